/* k3_pool.c: the one process-wide thread pool.
 *
 * Work is split into contiguous index ranges; each range's output is computed with
 * the same per-item arithmetic whoever runs it, so bits never depend on the split.
 * One parallel region runs at a time (a mutex serialises callers).
 */
#include <pthread.h>
#include <stdlib.h>

#include "k3_internal.h"

#define KP_MAX 64

static pthread_mutex_t kp_call_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t kp_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t kp_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t kp_done = PTHREAD_COND_INITIALIZER;
static int kp_started = 0;
static unsigned long kp_generation = 0;
static int kp_pending = 0;

static kp_fn kp_job_fn;
static void *kp_job_ctx;
static int kp_job_n, kp_job_parts;
static pthread_once_t kp_atfork_once = PTHREAD_ONCE_INIT;
/* The generation current when each worker was made: a worker waits for the NEXT job, so a
 * worker made after fork (or when the pool grows) never takes up a finished job's range. */
static unsigned long kp_birth[KP_MAX];

/* fork() copies only the calling thread: in the child the workers are gone and a lock may
 * be held by one of them. Start the child with an empty pool (workers are made on demand). */
static void kp_after_fork_child(void) {
    pthread_mutex_t fresh_mutex = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t fresh_cond = PTHREAD_COND_INITIALIZER;
    kp_call_lock = fresh_mutex;
    kp_lock = fresh_mutex;
    kp_wake = fresh_cond;
    kp_done = fresh_cond;
    kp_started = 0;
    kp_pending = 0;
    kp_job_parts = 0;
}

static void kp_register_atfork(void) { pthread_atfork(NULL, NULL, kp_after_fork_child); }

static void kp_range(int part, int parts, int n, int *b, int *e) {
    long lo = (long)n * part / parts, hi = (long)n * (part + 1) / parts;
    *b = (int)lo;
    *e = (int)hi;
}

static void *kp_worker(void *arg) {
    int id = (int)(intptr_t)arg; /* worker id 1..KP_MAX-1; part 0 is the caller */
    unsigned long seen = kp_birth[id]; /* written before pthread_create: visible here */
    for (;;) {
        pthread_mutex_lock(&kp_lock);
        while (kp_generation == seen) pthread_cond_wait(&kp_wake, &kp_lock);
        seen = kp_generation;
        int parts = kp_job_parts, n = kp_job_n;
        kp_fn fn = kp_job_fn;
        void *ctx = kp_job_ctx;
        pthread_mutex_unlock(&kp_lock);
        if (id < parts) {
            int b, e;
            kp_range(id, parts, n, &b, &e);
            if (b < e) fn(ctx, b, e);
            pthread_mutex_lock(&kp_lock);
            if (--kp_pending == 0) pthread_cond_signal(&kp_done);
            pthread_mutex_unlock(&kp_lock);
        }
    }
    return NULL;
}

static int kp_ensure(int want) {
    pthread_once(&kp_atfork_once, kp_register_atfork);
    if (want > KP_MAX) want = KP_MAX;
    while (kp_started < want - 1) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        kp_birth[kp_started + 1] = kp_generation; /* no job runs: callers hold kp_call_lock */
        int rc = pthread_create(&t, &at, kp_worker, (void *)(intptr_t)(kp_started + 1));
        pthread_attr_destroy(&at);
        if (rc != 0) break;
        kp_started++;
    }
    return kp_started + 1;
}

void kp_parallel_for(int nthreads, int n, kp_fn fn, void *ctx) {
    if (n <= 0) return;
    if (nthreads > n) nthreads = n;
    if (nthreads <= 1) {
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&kp_call_lock);
    int avail = kp_ensure(nthreads);
    int parts = nthreads < avail ? nthreads : avail;
    if (parts <= 1) {
        pthread_mutex_unlock(&kp_call_lock);
        fn(ctx, 0, n);
        return;
    }
    pthread_mutex_lock(&kp_lock);
    kp_job_fn = fn;
    kp_job_ctx = ctx;
    kp_job_n = n;
    kp_job_parts = parts;
    kp_pending = parts - 1;
    kp_generation++;
    pthread_cond_broadcast(&kp_wake);
    pthread_mutex_unlock(&kp_lock);
    int b, e;
    kp_range(0, parts, n, &b, &e);
    if (b < e) fn(ctx, b, e);
    pthread_mutex_lock(&kp_lock);
    while (kp_pending > 0) pthread_cond_wait(&kp_done, &kp_lock);
    pthread_mutex_unlock(&kp_lock);
    pthread_mutex_unlock(&kp_call_lock);
}
