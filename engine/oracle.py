"""Float64 numpy oracle for the Kimi K3 text model (spec k3-model.md, section 5).

Written to be read side by side with the spec: one function per spec subsection, float64
throughout, a naive per-token KDA recurrence, no caches or fused kernels. It shares no code
with the C engine or with the checkpoint validator; it reads the checkpoint and config.json
itself and assumes they are valid (it still names any tensor it cannot find).

Weight convention: a matrix stored [out, in] acts as y = W x, so with row vectors x [T, in]
we compute x @ W.T.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import mxfp4

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"

# Fixed epsilons written as constants in the spec (5.2-5.6); only the pre-norms and the
# final norm take `rms_norm_eps` from the config.
ATTN_RES_EPS = 1e-5
ROUTED_NORM_EPS = 1e-5
KDA_O_NORM_EPS = 1e-5
MLA_NORM_EPS = 1e-6
L2NORM_EPS = 1e-6
ROUTER_RENORM_EPS = 1e-20


class OracleError(Exception):
    """Raised for checkpoint or config problems the oracle cannot work around."""


# --------------------------------------------------------------------------------------
# config.json (spec section 2)
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class OracleConfig:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    # KDA (text_config.linear_attn_config)
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel_size: int
    gate_lower_bound: float
    kda_layers: frozenset[int]  # zero-based
    mla_layers: frozenset[int]  # zero-based
    # MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE / FFN
    num_experts: int
    num_experts_per_token: int
    routed_expert_hidden_size: int
    moe_intermediate_size: int
    intermediate_size: int
    first_k_dense_replace: int
    moe_layer_freq: int
    moe_renormalize: bool
    routed_scaling_factor: float
    situ_beta1: float
    situ_beta2: float
    # AttnRes
    attn_res_block_size: int

    def is_kda(self, layer: int) -> bool:
        return layer in self.kda_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


def read_config(path: str | Path) -> OracleConfig:
    """Read config.json (nested: root.text_config, text_config.linear_attn_config)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    root = json.loads(path.read_text(encoding="utf-8"))
    tc = root.get("text_config")
    if not isinstance(tc, dict):
        raise OracleError(f"{path}: missing object text_config")
    la = tc.get("linear_attn_config")
    if not isinstance(la, dict):
        raise OracleError(f"{path}: missing object text_config.linear_attn_config")

    missing: list[str] = []

    def get(obj: dict, key: str, where: str):
        if key not in obj:
            missing.append(f"{where}{key}")
            return None
        return obj[key]

    t = lambda k: get(tc, k, "text_config.")  # noqa: E731
    a = lambda k: get(la, k, "text_config.linear_attn_config.")  # noqa: E731
    values = dict(
        hidden_size=t("hidden_size"),
        num_hidden_layers=t("num_hidden_layers"),
        vocab_size=t("vocab_size"),
        rms_norm_eps=t("rms_norm_eps"),
        kda_num_heads=a("num_heads"),
        kda_head_dim=a("head_dim"),
        conv_kernel_size=a("short_conv_kernel_size"),
        gate_lower_bound=a("gate_lower_bound"),
        kda_layers=a("kda_layers"),
        mla_layers=a("full_attn_layers"),
        num_attention_heads=t("num_attention_heads"),
        q_lora_rank=t("q_lora_rank"),
        kv_lora_rank=t("kv_lora_rank"),
        qk_nope_head_dim=t("qk_nope_head_dim"),
        qk_rope_head_dim=t("qk_rope_head_dim"),
        v_head_dim=t("v_head_dim"),
        num_experts=t("num_experts"),
        num_experts_per_token=t("num_experts_per_token"),
        routed_expert_hidden_size=t("routed_expert_hidden_size"),
        moe_intermediate_size=t("moe_intermediate_size"),
        intermediate_size=t("intermediate_size"),
        first_k_dense_replace=t("first_k_dense_replace"),
        moe_layer_freq=t("moe_layer_freq"),
        moe_renormalize=t("moe_renormalize"),
        routed_scaling_factor=t("routed_scaling_factor"),
        situ_beta1=t("activation_situ_beta"),
        situ_beta2=t("activation_situ_linear_beta"),
        attn_res_block_size=t("attn_res_block_size"),
    )
    if missing:
        raise OracleError(f"{path}: missing config fields: {', '.join(missing)}")
    # The config's layer lists are one-based (spec 2.2, 8.1).
    values["kda_layers"] = frozenset(int(i) - 1 for i in values["kda_layers"])
    values["mla_layers"] = frozenset(int(i) - 1 for i in values["mla_layers"])
    values["moe_renormalize"] = bool(values["moe_renormalize"])
    for key in ("rms_norm_eps", "gate_lower_bound", "routed_scaling_factor",
                "situ_beta1", "situ_beta2"):
        values[key] = float(values[key])
    cfg = OracleConfig(**values)
    for layer in range(cfg.num_hidden_layers):
        if (layer in cfg.kda_layers) == (layer in cfg.mla_layers):
            raise OracleError(f"{path}: layer {layer} (zero-based) is not in exactly one of "
                              "kda_layers / full_attn_layers")
    return cfg


# --------------------------------------------------------------------------------------
# Checkpoint reader (safetensors, sharded via model.safetensors.index.json)
# --------------------------------------------------------------------------------------

_DTYPES = {"U8": np.dtype("u1"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2"),
           "F32": np.dtype("<f4")}


def widen_bf16(raw: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float64, exactly: bits << 16 is the fp32 pattern."""
    bits32 = raw.astype(np.uint32) << np.uint32(16)
    return bits32.view(np.float32).astype(np.float64)


class Checkpoint:
    """Minimal safetensors reader; float tensors come back as float64, U8 as uint8."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index_path = self.model_dir / "model.safetensors.index.json"
        if index_path.exists():
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            self._file_of: dict[str, str] = dict(weight_map)
        else:
            single = self.model_dir / "model.safetensors"
            if not single.exists():
                raise OracleError(f"{self.model_dir}: neither model.safetensors.index.json "
                                  "nor model.safetensors exists")
            header, _ = self._read_header(single)
            self._file_of = {name: single.name for name in header if name != "__metadata__"}
        self._headers: dict[str, tuple[dict, int]] = {}

    @staticmethod
    def _read_header(path: Path) -> tuple[dict, int]:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n).decode("utf-8"))
        return header, 8 + n

    def _header(self, file_name: str) -> tuple[dict, int]:
        if file_name not in self._headers:
            self._headers[file_name] = self._read_header(self.model_dir / file_name)
        return self._headers[file_name]

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def tensor(self, name: str) -> np.ndarray:
        file_name = self._file_of.get(name)
        if file_name is None:
            raise OracleError(f"checkpoint {self.model_dir}: missing tensor {name}")
        header, data_start = self._header(file_name)
        entry = header.get(name)
        if entry is None:
            raise OracleError(f"checkpoint {self.model_dir}: tensor {name} is assigned to "
                              f"{file_name} by the index but absent from its header")
        dtype_name = entry["dtype"]
        if dtype_name not in _DTYPES:
            raise OracleError(f"tensor {name}: unsupported dtype {dtype_name}")
        begin, end = entry["data_offsets"]
        with open(self.model_dir / file_name, "rb") as f:
            f.seek(data_start + begin)
            buf = f.read(end - begin)
        raw = np.frombuffer(buf, dtype=_DTYPES[dtype_name]).reshape(entry["shape"])
        if dtype_name == "U8":
            return raw.copy()
        if dtype_name == "BF16":
            return widen_bf16(raw)
        return raw.astype(np.float64)  # F16 and F32 widen exactly


# --------------------------------------------------------------------------------------
# Elementwise pieces (spec 5.2, 5.7)
# --------------------------------------------------------------------------------------

def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function without overflow warnings for large |x|."""
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """w_i * x_i / sqrt(mean_j x_j^2 + eps), over the last axis; eps inside the root."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return w * (x / np.sqrt(ms + eps))


def l2norm(x: np.ndarray, eps: float = L2NORM_EPS) -> np.ndarray:
    """x / sqrt(sum_d x_d^2 + eps) over the last axis (KDA q and k; eps on the SUM)."""
    return x / np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True) + eps)


def situ(g: np.ndarray, v: np.ndarray, beta1: float, beta2: float) -> np.ndarray:
    """SiTU(g, v) = [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(v/b2)]; the sigmoid sees RAW g."""
    return (beta1 * np.tanh(g / beta1) * sigmoid(g)) * (beta2 * np.tanh(v / beta2))


@dataclass
class ForwardStats:
    """Per-forward statistics the fixture generator checks (spec 9.2)."""
    max_abs_gate: float = 0.0
    max_abs_up: float = 0.0
    bias_changed_selection: bool = False
    nan_or_inf: bool = False
    experts_used: set[tuple[int, int]] = field(default_factory=set)  # (layer, expert)

    def see_situ(self, g: np.ndarray, v: np.ndarray) -> None:
        if g.size:
            self.max_abs_gate = max(self.max_abs_gate, float(np.max(np.abs(g))))
            self.max_abs_up = max(self.max_abs_up, float(np.max(np.abs(v))))

    def see_values(self, x: np.ndarray) -> None:
        if not np.all(np.isfinite(x)):
            self.nan_or_inf = True

    def as_dict(self) -> dict:
        return {"max_abs_gate": self.max_abs_gate, "max_abs_up": self.max_abs_up,
                "bias_changed_selection": self.bias_changed_selection,
                "nan_or_inf": self.nan_or_inf}


def glu_mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray,
            beta1: float, beta2: float, stats: ForwardStats | None = None) -> np.ndarray:
    """W_down . SiTU(W_gate x, W_up x): the dense MLP, the shared MLP and each routed expert."""
    g = x @ w_gate.T
    v = x @ w_up.T
    if stats is not None:
        stats.see_situ(g, v)
    return situ(g, v, beta1, beta2) @ w_down.T


# --------------------------------------------------------------------------------------
# Block Attention Residuals (spec 5.3)
# --------------------------------------------------------------------------------------

def attn_res(sources: Sequence[np.ndarray], w_norm: np.ndarray, w_proj: np.ndarray) -> np.ndarray:
    """Softmax-weighted sum of the RAW sources; scores from RMS-normalized keys.

    Each source is [..., E] (leading axes, e.g. tokens, are independent). w_proj may be
    stored [1, E].
    """
    u = np.reshape(w_norm, -1) * np.reshape(w_proj, -1)
    v = np.stack(list(sources), axis=0)                       # [S, ..., E]
    keys = v / np.sqrt(np.mean(np.square(v), axis=-1, keepdims=True) + ATTN_RES_EPS)
    z = keys @ u                                              # [S, ...]
    z = z - np.max(z, axis=0, keepdims=True)
    p = np.exp(z)
    p = p / np.sum(p, axis=0, keepdims=True)
    out = np.zeros_like(v[0])
    for s in range(v.shape[0]):                              # push order, fixed
        out = out + p[s][..., None] * v[s]
    return out


# --------------------------------------------------------------------------------------
# Kimi Delta Attention (spec 5.4)
# --------------------------------------------------------------------------------------

def causal_conv_silu(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Depthwise causal conv then SiLU. x [T, P]; w [P, 1, K] or [P, K].

    y[t, c] = sum_j w[c, j] * x[t-K+1+j, c]; w[c, K-1] meets the newest input; inputs
    before the start are 0.
    """
    taps = np.reshape(w, (x.shape[1], -1))
    k = taps.shape[1]
    padded = np.concatenate([np.zeros((k - 1, x.shape[1])), x], axis=0)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        window = padded[t:t + k]                               # rows x[t-K+1 .. t]
        y[t] = np.sum(taps.T * window, axis=0)
    return silu(y)


def kda_decay(z: np.ndarray, a_log: np.ndarray, g_min: float, num_heads: int,
              head_dim: int) -> np.ndarray:
    """alpha = exp(g), g[h, d] = g_min * sigmoid(exp(A_log[h]) * z[h, d]). z [T, P] -> [T, H, D].

    A_log is per head: only its first H entries are used (the rest is padding).
    """
    zh = z.reshape(z.shape[0], num_heads, head_dim)
    a = np.exp(np.reshape(a_log, -1)[:num_heads])[None, :, None]
    g = g_min * sigmoid(a * zh)
    return np.exp(g)


def kda_recurrence(q: np.ndarray, k: np.ndarray, v: np.ndarray, alpha: np.ndarray,
                   beta: np.ndarray,
                   state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Naive delta-rule recurrence, per head. q (already scaled), k, v, alpha: [T, H, D];
    beta: [T, H]; state S [H, D, D] (row = key channel, column = value channel), default 0.

    Per token: decay rows of S by alpha; read u = S^T k; write S += k (x) beta (v - u);
    output o = S^T q from the UPDATED state. Returns (o [T, H, D], final S).
    """
    t_len, heads, dim = q.shape
    s = np.zeros((heads, dim, dim)) if state is None else state.copy()
    out = np.zeros((t_len, heads, v.shape[2]))
    for t in range(t_len):
        for h in range(heads):
            s[h] = alpha[t, h][:, None] * s[h]
            u = s[h].T @ k[t, h]
            s[h] = s[h] + np.outer(k[t, h], beta[t, h] * (v[t, h] - u))
            out[t, h] = s[h].T @ q[t, h]
    return out, s


def kda_layer(x: np.ndarray, *, w_q: np.ndarray, w_k: np.ndarray, w_v: np.ndarray,
              conv_q: np.ndarray, conv_k: np.ndarray, conv_v: np.ndarray,
              w_fa: np.ndarray, w_fb: np.ndarray, a_log: np.ndarray, dt_bias: np.ndarray,
              w_b: np.ndarray, w_g: np.ndarray, o_norm: np.ndarray, w_o: np.ndarray,
              num_heads: int, head_dim: int, g_min: float) -> np.ndarray:
    """KDA over a whole sequence from a fresh state. x [T, E] (normalized input) -> [T, E]."""
    t_len = x.shape[0]
    shape = (t_len, num_heads, head_dim)
    # 1-2. projections, causal conv, SiLU
    q = causal_conv_silu(x @ w_q.T, conv_q).reshape(shape)
    k = causal_conv_silu(x @ w_k.T, conv_k).reshape(shape)
    v = causal_conv_silu(x @ w_v.T, conv_v).reshape(shape)
    # 3. L2 norm of q and k per head; q scaled by D^-1/2 afterwards
    q = l2norm(q) * head_dim ** -0.5
    k = l2norm(k)
    # 4. beta, one per head
    beta = sigmoid(x @ w_b.T)                                  # [T, H]
    # 5. decay: rank pair with nothing in between, dt_bias inside the exp(A) product
    z = (x @ w_fa.T) @ w_fb.T + np.reshape(dt_bias, -1)
    alpha = kda_decay(z, a_log, g_min, num_heads, head_dim)
    # 6. recurrence
    o, _ = kda_recurrence(q, k, v, alpha, beta)
    # 7. per-head RMSNorm (shared weight), then the sigmoid gate
    gate = sigmoid(x @ w_g.T).reshape(shape)
    y = rmsnorm(o, np.reshape(o_norm, -1), KDA_O_NORM_EPS) * gate
    # 8. output projection
    return y.reshape(t_len, num_heads * head_dim) @ w_o.T


# --------------------------------------------------------------------------------------
# Gated MLA with NoPE (spec 5.5)
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MlaDims:
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int


def _mla_inputs(x: np.ndarray, w_qa: np.ndarray, q_a_norm: np.ndarray, w_qb: np.ndarray,
                w_kva: np.ndarray, kv_a_norm: np.ndarray,
                dims: MlaDims) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps 1-3: q [T, H, d_qk], normalized latent c_hat [T, r_kv], shared k_rope [T, d_r]."""
    d_qk = dims.qk_nope_head_dim + dims.qk_rope_head_dim
    q = rmsnorm(x @ w_qa.T, np.reshape(q_a_norm, -1), MLA_NORM_EPS) @ w_qb.T
    q = q.reshape(x.shape[0], dims.num_heads, d_qk)
    c = x @ w_kva.T
    c_lat = c[:, :dims.kv_lora_rank]
    k_rope = c[:, dims.kv_lora_rank:dims.kv_lora_rank + dims.qk_rope_head_dim]
    c_hat = rmsnorm(c_lat, np.reshape(kv_a_norm, -1), MLA_NORM_EPS)  # latent only
    return q, c_hat, k_rope


def _causal_softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over s <= t of scores [T, T] (row t = query)."""
    t_len = scores.shape[0]
    mask = np.tril(np.ones((t_len, t_len), dtype=bool))
    s = np.where(mask, scores, -np.inf)
    s = s - np.max(s, axis=1, keepdims=True)
    p = np.where(mask, np.exp(s), 0.0)
    return p / np.sum(p, axis=1, keepdims=True)


def mla_layer_expanded(x: np.ndarray, *, w_qa: np.ndarray, q_a_norm: np.ndarray,
                       w_qb: np.ndarray, w_kva: np.ndarray, kv_a_norm: np.ndarray,
                       w_kvb: np.ndarray, w_g: np.ndarray, w_o: np.ndarray,
                       dims: MlaDims) -> np.ndarray:
    """Gated MLA, expanded keys/values per head. x [T, E] -> [T, E]."""
    t_len = x.shape[0]
    d_n, d_v = dims.qk_nope_head_dim, dims.v_head_dim
    scale = (d_n + dims.qk_rope_head_dim) ** -0.5
    q, c_hat, k_rope = _mla_inputs(x, w_qa, q_a_norm, w_qb, w_kva, kv_a_norm, dims)
    # kv_b rows per head are [k_nope_h (d_n) || v_h (d_v)]
    kv = (c_hat @ w_kvb.T).reshape(t_len, dims.num_heads, d_n + d_v)
    out = np.zeros((t_len, dims.num_heads, d_v))
    for h in range(dims.num_heads):
        key = np.concatenate([kv[:, h, :d_n], k_rope], axis=1)  # one k_rope for all heads
        value = kv[:, h, d_n:]
        p = _causal_softmax((q[:, h, :] @ key.T) * scale)
        out[:, h, :] = p @ value
    gate = sigmoid(x @ w_g.T)
    return (gate * out.reshape(t_len, -1)) @ w_o.T              # gate, then o_proj, no norm


def mla_layer_absorbed(x: np.ndarray, *, w_qa: np.ndarray, q_a_norm: np.ndarray,
                       w_qb: np.ndarray, w_kva: np.ndarray, kv_a_norm: np.ndarray,
                       w_kvb: np.ndarray, w_g: np.ndarray, w_o: np.ndarray,
                       dims: MlaDims) -> np.ndarray:
    """Gated MLA in latent form: attention over (c_hat, k_rope) with W_kb/W_vb absorbed."""
    t_len = x.shape[0]
    d_n, d_v = dims.qk_nope_head_dim, dims.v_head_dim
    scale = (d_n + dims.qk_rope_head_dim) ** -0.5
    q, c_hat, k_rope = _mla_inputs(x, w_qa, q_a_norm, w_qb, w_kva, kv_a_norm, dims)
    per_head = d_n + d_v
    out = np.zeros((t_len, dims.num_heads, d_v))
    for h in range(dims.num_heads):
        w_kb = w_kvb[h * per_head: h * per_head + d_n, :]          # [d_n, r_kv]
        w_vb = w_kvb[h * per_head + d_n: (h + 1) * per_head, :]    # [d_v, r_kv]
        q_lat = q[:, h, :d_n] @ w_kb                               # W_kb^T q_nope
        scores = (q_lat @ c_hat.T + q[:, h, d_n:] @ k_rope.T) * scale
        p = _causal_softmax(scores)
        out[:, h, :] = (p @ c_hat) @ w_vb.T
    gate = sigmoid(x @ w_g.T)
    return (gate * out.reshape(t_len, -1)) @ w_o.T


# --------------------------------------------------------------------------------------
# Stable LatentMoE (spec 5.6)
# --------------------------------------------------------------------------------------

def _top_k(scores: np.ndarray, k: int) -> list[int]:
    """Indices of the k largest scores, ordered by score desc then index asc."""
    return sorted(range(len(scores)), key=lambda e: (-scores[e], e))[:k]


def route(x: np.ndarray, w_r: np.ndarray, bias: np.ndarray, k: int, renormalize: bool,
          scaling: float) -> tuple[list[int], np.ndarray]:
    """Sigmoid router for one token x [E]. The bias picks the set; weights are unbiased."""
    s = sigmoid(w_r @ x)
    experts = _top_k(s + np.reshape(bias, -1), k)
    weights = s[experts]
    if k > 1 and renormalize:
        weights = weights / (np.sum(weights) + ROUTER_RENORM_EPS)
    return experts, weights * scaling


ExpertFn = Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray]]


def moe_layer(x: np.ndarray, *, w_r: np.ndarray, bias: np.ndarray, k: int, renormalize: bool,
              scaling: float, w_down: np.ndarray, w_up: np.ndarray, routed_norm: np.ndarray,
              expert: ExpertFn, shared_gate: np.ndarray, shared_up: np.ndarray,
              shared_down: np.ndarray, beta1: float, beta2: float,
              stats: ForwardStats | None = None) -> np.ndarray:
    """LatentMoE over x [T, E]. ``expert(e)`` returns decoded (w1 gate, w2 down, w3 up)."""
    out = np.zeros_like(x)
    bias = np.reshape(bias, -1)
    for t in range(x.shape[0]):
        xt = x[t]
        experts, weights = route(xt, w_r, bias, k, renormalize, scaling)
        if stats is not None:
            unbiased = _top_k(sigmoid(w_r @ xt), k)
            if set(unbiased) != set(experts):
                stats.bias_changed_selection = True
        z = w_down @ xt                                          # latent, from full x
        u = np.zeros(w_down.shape[0])
        for e, weight in zip(experts, weights):                  # list order
            w1, w2, w3 = expert(e)
            u = u + weight * glu_mlp(z, w1, w3, w2, beta1, beta2, stats)
        r = w_up @ rmsnorm(u, np.reshape(routed_norm, -1), ROUTED_NORM_EPS)
        sh = glu_mlp(xt, shared_gate, shared_up, shared_down, beta1, beta2, stats)
        out[t] = r + sh
    return out


# --------------------------------------------------------------------------------------
# The model (spec 1, 5.1, 5.3, 5.8)
# --------------------------------------------------------------------------------------

class Oracle:
    """Teacher-forced float64 forward pass of a K3-shaped checkpoint directory."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.config: OracleConfig = read_config(self.model_dir / "config.json")
        self.checkpoint = Checkpoint(self.model_dir)
        self._cache: dict[str, np.ndarray] = {}
        self._experts: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._expert_nan_groups: dict[tuple[int, int], int] = {}
        self.mla_dims = MlaDims(
            num_heads=self.config.num_attention_heads,
            qk_nope_head_dim=self.config.qk_nope_head_dim,
            qk_rope_head_dim=self.config.qk_rope_head_dim,
            v_head_dim=self.config.v_head_dim,
            kv_lora_rank=self.config.kv_lora_rank,
        )

    # ---- weights ----
    def weight(self, name: str) -> np.ndarray:
        """A tensor by its full checkpoint name (float64, or uint8 for U8), cached."""
        if name not in self._cache:
            self._cache[name] = self.checkpoint.tensor(name)
        return self._cache[name]

    def _w(self, layer: int, rest: str) -> np.ndarray:
        return self.weight(f"{PREFIX}layers.{layer}.{rest}")

    def _expert(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decoded (w1 gate [I_e, l], w2 down [l, I_e], w3 up [I_e, l]) from stored bytes."""
        key = (layer, e)
        if key not in self._experts:
            mats = []
            nan_groups = 0
            for part in ("w1", "w2", "w3"):
                base = f"{PREFIX}layers.{layer}.block_sparse_moe.experts.{e}.{part}"
                w, n = mxfp4.decode(self.checkpoint.tensor(base + ".weight_packed"),
                                    self.checkpoint.tensor(base + ".weight_scale"))
                mats.append(w)
                nan_groups += n
            self._experts[key] = (mats[0], mats[1], mats[2])
            self._expert_nan_groups[key] = nan_groups
        return self._experts[key]

    def _expert_used(self, layer: int, e: int,
                     stats: ForwardStats) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        stats.experts_used.add((layer, e))
        return self._expert(layer, e)

    # ---- sublayers ----
    def _attention(self, layer: int, x: np.ndarray, mla_form: str) -> np.ndarray:
        cfg = self.config
        w = lambda rest: self._w(layer, "self_attn." + rest)  # noqa: E731
        if cfg.is_kda(layer):
            return kda_layer(
                x, w_q=w("q_proj.weight"), w_k=w("k_proj.weight"), w_v=w("v_proj.weight"),
                conv_q=w("q_conv1d.weight"), conv_k=w("k_conv1d.weight"),
                conv_v=w("v_conv1d.weight"), w_fa=w("f_a_proj.weight"),
                w_fb=w("f_b_proj.weight"), a_log=w("A_log"), dt_bias=w("dt_bias"),
                w_b=w("b_proj.weight"), w_g=w("g_proj.weight"), o_norm=w("o_norm.weight"),
                w_o=w("o_proj.weight"), num_heads=cfg.kda_num_heads,
                head_dim=cfg.kda_head_dim, g_min=cfg.gate_lower_bound)
        mla = mla_layer_expanded if mla_form == "expanded" else mla_layer_absorbed
        return mla(x, w_qa=w("q_a_proj.weight"), q_a_norm=w("q_a_layernorm.weight"),
                   w_qb=w("q_b_proj.weight"), w_kva=w("kv_a_proj_with_mqa.weight"),
                   kv_a_norm=w("kv_a_layernorm.weight"), w_kvb=w("kv_b_proj.weight"),
                   w_g=w("g_proj.weight"), w_o=w("o_proj.weight"), dims=self.mla_dims)

    def _ffn(self, layer: int, x: np.ndarray, stats: ForwardStats) -> np.ndarray:
        cfg = self.config
        if not cfg.is_moe(layer):
            return glu_mlp(x, self._w(layer, "mlp.gate_proj.weight"),
                           self._w(layer, "mlp.up_proj.weight"),
                           self._w(layer, "mlp.down_proj.weight"),
                           cfg.situ_beta1, cfg.situ_beta2, stats)
        m = lambda rest: self._w(layer, "block_sparse_moe." + rest)  # noqa: E731
        return moe_layer(
            x, w_r=m("gate.weight"), bias=m("gate.e_score_correction_bias"),
            k=cfg.num_experts_per_token, renormalize=cfg.moe_renormalize,
            scaling=cfg.routed_scaling_factor, w_down=m("routed_expert_down_proj.weight"),
            w_up=m("routed_expert_up_proj.weight"),
            routed_norm=m("routed_expert_norm.weight"),
            expert=lambda e: self._expert_used(layer, e, stats),
            shared_gate=m("shared_experts.gate_proj.weight"),
            shared_up=m("shared_experts.up_proj.weight"),
            shared_down=m("shared_experts.down_proj.weight"),
            beta1=cfg.situ_beta1, beta2=cfg.situ_beta2, stats=stats)

    # ---- whole model ----
    def forward_with_stats(self, ids: Sequence[int], *,
                           mla_form: str = "expanded") -> tuple[np.ndarray, dict]:
        """Logits [T, V] for every position (fresh state) plus the spec 9.2 statistics:
        {"max_abs_gate", "max_abs_up", "bias_changed_selection", "nan_or_inf",
        "mxfp4_nan_groups" (s = 255 groups over the experts this pass used)}."""
        cfg = self.config
        if mla_form not in ("expanded", "absorbed"):
            raise ValueError(f"mla_form must be 'expanded' or 'absorbed', got {mla_form!r}")
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("forward needs at least one token id")
        for i in ids:
            if not 0 <= i < cfg.vocab_size:
                raise ValueError(f"token id {i} outside [0, {cfg.vocab_size})")
        stats = ForwardStats()

        h = self.weight(PREFIX + "embed_tokens.weight")[ids]       # 5.1: row gather
        blocks: list[np.ndarray] = []                              # B, in push order
        for layer in range(cfg.num_hidden_layers):
            r = lambda rest: self._w(layer, rest)  # noqa: E731
            prefix: np.ndarray | None = h
            x = h if not blocks else attn_res(
                blocks + [prefix], r("self_attention_res_norm.weight"),
                r("self_attention_res_proj.weight"))
            if layer % cfg.attn_res_block_size == 0:               # boundary: push, reset
                blocks.append(prefix)
                prefix = None
            a = self._attention(
                layer, rmsnorm(x, r("input_layernorm.weight"), cfg.rms_norm_eps), mla_form)
            prefix = a if prefix is None else prefix + a
            x = attn_res(blocks + [prefix], r("mlp_res_norm.weight"),
                         r("mlp_res_proj.weight"))
            m = self._ffn(layer, rmsnorm(x, r("post_attention_layernorm.weight"),
                                         cfg.rms_norm_eps), stats)
            h = prefix + m
            stats.see_values(h)

        h = attn_res(blocks + [h], self.weight(PREFIX + "output_attn_res_norm.weight"),
                     self.weight(PREFIX + "output_attn_res_proj.weight"))
        h = rmsnorm(h, self.weight(PREFIX + "norm.weight"), cfg.rms_norm_eps)
        logits = h @ self.weight(LM_HEAD).T                        # untied
        stats.see_values(logits)
        result = stats.as_dict()
        result["mxfp4_nan_groups"] = sum(self._expert_nan_groups[k] for k in stats.experts_used)
        return logits, result

    def forward(self, ids: Sequence[int], *, mla_form: str = "expanded") -> np.ndarray:
        """Teacher-forced float64 logits [T, V] for every position, from a fresh state."""
        logits, _ = self.forward_with_stats(ids, mla_form=mla_form)
        return logits
