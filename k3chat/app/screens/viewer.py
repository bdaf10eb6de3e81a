"""Full-screen reasoning viewer with search (v on a block)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Footer, Input, Static, TextArea
from textual.widgets.text_area import Selection

from ..text import neutralise


class ReasoningViewer(Screen[None]):
    """The whole reasoning of one answer, read-only, with find (enter / n: next, N: previous).

    The find box opens with / and takes the keys while it has the focus; enter jumps to the
    next match and hands the keys back to the text, so n and N then move between matches.
    Escape in the find box closes only the find box (the query is kept for n and N).
    """

    BINDINGS = [
        Binding("escape,q", "close", "Close"),
        Binding("slash,ctrl+f", "find", "Find"),
        Binding("n", "next", "Next match"),
        Binding("N", "previous", "Previous match"),
        Binding("c", "copy", "Copy all"),
    ]

    def __init__(self, text: str, title: str) -> None:
        super().__init__(classes="viewer")
        self.text = text
        self.shown = neutralise(text)  # same length per character class is not guaranteed:
        self.title_text = title          # search runs on what is shown
        self.query_text = ""

    def compose(self) -> ComposeResult:
        yield Static(self.title_text, id="viewer-title", markup=False)
        with Horizontal(id="viewer-find-bar"):
            yield Static("Find:", id="viewer-find-label", markup=False)
            yield Input(placeholder="text to find, enter for the next match", id="viewer-find")
            yield Static("", id="viewer-matches", markup=False)
        yield TextArea(self.shown, read_only=True, soft_wrap=True, id="viewer-text", show_cursor=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#viewer-find-bar").display = False
        self.query_one("#viewer-text", TextArea).focus()

    @property
    def finding(self) -> bool:
        """The find box has the keys."""
        return self.focused is self.query_one("#viewer-find", Input)

    # ------------------------------------------------------------------ find

    def _matches(self) -> list[int]:
        needle = self.query_text.casefold()
        if not needle:
            return []
        hay = self.shown.casefold()
        out, at = [], hay.find(needle)
        while at >= 0:
            out.append(at)
            at = hay.find(needle, at + 1)
        return out

    def _go(self, forward: bool) -> None:
        area = self.query_one("#viewer-text", TextArea)
        matches = self._matches()
        status = self.query_one("#viewer-matches", Static)
        if not self.query_text:
            status.update("")
            return
        if not matches:
            status.update("no match")
            self.app.bell()
            return
        doc = area.document
        here = doc.get_index_from_location(area.selection.start if forward else area.selection.start)
        if forward:
            nxt = next((m for m in matches if m > here or (m == here and area.selection.is_empty)), matches[0])
        else:
            nxt = next((m for m in reversed(matches) if m < here), matches[-1])
        start = doc.get_location_from_index(nxt)
        end = doc.get_location_from_index(nxt + len(self.query_text))
        area.selection = Selection(start, end)
        area.scroll_cursor_visible(center=True)
        status.update(f"{matches.index(nxt) + 1}/{len(matches)}")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_text = event.value
        self._go(True)
        self.query_one("#viewer-text", TextArea).focus()  # n / N now jump instead of typing

    def on_input_changed(self, event: Input.Changed) -> None:
        self.query_text = event.value
        matches = self._matches()
        self.query_one("#viewer-matches", Static).update(f"{len(matches)} matches" if self.query_text else "")

    def action_find(self) -> None:
        self.query_one("#viewer-find-bar").display = True
        self.query_one("#viewer-find", Input).focus()

    def action_next(self) -> None:
        self._go(True)

    def action_previous(self) -> None:
        self._go(False)

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.app.notify("Reasoning copied", markup=False)

    def action_close(self) -> None:
        if self.finding:  # escape in the find box closes the find box only
            self.query_one("#viewer-find-bar").display = False
            self.query_one("#viewer-text", TextArea).focus()
            return
        self.dismiss(None)
