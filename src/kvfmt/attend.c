/* kvc_kvfmt_attention (docs/KV_FORMATS.md section 6): online softmax over
 * the quantized groups, read from the pages with the K parameters folded
 * into the query (q . k = (q * scale) . code + q . zero), then over the
 * float16 tail; the rotation of V is undone on the output. One task per
 * (query row, KV head) handles the query heads of that GQA group. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvfmt_internal.h"
#include "../kernels/kernels.h"
#if defined(__x86_64__) || defined(__i386__)
#include "../kernels/kvfmt_kernels.h"
#define KVFMT_SIMD 1
#endif

#define HC 8 /* query heads per pass: bounds the stack buffers */

typedef struct attend_ctx {
    const kvc_kvfmt *f;
    kvc__kvfmt_layout l;
    const kvc_tensor *pages, *q, *out, *lse;
    const kvc_kvfmt_seq *seqs;
    const int32_t *q_seq, *q_pos;
    int64_t Hq, grp;
    float sm_scale;
} attend_ctx;

static float f16at(const unsigned char *base, size_t off, int64_t idx) {
    uint16_t h;
    memcpy(&h, base + off + (size_t)idx * 2, 2);
    return kvc_f16_to_f32(h);
}

static const unsigned char *page_of(const attend_ctx *c, const kvc_kvfmt_seq *s, int64_t t) {
    return (const unsigned char *)c->pages->data +
           (int64_t)s->pages[t / c->f->page_size] * c->pages->stride[0];
}

/* codes [i0, i0 + n) of a row of 8- or 4-bit codes, as floats */
static void unpack(const unsigned char *row, int64_t i0, int64_t n, int bits, int sym, float *dst) {
    if (bits == 8) {
        if (sym)
            for (int64_t i = 0; i < n; i++) dst[i] = (float)(int8_t)row[i0 + i];
        else
            for (int64_t i = 0; i < n; i++) dst[i] = (float)row[i0 + i];
    } else {
        for (int64_t i = 0; i < n; i++) {
            const int64_t k = i0 + i;
            int q = (row[k / 2] >> ((k & 1) * 4)) & 15;
            if (sym && q > 7) q -= 16;
            dst[i] = (float)q;
        }
    }
}

typedef struct state {
    float m[HC], l[HC];
    float o[HC][KVC_ATTN_MAX_HEAD_DIM];
} state;

/* Folds scores s[g][0..n) (scaled) into the state; leaves exp weights in s. */
static void softmax_step(state *st, int64_t ng, float (*s)[512], int64_t n) {
    for (int64_t g = 0; g < ng; g++) {
        float mx = st->m[g];
        for (int64_t t = 0; t < n; t++) mx = s[g][t] > mx ? s[g][t] : mx;
        const float corr = st->m[g] == -INFINITY ? 0.0f : expf(st->m[g] - mx);
        st->m[g] = mx;
        float sum = 0;
        for (int64_t t = 0; t < n; t++) {
            s[g][t] = expf(s[g][t] - mx);
            sum += s[g][t];
        }
        st->l[g] = st->l[g] * corr + sum;
        if (corr != 1.0f)
            for (int64_t i = 0; i < KVC_ATTN_MAX_HEAD_DIM; i++) st->o[g][i] *= corr;
    }
}

static void attend_task(void *arg, int64_t task) {
    const attend_ctx *c = arg;
    const kvc_kvfmt *f = c->f;
    const kvc__kvfmt_layout *l = &c->l;
    const int64_t H = f->num_kv_heads, Dh = f->head_dim, P = f->page_size, G = f->group;
    const int64_t HD = H * Dh, gv = f->v_group, nvg = Dh / gv;
    const int64_t row = task / H, h = task % H;
    const kvc_kvfmt_seq *s = &c->seqs[c->q_seq[row]];
    const int64_t pos = c->q_pos[row], nq = (s->n_kv / G) * G;
    const int bits = f->bits;
    float qv[HC][KVC_ATTN_MAX_HEAD_DIM], qs[HC][KVC_ATTN_MAX_HEAD_DIM], bias[HC];
    float ks[KVC_ATTN_MAX_HEAD_DIM], kz[KVC_ATTN_MAX_HEAD_DIM], codes[KVC_ATTN_MAX_HEAD_DIM];
    float sc[HC][512], wc[512];
    state st;
    for (int64_t g0 = 0; g0 < c->grp; g0 += HC) {
        const int64_t ng = c->grp - g0 < HC ? c->grp - g0 : HC;
        memset(&st, 0, sizeof st);
        for (int64_t g = 0; g < ng; g++) {
            st.m[g] = -INFINITY;
            const float *qr = (const float *)c->q->data + row * c->q->stride[0] +
                              (h * c->grp + g0 + g) * c->q->stride[1];
            memcpy(qv[g], qr, (size_t)Dh * sizeof(float));
        }
        /* quantized groups */
        for (int64_t j = 0; j * G < nq && j * G <= pos; j++) {
            const int64_t t0 = j * G, t1 = t0 + G <= pos + 1 ? t0 + G : pos + 1;
            for (int64_t ch = 0; ch < Dh; ch++) {
                const int64_t e = h * Dh + ch;
                const unsigned char *pg;
                int64_t idx;
                if (G <= P) {
                    pg = page_of(c, s, t0);
                    idx = (j % (P / G)) * HD + e;
                } else {
                    pg = page_of(c, s, t0 + (e / l->k_share) * P);
                    idx = e % l->k_share;
                }
                ks[ch] = f16at(pg, l->k_scale, idx);
                kz[ch] = f16at(pg, l->k_zero, idx);
            }
            for (int64_t g = 0; g < ng; g++) {
                float b = 0;
                for (int64_t ch = 0; ch < Dh; ch++) {
                    qs[g][ch] = qv[g][ch] * ks[ch];
                    b += qv[g][ch] * kz[ch];
                }
                bias[g] = b;
            }
            for (int64_t t = t0; t < t1; t++) {
                const unsigned char *pg = page_of(c, s, t) + l->k_codes;
                const int64_t off = (h * P + t % P) * Dh;
                unpack(pg, off, Dh, bits, 0, codes);
                for (int64_t g = 0; g < ng; g++) {
                    float d = 0;
                    for (int64_t ch = 0; ch < Dh; ch++) d += qs[g][ch] * codes[ch];
                    sc[g][t - t0] = (d + bias[g]) * c->sm_scale;
                }
            }
            softmax_step(&st, ng, sc, t1 - t0);
            /* P . V: per channel, a dot product over the group's tokens */
            for (int64_t ch = 0; ch < Dh; ch++) {
                const int64_t vg = ch / gv;
                for (int64_t t = t0; t < t1;) { /* page by page */
                    const int64_t te = (t / P + 1) * P < t1 ? (t / P + 1) * P : t1;
                    const unsigned char *pg = page_of(c, s, t);
                    float cv[512];
                    unpack(pg + l->v_codes, (h * Dh + ch) * P, P, bits, !f->v_asym, cv);
                    for (int64_t u = t; u < te; u++)
                        wc[u - t0] = cv[u % P] * f16at(pg, l->v_scale, (h * P + u % P) * nvg + vg);
                    t = te;
                }
                for (int64_t g = 0; g < ng; g++) {
                    float a = 0;
                    for (int64_t u = 0; u < t1 - t0; u++) a += sc[g][u] * wc[u];
                    st.o[g][ch] += a;
                }
                if (f->v_asym && ch % gv == 0) { /* the zero points of this channel group */
                    for (int64_t u = t0; u < t1; u++)
                        wc[u - t0] = f16at(page_of(c, s, u), l->v_zero, (h * P + u % P) * nvg + vg);
                    for (int64_t g = 0; g < ng; g++) {
                        float a = 0;
                        for (int64_t u = 0; u < t1 - t0; u++) a += sc[g][u] * wc[u];
                        for (int64_t k = 0; k < gv; k++) st.o[g][ch + k] += a;
                    }
                }
            }
        }
        /* float16 tail, in blocks of up to 512 tokens (at most G - 1 of them) */
        for (int64_t t0 = nq; t0 <= pos; t0 += 512) {
            const int64_t t1 = t0 + 512 <= pos + 1 ? t0 + 512 : pos + 1;
            for (int64_t t = t0; t < t1; t++) {
                const uint16_t *kr = s->tail + (t % G) * HD + h * Dh;
                for (int64_t ch = 0; ch < Dh; ch++) codes[ch] = kvc_f16_to_f32(kr[ch]);
                for (int64_t g = 0; g < ng; g++) {
                    float d = 0;
                    for (int64_t ch = 0; ch < Dh; ch++) d += qv[g][ch] * codes[ch];
                    sc[g][t - t0] = d * c->sm_scale;
                }
            }
            softmax_step(&st, ng, sc, t1 - t0);
            for (int64_t t = t0; t < t1; t++) {
                const uint16_t *vr = s->tail + (G + t % G) * HD + h * Dh;
                for (int64_t ch = 0; ch < Dh; ch++) codes[ch] = kvc_f16_to_f32(vr[ch]);
                for (int64_t g = 0; g < ng; g++) {
                    const float p = sc[g][t - t0];
                    for (int64_t ch = 0; ch < Dh; ch++) st.o[g][ch] += p * codes[ch];
                }
            }
        }
        for (int64_t g = 0; g < ng; g++) {
            const int64_t qh = h * c->grp + g0 + g;
            float *o = (float *)c->out->data + row * c->out->stride[0] + qh * c->out->stride[1];
            const float inv = st.l[g] > 0 ? 1.0f / st.l[g] : 0.0f;
            for (int64_t ch = 0; ch < Dh; ch++) o[ch] = st.o[g][ch] * inv;
            if (f->rotate_v) kvc__kvfmt_rotate(o, (int32_t)Dh);
            if (c->lse) {
                float *ls = (float *)c->lse->data + row * c->lse->stride[0] + qh * c->lse->stride[1];
                *ls = st.l[g] > 0 ? (st.m[g] + logf(st.l[g])) * 1.44269504088896341f : -INFINITY;
            }
        }
    }
}

/* ---- SIMD path (src/kernels/kvfmt_*.c) ------------------------------------
 * Work units: a run of up to KVC_KVFMT_NV / heads consecutive query rows of
 * one sequence (prefill: the K/V codes of a group are converted once for the
 * whole run), one KV head, its query heads (in passes of at most
 * KVC_KVFMT_NV). When there are few units (small batch decode), each
 * unit's keys are split in chunks of a fixed number of tokens, merged in
 * chunk order afterwards: the split depends on the problem only, never on
 * the pool, so results are the same for any thread count. */
#ifdef KVFMT_SIMD
#define SPLIT_UNITS 32   /* fewer units than this: split keys in chunks */
#define SPLIT_TOKENS 1024

typedef struct sunit {
    int64_t row0, task0;
    int32_t nrows, h, hq0, nh, nchunks;
    int64_t qend, chunk; /* quantized tokens read; tokens per chunk */
} sunit;

typedef struct simd_ctx {
    const kvc_kvfmt *f;
    kvc__kvfmt_layout l;
    const kvc_tensor *pages, *q, *out, *lse;
    const kvc_kvfmt_seq *seqs;
    const int32_t *q_seq, *q_pos;
    kvc_kvfmt_kernel kernel;
    const sunit *units;
    const int64_t *task_unit;
    float *scratch; /* per task: m (NV), l (NV), o (NV, Dh) */
    int64_t sstride;
    float sc;
} simd_ctx;

static void simd_task(void *arg, int64_t task) {
    const simd_ctx *c = arg;
    const kvc_kvfmt *f = c->f;
    const sunit *u = &c->units[c->task_unit[task]];
    const int64_t ci = task - u->task0;
    const kvc_kvfmt_seq *s = &c->seqs[c->q_seq[u->row0]];
    kvc_kvfmt_job j;
    j.bits = f->bits;
    j.Dh = f->head_dim;
    j.P = f->page_size;
    j.G = f->group;
    j.gv = f->v_group;
    j.nvg = f->head_dim / f->v_group;
    j.H = f->num_kv_heads;
    j.h = u->h;
    j.base = (const unsigned char *)c->pages->data;
    j.page_stride = c->pages->stride[0];
    j.pages = s->pages;
    j.k_codes = c->l.k_codes;
    j.v_codes = c->l.v_codes;
    j.v_scale = c->l.v_scale;
    j.v_zero = c->l.v_zero;
    j.k_scale = c->l.k_scale;
    j.k_zero = c->l.k_zero;
    j.k_share = c->l.k_share;
    j.tail = s->tail;
    j.n_kv = s->n_kv;
    j.nquant = (s->n_kv / f->group) * f->group;
    j.t0 = ci * u->chunk;
    j.t1 = j.t0 + u->chunk < u->qend ? j.t0 + u->chunk : u->qend;
    j.do_tail = ci == u->nchunks - 1;
    j.nv = u->nrows * u->nh;
    for (int32_t r = 0; r < u->nrows; r++)
        for (int32_t g = 0; g < u->nh; g++) {
            const int64_t row = u->row0 + r, v = r * u->nh + g;
            j.q[v] = (const float *)c->q->data + row * c->q->stride[0] +
                     (u->hq0 + g) * c->q->stride[1];
            j.pos[v] = c->q_pos[row];
        }
    j.sc = c->sc;
    float *m = c->scratch + task * c->sstride;
    j.m = m;
    j.l = m + KVC_KVFMT_NV;
    j.o = m + 2 * KVC_KVFMT_NV;
    c->kernel(&j);
}

/* Merges a unit's chunks (in order), normalizes, rotates back, writes. */
static void simd_finish(void *arg, int64_t ui) {
    const simd_ctx *c = arg;
    const sunit *u = &c->units[ui];
    const int64_t Dh = c->f->head_dim;
    for (int32_t r = 0; r < u->nrows; r++)
        for (int32_t g = 0; g < u->nh; g++) {
            const int64_t row = u->row0 + r, v = r * u->nh + g, qh = u->hq0 + g;
            float mx = -INFINITY;
            for (int32_t k = 0; k < u->nchunks; k++) {
                const float mk = c->scratch[(u->task0 + k) * c->sstride + v];
                mx = mk > mx ? mk : mx;
            }
            float *o = (float *)c->out->data + row * c->out->stride[0] + qh * c->out->stride[1];
            float l = 0;
            for (int64_t ch = 0; ch < Dh; ch++) o[ch] = 0;
            for (int32_t k = 0; k < u->nchunks; k++) {
                const float *st = c->scratch + (u->task0 + k) * c->sstride;
                if (st[v] == -INFINITY) continue;
                const float w = u->nchunks == 1 ? 1.0f : exp2f(st[v] - mx);
                l += st[KVC_KVFMT_NV + v] * w;
                const float *ok = st + 2 * KVC_KVFMT_NV + v * Dh;
                for (int64_t ch = 0; ch < Dh; ch++) o[ch] += ok[ch] * w;
            }
            const float inv = l > 0 ? 1.0f / l : 0.0f;
            for (int64_t ch = 0; ch < Dh; ch++) o[ch] *= inv;
            if (c->f->rotate_v) kvc__kvfmt_rotate(o, (int32_t)Dh);
            if (c->lse) {
                float *ls = (float *)c->lse->data + row * c->lse->stride[0] + qh * c->lse->stride[1];
                *ls = l > 0 ? mx + log2f(l) : -INFINITY;
            }
        }
}

static kvc_kvfmt_kernel simd_kernel(const kvc_kvfmt *f) {
    const kvc_isa isa = kvc_get_isa();
    int vl;
    kvc_kvfmt_kernel k;
    if (isa >= KVC_ISA_AVX512)
        k = kvc__kvfmt_run_avx512, vl = 16; /* amx included */
    else if (isa == KVC_ISA_AVX2)
        k = kvc__kvfmt_run_avx2, vl = 8;
    else
        return NULL;
    if ((f->bits != 8 && f->bits != 4) || !f->v_asym) return NULL;
    if (f->head_dim % (f->bits == 4 ? 2 * vl : vl) || f->v_group % vl || f->page_size % vl ||
        f->group % vl || f->group > KVC_KVFMT_BT_MAX)
        return NULL;
    return k;
}

/* KVC_OK, or KVC_ERR_NOMEM; *done = 0 when the format has no kernel
 * on this ISA (the generic C then runs). */
static kvc_status attend_simd(const attend_ctx *a, int64_t nq, int64_t n_seqs,
                              kvc_threadpool *pool, int *done) {
    const kvc_kvfmt *f = a->f;
    *done = 0;
    const kvc_kvfmt_kernel kern = simd_kernel(f);
    if (!kern) return KVC_OK;
    (void)n_seqs;
    const int64_t H = f->num_kv_heads, G = f->group, grp = a->grp;
    const int64_t hp = grp < KVC_KVFMT_NV ? grp : KVC_KVFMT_NV; /* heads per pass */
    const int64_t rb = KVC_KVFMT_NV / hp;                          /* rows per unit */
    const int64_t npass = (grp + hp - 1) / hp;
    /* row runs */
    int64_t nruns = 0;
    for (int64_t i = 0; i < nq;) {
        int64_t e = i + 1;
        while (e < nq && e - i < rb && a->q_seq[e] == a->q_seq[i]) e++;
        nruns++;
        i = e;
    }
    const int64_t nunits = nruns * H * npass;
    const int64_t BT = G <= 256 ? (256 / G) * G : G;
    const int64_t chunk = nunits < SPLIT_UNITS ? (SPLIT_TOKENS + BT - 1) / BT * BT : INT64_MAX / 2;
    sunit *units = malloc((size_t)nunits * sizeof *units);
    if (!units) return kvc__error(KVC_ERR_NOMEM, "kvc_kvfmt_attention: out of memory");
    int64_t ntasks = 0, ui = 0;
    for (int64_t i = 0; i < nq;) {
        int64_t e = i + 1;
        while (e < nq && e - i < rb && a->q_seq[e] == a->q_seq[i]) e++;
        int64_t maxpos = 0;
        for (int64_t r = i; r < e; r++) maxpos = a->q_pos[r] > maxpos ? a->q_pos[r] : maxpos;
        const kvc_kvfmt_seq *s = &a->seqs[a->q_seq[i]];
        const int64_t nquant = (s->n_kv / G) * G;
        int64_t qend = (maxpos / G + 1) * G;
        if (qend > nquant) qend = nquant;
        const int64_t nch = qend > 0 ? (qend + chunk - 1) / chunk : 1;
        for (int64_t h = 0; h < H; h++)
            for (int64_t p = 0; p < npass; p++) {
                sunit *u = &units[ui++];
                u->row0 = i;
                u->nrows = (int32_t)(e - i);
                u->h = (int32_t)h;
                u->hq0 = (int32_t)(h * grp + p * hp);
                u->nh = (int32_t)(grp - p * hp < hp ? grp - p * hp : hp);
                u->nchunks = (int32_t)nch;
                u->qend = qend;
                u->chunk = chunk;
                u->task0 = ntasks;
                ntasks += nch;
            }
        i = e;
    }
    const int64_t sstride = 2 * KVC_KVFMT_NV + KVC_KVFMT_NV * f->head_dim;
    int64_t *task_unit = malloc((size_t)ntasks * sizeof *task_unit);
    float *scratch = kvc__scratch_get(pool, (size_t)(ntasks * sstride) * sizeof(float));
    if (!task_unit || !scratch) {
        free(units);
        free(task_unit);
        if (scratch) kvc__scratch_release(pool, scratch);
        return kvc__error(KVC_ERR_NOMEM, "kvc_kvfmt_attention: out of memory");
    }
    for (int64_t u = 0; u < nunits; u++)
        for (int32_t k = 0; k < units[u].nchunks; k++) task_unit[units[u].task0 + k] = u;
    simd_ctx c = {f, a->l, a->pages, a->q, a->out, a->lse, a->seqs, a->q_seq, a->q_pos,
                  kern, units, task_unit, scratch, sstride,
                  a->sm_scale * 1.44269504088896341f};
    kvc__parallel_for(pool, ntasks, simd_task, &c);
    kvc__parallel_for(pool, nunits, simd_finish, &c);
    kvc__scratch_release(pool, scratch);
    free(task_unit);
    free(units);
    *done = 1;
    return KVC_OK;
}
#endif

kvc_status kvc_kvfmt_attention(const kvc_kvfmt *f, const kvc_tensor *pages,
                               const kvc_kvfmt_seq *seqs, int64_t n_seqs, const kvc_tensor *q,
                               const int32_t *q_seq, const int32_t *q_pos,
                               const kvc_attn_params *params, kvc_tensor *out, kvc_tensor *lse,
                               kvc_threadpool *pool) {
    static const char fn[] = "kvc_kvfmt_attention";
    KVC_TRY(kvc_kvfmt_check(f));
    KVC_CHECK(f->group <= 512, "%s: group %d above 512", fn, (int)f->group);
    KVC_CHECK(pages && q && out && (seqs || n_seqs == 0) && n_seqs >= 0,
              "%s: NULL argument", fn);
    KVC_TRY(kvc__check_tensor(pages, "pages", 1));
    KVC_TRY(kvc__check_tensor(q, "q", 1));
    KVC_TRY(kvc__check_tensor(out, "out", 1));
    KVC_TRY(kvc__check_writable(out, "out"));
    const kvc__kvfmt_layout l = kvc__kvfmt_layout_of(f);
    const int64_t H = f->num_kv_heads, Dh = f->head_dim, P = f->page_size, G = f->group;
    KVC_CHECK(pages->dtype == KVC_U8 && pages->ndim == 2 && pages->shape[1] == (int64_t)l.page,
              "%s: pages must be uint8 (num_pages, %zu)", fn, l.page);
    KVC_CHECK(q->dtype == KVC_F32 && q->ndim == 3 && q->shape[2] == Dh && q->shape[1] >= 1 &&
                  q->shape[1] % H == 0,
              "%s: q must be float32 (nq, Hq, %lld) with Hq a multiple of %lld", fn,
              (long long)Dh, (long long)H);
    const int64_t nq = q->shape[0], Hq = q->shape[1];
    KVC_CHECK(out->dtype == KVC_F32 && out->ndim == 3 && out->shape[0] == nq &&
                  out->shape[1] == Hq && out->shape[2] == Dh,
              "%s: out must be float32 (%lld, %lld, %lld)", fn, (long long)nq, (long long)Hq,
              (long long)Dh);
    if (lse) {
        KVC_TRY(kvc__check_tensor(lse, "lse", 0));
        KVC_TRY(kvc__check_writable(lse, "lse"));
        KVC_CHECK(lse->dtype == KVC_F32 && lse->ndim == 2 && lse->shape[0] == nq &&
                      lse->shape[1] == Hq,
                  "%s: lse must be float32 (%lld, %lld)", fn, (long long)nq, (long long)Hq);
    }
    KVC_CHECK(nq == 0 || (q_seq && q_pos), "%s: q_seq and q_pos must not be NULL", fn);
    float sm = 0;
    if (params) {
        KVC_CHECK(!(params->sm_scale < 0) && isfinite(params->sm_scale),
                  "%s: sm_scale must be finite and >= 0", fn);
        if (params->logits_soft_cap > 0 || params->window_left >= 0 || params->sinks)
            return kvc__error(KVC_ERR_UNSUPPORTED, "%s: logits_soft_cap, window_left and sinks "
                              "are not supported over compressed formats", fn);
        sm = params->sm_scale;
    }
    if (sm == 0) sm = (float)(1.0 / sqrt((double)Dh));
    for (int64_t b = 0; b < n_seqs; b++) {
        const kvc_kvfmt_seq *s = &seqs[b];
        KVC_CHECK(s->n_kv >= 0, "%s: sequence %lld: n_kv %lld", fn, (long long)b,
                  (long long)s->n_kv);
        if (s->n_kv == 0) continue;
        KVC_CHECK(s->pages && s->tail, "%s: sequence %lld: NULL pages or tail", fn, (long long)b);
        for (int64_t p = 0; p < ((s->n_kv / G) * G + P - 1) / P; p++)
            KVC_CHECK(s->pages[p] >= 0 && s->pages[p] < pages->shape[0], "%s: sequence %lld: "
                      "page id %d outside [0, %lld)", fn, (long long)b, (int)s->pages[p],
                      (long long)pages->shape[0]);
    }
    for (int64_t i = 0; i < nq; i++) {
        KVC_CHECK(q_seq[i] >= 0 && q_seq[i] < n_seqs, "%s: q_seq[%lld] = %d outside [0, %lld)",
                  fn, (long long)i, (int)q_seq[i], (long long)n_seqs);
        KVC_CHECK(q_pos[i] >= 0 && q_pos[i] < seqs[q_seq[i]].n_kv, "%s: q_pos[%lld] = %d "
                  "outside [0, %lld)", fn, (long long)i, (int)q_pos[i],
                  (long long)seqs[q_seq[i]].n_kv);
    }
    if (nq == 0) return KVC_OK;
    attend_ctx c = {f, l, pages, q, out, lse, seqs, q_seq, q_pos, Hq, Hq / H, sm};
#ifdef KVFMT_SIMD
    int done = 0;
    KVC_TRY(attend_simd(&c, nq, n_seqs, pool, &done));
    if (done) return KVC_OK;
#endif
    kvc__parallel_for(pool, nq * H, attend_task, &c);
    return KVC_OK;
}
