"""Model and user text made safe to draw: shown literally, never interpreted.

Text that reaches the terminal from the model (or from a history file, a session name, a
file path) is never parsed as Textual or Rich markup: it is wrapped in ``Content`` objects,
whose constructor takes text as is. That alone does not neutralise control characters, which
a terminal would obey (``\\x1b[31m`` would recolour the screen, ``\\x1b]52;...`` could write the
clipboard), so every such character is first replaced by a visible stand-in:

- C0 controls and DEL become their Unicode "control pictures" (``\\x1b`` -> ``␛``);
  newline and tab are kept; a CR right before a newline is dropped;
- C1 controls (U+0080..U+009F) and the bidirectional overrides and isolates (which reorder
  what is displayed, "trojan source") become ``⟨U+XXXX⟩``.
"""

from __future__ import annotations

import re

from textual.content import Content

_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _stand_in(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x20:
        return chr(0x2400 + code)
    if code == 0x7F:
        return "\u2421"
    return f"\u27e8U+{code:04X}\u27e9"


def neutralise(text: str) -> str:
    """``text`` with every character a terminal would act on replaced by a visible one."""
    if "\r\n" in text:
        text = text.replace("\r\n", "\n")
    return _UNSAFE.sub(_stand_in, text)


def literal(text: str) -> Content:
    """Content that shows ``text`` exactly (markup characters included), neutralised."""
    return Content(neutralise(text))


def one_line(text: str, limit: int = 80) -> str:
    """A single display line: whitespace runs folded, neutralised, cut with an ellipsis."""
    line = neutralise(" ".join(text.split()))
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"
