/* Model loading in C, so the sanitizer builds run the error paths: the
 * messages for missing, mistyped and unknown keys, unused tensors and blocks
 * past block_count (on patched copies of the tiny llama, KVC_TINY_GGUF),
 * and the architecture variants written by tests/gen_tiny_gguf.py (a qwen2,
 * KVC_TINY_QWEN2_GGUF, and a llama with every bias, rope_freqs.weight and
 * linear rope scaling, KVC_TINY_LLAMA31_GGUF) through the forward pass and
 * the cache. Agreement with the numpy reference is tested in Python
 * (python/tests/test_model_variants.py). */
#define _POSIX_C_SOURCE 200809L /* mkstemp, fdopen */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test.h"

const char *test_suite_name = "model_load";

static unsigned char *read_all(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    unsigned char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long n = ftell(f);
        buf = n > 0 ? malloc((size_t)n) : NULL;
        if (buf && (fseek(f, 0, SEEK_SET) != 0 || fread(buf, 1, (size_t)n, f) != (size_t)n)) {
            free(buf);
            buf = NULL;
        }
        *size = (size_t)n;
    }
    fclose(f);
    return buf;
}

/* Loads a copy of the tiny llama with the first occurrence of the n bytes
 * `from` replaced by `to` and then, if val, val_len bytes written val_off
 * bytes past its end (after a key: 4 bytes of value type, then the value).
 * -1000 if the copy cannot be made. */
static kvc_status load_bytes_patched(const void *from, const void *to, size_t n, size_t val_off,
                                     const void *val, size_t val_len, kvc_model **m) {
    *m = NULL;
    size_t size = 0;
    unsigned char *buf = read_all(getenv("KVC_TINY_GGUF"), &size);
    if (!buf) return (kvc_status)-1000;
    size_t at = 0;
    while (at + n <= size && memcmp(buf + at, from, n) != 0) at++;
    kvc_status st = (kvc_status)-1000;
    if (at + n + val_off + val_len <= size) {
        memcpy(buf + at, to, n);
        if (val) memcpy(buf + at + n + val_off, val, val_len);
        char path[] = "/tmp/kvc_test_load_XXXXXX";
        int fd = mkstemp(path);
        FILE *o = fd >= 0 ? fdopen(fd, "wb") : NULL;
        if (o) {
            int ok = fwrite(buf, 1, size, o) == size;
            if (fclose(o) == 0 && ok) {
                kvc_model *bogus = (kvc_model *)(void *)1;
                *m = bogus;
                st = kvc_model_load(path, NULL, m);
            }
        }
        if (fd >= 0) remove(path);
    }
    free(buf);
    return st;
}

/* load_bytes_patched for a string and its replacement of the same length. */
static kvc_status load_patched(const char *from, const char *to, size_t val_off, const void *val,
                               size_t val_len, kvc_model **m) {
    if (strlen(to) != strlen(from)) return (kvc_status)-1000;
    return load_bytes_patched(from, to, strlen(from), val_off, val, val_len, m);
}

#define NEED_TINY()                                                                                \
    if (!getenv("KVC_TINY_GGUF")) SKIP("KVC_TINY_GGUF not set (ctest sets it)")

/* The message is exactly what the key's problem is: it used to be formatted
 * into the buffer it read (garbled, and an overlapping copy for valgrind). */
TEST(missing_and_mistyped_keys_are_named) {
    NEED_TINY();
    kvc_model *m;
    /* the key renamed into the ignored general.* namespace: missing */
    ASSERT_STATUS(load_patched("llama.block_count", "general.blk_count", 0, NULL, 0, &m),
                  KVC_ERR_CORRUPT);
    ASSERT_TRUE(m == NULL);
    ASSERT_TRUE(strcmp(kvc_last_error(),
                       "model: required metadata key llama.block_count is missing") == 0);
    /* uint32 -> float32 (type 6): the value stays 4 bytes */
    const uint32_t f32 = 6;
    ASSERT_STATUS(load_patched("llama.context_length", "llama.context_length", 0, &f32, 4, &m),
                  KVC_ERR_CORRUPT);
    ASSERT_TRUE(m == NULL);
    ASSERT_TRUE(strcmp(kvc_last_error(), "model: metadata key llama.context_length has type "
                                         "float32, expected an integer") == 0);
    const uint32_t i32 = 5; /* int32: still an integer, accepted */
    ASSERT_OK(load_patched("llama.context_length", "llama.context_length", 0, &i32, 4, &m));
    kvc_model_destroy(m);
    return 0;
}

TEST(unknown_keys_and_tensors_are_refused) {
    NEED_TINY();
    kvc_model *m;
    ASSERT_STATUS(load_patched("llama.vocab_size", "llama.vocab_sizz", 0, NULL, 0, &m),
                  KVC_ERR_UNSUPPORTED);
    ASSERT_TRUE(m == NULL);
    ASSERT_STR_CONTAINS(kvc_last_error(), "metadata key llama.vocab_sizz is not supported");
    ASSERT_STATUS(load_patched("llama.vocab_size", "xlama.vocab_size", 0, NULL, 0, &m),
                  KVC_ERR_UNSUPPORTED);
    ASSERT_STR_CONTAINS(kvc_last_error(), "metadata key xlama.vocab_size is not understood");
    /* the tiny llama's output matrix renamed: the head falls back to the
     * tied embedding and the renamed tensor would be ignored */
    static const char out[] = "\x0d\0\0\0\0\0\0\0output.weight"; /* not attn_output */
    static const char outx[] = "\x0d\0\0\0\0\0\0\0outpux.weight";
    ASSERT_STATUS(load_bytes_patched(out, outx, sizeof out - 1, 0, NULL, 0, &m),
                  KVC_ERR_UNSUPPORTED);
    ASSERT_TRUE(m == NULL);
    ASSERT_STR_CONTAINS(kvc_last_error(),
                        "tensor outpux.weight is not used by the llama architecture");
    /* block_count 2 -> 1: block 1's tensors would be ignored */
    const uint32_t one = 1;
    ASSERT_STATUS(load_patched("llama.block_count", "llama.block_count", 4, &one, 4, &m),
                  KVC_ERR_CORRUPT);
    ASSERT_TRUE(m == NULL);
    ASSERT_STR_CONTAINS(kvc_last_error(), "tensor blk.1.");
    ASSERT_STR_CONTAINS(kvc_last_error(), "is in block 1 but llama.block_count is 1");
    return 0;
}

/* Eval with 1 and 2 threads (same bits), then greedy decoding through the
 * cache equals recomputing the sequence with the same prefill/decode split
 * (seed 001: the biases, NEOX rope and scaled frequencies are per row). */
static int run_variant(kvc_model *m) {
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    const int64_t V = in.n_vocab, P = 7, G = 9;
    int32_t seq[16] = {5, 9, 2, 7, 1, 3, 8};
    float *lg = malloc(sizeof(float) * (size_t)V), *all = malloc(sizeof(float) * 16 * (size_t)V);
    float *all2 = malloc(sizeof(float) * 16 * (size_t)V);
    ASSERT_TRUE(lg && all && all2);
    ASSERT_OK(kvc_model_eval(m, seq, P, -1, KVC_F32, all, 1));
    ASSERT_OK(kvc_model_eval(m, seq, P, -1, KVC_F32, all2, 2));
    ASSERT_MEM_EQ(all, all2, sizeof(float) * (size_t)(P * V));
    /* pages as kvc_model_eval's: attention sums page by page */
    kvc_cache_params cp = kvc_model_cache_params(m, KVC_F32, P + G);
    kvc_cache *cache;
    ASSERT_OK(kvc_cache_create(&cp, &cache));
    kvc_model_ctx *ctx;
    ASSERT_OK(kvc_model_ctx_create(m, 2, &ctx));
    kvc_seq_id s;
    ASSERT_OK(kvc_cache_add_sequence(cache, NULL, P, 0, &s, NULL));
    int64_t pos0 = 0, n = P, dec = P;
    ASSERT_OK(kvc_model_forward(ctx, cache, 1, &s, &pos0, &n, &dec, seq, NULL, lg));
    for (int64_t t = P; t < P + G; t++) {
        for (int64_t i = 0; i < V; i++) ASSERT_TRUE(isfinite(lg[i]));
        ASSERT_OK(kvc_sample(lg, (int32_t)V, NULL, NULL, &seq[t]));
        ASSERT_OK(kvc_model_eval(m, seq, t, P, KVC_F32, all, 1));
        ASSERT_MEM_EQ(lg, all + (t - 1) * V, sizeof(float) * (size_t)V);
        if (t + 1 == P + G) break;
        ASSERT_OK(kvc_cache_append(cache, s, NULL, 1, NULL));
        pos0 = t;
        n = 1;
        ASSERT_OK(kvc_model_forward(ctx, cache, 1, &s, &pos0, &n, &dec, seq + t, NULL, lg));
    }
    ASSERT_OK(kvc_cache_check(cache));
    free(lg);
    free(all);
    free(all2);
    kvc_model_ctx_destroy(ctx);
    kvc_cache_destroy(cache);
    return 0;
}

static kvc_model *load_env(const char *var) {
    const char *path = getenv(var);
    kvc_model *m = NULL;
    if (path && kvc_model_load(path, NULL, &m) != KVC_OK) {
        fprintf(stderr, "  cannot load %s: %s\n", path, kvc_last_error());
        m = NULL;
    }
    return m;
}

TEST(qwen2_runs_through_the_cache) {
    if (!getenv("KVC_TINY_QWEN2_GGUF")) SKIP("KVC_TINY_QWEN2_GGUF not set (ctest sets it)");
    kvc_model *m = load_env("KVC_TINY_QWEN2_GGUF");
    ASSERT_TRUE(m != NULL);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    ASSERT_TRUE(strcmp(in.arch, "qwen2") == 0);
    ASSERT_EQ_I64(in.rope_neox, 1);
    ASSERT_EQ_I64(in.biases, KVC_MODEL_BIAS_Q | KVC_MODEL_BIAS_K | KVC_MODEL_BIAS_V);
    ASSERT_EQ_I64(in.rope_freq_factors, 0);
    ASSERT_TRUE(in.rope_scale == 1.0f && in.tied_output == 1);
    int r = run_variant(m);
    kvc_model_destroy(m);
    return r;
}

TEST(llama31_runs_through_the_cache) {
    if (!getenv("KVC_TINY_LLAMA31_GGUF")) SKIP("KVC_TINY_LLAMA31_GGUF not set (ctest sets it)");
    kvc_model *m = load_env("KVC_TINY_LLAMA31_GGUF");
    ASSERT_TRUE(m != NULL);
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m, &in));
    ASSERT_TRUE(strcmp(in.arch, "llama") == 0);
    ASSERT_EQ_I64(in.rope_neox, 0);
    ASSERT_EQ_I64(in.biases, 127);
    ASSERT_EQ_I64(in.rope_freq_factors, 1);
    ASSERT_TRUE(in.rope_scale == 2.0f);
    int r = run_variant(m);
    kvc_model_destroy(m);
    return r;
}

typedef struct progress_log {
    int n, monotonic;
    float last;
} progress_log;

static void on_progress(float f, void *user) {
    progress_log *g = user;
    g->monotonic &= f >= g->last && f <= 1.0f;
    g->last = f;
    g->n++;
}

/* use_mmap 0 (--no-mmap): the file read into memory gives the same model,
 * logits bit for bit, with progress from 0 to 1 as when mapped; anything
 * but 0 or 1 is refused. */
TEST(read_into_memory_equals_mapped) {
    const char *path = getenv("KVC_TINY_LLAMA31_GGUF");
    if (!path) SKIP("KVC_TINY_LLAMA31_GGUF not set (ctest sets it)");
    kvc_model_params p = kvc_model_default_params();
    ASSERT_EQ_I64(p.use_mmap, 1);
    kvc_model *m[2] = {NULL, NULL};
    progress_log pl[2] = {{0, 1, 0.0f}, {0, 1, 0.0f}};
    p.progress = on_progress;
    p.progress_user = &pl[0];
    ASSERT_OK(kvc_model_load(path, &p, &m[0]));
    p.use_mmap = 0;
    p.progress_user = &pl[1];
    ASSERT_OK(kvc_model_load(path, &p, &m[1]));
    for (int k = 0; k < 2; k++) {
        ASSERT_TRUE(pl[k].n >= 3 && pl[k].monotonic);
        ASSERT_TRUE(pl[k].last == 1.0f);
    }
    kvc_model_info in;
    ASSERT_OK(kvc_model_get_info(m[0], &in));
    const int64_t T = 21, V = in.n_vocab;
    int32_t tok[21];
    for (int64_t t = 0; t < T; t++) tok[t] = (int32_t)((t * 37 + 5) % V);
    float *lg[2];
    for (int k = 0; k < 2; k++) {
        lg[k] = malloc(sizeof(float) * (size_t)(T * V));
        ASSERT_OK(kvc_model_eval(m[k], tok, T, 10, KVC_F16, lg[k], 2));
    }
    ASSERT_MEM_EQ(lg[0], lg[1], sizeof(float) * (size_t)(T * V));
    free(lg[0]), free(lg[1]);
    kvc_model_destroy(m[0]);
    kvc_model_destroy(m[1]);
    kvc_model *bad = NULL;
    p.use_mmap = 2;
    ASSERT_STATUS(kvc_model_load(path, &p, &bad), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "use_mmap");
    ASSERT_TRUE(bad == NULL);
    p.use_mmap = 0;
    ASSERT_STATUS(kvc_model_load("/nonexistent/model.gguf", &p, &bad), KVC_ERR_IO);
    ASSERT_STR_CONTAINS(kvc_last_error(), "cannot open");
    return 0;
}

const test_case test_suite[] = {
    TEST_ENTRY(missing_and_mistyped_keys_are_named),
    TEST_ENTRY(read_into_memory_equals_mapped),
    TEST_ENTRY(unknown_keys_and_tensors_are_refused),
    TEST_ENTRY(qwen2_runs_through_the_cache),
    TEST_ENTRY(llama31_runs_through_the_cache),
    {0, 0},
};
