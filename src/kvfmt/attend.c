/* kvc_kvfmt_attention (docs/KV_FORMATS.md section 6): online softmax over
 * the quantized groups, read from the pages with the K parameters folded
 * into the query (q . k = (q * scale) . code + q . zero), then over the
 * float16 tail; the rotation of V is undone on the output. One task per
 * (query row, KV head) handles the query heads of that GQA group. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvfmt_internal.h"

#define HC 8 /* query heads per pass: bounds the stack buffers */

typedef struct attend_ctx {
    const kvc_kvfmt *f;
    kvc__kvfmt_layout l;
    const kvc_tensor *pages, *q, *out, *lse;
    const kvc_kvfmt_seq *seqs;
    const kvc__kvfmt_win *wins;
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
static void softmax_step(state *st, int64_t ng, float (*s)[512], int64_t n, int64_t Dh) {
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
            for (int64_t i = 0; i < Dh; i++) st->o[g][i] *= corr;
    }
}

/* Row u of a query's float16 rows (K, or V with kv 1): sink row u for u <
 * ns, else position nq + u - ns from the window. */
static const uint16_t *f16_row(const kvc_kvfmt *f, const kvc_kvfmt_seq *s,
                               const kvc__kvfmt_win *win, int64_t ns, int64_t nq, int64_t u,
                               int kv) {
    if (u < ns) return s->sink + (kv * f->sink + u) * (int64_t)f->num_kv_heads * f->head_dim;
    return (kv ? win->v : win->k) + kvc__kvfmt_slot(win, nq + u - ns) * win->rs;
}

static void attend_task(void *arg, int64_t task) {
    const attend_ctx *c = arg;
    const kvc_kvfmt *f = c->f;
    const kvc__kvfmt_layout *l = &c->l;
    const int64_t H = f->num_kv_heads, Dh = f->head_dim, P = f->page_size, G = f->group;
    const int64_t HD = H * Dh, gv = f->v_group, nvg = Dh / gv;
    const int64_t row = task / H, h = task % H;
    const kvc_kvfmt_seq *s = &c->seqs[c->q_seq[row]];
    const kvc__kvfmt_win *win = &c->wins[c->q_seq[row]];
    const int64_t pos = c->q_pos[row], nq = kvc__kvfmt_f16_from(f, pos);
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
        for (int64_t j = 0; j * G < nq; j++) { /* nq <= pos + 1: whole groups */
            const int64_t t0 = j * G, t1 = t0 + G;
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
                for (int64_t ch = 0; ch < Dh; ch++)
                    unpack(pg, kvc__kvfmt_kidx(bits, Dh, P, h, ch, t % P), 1, bits, 0, codes + ch);
                for (int64_t g = 0; g < ng; g++) {
                    float d = 0;
                    for (int64_t ch = 0; ch < Dh; ch++) d += qs[g][ch] * codes[ch];
                    /* the sink positions are read in float16 below */
                    sc[g][t - t0] = t < f->sink ? -INFINITY : (d + bias[g]) * c->sm_scale;
                }
            }
            softmax_step(&st, ng, sc, t1 - t0, Dh);
            /* P . V: per channel, a dot product over the group's tokens */
            for (int64_t ch = 0; ch < Dh; ch++) {
                const int64_t vg = ch / gv;
                for (int64_t t = t0; t < t1;) { /* page by page */
                    const int64_t te = (t / P + 1) * P < t1 ? (t / P + 1) * P : t1;
                    const unsigned char *pg = page_of(c, s, t);
                    float cv[512]; /* te - t <= G <= 512 (a page may hold more) */
                    unpack(pg + l->v_codes, (h * Dh + ch) * P + t % P, te - t, bits, !f->v_asym,
                           cv);
                    for (int64_t u = t; u < te; u++)
                        wc[u - t0] = cv[u - t] * f16at(pg, l->v_scale, (h * P + u % P) * nvg + vg);
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
        /* float16 rows: the sink rows when group 0 was read quantized, then
         * positions nq .. pos from the window; in blocks of up to 512 (at most
         * S + G - 1 + W rows) */
        const int64_t ns = nq > 0 ? f->sink : 0, nf = ns + pos + 1 - nq;
        for (int64_t u0 = 0; u0 < nf; u0 += 512) {
            const int64_t u1 = u0 + 512 < nf ? u0 + 512 : nf;
            for (int64_t u = u0; u < u1; u++) {
                const uint16_t *kr = f16_row(f, s, win, ns, nq, u, 0) + h * Dh;
                for (int64_t ch = 0; ch < Dh; ch++) codes[ch] = kvc_f16_to_f32(kr[ch]);
                for (int64_t g = 0; g < ng; g++) {
                    float d = 0;
                    for (int64_t ch = 0; ch < Dh; ch++) d += qv[g][ch] * codes[ch];
                    sc[g][u - u0] = d * c->sm_scale;
                }
            }
            softmax_step(&st, ng, sc, u1 - u0, Dh);
            for (int64_t u = u0; u < u1; u++) {
                const uint16_t *vr = f16_row(f, s, win, ns, nq, u, 1) + h * Dh;
                for (int64_t ch = 0; ch < Dh; ch++) codes[ch] = kvc_f16_to_f32(vr[ch]);
                for (int64_t g = 0; g < ng; g++) {
                    const float p = sc[g][u - u0];
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

kvc__kvfmt_win kvc__kvfmt_tail_win(const kvc_kvfmt *f, const kvc_kvfmt_seq *s) {
    const int64_t T = f->group + f->window, HD = (int64_t)f->num_kv_heads * f->head_dim;
    const int64_t w0 = s->n_kv / f->group * f->group - f->window;
    kvc__kvfmt_win w = {s->tail, s->tail ? s->tail + T * HD : NULL, HD, w0 > 0 ? w0 : 0, T};
    return w;
}

/* Page ids a query at p reads: those of its quantized groups. */
static int64_t query_pages(const kvc_kvfmt *f, int32_t p) {
    return (kvc__kvfmt_f16_from(f, p) + f->page_size - 1) / f->page_size;
}

static int has_rows(const int64_t *row_indptr, int64_t b) {
    return row_indptr && row_indptr[b + 1] > row_indptr[b];
}

size_t kvc__kvfmt_idx_bytes(const kvc_kvfmt *f, const kvc_kvfmt_seq *seqs, int64_t n_seqs,
                            const int64_t *row_indptr, int64_t nq, const int32_t *q_seq,
                            const int32_t *q_pos) {
    const int64_t P = f->page_size;
    int64_t ids = 0;
    for (int64_t b = 0; b < n_seqs; b++)
        if (has_rows(row_indptr, b)) ids += (seqs[b].n_kv + P - 1) / P;
    /* a sequence without rows: the most its queries read, once per run of
     * them in q_seq (exact for a decode or a prefill, whose rows of a
     * sequence come together; more room than needed otherwise) */
    for (int64_t i = 0; i < nq;) {
        const int32_t b = q_seq[i];
        int64_t most = 0;
        for (; i < nq && q_seq[i] == b; i++) {
            const int64_t np = query_pages(f, q_pos[i]);
            most = np > most ? np : most;
        }
        if (!has_rows(row_indptr, b)) ids += most;
    }
    const size_t n = (size_t)n_seqs * (sizeof(kvc_kvfmt_seq) + 8) +
                     (row_indptr ? (size_t)(n_seqs + 1) * 8 : 0) + (size_t)nq * 8 +
                     (size_t)ids * 4;
    return (n + 63) / 64 * 64;
}

void kvc__kvfmt_idx_copy(const kvc_kvfmt *f, const kvc_kvfmt_seq *seqs, int64_t n_seqs,
                         const int64_t *row_indptr, int64_t nq, const int32_t *q_seq,
                         const int32_t *q_pos, void *mem, kvc__kvfmt_idx *out) {
    const int64_t P = f->page_size;
    kvc_kvfmt_seq *s = mem;
    int64_t *need = (int64_t *)(s + n_seqs); /* page ids read, per sequence */
    int64_t *ip = need + n_seqs;
    int32_t *qs = (int32_t *)(ip + (row_indptr ? n_seqs + 1 : 0)), *qp = qs + nq, *ids = qp + nq;
    if (n_seqs > 0) memcpy(s, seqs, (size_t)n_seqs * sizeof *s);
    if (row_indptr) memcpy(ip, row_indptr, (size_t)(n_seqs + 1) * sizeof *ip);
    if (nq > 0) {
        memcpy(qs, q_seq, (size_t)nq * sizeof *qs);
        memcpy(qp, q_pos, (size_t)nq * sizeof *qp);
    }
    for (int64_t b = 0; b < n_seqs; b++)
        need[b] = has_rows(row_indptr ? ip : NULL, b) ? (s[b].n_kv + P - 1) / P : 0;
    for (int64_t i = 0; i < nq; i++) { /* with rows: q_pos < n_kv reads no more */
        const int64_t np = query_pages(f, qp[i]);
        need[qs[i]] = np > need[qs[i]] ? np : need[qs[i]];
    }
    for (int64_t b = 0; b < n_seqs; b++) {
        if (need[b] > 0) memcpy(ids, s[b].pages, (size_t)need[b] * sizeof *ids);
        s[b].pages = ids;
        ids += need[b];
    }
    out->seqs = s;
    out->row_indptr = row_indptr ? ip : NULL;
    out->q_seq = qs;
    out->q_pos = qp;
}

kvc_status kvc__kvfmt_attn_check(const char *fn, const kvc_kvfmt *f, const kvc_tensor *pages,
                                 const kvc_kvfmt_seq *seqs, int64_t n_seqs, const int64_t *lo,
                                 const kvc_tensor *q, const int32_t *q_seq, const int32_t *q_pos,
                                 const kvc_attn_params *params, const kvc_tensor *out,
                                 const kvc_tensor *lse, float *sm) {
    KVC_CHECK(q && out, "%s: NULL q or out", fn);
    KVC_TRY(kvc__check_tensor(q, "q", 1));
    KVC_TRY(kvc__check_tensor(out, "out", 1));
    KVC_TRY(kvc__check_writable(out, "out"));
    const int64_t H = f->num_kv_heads, Dh = f->head_dim, P = f->page_size;
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
    float scale = 0;
    if (params) {
        KVC_CHECK(!(params->sm_scale < 0) && isfinite(params->sm_scale),
                  "%s: sm_scale must be finite and >= 0", fn);
        /* the ranges every attention operator refuses outside (attention.h) */
        KVC_CHECK(isfinite(params->logits_soft_cap) && params->logits_soft_cap >= 0.0f,
                  "%s: logits_soft_cap must be finite and >= 0 (0 disables it)", fn);
        KVC_CHECK(params->window_left >= -1, "%s: window_left %d must be >= -1", fn,
                  (int)params->window_left);
        if (params->logits_soft_cap > 0 || params->window_left >= 0 || params->sinks)
            return kvc__error(KVC_ERR_UNSUPPORTED, "%s: logits_soft_cap, window_left and sinks "
                              "are not supported over compressed formats", fn);
        scale = params->sm_scale;
    }
    *sm = scale != 0 ? scale : (float)(1.0 / sqrt((double)Dh));
    for (int64_t i = 0; i < nq; i++) {
        KVC_CHECK(q_seq[i] >= 0 && q_seq[i] < n_seqs, "%s: q_seq[%lld] = %d outside [0, %lld)",
                  fn, (long long)i, (int)q_seq[i], (long long)n_seqs);
        const kvc_kvfmt_seq *s = &seqs[q_seq[i]];
        const int64_t l0 = lo ? lo[q_seq[i]] : 0;
        KVC_CHECK(q_pos[i] >= l0 && q_pos[i] < s->n_kv, "%s: q_pos[%lld] = %d outside [%lld, "
                  "%lld) (positions whose float16 values are gone from the tail are attended "
                  "in the call that stores them)", fn, (long long)i, (int)q_pos[i],
                  (long long)l0, (long long)s->n_kv);
        KVC_CHECK(s->pages && s->tail, "%s: sequence %d: NULL pages or tail", fn, (int)q_seq[i]);
        KVC_CHECK(f->sink == 0 || s->sink, "%s: sequence %d: NULL sink (the format keeps %d "
                  "sink rows)", fn, (int)q_seq[i], (int)f->sink);
        const int64_t np = (kvc__kvfmt_f16_from(f, q_pos[i]) + P - 1) / P;
        for (int64_t p = 0; p < np; p++)
            KVC_CHECK(s->pages[p] >= 0 && s->pages[p] < pages->shape[0], "%s: sequence %d: "
                      "page id %d outside [0, %lld)", fn, (int)q_seq[i], (int)s->pages[p],
                      (long long)pages->shape[0]);
    }
    return KVC_OK;
}

void kvc__kvfmt_attend(const kvc_kvfmt *f, const kvc_tensor *pages, const kvc_kvfmt_seq *seqs,
                       const kvc__kvfmt_win *wins, const kvc_tensor *q, const int32_t *q_seq,
                       const int32_t *q_pos, float sm, kvc_tensor *out, kvc_tensor *lse,
                       kvc_threadpool *pool, void *mem) {
    const int64_t nq = q->shape[0], Hq = q->shape[1], H = f->num_kv_heads;
    if (nq == 0) return;
    if (kvc__kvfmt_attend_simd(f, pages, seqs, wins, q, q_seq, q_pos, sm, out, lse, pool, mem))
        return;
    attend_ctx c = {f, kvc__kvfmt_layout_of(f), pages, q, out, lse, seqs, wins, q_seq, q_pos,
                    Hq, Hq / H, sm};
    kvc__parallel_for(pool, nq * H, attend_task, &c);
}

kvc_status kvc_kvfmt_attention(const kvc_kvfmt *f, const kvc_tensor *pages,
                               const kvc_kvfmt_seq *seqs, int64_t n_seqs, const kvc_tensor *q,
                               const int32_t *q_seq, const int32_t *q_pos,
                               const kvc_attn_params *params, kvc_tensor *out, kvc_tensor *lse,
                               kvc_threadpool *pool) {
    static const char fn[] = "kvc_kvfmt_attention";
    KVC_TRY(kvc_kvfmt_check(f));
    KVC_CHECK(f->group <= 512, "%s: group %d above 512", fn, (int)f->group);
    KVC_CHECK(pages && (seqs || n_seqs == 0) && n_seqs >= 0 && n_seqs <= ((int64_t)1 << 31),
              "%s: NULL argument", fn);
    KVC_TRY(kvc__check_tensor(pages, "pages", 1));
    const kvc__kvfmt_layout l = kvc__kvfmt_layout_of(f);
    KVC_CHECK(pages->dtype == KVC_U8 && pages->ndim == 2 && pages->shape[1] == (int64_t)l.page,
              "%s: pages must be uint8 (num_pages, %zu)", fn, l.page);
    const int64_t nq = q ? q->shape[0] : 0;
    int64_t *lo = NULL;
    kvc__kvfmt_win *wins = NULL;
    void *mem = NULL;
    if (n_seqs > 0 && nq > 0) {
        lo = malloc((size_t)n_seqs * (sizeof *lo + sizeof *wins));
        if (!lo) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
        wins = (kvc__kvfmt_win *)(lo + n_seqs);
        for (int64_t b = 0; b < n_seqs; b++) {
            const int64_t g0 = seqs[b].n_kv / f->group * f->group;
            lo[b] = g0 > 0 ? g0 - 1 : 0;
            wins[b] = kvc__kvfmt_tail_win(f, &seqs[b]);
        }
    }
    float sm;
    kvc_status st = kvc__kvfmt_attn_check(fn, f, pages, seqs, n_seqs, lo, q, q_seq, q_pos,
                                          params, out, lse, &sm);
    if (st == KVC_OK && nq > 0) {
        /* the inputs read while out and lse are written, copied first (the
         * format and the tensors' descriptions too) */
        const kvc_kvfmt fc = *f;
        kvc_tensor pc = *pages, qc = *q, oc = *out, lc = lse ? *lse : *out;
        const size_t cb = kvc__kvfmt_idx_bytes(f, seqs, n_seqs, NULL, nq, q_seq, q_pos);
        const size_t sb = kvc__kvfmt_simd_bytes(f, nq, q->shape[1], q_seq, q_pos);
        if (!(mem = malloc(cb + sb))) {
            st = kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
        } else {
            kvc__kvfmt_idx ix;
            kvc__kvfmt_idx_copy(&fc, seqs, n_seqs, NULL, nq, q_seq, q_pos, mem, &ix);
            kvc__kvfmt_attend(&fc, &pc, ix.seqs, wins, &qc, ix.q_seq, ix.q_pos, sm, &oc,
                              lse ? &lc : NULL, pool, sb ? (char *)mem + cb : NULL);
        }
    }
    free(mem);
    free(lo);
    return st;
}
