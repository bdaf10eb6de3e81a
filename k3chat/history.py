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
  is noticed and recomputed; a missing or corrupt index is rebuilt from the files. Names are
  checked against the files before a name lookup is answered (``find``).
- ``sessions.lock``: flock'ed around every index update. The index itself cannot carry the
  lock because each update replaces its inode. A read-only store (``read_only=True``: list,
  show, export) takes it shared when it can open it read-only, else reads without it, and
  never writes anything.
- ``<id>.answering`` (0600): flock'ed by the k3chat that is answering the session (from its
  user record to its answer) and holding that process's pid, so a second one is told who is
  answering instead of appending in between.

Each session file is also flock'ed while it is appended to, so the "truncate back after a
failed write" rollback can never cut another writer's line.

Encryption at rest (opt-in, see k3chat/vault.py): a store opened with a vault (``open_store``
does when ``vault.json`` sits beside the root) writes every line of a session file, header
included, and the index as sealed JSON lines; the layout above is unchanged and only the byte
I/O functions know. A line that fails its tag is reported and skipped like any damaged line.
A store never mixes modes: an encrypted session read without the key, or a plaintext one read
with it (a conversion that did not finish), is refused with what to run.
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
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from k3chat import paths
from k3chat.attachments import Attachment, attachments_problem, model_message
from k3chat.display import for_terminal, json_safe
from k3chat.safe_markdown import answer_markdown
from k3chat.vault import (KIND_INDEX, KIND_SESSION, STATE_DECRYPTING, STATE_ON, SealError, Vault, has_sealed_line,
                          key_file_beside, unlock_if_enabled)

log = logging.getLogger(__name__)

INDEX_NAME = "sessions.json"
LOCK_NAME = "sessions.lock"
SUFFIX = ".jsonl"
ANSWERING_SUFFIX = ".answering"
FORMAT_VERSION = 1
META_KEY = "k3chat"  # lines carrying this key are store metadata, never conversation records

ROLES = ("system", "user", "assistant")
EFFORTS = ("low", "high", "max")
STOPS = ("end", "limit", "cancelled", "malformed", "error")  # why an answer ended (conversation.STOPS)
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


class _SealedWithoutKey(HistoryError):
    """An encrypted file met by a store without the key."""


class SessionExists(HistoryError):
    """``create(..., unique_name=True)`` found the name taken (``info`` is that session)."""

    def __init__(self, info: SessionInfo) -> None:
        self.info = info
        super().__init__(f"a session named {info.name!r} already exists ({info.id}); nothing was created")


class NameTaken(HistoryError):
    """A rename to a name another session has: refused, so a name always resolves."""

    def __init__(self, name: str, info: SessionInfo) -> None:
        self.info = info
        super().__init__(f"another session is already named {name!r} ({info.id}); nothing was renamed: choose "
                         "another name (names must be unique so that --session NAME finds one session)")


class SessionBusy(HistoryError):
    """Another k3chat process is answering this session right now."""

    def __init__(self, session: str, pid: int | None) -> None:
        self.session = session
        self.pid = pid
        who = f"another k3chat (pid {pid})" if pid else "another k3chat"
        super().__init__(f"session {session} is being answered by {who}; nothing was changed here: "
                         "wait for it to finish (or stop it), then run again")


class IndexUnreadable(HistoryError):
    """The index file exists but cannot be read as a file; the message names it and the fix."""


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
    skipped: list[str] = field(default_factory=list)  # the problems that cost a line (in problems too)
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
    if key == "remote":  # the server that answered (k3chat.remote), never a key
        return _string_problem("remote", value)
    if key == "thinking":
        return None if isinstance(value, bool) else "thinking must be true or false"
    if key == "effort":
        return None if value in EFFORTS else f"effort must be one of {', '.join(EFFORTS)}, got {value!r}"
    if key == "sampler":
        return _sampler_problem(value)
    if key == "stop":
        return None if value in STOPS else f"stop must be one of {', '.join(STOPS)}, got {value!r}"
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
        elif key == "attachments":
            problem = attachments_problem(value)
            if problem is None and role != "user":
                problem = f"attachments are only allowed on user records, not {role!r}"
        else:
            problem = _metadata_problem(key, value)
        if problem is None and key in ("reasoning_content", "interrupted", "stop") and role != "assistant":
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
    skipped_problems: list[str] = field(default_factory=list)  # the problems that cost a line


def _skip(parsed: _Parsed, problem: str) -> None:
    """A line (or part of one) that is not read: counted and reported as skipped, apart from
    the warnings about records that are kept."""
    parsed.skipped += 1
    parsed.skipped_problems.append(problem)
    parsed.problems.append(problem)


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
        _skip(parsed, f"line {number}: truncate line without a valid seq or record count, skipped; "
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
        _skip(parsed, f"line {number}: unexpected store line {for_terminal(repr(kind))}, skipped")


# Where one of our lines begins. The encoder escapes every quote inside a string, so this can
# only match at the start of a line, or where a lost line break glued a line onto another.
_LINE_START_RE = re.compile(rb'\{"(?:role|k3chat)":')


def _decode(raw: bytes) -> tuple[Any, str | None]:
    """(the JSON value of ``raw``, None), or (None, why it is not JSON)."""
    try:
        return json.loads(raw.decode("utf-8")), None
    except UnicodeDecodeError:
        return None, "not valid UTF-8"
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at column {exc.colno})"


def _glued_lines(raw: bytes) -> tuple[list[dict[str, Any]], int]:
    """(the objects in a line that does not decode as a whole, the bytes they take): each
    piece starting where one of our lines starts that decodes on its own, in order."""
    bounds = sorted({0, *(m.start() for m in _LINE_START_RE.finditer(raw))})
    found: list[dict[str, Any]] = []
    used = 0
    for piece in (raw[a:b] for a, b in zip(bounds, bounds[1:] + [len(raw)])):
        obj, why = _decode(piece)
        if why is None and isinstance(obj, dict):
            found.append(obj)
            used += len(piece)
    return found, used


def _parse_damaged(raw: bytes, number: int, parsed: _Parsed, why: str) -> None:
    """Skip a line that does not decode, but keep the records a lost line break glued into
    it (the answer after a damaged user line, say): only the damaged bytes are lost."""
    glued, used = _glued_lines(raw)
    if not glued:
        _skip(parsed, f"line {number}: {why}, skipped")
        return
    lost = len(raw) - used
    if lost:
        _skip(parsed, f"line {number}: {why}: {lost} damaged bytes skipped; the {len(glued)} whole line(s) "
                      "after them (a line break was lost) are read")
    else:
        parsed.problems.append(f"line {number}: {len(glued)} lines without the line break between them; "
                               "all are read")
    for obj in glued:
        _parse_object(obj, number, parsed)


def _parse_line(raw: bytes, number: int, parsed: _Parsed) -> None:
    if not raw.strip():
        _skip(parsed, f"line {number}: blank line, skipped")
        return
    obj, why = _decode(raw)
    if why is not None:
        _parse_damaged(raw, number, parsed, why)
        return
    _parse_object(obj, number, parsed)


def _parse_object(obj: Any, number: int, parsed: _Parsed) -> None:
    if isinstance(obj, dict) and META_KEY in obj:
        _parse_meta(obj, number, parsed)
        return
    problem = record_problem(obj)
    if problem is not None:
        _skip(parsed, f"line {number}: invalid record ({for_terminal(problem)}), skipped")
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
        parsed.problems.append(f"line {number}: {order}; a record before it may have been lost (this one is kept)")
    parsed.records.append(obj)
    parsed.seqs.append(seq)
    parsed.last_seq = max(parsed.last_seq, seq)
    parsed.last_role = obj["role"]
    if isinstance(obj.get("model"), str):
        parsed.model = obj["model"]


def _parse_file(data: bytes, unseal: Callable[[bytes], bytes] | None = None) -> _Parsed:
    """``unseal`` opens each line of an encrypted file (SealError: reported and skipped)."""
    parsed = _Parsed([], [], None, None, None, None, ends_with_newline=data.endswith(b"\n") or not data)
    lines = data.split(b"\n")
    incomplete = lines.pop()  # b"" when the file ends with a newline
    for number, raw in enumerate(lines, start=1):
        if unseal is not None:
            try:
                raw = unseal(raw)
            except SealError as exc:
                parsed.skipped += 1
                parsed.problems.append(f"line {number}: {exc}, skipped")
                continue
        _parse_line(raw, number, parsed)
    if incomplete:
        _skip(parsed, f"line {len(lines) + 1}: incomplete last line ({len(incomplete)} bytes, "
                      "a write was cut short), skipped")
    return parsed


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# --------------------------------------------------------------------------- the store


def _existing_private_dir(path: Path) -> Path:
    """For a read-only store: ``path`` checked, never created or chmodded (0500 is as private
    as 0700). One that is not ours, not a directory, or open to others goes through
    ensure_private_dir, which refuses it or tightens it with its own message."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path  # nothing stored yet: an empty history
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return paths.ensure_private_dir(path)
    return path


@dataclass
class _Tail:
    """Cached end-of-file facts, valid while the file keeps this inode and size."""

    key: tuple[int, int]  # (st_ino, st_size)
    last_role: str | None
    ends_with_newline: bool
    last_seq: int  # the highest record sequence number in the file


class HistoryStore:
    """Sessions on disk. Safe for several processes; not for several threads on one instance.

    ``read_only=True`` (list, show, export) creates, locks for writing and repairs nothing,
    so a read-only home (chmod -w, a read-only mount or backup) can still be read.
    """

    def __init__(self, root: Path | None = None, *, vault: Vault | None = None, read_only: bool = False) -> None:
        self.read_only = read_only
        private_dir = _existing_private_dir if read_only else paths.ensure_private_dir
        if root is None:
            private_dir(paths.data_dir())
            root = paths.data_dir() / "sessions"
        if vault is None and key_file_beside(Path(root)).exists():
            # Never write plaintext into an encrypted history (open_store unlocks it).
            raise HistoryError(f"the history in {root} is encrypted: open it with its passphrase "
                               "(history.open_store)")
        self.vault = vault
        self.root = private_dir(Path(root))
        self._tails: dict[str, _Tail] = {}
        # Temp files of writers that died mid-write hold conversation text: remove them
        # (best effort: on a read-only home they stay).
        paths.sweep_temps(self.root)

    # ---- public API

    def create(self, name: str, *, model: str | None = None, unique_name: bool = False,
               numbered: bool = False) -> SessionInfo:
        """A new empty session. With ``unique_name``, SessionExists if a session of that name
        exists (as its file says): checked under the index lock, so of several processes
        creating the same new name at once exactly one succeeds. With ``numbered`` (names
        made from the first message), a taken name gets the first free " (2)", " (3)" ..."""
        _check_name(name)
        if model is not None and _string_problem("model", model):
            raise HistoryError("model must be a string")
        now = time.time()
        with self._index_lock():
            entries = self._current_index()
            taken = self._named_in(entries, name) if unique_name else []
            if taken:
                raise SessionExists(taken[0])
            if numbered:
                name = self._free_name(entries, name)
            session_id = self._new_id(now)
            header: dict[str, Any] = {META_KEY: "session", "version": FORMAT_VERSION, "id": session_id,
                                      "name": name, "created": now, "model": model}
            line = self._sealed(session_id, _encode_line(header))
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
        with self._reading():
            entries = self._current_index()
        infos = [_info(session_id, entry) for session_id, entry in entries.items()]
        return sorted(infos, key=lambda info: (info.updated, info.id), reverse=True)

    def find(self, ref: str) -> SessionInfo | None:
        """A session by id, else by exact name; AmbiguousSession when several share it.

        A name is answered by the session files, not by the index alone (a cache that may be
        stale or edited): see _named_in.
        """
        with self._reading():
            entries = self._current_index()
            if ref in entries:
                return _info(ref, entries[ref])
            named = self._named_in(entries, ref)
        named.sort(key=lambda info: (info.updated, info.id), reverse=True)
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
        parsed = _parse_file(data, self._unsealer(session_id))
        created = parsed.created if parsed.created is not None else st.st_mtime
        info = SessionInfo(session_id, parsed.name or session_id, created, st.st_mtime,
                           len(parsed.records), parsed.model)
        if parsed.created is None and not any(p.startswith("line 1:") for p in parsed.problems):
            parsed.problems.append("line 1: session header missing; name and creation time guessed")
        return LoadedSession(parsed.records, parsed.problems, info, parsed.skipped_problems, parsed.settings)

    def rename(self, session_id: str, name: str) -> SessionInfo:
        """NameTaken if another session has ``name`` (as its file says). Checked under the
        index lock, then appended: two processes renaming two sessions to one new name in the
        same instant could both pass, which ``find`` then reports as ambiguous."""
        _check_id(session_id)
        _check_name(name)
        with self._index_lock():
            entries = self._current_index()
            others = [info for info in self._named_in(entries, name) if info.id != session_id]
        if others:
            raise NameTaken(name, others[0])
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
        parsed = _parse_file(data, self._unsealer(session_id))
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
        ``wipe`` overwrites first, and says what that cannot promise.
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
            self._remove_answering_lock(session_id)
            paths.fsync_dir(self.root)
            self._tails.pop(session_id, None)
            self._current_index()  # drops the entry of the file that is gone

    def wipe(self, session_id: str) -> list[Path]:
        """Overwrite the session file and its temp copies with zeros (fsynced), then unlink
        them and drop the session from the index, whose old copy (it holds the name) is zeroed
        too. Returns the files overwritten. Refused (SessionBusy) while a turn answers it.

        What this cannot promise is said by wipe_caveat: SSDs and copy-on-write or
        log-structured file systems may keep the old blocks.
        """
        _check_id(session_id)
        path = self._path(session_id)
        with self.answering(session_id):
            try:
                fd = paths.private_open(path, os.O_WRONLY)
            except FileNotFoundError:
                raise HistoryError(f"no session {session_id!r}") from None
            except OSError as exc:
                raise HistoryError(f"could not wipe session {session_id!r}: {_reason(exc)}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # before the index lock, as appends take them
                with self._index_lock():
                    entries = self._current_index(save=False)  # the old index is zeroed, not replaced
                    wiped = [path] if wipe_file(path, fd) else []
                    wiped += [p for p in temp_copies(self.root, f"{session_id}{SUFFIX}") if wipe_file(p)]
                    entries.pop(session_id, None)
                    self._tails.pop(session_id, None)
                    for index_copy in (self.root / INDEX_NAME, *temp_copies(self.root, INDEX_NAME)):
                        _overwrite_with_zeros(index_copy)
                    self._save_index_quietly(entries)
                    paths.fsync_dir(self.root)
            except OSError as exc:
                raise HistoryError(f"could not wipe session {session_id!r}: {_reason(exc)}; run the wipe "
                                   "again (what was already overwritten stays overwritten)") from exc
            finally:
                os.close(fd)
        self._remove_answering_lock(session_id)
        return wiped

    # ---- who is answering a session

    @contextmanager
    def answering(self, session_id: str) -> Iterator[None]:
        """Held by the k3chat that answers a session, from its user record to its answer: a
        second one gets SessionBusy (naming this process's pid) instead of appending in
        between or being told to answer a message that is being answered."""
        _check_id(session_id)
        if not self._path(session_id).exists():
            raise HistoryError(f"no session {session_id!r}")
        try:
            fd = paths.private_open(self._answering_path(session_id), os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise HistoryError(f"could not lock session {session_id!r}: {_reason(exc)}") from exc
        try:
            _take_answering_lock(fd, session_id)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the flock

    def check_idle(self, session_id: str) -> None:
        """SessionBusy if another k3chat is answering ``session_id`` now. Read-only: works on
        a read-only store too."""
        _check_id(session_id)
        try:
            fd = os.open(self._answering_path(session_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # never answered here (or not readable): nobody we could name
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released by close, at once
        except BlockingIOError:
            raise SessionBusy(session_id, _pid_in(fd)) from None
        finally:
            os.close(fd)

    def _answering_path(self, session_id: str) -> Path:
        return self.root / f"{session_id}{ANSWERING_SUFFIX}"

    def _remove_answering_lock(self, session_id: str) -> None:
        try:
            os.unlink(self._answering_path(session_id))
        except OSError:
            pass  # never created, or a read-only home: it holds only a pid

    def export_markdown(self, session_id: str) -> str:
        """The conversation for reading. Answers are Markdown made inert (k3chat.safe_markdown:
        they render, but links, images, URLs and HTML are shown as text, so an export never
        fetches anything); user and system messages and each reasoning block (in a quote) are
        fenced code blocks whose fence is longer than any backtick run inside, shown exactly;
        names are backslash-escaped; control characters are shown as visible escapes
        (display.for_terminal), so printing it cannot drive a terminal. For a faithful copy of
        the text use the JSON export."""
        loaded = self.load(session_id)
        info = loaded.info
        out = [f"# {_md_inline(info.name)}", "", f"Session `{info.id}`, created {_iso(info.created)}"
               + (f", model {_md_inline(info.model)}" if info.model else "") + "."]
        out += _markdown_damage(loaded)
        for record in loaded.records:
            out += ["", *_markdown_record(record)]
        return "\n".join(out) + "\n"

    def export_text(self, session_id: str) -> str:
        """The conversation to read in a terminal (``sessions show``): plain text with no
        Markdown syntax, each message under who said it, reasoning indented behind a bar.
        Whoever prints it shows controls as escapes (display.for_terminal)."""
        loaded = self.load(session_id)
        info = loaded.info
        out = [display_name(info.name), f"session {info.id}, created {_iso(info.created)}"
               + (f", model {display_name(info.model)}" if info.model else "")]
        if loaded.skipped:
            out.append(f"({len(loaded.skipped)} damaged line(s) of the session file are not shown)")
        for record in loaded.records:
            out += ["", *_text_record(record)]
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
        skipped = set(loaded.skipped)
        warnings = [f"damaged line not exported: {p}" if p in skipped else f"exported, with a warning: {p}"
                    for p in loaded.problems]
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
            out = {"role": record["role"], "content": model_message(record)["content"]}  # attachments as read
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
            if st.st_nlink == 0:
                # Replaced while we waited for the lock (sessions encrypt/decrypt, or deleted):
                # writing to the old inode would lose the line.
                raise HistoryError(f"session {session_id!r} was replaced or deleted while saving; "
                                   "nothing was written, try again")
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
            line = self._sealed(session_id, line)
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
            except (OSError, IndexUnreadable) as exc:
                # The line is durable; only the index (a cache, repaired by size) is stale.
                log.warning("history index not updated (%s); it will be rebuilt",
                            _reason(exc) if isinstance(exc, OSError) else exc)
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
        parsed = _parse_file(data[: st.st_size], self._unsealer(session_id))
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
        if self.read_only:
            return  # repaired in memory only; a writer saves it
        try:
            self._store_index(entries)
        except OSError as exc:
            log.warning("history index not saved (%s); it will be rebuilt", _reason(exc))

    # ---- the index

    @contextmanager
    def _index_lock(self) -> Iterator[None]:
        if self.read_only:
            raise HistoryError("this history was opened read-only; nothing can be changed through it")
        path = self.root / LOCK_NAME
        try:
            fd = paths.private_open(path, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            raise HistoryError(f"cannot lock the history index {path} for writing: {_reason(exc)}; changing "
                               f"sessions needs write access to {self.root} (reading them does not)") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """The index lock for reading. A writable store takes it exclusive (a stale index is
        repaired and saved); a read-only one shares it if the lock file opens read-only, else
        reads without it: the index is only ever replaced whole and is checked against the
        files' sizes, so what is read is consistent either way."""
        if not self.read_only:
            with self._index_lock():
                yield
            return
        try:
            fd: int | None = os.open(self.root / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            fd = None  # no lock file yet, or one we may not open: nobody to wait for we could see
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            if fd is not None:
                os.close(fd)

    def _current_index(self, *, save: bool = True) -> dict[str, dict[str, Any]]:
        """The index, reconciled with the files on disk and saved (unless ``save`` is False)
        if that changed it.

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
        if changed and save:
            self._save_index_quietly(entries)
        return entries

    def _named_in(self, entries: dict[str, dict[str, Any]], name: str) -> list[SessionInfo]:
        """The sessions whose files say they are named ``name``. The index is believed only when
        every file it names so agrees; otherwise (or when it knows no session of that name,
        which is what makes a caller create one) every file is asked, and entries whose name
        the file contradicts are repaired. Call with the index lock held."""
        claimed = [sid for sid, entry in entries.items() if entry["name"] == name]
        if claimed and all(self._name_in_file(sid) == name for sid in claimed):
            return [_info(sid, entries[sid]) for sid in claimed]
        self._correct_names(entries)
        return [_info(sid, entry) for sid, entry in entries.items() if entry["name"] == name]

    def _free_name(self, entries: dict[str, dict[str, Any]], name: str) -> str:
        """``name``, or the first of "name (2)", "name (3)" ... no session has. Index lock held."""
        candidate, number = name, 1
        while self._named_in(entries, candidate):
            number += 1
            suffix = f" ({number})"
            candidate = name[: MAX_NAME_LEN - len(suffix)].rstrip() + suffix
        return candidate

    def _name_in_file(self, session_id: str) -> str | None:
        try:
            return self.load(session_id).info.name
        except HistoryError:
            return None

    def _correct_names(self, entries: dict[str, dict[str, Any]]) -> None:
        """Re-read every session file; an entry whose name its file contradicts is replaced,
        reported, and the index saved."""
        repaired = []
        for session_id, entry in list(entries.items()):
            said = entry["name"]
            if self._refresh_entry(entries, session_id) and entries[session_id]["name"] != said:
                repaired.append(f"{session_id} is {entries[session_id]['name']!r}, not {said!r}")
        if repaired:
            log.warning("history index %s disagreed with the session files (%s); the files are believed%s",
                        self.root / INDEX_NAME, "; ".join(repaired),
                        "" if self.read_only else " and the index is repaired")
            self._save_index_quietly(entries)

    def _refresh_entry(self, entries: dict[str, dict[str, Any]], session_id: str) -> bool:
        try:
            loaded = self.load(session_id)
            size = os.stat(self._path(session_id)).st_size
        except (OSError, HistoryError):
            return False  # deleted meanwhile, or unreadable: leave it to the next listing
        entries[session_id] = _entry(loaded.info, size)
        return True

    def _read_index(self) -> dict[str, dict[str, Any]] | None:
        path = self.root / INDEX_NAME
        try:
            # O_NONBLOCK: a FIFO put in its place must not hang every command.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _unreadable_index(path, exc) from exc
        try:
            with os.fdopen(fd, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if not stat.S_ISREG(mode):
                    raise _unreadable_index(path, kind="a directory" if stat.S_ISDIR(mode) else "not a regular file")
                data = f.read()
        except OSError as exc:
            raise _unreadable_index(path, exc) from exc
        try:
            doc = json.loads(self._open_index(data))
            entries = doc["sessions"]
            if doc.get("version") != FORMAT_VERSION or not isinstance(entries, dict):
                raise ValueError("unknown index layout")
            for session_id, entry in entries.items():
                _check_id(session_id)
                _info(session_id, entry)  # raises on any missing or mistyped field
        except _SealedWithoutKey:
            raise  # not damaged: rebuilding it without the key would lose nothing but help no one
        except (ValueError, KeyError, TypeError, HistoryError, SealError) as exc:
            log.warning("history index %s is damaged (%s); rebuilding it from the sessions",
                        self.root / INDEX_NAME, exc)
            return None
        return entries

    def _store_index(self, entries: dict[str, dict[str, Any]]) -> None:
        doc = {"version": FORMAT_VERSION, "sessions": entries}
        data = json.dumps(doc, ensure_ascii=False, indent=1).encode()
        if self.vault is not None:
            data = self.vault.seal_line(data, kind=KIND_INDEX, binding="")
        paths.atomic_write(self.root / INDEX_NAME, data)

    def _open_index(self, data: bytes) -> bytes:
        """The index's JSON text; SealError (rebuilt) if a sealed index cannot be opened."""
        if self.vault is not None:
            # A plaintext index here is left from before `encrypt`: rebuilt, and so sealed.
            return self.vault.open_line(data, kind=KIND_INDEX, binding="")
        if has_sealed_line(data):
            raise _SealedWithoutKey(f"the history index {self.root / INDEX_NAME} is encrypted but the key "
                                    f"file {key_file_beside(self.root)} is missing; restore it to read the history")
        return data

    def _session_files(self) -> dict[str, int]:
        """Session id -> file size, for every well-named session file."""
        found: dict[str, int] = {}
        if self.read_only and not self.root.exists():
            return found  # a read-only look at a home that has no history yet
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
            data, st = f.read(), os.fstat(f.fileno())
        self._check_sealing(session_id, data)
        return data, st

    def _check_sealing(self, session_id: str, data: bytes) -> None:
        """Refuse a file in the other form than the store's: never read or extend it wrongly."""
        sealed = has_sealed_line(data)
        if self.vault is None and sealed:
            raise _SealedWithoutKey(f"session {session_id!r} is encrypted but the key file "
                                    f"{key_file_beside(self.root)} is missing; restore it to read the session")
        if self.vault is not None and data and not sealed:
            command = "decrypt" if self.vault.state == STATE_DECRYPTING else "encrypt"
            raise HistoryError(f"session {session_id!r} is not encrypted although the history is: an "
                               f"earlier `k3chat sessions {command}` did not finish; run it again")

    def _sealed(self, session_id: str, line: bytes) -> bytes:
        """``line`` (ending in a newline) as it goes to the session file."""
        if self.vault is None:
            return line
        return self.vault.seal_line(line[:-1], kind=KIND_SESSION, binding=session_id) + b"\n"

    def _unsealer(self, session_id: str) -> Callable[[bytes], bytes] | None:
        vault = self.vault
        if vault is None:
            return None
        return lambda raw: vault.open_line(raw, kind=KIND_SESSION, binding=session_id)

    def _new_id(self, now: float) -> str:
        # Sortable by creation and unguessable enough to never collide between processes.
        stamp = datetime.fromtimestamp(now, tz=timezone.utc).strftime("%Y%m%d-%H%M%S")
        while True:
            session_id = f"{stamp}-{secrets.token_hex(4)}"
            if not self._path(session_id).exists():
                return session_id


def open_store(root: Path | None = None, *, read_only: bool = False) -> HistoryStore:
    """The history store, unlocked when encryption is on (the passphrase is asked at most once
    per process; VaultError, exit code 2, when it cannot be had or is wrong)."""
    if root is None:
        (_existing_private_dir if read_only else paths.ensure_private_dir)(paths.data_dir())
        root = paths.data_dir() / "sessions"
    vault = unlock_if_enabled(key_file_beside(Path(root)))
    if vault is not None and vault.state != STATE_ON:
        log.warning("`k3chat sessions %s` did not finish; run it again to convert the rest of the history",
                    "decrypt" if vault.state == STATE_DECRYPTING else "encrypt")
    return HistoryStore(root, vault=vault, read_only=read_only)


def _unreadable_index(path: Path, exc: OSError | None = None, *, kind: str | None = None) -> IndexUnreadable:
    """Why the index cannot be read, naming it and what to do (it is only a cache)."""
    rebuild = "k3chat rebuilds the index from the session files"
    if exc is not None and exc.errno in (errno.ELOOP, errno.EISDIR):
        kind = "a directory" if exc.errno == errno.EISDIR else "a symbolic link (never followed)"
    if kind is not None or exc is None:
        advice = f"it is {kind or 'not a regular file'}, not the index file: move it out of the way ({rebuild})"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        advice = "permission denied: it should be a file you own with mode 0600 (chmod 600 it)"
    else:
        advice = f"{_reason(exc)}: if it is damaged, move it out of the way ({rebuild})"
    return IndexUnreadable(f"cannot read the history index {path}: {advice}")


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


def _markdown_damage(loaded: LoadedSession) -> list[str]:
    """What the export could not include and what it warns about, exactly (escaped)."""
    if not loaded.problems:
        return []
    kept = len(loaded.problems) - len(loaded.skipped)
    out = ["", f"> {len(loaded.skipped)} damaged line(s) of the session file were skipped in this export, "
               f"every other record is here; {kept} warning(s) about records that are kept:", ">"]
    return out + [f"> - {_md_inline(problem)}" for problem in loaded.problems]


def _markdown_record(record: Mapping[str, Any]) -> list[str]:
    heading = f"## {record['role'].capitalize()}"
    if _is_number(record.get("time")):
        heading += f" ({_iso(record['time'])})"
    if record.get("interrupted"):
        heading += " [interrupted]"
    out = [heading, ""]
    reasoning = record.get("reasoning_content")
    if reasoning:
        # Set apart as a quote holding an inert code block: read as notes, never rendered.
        out += ["> **Reasoning**", ">", *(f"> {line}".rstrip() for line in _fenced(reasoning)), ""]
    if record["role"] == "assistant":
        return out + answer_markdown(record["content"])  # rendered, but nothing in it can fetch
    return out + _fenced(record["content"]) + _markdown_attachments(record)  # what was typed, exactly as typed


def _markdown_attachments(record: Mapping[str, Any]) -> list[str]:
    """Each attachment set apart as a quote: name, kind, size, SHA-256 and notes (escaped),
    then the text the model read as an inert fenced block."""
    entries = record.get("attachments") or []
    out: list[str] = []
    for number, entry in enumerate(entries, start=1):
        out += ["", f"> **Attachment {number} of {len(entries)}: {_md_inline(entry['name'])}** "
                    f"({_md_inline(_kind_words(entry))}, {entry['size']:,} bytes, SHA\\-256 {entry['sha256']})"]
        out += [f"> *{_md_inline(note)}*" for note in entry["notes"]]
        out += [">", *(f"> {line}".rstrip() for line in _fenced(entry["text"]))]
    return out


def _kind_words(entry: Mapping[str, Any]) -> str:
    return Attachment.from_record(entry).label


_SPEAKERS = {"user": "You", "assistant": "K3", "system": "System"}


def _text_record(record: Mapping[str, Any]) -> list[str]:
    heading = _SPEAKERS[record["role"]]
    if _is_number(record.get("time")):
        heading += f" ({_iso(record['time'])})"
    if record.get("interrupted"):
        heading += " [interrupted]"
    out = [heading + ":"]
    reasoning = record.get("reasoning_content")
    if reasoning:
        out += ["  Reasoning:", *(f"  \u2502 {line}".rstrip() for line in reasoning.split("\n")), ""]
    return out + record["content"].split("\n") + _text_attachments(record)


def _text_attachments(record: Mapping[str, Any]) -> list[str]:
    entries = record.get("attachments") or []
    out: list[str] = []
    for number, entry in enumerate(entries, start=1):
        out += ["", f"  Attachment {number} of {len(entries)}: {display_name(entry['name'])} ({_kind_words(entry)}, "
                    f"{entry['size']:,} bytes, sha256 {entry['sha256']})"]
        out += [f"  note: {note}" for note in entry["notes"]]
        out += [f"  \u2502 {line}".rstrip() for line in entry["text"].split("\n")]
    return out


# --------------------------------------------------------------------------- wiping

# File systems on which an overwrite goes to new blocks, leaving the old ones as they were.
_COPY_ON_WRITE = {"btrfs": "copy-on-write", "zfs": "copy-on-write", "bcachefs": "copy-on-write",
                  "apfs": "copy-on-write", "f2fs": "log-structured", "nilfs2": "log-structured",
                  "overlay": "layered (a copy may remain in a lower layer)"}
_ZERO_CHUNK = 1 << 20


def temp_copies(directory: Path, target: str) -> list[Path]:
    """The atomic_write temp files for ``target`` in ``directory``, whoever wrote them."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        m = paths.TEMP_RE.fullmatch(name)
        if m is not None and m["target"] == target:
            found.append(Path(directory) / name)
    return found


def _zero_fd(fd: int) -> None:
    """Overwrite a regular file's bytes in place with zeros, then fsync."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return
    zeros = bytes(min(st.st_size, _ZERO_CHUNK))
    done = 0
    os.lseek(fd, 0, os.SEEK_SET)
    while done < st.st_size:
        chunk = min(len(zeros), st.st_size - done)
        paths.write_all(fd, memoryview(zeros)[:chunk])
        done += chunk
    os.fsync(fd)


def _overwrite_with_zeros(path: Path) -> bool:
    """Zero ``path`` in place (no unlink). False if it does not exist."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        _zero_fd(fd)
    finally:
        os.close(fd)
    return True


def wipe_file(path: Path, fd: int | None = None) -> bool:
    """Overwrite ``path`` with zeros (through ``fd`` if the caller holds it open and locked),
    fsync, then unlink it. False if it did not exist. The unlink is made durable by the
    caller's fsync of the directory."""
    if fd is None:
        if not _overwrite_with_zeros(path):
            return False
    else:
        _zero_fd(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return True


def _filesystem_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the file system holding ``path`` (Linux /proc/self/mountinfo, matched by
    device number), or None where that cannot be known cheaply."""
    try:
        dev = os.stat(path).st_dev
        if mountinfo is None:
            mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    wanted = f"{os.major(dev)}:{os.minor(dev)}"
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == wanted and "-" in fields[6:]:
            return fields[fields.index("-", 6) + 1]
    return None


def _non_rotating_disk(path: Path) -> bool | None:
    """True if the disk under ``path`` says it is not rotating (an SSD, or a virtual disk),
    False if it rotates, None if Linux sysfs cannot tell."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (block / "queue", block / ".." / "queue"):  # a whole disk, or a partition of one
        try:
            return (queue / "rotational").read_text().strip() == "0"
        except OSError:
            continue
    return None


def wipe_caveat(path: Path, mountinfo: str | None = None) -> str:
    """What overwriting files under ``path`` in place cannot promise, said for this machine
    where it can be told cheaply (file system type, rotating or not), else in general."""
    fs = _filesystem_type(path, mountinfo)
    kind = _COPY_ON_WRITE.get(fs or "")
    tail = ("only encryption (of the disk, or of the history) protects against that; backups and "
            "file-system snapshots are not touched")
    if kind is not None:
        return (f"the history is on {fs}, a {kind} file system: the zeros were written to new blocks and "
                f"the old ones may still hold the text until they are reused; {tail}")
    where = f"the history is on {fs}" if fs else "the history's file system is unknown"
    if _non_rotating_disk(path):
        return (f"{where}, on a disk that reports itself as non-rotating (an SSD or a virtual disk): its "
                f"controller remaps writes, so the old blocks may survive the overwrite; {tail}")
    return (f"{where}; on SSDs and on copy-on-write file systems (btrfs, zfs, APFS) overwriting in place "
            f"does not guarantee that the old blocks are gone; {tail}")


def _take_answering_lock(fd: int, session_id: str) -> None:
    """flock the answering file or raise SessionBusy. A check_idle() probe holds a shared
    lock for microseconds, so a refusal is retried briefly before it is believed."""
    for attempt in range(20):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.005)
    raise SessionBusy(session_id, _pid_in(fd))


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "the disk is full"
    return exc.strerror or str(exc)
