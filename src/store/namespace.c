/*
 * Digests of a GGUF model for store namespaces (docs/KV_STORE.md section 2):
 * the weights (every tensor's name, type, shape and bytes, in file order)
 * and the tokenizer (every tokenizer.* pair but the chat templates, with
 * its type and value). Each field is length-prefixed, so no two different
 * files hash the same bytes.
 */
#define XXH_INLINE_ALL
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "../core/internal.h"
#include "kvcache/gguf.h"
#include "store_internal.h"

static void upd_u64(XXH3_state_t *st, uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
    XXH3_128bits_update(st, b, 8);
}

static void upd_str(XXH3_state_t *st, const char *s, size_t n) {
    upd_u64(st, n);
    XXH3_128bits_update(st, s, n);
}

static kvc_store_key digest(XXH3_state_t *st) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits_digest(st));
    kvc_store_key k;
    memcpy(k.b, c.digest, 16);
    return k;
}

static size_t elem_bytes(kvc_gguf_type t) {
    switch (t) {
    case KVC_GGUF_UINT8: case KVC_GGUF_INT8: case KVC_GGUF_BOOL: return 1;
    case KVC_GGUF_UINT16: case KVC_GGUF_INT16: return 2;
    case KVC_GGUF_UINT32: case KVC_GGUF_INT32: case KVC_GGUF_FLOAT32: return 4;
    case KVC_GGUF_UINT64: case KVC_GGUF_INT64: case KVC_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

static kvc_status hash_value(const kvc_gguf *g, const char *key, XXH3_state_t *st) {
    const int64_t i = kvc_gguf_find_key(g, key);
    kvc_gguf_type type, et;
    int64_t n = 0;
    KVC_TRY(kvc_gguf_kv_type(g, i, &type, &et, &n));
    upd_u64(st, (uint64_t)type);
    if (type == KVC_GGUF_STRING) {
        const char *s;
        size_t len;
        KVC_TRY(kvc_gguf_get_str(g, key, &s, &len));
        upd_str(st, s, len);
    } else if (type == KVC_GGUF_ARRAY) {
        const void *data = NULL;
        KVC_TRY(kvc_gguf_get_arr(g, key, &et, &n, &data));
        upd_u64(st, (uint64_t)et);
        upd_u64(st, (uint64_t)n);
        if (et == KVC_GGUF_STRING) {
            for (int64_t j = 0; j < n; j++) {
                const char *s;
                size_t len;
                KVC_TRY(kvc_gguf_get_arr_str(g, key, j, &s, &len));
                upd_str(st, s, len);
            }
        } else if (data && elem_bytes(et)) {
            XXH3_128bits_update(st, data, (size_t)n * elem_bytes(et));
        } else {
            return kvc__error(KVC_ERR_UNSUPPORTED, "store: cannot digest GGUF key %s (an array "
                              "of arrays)", key);
        }
    } else if (type == KVC_GGUF_FLOAT32 || type == KVC_GGUF_FLOAT64 || type == KVC_GGUF_UINT64) {
        /* by the bits of their binary64 value (get_i64 refuses a uint64
         * above INT64_MAX, so uint64 goes this way too) */
        double d;
        KVC_TRY(kvc_gguf_get_f64(g, key, &d));
        uint64_t u;
        memcpy(&u, &d, 8);
        upd_u64(st, u);
    } else {
        int64_t v;
        KVC_TRY(kvc_gguf_get_i64(g, key, &v));
        upd_u64(st, (uint64_t)v);
    }
    return KVC_OK;
}

kvc_status kvc_store_gguf_digests(const char *path, kvc_store_key *model_digest,
                                  kvc_store_key *tokenizer_digest) {
    static const char fn[] = "kvc_store_gguf_digests";
    KVC_CHECK(path != NULL && model_digest != NULL && tokenizer_digest != NULL,
              "%s: path and outputs must not be NULL", fn);
    kvc_gguf *g = NULL;
    KVC_TRY(kvc_gguf_open(path, &g));
    XXH3_state_t *st = malloc(sizeof *st);
    if (!st) {
        kvc_gguf_close(g);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    }
    kvc_status rc = KVC_OK;
    XXH3_128bits_reset(st);
    const int64_t nt = kvc_gguf_n_tensors(g);
    upd_u64(st, (uint64_t)nt);
    for (int64_t i = 0; i < nt && rc == KVC_OK; i++) {
        kvc_gguf_tensor t;
        rc = kvc_gguf_get_tensor(g, i, &t);
        if (rc != KVC_OK) break;
        upd_str(st, t.name, strlen(t.name));
        upd_u64(st, (uint64_t)t.type);
        for (int d = 0; d < 4; d++) upd_u64(st, (uint64_t)t.ne[d]);
        upd_u64(st, t.size);
        XXH3_128bits_update(st, t.data, t.size);
    }
    kvc_store_key md = digest(st);
    XXH3_128bits_reset(st);
    for (int64_t i = 0; i < kvc_gguf_n_kv(g) && rc == KVC_OK; i++) {
        const char *k = kvc_gguf_key(g, i);
        if (!k || strncmp(k, "tokenizer.", 10) != 0 ||
            strncmp(k, "tokenizer.chat_template", 23) == 0)
            continue;
        upd_str(st, k, strlen(k));
        rc = hash_value(g, k, st);
    }
    kvc_store_key td = digest(st);
    free(st);
    kvc_gguf_close(g);
    if (rc != KVC_OK) return rc;
    *model_digest = md;
    *tokenizer_digest = td;
    return KVC_OK;
}

kvc_status kvc_store_model_namespace(const char *gguf_path, const kvc_model *model,
                                     const kvc_cache_params *cp, const void *salt,
                                     size_t salt_len, kvc_store_key *out) {
    static const char fn[] = "kvc_store_model_namespace";
    KVC_CHECK(gguf_path != NULL && model != NULL && cp != NULL && out != NULL,
              "%s: gguf_path, model, cache_params and out must not be NULL", fn);
    kvc_model_info in;
    KVC_TRY(kvc_model_get_info(model, &in));
    kvc_store_namespace_desc d;
    memset(&d, 0, sizeof d);
    KVC_TRY(kvc_store_gguf_digests(gguf_path, &d.model_digest, &d.tokenizer_digest));
    d.n_layers = in.n_layer;
    d.n_kv_heads = in.n_head_kv;
    d.head_dim = in.head_dim;
    d.n_rot = in.n_rot;
    d.rope_neox = in.rope_neox;
    d.rope_freq_factors = in.rope_freq_factors;
    d.rope_freq_base = in.rope_freq_base;
    d.rope_scale = in.rope_scale;
    d.cache = *cp;
    d.salt = salt;
    d.salt_len = salt_len;
    return kvc_store_namespace(&d, out);
}
