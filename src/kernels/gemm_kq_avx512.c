/*
 * AVX-512 VNNI kernels of kvc__gemm for K-quant weights (Q2_K, Q3_K, Q4_K,
 * Q5_K, Q6_K) and IQ4_XS (formulas in gemm_kernels.h). Compiled with -mavx512vnni; gemm.c calls
 * them only when the CPU has AVX512_VNNI (the AVX2 K-quant kernels run
 * otherwise).
 *
 * One activation group (16 blocks, L = 4 lanes) is two weight super-blocks
 * (the last group of a row may hold one: cols is a multiple of 256, not of
 * 512): register j (0..3) lane k (0..3) = block 4 j + k, i.e. super-block
 * j / 2, sub-block s = 4 (j % 2) + k. Each register is unpacked into bytes,
 * lo = elements 0..15 and hi = elements 16..31 of each lane's sub-block:
 *   Q4_K: sub-blocks s, s + 1 (k = 0, 1 and 2, 3) share 32 bytes of qs
 *     (low / high nibbles): two broadcast 16-byte loads, lanes 1 and 3
 *     shifted by 4 (masked vpsrlw), masked; Q5_K adds 16 where bit s of
 *     qh[l] is set (vptestmb + masked add);
 *   Q6_K: lane k takes ql[64 (j % 2) + 32 (k % 2) + l] (nibble k / 2) and
 *     bits 2 k of qh[32 (j % 2) + l] (vpsrlvd), q = 0..63;
 *   Q2_K, Q3_K: lane k takes bits 2 k of qs[32 (j % 2) + l] (vpsrlvd); Q3_K
 *     adds 4 where bit s of hmask[l] is set (vptestmb + masked add): 0..7;
 *   IQ4_XS: the 64 bytes of sub-blocks 4 (j % 2) .. + 3 in one load, each
 *     nibble through a vpshufb table (int8 activations: the values + 128).
 * Scales: as gemm_kq_avx2.c, 16 blocks at once: the two super-blocks'
 * bytes side by side, one vpshufb into the position order of the block sums
 * (block 4 (p % 4) + p / 4 at position p), times d of the position's
 * super-block.
 * Products as gemm_avx512.c: int16 activations vpdpwssd on the bytes
 * widened to int16 (Q6_K, Q3_K: q - 32, q - 4 sign-extended); int8
 * activations vpdpbusd (u8 q x s8 x); Q6_K / Q3_K then subtract 32 / 4
 * times each half's activation sum (qsum0, qsum - qsum0 of the activation
 * layout), IQ4_XS 128 qsum per block. Q6_K, Q3_K, Q2_K keep their two
 * halves apart (two reduce4); Q2_K's mins meet the same half sums: m0 qsum0
 * + m1 (qsum - qsum0) in float (exact: an integer below 2^24). The others
 * sum lo and hi in one chain.
 */
#include <immintrin.h>
#include <string.h>

#include "gemm_kq_common.h"

#define AI static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 4")

#define L 4 /* 128-bit lanes per register */

typedef struct kgroup {
    __m512i v[4][4]; /* int8: v[j][0] lo, v[j][1] hi bytes; int16: v[j][s] part s */
    __m512 dw, mw;   /* position order; halves types: scales of half 0 and half 1 */
    __m512 m0, m1, dm; /* Q2_K: mins of half 0 and half 1 (position order), -dmin */
} kgroup;

#define kq_bytes kvc__kq_bytes

#define halves kq_halves
#define code_off kq_code_off

AI __m128i ld16(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)(const void *)p); }

AI float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* [a, a, b, b] as 128-bit lanes. */
AI __m512i aabb(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_broadcastsi128_si256(ld16(a))),
                              _mm256_broadcastsi128_si256(ld16(b)), 1);
}

/* Lane k of the result holds 32-bit value a_k in all four words. */
AI __m512i rep4(int a0, int a1, int a2, int a3) {
    return _mm512_setr_epi32(a0, a0, a0, a0, a1, a1, a1, a1, a2, a2, a2, a2, a3, a3, a3, a3);
}

/* The 16 bytes at p in every lane, lane k shifted right by cnt's k (per
 * 32-bit word), masked. */
AI __m512i bits_at(const uint8_t *p, __m512i cnt, __m512i mask) {
    return _mm512_and_si512(_mm512_srlv_epi32(_mm512_broadcast_i32x4(ld16(p)), cnt), mask);
}




AI __m512 bytes_ps(__m128i b, int sign) {
    return _mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

/* Unpacks the nsb (1 or 2) super-blocks at w for bits-wide activations. */
AI void load_kgroup(const int32_t wt, const int bits, const uint8_t *w, int nsb, kgroup *g) {
    const int64_t bb = kq_bytes(wt);
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i lo[4], hi[4];
    float d[2] = {0.0f, 0.0f}, dmin[2] = {0.0f, 0.0f};
    UNROLL
    for (int j = 0; j < 4; j++) {
        const uint8_t *sbp = w + (j / 2) * bb;
        const int jj = j % 2;
        if (j / 2 >= nsb) {
            lo[j] = hi[j] = _mm512_setzero_si512();
            continue;
        }
        if (wt == KVC_GGML_Q2_K || wt == KVC_GGML_Q3_K) {
            /* sub-block s = 4 jj + k: 2 bits (qs[32 jj + l] >> 2 k) & 3; Q3_K:
             * bit s of hmask[l] as bit 2 */
            const uint8_t *qs = sbp + (wt == KVC_GGML_Q3_K ? 32 : 16) + 32 * jj;
            const __m512i cnt = rep4(0, 2, 4, 6);
            const __m512i m3 = _mm512_set1_epi8(3);
            lo[j] = bits_at(qs, cnt, m3);
            hi[j] = bits_at(qs + 16, cnt, m3);
            if (wt == KVC_GGML_Q3_K) { /* bit 4 jj + k of hmask[l] -> +4 (vptestmb + masked add) */
                const unsigned b0 = 0x01010101u << (4 * jj);
                const __m512i bit = rep4((int)b0, (int)(b0 << 1), (int)(b0 << 2), (int)(b0 << 3));
                const __m512i c4 = _mm512_set1_epi8(4);
                const __mmask64 ka = _mm512_test_epi8_mask(_mm512_broadcast_i32x4(ld16(sbp)), bit);
                const __mmask64 kb =
                    _mm512_test_epi8_mask(_mm512_broadcast_i32x4(ld16(sbp + 16)), bit);
                lo[j] = _mm512_mask_add_epi8(lo[j], ka, lo[j], c4);
                hi[j] = _mm512_mask_add_epi8(hi[j], kb, hi[j], c4);
            }
        } else if (wt == KVC_GGML_IQ4_XS) {
            /* sub-block s = 4 jj + k: 16 bytes at 8 + 16 s (64 in a row), low
             * nibbles elements 0..15, high 16..31; int8 activations take the
             * table + 128 (unsigned for vpdpbusd; 128 qsum comes off after) */
            const __m512i tbl = bits == 8 ? _mm512_broadcast_i32x4(_mm_setr_epi8(
                                                1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141,
                                                (char)153, (char)166, (char)181, (char)197, (char)217,
                                                (char)241))
                                          : _mm512_broadcast_i32x4(_mm_setr_epi8(
                                                -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25,
                                                38, 53, 69, 89, 113));
            const __m512i v = _mm512_loadu_si512((const void *)(sbp + 8 + 64 * jj));
            lo[j] = _mm512_shuffle_epi8(tbl, _mm512_and_si512(v, m4));
            hi[j] = _mm512_shuffle_epi8(tbl, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
        } else if (wt == KVC_GGML_Q6_K) {
            const uint8_t *ql = sbp + 64 * jj, *qh = sbp + 128 + 32 * jj;
            const __m512i a = _mm512_broadcast_i64x4(
                _mm256_inserti128_si256(_mm256_castsi128_si256(ld16(ql)), ld16(ql + 32), 1));
            const __m512i b = _mm512_broadcast_i64x4(
                _mm256_inserti128_si256(_mm256_castsi128_si256(ld16(ql + 16)), ld16(ql + 48), 1));
            const __mmask32 up = 0xFFFF0000u; /* lanes 2, 3: high nibbles */
            const __m512i cnt = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
            const __m512i m3 = _mm512_set1_epi8(3);
            const __m512i ha =
                _mm512_and_si512(_mm512_srlv_epi32(_mm512_broadcast_i32x4(ld16(qh)), cnt), m3);
            const __m512i hb = _mm512_and_si512(
                _mm512_srlv_epi32(_mm512_broadcast_i32x4(ld16(qh + 16)), cnt), m3);
            lo[j] = _mm512_or_si512(_mm512_and_si512(_mm512_mask_srli_epi16(a, up, a, 4), m4),
                                    _mm512_slli_epi16(ha, 4));
            hi[j] = _mm512_or_si512(_mm512_and_si512(_mm512_mask_srli_epi16(b, up, b, 4), m4),
                                    _mm512_slli_epi16(hb, 4));
        } else {
            const int five = wt == KVC_GGML_Q5_K;
            const uint8_t *qs = sbp + (five ? 48 : 16) + 64 * jj;
            const __mmask32 odd = 0xFF00FF00u; /* lanes 1, 3: high nibbles */
            const __m512i a = aabb(qs, qs + 32), b = aabb(qs + 16, qs + 48);
            lo[j] = _mm512_and_si512(_mm512_mask_srli_epi16(a, odd, a, 4), m4);
            hi[j] = _mm512_and_si512(_mm512_mask_srli_epi16(b, odd, b, 4), m4);
            if (five) { /* bit 4 jj + k of qh[l] -> +16 */
                const unsigned long long b0 = 0x0101010101010101ull << (4 * jj);
                const __m512i bit = _mm512_setr_epi64(
                    (long long)b0, (long long)b0, (long long)(b0 << 1), (long long)(b0 << 1),
                    (long long)(b0 << 2), (long long)(b0 << 2), (long long)(b0 << 3),
                    (long long)(b0 << 3));
                const __m512i m16 = _mm512_set1_epi8(16);
                const __mmask64 ka = _mm512_test_epi8_mask(_mm512_broadcast_i32x4(ld16(sbp + 16)), bit);
                const __mmask64 kb = _mm512_test_epi8_mask(_mm512_broadcast_i32x4(ld16(sbp + 32)), bit);
                lo[j] = _mm512_mask_add_epi8(lo[j], ka, lo[j], m16);
                hi[j] = _mm512_mask_add_epi8(hi[j], kb, hi[j], m16);
            }
        }
    }
    /* position p holds block 4 (p % 4) + p / 4: super-block 1 where p % 4 >= 2 */
    const __mmask16 sb1 = 0xCCCC;
    if (halves(wt)) {
        const int six = wt == KVC_GGML_Q6_K, three = wt == KVC_GGML_Q3_K;
        const int doff = six ? 208 : three ? 108 : 80;
        const __m128i k15 = _mm_set1_epi8(15);
        __m128i sc[2] = {_mm_setzero_si128(), _mm_setzero_si128()};
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = w + s * bb;
            d[s] = f16_at(b + doff);
            sc[s] = six ? ld16(b + 192) : three ? q3k_scales(b + 96) : _mm_and_si128(ld16(b), k15);
        }
        const __m128i s0 = sc[0], s1 = sc[1];
        /* half h of block 4 j + k: scale 8 (j % 2) + 2 k + h of super-block j / 2 */
        const __m128i i0 = _mm_setr_epi8(0, 8, 0, 8, 2, 10, 2, 10, 4, 12, 4, 12, 6, 14, 6, 14);
        const __m128i i1 = _mm_add_epi8(i0, _mm_set1_epi8(1));
        const __m128i h0 = _mm_mask_blend_epi8(sb1, _mm_shuffle_epi8(s0, i0), _mm_shuffle_epi8(s1, i0));
        const __m128i h1 = _mm_mask_blend_epi8(sb1, _mm_shuffle_epi8(s0, i1), _mm_shuffle_epi8(s1, i1));
        const __m512 dv = _mm512_mask_blend_ps(sb1, _mm512_set1_ps(d[0]), _mm512_set1_ps(d[1]));
        g->dw = _mm512_mul_ps(dv, bytes_ps(h0, wt != KVC_GGML_Q2_K));
        g->mw = _mm512_mul_ps(dv, bytes_ps(h1, wt != KVC_GGML_Q2_K));
        if (wt == KVC_GGML_Q2_K) { /* the mins (high nibbles) the same way */
            __m128i mn[2] = {_mm_setzero_si128(), _mm_setzero_si128()};
            for (int s = 0; s < nsb; s++) {
                dmin[s] = -f16_at(w + s * bb + 82);
                mn[s] = _mm_and_si128(_mm_srli_epi16(ld16(w + s * bb), 4), k15);
            }
            g->dm = _mm512_mask_blend_ps(sb1, _mm512_set1_ps(dmin[0]), _mm512_set1_ps(dmin[1]));
            g->m0 = bytes_ps(_mm_mask_blend_epi8(sb1, _mm_shuffle_epi8(mn[0], i0),
                                                 _mm_shuffle_epi8(mn[1], i0)), 0);
            g->m1 = bytes_ps(_mm_mask_blend_epi8(sb1, _mm_shuffle_epi8(mn[0], i1),
                                                 _mm_shuffle_epi8(mn[1], i1)), 0);
        }
    } else if (wt == KVC_GGML_IQ4_XS) {
        for (int s = 0; s < nsb; s++) d[s] = f16_at(w + s * bb);
        const __m128i c0 = iq4xs_scales(w);
        const __m128i c1 = nsb > 1 ? iq4xs_scales(w + bb) : _mm_setzero_si128();
        const __m128i perm = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __m512 dv = _mm512_mask_blend_ps(sb1, _mm512_set1_ps(d[0]), _mm512_set1_ps(d[1]));
        g->dw = _mm512_mul_ps(dv, bytes_ps(_mm_shuffle_epi8(_mm_unpacklo_epi64(c0, c1), perm), 1));
        g->mw = _mm512_setzero_ps();
    } else {
        for (int s = 0; s < nsb; s++) {
            d[s] = f16_at(w + s * bb);
            dmin[s] = f16_at(w + s * bb + 2);
        }
        const __m128i c0 = kq_scales(w + 4), c1 = nsb > 1 ? kq_scales(w + bb + 4) : _mm_setzero_si128();
        const __m128i perm = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __m128i sc = _mm_shuffle_epi8(_mm_unpacklo_epi64(c0, c1), perm);
        const __m128i mn = _mm_shuffle_epi8(_mm_unpackhi_epi64(c0, c1), perm);
        const __m512 dv = _mm512_mask_blend_ps(sb1, _mm512_set1_ps(d[0]), _mm512_set1_ps(d[1]));
        const __m512 mv = _mm512_mask_blend_ps(sb1, _mm512_set1_ps(dmin[0]), _mm512_set1_ps(dmin[1]));
        g->dw = _mm512_mul_ps(dv, bytes_ps(sc, 0));
        g->mw = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_mul_ps(mv, bytes_ps(mn, 0))), _mm512_set1_epi32(INT32_MIN)));
    }
    UNROLL
    for (int j = 0; j < 4; j++) {
        if (bits == 8) {
            g->v[j][0] = lo[j];
            g->v[j][1] = hi[j];
        } else if (halves(wt) || wt == KVC_GGML_IQ4_XS) {
            /* q - off, sign-extended even / odd bytes */
            const __m512i c = _mm512_set1_epi8((char)code_off(wt));
            const __m512i a = _mm512_sub_epi8(lo[j], c), b = _mm512_sub_epi8(hi[j], c);
            g->v[j][0] = _mm512_srai_epi16(_mm512_slli_epi16(a, 8), 8);
            g->v[j][1] = _mm512_srai_epi16(a, 8);
            g->v[j][2] = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 8);
            g->v[j][3] = _mm512_srai_epi16(b, 8);
        } else {
            const __m512i mff = _mm512_set1_epi16(0xff);
            g->v[j][0] = _mm512_and_si512(lo[j], mff);
            g->v[j][1] = _mm512_srli_epi16(lo[j], 8);
            g->v[j][2] = _mm512_and_si512(hi[j], mff);
            g->v[j][3] = _mm512_srli_epi16(hi[j], 8);
        }
    }
}

AI __m512i reduce4(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

/* One activation row's group xg against the unpacked super-blocks (nz = 2
 * registers for one super-block, 4 for two). */
AI __m512 row_kgroup(const int32_t wt, const int bits, const kgroup *g, int nz,
                     const uint8_t *xg, __m512 acc) {
    const int64_t qbytes = (bits == 16 ? 256 : 128) * L;
    const __m512i z = _mm512_setzero_si512();
    const int two = halves(wt), q2k = wt == KVC_GGML_Q2_K;
    __m512i a[4], b[4]; /* halves: half 0 / half 1; else a only */
#define XL(r) _mm512_loadu_si512((const void *)(xg + (r) * 16 * L))
    UNROLL
    for (int j = 0; j < 4; j++) {
        if (j >= nz) {
            a[j] = b[j] = z;
            continue;
        }
        if (bits == 16) {
            const __m512i x0 = XL(4 * j), x1 = XL(4 * j + 1);
            const __m512i x2 = XL(4 * j + 2), x3 = XL(4 * j + 3);
            const __m512i p0 =
                _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(z, g->v[j][0], x0), g->v[j][1], x1);
            if (two) {
                a[j] = p0;
                b[j] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(z, g->v[j][2], x2), g->v[j][3], x3);
            } else {
                a[j] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(p0, g->v[j][2], x2), g->v[j][3], x3);
            }
        } else if (two) {
            a[j] = _mm512_dpbusd_epi32(z, g->v[j][0], XL(2 * j));
            b[j] = _mm512_dpbusd_epi32(z, g->v[j][1], XL(2 * j + 1));
        } else {
            a[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, g->v[j][0], XL(2 * j)), g->v[j][1],
                                       XL(2 * j + 1));
        }
    }
#undef XL
    const __m512 dx = _mm512_loadu_ps((const void *)(xg + qbytes));
    /* the activation sums: of the block (qsum) and of its first half (qsum0) */
    const __m512i qs = _mm512_loadu_si512((const void *)(xg + qbytes + 16 * L));
    const __m512i qs0 = _mm512_loadu_si512((const void *)(xg + qbytes + 48 * L));
    __m512i i0 = reduce4(a[0], a[1], a[2], a[3]);
    if (bits == 8 && wt == KVC_GGML_IQ4_XS) /* the table's + 128 */
        i0 = _mm512_sub_epi32(i0, _mm512_slli_epi32(qs, 7));
    if (two) {
        __m512i i1 = reduce4(b[0], b[1], b[2], b[3]);
        if (bits == 8 && code_off(wt)) { /* sum (u - off) x = sum u x - off sum x, per half */
            const int sh = wt == KVC_GGML_Q6_K ? 5 : 2;
            i0 = _mm512_sub_epi32(i0, _mm512_slli_epi32(qs0, sh));
            i1 = _mm512_sub_epi32(i1, _mm512_slli_epi32(_mm512_sub_epi32(qs, qs0), sh));
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(g->dw, dx), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(g->mw, dx), acc);
        if (q2k) { /* m0 qsum0 + m1 (qsum - qsum0): an integer < 2^24, exact in float */
            const __m512 t = _mm512_fmadd_ps(
                g->m1, _mm512_cvtepi32_ps(_mm512_sub_epi32(qs, qs0)),
                _mm512_mul_ps(g->m0, _mm512_cvtepi32_ps(qs0)));
            acc = _mm512_fmadd_ps(t, _mm512_mul_ps(g->dm, dx), acc);
        }
    } else {
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(g->dw, dx), acc);
        if (wt != KVC_GGML_IQ4_XS)
            acc = _mm512_fmadd_ps(g->mw, _mm512_loadu_ps((const void *)(xg + qbytes + 32 * L)),
                                  acc);
    }
    return acc;
}

/* nr (1..4) activation rows times W row w: y[i * ldy]. */
AI void kq_tile(const int32_t wt, const int bits, const int nr, const uint8_t *w, int64_t nb,
                const uint8_t *x, int64_t xs, float *y, int64_t ldy) {
    const int64_t bb = kq_bytes(wt), gbytes = kvc__gemm_group_bytes(L, bits);
    const int64_t nsb = nb / 8;
    __m512 acc[4];
    UNROLL
    for (int i = 0; i < nr; i++) acc[i] = _mm512_setzero_ps();
    kgroup g;
    int64_t gi = 0;
    for (; 2 * gi + 2 <= nsb; gi++) {
        load_kgroup(wt, bits, w + 2 * gi * bb, 2, &g);
        UNROLL
        for (int i = 0; i < nr; i++)
            acc[i] = row_kgroup(wt, bits, &g, 4, x + i * xs + gi * gbytes, acc[i]);
    }
    if (2 * gi < nsb) {
        load_kgroup(wt, bits, w + 2 * gi * bb, 1, &g);
        UNROLL
        for (int i = 0; i < nr; i++)
            acc[i] = row_kgroup(wt, bits, &g, 2, x + i * xs + gi * gbytes, acc[i]);
    }
    UNROLL
    for (int i = 0; i < nr; i++) y[i * ldy] = _mm512_reduce_add_ps(acc[i]);
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

void kvc__gemm_kq8_avx512(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                          int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n,
                          float *Y, int64_t ldy) {
    kq_types(8, wt, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy);
}

void kvc__gemm_kq16_avx512(int32_t wt, const uint8_t *W, int64_t row_bytes, int64_t r0,
                           int64_t r1, int64_t nb, const uint8_t *xq, int64_t xs, int64_t n,
                           float *Y, int64_t ldy) {
    kq_types(16, wt, W, row_bytes, r0, r1, nb, xq, xs, n, Y, ldy);
}
