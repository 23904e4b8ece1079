/*
 * The store as an engine's connector (model.h): probe and restore at
 * admission, saves by each tier's write policy. Write-back and selective writes
 * need to know a page's key when the engine no longer names it (eviction,
 * a prefix hit): a table by page id remembers the key, parent, position
 * and token ids of every page this engine saw final or restored, checked
 * against the cache's own token ids before a page is saved.
 */
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "store_internal.h"


typedef struct slot {
    kvc_store_key key, parent;
    int64_t position;
    int32_t hits;
    uint32_t saved; /* tiers the page was queued for */
    uint8_t valid;
} slot;

typedef struct attach {
    kvc_store *s;
    kvc_store_key ns;
    int32_t P, U; /* page size; pages per unit (kvc_store_page_keys) */
    uint32_t through, back, selective; /* tiers by write policy */
    slot *slots;     /* num_pages (write-back and selective) */
    int32_t *tokens; /* num_pages * P */
    int64_t num_pages;
    int32_t *tmp;    /* P ids */
} attach;

void kvc__store_attach_free(void *p) {
    attach *a = p;
    if (!a) return;
    free(a->slots);
    free(a->tokens);
    free(a->tmp);
    free(a);
}

static kvc_status probe(void *user, const kvc_cache *cache, const int32_t *tokens,
                        int64_t first, int64_t max, int64_t *n) {
    (void)cache;
    attach *a = user;
    return kvc__store_probe_run(a->s, &a->ns, tokens, a->P, a->U, first, max, n);
}

static void *load_start(void *user, const kvc_cache *cache, const int32_t *tokens,
                        int64_t first, int64_t n) {
    attach *a = user;
    return kvc__store_load_start(a->s, cache, &a->ns, tokens, first, n);
}

static int load_poll(void *user, void *load, int wait, int64_t *n_ready) {
    (void)user;
    return kvc__store_load_poll(load, wait, n_ready);
}

/* The expectation (what the object must say) of page id's slot. */
static kvc_store_expect slot_expect(const attach *a, int32_t id) {
    kvc_store_expect e;
    e.ns = a->ns;
    e.key = a->slots[id].key;
    e.parent = a->slots[id].parent;
    e.position = a->slots[id].position;
    e.tokens = a->tokens + (int64_t)id * a->P;
    return e;
}

/* Queues page id as its slot describes for the tiers of mask tiers. */
static void queue_slot(attach *a, const kvc_cache *cache, int32_t id, uint32_t tiers) {
    const kvc_store_expect e = slot_expect(a, id);
    a->slots[id].saved |= tiers; /* once: a failure is counted as a dropped write */
    if (kvc__store_save_page(a->s, cache, id, &e, tiers) != KVC_OK) kvc_clear_error();
}

/* Saves page id from its slot for the tiers of mask tiers not yet given it,
 * if the cache still holds the slot's tokens. */
static void save_slot(attach *a, const kvc_cache *cache, int32_t id, uint32_t tiers) {
    slot *sl = &a->slots[id];
    tiers &= ~sl->saved;
    if (!sl->valid || !tiers) return;
    if (kvc_cache_page_tokens(cache, id, a->tmp) != KVC_OK ||
        memcmp(a->tmp, a->tokens + (int64_t)id * a->P, (size_t)a->P * sizeof(int32_t)) != 0) {
        kvc_clear_error();
        sl->valid = 0; /* reused since: not the page the slot describes */
        return;
    }
    queue_slot(a, cache, id, tiers);
}

/* Records pages [first, first + n) of tokens (in page_ids) in their slots
 * (keys computed once, for the slot, the event and a write-through), then
 * tells listeners the cache holds them; a write-through is queued after that
 * event, so subscribers hear of a page in the cache before the writer's
 * event of it in a tier. Restored pages are recorded as saved to every tier
 * (the policies never write them back) but are in the cache like the others:
 * reported now, and their eviction later. */
static void record_pages(attach *a, const kvc_cache *cache, const int32_t *tokens, int64_t first,
                         int64_t n, const int32_t *page_ids, int restored) {
    if (n <= 0) return;
    kvc_store_key *k = malloc((size_t)(first + n) * sizeof *k);
    if (!k || kvc_store_page_keys(&a->ns, tokens, first + n, a->P, a->U, k) != KVC_OK) {
        free(k);
        kvc_clear_error();
        return; /* out of memory: these pages go unsaved (a later miss) */
    }
    for (int64_t i = 0; i < n; i++) {
        const int32_t id = page_ids[i];
        if (id < 0 || id >= a->num_pages) continue;
        slot *sl = &a->slots[id];
        const int64_t pg = first + i;
        sl->key = k[pg];
        sl->parent = pg > 0 ? k[pg - 1] : a->ns;
        sl->position = pg * a->P;
        sl->hits = 0;
        sl->valid = 1;
        sl->saved = restored ? ~0u : 0;
        memcpy(a->tokens + (int64_t)id * a->P, tokens + pg * a->P,
               (size_t)a->P * sizeof(int32_t));
        kvc__store_emit_page(a->s, KVC_STORE_EVENT_STORED, KVC_STORE_TIER_CACHE, &a->ns,
                             &sl->key, &sl->parent, tokens + pg * a->P, a->P);
        if (a->through && !restored) queue_slot(a, cache, id, a->through);
    }
    free(k);
}

static void on_final(void *user, const kvc_cache *cache, const int32_t *tokens, int64_t first,
                     int64_t n, const int32_t *page_ids) {
    record_pages(user, cache, tokens, first, n, page_ids, 0);
}

/* Pages written into the engine's cache are recorded (record_pages) in
 * whole units: the engine computes a unit's pages written past the last
 * whole one again. */
static kvc_status restore(void *user, kvc_cache *cache, const int32_t *tokens, int64_t first,
                          int64_t n, const int32_t *page_ids, int64_t *n_restored) {
    attach *a = user;
    kvc_status st =
        kvc_store_restore_run(a->s, cache, &a->ns, tokens, first, n, page_ids, n_restored);
    if (st == KVC_OK) record_pages(a, cache, tokens, first, *n_restored / a->U * a->U, page_ids, 1);
    return st;
}

static void load_finish(void *user, void *load, kvc_cache *cache, int64_t skip,
                        const int32_t *page_ids, int64_t n) {
    attach *a = user;
    int64_t first = 0, ready = 0;
    /* recorded before the write, while the load holds the ids: the engine
     * gives it pages only once it is done, when the run it writes is known */
    if (load && cache && n > 0 && kvc__store_load_poll(load, 0, &ready)) {
        const int32_t *tokens = kvc__store_load_tokens(load, &first);
        const int64_t w = n < ready - skip ? n : ready - skip;
        record_pages(a, cache, tokens, first + skip, w / a->U * a->U, page_ids, 1);
    }
    kvc__store_load_finish(load, cache, skip, page_ids, n);
}

static void on_hit(void *user, const kvc_cache *cache, const int32_t *tokens, int64_t first,
                   int64_t n, const int32_t *page_ids) {
    (void)tokens, (void)first;
    attach *a = user;
    for (int64_t i = 0; i < n; i++) {
        const int32_t id = page_ids[i];
        if (id < 0 || id >= a->num_pages || !a->slots[id].valid) continue;
        const int32_t h = ++a->slots[id].hits;
        uint32_t due = 0; /* selective tiers whose count this hit reaches */
        for (int32_t t = 0; t < 32; t++)
            if ((a->selective >> t & 1u) && h >= kvc__store_tier_hits(a->s, t)) due |= 1u << t;
        save_slot(a, cache, id, due);
    }
}

static void on_evict(void *user, const kvc_cache *cache, int32_t id) {
    attach *a = user;
    if (id < 0 || id >= a->num_pages || !a->slots[id].valid) return;
    save_slot(a, cache, id, a->back);
    if (a->slots[id].valid) /* save_slot drops a slot whose page was reused since */
        kvc__store_emit_page(a->s, KVC_STORE_EVENT_REMOVED, KVC_STORE_TIER_CACHE, &a->ns,
                             &a->slots[id].key, &a->slots[id].parent, NULL, 0);
    a->slots[id].valid = 0; /* about to be reused */
}

/* REMOVED events for the pages of the cache a's slots name, when the store
 * stops following that cache (its events would otherwise leave subscribers
 * counting on pages nobody will report removed). */
static void report_removed(const attach *a) {
    for (int64_t id = 0; id < a->num_pages; id++)
        if (a->slots[id].valid)
            kvc__store_emit_page(a->s, KVC_STORE_EVENT_REMOVED, KVC_STORE_TIER_CACHE, &a->ns,
                                 &a->slots[id].key, &a->slots[id].parent, NULL, 0);
}

kvc_status kvc_store_attach_engine(kvc_store *s, kvc_engine *engine, const kvc_store_key *ns) {
    static const char fn[] = "kvc_store_attach_engine";
    KVC_CHECK(s != NULL && engine != NULL && ns != NULL, "%s: store, engine and ns must not be "
              "NULL", fn);
    const kvc_cache *cache = kvc_engine_cache(engine);
    kvc_cache_params cp;
    KVC_TRY(kvc_cache_get_params(cache, &cp));
    attach *a = calloc(1, sizeof *a);
    if (!a) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    a->s = s;
    a->ns = *ns;
    a->P = cp.page_size;
    a->U = kvc__store_unit_pages(cache);
    a->through = kvc__store_tiers_by_policy(s, KVC_STORE_WRITE_THROUGH);
    a->back = kvc__store_tiers_by_policy(s, KVC_STORE_WRITE_BACK);
    a->selective = kvc__store_tiers_by_policy(s, KVC_STORE_WRITE_SELECTIVE);
    a->num_pages = cp.num_pages;
    a->tmp = malloc((size_t)a->P * sizeof(int32_t));
    /* every policy: the slots also name evicted pages in events */
    a->slots = calloc((size_t)a->num_pages, sizeof *a->slots);
    a->tokens = malloc((size_t)a->num_pages * (size_t)a->P * sizeof(int32_t));
    if (!a->tmp || !a->slots || !a->tokens) {
        kvc__store_attach_free(a);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    }
    kvc_engine_connector c;
    memset(&c, 0, sizeof c);
    c.user = a;
    c.probe = probe;
    c.load_start = load_start;
    c.load_poll = load_poll;
    c.load_finish = load_finish;
    c.restore = restore;
    c.on_final = on_final;
    if (a->selective) c.on_hit = on_hit;
    c.on_evict = on_evict;
    kvc_status st = kvc__store_attach_add(s, engine, a);
    if (st != KVC_OK) { /* a is not listed: an older attachment stays as it is */
        kvc__store_attach_free(a);
        return st;
    }
    st = kvc_engine_set_connector(engine, &c);
    if (st != KVC_OK) { /* the engine and the store as they were */
        kvc__store_attach_take(s, engine, NULL); /* a: listed last, the newest */
        kvc__store_attach_free(a);
        return st;
    }
    /* An older attachment of this engine pointer: the same engine attached
     * again, or a destroyed one at the same address. It gets no more calls:
     * its pages are reported gone, as a router must not count on them. */
    attach *old = kvc__store_attach_take(s, engine, a);
    if (old) {
        report_removed(old);
        kvc__store_attach_free(old);
    }
    return KVC_OK;
}

kvc_status kvc_store_detach_engine(kvc_store *s, kvc_engine *engine) {
    static const char fn[] = "kvc_store_detach_engine";
    KVC_CHECK(s != NULL && engine != NULL, "%s: store and engine must not be NULL", fn);
    attach *a = kvc__store_attach_take(s, engine, NULL);
    KVC_CHECK(a != NULL, "%s: the engine is not attached to this store", fn);
    kvc_engine_connector c;
    /* the engine may have been given another connector since */
    if (kvc_engine_get_connector(engine, &c) == KVC_OK && c.user == a)
        kvc_engine_set_connector(engine, NULL); /* cannot fail: engine is not NULL */
    report_removed(a);
    kvc__store_attach_free(a);
    return KVC_OK;
}
