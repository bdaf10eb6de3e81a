"""The chat app on the built-in demo model, end to end, as a person uses it: type a question,
watch the reasoning stream, read the answer, the turn ends by itself, ask a follow-up that
uses the first answer. No scripted sampler: the real model, the real engine, greedy."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from k3chat.history import HistoryStore
from k3chat.settings import Settings

textual = pytest.importorskip("textual")

from k3chat.app import build_app  # noqa: E402
from k3chat.app.widgets.reasoning import ReasoningBlock  # noqa: E402
from k3chat.app.widgets.transcript import AnswerBlock  # noqa: E402


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


async def until(pilot: Any, condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


QUESTION, EXPECTED = "What is 36 + 47?", 36 + 47


def test_demo_answers_streams_reasoning_and_follows_up(home: Path) -> None:
    app = build_app(None, settings=Settings(max_tokens=800, effort="high"), demo=True, threads=2)
    live_reasoning: list[bool] = []

    async def ask(pilot: Any, text: str) -> None:
        before = app.turns_over
        app.chat.prompt.set_text(text)
        await pilot.press("enter")
        await until(pilot, lambda: app.turns_over > before, "the turn to end")
        await pilot.pause(0.05)

    async def scenario() -> None:
        async with app.run_test(size=(150, 45)) as pilot:
            await until(pilot, lambda: app.ready, "the demo model to open")
            assert app.engine.name == "k3chat demo"
            # the banner is drawn after the model opens: on a loaded machine not yet at `ready`
            await until(pilot, lambda: "Built-in demo model" in "\n".join(
                strip.text for strip in app.screen._compositor.render_strips()), "the banner to say what this is")
            real = app.chat.turn_event

            async def spy(event: Any, **kw: Any) -> None:
                if type(event).__name__ == "ReasoningToken":
                    block = app.chat.turn.reasoning if app.chat.turn is not None else None
                    live_reasoning.append(bool(block is not None and block.live))
                await real(event, **kw)

            app.chat.turn_event = spy  # type: ignore[method-assign]
            await ask(pilot, QUESTION)
            assert app.ui_errors == []
            reasoning = app.chat.query(ReasoningBlock).last()
            answer = app.chat.query(AnswerBlock).last()
            assert reasoning.tokens > 10 and "Ones:" in reasoning.text and not reasoning.live
            assert f"**{EXPECTED}**" in answer.text, answer.text
            await ask(pilot, "And add 7 to that.")
            answer2 = app.chat.query(AnswerBlock).last()
            # the follow-up starts from the first answer, and the demo gets this one right
            assert f"previous answer was {EXPECTED}" in app.chat.query(ReasoningBlock).last().text
            assert f"**{EXPECTED + 7}**" in answer2.text, answer2.text
            sid = app.conv.session_id
            await pilot.press("ctrl+q")
        records = HistoryStore().load(sid).records
        assert [r["role"] for r in records] == ["user", "assistant", "user", "assistant"]
        for r in records[1::2]:
            assert r.get("interrupted") is not True     # each turn ended by itself (end id)
        assert f"**{EXPECTED + 7}**" in records[3]["content"]

    asyncio.run(asyncio.wait_for(scenario(), 300))
    assert live_reasoning and all(live_reasoning[:5])   # the reasoning streamed while thinking
