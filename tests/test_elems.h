/*
 * Element access by dtype for the C test suites' plain references: one
 * element at a time, through the library's scalar conversions only (which
 * test_quant checks exhaustively against definitions).
 */
#ifndef KVC_TEST_ELEMS_H
#define KVC_TEST_ELEMS_H

#include "test.h"

static inline size_t dt_bytes(kvc_dtype dt, int64_t n) {
    return (size_t)(n * kvc_dtype_bits(dt) / 8);
}

/* Element i as float (int8/int4: the integer value). */
static inline float get_f(const void *p, kvc_dtype dt, int64_t i) {
    switch (dt) {
    case KVC_F32: return ((const float *)p)[i];
    case KVC_F16: return kvc_f16_to_f32(((const uint16_t *)p)[i]);
    case KVC_BF16: return kvc_bf16_to_f32(((const uint16_t *)p)[i]);
    case KVC_I8: return ((const int8_t *)p)[i];
    case KVC_I4: {
        unsigned b = ((const uint8_t *)p)[i >> 1], nib = (i & 1) ? b >> 4 : b & 15;
        return (float)((int)nib - ((nib & 8) ? 16 : 0));
    }
    default: return NAN;
    }
}

/* Stores v as element i (float dtypes round to nearest even; int8/int4 take
 * an integral v in range). */
static inline void set_f(void *p, kvc_dtype dt, int64_t i, float v) {
    switch (dt) {
    case KVC_F32: ((float *)p)[i] = v; break;
    case KVC_F16: ((uint16_t *)p)[i] = kvc_f32_to_f16(v); break;
    case KVC_BF16: ((uint16_t *)p)[i] = kvc_f32_to_bf16(v); break;
    case KVC_I8: ((int8_t *)p)[i] = (int8_t)v; break;
    case KVC_I4: {
        uint8_t *b = (uint8_t *)p + (i >> 1);
        unsigned nib = (unsigned)(int)v & 15u;
        *b = (i & 1) ? (uint8_t)((*b & 0x0f) | (nib << 4)) : (uint8_t)((*b & 0xf0) | nib);
        break;
    }
    default: break;
    }
}

/* n random elements of magnitude < mag (int8: < 100 * mag, int4: < 7 * mag). */
static inline void fill_random(void *p, kvc_dtype dt, int64_t n, uint64_t *rng, float mag) {
    for (int64_t i = 0; i < n; i++) {
        float v = test_rng_f32(rng) * mag;
        if (dt == KVC_I8) v = rintf(v * 100.0f);
        if (dt == KVC_I4) v = rintf(v * 7.0f);
        set_f(p, dt, i, v);
    }
}

#endif
