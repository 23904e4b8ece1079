/*
 * The timing harness, the memory bandwidth reference and small output
 * helpers shared by every `kvcache bench` target (see bench.h).
 *
 * The bandwidth reference uses its own pthreads, not a kvc_threadpool: it is
 * what the machine can do with n threads, independent of the library.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../../src/core/internal.h"
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

int bench_timer_start(bench_timer *t, bench_fn fn, void *ctx, double sample_s) {
    memset(t, 0, sizeof *t);
    t->fn = fn;
    t->ctx = ctx;
    t->k = 1;
    /* Warm-up: the first call takes page faults and cold caches; the second
     * gives the per-call estimate used to size the samples. */
    int rc = fn(ctx);
    if (rc != 0) return rc;
    double t0 = bench_now();
    rc = fn(ctx);
    if (rc != 0) return rc;
    double est = bench_now() - t0;
    if (est < sample_s) {
        double kk = sample_s / (est > 1e-8 ? est : 1e-8);
        t->k = kk > 1e7 ? 10000000 : (int64_t)kk;
        if (t->k < 1) t->k = 1;
    }
    return 0;
}

int bench_timer_run(bench_timer *t, double seconds, int min_samples) {
    double start = bench_now();
    int taken = 0;
    while (t->n < BENCH_MAX_SAMPLES) {
        double s0 = bench_now();
        for (int64_t i = 0; i < t->k; i++) {
            int rc = t->fn(t->ctx);
            if (rc != 0) return rc;
        }
        double s1 = bench_now();
        t->samples[t->n++] = (s1 - s0) / (double)t->k;
        t->calls += t->k;
        taken++;
        if (taken >= min_samples && s1 - start >= seconds) break;
    }
    return 0;
}

void bench_timer_result(const bench_timer *t, bench_timing *out) {
    memset(out, 0, sizeof *out);
    if (t->n == 0) return;
    double v[BENCH_MAX_SAMPLES];
    memcpy(v, t->samples, (size_t)t->n * sizeof v[0]);
    qsort(v, (size_t)t->n, sizeof v[0], cmp_double);
    out->samples = t->n;
    out->calls = t->calls;
    out->min_s = v[0];
    out->median_s = median_sorted(v, t->n);
}

int bench_time(bench_fn fn, void *ctx, double budget_s, bench_timing *out) {
    /* A static timer keeps the 4 KiB sample array off the stack; the CLI is
     * single-threaded. */
    static bench_timer t;
    memset(out, 0, sizeof *out);
    int rc = bench_timer_start(&t, fn, ctx, budget_s / 16.0);
    if (rc == 0) rc = bench_timer_run(&t, budget_s, 3);
    if (rc == 0) bench_timer_result(&t, out);
    return rc;
}

/* ---- memory ------------------------------------------------------------ */

/* The cache manager's allocation (kvc__alloc_large: huge pages from 8 MiB
 * on), so that the benches' paged caches and memcpy/read references see the
 * TLB an engine on kvc_cache sees. */
void *bench_alloc(size_t bytes) {
    size_t align = (size_t)sysconf(_SC_PAGESIZE);
    if (align < 64) align = 64;
    void *p = kvc__alloc_large(bytes, align); /* 0 bytes: a valid block too */
    if (p) memset(p, 0, bytes);
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

void bench_poison(void *p, size_t bytes) {
    memset(p, 0xff, bytes);
}

int bench_output_finite(const void *p, size_t n, int dt) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) {
        if (dt == KVC_F32) {
            uint32_t w;
            memcpy(&w, c + 4 * i, 4);
            if ((w & 0x7f800000u) == 0x7f800000u) return 0;
        } else {
            uint16_t h;
            memcpy(&h, c + 2 * i, 2);
            const uint16_t e = dt == KVC_BF16 ? 0x7f80 : 0x7c00;
            if ((h & e) == e) return 0;
        }
    }
    return 1;
}

static volatile uint64_t g_sink;

void bench_flush(const char *target) {
    errno = 0;
    if (fflush(stdout) == 0 && !ferror(stdout)) return;
    fprintf(stderr, "kvcache: bench %s: cannot write the output: %s\n", target,
            errno ? strerror(errno) : "write error");
    exit(CLI_EXIT_FAIL);
}

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

struct bench_membw_ctx {
    unsigned char *src, *dst;
    size_t bytes;
    int n_threads;
    membw_task tasks[BENCH_MAX_THREADS];
};

/* Sum of n bytes as 64-bit words; independent accumulators let the compiler
 * vectorize and keep several loads in flight. */
static uint64_t sum_words(const unsigned char *p, size_t n) {
    const uint64_t *w = (const uint64_t *)(const void *)p; /* p is page-aligned */
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

int bench_membw_pass(void *ctx) {
    bench_membw_ctx *c = ctx;
    pthread_t tid[BENCH_MAX_THREADS];
    int n = c->n_threads, started = 1;
    for (; started < n; started++)
        if (pthread_create(&tid[started], NULL, membw_thread, &c->tasks[started]) != 0) break;
    membw_run(&c->tasks[0]);
    for (int i = 1; i < started; i++) pthread_join(tid[i], NULL);
    if (started < n) {
        fprintf(stderr, "kvcache: bench: cannot start %d threads for the memcpy reference\n", n);
        return 1;
    }
    uint64_t sum = 0;
    for (int i = 0; i < n; i++) sum += c->tasks[i].sum;
    bench_sink(sum ^ c->dst[c->bytes / 2]);
    return 0;
}

bench_membw_ctx *bench_membw_create(size_t bytes) {
    bench_membw_ctx *c = calloc(1, sizeof *c);
    if (c != NULL) {
        c->bytes = bytes;
        c->src = bench_alloc(bytes);
        c->dst = bench_alloc(bytes);
    }
    if (c == NULL || c->src == NULL || c->dst == NULL) {
        fprintf(stderr, "kvcache: bench: cannot allocate 2 x %zu bytes for the memcpy reference\n",
                bytes);
        bench_membw_destroy(c);
        return NULL;
    }
    for (size_t i = 0; i < bytes; i += 64) c->src[i] = (unsigned char)(i >> 6);
    return c;
}

void bench_membw_destroy(bench_membw_ctx *c) {
    if (c == NULL) return;
    bench_free(c->src);
    bench_free(c->dst);
    free(c);
}

size_t bench_membw_prepare(bench_membw_ctx *c, int n_threads, int read_only) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > BENCH_MAX_THREADS) n_threads = BENCH_MAX_THREADS;
    /* Chunks are multiples of 4 KiB so every thread starts page-aligned. */
    size_t chunk = c->bytes / (size_t)n_threads / 4096 * 4096;
    if (chunk == 0) chunk = c->bytes / (size_t)n_threads;
    c->n_threads = n_threads;
    for (int i = 0; i < n_threads; i++) {
        membw_task *t = &c->tasks[i];
        t->src = c->src + (size_t)i * chunk;
        t->dst = c->dst + (size_t)i * chunk;
        t->n = chunk;
        t->read_only = read_only;
        t->sum = 0;
    }
    return chunk * (size_t)n_threads;
}

int bench_membw_measure(bench_membw_ctx *c, int n_threads, double budget_s, int with_read,
                        bench_membw *out) {
    memset(out, 0, sizeof *out);
    bench_timing tm;
    size_t bytes = bench_membw_prepare(c, n_threads, 0);
    if (bench_time(bench_membw_pass, c, budget_s, &tm) != 0) return -1;
    out->threads = c->n_threads;
    out->bytes = bytes;
    out->copy_gbs = 2.0 * (double)bytes / tm.median_s * 1e-9;
    if (with_read) {
        bench_membw_prepare(c, n_threads, 1);
        if (bench_time(bench_membw_pass, c, budget_s, &tm) != 0) return -1;
        out->read_gbs = (double)bytes / tm.median_s * 1e-9;
    }
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
    char model[256], family[32], cpumodel[32];
    cli_cpu_model(model, (int)sizeof model);
    cli_cpuinfo("cpu family", family, (int)sizeof family);
    cli_cpuinfo("model", cpumodel, (int)sizeof cpumodel);
    char date[64] = "?";
    time_t now = time(NULL);
    struct tm tmv;
    if (gmtime_r(&now, &tmv) != NULL) strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tmv);
    char load[64] = "?";
    FILE *lf = fopen("/proc/loadavg", "r");
    if (lf != NULL) {
        double l1, l5, l15;
        if (fscanf(lf, "%lf %lf %lf", &l1, &l5, &l15) == 3)
            snprintf(load, sizeof load, "%.2f %.2f %.2f", l1, l5, l15);
        fclose(lf);
    }
    const char *isa = kvc_isa_name(kvc_get_isa());
    const char *best = kvc_isa_name(kvc_best_isa());
    if (o->json) {
        fprintf(f, "{\"type\":\"machine\",\"target\":");
        bench_json_str(f, target);
        fprintf(f, ",\"version\":");
        bench_json_str(f, kvc_version_string());
        fprintf(f, ",\"cpu\":");
        bench_json_str(f, model);
        fprintf(f, ",\"cpu_family\":");
        bench_json_str(f, family);
        fprintf(f, ",\"cpu_model\":");
        bench_json_str(f, cpumodel);
        fprintf(f, ",\"cpus\":%d,\"isa\":\"%s\",\"best_isa\":\"%s\",\"date\":\"%s\","
                   "\"loadavg\":\"%s\",\"quick\":%s}\n",
                cli_online_cpus(), isa, best, date, load, o->quick ? "true" : "false");
        return;
    }
    fprintf(f, "# kvcache %s bench %s%s\n", kvc_version_string(), target,
            o->quick ? " (--quick: smoke-test sizes, figures not meaningful)" : "");
    fprintf(f, "# cpu: %s (family %s, model %s), %d online CPUs\n", model,
            family[0] ? family : "?", cpumodel[0] ? cpumodel : "?", cli_online_cpus());
    fprintf(f, "# isa: %s (best supported: %s)\n", isa, best);
    fprintf(f, "# date: %s, load average %s\n", date, load);
}

#define BENCH_ROUNDS 4

int bench_time_interleaved(bench_fn fn, void *ctx, double op_s, bench_membw_ctx *mb,
                           double membw_s, int n_threads, bench_timing *op,
                           double *memcpy_gbs) {
    /* static: two sample arrays of a few KiB; the CLI is single-threaded */
    static bench_timer t_op, t_mc;
    if (bench_timer_start(&t_op, fn, ctx, op_s / 16.0) != 0) return 1;
    if (bench_timer_start(&t_mc, bench_membw_pass, mb, membw_s / 8.0) != 0) return -1;
    for (int round = 0; round < BENCH_ROUNDS; round++) {
        if (bench_timer_run(&t_mc, membw_s / BENCH_ROUNDS, 1) != 0) return -1;
        if (bench_timer_run(&t_op, op_s / BENCH_ROUNDS, 2) != 0) return 1;
    }
    bench_timing mc;
    bench_timer_result(&t_op, op);
    bench_timer_result(&t_mc, &mc);
    *memcpy_gbs = 2.0 * (double)bench_membw_prepare(mb, n_threads, 0) / mc.median_s * 1e-9;
    return 0;
}

uint64_t bench_mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* ---- size guard -------------------------------------------------------- */

size_t bench_mem_limit(const bench_opts *o) {
    return o->quick ? BENCH_QUICK_MEM_LIMIT : BENCH_MEM_LIMIT;
}

static int refuse(const char *cmd, int quick, double need, const char *opts) {
    fprintf(stderr, "kvcache: %s: these sizes need about %.4g GiB per case, over the limit "
            "of %s; lower %s\n", cmd, need / (1 << 30), quick ? "256 MiB with --quick" : "6 GiB",
            opts);
    return CLI_EXIT_USAGE;
}

int bench_refuse_size(const bench_opts *o, const char *target, double need, const char *opts) {
    char cmd[64];
    snprintf(cmd, sizeof cmd, "bench %s", target);
    return refuse(cmd, o->quick, need, opts);
}

int bench_check_serve_size(const char *cmd, int quick, double need, const char *opts) {
    if (quick) return bench_check_size(cmd, quick, need, opts);
    /* a real model's cases scale with it (an 8B model at batch 16 x 4096
     * needs ~8 GiB): the limit is the machine's, not the kernels' 6 GiB */
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0) return bench_check_size(cmd, quick, need, opts);
    const double limit = 0.8 * (double)pages * (double)page;
    if (need <= limit) return 0;
    fprintf(stderr, "kvcache: %s: these sizes need about %.4g GiB per case, over 80%% of this "
            "machine's memory (%.4g GiB); lower %s\n", cmd, need / (1 << 30),
            (double)pages * (double)page / (1 << 30), opts);
    return CLI_EXIT_USAGE;
}

int bench_check_size(const char *cmd, int quick, double need, const char *opts) {
    const size_t limit = quick ? BENCH_QUICK_MEM_LIMIT : BENCH_MEM_LIMIT;
    return need > (double)limit ? refuse(cmd, quick, need, opts) : 0;
}
