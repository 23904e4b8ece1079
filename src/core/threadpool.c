/*
 * Caller-owned thread pool. kvc__parallel_for hands out task indices from an
 * atomic counter; the calling thread works too. Tasks are fixed chunks chosen
 * by the operator, never derived from the thread count, so the output does
 * not depend on n_threads.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

struct kvc_threadpool {
    int n_threads;
    pthread_t *workers; /* n_threads - 1 */
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* workers wait here for a new generation */
    pthread_cond_t done_cv; /* the caller waits here for workers to finish */
    uint64_t generation;    /* bumped once per parallel_for */
    int shutdown;
    int active; /* workers still inside the current generation */
    /* current job */
    kvc__task_fn fn;
    void *ctx;
    int64_t n_tasks;
    atomic_int_fast64_t next;
};

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
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->shutdown && p->generation == seen) pthread_cond_wait(&p->work_cv, &p->mu);
        if (p->shutdown) break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        run_tasks(p);
        pthread_mutex_lock(&p->mu);
        if (--p->active == 0) pthread_cond_signal(&p->done_cv);
    }
    pthread_mutex_unlock(&p->mu);
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
    pthread_cond_init(&p->done_cv, NULL);
    if (n_threads > 1) {
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->workers) {
            kvc_threadpool_destroy(p);
            return kvc__error(KVC_ERR_NOMEM, "kvc_threadpool_create: out of memory");
        }
        for (int i = 0; i < n_threads - 1; i++) {
            if (pthread_create(&p->workers[i], NULL, worker_main, p) != 0) {
                p->n_threads = i + 1; /* destroy joins only the started ones */
                kvc_threadpool_destroy(p);
                return kvc__error(KVC_ERR_NOMEM, "kvc_threadpool_create: cannot start thread %d",
                                  i);
            }
        }
    }
    *out = p;
    return KVC_OK;
}

void kvc_threadpool_destroy(kvc_threadpool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->shutdown = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    if (p->workers)
        for (int i = 0; i < p->n_threads - 1; i++) pthread_join(p->workers[i], NULL);
    free(p->workers);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work_cv);
    pthread_cond_destroy(&p->done_cv);
    free(p);
}

int kvc_threadpool_n_threads(const kvc_threadpool *p) { return p ? p->n_threads : 1; }

void kvc__parallel_for(kvc_threadpool *p, int64_t n_tasks, kvc__task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1) {
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store(&p->next, 0);
    p->active = p->n_threads - 1;
    p->generation++;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    run_tasks(p);
    pthread_mutex_lock(&p->mu);
    while (p->active > 0) pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
