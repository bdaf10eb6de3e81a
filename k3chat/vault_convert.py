"""`k3chat sessions encrypt` and `k3chat sessions decrypt`: convert the whole history.

Every session file and engine state file is converted on its own and replaced atomically
(paths.atomic_write), so an interruption leaves each file either as it was or converted, and
running the command again finishes the job: files already in the wanted form are skipped. The
index (a cache) is removed and rebuilt in the new form. The key file's ``state`` says a
conversion is under way, so commands that meet a file still in the old form say what to run.

Encrypt: the key file is written first (its own passphrase, asked twice, or from
K3CHAT_PASSPHRASE_FILE); resuming unlocks the key file that is there. Decrypt: the key file is
removed last, only once every file is plaintext. A record that cannot be decrypted (damaged)
is kept in the plaintext file as a ``{"k3chat": "damaged", ...}`` line holding its bytes, which
the store reports and skips like any damaged line; a state file that cannot be decrypted is
removed (the history rebuilds it). Run either command while no other k3chat process is open:
a process that meets a converted file refuses to write to it rather than mixing forms.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from k3chat import paths
from k3chat.history import _ID_RE, INDEX_NAME, LOCK_NAME, SUFFIX, HistoryStore
from k3chat.vault import (KIND_SESSION, KIND_STATE, STATE_DECRYPTING, STATE_ENCRYPTING, STATE_ON, SealError,
                          Vault, create_key_file, forget, has_sealed_line, is_sealed_stream, key_file_beside,
                          new_passphrase, unlock_if_enabled)

_READ_PIECE = 1 << 20


@dataclass
class Conversion:
    """What a conversion did, for the command's report."""

    sessions: int = 0  # session files converted now
    sessions_skipped: int = 0  # already in the wanted form
    states: int = 0
    states_skipped: int = 0
    notes: list[str] = field(default_factory=list)  # damaged records kept, state files removed
    created_key: bool = False


def sessions_root() -> Path:
    return paths.data_dir() / "sessions"


def states_root() -> Path:
    from k3chat.conversation import state_path

    return state_path("x").parent


def is_encrypted() -> bool:
    return key_file_beside(sessions_root()).exists()


def encrypt_history() -> Conversion:
    """Turn encryption on and convert what exists (VaultError: passphrase problems, exit 2)."""
    root = sessions_root()
    key_file = key_file_beside(root)
    report = Conversion()
    vault = unlock_if_enabled(key_file)
    if vault is None:
        paths.ensure_private_dir(paths.data_dir())
        vault = create_key_file(key_file, new_passphrase(), state=STATE_ENCRYPTING)
        report.created_key = True
    elif vault.state != STATE_ENCRYPTING:
        vault.set_state(STATE_ENCRYPTING)
    _convert_sessions(root, vault, seal=True, report=report)
    _convert_states(states_root(), vault, seal=True, report=report)
    vault.set_state(STATE_ON)
    if root.exists():
        HistoryStore(root, vault=vault).list()  # the index, rebuilt sealed
    return report


def decrypt_history() -> Conversion | None:
    """Convert everything back to plaintext and remove the key file; None if not encrypted."""
    root = sessions_root()
    key_file = key_file_beside(root)
    vault = unlock_if_enabled(key_file)
    if vault is None:
        return None
    report = Conversion()
    vault.set_state(STATE_DECRYPTING)
    _convert_sessions(root, vault, seal=False, report=report)
    _convert_states(states_root(), vault, seal=False, report=report)
    os.unlink(key_file)  # last: until here every sealed file could still be read
    paths.fsync_dir(key_file.parent)
    forget(key_file)
    if root.exists():
        HistoryStore(root).list()  # the index, rebuilt in plaintext
    return report


# --------------------------------------------------------------------------- session files


@contextmanager
def _index_locked(root: Path) -> Iterator[None]:
    # The store's own index lock (history.HistoryStore._index_lock).
    fd = paths.private_open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _convert_sessions(root: Path, vault: Vault, *, seal: bool, report: Conversion) -> None:
    if not root.exists():
        return
    paths.ensure_private_dir(root)
    # Temp copies left by writers that died hold the old form (plaintext, for encrypt).
    paths.sweep_temps(root)
    # Each file under its own append lock only: an appender holds that lock while it waits for
    # the index lock, so holding the index lock here meanwhile could deadlock with it.
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        session_id = entry.name[: -len(SUFFIX)]
        if not (entry.name.endswith(SUFFIX) and _ID_RE.fullmatch(session_id)
                and entry.is_file(follow_symlinks=False)):
            continue
        if _convert_session_file(Path(entry.path), session_id, vault, seal=seal, report=report):
            report.sessions += 1
        else:
            report.sessions_skipped += 1
    with _index_locked(root):
        try:
            os.unlink(root / INDEX_NAME)  # a cache in the old form: rebuilt by the caller
        except FileNotFoundError:
            pass
        paths.fsync_dir(root)


def _convert_session_file(path: Path, session_id: str, vault: Vault, *, seal: bool, report: Conversion) -> bool:
    """Convert one session file under its append lock; False if it already has the wanted form."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # an append in progress finishes first
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
        if has_sealed_line(data) == seal:
            return False
        if seal:
            converted = _sealed_file(data, session_id, vault)
        else:
            converted = _opened_file(data, session_id, vault, report)
        paths.atomic_write(path, converted)
        return True
    finally:
        os.close(fd)


def _split(data: bytes) -> tuple[list[bytes], bytes]:
    """(complete lines, the incomplete last line or b"")."""
    lines = data.split(b"\n")
    return lines, lines.pop()


def _sealed_file(data: bytes, session_id: str, vault: Vault) -> bytes:
    lines, tail = _split(data)
    out = b"".join(vault.seal_line(line, kind=KIND_SESSION, binding=session_id) + b"\n" for line in lines)
    if tail:
        # Still an incomplete last line (no newline), so still reported as one; sealed, though.
        out += vault.seal_line(tail, kind=KIND_SESSION, binding=session_id)
    return out


def _opened_file(data: bytes, session_id: str, vault: Vault, report: Conversion) -> bytes:
    lines, tail = _split(data)
    out = [_opened_line(line, number, session_id, vault, report) for number, line in enumerate(lines, start=1)]
    text = b"".join(line + b"\n" for line in out)
    if tail:
        text += _opened_line(tail, len(lines) + 1, session_id, vault, report)
    return text


def _opened_line(raw: bytes, number: int, session_id: str, vault: Vault, report: Conversion) -> bytes:
    try:
        return vault.open_line(raw, kind=KIND_SESSION, binding=session_id)
    except SealError as exc:
        report.notes.append(f"session {session_id} line {number}: {exc}; kept as a damaged line")
        # Its bytes are kept (nothing is thrown away), as a store line the reader skips.
        marker = {"k3chat": "damaged", "line": number, "reason": str(exc),
                  "bytes": base64.b64encode(raw).decode("ascii")}
        return json.dumps(marker, separators=(",", ":")).encode("ascii")


# --------------------------------------------------------------------------- state files


def _convert_states(root: Path, vault: Vault, *, seal: bool, report: Conversion) -> None:
    from k3chat.conversation import STATE_SUFFIX

    if not root.exists():
        return
    paths.sweep_temps(root)
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not (entry.name.endswith(STATE_SUFFIX) and entry.is_file(follow_symlinks=False)):
            continue
        if _convert_state_file(Path(entry.path), vault, seal=seal, report=report):
            report.states += 1
        else:
            report.states_skipped += 1


def _convert_state_file(path: Path, vault: Vault, *, seal: bool, report: Conversion) -> bool:
    with open(path, "rb") as f:
        if is_sealed_stream(f.read(8)) == seal:
            return False
        f.seek(0)
        if seal:
            pieces = iter(lambda: f.read(_READ_PIECE), b"")
            paths.atomic_write(path, vault.seal_stream(pieces, kind=KIND_STATE, binding=path.name))
            return True
        try:
            paths.atomic_write(path, vault.iter_stream(f, kind=KIND_STATE, binding=path.name))
        except SealError as exc:
            os.unlink(path)  # a cache that cannot be read: the history rebuilds it
            report.notes.append(f"state file {path.name}: {exc}; removed (the next run prefills the history)")
    return True


__all__ = ["Conversion", "encrypt_history", "decrypt_history", "is_encrypted"]
