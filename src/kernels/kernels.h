/*
 * Kernel table: one per ISA, selected at run time (dispatch.c). Kernels work
 * on whole rows (never per element) and dispatch on dtype inside, so callers
 * pay one indirect call per row run. Every ISA must produce bit-identical
 * results to the scalar reference (kernels_scalar.c): same rounding (nearest
 * even), true division for x/scale, float32 arithmetic only.
 */
#ifndef KVC_KERNELS_H
#define KVC_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kvcache/attention.h" /* KVC_ATTN_MAX_HEAD_DIM */
#include "kvcache/core.h"

/* Limits of one attn_decode call: head dimension (padded) and query heads. */
#define KVC_ATTN_MAX_DIM KVC_ATTN_MAX_HEAD_DIM
#define KVC_ATTN_MAX_G 16

/*
 * K/V rows of one KV head for attn_decode: n consecutive keys, key i at
 * k + i * k_stride bytes (likewise v), each row D elements of dt (F32, F16,
 * BF16, I8 or I4); for I8/I4 the row's D / group scales (ksd: F32 or F16) at
 * ks + i * ks_stride bytes (likewise vs, vsd).
 *
 * attn_decode(q, G, D, Dp, r, n, cap, sc, m, l, acc): q (G, Dp) float32
 * with zeros in [D, Dp), Dp a multiple of 16 <= KVC_ATTN_MAX_DIM, G <=
 * KVC_ATTN_MAX_G. Scores in base 2 are s * sc with s = q . k when cap == 0
 * (sc = sm_scale * log2 e > 0 and q unscaled, or sc = 1 and q carrying it),
 * else s = cap * tanh(q . k / cap) * log2 e and sc = 1 (q carries
 * sm_scale). The softmax takes the max of the raw s, then 2^(s * sc - m) in
 * one FMA: scores of large magnitude keep their differences (a q folded
 * with sm_scale * log2 e rounds each product at |s|'s scale). State per
 * head g: running max m[g] in base 2 (-inf initially), sum l[g] of
 * 2^(s * sc - m[g]) and acc (G, Dp) of those weights times v (tail zeros
 * kept).
 */
typedef struct kvc_attn_rows {
    const void *k, *v, *ks, *vs;
    int64_t k_stride, v_stride, ks_stride, vs_stride; /* bytes */
    kvc_dtype dt, ksd, vsd;
    int group;
    /* The next block's rows (same strides; NULL/0: none): SIMD kernels
     * prefetch them into L2 a few rows at a time while they work, so DRAM
     * reads overlap the arithmetic (one burst per call stalled the core). */
    const void *nk, *nv, *nks, *nvs;
    int64_t nn;
} kvc_attn_rows;

/*
 * Keys of one amx_run call (attn_amx.c): up to KVC_AMX_KEYS keys of one KV
 * head as runs of equally spaced rows (a run lies inside one page), with the
 * strides every run shares; `next` lists the keys of the call that runs next
 * (another head's rows, or the next keys), which the kernel prefetches into
 * L2 while it works. int8 rows (int4: packed, D / 2 bytes), scales of
 * ksd/vsd (F32 or F16), group elements per scale.
 */
#define KVC_AMX_MAX_DIM 256
#define KVC_AMX_KEYS 64
typedef struct kvc_amx_run {
    const void *k, *v, *ks, *vs;
    int n;
} kvc_amx_run;
typedef struct kvc_amx_keys {
    int64_t k_stride, v_stride, ks_stride, vs_stride; /* bytes */
    kvc_dtype ksd, vsd;
    int nrun, nnext;
    int pf_scales; /* 0: the next call's scale rows share this call's lines (not prefetched) */
    int pf_next;   /* 1: prefetch the rows of `next` */
    /* and/or whole token rows: for each run of `row`, the bytes
     * [k, k + n * k_stride) (likewise v, ks, vs) are prefetched, spread over
     * the call by lines (NHD caches whose token rows are contiguous) */
    int nrow;
    kvc_amx_run run[KVC_AMX_KEYS], next[KVC_AMX_KEYS], row[KVC_AMX_KEYS];
} kvc_amx_keys;

typedef struct kvc_kernels {
    kvc_isa isa;
    /* Copies n bytes (no overlap). A plain vector loop: glibc's memcpy takes
     * 2x longer for the 256 B - 4 KiB rows a cache moves on the machines we
     * measured (its rep-movsb path), and rows are what every operator moves. */
    void (*copy)(void *dst, const void *src, size_t n);
    /* n elements from src (sd) to dst (dd), both in {F32, F16, BF16}. */
    void (*convert)(const void *src, kvc_dtype sd, void *dst, kvc_dtype dd, int64_t n);
    /* 1 if |x_i| < limit for all n elements of x (F32/F16/BF16), else 0
     * (NaN fails). limit > 0; INFINITY: all finite. A quantized store
     * passes kvc__quant_limit. */
    int (*all_finite)(const void *x, kvc_dtype xd, int64_t n, float limit);
    /* n elements, n % g == 0 (g even for bits 4), x finite. q: int8 bytes, or
     * int4 packed (element 2i low nibble of byte i). scale: n/g of sd. */
    void (*quantize)(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *q,
                     void *scale, kvc_dtype sd);
    /* quantize for outputs too large to stay cached (a long prefill's
     * append): may use non-temporal stores (then fenced before returning),
     * which skip the read-for-ownership of every written line. Same bytes. */
    void (*quantize_stream)(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *q,
                            void *scale, kvc_dtype sd);
    /* quantize in two passes, for callers that must check the whole input
     * before writing anything (the paged append): quant_scales writes the
     * n/g scales quantize would store into `scale` and returns 1 if all of x
     * is below kvc__quant_limit(bits, sd) (0: some NaN/Inf, or a float16
     * scale that overflowed; `scale` then unspecified). quant_values
     * takes those scales (sin), copies them to `scale` and writes q; with
     * stream set it may use non-temporal stores (fenced before returning).
     * Together: the bytes of quantize. The check's read of x then does the
     * absmax work too, instead of a second pass doing it. SIMD fast paths:
     * F16/BF16 input with g == 8; other cases run the scalar reference. */
    int (*quant_scales)(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *scale,
                        kvc_dtype sd);
    void (*quant_values)(const void *x, kvc_dtype xd, int64_t n, int bits, int g,
                         const void *sin, void *q, void *scale, kvc_dtype sd, int stream);
    /* s[0..n) = cap * tanh(s / cap) * mul in place (vec_math.h): the soft
     * cap every attention kernel applies, exposed for tests. */
    void (*softcap)(float *s, int64_t n, float cap, float mul);
    /* x[0..n) = H x in place, H the normalized Sylvester Hadamard matrix of
     * order n (a power of two): float32 butterflies, stages h = 1, 2, 4, ...,
     * then each element times (float)(1 / sqrt(n)) (docs/KV_FORMATS.md
     * section 4). Every ISA does the same operations on the same operands, so
     * the bits are the same (V is rotated before it is stored). */
    void (*hadamard)(float *x, int32_t n);
    /* Inverse: y = (float)q * scale converted to yd. */
    void (*dequantize)(const void *q, int bits, const void *scale, kvc_dtype sd, int64_t n,
                       int g, void *y, kvc_dtype yd);
    /* dequantize over `rows` rows of n elements, row r at q + r * q_stride,
     * scale + r * s_stride and y + r * y_stride (bytes): one dispatch for a
     * strided run of rows (e.g. the heads of one token in a head-major
     * cache), where one call per 128-element row cost as much as the work. */
    void (*dequantize_rows)(const void *q, int64_t q_stride, int bits, const void *scale,
                            int64_t s_stride, kvc_dtype sd, int64_t rows, int64_t n, int g,
                            void *y, int64_t y_stride, kvc_dtype yd);
    /* Decode attention over n keys for G query heads sharing one KV head
     * (src/kernels/attn_body.h): continues the online-softmax state (m, l,
     * acc) of those heads. Unlike the kernels above, ISAs are not bitwise
     * identical here (float sums in vector order, polynomial exp2); each ISA
     * is deterministic and matches the scalar one to float32 rounding. */
    void (*attn_decode)(const float *q, int G, int D, int Dp, const struct kvc_attn_rows *r,
                        int64_t n, float cap, float sc, float *m, float *l, float *acc);
    /*
     * Decode over int8/int4 caches on AMX tiles (the "amx" table only;
     * NULL elsewhere; use when kvc__amx_decode_ok). A task calls
     * amx_tiles(1) on its thread, then per head set (one KV head, up to 4 of
     * its query heads): amx_begin with q (nh, Dp) float32, cap and sc as
     * attn_decode takes them, the cache's bits (8 or 4) and the query's
     * fixed-point bits (qbits: 16 for float16/bfloat16 queries, kept when
     * the set's heads have no outlier element, whose one score tile then
     * serves two quant groups of 16 or 32, and widened to 32 by a guard
     * when a key's scores could move the output by more than it allows; 32
     * for float32), a state of
     * amx_state_bytes (64-byte aligned), amx_run per call of up to 64
     * keys, amx_end for (m, l, acc) as attn_decode leaves them (acc (nh,
     * Dp)); then amx_tiles(0). Same numbers as attn_decode to float32
     * rounding with qbits 32, to the bound attention.h gives with 16
     * (attn_amx.c says how), deterministic for given calls.
     */
    void (*amx_tiles)(int on);
    size_t (*amx_state_bytes)(int D, int group);
    void (*amx_begin)(void *st, const float *q, int nh, int D, int Dp, int group, float cap,
                      float sc, int bits, int qbits);
    void (*amx_run)(void *st, const kvc_amx_keys *keys);
    void (*amx_end)(const void *st, float *m, float *l, float *acc, int Dp);
    /* copy with non-temporal stores on dst's 64-byte-aligned lines: they are
     * neither read first (for ownership) nor left in the caches, for outputs
     * a call writes past the cache's size (kvc__llc_bytes). Not fenced:
     * kvc__stream_fence() before another thread reads dst. scalar: copy. */
    void (*copy_stream)(void *dst, const void *src, size_t n);
} kvc_kernels;

/* Orders the calling thread's earlier non-temporal stores before its later
 * stores (sfence; x86-64's baseline SSE), e.g. the end of a parallel task. */
static inline void kvc__stream_fence(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_sfence();
#endif
}

/* Caches the AMX decode handles: int8 or int4 (unpacked to int8 in the
 * kernel), head dim a multiple of 64 up to KVC_AMX_MAX_DIM, quant group 16
 * or 32 or a multiple of 64 (groups never straddle the 64-element segments
 * the score tiles work on). */
static inline int kvc__amx_decode_ok(const kvc_kernels *k, kvc_dtype dt, int64_t D, int64_t group) {
    return k->amx_run != NULL && (dt == KVC_I8 || dt == KVC_I4) && D % 64 == 0 &&
           D <= KVC_AMX_MAX_DIM &&
           (group == 16 || group == 32 || (group >= 64 && group % 64 == 0));
}

/* Inputs whose quant_scales / quant_values have SIMD paths (other inputs
 * run the scalar reference there: quantize is the faster call for them). */
static inline int kvc__quant_split_fast(kvc_dtype xd, int g) {
    return g == 8 && (xd == KVC_F16 || xd == KVC_BF16);
}

/* Magnitude every input of a quantized store must stay below: finite
 * (SEMANTICS section 1) and, with float16 scales (a case SEMANTICS leaves
 * open, refused here like NaN), below 65520 * qmax, where absmax / qmax (a
 * float32 division) reaches 65520 and the scale would round to float16
 * infinity (dequantizing to NaN). 65520 * qmax is exact in float32 and the
 * smallest input that overflows: the float32 below it, divided by 127 or 7,
 * rounds to less than 65520 (test_quant checks both sides). */
static inline float kvc__quant_limit(int bits, kvc_dtype sd) {
    return sd == KVC_F16 ? 65520.0f * (bits == 8 ? 127.0f : 7.0f) : (float)INFINITY;
}

/* The error for n input elements x (xd) of a quantized store that failed
 * all_finite(..., kvc__quant_limit(bits, sd)): "<fn>: <what> has a NaN or
 * Inf value ..." or "... a value of magnitude >= <limit> ...". (quant.c) */
kvc_status kvc__quant_input_error(const char *fn, const char *what, const void *x, kvc_dtype xd,
                                  int64_t n, int bits, kvc_dtype sd);

/* The 16-bit pattern (F16 or BF16, sign cleared) of the smallest value >=
 * limit, at most the infinity pattern: |x| < limit iff x's magnitude bits
 * are below it. */
uint16_t kvc__limit_bits16(float limit, kvc_dtype xd);

/* The table for the current ISA (kvc_get_isa()). */
const kvc_kernels *kvc__kernels(void);
/* Last-level cache size in bytes (sysfs, else 32 MiB): calls that move
 * more than this use the *_stream kernels. */
int64_t kvc__llc_bytes(void);
/* Tests: pretend the last-level cache holds `bytes` (0: every quantized
 * append streams). Not thread-safe against running operators. */
void kvc__set_llc_bytes(int64_t bytes);

/* Per-ISA tables; the AVX ones are only called after the CPU check. */
const kvc_kernels *kvc__kernels_scalar(void);
const kvc_kernels *kvc__kernels_avx2(void);
const kvc_kernels *kvc__kernels_avx512(void);
/* The AVX-512 table plus the AMX decode; valid after kvc__amx_init() returned
 * 1 (it asks the OS for tile data permission; 0: AMX unusable). */
const kvc_kernels *kvc__kernels_amx(void);
int kvc__amx_init(void);

/* Elements [e0, D) of an int8/int4 row times their group scales, as float32
 * (the scalar path; SIMD row conversions use it for tails and odd groups). */
void kvc__dequant_row_tail(const void *src, kvc_dtype dt, const void *sc, kvc_dtype sd, int g,
                           int e0, int D, float *dst);

/* The scalar hadamard (SIMD tables use it for orders below a vector). */
void kvc__hadamard_ref(float *x, int32_t n);

/* Rounds a float32 scale to what a scale tensor of dtype sd stores. */
float kvc__scale_round(float s, kvc_dtype sd);

#endif
