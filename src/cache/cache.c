/*
 * Cache manager: page pool, storage, hash index, LRU, page tables, stats and
 * the invariant check (sequence operations are in sequence.c).
 *
 * Costs: taking or releasing a page, an index insert/remove and an LRU move
 * are O(1) (index removal walks one bucket chain, about one entry since the
 * table has >= 2 buckets per page); finding a sequence is a binary search
 * over the sorted id array. Everything the pool needs is allocated at
 * create; later allocations are only sequence tables and the id array.
 */
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cache_internal.h"

/* ---- allocation ----------------------------------------------------------------------- */

/* The page pool on huge pages where it is large (kvc__alloc_large). */
static void *default_alloc(size_t size, size_t align, void *user) {
    (void)user;
    return kvc__alloc_large(size, align);
}

static void default_free(void *p, void *user) {
    (void)user;
    free(p);
}

void *kvc__cache_alloc(kvc_cache *c, size_t size) {
    return c->a.alloc(size ? size : 1, 64, c->a.user);
}

void kvc__cache_free(kvc_cache *c, void *p) {
    if (p) c->a.free(p, c->a.user);
}

/* ---- hashing ---------------------------------------------------------------------------- */

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t kvc__chain_seed(uint64_t salt) { return mix64(salt ^ 0x6b76636163686531ull); }

uint64_t kvc__chain_hash(const kvc_cache *c, uint64_t parent_hash, const int32_t *tokens,
                         int32_t n) {
    uint64_t h = mix64(parent_hash + 0x9e3779b97f4a7c15ull);
    int32_t i = 0;
    for (; i + 1 < n; i += 2) {
        uint64_t w = (uint64_t)(uint32_t)tokens[i] | ((uint64_t)(uint32_t)tokens[i + 1] << 32);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    if (i < n) h = (h ^ (uint32_t)tokens[i]) * 0x100000001b3ull;
    return mix64(h ^ (uint64_t)n) & c->hash_mask;
}

uint64_t kvc__unit_hash(const kvc_cache *c, const int32_t *ids, const int32_t *pages) {
    if (c->unit == c->ps) return 0;
    uint64_t u = 0x756e697468617368ull;
    for (int32_t r = 0; r < c->unit / c->ps; r++)
        u = kvc__chain_hash(c, u, ids ? ids + (int64_t)r * c->ps : c->tokens + (int64_t)pages[r] * c->ps,
                            c->ps);
    return u;
}

void kvc__cache_set_hash_mask(kvc_cache *c, uint64_t mask) { c->hash_mask = mask; }

int kvc__chain_valid(const kvc_cache *c, int64_t packed) {
    if (packed < 0) return 0;
    int32_t p = kvc__packed_page(packed);
    if (p < 0 || p >= c->num_pages) return 0;
    return c->pages[p].in_index && c->pages[p].gen == kvc__packed_gen(packed);
}

/* ---- hash index ------------------------------------------------------------------------- */

int32_t kvc__index_find(const kvc_cache *c, uint64_t hash, int64_t parent, uint64_t salt,
                        const int32_t *tokens) {
    for (int32_t p = c->buckets[hash & c->bucket_mask]; p != KVC__NO_PAGE;
         p = c->pages[p].hnext) {
        const kvc__page *pg = &c->pages[p];
        if (pg->hash == hash && pg->parent == parent && pg->salt == salt &&
            memcmp(c->tokens + (int64_t)p * c->ps, tokens, (size_t)c->ps * sizeof(int32_t)) == 0)
            return p;
    }
    return KVC__NO_PAGE;
}

void kvc__index_insert(kvc_cache *c, int32_t page, uint64_t hash, uint64_t parent_hash,
                       int64_t parent, uint64_t salt, uint64_t unit) {
    kvc__page *pg = &c->pages[page];
    pg->unit = unit;
    pg->hash = hash;
    pg->parent_hash = parent_hash;
    pg->parent = parent;
    pg->salt = salt;
    pg->in_index = 1;
    int32_t *head = &c->buckets[hash & c->bucket_mask];
    pg->hnext = *head;
    *head = page;
    c->n_indexed++;
}

void kvc__index_remove(kvc_cache *c, int32_t page) {
    kvc__page *pg = &c->pages[page];
    int32_t *link = &c->buckets[pg->hash & c->bucket_mask];
    while (*link != page) link = &c->pages[*link].hnext;
    *link = pg->hnext;
    pg->hnext = KVC__NO_PAGE;
    pg->in_index = 0;
    pg->gen++; /* children naming this page as parent no longer match */
    c->n_indexed--;
    if (pg->dep) { /* sequences holding an identical page lose their index entry */
        pg->dep = 0;
        c->rescan = 1;
    }
}

/* ---- LRU and free stack ------------------------------------------------------------------ */

void kvc__lru_remove(kvc_cache *c, int32_t page) {
    kvc__page *pg = &c->pages[page];
    if (pg->prev != KVC__NO_PAGE) c->pages[pg->prev].next = pg->next;
    else c->lru_head = pg->next;
    if (pg->next != KVC__NO_PAGE) c->pages[pg->next].prev = pg->prev;
    else c->lru_tail = pg->prev;
    pg->prev = pg->next = KVC__NO_PAGE;
    c->n_lru--;
}

void kvc__lru_push_tail(kvc_cache *c, int32_t page) {
    kvc__page *pg = &c->pages[page];
    pg->next = KVC__NO_PAGE;
    pg->prev = c->lru_tail;
    if (c->lru_tail != KVC__NO_PAGE) c->pages[c->lru_tail].next = page;
    else c->lru_head = page;
    c->lru_tail = page;
    c->n_lru++;
}

int32_t kvc__take_page(kvc_cache *c) {
    int32_t p;
    if (c->n_free > 0) {
        p = c->free_stack[--c->n_free];
    } else {
        p = c->lru_head;
        if (c->evict_fn) c->evict_fn(c->evict_user, c, p); /* contents still intact */
        kvc__lru_remove(c, p);
        kvc__index_remove(c, p);
        c->st.evictions++;
    }
    kvc__sink_drop(c, p); /* its contents are gone; a first page gets new ones */
    c->pages[p].ref = 1;
    c->n_used++;
    return p;
}

void kvc__ref_page(kvc_cache *c, int32_t page) {
    kvc__page *pg = &c->pages[page];
    if (pg->ref == 0) {
        kvc__lru_remove(c, page); /* only cached pages can be found with ref 0 */
        c->n_used++;
    }
    pg->ref++;
}

void kvc__unref_page(kvc_cache *c, int32_t page) {
    kvc__page *pg = &c->pages[page];
    if (--pg->ref > 0) return;
    c->n_used--;
    if (pg->in_index) {
        kvc__lru_push_tail(c, page);
    } else {
        kvc__sink_drop(c, page); /* nobody can find it again */
        c->free_stack[c->n_free++] = page;
    }
}

void kvc__copy_page(kvc_cache *c, int32_t dst, int32_t src) {
    for (int32_t l = 0; l < c->p.num_layers; l++) {
        unsigned char *base = c->data + (size_t)l * c->layer_data_bytes;
        memcpy(base + (size_t)dst * c->page_data_bytes, base + (size_t)src * c->page_data_bytes,
               c->page_data_bytes);
        if (c->scale) {
            unsigned char *sb = c->scale + (size_t)l * c->layer_scale_bytes;
            memcpy(sb + (size_t)dst * c->page_scale_bytes,
                   sb + (size_t)src * c->page_scale_bytes, c->page_scale_bytes);
        }
    }
    if (c->tokens)
        memcpy(c->tokens + (int64_t)dst * c->ps, c->tokens + (int64_t)src * c->ps,
               (size_t)c->ps * sizeof(int32_t));
    if (c->sinks && c->sinks[src]) { /* a first page: its sink rows go with it */
        kvc__sink_attach(c, dst);
        memcpy(c->sinks[dst], c->sinks[src], kvc__sinks_bytes(c));
    }
    c->st.cow_copies++;
}

kvc__seq *kvc__find_seq(const kvc_cache *c, kvc_seq_id id, int64_t *pos) {
    int64_t lo = 0, hi = c->n_seqs;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (c->seqs[mid]->id < id) lo = mid + 1;
        else hi = mid;
    }
    if (pos) *pos = lo;
    if (lo < c->n_seqs && c->seqs[lo]->id == id) return c->seqs[lo];
    return NULL;
}

/* ---- create / destroy ---------------------------------------------------------------------- */

kvc_cache_params kvc_cache_default_params(void) {
    kvc_cache_params p;
    memset(&p, 0, sizeof p);
    p.page_size = 16;
    p.dtype = KVC_F16;
    p.scale_dtype = KVC_F16;
    p.quant_group = 8;
    p.layout = KVC_NHD;
    p.enable_prefix_caching = 1;
    return p;
}

static int is_quant(kvc_dtype dt) { return dt == KVC_I8 || dt == KVC_I4; }

kvc_status kvc_cache_create(const kvc_cache_params *params, kvc_cache **out) {
    static const char fn[] = "kvc_cache_create";
    if (out) *out = NULL; /* what a failure leaves */
    KVC_CHECK(params != NULL && out != NULL, "%s: params and out must not be NULL", fn);
    KVC_TRY(kvc_isa_env_check());
    const kvc_cache_params *p = params;
    KVC_CHECK(p->num_layers >= 1, "%s: num_layers must be >= 1, got %d", fn, (int)p->num_layers);
    KVC_CHECK(p->num_kv_heads >= 1, "%s: num_kv_heads must be >= 1, got %d", fn,
              (int)p->num_kv_heads);
    KVC_CHECK(p->head_dim >= 1, "%s: head_dim must be >= 1, got %d", fn, (int)p->head_dim);
    KVC_CHECK(p->page_size >= 1, "%s: page_size must be >= 1, got %d", fn, (int)p->page_size);
    KVC_CHECK((int)p->kv_format >= 0 && p->kv_format < KVC_KVFMT_COUNT,
              "%s: kv_format %d is not a KV format (none %d, kivi8 %d, kivi4 %d)", fn,
              (int)p->kv_format, (int)KVC_KVFMT_NONE, (int)KVC_KVFMT_KIVI8,
              (int)KVC_KVFMT_KIVI4);
    const int kvfmt = p->kv_format != KVC_KVFMT_NONE;
    KVC_CHECK(p->enable_prefix_caching == 0 || p->enable_prefix_caching == 1,
              "%s: enable_prefix_caching must be 0 or 1, got %d", fn,
              (int)p->enable_prefix_caching);
    KVC_CHECK((p->allocator.alloc == NULL) == (p->allocator.free == NULL),
              "%s: allocator.alloc and allocator.free must both be set or both NULL", fn);
    int32_t qg = 0;
    kvc_kvfmt fmt;
    memset(&fmt, 0, sizeof fmt);
    if (kvfmt) { /* dtype, scale_dtype, quant_group and layout are ignored */
        kvc_status st = kvc_kvfmt_make(p->kv_format, p->num_kv_heads, p->head_dim,
                                       p->page_size, &fmt);
        if (st != KVC_OK)
            return kvc__error(st, "%s: kv_format %s does not fit this geometry: %s", fn,
                              kvc_kv_format_name(p->kv_format), kvc_last_error());
    } else {
        KVC_CHECK(p->dtype == KVC_F32 || p->dtype == KVC_F16 || p->dtype == KVC_BF16 ||
                      is_quant(p->dtype),
                  "%s: dtype must be float32, float16, bfloat16, int8 or int4, got %s", fn,
                  kvc_dtype_name(p->dtype));
        KVC_CHECK(p->layout == KVC_NHD || p->layout == KVC_HND,
                  "%s: layout must be KVC_NHD (0) or KVC_HND (1), got %d", fn, (int)p->layout);
    }
    if (!kvfmt && is_quant(p->dtype)) {
        KVC_CHECK(p->scale_dtype == KVC_F32 || p->scale_dtype == KVC_F16,
                  "%s: scale_dtype must be float32 or float16, got %s", fn,
                  kvc_dtype_name(p->scale_dtype));
        qg = p->quant_group;
        KVC_CHECK(qg >= 1 && p->head_dim % qg == 0,
                  "%s: quant_group (%d) must be >= 1 and divide head_dim (%d)", fn, (int)qg,
                  (int)p->head_dim);
        KVC_CHECK(p->dtype != KVC_I4 || (qg % 2 == 0 && p->head_dim % 2 == 0),
                  "%s: int4 needs an even quant_group and head_dim (got %d, %d)", fn, (int)qg,
                  (int)p->head_dim);
    }
    KVC_CHECK(p->num_pages >= 0, "%s: num_pages must be >= 0, got %lld", fn,
              (long long)p->num_pages);
    /* bytes of one token slot of one layer, K and V (a per-token cache), or
     * of one page of one layer (a compressed format: its tokens share K
     * parameters, so the page is the unit) */
    const int64_t hd = (int64_t)p->num_kv_heads * p->head_dim;
    KVC_CHECK(hd <= ((int64_t)1 << 30) && p->num_layers <= (1 << 20),
              "%s: num_kv_heads * head_dim or num_layers too large", fn);
    int64_t tok_data = 0, tok_scale = 0, per_token = 0;
    const int64_t fmt_page = kvfmt ? (int64_t)kvc_kvfmt_page_bytes(&fmt) : 0;
    if (!kvfmt) {
        tok_data = 2 * kvc__bytes(p->dtype, hd);
        tok_scale = qg ? 2 * kvc__bytes(p->scale_dtype, hd / qg) : 0;
        per_token = (int64_t)p->num_layers * (tok_data + tok_scale);
    }
    int64_t num_pages = p->num_pages;
    if (num_pages == 0) {
        KVC_CHECK(p->max_bytes > 0, "%s: set num_pages > 0 or max_bytes > 0", fn);
        if (kvfmt) {
            /* fmt_page (< 2^43) * num_layers (<= 2^20) fits, but compare first anyway */
            num_pages = fmt_page > p->max_bytes / p->num_layers
                            ? 0
                            : p->max_bytes / (fmt_page * p->num_layers);
            KVC_CHECK(num_pages >= 1,
                      "%s: max_bytes %lld holds no page of %d layers x %lld bytes (%s)", fn,
                      (long long)p->max_bytes, (int)p->num_layers, (long long)fmt_page,
                      kvc_kv_format_name(p->kv_format));
        } else {
            /* per_token (< 2^54) * page_size (< 2^31) may overflow: compare first */
            num_pages = per_token > p->max_bytes / p->page_size
                            ? 0
                            : p->max_bytes / (per_token * p->page_size);
            KVC_CHECK(num_pages >= 1,
                      "%s: max_bytes %lld holds no page of %d tokens x %lld bytes per token",
                      fn, (long long)p->max_bytes, (int)p->page_size, (long long)per_token);
        }
    }
    KVC_CHECK(num_pages <= INT32_MAX / p->page_size,
              "%s: num_pages * page_size (%lld * %d) must fit in int32", fn,
              (long long)num_pages, (int)p->page_size);
    if (kvfmt)
        KVC_CHECK(fmt_page <= INT64_MAX / 4 / num_pages / p->num_layers,
                  "%s: storage size overflows", fn);
    else
        KVC_CHECK(tok_data + tok_scale <= INT64_MAX / 4 / p->page_size / num_pages /
                                              p->num_layers,
                  "%s: storage size overflows", fn); /* before any product of them */
    int64_t page_data = kvfmt ? fmt_page : tok_data * p->page_size;
    int64_t page_scale = tok_scale * p->page_size;
    if (kvfmt) per_token = (int64_t)p->num_layers * fmt_page / p->page_size;
    int64_t layer_data = page_data * num_pages, layer_scale = page_scale * num_pages;
    int64_t data_bytes = (layer_data * p->num_layers + 63) / 64 * 64;
    int64_t scale_bytes = layer_scale * p->num_layers;
    KVC_CHECK((uint64_t)(data_bytes + scale_bytes) <= (uint64_t)SIZE_MAX / 2,
              "%s: storage size overflows size_t", fn);

    kvc_allocator a = p->allocator;
    if (!a.alloc) {
        a.alloc = default_alloc;
        a.free = default_free;
        a.user = NULL;
    }
    kvc_cache *c = a.alloc(sizeof *c, 64, a.user);
    if (!c) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    memset(c, 0, sizeof *c);
    c->a = a;
    c->p = *p;
    c->p.num_pages = num_pages;
    if (!qg) {
        c->p.quant_group = 0;
    }
    c->num_pages = num_pages;
    c->ps = p->page_size;
    c->qg = qg;
    c->page_data_bytes = (size_t)page_data;
    c->page_scale_bytes = (size_t)page_scale;
    c->layer_data_bytes = (size_t)layer_data;
    c->layer_scale_bytes = (size_t)layer_scale;
    c->bytes_per_token = (size_t)per_token;
    c->kvfmt = kvfmt;
    c->fmt = fmt;
    c->tail_bytes = kvfmt ? kvc_kvfmt_tail_bytes(&fmt) : 0;
    c->sink_bytes = kvfmt ? kvc_kvfmt_sink_bytes(&fmt) : 0;
    c->group = kvfmt ? fmt.group : 1;
    c->unit = kvfmt && fmt.group > p->page_size ? fmt.group : p->page_size;
    int64_t nb = 1;
    while (nb < 2 * num_pages) nb *= 2;
    c->bucket_mask = (uint64_t)nb - 1;
    c->hash_mask = ~(uint64_t)0;
    int ok = 1;
    c->storage = kvc__cache_alloc(c, (size_t)(data_bytes + scale_bytes));
    ok = ok && c->storage;
    if (ok) c->pages = kvc__cache_alloc(c, (size_t)num_pages * sizeof(kvc__page));
    ok = ok && c->pages;
    if (ok) c->free_stack = kvc__cache_alloc(c, (size_t)num_pages * sizeof(int32_t));
    ok = ok && c->free_stack;
    if (ok && c->sink_bytes) {
        c->sinks = kvc__cache_alloc(c, (size_t)num_pages * sizeof(uint16_t *));
        ok = ok && c->sinks;
        if (ok) memset(c->sinks, 0, (size_t)num_pages * sizeof(uint16_t *));
    }
    if (ok && p->enable_prefix_caching) {
        c->tokens = kvc__cache_alloc(c, (size_t)(num_pages * p->page_size) * sizeof(int32_t));
        ok = ok && c->tokens;
        if (ok) c->buckets = kvc__cache_alloc(c, (size_t)nb * sizeof(int32_t));
        ok = ok && c->buckets;
    }
    if (!ok) {
        kvc_cache_destroy(c);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (%lld bytes of storage)", fn,
                          (long long)(data_bytes + scale_bytes));
    }
    memset(c->storage, 0, (size_t)(data_bytes + scale_bytes));
    c->data = c->storage;
    c->scale = qg ? (unsigned char *)c->storage + data_bytes : NULL;
    for (int64_t i = 0; i < num_pages; i++) {
        kvc__page *pg = &c->pages[i];
        memset(pg, 0, sizeof *pg);
        pg->prev = pg->next = pg->hnext = KVC__NO_PAGE;
        pg->parent = KVC__NO_PARENT;
        /* stack popped from the end: page 0 is taken first */
        c->free_stack[i] = (int32_t)(num_pages - 1 - i);
    }
    c->n_free = num_pages;
    c->lru_head = c->lru_tail = KVC__NO_PAGE;
    if (c->tokens) {
        memset(c->tokens, 0, (size_t)(num_pages * p->page_size) * sizeof(int32_t));
        for (int64_t i = 0; i < nb; i++) c->buckets[i] = KVC__NO_PAGE;
    }
    *out = c;
    return KVC_OK;
}

void kvc_cache_destroy(kvc_cache *c) {
    if (!c) return;
    for (int64_t i = 0; i < c->n_seqs; i++) {
        kvc__cache_free(c, c->seqs[i]->tail);
        kvc__cache_free(c, c->seqs[i]);
    }
    kvc__cache_free(c, c->seqs);
    if (c->sinks)
        for (int64_t i = 0; i < c->num_pages; i++) kvc__cache_free(c, c->sinks[i]);
    kvc__cache_free(c, c->sinks);
    kvc__cache_free(c, c->spare_sink);
    kvc__cache_free(c, c->buckets);
    kvc__cache_free(c, c->tokens);
    kvc__cache_free(c, c->free_stack);
    kvc__cache_free(c, c->pages);
    kvc__cache_free(c, c->storage);
    kvc_allocator a = c->a;
    a.free(c, a.user);
}

size_t kvc_cache_bytes_per_token(const kvc_cache *c) { return c ? c->bytes_per_token : 0; }
int64_t kvc_cache_capacity_tokens(const kvc_cache *c) { return c ? c->num_pages * c->ps : 0; }
int64_t kvc_cache_num_pages(const kvc_cache *c) { return c ? c->num_pages : 0; }

/* ---- layer views ------------------------------------------------------------------------- */

kvc_status kvc_cache_layer_tensors(const kvc_cache *c, int32_t layer, kvc_tensor *kv,
                                   kvc_tensor *scale) {
    static const char fn[] = "kvc_cache_layer_tensors";
    KVC_CHECK(c != NULL && kv != NULL, "%s: cache and kv must not be NULL", fn);
    KVC_CHECK(!c->kvfmt, "%s: the cache stores compressed format %s, not a paged cache: use "
              "kvc_cache_kvfmt_layer", fn, kvc_kv_format_name(c->fmt.id));
    KVC_CHECK(layer >= 0 && layer < c->p.num_layers, "%s: layer %d outside [0, %d)", fn,
              (int)layer, (int)c->p.num_layers);
    int64_t H = c->p.num_kv_heads, D = c->p.head_dim, P = c->ps;
    int64_t shape[5] = {c->num_pages, 2, P, H, D};
    if (c->p.layout == KVC_HND) {
        shape[2] = H;
        shape[3] = P;
    }
    *kv = kvc_tensor_make(c->data + (size_t)layer * c->layer_data_bytes, c->p.dtype, 5, shape);
    if (scale) {
        if (c->scale) {
            shape[4] = D / c->qg;
            *scale = kvc_tensor_make(c->scale + (size_t)layer * c->layer_scale_bytes,
                                     c->p.scale_dtype, 5, shape);
        } else {
            memset(scale, 0, sizeof *scale);
        }
    }
    return KVC_OK;
}

kvc_status kvc_cache_layer(const kvc_cache *c, int32_t layer, kvc_paged_cache *out) {
    static const char fn[] = "kvc_cache_layer";
    KVC_CHECK(c != NULL && out != NULL, "%s: cache and out must not be NULL", fn);
    KVC_CHECK(!c->kvfmt, "%s: the cache stores compressed format %s, not a paged cache: use "
              "kvc_cache_kvfmt_layer", fn, kvc_kv_format_name(c->fmt.id));
    kvc_tensor kv, sc;
    KVC_TRY(kvc_cache_layer_tensors(c, layer, &kv, &sc));
    return kvc_paged_cache_from_combined(&kv, c->scale ? &sc : NULL, c->p.layout,
                                         c->qg ? c->qg : c->p.quant_group, out);
}

/* ---- page tables ------------------------------------------------------------------------- */

static kvc_status find_all(const kvc_cache *c, const char *fn, const kvc_seq_id *seqs,
                           int64_t n_seqs, int64_t *total, int64_t *max_pages) {
    KVC_CHECK(n_seqs >= 0, "%s: n_seqs must be >= 0, got %lld", fn, (long long)n_seqs);
    KVC_CHECK(n_seqs == 0 || seqs != NULL, "%s: seqs is NULL", fn);
    int64_t t = 0, m = 0;
    for (int64_t b = 0; b < n_seqs; b++) {
        const kvc__seq *s = kvc__find_seq(c, seqs[b], NULL);
        if (!s)
            return kvc__error(KVC_ERR_NOT_FOUND, "%s: unknown sequence %lld (seqs[%lld])", fn,
                              (long long)seqs[b], (long long)b);
        t += s->n_pages;
        if (s->n_pages > m) m = s->n_pages;
    }
    *total = t;
    *max_pages = m;
    return KVC_OK;
}

kvc_status kvc_cache_page_table(const kvc_cache *c, const kvc_seq_id *seqs, int64_t n_seqs,
                                int32_t *kv_indptr, int32_t *kv_indices, int64_t capacity,
                                int32_t *kv_last_page_len, int64_t *n_indices) {
    static const char fn[] = "kvc_cache_page_table";
    KVC_CHECK(c != NULL, "%s: cache is NULL", fn);
    KVC_CHECK(kv_indptr != NULL && (n_seqs == 0 || kv_last_page_len != NULL),
              "%s: kv_indptr and kv_last_page_len must not be NULL", fn);
    int64_t total, maxp;
    KVC_TRY(find_all(c, fn, seqs, n_seqs, &total, &maxp));
    KVC_CHECK(total <= INT32_MAX, "%s: %lld pages do not fit in int32", fn, (long long)total);
    if (capacity < total || (total > 0 && kv_indices == NULL)) {
        if (n_indices) *n_indices = total;
        return kvc__error(KVC_ERR_INVALID_ARG,
                          "%s: kv_indices holds %lld entries, the batch needs %lld", fn,
                          (long long)capacity, (long long)total);
    }
    int64_t o = 0;
    kv_indptr[0] = 0;
    for (int64_t b = 0; b < n_seqs; b++) {
        /* seqs read again: an output overlapping it (core.h: undefined) may have
         * changed it, so the found sequence and the validated total still bound
         * every access */
        const kvc__seq *s = kvc__find_seq(c, seqs[b], NULL);
        const int64_t np = s ? (s->n_pages < total - o ? s->n_pages : total - o) : 0;
        if (np > 0) memcpy(kv_indices + o, s->pages, (size_t)np * sizeof(int32_t));
        o += np;
        kv_indptr[b + 1] = (int32_t)o;
        kv_last_page_len[b] =
            !s || s->len == 0 ? 0 : (int32_t)(s->len - (s->n_pages - 1) * c->ps);
    }
    if (n_indices) *n_indices = total;
    return KVC_OK;
}

kvc_status kvc_cache_cachestarts(const kvc_cache *c, const kvc_seq_id *seqs, int64_t n_seqs,
                                 int64_t *cachestarts, int64_t max_pages) {
    static const char fn[] = "kvc_cache_cachestarts";
    KVC_CHECK(c != NULL, "%s: cache is NULL", fn);
    KVC_CHECK(max_pages >= 0, "%s: max_pages must be >= 0", fn);
    int64_t total, maxp;
    KVC_TRY(find_all(c, fn, seqs, n_seqs, &total, &maxp));
    KVC_CHECK(maxp <= max_pages, "%s: a sequence holds %lld pages, max_pages is %lld", fn,
              (long long)maxp, (long long)max_pages);
    KVC_CHECK(n_seqs == 0 || max_pages <= INT64_MAX / n_seqs,
              "%s: %lld sequences x max_pages %lld overflow", fn, (long long)n_seqs,
              (long long)max_pages);
    KVC_CHECK(cachestarts != NULL || n_seqs == 0 || max_pages == 0, "%s: cachestarts is NULL",
              fn);
    for (int64_t b = 0; b < n_seqs; b++) {
        /* bounded again, as in kvc_cache_page_table: seqs may overlap cachestarts */
        const kvc__seq *s = kvc__find_seq(c, seqs[b], NULL);
        const int64_t np = s ? (s->n_pages < max_pages ? s->n_pages : max_pages) : 0;
        int64_t *row = cachestarts + b * max_pages;
        for (int64_t j = 0; j < np; j++) row[j] = (int64_t)s->pages[j] * c->ps;
        for (int64_t j = np; j < max_pages; j++) row[j] = -1;
    }
    return KVC_OK;
}

kvc_status kvc_cache_seq_len(const kvc_cache *c, kvc_seq_id seq, int64_t *n_tokens) {
    static const char fn[] = "kvc_cache_seq_len";
    KVC_CHECK(c != NULL && n_tokens != NULL, "%s: cache and n_tokens must not be NULL", fn);
    const kvc__seq *s = kvc__find_seq(c, seq, NULL);
    if (!s) return kvc__error(KVC_ERR_NOT_FOUND, "%s: unknown sequence %lld", fn, (long long)seq);
    *n_tokens = s->len;
    return KVC_OK;
}

kvc_status kvc_cache_get_stats(const kvc_cache *c, kvc_cache_stats *out) {
    KVC_CHECK(c != NULL && out != NULL, "kvc_cache_get_stats: cache and out must not be NULL");
    *out = c->st;
    out->free_pages = c->n_free;
    out->cached_pages = c->n_lru;
    out->used_pages = c->n_used;
    return KVC_OK;
}

/* ---- page contents ------------------------------------------------------------------ */

kvc_status kvc_cache_get_params(const kvc_cache *c, kvc_cache_params *out) {
    KVC_CHECK(c != NULL && out != NULL, "kvc_cache_get_params: cache and out must not be NULL");
    *out = c->p;
    out->num_pages = c->num_pages;
    return KVC_OK;
}

size_t kvc_cache_page_bytes(const kvc_cache *c) {
    return c ? (size_t)c->p.num_layers * (c->page_data_bytes + (c->scale ? c->page_scale_bytes : 0))
             : 0;
}

static kvc_status page_io_check(const kvc_cache *c, const char *fn, int32_t page, const void *buf,
                                size_t size) {
    KVC_CHECK(c != NULL && buf != NULL, "%s: cache and buffer must not be NULL", fn);
    KVC_CHECK(page >= 0 && page < c->num_pages, "%s: page %d outside [0, %lld)", fn, (int)page,
              (long long)c->num_pages);
    KVC_CHECK(size == kvc_cache_page_bytes(c), "%s: size %zu != kvc_cache_page_bytes %zu", fn,
              size, kvc_cache_page_bytes(c));
    return KVC_OK;
}

kvc_status kvc_cache_read_page(const kvc_cache *c, int32_t page, void *dst, size_t size) {
    KVC_TRY(page_io_check(c, "kvc_cache_read_page", page, dst, size));
    unsigned char *o = dst;
    for (int32_t l = 0; l < c->p.num_layers; l++) {
        memcpy(o, c->data + (size_t)l * c->layer_data_bytes + (size_t)page * c->page_data_bytes,
               c->page_data_bytes);
        o += c->page_data_bytes;
        if (c->scale) {
            memcpy(o, c->scale + (size_t)l * c->layer_scale_bytes +
                          (size_t)page * c->page_scale_bytes, c->page_scale_bytes);
            o += c->page_scale_bytes;
        }
    }
    return KVC_OK;
}

/* Copies a restored page into the storage with streaming stores: whole
 * prompts are restored at once (tens of MB, far beyond the caches), and
 * plain stores would first read every destination line from memory. SSE2
 * is baseline x86-64; elsewhere memcpy. */
static void copy_stream(void *dst, const void *src, size_t n) {
#if defined(__SSE2__)
    unsigned char *d = dst;
    const unsigned char *s = src;
    const size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (n < 256 || head > n) {
        memcpy(d, s, n);
        return;
    }
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; d += 64, s += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)), e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    _mm_sfence(); /* the streamed lines are visible before the tail and what follows */
    memcpy(d, s, n);
#else
    memcpy(dst, src, n);
#endif
}

kvc_status kvc_cache_write_page(kvc_cache *c, int32_t page, const void *src, size_t size) {
    static const char fn[] = "kvc_cache_write_page";
    KVC_TRY(page_io_check(c, fn, page, src, size));
    KVC_CHECK(c->pages[page].ref == 1, "%s: page %d is held by %d sequences (need exactly one)",
              fn, (int)page, (int)c->pages[page].ref);
    const unsigned char *in = src;
    for (int32_t l = 0; l < c->p.num_layers; l++) {
        copy_stream(c->data + (size_t)l * c->layer_data_bytes + (size_t)page * c->page_data_bytes,
                    in, c->page_data_bytes);
        in += c->page_data_bytes;
        if (c->scale) {
            copy_stream(c->scale + (size_t)l * c->layer_scale_bytes +
                            (size_t)page * c->page_scale_bytes,
                        in, c->page_scale_bytes);
            in += c->page_scale_bytes;
        }
    }
    return KVC_OK;
}

size_t kvc_cache_sink_bytes(const kvc_cache *c) {
    return c && c->sinks ? kvc__sinks_bytes(c) : 0;
}

static kvc_status sink_io_check(const kvc_cache *c, const char *fn, int32_t page, const void *buf,
                                size_t size) {
    KVC_CHECK(c != NULL && buf != NULL, "%s: cache and buffer must not be NULL", fn);
    KVC_CHECK(c->sinks != NULL, "%s: the cache keeps no sink rows (format %s)", fn,
              c->kvfmt ? kvc_kv_format_name(c->fmt.id) : "none");
    KVC_CHECK(page >= 0 && page < c->num_pages, "%s: page %d outside [0, %lld)", fn, (int)page,
              (long long)c->num_pages);
    KVC_CHECK(size == kvc__sinks_bytes(c), "%s: size %zu != kvc_cache_sink_bytes %zu", fn, size,
              kvc__sinks_bytes(c));
    KVC_CHECK(c->sinks[page] != NULL, "%s: page %d is no sequence's first page (it holds no "
              "sink rows)", fn, (int)page);
    return KVC_OK;
}

kvc_status kvc_cache_read_sink(const kvc_cache *c, int32_t page, void *dst, size_t size) {
    KVC_TRY(sink_io_check(c, "kvc_cache_read_sink", page, dst, size));
    memcpy(dst, c->sinks[page], size);
    return KVC_OK;
}

kvc_status kvc_cache_write_sink(kvc_cache *c, int32_t page, const void *src, size_t size) {
    static const char fn[] = "kvc_cache_write_sink";
    KVC_TRY(sink_io_check(c, fn, page, src, size));
    KVC_CHECK(c->pages[page].ref == 1, "%s: page %d is held by %d sequences (need exactly one)",
              fn, (int)page, (int)c->pages[page].ref);
    memcpy(c->sinks[page], src, size);
    return KVC_OK;
}

kvc_status kvc_cache_set_evict_hook(kvc_cache *c, kvc_cache_evict_fn fn, void *user) {
    KVC_CHECK(c != NULL, "kvc_cache_set_evict_hook: cache is NULL");
    c->evict_fn = fn;
    c->evict_user = fn ? user : NULL;
    return KVC_OK;
}

kvc_status kvc_cache_page_tokens(const kvc_cache *c, int32_t page, int32_t *tokens) {
    static const char fn[] = "kvc_cache_page_tokens";
    KVC_CHECK(c != NULL && tokens != NULL, "%s: cache and tokens must not be NULL", fn);
    KVC_CHECK(page >= 0 && page < c->num_pages, "%s: page %d outside [0, %lld)", fn, (int)page,
              (long long)c->num_pages);
    if (!c->tokens || !c->pages[page].in_index)
        return kvc__error(KVC_ERR_NOT_FOUND, "%s: page %d is not in the prefix index", fn,
                          (int)page);
    memcpy(tokens, c->tokens + (int64_t)page * c->ps, (size_t)c->ps * sizeof(int32_t));
    return KVC_OK;
}

/* ---- check ------------------------------------------------------------------------------- */

#define BAD(...) (kvc__error(KVC_ERR_CORRUPT, "kvc_cache_check: " __VA_ARGS__))

static kvc_status check_pages(const kvc_cache *c, int32_t *cnt) {
    const int64_t N = c->num_pages;
    /* references from page tables */
    for (int64_t i = 0; i < c->n_seqs; i++) {
        const kvc__seq *s = c->seqs[i];
        if (i > 0 && c->seqs[i - 1]->id >= s->id) return BAD("sequence ids not increasing");
        if (s->id < 0 || s->id >= c->next_id) return BAD("sequence id %lld out of range",
                                                         (long long)s->id);
        if (s->len < 0 || s->n_pages != (s->len + c->ps - 1) / c->ps || s->n_pages > s->cap)
            return BAD("sequence %lld: len %lld with %lld pages (cap %lld)", (long long)s->id,
                       (long long)s->len, (long long)s->n_pages, (long long)s->cap);
        if (s->known < 0 || s->known > s->len || s->nh < 0 || s->nh > s->known / c->ps ||
            (!c->tokens && (s->known || s->nh)))
            return BAD("sequence %lld: known %lld / hashed pages %lld inconsistent",
                       (long long)s->id, (long long)s->known, (long long)s->nh);
        if ((s->tail != NULL) != (c->kvfmt != 0))
            return BAD("sequence %lld: %s", (long long)s->id,
                       c->kvfmt ? "no tail in a compressed-format cache"
                                : "a tail in a per-token cache");
        if (c->sinks && s->n_pages > 0 && !c->sinks[s->pages[0]])
            return BAD("sequence %lld: first page %d has no sink rows", (long long)s->id,
                       (int)s->pages[0]);
        /* a page is hashed (and registered) only once its K groups are complete */
        if (s->nh * c->ps > s->known / c->unit * c->unit)
            return BAD("sequence %lld: %lld pages hashed, beyond its %lld tokens' whole groups",
                       (long long)s->id, (long long)s->nh, (long long)s->known);
        for (int64_t j = 0; j < s->n_pages; j++) {
            int32_t p = s->pages[j];
            if (p < 0 || p >= N) return BAD("sequence %lld: page id %d out of range",
                                            (long long)s->id, (int)p);
            cnt[p]++;
        }
        const int64_t R = c->unit / c->ps;
        if (s->nh % R != 0)
            return BAD("sequence %lld: %lld pages hashed, not whole groups of %lld pages",
                       (long long)s->id, (long long)s->nh, (long long)R);
        uint64_t h = kvc__chain_seed(s->salt), u = 0;
        for (int64_t j = 0; j < s->nh; j++) {
            int32_t p = s->pages[j];
            if (j % R == 0) u = kvc__unit_hash(c, NULL, s->pages + j);
            h = kvc__chain_hash(c, h ^ u, c->tokens + (int64_t)p * c->ps, c->ps);
            if (h != s->hashes[j])
                return BAD("sequence %lld: hash of page %lld does not match its tokens",
                           (long long)s->id, (long long)j);
            if (c->pages[p].in_index && c->pages[p].hash != h)
                return BAD("sequence %lld: indexed page %d has another hash", (long long)s->id,
                           (int)p);
        }
    }
    int64_t used = 0;
    for (int64_t p = 0; p < N; p++) {
        if (c->pages[p].ref != cnt[p])
            return BAD("page %lld: ref %d but %d page tables hold it", (long long)p,
                       (int)c->pages[p].ref, (int)cnt[p]);
        if (cnt[p] > 0) used++;
    }
    if (used != c->n_used) return BAD("used count %lld, %lld pages referenced",
                                      (long long)c->n_used, (long long)used);
    /* mark: 1 free, 2 lru, 4 index */
    for (int64_t p = 0; p < N; p++) cnt[p] = 0;
    if (c->n_free < 0 || c->n_free > N) return BAD("free count %lld", (long long)c->n_free);
    for (int64_t i = 0; i < c->n_free; i++) {
        int32_t p = c->free_stack[i];
        if (p < 0 || p >= N) return BAD("free stack holds %d", (int)p);
        if (cnt[p]) return BAD("page %d twice on the free stack", (int)p);
        cnt[p] = 1;
        if (c->pages[p].ref != 0 || c->pages[p].in_index)
            return BAD("free page %d is referenced or indexed", (int)p);
    }
    int64_t n = 0;
    int32_t prev = KVC__NO_PAGE;
    for (int32_t p = c->lru_head; p != KVC__NO_PAGE; p = c->pages[p].next) {
        if (p < 0 || p >= N || n > N) return BAD("LRU list broken");
        if (cnt[p]) return BAD("page %d on the LRU list and another list (or twice)", (int)p);
        if (c->pages[p].prev != prev) return BAD("LRU back link of page %d", (int)p);
        if (c->pages[p].ref != 0 || !c->pages[p].in_index)
            return BAD("LRU page %d is referenced or not indexed", (int)p);
        cnt[p] = 2;
        prev = p;
        n++;
    }
    if (prev != c->lru_tail || n != c->n_lru) return BAD("LRU tail or count");
    if (c->n_free + c->n_lru + c->n_used != N)
        return BAD("free %lld + cached %lld + used %lld != %lld pages", (long long)c->n_free,
                   (long long)c->n_lru, (long long)c->n_used, (long long)N);
    for (int64_t p = 0; p < N; p++)
        if (c->pages[p].ref == 0 && cnt[p] == 0)
            return BAD("unreferenced page %lld is on no list", (long long)p);
    /* index */
    n = 0;
    if (c->buckets) {
        for (uint64_t b = 0; b <= c->bucket_mask; b++) {
            for (int32_t p = c->buckets[b]; p != KVC__NO_PAGE; p = c->pages[p].hnext) {
                if (p < 0 || p >= N || n > N) return BAD("hash chain broken");
                const kvc__page *pg = &c->pages[p];
                if (!pg->in_index || (pg->hash & c->bucket_mask) != b || (cnt[p] & 4))
                    return BAD("page %d misplaced in the hash index", (int)p);
                cnt[p] |= 4;
                n++;
                const int32_t *tk = c->tokens + (int64_t)p * c->ps;
                uint64_t want = kvc__chain_hash(c, pg->parent_hash ^ pg->unit, tk, c->ps);
                if (pg->unit != 0 && c->unit == c->ps)
                    return BAD("page %d: a unit hash in a cache without groups across pages",
                               (int)p);
                if (want != pg->hash) return BAD("page %d: hash does not match tokens", (int)p);
                if (pg->parent == KVC__NO_PARENT) {
                    if (pg->parent_hash != kvc__chain_seed(pg->salt))
                        return BAD("page %d: root page with a foreign parent hash", (int)p);
                } else if (kvc__chain_valid(c, pg->parent)) {
                    const kvc__page *par = &c->pages[kvc__packed_page(pg->parent)];
                    if (par->hash != pg->parent_hash || par->salt != pg->salt)
                        return BAD("page %d: parent hash mismatch", (int)p);
                }
                if (kvc__index_find(c, pg->hash, pg->parent, pg->salt, tk) != p)
                    return BAD("page %d: duplicate entry in the hash index", (int)p);
            }
        }
    }
    for (int64_t p = 0; p < N; p++)
        if (c->pages[p].in_index && !(cnt[p] & 4))
            return BAD("page %lld marked indexed but not in the index", (long long)p);
    if (n != c->n_indexed) return BAD("index count %lld, found %lld", (long long)c->n_indexed,
                                      (long long)n);
    return KVC_OK;
}

/* The cache's own geometry (a compressed cache: its format and storage). */
static kvc_status check_geometry(const kvc_cache *c) {
    if (c->ps < 1 || c->num_pages < 1 || c->unit < c->ps || c->unit % c->ps != 0 ||
        c->group < 1)
        return BAD("page_size %d, unit %d, group %d inconsistent", (int)c->ps, (int)c->unit,
                   (int)c->group);
    if (!c->kvfmt) {
        if (c->group != 1 || c->unit != c->ps || c->tail_bytes != 0)
            return BAD("per-token cache with group rules");
        return KVC_OK;
    }
    if (kvc_kvfmt_check(&c->fmt) != KVC_OK) {
        kvc_clear_error();
        return BAD("invalid compressed format");
    }
    if (c->fmt.group != c->group || c->unit != (c->group > c->ps ? c->group : c->ps) ||
        c->fmt.page_size != c->ps || c->scale != NULL ||
        c->page_data_bytes != kvc_kvfmt_page_bytes(&c->fmt) ||
        c->layer_data_bytes != c->page_data_bytes * (size_t)c->num_pages ||
        c->tail_bytes != kvc_kvfmt_tail_bytes(&c->fmt) ||
        c->sink_bytes != kvc_kvfmt_sink_bytes(&c->fmt) || (c->sinks != NULL) != (c->sink_bytes > 0))
        return BAD("compressed format %s: storage, tail or sink sizes inconsistent",
                   kvc_kv_format_name(c->fmt.id));
    return KVC_OK;
}

kvc_status kvc_cache_check(const kvc_cache *cache) {
    KVC_CHECK(cache != NULL, "kvc_cache_check: cache is NULL");
    KVC_TRY(check_geometry(cache));
    kvc_cache *c = (kvc_cache *)cache; /* allocator only */
    int32_t *cnt = kvc__cache_alloc(c, (size_t)c->num_pages * sizeof(int32_t));
    if (!cnt) return kvc__error(KVC_ERR_NOMEM, "kvc_cache_check: out of memory");
    memset(cnt, 0, (size_t)c->num_pages * sizeof(int32_t));
    kvc_status st = check_pages(c, cnt);
    kvc__cache_free(c, cnt);
    return st;
}
