/*
 * `kvcache bench prefill`: kvc_prefill_run_paged (one request, one layer)
 * over a paged NHD cache (page_size 16, pages shuffled), shapes
 * Hq=32/H=8/Dh=128 and Hq=9/H=3/Dh=64, qo = kv in {512, 2048}, causal and
 * not, float16 and int8 caches (quant group 32, float16 scales), float16
 * q and out.
 *
 * FLOPs are counted as 4 * Dh per visible (query head, key) pair (QK^T and
 * PV, one multiply-add = 2 FLOPs; softmax and conversions not counted). The
 * bound is an FMA peak measured in the same run, interleaved with the
 * operator, with the same ISA as the library's kernels and as many
 * threads: independent FMA chains on registers, no memory traffic.
 * Goal (issue "Attention over the cache"): >= 0.4 of that peak at Dh=128.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"

#define PF_PAGE 16
#define PF_GROUP 32
#define PF_GOAL 0.4

/* ---- cases ------------------------------------------------------------------------ */

typedef struct pf_shape {
    int64_t Hq, H, D;
} pf_shape;

typedef struct pf_case {
    pf_shape s;
    int64_t B, L;
    int causal;
    kvc_dtype dt;
    const char *name;
    unsigned char *k, *v, *ks, *vs;
    uint16_t *q, *out;
    int32_t *qo_indptr, *indptr, *indices, *last;
    kvc_paged_cache pc;
    kvc_tensor tq, tout, tqo, tindptr, tindices, tlast;
    kvc_prefill_plan *plan;
    kvc_threadpool *pool;
    double flops;
} pf_case;

static int pf_call(void *ctx) {
    pf_case *c = ctx;
    kvc_attn_params p = kvc_attn_default_params();
    return kvc_prefill_run_paged(c->plan, &c->tq, &c->pc, &p, &c->tout, NULL, c->pool) != KVC_OK;
}

static void free_case(pf_case *c) {
    bench_free(c->k);
    bench_free(c->v);
    bench_free(c->ks);
    bench_free(c->vs);
    bench_free(c->q);
    bench_free(c->out);
    free(c->qo_indptr);
    free(c->indptr);
    free(c->indices);
    free(c->last);
    kvc_prefill_plan_destroy(c->plan);
    memset(c, 0, sizeof *c);
}

/* f16 bits of a value in +-[0.25, 4) from r. */
static uint16_t f16_bits(uint64_t r) {
    return (uint16_t)((r & 0x8000u) | ((13u + ((r >> 10) & 3u)) << 10) | (r & 0x3ffu));
}

static int setup(pf_case *c, pf_shape s, int64_t B, int64_t L, int causal, kvc_dtype dt,
                 const char *name) {
    memset(c, 0, sizeof *c);
    c->s = s, c->B = B, c->L = L, c->causal = causal, c->dt = dt, c->name = name;
    const int quant = dt != KVC_F16;
    const int64_t pages = (L + PF_PAGE - 1) / PF_PAGE, P = B * pages, slots = P * PF_PAGE;
    const size_t kvb = (size_t)(slots * s.H * s.D * kvc_dtype_bits(dt) / 8);
    const size_t sb = quant ? (size_t)(slots * s.H * (s.D / PF_GROUP)) * 2 : 0;
    const int64_t nq = B * L * s.Hq * s.D;
    c->k = bench_alloc(kvb);
    c->v = bench_alloc(kvb);
    if (quant) c->ks = bench_alloc(sb), c->vs = bench_alloc(sb);
    c->q = bench_alloc((size_t)nq * 2);
    c->out = bench_alloc((size_t)nq * 2);
    c->qo_indptr = calloc((size_t)B + 1, 4);
    c->indptr = calloc((size_t)B + 1, 4);
    c->indices = calloc((size_t)P, 4);
    c->last = calloc((size_t)B, 4);
    if (!c->k || !c->v || (quant && (!c->ks || !c->vs)) || !c->q || !c->out || !c->qo_indptr ||
        !c->indptr || !c->indices || !c->last) {
        fprintf(stderr, "kvcache: bench prefill: out of memory\n");
        free_case(c);
        return -1;
    }
    if (quant) {
        for (size_t i = 0; i < kvb; i++) {
            const uint64_t r = bench_mix64(i);
            c->k[i] = (unsigned char)r;
            c->v[i] = (unsigned char)(r >> 8);
        }
        const uint16_t one64 = kvc_f32_to_f16(1.0f / 64.0f);
        for (size_t i = 0; i < sb / 2; i++)
            ((uint16_t *)(void *)c->ks)[i] = ((uint16_t *)(void *)c->vs)[i] = one64;
    } else {
        for (size_t i = 0; i < kvb / 2; i++) {
            const uint64_t r = bench_mix64(i);
            ((uint16_t *)(void *)c->k)[i] = f16_bits(r);
            ((uint16_t *)(void *)c->v)[i] = f16_bits(r >> 16);
        }
    }
    for (int64_t i = 0; i < nq; i++)
        c->q[i] = kvc_f32_to_f16((float)((double)(bench_mix64((uint64_t)i + 99) >> 11) * 0x1p-53 - 0.5) * 0.25f);
    for (int64_t i = 0; i < P; i++) c->indices[i] = (int32_t)i;
    uint64_t r = 12345;
    for (int64_t i = P - 1; i > 0; i--) {
        r = bench_mix64(r);
        const int64_t j = (int64_t)(r % (uint64_t)(i + 1));
        const int32_t t = c->indices[i];
        c->indices[i] = c->indices[j], c->indices[j] = t;
    }
    for (int64_t b = 0; b < B; b++) {
        c->qo_indptr[b + 1] = (int32_t)((b + 1) * L);
        c->indptr[b + 1] = (int32_t)((b + 1) * pages);
        c->last[b] = (int32_t)(L - (pages - 1) * PF_PAGE);
    }
    int64_t csh[4] = {P, PF_PAGE, s.H, s.D}, ssh[4] = {P, PF_PAGE, s.H, s.D / PF_GROUP};
    c->pc.k = kvc_tensor_make(c->k, dt, 4, csh);
    c->pc.v = kvc_tensor_make(c->v, dt, 4, csh);
    if (quant) {
        c->pc.k_scale = kvc_tensor_make(c->ks, KVC_F16, 4, ssh);
        c->pc.v_scale = kvc_tensor_make(c->vs, KVC_F16, 4, ssh);
    }
    c->pc.layout = KVC_NHD;
    c->pc.quant_group = PF_GROUP;
    int64_t qsh[3] = {B * L, s.Hq, s.D}, nb = B, nb1 = B + 1, np = P;
    c->tq = kvc_tensor_make(c->q, KVC_F16, 3, qsh);
    c->tout = kvc_tensor_make(c->out, KVC_F16, 3, qsh);
    c->tqo = kvc_tensor_make(c->qo_indptr, KVC_I32, 1, &nb1);
    c->tindptr = kvc_tensor_make(c->indptr, KVC_I32, 1, &nb1);
    c->tindices = kvc_tensor_make(c->indices, KVC_I32, 1, &np);
    c->tlast = kvc_tensor_make(c->last, KVC_I32, 1, &nb);
    /* visible (query, key) pairs per head: qo = kv = L */
    const double pairs = causal ? (double)L * (double)(L + 1) / 2.0 : (double)L * (double)L;
    c->flops = 4.0 * (double)s.D * (double)s.Hq * pairs * (double)B;
    return 0;
}

/* Operator and FMA peak, interleaved in rounds. */
static int time_with_peak(pf_case *c, double op_s, bench_fma *pk, double ref_s, bench_timing *op,
                          double *peak_gflops) {
    static bench_timer t_op, t_pk;
    if (bench_timer_start(&t_op, pf_call, c, op_s / 16.0) != 0) return 1;
    if (bench_timer_start(&t_pk, bench_fma_pass, pk, ref_s / 8.0) != 0) return -1;
    for (int round = 0; round < 4; round++) {
        /* the peak runs about as long as the operator did in this round, so
         * both sample the same stretch of a shared machine's load */
        const double t0 = bench_now();
        if (bench_timer_run(&t_op, op_s / 4, 2) != 0) return 1;
        const double spent = bench_now() - t0;
        if (bench_timer_run(&t_pk, spent > ref_s / 4 ? spent : ref_s / 4, 1) != 0) return -1;
    }
    bench_timing pt;
    bench_timer_result(&t_op, op);
    bench_timer_result(&t_pk, &pt);
    /* medians on both sides: the two timers saw the same machine conditions */
    *peak_gflops = pk->flops / pt.median_s * 1e-9;
    return 0;
}

int bench_prefill(const bench_opts *o) {
    static const pf_shape shapes_full[2] = {{32, 8, 128}, {9, 3, 64}};
    static const int64_t lens_full[2] = {512, 2048}, lens_quick[1] = {96};
    const struct {
        unsigned bit;
        const char *name;
        kvc_dtype dt;
    } cts[2] = {{BENCH_CACHE_F16, "f16", KVC_F16}, {BENCH_CACHE_INT8, "int8", KVC_I8}};
    const unsigned caches = o->caches ? o->caches : (BENCH_CACHE_F16 | BENCH_CACHE_INT8);
    pf_shape shapes[2];
    int n_shapes = 2;
    memcpy(shapes, shapes_full, sizeof shapes);
    if (o->heads || o->head_dim) {
        shapes[0].H = o->heads ? o->heads : 8;
        shapes[0].D = o->head_dim ? o->head_dim : 128;
        shapes[0].Hq = shapes[0].H * 4;
        n_shapes = 1;
    }
    const int64_t *lens = o->quick ? lens_quick : lens_full;
    int n_lens = o->quick ? 1 : 2;
    int64_t one_len = o->kvlen, B = o->batch ? o->batch : 1;
    if (one_len) lens = &one_len, n_lens = 1;
    for (int si = 0; si < n_shapes; si++)
        if (shapes[si].D % PF_GROUP != 0 && (caches & BENCH_CACHE_INT8)) {
            fprintf(stderr, "kvcache: bench prefill: head dim must be a multiple of %d for int8 "
                            "caches\n", PF_GROUP);
            return CLI_EXIT_USAGE;
        }
    /* in double: the largest --batch, --kvlen and --heads overflow int64_t;
     * per case: q, out, K, V */
    double need = 0;
    for (int si = 0; si < n_shapes; si++)
        for (int li = 0; li < n_lens; li++) {
            const pf_shape s = shapes[si];
            const double slots = (double)B * (double)((lens[li] + PF_PAGE - 1) / PF_PAGE * PF_PAGE);
            const double bytes = 2 * slots * (double)(s.H * s.D) * 2 + /* K, V (f16 at most) */
                                 2 * (double)B * (double)lens[li] * (double)(s.Hq * s.D) * 2;
            if (bytes > need) need = bytes;
        }
    if (need > (double)bench_mem_limit(o))
        return bench_refuse_size(o, "prefill", need, "--batch, --kvlen, --heads or --head-dim");
    bench_print_machine(o, "prefill", stdout);
    if (!o->json)
        printf("# kvc_prefill_run_paged, one layer per call: %lld request(s) of qo = kv tokens, "
               "paged NHD cache, page_size %d (shuffled pages), float16 q/out, int8 with quant "
               "group %d and float16 scales; %.2f s per case. FLOPs: 4 * Dh per visible (query "
               "head, key) pair. peak: FMA chains on registers, same ISA (%s) and threads, "
               "interleaved\n",
               (long long)B, PF_PAGE, PF_GROUP, o->time_s, kvc_isa_name(kvc_get_isa()));
    const double ref_budget = o->quick ? 0.005 : 0.1;
    if (!o->json)
        printf("%-10s %-5s %6s %6s %3s %10s %9s %9s %6s\n", "shape", "cache", "kv", "causal",
               "thr", "ms/layer", "GFLOP/s", "peak", "ratio");
    int cases = 0, failed = 0, goals = 0, goals_met = 0;
    for (int si = 0; si < n_shapes; si++)
        for (int li = 0; li < n_lens; li++)
            for (int causal = 1; causal >= 0; causal--)
                for (int ci = 0; ci < 2; ci++) {
                    if (!(caches & cts[ci].bit)) continue;
                    const pf_shape s = shapes[si];
                    pf_case c;
                    if (setup(&c, s, B, lens[li], causal, cts[ci].dt, cts[ci].name) != 0)
                        return CLI_EXIT_FAIL;
                    for (int ti = 0; ti < o->n_thread_counts; ti++) {
                        const int nt = o->threads[ti];
                        cases++;
                        if (kvc_prefill_plan_create_paged(&c.tqo, &c.tindptr, &c.tindices, &c.tlast,
                                                          (int32_t)s.Hq, (int32_t)s.H,
                                                          (int32_t)s.D, PF_PAGE, causal, NULL, NULL,
                                                          nt, &c.plan) != KVC_OK ||
                            kvc_threadpool_create(nt, &c.pool) != KVC_OK) {
                            fprintf(stderr, "kvcache: bench prefill: %s\n", kvc_last_error());
                            failed++;
                            kvc_prefill_plan_destroy(c.plan);
                            c.plan = NULL;
                            continue;
                        }
                        bench_fma pk;
                        bench_fma_prepare(&pk, nt);
                        bench_timing tm;
                        double peak = 0;
                        const size_t n_out = (size_t)(B * c.L * s.Hq * s.D);
                        bench_poison(c.out, n_out * 2);
                        int rc = time_with_peak(&c, o->time_s, &pk, ref_budget, &tm, &peak);
                        kvc_threadpool_destroy(c.pool);
                        c.pool = NULL;
                        kvc_prefill_plan_destroy(c.plan);
                        c.plan = NULL;
                        if (rc != 0) {
                            fprintf(stderr, "kvcache: bench prefill: %s\n",
                                    rc > 0 ? kvc_last_error() : "FMA peak threads failed");
                            failed++;
                            continue;
                        }
                        if (!bench_output_finite(c.out, n_out, KVC_F16)) {
                            fprintf(stderr, "kvcache: bench prefill: output not written (or "
                                    "not finite)\n");
                            failed++;
                            continue;
                        }
                        bench_sink(bench_checksum(0, c.out, n_out * 2));
                        const double gf = c.flops / tm.median_s * 1e-9, ratio = gf / peak;
                        int met = -1;
                        if (s.D == 128) {
                            met = ratio >= PF_GOAL;
                            goals++, goals_met += met;
                        }
                        if (o->json) {
                            printf("{\"type\":\"case\",\"target\":\"prefill\",\"hq\":%lld,\"h\":%lld,"
                                   "\"head_dim\":%lld,\"cache\":\"%s\",\"batch\":%lld,\"qo\":%lld,"
                                   "\"kv\":%lld,\"causal\":%s,\"threads\":%d,\"isa\":\"%s\","
                                   "\"ms_per_layer\":%.4f,\"ms_min\":%.4f,\"flops\":%.0f,"
                                   "\"gflops\":%.3f,\"peak_gflops\":%.3f,\"ratio\":%.4f,"
                                   "\"goal\":\"%s\",\"goal_met\":%s}\n",
                                   (long long)s.Hq, (long long)s.H, (long long)s.D, c.name,
                                   (long long)B, (long long)c.L, (long long)c.L,
                                   causal ? "true" : "false", nt, kvc_isa_name(kvc_get_isa()),
                                   tm.median_s * 1e3, tm.min_s * 1e3, c.flops, gf, peak, ratio,
                                   met < 0 ? "" : ">=0.4", met < 0 ? "null" : met ? "true" : "false");
                        } else {
                            char sh[32];
                            snprintf(sh, sizeof sh, "%lld/%lld/%lld", (long long)s.Hq,
                                     (long long)s.H, (long long)s.D);
                            printf("%-10s %-5s %6lld %6s %3d %10.3f %9.1f %9.1f %6.3f%s\n", sh,
                                   c.name, (long long)c.L, causal ? "yes" : "no", nt,
                                   tm.median_s * 1e3, gf, peak, ratio,
                                   met < 0 ? "" : met ? " >=0.4 ok" : " >=0.4 MISSED");
                        }
                        bench_flush("prefill");
                    }
                    free_case(&c);
                }
    if (o->json)
        printf("{\"type\":\"summary\",\"cases\":%d,\"failed\":%d,\"goals\":%d,\"goals_met\":%d}\n",
               cases, failed, goals, goals_met);
    else
        printf("# %d cases, %d failed; goal (>= %.1f of the FMA peak at Dh=128) met %d of %d\n",
               cases, failed, PF_GOAL, goals_met, goals);
    return failed ? CLI_EXIT_FAIL : CLI_EXIT_OK;
}
