/*
 * `kvcache run -m MODEL -p PROMPT`: generates text with a GGUF model through
 * the engine (one request), streaming the tokens to stdout as they come.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h" /* bench_now */
#include "cli.h"
#include "cli_gen.h"
#include "cli_store.h"
#include "kvcache/kvcache.h"

static const char run_usage_head[] =
    "usage: kvcache run [-m MODEL] (-p PROMPT | -f FILE) [options]\n"
    "\n"
    "Generates a continuation of PROMPT (or, with --chat, an assistant reply) and\n"
    "streams it to stdout. Timings go to stderr, and so does a progress line while\n"
    "a long prompt is computed when stderr is a terminal.\n"
    "\n"
    "options:\n"
    "  -p, --prompt TEXT   prompt text\n"
    "  -f, --file FILE     prompt read from FILE ('-': standard input; one trailing\n"
    "                      newline dropped; at most 256 MiB)\n"
    "  --chat              apply the model's chat template (PROMPT is the user turn)\n"
    "  --system TEXT       system message for --chat\n"
    "  --chat-template F   Jinja chat template read from file F instead of the model's\n"
    "                      (also --chat-template-file)\n"
    "  --special           control-token text in the prompt (or in --chat message\n"
    "                      contents) becomes control tokens; default: plain text\n";
static const char run_usage_tail[] =
    "  -n, --n-predict N   tokens to generate at most (default 128; lowered to fit the\n"
    "                      context with the prompt)\n"
    "  -c, --ctx-size N    context limit in tokens (default 0: the model's trained\n"
    "                      context, e.g. 8192; past it RoPE positions were never trained)\n"
    "  -q, --quiet         no load progress, prompt progress or timings on stderr\n"
    "  -h, --help          this text\n"
    "\n"
    "Exit status: 0, 1 when the generation fails, 2 for a bad command line or a\n"
    "prompt that does not fit the context (-c), found once the model is loaded.\n";

int cmd_run(int argc, char **argv) {
    const char *cmd = "run";
    const char *prompt = NULL, *prompt_file = NULL, *system = NULL, *tmpl_file = NULL;
    int chat = 0, special = 0;
    int64_t n_ctx = 0;
    cli_gen_opts o;
    cli_gen_opts_default(&o, 128);
    cli_store_opts so;
    cli_store_opts_default(&so);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (cli_is_help(a)) {
            fputs(run_usage_head, stdout);
            fputs(cli_gen_opts_help, stdout);
            fputs(cli_store_opts_help, stdout);
            fputs(run_usage_tail, stdout);
            return CLI_EXIT_OK;
        }
        const int g = cli_gen_opts_parse(cmd, argc, argv, &i, &o);
        if (g > 1) return g;
        if (g == 1) continue;
        const int sg = cli_store_opts_parse(cmd, argc, argv, &i, &so);
        if (sg > 1) return sg;
        if (sg == 1) continue;
        const char **dst = !strcmp(a, "-p") || !strcmp(a, "--prompt") ? &prompt
                           : !strcmp(a, "-f") || !strcmp(a, "--file") ? &prompt_file
                           : !strcmp(a, "--system")                     ? &system
                           : !strcmp(a, "--chat-template") ||
                                     !strcmp(a, "--chat-template-file")
                               ? &tmpl_file
                                                                        : NULL;
        if (dst) {
            if (!v) return cli_usage_error(cmd, "%s needs a value", a);
            /* -p and --system are text: '' is an empty one, not a file name */
            if (dst != &system && dst != &prompt && cli_opt_path(cmd, a, v))
                return CLI_EXIT_USAGE;
            *dst = v;
            i++;
        } else if (!strcmp(a, "--chat")) {
            chat = 1;
        } else if (!strcmp(a, "--special")) {
            special = 1;
        } else if (!strcmp(a, "-c") || !strcmp(a, "--ctx-size")) {
            if (!v) return cli_usage_error(cmd, "%s needs a value", a);
            if (cli_opt_i64(cmd, a, v, 0, INT32_MAX, &n_ctx)) return CLI_EXIT_USAGE;
            i++;
        } else if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) {
            o.quiet = 1;
        } else {
            return cli_usage_error(cmd, "unexpected argument '%s'", a);
        }
    }
    if (cli_store_opts_check(cmd, &so)) return CLI_EXIT_USAGE;
    if (prompt && prompt_file) return cli_usage_error(cmd, "give -p or -f, not both");
    if (!prompt && !prompt_file)
        return cli_usage_error(cmd, "a prompt is required (-p TEXT or -f FILE)");
    if (system && !chat) return cli_usage_error(cmd, "--system needs --chat");
    if (tmpl_file && !chat) return cli_usage_error(cmd, "--chat-template needs --chat");
    if (prompt_file && tmpl_file && cli_is_stdin(prompt_file) && cli_is_stdin(tmpl_file))
        return cli_usage_error(cmd, "-f and --chat-template cannot both read standard input");

    int rc = CLI_EXIT_FAIL;
    char *file_text = NULL, *tmpl = NULL;
    size_t plen = prompt ? strlen(prompt) : 0, tmpl_len = 0;
    int32_t *ids = NULL;
    kvc_engine *eng = NULL;
    kvc_model *model = NULL;
    kvc_store *store = NULL;
    if (prompt_file) {
        if (cli_read_prompt(cmd, prompt_file, &file_text, &plen)) return CLI_EXIT_FAIL;
        prompt = file_text;
    }
    if (tmpl_file && cli_read_file(cmd, tmpl_file, &tmpl, &tmpl_len)) goto done;
    const double t0 = bench_now();
    if (!(model = cli_load_model(cmd, o.model_path, o.quiet, n_ctx, o.no_mmap))) goto done;
    const double t_load = bench_now() - t0;
    const kvc_tokenizer *tok = kvc_model_tokenizer(model);
    int64_t n_ids = 0;
    if (chat) {
        /* a file's content is the user message as written (NULs end it) */
        kvc_chat_message msgs[2];
        int nm = 0;
        if (system) msgs[nm++] = (kvc_chat_message){"system", system};
        msgs[nm++] = (kvc_chat_message){"user", prompt};
        if (cli_chat_tokens(tok, tmpl, msgs, nm, special, &ids, &n_ids) != KVC_OK) goto fail;
    } else if (cli_tokenize(tok, prompt, plen, kvc_tokenizer_add_bos(tok), special, &ids,
                            &n_ids) != KVC_OK) {
        goto fail;
    }
    /* the prompt does not fit the options (-c), as bench-serve and
     * perplexity say: a command-line error, found once the model is loaded */
    if (n_ids == 0) {
        rc = cli_usage_error(cmd, "the prompt has no tokens");
        goto done;
    }
    /* the context limit (the model's trained context unless -c): the library
     * refuses requests past it; -n is lowered to fit */
    kvc_model_info info;
    if (kvc_model_get_info(model, &info) != KVC_OK) goto fail;
    if (n_ids >= info.n_ctx) {
        rc = cli_usage_error(cmd, "the prompt has %lld tokens; the context is %d (-c to change "
                             "it)", (long long)n_ids, (int)info.n_ctx);
        goto done;
    }
    if (n_ids + o.n_predict > info.n_ctx) {
        o.n_predict = info.n_ctx - n_ids;
        if (!o.quiet)
            fprintf(stderr, "kvcache: run: -n lowered to %lld: the context is %d tokens\n",
                    (long long)o.n_predict, (int)info.n_ctx);
    }
    kvc_engine_params ep = kvc_engine_default_params();
    ep.n_threads = (int32_t)o.threads;
    ep.kv_dtype = cli_kv_dtype(o.kv_dtype);
    ep.kv_format = cli_kv_format(o.kv_dtype);
    ep.kv_capacity_tokens = n_ids + o.n_predict + 16;
    if (kvc_engine_create(model, &ep, &eng) != KVC_OK) goto fail;
    if (cli_store_attach(cmd, &so, o.model_path, model, eng, &store)) goto done;
    const kvc_sampling_params sp = cli_gen_sampling(&o);
    cli_gen_result r;
    /* plain completion echoes the prompt, as llama.cpp does; it is printed
     * once the prompt is computed, below the progress line */
    if (cli_generate(cmd, eng, tok, ids, n_ids, (int32_t)o.n_predict, &sp, o.ignore_eos, o.quiet,
                     chat ? NULL : prompt, chat ? 0 : plen, stdout, NULL, NULL, &r))
        goto done;
    fputc('\n', stdout);
    fflush(stdout);
    /* the pages this run computed are written before it exits */
    cli_store_finish(cmd, &so, store, eng, r.t_prefill,
                     r.n_gen > 1 && r.t_decode > 0 ? (double)(r.n_gen - 1) / r.t_decode : 0.0,
                     60.0);
    if (!o.quiet) {
        fprintf(stderr,
                "\nkvcache: load %.2f s | prompt %lld tokens in %.3f s (%.1f tok/s) | "
                "generated %lld tokens in %.3f s (%.1f tok/s) | kv %s, %d threads\n",
                t_load, (long long)n_ids, r.t_prefill,
                r.t_prefill > 0 ? (double)n_ids / r.t_prefill : 0.0, (long long)r.n_gen,
                r.t_decode, r.n_gen > 1 && r.t_decode > 0 ? (double)(r.n_gen - 1) / r.t_decode
                                                          : 0.0,
                cli_kv_name(o.kv_dtype), (int)o.threads);
    }
    rc = CLI_EXIT_OK;
    goto done;
fail:
    fprintf(stderr, "kvcache: run: %s\n", kvc_last_error());
done:
    cli_store_detach(store, eng);
    kvc_engine_destroy(eng);
    cli_store_close(store);
    free(ids);
    free(file_text);
    free(tmpl);
    kvc_model_destroy(model);
    return rc;
}
