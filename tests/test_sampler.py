"""k3chat.sampler: spec section 4 (settings, greedy, sampling steps, splitmix64/PCG32 RNG)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from k3chat.sampler import Pcg32, Sampler, SamplerError, SamplerSettings, TurnRng, splitmix64, splitmix64_next

SAMPLE = SamplerSettings(greedy=False, temperature=0.8, top_p=0.9, top_k=50, seed=12345)


def logits(n: int = 1000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, n).astype(np.float32)


# ---------------------------------------------------------------------------------------
# RNG against independent reference values


def test_splitmix64_reference_outputs() -> None:
    # Well-known SplitMix64 first outputs (Vigna's reference generator).
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(1234567) == 6457827717110365317
    x, first = splitmix64_next(0)
    assert first == 0xE220A8397B1DCDAF and x == 0x9E3779B97F4A7C15


def test_pcg32_reference_outputs() -> None:
    # pcg32-demo: pcg32_srandom_r(&rng, 42, 54).
    rng = Pcg32(42, 54)
    assert [rng.next_u32() for _ in range(6)] == [0xA15C02B7, 0x7B47F409, 0xBA1D3330, 0x83D2F293, 0xBFA4784B, 0xCBED606E]


def test_uniform_uses_a_then_b() -> None:
    a, b = 0xA15C02B7, 0x7B47F409
    assert Pcg32(42, 54).uniform() == ((a << 21) | (b & 0x1FFFFF)) / 2**53


def test_turn_seeding() -> None:
    seed, turn = 0xDEADBEEF12345678, 7
    x = (seed ^ (turn * 0x9E3779B97F4A7C15)) % 2**64
    init = splitmix64(x)
    seq = splitmix64((x + 0x9E3779B97F4A7C15) % 2**64)  # the state advanced once
    ref, got = Pcg32(init, seq), TurnRng(seed, turn)
    assert [got.next_u32() for _ in range(8)] == [ref.next_u32() for _ in range(8)]


# ---------------------------------------------------------------------------------------
# Spec 4 tests


def test_fifty_draws_replay_per_seed_and_turn() -> None:
    lg = logits()
    first = _run(Sampler(SAMPLE, 3), lg, 50)
    assert first == _run(Sampler(SAMPLE, 3), lg, 50)
    assert len(set(first)) > 5  # really sampling
    assert first != _run(Sampler(SAMPLE, 4), lg, 50)
    other = SamplerSettings(greedy=False, temperature=0.8, top_p=0.9, top_k=50, seed=12346)
    assert first != _run(Sampler(other, 3), lg, 50)


def _run(s: Sampler, lg: np.ndarray, n: int) -> list[int]:
    return [s.sample(lg) for _ in range(n)]


def test_greedy_is_first_argmax_without_rng() -> None:
    s = Sampler(SamplerSettings(seed=99), 1)
    state = s.rng.state
    assert s.sample(np.array([1.0, 3.0, 3.0, 2.0], dtype=np.float32)) == 1  # ties to the lower id
    lg = logits()
    assert s.sample(lg) == int(np.argmax(lg))
    with pytest.raises(SamplerError, match="non-finite"):   # the engine never masks with -inf
        s.sample(np.full(5, -np.inf, dtype=np.float32))
    assert s.rng.state == state


def test_huge_negative_logit_never_wins() -> None:
    s = Sampler(SamplerSettings(greedy=False, temperature=1.0, top_p=1.0, seed=5), 1)
    lg = np.array([0.0, -1e30], dtype=np.float32)
    assert all(s.sample(lg) == 0 for _ in range(20_000))


def test_one_logit_always_wins() -> None:
    s = Sampler(SamplerSettings(greedy=False, temperature=2.0, top_p=1.0, seed=6), 2)
    assert all(s.sample(np.array([0.5], dtype=np.float32)) == 0 for _ in range(200))
    lg = np.zeros(100, dtype=np.float32)
    lg[42] = 1000.0
    assert all(s.sample(lg) == 42 for _ in range(200))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": math.nan}, {"top_p": -0.1},
        {"temperature": 0.0}, {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -1.0},
        {"top_k": -1}, {"top_k": 1.5}, {"top_k": True},
        {"seed": -1}, {"seed": 2**64}, {"seed": 1.0},
    ],
)
def test_settings_refused(kwargs: dict) -> None:
    with pytest.raises(SamplerError):
        SamplerSettings(greedy=False, **kwargs)


def test_bad_logits_refused() -> None:
    for settings in (SamplerSettings(), SAMPLE):
        s = Sampler(settings, 1)
        with pytest.raises(SamplerError, match="empty"):
            s.sample(np.array([], dtype=np.float32))
        for bad in (np.nan, np.inf, -np.inf):  # an overflow upstream, never a token
            with pytest.raises(SamplerError, match="non-finite logit .* at id 1"):
                s.sample(np.array([0.0, bad], dtype=np.float32))


# ---------------------------------------------------------------------------------------
# Sampling steps


def test_distribution_follows_probabilities() -> None:
    p = np.array([0.5, 0.3, 0.2])
    s = Sampler(SamplerSettings(greedy=False, temperature=1.0, top_p=1.0, seed=1), 1)
    counts = np.bincount(_run(s, np.log(p).astype(np.float32), 6000), minlength=3) / 6000
    assert np.all(np.abs(counts - p) < 0.03), counts


def test_nucleus_includes_the_crossing_token() -> None:
    lg = np.log(np.array([0.2, 0.5, 0.3])).astype(np.float32)
    s = Sampler(SamplerSettings(greedy=False, temperature=1.0, top_p=0.6, seed=2), 1)
    draws = np.array(_run(s, lg, 4000))
    assert set(draws.tolist()) == {1, 2}  # 0.5 < 0.6, so 0.3 is added; 0.8 >= 0.6 stops before 0.2
    assert abs(np.mean(draws == 1) - 0.5 / 0.8) < 0.03  # drawn within the kept mass
    s = Sampler(SamplerSettings(greedy=False, temperature=1.0, top_p=0.5, seed=2), 1)
    assert set(_run(s, lg, 500)) == {1}
    # Exact halves: the mass before the second id is exactly 0.5, which is not < 0.5.
    exact = np.zeros(2, dtype=np.float32)
    assert set(_run(s, exact, 500)) == {0}
    s = Sampler(SamplerSettings(greedy=False, temperature=1.0, top_p=0.5000001, seed=2), 1)
    assert set(_run(s, exact, 500)) == {0, 1}


def test_top_k_and_ties_to_lower_id() -> None:
    lg = np.array([1.0, 2.0, 2.0, 2.0, 0.0], dtype=np.float32)
    s = Sampler(SamplerSettings(greedy=False, temperature=1.0, top_p=1.0, top_k=2, seed=3), 1)
    assert set(_run(s, lg, 1000)) == {1, 2}  # among equal p, the lower ids are kept
    s = Sampler(SamplerSettings(greedy=False, temperature=1.0, top_p=1.0, top_k=1, seed=3), 1)
    assert set(_run(s, lg, 100)) == {1}
    s = Sampler(SamplerSettings(greedy=False, temperature=1.0, top_p=1.0, top_k=99, seed=3), 1)
    assert set(_run(s, lg, 3000)) == {0, 1, 2, 3, 4}  # k >= vocab acts as off


def test_temperature_sharpens() -> None:
    lg = np.log(np.array([0.6, 0.4])).astype(np.float32)
    s = Sampler(SamplerSettings(greedy=False, temperature=0.25, top_p=1.0, seed=4), 1)
    # p ∝ (0.6, 0.4)^4 = 0.835 / 0.165
    share = np.mean(np.array(_run(s, lg, 4000)) == 0)
    assert abs(share - 0.6**4 / (0.6**4 + 0.4**4)) < 0.03


def test_infinite_logit_is_refused_without_a_draw() -> None:
    s = Sampler(SAMPLE, 1)
    state = s.rng.state
    with pytest.raises(SamplerError, match="non-finite"):
        s.sample(np.array([0.0, np.inf, 1.0], dtype=np.float32))
    assert s.rng.state == state
    s.sample(logits())
    assert s.rng.state != state  # a real draw advances the generator


def test_from_options_implies_sampling() -> None:
    assert SamplerSettings.from_options().greedy
    assert not SamplerSettings.from_options(temperature=0.7).greedy
    assert not SamplerSettings.from_options(seed=1).greedy
    assert SamplerSettings.from_options(seed=1, sample=False).greedy
    assert 0 <= SamplerSettings.from_options().seed < 2**64
    with pytest.raises(SamplerError):
        SamplerSettings.from_options(top_p=0.0)
