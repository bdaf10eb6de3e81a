"""`k3chat bench --speculative`: what exact speculative decoding costs and gains.

Two measurements, printed and written as JSON (nothing here is asserted anywhere):

1. **Verify bounds on the benchmark checkpoint** (engine/bench.py builds it; real widths,
   real expert size), with the trunk resident and streamed through a ring of 2 (page cache
   dropped before every pass, so a streamed trunk comes from the disk). From one prompt
   state: N serial decode steps (the greedy continuation t1..tN), then one verify pass of
   the same N positions (drafts all right: N tokens from one pass) and one of t1 followed by
   N-1 wrong ids (all wrong: one token from the pass). The verified logits are compared with
   the serial ones bit for bit. These are the two bounds of any real draft.
2. **The demo model end to end**: `Conversation` turns (greedy, thinking off) on a
   repeat-after-me prompt and a document-quote prompt, with N drafted tokens per pass and
   with speculation off: decode tokens/s (median of a few runs), drafted and kept tokens,
   and whether the generated ids equal the serial ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .private_files import write_private

__all__ = ["verify_bounds", "demo_speeds", "main_spec_bench", "DEMO_PROMPTS"]

RESULT_NAME = "bench-speculative.json"
# The demo model's own task phrasing (k3chat/demo/tasks.py, as in its prompts.jsonl)
DOCUMENT = ("A moon carries the garden in the morning. The small moon reads the tiny teacher. "
            "A train looks at the child in the morning.")
DEMO_PROMPTS = {
    "repeat-after-me": "Repeat after me: mississippi lemon pilot.",
    "document-quote": f"{DOCUMENT}\n\nRepeat this sentence: A moon carries the garden in the morning",
}
DEMO_MODES = ("off", "max")  # thinking off, and the default effort
Log = Callable[[str], None]


def _stats_delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    keys = ("trunk_bytes_read", "expert_bytes_read", "io_wait_ns", "cache_misses")
    return {k: int(b.get(k, 0)) - int(a.get(k, 0)) for k in keys}


def _timed(model: Any, fn: Callable[[], Any], before: Callable[[], None]) -> tuple[Any, float, dict[str, int]]:
    before()
    a = model.stats()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return out, dt, _stats_delta(a, model.stats())


def _pass_record(seconds: float, d: dict[str, int], tokens: int) -> dict[str, Any]:
    read = d["trunk_bytes_read"] + d["expert_bytes_read"]
    return {"seconds": seconds, "tokens": tokens, "s_per_token": seconds / tokens,
            "gb_read": read / 1e9, "expert_gb_read": d["expert_bytes_read"] / 1e9,
            "io_wait_s": d["io_wait_ns"] / 1e9}


def verify_bounds(directory: Path, ns: Sequence[int], *, threads: int, streamed: bool = True,
                  prompt_tokens: int = 8, log: Log | None = None) -> list[dict[str, Any]]:
    """Per trunk mode and N: N serial steps against one verify pass, drafts all right and all wrong."""
    from .bench import (BenchError, BenchShape, MARKER_NAME, _read_json, _shard_files, checkpoint_ready,
                        drop_page_cache)
    from .model import Model, StreamOptions

    say = log or (lambda _m: None)
    if not checkpoint_ready(directory):
        raise BenchError(f"{directory} holds no complete benchmark checkpoint; build it first with `k3chat bench` "
                         "(or measure the demo model alone: --demo-only)")
    from .config import load_config

    shape = BenchShape.from_dict(_read_json(directory / MARKER_NAME)["shape"])
    top_k = load_config(directory).top_k
    files = _shard_files(directory)
    rng = np.random.default_rng([shape.seed, 0x9E0])  # the prompt `k3chat bench` decodes after
    modes = [("resident", False)] + ([("streamed-ring2", True)] if streamed else [])
    out: list[dict[str, Any]] = []
    for mode, stream in modes:
        drop_page_cache(files)
        # lookahead as k3chat's default plans it: top-k with the trunk resident, off streamed
        opts = StreamOptions(expert_cache_bytes=shape.cache_slots * shape.slot_bytes, reader_threads=8,
                             lookahead=0 if stream else top_k, trunk_stream=stream, ring_slots=2)
        model = Model(directory, threads=threads, streaming=opts)
        cold = (lambda: drop_page_cache(files)) if stream else (lambda: None)
        try:
            prompt = [int(x) for x in rng.integers(0, model.vocab - 256, prompt_tokens)]
            sess = model.session(prompt_tokens + max(ns) + 2)
            logits0 = sess.feed(prompt)
            snap = sess.snapshot()
            for n in ns:
                say(f"{mode}: {n} serial steps, then verify passes of {n} positions ...")
                sess.restore(snap)
                tokens, rows, serial_s = [int(np.argmax(logits0))], [], []
                serial_read: dict[str, int] = {"trunk_bytes_read": 0, "expert_bytes_read": 0, "io_wait_ns": 0,
                                               "cache_misses": 0}
                for _ in range(n):
                    lg, dt, d = _timed(model, lambda: sess.feed([tokens[-1]]), cold)
                    rows.append(lg)
                    serial_s.append(dt)
                    serial_read = {k: serial_read[k] + d[k] for k in serial_read}
                    tokens.append(int(np.argmax(lg)))
                serial = _pass_record(sum(serial_s), serial_read, n)
                serial["s_per_step"] = serial_s
                sess.restore(snap)
                right_rows, right_s, right_d = _timed(model, lambda: sess.verify(tokens[:n]), cold)
                sess.accept(n)
                same = bool(np.stack(rows).tobytes() == right_rows.tobytes())
                sess.restore(snap)
                wrong = [tokens[0]] + [(t + 1) % model.vocab for t in tokens[1:n]]
                _, wrong_s, wrong_d = _timed(model, lambda: sess.verify(wrong), cold)
                sess.accept(1)
                right = _pass_record(right_s, right_d, n)
                wrong_rec = _pass_record(wrong_s, wrong_d, 1)
                out.append({"trunk": mode, "n": n, "serial": serial, "verify_all_right": right,
                            "verify_all_wrong": wrong_rec, "verified_logits_equal_serial": same,
                            "speedup_all_right": serial["s_per_token"] / right["s_per_token"],
                            "slowdown_all_wrong": wrong_rec["s_per_token"] / serial["s_per_token"]})
            sess.close()
        finally:
            model.close()
    return out


def demo_speeds(ns: Sequence[int], *, threads: int, repeats: int = 3, max_tokens: int = 256,
                log: Log | None = None) -> list[dict[str, Any]]:
    """Decode tokens/s of demo-model turns with speculation off (N = 0) and at each N."""
    from k3chat.conversation import Conversation
    from k3chat.demo import model_dir
    from k3chat.history import HistoryStore
    from k3chat.tokenizer import Tokenizer

    from .model import Model

    say = log or (lambda _m: None)
    d = model_dir()
    model = Model(d, threads=threads)
    tok = Tokenizer.from_dir(d)
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as home:  # the turns' history is thrown away
        os.environ["K3CHAT_HOME"] = home
        store = HistoryStore()
        try:
            for (name, text), mode in ((p, m) for p in DEMO_PROMPTS.items() for m in DEMO_MODES):
                serial_ids: list[int] | None = None
                for n in [0, *ns]:
                    say(f"demo model, {name}, thinking {mode}: speculative {n} ...")
                    speeds, cpu, row = [], [], {}
                    for _ in range(repeats):
                        conv = Conversation(model, tok, store, store.create("bench").id, thinking=mode != "off",
                                            effort=None if mode == "off" else mode, max_tokens=max_tokens,
                                            state_files=False, speculative=n)
                        c0 = time.process_time()  # CPU time: less at the mercy of a busy machine
                        r = conv.send(text)
                        cpu.append(time.process_time() - c0)
                        conv.close()
                        assert r is not None
                        speeds.append((r.generated_tokens - 1) / r.decode_seconds)
                        row = {"generated_tokens": r.generated_tokens, "draft_proposed": r.draft_proposed,
                               "draft_accepted": r.draft_accepted, "stop": r.stop, "answer": r.answer}
                        serial_ids = r.generated_ids if n == 0 else serial_ids
                        row["same_ids_as_serial"] = r.generated_ids == serial_ids
                    out.append({"prompt": name, "thinking": mode, "n": n,
                                "decode_tokens_per_s": statistics.median(speeds),
                                "turn_cpu_s": statistics.median(cpu),
                                "runs_tokens_per_s": speeds, **row})
        finally:
            model.close()
    return out


def format_spec_report(res: dict[str, Any]) -> str:
    lines = []
    if res.get("verify"):
        lines.append("verify N positions in one pass vs N serial steps (bench checkpoint, greedy)")
        lines.append(f"  {'trunk':<15} {'N':>3} {'serial s/tok':>12} {'right s/tok':>12} {'wrong s/tok':>12} "
                     f"{'pass s':>8} {'pass GB':>8} {'step GB':>8}  same bits")
        for r in res["verify"]:
            s, ok, bad = r["serial"], r["verify_all_right"], r["verify_all_wrong"]
            lines.append(f"  {r['trunk']:<15} {r['n']:>3} {s['s_per_token']:>12.3f} {ok['s_per_token']:>12.3f} "
                         f"{bad['s_per_token']:>12.3f} {ok['seconds']:>8.2f} {ok['gb_read']:>8.2f} "
                         f"{s['gb_read'] / s['tokens']:>8.2f}  {r['verified_logits_equal_serial']}")
    if res.get("demo"):
        lines.append("demo model, greedy: decode tokens/s and the turn's CPU seconds (medians)")
        for r in res["demo"]:
            kept = f"{r['draft_accepted']}/{r['draft_proposed']}" if r["n"] else "-"
            lines.append(f"  {r['prompt']:<16} thinking {r['thinking']:<4} N={r['n']:<2} "
                         f"{r['decode_tokens_per_s']:>8.1f} tok/s  turn CPU {r['turn_cpu_s']:.3f} s  "
                         f"drafts kept {kept:>7}  {r['generated_tokens']} tokens, same ids: "
                         f"{r['same_ids_as_serial']}")
    return "\n".join(lines)


def _ns(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated draft lengths, got {text!r}") from None
    if not values or any(not 1 <= v <= 64 for v in values):
        raise argparse.ArgumentTypeError(f"draft lengths must be 1..64, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    from .bench import default_bench_dir

    ap = argparse.ArgumentParser(prog="k3chat bench --speculative", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help=f"benchmark checkpoint directory (default: {default_bench_dir()})")
    ap.add_argument("--n", type=_ns, default=[4, 8], help="drafted tokens per pass to measure (default 4,8)")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: usable CPUs)")
    ap.add_argument("--repeats", type=int, default=3, help="demo turns per setting; the median is kept")
    ap.add_argument("--demo-only", action="store_true", help="only the demo model (no benchmark checkpoint)")
    ap.add_argument("--no-demo", action="store_true", help="only the benchmark checkpoint")
    ap.add_argument("--no-stream", action="store_true", help="skip the streamed-trunk configuration")
    ap.add_argument("--json", dest="json_out", help=f"write the JSON result here (default: ./{RESULT_NAME})")
    return ap


def main_spec_bench(argv: Sequence[str]) -> int:
    from .bench import default_bench_dir

    from .bench import BenchError
    from .exit_codes import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE

    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    threads = args.threads or len(os.sched_getaffinity(0))
    log: Log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    res: dict[str, Any] = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": threads,
                           "n": args.n}
    if not args.demo_only:
        d = Path(args.dir) if args.dir else default_bench_dir()
        res["checkpoint"] = str(d)
        try:
            res["verify"] = verify_bounds(d, args.n, threads=threads, streamed=not args.no_stream, log=log)
        except BenchError as exc:
            print(f"k3chat bench --speculative: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if not args.no_demo:
        res["demo"] = demo_speeds(args.n, threads=threads, repeats=args.repeats, log=log)
    print(format_spec_report(res))
    out = args.json_out or RESULT_NAME
    try:
        write_private(out, json.dumps(res, indent=2) + "\n")
    except OSError as exc:
        print(f"k3chat bench --speculative: cannot write {out}: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    print(f"wrote {out}")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main_spec_bench(sys.argv[1:]))
