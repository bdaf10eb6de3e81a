"""The Textual app driven by Textual's Pilot, on the tiny fixture model.

The model is opened once per module and handed to each app through ``engine_factory``. With
random weights the model never ends its turn, so most tests script the sampled ids (real
text, then BOUNDARY / CLOSURE / END) while the engine runs as usual; limits stay small.
Every test runs with K3CHAT_HOME in a temporary directory.
"""
from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import stat
import subprocess
import tempfile
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from k3chat.history import HistoryStore
from k3chat.settings import Settings
from k3chat.template import Grammar
from k3chat.tokenizer import Tokenizer

textual = pytest.importorskip("textual")

from k3chat.app import build_app  # noqa: E402
from k3chat.app.engine import Engine  # noqa: E402
from k3chat.app.screens.chat import ChatScreen  # noqa: E402
from k3chat.app.screens.dialogs import AskScreen, ConfirmScreen  # noqa: E402
from k3chat.app.screens.help import HelpScreen  # noqa: E402
from k3chat.app.screens.sessions import SessionsScreen  # noqa: E402
from k3chat.app.screens.viewer import ReasoningViewer  # noqa: E402
from k3chat.app.text import neutralise  # noqa: E402
from k3chat.app.widgets.reasoning import ReasoningBlock  # noqa: E402
from k3chat.app.widgets.status import StatusBar  # noqa: E402
from k3chat.app.widgets.transcript import AnswerBlock, UserMessage  # noqa: E402

SIZE = (150, 45)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Any:
    from k3engine.model import Model

    m = Model(tiny_dir, threads=2)
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


class Script:
    """A sampler factory: each turn emits its script, then ``filler`` forever (if given).
    ``delay`` seconds per filler sample keep a turn running long enough to interrupt it."""

    def __init__(self, *scripts: list[int], filler: list[int] | None = None, delay: float = 0.0) -> None:
        self.scripts = list(scripts)
        self.filler = filler
        self.delay = delay
        self.samples = 0

    def __call__(self, settings: Any, turn: int) -> Any:
        ids = list(self.scripts.pop(0)) if self.scripts else []
        outer = self

        class _S:
            def sample(self, logits: Any) -> int:
                assert np.asarray(logits).ndim == 1
                outer.samples += 1
                if ids:
                    return ids.pop(0)
                if outer.delay:
                    time.sleep(outer.delay)
                assert outer.filler, "script exhausted"
                return outer.filler[outer.samples % len(outer.filler)]

        return _S()


def answer(tok: Tokenizer, reasoning: str | None, content: str) -> list[int]:
    g = Grammar(tok)
    ids: list[int] = []
    if reasoning is not None:
        ids += tok.encode_text(reasoning) + list(g.boundary)
    return ids + tok.encode_text(content) + list(g.closure) + [tok.end_of_msg_id]


def make_app(model: Any, tok: Tokenizer, tiny_dir: Path, script: Script | None, *, max_tokens: int = 64,
             context: int | None = None, session: str | None = None, thinking: bool = True,
             speculative: int = 0) -> Any:
    def factory(model_dir: Path, settings: Settings, progress: Callable[[str], None]) -> Engine:
        progress("opening the test model")
        options = {"sampler_factory": script} if script is not None else {}
        return Engine(model=model, tokenizer=tok, model_dir=tiny_dir, name="tiny", owns_model=False,
                      context=context, conversation_options=options)

    settings = Settings(max_tokens=max_tokens, thinking=thinking, effort="high", speculative=speculative)
    return build_app(tiny_dir, settings=settings, engine_factory=factory, session=session)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


async def until(pilot: Any, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    # 30 s: a streamed turn that redraws a long answer per token took over 15 s on a loaded 2-core machine
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def started(pilot: Any) -> Any:
    app = pilot.app
    await until(pilot, lambda: app.ready, "the model to open")
    return app


async def send(pilot: Any, text: str) -> None:
    await turn(pilot, "enter", text=text)


async def turn(pilot: Any, *keys: str, text: str | None = None) -> None:
    """Press ``keys`` (with ``text`` in the box first) and wait for the turn they start to end."""
    app = pilot.app
    if text is not None:
        app.chat.prompt.set_text(text)
    before = app.turns_over
    await pilot.press(*keys)
    await until(pilot, lambda: app.turns_over > before, "the turn to end")
    await pilot.pause(0.05)


def screen_text(app: Any) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def stored(session_id: str) -> list[dict[str, Any]]:
    keep = ("role", "content", "reasoning_content", "interrupted")
    return [{k: r[k] for k in keep if k in r} for r in HistoryStore().load(session_id).records]


# --------------------------------------------------------------------------- tests


def test_send_streams_reasoning_and_answer_and_saves(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    script = Script(answer(tok, " Let me see.", " It is **Paris**."))
    app = make_app(model, tok, tiny_dir, script)
    seen: list[tuple[str, bool | None]] = []

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            real = app.chat.turn_event

            async def spy(event: Any, **kw: Any) -> None:
                block = app.chat.turn.reasoning if app.chat.turn is not None else None
                seen.append((type(event).__name__, block.live if block is not None else None))
                await real(event, **kw)

            app.chat.turn_event = spy  # type: ignore[method-assign]
            await send(pilot, "Where is the Louvre?")
            assert app.ui_errors == []
            reasoning = app.chat.query_one(ReasoningBlock)
            assert reasoning.text == " Let me see." and not reasoning.live and not reasoning.expanded
            assert reasoning.tokens == len(tok.encode_text(" Let me see."))
            assert app.chat.query_one(AnswerBlock).text == " It is **Paris**."
            text = screen_text(app)
            assert f"Thought: {reasoning.tokens} tokens" in text
            assert "It is Paris." in text  # Markdown: bold drawn, not the asterisks
            assert "Where is the Louvre?" in text
            session_id = app.conv.session_id
            assert stored(session_id) == [
                {"role": "user", "content": "Where is the Louvre?"},
                {"role": "assistant", "content": " It is **Paris**.", "reasoning_content": " Let me see."},
            ]
            assert HistoryStore().info(session_id).name == "Where is the Louvre?"
            app.set_reasoning_display("expanded")
            assert reasoning.expanded and reasoning.display
            app.set_reasoning_display("hidden")
            assert not reasoning.display and reasoning not in app.chat.transcript.blocks()
            app.set_reasoning_display("auto")
            assert reasoning.display and not reasoning.expanded
            await pilot.press("ctrl+q")
        assert app.return_value == 0

    run(scenario)
    kinds = [k for k, _ in seen]
    # streamed: reasoning tokens while the block is live, then answer tokens after it folded
    assert ("ReasoningToken", True) in seen
    assert kinds.index("ReasoningToken") < kinds.index("AnswerToken") < kinds.index("TurnDone")
    assert all(live is False for kind, live in seen if kind == "AnswerToken")


def test_ctrl_c_stops_keeps_partial_then_second_ctrl_c_quits(home: Path, model: Any, tok: Tokenizer,
                                                            tiny_dir: Path) -> None:
    script = Script(tok.encode_text(" Thinking hard"), filler=tok.encode_text(" more"), delay=0.01)
    app = make_app(model, tok, tiny_dir, script, max_tokens=5000)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            app.chat.prompt.set_text("Think forever")
            await pilot.press("enter")
            await until(pilot, lambda: app.chat.turn is not None and app.chat.turn.reasoning is not None
                        and app.chat.turn.reasoning.tokens >= 8, "reasoning to stream")
            await pilot.press("ctrl+c")
            await until(pilot, lambda: not app.busy, "the turn to stop")
            assert script.samples < 5000
            records = stored(app.conv.session_id)
            assert records[0] == {"role": "user", "content": "Think forever"}
            last = records[-1]
            assert last["role"] == "assistant" and last["interrupted"] is True and last["content"] == ""
            assert last["reasoning_content"].startswith(" Thinking hard more")
            assert "stopped on request" in screen_text(app)
            assert app.is_running
            await pilot.press("ctrl+c")  # the second one saves and quits
            await until(pilot, lambda: not app.is_running, "the app to quit", 5)
        assert app.return_value == 0

    run(scenario)


def test_two_quick_ctrl_c_save_and_quit(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    script = Script(tok.encode_text(" Busy"), filler=tok.encode_text(" busy"), delay=0.01)
    app = make_app(model, tok, tiny_dir, script, max_tokens=5000)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            app.chat.prompt.set_text("Work")
            await pilot.press("enter")
            await until(pilot, lambda: script.samples >= 8, "generation")
            sid = app.conv.session_id
            await pilot.press("ctrl+c", "ctrl+c")
            await until(pilot, lambda: not app.is_running, "the app to quit")
        assert app.return_value == 0
        last = stored(sid)[-1]
        assert last["interrupted"] is True and last["reasoning_content"].startswith(" Busy")

    run(scenario)


def test_ctrl_c_copies_a_selection_instead(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    app = make_app(model, tok, tiny_dir, Script())

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            app.chat.prompt.set_text("copy these words")
            app.chat.prompt.select_all()
            await pilot.press("ctrl+c")
            assert app.clipboard == "copy these words"
            assert app.is_running and not app.busy

    run(scenario)


def test_regenerate_and_edit_last(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    script = Script(answer(tok, " a", " One."), answer(tok, " b", " Again."), answer(tok, " c", " Edited."))
    app = make_app(model, tok, tiny_dir, script)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await send(pilot, "First question")
            sid = app.conv.session_id
            await turn(pilot, "ctrl+r")
            assert stored(sid) == [
                {"role": "user", "content": "First question"},
                {"role": "assistant", "content": " Again.", "reasoning_content": " b"},
            ]
            assert [a.text for a in app.chat.query(AnswerBlock)] == [" Again."]

            await pilot.press("ctrl+e")
            assert app.chat.editing and app.chat.prompt.text == "First question"
            await turn(pilot, "enter", text="Second version")
            assert stored(sid) == [
                {"role": "user", "content": "Second version"},
                {"role": "assistant", "content": " Edited.", "reasoning_content": " c"},
            ]
            assert [u.text for u in app.chat.query(UserMessage)] == ["Second version"]
            assert [a.text for a in app.chat.query(AnswerBlock)] == [" Edited."]
            assert not app.chat.editing and app.ui_errors == []

    run(scenario)


def test_model_text_is_shown_literally(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    hostile = "[bold]x[/] \x1b[31mred <|open|> <b>hi</b> \x1b]52;c;QUJD\x07 [link](http://example.com)"
    thought = "[i]plan[/i] \x1b[2J\u202eevil"
    script = Script(answer(tok, thought, hostile), answer(tok, None, hostile))
    app = make_app(model, tok, tiny_dir, script, max_tokens=400)

    def check_screen(text: str) -> None:
        assert "[bold]x[/]" in text
        assert "\u241b[31mred" in text  # ESC drawn as a control picture, not obeyed
        assert "<|open|>" in text and "<b>hi</b>" in text
        assert "\u241b]52;c;QUJD\u2407" in text  # no clipboard write, no bell
        assert "\x1b" not in text and "\x07" not in text

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await send(pilot, "[red]mine[/red] \x1b[1m")
            assert app.ui_errors == []
            await pilot.press("ctrl+t")  # unfold the reasoning
            await pilot.pause(0.1)
            text = screen_text(app)
            check_screen(text)
            assert "[red]mine[/red] \u241b[1m" in text  # the user's own text too
            assert "[i]plan[/i] \u241b[2J\u27e8U+202E\u27e9evil" in text
            # what is stored is exactly what the model said
            records = stored(app.conv.session_id)
            assert records[-1]["content"] == hostile and records[-1]["reasoning_content"] == thought
            # plain-text answers are literal too
            await app.toggle_markdown()
            await pilot.pause(0.1)
            check_screen(screen_text(app))

    run(scenario)
    assert neutralise("a\r\nb\x9bc\x7f") == "a\nb\u27e8U+009B\u27e9c\u2421"


def test_status_bar_shows_speed_and_context(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    filler = tok.encode_text(" word")
    app = make_app(model, tok, tiny_dir, Script(filler * 12), max_tokens=24)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await send(pilot, "Count")
            status = app.chat.query_one(StatusBar)
            parts = status.parts()
            assert any(p.endswith("tok/s") or p.endswith("s/tok") for p in parts), parts
            used = app.conv.history_tokens()  # the context figure between turns (issue 8 item 7)
            assert used > 0 and f"ctx {used:,}/" in " ".join(parts)
            assert any(p.startswith("cache ") for p in parts) and any(p.endswith("/tok read") for p in parts)
            assert parts[0] == "tiny" and "all resident" in parts
            line = [ln for ln in screen_text(app).splitlines() if "ctx " in ln]
            assert line and ("tok/s" in line[0] or "s/tok" in line[0])
            # the limit ended the turn: kept, marked interrupted, the reason shown
            assert stored(app.conv.session_id)[-1]["interrupted"] is True
            assert "24-token limit" in screen_text(app)

    run(scenario)


def test_status_bar_shows_the_draft_acceptance(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    """With speculative decoding on, a repetitive answer is drafted from itself: the status
    bar says how many drafted tokens the sampler kept."""
    filler = tok.encode_text(" word")
    app = make_app(model, tok, tiny_dir, Script(filler * 12), max_tokens=24, speculative=4)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await send(pilot, "Count")
            parts = app.chat.query_one(StatusBar).parts()
            drafts = [p for p in parts if p.startswith("drafts ")]
            assert drafts, parts
            kept, proposed = (int(x) for x in drafts[0].split()[1].split("/"))
            assert 0 < kept <= proposed and drafts[0].endswith(f"({100 * kept / proposed:.0f}%)")

    run(scenario)


def test_transcript_follows_the_bottom_until_scrolled_up(home: Path, model: Any, tok: Tokenizer,
                                                         tiny_dir: Path) -> None:
    lines = "".join(f"line {i}\n" for i in range(60))
    script = Script(answer(tok, None, lines), filler=tok.encode_text(" more\n"), delay=0.01)
    app = make_app(model, tok, tiny_dir, script, max_tokens=1000, thinking=False)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await send(pilot, "Count to sixty")
            transcript = app.chat.transcript
            assert transcript.max_scroll_y > 0 and transcript.is_vertical_scroll_end
            assert "line 59" in screen_text(app)
            app.chat.prompt.set_text("Go on")
            await pilot.press("enter")
            await until(pilot, lambda: script.samples >= len(answer(tok, None, lines)) + 30, "the second answer")
            assert transcript.is_vertical_scroll_end  # still following
            await pilot.press("shift+pageup")
            await pilot.pause(0.05)
            held, grown = transcript.scroll_y, transcript.max_scroll_y
            await until(pilot, lambda: transcript.max_scroll_y > grown + 5, "more lines")
            assert transcript.scroll_y == held  # the user scrolled up: the view stays put
            await pilot.press("ctrl+c")
            await until(pilot, lambda: not app.busy, "the stop")

    run(scenario)


def test_context_overflow_keeps_the_text(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    app = make_app(model, tok, tiny_dir, Script(), max_tokens=64, context=120)
    long = "a very long question " * 20

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await send(pilot, long)
            assert app.chat.prompt.text == long
            assert "does not fit the context" in screen_text(app)
            assert not app.chat.query(UserMessage)
            assert HistoryStore().list() == []  # the refused first message left no session
            assert app.ui_errors == []

    run(scenario)


def test_session_browser_search_resume_rename_delete_export(home: Path, model: Any, tok: Tokenizer,
                                                            tiny_dir: Path, tmp_path: Path) -> None:
    store = HistoryStore()
    alpha = store.create("alpha case")
    store.append(alpha.id, {"role": "user", "content": "about the contract"})
    store.append(alpha.id, {"role": "assistant", "content": "It is void.", "reasoning_content": "hm"})
    beta = store.create("beta matter")
    store.append(beta.id, {"role": "user", "content": "the patient's chart"})
    store.append(beta.id, {"role": "assistant", "content": "Stable.", "reasoning_content": ""})
    app = make_app(model, tok, tiny_dir, Script())
    out = tmp_path / "export.json"

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SessionsScreen), "the browser")
            browser = app.screen
            assert len(browser.shown) == 2
            await pilot.press(*"contract")  # a message, not a name
            await pilot.pause(0.05)
            assert [e.info.id for e in browser.shown] == [alpha.id]
            await pilot.press("enter")
            await until(pilot, lambda: app.conv is not None and app.conv.session_id == alpha.id, "the resume")
            await until(pilot, lambda: bool(app.chat.query(UserMessage)), "the history")
            assert [u.text for u in app.chat.query(UserMessage)] == ["about the contract"]
            assert "alpha case" in screen_text(app)

            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SessionsScreen), "the browser")
            browser = app.screen
            await pilot.press(*"beta")
            await pilot.pause(0.05)
            assert [e.info.id for e in browser.shown] == [beta.id]
            await pilot.press("f2")
            await until(pilot, lambda: isinstance(app.screen, AskScreen), "the rename box")
            app.screen.query_one("Input").value = "beta renamed"
            await pilot.press("enter")
            await until(pilot, lambda: HistoryStore().info(beta.id).name == "beta renamed", "the rename")

            await pilot.press("ctrl+x")
            await until(pilot, lambda: isinstance(app.screen, AskScreen), "the export box")
            app.screen.query_one("Input").value = str(out)
            await pilot.press("enter")
            await until(pilot, out.exists, "the export")
            assert stat.S_IMODE(out.stat().st_mode) == 0o600
            assert json.loads(out.read_text())["records"][0]["content"] == "the patient's chart"

            await pilot.press("delete")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
            await pilot.press("n")  # kept
            await pilot.pause(0.05)
            assert beta.id in [i.id for i in HistoryStore().list()]
            await pilot.press("delete")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the confirmation")
            await pilot.press("y")
            await until(pilot, lambda: beta.id not in [i.id for i in HistoryStore().list()], "the delete")
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, ChatScreen), "the chat screen")
            assert app.conv.session_id == alpha.id

    run(scenario)


def test_resume_by_name_keys_help_and_viewer(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    store = HistoryStore()
    info = store.create("notes")
    reasoning = "first idea\nsecond idea\nthird idea"
    store.append(info.id, {"role": "user", "content": "hello"})
    store.append(info.id, {"role": "assistant", "content": "Hi.", "reasoning_content": reasoning})
    app = make_app(model, tok, tiny_dir, Script(), session="notes")

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: bool(app.chat.query(ReasoningBlock)), "the history")
            block = app.chat.query_one(ReasoningBlock)
            assert not block.expanded and block.text == reasoning
            await pilot.press("f1")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen), "help")
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, ChatScreen), "the chat screen")
            # alt+up walks the blocks from the bottom: answer, reasoning, message
            await pilot.press("alt+up")
            assert isinstance(app.focused, AnswerBlock)
            await pilot.press("alt+up")
            assert app.focused is block
            await pilot.press("ctrl+t")
            assert block.expanded
            await pilot.press("c")
            assert app.clipboard == reasoning
            await pilot.press("v")
            await until(pilot, lambda: isinstance(app.screen, ReasoningViewer), "the viewer")
            await pilot.press("slash", *"idea", "enter")
            await pilot.pause(0.05)
            viewer = app.screen
            area = viewer.query_one("#viewer-text")
            assert area.selected_text == "idea"
            await pilot.press("escape")  # closes the viewer: focus goes back to the block
            await until(pilot, lambda: isinstance(app.screen, ChatScreen), "the chat screen")
            assert app.focused is block
            await pilot.press("alt+down", "alt+down")  # the answer, then past the last block: the input
            assert app.focused is app.chat.prompt

    run(scenario)


def test_sigterm_cancels_saves_and_exits(home: Path, model: Any, tok: Tokenizer, tiny_dir: Path) -> None:
    script = Script(tok.encode_text(" Long"), filler=tok.encode_text(" thought"), delay=0.01)
    app = make_app(model, tok, tiny_dir, script, max_tokens=5000)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            assert signal.SIGTERM in app._signals  # else the signal below would end pytest
            app.chat.prompt.set_text("Go on")
            await pilot.press("enter")
            await until(pilot, lambda: script.samples >= 8, "generation")
            sid = app.conv.session_id
            os.kill(os.getpid(), signal.SIGTERM)
            await until(pilot, lambda: not app.is_running, "the app to quit")
        assert app.return_value == 5
        last = stored(sid)[-1]
        assert last["role"] == "assistant" and last["interrupted"] is True
        assert last["reasoning_content"].startswith(" Long thought")

    run(scenario)
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)


def test_unanswered_message_is_answered_with_ctrl_r(home: Path, model: Any, tok: Tokenizer,
                                                     tiny_dir: Path) -> None:
    store = HistoryStore()
    info = store.create("crashed")
    store.append(info.id, {"role": "user", "content": "are you there?"})  # k3chat died before answering
    app = make_app(model, tok, tiny_dir, Script(answer(tok, " yes", " Here.")), session=info.id)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: "has no answer" in screen_text(app), "the notice")
            app.chat.prompt.set_text("something else")
            await pilot.press("enter")  # refused: answer the first one first
            await pilot.pause(0.1)
            assert not app.busy and len(stored(info.id)) == 1 and app.chat.prompt.text == "something else"
            app.chat.prompt.clear()
            await turn(pilot, "ctrl+r")
            assert stored(info.id)[1] == {"role": "assistant", "content": " Here.", "reasoning_content": " yes"}
            await pilot.press("shift+tab")  # the focus chain: from the input back to the last block
            assert isinstance(app.focused, AnswerBlock)
            await pilot.press("tab")
            assert app.focused is app.chat.prompt

    run(scenario)


HANGUP_SCRIPT = r"""
import asyncio, sys, time
from pathlib import Path
from k3chat.app import build_app
from k3chat.app.engine import Engine
from k3chat.settings import Settings
from k3chat.tokenizer import Tokenizer
from k3engine.model import Model

model_dir = Path(sys.argv[1])
model, tok = Model(model_dir, threads=1), Tokenizer.from_dir(model_dir)
ids = tok.encode_text(" hang on")

def sampler(settings, turn):
    class S:
        n = 0
        def sample(self, logits):
            time.sleep(0.01)
            S.n += 1
            if S.n == 10:
                print("GENERATING", flush=True)
            return ids[S.n % len(ids)]
    return S()

def factory(d, settings, progress):
    return Engine(model=model, tokenizer=tok, model_dir=model_dir, name="tiny", owns_model=False,
                  conversation_options={"sampler_factory": sampler})

app = build_app(model_dir, settings=Settings(max_tokens=4000), engine_factory=factory)

async def main():
    async with app.run_test() as pilot:
        while not app.ready:
            await pilot.pause(0.02)
        app.chat.prompt.set_text("hello")
        await pilot.press("enter")
        deadline = time.monotonic() + 30  # never outlive the test that started us
        while time.monotonic() < deadline:
            await pilot.pause(0.05)
        print("NO HANGUP:", "\n".join(s.text for s in app.screen._compositor.render_strips()), flush=True)
        sys.exit(3)

asyncio.run(main())
"""


def test_sighup_stores_the_partial_answer_and_exits(home: Path, tiny_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "hangup.py"
    script.write_text(HANGUP_SCRIPT)
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
    records = stored(info.id)
    assert records[0] == {"role": "user", "content": "hello"}
    assert records[1]["interrupted"] is True and "hang on hang" in records[1]["reasoning_content"]


def test_cli_chat_usage_errors(home: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat.cli import main

    assert main(["chat", "--demo", str(tiny_dir)]) == 2
    assert "not both" in capsys.readouterr().err
    store = HistoryStore()
    store.create("twin")
    store.create("twin")
    assert main(["chat", str(tiny_dir), "--session", "twin"]) == 2
    assert "several sessions are named" in capsys.readouterr().err


def test_core_and_engine_never_import_textual() -> None:
    code = ("import sys, k3chat.conversation, k3chat.chat_cli, k3chat.cli, k3engine.model, k3engine.budgeted; "
            "assert 'textual' not in sys.modules, sorted(m for m in sys.modules if 'textual' in m); "
            "import k3chat.app; assert 'textual' in sys.modules")
    # run outside the checkout: `-c` puts the working directory first on sys.path, and the
    # source tree's k3chat has no k3chat.themes (the installed package maps themes/ there)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=tempfile.gettempdir())


# --------------------------------------------------------------------------- issue 8: sessions


def notices(app: Any) -> list[str]:
    return [n.message for n in app._notifications]


def test_browser_searches_reasoning_with_snippets_and_lists_as_the_cli_does(
        home: Path, model: Any, tok: Tokenizer, tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from k3chat.cli import main

    store = HistoryStore()
    older = store.create("lease review")
    store.append(older.id, {"role": "user", "content": "Read the lease."})
    store.append(older.id, {"role": "assistant", "content": "Fine.",
                            "reasoning_content": "The indemnity clause [x](https://x.example) is broad."})
    newer = store.create("taxes")
    store.append(newer.id, {"role": "user", "content": "VAT?"})
    store.rename(older.id, "lease review (final)")  # renamed last: now the most recently updated
    assert main(["sessions", "list", "--json"]) == 0
    cli_order = [x["id"] for x in json.loads(capsys.readouterr().out)]
    app = make_app(model, tok, tiny_dir, Script())

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SessionsScreen), "the browser")
            browser = app.screen
            assert [e.info.id for e in browser.shown] == cli_order
            await pilot.press(*"INDEMNITY")  # only in the reasoning, in another case
            await pilot.pause(0.05)
            assert [e.info.id for e in browser.shown] == [older.id]
            preview = str(browser.query_one("#sessions-preview").render())
            assert "1 match:" in preview
            assert "reasoning, message 2: The indemnity clause [x](https://x.example) is broad." in preview
            await pilot.press("f2")  # rename to the other session's name: refused
            await until(pilot, lambda: isinstance(app.screen, AskScreen), "the rename box")
            app.screen.query_one("Input").value = "taxes"
            await pilot.press("enter")
            await pilot.pause(0.1)
            message = str(browser.query_one("#sessions-message").render())
            assert "not renamed: 'taxes' is the name of another session" in message
            assert HistoryStore().info(older.id).name == "lease review (final)"

    run(scenario)


def test_export_asks_before_replacing_and_refuses_an_incomplete_jsonl(home: Path, model: Any, tok: Tokenizer,
                                                                      tiny_dir: Path, tmp_path: Path) -> None:
    store = HistoryStore()
    info = store.create("brief")
    store.append(info.id, {"role": "user", "content": "Summarise."})
    store.append(info.id, {"role": "assistant", "content": "**Short**.", "reasoning_content": "r"})
    with open(store.root / f"{info.id}.jsonl", "ab") as f:
        f.write(b"{damaged line\n")
    existing = tmp_path / "brief.md"
    existing.write_text("keep me\n")
    existing.chmod(0o644)
    app = make_app(model, tok, tiny_dir, Script())

    async def export_to(pilot: Any, target: Path) -> None:
        await pilot.press("ctrl+s")
        await until(pilot, lambda: isinstance(app.screen, SessionsScreen), "the browser")
        await pilot.press("ctrl+x")
        await until(pilot, lambda: isinstance(app.screen, AskScreen), "the export box")
        question = str(app.screen.query_one(".dialog-text").render())
        assert "kimi-k3-in-c" not in question and "other chat tools" in question
        app.screen.query_one("Input").value = str(target)
        await pilot.press("enter")

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await export_to(pilot, existing)
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the overwrite question")
            assert "already exists" in str(app.screen.query_one(".dialog-text").render())
            await pilot.press("n")
            await pilot.pause(0.05)
            assert existing.read_text() == "keep me\n" and stat.S_IMODE(existing.stat().st_mode) == 0o644
            await pilot.press("ctrl+x")
            await until(pilot, lambda: isinstance(app.screen, AskScreen), "the export box")
            app.screen.query_one("Input").value = str(existing)
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the overwrite question")
            await pilot.press("y")
            await until(pilot, lambda: existing.read_text().startswith("# brief"), "the replacement")
            assert stat.S_IMODE(existing.stat().st_mode) == 0o600 and "**Short**." in existing.read_text()
            await pilot.press("escape")
            peer = tmp_path / "brief.jsonl"
            await export_to(pilot, peer)
            await pilot.pause(0.1)
            assert isinstance(app.screen, SessionsScreen) and not peer.exists()
            message = str(app.screen.query_one("#sessions-message").render())
            assert "not exported: 1 line(s) of this session are damaged" in message and ".json" in message

    run(scenario)


def test_empty_answer_copy_tab_to_newest_reasoning_and_fold_label(home: Path, model: Any, tok: Tokenizer,
                                                                    tiny_dir: Path) -> None:
    store = HistoryStore()
    info = store.create("two turns")
    store.append(info.id, {"role": "user", "content": "one"})
    store.append(info.id, {"role": "assistant", "content": "First.", "reasoning_content": "old thought"})
    store.append(info.id, {"role": "user", "content": "two"})
    store.append(info.id, {"role": "assistant", "content": "", "reasoning_content": "new thought"})
    app = make_app(model, tok, tiny_dir, Script(), session="two turns")

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: len(app.chat.query(ReasoningBlock)) == 2, "the history")
            app.copy_to_clipboard("before")
            app.copy_last_answer()
            await pilot.pause(0.05)
            assert app.clipboard == "before"
            assert notices(app)[-1] == "nothing to copy: the last answer is empty"
            assert app.focused is app.chat.prompt
            await pilot.press("tab")
            assert isinstance(app.focused, ReasoningBlock) and app.focused.text == "new thought"
            await pilot.press("tab")  # then on in reading order: that turn's answer
            assert isinstance(app.focused, AnswerBlock)
            await pilot.press("c")
            await pilot.pause(0.05)
            assert app.clipboard == "before" and notices(app)[-1] == "nothing to copy: the answer is empty"
            footer = screen_text(app).splitlines()[-1]
            assert "Fold block" in footer and "Fold thoughts" not in footer

    run(scenario)
