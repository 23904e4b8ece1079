/*
 * Scalar prefill kernels (prefill_body.h with 1-lane "vectors"): the portable
 * reference, and the run-time choice of the prefill table.
 */
#include <math.h>

#include "prefill.h"

typedef float pb_vec;
#define PB_VL 1
#define PB_NA 4
#define PB_NM 4
#define PB_LOAD(p) (*(p))
#define PB_STORE(p, v) (*(p) = (v))
#define PB_ZERO() 0.0f
#define PB_SET1(x) (x)
#define PB_BCAST(p) (*(p))
#define PB_FMA(a, b, c) ((a) * (b) + (c)) /* ISO C mode: never contracted */
#define PB_FFMA(a, b, c) fmaf((a), (b), (c)) /* fused, as the vector ISAs */
#define PB_MUL(a, b) ((a) * (b))
#define PB_ADD(a, b) ((a) + (b))
#define PB_SUB(a, b) ((a) - (b))
#define PB_MAX(a, b) ((a) > (b) ? (a) : (b))
#define PB_EXP2(v) pb_exp2(v)
#define PB_SEL_EQ(a, b, x, y) ((a) == (b) ? (x) : (y))
#define PB_RANGE(s, j, lo, hi) ((lo)[0] <= (j) && (j) <= (hi)[0] ? (s) : -INFINITY)
#define PB_GEMM gemm_scalar
#define PB_SOFTMAX softmax_scalar

static inline float pb_exp2(float x) { return x < -126.0f ? 0.0f : exp2f(x); }

#include "prefill_body.h"

static const kvc_prefill_kernels table = {KVC_ISA_SCALAR, gemm_scalar, softmax_scalar};

const kvc_prefill_kernels *kvc__prefill_kernels_scalar(void) { return &table; }

const kvc_prefill_kernels *kvc__prefill_kernels(void) {
#if defined(__x86_64__) || defined(__i386__)
    switch (kvc_get_isa()) {
    case KVC_ISA_AMX: /* the AVX-512 prefill kernels */
    case KVC_ISA_AVX512: return kvc__prefill_kernels_avx512();
    case KVC_ISA_AVX2: return kvc__prefill_kernels_avx2();
    default: break;
    }
#endif
    return &table;
}
