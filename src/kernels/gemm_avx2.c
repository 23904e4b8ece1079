/*
 * AVX2 (+FMA, F16C) kernels of kvc__gemm (gemm_kernels.h). Also the int8
 * kernels of the avx512 ISA on CPUs without AVX512_VNNI.
 *
 * int8 path: the AVX-512 scheme (gemm_avx512.c) at half width: groups of 8
 * weight blocks, register j (0..3) lane k (0..1) = block 2 j + k; products
 * with vpmaddubsw (u8 x s8 -> pairs summed in int16) then vpmaddwd with
 * ones (-> int32):
 *   Q4_0/Q4_1: nibbles (0..15) are the unsigned operand; lo and hi products
 *     (each pair |sum| <= 2 * 15 * 127) are added in int16 before vpmaddwd;
 *     Q4_0 subtracts 8 * qsum after.
 *   Q8_0: the sign trick, |w| (u8, 0..128) times x carrying w's sign
 *     (vpsignb), pair sums <= 2 * 128 * 127 < 32768, no saturation; lo and hi
 *     go through vpmaddwd separately (their sum could exceed int16).
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

#define L 2
#define GBLK 8
#define GBYTES (176 * L)
#define OFF_DX (128 * L)
#define OFF_QSUM (144 * L)
#define OFF_SX (160 * L)

static int64_t block_bytes(int32_t wt) {
    return wt == KVC_GGML_Q8_0 ? 34 : wt == KVC_GGML_Q4_0 ? 18 : 20;
}

/* Sum of the 8 lanes in a fixed order. */
AI float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- int8 path -------------------------------------------------------------- */

typedef struct wgroup {
    __m256i lo[4], hi[4]; /* Q4: nibbles; Q8_0: |w| */
    __m256i slo[4], shi[4]; /* Q8_0: w (for its sign) */
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

AI void load_group(const int32_t wt, const uint8_t *w, int nblk, __m256i idx, wgroup *g) {
    const int64_t bb = block_bytes(wt);
    const int nz = (nblk + 1) / 2;
    const __m256i m4 = _mm256_set1_epi8(15);
    UNROLL
    for (int j = 0; j < 4; j++) {
        if (j >= nz) {
            g->lo[j] = g->hi[j] = g->slo[j] = g->shi[j] = _mm256_setzero_si256();
            continue;
        }
        if (wt == KVC_GGML_Q8_0) {
            g->slo[j] = load2(w + 2, bb, j, nblk);
            g->shi[j] = load2(w + 18, bb, j, nblk);
            g->lo[j] = _mm256_abs_epi8(g->slo[j]);
            g->hi[j] = _mm256_abs_epi8(g->shi[j]);
        } else {
            const __m256i v = load2(w + (wt == KVC_GGML_Q4_1 ? 4 : 2), bb, j, nblk);
            g->lo[j] = _mm256_and_si256(v, m4);
            g->hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
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
    if (wt == KVC_GGML_Q4_1) g->mw = f16_dwords(h, 1);
}

AI __m256i reduce4(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const __m256i cd = _mm256_add_epi32(_mm256_unpacklo_epi32(c, d), _mm256_unpackhi_epi32(c, d));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
}

AI __m256 row_group(const int32_t wt, const wgroup *g, int nz, const uint8_t *xg, __m256 acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a[4];
    UNROLL
    for (int j = 0; j < 4; j++) {
        if (j >= nz) {
            a[j] = _mm256_setzero_si256();
            continue;
        }
        const __m256i xl = _mm256_loadu_si256((const __m256i *)(const void *)(xg + 2 * j * 16 * L));
        const __m256i xh =
            _mm256_loadu_si256((const __m256i *)(const void *)(xg + (2 * j + 1) * 16 * L));
        if (wt == KVC_GGML_Q8_0) {
            const __m256i pl = _mm256_madd_epi16(
                _mm256_maddubs_epi16(g->lo[j], _mm256_sign_epi8(xl, g->slo[j])), ones);
            const __m256i ph = _mm256_madd_epi16(
                _mm256_maddubs_epi16(g->hi[j], _mm256_sign_epi8(xh, g->shi[j])), ones);
            a[j] = _mm256_add_epi32(pl, ph);
        } else {
            a[j] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(g->lo[j], xl),
                                                      _mm256_maddubs_epi16(g->hi[j], xh)),
                                     ones);
        }
    }
    __m256i isum = reduce4(a[0], a[1], a[2], a[3]);
    if (wt == KVC_GGML_Q4_0) {
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(const void *)(xg + OFF_QSUM));
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(qs, 3));
    }
    const __m256 dx = _mm256_loadu_ps((const float *)(const void *)(xg + OFF_DX));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(g->dw, dx), acc);
    if (wt == KVC_GGML_Q4_1)
        acc = _mm256_fmadd_ps(g->mw, _mm256_loadu_ps((const float *)(const void *)(xg + OFF_SX)),
                              acc);
    return acc;
}

AI void q_tile(const int32_t wt, const int nr, const uint8_t *w, int64_t nb, const uint8_t *x,
               int64_t xs, float *y, int64_t ldy) {
    const int64_t bb = block_bytes(wt);
    const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7),
                                           _mm256_set1_epi32((int)bb));
    __m256 acc[4];
    UNROLL
    for (int i = 0; i < nr; i++) acc[i] = _mm256_setzero_ps();
    wgroup g;
    int64_t gi = 0;
    for (; (gi + 1) * GBLK <= nb; gi++) {
        load_group(wt, w + gi * GBLK * bb, GBLK, idx, &g);
        UNROLL
        for (int i = 0; i < nr; i++) acc[i] = row_group(wt, &g, 4, x + i * xs + gi * GBYTES, acc[i]);
    }
    if (gi * GBLK < nb) {
        const int nblk = (int)(nb - gi * GBLK);
        load_group(wt, w + gi * GBLK * bb, nblk, idx, &g);
        UNROLL
        for (int i = 0; i < nr; i++)
            acc[i] = row_group(wt, &g, (nblk + 1) / 2, x + i * xs + gi * GBYTES, acc[i]);
    }
    UNROLL
    for (int i = 0; i < nr; i++) y[i * ldy] = hsum8(acc[i]);
}

AI void q_rows(const int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
               int64_t nb, const uint8_t *xq, int64_t xs, int64_t n, float *Y, int64_t ldy) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int64_t r = r0; r < r1; r++)
            q_tile(wt, 4, W + r * row_bytes, nb, xq + i * xs, xs, Y + i * ldy + r, ldy);
    for (; i < n; i++)
        for (int64_t r = r0; r < r1; r++)
            q_tile(wt, 1, W + r * row_bytes, nb, xq + i * xs, xs, Y + i * ldy + r, ldy);
}

static void gemm_q_avx2(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
                        int64_t nb, const uint8_t *xq, int64_t xs, int64_t n, float *Y,
                        int64_t ldy) {
    switch (wt) {
    case KVC_GGML_Q8_0: q_rows(KVC_GGML_Q8_0, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy); break;
    case KVC_GGML_Q4_0: q_rows(KVC_GGML_Q4_0, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy); break;
    default: q_rows(KVC_GGML_Q4_1, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy); break;
    }
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
    static const kvc__gemm_kernels k = {"avx2", "avx2", L, gemm_q_avx2, gemm_f_avx2};
    return &k;
}
