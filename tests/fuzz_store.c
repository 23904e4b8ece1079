/*
 * libFuzzer target for page objects as a hostile or broken store returns
 * them (docs/KV_STORE.md sections 3-4): kvc_store_verify_object and
 * kvc_store_restore_page on a small float16 cache. Byte 0 of an input picks
 * how the rest becomes an object:
 *   0  the bytes as they are (an exact-size copy: ASan sees any overread);
 *   1  a valid object with the bytes XORed over it, the header checksum
 *      recomputed, so the checks behind it (version, geometry, sizes,
 *      namespace, keys, position, token ids) see forged headers;
 *   2  as 1 with the payload checksum recomputed too: only the expectation
 *      (namespace, keys, position, ids) stands between it and the cache.
 * Whatever is accepted must carry exactly the expected namespace, keys,
 * position and ids; whatever is refused names a reason and leaves the page
 * unwritten.
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

static kvc_cache *cache;
static int32_t pages[2];
static int32_t tok[8];
static kvc_store_key keys[2];
static kvc_store_expect e;
static unsigned char *good, *before, *after;
static size_t good_n, page_n;

static void init(void) {
    kvc_cache_params p = kvc_cache_default_params();
    p.num_layers = 2;
    p.num_kv_heads = 1;
    p.head_dim = 8;
    p.page_size = 4;
    p.num_pages = 4;
    p.dtype = KVC_F16;
    CHECK(kvc_cache_create(&p, &cache) == KVC_OK);
    for (int i = 0; i < 8; i++) tok[i] = 1000 + 7 * i;
    kvc_seq_id s;
    int64_t hit, n;
    int32_t indptr[2], last;
    CHECK(kvc_cache_add_sequence(cache, tok, 8, 0, &s, &hit) == KVC_OK);
    CHECK(kvc_cache_page_table(cache, &s, 1, indptr, pages, 2, &last, &n) == KVC_OK);
    page_n = kvc_cache_page_bytes(cache);
    before = malloc(page_n);
    after = malloc(page_n);
    for (size_t i = 0; i < page_n; i++) before[i] = (unsigned char)(i * 31 + 7);
    CHECK(kvc_cache_write_page(cache, pages[1], before, page_n) == KVC_OK);
    kvc_store_key ns;
    for (int i = 0; i < 16; i++) ns.b[i] = (uint8_t)(0x40 + i);
    CHECK(kvc_store_page_keys(&ns, tok, 2, 4, 1, keys) == KVC_OK);
    e.ns = ns;
    e.key = keys[1];
    e.parent = keys[0];
    e.position = 4;
    e.tokens = tok + 4;
    good_n = kvc_store_object_bytes(cache, 0);
    good = malloc(good_n);
    CHECK(kvc_store_serialize_page(cache, pages[1], &e, NULL, good, good_n, NULL) == KVC_OK);
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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!cache) init();
    if (size == 0) return 0;
    const int mode = data[0] % 3;
    data++, size--;
    size_t n = mode == 0 ? size : good_n;
    unsigned char *o = malloc(n ? n : 1);
    if (!o) return 0;
    if (mode == 0) {
        memcpy(o, data, n);
    } else {
        memcpy(o, good, n);
        for (size_t i = 0; i < size; i++) o[i % n] ^= data[i];
        reseal(o, n, mode == 2);
    }
    CHECK(kvc_cache_read_page(cache, pages[1], before, page_n) == KVC_OK);
    kvc_store_miss m = KVC_STORE_MISS_COUNT;
    kvc_status st = kvc_store_restore_page(cache, pages[1], o, n, &e, NULL, &m);
    CHECK(kvc_cache_read_page(cache, pages[1], after, page_n) == KVC_OK);
    if (st == KVC_OK) {
        /* accepted: the expected identity, and the payload in the page */
        CHECK(m == KVC_STORE_MISS_COUNT && n == good_n);
        CHECK(memcmp(o, good, 16) == 0);            /* magic, version, sizes, flags */
        CHECK(memcmp(o + 16, good + 16, 56) == 0);  /* namespace, key, parent, position */
        CHECK(memcmp(o + 72, good + 72, 24) == 0);  /* geometry */
        CHECK(memcmp(o + KVC_STORE_HEADER_BYTES, good + KVC_STORE_HEADER_BYTES, 16) == 0);
        CHECK(memcmp(after, o + KVC_STORE_HEADER_BYTES + 16, page_n) == 0);
        CHECK(kvc_cache_write_page(cache, pages[1], good + KVC_STORE_HEADER_BYTES + 16,
                                   page_n) == KVC_OK); /* back to the reference page */
    } else {
        CHECK(st == KVC_ERR_CORRUPT);
        CHECK(m > KVC_STORE_MISS_ABSENT && m < KVC_STORE_MISS_COUNT);
        CHECK(memcmp(before, after, page_n) == 0); /* nothing written */
    }
    kvc_clear_error();
    free(o);
    return 0;
}
