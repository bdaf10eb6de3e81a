"""Memory planner (design 2.3) on the real Kimi K3 config and index, and on the tiny fixture.

The K3 numbers asserted here come from the spec (k3-model.md sections 6 and 7), not from the
planner, so a wrong tensor table, dtype guess or state formula fails these tests.
"""
from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from k3engine import planner as pl
from k3engine import sizes as sz
from k3engine.config import load_config
from k3engine.errors import CheckpointError
from k3engine.safetensors_io import INDEX_NAME, open_checkpoint

REF = Path("/work/shared/reference/kimi-k3")
# Spec section 7 (as stored) and section 6.
K3_TRUNK = 108_811_694_848
K3_EMBED_LM_HEAD = 4_697_620_480
K3_LAYER0, K3_KDA_MOE, K3_MLA_MOE = 2_341_212_928, 1_267_742_208, 844_333_824
K3_EXPERT = 17_547_264
K3_KDA_STATE = 464_633_856
K3_MLA_PER_POSITION = 55_296


@pytest.fixture(scope="module")
def k3() -> tuple[object, pl.TensorSizes]:
    if not (REF / "config.json").exists():
        pytest.skip("reference K3 config not present")
    cfg = load_config(REF)
    return cfg, pl.tensor_sizes_from_dir(REF, cfg)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from k3engine.fixture import write_fixture

    return write_fixture("tiny", tmp_path_factory.mktemp("plan") / "tiny", with_oracle=False)


@pytest.fixture()
def fake_machine(monkeypatch: pytest.MonkeyPatch):
    """Replace the machine reader; returns a setter for what the machine 'has'."""
    state = {"m": sz.MachineMemory(total=64 * sz.GiB, available=48 * sz.GiB, swap_total=0,
                                   cgroup=None)}
    monkeypatch.setattr(sz, "read_machine_memory", lambda *a, **k: state["m"])

    def set_machine(m: sz.MachineMemory) -> None:
        state["m"] = m

    return set_machine


def check_invariants(plan: pl.Plan) -> None:
    """What every plan must satisfy, whatever the budget."""
    assert plan.total <= plan.budget
    assert plan.total == (plan.floor_bytes + plan.pinned_bytes
                          + plan.ring_slots * plan.ring_slot_bytes + plan.expert_cache_bytes)
    layers = set(plan.pinned_layers) | set(plan.streamed_layers)
    assert layers == set(range(len(plan.layer_bytes)))
    assert not set(plan.pinned_layers) & set(plan.streamed_layers)
    assert plan.pinned_bytes + plan.streamed_bytes == plan.trunk_bytes
    assert plan.expert_slots >= plan.min_expert_slots
    assert plan.expert_cache_bytes == plan.expert_slots * plan.expert_slot_bytes
    assert plan.expert_slot_bytes >= plan.expert_bytes
    if plan.trunk_resident:
        assert not plan.streamed_layers and plan.ring_slots == 0
    else:
        assert plan.streamed_layers and plan.ring_slots >= 2
        biggest_streamed = max(plan.layer_bytes[L] for L in plan.streamed_layers)
        assert plan.ring_slot_bytes >= biggest_streamed
        # "largest layers pinned": nothing streamed is bigger than anything pinned
        if plan.pinned_layers:
            assert min(plan.layer_bytes[L] for L in plan.pinned_layers) >= biggest_streamed
    # Leftover never holds a whole further slot unless every expert already has one.
    if plan.expert_slots < plan.experts_total:
        assert plan.budget - plan.total < plan.expert_slot_bytes


# ---------------------------------------------------------------------------------------
# Sizes of the real K3 from its config and index alone
# ---------------------------------------------------------------------------------------


def test_k3_sizes_match_the_spec(k3) -> None:
    cfg, ts = k3
    assert ts.source == "index + catalogue"
    assert ts.trunk_total == K3_TRUNK
    assert ts.embed + ts.lm_head == K3_EMBED_LM_HEAD
    assert ts.layer_trunk[0] == K3_LAYER0
    assert sorted(ts.layer_trunk[1:]).count(K3_KDA_MOE) == 68
    assert sorted(ts.layer_trunk[1:]).count(K3_MLA_MOE) == 24
    assert ts.expert_bytes == K3_EXPERT and ts.n_experts_total == 92 * 896
    assert pl.kda_state_bytes(cfg) == K3_KDA_STATE
    assert pl.mla_bytes_per_position(cfg) == K3_MLA_PER_POSITION


# ---------------------------------------------------------------------------------------
# Real K3 plans at 8, 16, 64 and 256 GiB (independent of this machine's RAM)
# ---------------------------------------------------------------------------------------


def test_k3_8g_is_refused_with_the_numbers(k3) -> None:
    """8 GiB cannot hold K3 under the design rules, whatever the context.

    Smallest plan at 8,192 tokens: floor = embeddings + lm_head 4.70 GB + KDA state 0.46 GB
    + one turn snapshot 0.46 GB + MLA cache 8,192 x 55,296 B = 0.45 GB + work and staging
    ~0.06 GB = 6.15 GB; trunk = everything streamed through 2 ring slots sized for layer 0
    (2.34 GB each, 4.68 GB; pinning layer 0 instead costs 2.34 + 2 x 1.27 = 4.88 GB); expert
    cache = 17 slots x 17.56 MB = 0.30 GB. Total 11.13 GB > 8.59 GB. Even with one token of
    context and no snapshot: 4.70 + 0.46 + 4.68 + 0.30 + ~0.03 = 10.2 GB.
    """
    cfg, ts = k3
    budget = sz.parse_memory("8G")
    with pytest.raises(pl.PlanError) as info:
        pl.make_plan(cfg, ts, budget, 8192, check_machine=False)
    err = info.value
    ring_slot = pl.slot_bytes(K3_LAYER0)
    floor = (K3_EMBED_LM_HEAD + 2 * K3_KDA_STATE + 8192 * K3_MLA_PER_POSITION)
    slots = 17 * pl.slot_bytes(K3_EXPERT)
    assert err.minimum is not None and err.minimum > budget
    assert err.minimum >= floor + 2 * ring_slot + slots
    assert err.minimum - (floor + 2 * ring_slot + slots) < 128 * sz.MiB  # work + staging + vectors
    assert err.max_context is None  # no context fits
    msg = str(err)
    for text in (f"{budget:,} B", f"{err.minimum:,} B", "layer 0", f"{K3_LAYER0:,} B",
                 "17 slots", "What to do", "--memory 11G", "smaller context does not help"):
        assert text in msg, text
    with pytest.raises(pl.PlanError):
        pl.make_plan(cfg, ts, budget, 1, check_machine=False, snapshots=0)


def test_k3_16g_pins_layer0_first_and_streams_the_rest(k3) -> None:
    cfg, ts = k3
    plan = pl.make_plan(cfg, ts, sz.parse_memory("medium"), 8192, check_machine=False)
    check_invariants(plan)
    assert not plan.trunk_resident
    assert 0 in plan.pinned_layers  # the biggest layer goes first (it also shrinks the ring)
    assert plan.ring_slots == 2 and plan.ring_slot_bytes == pl.slot_bytes(K3_KDA_MOE)
    assert plan.expert_slots >= 17
    _assert_trunk_first(plan)


def test_k3_64g_pins_part_of_the_trunk(k3) -> None:
    cfg, ts = k3
    plan = pl.make_plan(cfg, ts, sz.parse_memory("64G"), 8192, check_machine=False)
    check_invariants(plan)
    assert not plan.trunk_resident and plan.ring_slots >= 2
    assert 30 < len(plan.pinned_layers) < 93 and plan.streamed_layers
    assert plan.pinned_bytes > 50 * sz.GiB  # most of the budget went to the trunk
    _assert_trunk_first(plan)
    assert "pinned:" in plan.table() and "ring: 2 slots" in plan.table()


def test_k3_256g_trunk_resident_rest_is_expert_cache(k3) -> None:
    cfg, ts = k3
    budget = sz.parse_memory("256G")
    plan = pl.make_plan(cfg, ts, budget, 8192, check_machine=False)
    check_invariants(plan)
    assert plan.trunk_resident and plan.pinned_bytes == K3_TRUNK
    rest = budget - plan.floor_bytes - K3_TRUNK
    assert plan.expert_slots == rest // pl.slot_bytes(K3_EXPERT)
    assert plan.expert_slots > 8000
    table = plan.table()
    for text in ("embeddings", "lm_head", "KDA state", "MLA latent cache", "work buffers",
                 "prefill chunk of 64", "I/O staging", "resident (all layers)", "expert cache",
                 f"{K3_TRUNK:,} B"):
        assert text in table, text


def _assert_trunk_first(plan: pl.Plan) -> None:
    """Pinning one more layer would not fit beside the minimum expert cache."""
    room = plan.budget - plan.floor_bytes - plan.min_expert_slots * plan.expert_slot_bytes
    streamed = sorted(plan.streamed_layers, key=lambda L: -plan.layer_bytes[L])
    pinned = plan.pinned_bytes + plan.layer_bytes[streamed[0]]
    rest = streamed[1:]
    ring = 2 * pl.slot_bytes(plan.layer_bytes[rest[0]]) if rest else 0
    assert pinned + ring > room


def test_context_moves_bytes_from_expert_cache_to_floor(k3) -> None:
    cfg, ts = k3
    budget = sz.parse_memory("huge")
    short = pl.make_plan(cfg, ts, budget, 8192, check_machine=False)
    long = pl.make_plan(cfg, ts, budget, 131072, check_machine=False)
    check_invariants(long)
    assert long.mla_cache_bytes - short.mla_cache_bytes == (131072 - 8192) * K3_MLA_PER_POSITION
    grown = long.floor_bytes - short.floor_bytes
    assert grown > (131072 - 8192) * K3_MLA_PER_POSITION
    assert long.trunk_resident and long.pinned_bytes == short.pinned_bytes
    assert long.kda_state_bytes == short.kda_state_bytes  # KDA state is fixed
    lost = short.expert_cache_bytes - long.expert_cache_bytes
    assert lost > 0 and abs(lost - grown) < short.expert_slot_bytes  # whole slots only


def test_too_long_context_is_refused_with_the_largest_that_fits(k3) -> None:
    cfg, ts = k3
    budget = sz.parse_memory("16G")
    with pytest.raises(pl.PlanError) as info:
        pl.make_plan(cfg, ts, budget, 1 << 20, check_machine=False)
    best = info.value.max_context
    assert best is not None and 8192 < best < (1 << 20)
    assert f"at most {best:,} tokens" in str(info.value)
    check_invariants(pl.make_plan(cfg, ts, budget, best, check_machine=False))
    with pytest.raises(pl.PlanError):
        pl.make_plan(cfg, ts, budget, best + 1, check_machine=False)


# ---------------------------------------------------------------------------------------
# Memory strings and machine limits
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("12G", 12 * 2**30), ("512M", 512 * 2**20), ("1.5T", 3 * 2**39), ("12GiB", 12 * 2**30),
    ("12gi", 12 * 2**30), ("12 GiB", 12 * 2**30), ("12GB", 12 * 10**9), ("64k", 65536),
    ("123456", 123456), ("123456B", 123456), (" 8g ", 8 * 2**30),
    ("small", 8 * 2**30), ("medium", 16 * 2**30), ("large", 64 * 2**30), ("HUGE", 256 * 2**30),
])
def test_parse_memory(text: str, expected: int) -> None:
    assert sz.parse_memory(text) == expected


@pytest.mark.parametrize("text,fragment", [
    ("", "empty"), ("12X", "cannot read"), ("-1G", "cannot read"), ("0", "more than 0"),
    ("1.5", "whole number"), ("gigantic", "unknown memory preset"), ("12iB", "unit letter"),
    ("1e9", "cannot read"),
])
def test_parse_memory_refusals(text: str, fragment: str) -> None:
    with pytest.raises(sz.MemorySizeError) as info:
        sz.parse_memory(text)
    assert fragment in str(info.value)
    assert "12G" in str(info.value) or fragment in ("more than 0", "whole number", "unit letter")


def test_auto_uses_the_machine_limit() -> None:
    machine = sz.MachineMemory(total=32 * sz.GiB, available=20 * sz.GiB, swap_total=8 * sz.GiB,
                               cgroup=sz.CgroupMemory(2, "/x", 10 * sz.GiB, 2 * sz.GiB, 0))
    assert machine.limit == 8 * sz.GiB  # the cgroup headroom is tighter; swap never counts
    auto = sz.parse_memory("auto", machine)
    assert auto <= machine.limit and auto == int(8 * sz.GiB * 0.85) // (256 * sz.MiB) * 256 * sz.MiB


def test_machine_check_refuses_a_budget_above_available(tiny: Path, fake_machine) -> None:
    cfg = load_config(tiny)
    ts = pl.tensor_sizes_from_dir(tiny, cfg)
    fake_machine(sz.MachineMemory(total=16 * sz.GiB, available=100 * sz.MiB, swap_total=64 * sz.GiB,
                                  cgroup=None))
    with pytest.raises(pl.PlanError) as info:
        pl.make_plan(cfg, ts, 200 * sz.MiB, 1024)
    msg = str(info.value)
    assert "without swapping" in msg and f"{100 * sz.MiB:,} B" in msg and "--memory auto" in msg
    assert info.value.machine_limit == 100 * sz.MiB
    plan = pl.make_plan(cfg, ts, 64 * sz.MiB, 1024)  # below the limit: fine
    assert plan.machine_limit == 100 * sz.MiB
    assert pl.make_plan(cfg, ts, 200 * sz.MiB, 1024, check_machine=False).total <= 200 * sz.MiB
    # A cgroup limit binds even when MemAvailable is large.
    fake_machine(sz.MachineMemory(total=16 * sz.GiB, available=12 * sz.GiB, swap_total=0,
                                  cgroup=sz.CgroupMemory(1, "/m", 150 * sz.MiB, 60 * sz.MiB, 0)))
    with pytest.raises(pl.PlanError, match="cgroup v1 limit"):
        pl.make_plan(cfg, ts, 100 * sz.MiB, 1024)


def test_cgroup_v2_reader_takes_the_tightest_ancestor(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    leaf = root / "a" / "b"
    leaf.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "a" / "memory.max").write_text(f"{6 * sz.GiB}\n")
    (root / "a" / "memory.current").write_text(f"{1 * sz.GiB}\n")
    (leaf / "memory.max").write_text("max\n")
    (leaf / "memory.current").write_text(f"{sz.GiB}\n")
    (root / "a" / "memory.stat").write_text(f"anon 100\ninactive_file {512 * sz.MiB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    cg = sz.read_cgroup_memory(root, proc)
    assert cg is not None and cg.version == 2 and cg.limit == 6 * sz.GiB
    assert cg.headroom == 6 * sz.GiB - (sz.GiB - 512 * sz.MiB)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree: 100 kB\n"
                       "MemAvailable:   10240000 kB\nSwapTotal: 0 kB\n")
    m = sz.read_machine_memory(meminfo, root, proc)
    assert m.total == 16384000 * 1024 and m.available == 10240000 * 1024
    assert m.limit == min(m.available, cg.headroom)


def test_cgroup_v1_reader_and_unlimited(tmp_path: Path) -> None:
    mem = tmp_path / "cg" / "memory"
    (mem / "x").mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 "unlimited"
    (mem / "x" / "memory.limit_in_bytes").write_text(f"{2 * sz.GiB}\n")
    (mem / "x" / "memory.usage_in_bytes").write_text(f"{sz.GiB}\n")
    (mem / "x" / "memory.stat").write_text(f"total_inactive_file {256 * sz.MiB}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n0::/\n")
    cg = sz.read_cgroup_memory(tmp_path / "cg", proc)
    assert cg is not None and cg.version == 1 and cg.limit == 2 * sz.GiB
    assert cg.headroom == 2 * sz.GiB - (sz.GiB - 256 * sz.MiB)
    (mem / "x" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert sz.read_cgroup_memory(tmp_path / "cg", proc) is None


# ---------------------------------------------------------------------------------------
# Tiny fixture: shard headers, index-only estimates, `k3chat plan`
# ---------------------------------------------------------------------------------------


def test_tiny_sizes_from_headers_and_from_index_agree(tiny: Path, tmp_path: Path) -> None:
    cfg = load_config(tiny)
    from_headers = pl.tensor_sizes_from_dir(tiny, cfg)
    assert from_headers.source == "shard headers"
    ckpt = open_checkpoint(tiny)
    trunk = sum(t.nbytes for n, t in ckpt.tensors.items()
                if ".layers." in n and ".experts." not in n)
    assert from_headers.trunk_total == trunk
    # Without shards the planner guesses dtypes from the spec; the fixture follows the
    # release's dtypes, so the guess must land on the same bytes.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny / "config.json", bare)
    shutil.copy(tiny / INDEX_NAME, bare)
    from_index = pl.tensor_sizes_from_dir(bare, cfg)
    assert from_index.source == "index + catalogue"
    assert replace(from_index, source=from_headers.source) == from_headers


def test_index_that_does_not_match_config_is_refused(tiny: Path, tmp_path: Path) -> None:
    bare = tmp_path / "gz"
    bare.mkdir()
    shutil.copy(tiny / "config.json", bare)
    index = json.loads((tiny / INDEX_NAME).read_text())
    dropped = next(n for n in index["weight_map"]
                   if n.endswith("layers.2.self_attn.q_proj.weight"))
    del index["weight_map"][dropped]
    (bare / (INDEX_NAME + ".gz")).write_bytes(gzip.compress(json.dumps(index).encode()))
    with pytest.raises(CheckpointError, match="not listed"):
        pl.tensor_sizes_from_dir(bare)


def test_k3chat_plan_on_tiny_fixture(tiny: Path, tmp_path: Path, capsys, fake_machine) -> None:
    out = tmp_path / "plan.json"
    argv = [str(tiny), "--memory", "64M", "--context", "2048", "--json", str(out)]
    assert pl.main_plan(argv) == 0
    text = capsys.readouterr().out
    for part in ("floor total", "KDA state", "MLA latent cache", "2,048 positions",
                 "resident (all layers)", "expert cache", "total"):
        assert part in text, part
    data = json.loads(out.read_text())
    assert data["ok"] and data["plan"]["total"] <= 64 * sz.MiB
    assert data["plan"]["context"] == 2048 and data["plan"]["trunk_resident"] is True


def test_k3chat_plan_refusals_exit_2(tiny: Path, tmp_path: Path, capsys, fake_machine) -> None:
    assert pl.main_plan([str(tiny), "--memory", "1M"]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "1,048,576 B" in err and "What to do" in err
    assert pl.main_plan([str(tiny), "--memory", "lots"]) == 2
    assert "unknown memory preset" in capsys.readouterr().err
    assert pl.main_plan([str(tmp_path / "nowhere")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert pl.main_plan([str(tiny), "--context", "0"]) == 2
    # Above what the (fake) machine holds: refused, unless planning for another machine.
    fake_machine(sz.MachineMemory(total=sz.GiB, available=32 * sz.MiB, swap_total=0, cgroup=None))
    assert pl.main_plan([str(tiny), "--memory", "64M"]) == 2
    assert "without swapping" in capsys.readouterr().err
    assert pl.main_plan([str(tiny), "--memory", "64M", "--no-machine-check"]) == 0
