/*
 * The KV store (store.h, docs/KV_STORE.md): keys and namespaces, page
 * objects and every reason a load is refused, the store handle over the
 * directory tier, and the engine restoring prompts from it (with
 * KVC_TINY_GGUF): tokens and K/V bytes identical to recomputation.
 */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, nftw */
#define _XOPEN_SOURCE 700
#include <dirent.h>
#include <ftw.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvcache/store.h"
#include "store/store_internal.h"
#include "test.h"
#include "test_oom.h"

/* ---- helpers ------------------------------------------------------------------ */

static kvc_cache *make_cache(kvc_dtype dtype, kvc_kv_format fmt, int32_t page_size,
                             int64_t num_pages) {
    kvc_cache_params p = kvc_cache_default_params();
    p.num_layers = 3;
    p.num_kv_heads = 2;
    p.head_dim = 64;
    p.page_size = page_size;
    p.num_pages = num_pages;
    p.dtype = dtype;
    p.kv_format = fmt;
    kvc_cache *c = NULL;
    if (kvc_cache_create(&p, &c) != KVC_OK) return NULL;
    return c;
}

/* A sequence of n_tokens tokens (ids t0, t0+1, ...) whose pages hold
 * random bytes; its page ids into ids (cap pages). */
static int fill_seq(kvc_cache *c, int64_t n_tokens, int32_t t0, uint64_t seed, int32_t *ids,
                    int64_t cap, kvc_seq_id *seq) {
    int32_t *tok = malloc((size_t)n_tokens * sizeof(int32_t));
    for (int64_t i = 0; i < n_tokens; i++) tok[i] = t0 + (int32_t)i;
    int64_t hit = 0;
    kvc_status st = kvc_cache_add_sequence(c, tok, n_tokens, 0, seq, &hit);
    free(tok);
    if (st != KVC_OK) return -1;
    int32_t indptr[2], last;
    int64_t n = 0;
    if (kvc_cache_page_table(c, seq, 1, indptr, ids, cap, &last, &n) != KVC_OK) return -1;
    const size_t pb = kvc_cache_page_bytes(c);
    unsigned char *buf = malloc(pb);
    for (int64_t p = 0; p < n; p++) {
        for (size_t i = 0; i < pb; i++) buf[i] = (unsigned char)test_rng_next(&seed);
        if (kvc_cache_write_page(c, ids[p], buf, pb) != KVC_OK) {
            free(buf);
            return -1;
        }
    }
    free(buf);
    const size_t sb = kvc_cache_sink_bytes(c); /* kivi4: the first page's sink rows */
    if (sb && n > 0) {
        uint16_t *rows = malloc(sb);
        for (size_t i = 0; i < sb / 2; i++) rows[i] = (uint16_t)(test_rng_next(&seed) & 0x7bff);
        kvc_status st2 = kvc_cache_write_sink(c, ids[0], rows, sb);
        free(rows);
        if (st2 != KVC_OK) return -1;
    }
    return (int)n;
}

static kvc_store_key key_of(uint8_t v) {
    kvc_store_key k;
    for (int i = 0; i < 16; i++) k.b[i] = (uint8_t)(v + 17 * i);
    return k;
}

/* The expectation for page pg of tokens t0.. under ns, keys computed. */
static void expect_of(const kvc_store_key *ns, const int32_t *tokens, int64_t pg, int32_t P,
                      kvc_store_key *keys, kvc_store_expect *e) {
    kvc_store_page_keys(ns, tokens, pg + 1, P, 1, keys);
    e->ns = *ns;
    e->key = keys[pg];
    e->parent = pg > 0 ? keys[pg - 1] : *ns;
    e->position = pg * P;
    e->tokens = tokens + pg * P;
}

/* ---- keys and namespaces ----------------------------------------------------------- */

TEST(page_keys_match_independent_xxh3) {
    /* pinned by python-xxhash: xxh3_128_digest(ns + struct.pack('<4i', 1, 2, 3, 4)) and
     * xxh3_128_digest(k0 + struct.pack('<4i', 5, 6, 7, -1)), ns = bytes(range(16)) */
    static const char *want[2] = {"4c54e37fc7943ca3082d6b4fe9c74494",
                                  "a7c2d3abde03733aeb7a71e6961c66b2"};
    kvc_store_key ns, k[2];
    for (int i = 0; i < 16; i++) ns.b[i] = (uint8_t)i;
    const int32_t tok[8] = {1, 2, 3, 4, 5, 6, 7, -1};
    ASSERT_OK(kvc_store_page_keys(&ns, tok, 2, 4, 1, k));
    for (int p = 0; p < 2; p++) {
        char hex[33];
        for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", k[p].b[i]);
        ASSERT_STR_CONTAINS(hex, want[p]);
    }
    /* a page's key depends on every earlier page */
    int32_t tok2[8];
    memcpy(tok2, tok, sizeof tok);
    tok2[0] = 9;
    kvc_store_key k2[2];
    ASSERT_OK(kvc_store_page_keys(&ns, tok2, 2, 4, 1, k2));
    ASSERT_TRUE(memcmp(k2[1].b, k[1].b, 16) != 0);
    ASSERT_STATUS(kvc_store_page_keys(&ns, tok, 2, 0, 1, k), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_store_page_keys(NULL, tok, 2, 4, 1, k), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_store_page_keys(&ns, tok, 3, 4, 2, k), KVC_ERR_INVALID_ARG); /* 1.5 units */
    /* units of 2 pages: each key covers the unit's 8 ids and the page's index,
     * pinned by python-xxhash: u0 = xxh3_128_digest(ns + pack('<8i', *tok) + pack('<i', 0)),
     * u1 = xxh3_128_digest(u0 + pack('<8i', *tok) + pack('<i', 1)) */
    static const char *want2[2] = {"74290064a270f6a5ef50a171d50b7768",
                                   "cca9646d26850c72dbb2be818f4d66a3"};
    ASSERT_OK(kvc_store_page_keys(&ns, tok, 2, 4, 2, k));
    for (int p = 0; p < 2; p++) {
        char hex[33];
        for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", k[p].b[i]);
        ASSERT_STR_CONTAINS(hex, want2[p]);
    }
    /* a page of another group with the same ids has another key */
    ASSERT_OK(kvc_store_page_keys(&ns, tok2, 2, 4, 2, k2));
    ASSERT_TRUE(memcmp(k2[1].b, k[1].b, 16) != 0);
    return 0;
}

static kvc_store_namespace_desc base_desc(void) {
    kvc_store_namespace_desc d;
    memset(&d, 0, sizeof d);
    d.model_digest = key_of(1);
    d.tokenizer_digest = key_of(2);
    d.n_layers = 30;
    d.n_kv_heads = 3;
    d.head_dim = 64;
    d.n_rot = 64;
    d.rope_freq_base = 100000.0f;
    d.rope_scale = 1.0f;
    d.cache = kvc_cache_default_params();
    d.cache.page_size = 16;
    d.cache.dtype = KVC_F16;
    return d;
}

TEST(namespace_separates_everything_it_names) {
    kvc_store_namespace_desc d = base_desc();
    kvc_store_key a, b;
    ASSERT_OK(kvc_store_namespace(&d, &a));
    ASSERT_OK(kvc_store_namespace(&d, &b));
    ASSERT_MEM_EQ(a.b, b.b, 16); /* no seed: the same inputs, the same digest */
    /* irrelevant to a float16 cache: the quantization group */
    d.cache.quant_group = 32;
    ASSERT_OK(kvc_store_namespace(&d, &b));
    ASSERT_MEM_EQ(a.b, b.b, 16);
    const char salt1[] = "tenant-a", salt2[] = "tenant-b";
    for (int f = 0; f < 12; f++) {
        d = base_desc();
        switch (f) {
        case 0: d.model_digest.b[15] ^= 1; break;
        case 1: d.tokenizer_digest.b[0] ^= 1; break;
        case 2: d.n_layers = 31; break;
        case 3: d.head_dim = 128; break;
        case 4: d.rope_freq_base = 10000.0f; break;
        case 5: d.rope_neox = 1; break;
        case 6: d.cache.page_size = 32; break;
        case 7: d.cache.dtype = KVC_BF16; break;
        case 8: d.cache.layout = KVC_HND; break;
        case 9: d.cache.kv_format = KVC_KVFMT_KIVI4; break;
        case 10: d.salt = salt1, d.salt_len = strlen(salt1); break;
        default: d.salt = salt2, d.salt_len = strlen(salt2); break;
        }
        ASSERT_OK(kvc_store_namespace(&d, &b));
        if (memcmp(a.b, b.b, 16) == 0) TEST_FAIL_("field %d does not change the namespace", f);
    }
    d = base_desc();
    d.cache.dtype = KVC_I8;
    ASSERT_OK(kvc_store_namespace(&d, &a));
    d.cache.quant_group = 16; /* matters for int8 */
    ASSERT_OK(kvc_store_namespace(&d, &b));
    ASSERT_TRUE(memcmp(a.b, b.b, 16) != 0);
    d.salt = NULL;
    d.salt_len = 3;
    ASSERT_STATUS(kvc_store_namespace(&d, &b), KVC_ERR_INVALID_ARG);
    return 0;
}

/* ---- objects ----------------------------------------------------------------------- */

static int roundtrip_case(kvc_dtype dtype, kvc_kv_format fmt, int32_t P) {
    kvc_cache *src = make_cache(dtype, fmt, P, 32), *dst = make_cache(dtype, fmt, P, 32);
    ASSERT_TRUE(src && dst);
    int32_t ids[32], dids[32];
    kvc_seq_id s, d;
    const int64_t n_tok = 2 * (int64_t)(P > 64 ? P : 64);
    int np = fill_seq(src, n_tok, 100, 7, ids, 32, &s);
    if (np < 2) TEST_FAIL_("dtype %d format %d: %d pages: %s", (int)dtype, (int)fmt, np,
                           kvc_last_error());
    ASSERT_TRUE(fill_seq(dst, n_tok, 100, 99, dids, 32, &d) == np);
    int32_t *tok = malloc((size_t)n_tok * sizeof(int32_t));
    for (int64_t i = 0; i < n_tok; i++) tok[i] = 100 + (int32_t)i;
    kvc_store_key ns = key_of(5), *keys = malloc((size_t)np * sizeof(kvc_store_key));
    /* a first page of kivi4 carries its sink rows (position 0 in float16) */
    const size_t size = kvc_store_object_bytes(src, 0), pb = kvc_cache_page_bytes(src);
    const size_t sb = kvc_cache_sink_bytes(src);
    ASSERT_EQ_I64(sb, fmt == KVC_KVFMT_KIVI4 ? 3 * 2 * 1 * 2 * 64 * 2 : 0); /* L 3, H 2, Dh 64 */
    ASSERT_TRUE(size == KVC_STORE_HEADER_BYTES + (size_t)P * 4 + pb + sb);
    unsigned char *obj = malloc(size), *a = malloc(pb + sb + 1), *b = malloc(pb + sb + 1);
    for (int pg = 0; pg < np; pg++) {
        kvc_store_expect e;
        expect_of(&ns, tok, pg, P, keys, &e);
        size_t n = 0;
        ASSERT_OK(kvc_store_serialize_page(src, ids[pg], &e, NULL, obj, size, &n));
        ASSERT_EQ_I64(n, size - (pg > 0 ? sb : 0));
        if (sb && pg == 0) { /* the sink rows differ until restored */
            ASSERT_OK(kvc_cache_read_sink(src, ids[0], a, sb));
            ASSERT_OK(kvc_cache_read_sink(dst, dids[0], b, sb));
            ASSERT_TRUE(memcmp(a, b, sb) != 0);
            /* a page that is no first page holds none */
            ASSERT_STATUS(kvc_cache_read_sink(src, ids[1], a, sb), KVC_ERR_INVALID_ARG);
            ASSERT_STATUS(kvc_store_restore_page(dst, dids[0], obj, n - 1, &e, NULL, NULL),
                          KVC_ERR_CORRUPT);
        }
        kvc_store_miss m;
        ASSERT_OK(kvc_store_restore_page(dst, dids[pg], obj, n, &e, NULL, &m));
        ASSERT_EQ_I64(m, KVC_STORE_MISS_COUNT);
        ASSERT_OK(kvc_cache_read_page(src, ids[pg], a, pb));
        ASSERT_OK(kvc_cache_read_page(dst, dids[pg], b, pb));
        ASSERT_MEM_EQ(a, b, pb);
        if (sb && pg == 0) {
            ASSERT_OK(kvc_cache_read_sink(src, ids[0], a, sb));
            ASSERT_OK(kvc_cache_read_sink(dst, dids[0], b, sb));
            ASSERT_MEM_EQ(a, b, sb);
        }
    }
    ASSERT_OK(kvc_cache_check(dst));
    free(obj), free(a), free(b), free(tok), free(keys);
    kvc_cache_destroy(src);
    kvc_cache_destroy(dst);
    return 0;
}

TEST(objects_round_trip_every_storage) {
    if (roundtrip_case(KVC_F16, KVC_KVFMT_NONE, 16)) return 1;
    if (roundtrip_case(KVC_F32, KVC_KVFMT_NONE, 8)) return 1;
    if (roundtrip_case(KVC_I8, KVC_KVFMT_NONE, 16)) return 1; /* data and scales */
    if (roundtrip_case(KVC_I4, KVC_KVFMT_NONE, 16)) return 1;
    if (roundtrip_case(KVC_F16, KVC_KVFMT_KIVI8, 16)) return 1;
    if (roundtrip_case(KVC_F16, KVC_KVFMT_KIVI4, 128)) return 1;
    return 0;
}

/* Rewrites the header checksum (XXH3-128 of bytes [0, 112), docs/KV_STORE.md)
 * after a deliberate header edit, so that the check behind it is the one
 * that fails. */
static void reseal_header(unsigned char *o) {
    kvc_store_key h;
    kvc__store_hash128(o, 112, NULL, 0, &h);
    memcpy(o + 112, h.b, 16);
}

TEST(every_refusal_is_counted_by_its_reason_and_writes_nothing) {
    kvc_cache *c = make_cache(KVC_F16, KVC_KVFMT_NONE, 16, 8);
    ASSERT_TRUE(c != NULL);
    int32_t ids[8];
    kvc_seq_id s;
    ASSERT_TRUE(fill_seq(c, 48, 0, 3, ids, 8, &s) == 3);
    int32_t tok[48];
    for (int i = 0; i < 48; i++) tok[i] = i;
    kvc_store_key ns = key_of(9), keys[3];
    kvc_store_expect e;
    expect_of(&ns, tok, 1, 16, keys, &e);
    const size_t size = kvc_store_object_bytes(c, 0), pb = kvc_cache_page_bytes(c);
    unsigned char *good = malloc(size), *o = malloc(size + 1), *before = malloc(pb),
                  *after = malloc(pb);
    ASSERT_OK(kvc_store_serialize_page(c, ids[1], &e, NULL, good, size, NULL));
    ASSERT_OK(kvc_cache_read_page(c, ids[2], before, pb));
    struct {
        kvc_store_miss want;
        size_t len;
    } cases[] = {
        {KVC_STORE_MISS_TRUNCATED, size - 1}, {KVC_STORE_MISS_TRUNCATED, size + 1},
        {KVC_STORE_MISS_TRUNCATED, 100},      {KVC_STORE_MISS_MAGIC, size},
        {KVC_STORE_MISS_VERSION, size},       {KVC_STORE_MISS_HEADER, size},
        {KVC_STORE_MISS_GEOMETRY, size},      {KVC_STORE_MISS_PAYLOAD, size},
        {KVC_STORE_MISS_NAMESPACE, size},     {KVC_STORE_MISS_KEY, size},
        {KVC_STORE_MISS_KEY, size},           {KVC_STORE_MISS_TOKENS, size},
        {KVC_STORE_MISS_TOKENS, size},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        memcpy(o, good, size);
        o[size] = 0;
        kvc_store_expect x = e;
        int32_t other[16];
        switch (ci) {
        case 3: o[0] = 'X'; break;
        case 4: o[8] = 2, reseal_header(o); break;  /* version 2: unknown */
        case 5: o[70] ^= 0x10; break;                       /* position, checksum not fixed */
        case 6: o[76] = 4, reseal_header(o); break;  /* 4 layers */
        case 7: o[size - 5] ^= 1; break;                    /* a payload bit */
        case 8: x.ns.b[3] ^= 1; break;
        case 9: x.key.b[0] ^= 1; break;
        case 10: x.parent.b[15] ^= 1; break;
        case 11: x.position += 16; break;
        case 12: /* the right key, other token ids behind valid checksums */
            memcpy(other, e.tokens, sizeof other);
            other[5] += 1;
            x.tokens = other;
            break;
        default: break;
        }
        kvc_store_miss m = KVC_STORE_MISS_COUNT;
        kvc_status st = kvc_store_restore_page(c, ids[2], o, cases[ci].len, &x, NULL, &m);
        if (st != KVC_ERR_CORRUPT || m != cases[ci].want)
            TEST_FAIL_("case %zu: status %d miss %s, want %s", ci, (int)st,
                       kvc_store_miss_name(m), kvc_store_miss_name(cases[ci].want));
        ASSERT_STR_CONTAINS(kvc_last_error(), kvc_store_miss_name(cases[ci].want));
        ASSERT_OK(kvc_cache_read_page(c, ids[2], after, pb));
        ASSERT_MEM_EQ(before, after, pb); /* nothing written */
    }
    /* a single flipped bit anywhere is never applied */
    uint64_t rng = test_seed;
    for (int t = 0; t < 3000; t++) {
        memcpy(o, good, size);
        const size_t bit = (size_t)(test_rng_next(&rng) % (size * 8));
        o[bit / 8] ^= (unsigned char)(1u << (bit % 8));
        kvc_store_miss m;
        if (kvc_store_verify_object(c, o, size, &e, NULL, &m) == KVC_OK)
            TEST_FAIL_("bit %zu flipped was accepted", bit);
    }
    kvc_clear_error();
    ASSERT_OK(kvc_store_verify_object(c, good, size, &e, NULL, NULL));
    free(good), free(o), free(before), free(after);
    kvc_cache_destroy(c);
    return 0;
}

/* Every header field where docs/KV_STORE.md section 3 puts it, little-endian,
 * and both checksums over exactly the bytes it names (XXH3-128 computed here,
 * canonical bytes); flags other than bit 0 and another header size are
 * "version" misses behind a valid header checksum. */
static uint64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static void xxh128_canon(const void *a, size_t na, const void *b, size_t nb, unsigned char *out) {
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, a, na);
    XXH3_128bits_update(&st, b, nb);
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(&st));
    memcpy(out, c.digest, 16);
}

TEST(object_layout_is_the_documented_one) {
    kvc_cache *c = make_cache(KVC_I8, KVC_KVFMT_NONE, 16, 4);
    ASSERT_TRUE(c != NULL);
    int32_t ids[4];
    kvc_seq_id s;
    ASSERT_TRUE(fill_seq(c, 32, -5, 11, ids, 4, &s) == 2); /* a negative id too */
    int32_t tok[32];
    for (int i = 0; i < 32; i++) tok[i] = -5 + i;
    kvc_store_key ns = key_of(21), keys[2];
    kvc_store_expect e;
    expect_of(&ns, tok, 1, 16, keys, &e);
    const size_t size = kvc_store_object_bytes(c, 0), pb = kvc_cache_page_bytes(c);
    unsigned char *o = malloc(size), *page = malloc(pb), sum[16];
    size_t got = 0;
    ASSERT_OK(kvc_store_serialize_page(c, ids[1], &e, NULL, o, size, &got));
    ASSERT_EQ_I64(got, 128 + 16 * 4 + pb);
    ASSERT_MEM_EQ(o, "KVCPAGE\0", 8);
    ASSERT_EQ_I64(le(o + 8, 2), 1);
    ASSERT_EQ_I64(le(o + 10, 2), 128);
    ASSERT_EQ_I64(le(o + 12, 4), 0);
    ASSERT_MEM_EQ(o + 16, ns.b, 16);
    ASSERT_MEM_EQ(o + 32, keys[1].b, 16);
    ASSERT_MEM_EQ(o + 48, keys[0].b, 16);
    ASSERT_EQ_I64(le(o + 64, 8), 16);
    ASSERT_EQ_I64(le(o + 72, 4), 16);
    ASSERT_EQ_I64(le(o + 76, 4), 3);
    ASSERT_EQ_I64(le(o + 80, 8), pb / 3);
    ASSERT_EQ_I64(le(o + 88, 8), pb);
    for (int i = 0; i < 16; i++) ASSERT_EQ_I64((int32_t)le(o + 128 + 4 * i, 4), tok[16 + i]);
    ASSERT_OK(kvc_cache_read_page(c, ids[1], page, pb));
    ASSERT_MEM_EQ(o + 128 + 64, page, pb);
    xxh128_canon(o + 128, 64, o + 128 + 64, pb, sum);
    ASSERT_MEM_EQ(o + 96, sum, 16);
    xxh128_canon(o, 112, NULL, 0, sum);
    ASSERT_MEM_EQ(o + 112, sum, 16);
    /* flags bit 1, header bytes 64: unknown versions, the header resealed */
    kvc_store_miss m;
    for (int k = 0; k < 2; k++) {
        unsigned char *x = malloc(size);
        memcpy(x, o, size);
        if (k == 0) x[12] |= 2;
        else x[10] = 64;
        xxh128_canon(x, 112, NULL, 0, x + 112);
        ASSERT_STATUS(kvc_store_verify_object(c, x, size, &e, NULL, &m), KVC_ERR_CORRUPT);
        ASSERT_EQ_I64(m, KVC_STORE_MISS_VERSION);
        free(x);
    }
    ASSERT_OK(kvc_store_verify_object(c, o, size, &e, NULL, &m));
    free(o), free(page);
    kvc_cache_destroy(c);
    return 0;
}

TEST(authenticated_objects) {
    kvc_cache *c = make_cache(KVC_F16, KVC_KVFMT_NONE, 16, 4);
    ASSERT_TRUE(c != NULL);
    int32_t ids[4];
    kvc_seq_id s;
    ASSERT_TRUE(fill_seq(c, 32, 0, 4, ids, 4, &s) == 2);
    int32_t tok[32];
    for (int i = 0; i < 32; i++) tok[i] = i;
    kvc_store_key ns = key_of(3), keys[2];
    kvc_store_expect e;
    expect_of(&ns, tok, 0, 16, keys, &e);
    uint8_t key1[KVC_STORE_AUTH_KEY_BYTES], key2[KVC_STORE_AUTH_KEY_BYTES];
    for (int i = 0; i < KVC_STORE_AUTH_KEY_BYTES; i++) key1[i] = (uint8_t)i, key2[i] = (uint8_t)~i;
    const size_t plain = kvc_store_object_bytes(c, 0), tagged = kvc_store_object_bytes(c, 1);
    ASSERT_EQ_I64(tagged, plain + KVC_STORE_AUTH_TAG_BYTES);
    unsigned char *o = malloc(tagged), *p = malloc(plain);
    ASSERT_OK(kvc_store_serialize_page(c, ids[0], &e, key1, o, tagged, NULL));
    ASSERT_OK(kvc_store_serialize_page(c, ids[0], &e, NULL, p, plain, NULL));
    kvc_store_miss m;
    ASSERT_OK(kvc_store_verify_object(c, o, tagged, &e, key1, &m));
    ASSERT_STATUS(kvc_store_verify_object(c, o, tagged, &e, key2, &m), KVC_ERR_CORRUPT);
    ASSERT_EQ_I64(m, KVC_STORE_MISS_AUTH);
    ASSERT_STATUS(kvc_store_verify_object(c, p, plain, &e, key1, &m), KVC_ERR_CORRUPT);
    ASSERT_EQ_I64(m, KVC_STORE_MISS_AUTH); /* an untagged object under a key */
    o[tagged - 1] ^= 1;
    ASSERT_STATUS(kvc_store_verify_object(c, o, tagged, &e, key1, &m), KVC_ERR_CORRUPT);
    ASSERT_EQ_I64(m, KVC_STORE_MISS_AUTH);
    ASSERT_STATUS(kvc_store_serialize_page(c, ids[0], &e, key1, o, plain, NULL),
                  KVC_ERR_INVALID_ARG); /* no room for the tag */
    free(o), free(p);
    kvc_cache_destroy(c);
    return 0;
}

typedef struct evict_log {
    int n;
    int32_t page;
    int32_t tok0;
} evict_log;

static void on_evict(void *user, const kvc_cache *c, int32_t page) {
    evict_log *l = user;
    int32_t t[16];
    l->n++;
    l->page = page;
    l->tok0 = kvc_cache_page_tokens(c, page, t) == KVC_OK ? t[0] : -1;
}

TEST(cache_page_io_rules) {
    kvc_cache *c = make_cache(KVC_F16, KVC_KVFMT_NONE, 16, 2);
    ASSERT_TRUE(c != NULL);
    int32_t ids[2];
    kvc_seq_id s, child;
    ASSERT_TRUE(fill_seq(c, 32, 500, 1, ids, 2, &s) == 2);
    const size_t pb = kvc_cache_page_bytes(c);
    ASSERT_EQ_I64(pb, 3 * 2 * 16 * 2 * 64 * 2); /* layers * K,V * tokens * H * Dh * f16 */
    unsigned char *buf = malloc(pb);
    ASSERT_STATUS(kvc_cache_read_page(c, 2, buf, pb), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_read_page(c, 0, buf, pb - 1), KVC_ERR_INVALID_ARG);
    ASSERT_OK(kvc_cache_fork(c, s, &child));
    ASSERT_STATUS(kvc_cache_write_page(c, ids[0], buf, pb), KVC_ERR_INVALID_ARG); /* shared */
    ASSERT_STR_CONTAINS(kvc_last_error(), "held by 2");
    int32_t t[16];
    ASSERT_OK(kvc_cache_page_tokens(c, ids[1], t));
    ASSERT_EQ_I64(t[0], 516);
    /* eviction hook: called with the page's contents and ids intact */
    evict_log log = {0, -1, -1};
    ASSERT_OK(kvc_cache_set_evict_hook(c, on_evict, &log));
    ASSERT_OK(kvc_cache_free_sequence(c, child));
    ASSERT_OK(kvc_cache_free_sequence(c, s));
    int32_t other[17];
    for (int i = 0; i < 17; i++) other[i] = 900 + i;
    kvc_seq_id s2;
    int64_t hit;
    ASSERT_OK(kvc_cache_add_sequence(c, other, 17, 0, &s2, &hit));
    ASSERT_EQ_I64(log.n, 2);
    ASSERT_TRUE(log.tok0 == 500 || log.tok0 == 516);
    ASSERT_OK(kvc_cache_check(c));
    free(buf);
    kvc_cache_destroy(c);
    return 0;
}


/* ---- the engine over the directory tier (KVC_TINY_GGUF) ------------------------------ */

#define NEED_TINY(m)                                                                               \
    const char *tiny_path = getenv("KVC_TINY_GGUF");                                               \
    kvc_model *m = NULL;                                                                           \
    if (!tiny_path || !tiny_path[0]) SKIP("KVC_TINY_GGUF not set (ctest sets it)");                \
    ASSERT_OK(kvc_model_load(tiny_path, NULL, &m))

static int rm_cb(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void rm_rf(const char *dir) { nftw(dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS); }

typedef struct srun {
    kvc_kv_format fmt;
    kvc_dtype dtype;
    const char *url; /* NULL: no store */
    const char *more[2]; /* further tiers (NULL: none) */
    int no_promote;
    kvc_store_write_policy policy;
    int32_t queue_objects;
    const char *salt;
    int64_t capacity;
} srun;

static srun srun_default(void) {
    srun r;
    memset(&r, 0, sizeof r);
    r.dtype = KVC_F16;
    r.queue_objects = 4096;
    r.capacity = 1024;
    return r;
}

static kvc_engine_params srun_engine_params(const srun *r) {
    kvc_engine_params ep = kvc_engine_default_params();
    ep.kv_dtype = r->dtype;
    ep.kv_format = r->fmt;
    ep.page_size = 16;
    ep.kv_capacity_tokens = r->capacity;
    ep.max_step_tokens = 64; /* prompts in several chunks */
    ep.n_threads = 2;
    return ep;
}

/* The namespace the engine of r uses. */
static kvc_status srun_ns(const kvc_model *m, const char *path, const srun *r, kvc_store_key *ns) {
    kvc_engine_params ep = srun_engine_params(r);
    kvc_engine *e = NULL;
    kvc_status st = kvc_engine_create(m, &ep, &e);
    if (st != KVC_OK) return st;
    kvc_cache_params cp;
    st = kvc_cache_get_params(kvc_engine_cache(e), &cp);
    if (st == KVC_OK)
        st = kvc_store_model_namespace(path, m, &cp, r->salt, r->salt ? strlen(r->salt) : 0, ns);
    kvc_engine_destroy(e);
    return st;
}

/* Generates n_gen greedy tokens for each prompt in turn through one engine
 * (a store attached when r->url), checking the cache after every step. */
static int srun_go(const kvc_model *m, const char *path, const srun *r, int n_prompts,
                   const int32_t *const *prompts, const int *lens, int n_gen, int32_t *out,
                   kvc_engine_stats *es, kvc_store_stats *ss) {
    kvc_engine_params ep = srun_engine_params(r);
    kvc_engine *e = NULL;
    kvc_store *s = NULL;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    if (r->url) {
        kvc_store_params sp = kvc_store_default_params();
        sp.write_policy = r->policy;
        sp.queue_objects = r->queue_objects;
        sp.promote = !r->no_promote;
        kvc_cache_params cp;
        kvc_store_key ns;
        ASSERT_OK(kvc_cache_get_params(kvc_engine_cache(e), &cp));
        ASSERT_OK(kvc_store_model_namespace(path, m, &cp, r->salt,
                                            r->salt ? strlen(r->salt) : 0, &ns));
        const char *urls[3] = {r->url, r->more[0], r->more[1]};
        const int n_urls = 1 + (r->more[0] != NULL) + (r->more[0] && r->more[1]);
        ASSERT_OK(kvc_store_open(urls, n_urls, &sp, &s));
        ASSERT_OK(kvc_store_attach_engine(s, e, &ns));
    }
    for (int p = 0; p < n_prompts; p++) {
        int64_t id;
        ASSERT_OK(kvc_engine_add_request(e, prompts[p], lens[p], n_gen, NULL, 1, &id));
        int got = 0;
        while (kvc_engine_pending(e) > 0) {
            kvc_engine_event ev[4];
            int64_t ne = 0;
            ASSERT_OK(kvc_engine_step(e, ev, 4, &ne));
            ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
            for (int64_t i = 0; i < ne; i++) out[p * n_gen + got++] = ev[i].token;
        }
        ASSERT_EQ_I64(got, n_gen);
    }
    if (es) ASSERT_OK(kvc_engine_get_stats(e, es));
    if (s) {
        ASSERT_OK(kvc_store_flush(s, 30.0));
        if (ss) ASSERT_OK(kvc_store_get_stats(s, ss));
    }
    kvc_engine_destroy(e);
    kvc_store_close(s);
    return 0;
}

static void random_prompt(int32_t *p, int n, uint64_t seed, int32_t n_vocab) {
    for (int i = 0; i < n; i++) p[i] = (int32_t)(test_rng_next(&seed) % (uint64_t)n_vocab);
}

/* Path of page pg's file in the directory tier (docs/KV_STORE.md section 5). */
static void page_file(const char *dir, const kvc_store_key *ns, const int32_t *prompt, int pg,
                      char *out, size_t cap) {
    kvc_store_key keys[64];
    kvc_store_page_keys(ns, prompt, pg + 1, 16, 1, keys);
    char nh[33], kh[33];
    kvc__store_key_hex(ns, nh);
    kvc__store_key_hex(&keys[pg], kh);
    snprintf(out, cap, "%s/%s/%.2s/%s.kvp", dir, nh, kh, kh);
}

TEST(engine_restores_prompts_from_a_directory_exactly) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    char dir[] = "/tmp/kvc_store_XXXXXX";
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    char url[64];
    snprintf(url, sizeof url, "dir:%s", dir);
    enum { N = 150, GEN = 8 };
    int32_t prompt[N];
    random_prompt(prompt, N, test_seed, in.n_vocab);
    const int32_t *pp[1] = {prompt};
    const int lens[1] = {N};
    const struct {
        kvc_kv_format fmt;
        kvc_dtype dtype;
        int64_t restored; /* whole units of the first N - 1 tokens */
    } cases[] = {{KVC_KVFMT_NONE, KVC_F16, 144}, {KVC_KVFMT_NONE, KVC_I8, 144},
                 {KVC_KVFMT_KIVI8, KVC_F16, 128}, {KVC_KVFMT_KIVI4, KVC_F16, 128}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        srun r = srun_default();
        r.fmt = cases[c].fmt;
        r.dtype = cases[c].dtype;
        int32_t ref[GEN], a[GEN], b[GEN];
        kvc_engine_stats es;
        kvc_store_stats ss;
        if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, ref, NULL, NULL)) return 1;
        r.url = url;
        if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, a, &es, &ss)) return 1;
        ASSERT_MEM_EQ(a, ref, sizeof ref);
        ASSERT_EQ_I64(es.external_tokens, 0);
        ASSERT_TRUE(ss.writes_done >= cases[c].restored / 16);
        ASSERT_EQ_I64(ss.writes_dropped + ss.writes_failed, 0);
        /* a second engine (as a second process would) restores the prompt */
        if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, b, &es, &ss)) return 1;
        ASSERT_MEM_EQ(b, ref, sizeof ref);
        if (es.external_tokens != cases[c].restored)
            TEST_FAIL_("case %zu: restored %lld tokens, want %lld", c,
                       (long long)es.external_tokens, (long long)cases[c].restored);
        ASSERT_EQ_I64(ss.hit_pages, cases[c].restored / 16);
        ASSERT_EQ_I64(ss.verify_failures, 0);
        ASSERT_EQ_I64(es.prefill_tokens, N - cases[c].restored);
        ASSERT_EQ_I64(es.external_miss_tokens, N - cases[c].restored);
    }
    rm_rf(dir);
    kvc_model_destroy(m);
    return 0;
}

/* K/V restored = K/V recomputed, byte for byte, and the next step's logits
 * alike (model level: a cache computed, saved, restored into another). */
static int kv_bytes_case(const kvc_model *m, const char *path, kvc_dtype dtype,
                         kvc_kv_format fmt, const char *url, int64_t pool_bytes) {
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    enum { N = 129 };
    int32_t prompt[N];
    random_prompt(prompt, N, test_seed + 1, in.n_vocab);
    kvc_cache_params cp = kvc_model_cache_params(m, dtype, 512);
    cp.page_size = 16;
    cp.num_pages = 32;
    cp.kv_format = fmt;
    kvc_cache *x = NULL, *y = NULL, *z = NULL;
    ASSERT_OK(kvc_cache_create(&cp, &x));
    ASSERT_OK(kvc_cache_create(&cp, &y));
    ASSERT_OK(kvc_cache_create(&cp, &z));
    kvc_model_ctx *ctx = NULL;
    ASSERT_OK(kvc_model_ctx_create(m, 2, &ctx));
    const size_t V = (size_t)in.n_vocab;
    float *lx = malloc(V * sizeof(float)), *ly = malloc(V * sizeof(float)),
          *lz = malloc(V * sizeof(float));
    kvc_seq_id sx, sy, sz;
    int64_t hit;
    /* x and z compute all N tokens (x in one step, z in chunks of 40) */
    ASSERT_OK(kvc_cache_add_sequence(x, prompt, N, 0, &sx, &hit));
    ASSERT_OK(kvc_cache_add_sequence(z, prompt, N, 0, &sz, &hit));
    int64_t pos0 = 0, n = N;
    ASSERT_OK(kvc_model_forward(ctx, x, 1, &sx, &pos0, &n, NULL, prompt, NULL, lx));
    for (int64_t p = 0; p < N; p += 40) {
        int64_t c = N - p < 40 ? N - p : 40;
        ASSERT_OK(kvc_model_forward(ctx, z, 1, &sz, &p, &c, NULL, prompt + p, NULL, lz));
    }
    ASSERT_MEM_EQ(lx, lz, V * sizeof(float));
    kvc_store *s = NULL;
    kvc_store_params sp = kvc_store_default_params();
    sp.object_pool_bytes = pool_bytes;
    ASSERT_OK(kvc_store_open(&url, 1, &sp, &s));
    kvc_store_key ns;
    ASSERT_OK(kvc_store_model_namespace(path, m, &cp, NULL, 0, &ns));
    const int64_t unit = fmt == KVC_KVFMT_NONE ? 16 : 64, n_pages = (N - 1) / unit * unit / 16;
    int32_t ids[32], yids[32], indptr[2], last;
    int64_t np;
    ASSERT_OK(kvc_cache_page_table(x, &sx, 1, indptr, ids, 32, &last, &np));
    ASSERT_OK(kvc_store_save_run(s, x, &ns, prompt, 0, n_pages, ids));
    ASSERT_OK(kvc_store_flush(s, 30.0));
    /* y: restore the whole units, compute the rest */
    ASSERT_OK(kvc_cache_add_sequence(y, prompt, N, 0, &sy, &hit));
    ASSERT_OK(kvc_cache_page_table(y, &sy, 1, indptr, yids, 32, &last, &np));
    int64_t got = 0;
    ASSERT_OK(kvc_store_restore_run(s, y, &ns, prompt, 0, n_pages, yids, &got));
    ASSERT_EQ_I64(got, n_pages);
    pos0 = n_pages * 16;
    n = N - pos0;
    ASSERT_OK(kvc_model_forward(ctx, y, 1, &sy, &pos0, &n, NULL, prompt + pos0, NULL, ly));
    ASSERT_MEM_EQ(lx, ly, V * sizeof(float));
    const size_t pb = kvc_cache_page_bytes(x);
    unsigned char *bx = malloc(pb), *by = malloc(pb), *bz = malloc(pb);
    int32_t zids[32];
    ASSERT_OK(kvc_cache_page_table(z, &sz, 1, indptr, zids, 32, &last, &np));
    for (int64_t p = 0; p < n_pages; p++) {
        ASSERT_OK(kvc_cache_read_page(x, ids[p], bx, pb));
        ASSERT_OK(kvc_cache_read_page(y, yids[p], by, pb));
        ASSERT_OK(kvc_cache_read_page(z, zids[p], bz, pb));
        ASSERT_MEM_EQ(by, bz, pb); /* restored = recomputed (in other chunks) */
        ASSERT_MEM_EQ(bx, bz, pb);
    }
    ASSERT_OK(kvc_cache_check(y));
    /* again into a fresh cache: with a pool, the objects arrive in the
     * buffers of the first restore (another page's bytes before) */
    kvc_cache *w = NULL;
    kvc_seq_id sw;
    ASSERT_OK(kvc_cache_create(&cp, &w));
    ASSERT_OK(kvc_cache_add_sequence(w, prompt, N, 0, &sw, &hit));
    ASSERT_OK(kvc_cache_page_table(w, &sw, 1, indptr, zids, 32, &last, &np));
    ASSERT_OK(kvc_store_restore_run(s, w, &ns, prompt, 0, n_pages, zids, &got));
    ASSERT_EQ_I64(got, n_pages);
    /* a run cut inside a unit (page 5's file removed): the cut unit's
     * pages are written but computed again (store.h), so only the whole
     * units count as hits */
    if (unit > 16 && !strncmp(url, "dir:", 4)) {
        kvc_store_key keys[32];
        char nh[33], kh[33], fpath[256];
        ASSERT_OK(kvc_store_page_keys(&ns, prompt, n_pages, 16, (int32_t)(unit / 16), keys));
        kvc__store_key_hex(&ns, nh);
        kvc__store_key_hex(&keys[5], kh);
        snprintf(fpath, sizeof fpath, "%s/%s/%.2s/%s.kvp", url + 4, nh, kh, kh);
        ASSERT_EQ_I64(unlink(fpath), 0);
        kvc_cache *v = NULL;
        kvc_seq_id sv;
        int32_t vids[32];
        ASSERT_OK(kvc_cache_create(&cp, &v));
        ASSERT_OK(kvc_cache_add_sequence(v, prompt, N, 0, &sv, &hit));
        ASSERT_OK(kvc_cache_page_table(v, &sv, 1, indptr, vids, 32, &last, &np));
        kvc_store_stats s0, s1;
        ASSERT_OK(kvc_store_get_stats(s, &s0));
        ASSERT_OK(kvc_store_restore_run(s, v, &ns, prompt, 0, n_pages, vids, &got));
        ASSERT_EQ_I64(got, 5);
        ASSERT_OK(kvc_store_get_stats(s, &s1));
        ASSERT_EQ_I64(s1.hit_pages - s0.hit_pages, 4);
        ASSERT_EQ_I64(s1.miss_pages - s0.miss_pages, n_pages - 4);
        ASSERT_EQ_I64(s1.misses[KVC_STORE_MISS_ABSENT] - s0.misses[KVC_STORE_MISS_ABSENT],
                      n_pages - 4);
        ASSERT_OK(kvc_cache_check(v));
        kvc_cache_destroy(v);
    }
    /* runs past int32 token positions: refused (the sizes wrapped: a heap
     * overflow at 2^60, a signed overflow at INT64_MAX), nothing read */
    const int64_t far[3] = {(int64_t)1 << 60, INT64_MAX - unit + 1, (int64_t)1 << 27};
    for (int i = 0; i < 3; i++) {
        const int64_t first = far[i] / unit * unit;
        ASSERT_STATUS(kvc_store_restore_run(s, w, &ns, prompt, first, unit, zids, &got),
                      KVC_ERR_INVALID_ARG);
        ASSERT_STR_CONTAINS(kvc_last_error(), "int32 token positions");
        ASSERT_EQ_I64(got, 0);
        ASSERT_STATUS(kvc_store_save_run(s, x, &ns, prompt, first, unit, ids),
                      KVC_ERR_INVALID_ARG);
    }
    ASSERT_OK(kvc_cache_check(w));
    for (int64_t p = 0; p < n_pages; p++) {
        ASSERT_OK(kvc_cache_read_page(w, zids[p], by, pb));
        ASSERT_OK(kvc_cache_read_page(x, ids[p], bx, pb));
        ASSERT_MEM_EQ(by, bx, pb);
    }
    kvc_cache_destroy(w);
    free(bx), free(by), free(bz), free(lx), free(ly), free(lz);
    kvc_store_close(s);
    kvc_model_ctx_destroy(ctx);
    kvc_cache_destroy(x);
    kvc_cache_destroy(y);
    kvc_cache_destroy(z);
    return 0;
}

TEST(restored_kv_bytes_equal_recomputed) {
    NEED_TINY(m);
    char dir[] = "/tmp/kvc_store_XXXXXX";
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    char url[64];
    snprintf(url, sizeof url, "dir:%s", dir);
    const int64_t pool = kvc_store_default_params().object_pool_bytes;
    if (kv_bytes_case(m, tiny_path, KVC_F16, KVC_KVFMT_NONE, url, pool)) return 1;
    if (kv_bytes_case(m, tiny_path, KVC_F16, KVC_KVFMT_NONE, url, 0)) return 1; /* no pool */
    if (kv_bytes_case(m, tiny_path, KVC_F16, KVC_KVFMT_NONE, url, 1)) return 1; /* one too small */
    if (kv_bytes_case(m, tiny_path, KVC_I4, KVC_KVFMT_NONE, url, pool)) return 1;
    if (kv_bytes_case(m, tiny_path, KVC_F16, KVC_KVFMT_KIVI4, url, pool)) return 1;
    if (kv_bytes_case(m, tiny_path, KVC_F16, KVC_KVFMT_KIVI8, url, pool)) return 1;
    rm_rf(dir);
    kvc_model_destroy(m);
    return 0;
}

static int corrupt_file(const char *path, int how) {
    FILE *f = fopen(path, "r+b");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    if (how == 0) { /* a bit of the payload */
        fseek(f, size - 100, SEEK_SET);
        int c = fgetc(f);
        fseek(f, size - 100, SEEK_SET);
        fputc(c ^ 4, f);
        fclose(f);
        return 0;
    }
    if (how == 1) { /* version 2, header resealed: a reader that does not know it */
        unsigned char h[128];
        fseek(f, 0, SEEK_SET);
        if (fread(h, 1, 128, f) != 128) return fclose(f), -1;
        h[8] = 2;
        reseal_header(h);
        fseek(f, 0, SEEK_SET);
        fwrite(h, 1, 128, f);
        fclose(f);
        return 0;
    }
    fclose(f); /* truncated, or grown to 1 GiB (sparse; read no further than an object) */
    return truncate(path, how == 2 ? size / 2 : (off_t)1 << 30);
}

TEST(engine_survives_every_corruption_of_the_directory) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    enum { N = 100, GEN = 6 };
    int32_t prompt[N];
    random_prompt(prompt, N, test_seed + 2, in.n_vocab);
    const int32_t *pp[1] = {prompt};
    const int lens[1] = {N};
    srun r = srun_default();
    int32_t ref[GEN], out[GEN];
    if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, ref, NULL, NULL)) return 1;
    kvc_store_key ns;
    ASSERT_OK(srun_ns(m, tiny_path, &r, &ns));
    /* page 2 of 6 corrupted each way: pages 0, 1 restored, the rest computed */
    const kvc_store_miss want[4] = {KVC_STORE_MISS_PAYLOAD, KVC_STORE_MISS_VERSION,
                                    KVC_STORE_MISS_TRUNCATED, KVC_STORE_MISS_TRUNCATED};
    for (int how = 0; how < 4; how++) {
        char dir[] = "/tmp/kvc_store_XXXXXX", url[64], file[256];
        ASSERT_TRUE(mkdtemp(dir) != NULL);
        snprintf(url, sizeof url, "dir:%s", dir);
        r.url = url;
        kvc_engine_stats es;
        kvc_store_stats ss;
        if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, out, NULL, NULL)) return 1;
        page_file(dir, &ns, prompt, 2, file, sizeof file);
        ASSERT_OK(corrupt_file(file, how) == 0 ? KVC_OK : KVC_ERR_IO);
        if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, out, &es, &ss)) return 1;
        ASSERT_MEM_EQ(out, ref, sizeof ref);
        ASSERT_EQ_I64(es.external_tokens, 32);
        ASSERT_EQ_I64(ss.verify_failures, 1);
        if (ss.misses[want[how]] != 1) TEST_FAIL_("corruption %d: no %s miss", how,
                                                  kvc_store_miss_name(want[how]));
        /* the recomputed pages were written again: the next restore is whole */
        if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, out, &es, &ss)) return 1;
        ASSERT_MEM_EQ(out, ref, sizeof ref);
        ASSERT_EQ_I64(es.external_tokens, 96);
        /* another tenant (salt) finds nothing, and computes the same tokens */
        srun t = r;
        t.salt = "another tenant";
        if (srun_go(m, tiny_path, &t, 1, pp, lens, GEN, out, &es, &ss)) return 1;
        ASSERT_MEM_EQ(out, ref, sizeof ref);
        ASSERT_EQ_I64(es.external_tokens, 0);
        ASSERT_EQ_I64(ss.verify_failures, 0);
        rm_rf(dir);
    }
    kvc_model_destroy(m);
    return 0;
}

TEST(write_policies_and_a_full_queue) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    enum { N = 100, GEN = 4 };
    int32_t p1[N], p2[N], p3[N];
    random_prompt(p1, N, test_seed + 3, in.n_vocab);
    random_prompt(p2, N, test_seed + 4, in.n_vocab);
    random_prompt(p3, N, test_seed + 5, in.n_vocab);
    const int lens[3] = {N, N, N};
    int32_t ref[3 * GEN], out[3 * GEN];
    srun r = srun_default();
    const int32_t *pp[3] = {p1, p2, p3};
    if (srun_go(m, tiny_path, &r, 3, pp, lens, GEN, ref, NULL, NULL)) return 1;
    char dir[] = "/tmp/kvc_store_XXXXXX", url[64];
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(url, sizeof url, "dir:%s", dir);
    r.url = url;
    kvc_engine_stats es;
    kvc_store_stats ss;
    /* write-back: nothing is written until the cache evicts; 8 pages of
     * capacity hold one prompt, so each next prompt evicts the last one's */
    r.policy = KVC_STORE_WRITE_BACK;
    r.capacity = 128;
    if (srun_go(m, tiny_path, &r, 3, pp, lens, GEN, out, &es, &ss)) return 1;
    ASSERT_MEM_EQ(out, ref, sizeof ref);
    ASSERT_TRUE(ss.writes_done >= 6 && ss.writes_done <= 12); /* p1's and p2's pages */
    r.policy = KVC_STORE_WRITE_THROUGH;
    r.capacity = 1024;
    const int32_t *only1[1] = {p1};
    if (srun_go(m, tiny_path, &r, 1, only1, lens, GEN, out, &es, &ss)) return 1;
    ASSERT_MEM_EQ(out, ref, GEN * sizeof(int32_t));
    ASSERT_EQ_I64(es.external_tokens, 96); /* restored what write-back saved */
    rm_rf(dir);
    /* selective:2: a page is written once it served 2 prefix hits */
    ASSERT_TRUE(mkdtemp(strcpy(dir, "/tmp/kvc_store_XXXXXX")) != NULL);
    snprintf(url, sizeof url, "dir:%s", dir);
    r.policy = KVC_STORE_WRITE_SELECTIVE;
    const int32_t *thrice[3] = {p1, p1, p1};
    if (srun_go(m, tiny_path, &r, 2, thrice, lens, GEN, out, &es, &ss)) return 1;
    ASSERT_EQ_I64(ss.writes_queued, 0); /* one hit so far */
    if (srun_go(m, tiny_path, &r, 3, thrice, lens, GEN, out, &es, &ss)) return 1;
    ASSERT_EQ_I64(ss.writes_queued, 6); /* the second hit: p1's 6 full pages */
    for (int i = 0; i < 3; i++) ASSERT_MEM_EQ(out + i * GEN, ref, GEN * sizeof(int32_t));
    rm_rf(dir);
    /* a queue of one object drops writes, counted; the output is unchanged */
    ASSERT_TRUE(mkdtemp(strcpy(dir, "/tmp/kvc_store_XXXXXX")) != NULL);
    snprintf(url, sizeof url, "dir:%s", dir);
    r.policy = KVC_STORE_WRITE_THROUGH;
    r.queue_objects = 1;
    if (srun_go(m, tiny_path, &r, 3, pp, lens, GEN, out, &es, &ss)) return 1;
    ASSERT_MEM_EQ(out, ref, sizeof ref);
    ASSERT_TRUE(ss.writes_dropped > 0);
    ASSERT_EQ_I64(ss.writes_dropped + ss.writes_queued, 18);
    rm_rf(dir);
    kvc_model_destroy(m);
    return 0;
}

static int n_objects;
static int count_cb(const char *path, const struct stat *sb, int type, struct FTW *f) {
    (void)sb, (void)f;
    const size_t n = strlen(path);
    if (type == FTW_F && n > 4 && !strcmp(path + n - 4, ".kvp")) n_objects++;
    return 0;
}

/* Page objects in a directory tier. */
static int count_objects(const char *dir) {
    n_objects = 0;
    nftw(dir, count_cb, 16, FTW_PHYS);
    return n_objects;
}

/* Each tier writes by its own policy (URL ?write=); the others by the
 * store's; bad write options are refused. */
TEST(write_policies_per_tier) {
    NEED_TINY(m);
    char da[] = "/tmp/kvc_store_XXXXXX", db[] = "/tmp/kvc_store_XXXXXX",
         dc[] = "/tmp/kvc_store_XXXXXX";
    ASSERT_TRUE(mkdtemp(da) && mkdtemp(db) && mkdtemp(dc));
    char ua[64], ub[96], uc[96];
    snprintf(ua, sizeof ua, "dir:%s", da);
    /* URL options around the tier's own: both orders */
    snprintf(ub, sizeof ub, "dir:%s?write=back&max_bytes=64M", db);
    snprintf(uc, sizeof uc, "dir:%s?max_bytes=64M&write=selective:1", dc);
    { /* refused: nothing opened */
        const char *bad[] = {"?write=bogus", "?write=selective:0", "?write=back&write=back",
                             "?write=", "?write=back&bogus=1", "?max_bytes=1M&write=through&"};
        for (int i = 0; i < 6; i++) {
            char u[128];
            snprintf(u, sizeof u, "dir:%s%s", da, bad[i]);
            const char *pu = u;
            kvc_store *s = NULL;
            ASSERT_EQ_I64(kvc_store_open(&pu, 1, NULL, &s), KVC_ERR_INVALID_ARG);
            ASSERT_TRUE(s == NULL);
            ASSERT_TRUE(strstr(kvc_last_error(), "dir:") != NULL);
        }
    }
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    enum { N = 100, GEN = 4 };
    int32_t p1[N], p2[N], p3[N];
    random_prompt(p1, N, test_seed + 13, in.n_vocab);
    random_prompt(p2, N, test_seed + 14, in.n_vocab);
    random_prompt(p3, N, test_seed + 15, in.n_vocab);
    const int lens[4] = {N, N, N, N};
    int32_t ref[4 * GEN], out[4 * GEN];
    srun r = srun_default();
    const int32_t *pp[4] = {p1, p2, p3, p3};
    if (srun_go(m, tiny_path, &r, 4, pp, lens, GEN, ref, NULL, NULL)) return 1;
    /* 128 slots hold one prompt's 6 full pages: each next prompt evicts the
     * last one's; p3 runs twice (a prefix hit) */
    r.url = ua;
    r.more[0] = ub;
    r.more[1] = uc;
    r.policy = KVC_STORE_WRITE_THROUGH;
    r.capacity = 128;
    kvc_store_stats ss;
    if (srun_go(m, tiny_path, &r, 4, pp, lens, GEN, out, NULL, &ss)) return 1;
    ASSERT_MEM_EQ(out, ref, sizeof ref);
    ASSERT_EQ_I64(count_objects(da), 18); /* through: every full page of p1, p2, p3 */
    const int nb = count_objects(db); /* back: p1's and p2's pages, as evicted */
    ASSERT_TRUE(nb >= 6 && nb <= 12);
    ASSERT_EQ_I64(count_objects(dc), 6); /* selective:1: p3's, hit once */
    ASSERT_EQ_I64(ss.writes_queued, 18 + nb + 6);
    ASSERT_EQ_I64(ss.writes_failed + ss.writes_dropped, 0);
    rm_rf(da), rm_rf(db), rm_rf(dc);
    kvc_model_destroy(m);
    return 0;
}

/* Pages restored from a later tier are written to the earlier ones
 * (promote, the default), and only then. */
TEST(restored_pages_are_promoted_to_earlier_tiers) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    enum { N = 100, GEN = 4 };
    int32_t p1[N];
    random_prompt(p1, N, test_seed + 17, in.n_vocab);
    const int lens[1] = {N};
    const int32_t *pp[1] = {p1};
    int32_t ref[GEN], out[GEN];
    char da[] = "/tmp/kvc_store_XXXXXX", db[] = "/tmp/kvc_store_XXXXXX";
    ASSERT_TRUE(mkdtemp(da) && mkdtemp(db));
    char ua[64], ub[64];
    snprintf(ua, sizeof ua, "dir:%s?write=back", da); /* never evicts here: no own writes */
    snprintf(ub, sizeof ub, "dir:%s", db);
    srun r = srun_default();
    r.url = ub; /* p1's 6 full pages into B */
    if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, ref, NULL, NULL)) return 1;
    ASSERT_EQ_I64(count_objects(db), 6);
    kvc_engine_stats es;
    kvc_store_stats ss;
    r.url = ua;
    r.more[0] = ub;
    r.no_promote = 1; /* A stays empty */
    if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, out, &es, &ss)) return 1;
    ASSERT_MEM_EQ(out, ref, sizeof ref);
    ASSERT_EQ_I64(es.external_tokens, 96);
    ASSERT_EQ_I64(count_objects(da), 0);
    r.no_promote = 0; /* restored from B, written to A */
    if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, out, &es, &ss)) return 1;
    ASSERT_MEM_EQ(out, ref, sizeof ref);
    ASSERT_EQ_I64(es.external_tokens, 96);
    ASSERT_EQ_I64(ss.writes_queued, 6);
    ASSERT_EQ_I64(count_objects(da), 6);
    rm_rf(db); /* now A alone serves them */
    if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, out, &es, &ss)) return 1;
    ASSERT_MEM_EQ(out, ref, sizeof ref);
    ASSERT_EQ_I64(es.external_tokens, 96);
    ASSERT_EQ_I64(ss.writes_queued, 0);
    rm_rf(da), rm_rf(db); /* B again: opening its tier made it anew, empty */
    kvc_model_destroy(m);
    return 0;
}

/* The attached engine's cache events (KVC_STORE_TIER_CACHE), by key. */
typedef struct cache_evs {
    kvc_store_key keys[64];
    int stored[64], removed[64], n;
} cache_evs;

static void cache_ev_cb(void *user, const kvc_store_event *ev) {
    cache_evs *c = user;
    if (ev->tier != KVC_STORE_TIER_CACHE || ev->kind == KVC_STORE_EVENT_CLEARED) return;
    int i = 0;
    while (i < c->n && memcmp(&c->keys[i], &ev->key, sizeof ev->key) != 0) i++;
    if (i == c->n) {
        if (c->n == 64) return;
        c->keys[c->n++] = ev->key;
    }
    if (ev->kind == KVC_STORE_EVENT_STORED) c->stored[i]++;
    else c->removed[i]++;
}

static int cache_ev_find(const cache_evs *c, const kvc_store_key *k) {
    for (int i = 0; i < c->n; i++)
        if (!memcmp(&c->keys[i], k, sizeof *k)) return i;
    return -1;
}

/* Pages restored into the engine's cache are in it like computed ones: a
 * router following its events hears of each (stored) and of its eviction
 * (removed), in line or by a background load; restored pages are not
 * written back to the tiers. */
TEST(restored_pages_are_reported_in_the_cache_events) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    enum { NB = 150, NA = 40, GEN = 8 };
    int32_t pb[NB], pa[NA], pc[NB];
    random_prompt(pb, NB, test_seed + 21, in.n_vocab);
    random_prompt(pa, NA, test_seed + 22, in.n_vocab);
    random_prompt(pc, NB, test_seed + 23, in.n_vocab);
    char dir[] = "/tmp/kvc_store_XXXXXX", url[64];
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(url, sizeof url, "dir:%s", dir);
    srun r = srun_default();
    r.url = url;
    const int32_t *pp[1] = {pb};
    const int lens[1] = {NB};
    int32_t ref[GEN];
    if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, ref, NULL, NULL)) return 1; /* B stored */
    kvc_store_key ns, keys[9];
    ASSERT_OK(srun_ns(m, tiny_path, &r, &ns));
    ASSERT_OK(kvc_store_page_keys(&ns, pb, 9, 16, 1, keys));
    for (int bg = 0; bg < 2; bg++) { /* B alone: in line; after A: a background load */
        r.capacity = 160; /* 10 pages: C evicts B's */
        kvc_engine_params ep = srun_engine_params(&r);
        kvc_engine *e = NULL;
        kvc_store *s = NULL;
        ASSERT_OK(kvc_engine_create(m, &ep, &e));
        const char *urls[1] = {url};
        kvc_store_params sp = kvc_store_default_params();
        ASSERT_OK(kvc_store_open(urls, 1, &sp, &s));
        cache_evs ce;
        memset(&ce, 0, sizeof ce);
        ASSERT_OK(kvc_store_set_event_callback(s, cache_ev_cb, &ce));
        ASSERT_OK(kvc_store_attach_engine(s, e, &ns));
        int64_t id;
        if (bg) ASSERT_OK(kvc_engine_add_request(e, pa, NA, GEN, NULL, 1, &id));
        ASSERT_OK(kvc_engine_add_request(e, pb, NB, GEN, NULL, 1, &id));
        int32_t out[GEN];
        int got = 0;
        kvc_engine_event ev[2];
        int64_t ne;
        while (kvc_engine_pending(e) > 0) {
            ASSERT_OK(kvc_engine_step(e, ev, 2, &ne));
            ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
            for (int64_t i = 0; i < ne; i++)
                if (ev[i].request_id == id) out[got++] = ev[i].token;
        }
        ASSERT_EQ_I64(got, GEN);
        ASSERT_MEM_EQ(out, ref, sizeof ref);
        kvc_engine_stats es;
        ASSERT_OK(kvc_engine_get_stats(e, &es));
        ASSERT_EQ_I64(es.external_tokens, 144);
        for (int k = 0; k < 9; k++) {
            const int i = cache_ev_find(&ce, &keys[k]);
            if (i < 0 || ce.stored[i] != 1 || ce.removed[i] != 0)
                TEST_FAIL_("bg %d: page %d: %d stored, %d removed events, want 1 and 0", bg, k,
                           i < 0 ? 0 : ce.stored[i], i < 0 ? 0 : ce.removed[i]);
        }
        ASSERT_OK(kvc_store_flush(s, 30.0));
        kvc_store_stats ss;
        ASSERT_OK(kvc_store_get_stats(s, &ss));
        ASSERT_EQ_I64(ss.writes_queued, bg ? 2 : 0); /* A's 2 final pages, never B's again */
        ASSERT_OK(kvc_engine_add_request(e, pc, NB, 1, NULL, 1, &id)); /* evicts B's pages */
        while (kvc_engine_pending(e) > 0) ASSERT_OK(kvc_engine_step(e, ev, 2, &ne));
        for (int k = 0; k < 9; k++) {
            const int i = cache_ev_find(&ce, &keys[k]);
            if (i < 0 || ce.removed[i] != 1)
                TEST_FAIL_("bg %d: page %d evicted: %d removed events, want 1", bg, k,
                           i < 0 ? 0 : ce.removed[i]);
        }
        kvc_engine_destroy(e);
        kvc_store_close(s);
    }
    rm_rf(dir);
    kvc_model_destroy(m);
    return 0;
}

/* Two prompts sharing 80 tokens: their pages 4 hold the same ids but lie in
 * different K groups (kivi: other quantization parameters), so their keys
 * must differ, or one restores the other's page. */
TEST(partly_shared_groups_keep_their_own_pages) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    enum { N = 150, GEN = 8 };
    int32_t a[N], b[N];
    random_prompt(a, N, test_seed + 9, in.n_vocab);
    random_prompt(b, N, test_seed + 10, in.n_vocab);
    memcpy(b, a, 80 * sizeof(int32_t));
    const int32_t *pp[2] = {a, b};
    const int lens[2] = {N, N};
    const kvc_kv_format fmts[3] = {KVC_KVFMT_KIVI4, KVC_KVFMT_KIVI8, KVC_KVFMT_NONE};
    for (int f = 0; f < 3; f++) {
        char dir[] = "/tmp/kvc_store_XXXXXX", url[64];
        ASSERT_TRUE(mkdtemp(dir) != NULL);
        snprintf(url, sizeof url, "dir:%s", dir);
        srun r = srun_default();
        r.fmt = fmts[f];
        int32_t ref[2 * GEN], out[2 * GEN];
        kvc_engine_stats es;
        if (srun_go(m, tiny_path, &r, 2, pp, lens, GEN, ref, NULL, NULL)) return 1;
        r.url = url;
        if (srun_go(m, tiny_path, &r, 2, pp, lens, GEN, out, NULL, NULL)) return 1;
        ASSERT_MEM_EQ(out, ref, sizeof ref);
        /* each prompt alone in a new engine: restored from the store */
        for (int p = 0; p < 2; p++) {
            if (srun_go(m, tiny_path, &r, 1, pp + p, lens, GEN, out, &es, NULL)) return 1;
            if (memcmp(out, ref + p * GEN, GEN * sizeof(int32_t)) != 0)
                TEST_FAIL_("format %d, prompt %d: restored tokens differ", f, p);
            ASSERT_EQ_I64(es.external_tokens, f == 2 ? 144 : 128);
        }
        rm_rf(dir);
    }
    kvc_model_destroy(m);
    return 0;
}

/* ---- the engine's background loads (a connector of the test's own) ----------------- */

typedef struct fake_conn {
    const kvc_cache *ref;     /* the prompt's K/V, computed */
    const int32_t *ref_pages; /* its page ids */
    const int32_t *prompt;
    int n_prompt;
    int64_t pages;            /* what the connector holds of the prompt */
    int polls_left;           /* load_poll says "running" this many more times */
    int started, finished, applied_pages, polls, waits;
    int64_t first, max;       /* the load's first page and page count */
} fake_conn;

/* The prompts differ in their first page (all the probe may read). */
static int same_prompt(const fake_conn *f, const int32_t *tokens) {
    return memcmp(tokens, f->prompt, 16 * sizeof(int32_t)) == 0;
}

static kvc_status fc_probe(void *user, const kvc_cache *c, const int32_t *tokens, int64_t first,
                           int64_t max, int64_t *n) {
    (void)c;
    fake_conn *f = user;
    *n = same_prompt(f, tokens) && first == 0 ? (f->pages < max ? f->pages : max) : 0;
    return KVC_OK;
}

static void *fc_start(void *user, const kvc_cache *c, const int32_t *tokens, int64_t first,
                      int64_t n) {
    (void)c;
    fake_conn *f = user;
    if (!same_prompt(f, tokens) || first != 0) return NULL; /* nothing stored: computed */
    f->started++;
    f->first = first;
    f->max = n;
    return f;
}

static int fc_poll(void *user, void *load, int wait, int64_t *ready) {
    fake_conn *f = user;
    (void)load;
    f->polls++;
    if (wait) f->waits++, f->polls_left = 0;
    if (f->polls_left > 0) {
        f->polls_left--;
        return 0;
    }
    *ready = f->pages < f->max ? f->pages : f->max;
    return 1;
}

static void fc_finish(void *user, void *load, kvc_cache *c, int64_t skip, const int32_t *ids,
                      int64_t n) {
    fake_conn *f = user;
    (void)load;
    f->finished++;
    if (!c) return;
    const size_t pb = kvc_cache_page_bytes(c);
    unsigned char *buf = malloc(pb);
    for (int64_t i = 0; i < n; i++) {
        kvc_cache_read_page(f->ref, f->ref_pages[f->first + skip + i], buf, pb);
        kvc_cache_write_page(c, ids[i], buf, pb);
        f->applied_pages++;
    }
    free(buf);
}

TEST(engine_steps_others_while_a_load_runs) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    enum { NA = 40, NB = 150, GEN = 12 };
    int32_t pa[NA], pb[NB], ref_a[GEN], ref_b[GEN];
    random_prompt(pa, NA, test_seed + 7, in.n_vocab);
    random_prompt(pb, NB, test_seed + 8, in.n_vocab);
    srun r = srun_default();
    const int32_t *pp[2] = {pa, pb};
    const int lens[2] = {NA, NB};
    if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, ref_a, NULL, NULL)) return 1;
    if (srun_go(m, tiny_path, &r, 1, pp + 1, lens + 1, GEN, ref_b, NULL, NULL)) return 1;
    /* B's K/V computed once, in a cache of the engine's geometry */
    kvc_engine_params ep = srun_engine_params(&r);
    kvc_cache_params cp = kvc_model_cache_params(m, KVC_F16, 512);
    cp.page_size = 16;
    kvc_cache *ref = NULL;
    ASSERT_OK(kvc_cache_create(&cp, &ref));
    kvc_model_ctx *ctx = NULL;
    ASSERT_OK(kvc_model_ctx_create(m, 1, &ctx));
    kvc_seq_id sr;
    int64_t hit, pos0 = 0, n = NB;
    ASSERT_OK(kvc_cache_add_sequence(ref, pb, NB, 0, &sr, &hit));
    float *lg = malloc((size_t)in.n_vocab * sizeof(float));
    ASSERT_OK(kvc_model_forward(ctx, ref, 1, &sr, &pos0, &n, NULL, pb, NULL, lg));
    int32_t ref_pages[16], indptr[2], last;
    int64_t np;
    ASSERT_OK(kvc_cache_page_table(ref, &sr, 1, indptr, ref_pages, 16, &last, &np));
    fake_conn f = {ref, ref_pages, pb, NB, 9, 6, 0, 0, 0, 0, 0, 0, 0};
    kvc_engine_connector c;
    memset(&c, 0, sizeof c);
    c.user = &f;
    c.probe = fc_probe;
    c.load_start = fc_start;
    c.load_poll = fc_poll;
    c.load_finish = fc_finish;
    kvc_engine *e = NULL;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    ASSERT_OK(kvc_engine_set_connector(e, &c));
    int64_t ida, idb;
    ASSERT_OK(kvc_engine_add_request(e, pb, NB, GEN, NULL, 1, &idb)); /* B first in the queue */
    ASSERT_OK(kvc_engine_add_request(e, pa, NA, GEN, NULL, 1, &ida));
    int32_t oa[GEN], ob[GEN];
    int ga = 0, gb = 0, steps = 0, a_while_loading = 0;
    while (kvc_engine_pending(e) > 0) {
        kvc_engine_event ev[2];
        int64_t ne = 0;
        const int loading = f.started == 1 && f.finished == 0;
        ASSERT_OK(kvc_engine_step(e, ev, 2, &ne));
        ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
        steps++;
        for (int64_t i = 0; i < ne; i++) {
            if (ev[i].request_id == ida) oa[ga++] = ev[i].token, a_while_loading += loading;
            else ob[gb++] = ev[i].token;
        }
    }
    ASSERT_EQ_I64(ga, GEN);
    ASSERT_EQ_I64(gb, GEN);
    ASSERT_MEM_EQ(oa, ref_a, sizeof oa);
    ASSERT_MEM_EQ(ob, ref_b, sizeof ob); /* from the loaded pages */
    ASSERT_EQ_I64(f.started, 1);
    ASSERT_EQ_I64(f.finished, 1);
    ASSERT_EQ_I64(f.applied_pages, 9); /* 144 of 150 tokens */
    ASSERT_TRUE(a_while_loading >= 3); /* A generated while B's load ran */
    kvc_engine_stats es;
    ASSERT_OK(kvc_engine_get_stats(e, &es));
    ASSERT_EQ_I64(es.external_tokens, 144);
    ASSERT_EQ_I64(es.prefill_tokens, NA + NB - 144);
    /* with nothing else to do, a step waits for the load */
    f.polls_left = 1000000;
    f.started = f.finished = f.applied_pages = f.waits = 0;
    kvc_engine_destroy(e);
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    ASSERT_OK(kvc_engine_set_connector(e, &c));
    ASSERT_OK(kvc_engine_add_request(e, pb, NB, 2, NULL, 1, &idb));
    kvc_engine_event ev[2];
    int64_t ne = 0;
    ASSERT_OK(kvc_engine_step(e, ev, 2, &ne));
    ASSERT_EQ_I64(f.waits, 1);
    ASSERT_EQ_I64(ne, 1); /* admitted after the wait, in the same step: its first token */
    ASSERT_EQ_I64(ev[0].token, ref_b[0]);
    kvc_engine_destroy(e);
    /* a cancelled or destroyed engine's loads are released unused */
    f.polls_left = 1000000;
    f.started = f.finished = f.applied_pages = 0;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    ASSERT_OK(kvc_engine_set_connector(e, &c));
    ASSERT_OK(kvc_engine_add_request(e, pb, NB, 2, NULL, 1, &idb));
    ASSERT_OK(kvc_engine_add_request(e, pa, NA, 2, NULL, 1, &ida));
    ASSERT_OK(kvc_engine_step(e, ev, 2, &ne)); /* B loads, A runs */
    ASSERT_EQ_I64(f.started, 1);
    ASSERT_OK(kvc_engine_cancel(e, idb));
    ASSERT_EQ_I64(f.finished, 1);
    ASSERT_OK(kvc_engine_add_request(e, pb, NB, 2, NULL, 1, &idb));
    ASSERT_OK(kvc_engine_step(e, ev, 2, &ne));
    ASSERT_EQ_I64(f.started, 2);
    kvc_engine_destroy(e);
    ASSERT_EQ_I64(f.finished, 2);
    ASSERT_EQ_I64(f.applied_pages, 0);
    /* two queued requests with B's prompt: one load; the second waits for
     * it and takes the loaded pages as a prefix hit */
    f.polls_left = 6;
    f.started = f.finished = f.applied_pages = 0;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    ASSERT_OK(kvc_engine_set_connector(e, &c));
    int64_t idb2;
    ASSERT_OK(kvc_engine_add_request(e, pb, NB, GEN, NULL, 1, &idb));
    ASSERT_OK(kvc_engine_add_request(e, pb, NB, GEN, NULL, 1, &idb2));
    ASSERT_OK(kvc_engine_add_request(e, pa, NA, GEN, NULL, 1, &ida));
    int32_t ob2[GEN];
    int gb2 = 0;
    ga = gb = 0;
    while (kvc_engine_pending(e) > 0) {
        kvc_engine_event ev3[3];
        ASSERT_OK(kvc_engine_step(e, ev3, 3, &ne));
        ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
        ASSERT_TRUE(f.started <= 1);
        for (int64_t i = 0; i < ne; i++) {
            if (ev3[i].request_id == ida) oa[ga++] = ev3[i].token;
            else if (ev3[i].request_id == idb) ob[gb++] = ev3[i].token;
            else ob2[gb2++] = ev3[i].token;
        }
    }
    ASSERT_EQ_I64(ga, GEN);
    ASSERT_EQ_I64(gb, GEN);
    ASSERT_EQ_I64(gb2, GEN);
    ASSERT_MEM_EQ(oa, ref_a, sizeof oa);
    ASSERT_MEM_EQ(ob, ref_b, sizeof ob);
    ASSERT_MEM_EQ(ob2, ref_b, sizeof ob2);
    ASSERT_EQ_I64(f.started, 1);
    ASSERT_EQ_I64(f.applied_pages, 9);
    ASSERT_OK(kvc_engine_get_stats(e, &es));
    ASSERT_EQ_I64(es.external_tokens, 144);
    ASSERT_EQ_I64(es.cached_tokens, 144); /* the second B's prefix hit */
    ASSERT_EQ_I64(es.prefill_tokens, NA + 2 * (NB - 144));
    kvc_engine_destroy(e);
    ASSERT_EQ_I64(f.finished, 1);
    free(lg);
    kvc_model_ctx_destroy(ctx);
    kvc_cache_destroy(ref);
    kvc_model_destroy(m);
    return 0;
}

/* The store's object buffers (objpool.c): reuse of about the same size,
 * newest first, the byte bound, and a NULL pool as malloc/free. */
TEST(objpool_reuses_within_its_bound) {
    kvc__objpool *p = kvc__objpool_create(1000);
    ASSERT_TRUE(p != NULL);
    int n;
    size_t bytes;
    unsigned char *a = kvc__objpool_get(p, 400), *b = kvc__objpool_get(p, 400);
    ASSERT_TRUE(a && b);
    memset(a, 1, 400), memset(b, 2, 400);
    kvc__objpool_put(p, a, 400);
    kvc__objpool_put(p, b, 400);
    kvc__objpool_held(p, &n, &bytes);
    ASSERT_EQ_I64(n, 2);
    ASSERT_EQ_I64(bytes, 800);
    unsigned char *c = kvc__objpool_get(p, 360); /* within 1/8: the newest, b */
    ASSERT_TRUE(c == b);
    unsigned char *d = kvc__objpool_get(p, 200); /* a is too large for it */
    ASSERT_TRUE(d != NULL && d != a);
    memset(d, 3, 200);
    kvc__objpool_held(p, &n, &bytes);
    ASSERT_EQ_I64(n, 1);
    ASSERT_EQ_I64(bytes, 400);
    kvc__objpool_put(p, c, 400);
    kvc__objpool_put(p, d, 200); /* 1,000 bytes */
    unsigned char *e = malloc(1);
    ASSERT_TRUE(e != NULL);
    kvc__objpool_put(p, e, 1); /* past the bound: freed */
    kvc__objpool_held(p, &n, &bytes);
    ASSERT_EQ_I64(n, 3);
    ASSERT_EQ_I64(bytes, 1000);
    free(kvc__objpool_get(p, 400)); /* a pool buffer is a malloc block */
    kvc__objpool_put(p, NULL, 10);
    kvc__objpool_destroy(p); /* frees the two still held */
    void *f = kvc__objpool_get(NULL, 0);
    ASSERT_TRUE(f != NULL);
    kvc__objpool_put(NULL, f, 0);
    kvc__objpool_held(NULL, &n, &bytes);
    ASSERT_EQ_I64(n, 0);
    kvc__objpool_destroy(NULL);
    kvc_store_params sp = kvc_store_default_params();
    sp.object_pool_bytes = -1;
    static char sentinel;
    kvc_store *s = (kvc_store *)&sentinel; /* a failed open sets it to NULL (core.h) */
    ASSERT_STATUS(kvc_store_open(NULL, 0, &sp, &s), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "object_pool_bytes");
    ASSERT_TRUE(s == NULL);
    kvc_store_close(NULL); /* a no-op (store.h) */
    return 0;
}

TEST(hash_variants_agree) {
    uint64_t rng = test_seed;
    unsigned char *buf = malloc(1 << 20);
    for (int i = 0; i < (1 << 20); i++) buf[i] = (unsigned char)test_rng_next(&rng);
    if (!test_isa_usable(KVC_ISA_AVX2)) {
        free(buf);
        return 0;
    }
    for (int t = 0; t < 200; t++) {
        const size_t na = (size_t)(test_rng_next(&rng) % 5000),
                     nb = (size_t)(test_rng_next(&rng) % 400000);
        kvc_store_key a, b;
        kvc__store_hash128_base(buf, na, buf + 5000, nb, &a);
        kvc__store_hash128_avx2(buf, na, buf + 5000, nb, &b);
        ASSERT_MEM_EQ(a.b, b.b, 16);
    }
    free(buf);
    return 0;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The highest nice value among this process's threads (Linux: per thread). */
static int max_thread_nice(void) {
    int best = -100;
    DIR *d = opendir("/proc/self/task");
    if (!d) return best;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char path[300], buf[1024];
        snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        const size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        /* fields after "(comm)": state is field 3, nice field 19 */
        const char *p = strrchr(buf, ')');
        int field = 2, nice = 0;
        for (; p && *p; p++)
            if (*p == ' ' && ++field == 19) {
                nice = atoi(p + 1);
                break;
            }
        if (field == 19 && nice > best) best = nice;
    }
    closedir(d);
    return best;
}

/* The writer thread runs at the lowest priority by default (the engine's
 * threads keep the CPUs); writer_nice 0 keeps the caller's. */
TEST(writer_thread_yields_the_cpus) {
#if !defined(__linux__)
    SKIP("per-thread nice values are Linux's");
#else
    char dir[] = "/tmp/kvc_store_XXXXXX", url[64];
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(url, sizeof url, "dir:%s", dir);
    const char *u = url;
    const int base = max_thread_nice();
    ASSERT_TRUE(base > -100 && base < 19);
    kvc_store *s = NULL;
    ASSERT_OK(kvc_store_open(&u, 1, NULL, &s));
    /* the writer sets its priority as it starts: wait for it */
    int seen = base;
    for (int i = 0; i < 1000 && seen != 19; i++) {
        seen = max_thread_nice();
        if (seen != 19) sleep_ms(1);
    }
    ASSERT_EQ_I64(seen, 19);
    kvc_store_close(s);
    kvc_store_params p = kvc_store_default_params();
    p.writer_nice = 0;
    ASSERT_OK(kvc_store_open(&u, 1, &p, &s));
    ASSERT_OK(kvc_store_flush(s, 5.0)); /* the writer has started and waits */
    sleep_ms(20);
    ASSERT_EQ_I64(max_thread_nice(), base);
    kvc_store_close(s);
    p.writer_nice = -1;
    ASSERT_EQ_I64(kvc_store_open(&u, 1, &p, &s), KVC_ERR_INVALID_ARG);
    p.writer_nice = 40;
    ASSERT_EQ_I64(kvc_store_open(&u, 1, &p, &s), KVC_ERR_INVALID_ARG);
    rm_rf(dir);
    return 0;
#endif
}

/* The engine-cache pages a store's events named: STORED adds, REMOVED drops. */
typedef struct gpu_set {
    kvc_store_key keys[256];
    int n, stored, removed, bad; /* bad: a removal of a key not in the set */
} gpu_set;

static void gpu_set_event(void *user, const kvc_store_event *ev) {
    gpu_set *g = user;
    if (ev->tier != KVC_STORE_TIER_CACHE) return;
    int at = -1;
    for (int i = 0; i < g->n && at < 0; i++)
        if (!memcmp(&g->keys[i], &ev->key, sizeof ev->key)) at = i;
    if (ev->kind == KVC_STORE_EVENT_STORED) {
        g->stored++;
        if (at < 0 && g->n < 256) g->keys[g->n++] = ev->key;
    } else if (ev->kind == KVC_STORE_EVENT_REMOVED) {
        g->removed++;
        if (at < 0) g->bad++;
        else g->keys[at] = g->keys[--g->n];
    }
}

static int serve_one(kvc_engine *e, const int32_t *prompt, int n) {
    int64_t id;
    ASSERT_OK(kvc_engine_add_request(e, prompt, n, 4, NULL, 1, &id));
    while (kvc_engine_pending(e) > 0) {
        kvc_engine_event ev[4];
        int64_t ne = 0;
        ASSERT_OK(kvc_engine_step(e, ev, 4, &ne));
    }
    return 0;
}

TEST(detach_reports_the_cache_gone) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    enum { N = 100 };
    int32_t prompt[N];
    random_prompt(prompt, N, test_seed + 7, in.n_vocab);
    srun r = srun_default();
    kvc_engine_params ep = srun_engine_params(&r);
    kvc_engine *e = NULL, *e2 = NULL;
    kvc_store *s = NULL, *s1 = NULL;
    kvc_store_key ns;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    ASSERT_OK(srun_ns(m, tiny_path, &r, &ns));
    ASSERT_OK(kvc_store_open(NULL, 0, NULL, &s)); /* no tiers: events only */
    ASSERT_OK(kvc_store_open(NULL, 0, NULL, &s1));
    gpu_set g;
    memset(&g, 0, sizeof g);
    ASSERT_OK(kvc_store_set_event_callback(s, gpu_set_event, &g));

    ASSERT_OK(kvc_store_attach_engine(s, e, &ns));
    if (serve_one(e, prompt, N)) return 1;
    ASSERT_EQ_I64(g.stored, N / 16); /* the full pages of the prompt */
    ASSERT_EQ_I64(g.n, N / 16);
    kvc_engine_connector c;
    ASSERT_OK(kvc_engine_get_connector(e, &c));
    ASSERT_TRUE(c.user != NULL && c.probe != NULL);
    ASSERT_OK(kvc_store_detach_engine(s, e));
    ASSERT_EQ_I64(g.n, 0); /* every page it reported, reported gone */
    ASSERT_EQ_I64(g.removed, N / 16);
    ASSERT_EQ_I64(g.bad, 0);
    ASSERT_OK(kvc_engine_get_connector(e, &c));
    ASSERT_TRUE(c.user == NULL && c.probe == NULL && c.on_final == NULL);
    ASSERT_STATUS(kvc_store_detach_engine(s, e), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "not attached");
    ASSERT_STATUS(kvc_store_detach_engine(NULL, e), KVC_ERR_INVALID_ARG);
    prompt[0] ^= 1; /* a new prompt: the engine serves it, the store hears nothing */
    if (serve_one(e, prompt, N)) return 1;
    ASSERT_EQ_I64(g.stored, N / 16);

    /* attached again while attached: the first attachment's pages are gone */
    ASSERT_OK(kvc_store_attach_engine(s, e, &ns));
    prompt[0] ^= 2;
    if (serve_one(e, prompt, N)) return 1;
    ASSERT_EQ_I64(g.n, N / 16);
    ASSERT_OK(kvc_store_attach_engine(s, e, &ns));
    ASSERT_EQ_I64(g.n, 0);
    ASSERT_EQ_I64(g.bad, 0);
    ASSERT_OK(kvc_store_detach_engine(s, e));
    ASSERT_STATUS(kvc_store_detach_engine(s, e), KVC_ERR_INVALID_ARG);

    /* detaching from a store the engine has left keeps the newer connector */
    ASSERT_OK(kvc_store_attach_engine(s, e, &ns));
    ASSERT_OK(kvc_store_attach_engine(s1, e, &ns));
    ASSERT_OK(kvc_store_detach_engine(s, e));
    ASSERT_OK(kvc_engine_get_connector(e, &c));
    ASSERT_TRUE(c.user != NULL && c.probe != NULL);
    ASSERT_OK(kvc_store_detach_engine(s1, e));
    ASSERT_OK(kvc_engine_get_connector(e, &c));
    ASSERT_TRUE(c.user == NULL);

    /* a refused attach lists nothing */
    ep.enable_prefix_caching = 0;
    ASSERT_OK(kvc_engine_create(m, &ep, &e2));
    ASSERT_STATUS(kvc_store_attach_engine(s, e2, &ns), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_store_detach_engine(s, e2), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_engine_get_connector(NULL, &c), KVC_ERR_INVALID_ARG);

    kvc_engine_destroy(e2);
    kvc_engine_destroy(e);
    kvc_store_close(s1);
    kvc_store_close(s);
    kvc_model_destroy(m);
    return 0;
}

/* 0 when the cache events say of the prompt's pages [0, n_pages) what the
 * cache holds: one STORED more than REMOVED for a page it holds (its prefix
 * findable), as many of each for one it does not. Unless exact, a page the
 * cache holds may also have no event at all (the events of pages recorded
 * while out of memory are lost, never wrong). */
static int events_match_cache(const cache_evs *ce, const kvc_cache *cache, const int32_t *prompt,
                              int64_t n_tok, const kvc_store_key *keys, int n_pages, int exact,
                              const char *when) {
    int64_t hit = 0;
    ASSERT_OK(kvc_cache_lookup_prefix(cache, prompt, n_tok, 0, &hit));
    for (int k = 0; k < n_pages; k++) {
        const int i = cache_ev_find(ce, &keys[k]);
        const int have = i < 0 ? 0 : ce->stored[i] - ce->removed[i];
        const int want = hit >= (int64_t)(k + 1) * 16;
        if (have != want && (exact || have != 0))
            TEST_FAIL_("%s: page %d: %d stored, %d removed events; the cache %s it", when, k,
                       i < 0 ? 0 : ce->stored[i], i < 0 ? 0 : ce->removed[i],
                       want ? "holds" : "does not hold");
    }
    return 0;
}

/* An in-line restore (here stopping at a corrupted page) whose admission
 * then fails (any one allocation of the step failing) rolls its pages back
 * out of the cache, and the events must say so: a router must never count
 * on pages the cache no longer holds. */
TEST(rolled_back_restores_report_their_pages_gone) {
    if (!test_oom_available()) SKIP("allocation failures need the linker's --wrap");
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    enum { N = 100, GEN = 2, NP = N / 16 };
    int32_t prompt[N], ref[GEN];
    random_prompt(prompt, N, test_seed + 31, in.n_vocab);
    const int32_t *pp[1] = {prompt};
    const int lens[1] = {N};
    char dir[] = "/tmp/kvc_store_XXXXXX", url[64], file[256];
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(url, sizeof url, "dir:%s", dir);
    srun r = srun_default();
    r.url = url;
    if (srun_go(m, tiny_path, &r, 1, pp, lens, GEN, ref, NULL, NULL)) return 1;
    kvc_store_key ns, keys[NP];
    ASSERT_OK(srun_ns(m, tiny_path, &r, &ns));
    ASSERT_OK(kvc_store_page_keys(&ns, prompt, NP, 16, 1, keys));
    page_file(dir, &ns, prompt, 3, file, sizeof file);
    ASSERT_OK(corrupt_file(file, 0) == 0 ? KVC_OK : KVC_ERR_IO); /* pages 0-2 restored */
    int failed_restores = 0;
    for (long k = 1;; k++) {
        kvc_engine_params ep = srun_engine_params(&r);
        ep.n_threads = 1; /* the step's allocations in one order */
        kvc_engine *e = NULL;
        kvc_store *s = NULL;
        ASSERT_OK(kvc_engine_create(m, &ep, &e));
        const char *urls[1] = {url};
        kvc_store_params sp = kvc_store_default_params();
        /* no writes: the corrupted page stays, and one thread allocates */
        sp.write_policy = KVC_STORE_WRITE_SELECTIVE;
        sp.selective_hits = 1000;
        ASSERT_OK(kvc_store_open(urls, 1, &sp, &s));
        cache_evs ce;
        memset(&ce, 0, sizeof ce);
        ASSERT_OK(kvc_store_set_event_callback(s, cache_ev_cb, &ce));
        ASSERT_OK(kvc_store_attach_engine(s, e, &ns));
        int64_t id;
        ASSERT_OK(kvc_engine_add_request(e, prompt, N, GEN, NULL, 1, &id));
        kvc_engine_event ev[1];
        int64_t ne = 0;
        test_oom_arm(k, 0);
        const kvc_status st = kvc_engine_step(e, ev, 1, &ne);
        const long failed = test_oom_disarm();
        kvc_clear_error();
        ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
        char when[64];
        snprintf(when, sizeof when, "allocation %ld failed (step: %s)", k, kvc_status_str(st));
        if (events_match_cache(&ce, kvc_engine_cache(e), prompt, N, keys, NP, !failed, when))
            return 1;
        const int i0 = cache_ev_find(&ce, &keys[0]);
        if (i0 >= 0 && ce.removed[i0] > 0) { /* restored, then rolled back */
            failed_restores++;
            printf("  allocation %ld: restore rolled back (step: %s)\n", k, kvc_status_str(st));
        }
        int32_t out[GEN];
        int got = st == KVC_OK && ne == 1 ? 1 : 0;
        if (got) out[0] = ev[0].token;
        while (kvc_engine_pending(e) > 0) {
            ASSERT_OK(kvc_engine_step(e, ev, 1, &ne));
            if (ne == 1) out[got++] = ev[0].token;
        }
        ASSERT_EQ_I64(got, GEN);
        ASSERT_MEM_EQ(out, ref, sizeof ref);
        if (events_match_cache(&ce, kvc_engine_cache(e), prompt, N, keys, NP, !failed,
                               "at the end"))
            return 1;
        ASSERT_OK(kvc_store_detach_engine(s, e));
        kvc_engine_destroy(e);
        kvc_store_close(s);
        if (failed == 0) break; /* the step made fewer than k allocations */
    }
    ASSERT_TRUE(failed_restores > 0); /* some failure undid a restore */
    rm_rf(dir);
    kvc_model_destroy(m);
    return 0;
}

/* flush without a limit: an infinite or huge timeout waits for the writes
 * (its deadline once overflowed time_t: pthread_cond_timedwait failed at
 * once and flush spun forever holding the lock the writer needed); NaN is
 * refused. */
/* writes_done and writes_failed count objects, once each however many
 * tiers an object goes to: an object two of three tiers refuse (over their
 * max_bytes) is one failed write, and bytes_written sums the tiers' bytes.
 * (Before: writes_failed counted each refusing tier, 2 here, against
 * writes_done's 1 per object.) */
TEST(write_stats_count_objects_once) {
    char dir[] = "/tmp/kvc_store_XXXXXX", u[3][96];
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(u[0], sizeof u[0], "dir:%s/a?max_bytes=1K", dir);
    snprintf(u[1], sizeof u[1], "dir:%s/b?max_bytes=1K", dir);
    snprintf(u[2], sizeof u[2], "dir:%s/c", dir);
    const char *urls[3] = {u[0], u[1], u[2]};
    kvc_store *s = NULL;
    ASSERT_OK(kvc_store_open(urls, 3, NULL, &s));
    unsigned char big[2048], small[100];
    memset(big, 1, sizeof big);
    memset(small, 2, sizeof small);
    kvc_store_key ns, k1, k2;
    memset(&ns, 3, sizeof ns);
    memset(&k1, 4, sizeof k1);
    memset(&k2, 5, sizeof k2);
    ASSERT_OK(kvc_store_put(s, &ns, &k1, big, sizeof big)); /* only c takes it */
    ASSERT_OK(kvc_store_put(s, &ns, &k2, small, sizeof small));
    ASSERT_OK(kvc_store_flush(s, 30.0));
    kvc_store_stats st;
    ASSERT_OK(kvc_store_get_stats(s, &st));
    ASSERT_EQ_I64(st.writes_queued, 2);
    ASSERT_EQ_I64(st.writes_done, 2);
    ASSERT_EQ_I64(st.writes_failed, 1);
    ASSERT_EQ_I64(st.bytes_written, (int64_t)sizeof big + 3 * (int64_t)sizeof small);
    kvc_store_close(s);
    rm_rf(dir);
    return 0;
}

TEST(flush_without_a_limit) {
    char dir[] = "/tmp/kvc_store_XXXXXX", url[64];
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(url, sizeof url, "dir:%s", dir);
    const char *u = url;
    kvc_store *s = NULL;
    ASSERT_OK(kvc_store_open(&u, 1, NULL, &s));
    enum { N = 24, SZ = 256 * 1024 };
    unsigned char *obj = malloc(SZ);
    ASSERT_TRUE(obj != NULL);
    memset(obj, 0x5a, SZ);
    kvc_store_key ns, key;
    memset(&ns, 7, sizeof ns);
    const double limits[2] = {INFINITY, 1e300};
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < N; i++) {
            memset(&key, 0, sizeof key);
            key.b[0] = (uint8_t)round, key.b[1] = (uint8_t)i;
            ASSERT_OK(kvc_store_put(s, &ns, &key, obj, SZ));
        }
        ASSERT_OK(kvc_store_flush(s, limits[round]));
        kvc_store_stats st;
        ASSERT_OK(kvc_store_get_stats(s, &st));
        ASSERT_EQ_I64(st.writes_done, (round + 1) * N);
        ASSERT_EQ_I64(st.writes_failed, 0);
    }
    ASSERT_STATUS(kvc_store_flush(s, NAN), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "NaN");
    free(obj);
    kvc_store_close(s);
    rm_rf(dir);
    return 0;
}

/* A failed kvc_store_open leaves nothing behind: the directories it made
 * for earlier dir: tiers are removed when a later URL fails (a bad URL, an
 * unusable directory), nested ones included; a directory that existed
 * stays with its files. kvc_store_abandon undoes an open the same way
 * (the CLI's, when --kv-events cannot bind). */
static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

TEST(failed_open_removes_what_it_created) {
    char base[] = "/tmp/kvc_store_XXXXXX", a[128], ab[128], old[128], file[160], tmp[160],
         ua[160], uab[160], uold[160], ufile[200];
    ASSERT_TRUE(mkdtemp(base) != NULL);
    snprintf(a, sizeof a, "%s/a", base);
    snprintf(ab, sizeof ab, "%s/a/b", base);
    snprintf(old, sizeof old, "%s/old", base);
    snprintf(file, sizeof file, "%s/old/mine", base);
    ASSERT_TRUE(mkdir(old, 0755) == 0);
    FILE *f = fopen(file, "w");
    ASSERT_TRUE(f != NULL);
    fputs("x", f);
    fclose(f);
    snprintf(ua, sizeof ua, "dir:%s", a);
    snprintf(uab, sizeof uab, "dir:%s?max_bytes=1M", ab);
    snprintf(uold, sizeof uold, "dir:%s", old);
    snprintf(ufile, sizeof ufile, "dir:%s/sub", file); /* under a file: cannot be made */
    const char *bad_last[][4] = {
        {ua, uab, uold, "nope://x"},         /* an unknown scheme */
        {ua, uab, uold, "dir:/k?write=x"},   /* a bad write policy */
        {ua, uab, uold, ufile},              /* a directory that cannot be made */
        {uold, ua, uab, "dir:/k?max_bytes=0"}, /* a dir tier's own option */
    };
    for (int c = 0; c < 4; c++) {
        kvc_store *s = (kvc_store *)1;
        kvc_status st = kvc_store_open(bad_last[c], 4, NULL, &s);
        if (st >= 0) TEST_FAIL_("case %d: open succeeded", c);
        ASSERT_TRUE(s == NULL);
        if (is_dir(a) || is_dir(ab)) TEST_FAIL_("case %d: %s left behind", c, a);
        snprintf(tmp, sizeof tmp, "%s/tmp", old);
        if (is_dir(tmp)) TEST_FAIL_("case %d: %s left behind", c, tmp);
        ASSERT_TRUE(is_dir(old) && access(file, F_OK) == 0); /* existed: kept */
    }
    /* the open's own tmp/ in a directory that existed goes, the rest stays */
    const char *two[2] = {uold, ua};
    kvc_store *s = NULL;
    ASSERT_OK(kvc_store_open(two, 2, NULL, &s));
    ASSERT_TRUE(is_dir(tmp) && is_dir(a));
    kvc_store_abandon(s);
    ASSERT_TRUE(!is_dir(tmp) && !is_dir(a) && access(file, F_OK) == 0);
    /* anything written keeps its directory: abandon removes only empty ones */
    ASSERT_OK(kvc_store_open(&two[1], 1, NULL, &s));
    kvc_store_key ns = key_of(1), key = key_of(2);
    ASSERT_OK(kvc_store_put(s, &ns, &key, "object", 6));
    ASSERT_OK(kvc_store_flush(s, -1));
    kvc_store_abandon(s);
    ASSERT_TRUE(is_dir(a));
    kvc_store_abandon(NULL);
    rm_rf(base);
    return 0;
}

/* A page whose file cannot be read (a directory where it belongs) cuts the
 * restored run there: the pages before it in the same batch are restored,
 * the tier call does not fail, and a later tier continues from that page. */
TEST(unreadable_page_is_a_miss_of_its_own) {
    char base[] = "/tmp/kvc_store_XXXXXX", d1[64], d2[64], u1[80], u2[80], p[256];
    ASSERT_TRUE(mkdtemp(base) != NULL);
    snprintf(d1, sizeof d1, "%s/one", base);
    snprintf(d2, sizeof d2, "%s/two", base);
    snprintf(u1, sizeof u1, "dir:%s", d1);
    snprintf(u2, sizeof u2, "dir:%s", d2);
    enum { P = 16, N = 8 };
    kvc_cache *src = make_cache(KVC_F16, KVC_KVFMT_NONE, P, N),
              *dst = make_cache(KVC_F16, KVC_KVFMT_NONE, P, N);
    ASSERT_TRUE(src && dst);
    int32_t ids[N], dids[N], tok[N * P];
    kvc_seq_id sq, dq;
    ASSERT_EQ_I64(fill_seq(src, N * P, 100, 7, ids, N, &sq), N);
    ASSERT_EQ_I64(fill_seq(dst, N * P, 100, 99, dids, N, &dq), N);
    for (int i = 0; i < N * P; i++) tok[i] = 100 + i;
    const kvc_store_key ns = key_of(11);
    kvc_store_key keys[N];
    ASSERT_OK(kvc_store_page_keys(&ns, tok, N, P, 1, keys));
    const size_t pb = kvc_cache_page_bytes(src);
    unsigned char *a = malloc(pb), *b = malloc(pb);
    for (int round = 0; round < 2; round++) { /* one tier, then a second behind it */
        const char *urls[2] = {u1, u2};
        kvc_store_params sp = kvc_store_default_params();
        sp.promote = 0; /* no write to tier 0 (and its failure) while counting */
        kvc_store *s = NULL;
        ASSERT_OK(kvc_store_open(urls, 1 + round, &sp, &s));
        ASSERT_OK(kvc_store_save_run(s, src, &ns, tok, 0, N, ids));
        ASSERT_OK(kvc_store_flush(s, -1));
        char nh[33], kh[33];
        kvc__store_key_hex(&ns, nh);
        kvc__store_key_hex(&keys[3], kh);
        snprintf(p, sizeof p, "%s/%s/%.2s/%s.kvp", d1, nh, kh, kh);
        ASSERT_TRUE((unlink(p) == 0 || round == 1) && (mkdir(p, 0755) == 0 || round == 1));
        kvc_store_stats s0, st; /* the restore's share (tier 0 refused page 3's write) */
        ASSERT_OK(kvc_store_get_stats(s, &s0));
        int64_t n = -1;
        ASSERT_OK(kvc_store_restore_run(s, dst, &ns, tok, 0, N, dids, &n));
        ASSERT_OK(kvc_store_get_stats(s, &st));
        ASSERT_EQ_I64(st.errors - s0.errors, 0);
        ASSERT_EQ_I64(n, round == 0 ? 3 : N);
        ASSERT_EQ_I64(st.hit_pages - s0.hit_pages, n);
        for (int pg = 0; pg < n; pg++) {
            ASSERT_OK(kvc_cache_read_page(src, ids[pg], a, pb));
            ASSERT_OK(kvc_cache_read_page(dst, dids[pg], b, pb));
            ASSERT_MEM_EQ(a, b, pb);
        }
        if (round == 0) { /* past the cut: untouched */
            ASSERT_OK(kvc_cache_read_page(src, ids[3], a, pb));
            ASSERT_OK(kvc_cache_read_page(dst, dids[3], b, pb));
            ASSERT_TRUE(memcmp(a, b, pb) != 0);
        }
        kvc_store_close(s);
    }
    free(a), free(b);
    kvc_cache_destroy(src);
    kvc_cache_destroy(dst);
    rm_rf(base);
    return 0;
}

/* Attaching an engine again when an allocation fails leaves the first
 * attachment in place: the engine keeps its connector and can be detached.
 * (A failed listing of the new attachment used to unlist the old one
 * instead, which the engine still called: detach then failed, "not
 * attached".) */
TEST(failed_reattach_keeps_the_attachment) {
    if (!test_oom_available()) SKIP("allocation failures need the linker's --wrap");
    NEED_TINY(m);
    kvc_engine_params ep = kvc_engine_default_params();
    ep.enable_prefix_caching = 1;
    kvc_store_key ns = key_of(21);
    int failures = 0;
    for (long k = 1;; k++) {
        kvc_engine *e = NULL;
        kvc_store *s = NULL;
        ASSERT_OK(kvc_engine_create(m, &ep, &e));
        ASSERT_OK(kvc_store_open(NULL, 0, NULL, &s));
        ASSERT_OK(kvc_store_attach_engine(s, e, &ns));
        kvc_engine_connector before, after;
        ASSERT_OK(kvc_engine_get_connector(e, &before));
        test_oom_arm(k, 0);
        const kvc_status st = kvc_store_attach_engine(s, e, &ns);
        const long failed = test_oom_disarm();
        ASSERT_OK(kvc_engine_get_connector(e, &after));
        if (st != KVC_OK) {
            failures++;
            if (!failed) TEST_FAIL_("attach failed (%s) with no allocation failed",
                                    kvc_last_error());
            if (after.user != before.user) TEST_FAIL_("allocation %ld: connector changed", k);
        }
        kvc_clear_error();
        const kvc_status dt = kvc_store_detach_engine(s, e);
        if (dt != KVC_OK) TEST_FAIL_("allocation %ld failed: detach: %s", k, kvc_last_error());
        kvc_engine_destroy(e);
        kvc_store_close(s);
        if (failed == 0) break;
    }
    ASSERT_TRUE(failures > 0);
    kvc_model_destroy(m);
    return 0;
}

/* kvc_store_save_run queues the whole run or nothing: a page that cannot be
 * serialized, a queue too small for the run, or an allocation that fails
 * leaves the queue and the tier as they were (the writes counted dropped).
 * (It used to queue the pages before the failing one and return the error.) */
TEST(failed_save_run_queues_nothing) {
    char dir[] = "/tmp/kvc_store_XXXXXX", url[64];
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(url, sizeof url, "dir:%s", dir);
    const char *u = url;
    enum { P = 16, N = 8 };
    kvc_cache *c = make_cache(KVC_F16, KVC_KVFMT_NONE, P, N);
    ASSERT_TRUE(c != NULL);
    int32_t ids[N], bad[N], tok[N * P];
    kvc_seq_id sq;
    ASSERT_EQ_I64(fill_seq(c, N * P, 100, 7, ids, N, &sq), N);
    for (int i = 0; i < N * P; i++) tok[i] = 100 + i;
    memcpy(bad, ids, sizeof bad);
    bad[5] = N; /* no such page: the sixth page cannot be serialized */
    const kvc_store_key ns = key_of(12);
    kvc_store_params sp = kvc_store_default_params();
    sp.object_pool_bytes = 0; /* every object buffer a fresh allocation (the OOM loop) */
    kvc_store *s = NULL;
    kvc_store_stats st;
    ASSERT_OK(kvc_store_open(&u, 1, &sp, &s));
    ASSERT_STATUS(kvc_store_save_run(s, c, &ns, tok, 0, N, bad), KVC_ERR_INVALID_ARG);
    ASSERT_OK(kvc_store_flush(s, -1));
    ASSERT_OK(kvc_store_get_stats(s, &st));
    ASSERT_EQ_I64(st.writes_queued, 0);
    ASSERT_EQ_I64(st.writes_dropped, N);
    ASSERT_EQ_I64(count_objects(dir), 0);
    kvc_store_close(s);
    /* a queue of 3 objects cannot take a run of 8, even while it drains */
    sp.queue_objects = 3;
    ASSERT_OK(kvc_store_open(&u, 1, &sp, &s));
    ASSERT_STATUS(kvc_store_save_run(s, c, &ns, tok, 0, N, ids), KVC_ERR_NO_SPACE);
    ASSERT_STR_CONTAINS(kvc_last_error(), "nothing queued");
    ASSERT_OK(kvc_store_flush(s, -1));
    ASSERT_OK(kvc_store_get_stats(s, &st));
    ASSERT_EQ_I64(st.writes_queued, 0);
    ASSERT_EQ_I64(st.writes_dropped, N);
    ASSERT_EQ_I64(count_objects(dir), 0);
    kvc_store_close(s);
    /* every allocation of the call failed in turn: all queued, or none */
    sp.queue_objects = 4096;
    ASSERT_OK(kvc_store_open(&u, 1, &sp, &s));
    if (test_oom_available()) {
        int failures = 0;
        for (long k = 1;; k++) {
            kvc_store_stats s0;
            ASSERT_OK(kvc_store_flush(s, -1)); /* the writer idle: its allocations not counted */
            ASSERT_OK(kvc_store_get_stats(s, &s0));
            test_oom_arm(k, 0);
            const kvc_status r = kvc_store_save_run(s, c, &ns, tok, 0, N, ids);
            const long failed = test_oom_disarm();
            ASSERT_OK(kvc_store_flush(s, -1));
            ASSERT_OK(kvc_store_get_stats(s, &st));
            if (r == KVC_OK) {
                ASSERT_EQ_I64(st.writes_queued - s0.writes_queued, N);
                ASSERT_EQ_I64(st.writes_dropped - s0.writes_dropped, 0);
            } else {
                failures++;
                ASSERT_EQ_I64(r, KVC_ERR_NOMEM);
                ASSERT_EQ_I64(st.writes_queued - s0.writes_queued, 0);
                ASSERT_EQ_I64(st.writes_dropped - s0.writes_dropped, N);
                kvc_clear_error();
            }
            if (failed == 0) break;
        }
        ASSERT_TRUE(failures > N); /* at least each page's buffer */
    } else {
        ASSERT_OK(kvc_store_save_run(s, c, &ns, tok, 0, N, ids));
    }
    ASSERT_OK(kvc_store_flush(s, -1));
    ASSERT_EQ_I64(count_objects(dir), N);
    kvc_store_close(s);
    kvc_cache_destroy(c);
    rm_rf(dir);
    return 0;
}

/* A background load's pages count as hits when they are written into the
 * cache (kvc__store_load_finish), not when they are read: pages the engine
 * drops (a request cancelled, pages its prefix cache gained meanwhile) are
 * misses. (Every verified page used to count as a hit when read.) */
TEST(load_hits_count_pages_restored) {
    char dir[] = "/tmp/kvc_store_XXXXXX", url[64];
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(url, sizeof url, "dir:%s", dir);
    const char *u = url;
    enum { P = 16, N = 8 };
    kvc_cache *src = make_cache(KVC_F16, KVC_KVFMT_NONE, P, N),
              *dst = make_cache(KVC_F16, KVC_KVFMT_NONE, P, N);
    ASSERT_TRUE(src && dst);
    int32_t ids[N], dids[N], tok[N * P];
    kvc_seq_id sq, dq;
    ASSERT_EQ_I64(fill_seq(src, N * P, 100, 7, ids, N, &sq), N);
    ASSERT_EQ_I64(fill_seq(dst, N * P, 100, 99, dids, N, &dq), N);
    for (int i = 0; i < N * P; i++) tok[i] = 100 + i;
    const kvc_store_key ns = key_of(13);
    kvc_store *s = NULL;
    ASSERT_OK(kvc_store_open(&u, 1, NULL, &s));
    ASSERT_OK(kvc_store_save_run(s, src, &ns, tok, 0, 6, ids)); /* pages 6, 7: absent */
    ASSERT_OK(kvc_store_flush(s, -1));
    kvc_store_stats st;
    /* read, then dropped unused (the request left) */
    kvc__store_load *l = kvc__store_load_start(s, dst, &ns, tok, 0, N);
    ASSERT_TRUE(l != NULL);
    int64_t ready = -1;
    ASSERT_TRUE(kvc__store_load_poll(l, 1, &ready));
    ASSERT_EQ_I64(ready, 6);
    ASSERT_OK(kvc_store_get_stats(s, &st));
    ASSERT_EQ_I64(st.hit_pages, 0); /* read, not restored yet */
    ASSERT_TRUE(st.bytes_read > 0);
    kvc__store_load_finish(l, NULL, 0, NULL, 0);
    ASSERT_OK(kvc_store_get_stats(s, &st));
    ASSERT_EQ_I64(st.hit_pages, 0);
    ASSERT_EQ_I64(st.miss_pages, N);
    ASSERT_EQ_I64(st.misses[KVC_STORE_MISS_ABSENT], N);
    /* read, then 3 of the 6 written (2 in the prefix cache by then, the
     * sixth past the pages reserved) */
    l = kvc__store_load_start(s, dst, &ns, tok, 0, N);
    ASSERT_TRUE(l != NULL);
    ASSERT_TRUE(kvc__store_load_poll(l, 1, &ready));
    kvc__store_load_finish(l, dst, 2, dids + 2, 3);
    ASSERT_OK(kvc_store_get_stats(s, &st));
    ASSERT_EQ_I64(st.hit_pages, 3);
    ASSERT_EQ_I64(st.miss_pages, 2 * N - 3);
    ASSERT_EQ_I64(st.misses[KVC_STORE_MISS_ABSENT], 2 * N - 3);
    ASSERT_EQ_I64(st.verify_failures, 0);
    const size_t pb = kvc_cache_page_bytes(src);
    unsigned char *a = malloc(pb), *b = malloc(pb);
    for (int pg = 0; pg < N; pg++) { /* pages 2..4 restored, the others untouched */
        ASSERT_OK(kvc_cache_read_page(src, ids[pg], a, pb));
        ASSERT_OK(kvc_cache_read_page(dst, dids[pg], b, pb));
        ASSERT_TRUE((memcmp(a, b, pb) == 0) == (pg >= 2 && pg < 5));
    }
    free(a), free(b);
    kvc_store_close(s);
    kvc_cache_destroy(src);
    kvc_cache_destroy(dst);
    rm_rf(dir);
    return 0;
}

/* One store, two engines stepped on two threads at once (store.h: the
 * handle is safe to share). Each runs the same prompts (the other thread's
 * in reverse order), so one engine's background loads and in-line restores
 * read what the other's writer just wrote, while the main thread reads the
 * stats and events flow through one callback. Run under ThreadSanitizer by
 * .ci/run (c_store). */
enum { SH_PROMPTS = 4, SH_N = 100, SH_GEN = 4 };
typedef struct share_ctx {
    const kvc_model *m;
    kvc_store *s;
    kvc_store_key ns;
    kvc_engine_params ep;
    const int32_t *prompts[SH_PROMPTS];
    int reverse;
    int32_t out[SH_PROMPTS * SH_GEN];
    int failed;
    char why[160];
} share_ctx;

static int share_run(share_ctx *c) {
    kvc_engine *e = NULL;
    ASSERT_OK(kvc_engine_create(c->m, &c->ep, &e));
    ASSERT_OK(kvc_store_attach_engine(c->s, e, &c->ns));
    int64_t ids[SH_PROMPTS];
    for (int k = 0; k < SH_PROMPTS; k++) { /* all queued: later ones load while others run */
        const int p = c->reverse ? SH_PROMPTS - 1 - k : k;
        ASSERT_OK(kvc_engine_add_request(e, c->prompts[p], SH_N, SH_GEN, NULL, 1, &ids[p]));
    }
    int got[SH_PROMPTS] = {0};
    while (kvc_engine_pending(e) > 0) {
        kvc_engine_event ev[8];
        int64_t ne = 0;
        ASSERT_OK(kvc_engine_step(e, ev, 8, &ne));
        ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
        for (int64_t i = 0; i < ne; i++)
            for (int p = 0; p < SH_PROMPTS; p++)
                if (ev[i].request_id == ids[p]) c->out[p * SH_GEN + got[p]++] = ev[i].token;
    }
    for (int p = 0; p < SH_PROMPTS; p++) ASSERT_EQ_I64(got[p], SH_GEN);
    ASSERT_OK(kvc_store_detach_engine(c->s, e));
    kvc_engine_destroy(e);
    return 0;
}

static void *share_thread(void *arg) {
    share_ctx *c = arg;
    c->failed = share_run(c);
    if (c->failed) snprintf(c->why, sizeof c->why, "%s", kvc_last_error());
    return NULL;
}

static int64_t share_events;
static void share_count(void *user, const kvc_store_event *ev) {
    (void)user, (void)ev;
    share_events++; /* calls are serialized (store.h) */
}

TEST(engines_on_two_threads_share_one_store) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    int32_t pr[SH_PROMPTS][SH_N], ref[SH_PROMPTS * SH_GEN];
    const int32_t *pp[SH_PROMPTS];
    int lens[SH_PROMPTS];
    for (int p = 0; p < SH_PROMPTS; p++) {
        random_prompt(pr[p], SH_N, test_seed + 40 + (uint64_t)p, in.n_vocab);
        /* a shared first page: the engines' keys chain from the same parents */
        if (p > 0) memcpy(pr[p], pr[0], 16 * sizeof(int32_t));
        pp[p] = pr[p];
        lens[p] = SH_N;
    }
    srun r = srun_default();
    if (srun_go(m, tiny_path, &r, SH_PROMPTS, pp, lens, SH_GEN, ref, NULL, NULL)) return 1;
    char dir[] = "/tmp/kvc_store_XXXXXX", url[64];
    ASSERT_TRUE(mkdtemp(dir) != NULL);
    snprintf(url, sizeof url, "dir:%s", dir);
    const char *u = url;
    kvc_store *s = NULL;
    ASSERT_OK(kvc_store_open(&u, 1, NULL, &s));
    ASSERT_OK(kvc_store_set_event_callback(s, share_count, NULL));
    share_events = 0;
    share_ctx c[2];
    memset(c, 0, sizeof c);
    for (int k = 0; k < 2; k++) {
        c[k].m = m;
        c[k].s = s;
        c[k].ep = srun_engine_params(&r);
        c[k].ep.n_threads = 1;
        c[k].reverse = k;
        memcpy(c[k].prompts, pp, sizeof pp);
        ASSERT_OK(srun_ns(m, tiny_path, &r, &c[k].ns));
    }
    for (int round = 0; round < 2; round++) { /* an empty store, then a full one */
        pthread_t th[2];
        for (int k = 0; k < 2; k++) ASSERT_TRUE(pthread_create(&th[k], NULL, share_thread, &c[k]) == 0);
        kvc_store_stats st;
        for (int i = 0; i < 50; i++) ASSERT_OK(kvc_store_get_stats(s, &st));
        for (int k = 0; k < 2; k++) pthread_join(th[k], NULL);
        for (int k = 0; k < 2; k++) {
            if (c[k].failed) TEST_FAIL_("engine %d, round %d: %s", k, round, c[k].why);
            ASSERT_MEM_EQ(c[k].out, ref, sizeof ref);
        }
        ASSERT_OK(kvc_store_flush(s, -1));
        ASSERT_OK(kvc_store_get_stats(s, &st));
        ASSERT_EQ_I64(st.writes_done, st.writes_queued);
        ASSERT_EQ_I64(st.verify_failures, 0);
        if (round == 1) ASSERT_TRUE(st.hit_pages > 0);
    }
    ASSERT_TRUE(share_events > 0);
    kvc_store_close(s);
    rm_rf(dir);
    kvc_model_destroy(m);
    return 0;
}

const char *test_suite_name = "store";
const test_case test_suite[] = {
    TEST_ENTRY(page_keys_match_independent_xxh3),
    TEST_ENTRY(namespace_separates_everything_it_names),
    TEST_ENTRY(objects_round_trip_every_storage),
    TEST_ENTRY(every_refusal_is_counted_by_its_reason_and_writes_nothing),
    TEST_ENTRY(object_layout_is_the_documented_one),
    TEST_ENTRY(authenticated_objects),
    TEST_ENTRY(cache_page_io_rules),
    TEST_ENTRY(engine_restores_prompts_from_a_directory_exactly),
    TEST_ENTRY(restored_kv_bytes_equal_recomputed),
    TEST_ENTRY(engine_survives_every_corruption_of_the_directory),
    TEST_ENTRY(write_policies_and_a_full_queue),
    TEST_ENTRY(partly_shared_groups_keep_their_own_pages),
    TEST_ENTRY(engine_steps_others_while_a_load_runs),
    TEST_ENTRY(detach_reports_the_cache_gone),
    TEST_ENTRY(rolled_back_restores_report_their_pages_gone),
    TEST_ENTRY(objpool_reuses_within_its_bound),
    TEST_ENTRY(write_stats_count_objects_once),
    TEST_ENTRY(flush_without_a_limit),
    TEST_ENTRY(failed_open_removes_what_it_created),
    TEST_ENTRY(unreadable_page_is_a_miss_of_its_own),
    TEST_ENTRY(failed_reattach_keeps_the_attachment),
    TEST_ENTRY(hash_variants_agree),
    TEST_ENTRY(writer_thread_yields_the_cpus),
    TEST_ENTRY(write_policies_per_tier),
    TEST_ENTRY(restored_pages_are_promoted_to_earlier_tiers),
    TEST_ENTRY(restored_pages_are_reported_in_the_cache_events),
    TEST_ENTRY(failed_save_run_queues_nothing),
    TEST_ENTRY(load_hits_count_pages_restored),
    TEST_ENTRY(engines_on_two_threads_share_one_store),
    {0, 0},
};
