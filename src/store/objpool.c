/*
 * Recycled object buffers of a store (tier.h). Page objects are large (a
 * SmolLM2-135M page is 369 KB, a Llama-3-8B page 2 MiB) and a restore reads
 * them by the hundred. A fresh malloc of that size is memory the kernel
 * must fault in and zero as the object is copied into it (glibc hands
 * freed blocks of this size back to the kernel), which cost a restore from
 * Redis 12-20% of its throughput on the Xeon VM (docs/BENCHMARKS.md). The
 * pool keeps up to max_bytes of given-back buffers for the next objects of
 * about the same size, most recently used first (the warmest in cache).
 *
 * Buffers are plain malloc blocks, so free() on one is always allowed (it
 * only leaves the pool), and a buffer given back is recorded with the size
 * the caller names, which never exceeds its allocation.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tier.h"

enum { SLOTS = 256 };

typedef struct slot {
    void *buf;
    size_t cap;
} slot;

struct kvc__objpool {
    pthread_mutex_t mu;
    size_t max_bytes, bytes;
    int n;
    slot s[SLOTS];
};

kvc__objpool *kvc__objpool_create(size_t max_bytes) {
    kvc__objpool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    p->max_bytes = max_bytes;
    return p;
}

void kvc__objpool_destroy(kvc__objpool *p) {
    if (!p) return;
    for (int i = 0; i < p->n; i++) free(p->s[i].buf);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

void *kvc__objpool_get(kvc__objpool *p, size_t size) {
    if (p) {
        pthread_mutex_lock(&p->mu);
        /* newest first; a buffer up to 1/8 larger still fits (objects of one
         * store have one size, or a few close ones) */
        for (int i = p->n - 1; i >= 0; i--) {
            const size_t cap = p->s[i].cap;
            if (cap >= size && cap - size <= cap / 8) {
                void *buf = p->s[i].buf;
                p->bytes -= cap;
                memmove(&p->s[i], &p->s[i + 1], (size_t)(p->n - 1 - i) * sizeof p->s[0]);
                p->n--;
                pthread_mutex_unlock(&p->mu);
                return buf;
            }
        }
        pthread_mutex_unlock(&p->mu);
    }
    return malloc(size ? size : 1);
}

void kvc__objpool_put(kvc__objpool *p, void *buf, size_t size) {
    if (!buf) return;
    if (p) {
        pthread_mutex_lock(&p->mu);
        if (p->n < SLOTS && size <= p->max_bytes - p->bytes) { /* bytes <= max_bytes */
            p->s[p->n].buf = buf;
            p->s[p->n].cap = size;
            p->n++;
            p->bytes += size;
            pthread_mutex_unlock(&p->mu);
            return;
        }
        pthread_mutex_unlock(&p->mu);
    }
    free(buf);
}

void kvc__objpool_held(kvc__objpool *p, int *n, size_t *bytes) {
    *n = 0, *bytes = 0;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    *n = p->n, *bytes = p->bytes;
    pthread_mutex_unlock(&p->mu);
}
