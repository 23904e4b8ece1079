/*
 * AVX-512 (F/BW/VL/DQ) kernels: 16 float32 lanes per zmm. Compiled with
 * -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma -mf16c and only
 * called after dispatch.c has checked the CPU and the OS (ZMM state).
 * Every result is bit-identical to kernels_scalar.c:
 *   - f32 <-> f16 uses vcvtps2ph / vcvtph2ps with round-to-nearest-even
 *     (MXCSR default: no FTZ/DAZ, so subnormals convert exactly);
 *   - f32 -> bf16 is the scalar integer rounding on 16 lanes. VCVTNEPS2BF16
 *     (AVX512-BF16) is deliberately not used: it flushes denormals;
 *   - x / scale and absmax / qmax are true divisions (vdivps), never a
 *     reciprocal; rounding is vrndscaleps to nearest even, like nearbyintf;
 *   - only intrinsics do float math here, so nothing gets contracted to FMA.
 *
 * Tails use masked loads/stores (masked-off lanes neither fault nor write),
 * so any n is handled in vector code. Quantize/dequantize fast paths:
 *   - g == 8: two groups per zmm (lanes 0-7 and 8-15), the two scales put in
 *     place by one permute;
 *   - any other g >= 8 (g % 16 == 0 being the common case): per group,
 *     16 lanes per step and one masked step for g % 16.
 * g < 8 (2, 4, 6: under half a vector per group) goes to the scalar table.
 *
 * Inner loops are instantiated per dtype combination (always_inline helpers
 * called with constant dtypes), so no dtype switch runs per element.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels.h"

#define KVC_INLINE static inline __attribute__((always_inline))

/* Round to nearest even, no precision exception (F16C and vrndscaleps). */
#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

#define ALL16 ((__mmask16)0xffff)

/* Mask of the low r lanes, 0 <= r <= 16. */
KVC_INLINE __mmask16 lanes(int64_t r) { return (__mmask16)((1u << r) - 1u); }

/* ---- pointers ------------------------------------------------------------ */

KVC_INLINE size_t float_size(kvc_dtype d) { return d == KVC_F32 ? 4u : 2u; }

/* ---- 16-lane element conversions ----------------------------------------- */

/*
 * 16 f16 -> 16 f32, exactly as kvc_f16_to_f32. vcvtph2ps quiets signalling
 * NaNs (sets the top mantissa bit) while the scalar keeps the payload as it
 * is, so NaN lanes, rare, are rebuilt from the f16 bits:
 * sign << 16 | 0x7f800000 | mant << 13.
 */
KVC_INLINE __m512 f16x16_to_f32(__m256i h) {
    __m512 f = _mm512_cvtph_ps(h);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    if (__builtin_expect(nan != 0, 0)) {
        const __m512i h32 = _mm512_cvtepu16_epi32(h);
        const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(h32, _mm512_set1_epi32(0x8000)), 16);
        const __m512i mant = _mm512_slli_epi32(_mm512_and_si512(h32, _mm512_set1_epi32(0x3ff)), 13);
        const __m512i fix =
            _mm512_or_si512(_mm512_or_si512(sign, mant), _mm512_set1_epi32(0x7f800000));
        f = _mm512_mask_mov_ps(f, nan, _mm512_castsi512_ps(fix));
    }
    return f;
}

/* 16 f32 -> 16 f16. The hardware already matches the scalar on NaN:
 * sign | 0x7c00 | 0x200 | mant >> 13. */
KVC_INLINE __m256i f32x16_to_f16(__m512 f) { return _mm512_cvtps_ph(f, RNE); }

KVC_INLINE __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/*
 * bf16 bits of 16 f32 lanes, still in 32-bit lanes (each < 0x10000): the
 * scalar rule on each lane, NaN -> (u >> 16) | 0x40, else
 * (u + 0x7fff + ((u >> 16) & 1)) >> 16 (nearest even; subnormals kept,
 * overflow carries into Inf).
 */
KVC_INLINE __m512i bf16_bits16(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7fff));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
}

/* 16 f32 -> 16 bf16 (vpmovdw narrows). */
KVC_INLINE __m256i f32x16_to_bf16(__m512 f) { return _mm512_cvtepi32_epi16(bf16_bits16(f)); }

/*
 * 32 f32 (a then b) -> 32 bf16 in one zmm. Cheaper than two vpmovdw (two
 * uops each on Zen 4): vpackusdw narrows both (values < 0x10000, so no
 * saturation) but interleaves per 128-bit block, giving qwords
 * a0-3 b0-3 a4-7 b4-7 ...; one qword permute restores the order.
 */
KVC_INLINE __m512i f32x32_to_bf16(__m512 a, __m512 b) {
    const __m512i p = _mm512_packus_epi32(bf16_bits16(a), bf16_bits16(b));
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), p);
}

/* Loads the lanes m of x[i..i+16) (dtype d) as f32; other lanes are 0. A
 * constant ALL16 folds to the plain unaligned load. */
KVC_INLINE __m512 load16(const void *x, kvc_dtype d, int64_t i, __mmask16 m) {
    if (d == KVC_F32) {
        const float *p = (const float *)x + i;
        return m == ALL16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
    }
    const uint16_t *p = (const uint16_t *)x + i;
    const __m256i h = m == ALL16 ? _mm256_loadu_si256((const __m256i *)p)
                                 : _mm256_maskz_loadu_epi16(m, p);
    return d == KVC_F16 ? f16x16_to_f32(h) : bf16x16_to_f32(h);
}

/* Stores the lanes m of v as y[i..i+16) of dtype d. */
KVC_INLINE void store16(void *y, kvc_dtype d, int64_t i, __m512 v, __mmask16 m) {
    if (d == KVC_F32) {
        float *p = (float *)y + i;
        if (m == ALL16) _mm512_storeu_ps(p, v);
        else _mm512_mask_storeu_ps(p, m, v);
        return;
    }
    uint16_t *p = (uint16_t *)y + i;
    const __m256i h = d == KVC_F16 ? f32x16_to_f16(v) : f32x16_to_bf16(v);
    if (m == ALL16) _mm256_storeu_si256((__m256i *)p, h);
    else _mm256_mask_storeu_epi16(p, m, h);
}

/* Stores 32 f32 (a then b) as y[i..i+32) of dtype d. */
KVC_INLINE void store32(void *y, kvc_dtype d, int64_t i, __m512 a, __m512 b) {
    if (d == KVC_BF16) {
        _mm512_storeu_si512((uint16_t *)y + i, f32x32_to_bf16(a, b));
        return;
    }
    store16(y, d, i, a, ALL16);
    store16(y, d, i + 16, b, ALL16);
}

/* ---- convert ------------------------------------------------------------- */

KVC_INLINE void convert_run(const void *src, kvc_dtype sd, void *dst, kvc_dtype dd, int64_t n) {
    int64_t i = 0;
    /* Two vectors per iteration: enough loads in flight to stay memory bound. */
    for (; i + 32 <= n; i += 32) {
        store32(dst, dd, i, load16(src, sd, i, ALL16), load16(src, sd, i + 16, ALL16));
    }
    for (; i + 16 <= n; i += 16) store16(dst, dd, i, load16(src, sd, i, ALL16), ALL16);
    if (i < n) {
        const __mmask16 m = lanes(n - i);
        store16(dst, dd, i, load16(src, sd, i, m), m);
    }
}

/* Four vectors per iteration, then one at a time, then bytes. */
static void copy_avx512(void *dst, const void *src, size_t n) {
    char *d = dst;
    const char *s = src;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
        const __m512i c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
        _mm512_storeu_si512(d + i, a);
        _mm512_storeu_si512(d + i + 64, b);
        _mm512_storeu_si512(d + i + 128, c);
        _mm512_storeu_si512(d + i + 192, e);
    }
    for (; i + 64 <= n; i += 64) _mm512_storeu_si512(d + i, _mm512_loadu_si512(s + i));
    if (i < n) memcpy(d + i, s + i, n - i);
}

static void convert_avx512(const void *src, kvc_dtype sd, void *dst, kvc_dtype dd, int64_t n) {
    if (sd == dd) {
        copy_avx512(dst, src, (size_t)n * float_size(sd));
        return;
    }
    /* One loop per dtype pair: the dtype tests fold away inside each. */
#define PAIR(a, b)                                                                                 \
    if (sd == (a) && dd == (b)) {                                                                  \
        convert_run(src, (a), dst, (b), n);                                                        \
        return;                                                                                    \
    }
    PAIR(KVC_F32, KVC_F16)
    PAIR(KVC_F32, KVC_BF16)
    PAIR(KVC_F16, KVC_F32)
    PAIR(KVC_F16, KVC_BF16)
    PAIR(KVC_BF16, KVC_F32)
    PAIR(KVC_BF16, KVC_F16)
#undef PAIR
    kvc__kernels_scalar()->convert(src, sd, dst, dd, n); /* not reached for valid dtypes */
}

/* ---- all_finite ---------------------------------------------------------- */

/* |x| < limit iff x's magnitude bits (sign cleared) are below those of the
 * limit (rounded up to the input's format for 16-bit input); NaN and Inf
 * have the largest patterns, so limit INFINITY is the finiteness test. One
 * early-exit test per 64 bytes; the tail is a masked load (masked-off lanes
 * read as 0, below any limit). */
static int all_finite_avx512(const void *x, kvc_dtype xd, int64_t n, float limit) {
    if (xd == KVC_F32) {
        uint32_t lb;
        memcpy(&lb, &limit, 4);
        const __m512i abs = _mm512_set1_epi32(0x7fffffff), lim = _mm512_set1_epi32((int)lb);
        const float *p = x;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            if (_mm512_cmpge_epu32_mask(_mm512_and_si512(_mm512_loadu_si512(p + i), abs), lim))
                return 0;
        if (i < n) {
            const __m512i v = _mm512_maskz_loadu_epi32(lanes(n - i), p + i);
            if (_mm512_cmpge_epu32_mask(_mm512_and_si512(v, abs), lim)) return 0;
        }
        return 1;
    }
    const __m512i abs = _mm512_set1_epi16(0x7fff);
    const __m512i lim = _mm512_set1_epi16((short)kvc__limit_bits16(limit, xd));
    const uint16_t *p = x;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        if (_mm512_cmpge_epu16_mask(_mm512_and_si512(_mm512_loadu_si512(p + i), abs), lim))
            return 0;
    if (i < n) {
        const __mmask32 m = (__mmask32)((1ull << (n - i)) - 1u);
        const __m512i v = _mm512_maskz_loadu_epi16(m, p + i);
        if (_mm512_cmpge_epu16_mask(_mm512_and_si512(v, abs), lim)) return 0;
    }
    return 1;
}

/* ---- int8 / int4 lanes --------------------------------------------------- */

/* The lanes m of 16 int8 q[0..16) sign-extended to int32 (others 0). */
KVC_INLINE __m512i i8x16_load(const int8_t *q, __mmask16 m) {
    const __m128i b = m == ALL16 ? _mm_loadu_si128((const __m128i *)q) : _mm_maskz_loadu_epi8(m, q);
    return _mm512_cvtepi8_epi32(b);
}

/*
 * 16 int4 from 8 bytes (element k in bits 4k..4k+3 of the little-endian
 * qword), m the element lanes (an even count). Dword 0 (elements 0-7) goes
 * to lanes 0-7 and dword 1 to lanes 8-15; lane k then shifts its nibble to
 * the top (left by 28 - 4(k % 8)) and an arithmetic shift right by 28
 * sign-extends it.
 */
KVC_INLINE __m512i i4x16_load(const uint8_t *q, __mmask16 m) {
    __m128i b;
    if (m == ALL16) {
        b = _mm_loadl_epi64((const __m128i *)q);
    } else {
        const int nbytes = (__builtin_popcount(m) + 1) / 2; /* m = low lanes */
        b = _mm_maskz_loadu_epi8(lanes(nbytes), q);
    }
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i sh = _mm512_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12, 8, 4, 0);
    const __m512i v = _mm512_permutexvar_epi32(idx, _mm512_castsi128_si512(b));
    return _mm512_srai_epi32(_mm512_sllv_epi32(v, sh), 28);
}

/* 16 int32 in [-127, 127] -> 16 int8 (vpmovdb truncation is exact here). */
KVC_INLINE void i8x16_store(int8_t *q, __m512i v, __mmask16 m) {
    const __m128i b = _mm512_cvtepi32_epi8(v);
    if (m == ALL16) _mm_storeu_si128((__m128i *)q, b);
    else _mm_mask_storeu_epi8(q, m, b);
}

/*
 * 16 int32 in [-7, 7] -> 8 bytes of int4. Seen as 8 qwords, qword j holds
 * elements 2j (low dword) and 2j+1 (high dword): keep each dword's nibble,
 * move the high one from bit 32 to bit 4, and vpmovqb keeps the low byte.
 */
KVC_INLINE void i4x16_store(uint8_t *q, __m512i v, __mmask16 m) {
    const __m512i t = _mm512_and_si512(v, _mm512_set1_epi32(0xf));
    const __m128i b = _mm512_cvtepi64_epi8(_mm512_or_si512(t, _mm512_srli_epi64(t, 28)));
    if (m == ALL16) _mm_storel_epi64((__m128i *)q, b);
    else _mm_mask_storeu_epi8(q, lanes((__builtin_popcount(m) + 1) / 2), b);
}

/* Loads lanes m of elements [e, e+16) of q as int32. */
KVC_INLINE __m512i q16_load(const void *q, int bits, int64_t e, __mmask16 m) {
    return bits == 8 ? i8x16_load((const int8_t *)q + e, m)
                     : i4x16_load((const uint8_t *)q + e / 2, m);
}

KVC_INLINE void q16_store(void *q, int bits, int64_t e, __m512i v, __mmask16 m) {
    if (bits == 8) i8x16_store((int8_t *)q + e, v, m);
    else i4x16_store((uint8_t *)q + e / 2, v, m);
}

/* Scale i of a scale tensor as f32. vcvtph2ps quiets a signalling NaN where
 * kvc_f16_to_f32 does not, but the product with q quiets it the same way,
 * so dequantized values are identical. */
KVC_INLINE float scale_load(const void *scale, kvc_dtype sd, int64_t i) {
    return sd == KVC_F16 ? _cvtsh_ss(((const uint16_t *)scale)[i]) : ((const float *)scale)[i];
}

/* Scales i..i+16 (lanes m) as f32. */
KVC_INLINE __m512 scale16_load(const void *scale, kvc_dtype sd, int64_t i, __mmask16 m) {
    if (sd == KVC_F32) return _mm512_maskz_loadu_ps(m, (const float *)scale + i);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)scale + i));
}

/* ---- dequantize ---------------------------------------------------------- */

/* Lanes m of y[e..e+16) = (float)q * s. */
KVC_INLINE void dequant16(const void *q, int bits, int64_t e, __m512 s, void *y, kvc_dtype yd,
                          __mmask16 m) {
    const __m512i v = q16_load(q, bits, e, m);
    store16(y, yd, e, _mm512_mul_ps(_mm512_cvtepi32_ps(v), s), m);
}

/* y[e..e+32) = (float)q * (s0 on the first 16, s1 on the next 16). */
KVC_INLINE void dequant32(const void *q, int bits, int64_t e, __m512 s0, __m512 s1, void *y,
                          kvc_dtype yd) {
    const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(q16_load(q, bits, e, ALL16)), s0);
    const __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(q16_load(q, bits, e + 16, ALL16)), s1);
    store32(y, yd, e, a, b);
}

/*
 * g == 8, two groups per zmm. Blocks of 16 groups (128 elements): one load
 * of 16 scales, then for the pair (2j, 2j+1) a permute with indices
 * {2j x8, 2j+1 x8} lays scale 2j over lanes 0-7 and 2j+1 over lanes 8-15.
 * The last block may be short: its scale load is masked, and an odd last
 * group is a half (8-lane) step.
 */
KVC_INLINE void dequant_g8(const void *q, int bits, const void *scale, kvc_dtype sd, int64_t n,
                           void *y, kvc_dtype yd) {
    const int64_t ng = n / 8;
    const __m512i pair0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i two = _mm512_set1_epi32(2);
    for (int64_t gb = 0; gb < ng; gb += 16) {
        const int64_t nb = ng - gb < 16 ? ng - gb : 16; /* groups in this block */
        const __m512 s16 = scale16_load(scale, sd, gb, lanes(nb));
        __m512i idx = pair0;
        int64_t j = 0;
        for (; j + 4 <= nb; j += 4) { /* 4 groups: 32 elements */
            const __m512 s0 = _mm512_permutexvar_ps(idx, s16);
            idx = _mm512_add_epi32(idx, two);
            const __m512 s1 = _mm512_permutexvar_ps(idx, s16);
            idx = _mm512_add_epi32(idx, two);
            dequant32(q, bits, (gb + j) * 8, s0, s1, y, yd);
        }
        for (; j + 2 <= nb; j += 2, idx = _mm512_add_epi32(idx, two))
            dequant16(q, bits, (gb + j) * 8, _mm512_permutexvar_ps(idx, s16), y, yd, ALL16);
        if (j < nb) dequant16(q, bits, (gb + j) * 8, _mm512_permutexvar_ps(idx, s16), y, yd, 0xff);
    }
}

/* Any g >= 8: per group, broadcast the scale; 16 lanes per step, then one
 * masked step for the g % 16 left. */
KVC_INLINE void dequant_groups(const void *q, int bits, const void *scale, kvc_dtype sd,
                               int64_t n, int g, void *y, kvc_dtype yd) {
    const __mmask16 tail = lanes(g % 16);
    for (int64_t g0 = 0, gi = 0; g0 < n; g0 += g, gi++) {
        const __m512 s = _mm512_set1_ps(scale_load(scale, sd, gi));
        int64_t e = g0;
        const int64_t full = g0 + g - g % 16;
        for (; e + 32 <= full; e += 32) dequant32(q, bits, e, s, s, y, yd);
        for (; e < full; e += 16) dequant16(q, bits, e, s, y, yd, ALL16);
        if (tail) dequant16(q, bits, e, s, y, yd, tail);
    }
}

KVC_INLINE void dequant_run(const void *q, int bits, const void *scale, kvc_dtype sd, int64_t n,
                            int g, void *y, kvc_dtype yd) {
    if (g == 8) dequant_g8(q, bits, scale, sd, n, y, yd);
    else dequant_groups(q, bits, scale, sd, n, g, y, yd);
}

static void dequantize_rows_avx512(const void *q, int64_t q_stride, int bits, const void *scale,
                                 int64_t s_stride, kvc_dtype sd, int64_t rows, int64_t n, int g,
                                 void *y, int64_t y_stride, kvc_dtype yd) {
    if (g < 8) {
        kvc__kernels_scalar()->dequantize_rows(q, q_stride, bits, scale, s_stride, sd, rows, n, g,
                                               y, y_stride, yd);
        return;
    }
    /* One dtype dispatch for all rows; the row loop runs the inlined kernel. */
#define DQ(b, s, o)                                                                                \
    if (bits == (b) && sd == (s) && yd == (o)) {                                                   \
        for (int64_t r = 0; r < rows; r++)                                                         \
            dequant_run((const char *)q + r * q_stride, (b), (const char *)scale + r * s_stride,   \
                        (s), n, g, (char *)y + r * y_stride, (o));                                  \
        return;                                                                                    \
    }
#define DQ_Y(b, s) DQ(b, s, KVC_F32) DQ(b, s, KVC_F16) DQ(b, s, KVC_BF16)
    DQ_Y(8, KVC_F32)
    DQ_Y(8, KVC_F16)
    DQ_Y(4, KVC_F32)
    DQ_Y(4, KVC_F16)
#undef DQ_Y
#undef DQ
    kvc__kernels_scalar()->dequantize_rows(q, q_stride, bits, scale, s_stride, sd, rows, n, g, y,
                                           y_stride, yd);
}

static void dequantize_avx512(const void *q, int bits, const void *scale, kvc_dtype sd, int64_t n,
                            int g, void *y, kvc_dtype yd) {
    dequantize_rows_avx512(q, 0, bits, scale, 0, sd, 1, n, g, y, 0, yd);
}

/* ---- quantize ------------------------------------------------------------ */

/*
 * scale = max(absmax / qmax, 1e-5f) on every lane, with a true division;
 * vmaxps returns its first operand only if it is greater, exactly the
 * scalar's "if (!(s > 1e-5f)) s = 1e-5f". For f16 scales, also rounds
 * through f16 (returned in *h) since the stored value is the one used.
 */
KVC_INLINE __m512 scale_calc(__m512 absmax, float qmax, kvc_dtype sd, __m256i *h) {
    __m512 s = _mm512_div_ps(absmax, _mm512_set1_ps(qmax));
    s = _mm512_max_ps(s, _mm512_set1_ps(1e-5f));
    if (sd == KVC_F16) {
        *h = _mm512_cvtps_ph(s, RNE);
        s = _mm512_cvtph_ps(*h);
    }
    return s;
}

/* Stores lane `lane` (0 or 8) of the scale vector s (or of its f16 form h)
 * as scale gi. */
KVC_INLINE void scale_put(void *scale, kvc_dtype sd, int64_t gi, __m512 s, __m256i h, int lane) {
    if (sd == KVC_F16) {
        const __m128i part = lane ? _mm256_extracti128_si256(h, 1) : _mm256_castsi256_si128(h);
        ((uint16_t *)scale)[gi] = (uint16_t)_mm_extract_epi16(part, 0);
    } else {
        const __m128 part = lane ? _mm512_extractf32x4_ps(s, 2) : _mm512_castps512_ps128(s);
        ((float *)scale)[gi] = _mm_cvtss_f32(part);
    }
}

/* Lanes m of q[e..e+16) = clamp(rne(x / s), -qmax, qmax). */
KVC_INLINE void quant16(__m512 x, __m512 s, float qmax, void *q, int bits, int64_t e,
                        __mmask16 m) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(x, s), RNE);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-qmax)), _mm512_set1_ps(qmax));
    q16_store(q, bits, e, _mm512_cvttps_epi32(v), m);
}

KVC_INLINE __m512 abs16(__m512 v) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff)));
}

/* Any g >= 8: per group, pass 1 finds absmax (masked tail lanes read 0),
 * pass 2 quantizes 16 lanes per step. */
KVC_INLINE void quant_groups(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *q,
                             void *scale, kvc_dtype sd, int64_t g0) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const __mmask16 tail = lanes(g % 16);
    for (int64_t gi = g0 / g; g0 < n; g0 += g, gi++) {
        const int64_t full = g0 + g - g % 16;
        __m512 m = _mm512_setzero_ps();
        int64_t e = g0;
        for (; e < full; e += 16) m = _mm512_max_ps(m, abs16(load16(x, xd, e, ALL16)));
        if (tail) m = _mm512_max_ps(m, abs16(load16(x, xd, e, tail)));
        __m256i h = _mm256_setzero_si256();
        const __m512 s = scale_calc(_mm512_set1_ps(_mm512_reduce_max_ps(m)), qmax, sd, &h);
        scale_put(scale, sd, gi, s, h, 0);
        for (e = g0; e < full; e += 16) quant16(load16(x, xd, e, ALL16), s, qmax, q, bits, e, ALL16);
        if (tail) quant16(load16(x, xd, e, tail), s, qmax, q, bits, e, tail);
    }
}

/*
 * g == 8 on 16-bit inputs (f16, bf16), 128 elements (16 groups) per block,
 * in far fewer instructions than the generic g8 path:
 *   - absmax on the raw bits: for finite values, |x| is x & 0x7fff and its
 *     unsigned order is the float order, so a group max is vpmaxuw over
 *     16-bit lanes (32 elements per zmm) and converts exactly to f32;
 *   - the reduction is transposed: the block's 4 zmm (group i of zmm k in
 *     128-bit lane i) are merged pairwise (qword unpacks, then dword
 *     shuffles), 15 instructions for all 16 groups, and one vpermw puts the
 *     16 maxima in group order;
 *   - q = cvtps2dq(x / s) with round-to-nearest-even is rne then convert,
 *     and |x / s| < 128 for finite x (s is absmax / qmax, rounded to f16 at
 *     most 2^-11 relative, or 3e-3 near the 1e-5 floor, or 0 quotients for
 *     an f16 Inf scale), so the saturating packs (int32 -> int16 -> int8)
 *     followed by a clamp to [-qmax, qmax] on bytes equal the scalar clamp.
 */
KVC_INLINE __m512 h16x16_to_f32_fin(const uint16_t *p, kvc_dtype xd) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return xd == KVC_F16 ? _mm512_cvtph_ps(h) : bf16x16_to_f32(h); /* finite: no NaN fix-up */
}

/* The 16 group maxima of |x| over a 128-element block as raw 16-bit
 * magnitudes, in group order (a group holding NaN/Inf has at least the
 * dtype's Inf bits: the magnitude order extends past the finite values). */
KVC_INLINE __m256i quant_g8_h16_absmax(const uint16_t *x) {
    const __m512i absm = _mm512_set1_epi16(0x7fff);
    const __m512i A = _mm512_and_si512(_mm512_loadu_si512(x), absm);
    const __m512i B = _mm512_and_si512(_mm512_loadu_si512(x + 32), absm);
    const __m512i C = _mm512_and_si512(_mm512_loadu_si512(x + 64), absm);
    const __m512i D = _mm512_and_si512(_mm512_loadu_si512(x + 96), absm);
    /* lane i: words 0-3 of group i (A) / 8+i (C), words 4-7 of 4+i (B) / 12+i (D) */
    const __m512i p = _mm512_max_epu16(_mm512_unpacklo_epi64(A, B), _mm512_unpackhi_epi64(A, B));
    const __m512i r = _mm512_max_epu16(_mm512_unpacklo_epi64(C, D), _mm512_unpackhi_epi64(C, D));
    /* lane i, dword k: two words of group 4k + i */
    const __m512 pf = _mm512_castsi512_ps(p), rf = _mm512_castsi512_ps(r);
    __m512i t = _mm512_max_epu16(
        _mm512_castps_si512(_mm512_shuffle_ps(pf, rf, _MM_SHUFFLE(2, 0, 2, 0))),
        _mm512_castps_si512(_mm512_shuffle_ps(pf, rf, _MM_SHUFFLE(3, 1, 3, 1))));
    t = _mm512_max_epu16(t, _mm512_srli_epi32(t, 16));
    /* group j sits at word 8 (j % 4) + 2 (j / 4) */
    const __m512i gidx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 30, 22,
                                          14, 6, 28, 20, 12, 4, 26, 18, 10, 2, 24, 16, 8, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi16(gidx, t));
}

/* Stores 16 scales (h: their f16 bits, s: float32) at group gi. */
KVC_INLINE void scale16_put(void *scale, kvc_dtype sd, int64_t gi, __m512 s, __m256i h,
                            int stream) {
    if (sd == KVC_F16) {
        __m256i *d = (__m256i *)((uint16_t *)scale + gi);
        if (stream) _mm256_stream_si256(d, h);
        else _mm256_storeu_si256(d, h);
    } else {
        float *d = (float *)scale + gi;
        if (stream) _mm512_stream_ps(d, s);
        else _mm512_storeu_ps(d, s);
    }
}

/* Phase 1 of a 128-element block: the 16 group scales, stored; returns
 * their reciprocals. */
KVC_INLINE __m512 quant_g8_h16_scales(const uint16_t *x, kvc_dtype xd, float qmax, void *scale,
                                      kvc_dtype sd, int stream) {
    const __m256i m16 = quant_g8_h16_absmax(x);
    const __m512 absmax = xd == KVC_F16 ? _mm512_cvtph_ps(m16) : bf16x16_to_f32(m16);
    __m256i h = _mm256_setzero_si256();
    const __m512 s16 = scale_calc(absmax, qmax, sd, &h);
    scale16_put(scale, sd, 0, s16, h, stream);
    return _mm512_div_ps(_mm512_set1_ps(1.0f), s16);
}

/* The 8 vectors of int32 codes of a 128-element block as its q bytes (the
 * packs and clamp are explained above). */
KVC_INLINE void q128_store(const __m512i v[8], int bits, void *q, int stream) {
    const int8_t qmax = bits == 8 ? 127 : 7;
    /* after packs_epi32 + packs_epi16, 128-bit lane l holds dwords
     * v0[4l..4l+3], v1[..], v2[..], v3[..]: dword 4k + l goes back to 4l + k */
    const __m512i unpack = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i lo = _mm512_set1_epi8((char)-qmax), hi = _mm512_set1_epi8((char)qmax);
    __m512i b[2];
    for (int half = 0; half < 2; half++) {
        __m512i w = _mm512_packs_epi16(_mm512_packs_epi32(v[4 * half], v[4 * half + 1]),
                                       _mm512_packs_epi32(v[4 * half + 2], v[4 * half + 3]));
        w = _mm512_permutexvar_epi32(unpack, w);
        w = _mm512_max_epi8(w, lo);
        if (bits == 4) w = _mm512_min_epi8(w, hi);
        b[half] = w;
    }
    if (bits == 8) {
        if (stream) {
            _mm512_stream_si512(q, b[0]);
            _mm512_stream_si512((void *)((int8_t *)q + 64), b[1]);
        } else {
            _mm512_storeu_si512(q, b[0]);
            _mm512_storeu_si512((int8_t *)q + 64, b[1]);
        }
    } else {
        /* byte 2i low nibble, 2i+1 high nibble: per word, (w & 0x0f) | ((w >> 4) & 0xf0) */
        const __m512i sel = _mm512_set1_epi16(0x000f);
        for (int half = 0; half < 2; half++) {
            const __m512i w = _mm512_ternarylogic_epi32(sel, b[half],
                                                        _mm512_srli_epi16(b[half], 4), 0xca);
            __m256i *dst = (__m256i *)((uint8_t *)q + 32 * half);
            if (stream) _mm256_stream_si256(dst, _mm512_cvtepi16_epi8(w));
            else _mm256_storeu_si256(dst, _mm512_cvtepi16_epi8(w));
        }
    }
}

/*
 * Phase 2: q = rne(x / s) for the block's 8 vectors, computed as x * (1 / s)
 * (a zmm division costs ~6 cycles): the product is within 1.6e-5 of x / s
 * (|x / s| < 128, two roundings of 2^-24), so it rounds the same way unless
 * it lies within 3e-5 of a half-integer; vreduceps gives its distance to
 * the nearest integer; returns 1 for such a block (rare, but every exact
 * tie), which the caller redoes with quant_g8_h16_div.
 */
KVC_INLINE int quant_g8_h16_values(const uint16_t *x, kvc_dtype xd, int bits, void *q,
                                   int stream, __m512 inv16) {
    const __m512i pair0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i two = _mm512_set1_epi32(2);
    const __m512 near_half = _mm512_set1_ps(0.5f - 0x1p-15f);
    __m512i v[8];
    __m512 far[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}; /* max |y - rne(y)|, 2 chains */
    __m512i idx = pair0;
    for (int i = 0; i < 8; i++, idx = _mm512_add_epi32(idx, two)) {
        const __m512 y = _mm512_mul_ps(h16x16_to_f32_fin(x + 16 * i, xd),
                                       _mm512_permutexvar_ps(idx, inv16));
        v[i] = _mm512_cvt_roundps_epi32(y, RNE);
        /* vrangeps imm 0x0b: max of |a| and |b| */
        far[i & 1] = _mm512_range_ps(
            far[i & 1], _mm512_reduce_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), 0x0b);
    }
    q128_store(v, bits, q, stream);
    return _mm512_cmp_ps_mask(_mm512_range_ps(far[0], far[1], 0x0b), near_half, _CMP_GE_OQ) != 0;
}

/* The rare redo of a block whose products came near a half-integer: its
 * values again with divisions by its 16 scales (as stored at `scale`),
 * overwriting what quant_g8_h16_values wrote. Out of line and called after
 * the block loop: a call inside it made the compiler give up the loop's
 * vector constants (1.5x slower). */
static __attribute__((noinline, cold)) void quant_g8_h16_div(const uint16_t *x, kvc_dtype xd,
                                                             int bits, void *q, int stream,
                                                             const void *scale, kvc_dtype sd) {
    const __m512 s16 = sd == KVC_F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scale))
                                     : _mm512_loadu_ps((const float *)scale);
    const __m512i two = _mm512_set1_epi32(2);
    __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512i v[8];
    for (int i = 0; i < 8; i++, idx = _mm512_add_epi32(idx, two))
        v[i] = _mm512_cvt_roundps_epi32(
            _mm512_div_ps(h16x16_to_f32_fin(x + 16 * i, xd), _mm512_permutexvar_ps(idx, s16)), RNE);
    q128_store(v, bits, q, stream);
}

/* The values of nb (<= 8) blocks from element e0 on, from their
 * reciprocals inv[i]; then, after the loop and out of line, the blocks to
 * redo with divisions by their stored scales (scale: the row's, F16/F32). */
KVC_INLINE void quant_g8_h16_blocks(const uint16_t *x, kvc_dtype xd, const int nb, int bits,
                                    void *q, int stream, const __m512 *inv, const void *scale,
                                    kvc_dtype sd, int64_t e0) {
    unsigned redo = 0;
    for (int i = 0; i < nb; i++) {
        const int64_t e = e0 + 128 * i;
        redo |= (unsigned)quant_g8_h16_values(x + e, xd, bits,
                                              (int8_t *)q + (bits == 8 ? e : e / 2), stream,
                                              inv[i])
                << i;
    }
    for (; redo; redo &= redo - 1) {
        const int64_t e = e0 + 128 * (int64_t)__builtin_ctz(redo);
        quant_g8_h16_div(x + e, xd, bits, (int8_t *)q + (bits == 8 ? e : e / 2), stream,
                         (const char *)scale + (e / 8) * (sd == KVC_F16 ? 2 : 4), sd);
    }
}

/* Runs of up to 8 blocks: all scales first, then all values, so the long
 * absmax -> scale -> reciprocal chain of one block does not stall the
 * quantization of the others (out-of-order execution sees short loops).
 * stream: non-temporal stores when q and scale are aligned for them (a
 * block writes 128 / 64 q bytes and 32 / 64 scale bytes). */
KVC_INLINE int64_t quant_g8_h16(const uint16_t *x, kvc_dtype xd, int64_t n, int bits, void *q,
                                void *scale, kvc_dtype sd, int stream) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const size_t sbytes = sd == KVC_F16 ? 2 : 4;
    stream = stream && ((uintptr_t)q & (bits == 8 ? 63 : 31)) == 0 &&
             ((uintptr_t)scale & (sd == KVC_F16 ? 31 : 63)) == 0;
    __m512 inv[8];
    int64_t e = 0;
    while (e + 128 <= n) {
        int nb = (int)((n - e) / 128);
        if (nb > 8) nb = 8;
        for (int i = 0; i < nb; i++)
            inv[i] = quant_g8_h16_scales(x + e + 128 * i, xd, qmax,
                                         (char *)scale + ((e / 8) + 16 * i) * sbytes, sd, stream);
        quant_g8_h16_blocks(x, xd, nb, bits, q, stream, inv, scale, sd, e);
        e += 128 * (int64_t)nb;
    }
    return e;
}

/* absmax of each 8-lane half, on every lane of that half: swap neighbours,
 * pairs, then 128-bit blocks within each 256-bit half. */
KVC_INLINE __m512 absmax_halves(__m512 v) {
    __m512 a = abs16(v);
    a = _mm512_max_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
    a = _mm512_max_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm512_max_ps(a, _mm512_shuffle_f32x4(a, a, _MM_SHUFFLE(2, 3, 0, 1)));
}

/*
 * g == 8, two groups per zmm. Blocks of 128 elements (16 groups) first: the
 * 16 group maxima are gathered into one vector (a masked permute per input
 * vector drops its two maxima on lanes 2i, 2i+1), so the scale division, the
 * f16 rounding and the scale store happen once per block instead of once
 * per vector. Each vector then takes its two scales back with a permute
 * ({2i x8, 2i+1 x8}, as in dequant_g8). Leftover vectors go one at a time;
 * an odd last group takes the generic path.
 */
KVC_INLINE void quant_g8(const void *x, kvc_dtype xd, int64_t n, int bits, void *q, void *scale,
                         kvc_dtype sd, int stream) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const __m512i from_halves = _mm512_setr_epi32(0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8);
    const __m512i pair0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i two = _mm512_set1_epi32(2);
    int64_t e = 0;
    if (xd != KVC_F32) e = quant_g8_h16((const uint16_t *)x, xd, n, bits, q, scale, sd, stream);
    for (; e + 128 <= n; e += 128) {
        __m512 v[8], m = _mm512_setzero_ps();
        for (int i = 0; i < 8; i++) {
            v[i] = load16(x, xd, e + 16 * i, ALL16);
            m = _mm512_mask_permutexvar_ps(m, (__mmask16)(3u << (2 * i)), from_halves,
                                           absmax_halves(v[i]));
        }
        __m256i h = _mm256_setzero_si256();
        const __m512 s16 = scale_calc(m, qmax, sd, &h);
        if (sd == KVC_F16) _mm256_storeu_si256((__m256i *)((uint16_t *)scale + e / 8), h);
        else _mm512_storeu_ps((float *)scale + e / 8, s16);
        __m512i idx = pair0;
        for (int i = 0; i < 8; i++, idx = _mm512_add_epi32(idx, two))
            quant16(v[i], _mm512_permutexvar_ps(idx, s16), qmax, q, bits, e + 16 * i, ALL16);
    }
    for (; e + 16 <= n; e += 16) {
        const __m512 v = load16(x, xd, e, ALL16);
        __m256i h = _mm256_setzero_si256();
        const __m512 s = scale_calc(absmax_halves(v), qmax, sd, &h);
        scale_put(scale, sd, e / 8, s, h, 0);
        scale_put(scale, sd, e / 8 + 1, s, h, 8);
        quant16(v, s, qmax, q, bits, e, ALL16);
    }
    if (e < n) quant_groups(x, xd, n, bits, 8, q, scale, sd, e);
}

KVC_INLINE void quant_run(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *q,
                          void *scale, kvc_dtype sd) {
    if (g == 8) quant_g8(x, xd, n, bits, q, scale, sd, 0);
    else quant_groups(x, xd, n, bits, g, q, scale, sd, 0);
}

static void quantize_avx512(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *q,
                            void *scale, kvc_dtype sd) {
    if (g < 8) {
        kvc__kernels_scalar()->quantize(x, xd, n, bits, g, q, scale, sd);
        return;
    }
#define QZ(b, in, s)                                                                               \
    if (bits == (b) && xd == (in) && sd == (s)) {                                                  \
        quant_run(x, (in), n, (b), g, q, scale, (s));                                              \
        return;                                                                                    \
    }
#define QZ_X(b, s) QZ(b, KVC_F32, s) QZ(b, KVC_F16, s) QZ(b, KVC_BF16, s)
    QZ_X(8, KVC_F32)
    QZ_X(8, KVC_F16)
    QZ_X(4, KVC_F32)
    QZ_X(4, KVC_F16)
#undef QZ_X
#undef QZ
    kvc__kernels_scalar()->quantize(x, xd, n, bits, g, q, scale, sd);
}

/* quantize, with non-temporal stores on the 16-bit input, group 8 path
 * (the paged append's); other cases store normally. */
static void quantize_stream_avx512(const void *x, kvc_dtype xd, int64_t n, int bits, int g,
                                   void *q, void *scale, kvc_dtype sd) {
    if (g == 8 && (xd == KVC_F16 || xd == KVC_BF16) && (bits == 8 || bits == 4) &&
        (sd == KVC_F16 || sd == KVC_F32)) {
        quant_g8(x, xd, n, bits, q, scale, sd, 1);
        _mm_sfence(); /* order the streamed bytes before whatever signals completion */
    } else {
        quantize_avx512(x, xd, n, bits, g, q, scale, sd);
    }
}

/* ---- quantize in two passes (quant_scales / quant_values) ------------------ */

/* g == 8 on 16-bit input: blocks of 128 by quant_g8_h16_absmax (the block's
 * largest magnitude pattern against the limit's: NaN/Inf have the largest),
 * then 16 / 8 elements at a time. */
KVC_INLINE int qscales_g8_h16(const uint16_t *x, kvc_dtype xd, int64_t n, float qmax,
                              float limit, void *scale, kvc_dtype sd) {
    __m256i big = _mm256_setzero_si256();
    int64_t e = 0;
    for (; e + 128 <= n; e += 128) {
        const __m256i m16 = quant_g8_h16_absmax(x + e);
        big = _mm256_max_epu16(big, m16);
        __m256i h = _mm256_setzero_si256();
        const __m512 a = xd == KVC_F16 ? _mm512_cvtph_ps(m16) : bf16x16_to_f32(m16);
        const __m512 s = scale_calc(a, qmax, sd, &h); /* sets h: not inside the call below */
        scale16_put(scale, sd, e / 8, s, h, 0);
    }
    const __m256i lim = _mm256_set1_epi16((short)kvc__limit_bits16(limit, xd));
    int finite = _mm256_cmpge_epu16_mask(big, lim) == 0;
    if (e < n) finite = finite && all_finite_avx512(x + e, xd, n - e, limit);
    for (; e < n; e += 16) { /* n % 8 == 0: 16 lanes, or 8 at the end */
        const __mmask16 m = n - e >= 16 ? ALL16 : lanes(8);
        __m256i h = _mm256_setzero_si256();
        const __m512 s = scale_calc(absmax_halves(load16(x, xd, e, m)), qmax, sd, &h);
        scale_put(scale, sd, e / 8, s, h, 0);
        if (m == ALL16) scale_put(scale, sd, e / 8 + 1, s, h, 8);
    }
    return finite;
}

/* nb (<= 8) blocks from element e: their scales loaded, copied out and
 * inverted first, then their values, then any redo; returns the next e.
 * Called with nb == 8 as a constant, the loops unroll and the reciprocals
 * stay in registers. */
KVC_INLINE int64_t qvalues_run(const uint16_t *x, kvc_dtype xd, const int nb, int bits,
                               const void *sin, void *q, void *scale, kvc_dtype sd, int stream,
                               int64_t e) {
    __m512 inv[8];
    for (int i = 0; i < nb; i++) {
        const int64_t gi = e / 8 + 16 * i;
        __m256i h = _mm256_setzero_si256();
        __m512 s16;
        if (sd == KVC_F16) {
            h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)sin + gi));
            s16 = _mm512_cvtph_ps(h);
        } else {
            s16 = _mm512_loadu_ps((const float *)sin + gi);
        }
        scale16_put(scale, sd, gi, s16, h, stream);
        inv[i] = _mm512_div_ps(_mm512_set1_ps(1.0f), s16);
    }
    quant_g8_h16_blocks(x, xd, nb, bits, q, stream, inv, sin, sd, e);
    return e + 128 * (int64_t)nb;
}

/* Blocks of 128 in runs of 8 (qvalues_run); the rest 16 / 8 elements at a
 * time with divisions. stream: non-temporal stores when q and scale are
 * aligned for them. */
KVC_INLINE void qvalues_g8_h16(const uint16_t *x, kvc_dtype xd, int64_t n, int bits,
                               const void *sin, void *q, void *scale, kvc_dtype sd, int stream) {
    const int sst = stream;
    stream = stream && ((uintptr_t)q & (bits == 8 ? 63 : 31)) == 0 &&
             ((uintptr_t)scale & (sd == KVC_F16 ? 31 : 63)) == 0;
    int64_t e = 0;
    while (e + 128 <= n) { /* runs of 8 blocks (fewer at the end): reciprocals, values, redos */
        const int nb = n - e >= 1024 ? 8 : (int)((n - e) / 128);
        if (nb == 8) e = qvalues_run(x, xd, 8, bits, sin, q, scale, sd, stream, e);
        else e = qvalues_run(x, xd, nb, bits, sin, q, scale, sd, stream, e);
    }
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const size_t sb = sd == KVC_F16 ? 2 : 4;
    for (; e < n; e += 16) {
        const int64_t gi = e / 8;
        const int two = n - e >= 16;
        const float s0 = scale_load(sin, sd, gi), s1 = scale_load(sin, sd, two ? gi + 1 : gi);
        const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
        const __mmask16 m = two ? ALL16 : lanes(8);
        quant16(load16(x, xd, e, m), sv, qmax, q, bits, e, m);
        memcpy((char *)scale + gi * sb, (const char *)sin + gi * sb, (two ? 2 : 1) * sb);
    }
    if (sst) _mm_sfence(); /* order streamed bytes before whatever signals completion */
}

static int quant_scales_avx512(const void *x, kvc_dtype xd, int64_t n, int bits, int g,
                               void *scale, kvc_dtype sd) {
    const float qmax = bits == 8 ? 127.0f : 7.0f, limit = kvc__quant_limit(bits, sd);
    if (g == 8 && (bits == 8 || bits == 4)) {
#define QS(in, s)                                                                                  \
    if (xd == (in) && sd == (s))                                                                   \
        return qscales_g8_h16((const uint16_t *)x, (in), n, qmax, limit, scale, (s));
        QS(KVC_F16, KVC_F16) QS(KVC_F16, KVC_F32) QS(KVC_BF16, KVC_F16) QS(KVC_BF16, KVC_F32)
#undef QS
    }
    return kvc__kernels_scalar()->quant_scales(x, xd, n, bits, g, scale, sd);
}

static void quant_values_avx512(const void *x, kvc_dtype xd, int64_t n, int bits, int g,
                                const void *sin, void *q, void *scale, kvc_dtype sd, int stream) {
    if (g == 8) {
#define QV(b, in, s)                                                                               \
    if (bits == (b) && xd == (in) && sd == (s)) {                                                  \
        qvalues_g8_h16((const uint16_t *)x, (in), n, (b), sin, q, scale, (s), stream);            \
        return;                                                                                    \
    }
        QV(8, KVC_F16, KVC_F16) QV(8, KVC_F16, KVC_F32) QV(8, KVC_BF16, KVC_F16)
        QV(8, KVC_BF16, KVC_F32) QV(4, KVC_F16, KVC_F16) QV(4, KVC_F16, KVC_F32)
        QV(4, KVC_BF16, KVC_F16) QV(4, KVC_BF16, KVC_F32)
#undef QV
    }
    kvc__kernels_scalar()->quant_values(x, xd, n, bits, g, sin, q, scale, sd, stream);
}

/* ---- decode attention (attn_body.h, 16 lanes) ---------------------------- */

/* One K/V row -> D floats (dst padded to a multiple of 16: the last step
 * stores 16 lanes, zeros past D). Float rows: plain widening (a NaN stays a
 * NaN). Quantized rows with group % 8 == 0: scales per 8-lane half; other
 * groups element by element. */
static void ab_row_to_f32(const void *src, kvc_dtype dt, const void *sc, kvc_dtype sd, int g,
                          int D, float *dst) {
    int e = 0;
    switch (dt) {
    case KVC_F32:
        for (; e < D; e += 16)
            _mm512_store_ps(dst + e, _mm512_maskz_loadu_ps(D - e >= 16 ? ALL16 : lanes(D - e),
                                                           (const float *)src + e));
        return;
    case KVC_F16:
        for (; e + 16 <= D; e += 16)
            _mm512_store_ps(dst + e, _mm512_cvtph_ps(_mm256_loadu_si256(
                                         (const __m256i *)((const uint16_t *)src + e))));
        if (e < D)
            _mm512_store_ps(dst + e, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(
                                         lanes(D - e), (const uint16_t *)src + e)));
        return;
    case KVC_BF16:
        for (; e < D; e += 16) {
            const __m256i h = _mm256_maskz_loadu_epi16(D - e >= 16 ? ALL16 : lanes(D - e),
                                                       (const uint16_t *)src + e);
            _mm512_store_ps(dst + e, bf16x16_to_f32(h));
        }
        return;
    default: break;
    }
    const int bits = dt == KVC_I8 ? 8 : 4;
    if (g % 8 == 0) {
        /* Scale index of each 8-lane half, kept incrementally: an integer
         * division per step cost more than the conversion itself. */
        const int halves_per_group = g / 8;
        int gi = 0, left = halves_per_group; /* group of lane 0, halves left in it */
        for (; e < D; e += 16) {
            const __mmask16 m = D - e >= 16 ? ALL16 : lanes(D - e);
            const float s0 = scale_load(sc, sd, gi);
            if (--left == 0) gi++, left = halves_per_group;
            const float s1 = e + 8 < D ? scale_load(sc, sd, gi) : s0;
            if (--left == 0) gi++, left = halves_per_group;
            const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
            const __m512 v = _mm512_cvtepi32_ps(q16_load(src, bits, e, m));
            _mm512_store_ps(dst + e, _mm512_mul_ps(v, sv));
        }
        return;
    }
    kvc__dequant_row_tail(src, dt, sc, sd, g, e, D, dst);
}

/* AB_LOADK: 16 elements [e, e+16) of a K/V row as float32, unscaled (int8/
 * int4 widened exactly); dt is a constant after inlining. */
KVC_INLINE __m512 ab_loadk16(const void *p, kvc_dtype dt, int e) {
    switch (dt) {
    case KVC_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + e)));
    case KVC_BF16:
        return bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + e)));
    case KVC_I8:
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + e))));
    case KVC_I4: return _mm512_cvtepi32_ps(i4x16_load((const uint8_t *)p + e / 2, ALL16));
    default: return _mm512_loadu_ps((const float *)p + e);
    }
}

/*
 * AB_RED4: out[i] = sum of the lanes of ai, transposed: unpack pairs of
 * vectors, then shuffle quads, leaves (a0, a1, a2, a3) partial sums in every
 * 128-bit block; two halving adds finish. 12 operations for 4 sums, and
 * each sum is formed the same way whatever the other three hold.
 */
KVC_INLINE void ab_red4_16(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float *out) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* AB_MAX4: out[i] = max of the lanes of ai (the same transposition). */
KVC_INLINE void ab_max4_16(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float *out) {
    const __m512 t0 = _mm512_max_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t1 = _mm512_max_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 u = _mm512_max_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    _mm_storeu_ps(out, _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* AB_SCALEROW: the n scales of one row as float32, 16 per masked step. */
KVC_INLINE void ab_scalerow16(const void *sc, kvc_dtype sd, int n, float *dst) {
    for (int e = 0; e < n; e += 16) {
        const __mmask16 m = n - e >= 16 ? ALL16 : lanes(n - e);
        _mm512_mask_storeu_ps(dst + e, m, scale16_load(sc, sd, e, m));
    }
}

/* AB_GATHER: lanes i = p[i * stride] (16 floats from L1). */
KVC_INLINE __m512 ab_gather16(const float *p, int stride) {
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(stride));
    return _mm512_i32gather_ps(idx, p, 4);
}

/* AB_SCALE2: lanes 0-7 = p[0], lanes 8-15 = p[1] (the scales of a vector
 * that spans two quant groups of 8). */
KVC_INLINE __m512 ab_scale2_16(const float *p) {
    return _mm512_shuffle_f32x4(_mm512_set1_ps(p[0]), _mm512_set1_ps(p[1]), 0x44);
}

typedef __m512 ab_vec;
#define AB_VL 16
#define AB_LOAD(p) _mm512_load_ps(p)
#define AB_STORE(p, v) _mm512_store_ps((p), (v))
#define AB_ZERO() _mm512_setzero_ps()
#define AB_SET1(x) _mm512_set1_ps(x)
#define AB_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define AB_MUL(a, b) _mm512_mul_ps((a), (b))
#define AB_ADD(a, b) _mm512_add_ps((a), (b))
#define AB_SUB(a, b) _mm512_sub_ps((a), (b))
#define AB_MAX(a, b) _mm512_max_ps((a), (b))
#define AB_HMAX(v) _mm512_reduce_max_ps(v)
#define AB_EXP2(v) kvc__exp2_16(v)
#define AB_LOADK(p, dt, e) ab_loadk16((p), (dt), (e))
#define AB_RED4(a0, a1, a2, a3, out) ab_red4_16((a0), (a1), (a2), (a3), (out))
#define AB_MAX4(a0, a1, a2, a3, out) ab_max4_16((a0), (a1), (a2), (a3), (out))
#define AB_SCALEROW(sc, sd, n, dst) ab_scalerow16((sc), (sd), (n), (dst))
#define AB_GATHER(p, stride) ab_gather16((p), (stride))
#define AB_SCALE2(p) ab_scale2_16(p)
#define AB_NH 4
#define AB_NC 4
#define AB_NAME attn_decode_avx512
#include "attn_body.h"

static void softcap_avx512(float *s, int64_t n, float cap, float mul) {
    kvc__softcap_row(s, n, cap, mul);
}

/* Stages h = 1..8 inside each vector (lane i takes lane i ^ h: lanes with
 * i & h clear keep x_i + x_{i+h}, the others x_{i-h} - x_i, the reference's
 * operands in its order), then whole vectors. */
static void hadamard_avx512(float *x, int32_t n) {
    if (n < 16) {
        kvc__hadamard_ref(x, n);
        return;
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int32_t i = 0; i < n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        for (int h = 1; h < 16; h *= 2) {
            const __m512i hv = _mm512_set1_epi32(h);
            const __m512 y = _mm512_permutexvar_ps(_mm512_xor_si512(lane, hv), v);
            v = _mm512_mask_sub_ps(_mm512_add_ps(v, y), _mm512_test_epi32_mask(lane, hv), y, v);
        }
        _mm512_storeu_ps(x + i, v);
    }
    for (int32_t h = 16; h < n; h *= 2)
        for (int32_t i0 = 0; i0 < n; i0 += 2 * h)
            for (int32_t i = i0; i < i0 + h; i += 16) {
                const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + h);
                _mm512_storeu_ps(x + i, _mm512_add_ps(a, b));
                _mm512_storeu_ps(x + i + h, _mm512_sub_ps(a, b));
            }
    const __m512 s = _mm512_set1_ps((float)(1.0 / sqrt((double)n)));
    for (int32_t i = 0; i < n; i += 16)
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), s));
}

/* copy with 64-byte non-temporal stores on dst's aligned lines (kernels.h
 * copy_stream). */
static void copy_stream_avx512(void *dst, const void *src, size_t n) {
    char *d = dst;
    const char *s = src;
    size_t i = (size_t)(-(uintptr_t)d & 63);
    if (i > n) i = n;
    if (i) memcpy(d, s, i);
    for (; i + 256 <= n; i += 256) {
        const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
        const __m512i c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
        _mm512_stream_si512((void *)(d + i), a);
        _mm512_stream_si512((void *)(d + i + 64), b);
        _mm512_stream_si512((void *)(d + i + 128), c);
        _mm512_stream_si512((void *)(d + i + 192), e);
    }
    for (; i + 64 <= n; i += 64) _mm512_stream_si512((void *)(d + i), _mm512_loadu_si512(s + i));
    if (i < n) memcpy(d + i, s + i, n - i);
}

static const kvc_kernels table = {
    KVC_ISA_AVX512, copy_avx512, convert_avx512, all_finite_avx512, quantize_avx512,
    quantize_stream_avx512, quant_scales_avx512, quant_values_avx512, softcap_avx512,
    hadamard_avx512,
    dequantize_avx512, dequantize_rows_avx512, attn_decode_avx512,
    NULL, NULL, NULL, NULL, NULL, /* no AMX decode */
    copy_stream_avx512,
};

const kvc_kernels *kvc__kernels_avx512(void) { return &table; }
