"""Typed wrapper over the C engine: `Model` and `Session`.

The wrapper validates config.json and every shard header in Python (strict readers in
`config`, `safetensors_io`, `catalog`), then hands the C engine a flat config struct and a
table of tensor descriptors. The engine does all weight I/O and math. cffi releases the
GIL during engine calls, so a UI thread stays live while a token is computed; one lock
per handle keeps calls on a handle serial.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .catalog import bind
from .sizes import peak_resident_bytes
from .config import ModelConfig, load_config
from .errors import CheckpointError
from .safetensors_io import Checkpoint, open_checkpoint

__all__ = [
    "EngineError", "ExpertReadError", "TrunkReadError", "Cancelled", "Model", "Session",
    "CancelFlag", "StateArrays", "StreamOptions", "stats_delta",
]

_DTYPES = {"U8": 0, "BF16": 1, "F16": 2, "F32": 3}


def _lib() -> tuple[Any, Any]:
    from ._k3 import ffi, lib  # built by cffi at install time
    return ffi, lib


class EngineError(RuntimeError):
    """An engine call failed; `code` is the engine status, the message its detail text."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class ExpertReadError(EngineError):
    """A routed expert could not be read or failed its checks (status 4)."""


class TrunkReadError(EngineError):
    """A trunk tensor read failed (status 6)."""


class Cancelled(EngineError):
    """The step was cancelled through the cancel flag (status 5)."""


def _raise(code: int, detail: str) -> None:
    if code == 0:
        return
    cls = {4: ExpertReadError, 5: Cancelled, 6: TrunkReadError}.get(code, EngineError)
    raise cls(code, detail)


class CancelFlag:
    """A flag the engine polls between layers; set it from any thread."""

    def __init__(self) -> None:
        ffi, _ = _lib()
        self._cell = ffi.new("int32_t *", 0)

    def set(self) -> None:
        self._cell[0] = 1

    def clear(self) -> None:
        self._cell[0] = 0

    @property
    def is_set(self) -> bool:
        return bool(self._cell[0])


def engine_config(cfg: ModelConfig) -> Any:
    """The C struct for a validated config."""
    ffi, lib = _lib()
    if cfg.n_layers > lib.K3_MAX_LAYERS:
        raise CheckpointError(f"{cfg.n_layers} layers exceed the engine limit {lib.K3_MAX_LAYERS}")
    c = ffi.new("k3_config *")
    c.hidden, c.n_layers, c.vocab = cfg.hidden, cfg.n_layers, cfg.vocab
    c.rms_eps = cfg.rms_eps
    c.kda_heads, c.kda_head_dim, c.conv_kernel = cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel
    c.gate_lower_bound = cfg.gate_lower_bound
    c.mla_heads, c.q_lora_rank, c.kv_lora_rank = cfg.mla_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    c.qk_nope_dim, c.qk_rope_dim, c.v_head_dim = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
    c.n_experts, c.top_k, c.shared_width = cfg.n_experts, cfg.top_k, cfg.shared_width
    c.latent_dim, c.expert_width, c.dense_width = cfg.latent_dim, cfg.expert_width, cfg.dense_width
    c.first_dense = cfg.first_dense
    c.moe_renormalize = 1 if cfg.moe_renormalize else 0
    c.routed_scaling = cfg.routed_scaling
    c.situ_beta1, c.situ_beta2 = cfg.situ_beta1, cfg.situ_beta2
    c.attn_res_block = cfg.attn_res_block
    for L in range(cfg.n_layers):
        c.layer_is_mla[L] = 1 if cfg.is_mla(L) else 0
    return c


@dataclass(frozen=True)
class StreamOptions:
    """How the engine holds weights (see k3_open_opts in native/k3.h).

    The defaults keep every weight resident, experts read on first use and kept.
    Output bits never depend on any of these settings."""

    expert_cache_bytes: int = 0      # 0: no limit
    reader_threads: int = 2
    direct_io: bool = True
    lookahead: int = 0               # experts per token prefetched for the next layer
    prefetch: bool = True            # reader threads read a layer's misses at once
    trunk_stream: bool = False
    ring_slots: int = 2
    pinned: tuple[int, ...] = ()     # layers kept resident while streaming
    embed_stream: bool = False       # read embedding rows per token instead of holding them
    prefill_chunk: int = 64          # prompt tokens per pass: each distinct expert read once per pass
    head_block_rows: int = 0         # 0: lm_head held; N: read per pass in blocks of N rows
    ffn_split: bool = False          # a streamed dense FFN comes through the ring one matrix per unit
    trunk_readers: int = 1           # threads reading a streamed trunk unit's pieces in parallel
    trunk_piece_bytes: int = 0       # bytes per trunk read request; 0: one request per contiguous read


@dataclass(frozen=True)
class StateArrays:
    """A session's state decoded from the engine's export layout (k3_state.c)."""

    ids: np.ndarray
    kda_s: list[np.ndarray]      # per KDA layer [H_k, D, D]
    kda_conv: list[np.ndarray]   # per KDA layer [3, P, K-1]
    mla_rows: list[np.ndarray]   # per MLA layer [len, kv_lora + rope]


class Model:
    """An open checkpoint: validated tensors resident in the C engine."""

    def __init__(self, model_dir: str | Path, *, threads: int = 1, scalar: bool = False,
                 streaming: StreamOptions | None = None) -> None:
        ffi, lib = _lib()
        self.dir = Path(model_dir)
        self.streaming = streaming or StreamOptions()
        self.config: ModelConfig = load_config(self.dir)
        self.checkpoint: Checkpoint = open_checkpoint(self.dir)
        bind(self.config, self.checkpoint)
        self._lock = threading.Lock()   # one engine call at a time
        self._life = threading.Lock()   # quick reads (stats) against close
        shards = self.checkpoint.shards
        shard_ix = {s: i for i, s in enumerate(shards)}
        keep: list[Any] = []
        paths = ffi.new("char *[]", len(shards))
        for i, s in enumerate(shards):
            p = ffi.new("char[]", os.fsencode(self.checkpoint.path(s)))
            keep.append(p)
            paths[i] = p
        infos = list(self.checkpoint.tensors.values())
        descs = ffi.new("k3_tensor_desc[]", len(infos))
        for d, t in zip(descs, infos):
            nm = ffi.new("char[]", t.name.encode())
            keep.append(nm)
            d.name = nm
            d.shard = shard_ix[t.shard]
            d.dtype = _DTYPES[t.dtype]
            d.ndim = len(t.shape)
            if d.ndim > 4:
                raise CheckpointError(f"tensor {t.name} has {d.ndim} dimensions; at most 4 are supported")
            for i, n in enumerate(t.shape):
                d.shape[i] = n
            d.offset = t.start
            d.nbytes = t.nbytes
        err = ffi.new("char[]", 1024)
        out = ffi.new("k3_model **")
        rc = lib.k3_model_open(engine_config(self.config), paths, len(shards), descs, len(infos),
                               self._opts(self.streaming), out, err, 1024)
        _raise(rc, ffi.string(err).decode(errors="replace"))
        self._h = ffi.gc(out[0], lib.k3_model_close)
        # sessions point into the model: closing it closes them first
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()
        self.set_threads(threads)
        self.set_scalar(scalar)

    def _opts(self, so: StreamOptions | None) -> Any:
        ffi, lib = _lib()
        so = so or StreamOptions()
        o = ffi.new("k3_open_opts *")
        o.expert_cache_bytes = int(so.expert_cache_bytes)
        o.reader_threads = int(so.reader_threads)
        o.direct_io = 1 if so.direct_io else 0
        o.lookahead = int(so.lookahead)
        o.prefetch = 1 if so.prefetch else 0
        o.trunk_stream = 1 if so.trunk_stream else 0
        o.ring_slots = int(so.ring_slots)
        o.embed_stream = 1 if so.embed_stream else 0
        if so.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 token, got {so.prefill_chunk}")
        o.prefill_chunk = int(so.prefill_chunk)
        if so.head_block_rows < 0:
            raise ValueError(f"head_block_rows must be 0 (lm_head held) or >= 1 row, got "
                             f"{so.head_block_rows}")
        o.head_block_rows = int(so.head_block_rows)
        o.ffn_split = 1 if so.ffn_split else 0
        if not 1 <= so.trunk_readers <= 32:
            raise ValueError(f"trunk_readers must be 1..32 threads, got {so.trunk_readers}")
        o.trunk_readers = int(so.trunk_readers)
        if so.trunk_piece_bytes != 0 and so.trunk_piece_bytes < 4096:
            raise ValueError(f"trunk_piece_bytes must be 0 (whole reads) or >= 4096, got "
                             f"{so.trunk_piece_bytes}")
        o.trunk_piece_bytes = int(so.trunk_piece_bytes)
        for L in so.pinned:
            if not 0 <= L < self.config.n_layers:
                raise ValueError(f"pinned layer {L} is outside 0..{self.config.n_layers - 1}")
            o.pinned[L] = 1
        self._keep_opts = o
        return o

    def inject_fault(self, layer: int, expert: int, kind: int = 1) -> None:
        """Test hook: the next read of (layer, expert) fails with EIO.

        expert -1 targets the layer's streamed trunk, -2 any expert of the layer, -3 the
        next streamed lm_head block (layer ignored), -4 the layer's split FFN down matrix
        (read after its gate and up units)."""
        self._call("k3_model_inject_fault", int(layer), int(expert), int(kind))

    # ---- settings ----
    def set_threads(self, n: int) -> None:
        self._call("k3_model_set_threads", int(n))

    def set_scalar(self, on: bool) -> None:
        self._call("k3_model_set_scalar", 1 if on else 0)

    @property
    def simd_active(self) -> bool:
        _, lib = _lib()
        with self._life:
            return bool(lib.k3_model_simd_active(self._handle()))

    @property
    def vocab(self) -> int:
        return self.config.vocab

    def stats(self) -> dict[str, int]:
        """Cumulative engine counters, plus the process's peak resident set size.

        Per-token figures are differences of two calls (see `stats_delta`)."""
        ffi, lib = _lib()
        st = ffi.new("k3_stats *")
        with self._life:  # not the call lock: a status bar reads these while a token computes
            lib.k3_model_stats(self._handle(), st)
        out = {f: int(getattr(st, f)) for f, _ in ffi.typeof("k3_stats").fields}
        out["peak_rss_bytes"] = peak_resident_bytes()
        return out

    def _call(self, fn: str, *args: Any) -> None:
        ffi, lib = _lib()
        with self._lock:
            rc = getattr(lib, fn)(self._handle(), *args)
            if rc:
                _raise(rc, ffi.string(lib.k3_model_error(self._h)).decode(errors="replace"))

    # ---- compute ----
    def forward(self, ids: Sequence[int], *, shared_kda_slot: bool = False) -> np.ndarray:
        """Stateless full forward: float32 logits [len(ids), V] for every position."""
        ffi, _ = _lib()
        arr = np.ascontiguousarray(np.asarray(ids, dtype=np.int32))
        out = np.empty((len(arr), self.vocab), dtype=np.float32)
        self._call("k3_model_forward", ffi.from_buffer("int32_t[]", arr), len(arr),
                   ffi.from_buffer("float[]", out), 1 if shared_kda_slot else 0)
        return out

    def verify_bytes(self, positions: int) -> int:
        """Bytes a session's speculative verify record takes for that many positions."""
        _, lib = _lib()
        with self._life:
            return int(lib.k3_verify_bytes(self._handle(), int(positions)))

    def session(self, max_positions: int) -> "Session":
        return Session(self, max_positions)

    def close(self) -> None:
        ffi, lib = _lib()
        for s in list(self._sessions):
            s.close()
        with self._lock, self._life:  # waits for a running call and for quick readers
            if self._h is not None:
                ffi.release(self._h)
                self._h = None

    def _handle(self) -> Any:
        if self._h is None:
            raise EngineError(1, "the model is closed")
        return self._h

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """One conversation's state: ids fed so far, KDA state, MLA latent cache, snapshots."""

    def __init__(self, model: Model, max_positions: int) -> None:
        ffi, lib = _lib()
        self.model = model
        out = ffi.new("k3_session **")
        with model._lock:
            rc = lib.k3_session_create(model._handle(), int(max_positions), out)
            if rc:
                _raise(rc, ffi.string(lib.k3_model_error(model._h)).decode(errors="replace"))
            self._h = ffi.gc(out[0], lib.k3_session_free)
            model._sessions.add(self)
        self._lock = threading.Lock()   # one engine call at a time
        self._life = threading.Lock()   # quick reads against close

    def _hs(self) -> Any:
        if self._h is None:
            raise EngineError(1, "the session is closed")
        return self._h

    def _check(self, rc: int) -> None:
        ffi, lib = _lib()
        if rc:
            _raise(rc, ffi.string(lib.k3_session_error(self._h)).decode(errors="replace"))

    # Quick reads take only the lifetime lock, so they never wait for a running feed; read
    # during a feed they give the value before or after the chunk in flight.
    @property
    def length(self) -> int:
        _, lib = _lib()
        with self._life:
            return int(lib.k3_session_length(self._hs()))

    @property
    def capacity(self) -> int:
        _, lib = _lib()
        with self._life:
            return int(lib.k3_session_capacity(self._hs()))

    @property
    def tainted(self) -> bool:
        _, lib = _lib()
        with self._life:
            return bool(lib.k3_session_tainted(self._hs()))

    @property
    def ids(self) -> list[int]:
        ffi, lib = _lib()
        with self._lock, self._life:
            n = int(lib.k3_session_length(self._hs()))
            buf = ffi.new("int32_t[]", max(n, 1))
            got = lib.k3_session_ids(self._hs(), buf, n)
        return [int(buf[i]) for i in range(got)]

    def reset(self) -> None:
        _, lib = _lib()
        with self._lock:
            self._check(lib.k3_session_reset(self._hs()))

    def feed(self, ids: Sequence[int], *, all_logits: bool = False,
             cancel: CancelFlag | None = None) -> np.ndarray:
        """Feed ids; returns the last position's logits [V], or [n, V] with all_logits."""
        ffi, lib = _lib()
        arr = np.ascontiguousarray(np.asarray(ids, dtype=np.int32))
        if arr.ndim != 1 or len(arr) == 0:
            raise ValueError("feed needs a non-empty 1-D list of token ids")
        V = self.model.vocab
        last = np.empty(V, dtype=np.float32)
        allbuf = np.empty((len(arr), V), dtype=np.float32) if all_logits else None
        with self._lock, self.model._lock:
            rc = lib.k3_session_feed(self._hs(), ffi.from_buffer("int32_t[]", arr), len(arr), ffi.from_buffer("float[]", last),
                ffi.from_buffer("float[]", allbuf) if allbuf is not None else ffi.NULL,
                cancel._cell if cancel is not None else ffi.NULL)
            self._check(rc)
        return allbuf if allbuf is not None else last

    def verify(self, ids: Sequence[int], *, cancel: CancelFlag | None = None) -> np.ndarray:
        """Speculative decoding: the logits [n, V] of ids at positions length.. from one
        pass, bit-identical to feeding them one by one, without advancing the session. Follow
        with `accept(keep)`; any other feed, reset, import or restore drops the pending verify.
        A failed or cancelled verify leaves the session as it was."""
        ffi, lib = _lib()
        arr = np.ascontiguousarray(np.asarray(ids, dtype=np.int32))
        if arr.ndim != 1 or len(arr) == 0:
            raise ValueError("verify needs a non-empty 1-D list of token ids")
        out = np.empty((len(arr), self.model.vocab), dtype=np.float32)
        with self._lock, self.model._lock:
            self._check(lib.k3_session_verify(self._hs(), ffi.from_buffer("int32_t[]", arr), len(arr),
                                              ffi.from_buffer("float[]", out),
                                              cancel._cell if cancel is not None else ffi.NULL))
        return out

    def accept(self, keep: int) -> None:
        """Advance the session by the first `keep` positions of the pending verify."""
        _, lib = _lib()
        with self._lock, self.model._lock:  # the replay runs on the model's thread pool
            self._check(lib.k3_session_accept(self._hs(), int(keep)))

    # ---- state ----
    def export_state(self) -> bytearray:
        ffi, lib = _lib()
        with self._lock:
            size = ffi.new("uint64_t *")
            lib.k3_session_state_size(self._hs(), size)
            buf = bytearray(size[0])
            self._check(lib.k3_session_export(self._hs(), ffi.from_buffer(buf), size[0]))
        return buf  # a bytearray: no second copy of a state that can be gigabytes

    def import_state(self, data: bytes) -> None:
        ffi, lib = _lib()
        with self._lock:
            self._check(lib.k3_session_import(self._hs(), ffi.from_buffer(data), len(data)))

    def snapshot(self) -> int:
        ffi, lib = _lib()
        with self._lock:
            out = ffi.new("int32_t *")
            self._check(lib.k3_session_snapshot(self._hs(), out))
            return int(out[0])

    def restore(self, snap_id: int) -> None:
        _, lib = _lib()
        with self._lock:
            self._check(lib.k3_session_restore(self._hs(), int(snap_id)))

    def drop_snapshot(self, snap_id: int) -> None:
        _, lib = _lib()
        with self._lock:
            self._check(lib.k3_session_snapshot_drop(self._hs(), int(snap_id)))

    def state_arrays(self) -> StateArrays:
        return decode_state(self.export_state())

    def close(self) -> None:
        ffi, _ = _lib()
        with self._lock, self._life:
            if self._h is not None:
                ffi.release(self._h)
                self._h = None


_LEVELS = ("peak_rss_bytes", "direct_io", "direct_io_refused", "expert_slots", "trunk_inflight_max")


def stats_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What happened between two `Model.stats()` calls (levels are taken as they are)."""
    return {k: (v if k in _LEVELS else v - before.get(k, 0)) for k, v in after.items()}


def decode_state(data: bytes) -> StateArrays:
    """Split an exported state into arrays (layout documented in native/k3_state.c)."""
    hdr = np.frombuffer(data, dtype=np.uint32, count=10)
    if int(hdr[0]) != 0x3153334B:
        raise ValueError("not an engine state (bad magic)")
    n, n_kda, n_mla, H, D, P, K, W = (int(x) for x in hdr[2:10])
    off = 40
    ids = np.frombuffer(data, dtype=np.int32, count=n, offset=off)
    off += 4 * n
    s_list, c_list, r_list = [], [], []
    for _ in range(n_kda):
        s_list.append(np.frombuffer(data, dtype=np.float32, count=H * D * D, offset=off).reshape(H, D, D))
        off += 4 * H * D * D
        c_list.append(np.frombuffer(data, dtype=np.float32, count=3 * P * (K - 1), offset=off).reshape(3, P, K - 1))
        off += 4 * 3 * P * (K - 1)
    for _ in range(n_mla):
        r_list.append(np.frombuffer(data, dtype=np.float32, count=n * W, offset=off).reshape(n, W))
        off += 4 * n * W
    if off != len(data):
        raise ValueError(f"engine state has {len(data)} bytes, layout accounts for {off}")
    return StateArrays(ids, s_list, c_list, r_list)
