"""Test fixtures in the released Kimi K3 layout (spec k3-model.md sections 2, 3, 9).

A fixture directory holds what a real model directory holds, at toy sizes:

- `config.json`: the real nested shape (root `kimi_k3`, `text_config` with
  `linear_attn_config` and `quantization_config`, `vision_config`);
- `tiktoken.model` + `tokenizer_config.json` (the fixture tokenizer);
- one shard per layer (all tensors of layer L in shard L+1) plus a model-level shard,
  named `model-NNNNN-of-NNNNNN.safetensors`, with `model.safetensors.index.json`
  (or one `model.safetensors` with `single_file=True`);
- `oracle.npz` / `oracle.json`: prompt, greedy continuation and teacher-forced logits
  from the numpy oracle, which the engine gates (spec 9.3) compare against;
- `fixture.json`: how the directory was made (preset, seeds, layout).

Weights follow the adversarial initialisation of spec 9.2 from one numpy Generator
seeded with `seed`, drawn in a fixed order that does not depend on the layout, so the
contiguous, scrambled and single-file variants hold byte-identical tensors.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from k3engine.private_files import make_private_dirs, write_private
from k3engine.writer import (
    EXPERT_PARTS,
    Tensor,
    WriterError,
    bf16_tensor,
    f32_tensor,
    quantize_checked,
    u8_tensor,
    write_sharded,
    write_single,
)

PROMPT_LEN = 12
GEN_LEN = 20
MIN_MARGIN = 1e-3
MAX_PROMPT_ATTEMPTS = 40
BASE_PROMPT_SEED = 1000
GENERATOR_VERSION = 1
LM = "language_model.model."


class FixtureError(RuntimeError):
    """The generator refuses to produce a fixture (a self-check or a write check failed)."""


# ------------------------------------------------------------------------ presets


@dataclass(frozen=True)
class Preset:
    """Model dimensions of one fixture; field names follow the config fields they feed."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    kda_heads: int
    kda_head_dim: int
    conv_kernel: int
    gate_lower_bound: float
    full_attn_layers: tuple[int, ...]  # one-based, as in the config
    kda_layers: tuple[int, ...]  # one-based
    mla_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    routed_expert_hidden_size: int
    moe_intermediate_size: int
    intermediate_size: int
    attn_res_block_size: int
    rms_norm_eps: float = 1e-5
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    latent_moe_use_norm: bool = True
    mla_use_output_gate: bool = True
    first_k_dense_replace: int = 1
    group_size: int = 32
    note: str = ""

    @property
    def kda_width(self) -> int:
        return self.kda_heads * self.kda_head_dim

    def is_mla(self, layer: int) -> bool:
        """Zero-based layer L is MLA iff L+1 is in full_attn_layers (spec 2.3)."""
        return (layer + 1) in self.full_attn_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace


PRESETS: dict[str, Preset] = {
    # Spec 9.1, number for number.
    "tiny": Preset(
        name="tiny",
        hidden_size=128,
        num_hidden_layers=13,
        kda_heads=4,
        kda_head_dim=16,
        conv_kernel=4,
        gate_lower_bound=-5.0,
        full_attn_layers=(4, 8, 12, 13),
        kda_layers=(1, 2, 3, 5, 6, 7, 9, 10, 11),
        mla_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=2,
        routed_expert_hidden_size=64,
        moe_intermediate_size=64,
        intermediate_size=96,
        attn_res_block_size=3,
        note="spec 9.1: 13 layers, AttnRes blocks of 3, trailing MLA pair (zero-based 11, 12)",
    ),
    # For expert-cache work: the tiny trunk widths, but 64 routed experts with top-8
    # over 4 MoE layers (256 experts of 6,528 B). Five layers keep it cheap yet still
    # cover a dense KDA layer 0, KDA+MoE layers 1-2 and a trailing MLA pair 3-4; block
    # size 2 gives boundaries 0, 2, 4 so the last block is a single MLA layer again.
    "wide": Preset(
        name="wide",
        hidden_size=128,
        num_hidden_layers=5,
        kda_heads=4,
        kda_head_dim=16,
        conv_kernel=4,
        gate_lower_bound=-5.0,
        full_attn_layers=(4, 5),
        kda_layers=(1, 2, 3),
        mla_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=64,
        num_experts_per_token=8,
        num_shared_experts=2,
        routed_expert_hidden_size=64,
        moe_intermediate_size=64,
        intermediate_size=96,
        attn_res_block_size=2,
        note="expert-cache preset: 64 experts, top-8, 5 layers (KDA 0-2, MLA 3-4), blocks of 2",
    ),
}


# ------------------------------------------------------------------------- config

# The real quantization_config, verbatim (spec 2.2 asserts on it).
_QUANTIZATION_CONFIG: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "scale_dtype": "torch.uint8",
                "strategy": "group",
                "symmetric": True,
                "type": "float",
                "zp_dtype": None,
            },
        }
    },
    "format": "mxfp4-pack-quantized",
    "global_compression_ratio": None,
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

# The real vision_config (unused by the engine; present so the shape matches).
_VISION_CONFIG: dict[str, Any] = {
    "_attn_implementation": "flash_attention_2",
    "activation_func": "gelu_pytorch_tanh",
    "attn_bias": False,
    "init_pos_emb_height": 64,
    "init_pos_emb_time": 4,
    "init_pos_emb_width": 64,
    "linear_bias": False,
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mlp_type": "mlp2",
    "mm_hidden_size": 1024,
    "mm_projector_type": "patchmergerv2",
    "norm_type": "rmsnorm",
    "patch_embed_proj_bias": False,
    "patch_size": 14,
    "pos_emb_interpolation_mode": "bilinear",
    "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05,
    "qkv_hidden_size": 1536,
    "text_hidden_size": 7168,
    "vt_hidden_size": 1024,
    "vt_intermediate_size": 4096,
    "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27,
}

# Generic transformers fields of the real text_config (unused, kept for shape).
_HF_TEXT_FIELDS: dict[str, Any] = {
    "add_cross_attention": False,
    "bad_words_ids": None,
    "begin_suppress_tokens": None,
    "chunk_size_feed_forward": 0,
    "cross_attention_hidden_size": None,
    "decoder_start_token_id": None,
    "diversity_penalty": 0.0,
    "do_sample": False,
    "dtype": "bfloat16",
    "early_stopping": False,
    "encoder_no_repeat_ngram_size": 0,
    "exponential_decay_length_penalty": None,
    "finetuning_task": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "initializer_range": 0.02,
    "is_decoder": False,
    "is_encoder_decoder": False,
    "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "length_penalty": 1.0,
    "max_length": 20,
    "max_position_embeddings": 1048576,
    "min_length": 0,
    "no_repeat_ngram_size": 0,
    "num_beam_groups": 1,
    "num_beams": 1,
    "num_return_sequences": 1,
    "output_attentions": False,
    "output_hidden_states": False,
    "output_scores": False,
    "prefix": None,
    "problem_type": None,
    "pruned_heads": {},
    "remove_invalid_values": False,
    "repetition_penalty": 1.0,
    "return_dict": True,
    "return_dict_in_generate": False,
    "sep_token_id": None,
    "suppress_tokens": None,
    "task_specific_params": None,
    "temperature": 1.0,
    "tf_legacy_loss": False,
    "tie_encoder_decoder": False,
    "tokenizer_class": None,
    "top_k": 50,
    "top_p": 1.0,
    "torchscript": False,
    "transformers_version": "4.56.2",
    "typical_p": 1.0,
    "use_bfloat16": False,
    "use_cache": True,
}


@dataclass(frozen=True)
class SpecialIds:
    bos: int
    eos: int
    pad: int
    media_pad: int | None


def read_special_ids(model_dir: Path) -> SpecialIds:
    """Special ids by name from tokenizer_config.json (eos = <|end_of_msg|>, as the real config)."""
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    by_name = {entry["content"]: int(tid) for tid, entry in cfg["added_tokens_decoder"].items()}
    missing = [n for n in ("[BOS]", "<|end_of_msg|>", "[PAD]") if n not in by_name]
    if missing:
        raise FixtureError(f"tokenizer_config.json lacks special tokens {missing}")
    return SpecialIds(by_name["[BOS]"], by_name["<|end_of_msg|>"], by_name["[PAD]"], by_name.get("<|media_pad|>"))


def build_config(p: Preset, vocab_size: int, ids: SpecialIds) -> dict[str, Any]:
    """config.json in the real nested shape, with the preset's dimensions."""
    text: dict[str, Any] = {
        "_name_or_path": "",
        "activation_situ_beta": p.situ_beta,
        "activation_situ_linear_beta": p.situ_linear_beta,
        "architectures": ["KimiLinearForCausalLM"],
        "attn_res_block_size": p.attn_res_block_size,
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
            "AutoModel": "modeling_kimi_linear.KimiLinearModel",
            "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM",
        },
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
        "first_k_dense_replace": p.first_k_dense_replace,
        "hidden_act": "situ",
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "kv_lora_rank": p.kv_lora_rank,
        "latent_moe_use_norm": p.latent_moe_use_norm,
        "linear_attn_config": {
            "full_attn_layers": list(p.full_attn_layers),
            "gate_lower_bound": p.gate_lower_bound,
            "head_dim": p.kda_head_dim,
            "kda_layers": list(p.kda_layers),
            "num_heads": p.kda_heads,
            "short_conv_kernel_size": p.conv_kernel,
            "use_full_rank_gate": True,
        },
        "mla_use_nope": True,
        "mla_use_output_gate": p.mla_use_output_gate,
        "model_type": "kimi_linear",
        "moe_intermediate_size": p.moe_intermediate_size,
        "moe_layer_freq": 1,
        "moe_renormalize": p.moe_renormalize,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": p.mla_heads,
        "num_expert_group": 1,
        "num_experts": p.num_experts,
        "num_experts_per_token": p.num_experts_per_token,
        "num_hidden_layers": p.num_hidden_layers,
        "num_key_value_heads": p.mla_heads,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": p.num_shared_experts,
        "pad_token_id": ids.pad,
        "q_lora_rank": p.q_lora_rank,
        "qk_nope_head_dim": p.qk_nope_head_dim,
        "qk_rope_head_dim": p.qk_rope_head_dim,
        "quantization_config": json.loads(json.dumps(_QUANTIZATION_CONFIG)),
        "rms_norm_eps": p.rms_norm_eps,
        "routed_expert_hidden_size": p.routed_expert_hidden_size,
        "routed_scaling_factor": p.routed_scaling_factor,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "v_head_dim": p.v_head_dim,
        "vocab_size": vocab_size,
    }
    text["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = p.group_size
    text.update(_HF_TEXT_FIELDS)
    vision = dict(_VISION_CONFIG, text_hidden_size=p.hidden_size)
    root: dict[str, Any] = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        "bos_token_id": ids.bos,
        "dtype": "bfloat16",
        "eos_token_id": ids.eos,
        "ignore_index": -100,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "model_type": "kimi_k3",
        "pad_token_id": ids.pad,
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": False,
        "vision_config": vision,
    }
    if ids.media_pad is not None:
        root["media_placeholder_token_id"] = ids.media_pad
    return dict(sorted(root.items()))


# ------------------------------------------------------------------------ weights

# An init rule draws float64 values of a shape from the generator (spec 9.2).
Init = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]


def normal(std: float) -> Init:
    return lambda rng, shape: rng.standard_normal(shape) * std


def gain() -> Init:
    """RMSNorm gains 1 + N(0, 0.1): a gain of exactly 1 would hide a dropped weight."""
    return lambda rng, shape: 1.0 + rng.standard_normal(shape) * 0.1


def a_log(heads: int) -> Init:
    """A_log: linspace(-0.4, 1.2) over the used heads, the padding exactly 0."""

    def draw(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        out = np.zeros(shape)
        out[:heads] = np.linspace(-0.4, 1.2, heads)
        return out

    return draw


def router_bias() -> Init:
    """e_score_correction_bias linspace(-0.15, 0.15): big enough to reorder the top-k."""
    return lambda rng, shape: np.linspace(-0.15, 0.15, shape[0])


def kv_a(latent_rows: int) -> Init:
    """kv_a_proj_with_mqa: latent rows tiny (mean square ~ eps), rope rows N(0, 0.02)."""

    def draw(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        w = rng.standard_normal(shape)
        w[:latent_rows] *= 0.0002
        w[latent_rows:] *= 0.02
        return w

    return draw


CAP_STD = 1.2  # gate/up init: pushes |g| > beta1 and |v| > beta2
SMALL_STD = 0.02
EPS_STD = 0.0002


@dataclass(frozen=True)
class Entry:
    """One trunk tensor: name suffix after `layers.{L}.`, shape, storage, init."""

    suffix: str
    shape: tuple[int, ...]
    storage: str  # "bf16" or "f32"
    init: Init


def trunk_entries(p: Preset, layer: int) -> list[Entry]:
    """The trunk tensors of one layer in file order (that of the release's shards)."""
    E, P, D = p.hidden_size, p.kda_width, p.kda_head_dim
    out: list[Entry] = []
    if p.is_mla(layer):
        H, qk = p.mla_heads, p.qk_nope_head_dim + p.qk_rope_head_dim
        out += [
            Entry("self_attn.q_a_proj.weight", (p.q_lora_rank, E), "bf16", normal(EPS_STD)),
            Entry("self_attn.q_a_layernorm.weight", (p.q_lora_rank,), "bf16", gain()),
            Entry("self_attn.kv_a_layernorm.weight", (p.kv_lora_rank,), "bf16", gain()),
            Entry("self_attn.o_proj.weight", (E, H * p.v_head_dim), "bf16", normal(SMALL_STD)),
            Entry("self_attn.g_proj.weight", (H * p.v_head_dim, E), "bf16", normal(SMALL_STD)),
        ]
        tail = [
            Entry("self_attn.q_b_proj.weight", (H * qk, p.q_lora_rank), "bf16", normal(SMALL_STD)),
            Entry(
                "self_attn.kv_a_proj_with_mqa.weight",
                (p.kv_lora_rank + p.qk_rope_head_dim, E),
                "bf16",
                kv_a(p.kv_lora_rank),
            ),
            Entry(
                "self_attn.kv_b_proj.weight",
                (H * (p.qk_nope_head_dim + p.v_head_dim), p.kv_lora_rank),
                "bf16",
                normal(SMALL_STD),
            ),
        ]
    else:
        out += [Entry(f"self_attn.{x}_proj.weight", (P, E), "bf16", normal(SMALL_STD)) for x in "qkv"]
        out += [Entry(f"self_attn.{x}_conv1d.weight", (P, 1, p.conv_kernel), "f32", normal(0.4)) for x in "qkv"]
        out += [
            Entry("self_attn.b_proj.weight", (p.kda_heads, E), "bf16", normal(SMALL_STD)),
            Entry("self_attn.o_norm.weight", (D,), "bf16", gain()),
            Entry("self_attn.o_proj.weight", (E, P), "bf16", normal(SMALL_STD)),
            # [D] like the release's [128]: the first H_k entries used, the rest zero.
            Entry("self_attn.A_log", (D,), "f32", a_log(p.kda_heads)),
            Entry("self_attn.f_a_proj.weight", (D, E), "bf16", normal(SMALL_STD)),
            Entry("self_attn.f_b_proj.weight", (P, D), "bf16", normal(SMALL_STD)),
            Entry("self_attn.dt_bias", (P,), "f32", normal(0.5)),
            Entry("self_attn.g_proj.weight", (P, E), "bf16", normal(SMALL_STD)),
        ]
        tail = []
    out += [
        Entry("input_layernorm.weight", (E,), "bf16", gain()),
        Entry("post_attention_layernorm.weight", (E,), "bf16", gain()),
        Entry("self_attention_res_proj.weight", (1, E), "bf16", normal(SMALL_STD)),
        Entry("mlp_res_proj.weight", (1, E), "bf16", normal(SMALL_STD)),
        Entry("self_attention_res_norm.weight", (E,), "bf16", gain()),
        Entry("mlp_res_norm.weight", (E,), "bf16", gain()),
    ]
    if p.is_moe(layer):
        n, lat, sw = p.num_experts, p.routed_expert_hidden_size, p.moe_intermediate_size * p.num_shared_experts
        m = "block_sparse_moe."
        out += [
            Entry(m + "gate.weight", (n, E), "bf16", normal(SMALL_STD)),
            Entry(m + "gate.e_score_correction_bias", (n,), "bf16", router_bias()),
            Entry(m + "shared_experts.gate_proj.weight", (sw, E), "bf16", normal(CAP_STD)),
            Entry(m + "shared_experts.down_proj.weight", (E, sw), "bf16", normal(SMALL_STD)),
            Entry(m + "shared_experts.up_proj.weight", (sw, E), "bf16", normal(CAP_STD)),
            Entry(m + "routed_expert_down_proj.weight", (lat, E), "bf16", normal(SMALL_STD)),
            Entry(m + "routed_expert_up_proj.weight", (E, lat), "bf16", normal(SMALL_STD)),
            Entry(m + "routed_expert_norm.weight", (lat,), "bf16", gain()),
        ]
    else:
        I = p.intermediate_size
        out += [
            Entry("mlp.gate_proj.weight", (I, E), "bf16", normal(CAP_STD)),
            Entry("mlp.down_proj.weight", (E, I), "bf16", normal(SMALL_STD)),
            Entry("mlp.up_proj.weight", (I, E), "bf16", normal(CAP_STD)),
        ]
    return out + tail


def _make(name: str, storage: str, values: np.ndarray) -> Tensor:
    return bf16_tensor(name, values) if storage == "bf16" else f32_tensor(name, values)


@dataclass
class LayerTensors:
    trunk: list[Tensor]
    experts: dict[int, list[Tensor]] = field(default_factory=dict)  # id -> six, in EXPERT_PARTS order


@dataclass
class ModelTensors:
    layers: list[LayerTensors]
    model: list[Tensor]  # embed_tokens, lm_head, norm, output_attn_res_norm, output_attn_res_proj


def make_expert(p: Preset, rng: np.random.Generator, prefix: str) -> list[Tensor]:
    """One routed expert: w1/w3 (gate/up) N(0, 1.2) and w2 (down) N(0, 0.02), MXFP4-quantized."""
    lat, ie = p.routed_expert_hidden_size, p.moe_intermediate_size
    logical = {"w1": (ie, lat), "w2": (lat, ie), "w3": (ie, lat)}
    stds = {"w1": CAP_STD, "w2": SMALL_STD, "w3": CAP_STD}
    parts: dict[str, Tensor] = {}
    for w in ("w1", "w2", "w3"):
        values = rng.standard_normal(logical[w]) * stds[w]
        packed, scales = quantize_checked(f"{prefix}.{w}", values)
        parts[f"{w}.weight_packed"] = u8_tensor(f"{prefix}.{w}.weight_packed", packed)
        parts[f"{w}.weight_scale"] = u8_tensor(f"{prefix}.{w}.weight_scale", scales)
    return [parts[k] for k in EXPERT_PARTS]


def generate_tensors(p: Preset, vocab_size: int, seed: int) -> ModelTensors:
    """Every tensor of the model, drawn from one Generator in a layout-independent order."""
    rng = np.random.default_rng(seed)
    E = p.hidden_size
    model = [
        bf16_tensor(LM + "embed_tokens.weight", normal(SMALL_STD)(rng, (vocab_size, E))),
        bf16_tensor("language_model.lm_head.weight", normal(SMALL_STD)(rng, (vocab_size, E))),
        bf16_tensor(LM + "norm.weight", gain()(rng, (E,))),
        bf16_tensor(LM + "output_attn_res_norm.weight", gain()(rng, (E,))),
        bf16_tensor(LM + "output_attn_res_proj.weight", normal(SMALL_STD)(rng, (1, E))),
    ]
    layers: list[LayerTensors] = []
    for layer in range(p.num_hidden_layers):
        base = f"{LM}layers.{layer}."
        lt = LayerTensors([_make(base + e.suffix, e.storage, e.init(rng, e.shape)) for e in trunk_entries(p, layer)])
        if p.is_moe(layer):
            for eid in range(p.num_experts):
                lt.experts[eid] = make_expert(p, rng, f"{base}block_sparse_moe.experts.{eid}")
        layers.append(lt)
    return ModelTensors(layers, model)


# ------------------------------------------------------------------------- layout


def expert_order(n: int, rng: np.random.Generator) -> list[int]:
    """A shuffled expert order that is never the id order (nor its reverse)."""
    ids = list(range(n))
    if n < 3:
        return ids[::-1]
    while True:
        perm = [int(i) for i in rng.permutation(n)]
        if perm != ids and perm != ids[::-1]:
            return perm


def contiguous_layer(lt: LayerTensors, rng: np.random.Generator) -> list[Tensor]:
    """Release layout: one trunk run and one six-tensor run per expert, experts shuffled.

    The trunk run sits after the first third of the expert runs rather than at the
    start, so a reader cannot get away with assuming it begins the data section.
    """
    if not lt.experts:
        return list(lt.trunk)
    order = expert_order(len(lt.experts), rng)
    cut = (len(order) + 2) // 3
    out: list[Tensor] = []
    for eid in order[:cut]:
        out += lt.experts[eid]
    out += lt.trunk
    for eid in order[cut:]:
        out += lt.experts[eid]
    return out


# Non-canonical orders of an expert's six parts (indices into EXPERT_PARTS).
_SCRAMBLES: tuple[tuple[int, ...], ...] = (
    (1, 0, 3, 2, 5, 4),
    (4, 5, 0, 1, 2, 3),
    (5, 4, 3, 2, 1, 0),
    (2, 0, 4, 1, 5, 3),
)


def scrambled_layer(lt: LayerTensors, rng: np.random.Generator) -> list[Tensor]:
    """The same tensors with every run broken, so a reader must read tensor by tensor.

    - Every expert's six tensors are put in a non-canonical order.
    - The first expert (in shuffled order) stays gap-free but misordered: only the
      order check catches it. Every other expert is split in two halves with other
      tensors between them.
    - Trunk tensors alternate with expert chunks, so the trunk is not one run.
    A dense layer (no experts) has nothing to interleave; its trunk stays one run.
    """
    if not lt.experts:
        return list(lt.trunk)
    order = expert_order(len(lt.experts), rng)
    firsts: list[list[Tensor]] = []
    seconds: list[list[Tensor]] = []
    for k, eid in enumerate(order):
        six = [lt.experts[eid][i] for i in _SCRAMBLES[k % len(_SCRAMBLES)]]
        if k == 0:
            firsts.append(six)
        else:
            firsts.append(six[:3])
            seconds.append(six[3:])
    chunks = firsts + seconds
    out: list[Tensor] = []
    trunk = list(lt.trunk)
    # Alternate one trunk tensor with one expert chunk; leftovers go at the end.
    while trunk or chunks:
        if trunk:
            out.append(trunk.pop(0))
        if chunks:
            out += chunks.pop(0)
    return out


def plan_shards(mt: ModelTensors, seed: int, scrambled: bool) -> list[list[Tensor]]:
    """Shard L+1 holds layer L; the last shard holds the model-level tensors."""
    rng = np.random.default_rng([seed, 0x1A7])  # layout stream, separate from the weights
    place = scrambled_layer if scrambled else contiguous_layer
    shards = [place(lt, rng) for lt in mt.layers]
    shards.append(list(reversed(mt.model)) if scrambled else list(mt.model))
    return shards


# ------------------------------------------------------------------------- oracle


def _margins(rows: np.ndarray) -> np.ndarray:
    """top1 - top2 of each logits row."""
    top2 = np.sort(rows, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.ndarray):
        return _jsonable(v.tolist())
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    return v


@dataclass
class OracleRun:
    prompt_seed: int
    attempts: int
    prompt_ids: np.ndarray
    full_ids: np.ndarray
    logits: np.ndarray  # float64 [T, V], teacher-forced
    margins: np.ndarray  # [GEN_LEN], min of greedy-step and teacher-forced margins
    stats: dict[str, Any]


def _greedy(oracle: Any, prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """20 greedy tokens, each from a fresh full forward on the prefix; None on a thin margin."""
    ids = [int(i) for i in prompt]
    margins = []
    for _ in range(GEN_LEN):
        last = np.asarray(oracle.forward(np.array(ids, dtype=np.int64)))[-1]
        if not np.all(np.isfinite(last)):
            raise FixtureError("oracle produced NaN/Inf logits during greedy decoding")
        margin = float(_margins(last))
        if margin < MIN_MARGIN:
            return None
        margins.append(margin)
        ids.append(int(np.argmax(last)))
    return np.array(ids, dtype=np.int64), np.array(margins)


def run_oracle(model_dir: Path, p: Preset, n_ranks: int) -> OracleRun:
    """Prompt, greedy continuation and teacher-forced logits, with the spec 9.2 self-checks.

    A thin top-1/top-2 margin advances the prompt seed (never the weight seed), up to
    MAX_PROMPT_ATTEMPTS times; every other failed check refuses at once.
    """
    from k3engine.oracle import Oracle

    oracle = Oracle(model_dir)
    for attempt in range(MAX_PROMPT_ATTEMPTS):
        prompt_seed = BASE_PROMPT_SEED + attempt
        prompt = np.random.default_rng(prompt_seed).integers(0, n_ranks, PROMPT_LEN, dtype=np.int64)
        greedy = _greedy(oracle, prompt)
        if greedy is None:
            continue
        full_ids, step_margins = greedy
        logits, stats = oracle.forward_with_stats(full_ids)
        logits = np.asarray(logits, dtype=np.float64)
        tf_margins = _margins(logits[PROMPT_LEN - 1 : -1])
        tf_argmax = np.argmax(logits[PROMPT_LEN - 1 : -1], axis=-1)
        if np.any(tf_margins < MIN_MARGIN) or not np.array_equal(tf_argmax, full_ids[PROMPT_LEN:]):
            continue
        _self_check(stats, logits)
        return OracleRun(
            prompt_seed, attempt + 1, prompt, full_ids, logits, np.minimum(step_margins, tf_margins), _jsonable(stats)
        )
    raise FixtureError(
        f"no prompt seed in {BASE_PROMPT_SEED}..{BASE_PROMPT_SEED + MAX_PROMPT_ATTEMPTS - 1} gives every "
        f"generated position a top-1/top-2 margin >= {MIN_MARGIN}; refusing to write oracle data"
    )


def _self_check(stats: dict[str, Any], logits: np.ndarray) -> None:
    """Spec 9.2: both SiTU caps engaged, the bias changed a selection, everything finite."""
    problems = []
    for key in ("max_abs_gate", "max_abs_up", "bias_changed_selection", "nan_or_inf"):
        if key not in stats:
            problems.append(f"oracle stats lack {key!r}")
    if problems:
        raise FixtureError("; ".join(problems))
    if not float(stats["max_abs_gate"]) > 4.0:
        problems.append(f"no SiTU site has |g| > 4 (max {stats['max_abs_gate']})")
    if not float(stats["max_abs_up"]) > 25.0:
        problems.append(f"no SiTU site has |v| > 25 (max {stats['max_abs_up']})")
    if not stats["bias_changed_selection"]:
        problems.append("the router bias never changed a top-k selection")
    if stats["nan_or_inf"] or not np.all(np.isfinite(logits)):
        problems.append("NaN or Inf in the oracle's activations or logits")
    if problems:
        raise FixtureError("fixture self-check failed: " + "; ".join(problems))


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """An .npz with fixed zip timestamps, so the same arrays give the same bytes.

    np.savez stamps entries with the current time, which breaks byte-identical output.
    """
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, arr in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            body = io.BytesIO()
            np.lib.format.write_array(body, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(info, body.getvalue())
    return buf.getvalue()


def write_oracle_files(out: Path, run: OracleRun, p: Preset, seed: int) -> None:
    arrays = {
        "prompt_ids": run.prompt_ids.astype(np.int64),
        "full_ids": run.full_ids.astype(np.int64),
        "logits": run.logits.astype(np.float32),
    }
    write_private(out / "oracle.npz", _npz_bytes(arrays))
    meta = {
        "preset": p.name,
        "weight_seed": seed,
        "prompt_seed": run.prompt_seed,
        "prompt_attempts": run.attempts,
        "prompt_len": PROMPT_LEN,
        "gen_len": GEN_LEN,
        "T": int(run.full_ids.shape[0]),
        "vocab_size": int(run.logits.shape[1]),
        "min_margin_required": MIN_MARGIN,
        "margins": [float(m) for m in run.margins],
        "min_margin": float(run.margins.min()),
        "max_margin": float(run.margins.max()),
        "max_abs_logit": float(np.abs(run.logits).max()),
        "stats": run.stats,
        "self_checks": {
            "situ_gate_cap_engaged": float(run.stats["max_abs_gate"]) > 4.0,
            "situ_up_cap_engaged": float(run.stats["max_abs_up"]) > 25.0,
            "bias_changed_selection": bool(run.stats["bias_changed_selection"]),
            "margins_ok": bool(run.margins.min() >= MIN_MARGIN),
            "finite": not bool(run.stats["nan_or_inf"]),
        },
    }
    write_private(out / "oracle.json", json.dumps(_jsonable(meta), indent=2, sort_keys=True) + "\n")


# -------------------------------------------------------------------------- entry


def write_fixture(
    preset: str,
    out_dir: Path | str,
    *,
    scrambled: bool = False,
    single_file: bool = False,
    with_oracle: bool = True,
    seed: int = 0,
) -> Path:
    """Write a complete fixture model directory and return its path.

    The directory must not exist or be empty: stale shards from another layout would
    otherwise mix with the new ones. The same arguments give byte-identical files.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; refusing to overwrite")
    # Build in a hidden sibling and rename at the end: a refused or interrupted run
    # never leaves a checkpoint without its oracle data under the real name.
    make_private_dirs(out.parent)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # 0700, kept so
    try:
        _build(PRESETS[preset], work, scrambled=scrambled, single_file=single_file, with_oracle=with_oracle, seed=seed)
        if out.exists():
            out.rmdir()
        work.rename(out)
    finally:
        if work.exists():
            shutil.rmtree(work)
    return out


def _build(p: Preset, out: Path, *, scrambled: bool, single_file: bool, with_oracle: bool, seed: int) -> None:
    """Write every file of the fixture into the (empty) directory `out`."""
    from k3engine.tokenizer_files import write_fixture_tokenizer

    vocab = int(write_fixture_tokenizer(out))
    ids = read_special_ids(out)
    n_ranks = vocab - 256
    write_private(out / "config.json", json.dumps(build_config(p, vocab, ids), indent=2) + "\n")

    mt = generate_tensors(p, vocab, seed)
    shards = plan_shards(mt, seed, scrambled)
    if single_file:
        write_single(out, [t for shard in shards for t in shard], {"format": "pt"})
    else:
        write_sharded(out, shards, {"format": "pt"})

    manifest = {
        "generator_version": GENERATOR_VERSION,
        "preset": p.name,
        "note": p.note,
        "weight_seed": seed,
        "layout_seed": [seed, 0x1A7],
        "scrambled": scrambled,
        "single_file": single_file,
        "vocab_size": vocab,
        "n_ranks": n_ranks,
        "expert_bytes": 3 * p.moe_intermediate_size * p.routed_expert_hidden_size * 17 // 32,
        "oracle": with_oracle,
    }
    write_private(out / "fixture.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")

    if with_oracle:
        write_oracle_files(out, run_oracle(out, p, n_ranks), p, seed)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="k3chat fixture",
        description="Write a small Kimi K3 checkpoint in the released layout (test fixture).",
    )
    ap.add_argument("preset", help=f"one of: {', '.join(sorted(PRESETS))}")
    ap.add_argument("out_dir", help="output directory (must not exist or be empty)")
    ap.add_argument("--scrambled", action="store_true", help="break the trunk and expert runs (reader fallback twin)")
    ap.add_argument("--single-file", action="store_true", help="write one model.safetensors instead of shards")
    ap.add_argument("--no-oracle", action="store_true", help="skip the oracle prompt/logits (oracle.npz, oracle.json)")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    return ap


def main(argv: Sequence[str]) -> int:
    """`k3chat fixture PRESET OUT_DIR [--scrambled] [--single-file] [--no-oracle] [--seed N]`.

    Exit 0 on success, 2 on a usage error, 1 when the generator refuses.
    """
    ap = _parser()
    try:
        args = ap.parse_args(list(argv))
    except SystemExit as exc:  # argparse already printed the usage message
        return 2 if exc.code else 0
    if args.preset not in PRESETS:
        print(f"k3chat fixture: unknown preset {args.preset!r}; choose one of: {', '.join(sorted(PRESETS))}", file=sys.stderr)
        return 2
    if args.seed < 0:
        print("k3chat fixture: --seed must be >= 0", file=sys.stderr)
        return 2
    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"k3chat fixture: {out} exists and is not an empty directory", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        write_fixture(
            args.preset,
            out,
            scrambled=args.scrambled,
            single_file=args.single_file,
            with_oracle=not args.no_oracle,
            seed=args.seed,
        )
    except (FixtureError, WriterError) as exc:
        print(f"k3chat fixture: refused: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"k3chat fixture: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    files = sorted(f for f in out.iterdir() if f.is_file())
    print(f"wrote {args.preset} fixture to {out} in {time.perf_counter() - t0:.1f} s:")
    for f in files:
        print(f"  {f.name:40s} {f.stat().st_size:>12,d} B")
    if not args.no_oracle:
        meta = json.loads((out / "oracle.json").read_text())
        print(f"oracle: T={meta['T']}, prompt seed {meta['prompt_seed']}, min margin {meta['min_margin']:.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
