/*
 * AVX-512 prefill kernels (prefill_body.h, 16 lanes). Compiled with
 * -mavx512f/bw/vl/dq -mfma and called only after dispatch.c checked the CPU.
 * Register block 4 x 4 zmm: 16 accumulators (enough to hide the FMA latency
 * on two ports), 4 loads of Y and 4 broadcasts of X per 16 FMAs (the
 * broadcasts fold into the FMAs' memory operands).
 */
#include <immintrin.h>
#include <math.h>

#include "prefill.h"

#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __m512 pb_range16(__m512 s, int32_t j, const int32_t *lo, const int32_t *hi) {
    const __m512i vj = _mm512_set1_epi32(j);
    const __mmask16 in = _mm512_cmp_epi32_mask(_mm512_load_si512(lo), vj, _MM_CMPINT_LE) &
                         _mm512_cmp_epi32_mask(vj, _mm512_load_si512(hi), _MM_CMPINT_LE);
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), in, s);
}

static inline __m512 pb_sel_eq16(__m512 a, __m512 b, __m512 x, __m512 y) {
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ), x);
}

typedef __m512 pb_vec;
#define PB_VL 16
#define PB_NA 4
#define PB_NM 4
#define PB_LOAD(p) _mm512_load_ps(p)
#define PB_STORE(p, v) _mm512_store_ps((p), (v))
#define PB_ZERO() _mm512_setzero_ps()
#define PB_SET1(x) _mm512_set1_ps(x)
#define PB_BCAST(p) _mm512_set1_ps(*(p))
#define PB_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define PB_FFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define PB_MUL(a, b) _mm512_mul_ps((a), (b))
#define PB_ADD(a, b) _mm512_add_ps((a), (b))
#define PB_SUB(a, b) _mm512_sub_ps((a), (b))
#define PB_MAX(a, b) _mm512_max_ps((a), (b))
#define PB_EXP2(v) kvc__exp2_16(v)
#define PB_SEL_EQ(a, b, x, y) pb_sel_eq16((a), (b), (x), (y))
#define PB_RANGE(s, j, lo, hi) pb_range16((s), (j), (lo), (hi))
#define PB_GEMM gemm_avx512
#define PB_SOFTMAX softmax_avx512
#include "prefill_body.h"

static const kvc_prefill_kernels table = {KVC_ISA_AVX512, gemm_avx512, softmax_avx512};

const kvc_prefill_kernels *kvc__prefill_kernels_avx512(void) { return &table; }
