/*
 * Cache manager (include/kvcache/cache.h): a randomized run of add / append /
 * fork / truncate / free against a plain model of each sequence, with
 * kvc_cache_check after every step and the K/V of every sequence read back
 * through its page table (values derived from the token prefix, so cached
 * prefix pages must hold exactly those tokens' K/V); exact hit lengths and
 * eviction order; copy-on-write of data and scales (NHD/HND, int8/int4);
 * out-of-pages and out-of-memory failures (every allocation site) leaving
 * everything unchanged; unknown ids and bad parameters; every mutating call
 * failing on each of its allocations (test_oom.h) or on its arguments in
 * representative states, leaving every observable byte unchanged.
 */
#include <stdlib.h>

#include "test.h"
#include "test_oom.h"
#include "cache/cache_internal.h" /* kvc__cache_set_hash_mask */

/* ---- helpers ------------------------------------------------------------------------------- */

static kvc_cache_params small_params(int32_t ps, int64_t pages) {
    kvc_cache_params p = kvc_cache_default_params();
    p.num_layers = 2;
    p.num_kv_heads = 1;
    p.head_dim = 2;
    p.page_size = ps;
    p.num_pages = pages;
    p.dtype = KVC_F32;
    return p;
}

/* Element offset of (page, kv, slot, head, 0) in a combined 5-D layer tensor. */
static int64_t slot_off(const kvc_tensor *t, kvc_kv_layout lay, int64_t page, int kv,
                        int64_t slot, int64_t h) {
    if (lay == KVC_NHD)
        return page * t->stride[0] + kv * t->stride[1] + slot * t->stride[2] + h * t->stride[3];
    return page * t->stride[0] + kv * t->stride[1] + h * t->stride[2] + slot * t->stride[3];
}

/* Page id holding position t of seq (via the CSR page table). */
static int32_t page_of(kvc_cache *c, kvc_seq_id s, int64_t t, int32_t ps) {
    int32_t indptr[2], idx[4096], last;
    int64_t n;
    if (kvc_cache_page_table(c, &s, 1, indptr, idx, 4096, &last, &n) != KVC_OK) return -1;
    return idx[t / ps];
}

static uint64_t mixv(uint64_t h, int32_t tok) {
    uint64_t z = h ^ ((uint64_t)(uint32_t)tok * 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
    return z ^ (z >> 29);
}

/* ---- a counting allocator that can fail the N-th call ---------------------------------------- */

typedef struct counting {
    int64_t calls, fail_at, live;
} counting;

static void *c_alloc(size_t size, size_t align, void *user) {
    counting *k = user;
    k->calls++;
    if (k->fail_at && k->calls == k->fail_at) return NULL;
    size = (size + align - 1) / align * align;
    void *p = aligned_alloc(align, size);
    if (p) k->live++;
    return p;
}
static void c_free(void *p, void *user) {
    counting *k = user;
    if (p) k->live--;
    free(p);
}

/* ---- parameters -------------------------------------------------------------------------------- */

TEST(params) {
    kvc_cache *c = NULL;
    kvc_cache_params p = small_params(4, 8);
    ASSERT_STATUS(kvc_cache_create(NULL, &c), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_create(&p, NULL), KVC_ERR_INVALID_ARG);
    kvc_cache_params b = p;
    b.num_layers = 0;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.num_kv_heads = 0;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.head_dim = 0;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.page_size = 0;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.num_pages = -1;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.num_pages = 0; b.max_bytes = 0;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.num_pages = 0; b.max_bytes = 10; /* less than a page */
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.dtype = KVC_I32;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.layout = (kvc_kv_layout)2;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.dtype = KVC_I8; b.quant_group = 3;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.dtype = KVC_I4; b.quant_group = 1;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.dtype = KVC_I8; b.scale_dtype = KVC_BF16;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.enable_prefix_caching = 2;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b = p; b.num_pages = (int64_t)1 << 40;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    /* the largest shapes allowed, where a token's bytes times page_size
     * would overflow int64 (a wrapped 0 once divided max_bytes: SIGFPE) */
    b = p; b.num_layers = 1 << 20; b.num_kv_heads = 1 << 15; b.head_dim = 1 << 15;
    b.page_size = 1 << 30; b.dtype = KVC_F32; b.num_pages = 0; b.max_bytes = 1000;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b.max_bytes = INT64_MAX;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b.num_pages = 1; /* one page of 2^30 tokens x 2^33 bytes x 2^20 layers */
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    b.num_layers = 1;
    ASSERT_STATUS(kvc_cache_create(&b, &c), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(c == NULL);

    /* sizes: f16, 3 layers, H 2, Dh 8: 3 * 2 * 2 * 8 * 2 bytes per token */
    b = kvc_cache_default_params();
    b.num_layers = 3; b.num_kv_heads = 2; b.head_dim = 8; b.page_size = 16;
    b.num_pages = 0; b.max_bytes = 192 * 16 * 10 + 100;
    ASSERT_OK(kvc_cache_create(&b, &c));
    ASSERT_EQ_I64(kvc_cache_bytes_per_token(c), 192);
    ASSERT_EQ_I64(kvc_cache_num_pages(c), 10);
    ASSERT_EQ_I64(kvc_cache_capacity_tokens(c), 160);
    for (int l = 0; l < 3; l++) {
        kvc_tensor kv, sc;
        ASSERT_OK(kvc_cache_layer_tensors(c, l, &kv, &sc));
        ASSERT_EQ_I64(((uintptr_t)kv.data) % 64, 0);
        ASSERT_EQ_I64(kv.ndim, 5);
        ASSERT_EQ_I64(kv.shape[0], 10);
        ASSERT_EQ_I64(kv.shape[1], 2);
        kvc_paged_cache pc;
        ASSERT_OK(kvc_cache_layer(c, l, &pc));
        ASSERT_EQ_I64(pc.k.shape[1], 16);
    }
    kvc_tensor kv;
    ASSERT_STATUS(kvc_cache_layer_tensors(c, 3, &kv, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_layer_tensors(c, -1, &kv, NULL), KVC_ERR_INVALID_ARG);
    kvc_cache_destroy(c);
    /* int4, HND, f32 scales: data 2*H*Dh/2, scales 2*H*(Dh/qg)*4 per layer */
    b.dtype = KVC_I4; b.layout = KVC_HND; b.scale_dtype = KVC_F32; b.quant_group = 4;
    b.num_pages = 5;
    ASSERT_OK(kvc_cache_create(&b, &c));
    ASSERT_EQ_I64(kvc_cache_bytes_per_token(c), 3 * (2 * 2 * 4 + 2 * 2 * 2 * 4));
    kvc_tensor sc;
    ASSERT_OK(kvc_cache_layer_tensors(c, 1, &kv, &sc));
    ASSERT_EQ_I64(kv.shape[2], 2); /* H before page_size in HND */
    ASSERT_EQ_I64(kv.shape[3], 16);
    ASSERT_EQ_I64(sc.shape[4], 2);
    ASSERT_EQ_I64(((uintptr_t)sc.data) % 64, 0);
    kvc_cache_destroy(c);
    kvc_cache_destroy(NULL);
    return 0;
}

TEST(bad_args_and_unknown_ids) {
    kvc_cache *c;
    kvc_cache_params p = small_params(4, 8);
    ASSERT_OK(kvc_cache_create(&p, &c));
    int32_t toks[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    kvc_seq_id s, t;
    int64_t hit, n;
    ASSERT_STATUS(kvc_cache_add_sequence(c, toks, -1, 0, &s, &hit), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_add_sequence(c, toks, 8, 0, NULL, &hit), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_add_sequence(c, toks, 33, 0, &s, &hit), KVC_ERR_INVALID_ARG);
    ASSERT_OK(kvc_cache_add_sequence(c, toks, 5, 0, &s, &hit));
    ASSERT_STATUS(kvc_cache_append(c, s, toks, -1, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_append(c, s, toks, 28, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_truncate(c, s, 6), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_truncate(c, s, -1), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_fork(c, s, NULL), KVC_ERR_INVALID_ARG);
    int32_t indptr[3], idx[8], last[2];
    kvc_seq_id two[2] = {s, s};
    ASSERT_STATUS(kvc_cache_page_table(c, two, 2, indptr, idx, 3, last, &n), KVC_ERR_INVALID_ARG);
    ASSERT_EQ_I64(n, 4); /* tells the size it needs */
    int64_t cs[2];
    ASSERT_STATUS(kvc_cache_cachestarts(c, &s, 1, cs, 1), KVC_ERR_INVALID_ARG);
    /* 4 x 2^62 wrapped to 0, which let a NULL cachestarts through */
    kvc_seq_id four[4] = {s, s, s, s};
    ASSERT_STATUS(kvc_cache_cachestarts(c, four, 4, NULL, (int64_t)1 << 62), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_cachestarts(c, &s, 1, NULL, 4), KVC_ERR_INVALID_ARG);
    /* unknown and freed ids */
    kvc_seq_id bad[3] = {s + 1, -1, 12345};
    for (int i = 0; i < 3; i++) {
        ASSERT_STATUS(kvc_cache_append(c, bad[i], toks, 1, NULL), KVC_ERR_NOT_FOUND);
        ASSERT_STATUS(kvc_cache_fork(c, bad[i], &t), KVC_ERR_NOT_FOUND);
        ASSERT_STATUS(kvc_cache_truncate(c, bad[i], 0), KVC_ERR_NOT_FOUND);
        ASSERT_STATUS(kvc_cache_free_sequence(c, bad[i]), KVC_ERR_NOT_FOUND);
        ASSERT_STATUS(kvc_cache_seq_len(c, bad[i], &n), KVC_ERR_NOT_FOUND);
        ASSERT_STATUS(kvc_cache_page_table(c, &bad[i], 1, indptr, idx, 8, last, &n),
                      KVC_ERR_NOT_FOUND);
        ASSERT_STATUS(kvc_cache_cachestarts(c, &bad[i], 1, cs, 2), KVC_ERR_NOT_FOUND);
    }
    ASSERT_OK(kvc_cache_free_sequence(c, s));
    ASSERT_STATUS(kvc_cache_free_sequence(c, s), KVC_ERR_NOT_FOUND);
    ASSERT_STATUS(kvc_cache_append(c, s, toks, 1, NULL), KVC_ERR_NOT_FOUND);
    ASSERT_STATUS(kvc_cache_seq_len(c, s, &n), KVC_ERR_NOT_FOUND);
    /* ids are never reused */
    ASSERT_OK(kvc_cache_add_sequence(c, toks, 1, 0, &t, NULL));
    ASSERT_TRUE(t > s);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

/* ---- tables, positions ------------------------------------------------------------------------ */

TEST(page_tables) {
    kvc_cache *c;
    kvc_cache_params p = small_params(4, 16);
    p.enable_prefix_caching = 0;
    ASSERT_OK(kvc_cache_create(&p, &c));
    kvc_seq_id a, b, e;
    int64_t hit = -1;
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 6, 0, &a, &hit));
    ASSERT_EQ_I64(hit, 0);
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 0, 0, &e, &hit));
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 8, 0, &b, &hit));
    int32_t pos[8];
    ASSERT_OK(kvc_cache_append(c, a, NULL, 3, pos)); /* 6 -> 9: one new page */
    ASSERT_EQ_I64(pos[0], 6);
    ASSERT_EQ_I64(pos[2], 8);
    kvc_cache_stats st;
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.used_pages, 5);
    kvc_seq_id q[3] = {a, e, b};
    int32_t indptr[4], idx[16], last[3];
    int64_t n;
    ASSERT_OK(kvc_cache_page_table(c, q, 3, indptr, idx, 16, last, &n));
    ASSERT_EQ_I64(n, 5);
    ASSERT_EQ_I64(indptr[1], 3);
    ASSERT_EQ_I64(indptr[2], 3);
    ASSERT_EQ_I64(indptr[3], 5);
    ASSERT_EQ_I64(last[0], 1);
    ASSERT_EQ_I64(last[1], 0);
    ASSERT_EQ_I64(last[2], 4);
    int64_t cs[3 * 4];
    ASSERT_OK(kvc_cache_cachestarts(c, q, 3, cs, 4));
    for (int j = 0; j < 3; j++) ASSERT_EQ_I64(cs[j], (int64_t)idx[j] * 4);
    ASSERT_EQ_I64(cs[3], -1);
    ASSERT_EQ_I64(cs[4], -1);
    ASSERT_EQ_I64(cs[8], (int64_t)idx[3] * 4);
    ASSERT_EQ_I64(cs[11], -1);
    /* the same table passes the paged-cache validator */
    kvc_tensor ti = kvc_tensor_make(indptr, KVC_I32, 1, (int64_t[]){4});
    kvc_tensor tx = kvc_tensor_make(idx, KVC_I32, 1, (int64_t[]){5});
    kvc_tensor tl = kvc_tensor_make(last, KVC_I32, 1, (int64_t[]){3});
    ASSERT_OK(kvc_page_table_check(&ti, &tx, &tl, 4, 16));
    /* without prefix caching nothing is cached after free */
    ASSERT_OK(kvc_cache_free_sequence(c, b));
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.cached_pages, 0);
    ASSERT_EQ_I64(st.free_pages, 13);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

/* An output laid over seqs (core.h: overlap gives an undefined result, but
 * nothing read or written out of bounds): the lookups read seqs again after
 * writing, and found a freed id (a NULL sequence) or a longer one. Buffers
 * are exactly sized on the heap, so a sanitizer or valgrind sees any stray
 * access; the old code crashed on the NULL. */
TEST(page_tables_over_their_seqs) {
    kvc_cache *c;
    kvc_cache_params p = small_params(4, 32);
    p.enable_prefix_caching = 0;
    ASSERT_OK(kvc_cache_create(&p, &c));
    kvc_seq_id s[4];
    for (int i = 0; i < 4; i++) ASSERT_OK(kvc_cache_add_sequence(c, NULL, 1 + 9 * i, 0, &s[i], NULL));
    const int64_t total = 1 + 3 + 5 + 7;
    /* cachestarts over seqs: row 0 turns seqs[1..3] into page starts and -1s */
    int64_t *cs = malloc(4 * 8 * sizeof(int64_t));
    ASSERT_TRUE(cs != NULL);
    for (int i = 0; i < 4; i++) cs[i] = s[3 - i];
    ASSERT_OK(kvc_cache_cachestarts(c, cs, 4, cs, 8));
    free(cs);
    /* kv_indices (int32) over seqs (int64), capacity exactly the total */
    int64_t *buf = malloc((size_t)total * sizeof(int32_t));
    int32_t *indptr = malloc(5 * sizeof(int32_t)), *last = malloc(4 * sizeof(int32_t));
    ASSERT_TRUE(buf && indptr && last);
    for (int i = 0; i < 4; i++) buf[i] = s[3 - i];
    int64_t n = -1;
    ASSERT_OK(kvc_cache_page_table(c, buf, 4, indptr, (int32_t *)buf, total, last, &n));
    ASSERT_EQ_I64(n, total);
    ASSERT_TRUE(indptr[4] <= total);
    /* kv_indptr over seqs */
    int32_t *idx = malloc((size_t)total * sizeof(int32_t));
    ASSERT_TRUE(idx != NULL);
    for (int i = 0; i < 4; i++) buf[i] = s[i];
    ASSERT_OK(kvc_cache_page_table(c, buf, 4, (int32_t *)buf, idx, total, last, &n));
    free(idx);
    free(buf);
    free(indptr);
    free(last);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    /* kvc_cache_kvfmt_seqs: out over seqs */
    kvc_cache_params q = small_params(16, 8);
    q.num_kv_heads = 1;
    q.head_dim = 64;
    q.kv_format = KVC_KVFMT_KIVI8;
    ASSERT_OK(kvc_cache_create(&q, &c));
    kvc_seq_id t[2];
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 3, 0, &t[0], NULL));
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 20, 0, &t[1], NULL));
    kvc_kvfmt_seq *out = malloc(2 * sizeof *out);
    ASSERT_TRUE(out != NULL);
    memcpy(out, t, sizeof t); /* seqs in out[0]'s bytes */
    ASSERT_OK(kvc_cache_kvfmt_seqs(c, 0, (const kvc_seq_id *)out, 2, out));
    free(out);
    kvc_cache_destroy(c);
    return 0;
}

/* ---- prefix hits -------------------------------------------------------------------------------- */

TEST(prefix_hits) {
    kvc_cache *c;
    kvc_cache_params p = small_params(4, 32);
    ASSERT_OK(kvc_cache_create(&p, &c));
    int32_t P[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    kvc_seq_id a, s;
    int64_t hit;
    ASSERT_OK(kvc_cache_add_sequence(c, P, 10, 0, &a, &hit));
    ASSERT_EQ_I64(hit, 0);
    ASSERT_OK(kvc_cache_add_sequence(c, P, 10, 0, &s, &hit));
    ASSERT_EQ_I64(hit, 8); /* two full pages, not the partial one */
    ASSERT_EQ_I64(page_of(c, s, 0, 4), page_of(c, a, 0, 4));
    ASSERT_EQ_I64(page_of(c, s, 5, 4), page_of(c, a, 5, 4));
    ASSERT_TRUE(page_of(c, s, 9, 4) != page_of(c, a, 9, 4));
    ASSERT_OK(kvc_cache_add_sequence(c, P, 8, 0, &s, &hit));
    ASSERT_EQ_I64(hit, 4); /* never the whole prompt */
    ASSERT_OK(kvc_cache_add_sequence(c, P, 9, 0, &s, &hit));
    ASSERT_EQ_I64(hit, 8);
    ASSERT_OK(kvc_cache_add_sequence(c, P, 4, 0, &s, &hit));
    ASSERT_EQ_I64(hit, 0);
    ASSERT_OK(kvc_cache_add_sequence(c, P, 10, 7, &s, &hit));
    ASSERT_EQ_I64(hit, 0); /* other salt */
    ASSERT_OK(kvc_cache_add_sequence(c, P, 10, 7, &s, &hit));
    ASSERT_EQ_I64(hit, 8);
    int32_t Q[10] = {1, 2, 3, 4, 5, 99, 7, 8, 9, 10};
    ASSERT_OK(kvc_cache_add_sequence(c, Q, 10, 0, &s, &hit));
    ASSERT_EQ_I64(hit, 4);
    int32_t R[10] = {2, 2, 3, 4, 5, 6, 7, 8, 9, 10}; /* same second page, other parent */
    ASSERT_OK(kvc_cache_add_sequence(c, R, 10, 0, &s, &hit));
    ASSERT_EQ_I64(hit, 0);
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 10, 0, &s, &hit)); /* no ids: no lookup */
    ASSERT_EQ_I64(hit, 0);
    kvc_cache_stats st;
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.hit_tokens, 8 + 4 + 8 + 8 + 4);
    ASSERT_EQ_I64(st.hit_tokens + st.miss_tokens, 10 + 10 + 8 + 9 + 4 + 10 + 10 + 10 + 10 + 10);
    /* pages filled by append become findable; append without ids stops that */
    kvc_seq_id b;
    ASSERT_OK(kvc_cache_add_sequence(c, P, 2, 3, &b, &hit));
    ASSERT_OK(kvc_cache_append(c, b, P + 2, 3, NULL)); /* page 0 full */
    ASSERT_OK(kvc_cache_append(c, b, P + 5, 3, NULL)); /* page 1 full */
    ASSERT_OK(kvc_cache_append(c, b, NULL, 4, NULL));  /* page 2 unknown */
    ASSERT_OK(kvc_cache_append(c, b, P, 4, NULL));     /* still unknown */
    int32_t P2[17] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4, 0};
    ASSERT_OK(kvc_cache_add_sequence(c, P2, 17, 3, &s, &hit));
    ASSERT_EQ_I64(hit, 8);
    /* truncating back below the unknown page makes it hashable again */
    ASSERT_OK(kvc_cache_truncate(c, b, 8));
    ASSERT_OK(kvc_cache_free_sequence(c, s));
    ASSERT_OK(kvc_cache_append(c, b, P + 8, 4, NULL));
    int32_t P3[13] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 50};
    ASSERT_OK(kvc_cache_add_sequence(c, P3, 13, 3, &s, &hit));
    ASSERT_EQ_I64(hit, 12);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

/* kvc_cache_lookup_prefix predicts add_sequence's hit and changes nothing. */
TEST(lookup_prefix_matches_add) {
    kvc_cache *c;
    kvc_cache_params p = small_params(4, 24);
    ASSERT_OK(kvc_cache_create(&p, &c));
    uint64_t rng = test_seed;
    int32_t base[40];
    for (int i = 0; i < 40; i++) base[i] = (int32_t)(test_rng_next(&rng) % 5);
    kvc_seq_id live[64];
    int n_live = 0;
    for (int it = 0; it < 300; it++) {
        int32_t t[40];
        const int n = 1 + (int)(test_rng_next(&rng) % 40);
        const int keep = (int)(test_rng_next(&rng) % (n + 1)); /* shared prefix length */
        for (int i = 0; i < n; i++) t[i] = i < keep ? base[i] : (int32_t)(test_rng_next(&rng) % 5);
        const uint64_t salt = test_rng_next(&rng) % 2;
        kvc_cache_stats before, after;
        ASSERT_OK(kvc_cache_get_stats(c, &before));
        int64_t probe = -1, hit = -1;
        ASSERT_OK(kvc_cache_lookup_prefix(c, t, n, salt, &probe));
        ASSERT_OK(kvc_cache_get_stats(c, &after));
        ASSERT_MEM_EQ(&before, &after, sizeof before);
        ASSERT_TRUE(probe % 4 == 0 && probe < n);
        kvc_seq_id s;
        kvc_status st = kvc_cache_add_sequence(c, t, n, salt, &s, &hit);
        if (st == KVC_ERR_NO_SPACE || n_live == 64) {
            if (st == KVC_OK) kvc_cache_free_sequence(c, s);
            while (n_live > 0) ASSERT_OK(kvc_cache_free_sequence(c, live[--n_live]));
            continue;
        }
        ASSERT_OK(st);
        ASSERT_EQ_I64(hit, probe);
        live[n_live++] = s;
        if (test_rng_next(&rng) % 3 == 0) ASSERT_OK(kvc_cache_free_sequence(c, live[--n_live]));
        ASSERT_OK(kvc_cache_check(c));
    }
    int64_t h;
    ASSERT_STATUS(kvc_cache_lookup_prefix(NULL, base, 4, 0, &h), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_lookup_prefix(c, NULL, 4, 0, &h), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_lookup_prefix(c, base, -1, 0, &h), KVC_ERR_INVALID_ARG);
    ASSERT_OK(kvc_cache_lookup_prefix(c, NULL, 0, 0, &h));
    ASSERT_EQ_I64(h, 0);
    kvc_cache_destroy(c);
    return 0;
}

/* ---- eviction order -------------------------------------------------------------------------- */

TEST(eviction_order) {
    kvc_cache *c;
    kvc_cache_params p = small_params(2, 8);
    ASSERT_OK(kvc_cache_create(&p, &c));
    int32_t A[7] = {1, 2, 3, 4, 5, 6, 7}, B[5] = {9, 8, 7, 6, 5}, X[16];
    for (int i = 0; i < 16; i++) X[i] = 100 + i;
    kvc_seq_id a, b, x, y;
    int64_t hit;
    ASSERT_OK(kvc_cache_add_sequence(c, A, 7, 0, &a, &hit)); /* 3 full + 1 partial */
    ASSERT_OK(kvc_cache_add_sequence(c, B, 5, 0, &b, &hit)); /* 2 full + 1 partial */
    int32_t pa[4], pb[3];
    for (int j = 0; j < 4; j++) pa[j] = page_of(c, a, 2 * j, 2);
    for (int j = 0; j < 3; j++) pb[j] = page_of(c, b, 2 * j, 2);
    ASSERT_OK(kvc_cache_free_sequence(c, a)); /* LRU: a2 a1 a0 */
    ASSERT_OK(kvc_cache_free_sequence(c, b)); /* LRU: a2 a1 a0 b1 b0 */
    kvc_cache_stats st;
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.cached_pages, 5);
    ASSERT_EQ_I64(st.free_pages, 3); /* 1 never used + 2 partial pages */
    /* 4 pages: 3 free ones, then the deepest page of the older sequence */
    ASSERT_OK(kvc_cache_add_sequence(c, X, 8, 0, &x, &hit));
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.evictions, 1);
    ASSERT_EQ_I64(page_of(c, x, 6, 2), pa[2]);
    /* A's prompt now hits its first two pages only, which become recent */
    ASSERT_OK(kvc_cache_add_sequence(c, A, 5, 0, &y, &hit));
    ASSERT_EQ_I64(hit, 4);
    ASSERT_EQ_I64(page_of(c, y, 0, 2), pa[0]);
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.evictions, 2); /* its third page evicted b1 (LRU: a1 a0 gone: b1 b0) */
    ASSERT_EQ_I64(page_of(c, y, 4, 2), pb[1]);
    ASSERT_OK(kvc_cache_free_sequence(c, y)); /* LRU: b0 y1(=a1) y0(=a0); y2 was partial */
    ASSERT_OK(kvc_cache_free_sequence(c, x)); /* ... x3 x2 x1 x0 */
    ASSERT_OK(kvc_cache_check(c));
    /* take pages one by one and see the order: the free page first (y's partial
     * page), then b0, a1, a0, then x's deepest first */
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 0, 0, &y, &hit));
    int32_t seen[8];
    for (int i = 0; i < 8; i++) {
        ASSERT_OK(kvc_cache_append(c, y, NULL, 2, NULL));
        seen[i] = page_of(c, y, 2 * i, 2);
    }
    ASSERT_EQ_I64(seen[1], pb[0]);
    ASSERT_EQ_I64(seen[2], pa[1]);
    ASSERT_EQ_I64(seen[3], pa[0]);
    ASSERT_EQ_I64(seen[4], pa[2]); /* x3 */
    ASSERT_STATUS(kvc_cache_append(c, y, NULL, 1, NULL), KVC_ERR_INVALID_ARG); /* > capacity */
    ASSERT_STATUS(kvc_cache_add_sequence(c, NULL, 1, 0, &x, NULL), KVC_ERR_NO_SPACE);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

/* ---- copy-on-write of data and scales --------------------------------------------------------- */

static int cow_case(kvc_dtype dt, kvc_kv_layout lay) {
    kvc_cache *c;
    kvc_cache_params p = kvc_cache_default_params();
    p.num_layers = 2; p.num_kv_heads = 2; p.head_dim = 8; p.page_size = 4; p.num_pages = 8;
    p.dtype = dt; p.layout = lay; p.quant_group = 4;
    ASSERT_OK(kvc_cache_create(&p, &c));
    int32_t toks[6] = {1, 2, 3, 4, 5, 6};
    kvc_seq_id a, b;
    ASSERT_OK(kvc_cache_add_sequence(c, toks, 6, 0, &a, NULL));
    /* fill the whole storage with a pattern */
    uint64_t rng = 7;
    for (int l = 0; l < 2; l++) {
        kvc_tensor kv, sc;
        ASSERT_OK(kvc_cache_layer_tensors(c, l, &kv, &sc));
        size_t nb = (size_t)(kvc_tensor_numel(&kv) * kvc_dtype_bits(dt) / 8);
        for (size_t i = 0; i < nb; i++) ((unsigned char *)kv.data)[i] = (unsigned char)test_rng_next(&rng);
        if (dt == KVC_I8 || dt == KVC_I4) {
            size_t ns = (size_t)kvc_tensor_numel(&sc) * 2;
            for (size_t i = 0; i < ns; i++) ((unsigned char *)sc.data)[i] = (unsigned char)test_rng_next(&rng);
        }
    }
    ASSERT_OK(kvc_cache_fork(c, a, &b));
    int32_t shared = page_of(c, a, 4, 4);
    ASSERT_EQ_I64(page_of(c, b, 4, 4), shared);
    int32_t t7 = 7;
    ASSERT_OK(kvc_cache_append(c, b, &t7, 1, NULL));
    int32_t mine = page_of(c, b, 4, 4);
    ASSERT_TRUE(mine != shared);
    ASSERT_EQ_I64(page_of(c, a, 4, 4), shared);
    ASSERT_EQ_I64(page_of(c, b, 0, 4), page_of(c, a, 0, 4)); /* full page still shared */
    kvc_cache_stats st;
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.cow_copies, 1);
    for (int l = 0; l < 2; l++) {
        kvc_tensor kv, sc;
        ASSERT_OK(kvc_cache_layer_tensors(c, l, &kv, &sc));
        size_t pb = (size_t)(kv.stride[0] * kvc_dtype_bits(dt) / 8);
        ASSERT_MEM_EQ((char *)kv.data + pb * (size_t)mine, (char *)kv.data + pb * (size_t)shared, pb);
        if (dt == KVC_I8 || dt == KVC_I4) {
            size_t sb = (size_t)sc.stride[0] * 2;
            ASSERT_TRUE(sc.dtype == KVC_F16);
            ASSERT_MEM_EQ((char *)sc.data + sb * (size_t)mine, (char *)sc.data + sb * (size_t)shared, sb);
        }
    }
    /* a's next append writes in place (no longer shared) */
    ASSERT_OK(kvc_cache_append(c, a, &t7, 1, NULL));
    ASSERT_EQ_I64(page_of(c, a, 4, 4), shared);
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.cow_copies, 1);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

TEST(cow_copies_data_and_scales) {
    kvc_dtype dts[4] = {KVC_F16, KVC_BF16, KVC_I8, KVC_I4};
    for (int d = 0; d < 4; d++)
        for (int lay = 0; lay < 2; lay++)
            if (cow_case(dts[d], (kvc_kv_layout)lay)) {
                fprintf(stderr, "  (dtype %s, layout %d)\n", kvc_dtype_name(dts[d]), lay);
                return 1;
            }
    return 0;
}

TEST(truncate_and_cow) {
    kvc_cache *c;
    kvc_cache_params p = small_params(4, 16);
    ASSERT_OK(kvc_cache_create(&p, &c));
    int32_t P[13] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
    int32_t Z[4] = {70, 71, 72, 73};
    kvc_seq_id a, b, s;
    int64_t hit;
    /* unshared: the page becomes partial and leaves the index */
    ASSERT_OK(kvc_cache_add_sequence(c, P, 9, 0, &a, &hit));
    ASSERT_OK(kvc_cache_truncate(c, a, 6));
    ASSERT_OK(kvc_cache_check(c));
    ASSERT_OK(kvc_cache_add_sequence(c, P, 9, 0, &s, &hit));
    ASSERT_EQ_I64(hit, 4);
    ASSERT_OK(kvc_cache_free_sequence(c, s));
    ASSERT_OK(kvc_cache_append(c, a, Z, 2, NULL)); /* refills page 1 with other tokens */
    int32_t PZ[9] = {1, 2, 3, 4, 5, 6, 70, 71, 0};
    ASSERT_OK(kvc_cache_add_sequence(c, PZ, 9, 0, &s, &hit));
    ASSERT_EQ_I64(hit, 8);
    ASSERT_OK(kvc_cache_free_sequence(c, s));
    ASSERT_OK(kvc_cache_free_sequence(c, a));
    /* shared via fork: the truncated side copies on its next append; the full
     * cached page stays intact and findable */
    kvc_cache_stats st0, st;
    ASSERT_OK(kvc_cache_add_sequence(c, P, 9, 0, &a, &hit));
    ASSERT_OK(kvc_cache_fork(c, a, &b));
    ASSERT_OK(kvc_cache_truncate(c, b, 6));
    ASSERT_OK(kvc_cache_check(c));
    ASSERT_OK(kvc_cache_get_stats(c, &st0));
    int32_t shared = page_of(c, a, 4, 4);
    ASSERT_OK(kvc_cache_append(c, b, Z, 3, NULL));
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.cow_copies, st0.cow_copies + 1);
    ASSERT_TRUE(page_of(c, b, 4, 4) != shared);
    ASSERT_EQ_I64(page_of(c, a, 4, 4), shared);
    ASSERT_OK(kvc_cache_add_sequence(c, P, 13, 0, &s, &hit));
    ASSERT_EQ_I64(hit, 8);
    ASSERT_OK(kvc_cache_free_sequence(c, s));
    /* shared via fork, then the other holder goes: the page is in the index and
     * unshared; appending leaves the index instead of copying */
    ASSERT_OK(kvc_cache_truncate(c, b, 5));
    ASSERT_OK(kvc_cache_fork(c, a, &s));
    ASSERT_OK(kvc_cache_truncate(c, s, 7));
    ASSERT_OK(kvc_cache_free_sequence(c, a));
    ASSERT_OK(kvc_cache_check(c));
    ASSERT_OK(kvc_cache_get_stats(c, &st0));
    ASSERT_OK(kvc_cache_append(c, s, Z, 1, NULL));
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.cow_copies, st0.cow_copies);
    ASSERT_EQ_I64(page_of(c, s, 4, 4), shared);
    ASSERT_OK(kvc_cache_check(c));
    kvc_seq_id u;
    ASSERT_OK(kvc_cache_add_sequence(c, P, 13, 0, &u, &hit));
    ASSERT_EQ_I64(hit, 4);
    /* shared via a prefix hit */
    ASSERT_OK(kvc_cache_truncate(c, u, 2));
    ASSERT_OK(kvc_cache_get_stats(c, &st0));
    ASSERT_OK(kvc_cache_append(c, u, Z, 1, NULL));
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.cow_copies, st0.cow_copies + 1);
    ASSERT_OK(kvc_cache_truncate(c, u, 0));
    ASSERT_OK(kvc_cache_seq_len(c, u, &hit));
    ASSERT_EQ_I64(hit, 0);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

/* ---- failures leave everything unchanged -------------------------------------------------------- */

#define SNAP_MAX 64
typedef struct snap {
    kvc_cache_stats st;
    int64_t n;
    int32_t indptr[SNAP_MAX + 1], idx[1024], last[SNAP_MAX];
} snap;

static int take_snap(kvc_cache *c, const kvc_seq_id *ids, int64_t n, snap *s) {
    memset(s, 0, sizeof *s);
    if (kvc_cache_get_stats(c, &s->st) != KVC_OK) return 1;
    s->st.failed_allocs = 0;
    return kvc_cache_page_table(c, ids, n, s->indptr, s->idx, 1024, s->last, &s->n) != KVC_OK;
}

TEST(no_space_changes_nothing) {
    kvc_cache *c;
    kvc_cache_params p = small_params(4, 6);
    ASSERT_OK(kvc_cache_create(&p, &c));
    int32_t P[24];
    for (int i = 0; i < 24; i++) P[i] = i;
    kvc_seq_id ids[3];
    int64_t hit;
    ASSERT_OK(kvc_cache_add_sequence(c, P, 9, 0, &ids[0], &hit)); /* 3 pages */
    ASSERT_OK(kvc_cache_fork(c, ids[0], &ids[1]));
    ASSERT_OK(kvc_cache_add_sequence(c, P + 12, 8, 0, &ids[2], &hit)); /* 2 pages */
    ASSERT_OK(kvc_cache_free_sequence(c, ids[2]));                   /* 2 cached */
    ASSERT_OK(kvc_cache_add_sequence(c, P + 12, 8, 0, &ids[2], &hit)); /* hits 1 */
    ASSERT_EQ_I64(hit, 4); /* its second page duplicates the cached one */
    /* 0 free + 1 cached page left */
    snap a, b;
    ASSERT_TRUE(take_snap(c, ids, 3, &a) == 0);
    kvc_seq_id s;
    ASSERT_STATUS(kvc_cache_add_sequence(c, P, 24, 1, &s, &hit), KVC_ERR_NO_SPACE);
    ASSERT_STATUS(kvc_cache_append(c, ids[0], P, 8, NULL), KVC_ERR_NO_SPACE);
    ASSERT_OK(kvc_cache_append(c, ids[2], P, 4, NULL)); /* evicts the cached page */
    ASSERT_TRUE(take_snap(c, ids, 3, &a) == 0);
    /* CoW needs a page too */
    ASSERT_STATUS(kvc_cache_append(c, ids[1], P, 1, NULL), KVC_ERR_NO_SPACE);
    ASSERT_STATUS(kvc_cache_add_sequence(c, P, 1, 0, &s, &hit), KVC_ERR_NO_SPACE);
    ASSERT_TRUE(take_snap(c, ids, 3, &b) == 0);
    ASSERT_MEM_EQ(&a, &b, sizeof a);
    kvc_cache_stats st;
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.failed_allocs, 4);
    ASSERT_OK(kvc_cache_check(c));
    /* a hit on a cached page must count against what is available */
    /* (the duplicate took the evicted page's place in the index) */
    ASSERT_OK(kvc_cache_free_sequence(c, ids[2])); /* 3 pages cached */
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.cached_pages, 3);
    ASSERT_EQ_I64(st.free_pages, 0);
    int32_t Q[13] = {12, 13, 14, 15, 16, 17, 18, 19, 0, 1, 2, 3, 4};
    ASSERT_STATUS(kvc_cache_add_sequence(c, Q, 13, 0, &s, &hit), KVC_ERR_NO_SPACE);
    ASSERT_OK(kvc_cache_add_sequence(c, Q, 12, 0, &s, &hit)); /* 2 hits + 1 new */
    ASSERT_EQ_I64(hit, 8);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

static int nomem_case(kvc_cache_params p) {
    counting k = {0, 0, 0};
    p.allocator.alloc = c_alloc;
    p.allocator.free = c_free;
    p.allocator.user = &k;
    kvc_cache *c = NULL;
    int n;
    for (n = 1;; n++) {
        k.calls = 0;
        k.fail_at = n;
        kvc_status st = kvc_cache_create(&p, &c);
        if (st == KVC_OK) break;
        ASSERT_EQ_I64(st, KVC_ERR_NOMEM);
        ASSERT_EQ_I64(k.live, 0);
        ASSERT_TRUE(n < 100);
    }
    ASSERT_TRUE(n > 5); /* struct, storage, pages, free stack, tokens, buckets */
    k.fail_at = 0;
    int32_t P[64];
    for (int i = 0; i < 64; i++) P[i] = i % 7;
    kvc_seq_id ids[SNAP_MAX];
    int64_t nids = 0, hit;
    int sites = 0;
    /* ops: 0 add, 1 append (grows the table), 2 fork; many sequences grow the id array */
    for (int round = 0; round < 40; round++) {
        int op = round % 3;
        if (nids == 0) op = 0;
        for (n = 1;; n++) {
            snap a, b;
            k.fail_at = 0;
            ASSERT_TRUE(take_snap(c, ids, nids, &a) == 0);
            k.calls = 0;
            k.fail_at = n;
            kvc_status st;
            kvc_seq_id s = -1;
            if (op == 0) st = kvc_cache_add_sequence(c, P, 3 + round % 5, 0, &s, &hit);
            else if (op == 1) st = kvc_cache_append(c, ids[round % nids], P, 9, NULL);
            else st = kvc_cache_fork(c, ids[round % nids], &s);
            k.fail_at = 0;
            if (st == KVC_OK) {
                if (s >= 0) ids[nids++] = s;
                break;
            }
            ASSERT_EQ_I64(st, KVC_ERR_NOMEM);
            sites++;
            ASSERT_TRUE(take_snap(c, ids, nids, &b) == 0);
            ASSERT_MEM_EQ(&a, &b, sizeof a);
            ASSERT_OK(kvc_cache_check(c));
            ASSERT_TRUE(n < 10);
        }
        ASSERT_OK(kvc_cache_check(c));
    }
    ASSERT_TRUE(sites >= 20);
    /* check itself reports NOMEM */
    k.calls = 0;
    k.fail_at = 1;
    ASSERT_STATUS(kvc_cache_check(c), KVC_ERR_NOMEM);
    k.fail_at = 0;
    kvc_cache_destroy(c);
    ASSERT_EQ_I64(k.live, 0);
    return 0;
}

/* Per-token and compressed caches (whose sequences also own tails: one more
 * allocation for add and fork, the fork's a copy; kivi4's first pages their
 * sink rows). */
TEST(nomem_every_allocation_site) {
    if (nomem_case(small_params(2, 1024))) return 1;
    kvc_cache_params p = small_params(4, 1024);
    p.kv_format = KVC_KVFMT_KIVI8;
    p.num_kv_heads = 2;
    p.head_dim = 8;
    if (nomem_case(p)) {
        fprintf(stderr, "  (kivi8)\n");
        return 1;
    }
    p.kv_format = KVC_KVFMT_KIVI4; /* and first pages' sink rows (reserved before commits) */
    if (nomem_case(p)) {
        fprintf(stderr, "  (kivi4)\n");
        return 1;
    }
    return 0;
}

/* ---- compressed formats (kv_format) ------------------------------------------------------------ */

static kvc_cache_params fmt_params(kvc_kv_format kf, int32_t ps, int64_t pages) {
    kvc_cache_params p = small_params(ps, pages);
    p.kv_format = kf;
    p.num_kv_heads = 2;
    p.head_dim = 8; /* H * Dh 16: G / P up to 16 pages per group */
    return p;
}

/* Creation with each member: storage (num_layers, num_pages, page_bytes),
 * bytes per token (SmolLM2: 12,240 / 6,480), geometry errors that allocate
 * nothing, views refused or given by cache kind. */
TEST(kvfmt_create) {
    ASSERT_EQ_I64(kvc_cache_default_params().kv_format, KVC_KVFMT_NONE);
    const kvc_kv_format kfs[2] = {KVC_KVFMT_KIVI8, KVC_KVFMT_KIVI4};
    const int64_t bpt[2] = {12240, 6480};
    counting k = {0, 0, 0};
    for (int f = 0; f < 2; f++) {
        kvc_cache_params p = kvc_cache_default_params();
        p.num_layers = 30; p.num_kv_heads = 3; p.head_dim = 64; p.page_size = 16;
        p.num_pages = 8; p.kv_format = kfs[f];
        p.dtype = KVC_I32; /* ignored by a compressed format, as layout and quant_group */
        p.quant_group = 3;
        p.allocator.alloc = c_alloc; p.allocator.free = c_free; p.allocator.user = &k;
        kvc_cache *c;
        ASSERT_OK(kvc_cache_create(&p, &c));
        ASSERT_EQ_I64(kvc_cache_bytes_per_token(c), bpt[f]);
        ASSERT_EQ_I64(kvc_cache_capacity_tokens(c), 128);
        kvc_kvfmt fmt, want;
        ASSERT_OK(kvc_cache_kvfmt(c, &fmt));
        ASSERT_OK(kvc_kvfmt_make(kfs[f], 3, 64, 16, &want));
        ASSERT_MEM_EQ(&fmt, &want, sizeof fmt);
        const size_t pb = kvc_kvfmt_page_bytes(&fmt);
        ASSERT_EQ_I64(pb * 30, bpt[f] * 16);
        kvc_tensor t0, t1;
        ASSERT_OK(kvc_cache_kvfmt_layer(c, 0, &t0));
        ASSERT_OK(kvc_cache_kvfmt_layer(c, 29, &t1));
        ASSERT_TRUE(t0.dtype == KVC_U8 && t0.ndim == 2);
        ASSERT_EQ_I64(t0.shape[0], 8);
        ASSERT_EQ_I64(t0.shape[1], (int64_t)pb);
        ASSERT_EQ_I64(t0.stride[1], 1);
        ASSERT_EQ_I64(((uintptr_t)t0.data) % 64, 0);
        ASSERT_EQ_I64((char *)t1.data - (char *)t0.data, (int64_t)(29 * 8 * pb));
        ASSERT_STATUS(kvc_cache_kvfmt_layer(c, 30, &t0), KVC_ERR_INVALID_ARG);
        ASSERT_STATUS(kvc_cache_kvfmt_layer(c, -1, &t0), KVC_ERR_INVALID_ARG);
        kvc_tensor kv;
        kvc_paged_cache pc;
        ASSERT_STATUS(kvc_cache_layer_tensors(c, 0, &kv, NULL), KVC_ERR_INVALID_ARG);
        ASSERT_STR_CONTAINS(kvc_last_error(), "kvc_cache_kvfmt_layer");
        ASSERT_STATUS(kvc_cache_layer(c, 0, &pc), KVC_ERR_INVALID_ARG);
        ASSERT_STR_CONTAINS(kvc_last_error(), "kvc_cache_layer:");
        /* tails: one per layer, allocated with the sequence */
        kvc_seq_id s;
        int64_t live = k.live;
        ASSERT_OK(kvc_cache_add_sequence(c, NULL, 5, 0, &s, NULL));
        /* the id array, the sequence, its tails and (kivi4) its first page's sink rows */
        ASSERT_EQ_I64(k.live, live + 3 + (fmt.sink > 0));
        kvc_kvfmt_seq q0, q1;
        ASSERT_OK(kvc_cache_kvfmt_seqs(c, 0, &s, 1, &q0));
        ASSERT_OK(kvc_cache_kvfmt_seqs(c, 1, &s, 1, &q1));
        ASSERT_EQ_I64(q0.n_kv, 5);
        ASSERT_TRUE(q0.pages == q1.pages);
        ASSERT_EQ_I64((char *)q1.tail - (char *)q0.tail, (int64_t)kvc_kvfmt_tail_bytes(&fmt));
        ASSERT_EQ_I64(kvc_kvfmt_tail_bytes(&fmt), 2 * 64 * 3 * 64 * 2);
        ASSERT_EQ_I64(fmt.sink, kfs[f] == KVC_KVFMT_KIVI4);
        if (fmt.sink) {
            ASSERT_TRUE(q0.sink != NULL);
            ASSERT_EQ_I64((char *)q1.sink - (char *)q0.sink, (int64_t)kvc_kvfmt_sink_bytes(&fmt));
            ASSERT_EQ_I64(kvc_kvfmt_sink_bytes(&fmt), 2 * 1 * 3 * 64 * 2);
        } else {
            ASSERT_TRUE(q0.sink == NULL && kvc_kvfmt_sink_bytes(&fmt) == 0);
        }
        kvc_seq_id bad = s + 7;
        ASSERT_STATUS(kvc_cache_kvfmt_seqs(c, 0, &bad, 1, &q0), KVC_ERR_NOT_FOUND);
        ASSERT_STATUS(kvc_cache_kvfmt_seqs(c, 30, &s, 1, &q0), KVC_ERR_INVALID_ARG);
        ASSERT_OK(kvc_cache_kvfmt_seqs(c, 0, NULL, 0, NULL));
        ASSERT_OK(kvc_cache_check(c));
        ASSERT_OK(kvc_cache_free_sequence(c, s));
        /* the id array; a dropped sink allocation stays as the spare */
        ASSERT_EQ_I64(k.live, live + 1 + (fmt.sink > 0));
        kvc_cache_destroy(c);
        ASSERT_EQ_I64(k.live, 0);
        /* num_pages from max_bytes: whole pages of every layer */
        p.allocator = (kvc_allocator){0};
        p.num_pages = 0;
        p.max_bytes = (int64_t)(30 * pb * 10 + 100);
        ASSERT_OK(kvc_cache_create(&p, &c));
        ASSERT_EQ_I64(kvc_cache_num_pages(c), 10);
        kvc_cache_destroy(c);
        p.max_bytes = (int64_t)(30 * pb - 1);
        ASSERT_STATUS(kvc_cache_create(&p, &c), KVC_ERR_INVALID_ARG);
    }
    /* per-token caches have no format */
    kvc_cache *c;
    kvc_cache_params p = small_params(4, 8);
    ASSERT_OK(kvc_cache_create(&p, &c));
    kvc_kvfmt fmt;
    kvc_tensor t;
    kvc_seq_id s = 0;
    kvc_kvfmt_seq q;
    ASSERT_STATUS(kvc_cache_kvfmt(c, &fmt), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_kvfmt_layer(c, 0, &t), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_kvfmt_seqs(c, 0, &s, 1, &q), KVC_ERR_INVALID_ARG);
    kvc_cache_destroy(c);
    /* geometry errors: passed through, nothing allocated */
    struct { kvc_kv_format kf; int32_t H, Dh, P; const char *why; } bad[] = {
        {KVC_KVFMT_KIVI4, 2, 8, 5, "one must divide"},        /* neither divides G 64 */
        {KVC_KVFMT_KIVI4, 16, 7, 16, "even"},                 /* 4-bit codes: even Dh */
        {KVC_KVFMT_KIVI4, 2, 8, 1, "must divide H * Dh"},     /* 64 pages per group */
        {KVC_KVFMT_KIVI4, 1, 48, 16, "power-of-two"},         /* rotation */
        {KVC_KVFMT_KIVI8, 1, 2, 16, "must divide H * Dh"},    /* G / P = 4 pages, H * Dh 2 */
        {KVC_KVFMT_KIVI8, 1, KVC_ATTN_MAX_HEAD_DIM * 2, 16, "head_dim"}, /* kernels' limit */
        {(kvc_kv_format)3, 2, 8, 16, "kv_format 3"},
        {(kvc_kv_format)-1, 2, 8, 16, "kv_format -1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        p = fmt_params(bad[i].kf, bad[i].P, 8);
        p.num_kv_heads = bad[i].H;
        p.head_dim = bad[i].Dh;
        p.allocator.alloc = c_alloc; p.allocator.free = c_free; p.allocator.user = &k;
        k.calls = 0;
        c = (kvc_cache *)&k;
        ASSERT_STATUS(kvc_cache_create(&p, &c), KVC_ERR_INVALID_ARG);
        ASSERT_TRUE(c == NULL);
        ASSERT_EQ_I64(k.calls, 0);
        ASSERT_STR_CONTAINS(kvc_last_error(), "kvc_cache_create");
        ASSERT_STR_CONTAINS(kvc_last_error(), bad[i].why);
    }
    return 0;
}

/* Prefix hits reuse whole K groups: P 16, G 64: a 100-token shared prefix
 * of a 128-token sequence (both groups complete) gives 64, not 96. With
 * P 128 (> G) whole pages already are whole groups. */
TEST(kvfmt_prefix_hits_whole_groups) {
    kvc_cache *c;
    kvc_cache_params p = fmt_params(KVC_KVFMT_KIVI8, 16, 32);
    ASSERT_OK(kvc_cache_create(&p, &c));
    int32_t A[160], B[120];
    for (int i = 0; i < 160; i++) A[i] = i;
    for (int i = 0; i < 120; i++) B[i] = i < 100 ? i : 1000 + i;
    kvc_seq_id a, b, x;
    int64_t hit;
    ASSERT_OK(kvc_cache_add_sequence(c, A, 128, 0, &a, &hit));
    ASSERT_EQ_I64(hit, 0);
    ASSERT_OK(kvc_cache_lookup_prefix(c, B, 120, 0, &hit));
    ASSERT_EQ_I64(hit, 64);
    ASSERT_OK(kvc_cache_add_sequence(c, B, 120, 0, &b, &hit));
    ASSERT_EQ_I64(hit, 64);
    for (int t = 0; t < 64; t += 16) ASSERT_EQ_I64(page_of(c, b, t, 16), page_of(c, a, t, 16));
    ASSERT_TRUE(page_of(c, b, 64, 16) != page_of(c, a, 64, 16)); /* pages 4, 5 match, unused */
    ASSERT_OK(kvc_cache_lookup_prefix(c, A, 129, 0, &hit));
    ASSERT_EQ_I64(hit, 128);
    ASSERT_OK(kvc_cache_lookup_prefix(c, A, 128, 0, &hit));
    ASSERT_EQ_I64(hit, 64); /* within the first len - 1 tokens */
    /* pages of an incomplete group are not findable yet: x's 100 tokens
     * register group 0 only; once appended to 128, group 1 too */
    int32_t X[140];
    for (int i = 0; i < 140; i++) X[i] = 5000 + i;
    ASSERT_OK(kvc_cache_add_sequence(c, X, 100, 0, &x, &hit));
    ASSERT_OK(kvc_cache_lookup_prefix(c, X, 140, 0, &hit));
    ASSERT_EQ_I64(hit, 64);
    ASSERT_OK(kvc_cache_append(c, x, X + 100, 28, NULL));
    ASSERT_OK(kvc_cache_lookup_prefix(c, X, 140, 0, &hit));
    ASSERT_EQ_I64(hit, 128);
    kvc_cache_stats st;
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.hit_tokens, 64);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    /* P 128 > G 64 */
    p = fmt_params(KVC_KVFMT_KIVI4, 128, 8);
    ASSERT_OK(kvc_cache_create(&p, &c));
    int32_t L[300];
    for (int i = 0; i < 300; i++) L[i] = i;
    ASSERT_OK(kvc_cache_add_sequence(c, L, 300, 0, &a, &hit));
    ASSERT_OK(kvc_cache_lookup_prefix(c, L, 250, 0, &hit));
    ASSERT_EQ_I64(hit, 128);
    ASSERT_OK(kvc_cache_lookup_prefix(c, L, 257, 0, &hit));
    ASSERT_EQ_I64(hit, 256);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

/* kivi4's sink rows (position 0 in float16) belong to the sequence's first
 * page: a prefix hit and a fork share them, a copy of the shared first page
 * (copy-on-write) copies them, a cached first page keeps them for the next
 * hit, and a page taken for something else loses them. */
static int sink_of(kvc_cache *c, kvc_seq_id s, uint16_t **out) {
    kvc_kvfmt_seq q;
    ASSERT_OK(kvc_cache_kvfmt_seqs(c, 1, &s, 1, &q));
    *out = q.sink;
    return 0;
}

TEST(kvfmt_sink_rows_follow_the_first_page) {
    kvc_cache *c;
    kvc_cache_params p = fmt_params(KVC_KVFMT_KIVI4, 16, 16);
    ASSERT_OK(kvc_cache_create(&p, &c));
    kvc_kvfmt fmt;
    ASSERT_OK(kvc_cache_kvfmt(c, &fmt));
    ASSERT_EQ_I64(fmt.sink, 1);
    const size_t n = kvc_kvfmt_sink_bytes(&fmt) / 2; /* (2, 1, H 2, Dh 8) */
    ASSERT_EQ_I64(n, 32);
    int32_t A[100];
    for (int i = 0; i < 100; i++) A[i] = 7 + i;
    kvc_seq_id a, b, d, e;
    int64_t hit;
    uint16_t *sa, *sb, *sd, *se;
    ASSERT_OK(kvc_cache_add_sequence(c, A, 80, 0, &a, &hit));
    ASSERT_EQ_I64(hit, 0);
    ASSERT_TRUE(sink_of(c, a, &sa) == 0 && sa != NULL);
    for (size_t i = 0; i < n; i++) ASSERT_EQ_I64(sa[i], 0); /* zeroed until written */
    for (size_t i = 0; i < n; i++) sa[i] = (uint16_t)(0x3c00 + i); /* "position 0" */
    /* a prefix hit shares the first page and its sink rows */
    ASSERT_OK(kvc_cache_add_sequence(c, A, 90, 0, &b, &hit));
    ASSERT_EQ_I64(hit, 64);
    ASSERT_TRUE(sink_of(c, b, &sb) == 0 && sb == sa);
    /* freed, the first page stays cached with its rows: a later hit finds them */
    ASSERT_OK(kvc_cache_free_sequence(c, a));
    ASSERT_OK(kvc_cache_free_sequence(c, b));
    ASSERT_OK(kvc_cache_add_sequence(c, A, 70, 0, &b, &hit));
    ASSERT_EQ_I64(hit, 64);
    ASSERT_TRUE(sink_of(c, b, &sb) == 0 && sb != NULL);
    for (size_t i = 0; i < n; i++) ASSERT_EQ_I64(sb[i], 0x3c00 + i);
    /* fork shares; the child's first append inside group 0 copies the first
     * page and its sink rows */
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 10, 0, &d, NULL));
    ASSERT_TRUE(sink_of(c, d, &sd) == 0 && sd != NULL && sd != sb);
    for (size_t i = 0; i < n; i++) sd[i] = (uint16_t)(0x4000 + 3 * i);
    ASSERT_OK(kvc_cache_fork(c, d, &e));
    ASSERT_TRUE(sink_of(c, e, &se) == 0 && se == sd);
    ASSERT_OK(kvc_cache_append(c, e, NULL, 1, NULL));
    ASSERT_TRUE(sink_of(c, e, &se) == 0 && se != sd && se != NULL);
    ASSERT_MEM_EQ(se, sd, n * 2);
    ASSERT_TRUE(page_of(c, e, 0, 16) != page_of(c, d, 0, 16));
    /* an empty sequence gets its rows with its first page */
    kvc_seq_id z;
    uint16_t *sz;
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 0, 0, &z, NULL));
    ASSERT_TRUE(sink_of(c, z, &sz) == 0 && sz == NULL);
    ASSERT_OK(kvc_cache_append(c, z, NULL, 3, NULL));
    ASSERT_TRUE(sink_of(c, z, &sz) == 0 && sz != NULL);
    for (size_t i = 0; i < n; i++) ASSERT_EQ_I64(sz[i], 0);
    ASSERT_OK(kvc_cache_check(c));
    /* truncated to 0 and appended again: a new first page, new rows */
    ASSERT_OK(kvc_cache_truncate(c, d, 0));
    ASSERT_OK(kvc_cache_append(c, d, NULL, 5, NULL));
    ASSERT_TRUE(sink_of(c, d, &sd) == 0 && sd != NULL);
    for (size_t i = 0; i < n; i++) ASSERT_EQ_I64(sd[i], 0);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    /* kivi8 keeps none */
    p = fmt_params(KVC_KVFMT_KIVI8, 16, 16);
    ASSERT_OK(kvc_cache_create(&p, &c));
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 10, 0, &d, NULL));
    ASSERT_TRUE(sink_of(c, d, &sd) == 0 && sd == NULL);
    kvc_cache_destroy(c);
    return 0;
}

/* Fork copies the parent's tails: later writes to one are not seen by the
 * other. */
TEST(kvfmt_fork_copies_tails) {
    kvc_cache *c;
    kvc_cache_params p = fmt_params(KVC_KVFMT_KIVI4, 16, 16);
    ASSERT_OK(kvc_cache_create(&p, &c));
    kvc_kvfmt fmt;
    ASSERT_OK(kvc_cache_kvfmt(c, &fmt));
    const size_t n = kvc_kvfmt_tail_bytes(&fmt) / 2;
    kvc_seq_id a, b;
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 40, 0, &a, NULL));
    for (int l = 0; l < 2; l++) {
        kvc_kvfmt_seq q;
        ASSERT_OK(kvc_cache_kvfmt_seqs(c, l, &a, 1, &q));
        for (size_t i = 0; i < n; i++) q.tail[i] = (uint16_t)(i * 7 + (size_t)l * 1000);
    }
    ASSERT_OK(kvc_cache_fork(c, a, &b));
    for (int l = 0; l < 2; l++) {
        kvc_kvfmt_seq qa, qb;
        ASSERT_OK(kvc_cache_kvfmt_seqs(c, l, &a, 1, &qa));
        ASSERT_OK(kvc_cache_kvfmt_seqs(c, l, &b, 1, &qb));
        ASSERT_TRUE(qa.tail != qb.tail);
        ASSERT_EQ_I64(qb.n_kv, 40);
        ASSERT_MEM_EQ(qa.tail, qb.tail, n * 2);
        for (size_t i = 0; i < n; i++) qa.tail[i] ^= 0xffff; /* the parent writes on */
        for (size_t i = 0; i < n; i++)
            if (qb.tail[i] != (uint16_t)(i * 7 + (size_t)l * 1000))
                TEST_FAIL_("layer %d: child's tail changed at %zu", l, i);
    }
    ASSERT_OK(kvc_cache_free_sequence(c, a));
    kvc_kvfmt_seq qb;
    ASSERT_OK(kvc_cache_kvfmt_seqs(c, 1, &b, 1, &qb));
    ASSERT_EQ_I64(qb.tail[3], (uint16_t)(21 + 1000));
    /* a long sequence's page table grows; its tails stay where they were */
    uint16_t *before = qb.tail;
    ASSERT_OK(kvc_cache_append(c, b, NULL, 150, NULL));
    ASSERT_OK(kvc_cache_kvfmt_seqs(c, 1, &b, 1, &qb));
    ASSERT_TRUE(qb.tail == before);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

/* Copy-on-write of the incomplete group: forked at 40 tokens (P 16, G 64),
 * all three pages hold positions of group [0, 64), which its completion
 * rewrites: both sides get their own (storage of every layer copied), not
 * only the partly filled last page. After a complete group, only the pages
 * after it. Running out of pages for the copies changes nothing. */
TEST(kvfmt_cow_incomplete_group) {
    kvc_cache *c;
    kvc_cache_params p = fmt_params(KVC_KVFMT_KIVI8, 16, 16);
    ASSERT_OK(kvc_cache_create(&p, &c));
    kvc_tensor L[2];
    for (int l = 0; l < 2; l++) {
        ASSERT_OK(kvc_cache_kvfmt_layer(c, l, &L[l]));
        unsigned char *d = L[l].data;
        for (int64_t i = 0; i < L[l].shape[0] * L[l].shape[1]; i++)
            d[i] = (unsigned char)(i * 31 + l * 7 + 1);
    }
    const size_t pb = (size_t)L[0].shape[1];
    kvc_seq_id a, b;
    kvc_cache_stats st0, st;
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 40, 0, &a, NULL));
    ASSERT_OK(kvc_cache_fork(c, a, &b));
    int32_t pa[3];
    for (int j = 0; j < 3; j++) pa[j] = page_of(c, a, 16 * j, 16);
    ASSERT_OK(kvc_cache_get_stats(c, &st0));
    ASSERT_OK(kvc_cache_append(c, b, NULL, 1, NULL));
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.cow_copies, st0.cow_copies + 3);
    for (int j = 0; j < 3; j++) {
        int32_t pbj = page_of(c, b, 16 * j, 16);
        ASSERT_TRUE(pbj != pa[j]);
        ASSERT_EQ_I64(page_of(c, a, 16 * j, 16), pa[j]);
        for (int l = 0; l < 2; l++)
            ASSERT_MEM_EQ((char *)L[l].data + pb * (size_t)pbj,
                          (char *)L[l].data + pb * (size_t)pa[j], pb);
    }
    ASSERT_OK(kvc_cache_append(c, a, NULL, 1, NULL)); /* a's pages are its own now */
    ASSERT_OK(kvc_cache_get_stats(c, &st0));
    ASSERT_EQ_I64(st0.cow_copies, st.cow_copies);
    for (int j = 0; j < 3; j++) ASSERT_EQ_I64(page_of(c, a, 16 * j, 16), pa[j]);
    ASSERT_OK(kvc_cache_check(c));
    /* past a complete group: only the pages of the incomplete one */
    kvc_seq_id d, e;
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 70, 0, &d, NULL));
    ASSERT_OK(kvc_cache_fork(c, d, &e));
    ASSERT_OK(kvc_cache_get_stats(c, &st0));
    ASSERT_OK(kvc_cache_append(c, e, NULL, 2, NULL));
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.cow_copies, st0.cow_copies + 1);
    for (int j = 0; j < 4; j++) ASSERT_EQ_I64(page_of(c, e, 16 * j, 16), page_of(c, d, 16 * j, 16));
    ASSERT_TRUE(page_of(c, e, 64, 16) != page_of(c, d, 64, 16));
    ASSERT_OK(kvc_cache_check(c));
    /* the copies need pages: 16 - 3 (a) - 1 (b's) ... fill up, then fail */
    ASSERT_OK(kvc_cache_free_sequence(c, d));
    ASSERT_OK(kvc_cache_free_sequence(c, e));
    kvc_seq_id f, g;
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 40, 0, &f, NULL)); /* 3 pages */
    ASSERT_OK(kvc_cache_fork(c, f, &g));
    ASSERT_OK(kvc_cache_get_stats(c, &st0));
    kvc_seq_id filler;
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, (st0.free_pages + st0.cached_pages - 2) * 16, 0,
                                     &filler, NULL)); /* 2 pages left, 3 copies needed */
    snap s0, s1;
    kvc_seq_id ids[5] = {a, b, f, g, filler};
    ASSERT_TRUE(take_snap(c, ids, 5, &s0) == 0);
    ASSERT_STATUS(kvc_cache_append(c, g, NULL, 1, NULL), KVC_ERR_NO_SPACE);
    ASSERT_TRUE(take_snap(c, ids, 5, &s1) == 0);
    ASSERT_MEM_EQ(&s0, &s1, sizeof s0);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    /* P 128 > G 64: the page holding the incomplete group, complete groups too */
    p = fmt_params(KVC_KVFMT_KIVI8, 128, 8);
    ASSERT_OK(kvc_cache_create(&p, &c));
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 100, 0, &a, NULL));
    ASSERT_OK(kvc_cache_fork(c, a, &b));
    ASSERT_OK(kvc_cache_append(c, b, NULL, 1, NULL));
    ASSERT_TRUE(page_of(c, b, 0, 128) != page_of(c, a, 0, 128));
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

/* truncate refuses a cut inside a quantized group, truncate_ex keeps the
 * whole groups before it, rollback keeps exactly n; a cut within the tail
 * keeps the tail's bytes; per-token caches keep n with either. */
TEST(kvfmt_truncate_rules) {
    kvc_cache *c;
    kvc_cache_params p = fmt_params(KVC_KVFMT_KIVI8, 16, 32);
    ASSERT_OK(kvc_cache_create(&p, &c));
    int32_t T[200];
    for (int i = 0; i < 200; i++) T[i] = i;
    kvc_seq_id a;
    int64_t len, kept;
    ASSERT_OK(kvc_cache_add_sequence(c, T, 150, 0, &a, NULL)); /* groups [0,64) [64,128) */
    ASSERT_STATUS(kvc_cache_truncate(c, a, 100), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "kvc_cache_truncate_ex");
    ASSERT_OK(kvc_cache_seq_len(c, a, &len));
    ASSERT_EQ_I64(len, 150);
    /* within the tail [128, 150): exact, tail bytes unchanged */
    kvc_kvfmt_seq q;
    ASSERT_OK(kvc_cache_kvfmt_seqs(c, 1, &a, 1, &q));
    kvc_kvfmt fmt;
    ASSERT_OK(kvc_cache_kvfmt(c, &fmt));
    const size_t tb = kvc_kvfmt_tail_bytes(&fmt);
    for (size_t i = 0; i < tb / 2; i++) q.tail[i] = (uint16_t)(i * 3 + 1);
    unsigned char saved[2 * 64 * 16 * 2];
    ASSERT_TRUE(sizeof saved == tb);
    memcpy(saved, q.tail, tb);
    ASSERT_OK(kvc_cache_truncate(c, a, 140));
    ASSERT_OK(kvc_cache_truncate_ex(c, a, 130, &kept));
    ASSERT_EQ_I64(kept, 130);
    ASSERT_OK(kvc_cache_truncate(c, a, 128));
    ASSERT_OK(kvc_cache_kvfmt_seqs(c, 1, &a, 1, &q));
    ASSERT_MEM_EQ(q.tail, saved, tb);
    /* whole groups are fine for both */
    ASSERT_OK(kvc_cache_truncate(c, a, 64));
    ASSERT_OK(kvc_cache_seq_len(c, a, &len));
    ASSERT_EQ_I64(len, 64);
    ASSERT_OK(kvc_cache_append(c, a, T + 64, 86, NULL));
    ASSERT_OK(kvc_cache_truncate_ex(c, a, 100, &kept));
    ASSERT_EQ_I64(kept, 64);
    ASSERT_OK(kvc_cache_seq_len(c, a, &len));
    ASSERT_EQ_I64(len, 64);
    ASSERT_OK(kvc_cache_truncate_ex(c, a, 30, NULL));
    ASSERT_OK(kvc_cache_seq_len(c, a, &len));
    ASSERT_EQ_I64(len, 0);
    kvc_cache_stats st;
    ASSERT_OK(kvc_cache_get_stats(c, &st));
    ASSERT_EQ_I64(st.used_pages, 0);
    ASSERT_STATUS(kvc_cache_truncate_ex(c, a, 1, &kept), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_cache_truncate_ex(c, a + 9, 0, &kept), KVC_ERR_NOT_FOUND);
    ASSERT_OK(kvc_cache_check(c));
    /* rollback: the step that completed group [0, 64) did not run: 50 tokens
     * kept, and the group's pages leave the index (their bytes were never
     * written) */
    kvc_seq_id r;
    int64_t hit;
    int32_t U[100];
    for (int i = 0; i < 100; i++) U[i] = 7000 + i;
    ASSERT_OK(kvc_cache_add_sequence(c, U, 40, 0, &r, NULL));
    ASSERT_OK(kvc_cache_append(c, r, U + 40, 30, NULL)); /* 70: group 0 complete */
    ASSERT_OK(kvc_cache_lookup_prefix(c, U, 100, 0, &hit));
    ASSERT_EQ_I64(hit, 64);
    ASSERT_OK(kvc_cache_rollback(c, r, 50));
    ASSERT_OK(kvc_cache_seq_len(c, r, &len));
    ASSERT_EQ_I64(len, 50);
    ASSERT_OK(kvc_cache_lookup_prefix(c, U, 100, 0, &hit));
    ASSERT_EQ_I64(hit, 0);
    ASSERT_OK(kvc_cache_check(c));
    ASSERT_OK(kvc_cache_append(c, r, U + 50, 20, NULL));
    ASSERT_OK(kvc_cache_lookup_prefix(c, U, 100, 0, &hit));
    ASSERT_EQ_I64(hit, 64);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    /* a per-token cache: truncate_ex is truncate */
    p = small_params(4, 16);
    ASSERT_OK(kvc_cache_create(&p, &c));
    ASSERT_OK(kvc_cache_add_sequence(c, T, 30, 0, &a, NULL));
    ASSERT_OK(kvc_cache_truncate_ex(c, a, 13, &kept));
    ASSERT_EQ_I64(kept, 13);
    ASSERT_OK(kvc_cache_truncate(c, a, 5));
    ASSERT_OK(kvc_cache_seq_len(c, a, &len));
    ASSERT_EQ_I64(len, 5);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    return 0;
}

/* ---- randomized run against a model ------------------------------------------------------------- */

#define RMAX_SEQ 24
#define RMAX_LEN 256 /* array size; a run's sequences stay within rt.max_len */

typedef struct mseq {
    kvc_seq_id id;
    int64_t len;
    int32_t tok[RMAX_LEN];
    uint64_t val[RMAX_LEN]; /* prefix hash up to and including token t */
} mseq;

typedef struct rt {
    kvc_cache *c;
    kvc_cache_params p;
    mseq s[RMAX_SEQ];
    int n;
    uint64_t rng;
    int64_t max_len, max_add, max_append; /* sequence length, prompt, one append */
    int32_t G;                            /* compressed format: K group; else 0 */
} rt;

static uint32_t kv_value(uint64_t v, int layer, int kv, int d) {
    return (uint32_t)(mixv(v, layer * 4 + kv * 2 + d) >> 16);
}

/*
 * Compressed formats, emulated as kvc_kvfmt_append stores: positions [from,
 * len) go to the tail (slot t % G, a 32-bit word per K and V row), and each
 * K group they complete is "quantized" into its pages: the first 8 bytes of
 * slot t % P of a page (K and V words; the real layout is denser, but only
 * where the bytes go matters here). Page words are checked for positions of
 * complete groups, tail words for the rest.
 */
static size_t fmt_page_off(int64_t t, int32_t ps, int x) { return (size_t)(t % ps) * 8 + 4 * x; }
/* A page word depends on the whole group (as the K parameters do): sharers
 * of a group's first tokens write other bytes once their groups differ. */
static uint32_t fmt_page_word(const rt *r, const mseq *m, int64_t t, int l, int x) {
    const int64_t last = t / r->G * r->G + r->G - 1;
    return kv_value(m->val[t] ^ (m->val[last] * 0x9e3779b97f4a7c15ull), l, x, 0);
}
static size_t fmt_tail_off(const rt *r, int64_t t, int x) { /* uint16 (2, G, H, Dh) */
    return ((size_t)x * r->G + (size_t)(t % r->G)) * (size_t)(r->p.num_kv_heads * r->p.head_dim);
}

static int64_t fmt_sink(const rt *r) {
    kvc_kvfmt f;
    return kvc_cache_kvfmt(r->c, &f) == KVC_OK ? f.sink : 0;
}

static int write_kvfmt(rt *r, const mseq *m, int64_t from) {
    const int32_t ps = r->p.page_size, G = r->G;
    for (int l = 0; l < r->p.num_layers; l++) {
        kvc_tensor pages;
        kvc_kvfmt_seq fs;
        ASSERT_OK(kvc_cache_kvfmt_layer(r->c, l, &pages));
        ASSERT_OK(kvc_cache_kvfmt_seqs(r->c, l, &m->id, 1, &fs));
        ASSERT_EQ_I64(fs.n_kv, m->len);
        unsigned char *base = pages.data;
        for (int64_t t = from; t < m->len; t++)
            for (int x = 0; x < 2; x++) {
                uint32_t w = kv_value(m->val[t], l, x, 0);
                memcpy(fs.tail + fmt_tail_off(r, t, x), &w, 4);
            }
        const int64_t S = fmt_sink(r), HD = r->p.num_kv_heads * r->p.head_dim;
        for (int64_t t = from; t < S && t < m->len; t++) /* the sink rows (kivi4: position 0) */
            for (int x = 0; x < 2; x++) {
                uint32_t w = kv_value(m->val[t], l, x, 1);
                memcpy(fs.sink + (x * S + t) * HD, &w, 4);
            }
        for (int64_t g = from / G * G; g + G <= m->len; g += G) /* groups completed */
            for (int64_t t = g; t < g + G; t++)
                for (int x = 0; x < 2; x++) {
                    uint32_t w = fmt_page_word(r, m, t, l, x);
                    memcpy(base + (size_t)fs.pages[t / ps] * (size_t)pages.shape[1] +
                               fmt_page_off(t, ps, x), &w, 4);
                }
    }
    return 0;
}

static int verify_kvfmt(rt *r, const mseq *m, const int32_t *idx) {
    const int32_t ps = r->p.page_size, G = r->G;
    for (int l = 0; l < r->p.num_layers; l++) {
        kvc_tensor pages;
        kvc_kvfmt_seq fs;
        ASSERT_OK(kvc_cache_kvfmt_layer(r->c, l, &pages));
        ASSERT_OK(kvc_cache_kvfmt_seqs(r->c, l, &m->id, 1, &fs));
        ASSERT_EQ_I64(fs.n_kv, m->len);
        for (int64_t j = 0; j < (m->len + ps - 1) / ps; j++) ASSERT_EQ_I64(fs.pages[j], idx[j]);
        const unsigned char *base = pages.data;
        for (int64_t t = 0; t < m->len; t++)
            for (int x = 0; x < 2; x++) {
                uint32_t w, want;
                if (t < m->len / G * G) {
                    memcpy(&w, base + (size_t)idx[t / ps] * (size_t)pages.shape[1] +
                                   fmt_page_off(t, ps, x), 4);
                    want = fmt_page_word(r, m, t, l, x);
                } else {
                    memcpy(&w, fs.tail + fmt_tail_off(r, t, x), 4);
                    want = kv_value(m->val[t], l, x, 0);
                }
                if (w != want)
                    TEST_FAIL_("seq %lld token %lld layer %d: wrong %s word", (long long)m->id,
                               (long long)t, l, t < m->len / G * G ? "page" : "tail");
            }
        const int64_t S = fmt_sink(r), HD = r->p.num_kv_heads * r->p.head_dim;
        for (int64_t t = 0; t < S && t < m->len; t++)
            for (int x = 0; x < 2; x++) {
                uint32_t w;
                memcpy(&w, fs.sink + (x * S + t) * HD, 4);
                if (w != kv_value(m->val[t], l, x, 1))
                    TEST_FAIL_("seq %lld token %lld layer %d: wrong sink word", (long long)m->id,
                               (long long)t, l);
            }
    }
    return 0;
}

/* Writes positions [from, len) of m's K/V (every layer) through its page table. */
static int write_kv(rt *r, const mseq *m, int64_t from) {
    if (r->G) return write_kvfmt(r, m, from);
    int32_t ps = r->p.page_size;
    int32_t indptr[2], idx[RMAX_LEN], last;
    int64_t n;
    ASSERT_OK(kvc_cache_page_table(r->c, &m->id, 1, indptr, idx, RMAX_LEN, &last, &n));
    for (int l = 0; l < r->p.num_layers; l++) {
        kvc_tensor kv;
        ASSERT_OK(kvc_cache_layer_tensors(r->c, l, &kv, NULL));
        uint32_t *d = kv.data;
        for (int64_t t = from; t < m->len; t++)
            for (int x = 0; x < 2; x++)
                for (int e = 0; e < 2; e++)
                    d[slot_off(&kv, r->p.layout, idx[t / ps], x, t % ps, 0) + e] =
                        kv_value(m->val[t], l, x, e);
    }
    return 0;
}

static int verify_all(rt *r) {
    int32_t ps = r->p.page_size;
    for (int i = 0; i < r->n; i++) {
        const mseq *m = &r->s[i];
        int32_t indptr[2], idx[RMAX_LEN], last;
        int64_t n, len;
        ASSERT_OK(kvc_cache_seq_len(r->c, m->id, &len));
        ASSERT_EQ_I64(len, m->len);
        ASSERT_OK(kvc_cache_page_table(r->c, &m->id, 1, indptr, idx, RMAX_LEN, &last, &n));
        ASSERT_EQ_I64(n, (m->len + ps - 1) / ps);
        if (r->G) {
            if (verify_kvfmt(r, m, idx)) return 1;
            continue;
        }
        for (int l = 0; l < r->p.num_layers; l++) {
            kvc_tensor kv;
            ASSERT_OK(kvc_cache_layer_tensors(r->c, l, &kv, NULL));
            const uint32_t *d = kv.data;
            for (int64_t t = 0; t < m->len; t++)
                for (int x = 0; x < 2; x++)
                    for (int e = 0; e < 2; e++)
                        if (d[slot_off(&kv, r->p.layout, idx[t / ps], x, t % ps, 0) + e] !=
                            kv_value(m->val[t], l, x, e))
                            TEST_FAIL_("seq %lld token %lld layer %d: wrong K/V",
                                       (long long)m->id, (long long)t, l);
        }
    }
    return 0;
}

static void fill_vals(mseq *m, int64_t from) {
    for (int64_t t = from; t < m->len; t++)
        m->val[t] = mixv(t ? m->val[t - 1] : 0x1234, m->tok[t]);
}

/* Hash bits kept by random_run's caches (narrowed to force collisions). */
static uint64_t g_hash_mask = ~(uint64_t)0;

/* Runs call (an add, append or fork of random_run) first with one of its
 * first 4 allocations failing, alone or with every later one (test_oom.h):
 * a failure must leave a message, the invariants and the page tables and
 * stats (snapshot a) as they were; then the call runs unarmed. Random
 * states reach what fixed ones do not: duplicate pages, collisions, every
 * page size against the K group. */
#define RUN_FAILING_FIRST(call)                                                                    \
    do {                                                                                           \
        kvc_clear_error();                                                                         \
        test_oom_arm(1 + (long)(test_rng_next(&r.rng) % 4), (int)(test_rng_next(&r.rng) % 2));    \
        st = (call);                                                                               \
        if (test_oom_disarm() && st != KVC_OK) {                                                   \
            if (!kvc_last_error()[0]) TEST_FAIL_("%s -> %s without a message", #call,             \
                                                 kvc_status_str(st));                              \
            ASSERT_OK(kvc_cache_check(r.c));                                                       \
            snap after_;                                                                           \
            ASSERT_TRUE(take_snap(r.c, ids, r.n, &after_) == 0);                                   \
            ASSERT_MEM_EQ(&a, &after_, sizeof a);                                                  \
            st = (call);                                                                           \
        }                                                                                          \
    } while (0)

static int random_run(int32_t ps, int64_t pages, int prefix, kvc_kv_layout lay, int steps,
                      uint64_t seed, kvc_kv_format kf) {
    rt r;
    memset(&r, 0, sizeof r);
    r.p = small_params(ps, pages);
    r.p.layout = lay;
    r.p.enable_prefix_caching = prefix;
    r.rng = seed;
    r.max_len = 96;
    r.max_add = 40;
    r.max_append = 2 * ps;
    if (kf != KVC_KVFMT_NONE) { /* groups of 64: longer sequences, so they complete */
        r.p.kv_format = kf;
        r.p.num_kv_heads = 2;
        r.p.head_dim = 8;
        r.max_len = RMAX_LEN;
        r.max_add = ps > 64 ? 240 : 160; /* hits need prompts beyond a page */
        r.max_append = 2 * ps > 40 ? 2 * ps : 40;
    }
    ASSERT_OK(kvc_cache_create(&r.p, &r.c));
    kvc_kvfmt fmt = {0};
    if (kf != KVC_KVFMT_NONE) {
        ASSERT_OK(kvc_cache_kvfmt(r.c, &fmt));
        r.G = fmt.group;
    }
    if (r.max_len > kvc_cache_capacity_tokens(r.c)) r.max_len = kvc_cache_capacity_tokens(r.c);
    /* prefix hits come in whole pages, and whole K groups in a compressed format */
    const int64_t unit = r.G > ps ? r.G : ps;
    kvc__cache_set_hash_mask(r.c, g_hash_mask);
    /* a few shared stems so that prompts repeat */
    int32_t stems[4][RMAX_LEN];
    for (int s = 0; s < 4; s++)
        for (int t = 0; t < RMAX_LEN; t++) stems[s][t] = (int32_t)(test_rng_next(&r.rng) % 3);
    int64_t hits = 0, nospace = 0;
    for (int step = 0; step < steps; step++) {
        uint64_t u = test_rng_next(&r.rng);
        int op = (int)(u % 100);
        snap a, b;
        kvc_seq_id ids[RMAX_SEQ];
        for (int i = 0; i < r.n; i++) ids[i] = r.s[i].id;
        ASSERT_TRUE(take_snap(r.c, ids, r.n, &a) == 0);
        kvc_status st = KVC_OK;
        if (r.n == 0 || (op < 25 && r.n < RMAX_SEQ)) {
            mseq *m = &r.s[r.n];
            m->len = 1 + (int64_t)(test_rng_next(&r.rng) % (uint64_t)r.max_add);
            const int32_t *stem = stems[test_rng_next(&r.rng) % 4];
            int64_t keep = (int64_t)(test_rng_next(&r.rng) % (uint64_t)(m->len + 1));
            if (r.G && test_rng_next(&r.rng) % 2) keep = m->len; /* hits need whole groups */
            for (int64_t t = 0; t < m->len; t++)
                m->tok[t] = t < keep ? stem[t] : (int32_t)(test_rng_next(&r.rng) % 3);
            fill_vals(m, 0);
            int64_t hit = -1;
            int with_ids = test_rng_next(&r.rng) % 8 != 0;
            RUN_FAILING_FIRST(
                kvc_cache_add_sequence(r.c, with_ids ? m->tok : NULL, m->len, 0, &m->id, &hit));
            if (st == KVC_OK) {
                ASSERT_TRUE(hit >= 0 && hit < m->len && hit % unit == 0);
                if (!prefix || !with_ids) ASSERT_EQ_I64(hit, 0);
                hits += hit;
                if (write_kv(&r, m, hit)) return 1;
                r.n++;
            }
        } else {
            int i = (int)(test_rng_next(&r.rng) % (uint64_t)r.n);
            mseq *m = &r.s[i];
            if (op < 65) { /* append */
                int64_t k = 1 + (int64_t)(test_rng_next(&r.rng) % (uint64_t)r.max_append);
                if (m->len + k > r.max_len) k = r.max_len - m->len;
                int32_t tk[RMAX_LEN], posn[RMAX_LEN];
                for (int64_t j = 0; j < k; j++) tk[j] = (int32_t)(test_rng_next(&r.rng) % 3);
                int with_ids = test_rng_next(&r.rng) % 10 != 0;
                RUN_FAILING_FIRST(kvc_cache_append(r.c, m->id, with_ids ? tk : NULL, k, posn));
                if (st == KVC_OK) {
                    for (int64_t j = 0; j < k; j++) {
                        ASSERT_EQ_I64(posn[j], m->len + j);
                        m->tok[m->len + j] = tk[j];
                    }
                    int64_t from = m->len;
                    m->len += k;
                    fill_vals(m, from);
                    if (write_kv(&r, m, from)) return 1;
                }
            } else if (op < 75 && r.n < RMAX_SEQ) { /* fork */
                mseq *d = &r.s[r.n];
                RUN_FAILING_FIRST(kvc_cache_fork(r.c, m->id, &d->id));
                if (st == KVC_OK) {
                    kvc_seq_id id = d->id;
                    *d = *m;
                    d->id = id;
                    r.n++;
                }
            } else if (op < 88) { /* truncate */
                int64_t n = (int64_t)(test_rng_next(&r.rng) % (uint64_t)(m->len + 1));
                /* a cut inside a quantized group: truncate refuses, truncate_ex
                 * keeps the whole groups before it */
                const int inside = r.G && n < m->len / r.G * r.G && n % r.G != 0;
                int64_t kept = -1;
                if (r.G && test_rng_next(&r.rng) % 2) { /* (per-token runs draw as before) */
                    st = kvc_cache_truncate_ex(r.c, m->id, n, &kept);
                    if (st == KVC_OK) {
                        ASSERT_EQ_I64(kept, inside ? n / r.G * r.G : n);
                        m->len = kept;
                    }
                } else {
                    st = kvc_cache_truncate(r.c, m->id, n);
                    if (inside) {
                        ASSERT_STATUS(st, KVC_ERR_INVALID_ARG);
                        ASSERT_TRUE(take_snap(r.c, ids, r.n, &b) == 0);
                        ASSERT_MEM_EQ(&a, &b, sizeof a);
                        st = KVC_OK;
                    } else if (st == KVC_OK) {
                        m->len = n;
                    }
                }
            } else { /* free */
                st = kvc_cache_free_sequence(r.c, m->id);
                if (st == KVC_OK) {
                    ASSERT_STATUS(kvc_cache_free_sequence(r.c, m->id), KVC_ERR_NOT_FOUND);
                    r.s[i] = r.s[--r.n];
                }
            }
        }
        if (st == KVC_ERR_NO_SPACE) {
            nospace++;
            ASSERT_TRUE(take_snap(r.c, ids, r.n, &b) == 0);
            ASSERT_MEM_EQ(&a, &b, sizeof a);
            /* make room */
            int i = (int)(test_rng_next(&r.rng) % (uint64_t)r.n);
            ASSERT_OK(kvc_cache_free_sequence(r.c, r.s[i].id));
            r.s[i] = r.s[--r.n];
        } else {
            ASSERT_OK(st);
        }
        ASSERT_OK(kvc_cache_check(r.c));
        if (verify_all(&r)) {
            fprintf(stderr, "  at step %d\n", step);
            return 1;
        }
    }
    kvc_cache_stats st;
    ASSERT_OK(kvc_cache_get_stats(r.c, &st));
    printf("  %s page_size %d: %d sequences live, hit %lld, evictions %lld, cow %lld, no-space %lld, used %lld\n",
           kvc_kv_format_name(kf), (int)ps, r.n, (long long)hits, (long long)st.evictions, (long long)st.cow_copies,
           (long long)nospace, (long long)st.used_pages);
    if (prefix) {
        ASSERT_TRUE(hits > 0);
        ASSERT_TRUE(st.evictions > 0);
    }
    if (ps > 1) ASSERT_TRUE(st.cow_copies > 0);
    ASSERT_EQ_I64(st.failed_allocs, nospace);
    ASSERT_EQ_I64(st.hit_tokens, hits);
    kvc_cache_destroy(r.c);
    return 0;
}

TEST(randomized_against_model) {
    struct { int32_t ps; int64_t pages; int prefix; kvc_kv_layout lay; } cfg[] = {
        {4, 48, 1, KVC_NHD}, {1, 160, 1, KVC_HND}, {5, 40, 1, KVC_HND},
        {16, 14, 1, KVC_NHD}, {4, 48, 0, KVC_NHD}, {3, 30, 1, KVC_NHD},
    };
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++) {
        uint64_t seed = test_seed * 1000 + i;
        if (random_run(cfg[i].ps, cfg[i].pages, cfg[i].prefix, cfg[i].lay, 2500, seed,
                       KVC_KVFMT_NONE)) {
            fprintf(stderr, "  (config %zu: page_size %d, seed %llu)\n", i, (int)cfg[i].ps,
                    (unsigned long long)seed);
            return 1;
        }
    }
    return 0;
}

/* The same run over compressed-format caches (G 64): pages of complete
 * groups and tails read back, prefix hits in whole groups, truncate and
 * truncate_ex around quantized groups, copy-on-write of the pages of an
 * incomplete group (a missing copy shows when the other holder's group
 * completes over them), with G > P, G == P and G < P. */
TEST(randomized_kvfmt_against_model) {
    struct { int32_t ps; int64_t pages; int prefix; kvc_kv_format kf; } cfg[] = {
        {16, 60, 1, KVC_KVFMT_KIVI8}, {4, 220, 1, KVC_KVFMT_KIVI4},
        {64, 16, 1, KVC_KVFMT_KIVI8}, {128, 16, 1, KVC_KVFMT_KIVI4},
        {16, 60, 0, KVC_KVFMT_KIVI4},
    };
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; i++) {
        uint64_t seed = test_seed * 3000 + i;
        if (random_run(cfg[i].ps, cfg[i].pages, cfg[i].prefix, KVC_NHD, 2000, seed,
                       cfg[i].kf)) {
            fprintf(stderr, "  (config %zu: %s, page_size %d, seed %llu)\n", i,
                    kvc_kv_format_name(cfg[i].kf), (int)cfg[i].ps, (unsigned long long)seed);
            return 1;
        }
    }
    return 0;
}

/*
 * Hash collisions: with the hash narrowed to 0 or 2 bits every lookup meets
 * pages of other prompts, so hits must be confirmed by tokens, parent and
 * salt. Different prompts never share pages; the model run then reads every
 * sequence's K/V back as with full hashes.
 */
/* A sequence that fills a page identical to one already in the index points
 * its chain at that page, keeping its own copy out of the index; when that
 * page is evicted, the live sequence's own pages take its place, so its
 * prefix stays findable (the lookup once fell to 0 here). Likewise when the
 * duplicated page is overwritten by its holder. */
TEST(duplicate_pages_stay_findable) {
    for (int how = 0; how < 2; how++) {
        kvc_cache *c;
        kvc_cache_params p = small_params(2, 6);
        ASSERT_OK(kvc_cache_create(&p, &c));
        const int32_t t12[2] = {1, 2}, t34[2] = {3, 4}, q[5] = {1, 2, 3, 4, 5}, nine[8] = {9};
        kvc_seq_id a, b, x;
        int64_t hit;
        ASSERT_OK(kvc_cache_add_sequence(c, t12, 2, 0, &a, &hit));
        ASSERT_OK(kvc_cache_add_sequence(c, t12, 2, 0, &b, &hit)); /* own copy: hit 0 */
        ASSERT_EQ_I64(hit, 0);
        ASSERT_TRUE(page_of(c, a, 0, 2) != page_of(c, b, 0, 2));
        if (how == 0) {
            ASSERT_OK(kvc_cache_free_sequence(c, a)); /* a's page cached ... */
            ASSERT_OK(kvc_cache_append(c, b, t34, 2, NULL));
            ASSERT_OK(kvc_cache_lookup_prefix(c, q, 5, 0, &hit));
            ASSERT_EQ_I64(hit, 4);
            ASSERT_OK(kvc_cache_add_sequence(c, nine, 8, 0, &x, &hit)); /* ... and evicted */
        } else {
            ASSERT_OK(kvc_cache_append(c, b, t34, 2, NULL));
            ASSERT_OK(kvc_cache_truncate(c, a, 1)); /* a rewrites its page in place */
        }
        ASSERT_OK(kvc_cache_check(c));
        ASSERT_OK(kvc_cache_lookup_prefix(c, q, 5, 0, &hit));
        ASSERT_EQ_I64(hit, 4); /* b's own pages */
        if (how == 0) ASSERT_OK(kvc_cache_free_sequence(c, x));
        kvc_seq_id d;
        ASSERT_OK(kvc_cache_add_sequence(c, q, 5, 0, &d, &hit));
        ASSERT_EQ_I64(hit, 4);
        ASSERT_EQ_I64(page_of(c, d, 0, 2), page_of(c, b, 0, 2));
        ASSERT_EQ_I64(page_of(c, d, 3, 2), page_of(c, b, 3, 2));
        ASSERT_OK(kvc_cache_check(c));
        kvc_cache_destroy(c);
    }
    return 0;
}

/* rollback (reserved slots never written) against truncate: the page a
 * reservation filled and registered stays findable after truncate + free
 * (its K/V were written, as truncate assumes) but not after rollback + free;
 * a page shared with another sequence stays in the index either way, and
 * errors change nothing. */
TEST(rollback_unregisters_unwritten_pages) {
    for (int rb = 0; rb < 2; rb++) {
        kvc_cache *c;
        kvc_cache_params p = small_params(2, 8);
        ASSERT_OK(kvc_cache_create(&p, &c));
        const int32_t t[6] = {1, 2, 3, 4, 5, 6};
        kvc_seq_id a, b;
        int64_t hit;
        ASSERT_OK(kvc_cache_add_sequence(c, t, 2, 0, &a, &hit)); /* [1,2] */
        ASSERT_OK(kvc_cache_append(c, a, t + 2, 2, NULL));       /* reserves [3,4] */
        ASSERT_OK(kvc_cache_lookup_prefix(c, t, 5, 0, &hit));
        ASSERT_EQ_I64(hit, 4); /* findable as soon as reserved */
        kvc_status (*fn)(kvc_cache *, kvc_seq_id, int64_t) =
            rb ? kvc_cache_rollback : kvc_cache_truncate;
        ASSERT_STATUS(fn(c, a, 5), KVC_ERR_INVALID_ARG);
        ASSERT_STATUS(fn(c, a + 100, 3), KVC_ERR_NOT_FOUND);
        ASSERT_OK(kvc_cache_lookup_prefix(c, t, 5, 0, &hit));
        ASSERT_EQ_I64(hit, 4);
        ASSERT_OK(fn(c, a, 2)); /* the step reserving positions 2, 3 did not run */
        ASSERT_OK(kvc_cache_free_sequence(c, a));
        ASSERT_OK(kvc_cache_check(c));
        ASSERT_OK(kvc_cache_lookup_prefix(c, t, 5, 0, &hit));
        ASSERT_EQ_I64(hit, (rb ? 2 : 4));
        /* shared: b hits [1,2] [3,4] of a fresh sequence, which then rolls back */
        ASSERT_OK(kvc_cache_add_sequence(c, t, 4, 0, &a, &hit));
        ASSERT_OK(kvc_cache_add_sequence(c, t, 6, 0, &b, &hit));
        ASSERT_EQ_I64(hit, 4);
        ASSERT_OK(fn(c, a, 2));
        ASSERT_OK(kvc_cache_free_sequence(c, a));
        ASSERT_OK(kvc_cache_lookup_prefix(c, t, 5, 0, &hit));
        ASSERT_EQ_I64(hit, 4);
        ASSERT_OK(kvc_cache_check(c));
        kvc_cache_destroy(c);
    }
    return 0;
}

TEST(hash_collisions_are_confirmed) {
    kvc_cache *c;
    kvc_cache_params p = small_params(4, 32);
    ASSERT_OK(kvc_cache_create(&p, &c));
    kvc__cache_set_hash_mask(c, 0);
    int32_t P[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, Q[9] = {9, 8, 7, 6, 5, 4, 3, 2, 1};
    int32_t R[9] = {1, 2, 3, 4, 5, 6, 7, 9, 9}; /* shares P's first page only */
    kvc_seq_id a, b;
    int64_t hit;
    ASSERT_OK(kvc_cache_add_sequence(c, P, 9, 0, &a, &hit));
    ASSERT_EQ_I64(hit, 0);
    ASSERT_OK(kvc_cache_add_sequence(c, Q, 9, 0, &b, &hit));
    ASSERT_EQ_I64(hit, 0); /* same (zero) hash as P's pages, other tokens */
    ASSERT_OK(kvc_cache_add_sequence(c, R, 9, 0, &b, &hit));
    ASSERT_EQ_I64(hit, 4);
    ASSERT_OK(kvc_cache_add_sequence(c, P, 9, 1, &b, &hit));
    ASSERT_EQ_I64(hit, 0); /* same tokens, other salt */
    ASSERT_OK(kvc_cache_add_sequence(c, P, 9, 0, &b, &hit));
    ASSERT_EQ_I64(hit, 8);
    ASSERT_OK(kvc_cache_check(c));
    kvc_cache_destroy(c);
    static const uint64_t masks[2] = {0, 3};
    for (int m = 0; m < 2; m++) {
        g_hash_mask = masks[m];
        int bad = random_run(4, 48, 1, KVC_NHD, 1500, test_seed * 77 + (uint64_t)m,
                             KVC_KVFMT_NONE);
        /* groups across pages: a hit must never join pages of two groups */
        bad = bad || random_run(16, 60, 1, KVC_NHD, 1500, test_seed * 79 + (uint64_t)m,
                                KVC_KVFMT_KIVI8);
        g_hash_mask = ~(uint64_t)0;
        if (bad) TEST_FAIL_("random run with hash mask %llu failed", (unsigned long long)masks[m]);
    }
    return 0;
}

/* The default allocator puts a pool of 8 MiB or more on 2 MiB-aligned memory
 * marked for transparent huge pages (cache.c, core/memory.c): the mapping holding the
 * storage carries the "hg" flag of MADV_HUGEPAGE in /proc/self/smaps. */
TEST(large_pool_asks_for_huge_pages) {
#if !defined(__linux__)
    SKIP("transparent huge pages are a Linux feature");
#else
    FILE *sys = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!sys) SKIP("transparent huge pages not in this kernel");
    fclose(sys);
    kvc_cache_params p = kvc_cache_default_params();
    p.num_layers = 1; p.num_kv_heads = 8; p.head_dim = 128; p.page_size = 16;
    p.num_pages = 256; p.dtype = KVC_F16; /* 16 MiB of K and V */
    kvc_cache *c;
    ASSERT_OK(kvc_cache_create(&p, &c));
    kvc_paged_cache pc;
    ASSERT_OK(kvc_cache_layer(c, 0, &pc));
    uintptr_t a = (uintptr_t)pc.k.data;
    int aligned = a % ((uintptr_t)2 << 20) == 0, found = 0, hg = 0;
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) { /* a mapping's first line */
            found = lo <= a && a < hi;
        } else if (found && strncmp(line, "VmFlags:", 8) == 0) {
            hg = strstr(line, " hg") != NULL;
            break;
        }
    }
    if (f) fclose(f);
    kvc_cache_destroy(c);
    ASSERT_TRUE(f != NULL);
    ASSERT_TRUE(aligned);
    ASSERT_TRUE(hg);
    return 0;
#endif
}

/* ---- every failed call leaves the cache exactly as it was ------------------------------------ */

/*
 * The error rule (cache.h: "a call that fails changes nothing"), checked for
 * every mutating call in a set of representative states: several sequences,
 * prefix hits on used and cached pages, forks sharing a partly filled page,
 * a zero-length sequence, a compressed format with a partly filled K group
 * (kivi4: sink rows on first pages), and the same near full (no free page,
 * the id array at its capacity). Each call fails on its k-th allocation for
 * every k (test_oom.h: malloc and friends wrapped at link time, so no
 * allocation escapes), alone and with every later one failing too, and on
 * invalid arguments; it must then return an error with a message, pass
 * kvc_cache_check and leave everything observable unchanged: lengths, page
 * tables, compressed views (pages, tails, sink rows), every page's bytes,
 * tokens and sink rows, prefix lookups, stats, the free stack and LRU order
 * (which pages the next calls take or evict) and the eviction hook's calls.
 * After a failure the same call, unarmed, must give what it gives on a
 * fresh state.
 */
#define FX_SEQS 24
#define FX_TOK 200

typedef struct fx {
    kvc_cache *c;
    int kvfmt;
    int32_t ps;
    int64_t evictions; /* eviction hook calls */
    /* every sequence ever created (freed ones stay: their ids must stay unknown) */
    kvc_seq_id id[FX_SEQS];
    int32_t tok[FX_SEQS][FX_TOK]; /* the prompt it was added with (lookups probe it) */
    int64_t ntok[FX_SEQS];
    uint64_t salt[FX_SEQS];
    int n;
    /* roles (indices into id): a; b a fork of a; h a prefix hit on a; d freed (its
     * full pages cached); e added without ids; z truncated to 0; f and g = fork(f)
     * share a partly filled first page (near full: then fillers) */
    int a, b, h, d, e, z, f, g;
    kvc_threadpool *pool; /* 2 threads, its own: a fresh pool allocates its scratch */
} fx;

static void fx_evict(void *user, const kvc_cache *c, int32_t page) {
    (void)c;
    (void)page;
    ((fx *)user)->evictions++;
}

static int32_t fx_token(int base, int64_t i) { return (int32_t)(base * 1000 + i); }

static int fx_add(fx *f, int base, int64_t n, uint64_t salt, int *role) {
    ASSERT_TRUE(f->n < FX_SEQS && n <= FX_TOK);
    int32_t *t = f->tok[f->n];
    for (int64_t i = 0; i < n; i++) t[i] = fx_token(base, i);
    ASSERT_OK(kvc_cache_add_sequence(f->c, base ? t : NULL, n, salt, &f->id[f->n], NULL));
    f->ntok[f->n] = base ? n : 0;
    f->salt[f->n] = salt;
    if (role) *role = f->n;
    f->n++;
    return 0;
}

static int fx_fork(fx *f, int parent, int *role) {
    ASSERT_TRUE(f->n < FX_SEQS);
    ASSERT_OK(kvc_cache_fork(f->c, f->id[parent], &f->id[f->n]));
    memcpy(f->tok[f->n], f->tok[parent], sizeof f->tok[0]);
    f->ntok[f->n] = f->ntok[parent];
    f->salt[f->n] = f->salt[parent];
    *role = f->n++;
    return 0;
}

/* Distinct bytes everywhere a call may copy or overwrite: page storage, and
 * for a compressed format every sequence's tails and sink rows (small float16
 * values: a completed group quantizes the tail's rows). */
static int fx_fill(fx *f) {
    kvc_cache *c = f->c;
    unsigned char *d = c->data;
    const size_t nd = c->layer_data_bytes * (size_t)c->p.num_layers;
    for (size_t i = 0; i < nd; i++) d[i] = (unsigned char)(i * 131 + 17);
    if (c->scale)
        for (size_t i = 0; i < c->layer_scale_bytes * (size_t)c->p.num_layers; i++)
            c->scale[i] = (unsigned char)(i * 71 + 5);
    if (!f->kvfmt) return 0;
    kvc_kvfmt fmt;
    ASSERT_OK(kvc_cache_kvfmt(c, &fmt));
    const size_t tl = kvc_kvfmt_tail_bytes(&fmt) / 2, sl = kvc_kvfmt_sink_bytes(&fmt) / 2;
    for (int i = 0; i < f->n; i++) {
        for (int l = 0; l < c->p.num_layers; l++) {
            kvc_kvfmt_seq s;
            if (kvc_cache_kvfmt_seqs(c, l, &f->id[i], 1, &s) != KVC_OK) break; /* freed */
            for (size_t j = 0; j < tl; j++)
                s.tail[j] = (uint16_t)(0x3c00 + (j * 7 + i * 3 + l) % 512);
            if (s.sink)
                for (size_t j = 0; j < sl; j++) s.sink[j] = (uint16_t)(0x3800 + (j + i * 5) % 256);
        }
    }
    kvc_clear_error();
    return 0;
}

/* A per-token cache (dtype f32 or int8, page size 4, 24 pages) or a
 * compressed one (kivi8 / kivi4, page size 16, G 64: 4 pages per K group,
 * 24 pages); near_full: no free page, the cached ones left, and 16 live
 * sequences (the id array's capacity). */
static int fx_build(fx *f, kvc_dtype dt, kvc_kv_format kf, int near_full, int collide) {
    memset(f, 0, sizeof *f);
    kvc_cache_params p;
    if (kf != KVC_KVFMT_NONE) {
        p = fmt_params(kf, 16, 24);
    } else {
        p = small_params(4, 24);
        p.dtype = dt;
        p.quant_group = 2;
        p.layout = collide ? KVC_HND : KVC_NHD;
    }
    if (collide == 2) p.enable_prefix_caching = 0;
    ASSERT_OK(kvc_cache_create(&p, &f->c));
    if (collide == 1) kvc__cache_set_hash_mask(f->c, 0); /* every page in one bucket, one hash */
    f->kvfmt = kf != KVC_KVFMT_NONE;
    f->ps = p.page_size;
    ASSERT_OK(kvc_cache_set_evict_hook(f->c, fx_evict, f));
    int tmp;
    if (!f->kvfmt) {
        if (fx_add(f, 1, 10, 0, &f->a)) return 1; /* 3 pages, the last partly filled */
        if (fx_fork(f, f->a, &f->b)) return 1;
        if (fx_add(f, 1, 9, 0, &f->h)) return 1;     /* hits a's 2 full pages */
        if (fx_add(f, 2, 9, 5, &f->d)) return 1;     /* salt 5 */
        ASSERT_OK(kvc_cache_free_sequence(f->c, f->id[f->d])); /* 2 pages cached */
        if (fx_add(f, 0, 6, 0, &f->e)) return 1;     /* no ids */
        if (fx_add(f, 3, 6, 0, &f->z)) return 1;
        ASSERT_OK(kvc_cache_truncate(f->c, f->id[f->z], 0)); /* its full page cached */
        if (fx_add(f, 4, 3, 0, &f->f)) return 1;     /* one partly filled page */
        if (fx_fork(f, f->f, &f->g)) return 1;
        ASSERT_OK(kvc_cache_append(f->c, f->id[f->h], NULL, 1, NULL)); /* h: 10 tokens */
    } else {
        if (fx_add(f, 1, 70, 0, &f->a)) return 1; /* a whole group, 6 tokens of the next */
        if (fx_fork(f, f->a, &f->b)) return 1;
        if (fx_add(f, 1, 64, 0, &f->h)) return 1;     /* 64 tokens: no hit (< len) */
        ASSERT_OK(kvc_cache_free_sequence(f->c, f->id[f->h]));
        if (fx_add(f, 1, 80, 0, &f->h)) return 1;     /* hits a's first group (used) */
        ASSERT_OK(kvc_cache_append(f->c, f->id[f->h], NULL, 48, NULL)); /* 128: group 1 reserved */
        if (fx_add(f, 2, 65, 5, &f->d)) return 1;
        ASSERT_OK(kvc_cache_free_sequence(f->c, f->id[f->d])); /* its group cached */
        if (fx_add(f, 0, 20, 0, &f->e)) return 1;
        if (fx_add(f, 3, 10, 0, &f->z)) return 1;
        ASSERT_OK(kvc_cache_truncate(f->c, f->id[f->z], 0));
        if (fx_add(f, 4, 20, 0, &f->f)) return 1; /* 2 pages of an incomplete group */
        if (fx_fork(f, f->f, &f->g)) return 1;
    }
    if (near_full) {
        kvc_cache_stats st;
        ASSERT_OK(kvc_cache_get_stats(f->c, &st));
        if (fx_add(f, 0, st.free_pages * f->ps, 0, &tmp)) return 1; /* takes the free pages */
        while (f->c->n_seqs < 16)
            if (fx_add(f, 0, 0, 0, &tmp)) return 1; /* empty sequences hold no page */
        ASSERT_OK(kvc_cache_get_stats(f->c, &st));
        ASSERT_EQ_I64(st.free_pages, 0);
        ASSERT_TRUE(st.cached_pages > 0);
        ASSERT_EQ_I64(f->c->n_seqs, f->c->seqs_cap);
    }
    ASSERT_OK(kvc_cache_check(f->c));
    if (f->kvfmt) ASSERT_OK(kvc_threadpool_create(2, &f->pool));
    return fx_fill(f);
}

static void fx_destroy(fx *f) {
    kvc_cache_destroy(f->c);
    kvc_threadpool_destroy(f->pool);
}

/* ---- snapshots ---- */

typedef struct fsnap {
    unsigned char *p;
    size_t n, cap;
    size_t mark[256];
    const char *what[256];
    int nmark;
} fsnap;

static void fs_put(fsnap *s, const void *d, size_t n) {
    if (s->n + n > s->cap) {
        size_t cap = s->cap ? s->cap : 4096;
        while (cap < s->n + n) cap *= 2;
        unsigned char *q = realloc(s->p, cap);
        if (!q) abort(); /* taken unarmed */
        s->p = q;
        s->cap = cap;
    }
    memcpy(s->p + s->n, d, n);
    s->n += n;
}
static void fs_i64(fsnap *s, int64_t v) { fs_put(s, &v, sizeof v); }
static void fs_mark(fsnap *s, const char *what) {
    if (s->nmark < 256) {
        s->mark[s->nmark] = s->n;
        s->what[s->nmark++] = what;
    }
}

static void fsnap_take(fx *f, fsnap *s) {
    kvc_cache *c = f->c;
    s->n = 0;
    s->nmark = 0;
    fs_mark(s, "stats");
    kvc_cache_stats st;
    fs_i64(s, kvc_cache_get_stats(c, &st));
    st.failed_allocs = 0; /* counts KVC_ERR_NO_SPACE failures by design */
    fs_put(s, &st, sizeof st);
    /* which pages the next calls take (free stack) or evict (LRU order), and
     * the sequence ids they hand out */
    fs_mark(s, "free stack, LRU order, next id");
    fs_put(s, c->free_stack, (size_t)c->n_free * sizeof(int32_t));
    for (int32_t q = c->lru_head; q != KVC__NO_PAGE; q = c->pages[q].next) fs_i64(s, q);
    fs_i64(s, c->next_id);
    fs_i64(s, c->n_indexed);
    fs_i64(s, f->evictions);
    const int L = c->p.num_layers;
    kvc_kvfmt fmt;
    size_t tb = 0, sb = 0;
    if (f->kvfmt && kvc_cache_kvfmt(c, &fmt) == KVC_OK) {
        tb = kvc_kvfmt_tail_bytes(&fmt);
        sb = kvc_kvfmt_sink_bytes(&fmt);
    }
    for (int i = 0; i < f->n; i++) {
        fs_mark(s, "a sequence's length and page table");
        int64_t len = -1, ni = -1;
        fs_i64(s, kvc_cache_seq_len(c, f->id[i], &len));
        fs_i64(s, len);
        int32_t indptr[2] = {0, 0}, idx[64], last = -1;
        kvc_status ps = kvc_cache_page_table(c, &f->id[i], 1, indptr, idx, 64, &last, &ni);
        fs_i64(s, ps);
        fs_i64(s, ni);
        fs_i64(s, last);
        if (ps == KVC_OK) fs_put(s, idx, (size_t)ni * sizeof(int32_t));
        if (!f->kvfmt) continue;
        fs_mark(s, "a sequence's compressed view (pages, tail, sink rows)");
        for (int l = 0; l < L; l++) {
            kvc_kvfmt_seq v;
            memset(&v, 0, sizeof v);
            kvc_status vs = kvc_cache_kvfmt_seqs(c, l, &f->id[i], 1, &v);
            fs_i64(s, vs);
            if (vs != KVC_OK) continue;
            fs_i64(s, v.n_kv);
            fs_put(s, v.pages, (size_t)((v.n_kv + f->ps - 1) / f->ps) * sizeof(int32_t));
            fs_put(s, v.tail, tb);
            if (v.sink) fs_put(s, v.sink, sb);
        }
    }
    const size_t pb = kvc_cache_page_bytes(c), skb = kvc_cache_sink_bytes(c);
    unsigned char *buf = malloc(pb > skb ? pb : skb);
    if (!buf) abort();
    int32_t tk[64];
    for (int32_t q = 0; q < c->num_pages; q++) {
        fs_mark(s, "a page's tokens, bytes and sink rows");
        memset(tk, 0, sizeof tk);
        fs_i64(s, kvc_cache_page_tokens(c, q, tk));
        fs_put(s, tk, (size_t)f->ps * sizeof(int32_t));
        kvc_cache_read_page(c, q, buf, pb);
        fs_put(s, buf, pb);
        if (skb) {
            kvc_status ks = kvc_cache_read_sink(c, q, buf, skb);
            fs_i64(s, ks);
            if (ks == KVC_OK) fs_put(s, buf, skb);
        }
    }
    free(buf);
    /* prefix lookups of every prompt, as given and one token longer (whole pages) */
    fs_mark(s, "prefix lookups");
    for (int i = 0; i < f->n; i++) {
        if (!f->ntok[i]) continue;
        int32_t t[FX_TOK + 1];
        memcpy(t, f->tok[i], (size_t)f->ntok[i] * sizeof(int32_t));
        t[f->ntok[i]] = -5;
        for (int64_t extra = 0; extra < 2; extra++) {
            int64_t hit = -1;
            fs_i64(s, kvc_cache_lookup_prefix(c, t, f->ntok[i] + extra, f->salt[i], &hit));
            fs_i64(s, hit);
        }
    }
    kvc_clear_error();
}

/* 0 when equal, else prints what differs and returns 1. */
static int fsnap_cmp(const fsnap *a, const fsnap *b, const char *when) {
    size_t n = a->n < b->n ? a->n : b->n, i = 0;
    while (i < n && a->p[i] == b->p[i]) i++;
    if (i == n && a->n == b->n) return 0;
    const char *what = "?";
    for (int m = 0; m < a->nmark && a->mark[m] <= i; m++) what = a->what[m];
    TEST_FAIL_("%s: the cache changed (snapshot byte %zu of %zu/%zu: %s)", when, i, a->n, b->n,
               what);
}

/* ---- the calls ---- */

enum {
    OP_ADD_MISS, OP_ADD_HIT_USED, OP_ADD_HIT_CACHED, OP_ADD_NULL, OP_ADD_EMPTY, OP_ADD_HUGE,
    OP_APPEND_COW, OP_APPEND_COW_FIRST, OP_APPEND_GROW, OP_APPEND_EMPTY, OP_APPEND_NULL,
    OP_APPEND_TOKENS, OP_FORK, OP_FORK_EMPTY, OP_TRUNCATE, OP_TRUNCATE_EX, OP_ROLLBACK,
    OP_FREE, OP_FREE_SHARED, OP_WRITE_PAGE, OP_WRITE_SINK, OP_KVFMT_APPEND,
    OP_KVFMT_APPEND_POOL, OP_KVFMT_APPEND_ATTN, OP_PAGED_APPEND, OP_COUNT
};
static const char *const op_names[OP_COUNT] = {
    "add (miss)", "add (hit on used pages)", "add (hit on cached pages)", "add (no ids)",
    "add (0 tokens)", "add (whole capacity)", "append (copy-on-write)",
    "append (copy-on-write of a first page)", "append (table grows)",
    "append (to a 0-length sequence)", "append (no ids)", "append (ids)", "fork",
    "fork (0-length)", "truncate", "truncate_ex", "rollback", "free", "free (shared pages)",
    "write_page", "write_sink", "kvc_kvfmt_append", "kvc_kvfmt_append (2 threads)",
    "kvc_kvfmt_append_attention", "kvc_append_paged_kv_cache"};

static float g_rows[16 * 2 * 8], g_q[2 * 2 * 8], g_out[2 * 2 * 8];

/* Stores rows for h (the last 8 of its reserved 128: completes K group 1)
 * and e (its last 3) in layer 0, as a model step does; attn: and attends
 * from h's last and e's last position (bad 4: below the tail's reach). */
static kvc_status fx_kvfmt_append(fx *f, int bad, int attn, kvc_threadpool *pool) {
    kvc_tensor pages, k, v;
    kvc_kvfmt fmt;
    kvc_kvfmt_seq s[2];
    kvc_status st = kvc_cache_kvfmt(f->c, &fmt);
    if (st != KVC_OK) return st;
    if ((st = kvc_cache_kvfmt_layer(f->c, 0, &pages)) != KVC_OK) return st;
    const kvc_seq_id ids[2] = {f->id[f->h], f->id[f->e]};
    if ((st = kvc_cache_kvfmt_seqs(f->c, 0, ids, 2, s)) != KVC_OK) return st;
    const int64_t indptr[3] = {0, 8, 11}, shape[3] = {11, fmt.num_kv_heads, fmt.head_dim};
    for (int i = 0; i < 11 * 16; i++) g_rows[i] = (float)((i * 37) % 19) * 0.25f - 2.0f;
    if (bad == 1) g_rows[5 * 16 + 3] = NAN;          /* nothing written */
    if (bad == 2) s[1].n_kv = 2;                     /* 3 rows, n_kv 2 */
    k = kvc_tensor_make(g_rows, KVC_F32, 3, shape);
    v = kvc_tensor_make(g_rows, KVC_F32, 3, shape);
    if (bad == 3) k.shape[0] = 10;                   /* rows != row_indptr */
    if (!attn) return kvc_kvfmt_append(&fmt, &pages, s, 2, indptr, &k, &v, pool);
    for (int i = 0; i < 32; i++) g_q[i] = (float)(i % 5) * 0.5f - 1.0f;
    const int64_t qshape[3] = {2, fmt.num_kv_heads, fmt.head_dim}; /* Hq = H */
    kvc_tensor q = kvc_tensor_make(g_q, KVC_F32, 3, qshape);
    kvc_tensor out = kvc_tensor_make(g_out, KVC_F32, 3, qshape);
    const int32_t q_seq[2] = {0, 1}, q_pos[2] = {bad == 4 ? 10 : 127, 19};
    const kvc_attn_params ap = kvc_attn_default_params();
    return kvc_kvfmt_append_attention(&fmt, &pages, s, 2, indptr, &k, &v, &q, q_seq, q_pos, &ap,
                                      &out, NULL, pool);
}

/* Per-token caches: K/V rows for e's last 2 positions (4, 5) in layer 0
 * through its page table; bad 1: a NaN into an int8 cache (float caches
 * take it), bad 2: position 6 beyond e's length. */
static kvc_status fx_paged_append(fx *f, int bad) {
    kvc_paged_cache pc;
    kvc_status st = kvc_cache_layer(f->c, 0, &pc);
    if (st != KVC_OK) return st;
    int32_t indptr[2], idx[8], last;
    int64_t n;
    if ((st = kvc_cache_page_table(f->c, &f->id[f->e], 1, indptr, idx, 8, &last, &n)) != KVC_OK)
        return st;
    const int64_t H = f->c->p.num_kv_heads, Dh = f->c->p.head_dim;
    for (int i = 0; i < 2 * H * Dh; i++) g_rows[i] = (float)i * 0.75f - 1.0f;
    if (bad == 1) g_rows[1] = NAN;
    const int32_t bi[2] = {0, 0}, pos[2] = {4, bad == 2 ? 6 : 5};
    const int64_t rs[3] = {2, H, Dh}, two = 2, one = 1;
    kvc_tensor k = kvc_tensor_make(g_rows, KVC_F32, 3, rs);
    kvc_tensor tb = kvc_tensor_make((void *)bi, KVC_I32, 1, &two);
    kvc_tensor tp = kvc_tensor_make((void *)pos, KVC_I32, 1, &two);
    kvc_tensor ti = kvc_tensor_make(idx, KVC_I32, 1, &n);
    kvc_tensor tq = kvc_tensor_make(indptr, KVC_I32, 1, &two);
    kvc_tensor tl = kvc_tensor_make(&last, KVC_I32, 1, &one);
    return kvc_append_paged_kv_cache(&k, &k, &tb, &tp, &pc, &ti, &tq, &tl, NULL);
}

/* A page held by one sequence only (e's first). */
static int32_t fx_page(fx *f, int role, int64_t j) {
    int32_t indptr[2], idx[64], last;
    int64_t n;
    if (kvc_cache_page_table(f->c, &f->id[role], 1, indptr, idx, 64, &last, &n) != KVC_OK ||
        j >= n)
        return -1;
    return idx[j];
}

static unsigned char g_page_src[1 << 16];

/* Runs op; *applies is 0 where it does not exist for this cache kind. */
static kvc_status fx_op(fx *f, int op, int *applies) {
    kvc_cache *c = f->c;
    const int64_t P = f->ps, big = f->kvfmt ? 70 : 11;
    int32_t t[FX_TOK];
    kvc_seq_id s;
    int64_t hit, kept;
    *applies = 1;
    switch (op) {
    case OP_ADD_MISS:
        for (int i = 0; i < big; i++) t[i] = fx_token(9, i);
        return kvc_cache_add_sequence(c, t, big, 0, &s, &hit);
    case OP_ADD_HIT_USED: /* a's whole pages (groups), then other tokens */
        for (int i = 0; i < big; i++) t[i] = i < big - 6 ? fx_token(1, i) : fx_token(8, i);
        return kvc_cache_add_sequence(c, t, big, 0, &s, &hit);
    case OP_ADD_HIT_CACHED: /* d's, salt 5 */
        for (int i = 0; i < big + P; i++) t[i] = fx_token(2, i);
        return kvc_cache_add_sequence(c, t, big + P, 5, &s, &hit);
    case OP_ADD_NULL: return kvc_cache_add_sequence(c, NULL, P + 1, 0, &s, &hit);
    case OP_ADD_EMPTY:
        t[0] = 1;
        return kvc_cache_add_sequence(c, t, 0, 0, &s, &hit);
    case OP_ADD_HUGE:
        return kvc_cache_add_sequence(c, NULL, kvc_cache_capacity_tokens(c), 0, &s, &hit);
    case OP_APPEND_COW: /* b shares a's partly filled last page (group) */
        for (int i = 0; i < 3; i++) t[i] = fx_token(5, i);
        return kvc_cache_append(c, f->id[f->b], t, 3, NULL);
    case OP_APPEND_COW_FIRST: /* g shares f's first page */
        return kvc_cache_append(c, f->id[f->g], NULL, 2, NULL);
    case OP_APPEND_GROW: { /* a's page table outgrows its capacity */
        const int64_t n = f->kvfmt ? 60 : 8;
        int32_t pos[64];
        for (int i = 0; i < n; i++) t[i] = fx_token(6, i);
        return kvc_cache_append(c, f->id[f->a], t, n, pos);
    }
    case OP_APPEND_EMPTY: return kvc_cache_append(c, f->id[f->z], NULL, 1, NULL);
    case OP_APPEND_NULL: return kvc_cache_append(c, f->id[f->e], NULL, 2, NULL);
    case OP_APPEND_TOKENS: /* h: completes a page */
        for (int i = 0; i < P; i++) t[i] = fx_token(7, i);
        return kvc_cache_append(c, f->id[f->h], t, P - 2, NULL);
    case OP_FORK: return kvc_cache_fork(c, f->id[f->a], &s);
    case OP_FORK_EMPTY: return kvc_cache_fork(c, f->id[f->z], &s);
    case OP_TRUNCATE: return kvc_cache_truncate(c, f->id[f->a], f->kvfmt ? 64 : 5);
    case OP_TRUNCATE_EX: return kvc_cache_truncate_ex(c, f->id[f->a], f->kvfmt ? 30 : 5, &kept);
    case OP_ROLLBACK: return kvc_cache_rollback(c, f->id[f->h], f->kvfmt ? 100 : 5);
    case OP_FREE: return kvc_cache_free_sequence(c, f->id[f->h]);
    case OP_FREE_SHARED: return kvc_cache_free_sequence(c, f->id[f->a]);
    case OP_WRITE_PAGE:
        return kvc_cache_write_page(c, fx_page(f, f->e, 0), g_page_src, kvc_cache_page_bytes(c));
    case OP_WRITE_SINK:
        if (!kvc_cache_sink_bytes(c)) break;
        return kvc_cache_write_sink(c, fx_page(f, f->e, 0), g_page_src, kvc_cache_sink_bytes(c));
    case OP_KVFMT_APPEND:
    case OP_KVFMT_APPEND_POOL:
    case OP_KVFMT_APPEND_ATTN:
        if (!f->kvfmt) break;
        return fx_kvfmt_append(f, 0, op == OP_KVFMT_APPEND_ATTN,
                               op == OP_KVFMT_APPEND_POOL ? f->pool : NULL);
    case OP_PAGED_APPEND:
        if (f->kvfmt) break;
        return fx_paged_append(f, 0);
    }
    *applies = 0;
    return KVC_OK;
}

/* Calls that must fail on their arguments (want: the status). */
enum {
    BAD_ADD_NULL_CACHE, BAD_ADD_NULL_SEQ, BAD_ADD_NEG, BAD_ADD_OVER, BAD_APPEND_UNKNOWN,
    BAD_APPEND_FREED, BAD_APPEND_NEG_ID, BAD_APPEND_NEG, BAD_APPEND_OVER, BAD_APPEND_NULL_CACHE,
    BAD_FORK_UNKNOWN, BAD_FORK_NULL_CHILD, BAD_FORK_NULL_CACHE, BAD_TRUNC_OVER, BAD_TRUNC_NEG,
    BAD_TRUNC_UNKNOWN, BAD_TRUNC_GROUP, BAD_TRUNC_EX_OVER, BAD_ROLLBACK_OVER, BAD_ROLLBACK_NEG,
    BAD_ROLLBACK_FREED, BAD_FREE_UNKNOWN, BAD_FREE_FREED, BAD_FREE_NULL_CACHE, BAD_WP_SHARED,
    BAD_WP_CACHED, BAD_WP_RANGE, BAD_WP_SIZE, BAD_WP_NULL, BAD_WS_NOT_FIRST, BAD_WS_SHARED,
    BAD_WS_SIZE, BAD_HOOK_NULL_CACHE, BAD_KVFMT_NAN, BAD_KVFMT_NKV, BAD_KVFMT_SHAPE,
    BAD_KVFMT_QPOS, BAD_PAGED_NAN, BAD_PAGED_POS, BAD_COUNT
};

static kvc_status fx_bad(fx *f, int op, kvc_status *want, int *applies) {
    kvc_cache *c = f->c;
    int32_t t[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    kvc_seq_id s, unknown = f->c->next_id + 7;
    int64_t hit, len = 0;
    const size_t pb = kvc_cache_page_bytes(c), sb = kvc_cache_sink_bytes(c);
    kvc_cache_seq_len(c, f->id[f->a], &len);
    *applies = 1;
    *want = KVC_ERR_INVALID_ARG;
    switch (op) {
    case BAD_ADD_NULL_CACHE: return kvc_cache_add_sequence(NULL, t, 4, 0, &s, &hit);
    case BAD_ADD_NULL_SEQ: return kvc_cache_add_sequence(c, t, 4, 0, NULL, &hit);
    case BAD_ADD_NEG: return kvc_cache_add_sequence(c, t, -1, 0, &s, &hit);
    case BAD_ADD_OVER:
        return kvc_cache_add_sequence(c, NULL, kvc_cache_capacity_tokens(c) + 1, 0, &s, &hit);
    case BAD_APPEND_UNKNOWN:
        *want = KVC_ERR_NOT_FOUND;
        return kvc_cache_append(c, unknown, t, 1, NULL);
    case BAD_APPEND_FREED:
        *want = KVC_ERR_NOT_FOUND;
        return kvc_cache_append(c, f->id[f->d], t, 1, NULL);
    case BAD_APPEND_NEG_ID: *want = KVC_ERR_NOT_FOUND; return kvc_cache_append(c, -1, t, 1, NULL);
    case BAD_APPEND_NEG: return kvc_cache_append(c, f->id[f->a], t, -1, NULL);
    case BAD_APPEND_OVER:
        return kvc_cache_append(c, f->id[f->a], NULL, kvc_cache_capacity_tokens(c) - len + 1, NULL);
    case BAD_APPEND_NULL_CACHE: return kvc_cache_append(NULL, f->id[f->a], t, 1, NULL);
    case BAD_FORK_UNKNOWN: *want = KVC_ERR_NOT_FOUND; return kvc_cache_fork(c, unknown, &s);
    case BAD_FORK_NULL_CHILD: return kvc_cache_fork(c, f->id[f->a], NULL);
    case BAD_FORK_NULL_CACHE: return kvc_cache_fork(NULL, f->id[f->a], &s);
    case BAD_TRUNC_OVER: return kvc_cache_truncate(c, f->id[f->a], len + 1);
    case BAD_TRUNC_NEG: return kvc_cache_truncate(c, f->id[f->a], -1);
    case BAD_TRUNC_UNKNOWN: *want = KVC_ERR_NOT_FOUND; return kvc_cache_truncate(c, unknown, 0);
    case BAD_TRUNC_GROUP: /* inside a quantized group */
        if (!f->kvfmt) break;
        return kvc_cache_truncate(c, f->id[f->a], 30);
    case BAD_TRUNC_EX_OVER: return kvc_cache_truncate_ex(c, f->id[f->a], len + 1, &hit);
    case BAD_ROLLBACK_OVER: return kvc_cache_rollback(c, f->id[f->a], len + 1);
    case BAD_ROLLBACK_NEG: return kvc_cache_rollback(c, f->id[f->a], -3);
    case BAD_ROLLBACK_FREED:
        *want = KVC_ERR_NOT_FOUND;
        return kvc_cache_rollback(c, f->id[f->d], 0);
    case BAD_FREE_UNKNOWN: *want = KVC_ERR_NOT_FOUND; return kvc_cache_free_sequence(c, unknown);
    case BAD_FREE_FREED: *want = KVC_ERR_NOT_FOUND; return kvc_cache_free_sequence(c, f->id[f->d]);
    case BAD_FREE_NULL_CACHE: return kvc_cache_free_sequence(NULL, f->id[f->a]);
    case BAD_WP_SHARED: return kvc_cache_write_page(c, fx_page(f, f->a, 0), g_page_src, pb);
    case BAD_WP_CACHED: return kvc_cache_write_page(c, c->lru_head, g_page_src, pb);
    case BAD_WP_RANGE: return kvc_cache_write_page(c, (int32_t)c->num_pages, g_page_src, pb);
    case BAD_WP_SIZE: return kvc_cache_write_page(c, fx_page(f, f->e, 0), g_page_src, pb - 1);
    case BAD_WP_NULL: return kvc_cache_write_page(c, fx_page(f, f->e, 0), NULL, pb);
    case BAD_WS_NOT_FIRST: /* kivi4: e's second page holds no sink rows; else none at all */
        return kvc_cache_write_sink(c, fx_page(f, f->e, 1), g_page_src, sb ? sb : 8);
    case BAD_WS_SHARED:
        if (!sb) break;
        return kvc_cache_write_sink(c, fx_page(f, f->a, 0), g_page_src, sb);
    case BAD_WS_SIZE:
        if (!sb) break;
        return kvc_cache_write_sink(c, fx_page(f, f->e, 0), g_page_src, sb + 2);
    case BAD_HOOK_NULL_CACHE: return kvc_cache_set_evict_hook(NULL, fx_evict, f);
    case BAD_KVFMT_NAN:
    case BAD_KVFMT_NKV:
    case BAD_KVFMT_SHAPE:
        if (!f->kvfmt) break;
        return fx_kvfmt_append(f, op - BAD_KVFMT_NAN + 1, 0, NULL);
    case BAD_KVFMT_QPOS:
        if (!f->kvfmt) break;
        return fx_kvfmt_append(f, 4, 1, NULL);
    case BAD_PAGED_NAN:
        if (f->kvfmt || c->p.dtype != KVC_I8) break;
        return fx_paged_append(f, 1);
    case BAD_PAGED_POS:
        if (f->kvfmt) break;
        return fx_paged_append(f, 2);
    }
    *applies = 0;
    return KVC_OK;
}

/* After a failed call: an error with a message, every invariant, nothing changed. */
static int fx_failed(fx *f, kvc_status st, const fsnap *before, fsnap *tmp, const char *when) {
    if (st == KVC_OK) TEST_FAIL_("%s: succeeded", when);
    if (kvc_last_error()[0] == 0) TEST_FAIL_("%s: %s without a message", when, kvc_status_str(st));
    kvc_status ck = kvc_cache_check(f->c);
    if (ck != KVC_OK) TEST_FAIL_("%s: kvc_cache_check: %s", when, kvc_last_error());
    fsnap_take(f, tmp);
    return fsnap_cmp(before, tmp, when);
}

typedef struct fx_kind {
    const char *name;
    kvc_dtype dt;
    kvc_kv_format kf;
    int near_full;
    int collide; /* 1: every hash collides (HND for a per-token cache); 2: no prefix caching */
} fx_kind;

static int fx_case(const fx_kind *kd, fsnap *s0, fsnap *s1, fsnap *ref, int *n_failures) {
    fx f;
    char when[256];
    /* invalid arguments */
    for (int op = 0; op < BAD_COUNT; op++) {
        if (fx_build(&f, kd->dt, kd->kf, kd->near_full, kd->collide)) return 1;
        fsnap_take(&f, s0);
        kvc_status want;
        int applies;
        kvc_clear_error();
        kvc_status st = fx_bad(&f, op, &want, &applies);
        snprintf(when, sizeof when, "%s: invalid call %d (%s)", kd->name, op, kvc_last_error());
        if (applies) {
            if (st != want)
                TEST_FAIL_("%s: %s, want %s", when, kvc_status_str(st), kvc_status_str(want));
            if (fx_failed(&f, st, s0, s1, when)) return 1;
        }
        fx_destroy(&f);
    }
    /* each call with its k-th allocation failing, then every one from the k-th on */
    for (int op = 0; op < OP_COUNT; op++) {
        int applies;
        if (fx_build(&f, kd->dt, kd->kf, kd->near_full, kd->collide)) return 1;
        fsnap_take(&f, s0);
        kvc_clear_error();
        const kvc_status want = fx_op(&f, op, &applies);
        snprintf(when, sizeof when, "%s: %s unarmed (%s)", kd->name, op_names[op],
                 kvc_last_error());
        if (want != KVC_OK && applies) /* out of pages (near full) */
            if (want != KVC_ERR_NO_SPACE || fx_failed(&f, want, s0, s1, when)) {
                TEST_FAIL_("%s: %s", when, kvc_status_str(want));
            }
        ASSERT_OK(kvc_cache_check(f.c));
        fsnap_take(&f, ref);
        fx_destroy(&f);
        if (!applies || !test_oom_available()) continue;
        for (long k = 1;; k++) {
            long failed = 0;
            for (int sticky = 0; sticky < 2; sticky++) {
                if (fx_build(&f, kd->dt, kd->kf, kd->near_full, kd->collide)) return 1;
                fsnap_take(&f, s0);
                kvc_clear_error();
                test_oom_arm(k, sticky);
                kvc_status st = fx_op(&f, op, &applies);
                failed = test_oom_disarm();
                snprintf(when, sizeof when, "%s: %s, allocation %ld%s failing (%s)", kd->name,
                         op_names[op], k, sticky ? " and later ones" : "", kvc_last_error());
                if (failed && st != KVC_OK) {
                    (*n_failures)++;
                    if (fx_failed(&f, st, s0, s1, when)) return 1;
                    /* nothing hidden changed either: the call now does what it does
                     * on a fresh state */
                    kvc_clear_error();
                    st = fx_op(&f, op, &applies);
                }
                if (st != want) TEST_FAIL_("%s: then %s, want %s", when, kvc_status_str(st),
                                           kvc_status_str(want));
                ASSERT_OK(kvc_cache_check(f.c));
                fsnap_take(&f, s1);
                if (fsnap_cmp(ref, s1, when)) return 1;
                fx_destroy(&f);
                if (!failed) break; /* the call made fewer than k allocations */
            }
            if (!failed) break;
            ASSERT_TRUE(k < 64);
        }
    }
    return 0;
}

TEST(failed_calls_change_nothing) {
    static const fx_kind kinds[] = {
        {"f32", KVC_F32, KVC_KVFMT_NONE, 0, 0},
        {"f32 near full", KVC_F32, KVC_KVFMT_NONE, 1, 0},
        {"int8", KVC_I8, KVC_KVFMT_NONE, 0, 0},
        {"int4 HND, colliding hashes", KVC_I4, KVC_KVFMT_NONE, 0, 1},
        {"kivi8", KVC_F16, KVC_KVFMT_KIVI8, 0, 0},
        {"kivi8 near full, colliding hashes", KVC_F16, KVC_KVFMT_KIVI8, 1, 1},
        {"kivi4", KVC_F16, KVC_KVFMT_KIVI4, 0, 0},
        {"kivi4 near full", KVC_F16, KVC_KVFMT_KIVI4, 1, 0},
        {"kivi4, no prefix caching", KVC_F16, KVC_KVFMT_KIVI4, 0, 2},
    };
    for (size_t i = 0; i < sizeof g_page_src; i++) g_page_src[i] = (unsigned char)(i * 13 + 1);
    fsnap s0, s1, ref;
    memset(&s0, 0, sizeof s0);
    memset(&s1, 0, sizeof s1);
    memset(&ref, 0, sizeof ref);
    int n_failures = 0, rc = 0;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0] && !rc; i++)
        rc = fx_case(&kinds[i], &s0, &s1, &ref, &n_failures);
    free(s0.p);
    free(s1.p);
    free(ref.p);
    if (rc) return 1;
    if (!test_oom_available()) SKIP("allocation failures need the linker's --wrap");
    printf("  %d failed calls checked\n", n_failures);
    ASSERT_TRUE(n_failures > 100);
    return 0;
}

const char *test_suite_name = "cache";
const test_case test_suite[] = {
    TEST_ENTRY(params),
    TEST_ENTRY(bad_args_and_unknown_ids),
    TEST_ENTRY(page_tables), TEST_ENTRY(page_tables_over_their_seqs),
    TEST_ENTRY(prefix_hits),
    TEST_ENTRY(lookup_prefix_matches_add),
    TEST_ENTRY(eviction_order),
    TEST_ENTRY(cow_copies_data_and_scales),
    TEST_ENTRY(truncate_and_cow),
    TEST_ENTRY(no_space_changes_nothing),
    TEST_ENTRY(nomem_every_allocation_site),
    TEST_ENTRY(randomized_against_model),
    TEST_ENTRY(randomized_kvfmt_against_model),
    TEST_ENTRY(duplicate_pages_stay_findable),
    TEST_ENTRY(rollback_unregisters_unwritten_pages),
    TEST_ENTRY(hash_collisions_are_confirmed),
    TEST_ENTRY(kvfmt_create),
    TEST_ENTRY(kvfmt_prefix_hits_whole_groups),
    TEST_ENTRY(kvfmt_fork_copies_tails),
    TEST_ENTRY(kvfmt_cow_incomplete_group),
    TEST_ENTRY(kvfmt_sink_rows_follow_the_first_page),
    TEST_ENTRY(kvfmt_truncate_rules),
    TEST_ENTRY(large_pool_asks_for_huge_pages),
    TEST_ENTRY(failed_calls_change_nothing),
    {0, 0},
};
