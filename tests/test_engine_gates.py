"""Oracle gates G1-G7 of spec 9.3 for the C engine on the tiny adversarial fixture.

"Bit-identical" means byte equality of the fp32 buffers (np.array_equal on float32 is
not enough for -0.0 vs 0.0 or NaN payloads, so buffers are compared as bytes).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from k3engine.model import Cancelled, CancelFlag, EngineError, Model

PROMPT = 12
T = 32
# G6, tightened from the spec's 5e-5 (issue 10): the engine sums in double, so its logits
# are float64-close; float32 lanes gave up to 1.4e-5 (tiny, weight seed 7) and fail this.
ORACLE_REL_TOL = 1e-5


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Model:
    return Model(tiny_dir, threads=1)


@pytest.fixture(scope="module")
def full_ids(tiny_oracle: dict[str, np.ndarray]) -> list[int]:
    ids = [int(x) for x in tiny_oracle["full_ids"]]
    assert len(ids) == T
    return ids


@pytest.fixture(scope="module")
def g1_logits(model: Model, full_ids: list[int]) -> np.ndarray:
    return model.forward(full_ids)


def test_g1_teacher_forced_argmax(g1_logits: np.ndarray, full_ids: list[int]) -> None:
    pred = g1_logits.argmax(axis=1)
    agree = int((pred[PROMPT - 1:T - 1] == np.array(full_ids[PROMPT:])).sum())
    prompt_agree = int((pred[:PROMPT - 1] == np.array(full_ids[1:PROMPT])).sum())
    print(f"G1: generated span {agree}/20 (prompt positions, not gated: {prompt_agree}/{PROMPT - 1})")
    assert agree == T - PROMPT


def test_g2_greedy_full_recompute(model: Model, full_ids: list[int]) -> None:
    seq = full_ids[:PROMPT]
    for _ in range(T - PROMPT):
        seq.append(int(model.forward(seq)[-1].argmax()))
    assert seq == full_ids


def test_g3_incremental_decode_bit_identical(model: Model, full_ids: list[int],
                                             g1_logits: np.ndarray) -> None:
    s = model.session(T)
    logits = s.feed(full_ids[:PROMPT])
    assert same_bits(logits, g1_logits[PROMPT - 1])
    out = []
    for pos in range(PROMPT, T):
        tok = int(logits.argmax())
        out.append(tok)
        if pos == T - 1:
            break
        logits = s.feed([tok])
        assert same_bits(logits, g1_logits[pos]), f"decode step at position {pos} differs from prefill"
    assert out == full_ids[PROMPT:]


def test_g4_prefix_reuse_bit_identical(model: Model, full_ids: list[int]) -> None:
    split = 22
    a = model.session(T)
    a.feed(full_ids[:PROMPT])
    for tok in full_ids[PROMPT:split]:
        a.feed([tok])
    tail = a.feed(full_ids[split:], all_logits=True)
    ref = model.session(T)
    ref_all = ref.feed(full_ids, all_logits=True)
    assert same_bits(tail, ref_all[split:])
    sa, sr = a.state_arrays(), ref.state_arrays()
    assert list(sa.ids) == full_ids == list(sr.ids)
    assert len(sa.mla_rows) == 4 and len(sa.kda_s) == 9
    for x, y in zip(sa.mla_rows, sr.mla_rows):
        assert same_bits(x, y)
    for x, y in zip(sa.kda_s + sa.kda_conv, sr.kda_s + sr.kda_conv):
        assert same_bits(x, y)
    # the state is not trivially zero, so the comparison above means something
    assert all(np.abs(x).max() > 0 for x in sa.kda_s)


def test_g5a_state_slot_reuse(model: Model, full_ids: list[int]) -> None:
    other = [(i * 7 + 3) % 500 for i in range(20)]
    s = model.session(T)
    s.feed(other)
    s.reset()
    got = s.feed(full_ids, all_logits=True)
    fresh = model.session(T).feed(full_ids, all_logits=True)
    assert same_bits(got, fresh)


def test_g5b_shared_kda_scratch_slot(model: Model, full_ids: list[int], g1_logits: np.ndarray) -> None:
    assert same_bits(model.forward(full_ids, shared_kda_slot=True), g1_logits)


def assert_oracle_close(engine: np.ndarray, ref: np.ndarray, label: str) -> None:
    """Every position: max_v |engine - oracle| <= ORACLE_REL_TOL * max(1, max_v |oracle|)."""
    ref = ref.astype(np.float64)
    err = np.abs(engine.astype(np.float64) - ref).max(axis=1)
    bound = ORACLE_REL_TOL * np.maximum(1.0, np.abs(ref).max(axis=1))
    print(f"G6 {label}: max |engine - oracle| = {err.max():.3e} (bound {bound.min():.2e}); "
          f"worst position {int(err.argmax())}")
    assert (err <= bound).all()


def test_g6_oracle_tolerance(g1_logits: np.ndarray, tiny_oracle: dict[str, np.ndarray]) -> None:
    assert_oracle_close(g1_logits, tiny_oracle["logits"], "tiny")


def test_g6_oracle_tolerance_other_weight_seed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same gate on the tiny shape with weight seed 7, where float32 sums missed it."""
    from k3engine.fixture import write_fixture

    d = tmp_path_factory.mktemp("tiny_seed7")
    write_fixture("tiny", d, seed=7)
    with np.load(d / "oracle.npz") as z:
        ids, ref = [int(x) for x in z["full_ids"]], z["logits"]
    m = Model(d, threads=1)
    assert_oracle_close(m.forward(ids), ref, "tiny seed 7")
    if m.simd_active:  # the scalar kernels sum the same way, so they meet it too
        m.set_scalar(True)
        assert_oracle_close(m.forward(ids), ref, "tiny seed 7, scalar")


def test_g7_scrambled_twin(tiny_scrambled_dir: Path, model: Model, full_ids: list[int],
                           g1_logits: np.ndarray) -> None:
    twin = Model(tiny_scrambled_dir, threads=1)
    got = twin.forward(full_ids)
    assert same_bits(got, g1_logits)
    st, sc = twin.stats(), model.stats()
    assert st["trunk_fallback_reads"] > 0 and st["expert_fallback_reads"] > 0
    assert sc["trunk_fallback_reads"] == 0 and sc["expert_fallback_reads"] == 0
    assert sc["trunk_run_reads"] == 13
    # every expert the router chose was read exactly once, as one run
    assert sc["expert_run_reads"] == sc["cache_misses"] > 0
    # G3 on the twin: decode steps equal its own prefill rows
    s = twin.session(T)
    s.feed(full_ids[:PROMPT])
    for pos in range(PROMPT, 16):
        assert same_bits(s.feed([full_ids[pos]]), g1_logits[pos])


def test_single_file_checkpoint_same_bits(tiny_single_dir: Path, full_ids: list[int],
                                          g1_logits: np.ndarray) -> None:
    single = Model(tiny_single_dir, threads=1)
    assert same_bits(single.forward(full_ids), g1_logits)


def test_threads_bit_identical(tiny_dir: Path, full_ids: list[int], g1_logits: np.ndarray) -> None:
    two = Model(tiny_dir, threads=2)
    assert same_bits(two.forward(full_ids), g1_logits)
    s1, s2 = Model(tiny_dir, threads=1).session(T), two.session(T)
    s1.feed(full_ids)
    s2.feed(full_ids)
    assert s1.export_state() == s2.export_state()


def test_scalar_vs_simd_bit_identical(tiny_dir: Path, full_ids: list[int]) -> None:
    m = Model(tiny_dir, threads=1)
    if not m.simd_active:
        pytest.skip("this CPU has no AVX2: only the scalar kernels exist here, nothing to compare")
    simd = m.forward(full_ids)
    m.set_scalar(True)
    assert not m.simd_active
    scalar = m.forward(full_ids)
    assert same_bits(simd, scalar)
    # decode steps take the fused one-token kernels: compare those too
    rows = {}
    for on in (False, True):
        m.set_scalar(on)
        s = m.session(T)
        rows[on] = [s.feed(full_ids[:PROMPT])] + [s.feed([t]) for t in full_ids[PROMPT:]]
    assert all(same_bits(a, b) for a, b in zip(rows[False], rows[True]))


def test_chunked_prefill_bit_identical(model: Model) -> None:
    # longer than the engine's 64-token chunk, so prefill crosses chunk boundaries
    ids = [(i * 37 + 11) % 1000 for i in range(150)]
    whole = model.forward(ids)
    s = model.session(len(ids))
    parts = [s.feed(ids[:70], all_logits=True), s.feed(ids[70:71], all_logits=True),
             s.feed(ids[71:], all_logits=True)]
    assert same_bits(np.concatenate(parts), whole)


def test_snapshot_restore(model: Model, full_ids: list[int], g1_logits: np.ndarray) -> None:
    s = model.session(T)
    s.feed(full_ids[:PROMPT])
    snap = s.snapshot()
    s.feed([5, 6, 7])
    s.restore(snap)
    assert s.length == PROMPT and s.ids == full_ids[:PROMPT]
    assert same_bits(s.feed(full_ids[PROMPT:PROMPT + 1]), g1_logits[PROMPT])
    s.drop_snapshot(snap)
    with pytest.raises(EngineError, match="no snapshot"):
        s.restore(snap)


def test_state_export_import_round_trip(model: Model, full_ids: list[int], g1_logits: np.ndarray) -> None:
    s = model.session(T)
    s.feed(full_ids[:20])
    blob = s.export_state()
    other = model.session(T)
    other.import_state(blob)
    assert same_bits(other.feed(full_ids[20:21]), g1_logits[20])
    with pytest.raises(EngineError, match="bytes"):
        other.import_state(blob[:-4])
    bad = bytearray(blob)
    bad[0] ^= 1
    with pytest.raises(EngineError, match="magic"):
        other.import_state(bytes(bad))


def test_cancel_taints_and_reset_recovers(model: Model, full_ids: list[int], g1_logits: np.ndarray) -> None:
    s = model.session(T)
    flag = CancelFlag()
    flag.set()
    with pytest.raises(Cancelled):
        s.feed(full_ids[:PROMPT], cancel=flag)
    assert s.tainted
    with pytest.raises(EngineError, match="unusable"):
        s.feed(full_ids[:1])
    s.reset()
    assert not s.tainted
    assert same_bits(s.feed(full_ids[:PROMPT]), g1_logits[PROMPT - 1])


def test_bad_ids_and_overflow_are_refused_without_taint(model: Model) -> None:
    s = model.session(4)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        s.feed([model.vocab])
    with pytest.raises(EngineError, match="context full"):
        s.feed([1, 2, 3, 4, 5])
    assert not s.tainted and s.length == 0
    s.feed([1, 2])
    assert s.length == 2


def test_closing_the_model_closes_its_sessions(tiny_dir: Path, full_ids: list[int]) -> None:
    m = Model(tiny_dir)
    s = m.session(T)
    s.feed(full_ids[:3])
    m.close()
    with pytest.raises(EngineError, match="closed"):
        s.feed(full_ids[3:4])
    with pytest.raises(EngineError, match="closed"):
        m.forward(full_ids[:2])
    del s  # freeing after the model is gone must not touch freed memory
