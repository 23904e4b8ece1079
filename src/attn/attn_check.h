/*
 * Argument checks shared by every attention entry point (decode, prefill,
 * cascade, MLA, the pmx fused operator): one wording for the same mistake
 * wherever it is made.
 */
#ifndef KVC_ATTN_CHECK_H
#define KVC_ATTN_CHECK_H

#include <stdint.h>

#include "kvcache/attention.h"

/* 1 for float32, float16, bfloat16 (q/out dtypes). */
int kvc__attn_is_float(kvc_dtype d);

/* t non-NULL, valid, contiguous last dim, of exactly this ndim-D shape. */
kvc_status kvc__attn_check_shape(const char *fn, const char *name, const kvc_tensor *t, int ndim,
                                 const int64_t *shape);

/* q and out of shape qshape (ndim 2 or 3), float dtypes; lse (NULL or)
 * qshape without the last dim, float32. */
kvc_status kvc__attn_check_io(const char *fn, const kvc_tensor *q, const kvc_tensor *out,
                              const kvc_tensor *lse, int ndim, const int64_t *qshape);

/* Hq, H, D >= 1, Hq % H == 0; D > KVC_ATTN_MAX_DIM is KVC_ERR_UNSUPPORTED;
 * an unknown KVC_ISA value is refused (kvc_isa_env_check). */
kvc_status kvc__attn_check_heads(const char *fn, int64_t Hq, int64_t H, int64_t D);

/* *out = *p (or the defaults), checked (sinks: Hq values, none NaN or
 * +inf), with sm_scale 0 resolved to 1/sqrt(D). */
kvc_status kvc__attn_check_params(const char *fn, const kvc_attn_params *p, int64_t Hq,
                                  int64_t D, kvc_attn_params *out);

/*
 * How a driver hands scores to the kernels (kernels.h attn_decode, prefill.h,
 * mla.h): q unscaled (*qscale 1) and *sc = sm_scale * log2 e, so the
 * softmax takes the raw max and large scores keep their differences; unless
 * a soft cap (tanh of s * sm_scale: q times sm_scale), an additive mask
 * (added in base 2: `fold`) or a negative sm_scale (the raw max would be the
 * min) needs q scaled first (*qscale sm_scale * log2 e, *sc 1).
 */
static inline void kvc__attn_score_scale(float sm_scale, float cap, int fold, float *qscale,
                                         float *sc) {
    const float log2e = 1.4426950408889634f;
    fold = fold || cap > 0.0f || !(sm_scale > 0.0f);
    *qscale = cap > 0.0f ? sm_scale : fold ? sm_scale * log2e : 1.0f;
    *sc = fold ? 1.0f : sm_scale * log2e;
}

/* K/V pair (ndim-D, same shape and dtype, a storage dtype) with scales for
 * int8/int4 (shaped like k with last dim Dh / quant_group, float32/16). */
kvc_status kvc__attn_check_kv(const char *fn, const kvc_tensor *k, const kvc_tensor *v,
                              const kvc_tensor *ks, const kvc_tensor *vs, int32_t group,
                              int ndim);

/* A paged cache read with a plan: layout, K/V and scales as
 * kvc__attn_check_kv, and page_size, H, Dh and the plan's largest page id
 * matching the cache. */
kvc_status kvc__attn_check_paged(const char *fn, const kvc_paged_cache *cache, int64_t page_size,
                                 int64_t H, int64_t D, int64_t max_page);

#endif
