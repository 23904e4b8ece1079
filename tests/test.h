/*
 * Minimal in-tree test harness. A suite file defines tests with TEST(name)
 * and lists them in a TEST_LIST; test_main.c runs them, with --filter SUBSTR
 * and --seed N, and prints "N passed, N failed, N skipped" last.
 * Asserts print the expression, both values and the file:line, then fail
 * the current test (return 1). SKIP(reason) returns 2; an ISA the library
 * does not run here is a skipped path of a test that otherwise runs
 * (test_isa_usable). test_main.c lists every skip with its reason at the end
 * and fails the suite on one that tests/expected_skips.txt does not excuse
 * on this machine.
 */
#ifndef KVC_TEST_H
#define KVC_TEST_H

#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kvcache.h"

typedef int (*test_fn)(void);
typedef struct test_case {
    const char *name;
    test_fn fn;
} test_case;

/* Provided by each suite. */
extern const test_case test_suite[];
extern const char *test_suite_name;

/* Seed for randomized tests (--seed, default fixed). */
extern uint64_t test_seed;

#define TEST(name) static int test_##name(void)
#define TEST_ENTRY(name) {#name, test_##name}

#define TEST_FAIL_(...)                                                                            \
    do {                                                                                           \
        fprintf(stderr, "  %s:%d: ", __FILE__, __LINE__);                                          \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        return 1;                                                                                  \
    } while (0)

#define ASSERT_TRUE(c)                                                                             \
    do {                                                                                           \
        if (!(c)) TEST_FAIL_("assertion failed: %s", #c);                                          \
    } while (0)

#define ASSERT_EQ_I64(a, b)                                                                        \
    do {                                                                                           \
        long long a_ = (long long)(a), b_ = (long long)(b);                                        \
        if (a_ != b_) TEST_FAIL_("%s == %s: %lld != %lld", #a, #b, a_, b_);                        \
    } while (0)

#define ASSERT_STR_CONTAINS(s, sub)                                                                \
    do {                                                                                           \
        const char *s_ = (s);                                                                      \
        if (!s_ || !strstr(s_, (sub)))                                                             \
            TEST_FAIL_("%s does not contain \"%s\": \"%s\"", #s, (sub), s_ ? s_ : "(null)");       \
    } while (0)

#define ASSERT_OK(expr)                                                                            \
    do {                                                                                           \
        kvc_status st_ = (expr);                                                                   \
        if (st_ != KVC_OK)                                                                         \
            TEST_FAIL_("%s -> %s: %s", #expr, kvc_status_str(st_), kvc_last_error());              \
    } while (0)

#define ASSERT_STATUS(expr, want)                                                                  \
    do {                                                                                           \
        kvc_status st_ = (expr);                                                                   \
        if (st_ != (want))                                                                         \
            TEST_FAIL_("%s -> %s, want %s (%s)", #expr, kvc_status_str(st_),                       \
                       kvc_status_str(want), kvc_last_error());                                    \
    } while (0)

#define ASSERT_MEM_EQ(a, b, n)                                                                     \
    do {                                                                                           \
        size_t n_ = (size_t)(n);                                                                   \
        const unsigned char *a_ = (const unsigned char *)(a), *b_ = (const unsigned char *)(b);    \
        for (size_t i_ = 0; i_ < n_; i_++)                                                         \
            if (a_[i_] != b_[i_])                                                                  \
                TEST_FAIL_("%s vs %s differ at byte %zu of %zu: 0x%02x != 0x%02x", #a, #b, i_, n_, \
                           a_[i_], b_[i_]);                                                        \
    } while (0)

#define ASSERT_NEAR(a, b, tol)                                                                     \
    do {                                                                                           \
        double a_ = (a), b_ = (b);                                                                 \
        if (!(fabs(a_ - b_) <= (tol)))                                                             \
            TEST_FAIL_("%s ~ %s: %.9g vs %.9g (tol %g)", #a, #b, a_, b_, (double)(tol));           \
    } while (0)

/* Records the current test's skip reason (printf format); returns 2. */
int test_skip(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
#define SKIP(...) return test_skip(__VA_ARGS__)

/* 1 if the library runs isa here; otherwise 0, and the current test notes a
 * skipped path ("isa NAME not supported here"), reported and checked like a
 * skipped test. */
int test_isa_usable(kvc_isa isa);

/* A thread pool of n_threads (1..4), created on first use and destroyed
 * when the suite ends (test_main.c); NULL if it cannot be created. */
kvc_threadpool *test_pool(int n_threads);

/* Runs fn(arg) on a thread created with the 256 KiB of stack core.h promises
 * callers need (8x under sanitizers, which grow every frame) and joins it;
 * 0, or -1 if the thread could not be made. */
int test_on_small_stack(void *(*fn)(void *), void *arg);

/* Runs the body for every ISA the CPU supports (the others are skipped
 * paths, test_isa_usable) and restores the best one after. */
#define FOR_EACH_ISA(...)                                                                          \
    do {                                                                                           \
        for (int isa_ = 0; isa_ < KVC_ISA_COUNT; isa_++) {                                         \
            if (!test_isa_usable((kvc_isa)isa_)) continue;                                         \
            ASSERT_OK(kvc_set_isa((kvc_isa)isa_));                                                 \
            __VA_ARGS__;                                                                           \
        }                                                                                          \
        kvc_set_isa(kvc_best_isa());                                                               \
    } while (0)

/* splitmix64: small, seedable, identical on every platform. */
static inline uint64_t test_rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* Uniform float in [-1, 1). */
static inline float test_rng_f32(uint64_t *s) {
    return (float)((double)(test_rng_next(s) >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
}

/* n zeroed bytes followed by 64 guard bytes of 0x5a (malloc'ed; NULL if it
 * fails): test_guard_ok tells whether a call wrote past the n bytes, and
 * the guard read as indices is far out of range (stray reads show too). */
static inline void *test_guarded(size_t n) {
    unsigned char *p = malloc(n + 64);
    if (p) {
        memset(p, 0, n);
        memset(p + n, 0x5a, 64);
    }
    return p;
}
static inline int test_guard_ok(const void *p, size_t n) {
    for (size_t i = 0; i < 64; i++)
        if (((const unsigned char *)p)[n + i] != 0x5a) return 0;
    return 1;
}

#endif
