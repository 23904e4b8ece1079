/*
 * `kvcache bench gemm`: the model runtime's matrix products (src/model/
 * gemm.h) on SmolLM2-135M's shapes (rows x cols of W): 576x576 (attention
 * q/o), 192x576 (k/v), 1536x576 (ffn gate/up), 576x1536 (ffn down), and the
 * 49152x576 Q8_0 output head, plus 2048x2048 (a 1B model's attention q/o);
 * weights Q4_1, Q8_0, F16, Q5_0, Q5_1, IQ4_NL, the K-quants Q4_K, Q5_K, Q6_K, Q2_K, Q3_K and
 * IQ4_XS (these on the shapes whose cols is a multiple of their 256-element super-block:
 * 576x1536 and 2048x2048; --quick: 576x576, 192x576 and 576x1536).
 *
 * n = 1 (decode at batch 1) is a weight stream: the case cycles through
 * copies of W spanning far more than the last-level cache, so every call
 * reads W from DRAM as a real decode step does. Reported: GB/s of weight
 * bytes and the ratio to a plain vectorized read of a large buffer with the
 * same thread count, interleaved with the case (bench_util.c).
 *
 * n = 16, 128 (batched decode, prefill) is compute: GOP/s (2 rows cols n /
 * time) and the ratio to the peak of the instruction the kernel is built on,
 * measured in the same run with the same thread count: with int16
 * activations (the default, column act "i16") vpdpwssd zmm (32
 * multiply-adds) for the AVX-512 VNNI kernels, vpmaddwd ymm (16) for the
 * AVX2 kernels (which also need a vpaddd per vpmaddwd, so their ratio stays
 * well below 1); with int8 activations ("i8", kvc__gemm_set_act_bits(8))
 * vpdpbusd zmm (64) and vpmaddubsw ymm (32); vfmadd ymm/zmm (8/16) for the
 * float kernels (act "-"); a chain of dependent instructions per
 * accumulator, enough accumulators to cover the latency. Scalar kernels have
 * no peak (ratio "-"). Quantized weight types run every case with int16 and
 * then int8 activations, on adjacent lines.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BG_X86 1
#endif

#include "../../src/model/gemm.h"
#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"

#define GM_MAX_N 128 /* rows of X and Y: n of the largest case (a prefill chunk) */

/* ---- instruction peaks ----------------------------------------------------------- */

/* Loop trips per call per thread (16 instructions, ~3 ms at 1 << 20): a pass
 * must dwarf starting its threads (4096 gave 2 threads a seventh of 1 thread's
 * peak, 65536 1.3x). --quick runs 1 << 14: its figures are not meaningful, and
 * a sanitizer build takes tens of times as long per trip (at 1 << 20 the
 * quick run took 106 s of its test's 120 under ASan at -O0, 14 s at 1 << 14). */
static int peak_iters = 1 << 20;

typedef enum peak_kind {
    PEAK_NONE,
    PEAK_VNNI512,   /* vpdpbusd zmm */
    PEAK_VNNIW512,  /* vpdpwssd zmm */
    PEAK_MADDUBS256,
    PEAK_MADDWD256,
    PEAK_FMA512,
    PEAK_FMA256
} peak_kind;

#ifdef BG_X86
/* 16 chains of dependent vpdpbusd: 64 u8 x s8 multiply-adds each. */
__attribute__((target("avx512f,avx512vnni"))) static uint64_t peak_vnni512(void) {
    __m512i a[16];
    const __m512i x = _mm512_set1_epi8(1), y = _mm512_set1_epi8(-1);
    for (int k = 0; k < 16; k++) a[k] = _mm512_set1_epi32(k);
    for (int it = 0; it < peak_iters; it++)
        for (int k = 0; k < 16; k++) a[k] = _mm512_dpbusd_epi32(a[k], x, y);
    __m512i s = a[0];
    for (int k = 1; k < 16; k++) s = _mm512_xor_si512(s, a[k]);
    return (uint64_t)_mm512_reduce_add_epi32(s);
}

/* 16 chains of dependent vpdpwssd: 32 s16 x s16 multiply-adds each. */
__attribute__((target("avx512f,avx512vnni"))) static uint64_t peak_vnniw512(void) {
    __m512i a[16];
    const __m512i x = _mm512_set1_epi16(1), y = _mm512_set1_epi16(-1);
    for (int k = 0; k < 16; k++) a[k] = _mm512_set1_epi32(k);
    for (int it = 0; it < peak_iters; it++)
        for (int k = 0; k < 16; k++) a[k] = _mm512_dpwssd_epi32(a[k], x, y);
    __m512i s = a[0];
    for (int k = 1; k < 16; k++) s = _mm512_xor_si512(s, a[k]);
    return (uint64_t)_mm512_reduce_add_epi32(s);
}

/* 12 chains of dependent vpmaddwd ymm: 16 s16 x s16 products (+ pair sums). */
__attribute__((target("avx2"))) static uint64_t peak_maddwd256(void) {
    __m256i a[12];
    const __m256i y = _mm256_set1_epi16(1);
    for (int k = 0; k < 12; k++) a[k] = _mm256_set1_epi32(k);
    for (int it = 0; it < peak_iters; it++)
        for (int k = 0; k < 12; k++) a[k] = _mm256_madd_epi16(a[k], y);
    __m256i s = a[0];
    for (int k = 1; k < 12; k++) s = _mm256_xor_si256(s, a[k]);
    return (uint64_t)_mm256_extract_epi64(s, 0);
}

/* 12 chains of dependent vpmaddubsw ymm: 32 u8 x s8 products (+ pair sums). */
__attribute__((target("avx2"))) static uint64_t peak_maddubs256(void) {
    __m256i a[12];
    const __m256i y = _mm256_set1_epi8(3);
    for (int k = 0; k < 12; k++) a[k] = _mm256_set1_epi16((short)k);
    for (int it = 0; it < peak_iters; it++)
        for (int k = 0; k < 12; k++) a[k] = _mm256_maddubs_epi16(a[k], y);
    __m256i s = a[0];
    for (int k = 1; k < 12; k++) s = _mm256_xor_si256(s, a[k]);
    return (uint64_t)_mm256_extract_epi64(s, 0);
}

/* 16 chains of dependent FMAs (zmm: 16 lanes, ymm: 8). */
__attribute__((target("avx512f"))) static uint64_t peak_fma512(void) {
    __m512 a[16];
    const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-3f);
    for (int k = 0; k < 16; k++) a[k] = _mm512_set1_ps((float)k);
    for (int it = 0; it < peak_iters; it++)
        for (int k = 0; k < 16; k++) a[k] = _mm512_fmadd_ps(a[k], x, y);
    __m512 s = a[0];
    for (int k = 1; k < 16; k++) s = _mm512_add_ps(s, a[k]);
    return (uint64_t)_mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) static uint64_t peak_fma256(void) {
    __m256 a[12];
    const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-3f);
    for (int k = 0; k < 12; k++) a[k] = _mm256_set1_ps((float)k);
    for (int it = 0; it < peak_iters; it++)
        for (int k = 0; k < 12; k++) a[k] = _mm256_fmadd_ps(a[k], x, y);
    __m256 s = a[0];
    for (int k = 1; k < 12; k++) s = _mm256_add_ps(s, a[k]);
    float v[8];
    _mm256_storeu_ps(v, s);
    return (uint64_t)v[0];
}
#endif

/* Operations (multiply-add = 2) of one peak call on one thread. */
static double peak_ops(peak_kind k) {
    switch (k) {
    case PEAK_VNNI512: return 2.0 * 64 * 16 * (double)peak_iters;
    case PEAK_VNNIW512: return 2.0 * 32 * 16 * (double)peak_iters;
    case PEAK_MADDUBS256: return 2.0 * 32 * 12 * (double)peak_iters;
    case PEAK_MADDWD256: return 2.0 * 16 * 12 * (double)peak_iters;
    case PEAK_FMA512: return 2.0 * 16 * 16 * (double)peak_iters;
    case PEAK_FMA256: return 2.0 * 8 * 12 * (double)peak_iters;
    default: return 0;
    }
}

static const char *peak_name(peak_kind k) {
    switch (k) {
    case PEAK_VNNI512: return "vpdpbusd-zmm";
    case PEAK_VNNIW512: return "vpdpwssd-zmm";
    case PEAK_MADDUBS256: return "vpmaddubsw-ymm";
    case PEAK_MADDWD256: return "vpmaddwd-ymm";
    case PEAK_FMA512: return "vfmadd-zmm";
    case PEAK_FMA256: return "vfmadd-ymm";
    default: return "-";
    }
}

static uint64_t peak_once(peak_kind k) {
#ifdef BG_X86
    switch (k) {
    case PEAK_VNNI512: return peak_vnni512();
    case PEAK_VNNIW512: return peak_vnniw512();
    case PEAK_MADDUBS256: return peak_maddubs256();
    case PEAK_MADDWD256: return peak_maddwd256();
    case PEAK_FMA512: return peak_fma512();
    case PEAK_FMA256: return peak_fma256();
    default: break;
    }
#endif
    (void)k;
    return 0;
}

typedef struct peak_ctx {
    peak_kind kind;
    int n_threads;
} peak_ctx;

static void *peak_thread(void *arg) {
    bench_sink(peak_once(((peak_ctx *)arg)->kind));
    return NULL;
}

/* One peak call on every thread at once (the calling thread included). */
static int peak_pass(void *ctx) {
    peak_ctx *c = ctx;
    pthread_t tid[BENCH_MAX_THREADS];
    int started = 1;
    for (; started < c->n_threads; started++)
        if (pthread_create(&tid[started], NULL, peak_thread, c) != 0) break;
    bench_sink(peak_once(c->kind));
    for (int i = 1; i < started; i++) pthread_join(tid[i], NULL);
    return started < c->n_threads;
}

/* GOP/s of the peak loop with nt threads; 0 if none applies. */
static double measure_peak(peak_kind k, int nt, double budget) {
    if (k == PEAK_NONE) return 0;
    peak_ctx c = {k, nt};
    bench_timing tm;
    if (bench_time(peak_pass, &c, budget, &tm) != 0) return 0;
    return peak_ops(k) * nt / tm.median_s * 1e-9;
}

/* The instruction kernel set `kernel` is built on for weight type wt with
 * bits-wide activations (bits 0: float weights). */
static peak_kind peak_for(const char *kernel, int32_t wt, int bits) {
    const int quant = wt != KVC_GGML_F16 && wt != KVC_GGML_F32 && wt != KVC_GGML_BF16;
    if (strcmp(kernel, "avx512-vnni") == 0) return bits == 16 ? PEAK_VNNIW512 : PEAK_VNNI512;
    if (strcmp(kernel, "avx512") == 0) return PEAK_FMA512;
    if (strcmp(kernel, "avx2") == 0)
        return !quant ? PEAK_FMA256 : bits == 16 ? PEAK_MADDWD256 : PEAK_MADDUBS256;
    return PEAK_NONE;
}

/* ---- cases ----------------------------------------------------------------------- */

typedef struct gm_shape {
    int64_t rows, cols;
    const char *what;
} gm_shape;

typedef struct gm_case {
    int32_t wt;
    int64_t rows, cols, n, wbytes;
    uint8_t *w;     /* copies of W, wbytes apart */
    int64_t copies, next;
    float *x, *y;
    kvc_threadpool *pool;
    kvc_status st;
} gm_case;

static int gm_call(void *ctx) {
    gm_case *c = ctx;
    const uint8_t *w = c->w + c->next * c->wbytes;
    c->next = c->next + 1 < c->copies ? c->next + 1 : 0;
    c->st = kvc__gemm(c->wt, w, c->rows, c->cols, c->x, c->cols, c->n, c->y, c->rows, c->pool);
    return c->st != KVC_OK;
}

/* Random weights with float16 scales of a realistic size (0.002..0.02 for
 * 32-element blocks; K-quant super-block scales, multiplied by 6-bit or int8
 * sub-block scales, 10 to 100 times smaller). */
static void fill_w(int32_t wt, uint8_t *w, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 8) {
        const uint64_t r = bench_mix64((uint64_t)i);
        memcpy(w + i, &r, bytes - i < 8 ? (size_t)(bytes - i) : 8);
    }
    const int kq = kvc_ggml_block_size(wt) == 256;
    const int64_t bb = kvc_ggml_block_bytes(wt);
    /* where d sits: Q6_K, Q3_K, Q2_K put it after the codes */
    const int64_t d_at = wt == KVC_GGML_Q6_K ? 208 : wt == KVC_GGML_Q3_K ? 108
                       : wt == KVC_GGML_Q2_K ? 80 : 0;
    const int has_m = wt == KVC_GGML_Q4_1 || wt == KVC_GGML_Q5_1 || wt == KVC_GGML_Q4_K ||
                      wt == KVC_GGML_Q5_K || wt == KVC_GGML_Q2_K;
    for (int64_t b = 0; b + bb <= bytes; b += bb) {
        const uint64_t r = bench_mix64((uint64_t)b * 7 + 1);
        const float dv = 0.002f + 0.018f * (float)(r & 1023) / 1024.0f;
        uint16_t d = kvc_f32_to_f16(kq ? dv * 0.02f : dv);
        memcpy(w + b + d_at, &d, 2);
        if (has_m) { /* Q4_1/Q5_1 m (an offset), K-quant dmin (subtracted) */
            const float mv = 0.05f * (float)((r >> 10) & 1023) / 1024.0f;
            d = kvc_f32_to_f16(kq ? mv * 0.02f : -mv);
            memcpy(w + b + d_at + 2, &d, 2);
        }
    }
}

/* Operator and the plain-read reference, interleaved in rounds. */
static int time_with_read(gm_case *c, double op_s, bench_membw_ctx *mb, double ref_s, int nt,
                          bench_timing *op, double *read_gbs) {
    static bench_timer t_op, t_rd;
    const size_t bytes = bench_membw_prepare(mb, nt, 1);
    if (bench_timer_start(&t_op, gm_call, c, op_s / 16.0) != 0) return 1;
    if (bench_timer_start(&t_rd, bench_membw_pass, mb, ref_s / 8.0) != 0) return -1;
    for (int round = 0; round < 4; round++) {
        if (bench_timer_run(&t_rd, ref_s / 4, 1) != 0) return -1;
        if (bench_timer_run(&t_op, op_s / 4, 2) != 0) return 1;
    }
    bench_timing rd;
    bench_timer_result(&t_op, op);
    bench_timer_result(&t_rd, &rd);
    *read_gbs = (double)bytes / rd.median_s * 1e-9;
    return 0;
}

static const char *type_name(int32_t wt) { return kvc_ggml_type_name(wt); }

int bench_gemm(const bench_opts *o) {
    static const gm_shape shapes_full[] = {{576, 576, "attn q/o"},   {192, 576, "attn k/v"},
                                           {1536, 576, "ffn gate/up"}, {576, 1536, "ffn down"},
                                           {49152, 576, "output"},   {2048, 2048, "1B q/o"}};
    static const gm_shape shapes_quick[] = {
        {576, 576, "attn q/o"}, {192, 576, "attn k/v"}, {576, 1536, "ffn down"}};
    static const int32_t types[] = {KVC_GGML_Q4_1, KVC_GGML_Q8_0, KVC_GGML_F16,   KVC_GGML_Q5_0,
                                    KVC_GGML_Q5_1, KVC_GGML_IQ4_NL, KVC_GGML_Q4_K, KVC_GGML_Q5_K,
                                    KVC_GGML_Q6_K, KVC_GGML_Q2_K,   KVC_GGML_Q3_K, KVC_GGML_IQ4_XS};
    const int n_types = (int)(sizeof types / sizeof types[0]);
    static const int64_t ns_full[] = {1, 16, 128}, ns_quick[] = {1, 16};
    const gm_shape *shapes = o->quick ? shapes_quick : shapes_full;
    const int n_shapes = o->quick ? 3 : 6, n_ns = o->quick ? 2 : 3;
    const int64_t *ns = o->quick ? ns_quick : ns_full;
    /* X and Y hold 128 rows: a larger --batch was cut to 128 unsaid */
    if (o->batch > GM_MAX_N) {
        fprintf(stderr, "kvcache: bench gemm: --batch %lld: at most %d (the rows n of X)\n",
                (long long)o->batch, GM_MAX_N);
        return CLI_EXIT_USAGE;
    }
    int64_t one_n = o->batch;
    int n_ns_used = one_n ? 1 : n_ns;
    if (one_n) ns = &one_n;
    /* bytes of W copies for n = 1: well past the last-level cache */
    const int64_t stream_bytes = (int64_t)(o->quick ? 8 : 256) << 20;
    const double ref_budget = o->quick ? 0.005 : 0.1, peak_budget = o->quick ? 0.005 : 0.1;
    peak_iters = o->quick ? 1 << 14 : 1 << 20;

    bench_print_machine(o, "gemm", stdout);
    if (!o->json)
        printf("# kvc__gemm Y(n, rows) = X(n, cols) W(rows, cols)^T, %.2f s per case; n = 1: "
               "GB/s of weight bytes (W cycled over %lld MiB of copies) vs a plain read, same "
               "threads, interleaved; n > 1: GOP/s (2 rows cols n) vs the same-run peak of the "
               "kernel's instruction, same threads; act: activation integers of the quantized "
               "types (i16 default, i8 kvc__gemm_set_act_bits(8))\n",
               o->time_s, (long long)(stream_bytes >> 20));
    bench_membw_ctx *mb = bench_membw_create(o->membw_bytes);
    if (!mb) return CLI_EXIT_FAIL;
    if (!o->json)
        printf("%-4s %-3s %-12s %-11s %4s %3s %-12s %10s %9s %9s %6s  %s\n", "type", "act",
               "shape", "what", "n", "thr", "kernel", "us/call", "rate", "bound", "ratio", "unit");
    int cases = 0, failed = 0;
    for (int ti = 0; ti < o->n_thread_counts; ti++) {
        const int nt = o->threads[ti];
        kvc_threadpool *pool = NULL;
        if (kvc_threadpool_create(nt, &pool) != KVC_OK) {
            fprintf(stderr, "kvcache: bench gemm: %s\n", kvc_last_error());
            failed++;
            continue;
        }
        for (int si = 0; si < n_shapes; si++)
            for (int wi = 0; wi < n_types; wi++) {
                const gm_shape s = shapes[si];
                const int32_t wt = types[wi];
                if (s.rows == 49152 && wt != KVC_GGML_Q8_0) continue; /* the head is Q8_0 */
                if (s.cols % kvc_ggml_block_size(wt) != 0) continue; /* K-quants: 256 */
                gm_case c;
                memset(&c, 0, sizeof c);
                c.wt = wt;
                c.rows = s.rows;
                c.cols = s.cols;
                c.pool = pool;
                c.wbytes = s.rows * kvc__ggml_row_bytes(wt, s.cols);
                c.copies = (stream_bytes + c.wbytes - 1) / c.wbytes;
                c.w = bench_alloc((size_t)(c.copies * c.wbytes));
                c.x = bench_alloc((size_t)(GM_MAX_N * s.cols) * sizeof(float));
                c.y = bench_alloc((size_t)(GM_MAX_N * s.rows) * sizeof(float));
                if (!c.w || !c.x || !c.y) {
                    fprintf(stderr, "kvcache: bench gemm: out of memory\n");
                    bench_free(c.w);
                    bench_free(c.x);
                    bench_free(c.y);
                    kvc_threadpool_destroy(pool);
                    bench_membw_destroy(mb);
                    return CLI_EXIT_FAIL;
                }
                fill_w(wt, c.w, c.wbytes);
                for (int64_t k = 1; k < c.copies; k++) memcpy(c.w + k * c.wbytes, c.w, (size_t)c.wbytes);
                for (int64_t k = 0; k < GM_MAX_N * s.cols; k++)
                    c.x[k] = (float)((double)(bench_mix64((uint64_t)k + 5) >> 11) * 0x1p-53 - 0.5);
                const char *kernel = kvc__gemm_kernel_name(wt);
                const int quant = wt != KVC_GGML_F16;
                static const int bits_q[] = {16, 8}, bits_f[] = {0};
                const int *bits_l = quant ? bits_q : bits_f, n_bits = quant ? 2 : 1;
                for (int ni = 0; ni < n_ns_used; ni++)
                    for (int bi = 0; bi < n_bits; bi++) {
                        const int bits = bits_l[bi];
                        if (bits) kvc__gemm_set_act_bits(bits);
                        const peak_kind pk = peak_for(kernel, wt, bits);
                        c.n = ns[ni];
                        c.next = 0;
                        const int64_t saved_copies = c.copies;
                        if (c.n > 1) c.copies = 1; /* compute-bound: W stays in cache */
                        bench_timing tm;
                        double bound = 0;
                        int rc;
                        cases++;
                        bench_poison(c.y, (size_t)(c.n * c.rows) * sizeof(float));
                        if (c.n == 1) {
                            rc = time_with_read(&c, o->time_s, mb, ref_budget, nt, &tm, &bound);
                        } else {
                            bound = measure_peak(pk, nt, peak_budget);
                            rc = bench_time(gm_call, &c, o->time_s, &tm);
                            const double b2 = measure_peak(pk, nt, peak_budget);
                            bound = b2 > bound ? b2 : bound;
                        }
                        c.copies = saved_copies;
                        kvc__gemm_set_act_bits(16);
                        if (rc != 0) {
                            fprintf(stderr, "kvcache: bench gemm: %s\n",
                                    rc > 0 ? kvc_last_error() : "reference failed");
                            failed++;
                            continue;
                        }
                        if (!bench_output_finite(c.y, (size_t)(c.n * c.rows), KVC_F32)) {
                            fprintf(stderr, "kvcache: bench gemm: output not written (or not "
                                    "finite)\n");
                            failed++;
                            continue;
                        }
                        bench_sink(bench_checksum(0, c.y, (size_t)(c.n * c.rows) * sizeof(float)));
                        const double rate =
                            c.n == 1 ? (double)c.wbytes / tm.median_s * 1e-9
                                     : 2.0 * (double)(c.rows * c.cols * c.n) / tm.median_s * 1e-9;
                        const double ratio = bound > 0 ? rate / bound : 0;
                        const char *unit = c.n == 1 ? "GB/s (plain read)" : "GOP/s";
                        const char *act = bits == 16 ? "i16" : bits == 8 ? "i8" : "-";
                        char shape[32];
                        snprintf(shape, sizeof shape, "%lldx%lld", (long long)s.rows,
                                 (long long)s.cols);
                        if (o->json) {
                            printf("{\"type\":\"case\",\"target\":\"gemm\",\"wtype\":\"%s\","
                                   "\"act_bits\":%d,\"rows\":%lld,\"cols\":%lld,\"n\":%lld,"
                                   "\"threads\":%d,\"kernel\":\"%s\",\"us\":%.3f,\"us_min\":%.3f,"
                                   "\"%s\":%.3f,\"bound\":%.3f,\"bound_kind\":\"%s\","
                                   "\"ratio\":%.4f}\n",
                                   type_name(wt), bits, (long long)s.rows, (long long)s.cols,
                                   (long long)c.n, nt, kernel, tm.median_s * 1e6,
                                   tm.min_s * 1e6, c.n == 1 ? "gbs" : "gops", rate, bound,
                                   c.n == 1 ? "read" : peak_name(pk), ratio);
                        } else {
                            char rs[16] = "-";
                            if (bound > 0) snprintf(rs, sizeof rs, "%.3f", ratio);
                            printf("%-4s %-3s %-12s %-11s %4lld %3d %-12s %10.1f %9.2f %9.2f "
                                   "%6s  %s%s%s\n",
                                   type_name(wt), act, shape, s.what, (long long)c.n, nt, kernel,
                                   tm.median_s * 1e6, rate, bound, rs, unit,
                                   c.n == 1 ? "" : " vs ", c.n == 1 ? "" : peak_name(pk));
                        }
                        bench_flush("gemm");
                    }
                bench_free(c.w);
                bench_free(c.x);
                bench_free(c.y);
            }
        kvc_threadpool_destroy(pool);
    }
    bench_membw_destroy(mb);
    if (o->json)
        printf("{\"type\":\"summary\",\"cases\":%d,\"failed\":%d}\n", cases, failed);
    else
        printf("# %d cases, %d failed\n", cases, failed);
    return failed ? CLI_EXIT_FAIL : CLI_EXIT_OK;
}
