"""config.json reader: the real config's values, and every refusal of spec 2.2, 2.3 and 9.3."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from k3engine.config import ModelConfig, load_config, parse_config
from k3engine.errors import CheckpointError, ConfigError

from reference import REFERENCE
REAL: dict[str, Any] = json.loads((REFERENCE / "config.json").read_text())

Mutation = Callable[[dict[str, Any]], None]


def mutated(*changes: Mutation) -> dict[str, Any]:
    root = copy.deepcopy(REAL)
    for change in changes:
        change(root)
    return root


def tc(key: str, value: Any) -> Mutation:
    def change(root: dict[str, Any]) -> None:
        root["text_config"][key] = value
    return change


def la(key: str, value: Any) -> Mutation:
    def change(root: dict[str, Any]) -> None:
        root["text_config"]["linear_attn_config"][key] = value
    return change


def qc(key: str, value: Any) -> Mutation:
    def change(root: dict[str, Any]) -> None:
        root["text_config"]["quantization_config"][key] = value
    return change


def weights(key: str, value: Any) -> Mutation:
    def change(root: dict[str, Any]) -> None:
        group = root["text_config"]["quantization_config"]["config_groups"]["group_0"]
        group["weights"][key] = value
    return change


def delete(*path: str) -> Mutation:
    def change(root: dict[str, Any]) -> None:
        node = root
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return change


def refused(root: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(root, "test-config.json")
    return info.value


# ---------------------------------------------------------------------------------------
# The real config
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real() -> ModelConfig:
    return load_config(REFERENCE)


def test_real_config_values(real: ModelConfig) -> None:
    expected = dict(
        hidden=7168, n_layers=93, vocab=163840, rms_eps=1e-5, kda_heads=96, kda_head_dim=128,
        conv_kernel=4, gate_lower_bound=-5.0, mla_heads=96, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128, n_experts=896,
        top_k=16, n_shared_experts=2, latent_dim=3584, expert_width=3072, dense_width=33792,
        first_dense=1, moe_layer_freq=1, moe_renormalize=True, routed_scaling=1.0,
        situ_beta1=4.0, situ_beta2=25.0, attn_res_block=12, bos_token_id=163584,
        eos_token_id=163586, pad_token_id=163839, trunk_dtype="BF16",
    )
    for key, value in expected.items():
        got = getattr(real, key)
        assert got == value and type(got) is type(value), key


def test_real_layer_map(real: ModelConfig) -> None:
    mla = tuple(range(3, 88, 4)) + (91, 92)
    assert real.mla_layers == mla and len(mla) == 24
    assert len(real.kda_layers) == 69 and 0 in real.kda_layers
    assert real.is_kda(0) and real.is_kda(90) and real.is_mla(91) and real.is_mla(92)
    assert not real.is_mla(4) and real.is_mla(3)
    assert real.is_dense(0) and not real.is_moe(0)
    assert real.moe_layers == tuple(range(1, 93))
    with pytest.raises(IndexError):
        real.is_mla(93)


def test_real_derived_quantities(real: ModelConfig) -> None:
    # Spec 2.4.
    assert real.kda_width == 12288
    assert real.mla_qk_dim == 192 and real.mla_q_width == 18432
    assert real.kv_a_dim == 576 and real.kv_b_rows == 24576
    assert real.mla_value_width == 12288 and real.shared_width == 6144
    assert real.expert_bytes == 17_547_264
    assert real.n_block_snapshots == 8 and real.output_sources == 9
    assert [L for L in range(93) if real.is_block_boundary(L)] == list(range(0, 93, 12))
    # Attention side: ceil(L/S_b)+1; MLP side: floor(L/S_b)+2.
    assert [real.attn_sources(L) for L in (1, 12, 13, 92)] == [2, 2, 3, 9]
    assert [real.mlp_sources(L) for L in (0, 11, 12, 92)] == [2, 2, 3, 9]


def test_tiny_fixture_config_parses() -> None:
    # Spec 9.1: the tiny model uses the same nested shape and names.
    root = mutated(
        tc("hidden_size", 128), tc("num_hidden_layers", 13), tc("vocab_size", 1024),
        la("num_heads", 4), la("head_dim", 16),
        la("full_attn_layers", [4, 8, 12, 13]), la("kda_layers", [1, 2, 3, 5, 6, 7, 9, 10, 11]),
        tc("num_attention_heads", 4), tc("num_key_value_heads", 4), tc("q_lora_rank", 64),
        tc("kv_lora_rank", 32), tc("qk_nope_head_dim", 24), tc("qk_rope_head_dim", 8),
        tc("v_head_dim", 16), tc("num_experts", 8), tc("num_experts_per_token", 2),
        tc("routed_expert_hidden_size", 64), tc("moe_intermediate_size", 64),
        tc("intermediate_size", 96), tc("attn_res_block_size", 3),
    )
    root.update(bos_token_id=1000, eos_token_id=1001, pad_token_id=1023)
    cfg = parse_config(root, "tiny")
    assert cfg.mla_layers == (3, 7, 11, 12)
    assert cfg.n_block_snapshots == 5 and cfg.output_sources == 6
    assert cfg.expert_bytes == 6528 and cfg.shared_width == 128
    assert cfg.kv_a_dim == 40 and cfg.kv_b_rows == 160


def test_config_is_frozen(real: ModelConfig) -> None:
    with pytest.raises(AttributeError):
        real.hidden = 1  # type: ignore[misc]


# ---------------------------------------------------------------------------------------
# Missing fields: all named in one error
# ---------------------------------------------------------------------------------------


def test_three_missing_fields_reported_together() -> None:
    err = refused(mutated(delete("text_config", "hidden_size"),
                          delete("text_config", "linear_attn_config", "gate_lower_bound"),
                          delete("pad_token_id")))
    assert len(err.problems) == 3, err.problems
    text = str(err)
    for field in ("text_config.hidden_size", "linear_attn_config.gate_lower_bound",
                  "pad_token_id"):
        assert field in text
    assert "missing" in text and "test-config.json" in text


def test_missing_gate_lower_bound_refused() -> None:
    err = refused(mutated(delete("text_config", "linear_attn_config", "gate_lower_bound")))
    assert err.problems == [
        "text_config.linear_attn_config.gate_lower_bound: missing (required; there is no "
        "default)"]


def test_missing_situ_betas_refused() -> None:
    err = refused(mutated(delete("text_config", "activation_situ_beta"),
                          delete("text_config", "activation_situ_linear_beta")))
    assert len(err.problems) == 2
    assert "activation_situ_beta:" in str(err) and "activation_situ_linear_beta:" in str(err)


@pytest.mark.parametrize("path", [
    ("text_config", "num_experts_per_token"),
    ("text_config", "attn_res_block_size"),
    ("text_config", "tie_word_embeddings"),
    ("tie_word_embeddings",),
    ("text_config", "quantization_config", "ignore"),
    ("text_config", "linear_attn_config", "kda_layers"),
    ("bos_token_id",),
    ("text_config", "dtype"),  # it decides which dtype a trunk tensor may have
])
def test_each_missing_field_refused(path: tuple[str, ...]) -> None:
    err = refused(mutated(delete(*path)))
    assert any(path[-1] in p and "missing" in p for p in err.problems), err.problems


def test_missing_text_config_refused() -> None:
    err = refused(mutated(delete("text_config")))
    assert any("text_config: missing" in p for p in err.problems)


def test_many_problems_in_one_error() -> None:
    err = refused(mutated(tc("hidden_act", "silu"), tc("num_expert_group", 2),
                          weights("group_size", 16), tc("moe_intermediate_size", 48),
                          tc("hidden_size", 7168.0)))
    assert len(err.problems) == 5, err.problems


# ---------------------------------------------------------------------------------------
# Refusals (spec 9.3 and 2.3)
# ---------------------------------------------------------------------------------------

FULL = REAL["text_config"]["linear_attn_config"]["full_attn_layers"]
KDA = REAL["text_config"]["linear_attn_config"]["kda_layers"]

REFUSALS: list[tuple[str, Mutation, str]] = [
    # layer lists (one-based, partition of 1..N)
    ("layer index 0", la("full_attn_layers", [0] + FULL[1:] + [4]), "outside 1..93"),
    ("layer index 999", la("kda_layers", KDA + [999]), "outside 1..93"),
    ("overlapping lists", la("full_attn_layers", FULL + [5]), "overlap"),
    ("incomplete lists", la("full_attn_layers", FULL[:-1]), "miss 1 layer"),
    ("duplicate entry", la("kda_layers", KDA + [1]), "duplicate"),
    ("layer list of floats", la("kda_layers", [float(x) for x in KDA]), "list of integers"),
    # MoE shape
    ("top-k > n_experts", tc("num_experts_per_token", 897), "num_experts_per_token"),
    ("top-k 0", tc("num_experts_per_token", 0), "num_experts_per_token"),
    ("moe_intermediate_size 48", tc("moe_intermediate_size", 48), "multiple of 32"),
    ("latent width 3600", tc("routed_expert_hidden_size", 3600), "multiple of 32"),
    ("first_k_dense_replace > N", tc("first_k_dense_replace", 94), "first_k_dense_replace"),
    ("moe_layer_freq 2", tc("moe_layer_freq", 2), "moe_layer_freq"),
    # asserted variants
    ("mla_use_nope false", tc("mla_use_nope", False), "mla_use_nope"),
    ("mla_use_output_gate false", tc("mla_use_output_gate", False), "mla_use_output_gate"),
    ("hidden_act silu", tc("hidden_act", "silu"), "hidden_act"),
    ("num_expert_group 2", tc("num_expert_group", 2), "num_expert_group"),
    ("topk_group 2", tc("topk_group", 2), "topk_group"),
    ("softmax router", tc("moe_router_activation_func", "softmax"), "moe_router_activation"),
    ("topk_method greedy", tc("topk_method", "greedy"), "topk_method"),
    ("latent_moe_use_norm false", tc("latent_moe_use_norm", False), "latent_moe_use_norm"),
    ("tied embeddings (text)", tc("tie_word_embeddings", True), "tie_word_embeddings"),
    ("tied embeddings (root)", lambda r: r.update(tie_word_embeddings=True),
     "tie_word_embeddings"),
    ("MTP layers", tc("num_nextn_predict_layers", 1), "num_nextn_predict_layers"),
    ("kv heads differ", tc("num_key_value_heads", 8), "num_key_value_heads"),
    ("use_full_rank_gate false", la("use_full_rank_gate", False), "use_full_rank_gate"),
    ("wrong model_type", tc("model_type", "deepseek_v3"), "model_type"),
    # quantization_config
    ("group_size 16", weights("group_size", 16), "group_size"),
    ("num_bits 8", weights("num_bits", 8), "num_bits"),
    ("int weights", weights("type", "int"), "type"),
    ("channel strategy", weights("strategy", "channel"), "strategy"),
    ("asymmetric", weights("symmetric", False), "symmetric"),
    ("fp8 scales", weights("scale_dtype", "torch.float8_e4m3fn"), "scale_dtype"),
    ("quant_method", qc("quant_method", "fp8"), "quant_method"),
    ("format", qc("format", "nvfp4-pack-quantized"), "format"),
    ("input activations quantized", lambda r: r["text_config"]["quantization_config"]
     ["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
     "input_activations"),
    ("ignore lacks lm_head", qc("ignore", [x for x in REAL["text_config"]["quantization_config"]
                                           ["ignore"] if "lm_head" not in x]), "lm_head"),
    ("ignore lacks self_attn", qc("ignore", ["re:.*shared_experts.*", "re:.*lm_head.*",
                                             "re:.*mlp\\.(gate|up|down)_proj.*",
                                             "re:.*vision_tower.*", "re:.*mm_projector.*"]),
     "self_attn"),
    ("ignore covers experts", qc("ignore", ["re:.*"]), "routed experts"),
    ("ignore bad regex", qc("ignore", ["re:(["]), "regex"),
    # JSON types
    ("float for int", tc("hidden_size", 7168.0), "hidden_size: expected an integer"),
    ("bool for int", tc("num_experts", True), "num_experts: expected an integer"),
    ("string for int", tc("vocab_size", "163840"), "vocab_size: expected an integer"),
    ("int for bool", tc("moe_renormalize", 1), "moe_renormalize: expected true or false"),
    ("bool for float", tc("rms_norm_eps", True), "rms_norm_eps: expected a finite number"),
    ("NaN float", tc("routed_scaling_factor", float("nan")), "routed_scaling_factor"),
    ("infinite float", la("gate_lower_bound", float("-inf")), "gate_lower_bound"),
    # values
    ("gate_lower_bound >= 0", la("gate_lower_bound", 5.0), "must be < 0"),
    ("rms eps 0", tc("rms_norm_eps", 0.0), "must be > 0"),
    ("beta negative", tc("activation_situ_beta", -4.0), "must be > 0"),
    ("dimension 0", tc("q_lora_rank", 0), "q_lora_rank: every dimension must be >= 1"),
    ("bos >= V", lambda r: r.update(bos_token_id=163840), "bos_token_id"),
    ("pad negative", lambda r: r.update(pad_token_id=-1), "pad_token_id"),
    ("text_config not an object", lambda r: r.update(text_config=[]), "JSON object"),
    ("unknown weight dtype", tc("dtype", "float8_e4m3fn"),
     "text_config.dtype: must be one of bfloat16, float16, float32"),
    ("weight dtype not a string", tc("dtype", 16), "text_config.dtype: expected a string"),
]


@pytest.mark.parametrize("mutation,needle", [(m, n) for _, m, n in REFUSALS],
                         ids=[name for name, _, _ in REFUSALS])
def test_refusal(mutation: Mutation, needle: str) -> None:
    err = refused(mutated(mutation))
    assert any(needle in p for p in err.problems), err.problems
    assert isinstance(err, CheckpointError)
    assert "test-config.json" in str(err) and "fix" in str(err)


def test_older_torch_dtype_key_gives_the_trunk_dtype() -> None:
    def older(root: dict[str, Any]) -> None:
        root["text_config"]["torch_dtype"] = root["text_config"].pop("dtype")
    assert parse_config(mutated(older)).trunk_dtype == "BF16"
    assert parse_config(mutated(tc("dtype", "float16"))).trunk_dtype == "F16"


def test_integer_literal_accepted_for_float_fields() -> None:
    cfg = parse_config(mutated(tc("routed_scaling_factor", 1), la("gate_lower_bound", -5)))
    assert cfg.routed_scaling == 1.0 and type(cfg.routed_scaling) is float
    assert cfg.gate_lower_bound == -5.0


def test_literal_ignore_entries_must_cover_every_layer() -> None:
    names = [f"language_model.model.layers.{L}.self_attn.{p}" for L in range(92)
             for p in ("q_proj", "k_proj")]  # incomplete on purpose
    ignore = REAL["text_config"]["quantization_config"]["ignore"][1:] + names
    err = refused(mutated(qc("ignore", ignore)))
    assert any("self_attn" in p for p in err.problems)


def test_absent_input_activations_means_null() -> None:
    def drop(root: dict[str, Any]) -> None:
        del root["text_config"]["quantization_config"]["config_groups"]["group_0"][
            "input_activations"]
    assert parse_config(mutated(drop)).hidden == 7168


def test_hand_built_config_with_bad_layer_map_refused(real: ModelConfig) -> None:
    fields = {k: getattr(real, k) for k in real.__dataclass_fields__}
    with pytest.raises(ConfigError):
        ModelConfig(**{**fields, "mla_layers": (3, 3, 7)})
    with pytest.raises(ConfigError):
        ModelConfig(**{**fields, "mla_layers": (93,)})


# ---------------------------------------------------------------------------------------
# The file itself
# ---------------------------------------------------------------------------------------


def write_config(tmp_path: Path, text: str) -> Path:
    (tmp_path / "config.json").write_text(text, encoding="utf-8")
    return tmp_path


def test_load_config_from_file(tmp_path: Path) -> None:
    assert load_config(write_config(tmp_path, json.dumps(REAL))).n_layers == 93


def test_missing_config_json_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert "config.json" in str(info.value) and "not found" in str(info.value)


def test_duplicate_json_key_refused(tmp_path: Path) -> None:
    text = json.dumps(REAL).replace('"hidden_size": 7168',
                                    '"hidden_size": 7168, "hidden_size": 4096')
    assert text.count('"hidden_size"') == 2
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, text))
    assert "duplicate key 'hidden_size'" in str(info.value)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_constants_refused(tmp_path: Path, constant: str) -> None:
    text = json.dumps(REAL).replace('"rms_norm_eps": 1e-05', f'"rms_norm_eps": {constant}')
    assert constant in text
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, text))
    assert constant.lstrip("-") in str(info.value)


def test_overflowing_float_literal_refused(tmp_path: Path) -> None:
    text = json.dumps(REAL).replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e999')
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, text))
    assert "rms_norm_eps" in str(info.value)


@pytest.mark.parametrize("text", ["", "{", "[]", '{"text_config": {}} trailing'])
def test_malformed_config_file_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError):
        load_config(write_config(tmp_path, text))


def test_invalid_utf8_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert "UTF-8" in str(info.value)
