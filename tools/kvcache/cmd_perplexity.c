/*
 * `kvcache perplexity -m MODEL -f FILE`: perplexity of a text through the
 * cache, by llama-perplexity's protocol so that the figures compare with
 * llama.cpp's:
 *   - the whole file is tokenized once (BOS first when the vocabulary's
 *     tokenizer.ggml.add_bos_token says so; special-token text is not parsed);
 *   - n_chunks = n_tokens / n_ctx chunks of n_ctx tokens (the rest dropped),
 *     each run from an empty cache, its first token replaced by BOS when the
 *     vocabulary adds one;
 *   - in each chunk the positions first = n_ctx/2 .. n_ctx-2 predict the next
 *     token: n_ctx - 1 - n_ctx/2 tokens scored per chunk;
 *   - ppl = exp(mean nll), reported +/- ppl * sqrt((mean nll^2 - mean^2) /
 *     (count - 1)), llama.cpp's standard error.
 * The nll is -log_softmax(logits)[next] in double precision, max-shifted.
 * llama.cpp refuses texts shorter than two chunks; this needs one.
 */
#define _POSIX_C_SOURCE 200809L /* isatty */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "cli_gen.h"
#include "kvcache/kvcache.h"

static const char ppl_usage[] =
    "usage: kvcache perplexity [-m MODEL] -f FILE [options]\n"
    "\n"
    "Perplexity of the text in FILE, with llama-perplexity's protocol: the text is\n"
    "tokenized once and cut into chunks of N_CTX tokens, each evaluated from an\n"
    "empty cache (its first token replaced by BOS where the vocabulary adds one);\n"
    "the second half of each chunk is scored. Prints the perplexity with its\n"
    "standard error, the tokens scored and the KV cache bytes per token.\n"
    "\n"
    "options:\n"
    "  -m, --model PATH     GGUF model (default $KVCACHE_MODEL, else\n"
    "                       models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
    "  -f, --file FILE      the text (at least N_CTX tokens, at most 256 MiB;\n"
    "                       - reads standard input)\n"
    "  -c, --ctx-size N     tokens per chunk, 8 .. the model's context (default 1024,\n"
    "                       or the model's context when it is smaller)\n"
    "  -b, --batch-size N   token rows per forward step (default 512; results do not\n"
    "                       depend on it)\n"
    "  --kv-dtype TYPE      KV cache storage: " CLI_KV_HELP "\n"
    "                       (default f16; int8/int4 are the compressed formats kivi8/kivi4)\n"
    "  --kv-group N         int8-token/int4-token: elements per scale, dividing the head dim\n"
    "                       (default 8, the engine's)\n"
    "  -t, --threads N      threads (default: the CPUs this process may run on)\n"
    "  --no-mmap            read the model into memory instead of mapping it\n"
    "  --json               one JSON object: ppl, ppl_stderr, n_chunks, n_scored, n_ctx,\n"
    "                       n_tokens, kv_dtype, kv_group, kv_bytes_per_token\n"
    "  -q, --quiet          no progress (shown only on a terminal anyway) or notes on\n"
    "                       stderr\n"
    "  -h, --help           this text\n";

/* -log softmax(logits)[tok] in double, shifted by the max so exp never
 * overflows; NaN if a logit is not finite. */
static double token_nll(const float *logits, int32_t n_vocab, int32_t tok) {
    double mx = -INFINITY;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (!isfinite(logits[i])) return NAN;
        if (logits[i] > mx) mx = logits[i];
    }
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; i++) sum += exp((double)logits[i] - mx);
    return mx + log(sum) - (double)logits[tok];
}

static void load_progress(float f, void *user) {
    (void)user;
    fprintf(stderr, "\rloading model: %3d%%", (int)(f * 100.0f + 0.5f));
    if (f >= 1.0f) fputs("\r                    \r", stderr);
    fflush(stderr);
}

typedef struct ppl_result {
    double nll, nll2; /* sums over the scored tokens */
    int64_t count;
} ppl_result;

/* Scores every chunk of ids into *r; CLI_EXIT_OK or CLI_EXIT_FAIL (message
 * printed). */
static int score_chunks(kvc_cache *cache, kvc_model_ctx *ctx, const int32_t *ids,
                        int64_t n_chunks, int64_t n_ctx, int64_t n_batch, int32_t bos,
                        int32_t n_vocab, int progress, ppl_result *r) {
    const int64_t first = n_ctx / 2, step = n_batch < n_ctx ? n_batch : n_ctx;
    int32_t *chunk = malloc((size_t)n_ctx * sizeof *chunk);
    uint8_t *want = malloc((size_t)step);
    float *logits = malloc((size_t)step * (size_t)n_vocab * sizeof *logits);
    int rc = CLI_EXIT_FAIL;
    if (!chunk || !want || !logits) {
        fprintf(stderr, "kvcache: perplexity: out of memory\n");
        goto done;
    }
    for (int64_t c = 0; c < n_chunks; c++) {
        memcpy(chunk, ids + c * n_ctx, (size_t)n_ctx * sizeof *chunk);
        if (bos >= 0) chunk[0] = bos;
        kvc_seq_id seq;
        if (kvc_cache_add_sequence(cache, NULL, n_ctx, 0, &seq, NULL) != KVC_OK) goto fail;
        for (int64_t p = 0; p < n_ctx; p += step) {
            const int64_t n = n_ctx - p < step ? n_ctx - p : step;
            for (int64_t i = 0; i < n; i++) want[i] = p + i >= first && p + i < n_ctx - 1;
            if (kvc_model_forward(ctx, cache, 1, &seq, &p, &n, NULL, chunk + p, want, logits) !=
                KVC_OK)
                goto fail;
            const float *row = logits;
            for (int64_t i = 0; i < n; i++) {
                if (!want[i]) continue;
                const double v = token_nll(row, n_vocab, chunk[p + i + 1]);
                if (!isfinite(v)) {
                    fprintf(stderr, "kvcache: perplexity: non-finite logits in chunk %lld at "
                                    "position %lld\n", (long long)c + 1, (long long)(p + i));
                    goto done;
                }
                r->nll += v;
                r->nll2 += v * v;
                r->count++;
                row += n_vocab;
            }
        }
        if (kvc_cache_free_sequence(cache, seq) != KVC_OK) goto fail;
        if (progress) {
            fprintf(stderr, "\rperplexity: chunk %lld/%lld, ppl %.4f", (long long)c + 1,
                    (long long)n_chunks, exp(r->nll / (double)r->count));
            fflush(stderr);
        }
    }
    if (progress) fputs("\r\033[K", stderr);
    rc = CLI_EXIT_OK;
    goto done;
fail:
    fprintf(stderr, "kvcache: perplexity: %s\n", kvc_last_error());
done:
    free(logits);
    free(want);
    free(chunk);
    return rc;
}

int cmd_perplexity(int argc, char **argv) {
    const char *cmd = "perplexity";
    const char *model_path = cli_default_model(), *file = NULL;
    int json = 0, quiet = 0, kv_dtype = KVC_F16, no_mmap = 0;
    int64_t n_ctx = 0, n_batch = 512, threads = cli_online_cpus(); /* n_ctx 0: the default */
    int64_t group = kvc_engine_default_params().quant_group;
    int set_group = 0;
    static const char *const with_value[] = {
        "-m", "--model", "-f", "--file", "-c", "--ctx-size", "-b", "--batch-size",
        "--kv-group", "-t", "--threads", "--kv-dtype", NULL};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (cli_is_help(a)) {
            fputs(ppl_usage, stdout);
            return CLI_EXIT_OK;
        }
        if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        }
        if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) {
            quiet = 1;
            continue;
        }
        if (!strcmp(a, "--no-mmap")) {
            no_mmap = 1;
            continue;
        }
        if (!cli_is_one_of(a, with_value))
            return cli_usage_error(cmd, "unexpected argument '%s'", a);
        if (!v) return cli_usage_error(cmd, "%s needs a value", a);
        i++;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            if (cli_opt_path(cmd, a, v)) return CLI_EXIT_USAGE;
            model_path = v;
        } else if (!strcmp(a, "-f") || !strcmp(a, "--file")) {
            if (cli_opt_path(cmd, a, v)) return CLI_EXIT_USAGE;
            file = v;
        } else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size")) {
            if (cli_opt_i64(cmd, a, v, 8, 1 << 20, &n_ctx)) return CLI_EXIT_USAGE;
        } else if (!strcmp(a, "-b") || !strcmp(a, "--batch-size")) {
            if (cli_opt_i64(cmd, a, v, 1, 1 << 20, &n_batch)) return CLI_EXIT_USAGE;
        } else if (!strcmp(a, "--kv-group")) {
            if (cli_opt_i64(cmd, a, v, 1, 1 << 20, &group)) return CLI_EXIT_USAGE;
            set_group = 1;
        } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
            if (cli_opt_i64(cmd, a, v, 1, 256, &threads)) return CLI_EXIT_USAGE;
            cli_warn_threads(cmd, a, threads);
        } else if (!strcmp(a, "--kv-dtype")) {
            if (cli_parse_kv_dtype(v, &kv_dtype))
                return cli_usage_error(cmd, "--kv-dtype: expected one of " CLI_KV_HELP
                                       ", got '%s'", v);
        } else {
            return cli_usage_error(cmd, "unexpected argument '%s'", a);
        }
    }
    if (!file) return cli_usage_error(cmd, "a text file is required (-f FILE)");
    const int quantized = kv_dtype == KVC_I8 || kv_dtype == KVC_I4;
    if (set_group && !quantized)
        return cli_usage_error(cmd, "--kv-group needs --kv-dtype int8-token or int4-token");

    /* the text first: a wrong path should not wait for the model to load */
    size_t text_len = 0;
    char *text = NULL;
    if (cli_read_file(cmd, file, &text, &text_len)) return CLI_EXIT_FAIL; /* "-": stdin */
    const int tty = !quiet && isatty(2);
    kvc_model_params mp = kvc_model_default_params();
    mp.use_mmap = !no_mmap;
    if (tty) mp.progress = load_progress;
    kvc_model *model = NULL;
    if (kvc_model_load(model_path, &mp, &model) != KVC_OK) {
        fprintf(stderr, "kvcache: perplexity: cannot load %s: %s\n", model_path,
                kvc_last_error());
        if (access(model_path, R_OK) != 0)
            fprintf(stderr, "kvcache: perplexity: fetch the default model with "
                            "'bash scripts/fetch_model.sh'\n");
        free(text);
        return CLI_EXIT_FAIL;
    }
    int rc = CLI_EXIT_FAIL;
    int32_t *ids = NULL;
    kvc_cache *cache = NULL;
    kvc_model_ctx *ctx = NULL;
    kvc_model_info info;
    if (kvc_model_get_info(model, &info) != KVC_OK) goto fail;
    if (n_ctx == 0) { /* llama-perplexity's 1024, or the whole context of a smaller model */
        n_ctx = info.n_ctx_train < 1024 ? info.n_ctx_train : 1024;
        if (n_ctx < 1024 && !quiet)
            fprintf(stderr, "kvcache: perplexity: chunks of %lld tokens, the model's context "
                    "(-c to choose)\n", (long long)n_ctx);
        if (n_ctx < 8) {
            fprintf(stderr, "kvcache: perplexity: the model's context of %lld tokens is below "
                    "the 8 a chunk needs\n", (long long)n_ctx);
            goto done;
        }
    } else if (n_ctx > info.n_ctx_train) {
        rc = cli_usage_error(cmd, "-c %lld: the model's context is %d tokens", (long long)n_ctx,
                             (int)info.n_ctx_train);
        goto done;
    }
    const kvc_tokenizer *tok = kvc_model_tokenizer(model);
    const int add_bos = kvc_tokenizer_add_bos(tok);
    int64_t n_ids = 0;
    kvc_status st = kvc_tokenize(tok, text, text_len, add_bos, 0, NULL, 0, &n_ids);
    if (st != KVC_OK && st != KVC_ERR_NO_SPACE) goto fail;
    ids = malloc((size_t)(n_ids > 0 ? n_ids : 1) * sizeof *ids);
    if (!ids) {
        fprintf(stderr, "kvcache: perplexity: out of memory\n");
        goto done;
    }
    if (kvc_tokenize(tok, text, text_len, add_bos, 0, ids, n_ids, &n_ids) != KVC_OK) goto fail;
    for (int64_t i = 0; i < n_ids; i++) /* the scored ids index the logits */
        if (ids[i] < 0 || ids[i] >= info.n_vocab) {
            fprintf(stderr, "kvcache: perplexity: token id %d is outside the model's %d logits\n",
                    (int)ids[i], (int)info.n_vocab);
            goto done;
        }
    const int64_t n_chunks = n_ids / n_ctx;
    if (n_chunks < 1) {
        fprintf(stderr, "kvcache: perplexity: %s has %lld tokens; -c %lld needs at least %lld "
                        "(one chunk)\n", cli_file_name(file), (long long)n_ids, (long long)n_ctx,
                (long long)n_ctx);
        goto done;
    }
    kvc_cache_params cp = kvc_model_cache_params(model, cli_kv_dtype(kv_dtype), n_ctx);
    cp.kv_format = cli_kv_format(kv_dtype);
    cp.quant_group = (int32_t)group;
    cp.enable_prefix_caching = 0; /* every chunk from an empty cache */
    if (kvc_cache_create(&cp, &cache) != KVC_OK) {
        if (quantized) {
            rc = cli_usage_error(cmd, "--kv-group %lld: %s", (long long)group, kvc_last_error());
            goto done;
        }
        goto fail;
    }
    if (kvc_model_ctx_create(model, (int32_t)threads, &ctx) != KVC_OK) goto fail;
    const int32_t bos = add_bos ? kvc_tokenizer_bos(tok) : -1;
    ppl_result r = {0, 0, 0};
    rc = score_chunks(cache, ctx, ids, n_chunks, n_ctx, n_batch, bos, info.n_vocab, tty, &r);
    if (rc != CLI_EXIT_OK) goto done;
    const double mean = r.nll / (double)r.count;
    const double var = r.nll2 / (double)r.count - mean * mean;
    const double ppl = exp(mean);
    /* var can come out a rounding error below 0 when every nll is equal */
    const double se = r.count > 1 && var > 0 ? ppl * sqrt(var / (double)(r.count - 1)) : 0.0;
    const long long bpt = (long long)kvc_cache_bytes_per_token(cache);
    const char *dname = cli_kv_name(kv_dtype);
    if (json) {
        printf("{\"ppl\": %.17g, \"ppl_stderr\": %.17g, \"n_chunks\": %lld, \"n_scored\": %lld, "
               "\"n_ctx\": %lld, \"n_tokens\": %lld, \"kv_dtype\": \"%s\", \"kv_group\": ",
               ppl, se, (long long)n_chunks, (long long)r.count, (long long)n_ctx,
               (long long)n_ids, dname);
        if (quantized)
            printf("%lld", (long long)group);
        else
            fputs("null", stdout);
        printf(", \"kv_bytes_per_token\": %lld}\n", bpt);
    } else {
        printf("perplexity: %.4f +/- %.5f\n", ppl, se);
        printf("scored:     %lld tokens: %lld chunks of %lld (the text has %lld tokens)\n",
               (long long)r.count, (long long)n_chunks, (long long)n_ctx, (long long)n_ids);
        if (quantized)
            printf("kv cache:   %s group %lld, %lld bytes/token\n", dname, (long long)group, bpt);
        else
            printf("kv cache:   %s, %lld bytes/token\n", dname, bpt);
    }
    rc = CLI_EXIT_OK;
    goto done;
fail:
    fprintf(stderr, "kvcache: perplexity: %s\n", kvc_last_error());
done:
    kvc_model_ctx_destroy(ctx);
    kvc_cache_destroy(cache);
    free(ids);
    kvc_model_destroy(model);
    free(text);
    return rc;
}
