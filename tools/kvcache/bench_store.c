/*
 * `kvcache bench store`: the KV store's data path (store.h), in GB/s of
 * page payload, against references measured in the same run:
 *   serialize  kvc_store_serialize_page (page -> object: copy + checksums)
 *   restore    kvc_store_restore_page (verify every check + write the page)
 *              both against memcpy of the same bytes (goal >= 0.5), the
 *              three sampled in turn
 *   put / get  for each --kv-store: N objects queued and flushed
 *              (kvc_store_put + kvc_store_flush), then restored
 *              (kvc_store_restore_run: tier read + verify + write);
 *              for a Redis URL also `redis-benchmark` SET/GET of the same
 *              value size and pipelining (goal >= 0.7), when installed;
 *              ours and redis-benchmark's in turn, ROUNDS times, the
 *              median of each (one run of each moved the ratio by 2x on a
 *              shared 2-vCPU VM).
 * The page geometry is SmolLM2-135M's float16 page (30 layers, 3 KV heads,
 * Dh 64, 16 tokens: 368,640 bytes) unless given.
 */
#define _POSIX_C_SOURCE 200809L /* popen */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "cli_store.h"
#include "kvcache/kvcache.h"
#ifdef KVC_HAVE_STORE
#include "kvcache/store.h"
#endif

static const char usage[] =
    "usage: kvcache bench store [--kv-store URL]... [options]\n"
    "\n"
    "  --kv-store URL   a store to time put and get against (repeatable): dir:PATH,\n"
    "                   redis://HOST:PORT, unix:///PATH (its objects are left there)\n"
    "  --pages N        pages per pass (default 128: a 2048-token prompt)\n"
    "  --layers N, --heads N, --head-dim N, --page-size N\n"
    "                   page geometry (default 30, 3, 64, 16: SmolLM2-135M, f16)\n"
    "  --time SECONDS   time per case (default 1; put and get of a store in 3 rounds,\n"
    "                   redis-benchmark after each: the medians are compared)\n"
    "  --json           one JSON object per line\n";

#ifdef KVC_HAVE_STORE

enum { ROUNDS = 3 }; /* put/get samples, then redis-benchmark, ROUNDS times */

typedef struct bs bs;
struct bs {
    kvc_cache *src, *dst;
    int32_t *ids, *dids, *tok;
    int64_t n, ps; /* pages, tokens a page */
    size_t obj_bytes, page_bytes;
    unsigned char *objs; /* n objects */
    unsigned char *flat; /* n pages, memcpy source / destination */
    unsigned char *flat2;
    kvc_store_key ns;
    kvc_store_key *keys;
};

static double median(double *t, int k) {
    for (int i = 1; i < k; i++) /* insertion sort: few samples */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    return t[k / 2];
}

/* GB/s of fn_a .. fn_c (bytes per call), sampled in turn (a, b, c, a, b, c,
 * ...) so that every case sees the same moments of a shared machine: the
 * median of each. NULL functions are skipped; -1 if one fails. */
static int interleaved_rates(int (*const *fns)(struct bs *), int n_fns, struct bs *b,
                             double budget, double bytes, double *gbs) {
    double t[4][64];
    int k = 0;
    const double end = bench_now() + budget;
    do {
        for (int f = 0; f < n_fns; f++) {
            const double t0 = bench_now();
            if (fns[f](b)) return -1;
            t[f][k] = bench_now() - t0;
        }
        k++;
    } while (k < 64 && (bench_now() < end || k < 5));
    for (int f = 0; f < n_fns; f++) gbs[f] = bytes / median(t[f], k) / 1e9;
    return 0;
}

static void expect_of(bs *b, int64_t pg, kvc_store_expect *e) {
    e->ns = b->ns;
    e->key = b->keys[pg];
    e->parent = pg > 0 ? b->keys[pg - 1] : b->ns;
    e->position = pg * b->ps;
    e->tokens = b->tok + pg * b->ps;
}

static int do_memcpy(bs *b) {
    memcpy(b->flat2, b->flat, (size_t)b->n * b->page_bytes);
    return 0;
}

static int do_serialize(bs *b) {
    for (int64_t i = 0; i < b->n; i++) {
        kvc_store_expect e;
        expect_of(b, i, &e);
        if (kvc_store_serialize_page(b->src, b->ids[i], &e, NULL, b->objs + i * b->obj_bytes,
                                     b->obj_bytes, NULL) != KVC_OK)
            return -1;
    }
    return 0;
}

static int do_restore(bs *b) {
    for (int64_t i = 0; i < b->n; i++) {
        kvc_store_expect e;
        expect_of(b, i, &e);
        if (kvc_store_restore_page(b->dst, b->dids[i], b->objs + i * b->obj_bytes, b->obj_bytes,
                                   &e, NULL, NULL) != KVC_OK)
            return -1;
    }
    return 0;
}

static kvc_store *g_store;

static int do_put(bs *b) {
    for (int64_t i = 0; i < b->n; i++)
        if (kvc_store_put(g_store, &b->ns, &b->keys[i], b->objs + i * b->obj_bytes,
                          b->obj_bytes) != KVC_OK)
            return -1;
    return kvc_store_flush(g_store, 60.0) == KVC_OK ? 0 : -1;
}

static int do_get(bs *b) {
    int64_t got = 0;
    if (kvc_store_restore_run(g_store, b->dst, &b->ns, b->tok, 0, b->n, b->dids, &got) != KVC_OK)
        return -1;
    if (got != b->n) {
        fprintf(stderr, "kvcache: bench store: restored %lld of %lld pages\n", (long long)got,
                (long long)b->n);
        return -1;
    }
    return 0;
}

/* s[0..n) single-quoted for sh into dst (a ' as '\''); "" when it does not fit. */
static void shell_quote(char *dst, size_t cap, const char *s, size_t n) {
    size_t o = 0;
    dst[0] = 0;
    if (cap < 3) return;
    dst[o++] = '\'';
    for (size_t i = 0; i < n; i++) {
        if (o + 6 >= cap) {
            dst[0] = 0;
            return;
        }
        if (s[i] == '\'') {
            memcpy(dst + o, "'\\''", 4);
            o += 4;
        } else {
            dst[o++] = s[i];
        }
    }
    dst[o++] = '\'';
    dst[o] = 0;
}

/* s[0..n) with %XX decoded, shell-quoted into dst ("" if it does not fit). */
static void quote_decoded(char *dst, size_t cap, const char *s, size_t n) {
    char d[256];
    size_t o = 0;
    for (size_t i = 0; i < n && o + 1 < sizeof d; i++) {
        unsigned v;
        if (s[i] == '%' && i + 2 < n && sscanf(s + i + 1, "%2x", &v) == 1) {
            d[o++] = (char)v;
            i += 2;
        } else {
            d[o++] = s[i];
        }
    }
    shell_quote(dst, cap, d, o);
}

/* requests/s of redis-benchmark's SET and GET (value bytes, pipeline 32)
 * against url's first server (its credentials and database too); 0 when it
 * cannot run. The host or socket path goes to the shell quoted. */
static void redis_benchmark(const char *url, size_t value, int64_t n, double *set_rps,
                            double *get_rps) {
    *set_rps = *get_rps = 0;
    char target[1400], q[520], cmd[1600], user[300] = "", pass[300] = "";
    const size_t len = strcspn(url, ",?");
    const char *cred, *id = cli_store_url_after_cred(url, len, &cred), *end = url + len;
    if (cred) { /* USER:PASSWORD@ (checked by cli_store_url_problem) */
        const char *colon = memchr(cred, ':', (size_t)(id - 1 - cred));
        if (colon > cred) quote_decoded(user, sizeof user, cred, (size_t)(colon - cred));
        quote_decoded(pass, sizeof pass, colon + 1, (size_t)(id - 2 - colon));
        if (!pass[0] || (colon > cred && !user[0])) return;
    }
    const char *qdb = strstr(url + len, "db="), *slash = NULL;
    if (!strncmp(url, "unix://", 7)) {
        shell_quote(q, sizeof q, id, (size_t)(end - id));
        snprintf(target, sizeof target, "-s %s", q);
    } else {
        const char *h = id; /* HOST:PORT or [ADDR]:PORT */
        const char *hend = memchr(h, *h == '[' ? ']' : ':', (size_t)(end - h));
        if (!hend) return;
        if (*h == '[') h++;
        const char *port = strchr(hend, ':');
        slash = memchr(hend, '/', (size_t)(end - hend));
        shell_quote(q, sizeof q, h, (size_t)(hend - h));
        snprintf(target, sizeof target, "-h %s -p %d", q, port ? atoi(port + 1) : 6379);
    }
    const long db = slash                                          ? atol(slash + 1)
                    : qdb && (qdb[-1] == '?' || qdb[-1] == '&') ? atol(qdb + 3)
                                                                  : 0;
    const size_t tl = strlen(target);
    snprintf(target + tl, sizeof target - tl, "%s%s%s%s --dbnum %ld", user[0] ? " --user " : "",
             user, pass[0] ? " -a " : "", pass, db);
    if (!q[0]) return;
    snprintf(cmd, sizeof cmd, "redis-benchmark %s -c 1 -t set,get -d %zu -P 32 -n %lld -r %lld "
             "--csv 2>/dev/null", target, value, (long long)(n * 4), (long long)n);
    FILE *f = popen(cmd, "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        double rps = 0;
        if (sscanf(line, "\"SET\",\"%lf\"", &rps) == 1) *set_rps = rps;
        if (sscanf(line, "\"GET\",\"%lf\"", &rps) == 1) *get_rps = rps;
    }
    pclose(f);
}

static void report(int json, const char *what, const char *url, double gbs, double ref,
                   const char *ref_name) {
    if (json) {
        printf("{\"type\": \"case\", \"target\": \"bench-store\", \"case\": \"%s\", ", what);
        fputs("\"store\": ", stdout);
        bench_json_str(stdout, url ? url : "");
        printf(", \"gb_s\": %.3f, \"ref\": \"%s\", \"ref_gb_s\": %.3f, \"ratio\": %.3f}\n", gbs,
               ref_name, ref, ref > 0 ? gbs / ref : 0.0);
    } else {
        printf("%-10s %-40s %9.2f %9.2f %-16s %6.2f\n", what, url ? url : "-", gbs, ref,
               ref_name, ref > 0 ? gbs / ref : 0.0);
    }
    bench_flush("store");
}

int bench_store(int argc, char **argv) {
    const char *cmd = "bench store";
    const char *urls[16];
    int n_urls = 0, json = 0;
    int64_t pages = 128, layers = 30, heads = 3, dh = 64, ps = 16;
    double budget = 1.0;
    static const char *const with_value[] = {
        "--pages", "--layers", "--heads", "--head-dim", "--page-size", "--kv-store",
        "--time", NULL};
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (cli_is_help(a)) {
            fputs(usage, stdout);
            return CLI_EXIT_OK;
        }
        if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        }
        if (!cli_is_one_of(a, with_value))
            return cli_usage_error(cmd, "unexpected argument '%s'", a);
        if (!v) return cli_usage_error(cmd, "%s needs a value", a);
        i++;
        int64_t *dst = !strcmp(a, "--pages")       ? &pages
                       : !strcmp(a, "--layers")    ? &layers
                       : !strcmp(a, "--heads")     ? &heads
                       : !strcmp(a, "--head-dim")  ? &dh
                       : !strcmp(a, "--page-size") ? &ps
                                                   : NULL;
        if (dst) {
            if (cli_opt_i64(cmd, a, v, 1, 1 << 16, dst)) return CLI_EXIT_USAGE;
        } else if (!strcmp(a, "--kv-store")) {
            if (n_urls == 16) return cli_usage_error(cmd, "at most 16 --kv-store");
            const char *why = cli_store_url_problem(v);
            if (why) return cli_store_url_usage(cmd, v, why);
            urls[n_urls++] = v;
        } else if (!strcmp(a, "--time")) {
            if (cli_parse_seconds(v, 600, &budget))
                return cli_usage_error(cmd, "--time: expected seconds in (0, 600], got '%s'", v);
        } else {
            return cli_usage_error(cmd, "unexpected argument '%s'", a);
        }
    }
    /* every page lives five times (two caches, the objects, two flat copies)
     * at 4 bytes per element (float16 K and V): sizes past the limit are
     * refused before any allocation by the guard every bench target shares,
     * rather than left to fail or to the OOM killer once the buffers are
     * filled (double: the product of the options can pass int64) */
    const double need = 5.0 * 4.0 * (double)pages * (double)layers * (double)heads * (double)dh *
                        (double)ps;
    if (bench_check_size(cmd, 0, need, "--pages, --layers, --heads, --head-dim or --page-size"))
        return CLI_EXIT_USAGE;
    bs b;
    memset(&b, 0, sizeof b);
    int rc = CLI_EXIT_FAIL;
    kvc_cache_params cp = kvc_cache_default_params();
    cp.num_layers = (int32_t)layers;
    cp.num_kv_heads = (int32_t)heads;
    cp.head_dim = (int32_t)dh;
    cp.page_size = (int32_t)ps;
    cp.num_pages = pages;
    cp.dtype = KVC_F16;
    b.n = pages;
    b.ps = ps;
    if (kvc_cache_create(&cp, &b.src) != KVC_OK || kvc_cache_create(&cp, &b.dst) != KVC_OK)
        goto fail;
    b.page_bytes = kvc_cache_page_bytes(b.src);
    b.obj_bytes = kvc_store_object_bytes(b.src, 0);
    b.ids = malloc((size_t)pages * sizeof(int32_t));
    b.dids = malloc((size_t)pages * sizeof(int32_t));
    b.tok = malloc((size_t)(pages * ps) * sizeof(int32_t));
    b.keys = malloc((size_t)pages * sizeof(kvc_store_key));
    b.objs = malloc((size_t)pages * b.obj_bytes);
    b.flat = malloc((size_t)pages * b.page_bytes);
    b.flat2 = malloc((size_t)pages * b.page_bytes);
    if (!b.ids || !b.dids || !b.tok || !b.keys || !b.objs || !b.flat || !b.flat2) {
        fprintf(stderr, "kvcache: %s: out of memory\n", cmd);
        goto out;
    }
    for (int64_t i = 0; i < pages * ps; i++) b.tok[i] = (int32_t)(i * 7919 % 49152);
    uint64_t r = 1;
    for (size_t i = 0; i < (size_t)pages * b.page_bytes; i++) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        b.flat[i] = (unsigned char)(r >> 56);
    }
    memset(b.flat2, 0, (size_t)pages * b.page_bytes);
    kvc_seq_id s, d;
    int64_t hit;
    int32_t indptr[2], last;
    int64_t np;
    for (int k = 0; k < 16; k++) b.ns.b[k] = (uint8_t)(0xa0 + k);
    if (kvc_cache_add_sequence(b.src, b.tok, pages * ps, 0, &s, &hit) != KVC_OK ||
        kvc_cache_add_sequence(b.dst, NULL, pages * ps, 0, &d, &hit) != KVC_OK ||
        kvc_cache_page_table(b.src, &s, 1, indptr, b.ids, pages, &last, &np) != KVC_OK ||
        kvc_cache_page_table(b.dst, &d, 1, indptr, b.dids, pages, &last, &np) != KVC_OK ||
        kvc_store_page_keys(&b.ns, b.tok, pages, (int32_t)ps, 1, b.keys) != KVC_OK)
        goto fail;
    for (int64_t i = 0; i < pages; i++)
        if (kvc_cache_write_page(b.src, b.ids[i], b.flat + (size_t)i * b.page_bytes,
                                 b.page_bytes) != KVC_OK)
            goto fail;
    const double bytes = (double)pages * (double)b.page_bytes;
    if (!json) {
        printf("# page %zu bytes (%lld layers, %lld KV heads, Dh %lld, %lld tokens, f16), "
               "%lld pages a pass; GB/s of payload (1e9 bytes/s)\n",
               b.page_bytes, (long long)layers, (long long)heads, (long long)dh, (long long)ps,
               (long long)pages);
        printf("%-10s %-40s %9s %9s %-16s %6s\n", "case", "store", "GB/s", "ref_GB/s", "ref",
               "ratio");
    }
    int (*const fns[3])(bs *) = {do_memcpy, do_serialize, do_restore};
    double r3[3];
    if (interleaved_rates(fns, 3, &b, budget, bytes, r3)) goto fail;
    const double mc = r3[0], ser = r3[1], res = r3[2];
    report(json, "serialize", NULL, ser, mc, "memcpy");
    report(json, "restore", NULL, res, mc, "memcpy");
    for (int u = 0; u < n_urls; u++) {
        kvc_store_params sp = kvc_store_default_params();
        sp.queue_bytes = (int64_t)(2 * pages * (int64_t)b.obj_bytes);
        sp.queue_objects = (int32_t)(2 * pages);
        if (kvc_store_open(&urls[u], 1, &sp, &g_store) != KVC_OK) goto fail;
        int (*const fns2[2])(bs *) = {do_put, do_get};
        const int redis = strncmp(urls[u], "dir:", 4) != 0;
        double put_s[ROUNDS], get_s[ROUNDS], set_rps[ROUNDS], get_rps[ROUNDS];
        int bad = 0;
        for (int k = 0; k < ROUNDS && !bad; k++) {
            double r2[2] = {-1, -1};
            bad = interleaved_rates(fns2, 2, &b, budget / ROUNDS, bytes, r2);
            put_s[k] = r2[0], get_s[k] = r2[1];
            set_rps[k] = get_rps[k] = 0;
            if (!bad && redis)
                redis_benchmark(urls[u], b.obj_bytes, pages, &set_rps[k], &get_rps[k]);
        }
        const double put = bad ? -1 : median(put_s, ROUNDS), get = bad ? -1 : median(get_s, ROUNDS);
        kvc_store_stats st;
        kvc_store_get_stats(g_store, &st);
        kvc_store_close(g_store);
        g_store = NULL;
        char shown[1200]; /* no password in the output */
        cli_store_url_shown(urls[u], shown, sizeof shown);
        if (put < 0 || get < 0 || st.errors || st.writes_failed || st.writes_dropped) {
            fprintf(stderr, "kvcache: %s: %s: errors %lld, failed %lld, dropped %lld writes\n",
                    cmd, shown, (long long)st.errors, (long long)st.writes_failed,
                    (long long)st.writes_dropped);
            goto out;
        }
        const double ref_set = median(set_rps, ROUNDS) * (double)b.page_bytes / 1e9,
                     ref_get = median(get_rps, ROUNDS) * (double)b.page_bytes / 1e9;
        report(json, "put", shown, put, ref_set > 0 ? ref_set : mc,
               ref_set > 0 ? "redis-benchmark" : "memcpy");
        report(json, "get", shown, get, ref_get > 0 ? ref_get : mc,
               ref_get > 0 ? "redis-benchmark" : "memcpy");
    }
    rc = CLI_EXIT_OK;
    goto out;
fail:
    fprintf(stderr, "kvcache: %s: %s\n", cmd, kvc_last_error());
out:
    kvc_store_close(g_store);
    g_store = NULL;
    kvc_cache_destroy(b.src);
    kvc_cache_destroy(b.dst);
    free(b.ids), free(b.dids), free(b.tok), free(b.keys), free(b.objs), free(b.flat),
        free(b.flat2);
    return rc;
}
#else
int bench_store(int argc, char **argv) {
    (void)argc, (void)argv;
    fprintf(stderr, "kvcache: bench store: this build has no KV store (it needs libxxhash; "
            "Debian: libxxhash-dev, which scripts/setup.sh installs)\n");
    return CLI_EXIT_FAIL;
}
#endif
