/*
 * Caller-owned thread pool. kvc__parallel_for hands out task indices from an
 * atomic counter; the calling thread works too. Tasks are fixed chunks chosen
 * by the operator, never derived from the thread count, so the output does
 * not depend on n_threads.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

/*
 * Hand-off: the caller publishes the job, then bumps `generation`. Workers
 * spin on `generation` for a while (a model step issues hundreds of short
 * parallel loops; waking a thread blocked on a condition variable costs tens
 * of microseconds each time) and only then block on work_cv, announcing it in
 * `sleepers` so the caller knows to broadcast. Both sides use seq_cst
 * operations on generation/sleepers, so at least one sees the other's write
 * (no lost wake-up). Completion: workers decrement `active`; the caller spins,
 * then yields, until it reaches 0.
 */
#define SPIN_ITERS 20000 /* ~0.1-0.3 ms of pause instructions before blocking */
#define KVC__WORKER_STACK ((size_t)1 << 20) /* 1 MiB: several times what a task needs */

struct kvc_threadpool {
    int n_threads;
    pthread_t *workers; /* n_threads - 1 */
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* sleeping workers wait here for a new generation */
    atomic_uint_fast64_t generation; /* bumped once per parallel_for */
    atomic_int sleepers;             /* workers blocked (or about to block) on work_cv */
    atomic_int shutdown;
    atomic_int active; /* workers still inside the current generation */
    /* current job (written before generation is bumped) */
    kvc__task_fn fn;
    void *ctx;
    int64_t n_tasks;
    atomic_int_fast64_t next;
    void *scratch; /* kvc__scratch_get */
    size_t scratch_bytes;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void run_tasks(kvc_threadpool *p) {
    for (;;) {
        int64_t t = atomic_fetch_add(&p->next, 1);
        if (t >= p->n_tasks) break;
        p->fn(p->ctx, t);
    }
}

static void *worker_main(void *arg) {
    kvc_threadpool *p = arg;
    uint64_t seen = 0;
    for (;;) {
        uint64_t g = atomic_load(&p->generation);
        for (int i = 0; g == seen && i < SPIN_ITERS && !atomic_load(&p->shutdown); i++) {
            cpu_relax();
            g = atomic_load(&p->generation);
        }
        if (g == seen && !atomic_load(&p->shutdown)) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (!atomic_load(&p->shutdown) && (g = atomic_load(&p->generation)) == seen)
                pthread_cond_wait(&p->work_cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->shutdown)) break;
        seen = g;
        run_tasks(p);
        atomic_fetch_sub(&p->active, 1);
    }
    return NULL;
}

kvc_status kvc_threadpool_create(int n_threads, kvc_threadpool **out) {
    KVC_CHECK(out != NULL, "kvc_threadpool_create: out is NULL");
    *out = NULL;
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    KVC_CHECK(n_threads <= 1024, "kvc_threadpool_create: n_threads %d > 1024", n_threads);
    kvc_threadpool *p = calloc(1, sizeof *p);
    if (!p) return kvc__error(KVC_ERR_NOMEM, "kvc_threadpool_create: out of memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    if (n_threads > 1) {
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->workers) {
            kvc_threadpool_destroy(p);
            return kvc__error(KVC_ERR_NOMEM, "kvc_threadpool_create: out of memory");
        }
        /* Kernels keep their per-task state on the stack (about 200 KiB at
         * most; callers need 256 KiB, core.h): workers get at least
         * KVC__WORKER_STACK whatever the C library's default (musl's is 128
         * KiB; glibc's follows ulimit -s). */
        pthread_attr_t attr;
        size_t stack = 0;
        const int have_attr = pthread_attr_init(&attr) == 0;
        if (have_attr && pthread_attr_getstacksize(&attr, &stack) == 0 &&
            stack < KVC__WORKER_STACK)
            pthread_attr_setstacksize(&attr, KVC__WORKER_STACK);
        for (int i = 0; i < n_threads - 1; i++) {
            if (pthread_create(&p->workers[i], have_attr ? &attr : NULL, worker_main, p) != 0) {
                if (have_attr) pthread_attr_destroy(&attr);
                p->n_threads = i + 1; /* destroy joins only the started ones */
                kvc_threadpool_destroy(p);
                return kvc__error(KVC_ERR_NOMEM, "kvc_threadpool_create: cannot start thread %d",
                                  i);
            }
        }
        if (have_attr) pthread_attr_destroy(&attr);
    }
    *out = p;
    return KVC_OK;
}

void kvc_threadpool_destroy(kvc_threadpool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->shutdown, 1);
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    if (p->workers)
        for (int i = 0; i < p->n_threads - 1; i++) pthread_join(p->workers[i], NULL);
    free(p->workers);
    free(p->scratch);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work_cv);
    free(p);
}

int kvc_threadpool_n_threads(const kvc_threadpool *p) { return p ? p->n_threads : 1; }

/* 64-byte aligned: the matrix products keep quantized rows there, as their
 * own blocks were (aligned_alloc needs a multiple of the alignment). */
static void *scratch_alloc(size_t bytes) {
    if (bytes > SIZE_MAX - 63) return NULL;
    return aligned_alloc(64, bytes ? (bytes + 63) / 64 * 64 : 64);
}

void *kvc__scratch_get(kvc_threadpool *pool, size_t bytes) {
    if (!pool) return scratch_alloc(bytes);
    if (pool->scratch_bytes < bytes) {
        free(pool->scratch);
        pool->scratch = scratch_alloc(bytes);
        pool->scratch_bytes = pool->scratch ? bytes : 0;
    }
    return pool->scratch;
}

void kvc__scratch_release(kvc_threadpool *pool, void *p) {
    if (!pool) free(p);
}

void kvc__parallel_for(kvc_threadpool *p, int64_t n_tasks, kvc__task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    atomic_store(&p->active, p->n_threads - 1);
    atomic_fetch_add(&p->generation, 1); /* publishes the job (seq_cst) */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->work_cv);
        pthread_mutex_unlock(&p->mu);
    }
    run_tasks(p);
    for (int i = 0; atomic_load(&p->active) > 0; i++) {
        if (i < SPIN_ITERS) cpu_relax();
        else sched_yield();
    }
}
