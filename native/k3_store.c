/* k3_store.c: the routed-expert store: a byte-budgeted cache of whole experts read
 * straight from the shards.
 *
 * A MoE layer pins its batch of experts (kx_begin), the misses are sorted by file
 * offset and read by reader threads, each with one aligned read per expert run (direct
 * I/O when the filesystem allows it); the compute thread takes experts in arrival order
 * (kx_next).  Results never depend on arrival order: each (token, slot) product is kept
 * apart and summed in router order by the caller.  Router lookahead (kx_hint) starts
 * reads for the next layer without pinning them.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "k3_internal.h"
#include "k3_platform.h"

#define KX_ALIGN 4096u
#define KX_MAX_BATCH 4096

enum { KX_FREE = 0, KX_LOADING = 1, KX_READY = 2, KX_FAILED = 3 };

typedef struct {
    uint8_t *buf;       /* aligned allocation, made on first use */
    const uint8_t *data;/* the expert's first byte inside buf */
    int32_t key;        /* layer * n_experts + expert, -1 when free */
    int32_t state;
    int32_t refs;       /* pins by the current batch */
    int32_t prefetched; /* read by lookahead and not used yet */
    int32_t by_hint;    /* the current read was started by lookahead */
    int32_t consumed;   /* handed to the current batch by kx_next */
    uint64_t last_use;
    int errcode;
    char err[320];
} kx_slot;

struct kx_store {
    k3_model *m;
    kx_slot *slots;
    int nslots;
    size_t cap;          /* bytes per slot buffer */
    uint64_t expert_bytes;
    int32_t *where;      /* key -> slot, -1 */
    pthread_mutex_t mu;
    pthread_cond_t cv_job, cv_done;
    int32_t *queue;      /* slot indices to read, FIFO */
    int qhead, qlen, qcap;
    pthread_t *readers;
    int nreaders, stop, prefetch;
    int *dfd;            /* per shard: uncached descriptor (k3_platform.h) or -1 */
    int direct;
    uint64_t tick;
    int batch[KX_MAX_BATCH];
    int nbatch;
};

uint64_t km_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int kt_pread_atleast(int fd, void *buf, uint64_t n, uint64_t off, uint64_t need) {
    uint8_t *p = (uint8_t *)buf;
    uint64_t got = 0;
    /* stop once the needed bytes are in: a retry after a short read would be unaligned */
    while (got < need) {
        ssize_t r = pread(fd, p + got, (size_t)(n - got), (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) break;
        got += (uint64_t)r;
    }
    return got >= need ? 0 : -EIO;
}

static void kx_key_split(const kx_store *s, int key, int *layer, int *expert) {
    *layer = key / s->m->cfg.n_experts;
    *expert = key % s->m->cfg.n_experts;
}

/* Scale bytes 253 and 254 put E2M1 values past the fp32 range (6 * 2^126 > FLT_MAX): no
 * real checkpoint holds them, so bytes like that mean a damaged read or file.  (255 is
 * the MX NaN scale: a zero group, counted by the kernels.) */
static int kx_check_scales(kx_store *s, const kx_slot *sl, int L, int e, char *err, size_t errlen) {
    const kx_expert_loc *loc = &s->m->layers[L].experts[e];
    uint64_t pos = 0;
    for (int i = 0; i < 6; i++) {
        if (i % 2 == 1)
            for (uint64_t b = 0; b < loc->nbytes[i]; b++)
                if (sl->data[pos + b] == 253 || sl->data[pos + b] == 254) {
                    km_set_err(err, errlen, "layer %d expert %d: scale byte %u at byte %llu of tensor %d (shard %s, tensor offset %llu) decodes past the fp32 range; the expert's bytes are damaged",
                               L, e, sl->data[pos + b], (unsigned long long)b, i, s->m->shards[loc->shard[i]].path,
                               (unsigned long long)loc->offset[i]);
                    return K3_ERR_EXPERT_IO;
                }
        pos += loc->nbytes[i];
    }
    return K3_OK;
}

/* Read one expert into its slot.  Called without the lock held. */
static int kx_read(kx_store *s, kx_slot *sl, int key, char *err, size_t errlen) {
    k3_model *m = s->m;
    int L, e;
    kx_key_split(s, key, &L, &e);
    const kx_expert_loc *loc = &m->layers[L].experts[e];
    if (!sl->buf && posix_memalign((void **)&sl->buf, KX_ALIGN, s->cap) != 0) {
        sl->buf = NULL;
        km_set_err(err, errlen, "out of memory for an expert cache slot (%zu bytes)", s->cap);
        return K3_ERR_NOMEM;
    }
    int fault = 0;
    pthread_mutex_lock(&s->mu);
    if (m->fault_kind && m->fault_layer == L && (m->fault_expert == e || m->fault_expert == -2)) {
        fault = 1;
        m->fault_kind = 0;
    }
    pthread_mutex_unlock(&s->mu);
    if (loc->run) {
        uint64_t off = loc->offset[0], total = s->expert_bytes;
        int sh = loc->shard[0], rc;
        if (fault) {
            rc = -EIO;
        } else if (s->direct && __atomic_load_n(&s->dfd[sh], __ATOMIC_RELAXED) >= 0) {
            uint64_t lo = off & ~(uint64_t)(KX_ALIGN - 1);
            uint64_t hi = (off + total + KX_ALIGN - 1) & ~(uint64_t)(KX_ALIGN - 1);
            rc = kt_pread_atleast(s->dfd[sh], sl->buf, hi - lo, lo, off + total - lo);
            sl->data = sl->buf + (off - lo);
            if (rc == -EINVAL) { /* the filesystem took O_DIRECT at open but not for reads (Linux) */
                __atomic_store_n(&m->stats.direct_io_refused, 1, __ATOMIC_RELAXED);
                rc = kt_pread_full(m->shards[sh].fd, sl->buf, total, off);
                sl->data = sl->buf;
            }
        } else {
            rc = kt_pread_full(m->shards[sh].fd, sl->buf, total, off);
            sl->data = sl->buf;
            /* keep the page cache out of the budget when direct I/O is unavailable */
            if (rc == 0 && s->m->opts.direct_io) kos_drop_cached(m->shards[sh].fd, off, total);
        }
        if (rc != 0) {
            km_set_err(err, errlen, "read of layer %d expert %d failed: shard %s offset %llu length %llu: %s",
                       L, e, m->shards[sh].path, (unsigned long long)off, (unsigned long long)total,
                       strerror(-rc));
            return K3_ERR_EXPERT_IO;
        }
        __atomic_add_fetch(&m->stats.expert_run_reads, 1, __ATOMIC_RELAXED);
    } else {
        uint64_t pos = 0;
        for (int i = 0; i < 6; i++) {
            int rc = fault ? -EIO : kt_pread_full(m->shards[loc->shard[i]].fd, sl->buf + pos, loc->nbytes[i], loc->offset[i]);
            if (rc != 0) {
                km_set_err(err, errlen, "read of layer %d expert %d tensor %d failed: shard %s offset %llu length %llu: %s",
                           L, e, i, m->shards[loc->shard[i]].path, (unsigned long long)loc->offset[i],
                           (unsigned long long)loc->nbytes[i], strerror(-rc));
                return K3_ERR_EXPERT_IO;
            }
            pos += loc->nbytes[i];
        }
        sl->data = sl->buf;
        __atomic_add_fetch(&m->stats.expert_fallback_reads, 1, __ATOMIC_RELAXED);
    }
    __atomic_add_fetch(&m->stats.expert_bytes_read, s->expert_bytes, __ATOMIC_RELAXED);
    return kx_check_scales(s, sl, L, e, err, errlen);
}

static void kx_finish(kx_store *s, int idx, int rc, const char *err) {
    kx_slot *sl = &s->slots[idx];
    sl->state = rc == K3_OK ? KX_READY : KX_FAILED;
    sl->errcode = rc;
    if (rc != K3_OK) snprintf(sl->err, sizeof sl->err, "%s", err);
    pthread_cond_broadcast(&s->cv_done);
}

static void *kx_reader(void *arg) {
    kx_store *s = (kx_store *)arg;
    char err[320];
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && s->qlen == 0) pthread_cond_wait(&s->cv_job, &s->mu);
        if (s->stop) break;
        int idx = s->queue[s->qhead];
        s->qhead = (s->qhead + 1) % s->qcap;
        s->qlen--;
        int key = s->slots[idx].key;
        pthread_mutex_unlock(&s->mu);
        err[0] = 0;
        int rc = kx_read(s, &s->slots[idx], key, err, sizeof err);
        pthread_mutex_lock(&s->mu);
        kx_finish(s, idx, rc, err);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static uint64_t kx_offset_of(const kx_store *s, int key) {
    int L, e;
    kx_key_split(s, key, &L, &e);
    return s->m->layers[L].experts[e].offset[0];
}

/* Find a slot for key: a free one, else the least recently used unpinned ready/failed one.
 * Returns -1 if every slot is pinned or loading.  Lock held. */
static int kx_take_slot(kx_store *s, int key) {
    int best = -1;
    for (int i = 0; i < s->nslots; i++) {
        kx_slot *sl = &s->slots[i];
        if (sl->key < 0) {
            best = i;
            break;
        }
        if (sl->refs == 0 && sl->state != KX_LOADING && (best < 0 || sl->last_use < s->slots[best].last_use))
            best = i;
    }
    if (best < 0) return -1;
    kx_slot *sl = &s->slots[best];
    if (sl->key >= 0) {
        s->where[sl->key] = -1;
        __atomic_add_fetch(&s->m->stats.cache_evictions, 1, __ATOMIC_RELAXED);
        if (sl->prefetched) __atomic_add_fetch(&s->m->stats.lookahead_wasted, 1, __ATOMIC_RELAXED);
    }
    sl->key = key;
    sl->state = KX_LOADING;
    sl->refs = 0;
    sl->prefetched = 0;
    sl->by_hint = 0;
    sl->consumed = 0;
    s->where[key] = best;
    return best;
}

static void kx_enqueue(kx_store *s, const int *slots, int n) {
    for (int i = 0; i < n; i++) {
        s->queue[(s->qhead + s->qlen) % s->qcap] = slots[i];
        s->qlen++;
    }
    pthread_cond_broadcast(&s->cv_job);
}

typedef struct {
    uint64_t off;
    int idx;
} kx_order;

static int kx_cmp_order(const void *a, const void *b) {
    const kx_order *x = (const kx_order *)a, *y = (const kx_order *)b;
    return x->off < y->off ? -1 : x->off > y->off;
}

/* Slot indices sorted by their experts' file offsets (reads then sweep each shard once). */
static void kx_sort_by_offset(const kx_store *s, int *slots, int n) {
    kx_order tmp[KX_MAX_BATCH];
    for (int i = 0; i < n; i++) {
        tmp[i].off = kx_offset_of(s, s->slots[slots[i]].key);
        tmp[i].idx = slots[i];
    }
    qsort(tmp, (size_t)n, sizeof(kx_order), kx_cmp_order);
    for (int i = 0; i < n; i++) slots[i] = tmp[i].idx;
}

int kx_batch_limit(const kx_store *s) {
    int lim = s->nslots - 1; /* one spare slot so lookahead can never starve a batch */
    if (lim < 1) lim = 1;
    return lim < KX_MAX_BATCH ? lim : KX_MAX_BATCH;
}

int kx_begin(kx_store *s, int layer, const int *experts, int n, char *err, size_t errlen) {
    k3_model *m = s->m;
    int miss[KX_MAX_BATCH], nmiss = 0;
    if (n > kx_batch_limit(s)) {
        km_set_err(err, errlen, "expert batch of %d exceeds the cache's %d slots", n, kx_batch_limit(s));
        return K3_ERR_INVALID;
    }
    pthread_mutex_lock(&s->mu);
    s->nbatch = 0;
    for (int i = 0; i < n; i++) {
        int key = layer * m->cfg.n_experts + experts[i];
        int idx = s->where[key];
        if (idx >= 0 && s->slots[idx].state == KX_FAILED) {
            /* a failed read is retried, never served */
            s->slots[idx].state = KX_LOADING;
            s->slots[idx].by_hint = 0;
            s->slots[idx].refs++;
            s->slots[idx].consumed = 0;
            miss[nmiss++] = idx;
            __atomic_add_fetch(&m->stats.cache_misses, 1, __ATOMIC_RELAXED);
        } else if (idx >= 0) {
            kx_slot *sl = &s->slots[idx];
            sl->refs++;
            sl->consumed = 0;
            if (sl->prefetched) {
                __atomic_add_fetch(&m->stats.lookahead_used, 1, __ATOMIC_RELAXED);
                sl->prefetched = 0;
            }
            __atomic_add_fetch(&m->stats.cache_hits, 1, __ATOMIC_RELAXED);
        } else {
            for (;;) {
                idx = kx_take_slot(s, key);
                if (idx >= 0) break;
                /* every free slot is in flight for lookahead: wait for one to land */
                pthread_cond_wait(&s->cv_done, &s->mu);
            }
            s->slots[idx].refs = 1;
            miss[nmiss++] = idx;
            __atomic_add_fetch(&m->stats.cache_misses, 1, __ATOMIC_RELAXED);
        }
        s->batch[s->nbatch++] = idx;
    }
    s->tick++;
    for (int i = 0; i < s->nbatch; i++) s->slots[s->batch[i]].last_use = s->tick;
    kx_sort_by_offset(s, miss, nmiss);
    if (s->prefetch) kx_enqueue(s, miss, nmiss);
    pthread_mutex_unlock(&s->mu);
    if (!s->prefetch) { /* synchronous: read on the compute thread, in offset order */
        for (int i = 0; i < nmiss; i++) {
            char e2[320];
            e2[0] = 0;
            int rc = kx_read(s, &s->slots[miss[i]], s->slots[miss[i]].key, e2, sizeof e2);
            pthread_mutex_lock(&s->mu);
            kx_finish(s, miss[i], rc, e2);
            pthread_mutex_unlock(&s->mu);
        }
    }
    return K3_OK;
}

int kx_next(kx_store *s, int *expert, kx_view *view, char *err, size_t errlen) {
    k3_model *m = s->m;
    uint64_t t0 = km_now_ns();
    pthread_mutex_lock(&s->mu);
    for (;;) {
        int pending = 0;
        for (int i = 0; i < s->nbatch; i++) {
            kx_slot *sl = &s->slots[s->batch[i]];
            if (sl->consumed) continue;
            if (sl->state == KX_FAILED && sl->by_hint) {
                /* a lookahead read failed before the router asked: read it again */
                sl->by_hint = 0;
                sl->state = KX_LOADING;
                int idx = s->batch[i];
                if (s->prefetch) {
                    kx_enqueue(s, &idx, 1);
                } else {
                    char e2[320];
                    e2[0] = 0;
                    pthread_mutex_unlock(&s->mu);
                    int rc2 = kx_read(s, sl, sl->key, e2, sizeof e2);
                    pthread_mutex_lock(&s->mu);
                    kx_finish(s, idx, rc2, e2);
                }
                pending = 1;
                continue;
            }
            if (sl->state == KX_FAILED) {
                km_set_err(err, errlen, "%s", sl->err);
                int rc = sl->errcode;
                pthread_mutex_unlock(&s->mu);
                return rc;
            }
            if (sl->state != KX_READY) {
                pending = 1;
                continue;
            }
            sl->consumed = 1;
            int L;
            kx_key_split(s, sl->key, &L, expert);
            const kx_expert_loc *loc = &m->layers[L].experts[*expert];
            const uint8_t *p = sl->data;
            view->w1p = p;
            view->w1s = view->w1p + loc->nbytes[0];
            view->w2p = view->w1s + loc->nbytes[1];
            view->w2s = view->w2p + loc->nbytes[2];
            view->w3p = view->w2s + loc->nbytes[3];
            view->w3s = view->w3p + loc->nbytes[4];
            pthread_mutex_unlock(&s->mu);
            __atomic_add_fetch(&m->stats.io_wait_ns, km_now_ns() - t0, __ATOMIC_RELAXED);
            return K3_OK;
        }
        if (!pending) {
            pthread_mutex_unlock(&s->mu);
            *expert = -1;
            return K3_OK;
        }
        pthread_cond_wait(&s->cv_done, &s->mu);
    }
}

void kx_end(kx_store *s) {
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->nbatch; i++) {
        kx_slot *sl = &s->slots[s->batch[i]];
        if (sl->refs > 0) sl->refs--;
    }
    s->nbatch = 0;
    pthread_mutex_unlock(&s->mu);
}

void kx_hint(kx_store *s, int layer, const int *experts, int n) {
    k3_model *m = s->m;
    int miss[KX_MAX_BATCH], nmiss = 0;
    if (!s->prefetch) return;
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < n && nmiss < KX_MAX_BATCH; i++) {
        int key = layer * m->cfg.n_experts + experts[i];
        if (s->where[key] >= 0) continue;
        /* only take a slot that is free or unpinned; never wait for one */
        int idx = kx_take_slot(s, key);
        if (idx < 0) break;
        s->slots[idx].prefetched = 1;
        s->slots[idx].by_hint = 1;
        s->slots[idx].last_use = s->tick;
        miss[nmiss++] = idx;
        __atomic_add_fetch(&m->stats.lookahead_issued, 1, __ATOMIC_RELAXED);
    }
    kx_sort_by_offset(s, miss, nmiss);
    kx_enqueue(s, miss, nmiss);
    pthread_mutex_unlock(&s->mu);
}

void kx_store_destroy(kx_store *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv_job);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < s->nreaders; i++) pthread_join(s->readers[i], NULL);
    for (int i = 0; s->slots && i < s->nslots; i++) free(s->slots[i].buf);
    if (s->dfd)
        for (int i = 0; i < s->m->n_shards; i++)
            if (s->dfd[i] >= 0) close(s->dfd[i]);
    free(s->dfd);
    free(s->slots);
    free(s->where);
    free(s->queue);
    free(s->readers);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_job);
    pthread_cond_destroy(&s->cv_done);
    free(s);
}

int kx_store_create(k3_model *m, const k3_open_opts *o, kx_store **out, char *err, size_t errlen) {
    const k3_config *c = &m->cfg;
    *out = NULL;
    kx_store *s = (kx_store *)calloc(1, sizeof *s);
    if (!s) return K3_ERR_NOMEM;
    s->m = m;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_job, NULL);
    pthread_cond_init(&s->cv_done, NULL);
    s->expert_bytes = 3ull * c->expert_width * c->latent_dim / 2 + 3ull * c->expert_width * c->latent_dim / 32;
    s->cap = (size_t)((s->expert_bytes + 2 * KX_ALIGN + KX_ALIGN - 1) & ~(uint64_t)(KX_ALIGN - 1));
    int n_moe = 0;
    for (int L = 0; L < c->n_layers; L++) n_moe += m->layers[L].is_moe;
    uint64_t all = (uint64_t)n_moe * c->n_experts;
    uint64_t want = o->expert_cache_bytes ? o->expert_cache_bytes / s->cap : all + 1;
    if (want > all + 1) want = all + 1;
    if (n_moe > 0 && want < (uint64_t)c->top_k + 1) {
        km_set_err(err, errlen, "expert cache of %llu bytes holds %llu experts of %zu bytes; one layer's top-%d plus one spare needs %llu bytes",
                   (unsigned long long)o->expert_cache_bytes, (unsigned long long)want, s->cap, c->top_k,
                   (unsigned long long)((uint64_t)(c->top_k + 1) * s->cap));
        kx_store_destroy(s);
        return K3_ERR_INVALID;
    }
    if (want < 2) want = 2;
    s->nslots = (int)want;
    size_t nkeys = (size_t)c->n_layers * c->n_experts; /* keys are layer * n_experts + expert */
    s->slots = (kx_slot *)calloc((size_t)s->nslots, sizeof(kx_slot));
    s->where = (int32_t *)malloc(sizeof(int32_t) * nkeys);
    s->qcap = s->nslots + 1;
    s->queue = (int32_t *)malloc(sizeof(int32_t) * (size_t)s->qcap);
    s->dfd = (int *)malloc(sizeof(int) * (size_t)m->n_shards);
    if (s->dfd)
        for (int i = 0; i < m->n_shards; i++) s->dfd[i] = -1;
    if (!s->slots || !s->where || !s->queue || !s->dfd) {
        kx_store_destroy(s);
        return K3_ERR_NOMEM;
    }
    for (size_t i = 0; i < nkeys; i++) s->where[i] = -1;
    for (int i = 0; i < s->nslots; i++) s->slots[i].key = -1;
    if (o->direct_io) {
        int refused = 0;
        for (int i = 0; i < m->n_shards; i++) {
            s->dfd[i] = kos_open_uncached(m->shards[i].path);
            if (s->dfd[i] < 0) refused = 1;
        }
        s->direct = !refused;
        m->stats.direct_io_refused = refused;
        if (refused)
            for (int i = 0; i < m->n_shards; i++)
                if (s->dfd[i] >= 0) {
                    close(s->dfd[i]);
                    s->dfd[i] = -1;
                }
    }
    m->stats.direct_io = (uint64_t)s->direct;
    m->stats.expert_slots = (uint64_t)s->nslots;
    s->prefetch = o->prefetch != 0;
    int nr = o->reader_threads > 0 ? o->reader_threads : 2;
    if (nr > 32) nr = 32;
    s->readers = (pthread_t *)calloc((size_t)nr, sizeof(pthread_t));
    if (!s->readers) {
        kx_store_destroy(s);
        return K3_ERR_NOMEM;
    }
    if (s->prefetch)
        for (int i = 0; i < nr; i++) {
            if (pthread_create(&s->readers[i], NULL, kx_reader, s) != 0) break;
            s->nreaders++;
        }
    if (s->prefetch && s->nreaders == 0) s->prefetch = 0;
    *out = s;
    return K3_OK;
}
