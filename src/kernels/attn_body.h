/*
 * Decode-attention kernel body (kernels.h, attn_decode), instantiated once
 * per ISA: the including file defines the vector primitives below and
 * AB_NAME, then includes this file.
 *
 *   ab_vec, AB_VL                     vector type, float32 lanes (1, 8, 16)
 *   AB_LOAD(p) AB_STORE(p, v)         aligned enough: p is a multiple of AB_VL floats
 *   AB_ZERO() AB_SET1(x)
 *   AB_FMA(a, b, c)                   a * b + c
 *   AB_MUL(a, b) AB_ADD AB_SUB AB_MAX AB_HMAX(v), AB_HSUM(v) (AB_VL == 1 only)
 *   AB_EXP2(v)                        2^v for v <= 0, exactly 0 below -126
 *   ab_row_to_f32(src, dt, sc, sd, group, D, dst)   one K/V row -> D floats
 *
 * With AB_VL == 1 (kernels_scalar.c) this is the plain reference: keys in
 * blocks of AB_NB, the block's K rows converted to float32 in a stack tile,
 * G scores per key, one online-softmax rescale per block and head, then the
 * block's V rows converted and accumulated.
 *
 * SIMD ISAs (AB_VL > 1) also define
 *
 *   AB_LOADK(p, dt, e)                AB_VL elements [e, e + AB_VL) of a row of dtype dt
 *                                     (F32, F16, BF16, I8, I4; unscaled) as float32
 *   AB_RED4(a0, a1, a2, a3, out)      out[i] = horizontal sum of ai (4 floats stored)
 *   AB_MAX4(a0, a1, a2, a3, out)      out[i] = horizontal max of ai
 *   AB_SCALEROW(sc, sd, n, dst)       the n scales of a scale row (F32 or F16) -> dst floats
 *   AB_GATHER(p, stride)              vector of p[i * stride], lanes i
 *   AB_SCALE2(p)                      p[0] in the low half of the lanes, p[1] in the high half
 *   AB_NH                             query heads per register tile (<= 4)
 *   AB_NC                             vectors of the head dim per P.V tile (<= 4)
 *
 * and get the register-blocked kernel below: no float32 round trip for the
 * rows (K and V vectors are converted in registers and used by every query
 * head of the tile: AB_NH heads x 4 keys of score accumulators, AB_NH heads
 * x AB_NC vectors of output accumulators), int8/int4 group scales applied
 * once per converted K vector (shared by the heads) and folded into the
 * softmax weights for V (p * scale per key and group, AB_NB keys per vector
 * multiply). Quant groups of half a vector (8 with AVX-512, pmx's default;
 * 4 with AVX2) stay on the register path too: each K and V vector is
 * multiplied by its two groups' scales (AB_SCALE2), p is not folded. Rows
 * whose layout the register path does not cover (a head dim not a multiple
 * of AB_VL, other quant groups that are not a multiple of AB_VL, more groups
 * x heads than the weight table holds) go through the float32 tile as in
 * the reference, then the same register tiles.
 */
#include "vec_math.h"

#define AB_NB 16

#if AB_VL == 1

static void AB_NAME(const float *q, int G, int D, int Dp, const kvc_attn_rows *r, int64_t n,
                    float cap, float sc, float *m, float *l, float *acc) {
    static const float log2e = 1.4426950408889634f;
    float tile[AB_NB * KVC_ATTN_MAX_DIM] __attribute__((aligned(64)));
    float s[KVC_ATTN_MAX_G * AB_NB] __attribute__((aligned(64)));
    const int quant = r->dt == KVC_I8 || r->dt == KVC_I4;
    for (int j = 0; j < AB_NB; j++)
        for (int d = D; d < Dp; d++) tile[j * Dp + d] = 0.0f;
    for (int64_t j0 = 0; j0 < n; j0 += AB_NB) {
        const int nb = n - j0 < AB_NB ? (int)(n - j0) : AB_NB;
        /* K rows of the block -> tile */
        for (int j = 0; j < nb; j++) {
            const int64_t key = j0 + j;
            ab_row_to_f32((const char *)r->k + key * r->k_stride, r->dt,
                          quant ? (const char *)r->ks + key * r->ks_stride : NULL, r->ksd, r->group,
                          D, tile + j * Dp);
        }
        /* scores */
        for (int g = 0; g < G; g++) {
            const float *qg = q + (int64_t)g * Dp;
            for (int j = 0; j < nb; j++) {
                const float *kr = tile + j * Dp;
                ab_vec a0 = AB_ZERO(), a1 = AB_ZERO();
                int d = 0;
                for (; d + 2 * AB_VL <= Dp; d += 2 * AB_VL) {
                    a0 = AB_FMA(AB_LOAD(qg + d), AB_LOAD(kr + d), a0);
                    a1 = AB_FMA(AB_LOAD(qg + d + AB_VL), AB_LOAD(kr + d + AB_VL), a1);
                }
                for (; d < Dp; d += AB_VL) a0 = AB_FMA(AB_LOAD(qg + d), AB_LOAD(kr + d), a0);
                s[g * AB_NB + j] = AB_HSUM(a0) + AB_HSUM(a1);
            }
            if (cap > 0.0f) kvc__softcap_row(s + g * AB_NB, nb, cap, log2e);
            for (int j = nb; j < AB_NB; j++) s[g * AB_NB + j] = -INFINITY;
        }
        /* online softmax: one rescale per head and block; the max of the raw
         * scores, then 2^(s * sc - m) in one FMA (kernels.h) */
        for (int g = 0; g < G; g++) {
            float *sg = s + g * AB_NB;
            ab_vec mx = AB_LOAD(sg);
            for (int j = AB_VL; j < AB_NB; j += AB_VL) mx = AB_MAX(mx, AB_LOAD(sg + j));
            const float bm = AB_HMAX(mx) * sc;
            const float mn = bm > m[g] ? bm : m[g];
            if (mn == -INFINITY) { /* no finite score yet: nothing to add */
                for (int j = 0; j < AB_NB; j++) sg[j] = 0.0f;
                continue;
            }
            ab_vec sum = AB_ZERO();
            for (int j = 0; j < AB_NB; j += AB_VL) {
                ab_vec p = AB_EXP2(fmaf(AB_LOAD(sg + j), sc, -mn)); /* fused: one rounding */
                AB_STORE(sg + j, p);
                sum = AB_ADD(sum, p);
            }
            if (mn > m[g]) {
                const float alpha = m[g] == -INFINITY ? 0.0f : exp2f(m[g] - mn);
                const ab_vec va = AB_SET1(alpha);
                float *ag = acc + (int64_t)g * Dp;
                for (int d = 0; d < Dp; d += AB_VL) AB_STORE(ag + d, AB_MUL(AB_LOAD(ag + d), va));
                l[g] *= alpha;
                m[g] = mn;
            }
            l[g] += AB_HSUM(sum);
        }
        /* V rows of the block -> tile, accumulate */
        for (int j = 0; j < nb; j++) {
            const int64_t key = j0 + j;
            ab_row_to_f32((const char *)r->v + key * r->v_stride, r->dt,
                          quant ? (const char *)r->vs + key * r->vs_stride : NULL, r->vsd, r->group,
                          D, tile + j * Dp);
        }
        for (int g = 0; g < G; g++) {
            const float *pg = s + g * AB_NB;
            float *ag = acc + (int64_t)g * Dp;
            for (int d = 0; d < Dp; d += AB_VL) {
                ab_vec a = AB_LOAD(ag + d);
                for (int j = 0; j < nb; j++)
                    a = AB_FMA(AB_SET1(pg[j]), AB_LOAD(tile + j * Dp + d), a);
                AB_STORE(ag + d, a);
            }
        }
    }
}

#else /* AB_VL > 1: register-blocked */

#define AB_INL static inline __attribute__((always_inline))
/* p * scale table entries (groups x heads x AB_NB keys) of the register path */
#define AB_PS_MAX (KVC_ATTN_MAX_G * AB_NB * 16)

/* Byte offset of element e in a row of dtype dt (e even for I4). */
AB_INL int64_t ab_off(const kvc_dtype dt, int e) {
    return dt == KVC_F32 ? 4 * (int64_t)e
           : dt == KVC_I8 ? (int64_t)e
           : dt == KVC_I4 ? (int64_t)(e / 2)
                          : 2 * (int64_t)e;
}

/*
 * Scores of NH heads (q: NH rows of Dp) x 4 keys (kr[i]): out[h * AB_NB + i]
 * = q_h . k_i over ng groups of cpg vectors. kq: quantized rows, ksc[i * ng
 * + gi] the scale of key i, group gi (multiplied into the converted vector,
 * which all NH heads then use). half: groups of AB_VL / 2, so the loop runs
 * over the ng / 2 vectors (cpg 1), each scaled by its two groups' scales.
 */
AB_INL void ab_score_tile(const int NH, const kvc_dtype dt, const int kq, const int half,
                          const float *q, int Dp, const char *const *kr, const float *ksc, int ng,
                          int cpg, float *out) {
    ab_vec a[AB_NH][4];
#pragma GCC unroll 4
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) a[h][i] = AB_ZERO();
    int e = 0;
    const int nloop = half ? ng / 2 : ng;
    for (int gi = 0; gi < nloop; gi++) {
        ab_vec sv[4];
        if (kq) {
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                sv[i] = half ? AB_SCALE2(ksc + i * ng + 2 * gi) : AB_SET1(ksc[i * ng + gi]);
        }
        for (int cc = 0; cc < cpg; cc++, e += AB_VL) {
            ab_vec kv[4];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                kv[i] = AB_LOADK(kr[i], dt, e);
                if (kq) kv[i] = AB_MUL(kv[i], sv[i]);
            }
#pragma GCC unroll 4
            for (int h = 0; h < NH; h++) {
                const ab_vec qv = AB_LOAD(q + h * Dp + e);
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++) a[h][i] = AB_FMA(qv, kv[i], a[h][i]);
            }
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; h++) AB_RED4(a[h][0], a[h][1], a[h][2], a[h][3], out + h * AB_NB);
}

/* Prefetches (into L2) every cache line of rows [j0, j1) of the next
 * block's rows at p + j * st, each row `bytes` long. */
AB_INL void ab_prefetch_rows(const void *p, int64_t st, int64_t bytes, int64_t j0, int64_t j1) {
    if (!p) return;
    for (int64_t j = j0; j < j1; j++) {
        const uintptr_t a0 = (uintptr_t)p + (uintptr_t)(j * st), end = a0 + (uintptr_t)bytes;
        for (uintptr_t a = a0 & ~(uintptr_t)63; a < end; a += 64)
            __builtin_prefetch((const void *)a, 0, 2);
    }
}

/* The next block's K, V (and scale) rows [j0, j0 + 4) while this call's
 * keys [j0, j0 + 4) are scored (n: this call's keys; its last quad takes
 * the rest), so the requests are spread over the score quads. */
AB_INL void ab_prefetch_next(const kvc_attn_rows *r, int D, int64_t j0, int64_t n) {
    if (!r->nk || j0 >= r->nn) return;
    const int64_t j1 = j0 + 4 < r->nn && j0 + 4 < n ? j0 + 4 : r->nn; /* the last quad: the rest */
    const int64_t rb = ab_off(r->dt, D);
    ab_prefetch_rows(r->nk, r->k_stride, rb, j0, j1);
    ab_prefetch_rows(r->nv, r->v_stride, rb, j0, j1);
    if (r->nks) {
        const int64_t groups = D / r->group;
        ab_prefetch_rows(r->nks, r->ks_stride, groups * (r->ksd == KVC_F32 ? 4 : 2), j0, j1);
        ab_prefetch_rows(r->nvs, r->vs_stride, groups * (r->vsd == KVC_F32 ? 4 : 2), j0, j1);
    }
}

/* s[g * AB_NB + j] = q_g . k_j for the nb (<= AB_NB) keys at k + j * kst;
 * entries past nb are garbage (the caller overwrites them). pf: the call's
 * rows, whose next block is prefetched a quad at a time (NULL: none). */
AB_INL void ab_scores(const kvc_dtype dt, const int kq, const int half, const float *q, int G,
                      int Dp, const char *k, int64_t kst, const float *ksc, int ng, int cpg,
                      int nb, float *s, const kvc_attn_rows *pf, int D, int64_t pj0, int64_t n) {
    for (int j0 = 0; j0 < nb; j0 += 4) {
        if (pf) ab_prefetch_next(pf, D, pj0 + j0, n);
        const char *kr[4];
        for (int i = 0; i < 4; i++) kr[i] = k + (int64_t)(j0 + i < nb ? j0 + i : nb - 1) * kst;
        const float *ks = kq ? ksc + j0 * ng : NULL;
        for (int g0 = 0; g0 < G; g0 += AB_NH) {
            const float *qg = q + (int64_t)g0 * Dp;
            float *o = s + g0 * AB_NB + j0;
            switch (G - g0 < AB_NH ? G - g0 : AB_NH) {
#if AB_NH >= 4
            case 4: ab_score_tile(4, dt, kq, half, qg, Dp, kr, ks, ng, cpg, o); break;
#endif
#if AB_NH >= 3
            case 3: ab_score_tile(3, dt, kq, half, qg, Dp, kr, ks, ng, cpg, o); break;
#endif
            case 2: ab_score_tile(2, dt, kq, half, qg, Dp, kr, ks, ng, cpg, o); break;
            default: ab_score_tile(1, dt, kq, half, qg, Dp, kr, ks, ng, cpg, o); break;
            }
        }
    }
}

/*
 * acc[h][e0 + cc * AB_VL ...] += sum_j p * v_j for NH heads x NC vectors,
 * the accumulators held in registers over the nb keys. Weights: vq == 0,
 * p = pc[0][h * AB_NB + j] (one per head and key); vq == 1 (quantized V,
 * scale folded in), p = pc[cc][h * AB_NB + j] (per vector's group); vq == 2
 * (groups of half a vector), p = pc[0][h * AB_NB + j] and each V vector
 * multiplied by AB_SCALE2 of vsc + j * ng + 2 * (e0 / AB_VL + cc).
 */
AB_INL void ab_pv_tile(const int NH, const int NC, const kvc_dtype dt, const int vq,
                       const char *v, int64_t vst, int nb, const float *const *pc, float *acc,
                       int Dp, int e0, const float *vsc, int ng) {
    ab_vec a[AB_NH][AB_NC];
#pragma GCC unroll 4
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 4
        for (int cc = 0; cc < NC; cc++) a[h][cc] = AB_LOAD(acc + h * Dp + e0 + cc * AB_VL);
    const char *vr = v + ab_off(dt, e0); /* the piece's elements: constant offsets below */
    const float *vs = vq == 2 ? vsc + 2 * (e0 / AB_VL) : NULL;
    for (int j = 0; j < nb; j++, vr += vst) {
        ab_vec vv[AB_NC];
#pragma GCC unroll 4
        for (int cc = 0; cc < NC; cc++) {
            vv[cc] = AB_LOADK(vr, dt, cc * AB_VL);
            if (vq == 2) vv[cc] = AB_MUL(vv[cc], AB_SCALE2(vs + (int64_t)j * ng + 2 * cc));
        }
#pragma GCC unroll 4
        for (int h = 0; h < NH; h++) {
            if (vq == 1) {
#pragma GCC unroll 4
                for (int cc = 0; cc < NC; cc++)
                    a[h][cc] = AB_FMA(AB_SET1(pc[cc][h * AB_NB + j]), vv[cc], a[h][cc]);
            } else {
                const ab_vec p = AB_SET1(pc[0][h * AB_NB + j]);
#pragma GCC unroll 4
                for (int cc = 0; cc < NC; cc++) a[h][cc] = AB_FMA(p, vv[cc], a[h][cc]);
            }
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; h++)
#pragma GCC unroll 4
        for (int cc = 0; cc < NC; cc++) AB_STORE(acc + h * Dp + e0 + cc * AB_VL, a[h][cc]);
}

#define AB_PV_CASE(nh, nc)                                                                         \
    case (nh) * 8 + (nc):                                                                          \
        ab_pv_tile((nh), (nc), dt, vq, v, vst, nb, pc, ag, Dp, e0, vsc, ng);                       \
        break;

/* P.V over nd (a multiple of AB_VL) elements of the nb keys at v + j * vst.
 * ps: weights [group][G][AB_NB] (vq 1) or [G][AB_NB]; group of vector c:
 * c / cpg. vq 2: V scales vsc[j * ng + group] (ab_pv_tile). */
AB_INL void ab_pv(const kvc_dtype dt, const int vq, const char *v, int64_t vst, int nb, int nd,
                  const float *ps, int G, int cpg, float *acc, int Dp, const float *vsc, int ng) {
    const int nch = nd / AB_VL;
    for (int c0 = 0; c0 < nch; c0 += AB_NC) {
        const int nc = nch - c0 < AB_NC ? nch - c0 : AB_NC, e0 = c0 * AB_VL;
        for (int g0 = 0; g0 < G; g0 += AB_NH) {
            const int nh = G - g0 < AB_NH ? G - g0 : AB_NH;
            const float *pc[AB_NC];
            for (int cc = 0; cc < AB_NC; cc++)
                pc[cc] = ps + (vq == 1 && cc < nc ? (int64_t)((c0 + cc) / cpg) * G * AB_NB : 0) +
                         g0 * AB_NB;
            float *ag = acc + (int64_t)g0 * Dp;
            switch (nh * 8 + nc) {
                AB_PV_CASE(1, 1) AB_PV_CASE(1, 2) AB_PV_CASE(1, 3) AB_PV_CASE(1, 4)
                AB_PV_CASE(2, 1) AB_PV_CASE(2, 2) AB_PV_CASE(2, 3) AB_PV_CASE(2, 4)
#if AB_NH >= 3
                AB_PV_CASE(3, 1) AB_PV_CASE(3, 2) AB_PV_CASE(3, 3) AB_PV_CASE(3, 4)
#endif
#if AB_NH >= 4
                AB_PV_CASE(4, 1) AB_PV_CASE(4, 2) AB_PV_CASE(4, 3) AB_PV_CASE(4, 4)
#endif
            default: break;
            }
        }
    }
}
#undef AB_PV_CASE

/*
 * Online softmax of the block's scores s (G x AB_NB, -inf past the keys):
 * s becomes p = 2^(s - m), m/l/acc rescaled once per head. Heads go in
 * fours: the block maxima and the sums of p come out of one transposed
 * reduction each (AB_RED4 / AB_MAX4) instead of a horizontal reduction per
 * head, and the rescale factors 2^(m_old - m_new) of the four heads out of
 * one vector AB_EXP2.
 */
AB_INL void ab_softmax(int G, int Dp, float sc, float *s, float *m, float *l, float *acc) {
    float bm[4], sums[4], al[AB_VL] __attribute__((aligned(64)));
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int nh = G - g0 < 4 ? G - g0 : 4;
        ab_vec mx[4], sv[4];
        for (int h = 0; h < 4; h++) {
            const float *sg = s + (g0 + (h < nh ? h : 0)) * AB_NB;
            mx[h] = AB_LOAD(sg);
            for (int j = AB_VL; j < AB_NB; j += AB_VL) mx[h] = AB_MAX(mx[h], AB_LOAD(sg + j));
        }
        AB_MAX4(mx[0], mx[1], mx[2], mx[3], bm);
        for (int h = 0; h < 4; h++) bm[h] *= sc; /* to base 2 (kernels.h) */
        int any = 0; /* a head whose max grew (needs a rescale) */
        for (int i = 0; i < AB_VL; i++) al[i] = 0.0f;
        for (int h = 0; h < nh; h++) {
            const int g = g0 + h;
            const float mn = bm[h] > m[g] ? bm[h] : m[g];
            float *sg = s + g * AB_NB;
            sv[h] = AB_ZERO();
            if (mn == -INFINITY) { /* no finite score yet: nothing to add */
                for (int j = 0; j < AB_NB; j++) sg[j] = 0.0f;
                bm[h] = mn;
                continue;
            }
            const ab_vec vm = AB_SET1(-mn), vs = AB_SET1(sc);
            for (int j = 0; j < AB_NB; j += AB_VL) {
                const ab_vec p = AB_EXP2(AB_FMA(AB_LOAD(sg + j), vs, vm));
                AB_STORE(sg + j, p);
                sv[h] = AB_ADD(sv[h], p);
            }
            /* m_old - m_new <= 0; -inf (first finite block) gives 0 */
            if (mn > m[g]) al[h] = m[g] - mn, any = 1;
            bm[h] = mn;
        }
        for (int h = nh; h < 4; h++) sv[h] = AB_ZERO();
        AB_RED4(sv[0], sv[1], sv[2], sv[3], sums);
        if (any) AB_STORE(al, AB_EXP2(AB_LOAD(al)));
        for (int h = 0; h < nh; h++) {
            const int g = g0 + h;
            if (bm[h] == -INFINITY) continue;
            if (bm[h] > m[g]) {
                const ab_vec va = AB_SET1(al[h]);
                float *ag = acc + (int64_t)g * Dp;
                for (int d = 0; d < Dp; d += AB_VL) AB_STORE(ag + d, AB_MUL(AB_LOAD(ag + d), va));
                l[g] *= al[h];
                m[g] = bm[h];
            }
            l[g] += sums[h];
        }
    }
}

/*
 * All blocks of one call with the row dtype dt a constant. fast: rows read
 * in place (D % AB_VL == 0; quantized: group % AB_VL == 0 and the weight
 * table fits, or half: group == AB_VL / 2); else each block's rows go
 * through the float32 tile.
 */
AB_INL void ab_run(const kvc_dtype dt, const int fast, const int half, const float *q, int G,
                   int D, int Dp, const kvc_attn_rows *r, int64_t n, float cap, float sc, float *m,
                   float *l, float *acc, float *tile) {
    static const float log2e = 1.4426950408889634f;
    float s[KVC_ATTN_MAX_G * AB_NB] __attribute__((aligned(64)));
    /* scales [key][group]: up to 2 D / AB_VL groups (half-vector groups) */
    float ksc[AB_NB * 2 * KVC_ATTN_MAX_DIM / AB_VL] __attribute__((aligned(64)));
    float vsc[AB_NB * 2 * KVC_ATTN_MAX_DIM / AB_VL] __attribute__((aligned(64)));
    float ps[AB_PS_MAX] __attribute__((aligned(64)));
    const int quant = dt == KVC_I8 || dt == KVC_I4;     /* fast path: dt is the row dtype */
    const int tq = r->dt == KVC_I8 || r->dt == KVC_I4; /* tile path: rows of r->dt */
    const int kq = fast && quant; /* scales applied here, not in a tile */
    const int ng = kq ? D / r->group : 1;
    const int nd = fast ? D : Dp;
    const int cpg = half ? 1 : nd / AB_VL / ng; /* vectors per group (half: per 2 groups) */
    const kvc_dtype sdt = fast ? dt : KVC_F32; /* dtype the register tiles read */
    for (int64_t j0 = 0; j0 < n; j0 += AB_NB) {
        const int nb = n - j0 < AB_NB ? (int)(n - j0) : AB_NB;
        /* scores */
        const char *kb;
        int64_t kst;
        if (fast) {
            kb = (const char *)r->k + j0 * r->k_stride;
            kst = r->k_stride;
            if (kq) {
                const int nbr = (nb + 3) & ~3; /* the score tile reads whole quads */
                for (int j = 0; j < nbr; j++)
                    AB_SCALEROW((const char *)r->ks + (j0 + (j < nb ? j : nb - 1)) * r->ks_stride,
                                r->ksd, ng, ksc + j * ng);
            }
        } else {
            for (int j = 0; j < nb; j++) {
                const int64_t key = j0 + j;
                if (j % 4 == 0) ab_prefetch_next(r, D, key, n);
                ab_row_to_f32((const char *)r->k + key * r->k_stride, r->dt,
                              tq ? (const char *)r->ks + key * r->ks_stride : NULL, r->ksd,
                              r->group, D, tile + j * Dp);
            }
            kb = (const char *)tile;
            kst = (int64_t)Dp * (int64_t)sizeof(float);
        }
        /* the next block (rows [0, nn) of r->nk...) as this call's keys go by:
         * key j0 + j of this call prefetches row j0 + j of the next block */
        ab_scores(sdt, kq, half, q, G, Dp, kb, kst, ksc, ng, cpg, nb, s, fast ? r : NULL, D, j0,
                  n);
        for (int g = 0; g < G; g++) {
            float *sg = s + g * AB_NB;
            if (cap > 0.0f) kvc__softcap_row(sg, nb, cap, log2e);
            for (int j = nb; j < AB_NB; j++) sg[j] = -INFINITY;
        }
        ab_softmax(G, Dp, sc, s, m, l, acc);
        /* P.V */
        const char *vb;
        int64_t vst;
        const float *pw = s;
        if (fast) {
            vb = (const char *)r->v + j0 * r->v_stride;
            vst = r->v_stride;
            if (kq) /* scales [key][group]; half: V vectors scaled in ab_pv_tile */
                for (int j = 0; j < nb; j++)
                    AB_SCALEROW((const char *)r->vs + (j0 + j) * r->vs_stride, r->vsd, ng,
                                vsc + j * ng);
            if (kq && !half) { /* ps[gi][g][j] = p[g][j] * scale[j][gi] */
                for (int j = nb * ng; j < AB_NB * ng; j++) vsc[j] = 0.0f;
                for (int gi = 0; gi < ng; gi++)
                    for (int j = 0; j < AB_NB; j += AB_VL) {
                        const ab_vec sv = AB_GATHER(vsc + j * ng + gi, ng); /* keys j.. */
                        for (int g = 0; g < G; g++)
                            AB_STORE(ps + (gi * G + g) * AB_NB + j,
                                     AB_MUL(AB_LOAD(s + g * AB_NB + j), sv));
                    }
                pw = ps;
            }
        } else {
            for (int j = 0; j < nb; j++) {
                const int64_t key = j0 + j;
                ab_row_to_f32((const char *)r->v + key * r->v_stride, r->dt,
                              tq ? (const char *)r->vs + key * r->vs_stride : NULL, r->vsd,
                              r->group, D, tile + j * Dp);
            }
            vb = (const char *)tile;
            vst = (int64_t)Dp * (int64_t)sizeof(float);
        }
        ab_pv(sdt, kq ? (half ? 2 : 1) : 0, vb, vst, nb, nd, pw, G, cpg, acc, Dp, vsc, ng);
    }
}

static void AB_NAME(const float *q, int G, int D, int Dp, const kvc_attn_rows *r, int64_t n,
                    float cap, float sc, float *m, float *l, float *acc) {
    const kvc_dtype dt = r->dt;
    const int quant = dt == KVC_I8 || dt == KVC_I4;
    const int half = quant && 2 * r->group == AB_VL && D % AB_VL == 0;
    const int fast = D % AB_VL == 0 &&
                     (!quant || half ||
                      (r->group % AB_VL == 0 && (D / r->group) * G * AB_NB <= AB_PS_MAX));
    if (!fast) {
        float tile[AB_NB * KVC_ATTN_MAX_DIM] __attribute__((aligned(64)));
        for (int j = 0; j < AB_NB; j++)
            for (int d = D; d < Dp; d++) tile[j * Dp + d] = 0.0f;
        /* rows (of r->dt) converted into the float32 tile first */
        ab_run(KVC_F32, 0, 0, q, G, D, Dp, r, n, cap, sc, m, l, acc, tile);
        return;
    }
    switch (dt) {
    case KVC_F16: ab_run(KVC_F16, 1, 0, q, G, D, Dp, r, n, cap, sc, m, l, acc, NULL); break;
    case KVC_BF16: ab_run(KVC_BF16, 1, 0, q, G, D, Dp, r, n, cap, sc, m, l, acc, NULL); break;
/* quantized rows: half a constant in each instantiation */
#define AB_RUN_Q(t)                                                                                \
    do {                                                                                           \
        if (half)                                                                                  \
            ab_run((t), 1, 1, q, G, D, Dp, r, n, cap, sc, m, l, acc, NULL);                        \
        else                                                                                       \
            ab_run((t), 1, 0, q, G, D, Dp, r, n, cap, sc, m, l, acc, NULL);                        \
    } while (0)
    case KVC_I8: AB_RUN_Q(KVC_I8); break;
    case KVC_I4: AB_RUN_Q(KVC_I4); break;
#undef AB_RUN_Q
    default: ab_run(KVC_F32, 1, 0, q, G, D, Dp, r, n, cap, sc, m, l, acc, NULL); break;
    }
}

#undef AB_PS_MAX
#undef AB_INL
#endif /* AB_VL */

#undef AB_NB
