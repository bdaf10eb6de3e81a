"""The message box: a TextArea where enter sends and shift+enter (or ctrl+j, alt+enter)
starts a new line."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


class PromptInput(TextArea):
    """Multi-line input that posts ``Submitted`` on enter."""

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
            self.post_message(self.Submitted(self, self.text))
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
