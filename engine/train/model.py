"""The K3 forward pass in torch: a second implementation, batched and differentiable.

Written from spec k3-model.md section 5, like the numpy oracle, but for training: tokens
come in as [B, T], Kimi Delta Attention runs in its chunked form (``kda.chunked``), MLA in its
expanded form with a causal mask, and the routed experts as one gather per expert. Weights
live under their checkpoint names, so loading a checkpoint and exporting one are name for
name; the routed experts of a layer are held stacked ([n_e, rows, cols]) under the training
name ``...experts.w1`` and split per expert on export.

Two switches matter:
- ``quantize=True`` (training): every BF16-stored matrix passes through a BF16 rounding and
  every expert matrix through MXFP4 fake quantization, both with straight-through
  gradients, so the model trained is the model exported (quantization-aware training).
- ``quantize=False`` (loaded checkpoints): the weights already hold the stored values.

And one for speed: ``compiled=True`` (``train-demo --compile``) runs the elementwise-heavy
pieces through ``torch.compile`` (``Kernels``); the eager pieces stay the reference.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np

from k3engine.fixture import LM, Preset, trunk_entries

from . import kda, require_torch

torch = require_torch()
nn = torch.nn
F = torch.nn.functional
Tensor = Any

LM_HEAD = "language_model.lm_head.weight"
ATTN_RES_EPS = 1e-5
FIXED_EPS = 1e-5          # o_norm, routed_expert_norm (spec 5.2)
MLA_NORM_EPS = 1e-6
L2_EPS = 1e-6
EXPERT_PARTS = ("w1", "w2", "w3")  # gate [I_e, l], down [l, I_e], up [I_e, l]


# ----------------------------------------------------------------------------- pieces


def rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def situ(g: Tensor, v: Tensor, b1: float, b2: float) -> Tensor:
    """SiTU-GLU (spec 5.7): the sigmoid takes the uncapped gate."""
    return (b1 * torch.tanh(g / b1) * torch.sigmoid(g)) * (b2 * torch.tanh(v / b2))


def glu(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, b1: float, b2: float) -> Tensor:
    return situ(x @ w_gate.T, x @ w_up.T, b1, b2) @ w_down.T


def attn_res(sources: list[Tensor], w_norm: Tensor, w_proj: Tensor) -> Tensor:
    """Block AttnRes (spec 5.3): softmax over RMS-normalised keys, sum of the raw sources."""
    v = torch.stack(sources, dim=0)                               # [S, B, T, E]
    u = w_norm.reshape(-1) * w_proj.reshape(-1)
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + ATTN_RES_EPS)
    p = torch.softmax(keys @ u, dim=0)                            # [S, B, T]
    return (p[..., None] * v).sum(0)


def causal_conv_silu(x: Tensor, w: Tensor, history: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv, w [P, 1, K] with w[:, 0, K-1] on the newest input, then SiLU.
    ``history`` [B, K-1, P] holds the pre-conv inputs before x (zeros at the start); returns
    (output, the new history)."""
    k = w.shape[-1]
    if history is None:
        history = x.new_zeros(x.shape[0], k - 1, x.shape[2])
    full = torch.cat([history, x], dim=1)
    y = F.conv1d(full.transpose(1, 2), w, groups=w.shape[0])
    return F.silu(y.transpose(1, 2)), full[:, full.shape[1] - (k - 1):]


def bf16_ste(w: Tensor) -> Tensor:
    """The value w takes once stored as BF16 (nearest even), with an identity gradient."""
    return w + (w.to(torch.bfloat16).to(w.dtype) - w).detach()


_E2M1_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def mxfp4_values(w: Tensor) -> Tensor:
    """What ``k3engine.mxfp4.quantize`` then ``decode`` give, in torch (no gradient).

    Groups of 32 along the last (input) axis; scale 2^(s-127) with s = clamp(127 +
    ceil(log2(amax/6)), 1, 254) taken exactly; nearest E2M1 code, ties to the even code."""
    with torch.no_grad():
        shape = w.shape
        grp = w.reshape(*shape[:-1], shape[-1] // 32, 32).to(torch.float64)
        amax = grp.abs().amax(-1)
        safe = torch.where(amax > 0, amax, torch.ones_like(amax))
        e = torch.ceil(torch.log2(safe / 6.0))
        e = torch.where(torch.ldexp(torch.full_like(e, 6.0), e) < safe, e + 1, e)
        e = torch.where(torch.ldexp(torch.full_like(e, 6.0), e - 1) >= safe, e - 1, e)
        s = torch.where(amax > 0, (127 + e).clamp(1, 254), torch.full_like(e, 127))
        scale = torch.ldexp(torch.ones_like(s), s - 127)[..., None]
        scaled = grp / scale
        mids = torch.tensor(_MIDPOINTS, dtype=torch.float64, device=w.device)
        mags = torch.tensor(_E2M1_MAGS, dtype=torch.float64, device=w.device)
        m = scaled.abs()
        idx = torch.bucketize(m, mids, right=False)
        on_mid = (idx < len(_MIDPOINTS)) & (m == mids[idx.clamp(max=len(_MIDPOINTS) - 1)])
        idx = torch.where(on_mid & (idx % 2 == 1), idx + 1, idx)
        out = torch.sign(scaled) * mags[idx] * scale
        return out.reshape(shape).to(w.dtype)


def mxfp4_ste(w: Tensor) -> Tensor:
    return w + (mxfp4_values(w) - w).detach()


class Kernels:
    """Pieces of the forward pass, eager (the reference) or each passed through
    ``torch.compile``, which fuses their elementwise work into one loop: on 2 cores the eager
    forward and backward spend more time moving [B, T, E] tensors through memory than
    multiplying matrices, most of it in Block AttnRes and the norms. (Compiling KDA's chunk
    terms measured slower, and whole sublayers break up on the routing's data-dependent
    shapes and recompile per layer.) Compiled, the model is the same function up to
    rounding, so a run trained with it is another model than the eager run of its seed."""

    # A compiled piece gets one graph per variant its guards tell apart (how many AttnRes
    # sources, contiguous or strided input, grad or no grad), and a training step meets more of
    # them than dynamo's default limit of 8: past it, a piece silently runs eager for every new
    # variant (train-demo with --copy-mix hit it for attn_res and rmsnorm in its first steps).
    RECOMPILE_LIMIT = 64

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled
        if compiled:
            import torch._dynamo

            cfg = torch._dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, self.RECOMPILE_LIMIT)
        wrap = (lambda f: torch.compile(f, dynamic=True)) if compiled else (lambda f: f)  # noqa: E731
        self.rmsnorm = wrap(rmsnorm)
        self.situ = wrap(situ)
        self.glu = wrap(glu)
        self.attn_res = wrap(attn_res)

    def attention(self, q: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float) -> Tensor:
        """Causal attention. Compiled, the values are padded with zeros to the key width when
        they are narrower, which lets torch take its fused (flash) CPU kernel instead of
        writing out every [T, T] score; the padding columns are cut off again."""
        dv, dk = value.shape[-1], key.shape[-1]
        if self.compiled and mask is None and dv < dk:
            padded = F.pad(value, (0, dk - dv))
            return F.scaled_dot_product_attention(q, key, padded, is_causal=True, scale=scale)[..., :dv]
        return F.scaled_dot_product_attention(q, key, value, attn_mask=mask, is_causal=mask is None,
                                              scale=scale)


# ----------------------------------------------------------------------------- model


class K3Torch(nn.Module):
    """A K3-shaped model with the dimensions of a fixture Preset."""

    def __init__(self, p: Preset, vocab_size: int, *, seed: int = 0, dtype: Any = None,
                 tie_embeddings: bool = False, compiled: bool = False) -> None:
        super().__init__()
        self.p = p
        self.k = Kernels(compiled)
        self.vocab_size = vocab_size
        self.quantize = True
        self.chunk = 16         # fewest sequential steps whose decay factors fit float32 (kda.chunked)
        self.names: list[str] = []          # checkpoint names, in file order
        self.storage: dict[str, str] = {}   # name -> "bf16" | "f32" | "mxfp4"
        self._params = nn.ParameterDict()
        gen = torch.Generator().manual_seed(seed)
        dtype = dtype or torch.float32
        E = p.hidden_size
        depth_std = 0.02 / math.sqrt(2 * p.num_hidden_layers)

        def add(name: str, shape: tuple[int, ...], storage: str, init: str) -> None:
            t = torch.empty(shape, dtype=dtype)
            if init == "normal":
                t.normal_(0.0, 0.02, generator=gen)
            elif init == "out":
                t.normal_(0.0, depth_std, generator=gen)
            elif init == "one":
                t.fill_(1.0)
            elif init == "zero":
                t.zero_()
            elif init == "conv":          # near identity: the newest tap 1, the others small
                t.normal_(0.0, 0.1, generator=gen)
                t[..., -1] += 1.0
            elif init == "dt":            # decays spread from slow (0.99) to fast
                t.uniform_(-7.0, -1.0, generator=gen)
            else:
                raise ValueError(init)
            self._params[name.replace(".", "__")] = nn.Parameter(t)
            self.names.append(name)
            self.storage[name] = storage

        add(LM + "embed_tokens.weight", (vocab_size, E), "bf16", "normal")
        add(LM_HEAD, (vocab_size, E), "bf16", "normal")
        if tie_embeddings:
            # Trained as one matrix, still stored (and exported) as the two tensors K3 has
            # (tie_word_embeddings stays false): a token's way in and way out are then the same
            # vector, so a circuit that copies a token from the context to the output, learnt
            # on the frequent ids, serves a rare id too instead of being learnt id by id.
            self._params[LM_HEAD.replace(".", "__")] = self._params[(LM + "embed_tokens.weight").replace(".", "__")]
        add(LM + "norm.weight", (E,), "bf16", "one")
        add(LM + "output_attn_res_norm.weight", (E,), "bf16", "one")
        add(LM + "output_attn_res_proj.weight", (1, E), "bf16", "zero")
        for layer in range(p.num_hidden_layers):
            base = f"{LM}layers.{layer}."
            for e in trunk_entries(p, layer):
                add(base + e.suffix, e.shape, e.storage, _init_rule(e.suffix))
            if p.is_moe(layer):
                n, lat, ie = p.num_experts, p.routed_expert_hidden_size, p.moe_intermediate_size
                shapes = {"w1": (n, ie, lat), "w2": (n, lat, ie), "w3": (n, ie, lat)}
                for part in EXPERT_PARTS:
                    add(f"{base}block_sparse_moe.experts.{part}", shapes[part], "mxfp4",
                        "out" if part == "w2" else "normal")
        # A_log: the first H entries used, the padding exactly zero (kept zero: no grad)
        self._a_log_mask = {}
        for layer in range(p.num_hidden_layers):
            if not p.is_mla(layer):
                name = f"{LM}layers.{layer}.self_attn.A_log"
                with torch.no_grad():
                    self.w(name).zero_()
                mask = torch.zeros(p.kda_head_dim, dtype=dtype)
                mask[: p.kda_heads] = 1.0
                self._a_log_mask[name] = mask

    # ---- weights ----------------------------------------------------------------
    def w(self, name: str) -> Tensor:
        return self._params[name.replace(".", "__")]

    def weight(self, name: str) -> Tensor:
        """A weight as the forward pass sees it (stored-value rounding when quantizing)."""
        t = self.w(name)
        if name in self._a_log_mask:
            t = t * self._a_log_mask[name]
        if not self.quantize:
            return t
        kind = self.storage[name]
        if kind == "bf16":
            return bf16_ste(t)
        if kind == "mxfp4":
            return mxfp4_ste(t)
        return t

    def named_weights(self) -> Iterable[tuple[str, Tensor]]:
        for name in self.names:
            yield name, self.w(name)

    def router_bias_names(self) -> list[str]:
        return [n for n in self.names if n.endswith("gate.e_score_correction_bias")]

    # ---- sublayers ----------------------------------------------------------------
    def _kda(self, layer: int, x: Tensor, cache: dict | None = None) -> Tensor:
        p = self.p
        w = lambda s: self.weight(f"{LM}layers.{layer}.self_attn.{s}")  # noqa: E731
        b, t, _ = x.shape
        H, D = p.kda_heads, p.kda_head_dim
        heads = lambda y: y.reshape(b, t, H, D).transpose(1, 2)          # noqa: E731 [b,H,t,D]
        st = cache.setdefault(layer, {}) if cache is not None else {}
        conv = {}
        for name in "qkv":
            conv[name], hist = causal_conv_silu(x @ w(f"{name}_proj.weight").T, w(f"{name}_conv1d.weight"),
                                                st.get(name))
            if cache is not None:
                st[name] = hist
        q, k, v = heads(conv["q"]), heads(conv["k"]), heads(conv["v"])
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + L2_EPS) * D ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + L2_EPS)
        beta = torch.sigmoid(x @ w("b_proj.weight").T).transpose(1, 2)   # [b,H,t]
        z = (x @ w("f_a_proj.weight").T) @ w("f_b_proj.weight").T + w("dt_bias").reshape(-1)
        a = torch.exp(w("A_log").reshape(-1)[:H])[None, :, None, None]
        g = p.gate_lower_bound * torch.sigmoid(a * heads(z))               # log alpha
        o, state = kda.chunked(q, k, v, g, beta, chunk=self.chunk, state=st.get("S"))
        if cache is not None:
            st["S"] = state
        gate = torch.sigmoid(heads(x @ w("g_proj.weight").T))
        y = self.k.rmsnorm(o, w("o_norm.weight").reshape(-1), FIXED_EPS) * gate
        return y.transpose(1, 2).reshape(b, t, H * D) @ w("o_proj.weight").T

    def _mla(self, layer: int, x: Tensor, cache: dict | None = None) -> Tensor:
        p = self.p
        w = lambda s: self.weight(f"{LM}layers.{layer}.self_attn.{s}")  # noqa: E731
        b, t, _ = x.shape
        H, dn, dr, dv = p.mla_heads, p.qk_nope_head_dim, p.qk_rope_head_dim, p.v_head_dim
        q = self.k.rmsnorm(x @ w("q_a_proj.weight").T, w("q_a_layernorm.weight"), MLA_NORM_EPS)
        q = (q @ w("q_b_proj.weight").T).reshape(b, t, H, dn + dr).transpose(1, 2)
        c = x @ w("kv_a_proj_with_mqa.weight").T
        c_hat = self.k.rmsnorm(c[..., : p.kv_lora_rank], w("kv_a_layernorm.weight"), MLA_NORM_EPS)
        k_rope = c[..., p.kv_lora_rank: p.kv_lora_rank + dr]
        kv = (c_hat @ w("kv_b_proj.weight").T).reshape(b, t, H, dn + dv).transpose(1, 2)
        key = torch.cat([kv[..., :dn], k_rope[:, None].expand(b, H, t, dr)], dim=-1)
        value = kv[..., dn:]
        mask = None
        if cache is not None:                       # keys and values of earlier positions
            st = cache.setdefault(layer, {})
            if "key" in st:
                key = torch.cat([st["key"], key], dim=2)
                value = torch.cat([st["value"], value], dim=2)
            st["key"], st["value"] = key, value
            past = key.shape[2] - t
            mask = torch.ones(t, key.shape[2], dtype=torch.bool).tril(past)
        o = self.k.attention(q, key, value, mask, (dn + dr) ** -0.5)
        gate = torch.sigmoid(x @ w("g_proj.weight").T)
        return (gate * o.transpose(1, 2).reshape(b, t, H * dv)) @ w("o_proj.weight").T

    def _moe(self, layer: int, x: Tensor, loads: list[Tensor] | None) -> Tensor:
        p = self.p
        m = lambda s: self.weight(f"{LM}layers.{layer}.block_sparse_moe.{s}")  # noqa: E731
        b, t, E = x.shape
        xf = x.reshape(b * t, E)
        s = torch.sigmoid(xf @ m("gate.weight").T)                       # [N, n_e]
        bias = m("gate.e_score_correction_bias").reshape(-1)
        sel = torch.topk((s + bias).detach(), p.num_experts_per_token, dim=-1).indices
        wts = torch.gather(s, 1, sel)
        if p.num_experts_per_token > 1 and p.moe_renormalize:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * p.routed_scaling_factor
        if loads is not None:
            loads.append(torch.bincount(sel.reshape(-1), minlength=p.num_experts).detach())
        z = xf @ m("routed_expert_down_proj.weight").T                   # [N, l]
        w1, w2, w3 = (m(f"experts.{part}") for part in EXPERT_PARTS)
        unsorted = self._experts(z, sel, w1, w2, w3)
        u = (unsorted.reshape(b * t, p.num_experts_per_token, -1) * wts[..., None]).sum(1)
        r = self.k.rmsnorm(u, m("routed_expert_norm.weight"), FIXED_EPS) @ m("routed_expert_up_proj.weight").T
        sh = self.k.glu(xf, m("shared_experts.gate_proj.weight"), m("shared_experts.up_proj.weight"),
                        m("shared_experts.down_proj.weight"), p.situ_beta, p.situ_linear_beta)
        return (r + sh).reshape(b, t, E)

    def _experts(self, z: Tensor, sel: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
        """Each (token, slot) pair through its expert: [N * k, l] in the order of ``sel``,
        as one contiguous slice of pairs per expert (its size depends on the routing)."""
        p = self.p
        flat = sel.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=p.num_experts).tolist()
        zs = z[order // p.num_experts_per_token]
        outs, start = [], 0
        for e, c in enumerate(counts):
            if c:
                ze = zs[start:start + c]
                outs.append(self.k.situ(ze @ w1[e].T, ze @ w3[e].T, p.situ_beta, p.situ_linear_beta) @ w2[e].T)
            start += c
        h = torch.cat(outs, dim=0)
        return torch.empty_like(h).index_copy(0, order, h)

    def _dense(self, layer: int, x: Tensor) -> Tensor:
        w = lambda s: self.weight(f"{LM}layers.{layer}.mlp.{s}")  # noqa: E731
        return self.k.glu(x, w("gate_proj.weight"), w("up_proj.weight"), w("down_proj.weight"),
                          self.p.situ_beta, self.p.situ_linear_beta)

    # ---- the whole model ------------------------------------------------------------
    def forward(self, ids: Tensor, loads: list[Tensor] | None = None, cache: dict | None = None,
                rows: Tensor | None = None) -> Tensor:
        """Logits [B, T, V] for ids [B, T]: from a fresh state, or after what ``cache`` holds
        (a dict this call fills: KDA state and conv history, MLA keys and values), which is
        how greedy decoding runs one token at a time. ``loads`` collects the routed expert
        counts of every MoE layer (for the bias balancing of the trainer). With ``rows`` (a
        [B, T] bool mask) only those positions get logits, [N, V]: the trainer scores about
        half the positions, and the vocabulary projection is a large share of a step."""
        p = self.p
        r = lambda layer, s: self.weight(f"{LM}layers.{layer}.{s}")  # noqa: E731
        h = F.embedding(ids, self.weight(LM + "embed_tokens.weight"))
        blocks: list[Tensor] = []
        for layer in range(p.num_hidden_layers):
            prefix: Tensor | None = h
            x = h if not blocks else self.k.attn_res(blocks + [h], r(layer, "self_attention_res_norm.weight"),
                                              r(layer, "self_attention_res_proj.weight"))
            if layer % p.attn_res_block_size == 0:
                blocks.append(h)
                prefix = None
            xn = self.k.rmsnorm(x, r(layer, "input_layernorm.weight"), p.rms_norm_eps)
            a = self._mla(layer, xn, cache) if p.is_mla(layer) else self._kda(layer, xn, cache)
            prefix = a if prefix is None else prefix + a
            x = self.k.attn_res(blocks + [prefix], r(layer, "mlp_res_norm.weight"), r(layer, "mlp_res_proj.weight"))
            xn = self.k.rmsnorm(x, r(layer, "post_attention_layernorm.weight"), p.rms_norm_eps)
            m = self._moe(layer, xn, loads) if p.is_moe(layer) else self._dense(layer, xn)
            h = prefix + m
        if rows is not None:                  # everything below is per position
            blocks, h = [blk[rows] for blk in blocks], h[rows]
        h = self.k.attn_res(blocks + [h], self.weight(LM + "output_attn_res_norm.weight"),
                     self.weight(LM + "output_attn_res_proj.weight"))
        h = self.k.rmsnorm(h, self.weight(LM + "norm.weight"), p.rms_norm_eps)
        return h @ self.weight(LM_HEAD).T

    # ---- checkpoints --------------------------------------------------------------
    @torch.no_grad()
    def load_checkpoint(self, model_dir: Any) -> None:
        """Take every weight from a checkpoint directory (experts decoded from MXFP4)."""
        from k3engine import mxfp4
        from k3engine.oracle import Checkpoint

        ck = Checkpoint(model_dir)
        for name in self.names:
            if self.storage[name] == "mxfp4":
                base = name.rsplit(".", 1)[0]               # ...block_sparse_moe.experts
                part = name.rsplit(".", 1)[1]
                mats = []
                for e in range(self.p.num_experts):
                    w, _ = mxfp4.decode(ck.tensor(f"{base}.{e}.{part}.weight_packed"),
                                        ck.tensor(f"{base}.{e}.{part}.weight_scale"))
                    mats.append(w)
                value = np.stack(mats)
            else:
                value = ck.tensor(name)
            target = self.w(name)
            target.copy_(torch.from_numpy(np.asarray(value)).to(target.dtype).reshape(target.shape))


def _init_rule(suffix: str) -> str:
    if suffix.endswith(("layernorm.weight", "_norm.weight", "o_norm.weight")) or suffix.endswith("norm.weight"):
        return "one"
    if suffix.endswith("res_proj.weight") or suffix.endswith("e_score_correction_bias"):
        return "zero"
    if suffix.endswith("conv1d.weight"):
        return "conv"
    if suffix.endswith("dt_bias"):
        return "dt"
    if suffix.endswith("A_log"):
        return "zero"
    if suffix.endswith("routed_expert_down_proj.weight"):
        return "normal"
    if suffix.endswith(("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")):
        return "out"
    return "normal"
