/*
 * libFuzzer target for page objects as a hostile or broken store returns
 * them (docs/KV_STORE.md sections 3-4): kvc_store_verify_object and
 * kvc_store_restore_page on two small caches: page 1 of a float16 one, and
 * the first page of a kivi4 one, whose object also carries the sink rows
 * (position 0 in float16). Byte 0 of an input picks the target (byte 0 / 3
 * odd: kivi4) and how the rest becomes an object (byte 0 % 3):
 *   0  the bytes as they are (an exact-size copy: ASan sees any overread);
 *   1  a valid object with the bytes XORed over it, the header checksum
 *      recomputed, so the checks behind it (version, geometry, sizes,
 *      namespace, keys, position, token ids) see forged headers;
 *   2  as 1 with the payload checksum recomputed too: only the expectation
 *      (namespace, keys, position, ids) stands between it and the cache.
 * Whatever is accepted must carry exactly the expected namespace, keys,
 * position and ids, and land in the page (and sink rows); whatever is
 * refused names a reason and leaves both unwritten.
 *
 * Built with clang -fsanitize=fuzzer,address,undefined when -DKVC_FUZZ=ON;
 * otherwise fuzz_replay.c replays the seed corpus through the same entry
 * point.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/store.h"
#include "store/store_internal.h"
#include "fuzz.h"

typedef struct target {
    kvc_cache *cache;
    int32_t page;
    int32_t tok[64];
    kvc_store_expect e;
    unsigned char *good, *before, *after; /* before/after: page then sink rows */
    size_t good_n, page_n, sink_n;
} target;

static target tg[2];
static int ready;

/* A sequence of n_tok tokens in a cache of p; the object of its page pg. */
static void init_target(target *t, kvc_cache_params p, int n_tok, int pg) {
    CHECK(kvc_cache_create(&p, &t->cache) == KVC_OK);
    for (int i = 0; i < n_tok; i++) t->tok[i] = 1000 + 7 * i;
    kvc_seq_id s;
    int64_t hit, n;
    int32_t indptr[2], last, pages[16];
    CHECK(kvc_cache_add_sequence(t->cache, t->tok, n_tok, 0, &s, &hit) == KVC_OK);
    CHECK(kvc_cache_page_table(t->cache, &s, 1, indptr, pages, 16, &last, &n) == KVC_OK);
    t->page = pages[pg];
    t->page_n = kvc_cache_page_bytes(t->cache);
    t->sink_n = kvc_cache_sink_bytes(t->cache);
    t->before = malloc(t->page_n + t->sink_n);
    t->after = malloc(t->page_n + t->sink_n);
    for (size_t i = 0; i < t->page_n + t->sink_n; i++) t->before[i] = (unsigned char)(i * 31 + 7);
    CHECK(kvc_cache_write_page(t->cache, t->page, t->before, t->page_n) == KVC_OK);
    if (t->sink_n)
        CHECK(kvc_cache_write_sink(t->cache, t->page, t->before + t->page_n, t->sink_n) == KVC_OK);
    kvc_store_key ns, keys[16];
    for (int i = 0; i < 16; i++) ns.b[i] = (uint8_t)(0x40 + i);
    const int32_t unit = n_tok / p.page_size; /* one K group: the whole sequence */
    CHECK(kvc_store_page_keys(&ns, t->tok, n, p.page_size, pg ? 1 : unit, keys) == KVC_OK);
    t->e.ns = ns;
    t->e.key = keys[pg];
    t->e.parent = pg ? keys[pg - 1] : ns;
    t->e.position = (int64_t)pg * p.page_size;
    t->e.tokens = t->tok + pg * p.page_size;
    t->good = malloc(kvc_store_object_bytes(t->cache, 0));
    CHECK(kvc_store_serialize_page(t->cache, t->page, &t->e, NULL, t->good,
                                   kvc_store_object_bytes(t->cache, 0), &t->good_n) == KVC_OK);
}

static void init(void) {
    kvc_cache_params p = kvc_cache_default_params();
    p.num_layers = 2;
    p.num_kv_heads = 1;
    p.head_dim = 8;
    p.page_size = 4;
    p.num_pages = 4;
    p.dtype = KVC_F16;
    init_target(&tg[0], p, 8, 1);
    p.page_size = 16;
    p.num_pages = 8;
    p.kv_format = KVC_KVFMT_KIVI4; /* G 64: a group of 4 pages */
    init_target(&tg[1], p, 64, 0);
    CHECK(tg[1].sink_n > 0 && tg[1].good_n == kvc_store_object_bytes(tg[1].cache, 0));
    ready = 1;
}

static void reseal(unsigned char *o, size_t n, int payload) {
    kvc_store_key h;
    if (n < KVC_STORE_HEADER_BYTES) return;
    if (payload && n >= KVC_STORE_HEADER_BYTES + 16) { /* ids then payload: to the end */
        kvc__store_hash128(o + KVC_STORE_HEADER_BYTES, n - KVC_STORE_HEADER_BYTES, NULL, 0, &h);
        memcpy(o + 96, h.b, 16);
    }
    kvc__store_hash128(o, 112, NULL, 0, &h);
    memcpy(o + 112, h.b, 16);
}

/* The page's bytes, then its sink rows, into buf. */
static void snapshot(const target *t, unsigned char *buf) {
    CHECK(kvc_cache_read_page(t->cache, t->page, buf, t->page_n) == KVC_OK);
    if (t->sink_n)
        CHECK(kvc_cache_read_sink(t->cache, t->page, buf + t->page_n, t->sink_n) == KVC_OK);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!ready) init();
    if (size == 0) return 0;
    const int mode = data[0] % 3;
    target *t = &tg[(data[0] / 3) & 1];
    data++, size--;
    size_t n = mode == 0 ? size : t->good_n;
    unsigned char *o = malloc(n ? n : 1);
    if (!o) return 0;
    if (mode == 0) {
        memcpy(o, data, n);
    } else {
        memcpy(o, t->good, n);
        for (size_t i = 0; i < size; i++) o[i % n] ^= data[i];
        reseal(o, n, mode == 2);
    }
    const size_t all = t->page_n + t->sink_n;
    const size_t idn = t->good_n - KVC_STORE_HEADER_BYTES - all; /* token id bytes */
    snapshot(t, t->before);
    kvc_store_miss m = KVC_STORE_MISS_COUNT;
    kvc_status st = kvc_store_restore_page(t->cache, t->page, o, n, &t->e, NULL, &m);
    snapshot(t, t->after);
    const unsigned char *g = t->good;
    if (st == KVC_OK) {
        /* accepted: the expected identity, and the payload in the page (and sink rows) */
        CHECK(m == KVC_STORE_MISS_COUNT && n == t->good_n);
        CHECK(memcmp(o, g, 16) == 0);           /* magic, version, sizes, flags */
        CHECK(memcmp(o + 16, g + 16, 56) == 0); /* namespace, key, parent, position */
        CHECK(memcmp(o + 72, g + 72, 24) == 0); /* geometry */
        CHECK(memcmp(o + KVC_STORE_HEADER_BYTES, g + KVC_STORE_HEADER_BYTES, idn) == 0);
        CHECK(memcmp(t->after, o + KVC_STORE_HEADER_BYTES + idn, all) == 0);
        /* back to the reference bytes */
        CHECK(kvc_cache_write_page(t->cache, t->page, g + KVC_STORE_HEADER_BYTES + idn,
                                   t->page_n) == KVC_OK);
        if (t->sink_n)
            CHECK(kvc_cache_write_sink(t->cache, t->page,
                                       g + KVC_STORE_HEADER_BYTES + idn + t->page_n,
                                       t->sink_n) == KVC_OK);
    } else {
        CHECK(st == KVC_ERR_CORRUPT);
        CHECK(m > KVC_STORE_MISS_ABSENT && m < KVC_STORE_MISS_COUNT);
        CHECK(memcmp(t->before, t->after, all) == 0); /* nothing written */
    }
    kvc_clear_error();
    free(o);
    return 0;
}
