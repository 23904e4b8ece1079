/* Validation and row movement shared by the static and dynamic operators. */
#include <stdio.h>
#include <string.h>

#include "pmx_common.h"

kvc_pmx_kv_params kvc_pmx_kv_default_params(void) {
    kvc_pmx_kv_params p;
    p.num_layer = 1;
    p.layer_idx = 0;
    p.quant_bit = 0;
    p.quant_group = 8;
    p.num_repeat = 1;
    p.cache_layout = 0;
    p.cache_mode = 0;
    p.page_size = 128;
    return p;
}

/* ---- row movement --------------------------------------------------------- */

/* One contiguous run of n elements from input to cache. */
static void store_run(const pmx_op *op, const pmx_rows *in, const pmx_rows *c, int64_t n) {
    if (op->bits && in->qsptr)
        op->k->quant_values(in->ptr, op->t1, n, op->bits, op->group, in->qsptr, c->ptr, c->sptr,
                            c->sdtype, op->stream);
    else if (op->bits)
        (op->stream ? op->k->quantize_stream : op->k->quantize)(in->ptr, op->t1, n, op->bits,
                                                                 op->group, c->ptr, c->sptr,
                                                                 c->sdtype);
    else if (op->t1 == op->t2)
        op->k->copy(c->ptr, in->ptr, (size_t)kvc__bytes(op->t1, n));
    else
        op->k->convert(in->ptr, op->t1, c->ptr, op->t2, n);
}

/* One contiguous run of n elements from cache to output. */
static void load_run_cached(const pmx_op *op, const pmx_rows *c, const pmx_rows *out, int64_t n) {
    if (op->bits)
        op->k->dequantize(c->ptr, op->bits, c->sptr, c->sdtype, n, op->group, out->ptr, op->t1);
    else if (op->t1 == op->t2)
        op->k->copy(out->ptr, c->ptr, (size_t)kvc__bytes(op->t1, n));
    else
        op->k->convert(c->ptr, op->t2, out->ptr, op->t1, n);
}

/* Bytes of the L1-resident buffer a streaming load converts into before
 * its non-temporal copy to the output. */
#define PMX_STAGE 16384

/* load_run_cached, with op->stream through the stage (a float copy goes
 * straight), so the output's lines are written without being read. */
static void load_run(const pmx_op *op, const pmx_rows *c, const pmx_rows *out, int64_t n) {
    if (!op->stream) {
        load_run_cached(op, c, out, n);
        return;
    }
    if (!op->bits && op->t1 == op->t2) {
        op->k->copy_stream(out->ptr, c->ptr, (size_t)kvc__bytes(op->t1, n));
        return;
    }
    _Alignas(64) char stage[PMX_STAGE];
    int64_t step = PMX_STAGE / kvc__bytes(op->t1, 1);
    if (op->bits) step -= step % (2 * op->group); /* whole groups, whole int4 bytes */
    if (step <= 0) {
        load_run_cached(op, c, out, n);
        return;
    }
    pmx_rows b = *out;
    b.ptr = stage;
    for (int64_t i = 0; i < n; i += step) {
        const int64_t m = n - i < step ? n - i : step;
        pmx_rows a = *c;
        a.ptr += kvc__bytes(c->dtype, i);
        if (a.sptr) a.sptr += kvc__bytes(c->sdtype, i / op->group);
        load_run_cached(op, &a, &b, m);
        op->k->copy_stream(out->ptr + kvc__bytes(op->t1, i), stage,
                           (size_t)kvc__bytes(op->t1, m));
    }
}

/* Whether heads (and then tokens) of both blocks are back to back, so a
 * whole token (or the whole block) is one run: the common contiguous
 * layouts then cost one kernel call per block instead of one per row. */
static int heads_packed(const pmx_op *op, const pmx_rows *r, int64_t heads) {
    if (heads > 1 && r->head_stride != op->Dh) return 0;
    if (r->sptr && heads > 1 && r->shead_stride != op->Dh / op->group) return 0;
    return 1;
}

static int tokens_packed(const pmx_op *op, const pmx_rows *r, int64_t heads, int64_t ntok) {
    if (!heads_packed(op, r, heads)) return 0;
    if (ntok > 1 && r->tok_stride != heads * op->Dh) return 0;
    if (r->sptr && ntok > 1 && r->stok_stride != heads * op->Dh / op->group) return 0;
    return 1;
}

/* Row (t, h) of one half: Dh elements. */
static void store_row(const pmx_op *op, const pmx_rows *in, const pmx_rows *cache, int64_t t,
                      int64_t h) {
    pmx_rows a = pmx_rows_offset(in, t, h), b = pmx_rows_offset(cache, t, h);
    store_run(op, &a, &b, op->Dh);
}

/* Cache row (t, h) into output heads h*R .. h*R+R-1: converted once, then
 * copied. */
static void load_row(const pmx_op *op, const pmx_rows *cache, const pmx_rows *out, int64_t t,
                     int64_t h) {
    pmx_rows a = pmx_rows_offset(cache, t, h), b = pmx_rows_offset(out, t, h * op->repeat);
    const size_t row_bytes = (size_t)kvc__bytes(op->t1, op->Dh); /* <= 2 KiB: Dh <= 512 */
    if (op->stream && op->repeat > 1) { /* the repeats from the stage, not from the output */
        _Alignas(64) char stage[PMX_STAGE];
        pmx_rows s = b;
        s.ptr = stage;
        load_run_cached(op, &a, &s, op->Dh);
        for (int64_t r = 0; r < op->repeat; r++)
            op->k->copy_stream(b.ptr + kvc__bytes(op->t1, r * out->head_stride), stage,
                               row_bytes);
        return;
    }
    load_run(op, &a, &b, op->Dh);
    for (int64_t r = 1; r < op->repeat; r++)
        op->k->copy(b.ptr + kvc__bytes(op->t1, r * out->head_stride), b.ptr, row_bytes);
}

/* One token (all heads) of one half. */
static void store_token(const pmx_op *op, const pmx_rows *in, const pmx_rows *cache, int64_t t) {
    if (heads_packed(op, in, op->H) && heads_packed(op, cache, op->H)) {
        pmx_rows a = pmx_rows_offset(in, t, 0), b = pmx_rows_offset(cache, t, 0);
        store_run(op, &a, &b, op->H * op->Dh);
        return;
    }
    for (int64_t h = 0; h < op->H; h++) store_row(op, in, cache, t, h);
}

/* The head-major quantized load of one token with op->stream: as many of
 * its rows as the stage holds per dequantize_rows call, then each row (and
 * its repeats) copied out with non-temporal stores. */
static void load_token_stream(const pmx_op *op, const pmx_rows *cache, const pmx_rows *out,
                              int64_t t) {
    _Alignas(64) char stage[PMX_STAGE];
    const pmx_rows a = pmx_rows_offset(cache, t, 0), b = pmx_rows_offset(out, t, 0);
    const int64_t row_bytes = kvc__bytes(op->t1, op->Dh); /* <= 2 KiB: Dh <= 512 */
    const int64_t per = PMX_STAGE / row_bytes;
    for (int64_t h0 = 0; h0 < op->H; h0 += per) {
        const int64_t nh = op->H - h0 < per ? op->H - h0 : per;
        op->k->dequantize_rows(a.ptr + kvc__bytes(a.dtype, h0 * a.head_stride),
                               kvc__bytes(a.dtype, a.head_stride), op->bits,
                               a.sptr + kvc__bytes(a.sdtype, h0 * a.shead_stride),
                               kvc__bytes(a.sdtype, a.shead_stride), a.sdtype, nh, op->Dh,
                               op->group, stage, row_bytes, op->t1);
        for (int64_t h = 0; h < nh; h++)
            for (int64_t r = 0; r < op->repeat; r++)
                op->k->copy_stream(
                    b.ptr + kvc__bytes(op->t1, ((h0 + h) * op->repeat + r) * b.head_stride),
                    stage + h * row_bytes, (size_t)row_bytes);
    }
}

static void load_token(const pmx_op *op, const pmx_rows *cache, const pmx_rows *out, int64_t t) {
    if (op->repeat == 1 && heads_packed(op, cache, op->H) && heads_packed(op, out, op->H)) {
        pmx_rows a = pmx_rows_offset(cache, t, 0), b = pmx_rows_offset(out, t, 0);
        load_run(op, &a, &b, op->H * op->Dh);
        return;
    }
    if (op->bits && op->stream) {
        load_token_stream(op, cache, out, t);
        return;
    }
    if (op->bits) { /* head-major cache: the token's H rows in one kernel call */
        const pmx_rows a = pmx_rows_offset(cache, t, 0), b = pmx_rows_offset(out, t, 0);
        op->k->dequantize_rows(a.ptr, kvc__bytes(a.dtype, a.head_stride), op->bits, a.sptr,
                               kvc__bytes(a.sdtype, a.shead_stride), a.sdtype, op->H, op->Dh,
                               op->group, b.ptr, kvc__bytes(op->t1, op->repeat * b.head_stride),
                               op->t1);
        const size_t row_bytes = (size_t)kvc__bytes(op->t1, op->Dh);
        for (int64_t h = 0; h < op->H; h++) {
            char *first = b.ptr + kvc__bytes(op->t1, h * op->repeat * b.head_stride);
            for (int64_t r = 1; r < op->repeat; r++)
                op->k->copy(first + kvc__bytes(op->t1, r * b.head_stride), first, row_bytes);
        }
        return;
    }
    for (int64_t h = 0; h < op->H; h++) load_row(op, cache, out, t, h);
}

/*
 * Both movers take K and V together and pick the order that streams memory
 * best (measured on the bench's decode shapes):
 *  - a half whose tokens are back to back in both tensors: one kernel call;
 *  - token-major caches (a token's heads back to back; pmx dynamic layouts 0
 *    and 1 even keep its K and V side by side): tokens in order, K then V of
 *    each, one sequential stream instead of two half-strided ones (1.5-2x
 *    faster from DRAM than K and V in separate passes);
 *  - head-major caches (static layout 1, dynamic layout 3): K then V, each
 *    token by token with its heads inside, so the output is written in
 *    order while the cache is read as H sequential streams (head by head
 *    measured 2.5x slower: the strided output writes cost more). Callers
 *    also give K and V separate tasks there (kvc__pmx_head_major), so each
 *    set of H streams runs long before the other half's set starts.
 */
void kvc__pmx_store(const pmx_op *op, const pmx_rows in[2], const pmx_rows cache[2],
                    int64_t ntok) {
    int pending[2];
    for (int kv = 0; kv < 2; kv++) {
        pending[kv] = in[kv].ptr != NULL;
        if (pending[kv] && tokens_packed(op, &in[kv], op->H, ntok) &&
            tokens_packed(op, &cache[kv], op->H, ntok)) {
            store_run(op, &in[kv], &cache[kv], ntok * op->H * op->Dh);
            pending[kv] = 0;
        }
    }
    if (!pending[0] && !pending[1]) return;
    if (heads_packed(op, &cache[0], op->H) && heads_packed(op, &cache[1], op->H)) {
        for (int64_t t = 0; t < ntok; t++)
            for (int kv = 0; kv < 2; kv++)
                if (pending[kv]) store_token(op, &in[kv], &cache[kv], t);
        return;
    }
    for (int kv = 0; kv < 2; kv++)
        for (int64_t t = 0; t < ntok && pending[kv]; t++) store_token(op, &in[kv], &cache[kv], t);
}

static void pmx_load(const pmx_op *op, const pmx_rows cache[2], const pmx_rows out[2],
                     int64_t ntok);

void kvc__pmx_load(const pmx_op *op, const pmx_rows cache[2], const pmx_rows out[2],
                   int64_t ntok) {
    pmx_load(op, cache, out, ntok);
    if (op->stream) kvc__stream_fence(); /* a task's output is whole when it ends */
}

static void pmx_load(const pmx_op *op, const pmx_rows cache[2], const pmx_rows out[2],
                     int64_t ntok) {
    int pending[2];
    for (int kv = 0; kv < 2; kv++) {
        pending[kv] = out[kv].ptr != NULL;
        if (pending[kv] && op->repeat == 1 && tokens_packed(op, &cache[kv], op->H, ntok) &&
            tokens_packed(op, &out[kv], op->H, ntok)) {
            load_run(op, &cache[kv], &out[kv], ntok * op->H * op->Dh);
            pending[kv] = 0;
        }
    }
    if (!pending[0] && !pending[1]) return;
    if (heads_packed(op, &cache[0], op->H) && heads_packed(op, &cache[1], op->H)) {
        for (int64_t t = 0; t < ntok; t++)
            for (int kv = 0; kv < 2; kv++)
                if (pending[kv]) load_token(op, &cache[kv], &out[kv], t);
        return;
    }
    for (int kv = 0; kv < 2; kv++)
        for (int64_t t = 0; t < ntok && pending[kv]; t++) load_token(op, &cache[kv], &out[kv], t);
}

int kvc__pmx_stream_loads(const pmx_op *op, int64_t ntok, int halves) {
    const double rows = (double)ntok * (double)halves * (double)op->H;
    const double moved = rows * (double)op->repeat * (double)kvc__bytes(op->t1, op->Dh) +
                         rows * (double)kvc__bytes(op->t2, op->Dh);
    return moved > (double)kvc__llc_bytes();
}

int kvc__pmx_head_major(const pmx_op *op, const pmx_rows cache[2]) {
    return !heads_packed(op, &cache[0], op->H) || !heads_packed(op, &cache[1], op->H);
}

/* ---- validation ------------------------------------------------------------ */

static int is_float(kvc_dtype d) { return d == KVC_F32 || d == KVC_F16 || d == KVC_BF16; }

kvc_status kvc__pmx_scalar_i64(const char *fn, const char *name, const kvc_tensor *t,
                               int64_t *value) {
    KVC_TRY(kvc__check_tensor(t, name, 0));
    KVC_CHECK(t->dtype == KVC_I64, "%s: %s must be int64, got %s", fn, name,
              kvc_dtype_name(t->dtype));
    KVC_CHECK(kvc_tensor_numel(t) == 1, "%s: %s must hold exactly one element, got %lld", fn,
              name, (long long)kvc_tensor_numel(t));
    *value = *(const int64_t *)t->data;
    return KVC_OK;
}

kvc_status kvc__pmx_check_common(const char *fn, const kvc_pmx_kv_params *p, int max_layout,
                                 const kvc_tensor *ck, const kvc_tensor *cv,
                                 const kvc_tensor *cache, const kvc_tensor *scale, int64_t Dh,
                                 pmx_op *op) {
    char b1[96], b2[96];
    KVC_CHECK(p != NULL, "%s: params is NULL", fn);
    KVC_CHECK(p->num_layer >= 1, "%s: num_layer must be >= 1, got %d", fn, (int)p->num_layer);
    KVC_CHECK(p->layer_idx >= 0 && p->layer_idx < p->num_layer,
              "%s: layer_idx %d outside [0, num_layer=%d)", fn, (int)p->layer_idx,
              (int)p->num_layer);
    KVC_CHECK(p->quant_bit == 0 || p->quant_bit == 8 || p->quant_bit == 4,
              "%s: quant_bit must be 0, 8 or 4, got %d", fn, (int)p->quant_bit);
    KVC_CHECK(p->num_repeat >= 1, "%s: num_repeat must be >= 1, got %d", fn, (int)p->num_repeat);
    KVC_CHECK(p->cache_layout >= 0 && p->cache_layout <= max_layout,
              "%s: cache_layout must be in [0, %d], got %d", fn, max_layout,
              (int)p->cache_layout);

    /* current_key / current_value: same shape and dtype. */
    KVC_CHECK(ck->ndim == cv->ndim, "%s: current_key and current_value ranks differ", fn);
    for (int i = 0; i < ck->ndim; i++)
        KVC_CHECK(ck->shape[i] == cv->shape[i], "%s: current_key %s and current_value %s differ",
                  fn, kvc__shape_str(ck, b1, sizeof b1), kvc__shape_str(cv, b2, sizeof b2));
    KVC_CHECK(ck->dtype == cv->dtype, "%s: current_key is %s but current_value is %s", fn,
              kvc_dtype_name(ck->dtype), kvc_dtype_name(cv->dtype));
    const kvc_dtype t1 = ck->dtype, t2 = cache->dtype;
    KVC_CHECK(is_float(t1) || t1 == KVC_I8,
              "%s: current_key dtype must be float32, float16, bfloat16 or int8, got %s", fn,
              kvc_dtype_name(t1));

    if (p->quant_bit == 0) {
        if (t1 == KVC_I8)
            KVC_CHECK(t2 == KVC_I8, "%s: int8 inputs can only be copied into an int8 cache "
                                    "(quant_bit 0), cache is %s", fn, kvc_dtype_name(t2));
        else
            KVC_CHECK(is_float(t2), "%s: with quant_bit 0 the cache must be float32, float16 or "
                                    "bfloat16 for %s inputs, got %s", fn, kvc_dtype_name(t1),
                      kvc_dtype_name(t2));
    } else {
        KVC_CHECK(is_float(t1), "%s: quant_bit %d needs float inputs, got %s", fn,
                  (int)p->quant_bit, kvc_dtype_name(t1));
        kvc_dtype want = p->quant_bit == 8 ? KVC_I8 : KVC_I4;
        KVC_CHECK(t2 == want, "%s: quant_bit %d needs an %s cache, got %s", fn, (int)p->quant_bit,
                  kvc_dtype_name(want), kvc_dtype_name(t2));
        KVC_CHECK(p->quant_group >= 1 && Dh % p->quant_group == 0,
                  "%s: quant_group %d must divide head_dim %lld", fn, (int)p->quant_group,
                  (long long)Dh);
        KVC_CHECK(p->quant_bit != 4 || p->quant_group % 2 == 0,
                  "%s: quant_group must be even for int4, got %d", fn, (int)p->quant_group);
        KVC_CHECK(scale != NULL, "%s: scale is required when quant_bit is %d", fn,
                  (int)p->quant_bit);
        KVC_TRY(kvc__check_tensor(scale, "scale", 1));
        KVC_TRY(kvc__check_writable(scale, "scale"));
        KVC_CHECK(scale->dtype == KVC_F32 || scale->dtype == KVC_F16,
                  "%s: scale must be float32 or float16, got %s", fn,
                  kvc_dtype_name(scale->dtype));
        int ok = scale->ndim == cache->ndim;
        for (int i = 0; ok && i < cache->ndim - 1; i++) ok = scale->shape[i] == cache->shape[i];
        ok = ok && scale->shape[scale->ndim - 1] == Dh / p->quant_group;
        KVC_CHECK(ok, "%s: scale shape %s must be the cache shape %s with last dim %lld", fn,
                  kvc__shape_str(scale, b1, sizeof b1), kvc__shape_str(cache, b2, sizeof b2),
                  (long long)(Dh / p->quant_group));
    }
    op->k = kvc__kernels();
    op->Dh = Dh;
    op->repeat = p->num_repeat;
    op->bits = p->quant_bit;
    op->group = p->quant_bit ? p->quant_group : 1;
    op->sd = p->quant_bit ? scale->dtype : KVC_F32;
    op->t1 = t1;
    op->t2 = t2;
    return KVC_OK;
}

kvc_status kvc__pmx_check_output(const char *fn, const char *name, const kvc_tensor *out,
                                 kvc_dtype t1, int ndim, const int64_t *shape) {
    char b1[96], b2[96];
    KVC_TRY(kvc__check_tensor(out, name, 1));
    KVC_TRY(kvc__check_writable(out, name));
    KVC_CHECK(out->dtype == t1, "%s: %s must have the inputs' dtype %s, got %s", fn, name,
              kvc_dtype_name(t1), kvc_dtype_name(out->dtype));
    int ok = out->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = out->shape[i] == shape[i];
    if (!ok) {
        kvc_tensor want = kvc_tensor_make(NULL, t1, ndim, shape);
        return kvc__error(KVC_ERR_INVALID_ARG, "%s: %s has shape %s, expected %s", fn, name,
                          kvc__shape_str(out, b1, sizeof b1), kvc__shape_str(&want, b2, sizeof b2));
    }
    return KVC_OK;
}

kvc_status kvc__pmx_check_finite(const char *fn, const pmx_op *op, const pmx_rows *in,
                                 int64_t ntok, const char *name) {
    for (int64_t t = 0; t < ntok; t++)
        for (int64_t h = 0; h < op->H; h++) {
            pmx_rows r = pmx_rows_offset(in, t, h);
            if (!op->k->all_finite(r.ptr, op->t1, op->Dh, kvc__quant_limit(op->bits, op->sd))) {
                char what[96];
                snprintf(what, sizeof what, "%s (token %lld, head %lld)", name, (long long)t,
                         (long long)h);
                return kvc__quant_input_error(fn, what, r.ptr, op->t1, op->Dh, op->bits, op->sd);
            }
        }
    return KVC_OK;
}
