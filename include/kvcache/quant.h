/*
 * Element conversion and int8/int4 group quantization (SEMANTICS section 1).
 * These are the kernels every store into and read from a kvcache cache uses;
 * they run on the ISA chosen by kvc_get_isa() and give bit-identical results
 * on every ISA.
 *
 * Quantization of n elements x in groups of g consecutive elements:
 *   absmax = max|x_i| (float32); qmax = 127 (8 bits) or 7 (4 bits)
 *   scale  = max(absmax / qmax, 1e-5f), then rounded to the scale dtype
 *   q_i    = clamp(round_half_to_even(x_i / scale), -qmax, qmax)
 *   dequant_i = (float)q_i * scale, then converted to the output dtype.
 *
 * Buffers are plain arrays of n (or n / g) elements; float buffers must be
 * aligned to their element size (2 bytes for float16/bfloat16, 4 for
 * float32), as kvc_tensor data, else KVC_ERR_INVALID_ARG. int8/int4 codes
 * need no alignment. A failed call writes nothing.
 */
#ifndef KVCACHE_QUANT_H
#define KVCACHE_QUANT_H

#include "kvcache/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Converts n elements between KVC_F32, KVC_F16 and KVC_BF16 (round to
 * nearest even; same dtype is a copy). src and dst must not overlap. */
KVC_API kvc_status kvc_convert(const void *src, kvc_dtype src_dtype, void *dst,
                               kvc_dtype dst_dtype, int64_t n);

/*
 * Quantizes n elements.
 *   x      (n,) of x_dtype in {F32, F16, BF16}; every value must be finite,
 *          and with F16 scales below 65520 * qmax in magnitude (8321040 for
 *          8 bits, 458640 for 4: past it a group's absmax / qmax rounds to a
 *          float16 scale of +inf); else KVC_ERR_INVALID_ARG, nothing written
 *   quant_bit 8 or 4; quant_group g >= 1 divides n (even for 4 bits)
 *   q      int8: (n,) bytes; int4: (n/2,) bytes, packed low nibble first
 *   scale  (n/g,) of scale_dtype in {F32, F16}
 */
KVC_API kvc_status kvc_quantize(const void *x, kvc_dtype x_dtype, int64_t n, int32_t quant_bit,
                                int32_t quant_group, void *q, void *scale,
                                kvc_dtype scale_dtype);

/*
 * Dequantizes n elements (shapes as in kvc_quantize) into y (n,) of y_dtype
 * in {F32, F16, BF16}.
 */
KVC_API kvc_status kvc_dequantize(const void *q, int32_t quant_bit, const void *scale,
                                  kvc_dtype scale_dtype, int64_t n, int32_t quant_group,
                                  void *y, kvc_dtype y_dtype);

#ifdef __cplusplus
}
#endif
#endif
