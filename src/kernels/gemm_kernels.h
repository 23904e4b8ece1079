/*
 * Kernels of kvc__gemm (src/model/gemm.c), one table per ISA: scalar
 * reference (gemm_scalar.c), AVX2 (gemm_avx2.c, K-quants gemm_kq_avx2.c),
 * AVX-512 with VNNI (gemm_avx512.c, gemm_kq_avx512.c). Only gemm.c calls them, after the CPU check.
 *
 * Three paths:
 *
 *   float weights (F32, F16, BF16): Y[i][r] = sum_c X[i][c] * W[r][c] with
 *   float32 products and sums (each ISA its own, fixed, order).
 *
 *   quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL): every activation row is first
 *   quantized per 32-element block to int16 (the default) or int8
 *   (kvc__gemm_quantize_x below), then per weight block b of row r
 *       isum_b = sum_{e<32} qw[e] * qx[e]           (exact, int32)
 *       Y[i][r] += (dw_b * dx_b) * float(isum_b)  [+ mw_b * sx_b for Q4_1, Q5_1]
 *   with qw the block's integer weights (Q8_0: int8, Q4_0: nibble - 8,
 *   Q4_1: nibble, Q5_0: nibble + 16 qh bit - 16, Q5_1: nibble + 16 qh bit,
 *   IQ4_NL: KVC_GGML_IQ4_NL_VALUES[nibble]),
 *   dw/mw its float16 scale/offset, dx_b, sx_b = dx_b * sum(qx) of the
 *   activation block; float accumulation in an ISA-fixed order. int16:
 *   |isum| <= 32 * 128 * 32767 < 2^28 (no overflow; float(isum) may round,
 *   the same way on every ISA); int8: |isum| < 2^20 (exact).
 *
 *   K-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_XS: the same
 *   activations (cols is a multiple of 256, so a super-block is 8 activation
 *   blocks); per 32-element sub-block b of a super-block with f16 d (and
 *   dmin), float32 products of the dequantization's own factors:
 *     Q4_K, Q5_K: q unsigned (0..15, 0..31), sc_b / m_b the 6-bit scale /
 *       min, dw_b = d * sc_b, mw_b = -(dmin * m_b) (x = dw_b q + mw_b):
 *         isum_b = sum_{e<32} q[e] * qx[e]
 *         Y[i][r] += (dw_b * dx_b) * float(isum_b) + mw_b * sx_b
 *     IQ4_XS: q = KVC_GGML_IQ4_NL_VALUES[nibble] (signed), dw_b = d * (ls_b
 *       - 32): Y[i][r] += (dw_b * dx_b) * float(isum_b)
 *     Q6_K, Q3_K: q signed (Q6_K: 0..63 - 32; Q3_K: 2 low bits | high bit
 *       << 2, minus 4), one scale per 16 elements: per half h (elements
 *       16 h .. 16 h + 15) dw_bh = d * sc_{2b+h} (Q3_K: sc - 32):
 *         isum_bh = sum_{e<16} q[16 h + e] * qx[16 h + e]
 *         Y[i][r] += (dw_b0 * dx_b) * float(isum_b0) + (dw_b1 * dx_b) * float(isum_b1)
 *     Q2_K: q unsigned 0..3, per half dw_bh = d * sc_{2b+h} and a 4-bit min
 *       m_{2b+h}; the mins go through one integer sum per sub-block:
 *         msum_b = sum_h m_{2b+h} * sum_{e<16} qx[16 h + e]
 *         Y[i][r] += (dw_b0 * dx_b) * float(isum_b0) + (dw_b1 * dx_b) * float(isum_b1)
 *                    + (-dmin * dx_b) * float(msum_b)
 *   int16: |isum| <= 32 * 31 * 32767 < 2^25 (Q5_K) and 32 * 127 * 32767 <
 *   2^28 (IQ4_XS) (float(isum) may round, the same way on every ISA), <
 *   2^24 for Q4_K, each half of Q6_K / Q3_K / Q2_K and Q2_K's msum (exact);
 *   int8: exact. (A Q6_K block sum with the int8 scales folded in would
 *   reach 2^32 with int16 activations: hence the two halves.)

 * Row independence: a kernel computes each Y[i][r] with one fixed sequence
 * of operations that depends only on (X row i, W row r, cols, type, ISA,
 * activation bits), whatever the tile that row lands in, so Y[i] does not
 * depend on n, the other rows, or how gemm.c splits rows over tasks.
 */
#ifndef KVC_GEMM_KERNELS_H
#define KVC_GEMM_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache/gguf.h"

/* ---- quantized activations ------------------------------------------------
 *
 * One activation row of cols = 32 * nb floats becomes ceil(nb / (4 L))
 * groups of G = 4 L blocks (L = lanes: 1 scalar, 2 AVX2, 4 AVX-512; blocks
 * past nb are zero). A group is laid out the way the SIMD kernels consume it:
 * block b of the group sits in "register" j = b / L, 128-bit lane k = b % L.
 *
 * int8 (bits = 8), 192 L bytes:
 *   int8 q[4][2][L][16]   q[j][0][k] = elements 0..15 of block L j + k,
 *                         q[j][1][k] = elements 16..31 (the Q4 nibble halves)
 * int16 (bits = 16), 320 L bytes:
 *   int16 q[4][4][L][8]   q[j][s][k] = part s of block L j + k, 8 elements:
 *                         s = 0: 0, 2, .., 14    s = 1: 1, 3, .., 15
 *                         s = 2: 16, 18, .., 30  s = 3: 17, 19, .., 31
 *                         (the order in which the kernels widen weights with
 *                         16-bit shifts: even / odd bytes, low / high nibbles)
 *                         L = 1 instead: natural order, element e of block b
 *                         at q + 32 b + e (int16 units)
 * then, both:
 *   float dx[G]           scale of block b(p) at position p (below)
 *   int32 qsum[G]         sum of the block's 32 integer values
 *   float sx[G]           dx * qsum (float32 product), Q4_1's offset term
 *   int32 qsum0[G]        sum of the block's first 16 integer values (the
 *                         halves of Q2_K's mins and of the code offsets of
 *                         Q6_K, Q3_K: half 1 sums to qsum - qsum0)
 *
 * Positions p = 4 k + j hold block b(p) = L (p % 4) + p / 4: that is the
 * order in which the kernels' 4-register reduction delivers block sums. For
 * L = 1 this is the natural order (int8: element e of block b at q + 32 b +
 * e).
 *
 * Quantization of one block x[0..31], Q = 127 (int8) or 32767 (int16) (the
 * documented rule; the test suite has an independent copy):
 *   amax = max |x[e]|
 *   amax < 2^-120 (zero included): d = 0, q[e] = 0
 *   else: d = amax / Q, id = Q / amax (float32 divisions),
 *         q[e] = round_half_even(x[e] * id) (float32 product; |q| <= Q)
 *   any x[e] NaN or +-Inf: d = NaN, q[e] = 0 (the block's products are NaN,
 *   as in float arithmetic, instead of integers converted from NaN)
 */
#define KVC_GEMM_QK 32 /* elements per block, every quantized type */

/* Bytes of the integer values of one group (the scales follow them). */
static inline int64_t kvc__gemm_group_qbytes(int L, int bits) {
    return (int64_t)L * (bits == 16 ? 256 : 128);
}

/* Bytes of one group for lane count L: the integers, then dx, qsum, sx,
 * qsum0. */
static inline int64_t kvc__gemm_group_bytes(int L, int bits) {
    return kvc__gemm_group_qbytes(L, bits) + (int64_t)L * 64;
}

/* Bytes of one quantized activation row (multiple of 64 for L = 4). */
static inline int64_t kvc__gemm_xq_row_bytes(int64_t cols, int L, int bits) {
    const int64_t nb = cols / KVC_GEMM_QK, g = 4 * (int64_t)L;
    return (nb + g - 1) / g * kvc__gemm_group_bytes(L, bits);
}

/* Quantizes one row x[0..cols) to bits (8 or 16) bit integers into xq
 * (kvc__gemm_xq_row_bytes(cols, L, bits) bytes) in the layout above. Plain
 * C, identical for every ISA. */
void kvc__gemm_quantize_x(const float *x, int64_t cols, int L, int bits, void *xq);

/* ---- kernels --------------------------------------------------------------- */

/* Quantized weights (wt in Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL; the kq kernels
 * Q2_K/Q3_K/Q4_K/Q5_K/Q6_K/IQ4_XS): rows [r0, r1) of W (row r at
 * W + r * row_bytes), cols = 32 nb, activation rows i < n at xq + i *
 * xq_stride bytes (layout above, the table's lanes); Y[i][r] at Y + i * ldy
 * + r. */
typedef void (*kvc__gemm_q_fn)(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                               int64_t r1, int64_t nb, const uint8_t *xq, int64_t xq_stride,
                               int64_t n, float *Y, int64_t ldy);

typedef struct kvc__gemm_kernels {
    const char *name_q, *name_f; /* of the integer and the float kernels */
    int lanes; /* L of the activation layout the int kernels read */
    kvc__gemm_q_fn gemm_q8;  /* int8 activations */
    kvc__gemm_q_fn gemm_q16; /* int16 activations */
    kvc__gemm_q_fn gemm_kq8;  /* K-quant, IQ4_XS weights (nb a multiple of 8), int8 activations */
    kvc__gemm_q_fn gemm_kq16; /* and int16 activations */
    /* Float weights (wt in F32/F16/BF16): X row i at X + i * ldx. */
    void (*gemm_f)(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
                   int64_t cols, const float *X, int64_t ldx, int64_t n, float *Y, int64_t ldy);
} kvc__gemm_kernels;

/* K-quant kernels of the SIMD tables (gemm_kq_avx2.c, gemm_kq_avx512.c). */
/* Bytes of one super-block of a kq type. */
static inline int64_t kvc__kq_bytes(int32_t wt) {
    switch (wt) {
    case KVC_GGML_Q2_K: return 84;
    case KVC_GGML_Q3_K: return 110;
    case KVC_GGML_Q4_K: return 144;
    case KVC_GGML_Q5_K: return 176;
    case KVC_GGML_IQ4_XS: return 136;
    default: return 210; /* Q6_K */
    }
}

void kvc__gemm_kq8_avx2(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0, int64_t r1,
                        int64_t nb, const uint8_t *xq, int64_t xs, int64_t n, float *Y,
                        int64_t ldy);
void kvc__gemm_kq16_avx2(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                         int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n,
                         float *Y, int64_t ldy);
void kvc__gemm_kq8_avx512(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                          int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n,
                          float *Y, int64_t ldy);
void kvc__gemm_kq16_avx512(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                           int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n,
                           float *Y, int64_t ldy);

const kvc__gemm_kernels *kvc__gemm_kernels_scalar(void);
const kvc__gemm_kernels *kvc__gemm_kernels_avx2(void);
/* AVX-512 F/BW/VL/DQ float kernels and AVX-512 VNNI int kernels: only call
 * gemm_q8 / gemm_q16 of this table after checking VNNI (gemm.c does). */
const kvc__gemm_kernels *kvc__gemm_kernels_avx512(void);

#endif
