/* kvc_kvfmt_append: rows to float16 (V rotated), the tail, and the
 * quantization of every K group the rows complete (docs/KV_FORMATS.md
 * sections 3-5). The quantizer's arithmetic is exact in double, so the
 * bytes depend only on the float16 inputs. */
#include <math.h>
#include <string.h>

#include "../kernels/kernels.h"
#include "kvfmt_internal.h"

#define ROWS_PER_TASK 32

typedef struct store_ctx {
    const kvc_kvfmt *f;
    kvc__kvfmt_layout l;
    const kvc_tensor *pages, *key, *value;
    const kvc_kvfmt_seq *seqs;
    const int64_t *row_indptr;
    int64_t n_seqs, nnz, HD;
    /* staging: per sequence with rows, positions [w0[b], n_kv) as float16
     * (row, 2, H, Dh) from row off[b]: the old tail, then this call's rows
     * (V rotated) */
    uint16_t *st;
    int64_t *w0, *off, *dst; /* dst: staging row of input row r */
    unsigned char *bad;      /* per conversion task: a non-finite or overflowing value */
    int64_t *task_seq;       /* complete group -> sequence; task_grp -> group index */
    int64_t *task_grp;
    int64_t hpt, nhc;        /* heads per group task, tasks per group */
} store_ctx;

/* A zero point of -0 is stored as +0: min over {-0, +0} is either. */
static uint16_t canon0(uint16_t h) { return h == 0x8000u ? 0 : h; }

/* Rows [task * ROWS_PER_TASK, ...) to float16; V rotated first. The
 * dispatched conversions round to nearest even as kvc_f32_to_f16 does, so
 * the bytes are the same on every ISA. */
static void convert_task(void *arg, int64_t task) {
    store_ctx *c = arg;
    const kvc_kernels *kk = kvc__kernels();
    const int64_t H = c->f->num_kv_heads, Dh = c->f->head_dim;
    const int64_t r0 = task * ROWS_PER_TASK;
    const int64_t r1 = r0 + ROWS_PER_TASK < c->nnz ? r0 + ROWS_PER_TASK : c->nnz;
    _Alignas(64) float buf[KVC_ATTN_MAX_HEAD_DIM];
    int ok = 1;
    for (int64_t r = r0; r < r1; r++)
        for (int kv = 0; kv < 2; kv++)
            for (int64_t h = 0; h < H; h++) {
                const kvc_tensor *t = kv ? c->value : c->key;
                const int64_t off = r * t->stride[0] + h * t->stride[1];
                const void *src = (const char *)t->data + off * (t->dtype == KVC_F32 ? 4 : 2);
                kk->convert(src, t->dtype, buf, KVC_F32, Dh);
                ok &= kk->all_finite(buf, KVC_F32, Dh, INFINITY);
                if (kv && c->f->rotate_v) kvc__kvfmt_rotate(buf, (int32_t)Dh);
                uint16_t *dst = c->st + ((c->dst[r] * 2 + kv) * H + h) * Dh;
                kk->convert(buf, KVC_F32, dst, KVC_F16, Dh);
                ok &= kk->all_finite(dst, KVC_F16, Dh, INFINITY); /* beyond float16's range */
            }
    c->bad[task] = (unsigned char)!ok;
}

/* Smallest float16 s >= 0 with s * L >= d (d >= 0 exact), as bits. */
static uint16_t cover_scale(double d, int L) {
    if (d <= 0) return 0;
    uint16_t s = kvc_f32_to_f16((float)(d / L));
    while ((double)kvc_f16_to_f32(s) * L < d) s++;
    while (s > 0 && (double)kvc_f16_to_f32((uint16_t)(s - 1)) * L >= d) s--;
    return s;
}

/* Code of x in [zero, zero + L * scale]: rint of the exact quotient (the
 * default rounding mode is to nearest even). */
static int code_of(double x, double zero, double scale) {
    return scale > 0 ? (int)rint((x - zero) / scale) : 0;
}

/* code_of for x >= zero (an asymmetric group's values) and scale > 0: the
 * quotient is in [0, 2^8], where adding and taking away 2^52 rounds to
 * nearest even as rint does, without a libm call or a branch, so the loops
 * below vectorize. A group whose scale is 0 has every value equal to its
 * zero point: its scale is passed as 1 (code 0 either way). */
static inline int code_up(float x, float zero, double scale) {
    return (int)((((double)x - (double)zero) / scale + 0x1p52) - 0x1p52);
}

static inline double scale_for_codes(uint16_t sc) {
    return sc ? (double)kvc_f16_to_f32(sc) : 1.0;
}

static unsigned char *page_ptr(const store_ctx *c, const kvc_kvfmt_seq *s, int64_t t) {
    const int32_t id = s->pages[t / c->f->page_size];
    return (unsigned char *)c->pages->data + (int64_t)id * c->pages->stride[0];
}

static void put_f16(unsigned char *base, size_t off, int64_t idx, uint16_t v) {
    memcpy(base + off + (size_t)idx * 2, &v, 2);
}

/* The codes of head h's Dh channels for tokens t and t + 1 (4-bit: t even,
 * both in one page, the same byte) or t alone (8-bit). idx(ch, slot) is the
 * code's index in the field at off. */
static void put_codes(unsigned char *pg, size_t off, int bits, int64_t Dh, int64_t P, int64_t h,
                      int64_t slot, const unsigned char *q0, const unsigned char *q1, int k) {
    unsigned char *base = pg + off;
    if (bits == 4) { /* channel-major, nibbles along P: slot even, low nibble */
        for (int64_t ch = 0; ch < Dh; ch++)
            base[((h * Dh + ch) * P + slot) / 2] = (unsigned char)(q0[ch] | (q1[ch] << 4));
    } else if (k) { /* K: channel pairs, token by token; an odd last channel alone */
        int64_t ch = 0;
        for (; ch + 1 < Dh; ch += 2) {
            unsigned char *d = base + (h * Dh + ch) * P + 2 * slot;
            d[0] = q0[ch];
            d[1] = q0[ch + 1];
        }
        if (ch < Dh) base[kvc__kvfmt_kidx(8, Dh, P, h, ch, slot)] = q0[ch];
    } else {
        for (int64_t ch = 0; ch < Dh; ch++) base[(h * Dh + ch) * P + slot] = q0[ch];
    }
}

/* Smallest and largest of x[0 .. n): in 8 lanes, so that the loop
 * vectorizes (a running minimum waits on its latency per value). The
 * order can change only the sign of a zero result, which no output sees:
 * codes subtract it, the stored zero point is canon0's, the range is the
 * same. */
static void range_of(const float *x, int64_t n, float *lo, float *hi) {
    float l8[8], h8[8], l = INFINITY, h = -INFINITY;
    for (int u = 0; u < 8; u++) l8[u] = INFINITY, h8[u] = -INFINITY;
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        for (int u = 0; u < 8; u++) {
            l8[u] = x[k + u] < l8[u] ? x[k + u] : l8[u];
            h8[u] = x[k + u] > h8[u] ? x[k + u] : h8[u];
        }
    for (; k < n; k++) {
        l = x[k] < l ? x[k] : l;
        h = x[k] > h ? x[k] : h;
    }
    for (int u = 0; u < 8; u++) {
        l = l8[u] < l ? l8[u] : l;
        h = h8[u] > h ? h8[u] : h;
    }
    *lo = l;
    *hi = h;
}

/* One complete K group of one sequence: token t's float16 values come from
 * this call's rows when t >= pos0, else from the tail. The values are
 * converted to float32 a head row at a time (exact); the arithmetic is the
 * reference's (code_of, cover_scale), so the bytes are too. */
static void group_task(void *arg, int64_t task) {
    store_ctx *c = arg;
    const kvc_kvfmt *f = c->f;
    const kvc_kernels *kk = kvc__kernels();
    const int64_t gt = task / c->nhc, b = c->task_seq[gt], j = c->task_grp[gt];
    const kvc_kvfmt_seq *s = &c->seqs[b];
    const int64_t Dh = f->head_dim, P = f->page_size, G = f->group;
    const int64_t h0 = task % c->nhc * c->hpt;
    const int64_t h1 = h0 + c->hpt < f->num_kv_heads ? h0 + c->hpt : f->num_kv_heads;
    const int L = (1 << f->bits) - 1, Qs = (1 << (f->bits - 1)) - 1, bits = f->bits;
    const int step = bits == 4 ? 2 : 1; /* tokens per code write (G, P and j * G even at 4 bits) */
    const uint16_t *src[2 * 512]; /* rows of the group: K at [i], V at [G + i] (G <= 512) */
    for (int64_t i = 0; i < G; i++) {
        const uint16_t *r = c->st + (c->off[b] + j * G + i - c->w0[b]) * 2 * c->HD;
        src[i] = r;
        src[G + i] = r + c->HD;
    }
    enum { D = KVC_ATTN_MAX_HEAD_DIM };
    _Alignas(64) float x[2][D], lo[D], hi[D];
    double scd[D];
    unsigned char q[2][D];
    /* K: per channel over the G tokens; in group 0 the sink positions [0, S)
     * are left out (their codes are 0: attention reads the sink rows) */
    const int64_t R = G > P ? G / P : 1, per = c->l.k_share, i0 = j == 0 ? f->sink : 0;
    for (int64_t h = h0; h < h1; h++) {
        for (int64_t ch = 0; ch < Dh; ch++) lo[ch] = INFINITY, hi[ch] = -INFINITY;
        for (int64_t i = i0; i < G; i++) {
            kk->convert(src[i] + h * Dh, KVC_F16, x[0], KVC_F32, Dh);
            for (int64_t ch = 0; ch < Dh; ch++) {
                lo[ch] = x[0][ch] < lo[ch] ? x[0][ch] : lo[ch];
                hi[ch] = x[0][ch] > hi[ch] ? x[0][ch] : hi[ch];
            }
        }
        for (int64_t ch = 0; ch < Dh; ch++) {
            const int64_t e = h * Dh + ch;
            const uint16_t sc = cover_scale((double)hi[ch] - (double)lo[ch], L);
            scd[ch] = scale_for_codes(sc);
            /* parameters: page of the group (P >= G) or page e / per of its run */
            unsigned char *pg;
            int64_t idx;
            if (G <= P) {
                pg = page_ptr(c, s, j * G);
                idx = (j % (P / G)) * c->HD + e;
            } else {
                pg = page_ptr(c, s, (j * R + e / per) * P);
                idx = e % per;
            }
            put_f16(pg, c->l.k_scale, idx, sc);
            put_f16(pg, c->l.k_zero, idx, canon0(kvc_f32_to_f16(lo[ch]))); /* lo: a float16 */
        }
        for (int64_t i = 0; i < G; i += step) {
            for (int u = 0; u < step; u++) {
                if (i + u < i0) {
                    memset(q[u], 0, (size_t)Dh);
                    continue;
                }
                kk->convert(src[i + u] + h * Dh, KVC_F16, x[u], KVC_F32, Dh);
                for (int64_t ch = 0; ch < Dh; ch++)
                    q[u][ch] = (unsigned char)code_up(x[u][ch], lo[ch], scd[ch]);
            }
            const int64_t t = j * G + i;
            put_codes(page_ptr(c, s, t), c->l.k_codes, bits, Dh, P, h, t % P, q[0], q[1], 1);
        }
    }
    /* V: per token, groups of gv channels */
    const int64_t gv = f->v_group, ng = Dh / gv;
    for (int64_t i = 0; i < G; i += step) {
        const int64_t t = j * G + i, slot = t % P;
        unsigned char *pg = page_ptr(c, s, t);
        for (int64_t h = h0; h < h1; h++) {
            for (int u = 0; u < step; u++) {
                const uint16_t *xh = src[G + i + u] + h * Dh;
                for (int64_t g = 0; g < ng; g++) {
                    const uint16_t *xr = xh + g * gv;
                    const int64_t pidx = (h * P + slot + u) * ng + g;
                    if (f->v_asym) {
                        float *xf = x[u] + g * gv, l, hv;
                        kk->convert(xr, KVC_F16, xf, KVC_F32, gv);
                        range_of(xf, gv, &l, &hv);
                        const uint16_t sc = cover_scale((double)hv - (double)l, L);
                        const double sd = scale_for_codes(sc);
                        for (int64_t k = 0; k < gv; k++)
                            q[u][g * gv + k] = (unsigned char)code_up(xf[k], l, sd);
                        put_f16(pg, c->l.v_scale, pidx, sc);
                        put_f16(pg, c->l.v_zero, pidx, canon0(kvc_f32_to_f16(l)));
                    } else {
                        float amax = 0;
                        for (int64_t k = 0; k < gv; k++) {
                            const float v = fabsf(kvc_f16_to_f32(xr[k]));
                            amax = v > amax ? v : amax;
                        }
                        const uint16_t sc = cover_scale(amax, Qs);
                        const double sd = kvc_f16_to_f32(sc);
                        for (int64_t k = 0; k < gv; k++)
                            q[u][g * gv + k] = (unsigned char)(code_of(kvc_f16_to_f32(xr[k]), 0.0, sd) &
                                                               (bits == 8 ? 0xff : 0x0f));
                        put_f16(pg, c->l.v_scale, pidx, sc);
                    }
                }
            }
            put_codes(pg, c->l.v_codes, bits, Dh, P, h, slot, q[0], q[1], 0);
        }
    }
}

/* Heads per group task: whole groups when there are as many as threads
 * (a pass over one head reads every staged row for a few lines: about 15%
 * more time than a whole group's), else each group cut into runs of heads
 * so that every thread has one: a decode step's single complete group took
 * 0.35-0.4 ms on one thread at H 8 / Dh 128. The bytes do not depend on the
 * cut. */
static int64_t heads_per_task(const kvc_kvfmt *f, int64_t n_groups, const kvc_threadpool *pool) {
    const int64_t nt = kvc_threadpool_n_threads(pool), H = f->num_kv_heads;
    if (n_groups >= nt || (int64_t)f->group * f->head_dim * H < 8192) return H;
    const int64_t runs = (nt + n_groups - 1) / n_groups;
    return (H + runs - 1) / runs;
}

/* Staging rows of sequence b: [w0, n_kv), w0 = max(0, floor(pos0 / G) * G -
 * W): the old tail (which holds them) and the new rows. */
static int64_t stage_w0(const kvc_kvfmt *f, int64_t pos0) {
    const int64_t w0 = pos0 / f->group * f->group - f->window;
    return w0 > 0 ? w0 : 0;
}

/* Rows [pos0, n) that complete no group (most decode steps) go straight into
 * the ring: the slots they take held positions below n - G - W, which no
 * query of the call reads (section 6), so only they are staged. */
static int ring_direct(const kvc_kvfmt *f, int64_t n, int64_t cnt) {
    return cnt > 0 && (n - cnt) / f->group == n / f->group;
}

static int64_t stage_from(const kvc_kvfmt *f, int64_t n, int64_t cnt) {
    return ring_direct(f, n, cnt) ? n - cnt : stage_w0(f, n - cnt);
}

/* Staged rows of positions [from, n_kv) of sequence b into its tail ring. */
static void write_tail(const store_ctx *c, int64_t b, int64_t from) {
    const kvc_kvfmt_seq *s = &c->seqs[b];
    const int64_t T = c->f->group + c->f->window, HD = c->HD;
    for (int64_t t = from; t < s->n_kv; t++) {
        const uint16_t *r = c->st + (c->off[b] + t - c->w0[b]) * 2 * HD;
        memcpy(s->tail + (t % T) * HD, r, (size_t)HD * 2);
        memcpy(s->tail + (T + t % T) * HD, r + HD, (size_t)HD * 2);
    }
}

static size_t scratch_bytes(const kvc_kvfmt *f, int64_t nnz, int64_t n_seqs, int64_t n_rows,
                            int64_t n_tasks) {
    const int64_t n_conv = (nnz + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    const int64_t HD = (int64_t)f->num_kv_heads * f->head_dim;
    return (size_t)n_rows * 4 * (size_t)HD + (size_t)(n_tasks * 2 + nnz + n_seqs * 2) * 8 +
           (size_t)n_seqs * sizeof(kvc__kvfmt_win) + (size_t)n_conv + 64;
}

/* Staged rows and completed groups of the sequences with rows. */
static void count_work(const kvc_kvfmt *f, const kvc_kvfmt_seq *seqs, int64_t n_seqs,
                       const int64_t *row_indptr, int64_t *n_rows, int64_t *n_tasks) {
    *n_rows = *n_tasks = 0;
    for (int64_t b = 0; b < n_seqs; b++) {
        const int64_t cnt = row_indptr[b + 1] - row_indptr[b], n = seqs[b].n_kv;
        if (cnt <= 0) continue;
        *n_tasks += n / f->group - (n - cnt) / f->group;
        *n_rows += n - stage_from(f, n, cnt);
    }
}

size_t kvc__kvfmt_step_scratch_bytes(const kvc_kvfmt *f, const kvc_kvfmt_seq *seqs,
                                     int64_t n_seqs, const int64_t *row_indptr, int64_t nq,
                                     int64_t Hq, const int32_t *q_seq, const int32_t *q_pos) {
    int64_t n_rows, n_tasks;
    count_work(f, seqs, n_seqs, row_indptr, &n_rows, &n_tasks);
    return kvc__kvfmt_idx_bytes(f, seqs, n_seqs, row_indptr, nq, q_seq, q_pos) +
           scratch_bytes(f, row_indptr[n_seqs], n_seqs, n_rows, n_tasks) +
           kvc__kvfmt_simd_bytes(f, nq, Hq, q_seq, q_pos);
}

/* Both entry points: store, then (q != NULL) attend. */
static kvc_status append_attend(const char *fn, const kvc_kvfmt *f, kvc_tensor *pages,
                                const kvc_kvfmt_seq *seqs, int64_t n_seqs,
                                const int64_t *row_indptr, const kvc_tensor *key,
                                const kvc_tensor *value, const kvc_tensor *q,
                                const int32_t *q_seq, const int32_t *q_pos,
                                const kvc_attn_params *params, kvc_tensor *out, kvc_tensor *lse,
                                kvc_threadpool *pool) {
    KVC_TRY(kvc_kvfmt_check(f));
    KVC_CHECK(f->group <= 512, "%s: group %d above 512", fn, (int)f->group);
    KVC_CHECK(pages != NULL && key != NULL && value != NULL && (seqs != NULL || n_seqs == 0) &&
                  row_indptr != NULL && n_seqs >= 0 && n_seqs <= ((int64_t)1 << 31),
              "%s: NULL argument", fn);
    KVC_TRY(kvc__check_tensor(pages, "pages", 1));
    KVC_TRY(kvc__check_tensor(key, "key", 1));
    KVC_TRY(kvc__check_tensor(value, "value", 1));
    const kvc__kvfmt_layout l = kvc__kvfmt_layout_of(f);
    const int64_t H = f->num_kv_heads, Dh = f->head_dim, P = f->page_size, G = f->group;
    const int64_t T = G + f->window, HD = H * Dh;
    KVC_CHECK(pages->dtype == KVC_U8 && pages->ndim == 2 && pages->shape[1] == (int64_t)l.page,
              "%s: pages must be uint8 (num_pages, %zu)", fn, l.page);
    KVC_CHECK(pages->shape[0] == 0 || (pages->stride[0] % 2 == 0 &&
                                       ((uintptr_t)pages->data & 1) == 0),
              "%s: pages must be 2-byte aligned with an even page stride (float16 fields)", fn);
    KVC_CHECK(pages->shape[0] <= 1 || pages->stride[0] >= (int64_t)l.page,
              "%s: pages overlap (stride %lld < %zu bytes)", fn, (long long)pages->stride[0],
              l.page);
    KVC_CHECK(row_indptr[0] == 0, "%s: row_indptr[0] must be 0", fn);
    const int64_t nnz = row_indptr[n_seqs];
    for (int kv = 0; kv < 2; kv++) {
        const kvc_tensor *t = kv ? value : key;
        KVC_CHECK(t->ndim == 3 && t->shape[0] == nnz && t->shape[1] == H && t->shape[2] == Dh,
                  "%s: %s must be (%lld, %lld, %lld)", fn, kv ? "value" : "key", (long long)nnz,
                  (long long)H, (long long)Dh);
        KVC_CHECK(t->dtype == KVC_F32 || t->dtype == KVC_F16 || t->dtype == KVC_BF16,
                  "%s: %s must be float32, float16 or bfloat16 (got %s)", fn,
                  kv ? "value" : "key", kvc_dtype_name(t->dtype));
    }
    int64_t n_tasks = 0, n_rows = 0;
    for (int64_t b = 0; b < n_seqs; b++) {
        const kvc_kvfmt_seq *s = &seqs[b];
        const int64_t cnt = row_indptr[b + 1] - row_indptr[b];
        KVC_CHECK(cnt >= 0, "%s: row_indptr decreases at %lld", fn, (long long)b);
        KVC_CHECK(s->n_kv >= cnt, "%s: sequence %lld: %lld rows but n_kv %lld", fn,
                  (long long)b, (long long)cnt, (long long)s->n_kv);
        if (cnt == 0) continue;
        KVC_CHECK(s->tail != NULL && s->pages != NULL, "%s: sequence %lld: NULL pages or tail",
                  fn, (long long)b);
        KVC_CHECK(f->sink == 0 || s->sink != NULL, "%s: sequence %lld: NULL sink (the format "
                  "keeps %d sink rows)", fn, (long long)b, (int)f->sink);
        const int64_t np = (s->n_kv + P - 1) / P;
        for (int64_t p = 0; p < np; p++)
            KVC_CHECK(s->pages[p] >= 0 && s->pages[p] < pages->shape[0], "%s: sequence %lld: "
                      "page id %d outside [0, %lld)", fn, (long long)b, (int)s->pages[p],
                      (long long)pages->shape[0]);
    }
    count_work(f, seqs, n_seqs, row_indptr, &n_rows, &n_tasks);
    float sm = 0;
    size_t simd_bytes = 0;
    if (q) {
        KVC_TRY(kvc__kvfmt_attn_check(fn, f, pages, seqs, n_seqs, NULL, q, q_seq, q_pos, params,
                                      out, lse, &sm));
        /* per sequence: q_pos + 1 >= floor(pos0 / G) * G, the staging's reach */
        for (int64_t i = 0; i < q->shape[0]; i++) {
            const int64_t b = q_seq[i], cnt = row_indptr[b + 1] - row_indptr[b];
            const int64_t g0 = (seqs[b].n_kv - cnt) / G * G, lo = g0 > 0 ? g0 - 1 : 0;
            KVC_CHECK(q_pos[i] >= lo, "%s: q_pos[%lld] = %d below %lld: the float16 values it "
                      "reads are gone from the tail", fn, (long long)i, (int)q_pos[i],
                      (long long)lo);
        }
        simd_bytes = kvc__kvfmt_simd_bytes(f, q->shape[0], q->shape[1], q_seq, q_pos);
    }
    if (nnz == 0 && !q) return KVC_OK;
    const int64_t nq = q ? q->shape[0] : 0;

    const int64_t n_conv = (nnz + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    const size_t cb = kvc__kvfmt_idx_bytes(f, seqs, n_seqs, row_indptr, nq, q_seq, q_pos);
    const size_t own = scratch_bytes(f, nnz, n_seqs, n_rows, n_tasks);
    unsigned char *const block = kvc__scratch_get(pool, cb + own + simd_bytes);
    if (!block) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    /* From here on the inputs read while pages, tails, sinks, out and lse
     * are written are the copies (an output laid over one must not send
     * the reads out of bounds): the index arrays, the format and the
     * tensors' descriptions. */
    kvc__kvfmt_idx ix;
    kvc__kvfmt_idx_copy(f, seqs, n_seqs, row_indptr, nq, q_seq, q_pos, block, &ix);
    seqs = ix.seqs, row_indptr = ix.row_indptr, q_seq = ix.q_seq, q_pos = ix.q_pos;
    const kvc_kvfmt fc = *f;
    kvc_tensor pc = *pages, qc, oc, lc;
    f = &fc, pages = &pc;
    if (q) {
        qc = *q, oc = *out, q = &qc, out = &oc;
        if (lse) lc = *lse, lse = &lc;
    }
    unsigned char *const mem = block + cb;

    store_ctx c;
    memset(&c, 0, sizeof c);
    c.f = f, c.l = l, c.pages = pages, c.key = key, c.value = value, c.seqs = seqs;
    c.row_indptr = row_indptr, c.n_seqs = n_seqs, c.nnz = nnz, c.HD = HD;
    kvc__kvfmt_win *wins = (kvc__kvfmt_win *)mem; /* 8-byte members: first */
    c.w0 = (int64_t *)(wins + n_seqs);
    c.off = c.w0 + n_seqs;
    c.dst = c.off + n_seqs;
    c.task_seq = c.dst + nnz;
    c.task_grp = c.task_seq + n_tasks;
    c.st = (uint16_t *)(c.task_grp + n_tasks);
    c.bad = (unsigned char *)(c.st + n_rows * 2 * HD);
    int64_t k = 0, row = 0;
    for (int64_t b = 0; b < n_seqs; b++) {
        const kvc_kvfmt_seq *s = &seqs[b];
        const int64_t cnt = row_indptr[b + 1] - row_indptr[b], pos0 = s->n_kv - cnt;
        if (cnt == 0) {
            c.w0[b] = c.off[b] = 0;
            wins[b] = kvc__kvfmt_tail_win(f, s);
            continue;
        }
        c.w0[b] = stage_from(f, s->n_kv, cnt);
        c.off[b] = row;
        for (int64_t t = c.w0[b]; t < pos0; t++) { /* the old tail's rows */
            uint16_t *d = c.st + (row + t - c.w0[b]) * 2 * HD;
            memcpy(d, s->tail + (t % T) * HD, (size_t)HD * 2);
            memcpy(d + HD, s->tail + (T + t % T) * HD, (size_t)HD * 2);
        }
        for (int64_t r = row_indptr[b]; r < row_indptr[b + 1]; r++)
            c.dst[r] = row + pos0 - c.w0[b] + (r - row_indptr[b]);
        for (int64_t j = pos0 / G; j < s->n_kv / G; j++) c.task_seq[k] = b, c.task_grp[k] = j, k++;
        row += s->n_kv - c.w0[b];
        if (ring_direct(f, s->n_kv, cnt)) {
            wins[b] = kvc__kvfmt_tail_win(f, s); /* the rows are in the ring by then */
            continue;
        }
        wins[b].k = c.st + c.off[b] * 2 * HD;
        wins[b].v = wins[b].k + HD;
        wins[b].rs = 2 * HD;
        wins[b].w0 = c.w0[b];
        wins[b].mod = 0;
    }
    kvc_status st = KVC_OK;
    if (nnz > 0) {
        kvc__parallel_for(pool, n_conv, convert_task, &c);
        for (int64_t i = 0; i < n_conv && st == KVC_OK; i++)
            if (c.bad[i])
                st = kvc__error(KVC_ERR_INVALID_ARG, "%s: key or value holds a NaN, an infinity "
                                "or a value beyond float16's range (rows %lld..%lld); nothing "
                                "written", fn, (long long)(i * ROWS_PER_TASK),
                                (long long)((i + 1) * ROWS_PER_TASK - 1));
    }
    if (st != KVC_OK) {
        kvc__scratch_release(pool, block);
        return st;
    }
    /* quantize the complete groups, write the sink rows and the rows that go
     * straight into the ring, attend (reading them), then write the other
     * tails */
    if (n_tasks > 0) {
        c.hpt = heads_per_task(f, n_tasks, pool);
        c.nhc = (H + c.hpt - 1) / c.hpt;
        kvc__parallel_for(pool, n_tasks * c.nhc, group_task, &c);
    }
    for (int64_t b = 0; b < n_seqs; b++) {
        const kvc_kvfmt_seq *s = &seqs[b];
        const int64_t cnt = row_indptr[b + 1] - row_indptr[b], pos0 = s->n_kv - cnt;
        for (int64_t t = pos0; t < f->sink && t < s->n_kv; t++) {
            const uint16_t *r = c.st + (c.off[b] + t - c.w0[b]) * 2 * HD;
            memcpy(s->sink + t * HD, r, (size_t)HD * 2);
            memcpy(s->sink + (f->sink + t) * HD, r + HD, (size_t)HD * 2);
        }
        if (ring_direct(f, s->n_kv, cnt)) write_tail(&c, b, pos0);
    }
    if (q)
        kvc__kvfmt_attend(f, pages, seqs, wins, q, q_seq, q_pos, sm, out, lse, pool,
                          simd_bytes ? mem + own : NULL);
    for (int64_t b = 0; b < n_seqs; b++) {
        const kvc_kvfmt_seq *s = &seqs[b];
        const int64_t cnt = row_indptr[b + 1] - row_indptr[b];
        if (cnt > 0 && !ring_direct(f, s->n_kv, cnt))
            write_tail(&c, b, stage_w0(f, s->n_kv)); /* what the tail holds */
    }
    kvc__scratch_release(pool, block);
    return KVC_OK;
}

kvc_status kvc_kvfmt_append(const kvc_kvfmt *f, kvc_tensor *pages, const kvc_kvfmt_seq *seqs,
                            int64_t n_seqs, const int64_t *row_indptr, const kvc_tensor *key,
                            const kvc_tensor *value, kvc_threadpool *pool) {
    return append_attend("kvc_kvfmt_append", f, pages, seqs, n_seqs, row_indptr, key, value,
                         NULL, NULL, NULL, NULL, NULL, NULL, pool);
}

kvc_status kvc_kvfmt_append_attention(const kvc_kvfmt *f, kvc_tensor *pages,
                                      const kvc_kvfmt_seq *seqs, int64_t n_seqs,
                                      const int64_t *row_indptr, const kvc_tensor *key,
                                      const kvc_tensor *value, const kvc_tensor *q,
                                      const int32_t *q_seq, const int32_t *q_pos,
                                      const kvc_attn_params *params, kvc_tensor *out,
                                      kvc_tensor *lse, kvc_threadpool *pool) {
    static const char fn[] = "kvc_kvfmt_append_attention";
    KVC_CHECK(q != NULL, "%s: q is NULL", fn);
    return append_attend(fn, f, pages, seqs, n_seqs, row_indptr, key, value, q, q_seq, q_pos,
                         params, out, lse, pool);
}
