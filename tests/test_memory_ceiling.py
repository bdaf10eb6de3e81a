"""The memory budget is a ceiling for the whole process (issue 12 item 15).

A user with a cgroup limit relies on it: the process's peak resident memory must stay under
`--memory`, interpreter, libraries, tokenizer and the app's widgets included. The checkpoint
here has enough expert bytes (384 experts of 417,792 B, 160 MB) that the plan fills the
budget and the engine's expert cache really grows to the size planned (evictions prove it).
Peaks are read in the process that ran: the engine's peak_rss stat (VmHWM) for
`k3chat run`, /proc/self/status VmHWM for the app, /health (the engine's peak_rss stat) for
`k3chat serve`.
"""
from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from k3engine import sizes as sz
from k3engine.bench import BenchShape, build_bench_checkpoint

BINDING = BenchShape(
    name="binding", hidden_size=64, kda_heads=2, kda_head_dim=16, mla_heads=2, q_lora_rank=32,
    kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=128,
    num_experts_per_token=8, routed_expert_hidden_size=512, moe_intermediate_size=512,
    intermediate_size=96, cache_slots=16)


@pytest.fixture(scope="module")
def big_experts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bench_checkpoint(tmp_path_factory.mktemp("ceiling") / "model", shape=BINDING)


def test_run_peak_rss_stays_under_the_budget(big_experts: Path, tmp_path: Path) -> None:
    budget = 96 * sz.MiB
    rng = random.Random(1)
    ids = ",".join(str(rng.randrange(1, 1024)) for _ in range(250))  # touches most experts
    out = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-m", "k3chat.cli", "run", str(big_experts), "--ids", ids, "--gen", "8",
         "--memory", str(budget), "--threads", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "K3CHAT_HOME": str(tmp_path / "home")},
        cwd=tmp_path)  # not the source tree: `-c` puts the cwd first on sys.path
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    plan, stats = res["plan"], res["stats"]
    assert stats["peak_rss_bytes"] <= budget, (stats["peak_rss_bytes"], budget)
    assert plan["total"] <= budget and plan["process_bytes"] > 0
    # the plan binds: the cache holds what was planned and had to evict to get there
    assert stats["expert_slots"] == plan["expert_slots"] and stats["cache_evictions"] > 0


APP_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys, time
    from k3chat.app import build_app
    from k3chat.settings import Settings

    model, budget, out = sys.argv[1], sys.argv[2], sys.argv[3]
    app = build_app(model, settings=Settings(max_tokens=96, effort="high"), memory=budget,
                    threads=2)
    # A long first message: its prefill routes through most of the experts.
    question = " ".join(f"word{i} number {i * 7} and the sum of {i} plus {i + 3}" for i in range(40))

    async def until(pilot, cond, what):
        start = time.monotonic()
        while not cond():
            if time.monotonic() - start > 300:
                raise SystemExit(f"timed out waiting for {what}")
            await pilot.pause(0.02)

    async def main():
        async with app.run_test(size=(150, 45)) as pilot:
            await until(pilot, lambda: app.ready, "the model to open")
            for text in (question, "And once more, shorter."):
                before = app.turns_over
                app.chat.prompt.set_text(text)
                await pilot.press("enter")
                await until(pilot, lambda: app.turns_over > before, "the turn to end")
            stats = app.engine.model.stats()
            plan = app.engine.plan.to_dict()
            await pilot.press("ctrl+q")
        return stats, plan

    stats, plan = asyncio.run(main())
    hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
    json.dump({"hwm": hwm, "errors": [str(e) for e in app.ui_errors], "stats": stats,
               "plan": plan}, open(out, "w"))
""")


def test_app_peak_rss_stays_under_the_budget(big_experts: Path, tmp_path: Path) -> None:
    pytest.importorskip("textual")
    budget = 128 * sz.MiB
    out = tmp_path / "app.json"
    done = subprocess.run(
        [sys.executable, "-c", APP_SCRIPT, str(big_experts), str(budget), str(out)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "K3CHAT_HOME": str(tmp_path / "home")},
        cwd=tmp_path)  # not the source tree: `-c` puts the cwd first on sys.path
    assert done.returncode == 0, done.stderr
    res = json.loads(out.read_text())
    plan, stats = res["plan"], res["stats"]
    assert res["errors"] == []
    assert res["hwm"] <= budget, (res["hwm"], budget)
    assert plan["total"] <= budget and plan["process_bytes"] > 0
    assert stats["expert_slots"] == plan["expert_slots"] and stats["cache_evictions"] > 0


def test_peak_rss_stat_is_the_processs_own_not_its_parents(tiny_dir: Path) -> None:
    # getrusage's ru_maxrss survives execve on Linux: a run started by a large process (this
    # test runner) reported the parent's size as its own peak. VmHWM starts afresh at exec.
    ballast = b"\x01" * (300 * sz.MiB)  # written, so resident in this (parent) process
    code = ("import json, sys; from k3engine.model import Model; "
            "m = Model(sys.argv[1]); m.forward([1, 2, 3]); "
            "print(json.dumps(m.stats()['peak_rss_bytes']))")
    done = subprocess.run([sys.executable, "-c", code, str(tiny_dir)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(ballast) == 300 * sz.MiB
    peak = int(done.stdout)
    assert 0 < peak < 200 * sz.MiB, peak  # a tiny model in a fresh interpreter: ~40 MiB


def _http(port: int, method: str, path: str, body: dict | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        data = json.loads(reply.read())
        assert reply.status == 200, data
        return data
    finally:
        conn.close()


def test_server_peak_rss_stays_under_the_budget(big_experts: Path, tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    from server_proc import ServerProc

    budget = 128 * sz.MiB
    prompt = " ".join(f"word{i} number {i * 7} and the sum of {i} plus {i + 3}" for i in range(40))
    with ServerProc([str(big_experts), "--memory", str(budget), "--threads", "2", "--context", "1024"],
                    tmp_path / "home", start_timeout=300) as srv:
        assert srv.port, srv.stderr
        for text in (prompt, "And once more, shorter."):  # two conversations: the pool keeps a state
            _http(srv.port, "POST", "/v1/completions", {"model": srv.model, "prompt": text, "max_tokens": 8})
        memory = _http(srv.port, "GET", "/health")["memory"]
        assert srv.stop() == 0, srv.stderr
    assert memory["plan_bytes"] is not None and memory["plan_bytes"] <= budget, memory
    assert 0 < memory["peak_rss_bytes"] <= budget, (memory, budget)
    # the plan binds: the expert cache filled the slots planned and had to evict
    assert memory["expert_slots"] > 0 and memory["cache_evictions"] > 0, memory
