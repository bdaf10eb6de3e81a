"""Kernel-level checks: MXFP4 and BF16 products against float64 references, and the
portable and SIMD (AVX2, NEON) paths bit-identical on awkward inputs (extreme scales, -0 codes,
scale 255, row counts that are not multiples of the SIMD row block)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from k3engine import mxfp4
from k3engine._k3 import ffi, lib


def mx_matmul(packed: np.ndarray, scales: np.ndarray, x: np.ndarray, simd: int, threads: int = 1) -> tuple[np.ndarray, int]:
    rows, cols = packed.shape[0], packed.shape[1] * 2
    ntok = x.shape[0]
    y = np.empty((ntok, rows), dtype=np.float32)
    p, s, xx = (np.ascontiguousarray(a) for a in (packed, scales, x.astype(np.float32)))
    nan = lib.k3_kernel_mxfp4(ffi.from_buffer("uint8_t[]", p), ffi.from_buffer("uint8_t[]", s), rows, cols,
                              ffi.from_buffer("float[]", xx), ntok, ffi.from_buffer("float[]", y), simd, threads)
    assert nan >= 0
    return y, int(nan)


def awkward(rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    packed[0, :4] = 0x88  # -0 codes in both nibbles
    scales = rng.integers(100, 140, (rows, cols // 32), dtype=np.uint8)
    scales[0, 0], scales[1 % rows, -1] = 0, 1   # subnormal scales, never flushed
    scales[2 % rows, 0] = 252  # 6 * 2^125: the largest group that stays inside fp32
    scales[3 % rows, 1 % (cols // 32)] = 255     # NaN scale: a zero group, counted
    return packed, scales


@pytest.mark.parametrize("rows,cols,ntok", [(7, 64, 1), (13, 96, 1), (9, 64, 3), (64, 3584, 1), (5, 32, 2)])
def test_mxfp4_matches_float64_reference(rows: int, cols: int, ntok: int) -> None:
    packed, scales = awkward(rows, cols, rows * cols)
    x = np.random.default_rng(1).standard_normal((ntok, cols)).astype(np.float32)
    x[:, :32] *= 1e-30  # meets row 2's 2^125 group without leaving fp32
    w, nan_ref = mxfp4.decode(packed, scales)
    ref = x.astype(np.float64) @ w.T
    got, nan = mx_matmul(packed, scales, x, simd=0)
    assert nan_ref == 1 and nan == nan_ref  # one scale-255 group, counted once per row decode
    assert np.allclose(got, ref, rtol=1e-5, atol=1e-30 + 1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("rows,cols,ntok", [(7, 64, 1), (13, 96, 1), (9, 64, 3), (64, 3584, 1), (3, 3584, 4)])
@pytest.mark.parametrize("threads", [1, 2])
def test_mxfp4_simd_equals_scalar_bits(rows: int, cols: int, ntok: int, threads: int) -> None:
    if ffi.string(lib.k3_simd_kind()) == b"none":
        pytest.skip("no AVX2 or NEON here: only the portable kernel exists")
    packed, scales = awkward(rows, cols, 7 + rows)
    x = np.random.default_rng(2).standard_normal((ntok, cols)).astype(np.float32)
    x[:, :32] *= 1e-30
    x[:, :5] = [0.0, -0.0, 1e-38, -3e-8, 2.0]
    a, _ = mx_matmul(packed, scales, x, simd=0, threads=1)
    b, _ = mx_matmul(packed, scales, x, simd=1, threads=threads)
    assert a.tobytes() == b.tobytes()


def test_bf16_simd_equals_scalar_bits_and_reference() -> None:
    rng = np.random.default_rng(3)
    rows, cols, ntok = 11, 203, 3  # a tail after the 8-lane blocks
    wf32 = (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-20, 20, (rows, cols)))).astype(np.float32)
    w16 = (wf32.view(np.uint32) >> 16).astype(np.uint16)  # truncated to BF16, any exponent
    x = rng.standard_normal((ntok, cols)).astype(np.float32)
    out = []
    for simd in (0, 1):
        y = np.empty((ntok, rows), dtype=np.float32)
        assert lib.k3_kernel_bf16(ffi.from_buffer("uint16_t[]", w16), rows, cols, ffi.from_buffer("float[]", x),
                                  ntok, ffi.from_buffer("float[]", y), simd, 1) == 0
        out.append(y)
    wf = (w16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    ref = x.astype(np.float64) @ wf.T
    assert np.allclose(out[0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    if ffi.string(lib.k3_simd_kind()) != b"none":
        assert out[0].tobytes() == out[1].tobytes()


from reference import REFERENCE

REAL_SAMPLE = REFERENCE / "mxfp4-layer1-expert0-w1.json"


@pytest.fixture(scope="module")
def real_sample() -> dict:
    import json
    return json.loads(REAL_SAMPLE.read_text())


def _arr(d: dict, dtype: type) -> np.ndarray:
    return np.array(d["data"], dtype=dtype).reshape(d["shape"])


def test_engine_decodes_real_k3_bytes_exactly(real_sample: dict) -> None:
    packed, scales = _arr(real_sample["packed"], np.uint8), _arr(real_sample["scales"], np.uint8)
    expected = _arr(real_sample["expected"], np.float64).astype(np.float32)
    rows, cols = expected.shape
    out = np.empty((rows, cols), dtype=np.float32)
    assert lib.k3_kernel_mxfp4_decode(ffi.from_buffer("uint8_t[]", packed), ffi.from_buffer("uint8_t[]", scales),
                                      rows, cols, ffi.from_buffer("float[]", out)) == 0
    assert np.array_equal(out, expected)  # every value, exactly (signed zeros compare equal)
    assert float(out.astype(np.float64).sum()) == 1.9296875 and float(np.abs(out.astype(np.float64)).sum()) == 4481.0078125
    # negative control: the same bytes with their nibbles swapped decode to the file's control
    swapped = ((packed & 0x0F) << 4) | (packed >> 4)
    assert lib.k3_kernel_mxfp4_decode(ffi.from_buffer("uint8_t[]", swapped), ffi.from_buffer("uint8_t[]", scales),
                                      rows, cols, ffi.from_buffer("float[]", out)) == 0
    control = np.array(real_sample["expected_swapped_nibbles"]["first64"], dtype=np.float32)
    assert np.array_equal(out[0, :64], control) and not np.array_equal(out[0, :64], expected[0, :64])


@pytest.mark.parametrize("simd", [0, 1])
def test_engine_matvec_on_real_bytes(real_sample: dict, simd: int) -> None:
    packed, scales = _arr(real_sample["packed"], np.uint8), _arr(real_sample["scales"], np.uint8)
    cols = packed.shape[1] * 2
    x = ((np.arange(cols) % 7) - 3).astype(np.float32)[None, :]
    y, _ = mx_matmul(packed[:4], scales[:4], x, simd=simd)
    assert list(map(float, y[0])) == [3.6796875, -3.0625, -1.88671875, -0.78125]  # spec 4: exact


def _lane0_cancellation(cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Lane 0 of the 8-lane order meets 2^24, then 1, then -2^24 (elements 0, 8, 16).

    The exact sum is 1. A float32 lane rounds 2^24 + 1 back to 2^24 and returns 0; a
    double lane keeps the 1."""
    a = np.zeros(cols, dtype=np.float32)
    a[0], a[8], a[16] = 2.0 ** 24, 1.0, -(2.0 ** 24)
    return a, np.ones(cols, dtype=np.float32)


@pytest.mark.parametrize("simd", [0, 1])
def test_bf16_dot_sums_in_double(simd: int) -> None:
    w, x = _lane0_cancellation(40)
    w16 = (w.view(np.uint32) >> 16).astype(np.uint16)  # 2^24, 1 and -2^24 are exact in BF16
    y = np.empty((1, 1), dtype=np.float32)
    assert lib.k3_kernel_bf16(ffi.from_buffer("uint16_t[]", w16), 1, 40, ffi.from_buffer("float[]", x),
                              1, ffi.from_buffer("float[]", y), simd, 1) == 0
    assert float(y[0, 0]) == 1.0


@pytest.mark.parametrize("ntok", [1, 2])  # the fused one-token kernel and the decode-row path
@pytest.mark.parametrize("simd", [0, 1])
def test_mxfp4_dot_sums_in_double(simd: int, ntok: int) -> None:
    x, _ = _lane0_cancellation(64)
    packed = np.full((1, 32), 0x22, dtype=np.uint8)   # every weight is code 2 = 1.0 ...
    scales = np.full((1, 2), 127, dtype=np.uint8)     # ... times 2^0
    y, _ = mx_matmul(packed, scales, np.tile(x, (ntok, 1)), simd=simd)
    assert y.tolist() == [[1.0]] * ntok
