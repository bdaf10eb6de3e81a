"""The files attached to the next message, as chips above the message box.

Each chip shows the file's name, size and token count (what it adds to the message) and is
removed with delete, backspace or enter when focused, or by a click. The bar only holds and
draws; the app reads ``attachments`` when the message is sent and clears the bar.
"""

from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Static

from k3chat.attachments import Attachment

from ..text import one_line


def size_text(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    if nbytes < 1024 * 1024:
        return f"{nbytes / 1024:.1f} KiB"
    return f"{nbytes / 2**20:.1f} MiB"


def chip_text(attachment: Attachment, tokens: int | None) -> str:
    counted = f"{tokens:,} tokens" if tokens is not None else "tokens counted when the model is open"
    return one_line(f"\U0001f4ce {attachment.name} \u00b7 {size_text(attachment.size)} \u00b7 {counted} \u00d7", 70)


class AttachmentChip(Static, can_focus=True):
    """One attached file; delete, backspace, enter or a click removes it."""

    BINDINGS = [Binding("delete,backspace,enter", "remove", "Remove", show=True)]

    class RemoveRequested(Message):
        def __init__(self, chip: AttachmentChip) -> None:
            super().__init__()
            self.chip = chip

    def __init__(self, attachment: Attachment, tokens: int | None) -> None:
        super().__init__(chip_text(attachment, tokens), classes="attachment-chip", markup=False)
        self.attachment = attachment
        self.tokens = tokens

    def action_remove(self) -> None:
        self.post_message(self.RemoveRequested(self))

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.action_remove()


class AttachmentBar(Horizontal):
    """The chips of the next message (hidden while there are none)."""

    class Changed(Message):
        """The attachments changed (a chip added or removed)."""

    def on_mount(self) -> None:
        self.display = False

    @property
    def chips(self) -> list[AttachmentChip]:
        return list(self.query(AttachmentChip))

    @property
    def attachments(self) -> list[Attachment]:
        return [chip.attachment for chip in self.chips]

    @property
    def tokens(self) -> int:
        return sum(chip.tokens or 0 for chip in self.chips)

    async def add(self, attachment: Attachment, tokens: int | None) -> None:
        await self.mount(AttachmentChip(attachment, tokens))
        self.display = True
        self.post_message(self.Changed())

    async def set_attachments(self, items: list[tuple[Attachment, int | None]]) -> None:
        await self.remove_children()
        if items:
            await self.mount_all([AttachmentChip(a, tokens) for a, tokens in items])
        self.display = bool(items)
        self.post_message(self.Changed())

    async def clear(self) -> None:
        await self.set_attachments([])

    async def on_attachment_chip_remove_requested(self, event: AttachmentChip.RemoveRequested) -> None:
        event.stop()
        await event.chip.remove()
        self.display = bool(self.chips)
        self.post_message(self.Changed())


__all__ = ["AttachmentBar", "AttachmentChip", "chip_text", "size_text"]
