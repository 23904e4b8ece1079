/*
 * `kvcache bench-serve --sync`: llama.cpp's llama-batched-bench protocol on
 * kvcache's cache and forward pass. Phase 1 prefills every prompt (sequences
 * in order, their rows packed step_tokens to a forward); phase 2 runs gen
 * decode steps, each one row of every one of the B sequences, feeding back
 * the greedy token. So decode tok/s = B * gen / phase 2's time (S_TG) is a
 * B-way decode throughout, at contexts prompt_len .. prompt_len + gen - 1,
 * unlike the engine mode, where early sequences decode while later ones are
 * still in their prompts.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "serve.h"

void serve_prompt(const serve_case *c, int64_t b, int32_t *out) {
    if (c->text) {
        memcpy(out, c->text, (size_t)c->prompt_len * sizeof(int32_t));
        return;
    }
    const uint64_t seed = 12345 + (c->shared ? 0 : (uint64_t)b * (uint64_t)c->prompt_len);
    for (int64_t i = 0; i < c->prompt_len; i++)
        out[i] = (int32_t)(bench_mix64(seed + (uint64_t)i) % (uint64_t)c->n_vocab);
}

uint64_t serve_tokens_fnv(const int32_t *tokens, int64_t B, int64_t gen) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < B * gen; i++) {
        const uint32_t t = (uint32_t)tokens[i];
        for (int k = 0; k < 4; k++) h = (h ^ ((t >> (8 * k)) & 0xff)) * 1099511628211ull;
    }
    return h;
}

/* Greedy tokens of the logits rows, in order, for the sequences in idx. */
static kvc_status pick(const float *logits, int32_t n_vocab, const int64_t *idx, int64_t n,
                       int32_t *tok) {
    const kvc_sampling_params sp = kvc_sampling_default_params(); /* greedy */
    for (int64_t i = 0; i < n; i++) {
        uint64_t rng = 0;
        kvc_status st = kvc_sample(logits + i * n_vocab, n_vocab, &sp, &rng, &tok[idx[i]]);
        if (st != KVC_OK) return st;
    }
    return KVC_OK;
}

int serve_sync_run(const serve_case *c, serve_result *r) {
    const int64_t B = c->B, pp = c->prompt_len, V = c->n_vocab;
    memset(r, 0, sizeof *r);
    kvc_cache_params cp =
        kvc_model_cache_params(c->model, cli_kv_dtype(c->kv), B * (pp + c->gen + 16));
    cp.kv_format = cli_kv_format(c->kv);
    cp.enable_prefix_caching = c->prefix_cache;
    kvc_cache *cache = NULL;
    kvc_model_ctx *ctx = NULL;
    const int64_t rows_max = c->step_tokens > B ? c->step_tokens : B;
    int32_t *prompts = malloc((size_t)(B * pp) * sizeof(int32_t));
    int32_t *tok = malloc((size_t)B * sizeof(int32_t)); /* each sequence's last token */
    int32_t *rows = malloc((size_t)rows_max * sizeof(int32_t));
    uint8_t *want = malloc((size_t)rows_max);
    kvc_seq_id *seq = malloc((size_t)B * sizeof *seq), *bseq = malloc((size_t)B * sizeof *bseq);
    int64_t *done = malloc((size_t)B * sizeof(int64_t));
    int64_t *pos0 = malloc((size_t)B * sizeof(int64_t));
    int64_t *n = malloc((size_t)B * sizeof(int64_t)), *dec = malloc((size_t)B * sizeof(int64_t));
    int64_t *fin = malloc((size_t)B * sizeof(int64_t)); /* sequences whose logits a step gives */
    float *logits = malloc((size_t)(B * V) * sizeof(float));
    int32_t *out = malloc((size_t)(B * c->gen) * sizeof(int32_t)); /* generated, per sequence */
    int ok = 0;
    if (!prompts || !tok || !rows || !want || !seq || !bseq || !done || !pos0 || !n || !dec ||
        !fin || !logits || !out) {
        fprintf(stderr, "kvcache: bench-serve: out of memory\n");
        goto out;
    }
    if (kvc_cache_create(&cp, &cache) != KVC_OK ||
        kvc_model_ctx_create(c->model, (int32_t)c->threads, &ctx) != KVC_OK)
        goto fail;
    for (int64_t b = 0; b < B; b++) serve_prompt(c, b, prompts + b * pp);

    /* phase 1: prefill. Every sequence is reserved first; a shared prompt's
     * later copies hit the first copy's pages, which the first copy's rows
     * write before or in the same forward (every layer appends all K/V
     * before attending) */
    double t0 = bench_now();
    for (int64_t b = 0; b < B; b++) {
        if (kvc_cache_add_sequence(cache, c->prefix_cache ? prompts + b * pp : NULL, pp, 0,
                                   &seq[b], &done[b]) != KVC_OK)
            goto fail;
        r->cached_tokens += done[b];
    }
    for (int64_t b = 0; b < B; b++) dec[b] = pp; /* prompt rows: prefill kernel */
    for (int64_t first = 0; first < B;) {
        int64_t nb = 0, nr = 0, nf = 0;
        for (int64_t b = first; b < B && nr < c->step_tokens; b++) {
            int64_t chunk = pp - done[b];
            if (chunk > c->step_tokens - nr) chunk = c->step_tokens - nr;
            bseq[nb] = seq[b];
            pos0[nb] = done[b];
            n[nb] = chunk;
            memcpy(rows + nr, prompts + b * pp + done[b], (size_t)chunk * sizeof(int32_t));
            memset(want + nr, 0, (size_t)chunk);
            if (done[b] + chunk == pp) { /* the prompt's last row: the first token */
                want[nr + chunk - 1] = 1;
                fin[nf++] = b;
            }
            nb++, nr += chunk;
        }
        if (kvc_model_forward(ctx, cache, (int32_t)nb, bseq, pos0, n, dec, rows, want, logits) !=
                KVC_OK ||
            pick(logits, (int32_t)V, fin, nf, tok) != KVC_OK)
            goto fail;
        for (int64_t i = 0; i < nb; i++) done[first + i] += n[i];
        r->prefill_tokens += nr;
        while (first < B && done[first] == pp) first++;
        if (c->tty)
            fprintf(stderr, "\r  %s B=%lld: prefill %lld / %lld rows   ", cli_kv_name(c->kv),
                    (long long)B, (long long)(r->prefill_tokens + r->cached_tokens),
                    (long long)(B * pp));
    }
    r->prefill_s = bench_now() - t0;

    /* phase 2: gen steps, one row of every sequence each */
    t0 = bench_now();
    for (int64_t b = 0; b < B; b++) {
        n[b] = 1;
        fin[b] = b;
    }
    for (int64_t step = 0; step < c->gen; step++) {
        for (int64_t b = 0; b < B; b++) {
            out[b * c->gen + step] = tok[b];
            if (kvc_cache_append(cache, seq[b], &tok[b], 1, NULL) != KVC_OK) goto fail;
            pos0[b] = pp + step;
        }
        if (kvc_model_forward(ctx, cache, (int32_t)B, seq, pos0, n, dec, tok, NULL, logits) !=
                KVC_OK ||
            pick(logits, (int32_t)V, fin, B, tok) != KVC_OK)
            goto fail;
        if (c->tty)
            fprintf(stderr, "\r  %s B=%lld: decode step %lld / %lld        ",
                    cli_kv_name(c->kv), (long long)B, (long long)step + 1, (long long)c->gen);
    }
    r->decode_s = bench_now() - t0;
    r->decode_tokens = B * c->gen;
    r->decode_batch = (double)B;
    r->tokens_fnv = serve_tokens_fnv(out, B, c->gen);
    r->kv_bytes_per_token = (int64_t)kvc_cache_bytes_per_token(cache);
    /* the cache's own bookkeeping must have held through the run */
    if (kvc_cache_check(cache) != KVC_OK) goto fail;
    ok = 1;
    goto out;
fail:
    fprintf(stderr, "%skvcache: bench-serve: %s\n", c->tty ? "\r\033[K" : "", kvc_last_error());
out:
    if (c->tty) fputs("\r\033[K", stderr);
    kvc_model_ctx_destroy(ctx);
    kvc_cache_destroy(cache);
    free(prompts);
    free(tok);
    free(rows);
    free(want);
    free(seq);
    free(bseq);
    free(done);
    free(pos0);
    free(n);
    free(dec);
    free(fin);
    free(logits);
    free(out);
    return ok ? 0 : -1;
}
