/*
 * Decode attention (attention.h, SEMANTICS section 5): one query token per
 * request over a contiguous (single) or paged KV cache.
 *
 * Work is split into tasks (request, chunk of chunk_len(L) key positions),
 * all heads. A task converts the query heads to float32 (pre-scaled so the
 * softmax runs in base 2), walks its chunk's keys in blocks inside one page
 * and hands each block, head by head, to the kernel table's attn_decode,
 * which reads K/V in place (dequantizing on the fly) and carries an
 * online-softmax state (max, sum, accumulators). On the amx ISA,
 * int8/int4 caches the tile kernel takes go through chunk_amx instead (same
 * tasks, calls of 64 keys). A request with one chunk writes its output
 * directly; longer ones write partial states that a second pass merges by
 * log-sum-exp in chunk order. Chunks are fixed positions, so the output does
 * not depend on n_threads.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/attention.h"
#include "attn_check.h"
#include "attn_state.h"
#include "../core/internal.h"
#include "../kernels/kernels.h"
#include "../paged/paged_internal.h"

/*
 * Key positions per task for a request of L keys: about L / 8, 256 to 1024,
 * a function of L alone (never of n_threads or the rest of the batch, so a
 * request gives the same bits alone, batched, on any thread count). Longer
 * chunks pay the per-task costs (q conversion, state set-up, the chunk's
 * first block read without a prefetch, the merge) less often: from 256 to
 * 512-1024 keys, B 16 x 4096-16384 float16 decode ran 10-25% faster.
 */
static int64_t chunk_len(int64_t L) {
    int64_t c = 256;
    while (c < 1024 && c * 8 < L) c *= 2;
    return c;
}

/* ---- shared engine -------------------------------------------------------- */

/* Strides (elements) of one K/V-like tensor: page (0 for single), token, head. */
typedef struct attn_view {
    const char *data;
    kvc_dtype dt;
    int64_t page_st, tok_st, head_st;
} attn_view;

typedef struct attn_ctx {
    int64_t B, Hq, H, G, D, Dp;
    attn_view k, v, ks, vs;
    int quant, group;
    /* pages: request b's page j is indices[indptr[b] + j]; single: one page */
    const int32_t *indptr, *indices;
    int64_t page_size;
    const int64_t *len;    /* (B) tokens per request */
    const int64_t *nch;    /* (B) chunks per request (>= 1) */
    const int64_t *task0;  /* (B + 1) first task of request b (one task per chunk) */
    const int64_t *part0;  /* (B) float offset of request b's partials (multi-chunk) */
    float *part;           /* partial states: [chunk][head] x (D + 2): m, l, acc */
    /* q (B, Hq, D), out (B, Hq, D), lse (B, Hq): strides in elements */
    const char *q;
    kvc_dtype qd;
    int64_t q_sb, q_sh;
    char *out;
    kvc_dtype od;
    int64_t o_sb, o_sh;
    float *lse;
    int64_t l_sb, l_sh;
    float qscale, cap, sc; /* q multiplier, soft cap, scores to base 2 (kernels.h) */
    int32_t window;
    const float *sinks; /* (Hq) or NULL */
    const kvc_kernels *kern;
    int amx; /* int8/int4 cache the kernel table's AMX decode takes (chunk_amx) */
} attn_ctx;

/* Final output of query head hq of request b from a state (m, l, acc): the
 * scaled row in float32, then one vector conversion to out's dtype (the
 * kernels' convert rounds exactly like the scalar kvc_f32_to_*). */
static void finish_head(const attn_ctx *c, int64_t b, int64_t hq, float m, float l,
                        const float *acc) {
    char *o = c->out + kvc__bytes(c->od, b * c->o_sb + hq * c->o_sh);
    const int empty = !(l > 0.0f);
    float lse;
    const float inv = kvc__attn_finish(m, l, kvc__attn_sink2(c->sinks, hq), &lse);
    float t[KVC_ATTN_MAX_DIM];
    for (int64_t d = 0; d < c->D; d++) t[d] = empty ? 0.0f : acc[d] * inv;
    c->kern->convert(t, KVC_F32, o, c->od, c->D);
    if (c->lse) c->lse[b * c->l_sb + hq * c->l_sh] = lse;
}

/* First visible key of request b (window_left). */
static int64_t first_key(const attn_ctx *c, int64_t b) {
    int64_t L = c->len[b];
    if (c->window < 0 || L - 1 - c->window <= 0) return 0;
    return L - 1 - c->window;
}

/* Request of task t: the last b with task0[b] <= t. */
static int64_t task_request(const attn_ctx *c, int64_t t) {
    int64_t lo = 0, hi = c->B - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (c->task0[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static const char *view_at(const attn_view *v, int64_t page, int64_t slot, int64_t h) {
    return v->data + kvc__bytes(v->dt, page * v->page_st + slot * v->tok_st + h * v->head_st);
}

/* Fills rows with the run of n keys at slot `slot` of `page`, KV head h. */
static void run_rows(const attn_ctx *c, int64_t page, int64_t slot, int64_t h,
                     kvc_attn_rows *rows) {
    rows->k = view_at(&c->k, page, slot, h);
    rows->v = view_at(&c->v, page, slot, h);
    rows->k_stride = kvc__bytes(c->k.dt, c->k.tok_st);
    rows->v_stride = kvc__bytes(c->v.dt, c->v.tok_st);
    rows->dt = c->k.dt;
    rows->group = c->group;
    if (c->quant) {
        rows->ks = view_at(&c->ks, page, slot, h);
        rows->vs = view_at(&c->vs, page, slot, h);
        rows->ks_stride = kvc__bytes(c->ks.dt, c->ks.tok_st);
        rows->vs_stride = kvc__bytes(c->vs.dt, c->vs.tok_st);
        rows->ksd = c->ks.dt;
        rows->vsd = c->vs.dt;
    } else {
        rows->ks = rows->vs = NULL;
        rows->ks_stride = rows->vs_stride = 0;
        rows->ksd = rows->vsd = KVC_F32;
    }
    rows->nk = rows->nv = rows->nks = rows->nvs = NULL;
    rows->nn = 0;
}

/*
 * The next block's rows (n keys at page/slot, KV head h), which the SIMD
 * kernel prefetches into L2 a quad of keys at a time while it scores this
 * block. Measured on Zen 4 (Hq 32, H 8, Dh 128, float16, B 16, kv 4096,
 * 1 thread): one burst of prefetcht1 for the whole next block per kernel
 * call, issued here, stalled the core once the miss queue filled (~8 GB/s,
 * 30-34 ms); spread through the kernel 9.5-10 GB/s (23-28 ms); prefetching
 * two blocks ahead was slower again. T0 prefetches (into L1) hold L1 miss
 * buffers and ran no faster than none (~5.5 GB/s).
 */
static void next_rows(const attn_ctx *c, int64_t page, int64_t slot, int64_t h, int64_t n,
                      kvc_attn_rows *rows) {
    if (n <= 0) return;
    rows->nk = view_at(&c->k, page, slot, h);
    rows->nv = view_at(&c->v, page, slot, h);
    if (c->quant) {
        rows->nks = view_at(&c->ks, page, slot, h);
        rows->nvs = view_at(&c->vs, page, slot, h);
    }
    rows->nn = n;
}

/* Prefetches (into L1) KV head h's K/V rows (and scales) of keys [j, j + n)
 * of request b, one request per cache line: a chunk's first block, which is
 * needed at once (later blocks are prefetched by the kernel, next_rows). */
static void prefetch_first(const attn_ctx *c, int64_t b, int64_t j, int64_t n, int64_t h) {
    if (n <= 0) return;
    const int64_t page = c->indices ? c->indices[c->indptr[b] + j / c->page_size] : 0;
    const int64_t slot = j % c->page_size;
    const attn_view *views[4] = {&c->k, &c->v, &c->ks, &c->vs};
    const int64_t nv = c->quant ? 4 : 2;
    for (int64_t vi = 0; vi < nv; vi++) {
        const attn_view *w = views[vi];
        const int64_t row = kvc__bytes(w->dt, vi < 2 ? c->D : c->D / c->group);
        const int64_t step = kvc__bytes(w->dt, w->tok_st);
        const char *p0 = view_at(w, page, slot, h);
        for (int64_t i = 0; i < n; i++) {
            const uintptr_t a0 = (uintptr_t)(p0 + i * step), end = a0 + (uintptr_t)row;
            for (uintptr_t a = a0 & ~(uintptr_t)63; a < end; a += 64)
                __builtin_prefetch((const void *)a, 0, 3);
        }
    }
}

/* A task's result for query head hq of request b: the output row when the
 * request is one chunk, else the chunk's partial state (merge_task). */
static void task_head_done(const attn_ctx *c, int64_t b, int64_t ch, int64_t nch, int64_t hq,
                           float m, float l, const float *acc) {
    if (nch == 1) {
        finish_head(c, b, hq, m, l, acc);
        return;
    }
    float *pp = c->part + c->part0[b] + (ch * c->Hq + hq) * (c->D + 2);
    pp[0] = m;
    pp[1] = l;
    memcpy(pp + 2, acc, (size_t)c->D * sizeof(float));
}

/* Query head hq of request b as the kernels take it: float32 (times
 * sm_scale under a soft cap), zeros in [D, Dp). */
static void load_q(const attn_ctx *c, int64_t b, int64_t hq, float *dst) {
    const char *qr = c->q + kvc__bytes(c->qd, b * c->q_sb + hq * c->q_sh);
    c->kern->convert(qr, c->qd, dst, KVC_F32, c->D); /* exact widening */
    if (c->qscale != 1.0f)
        for (int64_t d = 0; d < c->D; d++) dst[d] *= c->qscale;
    for (int64_t d = c->D; d < c->Dp; d++) dst[d] = 0.0f;
}

/* ---- AMX path (int8/int4 caches on the tile unit, kernels.h amx_*) ---------- */

/* Stack bytes for AMX head-set states; more sets than fit go in batches. */
#define AMX_ARENA 65536

/* Runs (kvc_amx_keys) of positions [j, j1) of request b, KV head h: one
 * run per page piece, at most KVC_AMX_KEYS keys. */
static int amx_runs(const attn_ctx *c, int64_t b, int64_t h, int64_t j, int64_t j1,
                    kvc_amx_run *run) {
    int nr = 0;
    while (j < j1) {
        const int64_t pj = j / c->page_size, slot = j % c->page_size;
        int64_t n = c->page_size - slot;
        if (n > j1 - j) n = j1 - j;
        const int64_t page = c->indices ? c->indices[c->indptr[b] + pj] : 0;
        run[nr].k = view_at(&c->k, page, slot, h);
        run[nr].v = view_at(&c->v, page, slot, h);
        run[nr].ks = view_at(&c->ks, page, slot, h);
        run[nr].vs = view_at(&c->vs, page, slot, h);
        run[nr].n = (int)n;
        nr++;
        j += n;
    }
    return nr;
}

/* Runs of KV head h + 1 over the keys of `run` (KV head h): the same pages
 * and slots, one head stride further in each tensor. */
static void amx_runs_next_head(const attn_ctx *c, const kvc_amx_run *run, int nr,
                               kvc_amx_run *out) {
    const int64_t dk = kvc__bytes(c->k.dt, c->k.head_st), dv = kvc__bytes(c->v.dt, c->v.head_st);
    const int64_t dks = kvc__bytes(c->ks.dt, c->ks.head_st),
                  dvs = kvc__bytes(c->vs.dt, c->vs.head_st);
    for (int r = 0; r < nr; r++) {
        out[r].k = (const char *)run[r].k + dk;
        out[r].v = (const char *)run[r].v + dv;
        out[r].ks = (const char *)run[r].ks + dks;
        out[r].vs = (const char *)run[r].vs + dvs;
        out[r].n = run[r].n;
    }
}

/*
 * chunk_task for caches the AMX decode takes: head sets of up to 4 query
 * heads of one KV head, each with its state (q as tile digits, m, l, acc)
 * in a stack arena; keys in calls of KVC_AMX_KEYS from the chunk's first
 * key (a function of the request alone, like the chunks), every head set
 * consuming a call's keys before the next call, so each token row is
 * streamed once. Each call gets the rows of the call after it (the next KV
 * head's, or the next keys' first head's) to prefetch: prefetching the same
 * head's next keys instead, 8 calls ahead, measured 4% (B 1) to 18% (B 16,
 * kv 4096, H 8) slower. int4 NHD caches prefetch whole token rows of the
 * next keys instead (rows_ok below).
 * Not inlined into chunk_task: the two paths' stack arrays stay apart.
 */
static __attribute__((noinline)) void chunk_amx(const attn_ctx *c, int64_t b, int64_t ch,
                                                int64_t nch, int64_t j0, int64_t j1) {
    const kvc_kernels *kk = c->kern;
    const int64_t D = c->D, Dp = c->Dp, G = c->G;
    const int64_t sets = (G + 3) / 4, nslots = c->H * sets;
    const size_t sb = (kk->amx_state_bytes((int)D, c->group) + 63) & ~(size_t)63;
    const int64_t per = (int64_t)(AMX_ARENA / sb) > 0 ? (int64_t)(AMX_ARENA / sb) : 1;
    unsigned char arena[AMX_ARENA] __attribute__((aligned(64)));
    float q[4 * KVC_AMX_MAX_DIM] __attribute__((aligned(64)));
    float acc[4 * KVC_AMX_MAX_DIM] __attribute__((aligned(64)));
    float m[4], l[4];
    kvc_amx_keys keys;
    keys.k_stride = kvc__bytes(c->k.dt, c->k.tok_st);
    keys.v_stride = kvc__bytes(c->v.dt, c->v.tok_st);
    keys.ks_stride = kvc__bytes(c->ks.dt, c->ks.tok_st);
    keys.vs_stride = kvc__bytes(c->vs.dt, c->vs.tok_st);
    keys.ksd = c->ks.dt;
    keys.vsd = c->vs.dt;
    const int scale_near = kvc__bytes(c->ks.dt, c->ks.head_st) < 64 &&
                           kvc__bytes(c->vs.dt, c->vs.head_st) < 64;
    /* int4 NHD caches whose token rows are contiguous (every head, no
     * padding): the call of KV head h prefetches the h-th of H shares of the
     * next 64 keys' whole token rows (K, V, scales), so those keys' rows are
     * requested a whole round of heads ahead and in address order; only the
     * chunk's first 64 keys go head slice by head slice (the next call's
     * rows). int4 decode steps that read from DRAM took 0.83-0.95x the time;
     * int8 ones 1.02-1.08x (Hq 32), so int8 keeps the head slices. */
    const int64_t rowb = kvc__bytes(c->k.dt, D);
    const int rows_ok = c->k.dt == KVC_I4 && kvc__bytes(c->k.dt, c->k.head_st) == rowb &&
                        kvc__bytes(c->v.dt, c->v.head_st) == rowb &&
                        c->k.tok_st == c->H * c->k.head_st &&
                        c->v.tok_st == c->H * c->v.head_st &&
                        c->ks.tok_st == c->H * c->ks.head_st &&
                        c->vs.tok_st == c->H * c->vs.head_st;
    keys.nrow = 0;
    kk->amx_tiles(1);
    for (int64_t s0 = 0; s0 < nslots; s0 += per) {
        const int64_t s1 = s0 + per < nslots ? s0 + per : nslots;
        const int rows = rows_ok && s0 == 0 && s1 == nslots; /* every head in this pass */
        int have_next = 0; /* keys.next holds the call that runs next */
        for (int64_t sl = s0; sl < s1; sl++) {
            const int64_t h = sl / sets, g0 = (sl % sets) * 4, nh = G - g0 < 4 ? G - g0 : 4;
            for (int64_t g = 0; g < nh; g++) load_q(c, b, h * G + g0 + g, q + g * Dp);
            /* the query in 16 bits when it came as float16/bfloat16 (attention.h) */
            kk->amx_begin(arena + (size_t)(sl - s0) * sb, q, (int)nh, (int)D, (int)Dp, c->group,
                          c->cap, c->sc, c->k.dt == KVC_I4 ? 4 : 8, c->qd == KVC_F32 ? 32 : 16);
        }
        for (int64_t j = j0; j < j1; j += KVC_AMX_KEYS) {
            const int64_t je = j1 - j < KVC_AMX_KEYS ? j1 : j + KVC_AMX_KEYS;
            const int64_t jn = je + KVC_AMX_KEYS < j1 ? je + KVC_AMX_KEYS : j1;
            int64_t hcur = -1;
            for (int64_t sl = s0; sl < s1; sl++) {
                const int64_t h = sl / sets;
                if (h != hcur) { /* head sets of one KV head share the keys */
                    /* the previous call's `next` is this call (page lookups and
                     * offsets once per call, not twice) */
                    if (have_next) {
                        memcpy(keys.run, keys.next, (size_t)keys.nnext * sizeof keys.run[0]);
                        keys.nrun = keys.nnext;
                    } else {
                        keys.nrun = amx_runs(c, b, h, j, je, keys.run);
                    }
                    /* prefetched: the keys of the next call with other rows (the
                     * next KV head, or the next call's first head) */
                    const int same_keys = (s1 - 1) / sets > h;
                    if (same_keys) {
                        amx_runs_next_head(c, keys.run, keys.nrun, keys.next);
                        keys.nnext = keys.nrun;
                    } else {
                        keys.nnext = amx_runs(c, b, s0 / sets, je, jn, keys.next);
                    }
                    have_next = 1;
                    /* the next head's scales of the same keys lie within 64 bytes
                     * of this head's (NHD): this call brings them in */
                    keys.pf_scales = !(same_keys && scale_near);
                    keys.pf_next = !rows || j == j0;
                    if (rows) { /* head h's share of the next keys' token rows */
                        const int64_t per_h = (jn - je + c->H - 1) / c->H;
                        const int64_t t0 = je + h * per_h, t1 = t0 + per_h < jn ? t0 + per_h : jn;
                        keys.nrow = t0 < t1 ? amx_runs(c, b, 0, t0, t1, keys.row) : 0;
                    }
                    hcur = h;
                }
                kk->amx_run(arena + (size_t)(sl - s0) * sb, &keys);
                keys.nrow = 0; /* a head's other sets (G > 4) need not prefetch them again */
            }
        }
        for (int64_t sl = s0; sl < s1; sl++) {
            const int64_t h = sl / sets, g0 = (sl % sets) * 4, nh = G - g0 < 4 ? G - g0 : 4;
            kk->amx_end(arena + (size_t)(sl - s0) * sb, m, l, acc, (int)Dp);
            for (int64_t g = 0; g < nh; g++)
                task_head_done(c, b, ch, nch, h * G + g0 + g, m[g], l[g], acc + g * Dp);
        }
    }
    kk->amx_tiles(0);
}

/* ---- float kernels ----------------------------------------------------------- */

/* States (query heads x Dp floats) one task keeps on its stack at once. */
#define ATTN_STATE_FLOATS 16384
/* Keys per kernel call: all heads of a block of keys are done before the
 * next block, so each token row (all heads) is read from memory once. */
#define ATTN_KEY_BLOCK 16

/*
 * Task = (request, chunk of keys), all KV heads. A state slot is up to
 * KVC_ATTN_MAX_G query heads of one KV head; slots are processed in batches
 * that fit ATTN_STATE_FLOATS (normally all heads at once). For each block
 * of ATTN_KEY_BLOCK keys inside a page, every slot of the batch consumes the
 * block before the next one starts: the cache is streamed token row by
 * token row (an NHD row holds every head) instead of one head's slice at a
 * time, which read each row H times with strided, prefetch-hostile access.
 * Not inlined into chunk_task, like chunk_amx: a thread's stack holds one
 * path's arrays, not both (DESIGN "Threads": the stack a caller needs).
 */
static __attribute__((noinline)) void chunk_float(const attn_ctx *c, int64_t b, int64_t ch,
                                                  int64_t nch, int64_t j0, int64_t j1) {
    float qb[ATTN_STATE_FLOATS] __attribute__((aligned(64)));
    float acc[ATTN_STATE_FLOATS] __attribute__((aligned(64)));
    float m[ATTN_STATE_FLOATS / 16], l[ATTN_STATE_FLOATS / 16];
    const int64_t Dp = c->Dp, D = c->D;
    const int64_t gblocks = (c->G + KVC_ATTN_MAX_G - 1) / KVC_ATTN_MAX_G;
    const int64_t nslots = c->H * gblocks;
    for (int64_t s0 = 0; s0 < nslots;) {
        /* batch of slots [s0, s1): heads of slot s at qb/acc + off[s - s0] */
        int64_t s1 = s0, used = 0;
        int64_t off[ATTN_STATE_FLOATS / 16];
        while (s1 < nslots) {
            const int64_t g0 = (s1 % gblocks) * KVC_ATTN_MAX_G;
            const int64_t ng = c->G - g0 < KVC_ATTN_MAX_G ? c->G - g0 : KVC_ATTN_MAX_G;
            if (used + ng * Dp > ATTN_STATE_FLOATS && s1 > s0) break;
            off[s1 - s0] = used;
            used += ng * Dp;
            s1++;
        }
        for (int64_t sl = s0; sl < s1; sl++) {
            const int64_t h = sl / gblocks, g0 = (sl % gblocks) * KVC_ATTN_MAX_G;
            const int64_t ng = c->G - g0 < KVC_ATTN_MAX_G ? c->G - g0 : KVC_ATTN_MAX_G;
            for (int64_t g = 0; g < ng; g++) {
                const int64_t o = off[sl - s0] + g * Dp;
                load_q(c, b, h * c->G + g0 + g, qb + o);
                memset(acc + o, 0, (size_t)Dp * sizeof(float));
                m[off[sl - s0] / Dp + g] = -INFINITY;
                l[off[sl - s0] / Dp + g] = 0.0f;
            }
        }
        /* the chunk's first block (the kernel prefetches the next one as it goes) */
        if (j0 < j1) {
            int64_t n0 = c->page_size - j0 % c->page_size;
            if (n0 > j1 - j0) n0 = j1 - j0;
            if (n0 > ATTN_KEY_BLOCK) n0 = ATTN_KEY_BLOCK;
            for (int64_t h = s0 / gblocks; h <= (s1 - 1) / gblocks; h++)
                prefetch_first(c, b, j0, n0, h);
        }
        /* blocks of keys inside one page */
        for (int64_t j = j0; j < j1;) {
            const int64_t pj = j / c->page_size, slot = j % c->page_size;
            int64_t n = c->page_size - slot;
            if (n > j1 - j) n = j1 - j;
            if (n > ATTN_KEY_BLOCK) n = ATTN_KEY_BLOCK;
            const int64_t page = c->indices ? c->indices[c->indptr[b] + pj] : 0;
            int64_t jn = j + n, nn = 0; /* the next block: from this page or the next */
            if (jn < j1) {
                nn = c->page_size - jn % c->page_size;
                if (nn > j1 - jn) nn = j1 - jn;
                if (nn > ATTN_KEY_BLOCK) nn = ATTN_KEY_BLOCK;
            }
            const int64_t npage =
                nn > 0 && c->indices ? c->indices[c->indptr[b] + jn / c->page_size] : 0;
            for (int64_t sl = s0; sl < s1; sl++) {
                const int64_t h = sl / gblocks, g0 = (sl % gblocks) * KVC_ATTN_MAX_G;
                const int ng = (int)(c->G - g0 < KVC_ATTN_MAX_G ? c->G - g0 : KVC_ATTN_MAX_G);
                const int64_t o = off[sl - s0];
                kvc_attn_rows rows;
                run_rows(c, page, slot, h, &rows);
                if (g0 == 0) next_rows(c, npage, jn % c->page_size, h, nn, &rows);
                c->kern->attn_decode(qb + o, ng, (int)D, (int)Dp, &rows, n, c->cap, c->sc,
                                     m + o / Dp, l + o / Dp, acc + o);
            }
            j += n;
        }
        for (int64_t sl = s0; sl < s1; sl++) {
            const int64_t h = sl / gblocks, g0 = (sl % gblocks) * KVC_ATTN_MAX_G;
            const int64_t ng = c->G - g0 < KVC_ATTN_MAX_G ? c->G - g0 : KVC_ATTN_MAX_G;
            for (int64_t g = 0; g < ng; g++) {
                const int64_t o = off[sl - s0] + g * Dp, si = off[sl - s0] / Dp + g;
                task_head_done(c, b, ch, nch, h * c->G + g0 + g, m[si], l[si], acc + o);
            }
        }
        s0 = s1;
    }
}

static void chunk_task(void *ctx, int64_t t) {
    const attn_ctx *c = ctx;
    const int64_t b = task_request(c, t), ch = t - c->task0[b], nch = c->nch[b];
    const int64_t a = first_key(c, b), L = c->len[b];
    const int64_t cl = chunk_len(L);
    int64_t j0 = ch * cl, j1 = j0 + cl;
    if (j0 < a) j0 = a;
    if (j1 > L) j1 = L;
    if (c->amx)
        chunk_amx(c, b, ch, nch, j0, j1);
    else
        chunk_float(c, b, ch, nch, j0, j1);
}

/* Merges the chunks of request b, KV head h (multi-chunk requests only),
 * in chunk order. */
static void merge_task(void *ctx, int64_t t) {
    const attn_ctx *c = ctx;
    const int64_t b = t / c->H, h = t % c->H, nch = c->nch[b], D = c->D;
    if (nch == 1) return;
    float acc[KVC_ATTN_MAX_DIM];
    for (int64_t g = 0; g < c->G; g++) {
        const int64_t hq = h * c->G + g;
        const float *p0 = c->part + c->part0[b] + hq * (D + 2);
        const int64_t cst = c->Hq * (D + 2);
        float M = -INFINITY;
        for (int64_t ch = 0; ch < nch; ch++) {
            const float *p = p0 + ch * cst;
            if (p[1] > 0.0f && p[0] > M) M = p[0];
        }
        float Ls = 0.0f;
        for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
        if (M != -INFINITY) {
            for (int64_t ch = 0; ch < nch; ch++) {
                const float *p = p0 + ch * cst;
                if (!(p[1] > 0.0f)) continue;
                const float w = exp2f(p[0] - M);
                Ls += w * p[1];
                for (int64_t d = 0; d < D; d++) acc[d] += w * p[2 + d];
            }
        }
        finish_head(c, b, hq, M, Ls, acc);
    }
}

static void attn_execute(attn_ctx *c, kvc_threadpool *pool) {
    c->kern = kvc__kernels();
    c->amx = c->quant && kvc__amx_decode_ok(c->kern, c->k.dt, c->D, c->group);
    kvc__parallel_for(pool, c->task0[c->B], chunk_task, c);
    int multi = 0;
    for (int64_t b = 0; b < c->B && !multi; b++) multi = c->nch[b] > 1;
    if (multi) kvc__parallel_for(pool, c->B * c->H, merge_task, c);
}

static int64_t chunks_of(int64_t L) {
    const int64_t c = chunk_len(L);
    return L <= c ? 1 : (L + c - 1) / c;
}

/* ---- validation ------------------------------------------------------------ */

static void set_io(attn_ctx *c, const kvc_tensor *q, kvc_tensor *out, kvc_tensor *lse, int batched,
                   const kvc_attn_params *p) {
    const int o = batched ? 1 : 0;
    c->q = q->data;
    c->qd = q->dtype;
    c->q_sb = batched ? q->stride[0] : 0;
    c->q_sh = q->stride[o];
    c->out = out->data;
    c->od = out->dtype;
    c->o_sb = batched ? out->stride[0] : 0;
    c->o_sh = out->stride[o];
    c->lse = lse ? lse->data : NULL;
    c->l_sb = lse && batched ? lse->stride[0] : 0;
    c->l_sh = lse ? lse->stride[o] : 0;
    c->cap = p->logits_soft_cap;
    kvc__attn_score_scale(p->sm_scale, c->cap, 0, &c->qscale, &c->sc);
    c->window = p->window_left;
    c->sinks = p->sinks;
    c->Dp = (c->D + 15) / 16 * 16;
}

static attn_view make_view(const kvc_tensor *t, kvc_kv_layout layout, int paged) {
    attn_view v;
    v.data = t->data;
    v.dt = t->dtype;
    const int o = paged ? 1 : 0;
    v.page_st = paged ? t->stride[0] : 0;
    v.tok_st = layout == KVC_NHD ? t->stride[o] : t->stride[o + 1];
    v.head_st = layout == KVC_NHD ? t->stride[o + 1] : t->stride[o];
    return v;
}

/* ---- public API ------------------------------------------------------------- */

kvc_attn_params kvc_attn_default_params(void) {
    kvc_attn_params p;
    p.sm_scale = 0.0f;
    p.logits_soft_cap = 0.0f;
    p.window_left = -1;
    p.sinks = NULL;
    return p;
}

kvc_status kvc_single_decode(const kvc_tensor *q, const kvc_tensor *k, const kvc_tensor *v,
                             const kvc_tensor *k_scale, const kvc_tensor *v_scale,
                             int32_t quant_group, kvc_kv_layout layout,
                             const kvc_attn_params *params, kvc_tensor *out, kvc_tensor *lse,
                             kvc_threadpool *pool) {
    static const char fn[] = "kvc_single_decode";
    KVC_CHECK(q != NULL, "%s: q is NULL", fn);
    KVC_CHECK(layout == KVC_NHD || layout == KVC_HND, "%s: invalid layout %d", fn, (int)layout);
    KVC_TRY(kvc__attn_check_kv(fn, k, v, k_scale, v_scale, quant_group, 3));
    const int64_t L = layout == KVC_NHD ? k->shape[0] : k->shape[1];
    const int64_t H = layout == KVC_NHD ? k->shape[1] : k->shape[0];
    const int64_t D = k->shape[2];
    KVC_TRY(kvc__check_tensor(q, "q", 1));
    KVC_CHECK(q->ndim == 2, "%s: q must be (Hq, Dh)", fn);
    const int64_t Hq = q->shape[0];
    const int64_t qshape[2] = {Hq, D};
    KVC_TRY(kvc__attn_check_io(fn, q, out, lse, 2, qshape));
    KVC_TRY(kvc__attn_check_heads(fn, Hq, H, D));
    kvc_attn_params p;
    KVC_TRY(kvc__attn_check_params(fn, params, Hq, D, &p));

    int64_t len = L, nch = chunks_of(L), task0[2] = {0, nch}, part0 = 0;
    float *part = NULL;
    if (nch > 1) {
        int64_t np;
        if (!kvc__mul3_le(nch, Hq, D + 2, KVC__MAX_SCRATCH_FLOATS, &np) ||
            !(part = malloc((size_t)np * sizeof(float))))
            return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (%lld chunks x %lld heads of "
                              "partial results)", fn, (long long)nch, (long long)Hq);
    }
    attn_ctx c;
    memset(&c, 0, sizeof c);
    c.B = 1;
    c.Hq = Hq;
    c.H = H;
    c.G = Hq / H;
    c.D = D;
    c.k = make_view(k, layout, 0);
    c.v = make_view(v, layout, 0);
    c.quant = k->dtype == KVC_I8 || k->dtype == KVC_I4;
    if (c.quant) {
        c.ks = make_view(k_scale, layout, 0);
        c.vs = make_view(v_scale, layout, 0);
        c.group = quant_group;
    }
    c.page_size = L > 0 ? L : 1;
    c.len = &len;
    c.nch = &nch;
    c.task0 = task0;
    c.part0 = &part0;
    c.part = part;
    set_io(&c, q, out, lse, 0, &p);
    attn_execute(&c, pool);
    free(part);
    return KVC_OK;
}

struct kvc_decode_plan {
    int64_t B, Hq, H, D, page_size, n_threads;
    int64_t max_page; /* largest page id in the table, -1 if none */
    int32_t *indptr, *indices;
    int64_t *len, *nch, *task0, *part0;
    float *part;
};

void kvc_decode_plan_destroy(kvc_decode_plan *plan) {
    if (!plan) return;
    free(plan->indptr);
    free(plan->indices);
    free(plan->len);
    free(plan->nch);
    free(plan->task0);
    free(plan->part0);
    free(plan->part);
    free(plan);
}

kvc_status kvc_decode_plan_create(const kvc_tensor *kv_indptr, const kvc_tensor *kv_indices,
                                  const kvc_tensor *kv_last_page_len, int32_t num_qo_heads,
                                  int32_t num_kv_heads, int32_t head_dim, int32_t page_size,
                                  int32_t n_threads, kvc_decode_plan **out) {
    static const char fn[] = "kvc_decode_plan_create";
    KVC_CHECK(out != NULL, "%s: out is NULL", fn);
    *out = NULL; /* what a failure leaves */
    KVC_CHECK(page_size >= 1, "%s: page_size %d must be >= 1", fn, (int)page_size);
    KVC_CHECK(n_threads <= 1024, "%s: n_threads %d > 1024", fn, (int)n_threads);
    KVC_TRY(kvc__attn_check_heads(fn, num_qo_heads, num_kv_heads, head_dim));
    int64_t B = 0;
    KVC_TRY(kvc__paged_check_table(fn, kv_indptr, kv_indices, kv_last_page_len, page_size, -1, 1,
                                   &B));
    const int64_t n_idx = kvc__i32_1d(kv_indptr, B);
    kvc_decode_plan *p = calloc(1, sizeof *p);
    if (!p) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    p->B = B;
    p->Hq = num_qo_heads;
    p->H = num_kv_heads;
    p->D = head_dim;
    p->page_size = page_size;
    p->n_threads = n_threads;
    p->indptr = malloc((size_t)(B + 1) * sizeof(int32_t));
    p->indices = malloc((size_t)(n_idx > 0 ? n_idx : 1) * sizeof(int32_t));
    p->len = malloc((size_t)(B > 0 ? B : 1) * sizeof(int64_t));
    p->nch = malloc((size_t)(B > 0 ? B : 1) * sizeof(int64_t));
    p->part0 = malloc((size_t)(B > 0 ? B : 1) * sizeof(int64_t));
    p->task0 = malloc((size_t)(B + 1) * sizeof(int64_t));
    if (!p->indptr || !p->indices || !p->len || !p->nch || !p->part0 || !p->task0) {
        kvc_decode_plan_destroy(p);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    }
    p->max_page = -1;
    for (int64_t i = 0; i < n_idx; i++) {
        p->indices[i] = kvc__i32_1d(kv_indices, i);
        if (p->indices[i] > p->max_page) p->max_page = p->indices[i];
    }
    int64_t parts = 0;
    p->task0[0] = 0;
    for (int64_t b = 0; b <= B; b++) p->indptr[b] = kvc__i32_1d(kv_indptr, b);
    for (int64_t b = 0; b < B; b++) {
        const int64_t pages = p->indptr[b + 1] - p->indptr[b];
        p->len[b] = pages ? (pages - 1) * page_size + kvc__i32_1d(kv_last_page_len, b) : 0;
        p->nch[b] = chunks_of(p->len[b]);
        p->task0[b + 1] = p->task0[b] + p->nch[b];
        p->part0[b] = parts;
        int64_t np = 0;
        if (p->nch[b] > 1 &&
            (!kvc__mul3_le(p->nch[b], p->Hq, p->D + 2, KVC__MAX_SCRATCH_FLOATS, &np) ||
             np > KVC__MAX_SCRATCH_FLOATS - parts)) {
            kvc__error(KVC_ERR_NOMEM, "%s: out of memory (request %lld: %lld chunks x %lld "
                       "heads of partial results)", fn, (long long)b, (long long)p->nch[b],
                       (long long)p->Hq);
            kvc_decode_plan_destroy(p);
            return KVC_ERR_NOMEM;
        }
        parts += np;
    }
    if (parts > 0) {
        p->part = malloc((size_t)parts * sizeof(float));
        if (!p->part) {
            kvc_decode_plan_destroy(p);
            return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
        }
    }
    *out = p;
    return KVC_OK;
}

kvc_status kvc_decode_run(kvc_decode_plan *plan, const kvc_tensor *q,
                          const kvc_paged_cache *cache, const kvc_attn_params *params,
                          kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool) {
    static const char fn[] = "kvc_decode_run";
    KVC_CHECK(plan != NULL && q != NULL && cache != NULL, "%s: plan, q and cache must not be NULL",
              fn);
    const int64_t qshape[3] = {plan->B, plan->Hq, plan->D};
    KVC_TRY(kvc__attn_check_io(fn, q, out, lse, 3, qshape));
    KVC_TRY(kvc__attn_check_paged(fn, cache, plan->page_size, plan->H, plan->D, plan->max_page));
    kvc_attn_params p;
    KVC_TRY(kvc__attn_check_params(fn, params, plan->Hq, plan->D, &p));

    attn_ctx c;
    memset(&c, 0, sizeof c);
    c.B = plan->B;
    c.Hq = plan->Hq;
    c.H = plan->H;
    c.G = plan->Hq / plan->H;
    c.D = plan->D;
    c.k = make_view(&cache->k, cache->layout, 1);
    c.v = make_view(&cache->v, cache->layout, 1);
    c.quant = cache->k.dtype == KVC_I8 || cache->k.dtype == KVC_I4;
    if (c.quant) {
        c.ks = make_view(&cache->k_scale, cache->layout, 1);
        c.vs = make_view(&cache->v_scale, cache->layout, 1);
        c.group = cache->quant_group;
    }
    c.indptr = plan->indptr;
    c.indices = plan->indices;
    c.page_size = plan->page_size;
    c.len = plan->len;
    c.nch = plan->nch;
    c.task0 = plan->task0;
    c.part0 = plan->part0;
    c.part = plan->part;
    set_io(&c, q, out, lse, 1, &p);
    if (c.B > 0) attn_execute(&c, pool);
    return KVC_OK;
}
