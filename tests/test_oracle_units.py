"""Unit gates for the float64 oracle (spec k3-model.md sections 2, 5 and 9.3).

Expected values come from the spec's own numbers or from independent formulations written
here (closed forms, explicit loops, np.convolve, struct-level float decoding), never from
the code under test.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from k3engine import oracle as orc

from reference import REFERENCE as REAL_CONFIG_DIR


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ============================================================== SiTU (spec 5.7)

# tolerance: half a unit in the last digit the spec prints
@pytest.mark.parametrize("g, v, correct, half_ulp", [
    (10.0, 50.0, 95.1080215, 5e-8),
    (-10.0, 50.0, -0.00431790, 5e-9),
    (3.0, -30.0, -50.4383095, 5e-8),
])
def test_situ_reference_values(g: float, v: float, correct: float, half_ulp: float) -> None:
    got = float(orc.situ(np.array(g), np.array(v), 4.0, 25.0))
    assert abs(got - correct) <= half_ulp


@pytest.mark.parametrize("g, v, wrong", [(10.0, 50.0, 93.3093199), (-10.0, 50.0, -1.80301958)])
def test_situ_wrong_variant_differs(g: float, v: float, wrong: float) -> None:
    # The wrong variant applies the sigmoid to the capped gate; check that is what the spec's
    # "wrong" column means, then that the oracle is far from it.
    capped = 4.0 * math.tanh(g / 4.0)
    wrong_here = capped * _sig(capped) * 25.0 * math.tanh(v / 25.0)
    assert wrong_here == pytest.approx(wrong, rel=1e-7)
    got = float(orc.situ(np.array(g), np.array(v), 4.0, 25.0))
    assert abs(got - wrong) > 1.0


def test_situ_is_bounded_and_elementwise() -> None:
    g = np.linspace(-200, 200, 101)
    v = np.linspace(300, -300, 101)
    out = orc.situ(g, v, 4.0, 25.0)
    assert out.shape == g.shape and np.all(np.abs(out) < 100)
    assert out[3] == orc.situ(np.array(g[3]), np.array(v[3]), 4.0, 25.0)


def test_sigmoid_extremes_are_finite() -> None:
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        s = orc.sigmoid(np.array([-1000.0, 0.0, 1000.0]))
    assert list(s) == [0.0, 0.5, 1.0]


# ============================================================== RMSNorm / L2 norm (5.2, 9.3)

def test_rmsnorm_eps_values_from_spec() -> None:
    x = np.array([1e-3, -2e-3, 3e-3, 0.0])
    ones = np.ones(4)
    inv_1e6 = orc.rmsnorm(x, ones, 1e-6)[:3] / x[:3]
    inv_1e5 = orc.rmsnorm(x, ones, 1e-5)[:3] / x[:3]
    assert np.allclose(inv_1e6, 471.4045, rtol=0, atol=1e-4)
    assert np.allclose(inv_1e5, 272.1655, rtol=0, atol=1e-4)
    # eps outside the root would give 1/(sqrt(3.5e-6) + 1e-6) = 534.4..., not the spec value
    assert abs(inv_1e6[0] - 1.0 / (math.sqrt(3.5e-6) + 1e-6)) > 1.0


def test_rmsnorm_applies_weight_and_uses_own_width() -> None:
    x = np.array([[3.0, 4.0], [0.0, 2.0]])
    w = np.array([2.0, -1.0])
    out = orc.rmsnorm(x, w, 0.0)
    assert np.allclose(out[0], [2 * 3 / math.sqrt(12.5), -4 / math.sqrt(12.5)])
    assert np.allclose(out[1], [0.0, -2 / math.sqrt(2.0)])


def test_l2norm_eps_on_sum_of_squares() -> None:
    x = np.array([3e-4, 4e-4])                     # sum of squares 2.5e-7
    out = orc.l2norm(x)
    assert np.allclose(out, x / math.sqrt(2.5e-7 + 1e-6), rtol=1e-14)
    # not the mean: mean + eps would be 1.125e-6
    assert not np.allclose(out, x / math.sqrt(1.25e-7 + 1e-6), rtol=1e-3)


# ============================================================== AttnRes (5.3)

def test_attn_res_averages_raw_sources() -> None:
    rng = np.random.default_rng(0)
    v1 = 1e3 * rng.normal(size=16)       # large, so the 1e-5 in the key norm is negligible
    v0 = 3.0 * v1                        # same direction: (almost) equal keys and scores
    out = orc.attn_res([v0, v1], rng.normal(size=16), rng.normal(size=(1, 16)))
    assert np.allclose(out, (v0 + v1) / 2, rtol=1e-9)
    # averaging the normalized keys instead would be ~ v1 / rms(v1), far from this
    key = v1 / np.sqrt(np.mean(v1 ** 2) + 1e-5)
    assert not np.allclose(out, key, rtol=1e-2)


def test_attn_res_explicit_scores() -> None:
    sources = [np.array([2.0, 0.0, 0.0]), np.array([0.0, -1.0, 1.0]), np.array([1.0, 1.0, 1.0])]
    w_norm = np.array([1.5, 0.0, 2.0])
    w_proj = np.array([[2.0, 7.0, -1.0]])          # stored [1, E]
    u = [1.5 * 2.0, 0.0 * 7.0, 2.0 * -1.0]          # folded score vector
    z = []
    for v in sources:
        rms = math.sqrt(sum(c * c for c in v) / 3 + 1e-5)
        z.append(sum((c / rms) * uu for c, uu in zip(v, u)))
    m = max(z)
    e = [math.exp(zz - m) for zz in z]
    p = [ee / sum(e) for ee in e]
    expected = sum(pp * v for pp, v in zip(p, sources))
    out = orc.attn_res(sources, w_norm, w_proj)
    assert np.allclose(out, expected, rtol=1e-13, atol=1e-15)


def test_attn_res_per_token_rows_are_independent() -> None:
    rng = np.random.default_rng(1)
    srcs = [rng.normal(size=(5, 8)) for _ in range(4)]
    w_n, w_p = rng.normal(size=8), rng.normal(size=(1, 8))
    batched = orc.attn_res(srcs, w_n, w_p)
    for t in range(5):
        assert np.allclose(batched[t], orc.attn_res([s[t] for s in srcs], w_n, w_p), rtol=1e-13)


# ============================================================== Router (5.6, 9.3)

def test_router_exact_tie_picks_lower_index() -> None:
    w_r = np.array([[0.1], [0.9], [0.2], [0.9], [0.5]])
    experts, _ = orc.route(np.array([1.0]), w_r, np.zeros(5), 1, True, 1.0)
    assert experts == [1]
    experts, weights = orc.route(np.array([1.0]), w_r, np.zeros(5), 2, True, 1.0)
    assert experts == [1, 3]
    assert weights[0] == weights[1] == pytest.approx(0.5)


def test_router_order_is_biased_score_desc_then_index() -> None:
    w_r = np.array([[0.0], [1.0], [2.0], [1.0]])
    bias = np.array([0.0, 0.2, -0.5, 0.2])
    # biased: s(0)+0 = .5, s(1)+.2 = .931, s(2)-.5 = .381, s(3)+.2 = .931
    experts, _ = orc.route(np.array([1.0]), w_r, bias, 4, True, 1.0)
    assert experts == [1, 3, 0, 2]


def test_router_bias_changes_selection_not_weights() -> None:
    x = np.array([1.0])
    w_r = np.array([[2.0], [1.0], [0.5], [-1.0]])
    s = [_sig(2.0), _sig(1.0), _sig(0.5), _sig(-1.0)]

    experts, weights = orc.route(x, w_r, np.zeros(4), 2, True, 1.0)
    assert experts == [0, 1]
    assert np.allclose(weights, [s[0] / (s[0] + s[1]), s[1] / (s[0] + s[1])], rtol=1e-14)

    experts, weights = orc.route(x, w_r, np.array([0.0, 0.0, 0.5, 0.0]), 2, True, 1.0)
    assert experts == [2, 0]                       # the bias changed the set
    assert np.allclose(weights, [s[2] / (s[2] + s[0]), s[0] / (s[2] + s[0])], rtol=1e-14)

    # a bias that keeps the set leaves the weights bit-identical
    _, w_plain = orc.route(x, w_r, np.zeros(4), 2, True, 1.0)
    _, w_biased = orc.route(x, w_r, np.array([0.01, 0.0, 0.0, 0.0]), 2, True, 1.0)
    assert np.array_equal(w_plain, w_biased)


def test_router_weights_sum_to_one_and_scaling() -> None:
    rng = np.random.default_rng(2)
    w_r = rng.normal(size=(64, 16))
    bias = rng.normal(scale=0.1, size=64)
    for _ in range(20):
        x = rng.normal(size=16)
        experts, weights = orc.route(x, w_r, bias, 8, True, 1.0)
        assert len(experts) == 8 == len(set(experts))
        assert abs(weights.sum() - 1.0) <= 1e-6
        _, scaled = orc.route(x, w_r, bias, 8, True, 2.5)
        assert np.allclose(scaled, 2.5 * weights, rtol=1e-15)
        # sigmoid scores, not a softmax: without renormalization weights are sigma(logit)
        experts_raw, raw = orc.route(x, w_r, bias, 8, False, 1.0)
        assert np.allclose(raw, [_sig(float(w_r[e] @ x)) for e in experts_raw], rtol=1e-14)


# ============================================================== KDA (5.4)

def test_causal_conv_impulse_response_and_silu() -> None:
    # impulse at t = 0 in every channel: y_t = SiLU(w[K-1-t]) since w[K-1] meets the newest input
    taps = np.array([[[0.3, -0.7, 1.1, 2.0]], [[-1.0, 0.5, 0.25, -0.4]]])  # [P=2, 1, K=4]
    x = np.zeros((6, 2))
    x[0] = 1.0
    y = orc.causal_conv_silu(x, taps)
    for c in range(2):
        for t in range(6):
            pre = taps[c, 0, 3 - t] if t < 4 else 0.0
            assert y[t, c] == pytest.approx(pre * _sig(pre), rel=1e-14, abs=1e-300)


def test_causal_conv_matches_np_convolve() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(9, 5))
    taps = rng.normal(size=(5, 1, 4))
    y = orc.causal_conv_silu(x, taps)
    for c in range(5):
        pre = np.convolve(x[:, c], taps[c, 0, ::-1])[:9]
        assert np.allclose(y[:, c], pre / (1 + np.exp(-pre)), rtol=1e-13)


def test_kda_decay_per_head_a_log() -> None:
    # H = 2, D = 3, A_log padded to D entries: only the first H are used
    a_log = np.array([0.0, math.log(2.0), 99.0])
    z = np.array([[0.0, 1.0, -2.0, 0.0, 1.0, -2.0]])
    alpha = orc.kda_decay(z, a_log, -5.0, 2, 3)
    assert alpha.shape == (1, 2, 3)
    for h, a in enumerate([1.0, 2.0]):
        for d, zz in enumerate([0.0, 1.0, -2.0]):
            assert alpha[0, h, d] == pytest.approx(math.exp(-5.0 * _sig(a * zz)), rel=1e-14)
    assert alpha[0, 0, 0] == pytest.approx(math.exp(-2.5), rel=1e-14)
    assert np.all((alpha > math.exp(-5.0)) & (alpha < 1.0))


def _closed_form_kda(q, k, v, alpha, beta):
    """TR eq. 1 with explicit matrices: S_t = (I - b k k^T) Diag(a) S_{t-1} + b k v^T."""
    t_len, heads, dim = q.shape
    outs = np.zeros((t_len, heads, v.shape[2]))
    states = []
    for h in range(heads):
        s = np.zeros((dim, v.shape[2]))
        for t in range(t_len):
            kk = k[t, h][:, None]
            s = (np.eye(dim) - beta[t, h] * kk @ kk.T) @ np.diag(alpha[t, h]) @ s \
                + beta[t, h] * kk @ v[t, h][None, :]
            outs[t, h] = s.T @ q[t, h]
        states.append(s)
    return outs, np.stack(states)


def test_kda_recurrence_matches_closed_form() -> None:
    rng = np.random.default_rng(4)
    t_len, heads, dim = 6, 3, 5
    q = rng.normal(size=(t_len, heads, dim))
    k = rng.normal(size=(t_len, heads, dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(t_len, heads, dim))
    alpha = rng.uniform(0.01, 1.0, size=(t_len, heads, dim))
    beta = rng.uniform(0.0, 1.0, size=(t_len, heads))
    out, state = orc.kda_recurrence(q, k, v, alpha, beta)
    ref_out, ref_state = _closed_form_kda(q, k, v, alpha, beta)
    assert np.allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    assert np.allclose(state, ref_state, rtol=1e-12, atol=1e-13)
    # output must come from the UPDATED state: the first output is beta (k . q) v
    assert np.allclose(out[0], beta[0][:, None] * np.sum(k[0] * q[0], -1)[:, None] * v[0])


def test_kda_layer_against_independent_formulation() -> None:
    rng = np.random.default_rng(5)
    t_len, e, heads, dim, kern, rank = 5, 10, 2, 4, 3, 4
    p = heads * dim
    w = dict(
        w_q=rng.normal(size=(p, e)), w_k=rng.normal(size=(p, e)), w_v=rng.normal(size=(p, e)),
        conv_q=rng.normal(size=(p, 1, kern)), conv_k=rng.normal(size=(p, 1, kern)),
        conv_v=rng.normal(size=(p, 1, kern)), w_fa=rng.normal(size=(rank, e)),
        w_fb=rng.normal(size=(p, rank)),
        a_log=np.concatenate([[-0.4, 1.2], np.zeros(dim - heads)]),
        dt_bias=rng.normal(size=p), w_b=rng.normal(size=(heads, e)),
        w_g=rng.normal(size=(p, e)), o_norm=1 + 0.1 * rng.normal(size=dim),
        w_o=rng.normal(size=(e, p)),
    )
    x = rng.normal(size=(t_len, e))
    got = orc.kda_layer(x, num_heads=heads, head_dim=dim, g_min=-5.0, **w)

    def conv(name_w, name_c):
        pre_all = x @ w[name_w].T
        out = np.zeros_like(pre_all)
        for c in range(p):
            pre = np.convolve(pre_all[:, c], w[name_c][c, 0, ::-1])[:t_len]
            out[:, c] = pre / (1 + np.exp(-pre))
        return out.reshape(t_len, heads, dim)

    q, k, v = conv("w_q", "conv_q"), conv("w_k", "conv_k"), conv("w_v", "conv_v")
    q = q / np.sqrt((q ** 2).sum(-1, keepdims=True) + 1e-6) / math.sqrt(dim)
    k = k / np.sqrt((k ** 2).sum(-1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-(x @ w["w_b"].T)))
    z = (w["w_fb"] @ (w["w_fa"] @ x.T)).T + w["dt_bias"]
    alpha = np.zeros((t_len, heads, dim))
    for t in range(t_len):
        for h in range(heads):
            for d in range(dim):
                alpha[t, h, d] = math.exp(-5.0 * _sig(math.exp(w["a_log"][h]) * z[t, h * dim + d]))
    o, _ = _closed_form_kda(q, k, v, alpha, beta)
    gate = 1 / (1 + np.exp(-(x @ w["w_g"].T)))
    y = np.zeros((t_len, p))
    for t in range(t_len):
        for h in range(heads):
            oh = o[t, h]
            normed = w["o_norm"] * oh / math.sqrt(np.mean(oh ** 2) + 1e-5)
            y[t, h * dim:(h + 1) * dim] = normed * gate[t, h * dim:(h + 1) * dim]
    expected = y @ w["w_o"].T
    assert np.allclose(got, expected, rtol=1e-10, atol=1e-12)


# ============================================================== MLA (5.5, 9.3)

def _random_mla(rng, e=12, heads=3, d_n=5, d_r=3, d_v=4, r_q=7, r_kv=6):
    dims = orc.MlaDims(num_heads=heads, qk_nope_head_dim=d_n, qk_rope_head_dim=d_r,
                       v_head_dim=d_v, kv_lora_rank=r_kv)
    w = dict(
        w_qa=rng.normal(size=(r_q, e)), q_a_norm=1 + 0.1 * rng.normal(size=r_q),
        w_qb=rng.normal(size=(heads * (d_n + d_r), r_q)),
        w_kva=rng.normal(size=(r_kv + d_r, e)), kv_a_norm=1 + 0.1 * rng.normal(size=r_kv),
        w_kvb=rng.normal(size=(heads * (d_n + d_v), r_kv)),
        w_g=rng.normal(size=(heads * d_v, e)), w_o=rng.normal(size=(e, heads * d_v)),
    )
    return dims, w


def test_mla_absorbed_matches_expanded() -> None:
    rng = np.random.default_rng(6)
    dims, w = _random_mla(rng)
    x = rng.normal(size=(7, 12))
    a = orc.mla_layer_expanded(x, dims=dims, **w)
    b = orc.mla_layer_absorbed(x, dims=dims, **w)
    rel = np.max(np.abs(a - b)) / np.max(np.abs(a))
    assert rel <= 1e-5
    assert rel <= 1e-12            # float64: the forms differ only by summation order


def test_mla_against_explicit_per_head_loops() -> None:
    rng = np.random.default_rng(7)
    dims, w = _random_mla(rng)
    t_len, heads, d_n, d_r, d_v, r_kv = 4, 3, 5, 3, 4, 6
    x = rng.normal(size=(t_len, 12))

    def rms(vec, g, eps):
        return g * vec / math.sqrt(np.mean(vec ** 2) + eps)

    expected = np.zeros((t_len, 12))
    for t in range(t_len):
        q_all = w["w_qb"] @ rms(w["w_qa"] @ x[t], w["q_a_norm"], 1e-6)
        concat = np.zeros(heads * d_v)
        for h in range(heads):
            q_h = q_all[h * (d_n + d_r):(h + 1) * (d_n + d_r)]
            scores, values = [], []
            for s in range(t + 1):
                c = w["w_kva"] @ x[s]
                c_hat = rms(c[:r_kv], w["kv_a_norm"], 1e-6)
                kv = w["w_kvb"] @ c_hat
                base = h * (d_n + d_v)
                key = np.concatenate([kv[base:base + d_n], c[r_kv:]])   # shared rope slot
                values.append(kv[base + d_n:base + d_n + d_v])
                scores.append(float(q_h @ key) / math.sqrt(d_n + d_r))
            m = max(scores)
            p = [math.exp(sc - m) for sc in scores]
            concat[h * d_v:(h + 1) * d_v] = sum(pp * vv for pp, vv in zip(p, values)) / sum(p)
        gate = 1 / (1 + np.exp(-(w["w_g"] @ x[t])))
        expected[t] = w["w_o"] @ (gate * concat)
    for fn in (orc.mla_layer_expanded, orc.mla_layer_absorbed):
        assert np.allclose(fn(x, dims=dims, **w), expected, rtol=1e-10, atol=1e-12)


def test_mla_is_causal() -> None:
    rng = np.random.default_rng(8)
    dims, w = _random_mla(rng)
    x = rng.normal(size=(5, 12))
    x2 = x.copy()
    x2[4] += 1.0
    for fn in (orc.mla_layer_expanded, orc.mla_layer_absorbed):
        a, b = fn(x, dims=dims, **w), fn(x2, dims=dims, **w)
        assert np.allclose(a[:4], b[:4], rtol=1e-13) and not np.allclose(a[4], b[4])


def _eps_probe_mla():
    """E = 8, H = 1: x = [a (4) | c (4)]; q_nope = RMSNorm(a), c_lat = c, v = c_hat[:2]."""
    dims = orc.MlaDims(num_heads=1, qk_nope_head_dim=4, qk_rope_head_dim=1, v_head_dim=2,
                       kv_lora_rank=4)
    w_qa = np.zeros((4, 8)); w_qa[:, :4] = np.eye(4)
    w_qb = np.zeros((5, 4)); w_qb[:4] = np.eye(4)
    w_kva = np.zeros((5, 8)); w_kva[:4, 4:] = np.eye(4)
    w_kvb = np.zeros((6, 4)); w_kvb[:4] = np.eye(4); w_kvb[4, 0] = 1; w_kvb[5, 2] = 1
    w_o = np.zeros((8, 2)); w_o[:2] = np.eye(2)
    w = dict(w_qa=w_qa, q_a_norm=np.ones(4), w_qb=w_qb, w_kva=w_kva, kv_a_norm=np.ones(4),
             w_kvb=w_kvb, w_g=np.zeros((2, 8)), w_o=w_o)
    return dims, w


def test_mla_kv_a_norm_uses_eps_1e6() -> None:
    dims, w = _eps_probe_mla()
    tiny = np.array([1e-3, -2e-3, 3e-3, 0.0])
    x = np.concatenate([np.ones(4), tiny])[None, :]
    for fn in (orc.mla_layer_expanded, orc.mla_layer_absorbed):
        y = fn(x, dims=dims, **w)
        # one token: o = v = c_hat[[0, 2]], gate sigma(0) = 1/2
        c_hat = y[0, :2] / 0.5
        assert np.allclose(c_hat / tiny[[0, 2]], 471.4045, rtol=0, atol=1e-4)


def test_mla_q_a_norm_uses_eps_1e6() -> None:
    dims, w = _eps_probe_mla()
    a = np.array([1e-3, -2e-3, 3e-3, 0.0])
    c0, c1 = np.array([1.0, 0.0, 0.0, 0.0]), np.array([0.0, 0.0, 1.0, 0.0])
    x = np.stack([np.concatenate([a, c0]), np.concatenate([a, c1])])

    def expected_row1(inv_rms_q: float) -> np.ndarray:
        c_hat0 = c0 / math.sqrt(0.25 + 1e-6)
        c_hat1 = c1 / math.sqrt(0.25 + 1e-6)
        q = a * inv_rms_q
        s0, s1 = q @ c_hat0 / math.sqrt(5), q @ c_hat1 / math.sqrt(5)
        p0 = 1 / (1 + math.exp(s1 - s0))
        o = p0 * c_hat0[[0, 2]] + (1 - p0) * c_hat1[[0, 2]]
        return 0.5 * o

    right, wrong = expected_row1(471.4045), expected_row1(272.1655)
    assert np.max(np.abs(right - wrong)) > 1e-2
    for fn in (orc.mla_layer_expanded, orc.mla_layer_absorbed):
        y = fn(x, dims=dims, **w)
        assert np.allclose(y[1, :2], right, rtol=1e-6, atol=0)


# ============================================================== MoE and GLU (5.6-5.8)

def test_moe_layer_against_explicit_composition() -> None:
    rng = np.random.default_rng(9)
    e, n_e, k, lat, i_e, i_s = 6, 5, 2, 8, 4, 6
    experts = {j: (rng.normal(size=(i_e, lat)) * 3, rng.normal(size=(lat, i_e)),
                   rng.normal(size=(i_e, lat)) * 3) for j in range(n_e)}
    w = dict(w_r=rng.normal(size=(n_e, e)), bias=np.linspace(-0.15, 0.15, n_e),
             w_down=rng.normal(size=(lat, e)), w_up=rng.normal(size=(e, lat)),
             routed_norm=1 + 0.1 * rng.normal(size=lat),
             shared_gate=rng.normal(size=(i_s, e)) * 3, shared_up=rng.normal(size=(i_s, e)) * 30,
             shared_down=rng.normal(size=(e, i_s)))
    x = rng.normal(size=(6, e))
    stats = orc.ForwardStats()
    got = orc.moe_layer(x, k=k, renormalize=True, scaling=1.0, expert=lambda j: experts[j],
                        beta1=4.0, beta2=25.0, stats=stats, **w)

    def situ(g, v):
        return 4 * np.tanh(g / 4) / (1 + np.exp(-g)) * 25 * np.tanh(v / 25)

    changed = False
    max_g = max_v = 0.0
    for t in range(x.shape[0]):
        s = 1 / (1 + np.exp(-(w["w_r"] @ x[t])))
        biased = s + w["bias"]
        order = sorted(range(n_e), key=lambda j: (-biased[j], j))[:k]
        changed |= set(order) != set(sorted(range(n_e), key=lambda j: (-s[j], j))[:k])
        weights = s[order] / (s[order].sum() + 1e-20)
        z = w["w_down"] @ x[t]
        u = np.zeros(lat)
        for j, wt in zip(order, weights):
            w1, w2, w3 = experts[j]
            g, v = w1 @ z, w3 @ z
            max_g, max_v = max(max_g, np.abs(g).max()), max(max_v, np.abs(v).max())
            u += wt * (w2 @ situ(g, v))
        r = w["w_up"] @ (w["routed_norm"] * u / math.sqrt(np.mean(u ** 2) + 1e-5))
        g, v = w["shared_gate"] @ x[t], w["shared_up"] @ x[t]
        max_g, max_v = max(max_g, np.abs(g).max()), max(max_v, np.abs(v).max())
        sh = w["shared_down"] @ situ(g, v)
        assert np.allclose(got[t], r + sh, rtol=1e-11, atol=1e-12)
    assert stats.bias_changed_selection == changed
    assert stats.max_abs_gate == pytest.approx(max_g) and stats.max_abs_up == pytest.approx(max_v)
    assert max_g > 4 and max_v > 25   # the probe engages both caps


def test_glu_mlp_gate_is_first_argument() -> None:
    # SiTU is asymmetric, so swapping gate and up must change the output
    x = np.array([[1.0, -2.0]])
    a, b, d = np.array([[3.0, 1.0]]), np.array([[-1.0, 4.0]]), np.array([[1.0]])
    out = orc.glu_mlp(x, a, b, d, 4.0, 25.0)
    g, v = 1.0, -9.0
    expected = 4 * math.tanh(g / 4) * _sig(g) * 25 * math.tanh(v / 25)
    assert out[0, 0] == pytest.approx(expected, rel=1e-14)
    assert abs(orc.glu_mlp(x, b, a, d, 4.0, 25.0)[0, 0] - expected) > 0.1


# ============================================================== config and checkpoint reading

def test_read_real_config_layer_lists_are_one_based() -> None:
    if not (REAL_CONFIG_DIR / "config.json").exists():
        pytest.skip("real config not available")
    cfg = orc.read_config(REAL_CONFIG_DIR)
    expected_mla = set(range(3, 88, 4)) | {91, 92}
    assert cfg.mla_layers == expected_mla and len(cfg.mla_layers) == 24
    assert cfg.kda_layers == set(range(93)) - expected_mla and 0 in cfg.kda_layers
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (7168, 93, 163840)
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size) == (96, 128, 4)
    assert (cfg.situ_beta1, cfg.situ_beta2, cfg.gate_lower_bound) == (4.0, 25.0, -5.0)
    assert (cfg.num_experts, cfg.num_experts_per_token, cfg.attn_res_block_size) == (896, 16, 12)
    assert not cfg.is_moe(0) and all(cfg.is_moe(layer) for layer in range(1, 93))


def test_read_config_names_every_missing_field(tmp_path: Path) -> None:
    if not (REAL_CONFIG_DIR / "config.json").exists():
        pytest.skip("real config not available")
    root = json.loads((REAL_CONFIG_DIR / "config.json").read_text())
    del root["text_config"]["kv_lora_rank"]
    del root["text_config"]["activation_situ_beta"]
    del root["text_config"]["linear_attn_config"]["gate_lower_bound"]
    (tmp_path / "config.json").write_text(json.dumps(root))
    with pytest.raises(orc.OracleError) as info:
        orc.read_config(tmp_path)
    for name in ("kv_lora_rank", "activation_situ_beta", "gate_lower_bound"):
        assert name in str(info.value)


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Hand-rolled writer (independent of the reader): name -> (dtype, shape, raw bytes)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_checkpoint_widens_exactly_and_follows_the_index(tmp_path: Path) -> None:
    bf16_bits = [0x3F80, 0xC040, 0x0001, 0x7F7F, 0x8000, 0x3EAA]
    bf16_expected = [struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bf16_bits]
    assert bf16_expected[:2] == [1.0, -3.0] and bf16_expected[2] == 2.0 ** -133
    f16 = np.array([0.1, -65504.0, 2.0 ** -24], dtype="<f2")
    f32 = np.array([[0.1, 3.4e38], [-1e-45, 7.0]], dtype="<f4")
    u8 = np.array([[0, 7, 255]], dtype=np.uint8)
    _write_safetensors(tmp_path / "a.safetensors", {
        "m.bf16": ("BF16", [2, 3], struct.pack("<6H", *bf16_bits)),
        "m.f16": ("F16", [3], f16.tobytes()),
    })
    _write_safetensors(tmp_path / "b.safetensors", {
        "m.f32": ("F32", [2, 2], f32.tobytes()),
        "m.u8": ("U8", [1, 3], u8.tobytes()),
    })
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {}, "weight_map": {"m.bf16": "a.safetensors", "m.f16": "a.safetensors",
                                       "m.f32": "b.safetensors", "m.u8": "b.safetensors",
                                       "m.lost": "b.safetensors"}}))
    ckpt = orc.Checkpoint(tmp_path)
    got = ckpt.tensor("m.bf16")
    assert got.dtype == np.float64 and got.shape == (2, 3)
    assert got.reshape(-1).tolist() == bf16_expected
    assert np.signbit(got.reshape(-1)[4])
    assert ckpt.tensor("m.f16").tolist() == [float(v) for v in f16]
    assert ckpt.tensor("m.f32").tolist() == [[float(v) for v in row] for row in f32]
    u = ckpt.tensor("m.u8")
    assert u.dtype == np.uint8 and u.tolist() == [[0, 7, 255]]
    with pytest.raises(orc.OracleError, match="m.missing"):
        ckpt.tensor("m.missing")
    with pytest.raises(orc.OracleError, match="m.lost"):
        ckpt.tensor("m.lost")     # assigned by the index, absent from the shard header


def test_checkpoint_single_file_without_index(tmp_path: Path) -> None:
    _write_safetensors(tmp_path / "model.safetensors", {
        "only": ("F32", [2], np.array([1.5, -2.5], dtype="<f4").tobytes())})
    ckpt = orc.Checkpoint(tmp_path)
    assert ckpt.tensor("only").tolist() == [1.5, -2.5]
    with pytest.raises(orc.OracleError, match="other"):
        ckpt.tensor("other")


def test_checkpoint_refuses_an_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(orc.OracleError):
        orc.Checkpoint(tmp_path)
