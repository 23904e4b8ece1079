/*
 * MLA task kernel, AVX-512 (F/BW/VL/DQ + FMA): 16 float32 lanes. Compiled
 * with per-file ISA flags and only called after the CPU check (mla.c picks
 * it from kvc_get_isa()). The body is mla_body.h; this file supplies the
 * vector primitives and the 4 rows x 4 keys score microkernel.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "../core/internal.h"
#include "mla.h"

typedef __m512 mb_vec;
#define MB_VL 16
#define MB_PV_C 4 /* 4 rows x 4 vectors: 16 accumulators + 4 rows + 1 broadcast */
#define MB_LOAD(p) _mm512_loadu_ps(p)
#define MB_STORE(p, v) _mm512_storeu_ps((p), (v))
#define MB_ZERO() _mm512_setzero_ps()
#define MB_SET1(x) _mm512_set1_ps(x)
#define MB_ADD(a, b) _mm512_add_ps((a), (b))
#define MB_SUB(a, b) _mm512_sub_ps((a), (b))
#define MB_MUL(a, b) _mm512_mul_ps((a), (b))
#define MB_MAX(a, b) _mm512_max_ps((a), (b))
#define MB_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define MB_HSUM(v) _mm512_reduce_add_ps(v)
#define MB_HMAX(v) _mm512_reduce_max_ps(v)
#define MB_EXP2(v) mb_exp2(v)

/*
 * 2^x for x <= 0: x = n + f with n = round(x), |f| <= 1/2; 2^f by its
 * degree-6 Taylor polynomial in f ln 2 (relative error < 2e-7 on the
 * range), 2^n put in the exponent field. x < -126 (and -inf) gives exactly
 * 0, so masked keys contribute nothing.
 */
static inline __m512 mb_exp2(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284770e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~tiny, p, _mm512_castsi512_ps(e));
}

/* Lane i = sum of the lanes of a[i]: a transposed reduction (pairs, then
 * 128-bit blocks), 45 shuffles/adds for 16 dot products of Dq / 16 FMAs. */
static inline __m512 mb_reduce16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++) /* lanes alternate a[2i], a[2i+1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* each 128-bit block: a[4i .. 4i+3] */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x44),
                                    _mm512_shuffle_f32x4(c[0], c[1], 0xee));
    const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x44),
                                    _mm512_shuffle_f32x4(c[2], c[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, 0x88), _mm512_shuffle_f32x4(f0, f1, 0xdd));
}

/* 4 rows x 4 keys per step: 8 loads feed 16 FMAs; lane r * 4 + i of the
 * reduction is row r, key i, so its 128-bit block r is row r's 4 scores. */
static inline void mb_scores(const float *q, int Dq, const float *tile, int nk, float *s) {
    for (int kb = 0; kb < nk; kb += 4) {
        __m512 a[16];
        for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
        const float *k = tile + (int64_t)kb * Dq;
        for (int d = 0; d < Dq; d += 16) {
            __m512 qv[4], kv[4];
            for (int r = 0; r < 4; r++) qv[r] = _mm512_loadu_ps(q + (int64_t)r * Dq + d);
            for (int i = 0; i < 4; i++) kv[i] = _mm512_loadu_ps(k + (int64_t)i * Dq + d);
            for (int r = 0; r < 4; r++)
                for (int i = 0; i < 4; i++)
                    a[r * 4 + i] = _mm512_fmadd_ps(qv[r], kv[i], a[r * 4 + i]);
        }
        const __m512 v = mb_reduce16(a);
        _mm_storeu_ps(s + 0 * KVC_MLA_NB + kb, _mm512_extractf32x4_ps(v, 0));
        _mm_storeu_ps(s + 1 * KVC_MLA_NB + kb, _mm512_extractf32x4_ps(v, 1));
        _mm_storeu_ps(s + 2 * KVC_MLA_NB + kb, _mm512_extractf32x4_ps(v, 2));
        _mm_storeu_ps(s + 3 * KVC_MLA_NB + kb, _mm512_extractf32x4_ps(v, 3));
    }
}

#define MB_NAME kvc__mla_task_avx512
#include "mla_body.h"
