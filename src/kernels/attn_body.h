/*
 * Decode-attention kernel body (kernels.h, attn_decode), instantiated once
 * per ISA: the including file defines the vector primitives below and
 * AB_NAME, then includes this file.
 *
 *   ab_vec, AB_VL                     vector type, float32 lanes (1, 8, 16)
 *   AB_LOAD(p) AB_STORE(p, v)         aligned enough: p is a multiple of AB_VL floats
 *   AB_ZERO() AB_SET1(x)
 *   AB_FMA(a, b, c)                   a * b + c
 *   AB_MUL(a, b) AB_HSUM(v) AB_HMAX(v)
 *   AB_EXP2(v)                        2^v for v <= 0, exactly 0 below -126
 *   ab_row_to_f32(src, dt, sc, sd, group, D, dst)   one K/V row -> D floats
 *   AB_SCORES16(q, tile, Dp, out)     optional: out[j] = q . tile[j] for 16 rows
 *
 * Keys go in blocks of AB_NB: the block's K rows are converted to float32
 * (in a small stack tile: the cache is read once and never copied whole),
 * G scores per key, one online-softmax rescale per block and head, then the
 * block's V rows are converted and accumulated with the accumulator held in
 * registers across the block's keys.
 */
#define AB_NB 16

static void AB_NAME(const float *q, int G, int D, int Dp, const kvc_attn_rows *r, int64_t n,
                    float cap, float *m, float *l, float *acc) {
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
#ifdef AB_SCORES16
            if (nb == AB_NB) { /* a full block: 16 dot products, one transposed reduction */
                AB_SCORES16(qg, tile, Dp, s + g * AB_NB);
                if (cap > 0.0f)
                    for (int j = 0; j < nb; j++)
                        s[g * AB_NB + j] = cap * tanhf(s[g * AB_NB + j] / cap) * log2e;
                continue;
            }
#endif
            for (int j = 0; j < nb; j++) {
                const float *kr = tile + j * Dp;
                ab_vec a0 = AB_ZERO(), a1 = AB_ZERO();
                int d = 0;
                for (; d + 2 * AB_VL <= Dp; d += 2 * AB_VL) {
                    a0 = AB_FMA(AB_LOAD(qg + d), AB_LOAD(kr + d), a0);
                    a1 = AB_FMA(AB_LOAD(qg + d + AB_VL), AB_LOAD(kr + d + AB_VL), a1);
                }
                for (; d < Dp; d += AB_VL) a0 = AB_FMA(AB_LOAD(qg + d), AB_LOAD(kr + d), a0);
                float x = AB_HSUM(a0) + AB_HSUM(a1);
                if (cap > 0.0f) x = cap * tanhf(x / cap) * log2e;
                s[g * AB_NB + j] = x;
            }
            for (int j = nb; j < AB_NB; j++) s[g * AB_NB + j] = -INFINITY;
        }
        /* online softmax: one rescale per head and block */
        for (int g = 0; g < G; g++) {
            float *sg = s + g * AB_NB;
            ab_vec mx = AB_LOAD(sg);
            for (int j = AB_VL; j < AB_NB; j += AB_VL) mx = AB_MAX(mx, AB_LOAD(sg + j));
            const float bm = AB_HMAX(mx);
            const float mn = bm > m[g] ? bm : m[g];
            if (mn == -INFINITY) { /* no finite score yet: nothing to add */
                for (int j = 0; j < AB_NB; j++) sg[j] = 0.0f;
                continue;
            }
            const ab_vec vm = AB_SET1(mn);
            ab_vec sum = AB_ZERO();
            for (int j = 0; j < AB_NB; j += AB_VL) {
                ab_vec p = AB_EXP2(AB_SUB(AB_LOAD(sg + j), vm));
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

#undef AB_NB
