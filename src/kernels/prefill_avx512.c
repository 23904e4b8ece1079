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

/* 2^x for x <= 0: x = n + f, |f| <= 1/2, degree-6 polynomial for 2^f times
 * 2^n in the exponent bits (the decode kernels' coefficients); exactly 0
 * below -126, for -inf and for NaN. */
static inline __m512 pb_exp2_16(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, RNE);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}

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
#define PB_MUL(a, b) _mm512_mul_ps((a), (b))
#define PB_ADD(a, b) _mm512_add_ps((a), (b))
#define PB_SUB(a, b) _mm512_sub_ps((a), (b))
#define PB_MAX(a, b) _mm512_max_ps((a), (b))
#define PB_EXP2(v) pb_exp2_16(v)
#define PB_SEL_EQ(a, b, x, y) pb_sel_eq16((a), (b), (x), (y))
#define PB_RANGE(s, j, lo, hi) pb_range16((s), (j), (lo), (hi))
#define PB_GEMM gemm_avx512
#define PB_SOFTMAX softmax_avx512
#include "prefill_body.h"

static const kvc_prefill_kernels table = {KVC_ISA_AVX512, gemm_avx512, softmax_avx512};

const kvc_prefill_kernels *kvc__prefill_kernels_avx512(void) { return &table; }
