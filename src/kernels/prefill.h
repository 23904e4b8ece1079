/*
 * Prefill-attention kernels (src/attn/prefill.c), one table per ISA, chosen
 * by kvc_get_isa(). They work on float32 tiles in "lane" layout: the lanes
 * of a vector are the query rows of a tile (one query head and query
 * position per lane, Mp lanes, Mp a multiple of KVC_PF_LANES), so every
 * per-row quantity (score of one key, running max, sum, output element) is
 * one vector and no horizontal reduction is ever needed:
 *
 *   Qt (D, Mp)   query tile, transposed: Qt[d][m] = q_m[d] * scale
 *   St (n, Mp)   scores of n keys, then probabilities, in place
 *   Ot (Dpad, Mp) output accumulators, transposed
 *
 * Each lane's arithmetic is a fixed sequence of float32 operations that
 * involves no other lane, so a query row gets the same bits whatever tile
 * it shares (the row-independence contract of include/kvcache/prefill.h).
 * ISAs differ in the last bits (polynomial exp2 vs libm), each is
 * deterministic.
 */
#ifndef KVC_PREFILL_KERNELS_H
#define KVC_PREFILL_KERNELS_H

#include <stdint.h>

#include "kvcache/core.h"

/* Mp is a multiple of this (the widest vector). */
#define KVC_PF_LANES 16
/* The A extent of every gemm call is a multiple of this: each ISA's
 * register block height divides it, so there is no remainder code. 4 also
 * divides the usual head dims and the key block, so no work is padding. */
#define KVC_PF_APAD 4

/* Terms per FMA chain of the gemm below: one chain of Dh = 128 products
 * carried rounding error that grows with its length; chains of 32 added
 * together cut the error of float32 prefill with large scores 3-4x
 * (BENCHMARKS.md, prefill) for 0-7% of the speed. Divides KVC__PF_KB. */
#define KVC_PF_TCHUNK 32

typedef struct kvc_prefill_kernels {
    kvc_isa isa;
    /*
     * Broadcast GEMM into lane rows:
     *   C[a][0:Mp] = (alpha ? C[a][0:Mp] * alpha[0:Mp] : 0)
     *                + sum over chunks of (sum_{t in chunk, in order} X[a * xa + t * xt]
     *                                      * Y[t * ldy + 0:Mp])
     * for a < A. C (A, ldc), Y (T, ldy) float32, 64-byte aligned rows
     * (ldc, ldy multiples of 16); X read by scalar broadcasts (any strides).
     * A % KVC_PF_APAD == 0, Mp % KVC_PF_LANES == 0, Mp <= ldc, ldy.
     * Chunks: t ranges split where (t + t0) % KVC_PF_TCHUNK == 0; each is one
     * FMA chain per (a, lane) from zero, added to C in chunk order (the first
     * to C * alpha, rounded). QK^T is (X = K rows, xa = row stride, xt = 1,
     * Y = Qt, t0 = 0), PV is (X = V rows read down a column, xa = 1, xt = row
     * stride, Y = probabilities, t0 = the first key's position): chunks sit
     * at absolute key positions, so keys a lane does not see (p = 0) change
     * none of its bits and a row gives the same bits in any batch.
     */
    void (*gemm)(float *C, int64_t ldc, const float *X, int64_t xa, int64_t xt, const float *Y,
                 int64_t ldy, int64_t A, int64_t T, int64_t t0, int64_t Mp, const float *alpha);
    /*
     * One block of the online softmax, per lane m < Mp. Rows t < n of S
     * (n, lds) hold scores q.k of key position j0 + t: raw with sc =
     * sm_scale * log2 e > 0, or already base 2 with sc = 1 (q carrying the
     * scale; always so with a cap, a bias or sm_scale < 0), multiplied by
     * sm_scale only when cap > 0. For each t:
     *   s = cap > 0 ? cap * tanh(s / cap) * log2(e) : s;  s += bias[t][m]
     *   (bias (n, lds) or NULL); s = -inf unless lo[m] <= j0 + t <= hi[m].
     * Then with the block max b: m' = max(m, b * sc); alpha = 1 if m' == m,
     * else 2^(m - m'); p = 2^(s * sc - m') in one fused operation (0 for
     * s = -inf; m' = -inf counts as 0): large scores keep their
     * differences. S rows become p, l = l * alpha + sum_t p (t in order),
     * m = m' (base 2).
     * A lane with no visible key in the block leaves m, l unchanged and gets
     * alpha 1 and p 0, so the block is an exact no-op for it.
     */
    void (*softmax)(float *S, int64_t lds, int64_t n, int64_t Mp, int64_t j0, const int32_t *lo,
                    const int32_t *hi, const float *bias, float cap, float sc, float *m,
                    float *l, float *alpha);
} kvc_prefill_kernels;

/* The table for kvc_get_isa(). */
const kvc_prefill_kernels *kvc__prefill_kernels(void);

const kvc_prefill_kernels *kvc__prefill_kernels_scalar(void);
const kvc_prefill_kernels *kvc__prefill_kernels_avx2(void);
const kvc_prefill_kernels *kvc__prefill_kernels_avx512(void);

#endif
