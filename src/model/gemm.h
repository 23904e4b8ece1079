/*
 * Matrix products of the model runtime (internal): activations float32,
 * weights in a GGUF tensor type, read in place from the mapped file.
 *
 *   W   (rows, cols) in ggml type wt: row r starts at W + r * row_bytes with
 *       row_bytes = cols / block_size(wt) * block_bytes(wt) (GGUF layout:
 *       ne[0] = cols innermost, ne[1] = rows)
 *   X   (n, cols) float32, row i at X + i * ldx (elements)
 *   Y   (n, rows) float32, row i at Y + i * ldy (elements), overwritten:
 *       Y[i][r] = sum_c X[i][c] * W[r][c]
 *
 * Row independence (the model runtime's exactness depends on it): Y[i][:]
 * depends only on X[i][:], W, wt, the ISA and the activation width (below):
 * not on n, on the other rows or on the thread count. Quantized weight types
 * quantize X per 32-element block to integers for integer dot products;
 * that is part of the function, the same for every n.
 *
 * What the kernels compute (src/kernels/gemm_kernels.h has the details):
 *   F32, F16, BF16: float32 products and sums.
 *   Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL: each X row is quantized per 32-element block to
 *       integers of B bits, Q = 2^(B-1) - 1 (B = 16 by default, Q = 32767;
 *       B = 8, Q = 127 through kvc__gemm_set_act_bits), with d = amax / Q,
 *       q = round_half_even(x * Q / amax) (blocks with amax < 2^-120 become
 *       zero), then per weight block the exact integer dot product of the
 *       block's integer weights with q is scaled by d_w * d_x (Q4_1, Q5_1 add
 *       m_w * d_x * sum q) and summed in float32. The error against the
 *       exact product is at most sum_blocks (d_x / 2) * sum |w| plus float32
 *       rounding.
 *   Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (cols a multiple of 256): the
 *       same activation blocks; per 32-element sub-block the integer dot
 *       product with the sub-block's integers is scaled by (d * sc) * d_x
 *       (Q4_K/Q5_K add -(dmin * m) * d_x * sum q); the scales of Q2_K,
 *       Q3_K and Q6_K cover 16 elements, so each half block is its own
 *       integer sum and term (Q2_K's mins one more integer sum). Same
 *       error bound.
 *
 * Activation width, the precision trade-off: per element the activation
 * moves by at most d_x / 2 = amax / (2 Q) of its block: amax / 254 for int8
 * (llama.cpp's Q8_0 activations), amax / 65534 for int16, 258 times less,
 * close to float32 products of the dequantized weights (the weights' own
 * quantization error is then the only one that matters). On SmolLM2-135M
 * Q4_1 the int8 error flips greedy choices against a float reference
 * ("What is the capital of France?" starts with another token); int16 keeps
 * them. The cost: int16 halves the integer multiply throughput (AVX-512
 * VNNI vpdpwssd: 32 multiply-adds per zmm against vpdpbusd's 64; AVX2
 * vpmaddwd + vpaddd: 16 per ymm against vpmaddubsw's 32), doubles the
 * activation scratch, and widening weights to int16 costs a few more
 * shifts / masks per weight register. Decode (n = 1) reads the weights
 * from memory either way and barely changes; batched products (prefill)
 * are compute-bound and slower (`kvcache bench gemm` shows both).
 *
 * Each ISA (scalar, avx2, avx512) sums in its own fixed order, so results of
 * different ISAs agree to rounding only. Under the avx512 ISA the integer
 * kernels use AVX512_VNNI when the CPU has it (cpuid, at run time) and the
 * AVX2 integer kernels otherwise; kvc__gemm_kernel_name says which runs.
 * X and Y must not overlap W or each other; X must be finite.
 */
#ifndef KVC_MODEL_GEMM_H
#define KVC_MODEL_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache/core.h"
#include "kvcache/gguf.h"

/* 1 if kvc__gemm supports weight type wt (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K). */
int kvc__gemm_supported(int32_t wt);

/* Bytes of one row of cols elements of type wt (0 if cols is not a whole
 * number of blocks or wt is unknown). Knows the gemm types. */
int64_t kvc__ggml_row_bytes(int32_t wt, int64_t cols);

/* KVC_ERR_INVALID_ARG for an unsupported type, cols not a multiple of the
 * block size, a negative shape, ldx < cols, ldy < rows or a NULL pointer
 * (pointers may be NULL when n == 0 or rows == 0: nothing is done);
 * KVC_ERR_NOMEM if scratch cannot be allocated (Y is then unchanged).
 * pool may be NULL (calling thread only). Quantized weights take
 * kvc__gemm_scratch_bytes of the pool's scratch (kvc__scratch_get). */
kvc_status kvc__gemm(int32_t wt, const void *W, int64_t rows, int64_t cols, const float *X,
                     int64_t ldx, int64_t n, float *Y, int64_t ldy, kvc_threadpool *pool);

/* Bytes of pool scratch kvc__gemm(wt, ..., cols, ..., n, ...) asks for with
 * the kernels and activation width selected now (0: none). A caller that
 * gets that much from kvc__scratch_get first makes the product's allocation
 * unable to fail. */
size_t kvc__gemm_scratch_bytes(int32_t wt, int64_t cols, int64_t n);

/* One row of n elements of type t to float32 (embedding lookups):
 * kvc_ggml_dequantize (gguf.h), the gemm types. */
kvc_status kvc__ggml_dequant_row(int32_t t, const void *src, int64_t n, float *dst);

/* Name of the kernel set kvc__gemm uses now for weight type wt ("scalar",
 * "avx2", "avx512", "avx512-vnni"): for tests and benchmarks. */
const char *kvc__gemm_kernel_name(int32_t wt);

/* Test hook: on != 0 makes kvc__gemm behave as if the CPU had no
 * AVX512_VNNI (the AVX-512 ISA then runs the AVX2 integer kernels). Not
 * thread-safe with respect to running products. */
void kvc__gemm_set_no_vnni(int on);

/* Internal switch (tests, benchmarks): the integer width of quantized
 * activations for the quantized weight types, 16 (the default, what the model
 * runtime uses) or 8 (faster batched products, coarser: see above);
 * KVC_ERR_INVALID_ARG otherwise. Process-wide; each kvc__gemm call reads it
 * once at its start; do not change it while products run that must agree
 * with each other. */
kvc_status kvc__gemm_set_act_bits(int bits);
int kvc__gemm_act_bits(void);

#endif
