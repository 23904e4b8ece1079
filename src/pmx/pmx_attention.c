/*
 * opmx.dynamic_batching::MultiHeadCacheAttention (pmx.h): validate every
 * input, store the new tokens with kvc_pmx_dynamic_key_value_cache (which
 * validates its own inputs before writing), then run the prefill engine
 * (src/attn/prefill_internal.h) over the pmx cache in place: position t of
 * batch b is slot cachestarts[b] + t (mode 0: one "page" per batch) or
 * cachestarts[b, t / page_size] + t % page_size (mode 1), and a slot is a
 * token row of the layout's K or V half, so the engine's page id is the
 * slot of the page start and its id multiplier the token stride.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pmx_common.h"
#include "../attn/attn_check.h"
#include "../attn/prefill_internal.h"

kvc_pmx_mhca_params kvc_pmx_mhca_default_params(void) {
    kvc_pmx_mhca_params p;
    memset(&p, 0, sizeof p);
    p.kv = kvc_pmx_kv_default_params();
    p.is_causal = 1;
    return p;
}

/* Which cache dimension holds tokens, heads, layers and K|V, per layout
 * (as in pmx_dynamic.c). */
static const int tok_dim[4] = {0, 1, 2, 3}, head_dim[4] = {3, 3, 3, 2};
static const int layer_dim[4] = {1, 0, 0, 0}, kv_dim[4] = {2, 2, 1, 1};

static kvc__pf_view half_view(const kvc_tensor *t, int layout, int layer, int kv) {
    kvc__pf_view v;
    v.data = kvc__at(t, layer * t->stride[layer_dim[layout]] + kv * t->stride[kv_dim[layout]]);
    v.dt = t->dtype;
    v.tok_st = t->stride[tok_dim[layout]];
    v.head_st = t->stride[head_dim[layout]];
    v.id_mul = v.tok_st; /* page ids are slots */
    return v;
}

static int64_t i64_1d(const kvc_tensor *t, int64_t i) {
    return ((const int64_t *)t->data)[i * t->stride[0]];
}

/* (B+1) int64 starts: [0] == 0, non-decreasing. */
static kvc_status check_starts(const char *fn, const char *name, const kvc_tensor *t) {
    char b1[96];
    KVC_CHECK(t != NULL, "%s: %s is NULL", fn, name);
    KVC_TRY(kvc__check_tensor(t, name, 0));
    KVC_CHECK(t->dtype == KVC_I64 && t->ndim == 1 && t->shape[0] >= 1,
              "%s: %s must be (B+1,) int64, got %s %s", fn, name, kvc_dtype_name(t->dtype),
              kvc__shape_str(t, b1, sizeof b1));
    KVC_CHECK(i64_1d(t, 0) == 0, "%s: %s[0] must be 0", fn, name);
    for (int64_t b = 0; b + 1 < t->shape[0]; b++)
        KVC_CHECK(i64_1d(t, b + 1) >= i64_1d(t, b), "%s: %s must be non-decreasing (at %lld)", fn,
                  name, (long long)b);
    return KVC_OK;
}


kvc_status kvc_pmx_dynamic_multi_head_cache_attention(
    const kvc_tensor *query, const kvc_tensor *current_key, const kvc_tensor *current_value,
    const kvc_tensor *seqstarts, const kvc_tensor *kvstarts, const kvc_tensor *cachestarts,
    const kvc_tensor *start_pos, const kvc_tensor *decoding_batches,
    const kvc_tensor *max_seqlen, const kvc_tensor *max_kvlen, kvc_tensor *cache,
    kvc_tensor *scale, const kvc_tensor *attn_mask, const kvc_pmx_mhca_params *params,
    kvc_tensor *attn_output, kvc_threadpool *pool) {
    static const char fn[] = "kvc_pmx_dynamic_multi_head_cache_attention";
    char b1[96];
    KVC_CHECK(params != NULL, "%s: params is NULL", fn);
    KVC_CHECK(query && current_key && current_value && cache && attn_output,
              "%s: query, current_key, current_value, cache and attn_output must not be NULL", fn);
    if (params->is_alibi)
        return kvc__error(KVC_ERR_UNSUPPORTED, "%s: is_alibi is not supported yet", fn);
    const int64_t Hq = params->num_heads, D = params->head_dim;
    const int64_t H = params->num_kv_heads ? params->num_kv_heads : Hq;
    KVC_CHECK(Hq >= 1 && D >= 1 && H >= 1, "%s: num_heads %lld, head_dim %lld and num_kv_heads "
              "%lld must be >= 1 (num_kv_heads 0 means num_heads)", fn, (long long)Hq,
              (long long)D, (long long)H);
    KVC_TRY(kvc__attn_check_heads(fn, Hq, H, D));
    KVC_CHECK(params->kv.num_repeat == 1, "%s: kv.num_repeat must be 1 (GQA comes from "
              "num_kv_heads), got %d", fn, (int)params->kv.num_repeat);
    KVC_CHECK(params->kv.cache_layout >= 0 && params->kv.cache_layout <= 3,
              "%s: cache_layout must be 0..3, got %d", fn, (int)params->kv.cache_layout);
    KVC_CHECK(params->kv.cache_mode == 0 || params->kv.cache_mode == 1,
              "%s: cache_mode must be 0 or 1, got %d", fn, (int)params->kv.cache_mode);
    KVC_CHECK(params->kv.page_size >= 1, "%s: page_size must be >= 1, got %d", fn,
              (int)params->kv.page_size); /* mode 0 does not use it, as in the store */
    /* tensors the store does not look at */
    KVC_TRY(kvc__check_tensor(current_key, "current_key", 1));
    KVC_TRY(kvc__check_tensor(cache, "cache", 1));
    KVC_TRY(kvc__check_writable(cache, "cache"));
    KVC_CHECK(current_key->ndim == 3 && current_key->shape[1] == H && current_key->shape[2] == D,
              "%s: current_key %s must be (seqstarts[B], num_kv_heads=%lld, head_dim=%lld)", fn,
              kvc__shape_str(current_key, b1, sizeof b1), (long long)H, (long long)D);
    KVC_CHECK(kvc__attn_is_float(current_key->dtype), "%s: current_key must be float32, float16 or "
              "bfloat16 for attention, not %s", fn, kvc_dtype_name(current_key->dtype));
    const int quant = cache->dtype == KVC_I8 || cache->dtype == KVC_I4;
    KVC_CHECK(!quant || params->kv.quant_bit != 0, "%s: attention over a %s cache needs "
              "quant_bit %d", fn, kvc_dtype_name(cache->dtype), cache->dtype == KVC_I8 ? 8 : 4);
    KVC_TRY(check_starts(fn, "seqstarts", seqstarts));
    KVC_TRY(check_starts(fn, "kvstarts", kvstarts));
    const int64_t B = seqstarts->shape[0] - 1;
    KVC_CHECK(kvstarts->shape[0] == B + 1, "%s: kvstarts must have B+1 = %lld entries", fn,
              (long long)(B + 1));
    const int64_t nq = i64_1d(seqstarts, B), nkv = i64_1d(kvstarts, B);
    /* shapes under the operator's own names first (the shared check says q/out) */
    KVC_TRY(kvc__check_tensor(query, "query", 1));
    KVC_TRY(kvc__check_tensor(attn_output, "attn_output", 1));
    for (int i = 0; i < 2; i++) {
        const kvc_tensor *t = i ? attn_output : query;
        KVC_CHECK(t->ndim == 3 && t->shape[0] == nq && t->shape[1] == Hq && t->shape[2] == D,
                  "%s: %s %s must be (seqstarts[B]=%lld, num_heads=%lld, head_dim=%lld)", fn,
                  i ? "attn_output" : "query", kvc__shape_str(t, b1, sizeof b1), (long long)nq,
                  (long long)Hq, (long long)D);
    }
    KVC_TRY(kvc__pf_check_io(fn, query, attn_output, NULL, nq, Hq, D));
    KVC_CHECK(attn_output->dtype == query->dtype, "%s: attn_output must have query's dtype %s, "
              "not %s", fn, kvc_dtype_name(query->dtype), kvc_dtype_name(attn_output->dtype));
    int64_t db = 0;
    KVC_TRY(kvc__pmx_scalar_i64(fn, "decoding_batches", decoding_batches, &db));
    KVC_CHECK(db >= 0 && db <= B, "%s: decoding_batches %lld outside [0, B=%lld]", fn,
              (long long)db, (long long)B);
    if (attn_mask) {
        KVC_TRY(kvc__check_tensor(attn_mask, "attn_mask", 1));
        const int nd = attn_mask->ndim;
        KVC_CHECK(attn_mask->dtype == KVC_F32 || attn_mask->dtype == KVC_F16,
                  "%s: attn_mask must be float32 or float16, not %s", fn,
                  kvc_dtype_name(attn_mask->dtype));
        KVC_CHECK((nd == 2 || (nd == 3 && attn_mask->shape[0] == Hq)) &&
                      attn_mask->shape[nd - 2] == nq && attn_mask->shape[nd - 1] >= nkv,
                  "%s: attn_mask %s must be (%lld, >= %lld) or (%lld, %lld, >= %lld)", fn,
                  kvc__shape_str(attn_mask, b1, sizeof b1), (long long)nq, (long long)nkv,
                  (long long)Hq, (long long)nq, (long long)nkv);
    }
    for (int64_t b = 0; b < B; b++)
        KVC_CHECK(i64_1d(kvstarts, b + 1) - i64_1d(kvstarts, b) <= INT32_MAX,
                  "%s: batch %lld is too long", fn, (long long)b);

    /* Everything the attention needs, allocated before the store. A batch
     * uses at most cachestarts' MaxP pages (more fails the store's checks),
     * so lengths the store will refuse cannot ask for a huge buffer. */
    const int mode = params->kv.cache_mode;
    const int64_t ps = params->kv.page_size;
    const int64_t max_p = cachestarts && cachestarts->ndim == 2 ? cachestarts->shape[1] : 0;
    int64_t n_pages = 0, maxkv = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t kl = i64_1d(kvstarts, b + 1) - i64_1d(kvstarts, b);
        const int64_t np_b = kl > 0 ? (kl + ps - 1) / ps : 0;
        n_pages += mode == 0 ? 1 : np_b < max_p ? np_b : max_p;
        if (kl > maxkv) maxkv = kl;
        if (n_pages > ((int64_t)1 << 40))
            return kvc__error(KVC_ERR_NOMEM, "%s: %lld pages: out of memory", fn,
                              (long long)n_pages);
    }
    const size_t nb = (size_t)(B > 0 ? B : 1);
    int64_t *buf = malloc((7 * nb + 1 + (size_t)n_pages + 1) * sizeof(int64_t));
    uint8_t *causal = malloc(nb);
    kvc__pf_scratch *scr = NULL;
    kvc_status st = KVC_OK;
    if (!buf || !causal) st = kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    if (st == KVC_OK) st = kvc__pf_scratch_create(fn, kvc_threadpool_n_threads(pool), D, &scr);
    int64_t *qo0 = buf, *qo_len = buf + nb, *kv_len = buf + 2 * nb, *page0 = buf + 3 * nb;
    int64_t *row0 = buf + 4 * nb, *col0 = buf + 5 * nb, *task0 = buf + 6 * nb;
    /* cachestarts is not validated yet (the store does it): read it only in
     * the shape the store requires, else the store fails before any use */
    const int cs_ok = cachestarts && cachestarts->data && (uintptr_t)cachestarts->data % 8 == 0 &&
                      cachestarts->dtype == KVC_I64 &&
                      cachestarts->ndim == (mode == 0 ? 1 : 2) && cachestarts->shape[0] == B &&
                      cachestarts->stride[0] >= 0 && (mode == 0 || cachestarts->stride[1] >= 0);
    if (st == KVC_OK && cs_ok) {
        /* The lengths and pages, taken before the store writes the cache (a
         * cache laid over the index tensors, undefined by core.h, must not
         * send the attention out of bounds); the store then validates these
         * same values, and within the sizes above whatever they are. */
        int64_t *pages = buf + 7 * nb + 1, np = 0;
        const kvc_tensor *cs = cachestarts;
        for (int64_t b = 0; b < B; b++) {
            qo0[b] = row0[b] = i64_1d(seqstarts, b);
            qo_len[b] = i64_1d(seqstarts, b + 1) - qo0[b];
            col0[b] = i64_1d(kvstarts, b);
            kv_len[b] = i64_1d(kvstarts, b + 1) - col0[b];
            causal[b] = params->is_causal && qo_len[b] > 1 && b >= db;
            page0[b] = np;
            if (mode == 0) {
                pages[np++] = ((const int64_t *)cs->data)[b * cs->stride[0]];
            } else {
                const int64_t np_b = kv_len[b] > 0 ? (kv_len[b] + ps - 1) / ps : 0;
                for (int64_t p = 0; p < np_b && p < max_p; p++)
                    pages[np++] = ((const int64_t *)cs->data)[b * cs->stride[0] + p * cs->stride[1]];
            }
        }
    }
    /* The store validates the cache, scale, cachestarts, start_pos and the
     * lengths before writing; after it succeeds nothing can fail. */
    if (st == KVC_OK)
        st = kvc_pmx_dynamic_key_value_cache(current_key, current_value, seqstarts, kvstarts,
                                             cachestarts, start_pos, max_seqlen, max_kvlen, cache,
                                             scale, &params->kv, NULL, NULL, pool);
    if (st == KVC_OK) {
        int64_t *pages = buf + 7 * nb + 1;
        kvc__pf_batch bt;
        memset(&bt, 0, sizeof bt);
        bt.B = B, bt.Hq = Hq, bt.H = H, bt.D = D;
        bt.qo0 = qo0, bt.qo_len = qo_len, bt.kv_len = kv_len, bt.causal = causal;
        kvc__pf_tiling(&bt, task0);
        const int layout = params->kv.cache_layout, layer = params->kv.layer_idx;
        kvc__pf_kv kv;
        memset(&kv, 0, sizeof kv);
        kv.k = half_view(cache, layout, layer, 0);
        kv.v = half_view(cache, layout, layer, 1);
        kv.quant = quant;
        if (quant) {
            kv.ks = half_view(scale, layout, layer, 0);
            kv.vs = half_view(scale, layout, layer, 1);
            kv.group = params->kv.quant_group;
        }
        kv.page_size = mode == 0 ? maxkv + 1 : ps;
        kv.pages = pages;
        kv.page0 = page0;
        kvc__pf_mask mk;
        memset(&mk, 0, sizeof mk);
        if (attn_mask) {
            const int nd = attn_mask->ndim;
            mk.kind = KVC__PF_MASK_ADD;
            mk.add = attn_mask->data;
            mk.add_dt = attn_mask->dtype;
            mk.add_sh = nd == 3 ? attn_mask->stride[0] : 0;
            mk.add_sr = attn_mask->stride[nd - 2];
            mk.row0 = row0;
            mk.col0 = col0;
        }
        kvc__pf_io io;
        kvc__pf_set_io(&io, query, attn_output, NULL);
        kvc_attn_params ap = kvc_attn_default_params();
        ap.sm_scale = (float)(1.0 / sqrt((double)D));
        kvc__pf_execute(&bt, &kv, &mk, &io, &ap, scr, pool);
    }
    kvc__pf_scratch_destroy(scr);
    free(causal);
    free(buf);
    return st;
}
