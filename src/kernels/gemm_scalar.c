/*
 * Scalar reference kernels of kvc__gemm (gemm_kernels.h), plain C that reads
 * like the math: one output element at a time, blocks in order.
 *
 *   float weights:  acc = acc + w[c] * x[c], c = 0, 1, ...
 *   quantized:      per block b: isum = sum_e qw[e] * qx[e] (int32, exact),
 *                   acc = acc + (dw * dx) * float(isum)  [acc = acc + mw * sx]
 *                   (Q5_0, Q5_1: qw with its fifth bit from qh; Q5_0 qw - 16;
 *                   IQ4_NL: qw = kvalues[nibble])
 *
 * K-quants and IQ4_XS: gemm_kernels.h's per-sub-block and per-half sums.
 *
 * Activations use the layout with L = 1 (natural order: block b's 32 int8 or
 * int16 values at 32 b within its group of 4, then dx/qsum/sx of the 4
 * blocks). One block_dot for both widths: the activation integers are read
 * into int32 first. K-quants: one super-block's integers and scales are
 * unpacked, then its 8 sub-blocks go as above (gemm_kernels.h's formulas).
 */
#include <string.h>

#include "gemm_kernels.h"
#include "kvcache/core.h"

static float f16_at(const uint8_t *p) { return kvc_f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

static float load_w(int32_t wt, const uint8_t *w, int64_t c) {
    switch (wt) {
    case KVC_GGML_F32: {
        float v;
        memcpy(&v, w + 4 * c, 4);
        return v;
    }
    case KVC_GGML_F16: return f16_at(w + 2 * c);
    default: return kvc_bf16_to_f32((uint16_t)(w[2 * c] | w[2 * c + 1] << 8));
    }
}

static void gemm_f_scalar(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
                          int64_t cols, const float *X, int64_t ldx, int64_t n, float *Y,
                          int64_t ldy) {
    for (int64_t i = 0; i < n; i++) {
        const float *x = X + i * ldx;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *w = W + r * row_bytes;
            float acc = 0.0f;
            for (int64_t c = 0; c < cols; c++) acc = acc + load_w(wt, w, c) * x[c];
            Y[i * ldy + r] = acc;
        }
    }
}

/* Dot product of weight block wb (type wt) with activation block b of row
 * xq (bits 8 or 16); returns its float contribution. */
static float block_dot(int32_t wt, const uint8_t *wb, const uint8_t *xq, int64_t b, int bits) {
    const uint8_t *grp = xq + b / 4 * kvc__gemm_group_bytes(1, bits);
    const int64_t qb = kvc__gemm_group_qbytes(1, bits);
    const int p = (int)(b % 4);
    int32_t qx[32];
    for (int e = 0; e < 32; e++) {
        if (bits == 16) {
            int16_t v;
            memcpy(&v, grp + 64 * p + 2 * e, 2);
            qx[e] = v;
        } else {
            qx[e] = (int8_t)grp[32 * p + e];
        }
    }
    float dx, sx;
    memcpy(&dx, grp + qb + 4 * p, 4);
    memcpy(&sx, grp + qb + 32 + 4 * p, 4);
    int32_t isum = 0;
    switch (wt) {
    case KVC_GGML_Q8_0: /* f16 d, int8 q[32] */
        for (int e = 0; e < 32; e++) isum += (int8_t)wb[2 + e] * qx[e];
        return (f16_at(wb) * dx) * (float)isum;
    case KVC_GGML_Q4_0: /* f16 d, nibbles: element e < 16 low nibble of byte e, else high of e-16 */
        for (int e = 0; e < 16; e++) {
            isum += ((wb[2 + e] & 15) - 8) * qx[e];
            isum += ((wb[2 + e] >> 4) - 8) * qx[e + 16];
        }
        return (f16_at(wb) * dx) * (float)isum;
    case KVC_GGML_Q4_1: { /* f16 d, f16 m, nibbles; x = d q + m */
        for (int e = 0; e < 16; e++) {
            isum += (wb[4 + e] & 15) * qx[e];
            isum += (wb[4 + e] >> 4) * qx[e + 16];
        }
        const float acc = (f16_at(wb) * dx) * (float)isum;
        return acc + f16_at(wb + 2) * sx;
    }
    case KVC_GGML_Q5_0: { /* f16 d, qh[4], nibbles: bit 4 of element e is bit e of qh;
                           * x = d (q - 16) */
        const uint32_t qh = (uint32_t)wb[2] | (uint32_t)wb[3] << 8 | (uint32_t)wb[4] << 16 |
                            (uint32_t)wb[5] << 24;
        for (int e = 0; e < 16; e++) {
            isum += ((int32_t)((wb[6 + e] & 15) | ((qh >> e) & 1) << 4) - 16) * qx[e];
            isum += ((int32_t)((wb[6 + e] >> 4) | ((qh >> (e + 16)) & 1) << 4) - 16) * qx[e + 16];
        }
        return (f16_at(wb) * dx) * (float)isum;
    }
    case KVC_GGML_IQ4_NL: { /* f16 d, nibbles as Q4_0: x = d kvalues[q] */
        static const int8_t kv[16] = KVC_GGML_IQ4_NL_VALUES;
        for (int e = 0; e < 16; e++) {
            isum += kv[wb[2 + e] & 15] * qx[e];
            isum += kv[wb[2 + e] >> 4] * qx[e + 16];
        }
        return (f16_at(wb) * dx) * (float)isum;
    }
    default: { /* Q5_1: f16 d, f16 m, qh[4], nibbles; x = d q + m */
        const uint32_t qh = (uint32_t)wb[4] | (uint32_t)wb[5] << 8 | (uint32_t)wb[6] << 16 |
                            (uint32_t)wb[7] << 24;
        for (int e = 0; e < 16; e++) {
            isum += (int32_t)((wb[8 + e] & 15) | ((qh >> e) & 1) << 4) * qx[e];
            isum += (int32_t)((wb[8 + e] >> 4) | ((qh >> (e + 16)) & 1) << 4) * qx[e + 16];
        }
        const float acc = (f16_at(wb) * dx) * (float)isum;
        return acc + f16_at(wb + 2) * sx;
    }
    }
}

static void gemm_q_scalar(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
                          int64_t nb, const uint8_t *xq, int64_t xq_stride, int64_t n, float *Y,
                          int64_t ldy, int bits) {
    const int64_t bb = wt == KVC_GGML_Q8_0                              ? 34
                       : wt == KVC_GGML_Q4_0 || wt == KVC_GGML_IQ4_NL ? 18
                       : wt == KVC_GGML_Q4_1 ? 20
                       : wt == KVC_GGML_Q5_0 ? 22
                                             : 24;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *x = xq + i * xq_stride;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *w = W + r * row_bytes;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) acc = acc + block_dot(wt, w + b * bb, x, b, bits);
            Y[i * ldy + r] = acc;
        }
    }
}

static void gemm_q8_scalar(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                           int64_t r1, int64_t nb, const uint8_t *xq, int64_t xq_stride,
                           int64_t n, float *Y, int64_t ldy) {
    gemm_q_scalar(wt, W, row_bytes, r0, r1, nb, xq, xq_stride, n, Y, ldy, 8);
}

static void gemm_q16_scalar(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                            int64_t r1, int64_t nb, const uint8_t *xq, int64_t xq_stride,
                            int64_t n, float *Y, int64_t ldy) {
    gemm_q_scalar(wt, W, row_bytes, r0, r1, nb, xq, xq_stride, n, Y, ldy, 16);
}

/* ---- K-quants ------------------------------------------------------------------ */

/* Activation block b of row xq: integers, dx and sx. */
static void act_block(const uint8_t *xq, int64_t b, int bits, int32_t qx[32], float *dx,
                      float *sx) {
    const uint8_t *grp = xq + b / 4 * kvc__gemm_group_bytes(1, bits);
    const int64_t qb = kvc__gemm_group_qbytes(1, bits);
    const int p = (int)(b % 4);
    for (int e = 0; e < 32; e++) {
        if (bits == 16) {
            int16_t v;
            memcpy(&v, grp + 64 * p + 2 * e, 2);
            qx[e] = v;
        } else {
            qx[e] = (int8_t)grp[32 * p + e];
        }
    }
    memcpy(dx, grp + qb + 4 * p, 4);
    memcpy(sx, grp + qb + 32 + 4 * p, 4);
}

/* Integers and float scales of one super-block (layouts: gguf.h,
 * src/gguf/dequant.c): Q4_K/Q5_K q[e] unsigned, dw[j] = d sc_j, mw[j] =
 * -(dmin m_j) per sub-block j of 32; IQ4_XS q[e] = kvalues[nibble], dw[j] =
 * d (ls_j - 32); per 16 elements h: Q6_K q[e] - 32, dw[h] = d sc_h; Q3_K
 * q[e] - 4, dw[h] = d (sc_h - 32); Q2_K q[e] unsigned, dw[h] = d sc_h, mn[h]
 * the 4-bit min, mw[0] = -dmin. */
static void kq_unpack(int32_t wt, const uint8_t *b, int32_t q[256], float dw[16], float mw[8],
                      int32_t mn[16]) {
    switch (wt) {
    case KVC_GGML_Q6_K: {
        const float d = f16_at(b + 208);
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, r = e % 128;
            const int lo = (b[64 * h + r % 64] >> (4 * (r / 64))) & 15;
            const int hi = (b[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
            q[e] = (lo | hi << 4) - 32;
        }
        for (int h = 0; h < 16; h++) dw[h] = d * (float)(int8_t)b[192 + h];
        return;
    }
    case KVC_GGML_Q2_K:
    case KVC_GGML_Q3_K: {
        /* element e: 2 bits (qs[32 (e / 128) + e % 32] >> 2 (e / 32 % 4)) & 3;
         * Q3_K: high bit e / 32 of hmask[e % 32], scales 6-bit (+ 32) */
        const int three = wt == KVC_GGML_Q3_K;
        const uint8_t *qs = b + (three ? 32 : 16), *s = b + 96;
        const float d = f16_at(b + (three ? 108 : 80));
        for (int e = 0; e < 256; e++) {
            const int j = e / 32, l = e % 32;
            q[e] = (qs[32 * (j / 4) + l] >> (2 * (j % 4))) & 3;
            if (three) q[e] += 4 * ((b[l] >> j) & 1) - 4;
        }
        for (int h = 0; h < 16; h++) {
            if (three) {
                const int sc = ((s[h % 8] >> (4 * (h / 8))) & 15) |
                               ((s[8 + h % 4] >> (2 * (h / 4))) & 3) << 4;
                dw[h] = d * (float)(sc - 32);
            } else {
                dw[h] = d * (float)(b[h] & 15);
                mn[h] = b[h] >> 4;
            }
        }
        if (!three) mw[0] = -f16_at(b + 82);
        return;
    }
    case KVC_GGML_IQ4_XS: {
        static const int8_t kv[16] = KVC_GGML_IQ4_NL_VALUES;
        const float d = f16_at(b);
        const int sh = b[2] | b[3] << 8;
        for (int j = 0; j < 8; j++) {
            const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15) | ((sh >> (2 * j)) & 3) << 4;
            dw[j] = d * (float)(ls - 32);
            for (int l = 0; l < 16; l++) {
                q[32 * j + l] = kv[b[8 + 16 * j + l] & 15];
                q[32 * j + 16 + l] = kv[b[8 + 16 * j + l] >> 4];
            }
        }
        return;
    }
    default: break;
    }
    const int five = wt == KVC_GGML_Q5_K;
    const uint8_t *s = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
    const float d = f16_at(b), dmin = f16_at(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        if (j < 4) {
            sc = s[j] & 63;
            m = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        dw[j] = d * (float)sc;
        mw[j] = -(dmin * (float)m);
        for (int l = 0; l < 32; l++) {
            int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
            if (five) v |= ((qh[l] >> j) & 1) << 4;
            q[32 * j + l] = v;
        }
    }
}

static void gemm_kq_scalar(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                           int64_t r1, int64_t nb, const uint8_t *xq, int64_t xq_stride,
                           int64_t n, float *Y, int64_t ldy, int bits) {
    const int64_t bb = kvc__kq_bytes(wt);
    const int halves = wt == KVC_GGML_Q6_K || wt == KVC_GGML_Q3_K || wt == KVC_GGML_Q2_K;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *x = xq + i * xq_stride;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *w = W + r * row_bytes;
            float acc = 0.0f;
            for (int64_t sb = 0; sb < nb / 8; sb++) {
                int32_t q[256], mn[16];
                float dw[16], mw[8];
                kq_unpack(wt, w + sb * bb, q, dw, mw, mn);
                for (int j = 0; j < 8; j++) {
                    int32_t qx[32];
                    float dx, sx;
                    act_block(x, 8 * sb + j, bits, qx, &dx, &sx);
                    const int32_t *qw = q + 32 * j;
                    if (halves) {
                        int32_t i0 = 0, i1 = 0, s0 = 0, s1 = 0;
                        for (int e = 0; e < 16; e++) {
                            i0 += qw[e] * qx[e];
                            i1 += qw[16 + e] * qx[16 + e];
                            s0 += qx[e];
                            s1 += qx[16 + e];
                        }
                        acc = acc + (dw[2 * j] * dx) * (float)i0;
                        acc = acc + (dw[2 * j + 1] * dx) * (float)i1;
                        if (wt == KVC_GGML_Q2_K)
                            acc = acc + (mw[0] * dx) * (float)(mn[2 * j] * s0 + mn[2 * j + 1] * s1);
                    } else {
                        int32_t isum = 0;
                        for (int e = 0; e < 32; e++) isum += qw[e] * qx[e];
                        acc = acc + (dw[j] * dx) * (float)isum;
                        if (wt != KVC_GGML_IQ4_XS) acc = acc + mw[j] * sx;
                    }
                }
            }
            Y[i * ldy + r] = acc;
        }
    }
}

static void gemm_kq8_scalar(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                            int64_t r1, int64_t nb, const uint8_t *xq, int64_t xq_stride,
                            int64_t n, float *Y, int64_t ldy) {
    gemm_kq_scalar(wt, W, row_bytes, r0, r1, nb, xq, xq_stride, n, Y, ldy, 8);
}

static void gemm_kq16_scalar(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                             int64_t r1, int64_t nb, const uint8_t *xq, int64_t xq_stride,
                             int64_t n, float *Y, int64_t ldy) {
    gemm_kq_scalar(wt, W, row_bytes, r0, r1, nb, xq, xq_stride, n, Y, ldy, 16);
}

const kvc__gemm_kernels *kvc__gemm_kernels_scalar(void) {
    static const kvc__gemm_kernels k = {"scalar",        "scalar",        1,
                                        gemm_q8_scalar,  gemm_q16_scalar, gemm_kq8_scalar,
                                        gemm_kq16_scalar, gemm_f_scalar};
    return &k;
}
