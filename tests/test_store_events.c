/* The event publisher (src/store/events.c): what a subscriber receives,
 * decoded with msgpack-c as a vLLM KV-event subscriber would read it
 * (docs/KV_STORE.md section 7); draining at close; argument errors. Every
 * test works in its own mkdtemp directory (a dir tier and an ipc socket). */
#define _XOPEN_SOURCE 700 /* nftw, mkdtemp, nanosleep */
#include <ftw.h>
#include <msgpack.h>
#include <stdlib.h>
#include <time.h>
#include <zmq.h>

#include "test.h"
#include "test_oom.h"
#include "kvcache/store.h"
#include "store/store_internal.h" /* kvc__store_emit_page: one event, no other allocation */

#define P 4 /* tokens per page */

/* ---- helpers ---------------------------------------------------------------- */

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *f) {
    (void)sb, (void)flag, (void)f;
    return remove(p);
}

static int make_tmpdir(char buf[64]) {
    snprintf(buf, 64, "/tmp/kvc-ev-test-XXXXXX");
    return mkdtemp(buf) ? 0 : -1;
}

/* A test's directory, its dir tier's store and the endpoints inside it. */
typedef struct fixture {
    char dir[64], ep[128], rep[128];
    kvc_store *st;
} fixture;

static kvc_status fixture_open(fixture *f) {
    char url[128];
    memset(f, 0, sizeof *f);
    if (make_tmpdir(f->dir) != 0) return KVC_ERR_IO;
    snprintf(url, sizeof url, "dir:%s/tier", f->dir);
    snprintf(f->ep, sizeof f->ep, "ipc://%s/ev.sock", f->dir);
    snprintf(f->rep, sizeof f->rep, "ipc://%s/replay.sock", f->dir);
    const char *urls[] = {url};
    return kvc_store_open(urls, 1, NULL, &f->st);
}

static void fixture_close(fixture *f) {
    kvc_store_close(f->st);
    nftw(f->dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
}

static kvc_store_key mk(uint32_t i, uint8_t tag) {
    kvc_store_key k;
    for (int j = 0; j < 16; j++) k.b[j] = (uint8_t)(0x3c ^ (j * 29) ^ tag);
    memcpy(k.b + 4, &i, 4);
    return k;
}

/* An object whose header carries what events read (parent at 48, token
 * count at 72, ids at 128); nothing verifies it on the way out. */
static void *fake_obj(const kvc_store_key *parent, int32_t first_token, size_t *size) {
    *size = KVC_STORE_HEADER_BYTES + 4 * P + 64;
    unsigned char *o = calloc(1, *size);
    if (!o) return NULL;
    memcpy(o, "KVCPAGE", 8);
    memcpy(o + 48, parent->b, 16);
    o[72] = P;
    for (int32_t i = 0; i < P; i++) {
        uint32_t t = (uint32_t)(first_token + i);
        for (int b = 0; b < 4; b++) o[KVC_STORE_HEADER_BYTES + 4 * i + b] = (uint8_t)(t >> 8 * b);
    }
    return o;
}

typedef struct sub {
    void *ctx, *sock;
} sub;

static int sub_open(sub *s, const char *endpoint) {
    int timeout_ms = 5000, hwm = 0;
    s->ctx = zmq_ctx_new();
    s->sock = s->ctx ? zmq_socket(s->ctx, ZMQ_SUB) : NULL;
    return s->sock && zmq_setsockopt(s->sock, ZMQ_SUBSCRIBE, "", 0) == 0 &&
                   zmq_setsockopt(s->sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms) == 0 &&
                   zmq_setsockopt(s->sock, ZMQ_RCVHWM, &hwm, sizeof hwm) == 0 &&
                   zmq_connect(s->sock, endpoint) == 0
               ? 0
               : -1;
}

static void sub_close(sub *s) {
    int linger = 0;
    if (s->sock) zmq_setsockopt(s->sock, ZMQ_LINGER, &linger, sizeof linger), zmq_close(s->sock);
    if (s->ctx) zmq_ctx_term(s->ctx);
}

/* One message: its 3 frames' sizes checked; *seq from frame 1, the payload
 * copied to *buf (malloc'd: u's strings and bins point into it; free it
 * after u) and unpacked into u. 0 ok, -1 nothing came (timeout) or a bad
 * shape. */
static int sub_recv(sub *s, uint64_t *seq, msgpack_unpacked *u, void **buf) {
    *buf = NULL;
    zmq_msg_t f[3];
    int n = 0, more = 1, ok = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s->sock, 0) < 0) {
            zmq_msg_close(&m);
            ok = 0;
            break;
        }
        more = zmq_msg_more(&m);
        if (n < 3) f[n] = m;
        else zmq_msg_close(&m);
        n++;
    }
    if (ok && (n != 3 || zmq_msg_size(&f[0]) != 0 || zmq_msg_size(&f[1]) != 8)) ok = 0;
    if (ok) {
        const unsigned char *b = zmq_msg_data(&f[1]);
        *seq = 0;
        for (int i = 0; i < 8; i++) *seq = *seq << 8 | b[i];
        size_t off = 0, size = zmq_msg_size(&f[2]);
        msgpack_unpacked_init(u);
        if (!(*buf = malloc(size ? size : 1))) ok = 0;
        else memcpy(*buf, zmq_msg_data(&f[2]), size);
        if (ok && (msgpack_unpack_next(u, *buf, size, &off) != MSGPACK_UNPACK_SUCCESS ||
                   off != size))
            ok = 0;
        if (!ok) {
            msgpack_unpacked_destroy(u);
            free(*buf);
            *buf = NULL;
        }
    }
    for (int i = 0; i < n && i < 3; i++) zmq_msg_close(&f[i]);
    return ok ? 0 : -1;
}

static const msgpack_object *map_get(const msgpack_object *m, const char *key) {
    if (m->type != MSGPACK_OBJECT_MAP) return NULL;
    for (uint32_t i = 0; i < m->via.map.size; i++) {
        const msgpack_object *k = &m->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == strlen(key) &&
            !memcmp(k->via.str.ptr, key, k->via.str.size))
            return &m->via.map.ptr[i].val;
    }
    return NULL;
}

static int is_str(const msgpack_object *o, const char *s) {
    return o && o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
           !memcmp(o->via.str.ptr, s, o->via.str.size);
}

static int is_key(const msgpack_object *o, const kvc_store_key *k) {
    return o && o->type == MSGPACK_OBJECT_BIN && o->via.bin.size == 16 &&
           !memcmp(o->via.bin.ptr, k->b, 16);
}

/* ---- tests ------------------------------------------------------------------------ */

/* A chain of pages written to a dir tier, then the namespace invalidated:
 * BlockStored events with the keys as 16-byte bin, the first one's parent
 * nil (the namespace names no block), token ids, block_size, medium DISK;
 * then AllBlocksCleared; sequence numbers 0, 1, ...; the batch an array
 * [ts, events, 0]. */
TEST(wire_format) {
    fixture fx;
    ASSERT_OK(fixture_open(&fx));
    kvc_store *st = fx.st;
    const char *ep = fx.ep;
    kvc_store_events *ev = NULL;
    ASSERT_OK(kvc_store_events_open(st, ep, &ev));
    sub s;
    ASSERT_TRUE(sub_open(&s, ep) == 0);
    enum { N = 5 };
    kvc_store_key ns = mk(0, 0xee), keys[N];
    for (uint32_t i = 0; i < N; i++) {
        keys[i] = mk(i + 1, 0);
        size_t size = 0;
        void *obj = fake_obj(i ? &keys[i - 1] : &ns, (int32_t)(100 * i), &size);
        ASSERT_TRUE(obj != NULL);
        ASSERT_OK(kvc_store_put(st, &ns, &keys[i], obj, size));
        free(obj);
    }
    ASSERT_OK(kvc_store_flush(st, 10.0));
    ASSERT_OK(kvc_store_invalidate(st, &ns));

    int n_blocks = 0, cleared = 0;
    uint64_t want_seq = 0;
    const double now = (double)time(NULL);
    while (!cleared) {
        uint64_t seq = 0;
        msgpack_unpacked u;
        void *buf = NULL;
        ASSERT_TRUE(sub_recv(&s, &seq, &u, &buf) == 0);
        ASSERT_EQ_I64((int64_t)seq, (int64_t)want_seq);
        want_seq++;
        const msgpack_object *b = &u.data;
        ASSERT_TRUE(b->type == MSGPACK_OBJECT_ARRAY && b->via.array.size == 3);
        const msgpack_object *ts = &b->via.array.ptr[0], *evs = &b->via.array.ptr[1];
        ASSERT_TRUE(ts->type == MSGPACK_OBJECT_FLOAT64);
        ASSERT_NEAR(ts->via.f64, now, 60.0);
        ASSERT_TRUE(b->via.array.ptr[2].type == MSGPACK_OBJECT_POSITIVE_INTEGER &&
                    b->via.array.ptr[2].via.u64 == 0);
        ASSERT_TRUE(evs->type == MSGPACK_OBJECT_ARRAY && evs->via.array.size >= 1);
        for (uint32_t e = 0; e < evs->via.array.size; e++) {
            const msgpack_object *o = &evs->via.array.ptr[e];
            const msgpack_object *type = map_get(o, "type");
            ASSERT_TRUE(is_str(map_get(o, "medium"), "DISK"));
            if (is_str(type, "AllBlocksCleared")) {
                ASSERT_EQ_I64(n_blocks, N);
                cleared = 1;
                continue;
            }
            ASSERT_TRUE(is_str(type, "BlockStored"));
            ASSERT_EQ_I64(o->via.map.size, 8);
            const msgpack_object *h = map_get(o, "block_hashes");
            const msgpack_object *par = map_get(o, "parent_block_hash");
            const msgpack_object *tok = map_get(o, "token_ids"), *bs = map_get(o, "block_size");
            ASSERT_TRUE(h && h->type == MSGPACK_OBJECT_ARRAY && h->via.array.size >= 1);
            ASSERT_TRUE(map_get(o, "lora_id")->type == MSGPACK_OBJECT_NIL);
            ASSERT_TRUE(map_get(o, "lora_name")->type == MSGPACK_OBJECT_NIL);
            ASSERT_TRUE(bs && bs->type == MSGPACK_OBJECT_POSITIVE_INTEGER && bs->via.u64 == P);
            if (n_blocks == 0) ASSERT_TRUE(par && par->type == MSGPACK_OBJECT_NIL);
            else ASSERT_TRUE(is_key(par, &keys[n_blocks - 1]));
            ASSERT_TRUE(tok && tok->type == MSGPACK_OBJECT_ARRAY &&
                        tok->via.array.size == P * h->via.array.size);
            for (uint32_t i = 0; i < h->via.array.size; i++, n_blocks++) {
                ASSERT_TRUE(n_blocks < N && is_key(&h->via.array.ptr[i], &keys[n_blocks]));
                for (int j = 0; j < P; j++)
                    ASSERT_EQ_I64((int64_t)tok->via.array.ptr[P * i + (uint32_t)j].via.u64,
                                  100 * n_blocks + j);
            }
        }
        msgpack_unpacked_destroy(&u);
        free(buf);
    }
    /* the publisher counts a batch after sending it: give it a moment */
    kvc_store_events_stats es;
    for (int tries = 0; tries < 200; tries++) {
        ASSERT_OK(kvc_store_events_get_stats(ev, &es));
        if (es.events_sent == N + 1) break;
        nanosleep(&(struct timespec){0, 10000000L}, NULL);
    }
    ASSERT_EQ_I64(es.events_sent, N + 1);
    ASSERT_EQ_I64(es.batches_sent, (int64_t)want_seq);
    ASSERT_EQ_I64(es.events_dropped, 0);
    kvc_store_events_close(ev);
    sub_close(&s);
    fixture_close(&fx);
    return 0;
}

/* close sends what is queued (likely still inside the slow-joiner grace
 * here) in batches of at most 64, and uninstalls its callback: events after it go
 * nowhere (ASan would see a use after free). */
TEST(close_drains) {
    fixture fx;
    ASSERT_OK(fixture_open(&fx));
    kvc_store *st = fx.st;
    const char *ep = fx.ep;
    kvc_store_events *ev = NULL;
    ASSERT_OK(kvc_store_events_open(st, ep, &ev));
    sub s;
    ASSERT_TRUE(sub_open(&s, ep) == 0);
    enum { N = 300 };
    kvc_store_key ns = mk(9, 0xaa);
    for (int i = 0; i < N; i++) ASSERT_OK(kvc_store_invalidate(st, &ns)); /* one CLEARED each */
    kvc_store_events_close(ev);
    ASSERT_OK(kvc_store_invalidate(st, &ns));
    int got = 0;
    for (uint64_t want = 0; got < N; want++) {
        uint64_t seq = 0;
        msgpack_unpacked u;
        void *buf = NULL;
        ASSERT_TRUE(sub_recv(&s, &seq, &u, &buf) == 0);
        ASSERT_EQ_I64((int64_t)seq, (int64_t)want);
        const msgpack_object *evs = &u.data.via.array.ptr[1];
        ASSERT_TRUE(evs->via.array.size >= 1 && evs->via.array.size <= 64);
        got += (int)evs->via.array.size;
        msgpack_unpacked_destroy(&u);
        free(buf);
    }
    ASSERT_EQ_I64(got, N);
    sub_close(&s);
    fixture_close(&fx);
    return 0;
}

/* The frames of one message (at most 4), copied: sizes in n[], 0 when none
 * came within the socket's timeout. */
static int recv_raw(void *sock, unsigned char f[4][4096], size_t n[4]) {
    int k = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, 0) < 0) {
            zmq_msg_close(&m);
            return 0;
        }
        more = zmq_msg_more(&m);
        if (k < 4 && zmq_msg_size(&m) <= 4096) {
            n[k] = zmq_msg_size(&m);
            memcpy(f[k], zmq_msg_data(&m), n[k]);
        }
        zmq_msg_close(&m);
        k++;
    }
    return k;
}

static uint64_t seq_of(const unsigned char *b) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | b[i];
    return v;
}

/* vLLM's replay: batches numbered from a start, byte for byte as the PUB
 * socket sent them, the newest replay_batches only, then END_SEQ (-1) with
 * an empty payload; a REQ socket reads the first reply (same envelope); a
 * malformed request is dropped and the socket keeps serving. */
TEST(replay) {
    fixture fx;
    ASSERT_OK(fixture_open(&fx));
    kvc_store *st = fx.st;
    const char *ep = fx.ep;
    kvc_store_events *ev = NULL;
    kvc_store_events_params p = kvc_store_events_default_params();
    ASSERT_TRUE(p.replay_endpoint == NULL && p.replay_batches == 10000);
    p.replay_batches = 0;
    p.replay_endpoint = fx.rep;
    ASSERT_STATUS(kvc_store_events_open_with(st, ep, &p, &ev), KVC_ERR_INVALID_ARG);
    p.replay_batches = 3;
    ASSERT_OK(kvc_store_events_open_with(st, ep, &p, &ev));
    sub s;
    ASSERT_TRUE(sub_open(&s, ep) == 0);
    enum { N = 5 };
    static unsigned char pub[N][4096], f[4][4096];
    size_t pub_n[N], n[4];
    kvc_store_events_stats es;
    for (int i = 0; i < N; i++) { /* one batch each: wait until it is out */
        kvc_store_key ns = mk((uint32_t)i, 0x5a);
        ASSERT_OK(kvc_store_invalidate(st, &ns));
        for (int tries = 0; tries < 500; tries++) {
            ASSERT_OK(kvc_store_events_get_stats(ev, &es));
            if (es.batches_sent == i + 1) break;
            nanosleep(&(struct timespec){0, 10000000L}, NULL);
        }
        ASSERT_EQ_I64(es.batches_sent, i + 1);
    }
    for (int i = 0; i < N; i++) {
        ASSERT_EQ_I64(recv_raw(s.sock, f, n), 3);
        ASSERT_EQ_I64((int64_t)seq_of(f[1]), i);
        memcpy(pub[i], f[2], n[2]);
        pub_n[i] = n[2];
    }
    void *d = zmq_socket(s.ctx, ZMQ_DEALER); /* REQ's envelope, many replies */
    int timeout_ms = 5000, linger = 0;
    ASSERT_TRUE(d && zmq_setsockopt(d, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms) == 0 &&
                zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger) == 0 &&
                zmq_connect(d, fx.rep) == 0);
    const unsigned char bad[3] = {1, 2, 3};
    ASSERT_TRUE(zmq_send(d, "", 0, ZMQ_SNDMORE) == 0 && zmq_send(d, bad, 3, 0) == 3);
    for (uint64_t start = 1; start <= 7; start += 3) { /* 1: the kept 2..4; 4: 4; 7: none */
        unsigned char b[8];
        for (int i = 0; i < 8; i++) b[i] = (unsigned char)(start >> (56 - 8 * i));
        ASSERT_TRUE(zmq_send(d, "", 0, ZMQ_SNDMORE) == 0 && zmq_send(d, b, 8, 0) == 8);
        for (uint64_t want = start < 2 ? 2 : start;; want++) {
            ASSERT_EQ_I64(recv_raw(d, f, n), 3);
            ASSERT_EQ_I64((int64_t)n[0], 0);
            ASSERT_EQ_I64((int64_t)n[1], 8);
            if (want >= N) { /* END_SEQ */
                ASSERT_TRUE(seq_of(f[1]) == UINT64_MAX && n[2] == 0);
                break;
            }
            ASSERT_EQ_I64((int64_t)seq_of(f[1]), (int64_t)want);
            ASSERT_EQ_I64((int64_t)n[2], (int64_t)pub_n[want]);
            ASSERT_MEM_EQ(f[2], pub[want], n[2]);
        }
    }
    void *r = zmq_socket(s.ctx, ZMQ_REQ);
    ASSERT_TRUE(r && zmq_setsockopt(r, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms) == 0 &&
                zmq_setsockopt(r, ZMQ_LINGER, &linger, sizeof linger) == 0 &&
                zmq_connect(r, fx.rep) == 0);
    const unsigned char three[8] = {0, 0, 0, 0, 0, 0, 0, 3};
    ASSERT_EQ_I64(zmq_send(r, three, 8, 0), 8);
    ASSERT_EQ_I64(recv_raw(r, f, n), 2); /* REQ strips the envelope: [seq, payload] */
    ASSERT_EQ_I64((int64_t)seq_of(f[0]), 3);
    ASSERT_MEM_EQ(f[1], pub[3], pub_n[3]);
    ASSERT_OK(kvc_store_events_get_stats(ev, &es));
    ASSERT_EQ_I64(es.replays, 4);
    zmq_close(r);
    zmq_close(d);
    kvc_store_events_close(ev);
    sub_close(&s);
    fixture_close(&fx);
    return 0;
}

TEST(bad_args) {
    fixture fx;
    ASSERT_OK(fixture_open(&fx));
    kvc_store *st = fx.st;
    const char *ep = fx.ep;
    kvc_store_events *ev = NULL;
    ASSERT_STATUS(kvc_store_events_open(NULL, ep, &ev), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_store_events_open(st, NULL, &ev), KVC_ERR_INVALID_ARG);
    static char sentinel;
    ev = (kvc_store_events *)&sentinel; /* a failed open sets it to NULL (core.h) */
    ASSERT_STATUS(kvc_store_events_open(st, "nope://x", &ev), KVC_ERR_IO);
    ASSERT_STR_CONTAINS(kvc_last_error(), "nope://x");
    ASSERT_TRUE(ev == NULL);
    kvc_store_events_params p = kvc_store_events_default_params();
    p.replay_endpoint = "nope://y";
    ev = (kvc_store_events *)&sentinel;
    ASSERT_STATUS(kvc_store_events_open_with(st, ep, &p, &ev), KVC_ERR_IO);
    ASSERT_STR_CONTAINS(kvc_last_error(), "nope://y");
    ASSERT_TRUE(ev == NULL);
    ASSERT_OK(kvc_store_events_open(st, ep, &ev)); /* the failed open let go of ep */
    kvc_store_events_close(ev);
    kvc_store_events_close(NULL);
    fixture_close(&fx);
    return 0;
}

/* An event dropped before it is sent (here its ids' copy fails for lack
 * of memory; a full queue alike) has no sequence number of its own: the
 * next batch skips one, so a subscriber sees a gap and knows it lost
 * events, as for a failed send. (Before: the numbers ran on, 0 then 1, and
 * the loss was invisible: a router kept a block the store never said it
 * held, or one already gone.) */
TEST(dropped_event_leaves_a_gap) {
    if (!test_oom_available()) SKIP("allocation failures need the linker's --wrap");
    fixture fx;
    ASSERT_OK(fixture_open(&fx));
    kvc_store_events *ev = NULL;
    ASSERT_OK(kvc_store_events_open(fx.st, fx.ep, &ev));
    sub s;
    ASSERT_TRUE(sub_open(&s, fx.ep) == 0);
    const int32_t toks[P] = {11, 12, 13, 14};
    kvc_store_key ns = mk(7, 0xcc), k[3];
    for (uint32_t i = 0; i < 3; i++) k[i] = mk(i, 0xcc);
    uint64_t seq = 99;
    msgpack_unpacked u;
    void *buf = NULL;
    kvc__store_emit_page(fx.st, KVC_STORE_EVENT_STORED, 0, &ns, &k[0], &ns, toks, P);
    ASSERT_TRUE(sub_recv(&s, &seq, &u, &buf) == 0); /* batch 0 sent: the publisher idles */
    ASSERT_EQ_I64((int64_t)seq, 0);
    msgpack_unpacked_destroy(&u);
    free(buf);
    test_oom_arm(1, 0); /* the event's copy of its ids, the only allocation */
    kvc__store_emit_page(fx.st, KVC_STORE_EVENT_STORED, 0, &ns, &k[1], &k[0], toks, P);
    ASSERT_EQ_I64(test_oom_disarm(), 1);
    kvc_store_events_stats es;
    ASSERT_OK(kvc_store_events_get_stats(ev, &es));
    ASSERT_EQ_I64(es.events_dropped, 1);
    kvc__store_emit_page(fx.st, KVC_STORE_EVENT_STORED, 0, &ns, &k[2], &k[1], toks, P);
    ASSERT_TRUE(sub_recv(&s, &seq, &u, &buf) == 0);
    ASSERT_EQ_I64((int64_t)seq, 2); /* 1 is the gap */
    const msgpack_object *evs = &u.data.via.array.ptr[1];
    ASSERT_EQ_I64((int64_t)evs->via.array.size, 1);
    ASSERT_TRUE(is_key(map_get(&evs->via.array.ptr[0], "parent_block_hash"), &k[1]));
    msgpack_unpacked_destroy(&u);
    free(buf);
    kvc_store_events_close(ev);
    sub_close(&s);
    fixture_close(&fx);
    return 0;
}

/* Events dropped after the last batch, with none after them: close sends
 * one more batch, with no events, past a skipped number, so the gap shows.
 * (Before, close sent nothing and the loss stayed invisible.) */
TEST(drop_after_the_last_batch_shows_at_close) {
    if (!test_oom_available()) SKIP("allocation failures need the linker's --wrap");
    fixture fx;
    ASSERT_OK(fixture_open(&fx));
    kvc_store_events *ev = NULL;
    ASSERT_OK(kvc_store_events_open(fx.st, fx.ep, &ev));
    sub s;
    ASSERT_TRUE(sub_open(&s, fx.ep) == 0);
    const int32_t toks[P] = {11, 12, 13, 14};
    kvc_store_key ns = mk(8, 0xcd), k[2];
    for (uint32_t i = 0; i < 2; i++) k[i] = mk(i, 0xcd);
    uint64_t seq = 99;
    msgpack_unpacked u;
    void *buf = NULL;
    kvc__store_emit_page(fx.st, KVC_STORE_EVENT_STORED, 0, &ns, &k[0], &ns, toks, P);
    ASSERT_TRUE(sub_recv(&s, &seq, &u, &buf) == 0);
    ASSERT_EQ_I64((int64_t)seq, 0);
    msgpack_unpacked_destroy(&u);
    free(buf);
    test_oom_arm(1, 0); /* the event's copy of its ids */
    kvc__store_emit_page(fx.st, KVC_STORE_EVENT_STORED, 0, &ns, &k[1], &k[0], toks, P);
    ASSERT_EQ_I64(test_oom_disarm(), 1);
    kvc_store_events_close(ev);
    ASSERT_TRUE(sub_recv(&s, &seq, &u, &buf) == 0);
    ASSERT_EQ_I64((int64_t)seq, 2); /* 1 is the gap */
    ASSERT_EQ_I64((int64_t)u.data.via.array.size, 3);
    ASSERT_EQ_I64((int64_t)u.data.via.array.ptr[1].via.array.size, 0);
    msgpack_unpacked_destroy(&u);
    free(buf);
    sub_close(&s);
    fixture_close(&fx);
    return 0;
}

/* A second publisher replaces the first as the store's callback; closing
 * the first then leaves the second's in place (it once cleared whatever was
 * installed, and the second went silent). */
TEST(closing_a_replaced_publisher_keeps_the_new_one) {
    fixture fx;
    ASSERT_OK(fixture_open(&fx));
    kvc_store_events *ev1 = NULL, *ev2 = NULL;
    ASSERT_OK(kvc_store_events_open(fx.st, fx.ep, &ev1));
    ASSERT_OK(kvc_store_events_open(fx.st, fx.rep, &ev2));
    kvc_store_events_close(ev1);
    enum { N = 5 };
    kvc_store_key ns = mk(4, 0xbb);
    for (int i = 0; i < N; i++) ASSERT_OK(kvc_store_invalidate(fx.st, &ns));
    kvc_store_events_stats es = {0};
    for (int tries = 0; tries < 500 && es.events_sent + es.events_dropped < N; tries++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
        ASSERT_OK(kvc_store_events_get_stats(ev2, &es));
    }
    ASSERT_EQ_I64(es.events_sent + es.events_dropped, N);
    kvc_store_events_close(ev2);
    fixture_close(&fx);
    return 0;
}

const char *test_suite_name = "store_events";
const test_case test_suite[] = {
    TEST_ENTRY(wire_format),
    TEST_ENTRY(close_drains),
    TEST_ENTRY(replay),
    TEST_ENTRY(bad_args),
    TEST_ENTRY(closing_a_replaced_publisher_keeps_the_new_one),
    TEST_ENTRY(dropped_event_leaves_a_gap),
    TEST_ENTRY(drop_after_the_last_batch_shows_at_close),
    {0, 0},
};
