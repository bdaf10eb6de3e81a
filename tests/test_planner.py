"""Memory planner (design 2.3) on the real Kimi K3 config and index, and on the tiny fixture.

The K3 numbers asserted here come from the spec (k3-model.md sections 3.3, 6 and 7), not from
the planner, so a wrong tensor table, dtype guess, unit split or state formula fails these
tests. The tiny fixture checks the plan against the C engine itself: the options a plan gives
open a model that streams, and the ring bound covers the engine's real unit layout.
"""
from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from k3engine import planner as pl
from k3engine import sizes as sz
from k3engine.config import load_config
from k3engine.errors import CheckpointError
from k3engine.safetensors_io import INDEX_NAME, open_checkpoint

from reference import REFERENCE as REF
# Spec section 7 (as stored) and section 6.
K3_TRUNK = 108_811_694_848
K3_EMBED_LM_HEAD = 4_697_620_480
K3_LAYER0, K3_KDA_MOE, K3_MLA_MOE = 2_341_212_928, 1_267_742_208, 844_333_824
K3_EXPERT = 17_547_264
K3_KDA_STATE = 464_633_856
K3_MLA_PER_POSITION = 55_296
# Streaming units from the shapes of spec 3.3 (BF16 matrices, 2 B per element).
E, P, D = 7168, 12288, 128
K3_KDA_ATTN = (4 * P * E + E * P + D * E + P * D + 96 * E) * 2  # q k v g, o, f_a, f_b, b
K3_MLA_ATTN = (1536 * E + 18432 * 1536 + 576 * E + 24576 * 512 + P * E + E * P) * 2
K3_DENSE_FFN = 3 * 33792 * E * 2  # layer 0: gate, up, down
K3_ROUTER = 896 * E * 2
K3_MOE_FFN = K3_ROUTER + (2 * 3584 * E + 3 * 6144 * E) * 2  # router, latent down/up, shared
K3_ROW = E * 2  # one embedding row
# A layer's matrices (what pinning holds and streaming reads): attention + FFN units.
K3_LAYER0_MATRICES = K3_KDA_ATTN + K3_DENSE_FFN
K3_KDA_MATRICES = K3_KDA_ATTN + K3_MOE_FFN
K3_MLA_MATRICES = K3_MLA_ATTN + K3_MOE_FFN
# Small vectors, held as fp32 for every layer: 4 norms + 2 AttnRes [1, E] per layer; KDA
# conv x3, dt_bias, A_log (128, padded), o_norm; MLA q_a / kv_a norms; MoE bias, latent norm.
K3_VECTORS_FP32 = 4 * (93 * 6 * E + 69 * (3 * P * 4 + P + 128 + D) + 24 * (1536 + 512)
                       + 92 * (896 + 3584))
# ... and as stored (conv, dt_bias, A_log F32, the rest BF16): the trunk minus its matrices.
K3_VECTORS_STORED = (93 * 6 * E * 2 + 69 * (3 * P * 4 * 4 + P * 4 + 128 * 4 + D * 2)
                     + 24 * (1536 + 512) * 2 + 92 * (896 + 3584) * 2)


def page(n: int) -> int:
    return -(-n // 4096) * 4096


def ring_bound(nbytes: int, tensors: int) -> int:
    """Spec bound for a ring slot: unit bytes + 64 B per tensor, whole pages."""
    return page(nbytes + 64 * tensors)


EXPERT_SLOT = page(K3_EXPERT + 2 * 4096)  # the C store's cap


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


# What `k3chat plan` sets aside for the process in these in-process calls (the pytest process
# itself is larger and varies): a fixed, typical front-end reserve.
PROCESS = 72 * sz.MiB


@pytest.fixture
def fixed_process(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sz, "process_reserve", lambda: PROCESS)
    return PROCESS


def check_invariants(plan: pl.Plan) -> None:
    """What every plan must satisfy, whatever the budget."""
    assert plan.total <= plan.budget and plan.open_peak_bytes <= plan.budget
    assert plan.total == (plan.floor_bytes + plan.pinned_bytes + plan.router_bytes
                          + plan.ring_slots * plan.ring_slot_bytes + plan.expert_cache_bytes)
    layers = set(plan.pinned_layers) | set(plan.streamed_layers)
    assert layers == set(range(len(plan.layer_bytes)))
    assert not set(plan.pinned_layers) & set(plan.streamed_layers)
    assert plan.pinned_bytes == sum(plan.layer_matrix_bytes[L] for L in plan.pinned_layers)
    assert plan.pinned_bytes + plan.streamed_bytes + plan.router_bytes == plan.trunk_matrix_bytes
    assert plan.expert_slots >= plan.min_expert_slots
    assert plan.expert_cache_bytes == plan.expert_slots * plan.expert_slot_bytes
    assert plan.expert_slot_bytes >= plan.expert_bytes + 2 * 4096
    if plan.trunk_resident:
        assert not plan.streamed_layers and plan.ring_slots == 0 and plan.router_bytes == 0
    else:
        assert plan.streamed_layers and plan.ring_slots >= 2
        assert plan.embed_stream and plan.embed_bytes == plan.embed_row_bytes
        # the ring holds the largest streamed unit (attention or FFN), not a whole layer
        biggest_unit = max(max(plan.layer_unit_slots[L]) for L in plan.streamed_layers)
        assert plan.ring_slot_bytes == biggest_unit
        assert plan.ring_slot_bytes >= plan.ring_unit_bytes + 64 * plan.ring_unit_tensors
        # "largest layers pinned": nothing streamed is bigger than anything pinned
        if plan.pinned_layers:
            assert (min(plan.layer_matrix_bytes[L] for L in plan.pinned_layers)
                    >= max(plan.layer_matrix_bytes[L] for L in plan.streamed_layers))
    if not plan.embed_stream:
        assert plan.trunk_resident and plan.embed_bytes == plan.embed_table_bytes
    # Leftover never holds a whole further slot unless every expert already has one.
    if plan.expert_slots < plan.experts_total:
        assert plan.budget - plan.total < plan.expert_slot_bytes
    # The engine options say the same thing.
    opts = plan.engine_options()
    assert opts["expert_cache_bytes"] == plan.expert_cache_bytes
    assert opts["trunk_stream"] is (not plan.trunk_resident)
    assert opts["embed_stream"] is plan.embed_stream and opts["lookahead"] == plan.lookahead
    assert opts["pinned"] == plan.pinned_layers
    if not plan.trunk_resident:
        assert opts["ring_slots"] == plan.ring_slots


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
    # the units the engine streams
    assert (ts.layer_attn[0], ts.layer_attn_count[0]) == (K3_KDA_ATTN, 8)
    assert (ts.layer_ffn[0], ts.layer_ffn_count[0], ts.layer_router[0]) == (K3_DENSE_FFN, 3, 0)
    assert K3_DENSE_FFN == 1_453_326_336
    for L in range(1, 93):
        mla = cfg.is_mla(L)
        assert (ts.layer_attn[L], ts.layer_attn_count[L]) == ((K3_MLA_ATTN, 6) if mla
                                                              else (K3_KDA_ATTN, 8))
        assert (ts.layer_ffn[L], ts.layer_ffn_count[L]) == (K3_MOE_FFN, 6)
        assert ts.layer_router[L] == K3_ROUTER
    assert sum(ts.layer_vectors) + ts.model_vectors == K3_VECTORS_FP32 + 4 * 3 * E
    assert K3_TRUNK - sum(ts.layer_matrices(L) for L in range(93)) == K3_VECTORS_STORED


# ---------------------------------------------------------------------------------------
# Real K3 plans at 8, 9, 16, 64 and 256 GiB (independent of this machine's RAM)
# ---------------------------------------------------------------------------------------


K3_HEAD = K3_EMBED_LM_HEAD // 2  # lm_head [163,840, 7,168] BF16, as stored
# A streamed lm_head: blocks of as many 14,336 B rows as 32 MiB holds (2,340), one buffer.
K3_HEAD_BLOCK_ROWS = (32 << 20) // K3_ROW
K3_HEAD_BUFFER = K3_HEAD_BLOCK_ROWS * K3_ROW


def k3_floor(context: int, embed: int, head: int = K3_HEAD, snapshots: int = 1) -> int:
    """The floor from spec numbers, without the planner's work-buffer and staging estimate."""
    # one turn snapshot is the whole state export: KDA state + MLA rows + ids + 40 B header
    snapshot = snapshots * (K3_KDA_STATE + context * (K3_MLA_PER_POSITION + 4) + 40)
    return (head + embed + K3_VECTORS_FP32 + 4 * 3 * E + K3_KDA_STATE + snapshot
            + context * K3_MLA_PER_POSITION)


K3_STAGING = 8 * sz.MiB  # 8 reader threads x 1 MiB


def k3_work(chunk: int, context: int = 8192) -> int:
    """One prefill pass of `chunk` tokens on K3, from the spec's widths and what km_chunk and
    its sublayers allocate (native/k3_model.c, k3_kda.c, k3_mla.c, k3_moe.c, kk_widen)."""
    t, snapshots = chunk, -(-93 // 12)  # AttnRes blocks of 12 layers
    activations = (snapshots + 4) * t * E * 4  # cur, x, xn, a + block snapshots
    kda = 6 * P + D + 96  # q k v g z y, fa, beta
    mla = 2 * 1536 + 96 * 192 + 576 + 2 * 96 * 128  # qa x2, q, kv_a, o, gate
    moe = 2 * 896 + 2 * 16 + 16 * 3584 + 5 * 3584 + E + 2 * 6144 + 2 * 3072
    dense = 2 * 33792
    scratch = t * max(kda, mla, moe, dense) * 4
    widened = t * 33792 * 8  # layer 0's down projection takes the widest input
    routing = 4 * (t * (16 + 2 + 896) + 896)  # top-k, token and slot lists, lookahead picks
    mla_heads = 96 * (2 * 512 * 4 + (2 * 512 + context) * 8)  # qabs, ctx + double sums
    return activations + scratch + max(widened + routing, mla_heads) + 163840 * 4


def k3_largest_chunk(held_without_work: int, budget: int, context: int = 8192) -> int:
    """The largest chunk (<= context) whose pass fits beside what else the plan holds."""
    chunk = 64
    while chunk < context and held_without_work + k3_work(chunk + 1, context) <= budget:
        chunk += 1
    return chunk


def test_k3_work_buffers_mirror_what_the_engine_allocates(k3) -> None:
    """The work buffers are the engine's per-pass allocations: the MoE scratch is the
    largest on K3, the matmul inputs are widened to doubles, the MLA head rows are per head
    (96) with double scores to the context, and they grow with the chunk."""
    cfg, _ = k3
    for chunk, context in ((1, 1), (64, 8192), (1097, 8192), (8192, 131072)):
        parts = pl.work_buffer_parts(cfg, context, chunk)
        assert pl.work_buffer_bytes(parts) == k3_work(chunk, context), (chunk, context)
    parts = pl.work_buffer_parts(cfg, 8192, 64)
    assert parts["MLA scores, per head"] == 96 * (4096 + (1024 + 8192) * 8)
    assert parts["widened inputs (double)"] == 64 * 33792 * 8


def test_k3_8g_fits_streaming_units(k3) -> None:
    """8 GiB holds K3: no embedding table, ring slots for one unit, not one layer.

    Floor at 8,192 tokens without the table (GiB): lm_head 2.19 + KDA state 0.43 + one turn
    snapshot 0.85 (the whole state export: KDA state 0.43 + MLA rows 0.42 + ids) + MLA cache
    0.42 + fp32 vectors 0.06 + staging 0.01 + work for a 64-token pass 0.06 = 4.02. Pinning
    layer 0 (2.18) would let the ring slots shrink to a KDA attention unit (0.83 each), but
    that needs 4.02 + 2.18 + 2 x 0.83 (1.65) + 17 expert slots 0.28 = 8.13 > 8. So every layer
    streams, through slots for layer 0's dense FFN unit (1.35 each): 4.02 + 2 x 1.35 (2.71) +
    17 expert slots 0.28 = 7.01, and the remaining 0.99 grows the prefill chunk from 64 to
    1,097 tokens (work 1.05). (Layer 0 is pinned from 8.13 GiB: the 9 GiB test.)
    """
    cfg, ts = k3
    budget = sz.parse_memory("small")
    plan = pl.make_plan(cfg, ts, budget, 8192, check_machine=False)
    check_invariants(plan)
    assert plan.embed_stream and plan.embed_bytes == K3_ROW
    floor = k3_floor(8192, embed=K3_ROW) + K3_STAGING
    assert plan.floor_bytes == floor + k3_work(plan.prefill_chunk)
    # pinning layer 0 does not fit beside the smaller ring and the minimum expert cache
    assert (floor + k3_work(64) + K3_LAYER0_MATRICES + 2 * ring_bound(K3_KDA_ATTN, 8)
            + 17 * EXPERT_SLOT > budget)
    assert plan.pinned_layers == () and plan.pinned_bytes == 0
    assert plan.ring_slots == 2 and plan.ring_slot_bytes == ring_bound(K3_DENSE_FFN, 3)
    assert plan.ring_unit == "layer 0 FFN"
    assert plan.streamed_bytes == K3_LAYER0_MATRICES + 68 * K3_KDA_MATRICES + 24 * K3_MLA_MATRICES
    held = floor + 2 * ring_bound(K3_DENSE_FFN, 3) + 17 * EXPERT_SLOT
    assert plan.expert_slot_bytes == EXPERT_SLOT
    # the room above the minimum expert cache grows the prefill chunk
    assert plan.expert_slots == 17
    assert plan.prefill_chunk == k3_largest_chunk(held, budget) == 1097
    assert plan.cold_read_per_token == plan.streamed_bytes + 92 * 16 * K3_EXPERT + K3_ROW
    opts = plan.stream_options()
    assert (opts.trunk_stream, opts.ring_slots, opts.pinned) == (True, 2, ())
    assert opts.embed_stream
    assert opts.expert_cache_bytes == 17 * EXPERT_SLOT and opts.lookahead == 0
    assert opts.prefill_chunk == 1097
    assert (opts.direct_io, opts.prefetch, opts.reader_threads) == (True, True, 8)
    table = plan.table()
    for text in ("streamed: one row of 14,336 B", "pinned: 0 layers", "streamed: 93 layers",
                 "layer 0 FFN", f"{K3_DENSE_FFN:,} B in 3 tensors", "embed_stream=True",
                 "pinned none", "chunk of 1,097 tokens", "MLA scores, per head",
                 "widened inputs (double)"):
        assert text in table, text


def test_k3_9g_pins_layer0_so_the_slots_shrink(k3) -> None:
    """Pinning layer 0 lets the ring slots shrink from its dense FFN unit to a KDA attention
    unit; with the whole state export in the floor this first fits at 8.13 GiB (8 GiB streams
    every layer), so it is shown at 9 GiB.

    Floor 4.02 (rows streamed, a 64-token pass) + layer 0 2.18 + ring 2 x 0.83 (1.65) + 17
    expert slots 0.28 = 8.13 held; the remaining 0.87 grows the chunk to 967 tokens. Pinning
    layer 1 too (1.18) would need 8.13 + 1.18 = 9.31 > 9.
    """
    cfg, ts = k3
    budget = sz.parse_memory("9G")
    plan = pl.make_plan(cfg, ts, budget, 8192, check_machine=False)
    check_invariants(plan)
    assert plan.embed_stream and plan.embed_bytes == K3_ROW
    floor = k3_floor(8192, embed=K3_ROW) + K3_STAGING
    assert plan.floor_bytes == floor + k3_work(plan.prefill_chunk)
    assert plan.pinned_layers == (0,) and plan.pinned_bytes == K3_LAYER0_MATRICES
    assert plan.ring_slots == 2 and plan.ring_slot_bytes == ring_bound(K3_KDA_ATTN, 8)
    assert plan.ring_unit == "layer 1 attention"
    assert plan.streamed_bytes == 68 * K3_KDA_MATRICES + 24 * K3_MLA_MATRICES
    held = floor + K3_LAYER0_MATRICES + 2 * ring_bound(K3_KDA_ATTN, 8) + 17 * EXPERT_SLOT
    assert held + k3_work(64) + K3_KDA_MATRICES > budget  # layer 1 does not fit as well
    assert plan.expert_slot_bytes == EXPERT_SLOT
    assert plan.expert_slots == 17
    assert plan.prefill_chunk == k3_largest_chunk(held, budget) == 967
    assert plan.cold_read_per_token == plan.streamed_bytes + 92 * 16 * K3_EXPERT + K3_ROW
    opts = plan.stream_options()
    assert (opts.trunk_stream, opts.ring_slots, opts.pinned) == (True, 2, (0,))
    assert opts.embed_stream
    assert opts.expert_cache_bytes == 17 * EXPERT_SLOT and opts.lookahead == 0
    assert (opts.direct_io, opts.prefetch, opts.reader_threads) == (True, True, 8)
    table = plan.table()
    for text in ("streamed: one row of 14,336 B", "pinned: 1 layers", "layer 1 attention",
                 f"{K3_KDA_ATTN:,} B in 8 tensors", "embed_stream=True"):
        assert text in table, text


def test_k3_smallest_held_head_plan_streams_layer0(k3) -> None:
    """The smallest K3 plan that holds lm_head streams every layer through slots sized for
    layer 0's FFN unit: 7.01 GiB at 8,192 tokens: floor 4.02 (a 64-token pass) + ring
    2 x 1.35 (2.71) + 17 expert slots 0.28. One byte less and layer 0's FFN streams one
    matrix per unit (ffn_split), so the slots shrink to a KDA attention unit (0.83) with
    lm_head still held: 5.95 GiB; one byte below that lm_head streams and the FFN is one unit
    again (the unsplit ring fits beside a streamed lm_head down to 4.85 GiB).
    """
    cfg, ts = k3
    floor = k3_floor(8192, embed=K3_ROW) + K3_STAGING + k3_work(64)
    need = floor + 2 * ring_bound(K3_DENSE_FFN, 3) + 17 * EXPERT_SLOT
    plan = pl.make_plan(cfg, ts, need, 8192, check_machine=False)
    check_invariants(plan)
    assert not plan.head_stream and plan.lm_head_bytes == K3_HEAD
    assert plan.engine_options()["head_block_rows"] == 0 and plan.head_read_per_token == 0
    assert plan.pinned_layers == () and plan.ring_slot_bytes == ring_bound(K3_DENSE_FFN, 3)
    assert plan.expert_slots == 17 and plan.ring_unit == "layer 0 FFN"
    assert plan.prefill_chunk == 64 and plan.floor_bytes == floor
    assert not plan.ffn_split and not plan.engine_options()["ffn_split"]
    below = pl.make_plan(cfg, ts, need - 1, 8192, check_machine=False)
    check_invariants(below)
    assert not below.head_stream and below.ffn_split and below.pinned_layers == ()
    assert below.ring_unit == "layer 0 attention"  # layer 0 is a KDA layer; ties name the lowest
    assert below.ring_slot_bytes == ring_bound(K3_KDA_ATTN, 8) < ring_bound(K3_DENSE_FFN // 3, 1) * 2
    assert below.engine_options()["ffn_split"] and below.stream_options().ffn_split
    split_need = floor + 2 * ring_bound(K3_KDA_ATTN, 8) + 17 * EXPERT_SLOT
    assert 5.95 * sz.GiB < split_need < 5.96 * sz.GiB
    at = pl.make_plan(cfg, ts, split_need, 8192, check_machine=False)
    check_invariants(at)
    assert at.ffn_split and not at.head_stream and at.prefill_chunk == 64
    assert at.floor_bytes == floor and at.expert_slots == 17
    lower = pl.make_plan(cfg, ts, split_need - 1, 8192, check_machine=False)
    check_invariants(lower)
    # lm_head streamed, the unsplit ring fits again (4.85 GiB): the FFN splits only when needed
    assert lower.head_stream and lower.lm_head_bytes == K3_HEAD_BUFFER and not lower.ffn_split
    assert lower.ring_slot_bytes == ring_bound(K3_DENSE_FFN, 3)


def test_k3_smallest_plan_streams_lm_head_and_below_it_is_refused(k3) -> None:
    """The smallest K3 plan at 8,192 tokens streams lm_head too: its 2.19 GiB become one
    32 MiB block buffer, and layer 0's dense FFN streams split, one matrix (0.45 GiB) per
    unit, so the ring's two slots are sized for a KDA attention unit (0.83) instead of the
    three matrices (1.35): 3.80 GiB in all (floor 1.87 + ring 1.65 + 17 slots 0.28), 2.90 at
    one token. Every token reads the whole lm_head (163,840 x 7,168 x 2 B) in 71 reads.
    2.5 GiB is refused whatever the context."""
    cfg, ts = k3
    need = pl.minimum_budget(cfg, ts, 8192)
    floor = k3_floor(8192, embed=K3_ROW, head=K3_HEAD_BUFFER) + K3_STAGING + k3_work(64)
    assert need == floor + 2 * ring_bound(K3_KDA_ATTN, 8) + 17 * EXPERT_SLOT
    assert ring_bound(K3_DENSE_FFN // 3, 1) < ring_bound(K3_KDA_ATTN, 8)  # one matrix < attention
    assert 3.79 * sz.GiB < need < 3.81 * sz.GiB
    one = pl.minimum_budget(cfg, ts, 1)
    assert one == (k3_floor(1, embed=K3_ROW, head=K3_HEAD_BUFFER) + K3_STAGING + k3_work(1, 1)
                   + 2 * ring_bound(K3_KDA_ATTN, 8) + 17 * EXPERT_SLOT)
    assert 2.89 * sz.GiB < one < 2.91 * sz.GiB
    plan = pl.make_plan(cfg, ts, need, 8192, check_machine=False)
    check_invariants(plan)
    assert plan.head_stream and plan.head_block_rows == K3_HEAD_BLOCK_ROWS == 2340
    assert plan.lm_head_bytes == K3_HEAD_BUFFER and plan.floor_bytes == floor
    assert plan.pinned_layers == () and plan.ring_unit == "layer 0 attention"
    assert plan.ffn_split and plan.stream_options().ffn_split
    assert plan.layer_unit_slots[0] == (ring_bound(K3_KDA_ATTN, 8), ring_bound(K3_DENSE_FFN // 3, 1))
    assert plan.expert_slots == 17 and plan.prefill_chunk == 64
    assert plan.head_read_per_token == 163840 * 7168 * 2
    assert plan.cold_read_per_token == (K3_TRUNK - K3_VECTORS_STORED + K3_ROW + K3_HEAD
                                        + 92 * 16 * K3_EXPERT)
    assert plan.engine_options()["head_block_rows"] == 2340
    assert plan.stream_options().head_block_rows == 2340
    assert plan.read_seconds(plan.head_read_per_token, 2.0) == pytest.approx(
        163840 * 7168 * 2 / 2e9)
    table = plan.table(2.0)
    for text in ("streamed: blocks of 2,340 rows", f"{K3_HEAD:,} B read per token",
                 "in 71 reads", f"{163840 * 7168 * 2 / 2e9:.2f} s per token at 2 GB/s",
                 "head_block_rows=2,340", "ffn_split=True", "dense FFNs split"):
        assert text in table, text
    assert "give --disk-gbps" in plan.table()
    with pytest.raises(pl.PlanError):
        pl.make_plan(cfg, ts, need - 1, 8192, check_machine=False)
    budget = sz.parse_memory("2.5G")
    with pytest.raises(pl.PlanError) as info:
        pl.make_plan(cfg, ts, budget, 8192, check_machine=False)
    err = info.value
    assert err.minimum == need and err.max_context is None
    msg = str(err)
    for text in (f"{budget:,} B", f"{need:,} B", "layer 0's attention matrices",
                 f"{K3_KDA_ATTN:,} B in 8 tensors", f"{ring_bound(K3_KDA_ATTN, 8):,} B",
                 "17 slots", "embedding rows read per token",
                 "lm_head read per token in blocks of 2,340 rows", "What to do", "--memory 4G",
                 "smaller context does not help"):
        assert text in msg, text
    # without the turn snapshot (0.85 GiB at 8K) the same plan is 2.94 GiB
    bare = pl.make_plan(cfg, ts, need, 8192, check_machine=False, snapshots=0)
    check_invariants(bare)
    bare_need = pl.minimum_budget(cfg, ts, 8192, snapshots=0)
    assert bare_need == (k3_floor(8192, embed=K3_ROW, head=K3_HEAD_BUFFER, snapshots=0)
                         + K3_STAGING + k3_work(64) + 2 * ring_bound(K3_KDA_ATTN, 8)
                         + 17 * EXPERT_SLOT)


def test_k3_lookahead_keeps_the_routers_of_streamed_layers(k3) -> None:
    """At 9 GiB layer 0 is pinned without lookahead (8.13 GiB needed); with it the routers of
    the 92 streamed MoE layers (1.10 GiB) are held too, and 8.13 + 1.10 = 9.23 > 9, so every
    layer streams: floor 4.02 + routers 1.10 + ring 2 x 1.35 (2.71) + 17 expert slots 0.28 =
    8.11, and the remaining 0.89 grows the chunk to 992 tokens. (At 8 GiB, where layer 0
    streams anyway, lookahead with lm_head held needs 7.01 + 1.10 = 8.11, so at 8G layer 0's
    FFN streams split, one matrix per unit: slots of a KDA attention unit, 5.95 + 1.10 = 7.06,
    and lm_head stays held.)
    """
    cfg, ts = k3
    budget = sz.parse_memory("9G")
    assert pl.make_plan(cfg, ts, budget, 8192, check_machine=False).pinned_layers == (0,)
    plan = pl.make_plan(cfg, ts, budget, 8192, check_machine=False, lookahead=8)
    check_invariants(plan)
    # 92 routers no longer leave room to pin layer 0
    floor = k3_floor(8192, embed=K3_ROW) + K3_STAGING
    pin0 = (floor + k3_work(64) + K3_LAYER0_MATRICES + 2 * ring_bound(K3_KDA_ATTN, 8)
            + 17 * EXPERT_SLOT)
    assert pin0 <= budget < pin0 + 92 * K3_ROUTER
    assert plan.pinned_layers == () and plan.router_bytes == 92 * K3_ROUTER
    assert plan.streamed_bytes == plan.trunk_matrix_bytes - 92 * K3_ROUTER
    assert plan.ring_slot_bytes == ring_bound(K3_DENSE_FFN, 3)
    held = floor + 92 * K3_ROUTER + 2 * ring_bound(K3_DENSE_FFN, 3) + 17 * EXPERT_SLOT
    assert plan.expert_slots == 17
    assert plan.prefill_chunk == k3_largest_chunk(held, budget) == 992
    assert plan.layer_unit_slots[1] == (ring_bound(K3_KDA_ATTN, 8),
                                        ring_bound(K3_MOE_FFN - K3_ROUTER, 5))
    assert plan.stream_options().lookahead == 8
    assert "routers (lookahead)" in plan.table()
    base = pl.minimum_budget(cfg, ts, 8192)
    assert pl.minimum_budget(cfg, ts, 8192, lookahead=8) == base + 92 * K3_ROUTER
    with pytest.raises(pl.PlanError) as info:
        pl.make_plan(cfg, ts, base + K3_ROUTER, 8192, check_machine=False, lookahead=4)
    msg = str(info.value)
    assert "routers of 92 streamed MoE layers" in msg and "turn router lookahead off" in msg
    assert f"{base:,} B" in msg
    # with lm_head held and layer 0's FFN one unit lookahead does not fit 8 GiB (7.01 + 1.10);
    # split, one matrix per unit, it does (5.95 + 1.10), so lm_head stays held
    held_base = (k3_floor(8192, embed=K3_ROW) + K3_STAGING + k3_work(64)
                 + 2 * ring_bound(K3_DENSE_FFN, 3) + 17 * EXPERT_SLOT)
    assert held_base + 92 * K3_ROUTER > sz.parse_memory("8G")
    held_split = held_base - 2 * ring_bound(K3_DENSE_FFN, 3) + 2 * ring_bound(K3_KDA_ATTN, 8)
    assert held_split + 92 * K3_ROUTER <= sz.parse_memory("8G")
    at8 = pl.make_plan(cfg, ts, sz.parse_memory("8G"), 8192, check_machine=False, lookahead=8)
    check_invariants(at8)
    assert not at8.head_stream and at8.ffn_split and at8.router_bytes == 92 * K3_ROUTER
    assert at8.ring_slot_bytes == ring_bound(K3_KDA_ATTN, 8)
    # pinned layers hold their routers anyway: at 64G fewer are counted twice
    big = pl.make_plan(cfg, ts, sz.parse_memory("64G"), 8192, check_machine=False, lookahead=8)
    check_invariants(big)
    assert big.router_bytes == K3_ROUTER * sum(1 for L in big.streamed_layers if L > 0)


def test_k3_16g_pins_layer0_first_and_streams_the_rest(k3) -> None:
    """16 GiB pins layer 0 (2.18 GiB), then KDA layers (1.18 each) before MLA layers (0.79).

    With KDA layers still streamed the ring holds a KDA attention unit, 2 x 0.83 (1.65), so
    16 - floor 4.02 (a 64-token pass) - ring 1.65 - 17 expert slots 0.28 = 10.05 is left for
    pinned layers: layer 0 and 6 KDA layers (2.18 + 6 x 1.18 = 9.26) fit, a 7th (10.44) does
    not. The remaining 0.79 grows the chunk to 883 tokens. (With the snapshot counted as the
    KDA state alone the floor was 0.42 smaller and 7 KDA layers fitted.)
    """
    cfg, ts = k3
    budget = sz.parse_memory("medium")
    plan = pl.make_plan(cfg, ts, budget, 8192, check_machine=False)
    check_invariants(plan)
    assert not plan.trunk_resident and plan.embed_stream
    floor = k3_floor(8192, embed=K3_ROW) + K3_STAGING
    assert plan.floor_bytes == floor + k3_work(plan.prefill_chunk)
    assert 0 in plan.pinned_layers  # the biggest layer goes first (it also shrinks the ring)
    assert plan.ring_slots == 2 and plan.ring_slot_bytes == ring_bound(K3_KDA_ATTN, 8)
    ring = 2 * ring_bound(K3_KDA_ATTN, 8)
    room = budget - floor - k3_work(64) - ring - 17 * EXPERT_SLOT
    kda = (room - K3_LAYER0_MATRICES) // K3_KDA_MATRICES  # KDA layers pinned after layer 0
    kda_layers = [L for L in range(1, 93) if not cfg.is_mla(L)]
    assert kda == 6 and plan.pinned_layers == (0, *kda_layers[:kda])
    assert plan.pinned_layers == (0, 1, 2, 4, 5, 6, 8)  # KDA layers before MLA layers
    assert plan.pinned_bytes == K3_LAYER0_MATRICES + kda * K3_KDA_MATRICES
    held = floor + plan.pinned_bytes + ring + 17 * EXPERT_SLOT
    assert plan.expert_slots == 17
    assert plan.prefill_chunk == k3_largest_chunk(held, budget) == 883
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
    assert plan.trunk_resident and plan.pinned_bytes == K3_TRUNK - K3_VECTORS_STORED
    assert not plan.embed_stream and plan.embed_bytes == K3_EMBED_LM_HEAD // 2
    # the chunk reaches the context: a whole 8,192-token prompt in one pass
    assert plan.prefill_chunk == 8192
    assert plan.floor_bytes == (k3_floor(8192, embed=K3_EMBED_LM_HEAD // 2) + K3_STAGING
                                + k3_work(8192))
    rest = budget - plan.floor_bytes - plan.pinned_bytes
    assert plan.expert_slots == rest // EXPERT_SLOT
    assert plan.expert_slots > 8000
    opts = plan.stream_options()
    assert not opts.trunk_stream and not opts.embed_stream
    assert opts.expert_cache_bytes == plan.expert_slots * EXPERT_SLOT
    table = plan.table()
    for text in ("embeddings", "lm_head", "KDA state", "MLA latent cache", "work buffers",
                 "chunk of 8,192 tokens", "I/O staging", "resident (all layers)", "expert cache",
                 f"{K3_TRUNK:,} B", "resident table", "peak while opening"):
        assert text in table, text


def test_k3_open_peak_decides_the_embedding_table(k3) -> None:
    """Near the resident threshold the engine's open peak binds: it reads lm_head into a
    buffer and copies it (2 x 2.35 GB) before the ring, expert slots or session exist."""
    cfg, ts = k3
    matrices = K3_TRUNK - K3_VECTORS_STORED
    head = K3_EMBED_LM_HEAD // 2
    peak_with_table = K3_VECTORS_FP32 + 4 * 3 * E + 8 * sz.MiB + matrices + head + 2 * head
    held_with_table = k3_floor(8192, head) + matrices + 17 * EXPERT_SLOT
    assert peak_with_table > held_with_table + 64 * sz.MiB  # the peak is what binds
    below = pl.make_plan(cfg, ts, peak_with_table - 1, 8192, check_machine=False)
    check_invariants(below)
    assert below.trunk_resident and below.embed_stream  # resident, rows read per token
    at = pl.make_plan(cfg, ts, peak_with_table, 8192, check_machine=False)
    check_invariants(at)
    assert at.trunk_resident and not at.embed_stream and at.open_peak_bytes == peak_with_table


def _assert_trunk_first(plan: pl.Plan) -> None:
    """Pinning one more layer would not fit beside the minimum expert cache."""
    room = plan.budget - plan.floor_bytes - plan.min_expert_slots * plan.expert_slot_bytes
    streamed = sorted(plan.streamed_layers, key=lambda L: (-plan.layer_matrix_bytes[L], L))
    pinned = plan.pinned_bytes + plan.layer_matrix_bytes[streamed[0]]
    rest = streamed[1:]
    ring = 2 * max(max(plan.layer_unit_slots[L]) for L in rest) if rest else 0
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
    m = sz.read_machine_memory(meminfo, root, proc, system="linux")
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


def test_k3chat_plan_on_tiny_fixture(tiny: Path, tmp_path: Path, capsys, fake_machine,
                                     fixed_process) -> None:
    out = tmp_path / "plan.json"
    argv = [str(tiny), "--memory", "136M", "--context", "2048", "--json", str(out)]
    assert pl.main_plan(argv) == 0
    text = capsys.readouterr().out
    for part in ("floor total", "KDA state", "MLA latent cache", "2,048 positions",
                 "resident (all layers)", "expert cache", "total"):
        assert part in text, part
    data = json.loads(out.read_text())
    assert data["ok"] and data["plan"]["total"] <= 136 * sz.MiB
    assert data["plan"]["process_bytes"] == PROCESS  # the budget covers the process too
    row = next(line for line in text.splitlines() if "process (beside the engine)" in line)
    assert f"{PROCESS:,} B" in row and "resident memory" in row
    assert data["plan"]["context"] == 2048 and data["plan"]["trunk_resident"] is True
    assert data["plan"]["embed_stream"] is False
    # A budget that forces streaming: embedding rows and the lookahead in table and JSON.
    cfg = load_config(tiny)
    budget = pl.minimum_budget(cfg, pl.tensor_sizes_from_dir(tiny, cfg), 2048, lookahead=2,
                               process_bytes=PROCESS)
    argv = [str(tiny), "--memory", str(budget), "--context", "2048", "--lookahead", "2",
            "--json", str(out)]
    assert pl.main_plan(argv) == 0
    text = capsys.readouterr().out
    for part in ("streamed: one row of 256 B read per token", "ring: 2 slots",
                 "routers (lookahead)", "embed_stream=True", "lookahead=2"):
        assert part in text, part
    plan = json.loads(out.read_text())["plan"]
    assert plan["embed_stream"] is True and plan["lookahead"] == 2 and plan["total"] <= budget
    assert plan["engine_options"] == {
        "expert_cache_bytes": plan["expert_slots"] * plan["expert_slot_bytes"],
        "reader_threads": 8, "direct_io": True, "lookahead": 2, "prefetch": True,
        "trunk_stream": True, "ring_slots": 2, "pinned": plan["pinned_layers"],
        "embed_stream": True, "prefill_chunk": plan["prefill_chunk"], "head_block_rows": 0,
        "ffn_split": False}


def test_k3_prompt_expert_bytes_from_uniform_routing(k3) -> None:
    """The issue's figures: a 64-token chunk touches about 610 of 896 experts per layer under
    uniform top-16 routing (about 985 GB per chunk over 92 MoE layers), a 2,000-token prompt
    in 64-token passes reads about 31 TB, and one pass reads each expert once, 1.45 TB."""
    cfg, ts = k3
    plan = pl.make_plan(cfg, ts, sz.parse_memory("small"), 8192, check_machine=False)
    touched = 896 * (1 - (1 - 16 / 896) ** 64)
    assert 605 < touched < 615  # 613.2
    assert plan.prefill_passes(2000, 64) == [64] * 31 + [16]
    per_pass = 92 * K3_EXPERT * touched
    assert abs(plan.prefill_expert_bytes(64, 64) - per_pass) < 1
    assert 980e9 < per_pass < 995e9  # 989.7 GB
    last = 92 * K3_EXPERT * 896 * (1 - (1 - 16 / 896) ** 16)
    assert abs(plan.prefill_expert_bytes(2000, 64) - (31 * per_pass + last)) < 64
    assert 31.0e12 < plan.prefill_expert_bytes(2000, 64) < 31.1e12
    once = 92 * 896 * K3_EXPERT
    assert 1.44e12 < plan.prefill_expert_bytes(2000, 2000) <= once < 1.45e12
    # the plan's own chunk (1,097 tokens at 8G): two passes
    assert plan.prefill_passes(2000) == [1097, 903]
    report = pl.prompt_report(plan, 2000)
    assert report["plan"] == {"chunk": 1097, "passes": 2,
                              "expected_expert_bytes": round(plan.prefill_expert_bytes(2000))}
    assert report["default_chunk"]["passes"] == 32 and report["every_expert_once_bytes"] == once
    assert "uniform routing" in report["routing"]


def test_tiny_plan_caches_every_expert_before_growing_the_chunk(tiny: Path) -> None:
    """When every routed expert fits in the cache beside the base chunk, each is read at most
    once anyway: the cache keeps them all and the chunk takes only what is left; below that
    the chunk grows first, down to the minimum cache."""
    cfg = load_config(tiny)
    ts = pl.tensor_sizes_from_dir(tiny, cfg)
    context = 2048
    ample = pl.make_plan(cfg, ts, 1 << 40, context, check_machine=False)
    assert ample.expert_slots == ample.experts_total and ample.prefill_chunk == context
    everything = ample.floor_bytes + ample.trunk_plan_bytes + ample.expert_cache_bytes
    work = {c: pl.work_buffer_bytes(pl.work_buffer_parts(cfg, context, c)) for c in (64, 65)}
    base = everything - ample.work_bytes + work[64]  # all experts cached, a 64-token pass
    plan = pl.make_plan(cfg, ts, base, context, check_machine=False)
    check_invariants(plan)
    assert plan.expert_slots == plan.experts_total and plan.prefill_chunk == 64
    grown = pl.make_plan(cfg, ts, base + work[65] - work[64], context, check_machine=False)
    assert grown.expert_slots == grown.experts_total and grown.prefill_chunk == 65
    short = pl.make_plan(cfg, ts, base - 1, context, check_machine=False)
    check_invariants(short)
    assert short.expert_slots == short.min_expert_slots and short.prefill_chunk > 64
    # capped at the context
    assert pl.make_plan(cfg, ts, 1 << 40, 10, check_machine=False).prefill_chunk == 10


def test_k3chat_plan_prompt_tokens(tiny: Path, tmp_path: Path, capsys, fake_machine,
                                   fixed_process) -> None:
    out = tmp_path / "plan.json"
    argv = [str(tiny), "--memory", "136M", "--context", "2048", "--prompt-tokens", "1,000",
            "--json", str(out)]
    assert pl.main_plan(argv) == 0
    text = capsys.readouterr().out
    payload = json.loads(out.read_text())
    plan, prompt = payload["plan"], payload["prompt"]
    chunk = plan["prefill_chunk"]
    passes = -(-1000 // chunk)
    assert prompt["prompt_tokens"] == 1000 and prompt["plan"]["chunk"] == chunk
    assert prompt["plan"]["passes"] == passes and prompt["default_chunk"]["passes"] == 16
    cfg = load_config(tiny)
    n, k = cfg.n_experts, cfg.top_k
    sizes = [min(chunk, 1000 - d) for d in range(0, 1000, chunk)]
    expected = sum(n * (1 - (1 - k / n) ** t) for t in sizes) * len(cfg.moe_layers) * plan[
        "expert_bytes"]
    assert prompt["plan"]["expected_expert_bytes"] == round(expected)
    assert plan["work_parts"]["MLA scores, per head"] > 0
    assert plan["work_bytes"] == pl.work_buffer_bytes(plan["work_parts"])
    for part in ("prompt of 1,000 tokens", f"chunk {chunk:>7,} tokens", "uniform routing",
                 "expert_bytes_read", f"{round(expected):,} B", "MLA scores, per head"):
        assert part in text, part
    # a prompt longer than the context is refused with what to do
    assert pl.main_plan([str(tiny), "--memory", "136M", "--context", "100",
                         "--prompt-tokens", "101"]) == 2
    err = capsys.readouterr().err
    assert "101 tokens does not fit a context of 100" in err and "--context 101" in err
    assert pl.main_plan([str(tiny), "--prompt-tokens", "0"]) == 2
    assert "at least 1 token" in capsys.readouterr().err


def test_plan_json_is_written_0600_like_run_json(tiny: Path, tmp_path: Path, capsys,
                                                fake_machine, fixed_process) -> None:
    import os
    import stat
    out = tmp_path / "plan.json"
    out.write_text("an older, looser report")
    os.chmod(out, 0o644)
    old = os.umask(0o022)
    try:
        assert pl.main_plan([str(tiny), "--memory", "136M", "--json", str(out)]) == 0
        assert stat.S_IMODE(out.stat().st_mode) == 0o600 and json.loads(out.read_text())["ok"]
        refused = tmp_path / "refused.json"
        assert pl.main_plan([str(tiny), "--memory", "1M", "--json", str(refused)]) == 2
        assert stat.S_IMODE(refused.stat().st_mode) == 0o600
        assert json.loads(refused.read_text())["ok"] is False
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "refused.json"]


def test_k3chat_plan_refusals_exit_2(tiny: Path, tmp_path: Path, capsys, fake_machine,
                                     fixed_process) -> None:
    assert pl.main_plan([str(tiny), "--memory", "1M"]) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "1,048,576 B" in err and "What to do" in err
    assert pl.main_plan([str(tiny), "--memory", "lots"]) == 2
    assert "unknown memory preset" in capsys.readouterr().err
    assert pl.main_plan([str(tmp_path / "nowhere")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert pl.main_plan([str(tiny), "--context", "0"]) == 2
    assert pl.main_plan([str(tiny), "--lookahead", "-1"]) == 2
    # Above what the (fake) machine holds: refused, unless planning for another machine.
    fake_machine(sz.MachineMemory(total=sz.GiB, available=96 * sz.MiB, swap_total=0, cgroup=None))
    assert pl.main_plan([str(tiny), "--memory", "136M"]) == 2
    assert "without swapping" in capsys.readouterr().err
    assert pl.main_plan([str(tiny), "--memory", "136M", "--no-machine-check"]) == 0


# ---------------------------------------------------------------------------------------
# The plan against the C engine (tiny fixture)
# ---------------------------------------------------------------------------------------


def engine_unit_bytes(entries: list[tuple[int, int, int, int]]) -> int:
    """Slot bytes of one unit as native/k3_ring.c kr_unit_layout lays it out.

    entries: (shard index, file offset, bytes, element size). Sorted by shard and offset; a
    tensor extends the previous read when it follows it in the same shard and keeps its
    element alignment inside the slot, else a new read starts 64-byte aligned."""
    reads: list[list[int]] = []  # [shard, offset, length, slot offset]
    pos = 0
    for shard, off, nbytes, el in sorted(entries):
        last = reads[-1] if reads else None
        if (last and last[0] == shard and last[1] + last[2] == off
                and (last[3] + last[2]) % el == 0):
            last[2] += nbytes
        else:
            pos = (pos + 63) // 64 * 64
            reads.append([shard, off, nbytes, pos])
        pos = reads[-1][3] + reads[-1][2]
    return pos


def engine_units(model_dir: Path, n_layers: int,
                 lookahead: int) -> list[list[tuple[int, int, int]]]:
    """Per layer, per unit (attention, FFN): (engine slot bytes, stored bytes, tensors).

    Matrices are every 2-D tensor with both dims > 1 (the brief's rule, not the planner's
    name list); the router leaves the FFN unit when lookahead is on."""
    ckpt = open_checkpoint(model_dir)
    shard_id = {s: i for i, s in enumerate(ckpt.shards)}  # as k3engine.model hands them over
    out = []
    for L in range(n_layers):
        prefix = f"language_model.model.layers.{L}."
        units: list[list[tuple[int, int, int, int]]] = [[], []]
        for name, t in ckpt.tensors.items():
            if not name.startswith(prefix) or ".experts." in name:
                continue
            if len(t.shape) != 2 or min(t.shape) <= 1:
                continue
            local = name[len(prefix):]
            if lookahead and local == "block_sparse_moe.gate.weight":
                continue
            el = 4 if t.dtype == "F32" else 2
            units[0 if local.startswith("self_attn.") else 1].append(
                (shard_id[t.shard], t.start, t.nbytes, el))
        out.append([(engine_unit_bytes(u), sum(e[2] for e in u), len(u)) for u in units])
    return out


def test_engine_unit_layout_rule() -> None:
    """The reimplementation above pads the way kr_unit_layout does (the fixtures' tensors
    are all multiples of 64 B, so they never need it)."""
    assert engine_unit_bytes([(0, 0, 100, 2), (0, 100, 30, 2)]) == 130  # coalesced
    assert engine_unit_bytes([(0, 100, 30, 2), (0, 0, 100, 2), (0, 200, 10, 4)]) == 192 + 10
    assert engine_unit_bytes([(0, 0, 2, 2), (0, 2, 4, 4)]) == 64 + 4  # F32 after 2 B: new read
    assert engine_unit_bytes([(0, 0, 6, 2), (1, 6, 6, 2)]) == 64 + 6  # another shard
    for entries in ([(0, 0, 100, 2), (0, 300, 30, 2), (0, 900, 10, 4)],
                    [(0, 0, 2, 2), (0, 2, 4, 4)]):
        stored = sum(e[2] for e in entries)
        assert engine_unit_bytes(entries) <= pl.unit_slot_bytes(stored, len(entries))
        assert engine_unit_bytes(entries) <= stored + 64 * len(entries)


@pytest.fixture(scope="module")
def tiny_scrambled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from k3engine.fixture import write_fixture

    return write_fixture("tiny", tmp_path_factory.mktemp("plan") / "scrambled", scrambled=True,
                         with_oracle=False)


@pytest.mark.parametrize("lookahead", [0, 2])
@pytest.mark.parametrize("which", ["tiny", "tiny_scrambled"])
def test_ring_bound_covers_the_engine_unit_layout(which: str, lookahead: int,
                                                  request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(which)
    cfg = load_config(model_dir)
    ts = pl.tensor_sizes_from_dir(model_dir, cfg)
    units = engine_units(model_dir, cfg.n_layers, lookahead)
    plan = pl.make_plan(cfg, ts, pl.minimum_budget(cfg, ts, 64, lookahead=lookahead), 64,
                        check_machine=False, lookahead=lookahead)
    check_invariants(plan)
    assert not plan.pinned_layers  # the smallest plan streams every layer
    for L in range(cfg.n_layers):
        for u in (0, 1):
            real, stored, count = units[L][u]
            bound = plan.layer_unit_slots[L][u]
            assert real <= bound < stored + 64 * count + 4096, (L, u)
        # the planner's unit split agrees with the shape rule
        router = ts.layer_router[L] if lookahead else 0
        assert (units[L][0][1], units[L][0][2]) == (ts.layer_attn[L], ts.layer_attn_count[L])
        assert units[L][1][1] == ts.layer_ffn[L] - router
        assert units[L][1][2] == ts.layer_ffn_count[L] - (1 if router else 0)
    largest = max(max(units[L][0][0], units[L][1][0]) for L in plan.streamed_layers)
    assert plan.ring_slot_bytes >= largest


@pytest.mark.parametrize("lookahead", [0, 2])
def test_tiny_plan_opens_the_engine_as_planned(tiny: Path, lookahead: int) -> None:
    """A budget that forces streaming: the plan's options open the engine, which streams
    the planned layers, holds the planned expert slots and gives the same bits."""
    from k3engine.model import Model

    cfg = load_config(tiny)
    ts = pl.tensor_sizes_from_dir(tiny, cfg)
    budget = pl.minimum_budget(cfg, ts, 64, lookahead=lookahead) + 450_000
    plan = pl.make_plan(cfg, ts, budget, 64, check_machine=False, lookahead=lookahead)
    check_invariants(plan)
    assert plan.pinned_layers and plan.streamed_layers and plan.embed_stream
    assert plan.expert_slots < plan.experts_total  # the cache must evict
    opts = plan.stream_options(reader_threads=2)
    assert opts.reader_threads == 2 and opts.pinned == plan.pinned_layers
    ids = [(37 * i + 11) % cfg.vocab for i in range(48)]
    with Model(tiny) as resident:
        want = resident.forward(ids)
    with Model(tiny, streaming=opts) as m:
        got = m.forward(ids)
        st = m.stats()
    assert got.tobytes() == want.tobytes()
    assert st["expert_slots"] == plan.expert_slots
    units = 2 * len(plan.streamed_layers)  # one pass loads each streamed unit once
    assert units <= st["trunk_stream_reads"] <= units + plan.ring_slots
    assert st["cache_evictions"] > 0
    if lookahead:
        assert st["lookahead_issued"] > 0


def test_planner_does_not_need_the_built_engine() -> None:
    code = ("import sys; sys.modules['k3engine._k3'] = None; import k3engine.planner; "
            "assert 'k3engine.model' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("gib,want", [(256, 16), (64, 0), (8, 0)])
def test_default_lookahead_is_on_only_with_a_resident_trunk(k3, gib: int, want: int) -> None:
    cfg, ts = k3
    plan = pl.make_plan_default_lookahead(cfg, ts, gib * sz.GiB, 8192, check_machine=False)
    assert plan.lookahead == want
    assert plan.trunk_resident == (want > 0)
    if want == 0:  # no routers held for a lookahead that is off
        assert plan.router_bytes == 0
