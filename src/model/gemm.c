/*
 * Matrix products of the model runtime (gemm.h): argument checks, the ggml
 * type table, row dequantization (embedding lookups), activation
 * quantization, kernel selection and the split of output rows over the
 * thread pool.
 *
 * Work split: tasks of (GEMM_CHUNK rows of W) x (GEMM_XBLOCK rows of X),
 * one kvc__parallel_for task each, W chunk outer; a task computes every
 * Y[i][r] of its block. Block sizes never depend on the thread count, and
 * kernels compute each Y element with a fixed operation sequence
 * (gemm_kernels.h), so results are bitwise independent of the pool and of n.
 * Activations of the integer paths are quantized once per call (tasks of
 * GEMM_XQ_CHUNK rows, int16 or int8 by kvc__gemm_set_act_bits, read once
 * per call) into scratch: on the stack for decode-sized calls, else one
 * aligned heap block.
 *
 * Kernel choice: the ISA of kvc_get_isa(). The AVX-512 integer kernels need
 * AVX512_VNNI (cpuid leaf 7, ECX bit 11); without it the AVX2 integer
 * kernels run instead (the AVX-512 float kernels stay).
 */
#define _POSIX_C_SOURCE 200809L
#include "gemm.h"

#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "../kernels/gemm_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define GEMM_X86 1
#endif

/* Output rows per task: a 16-row weight tile of a 1536-column Q4_1 matrix
 * is 15 KiB (stays in L1 while activation rows stream past it). */
#define GEMM_CHUNK 16
/* Activation rows per task: 16 quantized rows of 1536 columns are 33 KiB
 * (int8) or 57 KiB (int16), L1 / L2; a task runs them against its
 * GEMM_CHUNK weight rows, 4 rows (at most 15 KiB) at a time. */
#define GEMM_XBLOCK 16
/* Activation rows quantized per task. */
#define GEMM_XQ_CHUNK 16
/* Scratch up to this size lives on the stack (decode: n = 1). */
#define GEMM_STACK_XQ 8192

/* ---- type table ------------------------------------------------------------ */

typedef struct gemm_type {
    int32_t type;
    const char *name;
    int64_t block;  /* elements per block */
    int64_t bytes;  /* bytes per block */
    int gemm;       /* 1 if kvc__gemm supports it */
} gemm_type;

/* Block layouts (ggml): see gguf.h and src/gguf/dequant.c. */
static const gemm_type g_types[] = {
    {KVC_GGML_F32, "F32", 1, 4, 1},      {KVC_GGML_F16, "F16", 1, 2, 1},
    {KVC_GGML_BF16, "BF16", 1, 2, 1},    {KVC_GGML_Q8_0, "Q8_0", 32, 34, 1},
    {KVC_GGML_Q4_0, "Q4_0", 32, 18, 1},  {KVC_GGML_Q4_1, "Q4_1", 32, 20, 1},
    {KVC_GGML_Q5_0, "Q5_0", 32, 22, 1},  {KVC_GGML_Q5_1, "Q5_1", 32, 24, 1},
    {KVC_GGML_IQ4_NL, "IQ4_NL", 32, 18, 1},
    {KVC_GGML_Q4_K, "Q4_K", 256, 144, 1}, {KVC_GGML_Q5_K, "Q5_K", 256, 176, 1},
    {KVC_GGML_Q6_K, "Q6_K", 256, 210, 1}, {KVC_GGML_Q2_K, "Q2_K", 256, 84, 1},
    {KVC_GGML_Q3_K, "Q3_K", 256, 110, 1}, {KVC_GGML_IQ4_XS, "IQ4_XS", 256, 136, 1},
};

/* K-quants (and IQ4_XS): 256-element super-blocks of 32-element sub-blocks
 * (16 for the scales of Q2_K, Q3_K, Q6_K), their own kernels
 * (gemm_kernels.h). */
static int is_kquant(int32_t t) {
    return t == KVC_GGML_Q2_K || t == KVC_GGML_Q3_K || t == KVC_GGML_Q4_K ||
           t == KVC_GGML_Q5_K || t == KVC_GGML_Q6_K || t == KVC_GGML_IQ4_XS;
}

static const gemm_type *find_type(int32_t t) {
    for (size_t i = 0; i < sizeof g_types / sizeof g_types[0]; i++)
        if (g_types[i].type == t) return &g_types[i];
    return NULL;
}

int kvc__gemm_supported(int32_t wt) {
    const gemm_type *t = find_type(wt);
    return t != NULL && t->gemm;
}

int64_t kvc__ggml_row_bytes(int32_t wt, int64_t cols) {
    const gemm_type *t = find_type(wt);
    if (t == NULL || cols < 0 || cols % t->block != 0) return 0;
    if (cols / t->block > INT64_MAX / t->bytes) return 0;
    return cols / t->block * t->bytes;
}

/* ---- row dequantization ----------------------------------------------------- */

kvc_status kvc__ggml_dequant_row(int32_t t, const void *src, int64_t n, float *dst) {
    return kvc_ggml_dequantize(t, src, n, dst);
}

/* ---- activation quantization (layout: gemm_kernels.h) ------------------------- */

/* round half to even for |v| < 2^22: adding 1.5 * 2^23 leaves no fraction
 * bits, so the float addition itself rounds (default rounding mode). */
static float rne(float v) { return (v + 0x1.8p23f) - 0x1.8p23f; }

void kvc__gemm_quantize_x(const float *x, int64_t cols, int L, int bits, void *xq) {
    const int64_t nb = cols / KVC_GEMM_QK, G = 4 * (int64_t)L;
    const int64_t groups = (nb + G - 1) / G, qbytes = kvc__gemm_group_qbytes(L, bits);
    const float qmax = bits == 16 ? 32767.0f : 127.0f;
    uint8_t *base = xq;
    memset(base, 0, (size_t)(groups * kvc__gemm_group_bytes(L, bits)));
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *grp = base + b / G * kvc__gemm_group_bytes(L, bits);
        const int bi = (int)(b % G), j = bi / L, k = bi % L, p = 4 * k + j;
        const float *xb = x + b * KVC_GEMM_QK;
        float amax = 0.0f;
        int bad = 0;
        for (int e = 0; e < KVC_GEMM_QK; e++) {
            const float a = fabsf(xb[e]); /* andps: a sign branch would mispredict */
            amax = a > amax ? a : amax;
            bad |= !(a <= FLT_MAX);
        }
        int32_t q[KVC_GEMM_QK] = {0};
        float d = 0.0f;
        int32_t qsum = 0;
        if (bad) {
            /* NaN/Inf activations (a broken model): a NaN scale makes the
             * products NaN, as a float product would, instead of converting
             * NaN to an integer (undefined) and computing on garbage */
            d = NAN;
        } else if (amax >= 0x1p-120f) {
            d = amax / qmax;
            const float id = qmax / amax;
            for (int e = 0; e < KVC_GEMM_QK; e++) {
                q[e] = (int32_t)rne(xb[e] * id);
                qsum += q[e];
            }
        }
        if (bits == 8) {
            int8_t *q8 = (int8_t *)(void *)grp;
            for (int e = 0; e < 16; e++) {
                q8[(j * 2 + 0) * 16 * L + 16 * k + e] = (int8_t)q[e];
                q8[(j * 2 + 1) * 16 * L + 16 * k + e] = (int8_t)q[e + 16];
            }
        } else {
            int16_t q16[KVC_GEMM_QK];
            for (int e = 0; e < KVC_GEMM_QK; e++) q16[e] = (int16_t)q[e];
            if (L == 1) {
                memcpy(grp + 64 * j, q16, sizeof q16);
            } else {
                /* part s: elements 16 (s / 2) + 2 i + s % 2, i < 8 */
                for (int s = 0; s < 4; s++) {
                    int16_t part[8];
                    for (int i = 0; i < 8; i++) part[i] = q16[16 * (s / 2) + 2 * i + s % 2];
                    memcpy(grp + ((4 * j + s) * L + k) * 16, part, sizeof part);
                }
            }
        }
        const float sx = d * (float)qsum;
        int32_t qsum0 = 0;
        for (int e = 0; e < KVC_GEMM_QK / 2; e++) qsum0 += q[e];
        memcpy(grp + qbytes + 4 * p, &d, 4);
        memcpy(grp + qbytes + 16 * L + 4 * p, &qsum, 4);
        memcpy(grp + qbytes + 32 * L + 4 * p, &sx, 4);
        memcpy(grp + qbytes + 48 * L + 4 * p, &qsum0, 4);
    }
}

/* ---- kernel selection --------------------------------------------------------- */

static int detect_vnni(void) {
#ifdef GEMM_X86
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    (void)a, (void)b, (void)d;
    return (c >> 11) & 1; /* AVX512_VNNI */
#else
    return 0;
#endif
}

/* cpuid once: in a VM it traps to the hypervisor (microseconds a call). */
static int cpu_has_vnni(void) {
    static atomic_int cached = -1;
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        v = detect_vnni();
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v;
}

static atomic_int g_no_vnni; /* test hook: 1 = behave as if VNNI were absent */

void kvc__gemm_set_no_vnni(int on) { atomic_store(&g_no_vnni, on != 0); }

static atomic_int g_act_bits = 16; /* activation integer width, 8 or 16 */

kvc_status kvc__gemm_set_act_bits(int bits) {
    KVC_CHECK(bits == 8 || bits == 16, "gemm: activation bits %d (8 or 16)", bits);
    atomic_store(&g_act_bits, bits);
    return KVC_OK;
}

int kvc__gemm_act_bits(void) { return atomic_load(&g_act_bits); }

typedef struct gemm_sel {
    const kvc__gemm_kernels *f; /* float kernels */
    const kvc__gemm_kernels *q; /* integer kernels */
} gemm_sel;

static gemm_sel select_kernels(void) {
    gemm_sel s = {kvc__gemm_kernels_scalar(), kvc__gemm_kernels_scalar()};
#ifdef GEMM_X86
    const kvc_isa isa = kvc_get_isa();
    if (isa >= KVC_ISA_AVX512) { /* amx: the AVX-512 kernels (no AMX GEMM yet) */
        s.f = kvc__gemm_kernels_avx512();
        s.q = cpu_has_vnni() && !atomic_load(&g_no_vnni) ? s.f : kvc__gemm_kernels_avx2();
    } else if (isa == KVC_ISA_AVX2) {
        s.f = s.q = kvc__gemm_kernels_avx2();
    }
#endif
    return s;
}

const char *kvc__gemm_kernel_name(int32_t wt) {
    const gemm_sel s = select_kernels();
    const gemm_type *t = find_type(wt);
    return t != NULL && t->block > 1 ? s.q->name_q : s.f->name_f;
}

/* ---- the product --------------------------------------------------------------- */

typedef struct gemm_ctx {
    const kvc__gemm_kernels *k;
    kvc__gemm_q_fn gemm_q; /* the kernel of the activation width */
    int32_t wt;
    int quant, bits;
    const uint8_t *W;
    int64_t row_bytes, rows, cols;
    const float *X;
    int64_t ldx, n;
    uint8_t *xq;
    int64_t xq_stride;
    float *Y;
    int64_t ldy;
} gemm_ctx;

static void quantize_task(void *p, int64_t t) {
    const gemm_ctx *c = p;
    const int64_t i1 = (t + 1) * GEMM_XQ_CHUNK < c->n ? (t + 1) * GEMM_XQ_CHUNK : c->n;
    for (int64_t i = t * GEMM_XQ_CHUNK; i < i1; i++)
        kvc__gemm_quantize_x(c->X + i * c->ldx, c->cols, c->k->lanes, c->bits,
                             c->xq + i * c->xq_stride);
}

/* Task t: W rows [r0, r0 + GEMM_CHUNK) x X rows [i0, i0 + GEMM_XBLOCK). */
static void gemm_task(void *p, int64_t t) {
    const gemm_ctx *c = p;
    const int64_t n_xb = (c->n + GEMM_XBLOCK - 1) / GEMM_XBLOCK;
    const int64_t r0 = t / n_xb * GEMM_CHUNK, i0 = t % n_xb * GEMM_XBLOCK;
    const int64_t r1 = r0 + GEMM_CHUNK < c->rows ? r0 + GEMM_CHUNK : c->rows;
    const int64_t ni = i0 + GEMM_XBLOCK < c->n ? GEMM_XBLOCK : c->n - i0;
    if (c->quant)
        c->gemm_q(c->wt, c->W, c->row_bytes, r0, r1, c->cols / KVC_GEMM_QK,
                  c->xq + i0 * c->xq_stride, c->xq_stride, ni, c->Y + i0 * c->ldy, c->ldy);
    else
        c->k->gemm_f(c->wt, c->W, c->row_bytes, r0, r1, c->cols, c->X + i0 * c->ldx, c->ldx, ni,
                     c->Y + i0 * c->ldy, c->ldy);
}

kvc_status kvc__gemm(int32_t wt, const void *W, int64_t rows, int64_t cols, const float *X,
                     int64_t ldx, int64_t n, float *Y, int64_t ldy, kvc_threadpool *pool) {
    const gemm_type *ty = find_type(wt);
    KVC_CHECK(ty != NULL && ty->gemm, "gemm: weight type %d (%s) is not supported", (int)wt,
              ty ? ty->name : "unknown");
    KVC_CHECK(rows >= 0 && cols >= 0 && n >= 0, "gemm: negative shape rows %lld cols %lld n %lld",
              (long long)rows, (long long)cols, (long long)n);
    KVC_CHECK(cols % ty->block == 0, "gemm: cols %lld is not a multiple of the %s block (%lld)",
              (long long)cols, ty->name, (long long)ty->block);
    KVC_CHECK(ldx >= cols && ldy >= rows, "gemm: ldx %lld < cols %lld or ldy %lld < rows %lld",
              (long long)ldx, (long long)cols, (long long)ldy, (long long)rows);
    if (n == 0 || rows == 0) return KVC_OK;
    KVC_CHECK(W != NULL && X != NULL && Y != NULL, "gemm: NULL %s",
              W == NULL ? "W" : X == NULL ? "X" : "Y");
    const int64_t row_bytes = kvc__ggml_row_bytes(wt, cols);
    KVC_CHECK(cols == 0 || (row_bytes > 0 && rows <= INT64_MAX / row_bytes),
              "gemm: W of %lld x %lld %s is too large", (long long)rows, (long long)cols,
              ty->name);
    if (cols == 0) {
        for (int64_t i = 0; i < n; i++) memset(Y + i * ldy, 0, (size_t)rows * sizeof *Y);
        return KVC_OK;
    }
    const gemm_sel sel = select_kernels();
    gemm_ctx c = {.wt = wt, .quant = ty->block > 1, .W = W, .row_bytes = row_bytes,
                  .rows = rows, .cols = cols, .X = X, .ldx = ldx, .n = n, .Y = Y, .ldy = ldy};
    c.k = c.quant ? sel.q : sel.f;
    c.bits = atomic_load(&g_act_bits); /* once: every task of the call agrees */
    if (is_kquant(wt))
        c.gemm_q = c.bits == 16 ? c.k->gemm_kq16 : c.k->gemm_kq8;
    else
        c.gemm_q = c.bits == 16 ? c.k->gemm_q16 : c.k->gemm_q8;
    _Alignas(64) uint8_t stack_xq[GEMM_STACK_XQ];
    void *heap = NULL;
    if (c.quant) {
        c.xq_stride = kvc__gemm_xq_row_bytes(cols, c.k->lanes, c.bits);
        KVC_CHECK(n <= INT64_MAX / 2 / c.xq_stride, "gemm: n %lld too large", (long long)n);
        const size_t need = (size_t)(n * c.xq_stride);
        if (need <= sizeof stack_xq) {
            c.xq = stack_xq;
        } else {
            /* the pool's scratch (kept between calls; kvc__gemm_scratch_bytes
             * tells a caller how much to reserve so that this cannot fail) */
            heap = kvc__scratch_get(pool, need);
            if (heap == NULL)
                return kvc__error(KVC_ERR_NOMEM, "gemm: cannot allocate %zu bytes of scratch",
                                  need);
            c.xq = heap;
        }
        kvc__parallel_for(pool, (n + GEMM_XQ_CHUNK - 1) / GEMM_XQ_CHUNK, quantize_task, &c);
    }
    kvc__parallel_for(pool,
                      (rows + GEMM_CHUNK - 1) / GEMM_CHUNK * ((n + GEMM_XBLOCK - 1) / GEMM_XBLOCK),
                      gemm_task, &c);
    if (heap) kvc__scratch_release(pool, heap);
    return KVC_OK;
}

size_t kvc__gemm_scratch_bytes(int32_t wt, int64_t cols, int64_t n) {
    const gemm_type *ty = find_type(wt);
    if (ty == NULL || !ty->gemm || ty->block == 1 || cols <= 0 || n <= 0) return 0;
    const gemm_sel sel = select_kernels();
    const int64_t stride = kvc__gemm_xq_row_bytes(cols, sel.q->lanes, atomic_load(&g_act_bits));
    if (stride <= 0 || n > INT64_MAX / 2 / stride) return 0; /* kvc__gemm refuses it */
    const size_t need = (size_t)(n * stride);
    return need <= GEMM_STACK_XQ ? 0 : need;
}
