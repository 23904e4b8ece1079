/*
 * Bit packing for attention masks (SEMANTICS section 4), numpy.packbits
 * semantics: each group of 8 booleans becomes a byte, the last one padded
 * with zero bits. Big bit order puts element 0 in bit 7, little in bit 0;
 * attention masks use little ("bit q * kv_len + k of a request's packed mask
 * is 1 to keep").
 */
#ifndef KVCACHE_MASK_H
#define KVCACHE_MASK_H

#include "kvcache/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvc_bitorder { KVC_BITORDER_BIG = 0, KVC_BITORDER_LITTLE = 1 } kvc_bitorder;

/* x (n,) bytes, nonzero = 1 -> out ((n + 7) / 8,) bytes. */
KVC_API kvc_status kvc_packbits(const uint8_t *x, int64_t n, kvc_bitorder order, uint8_t *out);

/*
 * Packs each segment x[indptr[i]:indptr[i+1]] separately, each padded to a
 * whole byte.
 *   x           (indptr[B],) bytes
 *   indptr      (B+1) int32 or int64, indptr[0] == 0, non-decreasing
 *   out         out_capacity bytes, >= sum of ceil(segment / 8)
 *   out_indptr  (B+1) of indptr's dtype, byte offsets of each packed segment
 */
KVC_API kvc_status kvc_segment_packbits(const uint8_t *x, const kvc_tensor *indptr,
                                        kvc_bitorder order, uint8_t *out, int64_t out_capacity,
                                        kvc_tensor *out_indptr);

/*
 * The packed custom-mask layout of a batch: request b's boolean mask
 * (qo_len_b, kv_len_b), row-major, packed little-endian and padded to a
 * byte, requests concatenated.
 *   mask        flat bytes, the masks concatenated (sum qo_len_b * kv_len_b)
 *   qo_indptr, kv_indptr  (B+1) int32: request b has qo_indptr[b+1] -
 *               qo_indptr[b] queries and kv_indptr[b+1] - kv_indptr[b] keys
 *   out, out_capacity, mask_indptr (B+1) int32 out: byte offsets
 */
KVC_API kvc_status kvc_build_packed_custom_mask(const uint8_t *mask, const kvc_tensor *qo_indptr,
                                                const kvc_tensor *kv_indptr, uint8_t *out,
                                                int64_t out_capacity, kvc_tensor *mask_indptr);

#ifdef __cplusplus
}
#endif
#endif
