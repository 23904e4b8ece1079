/* Cache manager internals shared by cache.c (pool, storage, hash index,
 * tables, check) and sequence.c (add/append/fork/truncate/free). */
#ifndef KVC_CACHE_INTERNAL_H
#define KVC_CACHE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "../core/internal.h"
#include "kvcache/cache.h"

#define KVC__NO_PAGE (-1)
#define KVC__NO_PARENT ((int64_t)-1)

/* One page of the pool. A page is in exactly one of three states:
 *   free    ref == 0, not in the index, on the free stack
 *   cached  ref == 0, in the index, on the LRU list
 *   used    ref >= 1, in neither list (it may or may not be in the index)
 * A page in the index is full and its token slots hold its tokens; its
 * parent is the index page of the previous chunk as (id << 32 | gen). */
typedef struct kvc__page {
    int32_t ref;
    int32_t in_index;
    int32_t prev, next; /* LRU links (cached pages) */
    int32_t hnext;      /* hash bucket chain */
    int32_t dep;        /* a sequence's chain names it instead of its own identical page */
    uint32_t gen;       /* bumped whenever the page leaves the index */
    int64_t parent;     /* packed (id, gen) of the parent, or KVC__NO_PARENT */
    uint64_t hash, parent_hash, salt;
    uint64_t unit;      /* unit hash mixed into hash (0 unless G > P, see kvc__unit_hash) */
} kvc__page;

/* A sequence: one allocation holding the header and its three arrays. */
typedef struct kvc__seq {
    kvc_seq_id id;
    int64_t len;      /* tokens */
    int64_t n_pages;  /* == ceil(len / page_size) */
    int64_t cap;      /* capacity of the arrays, in pages */
    int64_t known;    /* leading tokens whose ids are known (in the page slots) */
    int64_t nh;       /* leading full pages whose chain hash is in hashes[] */
    uint64_t salt;
    int32_t *pages;   /* page table */
    uint64_t *hashes; /* chain hash of page i (i < nh) */
    int64_t *chain;   /* index page standing for chunk i (packed id/gen), or -1 */
    uint16_t *tail;   /* compressed format: num_layers tails of float16 (2, G, H, Dh),
                       * a separate allocation (kept when the arrays grow); else NULL */
} kvc__seq;

struct kvc_cache {
    kvc_cache_params p;
    kvc_allocator a;
    /* storage */
    void *storage;
    unsigned char *data, *scale; /* scale NULL for float caches */
    size_t page_data_bytes, page_scale_bytes;   /* one page of one layer, K and V */
    size_t layer_data_bytes, layer_scale_bytes; /* num_pages pages */
    size_t bytes_per_token;
    int64_t num_pages;
    int32_t ps;
    int32_t qg;
    /* compressed format (kv_format != KVC_KVFMT_NONE): data holds
     * (num_layers, num_pages, page_bytes) with page_data_bytes = page_bytes,
     * so copy_page copies it like any storage; no scales */
    int kvfmt;
    kvc_kvfmt fmt;
    size_t tail_bytes; /* one layer's tail of one sequence */
    size_t sink_bytes; /* one layer's sink rows (kvfmt.h), 0 when the format keeps none */
    uint16_t **sinks;  /* per page: the sink rows (all layers) of the sequences whose first
                        * page it is; set when a page is taken as a first page (or copied
                        * from one), kept while it is cached (a prefix hit reuses them),
                        * dropped when the page is taken again; NULL array without sinks */
    uint16_t *spare_sink; /* reserved before a commit that gives a page sink rows */
    int32_t group;     /* G of the format; 1 for a per-token cache (no group rules) */
    int32_t unit;      /* lcm(P, G) = max(P, G): prefix hits and registered pages are
                        * whole units, so never part of a K group; P for a per-token cache */
    /* pages */
    kvc__page *pages;
    int32_t *tokens;     /* num_pages * ps token ids (prefix caching only) */
    int32_t *free_stack; /* num_pages */
    int64_t n_free;
    int32_t lru_head, lru_tail; /* head evicted first */
    int64_t n_lru;
    int64_t n_used;
    int32_t *buckets; /* hash index heads, n_buckets (power of two) */
    uint64_t bucket_mask;
    uint64_t hash_mask; /* ~0; tests narrow it to force collisions */
    int64_t n_indexed;
    int rescan; /* a page with dep set left the index: chains to resolve again */
    /* sequences, sorted by id */
    kvc__seq **seqs;
    int64_t n_seqs, seqs_cap;
    kvc_seq_id next_id;
    kvc_cache_stats st;
    kvc_cache_evict_fn evict_fn; /* kvc_cache_set_evict_hook */
    void *evict_user;
};

void *kvc__cache_alloc(kvc_cache *c, size_t size);
void kvc__cache_free(kvc_cache *c, void *p);

/* Chain hash of a page: over the parent's hash (or the salt seed for the
 * first page) and the page's token ids. */
uint64_t kvc__chain_seed(uint64_t salt);
uint64_t kvc__chain_hash(const kvc_cache *c, uint64_t parent_hash, const int32_t *tokens,
                         int32_t n);

/* Compressed formats with G > P: a K group spans R = G / P pages and every
 * page's bytes depend on all of the group's tokens (its K parameters), so a
 * page's identity is its tokens and its whole group's: hash = chain_hash(
 * parent_hash ^ unit, tokens) with unit this hash of the R pages' tokens
 * (ids + r * P, or when ids is NULL c->tokens of pages[r]). 0 otherwise. */
uint64_t kvc__unit_hash(const kvc_cache *c, const int32_t *ids, const int32_t *pages);

/* Test hook: keeps only the hash bits in mask (e.g. 0 makes every page
 * collide), so that hits must be confirmed by tokens, parent and salt.
 * Only on a cache with no sequences yet. */
void kvc__cache_set_hash_mask(kvc_cache *c, uint64_t mask);

static inline int64_t kvc__pack(int32_t page, uint32_t gen) {
    return (int64_t)(((uint64_t)(uint32_t)page << 32) | gen);
}
static inline int32_t kvc__packed_page(int64_t v) { return (int32_t)((uint64_t)v >> 32); }
static inline uint32_t kvc__packed_gen(int64_t v) { return (uint32_t)((uint64_t)v & 0xffffffffu); }
/* Whether packed names a page still in the index with the same identity. */
int kvc__chain_valid(const kvc_cache *c, int64_t packed);

/* Index: finds the page for (hash, parent, salt, tokens), or KVC__NO_PAGE. */
int32_t kvc__index_find(const kvc_cache *c, uint64_t hash, int64_t parent, uint64_t salt,
                        const int32_t *tokens);
void kvc__index_insert(kvc_cache *c, int32_t page, uint64_t hash, uint64_t parent_hash,
                       int64_t parent, uint64_t salt, uint64_t unit);
void kvc__index_remove(kvc_cache *c, int32_t page);

void kvc__lru_remove(kvc_cache *c, int32_t page);
void kvc__lru_push_tail(kvc_cache *c, int32_t page);

/* Pages obtainable now (free + cached). */
static inline int64_t kvc__available(const kvc_cache *c) { return c->n_free + c->n_lru; }
/* Takes a free page, else evicts the least recently used cached page;
 * returns it with ref 1. The caller checked availability. */
int32_t kvc__take_page(kvc_cache *c);
/* Adds a reference to a page (a cached page leaves the LRU list). */
void kvc__ref_page(kvc_cache *c, int32_t page);
/* Drops a reference; at 0 the page becomes cached (in the index) or free. */
void kvc__unref_page(kvc_cache *c, int32_t page);
/* Copies storage (every layer, data and scales) and token ids of a page. */
void kvc__copy_page(kvc_cache *c, int32_t dst, int32_t src);

/* Compressed formats (kvfmt_cache.c). A new sequence's tails (num_layers
 * of them): a copy of src's, or zeros when src is NULL; NULL when out of
 * memory. Only for a compressed cache (a per-token cache's sequences have
 * no tails). */
uint16_t *kvc__tails_alloc(kvc_cache *c, const uint16_t *src);
/* Sink rows (kvfmt_cache.c): kvc__sink_reserve makes sure the next
 * kvc__sink_attach cannot fail (KVC_ERR_NOMEM otherwise); attach gives page
 * p zeroed sink rows; kvc__sink_drop releases p's. No-ops without sinks. */
kvc_status kvc__sink_reserve(kvc_cache *c, const char *fn);
void kvc__sink_attach(kvc_cache *c, int32_t page);
void kvc__sink_drop(kvc_cache *c, int32_t page);
static inline size_t kvc__sinks_bytes(const kvc_cache *c) {
    return c->sink_bytes * (size_t)c->p.num_layers;
}
/* Bytes of a sequence's tails (all layers). */
static inline size_t kvc__tails_bytes(const kvc_cache *c) {
    return c->tail_bytes * (size_t)c->p.num_layers;
}
/* A prefix hit of `pages` leading pages cut to whole units (K groups). */
static inline int64_t kvc__round_hit(const kvc_cache *c, int64_t pages) {
    const int64_t per = c->unit / c->ps;
    return pages / per * per;
}

/* Finds a sequence (NULL if unknown) and its position in c->seqs. */
kvc__seq *kvc__find_seq(const kvc_cache *c, kvc_seq_id id, int64_t *pos);

#endif
