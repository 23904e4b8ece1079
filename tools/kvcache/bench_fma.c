/*
 * FMA peak measured in the same run as a compute-bound operator (bench.h):
 * every thread runs BENCH_FMA_CHAINS independent chains of the current
 * kernel ISA's widest float FMA (the scalar ISA: separate multiply and add,
 * as its kernels do), so the operator's GFLOP/s can be given as a fraction
 * of what the cores can do with the same ISA and thread count.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>

#include "bench.h"
#include "kvcache/kvcache.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FMA_X86 1
#endif

#define BENCH_FMA_CHAINS 12  /* > FMA latency x FMA ports on current cores */
#define BENCH_FMA_ITERS 2097152 /* per thread and pass (~3.5 ms at 2.4 GFMA/s/lane): with
                                  * 131072 (~0.2 ms) starting the threads cost
                                  * two threads ~25% of their peak */

/* Each runs one thread's loop and returns its FLOPs (2 per lane FMA); the
 * chains' sum goes to *sink (x * 0.999999 + tiny stays finite). */
#ifdef FMA_X86
__attribute__((target("avx512f"))) static double fma_avx512(float seed, float *sink) {
    __m512 acc[BENCH_FMA_CHAINS];
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(seed * 1e-7f);
    for (int i = 0; i < BENCH_FMA_CHAINS; i++) acc[i] = _mm512_set1_ps(seed + (float)i);
    for (int it = 0; it < BENCH_FMA_ITERS; it++)
#pragma GCC unroll 16 /* chains in registers at any -O level */
        for (int i = 0; i < BENCH_FMA_CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    __m512 s = acc[0];
    for (int i = 1; i < BENCH_FMA_CHAINS; i++) s = _mm512_add_ps(s, acc[i]);
    *sink = _mm512_reduce_add_ps(s);
    return 2.0 * 16 * BENCH_FMA_CHAINS * (double)BENCH_FMA_ITERS;
}

__attribute__((target("avx2,fma"))) static double fma_avx2(float seed, float *sink) {
    __m256 acc[BENCH_FMA_CHAINS];
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(seed * 1e-7f);
    for (int i = 0; i < BENCH_FMA_CHAINS; i++) acc[i] = _mm256_set1_ps(seed + (float)i);
    for (int it = 0; it < BENCH_FMA_ITERS; it++)
#pragma GCC unroll 16
        for (int i = 0; i < BENCH_FMA_CHAINS; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    __m256 s = acc[0];
    for (int i = 1; i < BENCH_FMA_CHAINS; i++) s = _mm256_add_ps(s, acc[i]);
    float t[8];
    _mm256_storeu_ps(t, s);
    *sink = t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
    return 2.0 * 8 * BENCH_FMA_CHAINS * (double)BENCH_FMA_ITERS;
}
#endif

static double fma_scalar(float seed, float *sink) {
    float acc[BENCH_FMA_CHAINS];
    const float a = 0.999999f, b = seed * 1e-7f;
    for (int i = 0; i < BENCH_FMA_CHAINS; i++) acc[i] = seed + (float)i;
    for (int it = 0; it < BENCH_FMA_ITERS; it++)
#pragma GCC unroll 16
        for (int i = 0; i < BENCH_FMA_CHAINS; i++) acc[i] = acc[i] * a + b;
    float s = 0;
    for (int i = 0; i < BENCH_FMA_CHAINS; i++) s += acc[i];
    *sink = s;
    return 2.0 * BENCH_FMA_CHAINS * (double)BENCH_FMA_ITERS;
}

static double fma_once(float seed, float *sink) {
#ifdef FMA_X86
    switch (kvc_get_isa()) {
    case KVC_ISA_AMX: /* its float work is AVX-512 */
    case KVC_ISA_AVX512: return fma_avx512(seed, sink);
    case KVC_ISA_AVX2: return fma_avx2(seed, sink);
    default: break;
    }
#endif
    return fma_scalar(seed, sink);
}

typedef struct fma_arg {
    bench_fma *f;
    int i;
} fma_arg;

static void *fma_thread(void *p) {
    fma_arg *a = p;
    fma_once(1.0f + (float)a->i, &a->f->sink[a->i]);
    return NULL;
}

void bench_fma_prepare(bench_fma *f, int n_threads) {
    f->threads = n_threads < 1 ? 1 : n_threads > BENCH_MAX_THREADS ? BENCH_MAX_THREADS : n_threads;
    f->flops = 0; /* set by each pass (FLOPs of one pass, all threads) */
}

int bench_fma_pass(void *ctx) {
    bench_fma *f = ctx;
    pthread_t tid[BENCH_MAX_THREADS];
    fma_arg args[BENCH_MAX_THREADS];
    int started = 1;
    for (; started < f->threads; started++) {
        args[started].f = f;
        args[started].i = started;
        if (pthread_create(&tid[started], NULL, fma_thread, &args[started]) != 0) break;
    }
    f->flops = fma_once(1.0f, &f->sink[0]) * f->threads;
    for (int i = 1; i < started; i++) pthread_join(tid[i], NULL);
    float s = 0;
    for (int i = 0; i < started; i++) s += f->sink[i];
    bench_sink((uint64_t)(int64_t)s);
    return started == f->threads ? 0 : 1;
}
