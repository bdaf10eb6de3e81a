"""`python -m k3chat.demo.recall_probe`: can the demo's shape learn to look a figure up by its label?

The demo model answers questions about a file about as often as picking one of the file's
two or three figures at random would (issue 7). This probe asks the one skill that needs,
alone: a fresh model of the demo's shape, with the demo's tokenizer, trains on nothing but
recall rows (`train.recall_batch`: a file of 2 to 6 labelled figures, then some of its
labels again, each to be followed by its own figure) and reports how often it writes the
right first digit, the id that only the label three ids back can tell (after "Boxes: " every
line's figure follows " "). Chance is about one in ten. One model per learning rate given,
each from the same seed on the same rows, with train-demo's warm-up and cosine schedule.
With --ffn-lr the feed-forward weights (train-demo --ffn-lr) learn at that share of each
rate. Prints the accuracy every 25 steps and writes JSON; asserts nothing about what it
measures. Needs torch.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from k3engine.exit_codes import EXIT_OK, EXIT_USAGE
from k3engine.private_files import write_private

from .train import DEMO_PRESET, build_tokenizer, cosine_factor, is_ffn_weight, recall_batch

RECALL_PROBE_VERSION = 2
REPORT_EVERY = 25


def _groups(model: Any, ffn_lr: float) -> list[dict[str, Any]]:
    """One group at the rate, or (with ``ffn_lr`` other than 1) the feed-forward weights apart."""
    if ffn_lr == 1.0:                   # as version 1 of the probe measured
        return [{"params": list(model.parameters()), "lr_scale": 1.0}]
    named = list(model.named_weights())
    return [{"params": [p for n, p in named if not is_ffn_weight(n)], "lr_scale": 1.0},
            {"params": [p for n, p in named if is_ffn_weight(n)], "lr_scale": ffn_lr}]


def probe_one(torch: Any, tok: Any, *, lr: float, steps: int, rows: int, seed: int,
              ffn_lr: float = 1.0) -> dict[str, Any]:
    """Train one fresh model on recall rows at peak ``lr``; the lookup accuracy step by step."""
    from k3engine.train.model import K3Torch

    torch.manual_seed(seed)
    bos, sep, pad = tok.special_id("[BOS]"), tok.special_id("<|sep|>"), tok.special_id("[PAD]")
    model = K3Torch(DEMO_PRESET, tok.vocab_size, seed=seed)
    opt = torch.optim.AdamW(_groups(model, ffn_lr), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, min(100, steps // 10))            # as train-demo ramps up
    rng = random.Random(seed ^ 0x4EC1)
    acc: list[float] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_scale"] * min(1.0, (step + 1) / warmup) * cosine_factor(step / max(1, steps - 1), 0.1)
        ids, target, lookup = recall_batch(torch, rng, tok, bos, sep, pad, rows)
        scored = target != -100
        logits = model(ids, [], rows=scored).float()
        loss = torch.nn.functional.cross_entropy(logits, target[scored])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # scored on the rows of this step, before the step learnt from them
        right = (logits.argmax(-1) == target[scored])[lookup[scored]]
        acc.append(float(right.float().mean()))
        losses.append(float(loss.detach()))
    every = [round(sum(acc[i:i + REPORT_EVERY]) / len(acc[i:i + REPORT_EVERY]), 4)
             for i in range(0, len(acc), REPORT_EVERY)]
    tail = acc[-50:]
    return {"lr": lr, "ffn_lr": ffn_lr, "lookup_accuracy_every_25": every, "final_lookup_accuracy": round(sum(tail) / len(tail), 4),
            "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4),
            "seconds": round(time.perf_counter() - t0, 1)}


def run_recall_probe(*, lrs: Sequence[float], steps: int, rows: int, threads: int, seed: int = 0,
                     ffn_lr: float = 1.0) -> dict[str, Any]:
    from k3engine.train import require_torch

    torch = require_torch()
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer(Path(tmp), seed)
    runs = [probe_one(torch, tok, lr=lr, steps=steps, rows=rows, seed=seed, ffn_lr=ffn_lr) for lr in lrs]
    return {"version": RECALL_PROBE_VERSION, "steps": steps, "rows": rows, "threads": threads, "ffn_lr": ffn_lr,
            "seed": seed, "torch": torch.__version__, "runs": runs}


def format_report(res: dict[str, Any]) -> str:
    lines = [f"first-digit lookups right, recall rows only ({res['rows']} rows a step, "
             f"{res['steps']} steps; chance about 0.1"
             + (f"; feed-forward weights at {res['ffn_lr']:g} of the rate" if res["ffn_lr"] != 1.0 else "")
             + f"), every {REPORT_EVERY} steps:"]
    for run in res["runs"]:
        curve = " ".join(f"{a:.2f}" for a in run["lookup_accuracy_every_25"])
        lines.append(f"  lr {run['lr']:g}: {curve}  (last 50 steps {run['final_lookup_accuracy']:.3f}, "
                     f"{run['seconds']:.0f} s)")
    return "\n".join(lines)


def _lrs(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3chat.demo.recall_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lr", default="3e-3,1e-3", help="peak learning rates, comma-separated, one model each "
                                                     "(default 3e-3,1e-3: train-demo's and a third of it)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rows", type=int, default=32, help="recall rows a step (default 32)")
    ap.add_argument("--ffn-lr", type=float, default=1.0, metavar="FRACTION",
                    help="the feed-forward weights learn at FRACTION of each rate (default 1), as "
                         "train-demo --ffn-lr")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", help="write the JSON result here")
    args = ap.parse_args(argv)
    try:
        lrs = _lrs(args.lr)
    except ValueError:
        lrs = []
    if not lrs or min(lrs) <= 0:
        print(f"recall_probe: --lr must be one or more positive numbers, comma-separated (got {args.lr!r})",
              file=sys.stderr)
        return EXIT_USAGE
    if not 0 < args.ffn_lr <= 1:
        print(f"recall_probe: --ffn-lr must be a fraction above 0 and at most 1 (got {args.ffn_lr})", file=sys.stderr)
        return EXIT_USAGE
    if min(args.steps, args.rows, args.threads) < 1:
        print("recall_probe: --steps, --rows and --threads must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    res = run_recall_probe(lrs=lrs, steps=args.steps, rows=args.rows, threads=args.threads, seed=args.seed,
                           ffn_lr=args.ffn_lr)
    print(format_report(res))
    if args.json_out:
        write_private(Path(args.json_out), json.dumps(res, indent=2) + "\n")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
