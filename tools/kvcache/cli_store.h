/*
 * The KV store options of run, chat and bench-serve (store.h): --kv-store
 * (repeatable: lookup order), --kv-store-write, --salt, --kv-events,
 * --kv-events-replay, --json-stats.
 */
#ifndef KVCACHE_TOOLS_CLI_STORE_H
#define KVCACHE_TOOLS_CLI_STORE_H

#include <stdint.h>

#include "kvcache/kvcache.h"

#define CLI_STORE_MAX 16

typedef struct kvc_store kvc_store;

typedef struct cli_store_opts {
    const char *urls[CLI_STORE_MAX];
    int n_urls;
    int policy;       /* kvc_store_write_policy */
    int policy_set;   /* --kv-store-write given */
    int32_t hits;     /* selective:N */
    const char *salt; /* NULL: none */
    const char *events; /* --kv-events ENDPOINT, NULL: none */
    const char *replay; /* --kv-events-replay ENDPOINT, NULL: none */
    int json_stats;
} cli_store_opts;

extern const char cli_store_opts_help[];

/* The syntax of a --kv-store URL (docs/KV_STORE.md section 5), checked
 * when the option is parsed so that a malformed one is a usage error before
 * the model loads: NULL if url is well formed, else why not (static text).
 * Opening the store may still fail (a directory that cannot be made). */
const char *cli_store_url_problem(const char *url);
#define CLI_STORE_URL_FORMS                                                                        \
    "a tier is dir:PATH[?max_bytes=N], redis://[[USER]:PASSWORD@]HOST:PORT[/DB] or "            \
    "unix://[[USER]:PASSWORD@]/PATH[?ttl=SECONDS&db=N], with ?write=P or &write=P"

/* Where Redis server URL s[0..n)'s part after "USER:PASSWORD@" starts (past
 * the scheme when it has none); *cred: the credentials as written, or NULL. */
const char *cli_store_url_after_cred(const char *s, size_t n, const char **cred);

/* url less the credentials of its Redis servers, into out (cap bytes): for
 * messages and reports. Returns the length of the whole (as snprintf): a
 * result >= cap was cut, at the end of the last server that fit (or inside
 * the options). */
size_t cli_store_url_shown(const char *url, char *out, size_t cap);

/* A usage error for --kv-store URL (exit 2), the URL quoted unless it may
 * hold a password. */
int cli_store_url_usage(const char *cmd, const char *url, const char *why);

void cli_store_opts_default(cli_store_opts *o);
/* As cli_gen_opts_parse: 1 parsed, 0 not a store option, CLI_EXIT_USAGE. */
int cli_store_opts_parse(const char *cmd, int argc, char **argv, int *i, cli_store_opts *o);
/* 1 when o asks for anything of the store (a tier, events, stats). */
int cli_store_opts_any(const cli_store_opts *o);

/* After parsing: options that need another (--kv-events-replay needs
 * --kv-events) are a usage error (its exit code), 0 if fine; options that
 * do nothing without --kv-store get a warning. */
int cli_store_opts_check(const char *cmd, const cli_store_opts *o);

/* Attaches the store of o to eng for the model at model_path, opening it
 * first unless *store is open (bench-serve keeps one store, and so one
 * event stream, across its cases; none asked for: *store stays NULL) and
 * with --kv-events publishing its events. Prints why and returns -1 on
 * failure (*store, if opened, is still to be closed). */
int cli_store_attach(const char *cmd, const cli_store_opts *o, const char *model_path,
                     const kvc_model *model, kvc_engine *eng, kvc_store **store);

/* Flushes the store's writes (at most timeout_s) and with --json-stats
 * prints the stats line on stderr (the store's counts since the attach).
 * ttft_s / decode_tok_s: the command's. */
void cli_store_finish(const char *cmd, const cli_store_opts *o, kvc_store *store,
                      const kvc_engine *eng, double ttft_s, double decode_tok_s,
                      double timeout_s);
/* Detaches eng (subscribers hear its cache's pages removed): before the
 * engine is destroyed. */
void cli_store_detach(kvc_store *store, kvc_engine *eng);
/* Sends the events still queued, stops publishing and closes the store. */
void cli_store_close(kvc_store *store);

#endif
