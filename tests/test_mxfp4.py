"""MXFP4 codec unit gates (spec k3-model.md section 4 and 9.2/9.3).

Expected numbers come from the spec text or the reference file's own `expected` arrays,
never from the code under test.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from k3engine import mxfp4

from reference import REFERENCE

SAMPLE = REFERENCE / "mxfp4-layer1-expert0-w1.json"


@lru_cache(maxsize=1)
def _sample() -> dict:
    if not SAMPLE.exists():
        pytest.skip(f"reference sample {SAMPLE} not available")
    return json.loads(SAMPLE.read_text())


def _array(entry: dict, dtype) -> np.ndarray:
    return np.asarray(entry["data"], dtype=dtype).reshape(entry["shape"])


def _decoded_sample() -> np.ndarray:
    d = _sample()
    w, nan_groups = mxfp4.decode(_array(d["packed"], np.uint8), _array(d["scales"], np.uint8))
    assert nan_groups == 0
    return w


# ---------------------------------------------------------------- table and real bytes

def test_e2m1_table_matches_spec() -> None:
    spec = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert mxfp4.E2M1.dtype == np.float64 and mxfp4.E2M1.shape == (16,)
    assert list(mxfp4.E2M1) == spec
    assert np.signbit(mxfp4.E2M1[8]), "code 8 is -0"
    # the reference file carries its own copy of the table
    assert list(mxfp4.E2M1) == _sample()["e2m1_lut"]


def test_real_sample_decodes_exactly() -> None:
    d = _sample()
    w = _decoded_sample()
    expected = _array(d["expected"], np.float64)
    assert w.shape == (64, 3584) and w.dtype == np.float64
    assert np.array_equal(w, expected)


def test_real_sample_first_bytes() -> None:
    d = _sample()
    packed = _array(d["packed"], np.uint8)
    scales = _array(d["scales"], np.uint8)
    assert packed[0, 0] == 0x16 and packed[0, 1] == 0xB9 and scales[0, 0] == 121
    w = _decoded_sample()
    assert list(w[0, :4]) == [0.0625, 0.0078125, -0.0078125, -0.0234375]


def test_real_sample_swapped_nibbles_is_the_negative_control() -> None:
    d = _sample()
    packed = _array(d["packed"], np.uint8)
    scales = _array(d["scales"], np.uint8)
    swapped, _ = mxfp4.decode(packed, scales, swap_nibbles=True)
    first64 = np.asarray(d["expected_swapped_nibbles"]["first64"], dtype=np.float64)
    assert np.array_equal(swapped.reshape(-1)[:64], first64)
    assert list(swapped[0, :4]) == [0.0078125, 0.0625, -0.0234375, -0.0078125]
    correct = _decoded_sample()
    assert not np.array_equal(swapped, correct)
    assert not np.array_equal(correct.reshape(-1)[:64], first64)
    # same statistics, wrong positions (spec 4)
    assert swapped.sum() == correct.sum() and np.abs(swapped).sum() == np.abs(correct).sum()


def test_real_sample_scale_histogram() -> None:
    scales = _array(_sample()["scales"], np.uint8)
    values, counts = np.unique(scales, return_counts=True)
    assert dict(zip(values.tolist(), counts.tolist())) == {120: 1104, 121: 6028, 122: 36}


def test_real_sample_checksums() -> None:
    w = _decoded_sample()
    assert w.size == 229_376
    # all values are multiples of 2^-8 with small magnitude: these sums are exact in fp64
    assert w.sum() == 1.9296875
    assert np.abs(w).sum() == 4481.0078125
    assert w[0].sum() == 0.78515625
    assert w[63, 3583] == -0.0234375
    packed = _array(_sample()["packed"], np.uint8)
    assert packed[63, 1791] == 188  # w[63][3583] is that byte's high nibble
    assert mxfp4.E2M1[188 >> 4] * 2.0 ** -6 == -0.0234375


def test_real_sample_matvec() -> None:
    w = _decoded_sample()
    x = (np.arange(w.shape[1]) % 7 - 3).astype(np.float64)
    y = w[:4] @ x
    assert list(y) == [3.6796875, -3.0625, -1.88671875, -0.78125]
    # exact in fp32 too, under any summation order
    y32 = w[:4].astype(np.float32) @ x.astype(np.float32)
    assert list(y32.astype(np.float64)) == [3.6796875, -3.0625, -1.88671875, -0.78125]


# ---------------------------------------------------------------- scales: 255 and 0

def test_scale_255_is_zero_group_and_counted() -> None:
    packed = np.full((2, 32), 0x77, dtype=np.uint8)     # every element code 7 (= 6.0)
    scales = np.array([[127, 255], [255, 255]], dtype=np.uint8)
    w, nan_groups = mxfp4.decode(packed, scales)
    assert nan_groups == 3
    assert np.all(w[0, :32] == 6.0)
    assert np.all(w[0, 32:] == 0.0) and not np.any(np.signbit(w[0, 32:]))
    assert np.all(w[1] == 0.0)
    assert np.all(np.isfinite(w))


def test_scale_0_is_2_pow_minus_127_not_flushed() -> None:
    # nibbles: low 1 (0.5), high 7 (6.0)
    packed = np.full((1, 16), 0x71, dtype=np.uint8)
    scales = np.array([[0]], dtype=np.uint8)
    w, nan_groups = mxfp4.decode(packed, scales)
    assert nan_groups == 0
    assert w[0, 0] == 0.5 * 2.0 ** -127 == 2.0 ** -128
    assert w[0, 1] == 6.0 * 2.0 ** -127
    assert w[0, 0] != 0.0
    # both are fp32 subnormals: representable exactly, and not zero
    assert float(np.float32(w[0, 0])) == w[0, 0] and np.float32(w[0, 0]) != 0


def test_scale_exponent_is_s_minus_127() -> None:
    packed = np.full((1, 16), 0x22, dtype=np.uint8)     # 1.0 everywhere
    for s in (1, 100, 127, 128, 200, 254):
        w, _ = mxfp4.decode(packed, np.array([[s]], dtype=np.uint8))
        assert np.all(w == 2.0 ** (s - 127)), s


def test_every_nibble_position() -> None:
    # byte j of row 0 holds low nibble j%16 and high nibble 15 - j%16
    packed = np.array([[(j % 16) | ((15 - j % 16) << 4) for j in range(16)]], dtype=np.uint8)
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    w, _ = mxfp4.decode(packed, np.array([[127]], dtype=np.uint8))
    for j in range(16):
        assert w[0, 2 * j] == table[j % 16]
        assert w[0, 2 * j + 1] == table[15 - j % 16]


# ---------------------------------------------------------------- shape validation

@pytest.mark.parametrize("packed_shape, scale_shape, fragment", [
    ((4, 16), (3, 1), "rows"),
    ((4, 16), (4, 2), "scale_cols"),
    ((4, 32), (4, 1), "scale_cols"),
    ((16,), (1,), "2-D"),
])
def test_decode_shape_errors(packed_shape, scale_shape, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        mxfp4.decode(np.zeros(packed_shape, np.uint8), np.zeros(scale_shape, np.uint8))


def test_decode_rejects_non_byte_data() -> None:
    with pytest.raises(ValueError):
        mxfp4.decode(np.full((1, 16), 300, np.int32), np.zeros((1, 1), np.uint8))
    with pytest.raises(ValueError):
        mxfp4.decode(np.zeros((1, 16), np.float32), np.zeros((1, 1), np.uint8))


def test_quantize_shape_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(np.ones((2, 48)))
    with pytest.raises(ValueError):
        mxfp4.quantize(np.ones(64))
    with pytest.raises(ValueError):
        mxfp4.quantize(np.full((1, 32), np.nan))


# ---------------------------------------------------------------- quantize

def _brute_force_nearest(m: float) -> float:
    """Nearest E2M1 magnitude, ties to the even code index (independent of the codec)."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    dist = [abs(m - g) for g in grid]
    best = min(dist)
    winners = [i for i, d in enumerate(dist) if d == best]
    even = [i for i in winners if i % 2 == 0]
    return grid[(even or winners)[0]]


def test_quantize_scale_rule_boundaries() -> None:
    # (amax, expected s): s = clamp(127 + ceil(log2(amax/6)), 1, 254)
    cases = [(6.0, 127), (6.000001, 128), (3.0, 126), (3.000001, 127), (12.0, 128),
             (0.75, 124), (1.0, 125), (6.0 * 2.0 ** -130, 1), (6.0 * 2.0 ** 200, 254)]
    for amax, s in cases:
        w = np.zeros((1, 32))
        w[0, 5] = -amax
        _, scales = mxfp4.quantize(w)
        assert scales[0, 0] == s, (amax, scales[0, 0], s)


def test_quantize_zero_group() -> None:
    packed, scales = mxfp4.quantize(np.zeros((2, 64)))
    assert np.all(packed == 0) and np.all(scales == 127)


def test_quantize_ties_round_half_to_even() -> None:
    w = np.zeros((1, 32))
    w[0, :8] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]    # amax 6 -> s = 127
    w[0, 8:16] = -w[0, :8]
    packed, scales = mxfp4.quantize(w)
    assert scales[0, 0] == 127
    dec, _ = mxfp4.decode(packed, scales)
    expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert list(dec[0, :8]) == expected
    assert list(dec[0, 8:16]) == [-v for v in expected]
    # column 8 is -6 (code 15); column 9 is -0.25, which rounds to zero: stored +0 (code 0)
    assert (packed[0, 4] & 0x0F) == 7 | 8 and (packed[0, 4] >> 4) == 0


def test_quantize_packs_low_nibble_even_column() -> None:
    w = np.zeros((1, 32))
    w[0, 0], w[0, 1] = 6.0, -0.5          # codes 7 and 9 at scale 2^0
    packed, scales = mxfp4.quantize(w)
    assert scales[0, 0] == 127 and packed[0, 0] == (7 | (9 << 4))


def test_quantize_round_trip_random() -> None:
    rng = np.random.default_rng(1234)
    w = rng.normal(0.0, 1.2, size=(48, 128))
    w[3, 32:64] = 0.0                                   # one all-zero group
    w[5, :32] *= 1e-30                                  # a tiny but representable group
    packed, scales = mxfp4.quantize(w)
    assert packed.shape == (48, 64) and scales.shape == (48, 4)
    assert packed.dtype == np.uint8 and scales.dtype == np.uint8
    assert not np.any(scales == 255)
    dec, nan_groups = mxfp4.decode(packed, scales)
    assert nan_groups == 0

    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    for r in range(w.shape[0]):
        for g in range(4):
            cols = slice(32 * g, 32 * g + 32)
            amax = np.abs(w[r, cols]).max()
            scale = 2.0 ** (int(scales[r, g]) - 127)
            if amax == 0:
                assert np.all(dec[r, cols] == 0)
                continue
            assert 3.0 < amax / scale <= 6.0                   # scale rule, unclamped
            assert np.any(dec[r, cols] != 0), "amax > 0 must not give an all-zero group"
            for c in range(32 * g, 32 * g + 32):
                m = abs(w[r, c]) / scale
                got = abs(dec[r, c]) / scale
                assert got == _brute_force_nearest(m)
                # within half of the local code step
                hi = np.searchsorted(grid, m)
                lo_v, hi_v = grid[max(hi - 1, 0)], grid[min(hi, 7)]
                assert abs(got - m) <= (hi_v - lo_v) / 2
                if got != 0:
                    assert np.sign(dec[r, c]) == np.sign(w[r, c])


def test_quantize_then_decode_is_idempotent_on_grid_values() -> None:
    # values already on the grid (at their own scale) survive unchanged
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 16, size=(8, 64))
    codes[:, ::32] = 7                                 # amax = 6 * scale in every group
    exps = rng.integers(-20, 20, size=(8, 2))
    w = mxfp4.E2M1[codes] * np.repeat(2.0 ** exps, 32, axis=1)
    packed, scales = mxfp4.quantize(w)
    dec, _ = mxfp4.decode(packed, scales)
    assert np.array_equal(dec, w)
    assert np.array_equal(scales.astype(int) - 127, exps)
