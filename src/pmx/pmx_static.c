/*
 * opmx::KeyValueCache (static batching), SEMANTICS section 2.
 *
 *   layout 0: cache (MaxB, L, 2, MaxS, H, Dh)    layout 1: (L, MaxB, 2, H, MaxS, Dh)
 *
 * Phase 1 stores current_key/value (B, S, H, Dh) at positions
 * [start_pos, start_pos + S) of batches [0, B); phase 2 reads positions
 * [0, start_pos + S) into key/value (B, start_pos + S, H * num_repeat, Dh).
 * Both phases are split into (batch, 64-token chunk) tasks, per K/V half in
 * head-major caches.
 */
#include "pmx_common.h"

typedef struct static_call {
    pmx_op op;
    const kvc_tensor *in[2]; /* current_key, current_value */
    kvc_tensor *out[2];      /* key, value (entries may be NULL) */
    const kvc_tensor *cache, *scale;
    int layout, layer;
    int64_t B, S, T, start_pos;
    int64_t n_chunks_store, n_chunks_load; /* per batch */
    int halves;                             /* 1: K and V in one task; 2: separate */
} static_call;

/* Rows of batch b, half kv (0 K, 1 V) of the cache, starting at position 0. */
static pmx_rows cache_rows(const static_call *c, int64_t b, int kv) {
    const kvc_tensor *t = c->cache, *s = c->scale;
    const int64_t *st = t->stride;
    pmx_rows r = {0};
    int64_t off, tok, head;
    if (c->layout == 0) { /* (MaxB, L, 2, MaxS, H, Dh) */
        off = b * st[0] + c->layer * st[1] + kv * st[2];
        tok = 3, head = 4;
    } else { /* (L, MaxB, 2, H, MaxS, Dh) */
        off = c->layer * st[0] + b * st[1] + kv * st[2];
        tok = 4, head = 3;
    }
    r.ptr = kvc__at(t, off);
    r.dtype = t->dtype;
    r.tok_stride = st[tok];
    r.head_stride = st[head];
    if (c->op.bits) {
        const int64_t *ss = s->stride;
        int64_t soff = c->layout == 0 ? b * ss[0] + c->layer * ss[1] + kv * ss[2]
                                      : c->layer * ss[0] + b * ss[1] + kv * ss[2];
        r.sptr = kvc__at(s, soff);
        r.sdtype = s->dtype;
        r.stok_stride = ss[tok];
        r.shead_stride = ss[head];
    }
    return r;
}

/* Rows of a (B, S, H, Dh) input or (B, T, H*R, Dh) output tensor, batch b. */
static pmx_rows tensor_rows(const kvc_tensor *t, int64_t b) {
    return pmx_tensor_rows(t, b * t->stride[0], 1, 2);
}

/* Task -> (batch, half, first token). With K and V together (halves == 1)
 * a task covers both; otherwise K tasks of a batch precede its V tasks. */
static int64_t task_unit(const static_call *c, int64_t task, int64_t n_chunks, int *kv,
                         int64_t *t0) {
    int64_t chunk = task % n_chunks, rest = task / n_chunks;
    *kv = c->halves == 2 ? (int)(rest % 2) : -1;
    *t0 = chunk * KVC_PMX_CHUNK;
    return rest / c->halves;
}

static void store_task(void *ctx, int64_t task) {
    const static_call *c = ctx;
    int only;
    int64_t t0, b = task_unit(c, task, c->n_chunks_store, &only, &t0);
    int64_t n = c->S - t0 < KVC_PMX_CHUNK ? c->S - t0 : KVC_PMX_CHUNK;
    pmx_rows in[2] = {{0}, {0}}, dst[2];
    for (int kv = 0; kv < 2; kv++) {
        dst[kv] = cache_rows(c, b, kv);
        dst[kv] = pmx_rows_offset(&dst[kv], c->start_pos + t0, 0);
        if (only >= 0 && kv != only) continue;
        in[kv] = tensor_rows(c->in[kv], b);
        in[kv] = pmx_rows_offset(&in[kv], t0, 0);
    }
    kvc__pmx_store(&c->op, in, dst, n);
}

static void load_task(void *ctx, int64_t task) {
    const static_call *c = ctx;
    int only;
    int64_t t0, b = task_unit(c, task, c->n_chunks_load, &only, &t0);
    int64_t n = c->T - t0 < KVC_PMX_CHUNK ? c->T - t0 : KVC_PMX_CHUNK;
    pmx_rows src[2], out[2] = {{0}, {0}};
    for (int kv = 0; kv < 2; kv++) {
        src[kv] = cache_rows(c, b, kv);
        src[kv] = pmx_rows_offset(&src[kv], t0, 0);
        if (!c->out[kv] || (only >= 0 && kv != only)) continue;
        out[kv] = tensor_rows(c->out[kv], b);
        out[kv] = pmx_rows_offset(&out[kv], t0, 0);
    }
    kvc__pmx_load(&c->op, src, out, n);
}

kvc_status kvc_pmx_key_value_cache(const kvc_tensor *current_key, const kvc_tensor *current_value,
                                   const kvc_tensor *start_pos, kvc_tensor *cache,
                                   kvc_tensor *scale, const kvc_pmx_kv_params *params,
                                   kvc_tensor *key, kvc_tensor *value, kvc_threadpool *pool) {
    static const char fn[] = "kvc_pmx_key_value_cache";
    char b1[96];
    KVC_TRY(kvc__check_tensor(current_key, "current_key", 1));
    KVC_TRY(kvc__check_tensor(current_value, "current_value", 1));
    KVC_TRY(kvc__check_tensor(cache, "cache", 1));
    KVC_TRY(kvc__check_writable(cache, "cache"));
    KVC_CHECK(current_key->ndim == 4, "%s: current_key must be (B, S, H, Dh), got %s", fn,
              kvc__shape_str(current_key, b1, sizeof b1));
    KVC_CHECK(cache->ndim == 6, "%s: cache must have 6 dims, got %s", fn,
              kvc__shape_str(cache, b1, sizeof b1));
    static_call c = {0};
    c.B = current_key->shape[0];
    c.S = current_key->shape[1];
    const int64_t H = current_key->shape[2], Dh = current_key->shape[3];
    KVC_TRY(kvc__pmx_check_common(fn, params, 1, current_key, current_value, cache, scale, Dh,
                                  &c.op));
    c.op.H = H;
    c.layout = params->cache_layout;
    c.layer = params->layer_idx;
    c.cache = cache;
    c.scale = c.op.bits ? scale : NULL;

    /* Cache shape for the layout. */
    const int64_t *cs = cache->shape;
    int64_t maxB = c.layout == 0 ? cs[0] : cs[1], L = c.layout == 0 ? cs[1] : cs[0];
    int64_t maxS = c.layout == 0 ? cs[3] : cs[4], cH = c.layout == 0 ? cs[4] : cs[3];
    KVC_CHECK(L == params->num_layer && cs[2] == 2 && cH == H && cs[5] == Dh,
              "%s: cache %s does not match layout %d %s with L=%d, H=%lld, Dh=%lld", fn,
              kvc__shape_str(cache, b1, sizeof b1), c.layout,
              c.layout == 0 ? "(MaxB, L, 2, MaxS, H, Dh)" : "(L, MaxB, 2, H, MaxS, Dh)",
              (int)params->num_layer, (long long)H, (long long)Dh);
    KVC_CHECK(c.op.t2 != KVC_I4 || Dh % 2 == 0, "%s: int4 cache needs an even head_dim", fn);
    KVC_TRY(kvc__pmx_scalar_i64(fn, "start_pos", start_pos, &c.start_pos));
    KVC_CHECK(c.B <= maxB, "%s: batch %lld > cache MaxB %lld", fn, (long long)c.B,
              (long long)maxB);
    KVC_CHECK(c.start_pos >= 0, "%s: start_pos %lld < 0", fn, (long long)c.start_pos);
    KVC_CHECK(c.start_pos <= maxS - c.S, "%s: start_pos %lld + S %lld > cache MaxS %lld", fn,
              (long long)c.start_pos, (long long)c.S, (long long)maxS);
    c.T = c.start_pos + c.S;

    int64_t hr_dh; /* the output's heads H * num_repeat: must not wrap */
    KVC_CHECK(kvc__mul3_le(H, c.op.repeat, Dh, INT64_MAX, &hr_dh),
              "%s: %lld heads x num_repeat %lld x head_dim %lld overflow", fn, (long long)H,
              (long long)c.op.repeat, (long long)Dh);
    const int64_t oshape[4] = {c.B, c.T, H * c.op.repeat, Dh};
    if (key) KVC_TRY(kvc__pmx_check_output(fn, "key", key, c.op.t1, 4, oshape));
    if (value) KVC_TRY(kvc__pmx_check_output(fn, "value", value, c.op.t1, 4, oshape));
    c.in[0] = current_key;
    c.in[1] = current_value;
    c.out[0] = key;
    c.out[1] = value;

    if (c.op.bits) {
        for (int kv = 0; kv < 2; kv++)
            for (int64_t b = 0; b < c.B; b++) {
                pmx_rows in = tensor_rows(c.in[kv], b);
                KVC_TRY(kvc__pmx_check_finite(fn, &c.op, &in, c.S,
                                              kv ? "current_value" : "current_key"));
            }
    }

    /* Everything is valid: from here on nothing can fail. */
    c.n_chunks_store = (c.S + KVC_PMX_CHUNK - 1) / KVC_PMX_CHUNK;
    c.n_chunks_load = (c.T + KVC_PMX_CHUNK - 1) / KVC_PMX_CHUNK;
    pmx_rows halves[2] = {cache_rows(&c, 0, 0), cache_rows(&c, 0, 1)};
    c.halves = kvc__pmx_head_major(&c.op, halves) ? 2 : 1;
    kvc__parallel_for(pool, c.B * c.halves * c.n_chunks_store, store_task, &c);
    c.op.stream = kvc__pmx_stream_loads(&c.op, c.B * c.T, (key != NULL) + (value != NULL));
    if (key || value) kvc__parallel_for(pool, c.B * c.halves * c.n_chunks_load, load_task, &c);
    return KVC_OK;
}
