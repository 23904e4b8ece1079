/*
 * OpenPPL pmx KV-cache operators (SEMANTICS sections 2 and 3):
 *   kvc_pmx_key_value_cache          opmx::KeyValueCache (static batching)
 *   kvc_pmx_dynamic_key_value_cache  opmx.dynamic_batching::KeyValueCache
 *   kvc_pmx_dynamic_multi_head_cache_attention
 *                                    opmx.dynamic_batching::MultiHeadCacheAttention
 *
 * Both store the new tokens' K/V into a multi-layer cache (quantizing to
 * int8/int4 with group scales when quant_bit != 0) and then read back every
 * position of each sequence, dequantized, with each KV head repeated
 * num_repeat times consecutively (output head h is cache head h / num_repeat).
 *
 * Dtypes: T1 (current_key/value and outputs) float32, float16, bfloat16, or
 * int8 only as a plain copy into an int8 cache with quant_bit 0. T2 (cache)
 * float32, float16, bfloat16 (quant_bit 0; a float T1 is converted, round to
 * nearest even), int8 (quant_bit 8, or 0 with int8 T1) or int4 (quant_bit 4).
 * T3 (scale) float32 or float16. Outputs have the dtype of current_key.
 *
 * Every tensor needs a contiguous last dimension (stride 1) but the int64
 * index tensors (seqstarts, kvstarts, cachestarts, start_pos, ...), which
 * may be strided as in paged.h; the other strides are free. Every input
 * is validated before anything is written: a failed call changes neither
 * cache nor scale nor outputs.
 */
#ifndef KVCACHE_PMX_H
#define KVCACHE_PMX_H

#include "kvcache/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_pmx_kv_params {
    int32_t num_layer;    /* L >= 1 (default 1) */
    int32_t layer_idx;    /* 0 <= layer_idx < L (default 0) */
    int32_t quant_bit;    /* 0, 8 or 4 (default 0) */
    int32_t quant_group;  /* divides Dh, even for 4 bits (default 8) */
    int32_t num_repeat;   /* >= 1 (default 1) */
    int32_t cache_layout; /* static 0..1, dynamic 0..3 (default 0) */
    int32_t cache_mode;   /* dynamic only: 0 offset, 1 paged (default 0) */
    int32_t page_size;    /* dynamic only, used by cache_mode 1; >= 1 (default 128) */
} kvc_pmx_kv_params;

/* The defaults to start from: the operators below take no NULL params
 * (KVC_ERR_INVALID_ARG). */
KVC_API kvc_pmx_kv_params kvc_pmx_kv_default_params(void);

/*
 * Static KeyValueCache.
 *   current_key, current_value  (B, S, H, Dh) T1
 *   start_pos     int64, one element (0-d or (1,)): first position to store
 *   cache         T2, layout 0: (MaxB, L, 2, MaxS, H, Dh)
 *                     layout 1: (L, MaxB, 2, H, MaxS, Dh); index 0 of the 2 axis is K
 *                 (int4: Dh counts 4-bit elements, i.e. Dh/2 bytes per row)
 *   scale         T3, cache's shape with last dim Dh/quant_group; required
 *                 when quant_bit != 0, ignored (may be NULL) otherwise
 *   key, value    (B, start_pos + S, H * num_repeat, Dh) of T1, written;
 *                 either may be NULL to skip reading back that half
 *   pool          thread pool or NULL (calling thread only)
 * Stores positions [start_pos, start_pos+S) of batches [0, B) in layer
 * layer_idx, then reads positions [0, start_pos+S).
 * Errors (KVC_ERR_INVALID_ARG, nothing written): B > MaxB, start_pos < 0,
 * start_pos + S > MaxS, layer_idx >= L, shape/dtype mismatch, missing scale,
 * bad attributes, non-finite input with quant_bit != 0 (or, with float16
 * scales, input whose scale would overflow: kvc_quantize).
 */
KVC_API kvc_status kvc_pmx_key_value_cache(const kvc_tensor *current_key,
                                           const kvc_tensor *current_value,
                                           const kvc_tensor *start_pos, kvc_tensor *cache,
                                           kvc_tensor *scale, const kvc_pmx_kv_params *params,
                                           kvc_tensor *key, kvc_tensor *value,
                                           kvc_threadpool *pool);

/*
 * dynamic_batching.KeyValueCache.
 *   current_key, current_value  (seqstarts[B], H, Dh) T1
 *   seqstarts     (B+1) int64, seqstarts[0] == 0, non-decreasing
 *   kvstarts      (B+1) int64, kvstarts[0] == 0, non-decreasing
 *   cachestarts   int64, (B) in cache_mode 0: slot of position 0 of batch b;
 *                 (B, MaxP) in cache_mode 1: token offset (inside MaxT) of the
 *                 start of each page; unused entries may be -1
 *   start_pos     (B) int64, start_pos[b] >= 0
 *   max_seqlen, max_kvlen  int64, one element each: at least the largest
 *                 seqstarts / kvstarts difference
 *   cache         T2, layout 0: (MaxT, L, 2, H, Dh)   1: (L, MaxT, 2, H, Dh)
 *                           2: (L, 2, MaxT, H, Dh)   3: (L, 2, H, MaxT, Dh)
 *   scale         T3, cache's shape with last dim Dh/quant_group
 *   key, value    (kvstarts[B], H * num_repeat, Dh) T1, or NULL
 * For batch b, S_b = seqstarts[b+1]-seqstarts[b], kvlen_b = kvstarts[b+1]-
 * kvstarts[b] and p_b = start_pos[b]; kvlen_b must equal p_b + S_b. Position
 * t of b lives at slot cachestarts[b] + t (mode 0) or
 * cachestarts[b, t / page_size] + t % page_size (mode 1). Positions
 * [p_b, p_b+S_b) are stored, then [0, kvlen_b) are read into rows
 * [kvstarts[b], kvstarts[b+1]) of key/value.
 * Errors (KVC_ERR_INVALID_ARG, nothing written): a slot outside [0, MaxT),
 * a -1 (or any negative) page entry that is needed, too few pages, bad
 * starts, negative positions, max_* too small, and the section 2 errors.
 */
KVC_API kvc_status kvc_pmx_dynamic_key_value_cache(
    const kvc_tensor *current_key, const kvc_tensor *current_value, const kvc_tensor *seqstarts,
    const kvc_tensor *kvstarts, const kvc_tensor *cachestarts, const kvc_tensor *start_pos,
    const kvc_tensor *max_seqlen, const kvc_tensor *max_kvlen, kvc_tensor *cache,
    kvc_tensor *scale, const kvc_pmx_kv_params *params, kvc_tensor *key, kvc_tensor *value,
    kvc_threadpool *pool);

/*
 * dynamic_batching.MultiHeadCacheAttention: the dynamic KeyValueCache store
 * above (params->kv, num_repeat must be 1), then attention of the queries
 * over the cache, read in place (dequantized on the fly for int8/int4):
 *   s = q . k / sqrt(head_dim) + attn_mask,  o = softmax(s) v  (float32)
 * Query head h reads KV head h / (num_heads / num_kv_heads). Batch b's
 * queries are rows [seqstarts[b], seqstarts[b+1]) and see positions
 * [0, kvlen_b) of b; with is_causal, batches b >= decoding_batches with
 * seqlen > 1 are causal, bottom-right aligned (query i sees position j iff
 * j <= i + kvlen_b - seqlen_b). A row that sees no key (all -inf) gives 0.
 *   query          (seqstarts[B], num_heads, Dh) float32/float16/bfloat16
 *   current_key, current_value, seqstarts, kvstarts, cachestarts,
 *   start_pos, max_seqlen, max_kvlen, cache, scale: as the KeyValueCache
 *                  (current_key: (seqstarts[B], num_kv_heads, Dh), float)
 *   decoding_batches  int64, one element, in [0, B]
 *   attn_mask      NULL or an additive float32/float16 mask, (Sum seq,
 *                  >= Sum kv) or (num_heads, Sum seq, >= Sum kv); batch b
 *                  uses [.., seqstarts[b]:seqstarts[b+1],
 *                  kvstarts[b]:kvstarts[b+1]] (-inf masks a key; finite
 *                  values, -FLT_MAX padding included, never do: those
 *                  beyond +-FLT_MAX / log2(e) all count as +-FLT_MAX)
 *   attn_output    (seqstarts[B], num_heads, Dh), dtype of query
 * Everything (attention inputs included) is validated before the store: a
 * failed call changes neither cache, scale nor attn_output. int8/int4
 * caches need quant_bit 8/4. is_alibi is not supported yet
 * (KVC_ERR_UNSUPPORTED). Head dims up to 512.
 */
typedef struct kvc_pmx_mhca_params {
    kvc_pmx_kv_params kv; /* cache attributes (num_repeat must be 1) */
    int32_t num_heads;    /* query heads (required, >= 1) */
    int32_t head_dim;     /* Dh (required, >= 1) */
    int32_t num_kv_heads; /* 0: num_heads; divides num_heads */
    int32_t is_causal;    /* default 1 */
    int32_t is_alibi;     /* default 0; 1 is not supported yet */
} kvc_pmx_mhca_params;

/* kv defaults, num_heads = head_dim = 0 (to be set), num_kv_heads 0,
 * is_causal 1, is_alibi 0. */
KVC_API kvc_pmx_mhca_params kvc_pmx_mhca_default_params(void);

KVC_API kvc_status kvc_pmx_dynamic_multi_head_cache_attention(
    const kvc_tensor *query, const kvc_tensor *current_key, const kvc_tensor *current_value,
    const kvc_tensor *seqstarts, const kvc_tensor *kvstarts, const kvc_tensor *cachestarts,
    const kvc_tensor *start_pos, const kvc_tensor *decoding_batches,
    const kvc_tensor *max_seqlen, const kvc_tensor *max_kvlen, kvc_tensor *cache,
    kvc_tensor *scale, const kvc_tensor *attn_mask, const kvc_pmx_mhca_params *params,
    kvc_tensor *attn_output, kvc_threadpool *pool);

#ifdef __cplusplus
}
#endif
#endif
