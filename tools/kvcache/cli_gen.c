/*
 * Helpers of the generating commands (cli_gen.h): prompt files, model
 * loading, shared options, tokenization, prefill progress and one streamed
 * request through the engine.
 */
#define _POSIX_C_SOURCE 200809L /* isatty, access */

#include "cli_gen.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench.h" /* bench_now */
#include "cli.h"

const char *cli_file_name(const char *path) {
    return strcmp(path, "-") == 0 ? "standard input" : path;
}

static int too_big(const char *cmd, const char *path) {
    fprintf(stderr, "kvcache: %s: cannot read %s: larger than %zu MiB, the limit of an input "
            "(far past any model's context)\n", cmd, cli_file_name(path),
            CLI_MAX_INPUT_BYTES >> 20);
    return -1;
}

int cli_read_file(const char *cmd, const char *path, char **text, size_t *len) {
    const int is_stdin = strcmp(path, "-") == 0;
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvcache: %s: cannot read %s: %s\n", cmd, path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode) &&
        (uintmax_t)st.st_size > CLI_MAX_INPUT_BYTES) {
        if (!is_stdin) fclose(f);
        return too_big(cmd, path);
    }
    size_t n = 0, cap = 4096;
    char *buf = malloc(cap);
    int err = buf == NULL, read_errno = 0;
    while (!err) {
        if (n > CLI_MAX_INPUT_BYTES) { /* a pipe or a device: no size to check first */
            if (!is_stdin) fclose(f);
            free(buf);
            return too_big(cmd, path);
        }
        if (n + 1 == cap) { /* room for one byte past the limit, no more */
            const size_t nc = cap * 2 < CLI_MAX_INPUT_BYTES + 2 ? cap * 2
                                                                : CLI_MAX_INPUT_BYTES + 2;
            char *q = realloc(buf, nc);
            if (!q) {
                err = 1, read_errno = ENOMEM;
                break;
            }
            buf = q;
            cap = nc;
        }
        size_t got = fread(buf + n, 1, cap - 1 - n, f);
        n += got;
        if (got == 0) {
            err = ferror(f) != 0;
            read_errno = errno; /* "Is a directory", as perplexity says it */
            break;
        }
    }
    if (!is_stdin) fclose(f);
    if (err) {
        fprintf(stderr, "kvcache: %s: cannot read %s: %s\n", cmd, cli_file_name(path),
                !buf ? "out of memory" : read_errno ? strerror(read_errno) : "read error");
        free(buf);
        return -1;
    }
    buf[n] = '\0';
    *text = buf;
    *len = n;
    return 0;
}

int cli_read_prompt(const char *cmd, const char *path, char **text, size_t *len) {
    if (cli_read_file(cmd, path, text, len)) return -1;
    if (*len > 0 && (*text)[*len - 1] == '\n') (*text)[--*len] = '\0';
    return 0;
}

static void load_progress(float f, void *user) {
    int *last = user, pct = (int)(f * 100.0f + 0.5f);
    if (pct == *last) return; /* called per tensor: one line per percent */
    *last = pct;
    fprintf(stderr, "\rloading model: %3d%%", pct);
    if (f >= 1.0f) fputs("\r                    \r", stderr);
    fflush(stderr);
}

kvc_model *cli_load_model(const char *cmd, const char *path, int quiet, int64_t n_ctx,
                          int no_mmap) {
    kvc_model_params mp = kvc_model_default_params();
    mp.n_ctx = (int32_t)n_ctx;
    mp.use_mmap = !no_mmap;
    int last = -1;
    if (!quiet && isatty(2)) {
        mp.progress = load_progress;
        mp.progress_user = &last;
    }
    kvc_model *model = NULL;
    if (kvc_model_load(path, &mp, &model) != KVC_OK) {
        fprintf(stderr, "kvcache: %s: cannot load %s: %s\n", cmd, path, kvc_last_error());
        if (access(path, R_OK) != 0)
            fprintf(stderr, "kvcache: %s: fetch the default model with "
                            "'bash scripts/fetch_model.sh'\n", cmd);
        return NULL;
    }
    return model;
}

/* -n is listed by each command: its default differs */
const char cli_gen_opts_help[] =
    "  -m, --model PATH    GGUF model (default $KVCACHE_MODEL, else\n"
    "                      models/SmolLM2-135M-Instruct.Q4_1.gguf)\n"
    "  --temp T            temperature, 0 = greedy (default 0)\n"
    "  --top-k K           top-k filter when sampling (default 40, 0 = off)\n"
    "  --top-p P           nucleus filter when sampling (default 0.95, 1 = off)\n"
    "  --seed N            sampling seed (default 0)\n"
    "  --kv-dtype TYPE     KV cache storage: " CLI_KV_HELP " (default f16)\n"
    "  -t, --threads N     threads (default: the CPUs this process may run on)\n"
    "  --ignore-eos        keep generating after an end-of-generation token\n"
    CLI_NO_MMAP_HELP;

void cli_gen_opts_default(cli_gen_opts *o, int64_t n_predict) {
    memset(o, 0, sizeof *o);
    o->model_path = cli_default_model();
    o->n_predict = n_predict;
    o->threads = cli_online_cpus();
    o->top_k = 40;
    o->temp = 0.0;
    o->top_p = 0.95;
    o->kv_dtype = KVC_F16;
}

int cli_gen_opts_parse(const char *cmd, int argc, char **argv, int *i, cli_gen_opts *o) {
    const char *a = argv[*i];
    const char *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!strcmp(a, "--ignore-eos")) {
        o->ignore_eos = 1;
        return 1;
    }
    if (!strcmp(a, "--no-mmap")) {
        o->no_mmap = 1;
        return 1;
    }
    static const char *const with_value[] = {"-m",     "--model", "-n",     "--n-predict",
                                             "-t",     "--threads", "--seed", "--top-k",
                                             "--temp", "--top-p", "--kv-dtype"};
    int known = 0;
    for (size_t k = 0; k < sizeof with_value / sizeof with_value[0]; k++)
        known |= !strcmp(a, with_value[k]);
    if (!known) return 0;
    if (!v) return cli_usage_error(cmd, "%s needs a value", a);
    ++*i;
    if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
        if (cli_opt_path(cmd, a, v)) return CLI_EXIT_USAGE;
        o->model_path = v;
    } else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict")) {
        if (cli_opt_i64(cmd, a, v, 1, 1 << 20, &o->n_predict)) return CLI_EXIT_USAGE;
    } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
        if (cli_opt_i64(cmd, a, v, 1, 256, &o->threads)) return CLI_EXIT_USAGE;
        cli_warn_threads(cmd, a, o->threads);
    } else if (!strcmp(a, "--seed")) {
        if (cli_parse_u64(v, &o->seed))
            return cli_usage_error(cmd, "%s: expected an integer in [0, 2^64), got '%s'", a, v);
    } else if (!strcmp(a, "--top-k")) {
        if (cli_opt_i64(cmd, a, v, 0, 1 << 30, &o->top_k)) return CLI_EXIT_USAGE;
    } else if (!strcmp(a, "--temp")) {
        if (cli_parse_f64(v, &o->temp) || !(o->temp >= 0 && o->temp <= 100))
            return cli_usage_error(cmd, "--temp: expected a number in [0, 100], got '%s'", v);
    } else if (!strcmp(a, "--top-p")) {
        /* > 0 as the float the sampler gets, not only as a double */
        if (cli_parse_f64(v, &o->top_p) || !((float)o->top_p > 0 && o->top_p <= 1))
            return cli_usage_error(cmd, "--top-p: expected a number in (0, 1], got '%s'", v);
    } else { /* --kv-dtype */
        if (cli_parse_kv_dtype(v, &o->kv_dtype))
            return cli_usage_error(cmd, "--kv-dtype: expected one of " CLI_KV_HELP ", "
                                   "got '%s'", v);
    }
    return 1;
}

kvc_sampling_params cli_gen_sampling(const cli_gen_opts *o) {
    kvc_sampling_params sp = kvc_sampling_default_params();
    sp.temperature = (float)o->temp;
    sp.top_k = (int32_t)o->top_k;
    sp.top_p = (float)o->top_p;
    sp.seed = o->seed;
    return sp;
}

kvc_status cli_tokenize(const kvc_tokenizer *tok, const char *text, size_t len, int add_bos,
                        int parse_special, int32_t **ids, int64_t *n_ids) {
    *ids = NULL;
    /* len + 1 tokens always suffice (kvc_tokenize): one pass */
    int32_t *buf = malloc((len + 1) * sizeof(int32_t));
    if (!buf) return KVC_ERR_NOMEM;
    kvc_status st = kvc_tokenize(tok, text, len, add_bos, parse_special, buf, (int64_t)len + 1,
                                 n_ids);
    if (st != KVC_OK) {
        free(buf);
        return st;
    }
    *ids = buf;
    return KVC_OK;
}

kvc_status cli_chat_tokens(const kvc_tokenizer *tok, const char *tmpl,
                           const kvc_chat_message *msgs, int64_t n_msgs, int special,
                           int32_t **ids, int64_t *n_ids) {
    *ids = NULL;
    const int add_bos = kvc_tokenizer_add_bos(tok);
    int64_t need = 0;
    kvc_status st = kvc_chat_tokenize(tok, tmpl, msgs, n_msgs, 1, add_bos, special, NULL, 0, &need);
    if (st != KVC_OK && st != KVC_ERR_NO_SPACE) return st;
    int32_t *buf = malloc((size_t)(need > 0 ? need : 1) * sizeof(int32_t));
    if (!buf) return KVC_ERR_NOMEM;
    st = kvc_chat_tokenize(tok, tmpl, msgs, n_msgs, 1, add_bos, special, buf, need, n_ids);
    if (st != KVC_OK) {
        free(buf);
        return st;
    }
    *ids = buf;
    return KVC_OK;
}

void cli_progress_begin(cli_progress *p, const char *label, int64_t to_compute, int64_t total,
                        int quiet) {
    p->on = !quiet && to_compute >= CLI_PROGRESS_MIN_TOKENS && isatty(2);
    p->total = total;
    p->label = label;
}

void cli_progress_update(cli_progress *p, int64_t done) {
    if (!p->on) return;
    fprintf(stderr, "\r%s: %lld / %lld tokens (%d%%)", p->label, (long long)done,
            (long long)p->total, p->total > 0 ? (int)(100 * done / p->total) : 100);
    fflush(stderr);
}

void cli_progress_end(cli_progress *p) {
    if (!p->on) return;
    fputs("\r\033[K", stderr);
    fflush(stderr);
    p->on = 0;
}

/* Valid UTF-8 bytes to out (and *keep). */
static void emit_bytes(const char *b, size_t n, FILE *out, char **keep, size_t *keep_len,
                       int *nomem) {
    fwrite(b, 1, n, out);
    if (keep && !*nomem) {
        char *q = realloc(*keep, *keep_len + n + 1);
        if (!q) {
            *nomem = 1;
            return;
        }
        memcpy(q + *keep_len, b, n);
        *keep_len += n;
        q[*keep_len] = '\0';
        *keep = q;
    }
}

/* A token's bytes through the UTF-8 stream: a character whose bytes span
 * tokens is written once complete, ill-formed bytes as U+FFFD. */
static void emit_token(const kvc_tokenizer *tok, int32_t id, kvc_utf8_stream *u8, FILE *out,
                       char **keep, size_t *keep_len, int *nomem) {
    char piece[256], text[3 * (256 + 4)]; /* kvc_utf8_stream_bound(256) */
    size_t plen = 0, tlen = 0;
    if (kvc_token_to_piece(tok, id, piece, sizeof piece, &plen) != KVC_OK ||
        kvc_utf8_stream_feed(u8, piece, plen, text, sizeof text, &tlen) != KVC_OK)
        return;
    emit_bytes(text, tlen, out, keep, keep_len, nomem);
}

int cli_generate(const char *cmd, kvc_engine *eng, const kvc_tokenizer *tok, const int32_t *ids,
                 int64_t n_ids, int32_t n_predict, const kvc_sampling_params *sp, int ignore_eos,
                 int quiet, const char *echo, size_t echo_len, FILE *out, char **keep,
                 size_t *keep_len, cli_gen_result *res) {
    memset(res, 0, sizeof *res);
    res->n_prompt = n_ids;
    kvc_engine_stats s0, s;
    int64_t hit = 0, rid;
    if (kvc_engine_get_stats(eng, &s0) != KVC_OK ||
        kvc_cache_lookup_prefix(kvc_engine_cache(eng), ids, n_ids, 0, &hit) != KVC_OK ||
        kvc_engine_add_request(eng, ids, n_ids, n_predict, sp, ignore_eos, &rid) != KVC_OK) {
        fprintf(stderr, "kvcache: %s: %s\n", cmd, kvc_last_error());
        return -1;
    }
    cli_progress pr;
    cli_progress_begin(&pr, "prompt", n_ids - hit, n_ids, quiet);
    cli_progress_update(&pr, hit);
    const double t0 = bench_now();
    double t_first = t0;
    int nomem = 0;
    kvc_utf8_stream u8;
    kvc_utf8_stream_init(&u8);
    while (kvc_engine_pending(eng) > 0) {
        kvc_engine_event ev[1];
        int64_t ne = 0;
        if (kvc_engine_step(eng, ev, 1, &ne) != KVC_OK) {
            cli_progress_end(&pr);
            fprintf(stderr, "kvcache: %s: %s\n", cmd, kvc_last_error());
            kvc_engine_cancel(eng, rid); /* the engine is reused (chat): leave it empty */
            return -1;
        }
        kvc_engine_get_stats(eng, &s);
        if (ne == 0) {
            /* prompt rows computed so far, on top of the cached ones */
            cli_progress_update(&pr, s.cached_tokens - s0.cached_tokens + s.prefill_tokens -
                                         s0.prefill_tokens);
            continue;
        }
        if (res->n_gen++ == 0) {
            t_first = bench_now();
            cli_progress_end(&pr);
            res->n_reused = s.cached_tokens - s0.cached_tokens;
            if (echo) fwrite(echo, 1, echo_len, out); /* all of it: a NUL byte included */
        }
        res->finish = ev[0].finish;
        if (ev[0].finish != KVC_FINISH_EOG)
            emit_token(tok, ev[0].token, &u8, out, keep, keep_len, &nomem);
        /* a full disk or a closed pipe (SIGPIPE ignored) stops the generation
         * and fails the command; main's last fflush finds nothing left */
        if (fflush(out) != 0 || ferror(out)) {
            fprintf(stderr, "kvcache: %s: cannot write the output: %s\n", cmd, strerror(errno));
            kvc_engine_cancel(eng, rid);
            return -1;
        }
    }
    char tail[4];
    size_t tail_len = 0;
    if (kvc_utf8_stream_flush(&u8, tail, sizeof tail, &tail_len) == KVC_OK && tail_len > 0) {
        emit_bytes(tail, tail_len, out, keep, keep_len, &nomem);
        fflush(out);
    }
    res->t_prefill = t_first - t0;
    res->t_decode = bench_now() - t_first;
    if (nomem) {
        fprintf(stderr, "kvcache: %s: out of memory\n", cmd);
        return -1;
    }
    return 0;
}
