"""`k3chat bench`: expert streaming measured the way the real model stresses it.

The benchmark checkpoint (design 5; spec k3-model.md 2.4, 3, 4, 7)
-------------------------------------------------------------------
`build_bench_checkpoint` writes, once, a checkpoint in the released layout: the real nested
`config.json` (through the fixture's config builder), one shard per layer holding all of
that layer's tensors plus a model-level shard, `model.safetensors.index.json`, and the
fixture tokenizer. Inside each MoE shard every routed expert is one contiguous six-tensor run
(w1.packed, w1.scale, w2.packed, w2.scale, w3.packed, w3.scale) and the runs are in shuffled
expert order, with the trunk run after the first third of them, as in the release.

The default `BenchShape` ("real") has the real widths where they drive I/O and compute:

| | benchmark | real K3 |
|---|---|---|
| hidden | 7168 | 7168 |
| KDA | 96 heads x 128 | same |
| MLA | 96 heads, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128 | same |
| routed expert | latent 3584, width 3072: **17,547,264 B** (MXFP4) | same |
| shared MLP | 2 x 3072 | same |
| layers | 4: 0 KDA + dense, 1-2 KDA + MoE, 3 MLA + MoE | 93 |
| experts per MoE layer / top-k | **64 / 16** | 896 / 16 |
| dense width (layer 0) | **8192 (reduced)** | 33792 |
| vocab | the fixture tokenizer's 1,280 (reduced) | 163,840 |

So a token's cold expert traffic per MoE layer is the real one (16 x 17,547,264 B =
280.8 MB); there are 3 MoE layers instead of 92. The run uses an expert cache smaller than
one layer's experts (40 slots by default, 64 experts per layer, 192 in all), so experts must
stream. 7.99 GB on disk (peak memory while writing: about 120 MB).

Weights need no oracle: a seeded numpy Generator fills BF16 matrices with N(0, 0.02) drawn in
float32 chunks (norm gains, A_log, router bias and the other small tensors use the fixture's
initialisers), and MXFP4 experts with random nibbles and E8M0 scale bytes in 118..123
(2^-9 .. 2^-4): never 255, and a 32-wide group whose 32 nibbles are all +-0 is patched and then
asserted absent, so no group decodes to all zeros. Everything is stream-written (a few MB
resident at a time) with progress on a callback.

The checkpoint lives in `platformdirs.user_cache_dir("k3chat")/bench-v1` (with K3CHAT_HOME
set: `$K3CHAT_HOME/cache/bench-v1`) or `--dir`, in 0700 directories, files 0600. A marker
file (`BENCH_COMPLETE.json`, listing every file and its size) is written last; a directory
without a valid marker is a half-built checkpoint and is rebuilt, never used. Free disk is
checked before anything is written, and a short disk is refused with the numbers.

The run
-------
`run_bench` measures decode (after a short prompt) under these configurations, each in a
fresh `Model` in this process, with the page cache of every shard dropped first
(posix_fadvise DONTNEED; the JSON says whether it worked):

- trunk resident, lookahead on (16 experts) and off;
- trunk streamed through a ring of 2 slots, lookahead on and off. The machine's RAM would
  otherwise serve the streamed trunk from the page cache after the first token, so by default
  the shards' page cache is dropped before every decode step too (`cold_trunk`), which makes
  each token read its trunk from the disk as it would for a model that does not fit.

Reported per configuration: seconds per token, GB read per token (trunk + expert, from the
engine's counters), the achieved read rate per wall second and per second the compute thread
spent waiting for bytes (both labelled), expert cache hit rate, lookahead issued/used/wasted,
the I/O-wait share of wall time; beside them the device's random-read bandwidth measured as
`k3chat doctor` does (`k3engine.doctor.probe_disk`, expert-sized O_DIRECT reads at queue
depths 1, 4, 8 and 16, in the benchmark directory). Against the disk, per configuration:
steady decode s/token (after the first token), end-to-end seconds per decoded token with the
prompt, the decode and prefill read rates beside the probe's best depth, and steady s/token
beside the bound bytes-read-per-token / that rate. For the prompt (prefill): seconds, tokens/s,
expert bytes read, and the achieved matmul GFLOP/s (2 x the multiply-adds the matmul kernels
did, from the engine's `matmul_madds` counter, / wall seconds) beside the machine's double
multiply-add peak (`k3_fma_peak_gflops`, independent FMA chains, on 1 thread and on the run's
threads). `python -m k3engine.kernel_bench` times the matmul kernels alone at these widths
without a checkpoint. No numbers here are asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .private_files import make_private_dirs, open_private, write_private

__all__ = [
    "BenchShape", "REAL_SHAPE", "TINY_SHAPE", "BenchError", "BENCH_VERSION", "MARKER_NAME",
    "MANIFEST_NAME", "RESULT_NAME", "default_bench_dir", "free_disk_bytes", "plan_checkpoint",
    "checkpoint_ready", "build_bench_checkpoint", "drop_page_cache", "run_bench",
    "format_report", "main_bench",
]

BENCH_VERSION = 1
MARKER_NAME = "BENCH_COMPLETE.json"  # written last: its absence means "half built"
MANIFEST_NAME = "bench.json"  # written first: marks the directory as a bench checkpoint
RESULT_NAME = "bench-result.json"  # default JSON output of `k3chat bench`
FREE_MARGIN = 256 * (1 << 20)  # never fill the disk to the last byte
CHUNK_ELEMS = 1 << 22  # BF16 values generated per step (16 MiB of float32 scratch)
SCALE_LO, SCALE_HI = 118, 123  # E8M0 scale bytes of the random experts (2^-9 .. 2^-4)
BF16_STD = 0.02
SMALL_NUMEL = 1 << 20  # tensors up to this size use the fixture's initialisers
SMALL_FILES_BYTES = 4 << 20  # tokenizer, config, index, manifest, marker: a bound
IO_ALIGN = 4096  # the engine's direct-I/O alignment (KX_ALIGN in native/k3_store.c)
LM = "language_model.model."

from .exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE  # noqa: E402 - one definition for every command

Progress = Callable[[int, int], None]  # (bytes written so far, total bytes)
Log = Callable[[str], None]


class BenchError(RuntimeError):
    """The benchmark refuses (no disk space, not a bench directory, no memory) or failed."""


# --------------------------------------------------------------------------------- shape


@dataclass(frozen=True)
class BenchShape:
    """Dimensions of a benchmark checkpoint. The defaults are the real-width benchmark."""

    name: str = "real"
    hidden_size: int = 7168
    kda_heads: int = 96
    kda_head_dim: int = 128
    conv_kernel: int = 4
    mla_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_experts: int = 64  # real: 896
    num_experts_per_token: int = 16  # real: 16
    num_shared_experts: int = 2
    routed_expert_hidden_size: int = 3584
    moe_intermediate_size: int = 3072
    intermediate_size: int = 8192  # layer-0 dense width, REDUCED (real: 33792)
    num_hidden_layers: int = 4
    full_attn_layers: tuple[int, ...] = (4,)  # one-based: layer 3 is MLA, 0-2 KDA
    attn_res_block_size: int = 2
    cache_slots: int = 40  # default expert cache for the run: < experts per layer
    seed: int = 0

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if n < 2 or not all(1 <= x <= n for x in self.full_attn_layers):
            raise ValueError(f"full_attn_layers {self.full_attn_layers} must be one-based in 1..{n}")
        if self.routed_expert_hidden_size % 32 or self.moe_intermediate_size % 32:
            raise ValueError("latent and expert width must be multiples of 32 (MXFP4 groups)")
        if not self.num_experts_per_token < self.cache_slots < self.num_experts:
            raise ValueError(
                f"cache_slots {self.cache_slots} must exceed top-{self.num_experts_per_token} and be "
                f"below the {self.num_experts} experts of one layer (forced streaming)")
        if self.kda_head_dim < self.kda_heads:
            raise ValueError("A_log is stored with head_dim entries; it must hold one per KDA head")

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(L for L in range(1, self.num_hidden_layers + 1) if L not in self.full_attn_layers)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Zero-based MoE layers (first_k_dense_replace = 1, freq 1)."""
        return tuple(range(1, self.num_hidden_layers))

    @property
    def expert_bytes(self) -> int:
        """3 * I_e * l * (1/2 + 1/32): the packed nibbles plus the scale bytes of w1, w2, w3."""
        il = self.moe_intermediate_size * self.routed_expert_hidden_size
        return 3 * (il // 2 + il // 32)

    @property
    def slot_bytes(self) -> int:
        """Cache bytes one expert slot takes in the engine (expert rounded to 4 KiB + 2 pages)."""
        return -(-self.expert_bytes // IO_ALIGN) * IO_ALIGN + 2 * IO_ALIGN

    def preset(self) -> Any:
        """The fixture `Preset` with these dimensions (for its config builder and trunk table)."""
        from .fixture import Preset

        return Preset(
            name=f"bench-{self.name}", hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers, kda_heads=self.kda_heads,
            kda_head_dim=self.kda_head_dim, conv_kernel=self.conv_kernel, gate_lower_bound=-5.0,
            full_attn_layers=tuple(self.full_attn_layers), kda_layers=self.kda_layers,
            mla_heads=self.mla_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim, num_experts=self.num_experts,
            num_experts_per_token=self.num_experts_per_token,
            num_shared_experts=self.num_shared_experts,
            routed_expert_hidden_size=self.routed_expert_hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            intermediate_size=self.intermediate_size, attn_res_block_size=self.attn_res_block_size,
            note="benchmark checkpoint (engine/bench.py): random weights, no oracle",
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["full_attn_layers"] = list(self.full_attn_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchShape":
        d = dict(d)
        d["full_attn_layers"] = tuple(d["full_attn_layers"])
        return cls(**d)


REAL_SHAPE = BenchShape()
# The same code path at toy sizes, for tests: 6,528 B experts, 16 per layer, top-4.
TINY_SHAPE = BenchShape(
    name="tiny", hidden_size=64, kda_heads=2, kda_head_dim=16, mla_heads=2, q_lora_rank=32,
    kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=16,
    num_experts_per_token=4, routed_expert_hidden_size=64, moe_intermediate_size=64,
    intermediate_size=96, cache_slots=10,
)


def default_bench_dir() -> Path:
    """`$K3CHAT_HOME/cache/bench-vN` when K3CHAT_HOME is set (as k3chat.paths does for data,
    config and state), else the platform cache directory."""
    import platformdirs

    home = os.environ.get("K3CHAT_HOME")
    base = Path(home).expanduser() / "cache" if home else Path(platformdirs.user_cache_dir("k3chat"))
    return base / f"bench-v{BENCH_VERSION}"


# ------------------------------------------------------------------------ tensor plan


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to be generated: what `writer.encode_header` needs plus how to fill it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str  # "bf16" (chunked N(0, 0.02)), "init" (fixture initialiser), "packed", "scale"
    init: Any = None  # fixture Init for kind "init"
    storage: str = "bf16"  # for kind "init": "bf16" or "f32"


@dataclass
class ShardPlan:
    name: str
    tensors: list[TensorPlan]
    header: bytes = b""

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def file_bytes(self) -> int:
        return 8 + len(self.header) + self.data_bytes


@dataclass
class CheckpointPlan:
    shape: BenchShape
    vocab: int
    shards: list[ShardPlan]
    expert_runs: dict[int, list[int]] = field(default_factory=dict)  # layer -> expert order

    @property
    def shard_bytes(self) -> int:
        return sum(s.file_bytes for s in self.shards)

    @property
    def tensor_bytes(self) -> int:
        return sum(s.data_bytes for s in self.shards)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _entry_plan(name: str, shape: tuple[int, ...], storage: str, init: Any) -> TensorPlan:
    size = {"bf16": 2, "f32": 4}[storage]
    nbytes = _numel(shape) * size
    dtype = "BF16" if storage == "bf16" else "F32"
    if storage == "bf16" and _numel(shape) > SMALL_NUMEL:
        return TensorPlan(name, dtype, shape, nbytes, "bf16")
    return TensorPlan(name, dtype, shape, nbytes, "init", init, storage)


def _expert_plans(shape: BenchShape, prefix: str) -> list[TensorPlan]:
    """The six tensors of one expert in the release's order (writer.EXPERT_PARTS)."""
    from .writer import EXPERT_PARTS

    lat, ie = shape.routed_expert_hidden_size, shape.moe_intermediate_size
    rows = {"w1": ie, "w2": lat, "w3": ie}
    cols = {"w1": lat, "w2": ie, "w3": lat}
    out = []
    for part in EXPERT_PARTS:
        w, kind = part.split(".")[0], ("packed" if part.endswith("packed") else "scale")
        width = cols[w] // 2 if kind == "packed" else cols[w] // 32
        out.append(TensorPlan(f"{prefix}.{part}", "U8", (rows[w], width), rows[w] * width, kind))
    return out


def plan_checkpoint(shape: BenchShape, vocab: int) -> CheckpointPlan:
    """Every shard's tensors in file order, with headers: the sizes are known before writing."""
    from .fixture import expert_order, gain, normal, trunk_entries
    from .writer import encode_header, shard_name

    p = shape.preset()
    layer_tensors: list[list[TensorPlan]] = []
    orders: dict[int, list[int]] = {}
    for L in range(shape.num_hidden_layers):
        base = f"{LM}layers.{L}."
        trunk = [_entry_plan(base + e.suffix, e.shape, e.storage, e.init) for e in trunk_entries(p, L)]
        if not p.is_moe(L):
            layer_tensors.append(trunk)
            continue
        # Release layout: shuffled expert runs, the trunk run after the first third.
        order = expert_order(shape.num_experts, np.random.default_rng([shape.seed, 0x1A7, L]))
        orders[L] = order
        cut = (len(order) + 2) // 3
        out: list[TensorPlan] = []
        for eid in order[:cut]:
            out += _expert_plans(shape, f"{base}block_sparse_moe.experts.{eid}")
        out += trunk
        for eid in order[cut:]:
            out += _expert_plans(shape, f"{base}block_sparse_moe.experts.{eid}")
        layer_tensors.append(out)
    E = shape.hidden_size
    model = [
        _entry_plan(LM + "embed_tokens.weight", (vocab, E), "bf16", normal(BF16_STD)),
        _entry_plan("language_model.lm_head.weight", (vocab, E), "bf16", normal(BF16_STD)),
        _entry_plan(LM + "norm.weight", (E,), "bf16", gain()),
        _entry_plan(LM + "output_attn_res_norm.weight", (E,), "bf16", gain()),
        _entry_plan(LM + "output_attn_res_proj.weight", (1, E), "bf16", normal(BF16_STD)),
    ]
    groups = layer_tensors + [model]
    shards = [ShardPlan(shard_name(i + 1, len(groups)), ts) for i, ts in enumerate(groups)]
    for s in shards:
        s.header = encode_header(s.tensors, {"format": "pt"})
    return CheckpointPlan(shape, vocab, shards, orders)


# --------------------------------------------------------------------------- generation


def _bf16_from_f32(x: np.ndarray) -> np.ndarray:
    """Round finite float32 to bfloat16 bits (nearest, ties to even), in uint32 arithmetic.

    `writer.bf16_bits` is exact for every input including NaN and overflow but goes through
    uint64; the generator only makes small finite values and this is ~30x faster. The
    benchmark's tests check the two agree on a sample.
    """
    u = x.view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype("<u2")


def _bf16_chunks(rng: np.random.Generator, numel: int) -> Iterable[np.ndarray]:
    done = 0
    while done < numel:
        n = min(CHUNK_ELEMS, numel - done)
        x = rng.standard_normal(n, dtype=np.float32)
        x *= np.float32(BF16_STD)
        yield _bf16_from_f32(x)
        done += n


_NONSIGN = np.uint64(0x7777777777777777)  # every nibble without its sign bit


def random_packed(rng: np.random.Generator, rows: int, packed_cols: int) -> np.ndarray:
    """Random E2M1 nibbles; no 32-wide group (16 bytes) is all +-0 (asserted)."""
    buf = np.frombuffer(bytearray(rng.bytes(rows * packed_cols)), dtype=np.uint8)
    groups = buf.view("<u8").reshape(-1, 2)  # 16 bytes = one group of 32 nibbles
    zero = ((groups[:, 0] | groups[:, 1]) & _NONSIGN) == 0
    if zero.any():
        buf.reshape(-1, 16)[zero, 0] |= np.uint8(0x02)  # low nibble 2: value 1.0 * scale
        zero = ((groups[:, 0] | groups[:, 1]) & _NONSIGN) == 0
    if zero.any():
        raise BenchError("generator bug: an MXFP4 group decodes to all zeros")
    return buf.reshape(rows, packed_cols)


def random_scales(rng: np.random.Generator, rows: int, groups: int) -> np.ndarray:
    s = rng.integers(SCALE_LO, SCALE_HI + 1, size=(rows, groups), dtype=np.uint8)
    if s.size and (int(s.max()) >= 255 or int(s.min()) < SCALE_LO):
        raise BenchError("generator bug: an E8M0 scale byte is outside the sane range")
    return s


def _tensor_chunks(t: TensorPlan, rng: np.random.Generator) -> Iterable[np.ndarray | bytes]:
    if t.kind == "bf16":
        yield from _bf16_chunks(rng, _numel(t.shape))
    elif t.kind == "init":
        from .writer import bf16_bits

        values = np.asarray(t.init(rng, t.shape))
        yield bf16_bits(values).astype("<u2") if t.storage == "bf16" else values.astype("<f4")
    elif t.kind == "packed":
        yield random_packed(rng, t.shape[0], t.shape[1])
    elif t.kind == "scale":
        yield random_scales(rng, t.shape[0], t.shape[1])
    else:  # pragma: no cover - plan kinds are fixed above
        raise BenchError(f"unknown tensor kind {t.kind!r}")


def _fadvise_dontneed(fd: int) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False


def _write_shard(path: Path, plan: ShardPlan, rng: np.random.Generator,
                 on_bytes: Callable[[int], None]) -> None:
    """Stream one shard to `path.tmp`, fsync, drop it from the page cache, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open_private(tmp, buffering=8 << 20) as f:
        head = len(plan.header).to_bytes(8, "little") + plan.header
        f.write(head)
        on_bytes(len(head))
        for t in plan.tensors:
            wrote = 0
            for chunk in _tensor_chunks(t, rng):
                mv = memoryview(chunk).cast("B") if isinstance(chunk, np.ndarray) else memoryview(chunk)
                f.write(mv)
                wrote += mv.nbytes
                on_bytes(mv.nbytes)
            if wrote != t.nbytes:
                raise BenchError(f"generator bug: {t.name} wrote {wrote} bytes, planned {t.nbytes}")
        f.flush()
        os.fsync(f.fileno())
        _fadvise_dontneed(f.fileno())  # a fresh build must not leave the bench warm
    if tmp.stat().st_size != plan.file_bytes:
        raise BenchError(f"{tmp.name}: {tmp.stat().st_size} bytes written, planned {plan.file_bytes}")
    os.replace(tmp, path)


# ------------------------------------------------------------------------ directory


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds (or would hold) `path`."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open_private(tmp) as f:
        f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def checkpoint_ready(directory: Path | str, shape: BenchShape | None = None) -> bool:
    """True when `directory` holds a complete benchmark checkpoint (of `shape`, if given).

    Complete means: a parseable marker of this BENCH_VERSION, and every file it lists
    present with the size it lists. Anything else is a half-built or stale checkpoint.
    """
    d = Path(directory)
    marker = _read_json(d / MARKER_NAME)
    if not isinstance(marker, dict) or marker.get("bench_version") != BENCH_VERSION:
        return False
    if shape is not None and marker.get("shape") != shape.to_dict():
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        try:
            if (d / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _is_ours(name: str) -> bool:
    return (name.startswith("model-") and (name.endswith(".safetensors") or name.endswith(".safetensors.tmp"))) \
        or name in {"model.safetensors.index.json", "config.json", "tiktoken.model", "tokenizer_config.json",
                    MANIFEST_NAME, MARKER_NAME, RESULT_NAME} \
        or (name.endswith(".tmp") and name[:-4] in {"model.safetensors.index.json", "config.json",
                                                     MANIFEST_NAME, MARKER_NAME, RESULT_NAME})


def _clear_directory(d: Path) -> None:
    """Remove a previous (possibly half-built) benchmark checkpoint's files.

    Only a directory that is empty or marked as a benchmark directory (manifest or marker)
    is touched, and only the file names a benchmark checkpoint has: `--dir` pointing at
    anything else is refused rather than emptied.
    """
    if not d.exists():
        return
    if not d.is_dir():
        raise BenchError(f"{d} exists and is not a directory")
    names = [p.name for p in d.iterdir()]
    if not names:
        return
    if MANIFEST_NAME not in names and MARKER_NAME not in names:
        raise BenchError(f"{d} is not empty and holds no benchmark checkpoint ({MANIFEST_NAME}); "
                         "refusing to delete its files: pass an empty or new --dir")
    # The marker goes first: from here on the directory is never taken as complete.
    for name in sorted(names, key=lambda n: n != MARKER_NAME):
        if _is_ours(name) and (d / name).is_file():
            (d / name).unlink()


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def build_bench_checkpoint(
    directory: Path | str | None = None,
    *,
    shape: BenchShape = REAL_SHAPE,
    progress: Progress | None = None,
    rebuild: bool = False,
    log: Log | None = None,
) -> Path:
    """Build the benchmark checkpoint in `directory` (default: the platform cache), once.

    A complete checkpoint of the same shape is reused unless `rebuild`. `progress(done,
    total)` is called as bytes are written; `log` gets the one-line messages (size up
    front, reuse). Raises BenchError when the disk is short or the directory is not ours.
    """
    from .fixture import build_config, read_special_ids
    from .tokenizer_files import DEFAULT_N_RANKS, SPECIAL_BLOCK, write_fixture_tokenizer
    from .writer import INDEX_NAME

    d = Path(directory) if directory is not None else default_bench_dir()
    say = log or (lambda _msg: None)
    if not rebuild and checkpoint_ready(d, shape):
        say(f"benchmark checkpoint: {d} (cached)")
        return d

    vocab = DEFAULT_N_RANKS + SPECIAL_BLOCK  # what write_fixture_tokenizer will write
    plan = plan_checkpoint(shape, vocab)
    total = plan.shard_bytes + SMALL_FILES_BYTES  # + tokenizer, config, index, manifest (a bound)
    say(f"building the benchmark checkpoint ({shape.name} shape) in {d}: {_gb(total)} "
        f"({len(plan.shards)} shards, {len(shape.moe_layers)} MoE layers x {shape.num_experts} experts "
        f"of {shape.expert_bytes:,} B)")
    _clear_directory(d)  # before measuring: a stale checkpoint's space counts as free
    free = free_disk_bytes(d)
    if free < total + FREE_MARGIN:
        raise BenchError(
            f"not enough free disk in {d}: the benchmark checkpoint needs {_gb(total)} "
            f"({total:,} B) plus a {_gb(FREE_MARGIN)} margin, only {_gb(free)} ({free:,} B) free; "
            "free some space or pass --dir on another disk")
    make_private_dirs(d)
    os.chmod(d, 0o700)  # ours (cleared above): private even if an older version made it 0755
    manifest = {
        "bench_version": BENCH_VERSION,
        "state": "building",
        "shape": shape.to_dict(),
        "vocab_size": vocab,
        "expert_bytes": shape.expert_bytes,
        "moe_layers": list(shape.moe_layers),
        "expert_order": {str(L): o for L, o in plan.expert_runs.items()},
        "shard_bytes": plan.shard_bytes,
        "tensor_bytes": plan.tensor_bytes,
        "notes": [
            "random weights (seeded): BF16 N(0, 0.02), MXFP4 random nibbles with scale bytes "
            f"{SCALE_LO}..{SCALE_HI}; no oracle",
            f"real widths (hidden {shape.hidden_size}, expert {shape.expert_bytes:,} B); "
            f"{shape.num_experts} experts per MoE layer with top-{shape.num_experts_per_token} "
            "(real: 896 / top-16)",
            f"layer-0 dense width {shape.intermediate_size} (reduced; real 33792); "
            f"vocab {vocab} (fixture tokenizer; real 163840)",
        ],
    }
    _write_json_atomic(d / MANIFEST_NAME, manifest)  # first: marks the directory as ours
    if int(write_fixture_tokenizer(d)) != vocab:
        raise BenchError("the fixture tokenizer's vocabulary is not the one planned")
    small = sum((d / n).stat().st_size for n in ("tiktoken.model", "tokenizer_config.json"))
    ids = read_special_ids(d)
    write_private(d / "config.json", json.dumps(build_config(shape.preset(), vocab, ids), indent=2) + "\n")

    done = [small]
    last = [0.0]

    def on_bytes(n: int) -> None:
        done[0] += n
        if progress is not None:
            now = time.monotonic()
            if now - last[0] >= 0.1:
                last[0] = now
                progress(min(done[0], total), total)

    if progress is not None:
        progress(done[0], total)
    weight_map: dict[str, str] = {}
    for i, sp in enumerate(plan.shards):
        rng = np.random.default_rng([shape.seed, i])
        _write_shard(d / sp.name, sp, rng, on_bytes)
        for t in sp.tensors:
            weight_map[t.name] = sp.name
    index = {"metadata": {"total_size": plan.tensor_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json_atomic(d / INDEX_NAME, index)
    manifest["state"] = "complete"
    _write_json_atomic(d / MANIFEST_NAME, manifest)
    files = {p.name: p.stat().st_size for p in sorted(d.iterdir())
             if p.is_file() and _is_ours(p.name) and p.name not in (MARKER_NAME, RESULT_NAME)
             and not p.name.endswith(".tmp")}
    marker = {"bench_version": BENCH_VERSION, "shape": shape.to_dict(), "files": files,
              "total_bytes": sum(files.values()), "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _write_json_atomic(d / MARKER_NAME, marker)  # last: only now is the checkpoint usable
    if progress is not None:
        progress(total, total)
    return d


# ----------------------------------------------------------------------------- the run


def _shard_files(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("model-*.safetensors") if p.is_file())


def drop_page_cache(files: Iterable[Path]) -> bool:
    """posix_fadvise(DONTNEED) on every file; True when the kernel accepted it for all."""
    ok = True
    for p in files:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            ok = False
            continue
        try:
            ok = _fadvise_dontneed(fd) and ok
        finally:
            os.close(fd)
    return ok


_DELTA_KEYS = ("trunk_bytes_read", "expert_bytes_read", "cache_hits", "cache_misses", "cache_evictions",
               "lookahead_issued", "lookahead_used", "lookahead_wasted", "io_wait_ns",
               "trunk_stream_reads", "expert_run_reads", "expert_fallback_reads", "expert_uses",
               "matmul_madds")


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: int(b.get(k, 0)) - int(a.get(k, 0)) for k in _DELTA_KEYS}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _summary(d: dict[str, int], seconds: float, tokens: int) -> dict[str, Any]:
    """Aggregates of a counter delta over `tokens` steps taking `seconds` of wall time."""
    read = d["trunk_bytes_read"] + d["expert_bytes_read"]
    io_s = d["io_wait_ns"] / 1e9
    lookups = d["cache_hits"] + d["cache_misses"]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "s_per_token": seconds / tokens if tokens else None,
        "tokens_per_s": tokens / seconds if seconds else None,
        "bytes_read": read,
        "trunk_bytes_read": d["trunk_bytes_read"],
        "expert_bytes_read": d["expert_bytes_read"],
        "gb_read_per_token": read / tokens / 1e9 if tokens else None,
        "trunk_gb_per_token": d["trunk_bytes_read"] / tokens / 1e9 if tokens else None,
        "expert_gb_per_token": d["expert_bytes_read"] / tokens / 1e9 if tokens else None,
        "read_gb_per_s_wall": _ratio(read / 1e9, seconds),
        "read_gb_per_s_io_wait": _ratio(read / 1e9, io_s),
        "io_wait_s": io_s,
        "io_wait_share": _ratio(io_s, seconds),
        "cache_hits": d["cache_hits"],
        "cache_misses": d["cache_misses"],
        "cache_evictions": d["cache_evictions"],
        "cache_hit_rate": _ratio(d["cache_hits"], lookups),
        "lookahead_issued": d["lookahead_issued"],
        "lookahead_used": d["lookahead_used"],
        "lookahead_wasted": d["lookahead_wasted"],
        "lookahead_precision": _ratio(d["lookahead_used"], d["lookahead_issued"]),
        # cache hits include experts the lookahead prefetched; split them out
        "hits_from_lookahead": d["lookahead_used"],
        "hits_from_reuse": d["cache_hits"] - d["lookahead_used"],
        "lookahead_coverage": _ratio(d["lookahead_used"], lookups),
        "expert_reads": d["expert_run_reads"] + d["expert_fallback_reads"],
        "expert_fallback_reads": d["expert_fallback_reads"],
        "trunk_stream_reads": d["trunk_stream_reads"],
        "expert_uses": d["expert_uses"],
        # compute: 2 flops per multiply-add the matmul kernels did (engine counter)
        "matmul_madds": d["matmul_madds"],
        "matmul_gflops": _ratio(2 * d["matmul_madds"] / 1e9, seconds),
    }


def _disk_bound(dec: dict[str, Any], pf: dict[str, Any], best: float | None, tokens: int) -> dict[str, Any]:
    """Decode and prefill against the disk: the achieved read rate beside the device's best
    (the doctor's probe at its best queue depth), and steady s/token beside the time the
    bytes read per token would take at that rate (the bound a disk-bound run approaches)."""
    steady = dec.get("s_per_token_after_first") or dec["s_per_token"]
    read_per_token = (dec["bytes_read"] / tokens) if tokens else 0
    bound = read_per_token / 1e9 / best if best else None
    return {
        "steady_s_per_token": steady,
        "end_to_end_s_per_token": (pf["seconds"] + dec["seconds"]) / tokens if tokens else None,
        "io_wait_share": dec["io_wait_share"],
        "prefill_io_wait_share": pf["io_wait_share"],
        "device_best_gb_per_s": best,
        "read_vs_device_best": _ratio(dec["read_gb_per_s_wall"] or 0.0, best) if best else None,
        "prefill_read_gb_per_s_wall": pf["read_gb_per_s_wall"],
        "prefill_read_vs_device_best": _ratio(pf["read_gb_per_s_wall"] or 0.0, best) if best else None,
        "disk_bound_s_per_token": bound,
        "steady_vs_disk_bound": _ratio(steady, bound) if bound else None,
    }


def _fma_peak(threads: int, seconds: float) -> dict[str, Any]:
    """The machine's double multiply-add peak (k3_fma_peak_gflops) on 1 and `threads` threads."""
    from ._k3 import ffi, lib

    out: dict[str, Any] = {"source": "k3_fma_peak_gflops (independent double FMA chains)",
                           "simd": ffi.string(lib.k3_simd_kind()).decode(), "seconds": seconds}
    for th in sorted({1, threads}):
        g = float(lib.k3_fma_peak_gflops(seconds, th))
        out[f"gflops_{th}_threads"] = g if g > 0 else None
    out["gflops_run_threads"] = out[f"gflops_{threads}_threads"]
    return out


def _probe_device(d: Path, size_bytes: int, seconds: float) -> dict[str, Any]:
    """Random-read bandwidth of the bench disk, measured exactly as `k3chat doctor` does."""
    from .doctor import K3_EXPERT_BYTES, probe_disk

    out: dict[str, Any] = {"source": "k3engine.doctor.probe_disk", "path": str(d)}
    try:
        r = probe_disk(d, size_bytes, K3_EXPERT_BYTES, seconds)
    except OSError as exc:
        out["error"] = f"{exc.strerror or exc} ({type(exc).__name__})"
        return out
    out.update({"mode": r.mode, "direct_io": r.direct_io, "note": r.note, "file_bytes": r.file_bytes,
                "read_bytes": r.read_bytes, "seconds_per_depth": seconds})
    out["phases"] = [{"queue_depth": p.queue_depth, "reads": p.reads, "bytes": p.bytes,
                      "seconds": p.seconds, "gb_per_s": p.gb_per_s} for p in r.phases]
    for p in r.phases:
        out[f"qd{p.queue_depth}_gb_per_s"] = p.gb_per_s
    top = max(r.phases, key=lambda p: p.gb_per_s)
    out["best_queue_depth"], out["best_gb_per_s"] = top.queue_depth, top.gb_per_s
    return out


def _estimate_memory(d: Path, slots: int, slot_bytes: int, streamed: bool) -> int:
    """Resident bytes a configuration needs: non-expert weights (or a ring of 2) + the cache."""
    from .safetensors_io import open_checkpoint

    ck = open_checkpoint(d)
    per_layer: dict[str, int] = {}
    other = 0
    for t in ck.tensors.values():
        if ".block_sparse_moe.experts." in t.name:
            continue
        if ".layers." in t.name:
            L = t.name.split(".layers.")[1].split(".")[0]
            per_layer[L] = per_layer.get(L, 0) + t.nbytes
        else:
            other += t.nbytes
    trunk = 2 * max(per_layer.values(), default=0) if streamed else sum(per_layer.values())
    return other + trunk + slots * slot_bytes


def run_bench(
    directory: Path | str | None = None,
    *,
    tokens: int = 8,
    prompt_tokens: int = 8,
    threads: int | None = None,
    lookahead: int = 16,
    cache_slots: int | None = None,
    reader_threads: int = 8,
    trunk_readers: int = 1,
    trunk_piece_bytes: int = 0,
    direct_io: bool = True,
    streamed: bool = True,
    cold_trunk: bool = True,
    drop_cache: bool = True,
    probe: bool = True,
    probe_bytes: int = 256 * (1 << 20),
    probe_seconds: float = 1.0,
    check_memory: bool = True,
    prefill_chunk: int = 64,
    log: Log | None = None,
) -> dict[str, Any]:
    """Decode `tokens` greedy tokens after a `prompt_tokens` prompt under each configuration.

    Configurations: trunk resident with lookahead `lookahead` and 0; if `streamed`, the
    trunk streamed through a ring of 2 with the same two lookaheads. The expert cache has
    `cache_slots` slots (default: the shape's, fewer than one layer's experts); the prompt is
    fed in passes of `prefill_chunk` tokens (the engine's default 64, or a plan's). Returns the
    JSON-ready result (see the module docstring); raises BenchError if the directory is
    not a complete benchmark checkpoint or the machine lacks the memory.
    """
    from .config import load_config
    from .model import Model, StreamOptions

    d = Path(directory) if directory is not None else default_bench_dir()
    say = log or (lambda _msg: None)
    if tokens < 1 or prompt_tokens < 1 or prefill_chunk < 1:
        raise ValueError("tokens, prompt_tokens and prefill_chunk must be >= 1")
    if not checkpoint_ready(d):
        raise BenchError(f"{d} holds no complete benchmark checkpoint (no valid {MARKER_NAME}); build it first")
    marker = _read_json(d / MARKER_NAME)
    shape = BenchShape.from_dict(marker["shape"])
    cfg = load_config(d)
    slots = int(cache_slots if cache_slots is not None else shape.cache_slots)
    if not cfg.top_k < slots:
        raise BenchError(f"cache_slots {slots} must exceed top-{cfg.top_k} (the engine needs a spare slot)")
    if threads is None:
        try:
            threads = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            threads = os.cpu_count() or 1
    files = _shard_files(d)
    cache_bytes = slots * shape.slot_bytes

    if check_memory:
        from .sizes import read_machine_memory

        usable = read_machine_memory().limit
        need = _estimate_memory(d, slots, shape.slot_bytes, streamed=False)
        if need > usable:
            raise BenchError(f"the resident-trunk run needs about {_gb(need)} of memory, this machine "
                             f"offers {_gb(usable)} without swapping")

    device: dict[str, Any]
    if probe:
        say(f"probing the device holding {d} (as k3chat doctor does)...")
        device = _probe_device(d, probe_bytes, probe_seconds)
        say(f"measuring the double multiply-add peak on 1 and {threads} threads...")
        peak = _fma_peak(threads, min(probe_seconds, 60.0))
    else:
        device = {"source": "not measured (probe=False)"}
        peak = {"source": "not measured (probe=False)", "gflops_run_threads": None}

    rng = np.random.default_rng([shape.seed, 0x9E0])
    n_ranks = cfg.vocab - 256
    prompt = [int(x) for x in rng.integers(0, n_ranks, prompt_tokens)]

    configs: list[tuple[str, bool, int]] = [("resident", False, lookahead), ("resident", False, 0)]
    if streamed:
        configs += [("streamed-ring2", True, lookahead), ("streamed-ring2", True, 0)]
    if lookahead == 0:
        configs = [c for i, c in enumerate(configs) if i % 2 == 0]

    results: list[dict[str, Any]] = []
    drops: list[bool] = []
    for trunk_mode, stream, la in configs:
        name = f"{trunk_mode}/lookahead={la}"
        say(f"running {name} ...")
        dropped = drop_page_cache(files) if drop_cache else False
        drops.append(dropped)
        opts = StreamOptions(expert_cache_bytes=cache_bytes, reader_threads=reader_threads,
                             direct_io=direct_io, lookahead=la, prefetch=True, trunk_stream=stream,
                             ring_slots=2, prefill_chunk=prefill_chunk, trunk_readers=trunk_readers,
                             trunk_piece_bytes=trunk_piece_bytes)
        t0 = time.perf_counter()
        model = Model(d, threads=threads, streaming=opts)
        open_s = time.perf_counter() - t0
        sess = None
        try:
            st_open = model.stats()
            sess = model.session(prompt_tokens + tokens + 1)
            a = model.stats()
            t0 = time.perf_counter()
            logits = sess.feed(prompt)
            prefill_s = time.perf_counter() - t0
            b = model.stats()
            prefill = _summary(_delta(a, b), prefill_s, prompt_tokens)
            prefill["matmul_gflops_vs_peak"] = _ratio(prefill["matmul_gflops"] or 0.0,
                                                      peak["gflops_run_threads"] or 0.0)
            per_token: list[dict[str, Any]] = []
            generated: list[int] = []
            total = {k: 0 for k in _DELTA_KEYS}
            decode_s = 0.0
            finite = bool(np.all(np.isfinite(logits)))
            for _ in range(tokens):
                tok = int(np.argmax(logits))
                generated.append(tok)
                if stream and cold_trunk and drop_cache:
                    drop_page_cache(files)  # the streamed trunk comes from the disk, not RAM
                a = model.stats()
                t0 = time.perf_counter()
                logits = sess.feed([tok])
                dt = time.perf_counter() - t0
                b = model.stats()
                dd = _delta(a, b)
                for k in _DELTA_KEYS:
                    total[k] += dd[k]
                decode_s += dt
                finite = finite and bool(np.all(np.isfinite(logits)))
                per_token.append({
                    "s": dt,
                    "gb_read": (dd["trunk_bytes_read"] + dd["expert_bytes_read"]) / 1e9,
                    "trunk_gb": dd["trunk_bytes_read"] / 1e9,
                    "expert_gb": dd["expert_bytes_read"] / 1e9,
                    "cache_hits": dd["cache_hits"], "cache_misses": dd["cache_misses"],
                    "lookahead_used": dd["lookahead_used"], "lookahead_wasted": dd["lookahead_wasted"],
                    "io_wait_share": _ratio(dd["io_wait_ns"] / 1e9, dt),
                })
            final = model.stats()
        finally:
            # The session first: freeing a session after its model is closed is a use-after-free.
            if sess is not None:
                sess.close()
            model.close()
        decode = _summary(total, decode_s, tokens)
        times = [p["s"] for p in per_token]
        decode["s_per_token_median"] = float(np.median(times))
        decode["s_per_token_min"] = float(min(times))
        decode["s_per_token_max"] = float(max(times))
        if tokens > 1:
            decode["s_per_token_after_first"] = float(np.mean(times[1:]))
        results.append({
            "name": name,
            "trunk": trunk_mode,
            "trunk_stream": stream,
            "ring_slots": 2 if stream else None,
            "lookahead": la,
            "expert_cache_bytes": cache_bytes,
            "expert_slots": int(st_open["expert_slots"]),
            "direct_io": bool(final["direct_io"]),
            "direct_io_refused": bool(final["direct_io_refused"]),
            "trunk_readers": trunk_readers if stream else None,
            "trunk_inflight_max": int(final["trunk_inflight_max"]),
            "page_cache_dropped_before": dropped,
            "cold_trunk_each_token": bool(stream and cold_trunk and drop_cache),
            "open_s": open_s,
            "open_trunk_bytes_read": int(st_open["trunk_bytes_read"]),
            "memory_estimate_bytes": _estimate_memory(d, slots, shape.slot_bytes, stream),
            "prefill": prefill,
            "decode": decode,
            "per_token": per_token,
            "generated_ids": generated,
            "finite_logits": finite,
        })

    def find(trunk_mode: str, la: int) -> dict[str, Any] | None:
        return next((r for r in results if r["trunk"] == trunk_mode and r["lookahead"] == la), None)

    comparison: dict[str, Any] = {}
    qd1, qd8 = device.get("qd1_gb_per_s"), device.get("qd8_gb_per_s")
    best = device.get("best_gb_per_s")
    for r in results:
        dec, pf = r["decode"], r["prefill"]
        comparison[r["name"]] = {
            "s_per_token": dec["s_per_token"],
            **_disk_bound(dec, pf, best, tokens),
            "gb_read_per_token": dec["gb_read_per_token"],
            "read_gb_per_s_wall": dec["read_gb_per_s_wall"],
            "read_vs_device_qd8": _ratio(dec["read_gb_per_s_wall"] or 0.0, qd8) if qd8 else None,
            "read_vs_device_qd1": _ratio(dec["read_gb_per_s_wall"] or 0.0, qd1) if qd1 else None,
        }
    for trunk_mode in ("resident", "streamed-ring2"):
        on, off = find(trunk_mode, lookahead), find(trunk_mode, 0)
        if on and off and lookahead:
            comparison[f"{trunk_mode}: lookahead speedup (s/token off / on)"] = _ratio(
                off["decode"]["s_per_token"], on["decode"]["s_per_token"])
    same = len({tuple(r["generated_ids"]) for r in results}) == 1

    return {
        "bench_version": BENCH_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "checkpoint": {
            "dir": str(d),
            "shape": shape.to_dict(),
            "expert_bytes": shape.expert_bytes,
            "experts_per_moe_layer": cfg.n_experts,
            "top_k": cfg.top_k,
            "moe_layers": len(shape.moe_layers),
            "cold_expert_gb_per_token": len(shape.moe_layers) * cfg.top_k * shape.expert_bytes / 1e9,
            "files_bytes": marker.get("total_bytes"),
            "notes": (_read_json(d / MANIFEST_NAME) or {}).get("notes", []),
        },
        "machine": {"cpus": os.cpu_count(), "threads": threads, "fma_peak": peak},
        "settings": {
            "tokens": tokens, "prompt_tokens": prompt_tokens, "prefill_chunk": prefill_chunk,
            "lookahead": lookahead,
            "cache_slots": slots, "slot_bytes": shape.slot_bytes, "expert_cache_bytes": cache_bytes,
            "reader_threads": reader_threads, "trunk_readers": trunk_readers, "trunk_piece_bytes": trunk_piece_bytes,
            "direct_io_requested": direct_io, "sampling": "greedy",
        },
        "device": device,
        "page_cache": {
            "dropped_between_configs": bool(drop_cache and all(drops)),
            "method": "posix_fadvise(POSIX_FADV_DONTNEED) on every shard file before each configuration"
                      if drop_cache else "not dropped (drop_cache=False)",
            "cold_trunk_each_token_when_streamed": bool(streamed and cold_trunk and drop_cache),
            "note": "routed experts are read with O_DIRECT when direct_io is true (no page cache); "
                    "a resident trunk is read once at open",
        },
        "configs": results,
        "comparison": comparison,
        "same_tokens_across_configs": same,
        "labels": {
            "read_gb_per_s_wall": "trunk + expert bytes read during decode / decode wall time",
            "read_gb_per_s_io_wait": "the same bytes / time the compute thread waited for them "
                                     "(reads overlapped with compute are not in the denominator)",
            "io_wait_share": "engine io_wait_ns / decode wall time",
            "cache_hit_rate": "expert lookups found in the cache (or in flight) / all lookups; "
                              "includes experts the lookahead prefetched (hits_from_lookahead)",
            "lookahead_precision": "lookahead prefetches the real router then used / prefetches issued",
            "lookahead_coverage": "expert lookups served by a lookahead prefetch / all lookups",
            "matmul_gflops": "2 x multiply-adds the BF16 and MXFP4 matmul kernels did (engine counter "
                             "matmul_madds; attention and KDA state updates not counted) / wall seconds",
            "matmul_gflops_vs_peak": "prefill matmul_gflops / machine.fma_peak at the run's thread count",
            "steady_s_per_token": "mean decode seconds per token after the first decoded token",
            "end_to_end_s_per_token": "(prefill seconds + decode seconds) / decoded tokens",
            "device_best_gb_per_s": "the device probe (as k3chat doctor) at its best queue depth",
            "read_vs_device_best": "decode read_gb_per_s_wall / device_best_gb_per_s",
            "disk_bound_s_per_token": "bytes read per decoded token / device_best_gb_per_s",
            "steady_vs_disk_bound": "steady_s_per_token / disk_bound_s_per_token (1.0 = the disk's "
                                    "speed; below 1 the run beat the probe's rate)",
            "trunk_inflight_max": "most streamed trunk read requests in flight at once",
        },
    }


# -------------------------------------------------------------------------------- CLI


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_report(res: dict[str, Any]) -> str:
    """A readable table of a `run_bench` result."""
    ck, dev, st = res["checkpoint"], res["device"], res["settings"]
    lines = [
        f"benchmark checkpoint: {ck['dir']}",
        f"  {ck['moe_layers']} MoE layers x {ck['experts_per_moe_layer']} experts of {ck['expert_bytes']:,} B, "
        f"top-{ck['top_k']}; cold experts per token {ck['cold_expert_gb_per_token']:.3f} GB",
        f"  expert cache {st['cache_slots']} slots ({st['expert_cache_bytes'] / 1e9:.2f} GB), "
        f"{st['reader_threads']} reader threads, {res['machine']['threads']} compute threads; "
        f"{st['prompt_tokens']}-token prompt in chunks of {st.get('prefill_chunk', 64)}, "
        f"{st['tokens']} decoded tokens (greedy)",
    ]
    if "qd8_gb_per_s" in dev:
        depths = ", ".join(f"QD{p['queue_depth']} {p['gb_per_s']:.2f}" for p in dev["phases"])
        lines.append(f"device: {dev['mode']}, {dev['read_bytes']:,} B random reads: {depths} GB/s; "
                     f"best QD{dev.get('best_queue_depth')} {_f(dev.get('best_gb_per_s'), '.2f')} GB/s")
    else:
        lines.append(f"device: {dev.get('error') or dev.get('source')}")
    pc = res["page_cache"]
    lines.append(f"page cache: {'dropped' if pc['dropped_between_configs'] else 'NOT dropped'} between "
                 f"configurations" + ("; dropped before every token when the trunk streams"
                                      if pc["cold_trunk_each_token_when_streamed"] else ""))
    head = (f"{'configuration':<28} {'s/token':>8} {'GB/tok':>7} {'trunk':>6} {'expert':>6} "
            f"{'GB/s wall':>9} {'GB/s io':>8} {'vs QD8':>6} {'hit':>5} {'la used':>7} {'la wast':>7} {'io wait':>7}")
    lines += ["", head, "-" * len(head)]
    for r in res["configs"]:
        dec = r["decode"]
        cmp_ = res["comparison"][r["name"]]
        lines.append(
            f"{r['name']:<28} {_f(dec['s_per_token'], '8.3f')} {_f(dec['gb_read_per_token'], '7.3f')} "
            f"{_f(dec['trunk_gb_per_token'], '6.2f')} {_f(dec['expert_gb_per_token'], '6.3f')} "
            f"{_f(dec['read_gb_per_s_wall'], '9.2f')} {_f(dec['read_gb_per_s_io_wait'], '8.2f')} "
            f"{_f(cmp_['read_vs_device_qd8'], '6.2f')} {_f(dec['cache_hit_rate'], '5.2f')} "
            f"{dec['lookahead_used']:>7d} {dec['lookahead_wasted']:>7d} {_f(dec['io_wait_share'], '7.1%')}")
    head = (f"{'against the disk':<28} {'steady':>7} {'e2e/tok':>7} {'bound':>6} {'vs bnd':>6} "
            f"{'GB/s':>5} {'vs dev':>6} {'pf GB/s':>7} {'pf vs':>6} {'io wait':>7}")
    lines += ["", head, "-" * len(head)]
    for r in res["configs"]:
        c = res["comparison"][r["name"]]
        if "steady_s_per_token" not in c:
            continue
        lines.append(
            f"{r['name']:<28} {_f(c['steady_s_per_token'], '7.3f')} {_f(c['end_to_end_s_per_token'], '7.3f')} "
            f"{_f(c['disk_bound_s_per_token'], '6.3f')} {_f(c['steady_vs_disk_bound'], '6.2f')} "
            f"{_f(c['read_gb_per_s_wall'], '5.2f')} {_f(c['read_vs_device_best'], '6.2f')} "
            f"{_f(c['prefill_read_gb_per_s_wall'], '7.2f')} {_f(c['prefill_read_vs_device_best'], '6.2f')} "
            f"{_f(c['io_wait_share'], '7.1%')}")
    lines.append("steady = decode s/token after the first; e2e/tok = (prefill + decode) s / decoded tokens; "
                 "bound = bytes read per token / the device's best GB/s; pf = prefill")
    streamed = [r for r in res["configs"] if r["trunk_stream"]]
    if streamed:
        piece = st.get("trunk_piece_bytes") or 0
        lines.append(f"streamed trunk: {st.get('trunk_readers')} reader(s), "
                     f"{'whole reads' if not piece else f'{piece >> 20} MiB requests'}; most trunk reads in flight at once: "
                     + ", ".join(f"{r['name']} {r.get('trunk_inflight_max', '-')}" for r in streamed))
    lines.append("")
    peak = res["machine"].get("fma_peak", {})
    if peak.get("gflops_run_threads") is not None:
        th = res["machine"]["threads"]
        lines.append(f"double multiply-add peak ({peak['simd']}): {_f(peak.get('gflops_1_threads'), '.1f')} GFLOP/s "
                     f"on 1 thread" + (f", {peak['gflops_run_threads']:.1f} on {th}" if th > 1 else ""))
    for r in res["configs"]:  # prefill: what a prompt costs in expert reads, time and compute
        pf = r["prefill"]
        lines.append(f"prefill {r['name']}: {_f(pf['seconds'], '.2f')} s, {_f(pf['tokens_per_s'], '.2f')} tok/s, "
                     f"matmuls {_f(pf.get('matmul_gflops'), '.2f')} GFLOP/s"
                     f" ({_f(pf.get('matmul_gflops_vs_peak'), '.1%')} of peak), expert bytes read "
                     f"{pf['expert_bytes_read']:,}")
    for k, v in res["comparison"].items():
        if "speedup" in k:
            lines.append(f"{k}: {_f(v, '.2f')}x")
    lines.append("same greedy tokens in every configuration: " + ("yes" if res["same_tokens_across_configs"] else "NO"))
    lines.append("GB/s wall = bytes read / decode time; GB/s io = bytes read / compute-thread I/O wait; "
                 "hit = expert cache hit rate; io wait = share of decode time waiting for bytes")
    return "\n".join(lines)


class _StderrProgress:
    def __init__(self, label: str) -> None:
        self.label = label
        self.t0 = time.monotonic()
        self.done = False

    def __call__(self, done: int, total: int) -> None:
        el = max(time.monotonic() - self.t0, 1e-9)
        pct = 100.0 * done / total if total else 100.0
        sys.stderr.write(f"\r{self.label}: {done / 1e9:6.2f} / {total / 1e9:.2f} GB ({pct:5.1f}%), "
                         f"{done / el / 1e6:6.0f} MB/s ")
        if done >= total and not self.done:
            self.done = True
            sys.stderr.write("\n")
        sys.stderr.flush()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="k3chat bench",
        description="Measure expert streaming on a benchmark checkpoint with the real expert size "
                    "(built once, cached).")
    ap.add_argument("--dir", help=f"benchmark checkpoint directory (default: {default_bench_dir()})")
    ap.add_argument("--tokens", type=int, default=8, help="decoded tokens per configuration (default 8)")
    ap.add_argument("--prompt-tokens", type=int, default=8, help="prompt length (default 8)")
    ap.add_argument("--prefill-chunk", type=int, default=64,
                    help="prompt tokens per engine pass (default 64; `k3chat plan --prompt-tokens N` "
                         "gives the chunk a budget allows)")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: usable CPUs)")
    ap.add_argument("--lookahead", type=int, default=16, help="router lookahead experts (default 16)")
    ap.add_argument("--trunk-readers", type=int, default=1,
                    help="threads reading the streamed trunk (default 1, the engine's)")
    ap.add_argument("--trunk-piece-mb", type=int, default=0,
                    help="MiB per streamed trunk read request, for several readers (default 0: whole reads)")
    ap.add_argument("--cache-slots", type=int, default=None,
                    help="expert cache slots (default 40: fewer than one layer's 64 experts)")
    ap.add_argument("--no-stream", action="store_true", help="skip the streamed-trunk configurations")
    ap.add_argument("--json", dest="json_out", help=f"write the JSON result here (default: DIR/{RESULT_NAME})")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the checkpoint even if it is complete")
    ap.add_argument("--probe-mb", type=int, default=256,
                    help="size of the device probe's temporary file in MiB, as k3chat doctor (default 256)")
    ap.add_argument("--probe-seconds", type=float, default=1.0,
                    help="seconds of probe reading per queue depth (default 1.0)")
    return ap


def main_bench(argv: Sequence[str], *, shape: BenchShape = REAL_SHAPE) -> int:
    """`k3chat bench [--dir D] [--tokens N] [--threads N] [--json OUT] [--rebuild]`.

    Exit 0 on success, 1 on a runtime failure, 2 on a usage error, 5 when interrupted.
    """
    if "--speculative" in argv:  # its own measurement (engine/spec_bench.py)
        from .spec_bench import main_spec_bench
        return main_spec_bench([a for a in argv if a != "--speculative"])
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    bad = [f"{flag} must be >= {lo}" for flag, v, lo in (
        ("--tokens", args.tokens, 1), ("--prompt-tokens", args.prompt_tokens, 1),
        ("--prefill-chunk", args.prefill_chunk, 1),
        ("--threads", args.threads, 1), ("--lookahead", args.lookahead, 0),
        ("--trunk-readers", args.trunk_readers, 1), ("--trunk-piece-mb", args.trunk_piece_mb, 0),
        ("--cache-slots", args.cache_slots, shape.num_experts_per_token + 1)) if v is not None and v < lo]
    if args.probe_mb * (1 << 20) < 2 * 17_547_264:
        bad.append("--probe-mb must be at least 34 (two expert-sized reads)")
    if not args.probe_seconds > 0:
        bad.append("--probe-seconds must be positive")
    if args.threads is not None and args.threads > 64:
        bad.append("--threads must be <= 64")
    if args.trunk_readers > 32:
        bad.append("--trunk-readers must be <= 32")
    if bad:
        print("k3chat bench: " + "; ".join(bad), file=sys.stderr)
        return EXIT_USAGE
    d = Path(args.dir) if args.dir else default_bench_dir()
    out = Path(args.json_out) if args.json_out else d / RESULT_NAME

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from .errors import CheckpointError
    from .model import EngineError

    try:
        build_bench_checkpoint(d, shape=shape, rebuild=args.rebuild, log=log,
                               progress=_StderrProgress("writing benchmark checkpoint"))
        res = run_bench(d, tokens=args.tokens, prompt_tokens=args.prompt_tokens, threads=args.threads,
                        lookahead=args.lookahead, cache_slots=args.cache_slots,
                        trunk_readers=args.trunk_readers, trunk_piece_bytes=args.trunk_piece_mb << 20,
                        prefill_chunk=args.prefill_chunk,
                        streamed=not args.no_stream, probe_bytes=args.probe_mb << 20,
                        probe_seconds=args.probe_seconds, log=log)
        print(format_report(res))
        make_private_dirs(out.parent)
        write_private(out, json.dumps(res, indent=2) + "\n")
        print(f"JSON written to {out}")
    except KeyboardInterrupt:
        print("\nk3chat bench: interrupted (a half-built checkpoint is rebuilt next time)", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (BenchError, EngineError, CheckpointError, OSError, ValueError) as exc:
        print(f"k3chat bench: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main_bench(sys.argv[1:]))
