/*
 * The store handle: tiers in lookup order, a writer thread draining a
 * bounded queue into every tier, restores that verify every object before
 * it touches the cache, counters, events.
 */
#if defined(__linux__)
#define _GNU_SOURCE /* syscall: the writer's nice value is per thread on Linux */
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define _POSIX_C_SOURCE 200809L /* clock_gettime, pthread_cond_timedwait */
#endif
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../core/internal.h"
#include "store_internal.h"

#define MAX_TIERS 16
#define BATCH 32 /* objects per tier call: one pipelined round trip */

/* What a tier's removed callback gets: the store and the tier's index, so
 * that its events name the tier (tiers do not know their index). */
typedef struct tier_ctx {
    kvc_store *s;
    int32_t t;
} tier_ctx;

typedef struct item {
    struct item *next;
    kvc_store_key ns, key;
    void *obj;
    size_t size;
    uint32_t tiers; /* bit t: write to tier t */
} item;

struct kvc_store {
    kvc_tier *tiers[MAX_TIERS];
    tier_ctx tier_ctx[MAX_TIERS];
    int32_t n_tiers;
    kvc_store_params p;
    kvc_store_write_policy policy[MAX_TIERS]; /* each tier's (URL ?write=, else p's) */
    int32_t need_hits[MAX_TIERS];             /* its SELECTIVE hits */
    uint8_t auth[KVC_STORE_AUTH_KEY_BYTES];
    int has_auth;
    pthread_mutex_t mu; /* queue, counters */
    /* Held while the event callback runs, so that once
     * kvc_store_set_event_callback returns the old callback is not running
     * (its user data may be freed). Serializes the writer's and engines'
     * events; callbacks are short by contract. */
    pthread_mutex_t ev_mu;
    pthread_cond_t cv_work, cv_done;
    item *head, *tail;
    int64_t q_n, q_bytes;
    int64_t enq, done; /* writes queued / finished (written or failed), for flush */
    int stop;
    pthread_t thr;
    kvc_store_stats st;
    char last_err[256]; /* the last failed tier call's message (under mu) */
    kvc_store_event_fn ev_fn;
    void *ev_user;
    kvc__objpool *pool; /* object buffers of the tiers' gets, restores and writes */
    kvc__store_attached *attached; /* kvc_store_attach_engine's, freed at detach or close */
    int64_t n_attached;
};

/* Keeps the message of a tier call that just failed on this thread (for
 * kvc_store_last_tier_error), then clears it: the failure is counted, not
 * the caller's error. */
static void tier_failed(kvc_store *s) {
    pthread_mutex_lock(&s->mu);
    snprintf(s->last_err, sizeof s->last_err, "%s", kvc_last_error());
    pthread_mutex_unlock(&s->mu);
    kvc_clear_error();
}

kvc_store_params kvc_store_default_params(void) {
    kvc_store_params p;
    memset(&p, 0, sizeof p);
    p.queue_objects = 4096;
    p.queue_bytes = (int64_t)512 << 20;
    p.load_timeout_s = 2.0;
    p.write_policy = KVC_STORE_WRITE_THROUGH;
    p.selective_hits = 2;
    p.writer_nice = 19;
    p.promote = 1;
    p.object_pool_bytes = (int64_t)64 << 20;
    return p;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

const uint8_t *kvc__store_auth_key(const kvc_store *s) { return s->has_auth ? s->auth : NULL; }
const kvc_store_params *kvc__store_params(const kvc_store *s) { return &s->p; }
uint32_t kvc__store_all_tiers(const kvc_store *s) { return (1u << s->n_tiers) - 1u; }

uint32_t kvc__store_tiers_by_policy(const kvc_store *s, kvc_store_write_policy p) {
    uint32_t m = 0;
    for (int32_t t = 0; t < s->n_tiers; t++)
        if (s->policy[t] == p) m |= 1u << t;
    return m;
}

int32_t kvc__store_tier_hits(const kvc_store *s, int32_t t) {
    return s->need_hits[t];
}

const char *kvc__store_tier_kind(const kvc_store *s, int32_t t) {
    return t >= 0 && t < s->n_tiers ? s->tiers[t]->kind : NULL;
}

/* ---- events ------------------------------------------------------------------ */

void kvc__store_emit(kvc_store *s, const kvc_store_event *ev) {
    pthread_mutex_lock(&s->ev_mu);
    if (s->ev_fn) s->ev_fn(s->ev_user, ev);
    pthread_mutex_unlock(&s->ev_mu);
}

void kvc__store_emit_page(kvc_store *s, kvc_store_event_kind kind, int32_t tier,
                          const kvc_store_key *ns, const kvc_store_key *key,
                          const kvc_store_key *parent, const int32_t *tokens, int32_t n_tokens) {
    kvc_store_event ev;
    memset(&ev, 0, sizeof ev);
    ev.kind = kind;
    ev.tier = tier;
    ev.ns = *ns;
    if (key) ev.key = *key;
    if (parent) ev.parent = *parent;
    ev.tokens = tokens;
    ev.n_tokens = tokens ? n_tokens : 0;
    kvc__store_emit(s, &ev);
}

/* An event for an object written to tier: parent and ids from its header
 * when it parses as a page object (objects put by others may not). */
static void emit_stored(kvc_store *s, int32_t tier, const item *it) {
    pthread_mutex_lock(&s->ev_mu);
    const int listening = s->ev_fn != NULL;
    pthread_mutex_unlock(&s->ev_mu);
    if (!listening) return; /* spare the ids' copy */
    kvc_store_key parent;
    int32_t *ids = NULL;
    const int32_t n = kvc__store_object_ids(it->obj, it->size, &parent, &ids);
    kvc__store_emit_page(s, KVC_STORE_EVENT_STORED, tier, &it->ns, &it->key, n ? &parent : NULL,
                         ids, n);
    free(ids);
}

static void tier_removed(void *user, const kvc_store_key *ns, const kvc_store_key *key) {
    const tier_ctx *c = user;
    kvc__store_emit_page(c->s, KVC_STORE_EVENT_REMOVED, c->t, ns, key, NULL, NULL, 0);
}

kvc_status kvc_store_set_event_callback(kvc_store *s, kvc_store_event_fn fn, void *user) {
    KVC_CHECK(s != NULL, "kvc_store_set_event_callback: store is NULL");
    pthread_mutex_lock(&s->ev_mu);
    s->ev_fn = fn;
    s->ev_user = fn ? user : NULL;
    pthread_mutex_unlock(&s->ev_mu);
    return KVC_OK;
}

void kvc__store_clear_event_callback(kvc_store *s, kvc_store_event_fn fn, void *user) {
    pthread_mutex_lock(&s->ev_mu);
    if (s->ev_fn == fn && s->ev_user == user) s->ev_fn = NULL, s->ev_user = NULL;
    pthread_mutex_unlock(&s->ev_mu);
}

/* ---- writer -------------------------------------------------------------------- */

/* Background writes yield the CPUs to the engine's threads (as RocksDB's
 * compaction threads do): on a machine the engine keeps busy, the writer
 * runs in the gaps, its queue fills and writes drop (counted) instead of
 * slowing the decode. Best effort: where the call is refused the writer
 * keeps the process's priority. */
static void lower_priority(int32_t nice) {
#if defined(__linux__)
    if (nice <= 0) return;
    const id_t tid = (id_t)syscall(SYS_gettid);
    errno = 0;
    const int cur = getpriority(PRIO_PROCESS, tid);
    if (cur == -1 && errno != 0) return;
    (void)setpriority(PRIO_PROCESS, tid, cur + nice > 19 ? 19 : cur + nice);
#else
    (void)nice;
#endif
}

static void *writer(void *arg) {
    kvc_store *s = arg;
    item *batch[BATCH];
    lower_priority(s->p.writer_nice);
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv_work, &s->mu);
        if (s->stop) {
            pthread_mutex_unlock(&s->mu);
            return NULL;
        }
        int n = 0;
        while (s->head && n < BATCH) {
            item *it = s->head;
            s->head = it->next;
            if (!s->head) s->tail = NULL;
            s->q_n--;
            s->q_bytes -= (int64_t)it->size;
            batch[n++] = it;
        }
        pthread_mutex_unlock(&s->mu);

        int64_t failed = 0, bytes = 0, errors = 0;
        /* lost[i]: a tier of batch[i] did not store it (writes_failed counts
         * objects, as writes_done does, not object-tier pairs) */
        unsigned char lost[BATCH] = {0};
        /* per tier, the items that name it; a tier call takes one
         * namespace: split the run at changes */
        for (int32_t t = 0; t < s->n_tiers; t++) {
            int m = 0, idx[BATCH];
            kvc_store_key tk[BATCH];
            const void *to[BATCH];
            size_t tl[BATCH];
            for (int i = 0; i < n; i++)
                if (batch[i]->tiers >> t & 1u) {
                    idx[m] = i, tk[m] = batch[i]->key, to[m] = batch[i]->obj;
                    tl[m++] = batch[i]->size;
                }
            for (int i = 0; i < m;) {
                const kvc_store_key *ns = &batch[idx[i]]->ns;
                int j = i + 1;
                while (j < m && memcmp(batch[idx[j]]->ns.b, ns->b, 16) == 0) j++;
                unsigned char w[BATCH]; /* which objects landed: events name only them */
                kvc_status st = s->tiers[t]->ops->put(s->tiers[t], ns, tk + i, to + i, tl + i,
                                                      j - i, w);
                if (st != KVC_OK) {
                    errors++;
                    tier_failed(s);
                }
                for (int k = 0; k < j - i; k++) {
                    if (!w[k]) {
                        lost[idx[i + k]] = 1;
                        continue;
                    }
                    bytes += (int64_t)tl[i + k];
                    emit_stored(s, t, batch[idx[i + k]]);
                }
                i = j;
            }
        }
        for (int i = 0; i < n; i++) {
            failed += lost[i];
            kvc__objpool_put(s->pool, batch[i]->obj, batch[i]->size);
            free(batch[i]);
        }
        pthread_mutex_lock(&s->mu);
        s->st.bytes_written += bytes;
        s->st.errors += errors;
        s->st.writes_failed += failed;
        s->st.writes_done += n;
        s->done += n;
        pthread_cond_broadcast(&s->cv_done);
        pthread_mutex_unlock(&s->mu);
    }
}

static void count_dropped(kvc_store *s) {
    pthread_mutex_lock(&s->mu);
    s->st.writes_dropped++;
    pthread_mutex_unlock(&s->mu);
}

kvc_status kvc__store_put_owned(kvc_store *s, const kvc_store_key *ns, const kvc_store_key *key,
                                void *obj, size_t size, uint32_t tiers) {
    tiers &= kvc__store_all_tiers(s);
    if (!tiers) { /* no tier to write (a store of none: events only) */
        kvc__objpool_put(s->pool, obj, size);
        return KVC_OK;
    }
    item *it = malloc(sizeof *it);
    if (!it) {
        kvc__objpool_put(s->pool, obj, size);
        count_dropped(s);
        return kvc__error(KVC_ERR_NOMEM, "kvc_store_put: out of memory");
    }
    it->next = NULL;
    it->ns = *ns;
    it->key = *key;
    it->obj = obj;
    it->size = size;
    it->tiers = tiers;
    pthread_mutex_lock(&s->mu);
    if (s->q_n >= s->p.queue_objects || s->q_bytes + (int64_t)size > s->p.queue_bytes) {
        s->st.writes_dropped++;
        pthread_mutex_unlock(&s->mu);
        kvc__objpool_put(s->pool, obj, size);
        free(it);
        return kvc__error(KVC_ERR_NO_SPACE, "kvc_store_put: the write queue is full (%d "
                          "objects, %lld bytes at most): write dropped",
                          (int)s->p.queue_objects, (long long)s->p.queue_bytes);
    }
    if (s->tail) s->tail->next = it;
    else s->head = it;
    s->tail = it;
    s->q_n++;
    s->q_bytes += (int64_t)size;
    s->enq++;
    s->st.writes_queued++;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    return KVC_OK;
}

/* kvc__store_put_owned of a copy of obj. */
static kvc_status put_copy(kvc_store *s, const kvc_store_key *ns, const kvc_store_key *key,
                           const void *obj, size_t size, uint32_t tiers) {
    void *copy = kvc__objpool_get(s->pool, size);
    if (!copy) {
        count_dropped(s);
        return kvc__error(KVC_ERR_NOMEM, "kvc_store_put: out of memory");
    }
    memcpy(copy, obj, size);
    return kvc__store_put_owned(s, ns, key, copy, size, tiers);
}

kvc_status kvc_store_put(kvc_store *s, const kvc_store_key *ns, const kvc_store_key *key,
                         const void *obj, size_t size) {
    KVC_CHECK(s != NULL && ns != NULL && key != NULL && obj != NULL && size > 0,
              "kvc_store_put: store, ns, key and obj must not be NULL, size > 0");
    return put_copy(s, ns, key, obj, size, kvc__store_all_tiers(s));
}

kvc_status kvc_store_flush(kvc_store *s, double timeout_s) {
    KVC_CHECK(s != NULL, "kvc_store_flush: store is NULL");
    KVC_CHECK(!isnan(timeout_s), "kvc_store_flush: timeout_s is NaN");
    /* a limit past a century is none: its deadline would overflow time_t
     * (pthread_cond_timedwait then fails at once, forever) */
    if (timeout_s > 3.2e9) timeout_s = -1;
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl); /* pthread_cond_timedwait's clock */
    if (timeout_s >= 0) {
        double t = (double)dl.tv_sec + 1e-9 * (double)dl.tv_nsec + timeout_s;
        dl.tv_sec = (time_t)t;
        dl.tv_nsec = (long)((t - (double)dl.tv_sec) * 1e9);
    }
    pthread_mutex_lock(&s->mu);
    const int64_t target = s->enq;
    int rc = 0;
    while (s->done < target && (rc == 0 || rc == EINTR)) {
        if (timeout_s < 0) pthread_cond_wait(&s->cv_done, &s->mu);
        else rc = pthread_cond_timedwait(&s->cv_done, &s->mu, &dl);
    }
    const int64_t left = target - s->done;
    pthread_mutex_unlock(&s->mu);
    if (left > 0)
        return kvc__error(KVC_ERR_IO, "kvc_store_flush: %lld writes still pending after %g s",
                          (long long)left, timeout_s);
    return KVC_OK;
}

/* ---- open / close -------------------------------------------------------------- */

/* url for a message: one that may hold a password (not dir:, with an '@':
 * Redis credentials) is not quoted, as the Redis tier's own messages. */
static const char *url_shown(const char *url) {
    return strncmp(url, "dir:", 4) && strchr(url, '@') ? "(not shown: it has an '@')" : url;
}

/* "write=through|back|selective:N" (v: the text after "write="). */
static kvc_status parse_policy(const char *url, const char *v, size_t n,
                               kvc_store_write_policy *policy, int32_t *hits) {
    if (n == 7 && !strncmp(v, "through", 7)) {
        *policy = KVC_STORE_WRITE_THROUGH;
        return KVC_OK;
    }
    if (n == 4 && !strncmp(v, "back", 4)) {
        *policy = KVC_STORE_WRITE_BACK;
        return KVC_OK;
    }
    long long h = 0;
    size_t i = 10;
    if (n > 10 && !strncmp(v, "selective:", 10))
        for (; i < n && v[i] >= '0' && v[i] <= '9' && h <= (1 << 20); i++)
            h = h * 10 + (v[i] - '0');
    if (i == n && n > 10 && h >= 1 && h <= (1 << 20)) {
        *policy = KVC_STORE_WRITE_SELECTIVE;
        *hits = (int32_t)h;
        return KVC_OK;
    }
    return kvc__error(KVC_ERR_INVALID_ARG, "kvc_store_open: \"%.200s\": write= takes through, "
                      "back or selective:N (1 <= N <= 1048576), got \"%.*s\"", url_shown(url),
                      memchr(v, '@', n) ? 3 : (int)(n < 40 ? n : 40),
                      memchr(v, '@', n) ? "..." : v); /* '@': a password's '?' unencoded */
}

/* Takes a "write=POLICY" option out of url's query (after its last '?',
 * options '&'-separated) into *policy / *hits (unchanged without one);
 * *clean receives the URL the tier parses (malloc'd). */
static kvc_status take_write_option(const char *url, char **clean,
                                    kvc_store_write_policy *policy, int32_t *hits) {
    const size_t len = strlen(url);
    char *out = malloc(len + 1);
    if (!out) return kvc__error(KVC_ERR_NOMEM, "kvc_store_open: out of memory");
    const char *q = strrchr(url, '?');
    if (!q) {
        memcpy(out, url, len + 1);
        *clean = out;
        return KVC_OK;
    }
    size_t o = (size_t)(q - url);
    memcpy(out, url, o);
    int seen = 0, kept = 0;
    for (const char *p = q + 1;;) {
        const char *e = strchr(p, '&');
        const size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n >= 6 && !strncmp(p, "write=", 6)) {
            kvc_status st = seen ? kvc__error(KVC_ERR_INVALID_ARG, "kvc_store_open: "
                                              "\"%.200s\": write= given twice",
                                              url_shown(url))
                                 : parse_policy(url, p + 6, n - 6, policy, hits);
            if (st != KVC_OK) {
                free(out);
                return st;
            }
            seen = 1;
        } else { /* the tier's own option (it checks them) */
            out[o++] = kept++ ? '&' : '?';
            memcpy(out + o, p, n);
            o += n;
        }
        if (!e) break;
        p = e + 1;
    }
    out[o] = 0;
    *clean = out;
    return KVC_OK;
}

/* Closes tiers [0, n); abandon: undoes their opens first (tier.h), last
 * tier first, since a tier's new directory may lie inside an earlier one's. */
static void close_tiers(kvc_tier *const *tiers, int32_t n, int abandon) {
    for (int32_t t = n - 1; abandon && t >= 0; t--)
        if (tiers[t]->ops->abandon) tiers[t]->ops->abandon(tiers[t]);
    for (int32_t t = 0; t < n; t++) tiers[t]->ops->close(tiers[t]);
}

static void store_close(kvc_store *s, int abandon) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thr, NULL);
    for (item *it = s->head, *nx; it; it = nx) {
        nx = it->next;
        free(it->obj);
        free(it);
    }
    close_tiers(s->tiers, s->n_tiers, abandon);
    for (int64_t i = 0; i < s->n_attached; i++) kvc__store_attach_free(s->attached[i].a);
    free(s->attached);
    kvc__objpool_destroy(s->pool);
    pthread_cond_destroy(&s->cv_work);
    pthread_cond_destroy(&s->cv_done);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->ev_mu);
    free(s);
}

void kvc_store_close(kvc_store *s) { store_close(s, 0); }
void kvc_store_abandon(kvc_store *s) { store_close(s, 1); }

kvc_status kvc_store_open(const char *const *urls, int32_t n_urls, const kvc_store_params *params,
                          kvc_store **out) {
    static const char fn[] = "kvc_store_open";
    if (out) *out = NULL;
    KVC_CHECK(out != NULL && (urls != NULL || n_urls == 0), "%s: urls and out must not be NULL",
              fn);
    KVC_CHECK(n_urls >= 0 && n_urls <= MAX_TIERS, "%s: %d tiers (need 0 to %d)", fn, (int)n_urls,
              MAX_TIERS);
    kvc_store_params p = params ? *params : kvc_store_default_params();
    KVC_CHECK(p.queue_objects >= 1 && p.queue_bytes >= 1 && p.load_timeout_s > 0 &&
                  p.write_policy >= KVC_STORE_WRITE_THROUGH &&
                  p.write_policy <= KVC_STORE_WRITE_SELECTIVE && p.selective_hits >= 1 &&
                  p.writer_nice >= 0 && p.writer_nice <= 39 && (p.promote == 0 || p.promote == 1) &&
                  p.object_pool_bytes >= 0,
              "%s: queue_objects, queue_bytes, load_timeout_s and selective_hits must be > 0, "
              "writer_nice in [0, 39], promote 0 or 1, object_pool_bytes >= 0 and write_policy "
              "one of kvc_store_write_policy", fn);
    KVC_CHECK(!p.redis_user || p.redis_password,
              "%s: redis_user needs redis_password (AUTH USER PASSWORD)", fn);
    KVC_CHECK(!p.redis_password || p.redis_password[0], "%s: redis_password is empty", fn);
    KVC_CHECK(!p.redis_user || p.redis_user[0], "%s: redis_user is empty", fn);
#ifndef KVC_HAVE_SODIUM
    if (p.auth_key)
        return kvc__error(KVC_ERR_UNSUPPORTED, "%s: authentication needs libsodium (Debian: "
                          "libsodium-dev), which this build lacks", fn);
#endif
    kvc_store *s = calloc(1, sizeof *s);
    if (!s) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    if (p.auth_key) {
        memcpy(s->auth, p.auth_key, KVC_STORE_AUTH_KEY_BYTES);
        s->has_auth = 1;
    }
    kvc_store_params given = p;
    p.auth_key = NULL; /* the copy above is the store's; the tiers copy the credentials */
    p.redis_user = p.redis_password = NULL;
    s->p = p;
    if (p.object_pool_bytes > 0 &&
        !(s->pool = kvc__objpool_create((uint64_t)p.object_pool_bytes > SIZE_MAX
                                            ? SIZE_MAX
                                            : (size_t)p.object_pool_bytes))) {
        free(s);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    }
    kvc_status st = KVC_OK;
    for (int32_t i = 0; i < n_urls && st == KVC_OK; i++) {
        const char *u0 = urls[i];
        char *u = NULL;
        s->policy[i] = p.write_policy;
        s->need_hits[i] = p.selective_hits;
        if (!u0) st = kvc__error(KVC_ERR_INVALID_ARG, "%s: url %d is NULL", fn, (int)i);
        else st = take_write_option(u0, &u, &s->policy[i], &s->need_hits[i]);
        if (st == KVC_OK && strncmp(u, "dir:", 4) == 0)
            st = kvc__tier_dir_open(u, &s->tiers[i]);
        else if (st == KVC_OK && (strncmp(u, "redis://", 8) == 0 || strncmp(u, "unix://", 7) == 0))
            st = kvc__tier_redis_open_as(u, given.redis_user, given.redis_password, &s->tiers[i]);
        else if (st == KVC_OK)
            st = kvc__error(KVC_ERR_INVALID_ARG, "%s: \"%s\": a tier is dir:PATH, "
                            "redis://HOST:PORT or unix:///PATH", fn, url_shown(u));
        kvc__free_secret(u); /* a copy of the URL: it may hold a password */
        if (st == KVC_OK) {
            s->tiers[i]->removed = tier_removed;
            s->tier_ctx[i].s = s;
            s->tier_ctx[i].t = i;
            s->tiers[i]->removed_user = &s->tier_ctx[i];
            s->tiers[i]->pool = s->pool;
            s->tiers[i]->read_timeout_ms = /* 0 (the tier's default) past ~11 days */
                p.load_timeout_s < 1e6 ? (int64_t)ceil(p.load_timeout_s * 1000) : 0;
            s->n_tiers = i + 1;
        }
    }
    if (st != KVC_OK) { /* nothing left behind: the directories made for it go too */
        close_tiers(s->tiers, s->n_tiers, 1);
        kvc__objpool_destroy(s->pool);
        free(s);
        return st;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->ev_mu, NULL);
    pthread_cond_init(&s->cv_work, NULL);
    pthread_cond_init(&s->cv_done, NULL);
    if (pthread_create(&s->thr, NULL, writer, s) != 0) {
        close_tiers(s->tiers, s->n_tiers, 1);
        pthread_cond_destroy(&s->cv_work);
        pthread_cond_destroy(&s->cv_done);
        pthread_mutex_destroy(&s->mu);
        pthread_mutex_destroy(&s->ev_mu);
        kvc__objpool_destroy(s->pool);
        free(s);
        return kvc__error(KVC_ERR_NOMEM, "%s: cannot start the writer thread", fn);
    }
    *out = s;
    return KVC_OK;
}

kvc_status kvc__store_attach_add(kvc_store *s, const void *engine, void *a) {
    pthread_mutex_lock(&s->mu);
    kvc__store_attached *q = realloc(s->attached, (size_t)(s->n_attached + 1) * sizeof *q);
    if (q) {
        s->attached = q;
        s->attached[s->n_attached++] = (kvc__store_attached){engine, a};
    }
    pthread_mutex_unlock(&s->mu);
    return q ? KVC_OK : kvc__error(KVC_ERR_NOMEM, "kvc_store_attach_engine: out of memory");
}

void *kvc__store_attach_take(kvc_store *s, const void *engine, const void *skip) {
    void *a = NULL;
    pthread_mutex_lock(&s->mu);
    for (int64_t i = s->n_attached - 1; i >= 0 && !a; i--) {
        if (s->attached[i].engine != engine || s->attached[i].a == skip) continue;
        a = s->attached[i].a;
        memmove(s->attached + i, s->attached + i + 1,
                (size_t)(s->n_attached - i - 1) * sizeof *s->attached);
        s->n_attached--;
    }
    pthread_mutex_unlock(&s->mu);
    return a;
}

kvc_status kvc_store_last_tier_error(kvc_store *s, char *buf, size_t cap) {
    KVC_CHECK(s != NULL && buf != NULL && cap > 0,
              "kvc_store_last_tier_error: store and buf must not be NULL, cap > 0");
    pthread_mutex_lock(&s->mu);
    snprintf(buf, cap, "%s", s->last_err);
    pthread_mutex_unlock(&s->mu);
    return KVC_OK;
}

kvc_status kvc_store_get_stats(kvc_store *s, kvc_store_stats *out) {
    KVC_CHECK(s != NULL && out != NULL, "kvc_store_get_stats: store and out must not be NULL");
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    pthread_mutex_unlock(&s->mu);
    return KVC_OK;
}

kvc_status kvc_store_invalidate(kvc_store *s, const kvc_store_key *ns) {
    KVC_CHECK(s != NULL && ns != NULL, "kvc_store_invalidate: store and ns must not be NULL");
    /* queued writes of ns would bring pages back: let them land first */
    kvc_status fl = kvc_store_flush(s, 30.0);
    if (fl != KVC_OK) return fl;
    kvc_status st = KVC_OK;
    char first[512] = ""; /* the first failure's message: a later tier's would overwrite it */
    for (int32_t t = 0; t < s->n_tiers; t++) {
        int removed = 0;
        kvc_status r = s->tiers[t]->ops->invalidate(s->tiers[t], ns, &removed);
        if (r != KVC_OK && st == KVC_OK) {
            st = r;
            snprintf(first, sizeof first, "%s", kvc_last_error());
        }
        /* also after a failure that removed some (a Redis server lost midway,
         * the others cleared): subscribers must not keep the removed pages,
         * and forgetting some still there only costs them routing hits */
        if (r == KVC_OK || removed)
            kvc__store_emit_page(s, KVC_STORE_EVENT_CLEARED, t, ns, NULL, NULL, NULL, 0);
    }
    return st == KVC_OK ? KVC_OK : kvc__error(st, "%s", first);
}

/* ---- reads ------------------------------------------------------------------------ */

static void add_stats(kvc_store *s, int64_t hit, int64_t miss, int64_t errors, int64_t bytes,
                      const int64_t *misses, int64_t timeouts) {
    pthread_mutex_lock(&s->mu);
    s->st.hit_pages += hit;
    s->st.miss_pages += miss;
    s->st.errors += errors;
    s->st.bytes_read += bytes;
    s->st.timeouts += timeouts;
    int64_t refused = 0;
    if (misses)
        for (int m = 1; m < KVC_STORE_MISS_COUNT; m++) {
            s->st.misses[m] += misses[m];
            refused += misses[m];
        }
    s->st.verify_failures += refused;
    /* the rest of the pages not restored: absent, unreachable or too late */
    s->st.misses[KVC_STORE_MISS_ABSENT] += miss > refused ? miss - refused : 0;
    pthread_mutex_unlock(&s->mu);
}

/* Whether pages [first, first + n) stay within int32 token positions (a
 * caller's huge first_page would otherwise wrap the sizes computed from it). */
static int run_fits(int64_t first, int64_t n, int32_t page_size) {
    const int64_t lim = page_size > 0 ? INT32_MAX / page_size : 0;
    return first >= 0 && n >= 0 && n <= lim && first <= lim - n;
}

/* Keys of pages [0, first + n) of tokens into a malloc'd array. */
static kvc_status keys_of(const kvc_store_key *ns, const int32_t *tokens, int64_t first,
                          int64_t n, int32_t page_size, int32_t unit_pages, kvc_store_key **out) {
    *out = NULL;
    KVC_CHECK(run_fits(first, n, page_size), "store: pages %lld + %lld of %d tokens are past "
              "int32 token positions", (long long)first, (long long)n, (int)page_size);
    const int64_t m = first + n;
    kvc_store_key *k = malloc((size_t)(m > 0 ? m : 1) * sizeof *k);
    if (!k) return kvc__error(KVC_ERR_NOMEM, "store: out of memory");
    kvc_status st = kvc_store_page_keys(ns, tokens, m, page_size, unit_pages, k);
    if (st != KVC_OK) {
        free(k);
        return st;
    }
    *out = k;
    return KVC_OK;
}

kvc_status kvc__store_probe_run(kvc_store *s, const kvc_store_key *ns, const int32_t *tokens,
                                int32_t page_size, int32_t unit_pages, int64_t first,
                                int64_t max, int64_t *n_pages) {
    *n_pages = 0;
    if (max <= 0) return KVC_OK;
    kvc_store_key *k;
    KVC_TRY(keys_of(ns, tokens, first, max, page_size, unit_pages, &k));
    int64_t pos = 0, errors = 0;
    for (int32_t t = 0; t < s->n_tiers && pos < max; t++) {
        int64_t n = 0;
        if (s->tiers[t]->ops->probe(s->tiers[t], ns, k + first + pos, max - pos, &n) != KVC_OK) {
            errors++;
            tier_failed(s);
            continue;
        }
        pos += n;
    }
    free(k);
    if (errors) add_stats(s, 0, 0, errors, 0, NULL, 0);
    *n_pages = pos;
    return KVC_OK;
}

/* A restore is pipelined: one thread reads batches of objects from the
 * tiers while a worker verifies the previous batch (at most two batches in
 * flight), so reading overlaps checksums and copies. The worker stops at
 * the first refused object; everything after it is discarded and read
 * again from the next tier. It either writes each verified page into the
 * cache (kvc_store_restore_run) or keeps the object for a later apply (an
 * engine's background load, kvc__store_load_*). */
typedef struct rbatch {
    int64_t pos, n; /* run index of objs[0]; objects in objs (all present) */
    int32_t tier;   /* where they came from */
    void *objs[BATCH];
    size_t lens[BATCH];
} rbatch;

typedef struct restore_ctx {
    kvc_store *s;
    const kvc_cache *cache;
    kvc_cache *wcache;              /* write mode: the cache written; NULL: keep mode */
    kvc_store_key ns;
    kvc_store_key *keys;            /* keys of pages [0, first + max) */
    const int32_t *tokens, *page_ids;
    int64_t first, max;
    int32_t P;
    int32_t unit;                   /* pages a K group spans (kvc_store_page_keys) */
    void **kept;                    /* keep mode: max verified objects */
    size_t *kept_lens;              /* and their sizes */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rbatch *q[2];
    int nq, quit;
    int cancel;                     /* keep mode: stop reading (guarded by mu) */
    int64_t good;  /* run pages verified (and written) */
    int failed;    /* a refused object: batches after it are dropped */
    int64_t bytes, errors, misses[KVC_STORE_MISS_COUNT];
    int64_t refused; /* keep mode: objects refused (counted), for the misses at finish */
} restore_ctx;

/* Promotion: a page verified from tier t > 0 is queued for tiers [0, t)
 * too, so the next lookup finds it in the first tier (a local directory
 * before a shared Redis keeps what it fetched). take: *obj is given to the
 * queue (NULL after); else copied. */
static void promote(kvc_store *s, const kvc_store_key *ns, const kvc_store_key *key, void **obj,
                    size_t len, int32_t tier, int take) {
    const uint32_t before = (1u << tier) - 1u;
    kvc_status st = take ? kvc__store_put_owned(s, ns, key, *obj, len, before)
                         : put_copy(s, ns, key, *obj, len, before);
    if (take) *obj = NULL;
    if (st != KVC_OK) kvc_clear_error(); /* counted as dropped */
}

static void rbatch_free(kvc_store *s, rbatch *b) {
    for (int64_t i = 0; i < b->n; i++) kvc__objpool_put(s->pool, b->objs[i], b->lens[i]);
    free(b);
}

static void *restore_worker(void *arg) {
    restore_ctx *r = arg;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        while (r->nq == 0 && !r->quit) pthread_cond_wait(&r->cv, &r->mu);
        if (r->nq == 0) {
            pthread_mutex_unlock(&r->mu);
            return NULL;
        }
        rbatch *b = r->q[0];
        const int failed = r->failed;
        pthread_mutex_unlock(&r->mu);
        int64_t ok = 0, bytes = 0;
        kvc_store_miss m = KVC_STORE_MISS_COUNT;
        int werr = 0;
        for (; !failed && ok < b->n; ok++) {
            const int64_t pg = r->first + b->pos + ok;
            kvc_store_expect e;
            e.ns = r->ns;
            e.key = r->keys[pg];
            e.parent = pg > 0 ? r->keys[pg - 1] : r->ns;
            e.position = pg * r->P;
            e.tokens = r->tokens + pg * r->P;
            bytes += (int64_t)b->lens[ok];
            const uint8_t *auth = kvc__store_auth_key(r->s);
            kvc_status st =
                r->wcache ? kvc_store_restore_page(r->wcache, r->page_ids[b->pos + ok],
                                                   b->objs[ok], b->lens[ok], &e, auth, &m)
                          : kvc_store_verify_object(r->cache, b->objs[ok], b->lens[ok], &e, auth,
                                                    &m);
            if (st != KVC_OK) {
                werr = m == KVC_STORE_MISS_COUNT; /* the cache refused the write */
                if (werr) tier_failed(r->s); /* counted in errors too */
                else kvc_clear_error();
                break;
            }
            if (b->tier > 0 && r->s->p.promote)
                promote(r->s, &e.ns, &e.key, &b->objs[ok], b->lens[ok], b->tier,
                        r->wcache != NULL);
            if (!r->wcache) { /* kept for the apply */
                r->kept[b->pos + ok] = b->objs[ok];
                r->kept_lens[b->pos + ok] = b->lens[ok];
                b->objs[ok] = NULL;
            }
        }
        pthread_mutex_lock(&r->mu);
        r->q[0] = r->q[1];
        r->nq--;
        if (!failed) {
            r->good = b->pos + ok;
            r->bytes += bytes;
            if (ok < b->n) {
                r->failed = 1;
                if (werr) r->errors++;
                else r->misses[m]++;
            }
        }
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        rbatch_free(r->s, b);
    }
}

/* Waits until the worker has taken every batch; the verified run's end. */
static int64_t restore_drain(restore_ctx *r) {
    pthread_mutex_lock(&r->mu);
    while (r->nq > 0) pthread_cond_wait(&r->cv, &r->mu);
    const int64_t good = r->good;
    r->failed = 0; /* the next tier starts afresh at good */
    pthread_mutex_unlock(&r->mu);
    return good;
}

/* Reads and verifies pages [first, first + max) of r (its mu and cv
 * initialized by the caller), tiers in order, with a worker thread; returns
 * the verified run's length (-1: no thread; message set) and counts
 * everything in the store's stats. */
static int64_t restore_pipeline(restore_ctx *r) {
    kvc_store *s = r->s;
    pthread_t worker;
    if (pthread_create(&worker, NULL, restore_worker, r) != 0) {
        kvc__error(KVC_ERR_NOMEM, "store: cannot start a thread");
        return -1;
    }
    const double deadline = now_s() + s->p.load_timeout_s;
    /* the tiers stop at it within a batch too (tier.h); none past ~11 days */
    const int64_t deadline_ns = s->p.load_timeout_s < 1e6 ? (int64_t)(deadline * 1e9) : 0;
    /* the largest object of this cache: a tier sends no more than one byte
     * past it (tier.h), so a huge planted object is refused by its size */
    size_t max_len = kvc_store_object_bytes(r->cache, s->has_auth);
    if (max_len == 0) max_len = SIZE_MAX / 2;
    int64_t pos = 0, errors = 0, timeouts = 0;
    int cancel = 0;
    for (int32_t t = 0; t < s->n_tiers && pos < r->max && !timeouts && !cancel; t++) {
        int64_t fetched = pos; /* this tier's reads went up to here */
        for (;;) {
            if (now_s() > deadline) {
                timeouts = 1;
                break;
            }
            pthread_mutex_lock(&r->mu);
            while (r->nq == 2 && !r->failed) pthread_cond_wait(&r->cv, &r->mu);
            const int stop = r->failed;
            cancel = r->cancel;
            pthread_mutex_unlock(&r->mu);
            if (stop || cancel || fetched >= r->max) break;
            rbatch *b = calloc(1, sizeof *b);
            if (!b) {
                errors++;
                break;
            }
            const int64_t n = r->max - fetched < BATCH ? r->max - fetched : BATCH;
            void *objs[BATCH];
            if (s->tiers[t]->ops->get(s->tiers[t], &r->ns, r->keys + r->first + fetched, n,
                                      max_len, deadline_ns, objs, b->lens) != KVC_OK) {
                errors++;
                tier_failed(s);
                free(b);
                break; /* the next tier from where the verified run ends */
            }
            b->pos = fetched;
            b->tier = t;
            while (b->n < n && objs[b->n]) b->objs[b->n] = objs[b->n], b->n++;
            for (int64_t i = b->n; i < n; i++) kvc__objpool_put(s->pool, objs[i], b->lens[i]);
            fetched += b->n;
            const int absent = b->n < n;
            if (b->n == 0) {
                free(b);
            } else {
                pthread_mutex_lock(&r->mu);
                r->q[r->nq++] = b;
                pthread_cond_signal(&r->cv);
                pthread_mutex_unlock(&r->mu);
            }
            if (absent) {
                timeouts = now_s() > deadline; /* maybe cut by it: no next tier */
                break;
            }
        }
        pos = restore_drain(r);
    }
    pthread_mutex_lock(&r->mu);
    r->quit = 1;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(worker, NULL);
    if (r->wcache) { /* a cut inside a unit: its pages are computed again (store.h) */
        const int64_t hit = pos / r->unit * r->unit;
        add_stats(s, hit, r->max - hit, errors + r->errors, r->bytes, r->misses, timeouts);
    } else { /* a load: its pages count as hits or misses when the engine uses them or not */
        add_stats(s, 0, 0, errors + r->errors, r->bytes, r->misses, timeouts);
        for (int m = 1; m < KVC_STORE_MISS_COUNT; m++) r->refused += r->misses[m];
    }
    return pos;
}

kvc_status kvc_store_restore_run(kvc_store *s, kvc_cache *cache, const kvc_store_key *ns,
                                 const int32_t *tokens, int64_t first, int64_t max,
                                 const int32_t *page_ids, int64_t *n_pages) {
    static const char fn[] = "kvc_store_restore_run";
    KVC_CHECK(s != NULL && cache != NULL && ns != NULL && n_pages != NULL &&
                  (max == 0 || (tokens != NULL && page_ids != NULL)),
              "%s: store, cache, ns, tokens, page_ids and n_pages must not be NULL", fn);
    KVC_CHECK(first >= 0 && max >= 0, "%s: first_page and max_pages must be >= 0", fn);
    *n_pages = 0;
    if (max == 0) return KVC_OK;
    kvc_cache_params cp;
    KVC_TRY(kvc_cache_get_params(cache, &cp));
    restore_ctx r;
    memset(&r, 0, sizeof r);
    const int32_t u = kvc__store_unit_pages(cache);
    KVC_CHECK(first % u == 0 && max % u == 0, "%s: first_page %lld and max_pages %lld must be "
              "whole units of %d pages (K groups span pages)", fn, (long long)first,
              (long long)max, (int)u);
    KVC_TRY(keys_of(ns, tokens, first, max, cp.page_size, u, &r.keys));
    r.s = s;
    r.cache = r.wcache = cache;
    r.ns = *ns;
    r.tokens = tokens;
    r.page_ids = page_ids;
    r.first = first;
    r.max = max;
    r.P = cp.page_size;
    r.unit = u;
    pthread_mutex_init(&r.mu, NULL);
    pthread_cond_init(&r.cv, NULL);
    const int64_t pos = restore_pipeline(&r);
    pthread_cond_destroy(&r.cv);
    pthread_mutex_destroy(&r.mu);
    free(r.keys);
    if (pos < 0) return KVC_ERR_NOMEM;
    *n_pages = pos;
    return KVC_OK;
}

/* ---- background loads (an engine's admission) ------------------------------ */

struct kvc__store_load {
    restore_ctx r;
    int32_t *tokens; /* a copy: the load runs beside the engine */
    pthread_t thr;
    pthread_mutex_t mu; /* done, and r.cancel through r.mu once the pipeline runs */
    pthread_cond_t cv;
    int done;
    int64_t ready;
};

static void *load_main(void *arg) {
    kvc__store_load *l = arg;
    int64_t pos = restore_pipeline(&l->r);
    kvc_clear_error();
    pthread_mutex_lock(&l->mu);
    l->ready = pos > 0 ? pos : 0;
    l->done = 1;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

kvc__store_load *kvc__store_load_start(kvc_store *s, const kvc_cache *cache,
                                       const kvc_store_key *ns, const int32_t *tokens,
                                       int64_t first, int64_t n) {
    kvc_cache_params cp;
    if (n <= 0 || s->n_tiers == 0 || kvc_cache_get_params(cache, &cp) != KVC_OK ||
        !run_fits(first, n, cp.page_size))
        return NULL;
    kvc__store_load *l = calloc(1, sizeof *l);
    if (!l) return NULL;
    const size_t nt = (size_t)(first + n) * (size_t)cp.page_size;
    l->tokens = malloc(nt * sizeof(int32_t));
    l->r.kept = calloc((size_t)n, sizeof(void *));
    l->r.kept_lens = calloc((size_t)n, sizeof(size_t));
    if (l->tokens) /* l->r.keys NULL on failure: handled below */
        (void)keys_of(ns, tokens, first, n, cp.page_size, kvc__store_unit_pages(cache), &l->r.keys);
    if (!l->tokens || !l->r.kept || !l->r.kept_lens || !l->r.keys) {
        kvc_clear_error();
        free(l->tokens), free(l->r.kept), free(l->r.kept_lens), free(l->r.keys), free(l);
        return NULL;
    }
    memcpy(l->tokens, tokens, nt * sizeof(int32_t));
    l->r.s = s;
    l->r.cache = cache;
    l->r.ns = *ns;
    l->r.tokens = l->tokens;
    l->r.first = first;
    l->r.max = n;
    l->r.P = cp.page_size;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    pthread_mutex_init(&l->r.mu, NULL);
    pthread_cond_init(&l->r.cv, NULL);
    if (pthread_create(&l->thr, NULL, load_main, l) != 0) {
        pthread_cond_destroy(&l->r.cv);
        pthread_mutex_destroy(&l->r.mu);
        pthread_cond_destroy(&l->cv);
        pthread_mutex_destroy(&l->mu);
        free(l->tokens), free(l->r.kept), free(l->r.kept_lens), free(l->r.keys), free(l);
        return NULL;
    }
    return l;
}

int kvc__store_load_poll(kvc__store_load *l, int wait, int64_t *n_ready) {
    pthread_mutex_lock(&l->mu);
    while (wait && !l->done) pthread_cond_wait(&l->cv, &l->mu);
    const int done = l->done;
    *n_ready = done ? l->ready : 0;
    pthread_mutex_unlock(&l->mu);
    return done;
}

const int32_t *kvc__store_load_tokens(const kvc__store_load *l, int64_t *first) {
    *first = l->r.first;
    return l->tokens;
}

void kvc__store_load_finish(kvc__store_load *l, kvc_cache *cache, int64_t skip,
                            const int32_t *page_ids, int64_t n) {
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    const int done = l->done;
    pthread_mutex_unlock(&l->mu);
    if (!done) { /* stop reading at the next batch */
        pthread_mutex_lock(&l->r.mu);
        l->r.cancel = 1;
        pthread_cond_broadcast(&l->r.cv);
        pthread_mutex_unlock(&l->r.mu);
    }
    pthread_join(l->thr, NULL);
    if (n > l->ready - skip) n = l->ready - skip;
    int64_t applied = 0;
    if (cache && skip >= 0) {
        for (int64_t i = 0; i < n; i++) /* verified whole: the write cannot be refused */
            if (kvc__store_apply_payload(cache, page_ids[i], l->r.kept[skip + i]) != KVC_OK)
                kvc_clear_error();
            else
                applied++;
    }
    /* hits are the pages restored into the cache, not the ones read: pages
     * the engine drops (the request left, its prefix cache had them by now,
     * past the pages it reserved) are misses like the ones never found */
    pthread_mutex_lock(&l->r.s->mu);
    l->r.s->st.hit_pages += applied;
    l->r.s->st.miss_pages += l->r.max - applied;
    l->r.s->st.misses[KVC_STORE_MISS_ABSENT] +=
        l->r.max - applied > l->r.refused ? l->r.max - applied - l->r.refused : 0;
    pthread_mutex_unlock(&l->r.s->mu);
    for (int64_t i = 0; i < l->r.max; i++)
        kvc__objpool_put(l->r.s->pool, l->r.kept[i], l->r.kept_lens[i]);
    pthread_cond_destroy(&l->r.cv);
    pthread_mutex_destroy(&l->r.mu);
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    free(l->tokens), free(l->r.kept), free(l->r.kept_lens), free(l->r.keys), free(l);
}

kvc_status kvc__store_save_page(kvc_store *s, const kvc_cache *cache, int32_t page_id,
                                const kvc_store_expect *e, uint32_t tiers) {
    const size_t size = kvc__store_object_size(cache, e->position, s->has_auth);
    void *obj = kvc__objpool_get(s->pool, size);
    kvc_status st = obj ? kvc_store_serialize_page(cache, page_id, e, kvc__store_auth_key(s), obj,
                                                   size, NULL)
                        : kvc__error(KVC_ERR_NOMEM, "store: out of memory");
    if (st == KVC_OK) return kvc__store_put_owned(s, &e->ns, &e->key, obj, size, tiers);
    kvc__objpool_put(s->pool, obj, size);
    count_dropped(s);
    return st;
}

/* Queues objs[0..n) (malloc'd or pooled, sizes[i] bytes) under (ns, keys[i])
 * for every tier, all or none: on a failure every object is freed and the n
 * writes are counted as dropped, so a failed save_run leaves the queue as it
 * was (a run cut short would keep the prefix's first pages and lose the
 * rest, a state the caller cannot see). */
static kvc_status put_owned_all(kvc_store *s, const kvc_store_key *ns, const kvc_store_key *keys,
                                void **objs, const size_t *sizes, int64_t n) {
    const uint32_t tiers = kvc__store_all_tiers(s);
    item **its = calloc((size_t)n, sizeof *its);
    int64_t bytes = 0, i = 0;
    for (; its && i < n && (its[i] = malloc(sizeof **its)); i++) {
        its[i]->next = NULL;
        its[i]->ns = *ns;
        its[i]->key = keys[i];
        its[i]->obj = objs[i];
        its[i]->size = sizes[i];
        its[i]->tiers = tiers;
        bytes += (int64_t)sizes[i];
    }
    kvc_status st = KVC_OK;
    pthread_mutex_lock(&s->mu);
    if (i < n) {
        s->st.writes_dropped += n;
        st = kvc__error(KVC_ERR_NOMEM, "kvc_store_save_run: out of memory: nothing queued");
    } else if (s->q_n + n > s->p.queue_objects || s->q_bytes + bytes > s->p.queue_bytes) {
        s->st.writes_dropped += n;
        st = kvc__error(KVC_ERR_NO_SPACE, "kvc_store_save_run: %lld objects (%lld bytes) do not "
                        "fit in the write queue (%lld of %d objects, %lld of %lld bytes taken): "
                        "nothing queued", (long long)n, (long long)bytes, (long long)s->q_n,
                        (int)s->p.queue_objects, (long long)s->q_bytes,
                        (long long)s->p.queue_bytes);
    } else {
        for (int64_t k = 0; k < n; k++) {
            if (s->tail) s->tail->next = its[k];
            else s->head = its[k];
            s->tail = its[k];
        }
        s->q_n += n;
        s->q_bytes += bytes;
        s->enq += n;
        s->st.writes_queued += n;
        pthread_cond_signal(&s->cv_work);
    }
    pthread_mutex_unlock(&s->mu);
    if (st != KVC_OK) {
        for (int64_t k = 0; k < n; k++) kvc__objpool_put(s->pool, objs[k], sizes[k]);
        for (int64_t k = 0; its && k < i; k++) free(its[k]);
    }
    free(its);
    return st;
}

kvc_status kvc_store_save_run(kvc_store *s, const kvc_cache *cache, const kvc_store_key *ns,
                              const int32_t *tokens, int64_t first, int64_t n,
                              const int32_t *page_ids) {
    static const char fn[] = "kvc_store_save_run";
    KVC_CHECK(s != NULL && cache != NULL && ns != NULL &&
                  (n == 0 || (tokens != NULL && page_ids != NULL)),
              "%s: store, cache, ns, tokens and page_ids must not be NULL", fn);
    KVC_CHECK(first >= 0 && n >= 0, "%s: first_page and n_pages must be >= 0", fn);
    if (n == 0) return KVC_OK;
    kvc_cache_params cp;
    KVC_TRY(kvc_cache_get_params(cache, &cp));
    const int32_t P = cp.page_size, u = kvc__store_unit_pages(cache);
    KVC_CHECK(first % u == 0 && n % u == 0, "%s: first_page %lld and n_pages %lld must be whole "
              "units of %d pages (K groups span pages)", fn, (long long)first, (long long)n,
              (int)u);
    if (s->n_tiers == 0) return KVC_OK; /* nowhere to write: nothing to serialize */
    kvc_store_key *k;
    kvc_status st = keys_of(ns, tokens, first, n, P, u, &k);
    if (st != KVC_OK) {
        if (st == KVC_ERR_NOMEM) { /* writes lost to memory are drops; bad runs are not */
            pthread_mutex_lock(&s->mu);
            s->st.writes_dropped += n;
            pthread_mutex_unlock(&s->mu);
        }
        return st;
    }
    /* every page serialized before any is queued: all or none */
    void **objs = calloc((size_t)n, sizeof *objs);
    size_t *sizes = calloc((size_t)n, sizeof *sizes);
    st = objs && sizes ? KVC_OK : kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    for (int64_t i = 0; i < n && st == KVC_OK; i++) {
        const int64_t pg = first + i;
        kvc_store_expect e;
        e.ns = *ns;
        e.key = k[pg];
        e.parent = pg > 0 ? k[pg - 1] : *ns;
        e.position = pg * P;
        e.tokens = tokens + pg * P;
        sizes[i] = kvc__store_object_size(cache, e.position, s->has_auth);
        objs[i] = kvc__objpool_get(s->pool, sizes[i]);
        st = objs[i] ? kvc_store_serialize_page(cache, page_ids[i], &e, kvc__store_auth_key(s),
                                                objs[i], sizes[i], NULL)
                     : kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    }
    if (st == KVC_OK) {
        st = put_owned_all(s, ns, k + first, objs, sizes, n); /* takes objs */
    } else {
        for (int64_t i = 0; objs && sizes && i < n; i++)
            kvc__objpool_put(s->pool, objs[i], sizes[i]);
        pthread_mutex_lock(&s->mu);
        s->st.writes_dropped += n;
        pthread_mutex_unlock(&s->mu);
    }
    free(objs);
    free(sizes);
    free(k);
    return st;
}
