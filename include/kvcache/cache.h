/*
 * Cache manager: a pool of KV pages shared by all layers, sequences that own
 * page tables, copy-on-write forks, and prefix caching (seed 004; vLLM/SGLang
 * style block manager).
 *
 * Storage is allocated once, 64-byte aligned, as
 *   data  (num_layers, num_pages, 2, page_size, H, Dh)   NHD
 *         (num_layers, num_pages, 2, H, page_size, Dh)   HND
 *   scale same with last dim Dh / quant_group            int8/int4 only
 * so layer l is a FlashInfer combined paged cache (kvc_cache_layer) and one
 * page id names the same slots in every layer. The manager only reserves
 * slots and keeps page tables; callers write K/V with
 * kvc_append_paged_kv_cache (or the pmx operators) and read it with
 * attention, using the page tables below.
 *
 * Sequences: add_sequence reserves slots for a prompt (reusing cached full
 * pages of an identical prefix, never the whole prompt: at most the full
 * pages within its first len - 1 tokens), append reserves more (a new page
 * only when the last one is full), fork shares every page (the partly
 * filled last page is copied when one side first writes to it), truncate
 * keeps a prefix, free releases. A page's reference count is the number of
 * sequences whose table holds it.
 *
 * Prefix caching: a page, once full, is identified by a hash chained over
 * its parent page's hash, its token ids and the sequence's salt; token ids
 * are kept and compared on a hit. Unreferenced pages keep their contents and
 * stay findable until reused. Eviction takes the least recently used
 * unreferenced cached page, and among pages released together the deepest
 * (latest in its sequence) first. Referenced pages are never evicted.
 *
 * Errors: every call validates first; a call that fails (KVC_ERR_NO_SPACE
 * when pages run out, KVC_ERR_NOT_FOUND for an unknown or freed sequence,
 * KVC_ERR_INVALID_ARG, KVC_ERR_NOMEM) changes nothing. Not thread-safe: one
 * caller at a time per cache.
 */
#ifndef KVCACHE_CACHE_H
#define KVCACHE_CACHE_H

#include "kvcache/core.h"
#include "kvcache/kvfmt.h"
#include "kvcache/paged.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvc_cache kvc_cache;
typedef int64_t kvc_seq_id; /* >= 0; never reused within one cache */

/* Allocation hooks (tests inject failures through them). NULL = the C
 * library's aligned_alloc; on Linux a page pool of 8 MiB or more is then
 * 2 MiB-aligned and offered to transparent huge pages (madvise
 * MADV_HUGEPAGE, a hint), which spares a decode step most of its TLB misses
 * at long contexts. */
typedef struct kvc_allocator {
    void *(*alloc)(size_t size, size_t align, void *user); /* NULL on failure */
    void (*free)(void *ptr, void *user);
    void *user;
} kvc_allocator;

typedef struct kvc_cache_params {
    int32_t num_layers;     /* >= 1 */
    int32_t num_kv_heads;   /* H >= 1 */
    int32_t head_dim;       /* Dh >= 1 (even for int4) */
    int32_t page_size;      /* tokens per page, >= 1 */
    int64_t num_pages;      /* > 0, or 0 to derive it from max_bytes */
    int64_t max_bytes;      /* storage budget when num_pages == 0 */
    kvc_dtype dtype;        /* KVC_F32, KVC_F16, KVC_BF16, KVC_I8, KVC_I4 */
    kvc_dtype scale_dtype;  /* int8/int4: KVC_F32 or KVC_F16 (default KVC_F16) */
    int32_t quant_group;    /* int8/int4: divides Dh, even for int4 (default 8) */
    kvc_kv_layout layout;   /* KVC_NHD (default) or KVC_HND */
    kvc_allocator allocator;
    int32_t enable_prefix_caching; /* 1 (default) or 0 */
    /* KVC_KVFMT_NONE (default): a per-token cache of dtype. A compressed
     * format (kvfmt.h) instead: dtype, scale_dtype, quant_group and layout
     * are ignored; storage is (num_layers, num_pages, page_bytes) and each
     * sequence carries a float16 tail per layer (below). */
    kvc_kv_format kv_format;
} kvc_cache_params;

KVC_API kvc_cache_params kvc_cache_default_params(void);

KVC_API kvc_status kvc_cache_create(const kvc_cache_params *params, kvc_cache **out);
KVC_API void kvc_cache_destroy(kvc_cache *cache); /* NULL is a no-op */

/* Bytes of storage (data + scales, all layers) per token slot; for a
 * compressed format num_layers * page_bytes / page_size (tails excluded).
 * These size accessors (and kvc_cache_page_bytes, kvc_cache_sink_bytes)
 * return 0 for a NULL cache. */
KVC_API size_t kvc_cache_bytes_per_token(const kvc_cache *cache);
/* num_pages * page_size. */
KVC_API int64_t kvc_cache_capacity_tokens(const kvc_cache *cache);
KVC_API int64_t kvc_cache_num_pages(const kvc_cache *cache);

/* Layer l's storage as a paged cache (views into the manager's buffer,
 * valid until kvc_cache_destroy): k/v of (num_pages, page_size, H, Dh) NHD
 * or (num_pages, H, page_size, Dh) HND; scales for int8/int4. */
KVC_API kvc_status kvc_cache_layer(const kvc_cache *cache, int32_t layer, kvc_paged_cache *out);

/* The combined 5-D tensor (num_pages, 2, ...) of layer l and, for int8/int4,
 * its scale tensor (scale may be NULL). */
KVC_API kvc_status kvc_cache_layer_tensors(const kvc_cache *cache, int32_t layer,
                                           kvc_tensor *kv, kvc_tensor *scale);

/*
 * New sequence holding n_tokens tokens (token_ids may be NULL when prefix
 * caching is off or not wanted: then nothing is looked up or registered).
 * Reserves slots for all of them; *seq receives its id and *n_cached (if
 * n_cached is not NULL) how many leading tokens
 * were found in the prefix cache (whole pages, < n_tokens), whose K/V the
 * caller must not write again. salt separates tenants/adapters (0 = none).
 * n_tokens beyond the cache's whole capacity is KVC_ERR_INVALID_ARG (it can
 * never fit); beyond the free and cached pages, KVC_ERR_NO_SPACE.
 */
KVC_API kvc_status kvc_cache_add_sequence(kvc_cache *cache, const int32_t *token_ids,
                                          int64_t n_tokens, uint64_t salt, kvc_seq_id *seq,
                                          int64_t *n_cached);

/* How many leading tokens kvc_cache_add_sequence(token_ids, n_tokens, salt)
 * would find in the prefix cache now (whole pages, < n_tokens), without
 * reserving or touching anything (0 when prefix caching is off). A serving
 * engine probes before deciding how much of a prompt to reserve. */
KVC_API kvc_status kvc_cache_lookup_prefix(const kvc_cache *cache, const int32_t *token_ids,
                                           int64_t n_tokens, uint64_t salt, int64_t *n_cached);

/* Reserves n more slots (token_ids: their ids, or NULL) and writes their
 * positions (n) to positions if not NULL. A shared, partly filled last page
 * is copied first (copy-on-write), data and scales of every layer. Pages it
 * fills become findable when all their token ids are known; with token_ids
 * NULL the sequence stops being hashable from that page on (until a
 * truncate below it). A length (current + n) beyond the cache's whole
 * capacity is KVC_ERR_INVALID_ARG (it can never fit); beyond the free and
 * cached pages, KVC_ERR_NO_SPACE. */
KVC_API kvc_status kvc_cache_append(kvc_cache *cache, kvc_seq_id seq, const int32_t *token_ids,
                                    int64_t n, int32_t *positions);

/* New sequence sharing every page of seq. */
KVC_API kvc_status kvc_cache_fork(kvc_cache *cache, kvc_seq_id seq, kvc_seq_id *child);

/* Keeps the first n_tokens (0 <= n_tokens <= length). Never allocates:
 * dropped pages lose this sequence's reference (deepest first into the LRU
 * list); a kept last page that becomes partly filled leaves the prefix index
 * if unshared, else is copied by the next append. */
KVC_API kvc_status kvc_cache_truncate(kvc_cache *cache, kvc_seq_id seq, int64_t n_tokens);

/* kvc_cache_truncate for slots that were reserved but whose K/V were never
 * written (a step that did not run: a request preempted or cancelled after
 * its append). Pages are findable from the moment their slots are reserved,
 * so truncate would leave such a page cached and findable without its K/V;
 * here the dropped pages this sequence holds alone leave the index first
 * (pages held by others too were written by them, or will be). */
KVC_API kvc_status kvc_cache_rollback(kvc_cache *cache, kvc_seq_id seq, int64_t n_tokens);

/* Releases the sequence; its full pages stay findable while cached. */
KVC_API kvc_status kvc_cache_free_sequence(kvc_cache *cache, kvc_seq_id seq);

KVC_API kvc_status kvc_cache_seq_len(const kvc_cache *cache, kvc_seq_id seq, int64_t *n_tokens);

/*
 * CSR page table of a batch (int32): kv_indptr (n_seqs + 1),
 * kv_indices (capacity >= total pages; *n_indices receives the total),
 * kv_last_page_len (n_seqs). If capacity is too small: KVC_ERR_INVALID_ARG,
 * *n_indices (if not NULL) receives the total needed, nothing else written.
 */
KVC_API kvc_status kvc_cache_page_table(const kvc_cache *cache, const kvc_seq_id *seqs,
                                        int64_t n_seqs, int32_t *kv_indptr, int32_t *kv_indices,
                                        int64_t capacity, int32_t *kv_last_page_len,
                                        int64_t *n_indices);

/* pmx page-mode table: cachestarts (n_seqs, max_pages) int64, page start
 * slot (page id * page_size) or -1; max_pages >= pages of every sequence. */
KVC_API kvc_status kvc_cache_cachestarts(const kvc_cache *cache, const kvc_seq_id *seqs,
                                         int64_t n_seqs, int64_t *cachestarts,
                                         int64_t max_pages);

/* ---- compressed formats (kv_format != KVC_KVFMT_NONE) -------------------
 *
 * Rules beyond the ones above (docs/KV_FORMATS.md section 5):
 *  - each sequence owns a tail per layer, float16 (2, G, H, Dh), allocated
 *    with it (kvc_kvfmt_tail_bytes each, counted apart from page storage);
 *    fork copies it;
 *  - a prefix hit reuses whole K groups: the usual hit rounded down to a
 *    multiple of G and of P (lookup_prefix reports the same); a page
 *    becomes findable once every K group it holds is complete (its slots
 *    reserved), and with G > P the pages of one group are found (and
 *    deduplicated) only together, since each depends on the whole group;
 *  - pages of a sequence's incomplete group are never shared when written:
 *    append gives a sequence its own copy of a shared page at or after
 *    position floor(len / G) * G (copy-on-write, as the partly filled last
 *    page of a per-token cache);
 *  - kvc_cache_truncate to a length inside a quantized group (below
 *    floor(len / G) * G and not a multiple of G) fails: the group's values
 *    are gone; kvc_cache_truncate_ex keeps the whole groups before the cut
 *    and reports the length kept. kvc_cache_rollback (slots never written)
 *    keeps exactly n_tokens: the cut group was never completed, and its
 *    kept pages this sequence holds alone leave the prefix index. A cut
 *    within the tail keeps the tail's bytes (slot t % G holds position t);
 *    free releases the tails.
 * kvc_cache_layer and kvc_cache_layer_tensors fail on such a cache (the
 * pages are not a FlashInfer cache); kvc_cache_page_table and
 * kvc_cache_cachestarts work as for any cache. */

/* The cache's format (KVC_ERR_INVALID_ARG for a per-token cache). */
KVC_API kvc_status kvc_cache_kvfmt(const kvc_cache *cache, kvc_kvfmt *out);

/* Layer l's pages: uint8 (num_pages, page_bytes), a view valid until
 * kvc_cache_destroy. */
KVC_API kvc_status kvc_cache_kvfmt_layer(const kvc_cache *cache, int32_t layer,
                                         kvc_tensor *pages);

/* The sequences as the kernels of kvfmt.h see them in layer l: page table,
 * length (slots reserved) and tail. Views valid until the next call that
 * changes one of them (append, fork, truncate, rollback, free). */
KVC_API kvc_status kvc_cache_kvfmt_seqs(const kvc_cache *cache, int32_t layer,
                                        const kvc_seq_id *seqs, int64_t n_seqs,
                                        kvc_kvfmt_seq *out);

/* kvc_cache_truncate keeping at most n_tokens: in a compressed-format
 * cache a cut inside a quantized group keeps only the whole groups before
 * it (the caller recomputes and appends the rest); *n_kept (may be NULL)
 * receives the length kept. Same as kvc_cache_truncate otherwise. */
KVC_API kvc_status kvc_cache_truncate_ex(kvc_cache *cache, kvc_seq_id seq, int64_t n_tokens,
                                         int64_t *n_kept);

/* ---- page contents (the KV store, store.h) --------------------------------
 * A page's K/V in every layer as one run of bytes: for each layer in order,
 * its data block (page_size tokens of K then V in the cache's layout, or a
 * compressed format's page) and, for int8/int4, its scale block. */

/* The parameters the cache was created with (num_pages as derived). */
KVC_API kvc_status kvc_cache_get_params(const kvc_cache *cache, kvc_cache_params *out);

/* Bytes of one page over all layers (what read/write_page move). */
KVC_API size_t kvc_cache_page_bytes(const kvc_cache *cache);

/* Copies page page_id's bytes to dst (size == kvc_cache_page_bytes). */
KVC_API kvc_status kvc_cache_read_page(const kvc_cache *cache, int32_t page_id, void *dst,
                                       size_t size);

/* Overwrites page page_id's bytes with src (size == kvc_cache_page_bytes).
 * Only a page held by exactly one sequence may be written (one just
 * reserved for K/V the caller restores), else KVC_ERR_INVALID_ARG. */
KVC_API kvc_status kvc_cache_write_page(kvc_cache *cache, int32_t page_id, const void *src,
                                        size_t size);

/* A format with sink rows (kivi4: position 0 kept in float16, kvfmt.h)
 * keeps them with each sequence's first page: kvc_cache_sink_bytes is their
 * size over all layers ((num_layers, 2, S, H, Dh) float16; 0 for a cache
 * without them). read_sink and write_sink move them for page page_id, which
 * must hold them (a sequence's first page, or a cached one that was),
 * else KVC_ERR_INVALID_ARG; write_sink, like write_page, only into a page
 * held by exactly one sequence. */
KVC_API size_t kvc_cache_sink_bytes(const kvc_cache *cache);
KVC_API kvc_status kvc_cache_read_sink(const kvc_cache *cache, int32_t page_id, void *dst,
                                       size_t size);
KVC_API kvc_status kvc_cache_write_sink(kvc_cache *cache, int32_t page_id, const void *src,
                                        size_t size);

/* Called when an unreferenced cached page is about to be reused (evicted),
 * its contents and token ids still intact; it must not call the cache
 * except kvc_cache_read_page, kvc_cache_read_sink and kvc_cache_page_tokens. */
typedef void (*kvc_cache_evict_fn)(void *user, const kvc_cache *cache, int32_t page_id);
/* Sets (fn NULL: clears) the eviction hook. */
KVC_API kvc_status kvc_cache_set_evict_hook(kvc_cache *cache, kvc_cache_evict_fn fn, void *user);

/* The token ids of a page in the prefix index (page_size of them) into
 * tokens; KVC_ERR_NOT_FOUND when the page is not findable (not full, never
 * registered, or prefix caching off). */
KVC_API kvc_status kvc_cache_page_tokens(const kvc_cache *cache, int32_t page_id,
                                         int32_t *tokens);

typedef struct kvc_cache_stats {
    int64_t free_pages;   /* never used, or evicted: no contents */
    int64_t cached_pages; /* unreferenced, contents kept, findable */
    int64_t used_pages;   /* referenced by at least one sequence */
    int64_t hit_tokens;   /* prompt tokens served from the prefix cache */
    int64_t miss_tokens;  /* prompt tokens that were not */
    int64_t evictions;    /* cached pages reused */
    int64_t cow_copies;   /* pages copied on write */
    int64_t failed_allocs; /* calls that failed with KVC_ERR_NO_SPACE */
} kvc_cache_stats;

KVC_API kvc_status kvc_cache_get_stats(const kvc_cache *cache, kvc_cache_stats *out);

/* Verifies every invariant (reference counts, free/LRU lists, hash index,
 * page tables); KVC_ERR_CORRUPT with a message naming the first broken one. */
KVC_API kvc_status kvc_cache_check(const kvc_cache *cache);

#ifdef __cplusplus
}
#endif
#endif
