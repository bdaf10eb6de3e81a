/* k3_ring.c: trunk streaming for budgets below the trunk size.
 *
 * The matrices of layers that are not pinned cycle through a ring of at least two slots,
 * in units: a layer's attention matrices, then its FFN matrices (so a slot is sized for
 * the largest unit, not the largest layer); with ffn_split a dense layer's FFN is three
 * units, gate, up, down, so its slot need is one matrix.  Reader threads walk the units in
 * forward order, cyclically, and fill slot (load mod slots) as soon as compute has released
 * it, so they run up to slots-1 units ahead.  A unit's reads can be cut into pieces
 * (trunk_piece_bytes) that several readers take in file order, so a device that wants a
 * deeper queue gets several requests at once; by default one reader makes one request per
 * contiguous read, which measured fastest on our test disk (kernel read-ahead streams it).
 * Compute takes loads in the same order; if a pass ended early (an error or a cancel), the
 * ring is reset to the wanted unit: a generation counter makes the readers drop whatever
 * they were reading for the old order, and a slot is refilled only once no piece of an old
 * read is still landing in it.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_internal.h"
#include "k3_platform.h"

enum { KR_EMPTY = 0, KR_READY = 1, KR_FAILED = 2, KR_FILLING = 3 };

typedef struct {
    uint8_t *buf;
    uint64_t load;  /* which load (sequence number) the slot holds or is filling */
    int state;      /* KR_* */
    int unit;       /* the seq entry of that load */
    int next, done; /* pieces handed to readers, pieces finished (this generation) */
    int inflight;   /* pieces being read into buf now, whatever their generation */
    int failed;
    uint64_t gen;
    char err[320];
} kr_slot;

struct kr_ring {
    k3_model *m;
    kr_slot *slots;
    int nslots;
    int *seq;       /* streamed units in forward order: L * KR_UNITS + unit */
    int nseq;
    uint64_t issued, produced, consumed; /* loads started, complete in order, used */
    int inflight;   /* pieces being read, all slots */
    uint64_t gen;   /* bumped by a reset; a read begun under an older one is dropped */
    int *pos_of;    /* unit (L * KR_UNITS + u) -> its position in seq, or -1 */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t *readers;
    int nreaders, stop;
};

static int kr_cmp_entry(const void *a, const void *b) {
    const kr_entry *x = (const kr_entry *)a, *y = (const kr_entry *)b;
    if (x->shard != y->shard) return x->shard < y->shard ? -1 : 1;
    return x->off < y->off ? -1 : x->off > y->off;
}

int kr_unit_layout(kr_unit *u, uint64_t piece) {
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
    uint64_t np = 0;
    for (int i = 0; i < u->nreads; i++) np += (u->reads[i].len + piece - 1) / piece;
    u->pieces = (kr_read *)calloc((size_t)np, sizeof(kr_read));
    if (!u->pieces) return -1;
    for (int i = 0; i < u->nreads; i++)
        for (uint64_t at = 0; at < u->reads[i].len; at += piece) {
            kr_read *pc = &u->pieces[u->npieces++];
            *pc = u->reads[i];
            pc->off += at;
            pc->slot_off += at;
            pc->len = u->reads[i].len - at < piece ? u->reads[i].len - at : piece;
        }
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

/* An injected fault for this unit (tests): the whole load fails before any read.  Lock held. */
static int kr_fault_here(k3_model *m, int L, int unit) {
    if (m->fault_kind && m->fault_layer == L &&
        (m->fault_expert == -1 || (m->fault_expert == -4 && unit == KR_FFN_DOWN))) {
        m->fault_kind = 0;
        return 1;
    }
    return 0;
}

static int kr_read_piece(kr_ring *r, int L, int unit, const kr_read *pc, uint8_t *buf, char *err, size_t errlen) {
    k3_model *m = r->m;
    int rc = kt_pread_full(m->shards[pc->shard].fd, buf + pc->slot_off, pc->len, pc->off);
    if (rc != 0) {
        km_set_err(err, errlen, "read of layer %d trunk (%s matrices) failed: shard %s offset %llu length %llu: %s",
                   L, kr_unit_name(&m->layers[L], unit), m->shards[pc->shard].path,
                   (unsigned long long)pc->off, (unsigned long long)pc->len, strerror(-rc));
        return K3_ERR_IO;
    }
    __atomic_add_fetch(&m->stats.trunk_bytes_read, pc->len, __ATOMIC_RELAXED);
    /* streamed bytes are read again next pass from disk, not held twice in RAM */
    if (m->opts.direct_io) kos_drop_cached(m->shards[pc->shard].fd, pc->off, pc->len);
    return K3_OK;
}

static const kr_unit *kr_unit_of(const kr_ring *r, int seq_entry) {
    return &r->m->layers[seq_entry / KR_UNITS].su[seq_entry % KR_UNITS];
}

/* A load whose pieces are all in ends ready or failed; loads become visible to compute in
 * order, so `produced` moves past every finished load at its front.  Lock held. */
static void kr_finish_load(kr_ring *r, kr_slot *s) {
    s->state = s->failed ? KR_FAILED : KR_READY;
    if (!s->failed) __atomic_add_fetch(&r->m->stats.trunk_stream_reads, 1, __ATOMIC_RELAXED);
    while (r->produced < r->issued) {
        kr_slot *f = &r->slots[r->produced % (uint64_t)r->nslots];
        if (f->load != r->produced || (f->state != KR_READY && f->state != KR_FAILED)) break;
        r->produced++;
    }
    pthread_cond_broadcast(&r->cv);
}

/* The slot with a piece left to read, lowest load first; else start the next load if its
 * slot is released and no old piece is landing in it; else NULL.  Lock held. */
static kr_slot *kr_pick(kr_ring *r) {
    for (uint64_t p = r->produced; p < r->issued; p++) {
        kr_slot *s = &r->slots[p % (uint64_t)r->nslots];
        if (s->state == KR_FILLING && s->load == p && s->next < kr_unit_of(r, s->unit)->npieces) return s;
    }
    if (r->issued - r->consumed >= (uint64_t)r->nslots) return NULL;
    kr_slot *s = &r->slots[r->issued % (uint64_t)r->nslots];
    if (s->inflight) return NULL;
    s->load = r->issued++;
    s->unit = r->seq[s->load % (uint64_t)r->nseq];
    s->gen = r->gen;
    s->next = s->done = s->failed = 0;
    s->state = KR_FILLING;
    int L = s->unit / KR_UNITS, u = s->unit % KR_UNITS;
    if (kr_fault_here(r->m, L, u)) {
        km_set_err(s->err, sizeof s->err, "read of layer %d trunk (%s matrices) failed: shard %s offset %llu length %llu: %s",
                   L, kr_unit_name(&r->m->layers[L], u), r->m->shards[kr_unit_of(r, s->unit)->reads[0].shard].path,
                   (unsigned long long)kr_unit_of(r, s->unit)->reads[0].off,
                   (unsigned long long)kr_unit_of(r, s->unit)->reads[0].len, strerror(EIO));
        s->failed = 1;
        s->next = kr_unit_of(r, s->unit)->npieces; /* nothing left to hand out */
    }
    if (s->next == kr_unit_of(r, s->unit)->npieces) {
        kr_finish_load(r, s);
        return NULL;
    }
    return s;
}

static void *kr_reader(void *arg) {
    kr_ring *r = (kr_ring *)arg;
    char err[320];
    pthread_mutex_lock(&r->mu);
    while (!r->stop) {
        kr_slot *s = kr_pick(r);
        if (!s) {
            if (r->issued - r->consumed < (uint64_t)r->nslots &&
                r->slots[r->issued % (uint64_t)r->nslots].inflight == 0)
                continue; /* kr_pick finished a load at once (a fault): look again */
            pthread_cond_wait(&r->cv, &r->mu);
            continue;
        }
        const kr_unit *u = kr_unit_of(r, s->unit);
        int L = s->unit / KR_UNITS, unit = s->unit % KR_UNITS;
        const kr_read *pc = &u->pieces[s->next++];
        uint64_t gen = s->gen;
        s->inflight++;
        if ((uint64_t)++r->inflight > r->m->stats.trunk_inflight_max) r->m->stats.trunk_inflight_max = (uint64_t)r->inflight;
        pthread_mutex_unlock(&r->mu);
        err[0] = 0;
        int rc = kr_read_piece(r, L, unit, pc, s->buf, err, sizeof err);
        pthread_mutex_lock(&r->mu);
        s->inflight--;
        r->inflight--;
        if (gen != r->gen) { /* reset while reading: this piece is for the old order */
            pthread_cond_broadcast(&r->cv);
            continue;
        }
        if (rc != K3_OK && !s->failed) {
            s->failed = 1;
            snprintf(s->err, sizeof s->err, "%s", err);
        }
        if (++s->done == u->npieces) kr_finish_load(r, s);
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
            r->consumed = r->produced = r->issued = next;
            for (int i = 0; i < r->nslots; i++) r->slots[i].state = KR_EMPTY;
            pthread_cond_broadcast(&r->cv);
            continue;
        }
        while (r->produced <= c) pthread_cond_wait(&r->cv, &r->mu);
        if (r->consumed != c) continue; /* reset meanwhile */
        kr_slot *s = &r->slots[c % (uint64_t)r->nslots];
        if (s->state == KR_FAILED) {
            km_set_err(err, errlen, "%s", s->err);
            s->state = KR_EMPTY;
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
    r->slots[r->consumed % (uint64_t)r->nslots].state = KR_EMPTY;
    r->consumed++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

void kr_ring_destroy(kr_ring *r) {
    if (!r) return;
    if (r->nreaders) {
        pthread_mutex_lock(&r->mu);
        r->stop = 1;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        for (int i = 0; i < r->nreaders; i++) pthread_join(r->readers[i], NULL);
    }
    free(r->readers);
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
    int nr = m->opts.trunk_readers > 0 ? m->opts.trunk_readers : 1;
    if (nr > 32) nr = 32;
    r->readers = (pthread_t *)calloc((size_t)nr, sizeof(pthread_t));
    if (!r->readers) {
        kr_ring_destroy(r);
        return K3_ERR_NOMEM;
    }
    for (int i = 0; i < nr; i++) {
        if (pthread_create(&r->readers[i], NULL, kr_reader, r) != 0) break;
        r->nreaders++;
    }
    if (r->nreaders == 0) {
        km_set_err(err, errlen, "cannot start the trunk reader threads");
        kr_ring_destroy(r);
        return K3_ERR_RUNTIME;
    }
    m->ring = r;
    return K3_OK;
}
