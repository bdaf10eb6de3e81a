"""`python -m k3engine.kernel_bench`: the prefill matmuls alone, at K3's real widths.

The full `k3chat bench` needs its 8 GB checkpoint; this needs none. It times the engine's
BF16 and MXFP4 matmul kernels (the k3_kernel_*_path entry points) on random weights of the
shapes K3 multiplies (spec k3-model.md section 4), for 1 token (decode) and 64 tokens (a
prefill chunk), on 1 thread and on every usable CPU, through both multi-token paths in one
run: the register-blocked kernels (kk_block_tok, the engine's default) and the path before
them, one token at a time. It prints and writes (JSON) GFLOP/s = 2 x rows x cols x tokens /
seconds (best of the repetitions), the blocked/per-token ratio, and the machine's double
multiply-add peak (k3_fma_peak_gflops) beside them; it also checks that both paths gave the
same bits. Nothing here is asserted about speed anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE
from .private_files import make_private_dirs, write_private

__all__ = ["KernelShape", "REAL_KERNEL_SHAPES", "run_kernel_bench", "format_kernel_report", "main"]

KERNEL_BENCH_VERSION = 1
Log = Callable[[str], None]


@dataclass(frozen=True)
class KernelShape:
    """One matrix the model multiplies: `rows` outputs of `cols`-wide dot products."""

    name: str
    kind: str  # "bf16" or "mxfp4"
    rows: int
    cols: int


# spec k3-model.md section 4: the shared MLP (trunk, BF16) and a routed expert (MXFP4)
REAL_KERNEL_SHAPES = (
    KernelShape("shared_experts.gate_proj", "bf16", 6144, 7168),
    KernelShape("shared_experts.down_proj", "bf16", 7168, 6144),
    KernelShape("experts.w1 (w3)", "mxfp4", 3072, 3584),
    KernelShape("experts.w2", "mxfp4", 3584, 3072),
)


def _lib() -> tuple[Any, Any]:
    from ._k3 import ffi, lib

    return ffi, lib


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Matmul:
    """Random weights of one shape, bound to its kernel; call(x, threads, blocked) -> y."""

    def __init__(self, shape: KernelShape, rng: np.random.Generator) -> None:
        from .bench import _bf16_from_f32, random_packed, random_scales

        self.shape = shape
        if shape.kind == "bf16":
            w = rng.standard_normal((shape.rows, shape.cols), dtype=np.float32) * np.float32(0.02)
            self.w16 = _bf16_from_f32(w.ravel()).reshape(shape.rows, shape.cols)
        elif shape.kind == "mxfp4":
            if shape.cols % 32:
                raise ValueError(f"{shape.name}: MXFP4 widths are multiples of 32, not {shape.cols}")
            self.packed = random_packed(rng, shape.rows, shape.cols // 2)
            self.scales = random_scales(rng, shape.rows, shape.cols // 32)
        else:
            raise ValueError(f"{shape.name}: kind must be bf16 or mxfp4, not {shape.kind!r}")

    def __call__(self, x: np.ndarray, threads: int, blocked: int) -> np.ndarray:
        ffi, lib = _lib()
        s = self.shape
        y = np.empty((x.shape[0], s.rows), dtype=np.float32)
        xb, yb = ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y)
        if s.kind == "bf16":
            rc = lib.k3_kernel_bf16_path(ffi.from_buffer("uint16_t[]", self.w16), s.rows, s.cols, xb, x.shape[0], yb,
                                         1, threads, blocked)
        else:
            rc = lib.k3_kernel_mxfp4_path(ffi.from_buffer("uint8_t[]", self.packed),
                                          ffi.from_buffer("uint8_t[]", self.scales), s.rows, s.cols, xb, x.shape[0],
                                          yb, 1, threads, blocked)
        if rc < 0:
            raise RuntimeError(f"{s.name}: the kernel refused its arguments (rc {rc})")
        return y


def _best_seconds(fn: Callable[[], object], seconds: float, min_reps: int) -> tuple[float, int]:
    """Best wall time of repeated calls: at least min_reps, and until `seconds` have passed."""
    best, reps, t_end = float("inf"), 0, time.perf_counter() + seconds
    while reps < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    return best, reps


def run_kernel_bench(shapes: Sequence[KernelShape] = REAL_KERNEL_SHAPES, *, tokens: Sequence[int] = (1, 64),
                     threads: Sequence[int] | None = None, seconds: float = 2.0, min_reps: int = 2,
                     peak_seconds: float = 1.0, seed: int = 0, log: Log | None = None) -> dict[str, Any]:
    """Time every shape x token count x thread count through both paths (see the module
    docstring); returns the JSON-ready result."""
    ffi, lib = _lib()
    say = log or (lambda _msg: None)
    cpus = _usable_cpus()
    thread_counts = sorted(set(threads)) if threads else sorted({1, cpus})
    if any(t < 1 or t > 64 for t in thread_counts) or any(n < 1 for n in tokens) or not seconds > 0:
        raise ValueError("threads must be 1..64, tokens >= 1 and seconds > 0")
    simd = ffi.string(lib.k3_simd_kind()).decode()
    peak: dict[str, float | None] = {}
    for th in thread_counts:
        say(f"measuring the double multiply-add peak on {th} thread(s)...")
        g = float(lib.k3_fma_peak_gflops(peak_seconds, th))
        peak[str(th)] = g if g > 0 else None
    rng = np.random.default_rng(seed)
    results: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    same_bits = True
    for shape in shapes:
        say(f"{shape.kind} {shape.name} [{shape.rows} x {shape.cols}]: generating weights...")
        mm = _Matmul(shape, rng)
        for ntok in tokens:
            x = rng.standard_normal((ntok, shape.cols), dtype=np.float32)
            for th in thread_counts:
                best: dict[str, float] = {}
                outs: dict[str, bytes] = {}
                for path, blocked in (("per_token", 0), ("blocked", 1)):
                    outs[path] = mm(x, th, blocked).tobytes()
                    t, reps = _best_seconds(lambda b=blocked: mm(x, th, b), seconds, min_reps)
                    gflops = 2.0 * shape.rows * shape.cols * ntok / t / 1e9
                    pk = peak.get(str(th))
                    best[path] = t
                    results.append({"kernel": shape.kind, "name": shape.name, "rows": shape.rows,
                                    "cols": shape.cols, "ntok": ntok, "threads": th, "path": path,
                                    "seconds_best": t, "reps": reps, "gflops": gflops,
                                    "vs_peak": gflops / pk if pk else None})
                    say(f"  {ntok:>3} tokens, {th} thread(s), {path:<9}: {gflops:7.2f} GFLOP/s")
                same = outs["per_token"] == outs["blocked"]
                same_bits = same_bits and same
                ratios.append({"kernel": shape.kind, "name": shape.name, "ntok": ntok, "threads": th,
                               "blocked_speedup": best["per_token"] / best["blocked"], "same_bits": same})
    return {
        "kernel_bench_version": KERNEL_BENCH_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "usable_cpus": cpus, "simd": simd,
                    "fma_peak_gflops": peak, "fma_peak_seconds": peak_seconds},
        "settings": {"tokens": list(tokens), "threads": thread_counts, "seconds_per_case": seconds,
                     "min_reps": min_reps, "seed": seed},
        "results": results,
        "ratios": ratios,
        "same_bits": same_bits,
        "labels": {
            "gflops": "2 x rows x cols x tokens / best wall seconds of one matmul call",
            "vs_peak": "gflops / fma_peak_gflops at the same thread count",
            "fma_peak_gflops": "independent double FMA chains (k3_fma_peak_gflops), 2 flops per multiply-add",
            "blocked_speedup": "per_token seconds / blocked seconds (same call, same inputs)",
            "same_bits": "the blocked and per-token outputs are the same bytes",
        },
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_kernel_report(res: dict[str, Any]) -> str:
    """A readable table of a `run_kernel_bench` result."""
    m = res["machine"]
    peaks = ", ".join(f"{_f(v, '.1f')} GFLOP/s on {k} thread(s)" for k, v in m["fma_peak_gflops"].items())
    lines = [f"double multiply-add peak ({m['simd']}): {peaks}", ""]
    head = (f"{'kernel':<6} {'matrix':<26} {'rows x cols':>12} {'tok':>4} {'thr':>3} "
            f"{'per-token':>10} {'blocked':>10} {'speedup':>7} {'vs peak':>7} {'bits':>5}")
    lines += [head, "-" * len(head)]
    by_key = {(r["name"], r["ntok"], r["threads"], r["path"]): r for r in res["results"]}
    for q in res["ratios"]:
        old = by_key[(q["name"], q["ntok"], q["threads"], "per_token")]
        new = by_key[(q["name"], q["ntok"], q["threads"], "blocked")]
        lines.append(f"{q['kernel']:<6} {q['name']:<26} {new['rows']:>5} x {new['cols']:<5} {q['ntok']:>4} "
                     f"{q['threads']:>3} {old['gflops']:>10.2f} {new['gflops']:>10.2f} "
                     f"{q['blocked_speedup']:>6.2f}x {_f(new['vs_peak'], '7.1%')} "
                     f"{'same' if q['same_bits'] else 'DIFF':>5}")
    lines.append("")
    lines.append("GFLOP/s = 2 x rows x cols x tokens / best seconds; per-token = the path before register "
                 "blocking; vs peak = blocked / the peak at the same thread count")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m k3engine.kernel_bench",
                                 description="Time the BF16 and MXFP4 matmul kernels at K3's widths, "
                                             "register-blocked against one token at a time.")
    ap.add_argument("--json", dest="json_out", help="write the JSON result here")
    ap.add_argument("--tokens", default="1,64", help="token counts, comma-separated (default 1,64)")
    ap.add_argument("--threads", default=None, help="thread counts, comma-separated (default: 1 and all usable)")
    ap.add_argument("--seconds", type=float, default=2.0, help="timing per case and path (default 2.0)")
    ap.add_argument("--peak-seconds", type=float, default=1.0, help="peak probe per thread count (default 1.0)")
    return ap


def _int_list(text: str, flag: str, lo: int, hi: int) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes integers separated by commas, not {text!r}") from None
    if not vals or any(v < lo or v > hi for v in vals):
        raise ValueError(f"{flag} values must be {lo}..{hi} (got {text!r})")
    return vals


def main(argv: Sequence[str] | None = None, *, shapes: Sequence[KernelShape] = REAL_KERNEL_SHAPES) -> int:
    """Exit 0 when done (and every output had the same bits both ways), 1 on a runtime
    failure or differing bits, 2 on a usage error, 5 when interrupted."""
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    try:
        tokens = _int_list(args.tokens, "--tokens", 1, 4096)
        threads = _int_list(args.threads, "--threads", 1, 64) if args.threads else None
        if not 0 < args.seconds <= 600 or not 0 < args.peak_seconds <= 60:
            raise ValueError("--seconds must be in (0, 600] and --peak-seconds in (0, 60]")
    except ValueError as exc:
        print(f"kernel_bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        res = run_kernel_bench(shapes, tokens=tokens, threads=threads, seconds=args.seconds, peak_seconds=args.peak_seconds,
                               log=lambda msg: print(msg, file=sys.stderr, flush=True))
        print(format_kernel_report(res))
        if args.json_out:
            out = Path(args.json_out)
            make_private_dirs(out.parent)
            write_private(out, json.dumps(res, indent=2) + "\n")
            print(f"JSON written to {out}")
    except KeyboardInterrupt:
        print("\nkernel_bench: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"kernel_bench: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    if not res["same_bits"]:
        print("kernel_bench: the blocked and per-token paths gave different bits (a bug: please report it)",
              file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
