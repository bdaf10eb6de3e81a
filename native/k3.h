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
} k3_stats;

typedef struct k3_model k3_model;
typedef struct k3_session k3_session;

/* ---- model ---- */
int k3_model_open(const k3_config *cfg, const char *const *shard_paths, int32_t n_shards,
                  const k3_tensor_desc *tensors, int32_t n_tensors, k3_model **out,
                  char *err, size_t errlen);
void k3_model_close(k3_model *m);
const char *k3_model_error(const k3_model *m);
/* Threads used by this model's kernels (1..64); output bits never depend on it. */
int k3_model_set_threads(k3_model *m, int32_t n);
/* 1 forces the portable scalar kernels; 0 lets the engine use SIMD when the CPU has it. */
int k3_model_set_scalar(k3_model *m, int32_t on);
/* 1 if SIMD kernels are in use right now. */
int32_t k3_model_simd_active(const k3_model *m);
int k3_model_stats(const k3_model *m, k3_stats *out);
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

/* Whole state as bytes (layout in k3_state.c): ids, KDA S and conv histories, MLA rows. */
int k3_session_state_size(const k3_session *s, uint64_t *size);
int k3_session_export(const k3_session *s, void *buf, uint64_t size);
int k3_session_import(k3_session *s, const void *buf, uint64_t size);

/* In-memory snapshots at turn boundaries. */
int k3_session_snapshot(k3_session *s, int32_t *snap_id);
int k3_session_restore(k3_session *s, int32_t snap_id);
int k3_session_snapshot_drop(k3_session *s, int32_t snap_id);

#endif
