/*
 * libFuzzer target for the compressed KV formats (include/kvcache/kvfmt.h):
 * kvc_kvfmt_append, kvc_kvfmt_attention and kvc_kvfmt_append_attention.
 *
 * Input: byte 0 the operation, then a PRNG seed, the format (kivi8, kivi4
 * or a custom tuple: bits, G, gv, V mode, rotation, W, S, possibly one that
 * kvc_kvfmt_check refuses), the geometry (H, Dh, P, query heads per KV
 * head), up to three sequences (tokens already stored, rows of this call),
 * the query rows, the thread count, the key dtype, then up to two
 * corruptions (a page id out of range, a query position or sequence out of
 * range, a NaN or an infinity in K or V, a NULL sink, a decreasing
 * row_indptr, rows beyond n_kv, a wrong dtype or shape, a refused attention
 * parameter). A byte past the end reads as 0, so short inputs are valid
 * calls. Values: K channels around their own offsets, V and q in [-2, 2].
 *
 * Checked on every call:
 *   - the status is KVC_OK or a documented error (INVALID_ARG, UNSUPPORTED,
 *     NOMEM) with a message; a valid call succeeds, a corrupted one the
 *     header refuses fails;
 *   - on error the pages, tails, sink rows and outputs are byte-identical
 *     to before;
 *   - a successful call gives the same bytes and outputs again with the
 *     other thread count, and (from the same starting bytes) on the scalar
 *     ISA the same pages, tails and sink rows (stores are exact on every
 *     ISA) and outputs within float16's tolerance.
 * KVC_FUZZ_STATS=1 in the environment prints the split of calls at exit.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kvcache.h"
#include "fuzz.h"
#include "fuzz_input.h"

static float rndf(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() >> 40) / 16777216.0f; }

enum { OP_APPEND, OP_ATTENTION, OP_APPEND_ATTENTION, OP_COUNT };
enum { EXP_VALID, EXP_MAY, EXP_FAIL };
enum { MAX_SEQS = 3, MAX_ROWS = 96 };

static kvc_threadpool *pools[3];

/* KVC_FUZZ_STATS=1: calls by operation, expectation and status, at exit */
static long stats[OP_COUNT][3][2];
static void print_stats(void) {
    static const char *ops[] = {"append", "attention", "append_attention"};
    static const char *exp[] = {"valid", "may", "corrupt"};
    for (int o = 0; o < OP_COUNT; o++)
        for (int e = 0; e < 3; e++)
            fprintf(stderr, "%-16s %-7s ok %6ld  refused %6ld\n", ops[o], exp[e], stats[o][e][0],
                    stats[o][e][1]);
}

typedef struct call {
    int op, expect, threads;
    kvc_kvfmt f;
    int fmt_ok;
    int64_t Hq, n_seqs, num_pages;
    size_t pb, tb, sb;
    unsigned char *pages;
    uint16_t *tails, *sinks; /* per sequence: tb and sb bytes */
    int32_t *ids;            /* page ids, sequence by sequence */
    kvc_kvfmt_seq seqs[MAX_SEQS];
    int64_t prior[MAX_SEQS], rows[MAX_SEQS];
    int64_t indptr[MAX_SEQS + 1];
    float *key, *value, *q, *out, *lse;
    kvc_dtype kv_dtype; /* what key and value hold (tk.dtype may be corrupted) */
    kvc_tensor tk, tv, tq, to, tl, tp;
    int32_t qseq[MAX_ROWS], qpos[MAX_ROWS];
    int64_t nq;
    kvc_attn_params params;
    int use_params;
} call;

static const int32_t dims[] = {8, 16, 32, 64, 96, 128, 6, 5};
/* 1024: pages past the generic kernel's 512-token blocks */
static const int32_t sizes[] = {16, 8, 32, 64, 1, 2, 128, 4, 1024};
static const int32_t groups[] = {64, 32, 16, 128, 8, 48};

static void gen_format(reader *r, call *c) {
    const int32_t H = 1 + (int32_t)pick(r, 3), Dh = dims[pick(r, 8)], P = sizes[pick(r, 9)];
    const unsigned kind = pick(r, 4);
    if (kind < 2) {
        c->fmt_ok = kvc_kvfmt_make(kind == 0 ? KVC_KVFMT_KIVI8 : KVC_KVFMT_KIVI4, H, Dh, P,
                                   &c->f) == KVC_OK;
        if (!c->fmt_ok) CHECK(kvc_last_error()[0] != 0);
    } else {
        kvc_kvfmt *f = &c->f;
        f->id = KVC_KVFMT_NONE;
        f->bits = pick(r, 2) ? 8 : 4;
        f->group = groups[pick(r, 6)];
        f->v_group = (int32_t)(1u << pick(r, 7)); /* 1 .. 64: may not divide Dh */
        f->v_asym = (int32_t)pick(r, 2);
        f->rotate_v = (int32_t)pick(r, 2);
        f->num_kv_heads = H, f->head_dim = Dh, f->page_size = P;
        f->window = f->group * (int32_t)pick(r, 3);
        f->sink = (int32_t)pick(r, 4) * 3; /* 0, 3, 6, 9: may reach G */
        c->fmt_ok = kvc_kvfmt_check(f) == KVC_OK;
    }
    if (!c->fmt_ok) { /* a geometry to build buffers with; every call must fail */
        c->f.num_kv_heads = H, c->f.head_dim = Dh, c->f.page_size = P;
        if (c->f.group <= 0) c->f.group = 64;
    }
    c->Hq = H * (1 + (int64_t)pick(r, 4));
}

/* Stores the prior tokens of every sequence (a valid call). */
static void store_prior(call *c, float *off) {
    const int64_t H = c->f.num_kv_heads, Dh = c->f.head_dim, row = H * Dh;
    for (int64_t b = 0; b < c->n_seqs; b++) {
        const int64_t n = c->prior[b];
        if (n == 0) continue;
        float *k = malloc((size_t)(n * row) * 4), *v = malloc((size_t)(n * row) * 4);
        CHECK(k && v);
        for (int64_t i = 0; i < n * row; i++) {
            k[i] = off[i % row] + rndf(-1, 1);
            v[i] = rndf(-2, 2);
        }
        int64_t ip[2] = {0, n}, sh[3] = {n, H, Dh};
        kvc_tensor tk = kvc_tensor_make(k, KVC_F32, 3, sh), tv = kvc_tensor_make(v, KVC_F32, 3, sh);
        kvc_kvfmt_seq s = c->seqs[b];
        s.n_kv = n;
        CHECK(kvc_kvfmt_append(&c->f, &c->tp, &s, 1, ip, &tk, &tv, pools[1]) == KVC_OK);
        free(k), free(v);
    }
}

static void gen_call(reader *r, call *c) {
    const int64_t H = c->f.num_kv_heads, Dh = c->f.head_dim, P = c->f.page_size, G = c->f.group;
    const int64_t row = H * Dh;
    c->n_seqs = 1 + (int64_t)pick(r, MAX_SEQS);
    int64_t total = 0;
    for (int64_t b = 0; b < c->n_seqs; b++) {
        c->prior[b] = c->op == OP_APPEND && pick(r, 2) ? 0 : (int64_t)pick(r, 4) * (int64_t)next(r) % 300;
        c->rows[b] = c->op == OP_ATTENTION ? 0 : (int64_t)pick(r, 5) * 24 + (int64_t)pick(r, 24);
        c->indptr[b + 1] = c->indptr[b] + c->rows[b];
        total += (c->prior[b] + c->rows[b] + P - 1) / P;
    }
    c->num_pages = total + 1;
    c->pb = c->fmt_ok ? kvc_kvfmt_page_bytes(&c->f) : 64;
    c->tb = c->fmt_ok ? kvc_kvfmt_tail_bytes(&c->f) : 64;
    c->sb = c->fmt_ok ? kvc_kvfmt_sink_bytes(&c->f) : 0;
    c->pages = calloc((size_t)c->num_pages, c->pb);
    c->tails = calloc((size_t)c->n_seqs, c->tb);
    c->sinks = calloc((size_t)c->n_seqs, c->sb + 2);
    c->ids = malloc((size_t)c->num_pages * 4);
    CHECK(c->pages && c->tails && c->sinks && c->ids);
    for (int64_t i = 0; i < c->num_pages; i++) c->ids[i] = (int32_t)i;
    for (int64_t i = c->num_pages - 1; i > 0; i--) { /* shuffled */
        const int64_t j = (int64_t)(rnd() % (uint64_t)(i + 1));
        const int32_t t = c->ids[i];
        c->ids[i] = c->ids[j], c->ids[j] = t;
    }
    int64_t psh[2] = {c->num_pages, (int64_t)c->pb};
    c->tp = kvc_tensor_make(c->pages, KVC_U8, 2, psh);
    int64_t p0 = 0;
    for (int64_t b = 0; b < c->n_seqs; b++) {
        c->seqs[b].pages = c->ids + p0;
        c->seqs[b].tail = (uint16_t *)(void *)((unsigned char *)c->tails + b * c->tb);
        c->seqs[b].sink = c->f.sink > 0 ? (uint16_t *)(void *)((unsigned char *)c->sinks + b * c->sb) : NULL;
        c->seqs[b].n_kv = c->prior[b] + c->rows[b];
        p0 += (c->seqs[b].n_kv + P - 1) / P;
    }
    float *off = malloc((size_t)row * 4);
    CHECK(off);
    for (int64_t e = 0; e < row; e++) off[e] = rndf(-4, 4);
    if (c->fmt_ok) store_prior(c, off);
    /* this call's rows */
    const int64_t n = c->indptr[c->n_seqs];
    const kvc_dtype kd = pick(r, 3) == 2 ? KVC_F16 : KVC_F32;
    const size_t es = kd == KVC_F16 ? 2 : 4;
    c->kv_dtype = kd;
    c->key = malloc((size_t)(n * row) * es + 4), c->value = malloc((size_t)(n * row) * es + 4);
    CHECK(c->key && c->value);
    for (int64_t i = 0; i < n * row; i++) {
        const float k = off[i % row] + rndf(-1, 1), v = rndf(-2, 2);
        if (kd == KVC_F16) {
            ((uint16_t *)(void *)c->key)[i] = kvc_f32_to_f16(k);
            ((uint16_t *)(void *)c->value)[i] = kvc_f32_to_f16(v);
        } else {
            c->key[i] = k, c->value[i] = v;
        }
    }
    free(off);
    int64_t sh[3] = {n, H, Dh};
    c->tk = kvc_tensor_make(c->key, kd, 3, sh);
    c->tv = kvc_tensor_make(c->value, kd, 3, sh);
    /* queries: each at a position its call may take */
    c->nq = 0;
    if (c->op != OP_APPEND) {
        const int64_t want = (int64_t)pick(r, 40);
        for (int64_t i = 0; i < want; i++) {
            const int64_t b = (int64_t)(rnd() % (uint64_t)c->n_seqs), nkv = c->seqs[b].n_kv;
            const int64_t base = c->op == OP_ATTENTION ? nkv : c->prior[b];
            const int64_t lo = base / G * G - 1 > 0 ? base / G * G - 1 : 0;
            if (nkv <= lo) continue;
            c->qseq[c->nq] = (int32_t)b;
            c->qpos[c->nq++] = (int32_t)(lo + (int64_t)(rnd() % (uint64_t)(nkv - lo)));
        }
    }
    const int64_t nq = c->nq;
    c->q = malloc((size_t)(nq * c->Hq * Dh) * 4 + 4);
    c->out = malloc((size_t)(nq * c->Hq * Dh) * 4 + 4);
    c->lse = malloc((size_t)(nq * c->Hq) * 4 + 4);
    CHECK(c->q && c->out && c->lse);
    for (int64_t i = 0; i < nq * c->Hq * Dh; i++) c->q[i] = rndf(-2, 2);
    int64_t qsh[3] = {nq, c->Hq, Dh}, lsh[2] = {nq, c->Hq};
    c->tq = kvc_tensor_make(c->q, KVC_F32, 3, qsh);
    c->to = kvc_tensor_make(c->out, KVC_F32, 3, qsh);
    c->tl = kvc_tensor_make(c->lse, KVC_F32, 2, lsh);
    c->params = kvc_attn_default_params();
    c->use_params = (int)pick(r, 2);
    c->threads = 1 + (int)pick(r, 2);
}

/* A corruption the call must refuse (expect FAIL), or may (MAY). */
static void corrupt(reader *r, call *c) {
    const int attn = c->op != OP_APPEND, app = c->op != OP_ATTENTION;
    const int64_t nrows = c->indptr[c->n_seqs];
    switch (pick(r, 9)) {
    case 0: { /* a page id out of range: refused where the call reads or writes it */
        const int64_t b = (int64_t)pick(r, (unsigned)c->n_seqs);
        const int64_t np = (c->seqs[b].n_kv + c->f.page_size - 1) / c->f.page_size;
        if (np == 0) return;
        int32_t *ids = (int32_t *)(uintptr_t)c->seqs[b].pages;
        ids[pick(r, (unsigned)np)] = pick(r, 2) ? -1 : (int32_t)c->num_pages;
        c->expect = c->expect == EXP_FAIL ? EXP_FAIL : EXP_MAY;
        return;
    }
    case 1: { /* a query position out of range: below 0 or at n_kv */
        if (!attn || c->nq == 0) return;
        const int64_t i = (int64_t)pick(r, (unsigned)c->nq), b = c->qseq[i];
        c->qpos[i] = pick(r, 2) || b < 0 || b >= c->n_seqs ? -1 : (int32_t)c->seqs[b].n_kv;
        c->expect = EXP_FAIL;
        return;
    }
    case 2: /* a query's sequence out of range */
        if (!attn || c->nq == 0) return;
        c->qseq[pick(r, (unsigned)c->nq)] = pick(r, 2) ? -1 : (int32_t)c->n_seqs;
        c->expect = EXP_FAIL;
        return;
    case 3: { /* a NaN or an infinity in K or V */
        if (!app || nrows == 0) return;
        const int64_t i = (int64_t)(rnd() % (uint64_t)(nrows * c->f.num_kv_heads * c->f.head_dim));
        void *t = pick(r, 2) ? (void *)c->key : (void *)c->value;
        const float x = pick(r, 2) ? NAN : -INFINITY;
        if (c->kv_dtype == KVC_F16) ((uint16_t *)t)[i] = kvc_f32_to_f16(x);
        else ((float *)t)[i] = x;
        c->expect = EXP_FAIL;
        return;
    }
    case 4: { /* no sink rows for a format that keeps them: refused for a
               * sequence the call appends to or a query reads */
        if (c->f.sink == 0) return;
        const int64_t b = (int64_t)pick(r, (unsigned)c->n_seqs);
        int used = app && c->rows[b] > 0;
        for (int64_t i = 0; attn && i < c->nq; i++) used |= c->qseq[i] == (int32_t)b;
        c->seqs[b].sink = NULL;
        if (used) c->expect = EXP_FAIL;
        else if (c->expect != EXP_FAIL) c->expect = EXP_MAY;
        return;
    }
    case 5: /* row_indptr decreasing, or a sequence's rows beyond its n_kv */
        if (!app || nrows == 0) return;
        if (pick(r, 2) && c->n_seqs >= 2 && c->rows[0] > 0) {
            c->indptr[1] = c->indptr[2] + 1;
        } else {
            int64_t b = 0;
            while (c->rows[b] == 0) b++;
            c->seqs[b].n_kv = c->rows[b] - 1;
        }
        c->expect = EXP_FAIL;
        return;
    case 6: /* a wrong dtype or shape */
        switch (pick(r, 4)) {
        case 0: if (!app) return; c->tk.dtype = KVC_I32; break;
        case 1: if (!app) return; c->tv.shape[2] += 1; break;
        case 2: /* Hq - 1 query heads (a view inside the buffers): refused
                 * unless it is still a positive multiple of H. Once per
                 * call: a second Hq - 1 may make a refused count valid
                 * again (4 -> 3 -> 2 with H = 2) */
            if (!attn || c->tq.shape[1] != c->Hq) return;
            c->tq.shape[1] -= 1, c->to.shape[1] -= 1, c->tl.shape[1] -= 1;
            if (c->tq.shape[1] >= 1 && c->tq.shape[1] % c->f.num_kv_heads == 0) {
                if (c->expect != EXP_FAIL) c->expect = EXP_MAY;
                return;
            }
            break;
        default: if (!attn) return; c->to.shape[2] -= 1; break;
        }
        c->expect = EXP_FAIL;
        return;
    case 7: /* a parameter these formats refuse */
        if (!attn) return;
        c->use_params = 1;
        if (pick(r, 2)) c->params.logits_soft_cap = 30.0f;
        else c->params.sm_scale = -1.0f;
        c->expect = EXP_FAIL;
        return;
    default: /* pages of the wrong width */
        c->tp.shape[1] -= 1;
        c->expect = EXP_FAIL;
        return;
    }
}

static kvc_status run(call *c, int threads) {
    kvc_threadpool *pool = pools[threads];
    const kvc_attn_params *pp = c->use_params ? &c->params : NULL;
    switch (c->op) {
    case OP_APPEND:
        return kvc_kvfmt_append(&c->f, &c->tp, c->seqs, c->n_seqs, c->indptr, &c->tk, &c->tv, pool);
    case OP_ATTENTION:
        return kvc_kvfmt_attention(&c->f, &c->tp, c->seqs, c->n_seqs, &c->tq, c->qseq, c->qpos,
                                   pp, &c->to, &c->tl, pool);
    default:
        return kvc_kvfmt_append_attention(&c->f, &c->tp, c->seqs, c->n_seqs, c->indptr, &c->tk,
                                          &c->tv, &c->tq, c->qseq, c->qpos, pp, &c->to,
                                          &c->tl, pool);
    }
}

/* the state a call may write: pages, tails, sink rows, outputs */
typedef struct state {
    unsigned char *pages, *tails, *sinks, *out, *lse;
} state;

static size_t n_out(const call *c) { return (size_t)(c->nq * c->Hq * c->f.head_dim) * 4; }

static void save(const call *c, state *s) {
    const size_t np = (size_t)c->num_pages * c->pb, nt = (size_t)c->n_seqs * c->tb;
    const size_t ns = (size_t)c->n_seqs * (c->sb + 2), no = n_out(c), nl = (size_t)(c->nq * c->Hq) * 4;
    s->pages = malloc(np + 1), s->tails = malloc(nt + 1), s->sinks = malloc(ns + 1);
    s->out = malloc(no + 1), s->lse = malloc(nl + 1);
    CHECK(s->pages && s->tails && s->sinks && s->out && s->lse);
    memcpy(s->pages, c->pages, np), memcpy(s->tails, c->tails, nt), memcpy(s->sinks, c->sinks, ns);
    memcpy(s->out, c->out, no), memcpy(s->lse, c->lse, nl);
}

static void load(call *c, const state *s) {
    memcpy(c->pages, s->pages, (size_t)c->num_pages * c->pb);
    memcpy(c->tails, s->tails, (size_t)c->n_seqs * c->tb);
    memcpy(c->sinks, s->sinks, (size_t)c->n_seqs * (c->sb + 2));
    memcpy(c->out, s->out, n_out(c));
    memcpy(c->lse, s->lse, (size_t)(c->nq * c->Hq) * 4);
}

static int same_store(const call *c, const state *s) {
    return !memcmp(c->pages, s->pages, (size_t)c->num_pages * c->pb) &&
           !memcmp(c->tails, s->tails, (size_t)c->n_seqs * c->tb) &&
           !memcmp(c->sinks, s->sinks, (size_t)c->n_seqs * (c->sb + 2));
}

static int same_out(const call *c, const state *s) {
    return !memcmp(c->out, s->out, n_out(c)) && !memcmp(c->lse, s->lse, (size_t)(c->nq * c->Hq) * 4);
}

static void free_state(state *s) { free(s->pages), free(s->tails), free(s->sinks), free(s->out), free(s->lse); }

static void execute(call *c) {
    memset(c->out, 0xa5, n_out(c));
    memset(c->lse, 0xa5, (size_t)(c->nq * c->Hq) * 4);
    state before, after;
    save(c, &before);
    const kvc_status st = run(c, c->threads);
    stats[c->op][c->expect][st != KVC_OK]++;
    if (st != KVC_OK) {
        CHECK(st == KVC_ERR_INVALID_ARG || st == KVC_ERR_UNSUPPORTED || st == KVC_ERR_NOMEM);
        CHECK(kvc_last_error()[0] != 0);
        CHECK(c->expect != EXP_VALID || st == KVC_ERR_NOMEM);
        CHECK(same_store(c, &before) && same_out(c, &before)); /* nothing written */
        free_state(&before);
        return;
    }
    CHECK(c->expect != EXP_FAIL);
    save(c, &after);
    /* the other thread count: the same bits */
    load(c, &before);
    CHECK(run(c, 3 - c->threads) == KVC_OK);
    CHECK(same_store(c, &after) && same_out(c, &after));
    /* the scalar ISA: the same stores, outputs within float16's tolerance */
    const kvc_isa isa = kvc_get_isa();
    if (isa != KVC_ISA_SCALAR) {
        load(c, &before);
        CHECK(kvc_set_isa(KVC_ISA_SCALAR) == KVC_OK);
        const kvc_status s2 = run(c, c->threads);
        CHECK(kvc_set_isa(isa) == KVC_OK);
        CHECK(s2 == KVC_OK);
        CHECK(same_store(c, &after));
        const float *o = (const float *)(void *)after.out;
        for (size_t i = 0; i < n_out(c) / 4; i++)
            CHECK(fabsf(c->out[i] - o[i]) <= 4e-3f + 4e-3f * fabsf(o[i]));
    }
    free_state(&before);
    free_state(&after);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_start(pools, print_stats);
    reader r = {data, size, 0};
    call *c = calloc(1, sizeof *c);
    CHECK(c);
    unsigned flags;
    c->op = fuzz_header(&r, OP_COUNT, &flags);
    gen_format(&r, c);
    gen_call(&r, c);
    c->expect = c->fmt_ok ? EXP_VALID : EXP_FAIL;
    for (unsigned k = 0; k < (flags & 3); k++) corrupt(&r, c);
    execute(c);
    free(c->pages), free(c->tails), free(c->sinks), free(c->ids);
    free(c->key), free(c->value), free(c->q), free(c->out), free(c->lse);
    free(c);
    return 0;
}
