/*
 * Caller-owned thread pool. kvc__parallel_for hands out task indices; the
 * calling thread works too. Tasks are fixed chunks chosen by the operator,
 * never derived from the thread count, so the output does not depend on
 * n_threads.
 *
 * A caller waits only for workers that hold a task: one word (`state`) holds
 * the job's generation, the tasks not yet claimed and the workers inside a
 * task, and a worker joins a job only by claiming one of its tasks in that
 * word. A worker that is descheduled, or still asleep, when a job is posted
 * simply misses it; the caller runs what nobody claimed and returns. Before
 * this, the caller waited for every worker to check in, so one descheduled
 * worker cost a whole time slice per parallel loop on a busy or
 * oversubscribed machine (10-25x slower decode).
 */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/*
 * state: bits 0-31 tasks not yet claimed, bits 32-43 workers inside a task
 * (holders), bits 44-63 the job's generation. While a worker holds a task
 * the caller cannot post the next job, so a holder's claims and the job
 * fields it reads (fn, ctx, n_tasks) always belong to one job; a worker with
 * a stale view fails its compare-and-swap and reloads.
 *
 * Waiting: idle workers spin on the generation for up to SPIN_NS (a model
 * step issues hundreds of short loops, and waking a thread blocked on a
 * condition variable costs tens of microseconds), then block on work_cv,
 * announced in `sleepers`. A caller whose tasks are all claimed spins up to
 * SPIN_NS for the holders, then blocks on done_cv, announced in
 * `caller_waiting`: blocking leaves its CPU idle, so the scheduler can run a
 * holder that was preempted there instead of the caller spinning on it. Both
 * announcements are seq_cst stores followed by seq_cst loads of the other
 * side's word, so at least one side sees the other (no lost wake-up); and a
 * worker that misses a job costs only speed, never correctness, since nobody
 * waits for it. Spinners call sched_yield every ~10 us: alone on a CPU it
 * returns at once, and a thread sharing its CPU lets a holder or the caller
 * run.
 *
 * More threads than CPUs: a worker spins only while at most max_spin =
 * (CPUs the process may use) - 1 workers are awake (the others go straight
 * to sleep), and a new job wakes only as many sleepers as it has tasks for
 * and as there are CPUs for (max_spin minus the workers awake). So -t 256
 * on 2 CPUs behaves as -t 2 with idle threads, instead of 255 threads woken
 * per loop to fight over 2 CPUs; on 1 CPU the caller alone runs every task.
 *
 * A busy machine: a worker preempted while it holds a task stalls the caller
 * for the rest of the other process's time slice (milliseconds, against
 * microseconds per loop). When a wait for holders lasts far longer than the
 * caller's own tasks took (BAD_WAIT_NS beyond 4 tasks' time), the next loops
 * run on the caller alone for a backoff of 1 ms, doubling up to 16 ms while
 * such waits recur; results do not change (tasks are fixed), only who runs
 * them.
 */
#define SPIN_NS 100000 /* 0.1 ms */
#define BAD_WAIT_NS 50000 /* a holder this late beyond its task's time was preempted */
#define BACKOFF_MIN_NS 1000000
#define BACKOFF_MAX_NS 16000000
#define KVC__WORKER_STACK ((size_t)1 << 20) /* 1 MiB: several times what a task needs */

#define REM_MASK ((uint64_t)0xffffffffu)
#define HOLD_ONE ((uint64_t)1 << 32)
#define HOLD_MASK ((uint64_t)0xfff << 32)
#define GEN_SHIFT 44
#define MAX_JOB_TASKS ((int64_t)REM_MASK) /* larger loops run as several jobs */

struct kvc_threadpool {
    int n_threads;
    int max_spin; /* workers kept awake at once: min(n_threads, CPUs) - 1 */
    /* the caller's: no workers until serial_until after a job waited for a
     * preempted holder (backoff_ns, doubling while it repeats) */
    uint64_t serial_until, backoff_ns, last_bad;
    pthread_t *workers; /* n_threads - 1 */
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* idle workers wait here for a new generation */
    pthread_cond_t done_cv; /* the caller waits here for the holders */
    _Atomic uint64_t state;
    atomic_int sleepers;       /* workers blocked (or about to block) on work_cv */
    atomic_int caller_waiting; /* the caller blocked (or about to block) on done_cv */
    atomic_int shutdown;
    uint64_t gen; /* the caller's: generation of the last job posted */
    /* the current job: written by the caller while no worker holds a task */
    kvc__task_fn fn;
    void *ctx;
    int64_t n_tasks;
    int64_t task0; /* index of the job's first task in the caller's loop */
    void *scratch; /* kvc__scratch_get */
    size_t scratch_bytes;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Spins while cond(p, arg) holds, at most SPIN_NS; returns whether it still
 * holds. */
typedef int (*spin_cond)(kvc_threadpool *p, uint64_t arg);
static int spin_while(kvc_threadpool *p, spin_cond cond, uint64_t arg) {
    uint64_t t0 = 0;
    for (int i = 0;; i++) {
        if (!cond(p, arg)) return 0;
        cpu_relax();
        if ((i & 255) == 255) {
            const uint64_t t = now_ns();
            if (t0 == 0) t0 = t;
            else if (t - t0 > SPIN_NS) return cond(p, arg);
            /* A thread that shares its CPU (a busy machine) lets the other
             * run: a holder or the caller; alone on it, this returns at once. */
            sched_yield();
        }
    }
}

static int same_gen(kvc_threadpool *p, uint64_t seen) {
    return !atomic_load(&p->shutdown) && atomic_load(&p->state) >> GEN_SHIFT == seen;
}

static int holders_busy(kvc_threadpool *p, uint64_t unused) {
    (void)unused;
    return (atomic_load(&p->state) & HOLD_MASK) != 0;
}

/* Worker: claims a task of the job in *w (joining it when `join`), or leaves
 * when none is left. Returns the task's index in the job, or -1. */
static int64_t worker_claim(kvc_threadpool *p, uint64_t w, int join) {
    const uint64_t gen = w >> GEN_SHIFT;
    for (;;) {
        if (w >> GEN_SHIFT != gen) return -1; /* only possible before joining */
        const uint64_t rem = w & REM_MASK;
        if (rem > 0) {
            if (atomic_compare_exchange_weak(&p->state, &w, w - 1 + (join ? HOLD_ONE : 0)))
                return p->n_tasks - (int64_t)rem;
        } else if (join) {
            return -1;
        } else if (atomic_compare_exchange_weak(&p->state, &w, w - HOLD_ONE)) {
            /* the last holder out wakes a caller that blocked for it */
            if ((w & HOLD_MASK) == HOLD_ONE && atomic_load(&p->caller_waiting)) {
                pthread_mutex_lock(&p->mu);
                pthread_cond_signal(&p->done_cv);
                pthread_mutex_unlock(&p->mu);
            }
            return -1;
        }
    }
}

/* Workers not blocked on work_cv (spinning or running a task). */
static int awake_workers(kvc_threadpool *p) {
    return p->n_threads - 1 - atomic_load(&p->sleepers);
}

static void *worker_main(void *arg) {
    kvc_threadpool *p = arg;
    uint64_t seen = 0;
    for (;;) {
        int waiting = same_gen(p, seen);
        /* spin only while no more workers are awake than there are CPUs for */
        if (waiting && awake_workers(p) <= p->max_spin) waiting = spin_while(p, same_gen, seen);
        if (waiting) {
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (same_gen(p, seen)) pthread_cond_wait(&p->work_cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->shutdown)) break;
        const uint64_t w = atomic_load(&p->state);
        seen = w >> GEN_SHIFT;
        int64_t t = worker_claim(p, w, 1);
        while (t >= 0) {
            p->fn(p->ctx, p->task0 + t);
            t = worker_claim(p, atomic_load(&p->state), 0);
        }
    }
    return NULL;
}

int kvc_cpu_count(void) {
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        const int n = CPU_COUNT(&set);
        if (n > 0) return n;
    }
#endif
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

kvc_status kvc_threadpool_create(int n_threads, kvc_threadpool **out) {
    KVC_CHECK(out != NULL, "kvc_threadpool_create: out is NULL");
    *out = NULL;
    const int n_cpus = kvc_cpu_count();
    if (n_threads <= 0) n_threads = n_cpus;
    KVC_CHECK(n_threads <= 1024, "kvc_threadpool_create: n_threads %d > 1024", n_threads);
    kvc_threadpool *p = calloc(1, sizeof *p);
    if (!p) return kvc__error(KVC_ERR_NOMEM, "kvc_threadpool_create: out of memory");
    p->n_threads = n_threads;
    p->max_spin = (n_threads < n_cpus ? n_threads : n_cpus) - 1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
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
    pthread_cond_destroy(&p->done_cv);
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

/* One job of at most MAX_JOB_TASKS tasks, the caller working too. */
static void run_job(kvc_threadpool *p, int64_t task0, int64_t n_tasks, kvc__task_fn fn,
                    void *ctx) {
    p->fn = fn;
    p->ctx = ctx;
    p->task0 = task0;
    p->n_tasks = n_tasks;
    p->gen = (p->gen + 1) & (((uint64_t)1 << (64 - GEN_SHIFT)) - 1);
    atomic_store(&p->state, p->gen << GEN_SHIFT | (uint64_t)n_tasks); /* publishes the job */
    if (atomic_load(&p->sleepers) > 0) {
        /* helpers the job can use on idle CPUs, beyond those awake */
        int64_t wake = n_tasks - 1 < p->max_spin ? n_tasks - 1 : p->max_spin;
        wake -= awake_workers(p);
        if (wake > 0) {
            pthread_mutex_lock(&p->mu);
            for (int64_t i = 0; i < wake; i++) pthread_cond_signal(&p->work_cv);
            pthread_mutex_unlock(&p->mu);
        }
    }
    const uint64_t t0 = now_ns();
    int64_t mine = 0;
    uint64_t w = atomic_load(&p->state);
    while ((w & REM_MASK) > 0) {
        if (atomic_compare_exchange_weak(&p->state, &w, w - 1)) {
            fn(ctx, task0 + n_tasks - (int64_t)(w & REM_MASK));
            mine++;
            w = atomic_load(&p->state);
        }
    }
    if (!holders_busy(p, 0)) return;
    /* Every task is claimed: wait for the workers still running one
     * (spinning only where a CPU is free for them meanwhile). */
    const uint64_t t1 = now_ns();
    if (p->max_spin > 0 ? spin_while(p, holders_busy, 0) : holders_busy(p, 0)) {
        pthread_mutex_lock(&p->mu);
        atomic_store(&p->caller_waiting, 1);
        while (holders_busy(p, 0)) pthread_cond_wait(&p->done_cv, &p->mu);
        atomic_store(&p->caller_waiting, 0);
        pthread_mutex_unlock(&p->mu);
    }
    const uint64_t t2 = now_ns();
    /* judged only against tasks the caller ran itself (their mean time) */
    if (mine > 0 && t2 - t1 > BAD_WAIT_NS + 4 * ((t1 - t0) / (uint64_t)mine)) {
        const int recurring = p->last_bad && t2 - p->last_bad < 2 * p->backoff_ns + BACKOFF_MIN_NS;
        p->backoff_ns = !recurring ? BACKOFF_MIN_NS
                        : 2 * p->backoff_ns < BACKOFF_MAX_NS ? 2 * p->backoff_ns
                                                             : BACKOFF_MAX_NS;
        p->serial_until = t2 + p->backoff_ns;
        p->last_bad = t2;
    }
}

void kvc__parallel_for(kvc_threadpool *p, int64_t n_tasks, kvc__task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    if (!p || p->n_threads == 1 || n_tasks == 1 ||
        (p->serial_until != 0 && now_ns() < p->serial_until)) {
        for (int64_t t = 0; t < n_tasks; t++) fn(ctx, t);
        return;
    }
    p->serial_until = 0;
    for (int64_t t0 = 0; t0 < n_tasks; t0 += MAX_JOB_TASKS)
        run_job(p, t0, n_tasks - t0 < MAX_JOB_TASKS ? n_tasks - t0 : MAX_JOB_TASKS, fn, ctx);
}
