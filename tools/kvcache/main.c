/*
 * kvcache command-line tool: entry point, top-level usage and the small
 * helpers every subcommand shares (option values, CPU facts).
 *
 *   kvcache run             generate text with a GGUF model
 *   kvcache chat            multi-turn chat on standard input
 *   kvcache bench-serve     continuous-batching throughput
 *   kvcache info            library version, ISA, CPUs
 *   kvcache bench [TARGET]  micro-benchmarks (kvcache bench --help lists them)
 *   kvcache run, bench-serve, perplexity: a GGUF model through the cache
 *
 * Exit status: 0 success, 1 the work failed (stdout that cannot be written
 * included: SIGPIPE is ignored), 2 bad command line (options whose numbers
 * do not fit the loaded model included: a prompt past -c, bench-serve's
 * sizes past the bench memory limit).
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "kvcache/kvcache.h"

static const char usage_text[] =
    "usage: kvcache <command> [options]\n"
    "\n"
    "commands:\n"
    "  run              generate text with a GGUF model through the cache\n"
    "  chat             multi-turn chat (one message a line of standard input)\n"
    "  bench-serve      continuous-batching throughput of a GGUF model\n"
    "  perplexity       perplexity of a text file (llama-perplexity's protocol)\n"
    "  info             library version, ISA in use and supported, CPUs\n"
    "  bench [TARGET]   micro-benchmarks; TARGET: pmx (default), append, cache,\n"
    "                   attention, prefill, mla, gemm, kernel, store\n"
    "  help [COMMAND]   this text, or the help of COMMAND\n"
    "  version          print the library version\n"
    "\n"
    "Run 'kvcache <command> --help' for the options of a command. An option that\n"
    "takes one value keeps the last one given (-c 512 -c 1024 is -c 1024), as in\n"
    "llama.cpp; --kv-store is repeatable, and options that would contradict each\n"
    "other (-p with -f, --system with --system-file) are refused.\n"
    "\n"
    "Exit status: 0 success; 1 the work failed; 2 a bad command line, numbers that\n"
    "do not fit the model included (a prompt past the context, sizes past a limit).\n";

/* ---- shared helpers ---------------------------------------------------- */

int cli_is_help(const char *arg) {
    return strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0;
}

int cli_is_one_of(const char *arg, const char *const *names) {
    for (; *names; names++)
        if (strcmp(arg, *names) == 0) return 1;
    return 0;
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    fputs("kvcache: ", stderr);
    if (cmd != NULL) fprintf(stderr, "%s: ", cmd); /* every command's errors name it */
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (cmd != NULL)
        fprintf(stderr, "\nRun 'kvcache %s --help' for usage.\n", cmd);
    else
        fputs("\nRun 'kvcache --help' for usage.\n", stderr);
    return CLI_EXIT_USAGE;
}

/* Every number of the command line has one syntax: decimal digits, a '-'
 * before a negative one, nothing else (strtoll and strtod alone would take
 * leading spaces, a '+', hexadecimal, "inf"; strtoull "-1" as 2^64 - 1), so
 * that -n, --seed, --threads and the rest accept and refuse alike. */

int cli_parse_u64(const char *s, uint64_t *out) {
    if (s == NULL || *s < '0' || *s > '9') return -1;
    uint64_t v = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || v > (UINT64_MAX - (uint64_t)(*s - '0')) / 10) return -1;
        v = v * 10 + (uint64_t)(*s - '0');
    }
    *out = v;
    return 0;
}

int cli_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    uint64_t m;
    if (s == NULL || cli_parse_u64(s + (*s == '-'), &m) != 0) return -1;
    if (m > (uint64_t)INT64_MAX + (*s == '-')) return -1;
    const int64_t v = *s != '-' ? (int64_t)m : m > (uint64_t)INT64_MAX ? INT64_MIN : -(int64_t)m;
    if (v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int cli_parse_f64(const char *s, double *out) {
    /* digits with a '.' and an exponent: [-]D[.D][e[+-]D] or [-].D... */
    if (s == NULL) return -1;
    const char *p = s + (*s == '-');
    if (!((*p >= '0' && *p <= '9') || (*p == '.' && p[1] >= '0' && p[1] <= '9'))) return -1;
    if (strspn(p, "0123456789.eE+-") != strlen(p)) return -1;
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

int cli_parse_seconds(const char *s, double hi, double *out) {
    double v;
    if (cli_parse_f64(s, &v) != 0 || !(v > 0.0) || !(v <= hi)) return -1;
    *out = v;
    return 0;
}

int cli_opt_i64(const char *cmd, const char *opt, const char *v, int64_t lo, int64_t hi,
                int64_t *out) {
    if (cli_parse_i64(v, lo, hi, out) == 0) return 0;
    return cli_usage_error(cmd, "%s: expected an integer in [%lld, %lld], got '%s'", opt,
                           (long long)lo, (long long)hi, v);
}

int cli_opt_path(const char *cmd, const char *opt, const char *v) {
    if (v[0] != '\0') return 0;
    return cli_usage_error(cmd, "%s: expected a file name, got ''", opt);
}

int cli_is_stdin(const char *path) {
    if (strcmp(path, "-") == 0) return 1;
    struct stat in, st;
    /* a pipe, a terminal or a socket has one read position, which both
     * readers would take from */
    return fstat(0, &in) == 0 && !S_ISREG(in.st_mode) && stat(path, &st) == 0 &&
           st.st_dev == in.st_dev && st.st_ino == in.st_ino;
}

int cli_online_cpus(void) { return kvc_cpu_count(); }

void cli_warn_threads(const char *cmd, const char *opt, int64_t threads) {
    const int n = kvc_cpu_count();
    if (threads > n)
        fprintf(stderr,
                "kvcache: %s: warning: %s %lld is more than the %d CPUs this process may run on; "
                "the extra threads share CPUs (no faster than %s %d)\n",
                cmd, opt, (long long)threads, n, opt, n);
}

const char *cli_cpuinfo(const char *key, char *buf, int n) {
    buf[0] = '\0';
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f == NULL) return buf;
    char line[512];
    size_t klen = strlen(key);
    while (fgets(line, sizeof line, f) != NULL) {
        /* "key<tabs>: value" */
        if (strncmp(line, key, klen) != 0) continue;
        const char *v = line + klen;
        while (*v == ' ' || *v == '\t') v++;
        if (*v != ':') continue; /* a longer key: "model" vs "model name" */
        v++;
        while (*v == ' ' || *v == '\t') v++;
        size_t len = strcspn(v, "\r\n");
        while (len > 0 && (v[len - 1] == ' ' || v[len - 1] == '\t')) len--;
        snprintf(buf, (size_t)n, "%.*s", (int)len, v);
        break;
    }
    fclose(f);
    return buf;
}

const char *cli_cpu_model(char *buf, int n) {
    cli_cpuinfo("model name", buf, n);
    if (buf[0] == '\0') snprintf(buf, (size_t)n, "unknown");
    return buf;
}

const char *cli_default_model(void) {
    const char *env = getenv("KVCACHE_MODEL");
    return env && env[0] ? env : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

int cli_parse_kv_dtype(const char *s, int *dtype) {
    /* int8 and int4 name the best compressed formats (docs/KV_FORMATS.md);
     * the per-token caches of the library's int8/int4 dtypes stay reachable
     * as int8-token and int4-token. The float names are the Python package's
     * (FlashInfer's torch names "float" and "half" included). */
    static const struct {
        const char *name;
        int dt;
    } names[] = {{"f32", KVC_F32},   {"float32", KVC_F32},  {"fp32", KVC_F32},
                 {"float", KVC_F32}, {"f16", KVC_F16},      {"float16", KVC_F16},
                 {"fp16", KVC_F16},  {"half", KVC_F16},     {"bf16", KVC_BF16},
                 {"bfloat16", KVC_BF16},
                 {"int8", CLI_KV_KIVI8}, {"int4", CLI_KV_KIVI4}, {"kivi8", CLI_KV_KIVI8},
                 {"kivi4", CLI_KV_KIVI4}, {"int8-token", KVC_I8}, {"int4-token", KVC_I4}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(s, names[i].name) == 0) {
            *dtype = (int)names[i].dt;
            return 0;
        }
    return -1;
}

kvc_dtype cli_kv_dtype(int code) { return code >= CLI_KV_FMT ? KVC_F16 : (kvc_dtype)code; }

kvc_kv_format cli_kv_format(int code) {
    return code >= CLI_KV_FMT ? (kvc_kv_format)(code - CLI_KV_FMT) : KVC_KVFMT_NONE;
}

const char *cli_kv_name(int code) {
    if (code >= CLI_KV_FMT) return kvc_kv_format_name(cli_kv_format(code));
    if (code == KVC_I8) return "int8-token";
    if (code == KVC_I4) return "int4-token";
    return kvc_dtype_name((kvc_dtype)code);
}

/* ---- dispatch ---------------------------------------------------------- */

static int run_command(int argc, char **argv) {
    const char *cmd = argv[0];
    if (strcmp(cmd, "info") == 0) return cmd_info(argc, argv);
    if (strcmp(cmd, "bench") == 0) return cmd_bench(argc, argv);
    if (strcmp(cmd, "run") == 0) return cmd_run(argc, argv);
    if (strcmp(cmd, "chat") == 0) return cmd_chat(argc, argv);
    if (strcmp(cmd, "bench-serve") == 0) return cmd_bench_serve(argc, argv);
    if (strcmp(cmd, "perplexity") == 0) return cmd_perplexity(argc, argv);
    if (strcmp(cmd, "version") == 0 || strcmp(cmd, "--version") == 0) {
        if (argc > 1) return cli_usage_error(NULL, "'version' takes no arguments");
        printf("kvcache %s\n", kvc_version_string());
        return CLI_EXIT_OK;
    }
    if (strcmp(cmd, "help") == 0 || cli_is_help(cmd)) {
        if (argc > 2) return cli_usage_error(NULL, "'help' takes at most one command");
        if (argc == 2) {
            const char *sub = argv[1];
            if (strcmp(sub, "info") == 0 || strcmp(sub, "bench") == 0 || strcmp(sub, "run") == 0 ||
                strcmp(sub, "chat") == 0 || strcmp(sub, "bench-serve") == 0 ||
                strcmp(sub, "perplexity") == 0) {
                char help[] = "--help";
                char *sub_argv[3] = {argv[1], help, NULL};
                return run_command(2, sub_argv);
            }
            if (strcmp(sub, "help") != 0 && strcmp(sub, "version") != 0) {
                fprintf(stderr, "kvcache: unknown command '%s'\n\n%s", sub, usage_text);
                return CLI_EXIT_USAGE;
            }
        }
        fputs(usage_text, stdout);
        return CLI_EXIT_OK;
    }
    if (cmd[0] == '-')
        fprintf(stderr, "kvcache: unknown option '%s'\n\n%s", cmd, usage_text);
    else
        fprintf(stderr, "kvcache: unknown command '%s'\n\n%s", cmd, usage_text);
    return CLI_EXIT_USAGE;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fputs(usage_text, stderr);
        return CLI_EXIT_USAGE;
    }
    /* a mistyped KVC_ISA would otherwise only show as the wrong kernels */
    if (kvc_isa_env_check() != KVC_OK) {
        fprintf(stderr, "kvcache: %s\n", kvc_last_error());
        return CLI_EXIT_USAGE;
    }
    /* A reader gone early (`kvcache info | head -c1`) is a write error that
     * every command reports (exit 1) after closing what it opened (a KV
     * store's queued writes, an event stream), not a death by signal (141). */
    signal(SIGPIPE, SIG_IGN);
    int rc = run_command(argc - 1, argv + 1);
    /* A full disk or closed pipe on stdout must not pass silently. */
    errno = 0;
    const int flush_failed = fflush(stdout) != 0;
    const int err = errno;
    if ((flush_failed || ferror(stdout)) && rc == CLI_EXIT_OK) {
        fprintf(stderr, "kvcache: %s: cannot write the output: %s\n", argv[1],
                flush_failed && err ? strerror(err) : "write error");
        rc = CLI_EXIT_FAIL;
    }
    return rc;
}
