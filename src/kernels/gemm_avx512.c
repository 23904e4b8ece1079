/*
 * AVX-512 kernels of kvc__gemm (gemm_kernels.h): F/BW/VL/DQ for the float
 * weights, plus VNNI (vpdpwssd / vpdpbusd) for the integer ones. This file
 * is compiled with -mavx512vnni; gemm.c only calls gemm_q8 / gemm_q16 after
 * checking the CPU has AVX512_VNNI (cpuid), and runs the AVX2 integer
 * kernels otherwise.
 *
 * Integer paths, one group of 16 weight blocks (512 elements) of one W row:
 *   - register j (0..3), 128-bit lane k holds block 4 j + k, loaded straight
 *     from the ggml blocks: 16 bytes of nibbles (Q4) or two 16-byte halves
 *     (Q8_0);
 *   - int16 activations (the default): the weights are widened to int16 in
 *     place with 16-bit shifts / masks, no shuffles: word i of a lane holds
 *     bytes 2i, 2i+1, so Q4 nibbles at bits 0, 8, 4, 12 are elements 2i,
 *     2i+1, 16+2i, 17+2i (zero-extended: srli + and 15), Q8_0 bytes are
 *     sign-extended with slli 8 + srai 8 (even) and srai 8 (odd); the
 *     activation layout stores the 4 parts in that order. Then vpdpwssd
 *     (s16 x s16, pairs summed into int32), 4 per register j;
 *   - int8 activations: vpdpbusd(u8 weights, s8 activations): for Q8_0 the
 *     weights are made unsigned by w ^ 0x80 = w + 128 and 128 * qsum is
 *     subtracted after; 2 per register j;
 *   - Q4_0 uses its nibbles as 0..15 and subtracts 8 * qsum after;
 *   - IQ4_NL: its nibbles select int8 values (vpshufb on a 16-byte table),
 *     then as Q8_0's bytes;
 *   - Q5_0 / Q5_1: the nibbles plus their fifth bits (qh words read as
 *     scalars into byte masks, a masked add) as bytes 0..31, widened like Q8_0's bytes
 *     for int16 activations (zero-extended); Q5_0 subtracts 16 * qsum;
 *   - each lane then holds 4 int32 partial sums of one block; reduce4 turns
 *     4 registers into one vector of 16 block sums, block b(p) = 4 (p % 4)
 *     + p / 4 at position p (the activation layout stores dx/qsum/sx in that
 *     order, and the weight scales are loaded in it: 16-byte lane loads
 *     at the block starts and a per-lane transpose, a gather for a partial
 *     group);
 *   - acc += float(isum) * (dw * dx) [+ mw * sx] in float32, one 16-lane
 *     accumulator per (X row, W row), reduced once at the end of the row.
 * A tile is up to 4 X rows x 1 W row: the weight group is loaded and
 * unpacked once and used for every X row of the tile; each Y element goes
 * through the same operations whatever the tile size (row independence).
 *
 * float path: tiles of up to 4 X rows x 4 W rows, 16 columns per step,
 * fused multiply-add into one accumulator per element, masked tail,
 * reduced at the end.
 */
#include <immintrin.h>
#include <string.h>

#include "gemm_kernels.h"

#define AI static inline __attribute__((always_inline))
/* Tile loops have compile-time trip counts (<= 4): unrolled, their
 * registers stay registers instead of stack arrays. */
#define UNROLL _Pragma("GCC unroll 4")

#define L 4    /* 128-bit lanes per register */
#define GBLK 16 /* blocks per group */

/* ---- integer paths ------------------------------------------------------------ */

typedef struct wgroup {
    /* register j lane k = block 4 j + k; int8: v[j][0] lo, v[j][1] hi (u8);
     * int16: v[j][s] part s (int16, the activation layout's part order) */
    __m512i v[4][4];
    __m512 dw, mw; /* scale and offset of block b(p) at position p */
} wgroup;

static const int8_t iq4nl_values[16] = KVC_GGML_IQ4_NL_VALUES;

static int64_t block_bytes(int32_t wt) {
    return wt == KVC_GGML_Q8_0                              ? 34
           : wt == KVC_GGML_Q4_0 || wt == KVC_GGML_IQ4_NL ? 18
           : wt == KVC_GGML_Q4_1 ? 20
           : wt == KVC_GGML_Q5_0 ? 22
                                 : 24;
}

/* Q5_0 / Q5_1: the fifth bits of register j's blocks (qh words at qh + b
 * bb) as byte masks: bit 16 k + e of *lo (*hi) is bit e (16 + e) of block
 * 4 j + k's word; blocks >= nblk give 0 and are not read. Scalar loads and
 * shifts: the shuffle port is busy with the lane inserts of load4. */
AI void fifth_masks(const uint8_t *qh, int64_t bb, int j, int nblk, __mmask64 *lo,
                    __mmask64 *hi) {
    uint64_t l = 0, h = 0;
    UNROLL
    for (int k = 0; k < 4; k++) {
        if (4 * j + k >= nblk) break;
        uint32_t v;
        memcpy(&v, qh + (4 * j + k) * bb, 4);
        l |= (uint64_t)(v & 0xffff) << (16 * k);
        h |= (uint64_t)(v >> 16) << (16 * k);
    }
    *lo = _cvtu64_mask64(l);
    *hi = _cvtu64_mask64(h);
}

/* Register j of a group: lane k = 16 bytes at p + (4 j + k) * bb, lanes of
 * blocks >= nblk zero (and not read). */
AI __m512i load4(const uint8_t *p, int64_t bb, int j, int nblk) {
    p += 4 * j * bb;
#define LD(k) _mm_loadu_si128((const __m128i *)(const void *)(p + (k) * bb))
    if (4 * j + 4 <= nblk) {
        __m512i v = _mm512_castsi128_si512(LD(0));
        v = _mm512_inserti32x4(v, LD(1), 1);
        v = _mm512_inserti32x4(v, LD(2), 2);
        return _mm512_inserti32x4(v, LD(3), 3);
    }
    __m512i v = _mm512_setzero_si512();
    if (4 * j + 0 < nblk) v = _mm512_inserti32x4(v, LD(0), 0);
    if (4 * j + 1 < nblk) v = _mm512_inserti32x4(v, LD(1), 1);
    if (4 * j + 2 < nblk) v = _mm512_inserti32x4(v, LD(2), 2);
    return v; /* 4 j + 3 >= nblk here */
#undef LD
}

/* Scales (and Q4_1 offsets) of the nblk (<= 16) blocks at w, block b(p) at
 * position p. */
AI void load_scales(const int32_t wt, const uint8_t *w, int nblk, __m512i idx, __m512 *dw,
                    __m512 *mw) {
    const int64_t bb = block_bytes(wt);
    /* block headers (f16 d [, f16 m]) as dwords, in position order */
    __m512i h;
    if (nblk == GBLK) {
        /* lane k of register j starts with the header of block 4 j + k
         * (16 bytes from a block start stay inside the block); a per-lane
         * transpose of the first dwords puts block 4 j + k at position
         * 4 k + j. Cheaper than a 16-element gather. */
        const __m512i t01 = _mm512_unpacklo_epi32(load4(w, bb, 0, GBLK), load4(w, bb, 1, GBLK));
        const __m512i t23 = _mm512_unpacklo_epi32(load4(w, bb, 2, GBLK), load4(w, bb, 3, GBLK));
        h = _mm512_unpacklo_epi64(t01, t23);
    } else if (nblk <= 4) {
        /* short tail (576 columns = 16 + 2 blocks): block b sits at position
         * 4 b; a few scalar loads beat a masked gather */
        h = _mm512_setzero_si512();
        UNROLL
        for (int b = 0; b < 4; b++) {
            if (b >= nblk) break;
            uint32_t v;
            memcpy(&v, w + b * bb, 4);
            h = _mm512_mask_set1_epi32(h, (__mmask16)(1u << (4 * b)), (int)v);
        }
    } else {
        const __m512i bpos = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __mmask16 m = _mm512_cmplt_epi32_mask(bpos, _mm512_set1_epi32(nblk));
        h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, (const void *)w, 1);
    }
    *dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
    if (wt == KVC_GGML_Q4_1 || wt == KVC_GGML_Q5_1)
        *mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
}

/* Loads and unpacks the nblk (<= 16) blocks at w for bits-wide activations. */
AI void load_group(const int32_t wt, const int bits, const uint8_t *w, int nblk, __m512i idx,
                   wgroup *g) {
    const int64_t bb = block_bytes(wt);
    const int nz = (nblk + 3) / 4;
    const __m512i m4 = _mm512_set1_epi8(15), x80 = _mm512_set1_epi8((char)0x80);
    UNROLL
    for (int j = 0; j < 4; j++) {
        if (j >= nz) {
            g->v[j][0] = g->v[j][1] = g->v[j][2] = g->v[j][3] = _mm512_setzero_si512();
            continue;
        }
        if (wt == KVC_GGML_Q8_0 || wt == KVC_GGML_IQ4_NL) {
            __m512i lo, hi; /* int8 weights: Q8_0's, or IQ4_NL's looked up (vpshufb) */
            if (wt == KVC_GGML_Q8_0) {
                lo = load4(w + 2, bb, j, nblk);
                hi = load4(w + 18, bb, j, nblk);
            } else {
                const __m512i tbl = _mm512_broadcast_i32x4(
                    _mm_loadu_si128((const __m128i *)(const void *)iq4nl_values));
                const __m512i v = load4(w + 2, bb, j, nblk);
                lo = _mm512_shuffle_epi8(tbl, _mm512_and_si512(v, m4));
                hi = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
            }
            if (bits == 8) {
                g->v[j][0] = _mm512_xor_si512(lo, x80);
                g->v[j][1] = _mm512_xor_si512(hi, x80);
            } else { /* sign-extended even bytes (shift up, arithmetic down), odd bytes */
                g->v[j][0] = _mm512_srai_epi16(_mm512_slli_epi16(lo, 8), 8);
                g->v[j][1] = _mm512_srai_epi16(lo, 8);
                g->v[j][2] = _mm512_srai_epi16(_mm512_slli_epi16(hi, 8), 8);
                g->v[j][3] = _mm512_srai_epi16(hi, 8);
            }
        } else if (wt == KVC_GGML_Q5_0 || wt == KVC_GGML_Q5_1) {
            /* codes as bytes (0..31), then (int16) even / odd bytes: the
             * activation layout's part order */
            const int qh = wt == KVC_GGML_Q5_0 ? 2 : 4;
            const __m512i v = load4(w + qh + 4, bb, j, nblk), x16 = _mm512_set1_epi8(16);
            __mmask64 mlo, mhi;
            fifth_masks(w + qh, bb, j, nblk, &mlo, &mhi);
            __m512i lo = _mm512_and_si512(v, m4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            lo = _mm512_mask_add_epi8(lo, mlo, lo, x16);
            hi = _mm512_mask_add_epi8(hi, mhi, hi, x16);
            if (bits == 8) {
                g->v[j][0] = lo;
                g->v[j][1] = hi;
            } else {
                const __m512i m255 = _mm512_set1_epi16(255);
                g->v[j][0] = _mm512_and_si512(lo, m255);
                g->v[j][1] = _mm512_srli_epi16(lo, 8);
                g->v[j][2] = _mm512_and_si512(hi, m255);
                g->v[j][3] = _mm512_srli_epi16(hi, 8);
            }
        } else {
            const __m512i v = load4(w + (wt == KVC_GGML_Q4_1 ? 4 : 2), bb, j, nblk);
            if (bits == 8) {
                g->v[j][0] = _mm512_and_si512(v, m4);
                g->v[j][1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            } else { /* word i = bytes 2i, 2i+1: nibble at bit 0 (element 2i),
                      * 8 (2i+1), 4 (16+2i), 12 (17+2i), zero-extended */
                const __m512i m15 = _mm512_set1_epi16(15);
                g->v[j][0] = _mm512_and_si512(v, m15);
                g->v[j][1] = _mm512_and_si512(_mm512_srli_epi16(v, 8), m15);
                g->v[j][2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
                g->v[j][3] = _mm512_srli_epi16(v, 12);
            }
        }
    }
    load_scales(wt, w, nblk, idx, &g->dw, &g->mw);
}

/* 4 registers of per-lane partial sums -> 16 block sums: lane k of the
 * result holds (a_k, b_k, c_k, d_k), the full sums of lane k of a, b, c, d. */
AI __m512i reduce4(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

/* One activation row against one weight group: acc += this group's terms. */
AI __m512 row_group(const int32_t wt, const int bits, const wgroup *g, int nz, const uint8_t *xg,
                    __m512 acc) {
    const int64_t qbytes = (bits == 16 ? 256 : 128) * L;
    __m512i a[4];
    UNROLL
    for (int j = 0; j < 4; j++) {
        if (j >= nz) {
            a[j] = _mm512_setzero_si512();
            continue;
        }
#define XL(r) _mm512_loadu_si512((const void *)(xg + (r) * 16 * L))
        if (bits == 8) {
            a[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), g->v[j][0],
                                                           XL(2 * j)),
                                       g->v[j][1], XL(2 * j + 1));
        } else { /* one chain of four: 4 j x nr rows of chains hide the latency */
            __m512i t = _mm512_setzero_si512();
            UNROLL
            for (int s = 0; s < 4; s++) t = _mm512_dpwssd_epi32(t, g->v[j][s], XL(4 * j + s));
            a[j] = t;
        }
#undef XL
    }
    __m512i isum = reduce4(a[0], a[1], a[2], a[3]);
    const __m512i qs = _mm512_loadu_si512((const void *)(xg + qbytes + 16 * L));
    if (wt == KVC_GGML_Q4_0) /* nibbles were used as 0..15: subtract 8 sum q */
        isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(qs, 3));
    if (wt == KVC_GGML_Q5_0) /* codes were used as 0..31: subtract 16 sum q */
        isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(qs, 4));
    if ((wt == KVC_GGML_Q8_0 || wt == KVC_GGML_IQ4_NL) && bits == 8) /* used as w + 128 */
        isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(qs, 7));
    const __m512 dx = _mm512_loadu_ps((const void *)(xg + qbytes));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(g->dw, dx), acc);
    if (wt == KVC_GGML_Q4_1 || wt == KVC_GGML_Q5_1)
        acc = _mm512_fmadd_ps(g->mw, _mm512_loadu_ps((const void *)(xg + qbytes + 32 * L)), acc);
    return acc;
}

/* nr (1..4) activation rows (row i at x + i * xs) times W row w: y[i * ldy]. */
AI void q_tile(const int32_t wt, const int bits, const int nr, const uint8_t *w, int64_t nb,
               const uint8_t *x, int64_t xs, float *y, int64_t ldy) {
    const int64_t bb = block_bytes(wt), gbytes = kvc__gemm_group_bytes(L, bits);
    const __m512i idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
        _mm512_set1_epi32((int)bb));
    __m512 acc[4];
    UNROLL
    for (int i = 0; i < nr; i++) acc[i] = _mm512_setzero_ps();
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
            acc[i] = row_group(wt, bits, &g, (nblk + 3) / 4, x + i * xs + gi * gbytes, acc[i]);
    }
    UNROLL
    for (int i = 0; i < nr; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
}

/* Tiles of 4 X rows x 1 W row; rows of X outermost so a tile's activations
 * stay in L1 while the task's W rows (a few KiB each) come from L1/L2. */
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

static void gemm_q8_avx512(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                           int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n,
                           float *Y, int64_t ldy) {
    q_types(8, wt, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy);
}

static void gemm_q16_avx512(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                            int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n,
                            float *Y, int64_t ldy) {
    q_types(16, wt, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy);
}

/* ---- float path --------------------------------------------------------------- */

/* 16 weights from column c of row w (lanes outside mask m are zero). */
AI __m512 load_wf(const int32_t wt, const uint8_t *w, int64_t c, __mmask16 m) {
    if (wt == KVC_GGML_F32) return _mm512_maskz_loadu_ps(m, (const void *)(w + 4 * c));
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const void *)(w + 2 * c));
    if (wt == KVC_GGML_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* BF16 */
}

AI __m512 load_wf_full(const int32_t wt, const uint8_t *w, int64_t c) {
    if (wt == KVC_GGML_F32) return _mm512_loadu_ps((const void *)(w + 4 * c));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)(w + 2 * c));
    if (wt == KVC_GGML_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* nr X rows (x + i * ldx) x nc W rows (w + c * row_bytes) -> y[i * ldy + c]. */
AI void f_tile(const int32_t wt, const int nr, const int nc, const uint8_t *w, int64_t row_bytes,
               int64_t cols, const float *x, int64_t ldx, float *y, int64_t ldy) {
    __m512 acc[4][4];
    UNROLL
    for (int i = 0; i < nr; i++)
        UNROLL
        for (int c = 0; c < nc; c++) acc[i][c] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= cols; k += 16) {
        __m512 wv[4];
        UNROLL
        for (int c = 0; c < nc; c++) wv[c] = load_wf_full(wt, w + c * row_bytes, k);
        UNROLL
        for (int i = 0; i < nr; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
            UNROLL
            for (int c = 0; c < nc; c++) acc[i][c] = _mm512_fmadd_ps(wv[c], xv, acc[i][c]);
        }
    }
    if (k < cols) {
        const __mmask16 m = (__mmask16)((1u << (cols - k)) - 1);
        __m512 wv[4];
        UNROLL
        for (int c = 0; c < nc; c++) wv[c] = load_wf(wt, w + c * row_bytes, k, m);
        UNROLL
        for (int i = 0; i < nr; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + k);
            UNROLL
            for (int c = 0; c < nc; c++) acc[i][c] = _mm512_fmadd_ps(wv[c], xv, acc[i][c]);
        }
    }
    UNROLL
    for (int i = 0; i < nr; i++)
        UNROLL
        for (int c = 0; c < nc; c++) y[i * ldy + c] = _mm512_reduce_add_ps(acc[i][c]);
}

AI void f_rows(const int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
               int64_t cols, const float *X, int64_t ldx, int64_t n, float *Y, int64_t ldy) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4)
            f_tile(wt, 4, 4, W + r * row_bytes, row_bytes, cols, X + i * ldx, ldx, Y + i * ldy + r, ldy);
        for (; r < r1; r++)
            f_tile(wt, 4, 1, W + r * row_bytes, row_bytes, cols, X + i * ldx, ldx, Y + i * ldy + r, ldy);
    }
    for (; i < n; i++) {
        int64_t r = r0;
        for (; r + 4 <= r1; r += 4)
            f_tile(wt, 1, 4, W + r * row_bytes, row_bytes, cols, X + i * ldx, ldx, Y + i * ldy + r, ldy);
        for (; r < r1; r++)
            f_tile(wt, 1, 1, W + r * row_bytes, row_bytes, cols, X + i * ldx, ldx, Y + i * ldy + r, ldy);
    }
}

static void gemm_f_avx512(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
                          int64_t cols, const float *X, int64_t ldx, int64_t n, float *Y,
                          int64_t ldy) {
    switch (wt) {
    case KVC_GGML_F32: f_rows(KVC_GGML_F32, W, row_bytes, r0, r1, cols, X, ldx, n, Y, ldy); break;
    case KVC_GGML_F16: f_rows(KVC_GGML_F16, W, row_bytes, r0, r1, cols, X, ldx, n, Y, ldy); break;
    default: f_rows(KVC_GGML_BF16, W, row_bytes, r0, r1, cols, X, ldx, n, Y, ldy); break;
    }
}

const kvc__gemm_kernels *kvc__gemm_kernels_avx512(void) {
    static const kvc__gemm_kernels k = {"avx512-vnni",        "avx512",
                                        L,                    gemm_q8_avx512,
                                        gemm_q16_avx512,      kvc__gemm_kq8_avx512,
                                        kvc__gemm_kq16_avx512, gemm_f_avx512};
    return &k;
}
