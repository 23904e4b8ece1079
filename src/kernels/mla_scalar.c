/*
 * MLA task kernel, portable C (baseline x86-64 or any CPU): the same body
 * (mla_body.h) with one-lane "vectors", and plain dot products for scores.
 */
#include <math.h>
#include <string.h>

#include "../core/internal.h"
#include "mla.h"

typedef float mb_vec;
#define MB_VL 1
#define MB_PV_C 4
#define MB_LOAD(p) (*(p))
#define MB_STORE(p, v) (*(p) = (v))
#define MB_ZERO() 0.0f
#define MB_SET1(x) (x)
#define MB_ADD(a, b) ((a) + (b))
#define MB_SUB(a, b) ((a) - (b))
#define MB_MUL(a, b) ((a) * (b))
#define MB_MAX(a, b) ((a) > (b) ? (a) : (b))
#define MB_FMA(a, b, c) ((a) * (b) + (c)) /* no -mfma here: fmaf would be a libm call */
#define MB_FFMA(a, b, c) fmaf((a), (b), (c)) /* per score only: libm is fine */
#define MB_HSUM(v) (v)
#define MB_HMAX(v) (v)
#define MB_EXP2(v) exp2f(v)

/* Each score one dot product in index order, four partial sums (the
 * compiler keeps them in registers without reassociating anything). */
static inline void mb_scores(const float *q, int Dq, const float *tile, int nk, float *s) {
    for (int r = 0; r < KVC_MLA_RB; r++)
        for (int j = 0; j < nk; j++) {
            const float *qr = q + (int64_t)r * Dq, *kj = tile + (int64_t)j * Dq;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
            for (int d = 0; d < Dq; d += 4) {
                a0 += qr[d] * kj[d];
                a1 += qr[d + 1] * kj[d + 1];
                a2 += qr[d + 2] * kj[d + 2];
                a3 += qr[d + 3] * kj[d + 3];
            }
            s[r * KVC_MLA_NB + j] = (a0 + a1) + (a2 + a3);
        }
}

#define MB_NAME kvc__mla_task_scalar
#include "mla_body.h"
