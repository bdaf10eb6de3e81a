"""The built-in demo model: a small Kimi K3 trained here, shipped as package data.

``tasks`` says what it was trained on and checks answers, ``corpus`` renders the training
text, ``train`` trains and exports it (torch, optional extra), ``evaluate`` scores it on
held-out questions through the C engine.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

DISPLAY_NAME = "k3chat demo"


def model_dir() -> Path:
    """The shipped demo checkpoint (a plain directory inside the installed package)."""
    return Path(str(files("k3chat.demo") / "k3chat-demo"))


def checkpoint_bytes(path: Path | None = None) -> int:
    d = path or model_dir()
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


def banner(path: Path | None = None) -> str:
    """One honest paragraph about the demo model, from its own files."""
    d = path or model_dir()
    size = checkpoint_bytes(d) / 1e6
    params = ""
    try:
        meta = json.loads((d / "training.json").read_text(encoding="utf-8"))
        params = f", {meta['parameters'] / 1e6:.1f} M parameters"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return (f"Built-in demo model: a tiny Kimi K3 ({size:.1f} MB{params}; 8 layers, KDA and MLA, "
            f"8 MXFP4 experts) trained on this project's own arithmetic and word puzzles: sums and "
            f"differences up to three digits, which of two numbers is larger, counting a letter, "
            f"reversing a word, repeating a sentence. It knows nothing else and is often wrong "
            f"(k3chat eval-demo measures it). For the real Kimi K3: "
            f"k3chat chat /path/to/Kimi-K3 (or set `model` in config.toml).")
