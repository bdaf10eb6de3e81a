"""Low-level safetensors checkpoint writer (spec k3-model.md section 3).

The reference `safetensors` library decides the order of tensors inside a file by
itself; the fixtures need to control it (contiguous trunk and expert runs, a shuffled
expert order, and a deliberately scrambled twin), so this module writes the format
directly:

    u64 little-endian N | N bytes of header JSON (space padded) | tensor data

`data_offsets` are relative to the end of the header, the spans tile the data
section in exactly the order the caller gives, and the header is padded with spaces
to a multiple of 8 so the data section starts 8-aligned (as the reference writer
does).

It also provides BF16 conversion (numpy has no bfloat16) and the MXFP4 expert
checks the fixture generator must pass before anything is written.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from .private_files import make_private_dirs, open_private, write_private

DTYPE_SIZES: dict[str, int] = {"U8": 1, "BF16": 2, "F16": 2, "F32": 4}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# The six tensors of one routed expert, in the order the release stores them.
EXPERT_PARTS: tuple[str, ...] = (
    "w1.weight_packed",
    "w1.weight_scale",
    "w2.weight_packed",
    "w2.weight_scale",
    "w3.weight_packed",
    "w3.weight_scale",
)
_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.block_sparse_moe\.experts\.(?P<e>\d+))\.(?P<part>w[123]\.weight_(packed|scale))$")


class WriterError(ValueError):
    """The writer refuses to produce a file (bad tensor, bad expert, bad layout)."""


# --------------------------------------------------------------------------- BF16


def _f64_to_f32_round_to_odd(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 bits with round-to-odd.

    Rounding float64 straight to float32 (nearest-even) and then to bf16 can round
    twice in the same direction across a tie (double rounding). Rounding to odd first
    keeps a sticky bit in the lowest float32 mantissa bit; with 16 spare bits the
    following nearest-even step to bf16 then equals a single correct rounding.
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)
    bits = f.view(np.uint32).copy()
    finite = np.isfinite(x)
    # Nearest rounding may have gone away from zero (including to inf): step back
    # one ulp in magnitude; the bit pattern of a float is monotone in |value|.
    away = finite & (np.abs(f.astype(np.float64)) > np.abs(x))
    bits[away] -= np.uint32(1)
    exact = finite & (bits.view(np.float32).astype(np.float64) == x)
    sticky = finite & ~exact
    bits[sticky] |= np.uint32(1)
    return bits


def bf16_bits(x: np.ndarray | Sequence[float] | float) -> np.ndarray:
    """Round float values to bfloat16 (nearest, ties to even) and return the uint16 bits.

    float64 input is rounded once, exactly (see `_f64_to_f32_round_to_odd`); float32
    and narrower input is taken as is. Infinities stay infinite, overflow goes to
    infinity, and any NaN becomes a quiet NaN with its sign kept (a NaN whose payload
    sits only in the low 16 bits would otherwise turn into infinity).
    """
    arr = np.asarray(x)
    if arr.dtype == np.float64 or not np.issubdtype(arr.dtype, np.floating):
        bits = _f64_to_f32_round_to_odd(arr.astype(np.float64))
    else:
        bits = arr.astype(np.float32).view(np.uint32).copy()
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    # Adding 0x7FFF plus the kept LSB rounds to nearest with ties to even; a carry
    # out of the mantissa bumps the exponent, which is the correct result (up to inf).
    rounded = (bits.astype(np.uint64) + np.uint64(0x7FFF) + lsb.astype(np.uint64)) >> np.uint64(16)
    out = rounded.astype(np.uint16)
    out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out.reshape(arr.shape)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 bits exactly to float32 (bits << 16)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """The float64 value each element takes once stored as BF16."""
    return bf16_to_f32(bf16_bits(x)).astype(np.float64)


# ------------------------------------------------------------------------ tensors


@dataclass(frozen=True)
class Tensor:
    """One tensor ready to be written: little-endian bytes plus dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise WriterError(f"{self.name}: dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if not self.name or len(self.name.encode()) > 512 or any(ord(c) < 0x20 for c in self.name):
            raise WriterError(f"bad tensor name {self.name!r}")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise WriterError(f"{self.name}: bad shape {self.shape}")
        want = int(np.prod(self.shape, dtype=np.int64)) * DTYPE_SIZES[self.dtype]
        if len(self.data) != want:
            raise WriterError(f"{self.name}: {len(self.data)} data bytes, shape {self.shape} {self.dtype} needs {want}")

    @property
    def nbytes(self) -> int:
        return len(self.data)


def bf16_tensor(name: str, values: np.ndarray) -> Tensor:
    """A BF16 tensor from float values (rounded to nearest even)."""
    arr = np.asarray(values)
    return Tensor(name, "BF16", tuple(int(d) for d in arr.shape), bf16_bits(arr).astype("<u2").tobytes())


def f32_tensor(name: str, values: np.ndarray) -> Tensor:
    """An F32 tensor (float64 input is rounded by numpy, nearest-even)."""
    arr = np.asarray(values, dtype="<f4")
    return Tensor(name, "F32", tuple(int(d) for d in arr.shape), arr.tobytes())


def u8_tensor(name: str, values: np.ndarray) -> Tensor:
    arr = np.asarray(values)
    if arr.dtype != np.uint8:
        raise WriterError(f"{name}: U8 tensor needs uint8 data, got {arr.dtype}")
    return Tensor(name, "U8", tuple(int(d) for d in arr.shape), arr.tobytes())


# ------------------------------------------------------------------ safetensors


def encode_header(tensors: Sequence[Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """The header JSON (space padded to a multiple of 8) for tensors laid out in order.

    Header keys are sorted by name, as the reference writer does, so key order says
    nothing about data order: readers must use `data_offsets`.
    """
    entries: dict[str, object] = {}
    offset = 0
    spans: dict[str, list[int]] = {}
    for t in tensors:
        if t.name in spans or t.name == "__metadata__":
            raise WriterError(f"duplicate tensor name {t.name!r}")
        spans[t.name] = [offset, offset + t.nbytes]
        offset += t.nbytes
    if metadata is not None:
        entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    by_name = {t.name: t for t in tensors}
    for name in sorted(by_name):
        t = by_name[name]
        entries[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": spans[name]}
    raw = json.dumps(entries, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(path: Path | str, tensors: Sequence[Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write one safetensors file with the tensors' data in exactly the given order.

    Returns the file size. Written to a temporary name first and renamed, so a
    crash never leaves a half-written shard under the real name.
    """
    path = Path(path)
    header = encode_header(tensors, metadata)
    tmp = path.with_name(path.name + ".tmp")
    with open_private(tmp) as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for t in tensors:
            f.write(t.data)
    os.replace(tmp, path)
    return path.stat().st_size


def shard_name(index: int, total: int) -> str:
    """Real naming: five-digit one-based index, six-digit total."""
    return f"model-{index:05d}-of-{total:06d}.safetensors"


def _check_unique(shards: Sequence[Sequence[Tensor]]) -> None:
    seen: set[str] = set()
    for shard in shards:
        for t in shard:
            if t.name in seen:
                raise WriterError(f"tensor {t.name!r} appears twice in the checkpoint")
            seen.add(t.name)


def write_sharded(
    out_dir: Path | str, shards: Sequence[Sequence[Tensor]], metadata: Mapping[str, str] | None = None
) -> list[Path]:
    """Write shards `model-NNNNN-of-NNNNNN.safetensors` plus `model.safetensors.index.json`.

    `shards[i]` becomes shard i+1, its tensors in the given order. The index holds
    `metadata.total_size` (the sum of tensor bytes, headers excluded) and a weight_map
    sorted by name. Routed expert tensors are checked first (`check_experts`).
    """
    out = make_private_dirs(out_dir)
    _check_unique(shards)
    check_experts([t for shard in shards for t in shard])
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = shard_name(i + 1, len(shards))
        write_safetensors(out / name, shard, metadata)
        paths.append(out / name)
        for t in shard:
            weight_map[t.name] = name
            total += t.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_private(out / INDEX_NAME, json.dumps(index, indent=2) + "\n")
    return paths


def write_single(out_dir: Path | str, tensors: Sequence[Tensor], metadata: Mapping[str, str] | None = None) -> Path:
    """Write every tensor into one `model.safetensors` (no index, as HF does for one file)."""
    out = make_private_dirs(out_dir)
    _check_unique([tensors])
    check_experts(tensors)
    write_safetensors(out / SINGLE_NAME, tensors, metadata)
    return out / SINGLE_NAME


# ------------------------------------------------------------------ MXFP4 checks


def check_mxfp4_matrix(name: str, packed: np.ndarray, scales: np.ndarray, original: np.ndarray | None = None) -> None:
    """Refuse an MXFP4 matrix that a reader would decode badly.

    Refused: any scale byte 255 (NaN in the MX spec; readers decode it as a zero
    group), a matrix that decodes to all zeros, and, when the pre-quantization
    weights are given, any 32-wide group with amax > 0 that decodes to all zeros.
    """
    from k3engine import mxfp4  # local import: the codec is a sibling module

    packed = np.asarray(packed)
    scales = np.asarray(scales)
    if packed.dtype != np.uint8 or scales.dtype != np.uint8:
        raise WriterError(f"{name}: MXFP4 tensors must be uint8")
    if packed.ndim != 2 or scales.ndim != 2 or packed.shape[0] != scales.shape[0] or scales.shape[1] * 32 != packed.shape[1] * 2:
        raise WriterError(f"{name}: packed {packed.shape} and scale {scales.shape} do not match")
    if np.any(scales == 255):
        r, g = np.argwhere(scales == 255)[0]
        raise WriterError(f"{name}: scale byte 255 (E8M0 NaN) at row {r}, group {g}; refusing to write")
    decoded, nan_groups = mxfp4.decode(packed, scales)
    if nan_groups:
        raise WriterError(f"{name}: {nan_groups} NaN scale groups")
    if not np.any(decoded):
        raise WriterError(f"{name}: the matrix decodes to all zeros; refusing to write")
    if original is not None:
        orig = np.asarray(original, dtype=np.float64)
        rows, cols = orig.shape
        amax = np.abs(orig).reshape(rows, cols // 32, 32).max(axis=2)
        dec_any = np.abs(decoded).reshape(rows, cols // 32, 32).max(axis=2) > 0
        bad = (amax > 0) & ~dec_any
        if np.any(bad):
            r, g = np.argwhere(bad)[0]
            raise WriterError(f"{name}: group (row {r}, group {g}) has amax {amax[r, g]:.3g} but decodes to all zeros")


def check_experts(tensors: Iterable[Tensor]) -> None:
    """Every routed expert: all six parts present, U8, and each matrix passes the MXFP4 checks."""
    experts: dict[str, dict[str, Tensor]] = {}
    for t in tensors:
        m = _EXPERT_RE.match(t.name)
        if m:
            experts.setdefault(m.group("prefix"), {})[m.group("part")] = t
    for prefix, parts in experts.items():
        missing = [p for p in EXPERT_PARTS if p not in parts]
        if missing:
            raise WriterError(f"{prefix}: missing {missing}")
        for w in ("w1", "w2", "w3"):
            pk, sc = parts[f"{w}.weight_packed"], parts[f"{w}.weight_scale"]
            if pk.dtype != "U8" or sc.dtype != "U8" or len(pk.shape) != 2 or len(sc.shape) != 2:
                raise WriterError(f"{prefix}.{w}: expert tensors must be 2-D U8")
            check_mxfp4_matrix(
                f"{prefix}.{w}",
                np.frombuffer(pk.data, np.uint8).reshape(pk.shape),
                np.frombuffer(sc.data, np.uint8).reshape(sc.shape),
            )


def quantize_checked(name: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4-quantize a matrix with `k3engine.mxfp4.quantize` and refuse bad results."""
    from k3engine import mxfp4

    packed, scales = mxfp4.quantize(np.asarray(w, dtype=np.float64))
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    scales = np.ascontiguousarray(scales, dtype=np.uint8)
    check_mxfp4_matrix(name, packed, scales, original=w)
    return packed, scales


# ------------------------------------------------------------------ layout checks


def read_header(path: Path | str) -> dict[str, dict]:
    """Parse a safetensors header (for tests and tools; not the engine's hardened reader)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n).decode("utf-8"))
    header.pop("__metadata__", None)
    return header


def is_tiled_run(spans: Sequence[tuple[int, int]]) -> bool:
    """True when the spans, in the given order, follow each other with no gap."""
    return all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
