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
/* compressed paged formats (kvfmt.h): `bench attention` only */
#define BENCH_CACHE_KIVI8 8u
#define BENCH_CACHE_KIVI4 16u
#define BENCH_CACHE_KIVI (BENCH_CACHE_KIVI8 | BENCH_CACHE_KIVI4)

/* pmx operators benchmarked (bit set). */
#define BENCH_OP_STATIC 1u
#define BENCH_OP_DYNAMIC 2u
#define BENCH_OP_ALL 3u

#define BENCH_GROUP_ROW (-1)

typedef struct bench_opts {
    int threads[BENCH_MAX_THREAD_COUNTS]; /* thread counts, each run in turn */
    int n_thread_counts;
    int64_t batch, kvlen, heads, head_dim; /* 0: the target's default */
    int64_t group;   /* int8/int4 quant group (attention, kernel; 0: the target's
                      * default; BENCH_GROUP_ROW: Dh, one scale per head row) */
    int64_t layers;  /* attention: caches the calls rotate over (0: 1) */
    double soft_cap; /* attention: logits_soft_cap of the calls (0: none) */
    double time_s;   /* time budget per case, seconds */
    size_t membw_bytes; /* memcpy reference buffer size */
    int quick;       /* tiny sizes, short budget: a smoke test */
    int json;        /* one JSON object per line instead of a table */
    unsigned caches; /* BENCH_CACHE_* */
    unsigned ops;    /* BENCH_OP_* */
    unsigned layouts; /* bit l: cache_layout l (pmx); attention: bit 0 NHD, bit 1 HND */
    unsigned modes;   /* bit m: cache_mode m (pmx dynamic: 0 offset, 1 paged) */
} bench_opts;

/* ---- size guard -------------------------------------------------------- */

/* The most bytes one case of any target may take: 6 GiB, or 256 MiB under
 * --quick. A smoke test must stay quick whatever sizes come with it: a
 * 5 GiB case takes minutes to fill and time (--quick's own sizes need a few
 * MiB). */
#define BENCH_MEM_LIMIT ((size_t)6 << 30)
#define BENCH_QUICK_MEM_LIMIT ((size_t)256 << 20)
size_t bench_mem_limit(const bench_opts *o);
/* The one answer of every target to options whose largest case needs more
 * (need bytes, in double: the options' product can pass int64): "kvcache:
 * bench TARGET: these sizes need about X GiB per case, over the limit of
 * 6 GiB (256 MiB with --quick); lower OPTS" on stderr, before any case runs;
 * returns CLI_EXIT_USAGE. */
int bench_refuse_size(const bench_opts *o, const char *target, double need, const char *opts);
/* The same guard for a command with options of its own (bench store,
 * bench-serve): "kvcache: CMD: these sizes need about ..." against the limit
 * bench_mem_limit gives for quick; CLI_EXIT_USAGE if need passes it, else 0. */
int bench_check_size(const char *cmd, int quick, double need, const char *opts);
/* bench-serve's: 80% of the machine's physical memory (256 MiB with --quick). */
int bench_check_serve_size(const char *cmd, int quick, double need, const char *opts);

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

#define BENCH_MAX_SAMPLES 512

/* Samples of one piece of code, collectable in several rounds so that two
 * timers can be interleaved (operator and memcpy then see the same machine
 * conditions on a shared, noisy box). */
typedef struct bench_timer {
    bench_fn fn;
    void *ctx;
    int64_t k; /* calls per sample */
    int64_t calls;
    int n;     /* samples taken */
    double samples[BENCH_MAX_SAMPLES]; /* seconds per call */
} bench_timer;

/* Warms up (2 calls) and picks the calls per sample so that a sample lasts
 * about sample_s. Returns 0, or the first non-zero value of fn. */
int bench_timer_start(bench_timer *t, bench_fn fn, void *ctx, double sample_s);

/* Takes samples until seconds have passed and at least min_samples were
 * taken in this round (or the sample array is full). 0 or fn's failure. */
int bench_timer_run(bench_timer *t, double seconds, int min_samples);

/* Median and minimum of the samples so far. */
void bench_timer_result(const bench_timer *t, bench_timing *out);

/* Start + one round of budget_s (at least 3 samples) + result. */
int bench_time(bench_fn fn, void *ctx, double budget_s, bench_timing *out);

/* ---- memory bandwidth reference ---------------------------------------- */

typedef struct bench_membw {
    int threads;
    size_t bytes;    /* bytes copied per memcpy call (all threads together) */
    double copy_gbs; /* 2 * bytes / time: read + write, 1e9 bytes/s */
    double read_gbs; /* bytes / time of a vectorizable sum over the buffer; 0
                      * when not measured */
} bench_membw;

/* Source and destination buffers of the reference, allocated once per run so
 * the reference can be taken again next to every case. */
typedef struct bench_membw_ctx bench_membw_ctx;

/* Allocates and touches 2 x bytes; NULL (message on stderr) on failure. */
bench_membw_ctx *bench_membw_create(size_t bytes);
void bench_membw_destroy(bench_membw_ctx *ctx); /* NULL is a no-op */

/* Sets what bench_membw_pass does: memcpy of the buffer (read_only 0) or a
 * vectorizable sum of it (read_only 1), split over n_threads pthreads, the
 * calling thread included. Returns the bytes copied or read per pass. */
size_t bench_membw_prepare(bench_membw_ctx *ctx, int n_threads, int read_only);

/* One pass, as a bench_fn (ctx is the bench_membw_ctx); non-zero if a thread
 * could not be started. */
int bench_membw_pass(void *ctx);

/* Copy (and, with_read, read) bandwidth with n_threads: median of passes for
 * about budget_s each. 0, or -1 with a message on stderr. */
int bench_membw_measure(bench_membw_ctx *ctx, int n_threads, double budget_s, int with_read,
                        bench_membw *out);

/*
 * Times op (fn, ctx) and the memcpy reference (mb, prepared for n_threads) in
 * alternating rounds, so that both see the same machine conditions: the box
 * is shared and its bandwidth drifts during a run. op_s / membw_s: time
 * budgets. Returns 0, 1 if the operator failed, -1 if the reference did
 * (message printed); fills the operator's timing and the reference's GB/s
 * (read + write).
 */
int bench_time_interleaved(bench_fn fn, void *ctx, double op_s, bench_membw_ctx *mb,
                           double membw_s, int n_threads, bench_timing *op,
                           double *memcpy_gbs);

/* ---- memory ------------------------------------------------------------ */

/* Page-aligned allocation with every page touched (zeroed), so that page
 * faults are not timed; from 8 MiB on on huge pages where the kernel grants
 * them, as the cache manager's pool (bench_util.c). NULL on failure. Free
 * with bench_free. */
void *bench_alloc(size_t bytes);
void bench_free(void *p);

/* Folds `bytes` bytes at p into the running hash h (order dependent). */
uint64_t bench_checksum(uint64_t h, const void *p, size_t bytes);

/* An operator's output is poisoned before it is timed (all-ones bytes: NaN
 * in float32, float16 and bfloat16) and checked afterwards: a call that
 * returns KVC_OK without writing its output fails the case rather than
 * being timed as fast. bench_output_finite: 1 if all n elements of dtype dt
 * (KVC_F32/F16/BF16) are finite. */
void bench_poison(void *p, size_t bytes);
int bench_output_finite(const void *p, size_t n, int dt);

/* splitmix64 finaliser: deterministic pseudo-random values for test data. */
uint64_t bench_mix64(uint64_t x);

/* Keeps a value alive so the compiler cannot drop the work behind it. */
void bench_sink(uint64_t v);

/* ---- output ------------------------------------------------------------ */

/* Flushes a case's line to stdout. When it cannot be written (a full disk,
 * a reader gone: SIGPIPE is ignored) says so on stderr and exits with
 * CLI_EXIT_FAIL: the remaining cases would run for no one, and a benchmark
 * holds nothing outside the process to close (bench store reports once its
 * stores are closed). */
void bench_flush(const char *target);

/* Writes s as a JSON string literal (with quotes). */
void bench_json_str(FILE *f, const char *s);

/* The machine header: '# key: value' lines, or one JSON "machine" object. */
void bench_print_machine(const bench_opts *o, const char *target, FILE *f);

/* ---- FMA peak (bench_fma.c) -------------------------------------------- */

/* Every thread (the caller's included) runs independent chains of the
 * current kernel ISA's widest float FMA; a pass's FLOPs (2 per lane FMA,
 * all threads) land in flops, so flops / seconds per pass is the peak. */
typedef struct bench_fma {
    int threads;
    double flops;
    float sink[BENCH_MAX_THREADS];
} bench_fma;

void bench_fma_prepare(bench_fma *f, int n_threads);
/* One pass (a bench_fn): non-zero if a thread could not be started. */
int bench_fma_pass(void *ctx);

/* ---- targets ----------------------------------------------------------- */

/* `kvcache bench pmx`: returns a CLI exit status. */
int bench_pmx(const bench_opts *o);

/* `kvcache bench append` (paged appends, decode- and prefill-like): returns
 * a CLI exit status. */
int bench_append(const bench_opts *o);

/* `kvcache bench cache` (cache manager bookkeeping, trace memory use):
 * returns a CLI exit status. */
int bench_cache(const bench_opts *o);

/* `kvcache bench attention` (kvc_decode_run per layer, K/V read bandwidth
 * vs a plain read): returns a CLI exit status. */
int bench_attention(const bench_opts *o);

/* `kvcache bench prefill` (prefill attention GFLOP/s vs a same-run FMA peak). */
int bench_prefill(const bench_opts *o);

/* `kvcache bench mla` (MLA decode over ckv/kpe pages). */
int bench_mla(const bench_opts *o);

/* `kvcache bench gemm` (model weight-type matrix products). */
int bench_gemm(const bench_opts *o);

/* `kvcache bench kernel` (decode kernels alone, against the float16 kernel). */
int bench_kernel(const bench_opts *o);

/* `kvcache bench store` (bench_store.c): its own options, argv[1] == "store". */
int bench_store(int argc, char **argv);

#endif
