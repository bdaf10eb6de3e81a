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

SEQ = [(i * 37 + 11) % 900 for i in range(14)]  # a prompt every vocabulary holds (>= 991 ids)


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
