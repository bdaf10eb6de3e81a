"""The app during a long prefill (issue 9, item 3), with Pilot on the tiny fixture: the
progress bar, ctrl+c at a chunk boundary, and a later start that continues from there."""
from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from k3chat import statefile
from k3chat.conversation import model_fingerprint_for, state_path
from k3chat.history import HistoryStore
from k3chat.settings import Settings
from k3chat.template import Grammar, encode, render
from k3chat.tokenizer import Tokenizer

textual = pytest.importorskip("textual")

from textual.widgets import ProgressBar  # noqa: E402

from k3chat.app import build_app  # noqa: E402
from k3chat.app.engine import Engine  # noqa: E402
from k3chat.app.screens.dialogs import ConfirmScreen  # noqa: E402

PIECE = 16
DOCUMENT = " ".join(f"clause {i} of the lease" for i in range(48))  # about 500 tokens: a shown prefill


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Any:
    from k3engine.model import Model

    m = Model(tiny_dir, threads=1)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


class Scripted:
    """A sampler factory: the answer's ids, then nothing (the turn ends with END)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, settings: Any, turn: int) -> Any:
        ids = list(self.ids)

        class _S:
            def sample(self, logits: Any) -> int:
                assert np.asarray(logits).ndim == 1
                return ids.pop(0)

        return _S()


def make_app(model: Any, tok: Tokenizer, tiny_dir: Path, answer: list[int], session: str | None = None) -> Any:
    def factory(model_dir: Path, settings: Settings, progress: Callable[[str], None]) -> Engine:
        options = {"sampler_factory": Scripted(answer), "prefill_piece": PIECE}
        return Engine(model=model, tokenizer=tok, model_dir=tiny_dir, name="tiny", owns_model=False,
                      conversation_options=options)

    return build_app(tiny_dir, settings=Settings(max_tokens=64, thinking=False), engine_factory=factory,
                     session=session)


async def until(pilot: Any, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 90))


def screen_text(app: Any) -> str:
    """What the screen shows, whitespace collapsed (a notice wraps across lines)."""
    return " ".join(" ".join(strip.text for strip in app.screen._compositor.render_strips()).split())


def test_ctrl_c_mid_prefill_keeps_the_message_and_the_next_start_asks_and_reads_only_the_rest(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from k3engine.model import Session

    g = Grammar(tok)
    answer = tok.encode_text(" It ends in May.") + list(g.closure) + [tok.end_of_msg_id]
    prompt = encode(render([{"role": "user", "content": DOCUMENT}], thinking=False, effort=None,
                           add_generation_prompt=True), tok)
    real = Session.feed

    def slow(self: Session, ids: Any, **kw: Any) -> Any:
        if len(ids) > 1:
            time.sleep(0.03)  # a piece takes long enough to be seen and stopped
        return real(self, ids, **kw)

    monkeypatch.setattr(Session, "feed", slow)
    app = make_app(model, tok, tiny_dir, answer)
    box: dict[str, Any] = {}

    async def first() -> None:
        async with app.run_test(size=(150, 45)) as pilot:
            await until(pilot, lambda: app.ready, "the model to open")
            app.chat.prompt.set_text(DOCUMENT)
            await pilot.press("enter")
            bar = app.chat.query_one("#progress-bar", ProgressBar)
            await until(pilot, lambda: app.chat.prefilling and (bar.progress or 0) > 0, "the prefill's bar")
            assert bar.total == len(prompt)
            shown = screen_text(app)
            assert "Reading the prompt:" in shown and f"/{len(prompt):,} tokens" in shown and "tok/s" in shown
            await pilot.press("ctrl+c")
            await until(pilot, lambda: not app.busy, "the prefill to stop")
            box["sid"] = sid = app.conv.session_id
            box["held"] = held = len(app.conv._fed)
            assert 0 < held < len(prompt) and held % PIECE == 0
            assert not app.chat.query_one("#progress").display  # the bar is gone
            assert "not yet answered" in screen_text(app)
            records = HistoryStore().load(sid).records
            assert [(r["role"], r["content"]) for r in records] == [("user", DOCUMENT)]
            await pilot.press("ctrl+q")
            await until(pilot, lambda: not app.is_running, "the app to quit", 10)

    run(first)
    sid, held = box["sid"], box["held"]
    sf = statefile.load_state(state_path(sid), fingerprint=model_fingerprint_for(tiny_dir))
    assert sf.n_tokens == held  # the state up to the chunk boundary, kept for the next start

    monkeypatch.setattr(Session, "feed", real)
    later = home.parent / "home-later"  # the same stopped session, for the "later" answer
    shutil.copytree(home, later)
    question = f"Continue reading the prompt? {len(prompt) - held:,} of {len(prompt):,} tokens left (held: {held:,})"

    def second(answer_key: str) -> Callable[[], Awaitable[None]]:
        again = make_app(model, tok, tiny_dir, answer, session=sid)

        async def scenario() -> None:
            async with again.run_test(size=(150, 45)) as pilot:
                await until(pilot, lambda: isinstance(again.screen, ConfirmScreen), "the question on start")
                assert again.conv is not None and again.conv.pending_user
                await until(pilot, lambda: question in screen_text(again), "the question's text")
                before = model.stats()["tokens_fed"]
                turns = again.turns_over
                await pilot.press(answer_key)
                if answer_key == "n":  # left for later: the note says how to continue
                    await pilot.pause(0.1)
                    assert again.turns_over == turns and not again.busy
                    assert model.stats()["tokens_fed"] == before
                    note = f"ctrl+r continues reading it ({len(prompt) - held:,} of {len(prompt):,} tokens left)"
                    assert note in screen_text(again)
                    await pilot.press("ctrl+r")
                await until(pilot, lambda: again.turns_over > turns, "the answer")
                # The engine read the rest of the prompt and the answer's steps, nothing more.
                assert model.stats()["tokens_fed"] - before == (len(prompt) - held) + (len(answer) - 1)
                records = HistoryStore().load(sid).records
                assert [(r["role"], r["content"]) for r in records] == [("user", DOCUMENT),
                                                                         ("assistant", " It ends in May.")]
                assert again.ui_errors == []
                await pilot.press("ctrl+q")

        return scenario

    run(second("y"))
    monkeypatch.setenv("K3CHAT_HOME", str(later))
    run(second("n"))
