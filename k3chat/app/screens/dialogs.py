"""Small modal dialogs: confirm, ask for a line of text."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static

from ..text import neutralise


class ConfirmScreen(ModalScreen[bool]):
    """y / enter confirms, n / escape cancels."""

    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str, *, yes: str = "Yes", no: str = "No") -> None:
        super().__init__(classes="dialog")
        self.question, self.yes, self.no = question, yes, no

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Static(neutralise(self.question), classes="dialog-text", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.yes, id="yes", variant="error")
                yield Button(self.no, id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


class AskScreen(ModalScreen[str | None]):
    """One line of text (enter accepts, escape cancels)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, value: str = "") -> None:
        super().__init__(classes="dialog")
        self.question, self.value = question, value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Static(neutralise(self.question), classes="dialog-text", markup=False)
            yield Input(value=self.value, id="ask-input")

    def on_mount(self) -> None:
        self.query_one("#ask-input", Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)
