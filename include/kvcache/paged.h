/*
 * FlashInfer-compatible paged KV storage (SEMANTICS section 4).
 *
 * A paged cache holds max_pages pages of page_size token slots:
 *   NHD: K and V each (max_pages, page_size, H, Dh)
 *   HND: K and V each (max_pages, H, page_size, Dh)
 * either as two tensors or as one combined tensor (max_pages, 2, page_size,
 * H, Dh) / (max_pages, 2, H, page_size, Dh) with index 0 of the 2 axis K
 * (kvc_paged_cache_from_combined makes the two views). Only the last
 * dimension must be contiguous; page, row and head strides are honoured and
 * K and V may have different strides.
 *
 * Storage dtypes: float32, float16, bfloat16 (inputs converted, round to
 * nearest even), int8 and int4 (inputs quantized per SEMANTICS section 1,
 * with scale tensors k_scale/v_scale of the cache's shape with last dim
 * Dh / quant_group, float32 or float16).
 *
 * Page tables are CSR, int32, for a batch of B requests:
 *   kv_indptr (B+1), kv_indptr[0] == 0, non-decreasing
 *   kv_indices (kv_indptr[B]) exactly, page ids in [0, max_pages)
 *   kv_last_page_len (B), 1..page_size for a request with pages, 0 without
 * and request b holds page_size * (pages_b - 1) + kv_last_page_len[b] tokens.
 * Every function validates the page tables it reads (FlashInfer does not).
 *
 * Index tensors may be strided 1-D int32 tensors unless noted.
 */
#ifndef KVCACHE_PAGED_H
#define KVCACHE_PAGED_H

#include "kvcache/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvc_kv_layout {
    KVC_NHD = 0, /* page (page_size, H, Dh) */
    KVC_HND = 1  /* page (H, page_size, Dh) */
} kvc_kv_layout;

/* One paged cache: views of caller memory (no ownership). */
typedef struct kvc_paged_cache {
    kvc_tensor k, v;             /* 4-D, same shape and dtype */
    kvc_tensor k_scale, v_scale; /* int8/int4 caches only (else ignored) */
    kvc_kv_layout layout;
    int32_t quant_group; /* int8/int4 caches only: divides Dh, even for int4 */
} kvc_paged_cache;

/*
 * Fills out with K and V views of a combined 5-D cache (and of a combined
 * 5-D scale tensor, which may be NULL for float caches). Checks the rank and
 * that the 2 axis has size 2; kvc_append_paged_kv_cache validates the rest.
 */
KVC_API kvc_status kvc_paged_cache_from_combined(const kvc_tensor *kv_cache,
                                                 const kvc_tensor *kv_scale,
                                                 kvc_kv_layout layout, int32_t quant_group,
                                                 kvc_paged_cache *out);

/*
 * Validates a CSR page table against a cache of max_pages pages of
 * page_size slots: shapes (B+1)/(kv_indptr[B])/(B), int32 dtypes, the
 * indptr rules, page ids in range, last_page_len rules. B is taken from
 * kv_last_page_len.
 */
KVC_API kvc_status kvc_page_table_check(const kvc_tensor *kv_indptr, const kvc_tensor *kv_indices,
                                        const kvc_tensor *kv_last_page_len, int64_t page_size,
                                        int64_t max_pages);

/*
 * seq_lens[b] = page_size * (pages_b - 1) + kv_last_page_len[b] (0 for an
 * empty request).
 *   kv_indptr (B+1) int32, kv_last_page_len (B) int32, seq_lens (B) int32 out
 */
KVC_API kvc_status kvc_get_seq_lens(const kvc_tensor *kv_indptr,
                                    const kvc_tensor *kv_last_page_len, int32_t page_size,
                                    kvc_tensor *seq_lens);

/*
 * Ragged append rows -> (request, position): for row j of request b
 * (append_indptr[b] <= j < append_indptr[b+1]), batch_indices[j] = b and
 * positions[j] = seq_lens[b] - (append_indptr[b+1] - j); seq_lens already
 * counts the appended tokens, so appended_b <= seq_lens[b] is required.
 *   append_indptr (B+1) int32, seq_lens (B) int32, nnz == append_indptr[B]
 *   batch_indices, positions (nnz) int32 out
 */
KVC_API kvc_status kvc_get_batch_indices_positions(const kvc_tensor *append_indptr,
                                                   const kvc_tensor *seq_lens, int64_t nnz,
                                                   kvc_tensor *batch_indices,
                                                   kvc_tensor *positions);

/*
 * Writes row j of append_key/append_value (nnz, H, Dh) to page
 * kv_indices[kv_indptr[b] + positions[j] / page_size], slot
 * positions[j] % page_size, of b = batch_indices[j] (K and V).
 *   append_key, append_value  (nnz, H, Dh) float32/float16/bfloat16, one
 *                             dtype for both (or the cache's own dtype for
 *                             a plain copy)
 *   batch_indices, positions  (nnz) int32
 *   cache                     paged cache; page tables must already include
 *                             the appended tokens
 * An input of the cache's own dtype is copied as is (int8 into int8 and int4
 * into int4 too, scales untouched and not required). k_scale and v_scale
 * may differ in dtype and strides, as may k and v.
 * Errors (KVC_ERR_INVALID_ARG, nothing written): bad page table,
 * batch_indices[j] outside [0, B), positions[j] outside [0, seq_len_b),
 * shape/dtype mismatch, missing scales, NaN/Inf into an int8/int4 cache
 * (or, with float16 scales, a value whose scale would overflow: kvc_quantize).
 * If two rows name the same slot, which one is stored is unspecified.
 * Rows are split into fixed chunks, so the bytes written do not depend on
 * the pool's thread count.
 */
KVC_API kvc_status kvc_append_paged_kv_cache(const kvc_tensor *append_key,
                                             const kvc_tensor *append_value,
                                             const kvc_tensor *batch_indices,
                                             const kvc_tensor *positions, kvc_paged_cache *cache,
                                             const kvc_tensor *kv_indices,
                                             const kvc_tensor *kv_indptr,
                                             const kvc_tensor *kv_last_page_len,
                                             kvc_threadpool *pool);

/*
 * MLA form: no head axis, any D_ckv / D_kpe (DeepSeek: 512 / 64).
 *   append_ckv (nnz, D_ckv), append_kpe (nnz, D_kpe)
 *   ckv_cache (max_pages, page_size, D_ckv), kpe_cache (max_pages, page_size, D_kpe)
 * float32/float16/bfloat16 storage (inputs converted; ckv and kpe may differ
 * in dtype); same rules as above. ckv_cache and kpe_cache must agree on
 * max_pages and page_size (they may be slices of one (max_pages, page_size,
 * D_ckv + D_kpe) tensor).
 */
KVC_API kvc_status kvc_append_paged_mla_kv_cache(
    const kvc_tensor *append_ckv, const kvc_tensor *append_kpe, const kvc_tensor *batch_indices,
    const kvc_tensor *positions, kvc_tensor *ckv_cache, kvc_tensor *kpe_cache,
    const kvc_tensor *kv_indices, const kvc_tensor *kv_indptr,
    const kvc_tensor *kv_last_page_len, kvc_threadpool *pool);

/*
 * CSR page table -> pmx page-mode table (seed 000, cache_mode 1):
 * cachestarts[b, j] = kv_indices[kv_indptr[b] + j] * page_size for
 * j < pages_b, -1 after. cachestarts (B, MaxP) int64 out, MaxP >= max pages_b.
 * The same pages are then readable by kvc_pmx_dynamic_key_value_cache when
 * the K and V page arrays are NHD and back to back in one buffer
 * (2, max_pages, page_size, H, Dh): that buffer is pmx layout 2 with L = 1
 * and MaxT = max_pages * page_size.
 */
KVC_API kvc_status kvc_page_table_to_pmx(const kvc_tensor *kv_indptr,
                                         const kvc_tensor *kv_indices, int32_t page_size,
                                         kvc_tensor *cachestarts);

/*
 * pmx page-mode table -> CSR. Request b holds seq_lens[b] tokens in its
 * first ceil(seq_lens[b] / page_size) pages; each of those entries must be
 * a non-negative multiple of page_size.
 *   cachestarts (B, MaxP) int64, seq_lens (B) int32 or int64
 *   kv_indptr (B+1), kv_last_page_len (B) int32 out; kv_indices (cap) int32
 *   out with cap >= total pages; *n_indices receives the total (n_indices
 *   may be NULL). Entries after the total are left as they were. If cap is
 *   too small: KVC_ERR_INVALID_ARG, *n_indices (if not NULL) receives the
 *   total needed and nothing else is written (as kvc_cache_page_table).
 */
KVC_API kvc_status kvc_pmx_to_page_table(const kvc_tensor *cachestarts,
                                         const kvc_tensor *seq_lens, int32_t page_size,
                                         kvc_tensor *kv_indptr, kvc_tensor *kv_indices,
                                         kvc_tensor *kv_last_page_len, int64_t *n_indices);

#ifdef __cplusplus
}
#endif
#endif
