/*
 * libFuzzer target for the argument handling and kernels of the operators:
 * paged append (KV and MLA), single/batch decode, single/paged/ragged
 * prefill (masks included), cascade, MLA, the three merges and the pmx
 * static/dynamic KeyValueCache and MultiHeadCacheAttention.
 *
 * Input: byte 0 picks the operation, the next bytes its shapes, dtypes,
 * layout, page table, strides, parameters and pool, then up to three
 * corruptions (generic: a tensor's dtype, rank, shape, a negative or
 * non-unit last stride, misaligned or NULL data, a NULL tensor, an
 * overlapping output, an index value; specific: page ids out of range,
 * last_page_len 0 or > page_size, indptr not starting at 0 or decreasing,
 * refused sinks, head counts, ...). A byte past the end reads as 0, so the
 * shortest inputs are valid calls. Tensor contents come from a PRNG seeded
 * by the input: multiples of 1/16 in [-2, 2] (exact in every float dtype, so
 * scores are exact dot products), random int8/int4 codes, scales 2^-k.
 *
 * Checked on every call:
 *   - the status is KVC_OK or a documented error (INVALID_ARG, UNSUPPORTED,
 *     NOMEM); a valid call succeeds, a call with a corruption the headers
 *     refuse fails; a failing plan create leaves *out NULL;
 *   - on error the message is non-empty and every buffer (inputs, outputs
 *     filled with a canary, caches) is byte-identical to before; on success
 *     the inputs are;
 *   - the call is run again on the scalar ISA (when the default is another
 *     one) from the same bytes: same status, caches bit-identical (stores
 *     are exact on every ISA), attention outputs within the test suites'
 *     tolerances (1e-5 float32, 1e-3 float16, 1e-2 bfloat16, relative to
 *     1 + |x|) while the scores stay small;
 *   - a successful call gives the same bytes again with the other thread
 *     count (pool and plan 1 <-> 2 threads, same ISA);
 *   - valid calls with finite data: no NaN in any output, and single decode,
 *     single prefill and merge_state match a float64 reference.
 * KVC_FUZZ_STATS=1 in the environment prints the split of calls (valid /
 * corrupted, by operation and status) at exit.
 *
 * Built with clang -fsanitize=fuzzer,address,undefined against kvcache_fuzz
 * (the whole library instrumented) when -DKVC_FUZZ=ON; otherwise
 * fuzz_replay.c replays the seed corpus through the same entry point.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kvcache.h"
#include "fuzz.h"
#include "fuzz_input.h"

/* A plan is sized by the caller's arrays (an MLA plan keeps task state for
 * every query row, a cascade plan accumulators for them), so a corrupted
 * qo_indptr can ask for gigabytes or terabytes; the library then returns
 * KVC_ERR_NOMEM, a documented status. ASan must let the allocation fail
 * instead of aborting, and fail it above 1 GiB: a 16 GiB request that
 * succeeded had ASan write 2 GiB of shadow for it, past the run's RSS
 * limit (a cascade plan for 2^27 query rows, found by a 20-minute run).
 * Set here for clang's fuzzer build, and by ctest (ASAN_OPTIONS) for gcc's
 * shared runtime, which does not see this hook. ASan refuses such a request
 * before libFuzzer's -malloc_limit_mb hook sees it. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) {
    return "allocator_may_return_null=1:max_allocation_size_mb=1024";
}

/* ---- buffers ------------------------------------------------------------- */

enum { IN, OUT, INOUT };
#define MAX_BUFS 48
typedef struct buffer {
    uint8_t *p, *snap, *res;
    size_t n;
    int kind;
} buffer;
static buffer bufs[MAX_BUFS];
static int n_bufs;

static int balloc(size_t n, int kind) {
    CHECK(n_bufs < MAX_BUFS);
    buffer *b = &bufs[n_bufs];
    b->n = n;
    b->kind = kind;
    b->p = malloc(n ? n : 1); /* exact size: ASan sees a byte past the end */
    b->snap = malloc(n ? n : 1);
    b->res = malloc(n ? n : 1);
    CHECK(b->p && b->snap && b->res);
    memset(b->p, 0, n);
    return n_bufs++;
}

static void free_bufs(void) {
    for (int i = 0; i < n_bufs; i++) free(bufs[i].p), free(bufs[i].snap), free(bufs[i].res);
    n_bufs = 0;
}

/* ---- tensors ------------------------------------------------------------- */

static int64_t off_of(const kvc_tensor *t, int64_t flat) {
    int64_t off = 0;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] <= 0) return 0; /* an empty (or corrupted) view has no elements */
    for (int d = t->ndim - 1; d >= 0; d--) {
        int64_t i = flat % t->shape[d];
        flat /= t->shape[d];
        off += i * t->stride[d];
    }
    return off;
}

/* 0 for a rank the corruptions made invalid */
static int64_t numel(const kvc_tensor *t) {
    if (t->ndim < 0 || t->ndim > KVC_MAX_DIMS) return 0;
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

/* element access through memcpy: a misaligned tensor (a corruption) is
 * still filled and read without undefined behaviour here */
#define LOAD(T, p, o) (memcpy(&v_##T, (const char *)(p) + (o) * (int64_t)sizeof(T), sizeof(T)), v_##T)
#define STORE(T, p, o, x) (v_##T = (T)(x), memcpy((char *)(p) + (o) * (int64_t)sizeof(T), &v_##T, sizeof(T)))

static double tget(const kvc_tensor *t, int64_t flat) {
    if (!t->data) return 0; /* a NULL-data corruption */
    int64_t o = off_of(t, flat);
    const void *p = t->data;
    float v_float;
    uint16_t v_uint16_t;
    int32_t v_int32_t;
    int64_t v_int64_t;
    switch (t->dtype) {
    case KVC_F32: return LOAD(float, p, o);
    case KVC_F16: return kvc_f16_to_f32(LOAD(uint16_t, p, o));
    case KVC_BF16: return kvc_bf16_to_f32(LOAD(uint16_t, p, o));
    case KVC_I8: return ((const int8_t *)p)[o];
    case KVC_I4: {
        unsigned b = ((const uint8_t *)p)[o >> 1];
        int nib = (int)((o & 1) ? b >> 4 : b & 15);
        return nib >= 8 ? nib - 16 : nib;
    }
    case KVC_I32: return LOAD(int32_t, p, o);
    case KVC_I64: return (double)LOAD(int64_t, p, o);
    case KVC_U8: return ((const uint8_t *)p)[o];
    default: return 0; /* a dtype corruption */
    }
}

static void tput(kvc_tensor *t, int64_t flat, double v) {
    if (!t->data) return;
    int64_t o = off_of(t, flat);
    void *p = t->data;
    float v_float;
    uint16_t v_uint16_t;
    int32_t v_int32_t;
    int64_t v_int64_t;
    switch (t->dtype) {
    case KVC_F32: STORE(float, p, o, v); break;
    case KVC_F16: STORE(uint16_t, p, o, kvc_f32_to_f16((float)v)); break;
    case KVC_BF16: STORE(uint16_t, p, o, kvc_f32_to_bf16((float)v)); break;
    case KVC_I8: ((int8_t *)p)[o] = (int8_t)v; break;
    case KVC_I4: {
        uint8_t *b = (uint8_t *)p + (o >> 1);
        unsigned nib = (unsigned)(int)v & 15;
        *b = (uint8_t)((o & 1) ? (*b & 15) | (nib << 4) : (*b & 0xF0) | nib);
        break;
    }
    case KVC_I32: STORE(int32_t, p, o, v < -2147483648.0 ? -2147483648.0 : v > 2147483647.0 ? 2147483647.0 : v); break;
    case KVC_I64: STORE(int64_t, p, o, v); break;
    case KVC_U8: ((uint8_t *)p)[o] = (uint8_t)v; break;
    default: break;
    }
}

/* Stride modes: 0 contiguous, 1 padded rows, 2 padded with the outer dims in
 * reverse order, 3 dim 0 broadcast (stride 0; inputs only). */
static kvc_tensor make(int kind, kvc_dtype dt, int nd, const int64_t *shape, int smode, int *buf) {
    kvc_tensor t;
    memset(&t, 0, sizeof t);
    t.dtype = dt;
    t.ndim = nd;
    for (int d = 0; d < nd; d++) t.shape[d] = shape[d];
    if (nd > 0) {
        const int pad = (smode == 1 || smode == 2) ? 2 : 0;
        int64_t cur = (shape[nd - 1] > 0 ? shape[nd - 1] : 1) + pad;
        t.stride[nd - 1] = 1;
        for (int k = 0; k < nd - 1; k++) {
            int d = smode == 2 ? k : nd - 2 - k;
            t.stride[d] = cur;
            cur = cur * (shape[d] > 0 ? shape[d] : 1) + pad;
        }
        if (smode == 3 && nd >= 2 && kind == IN) t.stride[0] = 0;
    }
    int64_t maxoff = 0, n = 1;
    for (int d = 0; d < nd; d++) {
        n *= shape[d];
        if (shape[d] > 0) maxoff += (shape[d] - 1) * t.stride[d];
    }
    size_t bytes = n == 0 ? 0 : (size_t)(((maxoff + 1) * kvc_dtype_bits(dt) + 7) / 8);
    int b = balloc(bytes, kind);
    t.data = bufs[b].p;
    if (buf) *buf = b;
    return t;
}

static double rand_val(kvc_dtype dt) {
    switch (dt) {
    case KVC_I8: return (double)(int)(rnd() % 255) - 127;
    case KVC_I4: return (double)(int)(rnd() % 16) - 8;
    default: return ((double)(int)(rnd() % 65) - 32) / 16.0;
    }
}

static void fill_rand(kvc_tensor *t) {
    int64_t n = numel(t);
    for (int64_t i = 0; i < n; i++) tput(t, i, rand_val(t->dtype));
}

/* positive scales 2^-k (exact in float16) */
static void fill_scale(kvc_tensor *t) {
    int64_t n = numel(t);
    for (int64_t i = 0; i < n; i++) tput(t, i, ldexp(1.0, -(int)(3 + rnd() % 5)));
}

static void fill_ints(kvc_tensor *t, const int64_t *v) {
    int64_t n = numel(t);
    for (int64_t i = 0; i < n; i++) tput(t, i, (double)v[i]);
}

/* ---- one call: slots, expectations ----------------------------------------- */

#define MAX_SLOTS 24
enum { NONE = 0, APPROX, EXACT }; /* how an output is compared across ISAs */
typedef struct slot {
    kvc_tensor t;
    int used, buf, kind, optional, ignored, cmp, is_index, smode, strided_ok, broken;
    const char *name;
} slot;

enum { EXP_VALID, EXP_FAIL, EXP_MAY };

enum {
    OP_APPEND,
    OP_APPEND_MLA,
    OP_SINGLE_DECODE,
    OP_BATCH_DECODE,
    OP_SINGLE_PREFILL,
    OP_PAGED_PREFILL,
    OP_RAGGED_PREFILL,
    OP_CASCADE,
    OP_MLA,
    OP_MERGE,
    OP_MERGE_IN_PLACE,
    OP_MERGE_STATES,
    OP_PMX_STATIC,
    OP_PMX_DYNAMIC,
    OP_PMX_MHCA,
    OP_COUNT
};
static const char *const op_names[OP_COUNT] = {
    "append", "append_mla", "single_decode", "batch_decode", "single_prefill",
    "paged_prefill", "ragged_prefill", "cascade", "mla", "merge_state", "merge_in_place",
    "merge_states", "pmx_static", "pmx_dynamic", "pmx_mhca"};

#define MAX_B 4
#define MAX_LEVELS 2
typedef struct call {
    int op;
    slot s[MAX_SLOTS];
    kvc_tensor *p[MAX_SLOTS]; /* what is passed: &s[i].t or NULL */
    kvc_attn_params ap;
    float sinks[16];
    int n_sinks;
    kvc_pmx_kv_params kp;
    kvc_pmx_mhca_params mp;
    int32_t Hq, H, D, ps, causal, nthreads, qg, layout, levels, Dkpe;
    float mla_scale, mla_cap;
    kvc_threadpool *pool;
    int expect, expect_status, no_compare, plan_failed;
    char log[512]; /* the corruptions, printed with KVC_FUZZ_VERBOSE=1 */
    int n_notes, n_may;
    double tol;
} call;

static kvc_threadpool *pools[3];

static kvc_tensor *add(call *c, int i, const char *name, int kind, kvc_dtype dt, int nd,
                       const int64_t *shape, int smode) {
    slot *s = &c->s[i];
    if (kind != IN && smode == 3) smode = 1;
    s->t = make(kind, dt, nd, shape, smode, &s->buf);
    s->used = 1;
    s->kind = kind;
    s->name = name;
    s->smode = smode;
    s->is_index = dt == KVC_I32 || dt == KVC_I64;
    c->p[i] = &s->t;
    return &s->t;
}

static kvc_tensor *add_ints(call *c, int i, const char *name, kvc_dtype dt, int nd,
                            const int64_t *shape, const int64_t *v, int strided) {
    kvc_tensor *t = add(c, i, name, IN, dt, nd, shape, strided ? 1 : 0);
    fill_ints(t, v);
    return t;
}

static void note(call *c, const char *what, int si) {
    size_t n = strlen(c->log);
    c->n_notes++;
    snprintf(c->log + n, sizeof c->log - n, " %s%s%s", what, si >= 0 ? ":" : "",
             si >= 0 ? (c->s[si].name ? c->s[si].name : "?") : "");
}

static void fail_must(call *c, int status) {
    c->expect = EXP_FAIL;
    c->expect_status = status;
}
static void fail_may(call *c) {
    c->n_may++;
    if (c->expect == EXP_VALID) c->expect = EXP_MAY;
}

static double dtype_tol(kvc_dtype d) {
    return d == KVC_BF16 ? 1e-2 : d == KVC_F16 ? 1e-3 : 1e-5;
}

/* ---- common pieces: params, page tables, paged caches -------------------- */

static const float sm_scales[] = {0.0f, 0.25f, 0.5f, 1.0f, -0.5f, 0.125f};
static const float cap_vals[] = {0.0f, 0.0f, 5.0f, 30.0f};
static const int32_t windows[] = {-1, -1, 0, 1, 3, 100};

static void gen_params(reader *r, call *c, int with_sinks) {
    c->ap = kvc_attn_default_params();
    c->ap.sm_scale = sm_scales[pick(r, 6)];
    c->ap.logits_soft_cap = cap_vals[pick(r, 4)];
    c->ap.window_left = windows[pick(r, 6)];
    c->ap.sinks = NULL;
    if (with_sinks && pick(r, 3) == 2) {
        for (int h = 0; h < c->Hq && h < 16; h++)
            c->sinks[h] = (rnd() % 5 == 0) ? -INFINITY : (float)((int)(rnd() % 33) - 16) / 8.0f;
        c->ap.sinks = c->sinks;
    }
}

typedef struct ptable {
    int B, max_pages, n_idx;
    int64_t pages[MAX_B], lpl[MAX_B], len[MAX_B], indptr[MAX_B + 1], idx[16];
} ptable;

/* B requests of 0..3 pages (0: empty), distinct page ids when distinct. */
static void gen_ptable(reader *r, ptable *pt, int B, int ps, int distinct) {
    pt->B = B;
    pt->indptr[0] = 0;
    for (int b = 0; b < B; b++) {
        pt->pages[b] = pick(r, 4);
        pt->lpl[b] = pt->pages[b] ? 1 + pick(r, (unsigned)ps) : 0;
        pt->len[b] = pt->pages[b] ? ps * (pt->pages[b] - 1) + pt->lpl[b] : 0;
        pt->indptr[b + 1] = pt->indptr[b] + pt->pages[b];
    }
    pt->n_idx = (int)pt->indptr[B];
    pt->max_pages = pt->n_idx + (int)pick(r, 3);
    if (pt->max_pages == 0) pt->max_pages = 1;
    /* a permutation of the pages, rotated, or random (repeats allowed) */
    int rot = (int)pick(r, 8);
    for (int i = 0; i < pt->n_idx; i++)
        pt->idx[i] = distinct ? (i + rot) % pt->max_pages : (int64_t)(rnd() % (uint64_t)pt->max_pages);
}

/* slots of a CSR table */
static void add_ptable(call *c, reader *r, const ptable *pt, int s_indptr, int s_idx, int s_lpl) {
    int64_t n1 = pt->B + 1, n = pt->n_idx, nb = pt->B;
    int strided = (int)pick(r, 2);
    add_ints(c, s_indptr, "kv_indptr", KVC_I32, 1, &n1, pt->indptr, strided);
    add_ints(c, s_idx, "kv_indices", KVC_I32, 1, &n, pt->idx, strided);
    if (s_lpl >= 0) add_ints(c, s_lpl, "kv_last_page_len", KVC_I32, 1, &nb, pt->lpl, strided);
}

/* Corruptions of a CSR table the headers refuse. */
static void corrupt_ptable(reader *r, call *c, int s_indptr, int s_idx, int s_lpl,
                           const ptable *pt) {
    kvc_tensor *ip = &c->s[s_indptr].t, *ix = &c->s[s_idx].t;
    if (c->s[s_indptr].broken || c->s[s_idx].broken || (s_lpl >= 0 && c->s[s_lpl].broken)) return;
    unsigned k = pick(r, 5);
    static const char *const what[] = {"page-id", "last-page-len", "indptr0", "decreasing", "indptr-end"};
    note(c, what[k], s_indptr);
    switch (k) {
    case 0: /* page id out of range */
        if (pt->n_idx > 0) {
            /* the cache's pages (cascade: more than this level's table) */
            int64_t pages = c->s[c->op == OP_APPEND_MLA ? 2 /* M_CKV */ : 0 /* S_K */].t.shape[0];
            tput(ix, pick(r, (unsigned)pt->n_idx), pick(r, 2) ? -1 : (double)pages + pick(r, 3));
            fail_must(c, KVC_ERR_INVALID_ARG);
        }
        break;
    case 1: /* last_page_len 0 with pages, or > page_size */
        if (s_lpl >= 0) {
            int b = (int)pick(r, (unsigned)pt->B);
            if (pt->pages[b] > 0) {
                tput(&c->s[s_lpl].t, b, pick(r, 2) ? 0 : c->ps + 1 + (int)pick(r, 3));
                fail_must(c, KVC_ERR_INVALID_ARG);
            } else {
                tput(&c->s[s_lpl].t, b, 1 + (int)pick(r, 2)); /* an empty request with a length */
                fail_must(c, KVC_ERR_INVALID_ARG);
            }
        }
        break;
    case 2: /* indptr[0] != 0 */
        tput(ip, 0, pick(r, 2) ? 1 : -1);
        fail_must(c, KVC_ERR_INVALID_ARG);
        break;
    case 3: /* decreasing indptr */
        if (pt->B >= 2 && pt->indptr[1] > 0) {
            tput(ip, 1, (double)pt->indptr[2] + 1);
            fail_must(c, KVC_ERR_INVALID_ARG);
        }
        break;
    default: /* indptr[B] past the indices */
        tput(ip, pt->B, (double)pt->indptr[pt->B] + 1 + (int)pick(r, 2));
        fail_must(c, KVC_ERR_INVALID_ARG);
        break;
    }
}

static kvc_dtype pick_float(reader *r) {
    static const kvc_dtype f[] = {KVC_F32, KVC_F16, KVC_BF16};
    return f[pick(r, 3)];
}
static kvc_dtype pick_store(reader *r) {
    static const kvc_dtype f[] = {KVC_F32, KVC_F16, KVC_BF16, KVC_I8, KVC_I4};
    return f[pick(r, 5)];
}

/* Head shape: Hq, H, D (and quant_group for int caches). */
static void gen_heads(reader *r, call *c, kvc_dtype kd) {
    static const int32_t dims[] = {8, 16, 32, 4, 2, 64, 6, 128};
    static const int32_t hs[][2] = {{1, 1}, {2, 1}, {2, 2}, {4, 2}, {3, 1}, {4, 1}};
    int h = (int)pick(r, 6);
    c->Hq = hs[h][0];
    c->H = hs[h][1];
    c->D = dims[pick(r, 8)];
    if (kd == KVC_I4 && c->D % 2) c->D++;
    int32_t g = c->D >> pick(r, 3);
    if (g < 1 || c->D % g) g = c->D;
    if (kd == KVC_I4 && g % 2) g = c->D;
    c->qg = g;
}

enum { S_K, S_V, S_KS, S_VS }; /* first four slots of a cache */

/* K, V (and scales) of a paged cache in slots base..base+3: separate or
 * views of one combined tensor (kvc_paged_cache_from_combined). */
static void add_paged_cache(reader *r, call *c, int base, kvc_dtype kd, int max_pages) {
    int64_t sh[4] = {max_pages, c->ps, c->H, c->D};
    if (c->layout == KVC_HND) sh[1] = c->H, sh[2] = c->ps;
    int sm = (int)pick(r, 3);
    int quant = kd == KVC_I8 || kd == KVC_I4;
    kvc_dtype sd = pick(r, 2) ? KVC_F16 : KVC_F32;
    if (pick(r, 4) == 0 && sm == 0) {
        /* combined (max_pages, 2, ...) */
        int64_t sh5[5] = {max_pages, 2, sh[1], sh[2], c->D};
        int b;
        kvc_tensor kv = make(INOUT, kd, 5, sh5, 0, &b), ks = {0};
        fill_rand(&kv);
        int bs = -1;
        if (quant) {
            sh5[4] = c->D / c->qg;
            ks = make(INOUT, sd, 5, sh5, 0, &bs); /* append writes the scales */
            fill_scale(&ks);
        }
        kvc_paged_cache pc;
        CHECK(kvc_paged_cache_from_combined(&kv, quant ? &ks : NULL, (kvc_kv_layout)c->layout,
                                            c->qg, &pc) == KVC_OK);
        const kvc_tensor *vs[4] = {&pc.k, &pc.v, &pc.k_scale, &pc.v_scale};
        for (int i = 0; i < (quant ? 4 : 2); i++) {
            slot *s = &c->s[base + i];
            s->t = *vs[i];
            s->used = 1;
            s->buf = i < 2 ? b : bs;
            s->kind = INOUT;
            s->name = i < 2 ? "kv_cache" : "kv_scale";
            s->smode = 1;
            c->p[base + i] = &s->t;
        }
        return;
    }
    fill_rand(add(c, base + S_K, "k_cache", INOUT, kd, 4, sh, sm));
    fill_rand(add(c, base + S_V, "v_cache", INOUT, kd, 4, sh, (int)pick(r, 3)));
    if (quant) {
        sh[3] = c->D / c->qg;
        fill_scale(add(c, base + S_KS, "k_scale", INOUT, sd, 4, sh, sm));
        fill_scale(add(c, base + S_VS, "v_scale", INOUT, pick(r, 2) ? KVC_F16 : sd, 4, sh, 0));
    }
}

static kvc_paged_cache paged_of(const call *c, int base) {
    kvc_paged_cache pc;
    memset(&pc, 0, sizeof pc);
    pc.k = c->s[base + S_K].t;
    pc.v = c->s[base + S_V].t;
    if (c->p[base + S_KS]) pc.k_scale = *c->p[base + S_KS];
    if (c->p[base + S_VS]) pc.v_scale = *c->p[base + S_VS];
    pc.layout = (kvc_kv_layout)c->layout;
    pc.quant_group = c->qg;
    return pc;
}

/* out (n, Hq, D) and lse (n, Hq) (lse maybe NULL), compared across ISAs */
static void add_out_lse(reader *r, call *c, int s_out, int s_lse, int64_t n, int64_t Hq, int64_t D,
                        kvc_dtype od) {
    int64_t sh[3] = {n, Hq, D};
    add(c, s_out, "out", OUT, od, 3, sh, (int)pick(r, 3))->dtype = od;
    c->s[s_out].cmp = APPROX;
    if (pick(r, 4)) {
        add(c, s_lse, "lse", OUT, KVC_F32, 2, sh, (int)pick(r, 2));
        c->s[s_lse].cmp = APPROX;
    }
    c->s[s_lse].optional = 1;
}

/* ---- the operations -------------------------------------------------------- */

/* slot numbers per operation */
enum { A_KEY = 4, A_VAL, A_BI, A_POS, A_INDPTR, A_IDX, A_LPL }; /* append: cache in 0..3 */
enum { D_Q = 4, D_OUT, D_LSE, D_INDPTR, D_IDX, D_LPL, D_MASK, D_PMASK, D_QOPTR, D_KVPTR };
enum { M_QN, M_QP, M_CKV, M_KPE, M_OUT, M_LSE, M_QOPTR, M_INDPTR, M_IDX, M_LEN, M_ACKV, M_AKPE,
       M_BI, M_POS };
enum { G_VA, G_SA, G_VB, G_SB, G_VO, G_SO, G_MASK };
enum { P_CK, P_CV, P_START, P_CACHE, P_SCALE, P_KEY, P_VAL, P_SEQ, P_KVS, P_CS, P_MAXS, P_MAXK,
       P_Q, P_DB, P_MASK, P_OUT };

static ptable g_pt[MAX_LEVELS];
static int64_t g_qo[MAX_LEVELS][MAX_B + 1];

static void *plan_sentinel(void) { return (void *)&g_pt; }

/* ---- the calls themselves (run twice: default ISA, scalar) */

static kvc_status run_call(call *c) {
    kvc_tensor **p = c->p;
    kvc_status st = KVC_OK;
    c->plan_failed = 0;
    switch (c->op) {
    case OP_APPEND: {
        kvc_paged_cache pc = paged_of(c, 0);
        st = kvc_append_paged_kv_cache(p[A_KEY], p[A_VAL], p[A_BI], p[A_POS], &pc, p[A_IDX],
                                       p[A_INDPTR], p[A_LPL], c->pool);
        break;
    }
    case OP_APPEND_MLA:
        st = kvc_append_paged_mla_kv_cache(p[M_ACKV], p[M_AKPE], p[M_BI], p[M_POS], p[M_CKV],
                                           p[M_KPE], p[M_IDX], p[M_INDPTR], p[M_LEN], c->pool);
        break;
    case OP_SINGLE_DECODE:
        st = kvc_single_decode(p[D_Q], p[S_K], p[S_V], p[S_KS], p[S_VS], c->qg,
                               (kvc_kv_layout)c->layout, &c->ap, p[D_OUT], p[D_LSE], c->pool);
        break;
    case OP_SINGLE_PREFILL:
        st = kvc_single_prefill(p[D_Q], p[S_K], p[S_V], p[S_KS], p[S_VS], c->qg,
                                (kvc_kv_layout)c->layout, c->causal, p[D_MASK], p[D_PMASK], &c->ap,
                                p[D_OUT], p[D_LSE], c->pool);
        break;
    case OP_BATCH_DECODE: {
        kvc_decode_plan *plan = plan_sentinel();
        st = kvc_decode_plan_create(p[D_INDPTR], p[D_IDX], p[D_LPL], c->Hq, c->H, c->D, c->ps,
                                    c->nthreads, &plan);
        if (st != KVC_OK) {
            CHECK(plan == NULL);
            c->plan_failed = 1;
            break;
        }
        kvc_paged_cache pc = paged_of(c, 0);
        st = kvc_decode_run(plan, p[D_Q], &pc, &c->ap, p[D_OUT], p[D_LSE], c->pool);
        kvc_decode_plan_destroy(plan);
        break;
    }
    case OP_PAGED_PREFILL:
    case OP_RAGGED_PREFILL: {
        kvc_prefill_plan *plan = plan_sentinel();
        if (c->op == OP_PAGED_PREFILL)
            st = kvc_prefill_plan_create_paged(p[D_QOPTR], p[D_INDPTR], p[D_IDX], p[D_LPL], c->Hq,
                                               c->H, c->D, c->ps, c->causal, p[D_MASK],
                                               p[D_PMASK], c->nthreads, &plan);
        else
            st = kvc_prefill_plan_create_ragged(p[D_QOPTR], p[D_KVPTR], c->Hq, c->H, c->D,
                                                c->causal, p[D_MASK], p[D_PMASK], c->nthreads,
                                                &plan);
        if (st != KVC_OK) {
            CHECK(plan == NULL);
            c->plan_failed = 1;
            break;
        }
        if (c->levels) /* run-time mask mode: flip and flip back, or flip */
            CHECK(kvc_prefill_plan_set_causal(plan, !c->causal) == KVC_OK);
        if (c->levels == 1) CHECK(kvc_prefill_plan_set_causal(plan, c->causal) == KVC_OK);
        if (c->op == OP_PAGED_PREFILL) {
            kvc_paged_cache pc = paged_of(c, 0);
            st = kvc_prefill_run_paged(plan, p[D_Q], &pc, &c->ap, p[D_OUT], p[D_LSE], c->pool);
        } else {
            st = kvc_prefill_run_ragged(plan, p[D_Q], p[S_K], p[S_V], p[S_KS], p[S_VS], c->qg,
                                        (kvc_kv_layout)c->layout, &c->ap, p[D_OUT], p[D_LSE],
                                        c->pool);
        }
        kvc_prefill_plan_destroy(plan);
        break;
    }
    case OP_CASCADE: {
        kvc_tensor qo[MAX_LEVELS], ip[MAX_LEVELS], ix[MAX_LEVELS], lp[MAX_LEVELS];
        for (int l = 0; l < c->levels; l++) {
            /* level l's tables in slots 12 + 4l .. */
            qo[l] = c->s[12 + 4 * l].t;
            ip[l] = c->s[13 + 4 * l].t;
            ix[l] = c->s[14 + 4 * l].t;
            lp[l] = c->s[15 + 4 * l].t;
        }
        kvc_cascade_plan *plan = plan_sentinel();
        st = kvc_cascade_plan_create(c->levels, qo, ip, ix, lp, c->Hq, c->H, c->D, c->ps,
                                     c->causal, c->nthreads, &plan);
        if (st != KVC_OK) {
            CHECK(plan == NULL);
            c->plan_failed = 1;
            break;
        }
        kvc_paged_cache pc = paged_of(c, 0);
        st = kvc_cascade_run(plan, p[D_Q], &pc, &c->ap, p[D_OUT], p[D_LSE], c->pool);
        kvc_cascade_plan_destroy(plan);
        break;
    }
    case OP_MLA: {
        kvc_mla_plan *plan = plan_sentinel();
        st = kvc_mla_plan_create(p[M_QOPTR], p[M_INDPTR], p[M_IDX], p[M_LEN], c->Hq, c->D,
                                 c->Dkpe, c->ps, c->causal, c->mla_scale, c->mla_cap, &plan);
        if (st != KVC_OK) {
            CHECK(plan == NULL);
            c->plan_failed = 1;
            break;
        }
        st = kvc_mla_run(plan, p[M_QN], p[M_QP], p[M_CKV], p[M_KPE], p[M_OUT], p[M_LSE], c->pool);
        kvc_mla_plan_destroy(plan);
        break;
    }
    case OP_MERGE:
        st = kvc_merge_state(p[G_VA], p[G_SA], p[G_VB], p[G_SB], p[G_VO], p[G_SO]);
        break;
    case OP_MERGE_IN_PLACE:
        st = kvc_merge_state_in_place(p[G_VA], p[G_SA], p[G_VB], p[G_SB], p[G_MASK]);
        break;
    case OP_MERGE_STATES:
        st = kvc_merge_states(p[G_VA], p[G_SA], p[G_VO], p[G_SO]);
        break;
    case OP_PMX_STATIC:
        st = kvc_pmx_key_value_cache(p[P_CK], p[P_CV], p[P_START], p[P_CACHE], p[P_SCALE], &c->kp,
                                     p[P_KEY], p[P_VAL], c->pool);
        break;
    case OP_PMX_DYNAMIC:
        st = kvc_pmx_dynamic_key_value_cache(p[P_CK], p[P_CV], p[P_SEQ], p[P_KVS], p[P_CS],
                                             p[P_START], p[P_MAXS], p[P_MAXK], p[P_CACHE],
                                             p[P_SCALE], &c->kp, p[P_KEY], p[P_VAL], c->pool);
        break;
    case OP_PMX_MHCA:
        st = kvc_pmx_dynamic_multi_head_cache_attention(
            p[P_Q], p[P_CK], p[P_CV], p[P_SEQ], p[P_KVS], p[P_CS], p[P_START], p[P_DB], p[P_MAXS],
            p[P_MAXK], p[P_CACHE], p[P_SCALE], p[P_MASK], &c->mp, p[P_OUT], c->pool);
        break;
    }
    return st;
}

/* ---- generators: a valid call of each operation ----------------------------- */

static kvc_threadpool *pick_pool(reader *r, int max_threads) {
    int i = (int)pick(r, 3);
    return i > max_threads ? pools[max_threads] : pools[i];
}

static void pack_mask(const uint8_t *m, int64_t n, uint8_t *out) {
    for (int64_t i = 0; i < n; i++)
        if (m[i]) out[i / 8] |= (uint8_t)(1u << (i % 8));
}

/* custom mask (flat, or 2-D for single), packed mask, or none: 0/1/2 */
static void add_masks(reader *r, call *c, const int64_t *qo, const int64_t *kv, int B, int two_d) {
    int kind = (int)pick(r, 3);
    if (kind == 0) return;
    int64_t n = 0, nb = 0;
    for (int b = 0; b < B; b++) n += qo[b] * kv[b], nb += (qo[b] * kv[b] + 7) / 8;
    uint8_t *m = calloc((size_t)n + 1, 1), *pk = calloc((size_t)nb + 1, 1);
    CHECK(m && pk);
    for (int64_t i = 0; i < n; i++) m[i] = rnd() % 3 != 0 ? (uint8_t)(1 + rnd() % 255) : 0;
    if (kind == 1) {
        kvc_tensor *t;
        if (two_d && pick(r, 2)) {
            int64_t sh[2] = {qo[0], kv[0]};
            t = add(c, D_MASK, "custom_mask", IN, KVC_U8, 2, sh, (int)pick(r, 2));
        } else {
            t = add(c, D_MASK, "custom_mask", IN, KVC_U8, 1, &n, 0);
        }
        for (int64_t i = 0; i < n; i++) tput(t, i, m[i]);
    } else {
        /* each request packed separately, padded to a byte */
        int64_t bit = 0, byte = 0;
        for (int b = 0; b < B; b++) {
            pack_mask(m + bit, qo[b] * kv[b], pk + byte);
            bit += qo[b] * kv[b];
            byte += (qo[b] * kv[b] + 7) / 8;
        }
        kvc_tensor *t = add(c, D_PMASK, "packed_custom_mask", IN, KVC_U8, 1, &nb, 0);
        for (int64_t i = 0; i < nb; i++) tput(t, i, pk[i]);
    }
    c->s[D_MASK].optional = c->s[D_PMASK].optional = 1;
    /* masks are read through their strides whatever their dtype became: a
     * dtype corruption to int8 (accepted) then a last stride of 2 read past
     * the buffer made for stride 1 (a harness overflow) */
    c->s[D_MASK].strided_ok = c->s[D_PMASK].strided_ok = 1;
    free(m);
    free(pk);
}

static void gen_append(reader *r, call *c) {
    kvc_dtype kd = pick_store(r);
    gen_heads(r, c, kd);
    c->ps = 1 + (int32_t)pick(r, 4);
    c->layout = (int32_t)pick(r, 2);
    int B = 1 + (int)pick(r, 3);
    ptable *pt = &g_pt[0];
    gen_ptable(r, pt, B, c->ps, 1);
    add_paged_cache(r, c, 0, kd, pt->max_pages);
    for (int i = 0; i < 4; i++) c->s[i].cmp = EXACT;
    int64_t bi[64], pos[64], nnz = 0;
    for (int b = 0; b < B; b++) {
        int64_t a = pick(r, (unsigned)pt->len[b] + 1);
        for (int64_t j = 0; j < a; j++) bi[nnz] = b, pos[nnz++] = pt->len[b] - a + j;
    }
    /* the cache's own dtype (a plain copy) or a float dtype */
    kvc_dtype ad = pick(r, 4) == 0 ? kd : pick_float(r);
    kvc_dtype vd = ad; /* the call refuses different dtypes (paged.h does not say) */
    c->s[S_KS].ignored = c->s[S_VS].ignored = ad == kd; /* a plain copy: scales unused */
    int64_t sh[3] = {nnz, c->H, c->D};
    fill_rand(add(c, A_KEY, "append_key", IN, ad, 3, sh, (int)pick(r, 4)));
    fill_rand(add(c, A_VAL, "append_value", IN, vd, 3, sh, (int)pick(r, 4)));
    int strided = (int)pick(r, 2);
    add_ints(c, A_BI, "batch_indices", KVC_I32, 1, &nnz, bi, strided);
    add_ints(c, A_POS, "positions", KVC_I32, 1, &nnz, pos, strided);
    add_ptable(c, r, pt, A_INDPTR, A_IDX, A_LPL);
    c->pool = pick_pool(r, 2);
}

static void gen_append_mla(reader *r, call *c) {
    static const int32_t dck[] = {16, 8, 3, 32}, dkp[] = {16, 4, 1, 8};
    c->D = dck[pick(r, 4)];
    c->Dkpe = dkp[pick(r, 4)];
    c->ps = 1 + (int32_t)pick(r, 4);
    int B = 1 + (int)pick(r, 3);
    ptable *pt = &g_pt[0];
    gen_ptable(r, pt, B, c->ps, 1);
    kvc_dtype cd = pick_float(r), kd = pick_float(r);
    if (pick(r, 3) == 0 && cd == kd) {
        /* slices of one (max_pages, page_size, D_ckv + D_kpe) tensor */
        int64_t sh[3] = {pt->max_pages, c->ps, c->D + c->Dkpe};
        int b;
        kvc_tensor all = make(INOUT, cd, 3, sh, 0, &b);
        fill_rand(&all);
        for (int i = 0; i < 2; i++) {
            slot *s = &c->s[M_CKV + i];
            s->t = all;
            s->t.shape[2] = i ? c->Dkpe : c->D;
            if (i) s->t.data = (char *)all.data + (size_t)c->D * (size_t)(kvc_dtype_bits(cd) / 8);
            s->used = 1, s->buf = b, s->kind = INOUT, s->smode = 1, s->cmp = EXACT;
            s->name = i ? "kpe_cache" : "ckv_cache";
            c->p[M_CKV + i] = &s->t;
        }
    } else {
        int64_t sh[3] = {pt->max_pages, c->ps, c->D};
        fill_rand(add(c, M_CKV, "ckv_cache", INOUT, cd, 3, sh, (int)pick(r, 3)));
        sh[2] = c->Dkpe;
        fill_rand(add(c, M_KPE, "kpe_cache", INOUT, kd, 3, sh, (int)pick(r, 3)));
        c->s[M_CKV].cmp = c->s[M_KPE].cmp = EXACT;
    }
    int64_t bi[64], pos[64], nnz = 0;
    for (int b = 0; b < B; b++) {
        int64_t a = pick(r, (unsigned)pt->len[b] + 1);
        for (int64_t j = 0; j < a; j++) bi[nnz] = b, pos[nnz++] = pt->len[b] - a + j;
    }
    int64_t sh[2] = {nnz, c->D};
    fill_rand(add(c, M_ACKV, "append_ckv", IN, pick_float(r), 2, sh, (int)pick(r, 4)));
    sh[1] = c->Dkpe;
    fill_rand(add(c, M_AKPE, "append_kpe", IN, pick_float(r), 2, sh, (int)pick(r, 4)));
    int strided = (int)pick(r, 2);
    add_ints(c, M_BI, "batch_indices", KVC_I32, 1, &nnz, bi, strided);
    add_ints(c, M_POS, "positions", KVC_I32, 1, &nnz, pos, strided);
    add_ptable(c, r, pt, M_INDPTR, M_IDX, M_LEN);
    c->pool = pick_pool(r, 2);
}

/* contiguous-cache K/V (kv_len keys) and scales in slots 0..3 */
static void add_kv(reader *r, call *c, kvc_dtype kd, int64_t kv_len) {
    int64_t sh[3] = {kv_len, c->H, c->D};
    if (c->layout == KVC_HND) sh[0] = c->H, sh[1] = kv_len;
    int sm = (int)pick(r, 4);
    fill_rand(add(c, S_K, "k", IN, kd, 3, sh, sm));
    fill_rand(add(c, S_V, "v", IN, kd, 3, sh, (int)pick(r, 4)));
    if (kd == KVC_I8 || kd == KVC_I4) {
        kvc_dtype sd = pick(r, 2) ? KVC_F16 : KVC_F32;
        sh[2] = c->D / c->qg;
        fill_scale(add(c, S_KS, "k_scale", IN, sd, 3, sh, sm));
        fill_scale(add(c, S_VS, "v_scale", IN, pick(r, 2) ? sd : KVC_F32, 3, sh, 0));
    }
}

static void set_tol(call *c, kvc_dtype a, kvc_dtype b, kvc_dtype d) {
    double t = dtype_tol(a);
    if (dtype_tol(b) > t) t = dtype_tol(b);
    if (dtype_tol(d) > t) t = dtype_tol(d);
    c->tol = t;
}

static void gen_single(reader *r, call *c, int prefill) {
    kvc_dtype kd = pick_store(r), qd = pick_float(r), od = pick_float(r);
    gen_heads(r, c, kd);
    c->layout = (int32_t)pick(r, 2);
    int64_t kv = pick(r, 10), qo = prefill ? 1 + pick(r, 5) : 1;
    add_kv(r, c, kd, kv);
    gen_params(r, c, 1);
    int64_t qsh[3] = {qo, c->Hq, c->D};
    fill_rand(add(c, D_Q, "q", IN, qd, prefill ? 3 : 2, prefill ? qsh : qsh + 1, (int)pick(r, 4)));
    if (prefill) {
        add_out_lse(r, c, D_OUT, D_LSE, qo, c->Hq, c->D, od);
        c->causal = (int32_t)pick(r, 2);
        add_masks(r, c, &qo, &kv, 1, 1);
    } else {
        add_out_lse(r, c, D_OUT, D_LSE, 1, c->Hq, c->D, od);
        /* drop the leading 1 */
        for (int i = D_OUT; i <= D_LSE; i++)
            if (c->s[i].used) {
                kvc_tensor *t = &c->s[i].t;
                for (int d = 0; d + 1 < t->ndim; d++)
                    t->shape[d] = t->shape[d + 1], t->stride[d] = t->stride[d + 1];
                t->ndim--;
            }
    }
    c->s[S_KS].optional = c->s[S_VS].optional = kd != KVC_I8 && kd != KVC_I4;
    set_tol(c, qd, kd, od);
    c->pool = pick_pool(r, 2);
}

static void gen_batch(reader *r, call *c, int op) {
    kvc_dtype kd = pick_store(r), qd = pick_float(r), od = pick_float(r);
    gen_heads(r, c, kd);
    c->layout = (int32_t)pick(r, 2);
    c->ps = 1 + (int32_t)pick(r, 4);
    int B = 1 + (int)pick(r, 3);
    ptable *pt = &g_pt[0];
    int64_t qo[MAX_B + 1] = {0}, kvl[MAX_B], kvp[MAX_B + 1] = {0}, N = 0;
    if (op == OP_RAGGED_PREFILL) {
        for (int b = 0; b < B; b++) kvl[b] = pick(r, 6), kvp[b + 1] = kvp[b] + kvl[b];
        add_kv(r, c, kd, kvp[B]);
        int64_t n1 = B + 1;
        add_ints(c, D_KVPTR, "kv_indptr", KVC_I32, 1, &n1, kvp, (int)pick(r, 2));
    } else {
        gen_ptable(r, pt, B, c->ps, (int)pick(r, 2));
        add_paged_cache(r, c, 0, kd, pt->max_pages);
        for (int i = 0; i < 4; i++)
            if (c->s[i].used) c->s[i].kind = IN, bufs[c->s[i].buf].kind = IN;
        add_ptable(c, r, pt, D_INDPTR, D_IDX, D_LPL);
        for (int b = 0; b < B; b++) kvl[b] = pt->len[b];
    }
    for (int b = 0; b < B; b++) {
        int64_t n = op == OP_BATCH_DECODE ? 1 : pick(r, 4);
        g_qo[0][b + 1] = g_qo[0][b] + n;
        qo[b] = n;
    }
    N = g_qo[0][B];
    if (op != OP_BATCH_DECODE) {
        int64_t n1 = B + 1;
        add_ints(c, D_QOPTR, "qo_indptr", KVC_I32, 1, &n1, g_qo[0], (int)pick(r, 2));
        c->causal = (int32_t)pick(r, 2);
        add_masks(r, c, qo, kvl, B, 0);
        c->levels = (int32_t)pick(r, 3); /* set_causal: no, twice, once */
        if (c->levels == 2 && !c->s[D_MASK].used && !c->s[D_PMASK].used) c->causal = !c->causal;
        else if (c->levels == 2) c->levels = 1;
    }
    gen_params(r, c, 1);
    int64_t qsh[3] = {N, c->Hq, c->D};
    fill_rand(add(c, D_Q, "q", IN, qd, 3, qsh, (int)pick(r, 4)));
    add_out_lse(r, c, D_OUT, D_LSE, N, c->Hq, c->D, od);
    c->nthreads = 1 + (int32_t)pick(r, 2);
    c->pool = pick_pool(r, op == OP_BATCH_DECODE ? 2 : c->nthreads);
    c->s[S_KS].optional = c->s[S_VS].optional = kd != KVC_I8 && kd != KVC_I4;
    set_tol(c, qd, kd, od);
}

static void gen_cascade(reader *r, call *c) {
    kvc_dtype kd = pick_store(r), qd = pick_float(r), od = pick_float(r);
    gen_heads(r, c, kd);
    c->layout = (int32_t)pick(r, 2);
    c->ps = 1 + (int32_t)pick(r, 4);
    c->levels = 1 + (int32_t)pick(r, 2);
    int B = 1 + (int)pick(r, 3), maxp = 1;
    /* last level: B requests; level 0 of two: one request over every row */
    g_qo[c->levels - 1][0] = 0;
    for (int b = 0; b < B; b++) g_qo[c->levels - 1][b + 1] = g_qo[c->levels - 1][b] + pick(r, 4);
    int64_t N = g_qo[c->levels - 1][B];
    if (c->levels == 2) g_qo[0][0] = 0, g_qo[0][1] = N;
    for (int l = 0; l < c->levels; l++) {
        int Bl = l + 1 < c->levels ? 1 : B;
        gen_ptable(r, &g_pt[l], Bl, c->ps, (int)pick(r, 2));
        if (g_pt[l].max_pages > maxp) maxp = g_pt[l].max_pages;
    }
    add_paged_cache(r, c, 0, kd, maxp);
    for (int i = 0; i < 4; i++)
        if (c->s[i].used) c->s[i].kind = IN, bufs[c->s[i].buf].kind = IN;
    for (int l = 0; l < c->levels; l++) {
        int64_t n1 = g_pt[l].B + 1;
        add_ints(c, 12 + 4 * l, "qo_indptr", KVC_I32, 1, &n1, g_qo[l], (int)pick(r, 2));
        add_ptable(c, r, &g_pt[l], 13 + 4 * l, 14 + 4 * l, 15 + 4 * l);
    }
    c->causal = (int32_t)pick(r, 2);
    gen_params(r, c, 1);
    int64_t qsh[3] = {N, c->Hq, c->D};
    fill_rand(add(c, D_Q, "q", IN, qd, 3, qsh, (int)pick(r, 4)));
    add_out_lse(r, c, D_OUT, D_LSE, N, c->Hq, c->D, od);
    c->nthreads = 1 + (int32_t)pick(r, 2);
    c->pool = pick_pool(r, c->nthreads);
    set_tol(c, qd, kd, od);
}

static void gen_mla(reader *r, call *c) {
    static const float scales[] = {0.25f, 0.5f, 1.0f, -0.5f, 0.125f};
    c->D = pick(r, 3) ? 16 : 32;
    c->Dkpe = pick(r, 2) ? 16 : 0;
    c->Hq = 1 + (int32_t)pick(r, 4);
    c->ps = 1 + (int32_t)pick(r, 4);
    c->causal = (int32_t)pick(r, 2);
    c->mla_scale = scales[pick(r, 5)];
    c->mla_cap = cap_vals[pick(r, 4)];
    int B = 1 + (int)pick(r, 3);
    int64_t qo[MAX_B + 1] = {0}, kvp[MAX_B + 1] = {0}, len[MAX_B], idx[64];
    int maxp = 1 + (int)pick(r, 2), n_idx = 0;
    for (int b = 0; b < B; b++) {
        qo[b + 1] = qo[b] + pick(r, 3);
        len[b] = pick(r, 8);
        kvp[b + 1] = kvp[b] + (len[b] + c->ps - 1) / c->ps;
    }
    n_idx = (int)kvp[B];
    if (n_idx > maxp) maxp = n_idx;
    for (int i = 0; i < n_idx; i++) idx[i] = (int64_t)(rnd() % (uint64_t)maxp);
    int64_t n1 = B + 1, nb = B, ni = n_idx + pick(r, 2); /* indices may be longer */
    for (int i = n_idx; i < ni; i++) idx[i] = 0;
    int strided = (int)pick(r, 2);
    add_ints(c, M_QOPTR, "qo_indptr", KVC_I32, 1, &n1, qo, strided);
    add_ints(c, M_INDPTR, "kv_indptr", KVC_I32, 1, &n1, kvp, strided);
    add_ints(c, M_IDX, "kv_indices", KVC_I32, 1, &ni, idx, strided);
    add_ints(c, M_LEN, "kv_len_arr", KVC_I32, 1, &nb, len, strided);
    kvc_dtype cd = pick_float(r), kd = pick_float(r), qd = pick_float(r), od = pick_float(r);
    int64_t sh[3] = {maxp, c->ps, c->D};
    fill_rand(add(c, M_CKV, "ckv_cache", IN, cd, 3, sh, (int)pick(r, 3)));
    sh[2] = c->Dkpe;
    fill_rand(add(c, M_KPE, "kpe_cache", IN, kd, 3, sh, (int)pick(r, 3)));
    int64_t qsh[3] = {qo[B], c->Hq, c->D};
    fill_rand(add(c, M_QN, "q_nope", IN, qd, 3, qsh, (int)pick(r, 4)));
    qsh[2] = c->Dkpe;
    fill_rand(add(c, M_QP, "q_pe", IN, pick(r, 2) ? qd : pick_float(r), 3, qsh, (int)pick(r, 4)));
    add_out_lse(r, c, M_OUT, M_LSE, qo[B], c->Hq, c->D, od);
    /* no rope part: the call takes NULL for q_pe and kpe_cache (mla.h does not say) */
    c->s[M_QP].optional = c->s[M_KPE].optional = c->Dkpe == 0;
    c->pool = pick_pool(r, 2);
    set_tol(c, qd, c->s[M_QP].t.dtype, od);
    set_tol(c, c->tol == 1e-2 ? KVC_BF16 : c->tol == 1e-3 ? KVC_F16 : KVC_F32, cd, kd);
}

static void fill_lse(kvc_tensor *t) {
    int64_t n = numel(t);
    for (int64_t i = 0; i < n; i++)
        tput(t, i, rnd() % 6 == 0 ? -INFINITY : ((double)(int)(rnd() % 161) - 80) / 8.0);
}

static void gen_merge(reader *r, call *c) {
    kvc_dtype vd = pick_float(r);
    int64_t N = pick(r, 4), H = 1 + pick(r, 3), D = 1 + pick(r, 17), n = pick(r, 4);
    int64_t vsh[4] = {N, H, D}, ssh[3] = {N, H};
    int kind = c->op == OP_MERGE_IN_PLACE ? INOUT : IN;
    if (c->op == OP_MERGE_STATES) {
        int64_t v4[4] = {N, n, H, D}, s3[3] = {N, n, H};
        fill_rand(add(c, G_VA, "v", IN, vd, 4, v4, (int)pick(r, 4)));
        fill_lse(add(c, G_SA, "s", IN, KVC_F32, 3, s3, (int)pick(r, 3)));
    } else {
        fill_rand(add(c, G_VA, "v_a", kind, vd, 3, vsh, (int)pick(r, 4)));
        fill_lse(add(c, G_SA, "s_a", kind, KVC_F32, 2, ssh, (int)pick(r, 4)));
        fill_rand(add(c, G_VB, "v_b", IN, vd, 3, vsh, (int)pick(r, 4)));
        fill_lse(add(c, G_SB, "s_b", IN, KVC_F32, 2, ssh, (int)pick(r, 4)));
    }
    c->s[G_SA].strided_ok = c->s[G_SB].strided_ok = c->s[G_SO].strided_ok = 1; /* any strides */
    if (c->op == OP_MERGE_IN_PLACE) {
        c->s[G_VA].cmp = c->s[G_SA].cmp = APPROX;
        if (pick(r, 2)) {
            kvc_tensor *m = add(c, G_MASK, "mask", IN, KVC_U8, 1, &N, (int)pick(r, 2));
            for (int64_t i = 0; i < N; i++) tput(m, i, rnd() % 3 ? 1 + (double)(rnd() % 255) : 0);
        }
        c->s[G_MASK].optional = 1;
    } else {
        add(c, G_VO, "v_out", OUT, vd, 3, vsh, (int)pick(r, 3));
        add(c, G_SO, "s_out", OUT, KVC_F32, 2, ssh, (int)pick(r, 3));
        c->s[G_VO].cmp = c->s[G_SO].cmp = APPROX;
    }
    c->tol = dtype_tol(vd);
}

/* pmx: kv params, the cache (6-D static, 5-D dynamic) and its scale */
static void gen_pmx_kv(reader *r, call *c, kvc_dtype *cd, int dynamic) {
    static const int32_t dims[] = {8, 16, 4, 2, 32, 6};
    *cd = pick_store(r);
    c->kp = kvc_pmx_kv_default_params();
    c->kp.num_layer = 1 + (int32_t)pick(r, 2);
    c->kp.layer_idx = (int32_t)pick(r, (unsigned)c->kp.num_layer);
    c->kp.quant_bit = *cd == KVC_I8 ? 8 : *cd == KVC_I4 ? 4 : 0;
    c->kp.num_repeat = 1 + (int32_t)pick(r, 2);
    c->kp.cache_layout = (int32_t)pick(r, dynamic ? 4 : 2);
    c->kp.cache_mode = dynamic ? (int32_t)pick(r, 2) : 0;
    c->kp.page_size = 1 + (int32_t)pick(r, 4);
    c->H = 1 + (int32_t)pick(r, 2);
    c->D = dims[pick(r, 6)];
    int32_t g = c->D >> pick(r, 3);
    if (g < 1 || c->D % g || (*cd == KVC_I4 && g % 2)) g = c->D;
    c->kp.quant_group = g;
}

static void add_pmx_cache(reader *r, call *c, kvc_dtype cd, int nd, const int64_t *sh, int out_kind) {
    int64_t s2[6];
    memcpy(s2, sh, sizeof(int64_t) * (size_t)nd);
    int sm = (int)pick(r, 3);
    fill_rand(add(c, P_CACHE, "cache", out_kind, cd, nd, sh, sm));
    c->s[P_CACHE].cmp = EXACT;
    c->s[P_SCALE].optional = c->kp.quant_bit == 0;
    if (c->kp.quant_bit || pick(r, 4) == 0) {
        s2[nd - 1] = c->D / c->kp.quant_group;
        fill_scale(add(c, P_SCALE, "scale", out_kind, pick(r, 2) ? KVC_F16 : KVC_F32, nd, s2, sm));
        c->s[P_SCALE].cmp = EXACT;
        c->s[P_SCALE].ignored = c->kp.quant_bit == 0; /* pmx.h: ignored then */
    }
}

static void gen_pmx_static(reader *r, call *c) {
    kvc_dtype cd;
    gen_pmx_kv(r, c, &cd, 0);
    kvc_dtype td = pick_float(r);
    if (cd == KVC_I8 && pick(r, 3) == 0) td = KVC_I8, c->kp.quant_bit = 0; /* plain copy */
    int64_t B = 1 + pick(r, 2), S = 1 + pick(r, 3), start = pick(r, 4);
    int64_t maxB = B + pick(r, 2), maxS = start + S + pick(r, 2), L = c->kp.num_layer;
    int64_t sh[6] = {maxB, L, 2, maxS, c->H, c->D};
    if (c->kp.cache_layout == 1)
        sh[0] = L, sh[1] = maxB, sh[3] = c->H, sh[4] = maxS;
    add_pmx_cache(r, c, cd, 6, sh, INOUT);
    int64_t csh[4] = {B, S, c->H, c->D};
    fill_rand(add(c, P_CK, "current_key", IN, td, 4, csh, (int)pick(r, 4)));
    fill_rand(add(c, P_CV, "current_value", IN, td, 4, csh, (int)pick(r, 4)));
    int64_t one = 1;
    add_ints(c, P_START, "start_pos", KVC_I64, (int)pick(r, 2), &one, &start, 0);
    int64_t osh[4] = {B, start + S, c->H * c->kp.num_repeat, c->D};
    for (int i = 0; i < 2; i++) {
        if (pick(r, 4) == 0) continue;
        add(c, P_KEY + i, i ? "value" : "key", OUT, td, 4, osh, (int)pick(r, 3));
        c->s[P_KEY + i].cmp = EXACT;
        c->s[P_KEY + i].optional = 1;
    }
    c->s[P_KEY].optional = c->s[P_VAL].optional = 1;
    c->pool = pick_pool(r, 2);
}

static int64_t g_maxt;

/* seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen and the
 * 5-D cache of a dynamic call; returns B and the totals */
static void gen_pmx_dyn_common(reader *r, call *c, kvc_dtype cd, int64_t *n_seq, int64_t *n_kv,
                               int out_kind) {
    int B = 1 + (int)pick(r, 3), ps = c->kp.page_size;
    int64_t seq[MAX_B + 1] = {0}, kvs[MAX_B + 1] = {0}, sp[MAX_B], cs[MAX_B * 8], msq = 0, mkv = 0;
    int64_t maxp = 1, t = 0;
    for (int b = 0; b < B; b++) {
        int64_t S = pick(r, 4);
        sp[b] = pick(r, 4);
        seq[b + 1] = seq[b] + S;
        kvs[b + 1] = kvs[b] + sp[b] + S;
        if (S > msq) msq = S;
        if (sp[b] + S > mkv) mkv = sp[b] + S;
        int64_t np = (sp[b] + S + ps - 1) / ps;
        if (np > maxp) maxp = np;
    }
    if (maxp > 8) maxp = 8;
    if (c->kp.cache_mode == 0) {
        for (int b = 0; b < B; b++) cs[b] = t, t += kvs[b + 1] - kvs[b] + pick(r, 2);
    } else {
        maxp += pick(r, 2);
        if (maxp > 8) maxp = 8;
        int64_t page = 0;
        for (int b = 0; b < B; b++) {
            int64_t np = (kvs[b + 1] - kvs[b] + ps - 1) / ps;
            for (int64_t j = 0; j < maxp; j++)
                cs[b * maxp + j] = j < np ? (page++) * ps : -1;
        }
        t = page * ps;
    }
    g_maxt = t + pick(r, 3);
    if (g_maxt == 0) g_maxt = 1;
    int64_t n1 = B + 1, nb = B, csh[2] = {B, maxp}, one = 1;
    int strided = (int)pick(r, 2);
    add_ints(c, P_SEQ, "seqstarts", KVC_I64, 1, &n1, seq, strided);
    add_ints(c, P_KVS, "kvstarts", KVC_I64, 1, &n1, kvs, strided);
    add_ints(c, P_CS, "cachestarts", KVC_I64, c->kp.cache_mode ? 2 : 1, c->kp.cache_mode ? csh : &nb,
             cs, strided);
    add_ints(c, P_START, "start_pos", KVC_I64, 1, &nb, sp, strided);
    msq += pick(r, 2);
    mkv += pick(r, 2);
    add_ints(c, P_MAXS, "max_seqlen", KVC_I64, (int)pick(r, 2), &one, &msq, 0);
    add_ints(c, P_MAXK, "max_kvlen", KVC_I64, (int)pick(r, 2), &one, &mkv, 0);
    int64_t L = c->kp.num_layer, T = g_maxt, H = c->H, D = c->D;
    int64_t shs[4][5] = {{T, L, 2, H, D}, {L, T, 2, H, D}, {L, 2, T, H, D}, {L, 2, H, T, D}};
    add_pmx_cache(r, c, cd, 5, shs[c->kp.cache_layout], out_kind);
    *n_seq = seq[B];
    *n_kv = kvs[B];
}

static void gen_pmx_dynamic(reader *r, call *c) {
    kvc_dtype cd;
    gen_pmx_kv(r, c, &cd, 1);
    kvc_dtype td = pick_float(r);
    if (cd == KVC_I8 && pick(r, 3) == 0) td = KVC_I8, c->kp.quant_bit = 0;
    int64_t ns, nk;
    gen_pmx_dyn_common(r, c, cd, &ns, &nk, INOUT);
    int64_t csh[3] = {ns, c->H, c->D};
    fill_rand(add(c, P_CK, "current_key", IN, td, 3, csh, (int)pick(r, 4)));
    fill_rand(add(c, P_CV, "current_value", IN, td, 3, csh, (int)pick(r, 4)));
    int64_t osh[3] = {nk, c->H * c->kp.num_repeat, c->D};
    for (int i = 0; i < 2; i++) {
        if (pick(r, 4) == 0) continue;
        add(c, P_KEY + i, i ? "value" : "key", OUT, td, 3, osh, (int)pick(r, 3));
        c->s[P_KEY + i].cmp = EXACT;
    }
    c->s[P_KEY].optional = c->s[P_VAL].optional = 1;
    c->pool = pick_pool(r, 2);
}

static void gen_pmx_mhca(reader *r, call *c) {
    kvc_dtype cd;
    gen_pmx_kv(r, c, &cd, 1);
    c->kp.num_repeat = 1;
    c->mp = kvc_pmx_mhca_default_params();
    c->Hq = c->H * (1 + (int32_t)pick(r, 2));
    c->mp.kv = c->kp;
    c->mp.num_heads = c->Hq;
    c->mp.head_dim = c->D;
    c->mp.num_kv_heads = c->Hq == c->H && pick(r, 2) ? 0 : c->H;
    c->mp.is_causal = (int32_t)pick(r, 2);
    kvc_dtype qd = pick_float(r);
    int64_t ns, nk;
    gen_pmx_dyn_common(r, c, cd, &ns, &nk, INOUT);
    int64_t csh[3] = {ns, c->H, c->D}, qsh[3] = {ns, c->Hq, c->D};
    fill_rand(add(c, P_CK, "current_key", IN, pick_float(r), 3, csh, (int)pick(r, 4)));
    fill_rand(add(c, P_CV, "current_value", IN, c->s[P_CK].t.dtype, 3, csh, (int)pick(r, 4)));
    fill_rand(add(c, P_Q, "query", IN, qd, 3, qsh, (int)pick(r, 4)));
    int64_t B = c->s[P_START].t.shape[0], db = pick(r, (unsigned)B + 1), one = 1;
    add_ints(c, P_DB, "decoding_batches", KVC_I64, (int)pick(r, 2), &one, &db, 0);
    if (pick(r, 2)) {
        int64_t msh[3] = {c->Hq, ns, nk + pick(r, 3)};
        int three = (int)pick(r, 2);
        kvc_tensor *m = add(c, P_MASK, "attn_mask", IN, pick(r, 2) ? KVC_F16 : KVC_F32,
                            three ? 3 : 2, three ? msh : msh + 1, (int)pick(r, 3));
        int64_t n = numel(m);
        for (int64_t i = 0; i < n; i++)
            tput(m, i, rnd() % 7 == 0 ? -INFINITY : ((double)(int)(rnd() % 33) - 16) / 8.0);
    }
    c->s[P_MASK].optional = 1;
    add(c, P_OUT, "attn_output", OUT, qd, 3, qsh, (int)pick(r, 3));
    c->s[P_OUT].cmp = APPROX;
    c->pool = pick_pool(r, 2);
    set_tol(c, qd, c->s[P_CK].t.dtype, cd == KVC_I8 || cd == KVC_I4 ? KVC_F32 : cd);
}

/* ---- corruptions ------------------------------------------------------------ */

/* Moves slot i's tensor into a new buffer made for shape sh (values copied
 * where the indices exist in both) and misaligned by skew bytes. */
static int remake(call *c, int i, const int64_t *sh, int skew) {
    slot *s = &c->s[i];
    kvc_tensor old = s->t;
    int b;
    /* not after a corruption of its layout (the old view may lie outside its buffer) */
    if (s->broken || kvc_dtype_bits(old.dtype) == 0 || old.ndim < 0 || old.ndim > KVC_MAX_DIMS)
        return 0;
    kvc_tensor t = make(s->kind, old.dtype, old.ndim, sh, s->smode == 3 ? 1 : s->smode, &b);
    if (skew) {
        buffer *nb = &bufs[b];
        uint8_t *p = realloc(nb->p, nb->n + (size_t)skew);
        uint8_t *q = realloc(nb->snap, nb->n + (size_t)skew);
        uint8_t *r2 = realloc(nb->res, nb->n + (size_t)skew);
        CHECK(p && q && r2);
        nb->p = p, nb->snap = q, nb->res = r2, nb->n += (size_t)skew;
        memset(p, 0, nb->n);
        t.data = p + skew;
    }
    int64_t n = numel(&t);
    for (int64_t f = 0; f < n; f++) {
        int64_t rem = f, of = 0, mul = 1, inside = 1;
        for (int d = t.ndim - 1; d >= 0; d--) {
            int64_t idx = rem % t.shape[d];
            rem /= t.shape[d];
            if (idx >= old.shape[d]) inside = 0;
            of += idx * mul;
            mul *= old.shape[d];
        }
        if (inside) tput(&t, f, tget(&old, of));
    }
    s->t = t;
    s->buf = b;
    return 1;
}

static int pick_slot(reader *r, const call *c) {
    int used[MAX_SLOTS], n = 0;
    for (int i = 0; i < MAX_SLOTS; i++)
        if (c->s[i].used) used[n++] = i;
    return n ? used[pick(r, (unsigned)n)] : -1;
}

/* slots passed by value (paged-cache views, cascade levels) cannot be NULL */
static int by_value(const call *c, int i) {
    int paged = c->op == OP_APPEND || c->op == OP_BATCH_DECODE || c->op == OP_PAGED_PREFILL ||
                c->op == OP_CASCADE;
    return (paged && i <= S_V) || (c->op == OP_CASCADE && i >= 12);
}

static void corrupt_tensor(reader *r, call *c) {
    int i = pick_slot(r, c);
    if (i < 0 || !c->p[i]) return; /* none, or already passed as NULL */
    if (c->s[i].t.ndim < 0 || c->s[i].t.ndim > KVC_MAX_DIMS) return; /* rank already broken */
    slot *s = &c->s[i];
    kvc_tensor *t = &s->t;
    int last = t->ndim - 1;
    unsigned k = pick(r, 10);
    static const char *const what[] = {"dtype", "rank", "shape", "neg-stride", "last-stride",
                                       "misalign", "null", "null-data", "overlap", "index-value"};
    note(c, what[k], i);
    int before = c->expect;
    switch (k) {
    case 0: { /* dtype: one no wider (no read past the buffer), or no dtype at all */
        int nd = (int)pick(r, KVC_DTYPE_COUNT + 2) - 1;
        if (nd < 0 || nd >= KVC_DTYPE_COUNT || nd == KVC_FP8_E4M3) {
            t->dtype = (kvc_dtype)(nd < 0 ? 99 : nd);
            fail_must(c, KVC_ERR_INVALID_ARG);
        } else if (kvc_dtype_bits((kvc_dtype)nd) <= kvc_dtype_bits(t->dtype) &&
                   (kvc_dtype)nd != t->dtype) {
            t->dtype = (kvc_dtype)nd;
            fail_may(c);
            c->no_compare = 1;
        }
        break;
    }
    case 1: /* rank */
        if (pick(r, 2)) {
            t->ndim = pick(r, 2) ? -1 : KVC_MAX_DIMS + 1;
            fail_must(c, KVC_ERR_INVALID_ARG);
        } else if (t->ndim > 0) {
            t->ndim--;
            fail_may(c);
        }
        break;
    case 2: { /* a size one smaller or larger */
        if (t->ndim <= 0) break;
        int d = (int)pick(r, (unsigned)t->ndim);
        int64_t sh[KVC_MAX_DIMS];
        memcpy(sh, t->shape, sizeof sh);
        sh[d] += pick(r, 2) ? 1 : -1;
        if (sh[d] < 0) break;
        if (t->dtype == KVC_I4 && d == last && sh[d] % 2) break;
        if (sh[d] < t->shape[d] && s->smode != 3) t->shape[d] = sh[d];
        else remake(c, i, sh, 0);
        fail_may(c);
        break;
    }
    case 3: /* a negative stride */
        for (int d = 0; d < last; d++)
            if (t->shape[d] > 1 && t->stride[d] > 0) {
                t->stride[d] = -t->stride[d];
                fail_must(c, KVC_ERR_INVALID_ARG);
                break;
            }
        break;
    case 4: /* last dimension not contiguous */
        if (last >= 0 && t->shape[last] > 1) {
            if (s->is_index || t->dtype == KVC_U8 || s->strided_ok) {
                /* index tensors and masks may be strided (paged.h; the
                 * library honours strides of them everywhere): stride 0,
                 * which stays inside the buffer */
                t->stride[last] = 0;
                fail_may(c);
                c->no_compare = 1;
            } else {
                t->stride[last] = pick(r, 2) ? 0 : 2;
                fail_must(c, KVC_ERR_INVALID_ARG);
            }
        }
        break;
    case 5: /* misaligned data */
        if (kvc_dtype_bits(t->dtype) >= 16 && numel(t) > 0) {
            int64_t sh[KVC_MAX_DIMS];
            memcpy(sh, t->shape, sizeof sh);
            if (remake(c, i, sh, 1)) fail_must(c, KVC_ERR_INVALID_ARG);
        }
        break;
    case 6: /* NULL tensor */
        if (by_value(c, i)) break;
        c->p[i] = NULL;
        if (s->optional) fail_may(c), c->no_compare = 1;
        else fail_must(c, KVC_ERR_INVALID_ARG);
        break;
    case 7: /* NULL data */
        if (t->ndim >= 0 && numel(t) > 0) {
            t->data = NULL;
            fail_must(c, KVC_ERR_INVALID_ARG);
        }
        break;
    case 8: /* a written tensor whose rows share memory: refused (internal.h,
             * kvc__check_writable); the outcome would depend on the write order */
        if (s->kind != IN && t->ndim >= 2 && t->shape[0] > 1) {
            t->stride[0] = 0;
            fail_must(c, KVC_ERR_INVALID_ARG);
        }
        break;
    default: /* an index value */
        if (s->is_index && !s->broken && numel(t) > 0) {
            static const double vals[] = {-1, 0, 1, 2, 3, 7, 1 << 20, 2147483647.0, -2147483648.0};
            int64_t e = pick(r, (unsigned)numel(t));
            double v = vals[pick(r, 9)];
            if (pick(r, 2)) v = tget(t, e) + (pick(r, 2) ? 1 : -1);
            tput(t, e, v);
            fail_may(c);
        }
        break;
    }
    /* an ignored tensor, or an empty one (core.h: nothing is read, so its
     * strides and data do not matter), may pass */
    int layout_only = k == 3 || k == 4 || k == 5 || k == 7;
    if (layout_only || k == 0 || k == 1) s->broken = 1; /* its view may now lie outside */
    if ((s->ignored || ((layout_only || k == 8) && numel(t) == 0)) && c->expect == EXP_FAIL &&
        before != EXP_FAIL)
        c->expect = EXP_MAY;
}

static const float bad_floats[] = {NAN, INFINITY, -INFINITY, 3e38f, 1e30f, -1e30f, 1e-30f, 0.0f};

static void corrupt_params(reader *r, call *c) {
    switch (c->op) {
    case OP_SINGLE_DECODE: case OP_SINGLE_PREFILL: case OP_BATCH_DECODE:
    case OP_PAGED_PREFILL: case OP_RAGGED_PREFILL: case OP_CASCADE:
        note(c, "attn-params", -1);
        switch (pick(r, 4)) {
        case 0: { /* sinks the header refuses: NaN, +inf, > FLT_MAX / log2 e */
            static const float refused[] = {NAN, INFINITY, 3e38f, -NAN};
            for (int h = 0; h < c->Hq && h < 16; h++) c->sinks[h] = 0.5f;
            c->sinks[pick(r, (unsigned)(c->Hq < 16 ? c->Hq : 16))] = refused[pick(r, 4)];
            c->ap.sinks = c->sinks;
            fail_must(c, KVC_ERR_INVALID_ARG);
            break;
        }
        case 1:
            c->ap.sm_scale = bad_floats[pick(r, 8)];
            fail_may(c);
            /* scores past 2^31 (log2 units) are outside attention.h's
             * domain: unspecified, different on each ISA */
            if (fabsf(c->ap.sm_scale) > 1e20f) c->no_compare = 1;
            break;
        case 2: c->ap.logits_soft_cap = pick(r, 2) ? bad_floats[pick(r, 8)] : -1.0f; fail_may(c); break;
        default: c->ap.window_left = pick(r, 2) ? -2 - (int32_t)pick(r, 3) : INT32_MAX; fail_may(c); break;
        }
        break;
    case OP_MLA:
        note(c, "mla-params", -1);
        if (pick(r, 2)) {
            c->mla_scale = bad_floats[pick(r, 8)];
            if (!isfinite(c->mla_scale) || c->mla_scale == 0) fail_must(c, KVC_ERR_INVALID_ARG);
            else fail_may(c);
            /* scores past 2^31 (log2 units) are outside attention.h's
             * domain: unspecified, different on each ISA */
            if (fabsf(c->mla_scale) > 1e20f) c->no_compare = 1;
        } else {
            c->mla_cap = pick(r, 2) ? bad_floats[pick(r, 8)] : -1.0f;
            fail_may(c);
        }
        break;
    case OP_PMX_STATIC: case OP_PMX_DYNAMIC: case OP_PMX_MHCA: {
        kvc_pmx_kv_params *kp = c->op == OP_PMX_MHCA ? &c->mp.kv : &c->kp;
        unsigned k = pick(r, 8);
        note(c, k == 0 ? "pmx-layer" : k == 1 ? "pmx-bits" : k == 2 ? "pmx-group" : k == 3 ? "pmx-repeat"
                : k == 4 ? "pmx-layout" : k == 5 ? "pmx-mode" : k == 6 ? "pmx-page" : "pmx-heads", -1);
        switch (k) {
        case 0: kp->layer_idx = pick(r, 2) ? kp->num_layer : -1; fail_must(c, KVC_ERR_INVALID_ARG); break;
        case 1: kp->quant_bit = pick(r, 2) ? 2 : 16; fail_must(c, KVC_ERR_INVALID_ARG); break;
        case 2: kp->quant_group = pick(r, 2) ? 0 : 3; fail_may(c); break;
        case 3: kp->num_repeat = pick(r, 2) ? 0 : kp->num_repeat + 1; fail_may(c); break;
        case 4: kp->cache_layout = pick(r, 2) ? -1 : 4; fail_must(c, KVC_ERR_INVALID_ARG); break;
        case 5: kp->cache_mode = pick(r, 2) ? -1 : 2; fail_may(c); break;
        case 6: kp->page_size = pick(r, 2) ? 0 : kp->page_size + 1; fail_may(c); break;
        default:
            if (c->op == OP_PMX_MHCA) {
                switch (pick(r, 4)) {
                case 0: c->mp.is_alibi = 1; fail_must(c, KVC_ERR_UNSUPPORTED); break;
                case 1: c->mp.num_heads += 1; fail_must(c, KVC_ERR_INVALID_ARG); break;
                case 2: c->mp.head_dim += 2; fail_must(c, KVC_ERR_INVALID_ARG); break;
                default: c->mp.num_kv_heads = c->Hq + 1; fail_must(c, KVC_ERR_INVALID_ARG); break;
                }
            } else {
                kp->num_layer = 0;
                fail_must(c, KVC_ERR_INVALID_ARG);
            }
        }
        break;
    }
    default: break;
    }
}

/* the integer arguments of a call */
static void corrupt_ints(reader *r, call *c) {
    unsigned k = pick(r, 7);
    static const char *const what[] = {"heads", "head-dim", "page-size", "quant-group", "layout",
                                       "causal", "threads"};
    note(c, what[k], -1);
    switch (k) {
    case 0: /* heads that do not divide */
        if (c->op == OP_BATCH_DECODE || c->op == OP_PAGED_PREFILL || c->op == OP_RAGGED_PREFILL ||
            c->op == OP_CASCADE) { /* the calls that take head counts */
            c->H = c->Hq + 1;
            fail_must(c, KVC_ERR_INVALID_ARG);
        }
        break;
    case 1: /* a head dim that does not match (or is too large) */
        if (c->op >= OP_SINGLE_DECODE && c->op <= OP_CASCADE) {
            if (c->op == OP_SINGLE_DECODE || c->op == OP_SINGLE_PREFILL) break; /* no D argument */
            c->D = pick(r, 2) ? c->D + 1 : 1024;
            fail_must(c, c->D == 1024 ? KVC_ERR_UNSUPPORTED : KVC_ERR_INVALID_ARG);
        } else if (c->op == OP_MLA) {
            c->D = pick(r, 2) ? 8 : 1024;
            fail_must(c, KVC_ERR_UNSUPPORTED);
        }
        break;
    case 2: /* page size */
        if (c->op == OP_BATCH_DECODE || c->op == OP_PAGED_PREFILL || c->op == OP_CASCADE ||
            c->op == OP_MLA) {
            /* 0, or one more: never back to the cache's size when repeated */
            c->ps = pick(r, 2) || c->ps == 0 ? 0 : c->ps + 1;
            if (c->op != OP_MLA || c->ps == 0) fail_must(c, KVC_ERR_INVALID_ARG);
            else fail_may(c);
        }
        break;
    case 3: /* quant group */
        if (c->s[S_KS].used && c->op != OP_MLA && c->op != OP_APPEND_MLA && c->op < OP_MERGE) {
            c->qg = pick(r, 2) ? 0 : c->qg + 1;
            const kvc_tensor *ks = &c->s[S_KS].t;
            int still_valid = c->qg > 0 && c->D % c->qg == 0 && ks->ndim > 0 &&
                              ks->shape[ks->ndim - 1] == c->D / c->qg; /* after repeats */
            /* a plain int8/int4 copy does not use the scales (paged.h) */
            if (still_valid || (c->op == OP_APPEND && c->s[A_KEY].t.dtype == c->s[S_K].t.dtype))
                fail_may(c);
            else fail_must(c, KVC_ERR_INVALID_ARG);
        }
        break;
    case 4: /* layout */
        if (c->op == OP_SINGLE_DECODE || c->op == OP_SINGLE_PREFILL || c->op == OP_RAGGED_PREFILL ||
            c->op == OP_APPEND || c->op == OP_BATCH_DECODE || c->op == OP_PAGED_PREFILL ||
            c->op == OP_CASCADE) {
            c->layout = pick(r, 2) ? 2 : -1;
            fail_must(c, KVC_ERR_INVALID_ARG);
        }
        break;
    case 5: /* causal not 0/1 */
        c->causal = pick(r, 2) ? 2 : -1;
        fail_may(c);
        break;
    default: /* thread counts: plan for 1, run on 2; or <= 0, too many */
        c->nthreads = pick(r, 2) ? 1 : (pick(r, 2) ? 0 : 5000);
        if (c->nthreads == 1) c->pool = pools[2];
        fail_may(c);
        break;
    }
}

static void corrupt_special(reader *r, call *c) {
    switch (c->op) {
    case OP_APPEND: corrupt_ptable(r, c, A_INDPTR, A_IDX, A_LPL, &g_pt[0]); break;
    case OP_APPEND_MLA: corrupt_ptable(r, c, M_INDPTR, M_IDX, M_LEN, &g_pt[0]); break;
    case OP_BATCH_DECODE: case OP_PAGED_PREFILL:
        corrupt_ptable(r, c, D_INDPTR, D_IDX, D_LPL, &g_pt[0]);
        break;
    case OP_CASCADE: {
        int l = (int)pick(r, (unsigned)c->levels);
        corrupt_ptable(r, c, 13 + 4 * l, 14 + 4 * l, 15 + 4 * l, &g_pt[l]);
        break;
    }
    case OP_MLA: /* a page id past the caches */
        if (!c->s[M_IDX].broken && !c->s[M_INDPTR].broken && !c->s[M_CKV].broken &&
            c->s[M_IDX].t.shape[0] > 0 && c->s[M_INDPTR].used &&
            tget(&c->s[M_INDPTR].t, numel(&c->s[M_INDPTR].t) - 1) > 0) {
            note(c, "page-id", M_IDX);
            tput(&c->s[M_IDX].t, 0, (double)c->s[M_CKV].t.shape[0] + pick(r, 2));
            fail_must(c, KVC_ERR_INVALID_ARG);
        }
        break;
    case OP_PMX_DYNAMIC: case OP_PMX_MHCA:
        /* a slot past MaxT */
        if (c->kp.cache_mode == 0 && !c->s[P_CS].broken && numel(&c->s[P_CS].t) > 0) {
            note(c, "slot", P_CS);
            tput(&c->s[P_CS].t, 0, (double)g_maxt);
            /* only a batch that stores or reads something touches it */
            fail_may(c);
        }
        break;
    default: break;
    }
}

/* NaN/Inf/huge values in one float input */
static int inject_specials(reader *r, call *c) {
    int i = pick_slot(r, c);
    if (i < 0) return 0;
    note(c, "specials", i);
    kvc_tensor *t = &c->s[i].t;
    if (c->s[i].broken || c->s[i].is_index || t->ndim < 0 || numel(t) == 0 || c->s[i].kind == OUT) return 0;
    if (t->dtype != KVC_F32 && t->dtype != KVC_F16 && t->dtype != KVC_BF16) return 0;
    static const double sp[] = {NAN, INFINITY, -INFINITY, 1e38, 65504.0, 1e6};
    int n = 1 + (int)pick(r, 3);
    for (int k = 0; k < n; k++) tput(t, pick(r, 255) % numel(t), sp[pick(r, 6)]);
    fail_may(c);
    c->no_compare = 1;
    return 1;
}

/* ---- checks ----------------------------------------------------------------- */

/* a within tol of b relative to 1 + |b|; infinities must be equal */
static int near(double a, double b, double tol) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    if (isinf(a) || isinf(b)) return a == b;
    return fabs(a - b) <= tol * (1.0 + fabs(b));
}

static void report(const call *c, const char *what, int si, int64_t i, double a, double b) {
    fprintf(stderr, "fuzz_attn: %s %s: %s[%lld] %.9g vs %.9g (tol %g)\n", op_names[c->op], what,
            c->s[si].name ? c->s[si].name : "?", (long long)i, a, b, c->tol);
}

/* max |x| over tensor i: over its view, or, when a corruption may have moved
 * the view outside its buffer (broken), over the whole buffer read in the
 * view's dtype (a bound for what a valid call read: a q given stride 0 by a
 * "negative stride" corruption used to count as 0, so the score tolerance
 * was too) */
static double amax(const call *c, int i) {
    if (!c->s[i].used || !c->p[i]) return 0;
    kvc_tensor t1 = *c->p[i];
    const kvc_tensor *t = &t1;
    if (c->s[i].broken) {
        const int bits = (unsigned)t1.dtype < KVC_DTYPE_COUNT ? kvc_dtype_bits(t1.dtype) : 0;
        if (bits <= 0) return 0;
        t1.data = bufs[c->s[i].buf].p;
        t1.ndim = 1;
        t1.shape[0] = (int64_t)(bufs[c->s[i].buf].n * 8 / (size_t)bits);
        t1.stride[0] = 1;
    }
    double m = 0;
    int64_t n = numel(t);
    for (int64_t k = 0; k < n; k++)
        if (fabs(tget(t, k)) > m) m = fabs(tget(t, k));
    return m;
}
static double max2(double a, double b) { return a > b ? a : b; }

/* Extra tolerance for large scores: float32 rounds each score at 2^-24 of
 * its magnitude (attention.h), which moves the weights by as much; bounded
 * here from the data, times the largest value. */
static double score_tol(const call *c) {
    double q, k, v, scale = fabs(c->ap.sm_scale), D = c->D;
    switch (c->op) {
    case OP_SINGLE_DECODE: case OP_SINGLE_PREFILL: case OP_BATCH_DECODE:
    case OP_PAGED_PREFILL: case OP_RAGGED_PREFILL: case OP_CASCADE:
        q = amax(c, D_Q);
        k = amax(c, S_K) * (c->s[S_KS].used ? amax(c, S_KS) : 1);
        v = amax(c, S_V) * (c->s[S_VS].used ? amax(c, S_VS) : 1);
        if (scale == 0) scale = 1 / sqrt(D);
        break;
    case OP_MLA:
        q = max2(amax(c, M_QN), amax(c, M_QP));
        k = max2(amax(c, M_CKV), amax(c, M_KPE));
        v = amax(c, M_CKV);
        D += c->Dkpe;
        scale = fabs(c->mla_scale);
        break;
    case OP_PMX_MHCA:
        q = amax(c, P_Q);
        k = v = max2(amax(c, P_CACHE) * (c->s[P_SCALE].used ? amax(c, P_SCALE) : 1),
                     amax(c, P_CK) + amax(c, P_CV));
        scale = 1 / sqrt(D);
        break;
    default: return 0;
    }
    return 0x1p-22 * scale * D * q * k * (1 + v);
}

/* float64 attention of one request over contiguous K/V (single decode and
 * prefill), against what the call wrote (checked on the scalar ISA) */
static void ref_single(const call *c) {
    const kvc_tensor *q = c->p[D_Q], *k = c->p[S_K], *v = c->p[S_V], *ks = c->p[S_KS],
                     *vs = c->p[S_VS], *out = c->p[D_OUT], *lse = c->p[D_LSE];
    const kvc_tensor *mask = c->p[D_MASK], *pmask = c->p[D_PMASK];
    int prefill = c->op == OP_SINGLE_PREFILL, quant = k->dtype == KVC_I8 || k->dtype == KVC_I4;
    int64_t qo = prefill ? q->shape[0] : 1, kv = c->layout == KVC_NHD ? k->shape[0] : k->shape[1];
    int64_t Hq = c->Hq, H = c->H, D = c->D, G = D / c->qg;
    double scale = c->ap.sm_scale == 0 ? 1.0 / sqrt((double)D) : c->ap.sm_scale;
    double cap = c->ap.logits_soft_cap;
    double *s = malloc(sizeof(double) * (size_t)(kv + 1)), stol = score_tol(c);
    CHECK(s);
    for (int64_t i = 0; i < qo; i++)
        for (int64_t h = 0; h < Hq; h++) {
            int64_t kh = h / (Hq / H);
            double m = -INFINITY;
            for (int64_t j = 0; j < kv; j++) {
                int vis = 1;
                int64_t diag = i + kv - qo;
                if (mask) vis = tget(mask, i * kv + j) != 0;
                else if (pmask) {
                    int64_t bit = i * kv + j;
                    vis = ((int)tget(pmask, bit / 8) >> (bit % 8)) & 1;
                } else if (prefill && c->causal) vis = j <= diag;
                if (c->ap.window_left >= 0 && j < diag - c->ap.window_left) vis = 0;
                if (!vis) {
                    s[j] = -INFINITY;
                    continue;
                }
                double dot = 0;
                for (int64_t d = 0; d < D; d++) {
                    int64_t kix = c->layout == KVC_NHD ? (j * H + kh) * D + d : (kh * kv + j) * D + d;
                    double kval = tget(k, kix);
                    if (quant)
                        kval *= tget(ks, c->layout == KVC_NHD ? (j * H + kh) * G + d / c->qg
                                                              : (kh * kv + j) * G + d / c->qg);
                    dot += tget(q, (i * Hq + h) * D + d) * kval;
                }
                s[j] = dot * scale;
                if (cap > 0) s[j] = cap * tanh(s[j] / cap);
                if (s[j] > m) m = s[j];
            }
            double sink = c->ap.sinks ? c->ap.sinks[h] : -INFINITY;
            if (sink > m) m = sink;
            double den = 0, tol = c->tol + stol;
            for (int64_t j = 0; j < kv; j++)
                if (s[j] != -INFINITY) den += exp(s[j] - m);
            if (sink != -INFINITY) den += exp(sink - m);
            for (int64_t d = 0; d < D; d++) {
                double o = 0;
                for (int64_t j = 0; j < kv; j++) {
                    if (s[j] == -INFINITY) continue;
                    int64_t vix = c->layout == KVC_NHD ? (j * H + kh) * D + d : (kh * kv + j) * D + d;
                    double vval = tget(v, vix);
                    if (quant)
                        vval *= tget(vs, c->layout == KVC_NHD ? (j * H + kh) * G + d / c->qg
                                                              : (kh * kv + j) * G + d / c->qg);
                    o += exp(s[j] - m) * vval;
                }
                o = den > 0 ? o / den : 0;
                double got = tget(out, (i * Hq + h) * D + d);
                if (!near(got, o, tol)) {
                    report(c, "float64 reference", D_OUT, (i * Hq + h) * D + d, got, o);
                    CHECK(0 && "output differs from the float64 reference");
                }
            }
            if (lse) {
                double want = den > 0 ? (m + log(den)) / log(2.0) : -INFINITY;
                double got = tget(lse, i * Hq + h);
                if (!near(got, want, tol)) {
                    report(c, "float64 reference", D_LSE, i * Hq + h, got, want);
                    CHECK(0 && "lse differs from the float64 reference");
                }
            }
        }
    free(s);
}

static void ref_merge(const call *c) {
    const kvc_tensor *va = c->p[G_VA], *sa = c->p[G_SA], *vb = c->p[G_VB], *sb = c->p[G_SB];
    const kvc_tensor *vo = c->p[G_VO], *so = c->p[G_SO];
    int64_t N = va->shape[0], H = va->shape[1], D = va->shape[2];
    for (int64_t i = 0; i < N * H; i++) {
        double a = tget(sa, i), b = tget(sb, i), m = a > b ? a : b, s = -INFINITY;
        double wa = 0, wb = 0;
        if (m != -INFINITY) {
            wa = exp2(a - m), wb = exp2(b - m);
            s = m + log2(wa + wb);
        }
        if (!near(tget(so, i), s, c->tol)) {
            report(c, "float64 reference", G_SO, i, tget(so, i), s);
            CHECK(0 && "merged lse differs from the float64 reference");
        }
        for (int64_t d = 0; d < D; d++) {
            double want = m == -INFINITY ? 0
                                         : (wa * tget(va, i * D + d) + wb * tget(vb, i * D + d)) /
                                               (wa + wb);
            double got = tget(vo, i * D + d);
            if (!near(got, want, c->tol)) {
                report(c, "float64 reference", G_VO, i * D + d, got, want);
                CHECK(0 && "merged v differs from the float64 reference");
            }
        }
    }
}

/* per operation: [expectation][status class] */
enum { ST_OK, ST_INVALID, ST_UNSUPPORTED, ST_NOMEM, ST_PLAN, ST_N };
static unsigned long stats[OP_COUNT][3][ST_N];

static void print_stats(void) {
    static const char *const ex[] = {"valid", "refused", "maybe"};
    fprintf(stderr, "fuzz_attn stats: op expectation ok invalid unsupported nomem (failed at plan)\n");
    unsigned long tot[3][ST_N] = {{0}};
    for (int o = 0; o < OP_COUNT; o++)
        for (int e = 0; e < 3; e++) {
            unsigned long *s = stats[o][e];
            for (int k = 0; k < ST_N; k++) tot[e][k] += s[k];
            if (s[0] + s[1] + s[2] + s[3])
                fprintf(stderr, "  %-15s %-7s %8lu %8lu %8lu %5lu (%lu)\n", op_names[o], ex[e], s[0],
                        s[1], s[2], s[3], s[4]);
        }
    for (int e = 0; e < 3; e++)
        fprintf(stderr, "  %-15s %-7s %8lu %8lu %8lu %5lu (%lu)\n", "TOTAL", ex[e], tot[e][0],
                tot[e][1], tot[e][2], tot[e][3], tot[e][4]);
}

static int has_nan(const kvc_tensor *t) {
    if (t->dtype != KVC_F32 && t->dtype != KVC_F16 && t->dtype != KVC_BF16) return 0;
    int64_t n = numel(t);
    for (int64_t i = 0; i < n; i++)
        if (isnan(tget(t, i))) return 1;
    return 0;
}

static void execute(call *c, int specials) {
    static int verbose = -1;
    if (verbose < 0) verbose = getenv("KVC_FUZZ_VERBOSE") && *getenv("KVC_FUZZ_VERBOSE") != '0';
    if (verbose)
        fprintf(stderr, "fuzz_attn: %s %s:%s\n", op_names[c->op],
                c->expect == EXP_VALID ? "valid" : c->expect == EXP_FAIL ? "refused" : "maybe",
                c->log);
    if (verbose) {
        fprintf(stderr, "  Hq %d H %d D %d qg %d ps %d layout %d causal %d threads %d scale %g cap %g "
                "window %d sinks %d pool %d mla %g/%g\n", c->Hq, c->H, c->D, c->qg, c->ps, c->layout,
                c->causal, c->nthreads, c->ap.sm_scale, c->ap.logits_soft_cap, c->ap.window_left,
                c->ap.sinks != NULL, kvc_threadpool_n_threads(c->pool), c->mla_scale, c->mla_cap);
        for (int i = 0; i < MAX_SLOTS; i++) {
            const kvc_tensor *t = &c->s[i].t;
            if (!c->s[i].used) continue;
            fprintf(stderr, "  %s%s %s (", c->s[i].name, c->p[i] ? "" : " NULL", kvc_dtype_name(t->dtype));
            for (int d = 0; d < t->ndim && d < KVC_MAX_DIMS; d++)
                fprintf(stderr, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
            fprintf(stderr, ") stride (");
            for (int d = 0; d < t->ndim && d < KVC_MAX_DIMS; d++)
                fprintf(stderr, "%s%lld", d ? ", " : "", (long long)t->stride[d]);
            fprintf(stderr, ")\n");
        }
    }
    for (int i = 0; i < n_bufs; i++) {
        if (bufs[i].kind == OUT) memset(bufs[i].p, 0xA5, bufs[i].n);
        memcpy(bufs[i].snap, bufs[i].p, bufs[i].n);
    }
    kvc_clear_error();
    kvc_status st = run_call(c);
    CHECK(st == KVC_OK || st == KVC_ERR_INVALID_ARG || st == KVC_ERR_UNSUPPORTED ||
          st == KVC_ERR_NOMEM);
    int plan_failed = c->plan_failed;
    if (st != KVC_OK) {
        CHECK(kvc_last_error()[0] != 0);
        for (int i = 0; i < n_bufs; i++) {
            if (memcmp(bufs[i].p, bufs[i].snap, bufs[i].n) != 0) {
                fprintf(stderr, "fuzz_attn: %s failed (%s) but changed buffer %d\n",
                        op_names[c->op], kvc_last_error(), i);
                CHECK(0 && "a failed call wrote");
            }
        }
    } else {
        for (int i = 0; i < n_bufs; i++)
            if (bufs[i].kind == IN) CHECK(memcmp(bufs[i].p, bufs[i].snap, bufs[i].n) == 0);
    }
    if (c->expect == EXP_VALID && st != KVC_OK)
        fprintf(stderr, "fuzz_attn: valid %s refused: %s\n", op_names[c->op], kvc_last_error());
    if (c->expect == EXP_VALID) CHECK(st == KVC_OK);
    if (c->expect == EXP_FAIL) {
        if (st == KVC_OK)
            fprintf(stderr, "fuzz_attn: %s accepted a refused call (corruptions:%s)\n",
                    op_names[c->op], c->log);
        CHECK(st != KVC_OK);
        if (c->n_notes == 1 && c->expect_status && st != c->expect_status)
            fprintf(stderr, "fuzz_attn: %s: %s, expected %s (%s)\n", op_names[c->op],
                    kvc_status_str(st), kvc_status_str((kvc_status)c->expect_status),
                    kvc_last_error());
        /* the status a lone corruption gets (with several, the first one checked wins) */
        CHECK(c->n_notes > 1 || !c->expect_status || st == c->expect_status);
    }
    int cls = st == KVC_OK ? ST_OK : st == KVC_ERR_INVALID_ARG ? ST_INVALID
              : st == KVC_ERR_UNSUPPORTED ? ST_UNSUPPORTED : ST_NOMEM;
    stats[c->op][c->expect][cls]++;
    if (plan_failed) stats[c->op][c->expect][ST_PLAN]++;

    /* again on the scalar ISA, from the same bytes */
    kvc_isa isa = kvc_get_isa();
    if (isa != KVC_ISA_SCALAR) {
        for (int i = 0; i < n_bufs; i++) {
            memcpy(bufs[i].res, bufs[i].p, bufs[i].n);
            memcpy(bufs[i].p, bufs[i].snap, bufs[i].n);
        }
        CHECK(kvc_set_isa(KVC_ISA_SCALAR) == KVC_OK);
        kvc_status st2 = run_call(c);
        CHECK(kvc_set_isa(isa) == KVC_OK);
        if (st2 != st)
            fprintf(stderr, "fuzz_attn: %s: %s on %s, %s on scalar\n", op_names[c->op],
                    kvc_status_str(st), kvc_isa_name(isa), kvc_status_str(st2));
        CHECK(st2 == st);
        if (st == KVC_OK && !c->no_compare) {
            double tol = c->tol + score_tol(c);
            for (int i = 0; i < MAX_SLOTS; i++) {
                slot *s = &c->s[i];
                if (!s->used || !c->p[i] || s->cmp == NONE || s->broken) continue;
                buffer *b = &bufs[s->buf];
                if (s->cmp == EXACT) {
                    if (memcmp(b->p, b->res, b->n) != 0) {
                        size_t k = 0;
                        while (b->p[k] == b->res[k]) k++;
                        fprintf(stderr, "fuzz_attn: %s: %s byte %zu: %s 0x%02x, scalar 0x%02x\n",
                                op_names[c->op], s->name, k, kvc_isa_name(isa), b->res[k], b->p[k]);
                        CHECK(0 && "a store differs between ISAs");
                    }
                    continue;
                }
                kvc_tensor other = s->t;
                other.data = b->res + ((uint8_t *)s->t.data - b->p);
                int64_t n = numel(&s->t);
                for (int64_t k = 0; k < n; k++) {
                    double a = tget(&other, k), e = tget(&s->t, k);
                    if (!near(a, e, tol)) {
                        report(c, kvc_isa_name(isa), i, k, a, e);
                        CHECK(0 && "an output differs between the ISA and scalar");
                    }
                }
            }
        }
    }
    /* again with the other thread count (pool 1 <-> 2 threads; a plan's
     * n_threads 1 <-> 2 with it), same ISA, from the same bytes: core.h
     * promises bitwise identical results for any thread count */
    if (st == KVC_OK) {
        const int t = kvc_threadpool_n_threads(c->pool), t2 = t >= 2 ? 1 : 2;
        kvc_threadpool *pool = c->pool;
        const int32_t nthreads = c->nthreads;
        c->pool = pools[t2];
        if (nthreads == 1 || nthreads == 2) c->nthreads = t2;
        for (int i = 0; i < n_bufs; i++) {
            if (isa == KVC_ISA_SCALAR) memcpy(bufs[i].res, bufs[i].p, bufs[i].n);
            memcpy(bufs[i].p, bufs[i].snap, bufs[i].n);
        }
        kvc_status st3 = run_call(c);
        c->pool = pool;
        c->nthreads = nthreads;
        if (st3 != st)
            fprintf(stderr, "fuzz_attn: %s: %s with %d threads, %s with %d (%s)\n",
                    op_names[c->op], kvc_status_str(st), t, kvc_status_str(st3), t2,
                    kvc_last_error());
        CHECK(st3 == st);
        for (int i = 0; i < n_bufs; i++) {
            if (memcmp(bufs[i].p, bufs[i].res, bufs[i].n) == 0) continue;
            size_t k = 0;
            while (bufs[i].p[k] == bufs[i].res[k]) k++;
            fprintf(stderr, "fuzz_attn: %s: buffer %d byte %zu: 0x%02x with %d threads, 0x%02x "
                            "with %d\n", op_names[c->op], i, k, bufs[i].res[k], t, bufs[i].p[k], t2);
            CHECK(0 && "a result depends on the thread count");
        }
    }
    /* valid, finite: no NaN, and the float64 references */
    if (st == KVC_OK && c->expect == EXP_VALID && !specials) {
        for (int i = 0; i < MAX_SLOTS; i++)
            if (c->s[i].used && c->p[i] && !c->s[i].broken && c->s[i].kind != IN &&
                has_nan(&c->s[i].t)) {
                fprintf(stderr, "fuzz_attn: %s: NaN in %s\n", op_names[c->op], c->s[i].name);
                CHECK(0 && "NaN in an output");
            }
        if (c->op == OP_SINGLE_DECODE || c->op == OP_SINGLE_PREFILL) ref_single(c);
        if (c->op == OP_MERGE) ref_merge(c);
    }
}

/* ---- entry --------------------------------------------------------------------- */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_start(pools, print_stats);
    reader r = {data, size, 0};
    call *c = calloc(1, sizeof *c);
    CHECK(c);
    unsigned flags;
    c->op = fuzz_header(&r, OP_COUNT, &flags);
    c->qg = 1;
    c->tol = 1e-5;
    memset(g_qo, 0, sizeof g_qo);
    switch (c->op) {
    case OP_APPEND: gen_append(&r, c); break;
    case OP_APPEND_MLA: gen_append_mla(&r, c); break;
    case OP_SINGLE_DECODE: gen_single(&r, c, 0); break;
    case OP_SINGLE_PREFILL: gen_single(&r, c, 1); break;
    case OP_BATCH_DECODE: case OP_PAGED_PREFILL: case OP_RAGGED_PREFILL: gen_batch(&r, c, c->op); break;
    case OP_CASCADE: gen_cascade(&r, c); break;
    case OP_MLA: gen_mla(&r, c); break;
    case OP_MERGE: case OP_MERGE_IN_PLACE: case OP_MERGE_STATES: gen_merge(&r, c); break;
    case OP_PMX_STATIC: gen_pmx_static(&r, c); break;
    case OP_PMX_DYNAMIC: gen_pmx_dynamic(&r, c); break;
    default: gen_pmx_mhca(&r, c); break;
    }
    c->expect = EXP_VALID;
    /* flags: bits 0-1 corruptions, bit 2 specials */
    int n_corrupt = (int)(flags & 3);
    for (int k = 0; k < n_corrupt; k++) {
        switch (pick(&r, 4)) {
        case 0: corrupt_tensor(&r, c); break;
        case 1: corrupt_params(&r, c); break;
        case 2: corrupt_ints(&r, c); break;
        default: corrupt_special(&r, c); break;
        }
    }
    int specials = (flags & 4) ? inject_specials(&r, c) : 0;
    /* a corruption that may pass can also undo a refused one (a stride 0
     * over a bad page id): refused only when every corruption is */
    if (c->expect == EXP_FAIL && c->n_may > 0) c->expect = EXP_MAY;
    execute(c, specials);
    free_bufs();
    free(c);
    return 0;
}
