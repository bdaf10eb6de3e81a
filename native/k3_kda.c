/* k3_kda.c: Kimi Delta Attention, the naive per-token recurrence (spec 5.4).
 *
 * Prefill and decode run the same per-token arithmetic (batch invariance): the
 * projections are per-token dot products and the recurrence is sequential in t.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "k3_internal.h"

size_t kda_scratch_floats(const k3_config *c, int ntok) {
    size_t P = (size_t)c->kda_heads * c->kda_head_dim;
    /* q k v g z(P each) + fa(D) + beta(H) + y(P) */
    return (size_t)ntok * (6 * P + c->kda_head_dim + c->kda_heads);
}

/* Causal depthwise conv over ntok tokens then SiLU, in place; hist holds the last K-1
 * pre-conv inputs per channel (oldest first) and is updated. */
static void kda_conv_silu(float *x, int ntok, int P, int K, const float *w, float *hist) {
    float win[64];
    for (int c = 0; c < P; c++) {
        float *h = hist + (size_t)c * (K - 1);
        const float *wc = w + (size_t)c * K;
        for (int t = 0; t < ntok; t++) {
            float in = x[(size_t)t * P + c];
            for (int j = 0; j < K - 1; j++) win[j] = h[j];
            win[K - 1] = in;
            double y = 0.0; /* double sum, as every reduction (k3_kernels.c) */
            for (int j = 0; j < K; j++) y = y + (double)wc[j] * (double)win[j]; /* w[K-1] meets the newest */
            for (int j = 0; j + 1 < K - 1; j++) h[j] = h[j + 1];
            if (K > 1) h[K - 2] = in;
            x[(size_t)t * P + c] = kk_silu((float)y);
        }
    }
}

/* One token's state update for one head: decay, read, write (spec 5.4); kh gets the
 * normalised key.  Both the feed and kda_accept run exactly this, so a replay of accepted
 * positions has the feed's bits. */
static void kda_step(float *S, const float *k, const float *v, const float *z, float beta, double expA,
                     float g_min, int D, int simd, float *kh) {
    float u[1024];
    double ud[1024]; /* the sums over the state's rows, in double */
    float kn = (float)(1.0 / sqrt(kk_dot_d(k, k, D, simd) + 1e-6));
    for (int d = 0; d < D; d++) kh[d] = k[d] * kn;
    for (int i = 0; i < D; i++) {
        /* the decay in double, rounded once (float steps would add ulps) */
        float alpha = (float)exp((double)g_min / (1.0 + exp(-expA * (double)z[i])));
        float *row = S + (size_t)i * D;
        for (int jj = 0; jj < D; jj++) row[jj] = alpha * row[jj];
    }
    for (int jj = 0; jj < D; jj++) ud[jj] = 0.0;
    for (int i = 0; i < D; i++) {
        const float *row = S + (size_t)i * D;
        for (int jj = 0; jj < D; jj++) ud[jj] = ud[jj] + (double)row[jj] * (double)kh[i];
    }
    for (int jj = 0; jj < D; jj++) u[jj] = (float)((double)beta * ((double)v[jj] - ud[jj]));
    for (int i = 0; i < D; i++) {
        float *row = S + (size_t)i * D;
        for (int jj = 0; jj < D; jj++) row[jj] = row[jj] + kh[i] * u[jj];
    }
}

typedef struct {
    const k3_model *m;
    const km_layer *ly;
    float *S;
    float *q, *k, *v, *g, *z, *beta, *y;
    int ntok, simd;
} kda_job;

static void kda_heads(void *vctx, int hb, int he) {
    kda_job *j = (kda_job *)vctx;
    const k3_config *c = &j->m->cfg;
    int H = c->kda_heads, D = c->kda_head_dim, P = H * D;
    float qs[1024], o[1024];
    double od[1024]; /* the sums over the state's rows, in double */
    float scale = 1.0f / sqrtf((float)D);
    for (int h = hb; h < he; h++) {
        float *S = j->S + (size_t)h * D * D;
        double expA = exp((double)j->ly->a_log[h]);
        for (int t = 0; t < j->ntok; t++) {
            float *q = j->q + (size_t)t * P + h * D, *k = j->k + (size_t)t * P + h * D;
            const float *v = j->v + (size_t)t * P + h * D;
            const float *z = j->z + (size_t)t * P + h * D;
            /* L2 norm of q and k per head: epsilon on the sum of squares */
            float qn = (float)(1.0 / sqrt(kk_dot_d(q, q, D, j->simd) + 1e-6));
            float kh[1024];
            for (int d = 0; d < D; d++) qs[d] = (q[d] * qn) * scale;
            float beta = j->beta[(size_t)t * H + h];
            /* decay, read, write, then output from the updated state */
            kda_step(S, k, v, z, beta, expA, c->gate_lower_bound, D, j->simd, kh);
            for (int jj = 0; jj < D; jj++) od[jj] = 0.0;
            for (int i = 0; i < D; i++) {
                const float *row = S + (size_t)i * D;
                for (int jj = 0; jj < D; jj++) od[jj] = od[jj] + (double)row[jj] * (double)qs[i];
            }
            for (int jj = 0; jj < D; jj++) o[jj] = (float)od[jj];
            /* per-head norm, then the gate */
            float *y = j->y + (size_t)t * P + h * D;
            kk_rmsnorm(o, j->ly->o_norm, D, K3_EPS_FIXED, y, j->simd);
            const float *g = j->g + (size_t)t * P + h * D;
            for (int d = 0; d < D; d++) y[d] = y[d] * kk_sigmoid(g[d]);
        }
    }
}

void kda_forward(const k3_model *m, const km_layer *ly, float *S, float *conv, const float *xn,
                 int ntok, float *out, float *scratch, kd_draft *draft) {
    const k3_config *c = &m->cfg;
    int H = c->kda_heads, D = c->kda_head_dim, P = H * D, E = c->hidden, K = c->conv_kernel;
    kk_ctx kc;
    km_kk_ctx(m, &kc);
    size_t TP = (size_t)ntok * P;
    float *q = scratch, *k = q + TP, *v = k + TP, *g = v + TP, *z = g + TP, *y = z + TP;
    float *fa = y + TP, *beta = fa + (size_t)ntok * D;
    kk_matmul(&kc, &ly->q_proj, xn, E, ntok, q, P);
    kk_matmul(&kc, &ly->k_proj, xn, E, ntok, k, P);
    kk_matmul(&kc, &ly->v_proj, xn, E, ntok, v, P);
    kk_matmul(&kc, &ly->g_proj_kda, xn, E, ntok, g, P);
    kk_matmul(&kc, &ly->f_a, xn, E, ntok, fa, D);
    kk_matmul(&kc, &ly->f_b, fa, D, ntok, z, P);
    kk_matmul(&kc, &ly->b_proj, xn, E, ntok, beta, H);
    for (size_t i = 0; i < TP; i++) z[i] = z[i] + ly->dt_bias[i % P];
    for (size_t i = 0; i < (size_t)ntok * H; i++) beta[i] = kk_sigmoid(beta[i]);
    size_t hs = (size_t)P * (K - 1);
    if (draft) { /* a verify feed: run on copies, keep what accepting a prefix replays */
        memcpy(draft->work_s, S, sizeof(float) * (size_t)P * D);
        memcpy(draft->work_conv, conv, sizeof(float) * 3 * hs);
        S = draft->work_s;
        conv = draft->work_conv;
        float *pre = draft->pre[ly->kda_index];
        for (int t = 0; t < ntok; t++) {
            memcpy(pre + (size_t)t * 3 * P, q + (size_t)t * P, sizeof(float) * P);
            memcpy(pre + (size_t)t * 3 * P + P, k + (size_t)t * P, sizeof(float) * P);
            memcpy(pre + (size_t)t * 3 * P + 2 * P, v + (size_t)t * P, sizeof(float) * P);
        }
    }
    kda_conv_silu(q, ntok, P, K, ly->q_conv, conv);
    kda_conv_silu(k, ntok, P, K, ly->k_conv, conv + hs);
    kda_conv_silu(v, ntok, P, K, ly->v_conv, conv + 2 * hs);
    if (draft) {
        float *post = draft->post[ly->kda_index];
        size_t row = (size_t)3 * P + H;
        for (int t = 0; t < ntok; t++) {
            memcpy(post + t * row, k + (size_t)t * P, sizeof(float) * P);
            memcpy(post + t * row + P, v + (size_t)t * P, sizeof(float) * P);
            memcpy(post + t * row + 2 * P, z + (size_t)t * P, sizeof(float) * P);
            memcpy(post + t * row + 3 * P, beta + (size_t)t * H, sizeof(float) * H);
        }
    }
    kda_job j = {m, ly, S, q, k, v, g, z, beta, y, ntok, kc.simd};
    kp_parallel_for(kc.nthreads, H, kda_heads, &j);
    kk_matmul(&kc, &ly->o_proj, y, P, ntok, out, E);
}

/* ---------------- verify records (speculative decoding) ---------------- */

size_t kd_draft_floats(const k3_model *m, int32_t cap) {
    const k3_config *c = &m->cfg;
    size_t H = (size_t)c->kda_heads, D = (size_t)c->kda_head_dim, P = H * D, K = (size_t)c->conv_kernel;
    if (m->n_kda == 0) return 0;
    return H * D * D + 3 * P * (K - 1) + (size_t)m->n_kda * (size_t)cap * (6 * P + H);
}

void kd_draft_free(kd_draft *d) {
    for (int i = 0; i < d->n_layers; i++) {
        if (d->pre) free(d->pre[i]);
        if (d->post) free(d->post[i]);
    }
    free(d->pre);
    free(d->post);
    free(d->ids);
    free(d->work_s);
    free(d->work_conv);
    memset(d, 0, sizeof *d);
}

int kd_draft_reserve(const k3_model *m, kd_draft *d, int32_t cap) {
    if (d->cap >= cap) return K3_OK;
    kd_draft_free(d);
    const k3_config *c = &m->cfg;
    size_t H = (size_t)c->kda_heads, D = (size_t)c->kda_head_dim, P = H * D, K = (size_t)c->conv_kernel;
    d->ids = (int32_t *)calloc((size_t)cap, sizeof(int32_t));
    d->work_s = (float *)calloc(H * D * D + 1, sizeof(float));
    d->work_conv = (float *)calloc(3 * P * (K - 1) + 1, sizeof(float));
    d->pre = (float **)calloc((size_t)m->n_kda + 1, sizeof(float *));
    d->post = (float **)calloc((size_t)m->n_kda + 1, sizeof(float *));
    if (!d->ids || !d->work_s || !d->work_conv || !d->pre || !d->post) {
        kd_draft_free(d);
        return K3_ERR_NOMEM;
    }
    d->n_layers = m->n_kda;
    for (int i = 0; i < m->n_kda; i++) {
        d->pre[i] = (float *)malloc(sizeof(float) * (size_t)cap * 3 * P);
        d->post[i] = (float *)malloc(sizeof(float) * (size_t)cap * (3 * P + H));
        if (!d->pre[i] || !d->post[i]) {
            kd_draft_free(d);
            return K3_ERR_NOMEM;
        }
    }
    d->cap = cap;
    return K3_OK;
}

typedef struct {
    const k3_model *m;
    const km_layer *ly;
    float *S;
    const float *post;
    int keep, simd;
} kda_accept_job;

static void kda_accept_heads(void *vctx, int hb, int he) {
    kda_accept_job *j = (kda_accept_job *)vctx;
    const k3_config *c = &j->m->cfg;
    int H = c->kda_heads, D = c->kda_head_dim, P = H * D;
    size_t row = (size_t)3 * P + H;
    float kh[1024];
    for (int h = hb; h < he; h++) {
        double expA = exp((double)j->ly->a_log[h]);
        for (int t = 0; t < j->keep; t++) {
            const float *r = j->post + t * row;
            kda_step(j->S + (size_t)h * D * D, r + h * D, r + P + h * D, r + 2 * P + h * D, r[3 * P + h], expA,
                     c->gate_lower_bound, D, j->simd, kh);
        }
    }
}

void kda_accept(const k3_model *m, ks_state *st, const kd_draft *d, int keep) {
    const k3_config *c = &m->cfg;
    int H = c->kda_heads, D = c->kda_head_dim, P = H * D, K = c->conv_kernel;
    kk_ctx kc;
    km_kk_ctx(m, &kc);
    for (int L = 0; L < c->n_layers; L++) {
        const km_layer *ly = &m->layers[L];
        if (ly->is_mla) continue;
        int i = ly->kda_index;
        /* conv histories: the last K-1 pre-conv inputs, as kda_conv_silu shifts them */
        float *hist = st->kda_conv[i];
        for (int t = 0; t < keep && K > 1; t++) {
            const float *in = d->pre[i] + (size_t)t * 3 * P;
            for (int ch = 0; ch < 3 * P; ch++) {
                float *h = hist + (size_t)ch * (K - 1);
                for (int jj = 0; jj + 1 < K - 1; jj++) h[jj] = h[jj + 1];
                h[K - 2] = in[ch];
            }
        }
        kda_accept_job j = {m, ly, st->kda_s[i], d->post[i], keep, kc.simd};
        kp_parallel_for(kc.nthreads, H, kda_accept_heads, &j);
    }
}
