/* Link-time allocation wrappers (test_oom.h). Built with KVC_TEST_OOM where
 * the linker takes --wrap (GNU ld, gold, lld); elsewhere the stubs say
 * "unavailable". The library is linked statically into the suites, so its
 * calls go through the __wrap_ functions; __real_ ones reach the C library
 * (or a sanitizer's interceptors). */
#include <errno.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>

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

#else

int test_oom_available(void) { return 0; }

#endif
