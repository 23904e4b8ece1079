/*
 * Vector math shared by the attention kernels of every ISA (decode,
 * prefill, MLA): 2^x for the online softmax, and the logit soft cap.
 * Include after <immintrin.h> in a translation unit compiled for the ISA:
 * the widest variant the compiler flags allow is defined.
 *
 * 2^x for x <= 0 (kvc__exp2_16 / kvc__exp2_8): x = n + f, n = rint(x),
 * |f| <= 1/2, Cephes' degree-6 polynomial for 2^f (relative error ~2e-7),
 * 2^n built in the exponent bits; exactly 0 below -126, for -inf and NaN,
 * so masked keys contribute nothing.
 *
 * Logit soft cap, s -> cap * tanh(s / cap) * mul (mul = log2 e where the
 * softmax runs in base 2).
 *
 * One algorithm, written once in scalar and once per vector width with the
 * same IEEE operations in the same order (fmaf where the vectors use FMA),
 * so every ISA gives the same bits and prefill stays bitwise identical
 * across ISAs. Accuracy: tanh within 1.5 ulp (checked against double tanh
 * in test_attn), against libm tanhf's 1 ulp; the point is speed: libm
 * tanhf per score made capped attention 2-3x slower than uncapped.
 *
 *   x = s / cap, a = |x|
 *   a < 0.55:  tanh a = a + a z P(z), z = a^2, P degree 4 (least squares on
 *              [0, 0.55], 0.7 ulp)
 *   else:      u = 2 min(a, 9.5) (tanh 9.5 rounds to 1), e^u by Cody-Waite
 *              (n = rint(u log2 e), r = u - n ln2 in two FMAs, |r| <= 0.347,
 *              Taylor degree 7), tanh a = 1 - 2 / (e^u + 1)
 *   then the sign of x (on both branches, so tanh(-0) = -0)
 *   NaN stays NaN; +-Inf gives +-cap * mul. Rows use the widest vector variant,
 *   scalar for the tail.
 */
#ifndef KVC_KERNELS_VEC_MATH_H
#define KVC_KERNELS_VEC_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
static inline __m512 kvc__exp2_16(__m512 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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
#endif
#if defined(__AVX512F__)
/* Lane i = sum of the lanes of a[i]: a transposed reduction (pairs, then
 * 128-bit blocks): 16 horizontal sums in 45 shuffles/adds. */
static inline __m512 kvc__reduce16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++) /* lanes alternate a[2i], a[2i+1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* each 128-bit block: a[4i .. 4i+3] */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44),
                                    _mm512_shuffle_f32x4(c[0], c[1], 0xee));
    const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44),
                                    _mm512_shuffle_f32x4(c[2], c[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, 0x88), _mm512_shuffle_f32x4(f0, f1, 0xdd));
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
/* Sum and maximum of the 8 lanes of v. */
static inline float kvc__hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline float kvc__hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
static inline __m256 kvc__exp2_8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
#endif

/*
 * a * b rounded up: the smallest float >= the exact product (the next float
 * when the fused residual is positive; -inf and NaN pass through). The AMX
 * decode takes its running max to base 2 this way, m = up(max s * sc), so
 * every weight 2^(s * sc - m) is <= 1, as its fixed-point weights need
 * (with a plain product the largest weight exceeded 1 by up to half an ulp
 * of m in the exponent and was clipped: 3e-4 - 8e-4 relative errors at
 * scores of 1e4). The float kernels take the plain product: a weight a few
 * ulps above 1 costs them nothing, and the rounding cost them ~3% (float16
 * kernel, measured).
 */
static inline float kvc__mul_up(float a, float b) {
    const float t = a * b;
    /* without branches: the residual's sign is data (a branch on it
     * mispredicts about every other time) */
    const uint32_t up = -(uint32_t)(fmaf(a, b, -t) > 0.0f); /* all ones: round up */
    uint32_t u;
    memcpy(&u, &t, sizeof u);
    /* the next float: bits + 1 above zero, - 1 below, the least subnormal at +-0 */
    const uint32_t zero = -(uint32_t)((u << 1) == 0u);
    const uint32_t next = (u + 1u - 2u * (u >> 31)) & ~zero;
    u = (u & ~up) | (((next | (zero & 1u))) & up);
    float r;
    memcpy(&r, &u, sizeof r);
    return r;
}

#define KVC_SC_SMALL 0.55f
#define KVC_SC_BIG 9.5f
#define KVC_SC_P0 -0.33333316445350647f
#define KVC_SC_P1 0.13332580029964447f
#define KVC_SC_P2 -0.053851865231990814f
#define KVC_SC_P3 0.02107025310397148f
#define KVC_SC_P4 -0.006272607482969761f
#define KVC_SC_LOG2E 1.4426950408889634f
#define KVC_SC_LN2_HI 0.693145751953125f /* ln 2 with 12 low bits clear: n * hi exact */
#define KVC_SC_LN2_LO 1.428606765330187e-06f

static inline float kvc__softcap1(float s, float cap, float mul) {
    const float x = s / cap, a = fabsf(x);
    const float z = a * a;
    float p = fmaf(KVC_SC_P4, z, KVC_SC_P3);
    p = fmaf(p, z, KVC_SC_P2);
    p = fmaf(p, z, KVC_SC_P1);
    p = fmaf(p, z, KVC_SC_P0);
    const float small = fmaf(a * z, p, a); /* >= 0: the sign goes on last, so -0 stays -0 */
    const float u = 2.0f * (a < KVC_SC_BIG ? a : KVC_SC_BIG); /* NaN -> BIG, as vminps */
    const float n = rintf(u * KVC_SC_LOG2E);
    float r = fmaf(-n, KVC_SC_LN2_HI, u);
    r = fmaf(-n, KVC_SC_LN2_LO, r);
    float e = 1.0f / 5040.0f;
    e = fmaf(e, r, 1.0f / 720.0f);
    e = fmaf(e, r, 1.0f / 120.0f);
    e = fmaf(e, r, 1.0f / 24.0f);
    e = fmaf(e, r, 1.0f / 6.0f);
    e = fmaf(e, r, 0.5f);
    e = fmaf(e, r, 1.0f);
    e = fmaf(e, r, 1.0f);
    e = ldexpf(e, (int)n); /* exact: n <= 28 */
    const float big = 1.0f - 2.0f / (e + 1.0f);
    float t = copysignf(a < KVC_SC_SMALL ? small : big, x);
    if (x != x) t = x;
    return cap * t * mul;
}

#if defined(__AVX512F__)
#define KVC_SC_VL 16
static inline __m512 kvc__softcap16(__m512 s, __m512 cap, __m512 mul) {
    const __m512 x = _mm512_div_ps(s, cap), a = _mm512_abs_ps(x);
    const __m512 z = _mm512_mul_ps(a, a);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(KVC_SC_P4), z, _mm512_set1_ps(KVC_SC_P3));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(KVC_SC_P2));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(KVC_SC_P1));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(KVC_SC_P0));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(a, z), p, a);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(2.0f), _mm512_min_ps(a, _mm512_set1_ps(KVC_SC_BIG)));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(u, _mm512_set1_ps(KVC_SC_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KVC_SC_LN2_HI), u);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KVC_SC_LN2_LO), r);
    __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 5040.0f), r, _mm512_set1_ps(1.0f / 720.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 120.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 24.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f / 6.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.0f));
    e = _mm512_scalef_ps(e, n);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
    __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(KVC_SC_SMALL), _CMP_LT_OQ),
                                    big, small);
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
    t = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
    t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), t, x);
    return _mm512_mul_ps(_mm512_mul_ps(cap, t), mul);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define KVC_SC_VL 8
static inline __m256 kvc__softcap8(__m256 s, __m256 cap, __m256 mul) {
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    const __m256 x = _mm256_div_ps(s, cap), a = _mm256_andnot_ps(signbit, x);
    const __m256 z = _mm256_mul_ps(a, a);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(KVC_SC_P4), z, _mm256_set1_ps(KVC_SC_P3));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(KVC_SC_P2));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(KVC_SC_P1));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(KVC_SC_P0));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(a, z), p, a);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(2.0f), _mm256_min_ps(a, _mm256_set1_ps(KVC_SC_BIG)));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(u, _mm256_set1_ps(KVC_SC_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(KVC_SC_LN2_HI), u);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(KVC_SC_LN2_LO), r);
    __m256 e = _mm256_fmadd_ps(_mm256_set1_ps(1.0f / 5040.0f), r, _mm256_set1_ps(1.0f / 720.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 120.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 24.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f / 6.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.0f));
    /* 2^n as float bits ((n + 127) << 23): n in [0, 28], the product exact */
    const __m256i pow2 = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    e = _mm256_mul_ps(e, _mm256_castsi256_ps(pow2));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(KVC_SC_SMALL), _CMP_LT_OQ));
    t = _mm256_or_ps(t, _mm256_and_ps(signbit, x));
    t = _mm256_blendv_ps(t, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_mul_ps(_mm256_mul_ps(cap, t), mul);
}
#endif

/* s[0..n) = cap * tanh(s / cap) * mul, in place. */
static inline void kvc__softcap_row(float *s, int64_t n, float cap, float mul) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 vc = _mm512_set1_ps(cap), vm = _mm512_set1_ps(mul);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, kvc__softcap16(_mm512_loadu_ps(s + i), vc, vm));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 vc = _mm256_set1_ps(cap), vm = _mm256_set1_ps(mul);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, kvc__softcap8(_mm256_loadu_ps(s + i), vc, vm));
#endif
    for (; i < n; i++) s[i] = kvc__softcap1(s[i], cap, mul);
}

#endif /* KVC_KERNELS_VEC_MATH_H */
