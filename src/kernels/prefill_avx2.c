/*
 * AVX2 + FMA prefill kernels (prefill_body.h, 8 lanes). Compiled with
 * -mavx2 -mfma -mf16c and called only after dispatch.c checked the CPU.
 * Register block 4 x 2 ymm: 8 accumulators + 2 loads of Y + 1 broadcast of
 * X, well inside the 16 ymm registers.
 */
#include <immintrin.h>
#include <math.h>

#include "prefill.h"

#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __m256 pb_range8(__m256 s, int32_t j, const int32_t *lo, const int32_t *hi) {
    const __m256i vj = _mm256_set1_epi32(j);
    const __m256i out = _mm256_or_si256(
        _mm256_cmpgt_epi32(_mm256_load_si256((const __m256i *)(const void *)lo), vj),
        _mm256_cmpgt_epi32(vj, _mm256_load_si256((const __m256i *)(const void *)hi)));
    return _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(out));
}

static inline __m256 pb_sel_eq8(__m256 a, __m256 b, __m256 x, __m256 y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_EQ_OQ));
}

typedef __m256 pb_vec;
#define PB_VL 8
#define PB_NA 4
#define PB_NM 2
#define PB_LOAD(p) _mm256_load_ps(p)
#define PB_STORE(p, v) _mm256_store_ps((p), (v))
#define PB_ZERO() _mm256_setzero_ps()
#define PB_SET1(x) _mm256_set1_ps(x)
#define PB_BCAST(p) _mm256_broadcast_ss(p)
#define PB_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define PB_FFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define PB_MUL(a, b) _mm256_mul_ps((a), (b))
#define PB_ADD(a, b) _mm256_add_ps((a), (b))
#define PB_SUB(a, b) _mm256_sub_ps((a), (b))
#define PB_MAX(a, b) _mm256_max_ps((a), (b))
#define PB_EXP2(v) kvc__exp2_8(v)
#define PB_SEL_EQ(a, b, x, y) pb_sel_eq8((a), (b), (x), (y))
#define PB_RANGE(s, j, lo, hi) pb_range8((s), (j), (lo), (hi))
#define PB_GEMM gemm_avx2
#define PB_SOFTMAX softmax_avx2
#include "prefill_body.h"

static const kvc_prefill_kernels table = {KVC_ISA_AVX2, gemm_avx2, softmax_avx2};

const kvc_prefill_kernels *kvc__prefill_kernels_avx2(void) { return &table; }
