/*
 * The prefill-attention engine shared by prefill.c (single, paged, ragged),
 * cascade.c and pmx_attention.c (pmx MultiHeadCacheAttention). Callers
 * describe where K/V rows live (kvc__pf_kv), the requests (kvc__pf_batch),
 * an optional mask and the q/out/lse tensors; the engine does the rest.
 *
 * Work: task = (request, tile of QT query rows, KV head, group of GT of its
 * query heads); the tile's QT * GT (query row, head) pairs are the lanes of
 * the kernels in src/kernels/prefill.h. Keys go in blocks of KVC__PF_KB
 * aligned to absolute key positions (block k holds keys [k*KB, (k+1)*KB)),
 * each block converted to float32 once per task, with an online-softmax
 * state per lane. Every lane sees the same blocks in the same order and
 * blocks where it sees no key are exact no-ops for it, so a query row's
 * bits do not depend on qo_len, its tile, the batch or the thread count.
 */
#ifndef KVC_PREFILL_INTERNAL_H
#define KVC_PREFILL_INTERNAL_H

#include <stdint.h>

#include "kvcache/prefill.h"
#include "../core/internal.h"

#define KVC__PF_KB 64   /* keys per block: fixed, part of the numerics */
#define KVC__PF_MAXM 64 /* lanes (query rows x heads) per tile */

/*
 * One K/V-like tensor (K, V or a scale tensor): element (token slot s of
 * page id p, head h, d) at data + (p * id_mul + s * tok_st + h * head_st + d)
 * elements. A paged cache has id = page number and id_mul = page stride; a
 * contiguous one id = first token row and id_mul = token stride.
 */
typedef struct kvc__pf_view {
    const char *data;
    kvc_dtype dt;
    int64_t id_mul, tok_st, head_st;
} kvc__pf_view;

/* Where request b's key j lives: page pages[page0[b] + j / page_size], slot
 * j % page_size. Scales (ks, vs) only for int8/int4 (quant != 0). */
typedef struct kvc__pf_kv {
    kvc__pf_view k, v, ks, vs;
    int quant, group;
    int64_t page_size;
    const int64_t *pages; /* page ids */
    const int64_t *page0; /* (B) first entry of request b in pages */
} kvc__pf_kv;

enum { KVC__PF_MASK_NONE = 0, KVC__PF_MASK_BITS = 1, KVC__PF_MASK_ADD = 2 };

/*
 * BITS: request b's visibility of key j from query row i is bit
 * i * kv_len + j of the little-endian bit string starting at byte byte0[b]
 * of bits (1 = visible). ADD: an additive float32/float16 mask, value for
 * (query head hq, row i, key j) at add + (hq * add_sh + (row0[b] + i) *
 * add_sr + col0[b] + j) elements (add_sh 0 when shared by the heads); -inf
 * masks a key.
 */
typedef struct kvc__pf_mask {
    int kind;
    const uint8_t *bits;
    const int64_t *byte0;
    const char *add;
    kvc_dtype add_dt;
    int64_t add_sh, add_sr;
    const int64_t *row0, *col0;
} kvc__pf_mask;

/* The requests. causal[b] != 0: bottom-right causal for request b (callers
 * clear it when a custom mask replaces causal). task0 comes from
 * kvc__pf_tiling. */
typedef struct kvc__pf_batch {
    int64_t B, Hq, H, D;
    const int64_t *qo0;    /* (B) first row of request b in q/out/lse */
    const int64_t *qo_len; /* (B) */
    const int64_t *kv_len; /* (B) */
    const uint8_t *causal; /* (B) */
    int64_t QT, GT, ngb;   /* tile: QT query rows x GT heads; ngb = ceil(G / GT) */
    const int64_t *task0;  /* (B + 1) first task of each request */
} kvc__pf_batch;

/* q, out (rows, Hq, D) and lse (rows, Hq) (NULL: not written), strides in
 * elements. */
typedef struct kvc__pf_io {
    const char *q;
    kvc_dtype qd;
    int64_t q_sr, q_sh;
    char *out;
    kvc_dtype od;
    int64_t o_sr, o_sh;
    float *lse;
    int64_t l_sr, l_sh;
} kvc__pf_io;

/* Per-thread work buffers for head_dim D, n_slots concurrent tasks. */
typedef struct kvc__pf_scratch kvc__pf_scratch;
kvc_status kvc__pf_scratch_create(const char *fn, int64_t n_slots, int64_t D,
                                  kvc__pf_scratch **out);
void kvc__pf_scratch_destroy(kvc__pf_scratch *s);
int64_t kvc__pf_scratch_slots(const kvc__pf_scratch *s);

/* Sets b->QT, GT, ngb from Hq, H and fills task0 (B + 1); returns the
 * number of tasks. */
int64_t kvc__pf_tiling(kvc__pf_batch *b, int64_t *task0);

/* Runs every task on the pool (whose thread count must not exceed the
 * scratch's slots). p checked (kvc__attn_check_params: sm_scale not 0). */
void kvc__pf_execute(const kvc__pf_batch *b, const kvc__pf_kv *kv, const kvc__pf_mask *mask,
                     const kvc__pf_io *io, const kvc_attn_params *p, kvc__pf_scratch *scr,
                     kvc_threadpool *pool);

/* Validation shared with cascade.c and pmx_attention.c (with attn_check.h). */
/* q and out (rows, Hq, D) float dtypes, lse (rows, Hq) float32 or NULL. */
kvc_status kvc__pf_check_io(const char *fn, const kvc_tensor *q, const kvc_tensor *out,
                            const kvc_tensor *lse, int64_t rows, int64_t Hq, int64_t D);
void kvc__pf_set_io(kvc__pf_io *io, const kvc_tensor *q, kvc_tensor *out, kvc_tensor *lse);
/* The pool must not have more threads than the scratch has slots. */
kvc_status kvc__pf_check_pool(const char *fn, const kvc_threadpool *pool,
                              const kvc__pf_scratch *s);

#endif
