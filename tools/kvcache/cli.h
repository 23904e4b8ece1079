/*
 * Shared declarations of the kvcache command-line tool (tools/kvcache).
 *
 * Every subcommand is a function taking the argument vector that starts at
 * its own name (argv[0] == "info", "bench", ...) and returning the process
 * exit status: CLI_EXIT_OK, CLI_EXIT_FAIL (the work failed) or
 * CLI_EXIT_USAGE (bad command line; a message was printed to stderr).
 * The tool uses the public API only (kvcache/kvcache.h).
 */
#ifndef KVCACHE_TOOLS_CLI_H
#define KVCACHE_TOOLS_CLI_H

#include <stdint.h>

#include "kvcache/kvfmt.h"

#define CLI_EXIT_OK 0
#define CLI_EXIT_FAIL 1
#define CLI_EXIT_USAGE 2

#if defined(__GNUC__)
#define CLI_PRINTF(fmt_idx, arg_idx) __attribute__((format(printf, fmt_idx, arg_idx)))
#else
#define CLI_PRINTF(fmt_idx, arg_idx)
#endif

/* ---- subcommands ------------------------------------------------------- */

int cmd_info(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_run(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_bench_serve(int argc, char **argv);
int cmd_perplexity(int argc, char **argv);

/* Default model path (models/ under the working directory, or
 * $KVCACHE_MODEL). */
const char *cli_default_model(void);
/* KV storage codes of --kv-dtype: a kvc_dtype (a per-token cache), or
 * CLI_KV_FMT + a kvc_kv_format (a compressed format). */
#define CLI_KV_FMT 100
#define CLI_KV_KIVI8 (CLI_KV_FMT + KVC_KVFMT_KIVI8)
#define CLI_KV_KIVI4 (CLI_KV_FMT + KVC_KVFMT_KIVI4)
#define CLI_KV_HELP "f32, f16, bf16, int8 (= kivi8), int4 (= kivi4), int8-token, int4-token"
/* A name of CLI_KV_HELP: 0 and its code in *dtype, or -1. */
int cli_parse_kv_dtype(const char *s, int *dtype);
kvc_dtype cli_kv_dtype(int code);      /* the dtype of a per-token cache (f16 otherwise) */
kvc_kv_format cli_kv_format(int code); /* KVC_KVFMT_NONE for a per-token cache */
const char *cli_kv_name(int code);     /* "kivi8", "int8-token", "float16", ... */

/* ---- helpers (main.c) -------------------------------------------------- */

/* 1 if arg is "-h" or "--help". */
int cli_is_help(const char *arg);

/* 1 if arg is one of names (NULL-terminated). */
int cli_is_one_of(const char *arg, const char *const *names);

/* Prints "kvcache: CMD: <message>" (no "CMD: " when cmd is NULL) and a hint
 * to run "kvcache CMD --help" on stderr; returns CLI_EXIT_USAGE so callers
 * can `return cli_usage_error(...)`. */
int cli_usage_error(const char *cmd, const char *fmt, ...) CLI_PRINTF(2, 3);

/* Numbers of the command line, one syntax for all (main.c): decimal digits,
 * '-' before a negative number, no '+', spaces, hexadecimal, inf or nan. */

/* A decimal integer in [lo, hi] into *out; 0 on success, -1 on garbage,
 * trailing characters or out-of-range values. */
int cli_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out);

/* cli_parse_i64 for the value v of option opt (as the user wrote it: "-c"
 * or "--ctx-size"): 0, or CLI_EXIT_USAGE after "OPT: expected an integer in
 * [LO, HI], got 'V'". */
int cli_opt_i64(const char *cmd, const char *opt, const char *v, int64_t lo, int64_t hi,
                int64_t *out);

/* 0 if the value v of option opt names a file, else CLI_EXIT_USAGE after
 * "OPT: expected a file name, got ''": an empty one (an unset shell
 * variable) would fail later as "cannot load : : cannot open". */
int cli_opt_path(const char *cmd, const char *opt, const char *v);

/* 1 if reading the file option's value path takes bytes from standard
 * input: "-", or a name of the stream open on fd 0 (/dev/stdin,
 * /proc/self/fd/0, the tty or fifo itself), found by st_dev and st_ino, not
 * by the name. A regular file on fd 0 opened again by name is read from its
 * start, apart from standard input: 0. */
int cli_is_stdin(const char *path);

/* A positive decimal number (e.g. "0.3") in (0, hi]; 0 or -1. */
int cli_parse_seconds(const char *s, double hi, double *out);

/* A finite decimal number ([-]D[.D][e[+-]D], nothing after it) into *out;
 * -1 if s is not one. Range checks are the caller's. */
int cli_parse_f64(const char *s, double *out);

/* A non-negative decimal integer up to UINT64_MAX; -1 otherwise. */
int cli_parse_u64(const char *s, uint64_t *out);

/* The CPUs this process may run on (kvc_cpu_count: its affinity mask). */
int cli_online_cpus(void);
/* Warns on stderr when threads exceeds cli_online_cpus(). */
void cli_warn_threads(const char *cmd, const char *opt, int64_t threads); /* opt: as written */

/* Value of the first "key : value" line of /proc/cpuinfo into buf ("" if
 * absent or unreadable); returns buf. */
const char *cli_cpuinfo(const char *key, char *buf, int n);

/* CPU model name from /proc/cpuinfo ("unknown" if unreadable) into buf. */
const char *cli_cpu_model(char *buf, int n);

#endif
