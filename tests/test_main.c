/* Runner shared by every C suite: filters, seeds, counts, and the skip
 * check (every skip listed with its reason, the suite failed by one that
 * tests/expected_skips.txt does not excuse here). */
#define _POSIX_C_SOURCE 200809L /* getline, stat */
#include <ctype.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "test.h"

#ifndef KVC_TEST_SOURCE_DIR /* the repository root (tests/CMakeLists.txt) */
#define KVC_TEST_SOURCE_DIR "."
#endif

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

/* ---- skips --------------------------------------------------------------- */

typedef struct skip_rec {
    const char *test; /* test_case name */
    int path;         /* 0: the test was skipped; 1: a path of it (an ISA) */
    char reason[200];
} skip_rec;

enum { MAX_SKIPS = 2048 };
static skip_rec skips[MAX_SKIPS];
static int n_skips, n_skips_lost;
static const char *current_test = "(none)";

/* 1 if newly recorded (one record per test, kind and reason). */
static int record_skip(int path, const char *reason) {
    for (int i = 0; i < n_skips; i++)
        if (skips[i].test == current_test && skips[i].path == path &&
            !strcmp(skips[i].reason, reason))
            return 0;
    if (n_skips == MAX_SKIPS) {
        n_skips_lost++;
        return 1;
    }
    skips[n_skips].test = current_test;
    skips[n_skips].path = path;
    snprintf(skips[n_skips].reason, sizeof skips[n_skips].reason, "%s", reason);
    n_skips++;
    return 1;
}

int test_skip(const char *fmt, ...) {
    char buf[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "  skipped: %s\n", buf);
    record_skip(0, buf);
    return 2;
}

int test_isa_usable(kvc_isa isa) {
    if (kvc_isa_supported(isa)) return 1;
    char buf[64];
    snprintf(buf, sizeof buf, "isa %s not supported here", kvc_isa_name(isa));
    if (record_skip(1, buf)) printf("  skipped path: %s\n", buf);
    return 0;
}

/* /proc/cpuinfo's first flags line, read once ("" if unreadable). */
static const char *cpu_flags(void) {
    static char *flags;
    static int done;
    if (!done) {
        done = 1;
        FILE *f = fopen("/proc/cpuinfo", "r");
        char *line = NULL;
        size_t cap = 0;
        while (f && getline(&line, &cap, f) > 0)
            if (!strncmp(line, "flags", 5) && strchr(line, ':')) {
                flags = line;
                line = NULL;
                break;
            }
        free(line);
        if (f) fclose(f);
    }
    return flags ? strchr(flags, ':') + 1 : "";
}

static int has_flag(const char *flag) {
    const size_t n = strlen(flag);
    for (const char *p = cpu_flags(); (p = strstr(p, flag)) != NULL; p += n)
        if (isspace((unsigned char)p[-1]) && (p[n] == '\0' || isspace((unsigned char)p[n])))
            return 1;
    return 0;
}

/* Whether a condition of tests/expected_skips.txt holds here (words
 * separated by spaces; unknown or Python-only conditions: no). */
static int condition_holds(char *cond) {
    char *save = NULL, *kind = strtok_r(cond, " \t", &save), *arg;
    if (!kind) return 0;
    int n_args = 0, lacks = 0, has_all = 1;
    const char *first = NULL;
    while ((arg = strtok_r(NULL, " \t", &save)) != NULL) {
        if (!n_args++) first = arg;
        if (has_flag(arg)) continue;
        lacks = 1;
        has_all = 0;
    }
    const int cpu_known = *cpu_flags() != '\0';
    if (!strcmp(kind, "cpu-lacks")) return n_args > 0 && cpu_known && lacks;
    if (!strcmp(kind, "cpu-has")) return n_args > 0 && cpu_known && has_all;
    if (!strcmp(kind, "env")) return n_args == 1 && getenv(first) && *getenv(first);
    if (!strcmp(kind, "missing") && n_args == 1) {
        char path[4096];
        snprintf(path, sizeof path, "%s%s%s", first[0] == '/' ? "" : KVC_TEST_SOURCE_DIR,
                 first[0] == '/' ? "" : "/", first);
        struct stat st;
        return stat(path, &st) != 0;
    }
    if (!strcmp(kind, "no-ld-wrap") && n_args == 0) {
#ifdef KVC_TEST_OOM
        return 0;
#else
        return 1;
#endif
    }
    return 0;
}

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = '\0';
    return s;
}

/* The condition that excuses reason here (copied to why), or 0. */
static int excused(const char *reason, char *why, size_t why_n) {
    FILE *f = fopen(KVC_TEST_SOURCE_DIR "/tests/expected_skips.txt", "r");
    if (!f) {
        snprintf(why, why_n, "cannot read %s/tests/expected_skips.txt", KVC_TEST_SOURCE_DIR);
        return 0;
    }
    char line[512];
    int ok = 0;
    while (!ok && fgets(line, sizeof line, f)) {
        char *bar = strchr(line, '|'), *cond = trim(line);
        if (*cond == '#' || !bar) continue;
        *bar = '\0';
        char *sub = trim(bar + 1);
        cond = trim(cond);
        snprintf(why, why_n, "%s", cond);
        ok = *sub && strstr(reason, sub) && condition_holds(cond);
    }
    fclose(f);
    if (!ok) snprintf(why, why_n, "UNEXPECTED");
    return ok;
}

/* Lists every skip (paths grouped by reason); the number of unexpected ones. */
static int report_skips(void) {
    int unexpected = 0;
    char why[512];
    for (int i = 0; i < n_skips; i++) {
        if (skips[i].path) {
            int first = 1, n = 0;
            for (int j = 0; j < n_skips; j++)
                if (skips[j].path && !strcmp(skips[j].reason, skips[i].reason)) {
                    first &= j >= i;
                    n++;
                }
            if (!first) continue;
            const int ok = excused(skips[i].reason, why, sizeof why);
            unexpected += !ok;
            printf("path not run (%s%s): %s [%d test%s, e.g. %s.%s]\n", ok ? "expected: " : "",
                   why, skips[i].reason, n, n == 1 ? "" : "s", test_suite_name, skips[i].test);
        } else {
            const int ok = excused(skips[i].reason, why, sizeof why);
            unexpected += !ok;
            printf("skipped (%s%s): %s.%s: %s\n", ok ? "expected: " : "", why, test_suite_name,
                   skips[i].test, skips[i].reason);
        }
    }
    if (n_skips_lost) {
        printf("UNEXPECTED: %d more skips than the harness records (%d)\n", n_skips_lost,
               MAX_SKIPS);
        unexpected++;
    }
    return unexpected;
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
        current_test = t->name;
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
    const int unexpected = report_skips();
    printf("%s: %d passed, %d failed, %d skipped, %d unexpected skip%s\n", test_suite_name, passed,
           failed, skipped, unexpected, unexpected == 1 ? "" : "s");
    return failed || unexpected ? 1 : 0;
}
