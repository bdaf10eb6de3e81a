"""Strict safetensors reader (spec 3.2), checkpoint opening, and catalogue binding (3.3, 3.4).

Each crafted file breaks exactly one rule; the refusal must name the file and the reason.
"""

from __future__ import annotations

import copy
import json
import random
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from k3engine.catalog import (EXPERT_PARTS, bind, check_a_log, classify, expected_tensors,
                              expert_names, expert_run, plan_runs, trunk_run, trunk_specs)
from k3engine.config import ModelConfig, parse_config
from k3engine.errors import CheckpointError, TensorSetError
from k3engine.safetensors_io import (DTYPE_SIZES, INDEX_NAME, SINGLE_NAME, TensorInfo,
                                     open_checkpoint, read_header, read_shard_header,
                                     read_tensor)

# ---------------------------------------------------------------------------------------
# Crafting files
# ---------------------------------------------------------------------------------------


def entry(dtype: str, shape: list[Any], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def st_bytes(header: dict[str, Any] | str | bytes, data: bytes, pad: int = 0,
             n: int | None = None) -> bytes:
    """A safetensors file: header given as a dict, raw JSON text, or raw bytes."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    raw = header.encode() if isinstance(header, str) else header
    raw += b" " * pad
    return struct.pack("<Q", len(raw) if n is None else n) + raw + data


def write(directory: Path, name: str, content: bytes) -> Path:
    path = directory / name
    path.write_bytes(content)
    return path


def refusal(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert str(path) in message, message  # every refusal names its file
    return message


TWO = {"a": entry("U8", [2], 0, 2), "b": entry("F32", [1], 2, 6)}

# name, file bytes, substring of the reason, does the safetensors library refuse it too?
CRAFTED: list[tuple[str, bytes, str, bool]] = [
    ("too short", b"\x02\x00\x00", "too short", True),
    ("N past EOF", st_bytes(TWO, b"x" * 6, n=10_000), "past the end of the file", True),
    ("N too small", struct.pack("<Q", 1) + b"{", "outside 2..100000000", False),
    ("N too large", struct.pack("<Q", 100_000_001) + b"{}", "outside 2..100000000", True),
    ("truncated JSON", st_bytes(json.dumps(TWO)[:-7], b"x" * 6), "invalid or truncated JSON",
     True),
    ("invalid UTF-8", st_bytes(b'{"a\xff":' + json.dumps(TWO["a"]).encode() + b"}", b"xx"),
     "not valid UTF-8", True),
    ("not an object", st_bytes("[]", b""), "does not start with '{'", True),
    ("trailing garbage", st_bytes(json.dumps(TWO) + "xyz", b"x" * 6), "trailing garbage",
     True),
    ("newline padding", st_bytes(json.dumps(TWO) + "\n", b"x" * 6), "trailing garbage", False),
    ("duplicate key", st_bytes('{"a":' + json.dumps(TWO["a"]) + ',"a":'
                               + json.dumps(TWO["a"]) + "}", b"xx"), "duplicate key 'a'", False),
    ("duplicate field in entry", st_bytes(
        '{"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}}', b"xx"),
     "exactly the keys", False),
    ("NaN in header", st_bytes('{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,2]}}',
                               b"xx"), "NaN", True),
    ("extra entry field", st_bytes({"a": {**TWO["a"], "extra": 1}}, b"xx"), "exactly the keys",
     False),
    ("missing entry field", st_bytes({"a": {"dtype": "U8", "shape": [2]}}, b"xx"),
     "exactly the keys", True),
    ("entry not an object", st_bytes({"a": [1, 2]}, b""), "exactly the keys", True),
    ("unknown dtype", st_bytes({"a": entry("F64", [1], 0, 8)}, b"x" * 8), "not supported",
     False),
    ("dtype not a string", st_bytes({"a": entry(4, [1], 0, 4)}, b"x" * 4),  # type: ignore
     "not supported", True),
    ("overflowing shape", st_bytes({"a": entry("F32", [2**40, 2**40], 0, 4)}, b"x" * 4),
     "overflows", True),
    ("overflow hidden by a zero dim", st_bytes({"a": entry("U8", [2**62, 2**62, 0], 0, 0)},
                                               b""), "overflows", True),
    ("negative shape", st_bytes({"a": entry("U8", [-2], 0, 2)}, b"xx"), "non-negative", True),
    ("float shape", st_bytes({"a": entry("U8", [2.0], 0, 2)}, b"xx"), "non-negative", True),
    ("bool shape", st_bytes({"a": entry("U8", [True], 0, 1)}, b"x"), "non-negative", False),
    ("shape an object", st_bytes({"a": {"dtype": "U8", "shape": {}, "data_offsets": [0, 1]}},
                                 b"x"), "must be a list", True),
    ("span != numel*size", st_bytes({"a": entry("F32", [2], 0, 4)}, b"x" * 4),
     "needs 8", True),
    ("span past EOF", st_bytes({"a": entry("U8", [8], 0, 8)}, b"x" * 4), "past the end",
     True),
    ("begin > end", st_bytes({"a": entry("U8", [0], 4, 2)}, b"x" * 4), "0 <= begin <= end",
     True),
    ("offsets of three", st_bytes({"a": {"dtype": "U8", "shape": [2],
                                         "data_offsets": [0, 2, 2]}}, b"xx"),
     "[begin, end]", True),
    ("overlapping spans", st_bytes({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)},
                                   b"x" * 6), "overlaps", True),
    ("gap", st_bytes({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 3, 5)}, b"x" * 5),
     "gap of 1 bytes", True),
    ("gap at the start", st_bytes({"a": entry("U8", [2], 1, 3)}, b"x" * 3), "gap", True),
    ("trailing bytes", st_bytes({"a": entry("U8", [2], 0, 2)}, b"x" * 3),
     "1 trailing bytes", True),
    ("long name", st_bytes({"n" * 513: entry("U8", [1], 0, 1)}, b"x"), "limit 512", False),
    ("control char in name", st_bytes({"a\nb": entry("U8", [1], 0, 1)}, b"x"),
     "control characters", False),
    ("C1 control char in name", st_bytes({"a\x85b": entry("U8", [1], 0, 1)}, b"x"),
     "control characters", False),
    ("empty name", st_bytes({"": entry("U8", [1], 0, 1)}, b"x"), "empty tensor name", False),
    ("metadata not strings", st_bytes({"__metadata__": {"k": 1}, **TWO}, b"x" * 6),
     "strings to strings", True),
    ("metadata not an object", st_bytes({"__metadata__": "x", **TWO}, b"x" * 6),
     "__metadata__ must be an object", True),
]


@pytest.mark.parametrize("content,reason,library_refuses", [c[1:] for c in CRAFTED],
                         ids=[c[0] for c in CRAFTED])
def test_crafted_file_refused(tmp_path: Path, content: bytes, reason: str,
                              library_refuses: bool) -> None:
    path = write(tmp_path, "model-00001-of-000002.safetensors", content)
    message = refusal(path)
    assert reason in message, message
    assert "re-download" in message  # says what to do
    if library_refuses:  # where the reference library has the same rule, it agrees
        with pytest.raises(Exception):
            with safe_open(str(path), "np") as fh:
                for key in fh.keys():
                    fh.get_tensor(key)


def test_space_padding_and_metadata_accepted(tmp_path: Path) -> None:
    header = {"__metadata__": {"format": "pt"}, **TWO}
    path = write(tmp_path, "x.safetensors", st_bytes(header, b"x" * 6, pad=5))
    shard = read_shard_header(path)
    assert shard.metadata == {"format": "pt"}
    n = len(json.dumps(header, separators=(",", ":"))) + 5
    assert shard.header_len == n and shard.data_start == 8 + n
    assert shard.tensors["a"] == TensorInfo("a", "U8", (2,), "x.safetensors", 8 + n, 2)
    assert shard.tensors["b"] == TensorInfo("b", "F32", (1,), "x.safetensors", 8 + n + 2, 4)


def test_empty_and_zero_sized_tensors_accepted(tmp_path: Path) -> None:
    assert read_header(write(tmp_path, "e.safetensors", st_bytes("{}", b""))) == {}
    header = {"z": entry("F32", [0, 5], 0, 0), "a": entry("U8", [3], 0, 3),
              "s": entry("F32", [], 3, 7)}  # a scalar has one element
    tensors = read_header(write(tmp_path, "z.safetensors", st_bytes(header, b"x" * 7)))
    assert tensors["z"].nbytes == 0 and tensors["s"].nbytes == 4 and tensors["s"].shape == ()


def test_entry_keys_in_any_order_accepted(tmp_path: Path) -> None:
    text = '{"a":{"data_offsets":[0,2],"shape":[1],"dtype":"BF16"}}'
    tensors = read_header(write(tmp_path, "o.safetensors", st_bytes(text, b"xy")))
    assert tensors["a"].dtype == "BF16" and tensors["a"].shape == (1,)


def test_matches_the_safetensors_library(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "language_model.w": rng.standard_normal((3, 5)).astype(np.float32),
        "language_model.h": rng.standard_normal((7,)).astype(np.float16),
        "language_model.u": rng.integers(0, 255, (4, 3), dtype=np.uint8),
        "vision_tower.v": rng.standard_normal((2, 2)).astype(np.float32),
    }
    path = tmp_path / SINGLE_NAME
    save_file(arrays, str(path), metadata={"format": "pt"})
    header = read_shard_header(path)
    assert header.metadata == {"format": "pt"}
    raw = path.read_bytes()
    with safe_open(str(path), "np") as fh:
        assert set(fh.keys()) == set(header.tensors)
        for name, info in header.tensors.items():
            ref = fh.get_tensor(name)
            assert info.shape == ref.shape
            assert info.nbytes == ref.nbytes
            assert raw[info.start:info.end] == ref.astype(ref.dtype.newbyteorder("<")).tobytes()
    ckpt = open_checkpoint(tmp_path)
    assert set(ckpt.tensors) == {n for n in arrays if n.startswith("language_model.")}
    assert ckpt.shards == [SINGLE_NAME] and not ckpt.sharded
    for name in ckpt.tensors:
        np.testing.assert_array_equal(read_tensor(ckpt, ckpt.tensors[name]), arrays[name])


def test_bf16_read_widens_exactly(tmp_path: Path) -> None:
    values = np.array([1.0, -2.5, 3.140625, 1e-40], dtype=np.float32)  # all exact in bf16
    bits = (values.view(np.uint32) >> 16).astype("<u2")
    path = write(tmp_path, SINGLE_NAME, st_bytes({"language_model.x": entry("BF16", [4], 0, 8)},
                                                 bits.tobytes()))
    ckpt = open_checkpoint(tmp_path)
    got = read_tensor(ckpt, ckpt.tensors["language_model.x"])
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), bits.astype(np.uint32) << 16)
    assert path.exists()


# ---------------------------------------------------------------------------------------
# Sharded checkpoints
# ---------------------------------------------------------------------------------------


def shard_file(directory: Path, name: str, sizes: dict[str, int]) -> bytes:
    """Write a shard of U8 tensors (name -> byte count) and return its data."""
    header: dict[str, Any] = {}
    pos = 0
    for tensor, size in sizes.items():
        header[tensor] = entry("U8", [size], pos, pos + size)
        pos += size
    data = bytes(random.Random(name).randrange(256) for _ in range(pos))
    write(directory, name, st_bytes(header, data, pad=3))
    return data


def write_index(directory: Path, weight_map: dict[str, str], total: int | None) -> None:
    meta = {} if total is None else {"metadata": {"total_size": total}}
    (directory / INDEX_NAME).write_text(json.dumps({**meta, "weight_map": weight_map}))


S1, S2, SV = ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
              "model-00003-of-00003.safetensors")
LAYOUT = {
    S1: {"language_model.a": 3, "language_model.b": 5},
    S2: {"language_model.c": 7},
    SV: {"vision_tower.v": 11, "mm_projector.p": 2},
}


def sharded(tmp_path: Path, layout: dict[str, dict[str, int]] | None = None,
            weight_map: dict[str, str] | None = None, total: int | None = 28,
            skip: tuple[str, ...] = ()) -> Path:
    layout = layout or LAYOUT
    for shard, sizes in layout.items():
        if shard not in skip:
            shard_file(tmp_path, shard, sizes)
    if weight_map is None:
        weight_map = {t: s for s, sizes in layout.items() for t in sizes}
    write_index(tmp_path, weight_map, total)
    return tmp_path


def test_sharded_checkpoint_offsets(tmp_path: Path) -> None:
    ckpt = open_checkpoint(sharded(tmp_path))
    assert ckpt.shards == [S1, S2] and ckpt.listed_shards == [S1, S2, SV]
    assert ckpt.missing_shards == [] and ckpt.total_size == 28 and ckpt.sharded
    assert set(ckpt.tensors) == {"language_model.a", "language_model.b", "language_model.c"}
    for name, info in ckpt.tensors.items():
        raw = ckpt.path(info.shard).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        assert info.start >= 8 + n and info.end <= len(raw)
        with safe_open(str(ckpt.path(info.shard)), "np") as fh:
            assert raw[info.start:info.end] == fh.get_tensor(name).tobytes()
    assert ckpt.tensors["language_model.b"].start == ckpt.tensors["language_model.a"].end
    assert ckpt.shard_id(S2) == 1
    with pytest.raises(CheckpointError):
        ckpt.path("../etc/passwd")


def test_vision_shard_may_be_absent(tmp_path: Path) -> None:
    # total_size (28) counts the vision bytes, so it cannot be checked without the shard.
    ckpt = open_checkpoint(sharded(tmp_path, skip=(SV,), total=999))
    assert ckpt.missing_shards == [SV] and ckpt.shards == [S1, S2]


def test_wrong_total_size_is_not_refused_at_open_but_kept_for_bind(tmp_path: Path) -> None:
    # Published indexes sometimes carry a wrong total: open leaves the verdict to whoever
    # checks every tensor's shape and dtype (bind, the planner).
    ckpt = open_checkpoint(sharded(tmp_path, total=27))
    assert ckpt.total_size == 27 and ckpt.shard_total == 28
    assert ckpt.total_size_problem == (f"{tmp_path / INDEX_NAME}: metadata.total_size is 27 "
                                       f"but the shards hold 28 tensor bytes")
    (tmp_path / "ok").mkdir()
    assert open_checkpoint(sharded(tmp_path / "ok", total=28)).total_size_problem is None


def test_absent_language_shard_reported_by_bind_not_open(tmp_path: Path) -> None:
    ckpt = open_checkpoint(sharded(tmp_path, skip=(S2,)))
    assert ckpt.missing_shards == [S2] and "language_model.c" not in ckpt.tensors
    assert ckpt.assigned["language_model.c"] == S2


def test_name_duplicated_across_shards_refused(tmp_path: Path) -> None:
    layout = copy.deepcopy(LAYOUT)
    layout[S2]["language_model.a"] = 3
    weight_map = {t: s for s, sizes in LAYOUT.items() for t in sizes}
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(sharded(tmp_path, layout, weight_map, total=None))
    assert "'language_model.a' appears in both" in str(info.value)
    assert S1 in str(info.value) and S2 in str(info.value)


@pytest.mark.parametrize("bad", ["../model-00001-of-00003.safetensors", "sub/x.safetensors",
                                 "..", "", "a\\b.safetensors", "/etc/passwd"])
def test_index_entry_not_a_bare_file_name_refused(tmp_path: Path, bad: str) -> None:
    weight_map = {t: s for s, sizes in LAYOUT.items() for t in sizes}
    weight_map["language_model.c"] = bad
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(sharded(tmp_path, weight_map=weight_map))
    assert INDEX_NAME in str(info.value) and "language_model.c" in str(info.value)


def test_index_header_mismatch_refused(tmp_path: Path) -> None:
    weight_map = {t: s for s, sizes in LAYOUT.items() for t in sizes}
    weight_map["language_model.b"] = S2  # the header of S1 holds it, the index says S2
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(sharded(tmp_path, weight_map=weight_map, total=None))
    message = str(info.value)
    assert "does not match" in message and "language_model.b" in message
    assert S1 in message or S2 in message


def test_header_holding_unlisted_tensor_refused(tmp_path: Path) -> None:
    layout = copy.deepcopy(LAYOUT)
    layout[S2]["language_model.z"] = 1
    weight_map = {t: s for s, sizes in LAYOUT.items() for t in sizes}
    with pytest.raises(CheckpointError, match="does not assign to it: 'language_model.z'"):
        open_checkpoint(sharded(tmp_path, layout, weight_map, total=None))


def test_bad_shard_header_refused_naming_the_shard(tmp_path: Path) -> None:
    sharded(tmp_path)
    path = tmp_path / S2
    path.write_bytes(path.read_bytes() + b"\0")  # one trailing byte
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(tmp_path)
    assert str(path) in str(info.value) and "trailing bytes" in str(info.value)


@pytest.mark.parametrize("text,reason", [
    ("{", "not acceptable JSON"),
    ('{"weight_map": {"language_model.a": "x", "language_model.a": "y"}}', "duplicate key"),
    ('{"weight_map": []}', "weight_map"),
    ('{"weight_map": {"language_model.a": 5}}', "file name"),
    ('{"metadata": {"total_size": 1.5}, "weight_map": {}}', "total_size"),
    ('{"metadata": {"total_size": NaN}, "weight_map": {}}', "NaN"),
])
def test_malformed_index_refused(tmp_path: Path, text: str, reason: str) -> None:
    (tmp_path / INDEX_NAME).write_text(text)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(tmp_path)
    assert INDEX_NAME in str(info.value) and reason in str(info.value)


def test_no_checkpoint_or_both_kinds_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        open_checkpoint(tmp_path)
    sharded(tmp_path)
    write(tmp_path, SINGLE_NAME, st_bytes("{}", b""))
    with pytest.raises(CheckpointError, match="ambiguous"):
        open_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------
# Catalogue binding and contiguity on a tiny model (spec 9.1 dimensions)
# ---------------------------------------------------------------------------------------

from reference import REFERENCE

REAL_CONFIG = json.loads((REFERENCE / "config.json").read_text())


def tiny_config(text_dtype: str = "bfloat16") -> ModelConfig:
    root = copy.deepcopy(REAL_CONFIG)
    root.update(bos_token_id=1000, eos_token_id=1001, pad_token_id=1023)
    text = root["text_config"]
    text["dtype"] = text_dtype
    text.update(hidden_size=128, num_hidden_layers=13, vocab_size=1024, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=24,
                qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=2,
                routed_expert_hidden_size=64, moe_intermediate_size=64,
                intermediate_size=96, attn_res_block_size=3)
    text["linear_attn_config"].update(num_heads=4, head_dim=16,
                                      full_attn_layers=[4, 8, 12, 13],
                                      kda_layers=[1, 2, 3, 5, 6, 7, 9, 10, 11])
    return parse_config(root, "tiny")


def stored_dtype(name: str, kind: str) -> str:
    if kind == "expert":
        return "U8"
    return "F32" if name.endswith(("conv1d.weight", "dt_bias", "A_log")) else "BF16"


def layer_of(name: str) -> int | None:
    prefix = "language_model.model.layers."
    return int(name[len(prefix):].split(".")[0]) if name.startswith(prefix) else None


def tiny_checkpoint(directory: Path, cfg: ModelConfig, scramble: bool = False,
                    override: dict[str, dict[str, Any]] | None = None,
                    drop: tuple[str, ...] = (), add: tuple[str, ...] = ()) -> None:
    """One shard per layer plus a model shard, real naming, experts in shuffled order.

    `scramble` breaks trunk and expert runs (an expert inside the trunk, w2 before w1);
    `override` replaces header entries' dtype/shape; `drop`/`add` remove or add tensors.
    """
    specs = expected_tensors(cfg)
    n_shards = cfg.n_layers + 1
    shard_of = {}
    for name in list(specs) + list(add):
        layer = layer_of(name)
        index = layer + 1 if layer is not None else n_shards
        shard_of[name] = f"model-{index:05d}-of-{n_shards:06d}.safetensors"
    rng = random.Random(7)
    for shard in sorted(set(shard_of.values())):
        names = [n for n in shard_of if shard_of[n] == shard]
        trunk = [n for n in names if classify(n) != "expert"]
        experts = sorted({n.rsplit(".", 2)[0] for n in names if classify(n) == "expert"})
        rng.shuffle(experts)
        parts = list(EXPERT_PARTS)
        if scramble:
            parts[0], parts[2] = parts[2], parts[0]
        order = trunk + [f"{e}.{p}" for e in experts for p in parts]
        if scramble and experts:
            order.insert(1, order.pop(len(trunk)))  # an expert tensor inside the trunk
        header: dict[str, Any] = {}
        pos = 0
        for name in order:
            if name in drop:
                continue
            spec = specs.get(name)
            shape = list(spec.shape) if spec else [3]
            if name.endswith("A_log"):
                shape = [16]  # zero-padded like the release
            dtype = stored_dtype(name, spec.kind if spec else "trunk")
            item = {"dtype": dtype, "shape": shape, **(override or {}).get(name, {})}
            size = DTYPE_SIZES[item["dtype"]] * int(np.prod(item["shape"]))
            header[name] = {**item, "data_offsets": [pos, pos + size]}
            pos += size
        write(directory, shard, st_bytes(header, bytes(pos)))
    weight_map = {n: s for n, s in shard_of.items() if n not in drop}
    weight_map["vision_tower.x"] = f"model-{n_shards + 1:05d}-of-{n_shards:06d}.safetensors"
    write_index(directory, weight_map, None)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return tiny_config()


def test_tiny_catalogue_counts(tiny: ModelConfig) -> None:
    specs = expected_tensors(tiny)
    experts = [n for n, s in specs.items() if s.kind == "expert"]
    assert len(experts) == 12 * 8 * 6
    assert len(trunk_specs(tiny, 0)) == 23  # KDA + dense
    assert len(trunk_specs(tiny, 1)) == 28  # KDA + MoE
    assert len(trunk_specs(tiny, 3)) == 22  # MLA + MoE
    assert len(specs) == 12 * 8 * 6 + 23 + 28 * 8 + 22 * 4 + 5
    w1 = specs["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    w2s = specs["language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_scale"]
    assert w1.shape == (64, 32) and w2s.shape == (64, 2) and w1.dtypes == {"U8"}
    kv_b = specs["language_model.model.layers.3.self_attn.kv_b_proj.weight"]
    assert kv_b.shape == (160, 32)
    assert expert_names(2, 5)[0].endswith("layers.2.block_sparse_moe.experts.5.w1.weight_packed")


def test_tiny_checkpoint_binds_and_runs_are_contiguous(tmp_path: Path,
                                                       tiny: ModelConfig) -> None:
    tiny_checkpoint(tmp_path, tiny)
    ckpt = open_checkpoint(tmp_path)
    bind(tiny, ckpt)
    assert len(ckpt.shards) == 14 and ckpt.missing_shards == [ckpt.listed_shards[-1]]
    plan = plan_runs(tiny, ckpt)
    assert plan.trunk_fallbacks == 0 and plan.expert_fallbacks == 0
    for layer in range(tiny.n_layers):
        run = trunk_run(ckpt, tiny, layer)
        infos = [ckpt.tensors[n] for n in trunk_specs(tiny, layer)]
        assert run is not None and run.shard == f"model-{layer + 1:05d}-of-000014.safetensors"
        assert run.hi - run.lo == sum(i.nbytes for i in infos)
        assert run.lo == min(i.start for i in infos)
    starts = []
    for expert in range(tiny.n_experts):
        run = expert_run(ckpt, 5, expert)
        assert run is not None and run.hi - run.lo == tiny.expert_bytes == 6528
        assert run.lo == ckpt.tensors[expert_names(5, expert)[0]].start
        starts.append(run.lo)
    assert starts != sorted(starts)  # runs are not in expert-id order
    assert expert_run(ckpt, 0, 0) is None  # layer 0 is dense


def test_scrambled_checkpoint_binds_but_runs_fall_back(tmp_path: Path,
                                                       tiny: ModelConfig) -> None:
    tiny_checkpoint(tmp_path, tiny, scramble=True)
    ckpt = open_checkpoint(tmp_path)
    bind(tiny, ckpt)  # layout is not a binding property
    plan = plan_runs(tiny, ckpt)
    assert plan.expert_fallbacks == 12 * 8  # w2 before w1 everywhere
    assert plan.trunk_fallbacks == 12  # an expert tensor inside every MoE layer's trunk
    assert plan.trunk[0] is not None
    assert trunk_run(ckpt, tiny, 1) is None and expert_run(ckpt, 1, 0) is None


def test_bind_reports_missing_extra_and_misshapen_together(tmp_path: Path,
                                                           tiny: ModelConfig) -> None:
    w1 = "language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight_packed"
    norm = "language_model.model.layers.4.input_layernorm.weight"
    q_a = "language_model.model.layers.3.self_attn.q_a_proj.weight"
    gone = "language_model.model.layers.6.self_attn.b_proj.weight"
    extra = "language_model.model.layers.6.self_attn.rope.inv_freq"
    tiny_checkpoint(tmp_path, tiny,
                    override={w1: {"dtype": "F16", "shape": [64, 16]},
                              norm: {"shape": [127]}, q_a: {"shape": [128, 64]}},
                    drop=(gone,), add=(extra,))
    (tmp_path / "model-00012-of-000014.safetensors").unlink()  # layer 11's shard
    ckpt = open_checkpoint(tmp_path)
    with pytest.raises(TensorSetError) as info:
        bind(tiny, ckpt)
    err = info.value
    message = str(err)
    assert isinstance(err, CheckpointError)
    assert gone in err.missing and f"{gone} (not in the index)" in message
    layer11 = [n for n in err.missing if layer_of(n) == 11]
    assert len(layer11) == 22 + 8 * 6
    assert "which is not in" in message and "model-00012-of-000014.safetensors" in message
    assert err.extra == [extra]
    assert len(err.misshapen) == 3
    assert f"{w1} in model-00003-of-000014.safetensors: dtype F16, expected U8" in message
    assert f"{norm} in model-00005-of-000014.safetensors: shape [127], expected [128]" in message
    assert f"{q_a} in model-00004-of-000014.safetensors: shape [128, 64], expected [64, 128]" \
        in message


def test_trunk_dtype_other_than_the_configs_is_refused(tmp_path: Path,
                                                      tiny: ModelConfig) -> None:
    # The audit's edit: BF16 -> F16 keeps every span valid (2 bytes per element), so only
    # the dtype contract (config.json dtype bfloat16; spec 3.3's F32 tensors) can catch it.
    q = "language_model.model.layers.1.self_attn.q_proj.weight"
    head = "language_model.lm_head.weight"
    conv = "language_model.model.layers.2.self_attn.k_conv1d.weight"
    dt_bias = "language_model.model.layers.2.self_attn.dt_bias"
    assert tiny.trunk_dtype == "BF16"
    tiny_checkpoint(tmp_path, tiny, override={q: {"dtype": "F16"}, head: {"dtype": "F16"},
                                              conv: {"dtype": "BF16"}, dt_bias: {"dtype": "F16"}})
    with pytest.raises(TensorSetError) as info:
        bind(tiny, open_checkpoint(tmp_path))
    err = info.value
    assert len(err.misshapen) == 4 and not err.missing and not err.extra
    assert (f"{q} in model-00002-of-000014.safetensors: dtype F16, expected BF16 (config.json "
            f"text_config.dtype is bfloat16)") in str(err)
    assert f"{head} in model-00014-of-000014.safetensors: dtype F16, expected BF16" in str(err)
    for name in (conv, dt_bias):
        found = "BF16" if name == conv else "F16"
        assert (f"{name} in model-00003-of-000014.safetensors: dtype {found}, expected F32 "
                f"(spec 3.3: conv weights, dt_bias and A_log are stored in F32)") in str(err)


def _set_total_size(model: Path, delta: int) -> tuple[int, int]:
    """Make the index's metadata.total_size wrong by `delta`; return (written, actual)."""
    index = json.loads((model / INDEX_NAME).read_text())
    shards = set(index["weight_map"].values())
    actual = sum(t.nbytes for shard in shards if (model / shard).exists()
                 for t in read_header(model / shard).values())
    index["metadata"] = {"total_size": actual + delta}
    (model / INDEX_NAME).write_text(json.dumps(index))
    return actual + delta, actual


def test_wrong_total_size_warns_once_when_every_tensor_fits(
        tmp_path: Path, tiny: ModelConfig, caplog: pytest.LogCaptureFixture) -> None:
    from k3engine.planner import tensor_sizes_from_dir
    tiny_checkpoint(tmp_path, tiny)
    (tmp_path / f"model-{tiny.n_layers + 2:05d}-of-000014.safetensors").write_bytes(
        st_bytes({"vision_tower.x": entry("U8", [3], 0, 3)}, b"abc"))  # all shards present
    written, actual = _set_total_size(tmp_path, 1000)
    with caplog.at_level("WARNING", logger="k3engine.safetensors_io"):
        tensor_sizes_from_dir(tmp_path, tiny)  # the planner runs first, then the model opens
        bind(tiny, open_checkpoint(tmp_path))
        bind(tiny, open_checkpoint(tmp_path))
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert f"metadata.total_size is {written} but the shards hold {actual} tensor bytes" \
        in warned[0] and "the checkpoint is used" in warned[0]


def test_wrong_total_size_is_named_when_bind_refuses(tmp_path: Path, tiny: ModelConfig) -> None:
    gone = "language_model.model.layers.6.self_attn.b_proj.weight"
    tiny_checkpoint(tmp_path, tiny, drop=(gone,))
    (tmp_path / f"model-{tiny.n_layers + 2:05d}-of-000014.safetensors").write_bytes(
        st_bytes({"vision_tower.x": entry("U8", [3], 0, 3)}, b"abc"))
    written, actual = _set_total_size(tmp_path, -5)
    with pytest.raises(TensorSetError) as info:
        bind(tiny, open_checkpoint(tmp_path))
    assert gone in info.value.missing
    assert (f"also: {tmp_path / INDEX_NAME}: metadata.total_size is {written} but the shards "
            f"hold {actual} tensor bytes") in str(info.value)


def test_run_goes_on_with_one_warning_when_total_size_is_wrong(tmp_path: Path,
                                                               tiny_dir: Path) -> None:
    import shutil
    import subprocess
    import sys
    model = tmp_path / "wrong-total"
    shutil.copytree(tiny_dir, model)
    written, actual = _set_total_size(model, 4096)
    done = subprocess.run([sys.executable, "-m", "k3chat.cli", "run", str(model), "--ids", "1,2",
                           "--gen", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("generated: ") and done.stdout.split()[1].count(",") == 2
    assert done.stderr.count("metadata.total_size") == 1, done.stderr
    assert f"total_size is {written} but the shards hold {actual} tensor bytes" in done.stderr


def test_run_refuses_the_audits_one_byte_bf16_to_f16_edit(tmp_path: Path,
                                                          tiny_dir: Path) -> None:
    # Same-length edit ("BF16" -> ' "F16"'): the header stays valid, spans and all.
    import shutil
    import subprocess
    import sys
    model = tmp_path / "edited"
    shutil.copytree(tiny_dir, model)
    shard = model / "model-00002-of-000014.safetensors"
    name = "language_model.model.layers.1.self_attn.q_proj.weight"
    raw = shard.read_bytes()
    key = f'"{name}":{{"dtype":"BF16"'.encode()
    assert raw.count(key) == 1
    shard.write_bytes(raw.replace(key, key[:-6] + b' "F16"'))
    assert read_header(shard)[name].dtype == "F16"
    done = subprocess.run([sys.executable, "-m", "k3chat.cli", "run", str(model), "--ids", "1,2",
                           "--gen", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert (f"{name} in {shard.name}: dtype F16, expected BF16 (config.json text_config.dtype "
            f"is bfloat16)") in done.stderr


def test_f16_trunk_binds_when_the_config_says_float16(tmp_path: Path) -> None:
    cfg16 = tiny_config(text_dtype="float16")
    assert cfg16.trunk_dtype == "F16"
    specs = expected_tensors(cfg16)
    as_f16 = {n: {"dtype": "F16"} for n, s in specs.items()
              if s.kind != "expert" and stored_dtype(n, s.kind) == "BF16"}
    tiny_checkpoint(tmp_path, cfg16, override=as_f16)
    bind(cfg16, open_checkpoint(tmp_path))  # F16 is read because the config says so
    (tmp_path / INDEX_NAME).unlink()
    for shard in tmp_path.glob("*.safetensors"):
        shard.unlink()
    tiny_checkpoint(tmp_path, cfg16)  # BF16 as released, against a float16 config
    with pytest.raises(TensorSetError, match=r"dtype BF16, expected F16 \(config.json "
                                             r"text_config.dtype is float16\)"):
        bind(cfg16, open_checkpoint(tmp_path))


@pytest.mark.parametrize("length,ok", [(4, True), (16, True), (3, False)])
def test_a_log_length(tmp_path: Path, tiny: ModelConfig, length: int, ok: bool) -> None:
    name = "language_model.model.layers.0.self_attn.A_log"
    tiny_checkpoint(tmp_path, tiny, override={name: {"shape": [length]}})
    ckpt = open_checkpoint(tmp_path)
    if ok:
        bind(tiny, ckpt)
    else:
        with pytest.raises(TensorSetError, match=r"A_log in .*: shape \[3\], expected \[n\] "
                                                 r"with n >= 4"):
            bind(tiny, ckpt)


def test_split_expert_refused(tmp_path: Path, tiny: ModelConfig) -> None:
    tiny_checkpoint(tmp_path, tiny)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    # Move one expert tensor to the model shard (both header and index agree).
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"
    src, dst = "model-00002-of-000014.safetensors", "model-00014-of-000014.safetensors"
    for shard, fn in ((src, lambda h: h.pop(name)), (dst, None)):
        raw = (tmp_path / shard).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        if fn is not None:
            fn(header)
        else:
            header[name] = {"dtype": "U8", "shape": [64, 2], "data_offsets": [0, 0]}
        # Re-lay the data so the file tiles again (content is zeros anyway).
        pos = 0
        for item in header.values():
            size = item["data_offsets"][1] - item["data_offsets"][0] or 128
            item["data_offsets"] = [pos, pos + size]
            pos += size
        write(tmp_path, shard, st_bytes(header, bytes(pos)))
    index["weight_map"][name] = dst
    write_index(tmp_path, index["weight_map"], None)
    ckpt = open_checkpoint(tmp_path)
    with pytest.raises(TensorSetError, match="experts.2: its six tensors are split over"):
        bind(tiny, ckpt)
    assert expert_run(ckpt, 1, 2) is None


def test_check_a_log() -> None:
    assert check_a_log(np.array([0.1, -0.4, 1.2, 0.0] + [0.0] * 12, np.float32), 4) is None
    assert check_a_log(np.array([0.1, 0.2, 0.3, 0.4]), 4) is None
    assert check_a_log(np.array([0.1, 0.2, 0.3, 0.4, -0.0]), 4) is None  # -0 is zero
    assert "fewer than the 4" in (check_a_log(np.zeros(3), 4) or "")
    assert "padding entry 5" in (check_a_log(np.array([1, 2, 3, 4, 0, 1e-30]), 4) or "")
    assert "padding" in (check_a_log(np.array([1, 2, 3, 4, np.nan]), 4) or "")
    assert "NaN" in (check_a_log(np.array([1, np.nan, 3, 4]), 4) or "")


def test_classify() -> None:
    assert classify("vision_tower.encoder.blocks.0.wo.weight") == "vision"
    assert classify("mm_projector.proj.0.weight") == "vision"
    assert classify("language_model.lm_head.weight") == "model"
    assert classify("language_model.model.norm.weight") == "model"
    assert classify("language_model.model.layers.7.block_sparse_moe.shared_experts."
                    "up_proj.weight") == "trunk"
    assert classify("language_model.model.layers.7.block_sparse_moe.experts.12."
                    "w2.weight_scale") == "expert"
