"""Where the real K3 reference data (shared/reference/kimi-k3) is: beside the checkout
(as CI lays it out), else K3_REFERENCE, else the development machine's /work/shared."""
from __future__ import annotations

import os
from pathlib import Path


def _find() -> Path:
    candidates = [Path(__file__).resolve().parents[2] / "shared" / "reference" / "kimi-k3"]
    if os.environ.get("K3_REFERENCE"):
        candidates.insert(0, Path(os.environ["K3_REFERENCE"]))
    candidates.append(Path("/work/shared/reference/kimi-k3"))
    for c in candidates:
        if (c / "config.json").exists():
            return c
    return candidates[0]  # tests that need it fail loudly, naming this path


REFERENCE: Path = _find()
