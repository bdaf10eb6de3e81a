"""The memory planner: one budget split into floor, trunk and expert cache (design 2.3).

`k3chat plan MODEL_DIR [--memory X] [--context N]` prints the split before anything loads.
Every size comes from the tensor table of the checkpoint in hand (shard headers when the
shards are present, else the index's names with the catalogue's shapes and the dtypes the
spec expects), never from constants, so the same code plans the real K3 and the fixtures.

Order of the split (trunk before experts: a peer measured trunk-first 1.69x faster at the
same budget):

1. **Floor** (always resident): embeddings and lm_head, the output norms, fp32 copies of the
   small vectors, the session state for the requested context (KDA state is fixed; the MLA
   latent cache grows by (kv_lora + rope) x 4 B per position per MLA layer), one turn
   snapshot of the KDA state, work buffers (an estimate for a prefill chunk of 64 tokens),
   and I/O staging buffers.
2. **Trunk**: all resident if it fits (with the minimum expert cache beside it). Otherwise
   the largest layers are pinned and the rest stream through a ring of 2 slots, each slot as
   large as the largest streamed layer. The most bytes are pinned that the budget allows.
3. **Expert cache**: the rest, in whole slots. A plan needs at least one layer's whole top-k
   plus one spare slot (the engine's expert store refuses fewer), else it is refused.

A budget is a ceiling: total <= budget always, and a budget above what the machine can hold
without swapping is refused unless `check_machine=False`.

Presets for the real Kimi K3 (its config.json and index; context 8,192 tokens, one turn
snapshot; GiB throughout; "streamed" is trunk read per token, "cold read" adds every MoE
layer's top-16 experts with an empty cache):

| preset | budget | floor | trunk | expert cache | total | cold read/token |
|---|---|---|---|---|---|---|
| small  | 8G   | refused: the smallest plan needs 10.37 (floor 5.73 + ring 2 x 2.18 sized for layer 0 + 17 expert slots 0.28) | | | | |
| medium | 16G  | 5.73 | 5 layers pinned (0-2, 4-5) 6.90 + ring 2 x 1.18; 88 layers (94.44) streamed | 61 slots, 1.00 | 15.99 | 118.49 |
| large  | 64G  | 5.73 | 46 layers pinned 55.31 + ring 2 x 1.18; 47 layers (46.03) streamed | 36 slots, 0.59 | 63.99 | 70.08 |
| huge   | 256G | 5.73 | all 93 layers resident, 101.34 | 9,109 slots, 148.93 | 256.00 | 24.06 |

Floor at 8,192 tokens: embeddings 2.19 + lm_head 2.19 + KDA state 0.43 + snapshot 0.43 + MLA
cache 0.42 + work 0.05 + staging and fp32 vectors 0.02. The smallest K3 budget is 9.94 GiB at
1 token, 10.37 at 8K, 11.64 at 32K and 16.72 at 128K; 16G holds at most 117,060 tokens.

(`python -m k3engine.planner DIR --memory large --no-machine-check` prints any of these in
full on any machine.)
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import sizes as sz
from .catalog import TensorSpec, expected_tensors, expert_names, model_specs, trunk_specs
from .config import ModelConfig, load_config
from .errors import CheckpointError
from .safetensors_io import (DTYPE_SIZES, INDEX_NAME, LANGUAGE_PREFIX, SINGLE_NAME,
                             JSONStrictError, open_checkpoint, strict_json_loads)

__all__ = [
    "Plan", "PlanError", "TensorSizes", "make_plan", "minimum_budget", "max_context",
    "tensor_sizes_from_dir", "sizes_from_table", "sizes_from_names", "work_buffer_parts",
    "main_plan", "DEFAULT_CONTEXT", "PREFILL_CHUNK", "RING_SLOTS", "IO_ALIGN",
]

DEFAULT_CONTEXT = 8192
PREFILL_CHUNK = 64  # tokens per prefill call the work buffers are sized for
FLOAT = 4  # fp32 activations and state
IO_ALIGN = 4096  # direct-I/O alignment of offsets, lengths and buffers
RING_SLOTS = 2  # a streamed trunk needs a reader one layer ahead, so never one slot
SPARE_EXPERT_SLOTS = 1  # the expert store needs one free slot beyond a layer's top-k
IO_READERS = 8  # reader threads (queue depth 8, what `k3chat doctor` measures)
# An allowance per reader thread for reads that do not land in a slot (per-tensor fallback
# reads of a checkpoint whose runs are not contiguous, unaligned small trunk tensors). The
# expert store reads whole runs straight into its slots, so this stays small.
STAGING_PER_READER = 1 * sz.MiB
MAX_COMPUTE_THREADS = 64  # the engine's thread cap; MLA score rows are per thread
DEFAULT_SNAPSHOTS = 1  # the turn-boundary snapshot that makes "regenerate" cheap (design 2.5)

GZ_INDEX_NAME = INDEX_NAME + ".gz"
# Tensors the spec expects in F32 (spec 3.3); with them the real trunk is 108,811,694,848 B.
_F32_SUFFIXES = ("_conv1d.weight", ".dt_bias", ".A_log")


# ---------------------------------------------------------------------------------------
# The tensor table, aggregated
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSizes:
    """Byte sizes the planner needs, summed from a checkpoint's tensor table."""

    layer_trunk: tuple[int, ...]  # bytes of each layer's trunk tensors, layer 0 first
    embed: int
    lm_head: int
    model_other: int  # final norm and the output AttnRes tensors
    vector_widening: int  # extra bytes when the small vectors are held as fp32
    expert_bytes: int  # one routed expert's six tensors
    n_experts_total: int  # routed experts over all MoE layers
    source: str  # "shard headers", "index + catalogue" or a mix

    @property
    def trunk_total(self) -> int:
        return sum(self.layer_trunk)


def _expected_nbytes(cfg: ModelConfig, name: str, spec: TensorSpec) -> int:
    """Bytes of a tensor known only by name: the catalogue's shape, the spec's dtype."""
    shape = spec.shape
    if spec.min_len:
        # A_log ships zero-padded to the KDA head width (128 for 96 heads in the release;
        # the fixture writer pads the same way), so its length is max(H_k, D).
        shape = (max(shape[0], cfg.kda_head_dim),)
    if spec.kind == "expert":
        dtype = "U8"
    elif name.endswith(_F32_SUFFIXES):
        dtype = "F32"
    else:
        dtype = "BF16"
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * DTYPE_SIZES[dtype]


def _widening(spec: TensorSpec, nbytes: int) -> int:
    """Extra bytes if this tensor is a small vector the engine keeps widened to fp32.

    Norm gains, biases, A_log, dt_bias and the [1, E] AttnRes projections are held as fp32
    arrays (matrices stay as stored and are widened row by row in the kernels).
    """
    shape = spec.shape
    is_vector = len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)
    if spec.kind == "expert" or not is_vector:
        return 0
    numel = shape[-1]  # for A_log: only the used H_k entries are kept
    return max(0, numel * FLOAT - nbytes)


def _name_problems(expected: Mapping[str, TensorSpec], names: Iterable[str]) -> list[str]:
    have = set(names)
    missing = [n for n in expected if n not in have]
    extra = sorted(n for n in have - expected.keys() if n.startswith(LANGUAGE_PREFIX))
    lines = []
    if missing:
        lines.append(f"{len(missing)} tensor(s) the config needs are not listed, e.g. "
                     f"{', '.join(missing[:3])}")
    if extra:
        lines.append(f"{len(extra)} listed tensor(s) are not used by this config, e.g. "
                     f"{', '.join(extra[:3])}")
    return lines


def sizes_from_table(cfg: ModelConfig, nbytes: Mapping[str, int],
                     source: str = "tensor table") -> TensorSizes:
    """Aggregate a name -> bytes table (language_model tensors; others are ignored)."""
    expected = expected_tensors(cfg)
    problems = _name_problems(expected, nbytes)
    if problems:
        raise CheckpointError(f"the tensor table does not match config.json: "
                              f"{'; '.join(problems)}. The checkpoint and config.json must "
                              f"come from the same release")
    return _aggregate(cfg, expected, nbytes, source)


def _aggregate(cfg: ModelConfig, expected: Mapping[str, TensorSpec], nbytes: Mapping[str, int],
               source: str) -> TensorSizes:
    """Sum a checked table (every expected name present) into the planner's sizes."""
    layer_trunk = tuple(sum(nbytes[n] for n in trunk_specs(cfg, L)) for L in range(cfg.n_layers))
    widening = sum(_widening(spec, nbytes[n]) for n, spec in expected.items()
                   if spec.kind != "expert")
    expert_bytes = _expert_bytes(cfg, nbytes)
    models = model_specs(cfg)
    embed_name = next(n for n in models if n.endswith("embed_tokens.weight"))
    head_name = next(n for n in models if n.endswith("lm_head.weight"))
    other = sum(nbytes[n] for n in models if n not in (embed_name, head_name))
    return TensorSizes(
        layer_trunk=layer_trunk, embed=nbytes[embed_name], lm_head=nbytes[head_name],
        model_other=other, vector_widening=widening, expert_bytes=expert_bytes,
        n_experts_total=len(cfg.moe_layers) * cfg.n_experts, source=source)


def _expert_bytes(cfg: ModelConfig, nbytes: Mapping[str, int]) -> int:
    """One expert's bytes; every expert must have the size the config implies."""
    want = cfg.expert_bytes
    for layer in cfg.moe_layers:
        for e in range(cfg.n_experts):
            got = sum(nbytes[n] for n in expert_names(layer, e))
            if got != want:
                raise CheckpointError(
                    f"routed expert {e} of layer {layer} is {got} bytes, but the config "
                    f"implies 3 x {cfg.expert_width} x {cfg.latent_dim} x (1/2 + 1/32) = "
                    f"{want}; the checkpoint and config.json do not belong together")
    return want


def sizes_from_names(cfg: ModelConfig, names: Iterable[str],
                     headers: Mapping[str, Any] | None = None) -> TensorSizes:
    """Sizes when only some (or no) shard headers are at hand.

    `names` are the index's language_model names; a name found in `headers` (TensorInfo
    from a validated shard header) takes its real size, the rest the spec's expectation.
    """
    headers = headers or {}
    expected = expected_tensors(cfg)
    names = set(names) | set(headers)
    problems = _name_problems(expected, names)
    misshapen = [f"{n}: {p}" for n, info in headers.items()
                 if n in expected and (p := expected[n].problem(info))]
    if misshapen:
        problems.append(f"{len(misshapen)} tensor(s) misshapen or of the wrong dtype, e.g. "
                        f"{'; '.join(misshapen[:3])}")
    if problems:
        raise CheckpointError(f"the checkpoint does not match config.json: "
                              f"{'; '.join(problems)}. The shards, index and config.json must "
                              f"come from the same release")
    table = {n: headers[n].nbytes if n in headers else _expected_nbytes(cfg, n, spec)
             for n, spec in expected.items()}
    found = sum(n in headers for n in expected)
    source = ("shard headers" if found == len(expected) else
              "index + catalogue" if found == 0 else
              f"shard headers for {found} of {len(expected)} tensors, index + catalogue "
              f"for the rest")
    return _aggregate(cfg, expected, table, source)


def _gz_index_names(path: Path) -> list[str]:
    """Names of a gzipped index (the reference data ships the release's index this way)."""
    try:
        root = strict_json_loads(gzip.decompress(path.read_bytes()).decode("utf-8"))
    except (OSError, EOFError, UnicodeDecodeError, JSONStrictError) as exc:
        raise CheckpointError(f"{path}: cannot read the index ({exc}); re-download it") from None
    if not isinstance(root, dict) or not isinstance(root.get("weight_map"), dict):
        raise CheckpointError(f"{path}: must be a JSON object with a 'weight_map' object")
    return [n for n in root["weight_map"] if isinstance(n, str)]


def tensor_sizes_from_dir(model_dir: str | Path, cfg: ModelConfig | None = None) -> TensorSizes:
    """Sizes for the checkpoint in `model_dir`, reading headers only (no tensor data).

    With `model.safetensors.index.json` (or `model.safetensors`) the index and every present
    shard header are validated and used; shards not on disk are sized from the catalogue.
    With only `model.safetensors.index.json.gz` (reference data) the names come from it.
    """
    model_dir = Path(model_dir)
    cfg = cfg if cfg is not None else load_config(model_dir)
    if (model_dir / INDEX_NAME).exists() or (model_dir / SINGLE_NAME).exists():
        ckpt = open_checkpoint(model_dir)
        return sizes_from_names(cfg, ckpt.assigned, ckpt.tensors)
    gz = model_dir / GZ_INDEX_NAME
    if gz.exists():
        return sizes_from_names(cfg, _gz_index_names(gz))
    raise CheckpointError(f"{model_dir}: no tensor index found (expected {INDEX_NAME} or "
                          f"{SINGLE_NAME}); the planner needs config.json and the index")


# ---------------------------------------------------------------------------------------
# Floor parts
# ---------------------------------------------------------------------------------------


def kda_state_bytes(cfg: ModelConfig) -> int:
    """Fixed per-sequence KDA state: S (H_k x D x D) and conv histories (3 x P x (K-1))."""
    per_layer = (cfg.kda_heads * cfg.kda_head_dim ** 2
                 + 3 * cfg.kda_width * (cfg.conv_kernel - 1)) * FLOAT
    return len(cfg.kda_layers) * per_layer


def mla_bytes_per_position(cfg: ModelConfig) -> int:
    """Latent cache row (normalized latent + rope key) of every MLA layer, per position."""
    return len(cfg.mla_layers) * cfg.kv_a_dim * FLOAT


def work_buffer_parts(cfg: ModelConfig, context: int,
                      chunk: int = PREFILL_CHUNK) -> dict[str, int]:
    """Estimated activation and scratch bytes for one prefill chunk of `chunk` tokens.

    Mirrors how the forward pass is laid out: the residual stream and the AttnRes block
    snapshots live for the whole pass; each sublayer's scratch is reused, so only the
    largest counts; MLA score rows are per compute thread and grow with the context.
    """
    t, e = chunk, cfg.hidden
    p, d, hk = cfg.kda_width, cfg.kda_head_dim, cfg.kda_heads
    h, lat = cfg.mla_heads, cfg.latent_dim
    kda = t * (6 * p + d + hk) + 3 * (t + cfg.conv_kernel - 1) * p
    mla = t * (2 * cfg.q_lora_rank + h * cfg.mla_qk_dim + h * cfg.kv_a_dim + cfg.kv_a_dim
               + 2 * cfg.mla_value_width)
    dense = 2 * t * cfg.dense_width
    moe = t * (2 * cfg.n_experts + 2 * cfg.top_k + cfg.top_k * lat + 4 * lat + e
               + 2 * cfg.shared_width + 2 * cfg.expert_width)
    return {
        "residual": (cfg.n_block_snapshots + 4) * t * e * FLOAT,
        "sublayer": max(kda, mla, dense, moe) * FLOAT,
        "attention rows": MAX_COMPUTE_THREADS * (2 * cfg.kv_lora_rank + context) * FLOAT,
        "logits": cfg.vocab * FLOAT,
    }


def _align(n: int) -> int:
    return -(-n // IO_ALIGN) * IO_ALIGN


def slot_bytes(run_bytes: int) -> int:
    """A read slot for a run that may start anywhere: direct I/O reads whole aligned pages,
    so the span can reach one page before and one after (the expert store does the same)."""
    return _align(run_bytes + 2 * IO_ALIGN)


@dataclass(frozen=True)
class _Floor:
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def _floor(cfg: ModelConfig, ts: TensorSizes, context: int, snapshots: int) -> _Floor:
    state = kda_state_bytes(cfg)
    return _Floor({
        "embeddings": ts.embed,
        "lm_head": ts.lm_head,
        "output norms, fp32 vectors": ts.model_other + ts.vector_widening,
        "KDA state": state,
        "turn snapshots": snapshots * state,
        "MLA latent cache": context * mla_bytes_per_position(cfg),
        "work buffers": sum(work_buffer_parts(cfg, context).values()),
        "I/O staging": IO_READERS * STAGING_PER_READER,
    })


# ---------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------


class PlanError(Exception):
    """The budget cannot hold a plan (or the machine cannot hold the budget).

    The message gives the numbers and what to do; `minimum` is the smallest budget that
    works at `context`, `max_context` the largest context that fits `budget` (None: none).
    """

    def __init__(self, message: str, *, budget: int, context: int, minimum: int | None = None,
                 max_context: int | None = None, machine_limit: int | None = None) -> None:
        super().__init__(message)
        self.budget = budget
        self.context = context
        self.minimum = minimum
        self.max_context = max_context
        self.machine_limit = machine_limit


@dataclass(frozen=True)
class Plan:
    """A budget split. Every field is bytes unless named otherwise."""

    budget: int
    context: int  # tokens the session state is sized for
    prefill_chunk: int
    # floor
    embed_bytes: int
    lm_head_bytes: int
    model_other_bytes: int  # output norms + fp32 copies of the small vectors
    kda_state_bytes: int
    snapshots: int
    snapshot_bytes: int
    mla_cache_bytes: int
    mla_bytes_per_position: int
    work_bytes: int
    staging_bytes: int
    # trunk
    trunk_bytes: int  # the whole trunk, resident or not
    trunk_resident: bool
    pinned_layers: tuple[int, ...]  # held in memory (all layers when trunk_resident)
    pinned_bytes: int
    streamed_layers: tuple[int, ...]  # read through the ring every token
    streamed_bytes: int
    ring_slots: int
    ring_slot_bytes: int
    # expert cache
    expert_bytes: int  # one routed expert as stored
    expert_slot_bytes: int  # one cache slot (expert + direct-I/O slack)
    expert_slots: int
    expert_cache_bytes: int
    min_expert_slots: int
    experts_total: int  # routed experts in the checkpoint
    top_k: int
    moe_layers: int
    sizes_source: str
    machine_limit: int | None = None  # what the machine could hold, when it was checked
    layer_bytes: tuple[int, ...] = field(default=(), repr=False)  # trunk bytes per layer

    @property
    def floor_parts(self) -> dict[str, int]:
        return {"embeddings": self.embed_bytes, "lm_head": self.lm_head_bytes,
                "output norms, fp32 vectors": self.model_other_bytes,
                "KDA state": self.kda_state_bytes, "turn snapshots": self.snapshot_bytes,
                "MLA latent cache": self.mla_cache_bytes, "work buffers": self.work_bytes,
                "I/O staging": self.staging_bytes}

    @property
    def floor_bytes(self) -> int:
        return sum(self.floor_parts.values())

    @property
    def ring_bytes(self) -> int:
        return self.ring_slots * self.ring_slot_bytes

    @property
    def trunk_plan_bytes(self) -> int:
        """Memory the trunk takes under this plan: pinned layers plus the ring."""
        return self.pinned_bytes + self.ring_bytes

    @property
    def total(self) -> int:
        return self.floor_bytes + self.trunk_plan_bytes + self.expert_cache_bytes

    @property
    def cold_read_per_token(self) -> int:
        """Bytes read per token with a cold expert cache: streamed trunk + every top-k."""
        return self.streamed_bytes + self.moe_layers * self.top_k * self.expert_bytes

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("layer_bytes")
        out["pinned_layers"] = list(self.pinned_layers)
        out["streamed_layers"] = list(self.streamed_layers)
        out.update(floor_parts=self.floor_parts, floor_bytes=self.floor_bytes,
                   ring_bytes=self.ring_bytes, trunk_plan_bytes=self.trunk_plan_bytes,
                   total=self.total, headroom=self.budget - self.total,
                   cold_read_per_token=self.cold_read_per_token)
        return out

    def table(self) -> str:
        return _render_table(self)


def _ranges(layers: Sequence[int]) -> str:
    """0, 1, 2, 5, 9, 10 -> '0-2, 5, 9-10'."""
    out: list[str] = []
    items = sorted(layers)
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ", ".join(out) if out else "none"


def _row(label: str, nbytes: int, note: str = "") -> str:
    return f"  {label:<30} {nbytes:>19,} B {sz.format_bytes(nbytes):>12}  {note}".rstrip()


def _render_table(p: Plan) -> str:
    per_pos = p.mla_bytes_per_position
    lines = [f"memory plan: budget {sz.format_bytes(p.budget)} ({p.budget:,} B), context "
             f"{p.context:,} tokens; sizes from {p.sizes_source}",
             "floor (always resident)"]
    notes = {"MLA latent cache": f"{p.context:,} positions x {per_pos:,} B",
             "work buffers": f"estimate, prefill chunk of {p.prefill_chunk} tokens",
             "turn snapshots": f"{p.snapshots} x KDA state",
             "KDA state": "fixed, whatever the context",
             "I/O staging": f"{IO_READERS} readers x {STAGING_PER_READER // sz.MiB} MiB"}
    lines += [_row(k, v, notes.get(k, "")) for k, v in p.floor_parts.items()]
    lines.append(_row("floor total", p.floor_bytes))
    n_layers = len(p.pinned_layers) + len(p.streamed_layers)
    lines.append(f"trunk ({p.trunk_bytes:,} B in {n_layers} layers)")
    if p.trunk_resident:
        lines.append(_row("resident (all layers)", p.pinned_bytes))
    else:
        lines.append(_row(f"pinned: {len(p.pinned_layers)} layers", p.pinned_bytes,
                          f"layers {_ranges(p.pinned_layers)}"))
        lines.append(_row(f"streamed: {len(p.streamed_layers)} layers", p.streamed_bytes,
                          "read every token, not held"))
        lines.append(_row(f"ring: {p.ring_slots} slots", p.ring_bytes,
                          f"{p.ring_slot_bytes:,} B each (largest streamed layer)"))
    lines.append("expert cache")
    lines.append(_row(f"{p.expert_slots:,} slots", p.expert_cache_bytes,
                      f"{p.expert_slot_bytes:,} B each (expert {p.expert_bytes:,} B + "
                      f"direct-I/O slack); minimum {p.min_expert_slots}, checkpoint has "
                      f"{p.experts_total:,}"))
    lines.append(_row("total", p.total, f"headroom {p.budget - p.total:,} B"))
    lines.append(f"cold read per token: {sz.format_bytes(p.cold_read_per_token)} "
                 f"(streamed trunk {sz.format_bytes(p.streamed_bytes)} + top-{p.top_k} experts of "
                 f"{p.moe_layers} MoE layers)")
    if p.machine_limit is not None:
        lines.append(f"machine: {sz.format_bytes(p.machine_limit)} can be held without "
                     f"swapping")
    return "\n".join(lines)


@dataclass(frozen=True)
class _Trunk:
    resident: bool
    pinned: tuple[int, ...]
    streamed: tuple[int, ...]
    ring_slot: int

    def cost(self, layer_bytes: Sequence[int]) -> int:
        ring = 0 if self.resident else RING_SLOTS * self.ring_slot
        return sum(layer_bytes[L] for L in self.pinned) + ring


def _trunk_options(layer_bytes: Sequence[int]) -> list[_Trunk]:
    """Every trunk layout worth considering, most pinned bytes first.

    Pinning the p largest layers and streaming the rest: for a fixed count p that pins
    the most bytes and also makes the ring (sized by the largest streamed layer) smallest.
    """
    everything = tuple(range(len(layer_bytes)))
    options = [_Trunk(True, everything, (), 0)]
    order = sorted(everything, key=lambda L: (-layer_bytes[L], L))
    for p in range(len(order) - 1, -1, -1):
        streamed = tuple(sorted(order[p:]))
        options.append(_Trunk(False, tuple(sorted(order[:p])), streamed,
                              slot_bytes(layer_bytes[order[p]])))
    return options


def _min_expert_slots(cfg: ModelConfig, ts: TensorSizes) -> int:
    if ts.n_experts_total == 0:
        return 0
    return min(cfg.top_k + SPARE_EXPERT_SLOTS, ts.n_experts_total)


def minimum_budget(cfg: ModelConfig, ts: TensorSizes, context: int,
                   snapshots: int = DEFAULT_SNAPSHOTS) -> int:
    """The smallest budget any plan at `context` fits in."""
    floor = _floor(cfg, ts, context, snapshots).total
    experts = _min_expert_slots(cfg, ts) * slot_bytes(ts.expert_bytes)
    trunk = min(t.cost(ts.layer_trunk) for t in _trunk_options(ts.layer_trunk))
    return floor + trunk + experts


def max_context(cfg: ModelConfig, ts: TensorSizes, budget: int,
                snapshots: int = DEFAULT_SNAPSHOTS, limit: int = 1 << 31) -> int | None:
    """The largest context a plan fits at `budget`, or None if not even one token does."""
    if minimum_budget(cfg, ts, 1, snapshots) > budget:
        return None
    lo, hi = 1, limit
    while lo < hi:  # the minimum grows with the context, so bisect
        mid = (lo + hi + 1) // 2
        if minimum_budget(cfg, ts, mid, snapshots) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _trunk_text(ts: TensorSizes, trunk: _Trunk) -> str:
    if trunk.resident:
        return f"trunk resident {sz.format_bytes(trunk.cost(ts.layer_trunk))}"
    biggest = max(trunk.streamed, key=lambda L: ts.layer_trunk[L])
    text = (f"trunk ring {RING_SLOTS} x {sz.format_bytes(trunk.ring_slot)} (the largest "
            f"streamed layer is layer {biggest}, {ts.layer_trunk[biggest]:,} B)")
    if trunk.pinned:
        pinned = trunk.cost(ts.layer_trunk) - RING_SLOTS * trunk.ring_slot
        text += f" + {len(trunk.pinned)} pinned layer(s) {sz.format_bytes(pinned)}"
    return text


def _refusal(cfg: ModelConfig, ts: TensorSizes, budget: int, context: int,
             snapshots: int, floor: _Floor) -> PlanError:
    need = minimum_budget(cfg, ts, context, snapshots)
    smallest = min(_trunk_options(ts.layer_trunk), key=lambda t: t.cost(ts.layer_trunk))
    k, slot = _min_expert_slots(cfg, ts), slot_bytes(ts.expert_bytes)
    fits = max_context(cfg, ts, budget, snapshots)
    parts = ", ".join(f"{name} {sz.format_bytes(v)}" for name, v in floor.parts.items())
    advice = f"What to do: give --memory {_round_up_g(need)} or more"
    if fits is not None:
        advice += f", or a context of at most {fits:,} tokens at this budget."
    else:
        advice += (" (a smaller context does not help: even one token needs "
                   f"{sz.format_bytes(minimum_budget(cfg, ts, 1, snapshots))}).")
    lines = [
        f"memory plan refused: a budget of {sz.format_bytes(budget)} ({budget:,} B) cannot "
        f"hold the smallest plan for a context of {context:,} tokens, which needs "
        f"{sz.format_bytes(need)} ({need:,} B):",
        f"  floor {sz.format_bytes(floor.total)} ({parts});",
        f"  {_trunk_text(ts, smallest)};",
        f"  expert cache {k} slots x {slot:,} B = {sz.format_bytes(k * slot)} (one layer's "
        f"top-{cfg.top_k} + {SPARE_EXPERT_SLOTS} spare).",
        advice,
    ]
    return PlanError("\n".join(lines), budget=budget, context=context, minimum=need,
                     max_context=fits)


def _round_up_g(nbytes: int) -> str:
    """The budget string to suggest: whole GiB (or MiB for tiny models), rounded up."""
    if nbytes >= sz.GiB:
        return f"{-(-nbytes // sz.GiB)}G"
    return f"{-(-nbytes // sz.MiB)}M"


def _check_machine(budget: int, context: int) -> int:
    """Refuse a budget the machine cannot hold without swapping; return what it can hold."""
    machine = sz.read_machine_memory()
    if budget > machine.limit:
        limit, auto = sz.format_bytes(machine.limit), sz.format_bytes(sz.auto_budget(machine))
        raise PlanError(
            f"memory plan refused: the budget {sz.format_bytes(budget)} ({budget:,} B) is more "
            f"than this machine can hold without swapping, {limit} ({machine.limit:,} B; "
            f"{machine.describe()}). k3chat never relies on swap. What to do: use "
            f"--memory auto ({auto}) or a budget of at most {limit}, or free memory and retry.",
            budget=budget, context=context, machine_limit=machine.limit)
    return machine.limit


def make_plan(cfg: ModelConfig, tensor_sizes: TensorSizes | Mapping[str, int],
              budget_bytes: int, context: int = DEFAULT_CONTEXT, *,
              check_machine: bool = True, snapshots: int = DEFAULT_SNAPSHOTS) -> Plan:
    """Split `budget_bytes` for `context` tokens; raise PlanError (with numbers) if it cannot.

    `tensor_sizes` is a TensorSizes or a name -> bytes table of the checkpoint.
    """
    ts = (tensor_sizes if isinstance(tensor_sizes, TensorSizes)
          else sizes_from_table(cfg, tensor_sizes))
    if context < 1:
        raise PlanError(f"context must be at least 1 token, got {context}", budget=budget_bytes,
                        context=context)
    if budget_bytes < 1:
        raise PlanError(f"budget must be positive, got {budget_bytes}", budget=budget_bytes,
                        context=context)
    machine_limit = _check_machine(budget_bytes, context) if check_machine else None
    floor = _floor(cfg, ts, context, snapshots)
    slot = slot_bytes(ts.expert_bytes)
    k = _min_expert_slots(cfg, ts)
    room = budget_bytes - floor.total - k * slot
    # Trunk first: the layout pinning the most bytes that fits beside the minimum cache.
    trunk = next((t for t in _trunk_options(ts.layer_trunk)
                  if t.cost(ts.layer_trunk) <= room), None)
    if trunk is None:
        raise _refusal(cfg, ts, budget_bytes, context, snapshots, floor)
    rest = budget_bytes - floor.total - trunk.cost(ts.layer_trunk)
    slots = min(rest // slot, ts.n_experts_total)
    return Plan(
        budget=budget_bytes, context=context, prefill_chunk=PREFILL_CHUNK,
        embed_bytes=floor.parts["embeddings"], lm_head_bytes=floor.parts["lm_head"],
        model_other_bytes=floor.parts["output norms, fp32 vectors"],
        kda_state_bytes=floor.parts["KDA state"],
        snapshots=snapshots, snapshot_bytes=floor.parts["turn snapshots"],
        mla_cache_bytes=floor.parts["MLA latent cache"],
        mla_bytes_per_position=mla_bytes_per_position(cfg),
        work_bytes=floor.parts["work buffers"], staging_bytes=floor.parts["I/O staging"],
        trunk_bytes=ts.trunk_total, trunk_resident=trunk.resident,
        pinned_layers=trunk.pinned, pinned_bytes=sum(ts.layer_trunk[L] for L in trunk.pinned),
        streamed_layers=trunk.streamed,
        streamed_bytes=sum(ts.layer_trunk[L] for L in trunk.streamed),
        ring_slots=0 if trunk.resident else RING_SLOTS,
        ring_slot_bytes=0 if trunk.resident else trunk.ring_slot,
        expert_bytes=ts.expert_bytes, expert_slot_bytes=slot, expert_slots=slots,
        expert_cache_bytes=slots * slot, min_expert_slots=k,
        experts_total=ts.n_experts_total, top_k=cfg.top_k, moe_layers=len(cfg.moe_layers),
        sizes_source=ts.source, machine_limit=machine_limit, layer_bytes=ts.layer_trunk,
    )


# ---------------------------------------------------------------------------------------
# `k3chat plan`
# ---------------------------------------------------------------------------------------

EXIT_OK = 0
EXIT_USAGE = 2


def _context_arg(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"context must be at least 1 token, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="k3chat plan",
        description="Print the memory plan for a model before loading anything.")
    ap.add_argument("model_dir", help="checkpoint directory (config.json and the index)")
    ap.add_argument("--memory", default="auto",
                    help="budget: 12G, 512M, 1.5T, 12GiB, 12GB (decimal), a preset "
                         f"({', '.join(f'{k}={v // sz.GiB}G' for k, v in sz.PRESETS.items())}) "
                         "or auto (default)")
    ap.add_argument("--context", type=_context_arg, default=DEFAULT_CONTEXT,
                    help=f"tokens of context to size the session for (default {DEFAULT_CONTEXT})")
    ap.add_argument("--json", dest="json_out", help="also write the plan as JSON to this file")
    ap.add_argument("--no-machine-check", action="store_true",
                    help="plan for another machine: do not compare the budget with this "
                         "machine's available memory")
    return ap


def _write_json(path: str, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def main_plan(argv: Sequence[str]) -> int:
    """`k3chat plan MODEL_DIR [--memory X] [--context N] [--json OUT]`: 0 ok, 2 refused."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:  # argparse: 2 on usage errors, 0 for --help
        return int(exc.code or 0)
    check = not args.no_machine_check
    try:
        budget = sz.parse_memory(args.memory)
        cfg = load_config(args.model_dir)
        ts = tensor_sizes_from_dir(args.model_dir, cfg)
        # `auto` is derived from the machine, so checking it against the machine is moot.
        plan = make_plan(cfg, ts, budget, args.context,
                         check_machine=check and not sz.is_auto(args.memory))
    except (sz.MemorySizeError, CheckpointError, PlanError, OSError) as exc:
        print(f"k3chat plan: {exc}", file=sys.stderr)
        if isinstance(exc, PlanError) and exc.machine_limit is not None:
            print("(to see the plan for a machine with more memory, add --no-machine-check)",
                  file=sys.stderr)
        if args.json_out:
            _write_json(args.json_out, {"ok": False, "error": str(exc)})
        return EXIT_USAGE
    print(f"model: {args.model_dir}")
    if sz.is_auto(args.memory):
        print(f"--memory auto: {int(sz.AUTO_FRACTION * 100)}% of what this machine can hold "
              f"without swapping, in 256 MiB steps")
    print(plan.table())
    if args.json_out:
        _write_json(args.json_out, {"ok": True, "model_dir": str(args.model_dir),
                                    "plan": plan.to_dict()})
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main_plan(sys.argv[1:]))
