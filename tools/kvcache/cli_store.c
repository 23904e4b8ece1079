/* The KV store options (cli_store.h). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_store.h"
#ifdef KVC_HAVE_STORE
#include "kvcache/store.h"
#endif

const char cli_store_opts_help[] =
    "  --kv-store URL      keep K/V pages beyond this process, looked up in the order\n"
    "                      given (repeatable): dir:PATH[?max_bytes=N],\n"
    "                      redis://[[USER]:PASSWORD@]HOST:PORT[/DB] or\n"
    "                      unix://[[USER]:PASSWORD@]/PATH/TO/SOCKET [?ttl=SECONDS&db=N]\n"
    "                      (several Redis servers: a comma-separated list; %-encode\n"
    "                      @ : / , ? & % in a password, which others on this machine\n"
    "                      can read in the process list: $KVCACHE_REDIS_PASSWORD\n"
    "                      (and $KVCACHE_REDIS_USER) in the environment, unencoded,\n"
    "                      is used for the servers whose URL gives none);\n"
    "                      a tier's own write policy: ?write=P (&write=P after\n"
    "                      another option)\n"
    "  --kv-store-write P  the other tiers': through (default: when a page is full),\n"
    "                      back (when the cache evicts it) or selective:N (after N\n"
    "                      prefix hits)\n"
    "  --salt STRING       tenant: pages are shared only under the same salt\n"
    "  --kv-events ENDPOINT  publish the store's and the engine cache's page\n"
    "                      events as vLLM KV events (ZeroMQ PUB bound to ENDPOINT,\n"
    "                      e.g. tcp://127.0.0.1:5557; without --kv-store, the\n"
    "                      engine cache's alone)\n"
    "  --kv-events-replay ENDPOINT  answer vLLM replay requests (ROUTER socket)\n"
    "                      with the last 10000 batches (64 MiB at most)\n"
    "  --json-stats        at exit, one JSON line of prompt, cache and store\n"
    "                      counters, time to first token and decode tokens/s on\n"
    "                      stderr\n";

#define URL_SHOW 200 /* characters of a URL quoted in a message */

int cli_store_url_usage(const char *cmd, const char *url, const char *why) {
    if (strchr(url, '@')) /* it may hold a password */
        return cli_usage_error(cmd, "--kv-store (the URL is not shown: it has an '@'): %s ("
                               CLI_STORE_URL_FORMS ")", why);
    return cli_usage_error(cmd, "--kv-store '%.*s': %s (" CLI_STORE_URL_FORMS ")", URL_SHOW, url,
                           why);
}

void cli_store_opts_default(cli_store_opts *o) {
    memset(o, 0, sizeof *o);
    o->hits = 2;
}

int cli_store_opts_parse(const char *cmd, int argc, char **argv, int *i, cli_store_opts *o) {
    const char *a = argv[*i];
    const char *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!strcmp(a, "--json-stats")) {
        o->json_stats = 1;
        return 1;
    }
    if (strcmp(a, "--kv-store") && strcmp(a, "--kv-store-write") && strcmp(a, "--salt") &&
        strcmp(a, "--kv-events") && strcmp(a, "--kv-events-replay"))
        return 0;
    if (!v) return cli_usage_error(cmd, "%s needs a value", a);
    ++*i;
    if (!strcmp(a, "--kv-store")) {
        if (o->n_urls == CLI_STORE_MAX)
            return cli_usage_error(cmd, "--kv-store: at most %d stores", CLI_STORE_MAX);
        const char *why = cli_store_url_problem(v);
        if (why) return cli_store_url_usage(cmd, v, why);
        o->urls[o->n_urls++] = v;
    } else if (!strcmp(a, "--salt")) {
        o->salt = v;
    } else if (!strcmp(a, "--kv-events") || !strcmp(a, "--kv-events-replay")) {
        /* ZeroMQ's TRANSPORT://ADDRESS, checked before the model loads (the
         * bind, after it, is the authority) */
        const size_t t = strspn(v, "abcdefghijklmnopqrstuvwxyz");
        if (t == 0 || strncmp(v + t, "://", 3) || v[t + 3] == '\0')
            return cli_usage_error(cmd, "%s '%.*s': an endpoint is TRANSPORT://ADDRESS, e.g. "
                                   "tcp://127.0.0.1:5557", a, URL_SHOW, v);
        *(!strcmp(a, "--kv-events") ? &o->events : &o->replay) = v;
    } else { /* --kv-store-write */
        int64_t n = 0;
        o->policy_set = 1;
        if (!strcmp(v, "through")) {
            o->policy = 0;
        } else if (!strcmp(v, "back")) {
            o->policy = 1;
        } else if (strncmp(v, "selective:", 10) || cli_parse_i64(v + 10, 1, 1 << 20, &n)) {
            return cli_usage_error(cmd, "--kv-store-write: expected through, back or "
                                   "selective:N (N >= 1), got '%s'", v);
        } else {
            o->policy = 2;
            o->hits = (int32_t)n;
        }
    }
    return 1;
}

int cli_store_opts_any(const cli_store_opts *o) {
    return o->n_urls > 0 || o->events || o->replay || o->json_stats;
}

int cli_store_opts_check(const char *cmd, const cli_store_opts *o) {
    if (o->replay && !o->events)
        return cli_usage_error(cmd, "--kv-events-replay needs --kv-events");
    if (o->n_urls == 0 && !o->events && o->salt) /* with --kv-events it salts the keys sent */
        fprintf(stderr, "kvcache: %s: warning: --salt without --kv-store\n", cmd);
    if (o->n_urls == 0 && o->policy_set)
        fprintf(stderr, "kvcache: %s: warning: --kv-store-write without --kv-store\n", cmd);
    return 0;
}

/* --json-stats: one line on stderr (the store's counters 0 without one). */
static void print_json_stats(const kvc_engine *eng, int has_tiers, int64_t verify_failures,
                             int64_t errors, int64_t bytes_read, int64_t bytes_written,
                             int64_t writes_dropped, double ttft_s, double decode_tok_s) {
    kvc_engine_stats es;
    memset(&es, 0, sizeof es);
    if (eng) kvc_engine_get_stats(eng, &es);
    if (!has_tiers) es.external_miss_tokens = 0; /* --kv-events alone: no store to miss */
    fprintf(stderr,
            "{\"prompt_tokens\": %lld, \"cached_tokens\": %lld, \"store_hit_tokens\": %lld, "
            "\"store_miss_tokens\": %lld, \"store_verify_failures\": %lld, \"store_errors\": "
            "%lld, \"store_bytes_read\": %lld, \"store_bytes_written\": %lld, "
            "\"store_writes_dropped\": %lld, \"ttft_s\": %.6f, \"decode_tok_s\": %.3f}\n",
            (long long)es.prompt_tokens, (long long)es.cached_tokens,
            (long long)es.external_tokens, (long long)es.external_miss_tokens,
            (long long)verify_failures, (long long)errors, (long long)bytes_read,
            (long long)bytes_written, (long long)writes_dropped, ttft_s, decode_tok_s);
}

#ifdef KVC_HAVE_STORE
/* The publisher of --kv-events, and the store's counters when the engine
 * was attached (--json-stats reports that engine's share). One store per
 * process, so file-scope handles keep the commands' calls unchanged. */
static kvc_store_events *g_events;
static kvc_store_stats g_base;

static void close_events(const char *cmd) {
    if (!g_events) return;
    kvc_store_events_stats es;
    if (kvc_store_events_get_stats(g_events, &es) == KVC_OK && es.events_dropped > 0)
        fprintf(stderr, "kvcache: %s: warning: --kv-events: %lld events dropped\n", cmd,
                (long long)es.events_dropped);
    kvc_store_events_close(g_events);
    g_events = NULL;
}

/* Opens the store of o and its publisher into *store; 0, or -1 (printed). */
static int open_store(const char *cmd, const cli_store_opts *o, kvc_store **store) {
    kvc_store_params sp = kvc_store_default_params();
    sp.write_policy = (kvc_store_write_policy)o->policy;
    sp.selective_hits = o->hits;
    /* the environment keeps a password out of the process list (redis-cli's
     * REDISCLI_AUTH does the same), read when a Redis tier is given; set but
     * empty is refused, not ignored */
    int redis = 0;
    for (int i = 0; i < o->n_urls; i++)
        redis |= !strncmp(o->urls[i], "redis://", 8) || !strncmp(o->urls[i], "unix://", 7);
    sp.redis_user = redis ? getenv("KVCACHE_REDIS_USER") : NULL;
    sp.redis_password = redis ? getenv("KVCACHE_REDIS_PASSWORD") : NULL;
    const char *bad_env = NULL;
    if (sp.redis_password && !sp.redis_password[0])
        bad_env = "KVCACHE_REDIS_PASSWORD is set but empty";
    else if (sp.redis_user && !sp.redis_password)
        bad_env = "KVCACHE_REDIS_USER is set without KVCACHE_REDIS_PASSWORD";
    else if (sp.redis_user && !sp.redis_user[0])
        bad_env = "KVCACHE_REDIS_USER is set but empty";
    if (bad_env) {
        fprintf(stderr, "kvcache: %s: --kv-store: %s\n", cmd, bad_env);
        return -1;
    }
    if (kvc_store_open(o->urls, o->n_urls, &sp, store) != KVC_OK) {
        fprintf(stderr, "kvcache: %s: --kv-store: %s\n", cmd, kvc_last_error());
        return -1;
    }
    /* events before any attach: an attach may already report pages */
    kvc_store_events_params evp = kvc_store_events_default_params();
    evp.replay_endpoint = o->replay;
    if (o->events && kvc_store_events_open_with(*store, o->events, &evp, &g_events) != KVC_OK) {
        fprintf(stderr, "kvcache: %s: --kv-events: %s\n", cmd, kvc_last_error());
        kvc_store_abandon(*store); /* and the directories its open made */
        *store = NULL;
        return -1;
    }
    return 0;
}

int cli_store_attach(const char *cmd, const cli_store_opts *o, const char *model_path,
                     const kvc_model *model, kvc_engine *eng, kvc_store **store) {
    if (o->replay && !o->events) { /* cli_store_opts_check refused it already */
        fprintf(stderr, "kvcache: %s: --kv-events-replay needs --kv-events\n", cmd);
        return -1;
    }
    if (o->n_urls == 0 && !o->events) return 0; /* --salt alone: warned at parsing */
    /* --kv-events alone: a store of no tiers carries the engine's events */
    kvc_cache_params cp;
    kvc_store_key ns;
    if (kvc_cache_get_params(kvc_engine_cache(eng), &cp) != KVC_OK ||
        kvc_store_model_namespace(model_path, model, &cp, o->salt,
                                  o->salt ? strlen(o->salt) : 0, &ns) != KVC_OK) {
        fprintf(stderr, "kvcache: %s: --kv-store: %s\n", cmd, kvc_last_error());
        return -1;
    }
    if (!*store && open_store(cmd, o, store)) return -1;
    if (kvc_store_get_stats(*store, &g_base) != KVC_OK ||
        kvc_store_attach_engine(*store, eng, &ns) != KVC_OK) {
        fprintf(stderr, "kvcache: %s: --kv-store: %s\n", cmd, kvc_last_error());
        return -1;
    }
    return 0;
}

void cli_store_finish(const char *cmd, const cli_store_opts *o, kvc_store *store,
                      const kvc_engine *eng, double ttft_s, double decode_tok_s,
                      double timeout_s) {
    if (store && kvc_store_flush(store, timeout_s) != KVC_OK)
        fprintf(stderr, "kvcache: %s: warning: %s\n", cmd, kvc_last_error());
    kvc_store_stats ss, b = g_base;
    memset(&ss, 0, sizeof ss);
    if (!store || kvc_store_get_stats(store, &ss) != KVC_OK) memset(&b, 0, sizeof b);
    /* a tier that fails (a server down, a full disk) costs the run nothing
     * but the pages it would have served or kept: said, not silent */
    if (ss.errors > b.errors) {
        char why[256] = "";
        if (kvc_store_last_tier_error(store, why, sizeof why) != KVC_OK) kvc_clear_error();
        fprintf(stderr, "kvcache: %s: warning: --kv-store: %lld tier calls failed (the last: "
                "%s): their pages were computed or not stored\n", cmd,
                (long long)(ss.errors - b.errors), why[0] ? why : "no message");
    }
    if (!o->json_stats) return;
    print_json_stats(eng, o->n_urls > 0, ss.verify_failures - b.verify_failures,
                     ss.errors - b.errors, ss.bytes_read - b.bytes_read,
                     ss.bytes_written - b.bytes_written, ss.writes_dropped - b.writes_dropped,
                     ttft_s, decode_tok_s);
}

void cli_store_detach(kvc_store *store, kvc_engine *eng) {
    if (store && eng && kvc_store_detach_engine(store, eng) != KVC_OK)
        kvc_clear_error(); /* not attached (its attach failed): nothing to report */
}

void cli_store_close(kvc_store *store) {
    close_events("kvcache"); /* before the store: it uninstalls its callback */
    kvc_store_close(store);
}
#else
int cli_store_attach(const char *cmd, const cli_store_opts *o, const char *model_path,
                     const kvc_model *model, kvc_engine *eng, kvc_store **store) {
    (void)model_path, (void)model, (void)eng;
    *store = NULL;
    if (o->n_urls == 0 && !o->events && !o->replay) return 0;
    fprintf(stderr, "kvcache: %s: --kv-store: this build has no KV store (it needs libxxhash; "
            "Debian: libxxhash-dev, which scripts/setup.sh installs)\n", cmd);
    return -1;
}

void cli_store_finish(const char *cmd, const cli_store_opts *o, kvc_store *store,
                      const kvc_engine *eng, double ttft_s, double decode_tok_s,
                      double timeout_s) {
    (void)cmd, (void)store, (void)timeout_s;
    if (o->json_stats) print_json_stats(eng, 0, 0, 0, 0, 0, 0, ttft_s, decode_tok_s);
}

void cli_store_detach(kvc_store *store, kvc_engine *eng) { (void)store, (void)eng; }
void cli_store_close(kvc_store *store) { (void)store; }
#endif
