/*
 * ggml block formats to float32 (gguf.h: kvc_ggml_dequantize): embedding
 * lookups, norm vectors and tests. Every value is computed with the float32
 * operations of ggml's reference dequantization, in its order (d * sc
 * first, then times q, then minus dmin * m), so the result is bitwise what
 * ggml and the gguf Python package give. This file is compiled for the
 * baseline ISA: no FMA instruction exists there to contract a * b - c into.
 */
#include <string.h>

#include "../core/internal.h"
#include "kvcache/gguf.h"

static float f16_at(const uint8_t *p) { return kvc_f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

/* Q4_0 / Q4_1 / Q5_0 / Q5_1 nibble e of a 32-element block: element e < 16
 * is the low nibble of byte e, element e >= 16 the high nibble of byte
 * e - 16; Q5 adds bit e of the little-endian uint32 qh as bit 4. */
static int nib(const uint8_t *qs, int e) { return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4; }

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Q4_K / Q5_K scale and min j of 8 (6 bits each, packed in 12 bytes): j < 4
 * in the low 6 bits of bytes j (scale) and j + 4 (min); j >= 4 in the
 * nibbles of byte j + 4 (scale low, min high) with their top 2 bits in bits
 * 6..7 of bytes j - 4 (scale) and j (min). */
static void kq_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q3_K's 16 6-bit scales (stored + 32) from 12 bytes, as ggml unpacks them:
 * low nibble from byte j % 8 (its high nibble for j >= 8), bits 4..5 from
 * the 2-bit pair j / 4 of byte 8 + j % 4. */
static void q3k_scales(const uint8_t *s, int sc[16]) {
    for (int j = 0; j < 16; j++)
        sc[j] = (((s[j % 8] >> (4 * (j / 8))) & 15) | ((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) -
                32;
}

/* IQ4_XS's 6-bit scale of sub-block j (0..7), minus 32: nibble j % 2 of
 * scales_l[j / 2], bits 2 j, 2 j + 1 of scales_h as bits 4, 5. */
static int iq4xs_scale(const uint8_t *b, int j) {
    const int hi = ((b[2] | b[3] << 8) >> (2 * j)) & 3;
    return (((b[4 + j / 2] >> (4 * (j % 2))) & 15) | hi << 4) - 32;
}

static void dequant_block(int32_t t, const uint8_t *b, float *y) {
    switch (t) {
    case KVC_GGML_Q8_0: { /* f16 d, int8 q[32]: x = d q */
        const float d = f16_at(b);
        for (int e = 0; e < 32; e++) y[e] = d * (float)(int8_t)b[2 + e];
        break;
    }
    case KVC_GGML_Q4_0: { /* f16 d, qs[16]: x = d (q - 8) */
        const float d = f16_at(b);
        for (int e = 0; e < 32; e++) y[e] = d * (float)(nib(b + 2, e) - 8);
        break;
    }
    case KVC_GGML_Q4_1: { /* f16 d, f16 m, qs[16]: x = d q + m */
        const float d = f16_at(b), m = f16_at(b + 2);
        for (int e = 0; e < 32; e++) y[e] = d * (float)nib(b + 4, e) + m;
        break;
    }
    case KVC_GGML_Q5_0: { /* f16 d, qh[4], qs[16]: x = d (q - 16) */
        const float d = f16_at(b);
        const uint32_t qh = le32(b + 2);
        for (int e = 0; e < 32; e++)
            y[e] = d * (float)((nib(b + 6, e) | (int)((qh >> e) & 1) << 4) - 16);
        break;
    }
    case KVC_GGML_Q5_1: { /* f16 d, f16 m, qh[4], qs[16]: x = d q + m */
        const float d = f16_at(b), m = f16_at(b + 2);
        const uint32_t qh = le32(b + 4);
        for (int e = 0; e < 32; e++)
            y[e] = d * (float)(nib(b + 8, e) | (int)((qh >> e) & 1) << 4) + m;
        break;
    }
    case KVC_GGML_IQ4_NL: { /* f16 d, qs[16]: x = d kvalues[q] */
        static const int8_t kv[16] = KVC_GGML_IQ4_NL_VALUES;
        const float d = f16_at(b);
        for (int e = 0; e < 32; e++) y[e] = d * (float)kv[nib(b + 2, e)];
        break;
    }
    case KVC_GGML_Q4_K:   /* f16 d, f16 dmin, scales[12], qs[128] */
    case KVC_GGML_Q5_K: { /* f16 d, f16 dmin, scales[12], qh[32], qs[128] */
        /* 8 sub-blocks j of 32: x = (d sc_j) q - (dmin m_j); element l of
         * sub-block j: nibble j % 2 (1: high) of qs[32 (j / 2) + l], Q5_K adds
         * bit j of qh[l] as bit 4 */
        const int five = t == KVC_GGML_Q5_K;
        const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
        const float d = f16_at(b), dmin = f16_at(b + 2);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            kq_scale_min(b + 4, j, &sc, &mn);
            const float dj = d * (float)sc, mj = dmin * (float)mn;
            for (int l = 0; l < 32; l++) {
                int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
                if (five) q |= ((qh[l] >> j) & 1) << 4;
                y[32 * j + l] = dj * (float)q - mj;
            }
        }
        break;
    }
    case KVC_GGML_Q6_K: { /* ql[128], qh[64], int8 scales[16], f16 d: x = (d sc[e / 16]) (q - 32);
                           * element e = 128 h + r: low 4 bits from ql[64 h + r % 64]
                           * (high nibble when r >= 64), high 2 bits from
                           * qh[32 h + r % 32] >> (2 (r / 32)) */
        const float d = f16_at(b + 208);
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, r = e % 128;
            const int lo = (b[64 * h + r % 64] >> (4 * (r / 64))) & 15;
            const int hi = (b[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
            y[e] = d * (float)(int8_t)b[192 + e / 16] * (float)((lo | hi << 4) - 32);
        }
        break;
    }
    case KVC_GGML_Q2_K: { /* scales[16], qs[64], f16 d, f16 dmin: x = (d sc) q - dmin m
                           * per 16 elements (sc, m: low, high nibble of scales[e / 16]) */
        const float d = f16_at(b + 80), dmin = f16_at(b + 82);
        for (int e = 0; e < 256; e++) {
            const int q = (b[16 + 32 * (e / 128) + e % 32] >> (2 * (e % 128 / 32))) & 3;
            const uint8_t sc = b[e / 16];
            y[e] = d * (float)(sc & 15) * (float)q - dmin * (float)(sc >> 4);
        }
        break;
    }
    case KVC_GGML_Q3_K: { /* hmask[32], qs[64], scales[12], f16 d: x = (d (sc - 32)) (q - 4) */
        const float d = f16_at(b + 108);
        int sc[16];
        q3k_scales(b + 96, sc);
        for (int e = 0; e < 256; e++) {
            const int l = e % 32, j = e / 32; /* j = 4 n + shift / 2 */
            const int q = ((b[32 + 32 * (j / 4) + l] >> (2 * (j % 4))) & 3) - 4 +
                          4 * ((b[l] >> j) & 1);
            y[e] = d * (float)sc[e / 16] * (float)q;
        }
        break;
    }
    case KVC_GGML_IQ4_XS: { /* f16 d, u16 scales_h, scales_l[4], qs[128]:
                             * x = (d (ls - 32)) kvalues[q] per 32 */
        static const int8_t kv[16] = KVC_GGML_IQ4_NL_VALUES;
        const float d = f16_at(b);
        for (int j = 0; j < 8; j++) {
            const float dl = d * (float)iq4xs_scale(b, j);
            for (int e = 0; e < 32; e++) y[32 * j + e] = dl * (float)kv[nib(b + 8 + 16 * j, e)];
        }
        break;
    }
    default: break;
    }
}

static int decodable(int32_t t) {
    switch (t) {
    case KVC_GGML_F32:
    case KVC_GGML_F16:
    case KVC_GGML_BF16:
    case KVC_GGML_Q8_0:
    case KVC_GGML_Q4_0:
    case KVC_GGML_Q4_1:
    case KVC_GGML_Q5_0:
    case KVC_GGML_Q5_1:
    case KVC_GGML_IQ4_NL:
    case KVC_GGML_IQ4_XS:
    case KVC_GGML_Q2_K:
    case KVC_GGML_Q3_K:
    case KVC_GGML_Q4_K:
    case KVC_GGML_Q5_K:
    case KVC_GGML_Q6_K: return 1;
    default: return 0;
    }
}

kvc_status kvc_ggml_dequantize(int32_t type, const void *src, int64_t n, float *dst) {
    const char *name = kvc_ggml_type_name(type);
    KVC_CHECK(name != NULL, "kvc_ggml_dequantize: unknown ggml type %d", (int)type);
    if (!decodable(type))
        return kvc__error(KVC_ERR_UNSUPPORTED, "kvc_ggml_dequantize: type %s is not supported",
                          name);
    const int64_t bs = kvc_ggml_block_size(type), bb = kvc_ggml_block_bytes(type);
    KVC_CHECK(n >= 0 && n % bs == 0,
              "kvc_ggml_dequantize: %lld elements is not a whole number of %s blocks (%lld)",
              (long long)n, name, (long long)bs);
    KVC_CHECK(n == 0 || (src != NULL && dst != NULL), "kvc_ggml_dequantize: NULL pointer");
    const uint8_t *s = src;
    switch (type) {
    case KVC_GGML_F32: memcpy(dst, src, (size_t)n * 4); break;
    case KVC_GGML_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = f16_at(s + 2 * i);
        break;
    case KVC_GGML_BF16:
        for (int64_t i = 0; i < n; i++)
            dst[i] = kvc_bf16_to_f32((uint16_t)(s[2 * i] | s[2 * i + 1] << 8));
        break;
    default:
        for (int64_t b = 0; b < n / bs; b++) dequant_block(type, s + b * bb, dst + b * bs);
        break;
    }
    return KVC_OK;
}
