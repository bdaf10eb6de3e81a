"""The released tensor index (497,220 names) against spec 3.1/3.3 and our catalogue.

The patterns below are written out from the spec table independently of
k3engine.catalog, so a catalogue bug cannot hide behind itself.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import re
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from k3engine.catalog import (EXPERT_PARTS, TensorSpec, bind, classify, expected_tensors,
                              expert_run, model_specs, plan_runs, trunk_run, trunk_specs)
from k3engine.config import ModelConfig, load_config
from k3engine.errors import TensorSetError
from k3engine.safetensors_io import (DTYPE_SIZES, INDEX_NAME, open_checkpoint,
                                     strict_json_loads)

from reference import REFERENCE
N_LAYERS = 93
MLA = set(range(3, 88, 4)) | {91, 92}


@pytest.fixture(scope="module")
def index_bytes() -> bytes:
    return gzip.decompress((REFERENCE / "model.safetensors.index.json.gz").read_bytes())


@pytest.fixture(scope="module")
def index(index_bytes: bytes) -> dict[str, Any]:
    return strict_json_loads(index_bytes.decode("utf-8"))  # also: no duplicate names


@pytest.fixture(scope="module")
def weight_map(index: dict[str, Any]) -> dict[str, str]:
    return index["weight_map"]


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return load_config(REFERENCE)


@pytest.fixture(scope="module")
def expected(cfg: ModelConfig) -> dict[str, TensorSpec]:
    return expected_tensors(cfg)


def shard(number: int) -> str:
    return f"model-{number:05d}-of-000096.safetensors"


def test_index_size(index: dict[str, Any], weight_map: dict[str, str]) -> None:
    assert len(weight_map) == 497_220
    assert index["metadata"]["total_size"] == 1_560_860_324_864
    assert len(set(weight_map.values())) == 96


def test_layer_and_model_tensors_in_their_shards(weight_map: dict[str, str]) -> None:
    layer_re = re.compile(r"language_model\.model\.layers\.(\d+)\.")
    for name, file in weight_map.items():
        m = layer_re.match(name)
        if m:
            assert file == shard(int(m.group(1)) + 1), name
        elif name.startswith("language_model."):
            assert file == shard(94), name
        elif name.startswith("mm_projector."):
            assert file == shard(95), name
        else:
            assert name.startswith("vision_tower.") and file == shard(96), name


# Spec 3.3, written out by hand. Layer kinds: K = KDA, M = MLA, D = dense, E = MoE.
_COMMON = [r"input_layernorm\.weight", r"post_attention_layernorm\.weight",
           r"self_attention_res_norm\.weight", r"mlp_res_norm\.weight",
           r"self_attention_res_proj\.weight", r"mlp_res_proj\.weight"]
_KDA = [r"self_attn\.[qkvg]_proj\.weight", r"self_attn\.o_proj\.weight",
        r"self_attn\.[qkv]_conv1d\.weight", r"self_attn\.f_[ab]_proj\.weight",
        r"self_attn\.b_proj\.weight", r"self_attn\.A_log", r"self_attn\.dt_bias",
        r"self_attn\.o_norm\.weight"]
_MLA = [r"self_attn\.q_a_proj\.weight", r"self_attn\.q_a_layernorm\.weight",
        r"self_attn\.q_b_proj\.weight", r"self_attn\.kv_a_proj_with_mqa\.weight",
        r"self_attn\.kv_a_layernorm\.weight", r"self_attn\.kv_b_proj\.weight",
        r"self_attn\.g_proj\.weight", r"self_attn\.o_proj\.weight"]
_DENSE = [r"mlp\.(gate|up|down)_proj\.weight"]
_MOE = [r"block_sparse_moe\.gate\.weight", r"block_sparse_moe\.gate\.e_score_correction_bias",
        r"block_sparse_moe\.routed_expert_(down|up)_proj\.weight",
        r"block_sparse_moe\.routed_expert_norm\.weight",
        r"block_sparse_moe\.shared_experts\.(gate|up|down)_proj\.weight"]
_EXPERT = re.compile(r"language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\."
                     r"(\d+)\.w[123]\.weight_(packed|scale)")
_MODEL = re.compile(r"language_model\.(model\.(embed_tokens|norm|output_attn_res_norm|"
                    r"output_attn_res_proj)\.weight|lm_head\.weight)")
_VISION = re.compile(r"(vision_tower|mm_projector)\..+")


def _layer_re(*groups: list[str]) -> re.Pattern[str]:
    alternatives = "|".join(p for group in groups for p in group)
    return re.compile(rf"language_model\.model\.layers\.(\d+)\.(?:{alternatives})")


def test_every_name_matches_a_spec_pattern_with_spec_counts(weight_map: dict[str, str]) -> None:
    patterns = {"K": _layer_re(_KDA), "M": _layer_re(_MLA), "D": _layer_re(_DENSE),
                "E": _layer_re(_MOE), "C": _layer_re(_COMMON)}
    per_layer: Counter[int] = Counter()
    counts: Counter[str] = Counter()
    experts: Counter[tuple[int, int]] = Counter()
    for name in weight_map:
        if m := _EXPERT.fullmatch(name):
            layer, expert = int(m.group(1)), int(m.group(2))
            assert 1 <= layer < N_LAYERS and expert < 896, name
            experts[layer, expert] += 1
            counts["expert"] += 1
        elif _MODEL.fullmatch(name):
            counts["model"] += 1
        elif _VISION.fullmatch(name):
            counts["vision"] += 1
        else:
            kinds = [k for k, p in patterns.items() if p.fullmatch(name)]
            assert kinds, f"no spec pattern for {name}"
            layer = int(name.split(".")[3])
            allowed = {"C", "M" if layer in MLA else "K", "D" if layer == 0 else "E"}
            assert set(kinds) & allowed, (name, kinds)  # g_proj/o_proj are in K and M
            per_layer[layer] += 1
            counts["other"] += 1
    assert counts == {"expert": 494_592, "other": 2_455, "model": 5, "vision": 168}
    assert set(experts.values()) == {6} and len(experts) == 92 * 896
    assert per_layer[0] == 23
    assert {per_layer[L] for L in range(1, N_LAYERS) if L not in MLA} == {28}
    assert {per_layer[L] for L in MLA} == {22}
    assert counts["other"] + counts["model"] == 2_460


def test_classify_counts(weight_map: dict[str, str]) -> None:
    counts = Counter(map(classify, weight_map))
    assert counts == {"expert": 494_592, "trunk": 2_455, "model": 5, "vision": 168}


def test_catalogue_equals_index(weight_map: dict[str, str],
                                expected: dict[str, TensorSpec]) -> None:
    language = {n for n in weight_map if n.startswith("language_model.")}
    assert len(expected) == len(language) == 497_052
    assert language == expected.keys()
    kinds = Counter(spec.kind for spec in expected.values())
    assert kinds == {"expert": 494_592, "trunk": 2_455, "model": 5}


# Spec 3.3 table with the real shapes, written out by hand (suffix after layers.{L}.).
_SPEC_SHAPES: dict[str, tuple[int, ...]] = {
    "input_layernorm.weight": (7168,), "post_attention_layernorm.weight": (7168,),
    "self_attention_res_norm.weight": (7168,), "mlp_res_norm.weight": (7168,),
    "self_attention_res_proj.weight": (1, 7168), "mlp_res_proj.weight": (1, 7168),
    "self_attn.q_proj.weight": (12288, 7168), "self_attn.k_proj.weight": (12288, 7168),
    "self_attn.v_proj.weight": (12288, 7168), "self_attn.g_proj.weight": (12288, 7168),
    "self_attn.o_proj.weight": (7168, 12288),
    "self_attn.q_conv1d.weight": (12288, 1, 4), "self_attn.k_conv1d.weight": (12288, 1, 4),
    "self_attn.v_conv1d.weight": (12288, 1, 4),
    "self_attn.f_a_proj.weight": (128, 7168), "self_attn.f_b_proj.weight": (12288, 128),
    "self_attn.b_proj.weight": (96, 7168), "self_attn.A_log": (96,),  # at least 96
    "self_attn.dt_bias": (12288,), "self_attn.o_norm.weight": (128,),
    "self_attn.q_a_proj.weight": (1536, 7168), "self_attn.q_a_layernorm.weight": (1536,),
    "self_attn.q_b_proj.weight": (18432, 1536),
    "self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
    "self_attn.kv_a_layernorm.weight": (512,), "self_attn.kv_b_proj.weight": (24576, 512),
    "mlp.gate_proj.weight": (33792, 7168), "mlp.up_proj.weight": (33792, 7168),
    "mlp.down_proj.weight": (7168, 33792),
    "block_sparse_moe.gate.weight": (896, 7168),
    "block_sparse_moe.gate.e_score_correction_bias": (896,),
    "block_sparse_moe.routed_expert_down_proj.weight": (3584, 7168),
    "block_sparse_moe.routed_expert_up_proj.weight": (7168, 3584),
    "block_sparse_moe.routed_expert_norm.weight": (3584,),
    "block_sparse_moe.shared_experts.gate_proj.weight": (6144, 7168),
    "block_sparse_moe.shared_experts.up_proj.weight": (6144, 7168),
    "block_sparse_moe.shared_experts.down_proj.weight": (7168, 6144),
    "w1.weight_packed": (3072, 1792), "w1.weight_scale": (3072, 112),
    "w3.weight_packed": (3072, 1792), "w3.weight_scale": (3072, 112),
    "w2.weight_packed": (3584, 1536), "w2.weight_scale": (3584, 96),
}
_MODEL_SHAPES = {
    "language_model.model.embed_tokens.weight": (163840, 7168),
    "language_model.lm_head.weight": (163840, 7168),
    "language_model.model.norm.weight": (7168,),
    "language_model.model.output_attn_res_norm.weight": (7168,),
    "language_model.model.output_attn_res_proj.weight": (1, 7168),
}


def test_catalogue_shapes_match_spec_table(expected: dict[str, TensorSpec]) -> None:
    expert_re = re.compile(r".*\.experts\.\d+\.(w[123]\.weight_\w+)")
    for name, spec in expected.items():
        if name in _MODEL_SHAPES:
            assert spec.shape == _MODEL_SHAPES[name] and spec.kind == "model", name
            continue
        m = expert_re.fullmatch(name)
        suffix = m.group(1) if m else name.split(".", 4)[4]
        assert spec.shape == _SPEC_SHAPES[suffix], name
        assert spec.kind == ("expert" if m else "trunk"), name
        assert spec.dtypes == {_stored_dtype(name, spec)}, name  # the release's, only
        assert spec.min_len == suffix.endswith("A_log"), name


def _stored_dtype(name: str, spec: TensorSpec) -> str:
    """As released: conv weights, dt_bias and A_log in F32, other non-experts BF16."""
    if spec.kind == "expert":
        return "U8"
    return "F32" if name.endswith(("conv1d.weight", "dt_bias", "A_log")) else "BF16"


def _stored_shape(name: str, spec: TensorSpec) -> tuple[int, ...]:
    return (128,) if name.endswith("A_log") else spec.shape  # A_log ships zero-padded to 128


def _stored_bytes(name: str, spec: TensorSpec) -> int:
    return DTYPE_SIZES[_stored_dtype(name, spec)] * math.prod(_stored_shape(name, spec))


def test_catalogue_shapes_reproduce_released_sizes(cfg: ModelConfig, index: dict[str, Any],
                                                   expected: dict[str, TensorSpec]) -> None:
    # Spec 7 sizes, and the index's total_size once the 894,900,480 vision bytes are added:
    # every shape in the catalogue is pinned by the real byte counts.
    trunk = [sum(_stored_bytes(n, s) for n, s in trunk_specs(cfg, L).items())
             for L in range(N_LAYERS)]
    assert trunk[0] == 2_341_212_928
    assert {trunk[L] for L in range(1, N_LAYERS) if L not in MLA} == {1_267_742_208}
    assert {trunk[L] for L in MLA} == {844_333_824}
    assert sum(trunk) == 108_811_694_848
    model = {n: _stored_bytes(n, s) for n, s in model_specs(cfg).items()}
    assert model["language_model.lm_head.weight"] * 2 == 4_697_620_480
    experts = sum(_stored_bytes(n, s) for n, s in expected.items() if s.kind == "expert")
    assert experts == 1_446_456_066_048 == 82_432 * cfg.expert_bytes
    total = sum(trunk) + sum(model.values()) + experts + 894_900_480
    assert total == index["metadata"]["total_size"]


# ---------------------------------------------------------------------------------------
# Opening a real-size checkpoint: sparse files with real names, shapes and layout
# ---------------------------------------------------------------------------------------


def _write_sparse_shards(directory: Path, weight_map: dict[str, str],
                         expected: dict[str, TensorSpec], shards: set[str]) -> None:
    """Headers as in the release (trunk first, expert runs shuffled); data left sparse."""
    by_shard: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if file in shards:
            by_shard.setdefault(file, []).append(name)
    rng = random.Random(1)
    for file, names in by_shard.items():
        trunk = sorted(n for n in names if expected[n].kind != "expert")
        experts = sorted({n.rsplit(".", 2)[0] for n in names if expected[n].kind == "expert"})
        rng.shuffle(experts)
        header: dict[str, Any] = {}
        pos = 0
        for name in trunk + [f"{e}.{p}" for e in experts for p in EXPERT_PARTS]:
            spec = expected[name]
            size = _stored_bytes(name, spec)
            header[name] = {"dtype": _stored_dtype(name, spec),
                            "shape": list(_stored_shape(name, spec)),
                            "data_offsets": [pos, pos + size]}
            pos += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(directory / file, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + pos)  # sparse: no disk space used


def test_open_real_index_with_some_shards(tmp_path: Path, index_bytes: bytes, cfg: ModelConfig,
                                          weight_map: dict[str, str],
                                          expected: dict[str, TensorSpec]) -> None:
    present = {shard(1), shard(2), shard(4), shard(94)}  # dense, KDA+MoE, MLA+MoE, model
    _write_sparse_shards(tmp_path, weight_map, expected, present)
    (tmp_path / INDEX_NAME).write_bytes(index_bytes)
    (tmp_path / "config.json").write_text((REFERENCE / "config.json").read_text())
    t0 = time.perf_counter()
    ckpt = open_checkpoint(tmp_path)
    elapsed = time.perf_counter() - t0
    assert elapsed < 20, f"opening took {elapsed:.1f} s: something is not linear"
    assert ckpt.shards == sorted(present) and len(ckpt.missing_shards) == 92
    assert len(ckpt.tensors) == 23 + (28 + 5376) + (22 + 5376) + 5
    assert os.path.getsize(tmp_path / shard(2)) > 16_900_000_000  # real size, sparse
    run = expert_run(ckpt, 1, 0)
    assert run is not None and run.hi - run.lo == 17_547_264
    for layer in (0, 1, 3):
        assert trunk_run(ckpt, cfg, layer) is not None
    with pytest.raises(TensorSetError) as info:
        bind(cfg, ckpt)
    err = info.value
    assert len(err.missing) == 497_052 - len(ckpt.tensors)
    assert not err.extra and not err.misshapen
    assert f"the index assigns to {shard(3)}, which is not in" in str(err)
    assert len(str(err)) < 100_000  # summarised, not half a million lines


def test_open_full_real_size_checkpoint(tmp_path: Path, index_bytes: bytes, cfg: ModelConfig,
                                        weight_map: dict[str, str],
                                        expected: dict[str, TensorSpec]) -> None:
    _write_sparse_shards(tmp_path, weight_map, expected, {shard(i) for i in range(1, 95)})
    (tmp_path / INDEX_NAME).write_bytes(index_bytes)
    t0 = time.perf_counter()
    ckpt = open_checkpoint(tmp_path)
    bind(cfg, ckpt)
    plan = plan_runs(cfg, ckpt)
    elapsed = time.perf_counter() - t0
    assert len(ckpt.tensors) == 497_052 and ckpt.missing_shards == [shard(95), shard(96)]
    assert plan.trunk_fallbacks == 0 and plan.expert_fallbacks == 0
    print(f"real-size checkpoint: open + bind + run plan took {elapsed:.1f} s")
