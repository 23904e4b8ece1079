/*
 * `kvcache bench cache`: the cache manager's bookkeeping (kvcache/cache.h).
 *
 *   ops       add_sequence (512-token prompt, no hit), append of 1 token,
 *             fork, free_sequence: operations per second
 *   lookup    add_sequence of a 2048-token prompt whose pages are all cached:
 *             prefix tokens found per second
 *   trace     a synthetic serving trace: requests with prompts of 64..1024
 *             tokens (half of them starting with one of 8 shared 256-token
 *             system prompts), outputs of 16..512 tokens (max_new_tokens
 *             512), up to 64 running at once; every step appends one token
 *             to each running request. Reports the fraction of allocated KV
 *             slots that hold live tokens (paged, averaged over steps),
 *             against reserving prompt + max_new_tokens per request up front
 *             (goal >= 0.96), and the prefix hit rate.
 *   decode    bookkeeping of one decode step for B = 64 sequences of ~1024
 *             tokens: append 1 token to each + the batch's CSR page table;
 *             compared with the time to read that batch's K/V once (a
 *             32-layer, 8-head, Dh 128, float16 model: 128 KiB per token) at
 *             the read bandwidth measured in the same run (goal < 1%).
 * Bookkeeping does not depend on the storage size, so the caches here use a
 * tiny head (H 1, Dh 8) to keep memory small.
 */
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "cli.h"
#include "kvcache/kvcache.h"

#define BC_PS 16

static kvc_cache *bc_create(int64_t pages) {
    kvc_cache_params p = kvc_cache_default_params();
    p.num_layers = 1;
    p.num_kv_heads = 1;
    p.head_dim = 8;
    p.page_size = BC_PS;
    p.num_pages = pages;
    kvc_cache *c = NULL;
    if (kvc_cache_create(&p, &c) != KVC_OK) {
        fprintf(stderr, "kvcache: bench cache: create: %s\n", kvc_last_error());
        return NULL;
    }
    return c;
}

static uint64_t bc_rng(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#define FAIL_IF(cond, what)                                                                        \
    do {                                                                                           \
        if (cond) {                                                                                \
            fprintf(stderr, "kvcache: bench cache: %s: %s\n", what, kvc_last_error());             \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

static void row(const bench_opts *o, const char *name, double value, const char *unit,
                const char *note) {
    if (o->json) {
        printf("{\"type\":\"case\",\"target\":\"cache\",\"case\":");
        bench_json_str(stdout, name);
        printf(",\"value\":%.6g,\"unit\":", value);
        bench_json_str(stdout, unit);
        printf(",\"note\":");
        bench_json_str(stdout, note ? note : "");
        printf("}\n");
    } else {
        printf("%-34s %14.4g %-12s %s\n", name, value, unit, note ? note : "");
    }
}

int bench_cache(const bench_opts *o) {
    const int quick = o->quick;
    int rc = 1;
    kvc_cache *c = NULL;
    int32_t *toks = NULL, *idx = NULL, *indptr = NULL, *last = NULL;
    kvc_seq_id *ids = NULL;
    bench_membw_ctx *mb = NULL;
    uint64_t rng = 42;
    const int64_t n_ops = quick ? 2000 : 100000;
    bench_print_machine(o, "cache", stdout);
    if (!o->json) printf("%-34s %14s %-12s %s\n", "case", "value", "unit", "note");
    toks = malloc(4096 * sizeof *toks);
    ids = malloc((size_t)n_ops * sizeof *ids);
    idx = malloc(65536 * sizeof *idx);
    indptr = malloc(1025 * sizeof *indptr);
    last = malloc(1024 * sizeof *last);
    FAIL_IF(!toks || !ids || !idx || !indptr || !last, "malloc");

    /* ---- ops ---- */
    {
        const int64_t n_add = quick ? 200 : 4000;
        c = bc_create(n_add * 33 + 64);
        FAIL_IF(!c, "create");
        double t0 = bench_now();
        for (int64_t i = 0; i < n_add; i++) {
            for (int j = 0; j < 512; j++) toks[j] = (int32_t)(i * 512 + j);
            FAIL_IF(kvc_cache_add_sequence(c, toks, 512, 0, &ids[i], NULL) != KVC_OK, "add");
        }
        double t1 = bench_now();
        for (int64_t k = 0; k < 16; k++)
            for (int64_t i = 0; i < n_add; i++) {
                int32_t t = (int32_t)k;
                FAIL_IF(kvc_cache_append(c, ids[i], &t, 1, NULL) != KVC_OK, "append");
            }
        double t2 = bench_now();
        for (int64_t i = 0; i < n_add; i++)
            FAIL_IF(kvc_cache_fork(c, ids[i], &ids[n_add + i]) != KVC_OK, "fork");
        double t3 = bench_now();
        for (int64_t i = 0; i < 2 * n_add; i++)
            FAIL_IF(kvc_cache_free_sequence(c, ids[i]) != KVC_OK, "free");
        double t4 = bench_now();
        row(o, "add_sequence (512 tokens, miss)", n_add / (t1 - t0), "ops/s", NULL);
        row(o, "append (1 token)", 16.0 * n_add / (t2 - t1), "ops/s", NULL);
        row(o, "fork (33 pages)", n_add / (t3 - t2), "ops/s", NULL);
        row(o, "free_sequence (33 pages)", 2.0 * n_add / (t4 - t3), "ops/s", NULL);
        FAIL_IF(kvc_cache_check(c) != KVC_OK, "check");
        kvc_cache_destroy(c);
        c = NULL;
    }

    /* ---- prefix lookup ---- */
    {
        c = bc_create(1024);
        FAIL_IF(!c, "create");
        for (int j = 0; j < 2049; j++) toks[j] = (int32_t)(bc_rng(&rng) % 32000);
        kvc_seq_id s;
        int64_t hit = 0, found = 0;
        FAIL_IF(kvc_cache_add_sequence(c, toks, 2049, 0, &s, &hit) != KVC_OK, "add");
        FAIL_IF(kvc_cache_free_sequence(c, s) != KVC_OK, "free");
        const int64_t reps = quick ? 200 : 5000;
        double t0 = bench_now();
        for (int64_t i = 0; i < reps; i++) {
            FAIL_IF(kvc_cache_add_sequence(c, toks, 2049, 0, &s, &hit) != KVC_OK, "add");
            found += hit;
            FAIL_IF(kvc_cache_free_sequence(c, s) != KVC_OK, "free");
        }
        double t1 = bench_now();
        FAIL_IF(found != reps * 2048, "lookup hit length");
        row(o, "prefix lookup (2048 cached)", (double)found / (t1 - t0), "tokens/s",
            "add+free of a fully cached prompt");
        kvc_cache_destroy(c);
        c = NULL;
    }

    /* ---- trace ---- */
    {
        const int64_t n_req = quick ? 300 : 5000, max_run = 64, max_new = 512;
        const int64_t pages = max_run * (1024 + max_new) / BC_PS + 64;
        c = bc_create(pages);
        FAIL_IF(!c, "create");
        int32_t sys[8][256];
        for (int g = 0; g < 8; g++)
            for (int j = 0; j < 256; j++) sys[g][j] = (int32_t)(bc_rng(&rng) % 32000);
        kvc_seq_id run[64];
        int64_t len[64], remain[64], plen[64];
        int n_run = 0;
        int64_t next = 0, done = 0, steps = 0;
        double util_sum = 0, reserve_sum = 0, share_sum = 0;
        int64_t pending_prompt = 0, pending_out = 0;
        int have_pending = 0;
        while (done < n_req) {
            /* admit */
            while (n_run < max_run && next < n_req) {
                if (!have_pending) {
                    pending_prompt = 64 + (int64_t)(bc_rng(&rng) % 961);
                    pending_out = 16 + (int64_t)(bc_rng(&rng) % 497);
                    int shared = bc_rng(&rng) % 2 == 0;
                    int g = (int)(bc_rng(&rng) % 8);
                    for (int64_t j = 0; j < pending_prompt; j++)
                        toks[j] = shared && j < 256 ? sys[g][j] : (int32_t)(bc_rng(&rng) % 32000);
                    have_pending = 1;
                }
                kvc_seq_id s;
                kvc_status st = kvc_cache_add_sequence(c, toks, pending_prompt, 0, &s, NULL);
                if (st == KVC_ERR_NO_SPACE) break;
                FAIL_IF(st != KVC_OK, "trace add");
                have_pending = 0;
                run[n_run] = s;
                len[n_run] = plen[n_run] = pending_prompt;
                remain[n_run] = pending_out;
                n_run++;
                next++;
            }
            /* decode step */
            for (int i = 0; i < n_run; i++) {
                int32_t t = (int32_t)(bc_rng(&rng) % 32000);
                kvc_status st = kvc_cache_append(c, run[i], &t, 1, NULL);
                if (st == KVC_ERR_NO_SPACE) continue; /* preemption is out of scope */
                FAIL_IF(st != KVC_OK, "trace append");
                len[i]++;
                remain[i]--;
            }
            /* measure */
            kvc_cache_stats cs;
            kvc_cache_get_stats(c, &cs);
            int64_t live = 0, unfilled = 0, reserved = 0;
            for (int i = 0; i < n_run; i++) {
                live += len[i];
                unfilled += (BC_PS - len[i] % BC_PS) % BC_PS;
                reserved += plen[i] + max_new;
            }
            if (cs.used_pages > 0 && n_run > 0) {
                double alloc = (double)cs.used_pages * BC_PS;
                util_sum += (alloc - (double)unfilled) / alloc;
                share_sum += (double)live / alloc;
                reserve_sum += (double)live / (double)reserved;
                steps++;
            }
            /* finish */
            for (int i = 0; i < n_run;) {
                if (remain[i] <= 0) {
                    FAIL_IF(kvc_cache_free_sequence(c, run[i]) != KVC_OK, "trace free");
                    n_run--;
                    run[i] = run[n_run];
                    len[i] = len[n_run];
                    remain[i] = remain[n_run];
                    plen[i] = plen[n_run];
                    done++;
                } else {
                    i++;
                }
            }
        }
        kvc_cache_stats cs;
        kvc_cache_get_stats(c, &cs);
        FAIL_IF(kvc_cache_check(c) != KVC_OK, "check");
        row(o, "trace: live / allocated slots", util_sum / (double)steps, "fraction",
            util_sum / (double)steps >= 0.96 ? "goal >= 0.96: met" : "goal >= 0.96: MISSED");
        row(o, "trace: live / reserved (max len)", reserve_sum / (double)steps, "fraction",
            "reserving prompt + max_new_tokens");
        row(o, "trace: token slots per page slot", share_sum / (double)steps, "ratio",
            "> 1 from shared prefix pages");
        row(o, "trace: prefix hit rate", (double)cs.hit_tokens /
            (double)(cs.hit_tokens + cs.miss_tokens), "fraction", NULL);
        kvc_cache_destroy(c);
        c = NULL;
    }

    /* ---- decode-step bookkeeping ---- */
    {
        const int B = 64;
        const int64_t L0 = 1024, steps = quick ? 64 : 1024;
        c = bc_create(B * (L0 + steps) / BC_PS + B * 2);
        FAIL_IF(!c, "create");
        for (int b = 0; b < B; b++) {
            for (int64_t j = 0; j < L0; j++) toks[j] = (int32_t)(bc_rng(&rng) % 32000);
            FAIL_IF(kvc_cache_add_sequence(c, toks, L0, 0, &ids[b], NULL) != KVC_OK, "add");
        }
        double best = 1e30, total = 0;
        int64_t n_idx = 0;
        for (int64_t s = 0; s < steps; s++) {
            double t0 = bench_now();
            for (int b = 0; b < B; b++) {
                int32_t t = (int32_t)(s + b);
                FAIL_IF(kvc_cache_append(c, ids[b], &t, 1, NULL) != KVC_OK, "append");
            }
            FAIL_IF(kvc_cache_page_table(c, ids, B, indptr, idx, 65536, last, &n_idx) != KVC_OK,
                    "page table");
            double dt = bench_now() - t0;
            total += dt;
            if (dt < best) best = dt;
        }
        double per_step = total / (double)steps;
        bench_sink((uint64_t)n_idx);
        /* decode-step estimate: read the batch's K/V once */
        mb = bench_membw_create(o->membw_bytes);
        FAIL_IF(!mb, "membw");
        bench_membw bw;
        FAIL_IF(bench_membw_measure(mb, o->threads[0] > 0 ? o->threads[0] : 1,
                                    quick ? 0.05 : 0.5, 1, &bw) != 0,
                "membw");
        /* the sequences grow from L0 to L0 + steps: their mean length */
        double bytes = (double)B * (double)(L0 + steps / 2) * 131072.0;
        double read_gbs = bw.read_gbs > 0 ? bw.read_gbs : bw.copy_gbs / 2;
        double step_s = bytes / (read_gbs * 1e9);
        char note[160];
        snprintf(note, sizeof note, "append x%d + page table; best %.2f us", B, best * 1e6);
        row(o, "decode bookkeeping (B=64)", per_step * 1e6, "us/step", note);
        snprintf(note, sizeof note, "%.1f GB/s read, %d thread(s), 128 KiB/token", read_gbs,
                 bw.threads);
        row(o, "decode step estimate (K/V read)", step_s * 1e6, "us/step", note);
        row(o, "bookkeeping / decode step", per_step / step_s, "fraction",
            per_step / step_s < 0.01 ? "goal < 0.01: met" : "goal < 0.01: MISSED");
        FAIL_IF(kvc_cache_check(c) != KVC_OK, "check");
    }
    rc = 0;
fail:
    bench_membw_destroy(mb);
    kvc_cache_destroy(c);
    free(toks);
    free(ids);
    free(idx);
    free(indptr);
    free(last);
    return rc;
}
