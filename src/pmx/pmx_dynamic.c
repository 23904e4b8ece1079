/*
 * opmx.dynamic_batching::KeyValueCache, SEMANTICS section 3.
 *
 *   layout 0: cache (MaxT, L, 2, H, Dh)   1: (L, MaxT, 2, H, Dh)
 *          2: (L, 2, MaxT, H, Dh)         3: (L, 2, H, MaxT, Dh)
 *
 * Sequences are packed: batch b owns input rows [seqstarts[b], seqstarts[b+1])
 * and output rows [kvstarts[b], kvstarts[b+1]). Position t of b lives at slot
 * cachestarts[b] + t (mode 0) or cachestarts[b, t / P] + t % P (mode 1, P =
 * page_size). Work is split over packed rows in 64-row chunks (K and V of a
 * chunk in one task); a chunk is
 * cut further at batch and page boundaries, where slots stop being
 * consecutive.
 */
#include <stdlib.h>

#include "pmx_common.h"

typedef struct dyn_call {
    pmx_op op;
    const kvc_tensor *in[2];
    kvc_tensor *out[2];
    const kvc_tensor *cachestarts;
    const int64_t *seqstarts, *kvstarts, *start_pos; /* contiguous copies' views, (B+1)/(B) */
    int64_t B, mode, page_size, maxT;
    pmx_rows half[2]; /* slot 0 of K and V in layer layer_idx */
    int64_t n_rows_in, n_rows_out;
    int halves; /* 1: K and V in one task; 2: separate tasks (head-major) */
} dyn_call;

static int64_t i64_1d(const kvc_tensor *t, int64_t i) {
    return ((const int64_t *)t->data)[i * t->stride[0]];
}

static int64_t page_entry(const dyn_call *c, int64_t b, int64_t p) {
    const kvc_tensor *t = c->cachestarts;
    return ((const int64_t *)t->data)[b * t->stride[0] + p * t->stride[1]];
}

/* Slot of position t of batch b, and how many following positions are in
 * consecutive slots (capped by limit). */
static int64_t slot_of(const dyn_call *c, int64_t b, int64_t t, int64_t limit, int64_t *run) {
    if (c->mode == 0) {
        *run = limit;
        return i64_1d(c->cachestarts, b) + t;
    }
    int64_t in_page = t % c->page_size, left = c->page_size - in_page;
    *run = left < limit ? left : limit;
    return page_entry(c, b, t / c->page_size) + in_page;
}

/* Batch owning packed row r: the last b with starts[b] <= r < starts[b+1]. */
static int64_t batch_of(const int64_t *starts, int64_t B, int64_t r) {
    int64_t lo = 0, hi = B; /* invariant: starts[lo] <= r < starts[hi] */
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if (starts[mid] <= r) lo = mid;
        else hi = mid;
    }
    return lo;
}

/* Rows of a packed (rows, heads, Dh) input or output tensor from row `row`. */
static pmx_rows packed_rows(const kvc_tensor *t, int64_t row) {
    return pmx_tensor_rows(t, row * t->stride[0], 0, 1);
}

/* Moves packed rows [r0, r1) of K and V (only half `only` if >= 0);
 * store != 0: inputs -> cache. */
static void move_rows(const dyn_call *c, int64_t r0, int64_t r1, int store, int only) {
    const int64_t *starts = store ? c->seqstarts : c->kvstarts;
    int64_t b = batch_of(starts, c->B, r0);
    for (int64_t r = r0; r < r1;) {
        while (starts[b + 1] <= r) b++; /* skip finished (and empty) batches */
        int64_t end = starts[b + 1] < r1 ? starts[b + 1] : r1;
        /* Stored rows start at start_pos; read rows at position 0. */
        int64_t pos = r - starts[b] + (store ? c->start_pos[b] : 0), run;
        int64_t slot = slot_of(c, b, pos, end - r, &run);
        /* cachestarts is read here, not copied: a cache or output laid over it
         * (core.h: undefined) may have changed it, so a run whose slots left
         * the validated [0, MaxT) is skipped, never moved out of bounds */
        if (slot < 0 || slot > c->maxT - run) {
            r += run;
            continue;
        }
        pmx_rows cache[2], rows[2] = {{0}, {0}};
        for (int kv = 0; kv < 2; kv++) {
            cache[kv] = pmx_rows_offset(&c->half[kv], slot, 0);
            const kvc_tensor *t = store ? c->in[kv] : c->out[kv];
            if (t && (only < 0 || kv == only)) rows[kv] = packed_rows(t, r);
        }
        if (store) kvc__pmx_store(&c->op, rows, cache, run);
        else kvc__pmx_load(&c->op, cache, rows, run);
        r += run;
    }
}

/* A task moves one 64-row chunk of packed rows, K and V together, or in
 * head-major caches one half (all K chunks first, then all V chunks). */
static void run_task(const dyn_call *c, int64_t task, int64_t n_rows, int store) {
    int64_t n_chunks = (n_rows + KVC_PMX_CHUNK - 1) / KVC_PMX_CHUNK;
    int only = c->halves == 2 ? (int)(task / n_chunks) : -1;
    int64_t r0 = (task % n_chunks) * KVC_PMX_CHUNK, r1 = r0 + KVC_PMX_CHUNK;
    move_rows(c, r0, r1 < n_rows ? r1 : n_rows, store, only);
}

static void store_task(void *ctx, int64_t task) {
    const dyn_call *c = ctx;
    run_task(c, task, c->n_rows_in, 1);
}

static void load_task(void *ctx, int64_t task) {
    const dyn_call *c = ctx;
    run_task(c, task, c->n_rows_out, 0);
}

/* Which cache dimension holds tokens, heads, layers and K|V, per layout. */
static const int tok_dim[4] = {0, 1, 2, 3}, head_dim[4] = {3, 3, 3, 2};
static const int layer_dim[4] = {1, 0, 0, 0}, kv_dim[4] = {2, 2, 1, 1};

/* Slot-0 rows of one half for the layout. */
static pmx_rows half_rows(int layout, int layer, int kv, const kvc_tensor *t, const kvc_tensor *s) {
    pmx_rows r = {0};
    r.ptr = kvc__at(t, layer * t->stride[layer_dim[layout]] + kv * t->stride[kv_dim[layout]]);
    r.dtype = t->dtype;
    r.tok_stride = t->stride[tok_dim[layout]];
    r.head_stride = t->stride[head_dim[layout]];
    if (s) {
        r.sptr = kvc__at(s, layer * s->stride[layer_dim[layout]] + kv * s->stride[kv_dim[layout]]);
        r.sdtype = s->dtype;
        r.stok_stride = s->stride[tok_dim[layout]];
        r.shead_stride = s->stride[head_dim[layout]];
    }
    return r;
}

/* Checks a (n,) int64 index tensor. */
static kvc_status check_index(const char *fn, const char *name, const kvc_tensor *t, int64_t n) {
    char b1[96];
    KVC_TRY(kvc__check_tensor(t, name, 0));
    KVC_CHECK(t->dtype == KVC_I64, "%s: %s must be int64, got %s", fn, name,
              kvc_dtype_name(t->dtype));
    KVC_CHECK(t->ndim == 1 && t->shape[0] == n, "%s: %s must have shape (%lld,), got %s", fn,
              name, (long long)n, kvc__shape_str(t, b1, sizeof b1));
    return KVC_OK;
}

/* Validates starts (B+1): starts[0] == 0, non-decreasing. */
static kvc_status check_starts(const char *fn, const char *name, const kvc_tensor *t, int64_t B) {
    KVC_TRY(check_index(fn, name, t, B + 1));
    KVC_CHECK(i64_1d(t, 0) == 0, "%s: %s[0] must be 0, got %lld", fn, name,
              (long long)i64_1d(t, 0));
    for (int64_t b = 0; b < B; b++)
        KVC_CHECK(i64_1d(t, b + 1) >= i64_1d(t, b), "%s: %s must be non-decreasing (%s[%lld] = "
                  "%lld > %s[%lld] = %lld)", fn, name, name, (long long)b,
                  (long long)i64_1d(t, b), name, (long long)(b + 1), (long long)i64_1d(t, b + 1));
    return KVC_OK;
}

/* Checks every slot batch b will touch, positions [0, kvlen), lies in [0, MaxT). */
static kvc_status check_slots(const char *fn, const dyn_call *c, int64_t b, int64_t kvlen,
                              int64_t maxT) {
    if (kvlen == 0) return KVC_OK;
    if (c->mode == 0) {
        int64_t s0 = i64_1d(c->cachestarts, b);
        KVC_CHECK(s0 >= 0 && s0 <= maxT - kvlen, "%s: batch %lld uses %lld slots from %lld, "
                  "outside the cache's [0, MaxT=%lld)", fn, (long long)b, (long long)kvlen,
                  (long long)s0, (long long)maxT);
        return KVC_OK;
    }
    int64_t pages = (kvlen + c->page_size - 1) / c->page_size;
    int64_t maxP = c->cachestarts->shape[1];
    KVC_CHECK(pages <= maxP, "%s: batch %lld needs %lld pages for %lld tokens, cachestarts has "
              "%lld", fn, (long long)b, (long long)pages, (long long)kvlen, (long long)maxP);
    for (int64_t p = 0; p < pages; p++) {
        int64_t s0 = page_entry(c, b, p);
        int64_t used = p < pages - 1 ? c->page_size : kvlen - p * c->page_size;
        KVC_CHECK(s0 >= 0, "%s: cachestarts[%lld, %lld] = %lld is needed (position %lld) but "
                  "negative", fn, (long long)b, (long long)p, (long long)s0,
                  (long long)(p * c->page_size));
        KVC_CHECK(s0 <= maxT - used, "%s: page cachestarts[%lld, %lld] = %lld spans %lld slots, "
                  "outside the cache's [0, MaxT=%lld)", fn, (long long)b, (long long)p,
                  (long long)s0, (long long)used, (long long)maxT);
    }
    return KVC_OK;
}

kvc_status kvc_pmx_dynamic_key_value_cache(
    const kvc_tensor *current_key, const kvc_tensor *current_value, const kvc_tensor *seqstarts,
    const kvc_tensor *kvstarts, const kvc_tensor *cachestarts, const kvc_tensor *start_pos,
    const kvc_tensor *max_seqlen, const kvc_tensor *max_kvlen, kvc_tensor *cache,
    kvc_tensor *scale, const kvc_pmx_kv_params *params, kvc_tensor *key, kvc_tensor *value,
    kvc_threadpool *pool) {
    static const char fn[] = "kvc_pmx_dynamic_key_value_cache";
    char b1[96];
    KVC_TRY(kvc__check_tensor(current_key, "current_key", 1));
    KVC_TRY(kvc__check_tensor(current_value, "current_value", 1));
    KVC_TRY(kvc__check_tensor(cache, "cache", 1));
    KVC_TRY(kvc__check_writable(cache, "cache"));
    KVC_CHECK(current_key->ndim == 3, "%s: current_key must be (seqstarts[B], H, Dh), got %s", fn,
              kvc__shape_str(current_key, b1, sizeof b1));
    KVC_CHECK(cache->ndim == 5, "%s: cache must have 5 dims, got %s", fn,
              kvc__shape_str(cache, b1, sizeof b1));
    dyn_call c = {0};
    const int64_t H = current_key->shape[1], Dh = current_key->shape[2];
    KVC_TRY(kvc__pmx_check_common(fn, params, 3, current_key, current_value, cache, scale, Dh,
                                  &c.op));
    c.op.H = H;
    const int layout = params->cache_layout;
    KVC_CHECK(params->cache_mode == 0 || params->cache_mode == 1,
              "%s: cache_mode must be 0 (offset) or 1 (paged), got %d", fn,
              (int)params->cache_mode);
    c.mode = params->cache_mode;
    c.page_size = params->page_size;
    /* checked in mode 0 too, which does not use it: a bad attribute is an error */
    KVC_CHECK(c.page_size >= 1, "%s: page_size must be >= 1, got %d", fn,
              (int)params->page_size);

    /* Cache shape for the layout. */
    static const char *const names[4] = {"(MaxT, L, 2, H, Dh)", "(L, MaxT, 2, H, Dh)",
                                         "(L, 2, MaxT, H, Dh)", "(L, 2, H, MaxT, Dh)"};
    const int64_t *cs = cache->shape;
    const int64_t maxT = cs[tok_dim[layout]];
    c.maxT = maxT;
    KVC_CHECK(cs[layer_dim[layout]] == params->num_layer && cs[kv_dim[layout]] == 2 &&
                  cs[head_dim[layout]] == H && cs[4] == Dh,
              "%s: cache %s does not match layout %d %s with L=%d, H=%lld, Dh=%lld", fn,
              kvc__shape_str(cache, b1, sizeof b1), layout, names[layout],
              (int)params->num_layer, (long long)H, (long long)Dh);
    KVC_CHECK(c.op.t2 != KVC_I4 || Dh % 2 == 0, "%s: int4 cache needs an even head_dim", fn);

    /* Index tensors. */
    KVC_TRY(kvc__check_tensor(seqstarts, "seqstarts", 0));
    KVC_CHECK(seqstarts->ndim == 1 && seqstarts->shape[0] >= 1,
              "%s: seqstarts must have shape (B+1,), got %s", fn,
              kvc__shape_str(seqstarts, b1, sizeof b1));
    const int64_t B = seqstarts->shape[0] - 1;
    c.B = B;
    KVC_TRY(check_starts(fn, "seqstarts", seqstarts, B));
    KVC_TRY(check_starts(fn, "kvstarts", kvstarts, B));
    KVC_TRY(check_index(fn, "start_pos", start_pos, B));
    KVC_TRY(kvc__check_tensor(cachestarts, "cachestarts", 0));
    KVC_CHECK(cachestarts->dtype == KVC_I64, "%s: cachestarts must be int64, got %s", fn,
              kvc_dtype_name(cachestarts->dtype));
    if (c.mode == 0)
        KVC_CHECK(cachestarts->ndim == 1 && cachestarts->shape[0] == B,
                  "%s: cachestarts must be (B,) = (%lld,) in cache_mode 0, got %s", fn,
                  (long long)B, kvc__shape_str(cachestarts, b1, sizeof b1));
    else
        KVC_CHECK(cachestarts->ndim == 2 && cachestarts->shape[0] == B,
                  "%s: cachestarts must be (B, MaxP) with B = %lld in cache_mode 1, got %s", fn,
                  (long long)B, kvc__shape_str(cachestarts, b1, sizeof b1));
    c.cachestarts = cachestarts;
    int64_t max_seqlen_v, max_kvlen_v;
    KVC_TRY(kvc__pmx_scalar_i64(fn, "max_seqlen", max_seqlen, &max_seqlen_v));
    KVC_TRY(kvc__pmx_scalar_i64(fn, "max_kvlen", max_kvlen, &max_kvlen_v));

    const int64_t n_in = i64_1d(seqstarts, B), n_out = i64_1d(kvstarts, B);
    KVC_CHECK(current_key->shape[0] == n_in, "%s: current_key has %lld rows, seqstarts[B] = %lld",
              fn, (long long)current_key->shape[0], (long long)n_in);

    /* The hot loops index contiguous int64 arrays; copy the strided ones. */
    int64_t *buf = malloc((size_t)(3 * B + 2) * sizeof *buf);
    if (!buf) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    int64_t *ss = buf, *ks = buf + B + 1, *sp = buf + 2 * B + 2;
    for (int64_t b = 0; b <= B; b++) {
        ss[b] = i64_1d(seqstarts, b);
        ks[b] = i64_1d(kvstarts, b);
        if (b < B) sp[b] = i64_1d(start_pos, b);
    }
    c.seqstarts = ss;
    c.kvstarts = ks;
    c.start_pos = sp;
    kvc_status st = KVC_OK;
    for (int64_t b = 0; b < B && st == KVC_OK; b++) {
        int64_t S = ss[b + 1] - ss[b], kvlen = ks[b + 1] - ks[b];
        if (sp[b] < 0)
            st = kvc__error(KVC_ERR_INVALID_ARG, "%s: start_pos[%lld] = %lld < 0", fn,
                            (long long)b, (long long)sp[b]);
        else if (sp[b] > kvlen || kvlen - sp[b] != S) /* kvlen, S >= 0: no overflow */
            st = kvc__error(KVC_ERR_INVALID_ARG, "%s: batch %lld has kv length %lld but "
                            "start_pos + seqlen = %lld + %lld", fn, (long long)b,
                            (long long)kvlen, (long long)sp[b], (long long)S);
        else if (S > max_seqlen_v)
            st = kvc__error(KVC_ERR_INVALID_ARG, "%s: max_seqlen %lld < seqlen %lld of batch %lld",
                            fn, (long long)max_seqlen_v, (long long)S, (long long)b);
        else if (kvlen > max_kvlen_v)
            st = kvc__error(KVC_ERR_INVALID_ARG, "%s: max_kvlen %lld < kv length %lld of batch "
                            "%lld", fn, (long long)max_kvlen_v, (long long)kvlen, (long long)b);
        else
            st = check_slots(fn, &c, b, kvlen, maxT);
    }
    int64_t hr_dh; /* the output's heads H * num_repeat: must not wrap */
    if (st == KVC_OK && !kvc__mul3_le(H, c.op.repeat, Dh, INT64_MAX, &hr_dh))
        st = kvc__error(KVC_ERR_INVALID_ARG, "%s: %lld heads x num_repeat %lld x head_dim %lld "
                        "overflow", fn, (long long)H, (long long)c.op.repeat, (long long)Dh);
    const int64_t oshape[3] = {n_out, H * c.op.repeat, Dh};
    if (st == KVC_OK && key) st = kvc__pmx_check_output(fn, "key", key, c.op.t1, 3, oshape);
    if (st == KVC_OK && value) st = kvc__pmx_check_output(fn, "value", value, c.op.t1, 3, oshape);
    c.in[0] = current_key;
    c.in[1] = current_value;
    c.out[0] = key;
    c.out[1] = value;
    if (st == KVC_OK && c.op.bits) {
        for (int kv = 0; kv < 2 && st == KVC_OK; kv++) {
            pmx_rows in = packed_rows(c.in[kv], 0);
            st = kvc__pmx_check_finite(fn, &c.op, &in, n_in, kv ? "current_value" : "current_key");
        }
    }
    if (st == KVC_OK) {
        /* Everything is valid: from here on nothing can fail. */
        const kvc_tensor *sc = c.op.bits ? scale : NULL;
        c.half[0] = half_rows(layout, params->layer_idx, 0, cache, sc);
        c.half[1] = half_rows(layout, params->layer_idx, 1, cache, sc);
        c.n_rows_in = n_in;
        c.n_rows_out = n_out;
        c.halves = kvc__pmx_head_major(&c.op, c.half) ? 2 : 1;
        kvc__parallel_for(pool, c.halves * ((n_in + KVC_PMX_CHUNK - 1) / KVC_PMX_CHUNK),
                          store_task, &c);
        c.op.stream = kvc__pmx_stream_loads(&c.op, n_out, (key != NULL) + (value != NULL));
        if (key || value)
            kvc__parallel_for(pool, c.halves * ((n_out + KVC_PMX_CHUNK - 1) / KVC_PMX_CHUNK),
                              load_task, &c);
    }
    free(buf);
    return st;
}
