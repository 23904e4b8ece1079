/* Model runtime in C: sampling, loading errors, and (with KVC_TINY_GGUF
 * pointing at a tiny llama written by tests/gen_tiny_gguf.py, as ctest
 * arranges) the forward pass and the engine, so the sanitizer builds run
 * them too. The independent reference is the numpy llama of
 * python/tests/llama_reference.py: here through the logits gen_tiny_gguf.py
 * wrote with it (tiny_eval_matches_numpy_reference); python/tests/test_model.py
 * compares more against it (every weight type, float/int8/int4 KV storage at
 * every decode step, the default model). The other tests here compare the
 * model with itself (threads, cache vs recomputation, batched vs alone). */
#define _POSIX_C_SOURCE 200809L /* mkstemp, fdopen */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"
#include "test_oom.h"

const char *test_suite_name = "model";

TEST(sample_greedy_and_ties) {
    float lg[5] = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
    kvc_sampling_params p = kvc_sampling_default_params();
    int32_t t = -1;
    ASSERT_OK(kvc_sample(lg, 5, &p, NULL, &t)); /* greedy needs no generator */
    ASSERT_EQ_I64(t, 1);                        /* lowest id among equal maxima */
    p.temperature = 0.7f;
    p.top_k = 1;
    uint64_t rng = 1;
    ASSERT_OK(kvc_sample(lg, 5, &p, &rng, &t));
    ASSERT_EQ_I64(t, 1);
    return 0;
}

TEST(sample_distribution_top_k_top_p) {
    float lg[4] = {1.0f, 0.0f, 2.0f, -3.0f};
    kvc_sampling_params p = kvc_sampling_default_params();
    p.temperature = 1.0f;
    uint64_t rng = test_seed;
    int counts[4] = {0};
    const int N = 20000;
    for (int i = 0; i < N; i++) {
        int32_t t;
        ASSERT_OK(kvc_sample(lg, 4, &p, &rng, &t));
        ASSERT_TRUE(t >= 0 && t < 4);
        counts[t]++;
    }
    double z = 0, pr[4];
    for (int i = 0; i < 4; i++) z += exp(lg[i]);
    for (int i = 0; i < 4; i++) {
        pr[i] = exp(lg[i]) / z;
        ASSERT_NEAR((double)counts[i] / N, pr[i], 0.015);
    }
    /* top_k 2 keeps ids 2 and 0 with renormalized mass */
    p.top_k = 2;
    int c2[4] = {0};
    for (int i = 0; i < N; i++) {
        int32_t t;
        ASSERT_OK(kvc_sample(lg, 4, &p, &rng, &t));
        c2[t]++;
    }
    ASSERT_EQ_I64(c2[1] + c2[3], 0);
    ASSERT_NEAR((double)c2[2] / N, pr[2] / (pr[2] + pr[0]), 0.015);
    /* top_p 0.6: id 2 alone holds 0.66 of the mass */
    p.top_k = 0;
    p.top_p = 0.6f;
    for (int i = 0; i < 200; i++) {
        int32_t t;
        ASSERT_OK(kvc_sample(lg, 4, &p, &rng, &t));
        ASSERT_EQ_I64(t, 2);
    }
    /* same state, same token */
    p.top_p = 1.0f;
    uint64_t a = 99, b = 99;
    for (int i = 0; i < 50; i++) {
        int32_t ta, tb;
        ASSERT_OK(kvc_sample(lg, 4, &p, &a, &ta));
        ASSERT_OK(kvc_sample(lg, 4, &p, &b, &tb));
        ASSERT_EQ_I64(ta, tb);
    }
    return 0;
}

TEST(sample_errors) {
    float lg[3] = {0.0f, NAN, 1.0f};
    kvc_sampling_params p = kvc_sampling_default_params();
    int32_t t = 7;
    uint64_t rng = 0;
    ASSERT_STATUS(kvc_sample(lg, 3, &p, &rng, &t), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "NaN");
    lg[1] = 0.0f;
    ASSERT_STATUS(kvc_sample(NULL, 3, &p, &rng, &t), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_sample(lg, 0, &p, &rng, &t), KVC_ERR_INVALID_ARG);
    p.temperature = -1.0f;
    ASSERT_STATUS(kvc_sample(lg, 3, &p, &rng, &t), KVC_ERR_INVALID_ARG);
    p.temperature = 1.0f;
    p.top_p = 0.0f;
    ASSERT_STATUS(kvc_sample(lg, 3, &p, &rng, &t), KVC_ERR_INVALID_ARG);
    p.top_p = 1.0f;
    p.top_k = -2;
    ASSERT_STATUS(kvc_sample(lg, 3, &p, &rng, &t), KVC_ERR_INVALID_ARG);
    p.top_k = 0;
    ASSERT_STATUS(kvc_sample(lg, 3, &p, NULL, &t), KVC_ERR_INVALID_ARG); /* sampling needs rng */
    ASSERT_EQ_I64(t, 7);
    /* infinite logits: the (first) maximum, never NaN arithmetic */
    float inf3[3] = {-INFINITY, -INFINITY, -INFINITY};
    ASSERT_OK(kvc_sample(inf3, 3, &p, &rng, &t));
    ASSERT_EQ_I64(t, 0);
    inf3[2] = INFINITY;
    ASSERT_OK(kvc_sample(inf3, 3, &p, &rng, &t));
    ASSERT_EQ_I64(t, 2);
    return 0;
}

TEST(load_errors) {
    kvc_model *m = (kvc_model *)(void *)1;
    ASSERT_STATUS(kvc_model_load(NULL, NULL, &m), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_model_load("x.gguf", NULL, NULL), KVC_ERR_INVALID_ARG);
    kvc_status st = kvc_model_load("/nonexistent/model.gguf", NULL, &m);
    ASSERT_TRUE(st == KVC_ERR_IO || st == KVC_ERR_NOT_FOUND);
    ASSERT_STR_CONTAINS(kvc_last_error(), "/nonexistent/model.gguf");
    /* a file that is not GGUF */
    char path[] = "/tmp/kvc_test_model_XXXXXX";
    FILE *f = NULL;
    int fd = mkstemp(path);
    ASSERT_TRUE(fd >= 0);
    f = fdopen(fd, "wb");
    ASSERT_TRUE(f != NULL);
    fputs("definitely not a gguf file, just text", f);
    fclose(f);
    st = kvc_model_load(path, NULL, &m);
    remove(path);
    ASSERT_STATUS(st, KVC_ERR_CORRUPT);
    kvc_model_destroy(NULL);
    kvc_engine_destroy(NULL);
    kvc_model_ctx_destroy(NULL);
    ASSERT_STATUS(kvc_engine_create(NULL, NULL, NULL), KVC_ERR_INVALID_ARG);
    return 0;
}


/* ---- with the tiny model ----------------------------------------------------- */

static kvc_model *tiny_model(void) {
    const char *path = getenv("KVC_TINY_GGUF");
    if (!path || !path[0]) return NULL;
    kvc_model *m = NULL;
    if (kvc_model_load(path, NULL, &m) != KVC_OK) {
        fprintf(stderr, "  cannot load %s: %s\n", path, kvc_last_error());
        return NULL;
    }
    return m;
}

/* m: the tiny model with `tensor` broken by nan_model (below). */
#define NEED_NAN_TINY(m, tensor)                                                                   \
    NEED_TINY(m##_good);                                                                           \
    kvc_model_destroy(m##_good);                                                                   \
    kvc_model *m = nan_model(getenv("KVC_TINY_GGUF"), tensor);                                     \
    ASSERT_TRUE(m != NULL)

#define NEED_TINY(m)                                                                               \
    kvc_model *m = tiny_model();                                                                   \
    if (!m) {                                                                                      \
        if (getenv("KVC_TINY_GGUF")) return 1;                                                     \
        SKIP("KVC_TINY_GGUF not set (ctest sets it)");                                             \
    }

TEST(tiny_info_and_eval) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    ASSERT_EQ_I64(in.n_layer, 2);
    ASSERT_EQ_I64(in.n_embd, 64);
    ASSERT_EQ_I64(in.n_head, 4);
    ASSERT_EQ_I64(in.n_head_kv, 2);
    ASSERT_EQ_I64(in.head_dim, 16);
    ASSERT_TRUE(in.n_vocab > 256 && kvc_model_tokenizer(m) != NULL);
    enum { N = 21 };
    int32_t tok[N];
    for (int i = 0; i < N; i++) tok[i] = (7 * i + 3) % in.n_vocab;
    float *a = malloc(sizeof(float) * N * (size_t)in.n_vocab);
    float *b = malloc(sizeof(float) * N * (size_t)in.n_vocab);
    ASSERT_TRUE(a && b);
    ASSERT_OK(kvc_model_eval(m, tok, N, -1, KVC_F32, a, 1));
    ASSERT_OK(kvc_model_eval(m, tok, N, -1, KVC_F32, b, 2)); /* thread count: same bits */
    ASSERT_MEM_EQ(a, b, sizeof(float) * N * (size_t)in.n_vocab);
    for (int64_t i = 0; i < (int64_t)N * in.n_vocab; i++) ASSERT_TRUE(isfinite(a[i]));
    /* the prefix of a sequence gives the same logits (row independence) */
    ASSERT_OK(kvc_model_eval(m, tok, 9, -1, KVC_F32, b, 2));
    ASSERT_MEM_EQ(a, b, sizeof(float) * 9 * (size_t)in.n_vocab);
    free(a);
    free(b);
    kvc_model_destroy(m);
    return 0;
}

/* The forward pass against the numpy llama (float64, weights dequantized by
 * the gguf package): logits gen_tiny_gguf.py wrote to KVC_TINY_REF for its
 * token ids, rows before decode_from through prefill and the rest through
 * the decode kernel. Tolerance as test_model.py's for quantized weights (the
 * C products round activations to int16): 1e-3 of max|ref| (measured ~3e-5
 * there), and the same arg-max wherever the reference's top-2 margin
 * exceeds 4x the error. */
TEST(tiny_eval_matches_numpy_reference) {
    NEED_TINY(m);
    const char *path = getenv("KVC_TINY_REF");
    FILE *f = path ? fopen(path, "rb") : NULL;
    if (!f) {
        kvc_model_destroy(m);
        SKIP("no numpy reference logits at %s (gen_tiny_gguf.py writes them with the gguf "
             "package)", path ? path : "KVC_TINY_REF (not set)");
    }
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    char magic[8];
    int32_t hdr[4], tok[64];
    int ok = fread(magic, 1, 8, f) == 8 && !memcmp(magic, "KVCREF1", 8) &&
             fread(hdr, 4, 4, f) == 4 && hdr[0] > 0 && hdr[0] <= 64 && hdr[1] == in.n_vocab &&
             fread(tok, 4, (size_t)hdr[0], f) == (size_t)hdr[0];
    const int64_t n = ok ? hdr[0] : 0, V = in.n_vocab;
    double *ref = malloc(sizeof(double) * (size_t)(n * V + 1));
    float *c = malloc(sizeof(float) * (size_t)(n * V + 1));
    ok = ok && ref && c && fread(ref, sizeof(double), (size_t)(n * V), f) == (size_t)(n * V);
    fclose(f);
    if (!ok) {
        free(ref);
        free(c);
        kvc_model_destroy(m);
        TEST_FAIL_("%s: not a reference file for this model", path);
    }
    kvc_status st = kvc_model_eval(m, tok, n, hdr[2], KVC_F32, c, 2);
    double amax = 0, err = 0;
    int64_t bad_row = -1, not_finite = 0;
    for (int64_t i = 0; st == KVC_OK && i < n * V; i++) {
        amax = fmax(amax, fabs(ref[i]));
        err = fmax(err, fabs((double)c[i] - ref[i]));
        not_finite += !isfinite(c[i]);
    }
    for (int64_t r = 0; st == KVC_OK && r < n && bad_row < 0; r++) {
        const double *x = ref + r * V;
        int64_t a = 0, b = -1, ca = 0;
        for (int64_t j = 1; j < V; j++) {
            if (x[j] > x[a]) {
                b = a;
                a = j;
            } else if (b < 0 || x[j] > x[b])
                b = j;
            if (c[r * V + j] > c[r * V + ca]) ca = j;
        }
        if (x[a] - x[b] > 4 * err && ca != a) bad_row = r;
    }
    free(ref);
    free(c);
    kvc_model_destroy(m);
    ASSERT_OK(st);
    printf("  max |c - numpy| = %.3g of max |numpy| (%.3g), %lld rows, decode from %d\n",
           err / amax, amax, (long long)n, hdr[2]);
    ASSERT_EQ_I64(not_finite, 0);
    if (!(err <= 1e-3 * amax)) TEST_FAIL_("max |c - numpy| %.3g > 1e-3 * %.3g", err, amax);
    if (bad_row >= 0) TEST_FAIL_("row %lld: arg-max differs from the reference's", (long long)bad_row);
    return 0;
}

/* Seed 001 in C: greedy decoding through the cache (generated rows through
 * the decode kernel) equals recomputing everything with the same split. */
TEST(tiny_cache_equals_recompute) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    const int64_t V = in.n_vocab, P = 6, G = 10;
    int32_t seqt[16] = {5, 9, 2, 7, 1, 3};
    kvc_cache_params cp = kvc_model_cache_params(m, KVC_F32, P + G);
    kvc_cache *cache;
    ASSERT_OK(kvc_cache_create(&cp, &cache));
    kvc_model_ctx *ctx;
    ASSERT_OK(kvc_model_ctx_create(m, 2, &ctx));
    kvc_seq_id s;
    ASSERT_OK(kvc_cache_add_sequence(cache, NULL, P, 0, &s, NULL));
    float *lg = malloc(sizeof(float) * (size_t)V), *all = malloc(sizeof(float) * 16 * (size_t)V);
    ASSERT_TRUE(lg && all);
    int64_t pos0 = 0, n = P, dec = P;
    ASSERT_OK(kvc_model_forward(ctx, cache, 1, &s, &pos0, &n, &dec, seqt, NULL, lg));
    for (int64_t t = P; t < P + G; t++) {
        int32_t next;
        ASSERT_OK(kvc_sample(lg, (int32_t)V, NULL, NULL, &next));
        seqt[t] = next;
        /* recompute the whole sequence so far with the same split */
        ASSERT_OK(kvc_model_eval(m, seqt, t, P, KVC_F32, all, 1));
        ASSERT_MEM_EQ(lg, all + (t - 1) * V, sizeof(float) * (size_t)V);
        if (t + 1 == P + G) break;
        ASSERT_OK(kvc_cache_append(cache, s, NULL, 1, NULL));
        pos0 = t;
        n = 1;
        ASSERT_OK(kvc_model_forward(ctx, cache, 1, &s, &pos0, &n, &dec, seqt + t, NULL, lg));
    }
    /* errors change nothing: positions past the reservation, bad tokens */
    pos0 = P + G;
    n = 1;
    ASSERT_STATUS(kvc_model_forward(ctx, cache, 1, &s, &pos0, &n, NULL, seqt, NULL, lg),
                  KVC_ERR_INVALID_ARG);
    pos0 = 0;
    int32_t bad = (int32_t)V;
    ASSERT_STATUS(kvc_model_forward(ctx, cache, 1, &s, &pos0, &n, NULL, &bad, NULL, lg),
                  KVC_ERR_INVALID_ARG);
    kvc_seq_id ghost = 12345;
    ASSERT_STATUS(kvc_model_forward(ctx, cache, 1, &ghost, &pos0, &n, NULL, seqt, NULL, lg),
                  KVC_ERR_NOT_FOUND);
    ASSERT_OK(kvc_cache_check(cache));
    free(lg);
    free(all);
    kvc_model_ctx_destroy(ctx);
    kvc_cache_destroy(cache);
    kvc_model_destroy(m);
    return 0;
}

/* Runs every prompt through one engine, request r for max_new[r] tokens (at
 * most 16); out[r] receives its tokens. */
static int run_engine(const kvc_model *m, kvc_engine_params ep, int n_req, const int32_t *prompts,
                      const int *lens, const int *max_new, int32_t out[][16],
                      kvc_engine_stats *st) {
    kvc_engine *e;
    if (kvc_engine_create(m, &ep, &e) != KVC_OK) return -1;
    int64_t ids[8];
    int got[8] = {0};
    for (int r = 0, off = 0; r < n_req; off += lens[r], r++)
        if (kvc_engine_add_request(e, prompts + off, lens[r], max_new[r], NULL, 1, &ids[r]) !=
            KVC_OK)
            return -1;
    kvc_engine_event ev[8];
    while (kvc_engine_pending(e) > 0) {
        int64_t ne;
        if (kvc_engine_step(e, ev, 8, &ne) != KVC_OK) return -1;
        if (kvc_cache_check(kvc_engine_cache(e)) != KVC_OK) return -1;
        for (int64_t i = 0; i < ne; i++)
            for (int r = 0; r < n_req; r++)
                if (ids[r] == ev[i].request_id && got[r] < 16) out[r][got[r]++] = ev[i].token;
    }
    for (int r = 0; r < n_req; r++)
        if (got[r] != max_new[r]) return -1;
    if (st) kvc_engine_get_stats(e, st);
    kvc_engine_destroy(e);
    return 0;
}

TEST(tiny_engine_batched_equals_alone) {
    NEED_TINY(m);
    /* prompts 0 and 2 share a 12-token prefix (prefix caching), 3 repeats 1 */
    int32_t prompts[64];
    const int lens[4] = {14, 9, 16, 9};
    int off = 0;
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < lens[r]; i++) {
            int32_t t = (int32_t)((r == 2 && i < 12) ? (3 * i + 1) % 300 : (11 * i + 5 * r) % 300);
            if (r == 0) t = (int32_t)((3 * i + 1) % 300);
            if (r == 3) t = (int32_t)((11 * i + 5) % 300);
            prompts[off++] = t;
        }
    const int max_new[4] = {6, 6, 6, 6};
    int32_t alone[4][16] = {{0}}, together[4][16] = {{0}}, tight[4][16] = {{0}};
    kvc_engine_params ep = kvc_engine_default_params();
    ep.page_size = 4;
    ep.kv_capacity_tokens = 256;
    for (int r = 0, o = 0; r < 4; o += lens[r], r++) {
        int32_t one[1][16] = {{0}};
        ASSERT_TRUE(run_engine(m, ep, 1, prompts + o, &lens[r], &max_new[r], one, NULL) == 0);
        memcpy(alone[r], one[0], sizeof one[0]);
    }
    ep.max_step_tokens = 8; /* chunked prefill mixed with decode rows */
    ep.n_threads = 2;
    kvc_engine_stats st;
    ASSERT_TRUE(run_engine(m, ep, 4, prompts, lens, max_new, together, &st) == 0);
    ASSERT_MEM_EQ(together, alone, sizeof alone);
    ASSERT_TRUE(st.cached_tokens >= 8);
    ep.kv_capacity_tokens = 40; /* too small for all at once: preemption */
    ASSERT_TRUE(run_engine(m, ep, 4, prompts, lens, max_new, tight, &st) == 0);
    ASSERT_MEM_EQ(tight, alone, sizeof alone);
    ASSERT_TRUE(st.preemptions > 0);
    kvc_model_destroy(m);
    return 0;
}

/* The compressed formats: prompts that cross K groups (64 tokens), two
 * sharing a 66-token prefix (a hit of one whole group), computed alone, in a
 * batch with chunked prefill (8 rows a step) and with preemption: the same
 * tokens, since every query reads what a decode at its position would and a
 * prefix hit ends on a group boundary. */
TEST(tiny_engine_compressed_formats_batched_equals_alone) {
    NEED_TINY(m);
    int32_t prompts[256];
    const int lens[3] = {70, 20, 80};
    int off = 0;
    for (int r = 0; r < 3; r++)
        for (int i = 0; i < lens[r]; i++)
            prompts[off++] = (int32_t)((r == 1 || i >= 66 ? 7 * i + 13 * r + 2 : 3 * i + 1) % 300);
    const int max_new[3] = {6, 6, 6};
    const kvc_kv_format fmts[2] = {KVC_KVFMT_KIVI8, KVC_KVFMT_KIVI4};
    for (int fi = 0; fi < 2; fi++) {
        int32_t alone[3][16] = {{0}}, together[3][16] = {{0}}, tight[3][16] = {{0}};
        kvc_engine_params ep = kvc_engine_default_params();
        ep.kv_format = fmts[fi];
        ep.kv_capacity_tokens = 512;
        for (int r = 0, o = 0; r < 3; o += lens[r], r++) {
            int32_t one[1][16] = {{0}};
            ASSERT_TRUE(run_engine(m, ep, 1, prompts + o, &lens[r], &max_new[r], one, NULL) == 0);
            memcpy(alone[r], one[0], sizeof one[0]);
        }
        ep.max_step_tokens = 8;
        ep.n_threads = 2;
        kvc_engine_stats st;
        ASSERT_TRUE(run_engine(m, ep, 3, prompts, lens, max_new, together, &st) == 0);
        ASSERT_MEM_EQ(together, alone, sizeof alone);
        ASSERT_TRUE(st.cached_tokens >= 64); /* prompt 2 reused prompt 0's first group */
        ep.kv_capacity_tokens = 112;          /* 7 pages: preemption */
        ASSERT_TRUE(run_engine(m, ep, 3, prompts, lens, max_new, tight, &st) == 0);
        ASSERT_MEM_EQ(tight, alone, sizeof alone);
    }
    kvc_model_destroy(m);
    return 0;
}

/* core.h promises the runtime (prefill, decode, matrix products) works in
 * 256 KiB of stack: kvc_model_eval with prefill and decode rows and 2
 * threads, on a thread created with exactly that (test_on_small_stack), on
 * every ISA, same logits as on the main thread. */

typedef struct eval_job {
    const kvc_model *m;
    const int32_t *tok;
    int64_t n;
    float *logits;
    kvc_status st;
} eval_job;

static void *eval_thread(void *arg) {
    eval_job *j = arg;
    j->st = kvc_model_eval(j->m, j->tok, j->n, j->n - 3, KVC_I8, j->logits, 2);
    return NULL;
}

TEST(tiny_eval_in_256k_of_stack) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    int32_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = (int32_t)((i * 29 + 3) % in.n_vocab);
    const size_t bytes = (size_t)40 * (size_t)in.n_vocab * sizeof(float);
    float *want = malloc(bytes), *got = malloc(bytes);
    ASSERT_TRUE(want && got);
    FOR_EACH_ISA({
        ASSERT_OK(kvc_model_eval(m, tok, 40, 37, KVC_I8, want, 2));
        eval_job j = {m, tok, 40, got, KVC_ERR_INTERNAL};
        ASSERT_TRUE(test_on_small_stack(eval_thread, &j) == 0);
        ASSERT_OK(j.st);
        ASSERT_MEM_EQ(got, want, bytes);
    });
    free(want);
    free(got);
    kvc_model_destroy(m);
    return 0;
}

/* A prompt chunk's reservation that preempts a request already in the step's
 * batch and still does not fit: the batch must lose the preempted request
 * (it used to be forwarded with its freed sequence: "unknown sequence").
 * Generation lengths are fixed (ignore_eos), so the schedule does not depend
 * on the model's tokens. */
TEST(tiny_engine_preemption_inside_prompt_chunks) {
    NEED_TINY(m);
    int32_t prompts[92];
    const int lens[5] = {27, 20, 1, 43, 1}, max_new[5] = {15, 5, 11, 1, 2};
    for (int r = 0, off = 0; r < 5; off += lens[r], r++)
        for (int i = 0; i < lens[r]; i++) prompts[off + i] = (int32_t)(3 + (i * 37) % 300);
    kvc_engine_params ep = kvc_engine_default_params();
    ep.kv_dtype = KVC_F32;
    ep.enable_prefix_caching = 0;
    int32_t alone[5][16] = {{0}}, tight[5][16] = {{0}};
    for (int r = 0, o = 0; r < 5; o += lens[r], r++) {
        int32_t one[1][16] = {{0}};
        ASSERT_TRUE(run_engine(m, ep, 1, prompts + o, &lens[r], &max_new[r], one, NULL) == 0);
        memcpy(alone[r], one[0], sizeof one[0]);
    }
    ep.page_size = 1;
    ep.kv_capacity_tokens = 44;
    ep.max_step_tokens = 5;
    ep.max_running = 3;
    kvc_engine_stats st;
    ASSERT_TRUE(run_engine(m, ep, 5, prompts, lens, max_new, tight, &st) == 0);
    ASSERT_MEM_EQ(tight, alone, sizeof alone);
    ASSERT_TRUE(st.preemptions > 0);
    kvc_model_destroy(m);
    return 0;
}

/* The tiny model with tensor[0] = NaN (F32, or a Q8_0 block scale),
 * written to a temp file: output_norm.weight makes every logit NaN
 * (kvc_sample fails inside kvc_engine_step); blk.1.attn_norm.weight makes
 * layer 1's q/k/v NaN, which kvc_model_forward refuses after layer 0 stored
 * its K/V; token_embd.weight does so for token 0 only, at layer 0. */
static kvc_model *nan_model(const char *tiny, const char *tensor) {
    FILE *f = fopen(tiny, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc((size_t)size);
    kvc_model *m = NULL;
    if (buf && fread(buf, 1, (size_t)size, f) == (size_t)size) {
        kvc_gguf *g;
        kvc_gguf_tensor t;
        if (kvc_gguf_open_memory(buf, (size_t)size, &g) == KVC_OK) {
            int64_t i = kvc_gguf_find_tensor(g, tensor);
            /* F32: element 0; Q8_0: the scale of block 0 (row 0's first 32) */
            if (i >= 0 && kvc_gguf_get_tensor(g, i, &t) == KVC_OK && (t.type == 0 || t.type == 8)) {
                const size_t off = (size_t)((const unsigned char *)t.data - buf);
                const float nan = NAN;
                const uint16_t nan16 = 0x7e00;
                const int f32 = t.type == 0;
                kvc_gguf_close(g);
                g = NULL;
                if (f32)
                    memcpy(buf + off, &nan, sizeof nan);
                else
                    memcpy(buf + off, &nan16, sizeof nan16);
                char path[] = "/tmp/kvc_test_nan_XXXXXX";
                int fd = mkstemp(path);
                FILE *o = fd >= 0 ? fdopen(fd, "wb") : NULL;
                if (o) {
                    int ok = fwrite(buf, 1, (size_t)size, o) == (size_t)size;
                    if (fclose(o) == 0 && ok && kvc_model_load(path, NULL, &m) != KVC_OK) m = NULL;
                }
                if (fd >= 0) remove(path);
            }
            kvc_gguf_close(g);
        }
    }
    free(buf);
    fclose(f);
    return m;
}

/* A step whose sampling fails (NaN logits) commits nothing: the request is
 * neither advanced nor retired, the same step fails the same way again (it
 * used to write before its batch arrays on the next step), and the request
 * can still be cancelled with every page released. */
TEST(tiny_engine_failed_step_changes_nothing) {
    NEED_NAN_TINY(m, "output_norm.weight");
    kvc_engine_params ep = kvc_engine_default_params();
    ep.page_size = 4;
    ep.kv_capacity_tokens = 64;
    kvc_engine *e;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    const int32_t p[6] = {5, 6, 7, 8, 9, 10};
    int64_t id;
    ASSERT_OK(kvc_engine_add_request(e, p, 6, 4, NULL, 0, &id));
    kvc_engine_event ev[1];
    int64_t ne = -1;
    for (int k = 0; k < 3; k++) {
        ASSERT_STATUS(kvc_engine_step(e, ev, 1, &ne), KVC_ERR_INVALID_ARG);
        ASSERT_STR_CONTAINS(kvc_last_error(), "NaN");
        ASSERT_STR_CONTAINS(kvc_last_error(), "request 0");
        ASSERT_EQ_I64(kvc_engine_pending(e), 1);
        ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
    }
    kvc_engine_stats st;
    ASSERT_OK(kvc_engine_get_stats(e, &st));
    ASSERT_EQ_I64(st.decode_tokens, 0);
    ASSERT_EQ_I64(st.prompt_tokens, 0); /* the admission was undone with the step */
    ASSERT_OK(kvc_engine_cancel(e, id));
    kvc_cache_stats cs;
    ASSERT_OK(kvc_cache_get_stats(kvc_engine_cache(e), &cs));
    ASSERT_EQ_I64(cs.used_pages, 0);
    kvc_engine_destroy(e);
    kvc_model_destroy(m);
    return 0;
}

/* A connector that restores in line whatever it is asked for (the pages'
 * contents do not matter: the steps here fail at sampling). */
static kvc_status all_probe(void *user, const kvc_cache *c, const int32_t *tokens, int64_t first,
                            int64_t max, int64_t *n) {
    (void)user, (void)c, (void)tokens, (void)first;
    *n = max;
    return KVC_OK;
}
static void *no_load(void *user, const kvc_cache *c, const int32_t *tokens, int64_t first,
                     int64_t n) {
    (void)user, (void)c, (void)tokens, (void)first, (void)n;
    return NULL;
}
static int no_poll(void *user, void *load, int wait, int64_t *ready) {
    (void)user, (void)load, (void)wait;
    *ready = 0;
    return 1;
}
static void no_finish(void *user, void *load, kvc_cache *c, int64_t skip, const int32_t *ids,
                      int64_t n) {
    (void)user, (void)load, (void)c, (void)skip, (void)ids, (void)n;
}
static kvc_status all_restore(void *user, kvc_cache *c, const int32_t *tokens, int64_t first,
                              int64_t n, const int32_t *ids, int64_t *n_restored) {
    (void)user, (void)c, (void)tokens, (void)first, (void)ids;
    *n_restored = n;
    return KVC_OK;
}

/* A failed step undoes the counting of the admissions it made, the
 * connector's tokens included: retried (here, failing again with the
 * restored pages now a prefix hit), each prompt token is counted once, as
 * cached, restored or missed. */
TEST(tiny_engine_failed_step_counts_no_restored_tokens) {
    NEED_NAN_TINY(m, "output_norm.weight");
    kvc_engine_params ep = kvc_engine_default_params();
    ep.page_size = 4;
    ep.kv_capacity_tokens = 64;
    kvc_engine *e;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    kvc_engine_connector c;
    memset(&c, 0, sizeof c);
    c.probe = all_probe;
    c.load_start = no_load;
    c.load_poll = no_poll;
    c.load_finish = no_finish;
    c.restore = all_restore;
    ASSERT_OK(kvc_engine_set_connector(e, &c));
    int32_t p[10];
    for (int i = 0; i < 10; i++) p[i] = 5 + i;
    int64_t id;
    ASSERT_OK(kvc_engine_add_request(e, p, 10, 2, NULL, 1, &id));
    kvc_engine_event ev[1];
    int64_t ne;
    for (int k = 0; k < 2; k++) {
        ASSERT_STATUS(kvc_engine_step(e, ev, 1, &ne), KVC_ERR_INVALID_ARG);
        ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
        kvc_engine_stats st;
        ASSERT_OK(kvc_engine_get_stats(e, &st));
        ASSERT_EQ_I64(st.prompt_tokens, 0);
        ASSERT_EQ_I64(st.cached_tokens, 0);
        ASSERT_EQ_I64(st.external_tokens, 0);
        ASSERT_EQ_I64(st.external_miss_tokens, 0);
    }
    ASSERT_OK(kvc_engine_cancel(e, id));
    kvc_engine_destroy(e);
    kvc_model_destroy(m);
    return 0;
}

/* A forward that fails after layer 0 stored K/V (layer 1's q/k/v are NaN),
 * with two identical prompts admitted in the same step: the second hits the
 * pages the first reserved in that step. The failed step must leave no page
 * findable (none holds K/V for every layer), both requests queued in their
 * order with nothing counted, and fail the same way when retried. */
TEST(tiny_engine_failed_forward_leaves_no_page_findable) {
    NEED_NAN_TINY(m, "blk.1.attn_norm.weight");
    kvc_engine_params ep = kvc_engine_default_params();
    ep.page_size = 4;
    ep.kv_capacity_tokens = 64;
    kvc_engine *e;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    int32_t p[13];
    for (int i = 0; i < 13; i++) p[i] = 7 + 3 * i;
    int64_t id[2];
    ASSERT_OK(kvc_engine_add_request(e, p, 13, 2, NULL, 1, &id[0]));
    ASSERT_OK(kvc_engine_add_request(e, p, 13, 2, NULL, 1, &id[1]));
    const kvc_cache *cache = kvc_engine_cache(e);
    kvc_engine_event ev[2];
    int64_t ne, hit = -1;
    for (int k = 0; k < 2; k++) {
        ASSERT_STATUS(kvc_engine_step(e, ev, 2, &ne), KVC_ERR_CORRUPT);
        ASSERT_STR_CONTAINS(kvc_last_error(), "layer 1");
        ASSERT_EQ_I64(kvc_engine_pending(e), 2);
        ASSERT_OK(kvc_cache_check(cache));
        ASSERT_OK(kvc_cache_lookup_prefix(cache, p, 13, 0, &hit));
        ASSERT_EQ_I64(hit, 0);
        kvc_cache_stats cs;
        ASSERT_OK(kvc_cache_get_stats(cache, &cs));
        ASSERT_EQ_I64(cs.used_pages, 0);
        kvc_engine_stats st;
        ASSERT_OK(kvc_engine_get_stats(e, &st));
        ASSERT_EQ_I64(st.prompt_tokens, 0);
    }
    /* both still queued */
    ASSERT_OK(kvc_engine_cancel(e, id[0]));
    ASSERT_OK(kvc_engine_cancel(e, id[1]));
    ASSERT_EQ_I64(kvc_engine_pending(e), 0);
    kvc_engine_destroy(e);
    kvc_model_destroy(m);
    return 0;
}

/* A failed step with a request admitted in an earlier step running: token 0
 * embeds to NaN, so the step that admits a prompt holding it fails while A
 * decodes. A must be rolled back to its computed tokens and, once the bad
 * request is cancelled, finish with exactly the tokens it gets alone. */
TEST(tiny_engine_failed_step_rolls_back_running_requests) {
    NEED_NAN_TINY(m, "token_embd.weight");
    kvc_engine_params ep = kvc_engine_default_params();
    ep.page_size = 4;
    ep.kv_capacity_tokens = 128;
    const int32_t a[11] = {5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125};
    const int32_t bad[6] = {9, 8, 0, 7, 6, 5};
    const int len_a = 11, max_a = 8;
    int32_t alone[1][16] = {{0}};
    ASSERT_TRUE(run_engine(m, ep, 1, a, &len_a, &max_a, alone, NULL) == 0);
    kvc_engine *e;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    int64_t id_a, id_b;
    ASSERT_OK(kvc_engine_add_request(e, a, len_a, max_a, NULL, 1, &id_a));
    kvc_engine_event ev[2];
    int64_t ne;
    int32_t got[16];
    int n_got = 0;
    ASSERT_OK(kvc_engine_step(e, ev, 2, &ne)); /* A's prompt and first token */
    ASSERT_EQ_I64(ne, 1);
    got[n_got++] = ev[0].token;
    ASSERT_OK(kvc_engine_add_request(e, bad, 6, 4, NULL, 1, &id_b));
    for (int k = 0; k < 2; k++) { /* A's decode row + B's admission: fails, twice */
        ASSERT_STATUS(kvc_engine_step(e, ev, 2, &ne), KVC_ERR_CORRUPT);
        ASSERT_STR_CONTAINS(kvc_last_error(), "layer 0");
        ASSERT_EQ_I64(kvc_engine_pending(e), 2);
        ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
    }
    ASSERT_OK(kvc_engine_cancel(e, id_b));
    while (kvc_engine_pending(e) > 0) {
        ASSERT_OK(kvc_engine_step(e, ev, 2, &ne));
        for (int64_t i = 0; i < ne; i++)
            if (ev[i].request_id == id_a && n_got < 16) got[n_got++] = ev[i].token;
    }
    ASSERT_EQ_I64(n_got, max_a);
    ASSERT_MEM_EQ(got, alone[0], (size_t)max_a * sizeof(int32_t));
    kvc_engine_destroy(e);
    kvc_model_destroy(m);
    return 0;
}

/* One context limit (n_ctx_train 256 for the tiny model unless overridden)
 * for eval, forward and engine admission, named in the error. */
TEST(tiny_context_limit) {
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    ASSERT_EQ_I64(in.n_ctx_train, 256);
    ASSERT_EQ_I64(in.n_ctx, 256);
    enum { N = 300 };
    int32_t tok[N];
    for (int i = 0; i < N; i++) tok[i] = (5 * i + 1) % in.n_vocab;
    float *lg = malloc(sizeof(float) * N * (size_t)in.n_vocab);
    ASSERT_TRUE(lg != NULL);
    lg[0] = 7.0f;
    ASSERT_STATUS(kvc_model_eval(m, tok, 257, -1, KVC_F32, lg, 1), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "past the context limit of 256 tokens");
    ASSERT_STR_CONTAINS(kvc_last_error(), "kvc_model_params.n_ctx");
    ASSERT_TRUE(lg[0] == 7.0f);
    ASSERT_OK(kvc_model_eval(m, tok, 256, -1, KVC_F32, lg, 1));
    /* the engine refuses a request past it at admission */
    kvc_engine *e = NULL;
    ASSERT_OK(kvc_engine_create(m, NULL, &e));
    int64_t rid;
    ASSERT_STATUS(kvc_engine_add_request(e, tok, 250, 7, NULL, 0, &rid), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "prompt + max_new_tokens is 257 tokens");
    ASSERT_EQ_I64(kvc_engine_pending(e), 0);
    ASSERT_OK(kvc_engine_add_request(e, tok, 250, 6, NULL, 0, &rid));
    kvc_engine_destroy(e);
    /* forward: positions past the limit */
    kvc_cache_params cp = kvc_model_cache_params(m, KVC_F32, 512);
    kvc_cache *c = NULL;
    ASSERT_OK(kvc_cache_create(&cp, &c));
    kvc_seq_id seq;
    ASSERT_OK(kvc_cache_add_sequence(c, NULL, 257, 0, &seq, NULL));
    kvc_model_ctx *ctx = NULL;
    ASSERT_OK(kvc_model_ctx_create(m, 1, &ctx));
    const int64_t pos0 = 250, n1 = 7;
    ASSERT_STATUS(kvc_model_forward(ctx, c, 1, &seq, &pos0, &n1, NULL, tok, NULL, lg),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "a sequence reaches 257 tokens");
    kvc_model_ctx_destroy(ctx);
    kvc_cache_destroy(c);
    kvc_model_destroy(m);
    /* an explicit override, larger and smaller */
    kvc_model_params p = kvc_model_default_params();
    p.n_ctx = 300;
    ASSERT_OK(kvc_model_load(getenv("KVC_TINY_GGUF"), &p, &m));
    ASSERT_OK(kvc_model_get_info(m, &in));
    ASSERT_EQ_I64(in.n_ctx, 300);
    ASSERT_OK(kvc_model_eval(m, tok, 300, -1, KVC_F32, lg, 1));
    kvc_model_destroy(m);
    p.n_ctx = 8;
    ASSERT_OK(kvc_model_load(getenv("KVC_TINY_GGUF"), &p, &m));
    ASSERT_STATUS(kvc_model_eval(m, tok, 9, -1, KVC_F32, lg, 1), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "context limit of 8 tokens (the model's n_ctx_train is 256");
    kvc_model_destroy(m);
    p.n_ctx = -1;
    ASSERT_STATUS(kvc_model_load(getenv("KVC_TINY_GGUF"), &p, &m), KVC_ERR_INVALID_ARG);
    free(lg);
    return 0;
}

TEST(tiny_engine_errors_and_cancel) {
    NEED_TINY(m);
    kvc_engine_params ep = kvc_engine_default_params();
    ep.kv_capacity_tokens = 32;
    kvc_engine *e;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    int32_t p[40] = {0};
    int64_t id, id2;
    ASSERT_STATUS(kvc_engine_add_request(e, p, 30, 8, NULL, 0, &id), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_engine_add_request(e, p, 0, 8, NULL, 0, &id), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_engine_add_request(e, p, 4, 0, NULL, 0, &id), KVC_ERR_INVALID_ARG);
    p[2] = 1 << 30;
    ASSERT_STATUS(kvc_engine_add_request(e, p, 4, 4, NULL, 0, &id), KVC_ERR_INVALID_ARG);
    p[2] = 0;
    kvc_sampling_params sp = kvc_sampling_default_params();
    sp.top_p = 2.0f;
    ASSERT_STATUS(kvc_engine_add_request(e, p, 4, 4, &sp, 0, &id), KVC_ERR_INVALID_ARG);
    sp = kvc_sampling_default_params();
    sp.temperature = INFINITY; /* kvc_sample refuses it: so must the request */
    ASSERT_STATUS(kvc_engine_add_request(e, p, 4, 4, &sp, 0, &id), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "temperature inf");
    /* no signed overflow in the capacity check, no read past the prompt */
    ASSERT_STATUS(kvc_engine_add_request(e, p, INT64_MAX, 1, NULL, 0, &id), KVC_ERR_INVALID_ARG);
    ASSERT_EQ_I64(kvc_engine_pending(e), 0);
    ASSERT_OK(kvc_engine_add_request(e, p, 4, 4, NULL, 1, &id));
    ASSERT_OK(kvc_engine_add_request(e, p, 6, 4, NULL, 1, &id2));
    kvc_engine_event ev[2];
    int64_t ne;
    ASSERT_STATUS(kvc_engine_step(e, ev, 1, &ne), KVC_ERR_INVALID_ARG); /* room for 2 needed */
    ASSERT_STATUS(kvc_engine_step(e, NULL, 2, &ne), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "NULL");
    ASSERT_STATUS(kvc_engine_step(e, ev, -1, &ne), KVC_ERR_INVALID_ARG);
    ASSERT_OK(kvc_engine_step(e, ev, 2, &ne));
    ASSERT_EQ_I64(ne, 2);
    ASSERT_OK(kvc_engine_cancel(e, id));
    ASSERT_STATUS(kvc_engine_cancel(e, id), KVC_ERR_NOT_FOUND);
    ASSERT_EQ_I64(kvc_engine_pending(e), 1);
    while (kvc_engine_pending(e) > 0) ASSERT_OK(kvc_engine_step(e, ev, 2, &ne));
    kvc_cache_stats cs;
    ASSERT_OK(kvc_cache_get_stats(kvc_engine_cache(e), &cs));
    ASSERT_EQ_I64(cs.used_pages, 0); /* everything released */
    ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
    kvc_engine_destroy(e);
    /* capacities and positions at INT64_MAX: errors, no signed overflow
     * (the sanitizer build runs this) */
    ASSERT_EQ_I64(kvc_model_cache_params(m, KVC_F16, INT64_MAX).num_pages, INT64_MAX / 16 + 1);
    ASSERT_EQ_I64(kvc_model_cache_params(m, KVC_F16, 33).num_pages, 3);
    ep.kv_capacity_tokens = INT64_MAX;
    ASSERT_STATUS(kvc_engine_create(m, &ep, &e), KVC_ERR_INVALID_ARG);
    float lg[1];
    ASSERT_TRUE(kvc_model_eval(m, p, INT64_MAX, -1, KVC_F32, lg, 1) != KVC_OK);
    kvc_cache *cache;
    kvc_cache_params cp = kvc_model_cache_params(m, KVC_F32, 32);
    ASSERT_OK(kvc_cache_create(&cp, &cache));
    kvc_model_ctx *ctx;
    ASSERT_OK(kvc_model_ctx_create(m, 1, &ctx));
    kvc_seq_id seq;
    ASSERT_OK(kvc_cache_add_sequence(cache, NULL, 4, 0, &seq, NULL));
    int64_t pos0 = INT64_MAX, n4 = 4;
    float logits[4 * 512];
    ASSERT_STATUS(kvc_model_forward(ctx, cache, 1, &seq, &pos0, &n4, NULL, p, NULL, logits),
                  KVC_ERR_INVALID_ARG);
    kvc_model_ctx_destroy(ctx);
    kvc_cache_destroy(cache);
    kvc_model_destroy(m);
    return 0;
}

/* ---- out of memory ----------------------------------------------------------- */

/* Bytes of every layer's K/V storage and scales of c, copied to buf unless
 * NULL. */
static size_t cache_storage(const kvc_cache *c, int32_t n_layer, unsigned char *buf) {
    size_t o = 0;
    for (int32_t l = 0; l < n_layer; l++) {
        kvc_tensor t[2];
        if (kvc_cache_layer_tensors(c, l, &t[0], &t[1]) != KVC_OK) return 0;
        for (int i = 0; i < 2; i++) {
            if (!t[i].data) continue; /* a float cache has no scales */
            const size_t b =
                (size_t)kvc_tensor_numel(&t[i]) * (size_t)kvc_dtype_bits(t[i].dtype) / 8;
            if (buf) memcpy(buf + o, t[i].data, b);
            o += b;
        }
    }
    return o;
}

enum { OOM_NA = 160, OOM_NB = 8 };

/* A cache holding sequence *sb with OOM_NB computed tokens of tb and one
 * more slot, and sequence *sa with OOM_NA slots, nothing computed. */
static int oom_cache(kvc_model_ctx *ctx, const kvc_cache_params *cp, const int32_t *tb,
                     float *logits, kvc_cache **c, kvc_seq_id *sa, kvc_seq_id *sb) {
    const int64_t pos0 = 0, n = OOM_NB;
    if (kvc_cache_create(cp, c) != KVC_OK) return 1;
    if (kvc_cache_add_sequence(*c, NULL, OOM_NB + 1, 0, sb, NULL) != KVC_OK ||
        kvc_model_forward(ctx, *c, 1, sb, &pos0, &n, &n, tb, NULL, logits) != KVC_OK ||
        kvc_cache_add_sequence(*c, NULL, OOM_NA, 0, sa, NULL) != KVC_OK)
        return 1;
    return 0;
}

/* A step that runs out of memory fails before it writes any K/V: every
 * allocation of a forward step (a 160-row prefill batched with a decode
 * row; float16 and int8 caches; one and two threads; a fresh context and
 * one whose scratch already fits) failed in turn gives KVC_ERR_NOMEM with
 * every layer's storage unchanged, and the context then computes the
 * logits of a run without failures. Layer 1's matrix products and int8
 * appends used to allocate after layer 0 had stored its K/V. */
TEST(tiny_forward_out_of_memory_writes_nothing) {
    if (!test_oom_available()) SKIP("allocation failures need the linker's --wrap");
    NEED_TINY(m);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    const int64_t V = in.n_vocab;
    int32_t rows[OOM_NA + 1], tb[OOM_NB + 1];
    for (int i = 0; i < OOM_NA; i++) rows[i] = (13 * i + 5) % (int32_t)V;
    for (int i = 0; i <= OOM_NB; i++) tb[i] = (7 * i + 2) % (int32_t)V;
    rows[OOM_NA] = tb[OOM_NB];
    const int64_t p0[2] = {0, OOM_NB}, n[2] = {OOM_NA, 1}, dec[2] = {OOM_NA, OOM_NB};
    const size_t lbytes = 2 * (size_t)V * sizeof(float);
    float *ref = malloc(lbytes), *lg = malloc(lbytes);
    ASSERT_TRUE(ref && lg);
    const kvc_dtype dts[2] = {KVC_F16, KVC_I8};
    int points = 0;
    for (int d = 0; d < 2; d++) {
        kvc_cache_params cp = kvc_model_cache_params(m, dts[d], OOM_NA + OOM_NB + 8);
        for (int32_t threads = 1; threads <= 2; threads++) {
            kvc_model_ctx *warm, *ctx;
            kvc_cache *c;
            kvc_seq_id s[2];
            ASSERT_OK(kvc_model_ctx_create(m, threads, &warm));
            ASSERT_TRUE(oom_cache(warm, &cp, tb, lg, &c, &s[0], &s[1]) == 0);
            ASSERT_OK(kvc_model_forward(warm, c, 2, s, p0, n, dec, rows, NULL, ref));
            const size_t bytes = cache_storage(c, in.n_layer, NULL);
            kvc_cache_destroy(c);
            unsigned char *before = malloc(bytes), *after = malloc(bytes);
            ASSERT_TRUE(before && after && bytes > 0);
            for (int w = 0; w < 2; w++) {
                for (long k = 1;; k++) {
                    ctx = warm;
                    if (!w) ASSERT_OK(kvc_model_ctx_create(m, threads, &ctx));
                    ASSERT_TRUE(oom_cache(ctx, &cp, tb, lg, &c, &s[0], &s[1]) == 0);
                    cache_storage(c, in.n_layer, before);
                    kvc_clear_error();
                    test_oom_arm(k, 0);
                    kvc_status st = kvc_model_forward(ctx, c, 2, s, p0, n, dec, rows, NULL, lg);
                    const long failed = test_oom_disarm();
                    if (failed == 0) { /* the step made fewer than k allocations */
                        ASSERT_OK(st);
                    } else {
                        if (st != KVC_ERR_NOMEM)
                            TEST_FAIL_("%s cache, %d threads, %s context: allocation %ld "
                                       "failed, the step returned %s",
                                       kvc_dtype_name(dts[d]), (int)threads, w ? "warm" : "new",
                                       k, kvc_status_str(st));
                        ASSERT_TRUE(kvc_last_error()[0] != '\0');
                        cache_storage(c, in.n_layer, after);
                        if (memcmp(before, after, bytes) != 0)
                            TEST_FAIL_("%s cache, %d threads, %s context: allocation %ld "
                                       "failed and the cache changed",
                                       kvc_dtype_name(dts[d]), (int)threads, w ? "warm" : "new",
                                       k);
                        ASSERT_OK(kvc_cache_check(c));
                        ASSERT_OK(kvc_model_forward(ctx, c, 2, s, p0, n, dec, rows, NULL, lg));
                        points++;
                    }
                    ASSERT_MEM_EQ(lg, ref, lbytes);
                    kvc_cache_destroy(c);
                    if (!w) kvc_model_ctx_destroy(ctx);
                    if (failed == 0) break;
                    ASSERT_TRUE(k < 1000);
                }
            }
            free(before);
            free(after);
            kvc_model_ctx_destroy(warm);
        }
    }
    ASSERT_TRUE(points >= 40);
    free(ref);
    free(lg);
    kvc_model_destroy(m);
    return 0;
}

/* Runs e to the end, appending request r's tokens (ids[r]) to got[r]. */
static int finish_engine(kvc_engine *e, const int64_t *ids, int n_req, int32_t got[][16],
                         int *n_got) {
    kvc_engine_event ev[4];
    int64_t ne;
    for (int guard = 0; kvc_engine_pending(e) > 0; guard++) {
        if (guard > 100 || kvc_engine_step(e, ev, 4, &ne) != KVC_OK) return 1;
        for (int64_t i = 0; i < ne; i++)
            for (int r = 0; r < n_req; r++)
                if (ev[i].request_id == ids[r] && n_got[r] < 16) got[r][n_got[r]++] = ev[i].token;
    }
    return 0;
}

/* Engine steps that run out of memory commit nothing: each allocation of
 * each step of a run (chunked prompts, decode rows, a prefix hit, a sampled
 * request) failed in turn gives KVC_ERR_NOMEM and no event, leaves the cache
 * consistent and every request pending, and the run then ends with the
 * tokens of a run without failures. */
TEST(tiny_engine_out_of_memory_changes_nothing) {
    if (!test_oom_available()) SKIP("allocation failures need the linker's --wrap");
    NEED_TINY(m);
    kvc_engine_params ep = kvc_engine_default_params();
    ep.page_size = 4;
    ep.kv_capacity_tokens = 64;
    ep.max_step_tokens = 6;
    enum { R = 3 };
    static const int32_t prompts[R][9] = {{5, 9, 2, 7, 1, 3, 8, 4, 6}, {11, 12, 13, 14, 15},
                                          {5, 9, 2, 7, 1, 3, 8, 4, 6}};
    const int lens[R] = {9, 5, 9}, max_new[R] = {3, 3, 2};
    kvc_sampling_params sp[R];
    for (int r = 0; r < R; r++) sp[r] = kvc_sampling_default_params();
    sp[1].temperature = 0.8f;
    sp[1].seed = 7;
    int64_t ids[R];
    int32_t want[R][16], got[R][16];
    int n_want[R] = {0}, n_got[R];
    kvc_engine *e;
    ASSERT_OK(kvc_engine_create(m, &ep, &e));
    for (int r = 0; r < R; r++)
        ASSERT_OK(kvc_engine_add_request(e, prompts[r], lens[r], max_new[r], &sp[r], 1, &ids[r]));
    ASSERT_TRUE(finish_engine(e, ids, R, want, n_want) == 0);
    kvc_engine_stats st;
    ASSERT_OK(kvc_engine_get_stats(e, &st));
    const int64_t steps = st.steps;
    ASSERT_TRUE(st.cached_tokens > 0);
    kvc_engine_destroy(e);
    int points = 0;
    for (int64_t k = 0; k < steps; k++) {
        for (long a = 1;; a++) {
            ASSERT_OK(kvc_engine_create(m, &ep, &e));
            for (int r = 0; r < R; r++) {
                ASSERT_OK(kvc_engine_add_request(e, prompts[r], lens[r], max_new[r], &sp[r], 1,
                                                 &ids[r]));
                n_got[r] = 0;
            }
            kvc_engine_event ev[4];
            int64_t ne;
            for (int64_t i = 0; i < k; i++) {
                ASSERT_OK(kvc_engine_step(e, ev, 4, &ne));
                for (int64_t j = 0; j < ne; j++)
                    for (int r = 0; r < R; r++)
                        if (ev[j].request_id == ids[r]) got[r][n_got[r]++] = ev[j].token;
            }
            const int64_t pending = kvc_engine_pending(e);
            ne = -1;
            test_oom_arm(a, 0);
            kvc_status s = kvc_engine_step(e, ev, 4, &ne);
            const long failed = test_oom_disarm();
            if (failed) {
                if (s != KVC_ERR_NOMEM)
                    TEST_FAIL_("step %lld, allocation %ld failed: %s", (long long)k, a,
                               kvc_status_str(s));
                ASSERT_EQ_I64(ne, 0);
                ASSERT_EQ_I64(kvc_engine_pending(e), pending);
                ASSERT_OK(kvc_cache_check(kvc_engine_cache(e)));
                points++;
            } else {
                ASSERT_OK(s);
                for (int64_t j = 0; j < ne; j++)
                    for (int r = 0; r < R; r++)
                        if (ev[j].request_id == ids[r]) got[r][n_got[r]++] = ev[j].token;
            }
            ASSERT_TRUE(finish_engine(e, ids, R, got, n_got) == 0);
            for (int r = 0; r < R; r++) {
                ASSERT_EQ_I64(n_got[r], n_want[r]);
                ASSERT_MEM_EQ(got[r], want[r], (size_t)n_want[r] * sizeof(int32_t));
            }
            kvc_cache_stats cs;
            ASSERT_OK(kvc_cache_get_stats(kvc_engine_cache(e), &cs));
            ASSERT_EQ_I64(cs.used_pages, 0);
            kvc_engine_destroy(e);
            if (!failed) break;
            ASSERT_TRUE(a < 1000);
        }
    }
    ASSERT_TRUE(points >= 20);
    kvc_model_destroy(m);
    return 0;
}

const test_case test_suite[] = {
    TEST_ENTRY(sample_greedy_and_ties),
    TEST_ENTRY(sample_distribution_top_k_top_p),
    TEST_ENTRY(sample_errors),
    TEST_ENTRY(load_errors),
    TEST_ENTRY(tiny_info_and_eval),
    TEST_ENTRY(tiny_eval_matches_numpy_reference),
    TEST_ENTRY(tiny_cache_equals_recompute),
    TEST_ENTRY(tiny_eval_in_256k_of_stack),
    TEST_ENTRY(tiny_engine_batched_equals_alone),
    TEST_ENTRY(tiny_engine_compressed_formats_batched_equals_alone),
    TEST_ENTRY(tiny_engine_preemption_inside_prompt_chunks),
    TEST_ENTRY(tiny_engine_failed_step_changes_nothing),
    TEST_ENTRY(tiny_engine_failed_step_counts_no_restored_tokens),
    TEST_ENTRY(tiny_engine_failed_forward_leaves_no_page_findable),
    TEST_ENTRY(tiny_engine_failed_step_rolls_back_running_requests),
    TEST_ENTRY(tiny_engine_errors_and_cancel),
    TEST_ENTRY(tiny_context_limit),
    TEST_ENTRY(tiny_forward_out_of_memory_writes_nothing),
    TEST_ENTRY(tiny_engine_out_of_memory_changes_nothing),
    {0, 0},
};
