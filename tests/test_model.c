/* Model runtime, the parts testable without a model file: sampling, and
 * loading errors. The forward pass and the engine are tested in Python
 * (python/tests/test_model.py) on tiny GGUF files written by the project's
 * writer and on the default model, against an independent numpy llama. */
#define _POSIX_C_SOURCE 200809L /* mkstemp, fdopen */
#include <stdio.h>
#include <stdlib.h>

#include "test.h"

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
    kvc_model_free(NULL);
    kvc_engine_destroy(NULL);
    kvc_model_ctx_free(NULL);
    ASSERT_STATUS(kvc_engine_create(NULL, NULL, NULL), KVC_ERR_INVALID_ARG);
    return 0;
}

const test_case test_suite[] = {
    TEST_ENTRY(sample_greedy_and_ties),
    TEST_ENTRY(sample_distribution_top_k_top_p),
    TEST_ENTRY(sample_errors),
    TEST_ENTRY(load_errors),
    {0, 0},
};
