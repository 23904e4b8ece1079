/*
 * AVX2 (+FMA, F16C) kernels of kvc__gemm for K-quant weights (Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K) and IQ4_XS (formulas in gemm_kernels.h). Also the
 * K-quant kernels of the avx512 ISA on CPUs without AVX512_VNNI.
 *
 * One activation group (8 blocks, L = 2 lanes) is one weight super-block:
 * register j (0..3) lane k (0..1) = sub-block 2 j + k, as in gemm_avx2.c.
 * A super-block is unpacked once per tile into bytes, lo = elements 0..15
 * and hi = elements 16..31 of each lane's sub-block:
 *   Q4_K: the 32 bytes qs[32 j ..] hold sub-blocks 2 j (low nibbles, lane 0)
 *     and 2 j + 1 (high nibbles, lane 1): a broadcast 16-byte load, lane 1
 *     shifted by 4, masked; Q5_K ORs in 16 where bit 2 j + k of qh[l] is set
 *     (and + cmpeq against the lane's bit);
 *   Q6_K: sub-block s = 2 j + k takes ql[64 (j / 2) + 32 k + l] (nibble
 *     j % 2) and bits 2 (s % 4) of qh[32 (j / 2) + l] (per-lane vpsrlvd),
 *     giving q = 0..63;
 *   Q2_K, Q3_K: sub-block s takes bits 2 (s % 4) of qs[32 (j / 2) + l]
 *     (vpsrlvd), Q3_K bit s of hmask[l] as bit 2: 0..7;
 *   IQ4_XS: the 32 bytes of sub-blocks 2 j, 2 j + 1 in one load, each nibble
 *     through a vpshufb table.
 * Scales: Q4_K/Q5_K's 6-bit scales and mins unpacked with 32-bit masks (the
 * 12 bytes as three words), then permuted into the position order of the
 * block sums (block b(p) = 2 (p % 4) + p / 4 at position p) and converted:
 * dw = d * sc, mw = -(dmin * m); Q6_K's int8 scales (Q3_K's 6-bit ones
 * minus 32, Q2_K's low nibbles) of half 0 and half 1 of each sub-block
 * likewise (dw, mw hold the two halves); IQ4_XS's 6-bit scales minus 32.
 * Products: int16 activations widen the bytes to int16 (zero- or, for
 * Q6_K's q - 32, sign-extension: even / odd bytes, the activation parts'
 * order) for vpmaddwd; int8 activations use vpmaddubsw (u8 q x s8 x, pair
 * sums <= 2 * 63 * 127: no saturation) and vpmaddwd with ones; Q6_K / Q3_K
 * then subtract 32 / 4 times each half's activation sum (qsum0, qsum - qsum0
 * of the activation layout). IQ4_XS, signed values, moves their signs to x
 * (vpsignb; pair sums <= 2 * 127 * 127, one vpmaddwd each). Q6_K, Q3_K, Q2_K
 * keep their two halves apart (two reduce4); Q2_K's mins meet the same half
 * sums: m0 qsum0 + m1 (qsum - qsum0) in float (exact: an integer below
 * 2^24). The others add lo and hi in each lane.
 */
#include <immintrin.h>
#include <string.h>

#include "gemm_kq_common.h"

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 4")

#define L 2 /* 128-bit lanes per register */

typedef struct kgroup {
    __m256i v[4][4]; /* int8: v[j][0] lo, v[j][1] hi bytes (IQ4_XS: |q|, then q in
                      * v[j][2], v[j][3] for the signs); int16: v[j][s] part s */
    __m256 dw, mw;   /* position order; halves types: scales of half 0 and half 1 */
    __m256 m0, m1, dm; /* Q2_K: mins of half 0 and half 1 (position order), -dmin */
} kgroup;

#define kq_bytes kvc__kq_bytes

#define halves kq_halves
#define code_off kq_code_off

AI __m256i bcast(const uint8_t *p) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)p));
}

AI float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The 16 bytes at p in both lanes, shifted right by cnt (per 32-bit word), masked. */
AI __m256i bits_at(const uint8_t *p, __m256i cnt, __m256i mask) {
    return _mm256_and_si256(_mm256_srlv_epi32(bcast(p), cnt), mask);
}




AI __m256 bytes_ps(__m128i b, int sign) {
    return _mm256_cvtepi32_ps(sign ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

/* Unpacks the super-block at w for bits-wide activations. */
AI void load_kgroup(const int32_t wt, const int bits, const uint8_t *w, kgroup *g) {
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256i lo[4], hi[4];
    if (wt == KVC_GGML_Q6_K) {
        const uint8_t *ql = w, *qh = w + 128;
        UNROLL
        for (int j = 0; j < 4; j++) {
            const int h = j / 2;
#define LD(o) _mm_loadu_si128((const __m128i *)(const void *)(ql + 64 * h + (o)))
            __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(LD(0)), LD(32), 1);
            __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(LD(16)), LD(48), 1);
#undef LD
            if (j % 2) {
                a = _mm256_srli_epi16(a, 4);
                b = _mm256_srli_epi16(b, 4);
            }
            const __m256i cnt = _mm256_setr_epi32(4 * (j % 2), 4 * (j % 2), 4 * (j % 2),
                                                  4 * (j % 2), 4 * (j % 2) + 2, 4 * (j % 2) + 2,
                                                  4 * (j % 2) + 2, 4 * (j % 2) + 2);
            const __m256i m3 = _mm256_set1_epi8(3);
            const __m256i ha = _mm256_and_si256(_mm256_srlv_epi32(bcast(qh + 32 * h), cnt), m3);
            const __m256i hb =
                _mm256_and_si256(_mm256_srlv_epi32(bcast(qh + 32 * h + 16), cnt), m3);
            lo[j] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(ha, 4));
            hi[j] = _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_slli_epi16(hb, 4));
        }
        const float d = f16_at(w + 208);
        /* scale 2 b(p) + h at position p: b(p) = 0, 2, 4, 6, 1, 3, 5, 7 */
        const __m128i s = _mm_shuffle_epi8(
            _mm_loadu_si128((const __m128i *)(const void *)(w + 192)),
            _mm_setr_epi8(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15));
        g->dw = _mm256_mul_ps(_mm256_set1_ps(d), bytes_ps(s, 1));
        g->mw = _mm256_mul_ps(_mm256_set1_ps(d), bytes_ps(_mm_srli_si128(s, 8), 1));
    } else if (wt == KVC_GGML_Q2_K || wt == KVC_GGML_Q3_K) {
        /* sub-block s = 2 j + k: 2 bits (qs[32 (j / 2) + l] >> 2 (s % 4)) & 3;
         * Q3_K: bit s of hmask[l] as bit 2 */
        const int three = wt == KVC_GGML_Q3_K;
        const uint8_t *qs = w + (three ? 32 : 16);
        const __m256i m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
        UNROLL
        for (int j = 0; j < 4; j++) {
            const int c = 4 * (j % 2);
            const __m256i cnt = _mm256_setr_epi32(c, c, c, c, c + 2, c + 2, c + 2, c + 2);
            lo[j] = bits_at(qs + 32 * (j / 2), cnt, m3);
            hi[j] = bits_at(qs + 32 * (j / 2) + 16, cnt, m3);
            if (three) {
                const int b = 2 * j;
                const __m256i hc = _mm256_setr_epi32(b, b, b, b, b + 1, b + 1, b + 1, b + 1);
                lo[j] = _mm256_or_si256(lo[j], _mm256_slli_epi16(bits_at(w, hc, m1), 2));
                hi[j] = _mm256_or_si256(hi[j], _mm256_slli_epi16(bits_at(w + 16, hc, m1), 2));
            }
        }
        const __m128i raw = _mm_loadu_si128((const __m128i *)(const void *)w);
        const __m128i k15 = _mm_set1_epi8(15);
        const __m128i s16 = three ? q3k_scales(w + 96) : _mm_and_si128(raw, k15);
        const float d = f16_at(w + (three ? 108 : 80));
        /* scale 2 b(p) + h at position p: b(p) = 0, 2, 4, 6, 1, 3, 5, 7 */
        const __m128i s = _mm_shuffle_epi8(
            s16, _mm_setr_epi8(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15));
        g->dw = _mm256_mul_ps(_mm256_set1_ps(d), bytes_ps(s, three));
        g->mw = _mm256_mul_ps(_mm256_set1_ps(d), bytes_ps(_mm_srli_si128(s, 8), three));
        if (!three) { /* the mins (high nibbles) the same way */
            const __m128i m = _mm_shuffle_epi8(
                _mm_and_si128(_mm_srli_epi16(raw, 4), k15),
                _mm_setr_epi8(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15));
            g->m0 = bytes_ps(m, 0);
            g->m1 = bytes_ps(_mm_srli_si128(m, 8), 0);
            g->dm = _mm256_set1_ps(-f16_at(w + 82));
        }
    } else if (wt == KVC_GGML_IQ4_XS) {
        /* sub-block s = 2 j + k: 16 bytes at 8 + 16 s, low nibbles elements
         * 0..15, high nibbles 16..31, each a table value */
        const __m256i tbl = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38,
                                             53, 69, 89, 113, -127, -104, -83, -65, -49, -35, -22,
                                             -10, 1, 13, 25, 38, 53, 69, 89, 113);
        UNROLL
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(w + 8 + 32 * j));
            lo[j] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(v, m4));
            hi[j] = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        }
        /* block b(p) = 0, 2, 4, 6, 1, 3, 5, 7 at position p */
        const __m128i ls = _mm_shuffle_epi8(
            iq4xs_scales(w), _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 8, 8, 8, 8, 8, 8, 8));
        g->dw = _mm256_mul_ps(_mm256_set1_ps(f16_at(w)), bytes_ps(ls, 1));
        g->mw = _mm256_setzero_ps();
    } else {
        const int five = wt == KVC_GGML_Q5_K;
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        UNROLL
        for (int j = 0; j < 4; j++) {
            const __m256i a = bcast(qs + 32 * j), b = bcast(qs + 32 * j + 16);
            lo[j] = _mm256_and_si256(_mm256_blend_epi32(a, _mm256_srli_epi16(a, 4), 0xF0), m4);
            hi[j] = _mm256_and_si256(_mm256_blend_epi32(b, _mm256_srli_epi16(b, 4), 0xF0), m4);
            if (five) { /* bit 2 j + k of qh[l] -> 16 */
                const long long b0 = (long long)(0x0101010101010101ull << (2 * j));
                const long long b1 = (long long)(0x0101010101010101ull << (2 * j + 1));
                const __m256i bit = _mm256_setr_epi64x(b0, b0, b1, b1);
                const __m256i m16 = _mm256_set1_epi8(16);
                const __m256i ha = bcast(qh), hb = bcast(qh + 16);
                lo[j] = _mm256_or_si256(
                    lo[j], _mm256_and_si256(
                               _mm256_cmpeq_epi8(_mm256_and_si256(ha, bit), bit), m16));
                hi[j] = _mm256_or_si256(
                    hi[j], _mm256_and_si256(
                               _mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit), m16));
            }
        }
        /* block b(p) = 0, 2, 4, 6, 1, 3, 5, 7 at position p */
        const __m128i s = _mm_shuffle_epi8(
            kq_scales(w + 4), _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
        g->dw = _mm256_mul_ps(_mm256_set1_ps(f16_at(w)), bytes_ps(s, 0));
        const __m256 neg = _mm256_set1_ps(-0.0f);
        g->mw = _mm256_xor_ps(
            _mm256_mul_ps(_mm256_set1_ps(f16_at(w + 2)), bytes_ps(_mm_srli_si128(s, 8), 0)), neg);
    }
    UNROLL
    for (int j = 0; j < 4; j++) {
        if (bits == 8 && wt == KVC_GGML_IQ4_XS) { /* |q| u8 with the sign moved to x */
            g->v[j][0] = _mm256_abs_epi8(lo[j]);
            g->v[j][1] = _mm256_abs_epi8(hi[j]);
            g->v[j][2] = lo[j];
            g->v[j][3] = hi[j];
        } else if (bits == 8) {
            g->v[j][0] = lo[j];
            g->v[j][1] = hi[j];
        } else if (halves(wt) || wt == KVC_GGML_IQ4_XS) {
            /* q - off, sign-extended even / odd bytes */
            const __m256i c = _mm256_set1_epi8((char)code_off(wt));
            const __m256i a = _mm256_sub_epi8(lo[j], c), b = _mm256_sub_epi8(hi[j], c);
            g->v[j][0] = _mm256_srai_epi16(_mm256_slli_epi16(a, 8), 8);
            g->v[j][1] = _mm256_srai_epi16(a, 8);
            g->v[j][2] = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
            g->v[j][3] = _mm256_srai_epi16(b, 8);
        } else {
            const __m256i mff = _mm256_set1_epi16(0xff);
            g->v[j][0] = _mm256_and_si256(lo[j], mff);
            g->v[j][1] = _mm256_srli_epi16(lo[j], 8);
            g->v[j][2] = _mm256_and_si256(hi[j], mff);
            g->v[j][3] = _mm256_srli_epi16(hi[j], 8);
        }
    }
}

AI __m256i reduce4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

/* One activation row's group xg against the unpacked super-block. */
AI __m256 row_kgroup(const int32_t wt, const int bits, const kgroup *g, const uint8_t *xg,
                     __m256 acc) {
    const int64_t qbytes = (bits == 16 ? 256 : 128) * L;
    const __m256i ones = _mm256_set1_epi16(1);
    const int two = halves(wt), q2k = wt == KVC_GGML_Q2_K;
    __m256i a[4], b[4]; /* halves: half 0 / half 1; else a only */
#define XL(r) _mm256_loadu_si256((const __m256i *)(const void *)(xg + (r) * 16 * L))
    UNROLL
    for (int j = 0; j < 4; j++) {
        if (bits == 16) {
            const __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(g->v[j][0], XL(4 * j)),
                                                _mm256_madd_epi16(g->v[j][1], XL(4 * j + 1)));
            const __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(g->v[j][2], XL(4 * j + 2)),
                                                _mm256_madd_epi16(g->v[j][3], XL(4 * j + 3)));
            if (two) {
                a[j] = p0;
                b[j] = p1;
            } else {
                a[j] = _mm256_add_epi32(p0, p1);
            }
        } else if (two) { /* pair sums <= 2 * 63 * 127 */
            a[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(g->v[j][0], XL(2 * j)), ones);
            b[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(g->v[j][1], XL(2 * j + 1)), ones);
        } else if (wt == KVC_GGML_IQ4_XS) { /* pair sums <= 2 * 127 * 127: one madd each */
            const __m256i x0 = XL(2 * j), x1 = XL(2 * j + 1);
            const __m256i s0 = _mm256_maddubs_epi16(g->v[j][0], _mm256_sign_epi8(x0, g->v[j][2]));
            const __m256i s1 = _mm256_maddubs_epi16(g->v[j][1], _mm256_sign_epi8(x1, g->v[j][3]));
            a[j] = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
        } else {
            a[j] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(g->v[j][0], XL(2 * j)),
                                                      _mm256_maddubs_epi16(g->v[j][1],
                                                                           XL(2 * j + 1))),
                                     ones);
        }
    }
#undef XL
    const __m256 dx = _mm256_loadu_ps((const float *)(const void *)(xg + qbytes));
    __m256i i0 = reduce4(a[0], a[1], a[2], a[3]);
    if (two) {
        /* the activation sums: of the block (qsum) and of its first half (qsum0) */
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(const void *)(xg + qbytes + 16 * L));
        const __m256i qs0 =
            _mm256_loadu_si256((const __m256i *)(const void *)(xg + qbytes + 48 * L));
        __m256i i1 = reduce4(b[0], b[1], b[2], b[3]);
        if (bits == 8 && code_off(wt)) { /* sum (u - off) x = sum u x - off sum x, per half */
            const int sh = wt == KVC_GGML_Q6_K ? 5 : 2;
            i0 = _mm256_sub_epi32(i0, _mm256_slli_epi32(qs0, sh));
            i1 = _mm256_sub_epi32(i1, _mm256_slli_epi32(_mm256_sub_epi32(qs, qs0), sh));
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(g->dw, dx), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(g->mw, dx), acc);
        if (q2k) { /* m0 qsum0 + m1 (qsum - qsum0): an integer < 2^24, exact in float */
            const __m256 t = _mm256_fmadd_ps(
                g->m1, _mm256_cvtepi32_ps(_mm256_sub_epi32(qs, qs0)),
                _mm256_mul_ps(g->m0, _mm256_cvtepi32_ps(qs0)));
            acc = _mm256_fmadd_ps(t, _mm256_mul_ps(g->dm, dx), acc);
        }
    } else {
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(g->dw, dx), acc);
        if (wt != KVC_GGML_IQ4_XS)
            acc = _mm256_fmadd_ps(
                g->mw, _mm256_loadu_ps((const float *)(const void *)(xg + qbytes + 32 * L)), acc);
    }
    return acc;
}

AI float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* nr (1..4) activation rows times W row w: y[i * ldy]. */
AI void kq_tile(const int32_t wt, const int bits, const int nr, const uint8_t *w, int64_t nb,
                const uint8_t *x, int64_t xs, float *y, int64_t ldy) {
    const int64_t bb = kq_bytes(wt), gbytes = kvc__gemm_group_bytes(L, bits);
    __m256 acc[4];
    UNROLL
    for (int i = 0; i < nr; i++) acc[i] = _mm256_setzero_ps();
    kgroup g;
    for (int64_t sb = 0; sb < nb / 8; sb++) {
        load_kgroup(wt, bits, w + sb * bb, &g);
        UNROLL
        for (int i = 0; i < nr; i++) acc[i] = row_kgroup(wt, bits, &g, x + i * xs + sb * gbytes, acc[i]);
    }
    UNROLL
    for (int i = 0; i < nr; i++) y[i * ldy] = hsum8(acc[i]);
}

AI void kq_rows(const int32_t wt, const int bits, const uint8_t *W, int64_t row_bytes, int64_t r0,
                int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n, float *Y,
                int64_t ldy) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int64_t r = r0; r < r1; r++)
            kq_tile(wt, bits, 4, W + r * row_bytes, nb, xq + i * xs, xs, Y + i * ldy + r, ldy);
    for (; i < n; i++)
        for (int64_t r = r0; r < r1; r++)
            kq_tile(wt, bits, 1, W + r * row_bytes, nb, xq + i * xs, xs, Y + i * ldy + r, ldy);
}

/* One switch for both widths: kq_rows specialized per type (bits is a
 * constant in each caller). */
AI void kq_types(const int bits, int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                 int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n, float *Y,
                 int64_t ldy) {
#define KQ_CASE(t) \
    case t: kq_rows(t, bits, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy); break
    switch (wt) {
    KQ_CASE(KVC_GGML_Q4_K);
    KQ_CASE(KVC_GGML_Q5_K);
    KQ_CASE(KVC_GGML_Q2_K);
    KQ_CASE(KVC_GGML_Q3_K);
    KQ_CASE(KVC_GGML_IQ4_XS);
    default: kq_rows(KVC_GGML_Q6_K, bits, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy); break;
    }
#undef KQ_CASE
}

void kvc__gemm_kq8_avx2(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
                        int64_t nb, const uint8_t *xq, int64_t xs, int64_t n, float *Y,
                        int64_t ldy) {
    kq_types(8, wt, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy);
}

void kvc__gemm_kq16_avx2(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                         int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n,
                         float *Y, int64_t ldy) {
    kq_types(16, wt, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy);
}
