"""`k3chat bench`: the benchmark checkpoint's layout, its cache marker, the disk refusal, and a
run on the tiny shape through the same code path as the real one. No timing is asserted."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from k3engine import bench
from k3engine.bench import (MARKER_NAME, REAL_SHAPE, RESULT_NAME, TINY_SHAPE, BenchError, BenchShape,
                            build_bench_checkpoint, checkpoint_ready, plan_checkpoint, run_bench)
from k3engine.writer import EXPERT_PARTS, INDEX_NAME, Tensor, bf16_bits, check_experts, read_header

VOCAB = 1280  # the fixture tokenizer: 1024 ranks + 256 specials
PROBE_SMALL = 40 << 20  # just above two expert-sized reads: keeps the device probe quick


def _runs_from_header(header: dict[str, dict]) -> tuple[dict[int, list[tuple[str, int, int]]], list[tuple[int, int]]]:
    """Expert id -> its six (part, begin, end) in offset order; trunk spans in offset order."""
    experts: dict[int, list[tuple[str, int, int]]] = {}
    trunk: list[tuple[int, int]] = []
    for name, e in header.items():
        b, end = e["data_offsets"]
        if ".block_sparse_moe.experts." in name:
            rest = name.split(".block_sparse_moe.experts.")[1]
            eid, part = rest.split(".", 1)
            experts.setdefault(int(eid), []).append((part, b, end))
        else:
            trunk.append((b, end))
    for parts in experts.values():
        parts.sort(key=lambda x: x[1])
    trunk.sort()
    return experts, trunk


def _check_runs(experts: dict[int, list[tuple[str, int, int]]], trunk: list[tuple[int, int]],
                n_experts: int, expert_bytes: int) -> None:
    assert sorted(experts) == list(range(n_experts))
    for eid, parts in experts.items():
        assert [p for p, _, _ in parts] == list(EXPERT_PARTS), f"expert {eid} parts out of order"
        assert all(parts[i][2] == parts[i + 1][1] for i in range(5)), f"expert {eid} run has a gap"
        assert parts[-1][2] - parts[0][1] == expert_bytes
    assert all(trunk[i][1] == trunk[i + 1][0] for i in range(len(trunk) - 1)), "trunk run has a gap"
    trunk_lo, trunk_hi = trunk[0][0], trunk[-1][1]
    for parts in experts.values():  # no expert bytes inside the trunk run
        assert parts[-1][2] <= trunk_lo or parts[0][1] >= trunk_hi
    order = [eid for eid, _ in sorted(experts.items(), key=lambda kv: kv[1][0][1])]
    assert order != sorted(order), "expert runs must not be in id order"


# ------------------------------------------------------------------ the real shape, planned


def test_real_shape_arithmetic_and_layout() -> None:
    s = REAL_SHAPE
    assert s.expert_bytes == 17_547_264 == 3 * 3072 * 3584 * 17 // 32
    assert (s.hidden_size, s.kda_heads, s.kda_head_dim) == (7168, 96, 128)
    assert (s.mla_heads, s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim,
            s.v_head_dim) == (96, 1536, 512, 128, 64, 128)
    assert (s.routed_expert_hidden_size, s.moe_intermediate_size) == (3584, 3072)
    assert s.num_experts_per_token < s.cache_slots < s.num_experts  # forced streaming
    assert sorted(s.kda_layers + s.full_attn_layers) == list(range(1, s.num_hidden_layers + 1))
    plan = plan_checkpoint(s, VOCAB)  # headers only: nothing is generated
    assert len(plan.shards) == s.num_hidden_layers + 1
    assert 6e9 < plan.shard_bytes < 12e9  # "several GB"
    for L in s.moe_layers:
        sp = plan.shards[L]
        header = json.loads(sp.header)
        header.pop("__metadata__")
        experts, trunk = _runs_from_header(header)
        _check_runs(experts, trunk, s.num_experts, 17_547_264)
        assert header[f"language_model.model.layers.{L}.block_sparse_moe.experts.0.w1.weight_packed"]["shape"] == [3072, 1792]
        assert header[f"language_model.model.layers.{L}.block_sparse_moe.experts.0.w2.weight_scale"]["shape"] == [3584, 96]
    h0 = json.loads(plan.shards[0].header)
    assert h0["language_model.model.layers.0.self_attn.q_proj.weight"]["shape"] == [12288, 7168]
    assert h0["language_model.model.layers.0.mlp.gate_proj.weight"]["shape"] == [s.intermediate_size, 7168]
    h3 = json.loads(plan.shards[3].header)
    assert h3["language_model.model.layers.3.self_attn.q_b_proj.weight"]["shape"] == [96 * 192, 1536]
    assert h3["language_model.model.layers.3.self_attn.kv_b_proj.weight"]["shape"] == [96 * 256, 512]


def test_shape_refuses_a_cache_that_would_not_force_streaming() -> None:
    with pytest.raises(ValueError, match="forced streaming"):
        BenchShape(cache_slots=64)
    with pytest.raises(ValueError):
        BenchShape(cache_slots=16)  # no spare slot beyond the top-16


def test_fast_bf16_matches_the_writer() -> None:
    x = (np.random.default_rng(5).standard_normal(100_000, dtype=np.float32) * 0.02)
    x[:4] = [0.0, -0.0, 1.0, np.float32(1.0) + np.float32(2**-8)]  # a tie rounds to even
    assert np.array_equal(bench._bf16_from_f32(x), bf16_bits(x))


class _ZeroBytes:
    """An rng whose bytes are all zero: every MXFP4 group would decode to zeros."""

    def bytes(self, n: int) -> bytes:
        return b"\x00" * n


def test_random_packed_never_leaves_an_all_zero_group() -> None:
    packed = bench.random_packed(_ZeroBytes(), 4, 32)  # type: ignore[arg-type]
    groups = packed.reshape(-1, 16)
    assert ((groups & 0x77) != 0).any(axis=1).all()
    scales = bench.random_scales(np.random.default_rng(0), 64, 64)
    assert scales.min() >= 118 and scales.max() <= 123


# ------------------------------------------------------------------ the tiny shape, built


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bench") / "bench-v1"
    seen: list[tuple[int, int]] = []
    build_bench_checkpoint(d, shape=TINY_SHAPE, progress=lambda a, b: seen.append((a, b)))
    assert seen and seen[-1][0] == seen[-1][1]  # progress reached its total
    assert all(a <= b for a, b in seen)
    return d


def test_tiny_layout(tiny_bench: Path) -> None:
    s = TINY_SHAPE
    assert s.expert_bytes == 6528
    index = json.loads((tiny_bench / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-000005.safetensors" for i in range(1, 6)]
    total = 0
    for i, name in enumerate(shards):
        header = read_header(tiny_bench / name)
        assert set(header) == {k for k, v in index["weight_map"].items() if v == name}
        total += sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
        for key in header:  # shard L+1 holds all of layer L
            if ".layers." in key:
                assert key.split(".layers.")[1].split(".")[0] == str(i)
        if i in s.moe_layers:
            experts, trunk = _runs_from_header(header)
            _check_runs(experts, trunk, s.num_experts, s.expert_bytes)
    assert index["metadata"]["total_size"] == total
    cfg = json.loads((tiny_bench / "config.json").read_text())
    tc = cfg["text_config"]
    assert cfg["model_type"] == "kimi_k3" and tc["model_type"] == "kimi_linear"
    la = tc["linear_attn_config"]
    assert sorted(la["kda_layers"] + la["full_attn_layers"]) == [1, 2, 3, 4]
    assert la["full_attn_layers"] == [4]
    assert (tc["num_experts"], tc["num_experts_per_token"]) == (16, 4)
    assert (tiny_bench / "tiktoken.model").exists() and (tiny_bench / "tokenizer_config.json").exists()


def test_tiny_experts_pass_the_writers_mxfp4_checks(tiny_bench: Path) -> None:
    tensors = []
    for shard in sorted(tiny_bench.glob("model-*.safetensors")):
        raw = shard.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        for name, e in read_header(shard).items():
            if ".experts." in name:
                b, end = e["data_offsets"]
                data = raw[8 + n + b: 8 + n + end]
                tensors.append(Tensor(name, e["dtype"], tuple(e["shape"]), data))
                if name.endswith("weight_scale"):
                    sc = np.frombuffer(data, np.uint8)
                    assert sc.min() >= 118 and sc.max() <= 123
    assert len(tensors) == 3 * 16 * 6
    check_experts(tensors)  # no scale 255, no all-zero matrix


def test_model_opens_the_tiny_bench_and_generates(tiny_bench: Path) -> None:
    from k3engine.model import Model, StreamOptions

    def greedy(m: Model) -> tuple[list[int], list[bytes]]:
        sess = m.session(16)
        logits = sess.feed([5, 17, 300, 42, 9])
        out, rows = [], [logits.tobytes()]
        for _ in range(5):
            assert np.all(np.isfinite(logits))
            out.append(int(np.argmax(logits)))
            logits = sess.feed([out[-1]])
            rows.append(logits.tobytes())
        sess.close()
        return out, rows

    ref = greedy(Model(tiny_bench))
    slot = TINY_SHAPE.slot_bytes
    m = Model(tiny_bench, streaming=StreamOptions(expert_cache_bytes=TINY_SHAPE.cache_slots * slot, lookahead=4))
    got = greedy(m)
    assert m.stats()["expert_slots"] == TINY_SHAPE.cache_slots
    assert m.stats()["cache_evictions"] > 0
    assert got == ref  # streaming changes no bits


# ------------------------------------------------------------------ marker and cache


def test_marker_logic(tmp_path: Path) -> None:
    d = tmp_path / "b"
    build_bench_checkpoint(d, shape=TINY_SHAPE)
    assert checkpoint_ready(d, TINY_SHAPE)
    assert not checkpoint_ready(d, REAL_SHAPE)  # another shape is not this checkpoint

    calls: list[int] = []
    msgs: list[str] = []
    build_bench_checkpoint(d, shape=TINY_SHAPE, progress=lambda a, b: calls.append(a), log=msgs.append)
    assert not calls and "cached" in msgs[-1]  # complete: reused, nothing written

    (d / MARKER_NAME).unlink()  # as if the build had died before its last step
    assert not checkpoint_ready(d)
    with pytest.raises(BenchError, match="no complete benchmark checkpoint"):
        run_bench(d, probe=False)
    build_bench_checkpoint(d, shape=TINY_SHAPE, progress=lambda a, b: calls.append(a))
    assert calls and checkpoint_ready(d, TINY_SHAPE)  # rebuilt

    shard = d / "model-00002-of-000005.safetensors"
    with open(shard, "r+b") as f:  # a damaged (short) shard invalidates the marker too
        f.truncate(shard.stat().st_size - 1)
    assert not checkpoint_ready(d, TINY_SHAPE)
    build_bench_checkpoint(d, shape=TINY_SHAPE)
    assert checkpoint_ready(d, TINY_SHAPE)

    (d / MARKER_NAME).write_text("{not json")
    assert not checkpoint_ready(d)


def test_half_built_directory_is_rebuilt_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "b"

    def boom(*a: object, **k: object) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(bench, "_write_shard", boom)
    with pytest.raises(OSError):
        build_bench_checkpoint(d, shape=TINY_SHAPE)
    assert not checkpoint_ready(d) and not (d / MARKER_NAME).exists()
    monkeypatch.undo()
    build_bench_checkpoint(d, shape=TINY_SHAPE)
    assert checkpoint_ready(d, TINY_SHAPE)


def test_foreign_directory_is_refused_untouched(tmp_path: Path) -> None:
    d = tmp_path / "mine"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "notes.txt").write_text("keep me")
    with pytest.raises(BenchError, match="refusing to delete"):
        build_bench_checkpoint(d, shape=TINY_SHAPE)
    assert (d / "config.json").read_text() == "{}" and (d / "notes.txt").exists()


def test_insufficient_disk_is_refused_with_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "free_disk_bytes", lambda path: 123_456_789)
    d = tmp_path / "real"
    with pytest.raises(BenchError) as ei:
        build_bench_checkpoint(d)  # the real shape: several GB, refused before writing anything
    msg = str(ei.value)
    assert "123,456,789 B" in msg and "GB" in msg and "needs" in msg
    assert not d.exists() or not any(d.iterdir())


# ------------------------------------------------------------------ the run


def test_run_bench_tiny_returns_every_field(tiny_bench: Path) -> None:
    res = run_bench(tiny_bench, tokens=3, prompt_tokens=4, threads=1, lookahead=4,
                    probe_bytes=PROBE_SMALL, probe_seconds=0.02)
    json.dumps(res)  # JSON-ready
    for key in ("bench_version", "checkpoint", "machine", "settings", "device", "page_cache", "configs",
                "comparison", "same_tokens_across_configs", "labels"):
        assert key in res
    assert res["checkpoint"]["expert_bytes"] == 6528
    dev = res["device"]
    assert dev["source"] == "k3engine.doctor.probe_disk"
    if "error" not in dev:
        assert dev["qd1_gb_per_s"] > 0 and dev["qd8_gb_per_s"] > 0 and dev["read_bytes"] == 17_547_264
    assert isinstance(res["page_cache"]["dropped_between_configs"], bool)
    names = [c["name"] for c in res["configs"]]
    assert names == ["resident/lookahead=4", "resident/lookahead=0",
                     "streamed-ring2/lookahead=4", "streamed-ring2/lookahead=0"]
    assert res["same_tokens_across_configs"]
    for c in res["configs"]:
        dec = c["decode"]
        assert c["expert_slots"] == TINY_SHAPE.cache_slots < TINY_SHAPE.num_experts
        assert c["finite_logits"] and len(c["generated_ids"]) == 3 and len(c["per_token"]) == 3
        for k in ("s_per_token", "gb_read_per_token", "read_gb_per_s_wall", "io_wait_share",
                  "cache_hit_rate", "lookahead_used", "lookahead_wasted", "lookahead_issued",
                  "trunk_gb_per_token", "expert_gb_per_token", "read_gb_per_s_io_wait"):
            assert k in dec
        assert dec["s_per_token"] > 0 and math.isfinite(dec["s_per_token"])
        assert dec["expert_bytes_read"] > 0  # the cache is smaller than a layer: experts stream
        assert dec["gb_read_per_token"] > 0
        assert 0.0 <= dec["cache_hit_rate"] <= 1.0
        assert 0.0 <= dec["io_wait_share"] <= 1.05
        assert dec["cache_hits"] + dec["cache_misses"] == 3 * 3 * TINY_SHAPE.num_experts_per_token
        if c["lookahead"] == 0:
            assert dec["lookahead_issued"] == 0 and dec["lookahead_used"] == 0
        else:
            assert dec["lookahead_used"] + dec["lookahead_wasted"] <= dec["lookahead_issued"]
        if c["trunk_stream"]:
            assert dec["trunk_stream_reads"] > 0 and dec["trunk_bytes_read"] > 0
        else:
            assert dec["trunk_bytes_read"] == 0
        assert c["prefill"]["tokens"] == 4
        pf = c["prefill"]  # compute: the engine's multiply-add counter over the prompt's wall time
        assert pf["matmul_madds"] > 0 and pf["tokens_per_s"] > 0
        assert math.isclose(pf["matmul_gflops"], 2 * pf["matmul_madds"] / 1e9 / pf["seconds"])
        assert math.isclose(pf["matmul_gflops_vs_peak"], pf["matmul_gflops"] / res["machine"]["fma_peak"]["gflops_run_threads"])
    peak = res["machine"]["fma_peak"]
    assert peak["gflops_1_threads"] > 0 and peak["gflops_run_threads"] == peak["gflops_1_threads"]  # threads=1
    by = {c["name"]: c["prefill"]["matmul_madds"] for c in res["configs"]}
    # the same prompt does the same matmuls whether the trunk streams; the lookahead adds its router's
    assert by["resident/lookahead=0"] == by["streamed-ring2/lookahead=0"] < by["resident/lookahead=4"]
    assert "resident: lookahead speedup (s/token off / on)" in res["comparison"]
    if "error" not in dev:  # the device's best depth is the fastest phase the probe measured
        assert dev["best_gb_per_s"] == max(p["gb_per_s"] for p in dev["phases"])
        assert dev["best_queue_depth"] in [p["queue_depth"] for p in dev["phases"]]
    for c in res["configs"]:  # against the disk, from the raw figures of the run
        cmp_, dec, pf = res["comparison"][c["name"]], c["decode"], c["prefill"]
        times = [t["s"] for t in c["per_token"]]
        assert math.isclose(cmp_["steady_s_per_token"], sum(times[1:]) / len(times[1:]))
        assert math.isclose(cmp_["end_to_end_s_per_token"], (pf["seconds"] + sum(times)) / 3)
        assert cmp_["io_wait_share"] == dec["io_wait_share"]
        if "error" not in dev:
            bound = dec["bytes_read"] / 3 / 1e9 / dev["best_gb_per_s"]
            assert math.isclose(cmp_["disk_bound_s_per_token"], bound)
            assert math.isclose(cmp_["steady_vs_disk_bound"], cmp_["steady_s_per_token"] / bound)
            assert math.isclose(cmp_["read_vs_device_best"], dec["read_gb_per_s_wall"] / dev["best_gb_per_s"])
            assert math.isclose(cmp_["prefill_read_vs_device_best"],
                                pf["bytes_read"] / 1e9 / pf["seconds"] / dev["best_gb_per_s"])
    assert res["settings"]["trunk_readers"] == 1 and res["settings"]["trunk_piece_bytes"] == 0
    report = bench.format_report(res)
    assert "resident/lookahead=4" in report and "against the disk" in report
    assert "double multiply-add peak" in report and " tok/s, matmuls " in report and "of peak)" in report


def test_main_bench_writes_json_and_exit_codes(tiny_bench: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = bench.main_bench(["--dir", str(tiny_bench), "--tokens", "2", "--threads", "1", "--no-stream",
                           "--lookahead", "4", "--json", str(out), "--probe-mb", "40", "--probe-seconds", "0.02"],
                          shape=TINY_SHAPE)
    assert rc == 0
    res = json.loads(out.read_text())
    assert [c["name"] for c in res["configs"]] == ["resident/lookahead=4", "resident/lookahead=0"]
    assert "s/token" in capsys.readouterr().out
    assert bench.main_bench(["--tokens", "0"]) == 2
    assert bench.main_bench(["--bogus"]) == 2
    assert bench.main_bench(["--probe-mb", "1"]) == 2
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("x")
    assert bench.main_bench(["--dir", str(foreign)], shape=TINY_SHAPE) == 1
    assert RESULT_NAME not in os.listdir(foreign)


def test_bench_prefill_chunk_is_passed_to_the_engine(tiny_bench: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`--prefill-chunk` reaches the engine: with a cache smaller than a layer's experts a
    one-token chunk re-reads experts a whole-prompt chunk reads once; both are reported."""
    read = {}
    for chunk in (1, 6):
        res = run_bench(tiny_bench, tokens=1, prompt_tokens=6, threads=1, lookahead=0,
                        streamed=False, probe=False, prefill_chunk=chunk)
        assert res["settings"]["prefill_chunk"] == chunk
        read[chunk] = res["configs"][0]["prefill"]["expert_bytes_read"]
        assert f"in chunks of {chunk}," in bench.format_report(res)
        assert f"expert bytes read {read[chunk]:,}" in bench.format_report(res)
    assert 0 < read[6] < read[1]
    assert bench.main_bench(["--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk must be >= 1" in capsys.readouterr().err


def test_speculative_bench_verifies_with_serial_bits_and_writes_json(tiny_bench: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`k3chat bench --speculative` on the tiny shape: one pass of N positions against N serial
    steps, drafts all right and all wrong, trunk resident and streamed (no timing asserted)."""
    out = tmp_path / "spec.json"
    assert bench.main_bench(["--speculative", "--dir", str(tiny_bench), "--n", "3", "--threads", "1",
                             "--no-demo", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["trunk"], r["n"]) for r in res["verify"]] == [("resident", 3), ("streamed-ring2", 3)]
    for r in res["verify"]:
        assert r["verified_logits_equal_serial"] is True
        assert (r["serial"]["tokens"], r["verify_all_right"]["tokens"], r["verify_all_wrong"]["tokens"]) == (3, 3, 1)
    assert "verify N positions in one pass" in capsys.readouterr().out
    assert bench.main_bench(["--speculative", "--dir", str(tmp_path / "none"), "--no-demo"]) == 2
