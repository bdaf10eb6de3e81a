"""The conversation as blocks: your messages, and per answer a reasoning block and the answer.

Every block can take focus (tab / shift+tab, alt+up / alt+down); c copies the focused one.
Answers stream into a Markdown stream (or plain text); the transcript follows the bottom until
you scroll up. Model text is never parsed as markup: Markdown is parsed with HTML off and no
link detection, links are never opened, and every piece of text is neutralised first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Markdown, Static

from k3chat.attachments import Attachment
from k3chat.conversation import stop_message

from ..text import literal, neutralise, one_line
from .attachments import size_text
from .reasoning import ReasoningBlock
from .status import format_speed


def _hard_breaks(state: Any) -> None:
    """A single newline inside a paragraph is a line break (chat text is written that way);
    Textual draws a soft break as a space."""
    for token in state.tokens:
        if token.type == "inline" and token.children:
            for child in token.children:
                if child.type == "softbreak":
                    child.type = "hardbreak"


def safe_markdown_parser() -> MarkdownIt:
    """CommonMark plus tables and strikethrough; raw HTML is text, URLs are not turned into
    links, and single newlines are kept."""
    md = MarkdownIt("gfm-like", {"html": False, "linkify": False, "breaks": True, "typographer": False})
    md.core.ruler.push("k3chat_hard_breaks", _hard_breaks)
    return md


class CodeBlock:
    """One fenced or indented code block of an answer, as the Markdown view shows it."""

    def __init__(self, code: str, language: str) -> None:
        self.code = code
        self.language = language

    @property
    def lines(self) -> int:
        return len(self.code.splitlines())


def code_blocks(text: str) -> list[CodeBlock]:
    """The code blocks of ``text`` in order, parsed by the parser that draws answers (so the
    numbers match what is on the screen); the code is the model's text exactly."""
    blocks = []
    for token in safe_markdown_parser().parse(text):
        if token.type in ("fence", "code_block"):
            info = token.info.split()
            blocks.append(CodeBlock(token.content, info[0] if info and token.type == "fence" else ""))
    return blocks


class _Block(Widget, can_focus=True):
    """A focusable block whose text can be copied."""

    BINDINGS = [Binding("c", "copy", "Copy", show=True)]
    what = "text"

    @property
    def text(self) -> str:
        raise NotImplementedError

    def action_copy(self) -> None:
        self.post_message(ReasoningBlock.CopyRequested(self.text, self.what))


class UserMessage(_Block):
    what = "message"

    def __init__(self, text: str, *, pending: bool = False, attachments: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(classes="message user")
        self._text = text
        self.attachments = list(attachments)  # history entries: shown by name, never their whole text
        self.set_class(pending, "-pending")

    @property
    def text(self) -> str:
        return self._text

    def compose(self) -> ComposeResult:
        yield Static("You", classes="speaker", markup=False)
        for entry in self.attachments:
            yield Static(literal(attachment_line(entry)), classes="attachment-line", markup=False)
        if self._text or not self.attachments:
            yield Static(literal(self._text), classes="body", markup=False)


def attachment_line(entry: Mapping[str, Any]) -> str:
    """One attached file in the transcript: name, kind, size and its notes, on one line."""
    attachment = Attachment.from_record(entry)
    notes = f" \u00b7 {'; '.join(attachment.notes)}" if attachment.notes else ""
    return one_line(f"\U0001f4ce {attachment.name} \u00b7 {attachment.label} \u00b7 {size_text(attachment.size)}{notes}", 200)


class AnswerBlock(_Block):
    """The answer: Markdown (streamed) or plain text."""

    BINDINGS = [Binding("c", "copy", "Copy", show=True), Binding("v", "view", "Reasoning", show=True),
                Binding("b", "copy_code", "Copy code", show=True),
                *(Binding(str(n), f"copy_code({n})", "Copy that code block", show=False) for n in range(1, 10))]
    what = "answer"

    class CodeCopyRequested(Message):
        """Copy one code block of this answer (``number`` of ``count``)."""

        def __init__(self, block: CodeBlock, number: int, count: int) -> None:
            super().__init__()
            self.block, self.number, self.count = block, number, count

    def __init__(self, text: str = "", *, markdown: bool = True, live: bool = False) -> None:
        super().__init__(classes="answer")
        self._parts: list[str] = [text] if text else []
        self._markdown = markdown
        self._stream: Any = None
        self._flush_pending = False
        self.live = live
        # Children made here, not queried: text may arrive before they are mounted.
        self._body: Widget = (
            Markdown(neutralise(text), parser_factory=safe_markdown_parser, open_links=False) if markdown
            else Static(literal(text), classes="plain", markup=False))
        self._placeholder = Static(self._placeholder_text(), classes="answer-placeholder", markup=False)
        self._placeholder.display = not text
        self._code_number = 0  # the code block b copied last (b copies the next one)

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def action_copy_code(self, number: int | None = None) -> None:
        """b: the next code block of this answer (the first after the last); 1-9: that one."""
        blocks = code_blocks(self.text)
        if not blocks:
            self.app.notify("This answer has no code block", markup=False)
            return
        if number is None:
            number = self._code_number % len(blocks) + 1
        elif number > len(blocks):
            self.app.notify(f"This answer has {len(blocks)} code block{'s' if len(blocks) > 1 else ''}",
                            markup=False)
            return
        self._code_number = number
        self.post_message(self.CodeCopyRequested(blocks[number - 1], number, len(blocks)))

    def compose(self) -> ComposeResult:
        yield self._body
        yield self._placeholder

    def _placeholder_text(self) -> Content:
        return Content("\u2026" if self.live else "(no answer)")

    def _show_placeholder(self) -> None:
        self._placeholder.display = not self.text

    async def append(self, text: str) -> None:
        if not text:
            return
        self._parts.append(text)
        self._show_placeholder()
        if self._markdown:
            if self._stream is None:
                assert isinstance(self._body, Markdown)
                self._stream = Markdown.get_stream(self._body)
            await self._stream.write(neutralise(text))
        elif not self._flush_pending:
            self._flush_pending = True
            self.call_after_refresh(self._flush_plain)

    def _flush_plain(self) -> None:
        self._flush_pending = False
        if isinstance(self._body, Static):
            self._body.update(literal(self.text))

    async def finish(self, final: str | None = None) -> None:
        """The turn is over; ``final`` is the answer as stored (shown if it differs)."""
        self.live = False
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if final is not None and final != self.text:
            self._parts = [final]
            if isinstance(self._body, Markdown):
                await self._body.update(neutralise(final))
            else:
                self._flush_plain()
        self._placeholder.update(self._placeholder_text())
        self._show_placeholder()

    def action_view(self) -> None:
        turn = self.parent
        if isinstance(turn, AssistantMessage) and turn.reasoning is not None:
            turn.reasoning.action_view()
        else:
            self.app.notify("This answer has no reasoning", markup=False)


class AssistantMessage(Vertical):
    """One answer: reasoning block (when thinking was on), answer, and a status line."""

    def __init__(self, *, thinking: bool, mode: str, markdown: bool, live: bool = False,
                 record: Mapping[str, Any] | None = None, tokenizer: Any = None) -> None:
        super().__init__(classes="message assistant")
        self.live = live
        self.reasoning: ReasoningBlock | None = None
        if record is not None:
            reasoning = record.get("reasoning_content")
            interrupted = bool(record.get("interrupted"))
            if reasoning is not None:
                exact = stored_reasoning_size(record)
                tokens, seconds = exact if exact is not None else _reasoning_size(reasoning, record, tokenizer)
                self.reasoning = ReasoningBlock(reasoning, mode=mode, tokens=tokens, seconds=seconds,
                                                approximate=exact is None,
                                                interrupted=interrupted and not record.get("content"))
            self.answer = AnswerBlock(str(record.get("content", "")), markdown=markdown)
            self._status = turn_status(record)
            self._footer = turn_footer(record)
        else:
            if thinking:
                self.reasoning = ReasoningBlock(live=live, mode=mode)
            self.answer = AnswerBlock(markdown=markdown, live=live)
            self._status = ""
            self._footer = ""

    def compose(self) -> ComposeResult:
        yield Static("K3", classes="speaker", markup=False)
        if self.reasoning is not None:
            yield self.reasoning
        yield self.answer
        status = Static(Content(self._status), classes="turn-status", markup=False)
        status.display = bool(self._status)
        status.set_class(bool(self._status), "-warning")  # as set_status draws it live
        yield status
        footer = Static(Content(self._footer), classes="turn-footer", markup=False)
        footer.display = bool(self._footer)
        yield footer

    def set_status(self, text: str, *, warning: bool = True) -> None:
        self._status = text
        status = self.query_one(".turn-status", Static)
        status.update(literal(text))
        status.display = bool(text)
        status.set_class(warning, "-warning")


    def set_footer(self, record: Mapping[str, Any]) -> None:
        """The turn's times and speed, from its stored record (as a redraw or a resume shows them)."""
        self._footer = turn_footer(record)
        footer = self.query_one(".turn-footer", Static)
        footer.update(literal(self._footer))
        footer.display = bool(self._footer)


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def turn_footer(record: Mapping[str, Any]) -> str:
    """The line under an answer: time to the first token, the whole turn, decoding speed (each
    only when the record stores it: older records have no times)."""
    speed = record.get("speed") if isinstance(record.get("speed"), Mapping) else {}
    parts = []
    first, whole = speed.get("first_token_seconds"), speed.get("turn_seconds")
    if isinstance(first, (int, float)) and first > 0:
        parts.append(f"first token {_duration(first)}")
    if isinstance(whole, (int, float)) and whole > 0:
        parts.append(f"turn {_duration(whole)}")
    decode = speed.get("decode_tokens_per_second")
    if parts and isinstance(decode, (int, float)) and decode > 0:
        parts.append(format_speed(decode))
    return " \u00b7 ".join(parts)


def turn_status(record: Mapping[str, Any]) -> str:
    """The line under an answer, from its stored record: why it was interrupted (the same live,
    after a redraw and after a resume); records older than the "stop" field just say so."""
    if not record.get("interrupted"):
        return ""
    stop = record.get("stop")
    generated = (record.get("tokens") or {}).get("generated")
    message = stop_message(stop, generated if isinstance(generated, int) else 0) if isinstance(stop, str) else None
    return f"interrupted: {message}" if message else "interrupted"


def stored_reasoning_size(record: Mapping[str, Any]) -> tuple[int, float | None] | None:
    """The exact reasoning tokens and seconds a record stores (None for older records)."""
    tokens = (record.get("tokens") or {}).get("reasoning")
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        return None
    seconds = (record.get("speed") or {}).get("reasoning_seconds")
    return tokens, float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else None


def _reasoning_size(reasoning: str, record: Mapping[str, Any], tokenizer: Any) -> tuple[int, float | None]:
    """Tokens and seconds of a stored reasoning (not stored as such: recounted, estimated)."""
    tokens = 0
    generated = (record.get("tokens") or {}).get("generated")
    if not record.get("content") and isinstance(generated, int) and generated > 0:
        tokens = generated  # no answer: every sampled id was reasoning
    elif reasoning:
        try:
            tokens = len(tokenizer.encode_text(reasoning)) if tokenizer is not None else len(reasoning) // 4
        except Exception:
            tokens = len(reasoning) // 4
    speed = (record.get("speed") or {}).get("decode_tokens_per_second")
    seconds = tokens / speed if isinstance(speed, (int, float)) and speed > 0 and tokens else None
    if seconds is not None and seconds < 0.1:
        seconds = None  # "about 0.0 s" says nothing
    return tokens, seconds


class Transcript(VerticalScroll, can_focus=False):
    """The scrolling conversation; anchored to the bottom until the user scrolls up."""

    def on_mount(self) -> None:
        self.anchor()

    def blocks(self) -> list[Widget]:
        """Focusable blocks in reading order (hidden reasoning blocks excluded)."""
        return [w for w in self.query("UserMessage, ReasoningBlock, AnswerBlock") if w.display]

    def turns(self) -> list[AssistantMessage]:
        return list(self.query(AssistantMessage))

    async def show_records(self, records: Iterable[Mapping[str, Any]], *, mode: str, markdown: bool,
                           tokenizer: Any) -> None:
        await self.remove_children()
        widgets: list[Widget] = []
        for record in records:
            role = record.get("role")
            if role == "user":
                widgets.append(UserMessage(str(record.get("content", "")), attachments=record.get("attachments") or ()))
            elif role == "assistant":
                widgets.append(AssistantMessage(thinking="reasoning_content" in record, mode=mode,
                                                markdown=markdown, record=record, tokenizer=tokenizer))
            elif role == "system":
                widgets.append(Static(literal(f"System: {record.get('content', '')}"), classes="system",
                                      markup=False))
        if widgets:
            await self.mount_all(widgets)
        self.anchor()
