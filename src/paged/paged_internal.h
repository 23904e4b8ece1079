/*
 * Page-table validation shared by paged.c (conversions, seq_lens) and
 * append.c (appends). Index tensors are 1-D int32 and may be strided; the
 * helpers read them through their stride and never assume contiguity.
 */
#ifndef KVC_PAGED_INTERNAL_H
#define KVC_PAGED_INTERNAL_H

#include "kvcache/paged.h"
#include "../core/internal.h"

/* Element i of a validated 1-D int32 tensor. */
static inline int32_t kvc__i32_1d(const kvc_tensor *t, int64_t i) {
    return ((const int32_t *)t->data)[i * t->stride[0]];
}

/* Checks a 1-D int32 tensor; n >= 0: it must have exactly n elements. */
kvc_status kvc__paged_check_i32(const char *fn, const char *name, const kvc_tensor *t, int64_t n);

/* Checks a ragged indptr (B+1) int32: indptr[0] == 0, non-decreasing. */
kvc_status kvc__paged_check_indptr(const char *fn, const char *name, const kvc_tensor *t,
                                   int64_t B);

/*
 * Checks a CSR page table (header comment of paged.h): kv_indptr (B+1),
 * kv_indices (kv_indptr[B]) with ids in [0, max_pages) (max_pages < 0: only
 * ids >= 0 are required), kv_last_page_len (B) in [1, page_size] for a
 * request with pages and 0 without. kv_indices may be NULL when
 * check_indices is 0 (get_seq_lens has no indices). B comes from
 * kv_last_page_len and is returned in *B_out.
 */
kvc_status kvc__paged_check_table(const char *fn, const kvc_tensor *kv_indptr,
                                  const kvc_tensor *kv_indices, const kvc_tensor *kv_last_page_len,
                                  int64_t page_size, int64_t max_pages, int check_indices,
                                  int64_t *B_out);

/*
 * 1 if token position pos (>= 0) lies inside request b of a validated table,
 * i.e. pos < page_size * (pages_b - 1) + last_page_len_b, computed without
 * multiplying (page_size comes from a cache shape and may be huge).
 */
static inline int kvc__paged_pos_ok(const kvc_tensor *kv_indptr,
                                    const kvc_tensor *kv_last_page_len, int64_t page_size,
                                    int64_t b, int64_t pos) {
    int64_t pages = (int64_t)kvc__i32_1d(kv_indptr, b + 1) - kvc__i32_1d(kv_indptr, b);
    int64_t page = pos / page_size;
    if (page < pages - 1) return 1;
    return page == pages - 1 && pos % page_size < kvc__i32_1d(kv_last_page_len, b);
}

/*
 * At least the bytes of pool scratch kvc_append_paged_kv_cache asks for
 * (kvc__scratch_get) to append nnz rows of H heads of Dh into a cache of
 * cache_dtype with quant_group (float caches: one flag byte per chunk). A
 * caller that gets that much first makes the append's allocation unable to
 * fail (the model's forward step, which must not fail between layers).
 */
size_t kvc__append_scratch_bytes(int64_t nnz, int64_t H, int64_t Dh, int32_t quant_group,
                                 kvc_dtype cache_dtype);

#endif
