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
#define KV_MUL(a, b) _mm256_mul_ps((a), (b))
#define KV_MAX(a, b) _mm256_max_ps((a), (b))
#define KV_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define KV_EXP2(v) kvc__exp2_8(v)
static inline float kv_hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline float kv_hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#define KV_HSUM(v) kv_hsum8(v)
#define KV_HMAX(v) kv_hmax8(v)
#define KV_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define KV_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p))))
#define KV_U4PAIR(p, lo, hi)                                                                      \
    do {                                                                                          \
        const __m256i d_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(p))); \
        (lo) = _mm256_cvtepi32_ps(_mm256_and_si256(d_, _mm256_set1_epi32(15)));                    \
        (hi) = _mm256_cvtepi32_ps(_mm256_srli_epi32(d_, 4));                                       \
    } while (0)
static inline __m256 kv_u4half(const void *p) {
    int32_t b;
    memcpy(&b, p, 4);
    const __m128i d = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(b));
    const __m256i x = _mm256_set_m128i(_mm_srli_epi32(d, 4), _mm_and_si128(d, _mm_set1_epi32(15)));
    return _mm256_cvtepi32_ps(x);
}
#define KV_U4HALF(p) kv_u4half(p)
#define KV_PERM_TOK(v) _mm256_permutevar8x32_ps((v), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7))
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
