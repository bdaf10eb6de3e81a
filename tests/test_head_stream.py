"""lm_head streamed in row blocks (issue 13 item 3): the same bits as lm_head held.

The tiny fixture's lm_head (1,280 rows) fits in one 32 MiB block, so the planner would never
stream it; the block size is shrunk to 7 rows here (183 blocks, the last one ragged) so that
its smallest plan streams lm_head as the real K3's does.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from k3engine import planner as pl
from k3engine.config import load_config
from k3engine.model import Model, StreamOptions, TrunkReadError

BLOCK_ROWS = 7


@pytest.fixture()
def small_blocks(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> int:
    cfg = load_config(tiny_dir)
    row = cfg.hidden * 2  # one BF16 lm_head row
    monkeypatch.setattr(pl, "HEAD_BLOCK_BYTES", BLOCK_ROWS * row + row // 2)
    return BLOCK_ROWS


def smallest_plan(tiny_dir: Path, context: int) -> pl.Plan:
    cfg = load_config(tiny_dir)
    ts = pl.tensor_sizes_from_dir(tiny_dir, cfg)
    return pl.make_plan(cfg, ts, pl.minimum_budget(cfg, ts, context), context,
                        check_machine=False)


def greedy(m: Model, prompt: list[int], steps: int) -> tuple[list[int], list[bytes]]:
    """Prefill, then greedy decode: the tokens and every step's logits as bytes."""
    s = m.session(len(prompt) + steps)
    logits = s.feed(prompt)
    tokens, rows = [], [logits.tobytes()]
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = s.feed([tokens[-1]])
        rows.append(logits.tobytes())
    return tokens, rows


def test_smallest_plan_streams_lm_head_with_the_same_bits(tiny_dir: Path, small_blocks: int
                                                          ) -> None:
    cfg = load_config(tiny_dir)
    plan = smallest_plan(tiny_dir, 64)
    assert plan.head_stream and plan.head_block_rows == small_blocks
    assert plan.lm_head_bytes == small_blocks * cfg.hidden * 2  # the buffer, not the matrix
    opts = plan.stream_options(reader_threads=2)
    assert opts.head_block_rows == small_blocks and opts.trunk_stream and opts.embed_stream
    prompt = [(37 * i + 11) % cfg.vocab for i in range(20)]
    with Model(tiny_dir, threads=2, streaming=replace(opts, head_block_rows=0)) as held:
        want_full = held.forward(prompt)
        want = greedy(held, prompt, 6)
        assert held.stats()["head_bytes_read"] == 0
    with Model(tiny_dir, threads=2, streaming=opts) as m:
        full = m.forward(prompt)
        before = m.stats()
        got = greedy(m, prompt, 6)
        after = m.stats()
    assert full.tobytes() == want_full.tobytes()
    assert got == want  # greedy tokens and every step's logits, bit for bit
    # each pass that wants logits reads lm_head whole: the prefill and 6 decode steps
    head = cfg.vocab * cfg.hidden * 2
    assert plan.head_read_per_token == head
    assert after["head_bytes_read"] - before["head_bytes_read"] == 7 * head


@pytest.mark.parametrize("rows", [1, 3, 1279, 1280, 5000])
def test_block_size_never_moves_a_bit(tiny_dir: Path, rows: int) -> None:
    ids = [(11 * i + 5) % 1280 for i in range(12)]
    with Model(tiny_dir) as held:
        want = held.forward(ids)
    with Model(tiny_dir, streaming=StreamOptions(head_block_rows=rows)) as m:
        got = m.forward(ids)
    assert got.tobytes() == want.tobytes()


def test_failed_lm_head_block_read_is_a_trunk_read_error(tiny_dir: Path) -> None:
    """A block that cannot be read fails the step as any trunk read does (status 6, exit 1
    in the front-ends): it names the rows, shard and offset; the session must recover."""
    with Model(tiny_dir, streaming=StreamOptions(head_block_rows=100)) as m:
        s = m.session(16)
        s.feed([1, 2, 3])
        m.inject_fault(0, -3)
        with pytest.raises(TrunkReadError) as info:
            s.feed([4])
        msg = str(info.value)
        assert "read of lm_head rows 0..99 failed" in msg and "offset" in msg
        assert "model-" in msg or ".safetensors" in msg  # the shard's path
        assert s.tainted
        s.reset()
        again = s.feed([1, 2, 3, 4])  # the fault is consumed: the next read succeeds
    with Model(tiny_dir) as held:
        assert again.tobytes() == held.forward([1, 2, 3, 4])[-1].tobytes()


def test_negative_block_rows_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="head_block_rows"):
        Model(tiny_dir, streaming=StreamOptions(head_block_rows=-1))
