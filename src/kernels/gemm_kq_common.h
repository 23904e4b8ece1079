/*
 * Scale decoding and type properties shared by the K-quant kernels
 * (gemm_kq_avx2.c, gemm_kq_avx512.c; formulas in gemm_kernels.h). SSE
 * intrinsics only, so each including file compiles them for its own ISA.
 */
#ifndef KVC_GEMM_KQ_COMMON_H
#define KVC_GEMM_KQ_COMMON_H

#include <immintrin.h>
#include <string.h>

#include "gemm_kernels.h"

#define KQ_AI static inline __attribute__((always_inline))

/* Types whose scales cover 16 elements (two sums per sub-block), and the
 * offset their codes carry (q = u - off, u unsigned). */
KQ_AI int kq_halves(int32_t wt) {
    return wt == KVC_GGML_Q6_K || wt == KVC_GGML_Q3_K || wt == KVC_GGML_Q2_K;
}
KQ_AI int kq_code_off(int32_t wt) {
    return wt == KVC_GGML_Q6_K ? 32 : wt == KVC_GGML_Q3_K ? 4 : 0;
}

/* Scales and mins of a Q4_K/Q5_K super-block as bytes sc[0..7] | m[0..7]. */
KQ_AI __m128i kq_scales(const uint8_t *s) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t sc_lo = u[0] & 0x3f3f3f3fu, m_lo = u[1] & 0x3f3f3f3fu;
    const uint32_t sc_hi = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 6) & 0x03030303u) << 4;
    const uint32_t m_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 6) & 0x03030303u) << 4;
    return _mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)m_lo, (int)m_hi);
}

/* Q3_K's 16 scales minus 32 as int8 (ggml's unpacking of the 12 bytes). */
KQ_AI __m128i q3k_scales(const uint8_t *s) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t a0 = (u[0] & 0x0f0f0f0fu) | (u[2] & 0x03030303u) << 4;
    const uint32_t a1 = (u[1] & 0x0f0f0f0fu) | ((u[2] >> 2) & 0x03030303u) << 4;
    const uint32_t a2 = ((u[0] >> 4) & 0x0f0f0f0fu) | ((u[2] >> 4) & 0x03030303u) << 4;
    const uint32_t a3 = ((u[1] >> 4) & 0x0f0f0f0fu) | ((u[2] >> 6) & 0x03030303u) << 4;
    return _mm_sub_epi8(_mm_setr_epi32((int)a0, (int)a1, (int)a2, (int)a3), _mm_set1_epi8(32));
}

/* IQ4_XS's 8 scales of a super-block, minus 32, as int8 in the low 8 bytes:
 * sub-block j's nibble j % 2 of scales_l[j / 2] | bits 2 j, 2 j + 1 of
 * scales_h << 4. */
KQ_AI __m128i iq4xs_scales(const uint8_t *b) {
    const unsigned sh = (unsigned)(b[2] | b[3] << 8);
    uint64_t v = 0;
    for (int j = 0; j < 8; j++) {
        const unsigned ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 15u) | ((sh >> (2 * j)) & 3u) << 4;
        v |= (uint64_t)(uint8_t)(ls - 32) << (8 * j);
    }
    return _mm_cvtsi64_si128((long long)v);
}

#endif
