/*
 * Model runtime: a llama-architecture GGUF model served through kvcache's
 * own paged cache (cache.h), prefill attention (prefill.h) and matrix
 * kernels, with a continuous-batching engine on top (seeds 001 and 004).
 *
 * Forward pass per token row (llama.cpp's "llama" and "qwen2" architectures):
 *   x = token_embd[tok]                                       (n_embd)
 *   per layer: h = rmsnorm(x) * attn_norm
 *              q, k, v = h Wq + bq, h Wk + bk, h Wv + bv      (Hq*Dh), (H*Dh), (H*Dh)
 *              rotary on q, k: pair i of each head rotated by the angle
 *              pos * base^(-2i / n_rot) / (rope_scale * freq_factor[i]);
 *              llama pairs adjacent dims (x[2i], x[2i+1]) (the GGUF layout
 *              of Q/K weights), qwen2 halves (x[i], x[i + n_rot/2]) (NEOX)
 *              k, v stored in the cache; o = attention(q, cache) Wo + bo; x += o
 *              h = rmsnorm(x) * ffn_norm
 *              x += (silu(h Wgate + bg) * (h Wup + bu)) Wdown + bd
 *   logits = rmsnorm(x) * output_norm  Wout  (Wout = token_embd when tied)
 * Biases are the blk.N.<name>.bias tensors where present (none: 0); qwen2
 * has the q/k/v ones, llama may have any. rope_scale is the linear rope
 * scaling factor (<arch>.rope.scaling.factor with type linear, or without
 * that key the older rope.scale_linear; 1 when absent or 0), freq_factor
 * the rope_freqs.weight tensor of Llama 3.1+ (1 when absent). Weights F32,
 * F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS and the K-quants Q2_K,
 * Q3_K, Q4_K, Q5_K, Q6_K (what llama.cpp's Q2_K .. Q6_K and IQ4_XS files mix:
 * it stores a matrix whose input dimension is not a multiple of 256 as
 * IQ4_NL, Q5_0, Q5_1 or Q8_0 instead)
 * are read in place from the mapped file.
 *
 * Loading refuses, naming it, whatever it would not follow: a tensor the
 * architecture does not use (e.g. blk.N.attn_q_norm.weight, or a block at
 * or past block_count), an <arch>.* key the runtime does not implement or a
 * value it does not (YaRN or LongRoPE scaling, experts, sliding windows,
 * soft-capping, a LayerNorm epsilon, ...), and keys outside general.*,
 * tokenizer.* (the tokenizer's, checked the same way by
 * kvc_tokenizer_from_gguf: a switch such as add_eos_token or
 * add_space_prefix set to true, or a key it does not know, is refused),
 * quantize.* and split.* (one file only).
 *
 * Exactness (seed 001): every row of every stage depends only on that row's
 * inputs (matrix kernels and attention are row-independent), so generation
 * through the cache gives bitwise the logits of recomputing the whole
 * sequence with float32 storage.
 *
 * Threads: a loaded kvc_model is read-only, so any number of threads may use
 * one model at once (each through its own context, engine or eval call); a
 * kvc_model_ctx, a kvc_engine and the cache they run on are used by one
 * thread at a time. Each call runs on its own thread pool of n_threads.
 */
#ifndef KVCACHE_MODEL_H
#define KVCACHE_MODEL_H

#include <stddef.h>

#include "kvcache/cache.h"
#include "kvcache/core.h"
#include "kvcache/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_model kvc_model;

/* Called during loading with the fraction done in [0, 1]. */
typedef void (*kvc_progress_fn)(float fraction, void *user);

typedef struct kvc_model_params {
    kvc_progress_fn progress; /* NULL: silent */
    void *progress_user;
    int32_t prefault; /* 1: touch every weight page at load (default 1) */
    /* Context limit in tokens (positions per sequence) for eval, forward and
     * engine requests: 0 (default) = the model's n_ctx_train (its GGUF
     * context_length), past which RoPE positions were never trained; > 0
     * overrides it, larger or smaller. Past the limit calls fail with
     * KVC_ERR_INVALID_ARG naming it (the CLI's -c/--ctx-size, Python's
     * Model(path, n_ctx=...)). */
    int32_t n_ctx;
    /* 1 (default): the weights are used in place from the mapped GGUF file;
     * 0: the file is read into memory of the model's own, on transparent huge
     * pages where Linux gives them (kvc_gguf_open_read; llama.cpp's
     * --no-mmap): decode streams every weight each token, and on 4 KiB file
     * pages it misses the TLB more (docs/BENCHMARKS.md). prefault is then
     * moot (the read touched every page) and progress covers the read. */
    int32_t use_mmap;
} kvc_model_params;

KVC_API kvc_model_params kvc_model_default_params(void);

/* kvc_model_info.biases: which bias vectors the blocks have. */
#define KVC_MODEL_BIAS_Q 1
#define KVC_MODEL_BIAS_K 2
#define KVC_MODEL_BIAS_V 4
#define KVC_MODEL_BIAS_O 8
#define KVC_MODEL_BIAS_FFN_GATE 16
#define KVC_MODEL_BIAS_FFN_UP 32
#define KVC_MODEL_BIAS_FFN_DOWN 64

typedef struct kvc_model_info {
    char arch[32];  /* "llama" or "qwen2" */
    char name[128]; /* general.name, may be empty */
    /* head_dim: <arch>.attention.key_length, else n_embd / n_head */
    int32_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx_train, n_rot;
    float rope_freq_base, rms_eps;
    int32_t tied_output;  /* 1 if the output head is token_embd */
    int64_t n_params;     /* weights, elements */
    size_t weight_bytes;  /* bytes of weight tensors in the file */
    /* appended after the fields above, which keep their offsets */
    int32_t rope_neox;    /* 1: rotary on halves (qwen2), 0: on adjacent pairs (llama) */
    float rope_scale;     /* linear rope scaling: positions divided by it (1: none) */
    int32_t rope_freq_factors; /* 1: rope_freqs.weight divides each frequency (Llama 3.1+) */
    int32_t biases;       /* KVC_MODEL_BIAS_* of the bias vectors any block has */
    int32_t n_ctx;        /* the context limit in force (kvc_model_params.n_ctx) */
} kvc_model_info;

/* Maps a GGUF file, checks every tensor the architecture needs (names,
 * shapes, supported types) and every key and tensor of the file (refusing
 * what the runtime would not follow, see above) and loads the tokenizer.
 * KVC_ERR_UNSUPPORTED for an architecture, key value or tensor not
 * implemented, KVC_ERR_CORRUPT for missing, mistyped or inconsistent
 * metadata or tensors, KVC_ERR_NOT_FOUND for a file without a tokenizer
 * (as kvc_tokenizer_from_gguf); the message names the key or tensor. */
KVC_API kvc_status kvc_model_load(const char *path, const kvc_model_params *params,
                                  kvc_model **out);
KVC_API void kvc_model_destroy(kvc_model *model); /* NULL is a no-op */
KVC_API kvc_status kvc_model_get_info(const kvc_model *model, kvc_model_info *out);
/* The model's tokenizer (owned by the model); NULL for a NULL model. */
KVC_API const kvc_tokenizer *kvc_model_tokenizer(const kvc_model *model);

/* Cache parameters for this model (layers, heads, head dim) with the given
 * storage dtype and capacity in tokens (rounded up to whole pages of the
 * default page_size); the rest as kvc_cache_default_params. A NULL model
 * gives kvc_cache_default_params() (which kvc_cache_create refuses). */
KVC_API kvc_cache_params kvc_model_cache_params(const kvc_model *model, kvc_dtype kv_dtype,
                                                int64_t capacity_tokens);

/*
 * One forward step over a batch of sequences of a cache made with
 * kvc_model_cache_params. Sequence s computes the tokens at positions
 * [pos0[s], pos0[s] + n[s]) (their slots must already be reserved in seqs[s],
 * and every position before pos0[s] must hold computed K/V); its K/V are
 * written to the cache and each row attends causally to positions
 * <= its own. Logits are produced for the rows flagged in want_logits.
 *   tokens       (sum n) int32, sequence by sequence
 *   seqs, pos0, n  (n_seqs)
 *   decode_from  (n_seqs) or NULL: rows at positions >= decode_from[s] attend
 *                with the decode kernel (one query row per call, memory-bound,
 *                the fast path for generated tokens), rows before it with the
 *                batched prefill kernel. Each kernel is row-independent, so a
 *                row's logits depend on this split, never on how steps are
 *                scheduled; the engine passes each request's prompt length.
 *                NULL: every row through prefill.
 *   want_logits  (sum n) uint8 or NULL (= the last row of each sequence)
 *   logits       (rows wanted, n_vocab) float32, in row order
 * Positions must stay below the context limit (kvc_model_params.n_ctx):
 * pos0[s] + n[s] <= n_ctx, else KVC_ERR_INVALID_ARG.
 * A context holds the step's scratch (grown as needed, reused across steps).
 * KVC_ERR_CORRUPT if a layer's queries, keys or values are not finite (NaN
 * or Inf weights): earlier layers' K/V are then written, later ones not, so
 * roll the rows' slots back (kvc_cache_rollback) before reusing them (in a
 * compressed-format cache, free the sequence instead: a step that completed
 * a K group has moved the earlier layers' tails on). Every other failure,
 * KVC_ERR_NOMEM included, comes before the first K/V write: the cache is
 * then unchanged.
 * Compressed-format caches (kvc_cache_params.kv_format): pos0[s] must be
 * where the sequence's stored tokens end (the tail holds its incomplete K
 * group), and decode_from does not apply: every row attends what a decode
 * at its position would (docs/KV_FORMATS.md section 6), whatever the steps.
 */
typedef struct kvc_model_ctx kvc_model_ctx;

/* n_threads in [1, 1024] (the context's own pool; 0 is not "all CPUs"). */
KVC_API kvc_status kvc_model_ctx_create(const kvc_model *model, int32_t n_threads,
                                        kvc_model_ctx **out);
KVC_API void kvc_model_ctx_destroy(kvc_model_ctx *ctx); /* NULL is a no-op */

KVC_API kvc_status kvc_model_forward(kvc_model_ctx *ctx, kvc_cache *cache, int32_t n_seqs,
                                     const kvc_seq_id *seqs, const int64_t *pos0,
                                     const int64_t *n, const int64_t *decode_from,
                                     const int32_t *tokens, const uint8_t *want_logits,
                                     float *logits);

/* Convenience: the logits of every position of one token sequence, computed
 * in one step in a fresh cache of kv_dtype (decode_from as in
 * kvc_model_forward; < 0 for none). tokens (n_tokens) int32, logits
 * (n_tokens, n_vocab) float32; n_threads as kvc_model_ctx_create.
 * KVC_ERR_INVALID_ARG if n_tokens exceeds the context limit (n_ctx). */
KVC_API kvc_status kvc_model_eval(const kvc_model *model, const int32_t *tokens, int64_t n_tokens,
                                  int64_t decode_from, kvc_dtype kv_dtype, float *logits,
                                  int32_t n_threads);

/* ---- sampling -------------------------------------------------------------- */

typedef struct kvc_sampling_params {
    float temperature; /* finite, >= 0; 0: greedy (argmax, lowest id on ties) */
    int32_t top_k;     /* >= 0; 0: off (1: greedy) */
    float top_p;       /* in (0, 1]; 1: off */
    uint64_t seed;
} kvc_sampling_params;

KVC_API kvc_sampling_params kvc_sampling_default_params(void); /* greedy */

/* Samples one token from logits (n_vocab) float32 (params NULL: greedy);
 * *rng is the caller's generator state (seeded from params.seed) and is
 * advanced when a draw is made: a greedy call (or an infinite maximum)
 * neither reads nor advances it, and rng may then be NULL. Deterministic
 * for a given state. KVC_ERR_INVALID_ARG for a NaN logit or parameters
 * outside the ranges above. */
KVC_API kvc_status kvc_sample(const float *logits, int32_t n_vocab,
                              const kvc_sampling_params *params, uint64_t *rng, int32_t *token);

/* ---- engine: continuous batching ---------------------------------------- */

typedef struct kvc_engine kvc_engine;

typedef struct kvc_engine_params {
    int32_t n_threads;         /* in [1, 1024] (default 1) */
    kvc_dtype kv_dtype;        /* KVC_F32, KVC_F16 (default), KVC_BF16, KVC_I8, KVC_I4 */
    int32_t quant_group;       /* int8/int4 (default 8) */
    int32_t page_size;         /* tokens per page (default 16) */
    int64_t kv_capacity_tokens; /* cache size in token slots (default 16384) */
    int32_t max_step_tokens;   /* token rows per step: decodes + prefill chunks (default 512;
                                  at most kv_capacity_tokens) */
    int32_t max_running;       /* sequences in flight (default 64) */
    int32_t enable_prefix_caching; /* default 1 */
    kvc_kv_format kv_format;   /* KVC_KVFMT_NONE (default: kv_dtype), or a compressed format
                                  (kvfmt.h; then kv_dtype and quant_group are ignored) */
} kvc_engine_params;

KVC_API kvc_engine_params kvc_engine_default_params(void);

KVC_API kvc_status kvc_engine_create(const kvc_model *model, const kvc_engine_params *params,
                                     kvc_engine **out);
KVC_API void kvc_engine_destroy(kvc_engine *engine); /* NULL is a no-op */

/* Queues a request: prompt tokens (copied), up to max_new_tokens generated
 * tokens, stopping early at an end-of-generation token unless ignore_eos;
 * sampling NULL: greedy. *request_id receives the request's id.
 * KVC_ERR_INVALID_ARG if n_prompt < 1, max_new_tokens < 1, a prompt token
 * is outside [0, n_vocab), sampling is outside kvc_sampling_params' ranges,
 * or n_prompt + max_new_tokens exceeds the model's context limit
 * (kvc_model_params.n_ctx) or the cache's capacity. */
KVC_API kvc_status kvc_engine_add_request(kvc_engine *engine, const int32_t *prompt,
                                          int64_t n_prompt, int32_t max_new_tokens,
                                          const kvc_sampling_params *sampling, int32_t ignore_eos,
                                          int64_t *request_id);

/* Drops a queued or running request (its pages go back to the cache). */
KVC_API kvc_status kvc_engine_cancel(kvc_engine *engine, int64_t request_id);

typedef enum kvc_finish_reason {
    KVC_FINISH_NONE = 0,   /* still running */
    KVC_FINISH_EOG = 1,    /* produced an end-of-generation token (included) */
    KVC_FINISH_LENGTH = 2  /* reached max_new_tokens */
} kvc_finish_reason;

typedef struct kvc_engine_event {
    int64_t request_id;
    int32_t token;  /* the token generated this step */
    int32_t finish; /* kvc_finish_reason */
} kvc_engine_event;

/*
 * One scheduling step: every running request that has finished its prompt
 * decodes one token; remaining room (max_step_tokens) goes to prompt chunks
 * of running requests, then to admitting queued ones (prefix-cache hits skip
 * their cached tokens). When pages run out, the most recently admitted
 * request is preempted: its sequence is freed (its full pages stay in the
 * prefix cache) and it is requeued at the front, to be recomputed later.
 * Writes one event per token generated (at most cap; *n_events the count;
 * KVC_ERR_INVALID_ARG if cap < min(running + queued requests, max_running),
 * the most that can run this step). A step that fails commits nothing but
 * its preemptions (no token, no event; requests it admitted are queued
 * again): e.g. NaN logits from a broken model fail every step naming the
 * request, which kvc_engine_cancel removes.
 */
KVC_API kvc_status kvc_engine_step(kvc_engine *engine, kvc_engine_event *events, int64_t cap,
                                   int64_t *n_events);

/* Requests queued or running (0 for NULL). */
KVC_API int64_t kvc_engine_pending(const kvc_engine *engine);

typedef struct kvc_engine_stats {
    int64_t steps;
    int64_t prompt_tokens;      /* prompt tokens of admitted requests */
    int64_t cached_tokens;      /* prompt tokens served from the prefix cache */
    int64_t prefill_tokens;     /* token rows computed for prompts (incl. recomputation) */
    int64_t decode_tokens;      /* tokens generated */
    int64_t preemptions;
    double prefill_seconds;     /* time in steps without decode rows */
    double decode_seconds;      /* time in steps with decode rows only */
    int64_t decode_only_tokens; /* tokens generated in those steps */
    double step_seconds;        /* time in all steps */
    int64_t kv_bytes_per_token; /* cache storage per token slot, all layers */
    int64_t kv_capacity_tokens;
    int64_t kv_used_tokens_peak; /* most slots held by sequences at once */
    int64_t external_tokens;    /* prompt tokens restored through the connector (a store) */
    int64_t external_miss_tokens; /* prompt tokens looked up there and not restored */
} kvc_engine_stats;

/*
 * External KV (a connector; kvc_store_attach_engine of store.h sets one).
 * Page indexes count from a sequence's first token; runs are whole prefix
 * units (pages, or for a compressed format lcm(page, K group) tokens).
 * When the engine meets a queued request, after the prefix cache's hit of
 * first_page pages:
 *   load_start   starts looking for the next (at most n_pages) pages and
 *                reading and verifying the run found, in the background (a
 *                handle; NULL: the request is computed). The request then
 *                waits, keeping its place in the queue, while the engine
 *                steps the others (a step with nothing else to do waits for
 *                the oldest load); a slow store delays only that request.
 *                A request whose next pages another request's load covers
 *                (same tokens) gets no load of its own: it waits for that
 *                one, then finds the pages in the prefix cache;
 *   load_poll    1 once the load is done (*n_ready: the verified run from
 *                its first page), 0 while it runs (wait: block until done);
 *   load_finish  writes loaded pages [skip, skip + n_pages) into page_ids
 *                (pages just reserved for the request; cache NULL or
 *                n_pages 0: none) and releases the load, stopping it first
 *                if it still runs. It cannot fail: the pages were verified.
 *   probe        when the engine has nothing else to step and restore is
 *                set: how many of the next (at most max_pages) pages the
 *                connector can likely give (*n_pages; nothing moved), then
 *   restore      the same as a load, in line: pages [first_page,
 *                first_page + n_pages) written into page_ids (just
 *                reserved), each verified first;
 *                *n_restored receives the run written from first_page on
 *                (the engine rolls the rest back and computes it).
 * Then, as pages change:
 *   on_final     pages [first_page, first_page + n_pages) of a request
 *                became final (full, K groups complete) with tokens' ids;
 *   on_hit       pages the prefix cache served at admission;
 *   on_evict     the cache is about to reuse a cached page (its hook,
 *                cache.h), or the engine rolls back a page restore wrote
 *                in the same admission (the rest of it failed).
 * probe, load_start, load_poll and load_finish are required
 * (kvc_engine_set_connector: KVC_ERR_INVALID_ARG); restore (then no in-line
 * restores), on_final, on_hit and on_evict may be NULL. All are called from the
 * thread that steps the engine, within kvc_engine_step (load_finish also
 * from kvc_engine_cancel, kvc_engine_set_connector and kvc_engine_destroy).
 */
typedef struct kvc_engine_connector {
    void *user;
    kvc_status (*probe)(void *user, const kvc_cache *cache, const int32_t *tokens,
                        int64_t first_page, int64_t max_pages, int64_t *n_pages);
    void *(*load_start)(void *user, const kvc_cache *cache, const int32_t *tokens,
                        int64_t first_page, int64_t n_pages);
    int (*load_poll)(void *user, void *load, int wait, int64_t *n_ready);
    void (*load_finish)(void *user, void *load, kvc_cache *cache, int64_t skip,
                        const int32_t *page_ids, int64_t n_pages);
    kvc_status (*restore)(void *user, kvc_cache *cache, const int32_t *tokens,
                          int64_t first_page, int64_t n_pages, const int32_t *page_ids,
                          int64_t *n_restored);
    void (*on_final)(void *user, const kvc_cache *cache, const int32_t *tokens,
                     int64_t first_page, int64_t n_pages, const int32_t *page_ids);
    void (*on_hit)(void *user, const kvc_cache *cache, const int32_t *tokens, int64_t first_page,
                   int64_t n_pages, const int32_t *page_ids);
    void (*on_evict)(void *user, const kvc_cache *cache, int32_t page_id);
} kvc_engine_connector;

/* Sets the engine's connector (copied; NULL detaches). Needs prefix caching
 * (KVC_ERR_INVALID_ARG without) and, for a compressed format, no float16
 * window (W = 0: restored pages then give exactly the recomputed K/V). */
KVC_API kvc_status kvc_engine_set_connector(kvc_engine *engine,
                                            const kvc_engine_connector *connector);
/* The engine's connector (a copy; all NULL when it has none). */
KVC_API kvc_status kvc_engine_get_connector(const kvc_engine *engine,
                                            kvc_engine_connector *out);

KVC_API kvc_status kvc_engine_get_stats(const kvc_engine *engine, kvc_engine_stats *out);
/* The engine's cache (for inspection: kvc_cache_get_stats, kvc_cache_check);
 * NULL for NULL. */
KVC_API const kvc_cache *kvc_engine_cache(const kvc_engine *engine);

#ifdef __cplusplus
}
#endif
#endif
