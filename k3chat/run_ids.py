"""`k3chat run MODEL_DIR --ids ...`: greedy generation on raw token ids.

The first Ctrl-C (or SIGTERM) lets the step in flight finish, writes what was generated
(marked interrupted) and exits 5; a second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from . import paths
from .cli import EXIT_EXPERT_IO, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE
from .display import for_terminal


def _err(message: str) -> None:
    """A status line on standard error; messages quote paths and engine text: controls shown."""
    print(for_terminal(f"k3chat: {message}"), file=sys.stderr, flush=True)


class _StopRequest:
    """Signal handling: the first signal asks to stop after the step, the second exits."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            os._exit(EXIT_INTERRUPTED)
        self.requested.set()
        print(file=sys.stderr)
        _err("stopping after the current step (Ctrl-C again to quit now)")

    def __enter__(self) -> "_StopRequest":
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def greedy(logits: np.ndarray) -> int:
    """The first maximum (ties go to the lower id); a NaN or infinite logit is an engine fault
    (a weight or an activation overflowed), never a token."""
    bad = np.flatnonzero(~np.isfinite(logits))
    if bad.size:
        raise FloatingPointError(f"the engine produced a non-finite logit ({float(logits[bad[0]])} at id "
                                 f"{int(bad[0])}); the checkpoint or the computation is broken")
    return int(np.argmax(logits))


def _token_row(seconds: float, d: dict[str, int]) -> dict[str, Any]:
    """One decode step's figures: time, bytes read, cache behaviour, I/O wait vs compute."""
    io = d["io_wait_ns"] / 1e9
    return {"seconds": seconds, "trunk_bytes_read": d["trunk_bytes_read"],
            "expert_bytes_read": d["expert_bytes_read"], "cache_hits": d["cache_hits"],
            "cache_misses": d["cache_misses"], "cache_evictions": d["cache_evictions"],
            "lookahead_issued": d["lookahead_issued"], "lookahead_used": d["lookahead_used"],
            "lookahead_wasted": d["lookahead_wasted"], "io_wait_seconds": io,
            "compute_seconds": max(0.0, seconds - io), "peak_rss_bytes": d["peak_rss_bytes"]}


def _write_json(path: str, payload: dict[str, Any]) -> None:
    # Private (0600) and atomic through an unpredictable O_EXCL|O_NOFOLLOW temp file, like
    # every file k3chat writes: a planted symlink at "<path>.tmp" cannot redirect it.
    paths.atomic_write(Path(path), json.dumps(payload, allow_nan=False).encode("utf-8"))


def run_ids(args: argparse.Namespace) -> int:
    from k3engine.budgeted import open_budgeted
    from k3engine.errors import CheckpointError
    from k3engine.model import EngineError, ExpertReadError, stats_delta
    from k3engine.planner import PlanError
    from k3engine.sizes import MemorySizeError

    from .chat_cli import json_path_problem

    problem = json_path_problem(args.json_out)
    if problem is not None:
        _err(problem)
        return EXIT_USAGE
    threads = args.threads or os.cpu_count() or 1
    memory = args.memory or "auto"
    try:
        opened = open_budgeted(args.model_dir, memory=memory, context=len(args.ids) + args.gen,
                               lookahead=args.lookahead, threads=min(threads, 64), scalar=args.scalar)
        model = opened.model
    except (PlanError, MemorySizeError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    except ValueError as exc:
        _err(str(exc))
        return EXIT_USAGE
    except CheckpointError as exc:
        _err(f"cannot open {args.model_dir}:\n{exc}")
        return EXIT_USAGE
    except FileNotFoundError as exc:
        _err(str(exc))
        return EXIT_USAGE
    except EngineError as exc:
        _err(f"the engine refused {args.model_dir}: {exc}")
        return EXIT_EXPERT_IO if isinstance(exc, ExpertReadError) else EXIT_RUNTIME
    except MemoryError:
        _err(f"out of memory opening {args.model_dir}; try a smaller --memory")
        return EXIT_RUNTIME
    except (OSError, KeyError, TypeError) as exc:
        _err(f"cannot open {args.model_dir}: {exc}")
        return EXIT_USAGE
    bad = [i for i in args.ids if i >= model.vocab]
    if bad:
        _err(f"--ids has ids {bad[:5]} outside the vocabulary [0, {model.vocab})")
        return EXIT_USAGE
    generated: list[int] = []
    per_token: list[dict[str, Any]] = []
    prefill_stats: dict[str, int] = {}
    prefill_s = 0.0
    logits_first: list[float] = []
    step_seconds: list[float] = []
    interrupted = False
    code = EXIT_OK
    error: str | None = None
    with _StopRequest() as stop:
        try:
            session = model.session(len(args.ids) + args.gen)
            t0 = time.perf_counter()
            before = model.stats()
            logits = session.feed(args.ids)
            prefill_s = time.perf_counter() - t0
            prefill_stats = stats_delta(before, model.stats())
            # standard JSON has no Infinity/NaN: a non-finite logit is written as null (and fails below)
            logits_first = [float(x) if np.isfinite(x) else None for x in logits]
            for step in range(args.gen):
                tok = greedy(logits)
                generated.append(tok)
                if stop.requested.is_set():
                    interrupted = True
                    break
                if step + 1 == args.gen:
                    break
                t = time.perf_counter()
                before = model.stats()
                logits = session.feed([tok])
                step_seconds.append(time.perf_counter() - t)
                per_token.append(_token_row(step_seconds[-1], stats_delta(before, model.stats())))
        except ExpertReadError as exc:
            error, code = str(exc), EXIT_EXPERT_IO
        except (EngineError, FloatingPointError, MemoryError) as exc:
            error, code = str(exc), EXIT_RUNTIME
    if interrupted and code == EXIT_OK:
        code = EXIT_INTERRUPTED
    payload = {
        "prompt_ids": list(args.ids),
        "generated_ids": generated,
        "logits_first": logits_first,
        "seconds_per_token": (sum(step_seconds) / len(step_seconds)) if step_seconds else None,
        "prefill_seconds": prefill_s if logits_first else None,
        "interrupted": interrupted,
        "error": error,
        "threads": threads,
        "simd": model.simd_active,
        "stats": model.stats(),
        "prefill_stats": prefill_stats,
        "per_token": per_token,
        "memory": memory,
        "plan": opened.plan.to_dict() if opened.plan is not None else None,
        "lookahead": opened.options.lookahead,
    }
    if args.json_out:
        try:
            _write_json(args.json_out, payload)
        except OSError as exc:
            _err(f"cannot write {args.json_out}: {exc}")
            return code or EXIT_RUNTIME
    if error:
        _err(f"generation failed: {error}")
    print("generated:", ",".join(str(i) for i in generated))
    if payload["seconds_per_token"] is not None:
        print(f"{payload['seconds_per_token']:.4f} s/token over {len(step_seconds)} decode steps")
    return code
