"""The chat app, issue 8 items 5-7: settings per session (system prompt, sampler, max tokens)
and a regenerate that can differ; the stop reason and exact counts kept in the record; one
context figure. Driven through Pilot on the tiny fixture with scripted samples (as test_app),
and on the demo model where the sampler itself matters."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from k3chat.history import HistoryStore, record_problem
from k3chat.tokenizer import Tokenizer

textual = pytest.importorskip("textual")

from test_app import SIZE, Script, answer, home, make_app, model, run, started, tok, until  # noqa: E402,F401

from k3chat.app.widgets.transcript import AssistantMessage  # noqa: E402


def shown_turns(app: Any) -> list[tuple[str, str]]:
    """(reasoning title, status line) of every answer on the screen."""
    out = []
    for turn in app.chat.transcript.query(AssistantMessage):
        title = turn.reasoning._title().plain if turn.reasoning is not None else ""
        out.append((title.lstrip("\u25be\u25b8 "), turn._status))
    return out


# --------------------------------------------------------------------------- item 6


def test_stop_reason_and_exact_counts_survive_redraw_and_resume(home: Path, model: Any, tok: Tokenizer,
                                                                 tiny_dir: Path) -> None:
    # the 14-token limit cuts the turn inside the answer
    script = Script(answer(tok, " one two three", " Four five six seven eight nine ten eleven twelve")[:14])
    app = make_app(model, tok, tiny_dir, script, max_tokens=14)
    seen: dict[str, Any] = {}

    async def first() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            app.chat.prompt.set_text("Count")
            await pilot.press("enter")
            await until(pilot, lambda: app.turns_over == 1, "the turn")
            await pilot.pause(0.1)
            seen["live"] = shown_turns(app)
            await app.toggle_markdown()  # a redraw from the stored records
            await pilot.pause(0.1)
            seen["redrawn"] = shown_turns(app)
            seen["sid"] = app.conv.session_id
            await pilot.press("ctrl+q")

    run(first)
    record = HistoryStore().load(seen["sid"]).records[-1]
    assert record["stop"] == "limit" and record["interrupted"] is True
    assert record_problem(record) is None
    assert isinstance(record["tokens"]["reasoning"], int) and record["tokens"]["reasoning"] > 0
    live = seen["live"]
    assert "14-token limit" in live[0][1], live
    assert "\u2248" not in live[0][0] and f"Thought: {record['tokens']['reasoning']:,} tokens" in live[0][0], live
    assert seen["redrawn"] == live  # same reason, same exact counts

    again = make_app(model, tok, tiny_dir, Script(), session=seen["sid"], max_tokens=14)

    async def resume() -> None:
        async with again.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: again.conv is not None and not again.loading_session, "the session")
            await pilot.pause(0.1)
            seen["resumed"] = shown_turns(again)

    run(resume)
    assert seen["resumed"] == live


def test_record_problem_checks_the_stop_field() -> None:
    base = {"role": "assistant", "content": "x", "interrupted": True}
    assert record_problem({**base, "stop": "limit"}) is None
    assert "stop must be one of" in (record_problem({**base, "stop": "bored"}) or "")
    assert "only allowed on assistant" in (record_problem({"role": "user", "content": "x", "stop": "end"}) or "")


# --------------------------------------------------------------------------- item 7


def held_tokens(records: list[dict[str, Any]], tok: Tokenizer, effort: str = "high") -> int:
    """The history as the model reads it, rendered here from the stored records."""
    from k3chat.template import encode, render

    return len(encode(render(records, thinking=True, effort=effort, add_generation_prompt=False), tok))


def context_part(app: Any) -> str:
    return next((p for p in app.chat.status.parts() if p.startswith("ctx ")), "")


def test_the_context_figure_is_one_figure_across_turns_quitting_and_restart(home: Path, model: Any,
                                                                            tok: Tokenizer, tiny_dir: Path) -> None:
    app = make_app(model, tok, tiny_dir, Script(answer(tok, " a b c", " One."), answer(tok, " d", " Two.")))
    seen: dict[str, Any] = {}

    async def first() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            during: list[int] = []
            original = app.chat.status.update_stats
            app.chat.status.update_stats = lambda stats: (during.append(stats.context_used), original(stats))[1]
            for n, text in enumerate(("First", "Second"), 1):
                app.chat.prompt.set_text(text)
                await pilot.press("enter")
                await until(pilot, lambda: app.turns_over == n, "the turn")
                await pilot.pause(0.05)
                held = held_tokens(HistoryStore().load(app.conv.session_id).records, tok)
                assert context_part(app).startswith(f"ctx {held:,}/"), (context_part(app), held)
                assert during and max(during) <= held + 2  # during the turn: what it has fed so far
                during.clear()
            seen["ctx"] = context_part(app)
            assert app.chat.status.speed  # the last turn's speed is shown...
            await pilot.press("ctrl+n")
            await pilot.pause(0.05)
            assert app.chat.status.speed == "" and context_part(app) == ""  # ...and cleared for a new session
            assert app.chat.status.cache == "" and app.chat.status.per_token == ""
            seen["sid"] = HistoryStore().list()[0].id
            await pilot.press("ctrl+q")

    run(first)
    again = make_app(model, tok, tiny_dir, Script(), session=seen["sid"])

    async def resume() -> None:
        async with again.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: again.conv is not None and not again.loading_session, "the session")
            seen["resumed"] = context_part(again)

    run(resume)
    assert seen["resumed"] == seen["ctx"]  # the same figure after a restart, not an estimate ("~")
