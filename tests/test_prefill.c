/*
 * Prefill attention (prefill.h) against a plain double-precision reference
 * on the dequantized K/V, for every ISA: single / paged / ragged, every
 * storage dtype, NHD/HND, GQA, causal, window, soft cap, custom and packed
 * masks, empty and fully masked rows, qo_len > kv_len, large negative
 * scores; bitwise properties (1 vs 2 threads, batched vs single request,
 * a causal row vs the same row run alone, mask equal to causal); cascade;
 * rejected inputs leave the outputs untouched.
 */
#include <stdlib.h>

#include "test_elems.h"

/* ---- K/V storage ------------------------------------------------------------ */

/* A K/V pair (with scales for int8/int4): paged (P, ps, H, D) / (P, H, ps, D)
 * or contiguous (ps, H, D) / (H, ps, D) (P = 1), rows padded to Dst. */
typedef struct store {
    kvc_dtype dt, sdt;
    kvc_kv_layout layout;
    int paged, group;
    int64_t P, ps, H, D, Dst, ng;
    void *k, *v, *ks, *vs;
    kvc_tensor tk, tv, tks, tvs;
} store;

static int is_quant(kvc_dtype dt) { return dt == KVC_I8 || dt == KVC_I4; }

static int64_t st_off(const store *s, int64_t page, int64_t slot, int64_t h, int64_t row) {
    return s->layout == KVC_NHD ? ((page * s->ps + slot) * s->H + h) * row
                                : ((page * s->H + h) * s->ps + slot) * row;
}

static void make_tensor(const store *s, void *data, kvc_dtype dt, int64_t last, int64_t row,
                        kvc_tensor *t) {
    int64_t sh[4];
    int nd = 0;
    if (s->paged) sh[nd++] = s->P;
    if (s->layout == KVC_NHD) sh[nd++] = s->ps, sh[nd++] = s->H;
    else sh[nd++] = s->H, sh[nd++] = s->ps;
    sh[nd++] = last;
    *t = kvc_tensor_make(data, dt, nd, sh);
    t->stride[nd - 2] = row;
    for (int i = nd - 3; i >= 0; i--) t->stride[i] = t->stride[i + 1] * sh[i + 1];
}

static void store_init(store *s, kvc_dtype dt, kvc_dtype sdt, int group, kvc_kv_layout layout,
                       int paged, int64_t P, int64_t ps, int64_t H, int64_t D) {
    memset(s, 0, sizeof *s);
    s->dt = dt, s->sdt = sdt, s->group = group, s->layout = layout, s->paged = paged;
    s->P = paged ? P : 1, s->ps = ps, s->H = H, s->D = D, s->Dst = D + 8;
    s->ng = is_quant(dt) ? D / group : 1;
    const int64_t n = s->P * ps * H * s->Dst, ns = s->P * ps * H * s->ng;
    s->k = calloc(1, dt_bytes(dt, n) + 64);
    s->v = calloc(1, dt_bytes(dt, n) + 64);
    make_tensor(s, s->k, dt, D, s->Dst, &s->tk);
    make_tensor(s, s->v, dt, D, s->Dst, &s->tv);
    if (is_quant(dt)) {
        s->ks = calloc(1, dt_bytes(sdt, ns) + 64);
        s->vs = calloc(1, dt_bytes(sdt, ns) + 64);
        make_tensor(s, s->ks, sdt, s->ng, s->ng, &s->tks);
        make_tensor(s, s->vs, sdt, s->ng, s->ng, &s->tvs);
    }
}

static void store_free(store *s) {
    free(s->k), free(s->v), free(s->ks), free(s->vs);
    memset(s, 0, sizeof *s);
}

/* Stored value (integer for int8/int4) and scale of (page, slot, h, d). */
static float raw_get(const store *s, int kv, int64_t pg, int64_t sl, int64_t h, int64_t d) {
    return get_f(kv ? s->v : s->k, s->dt, st_off(s, pg, sl, h, s->Dst) + d);
}
static float scale_get(const store *s, int kv, int64_t pg, int64_t sl, int64_t h, int64_t d) {
    return is_quant(s->dt) ? get_f(kv ? s->vs : s->ks, s->sdt, st_off(s, pg, sl, h, s->ng) + d / s->group)
                           : 1.0f;
}
static void raw_set(store *s, int kv, int64_t pg, int64_t sl, int64_t h, int64_t d, float x, float sc) {
    set_f(kv ? s->v : s->k, s->dt, st_off(s, pg, sl, h, s->Dst) + d, x);
    if (is_quant(s->dt) && d % s->group == 0)
        set_f(kv ? s->vs : s->ks, s->sdt, st_off(s, pg, sl, h, s->ng) + d / s->group, sc);
}
/* Dequantized value, as attention must see it. */
static double deq(const store *s, int kv, int64_t pg, int64_t sl, int64_t h, int64_t d) {
    return (double)raw_get(s, kv, pg, sl, h, d) * (double)scale_get(s, kv, pg, sl, h, d);
}

/* Random contents: floats in [-mag, mag), int8 up to +-127, int4 +-7 with
 * scales in [0.002, 0.012). */
static void store_fill(store *s, uint64_t *rng, float mag) {
    for (int64_t pg = 0; pg < s->P; pg++)
        for (int64_t sl = 0; sl < s->ps; sl++)
            for (int64_t h = 0; h < s->H; h++)
                for (int kv = 0; kv < 2; kv++) {
                    float sc = 1.0f;
                    for (int64_t d = 0; d < s->D; d++) {
                        if (d % s->group == 0) sc = 0.002f + 0.01f * fabsf(test_rng_f32(rng));
                        float x = test_rng_f32(rng) * mag;
                        if (s->dt == KVC_I8) x = rintf(test_rng_f32(rng) * 127.0f);
                        if (s->dt == KVC_I4) x = rintf(test_rng_f32(rng) * 7.0f);
                        raw_set(s, kv, pg, sl, h, d, x, sc);
                    }
                }
}

/* ---- reference ------------------------------------------------------------------ */

/* One request: q (qo, Hq, D), k/v (kv, H, D) doubles; mask (qo, kv) or NULL
 * (replaces causal). out (qo, Hq, D), lse (qo, Hq) base 2. */
typedef struct ref_req {
    int64_t qo, kv, Hq, H, D;
    const double *q, *k, *v;
    const uint8_t *mask;
    int causal, window;
    double sm, cap;
    const double *add; /* (Hq, qo, kv) additive mask or NULL */
    const float *sinks; /* (Hq) natural-unit sink logits or NULL */
} ref_req;

static void ref_attn(const ref_req *r, double *out, double *lse) {
    const double sm = r->sm > 0 ? r->sm : 1.0 / sqrt((double)r->D);
    const int64_t G = r->Hq / r->H;
    double *s = malloc(sizeof(double) * (size_t)(r->kv + 1));
    for (int64_t i = 0; i < r->qo; i++)
        for (int64_t hq = 0; hq < r->Hq; hq++) {
            const int64_t h = hq / G, diag = i + r->kv - r->qo;
            const double *qv = r->q + (i * r->Hq + hq) * r->D;
            double mx = -INFINITY;
            for (int64_t j = 0; j < r->kv; j++) {
                int vis = r->mask ? r->mask[i * r->kv + j] != 0 : (!r->causal || j <= diag);
                if (r->window >= 0 && j < diag - r->window) vis = 0;
                if (!vis) {
                    s[j] = -INFINITY;
                    continue;
                }
                double x = 0;
                for (int64_t d = 0; d < r->D; d++) x += qv[d] * r->k[(j * r->H + h) * r->D + d];
                x *= sm;
                if (r->cap > 0) x = r->cap * tanh(x / r->cap);
                if (r->add) x += r->add[(hq * r->qo + i) * r->kv + j];
                s[j] = x;
                if (x > mx) mx = x;
            }
            /* a sink: one more logit in the softmax, with no value row */
            const double t = r->sinks ? (double)r->sinks[hq] : -INFINITY;
            if (t > mx) mx = t;
            double *o = out + (i * r->Hq + hq) * r->D, sum = t > -INFINITY ? exp(t - mx) : 0.0;
            for (int64_t d = 0; d < r->D; d++) o[d] = 0;
            if (mx > -INFINITY)
                for (int64_t j = 0; j < r->kv; j++) {
                    if (s[j] == -INFINITY) continue;
                    const double w = exp(s[j] - mx);
                    sum += w;
                    for (int64_t d = 0; d < r->D; d++) o[d] += w * r->v[(j * r->H + h) * r->D + d];
                }
            for (int64_t d = 0; d < r->D; d++) o[d] = sum > 0 ? o[d] / sum : 0.0;
            lse[i * r->Hq + hq] = sum > 0 ? (mx + log(sum)) / log(2.0) : -INFINITY;
        }
    free(s);
}

/* Compares rows [0, qo) of out (strides so, sh) / lse with the reference. */
static int compare(const kvc_tensor *out, const float *lse, int64_t l_sr, int64_t row0,
                   const double *ro, const double *rl, int64_t qo, int64_t Hq, int64_t D,
                   double tol, const char *what) {
    for (int64_t i = 0; i < qo; i++)
        for (int64_t hq = 0; hq < Hq; hq++) {
            for (int64_t d = 0; d < D; d++) {
                const double g = get_f(out->data, out->dtype,
                                       (row0 + i) * out->stride[0] + hq * out->stride[1] + d);
                const double r = ro[(i * Hq + hq) * D + d];
                if (!(fabs(g - r) <= tol * (1.0 + fabs(r))))
                    TEST_FAIL_("%s: out[%lld, %lld, %lld] %.9g vs ref %.9g (tol %g)", what,
                               (long long)i, (long long)hq, (long long)d, g, r, tol);
            }
            if (!lse) continue;
            const double g = lse[(row0 + i) * l_sr + hq], r = rl[i * Hq + hq];
            if (isinf(r)) {
                if (!(isinf(g) && g < 0))
                    TEST_FAIL_("%s: lse[%lld, %lld] %g, want -inf", what, (long long)i,
                               (long long)hq, g);
            } else if (!(fabs(g - r) <= tol * (1.0 + fabs(r)))) {
                TEST_FAIL_("%s: lse[%lld, %lld] %.9g vs ref %.9g", what, (long long)i,
                           (long long)hq, g, r);
            }
        }
    return 0;
}

static double tol_for(kvc_dtype od, kvc_dtype kd, kvc_dtype qd) {
    if (od == KVC_BF16) return 8e-3;
    if (od == KVC_F16) return 1e-3;
    return kd == KVC_F32 && qd == KVC_F32 ? 1e-5 : 2e-5;
}

/* ---- one batched case ------------------------------------------------------------ */

typedef struct pcase {
    kvc_dtype kd, sd, qd, od;
    kvc_kv_layout layout;
    int64_t ps, Hq, H, D;
    int B;
    const int64_t *qo, *kv;
    int causal, window, mask; /* mask: 0 none, 1 boolean, 2 packed, 3 boolean = causal */
    float cap, sm, qmag;
    int ragged;               /* ragged K/V instead of pages */
    int check_single;         /* also: each request alone through kvc_single_prefill */
    const float *sinks;       /* (Hq) or NULL */
} pcase;

/* Copies request b's keys (pages idx, n keys) into a contiguous store. */
static void copy_request(const store *src, const int32_t *idx, int64_t n, store *dst) {
    for (int64_t j = 0; j < n; j++) {
        const int64_t pg = src->paged ? idx[j / src->ps] : 0, sl = src->paged ? j % src->ps : idx[0] + j;
        for (int64_t h = 0; h < src->H; h++)
            for (int kv = 0; kv < 2; kv++)
                for (int64_t d = 0; d < src->D; d++)
                    raw_set(dst, kv, 0, j, h, d, raw_get(src, kv, pg, sl, h, d),
                            scale_get(src, kv, pg, sl, h, d));
    }
}

/* K/V of request b as doubles (n, H, D). */
static void gather(const store *s, const int32_t *idx, int64_t n, int kv, double *out) {
    for (int64_t j = 0; j < n; j++) {
        const int64_t pg = s->paged ? idx[j / s->ps] : 0, sl = s->paged ? j % s->ps : idx[0] + j;
        for (int64_t h = 0; h < s->H; h++)
            for (int64_t d = 0; d < s->D; d++)
                out[(j * s->H + h) * s->D + d] = deq(s, kv, pg, sl, h, d);
    }
}

static void pack_bits(const uint8_t *m, int64_t n, uint8_t *out) {
    memset(out, 0, (size_t)((n + 7) / 8));
    for (int64_t i = 0; i < n; i++)
        if (m[i]) out[i >> 3] |= (uint8_t)(1u << (i & 7));
}

static int run_case(const pcase *c, uint64_t seed) {
    const int B = c->B;
    const int64_t Hq = c->Hq, H = c->H, D = c->D, ps = c->ps;
    uint64_t rng = seed;
    int rc = 0;
    char what[256];
    snprintf(what, sizeof what,
             "%s k=%s q=%s o=%s %s ps %lld Hq %lld H %lld D %lld B %d causal %d win %d mask %d "
             "cap %g isa %s",
             c->ragged ? "ragged" : "paged", kvc_dtype_name(c->kd), kvc_dtype_name(c->qd),
             kvc_dtype_name(c->od), c->layout == KVC_NHD ? "NHD" : "HND", (long long)ps,
             (long long)Hq, (long long)H, (long long)D, B, c->causal, c->window, c->mask,
             (double)c->cap, kvc_isa_name(kvc_get_isa()));
    /* tables */
    int32_t *qo_indptr = calloc((size_t)B + 1, 4), *kv_indptr = calloc((size_t)B + 1, 4);
    int32_t *last = calloc((size_t)B + 1, 4);
    int64_t pages = 0, nnz = 0, nkv = 0, mbits = 0, mbytes = 0, maxkv = 0;
    for (int b = 0; b < B; b++) {
        const int64_t np = c->ragged ? c->kv[b] : (c->kv[b] + ps - 1) / ps;
        qo_indptr[b + 1] = (int32_t)(qo_indptr[b] + c->qo[b]);
        kv_indptr[b + 1] = (int32_t)(kv_indptr[b] + np);
        last[b] = (int32_t)(c->ragged ? 0 : np ? c->kv[b] - (np - 1) * ps : 0);
        pages += np;
        nnz += c->qo[b];
        nkv += c->kv[b];
        mbits += c->qo[b] * c->kv[b];
        mbytes += (c->qo[b] * c->kv[b] + 7) / 8;
        if (c->kv[b] > maxkv) maxkv = c->kv[b];
    }
    const int64_t P = pages + 2;
    int32_t *indices = calloc((size_t)P, 4);
    for (int64_t i = 0; i < P; i++) indices[i] = (int32_t)i;
    for (int64_t i = P - 1; i > 0; i--) {
        const int64_t j = (int64_t)(test_rng_next(&rng) % (uint64_t)(i + 1));
        const int32_t t = indices[i];
        indices[i] = indices[j], indices[j] = t;
    }
    store s;
    if (c->ragged) store_init(&s, c->kd, c->sd, 8, c->layout, 0, 1, nkv > 0 ? nkv : 1, H, D);
    else store_init(&s, c->kd, c->sd, 8, c->layout, 1, P, ps, H, D);
    store_fill(&s, &rng, 1.0f);
    if (c->ragged) { /* shape (nkv, H, D) exactly */
        s.tk.shape[c->layout == KVC_NHD ? 0 : 1] = nkv;
        s.tv.shape[c->layout == KVC_NHD ? 0 : 1] = nkv;
        if (is_quant(c->kd)) {
            s.tks.shape[c->layout == KVC_NHD ? 0 : 1] = nkv;
            s.tvs.shape[c->layout == KVC_NHD ? 0 : 1] = nkv;
        }
    }
    /* q (nnz, Hq, D) with padded head stride; out likewise */
    const int64_t qh = D + 4, qn = (nnz + 1) * Hq * qh;
    void *qb = calloc(1, dt_bytes(c->qd, qn) + 64);
    fill_random(qb, c->qd, qn, &rng, c->qmag > 0 ? c->qmag : 1.0f);
    int64_t qsh[3] = {nnz, Hq, D}, lsh[2] = {nnz, Hq};
    kvc_tensor tq = kvc_tensor_make(qb, c->qd, 3, qsh);
    tq.stride[1] = qh, tq.stride[0] = Hq * qh;
    void *ob[2] = {calloc(1, dt_bytes(c->od, qn) + 64), calloc(1, dt_bytes(c->od, qn) + 64)};
    float *lse[2] = {calloc((size_t)(nnz + 1) * (size_t)Hq, 4), calloc((size_t)(nnz + 1) * (size_t)Hq, 4)};
    kvc_tensor to[2], tl[2];
    for (int i = 0; i < 2; i++) {
        to[i] = tq;
        to[i].data = ob[i];
        to[i].dtype = c->od;
        tl[i] = kvc_tensor_make(lse[i], KVC_F32, 2, lsh);
    }
    /* masks: boolean, flat */
    uint8_t *mb = calloc((size_t)mbits + 1, 1), *mp = calloc((size_t)mbytes + 1, 1);
    for (int64_t b = 0, e = 0, o = 0; b < B; b++) {
        for (int64_t i = 0; i < c->qo[b]; i++)
            for (int64_t j = 0; j < c->kv[b]; j++, e++)
                mb[e] = c->mask == 3 ? j <= i + c->kv[b] - c->qo[b]
                                     : (test_rng_next(&rng) % 10) < 7 || j == 0;
        pack_bits(mb + e - c->qo[b] * c->kv[b], c->qo[b] * c->kv[b], mp + o);
        o += (c->qo[b] * c->kv[b] + 7) / 8;
    }
    int64_t nb1 = B + 1, nbb = B, npg = pages, nmb = mbits, nmp = mbytes;
    kvc_tensor t_qo = kvc_tensor_make(qo_indptr, KVC_I32, 1, &nb1),
               t_kv = kvc_tensor_make(kv_indptr, KVC_I32, 1, &nb1),
               t_idx = kvc_tensor_make(indices, KVC_I32, 1, &npg),
               t_last = kvc_tensor_make(last, KVC_I32, 1, &nbb),
               t_mb = kvc_tensor_make(mb, KVC_U8, 1, &nmb), t_mp = kvc_tensor_make(mp, KVC_U8, 1, &nmp);
    const kvc_tensor *cm = c->mask == 1 || c->mask == 3 ? &t_mb : NULL, *pm = c->mask == 2 ? &t_mp : NULL;
    kvc_paged_cache pc;
    memset(&pc, 0, sizeof pc);
    pc.k = s.tk, pc.v = s.tv, pc.k_scale = s.tks, pc.v_scale = s.tvs;
    pc.layout = c->layout, pc.quant_group = 8;
    kvc_attn_params p = kvc_attn_default_params();
    p.sm_scale = c->sm, p.logits_soft_cap = c->cap, p.window_left = c->window;
    p.sinks = c->sinks;
    /* run with 1 and 2 threads */
    for (int nt = 1; nt <= 2 && !rc; nt++) {
        kvc_prefill_plan *plan = NULL;
        kvc_status st;
        if (c->ragged)
            st = kvc_prefill_plan_create_ragged(&t_qo, &t_kv, (int32_t)Hq, (int32_t)H, (int32_t)D,
                                                c->causal, cm, pm, nt, &plan);
        else
            st = kvc_prefill_plan_create_paged(&t_qo, &t_kv, &t_idx, &t_last, (int32_t)Hq,
                                               (int32_t)H, (int32_t)D, (int32_t)ps, c->causal, cm,
                                               pm, nt, &plan);
        if (st == KVC_OK) {
            if (c->ragged)
                st = kvc_prefill_run_ragged(plan, &tq, &s.tk, &s.tv, &s.tks, &s.tvs, 8, c->layout,
                                            &p, &to[nt - 1], &tl[nt - 1], test_pool(nt));
            else
                st = kvc_prefill_run_paged(plan, &tq, &pc, &p, &to[nt - 1], &tl[nt - 1],
                                           test_pool(nt));
        }
        kvc_prefill_plan_destroy(plan);
        if (st != KVC_OK) {
            fprintf(stderr, "  %s: %s\n", what, kvc_last_error());
            rc = 1;
        }
    }
    if (!rc && (memcmp(ob[0], ob[1], dt_bytes(c->od, qn)) ||
                memcmp(lse[0], lse[1], (size_t)(nnz * Hq) * 4))) {
        fprintf(stderr, "  %s: 2 threads differ from 1\n", what);
        rc = 1;
    }
    /* reference per request */
    double *qd = calloc((size_t)(maxkv + 1) * 0 + (size_t)(nnz + 1) * (size_t)(Hq * D), 8);
    double *kr = calloc((size_t)(maxkv + 1) * (size_t)(H * D), 8),
           *vr = calloc((size_t)(maxkv + 1) * (size_t)(H * D), 8);
    double *ro = calloc((size_t)(nnz + 1) * (size_t)(Hq * D), 8), *rl = calloc((size_t)(nnz + 1) * (size_t)Hq, 8);
    for (int64_t i = 0; i < nnz; i++)
        for (int64_t hq = 0; hq < Hq; hq++)
            for (int64_t d = 0; d < D; d++)
                qd[(i * Hq + hq) * D + d] = get_f(qb, c->qd, i * tq.stride[0] + hq * qh + d);
    const double tol = tol_for(c->od, c->kd, c->qd);
    for (int64_t b = 0, e = 0; b < B && !rc; b++) {
        const int32_t *idx = c->ragged ? kv_indptr + b : indices + kv_indptr[b];
        gather(&s, idx, c->kv[b], 0, kr);
        gather(&s, idx, c->kv[b], 1, vr);
        ref_req r = {c->qo[b], c->kv[b], Hq, H, D, qd + qo_indptr[b] * Hq * D, kr, vr,
                     c->mask ? mb + e : NULL, c->causal, c->window, c->sm, c->cap, NULL,
                     c->sinks};
        ref_attn(&r, ro, rl);
        rc = compare(&to[0], lse[0], Hq, qo_indptr[b], ro, rl, c->qo[b], Hq, D, tol, what);
        /* the same request alone, contiguous K/V: bitwise the batched rows */
        if (!rc && c->check_single && c->qo[b] > 0) {
            store one;
            store_init(&one, c->kd, c->sd, 8, c->layout, 0, 1, c->kv[b] > 0 ? c->kv[b] : 1, H, D);
            copy_request(&s, idx, c->kv[b], &one);
            one.tk.shape[c->layout == KVC_NHD ? 0 : 1] = c->kv[b];
            one.tv.shape[c->layout == KVC_NHD ? 0 : 1] = c->kv[b];
            one.tks.shape[c->layout == KVC_NHD ? 0 : 1] = c->kv[b];
            one.tvs.shape[c->layout == KVC_NHD ? 0 : 1] = c->kv[b];
            kvc_tensor q1 = tq, o1 = to[1], l1 = tl[1];
            q1.shape[0] = o1.shape[0] = l1.shape[0] = c->qo[b];
            q1.data = (char *)qb + dt_bytes(c->qd, qo_indptr[b] * tq.stride[0]);
            int64_t msh[2] = {c->qo[b], c->kv[b]}, pn = (c->qo[b] * c->kv[b] + 7) / 8;
            kvc_tensor m1 = kvc_tensor_make(mb + e, KVC_U8, 2, msh), p1 = kvc_tensor_make(
                mp, KVC_U8, 1, &pn);
            uint8_t *pk = calloc((size_t)pn + 1, 1);
            pack_bits(mb + e, c->qo[b] * c->kv[b], pk);
            p1.data = pk;
            memset(ob[1], 0, dt_bytes(c->od, qn));
            kvc_status st = kvc_single_prefill(
                &q1, &one.tk, &one.tv, is_quant(c->kd) ? &one.tks : NULL,
                is_quant(c->kd) ? &one.tvs : NULL, 8, c->layout, c->causal,
                c->mask == 1 || c->mask == 3 ? &m1 : NULL, c->mask == 2 ? &p1 : NULL, &p, &o1, &l1,
                test_pool(2));
            if (st != KVC_OK) {
                fprintf(stderr, "  %s: single: %s\n", what, kvc_last_error());
                rc = 1;
            }
            const size_t rowb = dt_bytes(c->od, tq.stride[0]);
            if (!rc && (memcmp((char *)ob[0] + rowb * (size_t)qo_indptr[b], ob[1],
                               rowb * (size_t)c->qo[b]) ||
                        memcmp(lse[0] + qo_indptr[b] * Hq, lse[1], (size_t)(c->qo[b] * Hq) * 4))) {
                fprintf(stderr, "  %s: request %lld alone differs from the batch\n", what,
                        (long long)b);
                rc = 1;
            }
            free(pk);
            store_free(&one);
        }
        e += c->qo[b] * c->kv[b];
    }
    free(qo_indptr), free(kv_indptr), free(last), free(indices), free(qb), free(ob[0]), free(ob[1]);
    free(lse[0]), free(lse[1]), free(mb), free(mp), free(qd), free(kr), free(vr), free(ro), free(rl);
    store_free(&s);
    return rc;
}

static pcase base(void) {
    pcase c;
    memset(&c, 0, sizeof c);
    c.kd = KVC_F16, c.sd = KVC_F16, c.qd = KVC_F32, c.od = KVC_F32;
    c.layout = KVC_NHD, c.ps = 16, c.Hq = 4, c.H = 2, c.D = 64, c.window = -1;
    return c;
}

/* ---- tests ------------------------------------------------------------------------ */

/* Every storage dtype and layout, page sizes, GQA, causal or not, batched
 * vs alone. */
TEST(paged_dtypes_layouts) {
    static const kvc_dtype kds[5] = {KVC_F32, KVC_F16, KVC_BF16, KVC_I8, KVC_I4};
    static const int64_t qo[3] = {17, 1, 5}, kv[3] = {54, 7, 40};
    FOR_EACH_ISA({
        for (int di = 0; di < 5; di++)
            for (int lay = 0; lay < 2; lay++) {
                pcase c = base();
                c.kd = kds[di];
                c.sd = di == 4 ? KVC_F32 : KVC_F16;
                c.layout = (kvc_kv_layout)lay;
                c.ps = lay ? 5 : 16;
                c.B = 3, c.qo = qo, c.kv = kv;
                c.causal = (di + lay) % 2;
                c.check_single = 1;
                if (run_case(&c, test_seed + (uint64_t)(di * 2 + lay)) != 0) return 1;
            }
    });
    return 0;
}

/* The shape grid of the issue, sampled: batch {1, 3, 17}, kv {1, 7, 54,
 * 512, 2048}, qo {1, 17, 127}, page size {1, 5, 16}, Hq/H {1, 4, 8},
 * Dh {64, 128}. */
TEST(paged_grid) {
    static const int64_t kvs[5] = {1, 7, 54, 512, 2048}, qos[3] = {1, 17, 127};
    static const int64_t pss[3] = {1, 5, 16}, gs[3] = {1, 4, 8}, Ds[2] = {64, 128};
    static const int Bs[3] = {1, 3, 17};
    static const kvc_dtype kds[5] = {KVC_F16, KVC_I8, KVC_BF16, KVC_I4, KVC_F32};
    uint64_t rng = test_seed ^ 0x5eed;
    FOR_EACH_ISA({
        for (int it = 0; it < 8; it++) { /* rng runs on: each ISA samples other shapes */
            pcase c = base();
            const int B = Bs[it % 3];
            c.ps = pss[it % 3];
            c.H = 1 + (int64_t)(test_rng_next(&rng) % 2);
            c.Hq = c.H * gs[(it / 3) % 3];
            c.D = Ds[it % 2];
            if (B == 17) c.Hq = c.H = 1;
            int64_t qo[17], kv[17];
            int64_t work = 0;
            for (int b = 0; b < B; b++) {
                qo[b] = qos[test_rng_next(&rng) % 3];
                kv[b] = kvs[test_rng_next(&rng) % 5];
                /* keep the double reference affordable under sanitizers */
                if ((work + qo[b] * kv[b]) * c.Hq * c.D > 20000000) kv[b] = kvs[test_rng_next(&rng) % 3];
                work += qo[b] * kv[b];
            }
            c.B = B, c.qo = qo, c.kv = kv;
            c.kd = kds[it % 5];
            c.sd = it % 2 ? KVC_F32 : KVC_F16;
            c.layout = (kvc_kv_layout)(it % 2);
            c.causal = it % 4 != 1;
            c.qd = it % 3 == 0 ? KVC_F16 : KVC_F32;
            c.check_single = it % 3 == 2;
            if (run_case(&c, test_seed + 100 + (uint64_t)it) != 0) return 1;
        }
    });
    return 0;
}

/* One long request (kv 2048, qo 100): many key blocks, two query tiles;
 * causal on one ISA, not on the next. */
TEST(long_request) {
    static const int64_t qo[1] = {100}, kv[1] = {2048};
    int n = 0;
    FOR_EACH_ISA({
        pcase c = base();
        c.B = 1, c.qo = qo, c.kv = kv, c.Hq = 2, c.H = 1, c.D = 64;
        c.causal = n % 2 == 0;
        c.kd = c.causal ? KVC_I8 : KVC_F16;
        if (run_case(&c, test_seed + 7 + (uint64_t)n++) != 0) return 1;
    });
    return 0;
}

/* Ragged K/V, masks, windows, soft cap, sm_scale, io dtypes. */
TEST(ragged_masks_params) {
    static const int64_t qo[4] = {9, 0, 33, 70}, kv[4] = {30, 5, 33, 65};
    FOR_EACH_ISA({
        for (int v = 0; v < 8; v++) {
            pcase c = base();
            c.B = 4, c.qo = qo, c.kv = kv;
            c.ragged = v % 2 == 0;
            c.layout = (kvc_kv_layout)((v / 2) % 2);
            c.Hq = 6, c.H = 3, c.D = 40;
            c.mask = v % 4;                         /* none, bool, packed, bool == causal */
            c.causal = v % 3 == 0;
            c.window = v == 5 ? 0 : v == 6 ? 20 : v == 1 ? 3 : -1;
            c.cap = v == 4 ? 4.0f : 0.0f;
            c.sm = v == 7 ? 0.05f : 0.0f;
            c.kd = v % 3 == 1 ? KVC_I4 : v % 3 == 2 ? KVC_BF16 : KVC_F32;
            c.sd = KVC_F32;
            c.qd = v == 3 ? KVC_BF16 : v == 2 ? KVC_F16 : KVC_F32;
            c.od = v == 3 ? KVC_BF16 : v == 6 ? KVC_F16 : KVC_F32;
            c.check_single = 1;
            if (run_case(&c, test_seed + 200 + (uint64_t)v) != 0) return 1;
        }
    });
    return 0;
}

/* qo_len > kv_len with causal (rows with no key: zeros, lse -inf), empty
 * requests, window 0, fully masked rows. */
TEST(edge_rows) {
    static const int64_t qo[5] = {20, 3, 0, 4, 6}, kv[5] = {6, 0, 9, 1, 6};
    /* v 4-7 as 0-3 with attention sinks: rows with no key then output
     * zeros and the sink's lse (-inf where a head has none) */
    static const float sinks[4] = {1.5f, -INFINITY, -2.0f, 8.0f};
    FOR_EACH_ISA({
        for (int vs = 0; vs < 8; vs++) {
            const int v = vs % 4;
            pcase c = base();
            c.sinks = vs >= 4 ? sinks : NULL;
            c.B = 5, c.qo = qo, c.kv = kv;
            c.causal = v != 2;
            c.window = v == 1 ? 0 : -1;
            c.mask = v == 3 ? 1 : 0;
            c.ragged = v == 2;
            c.check_single = 1;
            if (v == 3) c.D = 33, c.Hq = 3, c.H = 1, c.kd = KVC_BF16; /* odd head dim */
            if (run_case(&c, test_seed + 300 + (uint64_t)vs) != 0) return 1;
        }
    });
    /* fully masked rows through a custom mask: zeros and -inf, no NaN */
    float q[3 * 2 * 8], k[4 * 1 * 8], v[4 * 1 * 8], out[3 * 2 * 8], lse[3 * 2];
    uint8_t m[3 * 4] = {0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0};
    for (int i = 0; i < 48; i++) q[i] = 0.3f;
    for (int i = 0; i < 32; i++) k[i] = 0.1f * (float)(i % 5), v[i] = (float)(i / 8);
    int64_t qsh[3] = {3, 2, 8}, ksh[3] = {4, 1, 8}, msh[2] = {3, 4}, lsh[2] = {3, 2};
    kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, qsh), tk = kvc_tensor_make(k, KVC_F32, 3, ksh),
               tv = kvc_tensor_make(v, KVC_F32, 3, ksh), to = kvc_tensor_make(out, KVC_F32, 3, qsh),
               tl = kvc_tensor_make(lse, KVC_F32, 2, lsh), tm = kvc_tensor_make(m, KVC_U8, 2, msh);
    FOR_EACH_ISA({
        memset(out, 0x7f, sizeof out);
        ASSERT_OK(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 1, &tm, NULL, NULL,
                                     &to, &tl, NULL));
        for (int h = 0; h < 2; h++) {
            ASSERT_TRUE(isinf(lse[h]) && lse[h] < 0);
            ASSERT_TRUE(isinf(lse[4 + h]) && lse[4 + h] < 0);
            double s0 = 0, s3 = 0;
            for (int d = 0; d < 8; d++) s0 += 0.3f * k[d], s3 += 0.3f * k[3 * 8 + d];
            s0 /= sqrt(8.0), s3 /= sqrt(8.0);
            ASSERT_NEAR(lse[2 + h], log(exp(s0) + exp(s3)) / log(2.0), 1e-5);
            for (int d = 0; d < 8; d++) {
                ASSERT_TRUE(out[h * 8 + d] == 0.0f && !signbit(out[h * 8 + d]));
                ASSERT_TRUE(out[(4 + h) * 8 + d] == 0.0f);
                ASSERT_TRUE(!isnan(out[(2 + h) * 8 + d]));
            }
        }
    });
    return 0;
}

/* Scores around -5e5 still beat masked keys: all visible scores are huge and
 * negative, the output is their softmax over V, not a masked key's V. */
TEST(large_negative_scores) {
    enum { L = 70, D = 16 };
    float q[2 * D], k[L * D], v[L * D], out[2 * D], lse[2];
    for (int d = 0; d < D; d++) q[d] = q[D + d] = d == 0 ? -1000.0f : 0.0f;
    for (int j = 0; j < L; j++)
        for (int d = 0; d < D; d++) {
            /* s_j = -1000 * k0 / 4: visible keys ~ -5e5, the rest near 0 */
            k[j * D + d] = d == 0 ? (j < 66 ? 2000.0f + (float)(j % 3) * 0.001f : 0.0f) : 0.0f;
            v[j * D + d] = (float)(j % 7);
        }
    int64_t qsh[3] = {2, 1, D}, ksh[3] = {L, 1, D}, lsh[2] = {2, 1}, msh[2] = {2, L};
    uint8_t m[2 * L];
    for (int j = 0; j < L; j++) m[j] = m[L + j] = j < 66;
    kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, qsh), tk = kvc_tensor_make(k, KVC_F32, 3, ksh),
               tv = kvc_tensor_make(v, KVC_F32, 3, ksh), to = kvc_tensor_make(out, KVC_F32, 3, qsh),
               tl = kvc_tensor_make(lse, KVC_F32, 2, lsh), tm = kvc_tensor_make(m, KVC_U8, 2, msh);
    /* reference in double */
    double w[L], sum = 0, mx = -INFINITY, o = 0;
    for (int j = 0; j < 66; j++) {
        w[j] = -1000.0 * (double)k[j * D] / 4.0;
        if (w[j] > mx) mx = w[j];
    }
    for (int j = 0; j < 66; j++) sum += exp(w[j] - mx), o += exp(w[j] - mx) * v[j * D];
    FOR_EACH_ISA({
        ASSERT_OK(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 0, &tm, NULL, NULL,
                                     &to, &tl, NULL));
        ASSERT_TRUE(lse[0] < -7e5);
        ASSERT_NEAR(lse[0], (mx + log(sum)) / log(2.0), 1e-5 * 7.3e5);
        ASSERT_NEAR(out[0], o / sum, 1e-3);
        /* and the same keys hidden by a window instead of the mask */
        kvc_attn_params p = kvc_attn_default_params();
        kvc_tensor tk2 = tk, tv2 = tv;
        tk2.shape[0] = tv2.shape[0] = 66;
        p.window_left = 65;
        ASSERT_OK(kvc_single_prefill(&tq, &tk2, &tv2, NULL, NULL, 0, KVC_NHD, 1, NULL, NULL, &p,
                                     &to, &tl, NULL));
        ASSERT_NEAR(out[D], o / sum, 1e-3);
    });
    return 0;
}

/* Row independence: row i of a causal prefill equals, bitwise, the same row
 * run as a one-row request over the keys it sees (with and without a
 * window), on every ISA. */
TEST(row_independence) {
    enum { QO = 100, KV = 300, Hq = 8, H = 2, D = 64, PS = 16 };
    const kvc_dtype kds[2] = {KVC_F16, KVC_I8};
    for (int di = 0; di < 2; di++) {
        uint64_t rng = test_seed + 400 + (uint64_t)di;
        store s;
        const int64_t np = (KV + PS - 1) / PS;
        store_init(&s, kds[di], KVC_F16, 8, di ? KVC_HND : KVC_NHD, 1, np, PS, H, D);
        store_fill(&s, &rng, 1.0f);
        kvc_paged_cache pc;
        memset(&pc, 0, sizeof pc);
        pc.k = s.tk, pc.v = s.tv, pc.k_scale = s.tks, pc.v_scale = s.tvs;
        pc.layout = s.layout, pc.quant_group = 8;
        int32_t idx[64];
        for (int i = 0; i < np; i++) idx[i] = (int32_t)((i * 5 + 3) % np);
        float *q = malloc(sizeof(float) * QO * Hq * D), *out = malloc(sizeof(float) * QO * Hq * D);
        float lse[QO * Hq], o1[Hq * D], l1[Hq];
        for (int i = 0; i < QO * Hq * D; i++) q[i] = test_rng_f32(&rng);
        int64_t qsh[3] = {QO, Hq, D}, lsh[2] = {QO, Hq}, n2 = 2, n1 = 1, nidx = np;
        int32_t qo_ptr[2] = {0, QO}, kv_ptr[2] = {0, (int32_t)np}, last[1] = {KV - (np - 1) * PS};
        kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, qsh), to = kvc_tensor_make(out, KVC_F32, 3, qsh),
                   tl = kvc_tensor_make(lse, KVC_F32, 2, lsh), tqo = kvc_tensor_make(qo_ptr, KVC_I32, 1, &n2),
                   tkv = kvc_tensor_make(kv_ptr, KVC_I32, 1, &n2), tix = kvc_tensor_make(idx, KVC_I32, 1, &nidx),
                   tla = kvc_tensor_make(last, KVC_I32, 1, &n1);
        FOR_EACH_ISA({
            for (int win = 0; win < 2; win++) {
                kvc_attn_params p = kvc_attn_default_params();
                p.window_left = win ? 77 : -1;
                kvc_prefill_plan *plan = NULL;
                qo_ptr[1] = QO, kv_ptr[1] = (int32_t)np, last[0] = (int32_t)(KV - (np - 1) * PS);
                ASSERT_OK(kvc_prefill_plan_create_paged(&tqo, &tkv, &tix, &tla, Hq, H, D, PS, 1,
                                                        NULL, NULL, 2, &plan));
                ASSERT_OK(kvc_prefill_run_paged(plan, &tq, &pc, &p, &to, &tl, test_pool(2)));
                kvc_prefill_plan_destroy(plan);
                for (int i = 0; i < QO; i += 7) {
                    const int64_t kvi = i + KV - QO + 1, npi = (kvi + PS - 1) / PS;
                    qo_ptr[1] = 1, kv_ptr[1] = (int32_t)npi, last[0] = (int32_t)(kvi - (npi - 1) * PS);
                    int64_t q1sh[3] = {1, Hq, D}, l1sh[2] = {1, Hq};
                    kvc_tensor tq1 = kvc_tensor_make(q + i * Hq * D, KVC_F32, 3, q1sh),
                               to1 = kvc_tensor_make(o1, KVC_F32, 3, q1sh),
                               tl1 = kvc_tensor_make(l1, KVC_F32, 2, l1sh);
                    tix.shape[0] = npi;
                    ASSERT_OK(kvc_prefill_plan_create_paged(&tqo, &tkv, &tix, &tla, Hq, H, D, PS,
                                                            1, NULL, NULL, 1, &plan));
                    ASSERT_OK(kvc_prefill_run_paged(plan, &tq1, &pc, &p, &to1, &tl1, NULL));
                    kvc_prefill_plan_destroy(plan);
                    tix.shape[0] = np;
                    ASSERT_MEM_EQ(o1, out + i * Hq * D, sizeof o1);
                    ASSERT_MEM_EQ(l1, lse + i * Hq, sizeof l1);
                }
            }
        });
        free(q), free(out);
        store_free(&s);
    }
    return 0;
}

/* A custom mask equal to causal gives the causal result bitwise, and the
 * packed mask equals the boolean one. */
TEST(mask_equivalences) {
    enum { QO = 37, KV = 90, Hq = 4, H = 1, D = 32 };
    uint64_t rng = test_seed + 500;
    store s;
    store_init(&s, KVC_BF16, KVC_F16, 8, KVC_NHD, 0, 1, KV, H, D);
    store_fill(&s, &rng, 1.0f);
    float *q = malloc(sizeof(float) * QO * Hq * D), *o[3];
    float l[3][QO * Hq];
    for (int i = 0; i < QO * Hq * D; i++) q[i] = test_rng_f32(&rng);
    for (int i = 0; i < 3; i++) o[i] = malloc(sizeof(float) * QO * Hq * D);
    uint8_t mb[QO * KV], mp[(QO * KV + 7) / 8];
    for (int i = 0; i < QO; i++)
        for (int j = 0; j < KV; j++) mb[i * KV + j] = j <= i + KV - QO;
    pack_bits(mb, QO * KV, mp);
    int64_t qsh[3] = {QO, Hq, D}, lsh[2] = {QO, Hq}, nm = QO * KV, np = (QO * KV + 7) / 8;
    kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, qsh), tm = kvc_tensor_make(mb, KVC_U8, 1, &nm),
               tp = kvc_tensor_make(mp, KVC_U8, 1, &np);
    FOR_EACH_ISA({
        for (int w = 0; w < 2; w++) {
            kvc_attn_params p = kvc_attn_default_params();
            p.window_left = w ? 10 : -1;
            for (int i = 0; i < 3; i++) {
                kvc_tensor to = kvc_tensor_make(o[i], KVC_F32, 3, qsh), tl = kvc_tensor_make(l[i], KVC_F32, 2, lsh);
                ASSERT_OK(kvc_single_prefill(&tq, &s.tk, &s.tv, NULL, NULL, 0, KVC_NHD, i == 0 || w,
                                             i == 1 ? &tm : NULL, i == 2 ? &tp : NULL, &p, &to, &tl,
                                             test_pool(2)));
            }
            ASSERT_MEM_EQ(o[0], o[1], sizeof(float) * QO * Hq * D);
            ASSERT_MEM_EQ(o[0], o[2], sizeof(float) * QO * Hq * D);
            ASSERT_MEM_EQ(l[0], l[1], sizeof l[0]);
            ASSERT_MEM_EQ(l[0], l[2], sizeof l[0]);
        }
    });
    for (int i = 0; i < 3; i++) free(o[i]);
    free(q);
    store_free(&s);
    return 0;
}

/* kvc_prefill_plan_set_causal: a plan made without causal, switched on,
 * gives the causal plan's bits (and back); a custom mask stays in force. */
TEST(set_causal) {
    enum { QO = 21, KV = 50, Hq = 4, H = 2, D = 32 };
    uint64_t rng = test_seed + 550;
    store s;
    store_init(&s, KVC_F16, KVC_F16, 8, KVC_NHD, 0, 1, KV, H, D);
    store_fill(&s, &rng, 1.0f);
    float q[QO * Hq * D], o[4][QO * Hq * D];
    for (int i = 0; i < QO * Hq * D; i++) q[i] = test_rng_f32(&rng);
    int32_t qo[2] = {0, QO}, kv[2] = {0, KV};
    uint8_t all[QO * KV];
    memset(all, 1, sizeof all);
    int64_t n2 = 2, nm = QO * KV, qsh[3] = {QO, Hq, D};
    kvc_tensor tqo = kvc_tensor_make(qo, KVC_I32, 1, &n2), tkv = kvc_tensor_make(kv, KVC_I32, 1, &n2),
               tm = kvc_tensor_make(all, KVC_U8, 1, &nm), tq = kvc_tensor_make(q, KVC_F32, 3, qsh);
    kvc_prefill_plan *pn = NULL, *pc = NULL, *pm = NULL;
    ASSERT_OK(kvc_prefill_plan_create_ragged(&tqo, &tkv, Hq, H, D, 0, NULL, NULL, 2, &pn));
    ASSERT_OK(kvc_prefill_plan_create_ragged(&tqo, &tkv, Hq, H, D, 1, NULL, NULL, 2, &pc));
    ASSERT_OK(kvc_prefill_plan_create_ragged(&tqo, &tkv, Hq, H, D, 0, &tm, NULL, 2, &pm));
#define RUN_INTO(plan, i)                                                                          \
    do {                                                                                           \
        kvc_tensor to_ = kvc_tensor_make(o[i], KVC_F32, 3, qsh);                                   \
        ASSERT_OK(kvc_prefill_run_ragged(plan, &tq, &s.tk, &s.tv, NULL, NULL, 0, KVC_NHD, NULL,    \
                                         &to_, NULL, test_pool(2)));                               \
    } while (0)
    RUN_INTO(pn, 0); /* not causal */
    RUN_INTO(pc, 1); /* causal */
    ASSERT_TRUE(memcmp(o[0], o[1], sizeof o[0]) != 0);
    ASSERT_OK(kvc_prefill_plan_set_causal(pn, 1));
    RUN_INTO(pn, 2);
    ASSERT_MEM_EQ(o[2], o[1], sizeof o[0]);
    ASSERT_OK(kvc_prefill_plan_set_causal(pn, 0));
    RUN_INTO(pn, 2);
    ASSERT_MEM_EQ(o[2], o[0], sizeof o[0]);
    ASSERT_OK(kvc_prefill_plan_set_causal(pm, 1)); /* the all-visible mask stays */
    RUN_INTO(pm, 3);
    ASSERT_MEM_EQ(o[3], o[0], sizeof o[0]);
#undef RUN_INTO
    ASSERT_STATUS(kvc_prefill_plan_set_causal(pn, 2), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_prefill_plan_set_causal(NULL, 1), KVC_ERR_INVALID_ARG);
    kvc_prefill_plan_destroy(pn);
    kvc_prefill_plan_destroy(pc);
    kvc_prefill_plan_destroy(pm);
    store_free(&s);
    return 0;
}

/* ---- cascade ------------------------------------------------------------------ */

/* Two levels (a shared prefix for all requests at level 0, each request's
 * own pages causal at level 1) equal a one-level causal prefill over the
 * concatenated pages. */
TEST(cascade_two_levels) {
    enum { B = 3, Hq = 4, H = 2, D = 64, PS = 8, PRE = 4 /* prefix pages */ };
    const int64_t uniq[B] = {21, 9, 40}, qo[B] = {5, 9, 17};
    uint64_t rng = test_seed + 600;
    const kvc_dtype kds[2] = {KVC_F16, KVC_I4};
    for (int di = 0; di < 2; di++) {
        int64_t npu[B], tot = PRE, nnz = 0;
        for (int b = 0; b < B; b++) npu[b] = (uniq[b] + PS - 1) / PS, tot += npu[b], nnz += qo[b];
        store s;
        store_init(&s, kds[di], KVC_F32, 8, di ? KVC_HND : KVC_NHD, 1, tot, PS, H, D);
        store_fill(&s, &rng, 1.0f);
        kvc_paged_cache pc;
        memset(&pc, 0, sizeof pc);
        pc.k = s.tk, pc.v = s.tv, pc.k_scale = s.tks, pc.v_scale = s.tvs;
        pc.layout = s.layout, pc.quant_group = 8;
        /* level 0: one request holding every row; level 1: per request */
        int32_t qo0[2] = {0, (int32_t)nnz}, kv0[2] = {0, PRE}, idx0[PRE], last0[1] = {PS};
        int32_t qo1[B + 1] = {0}, kv1[B + 1] = {0}, idx1[64], last1[B];
        int32_t kvf[B + 1] = {0}, idxf[128], lastf[B];
        for (int i = 0; i < PRE; i++) idx0[i] = i;
        int32_t nxt = PRE;
        for (int b = 0; b < B; b++) {
            qo1[b + 1] = qo1[b] + (int32_t)qo[b];
            kv1[b + 1] = kv1[b] + (int32_t)npu[b];
            kvf[b + 1] = kvf[b] + PRE + (int32_t)npu[b];
            for (int i = 0; i < PRE; i++) idxf[kvf[b] + i] = i;
            for (int i = 0; i < npu[b]; i++) idx1[kv1[b] + i] = idxf[kvf[b] + PRE + i] = nxt++;
            last1[b] = lastf[b] = (int32_t)(uniq[b] - (npu[b] - 1) * PS);
        }
        int64_t n2 = 2, n1 = 1, npre = PRE, nb1 = B + 1, nb = B, ni1 = kv1[B], nif = kvf[B];
        kvc_tensor tqo[2] = {kvc_tensor_make(qo0, KVC_I32, 1, &n2), kvc_tensor_make(qo1, KVC_I32, 1, &nb1)};
        kvc_tensor tkv[2] = {kvc_tensor_make(kv0, KVC_I32, 1, &n2), kvc_tensor_make(kv1, KVC_I32, 1, &nb1)};
        kvc_tensor tix[2] = {kvc_tensor_make(idx0, KVC_I32, 1, &npre), kvc_tensor_make(idx1, KVC_I32, 1, &ni1)};
        kvc_tensor tla[2] = {kvc_tensor_make(last0, KVC_I32, 1, &n1), kvc_tensor_make(last1, KVC_I32, 1, &nb)};
        kvc_tensor tkvf = kvc_tensor_make(kvf, KVC_I32, 1, &nb1), tixf = kvc_tensor_make(idxf, KVC_I32, 1, &nif),
                   tlaf = kvc_tensor_make(lastf, KVC_I32, 1, &nb);
        float *q = malloc(sizeof(float) * (size_t)(nnz * Hq * D));
        uint16_t *oc = malloc(2 * (size_t)(nnz * Hq * D));
        float *of = malloc(sizeof(float) * (size_t)(nnz * Hq * D)), *lc = malloc(sizeof(float) * (size_t)(nnz * Hq)),
              *lf = malloc(sizeof(float) * (size_t)(nnz * Hq));
        for (int64_t i = 0; i < nnz * Hq * D; i++) q[i] = test_rng_f32(&rng);
        int64_t qsh[3] = {nnz, Hq, D}, lsh[2] = {nnz, Hq};
        kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, qsh), toc = kvc_tensor_make(oc, KVC_F16, 3, qsh),
                   tof = kvc_tensor_make(of, KVC_F32, 3, qsh), tlc = kvc_tensor_make(lc, KVC_F32, 2, lsh),
                   tlf = kvc_tensor_make(lf, KVC_F32, 2, lsh);
        /* with sinks (second pass): counted once, after the levels, as by
         * the one-level prefill over the same keys */
        const float sinks[Hq] = {-INFINITY, 0.5f, 3.0f, -2.0f};
        kvc_attn_params ps = kvc_attn_default_params();
        ps.sinks = sinks;
        FOR_EACH_ISA({
            for (int run = 0; run < 4; run++) {
                const int nt = 1 + run % 2;
                const kvc_attn_params *pp = run < 2 ? NULL : &ps;
                kvc_cascade_plan *cp = NULL;
                kvc_prefill_plan *fp = NULL;
                ASSERT_OK(kvc_cascade_plan_create(2, tqo, tkv, tix, tla, Hq, H, D, PS, 1, nt, &cp));
                ASSERT_OK(kvc_cascade_run(cp, &tq, &pc, pp, &toc, &tlc, test_pool(nt)));
                kvc_cascade_plan_destroy(cp);
                ASSERT_OK(kvc_prefill_plan_create_paged(&tqo[1], &tkvf, &tixf, &tlaf, Hq, H, D, PS,
                                                        1, NULL, NULL, nt, &fp));
                ASSERT_OK(kvc_prefill_run_paged(fp, &tq, &pc, pp, &tof, &tlf, test_pool(nt)));
                kvc_prefill_plan_destroy(fp);
                for (int64_t i = 0; i < nnz * Hq * D; i++)
                    ASSERT_NEAR(kvc_f16_to_f32(oc[i]), of[i], 1e-3 * (1 + fabs(of[i])));
                for (int64_t i = 0; i < nnz * Hq; i++) ASSERT_NEAR(lc[i], lf[i], 1e-5 * (1 + fabs(lf[i])));
            }
        });
        free(q), free(oc), free(of), free(lc), free(lf);
        store_free(&s);
    }
    return 0;
}

/* ---- pmx MultiHeadCacheAttention ------------------------------------------------ */

static const int mh_tok[4] = {0, 1, 2, 3}, mh_head[4] = {3, 3, 3, 2};
static const int mh_layer[4] = {1, 0, 0, 0}, mh_kv[4] = {2, 2, 1, 1};

static int64_t mh_off(const kvc_tensor *t, int layout, int64_t layer, int kv, int64_t slot,
                      int64_t h, int64_t d) {
    return layer * t->stride[mh_layer[layout]] + kv * t->stride[mh_kv[layout]] +
           slot * t->stride[mh_tok[layout]] + h * t->stride[mh_head[layout]] + d;
}

static void mh_shape(int layout, int64_t T, int64_t L, int64_t H, int64_t last, int64_t *sh) {
    int64_t v[5];
    v[mh_tok[layout]] = T, v[mh_layer[layout]] = L, v[mh_kv[layout]] = 2, v[mh_head[layout]] = H;
    v[4] = last;
    memcpy(sh, v, sizeof v);
}

/* One MHCA call over a cache filled with random "past" tokens, compared
 * with the reference on the cache dequantized after the call. */
static int run_mhca(int layout, int mode, kvc_dtype cd, int maskdim, int64_t Hq, int64_t H,
                    int64_t D, uint64_t seed) {
    enum { B = 3, NL = 2, LAYER = 1, PS = 8, QG = 8, MAXP = 6, T = 4 * PS * MAXP };
    const int64_t seq[B] = {1, 13, 6}, past[B] = {20, 9, 0};
    const int quant = is_quant(cd);
    uint64_t rng = seed;
    int64_t ss[B + 1] = {0}, ks[B + 1] = {0}, sp[B], maxs = 0, maxk = 0;
    for (int b = 0; b < B; b++) {
        ss[b + 1] = ss[b] + seq[b], ks[b + 1] = ks[b] + seq[b] + past[b], sp[b] = past[b];
        if (seq[b] > maxs) maxs = seq[b];
        if (seq[b] + past[b] > maxk) maxk = seq[b] + past[b];
    }
    const int64_t nq = ss[B], nkv = ks[B];
    int64_t cs0[B], cs1[B * MAXP];
    for (int b = 0; b < B; b++) {
        cs0[b] = 2 + b * 40; /* offsets: disjoint ranges */
        for (int p = 0; p < MAXP; p++) cs1[b * MAXP + p] = -1;
        for (int p = 0; p * PS < seq[b] + past[b]; p++)
            cs1[b * MAXP + p] = ((p * 3 + b * 7 + 1) % (T / PS)) * PS; /* scattered pages */
    }
    /* make the mode-1 pages distinct */
    {
        int used[T / PS] = {0}, nxt = 0;
        for (int b = 0; b < B; b++)
            for (int p = 0; p < MAXP; p++)
                if (cs1[b * MAXP + p] >= 0) {
                    while (used[(nxt * 5 + 3) % (T / PS)]) nxt++;
                    used[(nxt * 5 + 3) % (T / PS)] = 1;
                    cs1[b * MAXP + p] = (int64_t)((nxt * 5 + 3) % (T / PS)) * PS;
                }
    }
    int64_t csh[5], ssh[5];
    mh_shape(layout, T, NL, H, D, csh);
    mh_shape(layout, T, NL, H, D / QG, ssh);
    const int64_t cn = T * NL * 2 * H * D, sn = T * NL * 2 * H * (D / QG);
    void *cache = calloc(1, dt_bytes(cd, cn) + 64), *scale = calloc(1, (size_t)sn * 4 + 64);
    kvc_tensor tc = kvc_tensor_make(cache, cd, 5, csh), tsc = kvc_tensor_make(scale, KVC_F32, 5, ssh);
    fill_random(cache, cd, cn, &rng, 1.0f);
    for (int64_t i = 0; i < sn; i++) ((float *)scale)[i] = 0.002f + 0.01f * fabsf(test_rng_f32(&rng));
    float *q = malloc(sizeof(float) * (size_t)(nq * Hq * D)), *ck = malloc(sizeof(float) * (size_t)(nq * H * D)),
          *cv = malloc(sizeof(float) * (size_t)(nq * H * D));
    uint16_t *out = calloc((size_t)(nq * Hq * D) + 1, 2);
    for (int64_t i = 0; i < nq * Hq * D; i++) q[i] = test_rng_f32(&rng);
    for (int64_t i = 0; i < nq * H * D; i++) ck[i] = test_rng_f32(&rng), cv[i] = test_rng_f32(&rng);
    /* q as float16 (the output takes q's dtype) */
    uint16_t *qh = malloc(2 * (size_t)(nq * Hq * D));
    for (int64_t i = 0; i < nq * Hq * D; i++) qh[i] = kvc_f32_to_f16(q[i]), q[i] = kvc_f16_to_f32(qh[i]);
    const int64_t mcols = nkv + 3, mheads = maskdim == 3 ? Hq : 1;
    float *mask = malloc(sizeof(float) * (size_t)(mheads * nq * mcols));
    for (int64_t i = 0; i < mheads * nq * mcols; i++)
        mask[i] = test_rng_next(&rng) % 9 == 0 ? -INFINITY : 0.5f * test_rng_f32(&rng);
    int64_t qsh[3] = {nq, Hq, D}, ksh[3] = {nq, H, D}, nb1 = B + 1, nb = B, one = 1;
    int64_t csh1[2] = {B, MAXP}, msh[3] = {mheads, nq, mcols};
    int64_t db = 1, mxs = maxs, mxk = maxk;
    kvc_tensor tq = kvc_tensor_make(qh, KVC_F16, 3, qsh), tck = kvc_tensor_make(ck, KVC_F32, 3, ksh),
               tcv = kvc_tensor_make(cv, KVC_F32, 3, ksh), to = kvc_tensor_make(out, KVC_F16, 3, qsh),
               tss = kvc_tensor_make(ss, KVC_I64, 1, &nb1), tks = kvc_tensor_make(ks, KVC_I64, 1, &nb1),
               tcs = mode ? kvc_tensor_make(cs1, KVC_I64, 2, csh1) : kvc_tensor_make(cs0, KVC_I64, 1, &nb),
               tsp = kvc_tensor_make(sp, KVC_I64, 1, &nb), tdb = kvc_tensor_make(&db, KVC_I64, 1, &one),
               tms = kvc_tensor_make(&mxs, KVC_I64, 0, NULL), tmk = kvc_tensor_make(&mxk, KVC_I64, 0, NULL),
               tm = maskdim == 3 ? kvc_tensor_make(mask, KVC_F32, 3, msh) : kvc_tensor_make(mask, KVC_F32, 2, msh + 1);
    kvc_pmx_mhca_params p = kvc_pmx_mhca_default_params();
    p.kv.num_layer = NL, p.kv.layer_idx = LAYER, p.kv.cache_layout = layout, p.kv.cache_mode = mode;
    p.kv.page_size = PS, p.kv.quant_group = QG;
    p.kv.quant_bit = cd == KVC_I8 ? 8 : cd == KVC_I4 ? 4 : 0;
    p.num_heads = (int32_t)Hq, p.head_dim = (int32_t)D, p.num_kv_heads = H == Hq ? 0 : (int32_t)H;
    char what[160];
    snprintf(what, sizeof what, "mhca layout %d mode %d %s mask %dD Hq %lld H %lld D %lld isa %s",
             layout, mode, kvc_dtype_name(cd), maskdim, (long long)Hq, (long long)H, (long long)D,
             kvc_isa_name(kvc_get_isa()));
    int rc = 0;
    /* rejected first: a mask too narrow and is_alibi leave cache and output untouched */
    {
        void *c0 = malloc(dt_bytes(cd, cn));
        memcpy(c0, cache, dt_bytes(cd, cn));
        kvc_tensor bad = tm;
        bad.shape[bad.ndim - 1] = nkv - 1;
        memset(out, 0x33, 2 * (size_t)(nq * Hq * D));
        kvc_status st = kvc_pmx_dynamic_multi_head_cache_attention(
            &tq, &tck, &tcv, &tss, &tks, &tcs, &tsp, &tdb, &tms, &tmk, &tc, quant ? &tsc : NULL,
            &bad, &p, &to, test_pool(2));
        kvc_pmx_mhca_params pa = p;
        pa.is_alibi = 1;
        kvc_status st2 = kvc_pmx_dynamic_multi_head_cache_attention(
            &tq, &tck, &tcv, &tss, &tks, &tcs, &tsp, &tdb, &tms, &tmk, &tc, quant ? &tsc : NULL,
            NULL, &pa, &to, test_pool(2));
        int64_t dbb = B + 1;
        kvc_tensor tdbb = kvc_tensor_make(&dbb, KVC_I64, 0, NULL);
        kvc_status st3 = kvc_pmx_dynamic_multi_head_cache_attention(
            &tq, &tck, &tcv, &tss, &tks, &tcs, &tsp, &tdbb, &tms, &tmk, &tc, quant ? &tsc : NULL,
            NULL, &p, &to, test_pool(2));
        if (st != KVC_ERR_INVALID_ARG || st2 != KVC_ERR_UNSUPPORTED || st3 != KVC_ERR_INVALID_ARG ||
            memcmp(c0, cache, dt_bytes(cd, cn)) != 0 || ((uint16_t *)out)[0] != 0x3333) {
            fprintf(stderr, "  %s: rejected call wrote or was accepted (%d %d %d)\n", what, st, st2, st3);
            rc = 1;
        }
        free(c0);
    }
    kvc_status st = rc ? KVC_OK : kvc_pmx_dynamic_multi_head_cache_attention(
        &tq, &tck, &tcv, &tss, &tks, &tcs, &tsp, &tdb, &tms, &tmk, &tc, quant ? &tsc : NULL,
        maskdim ? &tm : NULL, &p, &to, test_pool(2));
    if (st != KVC_OK) {
        fprintf(stderr, "  %s: %s\n", what, kvc_last_error());
        rc = 1;
    }
    /* reference per batch on the cache as it is now */
    for (int b = 0; b < B && !rc; b++) {
        const int64_t S = seq[b], L = seq[b] + past[b];
        double *qd = malloc(sizeof(double) * (size_t)(S * Hq * D));
        double *kd = malloc(sizeof(double) * (size_t)(L * H * D + 1)), *vd = malloc(sizeof(double) * (size_t)(L * H * D + 1));
        double *ad = malloc(sizeof(double) * (size_t)(Hq * S * L + 1));
        double *ro = malloc(sizeof(double) * (size_t)(S * Hq * D)), *rl = malloc(sizeof(double) * (size_t)(S * Hq));
        for (int64_t i = 0; i < S * Hq * D; i++) qd[i] = q[ss[b] * Hq * D + i];
        for (int64_t t = 0; t < L; t++) {
            const int64_t slot = mode ? cs1[b * MAXP + t / PS] + t % PS : cs0[b] + t;
            for (int64_t h = 0; h < H; h++)
                for (int64_t d = 0; d < D; d++)
                    for (int kv = 0; kv < 2; kv++) {
                        double x = get_f(cache, cd, mh_off(&tc, layout, LAYER, kv, slot, h, d));
                        if (quant) x *= ((float *)scale)[mh_off(&tsc, layout, LAYER, kv, slot, h, d / QG)];
                        (kv ? vd : kd)[(t * H + h) * D + d] = x;
                    }
        }
        for (int64_t hq = 0; hq < Hq; hq++)
            for (int64_t i = 0; i < S; i++)
                for (int64_t j = 0; j < L; j++)
                    ad[(hq * S + i) * L + j] = maskdim ? mask[((maskdim == 3 ? hq : 0) * nq + ss[b] + i) * mcols + ks[b] + j] : 0.0;
        ref_req r = {S, L, Hq, H, D, qd, kd, vd, NULL, S > 1 && b >= db, -1, 0, 0, ad, NULL};
        ref_attn(&r, ro, rl);
        rc = compare(&to, NULL, 0, ss[b], ro, rl, S, Hq, D, 1e-3, what);
        free(qd), free(kd), free(vd), free(ad), free(ro), free(rl);
    }
    free(cache), free(scale), free(q), free(ck), free(cv), free(out), free(qh), free(mask);
    return rc;
}

TEST(pmx_mhca) {
    static const kvc_dtype cds[4] = {KVC_F16, KVC_I8, KVC_I4, KVC_F32};
    FOR_EACH_ISA({
        for (int layout = 0; layout < 4; layout++)
            for (int mode = 0; mode < 2; mode++) {
                const int v = layout * 2 + mode;
                if (run_mhca(layout, mode, cds[v % 4], v % 3 == 0 ? 0 : v % 3 == 1 ? 2 : 3,
                             v % 2 ? 4 : 6, v % 2 ? 2 : 6, v % 3 == 2 ? 64 : 32,
                             test_seed + 700 + (uint64_t)v) != 0)
                    return 1;
            }
    });
    return 0;
}

/* ---- rejected inputs ------------------------------------------------------------ */

TEST(rejects) {
    float q[4 * 2 * 64], k[10 * 2 * 64], v[10 * 2 * 64], out[4 * 2 * 64], lse[8];
    for (int i = 0; i < 4 * 2 * 64; i++) q[i] = 0.1f;
    for (int i = 0; i < 10 * 2 * 64; i++) k[i] = v[i] = 0.2f;
    int64_t qsh[3] = {4, 2, 64}, ksh[3] = {10, 2, 64}, lsh[2] = {4, 2};
    kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, qsh), tk = kvc_tensor_make(k, KVC_F32, 3, ksh),
               tv = kvc_tensor_make(v, KVC_F32, 3, ksh), to = kvc_tensor_make(out, KVC_F32, 3, qsh),
               tl = kvc_tensor_make(lse, KVC_F32, 2, lsh);
    memset(out, 0x5a, sizeof out);
    memset(lse, 0x5a, sizeof lse);
    float out0[sizeof out / 4], lse0[8];
    memcpy(out0, out, sizeof out);
    memcpy(lse0, lse, sizeof lse);
    kvc_attn_params p = kvc_attn_default_params();
#define REJ(call)                                                                                  \
    do {                                                                                           \
        ASSERT_STATUS(call, KVC_ERR_INVALID_ARG);                                                  \
        ASSERT_MEM_EQ(out, out0, sizeof out);                                                      \
        ASSERT_MEM_EQ(lse, lse0, sizeof lse);                                                      \
    } while (0)
    int64_t q3[3] = {4, 3, 64};
    kvc_tensor tq3 = kvc_tensor_make(q, KVC_F32, 3, q3), to3 = kvc_tensor_make(out, KVC_F32, 3, q3);
    REJ(kvc_single_prefill(&tq3, &tk, &tv, NULL, NULL, 0, KVC_NHD, 1, NULL, NULL, &p, &to3, NULL, NULL));
    kvc_tensor tqb = tq;
    tqb.dtype = KVC_I8;
    REJ(kvc_single_prefill(&tqb, &tk, &tv, NULL, NULL, 0, KVC_NHD, 1, NULL, NULL, &p, &to, &tl, NULL));
    kvc_tensor tlb = tl;
    tlb.shape[0] = 3;
    REJ(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 1, NULL, NULL, &p, &to, &tlb, NULL));
    REJ(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, (kvc_kv_layout)3, 1, NULL, NULL, &p, &to, &tl, NULL));
    /* causal is 0 or 1 (2 and -1 were taken as true) */
    REJ(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 2, NULL, NULL, &p, &to, &tl, NULL));
    REJ(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, -1, NULL, NULL, &p, &to, &tl, NULL));
    kvc_attn_params pb = p;
    pb.window_left = -5;
    REJ(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 1, NULL, NULL, &pb, &to, &tl, NULL));
    pb = p;
    pb.sm_scale = INFINITY;
    REJ(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 1, NULL, NULL, &pb, &to, &tl, NULL));
    /* masks: wrong size, wrong dtype, both given */
    uint8_t m[4 * 10 + 1] = {0}, mp[5 + 1] = {0};
    int64_t n39 = 39, n40 = 40, n5 = 5, n6 = 6;
    kvc_tensor tm39 = kvc_tensor_make(m, KVC_U8, 1, &n39), tm40 = kvc_tensor_make(m, KVC_U8, 1, &n40),
               tp6 = kvc_tensor_make(mp, KVC_U8, 1, &n6), tp5 = kvc_tensor_make(mp, KVC_U8, 1, &n5);
    REJ(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 0, &tm39, NULL, &p, &to, &tl, NULL));
    REJ(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 0, NULL, &tp6, &p, &to, &tl, NULL));
    REJ(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 0, &tm40, &tp5, &p, &to, &tl, NULL));
    kvc_tensor tmf = tm40;
    tmf.dtype = KVC_F32;
    tmf.shape[0] = 10;
    REJ(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 0, &tmf, NULL, &p, &to, &tl, NULL));
    /* int8 without scales */
    int8_t k8[10 * 2 * 64] = {0};
    kvc_tensor tk8 = kvc_tensor_make(k8, KVC_I8, 3, ksh);
    REJ(kvc_single_prefill(&tq, &tk8, &tk8, NULL, NULL, 8, KVC_NHD, 0, NULL, NULL, &p, &to, &tl, NULL));
    ASSERT_OK(kvc_single_prefill(&tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, 0, &tm40, NULL, &p, &to, &tl, NULL));
    memcpy(out0, out, sizeof out);
    memcpy(lse0, lse, sizeof lse);
    /* plans: bad tables, head counts, unsupported Dh; nothing written to out */
    int32_t qo_ptr[3] = {0, 1, 4}, kv_ptr[3] = {0, 1, 2}, idx[2] = {0, 3}, last[2] = {2, 3};
    int64_t n3 = 3, n2 = 2;
    kvc_tensor tqo = kvc_tensor_make(qo_ptr, KVC_I32, 1, &n3), tkv = kvc_tensor_make(kv_ptr, KVC_I32, 1, &n3),
               tix = kvc_tensor_make(idx, KVC_I32, 1, &n2), tla = kvc_tensor_make(last, KVC_I32, 1, &n2);
    kvc_prefill_plan *plan = NULL;
    qo_ptr[1] = 5; /* decreasing */
    ASSERT_STATUS(kvc_prefill_plan_create_paged(&tqo, &tkv, &tix, &tla, 2, 2, 64, 4, 1, NULL, NULL, 1, &plan),
                  KVC_ERR_INVALID_ARG);
    qo_ptr[1] = 1;
    last[1] = 5; /* > page_size */
    ASSERT_STATUS(kvc_prefill_plan_create_paged(&tqo, &tkv, &tix, &tla, 2, 2, 64, 4, 1, NULL, NULL, 1, &plan),
                  KVC_ERR_INVALID_ARG);
    last[1] = 3;
    ASSERT_STATUS(kvc_prefill_plan_create_paged(&tqo, &tkv, &tix, &tla, 3, 2, 64, 4, 1, NULL, NULL, 1, &plan),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_prefill_plan_create_paged(&tqo, &tkv, &tix, &tla, 2, 2, 1024, 4, 1, NULL, NULL, 1, &plan),
                  KVC_ERR_UNSUPPORTED);
    ASSERT_STATUS(kvc_prefill_plan_create_paged(&tqo, &tkv, &tix, &tla, 2, 2, 64, 4, 1, &tm39, NULL, 1, &plan),
                  KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(plan == NULL);
    ASSERT_OK(kvc_prefill_plan_create_paged(&tqo, &tkv, &tix, &tla, 2, 2, 64, 4, 1, NULL, NULL, 1, &plan));
    float cache[3 * 4 * 2 * 64] = {0};
    int64_t csh[4] = {3, 4, 2, 64};
    kvc_paged_cache pc;
    memset(&pc, 0, sizeof pc);
    pc.k = kvc_tensor_make(cache, KVC_F32, 4, csh);
    pc.v = pc.k;
    pc.layout = KVC_NHD;
    /* page 3 outside a 3-page cache */
    REJ(kvc_prefill_run_paged(plan, &tq, &pc, &p, &to, &tl, NULL));
    csh[0] = 4;
    float cache4[4 * 4 * 2 * 64] = {0};
    pc.k = kvc_tensor_make(cache4, KVC_F32, 4, csh);
    pc.v = pc.k;
    kvc_paged_cache pc2 = pc;
    pc2.layout = KVC_HND; /* H would be 4 */
    REJ(kvc_prefill_run_paged(plan, &tq, &pc2, &p, &to, &tl, NULL));
    REJ(kvc_prefill_run_paged(plan, &tq3, &pc, &p, &to3, NULL, NULL));
    /* a pool with more threads than the plan was made for */
    if (test_pool(2)) REJ(kvc_prefill_run_paged(plan, &tq, &pc, &p, &to, &tl, test_pool(2)));
    /* ragged run with a paged plan */
    REJ(kvc_prefill_run_ragged(plan, &tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &to, &tl, NULL));
    ASSERT_OK(kvc_prefill_run_paged(plan, &tq, &pc, &p, &to, &tl, NULL));
    kvc_prefill_plan_destroy(plan);
    kvc_prefill_plan_destroy(NULL);
    /* ragged: k rows must match kv_indptr[B] */
    ASSERT_OK(kvc_prefill_plan_create_ragged(&tqo, &tkv, 2, 2, 64, 1, NULL, NULL, 1, &plan));
    memcpy(out0, out, sizeof out);
    memcpy(lse0, lse, sizeof lse);
    REJ(kvc_prefill_run_ragged(plan, &tq, &tk, &tv, NULL, NULL, 0, KVC_NHD, &p, &to, &tl, NULL));
    kvc_tensor tk2 = tk, tv2 = tv;
    tk2.shape[0] = tv2.shape[0] = 2;
    ASSERT_OK(kvc_prefill_run_ragged(plan, &tq, &tk2, &tv2, NULL, NULL, 0, KVC_NHD, &p, &to, &tl, NULL));
    kvc_prefill_plan_destroy(plan);
    /* cascade: levels disagreeing on the number of rows */
    kvc_cascade_plan *cp = NULL;
    int32_t qo_b[2] = {0, 3};
    kvc_tensor tqob = kvc_tensor_make(qo_b, KVC_I32, 1, &n2);
    int32_t kv_b[2] = {0, 1}, last_b[1] = {2};
    int64_t n1 = 1;
    kvc_tensor tkvb = kvc_tensor_make(kv_b, KVC_I32, 1, &n2), tixb = kvc_tensor_make(idx, KVC_I32, 1, &n1),
               tlab = kvc_tensor_make(last_b, KVC_I32, 1, &n1);
    kvc_tensor lq[2] = {tqob, tqo}, lk[2] = {tkvb, tkv}, li[2] = {tixb, tix}, ll[2] = {tlab, tla};
    ASSERT_STATUS(kvc_cascade_plan_create(2, lq, lk, li, ll, 2, 2, 64, 4, 1, 1, &cp), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cascade_plan_create(0, lq, lk, li, ll, 2, 2, 64, 4, 1, 1, &cp), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(cp == NULL);
    kvc_cascade_plan_destroy(NULL); /* a no-op (prefill.h) */
#undef REJ
    return 0;
}

const char *test_suite_name = "prefill";
const test_case test_suite[] = {
    TEST_ENTRY(paged_dtypes_layouts),
    TEST_ENTRY(paged_grid),
    TEST_ENTRY(long_request),
    TEST_ENTRY(ragged_masks_params),
    TEST_ENTRY(edge_rows),
    TEST_ENTRY(large_negative_scores),
    TEST_ENTRY(row_independence),
    TEST_ENTRY(set_causal),
    TEST_ENTRY(mask_equivalences),
    TEST_ENTRY(cascade_two_levels),
    TEST_ENTRY(pmx_mhca),
    TEST_ENTRY(rejects),
    {0, 0},
};
