"""Snapshot tests of the app's screens: the chat screen with a reasoning block and an answer,
the session browser, the reasoning viewer, help and the settings dialog.

Each screen is exported as SVG (App.export_screenshot: truecolor, independent of the terminal
the tests run in) and compared with tests/snapshots/NAME.svg; the screen's text is kept beside
it as NAME.txt, so a change reads as a diff in review. Everything on the screens is fixed: the
sessions are written here with fixed times and ids (TZ=UTC), a resumed session shows the
times stored in its records, cursors do not blink, no toasts, a fixed terminal size.

A failing comparison leaves the new screen in the test's tmp directory (the path is in the
message). To accept a deliberate change, regenerate and review the diff:

    K3CHAT_UPDATE_SNAPSHOTS=1 pytest tests/test_app_snapshots.py
"""
from __future__ import annotations

import difflib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from k3chat.history import HistoryStore
from k3chat.tokenizer import Tokenizer

textual = pytest.importorskip("textual")

from test_app import Script, make_app, model, run, screen_text, started, tok, until  # noqa: E402,F401

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("K3CHAT_UPDATE_SNAPSHOTS") == "1"
SIZE = (110, 34)
FIXED_TIME = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC

REASONING = ("The user wants the capital of France and a line of Python that prints it.\n"
             "Paris is the capital. A print call is enough.")
ANSWER = ("The capital of France is **Paris**.\n\n"
          "```python\nprint(\"Paris\")\n```\n\n"
          "- population about 2.1 million\n- on the Seine")


class _Fixed:
    """A stand-in for a module inside k3chat.history: fixed ``time()``, counted ids."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._n = 0

    def time(self) -> float:
        return FIXED_TIME

    def token_hex(self, nbytes: int) -> str:
        self._n += 1
        return f"{self._n:0{2 * nbytes}x}"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.fixture
def steady(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private home, UTC, and none of the environment that changes how Textual draws."""
    if os.environ.get("TEXTUAL_DIM_FACTOR"):
        pytest.skip("TEXTUAL_DIM_FACTOR is set: the snapshots are drawn with Textual's default dimming")
    from textual import constants

    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    for name in ("NO_COLOR", "TEXTUAL_THEME", "TEXTUAL_FILTERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "FILTERS", "")
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield tmp_path / "home"
    monkeypatch.undo()
    time.tzset()


def write_sessions(monkeypatch: pytest.MonkeyPatch) -> str:
    """Two sessions with fixed times and ids; returns the id of the one with the answer."""
    import k3chat.history as history

    with monkeypatch.context() as m:
        m.setattr(history, "time", _Fixed(time))
        m.setattr(history, "secrets", _Fixed(secrets))
        store = HistoryStore()
        other = store.create("Packing list for a weekend", model="tiny")
        store.append(other.id, {"role": "user", "content": "What should I pack for two days of hiking?"})
        info = store.create("Capital of France", model="tiny")
        store.append(info.id, {"role": "user", "content": "What is the capital of France? Show it in Python."})
        store.append(info.id, {
            "role": "assistant", "content": ANSWER, "reasoning_content": REASONING, "stop": "end",
            "model": "tiny", "thinking": True, "effort": "high", "sampler": {"greedy": True},
            "tokens": {"prompt": 31, "reused": 0, "prefilled": 31, "generated": 52, "reasoning": 24},
            "speed": {"reasoning_seconds": 2.75, "prefill_tokens_per_second": 120.5,
                      "decode_tokens_per_second": 9.25, "first_token_seconds": 0.42, "turn_seconds": 6.1}})
    return info.id


async def settle(pilot: Any) -> None:
    """Let the screen finish drawing: no blinking cursor, no toast, the same text twice."""
    app = pilot.app
    previous = None
    for _ in range(50):
        for widget in app.screen.query("Input, TextArea"):
            widget.cursor_blink = False
        app.clear_notifications()
        await pilot.pause(0.05)
        text = screen_text(app)
        if text == previous:
            return
        previous = text
    raise AssertionError("the screen kept changing")


def mismatch(app: Any, name: str, out: Path) -> str | None:
    """None when the screen is the stored snapshot NAME, else what differs (and where the new
    one was written). With K3CHAT_UPDATE_SNAPSHOTS=1 the stored one is replaced instead."""
    svg, text = app.export_screenshot(title=name), screen_text(app).rstrip() + "\n"
    svg_path, text_path = SNAPSHOTS / f"{name}.svg", SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        svg_path.write_text(svg, encoding="utf-8")
        text_path.write_text(text, encoding="utf-8")
        return None
    if not svg_path.exists():
        return f"no snapshot {svg_path}: generate it with K3CHAT_UPDATE_SNAPSHOTS=1 and review it"
    if svg_path.read_text(encoding="utf-8") == svg:
        return None
    (out / f"{name}.svg").write_text(svg, encoding="utf-8")
    (out / f"{name}.txt").write_text(text, encoding="utf-8")
    expected = text_path.read_text(encoding="utf-8") if text_path.exists() else ""
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "stored", "now"))
    what = diff or "the text is the same: colours, styles or layout differ"
    return f"screen {name!r} differs from {svg_path} (new one: {out / name}.svg)\n{what}"


def test_snapshots_of_chat_browser_viewer_help_and_settings(steady: Path, monkeypatch: pytest.MonkeyPatch,
                                                             model: Any, tok: Tokenizer, tiny_dir: Path,
                                                             tmp_path: Path) -> None:
    from k3chat.app.screens.help import HelpScreen
    from k3chat.app.screens.sessions import SessionsScreen
    from k3chat.app.screens.settings import SettingsScreen
    from k3chat.app.screens.viewer import ReasoningViewer
    from k3chat.app.widgets.reasoning import ReasoningBlock

    sid = write_sessions(monkeypatch)
    app = make_app(model, tok, tiny_dir, Script(), session=sid)
    problems: list[str] = []

    async def shot(pilot: Any, name: str) -> None:
        await settle(pilot)
        problem = mismatch(app, name, tmp_path)
        if problem:
            problems.append(problem)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await started(pilot)
            await until(pilot, lambda: app.conv is not None and not app.loading_session, "the session")
            await pilot.press("tab", "enter")  # the reasoning block, unfolded
            assert isinstance(app.focused, ReasoningBlock) and app.focused.expanded
            await shot(pilot, "chat")
            if not UPDATE:  # the comparison sees a moved widget (then it is put back)
                title = app.chat.query_one("#title")
                title.styles.dock = "bottom"
                await settle(pilot)
                assert mismatch(app, "chat", tmp_path) is not None
                title.styles.dock = "none"
                await shot(pilot, "chat")

            await pilot.press("v")
            await until(pilot, lambda: isinstance(app.screen, ReasoningViewer), "the viewer")
            await shot(pilot, "viewer")
            await pilot.press("escape")

            await pilot.press("f1")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen), "help")
            await shot(pilot, "help")
            await pilot.press("escape")

            await pilot.press("ctrl+o")
            await until(pilot, lambda: isinstance(app.screen, SettingsScreen), "the settings dialog")
            await shot(pilot, "settings")
            await pilot.press("escape")

            await pilot.press("ctrl+s")
            await until(pilot, lambda: isinstance(app.screen, SessionsScreen), "the session browser")
            await shot(pilot, "sessions")

    run(scenario)
    assert problems == [], "\n\n".join(problems)
