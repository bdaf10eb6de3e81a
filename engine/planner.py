"""The memory planner: one budget split into floor, trunk and expert cache (design 2.3).

`k3chat plan MODEL_DIR [--memory X] [--context N] [--lookahead K]` prints the split before
anything loads. Every size comes from the tensor table of the checkpoint in hand (shard
headers when the shards are present, else the index's names with the catalogue's shapes and
the dtypes the spec expects), never from constants, so the same code plans the real K3 and
the fixtures. The plan models what the C engine holds (native/k3_load.c, k3_ring.c,
k3_store.c) and `Plan.stream_options()` gives the engine exactly those options.

Order of the split (trunk before experts: a peer measured trunk-first 1.69x faster at the
same budget):

1. **Floor** (always resident): lm_head (or, only when no plan fits with it held, one
   buffer of HEAD_BLOCK_BYTES into which its row blocks are read every token:
   `head_block_rows`, the whole lm_head read per token); the embedding table only when the whole trunk is
   resident (otherwise, or when only that lets a resident trunk fit, embedding rows are read
   from the shard per token: `embed_stream`, one row of hidden x 2 B); every small vector of
   every layer widened to fp32 (norms, AttnRes, conv, A_log, dt_bias, router biases: the
   engine keeps them even for streamed layers); the session state for the requested context
   (KDA state is fixed; the MLA latent cache grows by (kv_lora + rope) x 4 B per position
   per MLA layer), one turn snapshot (the engine's whole state export at the context, as
   k3_session_snapshot copies it: a 40 B header, the token ids, the KDA state and every MLA
   row), the work buffers of one prefill pass (what km_chunk and its sublayers allocate for
   `prefill_chunk` tokens: activations and block snapshots, the largest sublayer's scratch,
   matmul inputs widened to doubles, routing lists, the MLA attention's per-head rows with
   double scores to the context; see work_buffer_parts) and I/O staging buffers. The trunk
   layout below is chosen with the work of a 64-token pass (PREFILL_CHUNK, the base).
2. **Trunk** (its matrices: every 2-D tensor with both dims > 1, which are exactly the
   tensors the engine binds as matrices): all resident if it fits
   (with the minimum expert cache beside it). Otherwise the largest layers are pinned and
   the rest stream in UNITS, a layer's attention matrices then its FFN matrices, through a
   ring of 2 slots, each as large as the largest streamed unit (bounded by its bytes + 64 B
   per tensor for the engine's 64-byte aligned reads, in whole pages). With router lookahead
   (`lookahead` > 0) every streamed MoE layer's router stays resident and leaves its FFN
   unit. As many of the largest layers are pinned as the budget allows. Only when the ring
   does not fit otherwise, a streamed dense FFN is split one matrix per unit (`ffn_split`:
   gate, up, down, read in the order the GLU uses them), so it needs a slot of its largest
   matrix, not of all three.
3. **Prefill chunk**: the largest pass (at most the context) that fits beside the trunk and
   the minimum expert cache: a bigger chunk reads each distinct expert, and every streamed
   trunk unit, once for more tokens (on K3 a 64-token pass touches ~613 of a layer's 896
   experts, so a 2,000-token prompt reads ~31 TB at 64 and 1.45 TB in one pass). When every
   routed expert fits in the cache beside a 64-token pass, the cache keeps them all (each is
   then read at most once anyway) and the chunk takes what is left.
4. **Expert cache**: the rest, in whole slots (expert + 2 x 4096 B, page-aligned). A plan
   needs at least one layer's whole top-k plus one spare slot (the engine's expert store
   refuses fewer), else it is refused.

A budget is a ceiling: what the plan holds is <= budget, and so is the peak while the engine
opens the model (pinned layers and vectors plus its largest read buffer: a pinned layer's
run, or lm_head read and copied, before the ring and expert slots exist). A budget above
what the machine can hold without swapping is refused unless `check_machine=False`.

Presets for the real Kimi K3 (its config.json and index; context 8,192 tokens, one turn
snapshot, the default lookahead of `k3chat plan`: top-k 16 with the trunk resident, else 0;
GiB throughout; "streamed" is trunk read per token, "cold read" adds every MoE layer's
top-16 experts with an empty cache; ring slots: layer 0's FFN unit, 1,453,330,432 B, while
layer 0 streams, else a KDA layer's attention unit, 887,164,928 B):

| preset | budget | floor (work) | chunk | pinned | streamed | ring | expert cache | lookahead | total | cold read/token |
|---|---|---|---|---|---|---|---|---|---|---|
| small  | 8G   | 5.01 (1.05), rows streamed | 1,097 | none | 93 layers, 101.29 | 2 x 1.35 (layer 0 FFN) | 17 slots, 0.28 | 0 | 8.00 | 125.35 |
| medium | 16G  | 4.81 (0.85), rows streamed | 883 | 7 layers (0-2, 4-6, 8), 9.26 | 86 layers, 92.03 | 2 x 0.83 (KDA attention) | 17 slots, 0.28 | 0 | 16.00 | 116.09 |
| large  | 64G  | 4.43 (0.47), rows streamed | 487 | 48 layers (0 and KDA layers to 62), 57.64 | 45 layers, 43.65 | 2 x 0.83 (KDA attention) | 17 slots, 0.28 | 0 | 64.00 | 67.71 |
| huge   | 256G | 14.00 (7.85), table held | 8,192 | all 93 layers, 101.29 | none | none | 8,606 slots, 140.71 | 16 | 256.00 | 24.06 |

Floor at 8,192 tokens with a 64-token pass: lm_head 2.19 + KDA state 0.43 + snapshot 0.85
(KDA state 0.43 + MLA rows 0.42 + ids 32 KiB + header) + MLA cache 0.42 + layer vectors 0.06
+ work 0.06 (activations 21 MiB, MoE scratch 25, widened inputs 16.5, MLA heads 7.1) +
staging 0.01 = 4.02, plus the embedding table 2.19 when the trunk is resident; a pass costs
about 1 MiB per token more. The smallest plan streams every layer, through ring slots for
layer 0's dense FFN unit (3 x 33,792 x 7,168 x 2 B = 1.35 GiB each): 7.01 GiB at 8K (floor
4.02 + ring 2 x 1.35 + 17 expert slots 0.28); 6.11 at 1 token, 9.55 at 32K, 19.74 at 128K.
Pinning layer 0 (2.18) shrinks the slots to a KDA attention unit (0.83) and first fits at
8.13 GiB (8K), so 8G streams every layer. Below 7.01 GiB layer 0's FFN streams split
(ffn_split): its three 0.45 GiB matrices are units of their own, so the ring's slots are
sized for a KDA attention unit (0.83), the same bytes read per token: 5.95 GiB at 8K with
lm_head held. Below that lm_head streams: its 2.19 GiB become a 32 MiB block buffer (2,340
rows) and every token reads all of it (2.19 GiB, 71 reads): 4.85 GiB at 8K with the FFN
one unit (floor 1.87 + ring 2.71 + expert slots 0.28), and, split, 3.80 (floor 1.87 + ring
1.65 + expert slots 0.28), 2.90 at one token, 2.94 at 8K without the turn snapshot (0.85). With lm_head streamed 8G holds at most 48,792 tokens and 16G 125,926.
Lookahead adds 92 routers (1.10 GiB) to the smallest plan (4.90 at 8K). A resident trunk
needs 105.73 GiB (rows streamed) and the
embedding table joins it from 107.92 GiB (the peak while lm_head is read and copied at open
binds).

(`python -m k3engine.planner DIR --memory large --no-machine-check` prints any of these in
full on any machine, plus the process row: the figures above are the engine's alone, and
`k3chat plan`, `run` and the app first set aside what the process itself needs, measured
(sizes.process_reserve: its resident memory, ~40-60 MiB, + 32 MiB for growth).)
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
from .catalog import (TensorSpec, expected_tensors, expert_names, layer_prefix, model_specs,
                      trunk_specs)
from .config import ModelConfig, load_config
from .errors import CheckpointError
from .private_files import write_private
from .safetensors_io import (DTYPE_SIZES, INDEX_NAME, LANGUAGE_PREFIX, SINGLE_NAME,
                             JSONStrictError, open_checkpoint, strict_json_loads,
                             warn_total_size_once)

__all__ = [
    "Plan", "PlanError", "TensorSizes", "make_plan", "minimum_budget", "max_context",
    "tensor_sizes_from_dir", "sizes_from_table", "sizes_from_names", "work_buffer_parts",
    "work_buffer_bytes", "expected_distinct_experts", "prompt_report", "base_chunk",
    "slot_bytes", "unit_slot_bytes", "main_plan", "DEFAULT_CONTEXT", "PREFILL_CHUNK",
    "verify_record_bytes",
    "RING_SLOTS", "RING_READ_ALIGN", "IO_ALIGN",
]

DEFAULT_CONTEXT = 8192
PREFILL_CHUNK = 64  # the smallest prefill chunk a plan gives (the engine's default); plans grow it
FLOAT = 4  # fp32 activations, state and the widened small vectors
DOUBLE = 8  # matmul inputs widened for the double-lane kernels, MLA head sums and scores
INT = 4  # int32 routing lists
IO_ALIGN = 4096  # direct-I/O alignment of offsets, lengths and buffers
RING_SLOTS = 2  # a streamed trunk needs a reader one unit ahead, so never one slot
RING_READ_ALIGN = 64  # kr_unit_layout starts every read that is not coalesced 64-byte aligned
SPARE_EXPERT_SLOTS = 1  # the expert store needs one free slot beyond a layer's top-k
IO_READERS = 8  # reader threads (queue depth 8, what `k3chat doctor` measures)
# An allowance per reader thread for reads that do not land in a slot (per-tensor fallback
# reads of a checkpoint whose runs are not contiguous, unaligned small trunk tensors). The
# expert store reads whole runs straight into its slots, so this stays small.
STAGING_PER_READER = 1 * sz.MiB
DEFAULT_SNAPSHOTS = 1  # the turn-boundary snapshot that makes "regenerate" cheap (design 2.5)
# lm_head streamed (only when no plan fits with it held): blocks of rows up to this many
# bytes, one read each, large enough that a read runs at sequential disk speed.
HEAD_BLOCK_BYTES = 32 * sz.MiB

GZ_INDEX_NAME = INDEX_NAME + ".gz"

# The matrices of a layer, as the engine binds them (km_bind_layer in native/k3_load.c):
# kept in their stored dtype and, when the layer streams, read through the ring in two
# units. Every other trunk tensor (norm gains, AttnRes [1, E] projections, conv [P, 1, K],
# A_log, dt_bias, e_score_correction_bias) is a small vector the engine widens to fp32 and
# keeps resident, streamed layer or not.
_ATTN_MATRICES = frozenset(f"self_attn.{x}.weight" for x in (
    "q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "f_a_proj", "f_b_proj", "b_proj",  # KDA
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"))  # MLA (+ g_proj, o_proj)
ROUTER = "block_sparse_moe.gate.weight"
_FFN_MATRICES = frozenset({
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",  # dense
    ROUTER, "block_sparse_moe.routed_expert_down_proj.weight",
    "block_sparse_moe.routed_expert_up_proj.weight",
    "block_sparse_moe.shared_experts.gate_proj.weight",
    "block_sparse_moe.shared_experts.up_proj.weight",
    "block_sparse_moe.shared_experts.down_proj.weight"})


# ---------------------------------------------------------------------------------------
# The tensor table, aggregated
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSizes:
    """Byte sizes the planner needs, summed from a checkpoint's tensor table.

    Per layer (layer 0 first): the matrices of its attention unit and of its FFN unit
    (bytes as stored and how many tensors), the router among the FFN matrices, and the
    fp32 bytes of its small vectors.
    """

    layer_trunk: tuple[int, ...]  # every trunk tensor of the layer, as stored
    layer_attn: tuple[int, ...]  # attention matrices, as stored
    layer_attn_count: tuple[int, ...]
    layer_ffn: tuple[int, ...]  # FFN matrices (router included), as stored
    layer_ffn_count: tuple[int, ...]
    layer_router: tuple[int, ...]  # the MoE router matrix (0 for a dense layer)
    layer_vectors: tuple[int, ...]  # the small vectors widened to fp32 (always resident)
    embed: int
    lm_head: int
    model_vectors: int  # final norm and the output AttnRes tensors, widened to fp32
    expert_bytes: int  # one routed expert's six tensors
    n_experts_total: int  # routed experts over all MoE layers
    source: str  # "shard headers", "index + catalogue" or a mix
    # a dense layer's largest FFN matrix, as stored: its unit when the FFN streams split
    # (ffn_split); 0 for a MoE layer, whose FFN is always one unit
    layer_ffn_largest: tuple[int, ...] = ()

    @property
    def trunk_total(self) -> int:
        return sum(self.layer_trunk)

    def layer_matrices(self, layer: int) -> int:
        """Bytes a pinned layer holds beyond its vectors: all its matrices, as stored."""
        return self.layer_attn[layer] + self.layer_ffn[layer]


def _expected_nbytes(cfg: ModelConfig, name: str, spec: TensorSpec) -> tuple[int, int]:
    """(bytes, elements) of a tensor known only by name: the catalogue's shape and the
    dtype the spec expects."""
    shape = spec.shape
    if spec.min_len:
        # A_log ships zero-padded to the KDA head width (128 for 96 heads in the release;
        # the fixture writer pads the same way), so its length is max(H_k, D).
        shape = (max(shape[0], cfg.kda_head_dim),)
    (dtype,) = spec.dtypes  # the catalogue allows exactly one dtype per tensor
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * DTYPE_SIZES[dtype], numel


def _spec_numel(spec: TensorSpec, nbytes: int) -> int:
    """Elements of a trunk vector known by its bytes only: the catalogue's shape, or for a
    vector that may be longer (A_log) the most a 2-byte dtype can hold (an upper bound)."""
    if spec.min_len:
        return nbytes // 2
    numel = 1
    for dim in spec.shape:
        numel *= dim
    return numel


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
    """Aggregate a name -> bytes table (language_model tensors; others are ignored).

    Without dtypes the fp32 size of a vector comes from the catalogue's shape (A_log, which
    may be padded: an upper bound)."""
    expected = expected_tensors(cfg)
    problems = _name_problems(expected, nbytes)
    if problems:
        raise CheckpointError(f"the tensor table does not match config.json: "
                              f"{'; '.join(problems)}. The checkpoint and config.json must "
                              f"come from the same release")
    return _aggregate(cfg, expected, nbytes, {}, source)


def _aggregate(cfg: ModelConfig, expected: Mapping[str, TensorSpec], nbytes: Mapping[str, int],
               numel: Mapping[str, int], source: str) -> TensorSizes:
    """Sum a checked table (every expected name present) into the planner's sizes.

    `numel` gives the element count of tensors whose dtype is known (else the catalogue's)."""

    def fp32(name: str) -> int:
        n = numel[name] if name in numel else _spec_numel(expected[name], nbytes[name])
        return n * FLOAT

    cols: dict[str, list[int]] = {k: [] for k in ("trunk", "attn", "attn_n", "ffn", "ffn_n",
                                                  "router", "vectors", "ffn_max")}
    moe = set(cfg.moe_layers)
    for layer in range(cfg.n_layers):
        prefix = layer_prefix(layer)
        row = dict.fromkeys(cols, 0)
        for name in trunk_specs(cfg, layer):
            local = name[len(prefix):]
            row["trunk"] += nbytes[name]
            if local in _ATTN_MATRICES:
                row["attn"] += nbytes[name]
                row["attn_n"] += 1
            elif local in _FFN_MATRICES:
                row["ffn"] += nbytes[name]
                row["ffn_n"] += 1
                if local == ROUTER:
                    row["router"] = nbytes[name]
                if layer not in moe:
                    row["ffn_max"] = max(row["ffn_max"], nbytes[name])
            else:
                row["vectors"] += fp32(name)
        for key, value in row.items():
            cols[key].append(value)
    models = model_specs(cfg)
    embed_name = next(n for n in models if n.endswith("embed_tokens.weight"))
    head_name = next(n for n in models if n.endswith("lm_head.weight"))
    return TensorSizes(
        layer_trunk=tuple(cols["trunk"]), layer_attn=tuple(cols["attn"]),
        layer_attn_count=tuple(cols["attn_n"]), layer_ffn=tuple(cols["ffn"]),
        layer_ffn_count=tuple(cols["ffn_n"]), layer_router=tuple(cols["router"]),
        layer_vectors=tuple(cols["vectors"]), embed=nbytes[embed_name],
        lm_head=nbytes[head_name],
        model_vectors=sum(fp32(n) for n in models if n not in (embed_name, head_name)),
        expert_bytes=_expert_bytes(cfg, nbytes),
        n_experts_total=len(cfg.moe_layers) * cfg.n_experts, source=source,
        layer_ffn_largest=tuple(cols["ffn_max"]))


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
    misshapen = [f"{n} in {info.shard}: {p}" for n, info in headers.items()
                 if n in expected and (p := expected[n].problem(info))]
    if misshapen:
        problems.append(f"{len(misshapen)} tensor(s) misshapen or of the wrong dtype, e.g. "
                        f"{'; '.join(misshapen[:3])}")
    if problems:
        raise CheckpointError(f"the checkpoint does not match config.json: "
                              f"{'; '.join(problems)}. The shards, index and config.json must "
                              f"come from the same release")
    table: dict[str, int] = {}
    numel: dict[str, int] = {}
    for n, spec in expected.items():
        if n in headers:
            table[n] = headers[n].nbytes
            if spec.kind != "expert":
                numel[n] = headers[n].nbytes // DTYPE_SIZES[headers[n].dtype]
        else:
            table[n], numel[n] = _expected_nbytes(cfg, n, spec)
    found = sum(n in headers for n in expected)
    source = ("shard headers" if found == len(expected) else
              "index + catalogue" if found == 0 else
              f"shard headers for {found} of {len(expected)} tensors, index + catalogue "
              f"for the rest")
    return _aggregate(cfg, expected, table, numel, source)


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
        sizes = sizes_from_names(cfg, ckpt.assigned, ckpt.tensors)
        if not ckpt.missing_shards:  # then every tensor was checked against its header
            warn_total_size_once(ckpt)
        return sizes
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
    """The bytes the engine allocates for one prefill pass of `chunk` tokens, by kind.

    Mirrors km_chunk (native/k3_model.c) and the sublayers it calls: the residual stream,
    x, xn, the sublayer output and the AttnRes block snapshots live for the whole pass; one
    scratch area sized for the largest sublayer (kda/mla/moe/dense_scratch_floats) is
    reused; each matmul widens its input to doubles for the chunk (kk_widen); the MoE keeps
    int routing lists (lookahead picks bounded by the expert count); the MLA attention keeps
    per head (H = 96 on K3) its absorbed query and context in float and in double, plus
    double scores over every position up to the context. The widened inputs and the MLA
    head rows are never allocated at the same time (work_buffer_bytes takes the larger).
    """
    t, e = chunk, cfg.hidden
    p, d, hk = cfg.kda_width, cfg.kda_head_dim, cfg.kda_heads
    h, lat, ne, k = cfg.mla_heads, cfg.latent_dim, cfg.n_experts, cfg.top_k
    kda = t * (6 * p + d + hk)
    mla = t * (2 * cfg.q_lora_rank + h * cfg.mla_qk_dim + cfg.kv_a_dim + 2 * cfg.mla_value_width)
    dense = 2 * t * cfg.dense_width
    moe = t * (2 * ne + 2 * k + k * lat + 5 * lat + e + 2 * cfg.shared_width
               + 2 * cfg.expert_width)
    # the widest input any matmul of the pass takes (kk_matmul, kk_mxfp4_matmul)
    widest = max(e, p, d, cfg.q_lora_rank, cfg.mla_value_width, cfg.dense_width,
                 cfg.shared_width, cfg.expert_width, lat)
    r = cfg.kv_lora_rank
    scores = h * (2 * r * FLOAT + (2 * r + context) * DOUBLE) if cfg.mla_layers else 0
    routing = INT * (t * (k + 2 + ne) + ne) if cfg.moe_layers else 0
    return {
        "activations": (cfg.n_block_snapshots + 4) * t * e * FLOAT,
        "sublayer scratch": max(kda, mla, dense, moe) * FLOAT,
        "widened inputs (double)": t * widest * DOUBLE,
        "routing lists": routing,
        "MLA scores, per head": scores,
        "logits": cfg.vocab * FLOAT,
    }


def work_buffer_bytes(parts: Mapping[str, int]) -> int:
    """The peak of one pass: what lives all pass, plus the larger of the matmul inputs
    widened beside the routing lists and the MLA head rows (freed before the next matmul)."""
    transient = max(parts["widened inputs (double)"] + parts["routing lists"],
                    parts["MLA scores, per head"])
    return parts["activations"] + parts["sublayer scratch"] + transient + parts["logits"]


def base_chunk(context: int) -> int:
    """The chunk every plan can give: the engine's default, or the context when smaller."""
    return min(PREFILL_CHUNK, context)


def expected_distinct_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts `tokens` tokens route to in one MoE layer under uniform
    routing (each token picks top_k distinct experts uniformly at random)."""
    if n_experts == 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def _align(n: int) -> int:
    return -(-n // IO_ALIGN) * IO_ALIGN


def slot_bytes(run_bytes: int) -> int:
    """An expert cache slot for a run that may start anywhere: direct I/O reads whole
    aligned pages, so the span can reach one page before and one after (the expert store's
    `cap` in native/k3_store.c: align4096(expert + 2 x 4096))."""
    return _align(run_bytes + 2 * IO_ALIGN)


def unit_slot_bytes(unit_bytes: int, n_tensors: int) -> int:
    """An upper bound on the ring slot a streamed unit needs (kr_unit_layout in
    native/k3_ring.c): its tensors back to back, each read that is not coalesced with the
    one before starting 64-byte aligned (less than 64 B of padding per tensor), in a
    page-aligned buffer."""
    if n_tensors == 0:
        return 0
    return _align(unit_bytes + RING_READ_ALIGN * n_tensors)


@dataclass(frozen=True)
class _Floor:
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def embed_row_bytes(cfg: ModelConfig, ts: TensorSizes) -> int:
    """One embedding row as stored: what `embed_stream` reads per token."""
    return ts.embed // cfg.vocab


def head_block_rows(cfg: ModelConfig, ts: TensorSizes) -> int:
    """lm_head rows per streamed block: as many as HEAD_BLOCK_BYTES holds, at least one."""
    return max(1, min(cfg.vocab, HEAD_BLOCK_BYTES // (ts.lm_head // cfg.vocab)))


def head_buffer_bytes(cfg: ModelConfig, ts: TensorSizes) -> int:
    """The block buffer a streamed lm_head needs (km_head in native/k3_model.c)."""
    return head_block_rows(cfg, ts) * (ts.lm_head // cfg.vocab)


STATE_HEADER = 40  # k3_state.c: ten 32-bit words before the ids


def snapshot_bytes(cfg: ModelConfig, context: int) -> int:
    """One turn-boundary snapshot at `context` positions (k3_session_snapshot copies the
    full export: header, ids, every KDA state and conv history, every MLA row)."""
    return STATE_HEADER + context * (4 + mla_bytes_per_position(cfg)) + kda_state_bytes(cfg)


SPECULATIVE_PART = "speculative verify"


def verify_record_bytes(cfg: ModelConfig, speculative: int) -> int:
    """What exact speculative decoding with up to `speculative` drafted tokens holds beside
    the session (0 when off): the verify record for speculative + 1 positions, as
    k3_verify_bytes counts it (native/k3_kda.c: one KDA layer's scratch state and conv
    history, then per position and KDA layer the q/k/v before the conv, k/v after it, the
    decay and beta), and the logits of every verified position. Its pass fits the prefill
    chunk's work buffers (speculative + 1 tokens, at most MAX_SPECULATIVE + 1)."""
    if speculative <= 0:
        return 0
    n = speculative + 1
    p, hk, d, k = cfg.kda_width, cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel
    n_kda = len(cfg.kda_layers)
    record = (hk * d * d + 3 * p * (k - 1) + n_kda * n * (6 * p + hk)) if n_kda else 0
    return FLOAT * record + INT * n + n * cfg.vocab * FLOAT


def _floor(cfg: ModelConfig, ts: TensorSizes, context: int, snapshots: int,
           embed_stream: bool, process_bytes: int = 0, chunk: int | None = None,
           head_stream: bool = False, verify_bytes: int = 0) -> _Floor:
    """Everything resident whatever the trunk layout (given the embedding and lm_head choice).

    With `embed_stream` the engine holds no embedding table, only a one-row read buffer
    (km_embed in native/k3_model.c); with `head_stream` no lm_head, only its block buffer
    (km_head). `process_bytes` is what the process needs beside the
    engine (interpreter, libraries, tokenizer, UI): the budget is for the whole process.
    The work buffers are for a prefill pass of `chunk` tokens (default: base_chunk)."""
    state = kda_state_bytes(cfg)
    work = work_buffer_parts(cfg, context, base_chunk(context) if chunk is None else chunk)
    verify = {SPECULATIVE_PART: verify_bytes} if verify_bytes else {}  # only when it is on
    return _Floor({
        PROCESS_PART: process_bytes,
        "embeddings": embed_row_bytes(cfg, ts) if embed_stream else ts.embed,
        "lm_head": head_buffer_bytes(cfg, ts) if head_stream else ts.lm_head,
        "output norms (fp32)": ts.model_vectors,
        "layer vectors (fp32)": sum(ts.layer_vectors),
        "KDA state": state,
        # a snapshot is the engine's whole state export: ids, KDA state and MLA rows
        "turn snapshots": snapshots * snapshot_bytes(cfg, context),
        "MLA latent cache": context * mla_bytes_per_position(cfg),
        "work buffers": work_buffer_bytes(work),
        "I/O staging": IO_READERS * STAGING_PER_READER,
        **verify,
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


_UNIT_NAMES = ("attention", "FFN", "split FFN")  # unit index 2: one matrix of a split FFN
PROCESS_PART = "process (beside the engine)"


@dataclass(frozen=True)
class Plan:
    """A budget split. Every field is bytes unless named otherwise."""

    budget: int
    context: int  # tokens the session state is sized for
    prefill_chunk: int
    # floor
    embed_stream: bool  # embedding rows read from the shard per token; no table held
    embed_bytes: int  # resident for the embeddings: the table, or one row buffer
    embed_table_bytes: int  # the embedding table as stored
    embed_row_bytes: int  # one row, read per token when embed_stream
    lm_head_bytes: int  # resident for lm_head: the matrix, or one block buffer
    model_vector_bytes: int  # output norms and AttnRes, fp32
    layer_vector_bytes: int  # every layer's small vectors, fp32, resident even when streamed
    kda_state_bytes: int
    snapshots: int
    snapshot_bytes: int
    mla_cache_bytes: int
    mla_bytes_per_position: int
    work_bytes: int  # the peak of one prefill pass of prefill_chunk tokens
    staging_bytes: int
    # trunk
    trunk_bytes: int  # the whole trunk as stored, resident or not
    trunk_matrix_bytes: int  # its matrices (the rest is the vectors, held as fp32 above)
    trunk_resident: bool
    pinned_layers: tuple[int, ...]  # held in memory (all layers when trunk_resident)
    pinned_bytes: int  # matrices of the pinned layers
    streamed_layers: tuple[int, ...]  # matrices read through the ring every token
    streamed_bytes: int  # matrices read per token (routers excluded with lookahead)
    lookahead: int  # experts per token prefetched for the next layer (0: off)
    router_bytes: int  # routers of streamed MoE layers held resident for the lookahead
    ring_slots: int
    ring_slot_bytes: int  # upper bound for the largest streamed unit
    ring_unit: str  # which unit sizes the ring, e.g. "layer 0 FFN" ("" when resident)
    ring_unit_bytes: int  # that unit's matrices, as stored
    ring_unit_tensors: int
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
    process_bytes: int = 0  # the process beside the engine: interpreter, libraries, UI
    open_peak_bytes: int = 0  # the most held while the engine opens the model (<= budget)
    head_stream: bool = False  # lm_head read per pass in row blocks; only when held cannot fit
    head_block_rows: int = 0  # rows per block when head_stream (0: held)
    head_table_bytes: int = 0  # lm_head as stored: what head_stream reads per token
    ffn_split: bool = False  # streamed dense FFNs one matrix per ring unit; only when needed
    machine_limit: int | None = None  # what the machine could hold, when it was checked
    speculative: int = 0  # drafted tokens verified per pass (0: off)
    verify_bytes: int = 0  # its verify record and logits (verify_record_bytes)
    work_parts: dict[str, int] = field(default_factory=dict)  # work_bytes by kind
    # per layer, layer 0 first
    layer_bytes: tuple[int, ...] = field(default=(), repr=False)  # trunk as stored
    layer_matrix_bytes: tuple[int, ...] = field(default=(), repr=False)  # cost when pinned
    layer_unit_slots: tuple[tuple[int, int], ...] = field(default=(), repr=False)  # ring
    # slot bound of the (attention, FFN) units if the layer streams under this lookahead
    # (with ffn_split a dense layer's FFN entry is its largest matrix's unit)

    @property
    def floor_parts(self) -> dict[str, int]:
        return {PROCESS_PART: self.process_bytes,
                "embeddings": self.embed_bytes, "lm_head": self.lm_head_bytes,
                "output norms (fp32)": self.model_vector_bytes,
                "layer vectors (fp32)": self.layer_vector_bytes,
                "KDA state": self.kda_state_bytes, "turn snapshots": self.snapshot_bytes,
                "MLA latent cache": self.mla_cache_bytes, "work buffers": self.work_bytes,
                "I/O staging": self.staging_bytes,
                **({SPECULATIVE_PART: self.verify_bytes} if self.speculative else {})}

    @property
    def floor_bytes(self) -> int:
        return sum(self.floor_parts.values())

    @property
    def ring_bytes(self) -> int:
        return self.ring_slots * self.ring_slot_bytes

    @property
    def trunk_plan_bytes(self) -> int:
        """Memory the trunk matrices take under this plan: pinned, ring, lookahead routers."""
        return self.pinned_bytes + self.ring_bytes + self.router_bytes

    @property
    def total(self) -> int:
        return self.floor_bytes + self.trunk_plan_bytes + self.expert_cache_bytes

    @property
    def head_read_per_token(self) -> int:
        """lm_head bytes read per generated token (every pass that wants logits reads it
        whole once, whatever its tokens): 0 when held."""
        return self.head_table_bytes if self.head_stream else 0

    @property
    def cold_read_per_token(self) -> int:
        """Bytes read per token with a cold expert cache: streamed trunk matrices, every
        MoE layer's top-k and, with embed_stream, the token's embedding row, with
        head_stream the whole lm_head."""
        return (self.streamed_bytes + self.moe_layers * self.top_k * self.expert_bytes
                + (self.embed_row_bytes if self.embed_stream else 0) + self.head_read_per_token)

    def read_seconds(self, nbytes: int, disk_gb_per_s: float) -> float:
        """Seconds to read `nbytes` at a disk speed (GB/s, decimal, as `k3chat doctor`)."""
        return nbytes / (disk_gb_per_s * 1e9)

    def prefill_passes(self, prompt_tokens: int, chunk: int | None = None) -> list[int]:
        """Tokens of each engine pass a prompt is fed in (the engine's km_forward split)."""
        c = self.prefill_chunk if chunk is None else chunk
        return [min(c, prompt_tokens - done) for done in range(0, prompt_tokens, c)]

    def prefill_expert_bytes(self, prompt_tokens: int, chunk: int | None = None) -> float:
        """Expected routed-expert bytes a prompt reads: per pass, every MoE layer's expected
        distinct experts under uniform routing, each read once in that pass (none reused
        from the cache across passes: with a small cache, as on K3, that is what happens)."""
        per_layer = self.experts_total // self.moe_layers if self.moe_layers else 0
        distinct = sum(expected_distinct_experts(per_layer, self.top_k, n)
                       for n in self.prefill_passes(prompt_tokens, chunk))
        return distinct * self.moe_layers * self.expert_bytes

    def engine_options(self, reader_threads: int = IO_READERS) -> dict[str, Any]:
        """The engine's open options for this plan, as `StreamOptions` field values."""
        return {
            "expert_cache_bytes": self.expert_slots * self.expert_slot_bytes,
            "reader_threads": reader_threads,
            "direct_io": True,
            "lookahead": self.lookahead,
            "prefetch": True,
            "trunk_stream": not self.trunk_resident,
            # with a resident trunk the engine builds no ring; 2 is StreamOptions' default
            "ring_slots": self.ring_slots if not self.trunk_resident else RING_SLOTS,
            "pinned": tuple(self.pinned_layers),
            "embed_stream": self.embed_stream,
            "prefill_chunk": self.prefill_chunk,  # the chunk the work buffers were sized for
            "head_block_rows": self.head_block_rows if self.head_stream else 0,
            "ffn_split": self.ffn_split,
        }

    def stream_options(self, reader_threads: int = IO_READERS) -> Any:
        """`k3engine.model.StreamOptions` that make the engine hold exactly this plan."""
        from .model import StreamOptions  # lazy: the planner must not need the built engine

        return StreamOptions(**self.engine_options(reader_threads))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("layer_bytes", "layer_matrix_bytes", "layer_unit_slots"):
            out.pop(key)
        out["pinned_layers"] = list(self.pinned_layers)
        out["streamed_layers"] = list(self.streamed_layers)
        options = self.engine_options()
        options["pinned"] = list(options["pinned"])
        out.update(floor_parts=self.floor_parts, floor_bytes=self.floor_bytes,
                   ring_bytes=self.ring_bytes, trunk_plan_bytes=self.trunk_plan_bytes,
                   total=self.total, headroom=self.budget - self.total,
                   cold_read_per_token=self.cold_read_per_token,
                   head_read_per_token=self.head_read_per_token, engine_options=options)
        return out

    def table(self, disk_gb_per_s: float | None = None) -> str:
        """The plan as text; with a disk speed, what a streamed lm_head costs in time."""
        return _render_table(self, disk_gb_per_s)


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


def _render_table(p: Plan, disk_gb_per_s: float | None = None) -> str:
    per_pos = p.mla_bytes_per_position
    lines = [f"memory plan: budget {sz.format_bytes(p.budget)} ({p.budget:,} B), context "
             f"{p.context:,} tokens; sizes from {p.sizes_source}",
             "floor (always resident)"]
    embed_note = (f"streamed: one row of {p.embed_row_bytes:,} B read per token "
                  f"(table of {p.embed_table_bytes:,} B not held)" if p.embed_stream
                  else "resident table")
    notes = {PROCESS_PART: (f"this process's resident memory + {sz.format_bytes(sz.PROCESS_GROWTH)} "
                            f"for its growth (interpreter, libraries, tokenizer, UI)"
                            if p.process_bytes else "not counted"),
             "embeddings": embed_note,
             "lm_head": (f"streamed: blocks of {p.head_block_rows:,} rows, the whole "
                         f"{p.head_table_bytes:,} B read per token (not held)" if p.head_stream
                         else "resident"),
             "MLA latent cache": f"{p.context:,} positions x {per_pos:,} B",
             "layer vectors (fp32)": "norms, AttnRes, conv, A_log, dt_bias, router biases",
             "work buffers": f"peak of one prefill pass, chunk of {p.prefill_chunk:,} tokens "
                             f"(the largest this budget allows, at most the context)",
             "turn snapshots": f"{p.snapshots} x (KDA state + MLA rows + ids at the context)",
             "KDA state": "fixed, whatever the context",
             "I/O staging": f"{IO_READERS} readers x {STAGING_PER_READER // sz.MiB} MiB",
             SPECULATIVE_PART: f"up to {p.speculative} drafted tokens: per-position KDA vectors "
                               f"to roll back to, and {p.speculative + 1} positions' logits"}
    for k, v in p.floor_parts.items():
        lines.append(_row(k, v, notes.get(k, "")))
        if k == "work buffers":
            lines += _work_rows(p)
    lines.append(_row("floor total", p.floor_bytes))
    n_layers = len(p.pinned_layers) + len(p.streamed_layers)
    lines.append(f"trunk ({p.trunk_bytes:,} B in {n_layers} layers; matrices "
                 f"{p.trunk_matrix_bytes:,} B, vectors in the floor)")
    if p.trunk_resident:
        lines.append(_row("resident (all layers)", p.pinned_bytes))
    else:
        lines.append(_row(f"pinned: {len(p.pinned_layers)} layers", p.pinned_bytes,
                          f"layers {_ranges(p.pinned_layers)}"))
        lines.append(_row(f"streamed: {len(p.streamed_layers)} layers", p.streamed_bytes,
                          f"layers {_ranges(p.streamed_layers)}, read every token, not held"))
        if p.lookahead:
            lines.append(_row("routers (lookahead)", p.router_bytes,
                              f"of the streamed MoE layers, resident for lookahead "
                              f"{p.lookahead}"))
        lines.append(_row(f"ring: {p.ring_slots} slots", p.ring_bytes,
                          f"{p.ring_slot_bytes:,} B each (largest streamed unit: "
                          f"{p.ring_unit} matrices, {p.ring_unit_bytes:,} B in "
                          f"{p.ring_unit_tensors} tensors)"))
        if p.ffn_split:
            lines.append("    (streamed dense FFNs split: one matrix per unit, gate, up, down, "
                         "so none needs a slot of its three)")
    lines.append("expert cache")
    lines.append(_row(f"{p.expert_slots:,} slots", p.expert_cache_bytes,
                      f"{p.expert_slot_bytes:,} B each (expert {p.expert_bytes:,} B + "
                      f"direct-I/O slack); minimum {p.min_expert_slots}, checkpoint has "
                      f"{p.experts_total:,}"))
    lines.append(_row("total", p.total, f"headroom {p.budget - p.total:,} B"))
    lines.append(_row("peak while opening", p.open_peak_bytes,
                      "pinned layers + vectors + the largest read buffer (no ring, expert "
                      "slots or session yet)"))
    embed_read = f" + embedding row {p.embed_row_bytes:,} B" if p.embed_stream else ""
    head_read = (f" + lm_head {sz.format_bytes(p.head_read_per_token)}" if p.head_stream
                 else "")
    lines.append(f"cold read per token: {sz.format_bytes(p.cold_read_per_token)} "
                 f"(streamed trunk {sz.format_bytes(p.streamed_bytes)} + top-{p.top_k} experts of "
                 f"{p.moe_layers} MoE layers{embed_read}{head_read})")
    if p.head_stream:
        lines.append(_head_cost_line(p, disk_gb_per_s))
    opts = p.engine_options()
    pinned = _ranges(p.pinned_layers) if opts["trunk_stream"] else "all"
    lines.append(f"engine options: trunk_stream={opts['trunk_stream']}, ring_slots="
                 f"{opts['ring_slots']}, pinned {pinned}, embed_stream={p.embed_stream}, "
                 f"lookahead={p.lookahead}, expert_cache_bytes={opts['expert_cache_bytes']:,}, "
                 f"head_block_rows={opts['head_block_rows']:,}, ffn_split={p.ffn_split}")
    if p.machine_limit is not None:
        lines.append(f"machine: {sz.format_bytes(p.machine_limit)} can be held without "
                     f"swapping")
    return "\n".join(lines)


def _head_cost_line(p: Plan, disk_gb_per_s: float | None) -> str:
    """What streaming lm_head costs per token, in bytes and, given a disk speed, seconds."""
    blocks = -(-p.head_table_bytes // p.lm_head_bytes)
    text = (f"lm_head streamed (no plan fits with it held): {p.head_read_per_token:,} B "
            f"({sz.format_bytes(p.head_read_per_token)}) read per token in {blocks:,} reads of "
            f"up to {p.lm_head_bytes:,} B")
    if disk_gb_per_s is None:
        return text + ("; give --disk-gbps (the read speed `k3chat doctor` measures) for "
                       "the time it costs")
    return (text + f", {p.read_seconds(p.head_read_per_token, disk_gb_per_s):.2f} s per token "
            f"at {disk_gb_per_s:g} GB/s")


_WORK_NOTES = {
    "activations": "residual, x, xn, sublayer output and the AttnRes block snapshots",
    "sublayer scratch": "the largest of KDA, MLA, MoE and dense scratch, reused",
    "widened inputs (double)": "one matmul input at a time, for the double-lane kernels",
    "routing lists": "MoE top-k, token lists and lookahead picks (int32)",
    "MLA scores, per head": "query and context rows + double scores to the "
                                        "context, per head; not beside the widened inputs",
    "logits": "the last position's logits",
}


def _work_rows(p: Plan) -> list[str]:
    """The work buffers by kind, indented under their row."""
    return [_row(f"  {k}", v, _WORK_NOTES.get(k, "")) for k, v in p.work_parts.items()]


@dataclass(frozen=True)
class _Layout:
    """Per-layer costs under a lookahead setting."""

    matrices: tuple[int, ...]  # held when pinned
    streamed: tuple[int, ...]  # read per token when streamed
    routers: tuple[int, ...]  # held when streamed (lookahead only)
    units: tuple[tuple[int, int], ...]  # ring slot bound of (attention, FFN) when streamed
    split: tuple[int, ...]  # slot bound of a split FFN's largest matrix (0: cannot split)
    # (bytes, tensors) of each unit index of _UNIT_NAMES: attention, FFN, split FFN matrix
    unit_raw: tuple[tuple[tuple[int, int], tuple[int, int], tuple[int, int]], ...]
    # read buffers while the layer is opened: a pinned layer's whole run (or, when it is not
    # contiguous, one tensor at a time); a streamed layer's resident tensors one at a time
    open_pinned: tuple[int, ...]
    open_streamed: tuple[int, ...]

    def unit_slots(self, ffn_split: bool) -> tuple[tuple[int, int], ...]:
        """Per layer, the slot bounds of its (attention, FFN) units as the engine streams
        them: with ffn_split a dense layer's FFN needs only its largest matrix."""
        return tuple((a, s if ffn_split and s else f) for (a, f), s in zip(self.units, self.split))


def _layout(ts: TensorSizes, lookahead: int) -> _Layout:
    n = len(ts.layer_trunk)
    routers = tuple(ts.layer_router[L] if lookahead > 0 else 0 for L in range(n))
    raw = []
    for L in range(n):
        attn = (ts.layer_attn[L], ts.layer_attn_count[L])
        ffn = (ts.layer_ffn[L] - routers[L], ts.layer_ffn_count[L] - (1 if routers[L] else 0))
        largest = ts.layer_ffn_largest[L] if ts.layer_ffn_largest else 0
        raw.append((attn, ffn, (largest, 1) if largest else (0, 0)))
    streamed = tuple(ts.layer_matrices(L) - routers[L] for L in range(n))
    return _Layout(
        matrices=tuple(ts.layer_matrices(L) for L in range(n)), streamed=streamed,
        routers=routers,
        units=tuple((unit_slot_bytes(*a), unit_slot_bytes(*f)) for a, f, _ in raw),
        split=tuple(unit_slot_bytes(*m) for _, _, m in raw),
        unit_raw=tuple(raw), open_pinned=ts.layer_trunk,
        open_streamed=tuple(ts.layer_trunk[L] - streamed[L] for L in range(n)))


@dataclass(frozen=True)
class _Trunk:
    resident: bool
    embed_stream: bool
    pinned: tuple[int, ...]
    streamed: tuple[int, ...]
    ring_slot: int  # bound for the largest streamed unit (0 when resident)
    ring_unit: tuple[int, int] | None  # (layer, unit index) that sizes the ring
    pinned_bytes: int
    streamed_bytes: int
    router_bytes: int
    open_buffer: int  # the largest read buffer while the layers are opened
    ffn_split: bool = False  # streamed dense FFNs come one matrix per ring unit

    def cost(self, ring_slots: int) -> int:
        """Trunk memory: pinned matrices + ring + routers held for the lookahead."""
        ring = 0 if self.resident else ring_slots * self.ring_slot
        return self.pinned_bytes + ring + self.router_bytes


def _trunk_options(lay: _Layout) -> list[_Trunk]:
    """Every trunk layout worth considering, most pinned bytes first.

    A resident trunk first, with the embedding table, then reading embedding rows per
    token instead (only that may let a resident trunk fit). Then the p largest layers
    pinned and the rest streamed (with embedding rows read per token): for a fixed count p
    that pins the most bytes, and here the ring is sized by the largest streamed unit.
    When a streamed dense FFN is that unit, the same layout follows with the FFN split one
    matrix per unit (ffn_split, a smaller ring): after the unsplit one, so the FFN splits
    only when the budget needs it, and before pinning fewer layers (same bytes read).
    """
    n = len(lay.matrices)
    everything = tuple(range(n))
    total = sum(lay.matrices)
    order = sorted(everything, key=lambda L: (-lay.matrices[L], L))
    pinned_open = [0]  # pinned_open[p]: the largest run of the p largest layers
    for L in order:
        pinned_open.append(max(pinned_open[-1], lay.open_pinned[L]))
    options = [_Trunk(True, embed, everything, (), 0, None, total, 0, 0, pinned_open[n])
               for embed in (False, True)]
    best: tuple[int, int, int] = (0, 0, 0)  # (slot bound, layer, unit): the ring's unit
    best_split = best  # the same with every streamed dense FFN split
    streamed: list[int] = []
    pinned_bytes, streamed_bytes, router_bytes, streamed_open = total, 0, 0, 0
    for p in range(n - 1, -1, -1):
        L = order[p]
        streamed.append(L)
        pinned_bytes -= lay.matrices[L]
        streamed_bytes += lay.streamed[L]
        router_bytes += lay.routers[L]
        streamed_open = max(streamed_open, lay.open_streamed[L])
        for u in (0, 1):  # ties name the lowest layer
            if (lay.units[L][u], -L) > (best[0], -best[1]):
                best = (lay.units[L][u], L, u)
        for u, bound in ((0, lay.units[L][0]), (2, lay.split[L]) if lay.split[L] else (1, lay.units[L][1])):
            if (bound, -L) > (best_split[0], -best_split[1]):
                best_split = (bound, L, u)
        pinned_now, streamed_now = tuple(sorted(order[:p])), tuple(sorted(streamed))
        open_buffer = max(pinned_open[p], streamed_open)
        options.append(_Trunk(False, True, pinned_now, streamed_now, best[0], (best[1], best[2]),
                              pinned_bytes, streamed_bytes, router_bytes, open_buffer))
        if best_split[0] < best[0]:
            options.append(_Trunk(False, True, pinned_now, streamed_now, best_split[0],
                                  (best_split[1], best_split[2]), pinned_bytes, streamed_bytes,
                                  router_bytes, open_buffer, ffn_split=True))
    return options


def _open_peak(ts: TensorSizes, floor: _Floor, trunk: _Trunk, head_stream: bool = False) -> int:
    """The most the engine holds while it opens the model (k3_model_open), an upper bound.

    The layers come first, each pinned one through a read buffer of its whole run; then the
    embedding table (when held) and lm_head (when held), each read into a buffer and copied.
    The ring, the expert slots (made on first use), the session state, the work buffers and
    a streamed lm_head's block buffer do not exist yet."""
    held = (floor.parts[PROCESS_PART] + floor.parts["layer vectors (fp32)"]
            + floor.parts["output norms (fp32)"] + floor.parts["I/O staging"]
            + trunk.pinned_bytes + trunk.router_bytes)
    table = 0 if trunk.embed_stream else ts.embed
    head = 0 if head_stream else ts.lm_head
    return held + max(trunk.open_buffer, 2 * table, table + 2 * head)


def _largest_chunk(cfg: ModelConfig, ts: TensorSizes, budget: int, context: int,
                   snapshots: int, trunk: _Trunk, ring_slots: int, process_bytes: int,
                   head_stream: bool = False, verify_bytes: int = 0) -> int:
    """The largest prefill chunk (at most the context) beside `trunk` and the expert cache.

    A bigger chunk reads each distinct expert and every streamed trunk unit once for more
    tokens, so it takes the room above the minimum expert cache; except when the budget
    could cache every routed expert beside the base chunk: then each expert is read at most
    once anyway, so the cache keeps them all and the chunk gets only what is left."""
    slot = slot_bytes(ts.expert_bytes)
    base = base_chunk(context)

    def need(chunk: int, slots: int) -> int:
        floor = _floor(cfg, ts, context, snapshots, trunk.embed_stream, process_bytes, chunk,
                       head_stream, verify_bytes)
        return floor.total + trunk.cost(ring_slots) + slots * slot

    slots = _min_expert_slots(cfg, ts)
    if ts.n_experts_total and need(base, ts.n_experts_total) <= budget:
        slots = ts.n_experts_total
    if need(base, slots) > budget:  # the caller checked the base chunk fits: defensive
        return base
    lo, hi = base, context
    while lo < hi:  # the work buffers grow with the chunk, so bisect
        mid = (lo + hi + 1) // 2
        if need(mid, slots) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _min_expert_slots(cfg: ModelConfig, ts: TensorSizes) -> int:
    if ts.n_experts_total == 0:
        return 0
    return min(cfg.top_k + SPARE_EXPERT_SLOTS, ts.n_experts_total)


def _check_ring_slots(ring_slots: int, budget: int, context: int) -> None:
    if ring_slots < 2:
        raise PlanError(f"a streamed trunk needs a ring of at least 2 slots (a reader one "
                        f"unit ahead), got {ring_slots}", budget=budget, context=context)


def _need(cfg: ModelConfig, ts: TensorSizes, floors: Mapping[bool, _Floor], trunk: _Trunk,
          ring_slots: int, head_stream: bool = False) -> int:
    """The smallest budget `trunk` fits in: held with the minimum expert cache, and the
    peak while the engine opens the model (`floors` made with the same `head_stream`)."""
    floor = floors[trunk.embed_stream]
    held = floor.total + trunk.cost(ring_slots) + _min_expert_slots(cfg, ts) * slot_bytes(
        ts.expert_bytes)
    return max(held, _open_peak(ts, floor, trunk, head_stream))


def _floors(cfg: ModelConfig, ts: TensorSizes, context: int, snapshots: int,
            process_bytes: int, head_stream: bool, verify_bytes: int = 0) -> dict[bool, _Floor]:
    """The floor with and without the embedding table, for one lm_head choice."""
    return {e: _floor(cfg, ts, context, snapshots, e, process_bytes, None, head_stream, verify_bytes)
            for e in (False, True)}


def _smallest(cfg: ModelConfig, ts: TensorSizes, context: int, snapshots: int,
              lookahead: int, ring_slots: int,
              process_bytes: int = 0) -> tuple[int, _Trunk, bool]:
    """The smallest budget any plan at `context` fits in, its trunk layout and whether
    lm_head streams (ties keep it held)."""
    options = _trunk_options(_layout(ts, lookahead))
    best: tuple[int, _Trunk, bool] | None = None
    for head_stream in (False, True):
        floors = _floors(cfg, ts, context, snapshots, process_bytes, head_stream)
        need, trunk = min(((_need(cfg, ts, floors, t, ring_slots, head_stream), t)
                           for t in options), key=lambda x: x[0])
        if best is None or need < best[0]:
            best = (need, trunk, head_stream)
    assert best is not None
    return best


def minimum_budget(cfg: ModelConfig, ts: TensorSizes, context: int,
                   snapshots: int = DEFAULT_SNAPSHOTS, *, lookahead: int = 0,
                   ring_slots: int = RING_SLOTS, process_bytes: int = 0) -> int:
    """The smallest budget any plan at `context` fits in."""
    return _smallest(cfg, ts, context, snapshots, lookahead, ring_slots, process_bytes)[0]


def max_context(cfg: ModelConfig, ts: TensorSizes, budget: int,
                snapshots: int = DEFAULT_SNAPSHOTS, limit: int = 1 << 31, *,
                lookahead: int = 0, ring_slots: int = RING_SLOTS,
                process_bytes: int = 0) -> int | None:
    """The largest context a plan fits at `budget`, or None if not even one token does."""
    def need(context: int) -> int:
        return minimum_budget(cfg, ts, context, snapshots, lookahead=lookahead,
                              ring_slots=ring_slots, process_bytes=process_bytes)

    if need(1) > budget:
        return None
    lo, hi = 1, limit
    while lo < hi:  # the minimum grows with the context, so bisect
        mid = (lo + hi + 1) // 2
        if need(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _unit_text(lay: _Layout, unit: tuple[int, int]) -> str:
    L, u = unit
    nbytes, count = lay.unit_raw[L][u]
    return f"layer {L}'s {_UNIT_NAMES[u]} matrices, {nbytes:,} B in {count} tensors"


def _trunk_text(lay: _Layout, trunk: _Trunk, ring_slots: int) -> str:
    if trunk.resident:
        return f"trunk matrices resident {sz.format_bytes(trunk.pinned_bytes)}"
    assert trunk.ring_unit is not None
    text = (f"trunk ring {ring_slots} x {sz.format_bytes(trunk.ring_slot)} ({trunk.ring_slot:,} "
            f"B; the largest streamed unit is {_unit_text(lay, trunk.ring_unit)})")
    if trunk.pinned:
        text += (f" + {len(trunk.pinned)} pinned layer(s) {sz.format_bytes(trunk.pinned_bytes)}"
                 f" (layers {_ranges(trunk.pinned)})")
    if trunk.router_bytes:
        text += (f" + the routers of {sum(1 for L in trunk.streamed if lay.routers[L])} "
                 f"streamed MoE layers held for the lookahead "
                 f"{sz.format_bytes(trunk.router_bytes)}")
    return text


def _refusal(cfg: ModelConfig, ts: TensorSizes, budget: int, context: int, snapshots: int,
             lookahead: int, ring_slots: int, process_bytes: int = 0) -> PlanError:
    need, smallest, head_stream = _smallest(cfg, ts, context, snapshots, lookahead, ring_slots,
                                            process_bytes)
    floor = _floor(cfg, ts, context, snapshots, smallest.embed_stream, process_bytes, None,
                   head_stream)
    k, slot = _min_expert_slots(cfg, ts), slot_bytes(ts.expert_bytes)
    fits = max_context(cfg, ts, budget, snapshots, lookahead=lookahead, ring_slots=ring_slots,
                       process_bytes=process_bytes)
    parts = ", ".join(f"{name} {sz.format_bytes(v)}" for name, v in floor.parts.items())
    if smallest.embed_stream:
        parts += (f"; embedding rows read per token, {embed_row_bytes(cfg, ts):,} B each, "
                  f"instead of holding the {sz.format_bytes(ts.embed)} table")
    if head_stream:
        parts += (f"; lm_head read per token in blocks of {head_block_rows(cfg, ts):,} rows "
                  f"({sz.format_bytes(ts.lm_head)} per token) instead of held")
    advice = f"What to do: give --memory {_round_up_g(need)} or more"
    if fits is not None:
        advice += f", or a context of at most {fits:,} tokens at this budget"
    else:
        one = minimum_budget(cfg, ts, 1, snapshots, lookahead=lookahead, ring_slots=ring_slots,
                             process_bytes=process_bytes)
        advice += (f" (a smaller context does not help: even one token needs "
                   f"{sz.format_bytes(one)})")
    if lookahead > 0:
        without = minimum_budget(cfg, ts, context, snapshots, ring_slots=ring_slots,
                                 process_bytes=process_bytes)
        advice += (f", or turn router lookahead off (lookahead 0 needs "
                   f"{sz.format_bytes(without)} ({without:,} B))")
    lines = [
        f"memory plan refused: a budget of {sz.format_bytes(budget)} ({budget:,} B) cannot "
        f"hold the smallest plan for a context of {context:,} tokens, which needs "
        f"{sz.format_bytes(need)} ({need:,} B):",
        f"  floor {sz.format_bytes(floor.total)} ({parts});",
        f"  {_trunk_text(_layout(ts, lookahead), smallest, ring_slots)};",
        f"  expert cache {k} slots x {slot:,} B = {sz.format_bytes(k * slot)} (one layer's "
        f"top-{cfg.top_k} + {SPARE_EXPERT_SLOTS} spare).",
        advice + ".",
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
              check_machine: bool = True, snapshots: int = DEFAULT_SNAPSHOTS,
              lookahead: int = 0, ring_slots: int = RING_SLOTS, process_bytes: int = 0,
              speculative: int = 0) -> Plan:
    """Split `budget_bytes` for `context` tokens; raise PlanError (with numbers) if it cannot.

    `tensor_sizes` is a TensorSizes or a name -> bytes table of the checkpoint. `lookahead`
    is the engine's router lookahead (experts per token prefetched for the next layer): when
    positive, every streamed MoE layer's router stays resident. `ring_slots` (>= 2) is the
    engine's ring size when the trunk streams. `process_bytes` is what the process needs
    beside the engine (see budgeted.process_reserve): the budget is a ceiling for the whole
    process, so the engine is given the rest. `speculative` > 0 adds the verify record of
    exact speculative decoding to the floor (verify_record_bytes).
    """
    ts = (tensor_sizes if isinstance(tensor_sizes, TensorSizes)
          else sizes_from_table(cfg, tensor_sizes))
    if context < 1:
        raise PlanError(f"context must be at least 1 token, got {context}", budget=budget_bytes,
                        context=context)
    if budget_bytes < 1:
        raise PlanError(f"budget must be positive, got {budget_bytes}", budget=budget_bytes,
                        context=context)
    if lookahead < 0:
        raise PlanError(f"lookahead must be 0 (off) or more experts, got {lookahead}",
                        budget=budget_bytes, context=context)
    if process_bytes < 0:
        raise PlanError(f"process_bytes must be >= 0, got {process_bytes}",
                        budget=budget_bytes, context=context)
    _check_ring_slots(ring_slots, budget_bytes, context)
    machine_limit = _check_machine(budget_bytes, context) if check_machine else None
    verify = verify_record_bytes(cfg, speculative)
    slot = slot_bytes(ts.expert_bytes)
    k = _min_expert_slots(cfg, ts)
    lay = _layout(ts, lookahead)
    # Trunk first: the layout pinning the most bytes that fits beside the minimum cache,
    # with lm_head held; streamed (read whole every token) only when nothing else fits.
    trunk, head_stream = None, False
    for head_stream in (False, True):
        floors = _floors(cfg, ts, context, snapshots, process_bytes, head_stream, verify)
        trunk = next((t for t in _trunk_options(lay)
                      if _need(cfg, ts, floors, t, ring_slots, head_stream) <= budget_bytes),
                     None)
        if trunk is not None:
            break
    if trunk is None:
        raise _refusal(cfg, ts, budget_bytes, context, snapshots, lookahead, ring_slots,
                       process_bytes)
    chunk = _largest_chunk(cfg, ts, budget_bytes, context, snapshots, trunk, ring_slots,
                           process_bytes, head_stream, verify)
    floor = _floor(cfg, ts, context, snapshots, trunk.embed_stream, process_bytes, chunk,
                   head_stream, verify)
    rest = budget_bytes - floor.total - trunk.cost(ring_slots)
    slots = min(rest // slot, ts.n_experts_total)
    unit = trunk.ring_unit
    unit_bytes, unit_tensors = lay.unit_raw[unit[0]][unit[1]] if unit else (0, 0)
    return Plan(
        budget=budget_bytes, context=context, prefill_chunk=chunk,
        work_parts=work_buffer_parts(cfg, context, chunk),
        embed_stream=trunk.embed_stream, embed_bytes=floor.parts["embeddings"],
        embed_table_bytes=ts.embed, embed_row_bytes=embed_row_bytes(cfg, ts),
        lm_head_bytes=floor.parts["lm_head"],
        model_vector_bytes=floor.parts["output norms (fp32)"],
        layer_vector_bytes=floor.parts["layer vectors (fp32)"],
        kda_state_bytes=floor.parts["KDA state"],
        snapshots=snapshots, snapshot_bytes=floor.parts["turn snapshots"],
        mla_cache_bytes=floor.parts["MLA latent cache"],
        mla_bytes_per_position=mla_bytes_per_position(cfg),
        work_bytes=floor.parts["work buffers"], staging_bytes=floor.parts["I/O staging"],
        trunk_bytes=ts.trunk_total, trunk_matrix_bytes=sum(lay.matrices),
        trunk_resident=trunk.resident, pinned_layers=trunk.pinned,
        pinned_bytes=trunk.pinned_bytes, streamed_layers=trunk.streamed,
        streamed_bytes=trunk.streamed_bytes, lookahead=lookahead,
        router_bytes=trunk.router_bytes,
        ring_slots=0 if trunk.resident else ring_slots,
        ring_slot_bytes=trunk.ring_slot,
        ring_unit=f"layer {unit[0]} {_UNIT_NAMES[unit[1]]}" if unit else "",
        ring_unit_bytes=unit_bytes, ring_unit_tensors=unit_tensors,
        expert_bytes=ts.expert_bytes, expert_slot_bytes=slot, expert_slots=slots,
        expert_cache_bytes=slots * slot, min_expert_slots=k,
        experts_total=ts.n_experts_total, top_k=cfg.top_k, moe_layers=len(cfg.moe_layers),
        sizes_source=ts.source, process_bytes=process_bytes, machine_limit=machine_limit,
        speculative=max(speculative, 0), verify_bytes=verify,
        layer_bytes=ts.layer_trunk,
        open_peak_bytes=_open_peak(ts, floor, trunk, head_stream),
        head_stream=head_stream, head_block_rows=head_block_rows(cfg, ts) if head_stream else 0,
        head_table_bytes=ts.lm_head, ffn_split=trunk.ffn_split,
        layer_matrix_bytes=lay.matrices, layer_unit_slots=lay.unit_slots(trunk.ffn_split),
    )


def make_plan_default_lookahead(cfg: ModelConfig, tensor_sizes: TensorSizes | Mapping[str, int],
                                budget_bytes: int, context: int = DEFAULT_CONTEXT, *,
                                check_machine: bool = True, process_bytes: int = 0,
                                speculative: int = 0) -> Plan:
    """The plan with k3chat's default lookahead: the model's top-k when the trunk is
    resident, off when it streams. `k3chat bench` measured lookahead 1.44-1.50x faster with
    the trunk resident and no gain with it streamed (0.96-1.01x: the prefetches compete
    with the trunk reads), where its resident routers are better spent on pinned layers."""
    try:
        plan = make_plan(cfg, tensor_sizes, budget_bytes, context, check_machine=check_machine,
                         lookahead=cfg.top_k, process_bytes=process_bytes, speculative=speculative)
        if plan.trunk_resident:
            return plan
    except PlanError:
        pass
    return make_plan(cfg, tensor_sizes, budget_bytes, context, check_machine=check_machine,
                     lookahead=0, process_bytes=process_bytes, speculative=speculative)


# ---------------------------------------------------------------------------------------
# `k3chat plan`
# ---------------------------------------------------------------------------------------

from .exit_codes import EXIT_OK, EXIT_USAGE  # noqa: E402 - one definition for every command


def _context_arg(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"context must be at least 1 token, got {value}")
    return value


def _lookahead_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of experts, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"lookahead must be 0 (off) or more, got {value}")
    return value


from .limits import MAX_SPECULATIVE, speculative_arg  # noqa: E402 - one definition


def _prompt_arg(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a prompt has at least 1 token, got {value}")
    return value


def _gbps_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a speed in GB/s, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"a disk speed is a positive number of GB/s, got {text}")
    return value


def prompt_report(plan: Plan, prompt_tokens: int) -> dict[str, Any]:
    """How a prompt of `prompt_tokens` is fed under `plan`, beside the engine's default chunk
    and one pass for the whole prompt: passes and expected routed-expert bytes."""
    per_layer = plan.experts_total // plan.moe_layers if plan.moe_layers else 0
    every_once = plan.moe_layers * per_layer * plan.expert_bytes

    def case(chunk: int) -> dict[str, Any]:
        passes = plan.prefill_passes(prompt_tokens, chunk)
        return {"chunk": chunk, "passes": len(passes),
                "expected_expert_bytes": round(plan.prefill_expert_bytes(prompt_tokens, chunk))}

    return {"prompt_tokens": prompt_tokens, "plan": case(plan.prefill_chunk),
            "default_chunk": case(PREFILL_CHUNK), "one_pass": case(prompt_tokens),
            "every_expert_once_bytes": every_once,
            "routing": "expected distinct experts per pass and MoE layer under uniform "
                       "routing, n x (1 - (1 - k/n)^tokens), each read once per pass; "
                       "the engine's statistics (expert_bytes_read) report what was read"}


def _prompt_text(rep: Mapping[str, Any]) -> str:
    def line(label: str, c: Mapping[str, Any]) -> str:
        nbytes = c["expected_expert_bytes"]
        return (f"  {label:<22} chunk {c['chunk']:>7,} tokens, {c['passes']:>5,} pass(es): "
                f"{nbytes:>22,} B {sz.format_bytes(nbytes):>12}")

    return "\n".join([
        f"prompt of {rep['prompt_tokens']:,} tokens: expected routed-expert bytes read "
        f"(uniform routing: each pass reads the distinct experts its tokens route to, once)",
        line("this plan", rep["plan"]), line("engine default", rep["default_chunk"]),
        line("whole prompt at once", rep["one_pass"]),
        f"  (every routed expert once: {rep['every_expert_once_bytes']:,} B; the engine's "
        f"statistics report what was read: expert_bytes_read)"])


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
    ap.add_argument("--speculative", type=speculative_arg, default=0, metavar="N",
                    help="count the verify record of exact speculative decoding with up to N "
                         "drafted tokens (run/chat/serve --speculative N); default 0, off")
    ap.add_argument("--lookahead", type=_lookahead_arg, default=None,
                    help="router lookahead the engine will run with: experts per token "
                         "prefetched for the next layer (default, as `k3chat run` does: "
                         "the model's top-k when the trunk is resident, else 0 = off); when "
                         "on, the routers of streamed layers stay resident")
    ap.add_argument("--prompt-tokens", type=_prompt_arg, default=None, metavar="N",
                    help="also report how a prompt of N tokens is fed: the prefill chunk, the "
                         "passes and the expected expert bytes read (uniform routing)")
    ap.add_argument("--disk-gbps", type=_gbps_arg, default=None, metavar="GB/S",
                    help="the disk's read speed in GB/s (what `k3chat doctor` measures): when "
                         "the plan streams lm_head, also say what that costs per token in time")
    ap.add_argument("--json", dest="json_out", help="also write the plan as JSON to this file")
    ap.add_argument("--no-machine-check", action="store_true",
                    help="plan for another machine: do not compare the budget with this "
                         "machine's available memory")
    return ap


def _write_json(path: str, payload: dict[str, Any]) -> None:
    write_private(path, json.dumps(payload, indent=2) + "\n")  # 0600 like run --json


def main_plan(argv: Sequence[str]) -> int:
    """`k3chat plan MODEL_DIR [--memory X] [--context N] [--lookahead K] [--prompt-tokens N]
    [--disk-gbps S] [--json OUT]`:
    0 ok, 2 refused."""
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
        machine = check and not sz.is_auto(args.memory)
        # This process stands in for the one that will run the model (which measures its own).
        process = sz.process_reserve()
        if args.lookahead is None:
            plan = make_plan_default_lookahead(cfg, ts, budget, args.context, check_machine=machine,
                                               process_bytes=process, speculative=args.speculative)
        else:
            plan = make_plan(cfg, ts, budget, args.context, check_machine=machine,
                             lookahead=args.lookahead, process_bytes=process,
                             speculative=args.speculative)
        if args.prompt_tokens is not None and args.prompt_tokens > args.context:
            raise PlanError(f"a prompt of {args.prompt_tokens:,} tokens does not fit a context of "
                            f"{args.context:,} tokens. What to do: give --context "
                            f"{args.prompt_tokens:,} or more", budget=budget, context=args.context)
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
    print(plan.table(args.disk_gbps))
    payload: dict[str, Any] = {"ok": True, "model_dir": str(args.model_dir), "plan": plan.to_dict()}
    if args.disk_gbps is not None:
        payload["disk_gb_per_s"] = args.disk_gbps
        payload["head_read_seconds_per_token"] = plan.read_seconds(plan.head_read_per_token,
                                                                   args.disk_gbps)
    if args.prompt_tokens is not None:
        payload["prompt"] = prompt_report(plan, args.prompt_tokens)
        print(_prompt_text(payload["prompt"]))
    if args.json_out:
        _write_json(args.json_out, payload)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main_plan(sys.argv[1:]))
