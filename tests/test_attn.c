/*
 * Decode attention (attention.h) against a plain double-precision reference
 * on the dequantized K/V: every ISA, 1 and 2 threads (bitwise identical),
 * single and paged, all storage dtypes, GQA ratios, odd head dims, chunk
 * boundaries, soft cap, window, lse, rejected inputs.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE */
#include <stdlib.h>
#include <sys/mman.h>

#include "test_elems.h"
#include "kernels/kernels.h" /* the soft-cap kernel, the ISA tables */
#include "kernels/prefill.h"

/* ---- reference ------------------------------------------------------------ */

typedef struct ref_in {
    int64_t Hq, H, D, L;
    const float *q;  /* (Hq, D) as stored (rounded to q's dtype) */
    const double *k; /* (L, H, D) dequantized */
    const double *v;
    double sm_scale, cap;
    int window;
    const float *sinks; /* (Hq) natural-unit sink logits or NULL */
} ref_in;

/* out (Hq, D), lse (Hq) base 2; slack (Hq * D) and lse_slack (Hq), unless
 * NULL, receive what float32 scores cannot hold. A score is a sum of D
 * products rounded as it accumulates, so key j's is off by about e_j = 2
 * roundings of 2^-24 times sm_scale * sum_d |q_d k_jd| (the roundings of random partial sums
 * add up like a random walk, to under one such rounding; two for margin;
 * the worst case is D of them). To first order, errors delta_j move output
 * d by sum_j w_j (delta_j - mean_w delta) (v_jd - o_d), at most
 * sum_j w_j (e_j + max e) |v_jd - o_d|, and lse (base 2) by log2 e
 * sum_j w_j e_j (w the reference's weights, a sink's error 0). Unit-scale
 * data: ~1e-7, far under the flat tolerances. Scores in the thousands (the
 * large-logit cases) are off by ~1e-4 in float32 alone, and outputs near 1
 * by up to 2e-4 (25 seeds, every ISA): a flat 1e-5 passed only for lucky
 * seeds (4 of 7 others failed). */
static void ref_decode(const ref_in *r, double *out, double *lse, double *slack,
                       double *lse_slack) {
    double sc = r->sm_scale > 0 ? r->sm_scale : 1.0 / sqrt((double)r->D);
    int64_t G = r->Hq / r->H;
    int64_t a = 0;
    if (r->window >= 0 && r->L - 1 - r->window > 0) a = r->L - 1 - r->window;
    double *s = malloc(sizeof(double) * (size_t)(2 * r->L + 1)), *e = s + r->L;
    for (int64_t hq = 0; hq < r->Hq; hq++) {
        int64_t h = hq / G;
        double mx = -INFINITY, emax = 0.0;
        for (int64_t j = a; j < r->L; j++) {
            double x = 0, ab = 0;
            for (int64_t d = 0; d < r->D; d++) {
                const double p = (double)r->q[hq * r->D + d] * r->k[(j * r->H + h) * r->D + d];
                x += p;
                ab += fabs(p);
            }
            x *= sc;
            if (r->cap > 0) x = r->cap * tanh(x / r->cap);
            s[j] = x;
            e[j] = 2.0 * 0x1p-24 * sc * ab;
            if (x > mx) mx = x;
            emax = fmax(emax, e[j]);
        }
        /* a sink: one more logit in the softmax, with no value row */
        const double t = r->sinks ? (double)r->sinks[hq] : -INFINITY;
        if (t > mx) mx = t;
        double sum = t > -INFINITY ? exp(t - mx) : 0.0;
        for (int64_t j = a; j < r->L; j++) sum += exp(s[j] - mx);
        for (int64_t j = a; j < r->L; j++) /* the weights */
            s[j] = sum > 0 ? exp(s[j] - mx) / sum : 0.0;
        double le = 0.0;
        for (int64_t j = a; j < r->L; j++) le += s[j] * e[j];
        for (int64_t d = 0; d < r->D; d++) {
            double o = 0;
            for (int64_t j = a; j < r->L; j++) o += s[j] * r->v[(j * r->H + h) * r->D + d];
            out[hq * r->D + d] = o;
            if (!slack) continue;
            double sl = 0.0;
            for (int64_t j = a; j < r->L; j++)
                sl += s[j] * (e[j] + emax) * fabs(r->v[(j * r->H + h) * r->D + d] - o);
            slack[hq * r->D + d] = sl;
        }
        lse[hq] = sum > 0 ? (mx + log(sum)) / log(2.0) : -INFINITY;
        if (lse_slack) lse_slack[hq] = 1.4426950408889634 * le;
    }
    free(s);
}

static int is_quant(kvc_dtype dt) { return dt == KVC_I8 || dt == KVC_I4; }

/* Compares out (Hq, D) of dtype od and lse with the reference: within tol
 * relative (to 1 + |ref|) plus the absolute slack of each element
 * (ref_decode's; NULL: none). */
static int compare(const void *out, kvc_dtype od, const float *lse, const double *ro,
                   const double *rl, int64_t Hq, int64_t D, double tol, const double *slack,
                   const double *lse_slack, const char *what) {
    for (int64_t i = 0; i < Hq * D; i++) {
        const double g = get_f(out, od, i), sl = slack ? slack[i] : 0.0;
        if (!(fabs(g - ro[i]) <= tol * (1.0 + fabs(ro[i])) + sl))
            TEST_FAIL_("%s: out[%lld] %.9g vs ref %.9g (tol %g + %g)", what, (long long)i, g,
                       ro[i], tol, sl);
    }
    if (lse)
        for (int64_t h = 0; h < Hq; h++) {
            if (isinf(rl[h])) {
                if (!(isinf(lse[h]) && lse[h] < 0)) TEST_FAIL_("%s: lse[%lld] %g, want -inf", what,
                                                                (long long)h, lse[h]);
            } else if (!(fabs(lse[h] - rl[h]) <=
                         tol * (1.0 + fabs(rl[h])) + (lse_slack ? lse_slack[h] : 0.0))) {
                TEST_FAIL_("%s: lse[%lld] %.9g vs ref %.9g", what, (long long)h, lse[h], rl[h]);
            }
        }
    return 0;
}

/* ---- single decode cases ------------------------------------------------------ */

typedef struct sd_case {
    kvc_dtype kd, sd, qd, od;
    kvc_kv_layout layout;
    int64_t Hq, H, D, L;
    int group;
    float cap, sm_scale;
    int window;
    float qmag;  /* query magnitude (large: stability) */
    int qspecial; /* 1: query head 0 all zeros; 2: every head one element 1e4 x the rest;
                     3: every head an outlier channel, 300 x qmag */
    float sspread; /* > 0: int8/int4 scales 0.01 * 10^u, u uniform in [-sspread, sspread] */
    int64_t sjump; /* > 0: int8/int4 scales of keys from this one on 10x */
    const float *sinks; /* (Hq) or NULL */
} sd_case;

static int run_single(const sd_case *c, uint64_t seed) {
    const int64_t Hq = c->Hq, H = c->H, D = c->D, L = c->L, pad = 8;
    /* storage with the head dim padded (non-contiguous rows) */
    const int64_t Dst = D + pad, n = L * H * Dst;
    const int q8 = is_quant(c->kd);
    const int64_t ng = q8 ? D / c->group : 0;
    uint64_t rng = seed;
    void *kb = calloc(1, dt_bytes(c->kd, n) + 16), *vb = calloc(1, dt_bytes(c->kd, n) + 16);
    void *ksb = calloc(1, dt_bytes(c->sd, L * H * (ng + 1)) + 16),
         *vsb = calloc(1, dt_bytes(c->sd, L * H * (ng + 1)) + 16);
    void *qb = calloc(1, dt_bytes(c->qd, Hq * D) + 16);
    float *qf = calloc((size_t)(Hq * D), sizeof(float));
    double *kr = calloc((size_t)(L * H * D + 1), sizeof(double)),
           *vr = calloc((size_t)(L * H * D + 1), sizeof(double));
    double *ro = calloc((size_t)(Hq * D), sizeof(double)), *rl = calloc((size_t)Hq, sizeof(double));
    void *ob = calloc(1, dt_bytes(c->od, Hq * D) + 16), *ob2 = calloc(1, dt_bytes(c->od, Hq * D) + 16);
    float *lse = calloc((size_t)Hq, sizeof(float)), *lse2 = calloc((size_t)Hq, sizeof(float));
    int rc = 0;
    fill_random(qb, c->qd, Hq * D, &rng, c->qmag);
    if (c->qspecial == 1)
        for (int64_t d = 0; d < D; d++) set_f(qb, c->qd, d, 0.0f);
    if (c->qspecial == 2)
        for (int64_t h = 0; h < Hq; h++) {
            for (int64_t d = 0; d < D; d++)
                set_f(qb, c->qd, h * D + d, get_f(qb, c->qd, h * D + d) * 1e-4f);
            set_f(qb, c->qd, h * D + (h * 7) % D, c->qmag);
        }
    if (c->qspecial == 3)
        for (int64_t h = 0; h < Hq; h++) set_f(qb, c->qd, h * D + (h * 7) % D, 300.0f * c->qmag);
    for (int64_t i = 0; i < Hq * D; i++) qf[i] = get_f(qb, c->qd, i);
    /* element (j, h, d) offset in storage */
#define SOFF(j, h, d) (c->layout == KVC_NHD ? ((j) * H + (h)) * Dst + (d) : ((h) * L + (j)) * Dst + (d))
#define SCOFF(j, h, e) (c->layout == KVC_NHD ? ((j) * H + (h)) * ng + (e) : ((h) * L + (j)) * ng + (e))
    for (int kv = 0; kv < 2; kv++) {
        void *st = kv ? vb : kb, *ss = kv ? vsb : ksb;
        double *rr = kv ? vr : kr;
        for (int64_t j = 0; j < L; j++)
            for (int64_t h = 0; h < H; h++) {
                if (q8)
                    for (int64_t e = 0; e < ng; e++)
                        set_f(ss, c->sd, SCOFF(j, h, e),
                              (c->sjump > 0 && j >= c->sjump ? 10.0f : 1.0f) *
                                  (c->sspread > 0
                                       ? 0.01f * powf(10.0f, c->sspread * test_rng_f32(&rng))
                                       : 0.002f + 0.01f * fabsf(test_rng_f32(&rng))));
                for (int64_t d = 0; d < D; d++) {
                    float x = test_rng_f32(&rng);
                    if (c->kd == KVC_I8) x = rintf(x * 127.0f);
                    if (c->kd == KVC_I4) x = rintf(x * 7.0f);
                    set_f(st, c->kd, SOFF(j, h, d), x);
                    double val = get_f(st, c->kd, SOFF(j, h, d));
                    if (q8) val *= get_f(ss, c->sd, SCOFF(j, h, d / c->group));
                    rr[(j * H + h) * D + d] = val;
                }
            }
    }
    ref_in ri = {Hq, H, D, L, qf, kr, vr, c->sm_scale, c->cap, c->window, c->sinks};
    double *slack = calloc((size_t)(Hq * D + Hq), sizeof(double));
    ref_decode(&ri, ro, rl, slack, slack + Hq * D);
    const int int16 = c->kd == KVC_F16 || c->kd == KVC_BF16 || c->qd != KVC_F32 || c->od != KVC_F32;
    double tol = (c->kd == KVC_BF16 || c->qd == KVC_BF16 || c->od == KVC_BF16) ? 1e-2
                 : int16                                                        ? 1e-3
                                                                                : 1e-5;
    int64_t tsh[3], tst[3], ssh[3], sst[3];
    if (c->layout == KVC_NHD) {
        tsh[0] = L, tsh[1] = H, tsh[2] = D;
        tst[0] = H * Dst, tst[1] = Dst, tst[2] = 1;
        ssh[0] = L, ssh[1] = H, ssh[2] = ng;
        sst[0] = H * ng, sst[1] = ng, sst[2] = 1;
    } else {
        tsh[0] = H, tsh[1] = L, tsh[2] = D;
        tst[0] = L * Dst, tst[1] = Dst, tst[2] = 1;
        ssh[0] = H, ssh[1] = L, ssh[2] = ng;
        sst[0] = L * ng, sst[1] = ng, sst[2] = 1;
    }
    kvc_tensor tk = kvc_tensor_make(kb, c->kd, 3, tsh), tv = kvc_tensor_make(vb, c->kd, 3, tsh);
    memcpy(tk.stride, tst, sizeof tst);
    memcpy(tv.stride, tst, sizeof tst);
    kvc_tensor tks = kvc_tensor_make(ksb, c->sd, 3, ssh), tvs = kvc_tensor_make(vsb, c->sd, 3, ssh);
    memcpy(tks.stride, sst, sizeof sst);
    memcpy(tvs.stride, sst, sizeof sst);
    int64_t qsh[2] = {Hq, D};
    kvc_tensor tq = kvc_tensor_make(qb, c->qd, 2, qsh);
    kvc_tensor to = kvc_tensor_make(ob, c->od, 2, qsh), to2 = kvc_tensor_make(ob2, c->od, 2, qsh);
    kvc_tensor tl = kvc_tensor_make(lse, KVC_F32, 1, &Hq), tl2 = kvc_tensor_make(lse2, KVC_F32, 1, &Hq);
    kvc_attn_params p = kvc_attn_default_params();
    p.sm_scale = c->sm_scale;
    p.logits_soft_cap = c->cap;
    p.window_left = c->window;
    p.sinks = c->sinks;
    char what[160];
    snprintf(what, sizeof what, "%s/%s %s q %s out %s Hq %lld H %lld D %lld L %lld cap %g w %d isa %s",
             kvc_dtype_name(c->kd), kvc_dtype_name(c->sd), c->layout == KVC_NHD ? "NHD" : "HND",
             kvc_dtype_name(c->qd), kvc_dtype_name(c->od), (long long)Hq, (long long)H,
             (long long)D, (long long)L, c->cap, c->window, kvc_isa_name(kvc_get_isa()));
    kvc_status st = kvc_single_decode(&tq, &tk, &tv, q8 ? &tks : NULL, q8 ? &tvs : NULL, c->group,
                                      c->layout, &p, &to, &tl, test_pool(1));
    if (st != KVC_OK) {
        fprintf(stderr, "  %s: %s\n", what, kvc_last_error());
        rc = 1;
    }
    if (!rc) rc = compare(ob, c->od, lse, ro, rl, Hq, D, tol, slack, slack + Hq * D, what);
    if (!rc) {
        st = kvc_single_decode(&tq, &tk, &tv, q8 ? &tks : NULL, q8 ? &tvs : NULL, c->group,
                               c->layout, &p, &to2, &tl2, test_pool(2));
        if (st != KVC_OK || memcmp(ob, ob2, dt_bytes(c->od, Hq * D)) != 0 ||
            memcmp(lse, lse2, (size_t)Hq * 4) != 0) {
            fprintf(stderr, "  %s: 2 threads differ from 1 thread\n", what);
            rc = 1;
        }
    }
#undef SOFF
#undef SCOFF
    free(kb), free(vb), free(ksb), free(vsb), free(qb), free(qf), free(kr), free(vr);
    free(ro), free(rl), free(slack), free(ob), free(ob2), free(lse), free(lse2);
    return rc;
}

static sd_case base_case(void) {
    sd_case c;
    memset(&c, 0, sizeof c);
    c.kd = KVC_F32;
    c.sd = KVC_F32;
    c.qd = KVC_F32;
    c.od = KVC_F32;
    c.layout = KVC_NHD;
    c.Hq = 8;
    c.H = 2;
    c.D = 64;
    c.L = 100;
    c.group = 16;
    c.window = -1;
    c.qmag = 1.0f;
    return c;
}

#define RUN(c)                                                                                     \
    do {                                                                                           \
        if (run_single(&(c), test_seed + 17) != 0) return 1;                                       \
    } while (0)

TEST(single_dtypes_layouts) {
    const kvc_dtype dts[5] = {KVC_F32, KVC_F16, KVC_BF16, KVC_I8, KVC_I4};
    FOR_EACH_ISA({
        for (int di = 0; di < 5; di++)
            for (int lay = 0; lay < 2; lay++)
                for (int si = 0; si < (is_quant(dts[di]) ? 2 : 1); si++) {
                    sd_case c = base_case();
                    c.kd = dts[di];
                    c.sd = si ? KVC_F16 : KVC_F32;
                    c.layout = (kvc_kv_layout)lay;
                    c.L = 300;
                    RUN(c);
                }
    });
    return 0;
}

TEST(single_lengths_dims_gqa) {
    /* 2049 and 4097 keys: tasks of 512 and 1024 keys (chunk_len), partial last chunks */
    const int64_t lens[9] = {0, 1, 7, 255, 256, 257, 3000, 2049, 4097};
    const int64_t dims[3] = {64, 128, 80};
    const int64_t hq[4][2] = {{4, 4}, {8, 2}, {16, 2}, {9, 3}};
    FOR_EACH_ISA({
        for (int li = 0; li < 9; li++)
            for (int di = 0; di < 3; di++)
                for (int gi = 0; gi < 4; gi++) {
                    if (lens[li] >= 2049 && (di != 1 || gi == 0)) continue; /* keep it quick */
                    sd_case c = base_case();
                    c.kd = (li + di + gi) % 2 ? KVC_F16 : KVC_I8;
                    c.sd = KVC_F16;
                    c.L = lens[li];
                    c.D = dims[di];
                    c.Hq = hq[gi][0];
                    c.H = hq[gi][1];
                    RUN(c);
                }
    });
    return 0;
}

TEST(single_odd_groups_and_dims) {
    FOR_EACH_ISA({
        sd_case c = base_case();
        c.kd = KVC_I4;
        c.D = 36;
        c.group = 4; /* group % 8 != 0: the element path */
        c.L = 40;
        RUN(c);
        c.kd = KVC_I8;
        c.group = 12;
        RUN(c);
        c.kd = KVC_F16;
        c.D = 20;
        RUN(c);
        c.kd = KVC_I4;
        c.D = 80;
        c.group = 8;
        RUN(c);
    });
    return 0;
}

TEST(single_softcap_window_scale) {
    FOR_EACH_ISA({
        sd_case c = base_case();
        c.L = 600;
        c.cap = 2.0f;
        c.qmag = 8.0f;
        RUN(c);
        c.cap = 0.0f;
        c.window = 0;
        RUN(c);
        c.window = 37;
        RUN(c);
        c.window = 300; /* crosses a chunk boundary */
        RUN(c);
        c.window = 5000;
        RUN(c);
        c.window = 100;
        c.cap = 30.0f;
        c.sm_scale = 0.5f;
        c.kd = KVC_I8;
        RUN(c);
    });
    return 0;
}

/* Attention sinks (kvc_attn_params.sinks): absent, small, dominant, per
 * head; one and several chunks; every storage dtype; with window and cap. */
TEST(single_sinks) {
    static const float sinks[8] = {-INFINITY, 0.0f, 2.0f, -1.0f, 6.0f, -INFINITY, 0.25f, 12.0f};
    const kvc_dtype dts[4] = {KVC_F32, KVC_F16, KVC_I8, KVC_I4};
    const int64_t Ls[3] = {1, 600, 3000};
    FOR_EACH_ISA({
        for (int di = 0; di < 4; di++)
            for (int li = 0; li < 3; li++) {
                sd_case c = base_case();
                c.kd = dts[di];
                c.L = Ls[li];
                c.qmag = 3.0f;
                c.sinks = sinks;
                RUN(c);
            }
        sd_case c = base_case();
        c.sinks = sinks;
        c.window = 10;
        c.cap = 5.0f;
        c.layout = KVC_HND;
        c.od = KVC_F16;
        RUN(c);
    });
    return 0;
}

TEST(single_io_dtypes) {
    FOR_EACH_ISA({
        sd_case c = base_case();
        c.qd = KVC_F16;
        c.od = KVC_F16;
        c.kd = KVC_F16;
        RUN(c);
        c.qd = KVC_BF16;
        c.od = KVC_BF16;
        RUN(c);
        c.qd = KVC_F32;
        c.od = KVC_F16;
        c.kd = KVC_I4;
        c.sd = KVC_F16;
        c.L = 513;
        RUN(c);
    });
    return 0;
}

TEST(single_large_logits) {
    FOR_EACH_ISA({
        sd_case c = base_case();
        c.qmag = 400.0f; /* scores in the thousands: needs the running max */
        c.L = 700;
        c.D = 128;
        RUN(c);
        c.kd = KVC_I8;
        c.sm_scale = 3.0f;
        RUN(c);
    });
    return 0;
}

/* Scores of -5e5 + small exact steps (one-hot q, float32 K: the dot products
 * are exact) keep their differences: the kernels take the raw max and
 * 2^(s * sm_scale * log2 e - m) in one FMA (folding sm_scale * log2 e into q
 * rounded each score at its magnitude, ~3e-3 relative error here). Decode
 * and a prefill of the same rows, every ISA, 1e-5 against double. */
TEST(single_large_scores_exact) {
    enum { L = 50, D = 32, Hq = 2 };
    float q[Hq * D], k[L * D], v[L * D], out[Hq * D], lse[Hq];
    double kd[L * D], vd[L * D], ro[Hq * D], rl[Hq];
    uint64_t rng = test_seed + 77;
    memset(q, 0, sizeof q);
    q[0] = q[D] = 1.0f;
    for (int j = 0; j < L; j++)
        for (int d = 0; d < D; d++) {
            k[j * D + d] = d == 0 ? -5e5f + 0.125f * (float)(j % 17) : test_rng_f32(&rng);
            v[j * D + d] = test_rng_f32(&rng);
            kd[j * D + d] = k[j * D + d];
            vd[j * D + d] = v[j * D + d];
        }
    const float scales[2] = {1.0f, 0.7f};
    int64_t qsh[2] = {Hq, D}, ksh[3] = {L, 1, D}, lsh[1] = {Hq};
    int64_t qsh3[3] = {1, Hq, D}, lsh2[2] = {1, Hq};
    FOR_EACH_ISA({
        for (int si = 0; si < 2; si++) {
            kvc_attn_params p = kvc_attn_default_params();
            p.sm_scale = scales[si];
            ref_in r = {Hq, 1, D, L, q, kd, vd, scales[si], 0.0, -1, NULL};
            ref_decode(&r, ro, rl, NULL, NULL);
            kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 2, qsh),
                       tk = kvc_tensor_make(k, KVC_F32, 3, ksh),
                       tv = kvc_tensor_make(v, KVC_F32, 3, ksh),
                       to = kvc_tensor_make(out, KVC_F32, 2, qsh),
                       tl = kvc_tensor_make(lse, KVC_F32, 1, lsh);
            ASSERT_OK(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &to, &tl,
                                        test_pool(1)));
            if (compare(out, KVC_F32, lse, ro, rl, Hq, D, 1e-5, NULL, NULL,
                        "large scores, decode"))
                return 1;
            kvc_tensor tq3 = kvc_tensor_make(q, KVC_F32, 3, qsh3),
                       to3 = kvc_tensor_make(out, KVC_F32, 3, qsh3),
                       tl2 = kvc_tensor_make(lse, KVC_F32, 2, lsh2);
            ASSERT_OK(kvc_single_prefill(&tq3, &tk, &tv, NULL, NULL, 0, KVC_NHD, 0, NULL, NULL,
                                         &p, &to3, &tl2, test_pool(1)));
            if (compare(out, KVC_F32, lse, ro, rl, Hq, D, 1e-5, NULL, NULL,
                        "large scores, prefill"))
                return 1;
        }
    });
    return 0;
}

/*
 * The query precision of int8/int4 decode (attention.h): with a float16 or
 * bfloat16 q, each key's score may be off by at most sm_scale * sum_i
 * |k_i| * max|q| / 65278 (the AMX kernel's query in 16 bits: half a step
 * of 2 * 0x7f7f), so the base-2 lse by at most log2 e times the largest
 * such bound (a smooth max) and each output by twice it times max|v| (the
 * weights' relative change); with a float32 q, max|q| (2^-24 + 2^-32)
 * (32 bits: each element off by float32's rounding of itself plus half a
 * step of max|q| / 0x7f7f7f00). Queries flat enough for 16 bits (largest
 * element 1, the others up to 0.5 of both signs: max|q| <= 16 mean|q|),
 * int8 K/V with group 32
 * and 128, 200 keys and one key (then lse is the score: an 8-bit query
 * fails), every ISA. A worst-case bound: random
 * rounding errors cancel, so a kernel a few bits coarser can stay inside
 * it on such data; the tolerances of the grids above catch gross errors.
 */
TEST(single_int8_query_precision) {
    enum { Hq = 4, D = 128, L = 200 };
    static const int groups[2] = {32, 128};
    static const kvc_dtype qds[2] = {KVC_F16, KVC_F32};
    int8_t k[L * D], v[L * D];
    uint16_t ks[L * D / 32], vs[L * D / 32];
    float qf[Hq * D], out[Hq * D], lse[Hq];
    uint16_t q16[Hq * D];
    double kd[L * D], vd[L * D], ro[Hq * D], rl[Hq];
    uint64_t rng = test_seed + 91;
    for (int i = 0; i < L * D; i++) {
        k[i] = (int8_t)rintf(127.0f * test_rng_f32(&rng));
        v[i] = (int8_t)rintf(127.0f * test_rng_f32(&rng));
    }
    FOR_EACH_ISA({
        for (int gi = 0; gi < 4; gi++) /* groups 32, 128; all keys, then key 0 alone */
            for (int qi = 0; qi < 2; qi++) {
                const int64_t Ln = gi < 2 ? L : 1; /* one key: lse is its score */
                const int group = groups[gi % 2], ng = D / group;
                for (int i = 0; i < L * ng; i++) {
                    set_f(ks, KVC_F16, i, 0.004f + 0.004f * fabsf(test_rng_f32(&rng)));
                    set_f(vs, KVC_F16, i, 0.004f + 0.004f * fabsf(test_rng_f32(&rng)));
                }
                for (int h = 0; h < Hq; h++)
                    for (int d = 0; d < D; d++) {
                        const float x = d == 7 * h ? 1.0f : 0.5f * test_rng_f32(&rng);
                        set_f(q16, KVC_F16, h * D + d, x);
                        qf[h * D + d] = get_f(q16, KVC_F16, h * D + d); /* same values */
                    }
                double bound = 0.0, vmax = 0.0; /* the largest score bound, max|v| */
                const double half_step = qds[qi] == KVC_F32 ? 0x1p-24 + 0x1p-32 : 1.0 / 65278.0;
                const double sm = 1.0 / sqrt((double)D);
                for (int j = 0; j < Ln; j++)
                    for (int h = 0; h < Hq; h++) {
                        double qm = 0.0, k1 = 0.0;
                        for (int d = 0; d < D; d++) {
                            const int64_t si = j * ng + d / group;
                            kd[j * D + d] = k[j * D + d] * (double)get_f(ks, KVC_F16, si);
                            vd[j * D + d] = v[j * D + d] * (double)get_f(vs, KVC_F16, si);
                            qm = fmax(qm, fabs(qf[h * D + d]));
                            k1 += fabs(kd[j * D + d]);
                            vmax = fmax(vmax, fabs(vd[j * D + d]));
                        }
                        bound = fmax(bound, sm * k1 * qm * half_step);
                    }
                ref_in r = {Hq, 1, D, Ln, qf, kd, vd, 0.0, 0.0, -1, NULL};
                ref_decode(&r, ro, rl, NULL, NULL);
                int64_t qsh[2] = {Hq, D}, ksh[3] = {Ln, 1, D}, ssh[3] = {Ln, 1, ng}, lsh[1] = {Hq};
                kvc_tensor tq = kvc_tensor_make(qds[qi] == KVC_F16 ? (void *)q16 : (void *)qf,
                                                qds[qi], 2, qsh),
                           tk = kvc_tensor_make(k, KVC_I8, 3, ksh),
                           tv = kvc_tensor_make(v, KVC_I8, 3, ksh),
                           tks = kvc_tensor_make(ks, KVC_F16, 3, ssh),
                           tvs = kvc_tensor_make(vs, KVC_F16, 3, ssh),
                           to = kvc_tensor_make(out, KVC_F32, 2, qsh),
                           tl = kvc_tensor_make(lse, KVC_F32, 1, lsh);
                kvc_attn_params p = kvc_attn_default_params();
                ASSERT_OK(kvc_single_decode(&tq, &tk, &tv, &tks, &tvs, group, KVC_NHD, &p, &to,
                                            &tl, test_pool(1)));
                /* the bound plus float32 rounding of the sums (1e-6 relative) */
                const double lse_tol = 1.4426950408889634 * bound + 1e-6 * 8.0;
                const double out_tol = 2.0 * bound * vmax + 1e-6 * vmax;
                for (int h = 0; h < Hq; h++) {
                    if (fabs(lse[h] - rl[h]) > lse_tol) {
                        TEST_FAIL_("q %s group %d isa %s: lse %.9g vs %.9g (bound %.3g)",
                                   kvc_dtype_name(qds[qi]), group, kvc_isa_name(kvc_get_isa()),
                                   lse[h], rl[h], lse_tol);
                        return 1;
                    }
                    for (int d = 0; d < D; d++)
                        if (fabs(out[h * D + d] - ro[h * D + d]) > out_tol) {
                            TEST_FAIL_("q %s group %d isa %s: out %.9g vs %.9g (bound %.3g)",
                                       kvc_dtype_name(qds[qi]), group,
                                       kvc_isa_name(kvc_get_isa()), out[h * D + d],
                                       ro[h * D + d], out_tol);
                            return 1;
                        }
                }
            }
    });
    return 0;
}

/*
 * The SIMD kernels' register tiles: query heads in tiles of up to 4 (AVX2:
 * 2) with every remainder, keys in quads with partial last blocks, head dims
 * in pieces of up to 4 vectors with every remainder, int8/int4 group scales
 * per vector (groups of 1, 2, 4, 8 vectors) or per half vector (groups of
 * 8 with AVX-512, 4 with AVX2), and the fallbacks through the float32 tile:
 * a head dim or group that is not a multiple of the vector width (nor half
 * of it), and groups x heads beyond the weight table (D 512, group 16, G 16).
 */
TEST(single_register_tiles) {
    static const struct {
        kvc_dtype kd;
        int64_t Hq, H, D, L;
        int group;
    } cs[] = {
        {KVC_F16, 5, 1, 128, 13, 16},   {KVC_F16, 6, 2, 96, 37, 16},
        {KVC_F16, 13, 1, 64, 300, 16},  {KVC_F16, 16, 1, 128, 50, 16},
        {KVC_BF16, 7, 1, 112, 21, 16},  {KVC_F32, 3, 1, 48, 19, 16},
        {KVC_F16, 4, 2, 40, 33, 8},     {KVC_I8, 4, 1, 128, 77, 32},
        {KVC_I8, 12, 3, 128, 290, 64},  {KVC_I8, 16, 2, 256, 45, 128},
        {KVC_I4, 4, 1, 128, 29, 32},    {KVC_I4, 3, 1, 64, 262, 16},
        {KVC_I8, 4, 2, 96, 40, 24},     {KVC_I4, 5, 1, 80, 17, 8},
        {KVC_I8, 16, 1, 512, 35, 16},   {KVC_F16, 16, 1, 512, 18, 16},
        {KVC_I8, 1, 1, 32, 5, 32},      {KVC_F16, 2, 2, 16, 3, 16},
        /* groups of half a vector (AVX-512: 8, AVX2: 4): scales per half vector */
        {KVC_I8, 4, 1, 128, 77, 8},     {KVC_I8, 9, 3, 64, 130, 8},
        {KVC_I4, 8, 2, 128, 45, 8},     {KVC_I8, 16, 1, 512, 35, 8},
        {KVC_I8, 4, 2, 64, 40, 4},      {KVC_I4, 3, 1, 32, 21, 4},
        {KVC_I8, 4, 1, 40, 20, 8},
    };
    FOR_EACH_ISA({
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
            for (int sdi = 0; sdi < 2; sdi++) {
                if (sdi && !is_quant(cs[i].kd)) continue;
                sd_case c = base_case();
                c.kd = cs[i].kd;
                c.sd = sdi ? KVC_F16 : KVC_F32;
                c.Hq = cs[i].Hq;
                c.H = cs[i].H;
                c.D = cs[i].D;
                c.L = cs[i].L;
                c.group = cs[i].group;
                c.qd = i % 3 == 1 ? KVC_F16 : KVC_F32;
                c.cap = i % 4 == 2 ? 20.0f : 0.0f;
                RUN(c);
            }
    });
    return 0;
}

/*
 * int8 and int4 caches with a quant group that is a multiple of 16 and a
 * head dim that is a multiple of 64 (up to 256): the AMX decode on the
 * "amx" ISA (attn_amx.c; int4 K rows unpacked, V rows split into nibble
 * tiles, Dh 64 two rows per register), the float kernels elsewhere. Head
 * sets of 1-4 query heads (G 1..16), group 16..256 (interleave pieces of
 * 16, 32 and 64 bytes, one to several groups per 64-element segment,
 * groups over two to four segments; 48 and 96 straddle segments and take
 * the float kernels), calls of 64 keys with partial last blocks and calls,
 * chunks of 256-1024 keys, both scale dtypes and layouts, float16 q/out,
 * soft cap, an all-zero query, spiky queries, scales over 4 decades.
 */
TEST(single_int8_grouped) {
    static const struct {
        int64_t Hq, H, D;
        int group;
    } shp[] = {{4, 1, 128, 32},  {8, 2, 128, 16}, {3, 1, 64, 32},   {1, 1, 128, 128},
               {5, 1, 256, 64},  {16, 1, 64, 16}, {12, 3, 192, 64}, {2, 2, 256, 128},
               {6, 1, 128, 64},  {4, 4, 192, 32}, {9, 3, 64, 64},   {7, 1, 256, 32},
               {4, 1, 192, 96},  {8, 2, 192, 48}, {3, 1, 192, 192}, {4, 2, 256, 256}};
    static const int64_t lens[] = {1, 15, 16, 17, 63, 64, 65, 130, 1100};
    FOR_EACH_ISA({
        for (size_t si = 0; si < 2 * (sizeof shp / sizeof shp[0]); si++)
            for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
                const int i4 = si >= sizeof shp / sizeof shp[0]; /* int4: the shapes again */
                if (lens[li] == 1100 && si % 3 != 0) continue; /* keep it quick */
                sd_case c = base_case();
                c.kd = i4 ? KVC_I4 : KVC_I8;
                const size_t sh = si % (sizeof shp / sizeof shp[0]);
                c.Hq = shp[sh].Hq;
                c.H = shp[sh].H;
                c.D = shp[sh].D;
                c.group = shp[sh].group;
                c.L = lens[li];
                c.sd = (si + li) % 2 ? KVC_F16 : KVC_F32;
                c.layout = (kvc_kv_layout)((si / 2 + li) % 2);
                if (li % 4 == 3) c.qd = c.od = KVC_F16;
                if (li % 4 == 1) c.qd = KVC_F16; /* 16-bit q, float32 out */
                if (li % 5 == 2) c.cap = 20.0f;
                RUN(c);
            }
        for (int i4 = 0; i4 < 2; i4++) {
            sd_case c = base_case();
            c.kd = i4 ? KVC_I4 : KVC_I8;
            c.D = 128;
            c.group = 32;
            c.Hq = 8;
            c.H = 2;
            c.L = 333;
            c.qspecial = 1; /* a zero query: scores 0, uniform weights */
            RUN(c);
            c.qspecial = 2; /* one element carries each head */
            c.qmag = 50.0f;
            RUN(c);
            c.qspecial = 0;
            c.sspread = 2.0f; /* scales 1e-4 .. 1: per-call V weight ranges */
            RUN(c);
            c.qmag = 300.0f; /* scores in the thousands */
            c.sspread = 0.0f;
            RUN(c);
            /* float16 queries with an outlier channel and scores in the tens:
             * the AMX kernel keeps such heads in 32 bits (16 bits gave up to
             * 6x the float16 tolerance) */
            c.qd = KVC_F16;
            c.qspecial = 3;
            for (int qm = 0; qm < 2; qm++) {
                c.qmag = qm ? 8.0f : 2.0f;
                RUN(c);
            }
            /* flat float16 queries with scores in the tens (sm_scale 2,
             * scales up to 0.06): the AMX kernel in 16 bits was 1.8x the
             * float16 tolerance off (int8), so its guard widens such calls
             * to 32 bits (attn_amx.c, WIDEN_BOUND) */
            c.qspecial = 0;
            c.qmag = 4.0f;
            c.sm_scale = 2.0f;
            c.sspread = 0.8f;
            RUN(c);
            /* scales 10x from a later key on, 2.6x the tolerance off in 16
             * bits: head sets whose first keys stay below the bound widen
             * inside a call (key 40: its third block of 16) or in a later
             * call (key 200) */
            c.sm_scale = 0.4f;
            c.sspread = 0.0f;
            c.sjump = 40;
            RUN(c);
            c.sjump = 200;
            RUN(c);
            c.sm_scale = 0.0f;
            c.sjump = 0;
        }
    });
    return 0;
}

/* ---- batched (paged) -------------------------------------------------------- */

static int run_paged_g(kvc_dtype kd, kvc_dtype sd, kvc_kv_layout layout, int64_t ps, int64_t Hq,
                       int64_t H, int64_t D, int B, const int64_t *lens, float cap, int window,
                       int group) {
    const int q8 = is_quant(kd);
    const int pad = 16;
    const int64_t ng = q8 ? D / group : 1;
    uint64_t rng = test_seed * 31 + (uint64_t)ps;
    int64_t pages_total = 0;
    int32_t *indptr = calloc((size_t)B + 1, 4), *last = calloc((size_t)B, 4);
    for (int b = 0; b < B; b++) {
        int64_t np = (lens[b] + ps - 1) / ps;
        indptr[b + 1] = (int32_t)(indptr[b] + np);
        last[b] = (int32_t)(np ? lens[b] - (np - 1) * ps : 0);
        pages_total += np;
    }
    const int64_t P = pages_total + 3; /* spare pages */
    int32_t *indices = calloc((size_t)(pages_total + 1), 4);
    for (int64_t i = 0; i < pages_total; i++) indices[i] = (int32_t)((i * 7 + 2) % P);
    /* (indices distinct because gcd(7, P) may not be 1: make it a permutation) */
    {
        int32_t *perm = calloc((size_t)P, 4);
        for (int64_t i = 0; i < P; i++) perm[i] = (int32_t)i;
        for (int64_t i = P - 1; i > 0; i--) {
            int64_t j = (int64_t)(test_rng_next(&rng) % (uint64_t)(i + 1));
            int32_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        for (int64_t i = 0; i < pages_total; i++) indices[i] = perm[i];
        free(perm);
    }
    /* cache (P, ps, H, D + pad) or (P, H, ps, D + pad), and K/V in separate buffers */
    const int64_t Dst = D + pad, n = P * ps * H * Dst;
    void *kb = calloc(1, dt_bytes(kd, n) + 16), *vb = calloc(1, dt_bytes(kd, n) + 16);
    void *ksb = calloc(1, dt_bytes(sd, P * ps * H * ng) + 16), *vsb = calloc(1, dt_bytes(sd, P * ps * H * ng) + 16);
#define POFF(pg, s, h, st) (layout == KVC_NHD ? (((pg) * ps + (s)) * H + (h)) * (st) : (((pg) * H + (h)) * ps + (s)) * (st))
    int64_t Ltot = 0;
    for (int b = 0; b < B; b++) Ltot += lens[b];
    double *kr = calloc((size_t)(Ltot * H * D + 1), 8), *vr = calloc((size_t)(Ltot * H * D + 1), 8);
    int64_t off = 0;
    for (int b = 0; b < B; b++) {
        for (int64_t j = 0; j < lens[b]; j++) {
            int64_t pg = indices[indptr[b] + j / ps], s = j % ps;
            for (int kv = 0; kv < 2; kv++) {
                void *st = kv ? vb : kb, *ss = kv ? vsb : ksb;
                double *rr = (kv ? vr : kr) + (off + j) * H * D;
                for (int64_t h = 0; h < H; h++) {
                    if (q8)
                        for (int64_t e = 0; e < ng; e++)
                            set_f(ss, sd, POFF(pg, s, h, ng) + e, 0.002f + 0.01f * fabsf(test_rng_f32(&rng)));
                    for (int64_t d = 0; d < D; d++) {
                        float x = test_rng_f32(&rng);
                        if (kd == KVC_I8) x = rintf(x * 127.0f);
                        if (kd == KVC_I4) x = rintf(x * 7.0f);
                        int64_t e = POFF(pg, s, h, Dst) + d;
                        set_f(st, kd, e, x);
                        double val = get_f(st, kd, e);
                        if (q8) val *= get_f(ss, sd, POFF(pg, s, h, ng) + d / group);
                        rr[h * D + d] = val;
                    }
                }
            }
        }
        off += lens[b];
    }
    int64_t csh[4], sh4[4];
    if (layout == KVC_NHD) {
        csh[0] = P, csh[1] = ps, csh[2] = H, csh[3] = D;
        sh4[0] = P, sh4[1] = ps, sh4[2] = H, sh4[3] = ng;
    } else {
        csh[0] = P, csh[1] = H, csh[2] = ps, csh[3] = D;
        sh4[0] = P, sh4[1] = H, sh4[2] = ps, sh4[3] = ng;
    }
    kvc_paged_cache pc;
    memset(&pc, 0, sizeof pc);
    pc.k = kvc_tensor_make(kb, kd, 4, csh);
    pc.v = kvc_tensor_make(vb, kd, 4, csh);
    for (int i = 2; i >= 0; i--) pc.k.stride[i] = pc.k.stride[i + 1] * (i == 2 ? Dst : csh[i + 1]);
    memcpy(pc.v.stride, pc.k.stride, sizeof pc.k.stride);
    if (q8) {
        pc.k_scale = kvc_tensor_make(ksb, sd, 4, sh4);
        pc.v_scale = kvc_tensor_make(vsb, sd, 4, sh4);
    }
    pc.layout = layout;
    pc.quant_group = group;
    /* q (B, Hq, D) float32 */
    float *q = calloc((size_t)(B * Hq * D + 1), 4);
    for (int64_t i = 0; i < B * Hq * D; i++) q[i] = test_rng_f32(&rng);
    float *out = calloc((size_t)(B * Hq * D + 1), 4), *out2 = calloc((size_t)(B * Hq * D + 1), 4);
    float *lse = calloc((size_t)(B * Hq + 1), 4), *lse2 = calloc((size_t)(B * Hq + 1), 4);
    double *ro = calloc((size_t)(Hq * D), 8), *rl = calloc((size_t)Hq, 8);
    int64_t nB = B, nB1 = B + 1, nI = pages_total, qsh[3] = {B, Hq, D}, lsh[2] = {B, Hq};
    kvc_tensor t_indptr = kvc_tensor_make(indptr, KVC_I32, 1, &nB1),
               t_indices = kvc_tensor_make(indices, KVC_I32, 1, &nI),
               t_last = kvc_tensor_make(last, KVC_I32, 1, &nB);
    kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, qsh), to = kvc_tensor_make(out, KVC_F32, 3, qsh),
               to2 = kvc_tensor_make(out2, KVC_F32, 3, qsh), tl = kvc_tensor_make(lse, KVC_F32, 2, lsh),
               tl2 = kvc_tensor_make(lse2, KVC_F32, 2, lsh);
    kvc_attn_params p = kvc_attn_default_params();
    p.logits_soft_cap = cap;
    p.window_left = window;
    int rc = 0;
    kvc_decode_plan *plan = NULL;
    char what[160];
    snprintf(what, sizeof what, "paged %s/%s %s ps %lld Hq %lld H %lld D %lld B %d group %d isa %s",
             kvc_dtype_name(kd), kvc_dtype_name(sd), layout == KVC_NHD ? "NHD" : "HND",
             (long long)ps, (long long)Hq, (long long)H, (long long)D, B, group,
             kvc_isa_name(kvc_get_isa()));
    for (int nt = 1; nt <= 2 && !rc; nt++) {
        kvc_status st = kvc_decode_plan_create(&t_indptr, &t_indices, &t_last, (int32_t)Hq,
                                               (int32_t)H, (int32_t)D, (int32_t)ps, nt, &plan);
        if (st == KVC_OK)
            st = kvc_decode_run(plan, &tq, &pc, &p, nt == 1 ? &to : &to2, nt == 1 ? &tl : &tl2,
                                test_pool(nt));
        kvc_decode_plan_destroy(plan);
        plan = NULL;
        if (st != KVC_OK) {
            fprintf(stderr, "  %s: %s\n", what, kvc_last_error());
            rc = 1;
        }
    }
    if (!rc && (memcmp(out, out2, (size_t)(B * Hq * D) * 4) || memcmp(lse, lse2, (size_t)(B * Hq) * 4))) {
        fprintf(stderr, "  %s: 2 threads differ from 1\n", what);
        rc = 1;
    }
    off = 0;
    for (int b = 0; b < B && !rc; b++) {
        ref_in ri = {Hq, H, D, lens[b], q + b * Hq * D, kr + off * H * D, vr + off * H * D, 0, cap, window, NULL};
        double *slack = calloc((size_t)(Hq * D + Hq), sizeof(double));
        ref_decode(&ri, ro, rl, slack, slack + Hq * D);
        double tol = kd == KVC_BF16 ? 1e-2 : kd == KVC_F16 ? 1e-3 : 1e-5;
        rc = compare(out + b * Hq * D, KVC_F32, lse + b * Hq, ro, rl, Hq, D, tol, slack,
                     slack + Hq * D, what);
        free(slack);
        off += lens[b];
    }
#undef POFF
    free(indptr), free(last), free(indices), free(kb), free(vb), free(ksb), free(vsb), free(kr), free(vr);
    free(q), free(out), free(out2), free(lse), free(lse2), free(ro), free(rl);
    return rc;
}

static int run_paged(kvc_dtype kd, kvc_dtype sd, kvc_kv_layout layout, int64_t ps, int64_t Hq,
                     int64_t H, int64_t D, int B, const int64_t *lens, float cap, int window) {
    return run_paged_g(kd, sd, layout, ps, Hq, H, D, B, lens, cap, window, 8);
}

TEST(paged_ragged) {
    const int64_t lens[6] = {5, 0, 600, 1, 17, 256};
    const kvc_dtype dts[4] = {KVC_F16, KVC_I8, KVC_I4, KVC_F32};
    FOR_EACH_ISA({
        for (int di = 0; di < 4; di++)
            for (int lay = 0; lay < 2; lay++)
                for (int psi = 0; psi < 2; psi++) {
                    int64_t ps = psi ? 16 : 1;
                    if (run_paged(dts[di], di == 2 ? KVC_F32 : KVC_F16, (kvc_kv_layout)lay, ps, 8,
                                  2, 64, 6, lens, 0.0f, -1) != 0)
                        return 1;
                }
        if (run_paged(KVC_I8, KVC_F16, KVC_HND, 16, 9, 3, 80, 6, lens, 5.0f, 100) != 0) return 1;
        const int64_t one[1] = {0};
        if (run_paged(KVC_F16, KVC_F16, KVC_NHD, 16, 4, 4, 128, 1, one, 0.0f, -1) != 0) return 1;
        /* requests split in tasks of 1024, 256 and 512 keys (chunk_len), one batch */
        const int64_t longl[3] = {4097, 3, 2049};
        if (run_paged(KVC_F16, KVC_F16, KVC_NHD, 16, 8, 2, 64, 3, longl, 0.0f, -1) != 0) return 1;
        if (run_paged(KVC_I8, KVC_F16, KVC_HND, 5, 4, 1, 64, 3, longl, 0.0f, 3000) != 0) return 1;
    });
    return 0;
}

/* core.h promises decode runs in 256 KiB of stack (the per-task state lives
 * there): the float path (float16, the largest head dim) and the AMX/int8
 * path, multi-chunk requests, on a thread created with exactly that stack
 * (test_on_small_stack). */

static void *small_stack_decode(void *arg) {
    int *rc = arg;
    const int64_t lens[3] = {1500, 3, 700};
    *rc = run_paged(KVC_F16, KVC_F32, KVC_NHD, 16, 8, 2, KVC_ATTN_MAX_DIM, 3, lens, 0.0f, -1) ||
          run_paged(KVC_I8, KVC_F16, KVC_NHD, 16, 32, 8, 128, 3, lens, 0.0f, -1) ||
          run_paged(KVC_I4, KVC_F32, KVC_HND, 5, 12, 3, 64, 3, lens, 0.0f, -1);
    return NULL;
}

TEST(decode_in_256k_of_stack) {
    FOR_EACH_ISA({
        int rc = 1;
        ASSERT_TRUE(test_on_small_stack(small_stack_decode, &rc) == 0);
        ASSERT_TRUE(rc == 0);
    });
    return 0;
}

TEST(paged_int8_grouped) {
    /* page sizes that split 16-key blocks (1, 5, 24) and ones that hold them
     * (16, 64): rows copied or read in place by the tiles (int4 rows are
     * unpacked either way, from per-key or per-block addresses) */
    const int64_t lens[5] = {70, 0, 1, 300, 129};
    const int64_t pss[5] = {1, 5, 16, 24, 64};
    const kvc_dtype kds[2] = {KVC_I8, KVC_I4};
    FOR_EACH_ISA({
        for (int ki = 0; ki < 2; ki++)
            for (int pi = 0; pi < 5; pi++)
                for (int lay = 0; lay < 2; lay++)
                    if (run_paged_g(kds[ki], pi % 2 ? KVC_F32 : KVC_F16, (kvc_kv_layout)lay,
                                    pss[pi], 8, 2, 128, 5, lens, pi == 3 ? 10.0f : 0.0f,
                                    pi == 4 ? 100 : -1, pi == 2 ? 64 : 32) != 0)
                        return 1;
        const int64_t longl[3] = {4097, 3, 2049};
        if (run_paged_g(KVC_I8, KVC_F16, KVC_NHD, 16, 12, 3, 64, 3, longl, 0.0f, -1, 16) != 0)
            return 1;
        if (run_paged_g(KVC_I4, KVC_F32, KVC_HND, 5, 12, 3, 64, 3, longl, 0.0f, -1, 32) != 0)
            return 1;
    });
    return 0;
}

/* The amx level keeps the AVX-512 kernels for everything but int8 decode. */
TEST(amx_level_tables) {
    if (!test_isa_usable(KVC_ISA_AMX)) return 0;
    ASSERT_OK(kvc_set_isa(KVC_ISA_AMX));
    const kvc_kernels *a = kvc__kernels(), *x = kvc__kernels_avx512();
    int rc = a->isa != KVC_ISA_AMX || a->amx_run == NULL || a->attn_decode != x->attn_decode ||
             a->quantize != x->quantize || x->amx_run != NULL ||
             kvc__prefill_kernels()->isa != KVC_ISA_AVX512;
    kvc_set_isa(kvc_best_isa());
    if (rc) TEST_FAIL_("amx table: %s", "not the AVX-512 table plus the AMX decode");
    return 0;
}

/*
 * The prefill gemm's chains (prefill.h): terms split where (t + t0) %
 * KVC_PF_TCHUNK == 0, each chain summed from zero, chains added in order.
 * Terms 2^24, 1, -2^24 (exact products, so every ISA gives the same bits):
 * one chain rounds 2^24 + 1 away and gives 0, a boundary before the 1 gives
 * 1, one before the -2^24 gives 0 again. Also T = 0 (C = C * alpha, or 0),
 * alpha on the first chain, and nothing written past Mp or below row A.
 */
TEST(prefill_gemm_chains) {
    enum { A = 4, MP = 16, LDC = 32, ROWS = 6 };
    FOR_EACH_ISA({
        const kvc_prefill_kernels *pk = kvc__prefill_kernels();
        float y[3 * MP] __attribute__((aligned(64)));
        float x[A * 3], alpha[MP] __attribute__((aligned(64)));
        float c[ROWS * LDC] __attribute__((aligned(64)));
        const float terms[3] = {16777216.0f, 1.0f, -16777216.0f};
        for (int t = 0; t < 3; t++)
            for (int m = 0; m < MP; m++) y[t * MP + m] = terms[t];
        for (int i = 0; i < A * 3; i++) x[i] = 1.0f;
        const int64_t t0s[4] = {0, 31, 30, 64 + 31};
        const float want[4] = {0.0f, 1.0f, 0.0f, 1.0f};
        for (int ti = 0; ti < 4; ti++) {
            for (int i = 0; i < ROWS * LDC; i++) c[i] = -7.0f;
            pk->gemm(c, LDC, x, 3, 1, y, MP, A, 3, t0s[ti], MP, NULL);
            for (int a = 0; a < ROWS; a++)
                for (int m = 0; m < LDC; m++) {
                    const float e = a < A && m < MP ? want[ti] : -7.0f;
                    if (c[a * LDC + m] != e)
                        TEST_FAIL_("isa %s t0 %lld: C[%d][%d] = %g, expected %g",
                                   kvc_isa_name(kvc_get_isa()), (long long)t0s[ti], a, m,
                                   (double)c[a * LDC + m], (double)e);
                }
        }
        /* alpha scales the old C once, before the first chain is added:
         * terms 1, 2, 3 (exact sums): 6 * 0.5 + 1 + (2 + 3) */
        for (int t = 0; t < 3; t++)
            for (int m = 0; m < MP; m++) y[t * MP + m] = (float)(t + 1);
        for (int m = 0; m < MP; m++) alpha[m] = 0.5f;
        for (int i = 0; i < ROWS * LDC; i++) c[i] = 6.0f;
        pk->gemm(c, LDC, x, 3, 1, y, MP, A, 3, 31, MP, alpha);
        ASSERT_TRUE(c[0] == 9.0f && c[(A - 1) * LDC + MP - 1] == 9.0f && c[MP] == 6.0f &&
                    c[A * LDC] == 6.0f);
        /* no terms */
        pk->gemm(c, LDC, x, 3, 1, y, MP, A, 0, 0, MP, alpha);
        ASSERT_TRUE(c[0] == 4.5f && c[A * LDC] == 6.0f);
        pk->gemm(c, LDC, x, 3, 1, y, MP, A, 0, 0, MP, NULL);
        ASSERT_TRUE(c[0] == 0.0f && c[(A - 1) * LDC + MP - 1] == 0.0f && c[MP] == 6.0f);
    });
    return 0;
}

/* ---- rejected inputs ----------------------------------------------------------- */

TEST(rejects) {
    float q[4 * 64], k[10 * 2 * 64], v[10 * 2 * 64], out[4 * 64], lse[4];
    for (int i = 0; i < 4 * 64; i++) q[i] = 0.1f;
    for (int i = 0; i < 10 * 2 * 64; i++) k[i] = v[i] = 0.2f;
    int64_t qsh[2] = {4, 64}, ksh[3] = {10, 2, 64}, n4 = 4;
    kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 2, qsh), tk = kvc_tensor_make(k, KVC_F32, 3, ksh),
               tv = kvc_tensor_make(v, KVC_F32, 3, ksh), to = kvc_tensor_make(out, KVC_F32, 2, qsh),
               tl = kvc_tensor_make(lse, KVC_F32, 1, &n4);
    memset(out, 0x5a, sizeof out);
    memset(lse, 0x5a, sizeof lse);
    float out0[4 * 64], lse0[4];
    memcpy(out0, out, sizeof out);
    memcpy(lse0, lse, sizeof lse);
    kvc_attn_params p = kvc_attn_default_params();
#define REJ(call)                                                                                  \
    do {                                                                                           \
        ASSERT_STATUS(call, KVC_ERR_INVALID_ARG);                                                  \
        ASSERT_MEM_EQ(out, out0, sizeof out);                                                      \
        ASSERT_MEM_EQ(lse, lse0, sizeof lse);                                                      \
    } while (0)
    /* Hq % H */
    int64_t q3[2] = {3, 64};
    kvc_tensor tq3 = kvc_tensor_make(q, KVC_F32, 2, q3), to3 = kvc_tensor_make(out, KVC_F32, 2, q3);
    REJ(kvc_single_decode(&tq3, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &to3, NULL, NULL));
    /* Dh mismatch, dtype of q/out/lse */
    int64_t q63[2] = {4, 63};
    kvc_tensor tqb = kvc_tensor_make(q, KVC_F32, 2, q63);
    REJ(kvc_single_decode(&tqb, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &to, &tl, NULL));
    tqb = tq;
    tqb.dtype = KVC_I8;
    REJ(kvc_single_decode(&tqb, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &to, &tl, NULL));
    kvc_tensor tob = to;
    tob.dtype = KVC_I32;
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &tob, &tl, NULL));
    kvc_tensor tlb = tl;
    tlb.dtype = KVC_F16;
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &to, &tlb, NULL));
    /* data not aligned to its elements (q, lse): refused before any load */
    kvc_tensor tqm = tq, tlm = tl;
    tqm.data = (char *)tq.data + 2;
    REJ(kvc_single_decode(&tqm, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &to, &tl, NULL));
    ASSERT_STR_CONTAINS(kvc_last_error(), "aligned");
    tlm.data = (char *)tl.data + 1; /* never dereferenced */
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &to, &tlm, NULL));
    ASSERT_STR_CONTAINS(kvc_last_error(), "aligned");
    /* written rows that share memory (stride 0), out or lse */
    kvc_tensor toz = to, tlz = tl;
    toz.stride[0] = 0;
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &toz, &tl, NULL));
    ASSERT_STR_CONTAINS(kvc_last_error(), "stride 0");
    tlz.stride[0] = 0; /* 1-D here: refused as its last dimension already */
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &to, &tlz, NULL));
    /* k/v mismatch, layout, params */
    int64_t ksh2[3] = {9, 2, 64};
    kvc_tensor tv2 = kvc_tensor_make(v, KVC_F32, 3, ksh2);
    REJ(kvc_single_decode(&tq, &tk, &tv2, NULL, NULL, 0, KVC_NHD, &p, &to, &tl, NULL));
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, (kvc_kv_layout)7, &p, &to, &tl, NULL));
    kvc_attn_params pb = p;
    pb.window_left = -2;
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &pb, &to, &tl, NULL));
    pb = p;
    pb.logits_soft_cap = NAN;
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &pb, &to, &tl, NULL));
    float sinks[4] = {0.0f, -INFINITY, NAN, 1.0f};
    pb = p;
    pb.sinks = sinks;
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &pb, &to, &tl, NULL));
    ASSERT_STR_CONTAINS(kvc_last_error(), "sinks[2]");
    sinks[2] = INFINITY;
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &pb, &to, &tl, NULL));
    sinks[2] = 3e38f; /* finite, but sink * log2 e overflows: once a NaN output, KVC_OK */
    REJ(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &pb, &to, &tl, NULL));
    ASSERT_STR_CONTAINS(kvc_last_error(), "sinks[2]");
    sinks[2] = 2.3e38f; /* the largest ones stay usable: the sink takes everything */
    ASSERT_OK(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &pb, &to, &tl, NULL));
    for (int i = 0; i < (int)(sizeof out / sizeof out[0]); i++) ASSERT_TRUE(isfinite(out[i]));
    memcpy(out, out0, sizeof out);
    memcpy(lse, lse0, sizeof lse);
    sinks[2] = -INFINITY; /* -inf: no sink for that head, accepted */
    ASSERT_OK(kvc_single_decode(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &pb, &to, &tl, NULL));
    memcpy(out, out0, sizeof out);
    memcpy(lse, lse0, sizeof lse);
    /* int8 without scales, bad group, bad scale shape */
    int8_t k8[10 * 2 * 64] = {0}, v8[10 * 2 * 64] = {0};
    float s8[10 * 2 * 8];
    int64_t s8sh[3] = {10, 2, 8}, s8bad[3] = {10, 2, 4};
    kvc_tensor tk8 = kvc_tensor_make(k8, KVC_I8, 3, ksh), tv8 = kvc_tensor_make(v8, KVC_I8, 3, ksh),
               ts8 = kvc_tensor_make(s8, KVC_F32, 3, s8sh), ts8b = kvc_tensor_make(s8, KVC_F32, 3, s8bad);
    REJ(kvc_single_decode(&tq, &tk8, &tv8, NULL, NULL, 8, KVC_NHD, &p, &to, &tl, NULL));
    REJ(kvc_single_decode(&tq, &tk8, &tv8, &ts8, &ts8, 7, KVC_NHD, &p, &to, &tl, NULL));
    REJ(kvc_single_decode(&tq, &tk8, &tv8, &ts8b, &ts8b, 8, KVC_NHD, &p, &to, &tl, NULL));
    kvc_tensor ts8d = ts8;
    ts8d.dtype = KVC_BF16;
    REJ(kvc_single_decode(&tq, &tk8, &tv8, &ts8d, &ts8d, 8, KVC_NHD, &p, &to, &tl, NULL));
    for (int i = 0; i < 10 * 2 * 8; i++) s8[i] = 0.01f;
    ASSERT_OK(kvc_single_decode(&tq, &tk8, &tv8, &ts8, &ts8, 8, KVC_NHD, &p, &to, &tl, NULL));
    memcpy(out0, out, sizeof out);
    memcpy(lse0, lse, sizeof lse);

    /* plan/run: bad table, page ids outside the cache, cache/plan mismatch */
    int32_t indptr[3] = {0, 1, 2}, indices[2] = {0, 5}, last[2] = {1, 2};
    int64_t n2 = 2, n3 = 3;
    kvc_tensor ti = kvc_tensor_make(indptr, KVC_I32, 1, &n3), tx = kvc_tensor_make(indices, KVC_I32, 1, &n2),
               tla = kvc_tensor_make(last, KVC_I32, 1, &n2);
    kvc_decode_plan *plan = NULL;
    last[0] = 5; /* > page_size 4 */
    ASSERT_STATUS(kvc_decode_plan_create(&ti, &tx, &tla, 4, 2, 64, 4, 1, &plan), KVC_ERR_INVALID_ARG);
    last[0] = 1;
    ASSERT_STATUS(kvc_decode_plan_create(&ti, &tx, &tla, 3, 2, 64, 4, 1, &plan), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_decode_plan_create(&ti, &tx, &tla, 4, 2, 64, 4, 1025, &plan),
                  KVC_ERR_INVALID_ARG); /* n_threads at most 1024, as for prefill */
    ASSERT_TRUE(plan == NULL);
    ASSERT_OK(kvc_decode_plan_create(&ti, &tx, &tla, 4, 2, 64, 4, 1, &plan));
    float cache[4 * 4 * 2 * 64] = {0}, bq[2 * 4 * 64] = {0}, bo[2 * 4 * 64], bl[8];
    memset(bo, 0x5a, sizeof bo);
    memset(bl, 0x5a, sizeof bl);
    float bo0[2 * 4 * 64], bl0[8];
    memcpy(bo0, bo, sizeof bo);
    memcpy(bl0, bl, sizeof bl);
    int64_t csh[4] = {4, 4, 2, 64}, bqs[3] = {2, 4, 64}, bls[2] = {2, 4};
    kvc_paged_cache pc;
    memset(&pc, 0, sizeof pc);
    pc.k = kvc_tensor_make(cache, KVC_F32, 4, csh);
    pc.v = pc.k;
    pc.layout = KVC_NHD;
    kvc_tensor tbq = kvc_tensor_make(bq, KVC_F32, 3, bqs), tbo = kvc_tensor_make(bo, KVC_F32, 3, bqs),
               tbl = kvc_tensor_make(bl, KVC_F32, 2, bls);
    /* page 5 outside a 4-page cache */
    ASSERT_STATUS(kvc_decode_run(plan, &tbq, &pc, &p, &tbo, &tbl, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_MEM_EQ(bo, bo0, sizeof bo);
    ASSERT_MEM_EQ(bl, bl0, sizeof bl);
    kvc_decode_plan_destroy(plan);
    indices[1] = 3;
    ASSERT_OK(kvc_decode_plan_create(&ti, &tx, &tla, 4, 2, 64, 4, 1, &plan));
    int64_t bad[3] = {3, 4, 64};
    kvc_tensor tbq3 = kvc_tensor_make(bq, KVC_F32, 3, bad);
    ASSERT_STATUS(kvc_decode_run(plan, &tbq3, &pc, &p, &tbo, &tbl, NULL), KVC_ERR_INVALID_ARG);
    kvc_paged_cache pc2 = pc;
    pc2.layout = KVC_HND; /* now H = 4 != plan's 2 */
    ASSERT_STATUS(kvc_decode_run(plan, &tbq, &pc2, &p, &tbo, &tbl, NULL), KVC_ERR_INVALID_ARG);
    pc2 = pc;
    pc2.k.dtype = KVC_I8;
    pc2.v.dtype = KVC_I8;
    ASSERT_STATUS(kvc_decode_run(plan, &tbq, &pc2, &p, &tbo, &tbl, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_MEM_EQ(bo, bo0, sizeof bo);
    ASSERT_MEM_EQ(bl, bl0, sizeof bl);
    ASSERT_OK(kvc_decode_run(plan, &tbq, &pc, &p, &tbo, &tbl, NULL));
    kvc_decode_plan_destroy(plan);
    kvc_decode_plan_destroy(NULL);
    /* Dh over the supported maximum */
    ASSERT_STATUS(kvc_decode_plan_create(&ti, &tx, &tla, 4, 2, 1024, 4, 1, &plan), KVC_ERR_UNSUPPORTED);
#undef REJ
    return 0;
}

/*
 * The soft cap every attention kernel applies (src/kernels/vec_math.h):
 * tanh within 2 ulp of double tanh over all float magnitudes, cap * tanh(s /
 * cap) * mul within 4 float roundings, special values, and the same bits on
 * every ISA (prefill promises ISA-independent results).
 */
TEST(softcap_kernel) {
    enum { N = 200003 };
    static float s[N], ref[N], out[N];
    uint64_t rng = test_seed ^ 0x7a9;
    for (int i = 0; i < N; i++) {
        const uint64_t r = test_rng_next(&rng);
        uint32_t bits = (uint32_t)r;
        if (i % 4 == 0) bits = (bits & 0x807fffffu) | ((uint32_t)(100 + (r >> 40) % 60) << 23);
        memcpy(&s[i], &bits, 4);
        if (!isfinite(s[i])) s[i] = (float)((double)(r >> 11) * 0x1p-53 * 40.0 - 20.0);
    }
    static const float specials[] = {0.0f, -0.0f, 1e-40f, -1e-40f, 0.55f, -0.55f, 0.5499999f,
                                     9.5f, -9.5f, 20.0f, 1e30f, -1e30f};
    memcpy(s, specials, sizeof specials);
    const kvc_isa best = kvc_best_isa();
    static const float caps[3][2] = {{1.0f, 1.0f}, {30.0f, 1.4426950408889634f}, {4.0f, 0.5f}};
    for (int ci = 0; ci < 3; ci++) {
        const float cap = caps[ci][0], mul = caps[ci][1];
        ASSERT_OK(kvc_set_isa(KVC_ISA_SCALAR));
        memcpy(ref, s, sizeof s);
        kvc__kernels()->softcap(ref, N, cap, mul);
        for (int i = 0; i < N; i++) {
            const float x = s[i] / cap;
            const double want = (double)cap * tanh((double)x) * (double)mul;
            const float fw = fabsf((float)want);
            const double tol = ci == 0 ? 2.0 * ((double)nextafterf(fw, INFINITY) - (double)fw)
                                       : 4.0 * 0x1p-24 * fabs(want) + 1e-45;
            if (!(fabs((double)ref[i] - want) <= tol))
                TEST_FAIL_("cap %g mul %g: s = %a -> %a, tanh reference %a (tolerance %g)",
                           (double)cap, (double)mul, (double)s[i], (double)ref[i], want, tol);
        }
        for (int isa = 1; isa <= (int)best; isa++) {
            ASSERT_OK(kvc_set_isa((kvc_isa)isa));
            memcpy(out, s, sizeof s);
            kvc__kernels()->softcap(out, N, cap, mul);
            for (int i = 0; i < N; i++)
                if (memcmp(&out[i], &ref[i], 4) != 0)
                    TEST_FAIL_("%s cap %g: s = %a -> %a, scalar %a", kvc_isa_name((kvc_isa)isa),
                               (double)cap, (double)s[i], (double)out[i], (double)ref[i]);
        }
    }
    /* special values, every ISA, in vector lanes and the scalar tail */
    for (int isa = 0; isa <= (int)best; isa++) {
        ASSERT_OK(kvc_set_isa((kvc_isa)isa));
        float sp[19];
        for (int i = 0; i < 19; i++) sp[i] = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY;
        kvc__kernels()->softcap(sp, 19, 30.0f, 2.0f);
        for (int i = 0; i < 19; i++) {
            if (i % 3 == 0) ASSERT_TRUE(isnan(sp[i]));
            else ASSERT_TRUE(sp[i] == (i % 3 == 1 ? 60.0f : -60.0f));
        }
        float z[2] = {0.0f, -0.0f};
        kvc__kernels()->softcap(z, 2, 30.0f, 2.0f);
        ASSERT_TRUE(z[0] == 0.0f && !signbit(z[0]) && z[1] == 0.0f && signbit(z[1]));
    }
    ASSERT_OK(kvc_set_isa(best));
    return 0;
}

/* Scratch sized from the caller's shapes: broadcast (stride 0) views make
 * huge shapes cheap, and the products once wrapped into tiny allocations
 * the kernels then wrote past. Each call must fail cleanly instead. */
TEST(huge_broadcast_shapes_refused) {
    static float row[64], qrow[64];
    for (int i = 0; i < 64; i++) row[i] = 0.5f, qrow[i] = 0.1f;
    { /* decode plan: 2^24 pages of 2^30 tokens (every page id 0), 4096 heads */
        const int32_t H = 4096, D = 62, P = 1 << 30, pages = 1 << 24;
        int32_t indptr[2] = {0, pages}, last[1] = {P}, zero = 0;
        int64_t s1 = 2, sB = 1, sN = pages;
        kvc_tensor ti = kvc_tensor_make(indptr, KVC_I32, 1, &s1);
        kvc_tensor tl = kvc_tensor_make(last, KVC_I32, 1, &sB);
        kvc_tensor tx = kvc_tensor_make(&zero, KVC_I32, 1, &sN);
        tx.stride[0] = 0;
        kvc_decode_plan *plan = NULL;
        ASSERT_STATUS(kvc_decode_plan_create(&ti, &tx, &tl, H, H, D, P, 1, &plan), KVC_ERR_NOMEM);
        ASSERT_TRUE(plan == NULL);
    }
    { /* single decode: 2^57 keys (one row), 1024 query heads (one row) */
        const int64_t L = (int64_t)1 << 57, Hq = 1024, D = 62;
        int64_t ks[3] = {L, 1, D}, qs[2] = {Hq, D};
        kvc_tensor k = kvc_tensor_make(row, KVC_F32, 3, ks);
        k.stride[0] = k.stride[1] = 0;
        kvc_tensor q = kvc_tensor_make(qrow, KVC_F32, 2, qs);
        q.stride[0] = 0;
        float *o = calloc((size_t)(Hq * D), sizeof(float));
        ASSERT_TRUE(o != NULL);
        o[0] = 7.0f;
        kvc_tensor out = kvc_tensor_make(o, KVC_F32, 2, qs);
        ASSERT_STATUS(kvc_single_decode(&q, &k, &k, NULL, NULL, 0, KVC_NHD, NULL, &out, NULL, NULL),
                      KVC_ERR_NOMEM);
        ASSERT_TRUE(o[0] == 7.0f); /* nothing written */
        free(o);
    }
    { /* cascade plan: 2^31 - 1 query rows x 2^31 - 1 heads x 512 */
        int32_t qo[2] = {0, 2147483647}, kvp[2] = {0, 1}, idx[1] = {0}, last[1] = {1};
        int64_t two = 2, one = 1;
        kvc_tensor tq = kvc_tensor_make(qo, KVC_I32, 1, &two);
        kvc_tensor tk = kvc_tensor_make(kvp, KVC_I32, 1, &two);
        kvc_tensor tx = kvc_tensor_make(idx, KVC_I32, 1, &one);
        kvc_tensor tl = kvc_tensor_make(last, KVC_I32, 1, &one);
        kvc_cascade_plan *p = NULL;
        kvc_status st = kvc_cascade_plan_create(1, &tq, &tk, &tx, &tl, 2147483647, 2147483647,
                                                512, 16, 0, 1, &p);
        ASSERT_TRUE(st < 0 && p == NULL);
    }
    { /* single prefill with a custom mask: 2^34 x 2^30 bits wrapped to 0, so a (0,)
       * mask passed; the output is a MAP_NORESERVE mapping nothing touches */
        const int64_t qo = (int64_t)1 << 34, L = (int64_t)1 << 30, D = 16;
        int64_t ks[3] = {L, 1, D}, qs[3] = {qo, 1, D}, ms[1] = {0};
        kvc_tensor k = kvc_tensor_make(row, KVC_F32, 3, ks);
        k.stride[0] = k.stride[1] = 0;
        kvc_tensor q = kvc_tensor_make(qrow, KVC_F32, 3, qs);
        q.stride[0] = q.stride[1] = 0;
        const size_t ob = (size_t)(qo * D) * 2;
        void *o = mmap(NULL, ob, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        ASSERT_TRUE(o != MAP_FAILED);
        kvc_tensor out = kvc_tensor_make(o, KVC_BF16, 3, qs);
        static uint8_t mbuf[1];
        kvc_tensor mask = kvc_tensor_make(mbuf, KVC_U8, 1, ms);
        ASSERT_STATUS(kvc_single_prefill(&q, &k, &k, NULL, NULL, 0, KVC_NHD, 0, &mask, NULL, NULL,
                                         &out, NULL, NULL),
                      KVC_ERR_INVALID_ARG);
        ASSERT_STR_CONTAINS(kvc_last_error(), "too large");
        munmap(o, ob);
    }
    return 0;
}

/* The rotation of kivi's V (docs/KV_FORMATS.md section 4): the scalar
 * kernel against H x / sqrt(n) in float64 with H built entry by entry, and
 * every ISA bit for bit against the scalar one (the stored bytes depend on
 * it), orders 1..512, with zeros, subnormals, large values and non-finite
 * ones (those only need to stay NaN or the same infinity). */
TEST(hadamard_kernel) {
    enum { NMAX = 512 };
    static float x[NMAX], ref[NMAX], out[NMAX];
    uint64_t rng = test_seed ^ 0x4ad;
    const kvc_isa best = kvc_best_isa();
    for (int n = 1; n <= NMAX; n *= 2)
        for (int rep = 0; rep < 6; rep++) {
            double amax = 0;
            for (int i = 0; i < n; i++) {
                const uint64_t r = test_rng_next(&rng);
                x[i] = (float)((double)(r >> 11) * 0x1p-53 * 2.0 - 1.0);
                if (rep == 1) x[i] *= 1e30f; /* sums near float32's top */
                if (rep == 2 && i % 3 == 0) x[i] = i % 2 ? 1e-40f : -0.0f;
                if (rep == 3) x[i] = (float)(r % 7) - 3.0f; /* exact sums, ties in the scale */
                if (rep >= 4 && i % 5 == 1) x[i] = rep == 4 ? INFINITY : NAN;
                amax = fmax(amax, fabs((double)x[i]));
            }
            ASSERT_OK(kvc_set_isa(KVC_ISA_SCALAR));
            memcpy(ref, x, sizeof(float) * (size_t)n);
            kvc__kernels()->hadamard(ref, n);
            int L = 0;
            while ((1 << L) < n) L++;
            const double tol = (L + 2) * (double)n * 0x1p-24 * amax / sqrt((double)n);
            for (int i = 0; i < n && rep < 4; i++) {
                double want = 0;
                for (int j = 0; j < n; j++)
                    want += (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.0 : 1.0) * (double)x[j];
                want /= sqrt((double)n);
                if (!(fabs((double)ref[i] - want) <= tol))
                    TEST_FAIL_("n %d rep %d: element %d is %a, float64 %a (tolerance %g)", n, rep,
                               i, (double)ref[i], want, tol);
            }
            for (int isa = 1; isa <= (int)best; isa++) {
                ASSERT_OK(kvc_set_isa((kvc_isa)isa));
                memcpy(out, x, sizeof(float) * (size_t)n);
                kvc__kernels()->hadamard(out, n);
                for (int i = 0; i < n; i++)
                    if (isnan(ref[i]) ? !isnan(out[i]) : memcmp(&out[i], &ref[i], 4) != 0)
                        TEST_FAIL_("%s n %d rep %d: element %d is %a, scalar %a",
                                   kvc_isa_name((kvc_isa)isa), n, rep, i, (double)out[i],
                                   (double)ref[i]);
            }
        }
    ASSERT_OK(kvc_set_isa(best));
    return 0;
}

const char *test_suite_name = "attn";
const test_case test_suite[] = {
    TEST_ENTRY(softcap_kernel),
    TEST_ENTRY(hadamard_kernel),
    TEST_ENTRY(huge_broadcast_shapes_refused),
    TEST_ENTRY(single_dtypes_layouts),
    TEST_ENTRY(single_lengths_dims_gqa),
    TEST_ENTRY(single_odd_groups_and_dims),
    TEST_ENTRY(single_softcap_window_scale),
    TEST_ENTRY(single_sinks),
    TEST_ENTRY(single_io_dtypes),
    TEST_ENTRY(single_large_logits),
    TEST_ENTRY(single_large_scores_exact),
    TEST_ENTRY(single_int8_query_precision),
    TEST_ENTRY(single_register_tiles),
    TEST_ENTRY(single_int8_grouped),
    TEST_ENTRY(decode_in_256k_of_stack),
    TEST_ENTRY(paged_int8_grouped),
    TEST_ENTRY(amx_level_tables),
    TEST_ENTRY(prefill_gemm_chains),
    TEST_ENTRY(paged_ragged),
    TEST_ENTRY(rejects),
    {0, 0},
};
