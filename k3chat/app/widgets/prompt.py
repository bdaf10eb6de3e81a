"""The message box: a TextArea where enter sends and shift+enter (or ctrl+j, alt+enter)
starts a new line."""

from __future__ import annotations

from typing import NamedTuple

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")
# What terminals send for alt+enter: ESC CR (tmux, xterm, most others), ESC LF (foot).
ALT_ENTER_SEQUENCES = ("\x1b\r", "\x1b\n")


class _KeyName(NamedTuple):
    """An entry of Textual's table of terminal sequences: it reads the key's name from .value."""

    value: str


def teach_alt_enter() -> None:
    """Make Textual read alt+enter as alt+enter. Its parser turns ESC CR into a plain enter (the
    alt is dropped for keys that have a name), so alt+enter would send the message. An entry in
    its sequence table is matched first; one Textual already has is left alone."""
    from textual import _ansi_sequences

    for sequence in ALT_ENTER_SEQUENCES:
        _ansi_sequences.ANSI_SEQUENCES_KEYS.setdefault(sequence, (_KeyName("alt+enter"),))


class PromptInput(TextArea):
    """Multi-line input that posts ``Submitted`` on enter.

    The box is emptied at the moment enter is pressed, not when the message is handled: keys
    typed right after enter (type-ahead, a paste, a slow link delivering a burst) land in the
    empty box instead of being cleared with the message. A refused message is put back with
    ``restore``.
    """

    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

    def __init__(self, *, id: str | None = None, placeholder: str = "") -> None:
        super().__init__("", id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         placeholder=placeholder, compact=True)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter" and not self.read_only:
            event.stop()
            event.prevent_default()
            text = self.text
            if text:
                self.clear()
            self.post_message(self.Submitted(self, text))
            return
        if event.key in NEWLINE_KEYS and not self.read_only:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self.replace("\n", start, end, maintain_selection_offset=False)
            return
        await super()._on_key(event)

    def set_text(self, text: str) -> None:
        """Replace the contents and put the cursor at the end."""
        self.load_text(text)
        self.move_cursor(self.document.end)

    def restore(self, text: str) -> None:
        """Put back a message that was not sent, before whatever was typed since (on a new
        line), so that neither is lost."""
        typed = self.text
        self.set_text(f"{text}\n{typed}" if typed and text else (text or typed))
