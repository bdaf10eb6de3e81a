"""Open a model under a memory budget: plan first (nothing loaded), then open with the
plan's options. The CLI and the app both come through here.

`memory` is what the user typed: "12G", a preset name, or "auto". The default, "all",
keeps every weight resident with no plan (the fixtures' case; the real K3 needs a budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import sizes as sz
from .config import load_config
from .model import Model, StreamOptions
from .planner import (DEFAULT_CONTEXT, Plan, make_plan, make_plan_default_lookahead,
                      tensor_sizes_from_dir)

__all__ = ["OpenedModel", "open_budgeted", "check_lookahead", "LookaheadError", "ALL_RESIDENT"]

ALL_RESIDENT = "all"



@dataclass
class OpenedModel:
    model: Model
    plan: Plan | None        # None when everything is resident without a plan
    options: StreamOptions


class LookaheadError(ValueError):
    """A lookahead setting the model cannot use."""


def check_lookahead(lookahead: int | None, n_experts: int, top_k: int) -> None:
    """0 (off) up to the experts of a layer: prefetching more than exist is a typo, not a
    setting (the engine would silently clamp it)."""
    if lookahead is None:
        return
    if lookahead < 0:
        raise LookaheadError(f"--lookahead must be >= 0 (0 turns it off), got {lookahead}")
    if lookahead > n_experts:
        raise LookaheadError(f"--lookahead {lookahead:,} is more than the {n_experts} routed experts of a "
                             f"layer; give 0 (off) to {n_experts} (the default is the top-k, {top_k})")


def open_budgeted(model_dir: str | Path, *, memory: str = ALL_RESIDENT,
                  context: int = DEFAULT_CONTEXT, lookahead: int | None = None,
                  threads: int = 1, scalar: bool = False,
                  check_machine: bool = True, speculative: int = 0) -> OpenedModel:
    """Plan `memory` for `context` tokens and open the model with that plan.

    lookahead None is k3chat's default: the model's top-k when the trunk is resident, off
    when it streams (see planner.make_plan_default_lookahead for the measurements); 0 turns
    it off. `speculative` (drafted tokens per verify pass) puts its verify record in the
    plan. Raises PlanError (with the numbers) when the budget cannot hold the model,
    MemorySizeError for a bad string.
    """
    cfg = load_config(model_dir)
    check_lookahead(lookahead, cfg.n_experts, cfg.top_k)
    if memory == ALL_RESIDENT:
        opts = StreamOptions(lookahead=cfg.top_k if lookahead is None else int(lookahead))
        return OpenedModel(Model(model_dir, threads=threads, scalar=scalar, streaming=opts), None, opts)
    budget = sz.parse_memory(memory)
    ts = tensor_sizes_from_dir(model_dir, cfg)
    machine = check_machine and not sz.is_auto(memory)
    # The budget is for the whole process (a cgroup limit counts all of it): the engine gets
    # what the process, measured as it stands, leaves.
    process = sz.process_reserve()
    if lookahead is None:
        plan = make_plan_default_lookahead(cfg, ts, budget, context, check_machine=machine,
                                           process_bytes=process, speculative=speculative)
    else:
        plan = make_plan(cfg, ts, budget, context, check_machine=machine, lookahead=int(lookahead),
                         process_bytes=process, speculative=speculative)
    opts = plan.stream_options()
    return OpenedModel(Model(model_dir, threads=threads, scalar=scalar, streaming=opts), plan, opts)
