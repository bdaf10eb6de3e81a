"""Checkpoint writer and fixture layout (spec k3-model.md sections 2, 3, 9.1, 9.2)."""

from __future__ import annotations

import json
import math
import re
import struct
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from k3engine import fixture as fx
from k3engine import writer as wr

LM = "language_model.model."


# ---------------------------------------------------------------- BF16 rounding


def ref_bf16_bits(x: float) -> int:
    """Independent BF16 rounding: exact rational arithmetic, Python's half-even round()."""
    if math.isnan(x):
        return -1  # checked separately
    if math.isinf(x):
        return 0x7F80 | (0x8000 if x < 0 else 0)
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    a = Fraction(abs(x))
    if a == 0:
        return sign
    exp = math.frexp(abs(x))[1] - 1  # a in [2^exp, 2^(exp+1))
    ulp = Fraction(2) ** (max(exp, -126) - 7)  # 8 significant bits; subnormals below 2^-126
    q = round(a / ulp)  # Fraction.__round__ is half-to-even
    value = q * ulp
    if value >= Fraction(2) ** 128:
        return sign | 0x7F80
    bits = struct.unpack(">I", struct.pack(">f", float(value)))[0]
    assert bits & 0xFFFF == 0, "a BF16 value is exact in float32"
    return sign | (bits >> 16)


def test_bf16_ties_round_to_even() -> None:
    ulp = 2.0**-7  # BF16 spacing in [1, 2)
    cases = {
        1.0 + ulp / 2: 0x3F80,  # tie between 1.0 (even) and 1+ulp (odd): down
        1.0 + 3 * ulp / 2: 0x3F82,  # tie between odd and even: up
        -(1.0 + ulp / 2): 0xBF80,
        1.0 + ulp / 2 + 2.0**-30: 0x3F81,  # just above the tie: up. float64 -> f32 -> bf16 would say 0x3F80
        1.0 + ulp / 2 - 2.0**-30: 0x3F80,
        (2 - 2.0**-7) * 2.0**127: 0x7F7F,  # bf16 max
        3.4e38: 0x7F80,  # past bf16 max + half ulp: overflow to inf
        -0.0: 0x8000,
        2.0**-134: 0x0000,  # exactly half the smallest subnormal 2^-133: tie to even (zero)
        3 * 2.0**-135: 0x0001,  # above half: the smallest subnormal
        3 * 2.0**-134: 0x0002,  # tie between subnormals 1 and 2: even
    }
    got = wr.bf16_bits(np.array(list(cases), dtype=np.float64))
    for (x, want), g in zip(cases.items(), got):
        assert ref_bf16_bits(x) == want, x
        assert int(g) == want, (x, hex(int(g)), hex(want))


def test_bf16_matches_reference_on_random_values() -> None:
    rng = np.random.default_rng(7)
    mant = rng.random(4000) + 1.0
    exps = rng.integers(-140, 128, 4000)
    x64 = np.ldexp(mant, exps) * rng.choice([-1.0, 1.0], 4000)
    # Exact ties and near-ties in float32 too, where the input is already float32.
    x32 = (np.arange(1 << 12, dtype=np.uint32) << 15 | 0x3F000000).view(np.float32)
    for arr in (x64, x32, x64.astype(np.float32)):
        got = wr.bf16_bits(arr)
        want = [ref_bf16_bits(float(v)) for v in arr]
        assert [int(g) for g in got] == want


def test_bf16_specials() -> None:
    x = np.array([np.inf, -np.inf, np.nan, -np.nan], dtype=np.float64)
    bits = wr.bf16_bits(x)
    assert bits[0] == 0x7F80 and bits[1] == 0xFF80
    back = wr.bf16_to_f32(bits)
    assert np.isnan(back[2]) and np.isnan(back[3])
    assert (bits[2] & 0x8000) == 0 and (bits[3] & 0x8000) == 0x8000
    # A float32 NaN whose payload sits only in the low 16 bits must not become inf.
    low_nan = np.array([0x7F800001], dtype=np.uint32).view(np.float32)
    assert np.isnan(wr.bf16_to_f32(wr.bf16_bits(low_nan)))[0]


# ------------------------------------------------------------- safetensors files


def raw_tensor(path: Path, name: str) -> tuple[dict, bytes]:
    """Header entry and raw bytes of one tensor, located by its data_offsets."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    entry = json.loads(data[8 : 8 + n])[name]
    b, e = entry["data_offsets"]
    return entry, data[8 + n + b : 8 + n + e]


def test_write_and_read_back(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    u8 = rng.integers(0, 256, (5, 6), dtype=np.uint8)
    f32 = rng.standard_normal((3, 1, 4)).astype(np.float32)
    bfv = rng.standard_normal((7, 3))
    tensors = [wr.f32_tensor("z.f32", f32), wr.bf16_tensor("a.bf16", bfv), wr.u8_tensor("m.u8", u8)]
    path = tmp_path / "x.safetensors"
    size = wr.write_safetensors(path, tensors, {"format": "pt"})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert size == len(raw) and n % 8 == 0
    assert raw[8 + n - 1 : 8 + n] in (b"}", b" ")
    header = json.loads(raw[8 : 8 + n])
    # Data order is the given order (not the sorted key order).
    assert [header[t.name]["data_offsets"][0] for t in tensors] == [0, 48, 48 + 42]
    assert len(raw) == 8 + n + 48 + 42 + 30
    with safe_open(str(path), "numpy") as f:
        assert set(f.keys()) == {"z.f32", "a.bf16", "m.u8"}
        assert f.metadata() == {"format": "pt"}
        np.testing.assert_array_equal(f.get_tensor("m.u8"), u8)
        np.testing.assert_array_equal(f.get_tensor("z.f32"), f32)
    entry, body = raw_tensor(path, "a.bf16")
    assert entry["dtype"] == "BF16" and entry["shape"] == [7, 3]
    assert body == struct.pack("<21H", *[ref_bf16_bits(float(v)) for v in bfv.ravel()])


def test_tensor_and_header_refusals(tmp_path: Path) -> None:
    with pytest.raises(wr.WriterError):
        wr.Tensor("x", "F64", (1,), b"\0" * 8)
    with pytest.raises(wr.WriterError):
        wr.Tensor("x", "F32", (2,), b"\0" * 4)
    t = wr.f32_tensor("x", np.zeros(2))
    with pytest.raises(wr.WriterError):
        wr.write_sharded(tmp_path, [[t], [t]])


def expert_tensors(prefix: str, packed: np.ndarray, scales: np.ndarray) -> list[wr.Tensor]:
    out = []
    for w in ("w1", "w2", "w3"):
        out += [wr.u8_tensor(f"{prefix}.{w}.weight_packed", packed), wr.u8_tensor(f"{prefix}.{w}.weight_scale", scales)]
    return out


def test_writer_refuses_bad_experts(tmp_path: Path) -> None:
    prefix = LM + "layers.1.block_sparse_moe.experts.0"
    good_p, good_s = wr.quantize_checked("ok", np.random.default_rng(0).standard_normal((64, 64)))
    wr.write_sharded(tmp_path / "ok", [expert_tensors(prefix, good_p, good_s)])  # control: accepted
    zero_p = np.zeros((64, 32), np.uint8)
    with pytest.raises(wr.WriterError, match="all zeros"):
        wr.write_sharded(tmp_path / "zero", [expert_tensors(prefix, zero_p, good_s)])
    bad_s = good_s.copy()
    bad_s[3, 1] = 255
    with pytest.raises(wr.WriterError, match="255"):
        wr.write_single(tmp_path / "nan", expert_tensors(prefix, good_p, bad_s))
    with pytest.raises(wr.WriterError, match="missing"):
        wr.write_sharded(tmp_path / "part", [expert_tensors(prefix, good_p, good_s)[:5]])
    with pytest.raises(wr.WriterError, match="all zeros"):
        wr.quantize_checked("zero", np.zeros((4, 32)))
    # A group with amax > 0 that underflows to zero codes (scale clamped at 1).
    tiny = np.zeros((1, 64))
    tiny[0, 0], tiny[0, 40] = 1.0, 1e-45
    with pytest.raises(wr.WriterError, match="amax"):
        wr.quantize_checked("underflow", tiny)
    assert not any((tmp_path / d).exists() and any((tmp_path / d).iterdir()) for d in ("zero", "nan", "part"))


# --------------------------------------------------------------- fixture layout


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("writer")
    return {
        "plain": fx.write_fixture("tiny", base / "plain", with_oracle=False),
        "scrambled": fx.write_fixture("tiny", base / "scrambled", scrambled=True, with_oracle=False),
        "single": fx.write_fixture("tiny", base / "single", single_file=True, with_oracle=False),
    }


def load_index(d: Path) -> dict:
    return json.loads((d / wr.INDEX_NAME).read_text())


def headers(d: Path) -> dict[str, tuple[str, dict]]:
    """name -> (file, header entry) over every safetensors file in d."""
    out: dict[str, tuple[str, dict]] = {}
    for f in sorted(d.glob("*.safetensors")):
        for name, entry in wr.read_header(f).items():
            assert name not in out
            out[name] = (f.name, entry)
    return out


def layer_of(name: str) -> int | None:
    m = re.match(r"language_model\.model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def expert_of(name: str) -> tuple[int, str] | None:
    m = re.search(r"\.experts\.(\d+)\.(w[123]\.weight_(?:packed|scale))$", name)
    return (int(m.group(1)), m.group(2)) if m else None


def layer_runs(h: dict[str, tuple[str, dict]], layer: int) -> tuple[list[tuple[str, dict]], dict[int, list[tuple[str, dict]]]]:
    """Trunk entries and expert entries (by id) of one layer, each sorted by offset."""
    trunk, experts = [], {}
    for name, (_, entry) in h.items():
        if layer_of(name) != layer:
            continue
        ex = expert_of(name)
        if ex:
            experts.setdefault(ex[0], []).append((ex[1], entry))
        else:
            trunk.append((name, entry))
    key = lambda it: it[1]["data_offsets"][0]
    return sorted(trunk, key=key), {e: sorted(v, key=key) for e, v in experts.items()}


def is_run(entries: list[tuple[str, dict]]) -> bool:
    return wr.is_tiled_run([tuple(e["data_offsets"]) for _, e in entries])


def test_shard_files_and_index(tiny_dirs: dict[str, Path]) -> None:
    d = tiny_dirs["plain"]
    idx = load_index(d)
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-000014.safetensors" for i in range(1, 15)]
    assert set(idx["weight_map"].values()) == set(files)
    tensor_bytes = 0
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "numpy") as st:  # the reference library validates tiling
            keys = set(st.keys())
        assert keys == {n for n, s in idx["weight_map"].items() if s == f.name}
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        assert n % 8 == 0
        tensor_bytes += len(raw) - 8 - n
    assert idx["metadata"]["total_size"] == tensor_bytes
    for name, shard in idx["weight_map"].items():
        layer = layer_of(name)
        want = layer + 1 if layer is not None else 14
        assert shard == f"model-{want:05d}-of-000014.safetensors", name
    counts = {"expert": 0, "other": 0}
    for name in idx["weight_map"]:
        counts["expert" if expert_of(name) else "other"] += 1
    assert counts == {"expert": 12 * 8 * 6, "other": 23 + 8 * 28 + 4 * 22 + 5}


def test_contiguous_runs_and_shuffled_experts(tiny_dirs: dict[str, Path]) -> None:
    h = headers(tiny_dirs["plain"])
    for layer in range(13):
        trunk, experts = layer_runs(h, layer)
        assert is_run(trunk), layer
        files = {h[n][0] for n, _ in trunk}
        assert files == {f"model-{layer + 1:05d}-of-000014.safetensors"}
        if layer == 0:
            assert not experts
            continue
        assert sorted(experts) == list(range(8))
        starts = {}
        for eid, parts in experts.items():
            assert [p for p, _ in parts] == list(wr.EXPERT_PARTS), (layer, eid)
            assert is_run(parts)
            lo, hi = parts[0][1]["data_offsets"][0], parts[-1][1]["data_offsets"][1]
            assert hi - lo == 6528
            starts[eid] = lo
            t_lo, t_hi = trunk[0][1]["data_offsets"][0], trunk[-1][1]["data_offsets"][1]
            assert hi <= t_lo or lo >= t_hi  # no expert bytes inside the trunk run
        by_offset = sorted(starts, key=starts.get)
        assert by_offset != sorted(by_offset), f"layer {layer}: experts stored in id order"


def test_scrambled_twin_breaks_runs_same_bytes(tiny_dirs: dict[str, Path]) -> None:
    plain, scr = tiny_dirs["plain"], tiny_dirs["scrambled"]
    assert load_index(plain) == load_index(scr)
    hp, hs = headers(plain), headers(scr)
    assert hp.keys() == hs.keys()
    for layer in range(1, 13):
        trunk, experts = layer_runs(hs, layer)
        assert not is_run(trunk), layer
        for eid, parts in experts.items():
            in_order = [p for p, _ in parts] == list(wr.EXPERT_PARTS)
            assert not (in_order and is_run(parts)), (layer, eid)
        # At least one expert is gap-free but misordered, the rest are split.
        assert any(is_run(parts) for parts in experts.values())
        assert any(not is_run(parts) for parts in experts.values())
    for name in hp:
        (ep, bp), (es, bs) = raw_tensor(plain / hp[name][0], name), raw_tensor(scr / hs[name][0], name)
        assert (ep["dtype"], ep["shape"], bp) == (es["dtype"], es["shape"], bs), name


def test_single_file_variant(tiny_dirs: dict[str, Path]) -> None:
    d, plain = tiny_dirs["single"], tiny_dirs["plain"]
    assert sorted(p.name for p in d.glob("*.safetensors")) == ["model.safetensors"]
    assert not (d / wr.INDEX_NAME).exists()
    with safe_open(str(d / "model.safetensors"), "numpy") as st:
        names = set(st.keys())
    hp = headers(plain)
    assert names == set(hp)
    for name in list(hp)[::5]:
        assert raw_tensor(d / "model.safetensors", name)[1] == raw_tensor(plain / hp[name][0], name)[1]


def test_tiny_config_matches_spec_9_1(tiny_dirs: dict[str, Path]) -> None:
    d = tiny_dirs["plain"]
    cfg = json.loads((d / "config.json").read_text())
    tok = json.loads((d / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    by_name = {v["content"]: int(k) for k, v in tok.items()}
    n_ranks = len((d / "tiktoken.model").read_text().splitlines())
    assert cfg["model_type"] == "kimi_k3" and cfg["tie_word_embeddings"] is False and "vision_config" in cfg
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (
        by_name["[BOS]"], by_name["<|end_of_msg|>"], by_name["[PAD]"])
    t = cfg["text_config"]
    assert (t["bos_token_id"], t["eos_token_id"], t["pad_token_id"]) == (
        cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"])
    la = t["linear_attn_config"]
    want = {
        "model_type": "kimi_linear", "hidden_size": 128, "num_hidden_layers": 13, "vocab_size": n_ranks + 256,
        "rms_norm_eps": 1e-5, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64,
        "kv_lora_rank": 32, "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": 8, "num_experts_per_token": 2,
        "num_shared_experts": 2, "routed_expert_hidden_size": 64, "moe_intermediate_size": 64,
        "intermediate_size": 96, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "num_expert_group": 1,
        "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 1.0, "latent_moe_use_norm": True,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": 3, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
    }
    assert {k: t[k] for k in want} == want
    assert all(type(t[k]) is type(v) for k, v in want.items())  # ints stay ints, floats floats
    assert la == {"full_attn_layers": [4, 8, 12, 13], "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11],
                  "gate_lower_bound": -5.0, "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                  "use_full_rank_gate": True}
    from reference import REFERENCE

    r = json.loads((REFERENCE / "config.json").read_text())
    assert t["quantization_config"] == r["text_config"]["quantization_config"]
    assert set(t) == set(r["text_config"]) and set(cfg) == set(r) and set(cfg["vision_config"]) == set(r["vision_config"])


def test_tiny_tensor_dtypes_shapes_and_init(tiny_dirs: dict[str, Path]) -> None:
    d = tiny_dirs["plain"]
    h = headers(d)
    dt = lambda n: h[LM + n][1]["dtype"]
    sh = lambda n: h[LM + n][1]["shape"]
    assert dt("layers.1.self_attn.q_conv1d.weight") == "F32" and sh("layers.1.self_attn.q_conv1d.weight") == [64, 1, 4]
    assert dt("layers.1.self_attn.dt_bias") == "F32" and sh("layers.1.self_attn.dt_bias") == [64]
    assert dt("layers.3.self_attn.kv_b_proj.weight") == "BF16" and sh("layers.3.self_attn.kv_b_proj.weight") == [160, 32]
    assert sh("layers.3.self_attn.kv_a_proj_with_mqa.weight") == [40, 128]
    assert dt("layers.2.block_sparse_moe.gate.e_score_correction_bias") == "BF16"
    assert sh("layers.2.block_sparse_moe.experts.5.w2.weight_packed") == [64, 32]
    assert sh("layers.2.block_sparse_moe.experts.5.w3.weight_scale") == [64, 2]
    for name, (f, entry) in h.items():
        if expert_of(name):
            assert entry["dtype"] == "U8"
        elif not name.endswith(("conv1d.weight", "dt_bias", "A_log")):
            assert entry["dtype"] == "BF16", name
    for layer in (0, 1, 2, 4, 5, 6, 8, 9, 10):  # the KDA layers: A_log [16], 4 used, 12 exactly 0
        name = f"{LM}layers.{layer}.self_attn.A_log"
        with safe_open(str(d / h[name][0]), "numpy") as st:
            a = st.get_tensor(name)
        assert a.dtype == np.float32 and a.shape == (16,)
        np.testing.assert_array_equal(a[:4], np.linspace(-0.4, 1.2, 4).astype(np.float32))
        assert np.all(a[4:].view(np.uint32) == 0)  # +0.0 exactly, not -0.0
    name = LM + "layers.5.block_sparse_moe.gate.e_score_correction_bias"
    bias = np.frombuffer(raw_tensor(d / h[name][0], name)[1], "<u2")
    np.testing.assert_array_equal(wr.bf16_to_f32(bias), wr.bf16_to_f32(wr.bf16_bits(np.linspace(-0.15, 0.15, 8))))
    name = LM + "layers.3.self_attn.kv_a_proj_with_mqa.weight"
    kva = wr.bf16_to_f32(np.frombuffer(raw_tensor(d / h[name][0], name)[1], "<u2")).reshape(40, 128)
    assert 1e-4 < kva[:32].std() < 3e-4 and 0.01 < kva[32:].std() < 0.03


def test_deterministic_and_seed_sensitive(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    again = fx.write_fixture("tiny", tmp_path / "again", with_oracle=False)
    first = tiny_dirs["plain"]
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for n in names:
        assert (first / n).read_bytes() == (again / n).read_bytes(), n
    other = fx.write_fixture("tiny", tmp_path / "other", with_oracle=False, seed=1)
    shard = "model-00002-of-000014.safetensors"
    assert (other / shard).read_bytes() != (first / shard).read_bytes()


def test_wide_preset_layout(tmp_path: Path) -> None:
    d = fx.write_fixture("wide", tmp_path / "wide", with_oracle=False)
    cfg = json.loads((d / "config.json").read_text())["text_config"]
    la = cfg["linear_attn_config"]
    assert (cfg["num_experts"], cfg["num_experts_per_token"], cfg["num_hidden_layers"]) == (64, 8, 5)
    assert sorted(la["full_attn_layers"] + la["kda_layers"]) == [1, 2, 3, 4, 5] and la["full_attn_layers"] == [4, 5]
    h = headers(d)
    for layer in range(1, 5):
        trunk, experts = layer_runs(h, layer)
        assert is_run(trunk) and len(experts) == 64 and all(is_run(p) for p in experts.values())


def test_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert fx.main([]) == 2
    assert fx.main(["huge", str(tmp_path / "x")]) == 2
    assert "unknown preset" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    assert fx.main(["tiny", str(tmp_path / "busy"), "--no-oracle"]) == 2
    assert fx.main(["tiny", str(tmp_path / "ok"), "--no-oracle", "--single-file", "--seed", "3"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
