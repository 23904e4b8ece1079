/*
 * `kvcache bench append`: kvc_append_paged_kv_cache on the two shapes that
 * matter for a serving engine, one layer per call:
 *
 *   decode   B requests (256) append 1 token each. Every request owns
 *            kvlen_cap = 256 positions (16 pages); call i writes position
 *            i % 256 of every request, so successive calls touch new cache
 *            lines across the whole cache as decode steps do (the cache,
 *            268 MB in float16, is far larger than the L3).
 *   prefill  4 requests append 2048 tokens each into fresh pages.
 *
 * H = 8, Dh = 128, page_size 16, NHD, one combined (max_pages, 2, 16, H, Dh)
 * cache with pages handed out in a shuffled order, float16 inputs; float16
 * storage (a copy) or int8 (quant group 8, float16 scales). Each case reports
 * us/call, ns per (token, layer), bytes moved (inputs read + cache rows and
 * scales written), GB/s and the ratio to memcpy measured in the same run
 * (interleaved, same thread count); quantized prefills also the ratio to a
 * model of their two passes (two_pass below). Goals: decode <= 1000 ns per
 * (token, layer); prefill >= 0.6 of memcpy. A few rows of the last call are
 * checked against the inputs (float16) or kvc_quantize (int8).
 */
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"

#define APP_PAGE 16
#define APP_GROUP 8

typedef struct app_cachetype {
    unsigned bit; /* BENCH_CACHE_* */
    const char *name;
    kvc_dtype dtype;
} app_cachetype;

static const app_cachetype app_cachetypes[] = {
    {BENCH_CACHE_F16, "f16", KVC_F16},
    {BENCH_CACHE_INT8, "int8", KVC_I8},
    {BENCH_CACHE_INT4, "int4", KVC_I4},
};
#define N_CACHETYPES ((int)(sizeof app_cachetypes / sizeof app_cachetypes[0]))

typedef struct app_dims {
    int64_t B, T;    /* requests, tokens appended per request per call */
    int64_t S;       /* positions each request owns (decode: the cap; prefill: T) */
    int64_t H, D;
    int decode;
} app_dims;

typedef struct app_case {
    app_dims d;
    const app_cachetype *ct;
    int64_t nnz, max_pages;
    uint16_t *xk, *xv; /* (nnz, H, D) float16 */
    unsigned char *cache, *scale;
    size_t cache_bytes, scale_bytes;
    int32_t *indptr, *indices, *last, *bi, *pos;
    kvc_tensor t_xk, t_xv, t_bi, t_pos, t_indices, t_indptr, t_last;
    kvc_paged_cache pc;
    kvc_threadpool *pool;
    int64_t step; /* decode: calls so far (position step % S) */
    kvc_status st;
} app_case;

static int app_call(void *ctx) {
    app_case *c = ctx;
    if (c->d.decode) { /* the next decode step: one new position per request */
        const int32_t p = (int32_t)(c->step++ % c->d.S);
        for (int64_t j = 0; j < c->nnz; j++) c->pos[j] = p;
    }
    c->st = kvc_append_paged_kv_cache(&c->t_xk, &c->t_xv, &c->t_bi, &c->t_pos, &c->pc,
                                      &c->t_indices, &c->t_indptr, &c->t_last, c->pool);
    return c->st != KVC_OK;
}

/* ---- set-up ------------------------------------------------------------ */

static void free_case(app_case *c) {
    bench_free(c->xk);
    bench_free(c->xv);
    bench_free(c->cache);
    bench_free(c->scale);
    free(c->indptr);
    free(c->indices);
    free(c->last);
    free(c->bi);
    free(c->pos);
    memset(c, 0, sizeof *c);
}

static int64_t pages_of(const app_dims *d) { return (d->S + APP_PAGE - 1) / APP_PAGE; }

/* Bytes the buffers of a case take (cache with scales, inputs). */
static double case_bytes(const app_dims *d, const app_cachetype *ct) {
    double slots = (double)(d->B * pages_of(d) * APP_PAGE), row = (double)(d->H * d->D);
    double per =
        row * kvc_dtype_bits(ct->dtype) / 8.0 + (ct->dtype != KVC_F16 ? row / APP_GROUP * 2 : 0);
    return 2.0 * slots * per + 2.0 * (double)(d->B * d->T) * row * 2.0;
}

static int setup_case(app_case *c, const app_dims *d, const app_cachetype *ct) {
    memset(c, 0, sizeof *c);
    c->d = *d;
    c->ct = ct;
    const int64_t B = d->B, H = d->H, D = d->D, pages = pages_of(d);
    const int quant = ct->dtype != KVC_F16;
    c->nnz = B * d->T;
    c->max_pages = B * pages;
    size_t in_bytes = (size_t)(c->nnz * H * D) * 2;
    int64_t csh[5] = {c->max_pages, 2, APP_PAGE, H, D},
            ssh[5] = {c->max_pages, 2, APP_PAGE, H, D / APP_GROUP};
    c->cache_bytes = (size_t)(c->max_pages * 2 * APP_PAGE * H * D * kvc_dtype_bits(ct->dtype) / 8);
    c->scale_bytes = quant ? (size_t)(c->max_pages * 2 * APP_PAGE * H * (D / APP_GROUP)) * 2 : 0;
    c->xk = bench_alloc(in_bytes);
    c->xv = bench_alloc(in_bytes);
    c->cache = bench_alloc(c->cache_bytes);
    c->scale = quant ? bench_alloc(c->scale_bytes) : NULL;
    c->indptr = calloc((size_t)B + 1, sizeof(int32_t));
    c->indices = calloc((size_t)c->max_pages, sizeof(int32_t));
    c->last = calloc((size_t)B, sizeof(int32_t));
    c->bi = calloc((size_t)c->nnz, sizeof(int32_t));
    c->pos = calloc((size_t)c->nnz, sizeof(int32_t));
    if (!c->xk || !c->xv || !c->cache || (quant && !c->scale) || !c->indptr || !c->indices ||
        !c->last || !c->bi || !c->pos) {
        fprintf(stderr, "kvcache: bench append: out of memory\n");
        free_case(c);
        return -1;
    }
    /* Inputs: finite float16 in +-[0.25, 4). */
    for (int64_t i = 0; i < c->nnz * H * D; i++) {
        uint64_t r = bench_mix64((uint64_t)i);
        c->xk[i] = (uint16_t)((r & 0x8000u) | ((13u + ((r >> 10) & 3u)) << 10) | (r & 0x3ffu));
        r >>= 16;
        c->xv[i] = (uint16_t)((r & 0x8000u) | ((13u + ((r >> 10) & 3u)) << 10) | (r & 0x3ffu));
    }
    /* Page table: every request owns S positions; pages shuffled (fixed seed). */
    for (int64_t i = 0; i < c->max_pages; i++) c->indices[i] = (int32_t)i;
    uint64_t r = 12345;
    for (int64_t i = c->max_pages - 1; i > 0; i--) {
        r = bench_mix64(r);
        int64_t j = (int64_t)(r % (uint64_t)(i + 1));
        int32_t t = c->indices[i];
        c->indices[i] = c->indices[j];
        c->indices[j] = t;
    }
    for (int64_t b = 0; b < B; b++) {
        c->indptr[b + 1] = (int32_t)((b + 1) * pages);
        c->last[b] = (int32_t)(d->S - (pages - 1) * APP_PAGE);
    }
    int64_t ish[3] = {c->nnz, H, D}, nb = B, nb1 = B + 1, nnz = c->nnz, np = c->max_pages;
    c->t_xk = kvc_tensor_make(c->xk, KVC_F16, 3, ish);
    c->t_xv = kvc_tensor_make(c->xv, KVC_F16, 3, ish);
    c->t_bi = kvc_tensor_make(c->bi, KVC_I32, 1, &nnz);
    c->t_pos = kvc_tensor_make(c->pos, KVC_I32, 1, &nnz);
    c->t_indices = kvc_tensor_make(c->indices, KVC_I32, 1, &np);
    c->t_indptr = kvc_tensor_make(c->indptr, KVC_I32, 1, &nb1);
    c->t_last = kvc_tensor_make(c->last, KVC_I32, 1, &nb);
    if (d->decode) {
        for (int64_t j = 0; j < c->nnz; j++) c->bi[j] = (int32_t)j;
    } else { /* rows of request b at its positions [S - T, S), through the library */
        int32_t *app = calloc((size_t)B + 1, sizeof(int32_t)),
                *seq = calloc((size_t)B, sizeof(int32_t));
        kvc_status st = KVC_ERR_NOMEM;
        if (app && seq) {
            for (int64_t b = 0; b < B; b++)
                app[b + 1] = (int32_t)((b + 1) * d->T), seq[b] = (int32_t)d->S;
            kvc_tensor ta = kvc_tensor_make(app, KVC_I32, 1, &nb1),
                       ts = kvc_tensor_make(seq, KVC_I32, 1, &nb);
            st = kvc_get_batch_indices_positions(&ta, &ts, nnz, &c->t_bi, &c->t_pos);
        }
        free(app);
        free(seq);
        if (st != KVC_OK) {
            fprintf(stderr, "kvcache: bench append: rows: %s\n", kvc_last_error());
            free_case(c);
            return -1;
        }
    }
    kvc_tensor t5 = kvc_tensor_make(c->cache, ct->dtype, 5, csh);
    kvc_tensor s5 = kvc_tensor_make(c->scale, KVC_F16, 5, ssh);
    if (kvc_paged_cache_from_combined(&t5, quant ? &s5 : NULL, KVC_NHD, APP_GROUP, &c->pc) !=
        KVC_OK) {
        fprintf(stderr, "kvcache: bench append: %s\n", kvc_last_error());
        free_case(c);
        return -1;
    }
    return 0;
}

/* ---- checks ------------------------------------------------------------ */

/* Row j of the last call, K and V: stored as the input (float16) or as
 * kvc_quantize of it (int8/int4, scales included). 0, or -1 with a message. */
static int check_row(const app_case *c, int64_t j, const char *label) {
    const int64_t H = c->d.H, D = c->d.D, n = H * D;
    const int32_t b = c->bi[j], p = c->pos[j];
    const int64_t page = c->indices[c->indptr[b] + p / APP_PAGE], slot = p % APP_PAGE;
    const int bits = kvc_dtype_bits(c->ct->dtype);
    unsigned char q[65536];
    uint16_t s[8192];
    if (n > 8192) return 0; /* row buffers are sized for H*Dh <= 8192 */
    for (int kv = 0; kv < 2; kv++) {
        const uint16_t *x = (kv ? c->xv : c->xk) + j * n;
        const int64_t e = ((page * 2 + kv) * APP_PAGE + slot) * n; /* element offset */
        const unsigned char *row = c->cache + e * bits / 8;
        int ok;
        if (c->ct->dtype == KVC_F16) {
            ok = memcmp(row, x, (size_t)n * 2) == 0;
        } else {
            ok = kvc_quantize(x, KVC_F16, n, bits, APP_GROUP, q, s, KVC_F16) == KVC_OK &&
                 memcmp(row, q, (size_t)(n * bits / 8)) == 0 &&
                 memcmp(c->scale + e / APP_GROUP * 2, s, (size_t)(n / APP_GROUP) * 2) == 0;
        }
        if (!ok) {
            fprintf(stderr,
                    "kvcache: bench append: %s: wrong %s row %lld (request %d, position %d)\n",
                    label, kv ? "value" : "key", (long long)j, (int)b, (int)p);
            return -1;
        }
    }
    return 0;
}

static int check_case(const app_case *c, const char *label) {
    const int64_t rows[3] = {0, c->nnz / 2, c->nnz - 1};
    for (int i = 0; i < 3; i++)
        if (check_row(c, rows[i], label) != 0) return -1;
    return 0;
}

/* ---- reporting and driver ------------------------------------------------ */

typedef struct app_row {
    const app_case *c;
    int threads;
    bench_timing tm;
    double bytes, gbs, memcpy_gbs, ratio, ns_tok;
    double read_gbs, model; /* two-pass model (quantized prefill; model < 0: none) */
    int met;
} app_row;

/* Inputs read (K and V, float16). */
static double input_bytes(const app_case *c) {
    return 2.0 * (double)c->nnz * (double)(c->d.H * c->d.D) * 2.0;
}

/* Inputs read (K and V) + cache rows and scales written. */
static double bytes_per_call(const app_case *c) {
    const double rows = 2.0 * (double)c->nnz, n = (double)(c->d.H * c->d.D);
    double out = n * kvc_dtype_bits(c->ct->dtype) / 8.0;
    if (c->ct->dtype != KVC_F16) out += n / APP_GROUP * 2.0;
    return input_bytes(c) + rows * out;
}

/* A quantized prefill larger than the cache reads its input twice: the
 * NaN/Inf check covers every row before the first write (SEMANTICS: a
 * failed call writes nothing), and by the time the writing pass comes the
 * input has mostly left the cache. Model of that: one read-only pass over
 * the input at the measured read bandwidth plus one copy-like pass (input
 * read + cache written) at the measured memcpy bandwidth; the `2pass`
 * column is (model time) / measured time. Not a strict bound: whatever part
 * of the input the last-level cache still holds is read faster (values
 * above 1 are possible, e.g. with 2 threads). */
static int two_pass(const app_case *c) { return !c->d.decode && c->ct->dtype != KVC_F16; }

static const char *goal_str(const app_case *c) { return c->d.decode ? "<=1000ns" : ">=0.60"; }

static void print_row(const bench_opts *o, const app_row *r) {
    const app_case *c = r->c;
    if (o->json) {
        printf("{\"type\":\"case\",\"target\":\"append\",\"shape\":\"%s\",\"cache\":\"%s\","
               "\"threads\":%d,\"isa\":\"%s\",\"requests\":%lld,\"tokens_per_request\":%lld,"
               "\"heads\":%lld,\"head_dim\":%lld,\"page_size\":%d,\"quant_group\":%d,"
               "\"us_per_call\":%.3f,\"us_min\":%.3f,\"calls\":%lld,\"samples\":%d,"
               "\"ns_per_token_layer\":%.2f,\"bytes_per_call\":%.0f,\"gbs\":%.3f,"
               "\"memcpy_gbs\":%.3f,\"ratio\":%.4f,\"goal\":\"%s\",\"goal_met\":%s",
               c->d.decode ? "decode" : "prefill", c->ct->name, r->threads,
               kvc_isa_name(kvc_get_isa()), (long long)c->d.B, (long long)c->d.T,
               (long long)c->d.H, (long long)c->d.D, APP_PAGE, APP_GROUP, r->tm.median_s * 1e6,
               r->tm.min_s * 1e6, (long long)r->tm.calls, r->tm.samples, r->ns_tok, r->bytes,
               r->gbs, r->memcpy_gbs, r->ratio, goal_str(c), r->met ? "true" : "false");
        if (r->model >= 0.0)
            printf(",\"read_gbs\":%.3f,\"two_pass_model\":%.4f", r->read_gbs, r->model);
        printf("}\n");
        return;
    }
    char model[16] = "     -";
    if (r->model >= 0.0) snprintf(model, sizeof model, "%6.3f", r->model);
    printf("%-8s %-5s %3d %7lld %10.1f %8.1f %9.2f %8.2f %8.2f %7.3f %s  %s %s\n",
           c->d.decode ? "decode" : "prefill", c->ct->name, r->threads, (long long)c->nnz,
           r->tm.median_s * 1e6, r->ns_tok, r->bytes * 1e-6, r->gbs, r->memcpy_gbs, r->ratio, model,
           goal_str(c), r->met ? "ok" : "MISSED");
}

/* Runs one case with each thread count; returns the number of failures. */
static int run_case(const bench_opts *o, app_case *c, bench_membw_ctx *mb, double membw_budget,
                    int *cases, int *met) {
    char label[96];
    int failed = 0;
    for (int ti = 0; ti < o->n_thread_counts; ti++) {
        const int nt = o->threads[ti];
        snprintf(label, sizeof label, "%s, %s cache, %d thread%s",
                 c->d.decode ? "decode" : "prefill", c->ct->name, nt, nt == 1 ? "" : "s");
        (*cases)++;
        if (kvc_threadpool_create(nt, &c->pool) != KVC_OK) {
            fprintf(stderr, "kvcache: bench append: %s: thread pool: %s\n", label,
                    kvc_last_error());
            failed++;
            continue;
        }
        app_row r;
        memset(&r, 0, sizeof r);
        r.c = c;
        r.threads = nt;
        bench_membw_prepare(mb, nt, 0);
        int rc = bench_time_interleaved(app_call, c, o->time_s, mb, membw_budget, r.threads,
                                        &r.tm, &r.memcpy_gbs);
        kvc_threadpool_destroy(c->pool);
        c->pool = NULL;
        if (rc != 0) {
            if (rc > 0)
                fprintf(stderr, "kvcache: bench append: %s: %s: %s\n", label, kvc_status_str(c->st),
                        kvc_last_error());
            return failed + 1;
        }
        if (check_case(c, label) != 0) return failed + 1;
        r.model = -1.0;
        bench_membw bw;
        if (two_pass(c) && bench_membw_measure(mb, nt, membw_budget, 1, &bw) == 0) {
            const double in = input_bytes(c), all = bytes_per_call(c);
            r.read_gbs = bw.read_gbs;
            r.model = (in / bw.read_gbs + all / r.memcpy_gbs) * 1e-9 / r.tm.median_s;
        }
        r.bytes = bytes_per_call(c);
        r.gbs = r.bytes / r.tm.median_s * 1e-9;
        r.ratio = r.gbs / r.memcpy_gbs;
        r.ns_tok = r.tm.median_s * 1e9 / (double)c->nnz;
        r.met = c->d.decode ? r.ns_tok <= 1000.0 : r.ratio >= 0.6;
        *met += r.met;
        print_row(o, &r);
        bench_flush("append");
    }
    return failed;
}

int bench_append(const bench_opts *o) {
    app_dims shapes[2];
    const int64_t H = o->heads ? o->heads : (o->quick ? 2 : 8);
    const int64_t D = o->head_dim ? o->head_dim : (o->quick ? 64 : 128);
    /* decode: B requests x 1 token over a cap of 256 positions each */
    shapes[0] =
        (app_dims){o->batch ? o->batch : (o->quick ? 16 : 256), 1, o->quick ? 64 : 256, H, D, 1};
    /* prefill: 4 requests x kvlen tokens into fresh pages */
    const int64_t T = o->kvlen ? o->kvlen : (o->quick ? 128 : 2048);
    shapes[1] = (app_dims){o->quick ? 2 : 4, T, T, H, D, 0};
    double need = 0;
    for (int s = 0; s < 2; s++)
        for (int ci = 0; ci < N_CACHETYPES; ci++)
            if ((o->caches & app_cachetypes[ci].bit) &&
                case_bytes(&shapes[s], &app_cachetypes[ci]) > need)
                need = case_bytes(&shapes[s], &app_cachetypes[ci]);
    if (need > (double)bench_mem_limit(o))
        return bench_refuse_size(o, "append", need, "--batch, --kvlen, --heads or --head-dim");
    bench_print_machine(o, "append", stdout);
    if (!o->json)
        printf("# kvc_append_paged_kv_cache, NHD combined cache, page_size %d, H=%lld, Dh=%lld, "
               "float16 inputs, int8/int4 with quant group %d and float16 scales; decode: %lld "
               "requests x 1 token (position cycling over %lld per request), prefill: %lld "
               "requests x %lld tokens; %.2f s per case\n",
               APP_PAGE, (long long)H, (long long)D, APP_GROUP, (long long)shapes[0].B,
               (long long)shapes[0].S, (long long)shapes[1].B, (long long)T, o->time_s);

    const double membw_budget = o->quick ? 0.005 : 0.15;
    bench_membw_ctx *mb = bench_membw_create(o->membw_bytes);
    if (mb == NULL) return CLI_EXIT_FAIL;
    if (!o->json)
        printf("%-8s %-5s %3s %7s %10s %8s %9s %8s %8s %7s %6s  %s\n", "shape", "cache", "thr",
               "tokens", "us/call", "ns/tok", "MB/call", "GB/s", "memcpy", "ratio", "2pass",
               "goal");
    int cases = 0, failed = 0, met = 0;
    for (int s = 0; s < 2; s++)
        for (int ci = 0; ci < N_CACHETYPES; ci++) {
            if (!(o->caches & app_cachetypes[ci].bit)) continue;
            app_case c;
            if (setup_case(&c, &shapes[s], &app_cachetypes[ci]) != 0) {
                bench_membw_destroy(mb);
                return CLI_EXIT_FAIL;
            }
            failed += run_case(o, &c, mb, membw_budget, &cases, &met);
            free_case(&c);
        }
    bench_membw_destroy(mb);
    if (o->json)
        printf("{\"type\":\"summary\",\"cases\":%d,\"failed\":%d,\"goals_met\":%d}\n", cases,
               failed, met);
    else
        printf("# %d case%s, %d failed, goal (decode <= 1000 ns per token and layer, prefill >= "
               "0.60 of memcpy) met by %d\n", cases, cases == 1 ? "" : "s", failed, met);
    return failed ? CLI_EXIT_FAIL : CLI_EXIT_OK;
}
