"""What to tell the user when a message does not fit the session's context (no Textual).

A Conversation refuses such a message before anything is sent or saved (ContextOverflow).
``advise`` turns that refusal into the numbers a person can act on: the positions the turn
needs, a context that would hold them, and the smallest memory budget the planner
(k3engine.planner.minimum_budget) finds for that context. The CLI prints ``message``; the app
shows it and may offer to start the session again with ``suggested`` positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from k3engine.sizes import format_bytes

from .conversation import ContextOverflow, model_max_positions

CONTEXT_STEP = 1024  # a suggested context is rounded up to this, so a follow-up still fits


@dataclass(frozen=True)
class ContextAdvice:
    needed: int  # positions the turn needs: prompt + answer limit + 1 + what closes a cut answer
    prompt_tokens: int
    max_tokens: int
    context: int  # the session's context now
    suggested: int | None  # a context that holds the turn; None: more than the model's limit
    model_limit: int | None  # the model's max_position_embeddings, when known
    memory: int | None  # the planner's smallest budget for ``suggested`` (None: not planned)
    lookahead: int = 0  # what ``memory`` was planned with: the session plan's lookahead
    process_bytes: int = 0  # and its reserve for the process beside the engine

    def message(self, model_dir: str | Path) -> str:
        head = (f"the message does not fit the context: the turn needs {self.needed:,} positions "
                f"({self.prompt_tokens:,} prompt tokens + {self.max_tokens:,} for the answer + "
                f"{self.needed - self.prompt_tokens - self.max_tokens} kept to close it) and the session holds "
                f"{self.context:,}; nothing was sent or saved")
        if self.suggested is None:
            limit = f"{self.model_limit:,}" if self.model_limit is not None else "its limit"
            return (f"{head}. The model cannot hold that many positions (max_position_embeddings {limit}): "
                    "attach less, or a shorter part of the document, or lower --max-tokens")
        memory = ""
        if self.memory is not None:
            memory = (f", which needs at least {format_bytes(self.memory)} of memory by the planner "
                      f"(`k3chat plan {model_dir} --context {self.suggested}` shows the plan)")
        return (f"{head}. A context of {self.suggested:,} positions holds it{memory}. "
                f"What to do: run again with --context {self.suggested}"
                + (f" and a --memory of {memory_text(self.memory)} or more" if self.memory is not None else ""))


def memory_text(nbytes: int) -> str:
    """``nbytes`` rounded up to a --memory value one can type (tenths of a GiB, or MiB below one)."""
    if nbytes < 2**30:
        return f"{-(-nbytes // 2**20)}M"
    return f"{-(-nbytes * 10 // 2**30) / 10:g}G"


def suggested_context(needed: int, model_limit: int | None) -> int | None:
    """The context to suggest for ``needed`` positions: rounded up, capped at the model's limit."""
    rounded = -(-needed // CONTEXT_STEP) * CONTEXT_STEP
    if model_limit is None:
        return rounded
    if needed > model_limit:
        return None
    return min(rounded, model_limit)


def advise(overflow: ContextOverflow, model_dir: str | Path | None, *, lookahead: int = 0,
           process_bytes: int = 0) -> ContextAdvice:
    """The numbers for ``overflow``; the memory is planned the way the session's own plan was
    (its lookahead and the process's own reserve), when the model directory is known."""
    needed = overflow.prompt_tokens + overflow.max_tokens + 1 + overflow.reserve
    limit = model_max_positions(model_dir) if model_dir is not None else None
    suggested = suggested_context(needed, limit)
    memory = None
    if suggested is not None and model_dir is not None:
        memory = planned_minimum(model_dir, suggested, lookahead=lookahead, process_bytes=process_bytes)
    return ContextAdvice(needed=needed, prompt_tokens=overflow.prompt_tokens, max_tokens=overflow.max_tokens,
                         context=overflow.context, suggested=suggested, model_limit=limit, memory=memory,
                         lookahead=lookahead, process_bytes=process_bytes)


def planned_minimum(model_dir: str | Path, context: int, *, lookahead: int = 0, process_bytes: int = 0) -> int | None:
    """The planner's smallest budget for ``context`` positions (None if the checkpoint cannot
    be sized: the advice then leaves memory out rather than guess)."""
    from k3engine.config import load_config
    from k3engine.errors import CheckpointError
    from k3engine.planner import minimum_budget, tensor_sizes_from_dir

    try:
        cfg = load_config(model_dir)
        sizes = tensor_sizes_from_dir(model_dir, cfg)
    except (CheckpointError, OSError, ValueError):
        return None
    return minimum_budget(cfg, sizes, context, lookahead=lookahead, process_bytes=process_bytes)


__all__ = ["ContextAdvice", "advise", "suggested_context", "planned_minimum", "CONTEXT_STEP", "memory_text"]
