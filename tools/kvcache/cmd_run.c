/*
 * `kvcache run -m MODEL -p PROMPT`: generates text with a GGUF model through
 * the engine (one request), streaming the tokens to stdout as they come.
 */
#define _POSIX_C_SOURCE 200809L /* isatty, access */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h" /* bench_now */
#include "cli.h"
#include "kvcache/kvcache.h"

static const char run_usage[] =
    "usage: kvcache run [-m MODEL] -p PROMPT [options]\n"
    "\n"
    "Generates a continuation of PROMPT (or, with --chat, an assistant reply) and\n"
    "streams it to stdout. Timings go to stderr.\n"
    "\n"
    "options:\n"
    "  -m, --model PATH    GGUF model (default $KVCACHE_MODEL, else\n"
    "                      models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
    "  -p, --prompt TEXT   prompt text\n"
    "  --chat              apply the model's chat template (PROMPT is the user turn)\n"
    "  --system TEXT       system message for --chat\n"
    "  -n, --n-predict N   tokens to generate at most (default 128; lowered to fit the\n"
    "                      context with the prompt)\n"
    "  -c, --ctx-size N    context limit in tokens (default 0: the model's trained\n"
    "                      context, e.g. 8192; past it RoPE positions were never trained)\n"
    "  --temp T            temperature, 0 = greedy (default 0)\n"
    "  --top-k K           top-k filter when sampling (default 40, 0 = off)\n"
    "  --top-p P           nucleus filter when sampling (default 0.95, 1 = off)\n"
    "  --seed N            sampling seed (default 0)\n"
    "  --kv-dtype TYPE     KV cache storage: f32, f16, bf16, int8, int4 (default f16)\n"
    "  -t, --threads N     threads (default: the CPUs this process may run on)\n"
    "  --ignore-eos        keep generating after an end-of-generation token\n"
    "  -q, --quiet         no load progress or timings on stderr\n"
    "  -h, --help          this text\n";

static void load_progress(float f, void *user) {
    (void)user;
    fprintf(stderr, "\rloading model: %3d%%", (int)(f * 100.0f + 0.5f));
    if (f >= 1.0f) fputs("\r                    \r", stderr);
    fflush(stderr);
}

int cmd_run(int argc, char **argv) {
    const char *cmd = "run";
    const char *model_path = cli_default_model(), *prompt = NULL, *system = NULL;
    int chat = 0, special = 0, quiet = 0, ignore_eos = 0, kv_dtype = KVC_F16;
    int64_t n_predict = 128, threads = cli_online_cpus(), top_k = 40, n_ctx = 0;
    uint64_t seed = 0;
    double temp = 0.0, top_p = 0.95;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (cli_is_help(a)) {
            fputs(run_usage, stdout);
            return CLI_EXIT_OK;
        }
#define NEED_VALUE()                                                                               \
    do {                                                                                           \
        if (!v) return cli_usage_error(cmd, "%s needs a value", a);                                \
        i++;                                                                                       \
    } while (0)
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            NEED_VALUE();
            model_path = v;
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            NEED_VALUE();
            prompt = v;
        } else if (!strcmp(a, "--system")) {
            NEED_VALUE();
            system = v;
        } else if (!strcmp(a, "--chat")) {
            chat = 1;
        } else if (!strcmp(a, "--special")) {
            special = 1;
        } else if (!strcmp(a, "--ignore-eos")) {
            ignore_eos = 1;
        } else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) {
            quiet = 1;
        } else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict")) {
            NEED_VALUE();
            if (cli_parse_i64(v, 1, 1 << 20, &n_predict))
                return cli_usage_error(cmd, "-n: expected an integer in [1, 1048576], got '%s'", v);
        } else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size")) {
            NEED_VALUE();
            if (cli_parse_i64(v, 0, INT32_MAX, &n_ctx))
                return cli_usage_error(cmd, "-c: expected an integer in [0, 2^31), got '%s'", v);
        } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
            NEED_VALUE();
            if (cli_parse_i64(v, 1, 256, &threads))
                return cli_usage_error(cmd, "-t: expected an integer in [1, 256], got '%s'", v);
            cli_warn_threads(cmd, threads);
        } else if (!strcmp(a, "--seed")) {
            NEED_VALUE();
            if (cli_parse_u64(v, &seed))
                return cli_usage_error(cmd, "--seed: expected an integer in [0, 2^64), got '%s'",
                                       v);
        } else if (!strcmp(a, "--top-k")) {
            NEED_VALUE();
            if (cli_parse_i64(v, 0, 1 << 30, &top_k))
                return cli_usage_error(cmd, "--top-k: expected an integer >= 0, got '%s'", v);
        } else if (!strcmp(a, "--temp")) {
            NEED_VALUE();
            if (cli_parse_f64(v, &temp) || !(temp >= 0 && temp <= 100))
                return cli_usage_error(cmd, "--temp: expected a number in [0, 100], got '%s'", v);
        } else if (!strcmp(a, "--top-p")) {
            NEED_VALUE();
            /* > 0 as the float the sampler gets, not only as a double */
            if (cli_parse_f64(v, &top_p) || !((float)top_p > 0 && top_p <= 1))
                return cli_usage_error(cmd, "--top-p: expected a number in (0, 1], got '%s'", v);
        } else if (!strcmp(a, "--kv-dtype")) {
            NEED_VALUE();
            if (cli_parse_kv_dtype(v, &kv_dtype))
                return cli_usage_error(cmd, "--kv-dtype: expected f32, f16, bf16, int8 or int4, "
                                       "got '%s'", v);
        } else {
            return cli_usage_error(cmd, "unexpected argument '%s'", a);
        }
#undef NEED_VALUE
    }
    if (!prompt) return cli_usage_error(cmd, "a prompt is required (-p TEXT)");
    if (system && !chat) return cli_usage_error(cmd, "--system needs --chat");

    kvc_model_params mp = kvc_model_default_params();
    mp.n_ctx = (int32_t)n_ctx;
    if (!quiet && isatty(2)) mp.progress = load_progress;
    kvc_model *model = NULL;
    double t0 = bench_now();
    if (kvc_model_load(model_path, &mp, &model) != KVC_OK) {
        fprintf(stderr, "kvcache: run: cannot load %s: %s\n", model_path, kvc_last_error());
        if (access(model_path, R_OK) != 0)
            fprintf(stderr, "kvcache: run: fetch the default model with "
                            "'bash scripts/fetch_model.sh'\n");
        return CLI_EXIT_FAIL;
    }
    const double t_load = bench_now() - t0;
    const kvc_tokenizer *tok = kvc_model_tokenizer(model);
    int rc = CLI_EXIT_FAIL;
    int32_t *ids = NULL;
    kvc_engine *eng = NULL;
    const size_t tlen = strlen(prompt);
    kvc_chat_message msgs[2];
    int nm = 0;
    if (system) msgs[nm++] = (kvc_chat_message){"system", system};
    msgs[nm++] = (kvc_chat_message){"user", prompt};
    int64_t n_ids = 0;
    const int add_bos = kvc_tokenizer_add_bos(tok);
    /* with --chat, the messages are plain text unless --special: only the
     * template's own markers become control tokens */
#define TOKENIZE(out, cap)                                                                             (chat ? kvc_chat_tokenize(tok, NULL, msgs, nm, 1, add_bos, special, out, cap, &n_ids)                   : kvc_tokenize(tok, prompt, tlen, add_bos, special, out, cap, &n_ids))
    kvc_status st = TOKENIZE(NULL, 0);
    if (st != KVC_OK && st != KVC_ERR_NO_SPACE) goto fail;
    ids = malloc((size_t)(n_ids > 0 ? n_ids : 1) * sizeof(int32_t));
    if (!ids || TOKENIZE(ids, n_ids) != KVC_OK) goto fail;
#undef TOKENIZE
    if (n_ids == 0) {
        fprintf(stderr, "kvcache: run: the prompt has no tokens\n");
        goto done;
    }
    /* the context limit (the model's trained context unless -c): the library
     * refuses requests past it; -n is lowered to fit */
    kvc_model_info info;
    if (kvc_model_get_info(model, &info) != KVC_OK) goto fail;
    if (n_ids >= info.n_ctx) {
        fprintf(stderr, "kvcache: run: the prompt has %lld tokens; the context is %d (-c to "
                "change it)\n", (long long)n_ids, (int)info.n_ctx);
        goto done;
    }
    if (n_ids + n_predict > info.n_ctx) {
        n_predict = info.n_ctx - n_ids;
        if (!quiet)
            fprintf(stderr, "kvcache: run: -n lowered to %lld: the context is %d tokens\n",
                    (long long)n_predict, (int)info.n_ctx);
    }
    kvc_engine_params ep = kvc_engine_default_params();
    ep.n_threads = (int32_t)threads;
    ep.kv_dtype = (kvc_dtype)kv_dtype;
    ep.kv_capacity_tokens = n_ids + n_predict + 16;
    if (kvc_engine_create(model, &ep, &eng) != KVC_OK) goto fail;
    kvc_sampling_params sp = kvc_sampling_default_params();
    sp.temperature = (float)temp;
    sp.top_k = (int32_t)top_k;
    sp.top_p = (float)top_p;
    sp.seed = seed;
    int64_t rid;
    if (kvc_engine_add_request(eng, ids, n_ids, (int32_t)n_predict, &sp, ignore_eos, &rid) !=
        KVC_OK)
        goto fail;
    if (!chat) { /* echo the prompt, as llama.cpp does for plain completion */
        fwrite(prompt, 1, strlen(prompt), stdout);
        fflush(stdout);
    }
    double t_first = 0, t_start = bench_now();
    int64_t n_gen = 0;
    /* tokens may end inside a character: only complete UTF-8 is written, an
     * incomplete tail at the end becomes U+FFFD */
    kvc_utf8_stream u8;
    kvc_utf8_stream_init(&u8);
    char piece[256], utf8[3 * (256 + 4)];
    size_t plen = 0, ulen = 0;
    while (kvc_engine_pending(eng) > 0) {
        kvc_engine_event ev[1];
        int64_t ne = 0;
        if (kvc_engine_step(eng, ev, 1, &ne) != KVC_OK) goto fail;
        for (int64_t i = 0; i < ne; i++) {
            if (n_gen++ == 0) t_first = bench_now();
            if (ev[i].finish == KVC_FINISH_EOG) continue; /* not part of the text */
            if (kvc_token_to_piece(tok, ev[i].token, piece, sizeof piece, &plen) == KVC_OK &&
                kvc_utf8_stream_feed(&u8, piece, plen, utf8, sizeof utf8, &ulen) == KVC_OK)
                fwrite(utf8, 1, ulen, stdout);
            fflush(stdout);
        }
    }
    if (kvc_utf8_stream_flush(&u8, utf8, sizeof utf8, &ulen) == KVC_OK) fwrite(utf8, 1, ulen, stdout);
    const double t_end = bench_now();
    fputc('\n', stdout);
    if (!quiet) {
        const double pre = t_first - t_start, dec = t_end - t_first;
        fprintf(stderr,
                "\nkvcache: load %.2f s | prompt %lld tokens in %.3f s (%.1f tok/s) | "
                "generated %lld tokens in %.3f s (%.1f tok/s) | kv %s, %d threads\n",
                t_load, (long long)n_ids, pre, pre > 0 ? (double)n_ids / pre : 0.0,
                (long long)n_gen, dec, n_gen > 1 && dec > 0 ? (double)(n_gen - 1) / dec : 0.0,
                kvc_dtype_name((kvc_dtype)kv_dtype), (int)threads);
    }
    rc = CLI_EXIT_OK;
    goto done;
fail:
    fprintf(stderr, "kvcache: run: %s\n", kvc_last_error());
done:
    kvc_engine_destroy(eng);
    free(ids);
    kvc_model_destroy(model);
    return rc;
}
