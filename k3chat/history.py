"""Conversation history: one JSONL file per session plus an index, all private and durable.

Layout under the store root (default ``<data dir>/sessions``, 0700):

- ``<id>.jsonl`` (0600): line 1 is a header ``{"k3chat": "session", ...}``; then one record
  per line (spec k3-chat.md 5.1 plus metadata), and ``{"k3chat": "rename", ...}`` lines, and
  ``{"k3chat": "settings", "settings": {...}}`` lines (the session's own settings, such as
  its thinking effort; later lines override earlier keys).
  The file is only ever appended to, one fsynced line at a time, so a crash can cost at most
  the line being written, and renames do not rewrite the file.
- ``sessions.json`` (0600): the index, a cache of what the JSONL files say. Written atomically.
  It records each file's size, so a stale entry (a crash between a record and the index update)
  is noticed and recomputed; a missing or corrupt index is rebuilt from the files.
- ``sessions.lock``: flock'ed around every index update. The index itself cannot carry the
  lock because each update replaces its inode.

Each session file is also flock'ed while it is appended to, so the "truncate back after a
failed write" rollback can never cut another writer's line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from k3chat import paths
from k3chat.display import for_terminal, json_safe

log = logging.getLogger(__name__)

INDEX_NAME = "sessions.json"
LOCK_NAME = "sessions.lock"
SUFFIX = ".jsonl"
FORMAT_VERSION = 1
META_KEY = "k3chat"  # lines carrying this key are store metadata, never conversation records

ROLES = ("system", "user", "assistant")
EFFORTS = ("low", "high", "max")
MAX_NAME_LEN = 200
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
# Names are shown on one line in the browser, in `sessions list` and in Markdown headings: no
# C0/C1 controls (ESC, the 8-bit CSI U+009B ...), DEL, bidi embeddings/overrides/isolates.
_NAME_BAD_RE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_LONE_SURROGATE_RE = re.compile(r"[\ud800-\udfff]")
_U64_MAX = 2**64 - 1

# Which role may follow which (spec 5.1): optional system first, then user/assistant
# alternating from user. A history ending in "user" is legal: the answer is generated later.
_NEXT_ROLES: dict[str | None, tuple[str, ...]] = {
    None: ("system", "user"),
    "system": ("user",),
    "user": ("assistant",),
    "assistant": ("user",),
}


class HistoryError(Exception):
    """A history operation failed; the message says what and whether anything was lost."""


class AmbiguousSession(HistoryError):
    """A session name that several sessions share: the caller must use an id."""


@dataclass(frozen=True)
class SessionInfo:
    id: str
    name: str
    created: float  # UNIX seconds
    updated: float
    n_messages: int
    model: str | None


@dataclass(frozen=True)
class LoadedSession:
    records: list[dict[str, Any]]
    problems: list[str]  # one line per damaged or suspicious line, with its line number
    info: SessionInfo
    settings: dict[str, Any] = field(default_factory=dict)  # from "settings" lines, merged in order


# --------------------------------------------------------------------------- validation


def _is_number(value: object) -> bool:
    # bool is an int subclass; True is never a valid temperature or timestamp.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: object, limit: int | None = None) -> bool:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return ok and (limit is None or value <= limit)  # type: ignore[operator]


def _string_problem(name: str, value: object) -> str | None:
    if not isinstance(value, str):
        return f"{name} must be a string, got {type(value).__name__}"
    # A lone surrogate cannot be written as UTF-8: refuse it here with a clear message.
    if _LONE_SURROGATE_RE.search(value):
        return f"{name} contains an unpaired surrogate"
    return None


def _sampler_problem(value: object) -> str | None:
    if not isinstance(value, dict):
        return "sampler must be an object"
    checks = {
        "greedy": lambda v: isinstance(v, bool),
        "temperature": _is_number,
        "top_p": _is_number,
        "top_k": _is_count,
        "seed": lambda v: _is_count(v, _U64_MAX),
    }
    for key, item in value.items():
        check = checks.get(key)
        if check is None:
            return f"sampler has unknown key {key!r}"
        if not check(item):
            return f"sampler.{key} has an invalid value {item!r}"
    return None


def _numbers_problem(name: str, value: object, *, integers: bool) -> str | None:
    if not isinstance(value, dict):
        return f"{name} must be an object"
    for key, item in value.items():
        ok = _is_count(item) if integers else (_is_number(item) and item >= 0)
        if not isinstance(key, str) or not ok:
            kind = "a non-negative integer" if integers else "a finite number >= 0"
            return f"{name}.{key} must be {kind}, got {item!r}"
    return None


def _metadata_problem(key: str, value: object) -> str | None:
    """Type rules for the metadata fields (design 3): time, model, effort, sampler, ..."""
    if key == "time":
        return None if _is_number(value) and value >= 0 else "time must be UNIX seconds"  # type: ignore[operator]
    if key == "seq":
        return None if _is_count(value) and value >= 1 else "seq must be an integer >= 1"  # type: ignore[operator]
    if key == "model":
        return _string_problem("model", value)
    if key == "thinking":
        return None if isinstance(value, bool) else "thinking must be true or false"
    if key == "effort":
        return None if value in EFFORTS else f"effort must be one of {', '.join(EFFORTS)}, got {value!r}"
    if key == "sampler":
        return _sampler_problem(value)
    if key == "tokens":
        return _numbers_problem("tokens", value, integers=True)
    if key == "speed":
        return _numbers_problem("speed", value, integers=False)
    return f"unknown field {key!r}"


def record_problem(record: object) -> str | None:
    """Why ``record`` is not a valid history record, or None if it is."""
    if not isinstance(record, Mapping):
        return "a record must be a JSON object"
    role = record.get("role")
    if role not in ROLES:
        return f"role must be one of {', '.join(ROLES)}, got {role!r}"
    if "content" not in record:
        return "content is missing"
    for key, value in record.items():
        if key == "role":
            continue
        if key in ("content", "reasoning_content"):
            problem = _string_problem(key, value)
        elif key == "interrupted":
            problem = None if isinstance(value, bool) else "interrupted must be true or false"
        else:
            problem = _metadata_problem(key, value)
        if problem is None and key in ("reasoning_content", "interrupted") and role != "assistant":
            problem = f"{key} is only allowed on assistant records, not {role!r}"
        if problem is not None:
            return problem
    return None


def _order_problem(previous: str | None, role: str) -> str | None:
    allowed = _NEXT_ROLES[previous]
    if role in allowed:
        return None
    after = f"after {previous!r}" if previous else "as the first record"
    return f"a {role!r} record cannot come {after} (expected {' or '.join(allowed)})"


def _name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not name.strip():
        return "a session name must be a non-empty string"
    if len(name) > MAX_NAME_LEN:
        return f"a session name is limited to {MAX_NAME_LEN} characters"
    if _NAME_BAD_RE.search(name) or _LONE_SURROGATE_RE.search(name):
        return "a session name cannot contain control characters (including C1 and bidi controls)"
    return None


def _check_name(name: object) -> str:
    problem = _name_problem(name)
    if problem is not None:
        raise HistoryError(problem)
    return name  # type: ignore[return-value]


def display_name(name: str) -> str:
    """A name read from a file that ``_check_name`` would refuse, made safe to show on one
    line: controls become visible escapes (display.for_terminal), newlines and tabs too."""
    return for_terminal(name).replace("\n", "\\n").replace("\t", "\\t")


def _check_id(session_id: object) -> str:
    # Ids become file names: this refuses "..", "/", hidden names and anything surprising.
    if not isinstance(session_id, str) or not _ID_RE.fullmatch(session_id):
        raise HistoryError(f"invalid session id {session_id!r}")
    return session_id


# --------------------------------------------------------------------------- encoding


def _encode_line(obj: Mapping[str, Any]) -> bytes:
    # json.dumps escapes every control character, so the line never contains a raw "\n";
    # allow_nan=False keeps the file standard JSON.
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8") + b"\n"


def _ordered(record: Mapping[str, Any]) -> dict[str, Any]:
    """The spec fields first, in the peer's order, so the file reads naturally."""
    first = ("role", "content", "reasoning_content", "interrupted")
    out = {key: record[key] for key in first if key in record}
    out.update((key, value) for key, value in record.items() if key not in out)
    return out


@dataclass
class _Parsed:
    """What a session file says, with every damaged line accounted for."""

    records: list[dict[str, Any]]
    problems: list[str]
    name: str | None
    created: float | None
    model: str | None
    last_role: str | None
    ends_with_newline: bool
    seqs: list[int] = field(default_factory=list)  # each kept record's sequence number
    last_seq: int = 0  # the highest sequence number any record line has had
    skipped: int = 0  # damaged lines so far (a count-based truncate after one is unreliable)
    settings: dict[str, Any] = field(default_factory=dict)


def _meta_name(obj: Mapping[str, Any], number: int, parsed: _Parsed, what: str) -> str | None:
    name = obj.get("name")
    if not isinstance(name, str):
        parsed.problems.append(f"line {number}: {what} has no valid name")
        return None
    problem = _name_problem(name)
    if problem is not None:
        shown = display_name(name) if name.strip() else None
        parsed.problems.append(f"line {number}: {what} name refused ({problem})"
                               + ("; it is shown with its controls escaped" if shown else ""))
        return shown
    return name


def _parse_truncate(obj: Mapping[str, Any], number: int, parsed: _Parsed) -> None:
    """Regenerate / edit-last: later records are superseded. They stay in the file (it is only
    ever appended to) but are no longer part of the conversation.

    A truncate line names the sequence number of the last record it keeps (``seq``), so a
    damaged or missing line before it cannot shift what it cuts; ``records`` (the count kept)
    is checked against the result. Files written before sequence numbers have ``records`` only.
    """
    seq, count = obj.get("seq"), obj.get("records")
    if _is_count(seq):
        # Sequence numbers only grow along the file, so the kept records are a prefix.
        keep = next((i for i, s in enumerate(parsed.seqs) if s > seq), len(parsed.seqs))
        missing = seq > 0 and (keep == 0 or parsed.seqs[keep - 1] != seq)
        del parsed.records[keep:], parsed.seqs[keep:]
        if missing:
            parsed.problems.append(
                f"line {number}: truncate could not be applied exactly: the last record it keeps "
                f"(number {seq}) is missing, so a line before it was damaged or lost; {keep} record(s) "
                "numbered up to it are kept; check the conversation")
        elif _is_count(count) and count != keep:
            parsed.problems.append(
                f"line {number}: truncate could not be applied exactly: it kept {count} record(s) when "
                f"it was written, {keep} now, so a line before it was damaged or lost; check the "
                "conversation")
    elif _is_count(count):
        if parsed.skipped:
            parsed.problems.append(
                f"line {number}: truncate (old format, a record count) after {parsed.skipped} damaged "
                "line(s): it may keep a superseded answer or drop a kept one; check the conversation")
        elif count > len(parsed.records):
            parsed.problems.append(f"line {number}: truncate keeps {count} records but only "
                                   f"{len(parsed.records)} exist; check the conversation")
        del parsed.records[count:], parsed.seqs[count:]
    else:
        parsed.skipped += 1
        parsed.problems.append(f"line {number}: truncate line without a valid seq or record count, skipped; "
                               "superseded answers may be shown")
        return
    parsed.last_role = parsed.records[-1]["role"] if parsed.records else None


def _parse_meta(obj: dict[str, Any], number: int, parsed: _Parsed) -> None:
    kind = obj.get(META_KEY)
    if kind == "session" and number == 1:
        created, model = obj.get("created"), obj.get("model")
        parsed.name = _meta_name(obj, number, parsed, "the session header")
        parsed.created = float(created) if _is_number(created) else None
        parsed.model = model if isinstance(model, str) else None
    elif kind == "rename" and isinstance(obj.get("name"), str):
        parsed.name = _meta_name(obj, number, parsed, "a rename") or parsed.name
    elif kind == "truncate":
        _parse_truncate(obj, number, parsed)
    elif kind == "settings" and isinstance(obj.get("settings"), dict):
        parsed.settings.update(obj["settings"])  # the reader checks each value it uses
    else:
        parsed.skipped += 1
        parsed.problems.append(f"line {number}: unexpected store line {for_terminal(repr(kind))}, skipped")


def _parse_line(raw: bytes, number: int, parsed: _Parsed) -> None:
    if not raw.strip():
        parsed.skipped += 1
        parsed.problems.append(f"line {number}: blank line, skipped")
        return
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        parsed.skipped += 1
        parsed.problems.append(f"line {number}: not valid UTF-8, skipped")
        return
    except json.JSONDecodeError as exc:
        parsed.skipped += 1
        parsed.problems.append(f"line {number}: not valid JSON ({exc.msg} at column {exc.colno}), skipped")
        return
    if isinstance(obj, dict) and META_KEY in obj:
        _parse_meta(obj, number, parsed)
        return
    problem = record_problem(obj)
    if problem is not None:
        parsed.skipped += 1
        parsed.problems.append(f"line {number}: invalid record ({for_terminal(problem)}), skipped")
        return
    # Records written since sequence numbers carry their own; older ones are numbered by
    # their place among the record lines, as the writer of an old truncate line counted them.
    seq = obj.get("seq", parsed.last_seq + 1)
    if seq <= parsed.last_seq:
        parsed.problems.append(f"line {number}: sequence number {seq} does not follow {parsed.last_seq}; "
                               "the file was edited or a line repeated")
    order = _order_problem(parsed.last_role, obj["role"])
    if order is not None:
        # Kept: a lost line in between is the usual cause, and dropping this one would lose more.
        parsed.problems.append(f"line {number}: {order}; a record before it may have been lost")
    parsed.records.append(obj)
    parsed.seqs.append(seq)
    parsed.last_seq = max(parsed.last_seq, seq)
    parsed.last_role = obj["role"]
    if isinstance(obj.get("model"), str):
        parsed.model = obj["model"]


def _parse_file(data: bytes) -> _Parsed:
    parsed = _Parsed([], [], None, None, None, None, ends_with_newline=data.endswith(b"\n") or not data)
    lines = data.split(b"\n")
    incomplete = lines.pop()  # b"" when the file ends with a newline
    for number, raw in enumerate(lines, start=1):
        _parse_line(raw, number, parsed)
    if incomplete:
        parsed.problems.append(
            f"line {len(lines) + 1}: incomplete last line ({len(incomplete)} bytes, "
            "a write was cut short), skipped"
        )
    return parsed


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# --------------------------------------------------------------------------- the store


@dataclass
class _Tail:
    """Cached end-of-file facts, valid while the file keeps this inode and size."""

    key: tuple[int, int]  # (st_ino, st_size)
    last_role: str | None
    ends_with_newline: bool
    last_seq: int  # the highest record sequence number in the file


class HistoryStore:
    """Sessions on disk. Safe for several processes; not for several threads on one instance."""

    def __init__(self, root: Path | None = None) -> None:
        if root is None:
            paths.ensure_private_dir(paths.data_dir())
            root = paths.data_dir() / "sessions"
        self.root = paths.ensure_private_dir(Path(root))
        self._tails: dict[str, _Tail] = {}
        # Temp files of writers that died mid-write hold conversation text: remove them.
        paths.sweep_temps(self.root)

    # ---- public API

    def create(self, name: str, *, model: str | None = None) -> SessionInfo:
        _check_name(name)
        if model is not None and _string_problem("model", model):
            raise HistoryError("model must be a string")
        now = time.time()
        with self._index_lock():
            entries = self._current_index()
            session_id = self._new_id(now)
            header: dict[str, Any] = {META_KEY: "session", "version": FORMAT_VERSION, "id": session_id,
                                      "name": name, "created": now, "model": model}
            line = _encode_line(header)
            try:
                # Atomic, so a session file never exists without its complete header.
                paths.atomic_write(self._path(session_id), line)
            except OSError as exc:
                raise HistoryError(f"could not create session {name!r}: {_reason(exc)}") from exc
            info = SessionInfo(session_id, name, now, now, 0, model)
            entries[session_id] = _entry(info, len(line))
            self._save_index_quietly(entries)
        return info

    def list(self) -> list[SessionInfo]:
        """All sessions, most recently updated first (stale index entries are refreshed)."""
        with self._index_lock():
            entries = self._current_index()
        infos = [_info(session_id, entry) for session_id, entry in entries.items()]
        return sorted(infos, key=lambda info: (info.updated, info.id), reverse=True)

    def find(self, ref: str) -> SessionInfo | None:
        """A session by id, else by exact name; AmbiguousSession when several share it."""
        infos = self.list()
        for info in infos:
            if info.id == ref:
                return info
        named = [info for info in infos if info.name == ref]
        if len(named) > 1:
            ids = ", ".join(info.id for info in named)
            raise AmbiguousSession(f"several sessions are named {ref!r} ({ids}); use an id")
        return named[0] if named else None

    def info(self, session_id: str) -> SessionInfo:
        _check_id(session_id)
        for info in self.list():
            if info.id == session_id:
                return info
        raise HistoryError(f"no session {session_id!r}")

    def append(self, session_id: str, record: Mapping[str, Any]) -> dict[str, Any]:
        """Validate, append as one line and fsync; return the record as stored.

        ``time`` is added if absent. On failure (disk full, I/O error) the file is cut back to
        its previous size and HistoryError says the record was not saved.
        """
        _check_id(session_id)
        problem = record_problem(record)
        if problem is not None:
            raise HistoryError(f"refusing to save an invalid record: {problem}")
        stored = _ordered(record)
        stored.setdefault("time", time.time())
        stored.pop("seq", None)  # the store numbers records itself, under the file lock
        return self._append_line(session_id, stored)

    def load(self, session_id: str) -> LoadedSession:
        _check_id(session_id)
        data, st = self._read(session_id)
        parsed = _parse_file(data)
        created = parsed.created if parsed.created is not None else st.st_mtime
        info = SessionInfo(session_id, parsed.name or session_id, created, st.st_mtime,
                           len(parsed.records), parsed.model)
        if parsed.created is None and not any(p.startswith("line 1:") for p in parsed.problems):
            parsed.problems.append("line 1: session header missing; name and creation time guessed")
        return LoadedSession(parsed.records, parsed.problems, info, parsed.settings)

    def rename(self, session_id: str, name: str) -> SessionInfo:
        _check_id(session_id)
        _check_name(name)
        # Appended, not rewritten: the record lines are never touched after they are written.
        meta = {META_KEY: "rename", "name": name, "time": time.time()}
        self._append_line(session_id, meta)
        return self.info(session_id)

    def set_settings(self, session_id: str, settings: Mapping[str, Any]) -> None:
        """Store settings of the session (appended; load() merges them in order)."""
        _check_id(session_id)
        self._append_line(session_id, {META_KEY: "settings", "settings": dict(settings), "time": time.time()})

    def truncate(self, session_id: str, n_records: int) -> LoadedSession:
        """Keep only the first ``n_records`` records (regenerate, edit the last message).

        Appended as a store line like a rename: the superseded records stay in the file,
        so nothing is lost, but load() no longer returns them. Returns the session as loaded
        afterwards.
        """
        _check_id(session_id)
        if not _is_count(n_records):
            raise HistoryError(f"truncate needs a record count >= 0, got {n_records!r}")
        data, _ = self._read(session_id)
        parsed = _parse_file(data)
        current = len(parsed.records)
        if n_records > current:
            raise HistoryError(f"session {session_id!r} has {current} records, cannot keep {n_records}")
        if n_records < current:
            # Anchored to the last kept record's sequence number, not to a count a damaged
            # line could shift; the count is kept as a check (and for the index).
            last_seq = parsed.seqs[n_records - 1] if n_records else 0
            meta = {META_KEY: "truncate", "seq": last_seq, "records": n_records, "time": time.time()}
            self._append_line(session_id, meta)
        return self.load(session_id)

    def delete(self, session_id: str) -> None:
        """Remove the session file and its index entry.

        This is an unlink: on SSDs and journaling file systems overwriting in place does not
        reliably erase data, so we do not pretend to; full-disk encryption is the real answer.
        """
        _check_id(session_id)
        with self._index_lock():
            try:
                os.unlink(self._path(session_id))
            except FileNotFoundError:
                raise HistoryError(f"no session {session_id!r}") from None
            except OSError as exc:
                raise HistoryError(f"could not delete session {session_id!r}: {_reason(exc)}") from exc
            # A temp copy left by a crashed write of this session goes with it, whoever made it.
            paths.sweep_temps(self.root, target=f"{session_id}{SUFFIX}", any_pid=True)
            paths.fsync_dir(self.root)
            self._tails.pop(session_id, None)
            self._current_index()  # drops the entry of the file that is gone

    def export_markdown(self, session_id: str) -> str:
        """The conversation for reading. Inert by construction: every message and every
        reasoning block is in a fenced code block whose fence is longer than any backtick run
        inside it, and names are backslash-escaped, so no viewer renders model text as links,
        images or HTML (an export never fetches anything); control characters are shown as
        visible escapes (display.for_terminal), so printing it cannot drive a terminal. For a
        faithful copy of the text use the JSON export."""
        loaded = self.load(session_id)
        info = loaded.info
        out = [f"# {_md_inline(info.name)}", "", f"Session `{info.id}`, created {_iso(info.created)}"
               + (f", model {_md_inline(info.model)}" if info.model else "") + "."]
        if loaded.problems:
            out += ["", f"> {len(loaded.problems)} damaged line(s) were skipped in this export."]
        for record in loaded.records:
            out += ["", *_markdown_record(record)]
        return "\n".join(out) + "\n"

    def export_json(self, session_id: str) -> str:
        """Everything we know, metadata included; ``json.loads`` gives back the records.
        Control characters JSON leaves raw (DEL, C1, bidi) are written as \\u escapes."""
        loaded = self.load(session_id)
        info = loaded.info
        doc = {
            "format": "k3chat-session",
            "version": FORMAT_VERSION,
            "session": {"id": info.id, "name": info.name, "created": info.created,
                        "updated": info.updated, "model": info.model},
            "records": loaded.records,
            "problems": loaded.problems,
        }
        return json_safe(json.dumps(doc, ensure_ascii=False, indent=2)) + "\n"

    def export_peer_jsonl(self, session_id: str) -> str:
        """JSONL for kimi-k3-in-c's strict ``--history`` reader (see export_peer_jsonl_checked)."""
        return self.export_peer_jsonl_checked(session_id)[0]

    def export_peer_jsonl_checked(self, session_id: str) -> tuple[str, list[str]]:
        """(JSONL for kimi-k3-in-c's strict ``--history`` reader, warnings).

        Only role, content and reasoning_content, in that order (spec 5.1: "an export for the
        peer drops it"). Records k3chat does not render (an interrupted answer with nothing in
        it, spec 5.4) are left out, so the peer is given the conversation our model saw. The
        warnings name every damaged line the export could not include, every record left out,
        and a left-out record that leaves two user messages in a row (the peer refuses those).
        """
        from k3chat.template import _skipped

        loaded = self.load(session_id)
        warnings = [f"damaged line not exported: {p}" for p in loaded.problems]
        lines = []
        previous: str | None = None
        dropped_at: int | None = None
        for number, record in enumerate(loaded.records, start=1):
            if _skipped(record):
                warnings.append(f"record {number}: an empty interrupted answer, left out (k3chat does not "
                                "render it either)")
                dropped_at = number
                continue
            if previous == record["role"] == "user" and dropped_at is not None:
                warnings.append(f"record {number}: follows another user message once record {dropped_at} is "
                                "left out; the peer's reader refuses two user messages in a row")
            out = {"role": record["role"], "content": record["content"]}
            if record["role"] == "assistant" and "reasoning_content" in record:
                out["reasoning_content"] = record["reasoning_content"]
            lines.append(json_safe(json.dumps(out, ensure_ascii=False)))
            previous = record["role"]
        return "".join(line + "\n" for line in lines), warnings

    # ---- appending

    def _append_line(self, session_id: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Append one line: a record (numbered here, with the next sequence number) or a store
        line (``obj`` has META_KEY). Returns what load() will read back for it."""
        role = None if META_KEY in obj else obj["role"]
        path = self._path(session_id)
        try:
            fd = paths.private_open(path, os.O_WRONLY | os.O_APPEND)  # no O_CREAT: never resurrect
        except FileNotFoundError:
            raise HistoryError(f"no session {session_id!r}") from None
        except OSError as exc:
            raise HistoryError(f"could not open session {session_id!r}: {_reason(exc)}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            st = os.fstat(fd)
            tail = self._tail(session_id, st)
            seq = tail.last_seq
            if role is not None:
                problem = _order_problem(tail.last_role, role)
                if problem is not None:
                    raise HistoryError(f"refusing to save: {problem}")
                seq += 1
                obj = _ordered({**obj, "seq": seq})
            line = _encode_line(obj)
            written = json.loads(line)  # exactly what load() will return for this line
            if not tail.ends_with_newline:
                # A crash left a partial line: end it so it stays one reported, skipped line
                # instead of swallowing this record too.
                line = b"\n" + line
            self._write_durably(fd, path, line, st.st_size)
            size = st.st_size + len(line)
            if obj.get(META_KEY) == "truncate":
                self._tails.pop(session_id, None)  # the last role changed: re-read when needed
            else:
                self._tails[session_id] = _Tail((st.st_ino, size), role or tail.last_role, True, seq)
            try:
                self._update_index_after_append(session_id, st, size, obj)
            except OSError as exc:
                # The line is durable; only the index (a cache, repaired by size) is stale.
                log.warning("history index not updated (%s); it will be rebuilt", _reason(exc))
        finally:
            os.close(fd)  # also releases the flock
        return written

    def _write_durably(self, fd: int, path: Path, line: bytes, old_size: int) -> None:
        try:
            paths.write_all(fd, line)
            os.fsync(fd)
        except BaseException as exc:
            # Cut back whatever part of the line reached the file (disk full, I/O error, or
            # an interrupt mid-write), so no half record remains.
            try:
                os.ftruncate(fd, old_size)
                os.fsync(fd)
                state = "the history is unchanged"
            except OSError:
                state = "a partial line may remain; it will be reported and skipped on load"
            if not isinstance(exc, OSError):
                raise
            raise HistoryError(f"could not save to {path.name}: {_reason(exc)}; "
                               f"the record was not saved and {state}") from exc

    def _tail(self, session_id: str, st: os.stat_result) -> _Tail:
        cached = self._tails.get(session_id)
        if cached is not None and cached.key == (st.st_ino, st.st_size):
            return cached
        data, _ = self._read(session_id)
        parsed = _parse_file(data[: st.st_size])
        tail = _Tail((st.st_ino, st.st_size), parsed.last_role, parsed.ends_with_newline, parsed.last_seq)
        self._tails[session_id] = tail
        return tail

    def _update_index_after_append(self, session_id: str, st: os.stat_result, size: int,
                                   obj: Mapping[str, Any]) -> None:
        with self._index_lock():
            try:
                current = os.stat(self._path(session_id)).st_ino
            except FileNotFoundError:
                current = None
            if current != st.st_ino:
                raise HistoryError(f"session {session_id!r} was deleted while saving; the record is lost")
            entries = self._read_index()
            if entries is None:
                self._current_index()  # rebuilt from the files, this line included
                return
            entry = entries.get(session_id)
            if entry is not None and entry["bytes"] == st.st_size:
                _advance_entry(entry, size, obj)  # index was in step: no need to re-read the file
            else:
                self._refresh_entry(entries, session_id)
            self._save_index_quietly(entries)

    def _save_index_quietly(self, entries: dict[str, dict[str, Any]]) -> None:
        # Callers have already made their change durable in the session file; the index is
        # a cache whose staleness _current_index detects by file size. So a failure to write
        # it (disk full) is logged rather than reported as a failed save.
        try:
            self._store_index(entries)
        except OSError as exc:
            log.warning("history index not saved (%s); it will be rebuilt", _reason(exc))

    # ---- the index

    @contextmanager
    def _index_lock(self) -> Iterator[None]:
        fd = paths.private_open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _current_index(self) -> dict[str, dict[str, Any]]:
        """The index, reconciled with the files on disk and saved if that changed it.

        Call with the index lock held.
        """
        entries = self._read_index()
        changed = entries is None
        entries = entries or {}
        on_disk = self._session_files()
        for session_id in list(entries):
            if session_id not in on_disk:
                del entries[session_id]
                changed = True
        for session_id, size in on_disk.items():
            entry = entries.get(session_id)
            if entry is None or entry["bytes"] != size:
                changed |= self._refresh_entry(entries, session_id)
        if changed:
            self._save_index_quietly(entries)
        return entries

    def _refresh_entry(self, entries: dict[str, dict[str, Any]], session_id: str) -> bool:
        try:
            loaded = self.load(session_id)
            size = os.stat(self._path(session_id)).st_size
        except (OSError, HistoryError):
            return False  # deleted meanwhile, or unreadable: leave it to the next listing
        entries[session_id] = _entry(loaded.info, size)
        return True

    def _read_index(self) -> dict[str, dict[str, Any]] | None:
        try:
            fd = os.open(self.root / INDEX_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        try:
            doc = json.loads(data)
            entries = doc["sessions"]
            if doc.get("version") != FORMAT_VERSION or not isinstance(entries, dict):
                raise ValueError("unknown index layout")
            for session_id, entry in entries.items():
                _check_id(session_id)
                _info(session_id, entry)  # raises on any missing or mistyped field
        except (ValueError, KeyError, TypeError, HistoryError) as exc:
            log.warning("history index %s is damaged (%s); rebuilding it from the sessions",
                        self.root / INDEX_NAME, exc)
            return None
        return entries

    def _store_index(self, entries: dict[str, dict[str, Any]]) -> None:
        doc = {"version": FORMAT_VERSION, "sessions": entries}
        paths.atomic_write(self.root / INDEX_NAME, json.dumps(doc, ensure_ascii=False, indent=1).encode())

    def _session_files(self) -> dict[str, int]:
        """Session id -> file size, for every well-named session file."""
        found = {}
        for entry in os.scandir(self.root):
            session_id = entry.name[: -len(SUFFIX)]
            if entry.name.endswith(SUFFIX) and _ID_RE.fullmatch(session_id) and entry.is_file(follow_symlinks=False):
                found[session_id] = entry.stat(follow_symlinks=False).st_size
        return found

    # ---- files

    def _path(self, session_id: str) -> Path:
        return self.root / f"{session_id}{SUFFIX}"

    def _read(self, session_id: str) -> tuple[bytes, os.stat_result]:
        try:
            fd = os.open(self._path(session_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise HistoryError(f"no session {session_id!r}") from None
        except OSError as exc:
            raise HistoryError(f"could not read session {session_id!r}: {_reason(exc)}") from exc
        with os.fdopen(fd, "rb") as f:
            return f.read(), os.fstat(f.fileno())

    def _new_id(self, now: float) -> str:
        # Sortable by creation and unguessable enough to never collide between processes.
        stamp = datetime.fromtimestamp(now, tz=timezone.utc).strftime("%Y%m%d-%H%M%S")
        while True:
            session_id = f"{stamp}-{secrets.token_hex(4)}"
            if not self._path(session_id).exists():
                return session_id


def _entry(info: SessionInfo, size: int) -> dict[str, Any]:
    return {"name": info.name, "created": info.created, "updated": info.updated,
            "n_messages": info.n_messages, "model": info.model, "bytes": size}


def _advance_entry(entry: dict[str, Any], size: int, obj: Mapping[str, Any]) -> None:
    entry["bytes"] = size
    entry["updated"] = time.time()
    if obj.get(META_KEY) == "rename":
        entry["name"] = obj["name"]
        return
    if obj.get(META_KEY) == "truncate":
        entry["n_messages"] = min(entry["n_messages"], obj["records"])
        return
    if obj.get(META_KEY) == "settings":
        return
    entry["n_messages"] += 1
    if isinstance(obj.get("model"), str):
        entry["model"] = obj["model"]


def _info(session_id: str, entry: Mapping[str, Any]) -> SessionInfo:
    name, model = entry["name"], entry["model"]
    created, updated = entry["created"], entry["updated"]
    n_messages, size = entry["n_messages"], entry["bytes"]
    if not (isinstance(name, str) and (model is None or isinstance(model, str))
            and _is_number(created) and _is_number(updated)
            and _is_count(n_messages) and _is_count(size)):
        raise TypeError(f"index entry for {session_id} has mistyped fields")
    return SessionInfo(session_id, name, float(created), float(updated), n_messages, model)


_MD_PUNCTUATION = re.compile(r"([!-/:-@\[-`{-~])")
_BACKTICKS = re.compile(r"`+")


def _md_inline(text: str) -> str:
    """One line of Markdown text that renders as itself: every ASCII punctuation character
    backslash-escaped (no links, images, HTML, emphasis or headings can start), controls
    shown as escapes."""
    return _MD_PUNCTUATION.sub(r"\\\1", display_name(text))


def _fenced(text: str) -> list[str]:
    """``text`` as a fenced code block that nothing inside can close: the fence is longer
    than the longest run of backticks in it (CommonMark closes a fence only with at least as
    many). Controls are shown as visible escapes."""
    text = for_terminal(text)
    longest = max((len(run) for run in _BACKTICKS.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + "text", *text.split("\n"), fence]


def _markdown_record(record: Mapping[str, Any]) -> list[str]:
    heading = f"## {record['role'].capitalize()}"
    if _is_number(record.get("time")):
        heading += f" ({_iso(record['time'])})"
    if record.get("interrupted"):
        heading += " [interrupted]"
    out = [heading, ""]
    reasoning = record.get("reasoning_content")
    if reasoning:
        out += ["Reasoning:", "", *_fenced(reasoning), "", "Answer:", ""]
    out += _fenced(record["content"])
    return out


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "the disk is full"
    return exc.strerror or str(exc)
