/* k3_kernels.c: dot products, matmuls, MXFP4, norms and activations.
 *
 * One reduction order everywhere: 8 lane accumulators (lane l takes elements
 * i = l mod 8 of the full blocks, the tail goes to lanes 0..), then the fixed tree
 * ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).  The lanes are doubles: the product of two
 * floats is exact in double, so only the adds round, and they round 2^29 times finer
 * than float lanes would (logits come out float64-close).  The sum is rounded to float
 * once, at the end.  -ffp-contract=off keeps multiplies and adds apart, so the AVX2
 * path (x86-64) and the NEON path (AArch64) give the scalar path's bits.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "k3_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#define K3_X86 1
#include <immintrin.h>
/* FMA on doubles gives mul-then-add bits here: the product of two floats is exact in
 * double, so the fused op rounds once, where the separate add would. */
#define K3_AVX2 __attribute__((target("avx2,fma")))
#elif defined(__aarch64__)
/* Advanced SIMD with float64 lanes is part of every AArch64 CPU: no flags, no runtime
 * check.  (32-bit ARM NEON has no double lanes and flushes subnormals: scalar there.) */
#define K3_NEON 1
#include <arm_neon.h>
#endif
#if defined(K3_X86) || defined(K3_NEON)
#define K3_SIMD 1
#endif

float kk_bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float kk_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static double kk_tree(const double a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* (double)x * (double)y is exact: 24-bit significands give at most 48 bits. */
static double kk_dot_scalar(const float *x, const float *y, int n) {
    double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8)
        for (int l = 0; l < 8; l++) a[l] = a[l] + (double)x[i + l] * (double)y[i + l];
    for (; i < n; i++) a[i - n8] = a[i - n8] + (double)x[i] * (double)y[i];
    return kk_tree(a);
}

static double kk_dot_bf16_scalar(const uint16_t *w, const float *x, int n) {
    double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8)
        for (int l = 0; l < 8; l++) a[l] = a[l] + (double)kk_bf16_to_f32(w[i + l]) * (double)x[i + l];
    for (; i < n; i++) a[i - n8] = a[i - n8] + (double)kk_bf16_to_f32(w[i]) * (double)x[i];
    return kk_tree(a);
}

static double kk_dot_f16_scalar(const uint16_t *w, const float *x, int n) {
    double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8)
        for (int l = 0; l < 8; l++) a[l] = a[l] + (double)kk_f16_to_f32(w[i + l]) * (double)x[i + l];
    for (; i < n; i++) a[i - n8] = a[i - n8] + (double)kk_f16_to_f32(w[i]) * (double)x[i];
    return kk_tree(a);
}

#ifdef K3_X86
int kk_cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* The 8 double lanes live in two registers: lo holds lanes 0..3, hi lanes 4..7. */
typedef struct {
    __m256d lo, hi;
} kk_lanes;

/* lanes += w * x for 8 floats each (exact products, one rounding per add). */
K3_AVX2 static inline void kk_lanes_madd(kk_lanes *a, __m256 w, __m256 x) {
    __m256d wl = _mm256_cvtps_pd(_mm256_castps256_ps128(w)), wh = _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1));
    __m256d xl = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), xh = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    a->lo = _mm256_fmadd_pd(wl, xl, a->lo);
    a->hi = _mm256_fmadd_pd(wh, xh, a->hi);
}

/* The same with x already widened (xd: 8 doubles): x is shared by every row of a matmul,
 * so it is widened once per call instead of once per row. */
K3_AVX2 static inline void kk_lanes_madd_xd(kk_lanes *a, __m256 w, const double *xd) {
    __m256d wl = _mm256_cvtps_pd(_mm256_castps256_ps128(w)), wh = _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1));
    a->lo = _mm256_fmadd_pd(wl, _mm256_loadu_pd(xd), a->lo);
    a->hi = _mm256_fmadd_pd(wh, _mm256_loadu_pd(xd + 4), a->hi);
}

K3_AVX2 static double kk_hsum_tree(kk_lanes a) {
    /* Same tree as kk_tree: (lo+hi) gives a0+a4..a3+a7, then pairs, then the last add. */
    __m256d s = _mm256_add_pd(a.lo, a.hi); /* s0=a0+a4 s1=a1+a5 s2=a2+a6 s3=a3+a7 */
    __m128d t = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1)); /* t0=s0+s2 t1=s1+s3 */
    return _mm_cvtsd_f64(_mm_add_sd(t, _mm_unpackhi_pd(t, t)));
}

K3_AVX2 static void kk_lanes_store(kk_lanes a, double out[8]) {
    _mm256_storeu_pd(out, a.lo);
    _mm256_storeu_pd(out + 4, a.hi);
}

K3_AVX2 static double kk_dot_avx2(const float *x, const float *y, int n) {
    kk_lanes acc = {_mm256_setzero_pd(), _mm256_setzero_pd()};
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8) kk_lanes_madd(&acc, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i));
    if (i < n) {
        double a[8];
        kk_lanes_store(acc, a);
        for (; i < n; i++) a[i - n8] = a[i - n8] + (double)x[i] * (double)y[i];
        return kk_tree(a);
    }
    return kk_hsum_tree(acc);
}

K3_AVX2 static double kk_dot_bf16_avx2(const uint16_t *w, const float *x,
                                                                int n) {
    kk_lanes acc = {_mm256_setzero_pd(), _mm256_setzero_pd()};
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(w + i));
        __m256 wf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        kk_lanes_madd(&acc, wf, _mm256_loadu_ps(x + i));
    }
    if (i < n) {
        double a[8];
        kk_lanes_store(acc, a);
        for (; i < n; i++) a[i - n8] = a[i - n8] + (double)kk_bf16_to_f32(w[i]) * (double)x[i];
        return kk_tree(a);
    }
    return kk_hsum_tree(acc);
}

/* kk_dot_avx2 with y widened beforehand (same order, same bits). */
K3_AVX2 static double kk_dot_xd_avx2(const float *x, const double *yd, int n) {
    kk_lanes acc = {_mm256_setzero_pd(), _mm256_setzero_pd()};
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8) kk_lanes_madd_xd(&acc, _mm256_loadu_ps(x + i), yd + i);
    if (i < n) {
        double a[8];
        kk_lanes_store(acc, a);
        for (; i < n; i++) a[i - n8] = a[i - n8] + (double)x[i] * yd[i];
        return kk_tree(a);
    }
    return kk_hsum_tree(acc);
}

/* kk_dot_bf16_avx2 with x widened beforehand (same order, same bits). */
K3_AVX2 static double kk_dot_bf16_xd_avx2(const uint16_t *w, const double *xd, int n) {
    kk_lanes acc = {_mm256_setzero_pd(), _mm256_setzero_pd()};
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(w + i));
        kk_lanes_madd_xd(&acc, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)), xd + i);
    }
    if (i < n) {
        double a[8];
        kk_lanes_store(acc, a);
        for (; i < n; i++) a[i - n8] = a[i - n8] + (double)kk_bf16_to_f32(w[i]) * xd[i];
        return kk_tree(a);
    }
    return kk_hsum_tree(acc);
}

/* Pieces of the register-blocked multi-token kernels (kk_block_tok): 8 weights are loaded
 * and widened once, then meet several tokens' lanes with kk_lanes_madd_xd's fused ops. */
#define KK_SIMD_FN K3_AVX2
typedef __m256 kk_f8; /* 8 floats */

K3_AVX2 static inline kk_lanes kk_lanes_zero(void) {
    kk_lanes a = {_mm256_setzero_pd(), _mm256_setzero_pd()};
    return a;
}

K3_AVX2 static inline kk_f8 kk_f8_load(const float *p) { return _mm256_loadu_ps(p); }

/* 8 BF16 weights widened exactly to floats (as kk_dot_bf16_xd_avx2 does) */
K3_AVX2 static inline kk_f8 kk_f8_bf16(const uint16_t *w) {
    __m128i h = _mm_loadu_si128((const __m128i *)w);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

K3_AVX2 static inline kk_lanes kk_f8_widen(kk_f8 w) {
    kk_lanes d = {_mm256_cvtps_pd(_mm256_castps256_ps128(w)), _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1))};
    return d;
}

/* lanes += w * x, w widened beforehand: the same fused ops as kk_lanes_madd_xd. */
K3_AVX2 static inline void kk_lanes_fma(kk_lanes *a, kk_lanes w, const double *xd) {
    a->lo = _mm256_fmadd_pd(w.lo, _mm256_loadu_pd(xd), a->lo);
    a->hi = _mm256_fmadd_pd(w.hi, _mm256_loadu_pd(xd + 4), a->hi);
}

int kk_cpu_has_simd(void) { return kk_cpu_has_avx2(); }
const char *k3_simd_kind(void) { return kk_cpu_has_avx2() ? "avx2" : "none"; }
#define kk_dot_simd kk_dot_avx2
#define kk_dot_bf16_simd kk_dot_bf16_avx2
#define kk_dot_xd_simd kk_dot_xd_avx2
#define kk_dot_bf16_xd_simd kk_dot_bf16_xd_avx2
#elif defined(K3_NEON)
int kk_cpu_has_avx2(void) { return 0; }
int kk_cpu_has_simd(void) { return 1; }
const char *k3_simd_kind(void) { return "neon"; }

/* The 8 double lanes live in four registers: q[k] holds lanes 2k and 2k+1. */
typedef struct {
    float64x2_t q[4];
} kk_lanes;

static inline kk_lanes kk_lanes_zero(void) {
    kk_lanes a;
    for (int k = 0; k < 4; k++) a.q[k] = vdupq_n_f64(0.0);
    return a;
}

/* lanes += w * x for 8 floats each (w0, x0: lanes 0..3; w1, x1: lanes 4..7).  As on
 * x86, the fused op gives mul-then-add bits: a product of two floats is exact in double. */
static inline void kk_lanes_madd(kk_lanes *a, float32x4_t w0, float32x4_t w1, float32x4_t x0,
                                 float32x4_t x1) {
    a->q[0] = vfmaq_f64(a->q[0], vcvt_f64_f32(vget_low_f32(w0)), vcvt_f64_f32(vget_low_f32(x0)));
    a->q[1] = vfmaq_f64(a->q[1], vcvt_high_f64_f32(w0), vcvt_high_f64_f32(x0));
    a->q[2] = vfmaq_f64(a->q[2], vcvt_f64_f32(vget_low_f32(w1)), vcvt_f64_f32(vget_low_f32(x1)));
    a->q[3] = vfmaq_f64(a->q[3], vcvt_high_f64_f32(w1), vcvt_high_f64_f32(x1));
}

/* The same with x already widened (xd: 8 doubles), as kk_lanes_madd_xd on x86. */
static inline void kk_lanes_madd_xd(kk_lanes *a, float32x4_t w0, float32x4_t w1, const double *xd) {
    a->q[0] = vfmaq_f64(a->q[0], vcvt_f64_f32(vget_low_f32(w0)), vld1q_f64(xd));
    a->q[1] = vfmaq_f64(a->q[1], vcvt_high_f64_f32(w0), vld1q_f64(xd + 2));
    a->q[2] = vfmaq_f64(a->q[2], vcvt_f64_f32(vget_low_f32(w1)), vld1q_f64(xd + 4));
    a->q[3] = vfmaq_f64(a->q[3], vcvt_high_f64_f32(w1), vld1q_f64(xd + 6));
}

static double kk_hsum_tree(kk_lanes a) {
    /* Same tree as kk_tree: lanes k and k+4 first, then the pairs, then the last add. */
    float64x2_t s01 = vaddq_f64(a.q[0], a.q[2]); /* a0+a4, a1+a5 */
    float64x2_t s23 = vaddq_f64(a.q[1], a.q[3]); /* a2+a6, a3+a7 */
    float64x2_t t = vaddq_f64(s01, s23);         /* (a0+a4)+(a2+a6), (a1+a5)+(a3+a7) */
    return vgetq_lane_f64(t, 0) + vgetq_lane_f64(t, 1);
}

static void kk_lanes_store(kk_lanes a, double out[8]) {
    for (int k = 0; k < 4; k++) vst1q_f64(out + 2 * k, a.q[k]);
}

/* 8 BF16 weights widened exactly to floats (the 16 bits go on top, as kk_bf16_to_f32). */
static inline void kk_bf16x8_neon(const uint16_t *w, float32x4_t *w0, float32x4_t *w1) {
    uint16x8_t h = vld1q_u16(w);
    *w0 = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
    *w1 = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
}

static double kk_dot_neon(const float *x, const float *y, int n) {
    kk_lanes acc = kk_lanes_zero();
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8)
        kk_lanes_madd(&acc, vld1q_f32(x + i), vld1q_f32(x + i + 4), vld1q_f32(y + i), vld1q_f32(y + i + 4));
    if (i < n) {
        double a[8];
        kk_lanes_store(acc, a);
        for (; i < n; i++) a[i - n8] = a[i - n8] + (double)x[i] * (double)y[i];
        return kk_tree(a);
    }
    return kk_hsum_tree(acc);
}

static double kk_dot_bf16_neon(const uint16_t *w, const float *x, int n) {
    kk_lanes acc = kk_lanes_zero();
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8) {
        float32x4_t w0, w1;
        kk_bf16x8_neon(w + i, &w0, &w1);
        kk_lanes_madd(&acc, w0, w1, vld1q_f32(x + i), vld1q_f32(x + i + 4));
    }
    if (i < n) {
        double a[8];
        kk_lanes_store(acc, a);
        for (; i < n; i++) a[i - n8] = a[i - n8] + (double)kk_bf16_to_f32(w[i]) * (double)x[i];
        return kk_tree(a);
    }
    return kk_hsum_tree(acc);
}

/* kk_dot_neon with y widened beforehand (same order, same bits). */
static double kk_dot_xd_neon(const float *x, const double *yd, int n) {
    kk_lanes acc = kk_lanes_zero();
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8) kk_lanes_madd_xd(&acc, vld1q_f32(x + i), vld1q_f32(x + i + 4), yd + i);
    if (i < n) {
        double a[8];
        kk_lanes_store(acc, a);
        for (; i < n; i++) a[i - n8] = a[i - n8] + (double)x[i] * yd[i];
        return kk_tree(a);
    }
    return kk_hsum_tree(acc);
}

/* kk_dot_bf16_neon with x widened beforehand (same order, same bits). */
static double kk_dot_bf16_xd_neon(const uint16_t *w, const double *xd, int n) {
    kk_lanes acc = kk_lanes_zero();
    int n8 = n & ~7, i;
    for (i = 0; i < n8; i += 8) {
        float32x4_t w0, w1;
        kk_bf16x8_neon(w + i, &w0, &w1);
        kk_lanes_madd_xd(&acc, w0, w1, xd + i);
    }
    if (i < n) {
        double a[8];
        kk_lanes_store(acc, a);
        for (; i < n; i++) a[i - n8] = a[i - n8] + (double)kk_bf16_to_f32(w[i]) * xd[i];
        return kk_tree(a);
    }
    return kk_hsum_tree(acc);
}
/* Pieces of the register-blocked multi-token kernels, as on x86 (kk_f8_* there). */
#define KK_SIMD_FN
typedef struct {
    float32x4_t lo, hi; /* floats 0..3, 4..7 */
} kk_f8;

static inline kk_f8 kk_f8_load(const float *p) {
    kk_f8 w = {vld1q_f32(p), vld1q_f32(p + 4)};
    return w;
}

static inline kk_f8 kk_f8_bf16(const uint16_t *w) {
    kk_f8 f;
    kk_bf16x8_neon(w, &f.lo, &f.hi);
    return f;
}

static inline kk_lanes kk_f8_widen(kk_f8 w) {
    kk_lanes d;
    d.q[0] = vcvt_f64_f32(vget_low_f32(w.lo));
    d.q[1] = vcvt_high_f64_f32(w.lo);
    d.q[2] = vcvt_f64_f32(vget_low_f32(w.hi));
    d.q[3] = vcvt_high_f64_f32(w.hi);
    return d;
}

/* lanes += w * x, w widened beforehand: the same fused ops as kk_lanes_madd_xd. */
static inline void kk_lanes_fma(kk_lanes *a, kk_lanes w, const double *xd) {
    a->q[0] = vfmaq_f64(a->q[0], w.q[0], vld1q_f64(xd));
    a->q[1] = vfmaq_f64(a->q[1], w.q[1], vld1q_f64(xd + 2));
    a->q[2] = vfmaq_f64(a->q[2], w.q[2], vld1q_f64(xd + 4));
    a->q[3] = vfmaq_f64(a->q[3], w.q[3], vld1q_f64(xd + 6));
}
#define kk_dot_simd kk_dot_neon
#define kk_dot_bf16_simd kk_dot_bf16_neon
#define kk_dot_xd_simd kk_dot_xd_neon
#define kk_dot_bf16_xd_simd kk_dot_bf16_xd_neon
#else
int kk_cpu_has_avx2(void) { return 0; }
int kk_cpu_has_simd(void) { return 0; }
const char *k3_simd_kind(void) { return "none"; }
#endif

/* X [ntok rows of ldx] widened to doubles [ntok, cols]; NULL when out of memory (the
 * callers then take the float-x kernels, which give the same bits). */
static double *kk_widen(const float *X, int ldx, int ntok, int cols) {
    double *xd = (double *)malloc(sizeof(double) * (size_t)ntok * (size_t)cols);
    if (!xd) return NULL;
    for (int t = 0; t < ntok; t++)
        for (int i = 0; i < cols; i++) xd[(size_t)t * cols + i] = X[(size_t)t * ldx + i];
    return xd;
}

double kk_dot_d(const float *a, const float *b, int n, int simd) {
#ifdef K3_SIMD
    if (simd) return kk_dot_simd(a, b, n);
#endif
    (void)simd;
    return kk_dot_scalar(a, b, n);
}

float kk_dot(const float *a, const float *b, int n, int simd) { return (float)kk_dot_d(a, b, n, simd); }

static double kk_dot_row_d(const kk_mat *w, int row, const float *x, int simd) {
    size_t off = (size_t)row * (size_t)w->cols;
    switch (w->dtype) {
    case K3_DT_BF16: {
        const uint16_t *p = (const uint16_t *)w->data + off;
#ifdef K3_SIMD
        if (simd) return kk_dot_bf16_simd(p, x, w->cols);
#endif
        return kk_dot_bf16_scalar(p, x, w->cols);
    }
    case K3_DT_F16:
        /* rare in checkpoints: portable path only (same order, so same bits) */
        return kk_dot_f16_scalar((const uint16_t *)w->data + off, x, w->cols);
    default:
        return kk_dot_d((const float *)w->data + off, x, w->cols, simd);
    }
}

float kk_dot_row(const kk_mat *w, int row, const float *x, int simd) { return (float)kk_dot_row_d(w, row, x, simd); }

#ifdef K3_SIMD
/* Register blocking for several tokens (prefill): KK_TOK tokens' lanes sit in registers
 * side by side, and each 8 weights of a row are loaded and widened once for all of them.
 * Every token's lanes still get kk_dot_bf16_xd_simd's (or kk_dot_xd_simd's) fused ops in
 * the same order, then the same tail and tree, so each output has the one-token bits.
 * KK_ROWS rows take turns on one token block, KK_SPAN columns at a time, so that block's
 * widened x (KK_TOK x KK_SPAN doubles, 16 KB) is read from L1 rather than L2 or L3. */
#define KK_TOK 4
#define KK_ROWS 8
#define KK_SPAN 512 /* a multiple of 8 */

/* acc[t] += w[i0..i1) . x_t[i0..i1) for t < KK_TOK, x_t = xd + t * ldx (i0, i1 multiples of 8). */
KK_SIMD_FN static void kk_bf16_span_tok(const uint16_t *w, const double *xd, size_t ldx, int i0, int i1,
                                        kk_lanes acc[KK_TOK]) {
    kk_lanes a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3];
    const double *x0 = xd, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
    for (int i = i0; i < i1; i += 8) {
        kk_lanes wd = kk_f8_widen(kk_f8_bf16(w + i));
        kk_lanes_fma(&a0, wd, x0 + i);
        kk_lanes_fma(&a1, wd, x1 + i);
        kk_lanes_fma(&a2, wd, x2 + i);
        kk_lanes_fma(&a3, wd, x3 + i);
    }
    acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
}

/* The same for a float row (an MXFP4 row decoded once). */
KK_SIMD_FN static void kk_f32_span_tok(const float *w, const double *xd, size_t ldx, int i0, int i1,
                                       kk_lanes acc[KK_TOK]) {
    kk_lanes a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3];
    const double *x0 = xd, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
    for (int i = i0; i < i1; i += 8) {
        kk_lanes wd = kk_f8_widen(kk_f8_load(w + i));
        kk_lanes_fma(&a0, wd, x0 + i);
        kk_lanes_fma(&a1, wd, x1 + i);
        kk_lanes_fma(&a2, wd, x2 + i);
        kk_lanes_fma(&a3, wd, x3 + i);
    }
    acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
}

/* One token's lanes after the full blocks: the one-token kernels' tail and tree. */
KK_SIMD_FN static double kk_finish_tok(kk_lanes acc, const void *w, int bf16, const double *xd, int n8, int n) {
    if (n8 == n) return kk_hsum_tree(acc);
    double a[8];
    kk_lanes_store(acc, a);
    for (int i = n8; i < n; i++) {
        double wi = bf16 ? (double)kk_bf16_to_f32(((const uint16_t *)w)[i]) : (double)((const float *)w)[i];
        a[i - n8] = a[i - n8] + wi * xd[i];
    }
    return kk_tree(a);
}

/* nr <= KK_ROWS rows (BF16 when bf16, else float; row r at w + r * n elements) times the
 * tokens [0, ntb) of xd ([ntb, n] widened; ntb a multiple of KK_TOK): Y[t * ldy + r]. */
KK_SIMD_FN static void kk_block_tok(const void *w, int bf16, int nr, int n, const double *xd, int ntb, float *Y,
                                    size_t ldy) {
    int n8 = n & ~7;
    kk_lanes acc[KK_ROWS][KK_TOK];
    for (int t0 = 0; t0 < ntb; t0 += KK_TOK) {
        const double *xt = xd + (size_t)t0 * n;
        for (int r = 0; r < nr; r++)
            for (int t = 0; t < KK_TOK; t++) acc[r][t] = kk_lanes_zero();
        for (int i0 = 0; i0 < n8; i0 += KK_SPAN) {
            int i1 = n8 - i0 < KK_SPAN ? n8 : i0 + KK_SPAN;
            for (int r = 0; r < nr; r++) {
                if (bf16)
                    kk_bf16_span_tok((const uint16_t *)w + (size_t)r * n, xt, (size_t)n, i0, i1, acc[r]);
                else
                    kk_f32_span_tok((const float *)w + (size_t)r * n, xt, (size_t)n, i0, i1, acc[r]);
            }
        }
        for (int r = 0; r < nr; r++) {
            const void *wr = bf16 ? (const void *)((const uint16_t *)w + (size_t)r * n)
                                  : (const void *)((const float *)w + (size_t)r * n);
            for (int t = 0; t < KK_TOK; t++)
                Y[(size_t)(t0 + t) * ldy + r] = (float)kk_finish_tok(acc[r][t], wr, bf16, xt + (size_t)t * n, n8, n);
        }
    }
}
#endif

typedef struct {
    const kk_mat *w;
    const float *X;
    int ldx, ntok;
    float *Y;
    int ldy, simd;
    const double *Xd; /* X widened ([ntok, cols]) for the SIMD BF16 kernel, or NULL */
    int per_token;    /* kk_ctx.per_token */
} kk_mm_job;

static void kk_mm_rows(void *vctx, int b, int e) {
    kk_mm_job *j = (kk_mm_job *)vctx;
#ifdef K3_SIMD
    if (j->Xd) {
        int n = j->w->cols;
        const uint16_t *base = (const uint16_t *)j->w->data;
        /* whole token blocks in registers; the rest (ntok % KK_TOK) one token at a time */
        int ntb = j->per_token ? 0 : j->ntok - j->ntok % KK_TOK;
        for (int r0 = b; r0 < e; r0 += KK_ROWS) {
            int r1 = e - r0 < KK_ROWS ? e : r0 + KK_ROWS;
            if (ntb) kk_block_tok(base + (size_t)r0 * n, 1, r1 - r0, n, j->Xd, ntb, j->Y + r0, (size_t)j->ldy);
            for (int r = r0; r < r1; r++)
                for (int t = ntb; t < j->ntok; t++)
                    j->Y[(size_t)t * j->ldy + r] =
                        (float)kk_dot_bf16_xd_simd(base + (size_t)r * n, j->Xd + (size_t)t * n, n);
        }
        return;
    }
#endif
    for (int r = b; r < e; r++)
        for (int t = 0; t < j->ntok; t++)
            j->Y[(size_t)t * j->ldy + r] = kk_dot_row(j->w, r, j->X + (size_t)t * j->ldx, j->simd);
}

void kk_matmul(const kk_ctx *c, const kk_mat *w, const float *X, int ldx, int ntok, float *Y,
               int ldy) {
    double *xd = c->simd && w->dtype == K3_DT_BF16 ? kk_widen(X, ldx, ntok, w->cols) : NULL;
    kk_mm_job j = {w, X, ldx, ntok, Y, ldy, c->simd, xd, c->per_token};
    if (c->madds) __atomic_add_fetch(c->madds, (uint64_t)w->rows * (uint64_t)w->cols * (uint64_t)ntok, __ATOMIC_RELAXED);
    /* Small matrices are not worth waking the pool. */
    int nt = ((size_t)w->rows * w->cols * (size_t)ntok < 32768) ? 1 : c->nthreads;
    kp_parallel_for(nt, w->rows, kk_mm_rows, &j);
    free(xd);
}

/* E2M1 code values (OCP MX), bit 3 is the sign. */
static const float kk_e2m1[16] = {0.0f, 0.5f, 1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

void kk_mxfp4_decode_row(const uint8_t *packed, const uint8_t *scales, int cols, float *out,
                         uint64_t *nan_groups) {
    for (int g = 0; g < cols / 32; g++) {
        uint8_t s = scales[g];
        float *o = out + g * 32;
        const uint8_t *p = packed + g * 16;
        if (s == 255) { /* NaN scale in the MX spec: a zero group, counted */
            memset(o, 0, 32 * sizeof(float));
            if (nan_groups) __atomic_add_fetch(nan_groups, 1, __ATOMIC_RELAXED);
            continue;
        }
        /* 2^(s-127) exactly, subnormal for s == 0 (never flushed) */
        float sc = ldexpf(1.0f, (int)s - 127);
        for (int j = 0; j < 16; j++) {
            o[2 * j] = kk_e2m1[p[j] & 15] * sc;      /* low nibble: even column */
            o[2 * j + 1] = kk_e2m1[p[j] >> 4] * sc; /* high nibble: odd column */
        }
    }
}

#ifdef K3_SIMD
/* E2M1 codes times two, as int8: exact integers, so (2e) * (scale / 2) == e * scale.
 * Code 8 (-0) becomes +0: a signed zero weight never changes a sum that starts at +0. */
static const int8_t kk_e2m1_x2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#ifdef K3_X86
/* 32 weights of one group as 4 x 8 floats, in column order. */
K3_AVX2 static void kk_mx_group_avx2(const uint8_t *p, float half_scale,
                                                             __m256 out[4]) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)kk_e2m1_x2);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    /* element 2j is the low nibble of byte j, element 2j+1 the high one */
    __m128i e0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
    __m128i e1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
    __m256 sc = _mm256_set1_ps(half_scale);
    out[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e0)), sc);
    out[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e0, 8))), sc);
    out[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(e1)), sc);
    out[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(e1, 8))), sc);
}
#endif

/* 2^(s-128) for every scale byte, built from bits (s = 0, 1 give exact subnormals). */
static float kk_half_scale(uint8_t s) {
    uint32_t bits = s >= 2 ? (uint32_t)(s - 1) << 23 : (s == 1 ? 1u << 22 : 1u << 21);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#define KK_MX_ROWS 4 /* rows side by side in the fused one-token kernels */

#ifdef K3_X86
/* Decode a row into floats (same values as the scalar decoder up to the sign of zero). */
K3_AVX2 static void kk_mx_decode_row_avx2(const uint8_t *packed, const uint8_t *scales,
                                                                  int cols, float *out, uint64_t *nan_groups) {
    for (int g = 0; g < cols / 32; g++) {
        if (scales[g] == 255) {
            memset(out + g * 32, 0, 32 * sizeof(float));
            if (nan_groups) __atomic_add_fetch(nan_groups, 1, __ATOMIC_RELAXED);
            continue;
        }
        __m256 w[4];
        kk_mx_group_avx2(packed + g * 16, kk_half_scale(scales[g]), w);
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(out + g * 32 + q * 8, w[q]);
    }
}

/* NR rows times one token, fused: each row keeps kk_dot's lane order over its decoded
 * weights; several rows run side by side only to hide the add latency. */
K3_AVX2 static void kk_mx_dot_rows_avx2(const uint8_t *packed, const uint8_t *scales,
                                                                int nr, int cols, const double *xd, float *y,
                                                                uint64_t *nan_groups) {
    size_t pr = (size_t)cols / 2, sr = (size_t)cols / 32;
    kk_lanes acc[KK_MX_ROWS];
    for (int r = 0; r < nr; r++) acc[r].lo = acc[r].hi = _mm256_setzero_pd();
    for (int g = 0; g < cols / 32; g++) {
        for (int r = 0; r < nr; r++) {
            uint8_t sb = scales[r * sr + g];
            __m256 w[4];
            if (sb == 255) {
                if (nan_groups) __atomic_add_fetch(nan_groups, 1, __ATOMIC_RELAXED);
                for (int q = 0; q < 4; q++) w[q] = _mm256_setzero_ps();
            } else {
                kk_mx_group_avx2(packed + r * pr + g * 16, kk_half_scale(sb), w);
            }
            for (int q = 0; q < 4; q++) kk_lanes_madd_xd(&acc[r], w[q], xd + g * 32 + q * 8);
        }
    }
    for (int r = 0; r < nr; r++) y[r] = (float)kk_hsum_tree(acc[r]);
}
#define kk_mx_decode_row_simd kk_mx_decode_row_avx2
#define kk_mx_dot_rows_simd kk_mx_dot_rows_avx2
#elif defined(K3_NEON)
/* 32 weights of one group as 8 x 4 floats, in column order (kk_mx_group_avx2's values). */
static void kk_mx_group_neon(const uint8_t *p, float half_scale, float32x4_t out[8]) {
    const int8x16_t lut = vld1q_s8(kk_e2m1_x2);
    uint8x16_t b = vld1q_u8(p);
    uint8x16_t lo = vandq_u8(b, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(b, 4);
    /* element 2j is the low nibble of byte j, element 2j+1 the high one */
    int8x16_t e[2] = {vqtbl1q_s8(lut, vzip1q_u8(lo, hi)), vqtbl1q_s8(lut, vzip2q_u8(lo, hi))};
    float32x4_t sc = vdupq_n_f32(half_scale);
    for (int h = 0; h < 2; h++) {
        int16x8_t l16 = vmovl_s8(vget_low_s8(e[h])), h16 = vmovl_high_s8(e[h]);
        out[4 * h + 0] = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(l16))), sc);
        out[4 * h + 1] = vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(l16)), sc);
        out[4 * h + 2] = vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(h16))), sc);
        out[4 * h + 3] = vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(h16)), sc);
    }
}

/* Decode a row into floats (same values as the scalar decoder up to the sign of zero). */
static void kk_mx_decode_row_neon(const uint8_t *packed, const uint8_t *scales, int cols, float *out,
                                  uint64_t *nan_groups) {
    for (int g = 0; g < cols / 32; g++) {
        if (scales[g] == 255) {
            memset(out + g * 32, 0, 32 * sizeof(float));
            if (nan_groups) __atomic_add_fetch(nan_groups, 1, __ATOMIC_RELAXED);
            continue;
        }
        float32x4_t w[8];
        kk_mx_group_neon(packed + g * 16, kk_half_scale(scales[g]), w);
        for (int q = 0; q < 8; q++) vst1q_f32(out + g * 32 + q * 4, w[q]);
    }
}

/* kk_mx_dot_rows_avx2 on NEON: each row keeps kk_dot's lane order over its weights. */
static void kk_mx_dot_rows_neon(const uint8_t *packed, const uint8_t *scales, int nr, int cols,
                                const double *xd, float *y, uint64_t *nan_groups) {
    size_t pr = (size_t)cols / 2, sr = (size_t)cols / 32;
    kk_lanes acc[KK_MX_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = kk_lanes_zero();
    for (int g = 0; g < cols / 32; g++) {
        for (int r = 0; r < nr; r++) {
            uint8_t sb = scales[r * sr + g];
            float32x4_t w[8];
            if (sb == 255) {
                if (nan_groups) __atomic_add_fetch(nan_groups, 1, __ATOMIC_RELAXED);
                for (int q = 0; q < 8; q++) w[q] = vdupq_n_f32(0.0f);
            } else {
                kk_mx_group_neon(packed + r * pr + g * 16, kk_half_scale(sb), w);
            }
            for (int q = 0; q < 4; q++) kk_lanes_madd_xd(&acc[r], w[2 * q], w[2 * q + 1], xd + g * 32 + q * 8);
        }
    }
    for (int r = 0; r < nr; r++) y[r] = (float)kk_hsum_tree(acc[r]);
}
#define kk_mx_decode_row_simd kk_mx_decode_row_neon
#define kk_mx_dot_rows_simd kk_mx_dot_rows_neon
#endif
#endif

typedef struct {
    const uint8_t *packed, *scales;
    int rows, cols;
    const float *X;
    int ldx, ntok;
    float *Y;
    int ldy, simd;
    uint64_t *nan_groups;
    const double *Xd; /* X widened ([ntok, cols]) for the SIMD kernels, or NULL */
    int per_token;    /* kk_ctx.per_token */
} kk_mx_job;

#ifdef K3_SIMD
/* Several tokens: KK_ROWS rows decoded once each (scale-255 groups counted once per row),
 * then whole token blocks in registers (kk_block_tok) and the rest (ntok % KK_TOK) one
 * token at a time, as the per-token path does.  0 if the row buffer cannot be had. */
static int kk_mx_rows_blocked(const kk_mx_job *j, int b, int e) {
    size_t pr = (size_t)j->cols / 2, sr = (size_t)j->cols / 32, n = (size_t)j->cols;
    float *rows = (float *)malloc(sizeof(float) * KK_ROWS * n);
    if (!rows) return 0;
    int ntb = j->ntok - j->ntok % KK_TOK;
    for (int r0 = b; r0 < e; r0 += KK_ROWS) {
        int nr = e - r0 < KK_ROWS ? e - r0 : KK_ROWS;
        for (int r = 0; r < nr; r++)
            kk_mx_decode_row_simd(j->packed + (r0 + r) * pr, j->scales + (r0 + r) * sr, j->cols, rows + r * n,
                                  j->nan_groups);
        kk_block_tok(rows, 0, nr, j->cols, j->Xd, ntb, j->Y + r0, (size_t)j->ldy);
        for (int r = 0; r < nr; r++)
            for (int t = ntb; t < j->ntok; t++)
                j->Y[(size_t)t * j->ldy + r0 + r] = (float)kk_dot_xd_simd(rows + r * n, j->Xd + (size_t)t * n, j->cols);
    }
    free(rows);
    return 1;
}
#endif

static void kk_mx_rows(void *vctx, int b, int e) {
    kk_mx_job *j = (kk_mx_job *)vctx;
    size_t pr = (size_t)j->cols / 2, sr = (size_t)j->cols / 32;
#ifdef K3_SIMD
    if (j->Xd && j->ntok == 1) {
        for (int r = b; r < e; r += KK_MX_ROWS) {
            int nr = e - r < KK_MX_ROWS ? e - r : KK_MX_ROWS;
            kk_mx_dot_rows_simd(j->packed + r * pr, j->scales + r * sr, nr, j->cols, j->Xd, j->Y + r, j->nan_groups);
        }
        return;
    }
    if (j->Xd && !j->per_token && j->ntok >= KK_TOK && kk_mx_rows_blocked(j, b, e)) return;
#endif
    float row[16384]; /* km_check_config caps latent and expert widths at 16384 */
    for (int r = b; r < e; r++) {
#ifdef K3_SIMD
        if (j->simd)
            kk_mx_decode_row_simd(j->packed + r * pr, j->scales + r * sr, j->cols, row, j->nan_groups);
        else
#endif
            kk_mxfp4_decode_row(j->packed + r * pr, j->scales + r * sr, j->cols, row, j->nan_groups);
        for (int t = 0; t < j->ntok; t++) {
#ifdef K3_SIMD
            if (j->Xd) {
                j->Y[(size_t)t * j->ldy + r] = (float)kk_dot_xd_simd(row, j->Xd + (size_t)t * j->cols, j->cols);
                continue;
            }
#endif
            j->Y[(size_t)t * j->ldy + r] = kk_dot(row, j->X + (size_t)t * j->ldx, j->cols, j->simd);
        }
    }
}

void kk_mxfp4_matmul(const kk_ctx *c, const uint8_t *packed, const uint8_t *scales, int rows,
                     int cols, const float *X, int ldx, int ntok, float *Y, int ldy,
                     uint64_t *nan_groups) {
    double *xd = c->simd ? kk_widen(X, ldx, ntok, cols) : NULL;
    kk_mx_job j = {packed, scales, rows, cols, X, ldx, ntok, Y, ldy, c->simd, nan_groups, xd, c->per_token};
    if (c->madds) __atomic_add_fetch(c->madds, (uint64_t)rows * (uint64_t)cols * (uint64_t)ntok, __ATOMIC_RELAXED);
    int nt = ((size_t)rows * cols * (size_t)ntok < 32768) ? 1 : c->nthreads;
    kp_parallel_for(nt, rows, kk_mx_rows, &j);
    free(xd);
}

void kk_rmsnorm(const float *x, const float *w, int n, float eps, float *out, int simd) {
    /* the mean square and its root in double; one rounding to float at the end */
    double ss = kk_dot_d(x, x, n, simd);
    float inv = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    for (int i = 0; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

/* The activations are evaluated in double and rounded once, so each is within half an
 * ulp of float64's value (float libm calls and float steps would add several ulps). */
static double kk_sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }

float kk_sigmoid(float x) { return (float)kk_sigmoid_d(x); }

float kk_silu(float x) { return (float)((double)x * kk_sigmoid_d(x)); }

float kk_situ(float g, float v, float b1, float b2) {
    /* the sigmoid takes the uncapped gate */
    double gate = ((double)b1 * tanh((double)g / b1)) * kk_sigmoid_d(g);
    return (float)(gate * ((double)b2 * tanh((double)v / b2)));
}

/* ---- the machine's double multiply-add peak, to print achieved GFLOP/s beside ----
 * Independent chains a = a * m + c (m just below 1, so the values stay near 1: no overflow
 * and no subnormals), more chains than FMA latency times FMA units on current cores. */
#define KK_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define KK_CHAIN_N 12

#ifdef K3_X86
K3_AVX2 static double kk_peak_avx2(int64_t iters) {
    const __m256d m = _mm256_set1_pd(0.9999999), c = _mm256_set1_pd(1e-7);
#define KK_DECL(k) __m256d a##k = _mm256_set1_pd(1.0 + (k) * 1e-3);
#define KK_STEP(k) a##k = _mm256_fmadd_pd(a##k, m, c);
#define KK_SUM(k) s = _mm256_add_pd(s, a##k);
    KK_CHAINS(KK_DECL)
    for (int64_t i = 0; i < iters; i++) {
        KK_CHAINS(KK_STEP)
    }
    __m256d s = _mm256_setzero_pd();
    KK_CHAINS(KK_SUM)
    double o[4];
    _mm256_storeu_pd(o, s);
    return o[0] + o[1] + o[2] + o[3];
#undef KK_DECL
#undef KK_STEP
#undef KK_SUM
}
#define KK_PEAK_LANES 4
#define kk_peak_simd kk_peak_avx2
#elif defined(K3_NEON)
static double kk_peak_neon(int64_t iters) {
    const float64x2_t m = vdupq_n_f64(0.9999999), c = vdupq_n_f64(1e-7);
#define KK_DECL(k) float64x2_t a##k = vdupq_n_f64(1.0 + (k) * 1e-3);
#define KK_STEP(k) a##k = vfmaq_f64(c, a##k, m);
#define KK_SUM(k) s = vaddq_f64(s, a##k);
    KK_CHAINS(KK_DECL)
    for (int64_t i = 0; i < iters; i++) {
        KK_CHAINS(KK_STEP)
    }
    float64x2_t s = vdupq_n_f64(0.0);
    KK_CHAINS(KK_SUM)
    return vgetq_lane_f64(s, 0) + vgetq_lane_f64(s, 1);
#undef KK_DECL
#undef KK_STEP
#undef KK_SUM
}
#define KK_PEAK_LANES 2
#define kk_peak_simd kk_peak_neon
#endif

/* Without SIMD: the same chains in scalar doubles (a multiply, then an add). */
static double kk_peak_scalar(int64_t iters) {
    const double m = 0.9999999, c = 1e-7;
#define KK_DECL(k) double a##k = 1.0 + (k) * 1e-3;
#define KK_STEP(k) a##k = a##k * m + c;
#define KK_SUM(k) s = s + a##k;
    KK_CHAINS(KK_DECL)
    for (int64_t i = 0; i < iters; i++) {
        KK_CHAINS(KK_STEP)
    }
    double s = 0.0;
    KK_CHAINS(KK_SUM)
    return s;
#undef KK_DECL
#undef KK_STEP
#undef KK_SUM
}

typedef struct {
    int64_t iters;
    int simd;
    volatile double sink[64]; /* one per part: keeps the chains from being optimised away */
} kk_peak_job;

static void kk_peak_part(void *vctx, int b, int e) {
    kk_peak_job *j = (kk_peak_job *)vctx;
    for (int p = b; p < e; p++) {
#ifdef K3_SIMD
        if (j->simd) {
            j->sink[p] = kk_peak_simd(j->iters);
            continue;
        }
#endif
        j->sink[p] = kk_peak_scalar(j->iters);
    }
}

static double kk_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* threads parts of `iters` iterations each, all at once: wall seconds */
static double kk_peak_run(kk_peak_job *j, int threads) {
    double t0 = kk_now();
    kp_parallel_for(threads, threads, kk_peak_part, j);
    return kk_now() - t0;
}

double k3_fma_peak_gflops(double seconds, int32_t threads) {
    if (!(seconds > 0.0) || seconds > 60.0 || threads < 1 || threads > 64) return -1.0;
    kk_peak_job j = {1 << 12, kk_cpu_has_simd(), {0.0}};
    double t = kk_peak_run(&j, 1);
    while (t < seconds / 20 && j.iters < ((int64_t)1 << 40)) { /* calibrate on one thread */
        j.iters *= 2;
        t = kk_peak_run(&j, 1);
    }
    if (t > 0.0) j.iters = (int64_t)((double)j.iters * (seconds / t)) + 1;
    t = kk_peak_run(&j, threads);
    int lanes = 1;
#ifdef K3_SIMD
    if (j.simd) lanes = KK_PEAK_LANES;
#endif
    return t > 0.0 ? 2.0 * KK_CHAIN_N * lanes * (double)j.iters * threads / t / 1e9 : -1.0;
}
