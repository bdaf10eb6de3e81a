"""Encrypted history at rest (opt-in per installation): the key file, the passphrase, and the
sealed formats of history records and engine state files.

Turning it on and off
---------------------
``k3chat sessions encrypt`` asks for a new passphrase (twice), writes the key file and converts
every session file, the index and every engine state file; ``k3chat sessions decrypt`` converts
them back and removes the key file. Each file is replaced atomically (temp file, fsync, rename),
so an interrupted conversion leaves every file either as it was or converted, never half; run
the same command again to finish (files already converted are skipped). Run either one while no
other k3chat process is open. While encryption is on, every k3chat command that reads or writes
the history asks for the passphrase once per process: from the file named by
``K3CHAT_PASSPHRASE_FILE`` (scripts, tests; its content minus one final newline), else on the
terminal (``/dev/tty``, no echo; three tries). With neither, or with a wrong passphrase, the
command stops with exit code 2 before anything is read or written. The chat app asks before its
screen starts. The passphrase cannot be recovered: without it (or without the key file) the
history cannot be read by anyone, us included.

Cryptography (all from the ``cryptography`` package)
----------------------------------------------------
- Cipher: AES-256-GCM, a fresh random 96-bit nonce for every record and every chunk.
- Key: a random 256-bit data key, stored wrapped (AES-256-GCM) under a key derived from the
  passphrase with scrypt, n = 2**17, r = 8, p = 1 (128 MiB of memory, about 0.5 s on the
  development machine), 16-byte random salt. The wrapped key's tag is the key check: a wrong
  passphrase fails to unwrap it and is refused before any history file is opened. Passphrases
  are NFC-normalised UTF-8 and must have at least 8 characters.
- Associated data binds every ciphertext to what it is: ``k3chat-vault``, the format version,
  the file kind (``session``, ``index``, ``state``) and the session (its id, or the state file's
  name). A record copied into another session, or a state file renamed to another session's,
  fails authentication.

Key file ``<data dir>/vault.json`` (0600, beside the ``sessions`` directory)::

    {"format": "k3chat-vault", "version": 1, "cipher": "AES-256-GCM",
     "kdf": {"name": "scrypt", "n": 131072, "r": 8, "p": 1, "salt": B64},
     "key": {"nonce": B64, "wrapped": B64}, "state": "on" | "encrypting" | "decrypting"}

``state`` says whether a conversion is under way (a command that finds one unfinished says to
run it again). The KDF parameters are read from the file (bounded, so a hostile file cannot ask
for unbounded memory); tests write key files with a lower ``n`` through ``create_key_file``,
the commands always use the default above.

History line (session files and ``sessions.json``): one JSON object per line,
``{"enc":1,"n":B64(nonce),"c":B64(ciphertext and tag)}``, whose plaintext is exactly the line
the unencrypted store would have written (without its newline). A damaged line fails its tag
and is reported and skipped like any damaged line; the other lines are unaffected.

Stream (engine state files, which can be gigabytes)::

    header   32 bytes: magic b"K3SEALED", version u32, chunk size u32 (1 MiB), stream id 16 bytes
    chunks   nonce 12 bytes | ciphertext | tag 16 bytes; every chunk but the last holds exactly
             one chunk size of plaintext, the last holds 0 .. chunk size

Each chunk's associated data is the binding above, the header, the chunk's index (u64) and a
final flag (u8), so a reordered, dropped, truncated or extended stream fails to open, and
truncation at a chunk boundary is named as such.

Threat model
------------
Protects: the content of conversations (messages, reasoning, session names, models, settings,
token counts) and of engine state files on a stolen or lost disk or laptop (powered off), a
backup, or a copied home directory, as long as the passphrase is not guessable. It also detects
damaged and swapped records.

Does not protect:
- a live compromised account or machine: while k3chat runs the key is in its memory, the
  passphrase can be keylogged, and the account can read the terminal and the process;
- metadata: the number of sessions and their ids (which contain their creation time, UTC to the
  second), which sessions have an engine state file, file sizes (each record's length is visible
  to within 3 bytes, so roughly the length of each message; a state file's to within 28 bytes
  per MiB, so roughly the conversation's length in tokens), the number of records and renames
  per session, file times (when each session was last written), and that encryption is on;
- plaintext written before ``encrypt``: converting replaces each file by rename, but the old
  blocks stay on the disk until reused (SSDs, journaling and copy-on-write file systems keep
  copies); only history written after ``encrypt`` never reaches the disk in plaintext;
- swap and hibernation images (encrypt swap), terminal scrollback, clipboard managers;
- exports (``sessions export -o``, the app's export, ``run --json``): plaintext by the user's
  choice, and said so on standard error;
- rollback: an attacker who can write the files can restore an older copy of a session file or
  drop whole records from its end (sequence numbers catch reordering within a file, not this);
  an attacker who can write your home can also change k3chat itself.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
import struct
import sys
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from k3chat import paths
from k3chat.runtime import EXIT_RUNTIME, EXIT_USAGE, Failure

KEY_FILE_NAME = "vault.json"
PASSPHRASE_ENV = "K3CHAT_PASSPHRASE_FILE"
FORMAT = "k3chat-vault"
FORMAT_VERSION = 1
CIPHER = "AES-256-GCM"

# scrypt: n = 2**17, r = 8 is 128 * n * r = 128 MiB and about half a second here.
KDF_N = 2**17
KDF_R = 8
KDF_P = 1
_KDF_MIN_N = 2**10  # tests only (through create_key_file); never a default
_KDF_MAX_MEMORY = 1 << 30  # refuse key files asking scrypt for more than 1 GiB
SALT_LEN = 16
KEY_LEN = 32
NONCE_LEN = 12
TAG_LEN = 16
MIN_PASSPHRASE_CHARS = 8
TERMINAL_TRIES = 3

# What a conversion is doing (the key file's "state").
STATE_ON = "on"
STATE_ENCRYPTING = "encrypting"
STATE_DECRYPTING = "decrypting"
_STATES = (STATE_ON, STATE_ENCRYPTING, STATE_DECRYPTING)

# File kinds bound into the associated data.
KIND_SESSION = "session"
KIND_INDEX = "index"
KIND_STATE = "state"

SEALED_LINE_PREFIX = b'{"enc":'
STREAM_MAGIC = b"K3SEALED"
_STREAM_HEADER = struct.Struct("<8sII16s")  # magic, version, chunk size, stream id
STREAM_CHUNK = 1 << 20
_MAX_STREAM_CHUNK = 64 << 20
_KEY_AD = b"k3chat-vault key v1"



class VaultError(Failure):
    """The encrypted history cannot be opened (no passphrase, a wrong one, a damaged key file).

    A runtime.Failure: ``code`` (also ``exit_code``) is what a command exits with, 2
    (configuration) unless an I/O failure.
    """

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message, exit_code)

    @property
    def exit_code(self) -> int:
        return self.code


class WrongPassphrase(VaultError):
    """The passphrase does not unwrap the key (the key check failed)."""


class SealError(Exception):
    """A sealed record or stream failed to open. The message says what (for a problem line);
    ``truncated`` is True when a stream is provably cut at a chunk boundary."""

    def __init__(self, message: str, *, truncated: bool = False) -> None:
        super().__init__(message)
        self.truncated = truncated


def key_file_beside(sessions_root: Path) -> Path:
    """The key file of the store at ``sessions_root``: ``vault.json`` in its parent (for the
    default store, ``<data dir>/vault.json``)."""
    return Path(sessions_root).parent / KEY_FILE_NAME


def installation_key_file() -> Path:
    return paths.data_dir() / KEY_FILE_NAME


def is_sealed_line(raw: bytes) -> bool:
    return raw.startswith(SEALED_LINE_PREFIX)


def has_sealed_line(data: bytes) -> bool:
    """Whether any line of ``data`` is a sealed record (so the file belongs to a vault)."""
    return data.startswith(SEALED_LINE_PREFIX) or b"\n" + SEALED_LINE_PREFIX in data


def is_sealed_stream(head: bytes) -> bool:
    return head.startswith(STREAM_MAGIC)


def _associated(kind: str, binding: str) -> bytes:
    # Length-prefixed parts, so no two (kind, binding) pairs give the same bytes.
    k, b = kind.encode("utf-8"), binding.encode("utf-8")
    return b"k3chat-vault\x00" + struct.pack("<IH", FORMAT_VERSION, len(k)) + k + struct.pack("<H", len(b)) + b


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"{what} is not valid base64") from exc


# --------------------------------------------------------------------------- the unlocked key


class Vault:
    """An unlocked data key and the key file it came from. Seals and opens records and streams."""

    def __init__(self, key: bytes, key_file: Path, doc: dict[str, Any]) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(key)
        self.key_file = Path(key_file)
        self._doc = doc

    @property
    def state(self) -> str:
        return str(self._doc.get("state", STATE_ON))

    def set_state(self, state: str) -> None:
        """Record what a conversion is doing, atomically (the key itself is unchanged)."""
        assert state in _STATES
        self._doc = {**self._doc, "state": state}
        _write_key_file(self.key_file, self._doc)

    # ---- one record

    def seal(self, plaintext: bytes | memoryview, associated: bytes) -> bytes:
        nonce = secrets.token_bytes(NONCE_LEN)
        return nonce + self._aead.encrypt(nonce, plaintext, associated)

    def open(self, blob: bytes, associated: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        if len(blob) < NONCE_LEN + TAG_LEN:
            raise SealError("encrypted record too short")
        try:
            return self._aead.decrypt(blob[:NONCE_LEN], blob[NONCE_LEN:], associated)
        except InvalidTag:
            raise SealError("encrypted record failed authentication (damaged, or moved here from "
                            "another session or file)") from None

    def seal_line(self, line: bytes, *, kind: str, binding: str) -> bytes:
        """One history line (without its newline) as a sealed JSON line (without a newline)."""
        blob = self.seal(line, _associated(kind, binding))
        doc = {"enc": FORMAT_VERSION, "n": _b64(blob[:NONCE_LEN]), "c": _b64(blob[NONCE_LEN:])}
        return json.dumps(doc, separators=(",", ":")).encode("ascii")

    def open_line(self, raw: bytes, *, kind: str, binding: str) -> bytes:
        """The plaintext line sealed in ``raw``; SealError says why it cannot be had."""
        if not is_sealed_line(raw):
            raise SealError("not an encrypted record although the history is encrypted")
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or set(doc) != {"enc", "n", "c"}:
                raise ValueError("unexpected fields")
            if doc["enc"] != FORMAT_VERSION:
                raise ValueError(f"unknown version {doc['enc']!r}")
            nonce, sealed = _unb64(doc["n"], "nonce"), _unb64(doc["c"], "ciphertext")
        except (ValueError, UnicodeDecodeError) as exc:
            raise SealError(f"damaged encrypted record ({exc})") from None
        if len(nonce) != NONCE_LEN:
            raise SealError("damaged encrypted record (bad nonce length)")
        return self.open(nonce + sealed, _associated(kind, binding))

    # ---- streams

    def seal_stream(self, pieces: Iterable[bytes | memoryview], *, kind: str, binding: str,
                    chunk_size: int = STREAM_CHUNK) -> Iterator[bytes]:
        """Sealed chunks of the concatenation of ``pieces``, header first. Pieces are pulled one
        at a time, so a caller's generator keeps its own pace (and its cancel checks)."""
        header = _STREAM_HEADER.pack(STREAM_MAGIC, FORMAT_VERSION, chunk_size, secrets.token_bytes(16))
        base = _associated(kind, binding) + header
        yield header
        pending = bytearray()
        index = 0
        for piece in pieces:
            view = memoryview(piece)
            # Emit a chunk only once more data is known to follow, so the last one is final.
            while len(pending) + len(view) > chunk_size:
                take = chunk_size - len(pending)
                if pending:
                    pending += view[:take]
                    yield self._seal_chunk(pending, base, index, final=False)
                    pending = bytearray()
                else:
                    yield self._seal_chunk(view[:take], base, index, final=False)
                view = view[take:]
                index += 1
            pending += view
        yield self._seal_chunk(pending, base, index, final=True)

    def _seal_chunk(self, plaintext: bytes | bytearray | memoryview, base: bytes, index: int, *,
                    final: bool) -> bytes:
        return self.seal(plaintext, base + struct.pack("<QB", index, final))

    def iter_stream(self, f: BinaryIO, *, kind: str, binding: str) -> Iterator[bytes]:
        """The plaintext chunks of the sealed stream read from ``f``, each verified before it
        is yielded; SealError on any damage, including truncation and trailing bytes."""
        header = f.read(_STREAM_HEADER.size)
        chunk_size = _stream_chunk_size(header)
        base = _associated(kind, binding) + header
        record = NONCE_LEN + chunk_size + TAG_LEN
        current = f.read(record)
        index = 0
        while True:
            following = f.read(record) if len(current) == record else b""
            final = not following
            if len(current) < NONCE_LEN + TAG_LEN:
                raise SealError(f"encrypted stream truncated inside chunk {index}", truncated=True)
            yield self._open_chunk(current, base, index, final)
            if final:
                return
            current, index = following, index + 1

    def _open_chunk(self, blob: bytes, base: bytes, index: int, final: bool) -> bytes:
        try:
            return self.open(blob, base + struct.pack("<QB", index, final))
        except SealError:
            if final:
                try:
                    self.open(blob, base + struct.pack("<QB", index, False))
                except SealError:
                    pass
                else:
                    raise SealError(f"encrypted stream truncated: it ends after chunk {index}, which is "
                                    "not its last", truncated=True) from None
            raise SealError(f"encrypted stream chunk {index} failed authentication (damaged, truncated, "
                            "or moved here from another session)") from None

    def read_stream(self, f: BinaryIO, *, kind: str, binding: str) -> bytearray:
        """The whole plaintext of a sealed stream, in one buffer sized from the file's length
        (a state of several gigabytes is held once, plus one chunk)."""
        start = f.tell()
        size = os.fstat(f.fileno()).st_size - start
        header = f.read(_STREAM_HEADER.size)
        f.seek(start)
        expected = _plaintext_size(size, _stream_chunk_size(header))
        out = bytearray(expected)
        pos = 0
        for chunk in self.iter_stream(f, kind=kind, binding=binding):
            out[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        if pos != expected:  # not reachable for a stream that authenticated; never trust a guess
            raise SealError(f"encrypted stream holds {pos} bytes, its length says {expected}")
        return out


def _stream_chunk_size(header: bytes) -> int:
    if len(header) < _STREAM_HEADER.size:
        if STREAM_MAGIC.startswith(header[: len(STREAM_MAGIC)]):
            raise SealError(f"encrypted stream ends inside its header ({len(header)} bytes)", truncated=True)
        raise SealError("not an encrypted stream (bad magic)")
    magic, version, chunk_size, _ = _STREAM_HEADER.unpack(header)
    if magic != STREAM_MAGIC:
        raise SealError("not an encrypted stream (bad magic)")
    if version != FORMAT_VERSION:
        raise SealError(f"encrypted stream version {version}, this build reads {FORMAT_VERSION}")
    if not 0 < chunk_size <= _MAX_STREAM_CHUNK:
        raise SealError(f"implausible chunk size {chunk_size}: the header is damaged")
    return int(chunk_size)


def _plaintext_size(size: int, chunk_size: int) -> int:
    """Plaintext bytes in a well-formed stream of ``size`` bytes (header included)."""
    body = max(0, size - _STREAM_HEADER.size)
    record = NONCE_LEN + chunk_size + TAG_LEN
    full, rest = divmod(body, record)
    chunks = full + (1 if rest else 0)
    return max(0, body - chunks * (NONCE_LEN + TAG_LEN))


# --------------------------------------------------------------------------- the key file


@dataclass(frozen=True)
class KdfParams:
    n: int
    r: int
    p: int
    salt: bytes


def _derive(passphrase: str, kdf: KdfParams) -> bytes:
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    secret = unicodedata.normalize("NFC", passphrase).encode("utf-8")
    return Scrypt(salt=kdf.salt, length=KEY_LEN, n=kdf.n, r=kdf.r, p=kdf.p).derive(secret)


def _kdf_problem(n: object, r: object, p: object) -> str | None:
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (n, r, p))
    if not ints:
        return "scrypt parameters must be integers"
    assert isinstance(n, int) and isinstance(r, int) and isinstance(p, int)
    if n < _KDF_MIN_N or n & (n - 1):
        return f"scrypt n must be a power of two >= {_KDF_MIN_N}, got {n}"
    if not (1 <= r <= 64 and 1 <= p <= 16):
        return f"scrypt r = {r}, p = {p} out of range"
    if 128 * n * r > _KDF_MAX_MEMORY:
        return f"scrypt n = {n}, r = {r} would need more than 1 GiB"
    return None


def _write_key_file(path: Path, doc: dict[str, Any]) -> None:
    paths.ensure_private_dir(path.parent)
    paths.atomic_write(path, (json.dumps(doc, indent=1) + "\n").encode("ascii"))


def create_key_file(path: Path, passphrase: str, *, n: int = KDF_N, r: int = KDF_R, p: int = KDF_P,
                    state: str = STATE_ENCRYPTING) -> Vault:
    """Write a new key file (0600) for a random data key wrapped under ``passphrase``.

    ``n``, ``r``, ``p`` exist for tests, which use a cheaper scrypt; the commands never pass them.
    """
    problem = _passphrase_problem(passphrase) or _kdf_problem(n, r, p)
    if problem is not None:
        raise VaultError(problem)
    path = Path(path)
    kdf = KdfParams(n, r, p, secrets.token_bytes(SALT_LEN))
    key = secrets.token_bytes(KEY_LEN)
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = secrets.token_bytes(NONCE_LEN)
    wrapped = AESGCM(_derive(passphrase, kdf)).encrypt(nonce, key, _KEY_AD)
    doc = {"format": FORMAT, "version": FORMAT_VERSION, "cipher": CIPHER,
           "kdf": {"name": "scrypt", "n": n, "r": r, "p": p, "salt": _b64(kdf.salt)},
           "key": {"nonce": _b64(nonce), "wrapped": _b64(wrapped)}, "state": state}
    _write_key_file(path, doc)
    vault = Vault(key, path, doc)
    _UNLOCKED[path] = (_fingerprint(doc), vault)
    return vault


def _read_key_file(path: Path) -> tuple[dict[str, Any], KdfParams, bytes, bytes]:
    """(document, KDF parameters, wrapped-key nonce, wrapped key); VaultError if damaged."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(1 << 16)
    except OSError as exc:
        raise VaultError(f"cannot read the key file {path}: {exc.strerror or exc}", EXIT_RUNTIME) from exc
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not a k3chat key file")
        if doc.get("version") != FORMAT_VERSION or doc.get("cipher") != CIPHER:
            raise ValueError(f"version {doc.get('version')!r} / cipher {doc.get('cipher')!r} is not "
                             f"what this build reads ({FORMAT_VERSION}, {CIPHER})")
        kdf, key = doc["kdf"], doc["key"]
        if kdf.get("name") != "scrypt":
            raise ValueError(f"unknown key derivation {kdf.get('name')!r}")
        problem = _kdf_problem(kdf.get("n"), kdf.get("r"), kdf.get("p"))
        if problem is not None:
            raise ValueError(problem)
        params = KdfParams(kdf["n"], kdf["r"], kdf["p"], _unb64(kdf.get("salt"), "salt"))
        nonce, wrapped = _unb64(key.get("nonce"), "key nonce"), _unb64(key.get("wrapped"), "wrapped key")
        if len(params.salt) < SALT_LEN or len(nonce) != NONCE_LEN or len(wrapped) != KEY_LEN + TAG_LEN:
            raise ValueError("wrong salt, nonce or key length")
        if doc.get("state", STATE_ON) not in _STATES:
            raise ValueError(f"unknown state {doc.get('state')!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise VaultError(f"the key file {path} is damaged ({exc}); restore it from a backup: without "
                         "it the encrypted history cannot be read") from None
    return doc, params, nonce, wrapped


def _fingerprint(doc: dict[str, Any]) -> str:
    return json.dumps({"kdf": doc.get("kdf"), "key": doc.get("key")}, sort_keys=True)


def unlock(path: Path, passphrase: str) -> Vault:
    """The vault of the key file at ``path``, or VaultError (wrong passphrase, damaged file)."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    path = Path(path)
    doc, kdf, nonce, wrapped = _read_key_file(path)
    try:
        key = AESGCM(_derive(passphrase, kdf)).decrypt(nonce, wrapped, _KEY_AD)
    except InvalidTag:
        raise WrongPassphrase(f"wrong passphrase for the encrypted history (key file {path}); nothing was "
                         "read or changed") from None
    vault = Vault(key, path, doc)
    _UNLOCKED[path] = (_fingerprint(doc), vault)
    return vault


# One unlock per process and key file: the app's worker threads and the CLI share it.
_UNLOCKED: dict[Path, tuple[str, Vault]] = {}


def cached(path: Path) -> Vault | None:
    """The vault this process already unlocked for ``path``, if the key file is unchanged."""
    entry = _UNLOCKED.get(Path(path))
    if entry is None:
        return None
    doc, _, _, _ = _read_key_file(Path(path))
    fingerprint, vault = entry
    if fingerprint != _fingerprint(doc):
        del _UNLOCKED[Path(path)]  # replaced by another encrypt: ask again
        return None
    vault._doc = doc  # the state may have moved on
    return vault


def forget(path: Path) -> None:
    _UNLOCKED.pop(Path(path), None)


def unlock_if_enabled(key_file: Path) -> Vault | None:
    """None when there is no key file (encryption off); else the unlocked vault, asking for the
    passphrase at most once per process (K3CHAT_PASSPHRASE_FILE, else the terminal)."""
    key_file = Path(key_file)
    if not key_file.exists():
        return None
    vault = cached(key_file)
    if vault is not None:
        return vault
    if os.environ.get(PASSPHRASE_ENV):
        return unlock(key_file, passphrase_from_file())
    _read_key_file(key_file)  # a damaged key file is said before the passphrase is asked
    for attempt in range(1, TERMINAL_TRIES + 1):
        try:
            return unlock(key_file, ask_terminal("k3chat: passphrase for the encrypted history: ",
                                                 purpose="the history is encrypted"))
        except WrongPassphrase:
            if attempt == TERMINAL_TRIES:
                raise
            _say_on_terminal("wrong passphrase, try again")
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- passphrases


def _passphrase_problem(passphrase: str) -> str | None:
    if len(unicodedata.normalize("NFC", passphrase)) < MIN_PASSPHRASE_CHARS:
        return f"the passphrase must have at least {MIN_PASSPHRASE_CHARS} characters"
    return None


def passphrase_from_file() -> str:
    """The passphrase in the file named by K3CHAT_PASSPHRASE_FILE (one final newline dropped)."""
    name = os.environ.get(PASSPHRASE_ENV, "")
    try:
        with open(name, "rb") as f:
            raw = f.read(1 << 16)
    except OSError as exc:
        raise VaultError(f"{PASSPHRASE_ENV} names {name!r}, which cannot be read: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise VaultError(f"the passphrase file {name!r} is not UTF-8 text") from None
    text = text[:-1] if text.endswith("\n") else text
    text = text[:-1] if text.endswith("\r") else text
    if not text:
        raise VaultError(f"the passphrase file {name!r} is empty")
    return text


def _open_terminal(purpose: str) -> None:
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        raise VaultError(f"{purpose} and there is no terminal to ask for it: set {PASSPHRASE_ENV} to a "
                         "file (mode 0600) that holds it") from None
    os.close(fd)


def ask_terminal(prompt: str, *, purpose: str = "a passphrase is needed") -> str:
    """Read a passphrase on the terminal without echo (getpass reads /dev/tty)."""
    import getpass
    import warnings

    _open_terminal(purpose)
    with warnings.catch_warnings():
        warnings.simplefilter("error", getpass.GetPassWarning)  # never fall back to an echoing stdin
        try:
            return getpass.getpass(prompt)
        except EOFError:
            raise VaultError("no passphrase given") from None
        except getpass.GetPassWarning:
            raise VaultError("cannot turn off echo on this terminal; refusing to read a passphrase there; "
                             f"use {PASSPHRASE_ENV}") from None


def _say_on_terminal(text: str) -> None:
    try:
        sys.stderr.write(f"k3chat: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def new_passphrase() -> str:
    """A new passphrase: the K3CHAT_PASSPHRASE_FILE file, else asked twice on the terminal."""
    if os.environ.get(PASSPHRASE_ENV):
        passphrase = passphrase_from_file()
    else:
        passphrase = ask_terminal("k3chat: new passphrase for the history: ",
                                  purpose="`sessions encrypt` needs a new passphrase")
        problem = _passphrase_problem(passphrase)
        if problem is not None:
            raise VaultError(f"{problem}; nothing was changed")
        again = ask_terminal("k3chat: the same passphrase again: ", purpose="the passphrase is asked twice")
        if again != passphrase:
            raise VaultError("the two passphrases differ; nothing was changed")
    problem = _passphrase_problem(passphrase)
    if problem is not None:
        raise VaultError(f"{problem}; nothing was changed")
    return passphrase


__all__ = ["Vault", "VaultError", "WrongPassphrase", "SealError", "create_key_file", "unlock", "unlock_if_enabled",
           "key_file_beside", "installation_key_file", "new_passphrase", "passphrase_from_file",
           "is_sealed_line", "has_sealed_line", "is_sealed_stream"]
