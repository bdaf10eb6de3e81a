"""Training the built-in demo model (an optional extra: ``pip install '.[train]'``).

The only place torch appears in k3chat. ``model.py`` is a second, independent
implementation of the K3 forward pass (spec k3-model.md section 5) written for training:
batched, differentiable, with the chunked form of Kimi Delta Attention (``kda.py``, with the
naive recurrence beside it). Its logits are tested against the float64 numpy oracle and the
C engine on the same random weights before it is trusted to train anything.
"""

from __future__ import annotations


def require_torch():  # -> module
    """Import torch or explain how to get it (the runtime never needs it)."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "training the demo model needs torch: pip install '.[train]' "
            "(torch==2.13.0, the CPU build)") from exc
    return torch
