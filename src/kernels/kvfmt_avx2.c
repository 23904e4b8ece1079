/*
 * kvfmt attention kernel (kvfmt_kernels.h), AVX2 + FMA + F16C: 8 float32
 * lanes, codes converted to float32 and multiplied with FMAs. Compiled with
 * per-file ISA flags; attend.c calls it only when the selected ISA is avx2.
 * The body is kvfmt_body.h.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kvfmt_kernels.h"
#include "vec_math.h"

typedef __m256 kv_vec;
#define KV_VL 8
#define KV_LOAD(p) _mm256_loadu_ps(p)
#define KV_STORE(p, v) _mm256_storeu_ps((p), (v))
#define KV_ZERO() _mm256_setzero_ps()
#define KV_SET1(x) _mm256_set1_ps(x)
#define KV_ADD(a, b) _mm256_add_ps((a), (b))
#define KV_SUB(a, b) _mm256_sub_ps((a), (b))
#define KV_MUL(a, b) _mm256_mul_ps((a), (b))
#define KV_MAX(a, b) _mm256_max_ps((a), (b))
#define KV_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define KV_EXP2(v) kvc__exp2_8(v)
#define KV_HSUM(v) kvc__hsum8(v)
#define KV_HMAX(v) kvc__hmax8(v)
#define KV_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define KV_NVB 4
static inline void kv_kc4(const void *p0, const void *p1, __m256 *x0, __m256 *x1) {
    int a, b;
    memcpy(&a, p0, 4), memcpy(&b, p1, 4);
    const __m256i d = _mm256_cvtepu8_epi32(_mm_setr_epi32(a, b, 0, 0));
    const __m256i lo = _mm256_and_si256(d, _mm256_set1_epi32(15)), hi = _mm256_srli_epi32(d, 4);
    *x0 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x20)); /* p0's: low halves */
    *x1 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo, hi, 0x31));
}
#define KV_KC4(p0, p1, x0, x1) kv_kc4((p0), (p1), &(x0), &(x1))
#define KV_UNPERM4(v) _mm256_permutevar8x32_ps((v), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
typedef __m256i kv_ivec; /* 16 int16 or 8 int32 */
#define KV_IZERO() _mm256_setzero_si256()
#define KV_ILOAD(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define KV_ISTORE(p, v) _mm256_storeu_si256((__m256i *)(void *)(p), (v))
#define KV_IADD(a, b) _mm256_add_epi32((a), (b))
#define KV_DPWSSD(acc, a, b) _mm256_add_epi32((acc), _mm256_madd_epi16((a), (b)))
#define KV_CVTI(v) _mm256_cvtps_epi32(v)
#define KV_I2F(v) _mm256_cvtepi32_ps(v)
/* int32 to int16 (saturating), a's lanes then b's */
#define KV_PACK16(a, b) _mm256_permute4x64_epi64(_mm256_packs_epi32((a), (b)), 0xd8)
/* even and odd lanes of the 2 VL int32 lanes a, b */
#define KV_EVOD(a, b, ev, od)                                                                     \
    do {                                                                                          \
        const __m256 a_ = _mm256_castsi256_ps(a), b_ = _mm256_castsi256_ps(b);                   \
        (ev) = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a_, b_, 0x88)), 0xd8); \
        (od) = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a_, b_, 0xdd)), 0xd8); \
    } while (0)
static inline __m256 kv_f16_half(const void *p, int hi) {
    __m256i x = _mm256_loadu_si256((const __m256i *)p);
    x = hi ? _mm256_srli_epi32(x, 16) : _mm256_and_si256(x, _mm256_set1_epi32(0xffff));
    x = _mm256_permute4x64_epi64(_mm256_packus_epi32(x, x), 0x88);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(x));
}
#define KV_F16_HALF(p, hi) kv_f16_half((p), (hi))
#define KV_LO4(x) _mm256_and_si256((x), _mm256_set1_epi16(15))
#define KV_HI4(x) _mm256_srli_epi16((x), 4)
/* 8 bytes at p0, then 8 at p1, zero-extended to int16 */
#define KV_C8X2(p0, p1)                                                                          \
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(const void *)(p0)), \
                                            _mm_loadl_epi64((const __m128i *)(const void *)(p1))))
static inline __m256i kv_c4x4(const void *p0, const void *p1, const void *p2, const void *p3) {
    int a, b, c, d;
    memcpy(&a, p0, 4), memcpy(&b, p1, 4), memcpy(&c, p2, 4), memcpy(&d, p3, 4);
    return _mm256_cvtepu8_epi16(_mm_setr_epi32(a, b, c, d));
}
#define KV_C4X4(p0, p1, p2, p3) kv_c4x4(p0, p1, p2, p3)
#define KV_ABS(v) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (v))
#define KV_PAIR(p) _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define KV_ISET1(x) _mm256_set1_epi32(x)
#define KV_IOTA() _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)
#define KV_KEEP_LE(v, x, y) \
    _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), (v), _mm256_cmp_ps((x), (y), _CMP_LE_OQ))

/* Lane i = sum of the 8 lanes of vector i of t (8 x 8 floats). */
static inline __m256 kv_reduce8(const float *t) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(t + i * 8);
    const __m256 h0 = _mm256_hadd_ps(a[0], a[1]), h1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h2 = _mm256_hadd_ps(a[4], a[5]), h3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);
    return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}
#define KV_REDUCE(t) kv_reduce8(t)

#define KV_NAME kvc__kvfmt_run_avx2
#include "kvfmt_body.h"
