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
 * depends only on X[i][:], W, wt and the ISA: not on n, on the other rows or
 * on the thread count. Quantized weight types may quantize X per 32-element
 * block (int8, as llama.cpp's Q8_0 activations) for integer dot products;
 * that is part of the function, the same for every n.
 */
#ifndef KVC_MODEL_GEMM_H
#define KVC_MODEL_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache/core.h"
#include "kvcache/gguf.h"

/* 1 if kvc__gemm supports weight type wt. */
int kvc__gemm_supported(int32_t wt);

/* Bytes of one row of cols elements of type wt (0 if cols is not a whole
 * number of blocks or wt is unknown). */
int64_t kvc__ggml_row_bytes(int32_t wt, int64_t cols);

/* KVC_ERR_INVALID_ARG for an unsupported type or cols not a multiple of the
 * block size; KVC_ERR_NOMEM if scratch cannot be allocated. */
kvc_status kvc__gemm(int32_t wt, const void *W, int64_t rows, int64_t cols, const float *X,
                     int64_t ldx, int64_t n, float *Y, int64_t ldy, kvc_threadpool *pool);

/* One row of n elements of type t to float32 (embedding lookups). */
kvc_status kvc__ggml_dequant_row(int32_t t, const void *src, int64_t n, float *dst);

#endif
