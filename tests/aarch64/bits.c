/* bits.c: scalar versus SIMD bit identity of the engine's kernels and forward pass, on
 * whatever architecture this is built for (tests/aarch64/run.sh builds it for x86-64 and
 * for AArch64, runs the second under qemu-aarch64 and compares the two outputs).
 *
 *   bits kernels OUT [--expect-simd KIND]   every kernel, scalar vs SIMD, adversarial inputs
 *   bits forward SPEC OUT [--expect-simd KIND]   the model in SPEC (open_spec.py), every
 *                                            option set x threads 1, 2 x scalar, SIMD
 *
 * Exit 0 only when every SIMD result has the scalar result's bits (and, with
 * --expect-simd, the SIMD path in use is KIND: a build that fell back to scalar kernels
 * would compare scalar with scalar and prove nothing).  OUT gets the results, to be
 * compared byte for byte with another architecture's.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_internal.h"

static int g_checks, g_failures;
static FILE *g_out;

/* splitmix64: the same numbers on every architecture */
static uint64_t g_rng = 0x6b33a64ull;
static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Finite floats that make the summation order visible: huge values that cancel, tiny and
 * subnormal ones, signed zeros, exact powers of two.  (No inf or NaN: NaN bits are not
 * the same on x86 and ARM, and no reduction of finite products produces one here.) */
static float adversarial(void) {
    uint64_t r = rnd();
    float sign = (r & 1) ? -1.0f : 1.0f;
    switch ((r >> 1) % 8) {
    case 0: return sign * 0.0f;
    case 1: return sign * from_bits((uint32_t)(r >> 16) & 0x7fffffu);          /* subnormal */
    case 2: return sign * ldexpf(1.0f + (float)((r >> 20) & 0xfff) / 4096.0f, 100); /* cancels */
    case 3: return sign * ldexpf(1.0f, (int)((r >> 24) % 60) - 30);            /* 2^k */
    default: {
        int e = (int)((r >> 24) % 80) - 40;                                    /* wide range */
        return sign * ldexpf((float)((r >> 32) & 0xffffff) / 16777216.0f + 0.5f, e);
    }
    }
}

static void fill(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = adversarial();
}

static void emit(const void *p, size_t bytes) { fwrite(p, 1, bytes, g_out); }

static void check(const char *what, const void *scalar, const void *simd, size_t bytes) {
    g_checks++;
    emit(scalar, bytes);
    if (memcmp(scalar, simd, bytes) != 0) {
        g_failures++;
        fprintf(stderr, "MISMATCH %s\n", what);
    }
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "bits: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

static const int LENGTHS[] = {0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 203, 256, 1000, 3584};
#define NLEN ((int)(sizeof LENGTHS / sizeof LENGTHS[0]))

static void check_dots(void) {
    float *x = xmalloc(4096 * 4), *y = xmalloc(4096 * 4), *w = xmalloc(4096 * 4), o0[4096], o1[4096];
    for (int k = 0; k < NLEN; k++) {
        int n = LENGTHS[k];
        char what[96];
        fill(x, (size_t)n);
        fill(y, (size_t)n);
        double d0 = kk_dot_d(x, y, n, 0), d1 = kk_dot_d(x, y, n, 1);
        snprintf(what, sizeof what, "kk_dot_d n=%d", n);
        check(what, &d0, &d1, sizeof d0);
        /* the same vector against itself: every product positive, order still matters */
        d0 = kk_dot_d(x, x, n, 0), d1 = kk_dot_d(x, x, n, 1);
        snprintf(what, sizeof what, "kk_dot_d self n=%d", n);
        check(what, &d0, &d1, sizeof d0);
        if (n == 0) continue;
        fill(w, (size_t)n);
        kk_rmsnorm(x, w, n, 1e-6f, o0, 0);
        kk_rmsnorm(x, w, n, 1e-6f, o1, 1);
        snprintf(what, sizeof what, "kk_rmsnorm n=%d", n);
        check(what, o0, o1, sizeof(float) * (size_t)n);
    }
    free(x), free(y), free(w);
}

/* BF16, F16 and F32 weight rows: kk_dot_row, then kk_matmul (which widens x once for the
 * SIMD BF16 kernel) at 1, 3 and 9 tokens (9: two register blocks of 4 and one token on its
 * own), 1 and 2 threads. */
static void check_matmuls(void) {
    static const int ROWS[] = {1, 5, 13, 64};
    for (int k = 0; k < NLEN; k++) {
        int cols = LENGTHS[k];
        if (cols == 0) continue;
        for (int ri = 0; ri < 4; ri++) {
            int rows = ROWS[ri], ntok = 9;
            float *wf = xmalloc(sizeof(float) * (size_t)rows * cols), *x = xmalloc(sizeof(float) * (size_t)ntok * cols);
            uint16_t *wb = xmalloc(2 * (size_t)rows * cols), *wh = xmalloc(2 * (size_t)rows * cols);
            float *y0 = xmalloc(sizeof(float) * (size_t)ntok * rows), *y1 = xmalloc(sizeof(float) * (size_t)ntok * rows);
            fill(wf, (size_t)rows * cols);
            fill(x, (size_t)ntok * cols);
            for (size_t i = 0; i < (size_t)rows * cols; i++) {
                uint32_t u;
                memcpy(&u, &wf[i], 4);
                wb[i] = (uint16_t)(u >> 16);
                wh[i] = (uint16_t)(rnd() & 0xfbff); /* exponent < 31: a finite F16 of either sign */
            }
            kk_mat mats[3] = {{wb, K3_DT_BF16, rows, cols}, {wh, K3_DT_F16, rows, cols}, {wf, K3_DT_F32, rows, cols}};
            static const char *names[3] = {"bf16", "f16", "f32"};
            for (int d = 0; d < 3; d++) {
                char what[96];
                for (int r = 0; r < rows; r++) {
                    float a = kk_dot_row(&mats[d], r, x, 0), b = kk_dot_row(&mats[d], r, x, 1);
                    snprintf(what, sizeof what, "kk_dot_row %s rows=%d cols=%d r=%d", names[d], rows, cols, r);
                    check(what, &a, &b, sizeof a);
                }
                static const int NTOK[] = {1, 3, 9};
                for (int ni = 0; ni < 3; ni++)
                    for (int th = 1; th <= 2; th++) {
                        int nt = NTOK[ni];
                        kk_ctx c0 = {1, 0}, c1 = {th, 1};
                        kk_matmul(&c0, &mats[d], x, cols, nt, y0, rows);
                        kk_matmul(&c1, &mats[d], x, cols, nt, y1, rows);
                        snprintf(what, sizeof what, "kk_matmul %s rows=%d cols=%d ntok=%d threads=%d", names[d], rows, cols, nt, th);
                        check(what, y0, y1, sizeof(float) * (size_t)nt * rows);
                    }
            }
            free(wf), free(x), free(wb), free(wh), free(y0), free(y1);
        }
    }
}

/* MXFP4 from packed bytes: -0 codes, subnormal scales 0 and 1, the largest finite scale
 * 252, NaN scale 255 (a zero group, counted); row counts around the 4-row SIMD block;
 * one token (the fused kernel) and several (decode, then the widened-x dot: 2 one token at
 * a time, 4 and 9 in register blocks of 4 and 9's last token on its own). */
static void check_mxfp4(void) {
    static const int ROWS[] = {1, 3, 4, 5, 9, 13};
    static const int COLS[] = {32, 64, 96, 3584};
    static const int NTOK[] = {1, 2, 4, 9};
    for (int ci = 0; ci < 4; ci++)
        for (int ri = 0; ri < 6; ri++)
            for (int ti = 0; ti < 4; ti++) {
                int rows = ROWS[ri], cols = COLS[ci], ntok = NTOK[ti], groups = cols / 32;
                uint8_t *p = xmalloc((size_t)rows * cols / 2), *s = xmalloc((size_t)rows * groups);
                float *x = xmalloc(sizeof(float) * (size_t)ntok * cols);
                float *y0 = xmalloc(sizeof(float) * (size_t)ntok * rows), *y1 = xmalloc(sizeof(float) * (size_t)ntok * rows);
                for (size_t i = 0; i < (size_t)rows * cols / 2; i++) p[i] = (uint8_t)rnd();
                for (size_t i = 0; i < (size_t)rows * groups; i++) s[i] = (uint8_t)(100 + rnd() % 40);
                p[0] = 0x88;                           /* -0 in both nibbles */
                s[0] = 0;                              /* subnormal scales, never flushed */
                s[(size_t)(rows - 1) * groups + groups - 1] = 1;
                if (rows > 2) s[(size_t)2 * groups] = 252;
                if (rows > 3) s[(size_t)3 * groups + (groups > 1)] = 255;
                fill(x, (size_t)ntok * cols);
                for (int th = 1; th <= 2; th++) {
                    uint64_t n0 = 0, n1 = 0;
                    kk_ctx c0 = {1, 0}, c1 = {th, 1};
                    kk_mxfp4_matmul(&c0, p, s, rows, cols, x, cols, ntok, y0, rows, &n0);
                    kk_mxfp4_matmul(&c1, p, s, rows, cols, x, cols, ntok, y1, rows, &n1);
                    char what[96];
                    snprintf(what, sizeof what, "kk_mxfp4_matmul rows=%d cols=%d ntok=%d threads=%d", rows, cols, ntok, th);
                    check(what, y0, y1, sizeof(float) * (size_t)ntok * rows);
                    snprintf(what, sizeof what, "kk_mxfp4_matmul nan groups rows=%d cols=%d ntok=%d", rows, cols, ntok);
                    check(what, &n0, &n1, sizeof n0);
                }
                free(p), free(s), free(x), free(y0), free(y1);
            }
}

/* ---------------- forward ---------------- */

static int unhex(const char *hex, void *out, size_t n) {
    if (strlen(hex) != 2 * n) return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return -1;
        ((uint8_t *)out)[i] = (uint8_t)v;
    }
    return 0;
}

#define MAX_OPTS 8
typedef struct {
    k3_config cfg;
    char labels[MAX_OPTS][32];
    k3_open_opts opts[MAX_OPTS];
    int nopts;
    char **shards;
    int nshards;
    k3_tensor_desc *t;
    int nt;
    int32_t *ids;
    int nids;
} spec;

static void spec_fail(const char *why, int line) {
    fprintf(stderr, "bits: spec line %d: %s\n", line, why);
    exit(2);
}

static void read_spec(const char *path, spec *sp) {
    FILE *f = fopen(path, "r");
    if (!f) {
        perror(path);
        exit(2);
    }
    memset(sp, 0, sizeof *sp);
    size_t cap = 1 << 16;
    char *line = xmalloc(cap), word[32];
    int ln = 0, have_cfg = 0;
    sp->shards = xmalloc(sizeof(char *) * 1024);
    sp->t = xmalloc(sizeof(k3_tensor_desc) * 65536);
    sp->ids = xmalloc(sizeof(int32_t) * 65536);
    while (fgets(line, (int)cap, f)) {
        ln++;
        line[strcspn(line, "\n")] = 0;
        if (sscanf(line, "%31s", word) != 1) continue;
        char *rest = line + strlen(word) + 1;
        if (!strcmp(word, "config")) {
            if (unhex(rest, &sp->cfg, sizeof sp->cfg)) spec_fail("config bytes do not match sizeof(k3_config)", ln);
            have_cfg = 1;
        } else if (!strcmp(word, "opts")) {
            char hex[4096];
            if (sp->nopts == MAX_OPTS || sscanf(rest, "%31s %4095s", sp->labels[sp->nopts], hex) != 2 ||
                unhex(hex, &sp->opts[sp->nopts], sizeof(k3_open_opts)))
                spec_fail("opts bytes do not match sizeof(k3_open_opts)", ln);
            sp->nopts++;
        } else if (!strcmp(word, "shard")) {
            if (sp->nshards == 1024) spec_fail("too many shards", ln);
            sp->shards[sp->nshards++] = strdup(rest);
        } else if (!strcmp(word, "tensor")) {
            k3_tensor_desc *d = &sp->t[sp->nt];
            char name[512];
            long long sh[4];
            unsigned long long off, nb;
            if (sp->nt == 65536 || sscanf(rest, "%511s %d %d %d %lld %lld %lld %lld %llu %llu", name, &d->shard, &d->dtype,
                                          &d->ndim, &sh[0], &sh[1], &sh[2], &sh[3], &off, &nb) != 10)
                spec_fail("bad tensor line", ln);
            d->name = strdup(name);
            for (int i = 0; i < 4; i++) d->shape[i] = sh[i];
            d->offset = off, d->nbytes = nb;
            sp->nt++;
        } else if (!strcmp(word, "ids")) {
            char *p = rest, *end;
            for (long v = strtol(p, &end, 10); end != p && sp->nids < 65536; v = strtol(p, &end, 10)) {
                sp->ids[sp->nids++] = (int32_t)v;
                p = end;
            }
        } else {
            spec_fail("unknown line", ln);
        }
    }
    fclose(f);
    free(line);
    if (!have_cfg || !sp->nopts || !sp->nshards || !sp->nt || !sp->nids) spec_fail("incomplete spec", ln);
}

static int check_forward(const char *path, const char *expect) {
    spec sp;
    read_spec(path, &sp);
    size_t n = (size_t)sp.nids * (size_t)sp.cfg.vocab;
    float *ref = xmalloc(sizeof(float) * n), *got = xmalloc(sizeof(float) * n);
    int have_ref = 0;
    for (int o = 0; o < sp.nopts; o++) {
        k3_model *m = NULL;
        char err[K3_ERRLEN];
        int rc = k3_model_open(&sp.cfg, (const char *const *)sp.shards, sp.nshards, sp.t, sp.nt, &sp.opts[o], &m, err,
                               sizeof err);
        if (rc != K3_OK) {
            fprintf(stderr, "bits: open (%s) failed: %s\n", sp.labels[o], err);
            return 1;
        }
        for (int th = 1; th <= 2; th++)
            for (int scalar = 1; scalar >= 0; scalar--) {
                char what[96];
                k3_model_set_threads(m, th);
                k3_model_set_scalar(m, scalar);
                if (!scalar && expect && !k3_model_simd_active(m)) {
                    fprintf(stderr, "bits: SIMD (%s) is not active in the model\n", expect);
                    return 1;
                }
                if (k3_model_forward(m, sp.ids, sp.nids, have_ref ? got : ref, 0) != K3_OK) {
                    fprintf(stderr, "bits: forward (%s) failed: %s\n", sp.labels[o], k3_model_error(m));
                    return 1;
                }
                snprintf(what, sizeof what, "forward %s threads=%d %s", sp.labels[o], th, scalar ? "scalar" : "simd");
                if (!have_ref) {
                    have_ref = 1;
                    emit(ref, sizeof(float) * n); /* the first run is the reference written out */
                    continue;
                }
                g_checks++;
                if (memcmp(ref, got, sizeof(float) * n) != 0) {
                    g_failures++;
                    fprintf(stderr, "MISMATCH %s\n", what);
                }
            }
        k3_stats st;
        k3_model_stats(m, &st);
        printf("forward %s: direct_io %llu refused %llu, expert bytes read %llu, trunk bytes read %llu\n",
               sp.labels[o], (unsigned long long)st.direct_io, (unsigned long long)st.direct_io_refused,
               (unsigned long long)st.expert_bytes_read, (unsigned long long)st.trunk_bytes_read);
        k3_model_close(m);
    }
    free(ref), free(got);
    return 0;
}

int main(int argc, char **argv) {
    const char *expect = NULL;
    if (argc >= 2 && !strcmp(argv[argc - 2], "--expect-simd")) {
        expect = argv[argc - 1];
        argc -= 2;
    }
    int forward = argc == 4 && !strcmp(argv[1], "forward");
    if (!(argc == 3 && !strcmp(argv[1], "kernels")) && !forward) {
        fprintf(stderr, "usage: bits kernels OUT | bits forward SPEC OUT  [--expect-simd avx2|neon]\n");
        return 2;
    }
    const char *kind = k3_simd_kind();
    if (expect && strcmp(kind, expect) != 0) {
        fprintf(stderr, "bits: expected %s kernels, this build and CPU have %s\n", expect, kind);
        return 1;
    }
    g_out = fopen(argv[argc - 1], "wb");
    if (!g_out) {
        perror(argv[argc - 1]);
        return 2;
    }
    if (forward) {
        if (check_forward(argv[2], expect)) return 1;
    } else {
        check_dots();
        check_matmuls();
        check_mxfp4();
    }
    if (fclose(g_out) != 0) {
        perror(argv[argc - 1]);
        return 1;
    }
    printf("%s: simd %s, %d comparisons of SIMD with scalar bits, %d mismatches\n", forward ? "forward" : "kernels", kind,
           g_checks, g_failures);
    return g_failures ? 1 : 0;
}
