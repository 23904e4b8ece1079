/*
 * kvfmt attention kernel (kvfmt_kernels.h), AVX-512 F/BW/VL/DQ/VNNI + FMA +
 * F16C: 16 float32 lanes; P.V with vpdpwssd (int16 weights, codes widened
 * to int16). Compiled with per-file ISA flags; attend_simd.c calls it only
 * when the selected ISA is avx512 (or amx) and the CPU has AVX512_VNNI.
 * The body is kvfmt_body.h.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kvfmt_kernels.h"
#include "vec_math.h"

typedef __m512 kv_vec;
#define KV_VL 16
#define KV_LOAD(p) _mm512_loadu_ps(p)
#define KV_STORE(p, v) _mm512_storeu_ps((p), (v))
#define KV_ZERO() _mm512_setzero_ps()
#define KV_SET1(x) _mm512_set1_ps(x)
#define KV_ADD(a, b) _mm512_add_ps((a), (b))
#define KV_SUB(a, b) _mm512_sub_ps((a), (b))
#define KV_MUL(a, b) _mm512_mul_ps((a), (b))
#define KV_MAX(a, b) _mm512_max_ps((a), (b))
#define KV_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define KV_HSUM(v) _mm512_reduce_add_ps(v)
#define KV_HMAX(v) _mm512_reduce_max_ps(v)
#define KV_EXP2(v) kvc__exp2_16(v)
#define KV_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#define KV_NVB 8
static inline void kv_kc4(const void *p0, const void *p1, __m512 *x0, __m512 *x1) {
    long long a, b;
    memcpy(&a, p0, 8), memcpy(&b, p1, 8);
    const __m512i d = _mm512_cvtepu8_epi32(_mm_set_epi64x(b, a));
    const __m512i lo = _mm512_and_si512(d, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(d, 4);
    *x0 = _mm512_cvtepi32_ps(_mm512_shuffle_i32x4(lo, hi, 0x44)); /* p0's: lo, hi halves 0 and 1 */
    *x1 = _mm512_cvtepi32_ps(_mm512_shuffle_i32x4(lo, hi, 0xEE));
}
#define KV_KC4(p0, p1, x0, x1) kv_kc4((p0), (p1), &(x0), &(x1))
#define KV_UNPERM4(v) \
    _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), (v))
typedef __m512i kv_ivec; /* 32 int16 or 16 int32 */
#define KV_IZERO() _mm512_setzero_si512()
#define KV_ILOAD(p) _mm512_loadu_si512((const void *)(p))
#define KV_ISTORE(p, v) _mm512_storeu_si512((void *)(p), (v))
#define KV_IADD(a, b) _mm512_add_epi32((a), (b))
/* in place: through the intrinsic GCC 12 computes into a copy of the
 * accumulator and moves it back, a register move per vpdpwssd in the loops */
static inline __m512i kv_dpwssd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
}
#define KV_DPWSSD(acc, a, b) kv_dpwssd((acc), (a), (b))
#define KV_CVTI(v) _mm512_cvtps_epi32(v)
#define KV_I2F(v) _mm512_cvtepi32_ps(v)
/* int32 to int16 (saturating), a's lanes then b's */
#define KV_PACK16(a, b) \
    _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtsepi32_epi16(a)), _mm512_cvtsepi32_epi16(b), 1)
/* even and odd lanes of the 2 VL int32 lanes a, b */
#define KV_EVOD(a, b, ev, od)                                                                          \
    do {                                                                                               \
        const __m512i i_ = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30); \
        (ev) = _mm512_permutex2var_epi32((a), i_, (b));                                                \
        (od) = _mm512_permutex2var_epi32((a), _mm512_add_epi32(i_, _mm512_set1_epi32(1)), (b));        \
    } while (0)
static inline __m512 kv_f16_half(const void *p, int hi) {
    __m512i x = _mm512_loadu_si512(p);
    if (hi) x = _mm512_srli_epi32(x, 16);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
}
#define KV_F16_HALF(p, hi) kv_f16_half((p), (hi))
#define KV_LO4(x) _mm512_and_si512((x), _mm512_set1_epi16(15))
#define KV_HI4(x) _mm512_srli_epi16((x), 4)
/* 16 bytes at p0, then 16 at p1, zero-extended to int16 */
#define KV_C8X2(p0, p1)                                                                          \
    _mm512_cvtepu8_epi16(_mm256_inserti128_si256(                                                \
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(p0))),            \
        _mm_loadu_si128((const __m128i *)(const void *)(p1)), 1))
static inline __m512i kv_c4x4(const void *p0, const void *p1, const void *p2, const void *p3) {
    long long a, b, c, d;
    memcpy(&a, p0, 8), memcpy(&b, p1, 8), memcpy(&c, p2, 8), memcpy(&d, p3, 8);
    return _mm512_cvtepu8_epi16(_mm256_set_epi64x(d, c, b, a));
}
#define KV_C4X4(p0, p1, p2, p3) kv_c4x4(p0, p1, p2, p3)
#define KV_ABS(v) _mm512_abs_ps(v)
#define KV_PAIR(p) _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#define KV_ISET1(x) _mm512_set1_epi32(x)
#define KV_IOTA() _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define KV_KEEP_LE(v, x, y) \
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), (y), _CMP_LE_OQ), _mm512_set1_ps(-INFINITY), (v))

/* Lane i = sum of the 16 lanes of vector i of t (16 x 16 floats). */
static inline __m512 kv_reduce16(const float *t) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_loadu_ps(t + i * 16);
    return kvc__reduce16(a);
}
#define KV_REDUCE(t) kv_reduce16(t)

/* P . V tiles: code vectors x query vectors held in registers */
#define KV_WK 4
#define KV_WV 4
#define KV_VTILES KV_VT(1, 1) KV_VT(1, 2) KV_VT(1, 3) KV_VT(1, 4) KV_VT(2, 1) KV_VT(2, 2) KV_VT(2, 3) KV_VT(2, 4) KV_VT(3, 1) KV_VT(3, 2) KV_VT(3, 3) KV_VT(3, 4) KV_VT(4, 1) KV_VT(4, 2) KV_VT(4, 3) KV_VT(4, 4)
#define KV_NAME kvc__kvfmt_run_avx512
#include "kvfmt_body.h"
