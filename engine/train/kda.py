"""Kimi Delta Attention recurrence in torch: the naive form and the chunked form it trains with.

Both take per-head tensors shaped [B, H, T, D]: q (L2-normalised and scaled), k
(L2-normalised), v, log_alpha = g (the log decay, per key channel, in (g_min, 0)), and beta
[B, H, T]. Per token (spec 5.4 step 6): decay the rows of S by alpha, read u = S^T k, write
S += k (beta (v - u))^T, output o = S^T q from the updated state.

Chunked form (derivation in the comments of ``chunked``): within a chunk of C tokens the
state is written S_t = Diag(gamma_t) X_t with gamma_t = exp(G_t), G the cumulative log decay
from the chunk start. X then follows an ungated delta rule whose writes solve one lower
triangular C x C system per chunk; every decay factor that appears is exp(G_t - G_j) with
j <= t (or G_C - G_j), so nothing overflows however strong the decay.
"""

from __future__ import annotations

from typing import Any

from . import require_torch

torch = require_torch()
Tensor = Any  # torch.Tensor (kept loose so this module imports without type stubs)


def naive(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
          state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token-by-token reference. Returns (o [B,H,T,Dv], final S [B,H,Dk,Dv])."""
    b, h, t_len, dk = k.shape
    dv = v.shape[-1]
    s = q.new_zeros(b, h, dk, dv) if state is None else state.clone()
    outs = []
    alpha = torch.exp(g)
    for t in range(t_len):
        s = alpha[:, :, t, :, None] * s
        u = torch.einsum("bhkv,bhk->bhv", s, k[:, :, t])
        s = s + k[:, :, t, :, None] * (beta[:, :, t, None] * (v[:, :, t] - u))[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    return torch.stack(outs, dim=2), s


def chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int = 8,
            state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The same recurrence, C tokens at a time. T is padded to a multiple of C with tokens
    that change nothing (k = 0, beta = 0, g = 0), and the padding is cut from the output.

    Decay factors exp(G_t - G_j) are split as exp(G_t) * exp(-G_j) around the chunk start;
    with g >= g_min = -5 per token the large factor stays below exp(5 C) (exp(80) at C = 16,
    inside fp32's exp(88); C = 32 overflows, tested), and every product that is used has
    j <= t, so it is at most 1."""
    b, h, t_len, dk = k.shape
    dv = v.shape[-1]
    pad = (-t_len) % chunk
    if pad:
        zpad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, pad))  # noqa: E731
        q, k, v, g = zpad(q), zpad(k), zpad(v), zpad(g)
        beta = torch.nn.functional.pad(beta, (0, pad))
    n = (t_len + pad) // chunk
    rs = lambda x: x.reshape(b, h, n, chunk, x.shape[-1])  # noqa: E731
    q, k, v, g = rs(q), rs(k), rs(v), rs(g)
    beta = beta.reshape(b, h, n, chunk, 1)

    G = torch.cumsum(g, dim=3)                                   # [b,h,n,C,dk], G_t <= 0
    up, down = torch.exp(G), torch.exp(-G)
    # With S_t = Diag(gamma_t) X_t (gamma = exp G):  X_t = X_{t-1} + a_t u_t^T with
    # a_t = k_t / gamma_t and u_t = beta_t (v_t - X_{t-1}^T b_t), b_t = k_t gamma_t.
    # Expanding X_{t-1} inside the chunk: u_t + sum_{j<t} beta_t (a_j . b_t) u_j
    # = beta_t (v_t - X_0^T b_t): a unit lower triangular system for the chunk's u.
    bg, ka, qg = k * up, k * down, q * up
    kk = bg @ ka.transpose(-1, -2)                               # [t, j] = a_j . b_t
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    tri = (beta * kk).masked_fill(~strict, 0.0) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    # u = W_v - W_b X_0 with W_v = tri^-1 (beta v), W_b = tri^-1 (beta b): one solve for both
    rhs = torch.cat([beta * v, beta * bg], dim=-1)
    w = torch.linalg.solve_triangular(tri, rhs, upper=False, unitriangular=True)
    w_v, w_b = w[..., :dv], w[..., dv:]
    # o_t = X_t^T (q_t gamma_t) = X_0^T (q_t gamma_t) + sum_{j<=t} (a_j . q_t gamma_t) u_j
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    qk = (qg @ ka.transpose(-1, -2)).masked_fill(~lower, 0.0)
    # chunk-end state: S_C = Diag(gamma_C) X_0 + sum_j (k_j gamma_C / gamma_j) u_j^T
    g_end = G[:, :, :, -1:, :]
    k_end = (k * torch.exp(g_end - G)).transpose(-1, -2)         # [b,h,n,dk,C]
    decay_end = torch.exp(g_end).transpose(-1, -2)               # [b,h,n,dk,1]

    s = q.new_zeros(b, h, dk, dv) if state is None else state
    outs = []
    for i in range(n):                                           # the only sequential part
        u = w_v[:, :, i] - w_b[:, :, i] @ s
        outs.append(qg[:, :, i] @ s + qk[:, :, i] @ u)
        s = decay_end[:, :, i] * s + k_end[:, :, i] @ u
    o = torch.stack(outs, dim=2).reshape(b, h, n * chunk, dv)
    return o[:, :, :t_len], s
