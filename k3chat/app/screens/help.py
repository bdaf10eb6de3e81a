"""Help: every key, on one screen (f1 or ? ; escape closes)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("Writing", (
        ("enter", "send the message"),
        ("shift+enter, ctrl+j, alt+enter", "new line"),
        ("ctrl+l", "attach a file to the next message (a directory tree and a path box; several files per "
                   "message; a chip shows each, delete or enter on a chip removes it)"),
        ("ctrl+e", "edit your last message and resend it (escape cancels)"),
        ("ctrl+r", "regenerate the last answer with a new seed, so it can differ (a greedy session samples "
                   "that one answer; or answer an unanswered message)"),
    )),
    ("While the model answers", (
        ("ctrl+c", "copy the selection if there is one; otherwise stop after the step in flight "
                   "(the partial answer is kept, marked interrupted, and saved)"),
        ("ctrl+c again", "stop the step in flight too, save and quit"),
        ("ctrl+q", "save and quit (again: stop the step in flight; a third time: quit at once)"),
    )),
    ("Reading", (
        ("tab, shift+tab", "move between the input and the blocks (tab from the input: the newest reasoning)"),
        ("alt+up, alt+down", "previous / next block"),
        ("ctrl+t", "fold or unfold the focused reasoning block (else the last one)"),
        ("enter, space", "fold or unfold the focused reasoning block"),
        ("c", "copy the focused block"),
        ("b", "on an answer: copy its next code block (numbered; the toast says which, its language and lines)"),
        ("1-9", "on an answer: copy that code block"),
        ("v", "full-screen reasoning viewer with search (/ find, n next, N previous)"),
        ("shift+pageup, shift+pagedown", "scroll the transcript"),
        ("escape", "back to the input"),
        ("j, k", "vim-style, when turned on (vim_keys = true in config.toml, or the palette) and a block has "
                 "the focus: next / previous block (typed as letters in the input)"),
        ("g, G", "vim-style, as j and k: first / last block"),
    )),
    ("Elsewhere", (
        ("ctrl+s", "sessions: search names, messages and reasoning; resume, rename, delete, export"),
        ("ctrl+n", "start a new session"),
        ("ctrl+o", "settings of this session: system prompt, sampling on/off, temperature, top-p, top-k, seed, "
                   "max tokens (kept with the session)"),
        ("ctrl+p", "command palette (thinking effort, kept per session; reasoning display; Markdown; "
                   "theme, remembered for the next start; ...)"),
        ("f1, ?", "this help"),
    )),
    ("Session browser (ctrl+s)", (
        ("up, down", "choose a session; enter resumes it"),
        ("/, ctrl+f", "search names, messages and reasoning"),
        ("f2, ctrl+r", "rename"),
        ("delete, ctrl+d", "delete (asks first)"),
        ("ctrl+x", "export to Markdown, JSON or JSONL"),
        ("escape", "back to the chat"),
    )),
    ("Reasoning viewer (v)", (
        ("/, ctrl+f", "find; enter jumps to the next match and gives the keys back to the text"),
        ("n, N", "next / previous match"),
        ("c", "copy the whole reasoning"),
        ("escape, q", "close (in the find box, escape closes only the find box)"),
    )),
    ("File picker (ctrl+l)", (
        ("enter", "in the path box or on a file in the tree: attach it (shift+tab: the tree)"),
        ("escape", "close the picker"),
    )),
    ("Attachment chips", (
        ("delete, backspace, enter", "remove the focused file from the next message"),
    )),
    ("Settings dialog (ctrl+o)", (
        ("ctrl+s", "save (enter in a field saves too)"),
        ("escape", "cancel"),
    )),
    ("Questions and this help", (
        ("y, n", "answer a question (escape: no, or cancel)"),
        ("escape, q, f1, ?", "close this help"),
    )),
)

ABOUT = ("k3chat runs Kimi K3 on this machine. It never uses the network: nothing you type "
         "or the model writes leaves it. Sessions are saved as you go (files readable only by you). "
         "Keys can be changed in config.toml, e.g. [keys] quit = \"ctrl+x\" (names: interrupt, quit, help, "
         "regenerate, edit_last, sessions, new_session, settings, attach, toggle_reasoning, previous_block, "
         "next_block, vim_next, vim_previous, vim_first, vim_last).")


def help_table() -> Table:
    """Keys and what they do, descriptions wrapped in their own column (plain Text, no markup)."""
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True)
    table.add_column(ratio=1)
    for n, (title, rows) in enumerate(KEYS):
        if n:
            table.add_row("", "")
        table.add_row(Text(title, style="bold"), "")
        for key, text in rows:
            table.add_row(Text(key, style="bold"), Text(text))
    table.add_row("", "")
    table.add_row("", Text(ABOUT, style="italic"))
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,f1,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(Content.styled("k3chat keys", "bold"), id="help-title", markup=False)
            yield Static(help_table(), id="help-text", markup=False)

    def action_close(self) -> None:
        self.dismiss(None)
