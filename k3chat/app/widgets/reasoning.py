"""A collapsible block per answer for the model's reasoning.

Live while the model thinks (the text streams in, the title counts tokens and seconds); when
the answer starts it collapses to "Thought: N tokens, T s" (display setting ``auto``), stays
open (``expanded``) or is not shown at all (``hidden``). ctrl+t or enter toggles the focused
block, c copies it, v opens the full-screen viewer. The text is shown literally.
"""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.content import Content
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Static

from ..text import literal

DISPLAY_MODES = ("expanded", "auto", "hidden")


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 60 else f"{int(value // 60)} min {int(value % 60)} s"


class ReasoningBlock(Widget, can_focus=True):
    """One answer's reasoning."""

    BINDINGS = [
        Binding("enter,space", "toggle", "Fold", show=True),
        Binding("c", "copy", "Copy", show=True),
        Binding("v", "view", "View", show=True),
    ]

    class ViewRequested(Message):
        def __init__(self, block: ReasoningBlock) -> None:
            super().__init__()
            self.block = block

    class CopyRequested(Message):
        def __init__(self, text: str, what: str) -> None:
            super().__init__()
            self.text = text
            self.what = what

    def __init__(self, text: str = "", *, live: bool = False, mode: str = "auto", tokens: int | None = None,
                 seconds: float | None = None, approximate: bool = False, interrupted: bool = False) -> None:
        super().__init__(classes="reasoning")
        self._parts: list[str] = [text] if text else []
        self._text_cache: str | None = text
        self.live = live
        self.mode = mode if mode in DISPLAY_MODES else "auto"
        self.tokens = tokens if tokens is not None else 0
        self.seconds = seconds
        self.approximate = approximate
        self.interrupted = interrupted
        self.expanded = live or self.mode == "expanded"
        self._started = time.monotonic()
        self._begun = not live  # live blocks wait for the prefill before they count time
        self._flush_pending = False
        self._timer = None
        self.display = self.mode != "hidden"

    # ------------------------------------------------------------------ state

    @property
    def text(self) -> str:
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
            self._parts = [self._text_cache] if self._text_cache else []
        return self._text_cache

    def compose(self) -> ComposeResult:
        yield Static(self._title(), classes="reasoning-title", markup=False)
        yield Static(literal(self.text), classes="reasoning-body", markup=False)

    def on_mount(self) -> None:
        self._apply_expanded()
        if self.live:
            self._timer = self.set_interval(0.5, self._tick)

    def _tick(self) -> None:
        if self.live:
            self.query_one(".reasoning-title", Static).update(self._title())

    def _title(self) -> Content:
        if self.live and not self._begun:
            return Content("\u25be Reading the prompt\u2026")
        if self.live:
            elapsed = time.monotonic() - self._started
            return Content(f"\u25be Thinking\u2026 {self.tokens:,} tokens, {_seconds(elapsed)}")
        arrow = "\u25be" if self.expanded else "\u25b8"
        if not self.text and not self.tokens:
            label = "No reasoning"
        else:
            approx = "\u2248" if self.approximate else ""
            label = f"Thought: {approx}{self.tokens:,} tokens"
            if self.seconds is not None:
                label += f", {approx}{_seconds(self.seconds)}"
        if self.interrupted:
            label += " (interrupted)"
        return Content(f"{arrow} {label}")

    def _apply_expanded(self) -> None:
        self.set_class(self.expanded, "-expanded")
        self.set_class(self.live, "-live")
        try:
            self.query_one(".reasoning-body", Static).display = self.expanded
            self.query_one(".reasoning-title", Static).update(self._title())
        except Exception:  # not composed yet
            pass

    # ------------------------------------------------------------------ streaming

    def start(self) -> None:
        """The model starts thinking (the prefill is over)."""
        self._started = time.monotonic()
        self._begun = True
        self._tick()

    def append(self, text: str, *, pieces: int = 1) -> None:
        """More reasoning text (``pieces`` events, about one token each)."""
        if not text:
            return
        self._parts.append(text)
        self._text_cache = None
        self.tokens += pieces
        if not self._flush_pending:
            self._flush_pending = True
            self.call_after_refresh(self._flush)

    def count(self, generated: int) -> None:
        """Ids sampled so far (all reasoning while the block is live), from a Stats event:
        more exact than counting text pieces, since some ids show no text."""
        if generated > self.tokens:
            self.tokens = generated
            self._tick()

    def _flush(self) -> None:
        self._flush_pending = False
        if not self.is_attached:
            return
        self.query_one(".reasoning-body", Static).update(literal(self.text))
        self.query_one(".reasoning-title", Static).update(self._title())

    def finish(self, *, tokens: int | None = None, seconds: float | None = None, text: str | None = None,
               interrupted: bool = False, collapse: bool = False) -> None:
        """Thinking is over: the answer started (``collapse``: fold it in ``auto`` mode), or the
        turn ended without an answer (the reasoning is all there is: it stays open)."""
        was_live = self.live
        self.live = False
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        if tokens is not None:
            self.tokens = tokens
        if seconds is not None:
            self.seconds = seconds
        elif was_live and self.seconds is None:
            self.seconds = time.monotonic() - self._started
        if text is not None and text != self.text:
            self._parts, self._text_cache = [text], text
        self.interrupted = interrupted
        if was_live and collapse and self.mode == "auto":
            self.expanded = False
        self._flush()
        self._apply_expanded()

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        self.display = mode != "hidden"
        if not self.live:
            self.expanded = mode == "expanded"
        self._apply_expanded()

    # ------------------------------------------------------------------ actions

    def action_toggle(self) -> None:
        self.expanded = not self.expanded
        self._apply_expanded()
        if self.expanded:
            self.call_after_refresh(self.scroll_visible, animate=False)

    def action_copy(self) -> None:
        self.post_message(self.CopyRequested(self.text, "reasoning"))

    def action_view(self) -> None:
        self.post_message(self.ViewRequested(self))
