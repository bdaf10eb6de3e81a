"""The register-blocked multi-token matmuls (native/k3_kernels.c, kk_block_tok): a prefill's
result is, bit for bit, what one-token calls of the same kernel give, for every token count
(whole blocks of 4 and the rest), widths with and without an 8-lane tail and across the
512-column spans, scale-255 MXFP4 groups counted once per row, 1 and 2 threads; and it
equals the per-token path it replaced, the portable scalar path, and float64 numpy within
the kernel tests' tolerance."""
from __future__ import annotations

import numpy as np
import pytest

from k3engine import mxfp4
from k3engine._k3 import ffi, lib

NTOKS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 64]
ROWS = 37  # 4 blocks of 8 rows and 5 more; big enough that 2 threads really split the rows


def _simd_or_skip() -> None:
    if ffi.string(lib.k3_simd_kind()) == b"none":
        pytest.skip("no AVX2 or NEON on this machine: only the portable kernel exists, nothing is blocked")


def bf16_matmul(w16: np.ndarray, x: np.ndarray, *, simd: int = 1, threads: int = 1, blocked: int = 1) -> np.ndarray:
    rows, cols = w16.shape
    xx = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty((xx.shape[0], rows), dtype=np.float32)
    assert lib.k3_kernel_bf16_path(ffi.from_buffer("uint16_t[]", np.ascontiguousarray(w16)), rows, cols,
                                   ffi.from_buffer("float[]", xx), xx.shape[0], ffi.from_buffer("float[]", y),
                                   simd, threads, blocked) == 0
    return y


def mx_matmul(packed: np.ndarray, scales: np.ndarray, x: np.ndarray, *, simd: int = 1, threads: int = 1,
              blocked: int = 1) -> tuple[np.ndarray, int]:
    rows, cols = packed.shape[0], packed.shape[1] * 2
    xx = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty((xx.shape[0], rows), dtype=np.float32)
    nan = lib.k3_kernel_mxfp4_path(ffi.from_buffer("uint8_t[]", np.ascontiguousarray(packed)),
                                   ffi.from_buffer("uint8_t[]", np.ascontiguousarray(scales)), rows, cols,
                                   ffi.from_buffer("float[]", xx), xx.shape[0], ffi.from_buffer("float[]", y),
                                   simd, threads, blocked)
    assert nan >= 0
    return y, int(nan)


def wide_bf16(rows: int, cols: int, seed: int) -> np.ndarray:
    """BF16 weights over a wide exponent range: any change of summation order shows."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-20, 20, (rows, cols)))).astype(np.float32)
    return (w.view(np.uint32) >> 16).astype(np.uint16)


def wide_x(ntok: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((ntok, cols)) * np.exp(rng.uniform(-8, 8, (ntok, cols)))).astype(np.float32)
    x[:, :3] = [0.0, -0.0, 1e-38]
    return x


def mx_weights(rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Random MXFP4 bytes with -0 codes, subnormal scales and a scale-255 (NaN) group in
    several rows; returns packed, scales and how many NaN groups there are."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    packed[0, :4] = 0x88
    scales = rng.integers(100, 140, (rows, cols // 32), dtype=np.uint8)
    scales[0, 0], scales[1, -1] = 0, 1
    nan_rows = [3, 8, 20, rows - 1]
    for i, r in enumerate(nan_rows):
        scales[r, i % (cols // 32)] = 255
    return packed, scales, len(nan_rows)


def one_at_a_time(call, x: np.ndarray) -> np.ndarray:  # noqa: ANN001 - a kernel taking x [1, cols]
    return np.concatenate([call(x[t:t + 1]) for t in range(x.shape[0])])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cols", [64, 203, 1024, 1100])  # tails 0, 3, 0, 4; 1024 and 1100 cross spans
@pytest.mark.parametrize("ntok", NTOKS)
def test_bf16_blocked_equals_one_token_calls(ntok: int, cols: int, threads: int) -> None:
    _simd_or_skip()
    w16 = wide_bf16(ROWS, cols, cols)
    x = wide_x(ntok, cols, 100 + ntok)
    got = bf16_matmul(w16, x, threads=threads)
    single = one_at_a_time(lambda xt: bf16_matmul(w16, xt, threads=1), x)
    assert got.tobytes() == single.tobytes()
    assert got.tobytes() == bf16_matmul(w16, x, threads=threads, blocked=0).tobytes()  # the path it replaced
    assert got.tobytes() == bf16_matmul(w16, x, simd=0).tobytes()  # the portable kernel
    wf = (w16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    ref = x.astype(np.float64) @ wf.T
    assert np.allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cols", [96, 1056, 3584])  # 3 groups; spans 512+512+32; the real latent width
@pytest.mark.parametrize("ntok", NTOKS)
def test_mxfp4_blocked_equals_one_token_calls(ntok: int, cols: int, threads: int) -> None:
    _simd_or_skip()
    packed, scales, n_nan = mx_weights(ROWS, cols, cols)
    x = np.random.default_rng(200 + ntok).standard_normal((ntok, cols)).astype(np.float32)
    x[:, :3] = [0.0, -0.0, 1e-38]
    got, nan = mx_matmul(packed, scales, x, threads=threads)
    assert nan == n_nan  # each scale-255 group counted once per row, whatever the token count
    singles = [mx_matmul(packed, scales, x[t:t + 1]) for t in range(ntok)]
    assert got.tobytes() == np.concatenate([y for y, _ in singles]).tobytes()
    assert all(n == n_nan for _, n in singles)
    old, nan_old = mx_matmul(packed, scales, x, threads=threads, blocked=0)  # the path it replaced
    assert got.tobytes() == old.tobytes() and nan_old == n_nan
    scalar, _ = mx_matmul(packed, scales, x, simd=0)
    assert got.tobytes() == scalar.tobytes()
    w, nan_ref = mxfp4.decode(packed, scales)
    assert nan_ref == n_nan
    ref = x.astype(np.float64) @ w.T
    assert np.allclose(got, ref, rtol=1e-5, atol=1e-30 + 1e-5 * np.abs(ref).max())


def test_fma_peak_is_measured_and_refuses_bad_arguments() -> None:
    one = lib.k3_fma_peak_gflops(0.05, 1)
    assert 0.0 < one < 1e5  # a rate was measured (its size is the benchmark's business, not a test's)
    assert lib.k3_fma_peak_gflops(0.0, 1) == -1.0 and lib.k3_fma_peak_gflops(0.05, 0) == -1.0
    assert lib.k3_fma_peak_gflops(0.05, 65) == -1.0


def _per_token_matmul_madds(model_dir) -> tuple[int, int, int]:  # noqa: ANN001 - a Path
    """From the checkpoint's tensor shapes: multiply-adds of every trunk matrix a token goes
    through, the lm_head's, and one routed expert's (w1, w3, w2 at their logical widths)."""
    from k3engine.safetensors_io import open_checkpoint

    trunk = head = 0
    expert: dict[str, int] = {}  # w1, w2, w3 (every layer's experts have the same widths)
    for t in open_checkpoint(model_dir).tensors.values():
        n = t.name
        if len(t.shape) != 2 or "embed_tokens" in n or "res_proj" in n:
            continue  # a lookup, and AttnRes's dot products (not matmuls)
        if "kv_b_proj" in n:
            continue  # MLA's absorbed form applies it per head to the latent cache, not as a matmul
        rows, cols = int(t.shape[0]), int(t.shape[1])
        if ".experts." in n and n.endswith("weight_packed"):
            expert[n.split(".")[-2]] = rows * cols * 2  # packed: two 4-bit codes a byte
        elif ".experts." in n:
            continue
        elif "lm_head" in n:
            head = rows * cols
        else:
            trunk += rows * cols
    assert sorted(expert) == ["w1", "w2", "w3"]
    return trunk, head, sum(expert.values())


def test_engine_counts_the_matmul_multiply_adds_it_does(tiny_dir) -> None:  # noqa: ANN001 - a Path
    """k3_stats.matmul_madds, the numerator of `k3chat bench`'s prefill GFLOP/s: a 6-token
    feed does every trunk matrix for 6 tokens, the lm_head for the last, and each routed
    (token, expert) product's three matrices."""
    from k3engine.model import Model

    trunk, head, expert = _per_token_matmul_madds(tiny_dir)
    assert trunk > 0 and head > 0 and expert > 0
    with Model(tiny_dir) as m:
        s = m.session(16)
        try:
            before = m.stats()
            s.feed([5, 9, 2, 7, 7, 3])
            after = m.stats()
        finally:
            s.close()
    uses = after["expert_uses"] - before["expert_uses"]
    assert uses > 0
    assert after["matmul_madds"] - before["matmul_madds"] == 6 * trunk + head + uses * expert
