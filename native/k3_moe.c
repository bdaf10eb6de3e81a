/* k3_moe.c: Stable LatentMoE (spec 5.6) and the dense SiTU-GLU MLP (spec 5.8).
 *
 * Router on the full-width x (sigmoid scores, bias for selection only), routed experts
 * in the latent space from MXFP4 bytes, weighted sum in list order, one RMSNorm on the
 * aggregate, up-projection; plus the fused shared MLP on x, unweighted.
 * Each distinct expert of a chunk is acquired once and applied to all its tokens.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "k3_internal.h"

size_t moe_scratch_floats(const k3_config *c, int ntok) {
    size_t T = ntok, l = c->latent_dim, I = c->expert_width, k = c->top_k, E = c->hidden;
    size_t shw = c->shared_width;
    /* logits(n_e) + weights(k) + z(l) + he(k*l) + u(l) + un(l) + r(E) + sh gate/up(2 shw)
     * + expert scratch: gathered z, g, v (per token) and output */
    return T * (c->n_experts + k + l + k * l + 2 * l + E + 2 * shw) + T * (l + 2 * I + l) + T * k +
           T * c->n_experts; /* lookahead router scores */
}

size_t dense_scratch_floats(const k3_config *c, int ntok) { return (size_t)ntok * 2 * c->dense_width; }

/* g = SiTU(g, v) elementwise over n values (the GLU's one non-matmul step). */
static void kk_situ_rows(const k3_config *c, float *g, const float *v, size_t n) {
    for (size_t i = 0; i < n; i++) g[i] = kk_situ(g[i], v[i], c->situ_beta1, c->situ_beta2);
}

/* y = W_down SiTU(W_gate x, W_up x) for ntok tokens. */
static void kk_glu(const kk_ctx *kc, const k3_config *c, const kk_mat *gate, const kk_mat *up,
                   const kk_mat *down, const float *x, int ldx, int ntok, float *y, int ldy,
                   float *scratch) {
    int w = gate->rows;
    float *g = scratch, *v = g + (size_t)ntok * w;
    kk_matmul(kc, gate, x, ldx, ntok, g, w);
    kk_matmul(kc, up, x, ldx, ntok, v, w);
    kk_situ_rows(c, g, v, (size_t)ntok * w);
    kk_matmul(kc, down, g, w, ntok, y, ldy);
}

void dense_forward(const k3_model *m, const km_layer *ly, const float *xn, int ntok, float *out,
                   float *scratch) {
    kk_ctx kc;
    km_kk_ctx(m, &kc);
    kk_glu(&kc, &m->cfg, &ly->mlp_gate, &ly->mlp_up, &ly->mlp_down, xn, m->cfg.hidden, ntok, out,
           m->cfg.hidden, scratch);
}

/* kk_glu's three matmuls and SiTU in its order, each matrix bound from the ring only
 * around its own matmul: one matrix in a slot at a time, the same bits. */
int dense_forward_split(k3_model *m, int L, const km_layer *ly, const float *xn, int ntok,
                        float *out, float *scratch, char *err, size_t errlen) {
    kk_ctx kc;
    km_kk_ctx(m, &kc);
    int E = m->cfg.hidden, w = m->cfg.dense_width;
    float *g = scratch, *v = g + (size_t)ntok * w;
    int rc = kr_acquire(m->ring, L, KR_FFN, err, errlen);
    if (rc != K3_OK) return rc;
    kk_matmul(&kc, &ly->mlp_gate, xn, E, ntok, g, w);
    kr_release(m->ring, L, KR_FFN);
    if ((rc = kr_acquire(m->ring, L, KR_FFN_UP, err, errlen)) != K3_OK) return rc;
    kk_matmul(&kc, &ly->mlp_up, xn, E, ntok, v, w);
    kr_release(m->ring, L, KR_FFN_UP);
    kk_situ_rows(&m->cfg, g, v, (size_t)ntok * w);
    if ((rc = kr_acquire(m->ring, L, KR_FFN_DOWN, err, errlen)) != K3_OK) return rc;
    kk_matmul(&kc, &ly->mlp_down, g, w, ntok, out, E);
    kr_release(m->ring, L, KR_FFN_DOWN);
    return K3_OK;
}

/* Top-k by biased score, descending, ties to the lower index. */
static void moe_select(const float *s, const float *bias, int n, int k, int *sel) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bv = 0.0f;
        for (int e = 0; e < n; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= sel[i] == e;
            if (taken) continue;
            float v = s[e] + bias[e];
            if (best < 0 || v > bv) {
                best = e;
                bv = v;
            }
        }
        sel[j] = best;
    }
}

/* Router lookahead: layer `next`'s router applied to this layer's MoE input predicts the
 * experts the next layer will want; their reads start now.  Only a hint: the real router
 * still decides, so output bits never depend on it. */
static void moe_lookahead(k3_model *m, int next, const float *xn, int ntok, float *scores) {
    const k3_config *c = &m->cfg;
    const km_layer *ny = &m->layers[next];
    int ne = c->n_experts, width = m->opts.lookahead < ne ? m->opts.lookahead : ne;
    kk_ctx kc;
    km_kk_ctx(m, &kc);
    kk_matmul(&kc, &ny->router, xn, c->hidden, ntok, scores, ne);
    int *pick = (int *)malloc(sizeof(int) * (size_t)ntok * width);
    if (!pick) return;
    for (int t = 0; t < ntok; t++) {
        float *s = scores + (size_t)t * ne;
        for (int e = 0; e < ne; e++) s[e] = kk_sigmoid(s[e]);
        moe_select(s, ny->router_bias, ne, width, pick + (size_t)t * width);
    }
    kx_hint(m->store, next, pick, ntok * width);
    free(pick);
}

int moe_forward(k3_model *m, int L, const km_layer *ly, const float *xn, int ntok, float *out,
                float *scratch, char *err, size_t errlen) {
    const k3_config *c = &m->cfg;
    int E = c->hidden, ne = c->n_experts, k = c->top_k, l = c->latent_dim, I = c->expert_width;
    int shw = c->shared_width;
    kk_ctx kc;
    km_kk_ctx(m, &kc);
    size_t T = ntok;
    float *logits = scratch, *wts = logits + T * ne, *z = wts + T * k, *he = z + T * l;
    float *u = he + T * k * l, *un = u + T * l, *r = un + T * l, *shs = r + T * E;
    float *zg = shs + T * 2 * shw, *g = zg + T * l, *v = g + T * I, *ho = v + T * I;
    int *sel = (int *)malloc(sizeof(int) * T * k);
    int *tok = (int *)malloc(sizeof(int) * T), *slot = (int *)malloc(sizeof(int) * T);
    int *distinct = (int *)malloc(sizeof(int) * (size_t)ne);
    float *scratch_la = ho + T * l;
    if (!sel || !tok || !slot || !distinct) {
        free(distinct);
        free(sel);
        free(tok);
        free(slot);
        km_set_err(err, errlen, "out of memory in the MoE of layer %d", L);
        return K3_ERR_NOMEM;
    }
    /* router: sigmoid scores, bias selects, unbiased scores weigh */
    kk_matmul(&kc, &ly->router, xn, E, ntok, logits, ne);
    for (size_t t = 0; t < T; t++) {
        float *s = logits + t * ne;
        for (int e = 0; e < ne; e++) s[e] = kk_sigmoid(s[e]);
        moe_select(s, ly->router_bias, ne, k, sel + t * k);
        double sum = 0.0; /* in double, as every reduction */
        for (int j = 0; j < k; j++) sum = sum + (double)s[sel[t * k + j]];
        for (int j = 0; j < k; j++) {
            double w = s[sel[t * k + j]];
            if (k > 1 && c->moe_renormalize) w = w / (sum + 1e-20);
            wts[t * k + j] = (float)(w * (double)c->routed_scaling);
        }
    }
    kk_matmul(&kc, &ly->lat_down, xn, E, ntok, z, l);
    /* distinct experts of the chunk, ascending; each is read at most once per chunk */
    int nd = 0;
    for (int e = 0; e < ne; e++) {
        int used = 0;
        for (size_t t = 0; t < T * k && !used; t++) used = sel[t] == e;
        if (used) distinct[nd++] = e;
    }
    int rc = K3_OK, lim = kx_batch_limit(m->store);
    for (int w0 = 0; w0 < nd && rc == K3_OK; w0 += lim) {
        int wn = nd - w0 < lim ? nd - w0 : lim;
        rc = kx_begin(m->store, L, distinct + w0, wn, err, errlen);
        /* after this layer's first batch is pinned, so the hint cannot evict it */
        if (rc == K3_OK && w0 == 0 && L + 1 < c->n_layers && m->layers[L + 1].is_moe && m->opts.lookahead > 0)
            moe_lookahead(m, L + 1, xn, ntok, scratch_la);
        for (int got = 0; rc == K3_OK && got < wn; got++) {
            kx_view ev;
            int e;
            rc = kx_next(m->store, &e, &ev, err, errlen);
            if (rc != K3_OK || e < 0) break;
            uint64_t t0 = km_now_ns();
            int n = 0;
            for (size_t t = 0; t < T; t++)
                for (int j = 0; j < k; j++)
                    if (sel[t * k + j] == e) {
                        tok[n] = (int)t;
                        slot[n] = j;
                        n++;
                    }
            for (int i = 0; i < n; i++) memcpy(zg + (size_t)i * l, z + (size_t)tok[i] * l, sizeof(float) * l);
            kk_mxfp4_matmul(&kc, ev.w1p, ev.w1s, I, l, zg, l, n, g, I, &m->stats.e8m0_nan_groups);
            kk_mxfp4_matmul(&kc, ev.w3p, ev.w3s, I, l, zg, l, n, v, I, &m->stats.e8m0_nan_groups);
            for (size_t i = 0; i < (size_t)n * I; i++) g[i] = kk_situ(g[i], v[i], c->situ_beta1, c->situ_beta2);
            kk_mxfp4_matmul(&kc, ev.w2p, ev.w2s, l, I, g, I, n, ho, l, &m->stats.e8m0_nan_groups);
            /* each (token, slot) product is kept apart: arrival order never moves bits */
            for (int i = 0; i < n; i++)
                memcpy(he + ((size_t)tok[i] * k + slot[i]) * l, ho + (size_t)i * l, sizeof(float) * l);
            __atomic_add_fetch(&m->stats.expert_uses, (uint64_t)n, __ATOMIC_RELAXED);
            (void)t0;
        }
        kx_end(m->store);
    }
    free(distinct);
    free(sel);
    free(tok);
    free(slot);
    if (rc != K3_OK) return rc;
    /* weighted sum in list order, one norm on the aggregate, then up */
    for (size_t t = 0; t < T; t++) {
        float *ut = u + t * l;
        const float *ht = he + t * k * l, *wt = wts + t * k;
        for (int x = 0; x < l; x++) {
            double acc = 0.0; /* in double, list order */
            for (int j = 0; j < k; j++) acc = acc + (double)wt[j] * (double)ht[(size_t)j * l + x];
            ut[x] = (float)acc;
        }
        kk_rmsnorm(ut, ly->lat_norm, l, K3_EPS_FIXED, un + t * l, kc.simd);
    }
    kk_matmul(&kc, &ly->lat_up, un, l, ntok, r, E);
    kk_glu(&kc, c, &ly->sh_gate, &ly->sh_up, &ly->sh_down, xn, E, ntok, out, E, shs);
    for (size_t i = 0; i < T * E; i++) out[i] = r[i] + out[i];
    return K3_OK;
}
