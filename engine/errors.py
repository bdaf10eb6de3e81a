"""Exceptions raised by the strict checkpoint and config readers.

Every message says what is wrong (naming the file, field or tensor) and what to do about it,
because the user sees these messages verbatim when a model refuses to load.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CheckpointError", "ConfigError", "TensorSetError"]


class CheckpointError(Exception):
    """A checkpoint (index, shard header or tensor set) violates the contract; refuse to load."""


class ConfigError(CheckpointError):
    """`config.json` is missing, malformed, or fails the spec's assertions.

    All problems are collected first and reported together (spec 2.2), so the user can fix
    the file in one pass; `.problems` holds one line per problem for programmatic use.
    """

    problems: list[str]
    source: str

    def __init__(self, problems: Sequence[str] | str, source: str = "config.json") -> None:
        items = [problems] if isinstance(problems, str) else list(problems)
        self.problems = items
        self.source = source
        super().__init__(self._render(items, source))

    @staticmethod
    def _render(problems: list[str], source: str) -> str:
        count = len(problems)
        head = f"{source}: config refused ({count} problem{'s' if count != 1 else ''}):"
        body = "\n".join(f"  - {p}" for p in problems)
        advice = (
            "k3chat has no built-in defaults: fix these fields so the file matches the "
            "released Kimi K3 config.json (nested text_config / linear_attn_config / "
            "quantization_config shape), then retry."
        )
        return f"{head}\n{body}\n{advice}"


class TensorSetError(CheckpointError):
    """The checkpoint's language_model tensors do not match the catalogue for its config.

    The message summarises every problem; the full lists are kept here because the real
    model has half a million tensors and a message naming them all would be unreadable.
    """

    missing: list[str]  # tensor names
    extra: list[str]  # tensor names
    misshapen: list[str]  # one "name in shard: problem" line each

    def __init__(self, message: str, missing: Sequence[str], extra: Sequence[str],
                 misshapen: Sequence[str]) -> None:
        self.missing = list(missing)
        self.extra = list(extra)
        self.misshapen = list(misshapen)
        super().__init__(message)
