/* Shared by the store's files (not exported). */
#ifndef KVC_STORE_INTERNAL_H
#define KVC_STORE_INTERNAL_H

#include "kvcache/store.h"
#include "tier.h"

/* XXH3-128 of a || b in canonical bytes (hash.c: SSE2 or AVX2 by
 * kvc_get_isa; the _base and _avx2 variants directly, for tests). */
void kvc__store_hash128(const void *a, size_t na, const void *b, size_t nb, kvc_store_key *out);
void kvc__store_hash128_base(const void *a, size_t na, const void *b, size_t nb,
                             kvc_store_key *out);
void kvc__store_hash128_avx2(const void *a, size_t na, const void *b, size_t nb,
                             kvc_store_key *out);
uint64_t kvc__store_hash64(const void *a, size_t na, uint64_t seed);

/* Pages per prefix unit of cache: G / P for a compressed format whose K
 * groups span pages, else 1 (kvc_store_page_keys). */
int32_t kvc__store_unit_pages(const kvc_cache *cache);
/* Bytes of the object of the page at position (a first page of a format
 * with sink rows carries them: docs/KV_STORE.md section 3). */
size_t kvc__store_object_size(const kvc_cache *cache, int64_t position, int auth);
/* Writes a verified object's payload into page page_id: its sink rows
 * first when it carries them, then the page (nothing when the first fails). */
kvc_status kvc__store_apply_payload(kvc_cache *cache, int32_t page_id, const void *obj);
/* kvc_store_put taking ownership of obj (malloc'd; freed on every path),
 * for the tiers of mask tiers (bit t: tier t). */
kvc_status kvc__store_put_owned(kvc_store *s, const kvc_store_key *ns, const kvc_store_key *key,
                                void *obj, size_t size, uint32_t tiers);
/* Tier masks: every tier; the tiers whose write policy is p (a tier's URL
 * option write=, else kvc_store_params.write_policy). */
uint32_t kvc__store_all_tiers(const kvc_store *s);
uint32_t kvc__store_tiers_by_policy(const kvc_store *s, kvc_store_write_policy p);
/* Tier t's prefix hits before a SELECTIVE write. */
int32_t kvc__store_tier_hits(const kvc_store *s, int32_t t);
/* The store's auth key or NULL. */
const uint8_t *kvc__store_auth_key(const kvc_store *s);
const kvc_store_params *kvc__store_params(const kvc_store *s);
/* Tier t's kind ("dir", "redis"), NULL when t is not a tier. */
const char *kvc__store_tier_kind(const kvc_store *s, int32_t t);
/* How many of pages [first_page, first_page + max_pages) of tokens the
 * tiers hold as a run (keys probed, nothing verified). */
kvc_status kvc__store_probe_run(kvc_store *s, const kvc_store_key *ns, const int32_t *tokens,
                                int32_t page_size, int32_t unit_pages, int64_t first_page,
                                int64_t max_pages, int64_t *n_pages);
/* Calls the event callback, if any, with ev. */
void kvc__store_emit(kvc_store *s, const kvc_store_event *ev);
/* Clears the event callback if it is still (fn, user): a publisher closing
 * after another replaced it leaves the other's in place. Returns when no
 * call of (fn, user) is running. */
void kvc__store_clear_event_callback(kvc_store *s, kvc_store_event_fn fn, void *user);
/* kvc__store_emit of an event of kind about one page (key, parent and
 * tokens may be NULL: absent from the event). */
void kvc__store_emit_page(kvc_store *s, kvc_store_event_kind kind, int32_t tier,
                          const kvc_store_key *ns, const kvc_store_key *key,
                          const kvc_store_key *parent, const int32_t *tokens, int32_t n_tokens);
/* Serializes page page_id of cache as e describes and queues it for the
 * tiers of mask tiers; a failure is counted as a dropped write. */
kvc_status kvc__store_save_page(kvc_store *s, const kvc_cache *cache, int32_t page_id,
                                const kvc_store_expect *e, uint32_t tiers);
/* The parent key and token ids (*ids malloc'd) of an object that parses as
 * a page object far enough to hold them; 0 (nothing allocated) otherwise. */
int32_t kvc__store_object_ids(const void *obj, size_t size, kvc_store_key *parent,
                              int32_t **ids);
/* The store's list of engine attachments (attach.c's), by engine: each is
 * freed when detached or at kvc_store_close. take unlists and returns the
 * newest attachment of engine other than skip (NULL: none). */
typedef struct kvc__store_attached {
    const void *engine;
    void *a;
} kvc__store_attached;
kvc_status kvc__store_attach_add(kvc_store *s, const void *engine, void *a);
void *kvc__store_attach_take(kvc_store *s, const void *engine, const void *skip);
/* A background load for an engine (attach.c): reads and verifies pages
 * [first, first + n) of tokens on its own thread, tiers in order, keeping
 * the objects. start: NULL when it cannot start (nothing to undo). poll:
 * 1 once done (*n_ready: the verified run), waiting for it when wait.
 * finish: stops it if running, writes the verified pages [skip, skip + n)
 * of the run into page_ids (cache NULL: none) and frees it. */
typedef struct kvc__store_load kvc__store_load;
kvc__store_load *kvc__store_load_start(kvc_store *s, const kvc_cache *cache,
                                       const kvc_store_key *ns, const int32_t *tokens,
                                       int64_t first, int64_t n);
int kvc__store_load_poll(kvc__store_load *l, int wait, int64_t *n_ready);
void kvc__store_load_finish(kvc__store_load *l, kvc_cache *cache, int64_t skip,
                            const int32_t *page_ids, int64_t n);
/* The load's token ids (its copy, pages [0, first + n)) and *first. */
const int32_t *kvc__store_load_tokens(const kvc__store_load *l, int64_t *first);
/* Frees what kvc_store_attach_engine made (at detach or close). */
void kvc__store_attach_free(void *a);

#endif
