/*
 * `kvcache bench kernel`: the decode kernels alone, without the driver (no
 * plan, tasks, page walk or merges), one thread. One head set (4 query heads
 * of a KV head) per KV head over the rows of L keys x H KV heads (NHD, one
 * run), the calls in the driver's order: every KV head's call for a run of
 * keys before the next keys (runs of 64 for the AMX kernel, blocks of 16 for
 * the float kernels), each given the next call's rows to prefetch as the
 * driver gives them. With Dh 128, H 8 the K/V rows take L x 4 KiB in float16,
 * L x 2 KiB in int8 (plus scales), L x 1 KiB in int4: L = 64 is 256/128/64 KiB
 * (L2 on current cores, not L1), L = 512 2/1/0.5 MiB (float16 past a 1 MiB
 * L2 where int8 still fits), 4096 beyond L2. A timed call sets the head sets up
 * (amx_begin: the query as tile digits) and passes over the keys until
 * 4096 have gone by (64 passes at L 64): the set-up weighs as in a chunk of
 * 4096 keys, and repeated keys leave the normalized output unchanged.
 *
 * Prints ns per 16 keys and head set for float16, int8 and int4 caches
 * (quant group 32 unless --group, float16 scales) with the kernel table of
 * the active ISA (amx: the tile kernel for int8/int4, with the query in 16
 * bits as for the float16 queries of `bench attention`, and int8 again with
 * the 32 bits of float32 queries), and each one's
 * speed-up against the float16 kernel at the same L, measured in the same
 * run: the kernels' own ratio, which bounds what a decode step can reach
 * when K/V sit near the core. Checks every int8/int4 output (the last pass's
 * head sets) against the scalar table's float kernel: a difference above
 * 1e-4 of max|o| fails the case.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"
#include "../../src/kernels/kernels.h"

#define KB_G 4   /* query heads per KV head (one head set) */
#define KB_RUN KVC_AMX_KEYS /* keys per AMX call */

typedef struct kb_case {
    const kvc_kernels *kk;
    kvc_dtype dt;
    int D, H, group, amx;
    int qbits;             /* AMX query precision: 16 (float16/bfloat16 q) or 32 (float32 q) */
    int64_t L, rowb, srow; /* keys, bytes per K/V head row, bytes per token's scale row */
    int reps;              /* passes over the L keys per timed call */
    float sc;              /* scores to base 2, as the driver passes it: log2 e / sqrt(Dh) */
    const unsigned char *k, *v, *ks, *vs;
    const float *q;               /* (H, G, D) */
    float *m, *l, *acc;           /* (H, G), (H, G), (H, G, D): float kernels' states */
    unsigned char *st;            /* (H) AMX states */
    size_t sb;
    kvc_amx_keys *keys;
} kb_case;

/* The rows of KV head h, keys [j, j + n) as attn_decode takes them. */
static void kb_rows(const kb_case *c, int h, int64_t j, kvc_attn_rows *r) {
    memset(r, 0, sizeof *r);
    r->k = c->k + (j * c->H + h) * c->rowb;
    r->v = c->v + (j * c->H + h) * c->rowb;
    r->k_stride = r->v_stride = c->H * c->rowb;
    r->dt = c->dt;
    r->group = c->group;
    r->ksd = r->vsd = KVC_F16;
    if (c->dt != KVC_F16) {
        r->ks = c->ks + j * c->srow + (int64_t)h * (c->D / c->group) * 2;
        r->vs = c->vs + j * c->srow + (int64_t)h * (c->D / c->group) * 2;
        r->ks_stride = r->vs_stride = c->srow;
    }
}

/* A timed call of the float kernels: the states reset, then c->reps passes
 * in blocks of 16 keys, every head per block, each call prefetching the next
 * block's rows of its head (decode.c). */
static int kb_pass_float(void *ctx) {
    kb_case *c = ctx;
    const int64_t GD = (int64_t)KB_G * c->D;
    for (int h = 0; h < c->H; h++)
        for (int g = 0; g < KB_G; g++) c->m[h * KB_G + g] = -INFINITY, c->l[h * KB_G + g] = 0.0f;
    memset(c->acc, 0, (size_t)(c->H * GD) * sizeof(float));
    for (int rep = 0; rep < c->reps; rep++) {
        for (int64_t j = 0; j < c->L; j += 16) {
            const int64_t n = c->L - j < 16 ? c->L - j : 16;
            for (int h = 0; h < c->H; h++) {
                kvc_attn_rows r, nr;
                kb_rows(c, h, j, &r);
                if (j + n < c->L) {
                    kb_rows(c, h, j + n, &nr);
                    r.nk = nr.k, r.nv = nr.v, r.nks = nr.ks, r.nvs = nr.vs;
                    r.nn = c->L - j - n < 16 ? c->L - j - n : 16;
                }
                c->kk->attn_decode(c->q + h * GD, KB_G, c->D, c->D, &r, n, 0.0f, c->sc,
                                   c->m + h * KB_G, c->l + h * KB_G, c->acc + h * GD);
            }
        }
    }
    return 0;
}

/* The run of KV head h, keys [j, j + n) as amx_run takes it. */
static void kb_run(const kb_case *c, int h, int64_t j, int64_t n, kvc_amx_run *r) {
    kvc_attn_rows rows;
    kb_rows(c, h, j, &rows);
    r->k = rows.k, r->v = rows.v, r->ks = rows.ks, r->vs = rows.vs;
    r->n = (int)n;
}

/* A timed call of the AMX kernel: amx_begin per head set, then c->reps
 * passes in runs of 64 keys, every head per run, each call prefetching the
 * next call's rows (the next head's, or head 0's of the next keys), scale
 * rows only for the latter (chunk_amx); amx_end per head set. */
static int kb_pass_amx(void *ctx) {
    kb_case *c = ctx;
    const kvc_kernels *kk = c->kk;
    kvc_amx_keys *keys = c->keys;
    const int64_t GD = (int64_t)KB_G * c->D;
    keys->k_stride = keys->v_stride = c->H * c->rowb;
    keys->ks_stride = keys->vs_stride = c->srow;
    keys->ksd = keys->vsd = KVC_F16;
    kk->amx_tiles(1);
    for (int h = 0; h < c->H; h++)
        kk->amx_begin(c->st + h * c->sb, c->q + h * GD, KB_G, c->D, c->D, c->group, 0.0f,
                      c->sc, c->dt == KVC_I4 ? 4 : 8, c->qbits);
    for (int rep = 0; rep < c->reps; rep++) {
        for (int64_t j = 0; j < c->L; j += KB_RUN) {
            const int64_t n = c->L - j < KB_RUN ? c->L - j : KB_RUN;
            for (int h = 0; h < c->H; h++) {
                keys->nrun = 1;
                kb_run(c, h, j, n, &keys->run[0]);
                keys->nnext = 0;
                keys->pf_scales = 1;
                if (h + 1 < c->H) {
                    kb_run(c, h + 1, j, n, &keys->next[0]);
                    keys->nnext = 1;
                    keys->pf_scales = 0; /* the next head's scales share these lines */
                } else if (j + n < c->L) {
                    const int64_t nn = c->L - j - n < KB_RUN ? c->L - j - n : KB_RUN;
                    kb_run(c, 0, j + n, nn, &keys->next[0]);
                    keys->nnext = 1;
                }
                keys->pf_next = 1;
                keys->nrow = 0;
                kk->amx_run(c->st + h * c->sb, keys);
            }
        }
    }
    for (int h = 0; h < c->H; h++)
        kk->amx_end(c->st + h * c->sb, c->m + h * KB_G, c->l + h * KB_G, c->acc + h * GD, c->D);
    kk->amx_tiles(0);
    return 0;
}

/* max |o - o_ref| / max |o_ref| over every head set's normalized output of
 * the last pass, o_ref from the scalar table's attn_decode. */
static double kb_check(kb_case *c) {
    const int64_t GD = (int64_t)KB_G * c->D;
    const float *acc = c->acc, *l = c->l;
    const size_t fl = (size_t)(c->H * GD) * sizeof(float);
    float *racc = malloc(fl), *rm = malloc((size_t)c->H * KB_G * sizeof(float)),
          *rl = malloc((size_t)c->H * KB_G * sizeof(float));
    if (!racc || !rm || !rl) {
        free(racc), free(rm), free(rl);
        return INFINITY;
    }
    kb_case r = *c;
    r.kk = kvc__kernels_scalar();
    r.acc = racc, r.m = rm, r.l = rl;
    r.reps = 1; /* repeated keys leave the normalized output as it is */
    kb_pass_float(&r);
    double diff = 0.0, big = 0.0;
    for (int64_t i = 0; i < c->H * GD; i++) {
        const int64_t hg = i / c->D;
        const double o = l[hg] > 0.0f ? acc[i] / l[hg] : 0.0;
        const double ro = rl[hg] > 0.0f ? racc[i] / rl[hg] : 0.0;
        if (fabs(o - ro) > diff || isnan(o)) diff = isnan(o) ? INFINITY : fabs(o - ro);
        if (fabs(ro) > big) big = fabs(ro);
    }
    free(racc), free(rm), free(rl);
    return big > 0.0 ? diff / big : diff;
}

/* Random f16 bit patterns of |x| in [2^-4, 2^-1) with random signs. */
static uint16_t kb_f16(uint64_t *s) {
    *s = bench_mix64(*s);
    return (uint16_t)(0x2c00u + (unsigned)(*s % 0x0c00u) + ((*s >> 20) & 1u) * 0x8000u);
}

int bench_kernel(const bench_opts *o) {
    const int D = o->head_dim ? (int)o->head_dim : 128, H = o->heads ? (int)o->heads : 8;
    const int group = o->group == BENCH_GROUP_ROW ? D : o->group ? (int)o->group : 32;
    if (D % 16 != 0 || D > KVC_ATTN_MAX_DIM || D % group != 0 || group % 2 != 0 || H < 1 ||
        H > 64) {
        fprintf(stderr,
                "kvcache: bench kernel: head dim %d must be a multiple of 16 up to %d and of the "
                "quant group %d (even), heads 1-64\n",
                D, KVC_ATTN_MAX_DIM, group);
        return CLI_EXIT_USAGE;
    }
    static const int64_t lens_full[3] = {64, 512, 4096};
    int64_t one = o->kvlen;
    const int64_t *lens = o->kvlen ? &one : lens_full;
    const int n_lens = o->kvlen ? 1 : (o->quick ? 1 : 3);
    const int64_t Lmax = lens[n_lens - 1];
    const int ng = D / group;
    /* float16 K and V, int8 K and V at half, their scales: refused past the
     * limit before any allocation, as every target does (--kvlen 16777216
     * asked for 1 TiB) */
    const double need = 3.0 * (double)Lmax * H * D * 2 + 2.0 * (double)Lmax * H * ng * 2;
    if (need > (double)bench_mem_limit(o))
        return bench_refuse_size(o, "kernel", need, "--kvlen, --heads or --head-dim");
    const int64_t GD = (int64_t)KB_G * D;
    const size_t kvb = (size_t)(Lmax * H * D * 2), sb = (size_t)(Lmax * H * ng * 2);
    unsigned char *k16 = bench_alloc(kvb), *v16 = bench_alloc(kvb), *k8 = bench_alloc(kvb / 2),
                  *v8 = bench_alloc(kvb / 2), *ks = bench_alloc(sb), *vs = bench_alloc(sb);
    float *q = bench_alloc((size_t)(H * GD) * sizeof(float));
    float *m = bench_alloc((size_t)H * KB_G * sizeof(float)),
          *l = bench_alloc((size_t)H * KB_G * sizeof(float)),
          *acc = bench_alloc((size_t)(H * GD) * sizeof(float));
    const kvc_kernels *kk = kvc__kernels();
    const size_t stb =
        kk->amx_state_bytes ? (kk->amx_state_bytes(D, group) + 63) & ~(size_t)63 : 0;
    unsigned char *st = stb ? bench_alloc(stb * (size_t)H) : NULL;
    kvc_amx_keys *keys = bench_alloc(sizeof *keys);
    int rc = 0;
    if (!k16 || !v16 || !k8 || !v8 || !ks || !vs || !q || !m || !l || !acc || !keys ||
        (stb && !st)) {
        fprintf(stderr, "kvcache: bench kernel: out of memory\n");
        rc = 1;
        goto done;
    }
    uint64_t s = 0x6b65726e656cull;
    for (size_t i = 0; i < kvb / 2; i++) {
        ((uint16_t *)k16)[i] = kb_f16(&s);
        ((uint16_t *)v16)[i] = kb_f16(&s);
        s = bench_mix64(s);
        k8[i] = (unsigned char)s; /* int8 values, or two int4 nibbles */
        v8[i] = (unsigned char)(s >> 8);
    }
    for (size_t i = 0; i < sb / 2; i++) {
        s = bench_mix64(s);
        ((uint16_t *)ks)[i] = (uint16_t)(0x1c00u + s % 0x0400u); /* ~2^-8 .. 2^-7 */
        ((uint16_t *)vs)[i] = (uint16_t)(0x1c00u + (s >> 16) % 0x0400u);
    }
    for (int64_t i = 0; i < H * GD; i++) {
        s = bench_mix64(s);
        q[i] = (float)((double)(s >> 11) / 9007199254740992.0 - 0.5) * 0.3f;
    }
    bench_print_machine(o, "kernel", stdout);
    if (!o->json) {
        printf("# decode kernels alone (isa %s), one thread: %d KV heads x %d query heads, Dh "
               "%d, NHD rows of L keys, calls in the driver's order; int8/int4 group %d, "
               "float16 scales. ns per 16 keys and head set; x f16: float16 time / this "
               "time at the same L, same run; amx q16/q32: the query in 16 bits (flat float16 "
               "queries) or 32 (float32)\n",
               kvc_isa_name(kk->isa), H, KB_G, D, group);
        printf("%6s %-5s %-8s %12s %8s %10s\n", "L", "cache", "kernel", "ns/16 keys", "x f16",
               "max diff");
    }
    int cases = 0, failed = 0;
    static const kvc_dtype dts[4] = {KVC_F16, KVC_I8, KVC_I4, KVC_I8};
    static const char *const names[4] = {"f16", "int8", "int4", "int8"};
    static const unsigned bits[4] = {BENCH_CACHE_F16, BENCH_CACHE_INT8, BENCH_CACHE_INT4,
                                     BENCH_CACHE_INT8};
    const unsigned caches = o->caches ? o->caches | BENCH_CACHE_F16 : BENCH_CACHE_ALL;
    for (int li = 0; li < n_lens; li++) {
        double t16 = 0.0;
        for (int di = 0; di < 4; di++) {
            if (!(caches & bits[di])) continue;
            if (di == 3 && !kvc__amx_decode_ok(kk, KVC_I8, D, group)) continue;
            kb_case c;
            memset(&c, 0, sizeof c);
            c.kk = kk, c.dt = dts[di], c.D = D, c.H = H, c.group = group, c.L = lens[li];
            c.rowb = c.dt == KVC_F16 ? 2 * D : c.dt == KVC_I8 ? D : D / 2;
            c.srow = (int64_t)H * ng * 2;
            c.k = c.dt == KVC_F16 ? k16 : k8, c.v = c.dt == KVC_F16 ? v16 : v8;
            c.ks = ks, c.vs = vs, c.q = q, c.m = m, c.l = l, c.acc = acc;
            c.st = st, c.sb = stb, c.keys = keys;
            c.amx = kvc__amx_decode_ok(kk, c.dt, D, group);
            c.qbits = di == 3 ? 32 : 16;
            c.reps = c.L >= 4096 ? 1 : (int)(4096 / c.L); /* set-up over 4096+ keys */
            c.sc = (float)(1.4426950408889634 / sqrt((double)D));
            bench_timing t;
            if (bench_time(c.amx ? kb_pass_amx : kb_pass_float, &c, o->time_s, &t) != 0) {
                rc = 1;
                goto done;
            }
            const double blocks = (double)c.reps * (double)((c.L + 15) / 16) * H;
            const double ns = t.median_s * 1e9 / blocks;
            if (c.dt == KVC_F16) t16 = ns;
            const double diff = c.dt == KVC_F16 ? 0.0 : kb_check(&c);
            const int bad = !(diff <= 1e-4);
            cases++;
            failed += bad;
            const char *kname = !c.amx ? "float" : c.qbits == 16 ? "amx q16" : "amx q32";
            if (o->json)
                printf("{\"type\":\"case\",\"target\":\"kernel\",\"isa\":\"%s\",\"L\":%lld,"
                       "\"cache\":\"%s\",\"kernel\":\"%s\",\"ns_per_16_keys\":%.1f,"
                       "\"vs_f16\":%.3f,\"max_diff\":%.3g,\"ok\":%s}\n",
                       kvc_isa_name(kk->isa), (long long)c.L, names[di], kname, ns,
                       t16 > 0.0 ? t16 / ns : 0.0, diff, bad ? "false" : "true");
            else
                printf("%6lld %-5s %-8s %12.1f %7.2fx %10.2g%s\n", (long long)c.L, names[di],
                       kname, ns, t16 > 0.0 ? t16 / ns : 0.0, diff, bad ? " WRONG" : "");
            bench_flush("kernel");
        }
    }
    if (o->json)
        printf("{\"type\":\"summary\",\"target\":\"kernel\",\"cases\":%d,\"failed\":%d}\n", cases,
               failed);
    else
        printf("# %d cases, %d failed\n", cases, failed);
    if (failed) rc = 1;
done:
    bench_free(k16), bench_free(v16), bench_free(k8), bench_free(v8), bench_free(ks);
    bench_free(vs), bench_free(q), bench_free(m), bench_free(l), bench_free(acc);
    bench_free(st), bench_free(keys);
    return rc;
}
