/* Runner shared by every C suite: filters, seeds, counts. */
#include <pthread.h>
#include <stdlib.h>

#include "test.h"

uint64_t test_seed = 20261122;

static kvc_threadpool *pools[5];

kvc_threadpool *test_pool(int n_threads) {
    if (n_threads < 1 || n_threads > 4) return NULL;
    if (!pools[n_threads] && kvc_threadpool_create(n_threads, &pools[n_threads]) != KVC_OK)
        return NULL;
    return pools[n_threads];
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SMALL_STACK_KIB 2048
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define SMALL_STACK_KIB 2048
#endif
#endif
#ifndef SMALL_STACK_KIB
#define SMALL_STACK_KIB 256
#endif

int test_on_small_stack(void *(*fn)(void *), void *arg) {
    pthread_attr_t attr;
    pthread_t th;
    if (pthread_attr_init(&attr) != 0) return -1;
    int rc = pthread_attr_setstacksize(&attr, (size_t)SMALL_STACK_KIB << 10) == 0 &&
                     pthread_create(&th, &attr, fn, arg) == 0
                 ? 0
                 : -1;
    pthread_attr_destroy(&attr);
    if (rc == 0) pthread_join(th, NULL);
    return rc;
}

int main(int argc, char **argv) {
    const char *filter = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--filter") && i + 1 < argc) filter = argv[++i];
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            test_seed = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: %s [--filter SUBSTR] [--seed N]\n", argv[0]);
            return 2;
        }
    }
    int passed = 0, failed = 0, skipped = 0;
    for (const test_case *t = test_suite; t->name; t++) {
        if (filter && !strstr(t->name, filter)) continue;
        kvc_clear_error();
        int r = t->fn();
        printf("%s %s.%s\n", r == 0 ? "ok  " : r == 2 ? "skip" : "FAIL", test_suite_name, t->name);
        fflush(stdout);
        if (r == 0) passed++;
        else if (r == 2) skipped++;
        else {
            failed++;
            fprintf(stderr, "  (seed %llu)\n", (unsigned long long)test_seed);
        }
    }
    for (int i = 0; i < 5; i++) kvc_threadpool_destroy(pools[i]);
    printf("%s: %d passed, %d failed, %d skipped\n", test_suite_name, passed, failed, skipped);
    return failed ? 1 : 0;
}
