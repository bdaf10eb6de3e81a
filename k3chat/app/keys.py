"""Every key binding of the app, read from the BINDINGS of its screens and widgets (the help
screen is checked against this list by a test, so the two cannot drift apart).

``python -m k3chat.app.keys`` prints them as a Markdown table.
"""

from __future__ import annotations

from textual.binding import Binding

from .app import K3ChatApp
from .screens.attach import AttachScreen
from .screens.chat import ChatScreen
from .screens.dialogs import AskScreen, ConfirmScreen
from .screens.help import HelpScreen
from .screens.sessions import SessionsScreen
from .screens.settings import SettingsScreen
from .screens.viewer import ReasoningViewer
from .widgets.attachments import AttachmentChip
from .widgets.reasoning import ReasoningBlock
from .widgets.transcript import AnswerBlock, UserMessage

# where a binding works -> the classes that declare it
PLACES: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("everywhere", (K3ChatApp,)),
    ("chat", (ChatScreen,)),
    ("a reasoning block", (ReasoningBlock,)),
    ("an answer", (AnswerBlock,)),
    ("your message", (UserMessage,)),
    ("an attachment chip", (AttachmentChip,)),
    ("file picker", (AttachScreen,)),
    ("session browser", (SessionsScreen,)),
    ("reasoning viewer", (ReasoningViewer,)),
    ("settings dialog", (SettingsScreen,)),
    ("a question", (ConfirmScreen, AskScreen)),
    ("help", (HelpScreen,)),
)
DISPLAY = {"question_mark": "?", "slash": "/"}


def display_key(key: str) -> str:
    """A key as the help screen writes it."""
    return DISPLAY.get(key, key)


def _bindings(cls: type) -> list[Binding]:
    out = []
    for item in getattr(cls, "BINDINGS", []):
        out.append(item if isinstance(item, Binding) else Binding(*item))
    return out


def binding_rows() -> list[tuple[str, list[str], str, str | None]]:
    """(place, keys as shown, description, keymap id) of every binding, in declaration order."""
    rows = []
    for place, classes in PLACES:
        for cls in classes:
            for binding in _bindings(cls):
                keys = [display_key(k.strip()) for k in binding.key.split(",")]
                rows.append((place, keys, binding.description or binding.action, binding.id))
    return rows


def markdown_table() -> str:
    """One row per binding; neighbours that do the same thing in one place share a row (1-9)."""
    rows: list[tuple[str, list[str], str, str | None]] = []
    for place, keys, what, binding_id in binding_rows():
        if rows and rows[-1][0] == place and rows[-1][2] == what and binding_id is None:
            rows[-1][1].extend(keys)
        else:
            rows.append((place, list(keys), what, binding_id))
    lines = ["| where | keys | what | `[keys]` name |", "| --- | --- | --- | --- |"]
    for place, keys, what, binding_id in rows:
        shown = ", ".join(f"`{k}`" for k in keys)
        lines.append(f"| {place} | {shown} | {what} | {binding_id or ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
