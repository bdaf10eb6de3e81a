/* k3_mla.c: gated MLA with NoPE in the absorbed form over a latent cache (spec 5.5).
 *
 * The cache row of a position is [c_hat (kv_lora, post-norm) | k_rope (rope)].
 * Scores: ((W_kb^h^T q_nope) . c_hat_s + q_rope . k_rope_s) / sqrt(d_qk);
 * output:  W_vb^h (sum_s p_s c_hat_s).  One form in every path.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "k3_internal.h"

size_t mla_scratch_floats(const k3_config *c, int ntok, int npos) {
    size_t H = c->mla_heads, dqk = c->qk_nope_dim + c->qk_rope_dim;
    size_t qa = c->q_lora_rank, kva = c->kv_lora_rank + c->qk_rope_dim;
    (void)npos;
    /* qa(2x for norm) + q + kva + o + gate */
    return (size_t)ntok * (2 * qa + H * dqk + kva + 2 * H * c->v_head_dim);
}

typedef struct {
    const k3_model *m;
    const km_layer *ly;
    const float *rows; /* cache rows [pos, W] */
    const float *q;    /* [ntok, H*dqk] */
    float *o;          /* [ntok, H*dv] */
    float *work;       /* per head: qabs R + ctx R */
    double *dwork;     /* per head: their double sums 2R + scores npos */
    int pos0, ntok, simd;
} mla_job;

/* acc[x] += W[r][x] * a over one row, in double (exact products, as every reduction):
 * element-wise, so vectorising it moves no bits. */
static void mla_axpy_row(const kk_mat *w, int r, float a, double *acc) {
    size_t off = (size_t)r * w->cols;
    int n = w->cols;
    double ad = a;
    if (w->dtype == K3_DT_BF16) {
        const uint16_t *p = (const uint16_t *)w->data + off;
        for (int x = 0; x < n; x++) acc[x] = acc[x] + (double)kk_bf16_to_f32(p[x]) * ad;
    } else if (w->dtype == K3_DT_F16) {
        const uint16_t *p = (const uint16_t *)w->data + off;
        for (int x = 0; x < n; x++) acc[x] = acc[x] + (double)kk_f16_to_f32(p[x]) * ad;
    } else {
        const float *p = (const float *)w->data + off;
        for (int x = 0; x < n; x++) acc[x] = acc[x] + (double)p[x] * ad;
    }
}

static void mla_heads(void *vctx, int hb, int he) {
    mla_job *j = (mla_job *)vctx;
    const k3_config *c = &j->m->cfg;
    int dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim, R = c->kv_lora_rank;
    int dqk = dn + dr, W = R + dr, npos = j->pos0 + j->ntok;
    double scale = 1.0 / sqrt((double)dqk);
    const kk_mat *kvb = &j->ly->kv_b;
    for (int h = hb; h < he; h++) {
        /* each head has its own work rows, so any split over threads is fine */
        float *qabs = j->work + (size_t)h * 2 * R, *ctx = qabs + R;
        double *qd = j->dwork + (size_t)h * (2 * R + npos), *cd = qd + R, *p = cd + R;
        int kb0 = h * (dn + dv), vb0 = kb0 + dn;
        for (int t = 0; t < j->ntok; t++) {
            const float *q = j->q + (size_t)t * c->mla_heads * dqk + (size_t)h * dqk;
            /* absorb W_kb^h into the query: qabs = W_kb^h^T q_nope, d ascending */
            for (int x = 0; x < R; x++) qd[x] = 0.0;
            for (int d = 0; d < dn; d++) mla_axpy_row(kvb, kb0 + d, q[d], qd);
            for (int x = 0; x < R; x++) qabs[x] = (float)qd[x];
            int last = j->pos0 + t; /* causal: s <= t, including t */
            double mx = -INFINITY;
            /* scores, softmax and the context sum in double; ctx is rounded once */
            for (int s = 0; s <= last; s++) {
                const float *row = j->rows + (size_t)s * W;
                double sc = (kk_dot_d(qabs, row, R, j->simd) + kk_dot_d(q + dn, row + R, dr, j->simd)) * scale;
                p[s] = sc;
                if (sc > mx) mx = sc;
            }
            double sum = 0.0;
            for (int s = 0; s <= last; s++) {
                p[s] = exp(p[s] - mx);
                sum = sum + p[s];
            }
            for (int x = 0; x < R; x++) cd[x] = 0.0;
            for (int s = 0; s <= last; s++) {
                double ps = p[s] / sum;
                const float *row = j->rows + (size_t)s * W;
                for (int x = 0; x < R; x++) cd[x] = cd[x] + ps * (double)row[x];
            }
            for (int x = 0; x < R; x++) ctx[x] = (float)cd[x];
            float *o = j->o + (size_t)t * c->mla_heads * dv + (size_t)h * dv;
            for (int d = 0; d < dv; d++) o[d] = kk_dot_row(kvb, vb0 + d, ctx, j->simd);
        }
    }
}

int mla_forward(const k3_model *m, const km_layer *ly, float *rows, int pos0, const float *xn,
                int ntok, float *out, float *scratch) {
    const k3_config *c = &m->cfg;
    int E = c->hidden, H = c->mla_heads, dqk = c->qk_nope_dim + c->qk_rope_dim;
    int rq = c->q_lora_rank, R = c->kv_lora_rank, dr = c->qk_rope_dim, W = R + dr;
    int dv = c->v_head_dim;
    kk_ctx kc;
    km_kk_ctx(m, &kc);
    float *qa = scratch, *qan = qa + (size_t)ntok * rq, *q = qan + (size_t)ntok * rq;
    float *kva = q + (size_t)ntok * H * dqk, *o = kva + (size_t)ntok * W;
    float *gate = o + (size_t)ntok * H * dv;
    kk_matmul(&kc, &ly->q_a, xn, E, ntok, qa, rq);
    for (int t = 0; t < ntok; t++)
        kk_rmsnorm(qa + (size_t)t * rq, ly->q_a_norm, rq, 1e-6f, qan + (size_t)t * rq, kc.simd);
    kk_matmul(&kc, &ly->q_b, qan, rq, ntok, q, H * dqk);
    kk_matmul(&kc, &ly->kv_a, xn, E, ntok, kva, W);
    for (int t = 0; t < ntok; t++) {
        float *row = rows + (size_t)(pos0 + t) * W, *src = kva + (size_t)t * W;
        /* the norm covers only the latent; the shared rope key is stored as is */
        kk_rmsnorm(src, ly->kv_a_norm, R, 1e-6f, row, kc.simd);
        memcpy(row + R, src + R, sizeof(float) * (size_t)dr);
    }
    size_t per_head = (size_t)2 * R + (size_t)pos0 + (size_t)ntok;
    float *work = (float *)malloc(sizeof(float) * 2 * (size_t)R * (size_t)H);
    double *dwork = (double *)malloc(sizeof(double) * per_head * (size_t)H);
    if (!work || !dwork) {
        free(work);
        free(dwork);
        return K3_ERR_NOMEM;
    }
    mla_job j = {m, ly, rows, q, o, work, dwork, pos0, ntok, kc.simd};
    kp_parallel_for(kc.nthreads, H, mla_heads, &j);
    free(work);
    free(dwork);
    /* gate, then project; no norm */
    kk_matmul(&kc, &ly->g_proj_mla, xn, E, ntok, gate, H * dv);
    for (size_t i = 0; i < (size_t)ntok * H * dv; i++) gate[i] = kk_sigmoid(gate[i]) * o[i];
    kk_matmul(&kc, &ly->o_proj, gate, H * dv, ntok, out, E);
    return K3_OK;
}
