/*
 * Paged KV storage (SEMANTICS section 4) against a plain per-token C
 * reference: every append is compared byte for byte over the whole cache and
 * scale buffers (padding included), float storage exactly, quantized storage
 * against kvc_quantize of the same rows; on every ISA the CPU supports and
 * with 1 and 2 threads. Plus page-table helpers against their formulas, pmx
 * <-> CSR conversions, an end-to-end read back through the pmx dynamic
 * operator, and rejected calls leaving every buffer unchanged.
 */
#include <stdlib.h>

#include "test_elems.h"
#include "kernels/kernels.h" /* kvc__set_llc_bytes */

static void fill_bytes(void *p, size_t n, uint64_t *rng) {
    for (size_t i = 0; i < n; i++) ((unsigned char *)p)[i] = (unsigned char)test_rng_next(rng);
}

/* Zeroed and 64-byte aligned, so unpadded rows line up as an allocator would
 * give them (the streaming store path needs aligned 128-element blocks). */
static void *xcalloc(size_t n) {
    const size_t r = (n + 63) / 64 * 64;
    void *p = aligned_alloc(64, r ? r : 64);
    if (p) memset(p, 0, r ? r : 64);
    return p;
}

static int64_t offset_of(const kvc_tensor *t, const int64_t *idx) {
    int64_t o = 0;
    for (int i = 0; i < t->ndim; i++) o += idx[i] * t->stride[i];
    return o;
}

/* A view of a buffer with shape, optionally padded: each stride is the next
 * dim's extent plus 8 elements (even, so valid for int4). Returns elements
 * the buffer needs. */
static int64_t make_view(kvc_tensor *t, void *data, kvc_dtype dt, int ndim, const int64_t *shape,
                         int pad) {
    *t = kvc_tensor_make(data, dt, ndim, shape);
    for (int i = ndim - 2; i >= 0; i--)
        t->stride[i] = shape[i + 1] * t->stride[i + 1] + (pad ? 8 : 0);
    return ndim ? shape[0] * t->stride[0] + (pad ? 8 : 0) : 1;
}

/* ---- a batch of requests and its page table ---------------------------------------- */

#define MAX_REQ 160

typedef struct batch {
    int B;
    int32_t seq[MAX_REQ], app[MAX_REQ]; /* tokens after the append, tokens appended */
    int64_t P, max_pages, nnz;
    int32_t indptr[MAX_REQ + 1], last[MAX_REQ], app_indptr[MAX_REQ + 1];
    int32_t *indices;     /* (indptr[B]) */
    int32_t *bi, *pos;    /* (nnz) */
} batch;

/* Builds the CSR table (pages handed out shuffled from max_pages = used + 3)
 * and the rows through kvc_get_seq_lens / kvc_get_batch_indices_positions;
 * shuffle permutes the rows. 0 on success. */
static int batch_init(batch *bt, int B, const int32_t *seq, const int32_t *app, int64_t P,
                      int shuffle, uint64_t *rng) {
    memset(bt, 0, sizeof *bt);
    bt->B = B;
    bt->P = P;
    for (int b = 0; b < B; b++) {
        bt->seq[b] = seq[b];
        bt->app[b] = app[b];
        int32_t pages = (int32_t)((seq[b] + P - 1) / P);
        bt->indptr[b + 1] = bt->indptr[b] + pages;
        bt->last[b] = pages ? (int32_t)(seq[b] - (pages - 1) * P) : 0;
        bt->app_indptr[b + 1] = bt->app_indptr[b] + app[b];
    }
    int64_t used = bt->indptr[B];
    bt->max_pages = used + 3;
    bt->nnz = bt->app_indptr[B];
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)bt->max_pages);
    bt->indices = malloc(sizeof(int32_t) * (size_t)(used + 1));
    bt->bi = malloc(sizeof(int32_t) * (size_t)(bt->nnz + 1));
    bt->pos = malloc(sizeof(int32_t) * (size_t)(bt->nnz + 1));
    for (int64_t i = 0; i < bt->max_pages; i++) perm[i] = (int32_t)i;
    for (int64_t i = bt->max_pages - 1; i > 0; i--) {
        int64_t j = (int64_t)(test_rng_next(rng) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    memcpy(bt->indices, perm, sizeof(int32_t) * (size_t)used);
    free(perm);
    /* Rows from the library's helpers (checked against formulas elsewhere). */
    int64_t nb = B, nb1 = B + 1, nnz = bt->nnz;
    int32_t seq_lens[MAX_REQ];
    kvc_tensor t_indptr = kvc_tensor_make(bt->indptr, KVC_I32, 1, &nb1);
    kvc_tensor t_last = kvc_tensor_make(bt->last, KVC_I32, 1, &nb);
    kvc_tensor t_seq = kvc_tensor_make(seq_lens, KVC_I32, 1, &nb);
    kvc_tensor t_app = kvc_tensor_make(bt->app_indptr, KVC_I32, 1, &nb1);
    kvc_tensor t_bi = kvc_tensor_make(bt->bi, KVC_I32, 1, &nnz);
    kvc_tensor t_pos = kvc_tensor_make(bt->pos, KVC_I32, 1, &nnz);
    if (kvc_get_seq_lens(&t_indptr, &t_last, (int32_t)P, &t_seq) != KVC_OK) return 1;
    for (int b = 0; b < B; b++)
        if (seq_lens[b] != seq[b]) return 1;
    if (kvc_get_batch_indices_positions(&t_app, &t_seq, nnz, &t_bi, &t_pos) != KVC_OK) return 1;
    for (int64_t i = nnz - 1; shuffle && i > 0; i--) {
        int64_t j = (int64_t)(test_rng_next(rng) % (uint64_t)(i + 1));
        int32_t tb = bt->bi[i], tp = bt->pos[i];
        bt->bi[i] = bt->bi[j], bt->pos[i] = bt->pos[j];
        bt->bi[j] = tb, bt->pos[j] = tp;
    }
    return 0;
}

static void batch_free(batch *bt) {
    free(bt->indices);
    free(bt->bi);
    free(bt->pos);
}

/* Page and slot of row j. */
static void row_dest(const batch *bt, int64_t j, int64_t *page, int64_t *slot) {
    int32_t b = bt->bi[j], p = bt->pos[j];
    *page = bt->indices[bt->indptr[b] + p / bt->P];
    *slot = p % bt->P;
}

/* ---- KV append against the reference ------------------------------------------------- */

typedef struct append_case {
    int layout, combined, padded, shuffle;
    int64_t H, Dh;
    int group;
    kvc_dtype t1, t2, t3; /* input, cache, scale */
} append_case;

/* Reference store of one input row (Dh elements at xo) into cache element
 * offset co / scale offset so. */
static int ref_store(const append_case *k, const void *x, int64_t xo, void *cache, int64_t co,
                     void *scale, int64_t so) {
    const int bits = k->t1 != k->t2 && (k->t2 == KVC_I8 || k->t2 == KVC_I4)
                         ? (k->t2 == KVC_I8 ? 8 : 4) : 0;
    if (!bits) {
        for (int64_t d = 0; d < k->Dh; d++) set_f(cache, k->t2, co + d, get_f(x, k->t1, xo + d));
        return 0;
    }
    unsigned char q[512], s[256];
    const void *row = (const char *)x + dt_bytes(k->t1, xo);
    if (kvc_quantize(row, k->t1, k->Dh, bits, k->group, q, s, k->t3) != KVC_OK) return 1;
    memcpy((char *)cache + dt_bytes(k->t2, co), q, dt_bytes(k->t2, k->Dh));
    memcpy((char *)scale + dt_bytes(k->t3, so), s, dt_bytes(k->t3, k->Dh / k->group));
    return 0;
}

static int run_append(const append_case *k, const batch *bt, int n_threads, uint64_t seed) {
    uint64_t rng = seed;
    const int64_t H = k->H, Dh = k->Dh, P = bt->P, MP = bt->max_pages, nnz = bt->nnz;
    const int64_t G = Dh / k->group;
    const int hnd = k->layout == KVC_HND;
    /* Cache buffers: one combined (MP, 2, a, b, Dh) or two (MP, a, b, Dh). */
    const int64_t a = hnd ? H : P, bb = hnd ? P : H;
    int64_t csh5[5] = {MP, 2, a, bb, Dh}, ssh5[5] = {MP, 2, a, bb, G};
    int64_t csh4[4] = {MP, a, bb, Dh}, ssh4[4] = {MP, a, bb, G};
    kvc_paged_cache pc;
    memset(&pc, 0, sizeof pc);
    kvc_tensor tc5, ts5, tmp;
    int64_t n_c, n_s; /* elements per buffer */
    void *cbuf[2] = {NULL, NULL}, *sbuf[2] = {NULL, NULL};
    if (k->combined) {
        n_c = make_view(&tmp, NULL, k->t2, 5, csh5, k->padded);
        n_s = make_view(&tmp, NULL, k->t3, 5, ssh5, k->padded);
    } else {
        n_c = make_view(&tmp, NULL, k->t2, 4, csh4, k->padded);
        n_s = make_view(&tmp, NULL, k->t3, 4, ssh4, k->padded);
    }
    const int nbuf = k->combined ? 1 : 2;
    void *rc[2] = {NULL, NULL}, *rs[2] = {NULL, NULL};
    for (int i = 0; i < nbuf; i++) {
        cbuf[i] = xcalloc(dt_bytes(k->t2, n_c));
        sbuf[i] = xcalloc(dt_bytes(k->t3, n_s));
        rc[i] = xcalloc(dt_bytes(k->t2, n_c));
        rs[i] = xcalloc(dt_bytes(k->t3, n_s));
        fill_bytes(cbuf[i], dt_bytes(k->t2, n_c), &rng);
        fill_bytes(sbuf[i], dt_bytes(k->t3, n_s), &rng);
        memcpy(rc[i], cbuf[i], dt_bytes(k->t2, n_c));
        memcpy(rs[i], sbuf[i], dt_bytes(k->t3, n_s));
    }
    if (k->combined) {
        make_view(&tc5, cbuf[0], k->t2, 5, csh5, k->padded);
        make_view(&ts5, sbuf[0], k->t3, 5, ssh5, k->padded);
        if (kvc_paged_cache_from_combined(&tc5, &ts5, (kvc_kv_layout)k->layout, k->group, &pc) !=
            KVC_OK) {
            fprintf(stderr, "  from_combined: %s\n", kvc_last_error());
            return 1;
        }
    } else {
        make_view(&pc.k, cbuf[0], k->t2, 4, csh4, k->padded);
        make_view(&pc.v, cbuf[1], k->t2, 4, csh4, k->padded);
        make_view(&pc.k_scale, sbuf[0], k->t3, 4, ssh4, k->padded);
        make_view(&pc.v_scale, sbuf[1], k->t3, 4, ssh4, k->padded);
        pc.layout = (kvc_kv_layout)k->layout;
        pc.quant_group = k->group;
    }
    /* Inputs (nnz, H, Dh), padded like the cache. */
    int64_t ish[3] = {nnz, H, Dh};
    kvc_tensor tk, tv;
    int64_t n_in = make_view(&tk, NULL, k->t1, 3, ish, k->padded);
    void *xk = xcalloc(dt_bytes(k->t1, n_in)), *xv = xcalloc(dt_bytes(k->t1, n_in));
    fill_random(xk, k->t1, n_in, &rng, 3.0f);
    fill_random(xv, k->t1, n_in, &rng, 0.5f);
    if (nnz > 0 && k->group <= Dh) /* an all-zero group: the 1e-5 scale floor */
        for (int d = 0; d < k->group; d++) set_f(xk, k->t1, d, 0.0f);
    make_view(&tk, xk, k->t1, 3, ish, k->padded);
    make_view(&tv, xv, k->t1, 3, ish, k->padded);
    int64_t nb = bt->B, nb1 = bt->B + 1, np = bt->indptr[bt->B];
    kvc_tensor t_bi = kvc_tensor_make(bt->bi, KVC_I32, 1, &nnz);
    kvc_tensor t_pos = kvc_tensor_make(bt->pos, KVC_I32, 1, &nnz);
    kvc_tensor t_ind = kvc_tensor_make(bt->indices, KVC_I32, 1, &np);
    kvc_tensor t_indptr = kvc_tensor_make((void *)bt->indptr, KVC_I32, 1, &nb1);
    kvc_tensor t_last = kvc_tensor_make((void *)bt->last, KVC_I32, 1, &nb);

    int bad = 0;
    kvc_status st = kvc_append_paged_kv_cache(&tk, &tv, &t_bi, &t_pos, &pc, &t_ind, &t_indptr,
                                              &t_last, test_pool(n_threads));
    if (st != KVC_OK) {
        fprintf(stderr, "  append failed: %s\n", kvc_last_error());
        bad = 5;
    }
    /* Reference: same views over the reference buffers. */
    kvc_tensor rk = pc.k, rv = pc.v, rks = pc.k_scale, rvs = pc.v_scale;
    const char *cb0 = cbuf[0], *sb0 = sbuf[0];
    rk.data = (char *)rc[0] + ((const char *)pc.k.data - cb0);
    rks.data = (char *)rs[0] + ((const char *)pc.k_scale.data - sb0);
    if (k->combined) {
        rv.data = (char *)rc[0] + ((const char *)pc.v.data - cb0);
        rvs.data = (char *)rs[0] + ((const char *)pc.v_scale.data - sb0);
    } else {
        rv.data = rc[1];
        rvs.data = rs[1];
    }
    for (int64_t j = 0; j < nnz && !bad; j++) {
        int64_t page, slot;
        row_dest(bt, j, &page, &slot);
        for (int kv = 0; kv < 2; kv++)
            for (int64_t h = 0; h < H; h++) {
                const kvc_tensor *c = kv ? &rv : &rk, *s = kv ? &rvs : &rks;
                int64_t ci[4] = {page, hnd ? h : slot, hnd ? slot : h, 0}, ii[3] = {j, h, 0};
                if (ref_store(k, kv ? xv : xk, offset_of(&tk, ii), c->data, offset_of(c, ci),
                              s->data, offset_of(s, ci)))
                    bad = 6;
            }
    }
    for (int i = 0; i < nbuf && !bad; i++) {
        if (memcmp(cbuf[i], rc[i], dt_bytes(k->t2, n_c))) bad = 1;
        else if (memcmp(sbuf[i], rs[i], dt_bytes(k->t3, n_s))) bad = 2;
    }
    if (bad)
        fprintf(stderr, "  append mismatch (%d) %s P %lld %s%s%s t1 %s t2 %s t3 %s group %d "
                "threads %d isa %s\n", bad, hnd ? "HND" : "NHD", (long long)P,
                k->combined ? "combined" : "split", k->padded ? " padded" : "",
                k->shuffle ? " shuffled" : "", kvc_dtype_name(k->t1), kvc_dtype_name(k->t2),
                kvc_dtype_name(k->t3), k->group, n_threads, kvc_isa_name(kvc_get_isa()));
    for (int i = 0; i < nbuf; i++) free(cbuf[i]), free(sbuf[i]), free(rc[i]), free(rs[i]);
    free(xk), free(xv);
    return bad;
}

/* A ragged batch for page size P: a few tokens onto 2 full pages, an empty
 * request, a decode step onto a full page, a first token, a long prefill
 * over a history crossing the 64-row task chunks, a short prefill. */
static void grid_batch(int64_t P, int32_t *seq, int32_t *app) {
    const int32_t p = (int32_t)P;
    int32_t s[6] = {2 * p + 3, 0, p + 1, 1, 3 * p + 70, 7}, a[6] = {3, 0, 1, 1, 3 * p + 60, 7};
    memcpy(seq, s, sizeof s);
    memcpy(app, a, sizeof a);
}

TEST(append_grid) {
    static const int64_t pages[4] = {1, 5, 16, 128};
    static const kvc_dtype stores[5] = {KVC_F32, KVC_F16, KVC_BF16, KVC_I8, KVC_I4};
    static const kvc_dtype floats[3] = {KVC_F32, KVC_F16, KVC_BF16};
    int n_cases = 0;
    FOR_EACH_ISA({
        for (int pi = 0; pi < 4; pi++) {
            int32_t seq[6], app[6];
            grid_batch(pages[pi], seq, app);
            for (int padded = 0; padded < 2; padded++) {
                batch bt;
                uint64_t rng = test_seed + (uint64_t)(pi * 2 + padded);
                ASSERT_TRUE(batch_init(&bt, 6, seq, app, pages[pi], padded, &rng) == 0);
                for (int layout = 0; layout < 2; layout++)
                    for (int comb = 0; comb < 2; comb++)
                        for (int si = 0; si < 5; si++) {
                            int rot = (layout + 2 * comb + pi + padded + si) % 4;
                            kvc_dtype t2 = stores[si], t1 = rot == 3 ? t2 : floats[rot];
                            append_case k = {layout, comb, padded, padded, 3, 32,
                                             (rot & 1) ? 16 : 8, t1, t2,
                                             (rot >> 1) ? KVC_F16 : KVC_F32};
                            for (int th = 1; th <= 2; th++) {
                                int r = run_append(&k, &bt, th, test_seed ^ (uint64_t)n_cases);
                                if (r) batch_free(&bt);
                                ASSERT_EQ_I64(r, 0);
                                n_cases++;
                            }
                        }
                batch_free(&bt);
            }
        }
    });
    ASSERT_TRUE(n_cases >= 320);
    return 0;
}

/* Calls that move more than the last-level cache quantize with
 * non-temporal stores; kvc__set_llc_bytes(0) makes every quantized call
 * one. Same bytes as the reference, aligned (whole 128-element blocks at
 * 64-byte boundaries: H 8, Dh 128, unpadded) and not (padded). */
TEST(append_streaming) {
    static const int64_t pages[3] = {1, 5, 16};
    static const kvc_dtype floats[3] = {KVC_F16, KVC_BF16, KVC_F32};
    const int64_t saved = kvc__llc_bytes();
    kvc__set_llc_bytes(0);
    int n_cases = 0, fails = 0;
    FOR_EACH_ISA({
        for (int pi = 0; pi < 3; pi++) {
            int32_t seq[6], app[6];
            grid_batch(pages[pi], seq, app);
            for (int padded = 0; padded < 2; padded++) {
                batch bt;
                uint64_t rng = test_seed + (uint64_t)(pi * 2 + padded);
                if (batch_init(&bt, 6, seq, app, pages[pi], padded, &rng) != 0) {
                    kvc__set_llc_bytes(saved);
                    TEST_FAIL_("batch_init failed");
                }
                for (int layout = 0; layout < 2; layout++)
                    for (int comb = 0; comb < 2; comb++)
                        for (int bits = 8; bits >= 4; bits -= 4)
                            for (int rot = 0; rot < 4; rot++) {
                                append_case k = {layout, comb, padded, padded, 8, 128,
                                                 (rot & 1) ? 16 : 8, floats[(rot + pi) % 3],
                                                 bits == 8 ? KVC_I8 : KVC_I4,
                                                 (rot >> 1) ? KVC_F32 : KVC_F16};
                                const int th = 1 + (rot + layout + comb) % 2;
                                fails += run_append(&k, &bt, th, test_seed ^ (uint64_t)n_cases) != 0;
                                n_cases++;
                            }
                batch_free(&bt);
            }
        }
    });
    kvc__set_llc_bytes(saved);
    ASSERT_EQ_I64(fails, 0);
    ASSERT_TRUE(n_cases >= 192);
    return 0;
}

/* Decode-like: many requests with one token each (chunks of 64 rows hold many
 * requests), and H = 1. */
TEST(append_decode_many) {
    int32_t seq[150], app[150];
    uint64_t rng = test_seed;
    for (int b = 0; b < 150; b++) {
        seq[b] = 1 + (int32_t)(test_rng_next(&rng) % 70);
        app[b] = b % 7 == 3 ? 0 : 1;
        if (app[b] == 0 && b % 2) seq[b] = 0; /* some empty requests */
    }
    batch bt;
    ASSERT_TRUE(batch_init(&bt, 150, seq, app, 16, 0, &rng) == 0);
    int n = 0, fails = 0;
    FOR_EACH_ISA({
        for (int layout = 0; layout < 2; layout++)
            for (int si = 0; si < 3; si++)
                for (int th = 1; th <= 2; th++) {
                    static const kvc_dtype t2s[3] = {KVC_F16, KVC_I8, KVC_I4};
                    append_case k = {layout, si == 1, 0, 0, si == 2 ? 1 : 8, 64, 8, KVC_BF16,
                                     t2s[si], KVC_F16};
                    fails += run_append(&k, &bt, th, test_seed + (uint64_t)n++) != 0;
                }
    });
    batch_free(&bt);
    ASSERT_EQ_I64(fails, 0);
    return 0;
}

/* ---- MLA ---------------------------------------------------------------------------- */

static int run_mla(int64_t P, kvc_dtype t_in, kvc_dtype t_ckv, kvc_dtype t_kpe, int n_threads) {
    uint64_t rng = test_seed ^ (uint64_t)(P * 7 + t_in * 3 + t_ckv);
    int32_t seq[6], app[6];
    grid_batch(P, seq, app);
    batch bt;
    if (batch_init(&bt, 6, seq, app, P, 1, &rng)) return 1;
    const int64_t DC = 40, DK = 8, MP = bt.max_pages, nnz = bt.nnz;
    /* ckv and kpe: (MP, P, D) each, padded page and slot strides; inputs are
     * column slices of one (nnz, DC + DK + 4) buffer. */
    int64_t shc[3] = {MP, P, DC}, shk[3] = {MP, P, DK}, shi[2] = {nnz, DC + DK + 4};
    kvc_tensor tc, tk, tin;
    int64_t n_c = make_view(&tc, NULL, t_ckv, 3, shc, 1),
            n_k = make_view(&tk, NULL, t_kpe, 3, shk, 1);
    void *cc = xcalloc(dt_bytes(t_ckv, n_c)), *ck = xcalloc(dt_bytes(t_kpe, n_k));
    void *rc = xcalloc(dt_bytes(t_ckv, n_c)), *rk = xcalloc(dt_bytes(t_kpe, n_k));
    void *in = xcalloc(dt_bytes(t_in, nnz * shi[1]));
    fill_bytes(cc, dt_bytes(t_ckv, n_c), &rng);
    fill_bytes(ck, dt_bytes(t_kpe, n_k), &rng);
    memcpy(rc, cc, dt_bytes(t_ckv, n_c));
    memcpy(rk, ck, dt_bytes(t_kpe, n_k));
    fill_random(in, t_in, nnz * shi[1], &rng, 2.0f);
    make_view(&tc, cc, t_ckv, 3, shc, 1);
    make_view(&tk, ck, t_kpe, 3, shk, 1);
    tin = kvc_tensor_make(in, t_in, 2, shi);
    kvc_tensor a_ckv = tin, a_kpe = tin;
    a_ckv.shape[1] = DC;
    a_kpe.shape[1] = DK;
    a_kpe.data = (char *)in + dt_bytes(t_in, DC + 2);
    int64_t nb = bt.B, nb1 = bt.B + 1, np = bt.indptr[bt.B];
    kvc_tensor t_bi = kvc_tensor_make(bt.bi, KVC_I32, 1, &nnz);
    kvc_tensor t_pos = kvc_tensor_make(bt.pos, KVC_I32, 1, &nnz);
    kvc_tensor t_ind = kvc_tensor_make(bt.indices, KVC_I32, 1, &np);
    kvc_tensor t_indptr = kvc_tensor_make(bt.indptr, KVC_I32, 1, &nb1);
    kvc_tensor t_last = kvc_tensor_make(bt.last, KVC_I32, 1, &nb);
    int bad = 0;
    if (kvc_append_paged_mla_kv_cache(&a_ckv, &a_kpe, &t_bi, &t_pos, &tc, &tk, &t_ind, &t_indptr,
                                      &t_last, test_pool(n_threads)) != KVC_OK) {
        fprintf(stderr, "  mla append failed: %s\n", kvc_last_error());
        bad = 3;
    }
    for (int64_t j = 0; j < nnz && !bad; j++) {
        int64_t page, slot;
        row_dest(&bt, j, &page, &slot);
        int64_t ci[3] = {page, slot, 0};
        for (int64_t d = 0; d < DC; d++)
            set_f(rc, t_ckv, offset_of(&tc, ci) + d, get_f(in, t_in, j * shi[1] + d));
        for (int64_t d = 0; d < DK; d++)
            set_f(rk, t_kpe, offset_of(&tk, ci) + d, get_f(in, t_in, j * shi[1] + DC + 2 + d));
    }
    if (!bad && memcmp(cc, rc, dt_bytes(t_ckv, n_c))) bad = 1;
    if (!bad && memcmp(ck, rk, dt_bytes(t_kpe, n_k))) bad = 2;
    if (bad)
        fprintf(stderr, "  mla mismatch (%d) P %lld in %s ckv %s kpe %s threads %d\n", bad,
                (long long)P, kvc_dtype_name(t_in), kvc_dtype_name(t_ckv), kvc_dtype_name(t_kpe),
                n_threads);
    free(cc), free(ck), free(rc), free(rk), free(in);
    batch_free(&bt);
    return bad;
}

TEST(append_mla) {
    int fails = 0;
    FOR_EACH_ISA({
        for (int th = 1; th <= 2; th++) {
            fails += run_mla(1, KVC_F32, KVC_F16, KVC_BF16, th) != 0;
            fails += run_mla(16, KVC_BF16, KVC_BF16, KVC_F32, th) != 0;
            fails += run_mla(5, KVC_F16, KVC_F16, KVC_F16, th) != 0;
        }
    });
    ASSERT_EQ_I64(fails, 0);
    return 0;
}

/* ---- page-table helpers --------------------------------------------------------------- */

TEST(batch_indices_positions_docstring) {
    /* FlashInfer's docstring example. */
    int32_t indptr[5] = {0, 1, 3, 6, 10}, seq[4] = {5, 5, 5, 5}, bi[10], pos[10];
    int64_t n5 = 5, n4 = 4, n10 = 10;
    kvc_tensor ti = kvc_tensor_make(indptr, KVC_I32, 1, &n5),
               ts = kvc_tensor_make(seq, KVC_I32, 1, &n4);
    kvc_tensor tb = kvc_tensor_make(bi, KVC_I32, 1, &n10),
               tp = kvc_tensor_make(pos, KVC_I32, 1, &n10);
    ASSERT_OK(kvc_get_batch_indices_positions(&ti, &ts, 10, &tb, &tp));
    static const int32_t want_pos[10] = {4, 3, 4, 2, 3, 4, 1, 2, 3, 4};
    static const int32_t want_bi[10] = {0, 1, 1, 2, 2, 2, 3, 3, 3, 3};
    ASSERT_MEM_EQ(pos, want_pos, sizeof pos);
    ASSERT_MEM_EQ(bi, want_bi, sizeof bi);
    /* Strided outputs: every other element of a 20-element buffer. */
    int32_t wide[20];
    for (int i = 0; i < 20; i++) wide[i] = -7;
    kvc_tensor tw = tp;
    tw.data = wide;
    tw.stride[0] = 2;
    ASSERT_OK(kvc_get_batch_indices_positions(&ti, &ts, 10, &tb, &tw));
    for (int i = 0; i < 10; i++) {
        ASSERT_EQ_I64(wide[2 * i], want_pos[i]);
        ASSERT_EQ_I64(wide[2 * i + 1], -7);
    }
    /* Rejects: nnz mismatch, a request appending more than its length. */
    memset(pos, 0, sizeof pos);
    ASSERT_STATUS(kvc_get_batch_indices_positions(&ti, &ts, 9, &tb, &tp), KVC_ERR_INVALID_ARG);
    seq[3] = 3;
    ASSERT_STATUS(kvc_get_batch_indices_positions(&ti, &ts, 10, &tb, &tp), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "seq_lens[3]");
    indptr[2] = 0;
    seq[3] = 5;
    ASSERT_STATUS(kvc_get_batch_indices_positions(&ti, &ts, 10, &tb, &tp), KVC_ERR_INVALID_ARG);
    for (int i = 0; i < 10; i++) ASSERT_EQ_I64(pos[i], 0);
    return 0;
}

TEST(seq_lens_formula) {
    /* Pages 3, 0 (empty), 1, 2 with page size 4. */
    int32_t indptr[5] = {0, 3, 3, 4, 6}, last[4] = {2, 0, 4, 1}, out[4] = {-1, -1, -1, -1};
    int64_t n5 = 5, n4 = 4;
    kvc_tensor ti = kvc_tensor_make(indptr, KVC_I32, 1, &n5),
               tl = kvc_tensor_make(last, KVC_I32, 1, &n4);
    kvc_tensor to = kvc_tensor_make(out, KVC_I32, 1, &n4);
    ASSERT_OK(kvc_get_seq_lens(&ti, &tl, 4, &to));
    for (int b = 0; b < 4; b++) {
        int32_t pages = indptr[b + 1] - indptr[b];
        ASSERT_EQ_I64(out[b], pages ? 4 * (pages - 1) + last[b] : 0);
    }
    int32_t idx[6] = {0, 1, 2, 3, 4, 5};
    int64_t n6 = 6;
    kvc_tensor tx = kvc_tensor_make(idx, KVC_I32, 1, &n6);
    ASSERT_OK(kvc_page_table_check(&ti, &tx, &tl, 4, 6));
    ASSERT_STATUS(kvc_page_table_check(&ti, &tx, &tl, 4, 5), KVC_ERR_INVALID_ARG); /* id 5 */
    ASSERT_STR_CONTAINS(kvc_last_error(), "kv_indices[5]");
    ASSERT_STATUS(kvc_page_table_check(&ti, &tx, &tl, 3, 6), KVC_ERR_INVALID_ARG); /* last 4 > 3 */
    ASSERT_STR_CONTAINS(kvc_last_error(), "kv_last_page_len[2]");
    last[1] = 1; /* empty request with a last page length */
    memset(out, 0xff, sizeof out);
    ASSERT_STATUS(kvc_get_seq_lens(&ti, &tl, 4, &to), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "no pages");
    for (int b = 0; b < 4; b++) ASSERT_EQ_I64(out[b], -1);
    last[1] = 0;
    last[0] = 0; /* request with pages but last_page_len 0 */
    ASSERT_STATUS(kvc_get_seq_lens(&ti, &tl, 4, &to), KVC_ERR_INVALID_ARG);
    last[0] = 2;
    ASSERT_STATUS(kvc_get_seq_lens(&ti, &tl, 0, &to), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_get_seq_lens(&ti, &tl, -3, &to), KVC_ERR_INVALID_ARG);
    /* int32 data not aligned to 4 bytes: refused (the loads would be UB) */
    static int32_t room[8];
    kvc_tensor tm = kvc_tensor_make((char *)room + 2, KVC_I32, 1, &n5);
    ASSERT_STATUS(kvc_get_seq_lens(&tm, &tl, 4, &to), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "aligned");
    tm = kvc_tensor_make((char *)room + 1, KVC_I32, 1, &n4);
    ASSERT_STATUS(kvc_get_seq_lens(&ti, &tl, 4, &tm), KVC_ERR_INVALID_ARG);
    return 0;
}

/* The table helpers read their inputs again while writing: an output laid
 * over an input (core.h: undefined) must still keep every access in bounds.
 * Guard bytes after each buffer catch stray writes and, read as page ids,
 * stray reads; on the old code each case went past its buffers. */
TEST(helpers_stay_in_bounds_with_outputs_over_inputs) {
    int64_t b2 = 2, b3 = 3, b4 = 4, n = 0;
    {   /* positions[0] over append_indptr[2]: b = 1 then seemed to append 98 rows */
        int32_t *ai = test_guarded(4 * 4), *sl = test_guarded(2 * 4), *bi = test_guarded(2 * 4);
        ASSERT_TRUE(ai && sl && bi);
        ai[1] = 1, ai[2] = 2, sl[0] = 100, sl[1] = 5;
        kvc_tensor tai = kvc_tensor_make(ai, KVC_I32, 1, &b3), tsl = kvc_tensor_make(sl, KVC_I32, 1, &b2);
        kvc_tensor tbi = kvc_tensor_make(bi, KVC_I32, 1, &b2), tpo = kvc_tensor_make(ai + 2, KVC_I32, 1, &b2);
        ASSERT_OK(kvc_get_batch_indices_positions(&tai, &tsl, 2, &tbi, &tpo));
        ASSERT_TRUE(test_guard_ok(ai, 16) && test_guard_ok(bi, 8));
        free(ai), free(sl), free(bi);
    }
    {   /* cachestarts over kv_indptr: later requests' page runs turned huge */
        int64_t *cs = test_guarded(3 * 2 * 8), csh[2] = {3, 2};
        int32_t *ix = test_guarded(3 * 4);
        ASSERT_TRUE(cs && ix);
        int32_t *ip = (int32_t *)(cs + 1);
        ip[1] = 1, ip[2] = 2, ip[3] = 3;
        kvc_tensor tip = kvc_tensor_make(ip, KVC_I32, 1, &b4), tix = kvc_tensor_make(ix, KVC_I32, 1, &b3);
        kvc_tensor tcs = kvc_tensor_make(cs, KVC_I64, 2, csh);
        ASSERT_OK(kvc_page_table_to_pmx(&tip, &tix, 1000, &tcs));
        for (int i = 0; i < 6; i++) ASSERT_TRUE(cs[i] == 0 || cs[i] == -1); /* ix is 0s */
        ASSERT_TRUE(test_guard_ok(cs, 48));
        free(cs), free(ix);
    }
    {   /* kv_indices over seq_lens[1]: request 1 then seemed to hold 100 pages */
        int64_t *cs = test_guarded(2 * 2 * 8), csh[2] = {2, 2};
        int32_t *sl = test_guarded(3 * 4), *ip = test_guarded(3 * 4), *last = test_guarded(2 * 4);
        ASSERT_TRUE(cs && sl && ip && last);
        cs[0] = 400, cs[1] = 404, cs[2] = 408, cs[3] = 412;
        sl[0] = 1, sl[1] = 1;
        kvc_tensor tcs = kvc_tensor_make(cs, KVC_I64, 2, csh), tsl = kvc_tensor_make(sl, KVC_I32, 1, &b2);
        kvc_tensor tip = kvc_tensor_make(ip, KVC_I32, 1, &b3), tla = kvc_tensor_make(last, KVC_I32, 1, &b2);
        kvc_tensor tix = kvc_tensor_make(sl + 1, KVC_I32, 1, &b2);
        ASSERT_OK(kvc_pmx_to_page_table(&tcs, &tsl, 4, &tip, &tix, &tla, &n));
        ASSERT_EQ_I64(n, 2);
        ASSERT_TRUE(ip[2] <= 2);
        ASSERT_TRUE(test_guard_ok(sl, 12));
        free(cs), free(sl), free(ip), free(last);
    }
    return 0;
}

/* A paged cache laid over its own kv_indices (core.h: undefined, in bounds):
 * row 0's K lands on kv_indices[1], so row 1's page id read afterwards is a
 * float's bits; the old code stored row 1 there, ~1e9 pages away. */
TEST(append_cache_over_its_page_table_stays_in_bounds) {
    float *k = test_guarded(8 * 4), *v = test_guarded(8 * 4); /* (max_pages 2, P 2, H 1, Dh 2) */
    ASSERT_TRUE(k && v);
    int32_t *ix = (int32_t *)&k[2]; /* page 0, slot 1 */
    ix[0] = 0, ix[1] = 1;
    int32_t ip[3] = {0, 1, 2}, last[2] = {2, 2}, bi[2] = {0, 1}, pos[2] = {1, 0};
    float x[4] = {3e9f, 3e9f, 1.0f, 2.0f};
    int64_t b2 = 2, b3 = 3, csh[4] = {2, 2, 1, 2}, xsh[3] = {2, 1, 2};
    kvc_paged_cache pc;
    memset(&pc, 0, sizeof pc);
    pc.k = kvc_tensor_make(k, KVC_F32, 4, csh);
    pc.v = kvc_tensor_make(v, KVC_F32, 4, csh);
    pc.layout = KVC_NHD;
    kvc_tensor tx = kvc_tensor_make(x, KVC_F32, 3, xsh), tix = kvc_tensor_make(ix, KVC_I32, 1, &b2);
    kvc_tensor tip = kvc_tensor_make(ip, KVC_I32, 1, &b3), tla = kvc_tensor_make(last, KVC_I32, 1, &b2);
    kvc_tensor tbi = kvc_tensor_make(bi, KVC_I32, 1, &b2), tpo = kvc_tensor_make(pos, KVC_I32, 1, &b2);
    ASSERT_OK(kvc_append_paged_kv_cache(&tx, &tx, &tbi, &tpo, &pc, &tix, &tip, &tla, NULL));
    ASSERT_TRUE(test_guard_ok(k, 32) && test_guard_ok(v, 32));
    free(k), free(v);
    return 0;
}

TEST(pmx_round_trip) {
    /* 4 requests, page size 3: 7 tokens (3 pages), empty, 3 tokens, 1 token. */
    int32_t indptr[5] = {0, 3, 3, 4, 5}, indices[5] = {6, 0, 4, 2, 5}, last[4] = {1, 0, 3, 1};
    int64_t n5 = 5, n4 = 4, cs_shape[2] = {4, 4};
    int64_t cs[16];
    kvc_tensor ti = kvc_tensor_make(indptr, KVC_I32, 1, &n5),
               tx = kvc_tensor_make(indices, KVC_I32, 1, &n5);
    kvc_tensor tl = kvc_tensor_make(last, KVC_I32, 1, &n4);
    kvc_tensor tcs = kvc_tensor_make(cs, KVC_I64, 2, cs_shape);
    ASSERT_OK(kvc_page_table_check(&ti, &tx, &tl, 3, 7));
    ASSERT_OK(kvc_page_table_to_pmx(&ti, &tx, 3, &tcs));
    static const int64_t want[16] = {18, 0, 12, -1, -1, -1, -1, -1, 6, -1, -1, -1, 15, -1, -1, -1};
    ASSERT_MEM_EQ(cs, want, sizeof cs);
    /* Back, with int64 and int32 seq_lens. */
    int64_t seq64[4] = {7, 0, 3, 1};
    int32_t seq32[4] = {7, 0, 3, 1}, o_indptr[5], o_indices[8], o_last[4];
    int64_t n8 = 8, n_ind = -1;
    kvc_tensor ts64 = kvc_tensor_make(seq64, KVC_I64, 1, &n4),
               ts32 = kvc_tensor_make(seq32, KVC_I32, 1, &n4);
    kvc_tensor toi = kvc_tensor_make(o_indptr, KVC_I32, 1, &n5);
    kvc_tensor tox = kvc_tensor_make(o_indices, KVC_I32, 1, &n8);
    kvc_tensor tol = kvc_tensor_make(o_last, KVC_I32, 1, &n4);
    for (int w = 0; w < 2; w++) {
        memset(o_indices, 0, sizeof o_indices);
        ASSERT_OK(kvc_pmx_to_page_table(&tcs, w ? &ts32 : &ts64, 3, &toi, &tox, &tol, &n_ind));
        ASSERT_EQ_I64(n_ind, 5);
        ASSERT_MEM_EQ(o_indptr, indptr, sizeof indptr);
        ASSERT_MEM_EQ(o_indices, indices, sizeof indices);
        ASSERT_MEM_EQ(o_last, last, sizeof last);
    }
    /* Random tables round trip (CSR -> pmx -> CSR), strided cachestarts. */
    uint64_t rng = test_seed;
    for (int it = 0; it < 50; it++) {
        int32_t seq[12], app[12];
        int B = 1 + (int)(test_rng_next(&rng) % 12);
        int64_t P = 1 + (int64_t)(test_rng_next(&rng) % 9);
        for (int b = 0; b < B; b++) seq[b] = (int32_t)(test_rng_next(&rng) % 40), app[b] = 0;
        batch bt;
        ASSERT_TRUE(batch_init(&bt, B, seq, app, P, 0, &rng) == 0);
        int64_t maxp = 0;
        for (int b = 0; b < B; b++)
            maxp = bt.indptr[b + 1] - bt.indptr[b] > maxp ? bt.indptr[b + 1] - bt.indptr[b] : maxp;
        int64_t big[12 * 100], sh[2] = {B, maxp + 1}, nb1 = B + 1, nb = B, np = bt.indptr[B];
        kvc_tensor tb = kvc_tensor_make(big, KVC_I64, 2, sh);
        tb.stride[0] = 100, tb.stride[1] = 2;
        kvc_tensor a = kvc_tensor_make(bt.indptr, KVC_I32, 1, &nb1),
                   x = kvc_tensor_make(bt.indices, KVC_I32, 1, &np);
        ASSERT_OK(kvc_page_table_to_pmx(&a, &x, (int32_t)P, &tb));
        int32_t r_indptr[13], r_last[12], r_ind[12 * 40];
        int64_t cap = 12 * 40;
        kvc_tensor ra = kvc_tensor_make(r_indptr, KVC_I32, 1, &nb1),
                   rl = kvc_tensor_make(r_last, KVC_I32, 1, &nb);
        kvc_tensor rx = kvc_tensor_make(r_ind, KVC_I32, 1, &cap),
                   rs = kvc_tensor_make(seq, KVC_I32, 1, &nb);
        ASSERT_OK(kvc_pmx_to_page_table(&tb, &rs, (int32_t)P, &ra, &rx, &rl, &n_ind));
        ASSERT_EQ_I64(n_ind, np);
        ASSERT_MEM_EQ(r_indptr, bt.indptr, sizeof(int32_t) * (size_t)(B + 1));
        ASSERT_MEM_EQ(r_last, bt.last, sizeof(int32_t) * (size_t)B);
        ASSERT_MEM_EQ(r_ind, bt.indices, sizeof(int32_t) * (size_t)np);
        for (int b = 0; b < B; b++)
            ASSERT_EQ_I64(big[b * 100 + 2 * maxp], -1); /* the spare column */
        batch_free(&bt);
    }
    /* Rejects, outputs untouched. */
    memset(o_indptr, 0x55, sizeof o_indptr);
    int32_t before[5];
    memcpy(before, o_indptr, sizeof before);
    cs[1] = 4; /* not a multiple of 3 */
    ASSERT_STATUS(kvc_pmx_to_page_table(&tcs, &ts64, 3, &toi, &tox, &tol, &n_ind),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "multiple");
    cs[1] = -1; /* needed entry missing */
    ASSERT_STATUS(kvc_pmx_to_page_table(&tcs, &ts64, 3, &toi, &tox, &tol, &n_ind),
                  KVC_ERR_INVALID_ARG);
    cs[1] = 0;
    seq64[0] = 13; /* 5 pages > MaxP 4 */
    ASSERT_STATUS(kvc_pmx_to_page_table(&tcs, &ts64, 3, &toi, &tox, &tol, &n_ind),
                  KVC_ERR_INVALID_ARG);
    seq64[0] = -1;
    ASSERT_STATUS(kvc_pmx_to_page_table(&tcs, &ts64, 3, &toi, &tox, &tol, &n_ind),
                  KVC_ERR_INVALID_ARG);
    seq64[0] = 7;
    int64_t n2 = 2;
    kvc_tensor small = kvc_tensor_make(o_indices, KVC_I32, 1, &n2); /* capacity 2 < 5 */
    n_ind = -7;
    ASSERT_STATUS(kvc_pmx_to_page_table(&tcs, &ts64, 3, &toi, &small, &tol, &n_ind),
                  KVC_ERR_INVALID_ARG);
    ASSERT_EQ_I64(n_ind, 5); /* the size needed, as kvc_cache_page_table reports it */
    ASSERT_STATUS(kvc_pmx_to_page_table(&tcs, &ts64, 0, &toi, &tox, &tol, &n_ind),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_pmx_to_page_table(NULL, &ts64, 3, &toi, &tox, &tol, &n_ind),
                  KVC_ERR_INVALID_ARG);
    ASSERT_MEM_EQ(o_indptr, before, sizeof before);
    /* to_pmx: MaxP too small, negative id, NULLs. */
    memcpy(cs, want, sizeof cs);
    kvc_tensor narrow = tcs;
    narrow.shape[1] = 2;
    ASSERT_STATUS(kvc_page_table_to_pmx(&ti, &tx, 3, &narrow), KVC_ERR_INVALID_ARG);
    indices[2] = -4;
    ASSERT_STATUS(kvc_page_table_to_pmx(&ti, &tx, 3, &tcs), KVC_ERR_INVALID_ARG);
    indices[2] = 4;
    ASSERT_STATUS(kvc_page_table_to_pmx(&ti, NULL, 3, &tcs), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_page_table_to_pmx(&ti, &tx, 3, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_MEM_EQ(cs, want, sizeof cs);
    return 0;
}

/* ---- end to end: paged append, read back through the pmx dynamic operator -------------- */

/* K and V page arrays back to back in one (2, MP, P, H, Dh) buffer are pmx
 * layout 2 (L=1, 2, MaxT = MP*P, H, Dh); cachestarts from
 * kvc_page_table_to_pmx. int8: the scales mirror it. */
static int run_e2e(int quant, int n_threads) {
    uint64_t rng = test_seed ^ 0xe2e;
    const int64_t P = 5, H = 2, Dh = 16, g = 8;
    int32_t seq[6], app[6];
    grid_batch(P, seq, app);
    for (int b = 0; b < 6; b++) app[b] = seq[b]; /* whole sequences: every position written */
    batch bt;
    if (batch_init(&bt, 6, seq, app, P, 1, &rng)) return 1;
    const int64_t MP = bt.max_pages, nnz = bt.nnz, B = bt.B;
    const kvc_dtype t2 = quant ? KVC_I8 : KVC_F16;
    int64_t csh[5] = {2, MP, P, H, Dh}, ssh[5] = {2, MP, P, H, Dh / g}, n_c = 2 * MP * P * H * Dh;
    void *cache = xcalloc(dt_bytes(t2, n_c)), *scale = xcalloc((size_t)(n_c / g) * 2);
    uint16_t *xk = malloc((size_t)(nnz * H * Dh) * 2), *xv = malloc((size_t)(nnz * H * Dh) * 2);
    fill_random(xk, KVC_F16, nnz * H * Dh, &rng, 2.0f);
    fill_random(xv, KVC_F16, nnz * H * Dh, &rng, 2.0f);
    kvc_tensor t5 = kvc_tensor_make(cache, t2, 5, csh),
               s5 = kvc_tensor_make(scale, KVC_F16, 5, ssh);
    kvc_paged_cache pc;
    memset(&pc, 0, sizeof pc);
    pc.layout = KVC_NHD;
    pc.quant_group = (int32_t)g;
    for (int kv = 0; kv < 2; kv++) {
        kvc_tensor *c = kv ? &pc.v : &pc.k, *s = kv ? &pc.v_scale : &pc.k_scale;
        *c = kvc_tensor_make((char *)cache + dt_bytes(t2, kv * t5.stride[0]), t2, 4, csh + 1);
        *s = kvc_tensor_make((uint16_t *)scale + kv * s5.stride[0], KVC_F16, 4, ssh + 1);
    }
    int64_t ish[3] = {nnz, H, Dh}, nb = B, nb1 = B + 1, np = bt.indptr[B];
    kvc_tensor tk = kvc_tensor_make(xk, KVC_F16, 3, ish), tv = kvc_tensor_make(xv, KVC_F16, 3, ish);
    kvc_tensor t_bi = kvc_tensor_make(bt.bi, KVC_I32, 1, &nnz),
               t_pos = kvc_tensor_make(bt.pos, KVC_I32, 1, &nnz);
    kvc_tensor t_ind = kvc_tensor_make(bt.indices, KVC_I32, 1, &np);
    kvc_tensor t_indptr = kvc_tensor_make(bt.indptr, KVC_I32, 1, &nb1),
               t_last = kvc_tensor_make(bt.last, KVC_I32, 1, &nb);
    int bad = 0;
    if (kvc_append_paged_kv_cache(&tk, &tv, &t_bi, &t_pos, &pc, &t_ind, &t_indptr, &t_last,
                                  test_pool(n_threads)) != KVC_OK)
        bad = 1;
    /* The pmx view and table. */
    int64_t maxp = 0;
    for (int b = 0; b < B; b++)
        maxp = bt.indptr[b + 1] - bt.indptr[b] > maxp ? bt.indptr[b + 1] - bt.indptr[b] : maxp;
    int64_t pcs[2] = {B, maxp}, *cs = malloc(sizeof(int64_t) * (size_t)(B * maxp));
    kvc_tensor tcs = kvc_tensor_make(cs, KVC_I64, 2, pcs);
    if (!bad && kvc_page_table_to_pmx(&t_indptr, &t_ind, (int32_t)P, &tcs) != KVC_OK) bad = 2;
    int64_t lsh[5] = {1, 2, MP * P, H, Dh}, lssh[5] = {1, 2, MP * P, H, Dh / g};
    kvc_tensor lc = kvc_tensor_make(cache, t2, 5, lsh),
               ls = kvc_tensor_make(scale, KVC_F16, 5, lssh);
    int64_t seqstarts[7] = {0}, kvstarts[7] = {0}, start[6], max_s = 0, max_kv = 0,
            zero3[3] = {0, H, Dh};
    for (int b = 0; b < B; b++) {
        kvstarts[b + 1] = kvstarts[b] + seq[b];
        start[b] = seq[b];
        max_kv = seq[b] > max_kv ? seq[b] : max_kv;
    }
    const int64_t total = kvstarts[B];
    uint16_t *ok = malloc((size_t)(total * H * Dh) * 2), *ov = malloc((size_t)(total * H * Dh) * 2);
    int64_t osh[3] = {total, H, Dh};
    kvc_tensor tnk = kvc_tensor_make(NULL, KVC_F16, 3, zero3),
               tss = kvc_tensor_make(seqstarts, KVC_I64, 1, &nb1);
    kvc_tensor tks = kvc_tensor_make(kvstarts, KVC_I64, 1, &nb1),
               tsp = kvc_tensor_make(start, KVC_I64, 1, &nb);
    kvc_tensor tms = kvc_tensor_make(&max_s, KVC_I64, 0, NULL),
               tmk = kvc_tensor_make(&max_kv, KVC_I64, 0, NULL);
    kvc_tensor tok = kvc_tensor_make(ok, KVC_F16, 3, osh),
               tov = kvc_tensor_make(ov, KVC_F16, 3, osh);
    kvc_pmx_kv_params p = kvc_pmx_kv_default_params();
    p.cache_layout = 2;
    p.cache_mode = 1;
    p.page_size = (int32_t)P;
    p.quant_bit = quant ? 8 : 0;
    p.quant_group = (int32_t)g;
    if (!bad && kvc_pmx_dynamic_key_value_cache(&tnk, &tnk, &tss, &tks, &tcs, &tsp, &tms, &tmk, &lc,
                                                quant ? &ls : NULL, &p, &tok, &tov,
                                                test_pool(n_threads)) != KVC_OK)
        bad = 3;
    if (bad) fprintf(stderr, "  e2e call %d failed: %s\n", bad, kvc_last_error());
    /* Row j of the input must come back at kvstarts[b] + pos. */
    for (int64_t j = 0; j < nnz && !bad; j++) {
        const int64_t r = kvstarts[bt.bi[j]] + bt.pos[j];
        for (int kv = 0; kv < 2 && !bad; kv++) {
            const uint16_t *x = (kv ? xv : xk) + j * H * Dh, *y = (kv ? ov : ok) + r * H * Dh;
            uint16_t want[32];
            if (quant) {
                int8_t q[32];
                uint16_t s[4];
                for (int64_t h = 0; h < H; h++) {
                    kvc_quantize(x + h * Dh, KVC_F16, Dh, 8, (int32_t)g, q, s, KVC_F16);
                    kvc_dequantize(q, 8, s, KVC_F16, Dh, (int32_t)g, want + h * Dh, KVC_F16);
                }
            } else {
                memcpy(want, x, (size_t)(H * Dh) * 2);
            }
            if (memcmp(y, want, (size_t)(H * Dh) * 2)) {
                fprintf(stderr, "  e2e mismatch: row %lld (request %d, position %d) kv %d\n",
                        (long long)j, bt.bi[j], bt.pos[j], kv);
                bad = 4;
            }
        }
    }
    free(cache), free(scale), free(xk), free(xv), free(cs), free(ok), free(ov);
    batch_free(&bt);
    return bad;
}

TEST(end_to_end_pmx_read) {
    for (int th = 1; th <= 2; th++) {
        ASSERT_EQ_I64(run_e2e(0, th), 0);
        ASSERT_EQ_I64(run_e2e(1, th), 0);
    }
    return 0;
}

/* ---- rejected calls --------------------------------------------------------------------- */

/* A valid int8 append (NHD, split K/V, f16 in, f16 scales), mutated one field
 * at a time. Page size 4, H 2, Dh 8, group 4. Requests: 6 tokens (2 pages),
 * empty, 3 tokens (1 page); rows: positions 4, 5 of request 0, 0..2 of 2. */
typedef struct fixture {
    int8_t k[6 * 4 * 2 * 8], v[6 * 4 * 2 * 8];
    uint16_t ks[6 * 4 * 2 * 2], vs[6 * 4 * 2 * 2];
    uint16_t xk[5 * 2 * 8], xv[5 * 2 * 8];
    int32_t bi[5], pos[5], indptr[4], indices[3], last[3];
    kvc_tensor txk, txv, tbi, tpos, tind, tindptr, tlast;
    kvc_paged_cache pc;
} fixture;

static void fixture_init(fixture *f) {
    memset(f, 0, sizeof *f);
    uint64_t rng = 11;
    fill_bytes(f->k, sizeof f->k, &rng);
    fill_bytes(f->v, sizeof f->v, &rng);
    fill_bytes(f->ks, sizeof f->ks, &rng);
    fill_bytes(f->vs, sizeof f->vs, &rng);
    fill_random(f->xk, KVC_F16, 80, &rng, 1.0f);
    fill_random(f->xv, KVC_F16, 80, &rng, 1.0f);
    int32_t bi[5] = {0, 0, 2, 2, 2}, pos[5] = {4, 5, 0, 1, 2}, indptr[4] = {0, 2, 2, 3},
            indices[3] = {5, 1, 3}, last[3] = {2, 0, 3};
    memcpy(f->bi, bi, sizeof bi), memcpy(f->pos, pos, sizeof pos);
    memcpy(f->indptr, indptr, sizeof indptr), memcpy(f->indices, indices, sizeof indices);
    memcpy(f->last, last, sizeof last);
    int64_t csh[4] = {6, 4, 2, 8}, ssh[4] = {6, 4, 2, 2}, ish[3] = {5, 2, 8}, n5 = 5, n4 = 4,
            n3 = 3;
    f->pc.k = kvc_tensor_make(f->k, KVC_I8, 4, csh);
    f->pc.v = kvc_tensor_make(f->v, KVC_I8, 4, csh);
    f->pc.k_scale = kvc_tensor_make(f->ks, KVC_F16, 4, ssh);
    f->pc.v_scale = kvc_tensor_make(f->vs, KVC_F16, 4, ssh);
    f->pc.layout = KVC_NHD;
    f->pc.quant_group = 4;
    f->txk = kvc_tensor_make(f->xk, KVC_F16, 3, ish);
    f->txv = kvc_tensor_make(f->xv, KVC_F16, 3, ish);
    f->tbi = kvc_tensor_make(f->bi, KVC_I32, 1, &n5);
    f->tpos = kvc_tensor_make(f->pos, KVC_I32, 1, &n5);
    f->tind = kvc_tensor_make(f->indices, KVC_I32, 1, &n3);
    f->tindptr = kvc_tensor_make(f->indptr, KVC_I32, 1, &n4);
    f->tlast = kvc_tensor_make(f->last, KVC_I32, 1, &n3);
}

static kvc_status fixture_call(fixture *f) {
    return kvc_append_paged_kv_cache(&f->txk, &f->txv, &f->tbi, &f->tpos, &f->pc, &f->tind,
                                     &f->tindptr, &f->tlast, test_pool(2));
}

TEST(append_rejects_leave_cache_unchanged) {
    static fixture f, orig;
    fixture_init(&f);
    memcpy(&orig, &f, sizeof f);
    ASSERT_OK(fixture_call(&f)); /* the unmutated call is valid ... */
    ASSERT_TRUE(memcmp(f.k, orig.k, sizeof f.k) != 0); /* ... and writes */
    enum { N_MUT = 42 };
    for (int m = 0; m < N_MUT; m++) {
        fixture_init(&f);
        switch (m) {
        case 0: f.indptr[0] = 1; break;
        case 1: f.indptr[2] = 1; break;                 /* non-decreasing violated */
        case 2: f.indices[0] = 6; break;                /* == max_pages */
        case 3: f.indices[1] = -1; break;
        case 4: f.last[0] = 0; break;                   /* pages but no tokens in the last */
        case 5: f.last[0] = 5; break;                   /* > page_size */
        case 6: f.last[1] = 1; break;                   /* empty request, last_page_len 1 */
        case 7: f.bi[0] = 3; break;                     /* == B */
        case 8: f.bi[4] = -1; break;
        case 9: f.pos[1] = 6; break;                    /* == seq_len of request 0 */
        case 10: f.pos[2] = -1; break;
        case 11: f.bi[3] = 1; break;                    /* the empty request */
        case 12: f.xk[4 * 16 + 15] = 0x7e00; break;     /* NaN in the last key row */
        case 13: f.xv[2 * 16 + 9] = 0xfc00; break;      /* -Inf in a value row */
        case 14: f.pc.quant_group = 3; break;
        case 15: f.pc.quant_group = 0; break;
        case 16: f.pc.k_scale.dtype = KVC_BF16; break;
        case 17: f.pc.v_scale.shape[3] = 4; break;
        case 18: memset(&f.pc.k_scale, 0, sizeof f.pc.k_scale); break; /* missing scales */
        case 19: f.txv.dtype = KVC_F32; break;
        case 20: f.txk.shape[2] = 4, f.txv.shape[2] = 4; break;
        case 21: f.pc.v.shape[0] = 5; break;
        case 22: f.pc.layout = (kvc_kv_layout)2; break;
        case 23: f.pc.k.stride[3] = 2; break;           /* last dim not contiguous */
        case 24: f.tbi.dtype = KVC_I64; break;
        case 25: f.tpos.shape[0] = 4; break;
        case 26: f.tind.shape[0] = 2; break;
        case 27: f.tindptr.shape[0] = 3; break;
        case 28: f.txk.dtype = f.txv.dtype = KVC_I32; break;
        case 29: f.pc.k.dtype = f.pc.v.dtype = KVC_U8; break;
        case 30: f.pc.k.dtype = f.pc.v.dtype = KVC_I4, f.pc.quant_group = 1; break; /* odd group */
        case 31: f.txk.ndim = 2, f.txv.ndim = 2; break;
        case 32: f.tlast.dtype = KVC_F32; break;
        case 33: f.txk.data = NULL; break;
        case 34: f.pc.k.shape[1] = -4, f.pc.v.shape[1] = -4; break;
        case 35: f.pc.k.ndim = f.pc.v.ndim = 9; break;
        case 36: f.pc.k.shape[2] = f.pc.v.shape[2] = 3; break; /* H mismatch with inputs */
        case 37: f.txk.shape[0] = f.txv.shape[0] = 4; break;   /* nnz mismatch with rows */
        case 38: f.pc.k_scale.shape[0] = 5; break;
        case 39: f.tlast.shape[0] = 2; break;
        case 40: f.pc.k.stride[0] = 0; break;          /* written pages share memory */
        case 41: f.pc.v_scale.stride[1] = 0; break;
        }
        memcpy(&orig, &f, sizeof f);
        kvc_clear_error();
        kvc_status st = fixture_call(&f);
        if (st != KVC_ERR_INVALID_ARG) TEST_FAIL_("mutation %d: status %s", m, kvc_status_str(st));
        if (strlen(kvc_last_error()) <= 10)
            TEST_FAIL_("mutation %d: message '%s'", m, kvc_last_error());
        if (m >= 40) ASSERT_STR_CONTAINS(kvc_last_error(), "stride 0");
        ASSERT_MEM_EQ(f.k, orig.k, sizeof f.k);
        ASSERT_MEM_EQ(f.v, orig.v, sizeof f.v);
        ASSERT_MEM_EQ(f.ks, orig.ks, sizeof f.ks);
        ASSERT_MEM_EQ(f.vs, orig.vs, sizeof f.vs);
    }
    /* NULL arguments. */
    fixture_init(&f);
    memcpy(&orig, &f, sizeof f);
    const kvc_tensor *x = &f.txk;
    ASSERT_STATUS(kvc_append_paged_kv_cache(NULL, x, &f.tbi, &f.tpos, &f.pc, &f.tind, &f.tindptr,
                                            &f.tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_append_paged_kv_cache(x, &f.txv, NULL, &f.tpos, &f.pc, &f.tind, &f.tindptr,
                                            &f.tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_append_paged_kv_cache(x, &f.txv, &f.tbi, NULL, &f.pc, &f.tind, &f.tindptr,
                                            &f.tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_append_paged_kv_cache(x, &f.txv, &f.tbi, &f.tpos, NULL, &f.tind, &f.tindptr,
                                            &f.tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_append_paged_kv_cache(x, &f.txv, &f.tbi, &f.tpos, &f.pc, NULL, &f.tindptr,
                                            &f.tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(
        kvc_append_paged_kv_cache(x, &f.txv, &f.tbi, &f.tpos, &f.pc, &f.tind, NULL, &f.tlast, NULL),
        KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_append_paged_kv_cache(x, &f.txv, &f.tbi, &f.tpos, &f.pc, &f.tind, &f.tindptr,
                                            NULL, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_MEM_EQ(f.k, orig.k, sizeof f.k);
    ASSERT_MEM_EQ(f.ks, orig.ks, sizeof f.ks);
    /* A valid copy into the int8 cache from int8 inputs needs no scales. */
    int8_t q[80];
    memset(q, 3, sizeof q);
    kvc_tensor tq = f.txk;
    tq.data = q;
    tq.dtype = KVC_I8;
    memset(&f.pc.k_scale, 0, sizeof f.pc.k_scale);
    memset(&f.pc.v_scale, 0, sizeof f.pc.v_scale);
    ASSERT_OK(kvc_append_paged_kv_cache(&tq, &tq, &f.tbi, &f.tpos, &f.pc, &f.tind, &f.tindptr,
                                        &f.tlast, NULL));
    ASSERT_EQ_I64(f.k[(1 * 4 + 0) * 16],
                  3); /* position 4 of request 0: its page 1 (id 1), slot 0 */
    return 0;
}

/*
 * NaN / Inf on the scales-first path (calls larger than the cache, forced
 * here, with float16 / bfloat16 inputs into group-8 caches: the finiteness
 * pass computes the scales too): a bad value in K or
 * V, in the first, a middle or the last of 70 rows (two 64-row chunks), at a
 * row's start or end, packed or head-strided inputs, NHD and HND, every ISA:
 * INVALID_ARG naming the tensor, row and head, cache and scales unchanged.
 * Likewise a bfloat16 1e7, whose float16 scale would overflow (1e7 / 127 >
 * 65504). The same call without them succeeds and writes.
 */
TEST(append_nonfinite_scales_first) {
    enum { NNZ = 70, H = 2, D = 128, PS = 4, PAGES = (NNZ + PS - 1) / PS, CN = PAGES * PS * H * D };
    static int8_t kc[CN], vc[CN], kc0[CN], vc0[CN];
    static uint16_t ks[CN / 8], vs[CN / 8], ks0[CN / 8], vs0[CN / 8];
    static uint16_t xk[NNZ * H * 2 * D], xv[NNZ * H * 2 * D];
    static const char *const names[2] = {"append_key", "append_value"};
    static const int rows[3] = {0, 33, NNZ - 1};
    int32_t bi[NNZ], pos[NNZ], indptr[2] = {0, PAGES}, indices[PAGES], last[1];
    for (int j = 0; j < NNZ; j++) bi[j] = 0, pos[j] = j;
    for (int p = 0; p < PAGES; p++) indices[p] = PAGES - 1 - p;
    last[0] = NNZ - (PAGES - 1) * PS;
    int64_t n_nnz = NNZ, n_pages = PAGES, n2 = 2, n1 = 1;
    const kvc_tensor tbi = kvc_tensor_make(bi, KVC_I32, 1, &n_nnz),
                     tpos = kvc_tensor_make(pos, KVC_I32, 1, &n_nnz),
                     tind = kvc_tensor_make(indices, KVC_I32, 1, &n_pages),
                     tptr = kvc_tensor_make(indptr, KVC_I32, 1, &n2),
                     tlast = kvc_tensor_make(last, KVC_I32, 1, &n1);
    uint64_t rng = test_seed ^ 0x7ff;
    int calls = 0;
    const int64_t saved = kvc__llc_bytes();
    kvc__set_llc_bytes(0); /* the two-pass path is taken by calls larger than the cache */
    FOR_EACH_ISA({
        for (int xi = 0; xi < 2; xi++) {
            const kvc_dtype xd = xi ? KVC_BF16 : KVC_F16;
            const uint16_t bad[3] = {xi ? 0x7fc0 : 0x7e00, xi ? 0x7f80 : 0x7c00,
                                     xi ? 0xff80 : 0xfc00}; /* NaN, +Inf, -Inf */
            for (int hnd = 0; hnd < 2; hnd++)
                for (int strided = 0; strided < 2; strided++) {
                    const int64_t csh[4] = {PAGES, hnd ? H : PS, hnd ? PS : H, D},
                                  ssh[4] = {PAGES, hnd ? H : PS, hnd ? PS : H, D / 8},
                                  ish[3] = {NNZ, H, D};
                    kvc_paged_cache pc;
                    memset(&pc, 0, sizeof pc);
                    pc.k = kvc_tensor_make(kc, KVC_I8, 4, csh);
                    pc.v = kvc_tensor_make(vc, KVC_I8, 4, csh);
                    pc.k_scale = kvc_tensor_make(ks, KVC_F16, 4, ssh);
                    pc.v_scale = kvc_tensor_make(vs, KVC_F16, 4, ssh);
                    pc.layout = hnd ? KVC_HND : KVC_NHD;
                    pc.quant_group = 8;
                    kvc_tensor txk = kvc_tensor_make(xk, xd, 3, ish),
                               txv = kvc_tensor_make(xv, xd, 3, ish);
                    const int64_t hs = strided ? 2 * D : D; /* head stride of the inputs */
                    txk.stride[1] = txv.stride[1] = hs;
                    txk.stride[0] = txv.stride[0] = H * hs;
                    for (int c = 0; c <= 8; c++) {
                        if (!xi && (c == 6 || c == 7)) continue; /* float16 stays below 65504 */
                        fill_random(xk, xd, NNZ * H * 2 * D, &rng, 3.0f);
                        fill_random(xv, xd, NNZ * H * 2 * D, &rng, 3.0f);
                        fill_bytes(kc, sizeof kc, &rng), fill_bytes(vc, sizeof vc, &rng);
                        fill_bytes(ks, sizeof ks, &rng), fill_bytes(vs, sizeof vs, &rng);
                        memcpy(kc0, kc, sizeof kc), memcpy(vc0, vc, sizeof vc);
                        memcpy(ks0, ks, sizeof ks), memcpy(vs0, vs, sizeof vs);
                        const int kv = c & 1, row = rows[(c / 2) % 3], head = row % 2;
                        const int64_t e = (int64_t)row * H * hs + head * hs + (c % 3 ? D - 1 : 0);
                        if (c < 6) (kv ? xv : xk)[e] = bad[c % 3];
                        if (c == 6 || c == 7) /* bfloat16 +-1e7 */
                            (kv ? xv : xk)[e] = kvc_f32_to_bf16(c == 6 ? 1e7f : -1e7f);
                        kvc_clear_error();
                        const kvc_status st =
                            kvc_append_paged_kv_cache(&txk, &txv, &tbi, &tpos, &pc, &tind, &tptr,
                                                      &tlast, test_pool(1 + c % 2));
                        calls++;
                        if (c == 8) { /* no bad value: accepted and written */
                            ASSERT_OK(st);
                            ASSERT_TRUE(memcmp(kc, kc0, sizeof kc) != 0);
                            ASSERT_TRUE(memcmp(vs, vs0, sizeof vs) != 0);
                            continue;
                        }
                        char want[64];
                        snprintf(want, sizeof want, "(row %d, head %d)", row, head);
                        if (st != KVC_ERR_INVALID_ARG || !strstr(kvc_last_error(), want) ||
                            !strstr(kvc_last_error(), names[kv]) ||
                            !strstr(kvc_last_error(), c < 6 ? "NaN or Inf" : "float16 scale"))
                            TEST_FAIL_("%s x %s %s strided %d: bad value in %s row %d head %d: "
                                       "%s '%s'", kvc_isa_name(kvc_get_isa()), kvc_dtype_name(xd),
                                       hnd ? "HND" : "NHD", strided, names[kv], row, head,
                                       kvc_status_str(st), kvc_last_error());
                        ASSERT_MEM_EQ(kc, kc0, sizeof kc);
                        ASSERT_MEM_EQ(vc, vc0, sizeof vc);
                        ASSERT_MEM_EQ(ks, ks0, sizeof ks);
                        ASSERT_MEM_EQ(vs, vs0, sizeof vs);
                    }
                }
        }
    });
    kvc__set_llc_bytes(saved);
    ASSERT_TRUE(calls >= 64);
    return 0;
}

TEST(mla_and_helpers_reject_garbage) {
    float ckv[2 * 2 * 8], kpe[2 * 2 * 4], in_c[2 * 8], in_k[2 * 4];
    memset(ckv, 0, sizeof ckv), memset(kpe, 0, sizeof kpe);
    memset(in_c, 0, sizeof in_c), memset(in_k, 0, sizeof in_k);
    int32_t bi[2] = {0, 0}, pos[2] = {0, 1}, indptr[2] = {0, 1}, indices[1] = {1}, last[1] = {2};
    int64_t shc[3] = {2, 2, 8}, shk[3] = {2, 2, 4}, sic[2] = {2, 8}, sik[2] = {2, 4}, n1 = 1,
            n2 = 2;
    kvc_tensor tc = kvc_tensor_make(ckv, KVC_F32, 3, shc),
               tk = kvc_tensor_make(kpe, KVC_F32, 3, shk);
    kvc_tensor ic = kvc_tensor_make(in_c, KVC_F32, 2, sic),
               ik = kvc_tensor_make(in_k, KVC_F32, 2, sik);
    kvc_tensor tbi = kvc_tensor_make(bi, KVC_I32, 1, &n2),
               tpos = kvc_tensor_make(pos, KVC_I32, 1, &n2);
    kvc_tensor tindptr = kvc_tensor_make(indptr, KVC_I32, 1, &n2),
               tind = kvc_tensor_make(indices, KVC_I32, 1, &n1);
    kvc_tensor tlast = kvc_tensor_make(last, KVC_I32, 1, &n1);
    in_c[0] = 1.0f;
    ASSERT_OK(kvc_append_paged_mla_kv_cache(&ic, &ik, &tbi, &tpos, &tc, &tk, &tind, &tindptr,
                                            &tlast, NULL));
    ASSERT_TRUE(ckv[16] == 1.0f); /* page 1, slot 0 */
    float before[sizeof ckv / 4];
    memcpy(before, ckv, sizeof ckv);
    in_c[0] = 2.0f;
    kvc_tensor bad = tc;
    bad.dtype = KVC_I8; /* MLA stores floats only */
    ASSERT_STATUS(kvc_append_paged_mla_kv_cache(&ic, &ik, &tbi, &tpos, &bad, &tk, &tind, &tindptr,
                                                &tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    bad = tk;
    bad.shape[1] = 1; /* page sizes differ */
    ASSERT_STATUS(kvc_append_paged_mla_kv_cache(&ic, &ik, &tbi, &tpos, &tc, &bad, &tind, &tindptr,
                                                &tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    bad = ik;
    bad.shape[1] = 5;
    ASSERT_STATUS(kvc_append_paged_mla_kv_cache(&ic, &bad, &tbi, &tpos, &tc, &tk, &tind, &tindptr,
                                                &tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    pos[1] = 2; /* seq_len is 2 */
    ASSERT_STATUS(kvc_append_paged_mla_kv_cache(&ic, &ik, &tbi, &tpos, &tc, &tk, &tind, &tindptr,
                                                &tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    pos[1] = 1;
    ASSERT_STATUS(kvc_append_paged_mla_kv_cache(NULL, &ik, &tbi, &tpos, &tc, &tk, &tind, &tindptr,
                                                &tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_append_paged_mla_kv_cache(&ic, &ik, &tbi, &tpos, &tc, NULL, &tind, &tindptr,
                                                &tlast, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_MEM_EQ(ckv, before, sizeof ckv);
    /* Helpers with NULLs and wrong ranks/dtypes. */
    ASSERT_STATUS(kvc_page_table_check(NULL, &tind, &tlast, 2, 2), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_page_table_check(&tindptr, NULL, &tlast, 2, 2), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_page_table_check(&tindptr, &tind, NULL, 2, 2), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_page_table_check(&tindptr, &tind, &tlast, 2, -1), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_page_table_check(&tindptr, &tind, &tlast, 0, 2), KVC_ERR_INVALID_ARG);
    ASSERT_OK(kvc_page_table_check(&tindptr, &tind, &tlast, 2, 2));
    kvc_tensor r2 = tc; /* 3-D float as an index */
    ASSERT_STATUS(kvc_page_table_check(&r2, &tind, &tlast, 2, 2), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_get_seq_lens(NULL, &tlast, 2, &tlast), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_get_seq_lens(&tindptr, &tlast, 2, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_get_batch_indices_positions(NULL, &tlast, 0, &tbi, &tpos),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_get_batch_indices_positions(&tindptr, NULL, 0, &tbi, &tpos),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_get_batch_indices_positions(&tindptr, &tlast, -1, &tbi, &tpos),
                  KVC_ERR_INVALID_ARG);
    kvc_paged_cache pc;
    int64_t sh5[5] = {2, 2, 2, 1, 8}, sh5b[5] = {2, 3, 2, 1, 8};
    kvc_tensor t5 = kvc_tensor_make(ckv, KVC_F32, 5, sh5),
               t5b = kvc_tensor_make(ckv, KVC_F32, 5, sh5b);
    ASSERT_STATUS(kvc_paged_cache_from_combined(NULL, NULL, KVC_NHD, 8, &pc), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_paged_cache_from_combined(&t5, NULL, KVC_NHD, 8, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_paged_cache_from_combined(&t5b, NULL, KVC_NHD, 8, &pc), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_paged_cache_from_combined(&tc, NULL, KVC_NHD, 8, &pc), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_paged_cache_from_combined(&t5, &tc, KVC_NHD, 8, &pc), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_paged_cache_from_combined(&t5, NULL, (kvc_kv_layout)7, 8, &pc),
                  KVC_ERR_INVALID_ARG);
    ASSERT_OK(kvc_paged_cache_from_combined(&t5, NULL, KVC_HND, 8, &pc));
    ASSERT_TRUE(pc.v.data == (void *)(ckv + 16) && pc.k.ndim == 4 && pc.k.shape[1] == 2 &&
                pc.layout == KVC_HND && pc.k_scale.data == NULL);
    return 0;
}

TEST(empty_append) {
    /* nnz = 0 (NULL input data) and B = 0 are valid no-ops. */
    uint16_t cache[1 * 2 * 1 * 8];
    memset(cache, 0x11, sizeof cache);
    int64_t csh[4] = {1, 2, 1, 8}, ish[3] = {0, 1, 8}, z = 0, one = 1;
    int32_t indptr[1] = {0};
    kvc_paged_cache pc;
    memset(&pc, 0, sizeof pc);
    pc.k = pc.v = kvc_tensor_make(cache, KVC_F16, 4, csh);
    kvc_tensor tx = kvc_tensor_make(NULL, KVC_F32, 3, ish),
               te = kvc_tensor_make(NULL, KVC_I32, 1, &z);
    kvc_tensor tindptr = kvc_tensor_make(indptr, KVC_I32, 1, &one);
    ASSERT_OK(kvc_append_paged_kv_cache(&tx, &tx, &te, &te, &pc, &te, &tindptr, &te, test_pool(2)));
    for (size_t i = 0; i < sizeof cache / 2; i++) ASSERT_EQ_I64(cache[i], 0x1111);
    return 0;
}

const char *test_suite_name = "paged";
const test_case test_suite[] = {
    TEST_ENTRY(append_grid),
    TEST_ENTRY(append_streaming),
    TEST_ENTRY(append_decode_many),
    TEST_ENTRY(append_mla),
    TEST_ENTRY(batch_indices_positions_docstring),
    TEST_ENTRY(seq_lens_formula),
    TEST_ENTRY(helpers_stay_in_bounds_with_outputs_over_inputs), TEST_ENTRY(append_cache_over_its_page_table_stays_in_bounds), TEST_ENTRY(pmx_round_trip),
    TEST_ENTRY(end_to_end_pmx_read),
    TEST_ENTRY(append_rejects_leave_cache_unchanged),
    TEST_ENTRY(append_nonfinite_scales_first),
    TEST_ENTRY(mla_and_helpers_reject_garbage),
    TEST_ENTRY(empty_append),
    {0, 0},
};
