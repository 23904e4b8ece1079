/*
 * Multi-level cascade attention (prefill.h): one prefill plan per level over
 * the same paged cache, causal on the last level only. Level 0 writes its
 * float32 state (o, lse) into the plan's accumulator, every further level
 * into a second buffer that is folded in with merge_state (SEMANTICS
 * section 5) in level order; only then is the caller's out/lse written, so
 * a level that fails validation leaves them untouched. Attention sinks
 * (params->sinks) join once, on that last pass, not per level.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn_check.h"
#include "attn_state.h"
#include "prefill_internal.h"
#include "../paged/paged_internal.h"

#define CASCADE_MAX_LEVELS 64
#define MERGE_ROWS 16 /* rows per merge task */

struct kvc_cascade_plan {
    int32_t n;
    int64_t nnz, Hq, D;
    kvc_prefill_plan *lv[CASCADE_MAX_LEVELS];
    float *acc, *acc_lse; /* (nnz, Hq, D), (nnz, Hq) */
    float *tmp, *tmp_lse;
};

void kvc_cascade_plan_destroy(kvc_cascade_plan *plan) {
    if (!plan) return;
    for (int32_t l = 0; l < plan->n; l++) kvc_prefill_plan_destroy(plan->lv[l]);
    free(plan->acc);
    free(plan->acc_lse);
    free(plan->tmp);
    free(plan->tmp_lse);
    free(plan);
}

kvc_status kvc_cascade_plan_create(int32_t num_levels, const kvc_tensor *qo_indptr,
                                   const kvc_tensor *kv_indptr, const kvc_tensor *kv_indices,
                                   const kvc_tensor *kv_last_page_len, int32_t num_qo_heads,
                                   int32_t num_kv_heads, int32_t head_dim, int32_t page_size,
                                   int32_t causal, int32_t n_threads, kvc_cascade_plan **out) {
    static const char fn[] = "kvc_cascade_plan_create";
    KVC_CHECK(out != NULL, "%s: out is NULL", fn);
    *out = NULL; /* what a failure leaves */
    KVC_CHECK(causal == 0 || causal == 1, "%s: causal must be 0 or 1, got %d", fn, (int)causal);
    KVC_CHECK(num_levels >= 1 && num_levels <= CASCADE_MAX_LEVELS,
              "%s: num_levels %d outside [1, %d]", fn, (int)num_levels, CASCADE_MAX_LEVELS);
    KVC_CHECK(qo_indptr && kv_indptr && kv_indices && kv_last_page_len,
              "%s: the per-level tensor arrays must not be NULL", fn);
    KVC_TRY(kvc__attn_check_heads(fn, num_qo_heads, num_kv_heads, head_dim));
    /* every level must cover the same query rows */
    int64_t nnz = -1;
    for (int32_t l = 0; l < num_levels; l++) {
        KVC_TRY(kvc__paged_check_i32(fn, "qo_indptr", &qo_indptr[l], -1));
        KVC_CHECK(qo_indptr[l].shape[0] >= 1, "%s: qo_indptr[%d] is empty", fn, (int)l);
        const int64_t last = kvc__i32_1d(&qo_indptr[l], qo_indptr[l].shape[0] - 1);
        KVC_CHECK(nnz < 0 || last == nnz,
                  "%s: level %d covers %lld query rows, level 0 covers %lld (all levels must "
                  "end at the same total)", fn, (int)l, (long long)last, (long long)nnz);
        nnz = last;
    }
    kvc_cascade_plan *p = calloc(1, sizeof *p);
    if (!p) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    p->nnz = nnz;
    p->Hq = num_qo_heads;
    p->D = head_dim;
    for (int32_t l = 0; l < num_levels; l++) {
        kvc_status st = kvc_prefill_plan_create_paged(
            &qo_indptr[l], &kv_indptr[l], &kv_indices[l], &kv_last_page_len[l], num_qo_heads,
            num_kv_heads, head_dim, page_size, causal && l == num_levels - 1, NULL, NULL,
            n_threads, &p->lv[l]);
        if (st != KVC_OK) {
            kvc_cascade_plan_destroy(p);
            return st;
        }
        p->n = l + 1;
    }
    int64_t nv64;
    if (!kvc__mul3_le(nnz, num_qo_heads, head_dim, KVC__MAX_SCRATCH_FLOATS, &nv64)) {
        kvc_cascade_plan_destroy(p);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (%lld rows x %d heads x %d)", fn,
                          (long long)nnz, (int)num_qo_heads, (int)head_dim);
    }
    const size_t nv = (size_t)nv64 + 1, ns = (size_t)(nnz * num_qo_heads) + 1;
    p->acc = malloc(nv * sizeof(float));
    p->acc_lse = malloc(ns * sizeof(float));
    if (num_levels > 1) {
        p->tmp = malloc(nv * sizeof(float));
        p->tmp_lse = malloc(ns * sizeof(float));
    }
    if (!p->acc || !p->acc_lse || (num_levels > 1 && (!p->tmp || !p->tmp_lse))) {
        kvc_cascade_plan_destroy(p);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    }
    *out = p;
    return KVC_OK;
}

typedef struct merge_ctx {
    const kvc_cascade_plan *p;
    int last;                /* write the caller's out/lse */
    char *out;
    kvc_dtype od;
    int64_t o_sr, o_sh;
    float *lse;
    int64_t l_sr, l_sh;
    const float *sinks; /* (Hq) or NULL: folded in on the last pass */
} merge_ctx;

static void store_elem(char *p, kvc_dtype dt, int64_t i, float x) {
    switch (dt) {
    case KVC_F16: ((uint16_t *)(void *)p)[i] = kvc_f32_to_f16(x); break;
    case KVC_BF16: ((uint16_t *)(void *)p)[i] = kvc_f32_to_bf16(x); break;
    default: ((float *)(void *)p)[i] = x; break;
    }
}

/* acc <- merge_state(acc, tmp) for rows [t * MERGE_ROWS, ...) (when the plan
 * has a second level), then out/lse from acc on the last pass. */
static void merge_task(void *vctx, int64_t t) {
    const merge_ctx *c = vctx;
    const kvc_cascade_plan *p = c->p;
    const int64_t D = p->D, r1 = (t + 1) * MERGE_ROWS < p->nnz ? (t + 1) * MERGE_ROWS : p->nnz;
    for (int64_t r = t * MERGE_ROWS; r < r1; r++)
        for (int64_t h = 0; h < p->Hq; h++) {
            float *va = p->acc + (r * p->Hq + h) * D, *sa = p->acc_lse + r * p->Hq + h;
            if (p->tmp) {
                const float *vb = p->tmp + (r * p->Hq + h) * D, sb = p->tmp_lse[r * p->Hq + h];
                const float m = *sa > sb ? *sa : sb;
                if (m == -INFINITY) {
                    for (int64_t d = 0; d < D; d++) va[d] = 0.0f;
                } else {
                    const float wa = exp2f(*sa - m), wb = exp2f(sb - m), inv = 1.0f / (wa + wb);
                    for (int64_t d = 0; d < D; d++) va[d] = (wa * va[d] + wb * vb[d]) * inv;
                    *sa = m + log2f(wa + wb);
                }
            }
            if (!c->last) continue;
            float f = 1.0f, s = *sa;
            if (c->sinks) /* the merged state as (m, l) = (lse, 1), or empty */
                f = kvc__attn_finish(s, s > -INFINITY ? 1.0f : 0.0f,
                                     kvc__attn_sink2(c->sinks, h), &s);
            char *o = c->out + kvc__bytes(c->od, r * c->o_sr + h * c->o_sh);
            for (int64_t d = 0; d < D; d++) store_elem(o, c->od, d, va[d] * f);
            if (c->lse) c->lse[r * c->l_sr + h * c->l_sh] = s;
        }
}

kvc_status kvc_cascade_run(kvc_cascade_plan *plan, const kvc_tensor *q,
                           const kvc_paged_cache *cache, const kvc_attn_params *params,
                           kvc_tensor *out, kvc_tensor *lse, kvc_threadpool *pool) {
    static const char fn[] = "kvc_cascade_run";
    KVC_CHECK(plan != NULL, "%s: plan is NULL", fn);
    KVC_CHECK(q != NULL && out != NULL, "%s: q and out must not be NULL", fn);
    KVC_TRY(kvc__pf_check_io(fn, q, out, lse, plan->nnz, plan->Hq, plan->D));
    int64_t lsh[2] = {plan->nnz, plan->Hq}, osh[3] = {plan->nnz, plan->Hq, plan->D};
    kvc_tensor ta = kvc_tensor_make(plan->acc, KVC_F32, 3, osh),
               tal = kvc_tensor_make(plan->acc_lse, KVC_F32, 2, lsh);
    kvc_tensor tb = kvc_tensor_make(plan->tmp, KVC_F32, 3, osh),
               tbl = kvc_tensor_make(plan->tmp_lse, KVC_F32, 2, lsh);
    /* the levels run without sinks: a sink joins the softmax once, at the end */
    kvc_attn_params lp;
    KVC_TRY(kvc__attn_check_params(fn, params, plan->Hq, plan->D, &lp));
    merge_ctx c;
    memset(&c, 0, sizeof c);
    c.p = plan;
    c.sinks = lp.sinks;
    lp.sinks = NULL;
    params = &lp;
    const int64_t n_tasks = (plan->nnz + MERGE_ROWS - 1) / MERGE_ROWS;
    /* Level runs validate the cache and params before writing their own
     * buffers; the caller's out/lse are written by the last merge only. */
    KVC_TRY(kvc_prefill_run_paged(plan->lv[0], q, cache, params, &ta, &tal, pool));
    for (int32_t l = 1; l < plan->n; l++) {
        KVC_TRY(kvc_prefill_run_paged(plan->lv[l], q, cache, params, &tb, &tbl, pool));
        c.last = l == plan->n - 1;
        if (c.last) {
            c.out = out->data, c.od = out->dtype, c.o_sr = out->stride[0], c.o_sh = out->stride[1];
            c.lse = lse ? lse->data : NULL;
            c.l_sr = lse ? lse->stride[0] : 0, c.l_sh = lse ? lse->stride[1] : 0;
        }
        if (n_tasks > 0) kvc__parallel_for(pool, n_tasks, merge_task, &c);
    }
    if (plan->n == 1) {
        kvc_cascade_plan tmp = *plan; /* no second state: just write out */
        tmp.tmp = NULL;
        c.p = &tmp;
        c.last = 1;
        c.out = out->data, c.od = out->dtype, c.o_sr = out->stride[0], c.o_sh = out->stride[1];
        c.lse = lse ? lse->data : NULL;
        c.l_sr = lse ? lse->stride[0] : 0, c.l_sh = lse ? lse->stride[1] : 0;
        if (n_tasks > 0) kvc__parallel_for(pool, n_tasks, merge_task, &c);
    }
    return KVC_OK;
}
