/*
 * Prefill attention (SEMANTICS section 5): any number of query rows per
 * request over K/V read in place from a contiguous (single), paged (CSR page
 * table) or ragged cache, in every storage dtype (float32, float16,
 * bfloat16, int8/int4 dequantized on the fly with group scales), and the
 * multi-level cascade built on it.
 *
 *   s_ij = sm_scale * q_i . k_j   (then cap * tanh(s / cap) when soft-capped)
 *   visible(i, j): causal (bottom-right): j <= i + kv_len - qo_len;
 *                  window_left w >= 0 also requires j >= i + kv_len - qo_len - w
 *                  (with or without causal); a custom mask replaces causal.
 *   o_i = sum_j softmax_j(s_i)_j v_j over visible j, lse_i base 2;
 *   a row with no visible key: o_i = 0, lse_i = -inf (never NaN).
 * Query head h reads KV head h / (Hq / H).
 *
 * Masks (uint8): custom_mask is boolean (nonzero = visible), (qo_len, kv_len)
 * row-major per request; packed_custom_mask is the same bits packed
 * little-endian (bit i of the flattened mask in byte i / 8, bit i % 8), each
 * request's mask padded to a whole byte. In batches both are flat 1-D
 * arrays with the requests concatenated in order (packed: offsets in bytes).
 * Give at most one of them.
 *
 * Row independence: the result of a query row depends only on that row, the
 * keys it sees (and their positions), the parameters and the ISA; not on
 * qo_len, the other rows or requests of the batch, or the thread count.
 * A row of a causal prefill is bitwise equal to the same row run alone as a
 * one-row request over the keys it sees. (The model runtime relies on this:
 * generation with the cache equals recomputation, seed 001.)
 *
 * Every call validates first and writes nothing on error. Dh <= 512.
 */
#ifndef KVCACHE_PREFILL_H
#define KVCACHE_PREFILL_H

#include "kvcache/attention.h"
#include "kvcache/core.h"
#include "kvcache/paged.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * One request.
 *   q        (qo_len, Hq, Dh) float32/float16/bfloat16
 *   k, v     NHD (kv_len, H, Dh) or HND (H, kv_len, Dh) in a storage dtype;
 *            int8/int4: k_scale, v_scale shaped like k with last dim
 *            Dh / quant_group (float32 or float16); int4 rows hold Dh
 *            4-bit elements (Dh / 2 bytes)
 *   causal   0/1 (ignored when a custom mask is given)
 *   custom_mask (qo_len, kv_len) or (qo_len * kv_len) uint8, or NULL
 *   packed_custom_mask (ceil(qo_len * kv_len / 8)) uint8, or NULL
 *   out      (qo_len, Hq, Dh) float32/float16/bfloat16; lse (qo_len, Hq) float32 or NULL
 */
KVC_API kvc_status kvc_single_prefill(const kvc_tensor *q, const kvc_tensor *k,
                                      const kvc_tensor *v, const kvc_tensor *k_scale,
                                      const kvc_tensor *v_scale, int32_t quant_group,
                                      kvc_kv_layout layout, int32_t causal,
                                      const kvc_tensor *custom_mask,
                                      const kvc_tensor *packed_custom_mask,
                                      const kvc_attn_params *params, kvc_tensor *out,
                                      kvc_tensor *lse, kvc_threadpool *pool);

/*
 * Batched prefill, planned once per batch composition (validates indptrs,
 * page table and mask sizes, copies them, partitions the work for n_threads
 * and allocates every buffer run needs), then run per layer with no
 * allocation. Requests with qo_len 0 are allowed (nothing to write).
 * n_threads: the largest pool run will be given (<= 0: the online CPUs; at
 * most 1024, as for decode and cascade plans); run rejects a pool with more
 * threads. Results do not depend on it. A plan
 * holds work buffers: one run at a time per plan.
 */
typedef struct kvc_prefill_plan kvc_prefill_plan;

/*
 * Paged K/V.
 *   qo_indptr (B+1) int32: request b's query rows are [qo_indptr[b], qo_indptr[b+1])
 *   kv_indptr, kv_indices, kv_last_page_len: CSR page table (paged.h)
 *   custom_mask / packed_custom_mask: flat, concatenated per request, or NULL
 */
KVC_API kvc_status kvc_prefill_plan_create_paged(
    const kvc_tensor *qo_indptr, const kvc_tensor *kv_indptr, const kvc_tensor *kv_indices,
    const kvc_tensor *kv_last_page_len, int32_t num_qo_heads, int32_t num_kv_heads,
    int32_t head_dim, int32_t page_size, int32_t causal, const kvc_tensor *custom_mask,
    const kvc_tensor *packed_custom_mask, int32_t n_threads, kvc_prefill_plan **out);

/* Ragged K/V: request b's keys are rows [kv_indptr[b], kv_indptr[b+1]) of k/v. */
KVC_API kvc_status kvc_prefill_plan_create_ragged(const kvc_tensor *qo_indptr,
                                                  const kvc_tensor *kv_indptr,
                                                  int32_t num_qo_heads, int32_t num_kv_heads,
                                                  int32_t head_dim, int32_t causal,
                                                  const kvc_tensor *custom_mask,
                                                  const kvc_tensor *packed_custom_mask,
                                                  int32_t n_threads, kvc_prefill_plan **out);

KVC_API void kvc_prefill_plan_destroy(kvc_prefill_plan *plan); /* NULL is a no-op */

/* Turns the plan's causal mask on (1) or off (0) for later runs, as
 * FlashInfer's run-time mask mode (its deprecated forward(causal=...)):
 * the work partition does not depend on it. A plan with a custom mask keeps
 * the mask (causal stays ignored). */
KVC_API kvc_status kvc_prefill_plan_set_causal(kvc_prefill_plan *plan, int32_t causal);

/*
 *   q      (qo_indptr[B], Hq, Dh) float32/float16/bfloat16
 *   cache  paged cache matching the plan (page_size, H, Dh); page ids inside it
 *   out    (qo_indptr[B], Hq, Dh) float32/float16/bfloat16 (any of them, converted
 *          once at the end); lse (qo_indptr[B], Hq) float32 or NULL
 */
KVC_API kvc_status kvc_prefill_run_paged(kvc_prefill_plan *plan, const kvc_tensor *q,
                                         const kvc_paged_cache *cache,
                                         const kvc_attn_params *params, kvc_tensor *out,
                                         kvc_tensor *lse, kvc_threadpool *pool);

/*
 *   k, v   NHD (kv_indptr[B], H, Dh) or HND (H, kv_indptr[B], Dh), storage
 *          dtype; scales as in kvc_single_prefill
 */
KVC_API kvc_status kvc_prefill_run_ragged(kvc_prefill_plan *plan, const kvc_tensor *q,
                                          const kvc_tensor *k, const kvc_tensor *v,
                                          const kvc_tensor *k_scale, const kvc_tensor *v_scale,
                                          int32_t quant_group, kvc_kv_layout layout,
                                          const kvc_attn_params *params, kvc_tensor *out,
                                          kvc_tensor *lse, kvc_threadpool *pool);

/*
 * Multi-level cascade over one paged cache (FlashInfer's
 * MultiLevelCascadeAttentionWrapper): level l is a batched prefill with its
 * own qo_indptr[l] (all ending at the same total of query rows) and page
 * table; causal applies to the last level only; the levels' states are
 * merged with merge_state in level order. Parameters (window included)
 * apply to each level as to a batched prefill. The plan holds work buffers:
 * one run at a time per plan.
 *   qo_indptr, kv_indptr, kv_indices, kv_last_page_len: arrays of num_levels tensors
 */
typedef struct kvc_cascade_plan kvc_cascade_plan;

KVC_API kvc_status kvc_cascade_plan_create(int32_t num_levels, const kvc_tensor *qo_indptr,
                                           const kvc_tensor *kv_indptr,
                                           const kvc_tensor *kv_indices,
                                           const kvc_tensor *kv_last_page_len,
                                           int32_t num_qo_heads, int32_t num_kv_heads,
                                           int32_t head_dim, int32_t page_size, int32_t causal,
                                           int32_t n_threads, kvc_cascade_plan **out);
KVC_API void kvc_cascade_plan_destroy(kvc_cascade_plan *plan); /* NULL is a no-op */

/* q, out (nnz_qo, Hq, Dh) float32/float16/bfloat16 (out's dtype may differ
 * from q's); cache: the paged cache every level's page table indexes (page
 * size, H, Dh as planned; int8/int4 with its scales, as for
 * kvc_prefill_run_paged); lse (nnz_qo, Hq) float32 or NULL. */
KVC_API kvc_status kvc_cascade_run(kvc_cascade_plan *plan, const kvc_tensor *q,
                                   const kvc_paged_cache *cache, const kvc_attn_params *params,
                                   kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool);

#ifdef __cplusplus
}
#endif
#endif
