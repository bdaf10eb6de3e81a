"""Strict safetensors header and checkpoint reader (spec k3-model.md section 3.2).

Every shard is untrusted input: the C engine will seek and read at the offsets produced here,
so a header is accepted only if it describes exactly the bytes of its file (tiled, in bounds,
sizes matching dtype x shape). Nothing here reads tensor data except `read_tensor`, which
exists for Python-side checks (A_log padding, the oracle, tests).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import re
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CheckpointError

__all__ = [
    "DTYPE_SIZES", "INDEX_NAME", "SINGLE_NAME", "LANGUAGE_PREFIX",
    "TensorInfo", "ShardHeader", "Checkpoint",
    "read_header", "read_shard_header", "header_file_size", "index_shards", "open_checkpoint", "read_tensor",
    "strict_json_loads", "JSONStrictError", "warn_total_size_once",
]

log = logging.getLogger(__name__)

DTYPE_SIZES: dict[str, int] = {"U8": 1, "BF16": 2, "F16": 2, "F32": 4}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
LANGUAGE_PREFIX = "language_model."

MIN_HEADER = 2  # "{}"
MAX_HEADER = 100_000_000
MAX_NAME_BYTES = 512
# Offsets and sizes go to C as int64/off_t, so anything past 2^63-1 counts as overflow.
SIZE_LIMIT = 2**63 - 1

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # Unicode category Cc
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_DAMAGED = ("the file is damaged, truncated or not a safetensors file; re-download it (check "
            "its size against the release)")


# ---------------------------------------------------------------------------------------
# Strict JSON: duplicate keys and NaN/Infinity are refused (Python's json accepts both).
# ---------------------------------------------------------------------------------------


class JSONStrictError(ValueError):
    """The text is not strict JSON (syntax error, duplicate key, NaN/Infinity, too deep)."""


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONStrictError(f"duplicate key {key!r}")
            seen.add(key)
    return obj


def _refuse_constant(name: str) -> Any:
    raise JSONStrictError(f"non-standard constant {name} (JSON has no NaN or Infinity)")


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs_no_duplicates,
                            parse_constant=_refuse_constant)


def _raw_decode(text: str, start: int = 0) -> tuple[Any, int]:
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        raise JSONStrictError(f"invalid or truncated JSON: {exc.msg} at line {exc.lineno} "
                              f"column {exc.colno} (char {exc.pos})") from None
    except RecursionError:
        raise JSONStrictError("JSON nested too deeply") from None


def strict_json_loads(text: str) -> Any:
    """json.loads that refuses duplicate keys and NaN/Infinity; whitespace around is allowed."""
    start = len(text) - len(text.lstrip(" \t\r\n"))
    value, end = _raw_decode(text, start)
    if text[end:].strip(" \t\r\n"):
        raise JSONStrictError(f"extra data after the JSON value at char {end}")
    return value


# ---------------------------------------------------------------------------------------
# One shard header
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes are: `start` is the ABSOLUTE byte offset in `shard`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str  # bare file name inside the checkpoint directory
    start: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True)
class ShardHeader:
    """A validated header: tensors (all of them, vision included), metadata and sizes."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    header_len: int  # N
    file_size: int

    @property
    def data_start(self) -> int:
        return 8 + self.header_len


class _Refusal(Exception):
    """Internal: a rule violation; the caller adds the file name."""


def name_problem(name: str) -> str | None:
    """Why a tensor name is unacceptable (rule 2), or None."""
    if name and len(name) <= MAX_NAME_BYTES and name.isascii() and name.isprintable():
        return None  # fast path: printable ASCII is one byte per char, no controls
    if not name:
        return "an empty tensor name"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return f"tensor name {name[:60]!r} holds an unpaired surrogate escape"
    if size > MAX_NAME_BYTES:
        return f"tensor name {name[:60]!r}... is {size} bytes (limit {MAX_NAME_BYTES})"
    if _CONTROL.search(name):
        return f"tensor name {name[:80]!r} contains control characters"
    return None


class _Pairs(list):  # type: ignore[type-arg]
    """A JSON object as its key/value pairs, in file order, duplicates kept.

    Used as the header decoder's object_pairs_hook: a C-level constructor, so the half
    million entry objects of a real checkpoint cost no Python call, and duplicate keys are
    still visible to the validation below. A distinct type keeps `{}` apart from `[]`.
    """

    __slots__ = ()


_HEADER_DECODER = json.JSONDecoder(object_pairs_hook=_Pairs, parse_constant=_refuse_constant)


def _parse_header_json(raw: bytes) -> _Pairs:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Refusal(f"header is not valid UTF-8 ({exc.reason} at header byte {exc.start})")
    if not text.startswith("{"):
        raise _Refusal("header does not start with '{' (not a safetensors JSON header)")
    try:
        value, end = _HEADER_DECODER.raw_decode(text)
    except json.JSONDecodeError as exc:
        raise _Refusal(f"header is invalid or truncated JSON: {exc.msg} at header char "
                       f"{exc.pos}")
    except JSONStrictError as exc:
        raise _Refusal(f"header is not acceptable JSON: {exc}")
    except RecursionError:
        raise _Refusal("header JSON is nested too deeply")
    if text[end:].strip(" "):
        raise _Refusal(f"trailing garbage after the header JSON at header char {end} "
                       f"(only 0x20 padding is allowed)")
    return value


def _show(value: Any) -> str:
    """A decoded header value as the user wrote it (objects come back as _Pairs)."""
    if type(value) is _Pairs:
        return "{" + ", ".join(f"{k!r}: {_show(v)}" for k, v in value) + "}"
    if type(value) is list:
        return "[" + ", ".join(_show(v) for v in value) + "]"
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _checked_metadata(value: Any) -> dict[str, str]:
    if type(value) is not _Pairs:
        raise _Refusal(f"__metadata__ must be an object, got {_show(value)}")
    meta = dict(value)
    if len(meta) != len(value):
        raise _Refusal("__metadata__ has a duplicate key")
    if not all(type(v) is str for v in meta.values()):
        raise _Refusal("__metadata__ must map strings to strings")
    return meta


def _entry_fields(name: str, value: Any) -> tuple[Any, Any, Any]:
    """(dtype, shape, data_offsets) of an entry that has exactly those three keys (rule 3)."""
    if type(value) is _Pairs and len(value) == 3:
        (k0, dtype), (k1, shape), (k2, offsets) = value
        if k0 == "dtype" and k1 == "shape" and k2 == "data_offsets":
            return dtype, shape, offsets  # the order every writer uses
        fields = dict(value)
        if fields.keys() == _ENTRY_KEYS:
            return fields["dtype"], fields["shape"], fields["data_offsets"]
    keys = [k for k, _ in value] if type(value) is _Pairs else _show(value)
    raise _Refusal(f"tensor {name!r}: entry must have exactly the keys dtype, shape and "
                   f"data_offsets (once each), got {keys}")


def _byte_size(name: str, dtype: Any, shape: Any) -> int:
    """numel * element size with overflow checks (rules 4 and 5)."""
    size = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if size is None:
        raise _Refusal(f"tensor {name!r}: dtype {_show(dtype)} is not supported "
                       f"(only {', '.join(DTYPE_SIZES)})")
    if type(shape) is not list:
        raise _Refusal(f"tensor {name!r}: shape {_show(shape)} must be a list")
    numel = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:  # `type is int` also refuses booleans
            raise _Refusal(f"tensor {name!r}: shape {_show(shape)} must hold non-negative "
                           f"integers")
        numel *= dim
        if numel > SIZE_LIMIT:
            raise _Refusal(f"tensor {name!r}: shape {_show(shape)} overflows 64-bit sizes")
    nbytes = numel * size
    if nbytes > SIZE_LIMIT:
        raise _Refusal(f"tensor {name!r}: shape {_show(shape)} x {dtype} overflows 64-bit "
                       f"sizes")
    return nbytes


def _span(name: str, what: str, offsets: Any, nbytes: int, data_start: int,
          file_size: int) -> int:
    """Validate data_offsets (rule 6); return the relative begin."""
    if (type(offsets) is not list or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
        raise _Refusal(f"tensor {name!r}: data_offsets {_show(offsets)} must be [begin, end] "
                       f"integers with 0 <= begin <= end")
    begin, end = offsets
    if end - begin != nbytes:
        raise _Refusal(f"tensor {name!r}: span [{begin}, {end}) is {end - begin} bytes but "
                       f"{what} needs {nbytes}")
    if data_start + end > file_size:
        raise _Refusal(f"tensor {name!r}: span ends at file byte {data_start + end}, past "
                       f"the end of the file ({file_size} bytes)")
    return begin


def check_names(names: list[str]) -> None:
    """Refuse the first bad name (rule 2). One C-level pass covers the usual all-ASCII case."""
    joined = "".join(names)
    if joined.isascii() and joined.isprintable() and (
            not names or (min(map(len, names)) > 0 and max(map(len, names)) <= MAX_NAME_BYTES)):
        return
    for name in names:
        problem = name_problem(name)
        if problem:
            raise _Refusal(problem)


def _check_unique(names: list[str]) -> None:
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise _Refusal(f"duplicate key {name!r}: it is described twice")
            seen.add(name)


def _slow_entry(name: str, value: Any, data_start: int,
                file_size: int) -> tuple[str, list[int], int, int]:
    """Full rule-by-rule check with precise messages; returns (dtype, shape, begin, nbytes)."""
    dtype, shape, offsets = _entry_fields(name, value)
    nbytes = _byte_size(name, dtype, shape)
    what = f"{dtype} x {_show(shape)}"
    begin = _span(name, what, offsets, nbytes, data_start, file_size)
    return dtype, shape, begin, nbytes


_INT_ONLY = frozenset((int,))


def _entries(pairs: _Pairs, shard: str, data_start: int,
             file_size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate every header entry (rules 2-6); return (tensors, metadata).

    The loop inlines a fast path for well-formed entries (half a million in the real
    model); anything unusual goes through `_slow_entry`, which applies the same rules one
    by one and explains the refusal.
    """
    names = [pair[0] for pair in pairs]
    check_names(names)
    _check_unique(names)
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    sizes, limit, prod, info = DTYPE_SIZES, SIZE_LIMIT, math.prod, TensorInfo
    for name, value in pairs:
        if name == "__metadata__":
            metadata = _checked_metadata(value)
            continue
        fast = False
        if type(value) is _Pairs and len(value) == 3:
            (k0, dtype), (k1, shape), (k2, offsets) = value
            if (k0 == "dtype" and k1 == "shape" and k2 == "data_offsets"
                    and type(dtype) is str and dtype in sizes
                    and type(shape) is list and set(map(type, shape)) <= _INT_ONLY
                    and min(shape, default=1) > 0  # zero dims: slow path (checked product)
                    and type(offsets) is list and len(offsets) == 2):
                nbytes = prod(shape) * sizes[dtype]
                begin, end = offsets
                fast = (nbytes <= limit and type(begin) is int and type(end) is int
                        and 0 <= begin and end - begin == nbytes
                        and data_start + end <= file_size)
        if not fast:
            dtype, shape, begin, nbytes = _slow_entry(name, value, data_start, file_size)
        tensors[name] = info(name, dtype, tuple(shape), shard, data_start + begin, nbytes)
    return tensors, metadata


def _check_tiling(infos: Iterable[TensorInfo], data_start: int, file_size: int) -> None:
    """Sorted by offset, spans must touch exactly and end at EOF (rule 7)."""
    pos = data_start
    prev = "the header"
    for info in sorted(infos, key=lambda t: (t.start, t.nbytes)):
        if info.start < pos:
            raise _Refusal(f"tensor {info.name!r} overlaps {prev} "
                           f"(starts at data byte {info.start - data_start}, "
                           f"{prev} ends at {pos - data_start})")
        if info.start > pos:
            raise _Refusal(f"gap of {info.start - pos} bytes before tensor {info.name!r} "
                           f"(data bytes {pos - data_start}..{info.start - data_start})")
        pos = info.end
        prev = f"tensor {info.name!r}"
    if pos != file_size:
        raise _Refusal(f"{file_size - pos} trailing bytes after the last tensor "
                       f"(tensor data ends at file byte {pos}, the file has {file_size})")


def _read_prefix(path: Path) -> tuple[int, bytes, int]:
    """Return (N, header bytes, file size), enforcing rule 1."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8:
                raise _Refusal(f"file is {size} bytes, too short for the 8-byte header length")
            (n,) = struct.unpack("<Q", fh.read(8))
            if not MIN_HEADER <= n <= MAX_HEADER:
                raise _Refusal(f"header length N = {n} is outside {MIN_HEADER}..{MAX_HEADER}")
            if 8 + n > size:
                raise _Refusal(f"header length N = {n} runs past the end of the file "
                               f"({size} bytes)")
            raw = fh.read(n)
    except OSError as exc:
        raise _Refusal(f"cannot read: {exc.strerror or exc}") from None
    if len(raw) != n:
        raise _Refusal(f"short read of the header ({len(raw)} of {n} bytes)")
    return n, raw, size


def read_shard_header(path: str | Path) -> ShardHeader:
    """Read and validate one safetensors file's header; raise CheckpointError naming the file."""
    path = Path(path)
    try:
        n, raw, size = _read_prefix(path)
        pairs = _parse_header_json(raw)
        tensors, metadata = _entries(pairs, path.name, 8 + n, size)
        _check_tiling(tensors.values(), 8 + n, size)
    except _Refusal as exc:
        raise CheckpointError(f"{path}: {exc}; {_DAMAGED}") from None
    return ShardHeader(path, tensors, metadata, n, size)


def header_file_size(path: str | Path) -> int:
    """The file size a safetensors header describes: 8 + N + the end of its last tensor.

    The header is checked by the same rules as read_shard_header except the end of the
    file, so a truncated or padded file is measured rather than refused (`k3chat verify`
    reports it as the wrong size); raise CheckpointError naming the file otherwise."""
    path = Path(path)
    try:
        n, raw, _ = _read_prefix(path)
        tensors, _ = _entries(_parse_header_json(raw), path.name, 8 + n, SIZE_LIMIT)
    except _Refusal as exc:
        raise CheckpointError(f"{path}: {exc}; {_DAMAGED}") from None
    return max((t.end for t in tensors.values()), default=8 + n)


def index_shards(index: str | Path) -> list[str]:
    """The shard file names an index lists, sorted; the index is checked as when opened."""
    weight_map, _ = _read_index(Path(index))
    return sorted(set(weight_map.values()))


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Validated tensors of one safetensors file (every name, vision included)."""
    return read_shard_header(path).tensors


# ---------------------------------------------------------------------------------------
# Whole checkpoint: sharded (with index) or a single model.safetensors
# ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class Checkpoint:
    """Validated headers of a checkpoint directory.

    `tensors` holds only `language_model.*` names that were found in present shards.
    `assigned` is what the index promises for `language_model.*` names (shard per name),
    so `catalog.bind` can name the shard of a missing tensor.
    """

    dir: Path
    shards: list[str]  # present shards holding language_model tensors, sorted by name
    tensors: dict[str, TensorInfo]
    assigned: dict[str, str]
    listed_shards: list[str] = field(default_factory=list)  # every shard named by the index
    missing_shards: list[str] = field(default_factory=list)  # listed but not on disk
    total_size: int | None = None  # index metadata.total_size, if given
    metadata: dict[str, dict[str, str]] = field(default_factory=dict)  # per-shard __metadata__
    file_sizes: dict[str, int] = field(default_factory=dict)  # per opened shard, as validated
    sharded: bool = True
    shard_total: int | None = None  # tensor bytes of every listed shard, when all are present

    @property
    def total_size_problem(self) -> str | None:
        """The index's metadata.total_size against the shards' bytes, when they differ."""
        if self.total_size is None or self.shard_total is None:
            return None
        if self.total_size == self.shard_total:
            return None
        return (f"{self.dir / INDEX_NAME}: metadata.total_size is {self.total_size} but the "
                f"shards hold {self.shard_total} tensor bytes")

    def path(self, shard: str) -> Path:
        if shard not in self.listed_shards:
            raise CheckpointError(f"{self.dir}: {shard!r} is not a shard of this checkpoint")
        return self.dir / shard

    def shard_id(self, shard: str) -> int:
        """Position of `shard` in `.shards` (what the C tensor table stores)."""
        return self.shards.index(shard)


def shard_name_problem(shard: Any) -> str | None:
    """Why an index value is not a bare shard file name (rule 9), or None."""
    if not isinstance(shard, str) or not shard:
        return f"shard {shard!r} must be a non-empty file name"
    if "/" in shard or "\\" in shard or ".." in shard:
        return f"shard {shard!r} must be a bare file name (no '/', '\\\\' or '..')"
    if _CONTROL.search(shard) or len(shard.encode("utf-8", "replace")) > 255:
        return f"shard {shard!r} is not a valid file name"
    return None


def _read_index(path: Path) -> tuple[dict[str, str], int | None]:
    """Parse model.safetensors.index.json strictly; return (weight_map, total_size)."""
    def refuse(reason: str) -> CheckpointError:
        return CheckpointError(f"{path}: {reason}; re-download the index from the release")

    try:
        root = strict_json_loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise refuse(f"cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise refuse(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except JSONStrictError as exc:
        raise refuse(f"not acceptable JSON: {exc}") from None
    if not isinstance(root, dict) or not isinstance(root.get("weight_map"), dict):
        raise refuse("must be a JSON object with a 'weight_map' object")
    weight_map: dict[str, Any] = root["weight_map"]
    try:
        check_names(list(weight_map))
    except _Refusal as exc:
        raise refuse(f"weight_map: {exc}") from None
    for name, shard in weight_map.items():
        if type(shard) is not str:
            raise refuse(f"weight_map entry {name[:80]!r}: {shard_name_problem(shard)}")
    # ~100 distinct shard names for half a million entries: check each name once.
    for shard in set(weight_map.values()):
        problem = shard_name_problem(shard)
        if problem:
            name = next(n for n, s in weight_map.items() if s == shard)
            raise refuse(f"weight_map entry {name[:80]!r}: {problem}")
    total: int | None = None
    meta = root.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise refuse("'metadata' must be a JSON object")
        total = meta.get("total_size")
        if total is not None and (type(total) is not int or total < 0):
            raise refuse(f"metadata.total_size must be a non-negative integer, got {total!r}")
    return weight_map, total


def _check_unique_across(headers: dict[str, ShardHeader]) -> None:
    """Rule 8: a name may live in one shard only."""
    owner: dict[str, str] = {}
    for shard, header in headers.items():
        for name in header.tensors:
            first = owner.setdefault(name, shard)
            if first != shard:
                raise CheckpointError(
                    f"tensor {name!r} appears in both {first} and {shard}; names must be unique "
                    f"across shards. One of the files is stale or foreign: re-download both")


def _sample(names: Iterable[str], limit: int = 5) -> str:
    items = sorted(names)
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(repr(n) for n in items[:limit]) + more


def _check_against_index(shard: str, header: ShardHeader, want: list[str], index: Path) -> None:
    """Rule 9: an opened shard holds exactly the names the index assigns to it."""
    got, wanted = header.tensors.keys(), set(want)
    if len(got) == len(want) and got == wanted:
        return
    lacking = wanted - got
    unexpected = got - wanted
    parts = []
    if lacking:
        parts.append(f"lacks {len(lacking)} tensor(s) the index assigns to it: {_sample(lacking)}")
    if unexpected:
        parts.append(f"holds {len(unexpected)} tensor(s) the index does not assign to it: "
                     f"{_sample(unexpected)}")
    raise CheckpointError(f"{header.path}: header does not match {index.name}: "
                          f"{'; '.join(parts)}. The shard and the index come from different "
                          f"releases or the shard is damaged: re-download it")


def _language(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    return {n: t for n, t in tensors.items() if n.startswith(LANGUAGE_PREFIX)}


def _open_sharded(model_dir: Path, index: Path) -> Checkpoint:
    weight_map, total = _read_index(index)
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    listed = sorted(by_shard)
    headers: dict[str, ShardHeader] = {}
    missing: list[str] = []
    for shard in listed:
        path = model_dir / shard
        if path.exists():
            headers[shard] = read_shard_header(path)
        else:
            missing.append(shard)  # fine for vision-only shards; bind() reports the rest
    _check_unique_across(headers)
    for shard, header in headers.items():
        _check_against_index(shard, header, by_shard[shard], index)
    # A wrong total is not refused here: published indexes sometimes carry one. Whoever has
    # checked every tensor's shape and dtype reports it (warn_total_size_once).
    actual = None if missing else sum(t.nbytes for h in headers.values()
                                      for t in h.tensors.values())
    tensors: dict[str, TensorInfo] = {}
    for header in headers.values():
        tensors.update(_language(header.tensors))
    return Checkpoint(
        dir=model_dir,
        shards=sorted({t.shard for t in tensors.values()}),
        tensors=tensors,
        assigned={n: s for n, s in weight_map.items() if n.startswith(LANGUAGE_PREFIX)},
        listed_shards=listed,
        missing_shards=missing,
        total_size=total,
        metadata={s: h.metadata for s, h in headers.items()},
        file_sizes={s: h.file_size for s, h in headers.items()},
        sharded=True,
        shard_total=actual,
    )


def _open_single(model_dir: Path, single: Path) -> Checkpoint:
    header = read_shard_header(single)
    tensors = _language(header.tensors)
    return Checkpoint(
        dir=model_dir,
        shards=[SINGLE_NAME] if tensors else [],
        tensors=tensors,
        assigned={n: SINGLE_NAME for n in tensors},
        listed_shards=[SINGLE_NAME],
        missing_shards=[],
        total_size=None,
        metadata={SINGLE_NAME: header.metadata},
        file_sizes={SINGLE_NAME: header.file_size},
        sharded=False,
    )


_TOTALS_WARNED: set[tuple[str, int | None, int | None]] = set()


def warn_total_size_once(ckpt: Checkpoint) -> None:
    """Warn (once per process and checkpoint) that the index's total_size is wrong.

    Call it only after every tensor was found with its shape and dtype: then the shards are
    the ones the config describes and only the index's total is off, so the model is used.
    """
    problem = ckpt.total_size_problem
    key = (str(ckpt.dir), ckpt.total_size, ckpt.shard_total)
    if problem is None or key in _TOTALS_WARNED:
        return
    _TOTALS_WARNED.add(key)
    log.warning("warning: %s; every tensor was found with its shape and dtype, so the "
                "index's total is taken as wrong and the checkpoint is used", problem)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: parsing half a million header entries creates millions of
    acyclic containers, and repeated full collections over them more than double the
    open time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def open_checkpoint(model_dir: str | Path) -> Checkpoint:
    """Validate the index (if any) and every present shard header of `model_dir`."""
    with _gc_paused():
        return _open_checkpoint(Path(model_dir))


def _open_checkpoint(model_dir: Path) -> Checkpoint:
    index, single = model_dir / INDEX_NAME, model_dir / SINGLE_NAME
    if index.exists() and single.exists():
        raise CheckpointError(
            f"{model_dir}: holds both {INDEX_NAME} and {SINGLE_NAME}, so it is ambiguous which "
            f"checkpoint to load; remove the one that does not belong")
    if index.exists():
        return _open_sharded(model_dir, index)
    if single.exists():
        return _open_single(model_dir, single)
    raise CheckpointError(
        f"{model_dir}: no checkpoint found (expected {INDEX_NAME} with its shards, or "
        f"{SINGLE_NAME}); point k3chat at the directory holding the downloaded release")


# ---------------------------------------------------------------------------------------
# Data access for Python-side checks (the C engine does its own I/O)
# ---------------------------------------------------------------------------------------

_NUMPY_LE = {"U8": "u1", "F16": "<f2", "F32": "<f4"}


def read_tensor(ckpt: Checkpoint, info: TensorInfo) -> np.ndarray:
    """Read one tensor's bytes; BF16 is widened exactly to float32, the rest kept as stored."""
    path = ckpt.path(info.shard)
    with open(path, "rb") as fh:
        fh.seek(info.start)
        raw = fh.read(info.nbytes)
    if len(raw) != info.nbytes:
        raise CheckpointError(f"{path}: short read of {info.name!r} ({len(raw)} of "
                              f"{info.nbytes} bytes at offset {info.start}); the file changed "
                              f"or is damaged: re-download it")
    if info.dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(info.shape)
    return np.frombuffer(raw, dtype=_NUMPY_LE[info.dtype]).reshape(info.shape).copy()
