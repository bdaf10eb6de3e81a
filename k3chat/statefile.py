"""Engine state files: resume a session without prefilling its whole history again.

A state file is only an optimisation: the history can always rebuild it (design 2.5). So
anything doubtful is refused with a reason and the caller prefills from the history; a wrong
state would silently give the model a different conversation than the one on screen.

Layout (little-endian), version 1::

    magic        8 bytes   b"K3STATE\\x00"
    version      u32
    fp_len       u16       then fp_len bytes: the model fingerprint, UTF-8
    n_tokens     u64       ids the payload has consumed
    payload_len  u64
    sha256       32 bytes  over every byte above, then the payload
    payload      payload_len bytes (opaque engine state)

The checksum covers the header too, so a flipped bit in n_tokens or the fingerprint is caught.

When the history is encrypted (a ``vault`` is passed), these same bytes are written as the
sealed stream of k3chat/vault.py, bound to the file's name (so to its session): they never
reach the disk in plaintext, temp files included. A damaged, truncated or swapped sealed file
is refused like any other doubtful state file.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from k3chat import paths
from k3chat.vault import KIND_STATE, SealError, is_sealed_stream

if TYPE_CHECKING:
    from k3chat.vault import Vault

MAGIC = b"K3STATE\x00"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIH")  # magic, version, fp_len
_COUNTS = struct.Struct("<QQ")  # n_tokens, payload_len
_DIGEST_LEN = 32
_MAX_FINGERPRINT = 1024

# Reasons, stable strings the caller can branch on (and tests assert).
MISSING = "missing"
UNREADABLE = "unreadable"
BAD_MAGIC = "bad_magic"
UNSUPPORTED_VERSION = "unsupported_version"
TRUNCATED = "truncated"
LENGTH_MISMATCH = "length_mismatch"
CHECKSUM_MISMATCH = "checksum_mismatch"
FINGERPRINT_MISMATCH = "fingerprint_mismatch"
AUTH_FAILED = "auth_failed"  # an encrypted state file that does not authenticate
NOT_ENCRYPTED = "not_encrypted"  # a plaintext state file although the history is encrypted
ENCRYPTED = "encrypted"  # an encrypted state file read without the key


class StateFileError(Exception):
    """A state file was refused. ``reason`` is one of the constants above; the message says
    what was found, for the status line ("state refused: ...; rebuilding from history")."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class StateFile:
    payload: bytes
    n_tokens: int
    fingerprint: str
    version: int = FORMAT_VERSION


def model_fingerprint(config_json_bytes: bytes, index_or_header_bytes: bytes, *, extra: bytes = b"") -> str:
    """SHA-256 of the model's identity: its config.json and its tensor index (or a
    safetensors header) as raw bytes. ``extra`` should carry anything else the payload layout
    depends on, such as the engine's state-layout version.

    Raw bytes, not parsed JSON: a file that changed in any way is treated as another model.
    Each part is length-prefixed so that moving bytes between parts changes the result.
    """
    h = hashlib.sha256(b"k3chat model fingerprint v1\x00")
    for part in (config_json_bytes, index_or_header_bytes, extra):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return "sha256:" + h.hexdigest()


class SaveCancelled(Exception):
    """save_state stopped because ``cancel()`` said so; the old file (if any) is unchanged."""


_WRITE_CHUNK = 64 << 20


def save_state(path: Path, payload: bytes, *, fingerprint: str, n_tokens: int,
               cancel: Callable[[], bool] | None = None, vault: Vault | None = None) -> None:
    """Write atomically (0600, in a 0700 directory): a crash leaves the old file or the new.

    ``cancel`` is polled between 64 MiB pieces of the payload (a second Ctrl-C during a large
    save); when it returns True the temp file is removed and SaveCancelled raised. With a
    ``vault`` the file is sealed as it is written.
    """
    path = Path(path)
    fp = fingerprint.encode("utf-8")
    if not 0 < len(fp) <= _MAX_FINGERPRINT:
        raise ValueError(f"fingerprint must be 1..{_MAX_FINGERPRINT} bytes")
    if not 0 <= n_tokens < 2**64:
        raise ValueError(f"n_tokens out of range: {n_tokens}")
    header = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(fp)) + fp + _COUNTS.pack(n_tokens, len(payload))
    digest = hashlib.sha256(header)
    digest.update(payload)

    def pieces() -> Iterator[bytes | memoryview]:
        yield header
        yield digest.digest()
        view = memoryview(payload)  # slices of it, never copies
        for start in range(0, len(view), _WRITE_CHUNK):
            if cancel is not None and cancel():
                raise SaveCancelled("state save cancelled")
            yield view[start : start + _WRITE_CHUNK]

    # The payload holds the conversation in another form: same privacy rules as the history.
    paths.ensure_private_dir(path.parent)
    chunks = pieces() if vault is None else vault.seal_stream(pieces(), kind=KIND_STATE, binding=path.name)
    paths.atomic_write(path, chunks)


_HEAD_MAX = _PREFIX.size + _MAX_FINGERPRINT + _COUNTS.size + _DIGEST_LEN


@dataclass(frozen=True)
class _Head:
    version: int
    fingerprint: bytes
    n_tokens: int
    payload_len: int
    header_end: int  # what the checksum covers before the payload
    digest: bytes
    payload_offset: int


def _parse_head(head: bytes) -> _Head:
    version, fp_len = _check_prefix(head)
    offset = _PREFIX.size
    stored_fp_bytes = head[offset : offset + fp_len]
    offset += fp_len
    if len(head) < offset + _COUNTS.size + _DIGEST_LEN:
        raise StateFileError(TRUNCATED, f"state file ends inside its header ({len(head)} bytes)")
    n_tokens, payload_len = _COUNTS.unpack_from(head, offset)
    offset += _COUNTS.size
    digest = head[offset : offset + _DIGEST_LEN]
    return _Head(version, stored_fp_bytes, n_tokens, payload_len, offset, digest, offset + _DIGEST_LEN)


def _read_plain(f: BinaryIO) -> tuple[_Head, bytes, bytes]:
    head = f.read(_HEAD_MAX)
    if is_sealed_stream(head):
        raise StateFileError(ENCRYPTED, "an encrypted state file, but the history is not encrypted (no key file)")
    fields = _parse_head(head)
    f.seek(fields.payload_offset)
    return fields, head, f.read()


def _read_sealed(f: BinaryIO, path: Path, vault: Vault) -> tuple[_Head, bytes, bytes]:
    """Decrypted into one buffer whose front is then dropped in place (a bytearray does that
    without moving the rest), so the payload is held once here too."""
    if f.read(len(MAGIC)) == MAGIC:
        raise StateFileError(NOT_ENCRYPTED, "a plaintext state file although the history is encrypted")
    f.seek(0)
    try:
        plain = vault.read_stream(f, kind=KIND_STATE, binding=path.name)
    except SealError as exc:
        raise StateFileError(TRUNCATED if exc.truncated else AUTH_FAILED, str(exc)) from None
    fields = _parse_head(bytes(plain[:_HEAD_MAX]))
    head = bytes(plain[: fields.payload_offset])
    del plain[: fields.payload_offset]
    return fields, head, plain  # type: ignore[return-value]  # a bytearray is as good as bytes here


def load_state(path: Path, *, fingerprint: str, vault: Vault | None = None) -> StateFile:
    """Read and verify; raise StateFileError(reason) unless every check passes.

    The header is read first and the payload straight into its own buffer, so a state of
    several gigabytes is held once, not once as the file and again as the payload. With a
    ``vault`` the file must be sealed (and is opened with it).
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise StateFileError(MISSING, f"no state file at {path}") from None
    except OSError as exc:
        raise StateFileError(UNREADABLE, f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        with f:
            fields, head, payload = _read_plain(f) if vault is None else _read_sealed(f, path, vault)
    except OSError as exc:
        raise StateFileError(UNREADABLE, f"cannot read {path}: {exc.strerror or exc}") from exc
    version, stored_fp_bytes, n_tokens = fields.version, fields.fingerprint, fields.n_tokens
    payload_len, header_end, stored_digest = fields.payload_len, fields.header_end, fields.digest
    actual_len = len(payload)
    if actual_len != payload_len:
        what = "truncated" if actual_len < payload_len else "has trailing bytes"
        raise StateFileError(LENGTH_MISMATCH, f"payload {what}: header says {payload_len} bytes, file has {actual_len}")
    digest = hashlib.sha256(head[:header_end])
    digest.update(payload)
    if digest.digest() != stored_digest:
        raise StateFileError(CHECKSUM_MISMATCH, "checksum mismatch: the state file is corrupt")
    # Checked after the checksum, so a damaged fingerprint field reads as corruption, and a
    # mismatch here really means "made by another model (or engine build)".
    stored_fp = stored_fp_bytes.decode("utf-8", errors="replace")
    if stored_fp != fingerprint:
        raise StateFileError(FINGERPRINT_MISMATCH, f"made for another model ({_short(stored_fp)}, this is {_short(fingerprint)})")
    return StateFile(payload, n_tokens, stored_fp, version)


def _check_prefix(data: bytes) -> tuple[int, int]:
    """Magic, then version (the layout after it depends on the version), then fp length."""
    if len(data) < len(MAGIC) and MAGIC.startswith(data):
        raise StateFileError(TRUNCATED, f"state file ends inside its magic ({len(data)} bytes)")
    if data[: len(MAGIC)] != MAGIC:
        raise StateFileError(BAD_MAGIC, "not a k3chat state file (bad magic)")
    if len(data) < _PREFIX.size:
        raise StateFileError(TRUNCATED, f"state file ends inside its header ({len(data)} bytes)")
    _, version, fp_len = _PREFIX.unpack_from(data, 0)
    if version != FORMAT_VERSION:
        raise StateFileError(UNSUPPORTED_VERSION, f"state format version {version}, this build reads {FORMAT_VERSION}")
    if not 0 < fp_len <= _MAX_FINGERPRINT:
        raise StateFileError(CHECKSUM_MISMATCH, f"implausible fingerprint length {fp_len}: the header is corrupt")
    return version, fp_len


def _short(fingerprint: str) -> str:
    return fingerprint if len(fingerprint) <= 23 else fingerprint[:23] + "..."
