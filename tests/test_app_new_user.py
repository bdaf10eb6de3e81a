"""The chat app's defects a new user hit (issue 8, items 1-4, 8, 11, 12), each driven the way
the user met it: keys through Pilot (or through Textual's own terminal parser where the bug is
in what the terminal sends), the real engine on the tiny fixture, scripted samples."""
from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from k3chat.history import HistoryStore
from k3chat.tokenizer import Tokenizer

textual = pytest.importorskip("textual")

from textual import events  # noqa: E402
from textual._xterm_parser import XTermParser  # noqa: E402

from test_app import SIZE, Script, answer, home, make_app, model, run, screen_text, started, stored, tok, until  # noqa: E402,F401

from k3chat.app.widgets.transcript import UserMessage  # noqa: E402


def burst(app: Any, *keys: str) -> None:
    """Keys as a terminal delivers a burst (type-ahead, a slow SSH link): all queued before the
    app handles the first, unlike Pilot.press, which waits for the app between keys."""
    for key in keys:
        char = key if len(key) == 1 else ("\r" if key == "enter" else None)
        event = events.Key(key, char)
        event.set_sender(app)
        app._driver.send_message(event)


# --------------------------------------------------------------------------- item 1: input


def test_alt_enter_from_a_terminal_is_read_as_alt_enter(model: Any, tok: Tokenizer, tiny_dir: Path,
                                                         home: Path) -> None:
    make_app(model, tok, tiny_dir, Script())  # the app teaches Textual the sequence
    parser = XTermParser()
    keys = [e.key for e in parser.feed("a\x1b\rb") if isinstance(e, events.Key)]
    assert keys == ["a", "alt+enter", "b"]  # tmux's ESC CR; a plain enter would send the message


def test_alt_enter_inserts_a_newline(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    app = make_app(model, tok, tiny_dir, Script())

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pilot.press(*"one", "alt+enter", *"two")
            await pilot.pause(0.05)
            assert app.chat.prompt.text == "one\ntwo"
            assert not app.busy and not app.chat.query(UserMessage)

    run(scenario)


def test_keys_typed_in_the_same_burst_as_enter_are_kept(home: Path, model: Any, tok: Tokenizer,
                                                        tiny_dir: Path) -> None:
    app = make_app(model, tok, tiny_dir, Script(answer(tok, " r", " ok")))

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            burst(app, *"one", "enter", *"two")
            await until(pilot, lambda: app.turns_over == 1, "the turn to end")
            await pilot.pause(0.05)
            assert [u.text for u in app.chat.query(UserMessage)] == ["one"]
            assert app.chat.prompt.text == "two"  # typed while "one" was being sent
            assert stored(app.conv.session_id)[0] == {"role": "user", "content": "one"}

    run(scenario)


def test_a_refused_message_comes_back_with_what_was_typed_since(home: Path, model: Any, tok: Tokenizer,
                                                                tiny_dir: Path) -> None:
    store = HistoryStore()
    info = store.create("crashed")
    store.append(info.id, {"role": "user", "content": "are you there?"})  # unanswered: a new one is refused
    app = make_app(model, tok, tiny_dir, Script(), session=info.id)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: "has no answer" in screen_text(app), "the notice")
            burst(app, *"first", "enter", *"more")
            await pilot.pause(0.2)
            assert not app.busy and len(stored(info.id)) == 1
            assert app.chat.prompt.text == "first\nmore"

    run(scenario)


def test_the_draft_comes_back_after_an_edit_is_sent(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    app = make_app(model, tok, tiny_dir, Script(answer(tok, " a", " One."), answer(tok, " b", " Two.")))

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            app.chat.prompt.set_text("First")
            await pilot.press("enter")
            await until(pilot, lambda: app.turns_over == 1, "the first turn")
            app.chat.prompt.set_text("a draft")
            await pilot.press("ctrl+e")
            app.chat.prompt.set_text("First, edited")
            await pilot.press("enter")
            await until(pilot, lambda: app.turns_over == 2, "the edited turn")
            assert stored(app.conv.session_id)[0]["content"] == "First, edited"
            assert app.chat.prompt.text == "a draft" and not app.chat.editing

    run(scenario)


# --------------------------------------------------------------------------- item 8: the viewer


def test_viewer_escape_closes_only_the_find_box_and_n_jumps_after_enter(home: Path, model: Any, tok: Tokenizer,
                                                                         tiny_dir: Path) -> None:
    from textual.widgets import Input

    from k3chat.app.screens.viewer import ReasoningViewer

    app = make_app(model, tok, tiny_dir, Script())
    text = "first idea\nsecond idea\nthird idea"

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            app.push_screen(ReasoningViewer(text, "Reasoning"))
            await until(pilot, lambda: isinstance(app.screen, ReasoningViewer)
                        and bool(app.screen.query("#viewer-text")), "the viewer")
            viewer = app.screen
            area, box = viewer.query_one("#viewer-text"), viewer.query_one("#viewer-find", Input)
            await pilot.press("slash", *"idea")
            assert app.focused is box
            await pilot.press("escape")
            await pilot.pause(0.05)
            assert app.screen is viewer  # only the find box closed
            assert not viewer.query_one("#viewer-find-bar").display and app.focused is area
            await pilot.press("slash", "enter")  # the query is still there: first match
            await pilot.pause(0.05)
            assert area.selected_text == "idea" and area.selection.start == (0, 6)
            await pilot.press("n")
            assert area.selection.start == (1, 7) and box.value == "idea"  # jumped, typed nothing
            await pilot.press("n")
            assert area.selection.start == (2, 6)
            await pilot.press("N")
            assert area.selection.start == (1, 7) and box.value == "idea"
            await pilot.press("escape")  # from the text: closes the viewer
            await until(pilot, lambda: not isinstance(app.screen, ReasoningViewer), "the viewer to close")

    run(scenario)


# --------------------------------------------------------------------------- item 4: the theme


async def palette(pilot: Any, command: str) -> None:
    """Run a command of the palette (ctrl+p) the way a person does: type it, press enter."""
    from textual.command import CommandPalette

    app = pilot.app
    await pilot.press("ctrl+p")
    await until(pilot, lambda: isinstance(app.screen, CommandPalette), "the palette")
    await pick(pilot, command)


async def pick(pilot: Any, text: str) -> None:
    """Type ``text`` into the open palette and run its best match."""
    from textual.command import CommandList, CommandPalette

    app = pilot.app
    await pilot.press(*text)
    await until(pilot, lambda: isinstance(app.screen, CommandPalette)
                and app.screen.query_one(CommandList).option_count > 0, "the palette's matches")
    await pilot.pause(0.3)  # the search settles on the best match
    await pilot.press("enter")
    await pilot.pause(0.1)


def test_the_theme_chosen_in_the_palette_is_remembered(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    from dataclasses import replace

    from k3chat import paths

    first = make_app(model, tok, tiny_dir, Script())

    async def choose() -> None:
        async with first.run_test(size=SIZE) as pilot:
            await started(pilot)
            assert first.theme == "k3-dark"
            await palette(pilot, "Theme")
            await pick(pilot, "k3-light")
            assert first.theme == "k3-light"

    run(choose)
    second = make_app(model, tok, tiny_dir, Script())

    async def restart() -> None:
        async with second.run_test(size=SIZE) as pilot:
            await started(pilot)
            assert second.theme == "k3-light"  # remembered across starts

    run(restart)
    from k3chat.app.theming import app_state_path

    path = app_state_path()  # a private file beside config.toml (which is never rewritten)
    assert path.parent == paths.config_dir() and not paths.config_file().exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # config.toml's theme edited after the choice: the file wins again
    third = make_app(model, tok, tiny_dir, Script())
    third.settings = replace(third.settings, theme="textual-dark")

    async def edited() -> None:
        async with third.run_test(size=SIZE) as pilot:
            await started(pilot)
            assert third.theme == "textual-dark"

    run(edited)


# --------------------------------------------------------------------------- item 3: thinking effort


def test_thinking_effort_is_shown_asked_kept_per_session_and_restored(home: Path, model: Any, tok: Tokenizer,
                                                                       tiny_dir: Path) -> None:
    from k3chat.app.screens.dialogs import ConfirmScreen
    from k3chat.template import encode, render

    first = make_app(model, tok, tiny_dir, Script(answer(tok, " a", " One."), answer(tok, " b", " Two.")))
    seen: dict[str, Any] = {}

    async def change_and_quit() -> None:
        async with first.run_test(size=SIZE) as pilot:
            await started(pilot)
            status = first.chat.status
            assert "thinking high" in status.parts()  # the launch setting (make_app: effort high)
            first.chat.prompt.set_text("First")
            await pilot.press("enter")
            await until(pilot, lambda: first.turns_over == 1, "the first turn")
            records = first.conv.records
            old = encode(render(records, thinking=True, effort="high", add_generation_prompt=False), tok)
            new = encode(render(records, thinking=True, effort="low", add_generation_prompt=False), tok)
            same = next(i for i, (x, y) in enumerate(zip(old, new)) if x != y)
            await palette(pilot, "Thinking: low")
            await until(pilot, lambda: isinstance(first.screen, ConfirmScreen), "the question")
            question = first.screen.question
            assert f"re-reads all {len(new) - same:,} tokens" in question, question
            await pilot.press("n")  # kept as it was
            await pilot.pause(0.05)
            assert (first.thinking, first.effort) == (True, "high") and "thinking high" in status.parts()
            await palette(pilot, "Thinking: low")
            await until(pilot, lambda: isinstance(first.screen, ConfirmScreen), "the question")
            await pilot.press("y")
            await pilot.pause(0.05)
            assert "thinking low" in status.parts() and first.conv.effort == "low"
            titles = [c.title for c in first.get_system_commands(first.screen)]
            assert "Thinking: low (current)" in titles and "Thinking: high" in titles
            first.chat.prompt.set_text("Second")
            await pilot.press("enter")
            await until(pilot, lambda: first.turns_over == 2, "the second turn")
            seen["sid"] = first.conv.session_id
            await pilot.press("ctrl+q")

    run(change_and_quit)
    sid = seen["sid"]
    assert HistoryStore().load(sid).settings == {"thinking": True, "effort": "low"}  # stored with the session
    assert HistoryStore().load(sid).records[-1]["effort"] == "low"
    second = make_app(model, tok, tiny_dir, Script(answer(tok, " c", " Three.")), session=sid)

    async def resume() -> None:
        async with second.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: second.conv is not None, "the session")
            assert (second.thinking, second.effort) == (True, "low")  # not the launch setting (high)
            assert "thinking low" in second.chat.status.parts()
            second.chat.prompt.set_text("Third")
            await pilot.press("enter")
            await until(pilot, lambda: second.turns_over == 1, "the third turn")
            await pilot.press("ctrl+q")

    run(resume)
    last = HistoryStore().load(sid).records[-1]
    assert last["effort"] == "low" and last["tokens"]["reused"] > 0  # the saved state matched the history


def test_thinking_from_the_command_line_overrides_the_resumed_session_and_says_so(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    from k3chat.app import build_app
    from k3chat.settings import Settings

    store = HistoryStore()
    info = store.create("kept low")
    store.append(info.id, {"role": "user", "content": "hi"})
    store.append(info.id, {"role": "assistant", "content": "Hi.", "reasoning_content": "", "thinking": True,
                           "effort": "low"})
    base = make_app(model, tok, tiny_dir, Script())
    app = build_app(tiny_dir, settings=Settings(effort="max"), engine_factory=base.engine_factory, session=info.id,
                    thinking_given=True)  # k3chat chat --session ID --thinking-effort max

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: app.conv is not None, "the session")
            assert (app.effort, app.conv.effort) == ("max", "max")
            await until(pilot, lambda: "from the command line (this session had thinking low)"
                        in str(app.chat.query_one("#notice").render()), "the note")

    run(scenario)
    assert HistoryStore().load(info.id).settings == {"thinking": True, "effort": "max"}


# --------------------------------------------------------------------------- item 2: engine state on every exit


async def quit_during_a_turn(pilot: Any, how: str) -> None:
    app = pilot.app
    if how == "ctrl+c ctrl+c":  # quickly: the second one also aborts the step in flight
        burst(app, "ctrl+c", "ctrl+c")
    elif how == "ctrl+c, then ctrl+c":  # the turn stops, then the second one quits
        await pilot.press("ctrl+c")
        await until(pilot, lambda: not app.busy, "the turn to stop")
        await pilot.press("ctrl+c")
    elif how == "ctrl+q":
        await pilot.press("ctrl+q")
    else:
        os.kill(os.getpid(), signal.SIGTERM)
    await until(pilot, lambda: not app.is_running, "the app to quit")


def slow_steps(monkeypatch: pytest.MonkeyPatch, seconds: float) -> dict[str, bool]:
    """Each decode step takes ``seconds`` (a real model's step), so a second ctrl+c arrives
    while one is in flight and aborts it. Returns the switch (``["on"]``)."""
    from k3engine.model import Session

    feed = Session.feed
    switch = {"on": True}

    def slow(self: Session, ids: Any, **kw: Any) -> Any:
        if len(ids) == 1 and switch["on"]:
            time.sleep(seconds)
        return feed(self, ids, **kw)

    monkeypatch.setattr(Session, "feed", slow)
    return switch


@pytest.mark.parametrize("how", ["ctrl+c ctrl+c", "ctrl+c, then ctrl+c", "ctrl+q", "SIGTERM"])
def test_every_way_of_quitting_saves_the_engine_state(how: str, home: Path, model: Any, tok: Tokenizer,
                                                      tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from k3chat.conversation import state_path

    # Sampled one character at a time, the reasoning re-encodes to other ids when it is stored,
    # so the live state of the stopped turn does not line up with the history (as with real
    # model text): what can be saved without computing is the turn's boundary snapshot.
    chars = [i for ch in " hello world" for i in tok.encode_text(ch)]
    assert tok.encode_text(tok.decode(chars)) != chars
    script = Script(chars, filler=chars)
    slow = slow_steps(monkeypatch, 0.1)
    from k3chat.conversation import Conversation

    aborts: list[int] = []
    abort = Conversation.abort
    monkeypatch.setattr(Conversation, "abort", lambda self: (aborts.append(1), abort(self))[1])
    first = make_app(model, tok, tiny_dir, script, max_tokens=5000)
    seen: dict[str, Any] = {}

    async def interrupted() -> None:
        async with first.run_test(size=SIZE) as pilot:
            await started(pilot)
            assert signal.SIGTERM in first._signals  # else the signal would end pytest
            first.chat.prompt.set_text("Work")
            await pilot.press("enter")
            await until(pilot, lambda: script.samples >= 4, "generation")
            seen["sid"] = first.conv.session_id
            await quit_during_a_turn(pilot, how)

    run(interrupted)
    sid = seen["sid"]
    assert bool(aborts) == (how == "ctrl+c ctrl+c")  # the quick second ctrl+c aborted the step in flight
    assert stored(sid)[-1]["interrupted"] is True  # the history was saved ...
    path = state_path(sid)
    assert path.exists(), first.exit_notes  # ... and the engine state too
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert first.exit_notes == []
    assert any(f"--session {sid}" in line for line in first.goodbye())
    second = make_app(model, tok, tiny_dir, Script(answer(tok, " ok", " Done.")), session=sid)

    async def resumed() -> None:
        async with second.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: second.conv is not None, "the session")
            second.chat.prompt.set_text("Again")
            await pilot.press("enter")
            await until(pilot, lambda: second.turns_over == 1, "the turn")

    slow["on"] = False
    run(resumed)
    assert HistoryStore().load(sid).records[-1]["tokens"]["reused"] > 0  # the next start reused it


def test_sighup_saves_the_engine_state_too(home: Path, tiny_dir: Path, tmp_path: Path) -> None:
    import select
    import subprocess

    from test_app import HANGUP_SCRIPT

    from k3chat.conversation import state_path

    script = tmp_path / "hangup.py"
    # One character at a time: the stored text re-encodes to other ids, so the stopped turn's
    # live state does not line up with the history; only the boundary snapshot can be saved.
    one_by_one = '[i for ch in " hello world" for i in tok.encode_text(ch)]'
    script.write_text(HANGUP_SCRIPT.replace('ids = tok.encode_text(" hang on")', f"ids = {one_by_one}"))
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "K3CHAT_HOME": str(home)})
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        assert line.strip() == "GENERATING", line + proc.stdout.read()
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=30) == 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (info,) = HistoryStore().list()
    assert stored(info.id)[-1]["interrupted"] is True
    assert state_path(info.id).exists()  # the next start reuses the conversation


# --------------------------------------------------------------------------- items 11, 12: the command line


def test_chat_without_a_terminal_is_refused_at_once(home: Path, tmp_path: Path) -> None:
    import subprocess

    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "k3chat", "chat", "--demo"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "K3CHAT_HOME": str(home)})
    assert proc.returncode == 2, proc.stderr
    assert "needs a terminal" in proc.stderr and "standard input" in proc.stderr
    assert "k3chat run --prompt" in proc.stderr  # what to do instead
    assert time.monotonic() - start < 60 and HistoryStore().list() == []


def test_a_mistyped_model_directory_says_it_does_not_exist(home: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat.cli import main

    (tmp_path / "Kimi-K3").mkdir()
    for argv in (["run", str(tmp_path / "Kimi-K2"), "--prompt", "hi"], ["chat", str(tmp_path / "Kimi-K2")],
                 ["run", str(tmp_path / "Kimi-K2"), "--ids", "1,2"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"the model directory {tmp_path / 'Kimi-K2'} does not exist" in err, err
        assert f"did you mean {tmp_path / 'Kimi-K3'}?" in err
        assert "fix these fields" not in err and "config refused" not in err
    assert main(["run", str(tmp_path / "Kimi-K3"), "--prompt", "hi"]) == 2
    assert "has no config.json, so it is not a model directory" in capsys.readouterr().err


def test_the_path_of_config_json_is_taken_as_its_directory(home: Path, tiny_dir: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat.cli import main

    config = tiny_dir / "config.json"
    assert main(["run", str(config), "--ids", "1,2", "--gen", "1", "--threads", "1"]) == 0
    assert f"using its directory {tiny_dir}" in capsys.readouterr().err
    assert main(["chat", str(config)]) == 2  # accepted; refused here only for want of a terminal
    err = capsys.readouterr().err
    assert f"using its directory {tiny_dir}" in err and "needs a terminal" in err


def test_an_unknown_option_is_named(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat.cli import main

    assert main(["run", "--demo", "--promt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "unknown option --promt (did you mean --prompt?)" in err and "is required" not in err
    assert err.startswith("usage: k3chat run")
    assert main(["sessions", "show", "--jsn", "x"]) == 2
    assert "k3chat sessions show: unknown option --jsn" in capsys.readouterr().err
    assert main(["sessions", "list", "--json"]) == 0  # a known option of a nested command
