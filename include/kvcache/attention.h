/*
 * Attention over kvcache storage (SEMANTICS section 5): decode (one query
 * token per request) reading K/V in place from float32/float16/bfloat16 or
 * int8/int4 caches (dequantized on the fly, never copied), and merging of
 * attention states by log-sum-exp.
 *
 *   s_j = sm_scale * q . k_j           (sm_scale 0 means 1/sqrt(Dh))
 *   s_j = cap * tanh(s_j / cap)        when logits_soft_cap > 0
 *   o   = sum_j softmax(s)_j v_j       softmax in float32
 *   lse = log2(sum_j 2^(s_j * log2 e))  (base 2, FlashInfer's convention)
 * Query head h reads KV head h / (Hq / H) (Hq % H == 0). window_left = w >= 0
 * keeps keys j >= kv_len - 1 - w (the query is the last position). A request
 * with no visible key gives o = 0 and lse = -inf, never NaN.
 *
 * Every call validates first and writes nothing on error. Results do not
 * depend on the thread count or on the other requests of a batch (work is
 * split in chunks of keys fixed by each request's own length). Unlike
 * the storage kernels, decode results differ in the last bits between ISAs
 * (summation order, polynomial exp2); each ISA is deterministic. Keys are
 * consumed in blocks that never cross a page, so the last bits also depend
 * on page_size (the same page size and ISA give the same bits), and decode
 * is not bitwise equal to a one-row prefill (prefill.h blocks keys by
 * absolute position). Head dimensions up to 512 are supported
 * (KVC_ERR_UNSUPPORTED above).
 *
 * Scores are float32 dot products of the unscaled q (prefill and MLA
 * likewise); the online softmax takes their max and then 2^(s * sm_scale *
 * log2 e - m) in one fused operation, so scores of large magnitude keep
 * their differences (-5e5 + 3 against -5e5 gives the float64 weights to
 * float32 rounding, and masked keys, -inf, never win). A soft cap, an
 * additive mask (pmx) or a negative sm_scale scale q first instead, which
 * rounds each product at the score's magnitude (~2^-24 |s|).
 * Scores must stay below 2^31 in log2 units (|sm_scale * q.k| * log2 e;
 * ~1.5e9 in natural units, where models' logits stay below ~1e3): every
 * exponent carries the float32 rounding of the running max (up to 2^-24 of
 * it), which past 2^31 leaves float32's exponent range, so results there
 * are unspecified (zeros or NaN, differing between ISAs). Prefill, cascade,
 * MLA and the pmx operator likewise.
 *
 * int8/int4 decode on the "amx" ISA multiplies integers on the tile unit:
 * each query head is rounded to fixed point relative to its largest
 * element: 16 bits when q is float16 or bfloat16 (which carries 11 or 8
 * bits itself) and the heads sharing a KV head have no element above 16
 * times their mean magnitude (a grid step is then at most float16's own
 * spacing at the mean element), else 32 bits (float32 q, or an outlier
 * channel, with which 16 bits gave up to 6x the float16 tolerance). A key's
 * score is then off by at most sm_scale * sum_i |k_i| * max|q| / 65278 (16
 * bits; with 32 each q_i keeps float32's rounding of itself, off by at most
 * |q_i| 2^-24 + max|q| 2^-32), so the output by at most twice that times
 * max|v| and the base-2 lse by log2 e times it; the softmax weights keep 24
 * bits. Typical errors are far smaller (the roundings cancel): about 1e-6
 * of max|o| in the benchmark's checks. As the 16-bit error grows with the
 * scores, the kernel bounds it per key from the K and V scales it reads and
 * takes 32 bits from the first key whose bound passes 0.02 (flat float16
 * queries with scores in the tens were up to 6x the float16 tolerance off
 * otherwise). The 16-bit query lets one score tile serve two quant groups
 * of 16 or 32 (BENCHMARKS.md: the int8 kernel ~1.1x faster).
 */
#ifndef KVCACHE_ATTENTION_H
#define KVCACHE_ATTENTION_H

#include "kvcache/core.h"
#include "kvcache/paged.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest head_dim the attention operators (decode, prefill, cascade, pmx)
 * take; past it they fail with KVC_ERR_UNSUPPORTED. */
#define KVC_ATTN_MAX_HEAD_DIM 512

/* Attention parameters; every operator taking them accepts NULL for the
 * defaults and refuses values outside the ranges below (KVC_ERR_INVALID_ARG). */
typedef struct kvc_attn_params {
    float sm_scale;        /* finite; 0: 1/sqrt(Dh) */
    float logits_soft_cap; /* finite, >= 0; > 0 enables cap * tanh(s / cap); tanh within
                              1.5 ulp, the same bits on every ISA */
    int32_t window_left;   /* >= -1; -1: no window */
    /* (Hq) float32 attention-sink logits or NULL (none): head h's softmax
     * denominator also counts exp(sinks[h]) (natural units, not scaled by
     * sm_scale or capped; -inf: no sink for that head, NaN and values
     * above FLT_MAX / log2 e (~2.36e38, +inf included) are refused), as
     * gpt-oss's sinks. Equivalent to merging a state (v = 0,
     * lse = sinks[h] * log2 e) into the result with merge_state: the output
     * shrinks by the sink's share and the lse counts it; a row with no
     * visible key outputs zeros and lse sinks[h] * log2 e. Decode, prefill
     * and cascade (once, after the levels) take it; the pmx operator and
     * MLA have no sinks. */
    const float *sinks;
} kvc_attn_params;

KVC_API kvc_attn_params kvc_attn_default_params(void);

/*
 * One request, one query token.
 *   q         (Hq, Dh) float32/float16/bfloat16
 *   k, v      NHD (kv_len, H, Dh) or HND (H, kv_len, Dh): float32, float16,
 *             bfloat16, int8 or int4 (then k_scale/v_scale of the same shape
 *             with last dim Dh / quant_group, float32 or float16)
 *   out       (Hq, Dh) float32/float16/bfloat16; lse (Hq) float32 or NULL
 */
KVC_API kvc_status kvc_single_decode(const kvc_tensor *q, const kvc_tensor *k,
                                     const kvc_tensor *v, const kvc_tensor *k_scale,
                                     const kvc_tensor *v_scale, int32_t quant_group,
                                     kvc_kv_layout layout, const kvc_attn_params *params,
                                     kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool);

/*
 * Batched decode over a paged cache, split like FlashInfer's wrapper: a plan
 * per batch composition (validates the page table, partitions work: long
 * requests are split into chunks of keys that threads process separately and
 * merge by log-sum-exp), then run per layer with no allocation. The plan
 * holds the chunks' partial states: one run at a time per plan (threads that
 * decode the same batch composition concurrently need a plan each).
 */
typedef struct kvc_decode_plan kvc_decode_plan;

/* kv_indptr (B+1), kv_indices (kv_indptr[B]), kv_last_page_len (B): int32
 * CSR page table (copied into the plan). n_threads: the pool size run will
 * be called with (<= 0: the online CPUs; at most 1024), as for prefill;
 * decode splits work by each request's length alone, so neither the plan
 * nor the results depend on it and run accepts any pool. */
KVC_API kvc_status kvc_decode_plan_create(const kvc_tensor *kv_indptr,
                                          const kvc_tensor *kv_indices,
                                          const kvc_tensor *kv_last_page_len,
                                          int32_t num_qo_heads, int32_t num_kv_heads,
                                          int32_t head_dim, int32_t page_size, int32_t n_threads,
                                          kvc_decode_plan **out);
KVC_API void kvc_decode_plan_destroy(kvc_decode_plan *plan); /* NULL is a no-op */

/*
 *   q      (B, Hq, Dh) float32/float16/bfloat16
 *   cache  paged cache (kvc_paged_cache: NHD/HND, any storage dtype, with
 *          scales for int8/int4); page ids must lie inside it
 *   out    (B, Hq, Dh); lse (B, Hq) float32 or NULL
 */
KVC_API kvc_status kvc_decode_run(kvc_decode_plan *plan, const kvc_tensor *q,
                                  const kvc_paged_cache *cache, const kvc_attn_params *params,
                                  kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool);

/*
 * Attention-state merging (SEMANTICS section 5): with m = max(s_a, s_b),
 * w_a = 2^(s_a - m), w_b = 2^(s_b - m): v = (w_a v_a + w_b v_b) / (w_a + w_b),
 * s = m + log2(w_a + w_b); two empty states (-inf) give v = 0, s = -inf.
 * The s tensors of the three merges may have any strides (last dim too).
 *   v_a, v_b, v_out  (N, H, D) float32/float16/bfloat16 (same dtype)
 *   s_a, s_b, s_out  (N, H) float32
 */
KVC_API kvc_status kvc_merge_state(const kvc_tensor *v_a, const kvc_tensor *s_a,
                                   const kvc_tensor *v_b, const kvc_tensor *s_b,
                                   kvc_tensor *v_out, kvc_tensor *s_out);

/* v, s updated with (v_other, s_other) as kvc_merge_state; mask (N) uint8 or
 * NULL: rows with mask 0 are left unchanged.
 *   v, v_other  (N, H, D) float32/float16/bfloat16 (same dtype)
 *   s, s_other  (N, H) float32 */
KVC_API kvc_status kvc_merge_state_in_place(kvc_tensor *v, kvc_tensor *s,
                                            const kvc_tensor *v_other,
                                            const kvc_tensor *s_other, const kvc_tensor *mask);

/* Folds n states as kvc_merge_state, in index order: v (N, n, H, D), s (N,
 * n, H) -> v_out (N, H, D), s_out (N, H); v and v_out float32/float16/
 * bfloat16 (same dtype), s and s_out float32; n = 0 gives v = 0, s = -inf. */
KVC_API kvc_status kvc_merge_states(const kvc_tensor *v, const kvc_tensor *s, kvc_tensor *v_out,
                                    kvc_tensor *s_out);

#ifdef __cplusplus
}
#endif
#endif
