/*
 * Suite "gemm": the model runtime's matrix products (src/model/gemm.h) and
 * ggml row dequantization.
 *
 * References written here from the block formats (GGUF/ggml docs, checked
 * against the gguf Python package's gguf.quants.dequantize), in double
 * precision, with no library code:
 *   - ref_dequant: every type's elements from the bytes;
 *   - quantize_ref: the documented activation rule (gemm.h), int16 (Q =
 *     32767, the default) and int8 (Q = 127, kvc__gemm_set_act_bits(8));
 *   - the exact reference of the integer paths: per block the integer dot
 *     product of the weight integers with the quantized activations, times
 *     d_w * d_x (+ m_w * d_x * sum q for Q4_1, Q5_1), summed in double; K-quants:
 *     integers and scales decoded as ggml's dequantize_row_q*_K loops walk
 *     them (kq_ref_ints), per 32-element sub-block d sc d_x isum - dmin m
 *     d_x sum q (Q4_K/Q5_K; IQ4_XS without the min) or per 16-element half
 *     d sc_h d_x isum_h (Q6_K, Q3_K; Q2_K - dmin m_h d_x sum_h q).
 * Checks, every type x every kernel set (scalar, avx2, avx512 with and
 * without VNNI) x activation width {16, 8} (quantized types) x rows {1, 7,
 * 64, 576, 1537} x cols {32, 64, 352, 576, 1536} (1, 2, 11, 18, 48 blocks:
 * every kind of partial group of 8 and 16 blocks; K-quants {256, 512, 768,
 * 1280, 1536}: 1, 2, 3, 5, 6 super-blocks, odd counts ending in half an
 * AVX-512 group) x n {1, 2, 5, 16, 33}:
 *   tight: |Y - exact| <= (2 nb + 8) 2^-24 sum_b |term_b| for the integer
 *     paths (nb block terms, Q4_1, Q5_1 and K-quants twice as many, Q2_K three
 *     times as many with (3 nb + 8); every float32
 *     rounding of a term, float(isum) included (int16: |isum| up to 2^27), and every
 *     addition costs at most 2^-24 of the absolute sum), and |Y - ref| <=
 *     (cols + 4) 2^-24 sum_c |w_c x_c| for float weights;
 *   loose (integer paths): |Y - sum_c w_c x_c| <= tight bound + sum_b (d_x /
 *     2 + 2^-22 amax_b) sum_e |w_be|: q d_x = x (1 + e)^3 + delta d_x with
 *     |delta| <= 1/2 (rounding to an integer) and |e| <= 2^-24 (the float32
 *     roundings of Q / amax, x * id and amax / Q), so each activation moves
 *     by at most d_x / 2 + 3.01 2^-24 amax_b. With d_x = amax_b / Q that is
 *     amax_b (1/254 + 2^-22) per element for int8 and amax_b (1/65534 +
 *     2^-22) for int16: the int16 bound is about 250 times tighter.
 * Plus row independence (bitwise, 1 and 2 threads, both widths), strided
 * X/Y, the activation width switch, K-quant integer sums at their bounds,
 * error cases and dequant_row for every type.
 */
#include <stdlib.h>

#include "model/gemm.h"
#include "test.h"

/* ---- helpers ------------------------------------------------------------------ */

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        abort();
    }
    return p;
}

typedef struct tinfo {
    int32_t t;
    const char *name;
    int64_t block, bytes;
} tinfo;

/* Block sizes written from the ggml docs (independent of gemm.c's table). */
static const tinfo types_all[] = {
    {KVC_GGML_F32, "F32", 1, 4},       {KVC_GGML_F16, "F16", 1, 2},
    {KVC_GGML_BF16, "BF16", 1, 2},     {KVC_GGML_Q8_0, "Q8_0", 32, 34},
    {KVC_GGML_Q4_0, "Q4_0", 32, 18},   {KVC_GGML_Q4_1, "Q4_1", 32, 20},
    {KVC_GGML_Q4_K, "Q4_K", 256, 144}, {KVC_GGML_Q5_K, "Q5_K", 256, 176},
    {KVC_GGML_Q6_K, "Q6_K", 256, 210}, {KVC_GGML_Q5_0, "Q5_0", 32, 22},
    {KVC_GGML_Q5_1, "Q5_1", 32, 24},   {KVC_GGML_IQ4_NL, "IQ4_NL", 32, 18},
    {KVC_GGML_Q2_K, "Q2_K", 256, 84},  {KVC_GGML_Q3_K, "Q3_K", 256, 110},
    {KVC_GGML_IQ4_XS, "IQ4_XS", 256, 136},
};
#define N_GEMM_TYPES 15 /* all of them go through kvc__gemm */

/* IQ4_NL's values (ggml-common.h kvalues_iq4nl; the gguf package's IQ4_NL.kvalues) */
static const int iq4nl_ref[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                  1,    13,   25,  38,  53,  69,  89,  113};
#define N_TYPES (sizeof types_all / sizeof types_all[0])

static int is_quant(int32_t t) { return t != KVC_GGML_F32 && t != KVC_GGML_F16 && t != KVC_GGML_BF16; }
static int is_kq(int32_t t) {
    return t == KVC_GGML_Q2_K || t == KVC_GGML_Q3_K || t == KVC_GGML_Q4_K || t == KVC_GGML_Q5_K ||
           t == KVC_GGML_Q6_K || t == KVC_GGML_IQ4_XS;
}

/* Scales per 16 elements (two integer sums per 32-element sub-block). */
static int kq_halves(int32_t t) {
    return t == KVC_GGML_Q2_K || t == KVC_GGML_Q3_K || t == KVC_GGML_Q6_K;
}

static void put16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static double get_f16(const uint8_t *p) { return (double)kvc_f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

/* Random matrix of rows x cols in type ti: float types uniform in [-1, 1);
 * block types random bytes with float16 fields set to scales of +-[0.002,
 * 0.02] (offsets in [-0.1, 0.1]); Q8_0 includes -128. */
static uint8_t *make_w(const tinfo *ti, int64_t rows, int64_t cols, uint64_t *rng) {
    const int64_t nblk = rows * (cols / ti->block);
    const size_t bytes = (size_t)(nblk * ti->bytes);
    uint8_t *w = xmalloc(bytes);
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)test_rng_next(rng);
    for (int64_t b = 0; b < nblk; b++) {
        uint8_t *p = w + b * ti->bytes;
        const float s = test_rng_f32(rng);
        const float d = (s < 0 ? -1.0f : 1.0f) * (0.002f + 0.018f * fabsf(test_rng_f32(rng)));
        const float m = 0.1f * test_rng_f32(rng);
        switch (ti->t) {
        case KVC_GGML_F32: {
            const float v = test_rng_f32(rng);
            memcpy(p, &v, 4);
            break;
        }
        case KVC_GGML_F16: put16(p, kvc_f32_to_f16(test_rng_f32(rng))); break;
        case KVC_GGML_BF16: put16(p, kvc_f32_to_bf16(test_rng_f32(rng))); break;
        case KVC_GGML_Q8_0:
        case KVC_GGML_Q4_0:
        case KVC_GGML_Q5_0:
        case KVC_GGML_IQ4_NL: put16(p, kvc_f32_to_f16(d)); break;
        case KVC_GGML_Q4_1:
        case KVC_GGML_Q5_1:
        case KVC_GGML_Q4_K:
        case KVC_GGML_Q5_K:
            put16(p, kvc_f32_to_f16(is_kq(ti->t) ? fabsf(d) * 0.05f : d));
            put16(p + 2, kvc_f32_to_f16(is_kq(ti->t) ? fabsf(m) * 0.1f : m));
            break;
        case KVC_GGML_Q6_K: put16(p + 208, kvc_f32_to_f16(d * 0.05f)); break;
        case KVC_GGML_Q3_K: put16(p + 108, kvc_f32_to_f16(d * 0.05f)); break;
        case KVC_GGML_IQ4_XS: put16(p, kvc_f32_to_f16(d * 0.01f)); break;
        case KVC_GGML_Q2_K:
            put16(p + 80, kvc_f32_to_f16(fabsf(d) * 0.1f));
            put16(p + 82, kvc_f32_to_f16(fabsf(m) * 0.1f));
            break;
        default: break;
        }
    }
    return w;
}

/* ---- reference dequantization (from the block formats) ------------------------- */

static void kq_ref_ints(int32_t t, const uint8_t *blk, int q[256], double dw[16], double mw[16]);

/* Integer value of element e of a Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL block: x = d q
 * + m (Q5: bit 4 is bit e of the little-endian qh word before the nibbles;
 * IQ4_NL: the table entry its nibble selects). */
static int qint(int32_t t, const uint8_t *blk, int e) {
    const int nib = e < 16 ? 0x0f : 0xf0, sh = e < 16 ? 0 : 4;
    switch (t) {
    case KVC_GGML_Q8_0: return (int8_t)blk[2 + e];
    case KVC_GGML_Q4_0: return ((blk[2 + e % 16] & nib) >> sh) - 8;
    case KVC_GGML_Q4_1: return (blk[4 + e % 16] & nib) >> sh;
    case KVC_GGML_IQ4_NL: return iq4nl_ref[(blk[2 + e % 16] & nib) >> sh];
    case KVC_GGML_Q5_0:
        return (((blk[6 + e % 16] & nib) >> sh) | ((blk[2 + e / 8] >> (e % 8)) & 1) << 4) - 16;
    default: return ((blk[8 + e % 16] & nib) >> sh) | ((blk[4 + e / 8] >> (e % 8)) & 1) << 4;
    }
}

static void ref_dequant(int32_t t, const uint8_t *row, int64_t cols, double *out) {
    switch (t) {
    case KVC_GGML_F32:
        for (int64_t c = 0; c < cols; c++) {
            float v;
            memcpy(&v, row + 4 * c, 4);
            out[c] = v;
        }
        return;
    case KVC_GGML_F16:
        for (int64_t c = 0; c < cols; c++) out[c] = get_f16(row + 2 * c);
        return;
    case KVC_GGML_BF16:
        for (int64_t c = 0; c < cols; c++) {
            const uint32_t u = (uint32_t)(row[2 * c] | row[2 * c + 1] << 8) << 16;
            float v;
            memcpy(&v, &u, 4);
            out[c] = v;
        }
        return;
    default: break;
    }
    if (t == KVC_GGML_Q8_0 || t == KVC_GGML_Q4_0 || t == KVC_GGML_Q4_1 || t == KVC_GGML_IQ4_NL) {
        const int64_t bb = t == KVC_GGML_Q8_0 ? 34 : t == KVC_GGML_Q4_1 ? 20 : 18;
        for (int64_t b = 0; b < cols / 32; b++) {
            const uint8_t *blk = row + b * bb;
            const double d = get_f16(blk), m = t == KVC_GGML_Q4_1 ? get_f16(blk + 2) : 0.0;
            for (int e = 0; e < 32; e++) out[32 * b + e] = d * qint(t, blk, e) + m;
        }
    } else if (t == KVC_GGML_Q5_0 || t == KVC_GGML_Q5_1) {
        /* d [m] qh[4] qs[16]: low 4 bits as Q4, bit 4 of element e = bit e of qh */
        const int one = t == KVC_GGML_Q5_1;
        for (int64_t b = 0; b < cols / 32; b++) {
            const uint8_t *blk = row + b * (one ? 24 : 22);
            const uint8_t *qh = blk + (one ? 4 : 2), *qs = qh + 4;
            const double d = get_f16(blk), m = one ? get_f16(blk + 2) : 0.0;
            for (int t16 = 0; t16 < 16; t16++) {
                const int h0 = (qh[t16 / 8] >> (t16 % 8)) & 1;
                const int h1 = (qh[(t16 + 16) / 8] >> ((t16 + 16) % 8)) & 1;
                const int q0 = (qs[t16] & 15) | h0 << 4, q1 = (qs[t16] >> 4) | h1 << 4;
                out[32 * b + t16] = one ? d * q0 + m : d * (q0 - 16);
                out[32 * b + t16 + 16] = one ? d * q1 + m : d * (q1 - 16);
            }
        }
    } else if (t == KVC_GGML_Q4_K || t == KVC_GGML_Q5_K) {
        /* d, dmin, 12 bytes of 6-bit scales/mins (bytes 0-3 scales j<4 + top
         * bits of scales j>=4, 4-7 mins likewise, 8-11 low nibble scale /
         * high nibble min of j>=4), [Q5_K: qh[32]], qs[128]: chunk g of 32
         * bytes holds sub-block 2g (low nibbles) and 2g+1 (high nibbles);
         * Q5_K: bit 4 of element l of sub-block j is bit j of qh[l]. */
        const int five = t == KVC_GGML_Q5_K;
        for (int64_t b = 0; b < cols / 256; b++) {
            const uint8_t *blk = row + b * (five ? 176 : 144), *s = blk + 4;
            const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
            const double d = get_f16(blk), dmin = get_f16(blk + 2);
            int sc[8], mn[8];
            for (int j = 0; j < 4; j++) {
                sc[j] = s[j] & 0x3f;
                mn[j] = s[4 + j] & 0x3f;
                sc[4 + j] = (s[8 + j] & 0x0f) | ((s[j] >> 2) & 0x30);
                mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
            }
            for (int g = 0; g < 4; g++)
                for (int h = 0; h < 2; h++)
                    for (int l = 0; l < 32; l++) {
                        const int sub = 2 * g + h;
                        const int q = ((qs[32 * g + l] >> (4 * h)) & 15) |
                                      (five ? ((qh[l] >> sub) & 1) << 4 : 0);
                        out[256 * b + 32 * sub + l] = d * sc[sub] * q - dmin * mn[sub];
                    }
        }
    } else if (t == KVC_GGML_Q2_K || t == KVC_GGML_Q3_K || t == KVC_GGML_IQ4_XS) {
        /* from the integers and factors kq_ref_ints decodes (below): exact */
        const int64_t bb = t == KVC_GGML_Q2_K ? 84 : t == KVC_GGML_Q3_K ? 110 : 136;
        for (int64_t b = 0; b < cols / 256; b++) {
            int q[256];
            double dw[16], mw[16];
            kq_ref_ints(t, row + b * bb, q, dw, mw);
            for (int e = 0; e < 256; e++)
                out[256 * b + e] = t == KVC_GGML_IQ4_XS ? dw[e / 32] * q[e]
                                                        : dw[e / 16] * q[e] + mw[e / 16];
        }
    } else if (t == KVC_GGML_Q6_K) {
        /* ql[128] qh[64] scales[16] d: halves a of 128; in a half, ql byte k
         * (64) gives elements k (low nibble) and 64 + k (high), qh byte l (32)
         * gives bits 4-5 of elements l, 32 + l, 64 + l, 96 + l (2 bits each) */
        for (int64_t b = 0; b < cols / 256; b++) {
            const uint8_t *blk = row + b * 210, *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(const void *)(blk + 192);
            const double d = get_f16(blk + 208);
            int q[256];
            for (int a = 0; a < 2; a++) {
                for (int k = 0; k < 64; k++) {
                    q[128 * a + k] = ql[64 * a + k] & 15;
                    q[128 * a + 64 + k] = ql[64 * a + k] >> 4;
                }
                for (int l = 0; l < 32; l++)
                    for (int s4 = 0; s4 < 4; s4++)
                        q[128 * a + 32 * s4 + l] |= ((qh[32 * a + l] >> (2 * s4)) & 3) << 4;
            }
            for (int e = 0; e < 256; e++) out[256 * b + e] = d * sc[e / 16] * (q[e] - 32);
        }
    }
}

/* Integers and scales of one K-quant super-block, the way ggml's
 * dequantize_row_q*_K loops walk it: Q4_K/Q5_K q[e] (0..15 / 0..31), dw[j]
 * = d sc_j, mw[j] = -dmin m_j per 32 elements; Q6_K q[e] - 32, dw[k] = d
 * scales[k] per 16 elements (mw unused); Q3_K q[e] - 4, dw[k] = d (sc_k -
 * 32) and Q2_K q[e], dw[k] = d sc_k, mw[k] = -dmin m_k per 16 elements;
 * IQ4_XS q[e] the table value, dw[j] = d (ls_j - 32) per 32. Every product is exact in double
 * and in float32 (an 11-bit f16 mantissa times <= 8 bits). */
static void kq_ref_ints(int32_t t, const uint8_t *blk, int q[256], double dw[16], double mw[16]) {
    if (t == KVC_GGML_Q2_K || t == KVC_GGML_Q3_K) {
        /* dequantize_row_q2_K / q3_K: halves n of 128, shifts j of 2 bits,
         * 16 elements per scale (is counts them); Q3_K's high bit m walks the
         * 8 bits of hmask, its 6-bit scales unpacked with ggml's kmask1/kmask2 */
        const int three = t == KVC_GGML_Q3_K;
        const uint8_t *qs = blk + (three ? 32 : 16), *hm = blk;
        const double d = get_f16(blk + (three ? 108 : 80)), dmin = three ? 0 : get_f16(blk + 82);
        int sc[16];
        if (three) {
            uint32_t aux[4];
            memcpy(aux, blk + 96, 12);
            const uint32_t tmp = aux[2], km1 = 0x03030303u, km2 = 0x0f0f0f0fu;
            aux[2] = ((aux[0] >> 4) & km2) | (((tmp >> 4) & km1) << 4);
            aux[3] = ((aux[1] >> 4) & km2) | (((tmp >> 6) & km1) << 4);
            aux[0] = (aux[0] & km2) | (((tmp >> 0) & km1) << 4);
            aux[1] = (aux[1] & km2) | (((tmp >> 2) & km1) << 4);
            for (int k = 0; k < 16; k++) sc[k] = (int8_t)((const uint8_t *)aux)[k] - 32;
        }
        int is = 0, y = 0, m = 1;
        for (int n = 0; n < 256; n += 128, qs += 32)
            for (int shift = 0; shift < 8; shift += 2, m <<= 1)
                for (int h = 0; h < 2; h++, is++) {
                    dw[is] = three ? d * sc[is] : d * (blk[is] & 15);
                    mw[is] = three ? 0.0 : -dmin * (blk[is] >> 4);
                    for (int l = 16 * h; l < 16 * h + 16; l++)
                        q[y++] = ((qs[l] >> shift) & 3) - (three && !(hm[l] & m) ? 4 : 0);
                }
        return;
    }
    if (t == KVC_GGML_IQ4_XS) { /* dequantize_row_iq4_xs: ls 6 bits, d (ls - 32) per 32 */
        const double d = get_f16(blk);
        const int sh = blk[2] | blk[3] << 8;
        for (int ib = 0; ib < 8; ib++) {
            const int ls =
                ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xf) | (((sh >> (2 * ib)) & 3) << 4);
            dw[ib] = d * (ls - 32);
            for (int j = 0; j < 16; j++) {
                q[32 * ib + j] = iq4nl_ref[blk[8 + 16 * ib + j] & 0xf];
                q[32 * ib + j + 16] = iq4nl_ref[blk[8 + 16 * ib + j] >> 4];
            }
        }
        return;
    }
    if (t == KVC_GGML_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const double d = get_f16(blk + 208);
        for (int k = 0; k < 16; k++) dw[k] = d * (int8_t)blk[192 + k];
        for (int n = 0; n < 256; n += 128, ql += 64, qh += 32)
            for (int l = 0; l < 32; l++) {
                q[n + l] = ((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4) - 32;
                q[n + l + 32] = ((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32;
                q[n + l + 64] = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                q[n + l + 96] = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
            }
        return;
    }
    const int five = t == KVC_GGML_Q5_K;
    const uint8_t *sc = blk + 4, *qh = blk + 16, *ql = blk + (five ? 48 : 16);
    const double d = get_f16(blk), dmin = get_f16(blk + 2);
    for (int j = 0; j < 8; j++) { /* ggml's get_scale_min_k4 */
        int s, m;
        if (j < 4) {
            s = sc[j] & 63;
            m = sc[j + 4] & 63;
        } else {
            s = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
            m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        dw[j] = d * s;
        mw[j] = -dmin * m;
    }
    int is = 0;
    for (int j = 0; j < 256; j += 64, ql += 32, is += 2)
        for (int l = 0; l < 32; l++) {
            q[j + l] = (ql[l] & 0xF) + (five && (qh[l] & (1u << is)) ? 16 : 0);
            q[j + l + 32] = (ql[l] >> 4) + (five && (qh[l] & (1u << (is + 1))) ? 16 : 0);
        }
}

/* The documented activation rule (gemm.h): q[32] and d of one block, bits
 * 8 or 16. */
static float quantize_ref(const float *x, int32_t *q, int bits) {
    const float Q = bits == 16 ? 32767.0f : 127.0f;
    float amax = 0;
    for (int e = 0; e < 32; e++) {
        if (!isfinite(x[e])) { /* NaN/Inf: a NaN scale, zero codes */
            memset(q, 0, 32 * sizeof *q);
            return NAN;
        }
        amax = fmaxf(amax, fabsf(x[e]));
    }
    if (amax < 0x1p-120f) {
        memset(q, 0, 32 * sizeof *q);
        return 0.0f;
    }
    const float d = amax / Q, id = Q / amax;
    for (int e = 0; e < 32; e++) {
        q[e] = (int32_t)rint((double)(x[e] * id)); /* float32 product, ties to even */
        if (q[e] > (int32_t)Q || q[e] < -(int32_t)Q) { /* the rule promises |q| <= Q */
            fprintf(stderr, "quantize_ref: |q| > %d\n", (int)Q);
            abort();
        }
    }
    return d;
}

static const int act_bits_g[] = {16, 8}; /* the default first */

/* ---- the grid -------------------------------------------------------------------- */

typedef struct variant {
    kvc_isa isa;
    int no_vnni;
    const char *name;
} variant;

static const variant variants[] = {{KVC_ISA_SCALAR, 0, "scalar"},
                                   {KVC_ISA_AVX2, 0, "avx2"},
                                   {KVC_ISA_AVX512, 0, "avx512"},
                                   {KVC_ISA_AVX512, 1, "avx512 without vnni"},
                                   {KVC_ISA_AMX, 0, "amx (AVX-512 GEMM kernels)"}};
#define N_VARIANTS 5

static int use_variant(const variant *v) {
    if (!test_isa_usable(v->isa)) return 0;
    if (kvc_set_isa(v->isa) != KVC_OK) return 0;
    kvc__gemm_set_no_vnni(v->no_vnni);
    return 1;
}

static void restore_isa(void) {
    kvc__gemm_set_no_vnni(0);
    kvc__gemm_set_act_bits(16);
    kvc_set_isa(kvc_best_isa());
}

static int use_bits(int bits) { return kvc__gemm_set_act_bits(bits) == KVC_OK; }

/* Reference results for n_max rows of X against W: exact (integer paths:
 * with activations quantized to bits-bit integers) and true (float
 * activations), plus bounds. */
typedef struct refs {
    double *exact, *tight, *truth, *loose; /* (n_max, rows) */
} refs;

static void refs_free(refs *r) {
    free(r->exact);
    free(r->tight);
    free(r->truth);
    free(r->loose);
}

static void make_refs(const tinfo *ti, const uint8_t *W, int64_t rows, int64_t cols,
                      const float *X, int64_t ldx, int64_t n, int bits, refs *out) {
    const int64_t rb = cols / ti->block * ti->bytes, nb = cols / 32;
    const size_t sz = (size_t)(n * rows) * sizeof(double);
    out->exact = xmalloc(sz);
    out->tight = xmalloc(sz);
    out->truth = xmalloc(sz);
    out->loose = xmalloc(sz);
    double *wd = xmalloc((size_t)cols * sizeof(double));
    const int quant = is_quant(ti->t);
    int32_t *xq = xmalloc((size_t)(n * cols) * sizeof(int32_t));
    float *dx = xmalloc((size_t)(n * (nb + 1)) * sizeof(float));
    if (quant)
        for (int64_t i = 0; i < n; i++)
            for (int64_t b = 0; b < nb; b++)
                dx[i * nb + b] = quantize_ref(X + i * ldx + 32 * b, xq + i * cols + 32 * b, bits);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *wr = W + r * rb;
        ref_dequant(ti->t, wr, cols, wd);
        for (int64_t i = 0; i < n; i++) {
            const float *x = X + i * ldx;
            double truth = 0, abs_sum = 0;
            for (int64_t c = 0; c < cols; c++) {
                truth += wd[c] * x[c];
                abs_sum += fabs(wd[c] * x[c]);
            }
            const int64_t o = i * rows + r;
            out->truth[o] = truth;
            if (!quant) {
                out->exact[o] = truth;
                out->tight[o] = (double)(cols + 4) * 0x1p-24 * abs_sum + 1e-30;
                out->loose[o] = out->tight[o];
                continue;
            }
            double exact = 0, terms = 0, qerr = 0;
            int kq[256];
            double kdw[16], kmw[16];
            for (int64_t b = 0; b < nb; b++) {
                if (is_kq(ti->t)) { /* per sub-block b % 8 (Q6_K: per half) */
                    const int j = (int)(b % 8);
                    if (j == 0) kq_ref_ints(ti->t, wr + b / 8 * ti->bytes, kq, kdw, kmw);
                    const int32_t *q = xq + i * cols + 32 * b;
                    const double dxb = dx[i * nb + b];
                    long is[2] = {0, 0}, qsum = 0;
                    double wabs = 0, amax = 0;
                    for (int e = 0; e < 32; e++) {
                        is[e / 16] += (long)kq[32 * j + e] * q[e];
                        qsum += q[e];
                        wabs += fabs(wd[32 * b + e]);
                        amax = fmax(amax, fabs((double)x[32 * b + e]));
                    }
                    double t1, t2, t3 = 0;
                    if (kq_halves(ti->t)) {
                        long hs[2] = {0, 0}; /* Q2_K's mins: per half sums of q */
                        for (int e = 0; e < 32; e++) hs[e / 16] += q[e];
                        t1 = kdw[2 * j] * dxb * (double)is[0];
                        t2 = kdw[2 * j + 1] * dxb * (double)is[1];
                        if (ti->t == KVC_GGML_Q2_K)
                            t3 = (kmw[2 * j] * (double)hs[0] + kmw[2 * j + 1] * (double)hs[1]) *
                                 dxb;
                    } else if (ti->t == KVC_GGML_IQ4_XS) {
                        t1 = kdw[j] * dxb * (double)(is[0] + is[1]);
                        t2 = 0;
                    } else {
                        t1 = kdw[j] * dxb * (double)(is[0] + is[1]);
                        t2 = kmw[j] * dxb * (double)qsum;
                    }
                    exact += t1 + t2 + t3; /* Q2_K's integer sum of mins is exact */
                    terms += fabs(t1) + fabs(t2) + fabs(t3);
                    qerr += (dxb / 2 + 0x1p-22 * amax) * wabs;
                    continue;
                }
                const uint8_t *blk = wr + b * ti->bytes;
                const int32_t *q = xq + i * cols + 32 * b;
                const double d = get_f16(blk), dxb = dx[i * nb + b];
                long isum = 0, qsum = 0;
                double wabs = 0, amax = 0;
                for (int e = 0; e < 32; e++) {
                    isum += (long)qint(ti->t, blk, e) * q[e];
                    qsum += q[e];
                    wabs += fabs(wd[32 * b + e]);
                    amax = fmax(amax, fabs((double)x[32 * b + e]));
                }
                const double t1 = d * dxb * (double)isum;
                exact += t1;
                terms += fabs(t1);
                if (ti->t == KVC_GGML_Q4_1 || ti->t == KVC_GGML_Q5_1) {
                    const double t2 = get_f16(blk + 2) * dxb * (double)qsum;
                    exact += t2;
                    terms += fabs(t2);
                }
                qerr += (dxb / 2 + 0x1p-22 * amax) * wabs;
            }
            out->exact[o] = exact;
            /* Q2_K: three terms per block */
            const int per_block = ti->t == KVC_GGML_Q2_K ? 3 : 2;
            out->tight[o] = (double)(per_block * nb + 8) * 0x1p-24 * terms + 1e-30;
            out->loose[o] = out->tight[o] + qerr;
        }
    }
    free(wd);
    free(xq);
    free(dx);
}

/* Compares Y (n rows at ldy) with the references. */
static int check_y(const char *what, const tinfo *ti, const variant *v, int bits, int64_t rows,
                   int64_t cols, int64_t n, const float *Y, int64_t ldy, const refs *rf) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = 0; r < rows; r++) {
            const double y = Y[i * ldy + r];
            const int64_t k = i * rows + r;
            if (!(fabs(y - rf->exact[k]) <= rf->tight[k]) ||
                !(fabs(y - rf->truth[k]) <= rf->loose[k]))
                TEST_FAIL_("%s %s %s act %d rows %lld cols %lld n %lld: Y[%lld][%lld] = %.9g, "
                           "exact %.9g (tol %.3g), true %.9g (tol %.3g)",
                           what, ti->name, v->name, bits, (long long)rows, (long long)cols,
                           (long long)n, (long long)i, (long long)r, y, rf->exact[k],
                           rf->tight[k], rf->truth[k], rf->loose[k]);
        }
    return 0;
}

/* Random activations, row i scaled by 2^(i % 5 - 2); one zero block. */
static float *make_x(int64_t n, int64_t cols, int64_t ldx, uint64_t *rng) {
    float *X = xmalloc((size_t)(n * ldx) * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < ldx; c++)
            X[i * ldx + c] = c < cols ? ldexpf(test_rng_f32(rng), (int)(i % 5) - 2) : NAN;
    if (n > 1 && cols >= 64)
        for (int64_t c = 32; c < 64; c++) X[ldx + c] = 0.0f;
    return X;
}

static int grid_type(const tinfo *ti) {
    static const int64_t rows_g[] = {1, 7, 64, 576, 1537}, n_g[] = {1, 2, 5, 16, 33};
    /* K-quants: 1, 2, 3, 5, 6 super-blocks (odd counts: a half group of 16
     * blocks at the end of an AVX-512 row) */
    static const int64_t cols_b[] = {32, 64, 352, 576, 1536}, cols_k[] = {256, 512, 768, 1280, 1536};
    const int64_t *cols_g = is_kq(ti->t) ? cols_k : cols_b;
    uint64_t rng = test_seed ^ (uint64_t)ti->t * 0x9e3779b97f4a7c15ull;
    const int n_bits = is_quant(ti->t) ? 2 : 1; /* float weights: no activation width */
    int rc = 0;
    for (size_t ci = 0; ci < 5 && !rc; ci++)
        for (size_t ri = 0; ri < 5 && !rc; ri++) {
            const int64_t rows = rows_g[ri], cols = cols_g[ci], nmax = 33;
            uint8_t *W = make_w(ti, rows, cols, &rng);
            float *X = make_x(nmax, cols, cols, &rng);
            float *Y = xmalloc((size_t)(nmax * rows) * sizeof(float));
            for (int bi = 0; bi < n_bits && !rc; bi++) {
                const int bits = act_bits_g[bi];
                refs rf;
                make_refs(ti, W, rows, cols, X, cols, nmax, bits, &rf);
                for (int vi = 0; vi < N_VARIANTS && !rc; vi++) {
                    if (!use_variant(&variants[vi]) || !use_bits(bits)) continue;
                    for (size_t ni = 0; ni < 5 && !rc; ni++) {
                        const int64_t n = n_g[ni];
                        kvc_threadpool *pool = ni % 2 ? test_pool(2) : NULL;
                        memset(Y, 0xff, (size_t)(nmax * rows) * sizeof(float));
                        kvc_status st = kvc__gemm(ti->t, W, rows, cols, X, cols, n, Y, rows, pool);
                        if (st != KVC_OK) {
                            fprintf(stderr, "  %s: %s\n", kvc_status_str(st), kvc_last_error());
                            rc = 1;
                            break;
                        }
                        rc = check_y("grid", ti, &variants[vi], bits, rows, cols, n, Y, rows, &rf);
                    }
                }
                restore_isa();
                refs_free(&rf);
            }
            free(W);
            free(X);
            free(Y);
        }
    return rc;
}

TEST(grid_f32) { return grid_type(&types_all[0]); }
TEST(grid_f16) { return grid_type(&types_all[1]); }
TEST(grid_bf16) { return grid_type(&types_all[2]); }
TEST(grid_q8_0) { return grid_type(&types_all[3]); }
TEST(grid_q4_0) { return grid_type(&types_all[4]); }
TEST(grid_q4_1) { return grid_type(&types_all[5]); }
TEST(grid_q4_k) { return grid_type(&types_all[6]); }
TEST(grid_q5_k) { return grid_type(&types_all[7]); }
TEST(grid_q6_k) { return grid_type(&types_all[8]); }
TEST(grid_q5_0) { return grid_type(&types_all[9]); }
TEST(grid_q5_1) { return grid_type(&types_all[10]); }
TEST(grid_iq4_nl) { return grid_type(&types_all[11]); }
TEST(grid_q2_k) { return grid_type(&types_all[12]); }
TEST(grid_q3_k) { return grid_type(&types_all[13]); }
TEST(grid_iq4_xs) { return grid_type(&types_all[14]); }

/* Float weights accept any cols: tails of every length below 16. */
TEST(float_odd_cols) {
    static const int64_t cols_g[] = {1, 7, 15, 17, 100, 579};
    uint64_t rng = test_seed + 7;
    int rc = 0;
    for (int ti = 0; ti < 3 && !rc; ti++)
        for (size_t ci = 0; ci < 6 && !rc; ci++) {
            const int64_t rows = 13, cols = cols_g[ci], n = 6;
            uint8_t *W = make_w(&types_all[ti], rows, cols, &rng);
            float *X = make_x(n, cols, cols, &rng), *Y = xmalloc((size_t)(n * rows) * 4);
            refs rf;
            make_refs(&types_all[ti], W, rows, cols, X, cols, n, 16, &rf);
            for (int vi = 0; vi < N_VARIANTS && !rc; vi++) {
                if (!use_variant(&variants[vi])) continue;
                if (kvc__gemm(types_all[ti].t, W, rows, cols, X, cols, n, Y, rows, NULL) != KVC_OK)
                    rc = 1;
                else
                    rc = check_y("odd cols", &types_all[ti], &variants[vi], 0, rows, cols, n, Y,
                                 rows, &rf);
            }
            restore_isa();
            refs_free(&rf);
            free(W);
            free(X);
            free(Y);
        }
    return rc;
}

/* ---- row independence ------------------------------------------------------------- */

/* Row i of an n = 33 product equals the n = 1 product of row i, bit for bit,
 * with 1 and 2 threads, for every type, kernel set and activation width; and
 * so does n = 5. */
TEST(row_independence) {
    static const int64_t cols_b[] = {576, 1536, 96}, cols_k[] = {768, 1536, 256};
    uint64_t rng = test_seed + 11;
    int rc = 0;
    for (int ti = 0; ti < N_GEMM_TYPES && !rc; ti++)
        for (int ci = 0; ci < 3 && !rc; ci++) {
            const tinfo *t = &types_all[ti];
            const int64_t rows = 100, cols = (is_kq(t->t) ? cols_k : cols_b)[ci], n = 33;
            uint8_t *W = make_w(t, rows, cols, &rng);
            float *X = make_x(n, cols, cols, &rng);
            float *Yn = xmalloc((size_t)(n * rows) * 4), *Y1 = xmalloc((size_t)rows * 4),
                  *Y5 = xmalloc((size_t)(5 * rows) * 4);
            for (int vb = 0; vb < N_VARIANTS * 2 && !rc; vb++) {
                const int vi = vb / 2, bits = act_bits_g[vb % 2];
                if (!use_variant(&variants[vi]) || !use_bits(bits)) continue;
                if (!is_quant(t->t) && bits != 16) continue;
                for (int th = 1; th <= 2 && !rc; th++) {
                    kvc_threadpool *pool = test_pool(th);
                    if (kvc__gemm(t->t, W, rows, cols, X, cols, n, Yn, rows, pool) != KVC_OK) {
                        rc = 1;
                        break;
                    }
                    for (int64_t i = 0; i < n && !rc; i++) {
                        if (kvc__gemm(t->t, W, rows, cols, X + i * cols, cols, 1, Y1, rows,
                                      pool) != KVC_OK ||
                            memcmp(Y1, Yn + i * rows, (size_t)rows * 4) != 0) {
                            fprintf(stderr,
                                    "  %s %s act %d cols %lld threads %d: row %lld differs\n",
                                    t->name, variants[vi].name, bits, (long long)cols, th,
                                    (long long)i);
                            rc = 1;
                        }
                    }
                    for (int64_t i0 = 0; i0 + 5 <= n && !rc; i0 += 7)
                        if (kvc__gemm(t->t, W, rows, cols, X + i0 * cols, cols, 5, Y5, rows,
                                      test_pool(3 - th)) != KVC_OK ||
                            memcmp(Y5, Yn + i0 * rows, (size_t)(5 * rows) * 4) != 0) {
                            fprintf(stderr, "  %s %s act %d: n = 5 from row %lld differs\n",
                                    t->name, variants[vi].name, bits, (long long)i0);
                            rc = 1;
                        }
                }
            }
            restore_isa();
            free(W);
            free(X);
            free(Yn);
            free(Y1);
            free(Y5);
        }
    return rc;
}

/* ---- strides -------------------------------------------------------------------- */

/* ldx > cols (the gap holds NaN: never read) and ldy > rows (the gap keeps
 * its contents). */
TEST(strided) {
    uint64_t rng = test_seed + 13;
    int rc = 0;
    for (int ti = 0; ti < N_GEMM_TYPES && !rc; ti++) {
        const tinfo *t = &types_all[ti];
        const int64_t rows = 37, cols = is_kq(t->t) ? 768 : 576, n = 9, ldx = cols + 40,
                      ldy = rows + 5;
        uint8_t *W = make_w(t, rows, cols, &rng);
        float *X = make_x(n, cols, ldx, &rng), *Y = xmalloc((size_t)(n * ldy) * 4);
        refs rf[2];
        for (int bi = 0; bi < 2; bi++)
            make_refs(t, W, rows, cols, X, ldx, n, act_bits_g[bi], &rf[bi]);
        for (int vb = 0; vb < N_VARIANTS * 2 && !rc; vb++) {
            const int vi = vb / 2, bits = act_bits_g[vb % 2];
            if (!use_variant(&variants[vi]) || !use_bits(bits)) continue;
            for (int64_t k = 0; k < n * ldy; k++) Y[k] = -12345.0f;
            if (kvc__gemm(t->t, W, rows, cols, X, ldx, n, Y, ldy, test_pool(2)) != KVC_OK) {
                rc = 1;
                break;
            }
            rc = check_y("strided", t, &variants[vi], bits, rows, cols, n, Y, ldy, &rf[vb % 2]);
            for (int64_t i = 0; i < n && !rc; i++)
                for (int64_t r = rows; r < ldy; r++)
                    if (Y[i * ldy + r] != -12345.0f) {
                        fprintf(stderr, "  %s: Y gap overwritten at [%lld][%lld]\n", t->name,
                                (long long)i, (long long)r);
                        rc = 1;
                    }
        }
        restore_isa();
        refs_free(&rf[0]);
        refs_free(&rf[1]);
        free(W);
        free(X);
        free(Y);
    }
    return rc;
}

/* ---- errors -------------------------------------------------------------------- */

TEST(errors) {
    float X[256] = {0}, Y[4] = {1, 2, 3, 4};
    uint8_t W[4 * 40] = {0};
    ASSERT_STATUS(kvc__gemm(KVC_GGML_Q8_K, W, 1, 256, X, 256, 1, Y, 1, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "not supported");
    ASSERT_STATUS(kvc__gemm(KVC_GGML_Q6_K, W, 1, 32, X, 32, 1, Y, 1, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "multiple");
    ASSERT_STATUS(kvc__gemm(99, W, 1, 32, X, 32, 1, Y, 1, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc__gemm(KVC_GGML_Q4_1, W, 1, 48, X, 48, 1, Y, 1, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "multiple");
    ASSERT_STATUS(kvc__gemm(KVC_GGML_Q4_1, W, -1, 32, X, 32, 1, Y, 1, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc__gemm(KVC_GGML_F32, W, 1, 8, X, 8, -2, Y, 1, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc__gemm(KVC_GGML_Q8_0, W, 2, 32, X, 31, 1, Y, 2, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "ldx");
    ASSERT_STATUS(kvc__gemm(KVC_GGML_Q8_0, W, 2, 32, X, 32, 2, Y, 1, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc__gemm(KVC_GGML_Q8_0, NULL, 2, 32, X, 32, 1, Y, 2, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "NULL W");
    ASSERT_STATUS(kvc__gemm(KVC_GGML_Q8_0, W, 2, 32, NULL, 32, 1, Y, 2, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc__gemm(KVC_GGML_Q8_0, W, 2, 32, X, 32, 1, NULL, 2, NULL), KVC_ERR_INVALID_ARG);
    for (int i = 0; i < 4; i++) ASSERT_TRUE(Y[i] == (float)(i + 1)); /* untouched on error */
    /* nothing to do: NULL pointers are fine */
    ASSERT_OK(kvc__gemm(KVC_GGML_Q8_0, NULL, 2, 32, NULL, 32, 0, NULL, 2, NULL));
    ASSERT_OK(kvc__gemm(KVC_GGML_Q8_0, NULL, 0, 32, NULL, 32, 3, NULL, 0, NULL));
    /* cols == 0: the empty sum */
    ASSERT_OK(kvc__gemm(KVC_GGML_Q4_0, W, 3, 0, X, 0, 1, Y, 3, NULL));
    ASSERT_TRUE(Y[0] == 0.0f && Y[1] == 0.0f && Y[2] == 0.0f && Y[3] == 4.0f);
    /* supported set and row sizes */
    for (size_t i = 0; i < N_TYPES; i++) {
        ASSERT_EQ_I64(kvc__gemm_supported(types_all[i].t), i < N_GEMM_TYPES);
        ASSERT_EQ_I64(kvc__ggml_row_bytes(types_all[i].t, 512),
                      512 / types_all[i].block * types_all[i].bytes);
    }
    ASSERT_EQ_I64(kvc__gemm_supported(KVC_GGML_Q8_K), 0);
    ASSERT_EQ_I64(kvc__gemm_supported(21), 0); /* IQ3_S */
    ASSERT_EQ_I64(kvc__ggml_row_bytes(KVC_GGML_Q5_K, 128), 0);
    ASSERT_EQ_I64(kvc__ggml_row_bytes(KVC_GGML_Q4_1, 33), 0);
    ASSERT_EQ_I64(kvc__ggml_row_bytes(KVC_GGML_Q8_K, 256), 0);
    ASSERT_EQ_I64(kvc__ggml_row_bytes(KVC_GGML_F16, 7), 14);
    return 0;
}

/* ---- dequant_row ------------------------------------------------------------------ */

TEST(dequant_row) {
    uint64_t rng = test_seed + 17;
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const tinfo *t = &types_all[ti];
        const int64_t n = t->block == 256 ? 1024 : t->block == 32 ? 1536 : 37;
        uint8_t *w = make_w(t, 1, n, &rng);
        double *ref = xmalloc((size_t)n * sizeof(double));
        float *out = xmalloc((size_t)n * sizeof(float));
        ref_dequant(t->t, w, n, ref);
        ASSERT_OK(kvc__ggml_dequant_row(t->t, w, n, out));
        for (int64_t e = 0; e < n; e++) {
            /* float32 evaluation: exact for F32/F16/BF16/Q8_0/Q4_0, one or two
             * roundings (offsets, Q6_K's three-factor product) otherwise */
            const double tol = 0x1p-22 * (fabs(ref[e]) + 0.2);
            if (!(fabs((double)out[e] - ref[e]) <= (is_quant(t->t) ? tol : 0.0))) {
                fprintf(stderr, "  %s element %lld: %.9g vs %.9g\n", t->name, (long long)e,
                        (double)out[e], ref[e]);
                free(w);
                free(ref);
                free(out);
                return 1;
            }
        }
        if (t->block > 1) {
            ASSERT_STATUS(kvc__ggml_dequant_row(t->t, w, n - 1, out), KVC_ERR_INVALID_ARG);
            ASSERT_STR_CONTAINS(kvc_last_error(), t->name);
        }
        free(w);
        free(ref);
        free(out);
    }
    float o[32];
    ASSERT_STATUS(kvc__ggml_dequant_row(KVC_GGML_Q8_K, o, 256, o), KVC_ERR_UNSUPPORTED);
    ASSERT_STATUS(kvc__ggml_dequant_row(99, o, 32, o), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc__ggml_dequant_row(KVC_GGML_Q8_0, NULL, 32, o), KVC_ERR_INVALID_ARG);
    ASSERT_OK(kvc__ggml_dequant_row(KVC_GGML_Q8_0, NULL, 0, NULL));
    return 0;
}

/* Exact activation quantization rule on hand-made blocks, both widths: ties
 * round to even (x * id = 63.5 -> 64 for int8, 16383.5 -> 16384 for int16),
 * an all-zero block and a tiny block give zero, -amax maps to -Q. */
TEST(quantize_rule) {
    /* W = Q8_0 with d = 1 and q = e_k (one-hot): Y = d_x * q_x[k] (exact). */
    uint8_t W[32 * 34];
    memset(W, 0, sizeof W);
    for (int k = 0; k < 32; k++) {
        put16(W + 34 * k, kvc_f32_to_f16(1.0f));
        W[34 * k + 2 + k] = 1;
    }
    float X[5][32], Y[5][32];
    for (int e = 0; e < 32; e++) {
        X[0][e] = (float)(e - 16) * 0.5f; /* amax 8 (element 0): q = rne(x * 127 / 8) */
        X[1][e] = 0.0f;
        X[2][e] = 1e-38f * (float)(e + 1); /* amax < 2^-120 */
        X[3][e] = X[4][e] = 1.0f;
    }
    X[3][5] = NAN; /* one non-finite element: every product of the block NaN */
    X[4][9] = -INFINITY;
    int rc = 0;
    for (int vb = 0; vb < N_VARIANTS * 2 && !rc; vb++) {
        const int vi = vb / 2, bits = act_bits_g[vb % 2];
        if (!use_variant(&variants[vi]) || !use_bits(bits)) continue;
        if (kvc__gemm(KVC_GGML_Q8_0, W, 32, 32, &X[0][0], 32, 5, &Y[0][0], 32, NULL) != KVC_OK) {
            rc = 1;
            break;
        }
        const float Q = bits == 16 ? 32767.0f : 127.0f, d = 8.0f / Q, id = Q / 8.0f;
        for (int e = 0; e < 32 && !rc; e++) {
            const float q = (float)rint((double)(X[0][e] * id)), want = d * q;
            /* the tie of e = 24 and -Q at e = 0, written out */
            const float q_hand = e == 24 ? (bits == 16 ? 16384.0f : 64.0f) : e == 0 ? -Q : q;
            if (Y[0][e] != want || q != q_hand || Y[1][e] != 0.0f || Y[2][e] != 0.0f ||
                !isnan(Y[3][e]) || !isnan(Y[4][e])) {
                fprintf(stderr, "  %s act %d element %d: %.9g (want %.9g), %g, %g\n",
                        variants[vi].name, bits, e, (double)Y[0][e], (double)want,
                        (double)Y[1][e], (double)Y[2][e]);
                rc = 1;
            }
        }
    }
    restore_isa();
    return rc;
}

/* The activation width switch: 16 by default, 8 and 16 accepted, anything
 * else refused (and the width kept); the two widths give different results
 * on a Q4_1 product, and int16 is the closer one to the float product. */
TEST(act_bits) {
    ASSERT_EQ_I64(kvc__gemm_act_bits(), 16);
    ASSERT_STATUS(kvc__gemm_set_act_bits(12), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc__gemm_set_act_bits(0), KVC_ERR_INVALID_ARG);
    ASSERT_EQ_I64(kvc__gemm_act_bits(), 16);
    ASSERT_OK(kvc__gemm_set_act_bits(8));
    ASSERT_EQ_I64(kvc__gemm_act_bits(), 8);
    ASSERT_STATUS(kvc__gemm_set_act_bits(32), KVC_ERR_INVALID_ARG);
    ASSERT_EQ_I64(kvc__gemm_act_bits(), 8);
    ASSERT_OK(kvc__gemm_set_act_bits(16));
    uint64_t rng = test_seed + 19;
    const tinfo *t = &types_all[5]; /* Q4_1 */
    const int64_t rows = 64, cols = 1536, n = 3;
    uint8_t *W = make_w(t, rows, cols, &rng);
    float *X = make_x(n, cols, cols, &rng), *Y[2];
    refs rf;
    make_refs(t, W, rows, cols, X, cols, n, 16, &rf); /* truth is the same for both */
    double err[2] = {0, 0};
    for (int bi = 0; bi < 2; bi++) {
        Y[bi] = xmalloc((size_t)(n * rows) * 4);
        ASSERT_OK(kvc__gemm_set_act_bits(act_bits_g[bi]));
        ASSERT_OK(kvc__gemm(t->t, W, rows, cols, X, cols, n, Y[bi], rows, NULL));
        for (int64_t k = 0; k < n * rows; k++) err[bi] += fabs(Y[bi][k] - rf.truth[k]);
    }
    ASSERT_OK(kvc__gemm_set_act_bits(16));
    printf("  Q4_1 %lldx%lld, mean |Y - float product|: int16 %.3g, int8 %.3g\n",
           (long long)rows, (long long)cols, err[0] / (double)(n * rows),
           err[1] / (double)(n * rows));
    const int differ = memcmp(Y[0], Y[1], (size_t)(n * rows) * 4) != 0;
    refs_free(&rf);
    free(W);
    free(X);
    free(Y[0]);
    free(Y[1]);
    ASSERT_TRUE(differ);
    ASSERT_TRUE(err[0] * 10 < err[1]); /* expected ~250x; 10x is a safe margin */
    return 0;
}

/* Integer sums at their bounds, every kernel set and width: Q5_K with q =
 * 31 and sc = 63 everywhere against activations at +-Q (|isum| = 32 * 31 *
 * 32767 > 2^24: float(isum) rounds), Q6_K with q - 32 = -32 and scale -128
 * (a half sums to 16 * 32 * 32767; with the scales folded in a block would
 * pass 2^31), Q4_K likewise; Q5_0 / Q5_1 with every code 31 (Q5_0: 15) or,
 * every other block, 0 (Q5_0: -16; int8 activations: the AVX2 pair sums of
 * 31 * 127 added in int16 at their largest); IQ4_NL likewise (nibble 15:
 * 113, nibble 0: -127, the AVX2 sign trick's pair sums at 2 * 127 * 127);
 * Q2_K with q = 3 and sc = m = 15 (its sum of mins at 32 * 15 * 32767);
 * Q3_K with q - 4 = -4 and scale -32 or q = 3 and scale 31; IQ4_XS with -127
 * and scale -32 or 113 and 31 (|isum| = 32 * 127 * 32767 > 2^27; int8: the
 * table + 128 at 241); each against the exact reference. */
TEST(kq_extremes) {
    const int64_t rows = 3, cols = 768, n = 2;
    int rc = 0;
    for (int ti = 6; ti <= 14 && !rc; ti++) {
        const tinfo *t = &types_all[ti];
        const int64_t nsb = rows * cols / t->block;
        uint8_t *W = xmalloc((size_t)(nsb * t->bytes));
        for (int64_t b = 0; b < nsb; b++) {
            uint8_t *p = W + b * t->bytes;
            if (t->t == KVC_GGML_Q2_K) { /* q = 3, sc = m = 15 */
                memset(p, 0xff, 80);
                put16(p + 80, kvc_f32_to_f16(1e-3f));
                put16(p + 82, kvc_f32_to_f16(b % 3 ? 5e-4f : 0.0f));
            } else if (t->t == KVC_GGML_Q3_K) { /* q - 4 = -4 with scale -32, or 3 with 31 */
                memset(p, b % 2 ? 0x00 : 0xff, 108);
                put16(p + 108, kvc_f32_to_f16(b % 3 ? 1e-3f : -1e-3f));
            } else if (t->t == KVC_GGML_IQ4_XS) { /* values -127 with scale -32, or 113 with 31 */
                memset(p, b % 2 ? 0x00 : 0xff, 136);
                put16(p, kvc_f32_to_f16(b % 3 ? 1e-3f : -1e-3f));
            } else if (t->t == KVC_GGML_Q6_K) {
                memset(p, 0, 192);                    /* q = 0: q - 32 = -32 */
                memset(p + 192, 0x80, 16);            /* scales -128 */
                put16(p + 208, kvc_f32_to_f16(b % 2 ? 1e-3f : -1e-3f));
            } else if (t->block == 32) { /* Q5_0 / Q5_1 / IQ4_NL */
                memset(p, b % 2 ? 0x00 : 0xff, (size_t)t->bytes);
                put16(p, kvc_f32_to_f16(b % 3 ? 1e-3f : -1e-3f));
                if (t->t == KVC_GGML_Q5_1) put16(p + 2, kvc_f32_to_f16(b % 3 ? 5e-4f : 0.0f));
            } else {
                memset(p, 0xff, (size_t)t->bytes); /* q = 15 / 31, sc = m = 63 */
                put16(p, kvc_f32_to_f16(1e-3f));
                put16(p + 2, kvc_f32_to_f16(b % 3 ? 5e-4f : 0.0f));
            }
        }
        float *X = xmalloc((size_t)(n * cols) * sizeof(float)), *Y = xmalloc((size_t)(n * rows) * 4);
        for (int64_t c = 0; c < cols; c++) {
            X[c] = 3.0f; /* every integer at +Q */
            X[cols + c] = c % 64 < 32 ? -2.0f : 2.0f;
        }
        for (int bi = 0; bi < 2 && !rc; bi++) {
            refs rf;
            make_refs(t, W, rows, cols, X, cols, n, act_bits_g[bi], &rf);
            for (int vi = 0; vi < N_VARIANTS && !rc; vi++) {
                if (!use_variant(&variants[vi]) || !use_bits(act_bits_g[bi])) continue;
                if (kvc__gemm(t->t, W, rows, cols, X, cols, n, Y, rows, NULL) != KVC_OK)
                    rc = 1;
                else
                    rc = check_y("extremes", t, &variants[vi], act_bits_g[bi], rows, cols, n, Y,
                                 rows, &rf);
            }
            restore_isa();
            refs_free(&rf);
        }
        free(W);
        free(X);
        free(Y);
    }
    return rc;
}

/* The kernel set names follow the ISA cap; without VNNI, the AVX2 integer
 * kernels. */
TEST(kernel_names) {
    int rc = 0;
    for (int vi = 0; vi < N_VARIANTS && !rc; vi++) {
        if (!use_variant(&variants[vi])) continue;
        const char *q = kvc__gemm_kernel_name(KVC_GGML_Q4_1), *f = kvc__gemm_kernel_name(KVC_GGML_F16);
        printf("  %s: integer %s, float %s\n", variants[vi].name, q, f);
        if (variants[vi].isa == KVC_ISA_SCALAR) rc = strcmp(q, "scalar") || strcmp(f, "scalar");
        if (variants[vi].isa == KVC_ISA_AVX2) rc = strcmp(q, "avx2") || strcmp(f, "avx2");
        if (variants[vi].isa >= KVC_ISA_AVX512)
            rc = strcmp(f, "avx512") || (variants[vi].no_vnni && strcmp(q, "avx2"));
    }
    restore_isa();
    return rc;
}

const char *test_suite_name = "gemm";
const test_case test_suite[] = {
    TEST_ENTRY(errors),           TEST_ENTRY(dequant_row),  TEST_ENTRY(quantize_rule),
    TEST_ENTRY(act_bits),         TEST_ENTRY(kernel_names), TEST_ENTRY(float_odd_cols),
    TEST_ENTRY(strided),          TEST_ENTRY(row_independence), TEST_ENTRY(grid_f32),
    TEST_ENTRY(grid_f16),         TEST_ENTRY(grid_bf16),    TEST_ENTRY(grid_q8_0),
    TEST_ENTRY(grid_q4_0),        TEST_ENTRY(grid_q4_1),    TEST_ENTRY(grid_q4_k),
    TEST_ENTRY(grid_q5_k),        TEST_ENTRY(grid_q6_k),    TEST_ENTRY(grid_q5_0),
    TEST_ENTRY(grid_q5_1),        TEST_ENTRY(grid_iq4_nl),  TEST_ENTRY(grid_q2_k),
    TEST_ENTRY(grid_q3_k),        TEST_ENTRY(grid_iq4_xs),  TEST_ENTRY(kq_extremes),
    {0, 0}};
