/*
 * Prefill attention (include/kvcache/prefill.h, SEMANTICS section 5): the
 * engine described in prefill_internal.h and the public single / paged /
 * ragged entry points.
 *
 * Per task (request b, query tile, KV head h, head group), lanes m = (query
 * row, query head) of the tile:
 *   Qt (D, Mp)   <- q rows * sm_scale * log2 e, transposed
 *   per key block [ja, je) (inside one absolute KB-aligned block):
 *     K rows -> float32 tile (n, Dk)       (read in place, dequantized)
 *     St (n, Mp) = K Qt                    (gemm, lanes = rows)
 *     online softmax per lane              (masks: range lo..hi, bias tile)
 *     V rows -> float32 tile (n, Dv)
 *     Ot (Dpad, Mp) = Ot * alpha + V^T St  (gemm)
 *   out = Ot / l, lse = m + log2 l         (0 / -inf for rows with no key)
 */
#define _POSIX_C_SOURCE 200809L /* sysconf */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attn_check.h"
#include "attn_state.h"
#include "prefill_internal.h"
#include "../kernels/kernels.h"
#include "../kernels/prefill.h"
#include "../paged/paged_internal.h"

#define LOG2E 1.4426950408889634f
#define KB KVC__PF_KB
#define MAXM KVC__PF_MAXM
_Static_assert(KB % KVC_PF_TCHUNK == 0, "gemm chunks must not straddle key blocks");
#define SROWS ((KB + KVC_PF_APAD - 1) / KVC_PF_APAD * KVC_PF_APAD) /* St/Kt rows: A padded */

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* ---- scratch ------------------------------------------------------------------ */

struct kvc__pf_scratch {
    int64_t n, D, Dk, Dv, Dpad;
    size_t slot_bytes;
    char *mem;
    atomic_int *busy; /* (n) 1 while a task uses the slot */
};

/* Byte offsets of the regions inside one slot (all 64-byte aligned). */
typedef struct pf_slot {
    float *qt, *st, *bias, *kt, *vt, *ot, *m, *l, *alpha, *row;
    int32_t *lo, *hi;
} pf_slot;

static size_t slot_layout(const kvc__pf_scratch *s, char *base, pf_slot *o) {
    size_t off = 0;
#define REGION(field, type, count)                                                                 \
    do {                                                                                           \
        if (o) o->field = (type *)(void *)(base + off);                                            \
        off += ((size_t)(count) * sizeof(type) + 63) / 64 * 64;                                    \
    } while (0)
    REGION(qt, float, s->D * MAXM);
    REGION(st, float, SROWS * MAXM);
    REGION(bias, float, KB * MAXM);
    REGION(kt, float, SROWS * s->Dk);
    REGION(vt, float, KB * s->Dv);
    REGION(ot, float, s->Dpad * MAXM);
    REGION(m, float, MAXM);
    REGION(l, float, MAXM);
    REGION(alpha, float, MAXM);
    REGION(row, float, s->Dk);
    REGION(lo, int32_t, MAXM);
    REGION(hi, int32_t, MAXM);
#undef REGION
    return off;
}

kvc_status kvc__pf_scratch_create(const char *fn, int64_t n_slots, int64_t D,
                                  kvc__pf_scratch **out) {
    kvc__pf_scratch *s = calloc(1, sizeof *s);
    if (!s) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    s->n = n_slots;
    s->D = D;
    s->Dpad = round_up(D, KVC_PF_APAD);
    s->Dk = round_up(D, 16);
    s->Dv = round_up(s->Dpad, 16);
    s->slot_bytes = slot_layout(s, NULL, NULL);
    /* calloc: the padding rows/columns of the K/V tiles must hold finite
     * values (zeros) before the first block writes them */
    s->mem = aligned_alloc(64, s->slot_bytes * (size_t)n_slots);
    s->busy = calloc((size_t)n_slots, sizeof *s->busy);
    if (!s->mem || !s->busy) {
        const long long bytes = (long long)(s->slot_bytes * (size_t)n_slots);
        kvc__pf_scratch_destroy(s);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (%lld bytes of work buffers)", fn,
                          bytes);
    }
    memset(s->mem, 0, s->slot_bytes * (size_t)n_slots);
    for (int64_t i = 0; i < n_slots; i++) atomic_init(&s->busy[i], 0);
    *out = s;
    return KVC_OK;
}

void kvc__pf_scratch_destroy(kvc__pf_scratch *s) {
    if (!s) return;
    free(s->mem);
    free(s->busy);
    free(s);
}

int64_t kvc__pf_scratch_slots(const kvc__pf_scratch *s) { return s->n; }

/* A free slot: at most n tasks run at once (one per pool thread), so the
 * scan always ends. Which slot a task gets does not affect its result. */
static int64_t slot_claim(kvc__pf_scratch *s) {
    for (;;)
        for (int64_t i = 0; i < s->n; i++)
            if (atomic_load_explicit(&s->busy[i], memory_order_relaxed) == 0 &&
                atomic_exchange(&s->busy[i], 1) == 0)
                return i;
}

/* ---- engine ------------------------------------------------------------------- */

typedef struct pf_ctx {
    const kvc__pf_batch *b;
    const kvc__pf_kv *kv;
    const kvc__pf_mask *mask;
    const kvc__pf_io *io;
    float qscale, cap, sc; /* q multiplier, soft cap, scores to base 2 (prefill.h) */
    int32_t window;
    const float *sinks; /* (Hq) or NULL */
    kvc__pf_scratch *scr;
    const kvc_kernels *kern;
    const kvc_prefill_kernels *pk;
} pf_ctx;

static float load_elem(const char *p, kvc_dtype dt, int64_t i) {
    switch (dt) {
    case KVC_F16: return kvc_f16_to_f32(((const uint16_t *)(const void *)p)[i]);
    case KVC_BF16: return kvc_bf16_to_f32(((const uint16_t *)(const void *)p)[i]);
    default: return ((const float *)(const void *)p)[i];
    }
}

int64_t kvc__pf_tiling(kvc__pf_batch *b, int64_t *task0) {
    const int64_t G = b->Hq / b->H;
    b->GT = G <= MAXM ? G : MAXM;
    b->QT = MAXM / b->GT;
    b->ngb = (G + b->GT - 1) / b->GT;
    task0[0] = 0;
    for (int64_t r = 0; r < b->B; r++)
        task0[r + 1] = task0[r] + (b->qo_len[r] + b->QT - 1) / b->QT * b->H * b->ngb;
    b->task0 = task0;
    return task0[b->B];
}

/* Request of task t: the last r with task0[r] <= t (empty requests have no
 * tasks, so task0[r] < task0[r + 1] for the one found). */
static int64_t task_request(const kvc__pf_batch *b, int64_t t) {
    int64_t lo = 0, hi = b->B - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (b->task0[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Keys [ja, ja + n) of request r, KV head h, of view w (scales sw) as
 * float32 rows of dst (row stride ld floats), run by run inside pages. */
static void load_rows(const pf_ctx *c, const kvc__pf_view *w, const kvc__pf_view *sw, int64_t r,
                      int64_t h, int64_t ja, int64_t n, float *dst, int64_t ld) {
    const kvc__pf_kv *kv = c->kv;
    const int64_t D = c->b->D;
    for (int64_t j = ja; j < ja + n;) {
        const int64_t slot = j % kv->page_size;
        int64_t cnt = kv->page_size - slot;
        if (cnt > ja + n - j) cnt = ja + n - j;
        const int64_t id = kv->pages[kv->page0[r] + j / kv->page_size];
        const char *src = w->data + kvc__bytes(w->dt, id * w->id_mul + slot * w->tok_st +
                                                          h * w->head_st);
        float *y = dst + (j - ja) * ld;
        if (kv->quant) {
            const char *sc = sw->data + kvc__bytes(sw->dt, id * sw->id_mul + slot * sw->tok_st +
                                                               h * sw->head_st);
            c->kern->dequantize_rows(src, kvc__bytes(w->dt, w->tok_st), w->dt == KVC_I8 ? 8 : 4,
                                     sc, kvc__bytes(sw->dt, sw->tok_st), sw->dt, cnt, D,
                                     kv->group, y, ld * (int64_t)sizeof(float), KVC_F32);
        } else {
            const int64_t rb = kvc__bytes(w->dt, w->tok_st);
            for (int64_t i = 0; i < cnt; i++)
                c->kern->convert(src + i * rb, w->dt, y + i * ld, KVC_F32, D);
        }
        j += cnt;
    }
}

/* Bias tile (n, Mp) for keys [ja, ja + n): 0 / -inf from mask bits, or the
 * additive mask in base-2 units. Padding lanes are masked by their range. */
static void fill_bias(const pf_ctx *c, int64_t r, int64_t i0, int64_t ng, int64_t hq0, int64_t M,
                      int64_t Mp, int64_t ja, int64_t n, float *bias) {
    const kvc__pf_mask *mk = c->mask;
    const int64_t L = c->b->kv_len[r];
    for (int64_t m = 0; m < M; m++) {
        const int64_t i = i0 + m / ng, hq = hq0 + m % ng;
        if (mk->kind == KVC__PF_MASK_BITS) {
            const uint8_t *bits = mk->bits + mk->byte0[r];
            const int64_t e0 = i * L + ja;
            for (int64_t t = 0; t < n; t++) {
                const int64_t e = e0 + t;
                bias[t * Mp + m] = (bits[e >> 3] >> (e & 7)) & 1 ? 0.0f : -INFINITY;
            }
        } else {
            const int64_t e0 = hq * mk->add_sh + (mk->row0[r] + i) * mk->add_sr + mk->col0[r] + ja;
            for (int64_t t = 0; t < n; t++) {
                /* finite masks past FLT_MAX / log2(e) (torch.finfo(float32).min
                 * pads rows) stay finite: as float32 scores plus such a mask
                 * they rank keys, they do not hide them like -inf */
                const float a = load_elem(mk->add, mk->add_dt, e0 + t), v = a * LOG2E;
                bias[t * Mp + m] = isinf(v) && !isinf(a) ? copysignf(FLT_MAX, a) : v;
            }
        }
    }
    for (int64_t m = M; m < Mp; m++)
        for (int64_t t = 0; t < n; t++) bias[t * Mp + m] = 0.0f;
}

static void pf_task(void *vctx, int64_t t) {
    const pf_ctx *c = vctx;
    const kvc__pf_batch *b = c->b;
    const kvc__pf_io *io = c->io;
    const int64_t r = task_request(b, t), local = t - b->task0[r];
    const int64_t qo = b->qo_len[r], L = b->kv_len[r], ntiles = (qo + b->QT - 1) / b->QT;
    /* KV head outermost, so tasks running close in time share one head's
     * K/V in cache; inside a head the last tiles first: under causal masks
     * they see the most keys (the small ones fill the gaps at the end) */
    const int64_t per_head = ntiles * b->ngb, h = local / per_head, rem = local % per_head;
    const int64_t tile = ntiles - 1 - rem / b->ngb, g0 = (rem % b->ngb) * b->GT, G = b->Hq / b->H;
    const int64_t i0 = tile * b->QT, nr = qo - i0 < b->QT ? qo - i0 : b->QT;
    const int64_t ng = G - g0 < b->GT ? G - g0 : b->GT, hq0 = h * G + g0;
    const int64_t M = nr * ng, Mp = round_up(M, KVC_PF_LANES), D = b->D;
    kvc__pf_scratch *scr = c->scr;
    const int64_t slot = slot_claim(scr);
    pf_slot s;
    slot_layout(scr, scr->mem + (size_t)slot * scr->slot_bytes, &s);

    /* per-lane key range [lo, hi] (causal, window, length) and state */
    int64_t jlo = L, jhi = -1;
    for (int64_t m = 0; m < Mp; m++) {
        int64_t lo = 0, hi = -1;
        if (m < M) {
            const int64_t i = i0 + m / ng, diag = i + L - qo;
            hi = b->causal[r] ? (diag < L - 1 ? diag : L - 1) : L - 1;
            if (c->window >= 0 && diag - c->window > 0) lo = diag - c->window;
            if (hi < -1) hi = -1;
            if (lo > L) lo = L;
            if (lo <= hi) {
                if (lo < jlo) jlo = lo;
                if (hi > jhi) jhi = hi;
            }
        }
        s.lo[m] = (int32_t)lo;
        s.hi[m] = (int32_t)hi;
        s.m[m] = -INFINITY;
        s.l[m] = 0.0f;
    }
    if (jlo <= jhi) {
        /* Qt (D, Mp), pad lanes zero */
        for (int64_t m = 0; m < Mp; m++) {
            if (m >= M) {
                for (int64_t d = 0; d < D; d++) s.qt[d * Mp + m] = 0.0f;
                continue;
            }
            const int64_t row = b->qo0[r] + i0 + m / ng, hq = hq0 + m % ng;
            c->kern->convert(io->q + kvc__bytes(io->qd, row * io->q_sr + hq * io->q_sh), io->qd,
                             s.row, KVC_F32, D);
            /* exact when qscale is 1 */
            for (int64_t d = 0; d < D; d++) s.qt[d * Mp + m] = s.row[d] * c->qscale;
        }
        memset(s.ot, 0, (size_t)(scr->Dpad * Mp) * sizeof(float));
        const kvc__pf_kv *kv = c->kv;
        for (int64_t jb = jlo / KB * KB; jb <= jhi; jb += KB) {
            const int64_t ja = jb > jlo ? jb : jlo;
            const int64_t je = (jb + KB - 1 < jhi ? jb + KB - 1 : jhi) + 1, n = je - ja;
            load_rows(c, &kv->k, &kv->ks, r, h, ja, n, s.kt, scr->Dk);
            c->pk->gemm(s.st, Mp, s.kt, scr->Dk, 1, s.qt, Mp, round_up(n, KVC_PF_APAD), D, 0, Mp,
                        NULL);
            const float *bias = NULL;
            if (c->mask->kind != KVC__PF_MASK_NONE) {
                fill_bias(c, r, i0, ng, hq0, M, Mp, ja, n, s.bias);
                bias = s.bias;
            }
            c->pk->softmax(s.st, Mp, n, Mp, ja, s.lo, s.hi, bias, c->cap, c->sc, s.m, s.l,
                           s.alpha);
            load_rows(c, &kv->v, &kv->vs, r, h, ja, n, s.vt, scr->Dv);
            c->pk->gemm(s.ot, Mp, s.vt, 1, scr->Dv, s.st, Mp, scr->Dpad, n, ja, Mp, s.alpha);
        }
    }
    for (int64_t m = 0; m < M; m++) {
        const int64_t row = b->qo0[r] + i0 + m / ng, hq = hq0 + m % ng;
        char *o = io->out + kvc__bytes(io->od, row * io->o_sr + hq * io->o_sh);
        const int empty = !(s.l[m] > 0.0f);
        float lse;
        const float inv = kvc__attn_finish(s.m[m], s.l[m], kvc__attn_sink2(c->sinks, hq), &lse);
        /* + 0.0f: a zero is +0 whatever blocks the lane skipped */
        for (int64_t d = 0; d < D; d++) s.row[d] = empty ? 0.0f : s.ot[d * Mp + m] * inv + 0.0f;
        c->kern->convert(s.row, KVC_F32, o, io->od, D);
        if (io->lse) io->lse[row * io->l_sr + hq * io->l_sh] = lse;
    }
    atomic_store(&scr->busy[slot], 0);
}

void kvc__pf_execute(const kvc__pf_batch *b, const kvc__pf_kv *kv, const kvc__pf_mask *mask,
                     const kvc__pf_io *io, const kvc_attn_params *p, kvc__pf_scratch *scr,
                     kvc_threadpool *pool) {
    static const kvc__pf_mask none = {KVC__PF_MASK_NONE, NULL, NULL, NULL, KVC_F32, 0, 0, NULL, NULL};
    pf_ctx c;
    c.b = b;
    c.kv = kv;
    c.mask = mask ? mask : &none;
    c.io = io;
    c.cap = p->logits_soft_cap;
    /* an additive mask is added in base 2: q scaled first */
    kvc__attn_score_scale(p->sm_scale, c.cap, c.mask->kind == KVC__PF_MASK_ADD, &c.qscale, &c.sc);
    c.window = p->window_left;
    c.sinks = p->sinks;
    c.scr = scr;
    c.kern = kvc__kernels();
    c.pk = kvc__prefill_kernels();
    const int64_t n = b->B > 0 ? b->task0[b->B] : 0;
    if (n > 0) kvc__parallel_for(pool, n, pf_task, &c);
}

/* ---- validation ------------------------------------------------------------------- */

kvc_status kvc__pf_check_io(const char *fn, const kvc_tensor *q, const kvc_tensor *out,
                            const kvc_tensor *lse, int64_t rows, int64_t Hq, int64_t D) {
    const int64_t shape[3] = {rows, Hq, D};
    return kvc__attn_check_io(fn, q, out, lse, 3, shape);
}

void kvc__pf_set_io(kvc__pf_io *io, const kvc_tensor *q, kvc_tensor *out, kvc_tensor *lse) {
    io->q = q->data;
    io->qd = q->dtype;
    io->q_sr = q->stride[0];
    io->q_sh = q->stride[1];
    io->out = out->data;
    io->od = out->dtype;
    io->o_sr = out->stride[0];
    io->o_sh = out->stride[1];
    io->lse = lse ? lse->data : NULL;
    io->l_sr = lse ? lse->stride[0] : 0;
    io->l_sh = lse ? lse->stride[1] : 0;
}

kvc_status kvc__pf_check_pool(const char *fn, const kvc_threadpool *pool,
                              const kvc__pf_scratch *s) {
    const int nt = kvc_threadpool_n_threads(pool);
    KVC_CHECK(nt <= s->n, "%s: the pool has %d threads but the plan was made for n_threads %lld "
              "(make the plan with n_threads >= the pool's)", fn, nt, (long long)s->n);
    return KVC_OK;
}

/* K/V pair (ndim-D, same shape and dtype, a storage dtype) with scales for
 * int8/int4 (shaped like k with last dim Dh / quant_group, float32/16). */
/* View of a K/V-like tensor: paged (max_pages, ...) or contiguous; NHD/HND. */
static kvc__pf_view make_view(const kvc_tensor *t, kvc_kv_layout layout, int paged) {
    kvc__pf_view v;
    const int o = paged ? 1 : 0;
    v.data = t->data;
    v.dt = t->dtype;
    v.tok_st = layout == KVC_NHD ? t->stride[o] : t->stride[o + 1];
    v.head_st = layout == KVC_NHD ? t->stride[o + 1] : t->stride[o];
    v.id_mul = paged ? t->stride[0] : v.tok_st;
    return v;
}

static void set_kv(kvc__pf_kv *kv, const kvc_tensor *k, const kvc_tensor *v,
                   const kvc_tensor *ks, const kvc_tensor *vs, int32_t group,
                   kvc_kv_layout layout, int paged) {
    memset(kv, 0, sizeof *kv);
    kv->k = make_view(k, layout, paged);
    kv->v = make_view(v, layout, paged);
    kv->quant = k->dtype == KVC_I8 || k->dtype == KVC_I4;
    if (kv->quant) {
        kv->ks = make_view(ks, layout, paged);
        kv->vs = make_view(vs, layout, paged);
        kv->group = group;
    }
}

static int is_mask_dtype(kvc_dtype d) { return d == KVC_U8 || d == KVC_I8; }

/*
 * Validates the custom masks against the requests and packs them into
 * little-endian bits (request r at byte byte0[r]). A boolean mask is 1-D
 * (sum of qo_len * kv_len) or, for one request, 2-D (qo_len, kv_len); a
 * packed one is 1-D (sum of ceil(qo_len * kv_len / 8) bytes). *bits is NULL
 * when no mask is given (then byte0 is untouched). Strides are honoured.
 */
static kvc_status pack_masks(const char *fn, const kvc_tensor *mask, const kvc_tensor *packed,
                             int64_t B, const int64_t *qo_len, const int64_t *kv_len,
                             uint8_t **bits, int64_t *byte0) {
    char buf[128];
    *bits = NULL;
    if (!mask && !packed) return KVC_OK;
    KVC_CHECK(!(mask && packed), "%s: give custom_mask or packed_custom_mask, not both", fn);
    int64_t n_bits = 0, n_bytes = 0;
    for (int64_t r = 0; r < B; r++) {
        int64_t nb; /* the mask's bits: qo_len * kv_len may pass int64 (broadcast q, k, v) */
        KVC_CHECK(kvc__mul3_le(qo_len[r], kv_len[r], 1, INT64_MAX - 7, &nb) &&
                      nb <= INT64_MAX - 7 - n_bits,
                  "%s: request %lld: a mask of %lld x %lld bits is too large", fn, (long long)r,
                  (long long)qo_len[r], (long long)kv_len[r]);
        n_bits += nb;
        n_bytes += (nb + 7) / 8;
    }
    const kvc_tensor *t = mask ? mask : packed;
    const char *name = mask ? "custom_mask" : "packed_custom_mask";
    KVC_TRY(kvc__check_tensor(t, name, 0));
    KVC_CHECK(is_mask_dtype(t->dtype), "%s: %s must be uint8 or int8, not %s", fn, name,
              kvc_dtype_name(t->dtype));
    const int two_d = mask && B == 1 && t->ndim == 2;
    if (two_d) {
        KVC_CHECK(t->shape[0] == qo_len[0] && t->shape[1] == kv_len[0],
                  "%s: custom_mask has shape %s, expected (%lld, %lld) or (%lld)", fn,
                  kvc__shape_str(t, buf, sizeof buf), (long long)qo_len[0], (long long)kv_len[0],
                  (long long)n_bits);
    } else {
        const int64_t want = mask ? n_bits : n_bytes;
        KVC_CHECK(t->ndim == 1 && t->shape[0] == want,
                  "%s: %s has shape %s, expected (%lld) (%s over the requests)", fn, name,
                  kvc__shape_str(t, buf, sizeof buf), (long long)want,
                  mask ? "sum of qo_len * kv_len" : "sum of ceil(qo_len * kv_len / 8) bytes");
    }
    uint8_t *out = calloc((size_t)(n_bytes > 0 ? n_bytes : 1), 1);
    if (!out) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    const uint8_t *src = t->data;
    int64_t e = 0, o = 0;
    for (int64_t r = 0; r < B; r++) {
        const int64_t nb = qo_len[r] * kv_len[r];
        byte0[r] = o;
        if (mask) {
            for (int64_t i = 0; i < nb; i++, e++) {
                const int64_t off = two_d ? (i / kv_len[0]) * t->stride[0] + (i % kv_len[0]) *
                                                                                 t->stride[1]
                                          : e * t->stride[0];
                if (src[off]) out[o + (i >> 3)] |= (uint8_t)(1u << (i & 7));
            }
        } else {
            for (int64_t i = 0; i < (nb + 7) / 8; i++) out[o + i] = src[(e + i) * t->stride[0]];
            e += (nb + 7) / 8;
        }
        o += (nb + 7) / 8;
    }
    *bits = out;
    return KVC_OK;
}

static int64_t online_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? n : 1;
}

/* ---- single request ------------------------------------------------------------- */

kvc_status kvc_single_prefill(const kvc_tensor *q, const kvc_tensor *k, const kvc_tensor *v,
                              const kvc_tensor *k_scale, const kvc_tensor *v_scale,
                              int32_t quant_group, kvc_kv_layout layout, int32_t causal,
                              const kvc_tensor *custom_mask, const kvc_tensor *packed_custom_mask,
                              const kvc_attn_params *params, kvc_tensor *out, kvc_tensor *lse,
                              kvc_threadpool *pool) {
    static const char fn[] = "kvc_single_prefill";
    KVC_CHECK(q != NULL && out != NULL, "%s: q and out must not be NULL", fn);
    KVC_CHECK(causal == 0 || causal == 1, "%s: causal must be 0 or 1, got %d", fn, (int)causal);
    KVC_CHECK(layout == KVC_NHD || layout == KVC_HND, "%s: invalid layout %d", fn, (int)layout);
    KVC_TRY(kvc__attn_check_kv(fn, k, v, k_scale, v_scale, quant_group, 3));
    const int64_t L = layout == KVC_NHD ? k->shape[0] : k->shape[1];
    const int64_t H = layout == KVC_NHD ? k->shape[1] : k->shape[0], D = k->shape[2];
    KVC_TRY(kvc__check_tensor(q, "q", 1));
    KVC_CHECK(q->ndim == 3, "%s: q must be 3-D (qo_len, Hq, Dh), not %d-D", fn, (int)q->ndim);
    const int64_t qo = q->shape[0], Hq = q->shape[1];
    KVC_TRY(kvc__pf_check_io(fn, q, out, lse, qo, Hq, D));
    KVC_TRY(kvc__attn_check_heads(fn, Hq, H, D));
    KVC_CHECK(L <= INT32_MAX, "%s: kv_len %lld is too long", fn, (long long)L);
    kvc_attn_params p;
    KVC_TRY(kvc__attn_check_params(fn, params, Hq, D, &p));
    int64_t byte0 = 0;
    uint8_t *bits = NULL;
    KVC_TRY(pack_masks(fn, custom_mask, packed_custom_mask, 1, &qo, &L, &bits, &byte0));
    kvc__pf_scratch *scr = NULL;
    kvc_status st = kvc__pf_scratch_create(fn, kvc_threadpool_n_threads(pool), D, &scr);
    if (st != KVC_OK) {
        free(bits);
        return st;
    }
    const int64_t qo0 = 0, page = 0, page0 = 0;
    const uint8_t caus = causal && !bits;
    int64_t task0[2];
    kvc__pf_batch b;
    memset(&b, 0, sizeof b);
    b.B = 1;
    b.Hq = Hq;
    b.H = H;
    b.D = D;
    b.qo0 = &qo0;
    b.qo_len = &qo;
    b.kv_len = &L;
    b.causal = &caus;
    kvc__pf_tiling(&b, task0);
    kvc__pf_kv kv;
    set_kv(&kv, k, v, k_scale, v_scale, quant_group, layout, 0);
    kv.page_size = L + 1;
    kv.pages = &page;
    kv.page0 = &page0;
    kvc__pf_mask mk;
    memset(&mk, 0, sizeof mk);
    if (bits) {
        mk.kind = KVC__PF_MASK_BITS;
        mk.bits = bits;
        mk.byte0 = &byte0;
    }
    kvc__pf_io io;
    kvc__pf_set_io(&io, q, out, lse);
    kvc__pf_execute(&b, &kv, &mk, &io, &p, scr, pool);
    kvc__pf_scratch_destroy(scr);
    free(bits);
    return KVC_OK;
}

/* ---- plans ------------------------------------------------------------------------ */

struct kvc_prefill_plan {
    int paged;
    int64_t B, Hq, H, D, page_size;
    int64_t nnz_qo, nnz_kv; /* rows of q; ragged: rows of k/v */
    int64_t max_page;       /* paged: largest page id, -1 if none */
    int64_t *qo0, *qo_len, *kv_len, *pages, *page0, *task0, *byte0;
    uint8_t *causal, *bits;
    kvc__pf_batch batch;
    kvc__pf_scratch *scr;
};

void kvc_prefill_plan_destroy(kvc_prefill_plan *plan) {
    if (!plan) return;
    free(plan->qo0);
    free(plan->qo_len);
    free(plan->kv_len);
    free(plan->pages);
    free(plan->page0);
    free(plan->task0);
    free(plan->byte0);
    free(plan->causal);
    free(plan->bits);
    kvc__pf_scratch_destroy(plan->scr);
    free(plan);
}

/* Common part of both plan kinds: the plan and its per-request arrays
 * (B requests, n_pages page ids). */
static kvc_status plan_alloc(const char *fn, int64_t B, int64_t n_pages, kvc_prefill_plan **out) {
    kvc_prefill_plan *p = calloc(1, sizeof *p);
    if (!p) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    const size_t nb = (size_t)(B > 0 ? B : 1);
    p->B = B;
    p->qo0 = malloc(nb * sizeof(int64_t));
    p->qo_len = malloc(nb * sizeof(int64_t));
    p->kv_len = malloc(nb * sizeof(int64_t));
    p->page0 = malloc(nb * sizeof(int64_t));
    p->byte0 = calloc(nb, sizeof(int64_t));
    p->causal = malloc(nb);
    p->task0 = malloc((nb + 1) * sizeof(int64_t));
    p->pages = malloc((size_t)(n_pages > 0 ? n_pages : 1) * sizeof(int64_t));
    if (!p->qo0 || !p->qo_len || !p->kv_len || !p->page0 || !p->byte0 || !p->causal ||
        !p->task0 || !p->pages) {
        kvc_prefill_plan_destroy(p);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    }
    *out = p;
    return KVC_OK;
}

/* Masks, causal flags, tiling and scratch: the end of both plan kinds. */
static kvc_status plan_finish(const char *fn, kvc_prefill_plan *p, int32_t causal,
                              const kvc_tensor *custom_mask, const kvc_tensor *packed,
                              int32_t n_threads) {
    KVC_TRY(pack_masks(fn, custom_mask, packed, p->B, p->qo_len, p->kv_len, &p->bits, p->byte0));
    for (int64_t r = 0; r < p->B; r++) p->causal[r] = causal && !p->bits;
    memset(&p->batch, 0, sizeof p->batch);
    p->batch.B = p->B;
    p->batch.Hq = p->Hq;
    p->batch.H = p->H;
    p->batch.D = p->D;
    p->batch.qo0 = p->qo0;
    p->batch.qo_len = p->qo_len;
    p->batch.kv_len = p->kv_len;
    p->batch.causal = p->causal;
    kvc__pf_tiling(&p->batch, p->task0);
    const int64_t nt = n_threads > 0 ? n_threads : online_cpus();
    return kvc__pf_scratch_create(fn, nt, p->D, &p->scr);
}

kvc_status kvc_prefill_plan_set_causal(kvc_prefill_plan *plan, int32_t causal) {
    static const char fn[] = "kvc_prefill_plan_set_causal";
    KVC_CHECK(plan != NULL, "%s: plan is NULL", fn);
    KVC_CHECK(causal == 0 || causal == 1, "%s: causal must be 0 or 1, got %d", fn, (int)causal);
    for (int64_t r = 0; r < plan->B; r++) plan->causal[r] = causal && !plan->bits;
    return KVC_OK;
}

static kvc_status check_plan_args(const char *fn, int32_t Hq, int32_t H, int32_t D,
                                  int32_t n_threads, kvc_prefill_plan **out) {
    KVC_CHECK(out != NULL, "%s: out is NULL", fn);
    *out = NULL; /* what a failure leaves */
    KVC_TRY(kvc__attn_check_heads(fn, Hq, H, D));
    KVC_CHECK(n_threads <= 1024, "%s: n_threads %d > 1024", fn, (int)n_threads);
    return KVC_OK;
}

kvc_status kvc_prefill_plan_create_paged(const kvc_tensor *qo_indptr, const kvc_tensor *kv_indptr,
                                         const kvc_tensor *kv_indices,
                                         const kvc_tensor *kv_last_page_len,
                                         int32_t num_qo_heads, int32_t num_kv_heads,
                                         int32_t head_dim, int32_t page_size, int32_t causal,
                                         const kvc_tensor *custom_mask,
                                         const kvc_tensor *packed_custom_mask, int32_t n_threads,
                                         kvc_prefill_plan **out) {
    static const char fn[] = "kvc_prefill_plan_create_paged";
    KVC_TRY(check_plan_args(fn, num_qo_heads, num_kv_heads, head_dim, n_threads, out));
    KVC_CHECK(causal == 0 || causal == 1, "%s: causal must be 0 or 1, got %d", fn, (int)causal);
    KVC_CHECK(page_size >= 1, "%s: page_size %d must be >= 1", fn, (int)page_size);
    int64_t B = 0;
    KVC_TRY(kvc__paged_check_table(fn, kv_indptr, kv_indices, kv_last_page_len, page_size, -1, 1,
                                   &B));
    KVC_TRY(kvc__paged_check_indptr(fn, "qo_indptr", qo_indptr, B));
    for (int64_t r = 0; r < B; r++) {
        const int64_t pages = (int64_t)kvc__i32_1d(kv_indptr, r + 1) - kvc__i32_1d(kv_indptr, r);
        const int64_t len = pages ? (pages - 1) * page_size + kvc__i32_1d(kv_last_page_len, r) : 0;
        KVC_CHECK(len <= INT32_MAX, "%s: request %lld holds %lld keys (at most %d)", fn,
                  (long long)r, (long long)len, INT32_MAX);
    }
    const int64_t n_idx = kvc__i32_1d(kv_indptr, B);
    kvc_prefill_plan *p = NULL;
    KVC_TRY(plan_alloc(fn, B, n_idx, &p));
    p->paged = 1;
    p->Hq = num_qo_heads;
    p->H = num_kv_heads;
    p->D = head_dim;
    p->page_size = page_size;
    p->max_page = -1;
    for (int64_t i = 0; i < n_idx; i++) {
        p->pages[i] = kvc__i32_1d(kv_indices, i);
        if (p->pages[i] > p->max_page) p->max_page = p->pages[i];
    }
    for (int64_t r = 0; r < B; r++) {
        const int64_t pages = (int64_t)kvc__i32_1d(kv_indptr, r + 1) - kvc__i32_1d(kv_indptr, r);
        p->qo0[r] = kvc__i32_1d(qo_indptr, r);
        p->qo_len[r] = kvc__i32_1d(qo_indptr, r + 1) - p->qo0[r];
        p->kv_len[r] = pages ? (pages - 1) * page_size + kvc__i32_1d(kv_last_page_len, r) : 0;
        p->page0[r] = kvc__i32_1d(kv_indptr, r);
    }
    p->nnz_qo = kvc__i32_1d(qo_indptr, B);
    kvc_status st = plan_finish(fn, p, causal, custom_mask, packed_custom_mask, n_threads);
    if (st != KVC_OK) {
        kvc_prefill_plan_destroy(p);
        return st;
    }
    *out = p;
    return KVC_OK;
}

kvc_status kvc_prefill_plan_create_ragged(const kvc_tensor *qo_indptr, const kvc_tensor *kv_indptr,
                                          int32_t num_qo_heads, int32_t num_kv_heads,
                                          int32_t head_dim, int32_t causal,
                                          const kvc_tensor *custom_mask,
                                          const kvc_tensor *packed_custom_mask, int32_t n_threads,
                                          kvc_prefill_plan **out) {
    static const char fn[] = "kvc_prefill_plan_create_ragged";
    KVC_TRY(check_plan_args(fn, num_qo_heads, num_kv_heads, head_dim, n_threads, out));
    KVC_CHECK(causal == 0 || causal == 1, "%s: causal must be 0 or 1, got %d", fn, (int)causal);
    KVC_TRY(kvc__paged_check_i32(fn, "qo_indptr", qo_indptr, -1));
    KVC_CHECK(qo_indptr->shape[0] >= 1, "%s: qo_indptr must have B + 1 >= 1 entries", fn);
    const int64_t B = qo_indptr->shape[0] - 1;
    KVC_TRY(kvc__paged_check_indptr(fn, "qo_indptr", qo_indptr, B));
    KVC_TRY(kvc__paged_check_indptr(fn, "kv_indptr", kv_indptr, B));
    kvc_prefill_plan *p = NULL;
    KVC_TRY(plan_alloc(fn, B, B, &p));
    p->Hq = num_qo_heads;
    p->H = num_kv_heads;
    p->D = head_dim;
    int64_t maxlen = 0;
    for (int64_t r = 0; r < B; r++) {
        p->qo0[r] = kvc__i32_1d(qo_indptr, r);
        p->qo_len[r] = kvc__i32_1d(qo_indptr, r + 1) - p->qo0[r];
        p->pages[r] = kvc__i32_1d(kv_indptr, r); /* one "page": the request's first row */
        p->page0[r] = r;
        p->kv_len[r] = kvc__i32_1d(kv_indptr, r + 1) - p->pages[r];
        if (p->kv_len[r] > maxlen) maxlen = p->kv_len[r];
    }
    p->page_size = maxlen + 1;
    p->nnz_qo = kvc__i32_1d(qo_indptr, B);
    p->nnz_kv = kvc__i32_1d(kv_indptr, B);
    kvc_status st = plan_finish(fn, p, causal, custom_mask, packed_custom_mask, n_threads);
    if (st != KVC_OK) {
        kvc_prefill_plan_destroy(p);
        return st;
    }
    *out = p;
    return KVC_OK;
}

static kvc_status run_plan(const char *fn, kvc_prefill_plan *plan, const kvc_tensor *q,
                           const kvc__pf_kv *kv, const kvc_attn_params *p, kvc_tensor *out,
                           kvc_tensor *lse, kvc_threadpool *pool) {
    kvc__pf_io io;
    kvc__pf_set_io(&io, q, out, lse);
    kvc__pf_mask mk;
    memset(&mk, 0, sizeof mk);
    if (plan->bits) {
        mk.kind = KVC__PF_MASK_BITS;
        mk.bits = plan->bits;
        mk.byte0 = plan->byte0;
    }
    kvc__pf_execute(&plan->batch, kv, &mk, &io, p, plan->scr, pool);
    (void)fn;
    return KVC_OK;
}

/* Checks common to both run kinds; fills p. */
static kvc_status check_run(const char *fn, kvc_prefill_plan *plan, int paged, const kvc_tensor *q,
                            const kvc_attn_params *params, kvc_tensor *out, kvc_tensor *lse,
                            kvc_threadpool *pool, kvc_attn_params *p) {
    KVC_CHECK(plan != NULL, "%s: plan is NULL", fn);
    KVC_CHECK(plan->paged == paged, "%s: the plan was made for %s K/V", fn,
              plan->paged ? "paged" : "ragged");
    KVC_CHECK(q != NULL && out != NULL, "%s: q and out must not be NULL", fn);
    KVC_TRY(kvc__pf_check_io(fn, q, out, lse, plan->nnz_qo, plan->Hq, plan->D));
    KVC_TRY(kvc__attn_check_params(fn, params, plan->Hq, plan->D, p));
    return kvc__pf_check_pool(fn, pool, plan->scr);
}

kvc_status kvc_prefill_run_paged(kvc_prefill_plan *plan, const kvc_tensor *q,
                                 const kvc_paged_cache *cache, const kvc_attn_params *params,
                                 kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool) {
    static const char fn[] = "kvc_prefill_run_paged";
    kvc_attn_params p;
    KVC_TRY(check_run(fn, plan, 1, q, params, out, lse, pool, &p));
    KVC_TRY(kvc__attn_check_paged(fn, cache, plan->page_size, plan->H, plan->D, plan->max_page));
    kvc__pf_kv kv;
    set_kv(&kv, &cache->k, &cache->v, &cache->k_scale, &cache->v_scale, cache->quant_group,
           cache->layout, 1);
    kv.page_size = plan->page_size;
    kv.pages = plan->pages;
    kv.page0 = plan->page0;
    return run_plan(fn, plan, q, &kv, &p, out, lse, pool);
}

kvc_status kvc_prefill_run_ragged(kvc_prefill_plan *plan, const kvc_tensor *q, const kvc_tensor *k,
                                  const kvc_tensor *v, const kvc_tensor *k_scale,
                                  const kvc_tensor *v_scale, int32_t quant_group,
                                  kvc_kv_layout layout, const kvc_attn_params *params,
                                  kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool) {
    static const char fn[] = "kvc_prefill_run_ragged";
    kvc_attn_params p;
    KVC_TRY(check_run(fn, plan, 0, q, params, out, lse, pool, &p));
    KVC_CHECK(layout == KVC_NHD || layout == KVC_HND, "%s: invalid layout %d", fn, (int)layout);
    KVC_TRY(kvc__attn_check_kv(fn, k, v, k_scale, v_scale, quant_group, 3));
    const int nhd = layout == KVC_NHD;
    const int64_t n = nhd ? k->shape[0] : k->shape[1], H = nhd ? k->shape[1] : k->shape[0];
    char buf[128];
    KVC_CHECK(n == plan->nnz_kv && H == plan->H && k->shape[2] == plan->D,
              "%s: k %s (%s) does not match the plan (kv_indptr[B] %lld, H %lld, Dh %lld)", fn,
              kvc__shape_str(k, buf, sizeof buf), nhd ? "NHD" : "HND", (long long)plan->nnz_kv,
              (long long)plan->H, (long long)plan->D);
    kvc__pf_kv kv;
    set_kv(&kv, k, v, k_scale, v_scale, quant_group, layout, 0);
    kv.page_size = plan->page_size;
    kv.pages = plan->pages;
    kv.page0 = plan->page0;
    return run_plan(fn, plan, q, &kv, &p, out, lse, pool);
}
