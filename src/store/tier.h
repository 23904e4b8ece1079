/*
 * A storage tier of the KV store (store.h): a place that keeps page objects
 * (docs/KV_STORE.md) under 128-bit keys grouped by a 128-bit namespace.
 * Tiers move opaque bytes; they never parse or trust an object (the store
 * verifies every object it reads). Implementations: dir.c (a directory, one
 * file per page), redis.c (Redis/Valkey servers through hiredis).
 *
 * Threads: the store calls a tier from any number of threads at once: its
 * writer thread (put) and every thread that uses the store (probe, get,
 * invalidate): each engine's, each engine's background loads (one thread
 * per load), callers of kvc_store_restore_run and kvc_store_invalidate. A
 * tier makes that safe with its own locks (dir.c: a mutex; redis.c: one
 * connection for put and one for the rest, each behind its mutex).
 *
 * Errors: return kvc_status with kvc__error's message. A key that is absent
 * is not an error (probe counts it, get leaves its slot NULL), nor is one
 * that cannot be read (get: an unreadable file, a value that is no string:
 * its slot NULL, the other keys read as usual). An unreachable server or
 * an unreadable directory is KVC_ERR_IO; the store counts it and treats
 * the call as all misses.
 */
#ifndef KVC_STORE_TIER_H
#define KVC_STORE_TIER_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "kvcache/store.h"

/* Keys and namespace digests are kvc_store_key (store.h): 16 bytes, the
 * canonical big-endian form of XXH3-128. Printed as 32 lower-case hex
 * digits wherever a tier needs a name. */
typedef struct kvc_tier kvc_tier;

/* Called by a tier when it drops an object on its own (budget eviction,
 * nothing else), from whichever thread dropped it. */
typedef void (*kvc_tier_removed_fn)(void *user, const kvc_store_key *ns, const kvc_store_key *key);

typedef struct kvc_tier_ops {
    /* Sets *n_present to how many of keys[0..n) are present from the first
     * on (the longest run; stops at the first absent one). One round trip
     * for a remote tier. */
    kvc_status (*probe)(kvc_tier *t, const kvc_store_key *ns, const kvc_store_key *keys,
                        int64_t n, int64_t *n_present);
    /* Reads keys[0..n): objs[i] receives a copy of the object in a buffer
     * of the tier's pool (the caller gives it back or frees it) and lens[i]
     * its size, or NULL / 0 when absent. An object over max_len bytes comes
     * back as its first max_len + 1 (no valid object is that large: a size
     * the store refuses, without a huge read or allocation). On an error
     * every objs[i] is NULL (nothing to free). Pipelined: one round trip
     * per server for the whole batch. deadline_ns (CLOCK_MONOTONIC ns, 0:
     * none): the call returns by then, give or take one read under way
     * (a socket wait's ~10 ms of slack, one file's read): keys it did not
     * read by then come back NULL, the ones read are kept (KVC_OK). */
    kvc_status (*get)(kvc_tier *t, const kvc_store_key *ns, const kvc_store_key *keys, int64_t n,
                      size_t max_len, int64_t deadline_ns, void **objs, size_t *lens);
    /* Writes n objects. Each is visible whole or not at all, never in part,
     * whatever happens to this process or the tier meanwhile (a killed
     * writer, a full disk). An existing object under the same key is
     * replaced (its bytes are the same by construction). written (may be
     * NULL): written[i] = 1 for each object written and still there when
     * put returns (a dir tier's budget may evict one of the call's own),
     * else 0. On error some
     * objects may have been written, each whole, in any order (several
     * servers, or an error reply in the middle of a pipeline). */
    kvc_status (*put)(kvc_tier *t, const kvc_store_key *ns, const kvc_store_key *keys,
                      const void *const *objs, const size_t *lens, int64_t n,
                      unsigned char *written);
    /* Removes every object of namespace ns (all processes' writes). A dir
     * tier fails only when it removed nothing (the namespace's rename);
     * space it could not reclaim after that is a later open's clean-up, not
     * an error (the objects are gone). A Redis tier may have removed some
     * objects when it fails (an error reply or a lost server midway).
     * removed (may be NULL): set to 1 when the call may have removed
     * objects, failed or not (the store then announces the namespace
     * cleared: a router must not keep routing to removed pages), else 0. */
    kvc_status (*invalidate)(kvc_tier *t, const kvc_store_key *ns, int *removed);
    void (*close)(kvc_tier *t); /* frees t */
    /* May be NULL. Before close, when the store's open failed after this
     * tier's: removes what the tier's open created (a dir tier's new
     * directories, while still empty), never what existed before it. */
    void (*abandon)(kvc_tier *t);
} kvc_tier_ops;

/* Recycled object buffers (objpool.c), shared by a store and its tiers:
 * every object a tier's get returns comes from kvc__objpool_get, and whoever
 * is done with one gives it back with its size (or frees it: the buffers
 * are malloc blocks). NULL pool: plain malloc and free. */
typedef struct kvc__objpool kvc__objpool;
kvc__objpool *kvc__objpool_create(size_t max_bytes); /* NULL: out of memory */
void kvc__objpool_destroy(kvc__objpool *p);          /* frees what it holds; NULL: no-op */
/* A buffer of at least size bytes (a recycled one when the pool holds one
 * of about that size), NULL when out of memory. */
void *kvc__objpool_get(kvc__objpool *p, size_t size);
/* Gives back buf, whose allocation holds at least size bytes (NULL: no-op);
 * freed when the pool is full. */
void kvc__objpool_put(kvc__objpool *p, void *buf, size_t size);
/* Buffers held and their recorded bytes (0 and 0 for a NULL pool). */
void kvc__objpool_held(kvc__objpool *p, int *n, size_t *bytes);

struct kvc_tier {
    const kvc_tier_ops *ops;
    char kind[8];     /* "dir" or "redis" */
    char name[256];   /* the URL it was opened with, for messages and stats */
    kvc_tier_removed_fn removed; /* may be NULL; set by the store after open */
    void *removed_user;
    kvc__objpool *pool; /* may be NULL; set by the store after open (get's buffers) */
    /* > 0: probe and get give up on a silent server after this many ms (the
     * store's load_timeout_s, set after open), so that a load that stops at
     * load_timeout_s is not held past it by one blocked read */
    int64_t read_timeout_ms;
};

/* "dir:PATH" or "dir:PATH?max_bytes=N" (N bytes, suffixes K, M, G = 2^10,
 * 2^20, 2^30 allowed; default: no budget). Creates PATH if missing. */
kvc_status kvc__tier_dir_open(const char *url, kvc_tier **out);

/* One or more comma-separated server URLs,
 * "redis://[[USER]:PASSWORD@]HOST:PORT[/DB]" or
 * "unix://[[USER]:PASSWORD@]/PATH/TO/SOCKET" (credentials %-encoded; sent
 * with AUTH, the database with SELECT, on each connect), with one optional
 * "?ttl=SECONDS&db=N" at the very end applying to all (default: no expiry,
 * database 0; db= for the servers without /DB). KVC_ERR_UNSUPPORTED when the
 * library was built without hiredis. Connects lazily or at open (an
 * unreachable server at open is not an error: it counts as down and is
 * retried with back-off). */
kvc_status kvc__tier_redis_open(const char *url, kvc_tier **out);
/* The same with credentials for the servers whose URL gives none
 * (kvc_store_params.redis_user / redis_password, as the store checked
 * them: each NULL or non-empty, no user without a password); copied. */
kvc_status kvc__tier_redis_open_as(const char *url, const char *user, const char *pass,
                                   kvc_tier **out);

/* Zeroes then frees a string that may hold a password (a URL, a copy of
 * one): volatile stores, which the compiler cannot drop as dead. NULL is a
 * no-op. */
static inline void kvc__free_secret(char *s) {
    if (!s) return;
    for (volatile char *p = s; *p; p++) *p = 0;
    free(s);
}

/* 32 lower-case hex digits and a NUL into out (33 bytes). */
void kvc__store_key_hex(const kvc_store_key *k, char out[33]);

#endif
