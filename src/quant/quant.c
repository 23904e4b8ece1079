/* Public conversion and quantization entry points: validate, then call the
 * kernel table of the current ISA. */
#include "kvcache/quant.h"
#include "../core/internal.h"
#include "../kernels/kernels.h"

static int is_float(kvc_dtype d) { return d == KVC_F32 || d == KVC_F16 || d == KVC_BF16; }

/* The kernels load elements through typed pointers (C needs them aligned;
 * a vectorised scalar loop may fault otherwise), so a buffer must be aligned
 * to its element size, as kvc_tensor data is (core.h). */
static kvc_status check_aligned(const char *fn, const char *name, const void *p, kvc_dtype d) {
    const uintptr_t a = (uintptr_t)kvc_dtype_bits(d) / 8;
    KVC_CHECK(a <= 1 || (uintptr_t)p % a == 0, "%s: %s %p is not aligned to its %d-byte %s elements",
              fn, name, p, (int)a, kvc_dtype_name(d));
    return KVC_OK;
}

kvc_status kvc_convert(const void *src, kvc_dtype src_dtype, void *dst, kvc_dtype dst_dtype,
                       int64_t n) {
    KVC_CHECK(n >= 0, "kvc_convert: n = %lld < 0", (long long)n);
    KVC_CHECK(is_float(src_dtype) && is_float(dst_dtype),
              "kvc_convert: dtypes must be float32/float16/bfloat16, got %s -> %s",
              kvc_dtype_name(src_dtype), kvc_dtype_name(dst_dtype));
    if (n == 0) return KVC_OK;
    KVC_CHECK(src && dst, "kvc_convert: NULL buffer");
    KVC_TRY(check_aligned("kvc_convert", "src", src, src_dtype));
    KVC_TRY(check_aligned("kvc_convert", "dst", dst, dst_dtype));
    kvc__kernels()->convert(src, src_dtype, dst, dst_dtype, n);
    return KVC_OK;
}

static kvc_status check_quant_args(const char *fn, int64_t n, int32_t bits, int32_t group,
                                   kvc_dtype scale_dtype) {
    KVC_CHECK(bits == 8 || bits == 4, "%s: quant_bit must be 8 or 4, got %d", fn, (int)bits);
    KVC_CHECK(group >= 1, "%s: quant_group must be >= 1, got %d", fn, (int)group);
    KVC_CHECK(bits != 4 || group % 2 == 0, "%s: quant_group must be even for int4, got %d", fn,
              (int)group);
    KVC_CHECK(n >= 0 && n % group == 0, "%s: n = %lld is not a multiple of quant_group %d", fn,
              (long long)n, (int)group);
    KVC_CHECK(scale_dtype == KVC_F32 || scale_dtype == KVC_F16,
              "%s: scale dtype must be float32 or float16, got %s", fn,
              kvc_dtype_name(scale_dtype));
    return KVC_OK;
}

kvc_status kvc_quantize(const void *x, kvc_dtype x_dtype, int64_t n, int32_t quant_bit,
                        int32_t quant_group, void *q, void *scale, kvc_dtype scale_dtype) {
    KVC_TRY(check_quant_args("kvc_quantize", n, quant_bit, quant_group, scale_dtype));
    KVC_CHECK(is_float(x_dtype), "kvc_quantize: input dtype must be float32/float16/bfloat16, got %s",
              kvc_dtype_name(x_dtype));
    if (n == 0) return KVC_OK;
    KVC_CHECK(x && q && scale, "kvc_quantize: NULL buffer");
    KVC_TRY(check_aligned("kvc_quantize", "x", x, x_dtype));
    KVC_TRY(check_aligned("kvc_quantize", "scale", scale, scale_dtype));
    const kvc_kernels *k = kvc__kernels();
    if (!k->all_finite(x, x_dtype, n, kvc__quant_limit(quant_bit, scale_dtype)))
        return kvc__quant_input_error("kvc_quantize", "the input", x, x_dtype, n, quant_bit,
                                      scale_dtype);
    k->quantize(x, x_dtype, n, quant_bit, quant_group, q, scale, scale_dtype);
    return KVC_OK;
}

kvc_status kvc_dequantize(const void *q, int32_t quant_bit, const void *scale,
                          kvc_dtype scale_dtype, int64_t n, int32_t quant_group, void *y,
                          kvc_dtype y_dtype) {
    KVC_TRY(check_quant_args("kvc_dequantize", n, quant_bit, quant_group, scale_dtype));
    KVC_CHECK(is_float(y_dtype),
              "kvc_dequantize: output dtype must be float32/float16/bfloat16, got %s",
              kvc_dtype_name(y_dtype));
    if (n == 0) return KVC_OK;
    KVC_CHECK(q && scale && y, "kvc_dequantize: NULL buffer");
    KVC_TRY(check_aligned("kvc_dequantize", "scale", scale, scale_dtype));
    KVC_TRY(check_aligned("kvc_dequantize", "y", y, y_dtype));
    kvc__kernels()->dequantize(q, quant_bit, scale, scale_dtype, n, quant_group, y, y_dtype);
    return KVC_OK;
}

kvc_status kvc__quant_input_error(const char *fn, const char *what, const void *x, kvc_dtype xd,
                                  int64_t n, int bits, kvc_dtype sd) {
    if (!kvc__kernels()->all_finite(x, xd, n, INFINITY))
        return kvc__error(KVC_ERR_INVALID_ARG,
                          "%s: %s has a NaN or Inf value; int8/int4 caches cannot store it", fn,
                          what);
    return kvc__error(KVC_ERR_INVALID_ARG,
                      "%s: %s has a value of magnitude >= %.9g, whose %s scale (absmax / %d) "
                      "would round to infinity; use float32 scales", fn, what,
                      (double)kvc__quant_limit(bits, sd), kvc_dtype_name(sd), bits == 8 ? 127 : 7);
}
