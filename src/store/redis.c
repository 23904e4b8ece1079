/*
 * The Redis tier (tier.h): objects as Redis strings under
 * "kvc:<ns hex>:<key hex>", spread over one or more servers by rendezvous
 * hashing, so that adding or losing a server moves or costs only its keys.
 *
 * Each server has two connections, one per caller role (tier.h: readers
 * probe, get and invalidate; the writer thread puts), each behind its own
 * mutex, so that a read never waits behind a large write (readers on
 * several threads take the read connection in turn). Every call
 * pipelines: all commands for a server are appended, then all replies read
 * (one round trip per server per call).
 *
 * A connection that fails (I/O, protocol, timeout) is dropped and its server
 * counts as down for an exponential back-off; calls touching it meanwhile
 * fail at once with KVC_ERR_IO instead of waiting on it, and the next call
 * after the back-off reconnects.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, sigtimedwait */
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>

#include <hiredis/hiredis.h>
#include <xxhash.h>

#include "../core/internal.h"
#include "tier.h"

enum {
    MAX_SERVERS = 64,
    CONNECT_MS = 200,      /* a local or LAN server answers far sooner */
    COMMAND_MS = 2000,     /* per socket read/write, not per call */
    BACKOFF_MIN_MS = 50,
    BACKOFF_MAX_MS = 2000,
    DEADLINE_SLACK_MS = 10, /* a read under a deadline may end this much past it */
    SILENT_MS = 100,        /* no byte for this long (or the socket timeout): down */
    KEY_NAME_LEN = 4 + 32 + 1 + 32, /* "kvc:" ns ":" key */
};

/* One connection and its own down state: the reader and the writer each
 * find out about a lost server, and back off, on their own. */
typedef struct conn {
    pthread_mutex_t mu;
    redisContext *ctx;   /* NULL: not connected */
    const kvc_tier *tier; /* its pool receives GET replies */
    redisReplyObjectFunctions fn; /* hiredis's, with create_string */
    void *(*base_string)(const redisReadTask *, char *, size_t); /* hiredis's */
    int64_t cmd_ms, cur_ms; /* socket timeout: the connection's own, the one set now */
    int64_t retry_at_ns; /* while down: no connect attempt before this */
    int64_t backoff_ms;  /* the next back-off */
    char why[448];       /* the last failure, for messages while down */
    char distrust[96];   /* a reply of the wrong type came: drop at release ("": none) */
} conn;

typedef struct server {
    char *url;     /* as given less USER:PASSWORD@: its identity for hashing and messages */
    char *host;    /* redis://HOST:PORT, or NULL */
    int port;
    char *path;    /* unix://PATH, or NULL */
    char *user, *pass; /* AUTH [USER] PASSWORD on connect (decoded), or NULL */
    long db;       /* SELECT db on connect when > 0 */
    uint64_t seed; /* XXH3 of url: the rendezvous seed */
    conn rd, wr;   /* reads (probe, get, invalidate), writes (put) */
} server;

typedef struct redis_tier {
    kvc_tier base;
    server *srv;
    int n_srv;
    long ttl; /* seconds, 0: none */
    long db;  /* ?db=N for the servers without /DB, -1: none */
} redis_tier;

/* ---- time, signals -------------------------------------------------------- */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* hiredis writes with write(2): a server that closed its end would raise
 * SIGPIPE and kill the host process. A library must not change the
 * process's signal handling, so the calling thread blocks SIGPIPE around
 * its socket I/O and discards the one the I/O raised (it is thread-directed
 * and stays pending while blocked); one already pending is left alone. */
typedef struct pipe_guard {
    sigset_t old;
    int was_pending;
} pipe_guard;

static void pipe_block(pipe_guard *g) {
    sigset_t s, pend;
    sigemptyset(&s);
    sigaddset(&s, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &s, &g->old);
    g->was_pending = sigpending(&pend) == 0 && sigismember(&pend, SIGPIPE) == 1;
}

static void pipe_unblock(pipe_guard *g) {
    if (!g->was_pending) {
        sigset_t s;
        sigemptyset(&s);
        sigaddset(&s, SIGPIPE);
        struct timespec zero = {0, 0};
        while (sigtimedwait(&s, NULL, &zero) == SIGPIPE) {
        }
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

/* ---- connections ---------------------------------------------------------- */

/* hiredis's string reply, except that a top-level bulk string (a GET's
 * object) is copied into a buffer of the tier's pool (tier.h) instead of a
 * fresh malloc block of hiredis: the same one copy, into memory that is
 * already mapped. take_reply then takes the buffer over. */
static void *create_string(const redisReadTask *task, char *str, size_t len) {
    const conn *c = task->privdata;
    if (task->type != REDIS_REPLY_STRING || task->parent) return c->base_string(task, str, len);
    redisReply *r = c->base_string(task, str, 0);
    char *buf = r ? kvc__objpool_get(c->tier->pool, len) : NULL;
    if (!buf) {
        if (r) freeReplyObject(r);
        return NULL; /* hiredis: out of memory */
    }
    memcpy(buf, str, len);
    free(r->str);
    r->str = buf;
    r->len = len;
    return r;
}

/* Drops c's context (c->mu held); with down, starts or doubles the back-off. */
static void conn_drop(conn *c, int down, const char *why) {
    if (c->ctx) redisFree(c->ctx);
    c->ctx = NULL;
    snprintf(c->why, sizeof c->why, "%s", why);
    if (!down) return;
    c->retry_at_ns = now_ns() + c->backoff_ms * 1000000;
    c->backoff_ms = c->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : c->backoff_ms * 2;
}

/* The server's words (an error reply's text) as a message may show them:
 * up to a quote, since Redis quotes the arguments of a command it does not
 * know (AUTH renamed away), the password among them; words that hold the
 * password before that are not shown at all. At most 100 bytes. */
static void server_words(const server *sv, const char *words, char out[128]) {
    size_t wlen = strcspn(words, "'`\"\r\n");
    if (wlen > 100) wlen = 100;
    const char *hit = sv->pass ? strstr(words, sv->pass) : NULL;
    if (hit && (size_t)(hit - words) < wlen) {
        words = "(not shown: it quotes the password)";
        wlen = strlen(words);
    }
    snprintf(out, 128, "%.*s", (int)wlen, words);
}

/* The error reply a server sent before it closed the connection, which a
 * failed write leaves unread: Redis answers an unauthenticated client's
 * large request ("unauthenticated bulk length") or a client past maxclients
 * that way, and the write then fails with EPIPE. Best effort (a
 * non-blocking read of what has arrived); "" when there is none. */
static void last_words(const server *sv, const conn *c, char out[128]) {
    out[0] = 0;
    if (!c->ctx || c->ctx->fd < 0 || (c->ctx->err != REDIS_ERR_IO && c->ctx->err != REDIS_ERR_EOF))
        return;
    char buf[256];
    const ssize_t n = recv(c->ctx->fd, buf, sizeof buf - 1, MSG_DONTWAIT);
    if (n < 2 || buf[0] != '-') return;
    buf[n] = 0;
    server_words(sv, buf + 1, out);
}

/* An I/O or protocol failure on c (c->mu held): drop, back off, report. */
static kvc_status conn_fail(server *sv, conn *c, const char *what) {
    char why[448], said[128];
    last_words(sv, c, said);
    const int auth = !sv->pass && (strstr(said, "NOAUTH") || strstr(said, "unauthenticated"));
    snprintf(why, sizeof why, "%.40s: %.100s%s%s%s%s", what,
             c->ctx && c->ctx->errstr[0] ? c->ctx->errstr : "connection lost",
             said[0] ? " (the server said: " : "", said,
             auth ? "; give the password in the URL or as the store's redis_password, "
                    "kvcache CLI: KVCACHE_REDIS_PASSWORD"
                  : "",
             said[0] ? ")" : "");
    conn_drop(c, 1, why);
    return kvc__error(KVC_ERR_IO, "redis tier: server %s: %s", sv->url, why);
}

/* Sets c's socket timeout (both ways) to ms; -1 on failure. */
static int conn_timeout(conn *c, int64_t ms) {
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)(ms % 1000 * 1000)};
    if (redisSetTimeout(c->ctx, tv) != REDIS_OK) return -1;
    c->cur_ms = ms;
    return 0;
}

static kvc_status conn_reply_by(server *sv, conn *c, int64_t deadline_ns, redisReply **out);

/* AUTH and SELECT on a fresh connection (c->mu held, SIGPIPE blocked), by
 * deadline_ns when not 0 (each reply read as a deadline-bound GET's is: a
 * server that answers late or trickles cannot hold a load past it): 0
 * done, 1 no reply (the caller fails it as a connect), -1 the server
 * refused or the deadline passed: c is dropped (a refusal with back-off:
 * wrong credentials or database do not fix themselves; retrying at once
 * would only hammer the server) and the error set. */
static int conn_handshake(server *sv, conn *c, int64_t deadline_ns) {
    for (int step = 0; step < 2; step++) {
        int rc;
        if (step == 0 && sv->pass)
            rc = sv->user ? redisAppendCommand(c->ctx, "AUTH %s %s", sv->user, sv->pass)
                          : redisAppendCommand(c->ctx, "AUTH %s", sv->pass);
        else if (step == 1 && sv->db > 0)
            rc = redisAppendCommand(c->ctx, "SELECT %ld", sv->db);
        else
            continue;
        redisReply *r = NULL;
        if (rc != REDIS_OK) return 1;
        if (!deadline_ns) {
            if (redisGetReply(c->ctx, (void **)&r) != REDIS_OK || !r) {
                if (r) freeReplyObject(r);
                return 1;
            }
        } else if (conn_reply_by(sv, c, deadline_ns, &r) != KVC_OK) {
            return -1; /* dropped, with back-off */
        } else if (!r) { /* past the deadline: dropped, no back-off (it was answering) */
            kvc__error(KVC_ERR_IO, "redis tier: server %s: no reply to %s by the load's deadline",
                       sv->url, step ? "SELECT" : "AUTH");
            return -1;
        }
        if (r->type == REDIS_REPLY_STATUS) {
            freeReplyObject(r);
            continue;
        }
        char words[128], why[160];
        server_words(sv, r->type == REDIS_REPLY_ERROR && r->str ? r->str : "unexpected reply",
                     words);
        snprintf(why, sizeof why, "%s refused: %s", step ? "SELECT" : "AUTH", words);
        freeReplyObject(r);
        conn_drop(c, 1, why);
        kvc__error(KVC_ERR_IO, "redis tier: server %s: %s", sv->url, why);
        return -1;
    }
    return 0;
}

/* Locks c and makes sure it is connected (by deadline_ns when not 0). On
 * failure c is unlocked again and the status is KVC_ERR_IO (at once while
 * the server is down). */
static kvc_status conn_acquire(server *sv, conn *c, int64_t deadline_ns, pipe_guard *g) {
    pthread_mutex_lock(&c->mu);
    pipe_block(g); /* the handshake writes too */
    if (!c->ctx) {
        int64_t wait = c->retry_at_ns - now_ns();
        if (wait > 0) {
            pipe_unblock(g);
            pthread_mutex_unlock(&c->mu);
            return kvc__error(KVC_ERR_IO, "redis tier: server %s is down (%s); retry in %lld ms",
                              sv->url, c->why, (long long)(wait / 1000000 + 1));
        }
        /* reads wait no longer than a load may (tier.h: read_timeout_ms) */
        int64_t conn_ms = CONNECT_MS, cmd_ms = COMMAND_MS, lim = c->tier->read_timeout_ms;
        if (c == &sv->rd && lim > 0) {
            conn_ms = lim < conn_ms ? lim : conn_ms;
            cmd_ms = lim < cmd_ms ? lim : cmd_ms;
        }
        const int64_t left_ms = deadline_ns ? (deadline_ns - now_ns()) / 1000000 + 1 : conn_ms;
        if (left_ms < conn_ms) conn_ms = left_ms > 1 ? left_ms : 1; /* 0 is no limit */
        struct timeval tv = {(time_t)(conn_ms / 1000), (suseconds_t)(conn_ms % 1000 * 1000)};
        c->ctx = sv->path ? redisConnectUnixWithTimeout(sv->path, tv)
                          : redisConnectWithTimeout(sv->host, sv->port, tv);
        c->cmd_ms = cmd_ms;
        /* the handshake waits no longer than the connect may */
        int hs = !c->ctx || c->ctx->err || conn_timeout(c, conn_ms < cmd_ms ? conn_ms : cmd_ms)
                     ? 1
                     : conn_handshake(sv, c, deadline_ns);
        if (hs == 0 && conn_timeout(c, cmd_ms) != 0) hs = 1;
        if (hs != 0) {
            kvc_status st = KVC_ERR_IO; /* hs < 0: conn_handshake set the error */
            if (hs > 0 && c->ctx) st = conn_fail(sv, c, "cannot connect");
            else if (hs > 0) {
                conn_drop(c, 1, "cannot connect: out of memory");
                st = kvc__error(KVC_ERR_IO, "redis tier: server %s: %s", sv->url, c->why);
            }
            pipe_unblock(g);
            pthread_mutex_unlock(&c->mu);
            return st;
        }
        /* keep the reader's buffer between replies: pages are ~0.1-1 MB,
         * and the default (free it above 16 KiB) regrows it for each */
        c->ctx->reader->maxbuf = 0;
        if (!c->ctx->reader->privdata) { /* unused by hiredis itself */
            c->fn = *c->ctx->reader->fn;
            c->base_string = c->fn.createString;
            c->fn.createString = create_string;
            c->ctx->reader->fn = &c->fn;
            c->ctx->reader->privdata = c;
        }
    }
    return KVC_OK;
}

/* Unlocks c; a call that kept its connection resets the back-off and the
 * socket timeout a deadline lowered (the next call may have none). */
static void conn_release(conn *c, pipe_guard *g) {
    pipe_unblock(g);
    if (c->distrust[0]) { /* conn_protocol: the replies were read, now let it go */
        if (c->ctx) conn_drop(c, 1, c->distrust);
        c->distrust[0] = 0;
    }
    if (c->ctx && c->cur_ms != c->cmd_ms && conn_timeout(c, c->cmd_ms) != 0)
        conn_drop(c, 0, "cannot set the socket timeout"); /* reconnect next time */
    if (c->ctx) c->backoff_ms = BACKOFF_MIN_MS;
    pthread_mutex_unlock(&c->mu);
}

/* Reads the next pipelined reply (c->mu held); KVC_ERR_IO and the
 * connection dropped if none could be read. */
static kvc_status conn_reply(server *sv, conn *c, redisReply **out) {
    void *r = NULL;
    if (redisGetReply(c->ctx, &r) != REDIS_OK || !r) {
        *out = NULL;
        if (r) freeReplyObject(r);
        return conn_fail(sv, c, "no reply");
    }
    *out = r;
    return KVC_OK;
}

/* conn_reply for a call that must end by deadline_ns (CLOCK_MONOTONIC, not
 * 0): hiredis's blocking loop (write the commands, then read until a reply
 * parses) with the clock checked between socket calls, and the socket
 * timeout lowered to the time left whenever a wait could otherwise end
 * more than DEADLINE_SLACK_MS past the deadline (one setsockopt per such
 * interval, not per read): a server that trickles its replies cannot hold
 * the call longer. Past the deadline: *out NULL, KVC_OK, and the
 * connection dropped without back-off (replies still due on it; the
 * server may be fine, only the caller's time is up), unless the server
 * sent not a byte for SILENT_MS (or its whole socket timeout, if shorter)
 * up to it: then it fails as a socket timeout does (down, back-off). */
static kvc_status conn_reply_by(server *sv, conn *c, int64_t deadline_ns, redisReply **out) {
    *out = NULL;
    int wdone = 0;
    int64_t heard = now_ns(); /* the wait's start, then the last byte's arrival */
    for (;;) {
        void *r = NULL; /* a reply already read in (redisGetReply's order) */
        if (redisGetReplyFromReader(c->ctx, &r) != REDIS_OK) return conn_fail(sv, c, "no reply");
        if (r) {
            *out = r;
            return KVC_OK;
        }
        const int64_t now = now_ns();
        if (now >= deadline_ns) break;
        if (now + c->cur_ms * 1000000 > deadline_ns + DEADLINE_SLACK_MS * 1000000) {
            const int64_t left = (deadline_ns - now) / 1000000 + 1; /* >= 1: 0 is no limit */
            if (conn_timeout(c, left < c->cmd_ms ? left : c->cmd_ms) != 0)
                return conn_fail(sv, c, "cannot set the socket timeout");
        }
        const size_t had = c->ctx->reader->len; /* grows only as bytes are fed */
        const int rc = wdone ? redisBufferRead(c->ctx) : redisBufferWrite(c->ctx, &wdone);
        if (rc == REDIS_OK && c->ctx->reader->len > had) heard = now_ns();
        if (rc != REDIS_OK) {
            if (now_ns() >= deadline_ns) break; /* the socket timed out at the deadline */
            return conn_fail(sv, c, "no reply");
        }
    }
    const int64_t silent_ms = c->cmd_ms < SILENT_MS ? c->cmd_ms : SILENT_MS;
    if (now_ns() - heard >= silent_ms * 1000000)
        return conn_fail(sv, c, "no reply by the load's deadline");
    conn_drop(c, 0, "a read passed its deadline");
    return KVC_OK;
}

/* A command could not be appended (out of memory): the output buffer may
 * hold part of it, so the connection is dropped (no back-off: the server
 * is fine). */
static kvc_status conn_append_failed(server *sv, conn *c) {
    conn_drop(c, 0, "out of memory");
    return kvc__error(KVC_ERR_NOMEM, "redis tier: server %s: out of memory queueing commands",
                      sv->url);
}

/* A reply of the wrong type: the peer does not speak the protocol we
 * expect, so the connection is dropped (and the server backs off) when the
 * call releases it. Not before: the reply parsed whole, so the stream is
 * still in step, and the replies still due for the call's other commands
 * are read first. A put's other objects may well have been stored, and
 * their replies say which (written[] must not call them lost). */
static kvc_status conn_protocol(server *sv, conn *c, const char *cmd, redisReply *r) {
    snprintf(c->distrust, sizeof c->distrust, "unexpected reply type %d to %s", r->type, cmd);
    freeReplyObject(r);
    return kvc__error(KVC_ERR_IO, "redis tier: server %s: %s", sv->url, c->distrust);
}

/* An error reply (e.g. OOM under maxmemory): the connection stays in sync. */
static kvc_status reply_error(server *sv, const char *cmd, redisReply *r) {
    const int noauth = r->str && !strncmp(r->str, "NOAUTH", 6);
    kvc_status st = kvc__error(KVC_ERR_IO, "redis tier: server %s: %s: %.*s%s", sv->url, cmd,
                               r->len > 200 ? 200 : (int)r->len, r->str ? r->str : "",
                               noauth ? " (give the password in the URL, "
                                        "redis://[USER]:PASSWORD@HOST:PORT, or as the "
                                        "store's redis_password; kvcache CLI: "
                                        "KVCACHE_REDIS_PASSWORD)"
                                      : "");
    freeReplyObject(r);
    return st;
}

/* ---- keys ----------------------------------------------------------------- */

static void key_name(const kvc_store_key *ns, const kvc_store_key *key,
                     char out[KEY_NAME_LEN + 1]) {
    memcpy(out, "kvc:", 4);
    kvc__store_key_hex(ns, out + 4);
    out[36] = ':';
    kvc__store_key_hex(key, out + 37);
}

/* Rendezvous hashing: the server with the highest score(url, key) owns the
 * key. A score tie (2^-64) goes to the smaller URL, so the choice never
 * depends on the order servers are listed in. */
static int owner_of(const redis_tier *rt, const kvc_store_key *key) {
    int best = 0;
    uint64_t best_score = XXH3_64bits_withSeed(key->b, 16, rt->srv[0].seed);
    for (int s = 1; s < rt->n_srv; s++) {
        uint64_t score = XXH3_64bits_withSeed(key->b, 16, rt->srv[s].seed);
        if (score > best_score ||
            (score == best_score && strcmp(rt->srv[s].url, rt->srv[best].url) < 0)) {
            best = s;
            best_score = score;
        }
    }
    return best;
}

/* own[i] = the server of keys[i]; a malloc'd array (free it). */
static kvc_status owners(const redis_tier *rt, const kvc_store_key *keys, int64_t n, int **own) {
    *own = (uint64_t)n > SIZE_MAX / sizeof(int) ? NULL : malloc((size_t)n * sizeof(int));
    if (!*own)
        return kvc__error(KVC_ERR_NOMEM, "redis tier: out of memory (%lld keys)", (long long)n);
    for (int64_t i = 0; i < n; i++) (*own)[i] = owner_of(rt, &keys[i]);
    return KVC_OK;
}

static int owns_any(const int *own, int64_t n, int s) {
    for (int64_t i = 0; i < n; i++)
        if (own[i] == s) return 1;
    return 0;
}

/* ---- operations ----------------------------------------------------------- */

/* One call's keys and results. Each server's share goes in one pipelined
 * exchange: a command per key it owns, then the replies in order. */
typedef enum { OP_PROBE, OP_GET, OP_PUT } op_kind;
typedef struct batch {
    redis_tier *rt;
    op_kind op;
    const kvc_store_key *ns, *keys;
    int64_t n;
    const int *own;                /* own[i]: the server of keys[i] */
    signed char *present;          /* OP_PROBE: 1, 0, or -1 (unknown) */
    void **objs;                   /* OP_GET */
    size_t *lens;                  /* OP_GET */
    long long max_len;             /* OP_GET: bytes past it are not sent */
    int64_t deadline_ns;           /* OP_GET: CLOCK_MONOTONIC, 0: none (tier.h) */
    const void *const *put_objs;   /* OP_PUT */
    const size_t *put_lens;        /* OP_PUT */
    unsigned char *written;        /* OP_PUT: 1 per object written (NULL: not wanted) */
} batch;

static const char *const op_cmd[] = {"EXISTS", "GETRANGE", "SET"};

/* Whether r is Redis's error for a key holding another type (someone put a
 * hash or a list under an object's name): a fact about that key alone. */
static int wrong_type(const redisReply *r) {
    return r->type == REDIS_REPLY_ERROR && r->str && r->len >= 9 &&
           !memcmp(r->str, "WRONGTYPE", 9);
}

/* Takes (and frees) the reply for keys[i]. A GETRANGE answered by anything
 * but a string (a WRONGTYPE error, a nil, an array or a number) is no
 * object: a miss for that key, whose complete reply keeps the connection in
 * step, so the batch's other keys still count. Other error replies (NOAUTH,
 * LOADING, ...) are about the server: the call fails. */
static kvc_status take_reply(batch *b, server *sv, conn *c, int64_t i, redisReply *r) {
    if (b->op == OP_GET && (wrong_type(r) || r->type != REDIS_REPLY_ERROR)) {
        if (r->type == REDIS_REPLY_STRING && r->len > 0) {
            /* No object is empty: an empty string is no object. The reply's
             * string is taken over, not copied: create_string put it in a
             * buffer of the pool (or hiredis in a malloc block: its default
             * allocator, never replaced here), and freeReplyObject then
             * frees a NULL. */
            b->objs[i] = r->str;
            b->lens[i] = r->len;
            r->str = NULL;
        }
        freeReplyObject(r);
        return KVC_OK;
    }
    if (r->type == REDIS_REPLY_ERROR) return reply_error(sv, op_cmd[b->op], r);
    kvc_status st = KVC_OK;
    if (b->op == OP_PROBE) {
        if (r->type != REDIS_REPLY_INTEGER) return conn_protocol(sv, c, "EXISTS", r);
        b->present[i] = r->integer > 0;
    } else if (b->op == OP_PUT) {
        if (r->type != REDIS_REPLY_STATUS) return conn_protocol(sv, c, "SET", r);
        if (b->written) b->written[i] = 1;
    }
    freeReplyObject(r);
    return st;
}

/* Server s's share of b: reads on its read connection, puts on its write
 * connection. Every queued reply is read, even after an error reply or a
 * failed copy, so that the connection stays in step (unless it was dropped). */
static kvc_status batch_server(batch *b, int s) {
    server *sv = &b->rt->srv[s];
    conn *c = b->op == OP_PUT ? &sv->wr : &sv->rd;
    pipe_guard g;
    if (b->deadline_ns && now_ns() >= b->deadline_ns) return KVC_OK; /* its keys stay NULL */
    KVC_TRY(conn_acquire(sv, c, b->deadline_ns, &g));
    kvc_status st = KVC_OK;
    char name[KEY_NAME_LEN + 1];
    for (int64_t i = 0; i < b->n; i++) {
        if (b->own[i] != s) continue;
        key_name(b->ns, &b->keys[i], name);
        int rc;
        if (b->op == OP_PROBE)
            rc = redisAppendCommand(c->ctx, "EXISTS %s", name);
        else if (b->op == OP_GET) /* GETRANGE: a huge value planted under a key costs
                                     max_len + 1 bytes, not its size (an absent key: "") */
            rc = redisAppendCommand(c->ctx, "GETRANGE %s 0 %lld", name, b->max_len);
        else if (b->rt->ttl)
            rc = redisAppendCommand(c->ctx, "SET %s %b EX %ld", name, b->put_objs[i],
                                    b->put_lens[i], b->rt->ttl);
        else
            rc = redisAppendCommand(c->ctx, "SET %s %b", name, b->put_objs[i], b->put_lens[i]);
        if (rc != REDIS_OK) {
            st = conn_append_failed(sv, c);
            break;
        }
    }
    for (int64_t i = 0; i < b->n && c->ctx; i++) {
        if (b->own[i] != s) continue;
        redisReply *r;
        kvc_status st_r = b->deadline_ns ? conn_reply_by(sv, c, b->deadline_ns, &r)
                                         : conn_reply(sv, c, &r);
        if (st_r == KVC_OK && !r) break; /* past the deadline: the rest stay NULL */
        if (st_r == KVC_OK) st_r = take_reply(b, sv, c, i, r);
        if (st == KVC_OK) st = st_r;
    }
    conn_release(c, &g);
    return st;
}

/* Runs b on every server that owns some of its keys. A probe or put tries
 * them all (a lost server costs only its keys); a get stops at the first
 * failure, since it then returns nothing. */
static kvc_status batch_run(batch *b) {
    int *own;
    KVC_TRY(owners(b->rt, b->keys, b->n, &own));
    b->own = own;
    kvc_status st = KVC_OK;
    for (int s = 0; s < b->rt->n_srv && !(st != KVC_OK && b->op == OP_GET); s++) {
        if (!owns_any(own, b->n, s)) continue;
        kvc_status st_s = batch_server(b, s);
        if (st == KVC_OK) st = st_s;
    }
    free(own);
    return st;
}

static kvc_status redis_probe(kvc_tier *t, const kvc_store_key *ns, const kvc_store_key *keys,
                              int64_t n, int64_t *n_present) {
    KVC_CHECK(n_present && ns && n >= 0 && (n == 0 || keys), "redis tier probe: bad arguments");
    *n_present = 0;
    if (n == 0) return KVC_OK;
    batch b = {.rt = (redis_tier *)t, .op = OP_PROBE, .ns = ns, .keys = keys, .n = n};
    if (!(b.present = malloc((size_t)n)))
        return kvc__error(KVC_ERR_NOMEM, "redis tier: out of memory");
    memset(b.present, -1, (size_t)n);
    kvc_status st = batch_run(&b);
    /* On an error the run also stops at the first key whose server failed. */
    while (*n_present < n && b.present[*n_present] == 1) ++*n_present;
    free(b.present);
    return st;
}

static kvc_status redis_get(kvc_tier *t, const kvc_store_key *ns, const kvc_store_key *keys,
                            int64_t n, size_t max_len, int64_t deadline_ns, void **objs,
                            size_t *lens) {
    KVC_CHECK(ns && n >= 0 && (n == 0 || (keys && objs && lens)), "redis tier get: bad arguments");
    for (int64_t i = 0; i < n; i++) {
        objs[i] = NULL;
        lens[i] = 0;
    }
    if (n == 0) return KVC_OK;
    batch b = {.rt = (redis_tier *)t, .op = OP_GET, .ns = ns, .keys = keys, .n = n,
               .objs = objs, .lens = lens,
               .max_len = max_len < (size_t)LLONG_MAX ? (long long)max_len : LLONG_MAX - 1,
               .deadline_ns = deadline_ns};
    kvc_status st = batch_run(&b);
    if (st != KVC_OK) { /* tier.h: on error nothing to free */
        for (int64_t i = 0; i < n; i++) {
            kvc__objpool_put(t->pool, objs[i], lens[i]);
            objs[i] = NULL;
            lens[i] = 0;
        }
    }
    return st;
}

static kvc_status redis_put(kvc_tier *t, const kvc_store_key *ns, const kvc_store_key *keys,
                            const void *const *objs, const size_t *lens, int64_t n,
                            unsigned char *written) {
    if (written && n > 0) memset(written, 0, (size_t)n);
    KVC_CHECK(ns && n >= 0 && (n == 0 || (keys && objs && lens)), "redis tier put: bad arguments");
    for (int64_t i = 0; i < n; i++)
        KVC_CHECK(objs[i] && lens[i] > 0, "redis tier put: object %lld is empty", (long long)i);
    if (n == 0) return KVC_OK;
    batch b = {.rt = (redis_tier *)t, .op = OP_PUT, .ns = ns, .keys = keys, .n = n,
               .put_objs = objs, .put_lens = lens, .written = written};
    return batch_run(&b);
}

/* SCAN for ns's keys on server s and UNLINK them, batch by batch; *removed
 * set to 1 once UNLINKs went out (some keys may be gone, whatever fails
 * after). */
static kvc_status invalidate_server(server *sv, const char *pattern, int *removed) {
    pipe_guard g;
    conn *c = &sv->rd;
    KVC_TRY(conn_acquire(sv, c, 0, &g));
    kvc_status st = KVC_OK;
    char cursor[32] = "0";
    do {
        redisReply *r;
        if (redisAppendCommand(c->ctx, "SCAN %s MATCH %s COUNT 1000", cursor, pattern) !=
            REDIS_OK) {
            st = conn_append_failed(sv, c);
            break;
        }
        if ((st = conn_reply(sv, c, &r)) != KVC_OK) break;
        if (r->type == REDIS_REPLY_ERROR) {
            st = reply_error(sv, "SCAN", r);
            break;
        }
        if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
            r->element[0]->type != REDIS_REPLY_STRING || r->element[0]->len == 0 ||
            r->element[0]->len >= sizeof cursor || r->element[1]->type != REDIS_REPLY_ARRAY) {
            st = conn_protocol(sv, c, "SCAN", r);
            break;
        }
        memcpy(cursor, r->element[0]->str, r->element[0]->len);
        cursor[r->element[0]->len] = 0;
        redisReply *found = r->element[1];
        size_t queued = 0;
        for (size_t k = 0; k < found->elements && st == KVC_OK; k++) {
            redisReply *e = found->element[k];
            if (e->type != REDIS_REPLY_STRING) continue;
            if (redisAppendCommand(c->ctx, "UNLINK %b", e->str, e->len) != REDIS_OK)
                st = conn_append_failed(sv, c);
            queued++;
        }
        freeReplyObject(r);
        if (queued) *removed = 1;
        for (size_t k = 0; k < queued && c->ctx; k++) { /* all of them: stay in step */
            kvc_status st_r = conn_reply(sv, c, &r);
            if (st_r == KVC_OK && r->type == REDIS_REPLY_ERROR)
                st_r = reply_error(sv, "UNLINK", r);
            else if (st_r == KVC_OK && r->type != REDIS_REPLY_INTEGER)
                st_r = conn_protocol(sv, c, "UNLINK", r);
            else if (st_r == KVC_OK)
                freeReplyObject(r);
            if (st == KVC_OK) st = st_r;
        }
    } while (st == KVC_OK && strcmp(cursor, "0") != 0);
    conn_release(c, &g);
    return st;
}

static kvc_status redis_invalidate(kvc_tier *t, const kvc_store_key *ns, int *removed) {
    redis_tier *rt = (redis_tier *)t;
    int any = 0;
    if (removed) *removed = 0;
    KVC_CHECK(ns, "redis tier invalidate: ns is NULL");
    char pattern[4 + 32 + 3] = "kvc:";
    kvc__store_key_hex(ns, pattern + 4);
    memcpy(pattern + 36, ":*", 3); /* hex digits: no glob characters to escape */
    kvc_status st = KVC_OK;
    for (int s = 0; s < rt->n_srv; s++) { /* a failed server does not stop the others */
        kvc_status st_s = invalidate_server(&rt->srv[s], pattern, &any);
        if (st == KVC_OK) st = st_s;
    }
    if (removed) *removed = any;
    return st;
}

static void redis_close(kvc_tier *t) {
    redis_tier *rt = (redis_tier *)t;
    if (!rt) return;
    for (int s = 0; s < rt->n_srv; s++) {
        server *sv = &rt->srv[s];
        conn *cs[2] = {&sv->rd, &sv->wr};
        for (int k = 0; k < 2; k++) {
            if (cs[k]->ctx) redisFree(cs[k]->ctx);
            pthread_mutex_destroy(&cs[k]->mu);
        }
        free(sv->url);
        free(sv->host);
        free(sv->path);
        free(sv->user);
        kvc__free_secret(sv->pass); /* not left in freed memory */
    }
    free(rt->srv);
    free(rt);
}

static const kvc_tier_ops redis_ops = {redis_probe, redis_get,   redis_put,
                                       redis_invalidate, redis_close, NULL};

/* ---- URLs ----------------------------------------------------------------- */

#define URL_FORMS                                                                          \
    "redis://[[USER]:PASSWORD@]HOST:PORT[/DB] or unix://[[USER]:PASSWORD@]/PATH, "            \
    "comma-separated, optional ?ttl=SECONDS&db=N"

/* Digits only, value in [lo, max]; -1 otherwise. */
static long parse_num(const char *s, size_t len, long lo, long max) {
    if (len == 0 || len > 10) return -1;
    long long v = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v >= lo && v <= max ? (long)v : -1;
}

static long parse_pos(const char *s, size_t len, long max) { return parse_num(s, len, 1, max); }

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static int hex_val(char c) {
    return c >= '0' && c <= '9' ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* s[0..n) with %XX decoded, into *out (malloc'd); a bad escape or %00 is
 * INVALID_ARG (the message names the field, never its text: a password). */
static kvc_status url_decode(const char *s, size_t n, const char *what, const char *url,
                             char **out) {
    char *d = malloc(n + 1), *o = d;
    if (!d) return kvc__error(KVC_ERR_NOMEM, "redis tier: out of memory");
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '%') {
            *o++ = s[i];
            continue;
        }
        const int hi = i + 2 < n ? hex_val(s[i + 1]) : -1;
        const int lo = hi >= 0 ? hex_val(s[i + 2]) : -1;
        if (lo < 0 || (hi | lo) == 0) {
            *o = 0;
            kvc__free_secret(d);
            return kvc__error(KVC_ERR_INVALID_ARG, "redis tier URL \"%s\": the %s has a bad "
                              "%%-escape (want %%XX, two hex digits, not %%00)", url, what);
        }
        *o++ = (char)(hi << 4 | lo);
        i += 2;
    }
    *o = 0;
    *out = d;
    return KVC_OK;
}

/* "USER:PASSWORD" or ":PASSWORD" (s[0..n), as written) into sv. */
static kvc_status parse_userinfo(const char *s, size_t n, server *sv, const char *url) {
    const char *colon = memchr(s, ':', n);
    KVC_CHECK(colon, "redis tier URL \"%s\": a user name needs a password "
              "(USER:PASSWORD@ or :PASSWORD@)", url);
    const size_t ulen = (size_t)(colon - s), plen = n - ulen - 1;
    KVC_CHECK(plen > 0, "redis tier URL \"%s\": empty password", url);
    if (ulen) KVC_TRY(url_decode(s, ulen, "user name", url, &sv->user));
    return url_decode(colon + 1, plen, "password", url, &sv->pass);
}

/* u for a message, unless it may hold a password (an '@' the parser could
 * not take as the end of credentials). */
static const char *shown(const char *u) {
    return strchr(u, '@') ? "(not shown: it has an '@')" : u;
}

/* One server URL, s[0..len), into sv. sv->url becomes the URL less its
 * credentials: the server's identity (hashing, "listed twice", messages,
 * the tier's name), so that a password never shows and changing one does
 * not move keys. */
static kvc_status parse_server(const char *s, size_t len, server *sv, const char *duser,
                               const char *dpass) {
    KVC_CHECK(len > 0, "redis tier URL: empty server in the list (want " URL_FORMS ")");
    char *given = dup_n(s, len); /* for messages until sv->url exists: redact first */
    if (!given) return kvc__error(KVC_ERR_NOMEM, "redis tier: out of memory");
    const int is_unix = !strncmp(given, "unix://", 7), is_redis = !strncmp(given, "redis://", 8);
    const size_t pre = is_unix ? 7 : is_redis ? 8 : 0;
    kvc_status st = KVC_OK;
    if (!pre) {
        st = !strncmp(given, "rediss://", 9)
                 ? kvc__error(KVC_ERR_INVALID_ARG, "redis tier URL: rediss:// (TLS) is not "
                              "supported (this hiredis has no TLS: reach the server through "
                              "a TLS tunnel to a local socket; want " URL_FORMS ")")
                 : kvc__error(KVC_ERR_INVALID_ARG, "redis tier URL \"%.200s\": unknown scheme "
                              "(want " URL_FORMS ")", strchr(given, '@') ? "..." : given);
        kvc__free_secret(given);
        return st;
    }
    /* credentials: up to the first "@/" for unix:// (the path follows),
     * up to the last '@' before the first '/' for redis:// */
    const char *rest = given + pre, *at = NULL;
    if (is_unix) {
        if (rest[0] != '/') {
            const char *p = strstr(rest, "@/");
            at = p;
        }
    } else {
        const size_t auth_len = strcspn(rest, "/");
        for (size_t i = 0; i < auth_len; i++)
            if (rest[i] == '@') at = rest + i;
    }
    /* the identity: scheme and what follows the credentials */
    const char *after = at ? at + 1 : rest;
    sv->url = malloc(pre + strlen(after) + 1);
    if (!sv->url) {
        kvc__free_secret(given);
        return kvc__error(KVC_ERR_NOMEM, "redis tier: out of memory");
    }
    memcpy(sv->url, given, pre);
    strcpy(sv->url + pre, after);
    const char *u = sv->url;
    if (at) st = parse_userinfo(rest, (size_t)(at - rest), sv, shown(u));
    kvc__free_secret(given);
    KVC_TRY(st);
    if (!at && dpass) { /* the store's credentials: a URL's own win (as redis-py's from_url) */
        sv->pass = dup_n(dpass, strlen(dpass));
        sv->user = duser ? dup_n(duser, strlen(duser)) : NULL;
        if (!sv->pass || (duser && !sv->user))
            return kvc__error(KVC_ERR_NOMEM, "redis tier: out of memory");
    }
    if (is_unix) {
        const char *p = u + 7;
        KVC_CHECK(p[0] == '/', "redis tier URL \"%s\": unix:// needs an absolute path "
                  "(unix:///PATH/TO/SOCKET)", shown(u));
        KVC_CHECK(strlen(p) < sizeof(((struct sockaddr_un *)0)->sun_path),
                  "redis tier URL \"%s\": socket path longer than %zu bytes", shown(u),
                  sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
        sv->path = dup_n(p, strlen(p));
    } else {
        const char *h = u + 8, *colon;
        size_t hlen;
        KVC_CHECK(!strchr(h, '@'), "redis tier URL \"%s\": bad host", shown(u));
        if (h[0] == '[') { /* [IPv6]:PORT */
            const char *close = strchr(h, ']');
            KVC_CHECK(close && close[1] == ':', "redis tier URL \"%s\": want redis://[ADDR]:PORT",
                      shown(u));
            h++;
            hlen = (size_t)(close - h);
            colon = close + 1;
        } else {
            colon = strchr(h, ':');
            KVC_CHECK(colon, "redis tier URL \"%s\": missing :PORT (want redis://HOST:PORT)",
                      shown(u));
            hlen = (size_t)(colon - h);
        }
        KVC_CHECK(hlen > 0 && !memchr(h, '/', hlen), "redis tier URL \"%s\": bad host", shown(u));
        const char *slash = strchr(colon + 1, '/');
        const size_t port_len = slash ? (size_t)(slash - colon - 1) : strlen(colon + 1);
        long port = parse_pos(colon + 1, port_len, 65535);
        KVC_CHECK(port > 0, "redis tier URL \"%s\": bad port (want 1..65535)", shown(u));
        if (slash) {
            sv->db = parse_num(slash + 1, strlen(slash + 1), 0, INT_MAX);
            KVC_CHECK(sv->db >= 0, "redis tier URL \"%s\": bad database (want /N, N a number "
                      "from 0)", shown(u));
        }
        sv->port = (int)port;
        sv->host = dup_n(h, hlen);
    }
    if (!sv->host && !sv->path) return kvc__error(KVC_ERR_NOMEM, "redis tier: out of memory");
    sv->seed = XXH3_64bits(sv->url, strlen(sv->url));
    return KVC_OK;
}

/* "?ttl=N&db=N" options (after the '?'), '&'-separated. */
static kvc_status parse_query(const char *q, long *ttl, long *db) {
    KVC_CHECK(*q, "redis tier URL: empty query after '?' (known options: ttl=SECONDS, db=N)");
    /* an '@' here is a password's '?' left unencoded: not echoed */
    KVC_CHECK(!strchr(q, '@'), "redis tier URL: an '@' after the '?' (a '?' in a password "
              "must be written %%3F)");
    while (*q) {
        size_t len = strcspn(q, "&");
        if (len >= 4 && !strncmp(q, "ttl=", 4)) {
            KVC_CHECK(*ttl == 0, "redis tier URL: ttl= is given twice");
            *ttl = parse_pos(q + 4, len - 4, INT_MAX);
            KVC_CHECK(*ttl > 0, "redis tier URL: ttl \"%.*s\" is not a positive integer of "
                      "seconds", (int)(len - 4), q + 4);
        } else if (len >= 3 && !strncmp(q, "db=", 3)) {
            KVC_CHECK(*db < 0, "redis tier URL: db= is given twice");
            *db = parse_num(q + 3, len - 3, 0, INT_MAX);
            KVC_CHECK(*db >= 0, "redis tier URL: db \"%.*s\" is not a database number (0, 1, "
                      "...)", (int)(len - 3), q + 3);
        } else {
            return kvc__error(KVC_ERR_INVALID_ARG, "redis tier URL: unknown option \"%.*s\" "
                              "(known: ttl=SECONDS, db=N)", (int)len, q);
        }
        q += len;
        if (*q == '&') q++;
        KVC_CHECK(*q || q[-1] != '&', "redis tier URL: empty option after '&'");
    }
    return KVC_OK;
}

static kvc_status parse_url(const char *url, redis_tier *rt, const char *user,
                            const char *pass) {
    KVC_CHECK(url && *url, "redis tier: empty URL (want " URL_FORMS ")");
    size_t list_len = strcspn(url, "?");
    rt->db = -1;
    if (url[list_len] == '?') KVC_TRY(parse_query(url + list_len + 1, &rt->ttl, &rt->db));
    int n = 1;
    for (size_t i = 0; i < list_len; i++) n += url[i] == ',';
    KVC_CHECK(n <= MAX_SERVERS, "redis tier URL: %d servers, at most %d", n, MAX_SERVERS);
    /* A server with an '@' but no scheme is the rest of a password that an
     * unencoded ',' split: refused before any server is parsed, since the
     * one before it ends in the password's start (its message would quote it). */
    for (const char *s = url; s < url + list_len;) {
        const size_t len = strcspn(s, ",?");
        KVC_CHECK(!memchr(s, '@', len) || !strncmp(s, "redis://", 8) ||
                      !strncmp(s, "unix://", 7) || !strncmp(s, "rediss://", 9),
                  "redis tier URL: a server has an '@' but no redis:// or unix:// (a ',' in a "
                  "password must be written %%2C)");
        s += len + 1;
    }
    if (!(rt->srv = calloc((size_t)n, sizeof *rt->srv)))
        return kvc__error(KVC_ERR_NOMEM, "redis tier: out of memory");
    for (const char *s = url; rt->n_srv < n;) {
        size_t len = strcspn(s, ",?");
        server *sv = &rt->srv[rt->n_srv++];
        conn *cs[2] = {&sv->rd, &sv->wr};
        for (int k = 0; k < 2; k++) {
            pthread_mutex_init(&cs[k]->mu, NULL);
            cs[k]->backoff_ms = BACKOFF_MIN_MS;
            cs[k]->tier = &rt->base;
        }
        sv->db = -1;
        KVC_TRY(parse_server(s, len, sv, user, pass));
        if (rt->db >= 0) {
            KVC_CHECK(sv->db < 0, "redis tier URL: server %s has a /DB and the URL ?db=N too",
                      sv->url);
            sv->db = rt->db;
        }
        for (int k = 0; k < rt->n_srv - 1; k++)
            KVC_CHECK(strcmp(rt->srv[k].url, sv->url), "redis tier URL: server %s listed twice",
                      sv->url);
        s += len + 1;
    }
    return KVC_OK;
}

kvc_status kvc__tier_redis_open(const char *url, kvc_tier **out) {
    return kvc__tier_redis_open_as(url, NULL, NULL, out);
}

kvc_status kvc__tier_redis_open_as(const char *url, const char *user, const char *pass,
                                   kvc_tier **out) {
    KVC_CHECK(out, "redis tier: out is NULL");
    *out = NULL;
    redis_tier *rt = calloc(1, sizeof *rt);
    if (!rt) return kvc__error(KVC_ERR_NOMEM, "redis tier: out of memory");
    kvc_status st = parse_url(url, rt, user, pass);
    if (st != KVC_OK) {
        redis_close(&rt->base);
        return st;
    }
    rt->base.ops = &redis_ops;
    snprintf(rt->base.kind, sizeof rt->base.kind, "redis");
    /* the name: the URL less credentials */
    char *name = rt->base.name;
    const size_t cap = sizeof rt->base.name;
    size_t len = 0;
    for (int i = 0; i < rt->n_srv; i++)
        len += (size_t)snprintf(name + (len < cap ? len : cap), len < cap ? cap - len : 0, "%s%s",
                                i ? "," : "", rt->srv[i].url);
    const char *q = strchr(url, '?');
    if (q)
        len += (size_t)snprintf(name + (len < cap ? len : cap), len < cap ? cap - len : 0, "%s",
                                q);
    if (len >= cap) memcpy(name + cap - 4, "...", 4); /* cut, and say so */
    /* Connections are made on first use: a server down now is retried then. */
    *out = &rt->base;
    return KVC_OK;
}
