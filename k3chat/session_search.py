"""Search across every session, in what was said, in the model's reasoning and in the text of
attached files.

One implementation for `k3chat sessions search TEXT` and the app's session browser. Matching
is case-insensitive on the text as stored (an encrypted history is read through its vault,
like any load). Each hit carries a one-line snippet around the match, split into the text
before, the match and the text after, so a caller can highlight it; controls in a snippet are
shown as visible escapes (display.for_terminal), never obeyed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from k3chat.display import for_terminal
from k3chat.history import HistoryError, HistoryStore, SessionInfo

SNIPPET_CONTEXT = 40  # characters of context on each side of a match
FIELDS = ("content", "reasoning_content")


@dataclass(frozen=True)
class Hit:
    session: SessionInfo
    record: int  # 1-based position of the record in the conversation
    role: str
    field: str  # "content", "reasoning_content" or "attachment"
    before: str
    match: str
    after: str
    attachment: str | None = None  # the attached file's name, for a match inside its text

    @property
    def snippet(self) -> str:
        return self.before + self.match + self.after

    @property
    def where(self) -> str:
        """Who said it, in words: "your message 3", "K3's reasoning 4" ..."""
        if self.attachment is not None:
            return f"attachment {for_terminal(self.attachment)}, message {self.record}"
        if self.role == "assistant":
            return f"{'reasoning' if self.field == 'reasoning_content' else 'answer'}, message {self.record}"
        return f"{'your message' if self.role == 'user' else 'system message'} {self.record}"

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session.id, "name": self.session.name, "record": self.record, "role": self.role,
                "field": self.field, "attachment": self.attachment, "snippet": self.snippet,
                "match_start": len(self.before), "match_end": len(self.before) + len(self.match)}


@dataclass
class SearchResult:
    hits: list[Hit]
    problems: list[str]  # sessions that could not be read, one line each


def pattern(text: str) -> re.Pattern[str]:
    """``text`` as a literal, case-insensitive pattern (ValueError if it is blank)."""
    if not text.strip():
        raise ValueError("give some text to search for")
    return re.compile(re.escape(text), re.IGNORECASE)


def search_sessions(store: HistoryStore, text: str, *, per_session: int | None = None) -> SearchResult:
    """Every match of ``text`` in every session (most recently updated first, as listed), at
    most ``per_session`` hits for each. A session that cannot be read is named in problems."""
    needle = pattern(text)
    result = SearchResult([], [])
    for info in store.list():
        try:
            records = store.load(info.id).records
        except (HistoryError, OSError) as exc:
            result.problems.append(f"session {info.id} could not be searched: {exc}")
            continue
        result.hits += list(_limited(record_hits(info, records, needle), per_session))
    return result


def record_hits(info: SessionInfo, records: Iterable[Mapping[str, Any]], needle: re.Pattern[str]) -> Iterable[Hit]:
    for number, record in enumerate(records, start=1):
        for field in FIELDS:
            value = record.get(field)
            if isinstance(value, str) and value:
                for m in needle.finditer(value):
                    yield _hit(info, number, str(record.get("role")), field, value, m)
        for entry in record.get("attachments") or ():  # the text the model read for each file
            for m in needle.finditer(entry["text"]):
                yield _hit(info, number, str(record.get("role")), "attachment", entry["text"], m, entry["name"])


def _limited(hits: Iterable[Hit], limit: int | None) -> Iterable[Hit]:
    for count, hit in enumerate(hits):
        if limit is not None and count >= limit:
            return
        yield hit


def _hit(info: SessionInfo, number: int, role: str, field: str, value: str, m: re.Match[str],
         attachment: str | None = None) -> Hit:
    start, end = m.span()
    lead = max(0, start - SNIPPET_CONTEXT)
    tail = min(len(value), end + SNIPPET_CONTEXT)
    before = ("\u2026" if lead else "") + _one_line(value[lead:start])
    after = _one_line(value[end:tail]) + ("\u2026" if tail < len(value) else "")
    return Hit(info, number, role, field, before, _one_line(m.group()), after, attachment)


def _one_line(text: str) -> str:
    # Line breaks and tabs become spaces (a snippet is one line); other controls are shown.
    return for_terminal(re.sub(r"[\r\n\t]", " ", text))


__all__ = ["Hit", "SearchResult", "search_sessions", "record_hits", "pattern", "SNIPPET_CONTEXT"]
