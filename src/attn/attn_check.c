/* Argument checks shared by the attention entry points (attn_check.h). */
#include <float.h>
#include <math.h>
#include <stdio.h>

#include "attn_check.h"
#include "../core/internal.h"
#include "../kernels/kernels.h" /* KVC_ATTN_MAX_DIM */

int kvc__attn_is_float(kvc_dtype d) { return d == KVC_F32 || d == KVC_F16 || d == KVC_BF16; }

kvc_status kvc__attn_check_shape(const char *fn, const char *name, const kvc_tensor *t, int ndim,
                                 const int64_t *shape) {
    char buf[128], want[128];
    KVC_CHECK(t != NULL, "%s: %s is NULL", fn, name);
    KVC_TRY(kvc__check_tensor(t, name, 1));
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    if (!ok) {
        int n = 0;
        want[0] = '\0';
        for (int i = 0; i < ndim; i++)
            n += snprintf(want + n, sizeof want - (size_t)n, "%s%lld", i ? ", " : "",
                          (long long)shape[i]);
        return kvc__error(KVC_ERR_INVALID_ARG, "%s: %s has shape %s, expected (%s)", fn, name,
                          kvc__shape_str(t, buf, sizeof buf), want);
    }
    return KVC_OK;
}

/* q/out/lse: q and out of shape qshape (ndim 2 or 3) float dtypes, lse of
 * qshape without the last dim, float32. */
kvc_status kvc__attn_check_io(const char *fn, const kvc_tensor *q, const kvc_tensor *out,
                              const kvc_tensor *lse, int ndim, const int64_t *qshape) {
    KVC_TRY(kvc__attn_check_shape(fn, "q", q, ndim, qshape));
    KVC_CHECK(kvc__attn_is_float(q->dtype), "%s: q must be float32, float16 or bfloat16, not %s", fn,
              kvc_dtype_name(q->dtype));
    KVC_CHECK(out != NULL, "%s: out is NULL", fn);
    KVC_TRY(kvc__attn_check_shape(fn, "out", out, ndim, qshape));
    KVC_TRY(kvc__check_writable(out, "out"));
    KVC_CHECK(kvc__attn_is_float(out->dtype), "%s: out must be float32, float16 or bfloat16, not %s", fn,
              kvc_dtype_name(out->dtype));
    if (lse) {
        KVC_TRY(kvc__attn_check_shape(fn, "lse", lse, ndim - 1, qshape));
        KVC_TRY(kvc__check_writable(lse, "lse"));
        KVC_CHECK(lse->dtype == KVC_F32, "%s: lse must be float32, not %s", fn,
                  kvc_dtype_name(lse->dtype));
    }
    return KVC_OK;
}

kvc_status kvc__attn_check_heads(const char *fn, int64_t Hq, int64_t H, int64_t D) {
    KVC_TRY(kvc_isa_env_check()); /* the attention calls pick their kernels next */
    KVC_CHECK(Hq >= 1 && H >= 1 && D >= 1, "%s: Hq %lld, H %lld and Dh %lld must be >= 1", fn,
              (long long)Hq, (long long)H, (long long)D);
    KVC_CHECK(Hq % H == 0, "%s: num_qo_heads %lld must be a multiple of num_kv_heads %lld", fn,
              (long long)Hq, (long long)H);
    if (D > KVC_ATTN_MAX_DIM)
        return kvc__error(KVC_ERR_UNSUPPORTED, "%s: head_dim %lld > %d is not supported", fn,
                          (long long)D, KVC_ATTN_MAX_DIM);
    return KVC_OK;
}

kvc_status kvc__attn_check_params(const char *fn, const kvc_attn_params *p, int64_t Hq,
                                  int64_t D, kvc_attn_params *out) {
    *out = p ? *p : kvc_attn_default_params();
    KVC_CHECK(isfinite(out->sm_scale), "%s: sm_scale must be finite", fn);
    KVC_CHECK(isfinite(out->logits_soft_cap) && out->logits_soft_cap >= 0.0f,
              "%s: logits_soft_cap must be finite and >= 0 (0 disables it)", fn);
    KVC_CHECK(out->window_left >= -1, "%s: window_left %d must be >= -1", fn,
              (int)out->window_left);
    /* the sink enters as a state with lse sinks[h] * log2 e: past FLT_MAX /
     * log2 e that is +inf and the output NaN */
    for (int64_t h = 0; out->sinks && h < Hq; h++)
        KVC_CHECK(!isnan(out->sinks[h]) && out->sinks[h] * 1.44269504f != INFINITY,
                  "%s: sinks[%lld] is %g (a logit below %g, or -inf for no sink)", fn,
                  (long long)h, (double)out->sinks[h], (double)(FLT_MAX / 1.44269504f));
    if (out->sm_scale == 0.0f) out->sm_scale = (float)(1.0 / sqrt((double)D));
    return KVC_OK;
}

kvc_status kvc__attn_check_kv(const char *fn, const kvc_tensor *k, const kvc_tensor *v,
                           const kvc_tensor *ks, const kvc_tensor *vs, int32_t group,
                              int ndim) {
    char b1[128], b2[128];
    KVC_CHECK(k != NULL && v != NULL, "%s: k and v must not be NULL", fn);
    KVC_TRY(kvc__check_tensor(k, "k", 1));
    KVC_TRY(kvc__check_tensor(v, "v", 1));
    KVC_CHECK(k->ndim == ndim, "%s: k must be %d-D, not %d-D", fn, ndim, (int)k->ndim);
    int same = v->ndim == k->ndim && v->dtype == k->dtype;
    for (int i = 0; same && i < ndim; i++) same = k->shape[i] == v->shape[i];
    KVC_CHECK(same, "%s: k %s %s and v %s %s must match in shape and dtype", fn,
              kvc_dtype_name(k->dtype), kvc__shape_str(k, b1, sizeof b1), kvc_dtype_name(v->dtype),
              kvc__shape_str(v, b2, sizeof b2));
    const kvc_dtype dt = k->dtype;
    KVC_CHECK(kvc__attn_is_float(dt) || dt == KVC_I8 || dt == KVC_I4,
              "%s: k/v dtype %s is not a cache storage dtype (float32, float16, bfloat16, int8, "
              "int4)", fn, kvc_dtype_name(dt));
    if (dt != KVC_I8 && dt != KVC_I4) return KVC_OK;
    const int64_t D = k->shape[ndim - 1];
    KVC_CHECK(group > 0 && D % group == 0 && (dt != KVC_I4 || group % 2 == 0),
              "%s: quant_group %d must divide Dh %lld (and be even for int4)", fn, (int)group,
              (long long)D);
    int64_t sshape[KVC_MAX_DIMS];
    for (int i = 0; i < ndim; i++) sshape[i] = k->shape[i];
    sshape[ndim - 1] = D / group;
    const kvc_tensor *sc[2] = {ks, vs};
    const char *names[2] = {"k_scale", "v_scale"};
    for (int i = 0; i < 2; i++) {
        KVC_CHECK(sc[i] != NULL, "%s: a %s cache needs %s", fn, kvc_dtype_name(dt), names[i]);
        KVC_TRY(kvc__attn_check_shape(fn, names[i], sc[i], ndim, sshape));
        KVC_CHECK(sc[i]->dtype == KVC_F32 || sc[i]->dtype == KVC_F16,
                  "%s: %s must be float32 or float16, not %s", fn, names[i],
                  kvc_dtype_name(sc[i]->dtype));
    }
    return KVC_OK;
}

kvc_status kvc__attn_check_paged(const char *fn, const kvc_paged_cache *cache, int64_t page_size,
                                 int64_t H, int64_t D, int64_t max_page) {
    KVC_CHECK(cache != NULL, "%s: cache is NULL", fn);
    KVC_CHECK(cache->layout == KVC_NHD || cache->layout == KVC_HND, "%s: invalid layout %d", fn,
              (int)cache->layout);
    const kvc_tensor *k = &cache->k;
    const int nhd = cache->layout == KVC_NHD;
    char buf[128];
    /* the cache against the plan before its scales: an int4 cache passed
     * unpacked (Dh bytes per row) is reported as that, not as a scale shape */
    KVC_CHECK(k->ndim == 4, "%s: k must be 4-D, not %d-D", fn, (int)k->ndim);
    const int64_t ps = nhd ? k->shape[1] : k->shape[2], h = nhd ? k->shape[2] : k->shape[1];
    KVC_CHECK(ps == page_size && h == H && k->shape[3] == D,
              "%s: cache %s %s (%s) does not match the plan (page_size %lld, H %lld, Dh %lld)%s",
              fn, kvc_dtype_name(k->dtype), kvc__shape_str(k, buf, sizeof buf),
              nhd ? "NHD" : "HND", (long long)page_size, (long long)H, (long long)D,
              k->dtype == KVC_I4 ? "; an int4 shape counts elements, stored as Dh / 2 bytes" : "");
    const int quant = k->dtype == KVC_I8 || k->dtype == KVC_I4;
    KVC_TRY(kvc__attn_check_kv(fn, &cache->k, &cache->v, quant ? &cache->k_scale : NULL,
                               quant ? &cache->v_scale : NULL, cache->quant_group, 4));
    KVC_CHECK(max_page < k->shape[0], "%s: page id %lld outside the cache's %lld pages", fn,
              (long long)max_page, (long long)k->shape[0]);
    return KVC_OK;
}
