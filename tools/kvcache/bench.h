/*
 * Benchmark harness of `kvcache bench` (STYLE 3.5, modelled on zstd benchfn):
 * warm-up, loop counts auto-scaled to a time budget, median and min time per
 * call, a checksum of outputs against dead-code elimination, and a memory
 * bandwidth reference (memcpy and plain read) measured in the same run with
 * the same number of threads, so operator bandwidth can be given as a
 * fraction of what the machine can move.
 */
#ifndef KVCACHE_TOOLS_BENCH_H
#define KVCACHE_TOOLS_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define BENCH_MAX_THREAD_COUNTS 16
#define BENCH_MAX_THREADS 256

/* Cache storage dtypes benchmarked (bit set). */
#define BENCH_CACHE_F16 1u
#define BENCH_CACHE_INT8 2u
#define BENCH_CACHE_INT4 4u
#define BENCH_CACHE_ALL 7u

/* pmx operators benchmarked (bit set). */
#define BENCH_OP_STATIC 1u
#define BENCH_OP_DYNAMIC 2u
#define BENCH_OP_ALL 3u

typedef struct bench_opts {
    int threads[BENCH_MAX_THREAD_COUNTS]; /* thread counts, each run in turn */
    int n_thread_counts;
    int64_t batch, kvlen, heads, head_dim; /* 0: the target's default */
    double time_s;   /* time budget per case, seconds */
    size_t membw_bytes; /* memcpy reference buffer size */
    int quick;       /* tiny sizes, short budget: a smoke test */
    int json;        /* one JSON object per line instead of a table */
    unsigned caches; /* BENCH_CACHE_* */
    unsigned ops;    /* BENCH_OP_* */
} bench_opts;

/* ---- timing ------------------------------------------------------------ */

/* Seconds from CLOCK_MONOTONIC. */
double bench_now(void);

/* One call of the code under test; returns 0 on success, non-zero on failure
 * (the harness stops and returns that value). */
typedef int (*bench_fn)(void *ctx);

typedef struct bench_timing {
    double median_s; /* median seconds per call over the samples */
    double min_s;    /* fastest sample, seconds per call */
    int64_t calls;   /* timed calls in all (warm-up excluded) */
    int samples;
} bench_timing;

/* Warms up (2 calls), then times samples of k calls each, k chosen so that a
 * sample lasts about budget_s / 16, until budget_s has passed (at least 3
 * samples, at most 256). Returns 0, or the first non-zero value of fn. */
int bench_time(bench_fn fn, void *ctx, double budget_s, bench_timing *out);

/* ---- memory bandwidth reference ---------------------------------------- */

typedef struct bench_membw {
    int threads;
    size_t bytes;    /* bytes copied per memcpy call (all threads together) */
    double copy_gbs; /* 2 * bytes / time: read + write, 1e9 bytes/s */
    double read_gbs; /* bytes / time of a vectorizable sum over the buffer */
} bench_membw;

/* Measures memcpy of `bytes` split over n_threads pthreads (the calling
 * thread included), and a plain read (sum) of the same buffer. 0 on success,
 * -1 if memory or threads could not be had (message on stderr). */
int bench_membw_measure(int n_threads, size_t bytes, double budget_s, bench_membw *out);

/* ---- memory ------------------------------------------------------------ */

/* Page-aligned allocation with every page touched (zeroed), so that page
 * faults are not timed. NULL on failure. Free with bench_free. */
void *bench_alloc(size_t bytes);
void bench_free(void *p);

/* Folds `bytes` bytes at p into the running hash h (order dependent). */
uint64_t bench_checksum(uint64_t h, const void *p, size_t bytes);

/* Keeps a value alive so the compiler cannot drop the work behind it. */
void bench_sink(uint64_t v);

/* ---- output ------------------------------------------------------------ */

/* Writes s as a JSON string literal (with quotes). */
void bench_json_str(FILE *f, const char *s);

/* The machine header: '# key: value' lines, or one JSON "machine" object. */
void bench_print_machine(const bench_opts *o, const char *target, FILE *f);

/* ---- targets ----------------------------------------------------------- */

/* `kvcache bench pmx`: returns a CLI exit status. */
int bench_pmx(const bench_opts *o);

#endif
