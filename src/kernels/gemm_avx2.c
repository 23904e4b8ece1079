/*
 * AVX2 (+FMA, F16C) kernels of kvc__gemm (gemm_kernels.h). Also the integer
 * kernels of the avx512 ISA on CPUs without AVX512_VNNI.
 *
 * Integer paths: the AVX-512 scheme (gemm_avx512.c) at half width: groups of
 * 8 weight blocks, register j (0..3) lane k (0..1) = block 2 j + k.
 * int16 activations (the default): weights widened to int16 in place with
 * 16-bit shifts / masks as in gemm_avx512.c, products with vpmaddwd (s16 x
 * s16 -> pairs summed in int32; no saturation: |w| <= 128, |x| <= 32767),
 * 4 per register j added with vpaddd; Q4_0 subtracts 8 * qsum after.
 * int8 activations: products with vpmaddubsw (u8 x s8 -> pairs summed in
 * int16) then vpmaddwd with ones (-> int32):
 *   Q4_0/Q4_1: nibbles (0..15) are the unsigned operand; lo and hi products
 *     (each pair |sum| <= 2 * 15 * 127) are added in int16 before vpmaddwd;
 *     Q4_0 subtracts 8 * qsum after. Q5_0/Q5_1 the same with the fifth bit
 *     OR-ed in (0..31, pairs <= 2 * 31 * 127, lo + hi < 2^14); Q5_0
 *     subtracts 16 * qsum. (int16 activations: Q5 codes as bytes first,
 *     then even / odd bytes widened.)
 *   Q8_0: the sign trick, |w| (u8, 0..128) times x carrying w's sign
 *     (vpsignb), pair sums <= 2 * 128 * 127 < 32768, no saturation; lo and hi
 *     go through vpmaddwd separately (their sum could exceed int16).
 *     IQ4_NL the same, its int8 values looked up from the nibbles (vpshufb).
 * reduce4 yields 8 block sums, block b(p) = 2 (p % 4) + p / 4 at position p.
 *
 * float path: tiles of up to 4 X rows x 2 W rows (1 x 4 for matrix-vector),
 * 8 columns per step, FMA, tail through a zero-padded copy.
 */
#include <immintrin.h>
#include <string.h>

#include "gemm_kernels.h"

#define AI static inline __attribute__((always_inline))
/* Tile loops have compile-time trip counts (<= 4): unrolled, their
 * registers stay registers instead of stack arrays. */
#define UNROLL _Pragma("GCC unroll 4")

#define L 2    /* 128-bit lanes per register */
#define GBLK 8 /* blocks per group */

static const int8_t iq4nl_values[16] = KVC_GGML_IQ4_NL_VALUES;

static int64_t block_bytes(int32_t wt) {
    return wt == KVC_GGML_Q8_0                              ? 34
           : wt == KVC_GGML_Q4_0 || wt == KVC_GGML_IQ4_NL ? 18
           : wt == KVC_GGML_Q4_1 ? 20
           : wt == KVC_GGML_Q5_0 ? 22
                                 : 24;
}

/* Q5_0 / Q5_1: the fifth bits of one nibble vector, 16 (0 or 16 each) per
 * lane: byte e of lane k gets bit e (half 0) or 16 + e (half 1) of the
 * dword at the start of lane k of h (the block's qh). */
AI __m256i fifth_bits(__m256i h, int half) {
    const __m256i sel = half ? _mm256_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3)
                             : _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
    const __m256i t = _mm256_and_si256(_mm256_shuffle_epi8(h, sel), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(t, bit), _mm256_set1_epi8(16));
}

/* Sum of the 8 lanes in a fixed order. */
AI float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- integer paths ------------------------------------------------------------ */

typedef struct wgroup {
    /* register j lane k = block 2 j + k. int8: Q4 v[j][0] lo / v[j][1] hi
     * nibbles, Q8_0 v[j][0] |lo| / v[j][1] |hi| / v[j][2] lo / v[j][3] hi
     * (the signs); int16: v[j][s] part s (int16) */
    __m256i v[4][4];
    __m256 dw, mw;
} wgroup;

AI __m256i load2(const uint8_t *p, int64_t bb, int j, int nblk) {
    p += 2 * j * bb;
    const __m128i a = 2 * j < nblk ? _mm_loadu_si128((const __m128i *)(const void *)p)
                                   : _mm_setzero_si128();
    const __m128i b = 2 * j + 1 < nblk ? _mm_loadu_si128((const __m128i *)(const void *)(p + bb))
                                       : _mm_setzero_si128();
    return _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
}

/* 8 float16 held in the low (shift 0) or high (shift 2) halves of the dwords
 * of h, to float. */
AI __m256 f16_dwords(__m256i h, int high) {
    const __m256i sel = high ? _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1,
                                                -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15, -1, -1,
                                                -1, -1, -1, -1, -1, -1)
                             : _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1,
                                                -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1,
                                                -1, -1, -1, -1, -1, -1);
    const __m256i t = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(h, sel), 0x08);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(t));
}

/* Loads and unpacks the nblk (<= 8) blocks at w for bits-wide activations
 * (widening to int16 as in gemm_avx512.c). */
AI void load_group(const int32_t wt, const int bits, const uint8_t *w, int nblk, __m256i idx,
                   wgroup *g) {
    const int64_t bb = block_bytes(wt);
    const int nz = (nblk + 1) / 2;
    const __m256i m4 = _mm256_set1_epi8(15), m15 = _mm256_set1_epi16(15);
    UNROLL
    for (int j = 0; j < 4; j++) {
        if (j >= nz) {
            g->v[j][0] = g->v[j][1] = g->v[j][2] = g->v[j][3] = _mm256_setzero_si256();
            continue;
        }
        if (wt == KVC_GGML_Q8_0 || wt == KVC_GGML_IQ4_NL) {
            __m256i lo, hi; /* int8 weights: Q8_0's, or IQ4_NL's looked up (vpshufb) */
            if (wt == KVC_GGML_Q8_0) {
                lo = load2(w + 2, bb, j, nblk);
                hi = load2(w + 18, bb, j, nblk);
            } else {
                const __m256i tbl = _mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)(const void *)iq4nl_values));
                const __m256i v = load2(w + 2, bb, j, nblk);
                lo = _mm256_shuffle_epi8(tbl, _mm256_and_si256(v, m4));
                hi = _mm256_shuffle_epi8(tbl, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            }
            if (bits == 8) {
                g->v[j][0] = _mm256_abs_epi8(lo);
                g->v[j][1] = _mm256_abs_epi8(hi);
                g->v[j][2] = lo;
                g->v[j][3] = hi;
            } else {
                g->v[j][0] = _mm256_srai_epi16(_mm256_slli_epi16(lo, 8), 8);
                g->v[j][1] = _mm256_srai_epi16(lo, 8);
                g->v[j][2] = _mm256_srai_epi16(_mm256_slli_epi16(hi, 8), 8);
                g->v[j][3] = _mm256_srai_epi16(hi, 8);
            }
        } else if (wt == KVC_GGML_Q5_0 || wt == KVC_GGML_Q5_1) {
            /* nibbles plus fifth bits as bytes (0..31), then (int16)
             * even / odd bytes: the activation layout's part order */
            const int qh = wt == KVC_GGML_Q5_0 ? 2 : 4;
            const __m256i v = load2(w + qh + 4, bb, j, nblk), h = load2(w + qh, bb, j, nblk);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m4), fifth_bits(h, 0));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                               fifth_bits(h, 1));
            if (bits == 8) {
                g->v[j][0] = lo;
                g->v[j][1] = hi;
            } else {
                const __m256i m255 = _mm256_set1_epi16(255);
                g->v[j][0] = _mm256_and_si256(lo, m255);
                g->v[j][1] = _mm256_srli_epi16(lo, 8);
                g->v[j][2] = _mm256_and_si256(hi, m255);
                g->v[j][3] = _mm256_srli_epi16(hi, 8);
            }
        } else {
            const __m256i v = load2(w + (wt == KVC_GGML_Q4_1 ? 4 : 2), bb, j, nblk);
            if (bits == 8) {
                g->v[j][0] = _mm256_and_si256(v, m4);
                g->v[j][1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            } else {
                g->v[j][0] = _mm256_and_si256(v, m15);
                g->v[j][1] = _mm256_and_si256(_mm256_srli_epi16(v, 8), m15);
                g->v[j][2] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m15);
                g->v[j][3] = _mm256_srli_epi16(v, 12);
            }
        }
    }
    __m256i h;
    if (nblk == GBLK) {
        h = _mm256_i32gather_epi32((const int *)(const void *)w, idx, 1);
    } else {
        const __m256i bpos = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(nblk), bpos);
        h = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(const void *)w,
                                        idx, m, 1);
    }
    g->dw = f16_dwords(h, 0);
    if (wt == KVC_GGML_Q4_1 || wt == KVC_GGML_Q5_1) g->mw = f16_dwords(h, 1);
}

AI __m256i reduce4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

AI __m256 row_group(const int32_t wt, const int bits, const wgroup *g, int nz, const uint8_t *xg,
                    __m256 acc) {
    const int64_t qbytes = (bits == 16 ? 256 : 128) * L;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a[4];
    UNROLL
    for (int j = 0; j < 4; j++) {
        if (j >= nz) {
            a[j] = _mm256_setzero_si256();
            continue;
        }
#define XL(r) _mm256_loadu_si256((const __m256i *)(const void *)(xg + (r) * 16 * L))
        if (bits == 16) { /* vpmaddwd: s16 x s16, pairs summed into int32 */
            const __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(g->v[j][0], XL(4 * j)),
                                                _mm256_madd_epi16(g->v[j][1], XL(4 * j + 1)));
            const __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(g->v[j][2], XL(4 * j + 2)),
                                                _mm256_madd_epi16(g->v[j][3], XL(4 * j + 3)));
            a[j] = _mm256_add_epi32(p0, p1);
        } else if (wt == KVC_GGML_Q8_0 || wt == KVC_GGML_IQ4_NL) {
            const __m256i pl = _mm256_madd_epi16(
                _mm256_maddubs_epi16(g->v[j][0], _mm256_sign_epi8(XL(2 * j), g->v[j][2])), ones);
            const __m256i ph = _mm256_madd_epi16(
                _mm256_maddubs_epi16(g->v[j][1], _mm256_sign_epi8(XL(2 * j + 1), g->v[j][3])),
                ones);
            a[j] = _mm256_add_epi32(pl, ph);
        } else {
            a[j] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(g->v[j][0], XL(2 * j)),
                                                      _mm256_maddubs_epi16(g->v[j][1],
                                                                           XL(2 * j + 1))),
                                     ones);
        }
#undef XL
    }
    __m256i isum = reduce4(a[0], a[1], a[2], a[3]);
    if (wt == KVC_GGML_Q4_0 || wt == KVC_GGML_Q5_0) {
        /* codes were used as 0..15 / 0..31: subtract 8 / 16 sum q */
        const __m256i qs =
            _mm256_loadu_si256((const __m256i *)(const void *)(xg + qbytes + 16 * L));
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(qs, wt == KVC_GGML_Q4_0 ? 3 : 4));
    }
    const __m256 dx = _mm256_loadu_ps((const float *)(const void *)(xg + qbytes));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(g->dw, dx), acc);
    if (wt == KVC_GGML_Q4_1 || wt == KVC_GGML_Q5_1)
        acc = _mm256_fmadd_ps(
            g->mw, _mm256_loadu_ps((const float *)(const void *)(xg + qbytes + 32 * L)), acc);
    return acc;
}

AI void q_tile(const int32_t wt, const int bits, const int nr, const uint8_t *w, int64_t nb,
               const uint8_t *x, int64_t xs, float *y, int64_t ldy) {
    const int64_t bb = block_bytes(wt), gbytes = kvc__gemm_group_bytes(L, bits);
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7),
                                           _mm256_set1_epi32((int)bb));
    __m256 acc[4];
    UNROLL
    for (int i = 0; i < nr; i++) acc[i] = _mm256_setzero_ps();
    wgroup g;
    int64_t gi = 0;
    for (; (gi + 1) * GBLK <= nb; gi++) {
        load_group(wt, bits, w + gi * GBLK * bb, GBLK, idx, &g);
        UNROLL
        for (int i = 0; i < nr; i++)
            acc[i] = row_group(wt, bits, &g, 4, x + i * xs + gi * gbytes, acc[i]);
    }
    if (gi * GBLK < nb) {
        const int nblk = (int)(nb - gi * GBLK);
        load_group(wt, bits, w + gi * GBLK * bb, nblk, idx, &g);
        UNROLL
        for (int i = 0; i < nr; i++)
            acc[i] = row_group(wt, bits, &g, (nblk + 1) / 2, x + i * xs + gi * gbytes, acc[i]);
    }
    UNROLL
    for (int i = 0; i < nr; i++) y[i * ldy] = hsum8(acc[i]);
}

AI void q_rows(const int32_t wt, const int bits, const uint8_t *W, int64_t row_bytes, int64_t r0,
               int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n, float *Y,
               int64_t ldy) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int64_t r = r0; r < r1; r++)
            q_tile(wt, bits, 4, W + r * row_bytes, nb, xq + i * xs, xs, Y + i * ldy + r, ldy);
    for (; i < n; i++)
        for (int64_t r = r0; r < r1; r++)
            q_tile(wt, bits, 1, W + r * row_bytes, nb, xq + i * xs, xs, Y + i * ldy + r, ldy);
}

/* One switch for both widths: q_rows specialized per type (bits is a
 * constant in each caller). */
AI void q_types(const int bits, int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n, float *Y,
                int64_t ldy) {
#define Q_CASE(t) \
    case t: q_rows(t, bits, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy); break
    switch (wt) {
    Q_CASE(KVC_GGML_Q8_0);
    Q_CASE(KVC_GGML_Q4_0);
    Q_CASE(KVC_GGML_Q4_1);
    Q_CASE(KVC_GGML_Q5_0);
    Q_CASE(KVC_GGML_IQ4_NL);
    default: q_rows(KVC_GGML_Q5_1, bits, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy); break;
    }
#undef Q_CASE
}

static void gemm_q8_avx2(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
                         int64_t nb, const uint8_t *xq, int64_t xs, int64_t n, float *Y,
                         int64_t ldy) {
    q_types(8, wt, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy);
}

static void gemm_q16_avx2(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                          int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n,
                          float *Y, int64_t ldy) {
    q_types(16, wt, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy);
}

/* ---- float path --------------------------------------------------------------- */

/* 8 weights at column c of row w; cnt < 8: only cnt of them, rest zero. */
AI __m256 load_wf(const int32_t wt, const uint8_t *w, int64_t c, int cnt) {
    const int esz = wt == KVC_GGML_F32 ? 4 : 2;
    uint8_t buf[32];
    const uint8_t *p = w + c * esz;
    if (cnt < 8) {
        memset(buf, 0, sizeof buf);
        memcpy(buf, p, (size_t)(cnt * esz));
        p = buf;
    }
    if (wt == KVC_GGML_F32) return _mm256_loadu_ps((const float *)(const void *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)(const void *)p);
    if (wt == KVC_GGML_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AI __m256 load_xf(const float *x, int cnt) {
    if (cnt == 8) return _mm256_loadu_ps(x);
    float buf[8] = {0};
    memcpy(buf, x, (size_t)cnt * sizeof *x);
    return _mm256_loadu_ps(buf);
}

AI void f_tile(const int32_t wt, const int nr, const int nc, const uint8_t *w, int64_t row_bytes,
               int64_t cols, const float *x, int64_t ldx, float *y, int64_t ldy) {
    __m256 acc[4][4];
    UNROLL
    for (int i = 0; i < nr; i++)
        UNROLL
        for (int c = 0; c < nc; c++) acc[i][c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= cols; k += 8) {
        __m256 wv[4];
        UNROLL
        for (int c = 0; c < nc; c++) wv[c] = load_wf(wt, w + c * row_bytes, k, 8);
        UNROLL
        for (int i = 0; i < nr; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            UNROLL
            for (int c = 0; c < nc; c++) acc[i][c] = _mm256_fmadd_ps(wv[c], xv, acc[i][c]);
        }
    }
    if (k < cols) {
        const int cnt = (int)(cols - k);
        __m256 wv[4];
        UNROLL
        for (int c = 0; c < nc; c++) wv[c] = load_wf(wt, w + c * row_bytes, k, cnt);
        UNROLL
        for (int i = 0; i < nr; i++) {
            const __m256 xv = load_xf(x + i * ldx + k, cnt);
            UNROLL
            for (int c = 0; c < nc; c++) acc[i][c] = _mm256_fmadd_ps(wv[c], xv, acc[i][c]);
        }
    }
    UNROLL
    for (int i = 0; i < nr; i++)
        UNROLL
        for (int c = 0; c < nc; c++) y[i * ldy + c] = hsum8(acc[i][c]);
}

AI void f_rows(const int32_t wt, const uint8_t *W, int64_t rb, int64_t r0, int64_t r1,
               int64_t cols, const float *X, int64_t ldx, int64_t n, float *Y, int64_t ldy) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        int64_t r = r0;
        for (; r + 2 <= r1; r += 2)
            f_tile(wt, 4, 2, W + r * rb, rb, cols, X + i * ldx, ldx, Y + i * ldy + r, ldy);
        for (; r < r1; r++)
            f_tile(wt, 4, 1, W + r * rb, rb, cols, X + i * ldx, ldx, Y + i * ldy + r, ldy);
    }
    for (; i < n; i++) {
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4)
            f_tile(wt, 1, 4, W + r * rb, rb, cols, X + i * ldx, ldx, Y + i * ldy + r, ldy);
        for (; r < r1; r++)
            f_tile(wt, 1, 1, W + r * rb, rb, cols, X + i * ldx, ldx, Y + i * ldy + r, ldy);
    }
}

static void gemm_f_avx2(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
                        int64_t cols, const float *X, int64_t ldx, int64_t n, float *Y,
                        int64_t ldy) {
    switch (wt) {
    case KVC_GGML_F32: f_rows(KVC_GGML_F32, W, row_bytes, r0, r1, cols, X, ldx, n, Y, ldy); break;
    case KVC_GGML_F16: f_rows(KVC_GGML_F16, W, row_bytes, r0, r1, cols, X, ldx, n, Y, ldy); break;
    default: f_rows(KVC_GGML_BF16, W, row_bytes, r0, r1, cols, X, ldx, n, Y, ldy); break;
    }
}

const kvc__gemm_kernels *kvc__gemm_kernels_avx2(void) {
    static const kvc__gemm_kernels k = {"avx2",       "avx2",       L,
                                        gemm_q8_avx2, gemm_q16_avx2, kvc__gemm_kq8_avx2,
                                        kvc__gemm_kq16_avx2, gemm_f_avx2};
    return &k;
}
