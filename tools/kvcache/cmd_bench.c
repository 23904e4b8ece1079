/*
 * `kvcache bench [TARGET] [options]`: parses the options shared by every
 * benchmark target into a bench_opts and runs the target. Without a target
 * (or when the first argument is an option) the target is pmx.
 */
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"

static const char bench_usage[] =
    "usage: kvcache bench [TARGET] [options]\n"
    "\n"
    "targets:\n"
    "  pmx     OpenPPL KeyValueCache operators (static and dynamic batching): store\n"
    "          one new token per sequence and read the whole cache back (default)\n"
    "  append  kvc_append_paged_kv_cache (FlashInfer paged layout, NHD, page_size 16):\n"
    "          decode-like (--batch requests x 1 token, default 256) and prefill-like\n"
    "          (4 requests x --kvlen tokens, default 2048) appends, f16 and int8\n"
    "          caches by default\n"
    "  cache   cache manager (kvcache/cache.h): add/append/fork/free ops per second,\n"
    "          prefix lookup tokens per second, KV slot use on a synthetic serving\n"
    "          trace vs reserving max length, decode-step bookkeeping (B = 64) vs\n"
    "          the time to read the batch's K/V (uses --quick, --json, --threads)\n"
    "  attention  decode attention (kvc_decode_run) over paged f16/int8/int4 caches\n"
    "          and kvc_kvfmt_attention over kivi8/kivi4 pages: time per layer, K/V\n"
    "          read bandwidth against a plain read and the FMA peak, speed against\n"
    "          float16\n"
    "  prefill kvc_prefill_run_paged, GFLOP/s against the FMA peak\n"
    "  mla     kvc_mla_run (MLA decode over ckv/kpe pages)\n"
    "  gemm    the model runtime's weight-type matrix products\n"
    "  kernel  decode kernels alone (one thread, no driver): ns per 16 keys and\n"
    "          head set for f16/int8/int4 rows of L 64, 512 and 4096 keys (Dh 128,\n"
    "          H 8: 256 KiB, 2 MiB, 16 MiB of float16 K/V; int8 half), int8/int4\n"
    "          speed against the float16 kernel\n"
    "  store   the KV store's data path (own options: kvcache bench store --help)\n"
    "\n";
/* in two: C11 compilers need only take 4095-character strings */
static const char bench_usage_options[] =
    "options (the defaults are pmx's; attention, prefill, mla and kernel sweep their\n"
    "own sets of shapes, batches and lengths unless an option fixes one):\n"
    "  --threads LIST    comma-separated thread counts, each run in turn (default 1,2)\n"
    "  --batch N         sequences B (default 16; append: decode requests, 256;\n"
    "                    gemm: rows n of X, at most 128)\n"
    "  --kvlen N         positions per sequence after the step, new token included\n"
    "                    (default 2048; append: prefill tokens per request, 2048)\n"
    "  --heads N         KV heads H (default 8; attention, prefill and kernel: with\n"
    "                    4 query heads each; mla: query heads)\n"
    "  --head-dim N      head dimension Dh (default 128), a multiple of 8 (pmx, append);\n"
    "                    attention and prefill: at most 512 and a multiple of the\n"
    "                    int8/int4 quant group (attention: --group, default 32;\n"
    "                    prefill: 32), attention's kivi4 a power of two; kernel: a\n"
    "                    multiple of 16 and of --group, at most 512; mla: 512 only\n"
    "  --group N|row     attention, kernel: int8/int4 quant group (default 32),\n"
    "                    dividing Dh; row: one scale per head row (group = Dh\n"
    "                    of each shape)\n"
    "  --layers N        attention: N caches of the same shape, one per layer, the\n"
    "                    calls taking them in turn as a model's decode step does\n"
    "                    (default 1: every call reads the same, cache-warm K/V);\n"
    "                    fewer where N caches would pass the case limit\n"
    "  --soft-cap X      attention: logits_soft_cap X > 0 (default none)\n"
    "  --cache LIST      cache types among f16,int8,int4 (default: pmx all, append\n"
    "                    f16,int8), and kivi8,kivi4 for attention (its default: all);\n"
    "                    in attention int8/int4 are kivi8/kivi4 (as --kv-dtype) and\n"
    "                    int8-token/int4-token the per-token caches\n"
    "  --op LIST         pmx operators among static,dynamic (default both)\n"
    "  --layout LIST     pmx cache layouts among 0,1,2,3 (default: static 0,1;\n"
    "                    dynamic 0,3); attention: paged layouts among nhd,hnd\n"
    "                    (default nhd)\n"
    "  --mode LIST       pmx dynamic cache modes among offset,paged (default both)\n"
    "  --time SECONDS    time budget per case (default 0.3)\n"
    "  --quick           tiny sizes and budgets: a smoke test, not a measurement\n"
    "                    (cases limited to 256 MiB, not 6 GiB; sizes whose largest\n"
    "                    case needs more are refused before any runs, either way)\n"
    "  --isa NAME        run the kernels with NAME: scalar, avx2, avx512, amx\n"
    "  --json            one JSON object per line instead of a table\n"
    "  -h, --help        this text\n"
    "\n"
    "Each case reports microseconds per call (median of samples after warm-up),\n"
    "bytes moved per call (read + written), GB/s (1e9 bytes/s), and the ratio to\n"
    "the memcpy bandwidth measured in the same run with as many threads (memcpy\n"
    "counted as read + write, i.e. 2x the bytes copied).\n";

/* Splits a comma-separated list; calls item() on each piece. -1 on error. */
static int parse_threads(const char *s, bench_opts *o) {
    o->n_thread_counts = 0;
    const char *p = s;
    for (;;) {
        size_t len = strcspn(p, ",");
        char buf[32];
        if (len == 0 || len >= sizeof buf) return -1;
        memcpy(buf, p, len);
        buf[len] = '\0';
        int64_t v;
        if (cli_parse_i64(buf, 1, BENCH_MAX_THREADS, &v) != 0) return -1;
        if (o->n_thread_counts >= BENCH_MAX_THREAD_COUNTS) return -1;
        o->threads[o->n_thread_counts++] = (int)v;
        if (p[len] == '\0') return 0;
        p += len + 1;
    }
}

/* Parses a comma-separated list of names[i] into a bit set; -1 on error. */
static int parse_names(const char *s, const char *const *names, int n, unsigned *out) {
    *out = 0;
    const char *p = s;
    for (;;) {
        size_t len = strcspn(p, ",");
        int found = -1;
        for (int i = 0; i < n; i++)
            if (strlen(names[i]) == len && strncmp(p, names[i], len) == 0) found = i;
        if (found < 0) return -1;
        *out |= 1u << found;
        if (p[len] == '\0') return 0;
        p += len + 1;
    }
}

static int parse_isa(const char *s, kvc_isa *out) {
    for (int i = 0; i < (int)KVC_ISA_COUNT; i++) {
        if (strcmp(s, kvc_isa_name((kvc_isa)i)) == 0) {
            *out = (kvc_isa)i;
            return 0;
        }
    }
    return -1;
}

/* Matches "--name VALUE" or "--name=VALUE" at argv[*i]; sets *val and
 * advances *i past the value. Returns 1 on a match, 0 if argv[*i] is another
 * option, -1 if the value is missing. */
static int opt_value(int argc, char **argv, int *i, const char *name, const char **val) {
    const char *a = argv[*i];
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0) return 0;
    if (a[n] == '=') {
        *val = a + n + 1;
        return 1;
    }
    if (a[n] != '\0') return 0;
    if (*i + 1 >= argc) return -1;
    *val = argv[++*i];
    return 1;
}

/* The options below that not every target uses (--group, --layers,
 * --soft-cap and --threads have warnings of their own): one bit each. */
enum {
    GIVEN_BATCH = 1 << 0,
    GIVEN_KVLEN = 1 << 1,
    GIVEN_HEADS = 1 << 2,
    GIVEN_HEAD_DIM = 1 << 3,
    GIVEN_CACHE = 1 << 4,
    GIVEN_OP = 1 << 5,
    GIVEN_LAYOUT = 1 << 6,
    GIVEN_MODE = 1 << 7,
    GIVEN_TIME = 1 << 8,
};
static const char *const given_names[] = {"--batch", "--kvlen", "--heads",  "--head-dim", "--cache",
                                          "--op",    "--layout", "--mode", "--time"};
#define GIVEN_SHAPE (GIVEN_BATCH | GIVEN_KVLEN | GIVEN_HEADS | GIVEN_HEAD_DIM)

/* Those options target uses (its bench_*.c reads them). */
static unsigned target_uses(const char *target) {
    if (!strcmp(target, "pmx")) return ~0u;
    if (!strcmp(target, "append") || !strcmp(target, "prefill"))
        return GIVEN_SHAPE | GIVEN_CACHE | GIVEN_TIME;
    if (!strcmp(target, "attention")) return GIVEN_SHAPE | GIVEN_CACHE | GIVEN_LAYOUT | GIVEN_TIME;
    if (!strcmp(target, "mla")) return GIVEN_SHAPE | GIVEN_TIME;
    if (!strcmp(target, "gemm")) return GIVEN_BATCH | GIVEN_TIME;
    if (!strcmp(target, "kernel"))
        return GIVEN_KVLEN | GIVEN_HEADS | GIVEN_HEAD_DIM | GIVEN_CACHE | GIVEN_TIME;
    return 0; /* cache: --quick, --json, --threads only */
}

int cmd_bench(int argc, char **argv) {
    /* int8/int4 name the compressed formats in attention (as --kv-dtype does),
     * the per-token caches elsewhere; int8-token/int4-token are always those */
    static const char *const cache_names[] = {"f16",   "int8",       "int4",      "kivi8",
                                              "kivi4", "int8-token", "int4-token"};
    static const char *const op_names[] = {"static", "dynamic"};
    static const char *const layout_names[] = {"0", "1", "2", "3"};
    static const char *const paged_layout_names[] = {"nhd", "hnd"};
    static const char *const mode_names[] = {"offset", "paged"};
    bench_opts o;
    memset(&o, 0, sizeof o);
    o.threads[0] = 1;
    o.threads[1] = 2;
    o.n_thread_counts = 2;
    o.caches = 0; /* 0: the target's default set */
    o.ops = BENCH_OP_ALL;
    o.layouts = 0; /* 0: the target's default set */
    o.modes = 3;
    const char *target = "pmx";
    const char *isa_name = NULL;
    int threads_given = 0;
    unsigned given = 0; /* GIVEN_* */
    int first = 1;
    if (argc > 1 && !strcmp(argv[1], "store")) return bench_store(argc, argv);
    if (argc > 1 && argv[1][0] != '-') {
        target = argv[1];
        first = 2;
        if (strcmp(target, "pmx") != 0 && strcmp(target, "append") != 0 &&
            strcmp(target, "cache") != 0 && strcmp(target, "attention") != 0 &&
            strcmp(target, "prefill") != 0 && strcmp(target, "mla") != 0 &&
            strcmp(target, "gemm") != 0 && strcmp(target, "kernel") != 0) {
            fprintf(stderr,
                    "kvcache: bench: unknown target '%s' (known: pmx, append, cache, attention, "
                    "prefill, mla, gemm, kernel, store)\n\n%s%s",
                    target, bench_usage, bench_usage_options);
            return CLI_EXIT_USAGE;
        }
    }
    char cmd[32]; /* "bench TARGET": usage errors and warnings name the target */
    snprintf(cmd, sizeof cmd, "bench %s", target);
    for (int i = first; i < argc; i++) {
        const char *a = argv[i];
        const char *v = NULL;
        int r;
        int64_t n;
        if (cli_is_help(a)) {
            fputs(bench_usage, stdout);
            fputs(bench_usage_options, stdout);
            return CLI_EXIT_OK;
        } else if (strcmp(a, "--quick") == 0) {
            o.quick = 1;
        } else if (strcmp(a, "--json") == 0) {
            o.json = 1;
        } else if ((r = opt_value(argc, argv, &i, "--threads", &v)) != 0) {
            if (r < 0) return cli_usage_error(cmd, "--threads needs a value");
            threads_given = 1;
            if (parse_threads(v, &o) != 0)
                return cli_usage_error(cmd,
                                       "--threads '%s': expected a comma-separated list "
                                       "of up to %d counts in [1, %d]",
                                       v, BENCH_MAX_THREAD_COUNTS, BENCH_MAX_THREADS);
        } else if ((r = opt_value(argc, argv, &i, "--batch", &v)) != 0) {
            given |= GIVEN_BATCH;
            if (r < 0) return cli_usage_error(cmd, "--batch needs a value");
            if (cli_opt_i64(cmd, "--batch", v, 1, 1 << 20, &o.batch)) return CLI_EXIT_USAGE;
        } else if ((r = opt_value(argc, argv, &i, "--kvlen", &v)) != 0) {
            given |= GIVEN_KVLEN;
            if (r < 0) return cli_usage_error(cmd, "--kvlen needs a value");
            if (cli_opt_i64(cmd, "--kvlen", v, 1, 1 << 24, &o.kvlen)) return CLI_EXIT_USAGE;
        } else if ((r = opt_value(argc, argv, &i, "--heads", &v)) != 0) {
            given |= GIVEN_HEADS;
            if (r < 0) return cli_usage_error(cmd, "--heads needs a value");
            if (cli_opt_i64(cmd, "--heads", v, 1, 1 << 16, &o.heads)) return CLI_EXIT_USAGE;
        } else if ((r = opt_value(argc, argv, &i, "--head-dim", &v)) != 0) {
            given |= GIVEN_HEAD_DIM;
            if (r < 0 || cli_parse_i64(v, 8, 1 << 16, &n) != 0 || n % 8 != 0)
                return cli_usage_error(cmd, "--head-dim expects a multiple of 8 in "
                                            "[8, 65536] (a target may need more: see "
                                            "--help)");
            o.head_dim = n;
        } else if ((r = opt_value(argc, argv, &i, "--group", &v)) != 0) {
            if (r > 0 && !strcmp(v, "row")) {
                o.group = BENCH_GROUP_ROW;
            } else {
                if (r < 0 || cli_parse_i64(v, 2, 1 << 16, &n) != 0 || n % 2 != 0)
                    return cli_usage_error(cmd, "--group expects an even integer in "
                                                "[2, 65536] or row");
                o.group = n;
            }
        } else if ((r = opt_value(argc, argv, &i, "--layers", &v)) != 0) {
            if (r < 0) return cli_usage_error(cmd, "--layers needs a value");
            if (cli_opt_i64(cmd, "--layers", v, 1, 1024, &o.layers)) return CLI_EXIT_USAGE;
        } else if ((r = opt_value(argc, argv, &i, "--soft-cap", &v)) != 0) {
            /* > 0 and finite as the float the operator takes: 1e308 became inf
             * (every case failed) and 1e-50 became 0 (soft cap off, said on) */
            if (r < 0 || cli_parse_f64(v, &o.soft_cap) != 0 || !((float)o.soft_cap > 0) ||
                (float)o.soft_cap > FLT_MAX)
                return cli_usage_error(cmd, "--soft-cap expects a number > 0, finite as a "
                                       "float (about 1.2e-38 to 3.4e38)");
        } else if ((r = opt_value(argc, argv, &i, "--cache", &v)) != 0) {
            given |= GIVEN_CACHE;
            if (r < 0 || parse_names(v, cache_names, 7, &o.caches) != 0)
                return cli_usage_error(cmd, "--cache expects a list of f16,int8,int4,"
                                            "int8-token,int4-token (and kivi8,kivi4 for "
                                            "attention)");
        } else if ((r = opt_value(argc, argv, &i, "--op", &v)) != 0) {
            given |= GIVEN_OP;
            if (r < 0 || parse_names(v, op_names, 2, &o.ops) != 0)
                return cli_usage_error(cmd, "--op expects a list of static,dynamic");
        } else if ((r = opt_value(argc, argv, &i, "--layout", &v)) != 0) {
            given |= GIVEN_LAYOUT;
            if (strcmp(target, "attention") == 0) {
                if (r < 0 || parse_names(v, paged_layout_names, 2, &o.layouts) != 0)
                    return cli_usage_error(cmd,
                                           "attention --layout expects a list of nhd,hnd");
            } else if (r < 0 || parse_names(v, layout_names, 4, &o.layouts) != 0) {
                return cli_usage_error(cmd, "--layout expects a list of 0,1,2,3");
            }
        } else if ((r = opt_value(argc, argv, &i, "--mode", &v)) != 0) {
            given |= GIVEN_MODE;
            if (r < 0 || parse_names(v, mode_names, 2, &o.modes) != 0)
                return cli_usage_error(cmd, "--mode expects a list of offset,paged");
        } else if ((r = opt_value(argc, argv, &i, "--time", &v)) != 0) {
            given |= GIVEN_TIME;
            if (r < 0 || cli_parse_seconds(v, 60.0, &o.time_s) != 0)
                return cli_usage_error(cmd, "--time expects seconds in (0, 60]");
        } else if ((r = opt_value(argc, argv, &i, "--isa", &v)) != 0) {
            if (r < 0) return cli_usage_error(cmd, "--isa needs a value");
            isa_name = v;
        } else if (a[0] == '-') {
            return cli_usage_error(cmd, "unknown option '%s'", a);
        } else {
            return cli_usage_error(cmd, "unexpected argument '%s'", a);
        }
    }
    if (threads_given && !strcmp(target, "kernel")) {
        fprintf(stderr, "kvcache: bench kernel: --threads is ignored (one thread)\n");
    } else if (threads_given) { /* as run, chat and perplexity warn: the largest count */
        int most = 0;
        for (int k = 0; k < o.n_thread_counts; k++)
            if (o.threads[k] > most) most = o.threads[k];
        cli_warn_threads(cmd, "--threads", most);
    }
    if (isa_name != NULL) {
        kvc_isa isa;
        if (parse_isa(isa_name, &isa) != 0)
            return cli_usage_error(cmd, "--isa '%s': expected scalar, avx2, avx512 or amx",
                                   isa_name);
        if (kvc_set_isa(isa) != KVC_OK) {
            /* a valid request this CPU cannot run: the work fails, not the command line */
            fprintf(stderr, "kvcache: bench: --isa %s: %s\n", isa_name, kvc_last_error());
            return CLI_EXIT_FAIL;
        }
    }
    /* what the attention operators take, before any case runs */
    if ((!strcmp(target, "attention") || !strcmp(target, "prefill")) &&
        o.head_dim > KVC_ATTN_MAX_HEAD_DIM)
        return cli_usage_error(cmd, "--head-dim %lld: the attention kernels take a multiple "
                               "of 8 in [8, %d]", (long long)o.head_dim,
                               KVC_ATTN_MAX_HEAD_DIM);
    {
        const unsigned tok = (o.caches >> 5) & 3u; /* int8-token, int4-token */
        if (strcmp(target, "attention") == 0) {
            const unsigned plain = (o.caches >> 1) & 3u; /* int8, int4 */
            o.caches = (o.caches & (BENCH_CACHE_F16 | BENCH_CACHE_KIVI)) | (plain << 3) |
                       (tok << 1);
        } else {
            o.caches = (o.caches & 31u) | (tok << 1);
        }
    }
    if ((o.caches & BENCH_CACHE_KIVI) && strcmp(target, "attention") != 0)
        return cli_usage_error(cmd, "--cache kivi8/kivi4: attention only");
    /* options a target does not use are said, not silently dropped */
    const int grouped = !strcmp(target, "attention") || !strcmp(target, "kernel");
    if (o.group && !grouped)
        fprintf(stderr, "kvcache: bench %s: --group is ignored (attention and kernel only; "
                "this target's group is fixed, see its header)\n", target);
    if (o.layers && strcmp(target, "attention") != 0)
        fprintf(stderr, "kvcache: bench %s: --layers is ignored (attention only)\n", target);
    if (o.soft_cap > 0 && strcmp(target, "attention") != 0)
        fprintf(stderr, "kvcache: bench %s: --soft-cap is ignored (attention only)\n", target);
    for (int k = 0; k < (int)(sizeof given_names / sizeof given_names[0]); k++)
        if (given & ~target_uses(target) & (1u << k))
            fprintf(stderr, "kvcache: bench %s: %s is ignored (this target does not use it)\n",
                    target, given_names[k]);
    if (o.time_s == 0) o.time_s = o.quick ? 0.01 : 0.3;
    o.membw_bytes = (size_t)(o.quick ? 64 : 256) << 20;
    if (strcmp(target, "cache") == 0) return bench_cache(&o);
    if (strcmp(target, "attention") == 0) return bench_attention(&o);
    if (strcmp(target, "prefill") == 0) return bench_prefill(&o);
    if (strcmp(target, "mla") == 0) return bench_mla(&o);
    if (strcmp(target, "gemm") == 0) return bench_gemm(&o);
    if (strcmp(target, "kernel") == 0) return bench_kernel(&o);
    if (strcmp(target, "append") == 0) {
        if (o.caches == 0) o.caches = BENCH_CACHE_F16 | BENCH_CACHE_INT8;
        return bench_append(&o);
    }
    if (o.caches == 0) o.caches = BENCH_CACHE_ALL;
    return bench_pmx(&o);
}
