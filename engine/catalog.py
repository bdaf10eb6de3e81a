"""The tensor catalogue (spec k3-model.md 3.3), binding a checkpoint to it, and the
contiguity checks of spec 3.4.

Shapes come from the config only, so the same code serves the real model and the tiny
fixtures. `bind` is the single place that decides whether a checkpoint's tensor set is
acceptable; the C engine trusts the table it is handed afterwards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import numpy as np

from .config import MXFP4_GROUP, TRUNK_DTYPES, ModelConfig
from .errors import TensorSetError
from .safetensors_io import LANGUAGE_PREFIX, Checkpoint, TensorInfo, warn_total_size_once

__all__ = [
    "TensorSpec", "Run", "RunPlan", "EXPERT_PARTS", "EXPERT_MARK",
    "expected_tensors", "trunk_specs", "model_specs", "expert_specs", "expert_names",
    "layer_prefix", "classify", "bind", "check_a_log",
    "trunk_run", "expert_run", "plan_runs",
]

Kind = Literal["trunk", "expert", "model"]
Class = Literal["trunk", "expert", "model", "vision"]

EXPERT_DTYPES = frozenset({"U8"})  # MXFP4 packed nibbles and E8M0 scales
# Spec 3.3's f32 column: the release stores these in F32 whatever config.json's dtype says.
F32_SUFFIXES = ("_conv1d.weight", ".dt_bias", ".A_log")
_UNSET: frozenset[str] = frozenset()  # a trunk spec's dtypes before trunk_specs decides them

MODEL_PREFIX = "language_model.model."
LAYERS_PREFIX = "language_model.model.layers."
EXPERT_MARK = ".block_sparse_moe.experts."
# The on-disk order of one expert's run (spec 3.4); the engine slices a run read in this order.
EXPERT_PARTS = ("w1.weight_packed", "w1.weight_scale", "w2.weight_packed",
                "w2.weight_scale", "w3.weight_packed", "w3.weight_scale")
MAX_LISTED = 200  # per category in a message; the exception carries the full lists


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What the engine requires of one tensor."""

    shape: tuple[int, ...]
    kind: Kind
    dtypes: frozenset[str]
    min_len: bool = False  # 1-D and may be LONGER than shape[0] (A_log ships zero-padded)
    why: str = ""  # where the dtype contract comes from, for the refusal

    def problem(self, info: TensorInfo) -> str | None:
        """Why `info` does not satisfy this spec, or None."""
        if info.dtype not in self.dtypes:
            why = f" ({self.why})" if self.why else ""
            return f"dtype {info.dtype}, expected {' or '.join(sorted(self.dtypes))}{why}"
        if self.min_len:
            if len(info.shape) != 1 or info.shape[0] < self.shape[0]:
                return f"shape {list(info.shape)}, expected [n] with n >= {self.shape[0]}"
        elif info.shape != self.shape:
            return f"shape {list(info.shape)}, expected {list(self.shape)}"
        return None


def _trunk(*shape: int) -> TensorSpec:
    return TensorSpec(tuple(shape), "trunk", _UNSET)


def _config_dtype_reason(cfg: ModelConfig) -> str:
    torch_name = next((k for k, v in TRUNK_DTYPES.items() if v == cfg.trunk_dtype),
                      cfg.trunk_dtype)
    return f"config.json text_config.dtype is {torch_name}"


def _with_dtype(cfg: ModelConfig, local: str, spec: TensorSpec) -> TensorSpec:
    """The one dtype a non-expert tensor may have: F32 for spec 3.3's f32 tensors, else the
    config's. Reading another (say F16 where the config says bfloat16, a one-byte header
    edit) would silently change the weights, so it is refused."""
    if local.endswith(F32_SUFFIXES):
        return replace(spec, dtypes=frozenset({"F32"}),
                       why="spec 3.3: conv weights, dt_bias and A_log are stored in F32")
    return replace(spec, dtypes=frozenset({cfg.trunk_dtype}), why=_config_dtype_reason(cfg))


def layer_prefix(layer: int) -> str:
    return f"{LAYERS_PREFIX}{layer}."


# ---------------------------------------------------------------------------------------
# Catalogue
# ---------------------------------------------------------------------------------------


def _common(cfg: ModelConfig) -> dict[str, TensorSpec]:
    e = cfg.hidden
    return {
        "input_layernorm.weight": _trunk(e),
        "post_attention_layernorm.weight": _trunk(e),
        "self_attention_res_norm.weight": _trunk(e),
        "mlp_res_norm.weight": _trunk(e),
        "self_attention_res_proj.weight": _trunk(1, e),
        "mlp_res_proj.weight": _trunk(1, e),
    }


def _kda(cfg: ModelConfig) -> dict[str, TensorSpec]:
    e, p, d, k = cfg.hidden, cfg.kda_width, cfg.kda_head_dim, cfg.conv_kernel
    specs = {f"self_attn.{x}_proj.weight": _trunk(p, e) for x in "qkvg"}
    specs |= {f"self_attn.{x}_conv1d.weight": _trunk(p, 1, k) for x in "qkv"}
    specs |= {
        "self_attn.o_proj.weight": _trunk(e, p),
        "self_attn.f_a_proj.weight": _trunk(d, e),  # one shared rank-D decay pair
        "self_attn.f_b_proj.weight": _trunk(p, d),
        "self_attn.b_proj.weight": _trunk(cfg.kda_heads, e),
        "self_attn.A_log": TensorSpec((cfg.kda_heads,), "trunk", _UNSET, min_len=True),
        "self_attn.dt_bias": _trunk(p),  # per head AND channel
        "self_attn.o_norm.weight": _trunk(d),  # shared by all heads
    }
    return specs


def _mla(cfg: ModelConfig) -> dict[str, TensorSpec]:
    e = cfg.hidden
    return {
        "self_attn.q_a_proj.weight": _trunk(cfg.q_lora_rank, e),
        "self_attn.q_a_layernorm.weight": _trunk(cfg.q_lora_rank),
        "self_attn.q_b_proj.weight": _trunk(cfg.mla_q_width, cfg.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": _trunk(cfg.kv_a_dim, e),
        "self_attn.kv_a_layernorm.weight": _trunk(cfg.kv_lora_rank),  # latent only
        "self_attn.kv_b_proj.weight": _trunk(cfg.kv_b_rows, cfg.kv_lora_rank),
        "self_attn.g_proj.weight": _trunk(cfg.mla_value_width, e),
        "self_attn.o_proj.weight": _trunk(e, cfg.mla_value_width),
    }


def _dense(cfg: ModelConfig) -> dict[str, TensorSpec]:
    e, i = cfg.hidden, cfg.dense_width
    return {
        "mlp.gate_proj.weight": _trunk(i, e),
        "mlp.up_proj.weight": _trunk(i, e),
        "mlp.down_proj.weight": _trunk(e, i),
    }


def _moe(cfg: ModelConfig) -> dict[str, TensorSpec]:
    # Router, latent projections and the fused shared MLP are trunk: BF16, never streamed.
    e, lat, s, m = cfg.hidden, cfg.latent_dim, cfg.shared_width, "block_sparse_moe."
    return {
        f"{m}gate.weight": _trunk(cfg.n_experts, e),
        f"{m}gate.e_score_correction_bias": _trunk(cfg.n_experts),
        f"{m}routed_expert_down_proj.weight": _trunk(lat, e),
        f"{m}routed_expert_up_proj.weight": _trunk(e, lat),
        f"{m}routed_expert_norm.weight": _trunk(lat),
        f"{m}shared_experts.gate_proj.weight": _trunk(s, e),
        f"{m}shared_experts.up_proj.weight": _trunk(s, e),
        f"{m}shared_experts.down_proj.weight": _trunk(e, s),
    }


def trunk_specs(cfg: ModelConfig, layer: int) -> dict[str, TensorSpec]:
    """Full names and specs of every trunk tensor of one layer (no routed experts)."""
    local = _common(cfg)
    local |= _mla(cfg) if cfg.is_mla(layer) else _kda(cfg)
    local |= _moe(cfg) if cfg.is_moe(layer) else _dense(cfg)
    prefix = layer_prefix(layer)
    return {prefix + k: _with_dtype(cfg, k, v) for k, v in local.items()}


def expert_specs(cfg: ModelConfig) -> tuple[TensorSpec, ...]:
    """Specs of one routed expert's six tensors, in EXPERT_PARTS order."""
    lat, i = cfg.latent_dim, cfg.expert_width

    def u8(rows: int, cols: int) -> TensorSpec:
        return TensorSpec((rows, cols), "expert", EXPERT_DTYPES,
                          why="MXFP4 blocks and E8M0 scales are stored as bytes")

    w13 = (u8(i, lat // 2), u8(i, lat // MXFP4_GROUP))  # [I_e, l]: l -> I_e
    w2 = (u8(lat, i // 2), u8(lat, i // MXFP4_GROUP))  # [l, I_e]: I_e -> l
    return (*w13, *w2, *w13)


def expert_names(layer: int, expert: int) -> tuple[str, ...]:
    """One expert's six tensor names, in run order (EXPERT_PARTS)."""
    base = f"{LAYERS_PREFIX}{layer}{EXPERT_MARK}{expert}."
    return tuple(base + part for part in EXPERT_PARTS)


def model_specs(cfg: ModelConfig) -> dict[str, TensorSpec]:
    e, v = cfg.hidden, cfg.vocab

    def spec(*shape: int) -> TensorSpec:
        return TensorSpec(tuple(shape), "model", frozenset({cfg.trunk_dtype}),
                          why=_config_dtype_reason(cfg))

    return {
        f"{MODEL_PREFIX}embed_tokens.weight": spec(v, e),
        "language_model.lm_head.weight": spec(v, e),  # not tied to the embedding
        f"{MODEL_PREFIX}norm.weight": spec(e),
        f"{MODEL_PREFIX}output_attn_res_norm.weight": spec(e),
        f"{MODEL_PREFIX}output_attn_res_proj.weight": spec(1, e),
    }


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every language_model tensor the engine needs for `cfg`, with its required spec."""
    out: dict[str, TensorSpec] = {}
    # Suffixes built once: the real model has 494,592 expert names, so this loop is hot.
    parts = [(f".{part}", spec) for part, spec in zip(EXPERT_PARTS, expert_specs(cfg))]
    for layer in range(cfg.n_layers):
        out |= trunk_specs(cfg, layer)
        if cfg.is_moe(layer):
            base = f"{LAYERS_PREFIX}{layer}{EXPERT_MARK}"
            out.update({f"{base}{e}{suffix}": spec
                        for e in range(cfg.n_experts) for suffix, spec in parts})
    out |= model_specs(cfg)
    return out


def classify(name: str) -> Class:
    """'vision' (ignored), 'expert' (routed, streamed), 'trunk' (per layer) or 'model'."""
    if not name.startswith(LANGUAGE_PREFIX):
        return "vision"
    if EXPERT_MARK in name:
        return "expert"
    if name.startswith(LAYERS_PREFIX):
        return "trunk"
    return "model"


def check_a_log(values: np.ndarray, kda_heads: int) -> str | None:
    """Spec 3.3: use the first H_k entries; the rest is padding and must be exactly zero."""
    flat = np.asarray(values).reshape(-1)
    if flat.size < kda_heads:
        return f"A_log has {flat.size} entries, fewer than the {kda_heads} KDA heads"
    used, pad = flat[:kda_heads], flat[kda_heads:]
    if not np.all(np.isfinite(used)):
        return "A_log holds a NaN or infinite value in its used entries"
    bad = np.flatnonzero(pad != 0)  # NaN != 0 too, so NaN padding is refused
    if bad.size:
        return (f"A_log padding entry {kda_heads + int(bad[0])} is {pad[bad[0]]!r}, not 0 "
                f"({bad.size} non-zero padding entries): the layout differs from the release")
    return None


# ---------------------------------------------------------------------------------------
# Binding a checkpoint to the catalogue
# ---------------------------------------------------------------------------------------


def _listing(title: str, lines: list[str]) -> list[str]:
    if not lines:
        return []
    shown = [f"    {line}" for line in lines[:MAX_LISTED]]
    if len(lines) > MAX_LISTED:
        shown.append(f"    ... and {len(lines) - MAX_LISTED} more lines")
    return [f"  {title}:", *shown]


def _missing_lines(missing: list[str], ckpt: Checkpoint) -> list[str]:
    """One line per absent shard (naming it), then one per other missing tensor."""
    lines: list[str] = []
    by_absent: dict[str, list[str]] = defaultdict(list)
    absent = set(ckpt.missing_shards)
    for name in missing:
        shard = ckpt.assigned.get(name)
        if shard in absent:
            by_absent[shard].append(name)
        elif shard is None:
            where = "the index" if ckpt.sharded else ckpt.listed_shards[0]
            lines.append(f"{name} (not in {where})")
        else:
            lines.append(f"{name} (the index assigns it to {shard})")
    shards = [f"{len(names)} tensor(s) the index assigns to {shard}, which is not in "
              f"{ckpt.dir}: e.g. {names[0]}" for shard, names in sorted(by_absent.items())]
    return shards + lines


def _check_found(expected: dict[str, TensorSpec],
                 found: dict[str, TensorInfo]) -> list[str]:
    """Misshapen or wrong-dtype tensors, and experts split over shards (spec 4 refuses those)."""
    bad: list[str] = []
    expert_shard: dict[str, str] = {}
    split: dict[str, set[str]] = {}
    for name, info in found.items():
        spec = expected.get(name)
        if spec is None:
            continue  # reported as unexpected
        if not (info.shape == spec.shape and info.dtype in spec.dtypes):
            problem = spec.problem(info)  # None for a padded A_log
            if problem:
                bad.append(f"{name} in {info.shard}: {problem}")
        if spec.kind == "expert":
            expert = name.rsplit(".", 2)[0]  # "...experts.{E}" (drop "w1.weight_packed")
            first = expert_shard.setdefault(expert, info.shard)
            if first != info.shard:
                split.setdefault(expert, {first}).add(info.shard)
    for expert, shards in split.items():
        bad.append(f"{expert}: its six tensors are split over {', '.join(sorted(shards))}; "
                   f"an expert must lie in one shard")
    return bad


def bind(cfg: ModelConfig, ckpt: Checkpoint) -> None:
    """Check every language_model tensor against the catalogue; one error lists everything."""
    expected = expected_tensors(cfg)
    found = ckpt.tensors
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    extra += [n for n in ckpt.assigned if n not in expected and n not in found]
    extra.sort()
    misshapen = _check_found(expected, found)
    if not (missing or extra or misshapen):
        warn_total_size_once(ckpt)
        return
    lines = [f"{ckpt.dir}: the checkpoint does not match its config.json "
             f"({len(missing)} missing, {len(extra)} unexpected, {len(misshapen)} misshapen):"]
    lines += _listing("missing", _missing_lines(missing, ckpt))
    lines += _listing("unexpected (not used by this config)", extra)
    lines += _listing("misshapen or wrong dtype", misshapen)
    if ckpt.total_size_problem:
        lines.append(f"  also: {ckpt.total_size_problem}")
    lines.append("The shards and config.json must come from the same release: re-download the "
                 "shards named above, or the config if the shards are right.")
    raise TensorSetError("\n".join(lines), missing, extra, misshapen)


# ---------------------------------------------------------------------------------------
# Contiguity (spec 3.4): verify from the headers, never assume
# ---------------------------------------------------------------------------------------


class Run(NamedTuple):
    """One gap-free byte range [lo, hi) of a shard, readable with a single request."""

    shard: str
    lo: int
    hi: int


def _present(ckpt: Checkpoint, names: Iterable[str]) -> list[TensorInfo] | None:
    infos = [ckpt.tensors.get(n) for n in names]
    return None if any(i is None for i in infos) else infos  # type: ignore[return-value]


def _tiled(items: list[TensorInfo]) -> Run | None:
    """The run if the tensors, in the given order, lie in one shard, each touching the last."""
    if not items:
        return None
    shard, pos = items[0].shard, items[0].start
    for info in items:
        if info.shard != shard or info.start != pos:
            return None
        pos = info.end
    return Run(shard, items[0].start, pos)


def trunk_run(ckpt: Checkpoint, cfg: ModelConfig, layer: int) -> Run | None:
    """Layer `layer`'s trunk as one gap-free range, whatever their order on disk; else None.

    Gap-free also means no expert (or other) bytes fall inside: spans never overlap.
    """
    infos = _present(ckpt, trunk_specs(cfg, layer))
    return None if infos is None else _tiled(sorted(infos, key=lambda i: (i.start, i.nbytes)))


def expert_run(ckpt: Checkpoint, layer: int, expert: int) -> Run | None:
    """One expert's six tensors as one range in EXPERT_PARTS order; else None."""
    infos = _present(ckpt, expert_names(layer, expert))
    return None if infos is None else _tiled(infos)


@dataclass(frozen=True)
class RunPlan:
    """Per-layer trunk runs and per-expert runs; None means per-tensor fallback reads."""

    trunk: dict[int, Run | None]
    experts: dict[tuple[int, int], Run | None]

    @property
    def trunk_fallbacks(self) -> int:
        return sum(r is None for r in self.trunk.values())

    @property
    def expert_fallbacks(self) -> int:
        return sum(r is None for r in self.experts.values())


def plan_runs(cfg: ModelConfig, ckpt: Checkpoint) -> RunPlan:
    """Check both layout properties for every layer and every expert (done once at open)."""
    trunk = {layer: trunk_run(ckpt, cfg, layer) for layer in range(cfg.n_layers)}
    experts = {(layer, e): expert_run(ckpt, layer, e)
               for layer in cfg.moe_layers for e in range(cfg.n_experts)}
    return RunPlan(trunk, experts)
