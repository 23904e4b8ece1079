/*
 * MLA task body (mla.h), instantiated once per ISA: the including file
 * defines the primitives below and MB_NAME, then includes this file.
 *
 *   mb_vec, MB_VL                    vector type, float32 lanes (1, 8, 16)
 *   MB_LOAD(p) MB_STORE(p, v)        unaligned
 *   MB_ZERO() MB_SET1(x) MB_ADD MB_SUB MB_MUL MB_MAX
 *   MB_FMA(a, b, c)                  a * b + c
 *   MB_FFMA(a, b, c)                 a * b + c with one rounding (fused on every ISA)
 *   MB_HSUM(v) MB_HMAX(v)            horizontal sum / max
 *   MB_EXP2(v)                       2^v for v <= 0 (-inf gives 0)
 *   MB_PV_C                          vectors per row in the P.V register block
 *   mb_scores(q, Dq, tile, nk, s)    s[r * KVC_MLA_NB + j] = q_r . tile_j for
 *                                    r < KVC_MLA_RB, j < nk (a multiple of 4)
 *
 * Why this shape: per key, MLA does Hq * (2 * D_ckv + D_kpe) multiply-adds
 * on D_ckv + D_kpe stored elements, so even at Hq = 16 it is compute-bound
 * on a CPU. A block of KVC_MLA_NB keys is converted to float32 once (a
 * stack tile of up to 80 KiB, L2-resident; 32 keys measured ~15% faster
 * than 16 or 8 on Zen 4: fewer accumulator passes per key) and then serves
 * every query row: scores for KVC_MLA_RB rows x 4 keys at a time (16 dot
 * products sharing their loads), one online-softmax step per row and
 * block, then P.V with a KVC_MLA_RB x MB_PV_C register block of the
 * accumulator, rescaled (by 2^(m_old - m_new)) while it is loaded. The
 * cache is read from memory once per task.
 */
#include "vec_math.h"
#define MB_NB KVC_MLA_NB
#define MB_RB KVC_MLA_RB

/* Last key row r may see (-1: none); padding rows see nothing. */
static inline int64_t mb_row_lim(const kvc_mla_task *t, int64_t r) {
    if (r >= t->real_rows) return -1;
    return t->causal ? r / t->Hq + t->kv_len - t->qo_len : t->kv_len - 1;
}

/* Keys [jb, jb + n) -> tile rows (ckv then kpe, float32, Dq apart); then
 * prefetches the rows of keys [jb + n, jb + n + pf). */
static void mb_load_block(const kvc_mla_task *t, int64_t jb, int n, int64_t pf, float *tile) {
    const int Dq = t->Dc + t->Dk;
    for (int i = 0; i < n; i++) {
        const int64_t j = jb + i, page = t->pages[j / t->page_size], slot = j % t->page_size;
        const char *c =
            t->ckv + kvc__bytes(t->ckv_dt, page * t->ckv_page_st + slot * t->ckv_tok_st);
        t->convert(c, t->ckv_dt, tile + (int64_t)i * Dq, KVC_F32, t->Dc);
        if (t->Dk > 0) {
            const char *k =
                t->kpe + kvc__bytes(t->kpe_dt, page * t->kpe_page_st + slot * t->kpe_tok_st);
            t->convert(k, t->kpe_dt, tile + (int64_t)i * Dq + t->Dc, KVC_F32, t->Dk);
        }
    }
    /* The next block's rows, one prefetch per cache line: the hardware
     * prefetchers lose the stream at page boundaries (pages are anywhere). */
    const int64_t crow = kvc__bytes(t->ckv_dt, t->Dc), krow = kvc__bytes(t->kpe_dt, t->Dk);
    for (int64_t j = jb + n; j < jb + n + pf; j++) {
        const int64_t page = t->pages[j / t->page_size], slot = j % t->page_size;
        const char *c =
            t->ckv + kvc__bytes(t->ckv_dt, page * t->ckv_page_st + slot * t->ckv_tok_st);
        for (int64_t o = 0; o < crow; o += 64) __builtin_prefetch(c + o, 0, 3);
        __builtin_prefetch(c + crow - 1, 0, 3);
        if (krow > 0) {
            const char *k =
                t->kpe + kvc__bytes(t->kpe_dt, page * t->kpe_page_st + slot * t->kpe_tok_st);
            for (int64_t o = 0; o < krow; o += 64) __builtin_prefetch(k + o, 0, 3);
            __builtin_prefetch(k + krow - 1, 0, 3);
        }
    }
}

/*
 * One online-softmax step for the KVC_MLA_RB rows at m, l: s (RB, NB) scores
 * in (base 2 after * sc, mla.h), probabilities 2^(s sc - m_new) out (0 for
 * keys j >= nv[r]);
 * alpha[r] = 2^(m_old - m_new), the factor the row's accumulator needs.
 */
static inline void mb_softmax(float *s, const int *nv, float cap, float sc, float *m, float *l,
                              float *alpha) {
    static const float log2e = 1.4426950408889634f;
    for (int r = 0; r < MB_RB; r++) {
        float *sr = s + r * MB_NB;
        if (cap > 0.0f && nv[r] > 0) kvc__softcap_row(sr, nv[r], cap, log2e);
        for (int j = nv[r] > 0 ? nv[r] : 0; j < MB_NB; j++) sr[j] = -INFINITY;
        mb_vec mx = MB_LOAD(sr);
        for (int j = MB_VL; j < MB_NB; j += MB_VL) mx = MB_MAX(mx, MB_LOAD(sr + j));
        const float bm = MB_HMAX(mx) * sc; /* the raw max to base 2 */
        const float mn = bm > m[r] ? bm : m[r];
        alpha[r] = 1.0f;
        if (mn == -INFINITY) { /* nothing visible yet: p = 0, state unchanged */
            for (int j = 0; j < MB_NB; j++) sr[j] = 0.0f;
            continue;
        }
        const mb_vec vm = MB_SET1(-mn), vs = MB_SET1(sc);
        mb_vec sum = MB_ZERO();
        for (int j = 0; j < MB_NB; j += MB_VL) {
            const mb_vec p = MB_EXP2(MB_FFMA(MB_LOAD(sr + j), vs, vm)); /* 2^(s sc - m) */
            MB_STORE(sr + j, p);
            sum = MB_ADD(sum, p);
        }
        if (mn > m[r]) {
            alpha[r] = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - mn);
            l[r] *= alpha[r];
            m[r] = mn;
        }
        l[r] += MB_HSUM(sum);
    }
}

/* acc (RB, Dc) = alpha * acc + p (RB, NB) . tile rows [0, n) (ckv part). */
static inline void mb_pv(float *acc, int Dc, const float *tile, int Dq, const float *p, int n,
                         const float *alpha) {
    mb_vec al[MB_RB];
    for (int r = 0; r < MB_RB; r++) al[r] = MB_SET1(alpha[r]);
    int d = 0;
    for (; d + MB_PV_C * MB_VL <= Dc; d += MB_PV_C * MB_VL) {
        mb_vec a[MB_RB][MB_PV_C];
        for (int r = 0; r < MB_RB; r++)
            for (int c = 0; c < MB_PV_C; c++)
                a[r][c] = MB_MUL(MB_LOAD(acc + (int64_t)r * Dc + d + c * MB_VL), al[r]);
        for (int j = 0; j < n; j++) {
            const float *v = tile + (int64_t)j * Dq + d;
            mb_vec vv[MB_PV_C];
            for (int c = 0; c < MB_PV_C; c++) vv[c] = MB_LOAD(v + c * MB_VL);
            for (int r = 0; r < MB_RB; r++) {
                const mb_vec pr = MB_SET1(p[r * MB_NB + j]);
                for (int c = 0; c < MB_PV_C; c++) a[r][c] = MB_FMA(pr, vv[c], a[r][c]);
            }
        }
        for (int r = 0; r < MB_RB; r++)
            for (int c = 0; c < MB_PV_C; c++)
                MB_STORE(acc + (int64_t)r * Dc + d + c * MB_VL, a[r][c]);
    }
    for (; d < Dc; d += MB_VL) { /* Dc not a multiple of the block */
        mb_vec a[MB_RB];
        for (int r = 0; r < MB_RB; r++) a[r] = MB_MUL(MB_LOAD(acc + (int64_t)r * Dc + d), al[r]);
        for (int j = 0; j < n; j++) {
            const mb_vec v = MB_LOAD(tile + (int64_t)j * Dq + d);
            for (int r = 0; r < MB_RB; r++) a[r] = MB_FMA(MB_SET1(p[r * MB_NB + j]), v, a[r]);
        }
        for (int r = 0; r < MB_RB; r++) MB_STORE(acc + (int64_t)r * Dc + d, a[r]);
    }
}

void MB_NAME(const kvc_mla_task *t) {
    const int Dc = t->Dc, Dq = t->Dc + t->Dk;
    float tile[MB_NB * (KVC_MLA_MAX_CKV + KVC_MLA_MAX_KPE)] __attribute__((aligned(64)));
    float s[MB_RB * MB_NB] __attribute__((aligned(64)));
    float alpha[MB_RB];
    int nv[MB_RB];
    /* Rows past a short last block are scored (then masked): keep them finite. */
    memset(tile, 0, sizeof(float) * (size_t)(MB_NB * Dq));
    for (int64_t jb = t->j0; jb < t->j1; jb += MB_NB) {
        const int n = t->j1 - jb < MB_NB ? (int)(t->j1 - jb) : MB_NB;
        int64_t pf = t->j1 - (jb + n);
        if (pf > MB_NB) pf = MB_NB;
        mb_load_block(t, jb, n, pf, tile);
        const int nk = (n + 3) & ~3;
        for (int64_t r0 = 0; r0 < t->rows; r0 += MB_RB) {
            int any = 0;
            for (int r = 0; r < MB_RB; r++) {
                int64_t v = mb_row_lim(t, r0 + r) - jb + 1;
                nv[r] = v <= 0 ? 0 : v >= n ? n : (int)v;
                any |= nv[r];
            }
            if (!any) continue; /* causal: the block lies past these rows */
            mb_scores(t->q + r0 * Dq, Dq, tile, nk, s);
            mb_softmax(s, nv, t->cap, t->sc, t->m + r0, t->l + r0, alpha);
            mb_pv(t->acc + r0 * Dc, Dc, tile, Dq, s, n, alpha);
        }
    }
}

#undef MB_NB
#undef MB_RB
