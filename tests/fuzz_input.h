/*
 * The decoded-call fuzz targets' input (fuzz_attn.c, fuzz_kvfmt.c): bytes
 * read in order, a byte past the end reading as 0 (so the shortest inputs
 * are valid calls), a splitmix64 stream for tensor contents, seeded
 * from the input, and the targets' thread pools.
 */
#ifndef KVC_TESTS_FUZZ_INPUT_H
#define KVC_TESTS_FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "kvcache/core.h"
#include "fuzz.h"

typedef struct reader {
    const uint8_t *p;
    size_t n, i;
} reader;

static inline unsigned next(reader *r) { return r->i < r->n ? r->p[r->i++] : 0; }
static inline unsigned pick(reader *r, unsigned n) { return next(r) % n; }

static uint64_t rng_state;
static inline uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The header every input starts with: the operator (a byte, modulo n_ops),
 * two bytes seeding rnd(), then a byte of flags; returns the operator. */
static inline int fuzz_header(reader *r, unsigned n_ops, unsigned *flags) {
    const int op = (int)pick(r, n_ops);
    rng_state = next(r) | (uint64_t)next(r) << 8;
    *flags = next(r);
    return op;
}

/* Once per process: pools[1] and pools[2] with 1 and 2 threads (pools[0]
 * NULL: the caller's thread), and stats printed at exit when
 * KVC_FUZZ_STATS is set and not 0. */
static inline void fuzz_start(kvc_threadpool *pools[3], void (*stats)(void)) {
    static int started;
    if (started) return;
    started = 1;
    pools[0] = NULL;
    CHECK(kvc_threadpool_create(1, &pools[1]) == KVC_OK);
    CHECK(kvc_threadpool_create(2, &pools[2]) == KVC_OK);
    const char *e = getenv("KVC_FUZZ_STATS");
    if (e && *e && *e != '0') atexit(stats);
}

#endif
