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
            await until(pilot, lambda: again.conv is not None and bool(shown_turns(again)), "the session shown")
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
            await until(pilot, lambda: again.conv is not None and context_part(again) != "", "the context figure")
            seen["resumed"] = context_part(again)

    run(resume)
    assert seen["resumed"] == seen["ctx"]  # the same figure after a restart, not an estimate ("~")


# --------------------------------------------------------------------------- item 5


class Recording(Script):
    """A Script that also keeps the sampler settings each turn was given."""

    def __init__(self, *scripts: list[int]) -> None:
        super().__init__(*scripts)
        self.given: list[Any] = []

    def __call__(self, settings: Any, turn: int) -> Any:
        self.given.append(settings)
        return super().__call__(settings, turn)


async def fill(pilot: Any, **values: str) -> None:
    from textual.widgets import Input

    for name, value in values.items():
        pilot.app.screen.query_one(f"#{name}", Input).value = value
    await pilot.pause(0.05)


def test_settings_dialog_is_checked_stored_with_the_session_and_shown_when_resumed(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    from textual.widgets import Checkbox, Input, Static, TextArea

    from k3chat.app.screens.settings import STARTED_NOTE, SettingsScreen

    script = Recording(answer(tok, " a", " One."))
    app = make_app(model, tok, tiny_dir, script)
    seen: dict[str, Any] = {}

    async def first() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            assert "greedy" in app.chat.status.parts()
            await pilot.press("ctrl+o")
            await until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings dialog")
            dialog = app.screen
            dialog.query_one("#system", TextArea).text = "You answer in one word."
            dialog.query_one("#sampling", Checkbox).value = True
            await fill(pilot, temperature="0", top_k="5", seed="42", max_tokens="20")
            await pilot.press("ctrl+s")
            error = dialog.query_one("#settings-error", Static)
            assert isinstance(app.screen, SettingsScreen) and error.display  # refused, the dialog stays
            assert "Temperature: must be > 0" in str(error.render()), str(error.render())
            await fill(pilot, temperature="0.7")
            await pilot.press("ctrl+s")
            await until(pilot, lambda: not isinstance(app.screen, SettingsScreen), "the dialog to close")
            assert "sampling t 0.7 p 0.95 k 5" in app.chat.status.parts()
            app.chat.prompt.set_text("Hello")
            await pilot.press("enter")
            await until(pilot, lambda: app.turns_over == 1, "the turn")
            seen["sid"] = app.conv.session_id
            await pilot.press("ctrl+q")

    run(first)
    used = script.given[0]
    assert (used.greedy, used.temperature, used.top_k, used.seed) == (False, 0.7, 5, 42)
    loaded = HistoryStore().load(seen["sid"])
    assert loaded.records[0] == {**loaded.records[0], "role": "system", "content": "You answer in one word."}
    assert {k: loaded.settings[k] for k in ("sampling", "temperature", "top_k", "seed", "max_tokens")} == {
        "sampling": True, "temperature": 0.7, "top_k": 5, "seed": 42, "max_tokens": 20}
    again = make_app(model, tok, tiny_dir, Recording(answer(tok, " b", " Two.")), session=seen["sid"])

    async def resume() -> None:
        async with again.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: again.conv is not None and not again.loading_session, "the session")
            assert "sampling t 0.7 p 0.95 k 5" in again.chat.status.parts()  # shown when resumed
            assert again.conv.max_tokens == 20 and again.conv.sampler.seed == 42
            await pilot.press("ctrl+o")
            await until(pilot, lambda: isinstance(again.screen, SettingsScreen), "the settings dialog")
            dialog = again.screen
            assert dialog.query_one("#temperature", Input).value == "0.7"
            assert dialog.query_one("#seed", Input).value == "42"
            assert dialog.query_one("#system", TextArea).text == "You answer in one word."
            assert str(dialog.query_one("#system-note", Static).render()) == STARTED_NOTE
            dialog.query_one("#system", TextArea).text = "Be verbose."
            await pilot.press("ctrl+s")
            await until(pilot, lambda: not isinstance(again.screen, SettingsScreen), "the dialog to close")
            assert again.system_prompt == "You answer in one word."  # this conversation keeps its own
            await pilot.press("ctrl+n")
            await pilot.pause(0.05)
            assert again.system_prompt == "Be verbose." and "greedy" in again.chat.status.parts()

    run(resume)
    assert HistoryStore().load(seen["sid"]).records[0]["content"] == "You answer in one word."


def test_ctrl_r_on_a_greedy_session_gives_another_answer_and_says_how(home: Path, model: Any, tok: Tokenizer,
                                                                      tiny_dir: Path) -> None:
    from k3chat.app.screens.help import help_table

    app = make_app(model, tok, tiny_dir, None, max_tokens=8, thinking=False)  # the real sampler
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            app.chat.prompt.set_text("Hello")
            await pilot.press("enter")
            await until(pilot, lambda: app.turns_over == 1, "the turn")
            seen["first"] = app.conv.records[-1]["content"]
            assert app.conv.sampler.greedy
            await pilot.press("ctrl+r")
            await until(pilot, lambda: app.turns_over == 2, "the regenerated turn")
            seen["again"] = app.conv.records[-1]
            seen["said"] = [str(n.message) for n in app._notifications]
            assert app.conv.sampler.greedy  # the session stays greedy: only that answer sampled

    run(scenario)
    again = seen["again"]
    assert again["sampler"]["greedy"] is False and isinstance(again["sampler"]["seed"], int)
    assert again["content"] != seen["first"]
    assert any("greedy decoding would give the same answer again" in s for s in seen["said"]), seen["said"]
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(help_table())
    assert "regenerate the last answer with a new seed" in console.export_text()
