"""XTML: K3's chat format (spec k3-chat.md section 1), rendered as segments and parsed back.

A rendering is a list of segments. A control segment is one marker name encoded as its
single id; a text segment is encoded alone with specials off, so user text can never
produce a special id and BPE never crosses a segment boundary.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from k3chat.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP, IncrementalDecoder, Tokenizer

EFFORTS: tuple[str, ...] = ("low", "high", "max")

_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)

_TOOL_DECLARE_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
# Only the ports carry this text (spec 1.9, unconfirmed against encoding_k3.py).
_TOOL_DECLARE_DYNAMIC_HEAD = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
)


class TemplateError(ValueError):
    """A conversation or setting that cannot be rendered in K3's format."""


class MalformedTurn(Exception):
    """A completion that does not follow the grammar of spec 1.7/1.8."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Segment(NamedTuple):
    text: str
    allow_special: bool


# ---------------------------------------------------------------------------------------
# Segment builders


def _text(value: str) -> list[Segment]:
    """An empty text yields no segment (spec 1.2)."""
    return [Segment(value, False)] if value else []


def _ctl(name: str) -> list[Segment]:
    return [Segment(name, True)]


def escape_attr(value: Any) -> str:
    """ESC of spec 1.2: `&` first (so `&quot;` is not escaped again), then `"`; nothing else."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _attr(key: str, value: Any) -> list[Segment]:
    """Four text segments: ` KEY`, `="`, ESC(value), `"` (the official split)."""
    return _text(f" {key}") + _text('="') + _text(escape_attr(value)) + _text('"')


def _open(tag: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    out = _ctl(OPEN) + _text(tag)
    for key, value in attrs:
        out += _attr(key, value)
    return out + _ctl(SEP)


def _close(tag: str) -> list[Segment]:
    return _ctl(CLOSE) + _text(tag) + _ctl(SEP)


def _element(tag: str, body: str, attrs: Sequence[tuple[str, Any]] = ()) -> list[Segment]:
    return _open(tag, attrs) + _text(body) + _close(tag)


def _message(attrs: Sequence[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    return _open("message", attrs) + body + _close("message") + _ctl(END_OF_MSG)


def _system_typed(kind: str, body: str) -> list[Segment]:
    """A synthesized system message: role, then type, one stripped body segment."""
    return _message([("role", "system"), ("type", kind)], _text(body.strip()))


# ---------------------------------------------------------------------------------------
# Settings


def check_effort(effort: str | None) -> None:
    """low, high or max; anything else (medium included) is a configuration error."""
    if effort is not None and effort not in EFFORTS:
        raise TemplateError(f"thinking_effort must be low, high or max, got {effort!r}")


def effort_body(effort: str) -> str:
    check_effort(effort)
    return _EFFORT_BODY.format(effort=effort)


# ---------------------------------------------------------------------------------------
# Tools (spec 1.9; rendered for completeness, k3chat does not use them yet)


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def _tool_declare(tools: Any, *, dynamic: bool) -> list[Segment]:
    head = _TOOL_DECLARE_DYNAMIC_HEAD if dynamic else _TOOL_DECLARE_HEAD
    body = head + "```json\n" + _compact_json(tools) + "\n```"
    # The declaration body is not stripped (unlike the other synthesized messages).
    return _message([("role", "system"), ("type", "tool-declare")], _text(body))


def _arg_type(value: Any) -> str:
    if isinstance(value, bool):  # before int: a bool is an int in Python
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "object"
    return "array"


def _arg_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call_function(call: Any) -> Mapping[str, Any]:
    if not isinstance(call, Mapping):
        raise TemplateError("a tool call must be an object")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise TemplateError("a tool call needs a non-empty function name")
    return fn


def _call_arguments(raw: Any) -> tuple[Mapping[str, Any], str | None]:
    """(arguments, raw JSON text when it does not parse)."""
    if raw is None:
        return {}, None
    if isinstance(raw, Mapping):
        return raw, None
    if not isinstance(raw, str):
        raise TemplateError("tool call arguments must be an object or a JSON string")
    if not raw.strip():
        return {}, None
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        return {}, raw
    if not isinstance(parsed, dict):
        raise TemplateError("tool call arguments must be a JSON object")
    return parsed, None


def _tools_block(calls: Sequence[Any]) -> list[Segment]:
    out = _open("tools")
    for index, call in enumerate(calls, start=1):
        fn = _call_function(call)
        args, raw = _call_arguments(fn.get("arguments"))
        out += _open("call", [("tool", fn["name"]), ("index", index)])
        if raw is not None:
            out += _element("json", raw, [("type", "object")])
        for key, value in args.items():
            out += _element("argument", _arg_value(value), [("key", key), ("type", _arg_type(value))])
        out += _close("call")
    return out + _close("tools")


def _call_ids(calls: Sequence[Any]) -> dict[str, tuple[int, str]]:
    """tool_call id -> (1-based call position, function name); first occurrence wins."""
    index: dict[str, tuple[int, str]] = {}
    for position, call in enumerate(calls, start=1):
        if isinstance(call, Mapping) and call.get("id") is not None:
            index.setdefault(str(call["id"]), (position, _call_function(call)["name"]))
    return index


def _sort_tool_results(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Put each run of tool results in call order when every one matches a tool_call_id."""
    out: list[Mapping[str, Any]] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        msg = messages[i]
        if msg.get("role") != "tool":
            if msg.get("role") == "assistant":
                calls = _call_ids(msg.get("tool_calls") or [])
            out.append(msg)
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        out += _sorted_run(messages[i:j], calls)
        i = j
    return out


def _sorted_run(run: Sequence[Mapping[str, Any]], calls: dict[str, tuple[int, str]]) -> list[Mapping[str, Any]]:
    matched = []
    for offset, msg in enumerate(run):
        call_id = msg.get("tool_call_id", msg.get("id"))
        hit = calls.get(str(call_id)) if call_id is not None else None
        if hit is None:
            return list(run)  # a partly matched run is left as it is
        matched.append((hit[0], offset, {**msg, "tool": hit[1]}))
    matched.sort(key=lambda item: (item[0], item[1]))
    return [m for _, _, m in matched]


# ---------------------------------------------------------------------------------------
# Messages


def _content(msg: Mapping[str, Any]) -> str:
    content = msg.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise TemplateError(f"{msg.get('role')} content must be a string")
    return content  # never trimmed


def _reasoning(msg: Mapping[str, Any]) -> str:
    value = msg.get("reasoning_content")
    if value is None:
        return ""
    text = str(value)
    # Official rule: whitespace-only reasoning renders as an empty think element.
    return text if text.strip() else ""


def _assistant(msg: Mapping[str, Any], thinking: bool) -> list[Segment]:
    body: list[Segment] = []
    if thinking:
        body += _element("think", _reasoning(msg))
    body += _element("response", _content(msg))
    if msg.get("tool_calls"):
        body += _tools_block(msg["tool_calls"])
    return _message([("role", "assistant")], body)


def _skipped(msg: Mapping[str, Any]) -> bool:
    """An interrupted record with nothing in it is not rendered (our choice, spec 5.4)."""
    return (
        msg.get("role") == "assistant"
        and bool(msg.get("interrupted"))
        and not msg.get("content")
        and not msg.get("reasoning_content")
        and not msg.get("tool_calls")
    )


def _render_messages(messages: Sequence[Mapping[str, Any]], thinking: bool) -> list[Segment]:
    out: list[Segment] = []
    calls: Sequence[Any] = []
    tool_index = 0
    for msg in _sort_tool_results(messages):
        role = msg.get("role")
        if _skipped(msg):
            continue
        if role == "assistant":
            calls, tool_index = msg.get("tool_calls") or [], 0
            out += _assistant(msg, thinking)
        elif role == "system" and msg.get("tools"):
            out += _tool_declare(msg["tools"], dynamic=True)
        elif role in ("system", "user"):
            out += _message([("role", role)], _text(_content(msg)))
        elif role == "tool":
            tool_index += 1
            out += _message(
                [("role", "tool"), ("tool", _tool_name(msg, calls, tool_index)), ("index", tool_index)],
                _text(_content(msg)),
            )
        else:
            raise TemplateError(f"unknown role {role!r}")
    return out


def _tool_name(msg: Mapping[str, Any], calls: Sequence[Any], index: int) -> str:
    name = msg.get("tool", msg.get("name"))
    if name is None and index <= len(calls):
        name = _call_function(calls[index - 1])["name"]
    if name is None:
        raise TemplateError("a tool result needs a tool name or a matching call")
    return str(name)


def generation_prompt(thinking: bool) -> list[Segment]:
    """The unclosed assistant message the model continues."""
    return _open("message", [("role", "assistant")]) + _open("think" if thinking else "response")


def render(
    messages: Sequence[Mapping[str, Any]],
    *,
    thinking: bool,
    effort: str | None,
    add_generation_prompt: bool,
    tools: Sequence[Any] | None = None,
) -> list[Segment]:
    """Render records in the official order (spec 1.4): tools, effort, messages, prompt."""
    check_effort(effort)
    out: list[Segment] = []
    if tools:
        out += _tool_declare(tools, dynamic=False)
    if thinking and effort is not None:
        out += _system_typed("thinking-effort", effort_body(effort))
    out += _render_messages(messages, thinking)
    if add_generation_prompt:
        out += generation_prompt(thinking)
    return out


def render_text(segments: Sequence[Segment]) -> str:
    """The joined text, for goldens and debugging only (never encode this)."""
    return "".join(s.text for s in segments)


def encode(segments: Sequence[Segment], tokenizer: Tokenizer) -> list[int]:
    """Encode each segment alone; control segments map straight to their single id."""
    ids: list[int] = []
    for seg in segments:
        if seg.allow_special:
            ids.append(tokenizer.special_id(seg.text))
        else:
            ids.extend(tokenizer.encode_text(seg.text))
    return ids


# ---------------------------------------------------------------------------------------
# Completion grammar and parsing (spec 1.7, 1.8, 5.4)


@dataclass(frozen=True)
class ParsedTurn:
    reasoning: str | None
    content: str


def _find(ids: Sequence[int], seq: Sequence[int], start: int = 0) -> int:
    """Index of the first occurrence of seq in ids at or after start, else -1."""
    n, m = len(ids), len(seq)
    first = seq[0]
    for i in range(start, n - m + 1):
        if ids[i] == first and list(ids[i : i + m]) == list(seq):
            return i
    return -1


class Grammar:
    """BOUNDARY, CLOSURE and END computed from a loaded tokenizer (spec 1.7)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        tok = tokenizer
        self.tokenizer = tok
        self.t_think = tuple(tok.encode_text("think"))
        self.t_resp = tuple(tok.encode_text("response"))
        self.t_msg = tuple(tok.encode_text("message"))
        close, sep, open_ = tok.close_id, tok.sep_id, tok.open_id
        self.boundary: tuple[int, ...] = (close, *self.t_think, sep, open_, *self.t_resp, sep)
        self.closure: tuple[int, ...] = (close, *self.t_resp, sep, close, *self.t_msg, sep)
        self.end_ids: frozenset[int] = tok.end_ids

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> Grammar:
        return cls(tokenizer)

    def _decode_part(self, ids: Sequence[int], what: str) -> str:
        for i in ids:
            if self.tokenizer.is_special(i):
                raise MalformedTurn(f"special id {i} ({self.tokenizer.special_name(i)}) in the {what}")
        return self.tokenizer.decode(ids)

    def parse_strict(self, ids: Sequence[int], thinking: bool) -> ParsedTurn:
        """Spec 1.8: REASONING BOUNDARY CONTENT CLOSURE END, exactly one end id, last."""
        g = list(ids)
        n = len(g)
        body = 0
        if thinking:
            b = _find(g, self.boundary)
            if b < 0:
                raise MalformedTurn("no end of reasoning (think/response boundary) in the turn")
            body = b + len(self.boundary)
        c = _find(g, self.closure, body)
        if c < 0:
            raise MalformedTurn("the response is not closed")
        if c + len(self.closure) != n - 1 or g[n - 1] not in self.end_ids:
            raise MalformedTurn("the turn does not end with exactly one end id after the closed response")
        reasoning = self._decode_part(g[: body - len(self.boundary)], "reasoning") if thinking else None
        content = self._decode_part(g[body:c], "content")
        return ParsedTurn(reasoning=reasoning, content=content)

    def _scan_to(self, g: Sequence[int], start: int, seq: Sequence[int]) -> tuple[int, bool]:
        """From start, the first special id: (its index, whether seq begins there)."""
        for i in range(start, len(g)):
            if self.tokenizer.is_special(g[i]):
                return i, list(g[i : i + len(seq)]) == list(seq)
        return len(g), False

    def parse_lenient(self, ids: Sequence[int], thinking: bool) -> ParsedTurn:
        """Spec 5.4: keep what an interrupted or malformed turn said, never a special id.

        Each part runs to its delimiter (BOUNDARY, then CLOSURE) or to the first other
        special id (the cut; END ids included). Step 4 (drop a dangling proper prefix of
        the delimiter) needs no code: both delimiters begin with <|close|>, a special id,
        so the cut always falls where such a prefix starts.
        """
        g = list(ids)
        reasoning: str | None = None
        body = 0
        if thinking:
            b, found = self._scan_to(g, 0, self.boundary)
            if not found:
                return ParsedTurn(reasoning=self.tokenizer.decode(g[:b]), content="")
            reasoning = self.tokenizer.decode(g[:b])
            body = b + len(self.boundary)
        c, _ = self._scan_to(g, body, self.closure)
        return ParsedTurn(reasoning=reasoning, content=self.tokenizer.decode(g[body:c]))


# ---------------------------------------------------------------------------------------
# Streaming


class StreamParser:
    """Turns sampled ids into display text by channel, as they arrive (spec 3.5).

    push() returns (channel, text) pairs, channel "reasoning" or "content". Control ids are
    never shown, and ids that could begin BOUNDARY or CLOSURE are held until they resolve.
    The stored text always comes from parse_strict/parse_lenient, not from here.
    """

    def __init__(self, grammar: Grammar, thinking: bool) -> None:
        self._g = grammar
        self._channel = "reasoning" if thinking else "content"
        self._dec = self._decoder()
        self.closed = False  # True once CLOSURE itself was seen (not a lenient cut)

    def _decoder(self) -> IncrementalDecoder:
        seq = self._g.boundary if self._channel == "reasoning" else self._g.closure
        return self._g.tokenizer.stream_decoder([seq])

    @property
    def channel(self) -> str:
        """The current channel: "reasoning", "content", or "done" once closed or cut."""
        return self._channel

    def push(self, token_id: int) -> list[tuple[str, str]]:
        if self._channel == "done":
            return []
        target = self._g.boundary if self._channel == "reasoning" else self._g.closure
        pending = (*self._dec.held, token_id)
        if pending == target:
            return self._switch(drop_held=True)
        tok = self._g.tokenizer
        if pending != target[: len(pending)] and any(tok.is_special(i) for i in pending):
            return self._stop()  # a control id outside the grammar ends what we show (lenient cut)
        return self._out(self._dec.push(token_id))

    def _switch(self, *, drop_held: bool) -> list[tuple[str, str]]:
        events = self._out(self._dec.flush(drop_held=drop_held))
        if self._channel == "reasoning":
            self._channel = "content"
            self._dec = self._decoder()
        else:
            self._channel = "done"
            self.closed = True
        return events

    def _stop(self) -> list[tuple[str, str]]:
        events = self._out(self._dec.flush(drop_held=True))
        self._channel = "done"
        return events

    def finish(self) -> list[tuple[str, str]]:
        """End of generation: show the rest, minus a dangling partial BOUNDARY/CLOSURE."""
        if self._channel == "done":
            return []
        return self._stop()

    def _out(self, text: str) -> list[tuple[str, str]]:
        return [(self._channel, text)] if text else []
