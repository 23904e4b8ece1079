/*
 * Suite "gguf": the GGUF reader (include/kvcache/gguf.h).
 *
 * GGUF images are built in memory by a small builder below (written from
 * the format description: header, key-values, tensor infos, aligned data),
 * so every field's byte position is known and tests can patch exactly one
 * field to make it invalid. Checks:
 *   - the ggml type table (names, block sizes, block bytes of every type);
 *   - every accessor on a valid image holding every value type, string and
 *     nested arrays, and tensors of several types and ranks (v2 and v3,
 *     default and custom alignment), from memory and from a file;
 *   - rejection, with the expected status and message, of each kind of
 *     invalid input: every truncated length of a valid image, bad magic,
 *     versions 0/1/4/big-endian, absurd counts, string lengths past the end,
 *     bad alignment, misaligned/out-of-file/overlapping tensor data, zero and
 *     overflowing dims, unknown types, duplicate names, bools other than 0/1;
 *   - single-byte mutations of a valid image never crash (run under ASan);
 *   - the real model (models/SmolLM2-135M-Instruct.Q4_1.gguf), if present.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"

/* ---- in-memory GGUF builder ------------------------------------------------- */

typedef struct gb {
    uint8_t *p;
    size_t n, cap;
} gb;

static void gb_put(gb *b, const void *d, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n) cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            fprintf(stderr, "out of memory\n");
            abort();
        }
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, d, n);
    b->n += n;
}

static void gb_le(gb *b, uint64_t v, int bytes) {
    uint8_t t[8];
    for (int i = 0; i < bytes; i++) t[i] = (uint8_t)(v >> (8 * i));
    gb_put(b, t, (size_t)bytes);
}
static void gb_u8(gb *b, uint8_t v) { gb_le(b, v, 1); }
static void gb_u32(gb *b, uint32_t v) { gb_le(b, v, 4); }
static void gb_u64(gb *b, uint64_t v) { gb_le(b, v, 8); }
static void gb_f32(gb *b, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    gb_u32(b, u);
}
static void gb_f64(gb *b, double f) {
    uint64_t u;
    memcpy(&u, &f, 8);
    gb_u64(b, u);
}
static void gb_str(gb *b, const char *s) {
    gb_u64(b, strlen(s));
    gb_put(b, s, strlen(s));
}
/* Key name + value type; returns the position of the key's length field. */
static size_t gb_key(gb *b, const char *key, uint32_t type) {
    size_t at = b->n;
    gb_str(b, key);
    gb_u32(b, type);
    return at;
}
static void gb_pad(gb *b, size_t align) {
    static const uint8_t zeros[256];
    while (b->n % align) gb_put(b, zeros, 1);
}

static void patch_le(gb *b, size_t at, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) b->p[at + (size_t)i] = (uint8_t)(v >> (8 * i));
}

/* Positions of fields in the sample image (byte offsets). */
typedef struct sample {
    gb b;
    size_t n_tensors_at, n_kv_at;
    size_t key_u8_at, key_i8_at; /* key length fields */
    size_t bool_at, bool_arr_at; /* the bool byte; element 1 of the bool array */
    size_t str_len_at;           /* length field of general.architecture's value */
    size_t arr_str1_at;          /* length field of element 1 of t.arr_str */
    size_t arr_i32_type_at;      /* element type field of t.arr_i32 */
    size_t align_type_at, align_at;
    size_t t_name_at[3], t_ndims_at[3], t_dim_at[3], t_type_at[3], t_off_at[3];
    size_t data_at; /* start of the data section */
    uint32_t alignment;
} sample;

/* Tensor data written into the sample. */
static const float sample_a[8] = {1, -2, 3.5f, 4, 5, 6, 7, -8};

/* A valid GGUF image: 17 or 18 key-values covering every value type and 3
 * tensors (F32 2-D, Q8_0 1-D, Q4_1 4-D). The last tensor ends at the end of
 * the image, so any truncation is invalid. alignment 0 = default (no key). */
static void build_sample(sample *s, uint32_t version, uint32_t alignment) {
    memset(s, 0, sizeof *s);
    gb *b = &s->b;
    s->alignment = alignment ? alignment : 32;
    gb_put(b, "GGUF", 4);
    gb_u32(b, version);
    s->n_tensors_at = b->n;
    gb_u64(b, 3);
    s->n_kv_at = b->n;
    gb_u64(b, alignment ? 18 : 17);

    gb_key(b, "general.architecture", KVC_GGUF_STRING);
    s->str_len_at = b->n;
    gb_str(b, "llama");
    s->key_u8_at = gb_key(b, "t.u8", KVC_GGUF_UINT8);
    gb_u8(b, 200);
    s->key_i8_at = gb_key(b, "t.i8", KVC_GGUF_INT8);
    gb_u8(b, (uint8_t)-100);
    gb_key(b, "t.u16", KVC_GGUF_UINT16);
    gb_le(b, 60000, 2);
    gb_key(b, "t.i16", KVC_GGUF_INT16);
    gb_le(b, (uint16_t)-30000, 2);
    gb_key(b, "t.u32", KVC_GGUF_UINT32);
    gb_u32(b, 4000000000u);
    gb_key(b, "t.i32", KVC_GGUF_INT32);
    gb_u32(b, (uint32_t)-2000000000);
    gb_key(b, "t.f32", KVC_GGUF_FLOAT32);
    gb_f32(b, 1.5f);
    gb_key(b, "t.bool", KVC_GGUF_BOOL);
    s->bool_at = b->n;
    gb_u8(b, 1);
    gb_key(b, "t.u64", KVC_GGUF_UINT64);
    gb_u64(b, (1ull << 63) + 5);
    gb_key(b, "t.i64", KVC_GGUF_INT64);
    gb_u64(b, (uint64_t)-(1ll << 40));
    gb_key(b, "t.f64", KVC_GGUF_FLOAT64);
    gb_f64(b, -2.25);
    gb_key(b, "t.arr_i32", KVC_GGUF_ARRAY);
    s->arr_i32_type_at = b->n;
    gb_u32(b, KVC_GGUF_INT32);
    gb_u64(b, 3);
    gb_u32(b, 1);
    gb_u32(b, (uint32_t)-2);
    gb_u32(b, 3);
    gb_key(b, "t.arr_str", KVC_GGUF_ARRAY);
    gb_u32(b, KVC_GGUF_STRING);
    gb_u64(b, 3);
    gb_str(b, "a");
    s->arr_str1_at = b->n;
    gb_str(b, "");
    gb_str(b, "hello world");
    gb_key(b, "t.arr_nested", KVC_GGUF_ARRAY); /* [[1, 2] (u8), ["x"]] */
    gb_u32(b, KVC_GGUF_ARRAY);
    gb_u64(b, 2);
    gb_u32(b, KVC_GGUF_UINT8);
    gb_u64(b, 2);
    gb_u8(b, 1);
    gb_u8(b, 2);
    gb_u32(b, KVC_GGUF_STRING);
    gb_u64(b, 1);
    gb_str(b, "x");
    gb_key(b, "t.arr_empty", KVC_GGUF_ARRAY);
    gb_u32(b, KVC_GGUF_FLOAT32);
    gb_u64(b, 0);
    gb_key(b, "t.arr_bool", KVC_GGUF_ARRAY);
    gb_u32(b, KVC_GGUF_BOOL);
    gb_u64(b, 3);
    gb_u8(b, 0);
    s->bool_arr_at = b->n;
    gb_u8(b, 1);
    gb_u8(b, 1);
    if (alignment) {
        gb_str(b, "general.alignment");
        s->align_type_at = b->n;
        gb_u32(b, KVC_GGUF_UINT32);
        s->align_at = b->n;
        gb_u32(b, alignment);
    }

    /* Tensor infos: a F32 ne (4, 2); b Q8_0 ne (32); c Q4_1 ne (64, 1, 1, 2). */
    static const char *names[3] = {"a", "b", "c"};
    static const uint32_t ndims[3] = {2, 1, 4};
    static const uint64_t dims[3][4] = {{4, 2, 1, 1}, {32, 1, 1, 1}, {64, 1, 1, 2}};
    static const uint32_t types[3] = {KVC_GGML_F32, KVC_GGML_Q8_0, KVC_GGML_Q4_1};
    static const uint64_t sizes[3] = {32, 34, 4 * 20};
    uint64_t off = 0;
    for (int t = 0; t < 3; t++) {
        s->t_name_at[t] = b->n;
        gb_str(b, names[t]);
        s->t_ndims_at[t] = b->n;
        gb_u32(b, ndims[t]);
        s->t_dim_at[t] = b->n;
        for (uint32_t d = 0; d < ndims[t]; d++) gb_u64(b, dims[t][d]);
        s->t_type_at[t] = b->n;
        gb_u32(b, types[t]);
        s->t_off_at[t] = b->n;
        gb_u64(b, off);
        off += sizes[t];
        off = (off + s->alignment - 1) / s->alignment * s->alignment;
    }
    gb_pad(b, s->alignment);
    s->data_at = b->n;
    /* a */
    for (int i = 0; i < 8; i++) gb_f32(b, sample_a[i]);
    gb_pad(b, s->alignment);
    /* b: d = 0.5 (f16 0x3800), q[i] = i - 16 */
    gb_le(b, 0x3800, 2);
    for (int i = 0; i < 32; i++) gb_u8(b, (uint8_t)(i - 16));
    gb_pad(b, s->alignment);
    /* c: 4 blocks, bytes 0..79 */
    for (int i = 0; i < 80; i++) gb_u8(b, (uint8_t)i);
}

/* A copy of the image in a buffer of exactly n bytes (so ASan sees any
 * read past the end). */
static uint8_t *exact_copy(const gb *b, size_t n) {
    uint8_t *p = malloc(n ? n : 1);
    if (!p) abort();
    memcpy(p, b->p, n);
    return p;
}

/* Opens the first n bytes of b from an exact-size copy. */
static kvc_status open_n(const gb *b, size_t n, kvc_gguf **g, uint8_t **copy) {
    *copy = exact_copy(b, n);
    return kvc_gguf_open_memory(*copy, n, g);
}

/* Calls every accessor on g; returns a checksum so nothing is optimized out.
 * Shared with the mutation test; any invalid read shows under ASan. */
static uint64_t walk_all(const kvc_gguf *g) {
    uint64_t sum = kvc_gguf_version(g) + kvc_gguf_alignment(g);
    for (int64_t i = 0; i < kvc_gguf_n_kv(g); i++) {
        const char *key = kvc_gguf_key(g, i);
        kvc_gguf_type t, et;
        int64_t n;
        if (!key || kvc_gguf_kv_type(g, i, &t, &et, &n) != KVC_OK) return 0;
        sum += (uint64_t)kvc_gguf_find_key(g, key) + strlen(key);
        int64_t iv;
        double fv;
        const char *s;
        size_t len;
        const void *data;
        if (kvc_gguf_get_i64(g, key, &iv) == KVC_OK) sum += (uint64_t)iv;
        if (kvc_gguf_get_f64(g, key, &fv) == KVC_OK) sum += (uint64_t)(fv != 0);
        if (kvc_gguf_get_str(g, key, &s, &len) == KVC_OK && len) sum += (uint8_t)s[len - 1];
        if (kvc_gguf_get_arr(g, key, &et, &n, &data) == KVC_OK && data && n > 0) {
            sum += ((const uint8_t *)data)[0];
        }
        if (t == KVC_GGUF_ARRAY && et == KVC_GGUF_STRING)
            for (int64_t j = 0; j < n; j++)
                if (kvc_gguf_get_arr_str(g, key, j, &s, &len) == KVC_OK && len)
                    sum += (uint8_t)s[0] + (uint8_t)s[len - 1];
    }
    for (int64_t i = 0; i < kvc_gguf_n_tensors(g); i++) {
        kvc_gguf_tensor t;
        if (kvc_gguf_get_tensor(g, i, &t) != KVC_OK) return 0;
        sum += (uint64_t)kvc_gguf_find_tensor(g, t.name);
        const uint8_t *d = t.data;
        if (t.size) sum += d[0] + d[t.size - 1];
    }
    return sum;
}

/* ---- type table ------------------------------------------------------------------ */

TEST(type_table) {
    static const struct {
        int32_t type;
        const char *name;
        int64_t bs, bb;
    } want[] = {
        {KVC_GGML_F32, "F32", 1, 4},       {KVC_GGML_F16, "F16", 1, 2},
        {KVC_GGML_Q4_0, "Q4_0", 32, 18},   {KVC_GGML_Q4_1, "Q4_1", 32, 20},
        {KVC_GGML_Q5_0, "Q5_0", 32, 22},   {KVC_GGML_Q5_1, "Q5_1", 32, 24},
        {KVC_GGML_Q8_0, "Q8_0", 32, 34},   {KVC_GGML_Q8_1, "Q8_1", 32, 36},
        {KVC_GGML_Q2_K, "Q2_K", 256, 84},  {KVC_GGML_Q3_K, "Q3_K", 256, 110},
        {KVC_GGML_Q4_K, "Q4_K", 256, 144}, {KVC_GGML_Q5_K, "Q5_K", 256, 176},
        {KVC_GGML_Q6_K, "Q6_K", 256, 210}, {KVC_GGML_Q8_K, "Q8_K", 256, 292},
        {KVC_GGML_BF16, "BF16", 1, 2},
        /* named and sized only (ggml's ggml-common.h: IQ2_XXS d + 32 u16, IQ4_NL
         * d + 16 nibbles, IQ4_XS d, scales_h, 4 scales_l, 128 nibbles, MXFP4 an
         * e8m0 byte + 16 nibbles, NVFP4 4 e4m3 scales + 32 nibbles per 64, Q1_0
         * d + 16 bytes of bits per 128, Q2_0 d + 16 bytes per 64, ...) */
        {16, "IQ2_XXS", 256, 66},          {17, "IQ2_XS", 256, 74},
        {18, "IQ3_XXS", 256, 98},          {19, "IQ1_S", 256, 50},
        {20, "IQ4_NL", 32, 18},            {21, "IQ3_S", 256, 110},
        {22, "IQ2_S", 256, 82},            {23, "IQ4_XS", 256, 136},
        {24, "I8", 1, 1},                  {25, "I16", 1, 2},
        {26, "I32", 1, 4},                 {27, "I64", 1, 8},
        {28, "F64", 1, 8},                 {29, "IQ1_M", 256, 56},
        {34, "TQ1_0", 256, 54},            {35, "TQ2_0", 256, 66},
        {39, "MXFP4", 32, 17},             {40, "NVFP4", 64, 36},
        {41, "Q1_0", 128, 18},             {42, "Q2_0", 64, 18},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const char *name = kvc_ggml_type_name(want[i].type);
        ASSERT_TRUE(name != NULL);
        ASSERT_TRUE(strcmp(name, want[i].name) == 0);
        ASSERT_EQ_I64(kvc_ggml_block_size(want[i].type), want[i].bs);
        ASSERT_EQ_I64(kvc_ggml_block_bytes(want[i].type), want[i].bb);
    }
    /* 4, 5 and 31-33, 36-38: types ggml removed; 43: past the last */
    static const int32_t unknown[] = {-1, 4,  5,    31,        32,       33, 36,
                                      37, 38, 43, 1000, INT32_MIN, INT32_MAX};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        ASSERT_TRUE(kvc_ggml_type_name(unknown[i]) == NULL);
        ASSERT_EQ_I64(kvc_ggml_block_size(unknown[i]), 0);
        ASSERT_EQ_I64(kvc_ggml_block_bytes(unknown[i]), 0);
    }
    return 0;
}

/* ---- accessors on a valid image ------------------------------------------------------ */

static int check_sample(const kvc_gguf *g, const sample *s, uint32_t version) {
    ASSERT_EQ_I64(kvc_gguf_version(g), version);
    ASSERT_EQ_I64(kvc_gguf_alignment(g), s->alignment);
    ASSERT_EQ_I64(kvc_gguf_n_kv(g), s->align_at ? 18 : 17);
    ASSERT_EQ_I64(kvc_gguf_n_tensors(g), 3);

    /* keys in file order, find_key inverse of key */
    static const char *keys[] = {"general.architecture", "t.u8",    "t.i8",       "t.u16",
                                 "t.i16",                "t.u32",   "t.i32",      "t.f32",
                                 "t.bool",               "t.u64",   "t.i64",      "t.f64",
                                 "t.arr_i32",            "t.arr_str", "t.arr_nested",
                                 "t.arr_empty",          "t.arr_bool"};
    static const kvc_gguf_type types[] = {
        KVC_GGUF_STRING, KVC_GGUF_UINT8,  KVC_GGUF_INT8,  KVC_GGUF_UINT16, KVC_GGUF_INT16,
        KVC_GGUF_UINT32, KVC_GGUF_INT32,  KVC_GGUF_FLOAT32, KVC_GGUF_BOOL, KVC_GGUF_UINT64,
        KVC_GGUF_INT64,  KVC_GGUF_FLOAT64, KVC_GGUF_ARRAY, KVC_GGUF_ARRAY, KVC_GGUF_ARRAY,
        KVC_GGUF_ARRAY,  KVC_GGUF_ARRAY};
    for (int64_t i = 0; i < 17; i++) {
        ASSERT_TRUE(strcmp(kvc_gguf_key(g, i), keys[i]) == 0);
        ASSERT_EQ_I64(kvc_gguf_find_key(g, keys[i]), i);
        kvc_gguf_type t, et;
        int64_t n;
        ASSERT_OK(kvc_gguf_kv_type(g, i, &t, &et, &n));
        ASSERT_EQ_I64(t, types[i]);
        if (t != KVC_GGUF_ARRAY) {
            ASSERT_EQ_I64(et, t);
            ASSERT_EQ_I64(n, 1);
        }
    }
    ASSERT_OK(kvc_gguf_kv_type(g, 0, NULL, NULL, NULL)); /* outputs optional */
    ASSERT_TRUE(kvc_gguf_key(g, -1) == NULL);
    ASSERT_TRUE(kvc_gguf_key(g, kvc_gguf_n_kv(g)) == NULL);
    ASSERT_EQ_I64(kvc_gguf_find_key(g, "t.u"), -1);
    ASSERT_EQ_I64(kvc_gguf_find_key(g, "t.u88"), -1);
    ASSERT_EQ_I64(kvc_gguf_find_key(g, ""), -1);
    ASSERT_EQ_I64(kvc_gguf_find_key(g, NULL), -1);
    ASSERT_STATUS(kvc_gguf_kv_type(g, kvc_gguf_n_kv(g), NULL, NULL, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "out of range");
    if (s->align_at) {
        int64_t a;
        ASSERT_OK(kvc_gguf_get_i64(g, "general.alignment", &a));
        ASSERT_EQ_I64(a, s->alignment);
    }

    /* integers */
    int64_t v;
    ASSERT_OK(kvc_gguf_get_i64(g, "t.u8", &v));
    ASSERT_EQ_I64(v, 200);
    ASSERT_OK(kvc_gguf_get_i64(g, "t.i8", &v));
    ASSERT_EQ_I64(v, -100);
    ASSERT_OK(kvc_gguf_get_i64(g, "t.u16", &v));
    ASSERT_EQ_I64(v, 60000);
    ASSERT_OK(kvc_gguf_get_i64(g, "t.i16", &v));
    ASSERT_EQ_I64(v, -30000);
    ASSERT_OK(kvc_gguf_get_i64(g, "t.u32", &v));
    ASSERT_EQ_I64(v, 4000000000ll);
    ASSERT_OK(kvc_gguf_get_i64(g, "t.i32", &v));
    ASSERT_EQ_I64(v, -2000000000ll);
    ASSERT_OK(kvc_gguf_get_i64(g, "t.bool", &v));
    ASSERT_EQ_I64(v, 1);
    ASSERT_OK(kvc_gguf_get_i64(g, "t.i64", &v));
    ASSERT_EQ_I64(v, -(1ll << 40));
    v = 77;
    ASSERT_STATUS(kvc_gguf_get_i64(g, "t.u64", &v), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "does not fit in int64");
    ASSERT_EQ_I64(v, 77); /* untouched on error */
    ASSERT_STATUS(kvc_gguf_get_i64(g, "t.f32", &v), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "'t.f32' has type float32");
    ASSERT_STATUS(kvc_gguf_get_i64(g, "general.architecture", &v), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_get_i64(g, "t.arr_i32", &v), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_get_i64(g, "no.such.key", &v), KVC_ERR_NOT_FOUND);
    ASSERT_STR_CONTAINS(kvc_last_error(), "no key 'no.such.key'");
    ASSERT_STATUS(kvc_gguf_get_i64(g, NULL, &v), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_get_i64(g, "t.u8", NULL), KVC_ERR_INVALID_ARG);
    uint64_t u = 77;
    ASSERT_OK(kvc_gguf_get_u64(g, "t.u64", &u));
    ASSERT_TRUE(u == (1ull << 63) + 5); /* every bit, past int64 and a double's 53 */
    ASSERT_OK(kvc_gguf_get_u64(g, "t.u32", &u));
    ASSERT_TRUE(u == 4000000000ull);
    u = 77;
    ASSERT_STATUS(kvc_gguf_get_u64(g, "t.i8", &u), KVC_ERR_INVALID_ARG); /* -100 */
    ASSERT_STR_CONTAINS(kvc_last_error(), "negative");
    ASSERT_TRUE(u == 77);
    ASSERT_STATUS(kvc_gguf_get_u64(g, "t.f32", &u), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_get_u64(g, "no.such.key", &u), KVC_ERR_NOT_FOUND);

    /* floats */
    double f;
    ASSERT_OK(kvc_gguf_get_f64(g, "t.f32", &f));
    ASSERT_TRUE(f == 1.5);
    ASSERT_OK(kvc_gguf_get_f64(g, "t.f64", &f));
    ASSERT_TRUE(f == -2.25);
    ASSERT_OK(kvc_gguf_get_f64(g, "t.i32", &f));
    ASSERT_TRUE(f == -2000000000.0);
    ASSERT_OK(kvc_gguf_get_f64(g, "t.u64", &f));
    ASSERT_TRUE(f == 9223372036854775808.0); /* 2^63 + 5 rounds to 2^63 */
    ASSERT_STATUS(kvc_gguf_get_f64(g, "t.bool", &f), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_get_f64(g, "general.architecture", &f), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_get_f64(g, "nope", &f), KVC_ERR_NOT_FOUND);

    /* strings */
    const char *str;
    size_t len;
    ASSERT_OK(kvc_gguf_get_str(g, "general.architecture", &str, &len));
    ASSERT_EQ_I64(len, 5);
    ASSERT_TRUE(memcmp(str, "llama", 5) == 0);
    ASSERT_STATUS(kvc_gguf_get_str(g, "t.u8", &str, &len), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "not a string");
    ASSERT_STATUS(kvc_gguf_get_str(g, "nope", &str, &len), KVC_ERR_NOT_FOUND);

    /* arrays */
    kvc_gguf_type et;
    int64_t n;
    const void *data;
    ASSERT_OK(kvc_gguf_get_arr(g, "t.arr_i32", &et, &n, &data));
    ASSERT_EQ_I64(et, KVC_GGUF_INT32);
    ASSERT_EQ_I64(n, 3);
    int32_t ints[3];
    memcpy(ints, data, sizeof ints); /* host is little-endian in CI */
    ASSERT_EQ_I64(ints[0], 1);
    ASSERT_EQ_I64(ints[1], -2);
    ASSERT_EQ_I64(ints[2], 3);
    ASSERT_OK(kvc_gguf_get_arr(g, "t.arr_bool", &et, &n, &data));
    ASSERT_EQ_I64(et, KVC_GGUF_BOOL);
    ASSERT_EQ_I64(n, 3);
    ASSERT_MEM_EQ(data, "\0\1\1", 3);
    ASSERT_OK(kvc_gguf_get_arr(g, "t.arr_empty", &et, &n, NULL));
    ASSERT_EQ_I64(et, KVC_GGUF_FLOAT32);
    ASSERT_EQ_I64(n, 0);
    ASSERT_OK(kvc_gguf_get_arr(g, "t.arr_str", &et, &n, &data));
    ASSERT_EQ_I64(et, KVC_GGUF_STRING);
    ASSERT_EQ_I64(n, 3);
    ASSERT_TRUE(data == NULL);
    ASSERT_OK(kvc_gguf_get_arr(g, "t.arr_nested", &et, &n, &data));
    ASSERT_EQ_I64(et, KVC_GGUF_ARRAY);
    ASSERT_EQ_I64(n, 2);
    ASSERT_TRUE(data == NULL);
    ASSERT_STATUS(kvc_gguf_get_arr(g, "t.u8", &et, &n, &data), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "not an array");
    ASSERT_STATUS(kvc_gguf_get_arr(g, "nope", &et, &n, &data), KVC_ERR_NOT_FOUND);

    static const char *strs[3] = {"a", "", "hello world"};
    for (int64_t i = 0; i < 3; i++) {
        ASSERT_OK(kvc_gguf_get_arr_str(g, "t.arr_str", i, &str, &len));
        ASSERT_EQ_I64(len, strlen(strs[i]));
        ASSERT_TRUE(memcmp(str, strs[i], len) == 0);
    }
    ASSERT_STATUS(kvc_gguf_get_arr_str(g, "t.arr_str", 3, &str, &len), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "index 3 out of range");
    ASSERT_STATUS(kvc_gguf_get_arr_str(g, "t.arr_str", -1, &str, &len), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_get_arr_str(g, "t.arr_i32", 0, &str, &len), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "not an array of strings");
    ASSERT_STATUS(kvc_gguf_get_arr_str(g, "t.arr_nested", 0, &str, &len), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_get_arr_str(g, "nope", 0, &str, &len), KVC_ERR_NOT_FOUND);

    /* tensors */
    const uint8_t *base = s->b.p;
    kvc_gguf_tensor t;
    ASSERT_EQ_I64(kvc_gguf_find_tensor(g, "a"), 0);
    ASSERT_EQ_I64(kvc_gguf_find_tensor(g, "b"), 1);
    ASSERT_EQ_I64(kvc_gguf_find_tensor(g, "c"), 2);
    ASSERT_EQ_I64(kvc_gguf_find_tensor(g, "d"), -1);
    ASSERT_EQ_I64(kvc_gguf_find_tensor(g, ""), -1);
    ASSERT_EQ_I64(kvc_gguf_find_tensor(g, NULL), -1);
    ASSERT_OK(kvc_gguf_get_tensor(g, 0, &t));
    ASSERT_TRUE(strcmp(t.name, "a") == 0);
    ASSERT_EQ_I64(t.type, KVC_GGML_F32);
    ASSERT_EQ_I64(t.n_dims, 2);
    ASSERT_EQ_I64(t.ne[0], 4);
    ASSERT_EQ_I64(t.ne[1], 2);
    ASSERT_EQ_I64(t.ne[2], 1);
    ASSERT_EQ_I64(t.ne[3], 1);
    ASSERT_EQ_I64(t.size, 32);
    ASSERT_TRUE((const uint8_t *)t.data == base + s->data_at);
    ASSERT_MEM_EQ(t.data, sample_a, 32);
    ASSERT_OK(kvc_gguf_get_tensor(g, 1, &t));
    ASSERT_TRUE(strcmp(t.name, "b") == 0);
    ASSERT_EQ_I64(t.type, KVC_GGML_Q8_0);
    ASSERT_EQ_I64(t.n_dims, 1);
    ASSERT_EQ_I64(t.ne[0], 32);
    ASSERT_EQ_I64(t.ne[1], 1);
    ASSERT_EQ_I64(t.size, 34);
    ASSERT_EQ_I64((const uint8_t *)t.data - base,
                  s->data_at + (32 + s->alignment - 1) / s->alignment * s->alignment);
    ASSERT_EQ_I64(((const uint8_t *)t.data)[0], 0x00);
    ASSERT_EQ_I64(((const uint8_t *)t.data)[1], 0x38);
    ASSERT_EQ_I64((int8_t)((const uint8_t *)t.data)[2], -16);
    ASSERT_OK(kvc_gguf_get_tensor(g, 2, &t));
    ASSERT_TRUE(strcmp(t.name, "c") == 0);
    ASSERT_EQ_I64(t.type, KVC_GGML_Q4_1);
    ASSERT_EQ_I64(t.n_dims, 4);
    ASSERT_EQ_I64(t.ne[0], 64);
    ASSERT_EQ_I64(t.ne[1], 1);
    ASSERT_EQ_I64(t.ne[2], 1);
    ASSERT_EQ_I64(t.ne[3], 2);
    ASSERT_EQ_I64(t.size, 80);
    ASSERT_EQ_I64((const uint8_t *)t.data + t.size - base, s->b.n); /* ends at EOF */
    ASSERT_EQ_I64(((const uint8_t *)t.data)[79], 79);
    ASSERT_EQ_I64(((uintptr_t)((const uint8_t *)t.data - base)) % s->alignment, 0);
    ASSERT_STATUS(kvc_gguf_get_tensor(g, 3, &t), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "index 3 out of range");
    ASSERT_STATUS(kvc_gguf_get_tensor(g, -1, &t), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_get_tensor(g, 0, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(walk_all(g) != 0);
    return 0;
}

TEST(accessors_v3) {
    sample s;
    build_sample(&s, 3, 0);
    kvc_gguf *g = NULL;
    uint8_t *copy;
    kvc_status st = open_n(&s.b, s.b.n, &g, &copy);
    memcpy(s.b.p, copy, s.b.n);
    free(s.b.p);
    s.b.p = copy; /* check_sample compares pointers against the opened image */
    ASSERT_OK(st);
    int r = check_sample(g, &s, 3);
    kvc_gguf_close(g);
    free(copy);
    return r;
}

TEST(accessors_v2_and_alignment) {
    static const uint32_t aligns[] = {1, 8, 64, 256};
    for (size_t k = 0; k < sizeof aligns / sizeof aligns[0]; k++) {
        sample s;
        build_sample(&s, 2, aligns[k]);
        kvc_gguf *g = NULL;
        ASSERT_OK(kvc_gguf_open_memory(s.b.p, s.b.n, &g));
        int r = check_sample(g, &s, 2);
        kvc_gguf_close(g);
        free(s.b.p);
        if (r) {
            fprintf(stderr, "  (alignment %u)\n", aligns[k]);
            return r;
        }
    }
    return 0;
}

TEST(minimal_files) {
    /* header only: no tensors, no key-values */
    gb b = {0};
    gb_put(&b, "GGUF", 4);
    gb_u32(&b, 3);
    gb_u64(&b, 0);
    gb_u64(&b, 0);
    kvc_gguf *g = NULL;
    uint8_t *copy;
    ASSERT_OK(open_n(&b, b.n, &g, &copy));
    ASSERT_EQ_I64(kvc_gguf_n_kv(g), 0);
    ASSERT_EQ_I64(kvc_gguf_n_tensors(g), 0);
    ASSERT_EQ_I64(kvc_gguf_alignment(g), 32);
    ASSERT_EQ_I64(kvc_gguf_find_key(g, "general.alignment"), -1);
    ASSERT_EQ_I64(kvc_gguf_find_tensor(g, "x"), -1);
    kvc_gguf_close(g);
    free(copy);
    /* Trailing bytes after the data section are allowed. */
    sample s;
    build_sample(&s, 3, 0);
    gb_u32(&s.b, 0xdeadbeef);
    ASSERT_OK(kvc_gguf_open_memory(s.b.p, s.b.n, &g));
    kvc_gguf_close(g);
    free(s.b.p);
    free(b.p);
    /* NULL handling */
    kvc_gguf_close(NULL);
    ASSERT_STATUS(kvc_gguf_open_memory(NULL, 10, &g), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(g == NULL);
    ASSERT_STATUS(kvc_gguf_open_memory("GGUF", 4, NULL), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_open_memory(NULL, 0, &g), KVC_ERR_CORRUPT);
    ASSERT_STATUS(kvc_gguf_open(NULL, &g), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_open_read(NULL, &g), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_gguf_open_read("x.gguf", NULL), KVC_ERR_INVALID_ARG);
    ASSERT_EQ_I64(kvc_gguf_n_kv(NULL), 0);
    ASSERT_EQ_I64(kvc_gguf_n_tensors(NULL), 0);
    ASSERT_EQ_I64(kvc_gguf_find_key(NULL, "a"), -1);
    ASSERT_TRUE(kvc_gguf_key(NULL, 0) == NULL);
    return 0;
}

/* ---- rejection ------------------------------------------------------------------- */

/* Opens s's image as patched; expects status want and msg in the message. */
static int expect_fail(const sample *s, kvc_status want, const char *msg, const char *what) {
    kvc_gguf *g = (kvc_gguf *)(uintptr_t)1;
    uint8_t *copy;
    kvc_status st = open_n(&s->b, s->b.n, &g, &copy);
    free(copy);
    if (st != want || g != NULL || !strstr(kvc_last_error(), msg)) {
        if (st == KVC_OK) kvc_gguf_close(g);
        TEST_FAIL_("%s: got %s \"%s\", want %s containing \"%s\"", what, kvc_status_str(st),
                   kvc_last_error(), kvc_status_str(want), msg);
    }
    return 0;
}

/* Builds a fresh sample, applies the patch, expects the failure. */
#define EXPECT_PATCHED(version, align, patch, want, msg)                                           \
    do {                                                                                           \
        sample s_;                                                                                 \
        build_sample(&s_, version, align);                                                         \
        sample *s = &s_;                                                                           \
        patch;                                                                                     \
        int r_ = expect_fail(s, want, msg, #patch);                                                \
        free(s_.b.p);                                                                              \
        if (r_) return r_;                                                                         \
    } while (0)

TEST(truncated_at_every_length) {
    static const uint32_t aligns[] = {0, 1, 64};
    for (size_t k = 0; k < 3; k++) {
        sample s;
        build_sample(&s, 3, aligns[k]);
        for (size_t n = 0; n < s.b.n; n++) {
            kvc_gguf *g = NULL;
            uint8_t *copy;
            kvc_status st = open_n(&s.b, n, &g, &copy);
            free(copy);
            if (st != KVC_ERR_CORRUPT) {
                kvc_gguf_close(g);
                free(s.b.p);
                TEST_FAIL_("%zu of %zu bytes (alignment %u): %s \"%s\"", n, s.b.n, aligns[k],
                           kvc_status_str(st), kvc_last_error());
            }
            ASSERT_TRUE(g == NULL);
            ASSERT_STR_CONTAINS(kvc_last_error(), "GGUF: ");
            ASSERT_STR_CONTAINS(kvc_last_error(), ", byte ");
        }
        free(s.b.p);
    }
    return 0;
}

TEST(bad_magic_and_version) {
    EXPECT_PATCHED(3, 0, s->b.p[0] = 'g', KVC_ERR_CORRUPT, "bad magic 'gGUF'");
    EXPECT_PATCHED(3, 0, memcpy(s->b.p, "\x7f" "ELF", 4), KVC_ERR_CORRUPT, "not a GGUF file");
    EXPECT_PATCHED(1, 0, (void)s, KVC_ERR_UNSUPPORTED, "version 1 is not supported");
    EXPECT_PATCHED(4, 0, (void)s, KVC_ERR_UNSUPPORTED, "version 4 is not supported");
    EXPECT_PATCHED(0, 0, (void)s, KVC_ERR_CORRUPT, "version 0");
    EXPECT_PATCHED(0x03000000u, 0, (void)s, KVC_ERR_UNSUPPORTED, "big-endian");
    EXPECT_PATCHED(0xffffffffu, 0, (void)s, KVC_ERR_UNSUPPORTED, "version 4294967295");
    return 0;
}

TEST(absurd_counts) {
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->n_tensors_at, 1ull << 62, 8), KVC_ERR_CORRUPT,
                   "claims 4611686018427387904 tensors");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->n_tensors_at, UINT64_MAX, 8), KVC_ERR_CORRUPT,
                   "tensors");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->n_kv_at, 1ull << 62, 8), KVC_ERR_CORRUPT,
                   "claims 4611686018427387904 key-value pairs");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->n_kv_at, UINT64_MAX, 8), KVC_ERR_CORRUPT,
                   "key-value pairs");
    /* Plausible but wrong counts: one more key-value pair or tensor than present. */
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->n_kv_at, 18, 8), KVC_ERR_CORRUPT, "byte");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->n_tensors_at, 4, 8), KVC_ERR_CORRUPT, "byte");
    /* Huge array counts. */
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->arr_i32_type_at + 4, 1ull << 62, 8),
                   KVC_ERR_CORRUPT, "key 't.arr_i32'");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->arr_str1_at - 8 - 1 - 8, UINT64_MAX, 8),
                   KVC_ERR_CORRUPT, "strings cannot fit");
    return 0;
}

TEST(string_lengths_past_eof) {
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->key_u8_at, 1ull << 63, 8), KVC_ERR_CORRUPT,
                   "key name has length 9223372036854775808, past the end");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->key_u8_at, UINT64_MAX, 8), KVC_ERR_CORRUPT,
                   "past the end");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->key_u8_at, s->b.n - s->key_u8_at - 8 + 1, 8),
                   KVC_ERR_CORRUPT, "past the end");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->str_len_at, UINT64_MAX - 2, 8), KVC_ERR_CORRUPT,
                   "key 'general.architecture', byte 56: string value has length");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->arr_str1_at, 1ull << 40, 8), KVC_ERR_CORRUPT,
                   "key 't.arr_str'");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_name_at[1], UINT64_MAX, 8), KVC_ERR_CORRUPT,
                   "tensor name has length");
    return 0;
}

TEST(bad_alignment) {
    EXPECT_PATCHED(3, 64, patch_le(&s->b, s->align_at, 0, 4), KVC_ERR_CORRUPT,
                   "alignment 0 is not a power of two");
    EXPECT_PATCHED(3, 64, patch_le(&s->b, s->align_at, 3, 4), KVC_ERR_CORRUPT,
                   "alignment 3 is not a power of two");
    EXPECT_PATCHED(3, 64, patch_le(&s->b, s->align_at, 48, 4), KVC_ERR_CORRUPT,
                   "key 'general.alignment'");
    EXPECT_PATCHED(3, 64, patch_le(&s->b, s->align_type_at, KVC_GGUF_INT32, 4), KVC_ERR_CORRUPT,
                   "alignment has type int32, must be uint32");
    EXPECT_PATCHED(3, 64, patch_le(&s->b, s->align_type_at, KVC_GGUF_FLOAT32, 4),
                   KVC_ERR_CORRUPT, "must be uint32");
    /* A smaller valid alignment makes the 64-aligned file still valid. */
    sample s;
    build_sample(&s, 3, 64);
    patch_le(&s.b, s.align_at, 16, 4);
    kvc_gguf *g = NULL;
    ASSERT_OK(kvc_gguf_open_memory(s.b.p, s.b.n, &g));
    ASSERT_EQ_I64(kvc_gguf_alignment(g), 16);
    kvc_gguf_close(g);
    /* A larger one: offsets are no longer multiples of it... */
    patch_le(&s.b, s.align_at, 1u << 20, 4);
    int r = expect_fail(&s, KVC_ERR_CORRUPT, "data offset 64 is not a multiple of the alignment "
                        "1048576", "alignment 2^20");
    /* ...and with every offset 0 mod 2^20, the data section starts past the end. */
    patch_le(&s.b, s.t_off_at[1], 1u << 20, 8);
    patch_le(&s.b, s.t_off_at[2], 2u << 20, 8);
    if (!r)
        r = expect_fail(&s, KVC_ERR_CORRUPT, "data section would start at byte 1048576, past the "
                        "end of the file", "alignment 2^20, offsets moved");
    free(s.b.p);
    return r;
}

TEST(bad_tensor_offsets) {
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_off_at[1], 33, 8), KVC_ERR_CORRUPT,
                   "tensor 'b', byte");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_off_at[1], 33, 8), KVC_ERR_CORRUPT,
                   "data offset 33 is not a multiple of the alignment 32");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_off_at[2], 1ull << 40, 8), KVC_ERR_CORRUPT,
                   "extends past the end of the file");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_off_at[2], UINT64_MAX - 31, 8), KVC_ERR_CORRUPT,
                   "tensor 'c'");
    /* c ends at EOF: one block further is out */
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_off_at[2], 128, 8), KVC_ERR_CORRUPT,
                   "data [128, +80 bytes) extends past the end of the file (the data section has "
                   "176 bytes)");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_off_at[1], 0, 8), KVC_ERR_CORRUPT,
                   "overlaps tensor 'a'");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_off_at[0], 32, 8), KVC_ERR_CORRUPT, "overlaps");
    /* Offsets need not follow the tensor order, only be disjoint: b (34
     * bytes) first at 0, a (32 bytes) at 64, c stays at 96. */
    sample s;
    build_sample(&s, 3, 0);
    patch_le(&s.b, s.t_off_at[0], 64, 8);
    patch_le(&s.b, s.t_off_at[1], 0, 8);
    kvc_gguf *g = NULL;
    ASSERT_OK(kvc_gguf_open_memory(s.b.p, s.b.n, &g));
    kvc_gguf_tensor t;
    ASSERT_OK(kvc_gguf_get_tensor(g, 0, &t));
    ASSERT_EQ_I64((const uint8_t *)t.data - s.b.p, s.data_at + 64);
    kvc_gguf_close(g);
    free(s.b.p);
    return 0;
}

TEST(bad_dims) {
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_dim_at[0], 0, 8), KVC_ERR_CORRUPT,
                   "tensor 'a', byte");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_dim_at[0] + 8, 0, 8), KVC_ERR_CORRUPT,
                   "dimension 1 is 0");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_dim_at[2] + 8, 1ull << 40, 8);
                   patch_le(&s->b, s->t_dim_at[2] + 16, 1ull << 40, 8), KVC_ERR_CORRUPT,
                   "dimension 2 = 1099511627776 makes the element count overflow int64");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_dim_at[1], 1ull << 63, 8), KVC_ERR_CORRUPT,
                   "overflow");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_dim_at[1], UINT64_MAX, 8), KVC_ERR_CORRUPT,
                   "overflow");
    /* Element count fits int64 but the byte size does not (F32: 4 bytes each). */
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_dim_at[0], 1ull << 61, 8), KVC_ERR_CORRUPT,
                   "overflow int64 bytes");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_ndims_at[0], 0, 4), KVC_ERR_CORRUPT,
                   "0 dimensions, must be 1 to 4");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_ndims_at[2], 5, 4), KVC_ERR_CORRUPT,
                   "5 dimensions");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_ndims_at[2], UINT32_MAX, 4), KVC_ERR_CORRUPT,
                   "dimensions, must be 1 to 4");
    /* A dimension that is valid but makes the data too big for the file. */
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_dim_at[0] + 8, 3, 8), KVC_ERR_CORRUPT,
                   "overlaps");
    return 0;
}

TEST(bad_tensor_types) {
    static const uint32_t unknown[] = {4, 5, 31, 36, 43, 1000, UINT32_MAX};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++)
        EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_type_at[1], unknown[i], 4),
                       KVC_ERR_UNSUPPORTED, "tensor 'b', byte");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_type_at[1], 31, 4), KVC_ERR_UNSUPPORTED,
                   "unknown ggml tensor type 31");
    /* a: ne[0] = 4 is no multiple of 32 */
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_type_at[0], KVC_GGML_Q8_0, 4), KVC_ERR_CORRUPT,
                   "ne[0] = 4 is not a multiple of the Q8_0 block size 32");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_type_at[2], KVC_GGML_Q4_K, 4), KVC_ERR_CORRUPT,
                   "Q4_K block size 256");
    /* A valid type change that grows the data past the file. */
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_type_at[2], KVC_GGML_F32, 4), KVC_ERR_CORRUPT,
                   "extends past the end");
    return 0;
}

TEST(duplicates_and_names) {
    EXPECT_PATCHED(3, 0, s->b.p[s->key_i8_at + 8 + 2] = 'u', KVC_ERR_CORRUPT,
                   "key 't.u8', byte");
    EXPECT_PATCHED(3, 0, s->b.p[s->key_i8_at + 8 + 2] = 'u', KVC_ERR_CORRUPT,
                   "duplicate key (pairs 1 and 2 have the same name)");
    EXPECT_PATCHED(3, 0, s->b.p[s->t_name_at[2] + 8] = 'a', KVC_ERR_CORRUPT,
                   "duplicate tensor name (tensor infos 0 and 2)");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->key_u8_at, 0, 8), KVC_ERR_CORRUPT,
                   "key-value pair 1, byte");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->key_u8_at, 0, 8), KVC_ERR_CORRUPT,
                   "empty key name");
    EXPECT_PATCHED(3, 0, s->b.p[s->key_u8_at + 8 + 1] = 0, KVC_ERR_CORRUPT,
                   "key name contains a NUL byte");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_name_at[1], 0, 8), KVC_ERR_CORRUPT,
                   "tensor info 1, byte");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->t_name_at[1], 0, 8), KVC_ERR_CORRUPT,
                   "empty tensor name");
    EXPECT_PATCHED(3, 0, s->b.p[s->t_name_at[1] + 8] = 0, KVC_ERR_CORRUPT,
                   "tensor name contains a NUL byte");
    /* Non-printable bytes are quoted as '?' in messages. */
    EXPECT_PATCHED(3, 0, (s->b.p[s->t_name_at[0] + 8] = 0x01, s->b.p[s->t_name_at[2] + 8] = 0x01),
                   KVC_ERR_CORRUPT, "tensor '?'");
    return 0;
}

TEST(bad_values) {
    EXPECT_PATCHED(3, 0, s->b.p[s->bool_at] = 2, KVC_ERR_CORRUPT, "key 't.bool'");
    EXPECT_PATCHED(3, 0, s->b.p[s->bool_at] = 2, KVC_ERR_CORRUPT,
                   "bool value 2 (element 0) is neither 0 nor 1");
    EXPECT_PATCHED(3, 0, s->b.p[s->bool_at] = 0xff, KVC_ERR_CORRUPT, "bool value 255");
    EXPECT_PATCHED(3, 0, s->b.p[s->bool_arr_at] = 7, KVC_ERR_CORRUPT,
                   "bool value 7 (element 1)");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->key_u8_at + 8 + 4, 13, 4), KVC_ERR_CORRUPT,
                   "key 't.u8', byte 81: unknown value type 13");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->key_u8_at + 8 + 4, UINT32_MAX, 4), KVC_ERR_CORRUPT,
                   "unknown value type 4294967295");
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->arr_i32_type_at, 13, 4), KVC_ERR_CORRUPT,
                   "unknown array element type 13");
    /* Scalar type changed to a wider one: the file no longer parses. */
    EXPECT_PATCHED(3, 0, patch_le(&s->b, s->key_u8_at + 8 + 4, KVC_GGUF_UINT64, 4),
                   KVC_ERR_CORRUPT, "byte");
    return 0;
}

TEST(nested_array_depth) {
    for (int depth = 1; depth <= 6; depth++) {
        gb b = {0};
        gb_put(&b, "GGUF", 4);
        gb_u32(&b, 3);
        gb_u64(&b, 0);
        gb_u64(&b, 1);
        gb_key(&b, "nested", KVC_GGUF_ARRAY);
        for (int d = 1; d < depth; d++) {
            gb_u32(&b, KVC_GGUF_ARRAY);
            gb_u64(&b, 1);
        }
        gb_u32(&b, KVC_GGUF_INT16);
        gb_u64(&b, 2);
        gb_le(&b, 7, 2);
        gb_le(&b, 8, 2);
        kvc_gguf *g = NULL;
        uint8_t *copy;
        kvc_status st = open_n(&b, b.n, &g, &copy);
        if (depth <= 4) {
            ASSERT_OK(st);
            kvc_gguf_type et;
            int64_t n;
            const void *data;
            ASSERT_OK(kvc_gguf_get_arr(g, "nested", &et, &n, &data));
            ASSERT_EQ_I64(et, depth == 1 ? KVC_GGUF_INT16 : KVC_GGUF_ARRAY);
            ASSERT_EQ_I64(n, depth == 1 ? 2 : 1);
            ASSERT_TRUE((data != NULL) == (depth == 1));
            kvc_gguf_close(g);
        } else {
            ASSERT_EQ_I64(st, KVC_ERR_CORRUPT);
            ASSERT_STR_CONTAINS(kvc_last_error(), "arrays nested more than 4 levels deep");
        }
        free(copy);
        free(b.p);
    }
    return 0;
}

/* Every byte of a valid image replaced by a few values: no crash, no leak,
 * and either a clean error or a handle whose accessors all work. */
TEST(single_byte_mutations) {
    static const uint8_t values[] = {0x00, 0x01, 0x02, 0x07, 0x20, 0x7f, 0x80, 0xff};
    sample s;
    build_sample(&s, 3, 0);
    int64_t n_ok = 0, n_err = 0;
    for (size_t at = 0; at < s.b.n; at++) {
        for (size_t k = 0; k < sizeof values / sizeof values[0]; k++) {
            uint8_t *copy = exact_copy(&s.b, s.b.n);
            copy[at] = values[k];
            kvc_gguf *g = NULL;
            kvc_status st = kvc_gguf_open_memory(copy, s.b.n, &g);
            if (st == KVC_OK) {
                (void)walk_all(g);
                kvc_gguf_close(g);
                n_ok++;
            } else {
                ASSERT_TRUE(g == NULL);
                ASSERT_TRUE(st == KVC_ERR_CORRUPT || st == KVC_ERR_UNSUPPORTED);
                ASSERT_STR_CONTAINS(kvc_last_error(), "GGUF: ");
                n_err++;
            }
            free(copy);
        }
    }
    free(s.b.p);
    ASSERT_TRUE(n_ok > 0 && n_err > 0);
    return 0;
}

/* ---- files --------------------------------------------------------------------------- */

static int write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, n, f);
    return (fclose(f) == 0 && w == n) ? 0 : -1;
}

TEST(open_file) {
    char dir[] = "/tmp/kvc_gguf_XXXXXX";
    if (!mkdtemp(dir)) SKIP("mkdtemp failed");
    char path[256], empty[256], bad[256];
    snprintf(path, sizeof path, "%s/sample.gguf", dir);
    snprintf(empty, sizeof empty, "%s/empty.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bad.gguf", dir);
    sample s;
    build_sample(&s, 3, 64);
    int r = 1;
    kvc_gguf *g = NULL;
    if (write_file(path, s.b.p, s.b.n) || write_file(empty, "", 0)) goto done;
    s.b.p[s.bool_at] = 3;
    if (write_file(bad, s.b.p, s.b.n)) goto done;
    s.b.p[s.bool_at] = 1;

    /* mapped, and read into memory (--no-mmap): the same handle */
    kvc_status (*const opens[2])(const char *, kvc_gguf **) = {kvc_gguf_open, kvc_gguf_open_read};
    for (int k = 0; k < 2; k++) {
        ASSERT_OK(opens[k](path, &g));
        ASSERT_EQ_I64(kvc_gguf_alignment(g), 64);
        ASSERT_EQ_I64(kvc_gguf_n_tensors(g), 3);
        kvc_gguf_tensor t;
        ASSERT_OK(kvc_gguf_get_tensor(g, 2, &t));
        ASSERT_EQ_I64((uintptr_t)t.data % 64, 0); /* both page-aligned */
        ASSERT_MEM_EQ(t.data, s.b.p + s.b.n - 80, 80);
        ASSERT_TRUE(walk_all(g) != 0);
        kvc_gguf_close(g);
        g = NULL;

        ASSERT_STATUS(opens[k](bad, &g), KVC_ERR_CORRUPT);
        ASSERT_TRUE(g == NULL);
        ASSERT_STR_CONTAINS(kvc_last_error(), bad);
        ASSERT_STR_CONTAINS(kvc_last_error(), ": GGUF: key 't.bool', byte");
        ASSERT_STATUS(opens[k](empty, &g), KVC_ERR_CORRUPT);
        ASSERT_STR_CONTAINS(kvc_last_error(), "the file is empty");
        ASSERT_STATUS(opens[k](dir, &g), KVC_ERR_IO);
        ASSERT_STR_CONTAINS(kvc_last_error(), "not a regular file");
        char missing[300];
        snprintf(missing, sizeof missing, "%s/missing.gguf", dir);
        ASSERT_STATUS(opens[k](missing, &g), KVC_ERR_IO);
        ASSERT_STR_CONTAINS(kvc_last_error(), "missing.gguf: cannot open: No such file");
        ASSERT_TRUE(g == NULL);
    }
    r = 0;
done:
    unlink(path);
    unlink(empty);
    unlink(bad);
    rmdir(dir);
    free(s.b.p);
    if (r) TEST_FAIL_("cannot write files under %s", dir);
    return 0;
}

/* The real model, found next to this source file (or $KVC_GGUF_MODEL). */
TEST(real_model) {
    char path[1024];
    const char *env = getenv("KVC_GGUF_MODEL");
    if (env && *env) {
        snprintf(path, sizeof path, "%s", env);
    } else {
        const char *src = __FILE__; /* .../tests/test_gguf.c */
        const char *slash = strrchr(src, '/');
        int dir_len = slash ? (int)(slash - src) : 0;
        snprintf(path, sizeof path, "%.*s%s../models/SmolLM2-135M-Instruct.Q4_1.gguf", dir_len,
                 src, slash ? "/" : "");
    }
    struct stat sb;
    if (stat(path, &sb) != 0)
        SKIP("the default model is absent (%s): scripts/fetch_model.sh", path);
    kvc_gguf *g = NULL;
    ASSERT_OK(kvc_gguf_open(path, &g));
    ASSERT_EQ_I64(kvc_gguf_version(g), 3);
    ASSERT_EQ_I64(kvc_gguf_alignment(g), 32);
    ASSERT_EQ_I64(kvc_gguf_n_kv(g), 33);
    ASSERT_EQ_I64(kvc_gguf_n_tensors(g), 272);
    const char *s;
    size_t len;
    ASSERT_OK(kvc_gguf_get_str(g, "general.architecture", &s, &len));
    ASSERT_TRUE(len == 5 && memcmp(s, "llama", 5) == 0);
    int64_t v;
    ASSERT_OK(kvc_gguf_get_i64(g, "llama.block_count", &v));
    ASSERT_EQ_I64(v, 30);
    ASSERT_OK(kvc_gguf_get_i64(g, "llama.attention.head_count_kv", &v));
    ASSERT_EQ_I64(v, 3);
    double f;
    ASSERT_OK(kvc_gguf_get_f64(g, "llama.rope.freq_base", &f));
    ASSERT_TRUE(f == 100000.0);
    kvc_gguf_type et;
    int64_t n;
    ASSERT_OK(kvc_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n, NULL));
    ASSERT_EQ_I64(et, KVC_GGUF_STRING);
    ASSERT_EQ_I64(n, 49152);
    ASSERT_OK(kvc_gguf_get_arr_str(g, "tokenizer.ggml.tokens", 0, &s, &len));
    ASSERT_TRUE(len == 13 && memcmp(s, "<|endoftext|>", 13) == 0);
    ASSERT_OK(kvc_gguf_get_arr_str(g, "tokenizer.ggml.tokens", n - 1, &s, &len));
    ASSERT_TRUE(len == 7 && memcmp(s, "ectable", 7) == 0);
    ASSERT_OK(kvc_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n, NULL));
    ASSERT_EQ_I64(n, 48900);
    int64_t i = kvc_gguf_find_tensor(g, "token_embd.weight");
    ASSERT_TRUE(i >= 0);
    kvc_gguf_tensor t;
    ASSERT_OK(kvc_gguf_get_tensor(g, i, &t));
    ASSERT_EQ_I64(t.type, KVC_GGML_Q8_0);
    ASSERT_EQ_I64(t.ne[0], 576);
    ASSERT_EQ_I64(t.ne[1], 49152);
    ASSERT_EQ_I64(t.size, 30081024);
    ASSERT_OK(kvc_gguf_get_tensor(g, kvc_gguf_find_tensor(g, "blk.29.ffn_down.weight"), &t));
    ASSERT_EQ_I64(t.type, KVC_GGML_Q4_1);
    ASSERT_EQ_I64(t.ne[0], 1536);
    ASSERT_EQ_I64(t.ne[1], 576);
    ASSERT_EQ_I64(kvc_gguf_find_tensor(g, "output.weight"), -1); /* tied */
    ASSERT_TRUE(walk_all(g) != 0);
    /* read into memory (--no-mmap): every tensor's bytes as mapped */
    kvc_gguf *r = NULL;
    ASSERT_OK(kvc_gguf_open_read(path, &r));
    ASSERT_EQ_I64(kvc_gguf_n_tensors(r), 272);
    for (int64_t k = 0; k < 272; k++) {
        kvc_gguf_tensor a, b;
        ASSERT_OK(kvc_gguf_get_tensor(g, k, &a));
        ASSERT_OK(kvc_gguf_get_tensor(r, k, &b));
        ASSERT_TRUE(a.data != b.data && a.size == b.size && strcmp(a.name, b.name) == 0);
        ASSERT_EQ_I64((uintptr_t)b.data % 32, 0);
        ASSERT_MEM_EQ(a.data, b.data, a.size);
    }
    kvc_gguf_close(r);
    kvc_gguf_close(g);
    return 0;
}

const char *test_suite_name = "gguf";
const test_case test_suite[] = {
    TEST_ENTRY(type_table),
    TEST_ENTRY(accessors_v3),
    TEST_ENTRY(accessors_v2_and_alignment),
    TEST_ENTRY(minimal_files),
    TEST_ENTRY(truncated_at_every_length),
    TEST_ENTRY(bad_magic_and_version),
    TEST_ENTRY(absurd_counts),
    TEST_ENTRY(string_lengths_past_eof),
    TEST_ENTRY(bad_alignment),
    TEST_ENTRY(bad_tensor_offsets),
    TEST_ENTRY(bad_dims),
    TEST_ENTRY(bad_tensor_types),
    TEST_ENTRY(duplicates_and_names),
    TEST_ENTRY(bad_values),
    TEST_ENTRY(nested_array_depth),
    TEST_ENTRY(single_byte_mutations),
    TEST_ENTRY(open_file),
    TEST_ENTRY(real_model),
    {0, 0},
};
