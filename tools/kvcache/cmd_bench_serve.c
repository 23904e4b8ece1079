/*
 * `kvcache bench-serve`: B parallel sequences through the continuous-batching
 * engine (like llama.cpp's llama-batched-bench): each gets a prompt of
 * --prompt-len tokens and generates --gen tokens (end-of-generation ignored).
 * Reports prompt (prefill) and generation (decode) tokens per second and the
 * KV memory per token of context, for each KV dtype and batch size.
 */
#define _POSIX_C_SOURCE 200809L /* isatty */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"

static const char serve_usage[] =
    "usage: kvcache bench-serve [-m MODEL] [options]\n"
    "\n"
    "options:\n"
    "  -m, --model PATH     GGUF model (default $KVCACHE_MODEL, else\n"
    "                       models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
    "  --batch LIST         parallel sequences, comma-separated (default 1,16)\n"
    "  --prompt-len N       prompt tokens per sequence (default 2048)\n"
    "  --gen N              tokens generated per sequence (default 32)\n"
    "  --kv-dtype LIST      KV storage among f32,f16,bf16,int8,int4 (default f16,int8)\n"
    "  --shared-prompt      one prompt for all sequences (prefix caching serves the\n"
    "                       copies); default: a different random prompt each\n"
    "  --step-tokens N      token rows per engine step (default 512)\n"
    "  -t, --threads N      threads (default 2)\n"
    "  --quick              prompt 64, gen 8, batch 1,4, f16: a smoke test (options\n"
    "                       given explicitly keep their values)\n"
    "  --json               one JSON object per line\n"
    "  -h, --help           this text\n"
    "\n"
    "prefill tok/s: prompt token rows computed / time of steps that were not pure\n"
    "decode; decode tok/s: tokens generated in pure decode steps / their time (the\n"
    "context then spans prompt-len .. prompt-len + gen); dec_B: the mean batch of\n"
    "those steps (prompts are prefilled in turn within --step-tokens rows a step, so\n"
    "early sequences decode in mixed steps and dec_B can be well below B); KV\n"
    "B/token: cache bytes per token slot over all layers (K, V and scales).\n";

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

int cmd_bench_serve(int argc, char **argv) {
    const char *cmd = "bench-serve";
    const char *model_path = cli_default_model();
    int64_t batches[16] = {1, 16}, prompt_len = 2048, gen = 32, threads = 2, step_tokens = 512;
    int n_batches = 2, n_dtypes = 2, shared = 0, quick = 0, json = 0;
    int set_batch = 0, set_prompt = 0, set_gen = 0, set_dtype = 0; /* win over --quick */
    int dtypes[8] = {KVC_F16, KVC_I8};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (cli_is_help(a)) {
            fputs(serve_usage, stdout);
            return CLI_EXIT_OK;
        }
        if (!strcmp(a, "--shared-prompt")) {
            shared = 1;
            continue;
        }
        if (!strcmp(a, "--quick")) {
            quick = 1;
            continue;
        }
        if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        }
        if (!v) return cli_usage_error(cmd, "unexpected argument '%s' (or missing value)", a);
        i++;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            model_path = v;
        } else if (!strcmp(a, "--batch")) {
            n_batches = split_list(v, 16, batch_item, batches);
            if (n_batches <= 0)
                return cli_usage_error(cmd, "--batch: expected up to 16 integers in [1, 1024], "
                                       "comma-separated, got '%s'", v);
            set_batch = 1;
        } else if (!strcmp(a, "--prompt-len")) {
            if (cli_parse_i64(v, 1, 1 << 20, &prompt_len))
                return cli_usage_error(cmd, "--prompt-len: bad value '%s'", v);
            set_prompt = 1;
        } else if (!strcmp(a, "--gen")) {
            if (cli_parse_i64(v, 1, 1 << 20, &gen))
                return cli_usage_error(cmd, "--gen: bad value '%s'", v);
            set_gen = 1;
        } else if (!strcmp(a, "--step-tokens")) {
            if (cli_parse_i64(v, 1, 1 << 20, &step_tokens))
                return cli_usage_error(cmd, "--step-tokens: bad value '%s'", v);
        } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
            if (cli_parse_i64(v, 1, 256, &threads))
                return cli_usage_error(cmd, "-t: bad value '%s'", v);
            cli_warn_threads(cmd, threads);
        } else if (!strcmp(a, "--kv-dtype")) {
            n_dtypes = split_list(v, 8, dtype_item, dtypes);
            if (n_dtypes <= 0)
                return cli_usage_error(cmd, "--kv-dtype: expected up to 8 of f32, f16, bf16, "
                                       "int8, int4, comma-separated, got '%s'", v);
            set_dtype = 1;
        } else {
            return cli_usage_error(cmd, "unexpected argument '%s'", a);
        }
    }
    if (quick) {
        if (!set_prompt) prompt_len = 64;
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
    const int tty = isatty(2);
    kvc_model_params mp = kvc_model_default_params();
    kvc_model *model = NULL;
    if (kvc_model_load(model_path, &mp, &model) != KVC_OK) {
        fprintf(stderr, "kvcache: bench-serve: cannot load %s: %s\n", model_path,
                kvc_last_error());
        return CLI_EXIT_FAIL;
    }
    kvc_model_info info;
    kvc_model_get_info(model, &info);
    /* positions past the trained context would time a model outside its
     * range (`kvcache run` refuses such prompts and shortens -n instead) */
    if (prompt_len + gen > info.n_ctx_train) {
        kvc_model_destroy(model);
        return cli_usage_error(cmd, "--prompt-len %lld + --gen %lld exceed the model's trained "
                               "context of %d tokens", (long long)prompt_len, (long long)gen,
                               (int)info.n_ctx_train);
    }
    char cpu[128];
    if (!json) {
        printf("# model: %s (%s), %d layers, %d heads / %d kv heads, head dim %d\n", model_path,
               info.name, (int)info.n_layer, (int)info.n_head, (int)info.n_head_kv,
               (int)info.head_dim);
        printf("# cpu: %s, threads %d, isa %s\n", cli_cpu_model(cpu, sizeof cpu), (int)threads,
               kvc_isa_name(kvc_get_isa()));
        printf("# prompt %lld tokens (%s), gen %lld tokens, step rows %lld\n",
               (long long)prompt_len, shared ? "shared" : "distinct", (long long)gen,
               (long long)step_tokens);
        printf("%-6s %4s %10s %12s %10s %12s %6s %11s %8s %6s\n", "kv", "B", "prefill_s",
               "prefill_t/s", "decode_s", "decode_t/s", "dec_B", "KV_B/token", "cached",
               "preempt");
    }
    int rc = CLI_EXIT_OK;
    int32_t *prompt = malloc((size_t)prompt_len * sizeof(int32_t));
    kvc_engine_event *ev = NULL;
    if (!prompt) return CLI_EXIT_FAIL;
    for (int di = 0; di < n_dtypes && rc == CLI_EXIT_OK; di++) {
        for (int bi = 0; bi < n_batches && rc == CLI_EXIT_OK; bi++) {
            const int64_t B = batches[bi];
            kvc_engine_params ep = kvc_engine_default_params();
            ep.n_threads = (int32_t)threads;
            ep.kv_dtype = (kvc_dtype)dtypes[di];
            ep.max_running = (int32_t)B;
            ep.max_step_tokens = (int32_t)step_tokens;
            ep.kv_capacity_tokens = B * (prompt_len + gen + ep.page_size);
            kvc_engine *eng = NULL;
            if (kvc_engine_create(model, &ep, &eng) != KVC_OK) {
                fprintf(stderr, "kvcache: bench-serve: %s\n", kvc_last_error());
                rc = CLI_EXIT_FAIL;
                break;
            }
            uint64_t rs = 12345;
            free(ev);
            ev = malloc((size_t)B * sizeof *ev);
            for (int64_t b = 0; b < B && rc == CLI_EXIT_OK; b++) {
                if (b == 0 || !shared)
                    for (int64_t i = 0; i < prompt_len; i++)
                        prompt[i] = (int32_t)(bench_mix64(rs++) % (uint64_t)info.n_vocab);
                int64_t id;
                if (!ev || kvc_engine_add_request(eng, prompt, prompt_len, (int32_t)gen, NULL, 1,
                                                  &id) != KVC_OK) {
                    fprintf(stderr, "kvcache: bench-serve: %s\n", kvc_last_error());
                    rc = CLI_EXIT_FAIL;
                }
            }
            int64_t done_tokens = 0, dec_steps = 0, dec_before = 0;
            while (rc == CLI_EXIT_OK && kvc_engine_pending(eng) > 0) {
                int64_t ne = 0;
                if (kvc_engine_step(eng, ev, B, &ne) != KVC_OK) {
                    fprintf(stderr, "kvcache: bench-serve: %s\n", kvc_last_error());
                    rc = CLI_EXIT_FAIL;
                    break;
                }
                done_tokens += ne;
                kvc_engine_stats sd;
                kvc_engine_get_stats(eng, &sd);
                if (sd.decode_only_tokens > dec_before) dec_steps++; /* a pure decode step */
                dec_before = sd.decode_only_tokens;
                if (tty && !json) {
                    kvc_engine_stats s;
                    kvc_engine_get_stats(eng, &s);
                    fprintf(stderr, "\r  %s B=%lld: prompt rows %lld, generated %lld / %lld   ",
                            kvc_dtype_name(ep.kv_dtype), (long long)B,
                            (long long)s.prefill_tokens, (long long)done_tokens,
                            (long long)(B * gen));
                }
            }
            if (tty && !json) fputs("\r\033[K", stderr);
            kvc_engine_stats s;
            kvc_engine_get_stats(eng, &s);
            const double pre_s = s.step_seconds - s.decode_seconds;
            const double pre_tps = pre_s > 0 ? (double)s.prefill_tokens / pre_s : 0;
            const double dec_tps = s.decode_seconds > 0 ? (double)s.decode_only_tokens /
                                                              s.decode_seconds : 0;
            /* the batch those steps had: prompts are prefilled in turn, so with
             * B > 1 the early sequences decode in mixed steps and the pure
             * decode steps come at the end, with fewer sequences left */
            const double dec_b = dec_steps > 0 ? (double)s.decode_only_tokens / (double)dec_steps
                                               : 0;
            if (rc == CLI_EXIT_OK) {
                if (json) {
                    fputs("{\"type\": \"case\", \"target\": \"bench-serve\", \"model\": ", stdout);
                    bench_json_str(stdout, info.name);
                    fputs(", \"cpu\": ", stdout);
                    bench_json_str(stdout, cli_cpu_model(cpu, sizeof cpu));
                    printf(", \"isa\": \"%s\", \"kv\": \"%s\", "
                           "\"batch\": %lld, \"prompt_len\": %lld, \"gen\": %lld, "
                           "\"shared_prompt\": %s, \"step_tokens\": %lld, \"threads\": %d, "
                           "\"prefill_s\": %.4f, \"prefill_tok_s\": %.1f, \"decode_s\": %.4f, "
                           "\"decode_tok_s\": %.2f, \"decode_mean_batch\": %.2f, "
                           "\"kv_bytes_per_token\": %lld, \"cached_tokens\": %lld, "
                           "\"preemptions\": %lld}\n",
                           kvc_isa_name(kvc_get_isa()), kvc_dtype_name(ep.kv_dtype),
                           (long long)B, (long long)prompt_len, (long long)gen,
                           shared ? "true" : "false", (long long)step_tokens,
                           (int)threads, pre_s, pre_tps, s.decode_seconds, dec_tps, dec_b,
                           (long long)s.kv_bytes_per_token, (long long)s.cached_tokens,
                           (long long)s.preemptions);
                } else {
                    printf("%-6s %4lld %10.3f %12.1f %10.3f %12.2f %6.1f %11lld %8lld %6lld\n",
                           kvc_dtype_name(ep.kv_dtype), (long long)B, pre_s, pre_tps,
                           s.decode_seconds, dec_tps, dec_b, (long long)s.kv_bytes_per_token,
                           (long long)s.cached_tokens, (long long)s.preemptions);
                }
                fflush(stdout);
            }
            kvc_engine_destroy(eng);
        }
    }
    free(ev);
    free(prompt);
    kvc_model_destroy(model);
    return rc;
}
