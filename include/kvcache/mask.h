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

/*
 * Every function below validates all of its arguments before writing, so a
 * rejected call (KVC_ERR_INVALID_ARG with a message in kvc_last_error())
 * leaves every output byte unchanged. Buffers may be NULL only when nothing
 * is read from or written to them; no alignment is required.
 */

/*
 * x (n,) bytes, nonzero = 1 -> out ((n + 7) / 8,) bytes.
 * Errors: n < 0, x or out NULL with n > 0, order not BIG/LITTLE.
 */
KVC_API kvc_status kvc_packbits(const uint8_t *x, int64_t n, kvc_bitorder order, uint8_t *out);

/*
 * Packs each segment x[indptr[i]:indptr[i+1]] separately, each padded to a
 * whole byte.
 *   x           (indptr[B],) bytes
 *   indptr      (B+1) int32 or int64, indptr[0] == 0, non-decreasing
 *   out         out_capacity bytes, >= sum of ceil(segment / 8)
 *   out_indptr  (B+1) of indptr's dtype, byte offsets of each packed segment;
 *               it may describe indptr's own memory (converted in place)
 * Index tensors are 1-D with stride 1. Errors: a bad order or index tensor
 * (dtype, shape, indptr[0] != 0, decreasing), out_capacity too small, x NULL
 * with indptr[B] > 0, out NULL with bytes to write.
 */
KVC_API kvc_status kvc_segment_packbits(const uint8_t *x, const kvc_tensor *indptr,
                                        kvc_bitorder order, uint8_t *out, int64_t out_capacity,
                                        kvc_tensor *out_indptr);

/*
 * The packed custom-mask layout of a batch: request b's boolean mask
 * (qo_len_b, kv_len_b), row-major, packed little-endian and padded to a
 * byte, requests concatenated.
 *   mask        flat bytes, nonzero = keep, the masks concatenated
 *               (sum qo_len_b * kv_len_b; the caller guarantees that size)
 *   qo_indptr, kv_indptr  (B+1) int32, [0] == 0, non-decreasing: request b
 *               has qo_indptr[b+1] - qo_indptr[b] queries and
 *               kv_indptr[b+1] - kv_indptr[b] keys
 *   out, out_capacity  >= sum ceil(qo_len_b * kv_len_b / 8) bytes
 *   mask_indptr (B+1) int32 out: byte offsets of each request's packed mask
 * Equivalent to kvc_segment_packbits(mask, cumsum(qo_len * kv_len), LITTLE).
 * Errors: as kvc_segment_packbits, plus qo/kv/mask_indptr of different
 * lengths and a total beyond INT32_MAX bytes (int32 offsets).
 */
KVC_API kvc_status kvc_build_packed_custom_mask(const uint8_t *mask, const kvc_tensor *qo_indptr,
                                                const kvc_tensor *kv_indptr, uint8_t *out,
                                                int64_t out_capacity, kvc_tensor *mask_indptr);

#ifdef __cplusplus
}
#endif
#endif
