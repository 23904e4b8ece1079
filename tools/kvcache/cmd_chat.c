/*
 * `kvcache chat`: multi-turn chat with a GGUF model, one user message per
 * line of standard input (a terminal or a pipe), replies streamed to stdout.
 *
 * One engine lives for the whole conversation. Each turn renders the whole
 * conversation with the chat template (add_generation_prompt) and submits it
 * as one request; the previous turns' pages (prompt and generated reply)
 * stay in the prefix cache when that request ends, so only the new message
 * and the tokens where the re-rendered reply differs from the generated one
 * are computed. --verbose prints how many prompt tokens each turn reused.
 */
#define _POSIX_C_SOURCE 200809L /* isatty, ssize_t, getc_unlocked */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "cli_gen.h"
#include "cli_store.h"
#include "kvcache/kvcache.h"

static const char chat_usage_head[] =
    "usage: kvcache chat [-m MODEL] [options]\n"
    "\n"
    "Chats with the model: each line of standard input is a user message (from a\n"
    "terminal or a pipe); each reply streams to stdout, followed by a newline.\n"
    "The conversation stays in the KV cache between turns: a turn's prompt is the\n"
    "whole conversation rendered by the chat template, and the prefix cache serves\n"
    "the part earlier turns computed.\n"
    "\n"
    "lines of their own:\n"
    "  /exit               quit (so does the end of input)\n"
    "  /reset              start a new conversation (the system message stays)\n"
    "\n"
    "A message that would take the conversation past the context (-c) is dropped,\n"
    "said on stderr; the exit status is 1 when messages came and none was answered.\n"
    "\n"
    "options:\n"
    "  -s, --system TEXT   system message (also -sys, --system-prompt)\n"
    "  --system-file FILE  system message read from FILE, one trailing newline\n"
    "                      dropped (also -sysf, --system-prompt-file)\n"
    "  --chat-template F   Jinja chat template read from file F instead of the model's\n"
    "                      (also --chat-template-file)\n"
    "  -c, --ctx-size N    conversation tokens the cache holds (default 4096; lowered\n"
    "                      to the model's trained context, said on stderr)\n"
    "  --special           control-token text typed in a message becomes control\n"
    "                      tokens (default: plain text)\n";
static const char chat_usage_tail[] =
    "  -n, --n-predict N   tokens per reply at most (default 512; lowered to fit the\n"
    "                      context)\n"
    "  -v, --verbose       after each reply, on stderr: 'reused N of M prompt tokens'\n"
    "                      (served by the prefix cache) and timings\n"
    "  -q, --quiet         no load or prompt progress on stderr\n"
    "  -h, --help          this text\n";

typedef struct conv {
    kvc_chat_message *m;
    char **owned; /* contents this conversation allocated (NULL: not owned) */
    int64_t n, cap;
} conv;

static int conv_push(conv *c, const char *role, char *content, int owned) {
    if (c->n == c->cap) {
        int64_t nc = c->cap ? 2 * c->cap : 8;
        kvc_chat_message *m = realloc(c->m, (size_t)nc * sizeof *m);
        if (m) c->m = m;
        char **o = realloc(c->owned, (size_t)nc * sizeof *o);
        if (o) c->owned = o;
        if (!m || !o) return -1;
        c->cap = nc;
    }
    c->m[c->n] = (kvc_chat_message){role, content};
    c->owned[c->n] = owned ? content : NULL;
    c->n++;
    return 0;
}

static void conv_truncate(conv *c, int64_t n) {
    while (c->n > n) free(c->owned[--c->n]);
}

/* A line of f, its '\n' dropped, into *line (NUL-terminated; *cap bytes):
 * its length; -1 at the end of input or on a read error (ferror tells);
 * -2 when memory runs out; -3 past CLI_MAX_INPUT_BYTES, the rest of it left
 * unread (getline took all of `chat < /dev/zero`, one endless line, until
 * memory ran out). */
static ssize_t read_line(FILE *f, char **line, size_t *cap) {
    size_t n = 0;
    int ch;
    if (*cap == 0) { /* an empty line needs its NUL */
        if (!(*line = malloc(256))) return -2;
        *cap = 256;
    }
    while ((ch = getc_unlocked(f)) != EOF && ch != '\n') { /* one reader: no lock a byte */
        if (n == CLI_MAX_INPUT_BYTES) return -3;
        if (n + 2 > *cap) {
            size_t nc = 2 * *cap;
            if (nc > CLI_MAX_INPUT_BYTES + 1) nc = CLI_MAX_INPUT_BYTES + 1;
            char *q = realloc(*line, nc);
            if (!q) return -2;
            *line = q;
            *cap = nc;
        }
        (*line)[n++] = (char)ch;
    }
    if (ch == EOF && (n == 0 || ferror(f))) return -1;
    (*line)[n] = '\0';
    return (ssize_t)n;
}

static int nomem(void) {
    fprintf(stderr, "kvcache: chat: out of memory\n");
    return CLI_EXIT_FAIL;
}

int cmd_chat(int argc, char **argv) {
    const char *cmd = "chat";
    const char *system = NULL, *system_file = NULL, *tmpl_file = NULL;
    int verbose = 0, special = 0;
    int64_t ctx_size = 4096;
    cli_gen_opts o;
    cli_gen_opts_default(&o, 512);
    cli_store_opts so;
    cli_store_opts_default(&so);
    kvc_store *store = NULL;
    double ttft = 0, dec_tok = 0, dec_s = 0; /* --json-stats: first turn's TTFT, mean decode */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (cli_is_help(a)) {
            fputs(chat_usage_head, stdout);
            fputs(cli_gen_opts_help, stdout);
            fputs(cli_store_opts_help, stdout);
            fputs(chat_usage_tail, stdout);
            return CLI_EXIT_OK;
        }
        const int g = cli_gen_opts_parse(cmd, argc, argv, &i, &o);
        if (g > 1) return g;
        if (g == 1) continue;
        const int sg = cli_store_opts_parse(cmd, argc, argv, &i, &so);
        if (sg > 1) return sg;
        if (sg == 1) continue;
        if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) {
            verbose = 1;
            continue;
        }
        if (!strcmp(a, "--special")) {
            special = 1;
            continue;
        }
        if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) {
            o.quiet = 1;
            continue;
        }
        /* llama.cpp's spellings too */
        const char **dst = !strcmp(a, "-s") || !strcmp(a, "--system") || !strcmp(a, "-sys") ||
                                   !strcmp(a, "--system-prompt")
                               ? &system
                           : !strcmp(a, "--system-file") || !strcmp(a, "-sysf") ||
                                   !strcmp(a, "--system-prompt-file")
                               ? &system_file
                           : !strcmp(a, "--chat-template") || !strcmp(a, "--chat-template-file")
                               ? &tmpl_file
                               : NULL;
        const int is_ctx = !strcmp(a, "-c") || !strcmp(a, "--ctx-size");
        if (!dst && !is_ctx) return cli_usage_error(cmd, "unexpected argument '%s'", a);
        if (!v) return cli_usage_error(cmd, "%s needs a value", a);
        i++;
        if (dst && dst != &system && cli_opt_path(cmd, a, v)) return CLI_EXIT_USAGE;
        if (dst)
            *dst = v;
        else if (cli_opt_i64(cmd, a, v, 16, 1 << 20, &ctx_size))
            return CLI_EXIT_USAGE;
    }
    if (cli_store_opts_check(cmd, &so)) return CLI_EXIT_USAGE;
    if (system && system_file) return cli_usage_error(cmd, "give --system or --system-file");
    if ((system_file && cli_is_stdin(system_file)) || (tmpl_file && cli_is_stdin(tmpl_file)))
        return cli_usage_error(cmd, "standard input carries the messages: name a file");

    int rc = CLI_EXIT_FAIL;
    char *sys_text = NULL, *tmpl = NULL, *line = NULL;
    size_t len = 0, line_cap = 0;
    conv c = {0};
    kvc_model *model = NULL;
    kvc_engine *eng = NULL;
    if (system_file) {
        if (cli_read_prompt(cmd, system_file, &sys_text, &len)) goto done;
        system = sys_text;
    }
    if (tmpl_file && cli_read_file(cmd, tmpl_file, &tmpl, &len)) goto done;
    if (!(model = cli_load_model(cmd, o.model_path, o.quiet, 0, o.no_mmap))) goto done;
    const kvc_tokenizer *tok = kvc_model_tokenizer(model);
    kvc_model_info info;
    if (kvc_model_get_info(model, &info) != KVC_OK) goto fail;
    /* positions past the trained context are RoPE angles the model never saw */
    if (ctx_size > info.n_ctx_train) {
        ctx_size = info.n_ctx_train;
        if (!o.quiet) /* said, as run says -n lowered, so that messages' context adds up */
            fprintf(stderr, "kvcache: chat: -c lowered to %lld: the model's trained context\n",
                    (long long)ctx_size);
    }
    {   /* a template that cannot render fails now, not at the first message */
        kvc_chat_message probe[2] = {{"system", system ? system : ""}, {"user", "hi"}};
        int32_t *ids = NULL;
        int64_t n = 0;
        kvc_status st = cli_chat_tokens(tok, tmpl, probe + (system ? 0 : 1), system ? 2 : 1,
                                        special, &ids, &n);
        free(ids);
        if (st != KVC_OK) goto fail;
        if (n == 0) { /* an empty template: every turn would fail in the engine */
            fprintf(stderr, "kvcache: chat: the chat template renders a message as no tokens\n");
            goto done;
        }
    }
    kvc_engine_params ep = kvc_engine_default_params();
    ep.n_threads = (int32_t)o.threads;
    ep.kv_dtype = cli_kv_dtype(o.kv_dtype);
    ep.kv_format = cli_kv_format(o.kv_dtype);
    ep.kv_capacity_tokens = ctx_size;
    ep.max_running = 1;
    if (kvc_engine_create(model, &ep, &eng) != KVC_OK) goto fail;
    if (cli_store_attach(cmd, &so, o.model_path, model, eng, &store)) {
        rc = CLI_EXIT_FAIL;
        goto done;
    }
    /* the limit is -c as given (or the trained context), as run's -c is, not
     * the cache's capacity, which whole pages round up */
    const int64_t cap = ctx_size;
    if (system && conv_push(&c, "system", (char *)system, 0)) {
        rc = nomem();
        goto done;
    }
    const int64_t n_keep = c.n;
    const int interactive = isatty(0);
    const kvc_sampling_params sp = cli_gen_sampling(&o);
    rc = CLI_EXIT_OK;
    int64_t turn = 0, dropped = 0;
    for (;;) {
        if (interactive) {
            fputs("> ", stdout);
            fflush(stdout);
        }
        errno = 0;
        ssize_t got = read_line(stdin, &line, &line_cap);
        if (got == -2) {
            rc = nomem();
            break;
        }
        if (got == -3) {
            fprintf(stderr, "kvcache: chat: cannot read standard input: a line longer than %zu "
                    "MiB, the limit of a message (far past any model's context)\n",
                    CLI_MAX_INPUT_BYTES >> 20);
            rc = CLI_EXIT_FAIL;
            break;
        }
        if (got < 0 && ferror(stdin)) { /* e.g. a directory: not the end of the input */
            fprintf(stderr, "kvcache: chat: cannot read standard input: %s\n",
                    errno ? strerror(errno) : "read error");
            rc = CLI_EXIT_FAIL;
            break;
        }
        if (got < 0) { /* end of input */
            if (interactive) fputc('\n', stdout); /* after the "> " of a Ctrl-D */
            break;
        }
        size_t n = strcspn(line, "\r\n");
        line[n] = '\0';
        if (n == 0) continue;
        if (!strcmp(line, "/exit")) break;
        if (!strcmp(line, "/reset")) {
            conv_truncate(&c, n_keep);
            if (verbose || interactive) fputs("kvcache: chat: conversation reset\n", stderr);
            continue;
        }
        turn++;
        char *msg = strdup(line);
        if (!msg || conv_push(&c, "user", msg, 1)) {
            free(msg);
            rc = nomem();
            break;
        }
        int32_t *ids = NULL;
        int64_t n_ids = 0;
        if (cli_chat_tokens(tok, tmpl, c.m, c.n, special, &ids, &n_ids) != KVC_OK) {
            fprintf(stderr, "kvcache: chat: %s\n", kvc_last_error());
            rc = CLI_EXIT_FAIL;
            break;
        }
        if (n_ids >= cap) {
            /* the message is dropped; the conversation so far stays usable
             * (and the turn is not one: --verbose numbers, the first TTFT) */
            free(ids);
            conv_truncate(&c, c.n - 1);
            turn--;
            dropped++;
            fprintf(stderr, "kvcache: chat: the conversation would hold %lld tokens, the "
                            "context %lld: %s\n",
                    (long long)n_ids, (long long)cap,
                    c.n > n_keep ? "/reset to start a new one"
                                 : "a shorter message, or -c to change the context");
            continue;
        }
        const int64_t room = cap - n_ids;
        const int32_t n_predict = (int32_t)(o.n_predict < room ? o.n_predict : room);
        char *reply = NULL;
        size_t reply_len = 0;
        cli_gen_result r;
        int bad = cli_generate(cmd, eng, tok, ids, n_ids, n_predict, &sp, o.ignore_eos, o.quiet,
                               NULL, 0, stdout, &reply, &reply_len, &r);
        free(ids);
        fputc('\n', stdout);
        fflush(stdout);
        if (bad) {
            free(reply);
            rc = CLI_EXIT_FAIL;
            break;
        }
        if (turn == 1) ttft = r.t_prefill;
        if (r.n_gen > 1) dec_tok += (double)(r.n_gen - 1), dec_s += r.t_decode;
        if (!reply) reply = strdup(""); /* an empty reply (EOG first) is still a turn */
        if (!reply || conv_push(&c, "assistant", reply, 1)) {
            free(reply);
            rc = nomem();
            break;
        }
        if (verbose)
            fprintf(stderr,
                    "kvcache: chat: turn %lld: reused %lld of %lld prompt tokens | prompt %.3f s "
                    "| generated %lld tokens in %.3f s%s\n",
                    (long long)turn, (long long)r.n_reused, (long long)r.n_prompt, r.t_prefill,
                    (long long)r.n_gen, r.t_decode,
                    r.finish == KVC_FINISH_LENGTH ? " (stopped at -n)" : "");
    }
    /* messages came and none could be answered (each past the context): the
     * session failed, as run does for a prompt past its context; a session
     * with answers keeps 0, its dropped messages said on stderr */
    if (rc == CLI_EXIT_OK && turn == 0 && dropped > 0) rc = CLI_EXIT_FAIL;
    cli_store_finish(cmd, &so, store, eng, ttft, dec_s > 0 ? dec_tok / dec_s : 0.0, 60.0);
    goto done;
fail:
    fprintf(stderr, "kvcache: chat: %s\n", kvc_last_error());
done:
    conv_truncate(&c, 0);
    free(c.m);
    free(c.owned);
    free(line);
    cli_store_detach(store, eng);
    kvc_engine_destroy(eng);
    cli_store_close(store);
    kvc_model_destroy(model);
    free(sys_text);
    free(tmpl);
    return rc;
}
