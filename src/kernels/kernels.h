/*
 * Kernel table: one per ISA, selected at run time (dispatch.c). Kernels work
 * on whole rows (never per element) and dispatch on dtype inside, so callers
 * pay one indirect call per row run. Every ISA must produce bit-identical
 * results to the scalar reference (kernels_scalar.c): same rounding (nearest
 * even), true division for x/scale, float32 arithmetic only.
 */
#ifndef KVC_KERNELS_H
#define KVC_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache/core.h"

typedef struct kvc_kernels {
    kvc_isa isa;
    /* Copies n bytes (no overlap). A plain vector loop: glibc's memcpy takes
     * 2x longer for the 256 B - 4 KiB rows a cache moves on the machines we
     * measured (its rep-movsb path), and rows are what every operator moves. */
    void (*copy)(void *dst, const void *src, size_t n);
    /* n elements from src (sd) to dst (dd), both in {F32, F16, BF16}. */
    void (*convert)(const void *src, kvc_dtype sd, void *dst, kvc_dtype dd, int64_t n);
    /* 1 if all n elements of x (F32/F16/BF16) are finite, else 0. */
    int (*all_finite)(const void *x, kvc_dtype xd, int64_t n);
    /* n elements, n % g == 0 (g even for bits 4), x finite. q: int8 bytes, or
     * int4 packed (element 2i low nibble of byte i). scale: n/g of sd. */
    void (*quantize)(const void *x, kvc_dtype xd, int64_t n, int bits, int g, void *q,
                     void *scale, kvc_dtype sd);
    /* Inverse: y = (float)q * scale converted to yd. */
    void (*dequantize)(const void *q, int bits, const void *scale, kvc_dtype sd, int64_t n,
                       int g, void *y, kvc_dtype yd);
} kvc_kernels;

/* The table for the current ISA (kvc_get_isa()). */
const kvc_kernels *kvc__kernels(void);

/* Per-ISA tables; the AVX ones are only called after the CPU check. */
const kvc_kernels *kvc__kernels_scalar(void);
const kvc_kernels *kvc__kernels_avx2(void);
const kvc_kernels *kvc__kernels_avx512(void);

/* Rounds a float32 scale to what a scale tensor of dtype sd stores. */
float kvc__scale_round(float s, kvc_dtype sd);

#endif
