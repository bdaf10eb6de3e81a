/* k3.h: public C API of the k3chat engine (Kimi K3 forward pass).
 *
 * The caller (the Python wrapper) parses and validates config.json and every
 * safetensors header, then hands the engine a flat config struct and a table of
 * tensor descriptors (shard, absolute offset, dtype, shape).  The engine does all
 * weight I/O and all model math.  Every call returns a k3_status; the detail text
 * of the last failure is kept on the handle (never printed, never exit()).
 */
#ifndef K3_H
#define K3_H

#include <stddef.h>
#include <stdint.h>

#define K3_MAX_LAYERS 512
#define K3_ERRLEN 1024

/* Status codes.  The CLI maps them to exit codes (see README). */
enum {
    K3_OK = 0,
    K3_ERR_RUNTIME = 1,   /* internal failure, bad state */
    K3_ERR_INVALID = 2,   /* bad argument, config or tensor table */
    K3_ERR_NOMEM = 3,
    K3_ERR_EXPERT_IO = 4, /* a routed expert could not be read or failed its checks */
    K3_ERR_CANCELLED = 5,
    K3_ERR_IO = 6         /* a trunk read failed */
};

enum { K3_DT_U8 = 0, K3_DT_BF16 = 1, K3_DT_F16 = 2, K3_DT_F32 = 3 };

typedef struct k3_config {
    int32_t hidden;          /* E */
    int32_t n_layers;        /* N */
    int32_t vocab;           /* V */
    float rms_eps;           /* most norms */
    int32_t kda_heads;       /* H_k */
    int32_t kda_head_dim;    /* D */
    int32_t conv_kernel;     /* K */
    float gate_lower_bound;  /* g_min < 0 */
    int32_t mla_heads;       /* H */
    int32_t q_lora_rank;
    int32_t kv_lora_rank;
    int32_t qk_nope_dim;
    int32_t qk_rope_dim;
    int32_t v_head_dim;
    int32_t n_experts;
    int32_t top_k;
    int32_t shared_width;    /* fused shared MLP width = I_e * n_shared */
    int32_t latent_dim;      /* routed_expert_hidden_size */
    int32_t expert_width;    /* moe_intermediate_size */
    int32_t dense_width;     /* intermediate_size */
    int32_t first_dense;     /* first_k_dense_replace */
    int32_t moe_renormalize;
    float routed_scaling;
    float situ_beta1;
    float situ_beta2;
    int32_t attn_res_block;
    uint8_t layer_is_mla[K3_MAX_LAYERS]; /* zero-based */
} k3_config;

typedef struct k3_tensor_desc {
    const char *name;
    int32_t shard;           /* index into the shard path list */
    int32_t dtype;           /* K3_DT_* */
    int32_t ndim;
    int64_t shape[4];
    uint64_t offset;         /* absolute byte offset in the shard file */
    uint64_t nbytes;
} k3_tensor_desc;

/* How the model holds its weights.  Zeroed options mean: every weight resident,
 * experts loaded on first use and kept. */
typedef struct k3_open_opts {
    uint64_t expert_cache_bytes; /* 0: no limit (a slot for every expert) */
    int32_t reader_threads;      /* expert reader threads, 0 -> 2 */
    int32_t direct_io;           /* 1: try uncached reads, k3_direct_io_kind() (falls back
                                  * to buffered, reported) */
    int32_t lookahead;           /* experts per token prefetched for the next layer; 0 off */
    int32_t prefetch;            /* 1: a layer's misses are read at once by the readers;
                                  * 0: read one by one on the compute thread */
    int32_t trunk_stream;        /* 1: layers not pinned are streamed through a ring */
    int32_t ring_slots;          /* >= 2 when streaming */
    uint8_t pinned[K3_MAX_LAYERS];
    int32_t embed_stream;        /* 1: embedding rows are read from the shard per token */
    int32_t prefill_chunk;       /* tokens per prefill pass (each distinct expert is read
                                  * at most once per pass); 0 -> 64.  Output bits never
                                  * depend on it. */
    int32_t head_block_rows;     /* 0: lm_head held.  > 0: lm_head not held; each pass that
                                  * wants logits reads it from the shard in blocks of this
                                  * many rows into one buffer, applied block by block (every
                                  * logit is the same row dot product: same bits). */
    int32_t ffn_split;           /* 1: a streamed dense layer's FFN comes through the ring
                                  * one matrix per unit (gate, up, down), so a slot needs
                                  * only its largest matrix; same kernels in the same order,
                                  * same bits.  0: the three matrices are one unit. */
    int32_t trunk_readers;       /* threads reading streamed trunk units, each request
                                  * trunk_piece_bytes, so several can be in flight; 0 -> 1 */
    uint64_t trunk_piece_bytes;  /* bytes per streamed trunk read request; 0: one request per
                                  * contiguous read */
} k3_open_opts;

typedef struct k3_stats {
    uint64_t trunk_bytes_read;
    uint64_t expert_bytes_read;
    uint64_t trunk_run_reads;       /* layers read as one contiguous run */
    uint64_t trunk_fallback_reads;  /* layers read tensor by tensor */
    uint64_t expert_run_reads;
    uint64_t expert_fallback_reads;
    uint64_t e8m0_nan_groups;       /* scale byte 255: decoded as zeros */
    uint64_t expert_uses;           /* (token, expert) products computed */
    uint64_t tokens_fed;
    uint64_t cache_hits;            /* expert found in the cache (or already in flight) */
    uint64_t cache_misses;          /* expert had to be read */
    uint64_t cache_evictions;
    uint64_t lookahead_issued;      /* prefetch reads started by the router lookahead */
    uint64_t lookahead_used;        /* ... later used by the real router */
    uint64_t lookahead_wasted;      /* ... evicted unused */
    uint64_t io_wait_ns;            /* compute thread waiting for expert or trunk bytes */
    uint64_t trunk_stream_reads;    /* streamed layer loads */
    uint64_t direct_io;             /* 1 if uncached (O_DIRECT, F_NOCACHE) reads are in use */
    uint64_t direct_io_refused;     /* 1 if they were asked for and refused */
    uint64_t expert_slots;          /* cache capacity in experts */
    uint64_t head_bytes_read;       /* lm_head blocks read (head_block_rows > 0); also in
                                     * trunk_bytes_read */
    uint64_t matmul_madds;          /* multiply-adds done by the BF16/F32 and MXFP4 matmul
                                     * kernels (rows x cols x tokens; not attention or KDA) */
    uint64_t trunk_inflight_max;    /* most streamed trunk read requests in flight at once */
} k3_stats;

typedef struct k3_model k3_model;
typedef struct k3_session k3_session;

/* ---- model ---- */
int k3_model_open(const k3_config *cfg, const char *const *shard_paths, int32_t n_shards,
                  const k3_tensor_desc *tensors, int32_t n_tensors, const k3_open_opts *opts,
                  k3_model **out, char *err, size_t errlen);
void k3_model_close(k3_model *m);
const char *k3_model_error(const k3_model *m);
/* Threads used by this model's kernels (1..64); output bits never depend on it. */
int k3_model_set_threads(k3_model *m, int32_t n);
/* 1 forces the portable scalar kernels; 0 lets the engine use SIMD when the CPU has it. */
int k3_model_set_scalar(k3_model *m, int32_t on);
/* 1 if SIMD kernels are in use right now. */
int32_t k3_model_simd_active(const k3_model *m);
int k3_model_stats(const k3_model *m, k3_stats *out);
/* Test hook: the next read of (layer, expert) fails with EIO (expert -1: that layer's
 * streamed trunk; -2: any expert of that layer; -3: the next streamed lm_head block,
 * layer ignored; -4: that layer's split FFN down matrix, the unit after gate and up).
 * kind 0 clears. */
int k3_model_inject_fault(k3_model *m, int32_t layer, int32_t expert, int32_t kind);
/* Stateless full forward over ids[0..n): logits_all gets n*V floats.
 * shared_kda_slot = 1 uses one KDA state slot re-zeroed before each KDA layer. */
int k3_model_forward(k3_model *m, const int32_t *ids, int32_t n, float *logits_all,
                     int32_t shared_kda_slot);

/* ---- session: one conversation's state ---- */
int k3_session_create(k3_model *m, int32_t max_positions, k3_session **out);
void k3_session_free(k3_session *s);
const char *k3_session_error(const k3_session *s);
int k3_session_reset(k3_session *s);
int32_t k3_session_length(const k3_session *s);
int32_t k3_session_capacity(const k3_session *s);
/* 1 when a failed or cancelled feed left the state unusable (reset or restore first). */
int32_t k3_session_tainted(const k3_session *s);
/* Copies min(cap, length) fed ids into out. */
int32_t k3_session_ids(const k3_session *s, int32_t *out, int32_t cap);
/* Feed ids at positions length..length+n-1.  logits_last (V floats) and logits_all
 * (n*V floats) may each be NULL.  cancel, if not NULL, is polled between layers. */
int k3_session_feed(k3_session *s, const int32_t *ids, int32_t n, float *logits_last,
                    float *logits_all, const volatile int32_t *cancel);

/* Speculative decoding.  k3_session_verify computes ids[0..n) at positions length.. in one
 * pass (logits_all gets n*V floats) without advancing the session; k3_session_accept(s, keep)
 * then advances it by the first keep of them (0..n), bit for bit as feeding them would.  Any
 * other feed, a reset, an import or a restore drops a pending verify.  A failed or cancelled
 * verify leaves the session as it was (never tainted). */
int k3_session_verify(k3_session *s, const int32_t *ids, int32_t n, float *logits_all,
                      const volatile int32_t *cancel);
int k3_session_accept(k3_session *s, int32_t keep);
/* Bytes of the verify record a session allocates for n positions (the planner counts it). */
uint64_t k3_verify_bytes(const k3_model *m, int32_t n);

/* Whole state as bytes (layout in k3_state.c): ids, KDA S and conv histories, MLA rows. */
int k3_session_state_size(const k3_session *s, uint64_t *size);
int k3_session_export(const k3_session *s, void *buf, uint64_t size);
int k3_session_import(k3_session *s, const void *buf, uint64_t size);

/* In-memory snapshots at turn boundaries. */
int k3_session_snapshot(k3_session *s, int32_t *snap_id);
int k3_session_restore(k3_session *s, int32_t snap_id);
int k3_session_snapshot_drop(k3_session *s, int32_t snap_id);

/* ---- kernels, exposed for their own tests and for benchmarks ---- */
/* y[t*rows + r] = W[r,:] . x[t*cols + :] for an MXFP4 matrix (packed [rows, cols/2],
 * scales [rows, cols/32]); simd 0 forces the portable path.  Returns the number of
 * scale-255 groups met (decoded as zeros). */
int64_t k3_kernel_mxfp4(const uint8_t *packed, const uint8_t *scales, int32_t rows, int32_t cols,
                        const float *x, int32_t ntok, float *y, int32_t simd, int32_t threads);
/* Decode an MXFP4 matrix to floats (out: rows * cols); returns scale-255 groups met. */
int64_t k3_kernel_mxfp4_decode(const uint8_t *packed, const uint8_t *scales, int32_t rows,
                               int32_t cols, float *out);
/* The same for a BF16 matrix [rows, cols]. */
int k3_kernel_bf16(const uint16_t *w, int32_t rows, int32_t cols, const float *x, int32_t ntok,
                   float *y, int32_t simd, int32_t threads);
/* The same two with the register-blocked multi-token SIMD path (blocked 1, the default
 * everywhere else) or the path before it, one token at a time (blocked 0): same bits,
 * kept so that a benchmark measures one against the other. */
int64_t k3_kernel_mxfp4_path(const uint8_t *packed, const uint8_t *scales, int32_t rows, int32_t cols,
                             const float *x, int32_t ntok, float *y, int32_t simd, int32_t threads,
                             int32_t blocked);
int k3_kernel_bf16_path(const uint16_t *w, int32_t rows, int32_t cols, const float *x, int32_t ntok,
                        float *y, int32_t simd, int32_t threads, int32_t blocked);
/* The machine's double multiply-add peak in GFLOP/s (2 flops per multiply-add): independent
 * chains on `threads` threads for about `seconds`, with the SIMD kernels' vectors when SIMD
 * is available (k3_simd_kind).  -1 for seconds outside (0, 60] or threads outside 1..64. */
double k3_fma_peak_gflops(double seconds, int32_t threads);
int32_t k3_cpu_has_avx2(void);
/* The SIMD kernels this build runs when SIMD is on: "avx2", "neon" or "none" (every
 * path gives the scalar path's bits). */
const char *k3_simd_kind(void);
/* How direct_io reads bypass the page cache here: "O_DIRECT" (Linux), "F_NOCACHE"
 * (macOS) or "none" (buffered only). */
const char *k3_direct_io_kind(void);

#endif
