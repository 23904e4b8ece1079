/*
 * MLA decode kernels (include/kvcache/mla.h), one per ISA: mla_scalar.c,
 * mla_avx2.c, mla_avx512.c instantiate mla_body.h. src/attn/mla.c plans and
 * splits the work; a kernel runs one task: the query rows of one request
 * against one chunk of its keys, continuing an online-softmax state.
 */
#ifndef KVC_KERNELS_MLA_H
#define KVC_KERNELS_MLA_H

#include <stdint.h>

#include "kvcache/core.h"
#include "kvcache/mla.h"

/* Keys converted to float32 per block: a block's rows serve every query row
 * (all heads) before the next block is read. */
#define KVC_MLA_NB 32
/* Query rows processed together (register blocking); row states are padded
 * to a multiple of it. */
#define KVC_MLA_RB 4

/*
 * One task. Row r (0 <= r < rows, rows a multiple of KVC_MLA_RB) is query
 * row r / Hq, head r % Hq of the request; rows >= real_rows are padding and
 * see no key. Row r sees keys [j0, min(j1, lim(r) + 1)) with lim(r) =
 * r / Hq + kv_len - qo_len under causal, else kv_len - 1.
 *
 * q (rows, Dc + Dk) float32, ckv part then kpe part: unscaled with sc =
 * sm_scale * log2 e (cap == 0, sm_scale > 0), or carrying the scale with
 * sc = 1 (times sm_scale when cap > 0, sm_scale * log2 e otherwise).
 * Scores in base 2 are s * sc with s = q . k, or s = cap * tanh(q . k /
 * cap) * log2 e; the softmax takes the raw max and 2^(s sc - m) in one
 * fused operation, so large scores keep their differences. State per row:
 * m (running max in base 2, -inf initially), l (sum of the weights), acc
 * (rows, Dc) (sum of the weights times ckv).
 */
typedef struct kvc_mla_task {
    /* key j of the request: page pages[j / page_size], slot j % page_size;
     * element offsets from the tensor strides */
    const char *ckv, *kpe;
    kvc_dtype ckv_dt, kpe_dt;
    int64_t ckv_page_st, ckv_tok_st, kpe_page_st, kpe_tok_st; /* elements */
    const int32_t *pages;
    int64_t page_size;
    int64_t j0, j1; /* keys of this task */
    int64_t kv_len, qo_len, Hq;
    int causal;
    int Dc, Dk;
    int64_t rows, real_rows;
    const float *q;
    float cap, sc;
    float *m, *l, *acc;
    /* the kernel table's dtype conversion (bit-identical on every ISA) */
    void (*convert)(const void *src, kvc_dtype sd, void *dst, kvc_dtype dd, int64_t n);
} kvc_mla_task;

typedef void (*kvc_mla_kernel)(const kvc_mla_task *t);

void kvc__mla_task_scalar(const kvc_mla_task *t);
void kvc__mla_task_avx2(const kvc_mla_task *t);
void kvc__mla_task_avx512(const kvc_mla_task *t);

#endif
