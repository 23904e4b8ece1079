/*
 * The timing harness, the memory bandwidth reference and small output
 * helpers shared by every `kvcache bench` target (see bench.h).
 *
 * The bandwidth reference uses its own pthreads, not a kvc_threadpool: it is
 * what the machine can do with n threads, independent of the library.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"

/* ---- timing ------------------------------------------------------------ */

double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of n sorted values. */
static double median_sorted(const double *v, int n) {
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#define BENCH_MAX_SAMPLES 256

int bench_time(bench_fn fn, void *ctx, double budget_s, bench_timing *out) {
    memset(out, 0, sizeof *out);
    /* Warm-up: the first call takes page faults and cold caches; the second
     * gives the per-call estimate used to size the samples. */
    int rc = fn(ctx);
    if (rc != 0) return rc;
    double t0 = bench_now();
    rc = fn(ctx);
    if (rc != 0) return rc;
    double est = bench_now() - t0;
    double target = budget_s / 16.0;
    int64_t k = 1;
    if (est < target) {
        double kk = target / (est > 1e-8 ? est : 1e-8);
        k = kk > 1e7 ? 10000000 : (int64_t)kk;
        if (k < 1) k = 1;
    }
    double samples[BENCH_MAX_SAMPLES];
    int n = 0;
    double start = bench_now();
    while (n < BENCH_MAX_SAMPLES) {
        double s0 = bench_now();
        for (int64_t i = 0; i < k; i++) {
            rc = fn(ctx);
            if (rc != 0) return rc;
        }
        double s1 = bench_now();
        samples[n++] = (s1 - s0) / (double)k;
        out->calls += k;
        if (n >= 3 && s1 - start >= budget_s) break;
    }
    qsort(samples, (size_t)n, sizeof samples[0], cmp_double);
    out->samples = n;
    out->min_s = samples[0];
    out->median_s = median_sorted(samples, n);
    return 0;
}

/* ---- memory ------------------------------------------------------------ */

void *bench_alloc(size_t bytes) {
    void *p = NULL;
    size_t align = (size_t)sysconf(_SC_PAGESIZE);
    if (align < 64) align = 64;
    if (bytes == 0) bytes = 1;
    if (posix_memalign(&p, align, bytes) != 0) return NULL;
    memset(p, 0, bytes);
    return p;
}

void bench_free(void *p) {
    free(p);
}

uint64_t bench_checksum(uint64_t h, const void *p, size_t bytes) {
    /* Four independent FNV-style lanes so the hash runs near memory speed. */
    const unsigned char *c = p;
    const uint64_t prime = 0x100000001b3ull;
    uint64_t lane[4] = {h, h ^ 0x9e3779b97f4a7c15ull, h ^ 0xbf58476d1ce4e5b9ull,
                        h ^ 0x94d049bb133111ebull};
    size_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
        for (int j = 0; j < 4; j++) {
            uint64_t w;
            memcpy(&w, c + i + 8 * (size_t)j, 8);
            lane[j] = (lane[j] ^ w) * prime;
        }
    }
    for (; i < bytes; i++) lane[0] = (lane[0] ^ c[i]) * prime;
    uint64_t r = lane[0];
    for (int j = 1; j < 4; j++) r = (r ^ (lane[j] >> 29) ^ lane[j]) * prime;
    return r ^ (r >> 32);
}

static volatile uint64_t g_sink;

void bench_sink(uint64_t v) {
    g_sink ^= v;
}

/* ---- memory bandwidth reference ---------------------------------------- */

typedef struct membw_task {
    const unsigned char *src;
    unsigned char *dst;
    size_t n;
    int read_only; /* 0: memcpy src -> dst; 1: sum src */
    uint64_t sum;
} membw_task;

/* Sum of n bytes as 64-bit words; independent accumulators let the compiler
 * vectorize and keep several loads in flight. */
static uint64_t sum_words(const unsigned char *p, size_t n) {
    const uint64_t *w = (const uint64_t *)(const void *)p; /* p is 64-byte aligned */
    size_t nw = n / 8;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    size_t i = 0;
    for (; i + 8 <= nw; i += 8) {
        a0 += w[i];
        a1 += w[i + 1];
        a2 += w[i + 2];
        a3 += w[i + 3];
        a4 += w[i + 4];
        a5 += w[i + 5];
        a6 += w[i + 6];
        a7 += w[i + 7];
    }
    for (; i < nw; i++) a0 += w[i];
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

static void membw_run(membw_task *t) {
    if (t->read_only)
        t->sum = sum_words(t->src, t->n);
    else
        memcpy(t->dst, t->src, t->n);
}

static void *membw_thread(void *arg) {
    membw_run(arg);
    return NULL;
}

/* One timed pass of all tasks: tasks[1..n) on new pthreads, tasks[0] here.
 * Returns seconds, or -1 if a thread could not be started. */
static double membw_pass(membw_task *tasks, int n) {
    pthread_t tid[BENCH_MAX_THREADS];
    double t0 = bench_now();
    int started = 1;
    for (; started < n; started++)
        if (pthread_create(&tid[started], NULL, membw_thread, &tasks[started]) != 0) break;
    membw_run(&tasks[0]);
    for (int i = 1; i < started; i++) pthread_join(tid[i], NULL);
    double dt = bench_now() - t0;
    if (started < n) {
        /* Finish the work the missing threads left so buffers stay valid. */
        for (int i = started; i < n; i++) membw_run(&tasks[i]);
        return -1.0;
    }
    return dt;
}

/* Median seconds of passes over the tasks, for about budget_s (>= 3). */
static double membw_time(membw_task *tasks, int n, double budget_s) {
    double s[64];
    int k = 0;
    if (membw_pass(tasks, n) < 0) return -1.0; /* warm-up */
    double start = bench_now();
    while (k < 64) {
        double dt = membw_pass(tasks, n);
        if (dt < 0) return -1.0;
        s[k++] = dt;
        if (k >= 3 && bench_now() - start >= budget_s) break;
    }
    qsort(s, (size_t)k, sizeof s[0], cmp_double);
    return median_sorted(s, k);
}

int bench_membw_measure(int n_threads, size_t bytes, double budget_s, bench_membw *out) {
    memset(out, 0, sizeof *out);
    if (n_threads < 1 || n_threads > BENCH_MAX_THREADS) return -1;
    /* Chunks are multiples of 4 KiB so every thread starts page-aligned. */
    size_t chunk = bytes / (size_t)n_threads / 4096 * 4096;
    if (chunk == 0) chunk = 4096;
    bytes = chunk * (size_t)n_threads;
    unsigned char *src = bench_alloc(bytes);
    unsigned char *dst = bench_alloc(bytes);
    membw_task *tasks = calloc((size_t)n_threads, sizeof *tasks);
    if (src == NULL || dst == NULL || tasks == NULL) {
        fprintf(stderr, "kvcache: bench: cannot allocate 2 x %zu bytes for the memcpy reference\n",
                bytes);
        bench_free(src);
        bench_free(dst);
        free(tasks);
        return -1;
    }
    for (size_t i = 0; i < bytes; i += 64) src[i] = (unsigned char)(i >> 6);
    for (int i = 0; i < n_threads; i++) {
        tasks[i].src = src + (size_t)i * chunk;
        tasks[i].dst = dst + (size_t)i * chunk;
        tasks[i].n = chunk;
    }
    double t_copy = membw_time(tasks, n_threads, budget_s);
    for (int i = 0; i < n_threads; i++) tasks[i].read_only = 1;
    double t_read = membw_time(tasks, n_threads, budget_s);
    uint64_t sum = bench_checksum(0, dst + bytes / 2, 4096);
    for (int i = 0; i < n_threads; i++) sum += tasks[i].sum;
    bench_sink(sum);
    bench_free(src);
    bench_free(dst);
    free(tasks);
    if (t_copy <= 0 || t_read <= 0) {
        fprintf(stderr, "kvcache: bench: cannot start %d threads for the memcpy reference\n",
                n_threads);
        return -1;
    }
    out->threads = n_threads;
    out->bytes = bytes;
    out->copy_gbs = 2.0 * (double)bytes / t_copy * 1e-9;
    out->read_gbs = (double)bytes / t_read * 1e-9;
    return 0;
}

/* ---- output ------------------------------------------------------------ */

void bench_json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}

void bench_print_machine(const bench_opts *o, const char *target, FILE *f) {
    char model[256];
    cli_cpu_model(model, (int)sizeof model);
    char date[64] = "?";
    time_t now = time(NULL);
    struct tm tmv;
    if (gmtime_r(&now, &tmv) != NULL) strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tmv);
    const char *isa = kvc_isa_name(kvc_get_isa());
    const char *best = kvc_isa_name(kvc_best_isa());
    if (o->json) {
        fprintf(f, "{\"type\":\"machine\",\"target\":");
        bench_json_str(f, target);
        fprintf(f, ",\"version\":");
        bench_json_str(f, kvc_version_string());
        fprintf(f, ",\"cpu\":");
        bench_json_str(f, model);
        fprintf(f, ",\"cpus\":%d,\"isa\":\"%s\",\"best_isa\":\"%s\",\"date\":\"%s\","
                   "\"quick\":%s}\n",
                cli_online_cpus(), isa, best, date, o->quick ? "true" : "false");
        return;
    }
    fprintf(f, "# kvcache %s bench %s%s\n", kvc_version_string(), target,
            o->quick ? " (--quick: smoke-test sizes, figures not meaningful)" : "");
    fprintf(f, "# cpu: %s, %d online CPUs\n", model, cli_online_cpus());
    fprintf(f, "# isa: %s (best supported: %s)\n", isa, best);
    fprintf(f, "# date: %s\n", date);
}
