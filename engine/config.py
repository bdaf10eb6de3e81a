"""Strict reader for Kimi K3 `config.json` (spec k3-model.md sections 2.1 to 2.4).

The engine has no built-in model constants: every quantity comes from the file, every missing
field is an error (never a default), and every problem is collected and reported in one
`ConfigError` so the user can fix the file in one pass.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .safetensors_io import JSONStrictError, strict_json_loads

__all__ = ["ModelConfig", "load_config", "parse_config", "CONFIG_NAME"]

CONFIG_NAME = "config.json"
MXFP4_GROUP = 32  # OCP MX block size: one E8M0 scale per 32 elements along the input dim

_MISSING = object()
# config.json `dtype` (torch's names) -> the safetensors dtype the non-expert weights must have.
TRUNK_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class ModelConfig:
    """Validated text-model config. Layer indices here are ZERO-based (the file's are one-based)."""

    hidden: int
    n_layers: int
    vocab: int
    rms_eps: float
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float
    mla_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    n_experts: int
    top_k: int
    n_shared_experts: int
    latent_dim: int  # routed_expert_hidden_size (the latent width l the experts act in)
    expert_width: int  # moe_intermediate_size (I_e)
    dense_width: int  # intermediate_size (layer-0 dense MLP)
    first_dense: int  # first_k_dense_replace
    moe_layer_freq: int
    moe_renormalize: bool
    routed_scaling: float
    situ_beta1: float
    situ_beta2: float
    attn_res_block: int
    trunk_dtype: str  # safetensors dtype of the non-expert weights ("BF16" for the release)
    mla_layers: tuple[int, ...]  # zero-based, strictly increasing
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int

    def __post_init__(self) -> None:
        # Cheap guard for hand-built configs (fixture writers): the layer map is what
        # everything else indexes by, so a malformed one must not get through.
        layers = tuple(self.mla_layers)
        object.__setattr__(self, "mla_layers", layers)
        ok = all(isinstance(x, int) and 0 <= x < self.n_layers for x in layers)
        if not ok or any(a >= b for a, b in zip(layers, layers[1:])):
            raise ConfigError(
                [f"mla_layers must be strictly increasing zero-based indices in "
                 f"0..{self.n_layers - 1}, got {list(layers)}"],
                source="ModelConfig",
            )

    # ---- layer map -------------------------------------------------------------------
    def is_mla(self, layer: int) -> bool:
        self._check_layer(layer)
        return layer in self._mla_set

    def is_kda(self, layer: int) -> bool:
        return not self.is_mla(layer)

    def is_moe(self, layer: int) -> bool:
        self._check_layer(layer)
        return layer >= self.first_dense and layer % self.moe_layer_freq == 0

    def is_dense(self, layer: int) -> bool:
        return not self.is_moe(layer)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(L for L in range(self.n_layers) if L not in self._mla_set)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(L for L in range(self.n_layers) if self.is_moe(L))

    @cached_property
    def _mla_set(self) -> frozenset[int]:
        return frozenset(self.mla_layers)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.n_layers - 1}")

    # ---- derived widths (spec 2.4) ---------------------------------------------------
    @property
    def kda_width(self) -> int:
        return self.kda_heads * self.kda_head_dim

    @property
    def shared_width(self) -> int:
        return self.expert_width * self.n_shared_experts

    @property
    def mla_qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def mla_q_width(self) -> int:
        return self.mla_heads * self.mla_qk_dim

    @property
    def kv_a_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def kv_b_rows(self) -> int:
        return self.mla_heads * (self.qk_nope_dim + self.v_head_dim)

    @property
    def mla_value_width(self) -> int:
        return self.mla_heads * self.v_head_dim

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert's six MXFP4 tensors: 3 * I_e * l * (1/2 + 1/32)."""
        per_matrix = self.expert_width * self.latent_dim
        return 3 * (per_matrix // 2 + per_matrix // MXFP4_GROUP)

    # ---- Block AttnRes bookkeeping (spec 5.3) ----------------------------------------
    def is_block_boundary(self, layer: int) -> bool:
        return layer % self.attn_res_block == 0

    @property
    def n_block_snapshots(self) -> int:
        """Snapshots pushed over a pass: boundaries 0, S_b, ... below N."""
        return -(-self.n_layers // self.attn_res_block)

    def attn_sources(self, layer: int) -> int:
        """Sources of the attention-side AttnRes at `layer` (1 at L=0 means x = h, no mixing)."""
        return -(-layer // self.attn_res_block) + 1

    def mlp_sources(self, layer: int) -> int:
        return layer // self.attn_res_block + 2

    @property
    def output_sources(self) -> int:
        return self.n_block_snapshots + 1


# ---------------------------------------------------------------------------------------
# Field reading with type checks; every failure is appended to one problem list.
# ---------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    """Render a value as JSON so the user sees what is in the file (true, null, 1.0)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Reader:
    """Typed accessors that record a problem and return None instead of raising."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def _get(self, obj: Mapping[str, Any], key: str, where: str) -> Any:
        value = obj.get(key, _MISSING)
        if value is _MISSING:
            self.problem(f"{where}{key}: missing (required; there is no default)")
        return value

    def _wrong(self, where: str, key: str, wanted: str, value: Any) -> None:
        self.problem(f"{where}{key}: expected {wanted}, got {_show(value)}")

    def obj(self, obj: Mapping[str, Any], key: str, where: str) -> dict[str, Any] | None:
        value = self._get(obj, key, where)
        if value is _MISSING:
            return None
        if not isinstance(value, dict):
            self._wrong(where, key, "a JSON object", value)
            return None
        return value

    def int_(self, obj: Mapping[str, Any], key: str, where: str) -> int | None:
        value = self._get(obj, key, where)
        if value is _MISSING:
            return None
        if not _is_int(value):
            self._wrong(where, key, "an integer (not a float or boolean)", value)
            return None
        return value

    def float_(self, obj: Mapping[str, Any], key: str, where: str) -> float | None:
        value = self._get(obj, key, where)
        if value is _MISSING:
            return None
        # An integer literal is a valid JSON number for a real-valued field; booleans are not.
        if not (_is_int(value) or isinstance(value, float)):
            self._wrong(where, key, "a finite number", value)
            return None
        if not math.isfinite(float(value)):
            self._wrong(where, key, "a finite number", value)
            return None
        return float(value)

    def bool_(self, obj: Mapping[str, Any], key: str, where: str) -> bool | None:
        value = self._get(obj, key, where)
        if value is _MISSING:
            return None
        if not isinstance(value, bool):
            self._wrong(where, key, "true or false", value)
            return None
        return value

    def str_(self, obj: Mapping[str, Any], key: str, where: str) -> str | None:
        value = self._get(obj, key, where)
        if value is _MISSING:
            return None
        if not isinstance(value, str):
            self._wrong(where, key, "a string", value)
            return None
        return value

    def int_list(self, obj: Mapping[str, Any], key: str, where: str) -> list[int] | None:
        value = self._get(obj, key, where)
        if value is _MISSING:
            return None
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            self._wrong(where, key, "a list of integers", value)
            return None
        return value

    def str_list(self, obj: Mapping[str, Any], key: str, where: str) -> list[str] | None:
        value = self._get(obj, key, where)
        if value is _MISSING:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self._wrong(where, key, "a list of strings", value)
            return None
        return value

    # Asserted values: the engine implements exactly one variant of the architecture.
    def expect(self, obj: Mapping[str, Any], key: str, where: str, wanted: Any) -> None:
        if isinstance(wanted, bool):
            got: Any = self.bool_(obj, key, where)
        elif isinstance(wanted, int):
            got = self.int_(obj, key, where)
        else:
            got = self.str_(obj, key, where)
        if got is not None and got != wanted:
            self.problem(
                f"{where}{key}: must be {_show(wanted)} (the only variant k3chat implements), "
                f"got {_show(got)}"
            )

    def expect_null(self, obj: Mapping[str, Any], key: str, where: str) -> None:
        # Absent and null mean the same thing in compressed-tensors: no quantization.
        if obj.get(key) is not None:
            self.problem(f"{where}{key}: must be null (k3chat keeps activations in fp32), "
                         f"got {_show(obj[key])}")


# ---------------------------------------------------------------------------------------
# Structural checks
# ---------------------------------------------------------------------------------------


def _check_layer_list(r: _Reader, name: str, values: list[int], n: int | None) -> None:
    seen: set[int] = set()
    dups: list[int] = []
    for v in values:
        if v in seen and v not in dups:
            dups.append(v)
        seen.add(v)
    if dups:
        r.problem(f"{name}: duplicate entries {dups}")
    if n is not None:
        bad = sorted({v for v in values if not 1 <= v <= n})
        if bad:
            r.problem(f"{name}: entries {bad} are outside 1..{n} "
                      f"(layer lists are one-based: layer L is entry L+1)")


def _layer_map(r: _Reader, full: list[int] | None, kda: list[int] | None,
               n: int | None, where: str) -> tuple[int, ...] | None:
    """Check the two one-based lists partition 1..N; return zero-based MLA layers."""
    fname, kname = f"{where}full_attn_layers", f"{where}kda_layers"
    if full is not None:
        _check_layer_list(r, fname, full, n)
    if kda is not None:
        _check_layer_list(r, kname, kda, n)
    if full is None or kda is None:
        return None
    both = sorted(set(full) & set(kda))
    if both:
        r.problem(f"{fname} and {kname} overlap at {both}: each layer is either MLA or KDA")
    if n is not None:
        union = {v for v in (*full, *kda) if 1 <= v <= n}
        if len(union) != n:
            # Name the first few gaps only: a typo'd N must not build a huge list.
            absent = [v for v in range(1, min(n, 100_000) + 1) if v not in union][:20]
            r.problem(f"{fname} and {kname} together miss {n - len(union)} layer(s) "
                      f"(first: {absent}): their union must be exactly 1..{n}")
    return tuple(sorted(v - 1 for v in set(full)))


def _positive(r: _Reader, where: str, values: Mapping[str, int | float | None]) -> None:
    for key, value in values.items():
        if value is not None and value <= 0:
            r.problem(f"{where}{key}: must be > 0, got {_show(value)}")


# ---------------------------------------------------------------------------------------
# quantization_config
# ---------------------------------------------------------------------------------------

_QC = "text_config.quantization_config."


def _check_quant_group(r: _Reader, where: str, group: Any) -> None:
    if not isinstance(group, dict):
        r.problem(f"{where[:-1]}: expected a JSON object, got {_show(group)}")
        return
    if "format" in group:
        r.expect(group, "format", where, "mxfp4-pack-quantized")
    weights = r.obj(group, "weights", where)
    if weights is not None:
        w = f"{where}weights."
        r.expect(weights, "num_bits", w, 4)
        r.expect(weights, "type", w, "float")
        r.expect(weights, "strategy", w, "group")
        r.expect(weights, "group_size", w, MXFP4_GROUP)
        r.expect(weights, "symmetric", w, True)
        r.expect(weights, "scale_dtype", w, "torch.uint8")
    r.expect_null(group, "input_activations", where)
    r.expect_null(group, "output_activations", where)


def _ignore_matches(entries: list[tuple[str, re.Pattern[str] | None]], module: str) -> bool:
    # compressed-tensors semantics: "re:<pattern>" is re.match, anything else an exact name.
    for text, pattern in entries:
        if pattern is not None and pattern.match(module):
            return True
        if pattern is None and text == module:
            return True
    return False


def _ignore_probes(n: int | None, mla: tuple[int, ...] | None,
                   first_dense: int | None) -> dict[str, list[str]]:
    """Module names that must be ignored (left unquantized), grouped by what they are."""
    # Literal (non-regex) ignore entries name layers one by one, so probe every layer; the
    # cap only keeps a absurd num_hidden_layers (reported elsewhere) from stalling us.
    layers = range(min(n, 4096)) if n is not None else range(1)
    mla_set = set(mla or ())
    kda_proj = ["q_proj", "k_proj", "v_proj", "g_proj", "o_proj", "f_a_proj", "f_b_proj",
                "b_proj"]
    mla_proj = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"]
    fd = first_dense if first_dense is not None else 1
    pre = "language_model.model.layers"
    probes: dict[str, list[str]] = {"self_attn": [], "shared_experts": [], "dense mlp": []}
    for L in layers:
        for p in (mla_proj if L in mla_set else kda_proj):
            probes["self_attn"].append(f"{pre}.{L}.self_attn.{p}")
        mlp = ["gate_proj", "up_proj", "down_proj"]
        if L < fd:
            probes["dense mlp"] += [f"{pre}.{L}.mlp.{p}" for p in mlp]
        else:
            probes["shared_experts"] += [f"{pre}.{L}.block_sparse_moe.shared_experts.{p}"
                                         for p in mlp]
    probes["lm_head"] = ["language_model.lm_head"]
    probes["vision_tower"] = ["vision_tower.encoder.blocks.0.wqkv", "vision_tower.patch_embed.proj"]
    probes["mm_projector"] = ["mm_projector.proj.0", "mm_projector.proj.2"]
    return {k: v for k, v in probes.items() if v}


def _check_ignore(r: _Reader, ignore: list[str], n: int | None, mla: tuple[int, ...] | None,
                  first_dense: int | None) -> None:
    entries: list[tuple[str, re.Pattern[str] | None]] = []
    for text in ignore:
        if text.startswith("re:"):
            try:
                entries.append((text, re.compile(text[3:])))
            except re.error as exc:
                r.problem(f"{_QC}ignore: entry {_show(text)} is not a valid regex ({exc})")
        else:
            entries.append((text, None))
    for what, modules in _ignore_probes(n, mla, first_dense).items():
        missed = [m for m in modules if not _ignore_matches(entries, m)]
        if missed:
            r.problem(f"{_QC}ignore: does not cover {what} (e.g. {missed[0]}); only routed "
                      f"experts may be MXFP4, everything else must be listed as ignored")
    expert = "language_model.model.layers.1.block_sparse_moe.experts.0.w1"
    if _ignore_matches(entries, expert):
        r.problem(f"{_QC}ignore: covers routed experts ({expert}); they must be MXFP4")


def _check_quant(r: _Reader, qc: dict[str, Any], n: int | None, mla: tuple[int, ...] | None,
                 first_dense: int | None) -> None:
    r.expect(qc, "quant_method", _QC, "compressed-tensors")
    r.expect(qc, "format", _QC, "mxfp4-pack-quantized")
    groups = r.obj(qc, "config_groups", _QC)
    if groups is not None:
        if not groups:
            r.problem(f"{_QC}config_groups: empty; the MXFP4 weight group is required")
        for name, group in groups.items():
            _check_quant_group(r, f"{_QC}config_groups.{name}.", group)
    r.expect_null(qc, "kv_cache_scheme", _QC)
    ignore = r.str_list(qc, "ignore", _QC)
    if ignore is not None:
        _check_ignore(r, ignore, n, mla, first_dense)


# ---------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------


def _read_text(r: _Reader, tc: dict[str, Any]) -> dict[str, Any]:
    """Read every text_config field the engine uses; None marks a recorded problem."""
    w = "text_config."
    f = {
        "hidden": r.int_(tc, "hidden_size", w),
        "n_layers": r.int_(tc, "num_hidden_layers", w),
        "vocab": r.int_(tc, "vocab_size", w),
        "rms_eps": r.float_(tc, "rms_norm_eps", w),
        "mla_heads": r.int_(tc, "num_attention_heads", w),
        "kv_heads": r.int_(tc, "num_key_value_heads", w),
        "q_lora_rank": r.int_(tc, "q_lora_rank", w),
        "kv_lora_rank": r.int_(tc, "kv_lora_rank", w),
        "qk_nope_dim": r.int_(tc, "qk_nope_head_dim", w),
        "qk_rope_dim": r.int_(tc, "qk_rope_head_dim", w),
        "v_head_dim": r.int_(tc, "v_head_dim", w),
        "n_experts": r.int_(tc, "num_experts", w),
        "top_k": r.int_(tc, "num_experts_per_token", w),
        "n_shared_experts": r.int_(tc, "num_shared_experts", w),
        "latent_dim": r.int_(tc, "routed_expert_hidden_size", w),
        "expert_width": r.int_(tc, "moe_intermediate_size", w),
        "dense_width": r.int_(tc, "intermediate_size", w),
        "first_dense": r.int_(tc, "first_k_dense_replace", w),
        "moe_layer_freq": r.int_(tc, "moe_layer_freq", w),
        "moe_renormalize": r.bool_(tc, "moe_renormalize", w),
        "routed_scaling": r.float_(tc, "routed_scaling_factor", w),
        "situ_beta1": r.float_(tc, "activation_situ_beta", w),
        "situ_beta2": r.float_(tc, "activation_situ_linear_beta", w),
        "attn_res_block": r.int_(tc, "attn_res_block_size", w),
        "trunk_dtype": _read_trunk_dtype(r, tc),
    }
    r.expect(tc, "mla_use_nope", w, True)
    r.expect(tc, "mla_use_output_gate", w, True)
    r.expect(tc, "moe_router_activation_func", w, "sigmoid")
    r.expect(tc, "topk_method", w, "noaux_tc")
    r.expect(tc, "num_expert_group", w, 1)
    r.expect(tc, "topk_group", w, 1)
    r.expect(tc, "latent_moe_use_norm", w, True)
    r.expect(tc, "hidden_act", w, "situ")
    r.expect(tc, "tie_word_embeddings", w, False)
    r.expect(tc, "num_nextn_predict_layers", w, 0)
    if "model_type" in tc:
        r.expect(tc, "model_type", w, "kimi_linear")
    return f


def _read_trunk_dtype(r: _Reader, tc: dict[str, Any]) -> str | None:
    """The non-expert weights' dtype: `text_config.dtype` (older files: `torch_dtype`).

    It decides which safetensors dtype a trunk tensor may have, so a one-byte header edit
    (BF16 -> F16) cannot silently change how the weights are read."""
    w = "text_config."
    key = "dtype" if "dtype" in tc or "torch_dtype" not in tc else "torch_dtype"
    value = r.str_(tc, key, w)
    if value is None:
        return None
    if value not in TRUNK_DTYPES:
        r.problem(f"{w}{key}: must be one of {', '.join(TRUNK_DTYPES)} (the dtype of the "
                  f"non-expert weights; the release says bfloat16), got {_show(value)}")
        return None
    return TRUNK_DTYPES[value]


def _read_linear_attn(r: _Reader, la: dict[str, Any]) -> dict[str, Any]:
    w = "text_config.linear_attn_config."
    f = {
        "kda_heads": r.int_(la, "num_heads", w),
        "kda_head_dim": r.int_(la, "head_dim", w),
        "conv_kernel": r.int_(la, "short_conv_kernel_size", w),
        "gate_lower_bound": r.float_(la, "gate_lower_bound", w),
        "full": r.int_list(la, "full_attn_layers", w),
        "kda": r.int_list(la, "kda_layers", w),
    }
    r.expect(la, "use_full_rank_gate", w, True)
    return f


# Internal field -> where it lives in the file, for messages about dimensions.
_DIMENSIONS = {
    "hidden": "text_config.hidden_size", "n_layers": "text_config.num_hidden_layers",
    "vocab": "text_config.vocab_size", "mla_heads": "text_config.num_attention_heads",
    "kv_heads": "text_config.num_key_value_heads", "q_lora_rank": "text_config.q_lora_rank",
    "kv_lora_rank": "text_config.kv_lora_rank", "qk_nope_dim": "text_config.qk_nope_head_dim",
    "qk_rope_dim": "text_config.qk_rope_head_dim", "v_head_dim": "text_config.v_head_dim",
    "n_experts": "text_config.num_experts", "n_shared_experts": "text_config.num_shared_experts",
    "latent_dim": "text_config.routed_expert_hidden_size",
    "expert_width": "text_config.moe_intermediate_size",
    "dense_width": "text_config.intermediate_size",
    "attn_res_block": "text_config.attn_res_block_size",
    "kda_heads": "text_config.linear_attn_config.num_heads",
    "kda_head_dim": "text_config.linear_attn_config.head_dim",
    "conv_kernel": "text_config.linear_attn_config.short_conv_kernel_size",
}


def _check_structure(r: _Reader, f: dict[str, Any]) -> None:
    w = "text_config."
    for key, name in _DIMENSIONS.items():
        if f.get(key) is not None and f[key] < 1:
            r.problem(f"{name}: every dimension must be >= 1, got {f[key]}")
    _positive(r, w, {"rms_norm_eps": f.get("rms_eps"),
                     "routed_scaling_factor": f.get("routed_scaling"),
                     "activation_situ_beta": f.get("situ_beta1"),
                     "activation_situ_linear_beta": f.get("situ_beta2")})
    g = f.get("gate_lower_bound")
    if g is not None and g >= 0:
        r.problem(f"{w}linear_attn_config.gate_lower_bound: must be < 0, got {_show(g)}")
    heads, kv = f.get("mla_heads"), f.get("kv_heads")
    if heads is not None and kv is not None and heads != kv:
        r.problem(f"{w}num_key_value_heads ({kv}) must equal num_attention_heads ({heads})")
    k, ne = f.get("top_k"), f.get("n_experts")
    if k is not None and ne is not None and not 1 <= k <= ne:
        r.problem(f"{w}num_experts_per_token: must be in 1..num_experts ({ne}), got {k}")
    for key, name in (("latent_dim", "routed_expert_hidden_size"),
                      ("expert_width", "moe_intermediate_size")):
        v = f.get(key)
        if v is not None and v % MXFP4_GROUP:
            r.problem(f"{w}{name}: must be a multiple of {MXFP4_GROUP} (an MXFP4 input "
                      f"width), got {v}")
    n, fd = f.get("n_layers"), f.get("first_dense")
    if n is not None and fd is not None and not 0 <= fd <= n:
        r.problem(f"{w}first_k_dense_replace: must be in 0..{n}, got {fd}")
    freq = f.get("moe_layer_freq")
    if freq is not None and freq != 1:
        r.problem(f"{w}moe_layer_freq: must be 1 (the only variant k3chat implements), "
                  f"got {freq}")


def _check_special_ids(r: _Reader, ids: dict[str, int | None], vocab: int | None) -> None:
    for key, value in ids.items():
        if value is None:
            continue
        if value < 0 or (vocab is not None and value >= vocab):
            r.problem(f"{key}: must be in 0..vocab_size-1 ({vocab}), got {value}")


def parse_config(root: Mapping[str, Any], source: str = CONFIG_NAME) -> ModelConfig:
    """Validate a parsed config.json (nested K3 shape).

    Raises one ConfigError listing every problem found, never just the first.
    """
    r = _Reader()
    if not isinstance(root, Mapping):
        raise ConfigError([f"the top level must be a JSON object, got {_show(root)}"], source)
    if "model_type" in root:
        r.expect(root, "model_type", "", "kimi_k3")
    ids = {k: r.int_(root, k, "") for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    r.expect(root, "tie_word_embeddings", "", False)
    tc = r.obj(root, "text_config", "")
    if tc is None:
        raise ConfigError(r.problems, source)

    f = _read_text(r, tc)
    la = r.obj(tc, "linear_attn_config", "text_config.")
    if la is not None:
        f.update(_read_linear_attn(r, la))
    _check_structure(r, f)
    mla = _layer_map(r, f.get("full"), f.get("kda"), f.get("n_layers"),
                     "text_config.linear_attn_config.")
    qc = r.obj(tc, "quantization_config", "text_config.")
    if qc is not None:
        _check_quant(r, qc, f.get("n_layers"), mla, f.get("first_dense"))
    _check_special_ids(r, ids, f.get("vocab"))
    if r.problems:
        raise ConfigError(r.problems, source)

    fields = {k: v for k, v in f.items() if k not in ("kv_heads", "full", "kda")}
    return ModelConfig(mla_layers=mla, **fields, **ids)  # type: ignore[arg-type]


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and validate `<model_dir>/config.json`; a missing file is refused (no defaults)."""
    path = Path(model_dir) / CONFIG_NAME
    source = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError([f"file not found; the model directory {model_dir} must contain "
                           f"the released {CONFIG_NAME} (k3chat has no built-in constants)"],
                          source) from None
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc}"], source) from exc
    try:
        text = raw.decode("utf-8")
        root = strict_json_loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigError([f"not valid UTF-8 ({exc.reason} at byte {exc.start})"],
                          source) from None
    except JSONStrictError as exc:
        raise ConfigError([f"not acceptable JSON: {exc}"], source) from None
    return parse_config(root, source)
