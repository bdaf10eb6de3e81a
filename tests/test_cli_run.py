"""`k3chat run MODEL_DIR --ids ...`: output, JSON contents and exit codes, as a user runs it."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest


def k3chat(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "k3chat.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_run_ids_matches_oracle(tiny_dir: Path, tiny_oracle: dict[str, np.ndarray], tmp_path: Path) -> None:
    prompt = [int(x) for x in tiny_oracle["prompt_ids"]]
    out = tmp_path / "run.json"
    r = k3chat("run", str(tiny_dir), "--ids", ",".join(map(str, prompt)), "--gen", "16", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["prompt_ids"] == prompt
    assert res["generated_ids"] == [int(x) for x in tiny_oracle["full_ids"][12:28]]
    first = np.array(res["logits_first"], dtype=np.float64)
    ref = tiny_oracle["logits"][11].astype(np.float64)
    assert first.shape == ref.shape
    assert np.abs(first - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())  # G6 (issue 10)
    assert res["seconds_per_token"] > 0
    assert res["interrupted"] is False and res["error"] is None


def test_readme_example_runs(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = k3chat("run", str(tiny_dir), "--ids", "3,7,11,5,9", "--gen", "16", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert len(json.loads(out.read_text())["generated_ids"]) == 16


@pytest.mark.parametrize("args,needle", [
    (["--ids", "1,x"], "comma-separated"),
    (["--ids", "1,2", "--gen", "0"], "positive"),
    (["--ids", "999999"], "outside the vocabulary"),
])
def test_usage_errors_exit_2(tiny_dir: Path, args: list[str], needle: str) -> None:
    r = k3chat("run", str(tiny_dir), *args)
    assert r.returncode == 2
    assert needle in r.stderr


def test_missing_model_dir_exits_2(tmp_path: Path) -> None:
    r = k3chat("run", str(tmp_path / "nope"), "--ids", "1,2")
    assert r.returncode == 2
    assert "config.json" in r.stderr


def test_corrupt_config_exits_2(tiny_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["text_config"]["hidden_size"]
    del cfg["text_config"]["rms_norm_eps"]
    (bad / "config.json").write_text(json.dumps(cfg))
    r = k3chat("run", str(bad), "--ids", "1,2")
    assert r.returncode == 2
    assert "hidden_size" in r.stderr and "rms_norm_eps" in r.stderr


def test_truncated_shard_exits_2(tiny_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "trunc"
    shutil.copytree(tiny_dir, bad)
    shard = sorted(bad.glob("model-00003-*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    r = k3chat("run", str(bad), "--ids", "1,2")
    assert r.returncode == 2
    assert shard.name in r.stderr


def test_sigint_finishes_step_and_exits_5(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "int.json"
    p = subprocess.Popen([sys.executable, "-m", "k3chat.cli", "run", str(tiny_dir), "--ids", "1,2,3",
                          "--gen", "200000", "--json", str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    line = p.stderr.readline()  # the model is open: a signal now stops generation, not opening
    assert "generating" in line, line
    time.sleep(1.0)
    assert p.poll() is None, "generation ended before the signal was sent"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 5, err
    res = json.loads(out.read_text())
    assert res["interrupted"] is True
    assert 0 < len(res["generated_ids"]) < 200000


def test_run_under_a_memory_budget_streams_and_reports_per_token(tiny_dir: Path, tiny_oracle: dict[str, np.ndarray],
                                                                tmp_path: Path) -> None:
    prompt = [int(x) for x in tiny_oracle["prompt_ids"]]
    ids = ",".join(map(str, prompt))
    # The smallest budget that plans streams the trunk and caches few experts. The budget
    # also covers the run process itself (measured by it), so ask that process: its refusal
    # names the minimum; 1 MiB above it absorbs the run-to-run jitter of its RSS.
    refused = k3chat("run", str(tiny_dir), "--ids", ids, "--gen", "8", "--memory", "1K")
    need = re.search(r"which needs [^(]*\(([\d,]+) B\)", refused.stderr)
    assert refused.returncode == 2 and need, refused.stderr
    budget = int(need.group(1).replace(",", "")) + (1 << 20)
    out = tmp_path / "m.json"
    r = k3chat("run", str(tiny_dir), "--ids", ids, "--gen", "8",
               "--memory", str(budget), "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["generated_ids"] == [int(x) for x in tiny_oracle["full_ids"][12:20]]
    assert res["plan"]["trunk_resident"] is False and res["plan"]["total"] <= budget
    assert len(res["per_token"]) == 7
    row = res["per_token"][0]
    assert row["trunk_bytes_read"] > 0  # the trunk streamed for this token
    assert set(row) >= {"expert_bytes_read", "cache_hits", "cache_misses", "io_wait_seconds",
                        "compute_seconds", "peak_rss_bytes", "lookahead_used"}
    assert res["stats"]["trunk_stream_reads"] > 0


def test_run_with_a_budget_too_small_is_refused_with_numbers(tiny_dir: Path) -> None:
    r = k3chat("run", str(tiny_dir), "--ids", "1,2", "--memory", "100K")
    assert r.returncode == 2
    assert "refused" in r.stderr and "What to do" in r.stderr


@pytest.mark.parametrize("cmd", [["plan", "{dir}", "--memory", "1G"], ["doctor", "--size-mb", "64", "--seconds", "0.2"]])
def test_plan_and_doctor_subcommands(tiny_dir: Path, tmp_path: Path, cmd: list[str]) -> None:
    args = [a.format(dir=tiny_dir) for a in cmd]
    if cmd[0] == "doctor":
        args += ["--dir", str(tmp_path)]
    r = k3chat(*args)
    assert r.returncode == 0, r.stderr
    assert ("memory plan" in r.stdout) if cmd[0] == "plan" else ("GB/s" in r.stdout)


def _poison_lm_head(src: Path, dst: Path, element: int, bits: int) -> None:
    """Copy a checkpoint and overwrite one BF16 element of lm_head in place."""
    from k3engine.writer import read_header

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"]["language_model.lm_head.weight"]
    entry = read_header(shard)["language_model.lm_head.weight"]
    with open(shard, "r+b") as f:
        header_len = int.from_bytes(f.read(8), "little")
        f.seek(8 + header_len + entry["data_offsets"][0] + 2 * element)
        f.write(bits.to_bytes(2, "little"))


@pytest.mark.parametrize("bits,name", [(0xFF80, "-inf"), (0x7F80, "inf"), (0x7FC0, "nan")])
def test_non_finite_logits_fail_instead_of_becoming_tokens(tiny_dir: Path, tmp_path: Path, bits: int,
                                                           name: str) -> None:
    bad = tmp_path / "bad"
    _poison_lm_head(tiny_dir, bad, 640, bits)   # the audit's case: row 5 of lm_head, column 0
    out = tmp_path / "r.json"
    r = k3chat("run", str(bad), "--ids", "1,2", "--gen", "3", "--json", str(out))
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "non-finite logit" in r.stderr
    res = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert res["error"] and "non-finite" in res["error"] and res["generated_ids"] == []
    assert res["logits_first"][640 // 128] is None     # element 640 = row 5 (hidden 128), col 0
