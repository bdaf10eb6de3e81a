/* k3_kda.c: Kimi Delta Attention, the naive per-token recurrence (spec 5.4).
 *
 * Prefill and decode run the same per-token arithmetic (batch invariance): the
 * projections are per-token dot products and the recurrence is sequential in t.
 */
#include <math.h>
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
    float u[1024], qs[1024], o[1024];
    double ud[1024], od[1024]; /* the sums over the state's rows, in double */
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
            float kn = (float)(1.0 / sqrt(kk_dot_d(k, k, D, j->simd) + 1e-6));
            float kh[1024];
            for (int d = 0; d < D; d++) {
                kh[d] = k[d] * kn;
                qs[d] = (q[d] * qn) * scale;
            }
            float beta = j->beta[(size_t)t * H + h];
            /* decay, read, write, then output from the updated state */
            for (int i = 0; i < D; i++) {
                /* the decay in double, rounded once (float steps would add ulps) */
                float alpha = (float)exp((double)c->gate_lower_bound / (1.0 + exp(-expA * (double)z[i])));
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
                 int ntok, float *out, float *scratch) {
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
    kda_conv_silu(q, ntok, P, K, ly->q_conv, conv);
    kda_conv_silu(k, ntok, P, K, ly->k_conv, conv + hs);
    kda_conv_silu(v, ntok, P, K, ly->v_conv, conv + 2 * hs);
    kda_job j = {m, ly, S, q, k, v, g, z, beta, y, ntok, kc.simd};
    kp_parallel_for(kc.nthreads, H, kda_heads, &j);
    kk_matmul(&kc, &ly->o_proj, y, P, ntok, out, E);
}
