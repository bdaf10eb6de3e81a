"""The chat screen: transcript, progress panel, notice line, message box, status bar.

The screen only draws; the app owns the engine, the conversation and the turn worker, and
hands the screen the turn's events (already on the UI thread).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Markdown, ProgressBar, Static

from k3chat.events import AnswerToken, Notice, PhaseChanged, Prefill, PrefillProgress, ReasoningToken, Stats, TurnDone
from k3chat.progress import progress_figures

from ..text import literal, one_line
from ..widgets.attachments import AttachmentBar
from ..widgets.prompt import PromptInput
from ..widgets.reasoning import ReasoningBlock
from ..widgets.status import StatusBar
from ..widgets.transcript import (AnswerBlock, AssistantMessage, Transcript, UserMessage, stored_reasoning_size,
                                  turn_status)

if TYPE_CHECKING:
    from ..app import K3ChatApp

PREFILL_PROGRESS_TOKENS = 256  # show the progress panel for prefills at least this long
TURN_NOTICES = ("limit", "cancelled", "malformed", "error")


def reasoning_tokens(generated: Sequence[int], boundary: Sequence[int]) -> int:
    """Sampled ids before the reasoning/answer boundary (all of them if there is none)."""
    n = len(boundary)
    for i in range(len(generated) - n + 1):
        if tuple(generated[i:i + n]) == tuple(boundary):
            return i
    return len(generated)


class ChatScreen(Screen[None]):
    BINDINGS = [
        # The app's quit, repeated first here so the footer shows it before the screen's keys:
        # it is the one a narrow terminal must not cut off (same id: [keys] rebinds both).
        Binding("ctrl+q", "app.quit", "Quit", priority=True, id="quit"),
        Binding("ctrl+r", "app.regenerate", "Regenerate", priority=True, id="regenerate"),
        Binding("ctrl+e", "app.edit_last", "Edit last", priority=True, id="edit_last"),
        Binding("ctrl+s", "app.sessions", "Sessions", priority=True, id="sessions"),
        Binding("ctrl+n", "app.new_session", "New", show=False, priority=True, id="new_session"),
        Binding("ctrl+o", "app.session_settings", "Settings", priority=True, id="settings"),
        Binding("ctrl+l", "app.attach", "Attach", priority=True, id="attach"),
        Binding("ctrl+t", "toggle_reasoning", "Fold block", priority=True, id="toggle_reasoning"),
        Binding("alt+up", "block(-1)", "Previous block", show=False, priority=True, id="previous_block"),
        Binding("alt+down", "block(1)", "Next block", show=False, priority=True, id="next_block"),
        Binding("shift+pageup", "scroll_transcript(-1)", "Scroll up", show=False, priority=True),
        Binding("shift+pagedown", "scroll_transcript(1)", "Scroll down", show=False, priority=True),
        Binding("tab", "tab", "To the blocks", show=False),
        Binding("escape", "escape", "To the input", show=False),
        Binding("question_mark", "app.help", "Help", show=False),
        # vim-style movement (vim_keys in config.toml, or the palette): never while typing
        Binding("j", "vim_block(1)", "Next block", show=False, id="vim_next"),
        Binding("k", "vim_block(-1)", "Previous block", show=False, id="vim_previous"),
        Binding("g", "vim_end(0)", "First block", show=False, id="vim_first"),
        Binding("G", "vim_end(-1)", "Last block", show=False, id="vim_last"),
    ]

    def __init__(self) -> None:
        super().__init__(id="chat")
        self.turn: AssistantMessage | None = None
        self._progress_started = 0.0
        self._progress_text = ""
        self._progress_timer: Any = None
        self._progress_elapsed = True  # add "(N s)" to the text (the prefill's bar has its own figures)
        self.prefilling = False  # the prefill's bar is up: a stop now ends at a chunk boundary
        self.editing = False
        self._stash = ""  # what was in the box when ctrl+e replaced it

    @property
    def k3(self) -> K3ChatApp:
        return self.app  # type: ignore[return-value]

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Static("k3chat", id="title", markup=False)
        yield Transcript(id="transcript")
        with Vertical(id="progress"):
            yield Static("", id="progress-text", markup=False)
            yield ProgressBar(total=None, show_eta=False, show_percentage=False, id="progress-bar")
        yield Static("", id="notice", markup=False)
        yield AttachmentBar(id="attachments")
        with Horizontal(id="prompt-row"):
            yield Static("\u276f", id="prompt-mark", markup=False)
            yield PromptInput(id="prompt", placeholder="Message K3 (enter sends; alt+enter or ctrl+j: new line)")
        yield StatusBar(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#progress").display = False
        self.query_one("#notice").display = False
        self.prompt.focus()
        self.k3.chat_ready()

    @property
    def prompt(self) -> PromptInput:
        return self.query_one("#prompt", PromptInput)

    @property
    def attachment_bar(self) -> AttachmentBar:
        return self.query_one("#attachments", AttachmentBar)

    @property
    def transcript(self) -> Transcript:
        return self.query_one("#transcript", Transcript)

    @property
    def status(self) -> StatusBar:
        return self.query_one("#status", StatusBar)

    def set_title(self, session: str | None, model: str | None) -> None:
        parts = ["k3chat", model or "", session or "new session"]
        self.query_one("#title", Static).update(literal(" \u00b7 ".join(p for p in parts if p)))

    # ------------------------------------------------------------------ progress and notices

    def show_progress(self, text: str) -> None:
        box = self.query_one("#progress")
        if not box.display:
            self._progress_started = time.monotonic()
        self._progress_text = text
        self._progress_elapsed = True
        box.display = True
        self._tick_progress()
        if self._progress_timer is None:
            self._progress_timer = self.set_interval(0.5, self._tick_progress)

    def _tick_progress(self) -> None:
        elapsed = time.monotonic() - self._progress_started
        suffix = f"  ({elapsed:.0f} s)" if self._progress_elapsed else ""
        self.query_one("#progress-text", Static).update(literal(f"{self._progress_text}{suffix}"))

    def show_prefill(self, event: PrefillProgress) -> None:
        """The prefill's bar: tokens done of total, tokens per second, ETA."""
        self.show_progress(f"Reading the prompt: {progress_figures(event)} "
                           "(ctrl+c stops at the next chunk and keeps what was read)")
        self._progress_elapsed = False
        self._tick_progress()
        self.prefilling = True
        self.query_one("#progress-bar", ProgressBar).update(total=max(event.total, 1), progress=event.done)

    def hide_progress(self) -> None:
        self.prefilling = False
        self.query_one("#progress-bar", ProgressBar).update(total=None, progress=0)
        self.query_one("#progress").display = False
        if self._progress_timer is not None:
            self._progress_timer.stop()
            self._progress_timer = None

    def show_notice(self, text: str, *, error: bool = False) -> None:
        notice = self.query_one("#notice", Static)
        notice.update(literal(text))
        notice.display = bool(text)
        notice.set_class(error, "-error")

    def clear_notice(self) -> None:
        self.show_notice("")

    # ------------------------------------------------------------------ history

    async def show_history(self, records: Sequence[Mapping[str, Any]]) -> None:
        self.turn = None
        await self.transcript.show_records(records, mode=self.k3.reasoning_display, markdown=self.k3.markdown,
                                           tokenizer=self.k3.tokenizer)

    # ------------------------------------------------------------------ a turn

    async def begin_turn(self, kind: str, text: str | None, *, thinking: bool,
                         attachments: Sequence[Mapping[str, Any]] = ()) -> None:
        """Draw what the turn will change before it runs (undone by show_history if refused)."""
        transcript = self.transcript
        if kind == "regenerate":
            turns = transcript.turns()
            if turns:
                await turns[-1].remove()
        elif kind == "edit":
            users = list(transcript.query(UserMessage))
            if users:
                last = users[-1]
                siblings = list(transcript.children)
                for widget in siblings[siblings.index(last):]:
                    await widget.remove()
        if kind in ("send", "edit") and text is not None:
            await transcript.mount(UserMessage(text, attachments=attachments))
        self.turn = AssistantMessage(thinking=thinking, mode=self.k3.reasoning_display, markdown=self.k3.markdown,
                                     live=True)
        await transcript.mount(self.turn)
        transcript.anchor()
        self.status.turn_started()
        self.status.set_phase("preparing")

    async def turn_event(self, event: Any, *, pieces: int = 1) -> None:
        """One event of the running turn (``pieces``: how many text events a joined one holds)."""
        turn = self.turn
        if isinstance(event, ReasoningToken):
            if turn is not None and turn.reasoning is not None:
                turn.reasoning.append(event.text, pieces=pieces)
        elif isinstance(event, AnswerToken):
            if turn is not None:
                await turn.answer.append(event.text)
        elif isinstance(event, Stats):
            self.status.update_stats(event)
            if turn is not None and turn.reasoning is not None and turn.reasoning.live:
                turn.reasoning.count(event.generated_tokens)
        elif isinstance(event, Prefill):
            fed, reused = event.prefilled_tokens, event.reused_tokens
            where = f", {reused:,} reused" if reused else ""
            self.status.set_phase(f"prefill {fed:,} tokens{where}")
            if fed >= PREFILL_PROGRESS_TOKENS:
                self.show_progress(f"Prefilling {fed:,} tokens of conversation{where}")
        elif isinstance(event, PrefillProgress):
            if event.total >= PREFILL_PROGRESS_TOKENS and event.done < event.total:
                self.show_prefill(event)
        elif isinstance(event, PhaseChanged):
            self._phase(event.phase)
        elif isinstance(event, Notice):
            if event.kind in TURN_NOTICES and turn is not None:
                turn.set_status(event.text)
            else:
                self.k3.say(event.text)
        elif isinstance(event, TurnDone):
            await self._done(event)

    def _phase(self, phase: str) -> None:
        turn = self.turn
        if phase != "prefill":
            self.hide_progress()
        if phase == "reasoning":
            self.status.set_phase("thinking")
            if turn is not None and turn.reasoning is not None:
                turn.reasoning.start()
        elif phase == "answer":
            self.status.set_phase("answering")
            if turn is not None and turn.reasoning is not None and turn.reasoning.live:
                turn.reasoning.finish(collapse=True)
        elif phase == "sync":
            self.status.set_phase("lining up the engine state")
        elif phase == "done":
            self.status.set_phase("ready")

    async def _done(self, event: TurnDone) -> None:
        result = event.result
        turn = self.turn
        if turn is None:
            return
        if result.pending:  # stopped while reading the prompt: no answer, the message waits
            self.turn = None
            await turn.remove()
            self.show_notice(f"{result.message} (ctrl+r answers it)" if result.message else "")
            return
        if turn.reasoning is not None:
            # the stored figures, so that a redraw or a resume shows exactly these
            exact = stored_reasoning_size(result.record)
            boundary = getattr(self.k3.grammar, "boundary", ())
            tokens = exact[0] if exact else (reasoning_tokens(result.generated_ids, boundary) if boundary else None)
            turn.reasoning.finish(tokens=tokens, seconds=exact[1] if exact else None,
                                  text=result.reasoning if result.reasoning is not None else None,
                                  interrupted=result.interrupted and not result.answer)
        await turn.answer.finish(result.answer)
        if result.interrupted:
            turn.set_status(turn_status(result.record) if result.saved else
                            (f"interrupted: {result.message}" if result.message else "interrupted"))
        elif not result.saved:
            turn.set_status("NOT saved")
        turn.set_footer(result.record)
        turn.live = False

    async def turn_over(self) -> None:
        """The worker ended (after TurnDone, or after a refusal or failure)."""
        self.hide_progress()
        if self.turn is not None and self.turn.live:
            # No TurnDone (refused or failed before the answer): stop the live widgets.
            if self.turn.reasoning is not None and self.turn.reasoning.live:
                self.turn.reasoning.finish(interrupted=True)
            await self.turn.answer.finish()
            self.turn.live = False
        self.turn = None
        if self.status.phase not in ("ready",):
            self.status.set_phase("ready")

    # ------------------------------------------------------------------ input

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        if event.text == "" and (self.editing or not self.attachment_bar.attachments):
            return
        if self.editing:
            await self.k3.submit_edit(event.text)
        else:
            await self.k3.submit(event.text)

    def start_edit(self, text: str) -> None:
        if not self.editing:
            self._stash = self.prompt.text
        self.editing = True
        self.prompt.set_text(text)
        self.prompt.focus()
        self.add_class("-editing")
        self.show_notice("Editing your last message: enter resends it (its answer is replaced), escape cancels")

    def stop_edit(self, *, restore: bool) -> str:
        """Leave edit mode; ``restore`` puts back what the box held before ctrl+e. Returns
        that text (for the caller to put back itself after sending the edit)."""
        if not self.editing:
            return ""
        self.editing = False
        self.remove_class("-editing")
        stash, self._stash = self._stash, ""
        if restore:
            self.prompt.set_text(stash)
        self.clear_notice()
        return stash

    # ------------------------------------------------------------------ keys

    def _focused_turn(self) -> AssistantMessage | None:
        node: Widget | None = self.focused
        while node is not None and not isinstance(node, AssistantMessage):
            node = node.parent if isinstance(node.parent, Widget) else None
        return node

    def action_toggle_reasoning(self) -> None:
        focused = self.focused
        if isinstance(focused, ReasoningBlock):
            focused.action_toggle()
            return
        turn = self._focused_turn()
        blocks = [turn.reasoning] if turn is not None and turn.reasoning is not None else [
            t.reasoning for t in self.transcript.turns() if t.reasoning is not None and t.reasoning.display]
        if not blocks:
            self.k3.say("no reasoning to fold")
            return
        blocks[-1].action_toggle()

    def action_block(self, step: int) -> None:
        blocks = self.transcript.blocks()
        if not blocks:
            return
        focused = self.focused
        if focused in blocks:
            index = blocks.index(focused) + step
            if index >= len(blocks):
                self.prompt.focus()
                return
            index = max(0, index)
        else:
            index = len(blocks) - 1 if step < 0 else 0
        blocks[index].focus()
        blocks[index].scroll_visible(animate=False)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The vim keys only when turned on and a transcript block has the focus: anywhere
        else (the message box above all) the key is typed or does what it does there."""
        if action.startswith("vim_"):
            return self.k3.vim_keys and self.focused in self.transcript.blocks()
        return True

    def action_vim_block(self, step: int) -> None:
        """j / k: the next or previous block, stopping at either end (alt+down leaves for the input)."""
        blocks = self.transcript.blocks()
        if self.focused in blocks:
            target = blocks[max(0, min(len(blocks) - 1, blocks.index(self.focused) + step))]
            target.focus()
            target.scroll_visible(animate=False)

    def action_vim_end(self, index: int) -> None:
        """g / G: the first or the last block."""
        blocks = self.transcript.blocks()
        if blocks:
            blocks[index].focus()
            blocks[index].scroll_visible(animate=False)

    def action_tab(self) -> None:
        """From the message box, to the newest reasoning block (the one just read), else the
        newest block; from anywhere else, the next widget as usual."""
        if self.focused is not self.prompt:
            self.focus_next()
            return
        blocks = self.transcript.blocks()
        target = next((b for b in reversed(blocks) if isinstance(b, ReasoningBlock)), blocks[-1] if blocks else None)
        if target is None:
            self.focus_next()
            return
        target.focus()
        target.scroll_visible(animate=False)

    def action_scroll_transcript(self, direction: int) -> None:
        transcript = self.transcript
        if direction < 0:
            transcript.scroll_page_up(animate=False)
        else:
            transcript.scroll_page_down(animate=False)

    def action_escape(self) -> None:
        if self.editing:
            self.stop_edit(restore=True)
            return
        if self.focused is not self.prompt:
            self.prompt.focus()

    def on_reasoning_block_copy_requested(self, event: ReasoningBlock.CopyRequested) -> None:
        event.stop()
        if not event.text.strip():
            self.k3.say(f"nothing to copy: the {event.what} is empty")
            return
        self.app.copy_to_clipboard(event.text)
        self.k3.say(f"Copied the {event.what} ({len(event.text):,} characters)")

    def on_answer_block_code_copy_requested(self, event: AnswerBlock.CodeCopyRequested) -> None:
        event.stop()
        block = event.block
        self.app.copy_to_clipboard(block.code)
        language = one_line(block.language, 30) if block.language else "no language given"
        self.k3.say(f"Copied code block {event.number} of {event.count} ({language}, {block.lines:,} "
                    f"line{'s' if block.lines != 1 else ''})")

    def on_reasoning_block_view_requested(self, event: ReasoningBlock.ViewRequested) -> None:
        event.stop()
        self.k3.open_viewer(event.block)

    def last_answer(self) -> AnswerBlock | None:
        turns = self.transcript.turns()
        return turns[-1].answer if turns else None

    def on_markdown_link_clicked(self, event: Markdown.LinkClicked) -> None:
        event.stop()
        self.app.copy_to_clipboard(event.href)
        self.k3.say("Link copied to the clipboard (k3chat never opens links)")


__all__ = ["ChatScreen", "reasoning_tokens"]
