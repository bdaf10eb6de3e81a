"""`python -m k3chat.demo.step_bench`: seconds per training step, eager against --compile.

Times what one `train-demo` step does (forward on the scored rows, loss, backward, AdamW)
on the demo's own shape and training text, for the eager model and the compiled one
(`Kernels(compiled=True)`, what `train-demo --compile` trains with), in one run: each has
its own model and optimizer from the same seed, both are warmed up on the same batches
(the compiled one compiles then), and then they take turns on each timed batch, so that a
noisy machine slows both alike. Prints and writes (JSON) the median seconds per step of each
and their ratio. Needs torch (and, for the compiled side, a C++ compiler). Nothing here is
asserted about speed anywhere.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from k3engine.exit_codes import EXIT_OK, EXIT_USAGE
from k3engine.private_files import write_private

from . import corpus, tasks
from .train import DEMO_PRESET, build_tokenizer, collate, compile_unavailable, make_batches

STEP_BENCH_VERSION = 1


def run_step_bench(*, steps: int, warmup: int, threads: int, batch_tokens: int, seed: int = 0) -> dict[str, Any]:
    from k3engine.train import require_torch
    from k3engine.train.model import K3Torch

    torch = require_torch()
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(Path(tmp), seed)
    rng = random.Random(seed)
    seqs = [corpus.encode_conversation(tasks.training_conversation(rng), tok) for _ in range(4000)]
    batches = make_batches(seqs, batch_tokens, random.Random(seed + 1))[: warmup + steps]
    pad = tok.special_id("[PAD]")
    sides = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        model = K3Torch(DEMO_PRESET, tok.vocab_size, seed=seed, compiled=compiled)
        sides[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(name: str, idx: list[int]) -> float:
        model, opt = sides[name]
        ids, target = collate(torch, seqs, idx, pad)
        t0 = time.perf_counter()
        scored = target != -100
        loss = torch.nn.functional.cross_entropy(model(ids, [], rows=scored).float(), target[scored])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    t_warm = {name: sum(step(name, b) for b in batches[:warmup]) for name in sides}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for b in batches[warmup:]:
        for name in sides:
            times[name].append(step(name, b))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"version": STEP_BENCH_VERSION, "threads": threads, "batch_tokens": batch_tokens,
            "steps": len(batches) - warmup, "warmup_steps": warmup, "torch": torch.__version__,
            "warmup_seconds": {k: round(v, 2) for k, v in t_warm.items()},
            "seconds_per_step": {k: round(v, 4) for k, v in med.items()},
            "compiled_speedup": round(med["eager"] / med["compiled"], 3)}


def format_report(res: dict[str, Any]) -> str:
    s = res["seconds_per_step"]
    return (f"train-demo step ({res['batch_tokens']} tokens, {res['threads']} threads, median of "
            f"{res['steps']} after {res['warmup_steps']} warm-up):\n"
            f"  eager     {s['eager']:.3f} s/step (warm-up {res['warmup_seconds']['eager']:.0f} s)\n"
            f"  compiled  {s['compiled']:.3f} s/step (warm-up, compiling, {res['warmup_seconds']['compiled']:.0f} s)\n"
            f"  compiled is {res['compiled_speedup']:.2f}x as fast")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3chat.demo.step_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps of each (default 20)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first (default 8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--json", dest="json_out", help="write the JSON result here")
    args = ap.parse_args(argv)
    if min(args.steps, args.warmup, args.threads, args.batch_tokens) < 1:
        print("step_bench: --steps, --warmup, --threads and --batch-tokens must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    broken = compile_unavailable()
    if broken:
        print(f"step_bench: torch.compile does not work here ({broken}): install a C++ compiler (g++)",
              file=sys.stderr)
        return EXIT_USAGE
    res = run_step_bench(steps=args.steps, warmup=args.warmup, threads=args.threads,
                         batch_tokens=args.batch_tokens)
    print(format_report(res))
    if args.json_out:
        write_private(Path(args.json_out), json.dumps(res, indent=2) + "\n")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
