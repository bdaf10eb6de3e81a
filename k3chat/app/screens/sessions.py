"""The session browser: search (names, messages and reasoning, with the matching text shown),
resume, rename, delete (confirmed), export (Markdown, JSON or JSONL; written 0600, an existing
file replaced only when confirmed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static

from k3chat import paths
from k3chat.history import HistoryError, HistoryStore, NameTaken, SessionInfo
from k3chat.session_search import Hit, pattern, record_hits

from ..text import literal, neutralise, one_line
from .dialogs import AskScreen, ConfirmScreen

EXPORTS = {"md": ("Markdown", ".md"), "json": ("JSON", ".json"), "jsonl": ("JSONL", ".jsonl")}
EXPORT_QUESTION = ("Save a copy of this conversation to a file. The end of the name picks the kind: .md to read "
                   "(Markdown), .json for everything k3chat keeps, .jsonl for other chat tools (one message per "
                   "line). Only you can read the file.")
HITS_SHOWN = 5  # matching snippets shown in the preview of a session


@dataclass
class _Entry:
    info: SessionInfo
    records: list[dict[str, Any]] | None = None  # loaded for a content search
    hits: list[Hit] = field(default_factory=list)  # of the current search


class SessionsChanged(Message):
    """A session was renamed or deleted in the browser (the chat screen may show it)."""

    def __init__(self, session_id: str, *, deleted: bool = False) -> None:
        super().__init__()
        self.session_id = session_id
        self.deleted = deleted


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M")


def _file_name(name: str, suffix: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in name).strip("-")[:60]
    return (safe or "session") + suffix


class SessionsScreen(Screen[str | None]):
    """Dismissed with the id of the session to resume, or None."""

    BINDINGS = [
        Binding("escape", "close", "Back"),
        Binding("f2,ctrl+r", "rename", "Rename", priority=True),
        Binding("delete,ctrl+d", "delete", "Delete", priority=True),
        Binding("ctrl+x", "export", "Export", priority=True),
        Binding("slash,ctrl+f", "search", "Search", show=False),
        Binding("down", "move(1)", "Next session", show=False),
        Binding("up", "move(-1)", "Previous session", show=False),
    ]

    def __init__(self, store: HistoryStore, *, current: str | None = None, busy: bool = False) -> None:
        super().__init__(classes="sessions")
        self.store = store
        self.current = current
        self.busy = busy  # a turn runs: resuming another session or deleting this one is refused
        self.entries: list[_Entry] = []
        self.shown: list[_Entry] = []

    def compose(self) -> ComposeResult:
        yield Static(Content.styled("Sessions", "bold"), id="sessions-title", markup=False)
        yield Input(placeholder="search names, messages and reasoning", id="sessions-search")
        with Horizontal(id="sessions-body"):
            yield DataTable(id="sessions-table", cursor_type="row", zebra_stripes=True)
            with Vertical(id="sessions-preview-box"):
                yield Static("", id="sessions-preview", markup=False)
        yield Static("", id="sessions-message", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_column("Updated", key="updated")
        table.add_column("Msgs", key="msgs")
        table.add_column("Name", key="name")
        self.reload()
        self.query_one("#sessions-search", Input).focus()

    # ------------------------------------------------------------------ data

    def reload(self, keep: str | None = None) -> None:
        try:
            infos = self.store.list()
        except (HistoryError, OSError) as exc:
            self.say(f"cannot list sessions: {exc}", error=True)
            infos = []
        cache = {e.info.id: e for e in self.entries}
        self.entries = []
        for info in infos:
            old = cache.get(info.id)
            same = old is not None and old.info.updated == info.updated
            self.entries.append(_Entry(info, old.records if same and old else None))
        self.refilter(keep=keep)

    def _records(self, entry: _Entry) -> list[dict[str, Any]]:
        if entry.records is None:
            try:
                entry.records = self.store.load(entry.info.id).records
            except (HistoryError, OSError):
                entry.records = []
        return entry.records

    def refilter(self, keep: str | None = None) -> None:
        query = self.query_one("#sessions-search", Input).value.strip()
        needle = pattern(query) if query else None
        shown = []
        for entry in self.entries:
            entry.hits = []
            if needle is not None and len(query) >= 2:
                # The same matching as `k3chat sessions search` (k3chat.session_search).
                entry.hits = list(record_hits(entry.info, self._records(entry), needle))
            if needle is None or needle.search(entry.info.name) or needle.search(entry.info.id) or entry.hits:
                shown.append(entry)
        self.shown = shown
        table = self.query_one(DataTable)
        keep = keep or self.selected_id()
        table.clear()
        for entry in shown:
            info = entry.info
            marker = " (open)" if info.id == self.current else ""
            table.add_row(_when(info.updated), str(info.n_messages),
                          Text(one_line(info.name, 70) + marker), key=info.id)
        if keep is not None:
            for row, entry in enumerate(shown):
                if entry.info.id == keep:
                    table.move_cursor(row=row)
        self.show_preview()
        total = f"{len(self.entries)} session{'s' if len(self.entries) != 1 else ''}"
        count = f"{len(shown)} of {total}" if query else total
        self.say(count)

    def selected(self) -> _Entry | None:
        table = self.query_one(DataTable)
        if not self.shown or table.cursor_row is None or not 0 <= table.cursor_row < len(self.shown):
            return None
        return self.shown[table.cursor_row]

    def selected_id(self) -> str | None:
        entry = self.selected()
        return entry.info.id if entry else None

    def show_preview(self) -> None:
        entry = self.selected()
        preview = self.query_one("#sessions-preview", Static)
        if entry is None:
            preview.update("")
            return
        info = entry.info
        lines = [f"{info.name}", f"id {info.id}", f"created {_when(info.created)}",
                 f"model {info.model or '?'}", ""]
        if entry.hits:
            preview.update(_matches(lines, entry.hits))
            return
        try:
            records = self.store.load(info.id).records[-6:]
        except (HistoryError, OSError) as exc:
            records, lines = [], lines + [f"cannot read: {exc}"]
        for r in records:
            who = {"user": "You", "assistant": "K3", "system": "System"}.get(r.get("role"), "?")
            lines.append(f"{who}: {one_line(str(r.get('content', '')), 200)}")
        preview.update(literal("\n".join(lines)))

    def say(self, text: str, *, error: bool = False) -> None:
        box = self.query_one("#sessions-message", Static)
        box.update(literal(text))
        box.set_class(error, "-error")

    # ------------------------------------------------------------------ events

    def on_input_changed(self, event: Input.Changed) -> None:
        self.refilter()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_resume()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_preview()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_resume()

    # ------------------------------------------------------------------ actions

    def action_move(self, step: int) -> None:
        table = self.query_one(DataTable)
        if self.shown:
            table.move_cursor(row=max(0, min(len(self.shown) - 1, (table.cursor_row or 0) + step)))

    def action_search(self) -> None:
        self.query_one("#sessions-search", Input).focus()

    def action_close(self) -> None:
        self.dismiss(None)

    def action_resume(self) -> None:
        entry = self.selected()
        if entry is None:
            return
        if self.busy and entry.info.id != self.current:
            self.say("the model is answering: stop it (ctrl+c) or wait before switching sessions", error=True)
            return
        self.dismiss(entry.info.id)

    def action_rename(self) -> None:
        entry = self.selected()
        if entry is None:
            return

        def done(name: str | None) -> None:
            if name is None or name == entry.info.name:
                return
            try:
                self.store.rename(entry.info.id, name)
            except NameTaken as exc:
                self.say(f"not renamed: {exc.info.name!r} is the name of another session; choose another", error=True)
                return
            except (HistoryError, OSError) as exc:
                self.say(str(exc), error=True)
                return
            self.say(f"renamed to {name}")
            self.app.post_message(SessionsChanged(entry.info.id))
            self.reload(keep=entry.info.id)

        self.app.push_screen(AskScreen("New name for the session:", entry.info.name), done)

    def action_delete(self) -> None:
        entry = self.selected()
        if entry is None:
            return
        info = entry.info
        if self.busy and info.id == self.current:
            self.say("the model is answering in this session: stop it first (ctrl+c)", error=True)
            return

        def done(yes: bool | None) -> None:
            if not yes:
                self.say("not deleted")
                return
            from k3chat.conversation import delete_state

            try:
                self.store.delete(info.id)
                delete_state(info.id)
            except (HistoryError, OSError) as exc:
                self.say(str(exc), error=True)
                return
            self.say(f"deleted {info.name}")
            self.app.post_message(SessionsChanged(info.id, deleted=True))
            self.reload()

        question = (f"Delete session {one_line(info.name, 60)!r} ({info.n_messages} messages) and its saved "
                    "engine state? This cannot be undone.")
        self.app.push_screen(ConfirmScreen(question, yes="Delete", no="Keep"), done)

    def action_export(self) -> None:
        entry = self.selected()
        if entry is not None:
            export_dialog(self.app, self.store, entry.info.id, entry.info.name, self.say)


def _matches(lines: list[str], hits: list[Hit]) -> Text:
    """The preview of a session found by its text: where each match is, the match in bold."""
    out = Text(neutralise("\n".join(lines)) + "\n")
    more = len(hits) - HITS_SHOWN
    out.append(f"{len(hits)} match{'es' if len(hits) != 1 else ''}:\n")
    for hit in hits[:HITS_SHOWN]:
        out.append(f"{hit.where}: ", style="dim")
        out.append(neutralise(hit.before))
        out.append(neutralise(hit.match), style="bold reverse")
        out.append(neutralise(hit.after) + "\n")
    if more > 0:
        out.append(f"and {more} more", style="dim")
    return out


Say = Callable[..., None]  # say(text, error=False): the status line of the caller


def export_dialog(app: Any, store: HistoryStore, session_id: str, name: str, say: Say) -> None:
    """Ask where to export a session, confirm before replacing a file, write it (0600)."""
    default = str(Path.cwd() / _file_name(name, ".md"))

    def chosen(target: str | None) -> None:
        if not target:
            return
        path = Path(target).expanduser()
        if path.is_dir():
            say(f"not exported: {path} is a folder; give a file name", error=True)
        elif path.exists() or path.is_symlink():
            question = f"{path} already exists. Replace it with this conversation?"
            app.push_screen(ConfirmScreen(question, yes="Replace", no="Keep it"),
                            lambda yes: write(path, True) if yes else say(f"not exported: {path} was kept as it was"))
        else:
            write(path, False)

    def write(path: Path, replace: bool) -> None:
        fmt = export_format(path)
        try:
            text = _export_text(store, session_id, fmt)
            paths.atomic_write(path, text.encode("utf-8"), replace=replace)
        except FileExistsError:
            say(f"not exported: {path} appeared meanwhile and was kept; export again to replace it", error=True)
            return
        except (HistoryError, OSError) as exc:
            say(f"not exported: {exc}", error=True)
            return
        plain = ", in plaintext: the history is encrypted, this copy is not" if store.vault is not None else ""
        say(f"exported as {EXPORTS[fmt][0]} to {path} (readable only by you{plain})")

    app.push_screen(AskScreen(EXPORT_QUESTION, default), chosen)


def _export_text(store: HistoryStore, session_id: str, fmt: str) -> str:
    if fmt == "md":
        return store.export_markdown(session_id)
    if fmt == "json":
        return store.export_json(session_id)
    text, warnings = store.export_peer_jsonl_checked(session_id)
    damaged = sum(w.startswith("damaged line") for w in warnings)
    if damaged:
        raise HistoryError(f"{damaged} line(s) of this session are damaged, so a JSONL copy would silently miss "
                           "messages; export to .json instead (it keeps everything and lists what is damaged)")
    if any("two user messages in a row" in w for w in warnings):
        raise HistoryError("an empty stopped answer sits between two of your messages, and other tools refuse a "
                           "JSONL file with two of your messages in a row; export to .json or .md instead")
    return text


def export_format(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".json": "json", ".jsonl": "jsonl"}.get(suffix, "md")


__all__ = ["SessionsScreen", "SessionsChanged", "EXPORTS", "export_format", "export_dialog"]
