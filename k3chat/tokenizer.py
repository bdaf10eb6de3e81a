"""K3 tokenizer: strict loader for tiktoken.model + tokenizer_config.json (spec k3-chat.md 3).

Special ids are discovered by name from the model's config, never from constants, so small
fixtures run the same code as the real 163,840-id vocabulary.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tiktoken
from k3engine.tokenizer_files import K3_PAT_STR

# Spec 3.3, verbatim; one copy, shared with the fixture tokenizer writer.
PAT_STR: str = K3_PAT_STR

# Spec 3.4 caps (code points), as tokenization_kimi.py applies them.
SLICE_CHARS: int = 400_000
RUN_CHARS: int = 25_000

SPECIAL_BLOCK: int = 256
MODEL_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
EOS = "[EOS]"
CONTROL_NAMES: tuple[str, ...] = (OPEN, CLOSE, SEP, END_OF_MSG, EOS)

# Spec 0: the official file; only then do we assert the official ids.
OFFICIAL_MODEL_SHA256 = "b6c497a7469b33ced9c38afb1ad6e47f03f5e5dc05f15930799210ec050c5103"
OFFICIAL_N_RANKS = 163_584
OFFICIAL_CONTROL_IDS: dict[str, int] = {
    OPEN: 163587,
    CLOSE: 163588,
    SEP: 163589,
    END_OF_MSG: 163586,
    EOS: 163585,
}


class TokenizerError(Exception):
    """The tokenizer files are unusable, or an id or name is not in the vocabulary."""


# ---------------------------------------------------------------------------------------
# Loading


def parse_tiktoken_model(data: bytes) -> dict[bytes, int]:
    """Strictly parse `base64 rank` lines (spec 3.1); refuse anything else with a reason."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the LF that ends the last line
    if not lines:
        raise TokenizerError(f"{MODEL_FILE}: the file is empty")
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for lineno, line in enumerate(lines, start=1):
        token, rank = _parse_line(line, lineno)
        if token in ranks:
            raise TokenizerError(f"{MODEL_FILE} line {lineno}: duplicate token (also rank {ranks[token]})")
        if rank in seen_ranks:
            raise TokenizerError(f"{MODEL_FILE} line {lineno}: duplicate rank {rank}")
        ranks[token] = rank
        seen_ranks.add(rank)
    _check_dense(seen_ranks)
    _check_bytes(ranks)
    return ranks


def _parse_line(line: bytes, lineno: int) -> tuple[bytes, int]:
    where = f"{MODEL_FILE} line {lineno}"
    if line == b"":
        raise TokenizerError(f"{where}: empty line")
    parts = line.split(b" ")
    if len(parts) != 2:
        raise TokenizerError(f"{where}: expected '<base64> <rank>' with one space, got {line[:60]!r}")
    b64, rank_text = parts
    try:
        token = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise TokenizerError(f"{where}: invalid base64 {b64[:60]!r} ({exc})") from None
    # Canonical form only, so one token has exactly one spelling.
    if base64.b64encode(token) != b64:
        raise TokenizerError(f"{where}: non-canonical base64 {b64[:60]!r}")
    if token == b"":
        raise TokenizerError(f"{where}: empty token")
    if not rank_text.isdigit() or (len(rank_text) > 1 and rank_text.startswith(b"0")):
        raise TokenizerError(f"{where}: rank must be a decimal integer, got {rank_text[:30]!r}")
    return token, int(rank_text)


def _check_dense(ranks: set[int]) -> None:
    n = len(ranks)
    if min(ranks) != 0 or max(ranks) != n - 1:
        missing = next((r for r in range(n) if r not in ranks), None)
        raise TokenizerError(
            f"{MODEL_FILE}: ranks are not exactly 0..{n - 1} (min {min(ranks)}, max {max(ranks)}, first missing {missing})"
        )


def _check_bytes(ranks: dict[bytes, int]) -> None:
    for b in range(256):
        if bytes([b]) not in ranks:
            raise TokenizerError(f"{MODEL_FILE}: missing the one-byte token 0x{b:02x}")


def parse_special_names(config: Any, n_ranks: int) -> dict[int, str]:
    """Name all 256 slots N..N+255 (spec 3.2); refuse a missing control name or a bad id."""
    if not isinstance(config, dict):
        raise TokenizerError(f"{CONFIG_FILE}: expected a JSON object")
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{CONFIG_FILE}: added_tokens_decoder must be an object")
    names = {i: f"<|reserved_token_{i}|>" for i in range(n_ranks, n_ranks + SPECIAL_BLOCK)}
    # Every entry counts, whatever its `special` flag says (spec 3.2).
    for key, entry in decoder.items():
        token_id = _entry_id(key, n_ranks)
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
            raise TokenizerError(f"{CONFIG_FILE}: added_tokens_decoder[{key!r}] needs a non-empty string 'content'")
        names[token_id] = entry["content"]
    _check_unique(names)
    present = set(names.values())
    for name in CONTROL_NAMES:
        if name not in present:
            raise TokenizerError(f"{CONFIG_FILE}: the control token {name} is missing from added_tokens_decoder")
    return names


def _entry_id(key: Any, n_ranks: int) -> int:
    if not isinstance(key, str) or not key.isdigit():
        raise TokenizerError(f"{CONFIG_FILE}: added_tokens_decoder key {key!r} is not a decimal id")
    token_id = int(key)
    if not n_ranks <= token_id < n_ranks + SPECIAL_BLOCK:
        raise TokenizerError(
            f"{CONFIG_FILE}: special id {token_id} is outside the block {n_ranks}..{n_ranks + SPECIAL_BLOCK - 1}"
        )
    return token_id


def _check_unique(names: dict[int, str]) -> None:
    owner: dict[str, int] = {}
    for token_id, name in sorted(names.items()):
        if name in owner:
            raise TokenizerError(f"{CONFIG_FILE}: the name {name!r} is used by ids {owner[name]} and {token_id}")
        owner[name] = token_id


# ---------------------------------------------------------------------------------------
# Chunking (spec 3.4)


def chunk_text(text: str) -> list[str]:
    """Cut text into the pieces tiktoken encodes alone: 400,000-char slices, 25,000-char runs."""
    pieces: list[str] = []
    for start in range(0, len(text), SLICE_CHARS):
        pieces.extend(_cut_runs(text[start : start + SLICE_CHARS]))
    return pieces


def _cut_runs(s: str) -> list[str]:
    """Cut before a character that would push a same-class (str.isspace) run past RUN_CHARS."""
    pieces: list[str] = []
    piece_start = 0
    run_len = 0
    run_space = s[0].isspace() if s else False
    for i, ch in enumerate(s):
        space = ch.isspace()
        if space != run_space:
            run_space, run_len = space, 1  # a class change starts a run but does not cut
        elif run_len == RUN_CHARS:
            pieces.append(s[piece_start:i])
            piece_start, run_len = i, 1
        else:
            run_len += 1
    pieces.append(s[piece_start:])
    return [p for p in pieces if p]


# ---------------------------------------------------------------------------------------
# The tokenizer


class Tokenizer:
    """Ranks 0..N-1 plus a 256-slot special block N..N+255 (spec 3.2)."""

    def __init__(self, ranks: dict[bytes, int], special_names: dict[int, str], *, name: str = "k3") -> None:
        self._n_ranks = len(ranks)
        self._names = dict(special_names)
        self._ids = {n: i for i, n in self._names.items()}
        self._id_bytes: list[bytes] = [b""] * self._n_ranks
        for token, rank in ranks.items():
            self._id_bytes[rank] = token
        self._enc = tiktoken.Encoding(
            name=name,
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self._ids,
            explicit_n_vocab=self._n_ranks + SPECIAL_BLOCK,
        )
        self.sha256: str | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tiktoken.model and tokenizer_config.json from a model or tokenizer directory."""
        d = Path(model_dir)
        model_path, config_path = d / MODEL_FILE, d / CONFIG_FILE
        for p in (model_path, config_path):
            if not p.is_file():
                raise TokenizerError(f"missing {p.name} in {d}")
        data = model_path.read_bytes()
        ranks = parse_tiktoken_model(data)
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"{CONFIG_FILE}: not valid JSON ({exc})") from None
        tok = cls(ranks, parse_special_names(config, len(ranks)), name=f"k3:{d}")
        tok.sha256 = hashlib.sha256(data).hexdigest()
        tok._check_official()
        return tok

    def _check_official(self) -> None:
        """With the official file, the discovered ids must be the published ones."""
        if self.sha256 != OFFICIAL_MODEL_SHA256:
            return
        if self._n_ranks != OFFICIAL_N_RANKS:
            raise TokenizerError(f"official {MODEL_FILE} but {self._n_ranks} ranks")
        for name, expected in OFFICIAL_CONTROL_IDS.items():
            if self._ids[name] != expected:
                raise TokenizerError(f"official {MODEL_FILE} but {name} is id {self._ids[name]}, expected {expected}")

    # -- sizes and specials --------------------------------------------------------------

    @property
    def n_ranks(self) -> int:
        return self._n_ranks

    @property
    def vocab_size(self) -> int:
        return self._n_ranks + SPECIAL_BLOCK

    @property
    def encoding(self) -> tiktoken.Encoding:
        return self._enc

    def engine_vocab_check(self, vocab_size: int) -> None:
        """Refuse an engine whose vocabulary is not N+256 (spec 3.2)."""
        if vocab_size != self.vocab_size:
            raise TokenizerError(
                f"tokenizer vocabulary {self._n_ranks}+{SPECIAL_BLOCK}={self.vocab_size} "
                f"does not match the engine's vocab_size {vocab_size}"
            )

    def special_id(self, name: str) -> int:
        try:
            return self._ids[name]
        except KeyError:
            raise TokenizerError(f"unknown special token {name!r}") from None

    def special_name(self, token_id: int) -> str:
        try:
            return self._names[token_id]
        except KeyError:
            raise TokenizerError(f"id {token_id} is not a special id") from None

    def is_special(self, token_id: int) -> bool:
        return token_id >= self._n_ranks

    @property
    def open_id(self) -> int:
        return self._ids[OPEN]

    @property
    def close_id(self) -> int:
        return self._ids[CLOSE]

    @property
    def sep_id(self) -> int:
        return self._ids[SEP]

    @property
    def end_of_msg_id(self) -> int:
        return self._ids[END_OF_MSG]

    @property
    def eos_id(self) -> int:
        return self._ids[EOS]

    @property
    def end_ids(self) -> frozenset[int]:
        """Either id ends a turn (spec 1.7: the sources disagree, we accept both)."""
        return frozenset({self.end_of_msg_id, self.eos_id})

    # -- encode / decode -----------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        """Encode a text segment: specials off, so typed control strings are ordinary ids."""
        ids: list[int] = []
        for piece in chunk_text(text):
            ids.extend(self._enc.encode(piece, allowed_special=set(), disallowed_special=()))
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of an ordinary id; special ids have no text bytes."""
        self._check_id(token_id)
        if self.is_special(token_id):
            raise TokenizerError(f"id {token_id} ({self._names[token_id]}) is special and has no text bytes")
        return self._id_bytes[token_id]

    def decode_bytes(self, ids: Iterable[int], *, show_special: bool = False) -> bytes:
        out = bytearray()
        for token_id in ids:
            self._check_id(token_id)
            if not self.is_special(token_id):
                out += self._id_bytes[token_id]
            elif show_special:
                out += self._names[token_id].encode("utf-8")
            else:
                raise TokenizerError(f"special id {token_id} ({self._names[token_id]}) in text to decode")
        return bytes(out)

    def decode(self, ids: Iterable[int], *, show_special: bool = False) -> str:
        """Decode as UTF-8 with replacement; special ids only appear as names in debug views."""
        return self.decode_bytes(ids, show_special=show_special).decode("utf-8", errors="replace")

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"id {token_id} is outside the vocabulary 0..{self.vocab_size - 1}")

    def stream_decoder(self, holdback: Sequence[Sequence[int]] = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self, holdback)


class IncrementalDecoder:
    """Streaming decode (spec 3.5).

    Holds back an incomplete UTF-8 tail and trailing ids that could still begin one of the
    `holdback` sequences (BOUNDARY, CLOSURE); never shows special ids.
    """

    def __init__(self, tokenizer: Tokenizer, holdback: Sequence[Sequence[int]] = ()) -> None:
        self._tok = tokenizer
        self._holdback = [tuple(seq) for seq in holdback if len(seq) > 0]
        self._held: list[int] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def held(self) -> tuple[int, ...]:
        return tuple(self._held)

    def push(self, token_id: int) -> str:
        """Add one id; return the text that is now safe to show."""
        self._tok._check_id(token_id)
        self._held.append(token_id)
        keep = self._longest_pending_prefix()
        release = self._held[: len(self._held) - keep]
        del self._held[: len(release)]
        return self._emit(release, final=False)

    def flush(self, *, drop_held: bool = False) -> str:
        """End of stream: release (or drop) the held ids and any incomplete UTF-8 tail."""
        release = [] if drop_held else self._held
        self._held = []
        return self._emit(release, final=True)

    def _longest_pending_prefix(self) -> int:
        """Length of the longest suffix of held ids that is a proper prefix of a holdback seq."""
        best = 0
        for seq in self._holdback:
            for k in range(min(len(seq) - 1, len(self._held)), best, -1):
                if tuple(self._held[-k:]) == seq[:k]:
                    best = k
                    break
        return best

    def _emit(self, ids: Iterable[int], *, final: bool) -> str:
        data = b"".join(self._tok._id_bytes[i] for i in ids if not self._tok.is_special(i))
        return self._utf8.decode(data, final=final)
