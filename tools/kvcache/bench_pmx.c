/*
 * `kvcache bench pmx`: the OpenPPL KeyValueCache operators on a decode step.
 *
 * Each case stores S = 1 new float16 token for each of B sequences at
 * position kvlen - 1 and reads the kvlen positions of every sequence back
 * (float16 outputs, num_repeat 1), through
 *   kvc_pmx_key_value_cache          layouts 0 and 1, and
 *   kvc_pmx_dynamic_key_value_cache  cache_mode 0 (offset) and 1 (paged,
 *                                    page_size 128, pages shuffled), layouts 0 and 3
 *                                    (1 and 2 on request: --layout),
 * with a float16, int8 or int4 cache (group 8, float16 scales), for every
 * thread count asked for.
 *
 * The caches are filled so that position t of head h of sequence b holds the
 * same values whatever the layout or mode (a hash of (k/v, b, t, h) seeds each
 * row); every case of one cache type must therefore produce bit-identical
 * outputs. The output checksum is compared across cases, and a few rows are
 * checked against kvc_quantize/kvc_dequantize, so a fast but wrong operator
 * cannot pass unnoticed.
 *
 * Bytes moved per call = new tokens read (K and V) + their stored rows and
 * scales + every cache row and scale read back + the outputs written.
 */
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"

#define PMX_GROUP 8
#define PMX_PAGE_SIZE 128

/* ---- cases ------------------------------------------------------------- */

typedef struct pmx_variant {
    unsigned op;  /* BENCH_OP_STATIC or BENCH_OP_DYNAMIC */
    int layout;   /* cache_layout */
    int mode;     /* cache_mode (dynamic only) */
    int by_default; /* run without --layout */
} pmx_variant;

static const pmx_variant pmx_variants[] = {
    {BENCH_OP_STATIC, 0, 0, 1},  {BENCH_OP_STATIC, 1, 0, 1},  {BENCH_OP_DYNAMIC, 0, 0, 1},
    {BENCH_OP_DYNAMIC, 1, 0, 0}, {BENCH_OP_DYNAMIC, 2, 0, 0}, {BENCH_OP_DYNAMIC, 3, 0, 1},
    {BENCH_OP_DYNAMIC, 0, 1, 1}, {BENCH_OP_DYNAMIC, 1, 1, 0}, {BENCH_OP_DYNAMIC, 2, 1, 0},
    {BENCH_OP_DYNAMIC, 3, 1, 1},
};

/* Without --layout: static layouts 0 and 1, dynamic 0 and 3; --layout picks
 * among all (static 0..1, dynamic 0..3). */
static int variant_selected(const bench_opts *o, const pmx_variant *v) {
    if (!(o->ops & v->op)) return 0;
    if (v->op == BENCH_OP_DYNAMIC && !(o->modes & (1u << v->mode))) return 0;
    return o->layouts == 0 ? v->by_default : (o->layouts & (1u << v->layout)) != 0;
}

typedef struct pmx_cachetype {
    unsigned bit; /* BENCH_CACHE_* */
    const char *name;
    kvc_dtype dtype;
    int quant_bit;
    double goal; /* wanted fraction of the memcpy bandwidth */
} pmx_cachetype;

static const pmx_cachetype pmx_cachetypes[] = {
    {BENCH_CACHE_F16, "f16", KVC_F16, 0, 0.7},
    {BENCH_CACHE_INT8, "int8", KVC_I8, 8, 0.5},
    {BENCH_CACHE_INT4, "int4", KVC_I4, 4, 0.5},
};

#define N_VARIANTS ((int)(sizeof pmx_variants / sizeof pmx_variants[0]))
#define N_CACHETYPES ((int)(sizeof pmx_cachetypes / sizeof pmx_cachetypes[0]))

typedef struct pmx_dims {
    int64_t B, N, H, D; /* sequences, kvlen, KV heads, head dim */
    int64_t S, P;       /* new tokens per sequence (1), start_pos (N - 1) */
} pmx_dims;

/* Everything one call needs; buffers are owned by the case. */
typedef struct pmx_case {
    pmx_dims d;
    pmx_variant v;
    const pmx_cachetype *ct;
    int64_t max_pages; /* paged mode: pages per sequence */

    uint16_t *cur_k, *cur_v; /* (B*S, H, D) float16 */
    unsigned char *cache, *scale;
    uint16_t *out_k, *out_v; /* (B*N, H, D) float16 */
    size_t cache_bytes, scale_bytes, cur_bytes, out_bytes;
    int64_t *seqstarts, *kvstarts, *cachestarts, *start_pos;
    int64_t max_seqlen, max_kvlen, start_pos_static;

    kvc_tensor t_cur_k, t_cur_v, t_cache, t_scale, t_key, t_value;
    kvc_tensor t_seqstarts, t_kvstarts, t_cachestarts, t_start_pos, t_max_seqlen, t_max_kvlen;
    kvc_tensor t_start_pos_static;
    kvc_pmx_kv_params params;
    kvc_threadpool *pool;
    kvc_status last; /* status of the last call */
} pmx_case;

static const char *variant_mode_name(const pmx_variant *v) {
    if (v->op == BENCH_OP_STATIC) return "-";
    return v->mode ? "paged" : "offset";
}

static const char *variant_op_name(const pmx_variant *v) {
    return v->op == BENCH_OP_STATIC ? "static" : "dynamic";
}

/* ---- the timed call ---------------------------------------------------- */

static int pmx_call(void *ctx) {
    pmx_case *c = ctx;
    kvc_tensor *scale = c->ct->quant_bit ? &c->t_scale : NULL;
    if (c->v.op == BENCH_OP_STATIC)
        c->last = kvc_pmx_key_value_cache(&c->t_cur_k, &c->t_cur_v, &c->t_start_pos_static,
                                          &c->t_cache, scale, &c->params, &c->t_key, &c->t_value,
                                          c->pool);
    else
        c->last = kvc_pmx_dynamic_key_value_cache(
            &c->t_cur_k, &c->t_cur_v, &c->t_seqstarts, &c->t_kvstarts, &c->t_cachestarts,
            &c->t_start_pos, &c->t_max_seqlen, &c->t_max_kvlen, &c->t_cache, scale, &c->params,
            &c->t_key, &c->t_value, c->pool);
    return c->last != KVC_OK;
}

/* ---- deterministic contents -------------------------------------------- */

static uint64_t row_seed(int kv, int64_t b, int64_t t, int64_t h) {
    return bench_mix64(bench_mix64(bench_mix64((uint64_t)kv * 0x51ull + (uint64_t)b) ^ (uint64_t)t) ^
                      (uint64_t)h);
}

/* Finite float16 in +-[0.25, 4) from 16 random bits. */
static uint16_t rand_f16(uint64_t r) {
    return (uint16_t)((r & 0x8000u) | ((13u + ((r >> 10) & 3u)) << 10) | (r & 0x3ffu));
}

/* Positive float16 scale in [2^-9, 2^-6) from 16 random bits. */
static uint16_t rand_scale(uint64_t r) {
    return (uint16_t)(((6u + ((r >> 10) & 3u) % 3u) << 10) | (r & 0x3ffu));
}

/* One row of the cache at position (kv, b, t, h): D elements of the cache
 * type (bytes: D*2, D or D/2) and, quantized, D/PMX_GROUP float16 scales. */
static void fill_row(const pmx_cachetype *ct, int64_t D, uint64_t seed, unsigned char *row,
                     uint16_t *scales) {
    uint64_t s = seed;
    if (ct->dtype == KVC_F16) {
        uint16_t v[4];
        for (int64_t i = 0; i < D; i += 4) {
            uint64_t r = bench_mix64(s++);
            for (int j = 0; j < 4; j++) v[j] = rand_f16(r >> (16 * j));
            memcpy(row + 2 * i, v, 8); /* D is a multiple of 8 */
        }
        return;
    }
    int64_t nbytes = ct->dtype == KVC_I8 ? D : D / 2;
    for (int64_t i = 0; i < nbytes; i += 8) {
        uint64_t r = bench_mix64(s++);
        for (int j = 0; j < 8 && i + j < nbytes; j++) {
            unsigned char byte = (unsigned char)(r >> (8 * j));
            if (ct->dtype == KVC_I8) {
                if (byte == 0x80) byte = 0x81; /* -128 is never stored */
            } else {
                if ((byte & 0x0f) == 0x08) byte ^= 0x01; /* -8 nibbles neither */
                if ((byte & 0xf0) == 0x80) byte ^= 0x10;
            }
            row[i + j] = byte;
        }
    }
    for (int64_t g = 0; g < D / PMX_GROUP; g++) scales[g] = rand_scale(bench_mix64(s++ ^ 0x5ca1e));
}

/* Element offset of row (kv, b, t, h) in a cache-shaped tensor t (the cache
 * itself or its scale). */
static int64_t row_offset(const pmx_case *c, const kvc_tensor *t, int kv, int64_t b, int64_t pos,
                          int64_t h) {
    const int64_t *st = t->stride;
    if (c->v.op == BENCH_OP_STATIC) {
        if (c->v.layout == 0) return b * st[0] + kv * st[2] + pos * st[3] + h * st[4];
        return b * st[1] + kv * st[2] + h * st[3] + pos * st[4];
    }
    int64_t slot = c->v.mode == 0
                       ? c->cachestarts[b] + pos
                       : c->cachestarts[b * c->max_pages + pos / PMX_PAGE_SIZE] + pos % PMX_PAGE_SIZE;
    switch (c->v.layout) {
    case 0: return slot * st[0] + kv * st[2] + h * st[3]; /* (MaxT, L, 2, H, Dh) */
    case 1: return slot * st[1] + kv * st[2] + h * st[3]; /* (L, MaxT, 2, H, Dh) */
    case 2: return kv * st[1] + slot * st[2] + h * st[3]; /* (L, 2, MaxT, H, Dh) */
    default: return kv * st[1] + h * st[2] + slot * st[3]; /* (L, 2, H, MaxT, Dh) */
    }
}

static unsigned char *cache_row(const pmx_case *c, int kv, int64_t b, int64_t pos, int64_t h) {
    int64_t e = row_offset(c, &c->t_cache, kv, b, pos, h);
    return c->cache + (size_t)(e * kvc_dtype_bits(c->ct->dtype) / 8);
}

static uint16_t *scale_row(const pmx_case *c, int kv, int64_t b, int64_t pos, int64_t h) {
    return (uint16_t *)(void *)c->scale + row_offset(c, &c->t_scale, kv, b, pos, h);
}

static void fill_cache(pmx_case *c) {
    const pmx_dims *d = &c->d;
    uint16_t dummy[1] = {0};
    for (int kv = 0; kv < 2; kv++)
        for (int64_t b = 0; b < d->B; b++)
            for (int64_t t = 0; t < d->N; t++)
                for (int64_t h = 0; h < d->H; h++)
                    fill_row(c->ct, d->D, row_seed(kv, b, t, h), cache_row(c, kv, b, t, h),
                             c->ct->quant_bit ? scale_row(c, kv, b, t, h) : dummy);
    /* The new tokens: seeded apart from the cache rows (kv 2 and 3). */
    pmx_cachetype f16 = {BENCH_CACHE_F16, "f16", KVC_F16, 0, 0};
    for (int64_t r = 0; r < d->B * d->S * d->H; r++) {
        fill_row(&f16, d->D, row_seed(2, r, 0, 0), (unsigned char *)(c->cur_k + r * d->D), dummy);
        fill_row(&f16, d->D, row_seed(3, r, 0, 0), (unsigned char *)(c->cur_v + r * d->D), dummy);
    }
}

/* ---- set-up ------------------------------------------------------------ */

static void free_case(pmx_case *c) {
    bench_free(c->cur_k);
    bench_free(c->cur_v);
    bench_free(c->cache);
    bench_free(c->scale);
    bench_free(c->out_k);
    bench_free(c->out_v);
    free(c->seqstarts);
    free(c->kvstarts);
    free(c->cachestarts);
    free(c->start_pos);
    memset(c, 0, sizeof *c);
}

/* Slots (MaxT) of the dynamic cache: B*N in offset mode, B*pages*page_size
 * when paged. */
static int64_t dynamic_slots(const pmx_dims *d, int mode, int64_t *max_pages) {
    *max_pages = (d->N + PMX_PAGE_SIZE - 1) / PMX_PAGE_SIZE;
    return mode == 0 ? d->B * d->N : d->B * *max_pages * PMX_PAGE_SIZE;
}

/* Bytes the buffers of one case take. */
static size_t case_bytes(const pmx_dims *d, const pmx_variant *v, const pmx_cachetype *ct) {
    int64_t pages;
    int64_t rows = v->op == BENCH_OP_STATIC ? d->B * d->N : dynamic_slots(d, v->mode, &pages);
    size_t row = (size_t)(d->D * kvc_dtype_bits(ct->dtype) / 8) +
                 (ct->quant_bit ? (size_t)(d->D / PMX_GROUP) * 2 : 0);
    size_t cache = 2 * (size_t)rows * (size_t)d->H * row;
    size_t out = 2 * (size_t)(d->B * d->N * d->H * d->D) * 2;
    return cache + out + 2 * (size_t)(d->B * d->S * d->H * d->D) * 2;
}

/* Allocates and fills the buffers and describes them as tensors. */
static int setup_case(pmx_case *c, const pmx_dims *d, const pmx_variant *v,
                      const pmx_cachetype *ct) {
    memset(c, 0, sizeof *c);
    c->d = *d;
    c->v = *v;
    c->ct = ct;
    const int64_t B = d->B, N = d->N, H = d->H, D = d->D, S = d->S;
    c->cur_bytes = (size_t)(B * S * H * D) * 2;
    c->out_bytes = (size_t)(B * N * H * D) * 2;
    c->cur_k = bench_alloc(c->cur_bytes);
    c->cur_v = bench_alloc(c->cur_bytes);
    c->out_k = bench_alloc(c->out_bytes);
    c->out_v = bench_alloc(c->out_bytes);
    c->seqstarts = calloc((size_t)B + 1, sizeof(int64_t));
    c->kvstarts = calloc((size_t)B + 1, sizeof(int64_t));
    c->start_pos = calloc((size_t)B, sizeof(int64_t));
    int64_t max_t = dynamic_slots(d, v->mode, &c->max_pages);
    int64_t n_starts = v->mode == 0 ? B : B * c->max_pages;
    c->cachestarts = calloc((size_t)n_starts, sizeof(int64_t));

    int64_t cshape[6], sshape[6];
    int nd;
    if (v->op == BENCH_OP_STATIC) {
        nd = 6;
        if (v->layout == 0) { /* (MaxB, L, 2, MaxS, H, Dh) */
            int64_t s[6] = {B, 1, 2, N, H, D};
            memcpy(cshape, s, sizeof s);
        } else { /* (L, MaxB, 2, H, MaxS, Dh) */
            int64_t s[6] = {1, B, 2, H, N, D};
            memcpy(cshape, s, sizeof s);
        }
    } else {
        nd = 5;
        const int64_t dyn_shapes[4][5] = {
            {max_t, 1, 2, H, D}, /* 0: (MaxT, L, 2, H, Dh) */
            {1, max_t, 2, H, D}, /* 1: (L, MaxT, 2, H, Dh) */
            {1, 2, max_t, H, D}, /* 2: (L, 2, MaxT, H, Dh) */
            {1, 2, H, max_t, D}, /* 3: (L, 2, H, MaxT, Dh) */
        };
        memcpy(cshape, dyn_shapes[v->layout], sizeof dyn_shapes[0]);
    }
    int64_t cache_elems = 1;
    for (int i = 0; i < nd; i++) cache_elems *= cshape[i];
    memcpy(sshape, cshape, sizeof sshape);
    sshape[nd - 1] = D / PMX_GROUP;
    c->cache_bytes = (size_t)(cache_elems * kvc_dtype_bits(ct->dtype) / 8);
    c->scale_bytes = ct->quant_bit ? (size_t)(cache_elems / PMX_GROUP) * 2 : 0;
    c->cache = bench_alloc(c->cache_bytes);
    c->scale = ct->quant_bit ? bench_alloc(c->scale_bytes) : NULL;
    if (c->cur_k == NULL || c->cur_v == NULL || c->out_k == NULL || c->out_v == NULL ||
        c->seqstarts == NULL || c->kvstarts == NULL || c->start_pos == NULL ||
        c->cachestarts == NULL || c->cache == NULL || (ct->quant_bit && c->scale == NULL)) {
        fprintf(stderr, "kvcache: bench pmx: out of memory\n");
        free_case(c);
        return -1;
    }

    /* Sequence bookkeeping: one new token per sequence at position N - 1. */
    for (int64_t b = 0; b <= B; b++) {
        c->seqstarts[b] = b * S;
        c->kvstarts[b] = b * N;
    }
    for (int64_t b = 0; b < B; b++) c->start_pos[b] = d->P;
    if (v->mode == 0) {
        for (int64_t b = 0; b < B; b++) c->cachestarts[b] = b * N;
    } else {
        /* Pages handed out in a shuffled order, as a real allocator would
         * after some churn (fixed seed: every run gets the same order). */
        for (int64_t i = 0; i < n_starts; i++) c->cachestarts[i] = i;
        uint64_t r = 12345;
        for (int64_t i = n_starts - 1; i > 0; i--) {
            r = bench_mix64(r);
            int64_t j = (int64_t)(r % (uint64_t)(i + 1));
            int64_t tmp = c->cachestarts[i];
            c->cachestarts[i] = c->cachestarts[j];
            c->cachestarts[j] = tmp;
        }
        for (int64_t i = 0; i < n_starts; i++) c->cachestarts[i] *= PMX_PAGE_SIZE;
    }
    c->max_seqlen = S;
    c->max_kvlen = N;
    c->start_pos_static = d->P;

    int64_t one = 1, bp1 = B + 1;
    if (v->op == BENCH_OP_STATIC) {
        int64_t cur_shape[4] = {B, S, H, D}, out_shape[4] = {B, N, H, D};
        c->t_cur_k = kvc_tensor_make(c->cur_k, KVC_F16, 4, cur_shape);
        c->t_cur_v = kvc_tensor_make(c->cur_v, KVC_F16, 4, cur_shape);
        c->t_key = kvc_tensor_make(c->out_k, KVC_F16, 4, out_shape);
        c->t_value = kvc_tensor_make(c->out_v, KVC_F16, 4, out_shape);
    } else {
        int64_t cur_shape[3] = {B * S, H, D}, out_shape[3] = {B * N, H, D};
        c->t_cur_k = kvc_tensor_make(c->cur_k, KVC_F16, 3, cur_shape);
        c->t_cur_v = kvc_tensor_make(c->cur_v, KVC_F16, 3, cur_shape);
        c->t_key = kvc_tensor_make(c->out_k, KVC_F16, 3, out_shape);
        c->t_value = kvc_tensor_make(c->out_v, KVC_F16, 3, out_shape);
    }
    c->t_cache = kvc_tensor_make(c->cache, ct->dtype, nd, cshape);
    c->t_scale = kvc_tensor_make(c->scale, KVC_F16, nd, sshape);
    c->t_seqstarts = kvc_tensor_make(c->seqstarts, KVC_I64, 1, &bp1);
    c->t_kvstarts = kvc_tensor_make(c->kvstarts, KVC_I64, 1, &bp1);
    c->t_start_pos = kvc_tensor_make(c->start_pos, KVC_I64, 1, &B);
    if (v->mode == 0) {
        c->t_cachestarts = kvc_tensor_make(c->cachestarts, KVC_I64, 1, &B);
    } else {
        int64_t cs_shape[2] = {B, c->max_pages};
        c->t_cachestarts = kvc_tensor_make(c->cachestarts, KVC_I64, 2, cs_shape);
    }
    c->t_max_seqlen = kvc_tensor_make(&c->max_seqlen, KVC_I64, 1, &one);
    c->t_max_kvlen = kvc_tensor_make(&c->max_kvlen, KVC_I64, 1, &one);
    c->t_start_pos_static = kvc_tensor_make(&c->start_pos_static, KVC_I64, 1, &one);

    c->params = kvc_pmx_kv_default_params();
    c->params.num_layer = 1;
    c->params.layer_idx = 0;
    c->params.quant_bit = ct->quant_bit;
    c->params.quant_group = PMX_GROUP;
    c->params.num_repeat = 1;
    c->params.cache_layout = v->layout;
    c->params.cache_mode = v->op == BENCH_OP_DYNAMIC ? v->mode : 0;
    c->params.page_size = PMX_PAGE_SIZE;
    fill_cache(c);
    return 0;
}

/* ---- checks ------------------------------------------------------------ */

/* Expected float16 output row of (kv, b, t, h) into y (D elements). */
static int expected_row(const pmx_case *c, int kv, int64_t b, int64_t t, int64_t h,
                        uint16_t *y) {
    const pmx_dims *d = &c->d;
    int64_t D = d->D;
    unsigned char q[1024];
    uint16_t sc[128];
    if (t >= d->P) { /* the new token, as given */
        const uint16_t *x = (kv ? c->cur_v : c->cur_k) + ((b * d->S + (t - d->P)) * d->H + h) * D;
        if (c->ct->quant_bit == 0) {
            memcpy(y, x, (size_t)D * 2);
            return 0;
        }
        if (kvc_quantize(x, KVC_F16, D, c->ct->quant_bit, PMX_GROUP, q, sc, KVC_F16) != KVC_OK)
            return -1;
    } else {
        fill_row(c->ct, D, row_seed(kv, b, t, h), q, sc);
        if (c->ct->quant_bit == 0) {
            memcpy(y, q, (size_t)D * 2);
            return 0;
        }
    }
    return kvc_dequantize(q, c->ct->quant_bit, sc, KVC_F16, D, PMX_GROUP, y, KVC_F16) == KVC_OK
               ? 0
               : -1;
}

/* Compares a few output rows (first/middle/last position incl. the new
 * token, first/last sequence and head) with the expected values. Returns 0,
 * or -1 with a message on stderr. */
static int check_outputs(const pmx_case *c, const char *label) {
    const pmx_dims *d = &c->d;
    if (d->D > 1024) return 0; /* row buffers are sized for Dh <= 1024 */
    uint16_t y[1024];
    int64_t bs[2] = {0, d->B - 1}, hs[2] = {0, d->H - 1}, ts[3] = {0, d->N / 2, d->P};
    for (int kv = 0; kv < 2; kv++)
        for (int ib = 0; ib < 2; ib++)
            for (int it = 0; it < 3; it++)
                for (int ih = 0; ih < 2; ih++) {
                    int64_t b = bs[ib], t = ts[it], h = hs[ih];
                    if (expected_row(c, kv, b, t, h, y) != 0) {
                        fprintf(stderr, "kvcache: bench pmx: %s: reference failed: %s\n", label,
                                kvc_last_error());
                        return -1;
                    }
                    const uint16_t *out =
                        (kv ? c->out_v : c->out_k) + ((b * d->N + t) * d->H + h) * d->D;
                    if (memcmp(out, y, (size_t)d->D * 2) != 0) {
                        fprintf(stderr,
                                "kvcache: bench pmx: %s: wrong output: %s row of sequence "
                                "%lld, position %lld, head %lld\n",
                                label, kv ? "value" : "key", (long long)b, (long long)t,
                                (long long)h);
                        return -1;
                    }
                }
    return 0;
}

/* ---- reporting --------------------------------------------------------- */

/* Bytes read + written by one call. */
static double bytes_per_call(const pmx_dims *d, const pmx_cachetype *ct) {
    double row_cache = (double)d->D * kvc_dtype_bits(ct->dtype) / 8.0 +
                       (ct->quant_bit ? (double)(d->D / PMX_GROUP) * 2.0 : 0.0);
    double row_t1 = (double)d->D * 2.0;
    double new_rows = 2.0 * (double)(d->B * d->S * d->H); /* K and V */
    double all_rows = 2.0 * (double)(d->B * d->N * d->H);
    return new_rows * (row_t1 + row_cache) + all_rows * (row_cache + row_t1);
}

typedef struct pmx_row {
    const pmx_case *c;
    int threads;
    bench_timing tm;
    double bytes, gbs, memcpy_gbs, ratio;
    uint64_t checksum;
} pmx_row;

static void print_table_header(void) {
    printf("%-8s %-6s %-6s %-5s %3s %11s %11s %8s %8s %7s  %s\n", "op", "layout", "mode", "cache",
           "thr", "us/call", "MB/call", "GB/s", "memcpy", "ratio", "goal");
}

static void print_row(const bench_opts *o, const pmx_row *r) {
    const pmx_case *c = r->c;
    int met = r->ratio >= c->ct->goal;
    if (o->json) {
        printf("{\"type\":\"case\",\"target\":\"pmx\",\"op\":\"%s\",\"layout\":%d,",
               variant_op_name(&c->v), c->v.layout);
        if (c->v.op == BENCH_OP_DYNAMIC)
            printf("\"cache_mode\":%d,\"page_size\":%d,", c->v.mode, PMX_PAGE_SIZE);
        printf("\"cache\":\"%s\",\"quant_bit\":%d,\"quant_group\":%d,\"threads\":%d,"
               "\"isa\":\"%s\",\"batch\":%lld,\"kvlen\":%lld,\"heads\":%lld,\"head_dim\":%lld,"
               "\"us_per_call\":%.3f,\"us_min\":%.3f,\"calls\":%lld,\"samples\":%d,"
               "\"bytes_per_call\":%.0f,\"gbs\":%.3f,\"memcpy_gbs\":%.3f,\"ratio\":%.4f,"
               "\"goal\":%.2f,\"goal_met\":%s,\"checksum\":\"%016llx\"}\n",
               c->ct->name, c->ct->quant_bit, PMX_GROUP, r->threads, kvc_isa_name(kvc_get_isa()),
               (long long)c->d.B, (long long)c->d.N, (long long)c->d.H, (long long)c->d.D,
               r->tm.median_s * 1e6, r->tm.min_s * 1e6, (long long)r->tm.calls, r->tm.samples,
               r->bytes, r->gbs, r->memcpy_gbs, r->ratio, c->ct->goal, met ? "true" : "false",
               (unsigned long long)r->checksum);
        return;
    }
    printf("%-8s %-6d %-6s %-5s %3d %11.1f %11.2f %8.2f %8.2f %7.3f  >=%.2f %s\n",
           variant_op_name(&c->v), c->v.layout, variant_mode_name(&c->v), c->ct->name, r->threads,
           r->tm.median_s * 1e6, r->bytes * 1e-6, r->gbs, r->memcpy_gbs, r->ratio, c->ct->goal,
           met ? "ok" : "MISSED");
}

/* ---- driver ------------------------------------------------------------ */

typedef struct pmx_totals {
    int cases, failed, goals_met;
    uint64_t ref_checksum[N_CACHETYPES];
    int have_ref[N_CACHETYPES];
} pmx_totals;

/* Runs one set-up case with each thread count. */
static void run_case(const bench_opts *o, pmx_case *c, int ct_idx, bench_membw_ctx *mb,
                     double membw_budget, pmx_totals *tot) {
    char label[128];
    for (int ti = 0; ti < o->n_thread_counts; ti++) {
        int nt = o->threads[ti];
        snprintf(label, sizeof label, "%s layout %d%s%s, %s cache, %d thread%s",
                 variant_op_name(&c->v), c->v.layout, c->v.op == BENCH_OP_DYNAMIC ? ", mode " : "",
                 c->v.op == BENCH_OP_DYNAMIC ? variant_mode_name(&c->v) : "", c->ct->name, nt,
                 nt == 1 ? "" : "s");
        tot->cases++;
        if (kvc_threadpool_create(nt, &c->pool) != KVC_OK) {
            fprintf(stderr, "kvcache: bench pmx: %s: thread pool: %s\n", label, kvc_last_error());
            tot->failed++;
            continue;
        }
        pmx_row r;
        memset(&r, 0, sizeof r);
        r.c = c;
        r.threads = nt;
        bench_membw_prepare(mb, nt, 0);
        int rc = bench_time_interleaved(pmx_call, c, o->time_s, mb, membw_budget, r.threads,
                                        &r.tm, &r.memcpy_gbs);
        kvc_threadpool_destroy(c->pool);
        c->pool = NULL;
        if (rc < 0) {
            tot->failed++;
            continue;
        }
        if (rc != 0) {
            fprintf(stderr, "kvcache: bench pmx: %s: %s: %s\n", label, kvc_status_str(c->last),
                    kvc_last_error());
            tot->failed++;
            return; /* the other thread counts would fail the same way */
        }
        if (ti == 0 && check_outputs(c, label) != 0) {
            tot->failed++;
            return;
        }
        r.checksum = bench_checksum(bench_checksum(0, c->out_k, c->out_bytes), c->out_v,
                                    c->out_bytes);
        bench_sink(r.checksum);
        if (!tot->have_ref[ct_idx]) {
            tot->have_ref[ct_idx] = 1;
            tot->ref_checksum[ct_idx] = r.checksum;
        } else if (tot->ref_checksum[ct_idx] != r.checksum) {
            fprintf(stderr,
                    "kvcache: bench pmx: %s: output checksum %016llx differs from the first "
                    "%s case (%016llx)\n",
                    label, (unsigned long long)r.checksum, c->ct->name,
                    (unsigned long long)tot->ref_checksum[ct_idx]);
            tot->failed++;
        }
        r.bytes = bytes_per_call(&c->d, c->ct);
        r.gbs = r.bytes / r.tm.median_s * 1e-9;
        r.ratio = r.gbs / r.memcpy_gbs;
        if (r.ratio >= c->ct->goal) tot->goals_met++;
        print_row(o, &r);
        bench_flush("pmx");
    }
}

/* when: "start" or "end" of the run (each case also takes its own). */
static void print_membw(const bench_opts *o, const bench_membw *bw, const char *when) {
    if (o->json) {
        printf("{\"type\":\"membw\",\"when\":\"%s\",\"threads\":%d,\"bytes\":%zu,"
               "\"memcpy_gbs\":%.3f,\"read_gbs\":%.3f}\n",
               when, bw->threads, bw->bytes, bw->copy_gbs, bw->read_gbs);
        return;
    }
    printf("# reference (%s), %d thread%s: memcpy %.2f GB/s (read + write of %zu MiB), "
           "read %.2f GB/s\n",
           when, bw->threads, bw->threads == 1 ? "" : "s", bw->copy_gbs, bw->bytes >> 20,
           bw->read_gbs);
}

int bench_pmx(const bench_opts *o) {
    pmx_dims d;
    d.B = o->batch ? o->batch : (o->quick ? 2 : 16);
    d.N = o->kvlen ? o->kvlen : (o->quick ? 256 : 2048);
    d.H = o->heads ? o->heads : (o->quick ? 2 : 8);
    d.D = o->head_dim ? o->head_dim : (o->quick ? 64 : 128);
    d.S = 1;
    d.P = d.N - 1;

    /* The largest case must fit. Sizes are capped by the option parser, but
     * their product can still exceed int64: estimate in double first (8 bytes
     * per element: float16 K and V outputs and cache), then count exactly. */
    double need = (double)d.B * (double)d.N * (double)d.H * (double)d.D * 8.0;
    const double limit = (double)bench_mem_limit(o);
    if (need <= limit) {
        for (int vi = 0; vi < N_VARIANTS; vi++)
            for (int ci = 0; ci < N_CACHETYPES; ci++) {
                size_t b = case_bytes(&d, &pmx_variants[vi], &pmx_cachetypes[ci]);
                if ((double)b > need) need = (double)b;
            }
    }
    if (need > limit)
        return bench_refuse_size(o, "pmx", need, "--batch, --kvlen, --heads or --head-dim");

    int selected = 0;
    for (int vi = 0; vi < N_VARIANTS; vi++)
        for (int ci = 0; ci < N_CACHETYPES; ci++)
            if ((o->caches & pmx_cachetypes[ci].bit) && variant_selected(o, &pmx_variants[vi]))
                selected++;
    if (selected == 0) {
        fprintf(stderr, "kvcache: bench pmx: no case matches --op/--layout/--mode/--cache "
                        "(static layouts are 0 and 1)\n");
        return CLI_EXIT_USAGE;
    }

    bench_print_machine(o, "pmx", stdout);
    if (!o->json)
        printf("# B=%lld sequences, kvlen=%lld (start_pos %lld, 1 new token each), H=%lld, "
               "Dh=%lld, float16 in/out, quant group %d with float16 scales, num_repeat 1, "
               "page_size %d; %.2f s per case\n",
               (long long)d.B, (long long)d.N, (long long)d.P, (long long)d.H, (long long)d.D,
               PMX_GROUP, PMX_PAGE_SIZE, o->time_s);

    /* Memory bandwidth reference: copy and read at the start and the end of
     * the run (drift), copy again next to every case (the ratio). */
    const double membw_budget = o->quick ? 0.02 : 0.5;
    const double case_membw_budget = o->quick ? 0.005 : 0.15;
    bench_membw_ctx *mb = bench_membw_create(o->membw_bytes);
    if (mb == NULL) return CLI_EXIT_FAIL;
    for (int ti = 0; ti < o->n_thread_counts; ti++) {
        bench_membw bw;
        if (bench_membw_measure(mb, o->threads[ti], membw_budget, 1, &bw) != 0) {
            bench_membw_destroy(mb);
            return CLI_EXIT_FAIL;
        }
        print_membw(o, &bw, "start");
    }
    if (!o->json) print_table_header();
    bench_flush("pmx");

    pmx_totals tot;
    memset(&tot, 0, sizeof tot);
    for (int ci = 0; ci < N_CACHETYPES; ci++) {
        if (!(o->caches & pmx_cachetypes[ci].bit)) continue;
        for (int vi = 0; vi < N_VARIANTS; vi++) {
            if (!variant_selected(o, &pmx_variants[vi])) continue;
            pmx_case c;
            if (setup_case(&c, &d, &pmx_variants[vi], &pmx_cachetypes[ci]) != 0) {
                bench_membw_destroy(mb);
                return CLI_EXIT_FAIL;
            }
            run_case(o, &c, ci, mb, case_membw_budget, &tot);
            free_case(&c);
        }
    }
    for (int ti = 0; ti < o->n_thread_counts; ti++) {
        bench_membw bw;
        if (bench_membw_measure(mb, o->threads[ti], membw_budget, 1, &bw) != 0) {
            tot.failed++;
            break;
        }
        print_membw(o, &bw, "end");
    }
    bench_membw_destroy(mb);
    if (o->json) {
        printf("{\"type\":\"summary\",\"cases\":%d,\"failed\":%d,\"goals_met\":%d}\n", tot.cases,
               tot.failed, tot.goals_met);
    } else {
        printf("# %d case%s, %d failed, goal (ratio to memcpy: f16 >= 0.70, int8/int4 >= 0.50) "
               "met by %d\n",
               tot.cases, tot.cases == 1 ? "" : "s", tot.failed, tot.goals_met);
    }
    return tot.failed ? CLI_EXIT_FAIL : CLI_EXIT_OK;
}
