/*
 * `kvcache bench mla`: kvc_mla_run (one decode step, one layer) over paged
 * ckv/kpe caches (D_ckv 512, D_kpe 64, page_size 64, shuffled pages), Hq 16
 * and 128, kv lengths 4096/16384, batch 1 and 16, float16 and bfloat16
 * caches, bfloat16 q/out (DeepSeek's), sm_scale 1/sqrt(192).
 *
 * Two same-run bounds, each interleaved with the operator so both see the
 * same machine conditions:
 *   - read: a plain vectorized read of a large buffer with as many threads;
 *     "rd" = (ckv/kpe bytes the step must read / time) / read GB/s;
 *   - fma: a register-only FMA loop of the active ISA's vector width with as
 *     many threads; "fma" = (2 * multiply-adds of scores and P.V / time) /
 *     peak GFLOP/s.
 * Per key, MLA does Hq * (2 D_ckv + D_kpe) multiply-adds on D_ckv + D_kpe
 * stored elements (about 30 flop/byte at Hq 16 and 240 at Hq 128): on a CPU
 * core that is compute-bound, so "fma" is the ratio that says how close the
 * kernel is to its limit; "bound" names the resource nearer saturation.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"

#define MLA_DC 512
#define MLA_DK 64
#define MLA_PAGE 64

/* ---- FMA peak reference
 * ------------------------------------------------------ */

/* ---- cases
 * -------------------------------------------------------------------- */

typedef struct mla_bcase {
    int64_t Hq, B, L;
    kvc_dtype dt;
    unsigned char *ckv, *kpe;
    uint16_t *qn, *qp, *out;
    float *lse;
    int32_t *qo_indptr, *kv_indptr, *indices, *len;
    kvc_tensor tqn, tqp, tckv, tkpe, tout, tlse, tqo, tkvp, tidx, tlen;
    kvc_mla_plan *plan;
    kvc_threadpool *pool;
    double bytes, flops;
} mla_bcase;

static int mla_call(void *ctx) {
    mla_bcase *c = ctx;
    return kvc_mla_run(c->plan, &c->tqn, &c->tqp, &c->tckv, &c->tkpe, &c->tout, &c->tlse,
                       c->pool) != KVC_OK;
}

static void free_case(mla_bcase *c) {
    bench_free(c->ckv);
    bench_free(c->kpe);
    bench_free(c->qn);
    bench_free(c->qp);
    bench_free(c->out);
    free(c->lse);
    free(c->qo_indptr);
    free(c->kv_indptr);
    free(c->indices);
    free(c->len);
    kvc_mla_plan_destroy(c->plan);
    memset(c, 0, sizeof *c);
}

/* Random 16-bit floats of magnitude in [0.25, 1) (f16 or bf16 bits). */
static void fill16(uint16_t *p, size_t n, kvc_dtype dt, uint64_t seed) {
    for (size_t i = 0; i < n; i++) {
        const uint64_t r = bench_mix64(seed + i);
        p[i] = dt == KVC_F16
                   ? (uint16_t)((r & 0x8000u) | ((13u + ((r >> 10) & 1u)) << 10) | (r & 0x3ffu))
                   : (uint16_t)((r & 0x8000u) | ((125u + ((r >> 7) & 1u)) << 7) | (r & 0x7fu));
    }
}

static int setup(mla_bcase *c, int64_t Hq, int64_t B, int64_t L, kvc_dtype dt) {
    memset(c, 0, sizeof *c);
    c->Hq = Hq, c->B = B, c->L = L, c->dt = dt;
    const int64_t pages = (L + MLA_PAGE - 1) / MLA_PAGE, P = B * pages;
    const size_t nc = (size_t)(P * MLA_PAGE * MLA_DC), nk = (size_t)(P * MLA_PAGE * MLA_DK);
    const size_t nq = (size_t)(B * Hq * MLA_DC), np = (size_t)(B * Hq * MLA_DK);
    c->ckv = bench_alloc(nc * 2);
    c->kpe = bench_alloc(nk * 2);
    c->qn = bench_alloc(nq * 2);
    c->qp = bench_alloc(np * 2);
    c->out = bench_alloc(nq * 2);
    c->lse = calloc((size_t)(B * Hq), sizeof(float));
    c->qo_indptr = calloc((size_t)B + 1, 4);
    c->kv_indptr = calloc((size_t)B + 1, 4);
    c->indices = calloc((size_t)P, 4);
    c->len = calloc((size_t)B, 4);
    if (!c->ckv || !c->kpe || !c->qn || !c->qp || !c->out || !c->lse || !c->qo_indptr ||
        !c->kv_indptr || !c->indices || !c->len) {
        fprintf(stderr, "kvcache: bench mla: out of memory\n");
        free_case(c);
        return -1;
    }
    fill16((uint16_t *)(void *)c->ckv, nc, dt, 1);
    fill16((uint16_t *)(void *)c->kpe, nk, dt, 1ull << 40);
    fill16(c->qn, nq, KVC_BF16, 2ull << 40);
    fill16(c->qp, np, KVC_BF16, 3ull << 40);
    for (int64_t i = 0; i < P; i++) c->indices[i] = (int32_t)i;
    uint64_t r = 4242;
    for (int64_t i = P - 1; i > 0; i--) {
        r = bench_mix64(r);
        const int64_t j = (int64_t)(r % (uint64_t)(i + 1));
        const int32_t t = c->indices[i];
        c->indices[i] = c->indices[j];
        c->indices[j] = t;
    }
    for (int64_t b = 0; b < B; b++) {
        c->qo_indptr[b + 1] = (int32_t)(b + 1);
        c->kv_indptr[b + 1] = (int32_t)((b + 1) * pages);
        c->len[b] = (int32_t)L;
    }
    int64_t csh[3] = {P, MLA_PAGE, MLA_DC}, ksh[3] = {P, MLA_PAGE, MLA_DK};
    int64_t qsh[3] = {B, Hq, MLA_DC}, psh[3] = {B, Hq, MLA_DK}, lsh[2] = {B, Hq};
    int64_t nb = B, nb1 = B + 1, np_ = P;
    c->tckv = kvc_tensor_make(c->ckv, dt, 3, csh);
    c->tkpe = kvc_tensor_make(c->kpe, dt, 3, ksh);
    c->tqn = kvc_tensor_make(c->qn, KVC_BF16, 3, qsh);
    c->tqp = kvc_tensor_make(c->qp, KVC_BF16, 3, psh);
    c->tout = kvc_tensor_make(c->out, KVC_BF16, 3, qsh);
    c->tlse = kvc_tensor_make(c->lse, KVC_F32, 2, lsh);
    c->tqo = kvc_tensor_make(c->qo_indptr, KVC_I32, 1, &nb1);
    c->tkvp = kvc_tensor_make(c->kv_indptr, KVC_I32, 1, &nb1);
    c->tidx = kvc_tensor_make(c->indices, KVC_I32, 1, &np_);
    c->tlen = kvc_tensor_make(c->len, KVC_I32, 1, &nb);
    c->bytes = (double)(B * L) * (MLA_DC + MLA_DK) * 2.0;
    c->flops = 2.0 * (double)(B * L) * (double)Hq * (2.0 * MLA_DC + MLA_DK);
    return 0;
}

/* Operator, plain read and FMA loop, interleaved in rounds. */
static int time_case(mla_bcase *c, double op_s, bench_membw_ctx *mb, double ref_s, int nt,
                     bench_timing *op, double *read_gbs, double *peak_gflops) {
    static bench_timer t_op, t_rd, t_fma;
    static bench_fma fr;
    const size_t bytes = bench_membw_prepare(mb, nt, 1);
    bench_fma_prepare(&fr, nt);
    if (bench_timer_start(&t_op, mla_call, c, op_s / 16.0) != 0) return 1;
    if (bench_timer_start(&t_rd, bench_membw_pass, mb, ref_s / 8.0) != 0) return -1;
    if (bench_timer_start(&t_fma, bench_fma_pass, &fr, ref_s / 8.0) != 0) return -1;
    for (int round = 0; round < 4; round++) {
        if (bench_timer_run(&t_rd, ref_s / 4, 1) != 0) return -1;
        if (bench_timer_run(&t_fma, ref_s / 4, 1) != 0) return -1;
        if (bench_timer_run(&t_op, op_s / 4, 2) != 0) return 1;
    }
    bench_timing rd, fm;
    bench_timer_result(&t_op, op);
    bench_timer_result(&t_rd, &rd);
    bench_timer_result(&t_fma, &fm);
    *read_gbs = (double)bytes / rd.median_s * 1e-9;
    *peak_gflops = fr.flops / fm.median_s * 1e-9;
    float s = 0;
    for (int i = 0; i < nt; i++) s += fr.sink[i];
    bench_sink((uint64_t)(int64_t)s);
    return 0;
}

static const char *dt_short(kvc_dtype d) { return d == KVC_F16 ? "f16" : "bf16"; }

int bench_mla(const bench_opts *o) {
    static const int64_t hqs_full[2] = {16, 128}, lens_full[2] = {4096, 16384},
                         batches_full[2] = {1, 16};
    static const int64_t hqs_quick[1] = {16}, lens_quick[1] = {300}, batches_quick[1] = {2};
    static const kvc_dtype dts[2] = {KVC_F16, KVC_BF16};
    const int64_t *hqs = o->quick ? hqs_quick : hqs_full;
    const int64_t *lens = o->quick ? lens_quick : lens_full;
    const int64_t *batches = o->quick ? batches_quick : batches_full;
    int n_hqs = o->quick ? 1 : 2, n_lens = o->quick ? 1 : 2, n_batches = o->quick ? 1 : 2;
    int64_t one_hq = o->heads, one_len = o->kvlen, one_batch = o->batch;
    if (one_hq) hqs = &one_hq, n_hqs = 1;
    if (one_len) lens = &one_len, n_lens = 1;
    if (one_batch) batches = &one_batch, n_batches = 1;
    if (o->head_dim && o->head_dim != MLA_DC) {
        fprintf(stderr, "kvcache: bench mla: D_ckv is fixed at %d (D_kpe %d)\n", MLA_DC, MLA_DK);
        return CLI_EXIT_USAGE;
    }
    /* every case's bytes (cache, q, out) before any runs; in double: the
     * largest --batch, --kvlen and --heads overflow int64_t */
    double need = 0;
    for (int hi = 0; hi < n_hqs; hi++)
        for (int bi = 0; bi < n_batches; bi++)
            for (int li = 0; li < n_lens; li++) {
                const double B = (double)batches[bi], Hq = (double)hqs[hi],
                             slots = (double)((lens[li] + MLA_PAGE - 1) / MLA_PAGE * MLA_PAGE);
                const double b = B * slots * (MLA_DC + MLA_DK) * 2.0 +
                                 B * Hq * (2 * MLA_DC + MLA_DK) * 2.0;
                if (b > need) need = b;
            }
    if (need > (double)bench_mem_limit(o))
        return bench_refuse_size(o, "mla", need, "--batch, --kvlen or --heads");

    bench_print_machine(o, "mla", stdout);
    if (!o->json)
        printf("# kvc_mla_run, one layer per call: D_ckv %d, D_kpe %d, page_size "
               "%d (shuffled "
               "pages), bfloat16 q/out, qo_len 1; %.2f s per case. rd: ckv/kpe "
               "GB/s over a plain "
               "vectorized read; fma: GFLOP/s over an FMA loop (%s), same threads, "
               "interleaved\n",
               MLA_DC, MLA_DK, MLA_PAGE, o->time_s, kvc_isa_name(kvc_get_isa()));
    const double ref_budget = o->quick ? 0.005 : 0.1;
    bench_membw_ctx *mb = bench_membw_create(o->membw_bytes);
    if (!mb) return CLI_EXIT_FAIL;
    if (!o->json)
        printf("%4s %-5s %5s %6s %3s %6s %10s %8s %7s %7s %6s %8s %8s %6s %s\n", "Hq", "cache",
               "batch", "kv", "thr", "chunk", "us/layer", "MB read", "GB/s", "read", "rd",
               "GFLOP/s", "peak", "fma", "bound");
    int cases = 0, failed = 0, skipped = 0;
    for (int hi = 0; hi < n_hqs; hi++)
        for (int bi = 0; bi < n_batches; bi++)
            for (int li = 0; li < n_lens; li++)
                for (int di = 0; di < 2; di++) {
                    const int64_t Hq = hqs[hi], B = batches[bi], L = lens[li];
                    mla_bcase c;
                    if (setup(&c, Hq, B, L, dts[di]) != 0) {
                        bench_membw_destroy(mb);
                        return CLI_EXIT_FAIL;
                    }
                    for (int ti = 0; ti < o->n_thread_counts; ti++) {
                        const int nt = o->threads[ti];
                        cases++;
                        if (kvc_mla_plan_create(
                                &c.tqo, &c.tkvp, &c.tidx, &c.tlen, (int32_t)Hq, MLA_DC, MLA_DK,
                                MLA_PAGE, 0, (float)(1.0 / sqrt(192.0)), 0.0f, &c.plan) != KVC_OK ||
                            kvc_threadpool_create(nt, &c.pool) != KVC_OK) {
                            fprintf(stderr, "kvcache: bench mla: %s\n", kvc_last_error());
                            failed++;
                            kvc_mla_plan_destroy(c.plan);
                            c.plan = NULL;
                            continue;
                        }
                        bench_timing tm;
                        double rd = 0, peak = 0;
                        const size_t n_out = (size_t)(B * Hq * MLA_DC);
                        bench_poison(c.out, n_out * 2);
                        const int rc =
                            time_case(&c, o->time_s, mb, ref_budget, nt, &tm, &rd, &peak);
                        const int64_t chunk = kvc_mla_plan_chunk(c.plan);
                        kvc_threadpool_destroy(c.pool);
                        c.pool = NULL;
                        kvc_mla_plan_destroy(c.plan);
                        c.plan = NULL;
                        if (rc != 0) {
                            if (rc > 0)
                                fprintf(stderr, "kvcache: bench mla: %s\n", kvc_last_error());
                            failed++;
                            continue;
                        }
                        if (!bench_output_finite(c.out, n_out, KVC_BF16)) {
                            fprintf(stderr, "kvcache: bench mla: output not written (or not "
                                    "finite)\n");
                            failed++;
                            continue;
                        }
                        bench_sink(bench_checksum(0, c.out, n_out * 2));
                        const double us = tm.median_s * 1e6;
                        const double gbs = c.bytes / tm.median_s * 1e-9, rratio = gbs / rd;
                        const double gfl = c.flops / tm.median_s * 1e-9, fratio = gfl / peak;
                        const char *bound = fratio >= rratio ? "compute" : "memory";
                        if (o->json) {
                            printf("{\"type\":\"case\",\"target\":\"mla\",\"hq\":%lld,"
                                   "\"d_ckv\":%d,\"d_kpe\":%d,\"page_size\":%d,\"cache\":\"%s\","
                                   "\"batch\":%lld,\"kv\":%lld,\"threads\":%d,\"isa\":\"%s\","
                                   "\"chunk\":%lld,\"us_per_layer\":%.3f,\"us_min\":%.3f,"
                                   "\"bytes\":%.0f,\"gbs\":%.3f,\"read_gbs\":%.3f,"
                                   "\"read_ratio\":%.4f,\"gflops\":%.3f,\"peak_gflops\":%.3f,"
                                   "\"fma_ratio\":%.4f,\"bound\":\"%s\"}\n",
                                   (long long)Hq, MLA_DC, MLA_DK, MLA_PAGE, dt_short(c.dt),
                                   (long long)B, (long long)L, nt, kvc_isa_name(kvc_get_isa()),
                                   (long long)chunk, us, tm.min_s * 1e6, c.bytes, gbs, rd, rratio,
                                   gfl, peak, fratio, bound);
                        } else {
                            printf("%4lld %-5s %5lld %6lld %3d %6lld %10.1f %8.2f %7.2f %7.2f "
                                   "%6.3f %8.1f %8.1f %6.3f %s\n",
                                   (long long)Hq, dt_short(c.dt), (long long)B, (long long)L, nt,
                                   (long long)chunk, us, c.bytes * 1e-6, gbs, rd, rratio, gfl, peak,
                                   fratio, bound);
                        }
                        bench_flush("mla");
                    }
                    free_case(&c);
                }
    bench_membw_destroy(mb);
    if (o->json)
        printf("{\"type\":\"summary\",\"cases\":%d,\"failed\":%d,\"skipped\":%d}\n", cases,
               failed, skipped);
    else
        printf("# %d cases, %d failed, %d skipped (memory)\n", cases, failed, skipped);
    return failed || (cases == 0 && skipped > 0) ? CLI_EXIT_FAIL : CLI_EXIT_OK;
}
