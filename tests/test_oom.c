/* Link-time allocation wrappers (test_oom.h). Built with KVC_TEST_OOM where
 * the linker takes --wrap (GNU ld, gold, lld); elsewhere the stubs say
 * "unavailable". The library is linked statically into the suites, so its
 * calls go through the __wrap_ functions; __real_ ones reach the C library
 * (or a sanitizer's interceptors). */
#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_oom.h"

static atomic_long calls, fail_at, failed;
static atomic_int armed, sticky_mode;

void test_oom_arm(long n, int sticky) {
    atomic_store(&calls, 0);
    atomic_store(&failed, 0);
    atomic_store(&fail_at, n);
    atomic_store(&sticky_mode, sticky);
    atomic_store(&armed, 1);
}

long test_oom_disarm(void) {
    atomic_store(&armed, 0);
    return atomic_load(&failed);
}

/* test_fail_unlink's state: a suffix is set and read by the test's thread
 * between the library's calls (the store's writer may unlink meanwhile:
 * the pointer is atomic, the string outlives the arming). */
static char unlink_suffix[256];
static atomic_int unlink_on, unlink_err;
static atomic_long unlink_failed;

void test_fail_unlink(const char *suffix, int err) {
    atomic_store(&unlink_on, 0);
    atomic_store(&unlink_failed, 0);
    if (!suffix) return;
    snprintf(unlink_suffix, sizeof unlink_suffix, "%s", suffix);
    atomic_store(&unlink_err, err);
    atomic_store(&unlink_on, 1);
}

long test_fail_unlink_count(void) { return atomic_load(&unlink_failed); }

#ifdef KVC_TEST_OOM

int test_oom_available(void) { return 1; }

/* 1 if this allocation is to fail (counted across threads). */
static int fail_now(void) {
    if (!atomic_load(&armed)) return 0;
    const long k = atomic_fetch_add(&calls, 1) + 1, n = atomic_load(&fail_at);
    if (k != n && !(atomic_load(&sticky_mode) && k > n)) return 0;
    atomic_fetch_add(&failed, 1);
    return 1;
}

void *__real_malloc(size_t n);
void *__real_calloc(size_t count, size_t size);
void *__real_realloc(void *p, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);
int __real_posix_memalign(void **p, size_t align, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t count, size_t size);
void *__wrap_realloc(void *p, size_t n);
void *__wrap_aligned_alloc(size_t align, size_t n);
int __wrap_posix_memalign(void **p, size_t align, size_t n);

void *__wrap_malloc(size_t n) { return fail_now() ? NULL : __real_malloc(n); }
void *__wrap_calloc(size_t count, size_t size) {
    return fail_now() ? NULL : __real_calloc(count, size);
}
void *__wrap_realloc(void *p, size_t n) { return fail_now() ? NULL : __real_realloc(p, n); }
void *__wrap_aligned_alloc(size_t align, size_t n) {
    return fail_now() ? NULL : __real_aligned_alloc(align, n);
}
int __wrap_posix_memalign(void **p, size_t align, size_t n) {
    return fail_now() ? ENOMEM : __real_posix_memalign(p, align, n);
}

int __real_unlink(const char *path);
int __wrap_unlink(const char *path);
int __wrap_unlink(const char *path) {
    if (atomic_load(&unlink_on)) {
        const size_t n = strlen(path), k = strlen(unlink_suffix);
        if (n >= k && !strcmp(path + n - k, unlink_suffix)) {
            atomic_fetch_add(&unlink_failed, 1);
            errno = atomic_load(&unlink_err);
            return -1;
        }
    }
    return __real_unlink(path);
}

#else

int test_oom_available(void) { return 0; }

#endif
