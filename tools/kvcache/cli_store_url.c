/* The --kv-store URL syntax (cli_store.h), apart from the rest of the CLI:
 * plain C and libc, so that tests/fuzz_store_url.c can hold it against the
 * store's own parser. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_store.h"

/* Debian 12's hiredis (0.14) has no TLS (docs/KV_STORE.md section 5) */
#define NO_TLS                                                                                     \
    "rediss:// (TLS) is not supported (reach the server through a TLS tunnel to a local socket)"

/* ---- URL syntax (docs/KV_STORE.md section 5) ------------------------------
 * The grammar kvc_store_open parses, checked here so that a mistyped URL is
 * a command-line error (exit 2) before the model loads, not a failure after
 * it. The store stays the authority: what passes here may still fail to
 * open (a directory that cannot be created, a build without hiredis). */

/* s[0..n) as a count in [1, max] of at most max_len digits (nothing else);
 * -1 otherwise. */
static int64_t url_count(const char *s, size_t n, int64_t max, size_t max_len) {
    int64_t v = 0;
    if (n == 0 || n > max_len) return -1;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9' || v > (max - (s[i] - '0')) / 10) return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v >= 1 ? v : -1;
}

/* s[0..n) as a number in [0, INT32_MAX] of 1 to 10 digits: 0 or -1 (a
 * Redis database, as the store reads it). */
static int url_db(const char *s, size_t n) {
    int64_t v = 0;
    if (n == 0 || n > 10) return -1;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v <= INT32_MAX ? 0 : -1;
}

/* "write=P" (v: the text after "write=", n bytes): 0 or -1. */
static int url_policy(const char *v, size_t n) {
    if ((n == 7 && !strncmp(v, "through", 7)) || (n == 4 && !strncmp(v, "back", 4))) return 0;
    return n > 10 && !strncmp(v, "selective:", 10) &&
                   url_count(v + 10, n - 10, 1 << 20, SIZE_MAX) > 0
               ? 0
               : -1;
}

static int hex_digit(char c) {
    return (c >= '0' && c <= '9') || ((c | 32) >= 'a' && (c | 32) <= 'f');
}

/* USER:PASSWORD or :PASSWORD, s[0..n) as written: NULL if fine. */
static const char *url_userinfo(const char *s, size_t n) {
    const char *colon = memchr(s, ':', n);
    if (!colon) return "a user name needs a password (USER:PASSWORD@ or :PASSWORD@)";
    if (colon + 1 == s + n) return "empty password";
    for (size_t i = 0; i < n; i++)
        if (s[i] == '%' && (i + 2 >= n || !hex_digit(s[i + 1]) || !hex_digit(s[i + 2]) ||
                            (s[i + 1] == '0' && s[i + 2] == '0')))
            return "a bad %-escape in the credentials (want %XX, not %00)";
    return NULL;
}

/* Where server s[0..n)'s identity (what follows its credentials) starts:
 * past "USER:PASSWORD@" if any, else past the scheme; *cred the
 * credentials' start (NULL: none). As the store: for unix:// up to the
 * first "@/", for redis:// up to the last '@' before the first '/'. */
const char *cli_store_url_after_cred(const char *s, size_t n, const char **cred) {
    const int is_unix = n >= 7 && !strncmp(s, "unix://", 7);
    const char *rest = s + (is_unix ? 7 : 8), *end = s + n, *at = NULL;
    *cred = NULL;
    if (n < 8 && !is_unix) return s + n;
    if (is_unix) {
        if (rest < end && *rest != '/')
            for (const char *p = rest; p + 1 < end; p++)
                if (p[0] == '@' && p[1] == '/') {
                    at = p;
                    break;
                }
    } else {
        for (const char *p = rest; p < end && *p != '/'; p++)
            if (*p == '@') at = p;
    }
    if (!at) return rest;
    *cred = rest;
    return at + 1;
}

/* One Redis server, s[0..n): redis://[[USER]:PASSWORD@]HOST:PORT[/DB],
 * redis://...[ADDR]:PORT[/DB] or unix://[[USER]:PASSWORD@]/PATH; *has_db
 * set when it names a /DB. NULL if fine, else why not (static text). */
static const char *url_server(const char *s, size_t n, int *has_db) {
    *has_db = 0;
    if (n == 0) return "an empty server in the list";
    if (n >= 9 && !strncmp(s, "rediss://", 9)) return NO_TLS;
    const int is_unix = n >= 7 && !strncmp(s, "unix://", 7);
    if (!is_unix && (n < 8 || strncmp(s, "redis://", 8)))
        return "a server is redis://HOST:PORT or unix:///PATH";
    const char *cred, *h = cli_store_url_after_cred(s, n, &cred), *end = s + n, *colon;
    if (cred) {
        const char *why = url_userinfo(cred, (size_t)(h - 1 - cred));
        if (why) return why;
    }
    if (is_unix) {
        if (h == end || *h != '/') return "unix:// needs an absolute path (unix:///PATH)";
        if (end - h >= 108) return "the socket path is longer than 107 bytes";
        return NULL;
    }
    if (memchr(h, '@', (size_t)(end - h))) return "bad host";
    size_t hlen;
    if (*h == '[') { /* [IPv6]:PORT */
        const char *close = memchr(h, ']', (size_t)(end - h));
        if (!close || close + 1 == end || close[1] != ':') return "want redis://[ADDR]:PORT";
        h++;
        hlen = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = memchr(h, ':', (size_t)(end - h));
        if (!colon) return "missing :PORT (redis://HOST:PORT)";
        hlen = (size_t)(colon - h);
    }
    if (hlen == 0 || memchr(h, '/', hlen)) return "bad host";
    const char *slash = memchr(colon + 1, '/', (size_t)(end - colon - 1));
    if (url_count(colon + 1, (size_t)((slash ? slash : end) - colon - 1), 65535, 10) < 0)
        return "the port must be a number in [1, 65535]";
    if (slash) {
        const size_t dn = (size_t)(end - slash - 1);
        if (url_db(slash + 1, dn) < 0)
            return "a database is /N, N a number from 0";
        *has_db = 1;
    }
    return NULL;
}

/* The tier URL left once write= is taken out (u: as the store passes it to
 * the tier). */
static const char *url_tier_problem(const char *u) {
    if (!strncmp(u, "dir:", 4)) { /* dir:PATH[?max_bytes=N[K|M|G]] */
        const char *path = u + 4, *q = strchr(path, '?');
        const size_t plen = q ? (size_t)(q - path) : strlen(path);
        if (plen == 0) return "empty PATH (dir:PATH)";
        if (plen > 3900) return "PATH longer than 3900 bytes";
        if (!q) return NULL;
        if (strncmp(q + 1, "max_bytes=", 10)) return "a directory's only option is max_bytes=N";
        const char *v = q + 11;
        const size_t dn = strspn(v, "0123456789");
        const int shift = v[dn] == 'K' ? 10 : v[dn] == 'M' ? 20 : v[dn] == 'G' ? 30 : 0;
        if (v[dn + (shift > 0)] != '\0' || url_count(v, dn, INT64_MAX >> shift, SIZE_MAX) < 0)
            return "max_bytes takes a positive number of bytes, optionally with K, M or G "
                   "(e.g. max_bytes=512M), and nothing after it";
        return NULL;
    }
    if (!strncmp(u, "rediss://", 9)) return NO_TLS;
    if (strncmp(u, "redis://", 8) && strncmp(u, "unix://", 7)) return "unknown scheme";
    const size_t list_len = strcspn(u, "?");
    int query_db = 0, query_ttl = 0;
    if (u[list_len] == '?') { /* ttl=SECONDS, db=N, '&'-separated */
        const char *q = u + list_len + 1;
        do {
            const size_t n = strcspn(q, "&");
            if (n >= 3 && !strncmp(q, "db=", 3)) {
                if (url_db(q + 3, n - 3) < 0)
                    return "db= takes a database number (0, 1, ...)";
                if (query_db++) return "db= is given twice";
            } else if (n < 4 || strncmp(q, "ttl=", 4) ||
                       url_count(q + 4, n - 4, INT32_MAX, 10) < 0) {
                return "a Redis tier's options are ttl=SECONDS (a positive integer) and db=N";
            } else if (query_ttl++) {
                return "ttl= is given twice";
            }
            q += n;
        } while (*q++ == '&');
    }
    int n_srv = 1;
    for (size_t i = 0; i < list_len; i++) n_srv += u[i] == ',';
    if (n_srv > 64) return "more than 64 servers";
    for (const char *s = u;; s++) { /* each server, s[0..len) */
        const size_t len = strcspn(s, ",?");
        int has_db;
        const char *why = url_server(s, len, &has_db);
        if (why) return why;
        if (has_db && query_db) return "a server has a /DB and the URL ?db=N too";
        const char *cred, *id = cli_store_url_after_cred(s, len, &cred);
        for (const char *t = u; t < s; t += strcspn(t, ",?") + 1) { /* the same server twice */
            const size_t tn = strcspn(t, ",?");
            const char *tid = cli_store_url_after_cred(t, tn, &cred);
            if (tid - t >= 7 && id - s >= 7 && t[0] == s[0] && /* same scheme, same rest */
                (size_t)(t + tn - tid) == (size_t)(s + len - id) && !strncmp(tid, id, s + len - id))
                return "a server listed twice";
        }
        s += len;
        if (*s != ',') break;
        if (s + 1 == u + list_len) return "an empty server in the list"; /* a trailing ',' */
    }
    return NULL;
}

const char *cli_store_url_problem(const char *url) {
    /* as kvc_store_open: write=P comes out of the options after the last
     * '?', the others stay for the tier, which parses what is left */
    const char *q = strrchr(url, '?');
    char *u = malloc(strlen(url) + 1), *o = u;
    if (!u) return NULL; /* no memory to check with: the store will say */
    memcpy(u, url, q ? (size_t)(q - url) : strlen(url) + 1);
    const char *why = NULL;
    if (q) {
        o += q - url;
        int writes = 0, kept = 0;
        for (const char *p = q + 1;;) {
            const char *e = strchr(p, '&');
            const size_t n = e ? (size_t)(e - p) : strlen(p);
            if (n >= 6 && !strncmp(p, "write=", 6)) {
                if (writes++) why = "write= given twice";
                else if (url_policy(p + 6, n - 6))
                    why = "write= takes through, back or selective:N (1 <= N <= 1048576)";
            } else {
                *o++ = kept++ ? '&' : '?';
                memcpy(o, p, n);
                o += n;
            }
            if (!e || why) break;
            p = e + 1;
        }
        *o = '\0';
    }
    if (!why) why = url_tier_problem(u);
    for (volatile char *p = u; *p; p++) *p = 0; /* a copy of the URL: it may hold a password */
    free(u);
    return why;
}

size_t cli_store_url_shown(const char *url, char *out, size_t cap) {
    size_t o = 0, need = 0;
    int full = cap == 0; /* once a piece does not fit, nothing after it is written */
    const char *s = url;
    if (!strncmp(url, "redis://", 8) || !strncmp(url, "unix://", 7)) {
        const size_t list_len = strcspn(url, "?");
        while (s < url + list_len) { /* each server: the scheme, then past USER:PASSWORD@ */
            const size_t n = strcspn(s, ",?");
            const char *cred, *id = cli_store_url_after_cred(s, n, &cred);
            const size_t pre = cred ? (size_t)(cred - s) : n, rest = cred ? (size_t)(s + n - id) : 0;
            const size_t len = pre + rest + (s[n] == ',');
            if (!full && o + len < cap) {
                memcpy(out + o, s, pre);
                memcpy(out + o + pre, id, rest);
                o += pre + rest;
                if (s[n] == ',') out[o++] = ',';
            } else {
                full = 1;
            }
            need += len;
            s += n + (s[n] == ',');
        }
    }
    const size_t tail = strlen(s); /* the options */
    if (!full) snprintf(out + o, cap - o, "%s", s);
    else if (cap) out[o] = '\0';
    return need + tail;
}
