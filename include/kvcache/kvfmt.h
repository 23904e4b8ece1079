/*
 * Compressed paged KV formats (docs/KV_FORMATS.md): kivi8 and kivi4.
 *
 * K is quantized per channel over groups of G consecutive tokens of a
 * sequence, V per token over groups of gv channels (kivi4: after a Hadamard
 * rotation of each head's V). Tokens not yet in a complete group stay in a
 * per-sequence float16 tail, K and V alike; the first S positions of a
 * sequence (the attention sink, kivi4: S = 1) stay in float16 for good, in
 * sink rows kept beside its first page. These formats sit beside the
 * per-token int8/int4 dtypes (SEMANTICS section 1), which keep their
 * meaning everywhere they are named so.
 *
 * Storage of one layer is a uint8 tensor (num_pages, page_bytes) (only
 * stride[1] must be 1); a page holds the codes and parameters of page_size
 * consecutive positions of one sequence, laid out as the document's section
 * 5. A sequence's tail for one layer is float16 (2, T, H, Dh), K then V,
 * T = G + W slots, slot t % T holding position t (V rotated when the format
 * rotates); it holds positions [max(0, floor(n / G) * G - W), n). Its sink
 * rows for one layer are float16 (2, S, H, Dh), K then V, row i holding
 * position i; sequences that share their first page share them.
 *
 * Attention at position i reads K/V exactly as a decode step at i would:
 * positions before max(0, floor((i + 1) / G) * G - W) from their quantized
 * groups, except the sink positions [0, S), read from the sink rows; the
 * rest (at most G - 1 + W of them) in float16. So results do not depend on
 * how a prompt is cut into steps.
 *
 * The bytes written depend only on the tokens' float16 K/V: not on the
 * batch, the number of tokens per call, the thread count or the ISA.
 */
#ifndef KVCACHE_KVFMT_H
#define KVCACHE_KVFMT_H

#include "kvcache/attention.h"
#include "kvcache/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvc_kv_format {
    KVC_KVFMT_NONE = 0,  /* not a compressed format: a per-token cache of a kvc_dtype */
    KVC_KVFMT_KIVI8 = 1, /* 8-bit K per channel (G 64), V per token asym (gv 64) */
    KVC_KVFMT_KIVI4 = 2, /* 4-bit, same groups, V Hadamard-rotated, position 0 in float16 */
    KVC_KVFMT_COUNT
} kvc_kv_format;

/* "none", "kivi8", "kivi4"; "?" for an invalid value. */
KVC_API const char *kvc_kv_format_name(kvc_kv_format f);
/* The format named name ("kivi8", "kivi4", any case); KVC_ERR_INVALID_ARG
 * naming the valid ones otherwise. "none" gives KVC_KVFMT_NONE. */
KVC_API kvc_status kvc_kv_format_from_name(const char *name, kvc_kv_format *out);

/* A format's parameters for one cache geometry (section 1). */
typedef struct kvc_kvfmt {
    kvc_kv_format id; /* the member these came from (KVC_KVFMT_NONE for a custom tuple) */
    int32_t bits;     /* 8 or 4: width of K and V codes */
    int32_t group;    /* G: tokens per K group; G % page_size == 0 or page_size % G == 0 */
    int32_t v_group;  /* gv: V channels per scale; divides head_dim */
    int32_t v_asym;   /* 1: V scale and zero point; 0: symmetric V (scale only) */
    int32_t rotate_v; /* 1: Hadamard rotation of V (head_dim a power of two) */
    int32_t num_kv_heads, head_dim, page_size; /* H >= 1, Dh in [1, KVC_ATTN_MAX_HEAD_DIM], P >= 1 */
    int32_t window;   /* W: positions of complete groups a query still reads in float16, before
                         its own group; a multiple of G, >= 0 (the tail holds them) */
    int32_t sink;     /* S in [0, min(G - 1, 16)]: positions [0, S) kept in float16 (sink rows)
                         and left out of group 0's K statistics */
} kvc_kvfmt;

/* The parameters of member id for H heads of Dh channels and pages of P
 * tokens (gv capped at Dh), checked with kvc_kvfmt_check. */
KVC_API kvc_status kvc_kvfmt_make(kvc_kv_format id, int32_t num_kv_heads, int32_t head_dim,
                                  int32_t page_size, kvc_kvfmt *out);

/* KVC_OK if every requirement of section 1 holds (bits 4 needs even Dh and
 * P; with G > P, G / P divides H * Dh; rotate_v needs a power-of-two Dh;
 * 0 <= S < G, S <= 16),
 * else KVC_ERR_INVALID_ARG naming the first that fails. */
KVC_API kvc_status kvc_kvfmt_check(const kvc_kvfmt *f);

/* Bytes of one page of one layer: P * (bytes per token per layer). 0 for
 * a format that fails kvc_kvfmt_check. */
KVC_API size_t kvc_kvfmt_page_bytes(const kvc_kvfmt *f);
/* Bytes of one layer's tail of one sequence: 2 * (G + W) * H * Dh * 2 (0
 * for a format that fails kvc_kvfmt_check). These three take NULL as a
 * failing format and leave kvc_last_error() empty. */
KVC_API size_t kvc_kvfmt_tail_bytes(const kvc_kvfmt *f);
/* Bytes of one layer's sink rows of one sequence: 2 * S * H * Dh * 2 (0
 * when S is 0 or the format fails kvc_kvfmt_check). */
KVC_API size_t kvc_kvfmt_sink_bytes(const kvc_kvfmt *f);

/* One sequence as the kernels see it, in one layer. */
typedef struct kvc_kvfmt_seq {
    const int32_t *pages; /* page ids of positions [0, n_kv): ceil(n_kv / P) entries */
    int64_t n_kv;         /* tokens stored, counting those of the current append */
    uint16_t *tail;       /* float16 (2, G + W, H, Dh); slot t % (G + W) holds position t */
    uint16_t *sink;       /* float16 (2, S, H, Dh): row i holds position i; NULL when S is 0.
                             Written by the append that stores position i, read by every
                             query past the first group; sequences sharing their first page
                             must share these values (a prefix hit carries them over) */
} kvc_kvfmt_seq;

/*
 * Stores K/V of n_seqs sequences. Rows [row_indptr[b], row_indptr[b+1]) of
 * key/value are positions n_kv - count .. n_kv - 1 of sequence b (count =
 * row_indptr[b+1] - row_indptr[b] <= n_kv), in order, continuing where the
 * sequence's stored tokens end (its tail as the previous store left it). Each
 * row goes to the tail (converted to float16, V rotated first), rows of
 * positions below S also to the sink rows; each K group the rows complete is
 * quantized into its pages.
 *   f          a checked format
 *   pages      uint8 (num_pages, page_bytes), page_bytes = kvc_kvfmt_page_bytes(f)
 *   seqs       n_seqs sequences; distinct sequences must not share a page
 *              of a group they complete
 *   row_indptr (n_seqs + 1), row_indptr[0] == 0, non-decreasing
 *   key, value (row_indptr[n_seqs], H, Dh) float32/float16/bfloat16, last
 *              dimension contiguous
 * Errors (KVC_ERR_INVALID_ARG, nothing written): bad shapes, page ids
 * outside [0, num_pages), a NaN, an infinity or a value beyond float16's
 * range (after the rotation). Threads split groups and rows in fixed
 * pieces, so the bytes do not depend on the pool.
 */
KVC_API kvc_status kvc_kvfmt_append(const kvc_kvfmt *f, kvc_tensor *pages,
                                    const kvc_kvfmt_seq *seqs, int64_t n_seqs,
                                    const int64_t *row_indptr, const kvc_tensor *key,
                                    const kvc_tensor *value, kvc_threadpool *pool);

/*
 * Attention over sequences stored in format f (section 6): query row i of
 * sequence q_seq[i] at position p = q_pos[i] attends keys [0, p] of it:
 * those before max(0, floor((p + 1) / G) * G - W) from the pages,
 * dequantized (the sink positions [0, S) from the sink rows instead), the
 * rest from the float16 tail. GQA: query head h reads KV
 * head h / (Hq / H).
 *   q       (nq, Hq, Dh) float32, last dimension contiguous; Hq % H == 0
 *   q_seq   (nq) int32 in [0, n_seqs); q_pos (nq) int32 in [0, n_kv) and
 *           q_pos + 1 >= floor(n_kv / G) * G (older positions' float16
 *           values are gone from the tail: attend them in the call that
 *           stores them, kvc_kvfmt_append_attention)
 *   params  NULL or sm_scale >= 0 (0: 1/sqrt(Dh)); logits_soft_cap,
 *           window_left and sinks are not supported (KVC_ERR_UNSUPPORTED if
 *           enabled; values outside attention.h's ranges: INVALID_ARG)
 *   out     (nq, Hq, Dh) float32, last dimension contiguous
 *   lse     NULL or (nq, Hq) float32: log2 of the softmax denominator of
 *           scaled scores (as kvc_decode_run)
 * Scores and softmax in float32 or wider; with rotate_v the output is
 * rotated back. Work is split in fixed pieces (a row's keys in chunks of
 * 1,024 positions): a row's result does not depend on the pool, nor on the
 * other rows of the call (one row or a whole prompt, any batch).
 */
KVC_API kvc_status kvc_kvfmt_attention(const kvc_kvfmt *f, const kvc_tensor *pages,
                                       const kvc_kvfmt_seq *seqs, int64_t n_seqs,
                                       const kvc_tensor *q, const int32_t *q_seq,
                                       const int32_t *q_pos, const kvc_attn_params *params,
                                       kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool);

/*
 * kvc_kvfmt_append, then kvc_kvfmt_attention, in one call: the queries'
 * float16 values come from this call's rows and the tail as it was before
 * the store, so a query may be at any position p of its sequence with
 * p + 1 >= floor(pos0 / G) * G, pos0 the sequence's first appended
 * position (every appended position qualifies). A model step calls this:
 * each row attends what a decode at its position would. Arguments as the
 * two calls; nothing is written when either would fail.
 */
KVC_API kvc_status kvc_kvfmt_append_attention(const kvc_kvfmt *f, kvc_tensor *pages,
                                              const kvc_kvfmt_seq *seqs, int64_t n_seqs,
                                              const int64_t *row_indptr, const kvc_tensor *key,
                                              const kvc_tensor *value, const kvc_tensor *q,
                                              const int32_t *q_seq, const int32_t *q_pos,
                                              const kvc_attn_params *params, kvc_tensor *out,
                                              kvc_tensor *lse, kvc_threadpool *pool);

#ifdef __cplusplus
}
#endif
#endif
