/* k3_model.c: model wiring: embedding, Block AttnRes, the layer loop, final norm and
 * lm_head (spec 5.1-5.3, 5.8).  Works on chunks of tokens of one sequence; every
 * per-token computation is the same whatever the chunk, so chunking never moves bits.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "k3_internal.h"

#define KM_CHUNK 64 /* prefill tokens per pass when the open options give none */

void km_kk_ctx(const k3_model *m, kk_ctx *c) {
    c->nthreads = m->nthreads;
    c->simd = m->simd_available && !m->force_scalar;
    c->per_token = 0;
    /* a statistics counter, bumped atomically like the readers' (the model is const here
     * only because the layer code reads it) */
    c->madds = (uint64_t *)&m->stats.matmul_madds;
}

/* AttnRes over sources src[0..n) for ntok tokens: softmax over key-normalised scores,
 * output the softmax-weighted sum of the raw sources in source order.  Scores, softmax
 * and the weighted sum are in double (as every reduction); each output rounds once. */
static void km_attn_res(const k3_model *m, float *const *src, int n, const float *u, int ntok,
                        float *out, int simd) {
    int E = m->cfg.hidden;
    double z[K3_MAX_LAYERS + 2];
    for (int t = 0; t < ntok; t++) {
        double mx = -INFINITY;
        for (int s = 0; s < n; s++) {
            const float *v = src[s] + (size_t)t * E;
            double inv = 1.0 / sqrt(kk_dot_d(v, v, E, simd) / (double)E + (double)K3_EPS_FIXED);
            z[s] = kk_dot_d(v, u, E, simd) * inv;
            if (z[s] > mx) mx = z[s];
        }
        double sum = 0.0;
        for (int s = 0; s < n; s++) {
            z[s] = exp(z[s] - mx);
            sum = sum + z[s];
        }
        for (int s = 0; s < n; s++) z[s] = z[s] / sum;
        float *o = out + (size_t)t * E;
        for (int i = 0; i < E; i++) {
            double acc = 0.0;
            for (int s = 0; s < n; s++) acc = acc + z[s] * (double)src[s][(size_t)t * E + i];
            o[i] = (float)acc;
        }
    }
}

static int km_embed(k3_model *m, const int32_t *ids, int ntok, float *h, char *err, size_t errlen) {
    int E = m->cfg.hidden;
    if (!m->embed.data) { /* rows read on demand: one small read per token */
        size_t el = m->embed.dtype == K3_DT_F32 ? 4 : 2, rowb = el * (size_t)E;
        uint8_t *row = (uint8_t *)malloc(rowb);
        if (!row) return K3_ERR_NOMEM;
        for (int t = 0; t < ntok; t++) {
            uint64_t off = m->embed_off + (uint64_t)ids[t] * rowb;
            int rc = kt_pread_full(m->shards[m->embed_shard].fd, row, rowb, off);
            if (rc != 0) {
                km_set_err(err, errlen, "read of the embedding row of token %d failed: shard %s offset %llu: %s", ids[t],
                           m->shards[m->embed_shard].path, (unsigned long long)off, strerror(-rc));
                free(row);
                return K3_ERR_IO;
            }
            __atomic_add_fetch(&m->stats.trunk_bytes_read, rowb, __ATOMIC_RELAXED);
            for (int i = 0; i < E; i++) {
                uint16_t v;
                if (el == 4) {
                    memcpy(&h[(size_t)t * E + i], row + 4 * i, 4);
                    continue;
                }
                memcpy(&v, row + 2 * i, 2);
                h[(size_t)t * E + i] = m->embed.dtype == K3_DT_BF16 ? kk_bf16_to_f32(v) : kk_f16_to_f32(v);
            }
        }
        free(row);
        return K3_OK;
    }
    for (int t = 0; t < ntok; t++) {
        const kk_mat *w = &m->embed;
        size_t off = (size_t)ids[t] * E;
        for (int i = 0; i < E; i++) {
            if (w->dtype == K3_DT_BF16)
                h[(size_t)t * E + i] = kk_bf16_to_f32(((const uint16_t *)w->data)[off + i]);
            else if (w->dtype == K3_DT_F16)
                h[(size_t)t * E + i] = kk_f16_to_f32(((const uint16_t *)w->data)[off + i]);
            else
                h[(size_t)t * E + i] = ((const float *)w->data)[off + i];
        }
    }
    return K3_OK;
}

static size_t km_max(size_t a, size_t b) { return a > b ? a : b; }

/* Consumes an injected lm_head fault (k3_model_inject_fault, expert -3). */
static int km_head_fault(k3_model *m) {
    if (!__atomic_load_n(&m->fault_kind, __ATOMIC_SEQ_CST) ||
        __atomic_load_n(&m->fault_expert, __ATOMIC_SEQ_CST) != -3)
        return 0;
    __atomic_store_n(&m->fault_kind, 0, __ATOMIC_SEQ_CST);
    return 1;
}

/* Logits of ntok normalized rows xn: lm_head held, one matmul; else its rows read from
 * the shard in blocks of head_block_rows into one buffer, each block its own matmul
 * writing its logit columns.  A logit is one row's dot product with xn either way (rows
 * are independent in kk_matmul), so streaming never moves a bit. */
static int km_head(k3_model *m, const kk_ctx *kc, const float *xn, int ntok, float *logits,
                   char *err, size_t errlen) {
    const k3_config *c = &m->cfg;
    int E = c->hidden, V = c->vocab;
    if (m->lm_head.data) {
        kk_matmul(kc, &m->lm_head, xn, E, ntok, logits, V);
        return K3_OK;
    }
    int block = m->opts.head_block_rows < V ? m->opts.head_block_rows : V;
    size_t rowb = (m->lm_head.dtype == K3_DT_F32 ? 4 : 2) * (size_t)E;
    void *buf = NULL;
    if (posix_memalign(&buf, 64, rowb * (size_t)block) != 0) {
        km_set_err(err, errlen, "out of memory for the lm_head block buffer (%d rows, %zu bytes)", block,
                   rowb * (size_t)block);
        return K3_ERR_NOMEM;
    }
    const kt_shard *sh = &m->shards[m->head_shard];
    int fault = km_head_fault(m);
    for (int r0 = 0; r0 < V; r0 += block) {
        int nr = V - r0 < block ? V - r0 : block;
        uint64_t off = m->head_off + (uint64_t)r0 * rowb, len = (uint64_t)nr * rowb;
        int rc = fault ? -EIO : kt_pread_full(sh->fd, buf, len, off);
        if (rc != 0) {
            km_set_err(err, errlen, "read of lm_head rows %d..%d failed: shard %s offset %llu length %llu: %s",
                       r0, r0 + nr - 1, sh->path, (unsigned long long)off, (unsigned long long)len,
                       strerror(-rc));
            free(buf);
            return K3_ERR_IO;
        }
        __atomic_add_fetch(&m->stats.trunk_bytes_read, len, __ATOMIC_RELAXED);
        __atomic_add_fetch(&m->stats.head_bytes_read, len, __ATOMIC_RELAXED);
        kk_mat w = {buf, m->lm_head.dtype, nr, E};
        kk_matmul(kc, &w, xn, E, ntok, logits + r0, V);
    }
    free(buf);
    return K3_OK;
}

static int km_chunk(k3_model *m, ks_state *st, const int32_t *ids, int ntok, float *logits,
                    int all_rows, const volatile int32_t *cancel, kd_draft *draft, char *err, size_t errlen) {
    const k3_config *c = &m->cfg;
    int E = c->hidden, Sb = c->attn_res_block, nsnap = (c->n_layers - 1) / Sb + 1;
    kk_ctx kc;
    km_kk_ctx(m, &kc);
    size_t TE = (size_t)ntok * E;
    size_t scr = km_max(km_max(kda_scratch_floats(c, ntok), mla_scratch_floats(c, ntok, st->len + ntok)),
                        km_max(moe_scratch_floats(c, ntok), dense_scratch_floats(c, ntok)));
    size_t total = TE * (size_t)(nsnap + 4) + scr;
    float *buf = (float *)malloc(sizeof(float) * total);
    if (!buf) {
        km_set_err(err, errlen, "out of memory for activations (%zu floats)", total);
        return K3_ERR_NOMEM;
    }
    float *cur = buf, *x = cur + TE, *xn = x + TE, *a = xn + TE, *scratch = a + TE + TE * nsnap;
    float *B[K3_MAX_LAYERS + 2];
    int nB = 0, have_cur = 1;
    int rc = km_embed(m, ids, ntok, cur, err, errlen);
    for (int L = 0; L < c->n_layers && rc == K3_OK; L++) {
        if (cancel && *cancel) {
            km_set_err(err, errlen, "cancelled at layer %d", L);
            rc = K3_ERR_CANCELLED;
            break;
        }
        const km_layer *ly = &m->layers[L];
        /* x: AttnRes over the snapshots and the running prefix (just h at L = 0) */
        if (nB == 0) {
            memcpy(x, cur, sizeof(float) * TE);
        } else {
            B[nB] = cur;
            km_attn_res(m, B, nB + 1, ly->attn_res_u, ntok, x, kc.simd);
        }
        if (L % Sb == 0) { /* push the pre-attention prefix, then reset it */
            B[nB] = a + TE + TE * nB;
            memcpy(B[nB], cur, sizeof(float) * TE);
            nB++;
            have_cur = 0;
        }
        for (int t = 0; t < ntok; t++)
            kk_rmsnorm(x + (size_t)t * E, ly->input_norm, E, c->rms_eps, xn + (size_t)t * E, kc.simd);
        if (ly->streamed && (rc = kr_acquire(m->ring, L, KR_ATTN, err, errlen)) != K3_OK) break;
        if (ly->is_mla) {
            rc = mla_forward(m, ly, st->mla_rows[ly->mla_index], st->len, xn, ntok, a, scratch);
            if (rc != K3_OK) km_set_err(err, errlen, "out of memory in the attention of layer %d", L);
        } else {
            int slot = st->shared_slot ? 0 : ly->kda_index;
            if (st->shared_slot) { /* one scratch slot, re-zeroed for every KDA layer */
                size_t P = (size_t)c->kda_heads * c->kda_head_dim;
                memset(st->kda_s[0], 0, sizeof(float) * P * c->kda_head_dim);
                memset(st->kda_conv[0], 0, sizeof(float) * 3 * P * (c->conv_kernel - 1));
            }
            kda_forward(m, ly, st->kda_s[slot], st->kda_conv[slot], xn, ntok, a, scratch, draft);
        }
        if (ly->streamed) kr_release(m->ring, L, KR_ATTN);
        if (have_cur) {
            for (size_t i = 0; i < TE; i++) cur[i] = cur[i] + a[i];
        } else {
            memcpy(cur, a, sizeof(float) * TE);
            have_cur = 1;
        }
        B[nB] = cur;
        km_attn_res(m, B, nB + 1, ly->mlp_res_u, ntok, x, kc.simd);
        for (int t = 0; t < ntok; t++)
            kk_rmsnorm(x + (size_t)t * E, ly->post_norm, E, c->rms_eps, xn + (size_t)t * E, kc.simd);
        if (ly->ffn_split) { /* its three matrices come through the ring one by one */
            if ((rc = dense_forward_split(m, L, ly, xn, ntok, a, scratch, err, errlen)) != K3_OK) break;
            for (size_t i = 0; i < TE; i++) cur[i] = cur[i] + a[i];
            continue;
        }
        if (ly->streamed && (rc = kr_acquire(m->ring, L, KR_FFN, err, errlen)) != K3_OK) break;
        if (ly->is_moe)
            rc = moe_forward(m, L, ly, xn, ntok, a, scratch, err, errlen);
        else
            dense_forward(m, ly, xn, ntok, a, scratch);
        if (ly->streamed) kr_release(m->ring, L, KR_FFN);
        if (rc == K3_OK)
            for (size_t i = 0; i < TE; i++) cur[i] = cur[i] + a[i];
    }
    if (rc == K3_OK && logits) {
        B[nB] = cur;
        km_attn_res(m, B, nB + 1, m->out_res_u, ntok, x, kc.simd);
        int first = all_rows ? 0 : ntok - 1;
        for (int t = first; t < ntok; t++)
            kk_rmsnorm(x + (size_t)t * E, m->final_norm, E, c->rms_eps, xn + (size_t)t * E, kc.simd);
        rc = km_head(m, &kc, xn + (size_t)first * E, ntok - first, logits, err, errlen);
    }
    free(buf);
    return rc;
}

/* Ids a feed or a verify may take: each inside the vocabulary, and room for all n. */
static int km_check_ids(const k3_model *m, const ks_state *st, const int32_t *ids, int n, const char *what,
                        char *err, size_t errlen) {
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->cfg.vocab) {
            km_set_err(err, errlen, "token id %d at index %d is outside the vocabulary [0, %d)", ids[i], i,
                       m->cfg.vocab);
            return K3_ERR_INVALID;
        }
    if ((int64_t)st->len + n > st->cap) {
        km_set_err(err, errlen, "context full: %d positions fed + %d %s > capacity %d", st->len, n, what, st->cap);
        return K3_ERR_INVALID;
    }
    return K3_OK;
}

int km_verify(k3_model *m, ks_state *st, kd_draft *d, const int32_t *ids, int n, float *logits_all,
              const volatile int32_t *cancel, char *err, size_t errlen) {
    d->n = 0;
    if (n <= 0 || n > d->cap || st->shared_slot) {
        km_set_err(err, errlen, "a verify feed needs 1..%d positions, got %d", d->cap, n);
        return K3_ERR_INVALID;
    }
    int rc = km_check_ids(m, st, ids, n, "to verify", err, errlen);
    if (rc != K3_OK) return rc;
    /* one pass whatever the prefill chunk: the point is to read the weights once for all n */
    rc = km_chunk(m, st, ids, n, logits_all, 1, cancel, d, err, errlen);
    if (rc != K3_OK) return rc;
    memcpy(d->ids, ids, sizeof(int32_t) * (size_t)n);
    d->n = n; /* tokens_fed grows on accept: per-token figures count what entered the session */
    return K3_OK;
}

int km_forward(k3_model *m, ks_state *st, const int32_t *ids, int n, float *logits_last,
               float *logits_all, const volatile int32_t *cancel, char *err, size_t errlen) {
    const k3_config *c = &m->cfg;
    if (n <= 0) {
        km_set_err(err, errlen, "nothing to feed");
        return K3_ERR_INVALID;
    }
    int checked = km_check_ids(m, st, ids, n, "new", err, errlen);
    if (checked != K3_OK) return checked;
    /* the shared KDA slot only holds within one pass over the whole sequence */
    int chunk = st->shared_slot ? n : (m->opts.prefill_chunk > 0 ? m->opts.prefill_chunk : KM_CHUNK);
    for (int done = 0; done < n;) {
        int cn = n - done < chunk ? n - done : chunk;
        int last_chunk = done + cn == n;
        float *lg = NULL;
        int all_rows = 0;
        float *tmp = NULL;
        if (logits_all) {
            lg = logits_all + (size_t)done * c->vocab;
            all_rows = 1;
        } else if (logits_last && last_chunk) {
            lg = logits_last;
        }
        int rc = km_chunk(m, st, ids + done, cn, lg, all_rows, cancel, NULL, err, errlen);
        if (rc == K3_OK && logits_all && logits_last && last_chunk)
            memcpy(logits_last, logits_all + (size_t)(n - 1) * c->vocab, sizeof(float) * c->vocab);
        free(tmp);
        if (rc != K3_OK) return rc;
        memcpy(st->ids + st->len, ids + done, sizeof(int32_t) * cn);
        st->len += cn;
        __atomic_add_fetch(&m->stats.tokens_fed, (uint64_t)cn, __ATOMIC_RELAXED);
        done += cn;
    }
    return K3_OK;
}
