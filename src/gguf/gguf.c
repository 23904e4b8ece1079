/*
 * GGUF reader (versions 2 and 3), see include/kvcache/gguf.h.
 *
 * kvc_gguf_open maps the file read-only and hands the mapping to the same
 * parser kvc_gguf_open_memory uses. The parser walks the whole header once
 * and validates everything an accessor could later touch:
 *
 *   header      magic, version (2/3), tensor and key-value counts bounded by
 *               what the remaining bytes could hold (checked before any
 *               allocation, so a header claiming 2^62 entries fails at once)
 *   key-values  key non-empty, without NUL bytes, unique; value type known;
 *               every string length and array extent inside the file; bools
 *               0 or 1; arrays of arrays up to GGUF_MAX_DEPTH levels;
 *               general.alignment a uint32 power of two
 *   tensors     name non-empty, without NUL bytes, unique; 1..4 dims, each
 *               > 0, element count and byte size fitting int64; ggml type
 *               known; ne[0] a multiple of the type's block size; offset a
 *               multiple of the alignment; data inside the file; no two
 *               tensors overlapping
 *
 * What is kept: a table of key-values (offsets into the image), one of
 * tensors, hash indexes for both (find_key/find_tensor are O(1)), a copy of
 * every key and tensor name with a NUL appended, and for each string array
 * the offset of every element (get_arr_str is O(1)). Accessors then only
 * index these tables: they cannot read outside the image.
 *
 * Integers are decoded byte by byte as little-endian, so the reader works on
 * any host; numeric array data is handed out raw (little-endian, unaligned).
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../core/internal.h"
#include "gguf_internal.h"
#include "kvcache/gguf.h"

/* Levels of array nesting accepted: 1 = plain arrays, 2 = arrays of arrays. */
#define GGUF_MAX_DEPTH 4
#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_HEADER_BYTES 24u /* magic, version, n_tensors, n_kv */
/* Smallest possible key-value pair: key length + 1 key byte + type + 1-byte value. */
#define GGUF_MIN_KV_BYTES (8u + 1u + 4u + 1u)
/* Smallest possible tensor info: name length + 1 byte + n_dims + 1 dim + type + offset. */
#define GGUF_MIN_TENSOR_BYTES (8u + 1u + 4u + 8u + 4u + 8u)

/* ---- ggml type table ----------------------------------------------------- */

typedef struct ggml_type_info {
    const char *name;
    int64_t block_size;  /* elements per block */
    int64_t block_bytes; /* bytes per block */
} ggml_type_info;

/* Block layouts as ggml defines them (ggml-common.h): e.g. Q4_1 is
 * {f16 d, f16 m, 16 bytes of nibbles} per 32 elements = 20 bytes; Q8_1 is
 * {f16 d, f16 s, 32 int8} = 36 bytes (older ggml used two f32: 40). */
static const ggml_type_info ggml_types[] = {
    [KVC_GGML_F32] = {"F32", 1, 4},        [KVC_GGML_F16] = {"F16", 1, 2},
    [KVC_GGML_Q4_0] = {"Q4_0", 32, 18},    [KVC_GGML_Q4_1] = {"Q4_1", 32, 20},
    [KVC_GGML_Q5_0] = {"Q5_0", 32, 22},    [KVC_GGML_Q5_1] = {"Q5_1", 32, 24},
    [KVC_GGML_Q8_0] = {"Q8_0", 32, 34},    [KVC_GGML_Q8_1] = {"Q8_1", 32, 36},
    [KVC_GGML_Q2_K] = {"Q2_K", 256, 84},   [KVC_GGML_Q3_K] = {"Q3_K", 256, 110},
    [KVC_GGML_Q4_K] = {"Q4_K", 256, 144},  [KVC_GGML_Q5_K] = {"Q5_K", 256, 176},
    [KVC_GGML_Q6_K] = {"Q6_K", 256, 210},  [KVC_GGML_Q8_K] = {"Q8_K", 256, 292},
    [KVC_GGML_BF16] = {"BF16", 1, 2},
    /* known by name and size only (ggml 0a50d99's ggml.h / ggml-common.h): a
     * file holding them opens, and whatever needs their values says which
     * type it does not decode */
    [KVC_GGML_IQ4_NL] = {"IQ4_NL", 32, 18},
    [16] = {"IQ2_XXS", 256, 66}, [17] = {"IQ2_XS", 256, 74},  [18] = {"IQ3_XXS", 256, 98},
    [19] = {"IQ1_S", 256, 50},   [21] = {"IQ3_S", 256, 110},  [22] = {"IQ2_S", 256, 82},
    [23] = {"IQ4_XS", 256, 136}, [24] = {"I8", 1, 1},         [25] = {"I16", 1, 2},
    [26] = {"I32", 1, 4},        [27] = {"I64", 1, 8},        [28] = {"F64", 1, 8},
    [29] = {"IQ1_M", 256, 56},   [34] = {"TQ1_0", 256, 54},   [35] = {"TQ2_0", 256, 66},
    [39] = {"MXFP4", 32, 17},    [40] = {"NVFP4", 64, 36},    [41] = {"Q1_0", 128, 18},
    [42] = {"Q2_0", 64, 18},
};

static const ggml_type_info *ggml_type_lookup(int64_t type) {
    if (type < 0 || type >= (int64_t)(sizeof ggml_types / sizeof ggml_types[0])) return NULL;
    return ggml_types[type].name ? &ggml_types[type] : NULL;
}

const char *kvc_ggml_type_name(int32_t type) {
    const ggml_type_info *t = ggml_type_lookup(type);
    return t ? t->name : NULL;
}

int64_t kvc_ggml_block_size(int32_t type) {
    const ggml_type_info *t = ggml_type_lookup(type);
    return t ? t->block_size : 0;
}

int64_t kvc_ggml_block_bytes(int32_t type) {
    const ggml_type_info *t = ggml_type_lookup(type);
    return t ? t->block_bytes : 0;
}

/* ---- value types ----------------------------------------------------------- */

#define GGUF_N_VALUE_TYPES 13 /* UINT8 .. FLOAT64 */

/* Bytes of a fixed-size value, 0 for STRING/ARRAY. type < GGUF_N_VALUE_TYPES. */
static uint64_t value_size(uint32_t type) {
    static const uint8_t sizes[GGUF_N_VALUE_TYPES] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return sizes[type];
}

static const char *value_type_name(uint32_t type) {
    static const char *const names[GGUF_N_VALUE_TYPES] = {
        "uint8", "int8", "uint16", "int16", "uint32", "int32",  "float32",
        "bool",  "string", "array", "uint64", "int64", "float64"};
    return type < GGUF_N_VALUE_TYPES ? names[type] : "unknown";
}

static uint64_t load_le(const uint8_t *p, unsigned n) {
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* ---- the handle ------------------------------------------------------------ */

typedef struct gguf_kv {
    const char *key;        /* NUL-terminated copy, in g->names */
    uint64_t key_off;       /* key bytes in the image */
    uint64_t key_len;
    uint32_t type;          /* kvc_gguf_type */
    uint32_t elem_type;     /* arrays: element type; otherwise == type */
    uint64_t n;             /* arrays: element count; otherwise 1 */
    uint64_t off;           /* scalars: the value; strings: the bytes; arrays: element 0 */
    uint64_t len;           /* strings: byte length */
    uint64_t *str_off;      /* string arrays: offset of each element's length field */
} gguf_kv;

typedef struct gguf_tensor {
    const char *name; /* NUL-terminated copy, in g->names */
    uint64_t name_off, name_len;
    int32_t type, n_dims;
    int64_t ne[4];
    uint64_t offset; /* relative to the data section */
    uint64_t size;   /* bytes */
} gguf_tensor;

/* Open-addressing hash index over names: slot -> entry index, -1 empty. */
typedef struct name_index {
    int64_t *slots;
    uint64_t mask;
} name_index;

struct kvc_gguf {
    const uint8_t *base;
    uint64_t size;
    void *map;  /* non-NULL when base is our mmap */
    void *copy; /* non-NULL when base is our read copy (kvc_gguf_open_read) */
    uint32_t version;
    uint32_t alignment;
    uint64_t data_off; /* start of the data section */
    int64_t n_kv, n_tensors;
    gguf_kv *kvs;
    gguf_tensor *tensors;
    name_index kv_index, tensor_index;
    char *names; /* all key and tensor name copies */
};

/* ---- parser ---------------------------------------------------------------- */

typedef struct parser {
    const uint8_t *base;
    uint64_t size;
    uint64_t pos;
    char ctx[96]; /* what is being read: "header", "key 'general.name'", ... */
} parser;

/* Quotes up to 48 bytes of a name from the image for messages, replacing
 * non-printable bytes with '?'. */
static void quote_name(char *dst, size_t dst_size, const uint8_t *s, uint64_t len) {
    size_t n = 0;
    uint64_t max = len < 48 ? len : 48;
    if (dst_size < 8) {
        if (dst_size) dst[0] = '\0';
        return;
    }
    dst[n++] = '\'';
    for (uint64_t i = 0; i < max && n + 5 < dst_size; i++)
        dst[n++] = (s[i] >= 0x20 && s[i] < 0x7f) ? (char)s[i] : '?';
    if (len > max && n + 5 < dst_size) {
        memcpy(dst + n, "...", 3);
        n += 3;
    }
    dst[n++] = '\'';
    dst[n] = '\0';
}

static void set_ctx(parser *ps, const char *kind, const uint8_t *name, uint64_t len) {
    char q[64];
    quote_name(q, sizeof q, name, len);
    snprintf(ps->ctx, sizeof ps->ctx, "%s %s", kind, q);
}

/* Reports a problem found at byte `at` of the image, naming ps->ctx. */
static kvc_status KVC_PRINTF(4, 5)
    fail(const parser *ps, kvc_status st, uint64_t at, const char *fmt, ...) {
    char detail[320];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return kvc__error(st, "GGUF: %s, byte %llu: %s", ps->ctx, (unsigned long long)at, detail);
}

/* Fails unless n more bytes are available; `what` names the field. */
static kvc_status need(const parser *ps, uint64_t n, const char *what) {
    if (n > ps->size - ps->pos)
        return fail(ps, KVC_ERR_CORRUPT, ps->pos,
                    "truncated: %s needs %llu bytes, the file has %llu left", what,
                    (unsigned long long)n, (unsigned long long)(ps->size - ps->pos));
    return KVC_OK;
}

static kvc_status read_u32(parser *ps, uint32_t *v, const char *what) {
    KVC_TRY(need(ps, 4, what));
    *v = (uint32_t)load_le(ps->base + ps->pos, 4);
    ps->pos += 4;
    return KVC_OK;
}

static kvc_status read_u64(parser *ps, uint64_t *v, const char *what) {
    KVC_TRY(need(ps, 8, what));
    *v = load_le(ps->base + ps->pos, 8);
    ps->pos += 8;
    return KVC_OK;
}

/* Reads a string (uint64 length + bytes): *off and *len locate its bytes. */
static kvc_status read_str(parser *ps, uint64_t *off, uint64_t *len, const char *what) {
    uint64_t start = ps->pos;
    KVC_TRY(read_u64(ps, len, what));
    if (*len > ps->size - ps->pos)
        return fail(ps, KVC_ERR_CORRUPT, start,
                    "%s has length %llu, past the end of the file (%llu bytes left)", what,
                    (unsigned long long)*len, (unsigned long long)(ps->size - ps->pos));
    *off = ps->pos;
    ps->pos += *len;
    return KVC_OK;
}

/* Validates a name (key or tensor name): non-empty, no NUL byte. */
static kvc_status check_name(const parser *ps, uint64_t at, uint64_t off, uint64_t len,
                             const char *what) {
    if (len == 0) return fail(ps, KVC_ERR_CORRUPT, at, "empty %s", what);
    if (memchr(ps->base + off, 0, len))
        return fail(ps, KVC_ERR_CORRUPT, at, "%s contains a NUL byte", what);
    return KVC_OK;
}

/* Validates n fixed-size elements of type t at ps->pos and skips them. */
static kvc_status skip_fixed(parser *ps, uint32_t t, uint64_t n) {
    uint64_t esize = value_size(t);
    uint64_t left = ps->size - ps->pos;
    if (n > left / esize)
        return fail(ps, KVC_ERR_CORRUPT, ps->pos,
                    "truncated: %llu %s values need %llu bytes per value, the file has %llu "
                    "bytes left",
                    (unsigned long long)n, value_type_name(t), (unsigned long long)esize,
                    (unsigned long long)left);
    if (t == KVC_GGUF_BOOL) {
        for (uint64_t i = 0; i < n; i++) {
            uint8_t b = ps->base[ps->pos + i];
            if (b > 1)
                return fail(ps, KVC_ERR_CORRUPT, ps->pos + i,
                            "bool value %u (element %llu) is neither 0 nor 1", b,
                            (unsigned long long)i);
        }
    }
    ps->pos += n * esize;
    return KVC_OK;
}

/* Reads an array's element type and count, validates its elements (nested
 * arrays down to GGUF_MAX_DEPTH) and skips them. depth is 1 for an array
 * that is a key's value. */
static kvc_status walk_array(parser *ps, int depth, uint32_t *elem_type, uint64_t *n,
                             uint64_t *first) {
    uint64_t at = ps->pos;
    uint32_t et;
    uint64_t count;
    KVC_TRY(read_u32(ps, &et, "array element type"));
    KVC_TRY(read_u64(ps, &count, "array length"));
    if (et >= GGUF_N_VALUE_TYPES)
        return fail(ps, KVC_ERR_CORRUPT, at, "unknown array element type %u", et);
    *elem_type = et;
    *n = count;
    *first = ps->pos;
    if (et == KVC_GGUF_STRING) {
        /* Each string takes at least its 8-byte length: bound before looping. */
        if (count > (ps->size - ps->pos) / 8)
            return fail(ps, KVC_ERR_CORRUPT, at,
                        "array of %llu strings cannot fit in the %llu bytes left",
                        (unsigned long long)count, (unsigned long long)(ps->size - ps->pos));
        for (uint64_t i = 0; i < count; i++) {
            uint64_t off, len;
            KVC_TRY(read_str(ps, &off, &len, "array string"));
        }
        return KVC_OK;
    }
    if (et == KVC_GGUF_ARRAY) {
        if (depth >= GGUF_MAX_DEPTH)
            return fail(ps, KVC_ERR_CORRUPT, at, "arrays nested more than %d levels deep",
                        GGUF_MAX_DEPTH);
        /* Each nested array takes at least 12 bytes (type + length). */
        if (count > (ps->size - ps->pos) / 12)
            return fail(ps, KVC_ERR_CORRUPT, at,
                        "array of %llu arrays cannot fit in the %llu bytes left",
                        (unsigned long long)count, (unsigned long long)(ps->size - ps->pos));
        for (uint64_t i = 0; i < count; i++) {
            uint32_t inner_type;
            uint64_t inner_n, inner_first;
            KVC_TRY(walk_array(ps, depth + 1, &inner_type, &inner_n, &inner_first));
        }
        return KVC_OK;
    }
    return skip_fixed(ps, et, count);
}

/* ---- growable arrays and the name index ------------------------------------- */

static kvc_status grow(void **arr, int64_t *cap, int64_t need_n, size_t elem) {
    if (need_n <= *cap) return KVC_OK;
    int64_t ncap = *cap ? *cap * 2 : 16;
    if (ncap < need_n) ncap = need_n;
    void *p = realloc(*arr, (size_t)ncap * elem);
    if (!p)
        return kvc__error(KVC_ERR_NOMEM, "GGUF: out of memory growing a table to %lld entries",
                          (long long)ncap);
    *arr = p;
    *cap = ncap;
    return KVC_OK;
}

static uint64_t hash_bytes(const void *p, uint64_t n) {
    const uint8_t *s = p;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (uint64_t i = 0; i < n; i++) h = (h ^ s[i]) * 0x100000001b3ull;
    return h;
}

/* Byte range of entry i's name in the image: a key or a tensor name. */
typedef struct name_ref {
    uint64_t off, len;
} name_ref;
typedef name_ref (*name_of_fn)(const kvc_gguf *g, int64_t i);

static name_ref key_name(const kvc_gguf *g, int64_t i) {
    return (name_ref){g->kvs[i].key_off, g->kvs[i].key_len};
}

static name_ref tensor_name(const kvc_gguf *g, int64_t i) {
    return (name_ref){g->tensors[i].name_off, g->tensors[i].name_len};
}

/* Builds an index over the names of entries [0, count); on a duplicate sets
 * *dup_a < *dup_b to the two entries and stops (the index is then partial,
 * which is fine: the caller fails the open). */
static kvc_status index_build(name_index *ix, const kvc_gguf *g, int64_t count,
                              name_of_fn name_of, int64_t *dup_a, int64_t *dup_b) {
    uint64_t n_slots = 16;
    while (n_slots < (uint64_t)count * 2) n_slots *= 2;
    ix->slots = malloc(n_slots * sizeof *ix->slots);
    if (!ix->slots) return kvc__error(KVC_ERR_NOMEM, "GGUF: out of memory for a name index");
    for (uint64_t s = 0; s < n_slots; s++) ix->slots[s] = -1;
    ix->mask = n_slots - 1;
    *dup_a = *dup_b = -1;
    for (int64_t i = 0; i < count; i++) {
        name_ref r = name_of(g, i);
        uint64_t s = hash_bytes(g->base + r.off, r.len) & ix->mask;
        while (ix->slots[s] >= 0) {
            int64_t j = ix->slots[s];
            name_ref q = name_of(g, j);
            if (q.len == r.len && memcmp(g->base + q.off, g->base + r.off, r.len) == 0) {
                *dup_a = j;
                *dup_b = i;
                return KVC_OK;
            }
            s = (s + 1) & ix->mask;
        }
        ix->slots[s] = i;
    }
    return KVC_OK;
}

/* Index of the entry named name (NUL-terminated), or -1. */
static int64_t index_find(const name_index *ix, const kvc_gguf *g, const char *name,
                          name_of_fn name_of) {
    if (!ix->slots || !name) return -1;
    uint64_t len = strlen(name);
    uint64_t s = hash_bytes(name, len) & ix->mask;
    while (ix->slots[s] >= 0) {
        int64_t j = ix->slots[s];
        name_ref q = name_of(g, j);
        if (q.len == len && memcmp(g->base + q.off, name, len) == 0) return j;
        s = (s + 1) & ix->mask;
    }
    return -1;
}

/* ---- parsing the sections ---------------------------------------------------- */

static kvc_status parse_header(parser *ps, kvc_gguf *g, uint64_t *n_tensors, uint64_t *n_kv) {
    snprintf(ps->ctx, sizeof ps->ctx, "header");
    if (ps->size < 4 || memcmp(ps->base, "GGUF", 4) != 0) {
        if (ps->size < 4)
            return fail(ps, KVC_ERR_CORRUPT, 0,
                        "truncated: %llu bytes is too short for the magic \"GGUF\"",
                        (unsigned long long)ps->size);
        char q[64];
        quote_name(q, sizeof q, ps->base, 4);
        return fail(ps, KVC_ERR_CORRUPT, 0, "bad magic %s, want \"GGUF\": not a GGUF file", q);
    }
    ps->pos = 4;
    KVC_TRY(read_u32(ps, &g->version, "version"));
    if (g->version == 1)
        return fail(ps, KVC_ERR_UNSUPPORTED, 4,
                    "GGUF version 1 is not supported (only versions 2 and 3)");
    if (g->version == 0)
        return fail(ps, KVC_ERR_CORRUPT, 4, "version 0 is not a GGUF version");
    if (g->version > 3) {
        /* A big-endian file (GGUF v3 allows them) has its version byte-swapped. */
        if ((g->version & 0xffffu) == 0 && (g->version >> 24) <= 3)
            return fail(ps, KVC_ERR_UNSUPPORTED, 4,
                        "version field 0x%08x looks like a big-endian GGUF file; only "
                        "little-endian files are supported",
                        g->version);
        return fail(ps, KVC_ERR_UNSUPPORTED, 4,
                    "GGUF version %u is not supported (only versions 2 and 3)", g->version);
    }
    KVC_TRY(read_u64(ps, n_tensors, "tensor count"));
    KVC_TRY(read_u64(ps, n_kv, "key-value count"));
    /* Bound both counts by what the rest of the file could hold before
     * allocating anything for them. */
    uint64_t left = ps->size - ps->pos;
    if (*n_kv > left / GGUF_MIN_KV_BYTES)
        return fail(ps, KVC_ERR_CORRUPT, 16,
                    "the header claims %llu key-value pairs, but the %llu bytes after it can "
                    "hold at most %llu",
                    (unsigned long long)*n_kv, (unsigned long long)left,
                    (unsigned long long)(left / GGUF_MIN_KV_BYTES));
    if (*n_tensors > left / GGUF_MIN_TENSOR_BYTES ||
        *n_kv * GGUF_MIN_KV_BYTES + *n_tensors * GGUF_MIN_TENSOR_BYTES > left)
        return fail(ps, KVC_ERR_CORRUPT, 8,
                    "the header claims %llu tensors and %llu key-value pairs, more than the "
                    "%llu bytes after it can hold",
                    (unsigned long long)*n_tensors, (unsigned long long)*n_kv,
                    (unsigned long long)left);
    return KVC_OK;
}

/* Records the element offsets of the string array kv (already validated). */
static kvc_status index_string_array(const parser *ps, gguf_kv *kv) {
    kv->str_off = malloc(kv->n ? kv->n * sizeof *kv->str_off : 1);
    if (!kv->str_off)
        return fail(ps, KVC_ERR_NOMEM, kv->off, "out of memory indexing %llu strings",
                    (unsigned long long)kv->n);
    uint64_t pos = kv->off;
    for (uint64_t i = 0; i < kv->n; i++) {
        kv->str_off[i] = pos;
        pos += 8 + load_le(ps->base + pos, 8);
    }
    return KVC_OK;
}

static kvc_status parse_kv(parser *ps, int64_t index, gguf_kv *kv) {
    uint64_t at = ps->pos;
    snprintf(ps->ctx, sizeof ps->ctx, "key-value pair %lld", (long long)index);
    KVC_TRY(read_str(ps, &kv->key_off, &kv->key_len, "key name"));
    KVC_TRY(check_name(ps, at, kv->key_off, kv->key_len, "key name"));
    set_ctx(ps, "key", ps->base + kv->key_off, kv->key_len);

    uint64_t type_at = ps->pos;
    KVC_TRY(read_u32(ps, &kv->type, "value type"));
    if (kv->type >= GGUF_N_VALUE_TYPES)
        return fail(ps, KVC_ERR_CORRUPT, type_at, "unknown value type %u", kv->type);
    kv->elem_type = kv->type;
    kv->n = 1;
    kv->off = ps->pos;
    if (kv->type == KVC_GGUF_STRING) return read_str(ps, &kv->off, &kv->len, "string value");
    if (kv->type == KVC_GGUF_ARRAY) {
        KVC_TRY(walk_array(ps, 1, &kv->elem_type, &kv->n, &kv->off));
        if (kv->elem_type == KVC_GGUF_STRING) return index_string_array(ps, kv);
        return KVC_OK;
    }
    return skip_fixed(ps, kv->type, 1);
}

static kvc_status parse_kvs(parser *ps, kvc_gguf *g, uint64_t n_kv) {
    int64_t cap = 0;
    for (uint64_t i = 0; i < n_kv; i++) {
        KVC_TRY(grow((void **)&g->kvs, &cap, g->n_kv + 1, sizeof *g->kvs));
        gguf_kv *kv = &g->kvs[g->n_kv];
        memset(kv, 0, sizeof *kv);
        g->n_kv++; /* counted before parsing so close() frees a partial str_off */
        KVC_TRY(parse_kv(ps, (int64_t)i, kv));
    }
    int64_t a = -1, b = -1;
    KVC_TRY(index_build(&g->kv_index, g, g->n_kv, key_name, &a, &b));
    if (a >= 0) {
        set_ctx(ps, "key", g->base + g->kvs[b].key_off, g->kvs[b].key_len);
        return fail(ps, KVC_ERR_CORRUPT, g->kvs[b].key_off - 8,
                    "duplicate key (pairs %lld and %lld have the same name)", (long long)a,
                    (long long)b);
    }
    return KVC_OK;
}

/* Reads general.alignment if present: a uint32 power of two. */
static kvc_status parse_alignment(parser *ps, kvc_gguf *g) {
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = kvc_gguf_find_key(g, "general.alignment");
    if (i < 0) return KVC_OK;
    const gguf_kv *kv = &g->kvs[i];
    snprintf(ps->ctx, sizeof ps->ctx, "key 'general.alignment'");
    if (kv->type != KVC_GGUF_UINT32)
        return fail(ps, KVC_ERR_CORRUPT, kv->off, "alignment has type %s, must be uint32",
                    value_type_name(kv->type));
    uint32_t a = (uint32_t)load_le(g->base + kv->off, 4);
    if (a == 0 || (a & (a - 1)) != 0)
        return fail(ps, KVC_ERR_CORRUPT, kv->off, "alignment %u is not a power of two", a);
    g->alignment = a;
    return KVC_OK;
}

static kvc_status parse_tensor(parser *ps, const kvc_gguf *g, int64_t index, gguf_tensor *t) {
    uint64_t at = ps->pos;
    snprintf(ps->ctx, sizeof ps->ctx, "tensor info %lld", (long long)index);
    KVC_TRY(read_str(ps, &t->name_off, &t->name_len, "tensor name"));
    KVC_TRY(check_name(ps, at, t->name_off, t->name_len, "tensor name"));
    set_ctx(ps, "tensor", ps->base + t->name_off, t->name_len);

    uint32_t n_dims;
    uint64_t dims_at = ps->pos;
    KVC_TRY(read_u32(ps, &n_dims, "number of dimensions"));
    if (n_dims < 1 || n_dims > 4)
        return fail(ps, KVC_ERR_CORRUPT, dims_at, "%u dimensions, must be 1 to 4", n_dims);
    t->n_dims = (int32_t)n_dims;
    int64_t numel = 1;
    for (int d = 0; d < 4; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        uint64_t ne, ne_at = ps->pos;
        KVC_TRY(read_u64(ps, &ne, "dimension"));
        if (ne == 0) return fail(ps, KVC_ERR_CORRUPT, ne_at, "dimension %u is 0", d);
        if (ne > (uint64_t)INT64_MAX || (int64_t)ne > INT64_MAX / numel)
            return fail(ps, KVC_ERR_CORRUPT, ne_at,
                        "dimension %u = %llu makes the element count overflow int64", d,
                        (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
        numel *= (int64_t)ne;
    }

    uint32_t type;
    uint64_t type_at = ps->pos;
    KVC_TRY(read_u32(ps, &type, "tensor type"));
    const ggml_type_info *ti = ggml_type_lookup(type);
    if (!ti)
        return fail(ps, KVC_ERR_UNSUPPORTED, type_at, "unknown ggml tensor type %u", type);
    t->type = (int32_t)type;
    if (t->ne[0] % ti->block_size != 0)
        return fail(ps, KVC_ERR_CORRUPT, dims_at + 4,
                    "ne[0] = %lld is not a multiple of the %s block size %lld",
                    (long long)t->ne[0], ti->name, (long long)ti->block_size);
    int64_t blocks = numel / ti->block_size;
    if (blocks > INT64_MAX / ti->block_bytes)
        return fail(ps, KVC_ERR_CORRUPT, dims_at + 4,
                    "%lld %s elements overflow int64 bytes", (long long)numel, ti->name);
    t->size = (uint64_t)(blocks * ti->block_bytes);

    uint64_t off_at = ps->pos;
    KVC_TRY(read_u64(ps, &t->offset, "tensor data offset"));
    if (t->offset % g->alignment != 0)
        return fail(ps, KVC_ERR_CORRUPT, off_at,
                    "data offset %llu is not a multiple of the alignment %u",
                    (unsigned long long)t->offset, g->alignment);
    return KVC_OK;
}

static int cmp_by_offset(const void *a, const void *b, const gguf_tensor *ts) {
    uint64_t x = ts[*(const int64_t *)a].offset, y = ts[*(const int64_t *)b].offset;
    return x < y ? -1 : x > y;
}

/* qsort has no context argument in C11: sort indices with a small merge sort. */
static void sort_by_offset(int64_t *idx, int64_t *tmp, int64_t n, const gguf_tensor *ts) {
    if (n < 2) return;
    int64_t h = n / 2;
    sort_by_offset(idx, tmp, h, ts);
    sort_by_offset(idx + h, tmp, n - h, ts);
    int64_t i = 0, j = h, k = 0;
    while (i < h && j < n) tmp[k++] = cmp_by_offset(&idx[j], &idx[i], ts) < 0 ? idx[j++] : idx[i++];
    while (i < h) tmp[k++] = idx[i++];
    while (j < n) tmp[k++] = idx[j++];
    memcpy(idx, tmp, (size_t)n * sizeof *idx);
}

/* Checks every tensor's data lies inside the file and no two overlap. */
static kvc_status check_extents(parser *ps, kvc_gguf *g) {
    if (g->n_tensors == 0) return KVC_OK;
    snprintf(ps->ctx, sizeof ps->ctx, "data section");
    if (g->data_off > g->size)
        return fail(ps, KVC_ERR_CORRUPT, ps->pos,
                    "the data section would start at byte %llu, past the end of the file "
                    "(%llu bytes)",
                    (unsigned long long)g->data_off, (unsigned long long)g->size);
    uint64_t room = g->size - g->data_off;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const gguf_tensor *t = &g->tensors[i];
        if (t->offset > room || t->size > room - t->offset) {
            set_ctx(ps, "tensor", g->base + t->name_off, t->name_len);
            return fail(ps, KVC_ERR_CORRUPT, g->data_off,
                        "data [%llu, +%llu bytes) extends past the end of the file (the data "
                        "section has %llu bytes)",
                        (unsigned long long)t->offset, (unsigned long long)t->size,
                        (unsigned long long)room);
        }
    }
    int64_t *idx = malloc((size_t)g->n_tensors * 2 * sizeof *idx);
    if (!idx) return kvc__error(KVC_ERR_NOMEM, "GGUF: out of memory sorting tensors");
    for (int64_t i = 0; i < g->n_tensors; i++) idx[i] = i;
    sort_by_offset(idx, idx + g->n_tensors, g->n_tensors, g->tensors);
    kvc_status st = KVC_OK;
    for (int64_t k = 1; k < g->n_tensors && st == KVC_OK; k++) {
        const gguf_tensor *a = &g->tensors[idx[k - 1]], *b = &g->tensors[idx[k]];
        if (a->offset + a->size > b->offset) {
            char qa[64];
            quote_name(qa, sizeof qa, g->base + a->name_off, a->name_len);
            set_ctx(ps, "tensor", g->base + b->name_off, b->name_len);
            st = fail(ps, KVC_ERR_CORRUPT, g->data_off + b->offset,
                      "data at offset %llu overlaps tensor %s (offset %llu, %llu bytes)",
                      (unsigned long long)b->offset, qa, (unsigned long long)a->offset,
                      (unsigned long long)a->size);
        }
    }
    free(idx);
    return st;
}

static kvc_status parse_tensors(parser *ps, kvc_gguf *g, uint64_t n_tensors) {
    int64_t cap = 0;
    for (uint64_t i = 0; i < n_tensors; i++) {
        KVC_TRY(grow((void **)&g->tensors, &cap, g->n_tensors + 1, sizeof *g->tensors));
        gguf_tensor *t = &g->tensors[g->n_tensors];
        memset(t, 0, sizeof *t);
        KVC_TRY(parse_tensor(ps, g, (int64_t)i, t));
        g->n_tensors++;
    }
    int64_t a = -1, b = -1;
    KVC_TRY(index_build(&g->tensor_index, g, g->n_tensors, tensor_name, &a, &b));
    if (a >= 0) {
        set_ctx(ps, "tensor", g->base + g->tensors[b].name_off, g->tensors[b].name_len);
        return fail(ps, KVC_ERR_CORRUPT, g->tensors[b].name_off - 8,
                    "duplicate tensor name (tensor infos %lld and %lld)", (long long)a,
                    (long long)b);
    }
    /* The data section starts at the next multiple of the alignment. */
    g->data_off = ps->pos + (g->alignment - ps->pos % g->alignment) % g->alignment;
    return check_extents(ps, g);
}

/* Copies every key and tensor name, NUL-terminated, into one block. */
static kvc_status copy_names(kvc_gguf *g) {
    uint64_t total = 1;
    for (int64_t i = 0; i < g->n_kv; i++) total += g->kvs[i].key_len + 1;
    for (int64_t i = 0; i < g->n_tensors; i++) total += g->tensors[i].name_len + 1;
    g->names = malloc(total);
    if (!g->names) return kvc__error(KVC_ERR_NOMEM, "GGUF: out of memory copying names");
    char *p = g->names;
    for (int64_t i = 0; i < g->n_kv; i++) {
        memcpy(p, g->base + g->kvs[i].key_off, g->kvs[i].key_len);
        g->kvs[i].key = p;
        p += g->kvs[i].key_len;
        *p++ = '\0';
    }
    for (int64_t i = 0; i < g->n_tensors; i++) {
        memcpy(p, g->base + g->tensors[i].name_off, g->tensors[i].name_len);
        g->tensors[i].name = p;
        p += g->tensors[i].name_len;
        *p++ = '\0';
    }
    return KVC_OK;
}

static kvc_status parse(kvc_gguf *g) {
    parser ps = {.base = g->base, .size = g->size, .pos = 0};
    uint64_t n_tensors = 0, n_kv = 0;
    KVC_TRY(parse_header(&ps, g, &n_tensors, &n_kv));
    KVC_TRY(parse_kvs(&ps, g, n_kv));
    KVC_TRY(parse_alignment(&ps, g));
    KVC_TRY(parse_tensors(&ps, g, n_tensors));
    return copy_names(g);
}

/* ---- open / close -------------------------------------------------------------- */

kvc_status kvc_gguf_open_memory(const void *data, size_t size, kvc_gguf **out) {
    KVC_CHECK(out != NULL, "kvc_gguf_open_memory: out is NULL");
    *out = NULL;
    KVC_CHECK(data != NULL || size == 0, "kvc_gguf_open_memory: data is NULL");
    kvc_gguf *g = calloc(1, sizeof *g);
    if (!g) return kvc__error(KVC_ERR_NOMEM, "GGUF: out of memory");
    static const uint8_t empty[1] = {0};
    g->base = data ? data : empty;
    g->size = size;
    kvc_status st = parse(g);
    if (st != KVC_OK) {
        kvc_gguf_close(g);
        return st;
    }
    *out = g;
    return KVC_OK;
}

/* Prefixes the current error message with the path. */
static kvc_status with_path(kvc_status st, const char *path) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kvc_last_error());
    return kvc__error(st, "%.200s: %s", path, msg);
}

/* Reads fd's size bytes into a kvc__alloc_large buffer (*copy), reporting
 * the fraction read to fn (may be NULL) every 64 MiB. */
static kvc_status read_all(int fd, const char *path, size_t size, void (*fn)(float, void *),
                           void *user, void **copy) {
    unsigned char *buf = kvc__alloc_large(size, 4096); /* aligned as a mapping would be */
    if (!buf)
        return kvc__error(KVC_ERR_NOMEM, "%.200s: out of memory reading %zu bytes", path, size);
    size_t got = 0;
    while (got < size) {
        const size_t want = size - got < ((size_t)64 << 20) ? size - got : (size_t)64 << 20;
        ssize_t r = read(fd, buf + got, want);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            const int e = errno;
            free(buf);
            return r < 0 ? kvc__error(KVC_ERR_IO, "%.200s: cannot read: %s", path, strerror(e))
                         : kvc__error(KVC_ERR_IO, "%.200s: the file shrank while read (%zu of "
                                      "%zu bytes)", path, got, size);
        }
        got += (size_t)r;
        if (fn) fn((float)((double)got / (double)size), user);
    }
    *copy = buf;
    return KVC_OK;
}

static kvc_status open_file(const char *path, int read_copy, void (*fn)(float, void *),
                            void *user, kvc_gguf **out) {
    const char *name = read_copy ? "kvc_gguf_open_read" : "kvc_gguf_open";
    KVC_CHECK(out != NULL, "%s: out is NULL", name);
    *out = NULL;
    KVC_CHECK(path != NULL, "%s: path is NULL", name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvc__error(KVC_ERR_IO, "%.200s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return kvc__error(KVC_ERR_IO, "%.200s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return kvc__error(KVC_ERR_IO, "%.200s: not a regular file", path);
    }
    if (sb.st_size == 0) {
        close(fd);
        return kvc__error(KVC_ERR_CORRUPT, "%.200s: GGUF: the file is empty", path);
    }
    if ((uint64_t)sb.st_size > (uint64_t)SIZE_MAX) {
        close(fd);
        return kvc__error(KVC_ERR_UNSUPPORTED, "%.200s: file too large to map", path);
    }
    size_t size = (size_t)sb.st_size;
    void *map = NULL, *copy = NULL;
    if (read_copy) {
        kvc_status st = read_all(fd, path, size, fn, user, &copy);
        close(fd);
        if (st != KVC_OK) return st;
    } else {
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        int map_errno = errno;
        close(fd); /* the mapping keeps the file open */
        if (map == MAP_FAILED)
            return kvc__error(KVC_ERR_IO, "%.200s: cannot mmap %zu bytes: %s", path, size,
                              strerror(map_errno));
    }
    kvc_gguf *g = NULL;
    kvc_status st = kvc_gguf_open_memory(map ? map : copy, size, &g);
    if (st != KVC_OK) {
        if (map) munmap(map, size);
        free(copy);
        return with_path(st, path);
    }
    g->map = map;
    g->copy = copy;
    *out = g;
    return KVC_OK;
}

kvc_status kvc_gguf_open(const char *path, kvc_gguf **out) {
    return open_file(path, 0, NULL, NULL, out);
}

kvc_status kvc_gguf_open_read(const char *path, kvc_gguf **out) {
    return kvc__gguf_open_read(path, NULL, NULL, out);
}

kvc_status kvc__gguf_open_read(const char *path, void (*fn)(float, void *), void *user,
                               kvc_gguf **out) {
    return open_file(path, 1, fn, user, out);
}

void kvc_gguf_close(kvc_gguf *g) {
    if (!g) return;
    for (int64_t i = 0; i < g->n_kv; i++) free(g->kvs[i].str_off);
    free(g->kvs);
    free(g->tensors);
    free(g->kv_index.slots);
    free(g->tensor_index.slots);
    free(g->names);
    if (g->map) munmap(g->map, (size_t)g->size);
    free(g->copy);
    free(g);
}

uint32_t kvc_gguf_version(const kvc_gguf *g) { return g ? g->version : 0; }

uint32_t kvc_gguf_alignment(const kvc_gguf *g) { return g ? g->alignment : 0; }

/* ---- key-value accessors ---------------------------------------------------------- */

int64_t kvc_gguf_n_kv(const kvc_gguf *g) { return g ? g->n_kv : 0; }

int64_t kvc_gguf_find_key(const kvc_gguf *g, const char *key) {
    if (!g || !key || g->n_kv == 0) return -1;
    return index_find(&g->kv_index, g, key, key_name);
}

const char *kvc_gguf_key(const kvc_gguf *g, int64_t i) {
    if (!g || i < 0 || i >= g->n_kv) return NULL;
    return g->kvs[i].key;
}

kvc_status kvc_gguf_kv_type(const kvc_gguf *g, int64_t i, kvc_gguf_type *type,
                            kvc_gguf_type *elem_type, int64_t *n_elems) {
    KVC_CHECK(g != NULL, "kvc_gguf_kv_type: g is NULL");
    KVC_CHECK(i >= 0 && i < g->n_kv, "kvc_gguf_kv_type: index %lld out of range [0, %lld)",
              (long long)i, (long long)g->n_kv);
    const gguf_kv *kv = &g->kvs[i];
    if (type) *type = (kvc_gguf_type)kv->type;
    if (elem_type) *elem_type = (kvc_gguf_type)kv->elem_type;
    if (n_elems) *n_elems = (int64_t)kv->n;
    return KVC_OK;
}

/* Finds key or fails with NOT_FOUND naming it (fn: the calling function). */
static kvc_status lookup(const kvc_gguf *g, const char *key, const char *fn, const gguf_kv **kv) {
    KVC_CHECK(g != NULL, "%s: g is NULL", fn);
    KVC_CHECK(key != NULL, "%s: key is NULL", fn);
    int64_t i = kvc_gguf_find_key(g, key);
    if (i < 0) return kvc__error(KVC_ERR_NOT_FOUND, "%s: no key '%.200s' in the GGUF file", fn, key);
    *kv = &g->kvs[i];
    return KVC_OK;
}

/* Integer value of a scalar of integer or bool type; 0 if not one. */
static int int_value(const kvc_gguf *g, const gguf_kv *kv, int *is_unsigned, uint64_t *bits) {
    const uint8_t *p = g->base + kv->off;
    switch (kv->type) {
    case KVC_GGUF_UINT8:
    case KVC_GGUF_BOOL: *bits = p[0]; *is_unsigned = 1; return 1;
    case KVC_GGUF_INT8: *bits = (uint64_t)(int64_t)(int8_t)p[0]; *is_unsigned = 0; return 1;
    case KVC_GGUF_UINT16: *bits = load_le(p, 2); *is_unsigned = 1; return 1;
    case KVC_GGUF_INT16:
        *bits = (uint64_t)(int64_t)(int16_t)load_le(p, 2);
        *is_unsigned = 0;
        return 1;
    case KVC_GGUF_UINT32: *bits = load_le(p, 4); *is_unsigned = 1; return 1;
    case KVC_GGUF_INT32:
        *bits = (uint64_t)(int64_t)(int32_t)load_le(p, 4);
        *is_unsigned = 0;
        return 1;
    case KVC_GGUF_UINT64: *bits = load_le(p, 8); *is_unsigned = 1; return 1;
    case KVC_GGUF_INT64: *bits = load_le(p, 8); *is_unsigned = 0; return 1;
    default: return 0;
    }
}

/* An integer value's 64 bits and signedness, for get_i64 and get_u64. */
static kvc_status int_of_key(const kvc_gguf *g, const char *key, const char *fn, const void *out,
                             int *is_unsigned, uint64_t *bits) {
    const gguf_kv *kv = NULL;
    KVC_TRY(lookup(g, key, fn, &kv));
    KVC_CHECK(out != NULL, "%s: out is NULL", fn);
    KVC_CHECK(int_value(g, kv, is_unsigned, bits), "%s: key '%.200s' has type %s, not an integer",
              fn, key, value_type_name(kv->type));
    return KVC_OK;
}

kvc_status kvc_gguf_get_i64(const kvc_gguf *g, const char *key, int64_t *out) {
    int is_unsigned = 0;
    uint64_t bits = 0;
    KVC_TRY(int_of_key(g, key, "kvc_gguf_get_i64", out, &is_unsigned, &bits));
    KVC_CHECK(!is_unsigned || bits <= (uint64_t)INT64_MAX,
              "kvc_gguf_get_i64: key '%.200s' = %llu does not fit in int64", key,
              (unsigned long long)bits);
    /* Two's complement reinterpretation, defined via memcpy. */
    memcpy(out, &bits, sizeof bits);
    return KVC_OK;
}

kvc_status kvc_gguf_get_u64(const kvc_gguf *g, const char *key, uint64_t *out) {
    int is_unsigned = 0;
    uint64_t bits = 0;
    KVC_TRY(int_of_key(g, key, "kvc_gguf_get_u64", out, &is_unsigned, &bits));
    KVC_CHECK(is_unsigned || bits <= (uint64_t)INT64_MAX,
              "kvc_gguf_get_u64: key '%.200s' = %lld is negative", key, (long long)(int64_t)bits);
    *out = bits;
    return KVC_OK;
}

kvc_status kvc_gguf_get_f64(const kvc_gguf *g, const char *key, double *out) {
    const gguf_kv *kv = NULL;
    KVC_TRY(lookup(g, key, "kvc_gguf_get_f64", &kv));
    KVC_CHECK(out != NULL, "kvc_gguf_get_f64: out is NULL");
    const uint8_t *p = g->base + kv->off;
    if (kv->type == KVC_GGUF_FLOAT32) {
        uint32_t u = (uint32_t)load_le(p, 4);
        float f;
        memcpy(&f, &u, 4);
        *out = (double)f;
        return KVC_OK;
    }
    if (kv->type == KVC_GGUF_FLOAT64) {
        uint64_t u = load_le(p, 8);
        memcpy(out, &u, 8);
        return KVC_OK;
    }
    int is_unsigned = 0;
    uint64_t bits = 0;
    KVC_CHECK(kv->type != KVC_GGUF_BOOL && int_value(g, kv, &is_unsigned, &bits),
              "kvc_gguf_get_f64: key '%.200s' has type %s, not a number", key,
              value_type_name(kv->type));
    if (is_unsigned) {
        *out = (double)bits;
    } else {
        int64_t v;
        memcpy(&v, &bits, sizeof v);
        *out = (double)v;
    }
    return KVC_OK;
}

kvc_status kvc_gguf_get_str(const kvc_gguf *g, const char *key, const char **s, size_t *len) {
    const gguf_kv *kv = NULL;
    KVC_TRY(lookup(g, key, "kvc_gguf_get_str", &kv));
    KVC_CHECK(s != NULL && len != NULL, "kvc_gguf_get_str: s or len is NULL");
    KVC_CHECK(kv->type == KVC_GGUF_STRING,
              "kvc_gguf_get_str: key '%.200s' has type %s, not a string", key,
              value_type_name(kv->type));
    *s = (const char *)(g->base + kv->off);
    *len = (size_t)kv->len;
    return KVC_OK;
}

kvc_status kvc_gguf_get_arr(const kvc_gguf *g, const char *key, kvc_gguf_type *elem_type,
                            int64_t *n, const void **data) {
    const gguf_kv *kv = NULL;
    KVC_TRY(lookup(g, key, "kvc_gguf_get_arr", &kv));
    KVC_CHECK(kv->type == KVC_GGUF_ARRAY,
              "kvc_gguf_get_arr: key '%.200s' has type %s, not an array", key,
              value_type_name(kv->type));
    if (elem_type) *elem_type = (kvc_gguf_type)kv->elem_type;
    if (n) *n = (int64_t)kv->n;
    if (data) {
        int raw = kv->elem_type != KVC_GGUF_STRING && kv->elem_type != KVC_GGUF_ARRAY;
        *data = raw ? (const void *)(g->base + kv->off) : NULL;
    }
    return KVC_OK;
}

kvc_status kvc_gguf_get_arr_str(const kvc_gguf *g, const char *key, int64_t i, const char **s,
                                size_t *len) {
    const gguf_kv *kv = NULL;
    KVC_TRY(lookup(g, key, "kvc_gguf_get_arr_str", &kv));
    KVC_CHECK(s != NULL && len != NULL, "kvc_gguf_get_arr_str: s or len is NULL");
    KVC_CHECK(kv->type == KVC_GGUF_ARRAY && kv->elem_type == KVC_GGUF_STRING,
              "kvc_gguf_get_arr_str: key '%.200s' is not an array of strings", key);
    KVC_CHECK(i >= 0 && (uint64_t)i < kv->n,
              "kvc_gguf_get_arr_str: index %lld out of range for key '%.200s' (%llu strings)",
              (long long)i, key, (unsigned long long)kv->n);
    uint64_t at = kv->str_off[i];
    *len = (size_t)load_le(g->base + at, 8);
    *s = (const char *)(g->base + at + 8);
    return KVC_OK;
}

/* ---- tensors ------------------------------------------------------------------------ */

int64_t kvc_gguf_n_tensors(const kvc_gguf *g) { return g ? g->n_tensors : 0; }

int64_t kvc_gguf_find_tensor(const kvc_gguf *g, const char *name) {
    if (!g || !name || g->n_tensors == 0) return -1;
    return index_find(&g->tensor_index, g, name, tensor_name);
}

kvc_status kvc_gguf_get_tensor(const kvc_gguf *g, int64_t i, kvc_gguf_tensor *out) {
    KVC_CHECK(g != NULL, "kvc_gguf_get_tensor: g is NULL");
    KVC_CHECK(out != NULL, "kvc_gguf_get_tensor: out is NULL");
    KVC_CHECK(i >= 0 && i < g->n_tensors, "kvc_gguf_get_tensor: index %lld out of range [0, %lld)",
              (long long)i, (long long)g->n_tensors);
    const gguf_tensor *t = &g->tensors[i];
    out->name = t->name;
    out->type = t->type;
    out->n_dims = t->n_dims;
    memcpy(out->ne, t->ne, sizeof out->ne);
    out->data = g->base + g->data_off + t->offset;
    out->size = (size_t)t->size;
    return KVC_OK;
}
