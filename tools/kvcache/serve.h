/*
 * `kvcache bench-serve` internals: one case (a KV dtype and batch size) and
 * what it measured, shared by the engine mode (cmd_bench_serve.c) and the
 * --sync mode (serve_sync.c).
 */
#ifndef KVCACHE_TOOLS_SERVE_H
#define KVCACHE_TOOLS_SERVE_H

#include <stdint.h>

#include "kvcache/kvcache.h"

typedef struct serve_case {
    const kvc_model *model;
    int32_t n_vocab;
    int64_t B, prompt_len, gen, threads, step_tokens;
    int kv; /* --kv-dtype code (cli.h) */
    int shared;       /* one prompt for all sequences */
    int prefix_cache; /* sequences may share cached prompt pages */
    const int32_t *text; /* prompt_len tokens every sequence gets (-p/-f), or NULL */
    int tty;          /* progress on stderr */
    const struct cli_store_opts *store; /* --kv-store (engine mode), or NULL */
    struct kvc_store **kv_store; /* with store: the store, opened by the first case and
                                    kept for the others (one event stream) */
    const char *model_path;
} serve_case;

typedef struct serve_result {
    double prefill_s, decode_s;
    int64_t prefill_tokens; /* prompt rows computed */
    int64_t decode_tokens;  /* tokens generated in pure decode steps */
    double decode_batch;    /* mean sequences per pure decode step */
    int64_t kv_bytes_per_token, cached_tokens, preemptions;
    /* FNV-1a of every sequence's first gen generated tokens, sequence by
     * sequence: both modes compute the same rows with the same kernels, so
     * they must agree (a check that --sync computes what the engine does) */
    uint64_t tokens_fnv;
    double ttft_s;            /* time to the first generated token */
    int64_t store_hit_tokens; /* prompt tokens restored from --kv-store */
} serve_result;

/* FNV-1a over B sequences' gen tokens (tokens[b * gen + i]). */
uint64_t serve_tokens_fnv(const int32_t *tokens, int64_t B, int64_t gen);

/* Sequence b's prompt (prompt_len tokens): the text, else random tokens
 * from a fixed seed, the same for every b when shared. */
void serve_prompt(const serve_case *c, int64_t b, int32_t *out);

/* The llama-batched-bench protocol (--sync): every prompt prefilled (rows of
 * several sequences batched, step_tokens a forward), then gen decode steps
 * of all B sequences at once, straight on a cache and the model's forward
 * pass. 0, or -1 after printing the error. */
int serve_sync_run(const serve_case *c, serve_result *r);

#endif
