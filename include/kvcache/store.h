/*
 * KV store: pages of a kvc_cache that outlive the process (libkvcache_store;
 * docs/KV_STORE.md is the contract). A page is storable once its bytes are
 * final (full, and for a compressed format its K group complete). It is kept
 * as one object holding every layer, under a 128-bit key chained from a
 * namespace digest over the page's tokens:
 *   ns      = XXH3-128(canonical text of model, tokenizer, geometry, format, salt)
 *   key[0]  = XXH3-128(ns || tokens of page 0), key[i] = XXH3-128(key[i-1] || tokens of page i)
 * (tokens as little-endian int32; 128-bit values in XXH3's canonical
 * big-endian form; for a compressed format whose K groups span pages, the
 * tokens of the page's whole group and its index in it). No process-random seed: any process of any build on any
 * machine computes the same keys.
 *
 * A load is applied only when the object's header, checksums, namespace,
 * key, parent key, position, token ids and sizes all match what the cache
 * expects (and its BLAKE2b tag, with an authentication key): anything else
 * is a miss counted by reason, never K/V.
 *
 * Tiers, looked up in the order given: "dir:PATH[?max_bytes=N]" (one file
 * per page, written under a temporary name and renamed, LRU within a byte
 * budget, shared safely by processes) and
 * "redis://[[USER]:PASSWORD@]HOST:PORT[/DB]" or
 * "unix://[[USER]:PASSWORD@]/PATH" (Redis or Valkey through hiredis; AUTH
 * and SELECT on connect, credentials %XX-encoded; several servers in one
 * comma-separated URL share the keys by rendezvous hashing;
 * "?ttl=SECONDS&db=N"; docs/KV_STORE.md section 5).
 * Any tier's URL may end in a write policy for engines attached to the
 * store, "write=through", "write=back" or "write=selective:N" (after '?',
 * or '&' after the tier's own option: "dir:/k?max_bytes=8G&write=back");
 * without one a tier takes kvc_store_params.write_policy.
 * Writes go to their tiers from a background thread with a bounded queue: a
 * full queue drops the write (a later miss) and counts it; nothing that
 * queues a write waits for it.
 *
 * Security (docs/KV_STORE.md section 6): without an authentication key,
 * anyone who can write to a tier can make this process serve K/V of their
 * choosing. Whether a prefix is stored shows in the time to first token, so
 * salts (tenants) must be chosen by the server, never taken from clients.
 */
#ifndef KVCACHE_STORE_H
#define KVCACHE_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "kvcache/cache.h"
#include "kvcache/core.h"
#include "kvcache/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A 128-bit key or digest: XXH3-128 in its canonical (big-endian) bytes. */
#ifndef KVC_STORE_KEY_DEFINED
#define KVC_STORE_KEY_DEFINED
typedef struct kvc_store_key {
    uint8_t b[16];
} kvc_store_key;
#else
typedef struct kvc_store_key kvc_store_key;
#endif

#define KVC_STORE_OBJ_VERSION 1
#define KVC_STORE_HEADER_BYTES 128
#define KVC_STORE_AUTH_KEY_BYTES 32 /* libsodium crypto_generichash_KEYBYTES */
#define KVC_STORE_AUTH_TAG_BYTES 32

/* ---- namespace and keys ------------------------------------------------- */

/* What K/V of a token depends on, besides the tokens (section 2). */
typedef struct kvc_store_namespace_desc {
    kvc_store_key model_digest;     /* of the weights (kvc_store_gguf_digests) */
    kvc_store_key tokenizer_digest; /* of the tokenizer (kvc_store_gguf_digests) */
    int32_t n_layers, n_kv_heads, head_dim;
    int32_t n_rot, rope_neox, rope_freq_factors;
    float rope_freq_base, rope_scale;
    kvc_cache_params cache; /* geometry and format: page_size, dtype, scale_dtype,
                               quant_group, layout, kv_format (the rest is ignored) */
    const void *salt;       /* tenant, any bytes (NULL with salt_len 0: none) */
    size_t salt_len;
} kvc_store_namespace_desc;

/* The namespace digest of d. */
KVC_API kvc_status kvc_store_namespace(const kvc_store_namespace_desc *d, kvc_store_key *out);

/* Digests of a GGUF file: model = its tensors (names, types, shapes and
 * data: a new file is a new namespace), tokenizer = its tokenizer.* keys
 * except the chat templates (they do not change token ids' K/V). Reads the
 * whole tensor data (~0.1 s per GB). */
KVC_API kvc_status kvc_store_gguf_digests(const char *gguf_path, kvc_store_key *model_digest,
                                          kvc_store_key *tokenizer_digest);

/* The namespace of model (loaded from gguf_path) served through a cache with
 * params cache_params, for a salt. */
KVC_API kvc_status kvc_store_model_namespace(const char *gguf_path, const kvc_model *model,
                                             const kvc_cache_params *cache_params,
                                             const void *salt, size_t salt_len,
                                             kvc_store_key *out);

/* keys[i] of the first n_pages pages of tokens (n_pages * page_size ids),
 * in units of unit_pages pages (n_pages a multiple): 1 for per-token caches
 * and compressed formats whose K groups fit in a page, G / page_size when
 * groups span pages (a page's bytes then depend on its whole group, so its
 * key covers the group's ids; docs/KV_STORE.md section 2). */
KVC_API kvc_status kvc_store_page_keys(const kvc_store_key *ns, const int32_t *tokens,
                                       int64_t n_pages, int32_t page_size, int32_t unit_pages,
                                       kvc_store_key *keys);

/* ---- page objects (section 3) ------------------------------------------- */

/* Why an object was not applied (stats index; section 4). */
typedef enum kvc_store_miss {
    KVC_STORE_MISS_ABSENT = 0,   /* no tier holds the key (or it could not be read) */
    KVC_STORE_MISS_TRUNCATED,    /* shorter or longer than its header says */
    KVC_STORE_MISS_MAGIC,        /* not a kvcache page object */
    KVC_STORE_MISS_VERSION,      /* a format version this reader does not know */
    KVC_STORE_MISS_HEADER,       /* header checksum */
    KVC_STORE_MISS_GEOMETRY,     /* layer count, page size or byte sizes differ */
    KVC_STORE_MISS_PAYLOAD,      /* payload checksum (token ids and K/V) */
    KVC_STORE_MISS_AUTH,         /* missing or wrong BLAKE2b tag (with an auth key) */
    KVC_STORE_MISS_NAMESPACE,    /* another model, format or tenant */
    KVC_STORE_MISS_KEY,          /* key or parent key differ (a collision or a misfiled object) */
    KVC_STORE_MISS_TOKENS,       /* position or token ids differ */
    KVC_STORE_MISS_COUNT
} kvc_store_miss;

KVC_API const char *kvc_store_miss_name(kvc_store_miss m); /* "absent", ... */

/* What the cache expects of one object. */
typedef struct kvc_store_expect {
    kvc_store_key ns, key, parent; /* parent = ns for the first page */
    int64_t position;              /* first token's position: page index * page_size */
    const int32_t *tokens;         /* page_size ids */
} kvc_store_expect;

/* Bytes of the largest page object for cache (header, token ids, payload
 * of every layer, and the tag when auth != 0): a sequence's first page's,
 * which in a format with sink rows also carries them (kvc_cache_sink_bytes
 * more than the others' objects). 0 for a NULL cache. */
KVC_API size_t kvc_store_object_bytes(const kvc_cache *cache, int auth);

/* Serializes page page_id of cache (every layer: kvc_cache_read_page) as the
 * object e describes into dst (cap >= kvc_store_object_bytes suffices for
 * any page; *size receives the bytes written). auth_key: NULL or KVC_STORE_AUTH_KEY_BYTES
 * (adds the tag; KVC_ERR_UNSUPPORTED if built without libsodium). The
 * caller vouches that the page holds e's tokens. */
KVC_API kvc_status kvc_store_serialize_page(const kvc_cache *cache, int32_t page_id,
                                            const kvc_store_expect *e, const uint8_t *auth_key,
                                            void *dst, size_t cap, size_t *size);

/* Checks obj (size bytes) against e and cache's geometry: KVC_OK and *miss
 * = KVC_STORE_MISS_COUNT when it may be applied, else KVC_ERR_CORRUPT with
 * *miss the first check that failed (in the enum's order) and a message.
 * With auth_key, an object without a valid tag fails (AUTH). */
KVC_API kvc_status kvc_store_verify_object(const kvc_cache *cache, const void *obj, size_t size,
                                           const kvc_store_expect *e, const uint8_t *auth_key,
                                           kvc_store_miss *miss);

/* Verifies obj, then writes its payload into page page_id of cache
 * (kvc_cache_write_page). Nothing is written unless every check passes. */
KVC_API kvc_status kvc_store_restore_page(kvc_cache *cache, int32_t page_id, const void *obj,
                                          size_t size, const kvc_store_expect *e,
                                          const uint8_t *auth_key, kvc_store_miss *miss);

/* ---- the store ---------------------------------------------------------- */

/* Threads: a kvc_store locks itself. Any number of threads may call the
 * functions below on one store at once (engines attached to it stepped on
 * threads of their own, restores, saves, puts, flushes, stats, invalidates,
 * event callback changes), except kvc_store_close and kvc_store_abandon,
 * which no other call on the store may overlap. What a call touches besides
 * the store follows its own rules: a kvc_cache or a kvc_engine is used by
 * one thread at a time (an engine's attachment is called from the thread
 * that steps it; kvc_store_detach_engine never while the engine steps). */
typedef struct kvc_store kvc_store;

typedef enum kvc_store_write_policy {
    KVC_STORE_WRITE_THROUGH = 0,  /* when a page becomes final */
    KVC_STORE_WRITE_BACK = 1,     /* when the cache evicts it */
    KVC_STORE_WRITE_SELECTIVE = 2 /* once it has served selective_hits prefix hits */
} kvc_store_write_policy;

typedef struct kvc_store_params {
    int32_t queue_objects;       /* writes waiting at most (default 4096) */
    int64_t queue_bytes;         /* and their bytes (default 512 MiB) */
    const uint8_t *auth_key;     /* NULL (default) or KVC_STORE_AUTH_KEY_BYTES, copied */
    double load_timeout_s;       /* a restore gives up after this (default 2 s), within
                                    a read batch too (docs/KV_STORE.md section 4) */
    kvc_store_write_policy write_policy; /* engine attachment (default THROUGH), for the
                                            tiers whose URL names none (?write=) */
    int32_t selective_hits;      /* SELECTIVE: hits before a write (default 2) */
    int32_t writer_nice;         /* in [0, 39], added to the writer thread's nice value,
                                    capped at 19 (Linux; default 19, 0 keeps the caller's): background
                                    writes take the CPUs the engine leaves idle, and on a
                                    machine it keeps busy the queue fills and writes drop */
    int32_t promote;             /* 1 (default): a page restored from a later tier is also
                                    queued for the earlier ones (whatever their policy);
                                    0: tiers are written by their policies only */
    int64_t object_pool_bytes;   /* object buffers kept for reuse once read, restored or
                                    written (default 64 MiB, 0: none): a fresh buffer the
                                    size of a page object is faulted in and zeroed by the
                                    kernel as it is filled */
    /* AUTH credentials for the Redis servers whose URL gives none (NULL: none, the
     * default): a password kept out of URLs, which process lists and logs show. A URL's
     * own credentials win, as with redis-py's from_url(url, password=...). A user needs
     * a password; an empty user or password is refused. Copied at open, the copies
     * zeroed at close. */
    const char *redis_user;
    const char *redis_password;
} kvc_store_params;

KVC_API kvc_store_params kvc_store_default_params(void);

/* Opens the tiers urls[0..n_urls) (lookup order = this order) and starts the
 * writer thread. A Redis server that does not answer is not an error (it
 * is retried with back-off); a bad URL or an unusable directory is, and
 * then nothing is left open or created (the directories it made for
 * earlier dir: tiers are removed again).
 * n_urls 0 (urls may be NULL) opens a store of no tiers: it finds nothing
 * and writes nothing, and an engine attached to it reports its cache's
 * pages as events (a router that follows the engine without a store). */
KVC_API kvc_status kvc_store_open(const char *const *urls, int32_t n_urls,
                                  const kvc_store_params *params, kvc_store **out);
/* Stops the writer; queued writes not yet written are dropped (counted):
 * kvc_store_flush first to keep them. NULL is a no-op. */
KVC_API void kvc_store_close(kvc_store *store);
/* kvc_store_close for a store whose setup failed right after
 * kvc_store_open (e.g. kvc_store_events_open could not bind): also removes
 * the directories that open created for its dir tiers (PATH, PATH/tmp)
 * while they are still empty, so the failed setup leaves nothing behind.
 * A directory that existed before, or that holds anything, stays. NULL is
 * a no-op. (A failing kvc_store_open does this itself.) */
KVC_API void kvc_store_abandon(kvc_store *store);

/* Waits until every write queued so far is written (or failed), at most
 * timeout_s (< 0 or over 100 years: no limit; NaN: KVC_ERR_INVALID_ARG);
 * KVC_ERR_IO on timeout. */
KVC_API kvc_status kvc_store_flush(kvc_store *store, double timeout_s);

/* Removes every object of namespace ns from every tier, after waiting (30 s
 * at most: KVC_ERR_IO past it, nothing removed) for the queued writes, which
 * could bring pages back. A tier that fails does not stop the others: the
 * first failure is returned, and the tiers that succeeded are cleared. A
 * CLEARED event goes out for each tier that succeeded and for each that
 * failed after it may have removed objects (a Redis tier one of whose
 * servers failed while the others removed their keys), since subscribers
 * must not keep pages that are gone; not for a tier that removed nothing
 * (a dir tier's failed rename, every Redis server down). */
KVC_API kvc_status kvc_store_invalidate(kvc_store *store, const kvc_store_key *ns);

/* Queues a copy of obj (size bytes) under (ns, key) for every tier. Never
 * waits: KVC_OK when queued, else the write is dropped and counted
 * (KVC_ERR_NO_SPACE when the queue is full). */
KVC_API kvc_status kvc_store_put(kvc_store *store, const kvc_store_key *ns,
                                 const kvc_store_key *key, const void *obj, size_t size);

/* The run of tokens' pages [first_page, first_page + max_pages) that the
 * tiers hold and that verify (first_page and max_pages whole units,
 * kvc_store_page_keys), restored into page_ids (pages the caller owns,
 * e.g. just reserved by kvc_cache_add_sequence; page_ids[i] receives page
 * first_page + i): *n_pages receives the run's length (from first_page on;
 * tiers tried in order, each continuing where the previous one stopped;
 * cut at the first absent or failing object or at the timeout; a cut may
 * fall inside a unit, whose pages the caller then recomputes). tokens
 * holds (first_page + max_pages) * page_size ids. The call verifies and
 * writes on a thread of its own while it reads the next objects (joined
 * before it returns; KVC_ERR_NOMEM if it cannot start). */
KVC_API kvc_status kvc_store_restore_run(kvc_store *store, kvc_cache *cache,
                                         const kvc_store_key *ns, const int32_t *tokens,
                                         int64_t first_page, int64_t max_pages,
                                         const int32_t *page_ids, int64_t *n_pages);

/* Serializes pages [first_page, first_page + n_pages) of tokens (page ids
 * page_ids[0..n_pages)) and queues them (kvc_store_put). tokens holds
 * (first_page + n_pages) * page_size ids (the keys chain from page 0);
 * first_page and n_pages are whole units (kvc_store_page_keys). All or
 * nothing: every page is serialized before any is queued, and the run is
 * queued at once only if the queue has room for all of it; otherwise
 * nothing is queued and the n_pages writes count as dropped (KVC_ERR_NO_SPACE
 * for a queue without room, so a run over queue_objects or queue_bytes
 * never fits; the serialization's error for a page that cannot be read,
 * e.g. KVC_ERR_INVALID_ARG for a bad page id; KVC_ERR_NOMEM). */
KVC_API kvc_status kvc_store_save_run(kvc_store *store, const kvc_cache *cache,
                                      const kvc_store_key *ns, const int32_t *tokens,
                                      int64_t first_page, int64_t n_pages,
                                      const int32_t *page_ids);

typedef struct kvc_store_stats {
    /* pages restored into a cache; pages looked up and not restored. An
     * engine's background load counts when the engine takes its pages:
     * those it reads but does not write into the cache (the request left,
     * its prefix cache had them by then) are misses, and so are the pages
     * kvc_store_restore_run writes of a unit it cut (computed again). */
    int64_t hit_pages, miss_pages;
    int64_t verify_failures;          /* objects read but refused (sum of misses[1..]) */
    int64_t misses[KVC_STORE_MISS_COUNT]; /* by reason; [ABSENT]: miss_pages not refused
                                             (absent, unreachable, past the timeout, or
                                             read by a load and not used) */
    int64_t errors;                   /* tier calls that failed (I/O, server down) */
    int64_t bytes_read;               /* object bytes read from the tiers */
    int64_t bytes_written;            /* object bytes stored, summed over the tiers */
    /* Objects, each counted once however many tiers it goes to: queued
     * for the writer; done: the writer is through with them, stored or
     * not; dropped: never queued (a full queue, out of memory); failed: of
     * the done ones, those that at least one of their tiers did not store
     * (an error, a refusal, a dir: budget that evicted it within its own
     * batch). */
    int64_t writes_queued, writes_done, writes_dropped, writes_failed;
    int64_t timeouts;                 /* restores cut by load_timeout_s */
} kvc_store_stats;

KVC_API kvc_status kvc_store_get_stats(kvc_store *store, kvc_store_stats *out);

/* The message of the most recent failed tier call counted in
 * kvc_store_stats.errors ("" while none failed), into buf (cap > 0 bytes,
 * cut to fit, NUL-terminated). Those failures happen on the writer thread
 * or inside a restore and cost only misses, so kvc_last_error never shows
 * them: this says why (a server down, a refused password, a full disk). */
KVC_API kvc_status kvc_store_last_tier_error(kvc_store *store, char *buf, size_t cap);

/* Events for cache-aware routers: pages stored, removed or all cleared.
 * tier >= 0 is a tier (index in the urls of kvc_store_open): stored after
 * the write, removed by its budget, cleared by kvc_store_invalidate
 * (also when it failed after removing some objects).
 * tier KVC_STORE_TIER_CACHE is the cache of an attached engine: stored when
 * a page becomes final there or is restored into it from a tier, removed
 * when the cache evicts it. Called from the writer thread, the threads
 * that step attached engines, and callers of kvc_store_invalidate and
 * kvc_store_detach_engine (one call at a time); must not call back into
 * the store.
 * tokens: the page's ids (NULL for removals and clears). */
#define KVC_STORE_TIER_CACHE (-1)
typedef enum kvc_store_event_kind {
    KVC_STORE_EVENT_STORED = 0,
    KVC_STORE_EVENT_REMOVED = 1,
    KVC_STORE_EVENT_CLEARED = 2
} kvc_store_event_kind;

typedef struct kvc_store_event {
    kvc_store_event_kind kind;
    int32_t tier;               /* index in the urls given to kvc_store_open */
    kvc_store_key ns, key, parent;
    const int32_t *tokens;
    int32_t n_tokens;
} kvc_store_event;

typedef void (*kvc_store_event_fn)(void *user, const kvc_store_event *ev);
/* Sets (or with fn NULL clears) the event callback. Calls are serialized
 * (one at a time, from any of those threads); once this returns, the
 * previous callback is not running and will not be called again. */
KVC_API kvc_status kvc_store_set_event_callback(kvc_store *store, kvc_store_event_fn fn,
                                                void *user);

/* ---- events over ZeroMQ (docs/KV_STORE.md section 7) ---------------------
 * The store's events published as vLLM's KVEventBatch on a ZeroMQ PUB
 * socket, for routers built for vLLM (llm-d, NVIDIA Dynamo, SGLang's
 * router): multipart [topic "", sequence number (8 bytes big-endian),
 * msgpack batch]. Keys are sent as 16-byte msgpack bin. Medium: "GPU" for
 * the attached engine's cache, "DISK" for a dir tier, "EXTERNAL" for a
 * Redis tier. Needs libzmq and msgpack-c (else KVC_ERR_UNSUPPORTED). */
typedef struct kvc_store_events kvc_store_events;

/* Binds a PUB socket to endpoint ("tcp://127.0.0.1:5557", "tcp://0.0.0.0:5557",
 * "ipc:///path") and installs itself as store's event callback (replacing
 * any). Events wait in a bounded queue (4096): a full queue drops them
 * (counted, and the next batch skips a sequence number: a gap tells
 * subscribers of the loss), never blocking the writer or an engine. A publisher thread
 * sends them in batches (64 events or 10 ms), the first one no sooner than
 * 200 ms after the bind (subscribers that connect in that time miss
 * nothing). The store must outlive it. */
KVC_API kvc_status kvc_store_events_open(kvc_store *store, const char *endpoint,
                                         kvc_store_events **out);

/* Replay (vLLM's replay_endpoint): a subscriber that sees a gap in the
 * sequence numbers asks for the batches from a number on. A ROUTER socket
 * bound to replay_endpoint takes requests [identity, "", start (8 bytes
 * big-endian)] (what a REQ socket sends) and answers each with the kept
 * batches numbered >= start, [identity, "", number, payload], then
 * [identity, "", 8 bytes 0xff, ""] (vLLM's END_SEQ, -1). */
typedef struct kvc_store_events_params {
    const char *replay_endpoint; /* NULL (default): no replay socket */
    int32_t replay_batches;      /* the newest batches kept for replay (default 10000,
                                    vLLM's buffer_steps) */
    int64_t replay_bytes;        /* and their payload bytes at most (default 64 MiB) */
} kvc_store_events_params;

KVC_API kvc_store_events_params kvc_store_events_default_params(void);
/* kvc_store_events_open with params (NULL: the defaults). */
KVC_API kvc_status kvc_store_events_open_with(kvc_store *store, const char *endpoint,
                                              const kvc_store_events_params *params,
                                              kvc_store_events **out);
/* Uninstalls the callback, sends what is queued, and closes (waiting at
 * most ~1 s for subscribers to take the last batches). When events were
 * lost after the last batch (or its send failed), one more batch with no
 * events goes out, past a skipped sequence number, so subscribers see the
 * gap. NULL is a no-op. */
KVC_API void kvc_store_events_close(kvc_store_events *ev);

typedef struct kvc_store_events_stats {
    int64_t events_sent;    /* store events published (one block each) */
    int64_t batches_sent;   /* KVEventBatch messages */
    int64_t events_dropped; /* queue full, out of memory, or a failed send */
    int64_t replays;        /* replay requests answered */
} kvc_store_events_stats;

KVC_API kvc_status kvc_store_events_get_stats(kvc_store_events *ev, kvc_store_events_stats *out);

/* ---- engine attachment ---------------------------------------------------
 * The engine probes its own prefix cache, then the store, when it admits a
 * request, restores the run it finds into the pages it reserves, and saves
 * pages by the store's write policy. One store may serve several engines
 * (each attach is independent), stepped on one thread or on several at
 * once; the store must outlive them. */
KVC_API kvc_status kvc_store_attach_engine(kvc_store *store, kvc_engine *engine,
                                           const kvc_store_key *ns);
/* Stops store following engine: the engine loses its connector (unless it
 * was given another since; loads in flight are dropped), the store frees
 * what it kept for it, and REMOVED events (tier KVC_STORE_TIER_CACHE) name
 * every page of the engine's cache it reported stored, so a subscriber
 * drops them. Call it before destroying an engine whose store lives on (a
 * store keeps an attachment until then, or until kvc_store_close), never
 * while the engine steps. KVC_ERR_INVALID_ARG if engine is not attached.
 * Attaching an engine again replaces its attachment the same way. */
KVC_API kvc_status kvc_store_detach_engine(kvc_store *store, kvc_engine *engine);

#ifdef __cplusplus
}
#endif
#endif
