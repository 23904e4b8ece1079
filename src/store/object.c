/*
 * Namespaces, keys and page objects (docs/KV_STORE.md sections 2 and 3).
 * Everything here is a pure function of its inputs: no seed, no clock, no
 * host byte order (integers are written little-endian byte by byte).
 */
#define XXH_INLINE_ALL
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#ifdef KVC_HAVE_SODIUM
#include <sodium.h>
#endif

#include "../core/internal.h"
#include "store_internal.h"

/* ---- little-endian fields -------------------------------------------------- */

static void put_u16(unsigned char *p, uint16_t v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}
static void put_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void put_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint16_t get_u16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t get_u32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static uint64_t get_u64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static kvc_store_key canon(XXH128_hash_t h) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, h);
    kvc_store_key k;
    memcpy(k.b, c.digest, 16);
    return k;
}

uint64_t kvc__store_hash64(const void *a, size_t na, uint64_t seed) {
    return XXH3_64bits_withSeed(a, na, seed);
}

/* ---- namespace --------------------------------------------------------------- */

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

kvc_status kvc_store_namespace(const kvc_store_namespace_desc *d, kvc_store_key *out) {
    static const char fn[] = "kvc_store_namespace";
    KVC_CHECK(d != NULL && out != NULL, "%s: desc and out must not be NULL", fn);
    KVC_CHECK(d->salt != NULL || d->salt_len == 0, "%s: salt is NULL with salt_len %zu", fn,
              d->salt_len);
    const kvc_cache_params *c = &d->cache;
    KVC_CHECK(d->n_layers >= 1 && d->n_kv_heads >= 1 && d->head_dim >= 1 && c->page_size >= 1,
              "%s: n_layers, n_kv_heads, head_dim and page_size must be >= 1", fn);
    char mh[33], th[33], text[1024];
    kvc__store_key_hex(&d->model_digest, mh);
    kvc__store_key_hex(&d->tokenizer_digest, th);
    int n = snprintf(text, sizeof text,
                     "kvcache-namespace 1\nmodel %s\ntokenizer %s\nlayers %d\nkv_heads %d\n"
                     "head_dim %d\nrope n_rot %d neox %d freq_factors %d base %08x scale %08x\n"
                     "page_size %d\n",
                     mh, th, (int)d->n_layers, (int)d->n_kv_heads, (int)d->head_dim,
                     (int)d->n_rot, (int)(d->rope_neox != 0), (int)(d->rope_freq_factors != 0),
                     (unsigned)f32_bits(d->rope_freq_base), (unsigned)f32_bits(d->rope_scale),
                     (int)c->page_size);
    if (c->kv_format != KVC_KVFMT_NONE) {
        kvc_kvfmt f;
        KVC_TRY(kvc_kvfmt_make(c->kv_format, d->n_kv_heads, d->head_dim, c->page_size, &f));
        n += snprintf(text + n, sizeof text - (size_t)n,
                      "kv %s bits %d group %d v_group %d v_asym %d rotate_v %d window %d k_codes "
                      "%s",
                      kvc_kv_format_name(c->kv_format), (int)f.bits, (int)f.group,
                      (int)f.v_group, (int)f.v_asym, (int)f.rotate_v, (int)f.window,
                      f.bits == 8 ? "channel-pairs" : "channel-major");
        /* only when set: formats without sink rows keep their namespaces */
        if (f.sink) n += snprintf(text + n, sizeof text - (size_t)n, " sink %d", (int)f.sink);
        n += snprintf(text + n, sizeof text - (size_t)n, "\n");
    } else {
        const int q = c->dtype == KVC_I8 || c->dtype == KVC_I4;
        KVC_CHECK(c->dtype >= 0 && c->dtype < KVC_DTYPE_COUNT, "%s: bad dtype %d", fn,
                  (int)c->dtype);
        n += snprintf(text + n, sizeof text - (size_t)n, "kv %s layout %s", kvc_dtype_name(c->dtype),
                      c->layout == KVC_HND ? "HND" : "NHD");
        if (q)
            n += snprintf(text + n, sizeof text - (size_t)n, " group %d scale %s",
                          (int)c->quant_group, kvc_dtype_name(c->scale_dtype));
        n += snprintf(text + n, sizeof text - (size_t)n, "\n");
    }
    n += snprintf(text + n, sizeof text - (size_t)n, "salt %zu:", d->salt_len);
    /* the salt's bytes follow the text (any bytes, length-prefixed) */
    kvc__store_hash128(text, (size_t)n, d->salt, d->salt_len, out);
    return KVC_OK;
}

kvc_status kvc_store_page_keys(const kvc_store_key *ns, const int32_t *tokens, int64_t n_pages,
                               int32_t page_size, int32_t unit_pages, kvc_store_key *keys) {
    static const char fn[] = "kvc_store_page_keys";
    KVC_CHECK(ns != NULL && (tokens != NULL || n_pages == 0) && (keys != NULL || n_pages == 0),
              "%s: ns, tokens and keys must not be NULL", fn);
    KVC_CHECK(n_pages >= 0 && page_size >= 1 && page_size <= (1 << 20) && unit_pages >= 1 &&
                  unit_pages <= (1 << 20),
              "%s: n_pages %lld must be >= 0, page_size %d and unit_pages %d in [1, 2^20]", fn,
              (long long)n_pages, (int)page_size, (int)unit_pages);
    KVC_CHECK(n_pages % unit_pages == 0, "%s: n_pages %lld is not a whole number of units of %d "
              "pages", fn, (long long)n_pages, (int)unit_pages);
    unsigned char buf[16 + 4 * 256];
    kvc_store_key parent = *ns;
    for (int64_t i = 0; i < n_pages; i++) {
        /* the ids of the page's whole unit: with K groups longer than a page,
         * a page's bytes depend on its group's every token */
        const int64_t u0 = i / unit_pages * unit_pages;
        const int32_t *t = tokens + u0 * page_size;
        const int64_t nt = (int64_t)unit_pages * page_size;
        XXH3_state_t st;
        XXH3_128bits_reset(&st);
        memcpy(buf, parent.b, 16);
        size_t n = 16;
        for (int64_t j = 0; j < nt; j++) {
            put_u32(buf + n, (uint32_t)t[j]);
            n += 4;
            if (n == sizeof buf) {
                XXH3_128bits_update(&st, buf, n);
                n = 0;
            }
        }
        if (unit_pages > 1) { /* which page of the unit */
            put_u32(buf + n, (uint32_t)(i - u0));
            n += 4;
        }
        XXH3_128bits_update(&st, buf, n);
        keys[i] = parent = canon(XXH3_128bits_digest(&st));
    }
    return KVC_OK;
}

int32_t kvc__store_unit_pages(const kvc_cache *cache) {
    kvc_kvfmt f;
    kvc_cache_params p;
    if (kvc_cache_get_params(cache, &p) != KVC_OK) return 1;
    if (p.kv_format == KVC_KVFMT_NONE || kvc_cache_kvfmt(cache, &f) != KVC_OK) {
        kvc_clear_error();
        return 1;
    }
    return f.group > p.page_size ? f.group / p.page_size : 1;
}

/* ---- objects ----------------------------------------------------------------- */

static const unsigned char magic[8] = {'K', 'V', 'C', 'P', 'A', 'G', 'E', 0};

const char *kvc_store_miss_name(kvc_store_miss m) {
    static const char *const names[] = {"absent",  "truncated", "magic",     "version",
                                        "header",  "geometry",  "payload",   "auth",
                                        "namespace", "key",     "tokens"};
    return m >= 0 && m < KVC_STORE_MISS_COUNT ? names[m] : "?";
}

/* Payload bytes of the object at position: the page of every layer, then
 * for a sequence's first page of a format with sink rows, those rows. */
static size_t payload_bytes(const kvc_cache *cache, int64_t position) {
    return kvc_cache_page_bytes(cache) + (position == 0 ? kvc_cache_sink_bytes(cache) : 0);
}

size_t kvc__store_object_size(const kvc_cache *cache, int64_t position, int auth) {
    kvc_cache_params p;
    if (!cache || kvc_cache_get_params(cache, &p) != KVC_OK) return 0;
    return KVC_STORE_HEADER_BYTES + (size_t)p.page_size * 4 + payload_bytes(cache, position) +
           (auth ? KVC_STORE_AUTH_TAG_BYTES : 0);
}

/* The largest object: a first page's, which carries the sink rows if any. */
size_t kvc_store_object_bytes(const kvc_cache *cache, int auth) {
    return kvc__store_object_size(cache, 0, auth);
}

kvc_status kvc__store_apply_payload(kvc_cache *cache, int32_t page_id, const void *obj) {
    kvc_cache_params p;
    KVC_TRY(kvc_cache_get_params(cache, &p));
    const unsigned char *o = obj, *pl = o + KVC_STORE_HEADER_BYTES + (size_t)p.page_size * 4;
    const size_t np = kvc_cache_page_bytes(cache);
    const size_t ns = payload_bytes(cache, (int64_t)get_u64(o + 64)) - np;
    if (ns > 0) KVC_TRY(kvc_cache_write_sink(cache, page_id, pl + np, ns)); /* first: no half */
    return kvc_cache_write_page(cache, page_id, pl, np);
}

/* Tokens as little-endian bytes then the payload: what the payload
 * checksum covers. */
static void payload_sum(const unsigned char *tok_bytes, size_t nt, const unsigned char *payload,
                        size_t np, unsigned char out[16]) {
    kvc_store_key k;
    kvc__store_hash128(tok_bytes, nt, payload, np, &k);
    memcpy(out, k.b, 16);
}

static kvc_status auth_tag(const uint8_t *key, const unsigned char *obj, size_t n,
                           unsigned char tag[KVC_STORE_AUTH_TAG_BYTES]) {
#ifdef KVC_HAVE_SODIUM
    if (sodium_init() < 0)
        return kvc__error(KVC_ERR_INTERNAL, "store: libsodium failed to initialize");
    crypto_generichash(tag, KVC_STORE_AUTH_TAG_BYTES, obj, n, key, KVC_STORE_AUTH_KEY_BYTES);
    return KVC_OK;
#else
    (void)key, (void)obj, (void)n, (void)tag;
    return kvc__error(KVC_ERR_UNSUPPORTED, "store: authentication needs libsodium (Debian: "
                      "libsodium-dev), which this build lacks");
#endif
}

kvc_status kvc_store_serialize_page(const kvc_cache *cache, int32_t page_id,
                                    const kvc_store_expect *e, const uint8_t *auth_key, void *dst,
                                    size_t cap, size_t *size) {
    static const char fn[] = "kvc_store_serialize_page";
    KVC_CHECK(cache != NULL && e != NULL && dst != NULL && e->tokens != NULL,
              "%s: cache, e, e->tokens and dst must not be NULL", fn);
    kvc_cache_params p;
    KVC_TRY(kvc_cache_get_params(cache, &p));
    KVC_CHECK(e->position >= 0 && e->position % p.page_size == 0,
              "%s: position %lld is not a page start", fn, (long long)e->position);
    const size_t nt = (size_t)p.page_size * 4, np = payload_bytes(cache, e->position);
    const size_t need = kvc__store_object_size(cache, e->position, auth_key != NULL);
    KVC_CHECK(cap >= need, "%s: cap %zu < %zu bytes needed", fn, cap, need);
    unsigned char *o = dst, *tok = o + KVC_STORE_HEADER_BYTES;
    const size_t pb = kvc_cache_page_bytes(cache);
    KVC_TRY(kvc_cache_read_page(cache, page_id, tok + nt, pb));
    if (np > pb) KVC_TRY(kvc_cache_read_sink(cache, page_id, tok + nt + pb, np - pb));
    memset(o, 0, KVC_STORE_HEADER_BYTES);
    memcpy(o, magic, 8);
    put_u16(o + 8, KVC_STORE_OBJ_VERSION);
    put_u16(o + 10, KVC_STORE_HEADER_BYTES);
    put_u32(o + 12, auth_key ? 1u : 0u);
    memcpy(o + 16, e->ns.b, 16);
    memcpy(o + 32, e->key.b, 16);
    memcpy(o + 48, e->parent.b, 16);
    put_u64(o + 64, (uint64_t)e->position);
    put_u32(o + 72, (uint32_t)p.page_size);
    put_u32(o + 76, (uint32_t)p.num_layers);
    put_u64(o + 80, (uint64_t)(pb / (size_t)p.num_layers));
    put_u64(o + 88, (uint64_t)np);
    for (int32_t i = 0; i < p.page_size; i++) put_u32(tok + 4 * i, (uint32_t)e->tokens[i]);
    payload_sum(tok, nt, tok + nt, np, o + 96);
    kvc_store_key h;
    kvc__store_hash128(o, 112, NULL, 0, &h);
    memcpy(o + 112, h.b, 16);
    if (auth_key) KVC_TRY(auth_tag(auth_key, o, need - KVC_STORE_AUTH_TAG_BYTES,
                                   o + need - KVC_STORE_AUTH_TAG_BYTES));
    if (size) *size = need;
    return KVC_OK;
}

static kvc_status miss_(kvc_store_miss *out, kvc_store_miss m, const char *what) {
    if (out) *out = m;
    return kvc__error(KVC_ERR_CORRUPT, "store object refused (%s): %s", kvc_store_miss_name(m),
                      what);
}

int32_t kvc__store_object_ids(const void *obj, size_t size, kvc_store_key *parent,
                              int32_t **ids) {
    const unsigned char *o = obj;
    *ids = NULL;
    if (size < KVC_STORE_HEADER_BYTES || memcmp(o, magic, 8) != 0) return 0;
    const uint32_t n = get_u32(o + 72);
    if (n == 0 || n > (1u << 20) || KVC_STORE_HEADER_BYTES + 4 * (size_t)n > size) return 0;
    int32_t *t = malloc(4 * (size_t)n);
    if (!t) return 0;
    for (uint32_t i = 0; i < n; i++) t[i] = (int32_t)get_u32(o + KVC_STORE_HEADER_BYTES + 4 * i);
    memcpy(parent->b, o + 48, 16);
    *ids = t;
    return (int32_t)n;
}

kvc_status kvc_store_verify_object(const kvc_cache *cache, const void *obj, size_t size,
                                   const kvc_store_expect *e, const uint8_t *auth_key,
                                   kvc_store_miss *miss) {
    static const char fn[] = "kvc_store_verify_object";
    if (miss) *miss = KVC_STORE_MISS_COUNT;
    KVC_CHECK(cache != NULL && obj != NULL && e != NULL && e->tokens != NULL,
              "%s: cache, obj, e and e->tokens must not be NULL", fn);
    kvc_cache_params p;
    KVC_TRY(kvc_cache_get_params(cache, &p));
    const unsigned char *o = obj;
    if (size < KVC_STORE_HEADER_BYTES)
        return miss_(miss, KVC_STORE_MISS_TRUNCATED, "shorter than a header");
    if (memcmp(o, magic, 8) != 0) return miss_(miss, KVC_STORE_MISS_MAGIC, "bad magic");
    /* versions this reader knows: 1 */
    if (get_u16(o + 8) != KVC_STORE_OBJ_VERSION || get_u16(o + 10) != KVC_STORE_HEADER_BYTES)
        return miss_(miss, KVC_STORE_MISS_VERSION, "unknown format version");
    kvc_store_key h;
    kvc__store_hash128(o, 112, NULL, 0, &h);
    if (memcmp(h.b, o + 112, 16) != 0)
        return miss_(miss, KVC_STORE_MISS_HEADER, "header checksum mismatch");
    const uint32_t flags = get_u32(o + 12), n_tok = get_u32(o + 72), n_layers = get_u32(o + 76);
    const uint64_t layer_bytes = get_u64(o + 80), payload = get_u64(o + 88);
    const size_t pb = kvc_cache_page_bytes(cache), nt = (size_t)p.page_size * 4;
    const size_t np = payload_bytes(cache, (int64_t)get_u64(o + 64));
    if (flags > 1) return miss_(miss, KVC_STORE_MISS_VERSION, "unknown flags");
    if (n_tok != (uint32_t)p.page_size || n_layers != (uint32_t)p.num_layers ||
        payload != np || layer_bytes != pb / (size_t)p.num_layers)
        return miss_(miss, KVC_STORE_MISS_GEOMETRY, "page size, layers or payload size differ");
    const size_t tag = (flags & 1) ? KVC_STORE_AUTH_TAG_BYTES : 0;
    if (size != KVC_STORE_HEADER_BYTES + nt + np + tag)
        return miss_(miss, KVC_STORE_MISS_TRUNCATED, "size differs from the header's");
    unsigned char sum[16];
    payload_sum(o + KVC_STORE_HEADER_BYTES, nt, o + KVC_STORE_HEADER_BYTES + nt, np, sum);
    if (memcmp(sum, o + 96, 16) != 0)
        return miss_(miss, KVC_STORE_MISS_PAYLOAD, "payload checksum mismatch");
    if (auth_key) {
        unsigned char t[KVC_STORE_AUTH_TAG_BYTES];
        if (!tag) return miss_(miss, KVC_STORE_MISS_AUTH, "no authentication tag");
        KVC_TRY(auth_tag(auth_key, o, size - tag, t));
        unsigned char diff = 0; /* constant time */
        for (int i = 0; i < KVC_STORE_AUTH_TAG_BYTES; i++) diff |= t[i] ^ o[size - tag + i];
        if (diff) return miss_(miss, KVC_STORE_MISS_AUTH, "authentication tag mismatch");
    }
    if (memcmp(o + 16, e->ns.b, 16) != 0)
        return miss_(miss, KVC_STORE_MISS_NAMESPACE, "another namespace");
    if (memcmp(o + 32, e->key.b, 16) != 0 || memcmp(o + 48, e->parent.b, 16) != 0)
        return miss_(miss, KVC_STORE_MISS_KEY, "key or parent key differ");
    if (get_u64(o + 64) != (uint64_t)e->position)
        return miss_(miss, KVC_STORE_MISS_TOKENS, "position differs");
    for (int32_t i = 0; i < p.page_size; i++)
        if (get_u32(o + KVC_STORE_HEADER_BYTES + 4 * (size_t)i) != (uint32_t)e->tokens[i])
            return miss_(miss, KVC_STORE_MISS_TOKENS, "token ids differ");
    return KVC_OK;
}

kvc_status kvc_store_restore_page(kvc_cache *cache, int32_t page_id, const void *obj, size_t size,
                                  const kvc_store_expect *e, const uint8_t *auth_key,
                                  kvc_store_miss *miss) {
    KVC_TRY(kvc_store_verify_object(cache, obj, size, e, auth_key, miss));
    return kvc__store_apply_payload(cache, page_id, obj);
}
