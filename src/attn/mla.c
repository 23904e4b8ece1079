/*
 * MLA decode over paged ckv/kpe caches (include/kvcache/mla.h).
 *
 * The plan copies the page table and splits every request into chunks of
 * `chunk` keys; a task is (request, chunk) with all of the request's query
 * rows (qo_len x Hq), so each ckv/kpe row is read from memory once per task
 * for every head. Each task owns a slot of plan memory: its query rows in
 * float32 (pre-scaled), their accumulators and softmax state. A request with
 * one chunk writes its output from its task; longer ones are merged by
 * log-sum-exp in chunk order in a second pass (one unit per query row).
 *
 * The chunk length depends only on the batch composition (total keys and
 * rows), never on the thread count, so results are bitwise identical for any
 * pool: at least 256 keys, and long enough that the batch makes about
 * MLA_TARGET_TASKS tasks and the slots fit MLA_SLOT_BUDGET floats.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "attn_check.h"
#include "../kernels/kernels.h"
#include "../kernels/mla.h"
#include "../paged/paged_internal.h"
#include "kvcache/mla.h"

#define MLA_MIN_CHUNK 256
#define MLA_TARGET_TASKS 64                         /* enough for 64 threads */
#define MLA_SLOT_BUDGET ((int64_t)32 * 1024 * 1024) /* floats (128 MiB) */

struct kvc_mla_plan {
    int64_t B, Hq, Dc, Dk, page_size, N;
    int causal;
    float sm_scale, cap;
    int64_t max_page; /* largest page id used, -1 if none */
    int64_t chunk, n_tasks;
    int32_t *qo_indptr, *kv_indptr, *kv_indices;
    int64_t *len;   /* (B) keys */
    int64_t *nch;   /* (B) chunks (0 for qo_len 0) */
    int64_t *task0; /* (B+1) first task of request b */
    int64_t *slot0; /* (B) float offset of request b's first slot */
    float *slots;
};

/* Rows of request b padded to the kernel's row block. */
static int64_t padded_rows(const kvc_mla_plan *p, int64_t b) {
    const int64_t rows = (int64_t)(p->qo_indptr[b + 1] - p->qo_indptr[b]) * p->Hq;
    return (rows + KVC_MLA_RB - 1) / KVC_MLA_RB * KVC_MLA_RB;
}

/* Floats per slot of request b: q (rows, Dc + Dk), acc (rows, Dc), m, l;
 * rounded to 16 so slots stay 64-byte aligned. -1: beyond any memory. */
static int64_t slot_floats(const kvc_mla_plan *p, int64_t b) {
    int64_t f;
    if (!kvc__mul3_le(padded_rows(p, b), 2 * p->Dc + p->Dk + 2, 1, KVC__MAX_SCRATCH_FLOATS, &f))
        return -1;
    return (f + 15) / 16 * 16;
}

/* Chunks and slot floats of the whole batch for a chunk length (-1: beyond
 * any memory). */
static int64_t layout_for(kvc_mla_plan *p, int64_t chunk) {
    int64_t floats = 0, tasks = 0;
    p->task0[0] = 0;
    for (int64_t b = 0; b < p->B; b++) {
        const int64_t qo = p->qo_indptr[b + 1] - p->qo_indptr[b];
        p->nch[b] = qo == 0 ? 0 : p->len[b] <= chunk ? 1 : (p->len[b] + chunk - 1) / chunk;
        p->slot0[b] = floats;
        const int64_t sf = slot_floats(p, b);
        int64_t f;
        if (sf < 0 || !kvc__mul3_le(p->nch[b], sf, 1, KVC__MAX_SCRATCH_FLOATS - floats, &f))
            return -1;
        floats += f;
        tasks += p->nch[b];
        p->task0[b + 1] = tasks;
    }
    p->n_tasks = tasks;
    return floats;
}

/* ---- run ------------------------------------------------------------------
 */

typedef struct mla_ctx {
    const kvc_mla_plan *p;
    const kvc_kernels *kern;
    kvc_mla_kernel kernel;
    const char *qn, *qp;
    kvc_dtype qnd, qpd;
    int64_t qn_s0, qn_s1, qp_s0, qp_s1;
    const kvc_tensor *ckv, *kpe;
    char *out;
    kvc_dtype od;
    int64_t o_s0, o_s1;
    float *lse;
    int64_t l_s0, l_s1;
    float qscale, sc; /* q multiplier; scores to base 2 (mla.h) */
} mla_ctx;

static kvc_mla_kernel kernel_for(kvc_isa isa) {
#if defined(__x86_64__) || defined(__i386__)
    if (isa >= KVC_ISA_AVX512) return kvc__mla_task_avx512; /* amx included */
    if (isa == KVC_ISA_AVX2) return kvc__mla_task_avx2;
#endif
    (void)isa;
    return kvc__mla_task_scalar;
}

/* Last b with task0[b] <= t (requests without tasks are skipped over). */
static int64_t task_request(const kvc_mla_plan *p, int64_t t) {
    int64_t lo = 0, hi = p->B - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (p->task0[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Writes out/lse of head h of global query row n from a state. */
static void finish_row(const mla_ctx *c, int64_t n, int64_t h, float m, float l, const float *acc) {
    const int64_t Dc = c->p->Dc;
    float o[KVC_MLA_MAX_CKV];
    const int empty = !(l > 0.0f);
    const float inv = empty ? 0.0f : 1.0f / l;
    for (int64_t d = 0; d < Dc; d++) o[d] = empty ? 0.0f : acc[d] * inv;
    c->kern->convert(o, KVC_F32, c->out + kvc__bytes(c->od, n * c->o_s0 + h * c->o_s1), c->od, Dc);
    if (c->lse) c->lse[n * c->l_s0 + h * c->l_s1] = empty ? -INFINITY : m + log2f(l);
}

static void chunk_task(void *vctx, int64_t t) {
    const mla_ctx *c = vctx;
    const kvc_mla_plan *p = c->p;
    const int64_t b = task_request(p, t), ch = t - p->task0[b];
    const int64_t Dc = p->Dc, Dk = p->Dk, Dq = Dc + Dk, Hq = p->Hq;
    const int64_t qo0 = p->qo_indptr[b], qo = p->qo_indptr[b + 1] - qo0;
    const int64_t rows = padded_rows(p, b), real = qo * Hq;
    float *q = p->slots + p->slot0[b] + ch * slot_floats(p, b);
    float *acc = q + rows * Dq, *m = acc + rows * Dc, *l = m + rows;
    /* query rows -> float32, times sm_scale under a cap (else the kernel
     * scales the scores: sc, mla.h) */
    for (int64_t r = 0; r < real; r++) {
        const int64_t n = qo0 + r / Hq, h = r % Hq;
        float *qr = q + r * Dq;
        c->kern->convert(c->qn + kvc__bytes(c->qnd, n * c->qn_s0 + h * c->qn_s1), c->qnd, qr,
                         KVC_F32, Dc);
        if (Dk > 0)
            c->kern->convert(c->qp + kvc__bytes(c->qpd, n * c->qp_s0 + h * c->qp_s1), c->qpd,
                             qr + Dc, KVC_F32, Dk);
        if (c->qscale != 1.0f)
            for (int64_t d = 0; d < Dq; d++) qr[d] *= c->qscale;
    }
    memset(q + real * Dq, 0, sizeof(float) * (size_t)((rows - real) * Dq));
    memset(acc, 0, sizeof(float) * (size_t)(rows * Dc));
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    kvc_mla_task k;
    memset(&k, 0, sizeof k);
    k.ckv = c->ckv->data;
    k.ckv_dt = c->ckv->dtype;
    k.ckv_page_st = c->ckv->stride[0];
    k.ckv_tok_st = c->ckv->stride[1];
    if (Dk > 0) {
        k.kpe = c->kpe->data;
        k.kpe_dt = c->kpe->dtype;
        k.kpe_page_st = c->kpe->stride[0];
        k.kpe_tok_st = c->kpe->stride[1];
    } else {
        k.kpe_dt = KVC_F32;
    }
    k.pages = p->kv_indices + p->kv_indptr[b];
    k.page_size = p->page_size;
    k.kv_len = p->len[b];
    k.j0 = ch * p->chunk;
    k.j1 = k.j0 + p->chunk < k.kv_len ? k.j0 + p->chunk : k.kv_len;
    k.qo_len = qo;
    k.Hq = Hq;
    k.causal = p->causal;
    k.Dc = (int)Dc;
    k.Dk = (int)Dk;
    k.rows = rows;
    k.real_rows = real;
    k.q = q;
    k.cap = p->cap;
    k.sc = c->sc;
    k.m = m;
    k.l = l;
    k.acc = acc;
    k.convert = c->kern->convert;
    if (k.j1 > k.j0) c->kernel(&k);
    if (p->nch[b] == 1)
        for (int64_t r = 0; r < real; r++)
            finish_row(c, qo0 + r / Hq, r % Hq, m[r], l[r], acc + r * Dc);
}

/* Merges the chunk states of global query row n (all heads), in chunk
 * order; rows of single-chunk requests were finished by their task. */
static void merge_task(void *vctx, int64_t n) {
    const mla_ctx *c = vctx;
    const kvc_mla_plan *p = c->p;
    int64_t lo = 0, hi = p->B - 1; /* request b: qo_indptr[b] <= n < qo_indptr[b + 1] */
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (p->qo_indptr[mid] <= n)
            lo = mid;
        else
            hi = mid - 1;
    }
    const int64_t b = lo, nch = p->nch[b];
    if (nch <= 1) return;
    const int64_t Dc = p->Dc, Dq = Dc + p->Dk, rows = padded_rows(p, b), sf = slot_floats(p, b);
    const float *base = p->slots + p->slot0[b];
    float acc[KVC_MLA_MAX_CKV];
    for (int64_t h = 0; h < p->Hq; h++) {
        const int64_t r = (n - p->qo_indptr[b]) * p->Hq + h;
        /* chunk ch's state of row r: acc at base + ch*sf + rows*Dq + r*Dc, m, l
         * after */
#define ST_ACC(ch) (base + (ch)*sf + rows * Dq + r * Dc)
#define ST_M(ch) (base[(ch)*sf + rows * Dq + rows * Dc + r])
#define ST_L(ch) (base[(ch)*sf + rows * Dq + rows * Dc + rows + r])
        float M = -INFINITY;
        for (int64_t ch = 0; ch < nch; ch++)
            if (ST_L(ch) > 0.0f && ST_M(ch) > M) M = ST_M(ch);
        float L = 0.0f;
        for (int64_t d = 0; d < Dc; d++) acc[d] = 0.0f;
        if (M != -INFINITY)
            for (int64_t ch = 0; ch < nch; ch++) {
                if (!(ST_L(ch) > 0.0f)) continue;
                const float w = exp2f(ST_M(ch) - M);
                const float *a = ST_ACC(ch);
                L += w * ST_L(ch);
                for (int64_t d = 0; d < Dc; d++) acc[d] += w * a[d];
            }
#undef ST_ACC
#undef ST_M
#undef ST_L
        finish_row(c, n, h, M, L, acc);
    }
}

/* ---- validation ------------------------------------------------------------
 */


/* t: a float tensor of exactly `shape` (ndim entries). */
static kvc_status check_float(const char *fn, const char *name, const kvc_tensor *t, int ndim,
                              const int64_t *shape) {
    char got[128], want[128];
    KVC_CHECK(t != NULL, "%s: %s is NULL", fn, name);
    KVC_TRY(kvc__check_tensor(t, name, 1));
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = shape[i] < 0 || t->shape[i] == shape[i];
    if (!ok) {
        int len = 0;
        want[0] = '\0';
        for (int i = 0; i < ndim; i++) {
            if (shape[i] < 0)
                len += snprintf(want + len, sizeof want - (size_t)len, "%s*", i ? ", " : "");
            else
                len += snprintf(want + len, sizeof want - (size_t)len, "%s%lld", i ? ", " : "",
                                (long long)shape[i]);
        }
        return kvc__error(KVC_ERR_INVALID_ARG, "%s: %s has shape %s, expected (%s)", fn, name,
                          kvc__shape_str(t, got, sizeof got), want);
    }
    KVC_CHECK(kvc__attn_is_float(t->dtype), "%s: %s must be float32, float16 or bfloat16, not %s", fn, name,
              kvc_dtype_name(t->dtype));
    return KVC_OK;
}

/* ---- public API -------------------------------------------------------------
 */

void kvc_mla_plan_destroy(kvc_mla_plan *plan) {
    if (!plan) return;
    free(plan->qo_indptr);
    free(plan->kv_indptr);
    free(plan->kv_indices);
    free(plan->len);
    free(plan->nch);
    free(plan->task0);
    free(plan->slot0);
    free(plan->slots);
    free(plan);
}

int64_t kvc_mla_plan_chunk(const kvc_mla_plan *plan) { return plan ? plan->chunk : 0; }
int64_t kvc_mla_plan_tasks(const kvc_mla_plan *plan) { return plan ? plan->n_tasks : 0; }

static kvc_status check_plan_args(const char *fn, int32_t num_heads, int32_t Dc, int32_t Dk,
                                  int32_t page_size, int32_t causal, float sm_scale, float cap) {
    KVC_CHECK(num_heads >= 1, "%s: num_heads %d must be >= 1", fn, (int)num_heads);
    KVC_CHECK(page_size >= 1, "%s: page_size %d must be >= 1", fn, (int)page_size);
    KVC_CHECK(Dc >= 1 && Dk >= 0, "%s: head_dim_ckv %d must be >= 1 and head_dim_kpe %d >= 0", fn,
              (int)Dc, (int)Dk);
    KVC_CHECK(causal == 0 || causal == 1, "%s: causal must be 0 or 1, got %d", fn, (int)causal);
    KVC_CHECK(isfinite(sm_scale) && sm_scale != 0.0f,
              "%s: sm_scale must be finite and nonzero (MLA has no default: pass e.g. "
              "1/sqrt(qk_nope_head_dim + qk_rope_head_dim)), got %g",
              fn, (double)sm_scale);
    KVC_CHECK(isfinite(cap) && cap >= 0.0f,
              "%s: logits_soft_cap must be finite and >= 0 (0 disables it), got %g", fn,
              (double)cap);
    if (Dc % 16 != 0 || Dc > KVC_MLA_MAX_CKV || Dk % 16 != 0 || Dk > KVC_MLA_MAX_KPE)
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "%s: head_dim_ckv %d / head_dim_kpe %d not supported: they must be "
                          "multiples of 16, at most %d / %d",
                          fn, (int)Dc, (int)Dk, KVC_MLA_MAX_CKV, KVC_MLA_MAX_KPE);
    return KVC_OK;
}

kvc_status kvc_mla_plan_create(const kvc_tensor *qo_indptr, const kvc_tensor *kv_indptr,
                               const kvc_tensor *kv_indices, const kvc_tensor *kv_len_arr,
                               int32_t num_heads, int32_t head_dim_ckv, int32_t head_dim_kpe,
                               int32_t page_size, int32_t causal, float sm_scale,
                               float logits_soft_cap, kvc_mla_plan **out) {
    static const char fn[] = "kvc_mla_plan_create";
    KVC_CHECK(out != NULL, "%s: out is NULL", fn);
    *out = NULL; /* what a failure leaves */
    KVC_TRY(kvc_isa_env_check());
    KVC_TRY(check_plan_args(fn, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
                            logits_soft_cap));
    KVC_TRY(kvc__paged_check_i32(fn, "kv_len_arr", kv_len_arr, -1));
    const int64_t B = kv_len_arr->shape[0];
    KVC_TRY(kvc__paged_check_indptr(fn, "qo_indptr", qo_indptr, B));
    KVC_TRY(kvc__paged_check_indptr(fn, "kv_indptr", kv_indptr, B));
    const int64_t n_idx = kvc__i32_1d(kv_indptr, B);
    KVC_TRY(kvc__paged_check_i32(fn, "kv_indices", kv_indices, -1));
    KVC_CHECK(kv_indices->shape[0] >= n_idx,
              "%s: kv_indices has %lld entries but kv_indptr[%lld] = %lld", fn,
              (long long)kv_indices->shape[0], (long long)B, (long long)n_idx);
    for (int64_t i = 0; i < n_idx; i++)
        KVC_CHECK(kvc__i32_1d(kv_indices, i) >= 0, "%s: kv_indices[%lld] = %d is negative", fn,
                  (long long)i, (int)kvc__i32_1d(kv_indices, i));
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = kvc__i32_1d(kv_len_arr, b);
        const int64_t pages = (int64_t)kvc__i32_1d(kv_indptr, b + 1) - kvc__i32_1d(kv_indptr, b);
        KVC_CHECK(len >= 0, "%s: kv_len_arr[%lld] = %lld is negative", fn, (long long)b,
                  (long long)len);
        KVC_CHECK(pages == (len + page_size - 1) / page_size,
                  "%s: request %lld has kv_len %lld, which needs %lld pages of %d, but "
                  "kv_indptr gives it %lld",
                  fn, (long long)b, (long long)len, (long long)((len + page_size - 1) / page_size),
                  (int)page_size, (long long)pages);
    }

    kvc_mla_plan *p = calloc(1, sizeof *p);
    if (!p) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    p->B = B;
    p->Hq = num_heads;
    p->Dc = head_dim_ckv;
    p->Dk = head_dim_kpe;
    p->page_size = page_size;
    p->causal = causal;
    p->sm_scale = sm_scale;
    p->cap = logits_soft_cap;
    const size_t nb = (size_t)(B > 0 ? B : 1);
    p->qo_indptr = malloc((size_t)(B + 1) * sizeof(int32_t));
    p->kv_indptr = malloc((size_t)(B + 1) * sizeof(int32_t));
    p->kv_indices = malloc((size_t)(n_idx > 0 ? n_idx : 1) * sizeof(int32_t));
    p->len = malloc(nb * sizeof(int64_t));
    p->nch = malloc(nb * sizeof(int64_t));
    p->slot0 = malloc(nb * sizeof(int64_t));
    p->task0 = malloc((size_t)(B + 1) * sizeof(int64_t));
    if (!p->qo_indptr || !p->kv_indptr || !p->kv_indices || !p->len || !p->nch || !p->slot0 ||
        !p->task0) {
        kvc_mla_plan_destroy(p);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    }
    for (int64_t b = 0; b <= B; b++) {
        p->qo_indptr[b] = kvc__i32_1d(qo_indptr, b);
        p->kv_indptr[b] = kvc__i32_1d(kv_indptr, b);
    }
    p->N = p->qo_indptr[B];
    p->max_page = -1;
    for (int64_t i = 0; i < n_idx; i++) {
        p->kv_indices[i] = kvc__i32_1d(kv_indices, i);
        if (p->kv_indices[i] > p->max_page) p->max_page = p->kv_indices[i];
    }
    int64_t total = 0, longest = 0;
    for (int64_t b = 0; b < B; b++) {
        p->len[b] = kvc__i32_1d(kv_len_arr, b);
        if (p->qo_indptr[b + 1] > p->qo_indptr[b]) {
            total += p->len[b];
            if (p->len[b] > longest) longest = p->len[b];
        }
    }
    /* Chunk: >= 256 keys, about MLA_TARGET_TASKS tasks for the batch, slots
     * within the budget (doubling stops once every request is one chunk). */
    int64_t chunk = (total + MLA_TARGET_TASKS - 1) / MLA_TARGET_TASKS;
    chunk = (chunk + MLA_MIN_CHUNK - 1) / MLA_MIN_CHUNK * MLA_MIN_CHUNK;
    if (chunk < MLA_MIN_CHUNK) chunk = MLA_MIN_CHUNK;
    int64_t floats = layout_for(p, chunk);
    while ((floats < 0 || floats > MLA_SLOT_BUDGET) && chunk < longest)
        floats = layout_for(p, chunk *= 2);
    p->chunk = chunk;
    if (floats < 0) {
        kvc_mla_plan_destroy(p);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (task state beyond any memory)", fn);
    }
    if (floats > 0) {
        p->slots = aligned_alloc(64, (size_t)floats * sizeof(float));
        if (!p->slots) {
            kvc_mla_plan_destroy(p);
            return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (%lld floats of task state)", fn,
                              (long long)floats);
        }
    }
    *out = p;
    return KVC_OK;
}

kvc_status kvc_mla_run(kvc_mla_plan *plan, const kvc_tensor *q_nope, const kvc_tensor *q_pe,
                       const kvc_tensor *ckv_cache, const kvc_tensor *kpe_cache, kvc_tensor *out,
                       kvc_tensor *lse, kvc_threadpool *pool) {
    static const char fn[] = "kvc_mla_run";
    KVC_CHECK(plan != NULL, "%s: plan is NULL", fn);
    const kvc_mla_plan *p = plan;
    const int64_t qn_shape[3] = {p->N, p->Hq, p->Dc}, qp_shape[3] = {p->N, p->Hq, p->Dk};
    const int64_t ckv_shape[3] = {-1, p->page_size, p->Dc},
                  kpe_shape[3] = {-1, p->page_size, p->Dk};
    const int with_pe = p->Dk > 0 || q_pe != NULL || kpe_cache != NULL;
    KVC_TRY(check_float(fn, "q_nope", q_nope, 3, qn_shape));
    if (with_pe) KVC_TRY(check_float(fn, "q_pe", q_pe, 3, qp_shape));
    KVC_TRY(check_float(fn, "ckv_cache", ckv_cache, 3, ckv_shape));
    if (with_pe) KVC_TRY(check_float(fn, "kpe_cache", kpe_cache, 3, kpe_shape));
    KVC_TRY(check_float(fn, "out", out, 3, qn_shape));
    KVC_TRY(kvc__check_writable(out, "out"));
    if (lse) {
        char got[128];
        KVC_TRY(kvc__check_tensor(lse, "lse", 1));
        KVC_TRY(kvc__check_writable(lse, "lse"));
        KVC_CHECK(lse->ndim == 2 && lse->shape[0] == p->N && lse->shape[1] == p->Hq,
                  "%s: lse has shape %s, expected (%lld, %lld)", fn,
                  kvc__shape_str(lse, got, sizeof got), (long long)p->N, (long long)p->Hq);
        KVC_CHECK(lse->dtype == KVC_F32, "%s: lse must be float32, not %s", fn,
                  kvc_dtype_name(lse->dtype));
    }
    KVC_CHECK(p->max_page < ckv_cache->shape[0], "%s: page id %lld outside ckv_cache's %lld pages",
              fn, (long long)p->max_page, (long long)ckv_cache->shape[0]);
    if (with_pe)
        KVC_CHECK(p->max_page < kpe_cache->shape[0],
                  "%s: page id %lld outside kpe_cache's %lld pages", fn, (long long)p->max_page,
                  (long long)kpe_cache->shape[0]);
    if (p->n_tasks == 0) return KVC_OK;

    mla_ctx c;
    memset(&c, 0, sizeof c);
    c.p = p;
    c.kern = kvc__kernels();
    c.kernel = kernel_for(c.kern->isa);
    c.qn = q_nope->data;
    c.qnd = q_nope->dtype;
    c.qn_s0 = q_nope->stride[0];
    c.qn_s1 = q_nope->stride[1];
    if (p->Dk > 0) {
        c.qp = q_pe->data;
        c.qpd = q_pe->dtype;
        c.qp_s0 = q_pe->stride[0];
        c.qp_s1 = q_pe->stride[1];
    }
    c.ckv = ckv_cache;
    c.kpe = p->Dk > 0 ? kpe_cache : NULL;
    c.out = out->data;
    c.od = out->dtype;
    c.o_s0 = out->stride[0];
    c.o_s1 = out->stride[1];
    c.lse = lse ? lse->data : NULL;
    c.l_s0 = lse ? lse->stride[0] : 0;
    c.l_s1 = lse ? lse->stride[1] : 0;
    kvc__attn_score_scale(p->sm_scale, p->cap, 0, &c.qscale, &c.sc);
    kvc__parallel_for(pool, p->n_tasks, chunk_task, &c);
    int multi = 0;
    for (int64_t b = 0; b < p->B && !multi; b++) multi = p->nch[b] > 1;
    if (multi) kvc__parallel_for(pool, p->N, merge_task, &c);
    return KVC_OK;
}
