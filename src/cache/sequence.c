/*
 * Sequence operations of the cache manager: add (with prefix lookup),
 * append, fork, truncate, free.
 *
 * Every mutating call validates, then makes every allocation it may need
 * (sequence tables, the id array) and checks page availability, and only
 * then commits; so a call that fails changes nothing (except the
 * failed_allocs counter for KVC_ERR_NO_SPACE).
 *
 * Token ids and hashing: a sequence knows the ids of its first `known`
 * tokens (they live in the token slots of its pages). A page is hashed and
 * registered in the index when it is full and all its ids are known. An
 * append without ids (token_ids NULL) stops the sequence being hashable from
 * that page on (until a truncate back below it).
 *
 * Copy-on-write: a sequence writes only into the pages from position
 * floor(len / G) * G on (G = c->group: 1 for a per-token cache, so only its
 * partly filled last page; a compressed format rewrites the pages of its
 * incomplete K group when the group completes). Before an append, a page
 * there held by other sequences too is copied (every layer's storage and
 * the token ids); an unshared page there that is still in the index
 * (possible after a truncate into a full, cached page) leaves the index
 * instead. truncate itself never allocates.
 *
 * Compressed formats (docs/KV_FORMATS.md section 5): prefix hits and
 * registered pages come in whole units of c->unit = max(P, G) tokens, so a
 * page is findable only once every K group it holds is complete, and a hit
 * never reuses part of a group. Each sequence owns its tails (one per
 * layer), allocated with it and copied by fork.
 */
#include <string.h>

#include "cache_internal.h"

static size_t seq_bytes(int64_t cap) {
    return sizeof(kvc__seq) + (size_t)cap * (sizeof(uint64_t) + sizeof(int64_t) + sizeof(int32_t));
}

static kvc__seq *seq_alloc(kvc_cache *c, int64_t cap) {
    if (cap < 4) cap = 4;
    kvc__seq *s = kvc__cache_alloc(c, seq_bytes(cap));
    if (!s) return NULL;
    memset(s, 0, sizeof *s);
    s->cap = cap;
    s->hashes = (uint64_t *)(void *)(s + 1);
    s->chain = (int64_t *)(void *)(s->hashes + cap);
    s->pages = (int32_t *)(void *)(s->chain + cap);
    return s;
}

/* Copies header and arrays of src into dst (dst->cap >= src->n_pages). */
static void seq_copy(kvc__seq *dst, const kvc__seq *src) {
    int64_t cap = dst->cap;
    uint64_t *h = dst->hashes;
    int64_t *ch = dst->chain;
    int32_t *pg = dst->pages;
    *dst = *src;
    dst->cap = cap;
    dst->hashes = h;
    dst->chain = ch;
    dst->pages = pg;
    memcpy(h, src->hashes, (size_t)src->nh * sizeof(uint64_t));
    memcpy(ch, src->chain, (size_t)src->nh * sizeof(int64_t));
    memcpy(pg, src->pages, (size_t)src->n_pages * sizeof(int32_t));
}

/* A bigger id array if one more sequence does not fit (*out NULL if it does). */
static kvc_status reserve_seqs(kvc_cache *c, const char *fn, kvc__seq ***out) {
    *out = NULL;
    if (c->n_seqs < c->seqs_cap) return KVC_OK;
    int64_t cap = c->seqs_cap ? c->seqs_cap * 2 : 16;
    kvc__seq **a = kvc__cache_alloc(c, (size_t)cap * sizeof(*a));
    if (!a) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (sequence array)", fn);
    if (c->n_seqs) memcpy(a, c->seqs, (size_t)c->n_seqs * sizeof(*a));
    *out = a;
    return KVC_OK;
}

static void commit_seqs(kvc_cache *c, kvc__seq **grown, kvc__seq *s) {
    if (grown) {
        kvc__cache_free(c, c->seqs);
        c->seqs = grown;
        c->seqs_cap = c->seqs_cap ? c->seqs_cap * 2 : 16;
    }
    c->seqs[c->n_seqs++] = s; /* ids increase: stays sorted */
}

static kvc_status no_space(kvc_cache *c, const char *fn, int64_t need) {
    c->st.failed_allocs++;
    return kvc__error(KVC_ERR_NO_SPACE, "%s: needs %lld pages, %lld free or cached", fn,
                      (long long)need, (long long)kvc__available(c));
}

static kvc_status find(const kvc_cache *c, const char *fn, kvc_seq_id id, kvc__seq **s,
                       int64_t *pos) {
    *s = kvc__find_seq(c, id, pos);
    if (!*s) return kvc__error(KVC_ERR_NOT_FOUND, "%s: unknown or freed sequence %lld", fn,
                               (long long)id);
    return KVC_OK;
}

/* Compressed formats with G > P (R = G / P pages per K group): resolves the
 * chain of the group at pages [i0, i0 + R) of s, chain[i0 - 1] valid. Every
 * page's bytes depend on the whole group, so pages of one group are only
 * ever keyed under each other: either the whole group is found in the index
 * (each page under the previous one, so all its tokens equal s's and its
 * pages were written together) and stands for s's, or s's own pages are
 * registered, each under its own predecessor. Never part of one group and
 * part of another, as a page-by-page resolution would do for two groups
 * sharing their first pages. Returns 0 when s's pages cannot be registered
 * (another page holds a key, after a hash collision or while a lost page's
 * duplicate stays indexed); the group is then not findable through s. */
static int resolve_unit(kvc_cache *c, kvc__seq *s, int64_t i0) {
    const int64_t R = c->unit / c->ps, parent0 = i0 ? s->chain[i0 - 1] : KVC__NO_PARENT;
    int64_t parent = parent0, r;
    for (r = 0; r < R; r++) {
        const int32_t *tk = c->tokens + (int64_t)s->pages[i0 + r] * c->ps;
        int32_t q = kvc__index_find(c, s->hashes[i0 + r], parent, s->salt, tk);
        if (q == KVC__NO_PAGE) break;
        parent = s->chain[i0 + r] = kvc__pack(q, c->pages[q].gen);
    }
    if (r == R) {
        for (r = 0; r < R; r++) {
            int32_t q = kvc__packed_page(s->chain[i0 + r]);
            if (q != s->pages[i0 + r]) c->pages[q].dep = 1; /* its leaving concerns s */
        }
        return 1;
    }
    for (r = 0; r < R; r++) s->chain[i0 + r] = -1;
    const uint64_t u = kvc__unit_hash(c, NULL, s->pages + i0);
    uint64_t ph = i0 ? s->hashes[i0 - 1] : kvc__chain_seed(s->salt);
    parent = parent0;
    for (r = 0; r < R; r++) {
        const int64_t i = i0 + r;
        const int32_t p = s->pages[i];
        int32_t q = kvc__index_find(c, s->hashes[i], parent, s->salt,
                                    c->tokens + (int64_t)p * c->ps);
        if (q != p) {
            if (q != KVC__NO_PAGE) return 0;
            kvc__page *pg = &c->pages[p];
            if (pg->in_index) {
                if (kvc__chain_valid(c, pg->parent) || pg->parent == KVC__NO_PARENT) return 0;
                kvc__index_remove(c, p); /* stale parent: re-key under the live one */
            }
            kvc__index_insert(c, p, s->hashes[i], ph, parent, s->salt, u);
        }
        parent = s->chain[i] = kvc__pack(p, c->pages[p].gen);
        ph = s->hashes[i];
    }
    return 1;
}

/* Makes chain[j] name the index page for chunk j of s (j < s->nh) when the
 * one it named left the index: chunks from the first stale one on are looked
 * up again, and where the index has none, the sequence's own page is
 * registered (re-keyed if it sits in the index under a stale parent). So a
 * page that duplicated an evicted one takes its place. Returns whether
 * chain[j] is valid. O(1) when it already is. With groups across pages,
 * whole groups (resolve_unit; j + 1 is then a multiple of R). */
static int resolve_chain(kvc_cache *c, kvc__seq *s, int64_t j) {
    if (kvc__chain_valid(c, s->chain[j])) return 1;
    int64_t i = j;
    while (i > 0 && !kvc__chain_valid(c, s->chain[i - 1])) i--;
    const int64_t R = c->unit / c->ps;
    if (R > 1) {
        for (i = i / R * R; i <= j; i += R)
            if (!resolve_unit(c, s, i)) return 0;
        return 1;
    }
    for (; i <= j; i++) {
        int32_t p = s->pages[i];
        const int32_t *tk = c->tokens + (int64_t)p * c->ps;
        int64_t parent = i ? s->chain[i - 1] : KVC__NO_PARENT;
        uint64_t ph = i ? s->hashes[i - 1] : kvc__chain_seed(s->salt);
        int32_t q = kvc__index_find(c, s->hashes[i], parent, s->salt, tk);
        if (q == KVC__NO_PAGE) {
            kvc__page *pg = &c->pages[p];
            if (pg->in_index) {
                if (kvc__chain_valid(c, pg->parent) || pg->parent == KVC__NO_PARENT) return 0;
                kvc__index_remove(c, p); /* stale parent: re-key under the live one */
            }
            kvc__index_insert(c, p, s->hashes[i], ph, parent, s->salt, 0);
            q = p;
        }
        if (q != p) c->pages[q].dep = 1; /* its leaving the index concerns s (rescan) */
        s->chain[i] = kvc__pack(q, c->pages[q].gen);
    }
    return 1;
}

/* After a page that some chain named in place of the sequence's own
 * identical page left the index (evicted, overwritten, re-keyed), every
 * sequence with a stale chain resolves it again from its first stale entry:
 * its own pages then take the lost page's place and stay findable. Rare
 * (duplicate pages), so a scan of all sequences; re-keying may flag more,
 * hence the loop (each pass leaves fewer stale entries). */
static void rescan_chains(kvc_cache *c) {
    for (int pass = 0; c->rescan && pass < 16; pass++) {
        c->rescan = 0;
        for (int64_t k = 0; k < c->n_seqs; k++) {
            kvc__seq *s = c->seqs[k];
            int64_t j = 0;
            while (j < s->nh && kvc__chain_valid(c, s->chain[j])) j++;
            if (j == s->nh) continue;
            for (int64_t i = j; i < s->nh; i++) s->chain[i] = -1; /* keyed under stale parents */
            resolve_chain(c, s, s->nh - 1);
        }
    }
}

/* Hashes (and registers where possible) the pages of s that are full and
 * whose token ids are all known, from page s->nh on; in a compressed format
 * only pages whose K groups are all complete (whole units), as a group's
 * pages hold its shared K parameters. */
static void register_pages(kvc_cache *c, kvc__seq *s) {
    if (!c->tokens) return;
    const int64_t R = c->unit / c->ps, full = s->known / c->unit * R;
    for (int64_t j0 = s->nh; j0 < full; j0 += R) { /* s->nh is a multiple of R */
        const uint64_t u = kvc__unit_hash(c, NULL, s->pages + j0);
        for (int64_t j = j0; j < j0 + R; j++) {
            const int32_t *tk = c->tokens + (int64_t)s->pages[j] * c->ps;
            uint64_t ph = j ? s->hashes[j - 1] : kvc__chain_seed(s->salt);
            s->hashes[j] = kvc__chain_hash(c, ph ^ u, tk, c->ps);
            s->chain[j] = -1;
        }
        s->nh = j0 + R;
        resolve_chain(c, s, j0 + R - 1);
    }
}

/* Releases a sequence's memory (tails, then the header and arrays). */
static void seq_release(kvc_cache *c, kvc__seq *s) {
    kvc__cache_free(c, s->tail);
    kvc__cache_free(c, s);
}

/* Releases pages [from, n_pages) deepest first: cached ones enter the LRU
 * list in that order, so the deepest is evicted first. */
static void release_tail(kvc_cache *c, kvc__seq *s, int64_t from) {
    for (int64_t j = s->n_pages - 1; j >= from; j--) kvc__unref_page(c, s->pages[j]);
    s->n_pages = from;
}

kvc_status kvc_cache_lookup_prefix(const kvc_cache *c, const int32_t *token_ids,
                                   int64_t n_tokens, uint64_t salt, int64_t *n_cached) {
    static const char fn[] = "kvc_cache_lookup_prefix";
    KVC_CHECK(c != NULL && n_cached != NULL, "%s: cache and n_cached must not be NULL", fn);
    KVC_CHECK(n_tokens >= 0, "%s: n_tokens %lld < 0", fn, (long long)n_tokens);
    KVC_CHECK(token_ids != NULL || n_tokens == 0, "%s: token_ids is NULL", fn);
    *n_cached = 0;
    if (c->tokens == NULL || n_tokens == 0) return KVC_OK;
    const int32_t ps = c->ps;
    const int64_t R = c->unit / ps, max_hits = (n_tokens - 1) / ps / R * R; /* whole units */
    uint64_t h = kvc__chain_seed(salt), u = 0;
    int64_t parent = KVC__NO_PARENT, hits = 0;
    for (; hits < max_hits; hits++) {
        const int32_t *tk = token_ids + hits * ps;
        if (hits % R == 0) u = kvc__unit_hash(c, tk, NULL);
        uint64_t hh = kvc__chain_hash(c, h ^ u, tk, ps);
        int32_t q = kvc__index_find(c, hh, parent, salt, tk);
        if (q == KVC__NO_PAGE) break;
        h = hh;
        parent = kvc__pack(q, c->pages[q].gen);
    }
    *n_cached = kvc__round_hit(c, hits) * ps;
    return KVC_OK;
}

kvc_status kvc_cache_add_sequence(kvc_cache *c, const int32_t *token_ids, int64_t n_tokens,
                                  uint64_t salt, kvc_seq_id *seq, int64_t *n_cached) {
    static const char fn[] = "kvc_cache_add_sequence";
    KVC_CHECK(c != NULL && seq != NULL, "%s: cache and seq must not be NULL", fn);
    KVC_CHECK(n_tokens >= 0 && n_tokens <= c->num_pages * c->ps,
              "%s: n_tokens %lld outside [0, capacity %lld]", fn, (long long)n_tokens,
              (long long)(c->num_pages * c->ps));
    const int32_t ps = c->ps;
    const int64_t np = (n_tokens + ps - 1) / ps;
    kvc__seq **grown;
    KVC_TRY(reserve_seqs(c, fn, &grown));
    kvc__seq *s = seq_alloc(c, np);
    if (!s) {
        kvc__cache_free(c, grown);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (page table)", fn);
    }
    s->salt = salt;
    const int hashing = c->tokens != NULL && token_ids != NULL;
    /* prefix lookup: whole pages within the first n_tokens - 1 tokens */
    int64_t hits = 0, hits_cached = 0;
    if (hashing && n_tokens > 0) {
        const int64_t R = c->unit / ps, max_hits = (n_tokens - 1) / ps / R * R;
        uint64_t h = kvc__chain_seed(salt), u = 0;
        int64_t parent = KVC__NO_PARENT;
        for (; hits < max_hits; hits++) {
            const int32_t *tk = token_ids + hits * ps;
            if (hits % R == 0) u = kvc__unit_hash(c, tk, NULL);
            uint64_t hh = kvc__chain_hash(c, h ^ u, tk, ps);
            int32_t q = kvc__index_find(c, hh, parent, salt, tk);
            if (q == KVC__NO_PAGE) break;
            h = hh;
            parent = kvc__pack(q, c->pages[q].gen);
            s->pages[hits] = q;
            s->hashes[hits] = hh;
            s->chain[hits] = parent;
        }
        hits = kvc__round_hit(c, hits); /* whole K groups only (compressed formats) */
        for (int64_t j = 0; j < hits; j++) hits_cached += c->pages[s->pages[j]].ref == 0;
    }
    const int64_t need = np - hits;
    if (need > kvc__available(c) - hits_cached) {
        kvc__cache_free(c, s);
        kvc__cache_free(c, grown);
        return no_space(c, fn, need);
    }
    if (hits == 0 && np > 0) {
        kvc_status st = kvc__sink_reserve(c, fn); /* for the new first page */
        if (st != KVC_OK) {
            kvc__cache_free(c, s);
            kvc__cache_free(c, grown);
            return st;
        }
    }
    if (c->kvfmt) { /* after the space check: the tails may be large */
        s->tail = kvc__tails_alloc(c, NULL);
        if (!s->tail) {
            kvc__cache_free(c, s);
            kvc__cache_free(c, grown);
            return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (%zu bytes of tails)", fn,
                              kvc__tails_bytes(c));
        }
    }
    /* commit */
    s->id = c->next_id++;
    for (int64_t j = 0; j < hits; j++) kvc__ref_page(c, s->pages[j]);
    for (int64_t j = hits; j < np; j++) s->pages[j] = kvc__take_page(c);
    if (hits == 0 && np > 0) kvc__sink_attach(c, s->pages[0]);
    s->len = n_tokens;
    s->n_pages = np;
    s->nh = hits;
    if (hashing) {
        for (int64_t j = hits; j < np; j++) {
            int64_t t0 = j * ps, nt = n_tokens - t0 < ps ? n_tokens - t0 : ps;
            memcpy(c->tokens + (int64_t)s->pages[j] * ps, token_ids + t0,
                   (size_t)nt * sizeof(int32_t));
        }
        s->known = n_tokens;
        register_pages(c, s);
    }
    commit_seqs(c, grown, s);
    rescan_chains(c);
    c->st.hit_tokens += hits * ps;
    c->st.miss_tokens += n_tokens - hits * ps;
    *seq = s->id;
    if (n_cached) *n_cached = hits * ps;
    return KVC_OK;
}

kvc_status kvc_cache_append(kvc_cache *c, kvc_seq_id seq, const int32_t *token_ids, int64_t n,
                            int32_t *positions) {
    static const char fn[] = "kvc_cache_append";
    KVC_CHECK(c != NULL, "%s: cache is NULL", fn);
    kvc__seq *s;
    int64_t pos;
    KVC_TRY(find(c, fn, seq, &s, &pos));
    KVC_CHECK(n >= 0 && n <= c->num_pages * c->ps - s->len,
              "%s: n %lld outside [0, %lld] (capacity %lld, length %lld)", fn, (long long)n,
              (long long)(c->num_pages * c->ps - s->len), (long long)(c->num_pages * c->ps),
              (long long)s->len);
    if (n == 0) return KVC_OK;
    const int32_t ps = c->ps;
    const int64_t len = s->len, np = (len + n + ps - 1) / ps;
    /* pages this append (or the group it completes later) writes into: from
     * the one holding position floor(len / G) * G (the partly filled last
     * page of a per-token cache, if any) */
    const int64_t first = len / c->group * c->group / ps;
    int64_t cow = 0;
    for (int64_t j = first; j < s->n_pages; j++) cow += c->pages[s->pages[j]].ref > 1;
    const int64_t need = np - s->n_pages + cow;
    if (need > kvc__available(c)) return no_space(c, fn, need);
    /* a new first page, or a copy of a shared one, gets sink rows */
    if (s->n_pages == 0 || (first == 0 && c->pages[s->pages[0]].ref > 1))
        KVC_TRY(kvc__sink_reserve(c, fn));
    if (np > s->cap) {
        int64_t cap = s->cap * 2 > np ? s->cap * 2 : np;
        kvc__seq *g = seq_alloc(c, cap);
        if (!g) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (page table)", fn);
        seq_copy(g, s);
        kvc__cache_free(c, s);
        c->seqs[pos] = s = g;
    }
    /* commit */
    for (int64_t j = first; j < s->n_pages; j++) {
        int32_t pg = s->pages[j];
        if (c->pages[pg].ref > 1) {
            int32_t q = kvc__take_page(c);
            kvc__copy_page(c, q, pg);
            kvc__unref_page(c, pg);
            s->pages[j] = q;
        } else if (c->pages[pg].in_index) {
            kvc__index_remove(c, pg); /* about to be overwritten */
        }
    }
    for (int64_t j = s->n_pages; j < np; j++) s->pages[j] = kvc__take_page(c);
    if (s->n_pages == 0) kvc__sink_attach(c, s->pages[0]);
    s->n_pages = np;
    if (c->tokens && token_ids && s->known == len) {
        for (int64_t i = 0; i < n; i++) {
            int64_t t = len + i;
            c->tokens[(int64_t)s->pages[t / ps] * ps + t % ps] = token_ids[i];
        }
        s->known = len + n;
    }
    s->len = len + n;
    if (positions)
        for (int64_t i = 0; i < n; i++) positions[i] = (int32_t)(len + i);
    register_pages(c, s);
    rescan_chains(c);
    return KVC_OK;
}

kvc_status kvc_cache_fork(kvc_cache *c, kvc_seq_id seq, kvc_seq_id *child) {
    static const char fn[] = "kvc_cache_fork";
    KVC_CHECK(c != NULL && child != NULL, "%s: cache and child must not be NULL", fn);
    kvc__seq *s;
    int64_t pos;
    KVC_TRY(find(c, fn, seq, &s, &pos));
    kvc__seq **grown;
    KVC_TRY(reserve_seqs(c, fn, &grown));
    kvc__seq *d = seq_alloc(c, s->n_pages);
    if (!d) {
        kvc__cache_free(c, grown);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (page table)", fn);
    }
    uint16_t *tail = NULL;
    if (c->kvfmt && !(tail = kvc__tails_alloc(c, s->tail))) { /* the child's copy */
        kvc__cache_free(c, d);
        kvc__cache_free(c, grown);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (%zu bytes of tails)", fn,
                          kvc__tails_bytes(c));
    }
    seq_copy(d, s);
    d->tail = tail;
    d->id = c->next_id++;
    for (int64_t j = 0; j < d->n_pages; j++) kvc__ref_page(c, d->pages[j]);
    commit_seqs(c, grown, d);
    *child = d->id;
    return KVC_OK;
}

/* How truncate, truncate_ex and rollback treat a cut inside a quantized K
 * group (below floor(len / G) * G, not a multiple of G). */
typedef enum cut_mode {
    CUT_STRICT,    /* truncate: fails, the group's values are gone */
    CUT_ROUND,     /* truncate_ex: keeps the whole groups before the cut */
    CUT_UNWRITTEN, /* rollback: exact, the cut group was never completed; pages of
                    * the cut that this sequence holds alone leave the index */
} cut_mode;

static kvc_status cut(kvc_cache *c, const char *fn, kvc_seq_id seq, int64_t n_tokens,
                      cut_mode mode, int64_t *n_kept) {
    KVC_CHECK(c != NULL, "%s: cache is NULL", fn);
    kvc__seq *s;
    int64_t pos;
    KVC_TRY(find(c, fn, seq, &s, &pos));
    KVC_CHECK(n_tokens >= 0 && n_tokens <= s->len, "%s: n_tokens %lld outside [0, %lld]", fn,
              (long long)n_tokens, (long long)s->len);
    const int32_t ps = c->ps, G = c->group;
    int64_t m = n_tokens;
    if (mode != CUT_UNWRITTEN && m < s->len / G * G && m % G != 0) {
        if (mode == CUT_STRICT)
            return kvc__error(KVC_ERR_INVALID_ARG,
                              "%s: length %lld of sequence %lld is inside K group [%lld, %lld), "
                              "already quantized (%s, length %lld): its values are gone; use "
                              "kvc_cache_truncate_ex, which keeps the %lld tokens of the whole "
                              "groups before it", fn, (long long)m, (long long)seq,
                              (long long)(m / G * G), (long long)(m / G * G + G),
                              kvc_kv_format_name(c->fmt.id), (long long)s->len,
                              (long long)(m / G * G));
        m = m / G * G;
    }
    const int64_t keep = (m + ps - 1) / ps;
    /* pages of whole units before m stay registered; the rest may not */
    const int64_t whole = m / c->unit * c->unit / ps;
    if (mode == CUT_UNWRITTEN)
        /* from the first page not in whole units: in a compressed format the
         * kept pages of the cut group were reserved (and registered) by the
         * step that did not run, but never written */
        for (int64_t j = whole; j < s->n_pages; j++) {
            kvc__page *pg = &c->pages[s->pages[j]];
            if (pg->ref == 1 && pg->in_index) kvc__index_remove(c, s->pages[j]);
        }
    release_tail(c, s, keep);
    if (m % ps != 0) {
        int32_t last = s->pages[s->n_pages - 1];
        /* unshared: it will be written in place, so it stops being findable now;
         * shared: the next append copies it */
        if (c->pages[last].ref == 1 && c->pages[last].in_index) kvc__index_remove(c, last);
    }
    s->len = m;
    if (s->known > m) s->known = m;
    if (s->nh > whole) s->nh = whole;
    rescan_chains(c);
    if (n_kept) *n_kept = m;
    return KVC_OK;
}

kvc_status kvc_cache_truncate(kvc_cache *c, kvc_seq_id seq, int64_t n_tokens) {
    return cut(c, "kvc_cache_truncate", seq, n_tokens, CUT_STRICT, NULL);
}

kvc_status kvc_cache_truncate_ex(kvc_cache *c, kvc_seq_id seq, int64_t n_tokens,
                                 int64_t *n_kept) {
    return cut(c, "kvc_cache_truncate_ex", seq, n_tokens, CUT_ROUND, n_kept);
}

kvc_status kvc_cache_rollback(kvc_cache *c, kvc_seq_id seq, int64_t n_tokens) {
    return cut(c, "kvc_cache_rollback", seq, n_tokens, CUT_UNWRITTEN, NULL);
}

kvc_status kvc_cache_free_sequence(kvc_cache *c, kvc_seq_id seq) {
    static const char fn[] = "kvc_cache_free_sequence";
    KVC_CHECK(c != NULL, "%s: cache is NULL", fn);
    kvc__seq *s;
    int64_t pos;
    KVC_TRY(find(c, fn, seq, &s, &pos));
    release_tail(c, s, 0);
    memmove(c->seqs + pos, c->seqs + pos + 1, (size_t)(c->n_seqs - pos - 1) * sizeof(*c->seqs));
    c->n_seqs--;
    seq_release(c, s);
    return KVC_OK;
}
