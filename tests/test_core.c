/* Core API: status strings, error messages, versions, dtypes, tensors, ISA
 * selection and the thread pool. */
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "test.h"
#include "../src/core/internal.h"

static void *fail_in_thread(void *arg) {
    float x = 0;
    *(int *)arg = kvc_convert(&x, KVC_I64, &x, KVC_F32, 1) == KVC_ERR_INVALID_ARG &&
                  strstr(kvc_last_error(), "int64") != NULL;
    return NULL;
}

TEST(status_strings) {
    const kvc_status all[] = {KVC_OK, KVC_ERR_NOMEM, KVC_ERR_INVALID_ARG, KVC_ERR_NO_SPACE,
                              KVC_ERR_NOT_FOUND, KVC_ERR_UNSUPPORTED, KVC_ERR_IO,
                              KVC_ERR_CORRUPT, KVC_ERR_INTERNAL};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        ASSERT_TRUE(kvc_status_str(all[i]) != NULL);
        for (size_t j = 0; j < i; j++) ASSERT_TRUE(strcmp(kvc_status_str(all[i]), kvc_status_str(all[j])));
        if (i) ASSERT_TRUE(all[i] < 0);
    }
    ASSERT_STR_CONTAINS(kvc_status_str((kvc_status)-999), "unknown");
    return 0;
}

TEST(version) {
    ASSERT_EQ_I64(kvc_version_number(), KVC_VERSION_NUMBER);
    ASSERT_TRUE(strcmp(kvc_version_string(), KVC_VERSION_STRING) == 0);
    char buf[32];
    snprintf(buf, sizeof buf, "%d.%d.%d", KVC_VERSION_MAJOR, KVC_VERSION_MINOR, KVC_VERSION_PATCH);
    ASSERT_TRUE(strcmp(buf, kvc_version_string()) == 0);
    return 0;
}

TEST(dtypes) {
    ASSERT_TRUE(strcmp(kvc_dtype_name(KVC_BF16), "bfloat16") == 0);
    ASSERT_TRUE(strcmp(kvc_dtype_name(KVC_I4), "int4") == 0);
    ASSERT_TRUE(strcmp(kvc_dtype_name((kvc_dtype)99), "?") == 0);
    ASSERT_EQ_I64(kvc_dtype_bits(KVC_F32), 32);
    ASSERT_EQ_I64(kvc_dtype_bits(KVC_F16), 16);
    ASSERT_EQ_I64(kvc_dtype_bits(KVC_I4), 4);
    ASSERT_EQ_I64(kvc_dtype_bits(KVC_I64), 64);
    ASSERT_EQ_I64(kvc_dtype_bits((kvc_dtype)-1), 0);
    return 0;
}

TEST(tensor_make) {
    int64_t shape[3] = {2, 3, 4};
    kvc_tensor t = kvc_tensor_make(NULL, KVC_F16, 3, shape);
    ASSERT_EQ_I64(t.ndim, 3);
    ASSERT_EQ_I64(t.stride[0], 12);
    ASSERT_EQ_I64(t.stride[1], 4);
    ASSERT_EQ_I64(t.stride[2], 1);
    ASSERT_EQ_I64(kvc_tensor_numel(&t), 24);
    kvc_tensor s = kvc_tensor_make(NULL, KVC_I64, 0, NULL);
    ASSERT_EQ_I64(kvc_tensor_numel(&s), 1);
    /* an invalid ndim or a NULL shape is kept invalid (every operator rejects
     * it), numel reports -1 for what it cannot count */
    ASSERT_EQ_I64(kvc_tensor_make(NULL, KVC_F32, 9, shape).ndim, -1);
    ASSERT_EQ_I64(kvc_tensor_make(NULL, KVC_F32, -3, shape).ndim, -1);
    ASSERT_EQ_I64(kvc_tensor_make(NULL, KVC_F32, 2, NULL).ndim, -1);
    ASSERT_EQ_I64(kvc_tensor_numel(NULL), -1);
    int64_t huge[3] = {(int64_t)1 << 62, 4, 4};
    kvc_tensor h = kvc_tensor_make(NULL, KVC_F32, 3, huge);
    ASSERT_EQ_I64(kvc_tensor_numel(&h), -1);
    /* a product that wraps to 0 must not pass as empty: the NULL data is
     * never read (this crashed in kvc_merge_state) */
    int64_t hs[2] = {(int64_t)1 << 62, 4};
    kvc_tensor v = kvc_tensor_make(NULL, KVC_F32, 3, huge),
               ls = kvc_tensor_make(NULL, KVC_F32, 2, hs);
    ASSERT_STATUS(kvc_merge_state(&v, &ls, &v, &ls, &v, &ls), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "overflows");
    kvc_tensor bad = kvc_tensor_make(NULL, KVC_F32, 9, shape);
    ASSERT_STATUS(kvc_merge_state(&bad, &ls, &bad, &ls, &bad, &ls), KVC_ERR_INVALID_ARG);
    return 0;
}

TEST(errors_are_per_thread_messages) {
    kvc_clear_error();
    ASSERT_TRUE(kvc_last_error()[0] == '\0');
    float x[4] = {0};
    ASSERT_STATUS(kvc_convert(x, KVC_F32, x, KVC_I8, 4), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "kvc_convert");
    ASSERT_STR_CONTAINS(kvc_last_error(), "int8");
    /* Another thread's failure does not touch this thread's message. */
    pthread_t th;
    int other_ok = 0;
    ASSERT_TRUE(pthread_create(&th, NULL, fail_in_thread, &other_ok) == 0);
    pthread_join(th, NULL);
    ASSERT_TRUE(other_ok);
    ASSERT_STR_CONTAINS(kvc_last_error(), "int8");
    kvc_clear_error();
    ASSERT_TRUE(kvc_last_error()[0] == '\0');
    return 0;
}

TEST(isa_selection) {
    kvc_isa best = kvc_best_isa();
    ASSERT_TRUE(kvc_isa_supported(KVC_ISA_SCALAR));
    ASSERT_TRUE(kvc_isa_supported(best));
    ASSERT_TRUE(kvc_get_isa() <= best);
    printf("  best isa: %s, in use: %s\n", kvc_isa_name(best), kvc_isa_name(kvc_get_isa()));
    for (int i = 0; i < KVC_ISA_COUNT; i++) {
        if (kvc_isa_supported((kvc_isa)i)) {
            ASSERT_OK(kvc_set_isa((kvc_isa)i));
            ASSERT_EQ_I64(kvc_get_isa(), i);
        } else {
            ASSERT_STATUS(kvc_set_isa((kvc_isa)i), KVC_ERR_UNSUPPORTED);
            ASSERT_EQ_I64(kvc_get_isa(), i - 1); /* unchanged */
        }
    }
    ASSERT_STATUS(kvc_set_isa((kvc_isa)7), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(strcmp(kvc_isa_name(KVC_ISA_AVX512), "avx512") == 0);
    ASSERT_OK(kvc_set_isa(best));
    return 0;
}

TEST(threadpool) {
    kvc_threadpool *p = NULL;
    ASSERT_STATUS(kvc_threadpool_create(1, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_threadpool_create(100000, &p), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(p == NULL);
    for (int n = 1; n <= 4; n++) {
        ASSERT_OK(kvc_threadpool_create(n, &p));
        ASSERT_EQ_I64(kvc_threadpool_n_threads(p), n);
        kvc_threadpool_destroy(p);
    }
    ASSERT_OK(kvc_threadpool_create(0, &p)); /* all CPUs */
    ASSERT_TRUE(kvc_threadpool_n_threads(p) >= 1);
    kvc_threadpool_destroy(p);
    kvc_threadpool_destroy(NULL);
    ASSERT_EQ_I64(kvc_threadpool_n_threads(NULL), 1);
    return 0;
}

/* Each task index of each loop runs exactly once, whatever the pool size
 * (oversubscribed pools included), and every task has finished when
 * kvc__parallel_for returns: the caller reads all counters right away. */
typedef struct {
    _Atomic int *hits;
    int64_t n;
    int sleep_every; /* > 0: every sleep_every-th task sleeps 50 us */
} count_job;

static void count_task(void *ctx, int64_t t) {
    count_job *j = ctx;
    if (t < 0 || t >= j->n) {
        atomic_fetch_add(&j->hits[j->n], 1); /* out-of-range slot */
        return;
    }
    if (j->sleep_every > 0 && t % j->sleep_every == 0) {
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
    }
    atomic_fetch_add(&j->hits[t], 1);
}

TEST(threadpool_runs_each_task_once) {
    const int sizes[] = {2, 3, 8, 33};
    const int64_t counts[] = {1, 2, 3, 7, 64, 1000};
    _Atomic int *hits = calloc(1001, sizeof *hits);
    ASSERT_TRUE(hits != NULL);
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        kvc_threadpool *p = NULL;
        ASSERT_OK(kvc_threadpool_create(sizes[si], &p));
        for (int rep = 0; rep < 200; rep++) {
            const int64_t n = counts[rep % 6];
            count_job j = {hits, n, rep % 3 == 0 ? 5 : 0};
            for (int64_t t = 0; t <= n; t++) atomic_store(&hits[t], 0);
            kvc__parallel_for(p, n, count_task, &j);
            for (int64_t t = 0; t < n; t++) {
                if (atomic_load(&hits[t]) != 1) {
                    fprintf(stderr, "pool %d, loop %d: task %lld ran %d times\n", sizes[si], rep,
                            (long long)t, atomic_load(&hits[t]));
                    free(hits);
                    kvc_threadpool_destroy(p);
                    return 1;
                }
            }
            ASSERT_EQ_I64(atomic_load(&hits[n]), 0);
        }
        kvc_threadpool_destroy(p);
    }
    free(hits);
    return 0;
}

/* kvc_cpu_count and the default pool size follow the affinity mask; a pool
 * of 8 threads confined to one CPU completes 2000 loops, the caller running
 * tasks itself (that nobody waits for descheduled workers is measured by
 * bench-serve, docs/BENCHMARKS.md, not asserted here). */
typedef struct {
    _Atomic int *by_caller;
    pthread_t caller;
} who_job;

static void who_task(void *ctx, int64_t t) {
    who_job *j = ctx;
    (void)t;
    if (pthread_equal(pthread_self(), j->caller)) atomic_fetch_add(j->by_caller, 1);
}

TEST(threadpool_cpu_count_follows_affinity) {
    cpu_set_t saved, one;
    ASSERT_TRUE(sched_getaffinity(0, sizeof saved, &saved) == 0);
    ASSERT_EQ_I64(kvc_cpu_count(), CPU_COUNT(&saved));
    int first = -1;
    for (int c = 0; c < CPU_SETSIZE && first < 0; c++)
        if (CPU_ISSET(c, &saved)) first = c;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    ASSERT_TRUE(sched_setaffinity(0, sizeof one, &one) == 0);
    const int n_one = kvc_cpu_count();
    kvc_threadpool *p = NULL;
    const kvc_status st = kvc_threadpool_create(0, &p);
    const int n_pool = st == KVC_OK ? kvc_threadpool_n_threads(p) : -1;
    kvc_threadpool_destroy(p);
    p = NULL;
    /* 8 threads on one CPU: every loop still completes, each task once */
    _Atomic int by_caller = 0;
    who_job j = {&by_caller, pthread_self()};
    int ok8 = kvc_threadpool_create(8, &p) == KVC_OK; /* workers inherit the one CPU */
    for (int rep = 0; ok8 && rep < 2000; rep++) kvc__parallel_for(p, 4, who_task, &j);
    kvc_threadpool_destroy(p);
    ASSERT_TRUE(sched_setaffinity(0, sizeof saved, &saved) == 0);
    ASSERT_EQ_I64(n_one, 1);
    ASSERT_EQ_I64(n_pool, 1);
    ASSERT_TRUE(ok8);
    ASSERT_TRUE(atomic_load(&by_caller) > 0);
    return 0;
}

/* Every creator sets *out to NULL when it fails (core.h), whatever *out held. */
TEST(creators_leave_out_null_on_failure) {
    static char sentinel;
    void *const bad = &sentinel;
    int32_t one[1] = {0};
    int64_t shape[1] = {1};
    kvc_tensor t = kvc_tensor_make(one, KVC_I32, 1, shape); /* B + 1 = 1 entries: B = 0 */
    kvc_threadpool *pool = bad;
    ASSERT_STATUS(kvc_threadpool_create(5000, &pool), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(pool == NULL);
    kvc_decode_plan *dp = bad;
    ASSERT_TRUE(kvc_decode_plan_create(&t, &t, &t, 4, 3, 64, 16, 1, &dp) < 0); /* 4 % 3 heads */
    ASSERT_TRUE(dp == NULL);
    kvc_prefill_plan *pp = bad;
    ASSERT_TRUE(kvc_prefill_plan_create_ragged(&t, &t, 4, 3, 64, 0, NULL, NULL, 1, &pp) < 0);
    ASSERT_TRUE(pp == NULL);
    pp = bad;
    ASSERT_TRUE(kvc_prefill_plan_create_paged(&t, &t, &t, &t, 4, 3, 64, 16, 0, NULL, NULL, 1,
                                              &pp) < 0);
    ASSERT_TRUE(pp == NULL);
    kvc_cascade_plan *cp = bad;
    ASSERT_TRUE(kvc_cascade_plan_create(0, &t, &t, &t, &t, 4, 4, 64, 16, 0, 1, &cp) < 0);
    ASSERT_TRUE(cp == NULL);
    kvc_mla_plan *mp = bad;
    ASSERT_TRUE(kvc_mla_plan_create(&t, &t, &t, &t, 0, 512, 64, 16, 0, 0.f, 0.f, &mp) < 0);
    ASSERT_TRUE(mp == NULL);
    kvc_cache_params cparams = kvc_cache_default_params();
    cparams.num_layers = 0;
    kvc_cache *cache = bad;
    ASSERT_STATUS(kvc_cache_create(&cparams, &cache), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(cache == NULL);
    kvc_model *model = bad;
    ASSERT_TRUE(kvc_model_load("/nonexistent/kvcache-test.gguf", NULL, &model) < 0);
    ASSERT_TRUE(model == NULL);
    kvc_gguf *g = bad;
    ASSERT_TRUE(kvc_gguf_open("/nonexistent/kvcache-test.gguf", &g) < 0);
    ASSERT_TRUE(g == NULL);
    g = bad;
    ASSERT_TRUE(kvc_gguf_open_read("/nonexistent/kvcache-test.gguf", &g) < 0);
    ASSERT_TRUE(g == NULL);
    g = bad;
    ASSERT_TRUE(kvc_gguf_open_memory("GGUX", 4, &g) < 0);
    ASSERT_TRUE(g == NULL);
    kvc_model_ctx *ctx = bad;
    ASSERT_STATUS(kvc_model_ctx_create(NULL, 1, &ctx), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(ctx == NULL);
    kvc_engine *engine = bad;
    ASSERT_STATUS(kvc_engine_create(NULL, NULL, &engine), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(engine == NULL);
    cache = bad;
    ASSERT_STATUS(kvc_cache_create(NULL, &cache), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(cache == NULL);
    kvc_tokenizer_vocab vocab = {0};
    kvc_tokenizer *tok = bad;
    ASSERT_STATUS(kvc_tokenizer_create(&vocab, &tok), KVC_ERR_INVALID_ARG); /* n_vocab 0 */
    ASSERT_TRUE(tok == NULL);
    tok = bad;
    ASSERT_STATUS(kvc_tokenizer_from_gguf(NULL, &tok), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(tok == NULL);
    return 0;
}

const char *test_suite_name = "core";
const test_case test_suite[] = {
    TEST_ENTRY(status_strings), TEST_ENTRY(version), TEST_ENTRY(dtypes),
    TEST_ENTRY(tensor_make), TEST_ENTRY(errors_are_per_thread_messages),
    TEST_ENTRY(isa_selection), TEST_ENTRY(threadpool),
    TEST_ENTRY(threadpool_runs_each_task_once), TEST_ENTRY(threadpool_cpu_count_follows_affinity),
    TEST_ENTRY(creators_leave_out_null_on_failure), {0, 0},
};
