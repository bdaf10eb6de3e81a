"""Text that reaches a terminal: model output, stored history, names, messages quoting them.

A model (or a pasted document, or a hand-edited history file) can contain escape sequences.
Written raw to a terminal they can retitle the window, rewrite what is on screen, plant
clipboard contents (OSC 52), make links that lie (OSC 8), or reorder what the reader sees
(bidi overrides, "Trojan Source"). So every terminal write of such text goes through
:func:`for_terminal`, and JSON written for people and peers goes through :func:`json_safe`.

Convention (one rule, per character, so stream chunks can be sanitized one at a time):

- kept: every printable character, ``\\n`` and ``\\t``;
- shown as Python-style escapes, as plain text: the C0 controls (U+0000-U+001F except ``\\n``
  and ``\\t``) and DEL as ``\\x00``...``\\x1f``, ``\\x7f``; the C1 controls (U+0080-U+009F,
  which include the 8-bit CSI U+009B and OSC U+009D) as ``\\x80``...``\\x9f``; the bidi
  embedding, override and isolate controls (U+202A-U+202E, U+2066-U+2069) as ``\\u202a``...;
  lone surrogates (undecodable bytes from argv) as ``\\udc80``... (they cannot be encoded for
  output at all).

So ESC [ 2 J reaches the screen as the eight visible characters ``\\x1b[2J``. The mapping is
for display only and is not reversible (a literal backslash is left as it is); the stored
text is never changed, and exports that must be faithful use JSON escapes instead.
"""

from __future__ import annotations

import re

# One class for everything that must never reach a terminal raw.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# The same set, minus what JSON already escapes (json.dumps escapes every C0 control).
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def for_terminal(text: str) -> str:
    """``text`` with every terminal control made visible (see the module docstring)."""
    return _UNSAFE.sub(_escape, text)


def is_terminal_safe(text: str) -> bool:
    """True when :func:`for_terminal` would leave ``text`` unchanged."""
    return _UNSAFE.search(text) is None


def json_safe(json_text: str) -> str:
    """JSON text (from ``json.dumps(..., ensure_ascii=False)``) with DEL, the C1 controls and
    the bidi controls written as ``\\uXXXX`` escapes. Those characters can only occur inside
    JSON strings, so the result is still valid JSON and decodes to exactly the same values;
    it just cannot drive a terminal that prints it."""
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text)


__all__ = ["for_terminal", "is_terminal_safe", "json_safe"]
