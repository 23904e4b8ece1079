/*
 * GGUF reader (versions 2 and 3): the container llama.cpp models ship in.
 *
 * File: magic "GGUF", uint32 version, uint64 tensor count, uint64 key-value
 * count, the key-value pairs (string key, uint32 value type, value), the
 * tensor infos (string name, uint32 n_dims <= 4, uint64 ne[n_dims] innermost
 * first, uint32 ggml type, uint64 offset), padding to `general.alignment`
 * (a uint32 key; default 32), then the tensor data; offsets are relative to
 * the start of the data section. A string is a uint64 byte length and the
 * bytes (no NUL); an array is a uint32 element type, a uint64 count and the
 * elements. All integers little-endian (big-endian files are refused).
 *
 * kvc_gguf_open maps the file read-only; every size, count, offset, string
 * length, type and tensor extent is validated at open, so the accessors
 * below cannot read outside the file:
 *   - counts are bounded by the bytes left before anything is allocated;
 *   - keys and tensor names are non-empty, contain no NUL byte, are unique;
 *   - value types are known, bools are 0 or 1, arrays of arrays are
 *     accepted up to 4 levels deep (their elements are validated, not
 *     exposed); general.alignment is a uint32 power of two;
 *   - tensors have 1..4 dims, each > 0, an element count and byte size that
 *     fit int64, a known type, ne[0] a multiple of the type's block size, an
 *     offset that is a multiple of the alignment, data inside the file and
 *     disjoint from every other tensor's.
 * A bad file gives KVC_ERR_CORRUPT (or KVC_ERR_UNSUPPORTED for a file we
 * cannot read: version 1 or > 3, big-endian, an unknown tensor type) with a
 * message naming what is wrong and where ("GGUF: key 't.bool', byte 81:
 * bool value 2 ..."; kvc_gguf_open prefixes the path); never a crash.
 * Opening costs one pass over the header plus a hash index of keys and
 * tensor names: find_key/find_tensor and get_arr_str are O(1).
 *
 * Pointers returned by accessors stay valid until kvc_gguf_close. Strings in
 * the file are not NUL-terminated: they are returned as (pointer, length);
 * key and tensor names are NUL-terminated copies. A handle is read-only
 * after open: any number of threads may call accessors on it concurrently.
 * The mapping assumes the file is not truncated while open (as with any
 * mmap, that would fault on access).
 */
#ifndef KVCACHE_GGUF_H
#define KVCACHE_GGUF_H

#include <stddef.h>

#include "kvcache/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Value types of key-value pairs (GGUF spec numbering). */
typedef enum kvc_gguf_type {
    KVC_GGUF_UINT8 = 0,
    KVC_GGUF_INT8 = 1,
    KVC_GGUF_UINT16 = 2,
    KVC_GGUF_INT16 = 3,
    KVC_GGUF_UINT32 = 4,
    KVC_GGUF_INT32 = 5,
    KVC_GGUF_FLOAT32 = 6,
    KVC_GGUF_BOOL = 7,
    KVC_GGUF_STRING = 8,
    KVC_GGUF_ARRAY = 9,
    KVC_GGUF_UINT64 = 10,
    KVC_GGUF_INT64 = 11,
    KVC_GGUF_FLOAT64 = 12
} kvc_gguf_type;

/* Tensor element types (ggml numbering). Block layouts as in ggml:
 *   Q4_0: 32 elements = f16 d + 16 bytes of nibbles (x = d * (q - 8));
 *         element i < 16 is the low nibble of byte i, element i + 16 its high nibble
 *   Q4_1: 32 elements = f16 d, f16 m + 16 bytes (x = d * q + m)
 *   Q5_0/Q5_1: as Q4 plus 4 bytes of high bits; Q8_0: f16 d + 32 int8 (x = d * q)
 *   Q8_1: f16 d, f16 s + 32 int8 (36 bytes; very old ggml used two f32)
 *   K-quants: 256-element super-blocks (Q2_K 84, Q3_K 110, Q4_K 144, Q5_K 176,
 *   Q6_K 210, Q8_K 292 bytes):
 *   Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8], 128
 *         bytes of nibbles; sub-block j of 32: x = d sc[j] q - dmin m[j]
 *   Q5_K: as Q4_K with 32 bytes of high bits (bit j of byte l: element l of
 *         sub-block j) before the nibbles
 *   Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, int8
 *         scales[16], f16 d; x = d scales[e / 16] (q - 32)
 *   Q2_K: 16 bytes of scales (low nibble sc, high nibble m, one per 16
 *         elements), 64 bytes of 2-bit codes, f16 d, f16 dmin;
 *         x = d sc[e / 16] q - dmin m[e / 16]
 *   Q3_K: 32 bytes of high bits, 64 bytes of 2-bit codes, 12 bytes of 6-bit
 *         scales (16, stored + 32), f16 d; x = d (sc[e / 16] - 32) (q - 4)
 *         with q the 2 low bits | high bit << 2
 *   (Q2_K/Q3_K element e = 128 n + 32 j + l: low bits (qs[32 n + l] >> 2 j) & 3,
 *   Q3_K high bit = bit 4 n + j of hmask[l])
 *   IQ4_NL: as Q4_0 with x = d * KVC_GGML_IQ4_NL_VALUES[q] (below)
 *   IQ4_XS: 256 elements = f16 d, u16 scales_h, 4 bytes scales_l, 128 bytes
 *         of nibbles; sub-block j of 32 laid out as an IQ4_NL block's codes,
 *         x = d (ls_j - 32) KVC_GGML_IQ4_NL_VALUES[q], ls_j 6 bits (nibble j % 2
 *         of scales_l[j / 2] | bits 2 j, 2 j + 1 of scales_h << 4)
 * F32 4 bytes, F16/BF16 2 bytes per element. */
typedef enum kvc_ggml_type {
    KVC_GGML_F32 = 0,
    KVC_GGML_F16 = 1,
    KVC_GGML_Q4_0 = 2,
    KVC_GGML_Q4_1 = 3,
    KVC_GGML_Q5_0 = 6,
    KVC_GGML_Q5_1 = 7,
    KVC_GGML_Q8_0 = 8,
    KVC_GGML_Q8_1 = 9,
    KVC_GGML_Q2_K = 10,
    KVC_GGML_Q3_K = 11,
    KVC_GGML_Q4_K = 12,
    KVC_GGML_Q5_K = 13,
    KVC_GGML_Q6_K = 14,
    KVC_GGML_Q8_K = 15,
    KVC_GGML_IQ4_NL = 20,
    KVC_GGML_IQ4_XS = 23,
    KVC_GGML_BF16 = 30
} kvc_ggml_type;

/* The 16 int8 values IQ4_NL's nibbles select (ggml's kvalues_iq4nl). */
#define KVC_GGML_IQ4_NL_VALUES \
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}

/* Name ("Q4_1", as ggml spells it), or NULL for a type this library does
 * not know. */
KVC_API const char *kvc_ggml_type_name(int32_t type);
/* Elements per block (1 for F32/F16/BF16, 32, 256; 64 or 128 for some
 * newer ggml types), 0 if unknown. The name and block of every ggml type up
 * to Q2_0 (42) are known (the other IQ, TQ and FP4 types by number,
 * outside the enum), so a GGUF holding any of them opens; kvc_ggml_dequantize and the
 * model say which types they do not decode. */
KVC_API int64_t kvc_ggml_block_size(int32_t type);
/* Bytes per block, 0 if unknown. */
KVC_API int64_t kvc_ggml_block_bytes(int32_t type);

/*
 * Decodes n elements of a tensor of ggml type `type` (n / block_size blocks
 * at src, in the layouts above; K-quant details in src/gguf/dequant.c) to
 * float32 at dst, with the float32 operations of ggml's reference
 * dequantization in its order, so the result is bitwise what ggml (and the
 * gguf Python package's gguf.quants.dequantize) computes. Decoded types:
 * F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K. KVC_ERR_INVALID_ARG for an unknown type, n < 0 or not a
 * multiple of the block size, or a NULL pointer with n > 0;
 * KVC_ERR_UNSUPPORTED for a known type not decoded here (Q8_1, Q8_K, the
 * other IQ types, TQ*, MXFP4, ...). dst is written only on
 * success; src and dst must not overlap.
 */
KVC_API kvc_status kvc_ggml_dequantize(int32_t type, const void *src, int64_t n, float *dst);

typedef struct kvc_gguf kvc_gguf;

/* Maps and validates a file. KVC_ERR_IO if it cannot be opened, is not a
 * regular file or cannot be mapped; KVC_ERR_CORRUPT/UNSUPPORTED as above.
 * On error *out is NULL. */
KVC_API kvc_status kvc_gguf_open(const char *path, kvc_gguf **out);
/* kvc_gguf_open, except that the file is read into private memory instead
 * of mapped (llama.cpp's --no-mmap): on Linux a file of 8 MiB or more lands
 * on 2 MiB-aligned memory offered to transparent huge pages, which a file
 * mapping of the page cache does not get, so weights streamed every token
 * miss the TLB far less. It costs the read at open and memory of its own
 * (a mapping shares the page cache between processes and loads lazily).
 * KVC_ERR_NOMEM when the memory is not there. */
KVC_API kvc_status kvc_gguf_open_read(const char *path, kvc_gguf **out);
/* Validates a GGUF image in memory (not copied: data must outlive the
 * handle). For tests and fuzzing. Tensor data pointers are aligned to the
 * file's alignment only if data itself is. */
KVC_API kvc_status kvc_gguf_open_memory(const void *data, size_t size, kvc_gguf **out);
KVC_API void kvc_gguf_close(kvc_gguf *g); /* NULL is a no-op */

/* The accessors returning a value give 0 (version, alignment, counts), -1
 * (find_*) or NULL (kvc_gguf_key) for a NULL g. */

KVC_API uint32_t kvc_gguf_version(const kvc_gguf *g);
/* Byte alignment of the data section (general.alignment, default 32). */
KVC_API uint32_t kvc_gguf_alignment(const kvc_gguf *g);

/* ---- key-value pairs ----------------------------------------------------- */

KVC_API int64_t kvc_gguf_n_kv(const kvc_gguf *g);
/* Index of key, or -1. */
KVC_API int64_t kvc_gguf_find_key(const kvc_gguf *g, const char *key);
/* Key i (NUL-terminated copy owned by g), or NULL for i out of range. */
KVC_API const char *kvc_gguf_key(const kvc_gguf *g, int64_t i);
/* Value type of pair i; for arrays also the element type and count (for
 * other values *elem_type = *type and *n_elems = 1). Any output may be NULL.
 * KVC_ERR_INVALID_ARG for i out of range. */
KVC_API kvc_status kvc_gguf_kv_type(const kvc_gguf *g, int64_t i, kvc_gguf_type *type,
                                    kvc_gguf_type *elem_type, int64_t *n_elems);

/*
 * Typed getters by key. KVC_ERR_NOT_FOUND if the key is absent,
 * KVC_ERR_INVALID_ARG if its type does not fit: get_i64 accepts any integer
 * type (and bool; a uint64 above INT64_MAX is an error), get_u64 the same
 * with any uint64 (a negative value is an error), get_f64 any integer or
 * float type (not bool; float32 is widened exactly), get_str a string.
 * Outputs are left unchanged on error.
 */
KVC_API kvc_status kvc_gguf_get_i64(const kvc_gguf *g, const char *key, int64_t *out);
KVC_API kvc_status kvc_gguf_get_u64(const kvc_gguf *g, const char *key, uint64_t *out);
KVC_API kvc_status kvc_gguf_get_f64(const kvc_gguf *g, const char *key, double *out);
KVC_API kvc_status kvc_gguf_get_str(const kvc_gguf *g, const char *key, const char **s,
                                    size_t *len);

/*
 * Arrays by key: element type and count (outputs may be NULL). Numeric and
 * bool arrays: *data points at the packed little-endian elements inside the
 * file (possibly unaligned: read with memcpy). String arrays: *data is NULL,
 * read elements with kvc_gguf_get_arr_str. Arrays of arrays: *elem_type is
 * KVC_GGUF_ARRAY, *data is NULL (their elements are not exposed).
 */
KVC_API kvc_status kvc_gguf_get_arr(const kvc_gguf *g, const char *key, kvc_gguf_type *elem_type,
                                    int64_t *n, const void **data);
/* Element i of a string array (O(1): offsets are indexed at open).
 * KVC_ERR_INVALID_ARG if key is not an array of strings or i is out of
 * range. */
KVC_API kvc_status kvc_gguf_get_arr_str(const kvc_gguf *g, const char *key, int64_t i,
                                        const char **s, size_t *len);

/* ---- tensors ------------------------------------------------------------- */

typedef struct kvc_gguf_tensor {
    const char *name;  /* NUL-terminated, owned by g */
    int32_t type;      /* kvc_ggml_type */
    int32_t n_dims;    /* 1..4 */
    int64_t ne[4];     /* elements per dim, innermost first; unused dims 1 */
    const void *data;  /* inside the mapping, at a multiple of the alignment from
                          the file start (so aligned for kvc_gguf_open) */
    size_t size;       /* bytes */
} kvc_gguf_tensor;

/* Tensors in file order (the order of the tensor infos, not of the data). */
KVC_API int64_t kvc_gguf_n_tensors(const kvc_gguf *g);
/* Index of the named tensor, or -1. */
KVC_API int64_t kvc_gguf_find_tensor(const kvc_gguf *g, const char *name);
/* Tensor i; size = ne[0]*ne[1]*ne[2]*ne[3] / block_size * block_bytes.
 * KVC_ERR_INVALID_ARG for i out of range. */
KVC_API kvc_status kvc_gguf_get_tensor(const kvc_gguf *g, int64_t i, kvc_gguf_tensor *out);

#ifdef __cplusplus
}
#endif
#endif
