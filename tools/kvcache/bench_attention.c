/*
 * `kvcache bench attention`: kvc_decode_run (one decode step, one layer)
 * over a paged NHD cache (HND with --layout hnd; page_size 16, pages
 * shuffled), shapes Hq=32/H=8/Dh=128 and Hq=9/H=3/Dh=64, kv lengths
 * 512/4096/16384, batch 1 and 16, float16 / int8 / int4 caches (quant group
 * ATT_GROUP = 32 or --group: N, or row for Dh; float16 scales), float16 q and out.
 *
 * Reports us per layer, the K/V bytes read (cache rows + scales), effective
 * GB/s and its ratio to a plain read (vectorized sum) of a large buffer with
 * the same thread count, interleaved with the operator in the same run
 * (the memory bound), and the compute bound: the arithmetic one step needs,
 * B * kv * (2 * Hq * Dh FMAs for q.k and p.v + 2 * H * Dh element
 * conversions, each counted as one FMA lane), over the FMA peak of the
 * selected ISA (independent vector FMA chains on the same threads, also
 * interleaved). "mem" = read-bound time / measured time, "fma" =
 * compute-bound time / measured time: whichever is near 1 is the bound that
 * applies. Goals: float16 >= 0.7 of the read bound at kv >= 4096; int8 at
 * least 1.6x faster per step than float16 (same shape, batch, kv, threads).
 * The speed against float16 is timed in pairs: the float16 case of the same
 * shape, batch and kv stays allocated while the others run, and each of
 * their rounds times it too (on a shared machine, cases run one after the
 * other saw different moments: ratios moved by up to 1.8x between runs).
 *
 * kivi8 / kivi4 (--cache, docs/KV_FORMATS.md): kvc_kvfmt_attention over
 * uint8 pages of the same page_size (shuffled), filled by kvc_kvfmt_append
 * of random float32 K/V (channels with their own offset and spread), one
 * float32 query per sequence at the last position; kv is a multiple of G =
 * 64 in the standard runs, so every group is quantized and the float16
 * tail is empty (a --kvlen that is not adds a tail). float32 q/out. Bytes
 * read: the pages' codes and parameters. Goal: at least 1.3x faster per
 * step than float16 (the float16 case of the same shape, batch, kv and
 * threads, in the same run; run in the first selected layout).
 *
 * --layers N gives the case N caches of the same shape (same contents, own
 * memory) and each call takes the next, as the layers of a model's decode
 * step do: then a layer's K/V has been pushed out of the caches by the other
 * layers' when its turn comes, where with one layer a small step re-reads
 * K/V the previous call left in L2/L3.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>
#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"

#define ATT_PAGE 16
#define ATT_GROUP 32

typedef struct att_shape {
    int64_t Hq, H, D;
} att_shape;

typedef struct att_case {
    att_shape s;
    int64_t B, L;
    kvc_dtype dt;
    const char *name;
    unsigned char *k, *v, *ks, *vs; /* layers caches, kv_stride / s_stride bytes apart */
    int64_t layers, layer;           /* caches, the one the next call reads */
    size_t kv_stride, s_stride;
    uint16_t *q, *out;
    float *lse;
    int32_t *indptr, *indices, *last;
    kvc_paged_cache pc;
    kvc_tensor tq, tout, tlse, tindptr, tindices, tlast;
    kvc_decode_plan *plan;
    kvc_threadpool *pool;
    kvc_status st;
    float soft_cap; /* logits_soft_cap of every call (0: none) */
    /* kivi8/kivi4 (fmt.id != KVC_KVFMT_NONE): pages in c->k, layers apart by kv_stride */
    kvc_kvfmt fmt;
    kvc_tensor tpages;
    kvc_kvfmt_seq *seqs;
    uint16_t *tails;
    int32_t *qseq, *qpos;
    double kv_bytes;
    double lane_ops; /* FMA lanes + converted elements one step needs */
} att_case;

static int att_call(void *ctx) {
    att_case *c = ctx;
    kvc_attn_params p = kvc_attn_default_params();
    p.logits_soft_cap = c->soft_cap;
    if (c->fmt.id != KVC_KVFMT_NONE) {
        if (c->layers > 1) {
            c->layer = c->layer + 1 == c->layers ? 0 : c->layer + 1;
            c->tpages.data = c->k + (size_t)c->layer * c->kv_stride;
        }
        c->st = kvc_kvfmt_attention(&c->fmt, &c->tpages, c->seqs, c->B, &c->tq, c->qseq, c->qpos,
                                    NULL, &c->tout, NULL, c->pool);
        return c->st != KVC_OK;
    }
    if (c->layers > 1) {
        c->layer = c->layer + 1 == c->layers ? 0 : c->layer + 1;
        c->pc.k.data = c->k + (size_t)c->layer * c->kv_stride;
        c->pc.v.data = c->v + (size_t)c->layer * c->kv_stride;
        if (c->ks) {
            c->pc.k_scale.data = c->ks + (size_t)c->layer * c->s_stride;
            c->pc.v_scale.data = c->vs + (size_t)c->layer * c->s_stride;
        }
    }
    c->st = kvc_decode_run(c->plan, &c->tq, &c->pc, &p, &c->tout, &c->tlse, c->pool);
    return c->st != KVC_OK;
}

static void free_case(att_case *c) {
    bench_free(c->k);
    bench_free(c->v);
    bench_free(c->ks);
    bench_free(c->vs);
    bench_free(c->q);
    bench_free(c->out);
    free(c->lse);
    free(c->indptr);
    free(c->indices);
    free(c->last);
    free(c->seqs);
    bench_free(c->tails);
    free(c->qseq);
    free(c->qpos);
    kvc_decode_plan_destroy(c->plan);
    memset(c, 0, sizeof *c);
}

static size_t round_page(size_t n) { return (n + 4095) & ~(size_t)4095; }

/* Bytes of one layer's K (or V) rows and of its K (or V) scales, page-rounded
 * as allocated: the stride between layers. */
static void layer_bytes(att_shape s, int64_t B, int64_t L, kvc_dtype dt, int64_t group,
                        size_t *kv, size_t *sc) {
    const int64_t slots = B * ((L + ATT_PAGE - 1) / ATT_PAGE) * ATT_PAGE;
    *kv = round_page((size_t)(slots * s.H * s.D * kvc_dtype_bits(dt) / 8));
    *sc = dt != KVC_F16 ? round_page((size_t)(slots * s.H * (s.D / group)) * 2) : 0;
}

static int setup(att_case *c, att_shape s, int64_t B, int64_t L, kvc_dtype dt, const char *name,
                 int64_t group, int64_t layers, kvc_kv_layout layout) {
    memset(c, 0, sizeof *c);
    c->s = s;
    c->B = B;
    c->L = L;
    c->dt = dt;
    c->name = name;
    const int quant = dt != KVC_F16;
    const int64_t pages = (L + ATT_PAGE - 1) / ATT_PAGE, P = B * pages;
    const int64_t row = s.H * s.D, slots = P * ATT_PAGE;
    const size_t kvb = (size_t)(slots * row * kvc_dtype_bits(dt) / 8);
    const size_t sb = quant ? (size_t)(slots * s.H * (s.D / group)) * 2 : 0;
    layer_bytes(s, B, L, dt, group, &c->kv_stride, &c->s_stride);
    c->layers = layers;
    c->k = bench_alloc(c->kv_stride * (size_t)layers);
    c->v = bench_alloc(c->kv_stride * (size_t)layers);
    if (quant) {
        c->ks = bench_alloc(c->s_stride * (size_t)layers);
        c->vs = bench_alloc(c->s_stride * (size_t)layers);
    }
    c->q = bench_alloc((size_t)(B * s.Hq * s.D) * 2);
    c->out = bench_alloc((size_t)(B * s.Hq * s.D) * 2);
    c->lse = calloc((size_t)(B * s.Hq), sizeof(float));
    c->indptr = calloc((size_t)B + 1, 4);
    c->indices = calloc((size_t)P, 4);
    c->last = calloc((size_t)B, 4);
    if (!c->k || !c->v || (quant && (!c->ks || !c->vs)) || !c->q || !c->out || !c->lse ||
        !c->indptr || !c->indices || !c->last) {
        fprintf(stderr, "kvcache: bench attention: out of memory\n");
        free_case(c);
        return -1;
    }
    /* contents: f16 in +-[0.25, 4); int bytes random; scales 1/64 */
    if (dt == KVC_F16) {
        uint16_t *k16 = (uint16_t *)(void *)c->k, *v16 = (uint16_t *)(void *)c->v;
        for (size_t i = 0; i < kvb / 2; i++) {
            uint64_t r = bench_mix64(i);
            k16[i] = (uint16_t)((r & 0x8000u) | ((13u + ((r >> 10) & 3u)) << 10) | (r & 0x3ffu));
            r >>= 16;
            v16[i] = (uint16_t)((r & 0x8000u) | ((13u + ((r >> 10) & 3u)) << 10) | (r & 0x3ffu));
        }
    } else {
        for (size_t i = 0; i < kvb; i++) {
            uint64_t r = bench_mix64(i);
            c->k[i] = (unsigned char)r;
            c->v[i] = (unsigned char)(r >> 8);
        }
        uint16_t one64 = kvc_f32_to_f16(1.0f / 64.0f);
        for (size_t i = 0; i < sb / 2; i++) {
            ((uint16_t *)(void *)c->ks)[i] = one64;
            ((uint16_t *)(void *)c->vs)[i] = one64;
        }
    }
    for (int64_t l = 1; l < layers; l++) {
        memcpy(c->k + (size_t)l * c->kv_stride, c->k, kvb);
        memcpy(c->v + (size_t)l * c->kv_stride, c->v, kvb);
        if (quant) {
            memcpy(c->ks + (size_t)l * c->s_stride, c->ks, sb);
            memcpy(c->vs + (size_t)l * c->s_stride, c->vs, sb);
        }
    }
    for (int64_t i = 0; i < B * s.Hq * s.D; i++)
        c->q[i] = kvc_f32_to_f16((float)((double)(bench_mix64((uint64_t)i + 99) >> 11) * 0x1p-53 - 0.5));
    for (int64_t i = 0; i < P; i++) c->indices[i] = (int32_t)i;
    uint64_t r = 12345;
    for (int64_t i = P - 1; i > 0; i--) {
        r = bench_mix64(r);
        int64_t j = (int64_t)(r % (uint64_t)(i + 1));
        int32_t t = c->indices[i];
        c->indices[i] = c->indices[j];
        c->indices[j] = t;
    }
    for (int64_t b = 0; b < B; b++) {
        c->indptr[b + 1] = (int32_t)((b + 1) * pages);
        c->last[b] = (int32_t)(L - (pages - 1) * ATT_PAGE);
    }
    /* NHD pages [P][page][H][Dh], HND [P][H][page][Dh] (scales alike, Dh/group) */
    const int hnd = layout == KVC_HND;
    int64_t csh[4] = {P, hnd ? s.H : ATT_PAGE, hnd ? ATT_PAGE : s.H, s.D};
    int64_t ssh[4] = {P, csh[1], csh[2], s.D / group};
    c->pc.k = kvc_tensor_make(c->k, dt, 4, csh);
    c->pc.v = kvc_tensor_make(c->v, dt, 4, csh);
    if (quant) {
        c->pc.k_scale = kvc_tensor_make(c->ks, KVC_F16, 4, ssh);
        c->pc.v_scale = kvc_tensor_make(c->vs, KVC_F16, 4, ssh);
    }
    c->pc.layout = layout;
    c->pc.quant_group = (int32_t)group;
    int64_t qsh[3] = {B, s.Hq, s.D}, lsh[2] = {B, s.Hq}, nb = B, nb1 = B + 1, np = P;
    c->tq = kvc_tensor_make(c->q, KVC_F16, 3, qsh);
    c->tout = kvc_tensor_make(c->out, KVC_F16, 3, qsh);
    c->tlse = kvc_tensor_make(c->lse, KVC_F32, 2, lsh);
    c->tindptr = kvc_tensor_make(c->indptr, KVC_I32, 1, &nb1);
    c->tindices = kvc_tensor_make(c->indices, KVC_I32, 1, &np);
    c->tlast = kvc_tensor_make(c->last, KVC_I32, 1, &nb);
    /* bytes the step must read: B * L tokens of K and V rows (+ scales) */
    double per_tok = (double)row * kvc_dtype_bits(dt) / 8.0;
    if (quant) per_tok += (double)(s.H * (s.D / group)) * 2.0;
    c->kv_bytes = 2.0 * per_tok * (double)(B * L);
    c->lane_ops = (double)(B * L) * (2.0 * (double)(s.Hq * s.D) + 2.0 * (double)(s.H * s.D));
    return 0;
}

/* Bytes of one layer's kivi pages (page-rounded): the stride between layers. */
static size_t kivi_layer_bytes(const kvc_kvfmt *f, int64_t B, int64_t L) {
    return round_page((size_t)(B * ((L + ATT_PAGE - 1) / ATT_PAGE)) * kvc_kvfmt_page_bytes(f));
}

/* A kivi8/kivi4 case: B sequences of L tokens appended (random K/V) to
 * layer 0's pages, copied to the other layers; one query per sequence at
 * position L - 1. */
static int setup_kivi(att_case *c, att_shape s, int64_t B, int64_t L, kvc_kv_format id,
                      const char *name, int64_t layers, kvc_threadpool *fill_pool) {
    memset(c, 0, sizeof *c);
    c->s = s;
    c->B = B;
    c->L = L;
    c->dt = KVC_U8;
    c->name = name;
    if (kvc_kvfmt_make(id, (int32_t)s.H, (int32_t)s.D, ATT_PAGE, &c->fmt) != KVC_OK) {
        fprintf(stderr, "kvcache: bench attention: %s\n", kvc_last_error());
        return -1;
    }
    const kvc_kvfmt *f = &c->fmt;
    const int64_t pages = (L + ATT_PAGE - 1) / ATT_PAGE, P = B * pages;
    /* each sequence's tail, then its sink rows (kivi4: position 0) */
    const size_t pb = kvc_kvfmt_page_bytes(f), tb = kvc_kvfmt_tail_bytes(f) + kvc_kvfmt_sink_bytes(f);
    c->kv_stride = kivi_layer_bytes(f, B, L);
    c->layers = layers;
    c->k = bench_alloc(c->kv_stride * (size_t)layers);
    c->tails = bench_alloc(tb * (size_t)B);
    c->q = bench_alloc((size_t)(B * s.Hq * s.D) * 4);
    c->out = bench_alloc((size_t)(B * s.Hq * s.D) * 4);
    c->indices = calloc((size_t)P, 4);
    c->seqs = calloc((size_t)B, sizeof *c->seqs);
    c->qseq = calloc((size_t)B, 4);
    c->qpos = calloc((size_t)B, 4);
    const int64_t CH = 1024, row = s.H * s.D;
    float *kx = malloc((size_t)(CH * row) * 4), *vx = malloc((size_t)(CH * row) * 4);
    float *off = malloc((size_t)row * 4), *spr = malloc((size_t)row * 4);
    if (!c->k || !c->tails || !c->q || !c->out || !c->indices || !c->seqs || !c->qseq ||
        !c->qpos || !kx || !vx || !off || !spr) {
        fprintf(stderr, "kvcache: bench attention: out of memory\n");
        free(kx), free(vx), free(off), free(spr);
        free_case(c);
        return -1;
    }
    for (int64_t i = 0; i < P; i++) c->indices[i] = (int32_t)i;
    uint64_t r = 12345;
    for (int64_t i = P - 1; i > 0; i--) {
        r = bench_mix64(r);
        int64_t j = (int64_t)(r % (uint64_t)(i + 1));
        int32_t t = c->indices[i];
        c->indices[i] = c->indices[j];
        c->indices[j] = t;
    }
    /* K channels: offset in [-4, 4), spread in [0.25, 2.25); V in [-2, 2) */
    for (int64_t e = 0; e < row; e++) {
        off[e] = (float)((double)(bench_mix64((uint64_t)e + 7) >> 11) * 0x1p-53 * 8.0 - 4.0);
        spr[e] = (float)((double)(bench_mix64((uint64_t)e + 77) >> 11) * 0x1p-53 * 2.0 + 0.25);
    }
    int64_t shp[2] = {P, (int64_t)pb};
    c->tpages = kvc_tensor_make(c->k, KVC_U8, 2, shp);
    int rc = 0;
    for (int64_t b = 0; b < B && rc == 0; b++) {
        kvc_kvfmt_seq *sq = &c->seqs[b];
        sq->pages = c->indices + b * pages;
        sq->tail = (uint16_t *)(void *)((unsigned char *)c->tails + (size_t)b * tb);
        sq->sink = f->sink ? (uint16_t *)(void *)((unsigned char *)sq->tail + kvc_kvfmt_tail_bytes(f))
                           : NULL;
        for (int64_t t0 = 0; t0 < L && rc == 0; t0 += CH) {
            const int64_t n = L - t0 < CH ? L - t0 : CH;
            for (int64_t i = 0; i < n * row; i++) {
                const uint64_t h = bench_mix64((uint64_t)((b * L + t0) * row + i) * 2 + 1);
                const double u1 = (double)(h >> 40) * 0x1p-24, u2 = (double)(h & 0xffffff) * 0x1p-24;
                kx[i] = off[i % row] + spr[i % row] * (float)(u1 - 0.5);
                vx[i] = (float)(u2 * 4.0 - 2.0);
            }
            sq->n_kv = t0 + n;
            int64_t ip[2] = {0, n}, ksh[3] = {n, s.H, s.D};
            kvc_tensor tk = kvc_tensor_make(kx, KVC_F32, 3, ksh);
            kvc_tensor tv = kvc_tensor_make(vx, KVC_F32, 3, ksh);
            if (kvc_kvfmt_append(f, &c->tpages, sq, 1, ip, &tk, &tv, fill_pool) != KVC_OK) rc = -1;
        }
        c->qseq[b] = (int32_t)b;
        c->qpos[b] = (int32_t)(L - 1);
    }
    free(kx), free(vx), free(off), free(spr);
    if (rc != 0) {
        fprintf(stderr, "kvcache: bench attention: %s\n", kvc_last_error());
        free_case(c);
        return -1;
    }
    for (int64_t l = 1; l < layers; l++)
        memcpy(c->k + (size_t)l * c->kv_stride, c->k, (size_t)P * pb);
    float *q32 = (float *)(void *)c->q;
    for (int64_t i = 0; i < B * s.Hq * s.D; i++)
        q32[i] = (float)((double)(bench_mix64((uint64_t)i + 99) >> 11) * 0x1p-53 - 0.5);
    int64_t qsh[3] = {B, s.Hq, s.D};
    c->tq = kvc_tensor_make(c->q, KVC_F32, 3, qsh);
    c->tout = kvc_tensor_make(c->out, KVC_F32, 3, qsh);
    /* bytes the step must read: B * L tokens of pages (codes and parameters) */
    c->kv_bytes = (double)pb / ATT_PAGE * (double)(B * L);
    c->lane_ops = (double)(B * L) * (2.0 * (double)(s.Hq * s.D) + 2.0 * (double)(s.H * s.D));
    return 0;
}

/* ---- FMA peak ---------------------------------------------------------------- */

/* Operator, the plain-read reference and the FMA peak, interleaved in rounds;
 * with pair (the float16 case of the same step, its plan and pool set), that
 * operator too, its timing in pair_tm. 1: the operator failed, 2: pair. */
static int time_with_read(att_case *c, double op_s, bench_membw_ctx *mb, double ref_s, int nt,
                          att_case *pair, bench_timing *op, bench_timing *pair_tm,
                          double *read_gbs, double *fma_per_s) {
    static bench_timer t_op, t_pair, t_rd, t_fma;
    static bench_fma fc;
    const size_t bytes = bench_membw_prepare(mb, nt, 1);
    bench_fma_prepare(&fc, nt);
    if (bench_timer_start(&t_op, att_call, c, op_s / 16.0) != 0) return 1;
    if (pair && bench_timer_start(&t_pair, att_call, pair, op_s / 16.0) != 0) return 2;
    if (bench_timer_start(&t_rd, bench_membw_pass, mb, ref_s / 8.0) != 0) return -1;
    if (bench_timer_start(&t_fma, bench_fma_pass, &fc, ref_s / 8.0) != 0) return -1;
    for (int round = 0; round < 4; round++) {
        if (bench_timer_run(&t_rd, ref_s / 4, 1) != 0) return -1;
        if (bench_timer_run(&t_fma, ref_s / 8, 1) != 0) return -1;
        if (bench_timer_run(&t_op, op_s / 4, 2) != 0) return 1;
        if (pair && bench_timer_run(&t_pair, op_s / 4, 2) != 0) return 2;
    }
    bench_timing rd, fm;
    bench_timer_result(&t_op, op);
    if (pair) bench_timer_result(&t_pair, pair_tm);
    bench_timer_result(&t_rd, &rd);
    bench_timer_result(&t_fma, &fm);
    *read_gbs = (double)bytes / rd.median_s * 1e-9;
    *fma_per_s = fc.flops / 2.0 / fm.median_s; /* lane FMAs per second */
    return 0;
}

/* What the cases of one run share, and their tallies. */
typedef struct att_run {
    const bench_opts *o;
    bench_membw_ctx *mb;
    double ref_budget;
    int64_t group, want_layers;
    int cases, failed, skipped, goals, goals_met;
} att_run;

/* Per-thread-count plan and pool of a case (the pool NULL when it fails). */
static int case_open(att_case *c, int nt) {
    if ((c->fmt.id == KVC_KVFMT_NONE &&
         kvc_decode_plan_create(&c->tindptr, &c->tindices, &c->tlast, (int32_t)c->s.Hq,
                                (int32_t)c->s.H, (int32_t)c->s.D, ATT_PAGE, nt,
                                &c->plan) != KVC_OK) ||
        kvc_threadpool_create(nt, &c->pool) != KVC_OK) {
        fprintf(stderr, "kvcache: bench attention: %s\n", kvc_last_error());
        kvc_decode_plan_destroy(c->plan);
        c->plan = NULL;
        return -1;
    }
    return 0;
}

static void case_close(att_case *c) {
    kvc_threadpool_destroy(c->pool);
    c->pool = NULL;
    kvc_decode_plan_destroy(c->plan);
    c->plan = NULL;
}

/* Bytes of one layer of a case (K and V, scales or format parameters), in
 * double first: the largest --batch, --kvlen and --heads overflow size_t (a
 * wrapped size could even be 0, a divisor below); 0 for a shape the format
 * refuses (run_case says why). */
static double att_need(att_shape s, int64_t B, int64_t L, kvc_dtype dt, kvc_kv_format fmt,
                       int64_t group) {
    const double slots = (double)B * (double)((L + ATT_PAGE - 1) / ATT_PAGE) * ATT_PAGE;
    if (fmt != KVC_KVFMT_NONE) {
        kvc_kvfmt f;
        if (kvc_kvfmt_make(fmt, (int32_t)s.H, (int32_t)s.D, ATT_PAGE, &f) != KVC_OK) return 0;
        return slots / ATT_PAGE * (double)kvc_kvfmt_page_bytes(&f);
    }
    return 2 * slots * (double)(s.H * s.D) * kvc_dtype_bits(dt) / 8 +
           (dt != KVC_F16 ? 2 * slots * (double)(s.H * (s.D / group)) * 2 : 0);
}

/* Times one cache (every thread count of the run) and prints its rows.
 * pair: the float16 case of the same shape, batch, kv and layout (NULL if
 * none), timed beside it for the speed ratio. keep (float16 only): the
 * case is handed to the caller instead of freed (zeroed if it could not be
 * set up or was skipped). -1 if setup fails. */
static int run_case(att_run *r, att_shape s, int64_t B, int64_t L, kvc_kv_layout layout,
                    kvc_dtype dt, kvc_kv_format fmt, const char *name, att_case *pair,
                    att_case *keep) {
    if (keep) memset(keep, 0, sizeof *keep);
    const bench_opts *o = r->o;
    const size_t limit = bench_mem_limit(o);
    const double need_d = att_need(s, B, L, dt, fmt, r->group);
    size_t need = 0;
    const int kivi = fmt != KVC_KVFMT_NONE;
    if (kivi) {
        kvc_kvfmt f;
        if (kvc_kvfmt_make(fmt, (int32_t)s.H, (int32_t)s.D, ATT_PAGE, &f) != KVC_OK) {
            fprintf(stderr, "kvcache: bench attention: %s\n", kvc_last_error());
            return -1;
        }
        if (need_d <= limit) need = kivi_layer_bytes(&f, B, L);
    } else if (need_d <= limit) {
        size_t kvl, scl;
        layer_bytes(s, B, L, dt, r->group, &kvl, &scl);
        need = 2 * (kvl + scl);
    }
    /* bench_attention refused options past the limit; an exact size a few
     * bytes over the estimate is still said and counted, not left out */
    if (need_d > limit || need > limit) {
        fprintf(stderr, "kvcache: bench attention: %s B %lld kv %lld skipped: one layer needs "
                "%.1f GiB, over the %.0f GiB limit\n", name, (long long)B, (long long)L,
                (need_d > (double)need ? need_d : (double)need) / (1 << 30),
                (double)limit / (1 << 30));
        r->skipped += o->n_thread_counts;
        return 0;
    }
    int64_t layers = (int64_t)(limit / need); /* as many as fit, at most asked */
    if (layers > r->want_layers) layers = r->want_layers;
    const char *lay = layout == KVC_HND ? "HND" : "NHD";
    att_case c;
    if (kivi) {
        if (o->soft_cap > 0) { /* not supported over compressed formats */
            r->skipped += o->n_thread_counts;
            return 0;
        }
        kvc_threadpool *fill = NULL;
        if (kvc_threadpool_create(o->threads[o->n_thread_counts - 1], &fill) != KVC_OK ||
            setup_kivi(&c, s, B, L, fmt, name, layers, fill) != 0) {
            kvc_threadpool_destroy(fill);
            return -1;
        }
        kvc_threadpool_destroy(fill);
    } else if (setup(&c, s, B, L, dt, name, r->group, layers, layout) != 0)
        return -1;
    c.soft_cap = (float)o->soft_cap;
    for (int ti = 0; ti < o->n_thread_counts; ti++) {
        const int nt = o->threads[ti];
        r->cases++;
        att_case *pr = pair && pair->k ? pair : NULL;
        if (case_open(&c, nt) != 0 || (pr && case_open(pr, nt) != 0)) {
            case_close(&c);
            r->failed++;
            continue;
        }
        bench_timing tm, ptm;
        double rd = 0, fps = 0;
        const size_t n_out = (size_t)(c.B * s.Hq * s.D);
        const int odt = kivi ? KVC_F32 : KVC_F16;
        const size_t osz = kivi ? 4 : 2;
        bench_poison(c.out, n_out * osz);
        int rc = time_with_read(&c, o->time_s, r->mb, r->ref_budget, nt, pr, &tm, &ptm, &rd, &fps);
        case_close(&c);
        if (pr) case_close(pr);
        if (rc != 0) {
            if (rc > 0) fprintf(stderr, "kvcache: bench attention: %s\n", kvc_last_error());
            r->failed++;
            continue;
        }
        if (!bench_output_finite(c.out, n_out, odt)) {
            fprintf(stderr, "kvcache: bench attention: %s %s B %lld kv %lld: output not written "
                    "(or not finite)\n", c.name, lay, (long long)B, (long long)L);
            r->failed++;
            continue;
        }
        bench_sink(bench_checksum(0, c.out, n_out * osz));
        const double us = tm.median_s * 1e6;
        const double gbs = c.kv_bytes / tm.median_s * 1e-9, ratio = gbs / rd;
        const double fma_ratio = c.lane_ops / fps / tm.median_s;
        double speed = 0, f16_us = pr ? ptm.median_s * 1e6 : 0;
        const char *goal = "";
        int met = -1;
        if (c.dt == KVC_F16) {
            if (L >= 4096) {
                met = ratio >= 0.7;
                goal = ">=0.7";
            }
        } else if (f16_us > 0) {
            speed = f16_us / us;
            if (c.dt == KVC_I8) {
                met = speed >= 1.6;
                goal = ">=1.6x";
            } else if (kivi) {
                met = speed >= 1.3;
                goal = ">=1.3x";
            }
        }
        if (met >= 0) r->goals++, r->goals_met += met;
        if (o->json) {
            printf("{\"type\":\"case\",\"target\":\"attention\",\"hq\":%lld,"
                   "\"h\":%lld,\"head_dim\":%lld,\"layout\":\"%s\",\"cache\":\"%s\","
                   "\"quant_group\":%lld,\"soft_cap\":%g,\"batch\":%lld,\"kv\":%lld,"
                   "\"layers\":%lld,"
                   "\"threads\":%d,\"isa\":\"%s\",\"us_per_layer\":"
                   "%.3f,\"us_min\":%.3f,\"bytes\":%.0f,\"gbs\":%.3f,"
                   "\"read_gbs\":%.3f,\"ratio\":%.4f,\"fma_gfmas\":%.2f,"
                   "\"lane_ops\":%.0f,\"fma_ratio\":%.4f,"
                   "\"f16_us_paired\":%.3f,\"speedup_vs_f16\":%.3f,\"goal\":\"%s\","
                   "\"goal_met\":%s}\n",
                   (long long)s.Hq, (long long)s.H, (long long)s.D, lay, c.name,
                   (long long)r->group, o->soft_cap, (long long)c.B, (long long)c.L,
                   (long long)c.layers, nt,
                   kvc_isa_name(kvc_get_isa()), us, tm.min_s * 1e6, c.kv_bytes, gbs, rd, ratio,
                   fps * 1e-9, c.lane_ops, fma_ratio, f16_us, speed, goal,
                   met < 0 ? "null" : met ? "true" : "false");
        } else {
            char sh[32], sp[16] = "", ly[32] = "";
            snprintf(sh, sizeof sh, "%lld/%lld/%lld", (long long)s.Hq, (long long)s.H,
                     (long long)s.D);
            if (speed > 0) snprintf(sp, sizeof sp, "%.2fx", speed);
            if (c.layers < r->want_layers)
                snprintf(ly, sizeof ly, " (%lld layers)", (long long)c.layers);
            printf("%-9s %-3s %-5s %5lld %6lld %3d %10.1f %9.2f %8.2f %8.2f %6.3f %7.1f %6.3f "
                   "%7s %s%s%s\n",
                   sh, lay, c.name, (long long)c.B, (long long)c.L, nt, us, c.kv_bytes * 1e-6, gbs,
                   rd, ratio, fps * 1e-9, fma_ratio, sp, goal,
                   met < 0 ? "" : met ? " ok" : " MISSED", ly);
        }
        bench_flush("attention");
    }
    if (keep)
        *keep = c;
    else
        free_case(&c);
    return 0;
}

int bench_attention(const bench_opts *o) {
    static const att_shape shapes_full[2] = {{32, 8, 128}, {9, 3, 64}};
    static const int64_t lens_full[3] = {512, 4096, 16384}, batches_full[2] = {1, 16};
    static const int64_t lens_quick[1] = {300}, batches_quick[1] = {2};
    const struct {
        unsigned bit;
        const char *name;
        kvc_dtype dt;
        kvc_kv_format fmt;
    } cts[5] = {{BENCH_CACHE_F16, "f16", KVC_F16, KVC_KVFMT_NONE},
                {BENCH_CACHE_INT8, "int8", KVC_I8, KVC_KVFMT_NONE},
                {BENCH_CACHE_INT4, "int4", KVC_I4, KVC_KVFMT_NONE},
                {BENCH_CACHE_KIVI8, "kivi8", KVC_U8, KVC_KVFMT_KIVI8},
                {BENCH_CACHE_KIVI4, "kivi4", KVC_U8, KVC_KVFMT_KIVI4}};
    const unsigned caches = o->caches ? o->caches : BENCH_CACHE_ALL | BENCH_CACHE_KIVI;
    att_shape shapes[2];
    int n_shapes = 2;
    memcpy(shapes, shapes_full, sizeof shapes);
    if (o->heads || o->head_dim) {
        shapes[0].H = o->heads ? o->heads : 8;
        shapes[0].D = o->head_dim ? o->head_dim : 128;
        shapes[0].Hq = shapes[0].H * 4;
        n_shapes = 1;
    }
    const int64_t *lens = o->quick ? lens_quick : lens_full;
    const int64_t *batches = o->quick ? batches_quick : batches_full;
    int n_lens = o->quick ? 1 : 3, n_batches = o->quick ? 1 : 2;
    int64_t one_len = o->kvlen, one_batch = o->batch;
    if (one_len) lens = &one_len, n_lens = 1;
    if (one_batch) batches = &one_batch, n_batches = 1;
    /* quant group per shape: --group N, row (Dh), or ATT_GROUP */
    int64_t groups[2];
    for (int si = 0; si < n_shapes; si++)
        groups[si] = o->group == BENCH_GROUP_ROW ? shapes[si].D : o->group ? o->group : ATT_GROUP;
    const int64_t want_layers = o->layers ? o->layers : 1;
    const unsigned layouts = o->layouts ? o->layouts : 1u; /* bit 0 NHD, bit 1 HND */
    for (int si = 0; si < n_shapes; si++) {
        const int64_t D = shapes[si].D;
        if (D % groups[si] != 0 && (caches & (BENCH_CACHE_INT8 | BENCH_CACHE_INT4))) {
            fprintf(stderr, "kvcache: bench attention: head dim %lld is not a multiple of the "
                            "quant group %lld of int8/int4 caches\n",
                    (long long)D, (long long)groups[si]);
            return CLI_EXIT_USAGE;
        }
        /* kivi4 rotates V by a Hadamard transform (kvc_kvfmt_check): refused
         * here, before any case, rather than failing its cases */
        if ((D & (D - 1)) != 0 && (caches & BENCH_CACHE_KIVI4)) {
            fprintf(stderr, "kvcache: bench attention: kivi4 needs a power-of-two head dim, not "
                            "%lld (--cache without kivi4 for this one)\n", (long long)D);
            return CLI_EXIT_USAGE;
        }
    }
    /* every case's bytes before any runs: options past the limit are
     * refused, as every target does (they were skipped case by case, and a
     * 5 GiB case under the limit took minutes, --quick or not) */
    double need = 0;
    for (int si = 0; si < n_shapes; si++)
        for (int bi = 0; bi < n_batches; bi++)
            for (int li = 0; li < n_lens; li++)
                for (int ci = 0; ci < 5; ci++) {
                    if (!(caches & cts[ci].bit)) continue;
                    const double b = att_need(shapes[si], batches[bi], lens[li], cts[ci].dt,
                                              cts[ci].fmt, groups[si]);
                    if (b > need) need = b;
                }
    if (need > (double)bench_mem_limit(o))
        return bench_refuse_size(o, "attention", need, "--batch, --kvlen, --heads or --head-dim");
    char gdesc[64];
    if (o->group == BENCH_GROUP_ROW)
        snprintf(gdesc, sizeof gdesc, "one scale per head row (quant group Dh)");
    else
        snprintf(gdesc, sizeof gdesc, "quant group %d", (int)groups[0]);

    bench_print_machine(o, "attention", stdout);
    if (!o->json)
        printf("# kvc_decode_run, one layer per call: paged cache (lay), page_size %d (shuffled "
               "pages), float16 q/out, int8/int4 with %s and float16 scales; "
               "kivi8/kivi4: kvc_kvfmt_attention over kvfmt pages (same page_size, float32 q/out, "
               "no float16 tail when kv %% 64 == 0); "
               "%.2f s per case. read GB/s: plain vectorized read, same threads, interleaved; "
               "mem = read-bound time / time; GFMA/s: FMA-lane peak of the ISA, same threads, "
               "interleaved; fma = (2*Hq*Dh FMAs + 2*H*Dh conversions per token) / peak / time; "
               "vs f16: against the f16 case of the same step, timed in turn with it\n",
               ATT_PAGE, gdesc, o->time_s);
    if (!o->json && o->soft_cap > 0)
        printf("# logits_soft_cap %g on every call\n", o->soft_cap);
    if (!o->json && want_layers > 1)
        printf("# each call reads the next of %lld layers' caches (fewer where marked: %.0f "
               "MiB in all)\n",
               (long long)want_layers, (double)(bench_mem_limit(o) >> 20));
    bench_membw_ctx *mb = bench_membw_create(o->membw_bytes);
    if (!mb) return CLI_EXIT_FAIL;
    if (!o->json)
        printf("%-9s %-3s %-5s %5s %6s %3s %10s %9s %8s %8s %6s %7s %6s %7s\n", "shape", "lay",
               "cache", "batch", "kv", "thr", "us/layer", "MB read", "GB/s", "read", "mem",
               "GFMA/s", "fma", "vs f16");
    att_run run = {o, mb, o->quick ? 0.005 : 0.1, groups[0], want_layers, 0, 0, 0, 0, 0};
    for (int si = 0; si < n_shapes; si++) {
        run.group = groups[si];
        for (int bi = 0; bi < n_batches; bi++)
            for (int li = 0; li < n_lens; li++)
                for (int lo = 0; lo < 2; lo++) {
                    if (!(layouts & (1u << lo))) continue;
                    const int first_layout = !(layouts & ((1u << lo) - 1));
                    att_case f16; /* kept for the others' speed ratios */
                    memset(&f16, 0, sizeof f16);
                    for (int ci = 0; ci < 5; ci++) {
                        if (!(caches & cts[ci].bit)) continue;
                        /* kivi pages have one layout: run once, against the first */
                        if (cts[ci].fmt != KVC_KVFMT_NONE && !first_layout) continue;
                        const int is_f16 = cts[ci].dt == KVC_F16;
                        if (run_case(&run, shapes[si], batches[bi], lens[li],
                                     lo ? KVC_HND : KVC_NHD, cts[ci].dt, cts[ci].fmt,
                                     cts[ci].name, is_f16 ? NULL : &f16,
                                     is_f16 ? &f16 : NULL) != 0) {
                            free_case(&f16);
                            bench_membw_destroy(mb);
                            return CLI_EXIT_FAIL;
                        }
                    }
                    free_case(&f16);
                }
    }
    bench_membw_destroy(mb);
    if (o->json)
        printf("{\"type\":\"summary\",\"cases\":%d,\"failed\":%d,\"skipped\":%d,"
               "\"goals\":%d,\"goals_met\":%d}\n",
               run.cases, run.failed, run.skipped, run.goals, run.goals_met);
    else
        printf("# %d cases, %d failed, %d skipped (memory); goals (f16 >= 0.7 of read at kv >= "
               "4096, int8 >= 1.6x f16, kivi8/kivi4 >= 1.3x f16) met %d of %d\n",
               run.cases, run.failed, run.skipped, run.goals_met, run.goals);
    /* nothing measured (every case over the memory limit) is not a success */
    return run.failed || (run.cases == 0 && run.skipped > 0) ? CLI_EXIT_FAIL : CLI_EXIT_OK;
}
