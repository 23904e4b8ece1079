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
#include "vec_math.h"

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
#define MB_FFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define MB_HSUM(v) _mm512_reduce_add_ps(v)
#define MB_HMAX(v) _mm512_reduce_max_ps(v)
#define MB_EXP2(v) kvc__exp2_16(v)

#define mb_reduce16(a) kvc__reduce16(a)

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
