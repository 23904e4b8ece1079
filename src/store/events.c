/*
 * The store's events as vLLM KV events over ZeroMQ (store.h, section 7 of
 * docs/KV_STORE.md), so that cache-aware routers built for vLLM can route
 * to a kvcache engine. Wire format after vllm-project/vllm
 * vllm/distributed/kv_events.py at commit 0181ea3173e53eea8cf04a86891488e3dc89bb34
 * (ZmqEventPublisher, KVEventBatch, BlockStored, BlockRemoved,
 * AllBlocksCleared; events map-encoded since vLLM PR #42892).
 *
 * The callback only copies the event into a bounded ring (it runs on the
 * store's writer thread or an engine's: it must never wait on the network);
 * one publisher thread owns the sockets (ZeroMQ sockets are not
 * thread-safe): the PUB socket and the optional replay ROUTER socket, which
 * it serves between batches from the newest batches it keeps.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, pthread_cond_timedwait */
#include <errno.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "../core/internal.h"
#include "store_internal.h"

#define QUEUE_CAP 4096   /* events waiting at most */
#define BATCH_MAX 64     /* events per KVEventBatch */
#define BATCH_WAIT_S 0.010 /* a partial batch waits this long for company */
#define GRACE_S 0.200    /* after the bind, before the first send (slow joiners) */
#define LINGER_MS 1000   /* close: how long ZeroMQ may keep delivering */
#define REPLAY_POLL_S 0.020 /* an idle publisher looks for replay requests this often */
#define ID_MAX 256       /* ZeroMQ routing ids are at most 255 bytes */

typedef struct qev {
    kvc_store_event_kind kind;
    int32_t tier;
    kvc_store_key ns, key, parent;
    int32_t *tokens; /* malloc'd copy (STORED), else NULL */
    int32_t n_tokens;
} qev;

typedef struct kept {
    uint64_t seq;
    void *payload;
    size_t size;
} kept;

struct kvc_store_events {
    kvc_store *store;
    void *zctx, *pub, *replay;
    kvc_store_events_params p;
    kept *kept; /* replay ring (publisher thread only) */
    int32_t kept_head, kept_n;
    int64_t kept_bytes;
    pthread_t thr;
    pthread_mutex_t mu; /* ring, stop, stats */
    pthread_cond_t cv;
    qev ring[QUEUE_CAP];
    int32_t head, n;
    int stop;
    int lost; /* an event was dropped since the last batch was taken: skip a number */
    double t_bind; /* monotonic */
    uint64_t seq;  /* next sequence number (publisher thread only) */
    kvc_store_events_stats st;
};

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static struct timespec mono_at(double t) {
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    return ts;
}

/* ---- callback (writer and engine threads) ------------------------------------ */

static void on_event(void *user, const kvc_store_event *ev) {
    kvc_store_events *e = user;
    int32_t *tok = NULL;
    if (ev->kind == KVC_STORE_EVENT_STORED && ev->tokens && ev->n_tokens > 0)
        tok = malloc((size_t)ev->n_tokens * sizeof *tok);
    const int lost_tokens = ev->kind == KVC_STORE_EVENT_STORED && !tok;
    pthread_mutex_lock(&e->mu);
    if (e->n == QUEUE_CAP || lost_tokens) { /* a BlockStored without its ids is useless */
        e->st.events_dropped++;
        e->lost = 1;
        pthread_mutex_unlock(&e->mu);
        free(tok);
        return;
    }
    qev *q = &e->ring[(e->head + e->n) % QUEUE_CAP];
    q->kind = ev->kind;
    q->tier = ev->tier;
    q->ns = ev->ns;
    q->key = ev->key;
    q->parent = ev->parent;
    q->tokens = tok;
    q->n_tokens = tok ? ev->n_tokens : 0;
    if (tok) memcpy(tok, ev->tokens, (size_t)ev->n_tokens * sizeof *tok);
    if (++e->n == 1 || e->n == BATCH_MAX) pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* ---- encoding ------------------------------------------------------------------ */

/* Routers weigh a hit by medium. The attached engine's cache is its working
 * KV (where vLLM says "GPU", MEDIUM_GPU) even though ours lives in host
 * memory: "CPU" would tell them the block needs a transfer first. Tiers use
 * the names routers know for slower places (Dynamo's StorageTier parsing:
 * "DISK", "EXTERNAL" for a store shared across engines). */
static const char *medium_of(const kvc_store *s, int32_t tier) {
    if (tier == KVC_STORE_TIER_CACHE) return "GPU";
    const char *kind = kvc__store_tier_kind(s, tier);
    if (kind && strcmp(kind, "dir") == 0) return "DISK";
    return "EXTERNAL";
}

static void pack_cstr(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static void pack_key(msgpack_packer *pk, const kvc_store_key *k) {
    msgpack_pack_bin(pk, sizeof k->b);
    msgpack_pack_bin_body(pk, k->b, sizeof k->b);
}

/* One vLLM event for ev[0..n), a run that groups: consecutive blocks of one
 * chain (one BlockStored, as vLLM sends a request's new blocks) or removals
 * from one medium (one BlockRemoved). */
static void pack_event(msgpack_packer *pk, const kvc_store *s, const qev *ev, int n) {
    const char *medium = medium_of(s, ev[0].tier);
    if (ev[0].kind == KVC_STORE_EVENT_STORED) {
        msgpack_pack_map(pk, 8); /* every BlockStored field without a default, in order */
        pack_cstr(pk, "type");
        pack_cstr(pk, "BlockStored");
        pack_cstr(pk, "block_hashes");
        msgpack_pack_array(pk, (size_t)n);
        for (int i = 0; i < n; i++) pack_key(pk, &ev[i].key);
        pack_cstr(pk, "parent_block_hash");
        /* vLLM: None for a request's first block; our first page's parent
         * is the namespace digest, which names no block */
        if (memcmp(ev[0].parent.b, ev[0].ns.b, 16) == 0) msgpack_pack_nil(pk);
        else pack_key(pk, &ev[0].parent);
        pack_cstr(pk, "token_ids");
        msgpack_pack_array(pk, (size_t)n * (size_t)ev[0].n_tokens);
        for (int i = 0; i < n; i++)
            for (int32_t j = 0; j < ev[i].n_tokens; j++) msgpack_pack_int32(pk, ev[i].tokens[j]);
        pack_cstr(pk, "block_size");
        msgpack_pack_int32(pk, ev[0].n_tokens);
        pack_cstr(pk, "lora_id");
        msgpack_pack_nil(pk);
        pack_cstr(pk, "medium");
        pack_cstr(pk, medium);
        pack_cstr(pk, "lora_name");
        msgpack_pack_nil(pk);
    } else if (ev[0].kind == KVC_STORE_EVENT_REMOVED) {
        msgpack_pack_map(pk, 3);
        pack_cstr(pk, "type");
        pack_cstr(pk, "BlockRemoved");
        pack_cstr(pk, "block_hashes");
        msgpack_pack_array(pk, (size_t)n);
        for (int i = 0; i < n; i++) pack_key(pk, &ev[i].key);
        pack_cstr(pk, "medium");
        pack_cstr(pk, medium);
    } else {
        /* vLLM's AllBlocksCleared has no fields; medium is ours (decoders
         * ignore unknown keys), and a router that clears everything of
         * this engine only forgets blocks, never routes wrongly */
        msgpack_pack_map(pk, 2);
        pack_cstr(pk, "type");
        pack_cstr(pk, "AllBlocksCleared");
        pack_cstr(pk, "medium");
        pack_cstr(pk, medium);
    }
}

/* How many of ev[0..n) form the run pack_event sends as one event. */
static int run_length(const qev *ev, int n) {
    int r = 1;
    if (ev[0].kind == KVC_STORE_EVENT_CLEARED) return 1;
    while (r < n && ev[r].kind == ev[0].kind && ev[r].tier == ev[0].tier) {
        if (ev[0].kind == KVC_STORE_EVENT_STORED &&
            (ev[r].n_tokens != ev[0].n_tokens || memcmp(ev[r].parent.b, ev[r - 1].key.b, 16) ||
             memcmp(ev[r].ns.b, ev[0].ns.b, 16)))
            break;
        r++;
    }
    return r;
}

/* Encodes ev[0..n) as KVEventBatch [ts, events, data_parallel_rank]. The
 * batch stays positional (vLLM's EventBatch was array_like through the
 * releases routers decode, and current decoders read either); events are
 * maps tagged by "type" (vLLM PR #42892). */
typedef struct out_buf {
    msgpack_sbuffer sb;
    int failed; /* out of memory: the bytes are incomplete */
} out_buf;

static int out_write(void *data, const char *buf, size_t len) {
    out_buf *o = data;
    if (msgpack_sbuffer_write(&o->sb, buf, len) != 0) o->failed = 1;
    return 0; /* keep going: the result is discarded anyway */
}

static void pack_batch(out_buf *o, const kvc_store *s, const qev *ev, int n) {
    msgpack_packer pk;
    msgpack_packer_init(&pk, o, out_write);
    int n_events = 0;
    for (int i = 0; i < n; i += run_length(ev + i, n - i)) n_events++;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec);
    msgpack_pack_array(&pk, (size_t)n_events);
    for (int i = 0, r; i < n; i += r) {
        r = run_length(ev + i, n - i);
        pack_event(&pk, s, ev + i, r);
    }
    msgpack_pack_int32(&pk, 0); /* one engine: rank 0, as vLLM without data parallelism */
}

/* ---- publisher thread ------------------------------------------------------------ */

static void be64(uint8_t out[8], uint64_t v) {
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)(v >> (56 - 8 * i));
}

static int send_batch(kvc_store_events *e, const out_buf *o) {
    const msgpack_sbuffer *sb = &o->sb;
    uint8_t seq[8];
    be64(seq, e->seq);
    e->seq++; /* used even by a failed send, as vLLM's: a gap tells of a loss */
    /* PUB never blocks: past the high-water mark ZeroMQ drops (DONTWAIT
     * only guards against a transport that would) */
    if (zmq_send(e->pub, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(e->pub, seq, sizeof seq, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(e->pub, sb->data, sb->size, ZMQ_DONTWAIT) < 0)
        return -1;
    return 0;
}

/* Keeps a copy of the batch numbered seq for replay, dropping the oldest
 * past the limits (out of memory: the batch is not replayable). */
static void keep_batch(kvc_store_events *e, uint64_t seq, const msgpack_sbuffer *sb) {
    if (!e->replay || (int64_t)sb->size > e->p.replay_bytes) return;
    while (e->kept_n > 0 && (e->kept_n == e->p.replay_batches ||
                             e->kept_bytes + (int64_t)sb->size > e->p.replay_bytes)) {
        kept *k = &e->kept[e->kept_head];
        e->kept_bytes -= (int64_t)k->size;
        free(k->payload);
        e->kept_head = (e->kept_head + 1) % e->p.replay_batches;
        e->kept_n--;
    }
    void *copy = malloc(sb->size ? sb->size : 1);
    if (!copy) return;
    memcpy(copy, sb->data, sb->size);
    kept *k = &e->kept[(e->kept_head + e->kept_n) % e->p.replay_batches];
    k->seq = seq;
    k->payload = copy;
    k->size = sb->size;
    e->kept_n++;
    e->kept_bytes += (int64_t)sb->size;
}

/* One frame of a request into buf (cap bytes); its size, or -1 when it
 * does not fit; *more: frames follow. */
static int recv_frame(void *sock, uint8_t *buf, size_t cap, int *more) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&m);
        *more = 0;
        return -2;
    }
    const size_t n = zmq_msg_size(&m);
    *more = zmq_msg_more(&m);
    if (n <= cap) memcpy(buf, zmq_msg_data(&m), n);
    zmq_msg_close(&m);
    return n <= cap ? (int)n : -1;
}

/* One replay answer to the client id (idn bytes): [id, "", seq, payload]. */
static void send_reply(kvc_store_events *e, const uint8_t *id, size_t idn, const uint8_t seq[8],
                       const void *payload, size_t size) {
    zmq_send(e->replay, id, idn, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(e->replay, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(e->replay, seq, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(e->replay, payload, size, ZMQ_DONTWAIT);
}

/* Answers the replay requests waiting (publisher thread). A request that is
 * not [identity, "", 8 bytes] is dropped unanswered, as vLLM does. Sends
 * never wait: past the socket's high-water mark ZeroMQ drops them. */
static void serve_replay(kvc_store_events *e) {
    for (;;) {
        zmq_pollitem_t it = {e->replay, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 0) <= 0 || !(it.revents & ZMQ_POLLIN)) return;
        uint8_t id[ID_MAX], f[3][8];
        int more = 0, nf = 0, sz[4] = {0, 0, 0, 0};
        sz[0] = recv_frame(e->replay, id, sizeof id, &more);
        nf = sz[0] == -2 ? 0 : 1;
        while (more) { /* the rest of the message, kept only while it fits the shape */
            uint8_t junk[8];
            int r = recv_frame(e->replay, nf < 3 ? f[nf] : junk, 8, &more);
            if (nf < 4) sz[nf] = r;
            nf++;
        }
        if (nf != 3 || sz[0] < 0 || sz[1] != 0 || sz[2] != 8) continue;
        uint64_t start = 0;
        for (int i = 0; i < 8; i++) start = start << 8 | f[2][i];
        const size_t idn = (size_t)sz[0];
        pthread_mutex_lock(&e->mu); /* counted first: a client may read the stats on END */
        e->st.replays++;
        pthread_mutex_unlock(&e->mu);
        for (int32_t i = 0; i < e->kept_n; i++) {
            const kept *k = &e->kept[(e->kept_head + i) % e->p.replay_batches];
            if (k->seq < start) continue;
            uint8_t seq[8];
            be64(seq, k->seq);
            send_reply(e, id, idn, seq, k->payload, k->size);
        }
        static const uint8_t end_seq[8] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
        send_reply(e, id, idn, end_seq, "", 0); /* vLLM's END_SEQ (-1) */
    }
}

static void *publisher(void *arg) {
    kvc_store_events *e = arg;
    qev batch[BATCH_MAX];
    out_buf o;
    msgpack_sbuffer_init(&o.sb);
    int unsent = 0; /* the last number was not delivered (a failed send or encode) */
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (e->n == 0 && !e->stop) {
            if (!e->replay) {
                pthread_cond_wait(&e->cv, &e->mu);
                continue;
            }
            struct timespec ts = mono_at(mono_s() + REPLAY_POLL_S);
            pthread_cond_timedwait(&e->cv, &e->mu, &ts);
            pthread_mutex_unlock(&e->mu);
            serve_replay(e);
            pthread_mutex_lock(&e->mu);
        }
        if (e->n == 0) { /* stopped and drained */
            /* Events lost after the last batch (dropped, or that batch not
             * sent) leave no gap unless a batch follows: a last one with no
             * events shows it, so a subscriber forgets what it may have
             * missed rather than trusting it (vLLM: [ts, [], rank]). */
            if (e->lost || unsent) {
                const struct timespec ts = mono_at(e->t_bind + GRACE_S);
                while (mono_s() < e->t_bind + GRACE_S) pthread_cond_timedwait(&e->cv, &e->mu, &ts);
                if (e->lost) e->seq++;
                e->lost = 0;
                pthread_mutex_unlock(&e->mu);
                msgpack_sbuffer_clear(&o.sb);
                o.failed = 0;
                pack_batch(&o, e->store, batch, 0);
                const uint64_t seq = e->seq;
                const int ok = !o.failed && send_batch(e, &o) == 0;
                if (!o.failed) keep_batch(e, seq, &o.sb);
                pthread_mutex_lock(&e->mu);
                if (ok) e->st.batches_sent++;
            }
            break;
        }
        /* slow joiners: a SUB that connects right after the bind gets
         * nothing sent before its connection completes */
        double t = e->t_bind + GRACE_S;
        if (!e->stop || mono_s() < t) {
            /* a partial batch waits a little for more (and out the grace) */
            double until = mono_s() + BATCH_WAIT_S;
            if (until < t) until = t;
            struct timespec ts = mono_at(until);
            while (e->n < BATCH_MAX && !e->stop && mono_s() < until &&
                   pthread_cond_timedwait(&e->cv, &e->mu, &ts) != ETIMEDOUT) {
            }
            ts = mono_at(t);
            while (mono_s() < t) pthread_cond_timedwait(&e->cv, &e->mu, &ts);
        }
        int n = e->n < BATCH_MAX ? e->n : BATCH_MAX;
        for (int i = 0; i < n; i++) batch[i] = e->ring[(e->head + i) % QUEUE_CAP];
        e->head = (e->head + n) % QUEUE_CAP;
        e->n -= n;
        const int lost = e->lost;
        e->lost = 0;
        pthread_mutex_unlock(&e->mu);
        /* Events dropped before this batch have no number of their own:
         * one is skipped, so a subscriber sees the gap (a loss) as for a
         * failed send. Never replayable: replay's answer starts past it. */
        if (lost) e->seq++;

        msgpack_sbuffer_clear(&o.sb);
        o.failed = 0;
        pack_batch(&o, e->store, batch, n);
        const uint64_t seq = e->seq;
        const int ok = !o.failed && send_batch(e, &o) == 0;
        if (o.failed) e->seq++; /* not encoded, not sent: its number is a gap too */
        /* kept even when the PUB send failed: replay can still deliver it */
        if (!o.failed) keep_batch(e, seq, &o.sb);
        for (int i = 0; i < n; i++) free(batch[i].tokens);
        if (e->replay) serve_replay(e);

        unsent = !ok;
        pthread_mutex_lock(&e->mu);
        if (ok) {
            e->st.events_sent += n;
            e->st.batches_sent++;
        } else {
            e->st.events_dropped += n;
        }
    }
    pthread_mutex_unlock(&e->mu);
    msgpack_sbuffer_destroy(&o.sb);
    return NULL;
}

/* ---- open / close ---------------------------------------------------------------- */

static void free_events(kvc_store_events *e) {
    if (e->pub) zmq_close(e->pub);
    if (e->replay) zmq_close(e->replay);
    for (int32_t i = 0; e->kept && i < e->kept_n; i++)
        free(e->kept[(e->kept_head + i) % e->p.replay_batches].payload);
    free(e->kept);
    if (e->zctx) zmq_ctx_term(e->zctx); /* waits out LINGER_MS at most */
    free(e);
}

kvc_store_events_params kvc_store_events_default_params(void) {
    kvc_store_events_params p;
    p.replay_endpoint = NULL;
    p.replay_batches = 10000; /* vLLM's buffer_steps */
    p.replay_bytes = (int64_t)64 << 20;
    return p;
}

kvc_status kvc_store_events_open(kvc_store *store, const char *endpoint,
                                 kvc_store_events **out) {
    return kvc_store_events_open_with(store, endpoint, NULL, out);
}

kvc_status kvc_store_events_open_with(kvc_store *store, const char *endpoint,
                                      const kvc_store_events_params *params,
                                      kvc_store_events **out) {
    static const char fn[] = "kvc_store_events_open";
    if (out) *out = NULL;
    KVC_CHECK(store != NULL && endpoint != NULL && out != NULL,
              "%s: store, endpoint and out must not be NULL", fn);
    const kvc_store_events_params p = params ? *params : kvc_store_events_default_params();
    KVC_CHECK(!p.replay_endpoint || (p.replay_batches >= 1 && p.replay_bytes >= 1),
              "%s: replay_batches and replay_bytes must be >= 1 (got %d, %lld)", fn,
              (int)p.replay_batches, (long long)p.replay_bytes);
    kvc_store_events *e = calloc(1, sizeof *e);
    if (!e) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    e->store = store;
    e->p = p;
    e->p.replay_endpoint = NULL; /* not kept: the caller's string */
    const int hwm = 100000, linger = LINGER_MS; /* vLLM's default hwm */
    if (!(e->zctx = zmq_ctx_new()) || !(e->pub = zmq_socket(e->zctx, ZMQ_PUB)) ||
        zmq_setsockopt(e->pub, ZMQ_SNDHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(e->pub, ZMQ_LINGER, &linger, sizeof linger) != 0) {
        kvc_status st = kvc__error(KVC_ERR_NOMEM, "%s: ZeroMQ: %s", fn, zmq_strerror(zmq_errno()));
        free_events(e);
        return st;
    }
    if (zmq_bind(e->pub, endpoint) != 0) {
        kvc_status st = kvc__error(KVC_ERR_IO, "%s: cannot bind \"%s\": %s", fn, endpoint,
                                   zmq_strerror(zmq_errno()));
        free_events(e);
        return st;
    }
    if (p.replay_endpoint) {
        /* a bounded send queue: a few full replays, then ZeroMQ drops */
        const int rhwm = p.replay_batches < 250000 ? 4 * (p.replay_batches + 1) : 1000000;
        if (!(e->kept = calloc((size_t)p.replay_batches, sizeof *e->kept)) ||
            !(e->replay = zmq_socket(e->zctx, ZMQ_ROUTER)) ||
            zmq_setsockopt(e->replay, ZMQ_SNDHWM, &rhwm, sizeof rhwm) != 0 ||
            zmq_setsockopt(e->replay, ZMQ_LINGER, &linger, sizeof linger) != 0) {
            kvc_status st = kvc__error(KVC_ERR_NOMEM, "%s: replay: %s", fn,
                                       e->kept ? zmq_strerror(zmq_errno()) : "out of memory");
            free_events(e);
            return st;
        }
        if (zmq_bind(e->replay, p.replay_endpoint) != 0) {
            kvc_status st = kvc__error(KVC_ERR_IO, "%s: cannot bind the replay endpoint "
                                       "\"%s\": %s", fn, p.replay_endpoint,
                                       zmq_strerror(zmq_errno()));
            free_events(e);
            return st;
        }
    }
    e->t_bind = mono_s();
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&e->thr, NULL, publisher, e) != 0) {
        pthread_cond_destroy(&e->cv);
        pthread_mutex_destroy(&e->mu);
        free_events(e);
        return kvc__error(KVC_ERR_NOMEM, "%s: cannot start the publisher thread", fn);
    }
    kvc_status st = kvc_store_set_event_callback(store, on_event, e);
    if (st != KVC_OK) {
        kvc_store_events_close(e);
        return st;
    }
    *out = e;
    return KVC_OK;
}

void kvc_store_events_close(kvc_store_events *e) {
    if (!e) return;
    /* first: once it returns no callback is running, so nothing adds to
     * the ring after the drain below */
    kvc__store_clear_event_callback(e->store, on_event, e);
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thr, NULL);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free_events(e);
}

kvc_status kvc_store_events_get_stats(kvc_store_events *e, kvc_store_events_stats *out) {
    KVC_CHECK(e != NULL && out != NULL, "kvc_store_events_get_stats: ev and out must not be NULL");
    pthread_mutex_lock(&e->mu);
    *out = e->st;
    pthread_mutex_unlock(&e->mu);
    return KVC_OK;
}
