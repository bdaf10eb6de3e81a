"""Limits shared by the engine's planner and the chat side, defined once (stdlib only, so the
settings reader can import it without the planner)."""

from __future__ import annotations

import argparse

MAX_SPECULATIVE = 64  # drafted tokens per verify pass; the verify record grows with it


def positive_arg(text: str) -> int:
    """argparse type for a count that must be at least 1 (--threads, --port, --queue...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def speculative_arg(text: str) -> int:
    """argparse type for --speculative N: 0 (off) to MAX_SPECULATIVE."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of drafted tokens, got {text!r}") from None
    if not 0 <= value <= MAX_SPECULATIVE:
        raise argparse.ArgumentTypeError(f"expected 0 (off) to {MAX_SPECULATIVE} drafted tokens, got {value}")
    return value
