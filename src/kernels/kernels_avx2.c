/*
 * AVX2 + FMA + F16C kernels: 8 float32 lanes per ymm. This file is compiled
 * with -mavx2 -mfma -mf16c and only called after dispatch.c has checked the
 * CPU. Every result is bit-identical to kernels_scalar.c:
 *   - f32 <-> f16 uses F16C with round-to-nearest-even (MXCSR default: no
 *     FTZ/DAZ, so subnormals convert exactly, like the scalar code);
 *   - f32 -> bf16 is the scalar integer rounding done on 8 lanes;
 *   - x / scale and absmax / qmax are true divisions (vdivps), never a
 *     reciprocal; rounding is vroundps to nearest even, like nearbyintf;
 *   - only intrinsics do float math here, so nothing gets contracted to FMA.
 *
 * Fast paths: convert and all_finite for any n (a scalar tail below 8
 * elements); quantize and dequantize when the group size g is a multiple of
 * 8, which covers every cache shape that matters (Dh = 64/128 rows with
 * g = 8..Dh, and runs of many rows: n = heads * Dh). Other g go to the
 * scalar table, correct by definition.
 *
 * Inner loops are instantiated per dtype combination (always_inline helpers
 * called with constant dtypes), so no dtype switch runs per element.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels.h"

#define KVC_INLINE static inline __attribute__((always_inline))

/* Round to nearest even, no precision exception: the F16C / vroundps mode. */
#define RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* ---- pointers ------------------------------------------------------------ */

KVC_INLINE size_t float_size(kvc_dtype d) { return d == KVC_F32 ? 4u : 2u; }

KVC_INLINE const void *cat(const void *p, kvc_dtype d, int64_t i) {
    return (const char *)p + (size_t)i * float_size(d);
}

KVC_INLINE void *at(void *p, kvc_dtype d, int64_t i) {
    return (char *)p + (size_t)i * float_size(d);
}

/* ---- 8-lane element conversions ------------------------------------------ */

/*
 * 8 f16 -> 8 f32, exactly as kvc_f16_to_f32. vcvtph2ps quiets signalling
 * NaNs (sets the top mantissa bit) while the scalar keeps the payload as it
 * is, so NaN lanes, rare, are rebuilt from the f16 bits:
 * sign << 16 | 0x7f800000 | mant << 13.
 */
KVC_INLINE __m256 f16x8_to_f32(__m128i h) {
    __m256 f = _mm256_cvtph_ps(h);
    const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    if (__builtin_expect(_mm256_movemask_ps(nan) != 0, 0)) {
        const __m256i h32 = _mm256_cvtepu16_epi32(h);
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x8000)), 16);
        const __m256i mant = _mm256_slli_epi32(_mm256_and_si256(h32, _mm256_set1_epi32(0x3ff)), 13);
        const __m256i fix =
            _mm256_or_si256(_mm256_or_si256(sign, mant), _mm256_set1_epi32(0x7f800000));
        f = _mm256_blendv_ps(f, _mm256_castsi256_ps(fix), nan);
    }
    return f;
}

/* 8 f32 -> 8 f16. F16C already matches the scalar on NaN:
 * sign | 0x7c00 | 0x200 | mant >> 13. */
KVC_INLINE __m128i f32x8_to_f16(__m256 f) { return _mm256_cvtps_ph(f, RNE); }

KVC_INLINE __m256 bf16x8_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/*
 * 8 f32 -> 8 bf16, the scalar rule on each lane: NaN -> (u >> 16) | 0x40,
 * else (u + 0x7fff + ((u >> 16) & 1)) >> 16 (nearest even; subnormals kept,
 * overflow carries into Inf). The 32-bit results fit in 16 bits, so the
 * unsigned saturating pack is a plain narrowing.
 */
KVC_INLINE __m128i f32x8_to_bf16(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)),
                                          _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    /* |u| > Inf as signed ints (both sides positive) <=> NaN. */
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* Loads 8 elements x[i..i+8) of dtype d as f32. */
KVC_INLINE __m256 load8(const void *x, kvc_dtype d, int64_t i) {
    if (d == KVC_F32) return _mm256_loadu_ps((const float *)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    return d == KVC_F16 ? f16x8_to_f32(h) : bf16x8_to_f32(h);
}

/* Stores 8 f32 as y[i..i+8) of dtype d. */
KVC_INLINE void store8(void *y, kvc_dtype d, int64_t i, __m256 v) {
    if (d == KVC_F32) {
        _mm256_storeu_ps((float *)y + i, v);
        return;
    }
    const __m128i h = d == KVC_F16 ? f32x8_to_f16(v) : f32x8_to_bf16(v);
    _mm_storeu_si128((__m128i *)((uint16_t *)y + i), h);
}

/* ---- convert ------------------------------------------------------------- */

KVC_INLINE void convert_run(const void *src, kvc_dtype sd, void *dst, kvc_dtype dd, int64_t n) {
    int64_t i = 0;
    /* Two vectors per iteration: enough loads in flight to stay memory bound. */
    for (; i + 16 <= n; i += 16) {
        const __m256 a = load8(src, sd, i), b = load8(src, sd, i + 8);
        store8(dst, dd, i, a);
        store8(dst, dd, i + 8, b);
    }
    for (; i + 8 <= n; i += 8) store8(dst, dd, i, load8(src, sd, i));
    if (i < n) kvc__kernels_scalar()->convert(cat(src, sd, i), sd, at(dst, dd, i), dd, n - i);
}

/* Four vectors per iteration, then one at a time, then bytes. */
static void copy_avx2(void *dst, const void *src, size_t n) {
    char *d = dst;
    const char *s = src;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        const __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        const __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_storeu_si256((__m256i *)(d + i), a);
        _mm256_storeu_si256((__m256i *)(d + i + 32), b);
        _mm256_storeu_si256((__m256i *)(d + i + 64), c);
        _mm256_storeu_si256((__m256i *)(d + i + 96), e);
    }
    for (; i + 32 <= n; i += 32)
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
    if (i < n) memcpy(d + i, s + i, n - i);
}

static void convert_avx2(const void *src, kvc_dtype sd, void *dst, kvc_dtype dd, int64_t n) {
    if (sd == dd) {
        copy_avx2(dst, src, (size_t)n * float_size(sd));
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
 * have the largest patterns, so limit INFINITY is the finiteness test. The
 * patterns are below 2^31 (2^15), so signed compares do. Checked 32
 * elements (f32) or 64 (16-bit) per early-exit test. */
static int all_finite_avx2(const void *x, kvc_dtype xd, int64_t n, float limit) {
    int64_t i = 0;
    if (xd == KVC_F32) {
        uint32_t lb;
        memcpy(&lb, &limit, 4);
        const __m256i abs = _mm256_set1_epi32(0x7fffffff), lim = _mm256_set1_epi32((int)lb - 1);
        const __m256i *p = (const __m256i *)x;
        for (; i + 32 <= n; i += 32, p += 4) {
            __m256i bad = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_and_si256(_mm256_loadu_si256(p + k), abs);
                bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(v, lim));
            }
            if (!_mm256_testz_si256(bad, bad)) return 0;
        }
    } else {
        const __m256i abs = _mm256_set1_epi16(0x7fff);
        const __m256i lim = _mm256_set1_epi16((short)(kvc__limit_bits16(limit, xd) - 1));
        const __m256i *p = (const __m256i *)x;
        for (; i + 64 <= n; i += 64, p += 4) {
            __m256i bad = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) {
                const __m256i v = _mm256_and_si256(_mm256_loadu_si256(p + k), abs);
                bad = _mm256_or_si256(bad, _mm256_cmpgt_epi16(v, lim));
            }
            if (!_mm256_testz_si256(bad, bad)) return 0;
        }
    }
    return i == n ? 1 : kvc__kernels_scalar()->all_finite(cat(x, xd, i), xd, n - i, limit);
}

/* ---- int8 / int4 lanes --------------------------------------------------- */

/* 8 int8 q[0..8) sign-extended to 8 int32. */
KVC_INLINE __m256i i8x8_load(const int8_t *q) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q));
}

/*
 * 8 int4 from 4 bytes (element k in bits 4k..4k+3 of the little-endian
 * word): broadcast the word, shift nibble k to the top (left by 28 - 4k),
 * then an arithmetic shift right by 28 sign-extends it.
 */
KVC_INLINE __m256i i4x8_load(const uint8_t *q) {
    int32_t w;
    memcpy(&w, q, 4);
    const __m256i sh = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
    return _mm256_srai_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(w), sh), 28);
}

/* 8 int32 in [-127, 127] -> 8 int8 in the low half (saturating packs are
 * plain narrowing here). */
KVC_INLINE __m128i i32x8_to_i8(__m256i v) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return _mm_packs_epi16(w, w);
}

KVC_INLINE void i8x8_store(int8_t *q, __m256i v) { _mm_storel_epi64((__m128i *)q, i32x8_to_i8(v)); }

/*
 * 8 int32 in [-7, 7] -> 4 bytes of int4. After narrowing to int8, each
 * 16-bit lane holds elements (2i, 2i+1) as (low, high) byte; the packed
 * byte is low & 0x0f | (lane >> 4) & 0xf0, then narrowed to 8 bits.
 */
KVC_INLINE void i4x8_store(uint8_t *q, __m256i v) {
    const __m128i b = i32x8_to_i8(v);
    const __m128i nib = _mm_or_si128(_mm_and_si128(b, _mm_set1_epi16(0x0f)),
                                     _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi16(0xf0)));
    const int32_t w = _mm_cvtsi128_si32(_mm_packus_epi16(nib, nib));
    memcpy(q, &w, 4);
}

/* Scale i of a scale tensor as f32. vcvtph2ps quiets a signalling NaN where
 * kvc_f16_to_f32 does not, but the product with q quiets it the same way,
 * so dequantized values are identical. */
KVC_INLINE float scale_load(const void *scale, kvc_dtype sd, int64_t i) {
    return sd == KVC_F16 ? _cvtsh_ss(((const uint16_t *)scale)[i]) : ((const float *)scale)[i];
}

/* ---- dequantize ---------------------------------------------------------- */

/* g % 8 == 0: per group, broadcast the scale, then 8 elements per step:
 * y = (float)q * scale. */
KVC_INLINE void dequant_run(const void *q, int bits, const void *scale, kvc_dtype sd, int64_t n,
                            int g, void *y, kvc_dtype yd) {
    int64_t e = 0;
    for (int64_t gi = 0; e < n; gi++) {
        const __m256 s = _mm256_set1_ps(scale_load(scale, sd, gi));
        const int64_t end = e + g;
        for (; e < end; e += 8) {
            const __m256i v = bits == 8 ? i8x8_load((const int8_t *)q + e)
                                        : i4x8_load((const uint8_t *)q + e / 2);
            store8(y, yd, e, _mm256_mul_ps(_mm256_cvtepi32_ps(v), s));
        }
    }
}

static void dequantize_rows_avx2(const void *q, int64_t q_stride, int bits, const void *scale,
                                 int64_t s_stride, kvc_dtype sd, int64_t rows, int64_t n, int g,
                                 void *y, int64_t y_stride, kvc_dtype yd) {
    if (g % 8 != 0) {
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

static void dequantize_avx2(const void *q, int bits, const void *scale, kvc_dtype sd, int64_t n,
                            int g, void *y, kvc_dtype yd) {
    dequantize_rows_avx2(q, 0, bits, scale, 0, sd, 1, n, g, y, 0, yd);
}

/* ---- quantize ------------------------------------------------------------ */

KVC_INLINE float hmax8(__m256 m) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/*
 * scale = max(absmax / qmax, 1e-5f) with a true division; maxss returns its
 * first operand only if it is greater, exactly the scalar's
 * "if (!(s > 1e-5f)) s = 1e-5f". Stores it in dtype sd and returns the
 * stored (rounded) value, which is the one quantization uses.
 */
KVC_INLINE float scale_store(float absmax, float qmax, void *scale, kvc_dtype sd, int64_t gi) {
    __m128 s = _mm_div_ss(_mm_set_ss(absmax), _mm_set_ss(qmax));
    s = _mm_max_ss(s, _mm_set_ss(1e-5f));
    if (sd == KVC_F16) {
        const uint16_t h = (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(s, RNE), 0);
        ((uint16_t *)scale)[gi] = h;
        return _cvtsh_ss(h);
    }
    const float f = _mm_cvtss_f32(s);
    ((float *)scale)[gi] = f;
    return f;
}

/*
 * g == 8 on 16-bit inputs (f16, bf16), 64 elements (8 groups) per block,
 * as the AVX-512 path does it with 8 lanes:
 *   - absmax on the raw bits (finite |x| is x & 0x7fff, ordered as the
 *     floats), the 8 group maxima from one transposed reduction of the
 *     block's 4 ymm (word unpacks, dword unpacks, a 64-bit swap), put in
 *     group order by one dword permute and one byte shuffle;
 *   - q = rne(x * (1 / s)), exact because a block whose products lie within
 *     3e-5 of a half-integer is redone with divisions (the product is within
 *     1.6e-5 of x / s for |x / s| < 128);
 *   - saturating packs to bytes, then the clamp to [-qmax, qmax].
 * stream: non-temporal stores (aligned q and scale only).
 */
KVC_INLINE __m256 h16x8_to_f32_fin(const uint16_t *p, kvc_dtype xd) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return xd == KVC_F16 ? _mm256_cvtph_ps(h) : bf16x8_to_f32(h); /* finite: no NaN fix-up */
}

/* The 8 group maxima of |x| over a 64-element block as raw 16-bit
 * magnitudes, in group order (NaN/Inf: at least the dtype's Inf bits). */
KVC_INLINE __m128i quant_g8_h16_absmax(const uint16_t *x) {
    const __m256i absm = _mm256_set1_epi16(0x7fff);
    /* lane l of A/B/C/D: group 2k + l (k = 0..3) */
    const __m256i A = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)x), absm);
    const __m256i B = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 16)), absm);
    const __m256i C = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 32)), absm);
    const __m256i D = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 48)), absm);
    /* words per lane: a0 b0 a1 b1 a2 b2 a3 b3, each the max of two of the group's words */
    const __m256i t0 = _mm256_max_epu16(_mm256_unpacklo_epi16(A, B), _mm256_unpackhi_epi16(A, B));
    const __m256i t1 = _mm256_max_epu16(_mm256_unpacklo_epi16(C, D), _mm256_unpackhi_epi16(C, D));
    /* a b c d twice per lane (4 words each), then their max */
    __m256i u = _mm256_max_epu16(_mm256_unpacklo_epi32(t0, t1), _mm256_unpackhi_epi32(t0, t1));
    u = _mm256_max_epu16(u, _mm256_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 3, 2)));
    /* words 0-3 of lane 0: groups 0 2 4 6; of lane 1: 1 3 5 7 */
    const __m128i m8 = _mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(u, _mm256_setr_epi32(0, 1, 4, 5, 0, 1, 4, 5)));
    return _mm_shuffle_epi8(m8, _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
}

/* Phase 1: the block's 8 scales, stored, and as float32 with reciprocals. */
KVC_INLINE void quant_g8_h16_scales(const uint16_t *x, kvc_dtype xd, float qmax, void *scale,
                                    kvc_dtype sd, int stream, __m256 *s_out, __m256 *inv_out) {
    const __m128i mx = quant_g8_h16_absmax(x);
    const __m256 absmax = xd == KVC_F16 ? _mm256_cvtph_ps(mx) : bf16x8_to_f32(mx);
    __m256 s = _mm256_div_ps(absmax, _mm256_set1_ps(qmax));
    s = _mm256_max_ps(s, _mm256_set1_ps(1e-5f)); /* the scalar's "if (!(s > 1e-5f))" */
    if (sd == KVC_F16) {
        const __m128i h = _mm256_cvtps_ph(s, RNE);
        if (stream) _mm_stream_si128((__m128i *)scale, h);
        else _mm_storeu_si128((__m128i *)scale, h);
        s = _mm256_cvtph_ps(h);
    } else if (stream) {
        _mm256_stream_ps((float *)scale, s);
    } else {
        _mm256_storeu_ps((float *)scale, s);
    }
    *s_out = s;
    *inv_out = _mm256_div_ps(_mm256_set1_ps(1.0f), s);
}

/* Phase 2: the block's 64 values (see above). */
KVC_INLINE void quant_g8_h16_values(const uint16_t *x, kvc_dtype xd, int bits, void *q,
                                    int stream, __m256 s8, __m256 inv8) {
    const char qmax = bits == 8 ? 127 : 7;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256i v[8];
    __m256 far = _mm256_setzero_ps(); /* max |y - rne(y)| */
    for (int i = 0; i < 8; i++) {
        const __m256 y = _mm256_mul_ps(h16x8_to_f32_fin(x + 8 * i, xd),
                                       _mm256_permutevar8x32_ps(inv8, _mm256_set1_epi32(i)));
        const __m256 r = _mm256_round_ps(y, RNE);
        v[i] = _mm256_cvttps_epi32(r);
        far = _mm256_max_ps(far, _mm256_andnot_ps(sign, _mm256_sub_ps(y, r)));
    }
    if (_mm256_movemask_ps(_mm256_cmp_ps(far, _mm256_set1_ps(0.5f - 0x1p-15f), _CMP_GE_OQ)))
        for (int i = 0; i < 8; i++)
            v[i] = _mm256_cvttps_epi32(_mm256_round_ps(
                _mm256_div_ps(h16x8_to_f32_fin(x + 8 * i, xd),
                              _mm256_permutevar8x32_ps(s8, _mm256_set1_epi32(i))),
                RNE));
    /* packs work per 128-bit lane: bytes come out as v0lo v1lo v2lo v3lo | v0hi ...
     * (4 bytes each); one dword permute restores v0 v1 v2 v3 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i lo = _mm256_set1_epi8((char)-qmax), hi = _mm256_set1_epi8(qmax);
    __m256i b[2];
    for (int half = 0; half < 2; half++) {
        __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[4 * half], v[4 * half + 1]),
                                       _mm256_packs_epi32(v[4 * half + 2], v[4 * half + 3]));
        w = _mm256_permutevar8x32_epi32(w, order);
        w = _mm256_max_epi8(w, lo);
        if (bits == 4) w = _mm256_min_epi8(w, hi);
        b[half] = w;
    }
    if (bits == 8) {
        __m256i *dst = (__m256i *)q;
        if (stream) _mm256_stream_si256(dst, b[0]), _mm256_stream_si256(dst + 1, b[1]);
        else _mm256_storeu_si256(dst, b[0]), _mm256_storeu_si256(dst + 1, b[1]);
    } else {
        /* per word: byte 2i in the low nibble, 2i + 1 in the high one, then
         * the words' low bytes (packus per lane + a qword permute) */
        const __m256i m0f = _mm256_set1_epi16(0x000f), mf0 = _mm256_set1_epi16(0x00f0);
        for (int half = 0; half < 2; half++) {
            const __m256i nib = _mm256_or_si256(_mm256_and_si256(b[half], m0f),
                                                _mm256_and_si256(_mm256_srli_epi16(b[half], 4), mf0));
            const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(nib, nib),
                                                       _MM_SHUFFLE(3, 1, 2, 0));
            __m128i *dst = (__m128i *)((uint8_t *)q + 16 * half);
            if (stream) _mm_stream_si128(dst, _mm256_castsi256_si128(p));
            else _mm_storeu_si128(dst, _mm256_castsi256_si128(p));
        }
    }
}

/* The values of nb (<= 8) blocks from element e0 on, from their scales s[i]
 * and reciprocals inv[i]. */
KVC_INLINE void quant_g8_h16_blocks(const uint16_t *x, kvc_dtype xd, int nb, int bits, void *q,
                                    int stream, const __m256 *s, const __m256 *inv, int64_t e0) {
    for (int i = 0; i < nb; i++) {
        const int64_t e = e0 + 64 * i;
        quant_g8_h16_values(x + e, xd, bits, (int8_t *)q + (bits == 8 ? e : e / 2), stream, s[i],
                            inv[i]);
    }
}

/* Runs of up to 8 blocks, scales first (see the AVX-512 version); returns
 * the elements done (a multiple of 64). */
KVC_INLINE int64_t quant_g8_h16(const uint16_t *x, kvc_dtype xd, int64_t n, int bits, void *q,
                                void *scale, kvc_dtype sd, int stream) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const size_t sbytes = sd == KVC_F16 ? 2 : 4;
    stream = stream && ((uintptr_t)q & (bits == 8 ? 31 : 15)) == 0 &&
             ((uintptr_t)scale & (sd == KVC_F16 ? 15 : 31)) == 0;
    __m256 s[8], inv[8];
    int64_t e = 0;
    while (e + 64 <= n) {
        int nb = (int)((n - e) / 64);
        if (nb > 8) nb = 8;
        for (int i = 0; i < nb; i++)
            quant_g8_h16_scales(x + e + 64 * i, xd, qmax,
                                (char *)scale + ((e / 8) + 8 * i) * sbytes, sd, stream, &s[i],
                                &inv[i]);
        quant_g8_h16_blocks(x, xd, nb, bits, q, stream, s, inv, e);
        e += 64 * (int64_t)nb;
    }
    return e;
}

/* g % 8 == 0: per group, pass 1 finds absmax, pass 2 computes
 * q = clamp(rne(x / scale), -qmax, qmax) 8 lanes at a time (after the
 * 16-bit g == 8 block path, for what it leaves). */
KVC_INLINE void quant_run(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *q,
                          void *scale, kvc_dtype sd, int stream) {
    int64_t done = 0;
    if (g == 8 && xd != KVC_F32) {
        done = quant_g8_h16((const uint16_t *)x, xd, n, bits, q, scale, sd, stream);
        if (done == n) return;
        x = (const uint16_t *)x + done;
        q = (int8_t *)q + (bits == 8 ? done : done / 2);
        scale = (char *)scale + (done / 8) * (sd == KVC_F16 ? 2 : 4);
        n -= done;
    }
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const __m256 hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t g0 = 0, gi = 0; g0 < n; g0 += g, gi++) {
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < g; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(load8(x, xd, g0 + i), absmask));
        const __m256 s = _mm256_set1_ps(scale_store(hmax8(m), qmax, scale, sd, gi));
        for (int i = 0; i < g; i += 8) {
            __m256 v = _mm256_round_ps(_mm256_div_ps(load8(x, xd, g0 + i), s), RNE);
            v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
            const __m256i iv = _mm256_cvttps_epi32(v);
            if (bits == 8) i8x8_store((int8_t *)q + g0 + i, iv);
            else i4x8_store((uint8_t *)q + (g0 + i) / 2, iv);
        }
    }
}

static void quantize_avx2(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *q,
                          void *scale, kvc_dtype sd) {
    if (g % 8 != 0) {
        kvc__kernels_scalar()->quantize(x, xd, n, bits, g, q, scale, sd);
        return;
    }
#define QZ(b, in, s)                                                                               \
    if (bits == (b) && xd == (in) && sd == (s)) {                                                  \
        quant_run(x, (in), n, (b), g, q, scale, (s), 0);                                           \
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
static void quantize_stream_avx2(const void *x, kvc_dtype xd, int64_t n, int bits, int g,
                                 void *q, void *scale, kvc_dtype sd) {
    if (g == 8 && (xd == KVC_F16 || xd == KVC_BF16) && (bits == 8 || bits == 4) &&
        (sd == KVC_F16 || sd == KVC_F32)) {
#define QS(b, in, s)                                                                               \
    if (bits == (b) && xd == (in) && sd == (s)) quant_run(x, (in), n, (b), 8, q, scale, (s), 1);
        QS(8, KVC_F16, KVC_F16) QS(8, KVC_F16, KVC_F32) QS(8, KVC_BF16, KVC_F16)
        QS(8, KVC_BF16, KVC_F32) QS(4, KVC_F16, KVC_F16) QS(4, KVC_F16, KVC_F32)
        QS(4, KVC_BF16, KVC_F16) QS(4, KVC_BF16, KVC_F32)
#undef QS
        _mm_sfence(); /* order the streamed bytes before whatever signals completion */
    } else {
        quantize_avx2(x, xd, n, bits, g, q, scale, sd);
    }
}

/* ---- quantize in two passes (quant_scales / quant_values) ------------------ */

/* g == 8 on 16-bit input: blocks of 64 by quant_g8_h16_absmax (the block's
 * largest magnitude pattern against the limit's: NaN/Inf have the largest),
 * then group by group. */
KVC_INLINE int qscales_g8_h16(const uint16_t *x, kvc_dtype xd, int64_t n, float qmax,
                              float limit, void *scale, kvc_dtype sd) {
    __m128i big = _mm_setzero_si128();
    int64_t e = 0;
    for (; e + 64 <= n; e += 64) {
        const __m128i mx = quant_g8_h16_absmax(x + e);
        big = _mm_max_epu16(big, mx);
        const __m256 a = xd == KVC_F16 ? _mm256_cvtph_ps(mx) : bf16x8_to_f32(mx);
        __m256 s = _mm256_max_ps(_mm256_div_ps(a, _mm256_set1_ps(qmax)), _mm256_set1_ps(1e-5f));
        if (sd == KVC_F16)
            _mm_storeu_si128((__m128i *)((uint16_t *)scale + e / 8), _mm256_cvtps_ph(s, RNE));
        else
            _mm256_storeu_ps((float *)scale + e / 8, s);
    }
    const __m128i lim = _mm_set1_epi16((short)kvc__limit_bits16(limit, xd));
    int finite = _mm_movemask_epi8(_mm_cmpeq_epi16(_mm_max_epu16(big, lim), big)) == 0;
    if (e < n) finite = finite && all_finite_avx2(x + e, xd, n - e, limit);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; e < n; e += 8)
        scale_store(hmax8(_mm256_and_ps(load8(x, xd, e), absmask)), qmax, scale, sd, e / 8);
    return finite;
}

/* Blocks of 64: up to 8 blocks' scales loaded, copied out and inverted
 * first, then their values (quant_g8_h16_values); the rest group by group
 * with divisions. */
KVC_INLINE void qvalues_g8_h16(const uint16_t *x, kvc_dtype xd, int64_t n, int bits,
                               const void *sin, void *q, void *scale, kvc_dtype sd, int stream) {
    const int sst = stream;
    stream = stream && ((uintptr_t)q & (bits == 8 ? 31 : 15)) == 0 &&
             ((uintptr_t)scale & (sd == KVC_F16 ? 15 : 31)) == 0;
    __m256 s[8], inv[8];
    int64_t e = 0;
    while (e + 64 <= n) {
        int nb = (int)((n - e) / 64);
        if (nb > 8) nb = 8;
        for (int i = 0; i < nb; i++) {
            const int64_t gi = e / 8 + 8 * i;
            if (sd == KVC_F16) {
                const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)sin + gi));
                __m128i *d = (__m128i *)((uint16_t *)scale + gi);
                if (stream) _mm_stream_si128(d, h);
                else _mm_storeu_si128(d, h);
                s[i] = _mm256_cvtph_ps(h);
            } else {
                s[i] = _mm256_loadu_ps((const float *)sin + gi);
                float *d = (float *)scale + gi;
                if (stream) _mm256_stream_ps(d, s[i]);
                else _mm256_storeu_ps(d, s[i]);
            }
            inv[i] = _mm256_div_ps(_mm256_set1_ps(1.0f), s[i]);
        }
        quant_g8_h16_blocks(x, xd, nb, bits, q, stream, s, inv, e);
        e += 64 * (int64_t)nb;
    }
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const __m256 hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
    for (; e < n; e += 8) {
        const float sv = scale_load(sin, sd, e / 8);
        if (sd == KVC_F16) ((uint16_t *)scale)[e / 8] = ((const uint16_t *)sin)[e / 8];
        else ((float *)scale)[e / 8] = sv;
        __m256 v = _mm256_round_ps(_mm256_div_ps(load8(x, xd, e), _mm256_set1_ps(sv)), RNE);
        const __m256i iv = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
        if (bits == 8) i8x8_store((int8_t *)q + e, iv);
        else i4x8_store((uint8_t *)q + e / 2, iv);
    }
    if (sst) _mm_sfence(); /* order streamed bytes before whatever signals completion */
}

static int quant_scales_avx2(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *scale,
                             kvc_dtype sd) {
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

static void quant_values_avx2(const void *x, kvc_dtype xd, int64_t n, int bits, int g,
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

/* ---- decode attention (attn_body.h, 8 lanes) ----------------------------- */

/* One K/V row -> D floats. Float rows: plain widening (a NaN stays a NaN, its
 * payload does not matter here). Quantized rows with group % 8 == 0: one
 * scale per 8 lanes; other groups go element by element. */
static void ab_row_to_f32(const void *src, kvc_dtype dt, const void *sc, kvc_dtype sd, int g,
                          int D, float *dst) {
    int e = 0;
    switch (dt) {
    case KVC_F32:
        for (; e + 8 <= D; e += 8) _mm256_storeu_ps(dst + e, _mm256_loadu_ps((const float *)src + e));
        for (; e < D; e++) dst[e] = ((const float *)src)[e];
        return;
    case KVC_F16:
        for (; e + 8 <= D; e += 8)
            _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(_mm_loadu_si128(
                                          (const __m128i *)((const uint16_t *)src + e))));
        for (; e < D; e++) dst[e] = kvc_f16_to_f32(((const uint16_t *)src)[e]);
        return;
    case KVC_BF16:
        for (; e + 8 <= D; e += 8)
            _mm256_storeu_ps(dst + e, bf16x8_to_f32(_mm_loadu_si128(
                                          (const __m128i *)((const uint16_t *)src + e))));
        for (; e < D; e++) dst[e] = kvc_bf16_to_f32(((const uint16_t *)src)[e]);
        return;
    default: break;
    }
    const uint8_t *qb = src;
    if (g % 8 == 0) {
        /* group index kept incrementally (no integer division per step) */
        for (int gi = 0, left = g / 8; e + 8 <= D; e += 8) {
            const __m256i v = dt == KVC_I8 ? i8x8_load((const int8_t *)src + e) : i4x8_load(qb + e / 2);
            _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_cvtepi32_ps(v),
                                                    _mm256_set1_ps(scale_load(sc, sd, gi))));
            if (--left == 0) gi++, left = g / 8;
        }
    }
    kvc__dequant_row_tail(src, dt, sc, sd, g, e, D, dst);
}

/* AB_LOADK: 8 elements [e, e+8) of a K/V row as float32, unscaled. */
KVC_INLINE __m256 ab_loadk8(const void *p, kvc_dtype dt, int e) {
    switch (dt) {
    case KVC_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + e)));
    case KVC_BF16:
        return bf16x8_to_f32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + e)));
    case KVC_I8: return _mm256_cvtepi32_ps(i8x8_load((const int8_t *)p + e));
    case KVC_I4: return _mm256_cvtepi32_ps(i4x8_load((const uint8_t *)p + e / 2));
    default: return _mm256_loadu_ps((const float *)p + e);
    }
}

/* AB_RED4: out[i] = sum of the lanes of ai (transposed: unpack, shuffle,
 * one add of the 128-bit halves). */
KVC_INLINE void ab_red4_8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float *out) {
    const __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    const __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

/* AB_MAX4: out[i] = max of the lanes of ai. */
KVC_INLINE void ab_max4_8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float *out) {
    const __m256 t0 = _mm256_max_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
    const __m256 t1 = _mm256_max_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
    const __m256 u = _mm256_max_ps(_mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm_storeu_ps(out, _mm_max_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

/* AB_SCALEROW: the n scales of one row as float32 (8, then 4 at a time: no
 * read past the row). */
KVC_INLINE void ab_scalerow8(const void *sc, kvc_dtype sd, int n, float *dst) {
    int e = 0;
    if (sd == KVC_F16) {
        const uint16_t *h = sc;
        for (; e + 8 <= n; e += 8)
            _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + e))));
        for (; e + 4 <= n; e += 4)
            _mm_storeu_ps(dst + e, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(h + e))));
    } else {
        const float *f = sc;
        for (; e + 8 <= n; e += 8) _mm256_storeu_ps(dst + e, _mm256_loadu_ps(f + e));
    }
    for (; e < n; e++) dst[e] = scale_load(sc, sd, e);
}

/* AB_GATHER: lanes i = p[i * stride]. */
KVC_INLINE __m256 ab_gather8(const float *p, int stride) {
    const __m256i idx =
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
    return _mm256_i32gather_ps(p, idx, 4);
}

/* AB_SCALE2: lanes 0-3 = p[0], lanes 4-7 = p[1] (the scales of a vector
 * that spans two quant groups of 4). */
KVC_INLINE __m256 ab_scale2_8(const float *p) {
    return _mm256_set_m128(_mm_set1_ps(p[1]), _mm_set1_ps(p[0]));
}

typedef __m256 ab_vec;
#define AB_VL 8
#define AB_LOAD(p) _mm256_load_ps(p)
#define AB_STORE(p, v) _mm256_store_ps((p), (v))
#define AB_ZERO() _mm256_setzero_ps()
#define AB_SET1(x) _mm256_set1_ps(x)
#define AB_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define AB_MUL(a, b) _mm256_mul_ps((a), (b))
#define AB_ADD(a, b) _mm256_add_ps((a), (b))
#define AB_SUB(a, b) _mm256_sub_ps((a), (b))
#define AB_MAX(a, b) _mm256_max_ps((a), (b))
#define AB_HMAX(v) hmax8(v)
#define AB_EXP2(v) kvc__exp2_8(v)
#define AB_LOADK(p, dt, e) ab_loadk8((p), (dt), (e))
#define AB_RED4(a0, a1, a2, a3, out) ab_red4_8((a0), (a1), (a2), (a3), (out))
#define AB_MAX4(a0, a1, a2, a3, out) ab_max4_8((a0), (a1), (a2), (a3), (out))
#define AB_SCALEROW(sc, sd, n, dst) ab_scalerow8((sc), (sd), (n), (dst))
#define AB_GATHER(p, stride) ab_gather8((p), (stride))
#define AB_SCALE2(p) ab_scale2_8(p)
#define AB_NH 2 /* 16 ymm registers: 2 heads x 4 keys of score accumulators */
#define AB_NC 4
#define AB_NAME attn_decode_avx2
#include "attn_body.h"

static void softcap_avx2(float *s, int64_t n, float cap, float mul) {
    kvc__softcap_row(s, n, cap, mul);
}

/* As hadamard_avx512 with 8 lanes: stages 1..4 inside each vector (lane i
 * takes lane i ^ h; lanes with i & h set keep x_{i-h} - x_i), then whole
 * vectors. */
static void hadamard_avx2(float *x, int32_t n) {
    if (n < 8) {
        kvc__hadamard_ref(x, n);
        return;
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int32_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        for (int h = 1; h < 8; h *= 2) {
            const __m256i hv = _mm256_set1_epi32(h);
            const __m256 y = _mm256_permutevar8x32_ps(v, _mm256_xor_si256(lane, hv));
            const __m256 hi =
                _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(lane, hv), hv));
            v = _mm256_blendv_ps(_mm256_add_ps(v, y), _mm256_sub_ps(y, v), hi);
        }
        _mm256_storeu_ps(x + i, v);
    }
    for (int32_t h = 8; h < n; h *= 2)
        for (int32_t i0 = 0; i0 < n; i0 += 2 * h)
            for (int32_t i = i0; i < i0 + h; i += 8) {
                const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + h);
                _mm256_storeu_ps(x + i, _mm256_add_ps(a, b));
                _mm256_storeu_ps(x + i + h, _mm256_sub_ps(a, b));
            }
    const __m256 s = _mm256_set1_ps((float)(1.0 / sqrt((double)n)));
    for (int32_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), s));
}

/* copy with 32-byte non-temporal stores on dst's 64-byte-aligned part
 * (kernels.h copy_stream). */
static void copy_stream_avx2(void *dst, const void *src, size_t n) {
    char *d = dst;
    const char *s = src;
    size_t i = (size_t)(-(uintptr_t)d & 63);
    if (i > n) i = n;
    if (i) memcpy(d, s, i);
    for (; i + 128 <= n; i += 128) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        const __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        const __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    for (; i + 32 <= n; i += 32)
        _mm256_stream_si256((__m256i *)(d + i), _mm256_loadu_si256((const __m256i *)(s + i)));
    if (i < n) memcpy(d + i, s + i, n - i);
}

static const kvc_kernels table = {
    KVC_ISA_AVX2, copy_avx2, convert_avx2, all_finite_avx2, quantize_avx2, quantize_stream_avx2,
    quant_scales_avx2, quant_values_avx2, softcap_avx2, hadamard_avx2, dequantize_avx2,
    dequantize_rows_avx2,
    attn_decode_avx2,
    NULL, NULL, NULL, NULL, NULL, /* no AMX decode */
    copy_stream_avx2,
};

const kvc_kernels *kvc__kernels_avx2(void) { return &table; }
