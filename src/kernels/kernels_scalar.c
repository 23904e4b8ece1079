/*
 * Scalar reference kernels: portable C that reads like SEMANTICS section 1.
 * The SIMD kernels must match these bit for bit; tests compare them.
 */
#include <math.h>
#include <string.h>

#include "kernels.h"

static inline float load_f32(const void *x, kvc_dtype dt, int64_t i) {
    switch (dt) {
    case KVC_F16: return kvc_f16_to_f32(((const uint16_t *)x)[i]);
    case KVC_BF16: return kvc_bf16_to_f32(((const uint16_t *)x)[i]);
    default: return ((const float *)x)[i];
    }
}

static inline void store_f32(void *y, kvc_dtype dt, int64_t i, float v) {
    switch (dt) {
    case KVC_F16: ((uint16_t *)y)[i] = kvc_f32_to_f16(v); break;
    case KVC_BF16: ((uint16_t *)y)[i] = kvc_f32_to_bf16(v); break;
    default: ((float *)y)[i] = v; break;
    }
}

static void copy_ref(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }

static void convert_ref(const void *src, kvc_dtype sd, void *dst, kvc_dtype dd, int64_t n) {
    if (sd == dd) {
        memcpy(dst, src, (size_t)(n * (sd == KVC_F32 ? 4 : 2)));
        return;
    }
    for (int64_t i = 0; i < n; i++) store_f32(dst, dd, i, load_f32(src, sd, i));
}

static int all_finite_ref(const void *x, kvc_dtype xd, int64_t n, float limit) {
    for (int64_t i = 0; i < n; i++)
        if (!(fabsf(load_f32(x, xd, i)) < limit)) return 0; /* NaN fails too */
    return 1;
}

uint16_t kvc__limit_bits16(float limit, kvc_dtype xd) {
    const int f16 = xd == KVC_F16;
    const uint16_t inf = f16 ? 0x7c00 : 0x7f80;
    /* past the largest finite value (the common case: no rounding needed) */
    if (limit > (f16 ? 65504.0f : kvc_bf16_to_f32(0x7f7f))) return inf;
    uint16_t b = f16 ? kvc_f32_to_f16(limit) : kvc_f32_to_bf16(limit); /* nearest */
    if ((f16 ? kvc_f16_to_f32(b) : kvc_bf16_to_f32(b)) < limit) b++;   /* round up */
    return b < inf ? b : inf;
}

float kvc__scale_round(float s, kvc_dtype sd) {
    return sd == KVC_F16 ? kvc_f16_to_f32(kvc_f32_to_f16(s)) : s;
}

/* Scale of group g0 / g as stored (SEMANTICS section 1): absmax / qmax,
 * at least 1e-5, rounded to sd. */
static void group_scale(const void *x, kvc_dtype xd, int64_t g0, int g, float qmax, void *scale,
                        kvc_dtype sd) {
    float absmax = 0.0f;
    for (int i = 0; i < g; i++) {
        float a = fabsf(load_f32(x, xd, g0 + i));
        if (a > absmax) absmax = a;
    }
    float s = absmax / qmax;
    if (!(s > 1e-5f)) s = 1e-5f;
    store_f32(scale, sd, g0 / g, s);
}

/* Values of group g0 / g with its stored scale: clamp(rne(x / s)). */
static void group_values(const void *x, kvc_dtype xd, int64_t g0, int g, int bits, float qmax,
                         const void *scale, kvc_dtype sd, void *q) {
    const float s = load_f32(scale, sd, g0 / g); /* the stored value is the one used */
    uint8_t *qb = q;
    for (int i = 0; i < g; i++) {
        float v = nearbyintf(load_f32(x, xd, g0 + i) / s);
        if (v > qmax) v = qmax;
        if (v < -qmax) v = -qmax;
        int iv = (int)v;
        int64_t e = g0 + i;
        if (bits == 8) {
            ((int8_t *)qb)[e] = (int8_t)iv;
        } else if (e & 1) {
            qb[e >> 1] = (uint8_t)((qb[e >> 1] & 0x0f) | ((unsigned)(iv & 0xf) << 4));
        } else {
            qb[e >> 1] = (uint8_t)(iv & 0xf); /* high nibble written by e+1 */
        }
    }
}

static void quantize_ref(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *q,
                         void *scale, kvc_dtype sd) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    for (int64_t g0 = 0; g0 < n; g0 += g) {
        group_scale(x, xd, g0, g, qmax, scale, sd);
        group_values(x, xd, g0, g, bits, qmax, scale, sd, q);
    }
}

static int quant_scales_ref(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *scale,
                            kvc_dtype sd) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    for (int64_t g0 = 0; g0 < n; g0 += g) group_scale(x, xd, g0, g, qmax, scale, sd);
    return all_finite_ref(x, xd, n, kvc__quant_limit(bits, sd));
}

static void quant_values_ref(const void *x, kvc_dtype xd, int64_t n, int bits, int g,
                             const void *sin, void *q, void *scale, kvc_dtype sd, int stream) {
    (void)stream;
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    memcpy(scale, sin, (size_t)(n / g) * (sd == KVC_F32 ? 4u : 2u));
    for (int64_t g0 = 0; g0 < n; g0 += g) group_values(x, xd, g0, g, bits, qmax, sin, sd, q);
}

static void dequantize_ref(const void *q, int bits, const void *scale, kvc_dtype sd, int64_t n,
                           int g, void *y, kvc_dtype yd) {
    const uint8_t *qb = q;
    for (int64_t e = 0; e < n; e++) {
        int iv;
        if (bits == 8) {
            iv = ((const int8_t *)q)[e];
        } else {
            unsigned nib = (e & 1) ? (qb[e >> 1] >> 4) : (qb[e >> 1] & 0xf);
            iv = (int)nib - ((nib & 8) ? 16 : 0);
        }
        store_f32(y, yd, e, (float)iv * load_f32(scale, sd, e / g));
    }
}

/* ---- decode attention (attn_body.h with 1-lane "vectors") ---------------- */

static inline float ab_elem(const void *src, kvc_dtype dt, int64_t e) {
    const uint8_t *qb = src;
    switch (dt) {
    case KVC_I8: return (float)((const int8_t *)src)[e];
    case KVC_I4: {
        unsigned nib = (e & 1) ? (qb[e >> 1] >> 4) : (qb[e >> 1] & 0xf);
        return (float)((int)nib - ((nib & 8) ? 16 : 0));
    }
    default: return load_f32(src, dt, e);
    }
}

void kvc__dequant_row_tail(const void *src, kvc_dtype dt, const void *sc, kvc_dtype sd, int g,
                           int e0, int D, float *dst) {
    for (int e = e0; e < D; e++) dst[e] = ab_elem(src, dt, e) * load_f32(sc, sd, e / g);
}

static void ab_row_to_f32(const void *src, kvc_dtype dt, const void *sc, kvc_dtype sd, int g,
                          int D, float *dst) {
    if (dt == KVC_I8 || dt == KVC_I4) {
        kvc__dequant_row_tail(src, dt, sc, sd, g, 0, D, dst);
    } else {
        for (int e = 0; e < D; e++) dst[e] = load_f32(src, dt, e);
    }
}

typedef float ab_vec;
#define AB_VL 1
#define AB_LOAD(p) (*(p))
#define AB_STORE(p, v) (*(p) = (v))
#define AB_ZERO() 0.0f
#define AB_SET1(x) (x)
#define AB_FMA(a, b, c) ((a) * (b) + (c))
#define AB_MUL(a, b) ((a) * (b))
#define AB_ADD(a, b) ((a) + (b))
#define AB_SUB(a, b) ((a) - (b))
#define AB_MAX(a, b) ((a) > (b) ? (a) : (b))
#define AB_HSUM(v) (v)
#define AB_HMAX(v) (v)
#define AB_EXP2(v) ab_exp2(v)
static inline float ab_exp2(float x) { return x < -126.0f ? 0.0f : exp2f(x); }
#define AB_NAME attn_decode_ref
#include "attn_body.h"

static void dequantize_rows_ref(const void *q, int64_t q_stride, int bits, const void *scale,
                                int64_t s_stride, kvc_dtype sd, int64_t rows, int64_t n, int g,
                                void *y, int64_t y_stride, kvc_dtype yd) {
    for (int64_t r = 0; r < rows; r++)
        dequantize_ref((const char *)q + r * q_stride, bits, (const char *)scale + r * s_stride,
                       sd, n, g, (char *)y + r * y_stride, yd);
}

static void softcap_ref(float *s, int64_t n, float cap, float mul) {
    kvc__softcap_row(s, n, cap, mul);
}

void kvc__hadamard_ref(float *x, int32_t n) {
    /* butterflies by blocks (no per-element test: vectorizes; the same
     * operations as element by element, so the same bits) */
    for (int32_t h = 1; h < n; h *= 2)
        for (int32_t i0 = 0; i0 < n; i0 += 2 * h)
            for (int32_t i = i0; i < i0 + h; i++) {
                const float a = x[i], b = x[i + h];
                x[i] = a + b;
                x[i + h] = a - b;
            }
    const float s = (float)(1.0 / sqrt((double)n));
    for (int32_t i = 0; i < n; i++) x[i] *= s;
}

static const kvc_kernels table = {
    KVC_ISA_SCALAR, copy_ref, convert_ref, all_finite_ref, quantize_ref, quantize_ref,
    quant_scales_ref, quant_values_ref, softcap_ref, kvc__hadamard_ref, dequantize_ref,
    dequantize_rows_ref,
    attn_decode_ref,
    NULL, NULL, NULL, NULL, NULL, /* no AMX decode */
    copy_ref, /* copy_stream: portable C has no non-temporal store */
};

const kvc_kernels *kvc__kernels_scalar(void) { return &table; }
