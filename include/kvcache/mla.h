/*
 * Multi-head latent attention (MLA) decode over paged ckv/kpe caches
 * (SEMANTICS sections 4 and 5), DeepSeek-style with the projections
 * absorbed, as FlashInfer's BatchMLAPagedAttentionWrapper computes it.
 *
 * All Hq query heads share one latent KV per token: ckv_j (D_ckv) and
 * kpe_j (D_kpe). For query head h of query row i of a request:
 *   s_j = sm_scale * (q_nope[h] . ckv_j + q_pe[h] . kpe_j)
 *   s_j = cap * tanh(s_j / cap)          when logits_soft_cap > 0
 *   o[h] = sum_j softmax(s)_j ckv_j       (D_ckv wide; softmax in float32)
 *   lse[h] = log2(sum_j exp(s_j))         (base 2, FlashInfer's convention)
 * With causal and qo_len > 1, query row i (0-based in its request) sees
 * key j iff j <= i + kv_len - qo_len (bottom-right aligned), the rule used
 * to verify speculative tokens; decode (qo_len 1) sees every key. A row
 * with no visible key (empty request, qo_len > kv_len) gives o = 0 and
 * lse = -inf, never NaN.
 *
 * Usage, once per batch composition and then once per layer:
 *
 *   kvc_mla_plan *plan;
 *   kvc_mla_plan_create(&qo_indptr, &kv_indptr, &kv_indices, &kv_len,
 *                       128, 512, 64, 64, 1, 1 / sqrtf(192), 0, &plan);
 *   for (int layer = 0; layer < L; layer++)
 *       kvc_mla_run(plan, &q_nope, &q_pe, &ckv[layer], &kpe[layer],
 *                   &out, &lse, pool);
 *   kvc_mla_plan_destroy(plan);
 *
 * Limits: D_ckv a multiple of 16 in [16, KVC_MLA_MAX_CKV], D_kpe a multiple
 * of 16 in [0, KVC_MLA_MAX_KPE] (0: no rope part); other sizes fail with
 * KVC_ERR_UNSUPPORTED. Storage: ckv/kpe float32, float16 or bfloat16 (what
 * kvc_append_paged_mla_kv_cache writes; ckv and kpe may differ); q and out
 * float32, float16 or bfloat16.
 *
 * Work: long requests are split into fixed chunks of keys processed as
 * separate tasks and merged by log-sum-exp in chunk order; the chunk length
 * is chosen by the plan from the batch composition alone, so results are
 * bitwise identical for any thread count. Each task streams its ckv/kpe rows
 * once for all heads and query rows. ISAs differ in the last bits (summation
 * order, polynomial exp2); each ISA is deterministic.
 *
 * Every call validates first and writes nothing on error; the plan copies
 * the page table, run allocates nothing. A plan is used by one run at a time.
 */
#ifndef KVCACHE_MLA_H
#define KVCACHE_MLA_H

#include "kvcache/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_MLA_MAX_CKV 512 /* largest head_dim_ckv */
#define KVC_MLA_MAX_KPE 128 /* largest head_dim_kpe */

typedef struct kvc_mla_plan kvc_mla_plan;

/*
 * Plans MLA attention for one batch composition of B requests.
 *   qo_indptr   (B+1) int32: request b owns query rows [qo_indptr[b],
 *               qo_indptr[b+1]) of q/out; qo_indptr[0] == 0, non-decreasing
 *               (qo_len 0 is allowed: the request computes nothing)
 *   kv_indptr   (B+1) int32, kv_indices (>= kv_indptr[B]) int32: CSR page
 *               table; request b's key j lies in page
 *               kv_indices[kv_indptr[b] + j / page_size], slot j % page_size
 *   kv_len_arr  (B) int32: keys per request (FlashInfer passes lengths, not
 *               last_page_len); request b must own exactly
 *               ceil(kv_len_arr[b] / page_size) pages
 *   num_heads   Hq >= 1; head_dim_ckv, head_dim_kpe: see the limits above
 *   page_size   >= 1
 *   causal      0 or 1
 *   sm_scale    required (FlashInfer has no default: the pre-absorption head
 *               dim, e.g. 1/sqrt(128 + 64), is not known here); finite, != 0
 *   logits_soft_cap  finite, >= 0: 0 disables; > 0 applies cap * tanh(s / cap)
 * The index arrays are copied; page ids are checked against the caches at
 * run. Errors: KVC_ERR_INVALID_ARG (bad table or attribute),
 * KVC_ERR_UNSUPPORTED (head dims), KVC_ERR_NOMEM; *out is NULL then.
 */
KVC_API kvc_status kvc_mla_plan_create(const kvc_tensor *qo_indptr, const kvc_tensor *kv_indptr,
                                       const kvc_tensor *kv_indices, const kvc_tensor *kv_len_arr,
                                       int32_t num_heads, int32_t head_dim_ckv,
                                       int32_t head_dim_kpe, int32_t page_size, int32_t causal,
                                       float sm_scale, float logits_soft_cap, kvc_mla_plan **out);

KVC_API void kvc_mla_plan_destroy(kvc_mla_plan *plan); /* NULL is a no-op */

/*
 * MLA attention for one layer. N = qo_indptr[B] query rows.
 *   q_nope     (N, Hq, D_ckv) float32/float16/bfloat16
 *   q_pe       (N, Hq, D_kpe) float32/float16/bfloat16 (with kpe_cache,
 *              may be NULL when the plan's D_kpe is 0)
 *   ckv_cache  (max_pages, page_size, D_ckv) float32/float16/bfloat16
 *   kpe_cache  (max_pages, page_size, D_kpe) float32/float16/bfloat16; both
 *              may be slices of one (max_pages, page_size, D_ckv + D_kpe)
 *              tensor; every page id of the plan must be < max_pages of each
 *   out        (N, Hq, D_ckv) float32/float16/bfloat16
 *   lse        (N, Hq) float32, or NULL
 *   pool       thread pool or NULL (calling thread only)
 * Only last dimensions must be contiguous. out must not overlap the inputs.
 * Errors (nothing written): KVC_ERR_INVALID_ARG for shapes, dtypes or page
 * ids that do not match the plan.
 */
KVC_API kvc_status kvc_mla_run(kvc_mla_plan *plan, const kvc_tensor *q_nope, const kvc_tensor *q_pe,
                               const kvc_tensor *ckv_cache, const kvc_tensor *kpe_cache,
                               kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool);

/* Keys per chunk the plan chose (a multiple of 256; for tests and
 * benchmarks), and the number of (request, chunk) tasks; 0 for NULL. */
KVC_API int64_t kvc_mla_plan_chunk(const kvc_mla_plan *plan);
KVC_API int64_t kvc_mla_plan_tasks(const kvc_mla_plan *plan);

#ifdef __cplusplus
}
#endif
#endif
