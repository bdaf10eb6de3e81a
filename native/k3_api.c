/* k3_api.c: the public handles: model settings, stateless forward, sessions, snapshots. */
#include <stdlib.h>
#include <string.h>

#include "k3_internal.h"

typedef struct {
    void *buf;
    uint64_t size;
    int used;
} k3_snap;

struct k3_session {
    k3_model *m;
    ks_state st;
    int tainted;
    k3_snap *snaps;
    int n_snaps;
    kd_draft draft; /* the pending verify feed, if any (speculative decoding) */
    char err[K3_ERRLEN];
};

const char *k3_model_error(const k3_model *m) { return m ? m->err : "no model"; }

int k3_model_set_threads(k3_model *m, int32_t n) {
    if (n < 1 || n > 64) {
        km_set_err(m->err, sizeof m->err, "threads must be 1..64, got %d", n);
        return K3_ERR_INVALID;
    }
    m->nthreads = n;
    return K3_OK;
}

int k3_model_set_scalar(k3_model *m, int32_t on) {
    m->force_scalar = on != 0;
    return K3_OK;
}

int32_t k3_model_simd_active(const k3_model *m) { return m->simd_available && !m->force_scalar; }

int k3_model_stats(const k3_model *m, k3_stats *out) {
    /* counters are bumped by reader threads: copy each with an atomic load */
    const uint64_t *src = (const uint64_t *)(const void *)&m->stats;
    uint64_t *dst = (uint64_t *)(void *)out;
    for (size_t i = 0; i < sizeof(k3_stats) / sizeof(uint64_t); i++) dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
    return K3_OK;
}

int k3_model_inject_fault(k3_model *m, int32_t layer, int32_t expert, int32_t kind) {
    __atomic_store_n(&m->fault_kind, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&m->fault_layer, layer, __ATOMIC_SEQ_CST);
    __atomic_store_n(&m->fault_expert, expert, __ATOMIC_SEQ_CST);
    __atomic_store_n(&m->fault_kind, kind, __ATOMIC_SEQ_CST);
    return K3_OK;
}

int k3_model_forward(k3_model *m, const int32_t *ids, int32_t n, float *logits_all,
                     int32_t shared_kda_slot) {
    ks_state st;
    if (n < 1) {
        km_set_err(m->err, sizeof m->err, "nothing to feed");
        return K3_ERR_INVALID;
    }
    if (km_check_owner(m, m->err, sizeof m->err) != K3_OK) return K3_ERR_RUNTIME;
    int rc = ks_alloc(m, &st, n, shared_kda_slot != 0);
    if (rc == K3_OK) rc = km_forward(m, &st, ids, n, NULL, logits_all, NULL, m->err, sizeof m->err);
    else km_set_err(m->err, sizeof m->err, "out of memory for the state of %d positions", n);
    ks_free(&st);
    return rc;
}

int k3_session_create(k3_model *m, int32_t max_positions, k3_session **out) {
    *out = NULL;
    if (max_positions < 1) {
        km_set_err(m->err, sizeof m->err, "session capacity must be >= 1, got %d", max_positions);
        return K3_ERR_INVALID;
    }
    k3_session *s = (k3_session *)calloc(1, sizeof *s);
    if (!s) return K3_ERR_NOMEM;
    s->m = m;
    if (ks_alloc(m, &s->st, max_positions, 0) != K3_OK) {
        ks_free(&s->st);
        free(s);
        km_set_err(m->err, sizeof m->err, "out of memory for a session of %d positions", max_positions);
        return K3_ERR_NOMEM;
    }
    *out = s;
    return K3_OK;
}

void k3_session_free(k3_session *s) {
    if (!s) return;
    for (int i = 0; i < s->n_snaps; i++) free(s->snaps[i].buf);
    free(s->snaps);
    kd_draft_free(&s->draft);
    ks_free(&s->st);
    free(s);
}

const char *k3_session_error(const k3_session *s) { return s ? s->err : "no session"; }

int k3_session_reset(k3_session *s) {
    s->draft.n = 0;
    ks_zero(s->m, &s->st);
    s->tainted = 0;
    return K3_OK;
}

int32_t k3_session_length(const k3_session *s) { return s->st.len; }
int32_t k3_session_capacity(const k3_session *s) { return s->st.cap; }
int32_t k3_session_tainted(const k3_session *s) { return s->tainted; }

int32_t k3_session_ids(const k3_session *s, int32_t *out, int32_t cap) {
    int32_t n = s->st.len < cap ? s->st.len : cap;
    if (n > 0) memcpy(out, s->st.ids, sizeof(int32_t) * (size_t)n);
    return n;
}

int k3_session_feed(k3_session *s, const int32_t *ids, int32_t n, float *logits_last,
                    float *logits_all, const volatile int32_t *cancel) {
    if (s->tainted) {
        km_set_err(s->err, sizeof s->err, "session state is unusable after a failed step; reset or restore a snapshot");
        return K3_ERR_RUNTIME;
    }
    /* refused before the state is touched: the session stays usable in its own process */
    if (km_check_owner(s->m, s->err, sizeof s->err) != K3_OK) return K3_ERR_RUNTIME;
    int32_t before = s->st.len;
    s->draft.n = 0; /* rows past the length are overwritten: nothing left to accept */
    int rc = km_forward(s->m, &s->st, ids, n, logits_last, logits_all, cancel, s->err, sizeof s->err);
    /* a failure after the state was touched leaves it unusable; argument errors don't */
    if (rc != K3_OK && rc != K3_ERR_INVALID) s->tainted = 1;
    if (rc == K3_ERR_INVALID && s->st.len != before) s->tainted = 1;
    return rc;
}

int k3_session_verify(k3_session *s, const int32_t *ids, int32_t n, float *logits_all,
                      const volatile int32_t *cancel) {
    s->draft.n = 0;
    if (s->tainted) {
        km_set_err(s->err, sizeof s->err, "session state is unusable after a failed step; reset or restore a snapshot");
        return K3_ERR_RUNTIME;
    }
    if (km_check_owner(s->m, s->err, sizeof s->err) != K3_OK) return K3_ERR_RUNTIME;
    if (n < 1 || !logits_all) {
        km_set_err(s->err, sizeof s->err, "a verify feed needs at least one id and a buffer for every position's logits");
        return K3_ERR_INVALID;
    }
    if (kd_draft_reserve(s->m, &s->draft, n) != K3_OK) {
        km_set_err(s->err, sizeof s->err, "out of memory for the verify record of %d positions", n);
        return K3_ERR_NOMEM;
    }
    /* the session's own state is not written: a failure or a cancel leaves it usable */
    return km_verify(s->m, &s->st, &s->draft, ids, n, logits_all, cancel, s->err, sizeof s->err);
}

int k3_session_accept(k3_session *s, int32_t keep) {
    int32_t n = s->draft.n;
    if (n == 0) {
        km_set_err(s->err, sizeof s->err, "no verify feed to accept positions from");
        return K3_ERR_INVALID;
    }
    if (keep < 0 || keep > n) {
        km_set_err(s->err, sizeof s->err, "can accept 0..%d verified positions, got %d", n, keep);
        return K3_ERR_INVALID;
    }
    kda_accept(s->m, &s->st, &s->draft, keep);
    memcpy(s->st.ids + s->st.len, s->draft.ids, sizeof(int32_t) * (size_t)keep);
    s->st.len += keep; /* MLA rows of the kept positions were written by the verify feed */
    __atomic_add_fetch(&s->m->stats.tokens_fed, (uint64_t)keep, __ATOMIC_RELAXED);
    s->draft.n = 0;
    return K3_OK;
}

uint64_t k3_verify_bytes(const k3_model *m, int32_t n) {
    return n < 1 ? 0 : 4ull * kd_draft_floats(m, n) + 4ull * (uint64_t)n;
}

int k3_session_state_size(const k3_session *s, uint64_t *size) {
    *size = ks_export_size(s->m, &s->st);
    return K3_OK;
}

int k3_session_export(const k3_session *s, void *buf, uint64_t size) {
    if (s->tainted || size != ks_export_size(s->m, &s->st)) {
        km_set_err(((k3_session *)s)->err, sizeof s->err,
                   s->tainted ? "session state is unusable; nothing to export" : "export buffer has the wrong size");
        return s->tainted ? K3_ERR_RUNTIME : K3_ERR_INVALID;
    }
    ks_export(s->m, &s->st, buf);
    return K3_OK;
}

int k3_session_import(k3_session *s, const void *buf, uint64_t size) {
    s->draft.n = 0;
    int rc = ks_import(s->m, &s->st, buf, size, s->err, sizeof s->err);
    if (rc == K3_OK) s->tainted = 0;
    return rc;
}

int k3_session_snapshot(k3_session *s, int32_t *snap_id) {
    if (s->tainted) {
        km_set_err(s->err, sizeof s->err, "session state is unusable; cannot snapshot it");
        return K3_ERR_RUNTIME;
    }
    int id = -1;
    for (int i = 0; i < s->n_snaps; i++)
        if (!s->snaps[i].used) id = i;
    if (id < 0) {
        k3_snap *ns = (k3_snap *)realloc(s->snaps, sizeof(k3_snap) * (size_t)(s->n_snaps + 1));
        if (!ns) return K3_ERR_NOMEM;
        s->snaps = ns;
        id = s->n_snaps++;
        s->snaps[id].buf = NULL;
    }
    uint64_t size = ks_export_size(s->m, &s->st);
    void *buf = malloc(size);
    if (!buf) {
        km_set_err(s->err, sizeof s->err, "out of memory for a %llu-byte snapshot", (unsigned long long)size);
        return K3_ERR_NOMEM;
    }
    ks_export(s->m, &s->st, buf);
    free(s->snaps[id].buf);
    s->snaps[id].buf = buf;
    s->snaps[id].size = size;
    s->snaps[id].used = 1;
    *snap_id = id;
    return K3_OK;
}

int k3_session_restore(k3_session *s, int32_t snap_id) {
    if (snap_id < 0 || snap_id >= s->n_snaps || !s->snaps[snap_id].used) {
        km_set_err(s->err, sizeof s->err, "no snapshot %d", snap_id);
        return K3_ERR_INVALID;
    }
    return k3_session_import(s, s->snaps[snap_id].buf, s->snaps[snap_id].size);
}

int k3_session_snapshot_drop(k3_session *s, int32_t snap_id) {
    if (snap_id < 0 || snap_id >= s->n_snaps || !s->snaps[snap_id].used) {
        km_set_err(s->err, sizeof s->err, "no snapshot %d", snap_id);
        return K3_ERR_INVALID;
    }
    free(s->snaps[snap_id].buf);
    s->snaps[snap_id].buf = NULL;
    s->snaps[snap_id].used = 0;
    return K3_OK;
}

int64_t k3_kernel_mxfp4_path(const uint8_t *packed, const uint8_t *scales, int32_t rows, int32_t cols,
                             const float *x, int32_t ntok, float *y, int32_t simd, int32_t threads,
                             int32_t blocked) {
    if (rows < 1 || cols < 32 || cols % 32 || ntok < 1) return -1;
    kk_ctx c = {threads < 1 ? 1 : threads, simd && kk_cpu_has_simd(), !blocked, NULL};
    uint64_t nan = 0;
    kk_mxfp4_matmul(&c, packed, scales, rows, cols, x, cols, ntok, y, rows, &nan);
    return (int64_t)nan;
}

int64_t k3_kernel_mxfp4(const uint8_t *packed, const uint8_t *scales, int32_t rows, int32_t cols,
                        const float *x, int32_t ntok, float *y, int32_t simd, int32_t threads) {
    return k3_kernel_mxfp4_path(packed, scales, rows, cols, x, ntok, y, simd, threads, 1);
}

int k3_kernel_bf16_path(const uint16_t *w, int32_t rows, int32_t cols, const float *x, int32_t ntok,
                        float *y, int32_t simd, int32_t threads, int32_t blocked) {
    if (rows < 1 || cols < 1 || ntok < 1) return K3_ERR_INVALID;
    kk_ctx c = {threads < 1 ? 1 : threads, simd && kk_cpu_has_simd(), !blocked, NULL};
    kk_mat m = {w, K3_DT_BF16, rows, cols};
    kk_matmul(&c, &m, x, cols, ntok, y, rows);
    return K3_OK;
}

int k3_kernel_bf16(const uint16_t *w, int32_t rows, int32_t cols, const float *x, int32_t ntok,
                   float *y, int32_t simd, int32_t threads) {
    return k3_kernel_bf16_path(w, rows, cols, x, ntok, y, simd, threads, 1);
}

int32_t k3_cpu_has_avx2(void) { return kk_cpu_has_avx2(); }

int64_t k3_kernel_mxfp4_decode(const uint8_t *packed, const uint8_t *scales, int32_t rows,
                               int32_t cols, float *out) {
    if (rows < 1 || cols < 32 || cols % 32) return -1;
    uint64_t nan = 0;
    for (int32_t r = 0; r < rows; r++)
        kk_mxfp4_decode_row(packed + (size_t)r * (cols / 2), scales + (size_t)r * (cols / 32), cols,
                            out + (size_t)r * cols, &nan);
    return (int64_t)nan;
}
