/*
 * Allocation failures for the C suites: test_oom.c wraps malloc, calloc,
 * realloc, aligned_alloc and posix_memalign at link time (-Wl,--wrap, set
 * up in tests/CMakeLists.txt for the suites that use it), so a test can make
 * the library's N-th allocation fail and check what the call does then.
 * While armed every allocation of the process counts, the test's own
 * included, and pool workers' too: arm right before the call under test.
 */
#ifndef KVC_TEST_OOM_H
#define KVC_TEST_OOM_H

/* 1 if allocations can be failed (the linker could wrap them), else 0:
 * tests SKIP then. */
int test_oom_available(void);

/* From now on, fails the n-th allocation (n >= 1) and, with sticky, every
 * later one as well. */
void test_oom_arm(long n, int sticky);

/* Stops failing; returns how many allocations were failed since armed (0:
 * the call made fewer than n, so it ran as usual). */
long test_oom_disarm(void);

/* unlink(2) failures (the suites that wrap allocations wrap unlink too):
 * from now on, every unlink of a path ending in suffix fails with err and
 * leaves the file alone; NULL suffix: unlink works again. Available when
 * test_oom_available() says so. */
void test_fail_unlink(const char *suffix, int err);

/* How many unlink calls test_fail_unlink failed since it was last called. */
long test_fail_unlink_count(void);

#endif
