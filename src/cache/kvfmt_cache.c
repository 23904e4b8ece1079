/*
 * Cache manager side of the compressed paged KV formats (kvfmt.h,
 * docs/KV_FORMATS.md section 5): the format and storage views, the
 * sequences as the kernels see them, and the per-sequence tails.
 *
 * The group rules themselves (prefix hits and registered pages in whole
 * groups, copy-on-write of the incomplete group's pages, truncate) live in
 * sequence.c, where c->group and c->unit make them the per-token rules for
 * a per-token cache (G 1, unit P).
 */
#include <string.h>

#include "cache_internal.h"

uint16_t *kvc__tails_alloc(kvc_cache *c, const uint16_t *src) {
    const size_t n = kvc__tails_bytes(c);
    uint16_t *t = kvc__cache_alloc(c, n);
    if (!t) return NULL;
    /* zeros rather than whatever the allocator had: nothing reads slots
     * beyond a sequence's length, but the bytes stay deterministic */
    if (src) memcpy(t, src, n);
    else memset(t, 0, n);
    return t;
}

kvc_status kvc__sink_reserve(kvc_cache *c, const char *fn) {
    if (!c->sinks || c->spare_sink) return KVC_OK;
    c->spare_sink = kvc__cache_alloc(c, kvc__sinks_bytes(c));
    if (!c->spare_sink)
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (%zu bytes of sink rows)", fn,
                          kvc__sinks_bytes(c));
    return KVC_OK;
}

void kvc__sink_attach(kvc_cache *c, int32_t page) {
    if (!c->sinks) return;
    if (!c->sinks[page]) {
        c->sinks[page] = c->spare_sink; /* reserved by the caller */
        c->spare_sink = NULL;
    }
    memset(c->sinks[page], 0, kvc__sinks_bytes(c)); /* deterministic until written */
}

void kvc__sink_drop(kvc_cache *c, int32_t page) {
    if (!c->sinks || !c->sinks[page]) return;
    if (!c->spare_sink) c->spare_sink = c->sinks[page]; /* the next attach needs none */
    else kvc__cache_free(c, c->sinks[page]);
    c->sinks[page] = NULL;
}

static kvc_status need_kvfmt(const kvc_cache *c, const char *fn) {
    KVC_CHECK(c != NULL, "%s: cache is NULL", fn);
    KVC_CHECK(c->kvfmt, "%s: the cache is a per-token cache (kv_format none, dtype %s), not a "
              "compressed format", fn, kvc_dtype_name(c->p.dtype));
    return KVC_OK;
}

kvc_status kvc_cache_kvfmt(const kvc_cache *c, kvc_kvfmt *out) {
    static const char fn[] = "kvc_cache_kvfmt";
    KVC_TRY(need_kvfmt(c, fn));
    KVC_CHECK(out != NULL, "%s: out is NULL", fn);
    *out = c->fmt;
    return KVC_OK;
}

kvc_status kvc_cache_kvfmt_layer(const kvc_cache *c, int32_t layer, kvc_tensor *pages) {
    static const char fn[] = "kvc_cache_kvfmt_layer";
    KVC_TRY(need_kvfmt(c, fn));
    KVC_CHECK(pages != NULL, "%s: pages is NULL", fn);
    KVC_CHECK(layer >= 0 && layer < c->p.num_layers, "%s: layer %d outside [0, %d)", fn,
              (int)layer, (int)c->p.num_layers);
    const int64_t shape[2] = {c->num_pages, (int64_t)c->page_data_bytes};
    *pages = kvc_tensor_make(c->data + (size_t)layer * c->layer_data_bytes, KVC_U8, 2, shape);
    return KVC_OK;
}

kvc_status kvc_cache_kvfmt_seqs(const kvc_cache *c, int32_t layer, const kvc_seq_id *seqs,
                                int64_t n_seqs, kvc_kvfmt_seq *out) {
    static const char fn[] = "kvc_cache_kvfmt_seqs";
    KVC_TRY(need_kvfmt(c, fn));
    KVC_CHECK(layer >= 0 && layer < c->p.num_layers, "%s: layer %d outside [0, %d)", fn,
              (int)layer, (int)c->p.num_layers);
    KVC_CHECK(n_seqs >= 0, "%s: n_seqs must be >= 0, got %lld", fn, (long long)n_seqs);
    KVC_CHECK(n_seqs == 0 || (seqs != NULL && out != NULL),
              "%s: seqs and out must not be NULL", fn);
    for (int64_t b = 0; b < n_seqs; b++) /* all found before anything is written */
        if (!kvc__find_seq(c, seqs[b], NULL))
            return kvc__error(KVC_ERR_NOT_FOUND, "%s: unknown sequence %lld (seqs[%lld])", fn,
                              (long long)seqs[b], (long long)b);
    const size_t per_layer = c->tail_bytes / sizeof(uint16_t);
    const size_t sink_layer = c->sink_bytes / sizeof(uint16_t);
    for (int64_t b = 0; b < n_seqs; b++) {
        /* seqs read again: out overlapping it (core.h: undefined) may have
         * changed it; an id no longer found gives an empty sequence, not a crash */
        const kvc__seq *s = kvc__find_seq(c, seqs[b], NULL);
        if (!s) {
            memset(&out[b], 0, sizeof out[b]);
            continue;
        }
        out[b].pages = s->pages;
        out[b].n_kv = s->len;
        out[b].tail = s->tail + (size_t)layer * per_layer;
        /* the first page's sink rows (kvc_cache_check: every first page has them) */
        out[b].sink = c->sinks && s->n_pages > 0 && c->sinks[s->pages[0]]
                          ? c->sinks[s->pages[0]] + (size_t)layer * sink_layer
                          : NULL;
    }
    return KVC_OK;
}
