/* dtype metadata, scalar float16/bfloat16 conversions and tensor checks. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

const char *kvc_dtype_name(kvc_dtype dtype) {
    static const char *const names[KVC_DTYPE_COUNT] = {
        "float32", "float16", "bfloat16", "int8", "int4", "float8_e4m3", "int32", "int64", "uint8"};
    return (unsigned)dtype < KVC_DTYPE_COUNT ? names[dtype] : "?";
}

int kvc_dtype_bits(kvc_dtype dtype) {
    static const int bits[KVC_DTYPE_COUNT] = {32, 16, 16, 8, 4, 8, 32, 64, 8};
    return (unsigned)dtype < KVC_DTYPE_COUNT ? bits[dtype] : 0;
}

static uint32_t f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static float bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

uint16_t kvc_f32_to_f16(float x) {
    uint32_t u = f32_bits(x);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t exp = (u >> 23) & 0xffu;
    uint32_t mant = u & 0x7fffffu;
    if (exp == 0xff) /* Inf, or NaN quieted with its top payload bits (as F16C does) */
        return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u | (mant >> 13) : 0));
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u); /* overflow -> Inf */
    if (e <= 0) {
        /* Subnormal half (or zero): shift the full 24-bit significand. */
        if (e < -10) return (uint16_t)sign;
        uint32_t m = mant | 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t h = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)e << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fffu;
    /* A carry out of the mantissa correctly bumps the exponent (to Inf at the top). */
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

float kvc_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
        if (mant == 0) return bits_f32(sign);
        /* Subnormal: value = mant * 2^-24, exact in float32. */
        float v = (float)mant * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
    return bits_f32(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

uint16_t kvc_f32_to_bf16(float x) {
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float kvc_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

kvc_tensor kvc_tensor_make(void *data, kvc_dtype dtype, int32_t ndim, const int64_t *shape) {
    kvc_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    /* an ndim outside [0, KVC_MAX_DIMS], or a NULL shape with ndim > 0, is
     * kept as an invalid ndim: every operator then rejects the tensor
     * (kvc__check_tensor) instead of working on a clamped one */
    t.ndim = ndim;
    if (ndim < 0 || ndim > KVC_MAX_DIMS || (ndim > 0 && shape == NULL)) {
        t.ndim = -1;
        return t;
    }
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t.shape[i] = shape[i];
        t.stride[i] = s;
        /* saturate: an overflowing size is rejected by the checks */
        if (__builtin_mul_overflow(s, shape[i] > 0 ? shape[i] : 1, &s)) s = INT64_MAX;
    }
    return t;
}

int64_t kvc_tensor_numel(const kvc_tensor *t) {
    if (t == NULL || t->ndim < 0 || t->ndim > KVC_MAX_DIMS) return -1;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] < 0 || __builtin_mul_overflow(n, t->shape[i], &n)) return -1;
    return n;
}

const char *kvc__shape_str(const kvc_tensor *t, char *buf, size_t n) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "(");
    for (int i = 0; i < t->ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (k < n) snprintf(buf + k, n - k, t->ndim == 1 ? ",)" : ")");
    return buf;
}

kvc_status kvc__check_tensor(const kvc_tensor *t, const char *name, int need_contig_last) {
    KVC_CHECK(t != NULL, "%s: tensor is NULL", name);
    KVC_CHECK((unsigned)t->dtype < KVC_DTYPE_COUNT, "%s: invalid dtype %d", name, (int)t->dtype);
    KVC_CHECK(t->ndim >= 0 && t->ndim <= KVC_MAX_DIMS, "%s: ndim %d outside [0, %d]", name,
              (int)t->ndim, KVC_MAX_DIMS);
    int64_t numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        KVC_CHECK(t->shape[i] >= 0, "%s: negative size %lld in dim %d", name,
                  (long long)t->shape[i], i);
        KVC_CHECK(t->stride[i] >= 0, "%s: negative stride in dim %d", name, i);
        KVC_CHECK(!__builtin_mul_overflow(numel, t->shape[i], &numel),
                  "%s: element count overflows int64 (shape %s)", name,
                  kvc__shape_str(t, (char[160]){0}, 160));
    }
    if (numel == 0) return KVC_OK;
    /* the last element's offset (elements; int4: nibbles) and its byte must
     * be representable: offsets are computed in int64 everywhere */
    int64_t last = 0;
    for (int i = 0; i < t->ndim; i++) {
        int64_t o;
        KVC_CHECK(!__builtin_mul_overflow(t->shape[i] - 1, t->stride[i], &o) &&
                      !__builtin_add_overflow(last, o, &last) && last <= INT64_MAX / 8,
                  "%s: extent overflows int64 (shape %s)", name,
                  kvc__shape_str(t, (char[160]){0}, 160));
    }
    KVC_CHECK(t->data != NULL, "%s: data is NULL", name);
    const int bits = kvc_dtype_bits(t->dtype);
    const uintptr_t align = bits >= 16 ? (uintptr_t)(bits / 8) : 1u;
    KVC_CHECK((uintptr_t)t->data % align == 0,
              "%s: data %p is not aligned to its %d-byte %s elements", name, t->data,
              (int)align, kvc_dtype_name(t->dtype));
    if (need_contig_last && t->ndim > 0 && t->shape[t->ndim - 1] > 1)
        KVC_CHECK(t->stride[t->ndim - 1] == 1, "%s: last dimension must be contiguous (stride 1)",
                  name);
    if (t->dtype == KVC_I4) {
        for (int i = 0; i < t->ndim - 1; i++)
            KVC_CHECK(t->stride[i] % 2 == 0 || t->shape[i] == 1,
                      "%s: int4 strides must be even (whole bytes)", name);
    }
    return KVC_OK;
}

kvc_status kvc__check_writable(const kvc_tensor *t, const char *name) {
    if (kvc_tensor_numel(t) <= 0) return KVC_OK; /* nothing written */
    for (int i = 0; i < t->ndim; i++)
        KVC_CHECK(t->stride[i] != 0 || t->shape[i] <= 1,
                  "%s: dimension %d (size %lld) has stride 0, so its elements share memory; "
                  "the call writes this tensor", name, i, (long long)t->shape[i]);
    return KVC_OK;
}
