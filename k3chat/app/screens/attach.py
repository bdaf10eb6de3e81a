"""The file picker behind "Attach file...": a directory tree from the working directory and a
path box (focused first). Enter on a file in the tree, or on a path in the box, chooses it; the screen posts
``AttachScreen.Chosen`` up to the app (which reads the file, off the UI thread, and adds its
chip, or says why it cannot) and closes. Escape closes without choosing."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Static

from ..text import literal


class AttachScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    class Chosen(Message):
        """A path the user chose to attach (not read yet)."""

        def __init__(self, path: Path) -> None:
            super().__init__()
            self.path = path

    def __init__(self, start: Path | None = None) -> None:
        super().__init__(classes="dialog", id="attach-screen")
        self.start = start or Path.cwd()

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box", id="attach-box"):
            yield Static(literal(f"Attach a file (enter on a file; escape cancels) \u00b7 {self.start}"),
                         classes="dialog-text", markup=False)
            yield DirectoryTree(self.start, id="attach-tree")
            yield Input(placeholder="or type a path and press enter", id="attach-path")
            yield Static("", id="attach-error", markup=False)

    def on_mount(self) -> None:
        self.query_one("#attach-error").display = False
        self.query_one("#attach-path", Input).focus()  # typing a path is quickest; shift+tab or a click reaches the tree

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        event.stop()
        self._choose(Path(event.path))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        value = event.value.strip()
        if not value:
            self._error("type the path of a file to attach")
            return
        path = Path(value).expanduser()
        self._choose(path if path.is_absolute() else self.start / path)

    def _choose(self, path: Path) -> None:
        self.app.post_message(self.Chosen(path))
        self.dismiss(None)

    def _error(self, text: str) -> None:
        box = self.query_one("#attach-error", Static)
        box.update(literal(text))
        box.display = True

    def action_cancel(self) -> None:
        self.dismiss(None)


__all__ = ["AttachScreen"]
