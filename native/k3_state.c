/* k3_state.c: per-sequence state, its byte layout, sessions and snapshots.
 *
 * Exported layout (little-endian host order, version 1):
 *   u32 magic "K3S1", u32 version, i32 len, i32 n_kda, i32 n_mla, i32 H_k, i32 D, i32 P,
 *   i32 K, i32 W (MLA row width kv_lora + rope), i32 ids[len],
 *   per KDA layer: f32 S[H_k*D*D] (row i = key channel), f32 conv[3][P][K-1] (q, k, v),
 *   per MLA layer: f32 rows[len][W].
 */
#include <stdlib.h>
#include <string.h>

#include "k3_internal.h"

#define KS_MAGIC 0x3153334Bu /* "K3S1" */
#define KS_VERSION 1u
#define KS_HDR_WORDS 10

static size_t ks_s_floats(const k3_config *c) {
    return (size_t)c->kda_heads * c->kda_head_dim * c->kda_head_dim;
}
static size_t ks_conv_floats(const k3_config *c) {
    return (size_t)3 * c->kda_heads * c->kda_head_dim * (c->conv_kernel - 1);
}
static size_t ks_row_floats(const k3_config *c) { return (size_t)c->kv_lora_rank + c->qk_rope_dim; }

int ks_alloc(const k3_model *m, ks_state *st, int32_t cap, int shared_slot) {
    const k3_config *c = &m->cfg;
    memset(st, 0, sizeof *st);
    st->cap = cap;
    st->shared_slot = shared_slot;
    int nk = shared_slot ? (m->n_kda > 0) : m->n_kda;
    st->n_kda_slots = nk;
    st->n_mla_slots = m->n_mla;
    st->ids = (int32_t *)calloc((size_t)cap + 1, sizeof(int32_t));
    st->kda_s = (float **)calloc((size_t)nk + 1, sizeof(float *));
    st->kda_conv = (float **)calloc((size_t)nk + 1, sizeof(float *));
    st->mla_rows = (float **)calloc((size_t)m->n_mla + 1, sizeof(float *));
    if (!st->ids || !st->kda_s || !st->kda_conv || !st->mla_rows) return K3_ERR_NOMEM;
    for (int i = 0; i < nk; i++) {
        st->kda_s[i] = (float *)calloc(ks_s_floats(c), sizeof(float));
        st->kda_conv[i] = (float *)calloc(ks_conv_floats(c) + 1, sizeof(float));
        if (!st->kda_s[i] || !st->kda_conv[i]) return K3_ERR_NOMEM;
    }
    for (int i = 0; i < m->n_mla; i++) {
        st->mla_rows[i] = (float *)calloc((size_t)cap * ks_row_floats(c) + 1, sizeof(float));
        if (!st->mla_rows[i]) return K3_ERR_NOMEM;
    }
    return K3_OK;
}

void ks_free(ks_state *st) {
    int nk = st->n_kda_slots;
    for (int i = 0; st->kda_s && i < nk; i++) free(st->kda_s[i]);
    for (int i = 0; st->kda_conv && i < nk; i++) free(st->kda_conv[i]);
    for (int i = 0; st->mla_rows && i < st->n_mla_slots; i++) free(st->mla_rows[i]);
    free(st->kda_s);
    free(st->kda_conv);
    free(st->mla_rows);
    free(st->ids);
    memset(st, 0, sizeof *st);
}

void ks_zero(const k3_model *m, ks_state *st) {
    const k3_config *c = &m->cfg;
    int nk = st->shared_slot ? (m->n_kda > 0) : m->n_kda;
    for (int i = 0; i < nk; i++) {
        memset(st->kda_s[i], 0, sizeof(float) * ks_s_floats(c));
        memset(st->kda_conv[i], 0, sizeof(float) * ks_conv_floats(c));
    }
    /* rows at or past len are never read nor exported: clear only the used ones */
    for (int i = 0; i < m->n_mla; i++) memset(st->mla_rows[i], 0, sizeof(float) * (size_t)st->len * ks_row_floats(c));
    st->len = 0;
}

uint64_t ks_export_size(const k3_model *m, const ks_state *st) {
    const k3_config *c = &m->cfg;
    return 4ull * KS_HDR_WORDS + 4ull * st->len +
           4ull * m->n_kda * (ks_s_floats(c) + ks_conv_floats(c)) +
           4ull * m->n_mla * (uint64_t)st->len * ks_row_floats(c);
}

static void ks_header(const k3_model *m, int32_t len, uint32_t *h) {
    const k3_config *c = &m->cfg;
    h[0] = KS_MAGIC;
    h[1] = KS_VERSION;
    h[2] = (uint32_t)len;
    h[3] = (uint32_t)m->n_kda;
    h[4] = (uint32_t)m->n_mla;
    h[5] = (uint32_t)c->kda_heads;
    h[6] = (uint32_t)c->kda_head_dim;
    h[7] = (uint32_t)(c->kda_heads * c->kda_head_dim);
    h[8] = (uint32_t)c->conv_kernel;
    h[9] = (uint32_t)ks_row_floats(c);
}

void ks_export(const k3_model *m, const ks_state *st, void *buf) {
    const k3_config *c = &m->cfg;
    uint8_t *p = (uint8_t *)buf;
    uint32_t h[KS_HDR_WORDS];
    ks_header(m, st->len, h);
    memcpy(p, h, sizeof h);
    p += sizeof h;
    memcpy(p, st->ids, 4ull * st->len);
    p += 4ull * st->len;
    for (int i = 0; i < m->n_kda; i++) {
        memcpy(p, st->kda_s[i], 4 * ks_s_floats(c));
        p += 4 * ks_s_floats(c);
        memcpy(p, st->kda_conv[i], 4 * ks_conv_floats(c));
        p += 4 * ks_conv_floats(c);
    }
    for (int i = 0; i < m->n_mla; i++) {
        size_t n = 4ull * st->len * ks_row_floats(c);
        memcpy(p, st->mla_rows[i], n);
        p += n;
    }
}

int ks_import(const k3_model *m, ks_state *st, const void *buf, uint64_t size, char *err,
              size_t errlen) {
    const k3_config *c = &m->cfg;
    const uint8_t *p = (const uint8_t *)buf;
    if (st->shared_slot) {
        km_set_err(err, errlen, "cannot import into a shared-slot state");
        return K3_ERR_INVALID;
    }
    if (size < 4ull * KS_HDR_WORDS) {
        km_set_err(err, errlen, "state is %llu bytes, shorter than its header", (unsigned long long)size);
        return K3_ERR_INVALID;
    }
    uint32_t h[KS_HDR_WORDS], want[KS_HDR_WORDS];
    memcpy(h, p, sizeof h);
    if (h[0] != KS_MAGIC || h[1] != KS_VERSION) {
        km_set_err(err, errlen, "state has magic %08x version %u, expected %08x version %u", h[0], h[1],
                   KS_MAGIC, KS_VERSION);
        return K3_ERR_INVALID;
    }
    int32_t len = (int32_t)h[2];
    if (len < 0 || len > st->cap) {
        km_set_err(err, errlen, "state holds %d positions, the session capacity is %d", len, st->cap);
        return K3_ERR_INVALID;
    }
    ks_header(m, len, want);
    if (memcmp(h, want, sizeof h) != 0) {
        km_set_err(err, errlen, "state was made for a model with other dimensions");
        return K3_ERR_INVALID;
    }
    ks_state tmp = *st;
    tmp.len = len;
    if (size != ks_export_size(m, &tmp)) {
        km_set_err(err, errlen, "state is %llu bytes, expected %llu for %d positions",
                   (unsigned long long)size, (unsigned long long)ks_export_size(m, &tmp), len);
        return K3_ERR_INVALID;
    }
    const int32_t *ids = (const int32_t *)(const void *)(p + sizeof h);
    for (int32_t i = 0; i < len; i++) {
        int32_t id;
        memcpy(&id, ids + i, 4);
        if (id < 0 || id >= c->vocab) {
            km_set_err(err, errlen, "state holds token id %d outside the vocabulary", id);
            return K3_ERR_INVALID;
        }
    }
    ks_zero(m, st);
    p += sizeof h;
    memcpy(st->ids, p, 4ull * len);
    p += 4ull * len;
    for (int i = 0; i < m->n_kda; i++) {
        memcpy(st->kda_s[i], p, 4 * ks_s_floats(c));
        p += 4 * ks_s_floats(c);
        memcpy(st->kda_conv[i], p, 4 * ks_conv_floats(c));
        p += 4 * ks_conv_floats(c);
    }
    for (int i = 0; i < m->n_mla; i++) {
        size_t n = 4ull * len * ks_row_floats(c);
        memcpy(st->mla_rows[i], p, n);
        p += n;
    }
    st->len = len;
    return K3_OK;
}
