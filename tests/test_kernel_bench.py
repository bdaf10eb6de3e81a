"""`python -m k3engine.kernel_bench` on small shapes: every field, both paths' bits compared,
the JSON written, usage errors refused (numbers are printed, never asserted)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from k3engine import kernel_bench
from k3engine.kernel_bench import KernelShape, run_kernel_bench

SMALL = (KernelShape("bf16 with a tail", "bf16", 19, 203), KernelShape("mxfp4", "mxfp4", 13, 96))


def test_kernel_bench_times_both_paths_and_compares_their_bits() -> None:
    res = run_kernel_bench(SMALL, tokens=(1, 9), threads=(1, 2), seconds=0.001, min_reps=1, peak_seconds=0.01)
    json.dumps(res)
    assert set(res["machine"]["fma_peak_gflops"]) == {"1", "2"}
    assert all(v is None or v > 0 for v in res["machine"]["fma_peak_gflops"].values())
    assert len(res["results"]) == 2 * 2 * 2 * 2  # shapes x tokens x threads x paths
    for r in res["results"]:
        assert r["path"] in ("per_token", "blocked") and r["reps"] >= 1
        assert r["gflops"] > 0 and math.isclose(r["gflops"], 2 * r["rows"] * r["cols"] * r["ntok"] / r["seconds_best"] / 1e9)
    assert len(res["ratios"]) == 8 and all(q["same_bits"] for q in res["ratios"]) and res["same_bits"]
    report = kernel_bench.format_kernel_report(res)
    assert "double multiply-add peak" in report and "bf16 with a tail" in report and "DIFF" not in report


def test_kernel_bench_main_writes_json_and_refuses_bad_arguments(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k.json"
    assert kernel_bench.main(["--json", str(out), "--tokens", "4", "--threads", "1", "--seconds", "0.001",
                              "--peak-seconds", "0.01"], shapes=SMALL) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["tokens"] == [4] and res["same_bits"] is True
    assert (out.stat().st_mode & 0o777) == 0o600
    assert "blocked" in capsys.readouterr().out
    for bad in (["--tokens", "0"], ["--tokens", "x"], ["--threads", "65"], ["--seconds", "0"], ["--bogus"]):
        assert kernel_bench.main(bad, shapes=SMALL) == 2
    assert "--tokens values must be 1..4096" in capsys.readouterr().err
