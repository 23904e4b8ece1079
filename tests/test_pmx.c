/*
 * pmx KeyValueCache operators against a plain C reference written from
 * SEMANTICS sections 1-3 (one element at a time, no library kernels), on
 * every ISA the CPU supports and with 1 and 2 threads; plus rejected calls
 * leaving cache and scale bytes unchanged. The larger numpy-referenced grids
 * live in python/tests/test_pmx.py; this suite also runs under sanitizers.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MAP_NORESERVE */
#include <stdlib.h>
#include <sys/mman.h>

#include "kernels/kernels.h" /* kvc__set_llc_bytes */
#include "test_elems.h"

/* ---- reference row store / load (SEMANTICS section 1) --------------------- */

typedef struct ref_cfg {
    int bits, group, repeat;
    int64_t H, Dh;
    kvc_dtype t1, t2, t3;
} ref_cfg;

/* Stores row x (element offset xo in xbuf) at cache element offset co, scale
 * element offset so. */
static void ref_store_row(const ref_cfg *c, const void *x, int64_t xo, void *cache, int64_t co,
                          void *scale, int64_t so) {
    if (!c->bits) {
        for (int64_t d = 0; d < c->Dh; d++) set_f(cache, c->t2, co + d, get_f(x, c->t1, xo + d));
        return;
    }
    const float qmax = c->bits == 8 ? 127.0f : 7.0f;
    for (int64_t g = 0; g < c->Dh / c->group; g++) {
        float absmax = 0;
        for (int d = 0; d < c->group; d++) {
            float a = fabsf(get_f(x, c->t1, xo + g * c->group + d));
            absmax = a > absmax ? a : absmax;
        }
        float s = absmax / qmax;
        s = s > 1e-5f ? s : 1e-5f;
        set_f(scale, c->t3, so + g, s);
        s = get_f(scale, c->t3, so + g);
        for (int d = 0; d < c->group; d++) {
            float v = rintf(get_f(x, c->t1, xo + g * c->group + d) / s);
            v = v > qmax ? qmax : v < -qmax ? -qmax : v;
            set_f(cache, c->t2, co + g * c->group + d, v);
        }
    }
}

/* Reads the cached row into output head rows out[oo + r*ohs] for r < repeat. */
static void ref_load_row(const ref_cfg *c, const void *cache, int64_t co, const void *scale,
                         int64_t so, void *out, int64_t oo, int64_t ohs) {
    for (int64_t d = 0; d < c->Dh; d++) {
        float v = get_f(cache, c->t2, co + d);
        if (c->bits) v *= get_f(scale, c->t3, so + d / c->group);
        for (int r = 0; r < c->repeat; r++) set_f(out, c->t1, oo + r * ohs + d, v);
    }
}

/* ---- helpers ---------------------------------------------------------------- */

static void *xcalloc(size_t n) { return calloc(n ? n : 1, 1); }

static int64_t strides_off(const kvc_tensor *t, const int64_t *idx) {
    int64_t o = 0;
    for (int i = 0; i < t->ndim; i++) o += idx[i] * t->stride[i];
    return o;
}

static const kvc_dtype float_types[3] = {KVC_F32, KVC_F16, KVC_BF16};

/* ---- static operator --------------------------------------------------------- */

typedef struct static_case {
    int layout, bits, group, repeat;
    kvc_dtype t1, t2, t3;
    int64_t B, maxB, L, layer, maxS, S, start, H, Dh;
} static_case;

/* Runs one static case on the current ISA with n_threads; returns 0 on match. */
static int run_static(const static_case *k, int n_threads) {
    uint64_t rng = test_seed ^ (uint64_t)(k->layout * 131 + k->bits * 17 + k->t1 * 7 + k->t2);
    const int64_t B = k->B, S = k->S, H = k->H, Dh = k->Dh, T = k->start + S, R = k->repeat;
    int64_t cshape[6], sshape[6];
    if (k->layout == 0) {
        int64_t s[6] = {k->maxB, k->L, 2, k->maxS, H, Dh};
        memcpy(cshape, s, sizeof s);
    } else {
        int64_t s[6] = {k->L, k->maxB, 2, H, k->maxS, Dh};
        memcpy(cshape, s, sizeof s);
    }
    memcpy(sshape, cshape, sizeof sshape);
    sshape[5] = Dh / k->group;
    int64_t in_shape[4] = {B, S, H, Dh}, out_shape[4] = {B, T, H * R, Dh};
    int64_t n_cache = 1, n_scale = 1, n_in = B * S * H * Dh, n_out = B * T * H * R * Dh;
    for (int i = 0; i < 6; i++) n_cache *= cshape[i], n_scale *= sshape[i];
    void *ck = xcalloc(dt_bytes(k->t1, n_in)), *cv = xcalloc(dt_bytes(k->t1, n_in));
    void *cache = xcalloc(dt_bytes(k->t2, n_cache)), *scale = xcalloc(dt_bytes(k->t3, n_scale));
    void *rcache = xcalloc(dt_bytes(k->t2, n_cache)), *rscale = xcalloc(dt_bytes(k->t3, n_scale));
    void *ok = xcalloc(dt_bytes(k->t1, n_out)), *ov = xcalloc(dt_bytes(k->t1, n_out));
    void *rk = xcalloc(dt_bytes(k->t1, n_out)), *rv = xcalloc(dt_bytes(k->t1, n_out));
    fill_random(ck, k->t1, n_in, &rng, 2.0f);
    fill_random(cv, k->t1, n_in, &rng, 0.5f);
    if (k->bits && Dh >= k->group) /* one all-zero group: scale must be the 1e-5 floor */
        for (int d = 0; d < k->group; d++) set_f(ck, k->t1, d, 0.0f);
    /* Old cache contents: valid quantized values and positive scales. */
    fill_random(cache, k->t2, n_cache, &rng, 1.0f);
    for (int64_t i = 0; i < n_scale; i++) set_f(scale, k->t3, i, 0.01f + 0.001f * (float)(i % 7));
    memcpy(rcache, cache, dt_bytes(k->t2, n_cache));
    memcpy(rscale, scale, dt_bytes(k->t3, n_scale));

    kvc_tensor tk = kvc_tensor_make(ck, k->t1, 4, in_shape), tv = kvc_tensor_make(cv, k->t1, 4, in_shape);
    kvc_tensor tc = kvc_tensor_make(cache, k->t2, 6, cshape), ts = kvc_tensor_make(scale, k->t3, 6, sshape);
    kvc_tensor tok = kvc_tensor_make(ok, k->t1, 4, out_shape), tov = kvc_tensor_make(ov, k->t1, 4, out_shape);
    int64_t start = k->start;
    kvc_tensor tsp = kvc_tensor_make(&start, KVC_I64, 0, NULL);
    kvc_pmx_kv_params p = kvc_pmx_kv_default_params();
    p.num_layer = (int32_t)k->L;
    p.layer_idx = (int32_t)k->layer;
    p.quant_bit = k->bits;
    p.quant_group = k->group;
    p.num_repeat = k->repeat;
    p.cache_layout = k->layout;
    kvc_status st = kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, k->bits ? &ts : NULL, &p, &tok,
                                            &tov, test_pool(n_threads));
    if (st != KVC_OK) {
        fprintf(stderr, "  call failed: %s\n", kvc_last_error());
        return 1;
    }

    /* Reference. */
    ref_cfg rc = {k->bits, k->group, k->repeat, H, Dh, k->t1, k->t2, k->t3};
    for (int kv = 0; kv < 2; kv++)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t s = 0; s < S; s++)
                for (int64_t h = 0; h < H; h++) {
                    int64_t t = k->start + s;
                    int64_t ci[6] = {b, k->layer, kv, t, h, 0}, ci1[6] = {k->layer, b, kv, h, t, 0};
                    const int64_t *idx = k->layout == 0 ? ci : ci1;
                    int64_t ii[4] = {b, s, h, 0};
                    ref_store_row(&rc, kv ? cv : ck, strides_off(&tk, ii), rcache,
                                  strides_off(&tc, idx), rscale, strides_off(&ts, idx));
                }
            for (int64_t t = 0; t < T; t++)
                for (int64_t h = 0; h < H; h++) {
                    int64_t ci[6] = {b, k->layer, kv, t, h, 0}, ci1[6] = {k->layer, b, kv, h, t, 0};
                    const int64_t *idx = k->layout == 0 ? ci : ci1;
                    int64_t oi[4] = {b, t, h * R, 0};
                    ref_load_row(&rc, rcache, strides_off(&tc, idx), rscale, strides_off(&ts, idx),
                                 kv ? rv : rk, strides_off(&tok, oi), tok.stride[2]);
                }
        }
    int bad = 0;
    if (memcmp(cache, rcache, dt_bytes(k->t2, n_cache))) bad = 1;
    if (k->bits && memcmp(scale, rscale, dt_bytes(k->t3, n_scale))) bad = 2;
    if (memcmp(ok, rk, dt_bytes(k->t1, n_out))) bad = 3;
    if (memcmp(ov, rv, dt_bytes(k->t1, n_out))) bad = 4;
    if (bad)
        fprintf(stderr, "  static mismatch (%s) layout %d bits %d t1 %s t2 %s t3 %s R %d threads %d\n",
                bad == 1 ? "cache" : bad == 2 ? "scale" : bad == 3 ? "key" : "value", k->layout,
                k->bits, kvc_dtype_name(k->t1), kvc_dtype_name(k->t2), kvc_dtype_name(k->t3),
                k->repeat, n_threads);
    free(ck), free(cv), free(cache), free(scale), free(rcache), free(rscale);
    free(ok), free(ov), free(rk), free(rv);
    return bad;
}

TEST(static_grid) {
    int n_cases = 0;
    FOR_EACH_ISA({
        for (int layout = 0; layout < 2; layout++)
            for (int bits = 0; bits <= 8; bits += 4)
                for (int i1 = 0; i1 < 3; i1++)
                    for (int i2 = 0; i2 < 3; i2++)
                        for (int repeat = 1; repeat <= 3; repeat += 2) {
                            if (bits && i2 == 2) continue; /* scale dtypes: f32, f16 */
                            static_case k = {layout, bits, 8, repeat, float_types[i1],
                                             bits == 8 ? KVC_I8 : bits == 4 ? KVC_I4 : float_types[i2],
                                             i2 == 0 ? KVC_F32 : KVC_F16,
                                             2, 3, 2, 1, 12, 3, 5, 3, 32};
                            for (int th = 1; th <= 2; th++) {
                                ASSERT_EQ_I64(run_static(&k, th), 0);
                                n_cases++;
                            }
                        }
    });
    /* Long sequences cross the 64-token task chunks; Dh 64 with group 16. */
    static_case big = {0, 8, 16, 2, KVC_F16, KVC_I8, KVC_F16, 3, 3, 1, 0, 200, 70, 130, 4, 64};
    static_case big1 = {1, 4, 32, 1, KVC_F32, KVC_I4, KVC_F32, 2, 2, 2, 1, 300, 150, 0, 2, 64};
    static_case i8copy = {0, 0, 8, 2, KVC_I8, KVC_I8, KVC_F32, 2, 2, 1, 0, 8, 3, 5, 2, 16};
    for (int th = 1; th <= 2; th++) {
        ASSERT_EQ_I64(run_static(&big, th), 0);
        ASSERT_EQ_I64(run_static(&big1, th), 0);
        ASSERT_EQ_I64(run_static(&i8copy, th), 0);
    }
    ASSERT_TRUE(n_cases > 100);
    return 0;
}

/* ---- dynamic operator ----------------------------------------------------------- */

typedef struct dyn_case {
    int layout, mode, page, bits, group, repeat;
    kvc_dtype t1, t2, t3;
    int64_t L, layer, maxT, H, Dh;
    int n_batch;
    const int64_t *seqlen, *start; /* per batch */
} dyn_case;

/* Element offset of (slot, layer, kv, head) for a dynamic layout. */
static int64_t dyn_off(const kvc_tensor *t, int layout, int64_t slot, int64_t l, int kv, int64_t h) {
    int64_t i0[5] = {slot, l, kv, h, 0}, i1[5] = {l, slot, kv, h, 0}, i2[5] = {l, kv, slot, h, 0},
            i3[5] = {l, kv, h, slot, 0};
    const int64_t *idx[4] = {i0, i1, i2, i3};
    return strides_off(t, idx[layout]);
}

static int run_dynamic(const dyn_case *k, int n_threads) {
    uint64_t rng = test_seed ^ (uint64_t)(k->layout * 31 + k->mode * 7 + k->bits + k->page * 101);
    const int B = k->n_batch;
    const int64_t H = k->H, Dh = k->Dh, R = k->repeat, P = k->page;
    int64_t seqstarts[17] = {0}, kvstarts[17] = {0}, start[16], cs0[16];
    int64_t maxP = 1, max_s = 0, max_kv = 0;
    for (int b = 0; b < B; b++) {
        int64_t kvlen = k->start[b] + k->seqlen[b];
        seqstarts[b + 1] = seqstarts[b] + k->seqlen[b];
        kvstarts[b + 1] = kvstarts[b] + kvlen;
        start[b] = k->start[b];
        maxP = (kvlen + P - 1) / P > maxP ? (kvlen + P - 1) / P : maxP;
        max_s = k->seqlen[b] > max_s ? k->seqlen[b] : max_s;
        max_kv = kvlen > max_kv ? kvlen : max_kv;
    }
    maxP += 1; /* at least one unused column, padded with -1 */
    int64_t *cs1 = malloc(sizeof(int64_t) * (size_t)(B * maxP));
    /* Mode 0: sequences back to back after a gap. Mode 1: pages handed out
     * from the end of the cache backwards, so slots are not monotonic. */
    int64_t next = 3, next_page = k->maxT / P - 1;
    for (int b = 0; b < B; b++) {
        int64_t kvlen = k->start[b] + k->seqlen[b];
        cs0[b] = next;
        next += kvlen;
        for (int64_t p = 0; p < maxP; p++)
            cs1[b * maxP + p] = p * P < kvlen ? (next_page--) * P : -1;
    }
    if (next > k->maxT || (k->mode && next_page < -1)) {
        fprintf(stderr, "  bad test case: cache too small\n");
        free(cs1);
        return 1;
    }
    int64_t cshape[5], sshape[5];
    {
        int64_t s0[5] = {k->maxT, k->L, 2, H, Dh}, s1[5] = {k->L, k->maxT, 2, H, Dh},
                s2[5] = {k->L, 2, k->maxT, H, Dh}, s3[5] = {k->L, 2, H, k->maxT, Dh};
        const int64_t *sh[4] = {s0, s1, s2, s3};
        memcpy(cshape, sh[k->layout], sizeof cshape);
    }
    memcpy(sshape, cshape, sizeof sshape);
    sshape[4] = Dh / k->group;
    const int64_t N = seqstarts[B], KV = kvstarts[B];
    int64_t in_shape[3] = {N, H, Dh}, out_shape[3] = {KV, H * R, Dh};
    int64_t n_cache = 1, n_scale = 1, n_in = N * H * Dh, n_out = KV * H * R * Dh;
    for (int i = 0; i < 5; i++) n_cache *= cshape[i], n_scale *= sshape[i];
    void *ck = xcalloc(dt_bytes(k->t1, n_in)), *cv = xcalloc(dt_bytes(k->t1, n_in));
    void *cache = xcalloc(dt_bytes(k->t2, n_cache)), *scale = xcalloc(dt_bytes(k->t3, n_scale));
    void *rcache = xcalloc(dt_bytes(k->t2, n_cache)), *rscale = xcalloc(dt_bytes(k->t3, n_scale));
    void *ok = xcalloc(dt_bytes(k->t1, n_out)), *ov = xcalloc(dt_bytes(k->t1, n_out));
    void *rk = xcalloc(dt_bytes(k->t1, n_out)), *rv = xcalloc(dt_bytes(k->t1, n_out));
    fill_random(ck, k->t1, n_in, &rng, 3.0f);
    fill_random(cv, k->t1, n_in, &rng, 0.25f);
    fill_random(cache, k->t2, n_cache, &rng, 1.0f);
    for (int64_t i = 0; i < n_scale; i++) set_f(scale, k->t3, i, 0.02f + 0.001f * (float)(i % 5));
    memcpy(rcache, cache, dt_bytes(k->t2, n_cache));
    memcpy(rscale, scale, dt_bytes(k->t3, n_scale));

    kvc_tensor tk = kvc_tensor_make(ck, k->t1, 3, in_shape), tv = kvc_tensor_make(cv, k->t1, 3, in_shape);
    kvc_tensor tc = kvc_tensor_make(cache, k->t2, 5, cshape), ts = kvc_tensor_make(scale, k->t3, 5, sshape);
    kvc_tensor tok = kvc_tensor_make(ok, k->t1, 3, out_shape), tov = kvc_tensor_make(ov, k->t1, 3, out_shape);
    int64_t nb1 = B + 1, nb = B, cs1_shape[2] = {B, maxP};
    kvc_tensor tss = kvc_tensor_make(seqstarts, KVC_I64, 1, &nb1);
    kvc_tensor tks = kvc_tensor_make(kvstarts, KVC_I64, 1, &nb1);
    kvc_tensor tsp = kvc_tensor_make(start, KVC_I64, 1, &nb);
    kvc_tensor tcs = k->mode ? kvc_tensor_make(cs1, KVC_I64, 2, cs1_shape)
                             : kvc_tensor_make(cs0, KVC_I64, 1, &nb);
    kvc_tensor tms = kvc_tensor_make(&max_s, KVC_I64, 0, NULL);
    kvc_tensor tmk = kvc_tensor_make(&max_kv, KVC_I64, 0, NULL);
    kvc_pmx_kv_params p = kvc_pmx_kv_default_params();
    p.num_layer = (int32_t)k->L;
    p.layer_idx = (int32_t)k->layer;
    p.quant_bit = k->bits;
    p.quant_group = k->group;
    p.num_repeat = k->repeat;
    p.cache_layout = k->layout;
    p.cache_mode = k->mode;
    p.page_size = k->page;
    kvc_status st = kvc_pmx_dynamic_key_value_cache(&tk, &tv, &tss, &tks, &tcs, &tsp, &tms, &tmk,
                                                    &tc, k->bits ? &ts : NULL, &p, &tok, &tov,
                                                    test_pool(n_threads));
    int bad = 0;
    if (st != KVC_OK) {
        fprintf(stderr, "  call failed: %s\n", kvc_last_error());
        bad = 5;
    }
    ref_cfg rc = {k->bits, k->group, k->repeat, H, Dh, k->t1, k->t2, k->t3};
    for (int kv = 0; kv < 2 && !bad; kv++)
        for (int b = 0; b < B; b++) {
            int64_t kvlen = kvstarts[b + 1] - kvstarts[b];
            for (int pass = 0; pass < 2; pass++) /* 0: store new rows, 1: read all */
                for (int64_t t = pass ? 0 : start[b]; t < kvlen; t++) {
                    int64_t slot = k->mode ? cs1[b * maxP + t / P] + t % P : cs0[b] + t;
                    for (int64_t h = 0; h < H; h++) {
                        int64_t co = dyn_off(&tc, k->layout, slot, k->layer, kv, h);
                        int64_t so = dyn_off(&ts, k->layout, slot, k->layer, kv, h);
                        if (!pass) {
                            int64_t ii[3] = {seqstarts[b] + t - start[b], h, 0};
                            ref_store_row(&rc, kv ? cv : ck, strides_off(&tk, ii), rcache, co,
                                          rscale, so);
                        } else {
                            int64_t oi[3] = {kvstarts[b] + t, h * R, 0};
                            ref_load_row(&rc, rcache, co, rscale, so, kv ? rv : rk,
                                         strides_off(&tok, oi), tok.stride[1]);
                        }
                    }
                }
        }
    if (!bad && memcmp(cache, rcache, dt_bytes(k->t2, n_cache))) bad = 1;
    if (!bad && k->bits && memcmp(scale, rscale, dt_bytes(k->t3, n_scale))) bad = 2;
    if (!bad && memcmp(ok, rk, dt_bytes(k->t1, n_out))) bad = 3;
    if (!bad && memcmp(ov, rv, dt_bytes(k->t1, n_out))) bad = 4;
    if (bad)
        fprintf(stderr, "  dynamic mismatch (%d) layout %d mode %d page %d bits %d t1 %s t2 %s R %d "
                "threads %d\n", bad, k->layout, k->mode, k->page, k->bits, kvc_dtype_name(k->t1),
                kvc_dtype_name(k->t2), k->repeat, n_threads);
    free(ck), free(cv), free(cache), free(scale), free(rcache), free(rscale);
    free(ok), free(ov), free(rk), free(rv), free(cs1);
    return bad;
}

TEST(dynamic_grid) {
    /* Ragged batch: a decode step, a prefill, an empty sequence, an empty
     * history, and a long one crossing task chunks. */
    static const int64_t seqlen[5] = {1, 9, 0, 0, 70}, start[5] = {20, 0, 5, 0, 3};
    int n_cases = 0;
    FOR_EACH_ISA({
        for (int layout = 0; layout < 4; layout++)
            for (int mode = 0; mode < 2; mode++)
                for (int bits = 0; bits <= 8; bits += 4)
                    for (int pi = 0; pi < (mode ? 3 : 1); pi++)
                        for (int repeat = 1; repeat <= 2; repeat++) {
                            static const int pages[3] = {1, 3, 16};
                            int i1 = (layout + bits / 4 + repeat) % 3;
                            dyn_case k = {layout, mode, mode ? pages[pi] : 128, bits, 8, repeat,
                                          float_types[i1],
                                          bits == 8 ? KVC_I8 : bits == 4 ? KVC_I4 : float_types[(i1 + layout) % 3],
                                          (layout & 1) ? KVC_F16 : KVC_F32,
                                          2, 1, 240, 2, 16, 5, seqlen, start};
                            for (int th = 1; th <= 2; th++) {
                                ASSERT_EQ_I64(run_dynamic(&k, th), 0);
                                n_cases++;
                            }
                        }
    });
    ASSERT_TRUE(n_cases >= 96);
    return 0;
}

/* Loads larger than the last-level cache write the output with
 * non-temporal stores, through a staging buffer for conversions (and with
 * repeats); kvc__set_llc_bytes(0) sends every call of both grids there. */
TEST(grids_with_streaming_loads) {
    const int64_t saved = kvc__llc_bytes();
    kvc__set_llc_bytes(0);
    int bad = test_static_grid() || test_dynamic_grid();
    /* token-major runs longer than the stage (16 KiB): several chunks of
     * whole groups, float32 and float16 outputs, int8 and int4 */
    static const static_case runs[4] = {
        {0, 8, 16, 1, KVC_F32, KVC_I8, KVC_F16, 2, 2, 1, 0, 140, 1, 129, 4, 64},
        {0, 4, 32, 1, KVC_F32, KVC_I4, KVC_F32, 2, 2, 1, 0, 140, 7, 120, 4, 64},
        {0, 8, 8, 1, KVC_F16, KVC_I8, KVC_F32, 1, 1, 1, 0, 200, 1, 150, 8, 128},
        {0, 0, 8, 1, KVC_F32, KVC_F16, KVC_F32, 1, 1, 1, 0, 200, 1, 150, 8, 128}};
    FOR_EACH_ISA({
        for (int i = 0; i < 4 && !bad; i++)
            for (int th = 1; th <= 2 && !bad; th++) bad = run_static(&runs[i], th);
    });
    kvc__set_llc_bytes(saved);
    ASSERT_EQ_I64(bad, 0);
    return 0;
}

/* ---- rejected calls ------------------------------------------------------------- */

/* A valid dynamic int8 call, mutated one field at a time by the test. */
typedef struct dyn_fixture {
    int8_t cache[2 * 2 * 32 * 2 * 8];  /* layout 2: (L=2, 2, MaxT=32, H=2, Dh=8) */
    uint16_t scale[2 * 2 * 32 * 2 * 1]; /* f16, group 8 */
    uint16_t ck[6 * 2 * 8], cv[6 * 2 * 8], ok[10 * 2 * 8], ov[10 * 2 * 8];
    int64_t seqstarts[3], kvstarts[3], start[2], cs[2 * 3], max_s, max_kv;
    kvc_tensor tk, tv, tc, ts, tok, tov, tss, tks, tsp, tcs, tms, tmk;
    kvc_pmx_kv_params p;
} dyn_fixture;

static void fixture_init(dyn_fixture *f) {
    memset(f, 0, sizeof *f);
    uint64_t rng = 7;
    for (int i = 0; i < 6 * 2 * 8; i++) {
        f->ck[i] = kvc_f32_to_f16(test_rng_f32(&rng));
        f->cv[i] = kvc_f32_to_f16(test_rng_f32(&rng));
    }
    for (size_t i = 0; i < sizeof f->cache; i++) f->cache[i] = (int8_t)(i * 37);
    for (size_t i = 0; i < sizeof f->scale / 2; i++) f->scale[i] = (uint16_t)(0x2000 + i);
    int64_t ss[3] = {0, 2, 6}, ks[3] = {0, 5, 10}, sp[2] = {3, 1}, cs[6] = {0, 4, -1, 16, 20, -1};
    memcpy(f->seqstarts, ss, sizeof ss);
    memcpy(f->kvstarts, ks, sizeof ks);
    memcpy(f->start, sp, sizeof sp);
    memcpy(f->cs, cs, sizeof cs);
    f->max_s = 4;
    f->max_kv = 5;
    int64_t csh[5] = {2, 2, 32, 2, 8}, ssh[5] = {2, 2, 32, 2, 1}, ish[3] = {6, 2, 8},
            osh[3] = {10, 2, 8}, n3 = 3, n2 = 2, cs_sh[2] = {2, 3};
    f->tc = kvc_tensor_make(f->cache, KVC_I8, 5, csh);
    f->ts = kvc_tensor_make(f->scale, KVC_F16, 5, ssh);
    f->tk = kvc_tensor_make(f->ck, KVC_F16, 3, ish);
    f->tv = kvc_tensor_make(f->cv, KVC_F16, 3, ish);
    f->tok = kvc_tensor_make(f->ok, KVC_F16, 3, osh);
    f->tov = kvc_tensor_make(f->ov, KVC_F16, 3, osh);
    f->tss = kvc_tensor_make(f->seqstarts, KVC_I64, 1, &n3);
    f->tks = kvc_tensor_make(f->kvstarts, KVC_I64, 1, &n3);
    f->tsp = kvc_tensor_make(f->start, KVC_I64, 1, &n2);
    f->tcs = kvc_tensor_make(f->cs, KVC_I64, 2, cs_sh);
    f->tms = kvc_tensor_make(&f->max_s, KVC_I64, 0, NULL);
    f->tmk = kvc_tensor_make(&f->max_kv, KVC_I64, 0, NULL);
    f->p = kvc_pmx_kv_default_params();
    f->p.num_layer = 2;
    f->p.layer_idx = 1;
    f->p.quant_bit = 8;
    f->p.cache_layout = 2;
    f->p.cache_mode = 1;
    f->p.page_size = 4;
}

static kvc_status fixture_call(dyn_fixture *f) {
    return kvc_pmx_dynamic_key_value_cache(&f->tk, &f->tv, &f->tss, &f->tks, &f->tcs, &f->tsp,
                                           &f->tms, &f->tmk, &f->tc, &f->ts, &f->p, &f->tok,
                                           &f->tov, NULL);
}

/* A cache laid over the index tensors (core.h: undefined, but in bounds).
 * KeyValueCache: batch 0's V lands on cachestarts[1], which the old code
 * then read as batch 1's slot (a float's bits, far past MaxT). Multi-head
 * cache attention: batch 0's K lands on kvstarts[2], which the old code read
 * again after the store, sizing batch 1's pages past its buffers. */
TEST(cache_over_index_tensors_stays_in_bounds) {
    /* layout 0 (MaxT 4, L 1, 2, H 1, Dh 2) float32: slot t is floats [4t, 4t + 4) */
    float *cache = test_guarded(16 * 4);
    ASSERT_TRUE(cache != NULL);
    int64_t *cs = (int64_t *)cache; /* cachestarts[0] = K of slot 0, [1] = its V */
    cs[0] = 0, cs[1] = 1;
    float x[4] = {1.0f, 2.0f, 3e9f, 3e9f}; /* (2 rows, H 1, Dh 2); V the same */
    int64_t ss[3] = {0, 1, 2}, ks[3] = {0, 1, 2}, sp[2] = {0, 0}, mx = 1;
    int64_t n3 = 3, n2 = 2, csh[5] = {4, 1, 2, 1, 2}, xsh[3] = {2, 1, 2};
    kvc_tensor tx = kvc_tensor_make(x, KVC_F32, 3, xsh), tc = kvc_tensor_make(cache, KVC_F32, 5, csh);
    kvc_tensor tss = kvc_tensor_make(ss, KVC_I64, 1, &n3), tks = kvc_tensor_make(ks, KVC_I64, 1, &n3);
    kvc_tensor tsp = kvc_tensor_make(sp, KVC_I64, 1, &n2), tcs = kvc_tensor_make(cs, KVC_I64, 1, &n2);
    kvc_tensor tmx = kvc_tensor_make(&mx, KVC_I64, 0, NULL);
    kvc_pmx_kv_params p = kvc_pmx_kv_default_params();
    ASSERT_OK(kvc_pmx_dynamic_key_value_cache(&tx, &tx, &tss, &tks, &tcs, &tsp, &tmx, &tmx, &tc,
                                              NULL, &p, NULL, NULL, NULL));
    ASSERT_TRUE(test_guard_ok(cache, 64));
    /* MHCA: kvstarts[1], [2] in slot 1's K and V, where batch 0 stores; the old
     * code then read batch 0 as ~4e18 keys long */
    memset(cache, 0, 64);
    int64_t *kv = (int64_t *)(cache + 2);
    kv[0] = 0, kv[1] = 1, kv[2] = 2;
    int64_t cs2[2] = {1, 2}, db = 0;
    float q[4] = {1, 1, 1, 1}, o[4];
    kvc_tensor tkv = kvc_tensor_make(kv, KVC_I64, 1, &n3), tcs2 = kvc_tensor_make(cs2, KVC_I64, 1, &n2);
    kvc_tensor tq = kvc_tensor_make(q, KVC_F32, 3, xsh), to = kvc_tensor_make(o, KVC_F32, 3, xsh);
    kvc_tensor tdb = kvc_tensor_make(&db, KVC_I64, 0, NULL);
    kvc_pmx_mhca_params mp = kvc_pmx_mhca_default_params();
    mp.num_heads = 1, mp.head_dim = 2;
    kvc_tensor tx2 = tx;
    float x2[4] = {3e9f, 3e9f, 1.0f, 2.0f};
    tx2.data = x2;
    ASSERT_OK(kvc_pmx_dynamic_multi_head_cache_attention(&tq, &tx2, &tx2, &tss, &tkv, &tcs2, &tsp,
                                                         &tdb, &tmx, &tmx, &tc, NULL, NULL, &mp,
                                                         &to, NULL));
    ASSERT_TRUE(test_guard_ok(cache, 64));
    /* the lengths and pages are taken before the store validates cachestarts:
     * a missing or mistyped one is still refused, not read */
    kv[0] = 0, kv[1] = 1, kv[2] = 2; /* as valid as before the store above */
    ASSERT_STATUS(kvc_pmx_dynamic_multi_head_cache_attention(&tq, &tx2, &tx2, &tss, &tkv, NULL,
                                                             &tsp, &tdb, &tmx, &tmx, &tc, NULL,
                                                             NULL, &mp, &to, NULL),
                  KVC_ERR_INVALID_ARG);
    kvc_tensor t32 = tcs2;
    t32.dtype = KVC_I32;
    ASSERT_STATUS(kvc_pmx_dynamic_multi_head_cache_attention(&tq, &tx2, &tx2, &tss, &tkv, &t32,
                                                             &tsp, &tdb, &tmx, &tmx, &tc, NULL,
                                                             NULL, &mp, &to, NULL),
                  KVC_ERR_INVALID_ARG);
    free(cache);
    return 0;
}

TEST(dynamic_rejects_leave_cache_unchanged) {
    static dyn_fixture f, orig;
    fixture_init(&f);
    ASSERT_OK(fixture_call(&f)); /* the unmutated call is valid */
    enum { N_MUT = 25 };
    for (int m = 0; m < N_MUT; m++) {
        fixture_init(&f);
        switch (m) {
        case 0: f.p.quant_bit = 5; break;
        case 1: f.p.quant_group = 3; break;
        case 2: f.p.cache_layout = 4; break;
        case 3: f.p.cache_mode = 2; break;
        case 4: f.p.page_size = 0; break;
        case 5: f.p.num_repeat = 0; break;
        case 6: f.p.layer_idx = 2; break;
        case 7: f.start[1] = 2; break;                       /* kvlen != start + seqlen */
        case 8: f.seqstarts[1] = 7; break;                   /* non-monotonic */
        case 9: f.cs[1] = -1; break;                         /* needed page is -1 */
        case 10: f.cs[3] = 30; break;                        /* page runs past MaxT */
        case 11: f.max_s = 3; break;
        case 12: f.max_kv = 4; break;
        case 13: f.ck[5 * 16 + 3] = 0x7e00; break;           /* NaN in the last stored row */
        case 14: f.tcs.shape[1] = 1; break;                  /* too few pages */
        case 15: f.ts.dtype = KVC_BF16; break;
        case 16: f.tc.dtype = KVC_I4; break;                 /* quant_bit 8 needs int8 */
        case 17: f.tv.dtype = KVC_F32; break;
        case 18: f.tok.shape[0] = 9; break;
        case 19: f.tc.shape[1] = 3; break;
        case 20: f.seqstarts[0] = 1; break;
        case 21: f.cv[2 * 16] = 0xfc00; break;               /* -Inf in current_value */
        case 22: f.tc.stride[0] = 0; break;                  /* layers share the written cache */
        case 23: f.ts.stride[2] = 0; break;                  /* slots share a written scale */
        case 24: f.tov.stride[0] = 0; break;                 /* output rows share memory */
        }
        memcpy(&orig, &f, sizeof f);
        kvc_clear_error();
        kvc_status st = fixture_call(&f);
        if (st != KVC_ERR_INVALID_ARG) TEST_FAIL_("mutation %d: status %s", m, kvc_status_str(st));
        ASSERT_TRUE(strlen(kvc_last_error()) > 10);
        if (m >= 22) ASSERT_STR_CONTAINS(kvc_last_error(), "stride 0");
        ASSERT_MEM_EQ(f.cache, orig.cache, sizeof f.cache);
        ASSERT_MEM_EQ(f.scale, orig.scale, sizeof f.scale);
        ASSERT_MEM_EQ(f.ok, orig.ok, sizeof f.ok);
    }
    /* Missing scale. */
    fixture_init(&f);
    ASSERT_STATUS(kvc_pmx_dynamic_key_value_cache(&f.tk, &f.tv, &f.tss, &f.tks, &f.tcs, &f.tsp,
                                                  &f.tms, &f.tmk, &f.tc, NULL, &f.p, &f.tok,
                                                  &f.tov, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "scale is required");
    return 0;
}

TEST(static_rejects_leave_cache_unchanged) {
    /* layout 0: (MaxB=2, L=1, 2, MaxS=8, H=1, Dh=8), float16 cache */
    uint16_t cache[2 * 2 * 8 * 8], before[sizeof cache / 2], ck[2 * 3 * 8], cv[2 * 3 * 8],
        out[2 * 8 * 8];
    for (size_t i = 0; i < sizeof cache / 2; i++) cache[i] = (uint16_t)(i * 7);
    memcpy(before, cache, sizeof cache);
    memset(ck, 0, sizeof ck);
    memset(cv, 0, sizeof cv);
    int64_t csh[6] = {2, 1, 2, 8, 1, 8}, ish[4] = {2, 3, 1, 8}, osh[4] = {2, 8, 1, 8};
    int64_t start = 5, one = 1;
    kvc_tensor tc = kvc_tensor_make(cache, KVC_F16, 6, csh);
    kvc_tensor tk = kvc_tensor_make(ck, KVC_F16, 4, ish), tv = kvc_tensor_make(cv, KVC_F16, 4, ish);
    kvc_tensor to = kvc_tensor_make(out, KVC_F16, 4, osh);
    kvc_tensor tsp = kvc_tensor_make(&start, KVC_I64, 1, &one);
    kvc_pmx_kv_params p = kvc_pmx_kv_default_params();
    /* start_pos + S = 8 == MaxS is fine ... */
    ASSERT_OK(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, &p, &to, NULL, NULL));
    memcpy(before, cache, sizeof cache);
    /* ... one more is not. */
    start = 6;
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, &p, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "MaxS");
    start = -1;
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, &p, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    start = 0;
    tk.shape[0] = tv.shape[0] = 3; /* B > MaxB */
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, &p, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "MaxB");
    tk.shape[0] = tv.shape[0] = 2;
    p.layer_idx = 1;
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, &p, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    p.layer_idx = 0;
    p.cache_layout = 2;
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, &p, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    p.cache_layout = 0;
    p.quant_bit = 8; /* float16 cache with quant_bit 8 */
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, &p, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    p.quant_bit = 0;
    tsp.dtype = KVC_I32;
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, &p, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    tsp.dtype = KVC_I64;
    tc.stride[0] = 0; /* the batches would share the written cache (fuzz_attn found it taken) */
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, &p, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "stride 0");
    tc.stride[0] = 2 * 8 * 8;
    tc.stride[5] = 2; /* last dim not contiguous */
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, &p, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    tc.stride[5] = 1;
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, NULL, NULL, &p, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_pmx_key_value_cache(&tk, &tv, &tsp, &tc, NULL, NULL, NULL, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_MEM_EQ(cache, before, sizeof cache);
    return 0;
}

TEST(zero_sizes) {
    /* B = 0 and S = 0 are valid no-ops on the store side. */
    float cache[1 * 1 * 2 * 4 * 1 * 4] = {0}, out[1];
    int64_t csh[6] = {1, 1, 2, 4, 1, 4}, ish[4] = {0, 0, 1, 4}, osh[4] = {0, 2, 1, 4}, start = 2;
    kvc_tensor tc = kvc_tensor_make(cache, KVC_F32, 6, csh);
    kvc_tensor tk = kvc_tensor_make(NULL, KVC_F32, 4, ish), to = kvc_tensor_make(out, KVC_F32, 4, osh);
    kvc_tensor tsp = kvc_tensor_make(&start, KVC_I64, 0, NULL);
    kvc_pmx_kv_params p = kvc_pmx_kv_default_params();
    ASSERT_OK(kvc_pmx_key_value_cache(&tk, &tk, &tsp, &tc, NULL, &p, &to, &to, NULL));
    return 0;
}

/* The output's heads H * num_repeat once wrapped (H 2^33, num_repeat 2^30:
 * 2^63), so a (1, 1, 0, 1) key passed its shape check and the read-back
 * wrote H * num_repeat rows into it. The cache: a 16 GiB MAP_NORESERVE
 * mapping nothing touches. */
TEST(output_heads_overflow_refused) {
    const int64_t H = (int64_t)1 << 33;
    int64_t cks[4] = {1, 0, H, 1}, cs[6] = {1, 1, 2, 1, H, 1}, os[4] = {1, 1, 0, 1};
    static int8_t dummy[1], kb[1];
    kvc_tensor ck = kvc_tensor_make(dummy, KVC_I8, 4, cks);
    const size_t cb = (size_t)(2 * H);
    void *cm = mmap(NULL, cb, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                    -1, 0);
    ASSERT_TRUE(cm != MAP_FAILED);
    kvc_tensor cache = kvc_tensor_make(cm, KVC_I8, 6, cs);
    int64_t sp = 1, one = 1;
    kvc_tensor tsp = kvc_tensor_make(&sp, KVC_I64, 1, &one);
    kvc_tensor key = kvc_tensor_make(kb, KVC_I8, 4, os);
    kvc_pmx_kv_params p = kvc_pmx_kv_default_params();
    p.num_repeat = 1 << 30;
    ASSERT_STATUS(kvc_pmx_key_value_cache(&ck, &ck, &tsp, &cache, NULL, &p, &key, NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "overflow");
    munmap(cm, cb);
    return 0;
}

const char *test_suite_name = "pmx";
const test_case test_suite[] = {
    TEST_ENTRY(static_grid),
    TEST_ENTRY(dynamic_grid),
    TEST_ENTRY(grids_with_streaming_loads),
    TEST_ENTRY(cache_over_index_tensors_stays_in_bounds), TEST_ENTRY(dynamic_rejects_leave_cache_unchanged),
    TEST_ENTRY(static_rejects_leave_cache_unchanged),
    TEST_ENTRY(zero_sizes),
    TEST_ENTRY(output_heads_overflow_refused),
    {0, 0},
};
