/*
 * MLA decode (mla.h) against a plain double-precision reference written from
 * the math in the header (SEMANTICS 5), on the values as stored: every ISA,
 * 1 and 2 threads bitwise identical, batches with empty/one-key/long
 * requests, page sizes 1/5/64 with shuffled pages, Hq 1/16/128, D_ckv
 * 512/128, D_kpe 64/32/0, all storage/q/out dtypes, causal qo_len > 1
 * (including qo_len > kv_len), soft cap, large logits, strided and combined
 * tensors, and rejected inputs (nothing written).
 *
 * Unused cache slots and pages hold NaN: reading one would poison the output.
 */
#include <stdlib.h>

#include "test_elems.h"

/* ---- cases
 * ------------------------------------------------------------------- */

typedef struct mla_case {
    int64_t B;
    const int32_t *kv_lens, *qo_lens; /* (B); qo_lens NULL: all 1 */
    int64_t Hq, Dc, Dk, ps;
    kvc_dtype cd, kd, qd, od; /* ckv, kpe, q (nope and pe), out */
    int causal;
    float cap, sm_scale; /* sm_scale 0: 1/sqrt(192) */
    float qmag;          /* query magnitude (0: 1) */
    int combined;        /* ckv/kpe: slices of one (P, ps, Dc + Dk) tensor */
    int pad;             /* q/out heads padded: non-contiguous rows */
    double tol;          /* 0: from the dtypes */
} mla_case;

static mla_case base_case(void) {
    mla_case c;
    memset(&c, 0, sizeof c);
    static const int32_t one[1] = {37};
    c.B = 1;
    c.kv_lens = one;
    c.Hq = 16;
    c.Dc = 128;
    c.Dk = 32;
    c.ps = 5;
    c.cd = c.kd = KVC_F16;
    c.qd = c.od = KVC_F32;
    return c;
}

static double case_tol(const mla_case *c) {
    if (c->tol > 0) return c->tol;
    if (c->od == KVC_BF16) return 1e-2;
    if (c->od == KVC_F16) return 1e-3;
    return 2e-5;
}

/* Everything one case allocates. */
typedef struct mla_bufs {
    int32_t *qo_indptr, *kv_indptr, *kv_indices, *kv_len;
    void *ckv, *kpe, *qn, *qp, *o1, *o2;
    float *l1, *l2;
    double *ro, *rl;
} mla_bufs;

static void free_bufs(mla_bufs *m) {
    free(m->qo_indptr), free(m->kv_indptr), free(m->kv_indices), free(m->kv_len);
    free(m->ckv), free(m->kpe), free(m->qn), free(m->qp), free(m->o1), free(m->o2);
    free(m->l1), free(m->l2), free(m->ro), free(m->rl);
}

/* ---- reference
 * ------------------------------------------------------------------ */

/* Element (page, slot, d) of a 3-D cache tensor as a double. */
static double cache_at(const kvc_tensor *t, int64_t page, int64_t slot, int64_t d) {
    return get_f(t->data, t->dtype, page * t->stride[0] + slot * t->stride[1] + d);
}

static double q_at(const kvc_tensor *t, int64_t n, int64_t h, int64_t d) {
    return get_f(t->data, t->dtype, n * t->stride[0] + h * t->stride[1] + d);
}

/* ro (N, Hq, Dc), rl (N, Hq): the math of mla.h in double. */
static void reference(const mla_case *c, const mla_bufs *m, const kvc_tensor *qn,
                      const kvc_tensor *qp, const kvc_tensor *ckv, const kvc_tensor *kpe,
                      double *ro, double *rl) {
    const double sc = c->sm_scale > 0 ? c->sm_scale : 1.0 / sqrt(192.0);
    int64_t maxlen = 1;
    for (int64_t b = 0; b < c->B; b++)
        if (c->kv_lens[b] > maxlen) maxlen = c->kv_lens[b];
    double *s = malloc(sizeof(double) * (size_t)maxlen);
    for (int64_t b = 0; b < c->B; b++) {
        const int64_t L = c->kv_lens[b], qo = m->qo_indptr[b + 1] - m->qo_indptr[b];
        const int32_t *pages = m->kv_indices + m->kv_indptr[b];
        for (int64_t i = 0; i < qo; i++) {
            const int64_t n = m->qo_indptr[b] + i;
            const int64_t last = c->causal ? i + L - qo : L - 1; /* keys [0, last] */
            for (int64_t h = 0; h < c->Hq; h++) {
                double mx = -INFINITY;
                for (int64_t j = 0; j <= last; j++) {
                    const int64_t pg = pages[j / c->ps], sl = j % c->ps;
                    double x = 0;
                    for (int64_t d = 0; d < c->Dc; d++)
                        x += q_at(qn, n, h, d) * cache_at(ckv, pg, sl, d);
                    for (int64_t d = 0; d < c->Dk; d++)
                        x += q_at(qp, n, h, d) * cache_at(kpe, pg, sl, d);
                    x *= sc;
                    if (c->cap > 0) x = c->cap * tanh(x / c->cap);
                    s[j] = x;
                    if (x > mx) mx = x;
                }
                double sum = 0;
                for (int64_t j = 0; j <= last; j++) sum += exp(s[j] - mx);
                double *o = ro + (n * c->Hq + h) * c->Dc;
                for (int64_t d = 0; d < c->Dc; d++) {
                    double acc = 0;
                    for (int64_t j = 0; j <= last; j++)
                        acc += exp(s[j] - mx) * cache_at(ckv, pages[j / c->ps], j % c->ps, d);
                    o[d] = sum > 0 ? acc / sum : 0.0;
                }
                rl[n * c->Hq + h] = sum > 0 ? (mx + log(sum)) / log(2.0) : -INFINITY;
            }
        }
    }
    free(s);
}

/* ---- runner
 * --------------------------------------------------------------------- */

static int compare(const mla_case *c, const void *out, kvc_dtype od, const kvc_tensor *to,
                   const float *lse, const double *ro, const double *rl, int64_t N,
                   const char *what) {
    const double tol = case_tol(c);
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < c->Hq; h++) {
            for (int64_t d = 0; d < c->Dc; d++) {
                const double g = get_f(out, od, n * to->stride[0] + h * to->stride[1] + d);
                const double r = ro[(n * c->Hq + h) * c->Dc + d];
                if (!(fabs(g - r) <= tol * (1.0 + fabs(r))))
                    TEST_FAIL_("%s: out[%lld, %lld, %lld] %.9g vs ref %.9g (tol %g)", what,
                               (long long)n, (long long)h, (long long)d, g, r, tol);
            }
            const double g = lse[n * c->Hq + h], r = rl[n * c->Hq + h];
            if (isinf(r)) {
                if (!(isinf(g) && g < 0))
                    TEST_FAIL_("%s: lse[%lld, %lld] %g, want -inf", what, (long long)n,
                               (long long)h, g);
            } else if (!(fabs(g - r) <= (c->tol > 0 ? c->tol : 1e-5) * (1.0 + fabs(r)))) {
                TEST_FAIL_("%s: lse[%lld, %lld] %.9g vs ref %.9g", what, (long long)n, (long long)h,
                           g, r);
            }
        }
    return 0;
}

/* Builds the batch of case c (shuffled pages, NaN in every unused slot),
 * runs it with 1 and 2 threads and checks both against the reference. */
static int run_case(const mla_case *c, uint64_t seed) {
    const int64_t B = c->B, Hq = c->Hq, Dc = c->Dc, Dk = c->Dk, ps = c->ps;
    const kvc_dtype kd = c->combined ? c->cd : c->kd;
    uint64_t rng = seed;
    mla_bufs m;
    memset(&m, 0, sizeof m);
    m.qo_indptr = calloc((size_t)B + 1, 4);
    m.kv_indptr = calloc((size_t)B + 1, 4);
    m.kv_len = calloc((size_t)B + 1, 4);
    for (int64_t b = 0; b < B; b++) {
        m.qo_indptr[b + 1] = m.qo_indptr[b] + (c->qo_lens ? c->qo_lens[b] : 1);
        m.kv_indptr[b + 1] = m.kv_indptr[b] + (int32_t)((c->kv_lens[b] + ps - 1) / ps);
        m.kv_len[b] = c->kv_lens[b];
    }
    const int64_t N = m.qo_indptr[B], used = m.kv_indptr[B], P = used + 3;
    m.kv_indices = calloc((size_t)P + 1, 4);
    int32_t *perm = calloc((size_t)P, 4);
    for (int64_t i = 0; i < P; i++) perm[i] = (int32_t)i;
    for (int64_t i = P - 1; i > 0; i--) {
        const int64_t j = (int64_t)(test_rng_next(&rng) % (uint64_t)(i + 1));
        const int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    memcpy(m.kv_indices, perm, (size_t)used * 4);
    /* caches: NaN everywhere, then the live slots */
    const int64_t row = c->combined ? Dc + Dk : 0;
    const int64_t cst = c->combined ? row : Dc, kst = c->combined ? row : Dk;
    const int64_t ncache = c->combined ? P * ps * row : P * ps * Dc;
    m.ckv = calloc(1, dt_bytes(c->cd, ncache) + 16);
    m.kpe = calloc(1, dt_bytes(kd, P * ps * Dk) + 16);
    for (int64_t i = 0; i < ncache; i++) set_f(m.ckv, c->cd, i, NAN);
    for (int64_t i = 0; i < P * ps * Dk; i++) set_f(m.kpe, kd, i, NAN);
    int64_t csh[3] = {P, ps, Dc}, ksh[3] = {P, ps, Dk};
    kvc_tensor tckv = kvc_tensor_make(m.ckv, c->cd, 3, csh);
    kvc_tensor tkpe = kvc_tensor_make(
        c->combined ? (void *)((char *)m.ckv + dt_bytes(c->cd, Dc)) : m.kpe, kd, 3, ksh);
    tckv.stride[0] = ps * cst, tckv.stride[1] = cst;
    tkpe.stride[0] = ps * kst, tkpe.stride[1] = kst;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < c->kv_lens[b]; j++) {
            const int64_t pg = m.kv_indices[m.kv_indptr[b] + j / ps], sl = j % ps;
            for (int64_t d = 0; d < Dc; d++)
                set_f(tckv.data, c->cd, pg * tckv.stride[0] + sl * tckv.stride[1] + d,
                      test_rng_f32(&rng));
            for (int64_t d = 0; d < Dk; d++)
                set_f(tkpe.data, kd, pg * tkpe.stride[0] + sl * tkpe.stride[1] + d,
                      test_rng_f32(&rng));
        }
    /* queries and outputs, heads padded by `pad` elements when asked */
    const int64_t pad = c->pad ? 8 : 0;
    const int64_t nq = N * Hq * (Dc + pad), np = N * Hq * (Dk + pad);
    m.qn = calloc(1, dt_bytes(c->qd, nq) + 16);
    m.qp = calloc(1, dt_bytes(c->qd, np) + 16);
    m.o1 = calloc(1, dt_bytes(c->od, nq) + 16);
    m.o2 = calloc(1, dt_bytes(c->od, nq) + 16);
    m.l1 = calloc((size_t)(N * Hq + 1), sizeof(float));
    m.l2 = calloc((size_t)(N * Hq + 1), sizeof(float));
    m.ro = calloc((size_t)(N * Hq * Dc + 1), sizeof(double));
    m.rl = calloc((size_t)(N * Hq + 1), sizeof(double));
    fill_random(m.qn, c->qd, nq, &rng, c->qmag > 0 ? c->qmag : 1.0f);
    fill_random(m.qp, c->qd, np, &rng, c->qmag > 0 ? c->qmag : 1.0f);
    int64_t qsh[3] = {N, Hq, Dc}, psh[3] = {N, Hq, Dk}, lsh[2] = {N, Hq};
    kvc_tensor tqn = kvc_tensor_make(m.qn, c->qd, 3, qsh),
               tqp = kvc_tensor_make(m.qp, c->qd, 3, psh);
    kvc_tensor to1 = kvc_tensor_make(m.o1, c->od, 3, qsh),
               to2 = kvc_tensor_make(m.o2, c->od, 3, qsh);
    tqn.stride[0] = Hq * (Dc + pad), tqn.stride[1] = Dc + pad;
    tqp.stride[0] = Hq * (Dk + pad), tqp.stride[1] = Dk + pad;
    to1.stride[0] = to2.stride[0] = Hq * (Dc + pad);
    to1.stride[1] = to2.stride[1] = Dc + pad;
    kvc_tensor tl1 = kvc_tensor_make(m.l1, KVC_F32, 2, lsh),
               tl2 = kvc_tensor_make(m.l2, KVC_F32, 2, lsh);
    int64_t nb = B, nb1 = B + 1, nidx = P;
    kvc_tensor tqo = kvc_tensor_make(m.qo_indptr, KVC_I32, 1, &nb1);
    kvc_tensor tkvp = kvc_tensor_make(m.kv_indptr, KVC_I32, 1, &nb1);
    kvc_tensor tidx = kvc_tensor_make(m.kv_indices, KVC_I32, 1, &nidx); /* longer than used */
    kvc_tensor tlen = kvc_tensor_make(m.kv_len, KVC_I32, 1, &nb);
    reference(c, &m, &tqn, &tqp, &tckv, &tkpe, m.ro, m.rl);

    char what[200];
    snprintf(what, sizeof what,
             "isa %s B %lld Hq %lld Dc %lld Dk %lld ps %lld ckv %s kpe %s q %s "
             "out %s causal %d "
             "cap %g comb %d pad %d",
             kvc_isa_name(kvc_get_isa()), (long long)B, (long long)Hq, (long long)Dc, (long long)Dk,
             (long long)ps, kvc_dtype_name(c->cd), kvc_dtype_name(kd), kvc_dtype_name(c->qd),
             kvc_dtype_name(c->od), c->causal, c->cap, c->combined, c->pad);
    int rc = 0;
    kvc_mla_plan *plan = NULL;
    const float sm = c->sm_scale > 0 ? c->sm_scale : (float)(1.0 / sqrt(192.0));
    kvc_status st = kvc_mla_plan_create(&tqo, &tkvp, &tidx, &tlen, (int32_t)Hq, (int32_t)Dc,
                                        (int32_t)Dk, (int32_t)ps, c->causal, sm, c->cap, &plan);
    if (st == KVC_OK)
        st = kvc_mla_run(plan, &tqn, Dk ? &tqp : NULL, &tckv, Dk ? &tkpe : NULL, &to1, &tl1,
                         test_pool(1));
    if (st != KVC_OK) {
        fprintf(stderr, "  %s: %s\n", what, kvc_last_error());
        rc = 1;
    }
    if (!rc) rc = compare(c, m.o1, c->od, &to1, m.l1, m.ro, m.rl, N, what);
    if (!rc) {
        st = kvc_mla_run(plan, &tqn, Dk ? &tqp : NULL, &tckv, Dk ? &tkpe : NULL, &to2, &tl2,
                         test_pool(2));
        if (st != KVC_OK || memcmp(m.o1, m.o2, dt_bytes(c->od, nq)) != 0 ||
            memcmp(m.l1, m.l2, (size_t)(N * Hq) * sizeof(float)) != 0) {
            fprintf(stderr, "  %s: 2 threads differ from 1 thread (%s)\n", what,
                    st == KVC_OK ? "ok" : kvc_last_error());
            rc = 1;
        }
    }
    kvc_mla_plan_destroy(plan);
    free(perm);
    free_bufs(&m);
    return rc;
}

/* ---- tests
 * -------------------------------------------------------------------- */

/* Shapes: Hq x (D_ckv, D_kpe) x page size over a batch with an empty, a
 * one-key, a short and a multi-chunk (> 256 keys) request. */
TEST(shapes) {
    static const int32_t lens[4] = {0, 1, 17, 300};
    static const int64_t hqs[3] = {1, 16, 128}, pss[3] = {1, 5, 64};
    static const int64_t dims[2][2] = {{512, 64}, {128, 32}};
    int rc = 0;
    FOR_EACH_ISA({
        for (int hi = 0; hi < 3 && !rc; hi++)
            for (int di = 0; di < 2 && !rc; di++)
                for (int pi = 0; pi < 3 && !rc; pi++) {
                    if (hqs[hi] == 128 && (di != 0 || pi != 2)) continue; /* the big one once */
                    mla_case c = base_case();
                    c.B = 4;
                    c.kv_lens = lens;
                    c.Hq = hqs[hi];
                    c.Dc = dims[di][0];
                    c.Dk = dims[di][1];
                    c.ps = pss[pi];
                    rc = run_case(&c, test_seed + (uint64_t)(hi * 9 + di * 3 + pi));
                }
        if (rc) return rc;
    });
    return 0;
}

/* Storage, q and out dtypes (ckv and kpe may differ). */
TEST(dtypes) {
    static const int32_t lens[3] = {1, 40, 300};
    static const kvc_dtype combos[][4] = {
        {KVC_F32, KVC_F32, KVC_F32, KVC_F32},     {KVC_F16, KVC_F16, KVC_F16, KVC_F16},
        {KVC_BF16, KVC_BF16, KVC_BF16, KVC_BF16}, {KVC_BF16, KVC_F32, KVC_F16, KVC_F32},
        {KVC_F16, KVC_BF16, KVC_F32, KVC_BF16},   {KVC_F32, KVC_F16, KVC_BF16, KVC_F16},
        {KVC_BF16, KVC_BF16, KVC_F32, KVC_F32},
    };
    int rc = 0;
    FOR_EACH_ISA({
        for (size_t i = 0; i < sizeof combos / sizeof combos[0] && !rc; i++) {
            mla_case c = base_case();
            c.B = 3;
            c.kv_lens = lens;
            c.cd = combos[i][0];
            c.kd = combos[i][1];
            c.qd = combos[i][2];
            c.od = combos[i][3];
            rc = run_case(&c, test_seed + 100 + i);
        }
        if (rc) return rc;
    });
    return 0;
}

/* qo_len > 1 with causal (speculative verification), including qo_len >
 * kv_len (fully masked rows) and an empty request; and without causal. */
TEST(causal_multi_token) {
    static const int32_t kv[5] = {7, 300, 2, 0, 64}, qo[5] = {3, 5, 4, 2, 1};
    int rc = 0;
    FOR_EACH_ISA({
        for (int causal = 0; causal < 2 && !rc; causal++)
            for (int hi = 0; hi < 2 && !rc; hi++) {
                mla_case c = base_case();
                c.B = 5;
                c.kv_lens = kv;
                c.qo_lens = qo;
                c.causal = causal;
                c.Hq = hi ? 16 : 3;
                c.ps = hi ? 64 : 1;
                rc = run_case(&c, test_seed + 200 + (uint64_t)(causal * 2 + hi));
            }
        if (rc) return rc;
    });
    return 0;
}

/* Long requests: many chunks merged by log-sum-exp; DeepSeek dims. */
TEST(long_context) {
    static const int32_t kv1[1] = {5000}, kv2[3] = {2100, 0, 777};
    int rc = 0;
    FOR_EACH_ISA({
        mla_case c = base_case();
        c.kv_lens = kv1;
        c.Dc = 512;
        c.Dk = 64;
        c.ps = 64;
        c.Hq = 16;
        c.od = KVC_F16;
        rc = run_case(&c, test_seed + 300);
        if (rc) return rc;
        c.B = 3;
        c.kv_lens = kv2;
        c.Hq = 5;
        c.ps = 5;
        c.od = KVC_F32;
        c.cd = c.kd = KVC_BF16;
        rc = run_case(&c, test_seed + 301);
        if (rc) return rc;
    });
    return 0;
}

/* Soft cap, large logits (softmax stability), a custom sm_scale. */
TEST(cap_and_large_logits) {
    static const int32_t lens[2] = {33, 300};
    int rc = 0;
    FOR_EACH_ISA({
        mla_case c = base_case();
        c.B = 2;
        c.kv_lens = lens;
        c.cap = 5.0f;
        c.qmag = 8.0f;
        rc = run_case(&c, test_seed + 400);
        if (rc) return rc;
        c.cap = 0.0f;
        c.qmag = 30.0f; /* |s| up to ~100: most keys underflow to 0 */
        c.sm_scale = 0.5f;
        c.tol = 2e-4; /* absolute score error ~1e-5 of |s|, times 2^s */
        rc = run_case(&c, test_seed + 401);
        if (rc) return rc;
    });
    return 0;
}

/* NoPE (D_kpe 0, NULL q_pe/kpe), ckv/kpe slices of one tensor, padded q/out. */
TEST(layouts) {
    static const int32_t lens[3] = {5, 0, 260};
    int rc = 0;
    FOR_EACH_ISA({
        mla_case c = base_case();
        c.B = 3;
        c.kv_lens = lens;
        c.Dk = 0;
        rc = run_case(&c, test_seed + 500);
        if (rc) return rc;
        c.Dk = 64;
        c.Dc = 512;
        c.combined = 1;
        c.pad = 1;
        c.cd = KVC_BF16;
        c.qd = KVC_BF16;
        rc = run_case(&c, test_seed + 501);
        if (rc) return rc;
        c.Dc = 48; /* a multiple of 16 that is not one of the 4-vector blocks */
        c.Dk = 16;
        c.combined = 0;
        rc = run_case(&c, test_seed + 502);
        if (rc) return rc;
    });
    return 0;
}

/* Empty batch and qo_len-0 requests. */
TEST(empty) {
    int32_t z[2] = {0, 0}, len[1] = {0};
    int64_t one = 1, two = 2;
    kvc_tensor qo = kvc_tensor_make(z, KVC_I32, 1, &one), kvp = qo;
    kvc_tensor idx = kvc_tensor_make(z, KVC_I32, 1, &one);
    int64_t zero = 0;
    kvc_tensor tlen = kvc_tensor_make(len, KVC_I32, 1, &zero);
    kvc_mla_plan *plan = NULL;
    ASSERT_OK(kvc_mla_plan_create(&qo, &kvp, &idx, &tlen, 16, 128, 32, 16, 1, 0.1f, 0.0f, &plan));
    ASSERT_EQ_I64(kvc_mla_plan_tasks(plan), 0);
    int64_t qsh[3] = {0, 16, 128}, psh[3] = {0, 16, 32}, csh[3] = {1, 16, 128},
            ksh[3] = {1, 16, 32};
    uint16_t cache[16 * 128];
    kvc_tensor tq = kvc_tensor_make(NULL, KVC_F32, 3, qsh),
               tp = kvc_tensor_make(NULL, KVC_F32, 3, psh);
    kvc_tensor tc = kvc_tensor_make(cache, KVC_F16, 3, csh),
               tk = kvc_tensor_make(cache, KVC_F16, 3, ksh);
    kvc_tensor to = kvc_tensor_make(NULL, KVC_F32, 3, qsh);
    ASSERT_OK(kvc_mla_run(plan, &tq, &tp, &tc, &tk, &to, NULL, test_pool(2)));
    kvc_mla_plan_destroy(plan);
    /* one request with qo_len 0 and 3 keys next to a normal one */
    static const int32_t kv[2] = {3, 9}, qol[2] = {0, 2};
    (void)two;
    int rc = 0;
    FOR_EACH_ISA({
        mla_case c = base_case();
        c.B = 2;
        c.kv_lens = kv;
        c.qo_lens = qol;
        c.causal = 1;
        rc = run_case(&c, test_seed + 600);
        if (rc) return rc;
    });
    kvc_mla_plan_destroy(NULL);
    return 0;
}

/* The chunk length depends on the batch only, and grows with it. */
TEST(plan_chunks) {
    int32_t indptr[3] = {0, 1, 2}, kvp[3], len[2], *idx = calloc(1 << 16, 4);
    for (int i = 0; i < (1 << 16); i++) idx[i] = i;
    int64_t n3 = 3, n2 = 2, ni = 1 << 16;
    kvc_tensor tqo = kvc_tensor_make(indptr, KVC_I32, 1, &n3),
               tkvp = kvc_tensor_make(kvp, KVC_I32, 1, &n3);
    kvc_tensor tidx = kvc_tensor_make(idx, KVC_I32, 1, &ni),
               tlen = kvc_tensor_make(len, KVC_I32, 1, &n2);
    static const int32_t lens[][2] = {{10, 20}, {300, 0}, {16384, 16384}, {100000, 3}};
    static const int64_t chunks[] = {256, 256, 512, 1792};
    int rc = 0;
    for (int i = 0; i < 4 && !rc; i++) {
        len[0] = lens[i][0];
        len[1] = lens[i][1];
        kvp[0] = 0;
        kvp[1] = (len[0] + 63) / 64;
        kvp[2] = kvp[1] + (len[1] + 63) / 64;
        kvc_mla_plan *plan = NULL;
        kvc_status st =
            kvc_mla_plan_create(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f, &plan);
        if (st != KVC_OK) {
            fprintf(stderr, "  %s\n", kvc_last_error());
            rc = 1;
        } else if (kvc_mla_plan_chunk(plan) != chunks[i]) {
            fprintf(stderr, "  lens %d/%d: chunk %lld, want %lld\n", lens[i][0], lens[i][1],
                    (long long)kvc_mla_plan_chunk(plan), (long long)chunks[i]);
            rc = 1;
        }
        kvc_mla_plan_destroy(plan);
    }
    free(idx);
    return rc;
}

/* ---- errors
 * -------------------------------------------------------------------- */

/* st, or KVC_ERR_INTERNAL if the call failed without leaving *plan NULL (core.h). */
static kvc_status mla_plan_null_on_error(kvc_status st, kvc_mla_plan *const *plan) {
    return st != KVC_OK && *plan != NULL ? KVC_ERR_INTERNAL : st;
}

TEST(plan_errors) {
    int32_t qo[3] = {0, 1, 2}, kvp[3] = {0, 2, 3}, idx[4] = {0, 1, 2, 3}, len[2] = {100, 64};
    int64_t n3 = 3, n2 = 2, n4 = 4;
    kvc_tensor tqo = kvc_tensor_make(qo, KVC_I32, 1, &n3),
               tkvp = kvc_tensor_make(kvp, KVC_I32, 1, &n3);
    kvc_tensor tidx = kvc_tensor_make(idx, KVC_I32, 1, &n4),
               tlen = kvc_tensor_make(len, KVC_I32, 1, &n2);
    kvc_mla_plan *plan = (kvc_mla_plan *)(void *)&plan; /* must become NULL on error */
    kvc_mla_plan *const sentinel = plan;
#define PLAN(...)                                                                                  \
    mla_plan_null_on_error((plan = sentinel, kvc_mla_plan_create(__VA_ARGS__, &plan)), &plan)
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f), KVC_OK);
    kvc_mla_plan_destroy(plan);
    plan = sentinel;
    len[0] = 129; /* needs 3 pages of 64, has 2 */
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "needs 3 pages");
    len[0] = 64; /* needs 1 */
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    len[0] = -1;
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    len[0] = 100;
    idx[1] = -4;
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "kv_indices[1]");
    idx[1] = 1;
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.0f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "sm_scale");
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, NAN, 0.0f),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.1f, -1.0f),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 2, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 0, 512, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 0, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 520, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_UNSUPPORTED);
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 1024, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_UNSUPPORTED);
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 8, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_UNSUPPORTED);
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 256, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_UNSUPPORTED);
    qo[0] = 1;
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    qo[0] = 0;
    qo[2] = 0; /* decreasing */
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    qo[2] = 2;
    int64_t n1 = 1;
    kvc_tensor short_idx = kvc_tensor_make(idx, KVC_I32, 1, &n1);
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &short_idx, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    kvc_tensor f32len = tlen;
    f32len.dtype = KVC_F32;
    ASSERT_STATUS(PLAN(&tqo, &tkvp, &tidx, &f32len, 16, 512, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(PLAN(&tqo, &tkvp, NULL, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(
        kvc_mla_plan_create(&tqo, &tkvp, &tidx, &tlen, 16, 512, 64, 64, 0, 0.1f, 0.0f, NULL),
        KVC_ERR_INVALID_ARG);
#undef PLAN
    ASSERT_TRUE(plan == NULL);
    return 0;
}

TEST(run_errors) {
    /* B = 2, 1 query row each, kv 10 and 3 over pages of 4: pages {2, 0, 1} and
     * {3} */
    enum { Hq = 4, Dc = 32, Dk = 16, PS = 4, NP = 4 };
    int32_t qo[3] = {0, 1, 2}, kvp[3] = {0, 3, 4}, idx[4] = {2, 0, 1, 3}, len[2] = {10, 3};
    int64_t n3 = 3, n2 = 2, n4 = 4;
    kvc_tensor tqo = kvc_tensor_make(qo, KVC_I32, 1, &n3),
               tkvp = kvc_tensor_make(kvp, KVC_I32, 1, &n3);
    kvc_tensor tidx = kvc_tensor_make(idx, KVC_I32, 1, &n4),
               tlen = kvc_tensor_make(len, KVC_I32, 1, &n2);
    kvc_mla_plan *plan = NULL;
    ASSERT_OK(kvc_mla_plan_create(&tqo, &tkvp, &tidx, &tlen, Hq, Dc, Dk, PS, 0, 0.2f, 0.0f, &plan));
    static float qn[2 * Hq * Dc], qp[2 * Hq * Dk], ckv[NP * PS * Dc], kpe[NP * PS * Dk];
    static float out[2 * Hq * Dc], lse[2 * Hq];
    int8_t i8[NP * PS * Dc];
    memset(i8, 0, sizeof i8);
    uint64_t rng = test_seed;
    for (size_t i = 0; i < sizeof qn / 4; i++) qn[i] = test_rng_f32(&rng);
    for (size_t i = 0; i < sizeof qp / 4; i++) qp[i] = test_rng_f32(&rng);
    for (size_t i = 0; i < sizeof ckv / 4; i++) ckv[i] = test_rng_f32(&rng);
    for (size_t i = 0; i < sizeof kpe / 4; i++) kpe[i] = test_rng_f32(&rng);
    int64_t qsh[3] = {2, Hq, Dc}, psh[3] = {2, Hq, Dk}, csh[3] = {NP, PS, Dc},
            ksh[3] = {NP, PS, Dk};
    int64_t lsh[2] = {2, Hq};
    kvc_tensor tqn = kvc_tensor_make(qn, KVC_F32, 3, qsh),
               tqp = kvc_tensor_make(qp, KVC_F32, 3, psh);
    kvc_tensor tc = kvc_tensor_make(ckv, KVC_F32, 3, csh),
               tk = kvc_tensor_make(kpe, KVC_F32, 3, ksh);
    kvc_tensor to = kvc_tensor_make(out, KVC_F32, 3, qsh),
               tl = kvc_tensor_make(lse, KVC_F32, 2, lsh);
    for (size_t i = 0; i < sizeof out / 4; i++) out[i] = 12345.0f;
    for (size_t i = 0; i < sizeof lse / 4; i++) lse[i] = 12345.0f;
    kvc_threadpool *pool = test_pool(2);
    /* each bad argument in turn; out and lse must keep their sentinel */
    kvc_tensor bad;
#define RUN_BAD(...)                                                                               \
    do {                                                                                           \
        ASSERT_STATUS(kvc_mla_run(__VA_ARGS__), KVC_ERR_INVALID_ARG);                              \
        for (size_t i_ = 0; i_ < sizeof out / 4; i_++) ASSERT_TRUE(out[i_] == 12345.0f);           \
        for (size_t i_ = 0; i_ < sizeof lse / 4; i_++) ASSERT_TRUE(lse[i_] == 12345.0f);           \
    } while (0)
    RUN_BAD(NULL, &tqn, &tqp, &tc, &tk, &to, &tl, pool);
    RUN_BAD(plan, NULL, &tqp, &tc, &tk, &to, &tl, pool);
    RUN_BAD(plan, &tqn, NULL, &tc, &tk, &to, &tl, pool);
    ASSERT_STR_CONTAINS(kvc_last_error(), "q_pe");
    RUN_BAD(plan, &tqn, &tqp, &tc, NULL, &to, &tl, pool);
    RUN_BAD(plan, &tqn, &tqp, &tc, &tk, NULL, &tl, pool);
    bad = tqn, bad.shape[1] = 3;
    RUN_BAD(plan, &bad, &tqp, &tc, &tk, &to, &tl, pool);
    ASSERT_STR_CONTAINS(kvc_last_error(), "q_nope has shape (2, 3, 32), expected (2, 4, 32)");
    bad = tqp, bad.shape[2] = 32;
    RUN_BAD(plan, &tqn, &bad, &tc, &tk, &to, &tl, pool);
    bad = tc, bad.shape[0] = 3; /* page 3 is used */
    RUN_BAD(plan, &tqn, &tqp, &bad, &tk, &to, &tl, pool);
    ASSERT_STR_CONTAINS(kvc_last_error(), "page id 3");
    bad = tk, bad.shape[0] = 3;
    RUN_BAD(plan, &tqn, &tqp, &tc, &bad, &to, &tl, pool);
    bad = tc, bad.shape[1] = 8;
    RUN_BAD(plan, &tqn, &tqp, &bad, &tk, &to, &tl, pool);
    bad = kvc_tensor_make(i8, KVC_I8, 3, csh);
    RUN_BAD(plan, &tqn, &tqp, &bad, &tk, &to, &tl, pool);
    ASSERT_STR_CONTAINS(kvc_last_error(), "int8");
    bad = tqn, bad.dtype = KVC_I32;
    RUN_BAD(plan, &bad, &tqp, &tc, &tk, &to, &tl, pool);
    bad = to, bad.dtype = KVC_I8;
    RUN_BAD(plan, &tqn, &tqp, &tc, &tk, &bad, &tl, pool);
    bad = to, bad.stride[2] = 2; /* last dim not contiguous */
    RUN_BAD(plan, &tqn, &tqp, &tc, &tk, &bad, &tl, pool);
    bad = tl, bad.dtype = KVC_F16;
    RUN_BAD(plan, &tqn, &tqp, &tc, &tk, &to, &bad, pool);
    bad = tl, bad.shape[1] = 5;
    RUN_BAD(plan, &tqn, &tqp, &tc, &tk, &to, &bad, pool);
#undef RUN_BAD
    /* then the valid call writes */
    ASSERT_OK(kvc_mla_run(plan, &tqn, &tqp, &tc, &tk, &to, &tl, pool));
    ASSERT_TRUE(out[0] != 12345.0f && isfinite(lse[0]));
    kvc_mla_plan_destroy(plan);
    return 0;
}

const char *test_suite_name = "mla";
const test_case test_suite[] = {TEST_ENTRY(shapes),
                                TEST_ENTRY(dtypes),
                                TEST_ENTRY(causal_multi_token),
                                TEST_ENTRY(long_context),
                                TEST_ENTRY(cap_and_large_logits),
                                TEST_ENTRY(layouts),
                                TEST_ENTRY(empty),
                                TEST_ENTRY(plan_chunks),
                                TEST_ENTRY(plan_errors),
                                TEST_ENTRY(run_errors),
                                {0, 0}};
