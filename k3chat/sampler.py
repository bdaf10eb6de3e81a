"""Sampler (spec k3-chat.md section 4): greedy by default; temperature, top-p, top-k, seed.

Reproducible per (seed, turn): a fresh PCG32 generator per assistant turn, seeded through
splitmix64 exactly as the peer engine does, with all arithmetic mod 2^64.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
GOLDEN = 0x9E3779B97F4A7C15
PCG_MULT = 6364136223846793005


class SamplerError(ValueError):
    """An invalid sampler setting, or logits the sampler cannot use (a NaN is an engine fault)."""


# ---------------------------------------------------------------------------------------
# RNG


def splitmix64_next(x: int) -> tuple[int, int]:
    """One splitmix64 step: (advanced state, output)."""
    x = (x + GOLDEN) & MASK64
    z = x
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return x, z


def splitmix64(x: int) -> int:
    return splitmix64_next(x & MASK64)[1]


class Pcg32:
    """PCG32 (XSH-RR), seeded as the reference pcg32_srandom(init, seq)."""

    def __init__(self, init: int, seq: int) -> None:
        self.inc = ((seq << 1) | 1) & MASK64
        self.state = 0
        self.next_u32()
        self.state = (self.state + init) & MASK64
        self.next_u32()

    def next_u32(self) -> int:
        old = self.state
        self.state = (old * PCG_MULT + self.inc) & MASK64
        xorshifted = (((old >> 18) ^ old) >> 27) & MASK32
        rot = old >> 59
        return ((xorshifted >> rot) | (xorshifted << ((-rot) & 31))) & MASK32

    def uniform(self) -> float:
        """U in [0, 1) from 53 bits: a (first call) high, b (second call) low."""
        a = self.next_u32()
        b = self.next_u32()
        return ((a << 21) | (b & 0x1FFFFF)) * 2.0**-53


class TurnRng(Pcg32):
    """The generator of one assistant turn: seed XOR turn*golden, then two splitmix64 draws."""

    def __init__(self, seed: int, turn: int) -> None:
        x = (seed ^ (turn * GOLDEN)) & MASK64
        x, init = splitmix64_next(x)
        x, seq = splitmix64_next(x)
        super().__init__(init, seq)


# ---------------------------------------------------------------------------------------
# Settings


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplerSettings:
    """Validated when built; greedy ignores the other fields."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if not _is_real(t) or not math.isfinite(t) or t <= 0:
            raise SamplerError(f"temperature must be finite and > 0, got {t!r}")
        if not _is_real(p) or not (0 < p <= 1):  # a NaN fails the comparison too
            raise SamplerError(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplerError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _is_int(self.seed) or not 0 <= self.seed <= MASK64:
            raise SamplerError(f"seed must be an unsigned 64-bit integer, got {self.seed!r}")

    @classmethod
    def from_options(
        cls,
        *,
        sample: bool | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> SamplerSettings:
        """Peer rule: setting T, top-p, top-k or seed implies sampling unless sample=False.

        A missing seed is drawn at random (the caller shows and stores it).
        """
        implied = any(v is not None for v in (temperature, top_p, top_k, seed))
        return cls(
            greedy=not (sample if sample is not None else implied),
            temperature=1.0 if temperature is None else temperature,
            top_p=0.95 if top_p is None else top_p,
            top_k=0 if top_k is None else top_k,
            seed=secrets.randbits(64) if seed is None else seed,
        )


# ---------------------------------------------------------------------------------------
# Sampling


def _as_logits(logits: npt.ArrayLike) -> npt.NDArray[np.float32]:
    arr = np.asarray(logits, dtype=np.float32).reshape(-1)
    if arr.size == 0:
        raise SamplerError("empty logits")
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:  # NaN or +-Inf: an overflow upstream, never a token to sample
        raise SamplerError(f"non-finite logit ({float(arr[bad[0]])}) at id {int(bad[0])} (engine fault)")
    return arr


def argmax_first(logits: npt.NDArray[np.float32]) -> int:
    """The first maximum (ties to the lower id); np.argmax returns the first occurrence."""
    return int(np.argmax(logits))


class Sampler:
    """One assistant turn's sampler: settings plus a fresh generator for (seed, turn)."""

    def __init__(self, settings: SamplerSettings, turn: int) -> None:
        if not _is_int(turn) or turn < 0:
            raise SamplerError(f"turn must be an integer >= 0, got {turn!r}")
        self.settings = settings
        self.turn = turn
        self.rng = TurnRng(settings.seed, turn)

    def sample(self, logits: npt.ArrayLike) -> int:
        arr = _as_logits(logits)
        if self.settings.greedy:
            return argmax_first(arr)  # no RNG use
        return self._sample(arr)

    def _sample(self, logits: npt.NDArray[np.float32]) -> int:
        s = self.settings
        n = logits.size
        l64 = logits.astype(np.float64)
        t = float(s.temperature)
        # Step 1, in the peer's order: l_i/T - l_max/T, then exp, in float64.
        with np.errstate(invalid="ignore", over="ignore"):  # inf logits: step 2 handles them
            p = np.exp(l64 / t - float(l64.max()) / t)
        total = float(np.cumsum(p)[-1])  # sequential sum, as the peer adds
        if not math.isfinite(total) or not total > 0:
            return argmax_first(logits)  # step 2: no draw
        p = p / total
        order = np.argsort(-p, kind="stable")  # step 3: p descending, ties to the lower id
        if 0 < s.top_k < n:
            order = order[: s.top_k]  # step 4
        kept_p = p[order]
        cum = np.cumsum(kept_p)  # sequential left-to-right sums
        before = np.concatenate(([0.0], cum[:-1]))
        n_keep = int(np.count_nonzero(before < s.top_p))  # step 5: mass before adding < top_p
        order, kept_p, cum = order[:n_keep], kept_p[:n_keep], cum[:n_keep]
        u = self.rng.uniform()  # step 6
        hits = np.flatnonzero(u * cum[-1] < cum)
        if hits.size:
            return int(order[hits[0]])
        positive = np.flatnonzero(kept_p > 0)
        return int(order[positive[-1]]) if positive.size else int(order[-1])
