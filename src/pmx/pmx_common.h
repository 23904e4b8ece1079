/*
 * Shared machinery of the pmx KV-cache operators: validation of dtypes,
 * attributes and scale tensors, and the block mover that stores new rows
 * into a cache (converting or quantizing) and reads cached rows back
 * (converting or dequantizing, repeating heads). Layout-specific code only
 * computes where a block of rows starts and its strides.
 */
#ifndef KVC_PMX_COMMON_H
#define KVC_PMX_COMMON_H

#include "kvcache/pmx.h"
#include "../core/internal.h"
#include "../kernels/kernels.h"

/* Tokens per parallel task. Fixed (never derived from n_threads) so output
 * bytes are the same for any thread count. */
#define KVC_PMX_CHUNK 64

/*
 * A block of rows (tokens x heads x Dh): element (t, h, d) is at element
 * offset t*tok_stride + h*head_stride + d from ptr (a byte pointer to
 * element (0, 0, 0)). The optional scale rows mirror it with Dh/g elements.
 */
typedef struct pmx_rows {
    char *ptr;
    kvc_dtype dtype;
    int64_t tok_stride, head_stride;
    char *sptr; /* NULL when not quantized */
    kvc_dtype sdtype;
    int64_t stok_stride, shead_stride;
    /* Input rows only: their scales, already computed (kernels.h
     * quant_scales; dtype qsdtype, Dh/g per row), or NULL: quantize then
     * computes them itself. */
    const char *qsptr;
    kvc_dtype qsdtype;
    int64_t qstok_stride, qshead_stride;
} pmx_rows;

/* What every row transfer of one call needs. */
typedef struct pmx_op {
    const kvc_kernels *k;
    int64_t H, Dh;
    int64_t repeat;   /* num_repeat: output heads per cache head */
    int bits, group;  /* quant_bit (0 = none) and quant_group */
    kvc_dtype sd;     /* scale dtype when quantized (pmx ops; the append keeps its own per half) */
    kvc_dtype t1, t2; /* input/output dtype, cache dtype */
    int stream;       /* stores to the cache (quantized) or the output may bypass the caches
                         (calls that move more than kvc__llc_bytes) */
} pmx_op;

/* Rows of a float/int8 tensor (no scales) whose tokens lie along dimension
 * tok_dim and heads along head_dim, from element offset off. */
static inline pmx_rows pmx_tensor_rows(const kvc_tensor *t, int64_t off, int tok_dim,
                                       int head_dim) {
    pmx_rows r = {0};
    r.ptr = kvc__at(t, off);
    r.dtype = t->dtype;
    r.tok_stride = t->stride[tok_dim];
    r.head_stride = t->stride[head_dim];
    return r;
}

/* Rows moved from element offsets: dst = src + t*tok + h*head (bytes). */
static inline pmx_rows pmx_rows_offset(const pmx_rows *r, int64_t t, int64_t h) {
    pmx_rows o = *r;
    o.ptr += kvc__bytes(r->dtype, t * r->tok_stride + h * r->head_stride);
    if (o.sptr) o.sptr += kvc__bytes(r->sdtype, t * r->stok_stride + h * r->shead_stride);
    if (o.qsptr) o.qsptr += kvc__bytes(r->qsdtype, t * r->qstok_stride + h * r->qshead_stride);
    return o;
}

/* Stores ntok tokens (all H heads) of input rows into cache rows, for K
 * (index 0) and V (index 1); a half whose in[kv].ptr is NULL is skipped. */
void kvc__pmx_store(const pmx_op *op, const pmx_rows in[2], const pmx_rows cache[2],
                    int64_t ntok);

/* 1 if loading ntok tokens of `halves` halves (K, V) moves more than the
 * last-level cache holds: its output is then written with non-temporal
 * stores (set op->stream for the loads). */
int kvc__pmx_stream_loads(const pmx_op *op, int64_t ntok, int halves);

/* 1 if a token's heads are not back to back in the cache (head-major
 * layouts): callers then run K and V as separate tasks. */
int kvc__pmx_head_major(const pmx_op *op, const pmx_rows cache[2]);

/* Reads ntok cached tokens of K and V into output rows (H*repeat heads
 * each); an output whose ptr is NULL is skipped. */
void kvc__pmx_load(const pmx_op *op, const pmx_rows cache[2], const pmx_rows out[2],
                   int64_t ntok);

/* Validates attributes common to both operators and fills op (all but H/Dh
 * come from params and dtypes). max_layout: 1 static, 3 dynamic. */
kvc_status kvc__pmx_check_common(const char *fn, const kvc_pmx_kv_params *p, int max_layout,
                                 const kvc_tensor *ck, const kvc_tensor *cv,
                                 const kvc_tensor *cache, const kvc_tensor *scale, int64_t Dh,
                                 pmx_op *op);

/* Checks an output tensor: dtype t1 and exactly the given shape. */
kvc_status kvc__pmx_check_output(const char *fn, const char *name, const kvc_tensor *out,
                                 kvc_dtype t1, int ndim, const int64_t *shape);

/* Reads a one-element int64 tensor. */
kvc_status kvc__pmx_scalar_i64(const char *fn, const char *name, const kvc_tensor *t,
                               int64_t *value);

/* Fails if any stored input value is NaN/Inf (quantized stores only).
 * rows: the input block, ntok tokens x H heads. */
kvc_status kvc__pmx_check_finite(const char *fn, const pmx_op *op, const pmx_rows *in,
                                 int64_t ntok, const char *name);

#endif
