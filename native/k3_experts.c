/* k3_experts.c: the resident expert source.
 *
 * Every routed expert is read at open into one buffer laid out as
 * w1p w1s w2p w2s w3p w3s.  An expert whose six tensors tile one range is read with
 * one request; otherwise tensor by tensor (counted).  The forward pass only sees the
 * kx_source interface, so a streaming store plugs in without touching the math.
 */
#include <stdlib.h>
#include <string.h>

#include "k3_internal.h"

typedef struct {
    k3_model *m;
    uint8_t **buf; /* [n_layers * n_experts], NULL for non-MoE layers */
    uint64_t expert_bytes;
} kx_resident;

static int kx_res_acquire(void *ctx, int layer, int expert, kx_view *out, char *err,
                          size_t errlen) {
    kx_resident *r = (kx_resident *)ctx;
    const k3_config *c = &r->m->cfg;
    if (layer < 0 || layer >= c->n_layers || expert < 0 || expert >= c->n_experts) {
        km_set_err(err, errlen, "expert %d of layer %d does not exist", expert, layer);
        return K3_ERR_EXPERT_IO;
    }
    uint8_t *b = r->buf[(size_t)layer * c->n_experts + expert];
    if (!b) {
        km_set_err(err, errlen, "layer %d has no routed experts", layer);
        return K3_ERR_EXPERT_IO;
    }
    const kx_expert_loc *loc = &r->m->layers[layer].experts[expert];
    const uint8_t *p[6];
    uint64_t off = 0;
    for (int i = 0; i < 6; i++) {
        p[i] = b + off;
        off += loc->nbytes[i];
    }
    out->w1p = p[0];
    out->w1s = p[1];
    out->w2p = p[2];
    out->w2s = p[3];
    out->w3p = p[4];
    out->w3s = p[5];
    return K3_OK;
}

static void kx_res_release(void *ctx, int layer, int expert) {
    (void)ctx;
    (void)layer;
    (void)expert;
}

static void kx_res_destroy(void *ctx) {
    kx_resident *r = (kx_resident *)ctx;
    size_t n = (size_t)r->m->cfg.n_layers * r->m->cfg.n_experts;
    for (size_t i = 0; i < n; i++) free(r->buf[i]);
    free(r->buf);
    free(r);
}

static int kx_read_expert(k3_model *m, int L, int e, uint8_t *dst, char *err, size_t errlen) {
    const kx_expert_loc *loc = &m->layers[L].experts[e];
    uint64_t total = 0;
    for (int i = 0; i < 6; i++) total += loc->nbytes[i];
    if (loc->run) {
        int rc = kt_pread_full(m->shards[loc->shard[0]].fd, dst, total, loc->offset[0]);
        if (rc != 0) {
            km_set_err(err, errlen, "read of layer %d expert %d failed: shard %s offset %llu length %llu: %s",
                       L, e, m->shards[loc->shard[0]].path, (unsigned long long)loc->offset[0],
                       (unsigned long long)total, strerror(-rc));
            return K3_ERR_EXPERT_IO;
        }
        m->stats.expert_run_reads++;
    } else {
        uint64_t off = 0;
        for (int i = 0; i < 6; i++) {
            int rc = kt_pread_full(m->shards[loc->shard[i]].fd, dst + off, loc->nbytes[i], loc->offset[i]);
            if (rc != 0) {
                km_set_err(err, errlen, "read of layer %d expert %d tensor %d failed: shard %s offset %llu length %llu: %s",
                           L, e, i, m->shards[loc->shard[i]].path, (unsigned long long)loc->offset[i],
                           (unsigned long long)loc->nbytes[i], strerror(-rc));
                return K3_ERR_EXPERT_IO;
            }
            off += loc->nbytes[i];
        }
        m->stats.expert_fallback_reads++;
    }
    m->stats.expert_bytes_read += total;
    return K3_OK;
}

int kx_resident_create(k3_model *m, kx_source *out, char *err, size_t errlen) {
    const k3_config *c = &m->cfg;
    kx_resident *r = (kx_resident *)calloc(1, sizeof(kx_resident));
    if (!r) return K3_ERR_NOMEM;
    r->m = m;
    r->buf = (uint8_t **)calloc((size_t)c->n_layers * c->n_experts, sizeof(uint8_t *));
    if (!r->buf) {
        free(r);
        return K3_ERR_NOMEM;
    }
    out->ctx = r;
    out->acquire = kx_res_acquire;
    out->release = kx_res_release;
    out->destroy = kx_res_destroy;
    for (int L = 0; L < c->n_layers; L++) {
        if (!m->layers[L].is_moe) continue;
        for (int e = 0; e < c->n_experts; e++) {
            const kx_expert_loc *loc = &m->layers[L].experts[e];
            uint64_t total = 0;
            for (int i = 0; i < 6; i++) total += loc->nbytes[i];
            uint8_t *b = (uint8_t *)malloc(total);
            if (!b) {
                km_set_err(err, errlen, "out of memory holding every routed expert resident");
                return K3_ERR_NOMEM; /* caller destroys the source */
            }
            r->buf[(size_t)L * c->n_experts + e] = b;
            int rc = kx_read_expert(m, L, e, b, err, errlen);
            if (rc != K3_OK) return rc;
        }
    }
    return K3_OK;
}
