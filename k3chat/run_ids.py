"""`k3chat run MODEL_DIR --ids ...`: greedy generation on raw token ids.

Stopping follows runtime.StopPolicy like every front-end: the first Ctrl-C (SIGTERM, SIGHUP)
lets the step in flight finish, the second aborts it between two layers; both still write
what was generated (marked interrupted) and exit 5. A third exits at once. Decoding runs on a
worker thread so that the main thread is always free to take the signals.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import paths
from .runtime import (EXIT_EXPERT_IO, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, Failure,
                      SignalStops, memory_option, open_model)
from .runtime import say as _err


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
    with SignalStops() as signals:  # until the exit code is known: a late signal is handled too
        try:
            return _run_ids(args, signals)
        except Failure as exc:
            _err(exc.message)
            return exc.code
        except KeyboardInterrupt:  # a second signal before decoding could start
            _err("interrupted before generation started; nothing was written")
            return EXIT_INTERRUPTED


def _run_ids(args: argparse.Namespace, signals: SignalStops) -> int:
    from k3engine.model import CancelFlag, Cancelled, EngineError, ExpertReadError, stats_delta

    from .chat_cli import _in_worker, json_path_problem

    problem = json_path_problem(args.json_out)
    if problem is not None:
        raise Failure(problem, EXIT_USAGE)
    memory = memory_option(args.memory, "auto")
    opened = open_model(args.model_dir, memory=memory, context=len(args.ids) + args.gen, threads=args.threads,
                        lookahead=args.lookahead, scalar=args.scalar, tokenizer=False)
    model = opened.model
    bad = [i for i in args.ids if i >= model.vocab]
    if bad:
        raise Failure(f"--ids has ids {bad[:5]} outside the vocabulary [0, {model.vocab})", EXIT_USAGE)
    generated: list[int] = []
    per_token: list[dict[str, Any]] = []
    prefill_stats: dict[str, int] = {}
    timing = {"prefill": 0.0}
    logits_first: list[float | None] = []
    step_seconds: list[float] = []
    cancel = CancelFlag()
    code = EXIT_OK
    error: str | None = None
    if signals.requested.is_set():
        raise KeyboardInterrupt

    def decode() -> None:
        session = model.session(len(args.ids) + args.gen)
        t0 = time.perf_counter()
        before = model.stats()
        logits = session.feed(args.ids, cancel=cancel)
        timing["prefill"] = time.perf_counter() - t0
        prefill_stats.update(stats_delta(before, model.stats()))
        # standard JSON has no Infinity/NaN: a non-finite logit is written as null (and fails below)
        logits_first.extend(float(x) if np.isfinite(x) else None for x in logits)
        for step in range(args.gen):
            tok = greedy(logits)
            generated.append(tok)
            if signals.requested.is_set() or step + 1 == args.gen:
                break
            t = time.perf_counter()
            before = model.stats()
            logits = session.feed([tok], cancel=cancel)
            step_seconds.append(time.perf_counter() - t)
            per_token.append(_token_row(step_seconds[-1], stats_delta(before, model.stats())))

    signals.policy.bind(abort_step=cancel.set)
    _err(f"generating {args.gen} token(s) from {len(args.ids)} prompt id(s) (Ctrl-C stops after the current step)")
    try:
        _in_worker(decode)
    except Cancelled:
        pass  # the second Ctrl-C stopped a step: what was generated before it is written
    except ExpertReadError as exc:
        error, code = str(exc), EXIT_EXPERT_IO
    except (EngineError, FloatingPointError, MemoryError) as exc:
        error, code = str(exc), EXIT_RUNTIME
    interrupted = signals.requested.is_set()
    signals.policy.finish()
    if interrupted and code == EXIT_OK:
        code = EXIT_INTERRUPTED
    payload = {
        "prompt_ids": list(args.ids),
        "generated_ids": generated,
        "logits_first": logits_first,
        "seconds_per_token": (sum(step_seconds) / len(step_seconds)) if step_seconds else None,
        "prefill_seconds": timing["prefill"] if logits_first else None,
        "interrupted": interrupted,
        "error": error,
        "threads": opened.threads,
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
