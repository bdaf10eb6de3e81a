/* k3_load.c: model open: config sanity, tensor binding with shape checks, trunk reads.
 *
 * Each layer's trunk tensors are read with one request when they tile one gap-free
 * run in one shard (verified here from the descriptors), else tensor by tensor; both
 * paths deliver the same bytes and the fallback is counted.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "k3_internal.h"
#include "k3_platform.h"

#define KM_PREFIX "language_model.model."

void km_set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* ---- name lookup: open addressing over descriptor indices ---- */
typedef struct {
    const k3_tensor_desc *t;
    int32_t n;
    int32_t *slots;
    uint32_t mask;
} km_index;

static uint32_t km_hash(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

static int km_index_build(km_index *ix, const k3_tensor_desc *t, int32_t n) {
    uint32_t cap = 16;
    while (cap < (uint32_t)n * 2u) cap <<= 1;
    ix->slots = (int32_t *)malloc(sizeof(int32_t) * cap);
    if (!ix->slots) return -1;
    memset(ix->slots, 0xff, sizeof(int32_t) * cap);
    ix->t = t;
    ix->n = n;
    ix->mask = cap - 1;
    for (int32_t i = 0; i < n; i++) {
        uint32_t h = km_hash(t[i].name) & ix->mask;
        while (ix->slots[h] >= 0) {
            if (strcmp(t[ix->slots[h]].name, t[i].name) == 0) return -2; /* duplicate */
            h = (h + 1) & ix->mask;
        }
        ix->slots[h] = i;
    }
    return 0;
}

static const k3_tensor_desc *km_find(const km_index *ix, const char *name) {
    uint32_t h = km_hash(name) & ix->mask;
    while (ix->slots[h] >= 0) {
        if (strcmp(ix->t[ix->slots[h]].name, name) == 0) return &ix->t[ix->slots[h]];
        h = (h + 1) & ix->mask;
    }
    return NULL;
}

/* ---- allocation bookkeeping ---- */
static void *km_alloc(k3_model *m, size_t bytes) {
    if (m->n_allocs == m->cap_allocs) {
        int nc = m->cap_allocs ? m->cap_allocs * 2 : 256;
        void **na = (void **)realloc(m->allocs, sizeof(void *) * nc);
        if (!na) return NULL;
        m->allocs = na;
        m->cap_allocs = nc;
    }
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) return NULL;
    m->allocs[m->n_allocs++] = p;
    return p;
}

static size_t km_elsize(int dt) { return dt == K3_DT_F32 ? 4 : dt == K3_DT_U8 ? 1 : 2; }

/* ---- per-layer loader: either one run buffer or per-tensor reads ---- */
typedef struct {
    k3_model *m;
    const km_index *ix;
    uint8_t *run;     /* the layer's run, or NULL */
    int run_shard;
    uint64_t run_lo, run_hi;
    char *err;
    size_t errlen;
    int failed;
    int io_failed;    /* the failure was a read, not a bad tensor */
    kr_unit *stream;  /* non-NULL: record matrices for the ring instead of reading them */
    kr_unit *units;   /* the layer's two units when it streams */
} km_loader;

static int km_cmp_desc_off(const void *a, const void *b) {
    const k3_tensor_desc *x = *(const k3_tensor_desc *const *)a, *y = *(const k3_tensor_desc *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Returns the raw bytes of t (malloc'd copy when read alone; *owned set). */
static const uint8_t *km_raw(km_loader *ld, const k3_tensor_desc *t, uint8_t **owned) {
    *owned = NULL;
    if (ld->run && t->shard == ld->run_shard && t->offset >= ld->run_lo &&
        t->offset + t->nbytes <= ld->run_hi)
        return ld->run + (t->offset - ld->run_lo);
    uint8_t *buf = (uint8_t *)malloc(t->nbytes ? t->nbytes : 1);
    if (!buf) {
        km_set_err(ld->err, ld->errlen, "out of memory reading %s (%llu bytes)", t->name,
                   (unsigned long long)t->nbytes);
        return NULL;
    }
    int rc = kt_pread_full(ld->m->shards[t->shard].fd, buf, t->nbytes, t->offset);
    if (rc != 0) {
        km_set_err(ld->err, ld->errlen, "read of %s failed: shard %s offset %llu length %llu: %s",
                   t->name, ld->m->shards[t->shard].path, (unsigned long long)t->offset,
                   (unsigned long long)t->nbytes, strerror(-rc));
        free(buf);
        ld->io_failed = 1;
        return NULL;
    }
    __atomic_add_fetch(&ld->m->stats.trunk_bytes_read, t->nbytes, __ATOMIC_RELAXED);
    *owned = buf;
    return buf;
}

static const k3_tensor_desc *km_need(km_loader *ld, const char *name, int ndim,
                                     const int64_t *shape, int is_matrix) {
    if (ld->failed) return NULL;
    const k3_tensor_desc *t = km_find(ld->ix, name);
    if (!t) {
        km_set_err(ld->err, ld->errlen, "tensor %s is missing from the tensor table", name);
        ld->failed = 1;
        return NULL;
    }
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        if (shape[i] >= 0 && t->shape[i] != shape[i]) ok = 0;
    if (!ok) {
        km_set_err(ld->err, ld->errlen, "tensor %s has shape [%lld,%lld,%lld] (ndim %d), expected ndim %d [%lld,%lld,%lld]",
                   name, (long long)t->shape[0], (long long)(t->ndim > 1 ? t->shape[1] : 0),
                   (long long)(t->ndim > 2 ? t->shape[2] : 0), t->ndim, ndim, (long long)shape[0],
                   (long long)(ndim > 1 ? shape[1] : 0), (long long)(ndim > 2 ? shape[2] : 0));
        ld->failed = 1;
        return NULL;
    }
    if (t->dtype != K3_DT_BF16 && t->dtype != K3_DT_F16 && t->dtype != K3_DT_F32) {
        km_set_err(ld->err, ld->errlen, "tensor %s has dtype code %d; non-expert tensors must be BF16, F16 or F32",
                   name, t->dtype);
        ld->failed = 1;
        return NULL;
    }
    uint64_t numel = 1;
    for (int i = 0; i < ndim; i++) numel *= (uint64_t)t->shape[i];
    if (numel * km_elsize(t->dtype) != t->nbytes || t->shard < 0 || t->shard >= ld->m->n_shards) {
        km_set_err(ld->err, ld->errlen, "tensor %s: byte length or shard does not match its shape", name);
        ld->failed = 1;
        return NULL;
    }
    (void)is_matrix;
    return t;
}

static void km_widen(const uint8_t *raw, int dtype, uint64_t n, float *out) {
    for (uint64_t i = 0; i < n; i++) {
        if (dtype == K3_DT_F32) {
            memcpy(&out[i], raw + 4 * i, 4);
        } else {
            uint16_t h;
            memcpy(&h, raw + 2 * i, 2);
            out[i] = dtype == K3_DT_BF16 ? kk_bf16_to_f32(h) : kk_f16_to_f32(h);
        }
    }
}

/* A small tensor widened to fp32. */
static float *km_vec(km_loader *ld, const char *name, int ndim, const int64_t *shape) {
    const k3_tensor_desc *t = km_need(ld, name, ndim, shape, 0);
    if (!t) return NULL;
    uint64_t n = t->nbytes / km_elsize(t->dtype);
    float *out = (float *)km_alloc(ld->m, sizeof(float) * n);
    uint8_t *owned;
    const uint8_t *raw = out ? km_raw(ld, t, &owned) : NULL;
    if (!raw) {
        if (!out) km_set_err(ld->err, ld->errlen, "out of memory for %s", name);
        ld->failed = 1;
        return NULL;
    }
    km_widen(raw, t->dtype, n, out);
    free(owned);
    return out;
}

/* A matrix kept in its stored dtype, copied to an aligned buffer. */
static void km_mat(km_loader *ld, const char *name, int64_t rows, int64_t cols, kk_mat *dst) {
    int64_t shape[2] = {rows, cols};
    const k3_tensor_desc *t = km_need(ld, name, 2, shape, 1);
    if (!t) return;
    dst->dtype = t->dtype;
    dst->rows = (int32_t)rows;
    dst->cols = (int32_t)cols;
    if (ld->stream) { /* bytes arrive through the ring at use time */
        kr_unit *sl = ld->stream;
        if (sl->n == sl->cap) {
            int nc = sl->cap ? sl->cap * 2 : 16;
            kr_entry *ne = (kr_entry *)realloc(sl->e, sizeof(kr_entry) * (size_t)nc);
            if (!ne) {
                km_set_err(ld->err, ld->errlen, "out of memory");
                ld->failed = 1;
                return;
            }
            sl->e = ne;
            sl->cap = nc;
        }
        kr_entry *en = &sl->e[sl->n++];
        en->dst = dst;
        en->shard = t->shard;
        en->off = t->offset;
        en->nbytes = t->nbytes;
        en->slot_off = 0;
        dst->data = NULL;
        return;
    }
    void *buf = km_alloc(ld->m, t->nbytes);
    uint8_t *owned;
    const uint8_t *raw = buf ? km_raw(ld, t, &owned) : NULL;
    if (!raw) {
        if (!buf) km_set_err(ld->err, ld->errlen, "out of memory for %s", name);
        ld->failed = 1;
        return;
    }
    memcpy(buf, raw, t->nbytes);
    free(owned);
    dst->data = buf;
    dst->dtype = t->dtype;
    dst->rows = (int32_t)rows;
    dst->cols = (int32_t)cols;
}

static void km_name(char *out, size_t n, int L, const char *suffix) {
    snprintf(out, n, KM_PREFIX "layers.%d.%s", L, suffix);
}

static int km_layer_of(const char *name) {
    size_t pl = strlen(KM_PREFIX "layers.");
    if (strncmp(name, KM_PREFIX "layers.", pl) != 0) return -1;
    return atoi(name + pl);
}

/* Verify that the layer's trunk tensors tile one run; if so read it in one request. */
static int km_read_run(km_loader *ld, int L, const k3_tensor_desc **trunk, int nt) {
    ld->run = NULL;
    if (nt == 0) return 0;
    for (int i = 0; i < nt; i++)
        if (trunk[i]->shard < 0 || trunk[i]->shard >= ld->m->n_shards ||
            trunk[i]->offset > UINT64_MAX - trunk[i]->nbytes) {
            km_set_err(ld->err, ld->errlen, "tensor %s: shard index or byte range out of bounds", trunk[i]->name);
            ld->failed = 1;
            return -1;
        }
    qsort(trunk, (size_t)nt, sizeof(trunk[0]), km_cmp_desc_off);
    int shard = trunk[0]->shard, ok = 1;
    uint64_t end = trunk[0]->offset;
    for (int i = 0; i < nt && ok; i++) {
        if (trunk[i]->shard != shard || trunk[i]->offset != end) ok = 0;
        end = trunk[i]->offset + trunk[i]->nbytes;
    }
    if (!ok) {
        __atomic_add_fetch(&ld->m->stats.trunk_fallback_reads, 1, __ATOMIC_RELAXED);
        return 0;
    }
    uint64_t lo = trunk[0]->offset, len = end - lo;
    ld->run = (uint8_t *)malloc(len ? len : 1);
    if (!ld->run) {
        km_set_err(ld->err, ld->errlen, "out of memory reading layer %d trunk (%llu bytes)", L,
                   (unsigned long long)len);
        return -1;
    }
    int rc = kt_pread_full(ld->m->shards[shard].fd, ld->run, len, lo);
    if (rc != 0) {
        km_set_err(ld->err, ld->errlen, "read of layer %d trunk failed: shard %s offset %llu length %llu: %s",
                   L, ld->m->shards[shard].path, (unsigned long long)lo, (unsigned long long)len,
                   strerror(-rc));
        free(ld->run);
        ld->run = NULL;
        return -1;
    }
    ld->run_shard = shard;
    ld->run_lo = lo;
    ld->run_hi = end;
    __atomic_add_fetch(&ld->m->stats.trunk_bytes_read, len, __ATOMIC_RELAXED);
    __atomic_add_fetch(&ld->m->stats.trunk_run_reads, 1, __ATOMIC_RELAXED);
    return 0;
}

static void km_fold_res(k3_model *m, km_loader *ld, const char *norm, const char *proj,
                        float **dst) {
    const k3_config *c = &m->cfg;
    int64_t s1[1] = {c->hidden}, s2[2] = {1, c->hidden};
    float *w = km_vec(ld, norm, 1, s1), *p = km_vec(ld, proj, 2, s2);
    if (!w || !p) return;
    /* score vector u = norm weight (.) proj, folded once at load */
    for (int i = 0; i < c->hidden; i++) w[i] = w[i] * p[i];
    *dst = w;
}

static void km_bind_layer(k3_model *m, km_loader *ld, int L) {
    const k3_config *c = &m->cfg;
    km_layer *ly = &m->layers[L];
    char nm[256], nm2[256];
    int64_t E = c->hidden, P = (int64_t)c->kda_heads * c->kda_head_dim;
    int64_t vE[1] = {E};
#define N(s) (km_name(nm, sizeof nm, L, s), nm)
    ly->input_norm = km_vec(ld, N("input_layernorm.weight"), 1, vE);
    ly->post_norm = km_vec(ld, N("post_attention_layernorm.weight"), 1, vE);
    km_name(nm2, sizeof nm2, L, "self_attention_res_proj.weight");
    km_fold_res(m, ld, N("self_attention_res_norm.weight"), nm2, &ly->attn_res_u);
    km_name(nm2, sizeof nm2, L, "mlp_res_proj.weight");
    km_fold_res(m, ld, N("mlp_res_norm.weight"), nm2, &ly->mlp_res_u);
    if (ld->units) ld->stream = &ld->units[KR_ATTN];
    if (!ly->is_mla) {
        int64_t H = c->kda_heads, D = c->kda_head_dim, K = c->conv_kernel;
        km_mat(ld, N("self_attn.q_proj.weight"), P, E, &ly->q_proj);
        km_mat(ld, N("self_attn.k_proj.weight"), P, E, &ly->k_proj);
        km_mat(ld, N("self_attn.v_proj.weight"), P, E, &ly->v_proj);
        km_mat(ld, N("self_attn.g_proj.weight"), P, E, &ly->g_proj_kda);
        km_mat(ld, N("self_attn.o_proj.weight"), E, P, &ly->o_proj);
        km_mat(ld, N("self_attn.f_a_proj.weight"), D, E, &ly->f_a);
        km_mat(ld, N("self_attn.f_b_proj.weight"), P, D, &ly->f_b);
        km_mat(ld, N("self_attn.b_proj.weight"), H, E, &ly->b_proj);
        int64_t cs[3] = {P, 1, K}, ds[1] = {P}, ns[1] = {D}, as[1] = {-1};
        ly->q_conv = km_vec(ld, N("self_attn.q_conv1d.weight"), 3, cs);
        ly->k_conv = km_vec(ld, N("self_attn.k_conv1d.weight"), 3, cs);
        ly->v_conv = km_vec(ld, N("self_attn.v_conv1d.weight"), 3, cs);
        ly->dt_bias = km_vec(ld, N("self_attn.dt_bias"), 1, ds);
        ly->o_norm = km_vec(ld, N("self_attn.o_norm.weight"), 1, ns);
        const k3_tensor_desc *at = ld->failed ? NULL : km_find(ld->ix, N("self_attn.A_log"));
        ly->a_log = km_vec(ld, N("self_attn.A_log"), 1, as);
        if (ly->a_log && at) {
            /* the release ships A_log zero-padded to 128; only the first H_k are used */
            if (at->shape[0] < H) {
                km_set_err(ld->err, ld->errlen, "%s has %lld entries, fewer than the %lld KDA heads", nm,
                           (long long)at->shape[0], (long long)H);
                ld->failed = 1;
            }
            for (int64_t i = H; !ld->failed && i < at->shape[0]; i++)
                if (ly->a_log[i] != 0.0f) {
                    km_set_err(ld->err, ld->errlen, "%s: padding entry %lld is %g, expected exactly 0", nm,
                               (long long)i, (double)ly->a_log[i]);
                    ld->failed = 1;
                }
        }
    } else {
        int64_t H = c->mla_heads, dqk = c->qk_nope_dim + c->qk_rope_dim;
        int64_t rq[1] = {c->q_lora_rank}, rkv[1] = {c->kv_lora_rank};
        km_mat(ld, N("self_attn.q_a_proj.weight"), c->q_lora_rank, E, &ly->q_a);
        ly->q_a_norm = km_vec(ld, N("self_attn.q_a_layernorm.weight"), 1, rq);
        km_mat(ld, N("self_attn.q_b_proj.weight"), H * dqk, c->q_lora_rank, &ly->q_b);
        km_mat(ld, N("self_attn.kv_a_proj_with_mqa.weight"), c->kv_lora_rank + c->qk_rope_dim, E,
               &ly->kv_a);
        ly->kv_a_norm = km_vec(ld, N("self_attn.kv_a_layernorm.weight"), 1, rkv);
        km_mat(ld, N("self_attn.kv_b_proj.weight"), H * (c->qk_nope_dim + c->v_head_dim),
               c->kv_lora_rank, &ly->kv_b);
        km_mat(ld, N("self_attn.g_proj.weight"), H * c->v_head_dim, E, &ly->g_proj_mla);
        km_mat(ld, N("self_attn.o_proj.weight"), E, H * c->v_head_dim, &ly->o_proj);
    }
    if (ld->units) ld->stream = &ld->units[KR_FFN];
    if (!ly->is_moe) { /* split: each matrix its own unit, in the order dense_forward_split takes them */
        km_mat(ld, N("mlp.gate_proj.weight"), c->dense_width, E, &ly->mlp_gate);
        if (ld->units && ly->ffn_split) ld->stream = &ld->units[KR_FFN_UP];
        km_mat(ld, N("mlp.up_proj.weight"), c->dense_width, E, &ly->mlp_up);
        if (ld->units && ly->ffn_split) ld->stream = &ld->units[KR_FFN_DOWN];
        km_mat(ld, N("mlp.down_proj.weight"), E, c->dense_width, &ly->mlp_down);
    } else {
        int64_t ne[1] = {c->n_experts}, nl[1] = {c->latent_dim};
        /* with lookahead the router stays resident: layer L-1 runs it before this
         * layer's trunk has arrived */
        kr_unit *streaming = ld->stream;
        if (m->opts.lookahead > 0) ld->stream = NULL;
        km_mat(ld, N("block_sparse_moe.gate.weight"), c->n_experts, E, &ly->router);
        ld->stream = streaming;
        ly->router_bias = km_vec(ld, N("block_sparse_moe.gate.e_score_correction_bias"), 1, ne);
        km_mat(ld, N("block_sparse_moe.routed_expert_down_proj.weight"), c->latent_dim, E,
               &ly->lat_down);
        km_mat(ld, N("block_sparse_moe.routed_expert_up_proj.weight"), E, c->latent_dim,
               &ly->lat_up);
        ly->lat_norm = km_vec(ld, N("block_sparse_moe.routed_expert_norm.weight"), 1, nl);
        km_mat(ld, N("block_sparse_moe.shared_experts.gate_proj.weight"), c->shared_width, E,
               &ly->sh_gate);
        km_mat(ld, N("block_sparse_moe.shared_experts.up_proj.weight"), c->shared_width, E,
               &ly->sh_up);
        km_mat(ld, N("block_sparse_moe.shared_experts.down_proj.weight"), E, c->shared_width,
               &ly->sh_down);
    }
#undef N
}

/* Locate the six tensors of every routed expert and check their shapes. */
static int km_bind_experts(k3_model *m, const km_index *ix, int L, char *err, size_t errlen) {
    const k3_config *c = &m->cfg;
    km_layer *ly = &m->layers[L];
    ly->experts = (kx_expert_loc *)km_alloc(m, sizeof(kx_expert_loc) * (size_t)c->n_experts);
    if (!ly->experts) {
        km_set_err(err, errlen, "out of memory");
        return K3_ERR_NOMEM;
    }
    static const char *parts[6] = {"w1.weight_packed", "w1.weight_scale", "w2.weight_packed",
                                   "w2.weight_scale", "w3.weight_packed", "w3.weight_scale"};
    int64_t l = c->latent_dim, I = c->expert_width;
    int64_t shapes[6][2] = {{I, l / 2}, {I, l / 32}, {l, I / 2}, {l, I / 32}, {I, l / 2}, {I, l / 32}};
    char nm[256];
    for (int e = 0; e < c->n_experts; e++) {
        kx_expert_loc *loc = &ly->experts[e];
        loc->run = 1;
        for (int p = 0; p < 6; p++) {
            snprintf(nm, sizeof nm, KM_PREFIX "layers.%d.block_sparse_moe.experts.%d.%s", L, e, parts[p]);
            const k3_tensor_desc *t = km_find(ix, nm);
            if (!t) {
                km_set_err(err, errlen, "tensor %s is missing from the tensor table", nm);
                return K3_ERR_INVALID;
            }
            if (t->dtype != K3_DT_U8 || t->ndim != 2 || t->shape[0] != shapes[p][0] ||
                t->shape[1] != shapes[p][1] || t->nbytes != (uint64_t)(shapes[p][0] * shapes[p][1]) ||
                t->shard < 0 || t->shard >= m->n_shards) {
                km_set_err(err, errlen, "expert tensor %s must be U8 [%lld,%lld]", nm,
                           (long long)shapes[p][0], (long long)shapes[p][1]);
                return K3_ERR_INVALID;
            }
            loc->shard[p] = t->shard;
            loc->offset[p] = t->offset;
            loc->nbytes[p] = t->nbytes;
            if (p > 0 && (t->shard != loc->shard[0] || t->offset != loc->offset[p - 1] + loc->nbytes[p - 1]))
                loc->run = 0;
        }
    }
    return K3_OK;
}

static int km_check_config(const k3_config *c, char *err, size_t errlen) {
    if (c->n_layers < 1 || c->n_layers > K3_MAX_LAYERS || c->hidden < 1 || c->vocab < 1 ||
        c->kda_heads < 1 || c->kda_head_dim < 1 || c->conv_kernel < 1 || c->mla_heads < 1 ||
        c->q_lora_rank < 1 || c->kv_lora_rank < 1 || c->qk_nope_dim < 1 || c->qk_rope_dim < 0 ||
        c->v_head_dim < 1 || c->n_experts < 1 || c->top_k < 1 || c->top_k > c->n_experts ||
        c->latent_dim < 32 || c->latent_dim % 32 || c->expert_width < 32 || c->expert_width % 32 ||
        c->shared_width < 1 || c->dense_width < 1 || c->first_dense < 0 ||
        c->first_dense > c->n_layers || c->attn_res_block < 1 || !(c->rms_eps > 0) ||
        !(c->situ_beta1 > 0) || !(c->situ_beta2 > 0) || !(c->gate_lower_bound < 0) ||
        !(c->routed_scaling > 0) || c->latent_dim > 4096 * 4 || c->expert_width > 4096 * 4 || c->kda_head_dim > 1024 ||
        c->conv_kernel > 64 || c->kv_lora_rank > 65536) {
        km_set_err(err, errlen, "engine config is out of range (validate config.json first)");
        return K3_ERR_INVALID;
    }
    return K3_OK;
}

static void km_free_all(k3_model *m) {
    kx_store_destroy(m->store);
    kr_ring_destroy(m->ring);
    for (int L = 0; m->layers && L < m->cfg.n_layers; L++)
        for (int u = 0; u < KR_UNITS; u++) {
            free(m->layers[L].su[u].e);
            free(m->layers[L].su[u].reads);
            free(m->layers[L].su[u].pieces);
        }
    for (int i = 0; i < m->n_allocs; i++) free(m->allocs[i]);
    free(m->allocs);
    if (m->shards) {
        for (int i = 0; i < m->n_shards; i++) {
            if (m->shards[i].fd >= 0) close(m->shards[i].fd);
            free(m->shards[i].path);
        }
        free(m->shards);
    }
    free(m->layers);
    free(m);
}

int k3_model_open(const k3_config *cfg, const char *const *shard_paths, int32_t n_shards,
                  const k3_tensor_desc *tensors, int32_t n_tensors, const k3_open_opts *opts,
                  k3_model **out, char *err, size_t errlen) {
    *out = NULL;
    if (!cfg || !shard_paths || n_shards < 1 || !tensors || n_tensors < 1) {
        km_set_err(err, errlen, "k3_model_open: empty shard list or tensor table");
        return K3_ERR_INVALID;
    }
    int rc = km_check_config(cfg, err, errlen);
    if (rc) return rc;
    k3_model *m = (k3_model *)calloc(1, sizeof(k3_model));
    if (!m) return K3_ERR_NOMEM;
    m->cfg = *cfg;
    if (opts) m->opts = *opts;
    m->nthreads = 1;
    m->owner_pid = getpid();
    m->simd_available = kk_cpu_has_simd();
    m->shards = (kt_shard *)calloc((size_t)n_shards, sizeof(kt_shard));
    m->layers = (km_layer *)calloc((size_t)cfg->n_layers, sizeof(km_layer));
    if (!m->shards || !m->layers) {
        km_free_all(m);
        return K3_ERR_NOMEM;
    }
    m->n_shards = n_shards;
    for (int i = 0; i < n_shards; i++) m->shards[i].fd = -1;
    for (int i = 0; i < n_shards; i++) {
        m->shards[i].path = strdup(shard_paths[i]);
        if (!m->shards[i].path) {
            km_free_all(m);
            return K3_ERR_NOMEM;
        }
        m->shards[i].fd = open(shard_paths[i], O_RDONLY | O_CLOEXEC);
        if (m->shards[i].fd < 0) {
            km_set_err(err, errlen, "cannot open shard %s: %s", shard_paths[i], strerror(errno));
            km_free_all(m);
            return K3_ERR_IO;
        }
        if (m->opts.direct_io) kos_prefer_uncached(m->shards[i].fd); /* macOS: streamed reads too */
    }
    km_index ix;
    int ir = km_index_build(&ix, tensors, n_tensors);
    if (ir != 0) {
        km_set_err(err, errlen, ir == -2 ? "tensor table has a duplicate name" : "out of memory");
        free(ix.slots);
        km_free_all(m);
        return ir == -2 ? K3_ERR_INVALID : K3_ERR_NOMEM;
    }
    /* bucket each layer's trunk (non-expert) descriptors for the run check */
    int32_t *count = (int32_t *)calloc((size_t)cfg->n_layers + 1, sizeof(int32_t));
    const k3_tensor_desc **byl = (const k3_tensor_desc **)malloc(sizeof(void *) * (size_t)n_tensors);
    int32_t *start = (int32_t *)calloc((size_t)cfg->n_layers + 1, sizeof(int32_t));
    rc = (!count || !byl || !start) ? K3_ERR_NOMEM : K3_OK;
    for (int32_t i = 0; rc == K3_OK && i < n_tensors; i++) {
        int L = km_layer_of(tensors[i].name);
        if (L >= 0 && L < cfg->n_layers && !strstr(tensors[i].name, ".block_sparse_moe.experts."))
            count[L + 1]++;
    }
    for (int L = 0; rc == K3_OK && L < cfg->n_layers; L++) count[L + 1] += count[L];
    for (int32_t i = 0; rc == K3_OK && i < n_tensors; i++) {
        int L = km_layer_of(tensors[i].name);
        if (L >= 0 && L < cfg->n_layers && !strstr(tensors[i].name, ".block_sparse_moe.experts."))
            byl[count[L] + start[L]++] = &tensors[i];
    }
    int kda = 0, mla = 0;
    for (int L = 0; rc == K3_OK && L < cfg->n_layers; L++) {
        km_layer *ly = &m->layers[L];
        ly->is_mla = cfg->layer_is_mla[L] != 0;
        ly->is_moe = L >= cfg->first_dense;
        ly->kda_index = ly->is_mla ? -1 : kda++;
        ly->mla_index = ly->is_mla ? mla++ : -1;
        km_loader ld = {m, &ix, NULL, 0, 0, 0, err, errlen, 0, 0, NULL, NULL};
        ly->streamed = m->opts.trunk_stream && !m->opts.pinned[L];
        ly->ffn_split = ly->streamed && !ly->is_moe && m->opts.ffn_split;
        if (ly->streamed) {
            ld.units = ly->su; /* small vectors are read one by one and stay resident */
        } else if (km_read_run(&ld, L, byl + count[L], count[L + 1] - count[L]) != 0) {
            rc = ld.failed ? K3_ERR_INVALID : K3_ERR_IO;
            break;
        }
        km_bind_layer(m, &ld, L);
        free(ld.run);
        int layout_failed = 0;
        for (int u = 0; ly->streamed && !ld.failed && u < KR_UNITS; u++)
            layout_failed |= kr_unit_layout(&ly->su[u], m->opts.trunk_piece_bytes ? m->opts.trunk_piece_bytes : KR_PIECE) != 0; /* unused units are empty: no-op */
        if (layout_failed) {
            km_set_err(err, errlen, "out of memory planning the reads of layer %d", L);
            rc = K3_ERR_NOMEM;
            break;
        }
        if (ld.failed) {
            rc = ld.io_failed ? K3_ERR_IO : K3_ERR_INVALID;
            break;
        }
        if (ly->is_moe) rc = km_bind_experts(m, &ix, L, err, errlen);
    }
    m->n_kda = kda;
    m->n_mla = mla;
    if (rc == K3_OK) {
        km_loader ld = {m, &ix, NULL, 0, 0, 0, err, errlen, 0, 0, NULL, NULL};
        int64_t E = cfg->hidden, vE[1] = {E}, es[2] = {cfg->vocab, E};
        if (m->opts.embed_stream) { /* a row gather: read each token's row when it is fed */
            const k3_tensor_desc *t = km_need(&ld, KM_PREFIX "embed_tokens.weight", 2, es, 1);
            if (t) {
                m->embed.data = NULL;
                m->embed.dtype = t->dtype;
                m->embed.rows = cfg->vocab;
                m->embed.cols = (int32_t)E;
                m->embed_shard = t->shard;
                m->embed_off = t->offset;
            }
        } else {
            km_mat(&ld, KM_PREFIX "embed_tokens.weight", cfg->vocab, E, &m->embed);
        }
        if (m->opts.head_block_rows > 0) { /* row blocks read per pass (km_head) */
            const k3_tensor_desc *t = km_need(&ld, "language_model.lm_head.weight", 2, es, 1);
            if (t) {
                m->lm_head.data = NULL;
                m->lm_head.dtype = t->dtype;
                m->lm_head.rows = cfg->vocab;
                m->lm_head.cols = (int32_t)E;
                m->head_shard = t->shard;
                m->head_off = t->offset;
            }
        } else {
            km_mat(&ld, "language_model.lm_head.weight", cfg->vocab, E, &m->lm_head);
        }
        m->final_norm = km_vec(&ld, KM_PREFIX "norm.weight", 1, vE);
        km_fold_res(m, &ld, KM_PREFIX "output_attn_res_norm.weight",
                    KM_PREFIX "output_attn_res_proj.weight", &m->out_res_u);
        if (ld.failed) rc = ld.io_failed ? K3_ERR_IO : K3_ERR_INVALID;
    }
    free(count);
    free(byl);
    free(start);
    free(ix.slots);
    if (rc == K3_OK) rc = kx_store_create(m, &m->opts, &m->store, err, errlen);
    if (rc == K3_OK && m->opts.trunk_stream) rc = kr_ring_create(m, err, errlen);
    if (rc != K3_OK) {
        km_free_all(m);
        return rc;
    }
    *out = m;
    return K3_OK;
}

int km_check_owner(const k3_model *m, char *err, size_t errlen) {
    if (m->owner_pid == getpid()) return K3_OK;
    km_set_err(err, errlen, "this model was opened by process %ld and inherited through fork(); "
               "its reader threads exist only there: open the model again in this process",
               (long)m->owner_pid);
    return K3_ERR_RUNTIME;
}

void k3_model_close(k3_model *m) {
    /* A forked child's copy: joining the parent's reader threads would wait forever and
     * their buffers may be mid-read, so the copy is left for the process exit to drop. */
    if (m && m->owner_pid == getpid()) km_free_all(m);
}
