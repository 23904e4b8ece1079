/*
 * append_paged_kv_cache and append_paged_mla_kv_cache, SEMANTICS section 4.
 *
 * Row j of the ragged input goes to page kv_indices[kv_indptr[b] + pos / P],
 * slot pos % P (b = batch_indices[j], pos = positions[j], P = page_size).
 * The rows are moved by the pmx block mover (kvc__pmx_store: copy, convert
 * or quantize, scale rows mirrored), which only needs where a block of
 * tokens starts and its token/head strides; here a block is a run of rows of
 * one request at consecutive positions inside one page, so a prefill moves
 * up to a page per kernel call (NHD, contiguous) and a decode step one row
 * of H*Dh per K|V.
 *
 * A call validates everything first (shapes, dtypes, page table, every row's
 * destination, finiteness for quantized caches), then writes; work is split
 * into fixed 64-row chunks (never derived from the thread count), so the
 * bytes written do not depend on n_threads. When a call is larger than the
 * last-level cache (op.stream) and its float16/bfloat16 inputs go into
 * group-8 quantized caches, the finiteness pass also computes the group
 * scales (kernels.h quant_scales, into (nnz, H, Dh / 8) scratch memory of
 * the pool), so the pass that writes only quantizes: the check has to read
 * the whole input from DRAM before anything is written anyway, and the
 * absmax work rides on that read. Calls that fit in the cache quantize in
 * one go (measured faster there: decode-like appends 500 -> 700 ns per
 * token and layer with the two passes).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "paged_internal.h"
#include "../pmx/pmx_common.h"

#define PAGED_CHUNK 64 /* input rows per task */

/* One half (K, V, ckv or kpe): its input and where page 0, slot 0 is. */
typedef struct paged_half {
    pmx_op op;            /* H, Dh, dtypes, quantization */
    const kvc_tensor *in; /* (nnz, H, Dh), or (nnz, D) for MLA (H = 1) */
    pmx_rows slot0;       /* tok_stride: slot stride inside a page */
    int64_t page_stride, spage_stride;
    char *qs; /* scales of the input rows (nnz, H, Dh / g), slot0.sdtype; NULL: none */
} paged_half;

typedef struct append_call {
    paged_half half[2];
    int shared_op; /* K/V: both halves have one op, one kvc__pmx_store moves both */
    int halves;    /* 1: both halves in one task; 2: separate tasks (head-major caches) */
    const kvc_tensor *bi, *pos, *indices, *indptr; /* validated 1-D int32 */
    int64_t nnz, page_size, n_chunks;
    int64_t B, n_indices, max_pages; /* the bounds check_rows validated */
    unsigned char *bad; /* finiteness pass: one flag per chunk */
    void *scratch;      /* holds half[].qs */
} append_call;

/* ---- row movement ----------------------------------------------------------- */

/* Scales per input row (head) of a quantized half. */
static int64_t row_groups(const paged_half *h) { return h->op.Dh / h->op.group; }

static pmx_rows input_rows(const paged_half *h, int64_t j) {
    const kvc_tensor *t = h->in;
    pmx_rows r = {0};
    r.ptr = kvc__at(t, j * t->stride[0]);
    r.dtype = t->dtype;
    r.tok_stride = t->stride[0];
    r.head_stride = t->ndim == 3 ? t->stride[1] : 0;
    if (h->qs) {
        r.qsdtype = h->slot0.sdtype;
        r.qshead_stride = row_groups(h);
        r.qstok_stride = h->op.H * r.qshead_stride;
        r.qsptr = h->qs + kvc__bytes(r.qsdtype, j * r.qstok_stride);
    }
    return r;
}

static pmx_rows page_rows(const paged_half *h, int64_t page, int64_t slot) {
    pmx_rows r = h->slot0;
    r.ptr += kvc__bytes(r.dtype, page * h->page_stride + slot * r.tok_stride);
    if (r.sptr) r.sptr += kvc__bytes(r.sdtype, page * h->spage_stride + slot * r.stok_stride);
    return r;
}

/* Stores input rows [j0, j1) (half `only` if >= 0), cut into runs of one
 * request at consecutive positions inside one page. */
static void store_rows(const append_call *c, int64_t j0, int64_t j1, int only) {
    const int64_t P = c->page_size;
    for (int64_t j = j0; j < j1;) {
        const int32_t b = kvc__i32_1d(c->bi, j), p = kvc__i32_1d(c->pos, j);
        const int64_t slot = p % P;
        /* The index tensors are read again here: a cache laid over them
         * (core.h: undefined) may have changed them, so a row whose
         * destination left the validated bounds is skipped, never stored out
         * of bounds. */
        const int64_t ip = b >= 0 && b < c->B && p >= 0 ? kvc__i32_1d(c->indptr, b) + p / P : -1;
        const int64_t page = ip >= 0 && ip < c->n_indices ? kvc__i32_1d(c->indices, ip) : -1;
        if (page < 0 || page >= c->max_pages) {
            j++;
            continue;
        }
        int64_t run = 1;
        while (j + run < j1 && run < P - slot && kvc__i32_1d(c->bi, j + run) == b &&
               kvc__i32_1d(c->pos, j + run) == p + run)
            run++;
        pmx_rows in[2] = {{0}, {0}}, cache[2];
        for (int kv = 0; kv < 2; kv++) {
            cache[kv] = page_rows(&c->half[kv], page, slot);
            if (only < 0 || only == kv) in[kv] = input_rows(&c->half[kv], j);
        }
        if (c->shared_op) {
            kvc__pmx_store(&c->half[0].op, in, cache, run);
        } else {
            for (int kv = 0; kv < 2; kv++) {
                if (!in[kv].ptr) continue;
                pmx_rows one[2] = {in[kv], {0}}, dst[2] = {cache[kv], cache[kv]};
                kvc__pmx_store(&c->half[kv].op, one, dst, run);
            }
        }
        j += run;
    }
}

/* Rows [chunk * PAGED_CHUNK, chunk_end) form one task's chunk. */
static int64_t chunk_end(const append_call *c, int64_t chunk) {
    const int64_t end = (chunk + 1) * PAGED_CHUNK;
    return end < c->nnz ? end : c->nnz;
}

static void store_task(void *ctx, int64_t task) {
    const append_call *c = ctx;
    const int only = c->halves == 2 ? (int)(task / c->n_chunks) : -1;
    const int64_t chunk = task % c->n_chunks;
    store_rows(c, chunk * PAGED_CHUNK, chunk_end(c, chunk), only);
}

/* ---- finiteness (quantized halves) --------------------------------------------- */

/* Input elements [x, x + n) of a half, rows from row-head rh on: 1 if
 * finite (and below kvc__quant_limit: a float16 scale must not overflow);
 * with h->qs set, their scales go to h->qs too. */
static int span_finite(const paged_half *h, const void *x, int64_t n, int64_t rh) {
    const pmx_op *op = &h->op;
    const kvc_dtype sd = h->slot0.sdtype;
    if (!h->qs) return op->k->all_finite(x, op->t1, n, kvc__quant_limit(op->bits, sd));
    return op->k->quant_scales(x, op->t1, n, op->bits, op->group,
                               h->qs + kvc__bytes(sd, rh * row_groups(h)), sd);
}

/* Input row j, head hh of a half. */
static const void *in_row(const paged_half *h, int64_t j, int64_t hh) {
    const kvc_tensor *t = h->in;
    return kvc__at(t, j * t->stride[0] + (h->op.H > 1 ? hh * t->stride[1] : 0));
}

/* 1 if input rows [j0, j1) of a half are all finite (and their scales in
 * h->qs when set), in as few kernel calls as the input's strides allow;
 * *bad_j / *bad_h get the first offending row and head when report is set
 * (row by row then). */
static int rows_finite(const paged_half *h, int64_t j0, int64_t j1, int report, int64_t *bad_j,
                       int64_t *bad_h) {
    const kvc_tensor *t = h->in;
    const pmx_op *op = &h->op;
    const int packed = op->H == 1 || t->stride[1] == op->Dh;
    if (!report && packed && (j1 - j0 == 1 || t->stride[0] == op->H * op->Dh))
        return span_finite(h, kvc__at(t, j0 * t->stride[0]), (j1 - j0) * op->H * op->Dh,
                           j0 * op->H);
    for (int64_t j = j0; j < j1; j++) {
        if (!report && packed) {
            if (!span_finite(h, kvc__at(t, j * t->stride[0]), op->H * op->Dh, j * op->H)) return 0;
            continue;
        }
        for (int64_t hh = 0; hh < op->H; hh++) {
            if (!span_finite(h, in_row(h, j, hh), op->Dh, j * op->H + hh)) {
                *bad_j = j;
                *bad_h = hh;
                return 0;
            }
        }
    }
    return 1;
}

static void finite_task(void *ctx, int64_t task) {
    append_call *c = ctx;
    const int64_t j0 = task * PAGED_CHUNK, j1 = chunk_end(c, task);
    int64_t bj, bh;
    for (int kv = 0; kv < 2; kv++)
        if (c->half[kv].op.bits && !rows_finite(&c->half[kv], j0, j1, 0, &bj, &bh))
            c->bad[task] = 1;
}

static void free_scales(append_call *c, kvc_threadpool *pool) {
    kvc__scratch_release(pool, c->scratch);
    c->scratch = NULL;
    c->half[0].qs = c->half[1].qs = NULL;
}

/* Fails if a row stored into a quantized half holds NaN or Inf; chunks are
 * checked in parallel, the first bad one is then scanned for the message.
 * Large calls' halves with float16/bfloat16 input and group 8 get their
 * scales computed here (c->half[kv].qs, in scratch memory of the pool:
 * released by the caller, or here on failure). */
static kvc_status check_finite(const char *fn, append_call *c, const char *const names[2],
                               kvc_threadpool *pool) {
    if (!c->half[0].op.bits && !c->half[1].op.bits) return KVC_OK;
    if (c->nnz == 0) return KVC_OK;
    size_t bytes[2] = {0, 0};
    for (int kv = 0; kv < 2; kv++) {
        const paged_half *h = &c->half[kv];
        if (h->op.bits && h->op.stream && kvc__quant_split_fast(h->op.t1, h->op.group))
            bytes[kv] = (size_t)kvc__bytes(h->slot0.sdtype, c->nnz * h->op.H * row_groups(h));
        bytes[kv] = (bytes[kv] + 63) & ~(size_t)63; /* V's scales start 64-byte aligned */
    }
    /* One block of the pool's scratch holds the scales and, after them, the
     * chunk flags: a caller that reserved kvc__append_scratch_bytes (the
     * model's forward step) makes this call unable to fail here. */
    c->scratch = kvc__scratch_get(pool, bytes[0] + bytes[1] + (size_t)c->n_chunks);
    if (!c->scratch) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    if (bytes[0]) c->half[0].qs = c->scratch;
    if (bytes[1]) c->half[1].qs = (char *)c->scratch + bytes[0];
    c->bad = (unsigned char *)c->scratch + bytes[0] + bytes[1];
    memset(c->bad, 0, (size_t)c->n_chunks);
    kvc__parallel_for(pool, c->n_chunks, finite_task, c);
    kvc_status st = KVC_OK;
    for (int64_t t = 0; t < c->n_chunks && st == KVC_OK; t++) {
        if (!c->bad[t]) continue;
        const int64_t j0 = t * PAGED_CHUNK, j1 = chunk_end(c, t);
        for (int kv = 0; kv < 2 && st == KVC_OK; kv++) {
            int64_t bj = -1, bh = -1;
            const paged_half *h = &c->half[kv];
            if (h->op.bits && !rows_finite(h, j0, j1, 1, &bj, &bh)) {
                char what[96];
                snprintf(what, sizeof what, "%s (row %lld, head %lld)", names[kv], (long long)bj,
                         (long long)bh);
                st = kvc__quant_input_error(fn, what, in_row(h, bj, bh), h->op.t1, h->op.Dh,
                                            h->op.bits, h->slot0.sdtype);
            }
        }
    }
    c->bad = NULL;
    if (st != KVC_OK) free_scales(c, pool);
    return st;
}

/* ---- validation ------------------------------------------------------------------ */

static int is_float(kvc_dtype d) { return d == KVC_F32 || d == KVC_F16 || d == KVC_BF16; }

/* Input dtype t1 into cache dtype t2: a copy (same dtype), a conversion
 * (float -> float) or quantization (float -> int8/int4; *bits 8 or 4). */
static kvc_status check_dtypes(const char *fn, const char *in_name, kvc_dtype t1, kvc_dtype t2,
                               int allow_quant, int *bits) {
    *bits = 0;
    if (allow_quant)
        KVC_CHECK(is_float(t2) || t2 == KVC_I8 || t2 == KVC_I4,
                  "%s: cache dtype must be float32, float16, bfloat16, int8 or int4, got %s", fn,
                  kvc_dtype_name(t2));
    else
        KVC_CHECK(is_float(t2), "%s: cache dtype must be float32, float16 or bfloat16, got %s", fn,
                  kvc_dtype_name(t2));
    if (t1 == t2) return KVC_OK;
    KVC_CHECK(is_float(t1), "%s: %s dtype %s cannot be stored into a %s cache (inputs must be "
              "float32, float16, bfloat16 or the cache's dtype)", fn, in_name,
              kvc_dtype_name(t1), kvc_dtype_name(t2));
    if (t2 == KVC_I8) *bits = 8;
    if (t2 == KVC_I4) *bits = 4;
    return KVC_OK;
}

/* Two input tensors of one call: same rank, shape and dtype. */
static kvc_status check_pair(const char *fn, const char *n1, const kvc_tensor *a, const char *n2,
                             const kvc_tensor *b) {
    char b1[96], b2[96];
    int same = a->ndim == b->ndim && a->dtype == b->dtype;
    for (int i = 0; same && i < a->ndim; i++) same = a->shape[i] == b->shape[i];
    KVC_CHECK(same, "%s: %s %s %s and %s %s %s must have the same shape and dtype", fn, n1,
              kvc__shape_str(a, b1, sizeof b1), kvc_dtype_name(a->dtype), n2,
              kvc__shape_str(b, b2, sizeof b2), kvc_dtype_name(b->dtype));
    return KVC_OK;
}

/* Scale tensor of a quantized cache: float32/float16, the cache's shape with
 * last dim Dh / group. */
static kvc_status check_scale(const char *fn, const char *name, const kvc_tensor *s,
                              const kvc_tensor *cache, int64_t groups) {
    char b1[96], b2[96];
    KVC_TRY(kvc__check_tensor(s, name, 1));
    KVC_TRY(kvc__check_writable(s, name));
    KVC_CHECK(s->dtype == KVC_F32 || s->dtype == KVC_F16,
              "%s: %s must be float32 or float16, got %s", fn, name, kvc_dtype_name(s->dtype));
    int ok = s->ndim == cache->ndim;
    for (int i = 0; ok && i < cache->ndim - 1; i++) ok = s->shape[i] == cache->shape[i];
    ok = ok && s->shape[s->ndim - 1] == groups;
    KVC_CHECK(ok, "%s: %s %s must be the cache shape %s with last dim Dh / quant_group = %lld "
              "(missing scales for an int8/int4 cache?)", fn, name,
              kvc__shape_str(s, b1, sizeof b1), kvc__shape_str(cache, b2, sizeof b2),
              (long long)groups);
    return KVC_OK;
}

/* Page table and every row's destination: batch_indices[j] in [0, B),
 * positions[j] in [0, seq_len_b). */
static kvc_status check_rows(const char *fn, append_call *c, const kvc_tensor *kv_last_page_len,
                             int64_t max_pages) {
    int64_t B;
    KVC_TRY(kvc__paged_check_table(fn, c->indptr, c->indices, kv_last_page_len, c->page_size,
                                   max_pages, 1, &B));
    c->B = B;
    c->n_indices = c->indices->shape[0];
    c->max_pages = max_pages;
    KVC_TRY(kvc__paged_check_i32(fn, "batch_indices", c->bi, c->nnz));
    KVC_TRY(kvc__paged_check_i32(fn, "positions", c->pos, c->nnz));
    for (int64_t j = 0; j < c->nnz; j++) {
        const int32_t b = kvc__i32_1d(c->bi, j), p = kvc__i32_1d(c->pos, j);
        KVC_CHECK(b >= 0 && b < B, "%s: batch_indices[%lld] = %d outside [0, B=%lld)", fn,
                  (long long)j, (int)b, (long long)B);
        KVC_CHECK(p >= 0 && kvc__paged_pos_ok(c->indptr, kv_last_page_len, c->page_size, b, p),
                  "%s: positions[%lld] = %d outside [0, seq_len) of request %d (its pages and "
                  "kv_last_page_len must already include the appended tokens)", fn,
                  (long long)j, (int)p, (int)b);
    }
    return KVC_OK;
}

/* Validation done: checks finiteness, then moves every row. */
static kvc_status run_append(const char *fn, append_call *c, const char *const names[2],
                             kvc_threadpool *pool) {
    c->n_chunks = (c->nnz + PAGED_CHUNK - 1) / PAGED_CHUNK;
    KVC_TRY(check_finite(fn, c, names, pool));
    /* Everything is valid: from here on nothing can fail. */
    if (c->nnz > 0) kvc__parallel_for(pool, c->halves * c->n_chunks, store_task, c);
    free_scales(c, pool);
    return KVC_OK;
}

size_t kvc__append_scratch_bytes(int64_t nnz, int64_t H, int64_t Dh, int32_t quant_group,
                                 kvc_dtype cache_dtype) {
    if (nnz <= 0) return 0;
    /* check_finite: scales of both halves (quantized caches; float32 at most,
     * each rounded up to 64 bytes), then one flag per chunk (every cache) */
    const size_t flags = (size_t)((nnz + PAGED_CHUNK - 1) / PAGED_CHUNK);
    if ((cache_dtype != KVC_I8 && cache_dtype != KVC_I4) || quant_group < 1) return flags;
    const size_t scales = ((size_t)(nnz * H * (Dh / quant_group)) * 4 + 63) & ~(size_t)63;
    return 2 * scales + flags;
}

/* ---- public functions ----------------------------------------------------------- */

kvc_status kvc_append_paged_kv_cache(const kvc_tensor *append_key, const kvc_tensor *append_value,
                                     const kvc_tensor *batch_indices, const kvc_tensor *positions,
                                     kvc_paged_cache *cache, const kvc_tensor *kv_indices,
                                     const kvc_tensor *kv_indptr,
                                     const kvc_tensor *kv_last_page_len, kvc_threadpool *pool) {
    static const char fn[] = "kvc_append_paged_kv_cache";
    static const char *const names[2] = {"append_key", "append_value"};
    char b1[96], b2[96];
    KVC_CHECK(cache != NULL, "%s: cache is NULL", fn);
    KVC_CHECK(append_key != NULL && append_value != NULL, "%s: append_key/append_value is NULL",
              fn);
    KVC_TRY(kvc__check_tensor(append_key, "append_key", 1));
    KVC_TRY(kvc__check_tensor(append_value, "append_value", 1));
    KVC_TRY(kvc__check_tensor(&cache->k, "cache->k", 1));
    KVC_TRY(kvc__check_tensor(&cache->v, "cache->v", 1));
    KVC_TRY(kvc__check_writable(&cache->k, "cache->k"));
    KVC_TRY(kvc__check_writable(&cache->v, "cache->v"));
    KVC_CHECK(cache->layout == KVC_NHD || cache->layout == KVC_HND,
              "%s: cache->layout must be KVC_NHD (0) or KVC_HND (1), got %d", fn,
              (int)cache->layout);
    const int hnd = cache->layout == KVC_HND;
    const kvc_tensor *k = &cache->k, *v = &cache->v;
    KVC_CHECK(k->ndim == 4, "%s: cache->k must be %s, got %s", fn,
              hnd ? "(max_pages, H, page_size, Dh) (HND)" : "(max_pages, page_size, H, Dh) (NHD)",
              kvc__shape_str(k, b1, sizeof b1));
    KVC_TRY(check_pair(fn, "cache->k", k, "cache->v", v));
    KVC_CHECK(append_key->ndim == 3, "%s: append_key must be (nnz, H, Dh), got %s", fn,
              kvc__shape_str(append_key, b1, sizeof b1));
    KVC_TRY(check_pair(fn, "append_key", append_key, "append_value", append_value));

    const int64_t max_pages = k->shape[0], P = k->shape[hnd ? 2 : 1], H = k->shape[hnd ? 1 : 2],
                  Dh = k->shape[3];
    KVC_CHECK(P >= 1 && H >= 1 && Dh >= 1, "%s: cache shape %s has page_size %lld, H %lld, "
              "Dh %lld; each must be >= 1", fn, kvc__shape_str(k, b1, sizeof b1), (long long)P,
              (long long)H, (long long)Dh);
    KVC_CHECK(append_key->shape[1] == H && append_key->shape[2] == Dh,
              "%s: append_key %s must be (nnz, H=%lld, Dh=%lld) to match cache %s", fn,
              kvc__shape_str(append_key, b1, sizeof b1), (long long)H, (long long)Dh,
              kvc__shape_str(k, b2, sizeof b2));

    append_call c = {0};
    pmx_op op = {0};
    KVC_TRY(check_dtypes(fn, "append_key", append_key->dtype, k->dtype, 1, &op.bits));
    KVC_CHECK(k->dtype != KVC_I4 || Dh % 2 == 0, "%s: an int4 cache needs an even Dh, got %lld",
              fn, (long long)Dh);
    op.group = 1;
    if (op.bits) {
        const int32_t g = cache->quant_group;
        KVC_CHECK(g >= 1 && Dh % g == 0, "%s: cache->quant_group %d must divide Dh %lld", fn,
                  (int)g, (long long)Dh);
        KVC_CHECK(op.bits != 4 || g % 2 == 0, "%s: cache->quant_group must be even for int4, got "
                  "%d", fn, (int)g);
        KVC_TRY(check_scale(fn, "cache->k_scale", &cache->k_scale, k, Dh / g));
        KVC_TRY(check_scale(fn, "cache->v_scale", &cache->v_scale, v, Dh / g));
        op.group = g;
    }
    op.k = kvc__kernels();
    op.H = H;
    op.Dh = Dh;
    op.repeat = 1;
    op.t1 = append_key->dtype;
    op.t2 = k->dtype;

    c.nnz = append_key->shape[0];
    c.page_size = P;
    c.bi = batch_indices;
    c.pos = positions;
    c.indices = kv_indices;
    c.indptr = kv_indptr;
    KVC_TRY(check_rows(fn, &c, kv_last_page_len, max_pages));

    /* A call whose inputs and quantized rows exceed the last-level cache
     * (a long prefill) writes with non-temporal stores: the rows could not
     * stay cached anyway, and skipping the read-for-ownership of each
     * written line saves a fifth of the memory traffic (int8, f16 input). */
    if (op.bits) {
        const double moved = 2.0 * (double)c.nnz * (double)(H * Dh) *
                             ((double)kvc__bytes(op.t1, 1) + op.bits / 8.0);
        op.stream = moved > (double)kvc__llc_bytes();
    }
    const int tok = hnd ? 2 : 1, head = hnd ? 1 : 2;
    for (int kv = 0; kv < 2; kv++) {
        const kvc_tensor *t = kv ? v : k, *s = kv ? &cache->v_scale : &cache->k_scale;
        paged_half *h = &c.half[kv];
        h->op = op;
        h->in = kv ? append_value : append_key;
        h->slot0.ptr = t->data;
        h->slot0.dtype = t->dtype;
        h->slot0.tok_stride = t->stride[tok];
        h->slot0.head_stride = t->stride[head];
        h->page_stride = t->stride[0];
        if (op.bits) {
            h->slot0.sptr = s->data;
            h->slot0.sdtype = s->dtype;
            h->slot0.stok_stride = s->stride[tok];
            h->slot0.shead_stride = s->stride[head];
            h->spage_stride = s->stride[0];
        }
    }
    c.shared_op = 1;
    pmx_rows slot0[2] = {c.half[0].slot0, c.half[1].slot0};
    c.halves = kvc__pmx_head_major(&op, slot0) ? 2 : 1;
    return run_append(fn, &c, names, pool);
}

/* One MLA half: input (nnz, D) into cache (max_pages, page_size, D). */
static kvc_status mla_half(const char *fn, const char *in_name, const kvc_tensor *in,
                           const char *cache_name, const kvc_tensor *cache, paged_half *h) {
    char b1[96], b2[96];
    KVC_TRY(kvc__check_tensor(in, in_name, 1));
    KVC_TRY(kvc__check_tensor(cache, cache_name, 1));
    KVC_TRY(kvc__check_writable(cache, cache_name));
    KVC_CHECK(cache->ndim == 3 && cache->shape[1] >= 1 && cache->shape[2] >= 1,
              "%s: %s must be (max_pages, page_size >= 1, D >= 1), got %s", fn, cache_name,
              kvc__shape_str(cache, b1, sizeof b1));
    KVC_CHECK(in->ndim == 2 && in->shape[1] == cache->shape[2],
              "%s: %s must be (nnz, D=%lld) to match %s %s, got %s", fn, in_name,
              (long long)cache->shape[2], cache_name, kvc__shape_str(cache, b2, sizeof b2),
              kvc__shape_str(in, b1, sizeof b1));
    int bits;
    KVC_TRY(check_dtypes(fn, in_name, in->dtype, cache->dtype, 0, &bits));
    h->op.k = kvc__kernels();
    h->op.H = 1;
    h->op.Dh = cache->shape[2];
    h->op.repeat = 1;
    h->op.group = 1;
    h->op.t1 = in->dtype;
    h->op.t2 = cache->dtype;
    h->in = in;
    h->slot0.ptr = cache->data;
    h->slot0.dtype = cache->dtype;
    h->slot0.tok_stride = cache->stride[1];
    h->page_stride = cache->stride[0];
    return KVC_OK;
}

kvc_status kvc_append_paged_mla_kv_cache(
    const kvc_tensor *append_ckv, const kvc_tensor *append_kpe, const kvc_tensor *batch_indices,
    const kvc_tensor *positions, kvc_tensor *ckv_cache, kvc_tensor *kpe_cache,
    const kvc_tensor *kv_indices, const kvc_tensor *kv_indptr,
    const kvc_tensor *kv_last_page_len, kvc_threadpool *pool) {
    static const char fn[] = "kvc_append_paged_mla_kv_cache";
    static const char *const names[2] = {"append_ckv", "append_kpe"};
    char b1[96], b2[96];
    append_call c = {0};
    KVC_TRY(mla_half(fn, "append_ckv", append_ckv, "ckv_cache", ckv_cache, &c.half[0]));
    KVC_TRY(mla_half(fn, "append_kpe", append_kpe, "kpe_cache", kpe_cache, &c.half[1]));
    KVC_CHECK(ckv_cache->shape[0] == kpe_cache->shape[0] &&
                  ckv_cache->shape[1] == kpe_cache->shape[1],
              "%s: ckv_cache %s and kpe_cache %s must have the same max_pages and page_size", fn,
              kvc__shape_str(ckv_cache, b1, sizeof b1), kvc__shape_str(kpe_cache, b2, sizeof b2));
    KVC_CHECK(append_ckv->shape[0] == append_kpe->shape[0],
              "%s: append_ckv has %lld rows but append_kpe %lld", fn,
              (long long)append_ckv->shape[0], (long long)append_kpe->shape[0]);
    c.nnz = append_ckv->shape[0];
    c.page_size = ckv_cache->shape[1];
    c.bi = batch_indices;
    c.pos = positions;
    c.indices = kv_indices;
    c.indptr = kv_indptr;
    KVC_TRY(check_rows(fn, &c, kv_last_page_len, ckv_cache->shape[0]));
    c.shared_op = 0;
    c.halves = 1;
    return run_append(fn, &c, names, pool);
}
