/* k3_internal.h: structures shared by the engine's components.
 *
 * Prefixes: kp_ thread pool, kk_ kernels, kt_ tensors and shard I/O, kx_ expert
 * source, kda_ Kimi Delta Attention, mla_ gated MLA, moe_ LatentMoE, km_ model
 * wiring, ks_ session state.
 */
#ifndef K3_INTERNAL_H
#define K3_INTERNAL_H

#include <stdint.h>
#include <stddef.h>
#include <sys/types.h>
#include "k3.h"

/* The spec fixes these norms' epsilon at 1e-5 whatever rms_norm_eps says: AttnRes keys,
 * KDA o_norm and the routed-expert norm (spec 5.2). */
#define K3_EPS_FIXED 1e-5f

/* ---------------- thread pool (k3_pool.c) ---------------- */
typedef void (*kp_fn)(void *ctx, int begin, int end);
/* Runs fn over [0, n) split into at most nthreads contiguous ranges. Results must not
 * depend on the split: every caller writes disjoint outputs with per-item arithmetic. */
void kp_parallel_for(int nthreads, int n, kp_fn fn, void *ctx);

/* ---------------- kernels (k3_kernels.c) ---------------- */
typedef struct kk_mat {
    const void *data; /* row-major [rows, cols], dtype below, suitably aligned */
    int32_t dtype;    /* K3_DT_BF16, K3_DT_F16 or K3_DT_F32 */
    int32_t rows, cols;
} kk_mat;

typedef struct kk_ctx {
    int nthreads;
    int simd; /* 1: SIMD kernels, AVX2 or NEON (same bits as scalar) */
    int per_token; /* 1: SIMD matmuls one token at a time, the path before register blocking
                    * (same bits; kept so benchmarks measure the blocking); 0: blocked */
    uint64_t *madds; /* if not NULL, every matmul adds the multiply-adds it does (atomic) */
} kk_ctx;

int kk_cpu_has_avx2(void);
/* 1 when this build has SIMD kernels the CPU can run (AVX2+FMA on x86-64, NEON on AArch64). */
int kk_cpu_has_simd(void);
/* Dot product with the engine's one reduction order (8 double lanes, fixed tree),
 * rounded once to float (kk_dot) or kept in double (kk_dot_d). */
float kk_dot(const float *a, const float *b, int n, int simd);
double kk_dot_d(const float *a, const float *b, int n, int simd);
/* Dot of one weight row (any dtype) with x, same order as kk_dot. */
float kk_dot_row(const kk_mat *w, int row, const float *x, int simd);
/* Y[t*ldy + r] = W[r,:] . X[t*ldx + :] for r < rows, t < ntok. */
void kk_matmul(const kk_ctx *c, const kk_mat *w, const float *X, int ldx, int ntok, float *Y,
               int ldy);
/* MXFP4 matmul from packed bytes: rows x cols logical, packed [rows, cols/2],
 * scales [rows, cols/32]. Counts scale-255 groups in *nan_groups. */
void kk_mxfp4_matmul(const kk_ctx *c, const uint8_t *packed, const uint8_t *scales, int rows,
                     int cols, const float *X, int ldx, int ntok, float *Y, int ldy,
                     uint64_t *nan_groups);
void kk_mxfp4_decode_row(const uint8_t *packed, const uint8_t *scales, int cols, float *out,
                         uint64_t *nan_groups);
float kk_bf16_to_f32(uint16_t v);
float kk_f16_to_f32(uint16_t v);
void kk_rmsnorm(const float *x, const float *w, int n, float eps, float *out, int simd);
float kk_sigmoid(float x);
float kk_silu(float x);
float kk_situ(float g, float v, float b1, float b2);

/* ---------------- tensors and shard I/O (k3_tensors.c) ---------------- */
typedef struct kt_shard {
    char *path;
    int fd;
} kt_shard;

/* Reads [off, off+n) of a shard fully (pread loop). Returns 0 or -errno; short -> -EIO. */
int kt_pread_full(int fd, void *buf, uint64_t n, uint64_t off);

/* ---------------- expert store (k3_store.c) ---------------- */
typedef struct kx_view {
    const uint8_t *w1p, *w1s, *w2p, *w2s, *w3p, *w3s;
} kx_view;

typedef struct kx_expert_loc {
    int32_t shard[6];      /* per tensor, order w1p w1s w2p w2s w3p w3s */
    uint64_t offset[6];
    uint64_t nbytes[6];
    int32_t run;           /* 1: the six tensors tile one range in one shard */
} kx_expert_loc;

typedef struct kx_store kx_store;

int kx_store_create(k3_model *m, const k3_open_opts *o, kx_store **out, char *err, size_t errlen);
void kx_store_destroy(kx_store *s);
/* Largest number of experts one batch may pin. */
int kx_batch_limit(const kx_store *s);
/* Pin the batch's experts and start reading the missing ones (sorted by file offset). */
int kx_begin(kx_store *s, int layer, const int *experts, int n, char *err, size_t errlen);
/* The next expert of the batch whose bytes are ready, in arrival order. */
int kx_next(kx_store *s, int *expert, kx_view *view, char *err, size_t errlen);
/* Unpin the batch. */
void kx_end(kx_store *s);
/* Lookahead: start reading these experts of `layer` if absent (never pinned). */
void kx_hint(kx_store *s, int layer, const int *experts, int n);

/* ---------------- trunk stream (k3_ring.c) ---------------- */
/* One streamed matrix: where it lives in the shard and where it lands in a ring slot. */
typedef struct kr_entry {
    kk_mat *dst;
    int32_t shard;
    uint64_t off, nbytes, slot_off;
} kr_entry;

/* One read that fills part of a slot: adjacent tensors are coalesced into one request. */
typedef struct kr_read {
    int32_t shard;
    uint64_t off, len, slot_off;
} kr_read;

/* A streaming unit: the attention matrices or the FFN matrices of one layer; with
 * ffn_split a dense layer's FFN is three units, one matrix each, in the order it uses them. */
typedef struct kr_unit {
    kr_entry *e;
    int n, cap;
    kr_read *reads;
    int nreads;
    kr_read *pieces;       /* the reads cut into KR_PIECE-byte requests, issued in parallel */
    int npieces;
    uint64_t bytes;        /* slot bytes this unit needs */
} kr_unit;

/* Bytes per trunk read request unless the open options say otherwise: no cut, one request
 * per contiguous read (one reader with whole reads measured fastest on our test disk; several
 * readers with smaller pieces are the option for devices that want a deeper queue). */
#define KR_PIECE (1ull << 62)

/* KR_FFN is the whole FFN, or the gate matrix when the layer's FFN is split */
enum { KR_ATTN = 0, KR_FFN = 1, KR_FFN_UP = 2, KR_FFN_DOWN = 3, KR_UNITS = 4 };

typedef struct kr_ring kr_ring;
int kr_ring_create(k3_model *m, char *err, size_t errlen);
void kr_ring_destroy(kr_ring *r);
/* Wait until unit (L, u) is in a slot and bind its matrices. */
int kr_acquire(kr_ring *r, int L, int u, char *err, size_t errlen);
void kr_release(kr_ring *r, int L, int u);
/* Plan the reads of a unit (sorted, coalesced, element-aligned). */
int kr_unit_layout(kr_unit *u, uint64_t piece_bytes);

/* ---------------- model ---------------- */
typedef struct km_layer {
    int is_mla, is_moe, kda_index, mla_index;
    /* shared by all */
    float *input_norm, *post_norm;
    float *attn_res_u, *mlp_res_u; /* norm weight (.) proj, folded at load */
    kk_mat o_proj;
    /* KDA */
    kk_mat q_proj, k_proj, v_proj, g_proj_kda, f_a, f_b, b_proj;
    float *q_conv, *k_conv, *v_conv; /* [P, K] */
    float *a_log;                    /* [H_k] */
    float *dt_bias;                  /* [P] */
    float *o_norm;                   /* [D] */
    /* MLA */
    kk_mat q_a, q_b, kv_a, kv_b, g_proj_mla;
    float *q_a_norm, *kv_a_norm;
    /* dense FFN */
    kk_mat mlp_gate, mlp_up, mlp_down;
    /* MoE */
    kk_mat router, lat_down, lat_up, sh_gate, sh_up, sh_down;
    float *router_bias, *lat_norm;
    kx_expert_loc *experts; /* [n_experts] */
    int streamed;           /* matrices come through the trunk ring */
    int ffn_split;          /* streamed dense FFN: units KR_FFN (gate), KR_FFN_UP, KR_FFN_DOWN */
    kr_unit su[KR_UNITS];   /* KR_ATTN, KR_FFN, and with ffn_split KR_FFN_UP, KR_FFN_DOWN */
} km_layer;

struct k3_model {
    k3_config cfg;
    int n_kda, n_mla;
    kt_shard *shards;
    int n_shards;
    km_layer *layers;
    kk_mat embed, lm_head;
    int32_t embed_shard;    /* embedding rows read on demand when embed.data is NULL */
    uint64_t embed_off;
    int32_t head_shard;     /* lm_head read in row blocks per pass when lm_head.data is NULL */
    uint64_t head_off;
    float *final_norm, *out_res_u;
    void **allocs; /* every buffer owned by the model */
    int n_allocs, cap_allocs;
    kx_store *store;
    kr_ring *ring;
    k3_open_opts opts;
    int fault_layer, fault_expert, fault_kind;
    int nthreads, force_scalar, simd_available;
    k3_stats stats;
    pid_t owner_pid; /* the process that opened it: its reader threads live only there */
    char err[K3_ERRLEN];
};

/* K3_OK, or K3_ERR_RUNTIME with `err` set when `m` was inherited through fork(). */
int km_check_owner(const k3_model *m, char *err, size_t errlen);

/* Per-sequence recurrent state. */
typedef struct ks_state {
    int32_t len, cap;
    int32_t *ids;      /* [cap] */
    float **kda_s;     /* [n_kda] -> [H_k * D * D] */
    float **kda_conv;  /* [n_kda] -> [3 * P * (K-1)] (q, k, v) */
    float **mla_rows;  /* [n_mla] -> [cap * (kv_lora + rope)] */
    int shared_slot;   /* kda_s/kda_conv have one entry used by every KDA layer */
    int n_kda_slots, n_mla_slots; /* what was allocated: freeing never reads the model */
} ks_state;

int ks_alloc(const k3_model *m, ks_state *st, int32_t cap, int shared_slot);
void ks_free(ks_state *st);
void ks_zero(const k3_model *m, ks_state *st);
uint64_t ks_export_size(const k3_model *m, const ks_state *st);
void ks_export(const k3_model *m, const ks_state *st, void *buf);
int ks_import(const k3_model *m, ks_state *st, const void *buf, uint64_t size, char *err,
              size_t errlen);

/* What a verify feed keeps so that any prefix of it can be accepted (speculative decoding).
 * During the feed, each KDA layer runs on scratch copies of its state and conv history, so
 * the session's own KDA state stays at the pre-feed position; accepting m positions replays
 * the recurrence for those m from the per-position vectors kept here (no weight is read
 * again).  MLA rows and ids are written past st->len and kept or dropped by length. */
typedef struct kd_draft {
    int32_t cap;       /* positions each record holds */
    int32_t n;         /* positions of the pending verify feed; 0: nothing to accept */
    int32_t *ids;      /* [cap] */
    float *work_s;     /* one KDA layer's state, scratch [H_k * D * D] */
    float *work_conv;  /* [3 * P * (K-1)] */
    float **pre;       /* per KDA layer [cap][3P]: q, k, v before the conv */
    float **post;      /* per KDA layer [cap][3P + H_k]: k, v after the conv, decay z, beta */
    int n_layers;      /* entries of pre/post allocated */
} kd_draft;

/* Floats of a verify record for `cap` positions (the planner counts the same). */
size_t kd_draft_floats(const k3_model *m, int32_t cap);
int kd_draft_reserve(const k3_model *m, kd_draft *d, int32_t cap);
void kd_draft_free(kd_draft *d);
/* Advance the session's KDA state and conv histories by the first `keep` positions of the
 * pending feed: the same per-token arithmetic the feed ran, so bits equal a serial feed. */
void kda_accept(const k3_model *m, ks_state *st, const kd_draft *d, int keep);

/* Forward of ids at positions st->len.. ; writes logits; advances st->len on success. */
int km_forward(k3_model *m, ks_state *st, const int32_t *ids, int n, float *logits_last,
               float *logits_all, const volatile int32_t *cancel, char *err, size_t errlen);
/* One pass over ids at positions st->len.. that leaves st untouched (see kd_draft): the
 * logits of every position in logits_all; d->n = n on success. */
int km_verify(k3_model *m, ks_state *st, kd_draft *d, const int32_t *ids, int n, float *logits_all,
              const volatile int32_t *cancel, char *err, size_t errlen);

void km_kk_ctx(const k3_model *m, kk_ctx *c);

/* sublayers (each processes ntok tokens of one sequence, in order) */
/* draft: NULL, or a verify feed's record (S and conv are then read, never written) */
void kda_forward(const k3_model *m, const km_layer *ly, float *S, float *conv, const float *xn,
                 int ntok, float *out, float *scratch, kd_draft *draft);
size_t kda_scratch_floats(const k3_config *c, int ntok);
int mla_forward(const k3_model *m, const km_layer *ly, float *rows, int pos0, const float *xn,
                int ntok, float *out, float *scratch);
size_t mla_scratch_floats(const k3_config *c, int ntok, int npos);
int moe_forward(k3_model *m, int L, const km_layer *ly, const float *xn, int ntok, float *out,
                float *scratch, char *err, size_t errlen);
size_t moe_scratch_floats(const k3_config *c, int ntok);
void dense_forward(const k3_model *m, const km_layer *ly, const float *xn, int ntok, float *out,
                   float *scratch);
size_t dense_scratch_floats(const k3_config *c, int ntok);
/* dense_forward for a layer whose FFN is split: acquires and releases each matrix's unit
 * around the matmul that uses it (same arithmetic as dense_forward). */
int dense_forward_split(k3_model *m, int L, const km_layer *ly, const float *xn, int ntok,
                        float *out, float *scratch, char *err, size_t errlen);

/* time in ns (monotonic) */
uint64_t km_now_ns(void);
/* Reads [off, off+need) into buf starting at an aligned offset: accepts EOF after need. */
int kt_pread_atleast(int fd, void *buf, uint64_t n, uint64_t off, uint64_t need);

void km_set_err(char *err, size_t errlen, const char *fmt, ...);

#endif
