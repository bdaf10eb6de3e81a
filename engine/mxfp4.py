"""MXFP4 codec (OCP MX: E2M1 elements, E8M0 scales), spec k3-model.md sections 4 and 9.2.

Layout of one logical matrix W [R, C] (C a multiple of 32):
- ``packed`` [R, C/2] uint8: element (r, c) lives in ``packed[r][c // 2]``; the LOW nibble
  (bits 0-3) is the even column c = 2j, the HIGH nibble the odd column 2j+1.
- ``scales`` [R, C/32] uint8: one E8M0 byte s per 32 consecutive columns of a row, value
  2^(s-127). s = 255 is NaN in the MX spec; we decode that group as 32 zeros and count it.

Decoding is exact in float64 (every product E2M1 * 2^k is representable, including s = 0,
whose 2^-127 is subnormal in fp32 but normal in fp64).

Quantization (used only to build fixtures) is specified in the ``quantize`` docstring.
"""
from __future__ import annotations

import numpy as np

GROUP_SIZE = 32
NAN_SCALE = 255
SCALE_BIAS = 127

# Spec section 4 table, indexed by nibble; bit 3 is the sign (8 is -0).
E2M1: np.ndarray = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float64,
)
E2M1.setflags(write=False)

# Non-negative magnitudes of codes 0..7 and the midpoints between neighbours.
_MAGNITUDES = E2M1[:8]
_MIDPOINTS = (_MAGNITUDES[:-1] + _MAGNITUDES[1:]) / 2.0  # 0.25 0.75 1.25 1.75 2.5 3.5 5.0


def _as_u8_matrix(a: np.ndarray, what: str) -> np.ndarray:
    """Return ``a`` as a 2-D uint8 array; reject anything that is not byte data."""
    arr = np.asarray(a)
    if arr.ndim != 2:
        raise ValueError(f"mxfp4: {what} must be 2-D, got shape {arr.shape}")
    if arr.dtype == np.uint8:
        return arr
    if arr.dtype.kind in "iu" and (arr.size == 0 or (arr.min() >= 0 and arr.max() <= 255)):
        return arr.astype(np.uint8)
    raise ValueError(f"mxfp4: {what} must hold bytes (uint8), got dtype {arr.dtype}")


def check_shapes(packed_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> tuple[int, int]:
    """Validate a (packed, scales) shape pair; return the logical shape (R, C)."""
    if len(packed_shape) != 2 or len(scales_shape) != 2:
        raise ValueError(
            f"mxfp4: packed and scales must be 2-D, got {tuple(packed_shape)} and "
            f"{tuple(scales_shape)}")
    rows, packed_cols = packed_shape
    scale_rows, scale_cols = scales_shape
    if rows != scale_rows:
        raise ValueError(
            f"mxfp4: packed has {rows} rows but scales has {scale_rows}; they must be equal")
    if scale_cols * GROUP_SIZE != packed_cols * 2:
        raise ValueError(
            f"mxfp4: scale_cols*32 must equal packed_cols*2, got {scale_cols}*32 = "
            f"{scale_cols * GROUP_SIZE} vs {packed_cols}*2 = {packed_cols * 2}")
    return rows, packed_cols * 2


def decode(packed: np.ndarray, scales: np.ndarray, *,
           swap_nibbles: bool = False) -> tuple[np.ndarray, int]:
    """Decode MXFP4 bytes to float64 W [R, C]; also return the number of s = 255 groups.

    ``swap_nibbles=True`` deliberately uses the wrong nibble order (high = even column);
    it exists only as the negative control of spec section 4.
    """
    packed = _as_u8_matrix(packed, "packed")
    scales = _as_u8_matrix(scales, "scales")
    rows, cols = check_shapes(packed.shape, scales.shape)

    low = packed & 0x0F
    high = packed >> 4
    even, odd = (high, low) if swap_nibbles else (low, high)
    codes = np.empty((rows, cols), dtype=np.uint8)
    codes[:, 0::2] = even
    codes[:, 1::2] = odd
    values = E2M1[codes]

    # 2^(s-127) built by ldexp: exact, no pow() rounding, no flush to zero.
    exponents = scales.astype(np.int64) - SCALE_BIAS
    group_scale = np.ldexp(np.ones(scales.shape, dtype=np.float64), exponents)
    out = values * np.repeat(group_scale, GROUP_SIZE, axis=1)
    # s = 255 (NaN in OCP MX) decodes as 32 plain +0 values, never as 2^128 or -0.
    nan_mask = scales == NAN_SCALE
    out[np.repeat(nan_mask, GROUP_SIZE, axis=1)] = 0.0
    return out, int(nan_mask.sum())


def _scale_exponent(amax: float) -> int:
    """Smallest integer e with amax <= 6 * 2^e, i.e. ceil(log2(amax / 6)) in exact arithmetic.

    log2 gives the candidate; the loops correct it by exact comparisons (6 * 2^e is exact),
    so results at powers of two do not depend on libm rounding.
    """
    e = int(np.ceil(np.log2(amax / 6.0)))
    while np.ldexp(6.0, e) < amax:
        e += 1
    while np.ldexp(6.0, e - 1) >= amax:
        e -= 1
    return e


def _nearest_code_magnitude(m: np.ndarray) -> np.ndarray:
    """Index (0..7) of the nearest E2M1 magnitude to each m >= 0.

    Ties (m exactly on a midpoint) go to the EVEN index, i.e. round half to even on the code
    grid, as IEEE conversion does (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0,
    2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0). Magnitudes above 6 saturate to 6.
    """
    # side="left": idx counts midpoints strictly below m, so a tie lands on the lower code.
    idx = np.searchsorted(_MIDPOINTS, m, side="left")
    on_mid = (idx < len(_MIDPOINTS)) & (m == _MIDPOINTS[np.minimum(idx, len(_MIDPOINTS) - 1)])
    idx = np.where(on_mid & (idx % 2 == 1), idx + 1, idx)
    return idx.astype(np.uint8)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize W [R, C] (C a multiple of 32) to (packed [R, C/2], scales [R, C/32]) uint8.

    Per group of 32 columns of a row (spec 9.2):
    - amax = max |w|; if amax == 0 the scale byte is 127 and every code is +0;
    - s = clamp(127 + ceil(log2(amax / 6)), 1, 254), with ceil(log2) evaluated exactly, so
      amax / 2^(s-127) lies in (3, 6] unless the clamp engaged;
    - each element becomes the E2M1 code nearest to w / 2^(s-127), ties to the even code
      (see ``_nearest_code_magnitude``); |values| > 6 (only possible at s = 254) saturate;
    - a value whose magnitude rounds to 0 is stored as +0 (code 0), never -0 (code 8).
    Because amax/scale > 3 when unclamped, a group with amax > 0 never decodes to all zeros
    unless its scale was clamped at 1 (amax < 6 * 2^-127).
    """
    arr = np.asarray(w, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"mxfp4.quantize: expected a 2-D matrix, got shape {arr.shape}")
    rows, cols = arr.shape
    if cols % GROUP_SIZE != 0:
        raise ValueError(f"mxfp4.quantize: column count {cols} is not a multiple of 32")
    if not np.all(np.isfinite(arr)):
        raise ValueError("mxfp4.quantize: input contains NaN or Inf")

    groups = arr.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    amax = np.abs(groups).max(axis=2, initial=0.0)
    scales = np.full(amax.shape, SCALE_BIAS, dtype=np.int64)
    for idx in zip(*np.nonzero(amax > 0)):
        s = SCALE_BIAS + _scale_exponent(float(amax[idx]))
        scales[idx] = min(max(s, 1), 254)

    # Dividing by a power of two is exact in float64 for these ranges.
    scaled = np.ldexp(groups, -(scales - SCALE_BIAS)[:, :, None])
    mag_idx = _nearest_code_magnitude(np.abs(scaled))
    negative = (scaled < 0) & (mag_idx > 0)
    codes = (mag_idx | np.where(negative, 8, 0).astype(np.uint8)).reshape(rows, cols)

    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scales.astype(np.uint8)
