"""Model answers as Markdown that renders as Markdown but can never fetch anything.

An exported answer keeps its emphasis, lists, tables, headings and code; what a renderer could
turn into a request or live markup is made text:

- ``<`` outside code is backslash-escaped: no raw HTML (``<img>``, ``<script>``), no
  ``<https://...>`` autolinks, no HTML comments;
- ``[`` and ``]`` outside code are backslash-escaped: no images, no links, no reference
  definitions; ``![pixel](https://...)`` is shown as that text;
- bare URLs (``https://``, ``http://``, ``ftp://``, ``www.``) are put in code spans, so a
  renderer that links bare URLs (GitHub, markdown-it's linkify) shows them as text;
- a code fence the answer leaves open is closed, so it cannot swallow the rest of the file.

Fenced code blocks are kept exactly. Inline code spans are kept only in a paragraph whose
backticks pair up within each line (then every renderer pairs them the same way); anywhere
else backticks are escaped too, so no code span can hide a ``<`` the scan took for code.
Control characters are shown as visible escapes (display.for_terminal) before all this.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from k3chat.display import for_terminal

_FENCE_OPEN = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_URL = re.compile(r"(?:https?://|ftp://|www\.)[^\s<>`|\[\]]+")
_URL_TRAILING = ".,:;!?\"')*_~"
_ESCAPED_OUTSIDE_CODE = {"<": "\\<", "[": "\\[", "]": "\\]"}
_PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


@dataclass
class _Fence:
    indent: str
    char: str
    length: int

    def closes(self, line: str) -> bool:
        stripped = line.lstrip(" ")
        run = len(stripped) - len(stripped.lstrip(self.char))
        return (len(line) - len(stripped) <= 3 and run >= self.length
                and stripped[run:].strip() == "")


def _fence_opened_by(line: str) -> _Fence | None:
    m = _FENCE_OPEN.match(line)
    if m is None:
        return None
    fence = m["fence"]
    if fence[0] == "`" and "`" in m["info"]:
        return None  # CommonMark: not a fence, an inline code span
    return _Fence(m["indent"], fence[0], len(fence))


def answer_markdown(text: str) -> list[str]:
    """The lines of ``text`` (an answer) as inert Markdown; see the module docstring."""
    out: list[str] = []
    paragraph: list[str] = []
    fence: _Fence | None = None
    for line in for_terminal(text).split("\n"):
        if fence is not None:
            out.append(line)
            if fence.closes(line):
                fence = None
            continue
        opened = _fence_opened_by(line)
        if opened is not None or not line.strip():
            out += _inline_block(paragraph)
            paragraph = []
            out.append(line)
            fence = opened
            continue
        paragraph.append(line)
    out += _inline_block(paragraph)
    if fence is not None:
        out.append(fence.indent + fence.char * fence.length)  # left open by the answer: closed here
    return out


# --------------------------------------------------------------------------- inline text


def _code_spans(line: str) -> list[tuple[int, int]] | None:
    """(start, end) of each code span in ``line`` as CommonMark pairs backtick runs, or None
    when a run is left unpaired or a span holds a ``|`` (a GFM table cell boundary)."""
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(line):
        ch = line[i]
        if ch == "\\" and i + 1 < len(line) and line[i + 1] in _PUNCTUATION:
            i += 2
            continue
        if ch != "`":
            i += 1
            continue
        run = len(line) - i - len(line[i:].lstrip("`"))
        close = _closing_run(line, i + run, run)
        if close is None or "|" in line[i:close + run]:
            return None
        spans.append((i, close + run))
        i = close + run
    return spans


def _closing_run(line: str, start: int, length: int) -> int | None:
    for m in re.finditer(r"`+", line[start:]):
        if len(m.group()) == length:
            return start + m.start()
    return None


def _inline_block(lines: list[str]) -> list[str]:
    """A paragraph-like run of lines: code spans kept only if every line pairs its own."""
    per_line = [_code_spans(line) for line in lines]
    keep_spans = all(spans is not None for spans in per_line)
    return [_inline_line(line, spans if keep_spans else None) for line, spans in zip(lines, per_line)]


def _inline_line(line: str, spans: list[tuple[int, int]] | None) -> str:
    if spans is None:
        return _escape_text(line, escape_backticks=True)
    out, at = [], 0
    for start, end in spans:
        out += [_escape_text(line[at:start]), line[start:end]]
        at = end
    out.append(_escape_text(line[at:]))
    return "".join(out)


def _escape_text(text: str, *, escape_backticks: bool = False) -> str:
    """Text outside code: URLs into code spans, the rest escaped where it could be live."""
    out, at = [], 0
    for m in _URL.finditer(text):
        url = m.group().rstrip(_URL_TRAILING)
        if not url or url.endswith(("://", "www.")):
            continue
        out += [_escape_chars(text[at:m.start()], escape_backticks), f"`{url}`"]
        at = m.start() + len(url)
    out.append(_escape_chars(text[at:], escape_backticks))
    return "".join(out)


def _escape_chars(text: str, escape_backticks: bool) -> str:
    table = dict(_ESCAPED_OUTSIDE_CODE, **({"`": "\\`"} if escape_backticks else {}))
    # A backslash already escaping one of them stays as the writer meant it: "\[" shows "[".
    return re.sub(r"\\[\\<\[\]`]|[<\[\]`]", lambda m: m.group() if len(m.group()) == 2 else table.get(m.group(), m.group()), text)


__all__ = ["answer_markdown"]
