/*
 * Paged caches, SEMANTICS section 4: combined-cache views, CSR page-table
 * validation, get_seq_lens / get_batch_indices_positions, and conversions
 * between CSR page tables and pmx page-mode cachestarts. Every function
 * validates all of its inputs before it writes an output, so a rejected call
 * leaves every buffer unchanged.
 */
#include <string.h>

#include "paged_internal.h"

/* ---- shared validation ------------------------------------------------------ */

kvc_status kvc__paged_check_i32(const char *fn, const char *name, const kvc_tensor *t,
                                int64_t n) {
    char b1[96];
    KVC_CHECK(t != NULL, "%s: %s is NULL", fn, name);
    KVC_TRY(kvc__check_tensor(t, name, 0));
    KVC_CHECK(t->dtype == KVC_I32, "%s: %s must be int32, got %s", fn, name,
              kvc_dtype_name(t->dtype));
    KVC_CHECK(t->ndim == 1, "%s: %s must be 1-D, got shape %s", fn, name,
              kvc__shape_str(t, b1, sizeof b1));
    KVC_CHECK(n < 0 || t->shape[0] == n, "%s: %s must have shape (%lld,), got %s", fn, name,
              (long long)n, kvc__shape_str(t, b1, sizeof b1));
    return KVC_OK;
}

kvc_status kvc__paged_check_indptr(const char *fn, const char *name, const kvc_tensor *t,
                                   int64_t B) {
    KVC_TRY(kvc__paged_check_i32(fn, name, t, B + 1));
    KVC_CHECK(kvc__i32_1d(t, 0) == 0, "%s: %s[0] must be 0, got %d", fn, name,
              (int)kvc__i32_1d(t, 0));
    for (int64_t b = 0; b < B; b++) {
        int32_t lo = kvc__i32_1d(t, b), hi = kvc__i32_1d(t, b + 1);
        KVC_CHECK(hi >= lo, "%s: %s must be non-decreasing (%s[%lld] = %d > %s[%lld] = %d)", fn,
                  name, name, (long long)b, (int)lo, name, (long long)(b + 1), (int)hi);
    }
    return KVC_OK;
}

kvc_status kvc__paged_check_table(const char *fn, const kvc_tensor *kv_indptr,
                                  const kvc_tensor *kv_indices, const kvc_tensor *kv_last_page_len,
                                  int64_t page_size, int64_t max_pages, int check_indices,
                                  int64_t *B_out) {
    KVC_CHECK(page_size >= 1, "%s: page_size must be >= 1, got %lld", fn, (long long)page_size);
    KVC_TRY(kvc__paged_check_i32(fn, "kv_last_page_len", kv_last_page_len, -1));
    const int64_t B = kv_last_page_len->shape[0];
    KVC_TRY(kvc__paged_check_indptr(fn, "kv_indptr", kv_indptr, B));
    const int64_t n_pages = kvc__i32_1d(kv_indptr, B);
    if (check_indices) {
        KVC_TRY(kvc__paged_check_i32(fn, "kv_indices", kv_indices, n_pages));
        for (int64_t i = 0; i < n_pages; i++) {
            int32_t p = kvc__i32_1d(kv_indices, i);
            KVC_CHECK(p >= 0, "%s: kv_indices[%lld] = %d is negative", fn, (long long)i, (int)p);
            KVC_CHECK(max_pages < 0 || p < max_pages,
                      "%s: kv_indices[%lld] = %d outside [0, max_pages=%lld)", fn, (long long)i,
                      (int)p, (long long)max_pages);
        }
    }
    for (int64_t b = 0; b < B; b++) {
        int32_t pages = kvc__i32_1d(kv_indptr, b + 1) - kvc__i32_1d(kv_indptr, b);
        int32_t last = kvc__i32_1d(kv_last_page_len, b);
        if (pages == 0)
            KVC_CHECK(last == 0, "%s: request %lld has no pages, so kv_last_page_len[%lld] must "
                      "be 0, got %d", fn, (long long)b, (long long)b, (int)last);
        else
            KVC_CHECK(last >= 1 && last <= page_size, "%s: kv_last_page_len[%lld] = %d outside "
                      "[1, page_size=%lld] (request %lld has %d pages)", fn, (long long)b,
                      (int)last, (long long)page_size, (long long)b, (int)pages);
    }
    *B_out = B;
    return KVC_OK;
}

/* ---- public functions ----------------------------------------------------------- */

/* Drops axis 1 (the K|V axis, index kv) of a 5-D tensor. */
static kvc_tensor drop_kv_axis(const kvc_tensor *t, int kv) {
    kvc_tensor o;
    memset(&o, 0, sizeof o);
    o.dtype = t->dtype;
    o.ndim = 4;
    o.data = t->data ? kvc__at(t, kv * t->stride[1]) : NULL;
    for (int i = 0, j = 0; i < 5; i++) {
        if (i == 1) continue;
        o.shape[j] = t->shape[i];
        o.stride[j++] = t->stride[i];
    }
    return o;
}

static kvc_status check_combined(const char *fn, const char *name, const kvc_tensor *t) {
    char b1[96];
    KVC_TRY(kvc__check_tensor(t, name, 1));
    KVC_CHECK(t->ndim == 5 && t->shape[1] == 2,
              "%s: %s must be (max_pages, 2, page_size, H, Dh) (NHD) or (max_pages, 2, H, "
              "page_size, Dh) (HND), got %s", fn, name, kvc__shape_str(t, b1, sizeof b1));
    return KVC_OK;
}

kvc_status kvc_paged_cache_from_combined(const kvc_tensor *kv_cache, const kvc_tensor *kv_scale,
                                         kvc_kv_layout layout, int32_t quant_group,
                                         kvc_paged_cache *out) {
    static const char fn[] = "kvc_paged_cache_from_combined";
    KVC_CHECK(out != NULL, "%s: out is NULL", fn);
    KVC_CHECK(kv_cache != NULL, "%s: kv_cache is NULL", fn);
    KVC_CHECK(layout == KVC_NHD || layout == KVC_HND,
              "%s: layout must be KVC_NHD (0) or KVC_HND (1), got %d", fn, (int)layout);
    KVC_TRY(check_combined(fn, "kv_cache", kv_cache));
    if (kv_scale) KVC_TRY(check_combined(fn, "kv_scale", kv_scale));
    kvc_paged_cache c;
    memset(&c, 0, sizeof c);
    c.k = drop_kv_axis(kv_cache, 0);
    c.v = drop_kv_axis(kv_cache, 1);
    if (kv_scale) {
        c.k_scale = drop_kv_axis(kv_scale, 0);
        c.v_scale = drop_kv_axis(kv_scale, 1);
    }
    c.layout = layout;
    c.quant_group = quant_group;
    *out = c;
    return KVC_OK;
}

kvc_status kvc_page_table_check(const kvc_tensor *kv_indptr, const kvc_tensor *kv_indices,
                                const kvc_tensor *kv_last_page_len, int64_t page_size,
                                int64_t max_pages) {
    static const char fn[] = "kvc_page_table_check";
    KVC_CHECK(max_pages >= 0, "%s: max_pages must be >= 0, got %lld", fn, (long long)max_pages);
    int64_t B;
    return kvc__paged_check_table(fn, kv_indptr, kv_indices, kv_last_page_len, page_size,
                                  max_pages, 1, &B);
}

kvc_status kvc_get_seq_lens(const kvc_tensor *kv_indptr, const kvc_tensor *kv_last_page_len,
                            int32_t page_size, kvc_tensor *seq_lens) {
    static const char fn[] = "kvc_get_seq_lens";
    int64_t B;
    KVC_TRY(kvc__paged_check_table(fn, kv_indptr, NULL, kv_last_page_len, page_size, -1, 0, &B));
    KVC_TRY(kvc__paged_check_i32(fn, "seq_lens", seq_lens, B));
    KVC_TRY(kvc__check_writable(seq_lens, "seq_lens"));
    for (int64_t b = 0; b < B; b++) {
        int64_t pages = (int64_t)kvc__i32_1d(kv_indptr, b + 1) - kvc__i32_1d(kv_indptr, b);
        int64_t len = pages ? (pages - 1) * page_size + kvc__i32_1d(kv_last_page_len, b) : 0;
        KVC_CHECK(len <= INT32_MAX, "%s: request %lld holds %lld tokens, more than int32 seq_lens "
                  "can hold", fn, (long long)b, (long long)len);
    }
    int32_t *out = seq_lens->data;
    for (int64_t b = 0; b < B; b++) {
        int64_t pages = (int64_t)kvc__i32_1d(kv_indptr, b + 1) - kvc__i32_1d(kv_indptr, b);
        out[b * seq_lens->stride[0]] =
            (int32_t)(pages ? (pages - 1) * page_size + kvc__i32_1d(kv_last_page_len, b) : 0);
    }
    return KVC_OK;
}

kvc_status kvc_get_batch_indices_positions(const kvc_tensor *append_indptr,
                                           const kvc_tensor *seq_lens, int64_t nnz,
                                           kvc_tensor *batch_indices, kvc_tensor *positions) {
    static const char fn[] = "kvc_get_batch_indices_positions";
    KVC_TRY(kvc__paged_check_i32(fn, "seq_lens", seq_lens, -1));
    const int64_t B = seq_lens->shape[0];
    KVC_TRY(kvc__paged_check_indptr(fn, "append_indptr", append_indptr, B));
    KVC_CHECK(nnz == kvc__i32_1d(append_indptr, B), "%s: nnz = %lld but append_indptr[B] = %d",
              fn, (long long)nnz, (int)kvc__i32_1d(append_indptr, B));
    KVC_TRY(kvc__paged_check_i32(fn, "batch_indices", batch_indices, nnz));
    KVC_TRY(kvc__paged_check_i32(fn, "positions", positions, nnz));
    KVC_TRY(kvc__check_writable(batch_indices, "batch_indices"));
    KVC_TRY(kvc__check_writable(positions, "positions"));
    for (int64_t b = 0; b < B; b++) {
        int64_t n = (int64_t)kvc__i32_1d(append_indptr, b + 1) - kvc__i32_1d(append_indptr, b);
        int32_t len = kvc__i32_1d(seq_lens, b);
        KVC_CHECK(len >= n, "%s: request %lld appends %lld tokens but seq_lens[%lld] = %d (it "
                  "must already count them)", fn, (long long)b, (long long)n, (long long)b,
                  (int)len);
    }
    int32_t *bi = batch_indices->data, *pos = positions->data;
    for (int64_t b = 0; b < B; b++) {
        /* the inputs are read again as the outputs are written: one laid over
         * them (core.h: undefined) may change them, so the validated [0, nnz)
         * bounds every write */
        const int32_t len = kvc__i32_1d(seq_lens, b);
        int64_t j0 = kvc__i32_1d(append_indptr, b), end = kvc__i32_1d(append_indptr, b + 1);
        j0 = j0 < 0 ? 0 : j0;
        end = end > nnz ? nnz : end;
        for (int64_t j = j0; j < end; j++) {
            bi[j * batch_indices->stride[0]] = (int32_t)b;
            pos[j * positions->stride[0]] = len - (end - j);
        }
    }
    return KVC_OK;
}

/* Checks a 2-D int64 (B, MaxP) page-mode table. */
static kvc_status check_cachestarts(const char *fn, const kvc_tensor *t, int64_t B) {
    char b1[96];
    KVC_CHECK(t != NULL, "%s: cachestarts is NULL", fn);
    KVC_TRY(kvc__check_tensor(t, "cachestarts", 0));
    KVC_CHECK(t->dtype == KVC_I64, "%s: cachestarts must be int64, got %s", fn,
              kvc_dtype_name(t->dtype));
    KVC_CHECK(t->ndim == 2 && (B < 0 || t->shape[0] == B),
              "%s: cachestarts must be (B, MaxP)%s, got %s", fn, B < 0 ? "" : " with B from the "
              "page table", kvc__shape_str(t, b1, sizeof b1));
    return KVC_OK;
}

kvc_status kvc_page_table_to_pmx(const kvc_tensor *kv_indptr, const kvc_tensor *kv_indices,
                                 int32_t page_size, kvc_tensor *cachestarts) {
    static const char fn[] = "kvc_page_table_to_pmx";
    KVC_CHECK(page_size >= 1, "%s: page_size must be >= 1, got %d", fn, (int)page_size);
    KVC_CHECK(kv_indptr != NULL, "%s: kv_indptr is NULL", fn);
    KVC_TRY(kvc__paged_check_i32(fn, "kv_indptr", kv_indptr, -1));
    KVC_CHECK(kv_indptr->shape[0] >= 1, "%s: kv_indptr must have shape (B+1,), got (0,)", fn);
    const int64_t B = kv_indptr->shape[0] - 1;
    KVC_TRY(kvc__paged_check_indptr(fn, "kv_indptr", kv_indptr, B));
    const int64_t n_pages = kvc__i32_1d(kv_indptr, B);
    KVC_TRY(kvc__paged_check_i32(fn, "kv_indices", kv_indices, n_pages));
    for (int64_t i = 0; i < n_pages; i++)
        KVC_CHECK(kvc__i32_1d(kv_indices, i) >= 0, "%s: kv_indices[%lld] = %d is negative", fn,
                  (long long)i, (int)kvc__i32_1d(kv_indices, i));
    KVC_TRY(check_cachestarts(fn, cachestarts, B));
    KVC_TRY(kvc__check_writable(cachestarts, "cachestarts"));
    const int64_t maxP = cachestarts->shape[1];
    for (int64_t b = 0; b < B; b++) {
        int64_t pages = (int64_t)kvc__i32_1d(kv_indptr, b + 1) - kvc__i32_1d(kv_indptr, b);
        KVC_CHECK(pages <= maxP, "%s: request %lld has %lld pages but cachestarts has MaxP = %lld "
                  "columns", fn, (long long)b, (long long)pages, (long long)maxP);
    }
    int64_t *cs = cachestarts->data;
    for (int64_t b = 0; b < B; b++) {
        /* kv_indptr read again: cachestarts laid over it (core.h: undefined)
         * may have changed it, so kv_indices is read within its n_pages only */
        const int64_t p0 = kvc__i32_1d(kv_indptr, b), pages = kvc__i32_1d(kv_indptr, b + 1) - p0;
        for (int64_t j = 0; j < maxP; j++)
            cs[b * cachestarts->stride[0] + j * cachestarts->stride[1]] =
                j < pages && p0 + j >= 0 && p0 + j < n_pages
                    ? (int64_t)kvc__i32_1d(kv_indices, p0 + j) * page_size
                    : -1;
    }
    return KVC_OK;
}

/* seq_lens[b] of an int32 or int64 1-D tensor. */
static int64_t seq_len_at(const kvc_tensor *t, int64_t b) {
    if (t->dtype == KVC_I32) return kvc__i32_1d(t, b);
    return ((const int64_t *)t->data)[b * t->stride[0]];
}

kvc_status kvc_pmx_to_page_table(const kvc_tensor *cachestarts, const kvc_tensor *seq_lens,
                                 int32_t page_size, kvc_tensor *kv_indptr, kvc_tensor *kv_indices,
                                 kvc_tensor *kv_last_page_len, int64_t *n_indices) {
    static const char fn[] = "kvc_pmx_to_page_table";
    char b1[96];
    KVC_CHECK(page_size >= 1, "%s: page_size must be >= 1, got %d", fn, (int)page_size);
    KVC_TRY(check_cachestarts(fn, cachestarts, -1));
    const int64_t B = cachestarts->shape[0], maxP = cachestarts->shape[1];
    KVC_CHECK(seq_lens != NULL, "%s: seq_lens is NULL", fn);
    KVC_TRY(kvc__check_tensor(seq_lens, "seq_lens", 0));
    KVC_CHECK(seq_lens->dtype == KVC_I32 || seq_lens->dtype == KVC_I64,
              "%s: seq_lens must be int32 or int64, got %s", fn, kvc_dtype_name(seq_lens->dtype));
    KVC_CHECK(seq_lens->ndim == 1 && seq_lens->shape[0] == B,
              "%s: seq_lens must have shape (B,) = (%lld,), got %s", fn, (long long)B,
              kvc__shape_str(seq_lens, b1, sizeof b1));
    KVC_TRY(kvc__paged_check_i32(fn, "kv_indptr", kv_indptr, B + 1));
    KVC_TRY(kvc__paged_check_i32(fn, "kv_last_page_len", kv_last_page_len, B));
    KVC_TRY(kvc__paged_check_i32(fn, "kv_indices", kv_indices, -1));
    KVC_TRY(kvc__check_writable(kv_indptr, "kv_indptr"));
    KVC_TRY(kvc__check_writable(kv_last_page_len, "kv_last_page_len"));
    KVC_TRY(kvc__check_writable(kv_indices, "kv_indices"));
    const int64_t *cs = cachestarts->data;
    const int64_t cs0 = cachestarts->stride[0], cs1 = cachestarts->stride[1];
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_len_at(seq_lens, b);
        KVC_CHECK(len >= 0, "%s: seq_lens[%lld] = %lld is negative", fn, (long long)b,
                  (long long)len);
        const int64_t pages = len / page_size + (len % page_size != 0);
        KVC_CHECK(pages <= maxP, "%s: request %lld needs %lld pages for %lld tokens, cachestarts "
                  "has MaxP = %lld", fn, (long long)b, (long long)pages, (long long)len,
                  (long long)maxP);
        for (int64_t j = 0; j < pages; j++) {
            const int64_t e = cs[b * cs0 + j * cs1];
            KVC_CHECK(e >= 0 && e % page_size == 0 && e / page_size <= INT32_MAX,
                      "%s: cachestarts[%lld, %lld] = %lld must be a non-negative multiple of "
                      "page_size %d (page id <= INT32_MAX)", fn, (long long)b, (long long)j,
                      (long long)e, (int)page_size);
        }
        total += pages;
        KVC_CHECK(total <= INT32_MAX, "%s: more than INT32_MAX pages in all", fn);
    }
    if (kv_indices->shape[0] < total) { /* as kvc_cache_page_table: report the size needed */
        if (n_indices) *n_indices = total;
        return kvc__error(KVC_ERR_INVALID_ARG, "%s: kv_indices holds %lld entries, the table "
                          "needs %lld", fn, (long long)kv_indices->shape[0], (long long)total);
    }
    int32_t *indptr = kv_indptr->data, *indices = kv_indices->data, *last = kv_last_page_len->data;
    int64_t k = 0;
    indptr[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        /* seq_lens read again: an output laid over it (core.h: undefined) may
         * have changed it, so MaxP and the validated total bound every access */
        int64_t len = seq_len_at(seq_lens, b);
        len = len < 0 ? 0 : len;
        int64_t pages = len / page_size + (len % page_size != 0);
        pages = pages < maxP ? pages : maxP;
        pages = pages < total - k ? pages : total - k;
        for (int64_t j = 0; j < pages; j++, k++)
            indices[k * kv_indices->stride[0]] = (int32_t)(cs[b * cs0 + j * cs1] / page_size);
        indptr[(b + 1) * kv_indptr->stride[0]] = (int32_t)k;
        last[b * kv_last_page_len->stride[0]] =
            (int32_t)(pages ? len - (pages - 1) * page_size : 0);
    }
    if (n_indices) *n_indices = total;
    return KVC_OK;
}
