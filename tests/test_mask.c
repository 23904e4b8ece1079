/*
 * kvc_packbits, kvc_segment_packbits and kvc_build_packed_custom_mask against
 * a bit-at-a-time reference written from SEMANTICS sections 4 and 5 (numpy
 * packbits: nonzero byte = 1, big order puts element 0 in bit 7, little in
 * bit 0, last byte zero-padded). Every n from 0 to 300 at every alignment,
 * both bit orders, guard bytes around every output, and rejected calls
 * leaving every output byte unchanged. The numpy-referenced grids live in
 * python/tests/test_mask.py; this suite also runs under sanitizers.
 */
#include <stdlib.h>

#include "test.h"

/* ---- reference ------------------------------------------------------------ */

static int64_t ref_bytes(int64_t n) { return (n + 7) / 8; }

/* Bit-at-a-time packbits; writes exactly ref_bytes(n) bytes. */
static void ref_pack(const uint8_t *x, int64_t n, kvc_bitorder order, uint8_t *out) {
    for (int64_t j = 0; j < ref_bytes(n); j++) out[j] = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!x[i]) continue;
        int bit = order == KVC_BITORDER_BIG ? 7 - (int)(i % 8) : (int)(i % 8);
        out[i / 8] = (uint8_t)(out[i / 8] | (1u << bit));
    }
}

/* Random bytes, about half zero; the nonzero ones cover single high and low
 * bits (0x80, 0x01) as well as arbitrary values, so a test catches a kernel
 * that only looks at some of a byte's bits. */
static void fill_random(uint8_t *x, int64_t n, uint64_t *rng) {
    static const uint8_t special[] = {0x01, 0x80, 0xff, 0x02, 0x40, 0x7f, 0x10, 0x08};
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = test_rng_next(rng);
        if (r & 1) x[i] = 0;
        else if (r & 2) x[i] = special[(r >> 2) & 7];
        else x[i] = (uint8_t)(r >> 8);
    }
}

static const kvc_bitorder ORDERS[2] = {KVC_BITORDER_BIG, KVC_BITORDER_LITTLE};

#define GUARD 16
#define CANARY 0xa5

static int guards_intact(const uint8_t *buf, int64_t start, int64_t len, int64_t total) {
    for (int64_t i = 0; i < total; i++)
        if ((i < start || i >= start + len) && buf[i] != CANARY) return 0;
    return 1;
}

/* ---- packbits ------------------------------------------------------------ */

TEST(packbits_known_values) {
    const uint8_t x[8] = {1, 0, 1, 1, 0, 0, 1, 1};
    uint8_t out[1];
    ASSERT_OK(kvc_packbits(x, 8, KVC_BITORDER_BIG, out));
    ASSERT_EQ_I64(out[0], 0xb3); /* 0b10110011, FlashInfer's example */
    ASSERT_OK(kvc_packbits(x, 8, KVC_BITORDER_LITTLE, out));
    ASSERT_EQ_I64(out[0], 0xcd); /* 0b11001101 */
    ASSERT_OK(kvc_packbits(x, 3, KVC_BITORDER_BIG, out));
    ASSERT_EQ_I64(out[0], 0xa0); /* padding bits are zero */
    ASSERT_OK(kvc_packbits(x, 3, KVC_BITORDER_LITTLE, out));
    ASSERT_EQ_I64(out[0], 0x05);
    return 0;
}

TEST(packbits_every_byte_value_is_truthy) {
    /* Byte v at position v: only v == 0 packs to a zero bit. */
    uint8_t x[256], out[32], want[32];
    for (int v = 0; v < 256; v++) x[v] = (uint8_t)v;
    for (int o = 0; o < 2; o++) {
        ASSERT_OK(kvc_packbits(x, 256, ORDERS[o], out));
        ref_pack(x, 256, ORDERS[o], want);
        ASSERT_MEM_EQ(out, want, 32);
        ASSERT_EQ_I64(out[0], o == 0 ? 0x7f : 0xfe);
        for (int j = 1; j < 32; j++) ASSERT_EQ_I64(out[j], 0xff);
    }
    return 0;
}

TEST(packbits_every_n_and_alignment) {
    /* n 0..300 (the blocked kernel path starts at 256) at input offsets 0..8
     * and output offsets 0..3, with guard bytes on both sides of the output. */
    enum { NMAX = 300 };
    static uint8_t xbuf[NMAX + 16], obuf[GUARD + NMAX / 8 + 8 + GUARD], want[NMAX / 8 + 8];
    uint64_t rng = test_seed;
    for (int64_t n = 0; n <= NMAX; n++) {
        for (int xo = 0; xo <= 8; xo++) {
            for (int oo = 0; oo < 4; oo++) {
                const uint8_t *x = xbuf + xo;
                fill_random(xbuf, NMAX + 16, &rng);
                for (int o = 0; o < 2; o++) {
                    memset(obuf, CANARY, sizeof obuf);
                    uint8_t *out = obuf + GUARD + oo;
                    ASSERT_OK(kvc_packbits(x, n, ORDERS[o], out));
                    ref_pack(x, n, ORDERS[o], want);
                    if (memcmp(out, want, (size_t)ref_bytes(n)))
                        TEST_FAIL_("n %lld, x offset %d, out offset %d, order %d differ",
                                   (long long)n, xo, oo, o);
                    if (!guards_intact(obuf, GUARD + oo, ref_bytes(n), (int64_t)sizeof obuf))
                        TEST_FAIL_("n %lld order %d wrote outside its %lld bytes", (long long)n, o,
                                   (long long)ref_bytes(n));
                }
            }
        }
    }
    return 0;
}

TEST(packbits_all_ones_and_all_zeros) {
    enum { N = 1000 };
    static uint8_t x[N], out[N / 8 + 1], want[N / 8 + 1];
    for (int v = 0; v < 2; v++) {
        memset(x, v ? 0x80 : 0, N);
        for (int64_t n = 0; n <= N; n += 37) {
            for (int o = 0; o < 2; o++) {
                ASSERT_OK(kvc_packbits(x, n, ORDERS[o], out));
                ref_pack(x, n, ORDERS[o], want);
                ASSERT_MEM_EQ(out, want, ref_bytes(n));
            }
        }
    }
    return 0;
}

TEST(packbits_large_random) {
    uint64_t rng = test_seed ^ 0x1234;
    const int64_t sizes[] = {1000003, 65536, 4096 + 255, 257, 511, 513};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        int64_t n = sizes[s];
        uint8_t *x = malloc((size_t)n + 3), *out = malloc((size_t)ref_bytes(n)),
                *want = malloc((size_t)ref_bytes(n));
        if (!x || !out || !want) {
            free(x), free(out), free(want);
            TEST_FAIL_("out of memory");
        }
        fill_random(x, n + 3, &rng);
        int bad = 0;
        for (int o = 0; o < 2 && !bad; o++) {
            for (int xo = 0; xo < 3 && !bad; xo++) {
                if (kvc_packbits(x + xo, n, ORDERS[o], out) != KVC_OK) bad = 1;
                ref_pack(x + xo, n, ORDERS[o], want);
                if (!bad && memcmp(out, want, (size_t)ref_bytes(n))) bad = 2;
            }
        }
        free(x), free(out), free(want);
        if (bad) TEST_FAIL_("n %lld: %s", (long long)n, bad == 1 ? "call failed" : "mismatch");
    }
    return 0;
}

TEST(packbits_rejects) {
    uint8_t x[16] = {1, 1, 1}, out[2] = {0x11, 0x22};
    ASSERT_STATUS(kvc_packbits(x, -1, KVC_BITORDER_BIG, out), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "n = -1");
    ASSERT_STATUS(kvc_packbits(NULL, 3, KVC_BITORDER_BIG, out), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "x is NULL");
    ASSERT_STATUS(kvc_packbits(x, 3, KVC_BITORDER_BIG, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "out is NULL");
    ASSERT_STATUS(kvc_packbits(x, 3, (kvc_bitorder)2, out), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "bitorder");
    ASSERT_STATUS(kvc_packbits(x, 3, (kvc_bitorder)-1, out), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_packbits(x, 0, (kvc_bitorder)7, out), KVC_ERR_INVALID_ARG);
    ASSERT_EQ_I64(out[0], 0x11);
    ASSERT_EQ_I64(out[1], 0x22);
    /* n == 0 needs no buffers at all. */
    ASSERT_OK(kvc_packbits(NULL, 0, KVC_BITORDER_LITTLE, NULL));
    return 0;
}

/* ---- segment_packbits ------------------------------------------------------ */

static kvc_tensor vec(void *data, kvc_dtype dt, int64_t n) {
    return kvc_tensor_make(data, dt, 1, &n);
}

static int64_t get_idx(const void *p, kvc_dtype dt, int64_t i) {
    return dt == KVC_I64 ? ((const int64_t *)p)[i] : ((const int32_t *)p)[i];
}

static void set_idx(void *p, kvc_dtype dt, int64_t i, int64_t v) {
    if (dt == KVC_I64) ((int64_t *)p)[i] = v;
    else ((int32_t *)p)[i] = (int32_t)v;
}

/* Random segment lengths in [0, maxlen], about a quarter of them empty. */
static int64_t random_indptr(void *ip, kvc_dtype dt, int64_t B, int64_t maxlen, uint64_t *rng) {
    int64_t total = 0;
    set_idx(ip, dt, 0, 0);
    for (int64_t b = 0; b < B; b++) {
        uint64_t r = test_rng_next(rng);
        int64_t len = (r & 3) == 0 ? 0 : (int64_t)((r >> 2) % (uint64_t)(maxlen + 1));
        total += len;
        set_idx(ip, dt, b + 1, total);
    }
    return total;
}

TEST(segment_packbits_known_values) {
    /* FlashInfer's example: segments of 4, 3, 4 -> 0b10110000, 0b00100000,
     * 0b11010000 (our own data: 1011 | 001 | 1101). */
    const uint8_t x[11] = {1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1};
    int32_t ip[4] = {0, 4, 7, 11}, oip[4] = {-1, -1, -1, -1};
    uint8_t out[3];
    kvc_tensor t = vec(ip, KVC_I32, 4), ot = vec(oip, KVC_I32, 4);
    ASSERT_OK(kvc_segment_packbits(x, &t, KVC_BITORDER_BIG, out, 3, &ot));
    ASSERT_EQ_I64(out[0], 0xb0);
    ASSERT_EQ_I64(out[1], 0x20);
    ASSERT_EQ_I64(out[2], 0xd0);
    for (int i = 0; i < 4; i++) ASSERT_EQ_I64(oip[i], i);
    return 0;
}

TEST(segment_packbits_random) {
    uint64_t rng = test_seed ^ 0x5e9;
    enum { BMAX = 40, LMAX = 300, XMAX = BMAX * LMAX + 8 };
    static uint8_t xbuf[XMAX + 8], obuf[GUARD + XMAX + GUARD], want[XMAX];
    static int64_t ip[BMAX + 1], oip[BMAX + 2];
    const kvc_dtype dts[2] = {KVC_I32, KVC_I64};
    for (int iter = 0; iter < 300; iter++) {
        kvc_dtype dt = dts[iter & 1];
        kvc_bitorder order = ORDERS[(iter >> 1) & 1];
        int64_t B = (int64_t)(test_rng_next(&rng) % (BMAX + 1));
        int64_t maxlen = iter % 3 == 0 ? 20 : LMAX;
        int64_t n = random_indptr(ip, dt, B, maxlen, &rng);
        int xo = (int)(test_rng_next(&rng) % 8);
        const uint8_t *x = xbuf + xo;
        fill_random(xbuf, XMAX + 8, &rng);
        /* Reference: each segment packed on its own, one after another. */
        int64_t pos = 0;
        for (int64_t b = 0; b < B; b++) {
            int64_t s = get_idx(ip, dt, b), e = get_idx(ip, dt, b + 1);
            ref_pack(x + s, e - s, order, want + pos);
            pos += ref_bytes(e - s);
        }
        /* Exact capacity and more. */
        for (int extra = 0; extra < 2; extra++) {
            memset(obuf, CANARY, sizeof obuf);
            memset(oip, 0xee, sizeof oip);
            kvc_tensor t = vec(ip, dt, B + 1), ot = vec(oip, dt, B + 1);
            ASSERT_OK(kvc_segment_packbits(x, &t, order, obuf + GUARD, pos + extra * 5, &ot));
            if (memcmp(obuf + GUARD, want, (size_t)pos))
                TEST_FAIL_("iter %d: B %lld n %lld packed bytes differ", iter, (long long)B,
                           (long long)n);
            ASSERT_TRUE(guards_intact(obuf, GUARD, pos, (int64_t)sizeof obuf));
            int64_t acc = 0;
            ASSERT_EQ_I64(get_idx(oip, dt, 0), 0);
            for (int64_t b = 0; b < B; b++) {
                acc += ref_bytes(get_idx(ip, dt, b + 1) - get_idx(ip, dt, b));
                ASSERT_EQ_I64(get_idx(oip, dt, b + 1), acc);
            }
            /* out_indptr's element B+1 (past its end) is untouched. */
            uint8_t sentinel[8];
            memset(sentinel, 0xee, 8);
            ASSERT_MEM_EQ((uint8_t *)oip + (dt == KVC_I64 ? 8 : 4) * (B + 1), sentinel,
                          dt == KVC_I64 ? 8 : 4);
        }
    }
    return 0;
}

TEST(segment_packbits_in_place_indptr) {
    /* out_indptr may describe indptr's own memory: each indptr[i + 1] is read
     * before out_indptr[i + 1] is written. */
    uint8_t x[20];
    uint64_t rng = test_seed;
    fill_random(x, 20, &rng);
    int64_t ip[5] = {0, 9, 9, 17, 20};
    uint8_t out[6], want[6];
    kvc_tensor t = vec(ip, KVC_I64, 5);
    ASSERT_OK(kvc_segment_packbits(x, &t, KVC_BITORDER_LITTLE, out, 6, &t));
    ref_pack(x, 9, KVC_BITORDER_LITTLE, want);
    ref_pack(x + 9, 8, KVC_BITORDER_LITTLE, want + 2);
    ref_pack(x + 17, 3, KVC_BITORDER_LITTLE, want + 3);
    ASSERT_MEM_EQ(out, want, 4);
    const int64_t wip[5] = {0, 2, 2, 3, 4};
    for (int i = 0; i < 5; i++) ASSERT_EQ_I64(ip[i], wip[i]);
    return 0;
}

/* out laid over the index array the loop reads again (core.h: undefined,
 * but in bounds): the first packed byte turned the last offset into 255,
 * and the old code then read x and wrote out far past their ends. */
TEST(packed_output_over_indptr_stays_in_bounds) {
    uint8_t x[16];
    memset(x, 1, sizeof x);
    int64_t *ip = malloc(3 * 8 + GUARD);
    ASSERT_TRUE(ip != NULL);
    memset(ip, CANARY, 3 * 8 + GUARD);
    ip[0] = 0, ip[1] = 8, ip[2] = 16;
    int64_t oip[3];
    kvc_tensor t = vec(ip, KVC_I64, 3), to = vec(oip, KVC_I64, 3);
    ASSERT_OK(kvc_segment_packbits(x, &t, KVC_BITORDER_LITTLE, (uint8_t *)&ip[2], 2, &to));
    ASSERT_TRUE(guards_intact((const uint8_t *)ip, 0, 3 * 8, 3 * 8 + GUARD));
    ASSERT_TRUE(oip[2] <= 2);
    free(ip);
    int32_t *qo = malloc(3 * 4 + GUARD), kv[3] = {0, 8, 16}, mi[3];
    ASSERT_TRUE(qo != NULL);
    memset(qo, CANARY, 3 * 4 + GUARD);
    qo[0] = 0, qo[1] = 1, qo[2] = 2;
    kvc_tensor tq = vec(qo, KVC_I32, 3), tk = vec(kv, KVC_I32, 3), tm = vec(mi, KVC_I32, 3);
    ASSERT_OK(kvc_build_packed_custom_mask(x, &tq, &tk, (uint8_t *)&qo[2], 2, &tm));
    ASSERT_TRUE(guards_intact((const uint8_t *)qo, 0, 3 * 4, 3 * 4 + GUARD));
    ASSERT_TRUE(mi[2] <= 2);
    free(qo);
    return 0;
}

TEST(segment_packbits_empty) {
    /* B = 0 (indptr = [0]) and all-empty segments need no buffers. */
    int32_t ip[3] = {0, 0, 0}, oip[3] = {7, 7, 7};
    kvc_tensor t = vec(ip, KVC_I32, 1), ot = vec(oip, KVC_I32, 1);
    ASSERT_OK(kvc_segment_packbits(NULL, &t, KVC_BITORDER_BIG, NULL, 0, &ot));
    ASSERT_EQ_I64(oip[0], 0);
    ASSERT_EQ_I64(oip[1], 7);
    t = vec(ip, KVC_I32, 3), ot = vec(oip, KVC_I32, 3);
    ASSERT_OK(kvc_segment_packbits(NULL, &t, KVC_BITORDER_BIG, NULL, 0, &ot));
    for (int i = 0; i < 3; i++) ASSERT_EQ_I64(oip[i], 0);
    return 0;
}

/* Runs a rejected segment_packbits call and checks that it fails with
 * INVALID_ARG, says want_msg, and leaves out and out_indptr unchanged. */
#define EXPECT_SEG_REJECT(x_, ip_, order_, cap_, oip_, want_msg)                                   \
    do {                                                                                           \
        memset(out, CANARY, sizeof out);                                                           \
        memset(oipbuf, 0x5a, sizeof oipbuf);                                                       \
        ASSERT_STATUS(kvc_segment_packbits((x_), (ip_), (order_), out, (cap_), (oip_)),            \
                      KVC_ERR_INVALID_ARG);                                                        \
        ASSERT_STR_CONTAINS(kvc_last_error(), want_msg);                                           \
        ASSERT_TRUE(guards_intact(out, 0, 0, (int64_t)sizeof out));                                \
        for (size_t i_ = 0; i_ < sizeof oipbuf; i_++) ASSERT_EQ_I64(((uint8_t *)oipbuf)[i_], 0x5a); \
    } while (0)

TEST(segment_packbits_rejects) {
    uint8_t x[64] = {1, 2, 3};
    uint8_t out[16];
    int64_t oipbuf[8];
    int32_t ip[4] = {0, 10, 20, 30};
    int64_t ip64[4] = {0, 10, 20, 30};
    kvc_tensor t = vec(ip, KVC_I32, 4), t64 = vec(ip64, KVC_I64, 4);
    kvc_tensor ot = vec(oipbuf, KVC_I32, 4), ot64 = vec(oipbuf, KVC_I64, 4);

    /* Sanity: the valid call needs 2 + 2 + 2 = 6 bytes. */
    ASSERT_OK(kvc_segment_packbits(x, &t, KVC_BITORDER_BIG, out, 6, &ot));

    EXPECT_SEG_REJECT(x, &t, (kvc_bitorder)2, 16, &ot, "bitorder");
    EXPECT_SEG_REJECT(x, NULL, KVC_BITORDER_BIG, 16, &ot, "indptr: tensor is NULL");
    EXPECT_SEG_REJECT(x, &t, KVC_BITORDER_BIG, 16, NULL, "out_indptr: tensor is NULL");
    EXPECT_SEG_REJECT(x, &t, KVC_BITORDER_BIG, 5, &ot, "out_capacity = 5 bytes");
    EXPECT_SEG_REJECT(x, &t, KVC_BITORDER_BIG, -1, &ot, "out_capacity = -1");
    EXPECT_SEG_REJECT(NULL, &t, KVC_BITORDER_BIG, 16, &ot, "x is NULL");
    EXPECT_SEG_REJECT(x, &t, KVC_BITORDER_BIG, 16, &ot64, "out_indptr must have indptr's dtype");
    EXPECT_SEG_REJECT(x, &t64, KVC_BITORDER_BIG, 16, &ot, "out_indptr must have indptr's dtype");
    ASSERT_STATUS(kvc_segment_packbits(x, &t, KVC_BITORDER_BIG, NULL, 16, &ot),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "out is NULL");

    kvc_tensor bad = vec(ip, KVC_F32, 4);
    EXPECT_SEG_REJECT(x, &bad, KVC_BITORDER_BIG, 16, &ot, "int32 or int64");
    bad = vec(ip, KVC_I32, 0);
    kvc_tensor ot0 = vec(oipbuf, KVC_I32, 0);
    EXPECT_SEG_REJECT(x, &bad, KVC_BITORDER_BIG, 16, &ot0, "B+1 >= 1");
    int64_t shape2[2] = {2, 2};
    bad = kvc_tensor_make(ip, KVC_I32, 2, shape2);
    EXPECT_SEG_REJECT(x, &bad, KVC_BITORDER_BIG, 16, &ot, "1-D");
    bad = vec(ip, KVC_I32, 4);
    bad.stride[0] = 2;
    EXPECT_SEG_REJECT(x, &bad, KVC_BITORDER_BIG, 16, &ot, "contiguous");
    kvc_tensor ot3 = vec(oipbuf, KVC_I32, 3);
    EXPECT_SEG_REJECT(x, &t, KVC_BITORDER_BIG, 16, &ot3, "out_indptr has 3 elements");

    int32_t nz0[3] = {1, 5, 9};
    bad = vec(nz0, KVC_I32, 3);
    EXPECT_SEG_REJECT(x, &bad, KVC_BITORDER_BIG, 16, &ot3, "indptr[0] must be 0, got 1");
    int64_t dec[4] = {0, 10, 9, 30};
    bad = vec(dec, KVC_I64, 4);
    EXPECT_SEG_REJECT(x, &bad, KVC_BITORDER_BIG, 16, &ot64, "indptr[2] = 9 < indptr[1] = 10");
    int32_t neg[3] = {0, -4, 0};
    bad = vec(neg, KVC_I32, 3);
    EXPECT_SEG_REJECT(x, &bad, KVC_BITORDER_BIG, 16, &ot3, "non-decreasing");
    return 0;
}

/* ---- build_packed_custom_mask ------------------------------------------------ */

TEST(custom_mask_layout) {
    /* Bit q * kv_len + k of request b's packed mask, read little-endian at
     * byte offset mask_indptr[b], is mask_b[q, k]. */
    uint64_t rng = test_seed ^ 0xc0ffee;
    enum { BMAX = 12, QMAX = 40, KMAX = 70 };
    static uint8_t mbuf[BMAX * QMAX * KMAX + 8], obuf[GUARD + BMAX * QMAX * KMAX / 8 + BMAX + GUARD];
    int32_t qo[BMAX + 1], kv[BMAX + 1], mip[BMAX + 2];
    for (int iter = 0; iter < 200; iter++) {
        int B = (int)(test_rng_next(&rng) % (BMAX + 1));
        qo[0] = kv[0] = 0;
        int64_t elems = 0, bytes = 0;
        for (int b = 0; b < B; b++) {
            uint64_t r = test_rng_next(&rng);
            int q = (r & 7) == 0 ? 0 : (int)((r >> 3) % (QMAX + 1));
            int k = (r & 0x700) == 0 ? 0 : (int)((r >> 20) % (KMAX + 1));
            qo[b + 1] = qo[b] + q;
            kv[b + 1] = kv[b] + k;
            elems += (int64_t)q * k;
            bytes += ((int64_t)q * k + 7) / 8;
        }
        int xo = (int)(test_rng_next(&rng) % 8);
        const uint8_t *mask = mbuf + xo;
        fill_random(mbuf, elems + 8, &rng);
        memset(obuf, CANARY, sizeof obuf);
        memset(mip, 0x77, sizeof mip);
        kvc_tensor tq = vec(qo, KVC_I32, B + 1), tk = vec(kv, KVC_I32, B + 1),
                   tm = vec(mip, KVC_I32, B + 1);
        uint8_t *out = obuf + GUARD;
        ASSERT_OK(kvc_build_packed_custom_mask(mask, &tq, &tk, out, bytes, &tm));
        ASSERT_TRUE(guards_intact(obuf, GUARD, bytes, (int64_t)sizeof obuf));
        ASSERT_EQ_I64(mip[B + 1], 0x77777777);
        ASSERT_EQ_I64(mip[0], 0);
        ASSERT_EQ_I64(mip[B], bytes);
        int64_t src = 0;
        for (int b = 0; b < B; b++) {
            int64_t q_len = qo[b + 1] - qo[b], k_len = kv[b + 1] - kv[b];
            ASSERT_EQ_I64(mip[b + 1] - mip[b], (q_len * k_len + 7) / 8);
            const uint8_t *p = out + mip[b];
            for (int64_t q = 0; q < q_len; q++) {
                for (int64_t k = 0; k < k_len; k++) {
                    int64_t off = q * k_len + k;
                    int bit = (p[off / 8] >> (off % 8)) & 1;
                    int want = mask[src + off] != 0;
                    if (bit != want)
                        TEST_FAIL_("iter %d request %d (q %lld, k %lld): bit %d, mask %d", iter, b,
                                   (long long)q, (long long)k, bit, want);
                }
            }
            /* Padding bits of the request's last byte are zero. */
            int64_t nbits = q_len * k_len;
            if (nbits % 8) ASSERT_EQ_I64(p[nbits / 8] >> (nbits % 8), 0);
            src += nbits;
        }
    }
    return 0;
}

TEST(custom_mask_equals_segment_packbits_little) {
    /* The same bytes as segment_packbits(mask, cumsum(qo * kv), "little"). */
    uint64_t rng = test_seed ^ 77;
    int32_t qo[6] = {0, 3, 3, 10, 11, 20}, kv[6] = {0, 5, 9, 9, 40, 41}, seg[6], mip[6], oseg[6];
    seg[0] = 0;
    for (int b = 0; b < 5; b++) seg[b + 1] = seg[b] + (qo[b + 1] - qo[b]) * (kv[b + 1] - kv[b]);
    static uint8_t mask[512], a[128], c[128];
    fill_random(mask, seg[5], &rng);
    kvc_tensor tq = vec(qo, KVC_I32, 6), tk = vec(kv, KVC_I32, 6), tm = vec(mip, KVC_I32, 6),
               ts = vec(seg, KVC_I32, 6), tos = vec(oseg, KVC_I32, 6);
    ASSERT_OK(kvc_build_packed_custom_mask(mask, &tq, &tk, a, sizeof a, &tm));
    ASSERT_OK(kvc_segment_packbits(mask, &ts, KVC_BITORDER_LITTLE, c, sizeof c, &tos));
    ASSERT_MEM_EQ(mip, oseg, sizeof mip);
    ASSERT_MEM_EQ(a, c, mip[5]);
    return 0;
}

#define EXPECT_MASK_REJECT(mask_, tq_, tk_, cap_, tm_, want_msg)                                   \
    do {                                                                                           \
        memset(out, CANARY, sizeof out);                                                           \
        memset(mip, 0x5a, sizeof mip);                                                             \
        ASSERT_STATUS(kvc_build_packed_custom_mask((mask_), (tq_), (tk_), out, (cap_), (tm_)),     \
                      KVC_ERR_INVALID_ARG);                                                        \
        ASSERT_STR_CONTAINS(kvc_last_error(), want_msg);                                           \
        ASSERT_TRUE(guards_intact(out, 0, 0, (int64_t)sizeof out));                                \
        for (size_t i_ = 0; i_ < sizeof mip; i_++) ASSERT_EQ_I64(((uint8_t *)mip)[i_], 0x5a);      \
    } while (0)

TEST(custom_mask_rejects) {
    uint8_t mask[64] = {1};
    uint8_t out[16];
    int32_t mip[8];
    int32_t qo[3] = {0, 2, 5}, kv[3] = {0, 4, 8}; /* 8 + 12 bits -> 1 + 2 bytes */
    kvc_tensor tq = vec(qo, KVC_I32, 3), tk = vec(kv, KVC_I32, 3), tm = vec(mip, KVC_I32, 3);
    ASSERT_OK(kvc_build_packed_custom_mask(mask, &tq, &tk, out, 3, &tm));
    ASSERT_EQ_I64(mip[2], 3);

    EXPECT_MASK_REJECT(mask, &tq, &tk, 2, &tm, "out_capacity = 2 bytes, the packed masks need 3");
    EXPECT_MASK_REJECT(mask, &tq, &tk, -3, &tm, "out_capacity = -3");
    EXPECT_MASK_REJECT(NULL, &tq, &tk, 3, &tm, "mask is NULL");
    EXPECT_MASK_REJECT(mask, NULL, &tk, 3, &tm, "qo_indptr: tensor is NULL");
    EXPECT_MASK_REJECT(mask, &tq, NULL, 3, &tm, "kv_indptr: tensor is NULL");
    EXPECT_MASK_REJECT(mask, &tq, &tk, 3, NULL, "mask_indptr: tensor is NULL");
    ASSERT_STATUS(kvc_build_packed_custom_mask(mask, &tq, &tk, NULL, 3, &tm), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "out is NULL");

    int64_t q64[3] = {0, 2, 5};
    kvc_tensor bad = vec(q64, KVC_I64, 3);
    EXPECT_MASK_REJECT(mask, &bad, &tk, 3, &tm, "qo_indptr must be int32");
    bad = vec(mip, KVC_I64, 3);
    EXPECT_MASK_REJECT(mask, &tq, &tk, 3, &bad, "mask_indptr must be int32");
    kvc_tensor tk2 = vec(kv, KVC_I32, 2);
    EXPECT_MASK_REJECT(mask, &tq, &tk2, 3, &tm, "kv_indptr has 2 elements");
    kvc_tensor tm4 = vec(mip, KVC_I32, 4);
    EXPECT_MASK_REJECT(mask, &tq, &tk, 3, &tm4, "mask_indptr has 4 elements");
    int32_t dec[3] = {0, 4, 3};
    bad = vec(dec, KVC_I32, 3);
    EXPECT_MASK_REJECT(mask, &tq, &bad, 3, &tm, "kv_indptr[2] = 3 < kv_indptr[1] = 4");
    int32_t nz0[3] = {1, 2, 5};
    bad = vec(nz0, KVC_I32, 3);
    EXPECT_MASK_REJECT(mask, &bad, &tk, 3, &tm, "qo_indptr[0] must be 0");

    /* 2^20 x 2^20 bits = 2^37 bytes: beyond int32 byte offsets, rejected
     * before the (absent) mask is read. */
    int32_t bq[2] = {0, 1 << 20}, bk[2] = {0, 1 << 20};
    kvc_tensor tbq = vec(bq, KVC_I32, 2), tbk = vec(bk, KVC_I32, 2), tbm = vec(mip, KVC_I32, 2);
    EXPECT_MASK_REJECT(mask, &tbq, &tbk, INT64_MAX, &tbm, "more than the int32 mask_indptr");

    /* B = 0 and empty requests need no buffers. */
    int32_t z[3] = {0, 0, 0}, zk[3] = {0, 5, 9};
    kvc_tensor tz = vec(z, KVC_I32, 3), tzk = vec(zk, KVC_I32, 3);
    ASSERT_OK(kvc_build_packed_custom_mask(NULL, &tz, &tzk, NULL, 0, &tm));
    ASSERT_EQ_I64(mip[0], 0);
    ASSERT_EQ_I64(mip[1], 0);
    ASSERT_EQ_I64(mip[2], 0);
    return 0;
}

const char *test_suite_name = "mask";
const test_case test_suite[] = {
    TEST_ENTRY(packbits_known_values),
    TEST_ENTRY(packbits_every_byte_value_is_truthy),
    TEST_ENTRY(packbits_every_n_and_alignment),
    TEST_ENTRY(packbits_all_ones_and_all_zeros),
    TEST_ENTRY(packbits_large_random),
    TEST_ENTRY(packbits_rejects),
    TEST_ENTRY(segment_packbits_known_values),
    TEST_ENTRY(segment_packbits_random),
    TEST_ENTRY(segment_packbits_in_place_indptr),
    TEST_ENTRY(packed_output_over_indptr_stays_in_bounds), TEST_ENTRY(segment_packbits_empty),
    TEST_ENTRY(segment_packbits_rejects),
    TEST_ENTRY(custom_mask_layout),
    TEST_ENTRY(custom_mask_equals_segment_packbits_little),
    TEST_ENTRY(custom_mask_rejects),
    {0, 0},
};
