/* k3_ring.c: trunk streaming for budgets below the trunk size.
 *
 * The matrices of layers that are not pinned cycle through a ring of at least two slots,
 * in units: a layer's attention matrices, then its FFN matrices (so a slot is sized for
 * the largest unit, not the largest layer); with ffn_split a dense layer's FFN is three
 * units, gate, up, down, so its slot need is one matrix.  A reader thread walks the units in forward
 * order, cyclically, and fills slot (load mod slots) as soon as compute has released it,
 * so it runs up to slots-1 units ahead.  Compute takes loads in the same order; if a pass
 * ended early (an error or a cancel), the ring is reset to the wanted unit: a generation
 * counter makes the reader drop whatever it was reading for the old order.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_internal.h"
#include "k3_platform.h"

typedef struct {
    uint8_t *buf;
    uint64_t load;  /* which load (sequence number) the slot holds */
    int state;      /* 0 empty, 1 ready, 2 failed */
    char err[320];
} kr_slot;

struct kr_ring {
    k3_model *m;
    kr_slot *slots;
    int nslots;
    int *seq;       /* streamed units in forward order: L * KR_UNITS + unit */
    int nseq;
    uint64_t produced, consumed;
    uint64_t gen;   /* bumped by a reset; a read begun under an older one is dropped */
    int *pos_of;    /* unit (L * KR_UNITS + u) -> its position in seq, or -1 */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t reader;
    int started, stop;
};

static int kr_cmp_entry(const void *a, const void *b) {
    const kr_entry *x = (const kr_entry *)a, *y = (const kr_entry *)b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    return x->off < y->off ? -1 : x->off > y->off;
}

int kr_unit_layout(kr_unit *u) {
    if (u->n == 0) return 0;
    qsort(u->e, (size_t)u->n, sizeof(kr_entry), kr_cmp_entry);
    u->reads = (kr_read *)calloc((size_t)u->n, sizeof(kr_read));
    if (!u->reads) return -1;
    uint64_t pos = 0;
    for (int i = 0; i < u->n; i++) {
        kr_entry *e = &u->e[i];
        kr_read *last = u->nreads ? &u->reads[u->nreads - 1] : NULL;
        size_t el = e->dst->dtype == K3_DT_F32 ? 4 : 2;
        /* extend the previous read when the tensor follows it in the file and keeps its
         * element alignment inside the slot; else start a new 64-byte aligned read */
        if (last && last->shard == e->shard && last->off + last->len == e->off &&
            (last->slot_off + last->len) % el == 0) {
            e->slot_off = last->slot_off + last->len;
            last->len += e->nbytes;
        } else {
            kr_read *r = &u->reads[u->nreads++];
            pos = (pos + 63) & ~(uint64_t)63;
            r->shard = e->shard;
            r->off = e->off;
            r->len = e->nbytes;
            r->slot_off = pos;
            e->slot_off = pos;
        }
        pos = u->reads[u->nreads - 1].slot_off + u->reads[u->nreads - 1].len;
    }
    u->bytes = pos;
    return 0;
}

static const char *kr_unit_name(const km_layer *ly, int unit) {
    if (unit == KR_ATTN) return "attention";
    if (!ly->ffn_split) return "FFN";
    return unit == KR_FFN ? "FFN gate" : unit == KR_FFN_UP ? "FFN up" : "FFN down";
}

/* Units a streamed layer goes through, in order: attention and FFN, or with a split FFN
 * attention, gate, up, down. */
static int kr_layer_units(const km_layer *ly) { return ly->ffn_split ? KR_UNITS : 2; }

static int kr_fill(kr_ring *r, int L, int unit, uint8_t *buf, char *err, size_t errlen) {
    k3_model *m = r->m;
    const kr_unit *u = &m->layers[L].su[unit];
    int fault = 0;
    pthread_mutex_lock(&r->mu);
    if (m->fault_kind && m->fault_layer == L &&
        (m->fault_expert == -1 || (m->fault_expert == -4 && unit == KR_FFN_DOWN))) {
        fault = 1;
        m->fault_kind = 0;
    }
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < u->nreads; i++) {
        const kr_read *rd = &u->reads[i];
        int rc = fault ? -EIO : kt_pread_full(m->shards[rd->shard].fd, buf + rd->slot_off, rd->len, rd->off);
        if (rc != 0) {
            km_set_err(err, errlen, "read of layer %d trunk (%s matrices) failed: shard %s offset %llu length %llu: %s",
                       L, kr_unit_name(&m->layers[L], unit), m->shards[rd->shard].path,
                       (unsigned long long)rd->off, (unsigned long long)rd->len, strerror(-rc));
            return K3_ERR_IO;
        }
        __atomic_add_fetch(&m->stats.trunk_bytes_read, rd->len, __ATOMIC_RELAXED);
        /* streamed bytes are read again next pass from disk, not held twice in RAM */
        if (m->opts.direct_io) kos_drop_cached(m->shards[rd->shard].fd, rd->off, rd->len);
    }
    __atomic_add_fetch(&m->stats.trunk_stream_reads, 1, __ATOMIC_RELAXED);
    return K3_OK;
}

static void *kr_reader(void *arg) {
    kr_ring *r = (kr_ring *)arg;
    char err[320];
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && r->produced - r->consumed >= (uint64_t)r->nslots) pthread_cond_wait(&r->cv, &r->mu);
        if (r->stop) break;
        uint64_t p = r->produced, gen = r->gen;
        kr_slot *s = &r->slots[p % (uint64_t)r->nslots];
        int unit = r->seq[p % (uint64_t)r->nseq];
        pthread_mutex_unlock(&r->mu);
        err[0] = 0;
        int rc = kr_fill(r, unit / KR_UNITS, unit % KR_UNITS, s->buf, err, sizeof err);
        pthread_mutex_lock(&r->mu);
        if (gen != r->gen) continue; /* reset while reading: this load is for the old order */
        s->load = p;
        s->state = rc == K3_OK ? 1 : 2;
        if (rc != K3_OK) snprintf(s->err, sizeof s->err, "%s", err);
        r->produced = p + 1;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

int kr_acquire(kr_ring *r, int L, int unit, char *err, size_t errlen) {
    uint64_t t0 = km_now_ns();
    pthread_mutex_lock(&r->mu);
    for (;;) {
        uint64_t c = r->consumed;
        if (r->seq[c % (uint64_t)r->nseq] != L * KR_UNITS + unit) {
            /* a pass ended early: restart the cycle at the wanted unit without reading
             * the units that pass skipped */
            uint64_t pos = (uint64_t)r->pos_of[L * KR_UNITS + unit], n = (uint64_t)r->nseq;
            uint64_t next = c + (pos + n - c % n) % n;
            r->gen++;
            r->consumed = r->produced = next;
            for (int i = 0; i < r->nslots; i++) r->slots[i].state = 0;
            pthread_cond_broadcast(&r->cv);
            continue;
        }
        while (r->produced <= c) pthread_cond_wait(&r->cv, &r->mu);
        if (r->consumed != c) continue; /* reset meanwhile */
        kr_slot *s = &r->slots[c % (uint64_t)r->nslots];
        if (s->state == 2) {
            km_set_err(err, errlen, "%s", s->err);
            s->state = 0;
            r->consumed = c + 1; /* the reader will load this unit again next cycle */
            pthread_cond_broadcast(&r->cv);
            pthread_mutex_unlock(&r->mu);
            __atomic_add_fetch(&r->m->stats.io_wait_ns, km_now_ns() - t0, __ATOMIC_RELAXED);
            return K3_ERR_IO;
        }
        const kr_unit *u = &r->m->layers[L].su[unit];
        for (int i = 0; i < u->n; i++) u->e[i].dst->data = s->buf + u->e[i].slot_off;
        pthread_mutex_unlock(&r->mu);
        __atomic_add_fetch(&r->m->stats.io_wait_ns, km_now_ns() - t0, __ATOMIC_RELAXED);
        return K3_OK;
    }
}

void kr_release(kr_ring *r, int L, int unit) {
    const kr_unit *u = &r->m->layers[L].su[unit];
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < u->n; i++) u->e[i].dst->data = NULL; /* a stale pointer must never be used */
    r->slots[r->consumed % (uint64_t)r->nslots].state = 0;
    r->consumed++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

void kr_ring_destroy(kr_ring *r) {
    if (!r) return;
    if (r->started) {
        pthread_mutex_lock(&r->mu);
        r->stop = 1;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        pthread_join(r->reader, NULL);
    }
    for (int i = 0; i < r->nslots; i++) free(r->slots[i].buf);
    free(r->slots);
    free(r->seq);
    free(r->pos_of);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

int kr_ring_create(k3_model *m, char *err, size_t errlen) {
    const k3_config *c = &m->cfg;
    int n = 0;
    uint64_t biggest = 0;
    for (int L = 0; L < c->n_layers; L++)
        if (m->layers[L].streamed)
            for (int u = 0; u < kr_layer_units(&m->layers[L]); u++) {
                n++;
                if (m->layers[L].su[u].bytes > biggest) biggest = m->layers[L].su[u].bytes;
            }
    if (n == 0) return K3_OK; /* everything pinned */
    int nslots = m->opts.ring_slots;
    if (nslots < 2) {
        km_set_err(err, errlen, "trunk streaming needs a ring of at least 2 slots, got %d", nslots);
        return K3_ERR_INVALID;
    }
    kr_ring *r = (kr_ring *)calloc(1, sizeof *r);
    if (!r) return K3_ERR_NOMEM;
    r->m = m;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->nslots = nslots;
    r->nseq = n;
    r->slots = (kr_slot *)calloc((size_t)nslots, sizeof(kr_slot));
    r->seq = (int *)malloc(sizeof(int) * (size_t)n);
    r->pos_of = (int *)malloc(sizeof(int) * (size_t)c->n_layers * KR_UNITS);
    if (!r->slots || !r->seq || !r->pos_of) {
        kr_ring_destroy(r);
        return K3_ERR_NOMEM;
    }
    n = 0;
    for (int i = 0; i < c->n_layers * KR_UNITS; i++) r->pos_of[i] = -1;
    for (int L = 0; L < c->n_layers; L++)
        if (m->layers[L].streamed)
            for (int u = 0; u < kr_layer_units(&m->layers[L]); u++) {
                r->pos_of[L * KR_UNITS + u] = n;
                r->seq[n++] = L * KR_UNITS + u;
            }
    for (int i = 0; i < nslots; i++)
        if (posix_memalign((void **)&r->slots[i].buf, 4096, biggest ? biggest : 64) != 0) {
            r->slots[i].buf = NULL;
            km_set_err(err, errlen, "out of memory for %d trunk ring slots of %llu bytes", nslots,
                       (unsigned long long)biggest);
            kr_ring_destroy(r);
            return K3_ERR_NOMEM;
        }
    if (pthread_create(&r->reader, NULL, kr_reader, r) != 0) {
        km_set_err(err, errlen, "cannot start the trunk reader thread");
        kr_ring_destroy(r);
        return K3_ERR_RUNTIME;
    }
    r->started = 1;
    m->ring = r;
    return K3_OK;
}
