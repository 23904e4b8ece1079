/* Compressed paged KV formats: page layout (docs/KV_FORMATS.md section 5)
 * and the pieces shared by format.c, store.c and attend.c. */
#ifndef KVC_KVFMT_INTERNAL_H
#define KVC_KVFMT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "../core/internal.h"
#include "kvcache/kvfmt.h"

/* Byte offsets of a page's fields, in the document's order. */
typedef struct kvc__kvfmt_layout {
    size_t k_codes;  /* (H, P, Dh) codes, int4 packed along Dh */
    size_t v_codes;  /* (H, Dh, P) codes, int4 packed along P */
    size_t v_scale;  /* (H, P, Dh / gv) float16 */
    size_t v_zero;   /* same, asym only (== k_scale when sym) */
    size_t k_scale;  /* H * Dh * P / G float16 */
    size_t k_zero;   /* same */
    size_t page;     /* total bytes */
    int64_t k_share; /* H * Dh * P / G: K parameter entries per page */
} kvc__kvfmt_layout;

kvc__kvfmt_layout kvc__kvfmt_layout_of(const kvc_kvfmt *f);

/* Stored form of one V row (Dh float32 values): rotated when the format
 * says so (float32 butterfly, section 4), in place. */
void kvc__kvfmt_rotate(float *x, int32_t n);

/* Upper bound of the pool scratch kvc_kvfmt_append takes for nnz rows of
 * n_seqs sequences (a caller that must not fail half way reserves it). */
size_t kvc__kvfmt_append_scratch_bytes(const kvc_kvfmt *f, int64_t nnz, int64_t n_seqs);

#endif
