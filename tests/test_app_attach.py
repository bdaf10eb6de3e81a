"""Attaching files in the app (Pilot, tiny fixture): the picker (directory tree and path box),
the palette entry, chips with name, size and token count, removing one, a refused file shown
in the app, and a message sent with its attachments as `k3chat run --file` sends it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from k3chat.history import HistoryStore
from k3chat.template import encode, render
from k3chat.tokenizer import Tokenizer

pytest.importorskip("textual")

from textual.widgets import DirectoryTree, Input  # noqa: E402

from k3chat.app.screens.attach import AttachScreen  # noqa: E402
from k3chat.app.widgets.attachments import AttachmentChip  # noqa: E402
from k3chat.app.widgets.transcript import UserMessage  # noqa: E402
from test_app import SIZE, Script, answer, home, make_app, model, run, screen_text, started, tok, until  # noqa: E402,F401

CSV = b"region,total\nnorth,1204\n"


def block(name: str, label: str, data: bytes, n: int = 1, of: int = 1) -> str:
    """One attachment as the model reads it, written out by hand (k3chat.attachments' form)."""
    which = f'attachment {n} of {of}: "{name}"'
    return f"==== {which} ({label}, {len(data)} bytes) ====\n{data.decode()}\n==== end of {which} ===="


async def pick_by_path(pilot: Any, path: str) -> None:
    app = pilot.app
    before = len(app.attach_events)
    await pilot.press("ctrl+l")
    await until(pilot, lambda: isinstance(app.screen, AttachScreen), "the picker")
    box = app.screen.query_one("#attach-path", Input)
    box.focus()
    box.value = path
    await pilot.press("enter")
    await until(pilot, lambda: len(app.attach_events) > before, f"{path} to be attached or refused")
    await pilot.pause(0.05)


def test_picker_chips_and_send(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    cwd = home.parent  # the home fixture made it the working directory
    (cwd / "q3.csv").write_bytes(CSV)
    (cwd / "notes.txt").write_bytes(b"North is ours.")
    (cwd / "photo.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    app = make_app(model, tok, tiny_dir, Script(answer(tok, " Sum.", " 1204.")))

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            titles = [c.title for c in app.get_system_commands(app.screen)]
            assert "Attach file..." in titles
            # The tree starts at the working directory: enter on a file attaches it.
            await pilot.press("ctrl+l")
            await until(pilot, lambda: isinstance(app.screen, AttachScreen), "the picker")
            tree = app.screen.query_one(DirectoryTree)
            assert Path(tree.path) == cwd
            await until(pilot, lambda: any(str(n.label) == "notes.txt" for n in tree.root.children), "the tree")
            line = next(n for n in tree.root.children if str(n.label) == "notes.txt").line
            assert isinstance(app.focused, Input)  # the path box first; tab reaches the tree
            await pilot.press("shift+tab")
            assert app.focused is tree
            tree.cursor_line = line
            await pilot.press("enter")
            await until(pilot, lambda: app.attach_events == ["notes.txt"], "notes.txt to be attached")
            assert not isinstance(app.screen, AttachScreen)
            # The path box, relative to the working directory.
            await pick_by_path(pilot, "q3.csv")
            chips = app.chat.query(AttachmentChip)
            assert [c.attachment.name for c in chips] == ["notes.txt", "q3.csv"]
            csv_tokens = len(tok.encode_text(block("q3.csv", "CSV", CSV)))
            assert chips[1].tokens == csv_tokens
            text = screen_text(app)
            assert f"q3.csv \u00b7 24 B \u00b7 {csv_tokens:,} tokens" in text and "notes.txt \u00b7 14 B" in text
            # A binary file is refused in the app, with the reason; nothing crashes.
            await pick_by_path(pilot, "photo.bin")
            assert "NUL byte at offset 8" in screen_text(app)
            assert len(app.chat.query(AttachmentChip)) == 2 and app.ui_errors == []
            # Remove the first chip from the keyboard.
            app.chat.query(AttachmentChip).first().focus()
            await pilot.press("delete")
            await pilot.pause(0.05)
            assert [c.attachment.name for c in app.chat.query(AttachmentChip)] == ["q3.csv"]
            # Send: the files go with the message; the transcript shows them by name only.
            app.chat.prompt.set_text("North total?")
            app.chat.prompt.focus()
            before = app.turns_over
            await pilot.press("enter")
            await until(pilot, lambda: app.turns_over > before, "the turn to end")
            await pilot.pause(0.05)
            assert not app.chat.query(AttachmentChip) and app.ui_errors == []
            user = app.chat.query_one(UserMessage)
            assert [a["name"] for a in user.attachments] == ["q3.csv"]
            shown = screen_text(app)
            assert "\U0001f4ce q3.csv \u00b7 CSV \u00b7 24 B" in shown and "north,1204" not in shown
            records = HistoryStore().load(app.conv.session_id).records
            assert records[0]["content"] == "North total?"
            assert [(a["name"], a["text"]) for a in records[0]["attachments"]] == [("q3.csv", CSV.decode())]
            # What the model read is the documented form, as `run --file` renders it.
            seen = [{"role": "user", "content": block("q3.csv", "CSV", CSV) + "\n\nNorth total?"}, records[1]]
            assert app.conv.history_tokens() == len(encode(render(seen, thinking=True, effort="high",
                                                                  add_generation_prompt=False), tok))

    run(scenario)


def test_a_refused_message_keeps_its_chips(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    cwd = home.parent
    (cwd / "long.txt").write_text("the pump log reads 7 bar\n" * 40)
    app = make_app(model, tok, tiny_dir, Script(), max_tokens=64, context=200)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pick_by_path(pilot, "long.txt")
            app.chat.prompt.set_text("Summarise")
            app.chat.prompt.focus()
            before = app.turns_over
            await pilot.press("enter")
            await until(pilot, lambda: app.turns_over > before, "the refusal")
            await pilot.pause(0.05)
            text = screen_text(app)
            assert "does not fit the context" in text and "--context 1024" in text
            assert [c.attachment.name for c in app.chat.query(AttachmentChip)] == ["long.txt"]
            assert app.chat.prompt.text == "Summarise"
            assert HistoryStore().list() == [] and app.ui_errors == []

    run(scenario)


def test_an_edited_message_still_shows_its_files(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    """ctrl+e keeps the message's files (Conversation.edit_last); the redrawn message shows them."""
    (home.parent / "q3.csv").write_bytes(CSV)
    app = make_app(model, tok, tiny_dir, Script(answer(tok, " a", " One."), answer(tok, " b", " Two.")))

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pick_by_path(pilot, "q3.csv")
            app.chat.prompt.set_text("North total?")
            app.chat.prompt.focus()
            before = app.turns_over
            await pilot.press("enter")
            await until(pilot, lambda: app.turns_over > before, "the first answer")
            await pilot.press("ctrl+e")
            assert app.chat.editing and app.chat.prompt.text == "North total?"
            app.chat.prompt.set_text("South total?")
            before = app.turns_over
            await pilot.press("enter")
            await until(pilot, lambda: app.turns_over > before, "the edited message's answer")
            await pilot.pause(0.05)
            user = app.chat.query_one(UserMessage)
            assert user.text == "South total?" and [a["name"] for a in user.attachments] == ["q3.csv"]
            assert "\U0001f4ce q3.csv \u00b7 CSV \u00b7 24 B" in screen_text(app)
            records = HistoryStore().load(app.conv.session_id).records
            assert records[0]["content"] == "South total?" and records[0]["attachments"][0]["name"] == "q3.csv"
            assert app.ui_errors == []

    run(scenario)


def test_a_refused_message_offers_a_restart_with_the_larger_context(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    """y: nothing sent or saved, the app exits with a restart request (context 1024, the
    planner's memory) carrying the message and its file; the next app puts them back."""
    from k3chat.context_fit import memory_text, planned_minimum
    from k3chat.restart import draft_path, hand_over
    from k3chat.app.screens.dialogs import ConfirmScreen

    (home.parent / "long.txt").write_text("the pump log reads 7 bar\n" * 40)
    memory = memory_text(planned_minimum(tiny_dir, 1024) or 0)
    app = make_app(model, tok, tiny_dir, Script(), max_tokens=64, context=200)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pick_by_path(pilot, "long.txt")
            app.chat.prompt.set_text("Summarise")
            app.chat.prompt.focus()
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            question = f"Restart this session with context 1,024 (memory {memory})?"
            await until(pilot, lambda: question in screen_text(app), "the question's text")
            await pilot.press("y")
            await until(pilot, lambda: not app.is_running, "the app to exit")

    run(scenario)
    request = app.restart
    assert request is not None and (request.session, request.context, request.memory) == (None, 1024, memory)
    assert request.draft.text == "Summarise"
    assert [a["name"] for a in request.draft.attachments] == ["long.txt"]
    assert HistoryStore().list() == [] and app.ui_errors == []

    hand_over(request.draft, None)  # what `k3chat chat` does before it starts again
    again = make_app(model, tok, tiny_dir, Script(), max_tokens=64, context=1024)

    async def restarted() -> None:
        async with again.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: again.chat.prompt.text == "Summarise", "the message back in the input")
            await until(pilot, lambda: len(again.chat.query(AttachmentChip)) == 1, "its file back as a chip")
            assert again.chat.query_one(AttachmentChip).attachment.name == "long.txt"
            assert not draft_path().exists()

    run(restarted)


def test_no_to_the_restart_leaves_the_message_in_the_input(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    from k3chat.app.screens.dialogs import ConfirmScreen

    app = make_app(model, tok, tiny_dir, Script(), max_tokens=64, context=200)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            app.chat.prompt.set_text("the pump log reads 7 bar " * 40)
            app.chat.prompt.focus()
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            await pilot.press("n")
            await pilot.pause(0.1)
            assert app.is_running and app.restart is None
            assert "does not fit the context" in screen_text(app)
            assert app.chat.prompt.text.startswith("the pump log")

    run(scenario)


def test_a_restart_keeps_the_users_memory_when_it_already_holds_the_larger_context(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    """Someone who gave --memory 64G must not be restarted with the planner's minimum."""
    from types import SimpleNamespace

    from k3chat.app.screens.dialogs import ConfirmScreen

    (home.parent / "long.txt").write_text("the pump log reads 7 bar\n" * 40)
    app = make_app(model, tok, tiny_dir, Script(), max_tokens=64, context=200)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            app.engine.plan = SimpleNamespace(budget=64 << 30, lookahead=0, process_bytes=0)  # this run's budget
            await pick_by_path(pilot, "long.txt")
            app.chat.prompt.set_text("Summarise")
            app.chat.prompt.focus()
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the question")
            assert "Restart this session with context 1,024?" in screen_text(app)
            await pilot.press("y")
            await until(pilot, lambda: not app.is_running, "the app to exit")

    run(scenario)
    assert app.restart is not None and (app.restart.context, app.restart.memory) == (1024, None)
