/*
 * MLA task kernel, AVX2 + FMA: 8 float32 lanes, 16 ymm registers. Compiled
 * with per-file ISA flags and only called after the CPU check. The body is
 * mla_body.h; this file supplies the vector primitives and a 4 rows x 2
 * keys score microkernel (8 accumulators + 6 operands fit 16 registers).
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "../core/internal.h"
#include "mla.h"
#include "vec_math.h"

typedef __m256 mb_vec;
#define MB_VL 8
#define MB_PV_C 2 /* 4 rows x 2 vectors: 8 accumulators + 2 rows + 1 broadcast */
#define MB_LOAD(p) _mm256_loadu_ps(p)
#define MB_STORE(p, v) _mm256_storeu_ps((p), (v))
#define MB_ZERO() _mm256_setzero_ps()
#define MB_SET1(x) _mm256_set1_ps(x)
#define MB_ADD(a, b) _mm256_add_ps((a), (b))
#define MB_SUB(a, b) _mm256_sub_ps((a), (b))
#define MB_MUL(a, b) _mm256_mul_ps((a), (b))
#define MB_MAX(a, b) _mm256_max_ps((a), (b))
#define MB_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define MB_FFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define MB_HSUM(v) kvc__hsum8(v)
#define MB_HMAX(v) kvc__hmax8(v)
#define MB_EXP2(v) kvc__exp2_8(v)

/* Lane i = sum of the lanes of a[i], i < 8 (pairwise hadd, then the two
 * 128-bit halves). */
static inline __m256 mb_reduce8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 4 rows x 2 keys per step: 6 loads feed 8 FMAs. */
static inline void mb_scores(const float *q, int Dq, const float *tile, int nk, float *s) {
    for (int kb = 0; kb < nk; kb += 2) {
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        const float *k = tile + (int64_t)kb * Dq;
        for (int d = 0; d < Dq; d += 8) {
            const __m256 k0 = _mm256_loadu_ps(k + d), k1 = _mm256_loadu_ps(k + Dq + d);
            for (int r = 0; r < 4; r++) {
                const __m256 qv = _mm256_loadu_ps(q + (int64_t)r * Dq + d);
                a[r * 2] = _mm256_fmadd_ps(qv, k0, a[r * 2]);
                a[r * 2 + 1] = _mm256_fmadd_ps(qv, k1, a[r * 2 + 1]);
            }
        }
        float v[8] __attribute__((aligned(32)));
        _mm256_store_ps(v, mb_reduce8(a));
        for (int r = 0; r < 4; r++) {
            s[r * KVC_MLA_NB + kb] = v[r * 2];
            s[r * KVC_MLA_NB + kb + 1] = v[r * 2 + 1];
        }
    }
}

#define MB_NAME kvc__mla_task_avx2
#include "mla_body.h"
