"""Exact speculative decoding (issue 10, item 3).

The premise first: the logits of positions fed together in one pass are bit-identical to
feeding them one at a time, on every fixture and the demo model. Then the engine's verify
feed and its rollback (``Session.verify`` / ``Session.accept``), the drafter, and the
conversation loop, whose output and final state must equal serial decoding's bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from k3engine.model import Model

SEQ = [(i * 37 + 11) % 900 for i in range(16)]  # a prompt every vocabulary holds (>= 991 ids)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module", params=["tiny", "wide", "demo"])
def any_model(request: pytest.FixtureRequest) -> Model:
    """Every fixture of engine/fixture.py and the shipped demo model."""
    if request.param == "demo":
        from k3chat.demo import model_dir

        path = model_dir()
        if not (path / "config.json").is_file():
            pytest.fail(f"the shipped demo model is missing at {path}")
    else:
        path = request.getfixturevalue(f"{request.param}_dir")
    m = Model(path, threads=2)
    yield m
    m.close()


@pytest.mark.parametrize("together", [2, 5, 9])
def test_positions_fed_together_have_serial_logits(any_model: Model, together: int) -> None:
    head, tail = SEQ[:5], SEQ[5:5 + together]
    serial = any_model.session(32)
    serial.feed(head)
    one_by_one = np.stack([serial.feed([t]) for t in tail])
    batched = any_model.session(32)
    batched.feed(head)
    assert same_bits(batched.feed(tail, all_logits=True), one_by_one)
    assert batched.export_state() == serial.export_state()


# ------------------------------------------------------------------ engine: verify and accept


def _serial(m: Model, head: list[int], tail: list[int]) -> tuple[np.ndarray, bytes]:
    s = m.session(32)
    s.feed(head)
    rows = np.stack([s.feed([t]) for t in tail]) if tail else np.empty((0, m.vocab), np.float32)
    return rows, bytes(s.export_state())


@pytest.mark.parametrize("n", [1, 4, 9])
def test_verify_then_accept_any_prefix_equals_serial_feeding(any_model: Model, n: int) -> None:
    head, tail = SEQ[:5], SEQ[5:5 + n]
    rows, _ = _serial(any_model, head, tail)
    for keep in sorted({0, 1, n // 2, n - 1, n}):
        s = any_model.session(32)
        s.feed(head)
        before = bytes(s.export_state())
        assert same_bits(s.verify(tail), rows)
        assert bytes(s.export_state()) == before, "a verify feed must not advance the session"
        s.accept(keep)
        _, state = _serial(any_model, head, tail[:keep])
        assert s.length == len(head) + keep and s.ids == head + tail[:keep]
        assert bytes(s.export_state()) == state, f"state after accepting {keep} of {n} differs from serial"
        # and the session goes on exactly as a serial one: the next step's logits agree
        nxt = SEQ[5 + keep]
        s2 = any_model.session(32)
        s2.feed(head + tail[:keep])
        assert same_bits(s.feed([nxt]), s2.feed([nxt]))


def test_verify_with_many_threads_and_scalar_kernels_keeps_bits(tiny_dir: Path) -> None:
    ref = Model(tiny_dir, threads=1)
    rows, state = _serial(ref, SEQ[:5], SEQ[5:12])
    for threads, scalar in ((4, False), (3, True)):
        m = Model(tiny_dir, threads=threads, scalar=scalar)
        s = m.session(32)
        s.feed(SEQ[:5])
        assert same_bits(s.verify(SEQ[5:12]), rows)
        s.accept(7)
        assert bytes(s.export_state()) == state


def test_accept_needs_a_pending_verify(tiny_dir: Path) -> None:
    from k3engine.model import EngineError

    m = Model(tiny_dir)
    s = m.session(32)
    s.feed(SEQ[:5])
    with pytest.raises(EngineError, match="no verify feed to accept"):
        s.accept(1)
    s.verify(SEQ[5:8])
    with pytest.raises(EngineError, match="can accept 0..3 verified positions, got 4"):
        s.accept(4)
    s.feed([SEQ[5]])  # another feed drops the pending verify: its rows are overwritten
    with pytest.raises(EngineError, match="no verify feed to accept"):
        s.accept(1)
    assert s.length == 6 and not s.tainted


def test_verify_past_the_context_end_is_refused_and_changes_nothing(tiny_dir: Path) -> None:
    from k3engine.model import EngineError

    m = Model(tiny_dir)
    s = m.session(8)
    s.feed(SEQ[:5])
    before = bytes(s.export_state())
    with pytest.raises(EngineError, match="context full: 5 positions fed \\+ 4 to verify > capacity 8"):
        s.verify(SEQ[5:9])
    assert bytes(s.export_state()) == before and not s.tainted
    s.verify(SEQ[5:8])  # exactly up to the end is fine
    s.accept(3)
    assert s.length == 8


def test_cancel_during_verify_leaves_the_session_as_it_was(tiny_dir: Path) -> None:
    from k3engine.model import Cancelled, CancelFlag

    m = Model(tiny_dir)
    s = m.session(32)
    s.feed(SEQ[:5])
    before = bytes(s.export_state())
    flag = CancelFlag()
    flag.set()
    with pytest.raises(Cancelled):
        s.verify(SEQ[5:9], cancel=flag)
    assert not s.tainted and bytes(s.export_state()) == before
    from k3engine.model import EngineError
    with pytest.raises(EngineError, match="no verify feed"):
        s.accept(1)
    rows, state = _serial(m, SEQ[:5], SEQ[5:9])
    assert same_bits(s.verify(SEQ[5:9]), rows)
    s.accept(4)
    assert bytes(s.export_state()) == state


def test_read_failure_mid_verify_leaves_the_session_as_it_was(tiny_dir: Path) -> None:
    from k3engine.model import ExpertReadError

    from k3engine.model import StreamOptions

    # a cache of 3 experts of 16,384 B: a 4-token pass reads its layer's experts again
    m = Model(tiny_dir, streaming=StreamOptions(expert_cache_bytes=3 * 16384))
    s = m.session(32)
    s.feed(SEQ[:5])
    before = bytes(s.export_state())
    last = m.config.n_layers - 1
    m.inject_fault(last, -2)  # the last layer: every earlier layer of the pass has run
    with pytest.raises(ExpertReadError):
        s.verify(SEQ[5:9])
    assert not s.tainted and bytes(s.export_state()) == before
