/*
 * `kvcache bench-serve`: B parallel sequences through the continuous-batching
 * engine (like llama.cpp's llama-batched-bench): each gets a prompt of
 * --prompt-len tokens and generates --gen tokens (end-of-generation ignored).
 * Reports prompt (prefill) and generation (decode) tokens per second and the
 * KV memory per token of context, for each KV dtype and batch size. --sync
 * runs llama-batched-bench's protocol instead (serve_sync.c).
 */
#define _POSIX_C_SOURCE 200809L /* isatty */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "cli_gen.h"
#include "cli_store.h"
#include "kvcache/kvcache.h"
#include "serve.h"

static const char serve_usage[] =
    "usage: kvcache bench-serve [-m MODEL] [options]\n"
    "\n"
    "options:\n"
    "  -m, --model PATH     GGUF model (default $KVCACHE_MODEL, else\n"
    "                       models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
    "  --batch LIST         parallel sequences, comma-separated (default 1,16)\n"
    "  --prompt-len N       prompt tokens per sequence (default 2048; with -p/-f the\n"
    "                       text's token count, and N may only shorten it)\n"
    "  -p, --prompt TEXT    every sequence's prompt is TEXT's tokens (implies\n"
    "                       --shared-prompt); default: random tokens\n"
    "  -f, --file FILE      the same with the text of FILE ('-': standard input; one\n"
    "                       trailing newline dropped)\n"
    "  --gen N              tokens generated per sequence (default 32)\n"
    "  --kv-dtype LIST      KV storage, comma-separated, among " CLI_KV_HELP "\n"
    "                       (default f16,int8)\n"
    "  --shared-prompt      one prompt for all sequences (prefix caching serves the\n"
    "                       copies); default: a different random prompt each\n"
    "  --no-prefix-cache    every sequence computes its whole prompt, shared or not\n"
    "  --sync               llama-batched-bench's protocol (below) instead of the\n"
    "                       continuous-batching engine\n"
    "  --step-tokens N      token rows per engine step / prefill forward (default 512)\n"
    "  -t, --threads N      threads (default 2)\n"
    "  --no-mmap            read the model into memory instead of mapping it\n"
    "  --quick              prompt 64, gen 8, batch 1,4, f16: a smoke test (options\n"
    "                       given explicitly keep their values)\n"
    "  --json               one JSON object per line\n"
    "  --kv-store URL, --kv-store-write P, --salt S, --kv-events E,\n"
    "  --kv-events-replay E, --json-stats\n"
    "                       one KV store, and one event stream, for every case's\n"
    "                       engine in turn (as for `kvcache run`; engine mode\n"
    "                       only); --json-stats prints each case's counters on\n"
    "                       stderr\n"
    "  -h, --help           this text\n"
    "\n"
    "Engine mode (default): all B requests go to the engine at once, as a server\n"
    "gets them. prefill tok/s: prompt token rows computed / time of steps that were\n"
    "not pure decode; decode tok/s: tokens generated in pure decode steps / their\n"
    "time (the context then spans prompt-len .. prompt-len + gen); dec_B: the mean\n"
    "batch of those steps (prompts are prefilled in turn within --step-tokens rows a\n"
    "step, so early sequences decode in mixed steps and dec_B can be well below B).\n"
    "\n"
    "--sync (llama-batched-bench): first every prompt is prefilled (rows of several\n"
    "sequences packed --step-tokens to a forward; the last row of each gives its\n"
    "first token), then --gen decode steps each compute one row of all B sequences\n"
    "(greedy tokens fed back; contexts prompt-len .. prompt-len + gen - 1). prefill\n"
    "tok/s = prompt rows computed / phase 1 time (S_PP); decode tok/s = B * gen /\n"
    "phase 2 time (S_TG); dec_B is B.\n"
    "\n"
    "KV B/token: cache bytes per token slot over all layers (K, V and scales);\n"
    "cached: prompt tokens served from the prefix cache.\n"
    "\n"
    "Exit status 2 (before any case runs) for a bad command line, a prompt past the\n"
    "model's context, or a case past 80% of the machine's memory (256 MiB with\n"
    "--quick: cache, forward rows and logits, estimated from the model once loaded).\n";

/* Splits a comma-separated list into items of fewer than 32 characters:
 * calls item(buf, i, ctx) for each; -1 for an empty list or item (",", "1,")
 * or more than max items or an item refused, else the count. */
static int split_list(const char *s, int max, int (*item)(const char *, int, void *), void *ctx) {
    int n = 0;
    for (;;) {
        char buf[32];
        size_t len = strcspn(s, ",");
        if (len == 0 || len >= sizeof buf || n == max) return -1;
        memcpy(buf, s, len);
        buf[len] = '\0';
        if (item(buf, n++, ctx)) return -1;
        s += len;
        if (*s == '\0') return n;
        s++; /* the comma: an item must follow */
    }
}

static int batch_item(const char *s, int i, void *out) {
    return cli_parse_i64(s, 1, 1024, (int64_t *)out + i);
}

static int dtype_item(const char *s, int i, void *out) {
    return cli_parse_kv_dtype(s, (int *)out + i);
}

/* Engine mode: B requests queued at once, stepped until all are done. */
static int serve_engine_run(const serve_case *c, serve_result *r) {
    const int64_t B = c->B;
    memset(r, 0, sizeof *r);
    kvc_engine_params ep = kvc_engine_default_params();
    ep.n_threads = (int32_t)c->threads;
    ep.kv_dtype = cli_kv_dtype(c->kv);
    ep.kv_format = cli_kv_format(c->kv);
    ep.max_running = (int32_t)B;
    ep.max_step_tokens = (int32_t)c->step_tokens;
    ep.kv_capacity_tokens = B * (c->prompt_len + c->gen + ep.page_size);
    ep.enable_prefix_caching = c->prefix_cache;
    kvc_engine *eng = NULL;
    kvc_store **store = c->kv_store;
    kvc_engine_event *ev = malloc((size_t)B * sizeof *ev);
    int32_t *prompt = malloc((size_t)c->prompt_len * sizeof(int32_t));
    int32_t *out = malloc((size_t)(B * c->gen) * sizeof(int32_t)); /* generated, per sequence */
    int64_t *n_out = calloc((size_t)B, sizeof(int64_t)), id0 = 0;
    int ok = 0;
    if (!ev || !prompt || !out || !n_out) {
        fprintf(stderr, "kvcache: bench-serve: out of memory\n");
        goto out;
    }
    if (kvc_engine_create(c->model, &ep, &eng) != KVC_OK) goto fail;
    if (c->store && cli_store_attach("bench-serve", c->store, c->model_path, c->model, eng, store))
        goto out;
    const double t0 = bench_now();
    for (int64_t b = 0; b < B; b++) {
        int64_t id;
        serve_prompt(c, b, prompt);
        if (kvc_engine_add_request(eng, prompt, c->prompt_len, (int32_t)c->gen, NULL, 1, &id) !=
            KVC_OK)
            goto fail;
        if (b == 0) id0 = id; /* ids are consecutive */
    }
    int64_t done_tokens = 0, dec_steps = 0, dec_before = 0;
    kvc_engine_stats s;
    while (kvc_engine_pending(eng) > 0) {
        int64_t ne = 0;
        if (kvc_engine_step(eng, ev, B, &ne) != KVC_OK) goto fail;
        if (done_tokens == 0 && ne > 0) r->ttft_s = bench_now() - t0;
        done_tokens += ne;
        for (int64_t i = 0; i < ne; i++) {
            const int64_t b = ev[i].request_id - id0;
            if (b >= 0 && b < B && n_out[b] < c->gen) out[b * c->gen + n_out[b]++] = ev[i].token;
        }
        kvc_engine_get_stats(eng, &s);
        if (s.decode_only_tokens > dec_before) dec_steps++; /* a pure decode step */
        dec_before = s.decode_only_tokens;
        if (c->tty)
            fprintf(stderr, "\r  %s B=%lld: prompt rows %lld, generated %lld / %lld   ",
                    cli_kv_name(c->kv), (long long)B, (long long)s.prefill_tokens,
                    (long long)done_tokens, (long long)(B * c->gen));
    }
    kvc_engine_get_stats(eng, &s);
    r->prefill_s = s.step_seconds - s.decode_seconds;
    r->decode_s = s.decode_seconds;
    r->prefill_tokens = s.prefill_tokens;
    r->decode_tokens = s.decode_only_tokens;
    /* the batch those steps had: prompts are prefilled in turn, so with
     * B > 1 the early sequences decode in mixed steps and the pure decode
     * steps come at the end, with fewer sequences left */
    r->decode_batch = dec_steps > 0 ? (double)s.decode_only_tokens / (double)dec_steps : 0;
    r->kv_bytes_per_token = s.kv_bytes_per_token;
    r->cached_tokens = s.cached_tokens;
    r->preemptions = s.preemptions;
    r->tokens_fnv = serve_tokens_fnv(out, B, c->gen);
    r->store_hit_tokens = s.external_tokens;
    if (c->store)
        cli_store_finish("bench-serve", c->store, *store, eng, r->ttft_s,
                         r->decode_s > 0 ? (double)r->decode_tokens / r->decode_s : 0.0, 60.0);
    ok = 1;
    goto out;
fail:
    fprintf(stderr, "%skvcache: bench-serve: %s\n", c->tty ? "\r\033[K" : "", kvc_last_error());
out:
    if (c->tty) fputs("\r\033[K", stderr);
    if (c->store) cli_store_detach(*store, eng);
    kvc_engine_destroy(eng);
    free(ev);
    free(prompt);
    free(out);
    free(n_out);
    return ok ? 0 : -1;
}

/* Bytes of a cache token slot for KV code kv (K, V and scales over all
 * layers), from a one-page cache of the model's geometry; the float32 size
 * if even that cannot be made (an estimate on the safe side). */
static double kv_token_bytes(const kvc_model *model, const kvc_model_info *in, int kv) {
    kvc_cache_params cp = kvc_model_cache_params(model, cli_kv_dtype(kv), 1);
    cp.kv_format = cli_kv_format(kv);
    cp.quant_group = kvc_engine_default_params().quant_group; /* as the engine's cache */
    kvc_cache *c = NULL;
    if (kvc_cache_create(&cp, &c) != KVC_OK) {
        kvc_clear_error();
        return 2.0 * 4.0 * in->n_layer * in->n_head_kv * in->head_dim;
    }
    const double b = (double)kvc_cache_bytes_per_token(c);
    kvc_cache_destroy(c);
    return b;
}

/* About the bytes the largest case takes: its cache (B * (prompt + gen) token
 * slots and a page each), the forward pass's rows (a step's rows plus one a
 * sequence) and B rows of logits; --sync also keeps every prompt. */
static double serve_case_bytes(const kvc_model *model, const kvc_model_info *in, int64_t B,
                               int kv, int64_t prompt_len, int64_t gen, int64_t step_tokens) {
    const double E = in->n_embd, QD = (double)in->n_head * in->head_dim,
                 KD = (double)in->n_head_kv * in->head_dim, F = in->n_ff;
    const double row = 4.0 * (3 * E + 2 * QD + 2 * KD + 2 * F);
    return kv_token_bytes(model, in, kv) * (double)B * (double)(prompt_len + gen + 16) +
           row * (double)(step_tokens + B) + 4.0 * (double)(B + 16) * in->n_vocab +
           4.0 * (double)B * (double)prompt_len;
}

int cmd_bench_serve(int argc, char **argv) {
    const char *cmd = "bench-serve";
    const char *model_path = cli_default_model(), *text = NULL, *text_file = NULL;
    int64_t batches[16] = {1, 16}, prompt_len = 2048, gen = 32, threads = 2, step_tokens = 512;
    int n_batches = 2, n_dtypes = 2, shared = 0, quick = 0, json = 0, sync = 0, no_prefix = 0;
    int no_mmap = 0;
    int set_batch = 0, set_prompt = 0, set_gen = 0, set_dtype = 0; /* win over --quick */
    int dtypes[8] = {KVC_F16, CLI_KV_KIVI8};
    cli_store_opts so;
    kvc_store *store = NULL; /* engine mode with a store: one for every case */
    cli_store_opts_default(&so);
    static const char *const with_value[] = {
        "-m", "--model", "-p", "--prompt", "-f", "--file", "--batch", "--prompt-len",
        "--gen", "--step-tokens", "-t", "--threads", "--kv-dtype", NULL};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (cli_is_help(a)) {
            fputs(serve_usage, stdout);
            return CLI_EXIT_OK;
        }
        const int sg = cli_store_opts_parse(cmd, argc, argv, &i, &so);
        if (sg > 1) return sg;
        if (sg == 1) continue;
        int *flag = !strcmp(a, "--shared-prompt")     ? &shared
                    : !strcmp(a, "--quick")           ? &quick
                    : !strcmp(a, "--json")            ? &json
                    : !strcmp(a, "--sync")            ? &sync
                    : !strcmp(a, "--no-prefix-cache") ? &no_prefix
                    : !strcmp(a, "--no-mmap")         ? &no_mmap
                                                      : NULL;
        if (flag) {
            *flag = 1;
            continue;
        }
        if (!cli_is_one_of(a, with_value))
            return cli_usage_error(cmd, "unexpected argument '%s'", a);
        if (!v) return cli_usage_error(cmd, "%s needs a value", a);
        i++;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            if (cli_opt_path(cmd, a, v)) return CLI_EXIT_USAGE;
            model_path = v;
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            text = v;
        } else if (!strcmp(a, "-f") || !strcmp(a, "--file")) {
            if (cli_opt_path(cmd, a, v)) return CLI_EXIT_USAGE;
            text_file = v;
        } else if (!strcmp(a, "--batch")) {
            n_batches = split_list(v, 16, batch_item, batches);
            if (n_batches <= 0)
                return cli_usage_error(cmd, "--batch: expected up to 16 integers in [1, 1024], "
                                       "comma-separated, got '%s'", v);
            set_batch = 1;
        } else if (!strcmp(a, "--prompt-len")) {
            if (cli_opt_i64(cmd, a, v, 1, 1 << 20, &prompt_len)) return CLI_EXIT_USAGE;
            set_prompt = 1;
        } else if (!strcmp(a, "--gen")) {
            if (cli_opt_i64(cmd, a, v, 1, 1 << 20, &gen)) return CLI_EXIT_USAGE;
            set_gen = 1;
        } else if (!strcmp(a, "--step-tokens")) {
            if (cli_opt_i64(cmd, a, v, 1, 1 << 20, &step_tokens)) return CLI_EXIT_USAGE;
        } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
            if (cli_opt_i64(cmd, a, v, 1, 256, &threads)) return CLI_EXIT_USAGE;
            cli_warn_threads(cmd, a, threads);
        } else if (!strcmp(a, "--kv-dtype")) {
            n_dtypes = split_list(v, 8, dtype_item, dtypes);
            if (n_dtypes <= 0)
                return cli_usage_error(cmd, "--kv-dtype: expected up to 8 of " CLI_KV_HELP
                                       ", comma-separated, got '%s'", v);
            set_dtype = 1;
        } else {
            return cli_usage_error(cmd, "unexpected argument '%s'", a);
        }
    }
    if (cli_store_opts_check(cmd, &so)) return CLI_EXIT_USAGE;
    if (text && text_file) return cli_usage_error(cmd, "give -p or -f, not both");
    if (sync && cli_store_opts_any(&so))
        return cli_usage_error(cmd, "--kv-store, --kv-events and --json-stats need the engine "
                               "mode (not --sync)");
    if (quick) {
        if (!set_prompt && !text && !text_file) prompt_len = 64;
        if (!set_gen) gen = 8;
        if (!set_batch) {
            batches[0] = 1;
            batches[1] = 4;
            n_batches = 2;
        }
        if (!set_dtype) {
            dtypes[0] = KVC_F16;
            n_dtypes = 1;
        }
    }
    char *file_text = NULL;
    size_t text_len = text ? strlen(text) : 0;
    if (text_file) {
        if (cli_read_prompt(cmd, text_file, &file_text, &text_len)) return CLI_EXIT_FAIL;
        text = file_text;
    }
    int rc = CLI_EXIT_FAIL;
    int32_t *text_ids = NULL;
    kvc_model *model = cli_load_model(cmd, model_path, json, 0, no_mmap);
    if (!model) goto done;
    kvc_model_info info;
    kvc_model_get_info(model, &info);
    if (text) {
        int64_t n_ids = 0;
        const kvc_tokenizer *tok = kvc_model_tokenizer(model);
        if (cli_tokenize(tok, text, text_len, kvc_tokenizer_add_bos(tok), 0, &text_ids, &n_ids) !=
            KVC_OK) {
            fprintf(stderr, "kvcache: bench-serve: %s\n", kvc_last_error());
            goto done;
        }
        if (n_ids == 0 || (set_prompt && prompt_len > n_ids)) {
            rc = cli_usage_error(cmd, "the prompt has %lld tokens%s", (long long)n_ids,
                                 n_ids ? ", fewer than --prompt-len" : "");
            goto done;
        }
        if (!set_prompt) prompt_len = n_ids;
        shared = 1; /* every sequence gets the text */
    }
    /* positions past the trained context would time a model outside its
     * range (`kvcache run` refuses such prompts and shortens -n instead) */
    if (prompt_len + gen > info.n_ctx) {
        rc = cli_usage_error(cmd, "--prompt-len %lld + --gen %lld exceed the model's trained "
                             "context of %d tokens", (long long)prompt_len, (long long)gen,
                             (int)info.n_ctx);
        goto done;
    }
    /* the cases' memory is checked before the first is made (a batch of 1024
     * prompts of 8000 tokens, 190 GB of cache, failed after the load and
     * the header, out of memory, exit 1) */
    double need = 0;
    for (int di = 0; di < n_dtypes; di++)
        for (int bi = 0; bi < n_batches; bi++) {
            const double b = serve_case_bytes(model, &info, batches[bi], dtypes[di], prompt_len,
                                              gen, step_tokens);
            if (b > need) need = b;
        }
    if (bench_check_serve_size(cmd, quick, need,
                               "--batch, --prompt-len, --gen, --step-tokens or --kv-dtype")) {
        rc = CLI_EXIT_USAGE;
        goto done;
    }
    char cpu[128];
    const char *mode = sync ? "sync" : "engine";
    if (!json) {
        printf("# model: %s (%s), %d layers, %d heads / %d kv heads, head dim %d\n", model_path,
               info.name, (int)info.n_layer, (int)info.n_head, (int)info.n_head_kv,
               (int)info.head_dim);
        printf("# cpu: %s, threads %d, isa %s\n", cli_cpu_model(cpu, sizeof cpu), (int)threads,
               kvc_isa_name(kvc_get_isa()));
        printf("# mode %s%s, prompt %lld tokens (%s%s), gen %lld tokens, step rows %lld\n", mode,
               sync ? " (llama-batched-bench protocol)" : " (continuous batching)",
               (long long)prompt_len, text ? "text, " : "", shared ? "shared" : "distinct",
               (long long)gen, (long long)step_tokens);
        if (no_prefix) printf("# prefix cache off\n");
        printf("%-6s %4s %10s %12s %10s %12s %6s %11s %8s %6s\n", "kv", "B", "prefill_s",
               "prefill_t/s", "decode_s", "decode_t/s", "dec_B", "KV_B/token", "cached",
               "preempt");
    }
    rc = CLI_EXIT_OK;
    for (int di = 0; di < n_dtypes && rc == CLI_EXIT_OK; di++) {
        for (int bi = 0; bi < n_batches && rc == CLI_EXIT_OK; bi++) {
            const serve_case c = {.model = model, .n_vocab = info.n_vocab, .B = batches[bi],
                                  .prompt_len = prompt_len, .gen = gen, .threads = threads,
                                  .step_tokens = step_tokens, .kv = dtypes[di],
                                  .shared = shared, .prefix_cache = !no_prefix,
                                  .text = text_ids, .tty = isatty(2) && !json,
                                  .store = cli_store_opts_any(&so) ? &so : NULL,
                                  .kv_store = &store, .model_path = model_path};
            serve_result r;
            if ((sync ? serve_sync_run(&c, &r) : serve_engine_run(&c, &r)) != 0) {
                rc = CLI_EXIT_FAIL;
                break;
            }
            const double pre_tps = r.prefill_s > 0 ? (double)r.prefill_tokens / r.prefill_s : 0;
            const double dec_tps = r.decode_s > 0 ? (double)r.decode_tokens / r.decode_s : 0;
            if (json) {
                fputs("{\"type\": \"case\", \"target\": \"bench-serve\", \"model\": ", stdout);
                bench_json_str(stdout, info.name);
                fputs(", \"cpu\": ", stdout);
                bench_json_str(stdout, cli_cpu_model(cpu, sizeof cpu));
                printf(", \"isa\": \"%s\", \"mode\": \"%s\", \"kv\": \"%s\", "
                       "\"batch\": %lld, \"prompt_len\": %lld, \"gen\": %lld, "
                       "\"prompt\": \"%s\", \"shared_prompt\": %s, \"prefix_cache\": %s, "
                       "\"step_tokens\": %lld, \"threads\": %d, "
                       "\"prefill_s\": %.4f, \"prefill_tokens\": %lld, \"prefill_tok_s\": %.1f, "
                       "\"decode_s\": %.4f, \"decode_tokens\": %lld, \"decode_tok_s\": %.2f, "
                       "\"decode_mean_batch\": %.2f, \"kv_bytes_per_token\": %lld, "
                       "\"cached_tokens\": %lld, \"preemptions\": %lld, "
                       "\"tokens_fnv\": \"%016llx\", \"ttft_s\": %.4f, "
                       "\"store_hit_tokens\": %lld}\n",
                       kvc_isa_name(kvc_get_isa()), mode, cli_kv_name(c.kv), (long long)c.B,
                       (long long)prompt_len, (long long)gen, text ? "text" : "random",
                       shared ? "true" : "false", no_prefix ? "false" : "true",
                       (long long)step_tokens, (int)threads, r.prefill_s,
                       (long long)r.prefill_tokens, pre_tps, r.decode_s,
                       (long long)r.decode_tokens, dec_tps, r.decode_batch,
                       (long long)r.kv_bytes_per_token, (long long)r.cached_tokens,
                       (long long)r.preemptions, (unsigned long long)r.tokens_fnv, r.ttft_s,
                       (long long)r.store_hit_tokens);
            } else {
                printf("%-6s %4lld %10.3f %12.1f %10.3f %12.2f %6.1f %11lld %8lld %6lld\n",
                       cli_kv_name(c.kv), (long long)c.B, r.prefill_s, pre_tps, r.decode_s,
                       dec_tps, r.decode_batch, (long long)r.kv_bytes_per_token,
                       (long long)r.cached_tokens, (long long)r.preemptions);
            }
            if (fflush(stdout) != 0 || ferror(stdout)) { /* the reader is gone: stop */
                fprintf(stderr, "kvcache: bench-serve: cannot write the output: %s\n",
                        strerror(errno));
                rc = CLI_EXIT_FAIL;
            }
        }
    }
done:
    cli_store_close(store);
    free(text_ids);
    free(file_text);
    kvc_model_destroy(model);
    return rc;
}
