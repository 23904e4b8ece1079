/*
 * Prefill-attention kernel bodies (prefill.h), instantiated once per ISA:
 * the including file defines the primitives below and PB_GEMM / PB_SOFTMAX
 * (the function names), then includes this file.
 *
 *   pb_vec, PB_VL                  vector of PB_VL float32 lanes
 *   PB_NA                          register block height (rows of C), divides KVC_PF_APAD
 *   PB_NM                          widest register block, in vectors (lanes = PB_NM * PB_VL)
 *   PB_LOAD(p) PB_STORE(p, v)      aligned
 *   PB_ZERO() PB_SET1(x) PB_BCAST(p)   PB_BCAST: all lanes = *p
 *   PB_FMA(a, b, c) = a * b + c    PB_MUL PB_ADD PB_SUB PB_MAX
 *   PB_FFMA(a, b, c)               a * b + c with one rounding (fused on every ISA)
 *   PB_EXP2(v)                     2^v for v <= 0, exactly 0 below -126 and for -inf
 *   PB_SEL_EQ(a, b, x, y)          lane-wise a == b ? x : y
 *   PB_RANGE(s, j, lo, hi)         lane-wise lo[m] <= j <= hi[m] ? s : -inf (lo, hi: int32 *)
 *
 * The register block keeps PB_NA x nm accumulators (nm <= PB_NM vectors)
 * in registers for a chunk of t (KVC_PF_TCHUNK): per t, nm vector loads of
 * Y and PB_NA broadcasts of X feed PB_NA * nm FMAs; a chunk's sums are then
 * added to C.
 */
#include "vec_math.h"

#define PB_LOG2E 1.4426950408889634f

/* One PB_NA x nm register block. nm is a constant after inlining (the
 * callers switch on it), so the accumulator arrays live in registers. Each
 * chunk of t (prefill.h: KVC_PF_TCHUNK, at absolute positions t + t0) sums
 * from zero in registers and is then added to C (the first one to the
 * rounded C * alpha, or 0): a chunk of zero terms then leaves C as it is,
 * whichever chunk comes first. */
static inline __attribute__((always_inline)) void pb_block(int nm, float *C, int64_t ldc,
                                                           const float *X, int64_t xa, int64_t xt,
                                                           const float *Y, int64_t ldy, int64_t T,
                                                           int64_t t0, const float *alpha) {
    pb_vec acc[PB_NA][PB_NM];
    const float *xp[PB_NA];
#pragma GCC unroll 16
    for (int a = 0; a < PB_NA; a++) xp[a] = X + a * xa;
    int64_t ta = 0;
    do { /* once when T is 0: C = C * alpha or 0 */
        int64_t tb = ta + KVC_PF_TCHUNK - (ta + t0) % KVC_PF_TCHUNK;
        if (tb > T) tb = T;
#pragma GCC unroll 16
        for (int a = 0; a < PB_NA; a++)
#pragma GCC unroll 16
            for (int v = 0; v < nm; v++) acc[a][v] = PB_ZERO();
        for (int64_t t = ta; t < tb; t++) {
            pb_vec y[PB_NM];
            const float *yr = Y + t * ldy;
            const int64_t xo = t * xt;
#pragma GCC unroll 16
            for (int v = 0; v < nm; v++) y[v] = PB_LOAD(yr + v * PB_VL);
#pragma GCC unroll 16
            for (int a = 0; a < PB_NA; a++) {
                const pb_vec xb = PB_BCAST(xp[a] + xo);
#pragma GCC unroll 16
                for (int v = 0; v < nm; v++) acc[a][v] = PB_FMA(xb, y[v], acc[a][v]);
            }
        }
        if (ta > 0) {
#pragma GCC unroll 16
            for (int a = 0; a < PB_NA; a++)
#pragma GCC unroll 16
                for (int v = 0; v < nm; v++)
                    PB_STORE(C + a * ldc + v * PB_VL,
                             PB_ADD(PB_LOAD(C + a * ldc + v * PB_VL), acc[a][v]));
        } else if (alpha) {
#pragma GCC unroll 16
            for (int a = 0; a < PB_NA; a++)
#pragma GCC unroll 16
                for (int v = 0; v < nm; v++)
                    PB_STORE(C + a * ldc + v * PB_VL,
                             PB_ADD(PB_MUL(PB_LOAD(C + a * ldc + v * PB_VL),
                                           PB_LOAD(alpha + v * PB_VL)),
                                    acc[a][v]));
        } else {
#pragma GCC unroll 16
            for (int a = 0; a < PB_NA; a++)
#pragma GCC unroll 16
                for (int v = 0; v < nm; v++) PB_STORE(C + a * ldc + v * PB_VL, acc[a][v]);
        }
        ta = tb;
    } while (ta < T);
}

static void PB_GEMM(float *C, int64_t ldc, const float *X, int64_t xa, int64_t xt, const float *Y,
                    int64_t ldy, int64_t A, int64_t T, int64_t t0, int64_t Mp,
                    const float *alpha) {
    for (int64_t m0 = 0; m0 < Mp;) {
        int64_t nm = (Mp - m0) / PB_VL;
        if (nm > PB_NM) nm = PB_NM;
        const float *al = alpha ? alpha + m0 : NULL;
        for (int64_t a0 = 0; a0 < A; a0 += PB_NA) {
            float *c = C + a0 * ldc + m0;
            const float *x = X + a0 * xa, *y = Y + m0;
            switch (nm) {
#if PB_NM >= 4
            case 4: pb_block(4, c, ldc, x, xa, xt, y, ldy, T, t0, al); break;
            case 3: pb_block(3, c, ldc, x, xa, xt, y, ldy, T, t0, al); break;
#endif
#if PB_NM >= 2
            case 2: pb_block(2, c, ldc, x, xa, xt, y, ldy, T, t0, al); break;
#endif
            default: pb_block(1, c, ldc, x, xa, xt, y, ldy, T, t0, al); break;
            }
        }
        m0 += nm * PB_VL;
    }
}

static void PB_SOFTMAX(float *S, int64_t lds, int64_t n, int64_t Mp, int64_t j0, const int32_t *lo,
                       const int32_t *hi, const float *bias, float cap, float sc, float *m,
                       float *l, float *alpha) {
    if (cap > 0.0f) /* vec_math.h: the same bits on every ISA */
        for (int64_t t = 0; t < n; t++) kvc__softcap_row(S + t * lds, Mp, cap, PB_LOG2E);
    const pb_vec ninf = PB_SET1(-INFINITY), one = PB_SET1(1.0f), zero = PB_ZERO(),
                 vsc = PB_SET1(sc);
    for (int64_t m0 = 0; m0 < Mp; m0 += PB_VL) {
        pb_vec bmax = ninf;
        for (int64_t t = 0; t < n; t++) {
            float *sr = S + t * lds + m0;
            pb_vec s = PB_LOAD(sr);
            if (bias) s = PB_ADD(s, PB_LOAD(bias + t * lds + m0));
            s = PB_RANGE(s, (int32_t)(j0 + t), lo + m0, hi + m0);
            PB_STORE(sr, s);
            bmax = PB_MAX(bmax, s);
        }
        /* the raw max to base 2, then 2^(s * sc - m') in one fused op */
        const pb_vec mo = PB_LOAD(m + m0), mn = PB_MAX(mo, PB_MUL(bmax, vsc));
        const pb_vec al = PB_SEL_EQ(mn, mo, one, PB_EXP2(PB_SUB(mo, mn)));
        const pb_vec nmu = PB_SUB(zero, PB_SEL_EQ(mn, ninf, zero, mn));
        pb_vec sum = zero;
        for (int64_t t = 0; t < n; t++) {
            float *sr = S + t * lds + m0;
            const pb_vec p = PB_EXP2(PB_FFMA(PB_LOAD(sr), vsc, nmu));
            PB_STORE(sr, p);
            sum = PB_ADD(sum, p);
        }
        PB_STORE(l + m0, PB_ADD(PB_MUL(PB_LOAD(l + m0), al), sum));
        PB_STORE(m + m0, mn);
        PB_STORE(alpha + m0, al);
    }
}

#undef PB_LOG2E
