/*
 * Continuous-batching engine (model.h), vLLM-style on kvcache's cache
 * manager.
 *
 * A request holds its tokens (prompt, then generated ones) and how many of
 * them have K/V in the cache (n_done) and reserved slots (n_resv). Each step:
 *   1. decode: every running request whose tokens are all computed but the
 *      last gets one row (reserving one slot); when pages run out, the most
 *      recently admitted request is preempted (sequence freed, its full
 *      pages stay in the prefix cache, requeued at the front, n_done = 0);
 *   2. prompt chunks: running requests still in their prompt get the rest of
 *      the step's row budget, in admission order;
 *   3. admission: queued requests in order, while rows and pages last. A
 *      probe of the prefix cache first (kvc_cache_lookup_prefix) tells how
 *      many tokens are already cached, so only hit + chunk slots are reserved.
 * Slots are reserved only for rows computed in the same step, so a page is
 * in the prefix index only once a step writes its K/V (another request can
 * hit it in that same step: every layer appends all K/V before attending);
 * a request preempted after reserving in the step is rolled back first
 * (drop_seq, kvc_cache_rollback).
 * The row at a request's last token gives logits, sampled into a new token.
 * A step that fails (forward or sampling) commits nothing but its
 * preemptions: requests it admitted go back to the queue, the others are
 * rolled back to their computed tokens and will redo the rows (fail_step).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, isatty */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvcache/model.h"
#include "../core/internal.h"
#include "../model/model_internal.h"

typedef struct req {
    int64_t id;
    int32_t *tok;
    int64_t n_tok, cap, n_prompt;
    int32_t max_new, n_gen, ignore_eos;
    int32_t admitted_once; /* its prompt is counted in the stats */
    int64_t counted_at;    /* the admission that counted it, and its cached tokens */
    int64_t counted_cached;
    int64_t counted_ext;   /* and those it restored (external_tokens) and missed there */
    int64_t counted_miss;
    kvc_sampling_params sp;
    uint64_t rng;
    kvc_seq_id seq; /* -1 when not admitted */
    int64_t n_done, n_resv;
    int64_t n_final; /* tokens of its pages reported final to the connector */
    void *load;        /* the connector's load of its prompt pages, while queued */
    int64_t load_first; /* the load's first page */
    int64_t load_n;     /* and the most pages it may give */
    int probed;        /* the connector had nothing to load for it */
    int64_t admit; /* admission counter, for picking preemption victims */
} req;

struct kvc_engine {
    const kvc_model *m;
    kvc_engine_params p;
    kvc_cache *cache;
    kvc_model_ctx *ctx;
    int32_t n_vocab;
    req **wait;    /* queue, front at 0 */
    int64_t n_wait, cap_wait;
    req **run;     /* admission order */
    int64_t n_run, cap_run;
    int64_t next_id, admit_counter;
    kvc_engine_stats st;
    /* step scratch */
    kvc_seq_id *b_seq;
    int64_t *b_pos0, *b_n, *b_dec;
    req **b_req;
    int32_t *b_tok;
    uint8_t *b_want;
    int32_t *b_new;  /* sampled token per batch entry, committed once all are drawn */
    uint64_t *b_rng; /* the entry's generator state after its draw */
    float *logits;
    int64_t cap_b, cap_rows;
    /* external KV (kvc_engine_set_connector) */
    kvc_engine_connector conn;
    int has_conn;
    int32_t unit;  /* prefix unit in tokens: page_size, or lcm(page, K group) */
    int32_t *pg;   /* page ids of one sequence */
    int64_t cap_pg;
};

kvc_engine_params kvc_engine_default_params(void) {
    kvc_engine_params p;
    memset(&p, 0, sizeof p);
    p.n_threads = 1;
    p.kv_dtype = KVC_F16;
    p.quant_group = 8;
    p.page_size = 16;
    p.kv_capacity_tokens = 16384;
    p.max_step_tokens = 512;
    p.max_running = 64;
    p.enable_prefix_caching = 1;
    return p;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void req_free(req *r) {
    if (!r) return;
    free(r->tok);
    free(r);
}

/* Releases r's load, if any, without using it. */
static void drop_load(kvc_engine *e, req *r) {
    if (r->load) e->conn.load_finish(e->conn.user, r->load, NULL, 0, NULL, 0);
    r->load = NULL;
    r->probed = 0;
}

void kvc_engine_destroy(kvc_engine *e) {
    if (!e) return;
    for (int64_t i = 0; i < e->n_wait; i++) drop_load(e, e->wait[i]);
    for (int64_t i = 0; i < e->n_wait; i++) req_free(e->wait[i]);
    for (int64_t i = 0; i < e->n_run; i++) req_free(e->run[i]);
    free(e->wait);
    free(e->run);
    free(e->b_seq);
    free(e->b_pos0);
    free(e->b_n);
    free(e->b_dec);
    free(e->b_req);
    free(e->b_tok);
    free(e->b_want);
    free(e->b_new);
    free(e->b_rng);
    free(e->logits);
    free(e->pg);
    kvc_model_ctx_destroy(e->ctx);
    kvc_cache_destroy(e->cache);
    free(e);
}

kvc_status kvc_engine_create(const kvc_model *m, const kvc_engine_params *params,
                             kvc_engine **out) {
    static const char fn[] = "kvc_engine_create";
    if (out) *out = NULL; /* what a failure leaves */
    KVC_CHECK(m != NULL && out != NULL, "%s: model and out must not be NULL", fn);
    kvc_engine_params p = params ? *params : kvc_engine_default_params();
    /* here, so that the message names this function rather than kvc_model_ctx_create */
    KVC_CHECK(p.n_threads >= 1 && p.n_threads <= 1024, "%s: n_threads %d must be in [1, 1024]",
              fn, (int)p.n_threads);
    KVC_CHECK(p.max_step_tokens >= 1 && p.max_running >= 1 && p.page_size >= 1 &&
                  p.kv_capacity_tokens >= 1,
              "%s: max_step_tokens, max_running, page_size and kv_capacity_tokens must be >= 1",
              fn);
    /* every row of a step goes into the cache: more than it holds never runs, and the
     * step's buffers are sized from this (INT32_MAX reserved gigabytes per step) */
    if (p.max_step_tokens > p.kv_capacity_tokens) p.max_step_tokens = (int32_t)p.kv_capacity_tokens;
    kvc_model_info in;
    KVC_TRY(kvc_model_get_info(m, &in));
    kvc_cache_params cp = kvc_model_cache_params(m, p.kv_dtype, p.kv_capacity_tokens);
    cp.page_size = p.page_size;
    cp.num_pages = p.kv_capacity_tokens / p.page_size +
                   (p.kv_capacity_tokens % p.page_size > 0); /* ceil, no overflow */
    cp.quant_group = p.quant_group;
    cp.enable_prefix_caching = p.enable_prefix_caching != 0;
    cp.kv_format = p.kv_format;
    kvc_engine *e = calloc(1, sizeof *e);
    if (!e) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    e->m = m;
    e->p = p;
    e->n_vocab = in.n_vocab;
    kvc_status st = kvc_cache_create(&cp, &e->cache);
    if (st == KVC_OK) st = kvc_model_ctx_create(m, p.n_threads, &e->ctx);
    if (st != KVC_OK) {
        kvc_engine_destroy(e);
        return st;
    }
    e->unit = p.page_size;
    kvc_kvfmt f;
    if (p.kv_format != KVC_KVFMT_NONE && kvc_cache_kvfmt(e->cache, &f) == KVC_OK &&
        f.group > e->unit)
        e->unit = f.group; /* G and P divide one another */
    e->st.kv_bytes_per_token = (int64_t)kvc_cache_bytes_per_token(e->cache);
    e->st.kv_capacity_tokens = kvc_cache_capacity_tokens(e->cache);
    *out = e;
    return KVC_OK;
}

static int push(req ***arr, int64_t *n, int64_t *cap, req *r, int front) {
    if (*n == *cap) {
        int64_t nc = *cap ? 2 * *cap : 16;
        req **q = realloc(*arr, (size_t)nc * sizeof(req *));
        if (!q) return 0;
        *arr = q;
        *cap = nc;
    }
    if (front) {
        memmove(*arr + 1, *arr, (size_t)*n * sizeof(req *));
        (*arr)[0] = r;
    } else {
        (*arr)[*n] = r;
    }
    (*n)++;
    return 1;
}

static void remove_at(req **arr, int64_t *n, int64_t i) {
    memmove(arr + i, arr + i + 1, (size_t)(*n - i - 1) * sizeof(req *));
    (*n)--;
}

kvc_status kvc_engine_add_request(kvc_engine *e, const int32_t *prompt, int64_t n_prompt,
                                  int32_t max_new_tokens, const kvc_sampling_params *sampling,
                                  int32_t ignore_eos, int64_t *request_id) {
    static const char fn[] = "kvc_engine_add_request";
    KVC_CHECK(e != NULL && prompt != NULL && request_id != NULL,
              "%s: engine, prompt and request_id must not be NULL", fn);
    KVC_CHECK(n_prompt >= 1, "%s: the prompt needs at least one token", fn);
    KVC_CHECK(max_new_tokens >= 1, "%s: max_new_tokens %d must be >= 1", fn, (int)max_new_tokens);
    KVC_TRY(kvc__model_check_ctx(e->m, fn, "prompt + max_new_tokens is", /* no overflow */
                                 n_prompt > INT32_MAX ? n_prompt : n_prompt + max_new_tokens));
    const int64_t cap = kvc_cache_capacity_tokens(e->cache);
    KVC_CHECK(n_prompt <= cap - max_new_tokens,
              "%s: prompt (%lld) + max_new_tokens (%d) exceeds the cache capacity of %lld tokens",
              fn, (long long)n_prompt, (int)max_new_tokens, (long long)cap);
    for (int64_t i = 0; i < n_prompt; i++)
        KVC_CHECK(prompt[i] >= 0 && prompt[i] < e->n_vocab, "%s: token %d at %lld outside "
                  "[0, %d)", fn, (int)prompt[i], (long long)i, (int)e->n_vocab);
    kvc_sampling_params sp = sampling ? *sampling : kvc_sampling_default_params();
    KVC_CHECK(isfinite(sp.temperature) && sp.temperature >= 0.0f && sp.top_k >= 0 &&
                  sp.top_p > 0.0f && sp.top_p <= 1.0f,
              "%s: bad sampling parameters (temperature %g, top_k %d, top_p %g: need a finite "
              "temperature >= 0, top_k >= 0, 0 < top_p <= 1)", fn, (double)sp.temperature,
              (int)sp.top_k, (double)sp.top_p);
    req *r = calloc(1, sizeof *r);
    if (!r) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    r->cap = n_prompt + max_new_tokens;
    r->tok = malloc((size_t)r->cap * sizeof(int32_t));
    if (!r->tok || !push(&e->wait, &e->n_wait, &e->cap_wait, r, 0)) {
        req_free(r);
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    }
    memcpy(r->tok, prompt, (size_t)n_prompt * sizeof(int32_t));
    r->n_tok = r->n_prompt = n_prompt;
    r->max_new = max_new_tokens;
    r->ignore_eos = ignore_eos != 0;
    r->sp = sp;
    r->rng = sp.seed;
    r->seq = -1;
    r->id = e->next_id++;
    *request_id = r->id;
    return KVC_OK;
}

static void drop_seq(kvc_engine *e, req *r) {
    /* slots reserved this step but not computed (a request preempted after
     * its decode row was reserved): their pages must not stay findable */
    if (r->seq >= 0 && r->n_resv > r->n_done) kvc_cache_rollback(e->cache, r->seq, r->n_done);
    if (r->seq >= 0) kvc_cache_free_sequence(e->cache, r->seq);
    r->seq = -1;
    r->n_done = r->n_resv = 0;
}

kvc_status kvc_engine_cancel(kvc_engine *e, int64_t id) {
    KVC_CHECK(e != NULL, "kvc_engine_cancel: engine is NULL");
    for (int64_t i = 0; i < e->n_wait; i++)
        if (e->wait[i]->id == id) {
            req *r = e->wait[i];
            drop_load(e, r);
            remove_at(e->wait, &e->n_wait, i);
            req_free(r);
            return KVC_OK;
        }
    for (int64_t i = 0; i < e->n_run; i++)
        if (e->run[i]->id == id) {
            req *r = e->run[i];
            drop_seq(e, r);
            remove_at(e->run, &e->n_run, i);
            req_free(r);
            return KVC_OK;
        }
    return kvc__error(KVC_ERR_NOT_FOUND, "kvc_engine_cancel: no pending request %lld",
                      (long long)id);
}

int64_t kvc_engine_pending(const kvc_engine *e) { return e ? e->n_wait + e->n_run : 0; }

kvc_status kvc_engine_get_stats(const kvc_engine *e, kvc_engine_stats *out) {
    KVC_CHECK(e != NULL && out != NULL, "kvc_engine_get_stats: engine and out must not be NULL");
    *out = e->st;
    return KVC_OK;
}

const kvc_cache *kvc_engine_cache(const kvc_engine *e) { return e ? e->cache : NULL; }

static void evict_trampoline(void *user, const kvc_cache *cache, int32_t page) {
    const kvc_engine *e = user;
    e->conn.on_evict(e->conn.user, cache, page);
}

kvc_status kvc_engine_set_connector(kvc_engine *e, const kvc_engine_connector *c) {
    static const char fn[] = "kvc_engine_set_connector";
    KVC_CHECK(e != NULL, "%s: engine is NULL", fn);
    KVC_CHECK(!c || (c->probe && c->load_start && c->load_poll && c->load_finish),
              "%s: probe, load_start, load_poll and load_finish must be set", fn);
    if (!c) {
        for (int64_t i = 0; i < e->n_wait; i++) drop_load(e, e->wait[i]);
        e->has_conn = 0;
        memset(&e->conn, 0, sizeof e->conn);
        return kvc_cache_set_evict_hook(e->cache, NULL, NULL);
    }
    KVC_CHECK(e->p.enable_prefix_caching, "%s: needs prefix caching (enable_prefix_caching)", fn);
    kvc_kvfmt f;
    KVC_CHECK(e->p.kv_format == KVC_KVFMT_NONE ||
                  (kvc_cache_kvfmt(e->cache, &f) == KVC_OK && f.window == 0),
              "%s: a compressed format with a float16 window cannot be restored exactly", fn);
    for (int64_t i = 0; i < e->n_wait; i++) drop_load(e, e->wait[i]); /* the old connector's */
    e->conn = *c;
    e->has_conn = 1;
    return kvc_cache_set_evict_hook(e->cache, c->on_evict ? evict_trampoline : NULL, e);
}

kvc_status kvc_engine_get_connector(const kvc_engine *e, kvc_engine_connector *out) {
    KVC_CHECK(e != NULL && out != NULL, "kvc_engine_get_connector: engine and out must not be "
              "NULL");
    if (e->has_conn)
        *out = e->conn;
    else
        memset(out, 0, sizeof *out);
    return KVC_OK;
}

/* Page ids of seq into e->pg; their count, or -1 (message set). */
static int64_t seq_pages(kvc_engine *e, kvc_seq_id seq) {
    int32_t indptr[2], last;
    int64_t n = 0;
    kvc_status st = kvc_cache_page_table(e->cache, &seq, 1, indptr, e->pg, e->cap_pg, &last, &n);
    if (st == KVC_ERR_INVALID_ARG && n > e->cap_pg) {
        kvc_clear_error();
        int32_t *q = realloc(e->pg, (size_t)(n + 64) * sizeof(int32_t));
        if (!q) {
            kvc__error(KVC_ERR_NOMEM, "kvc_engine_step: out of memory");
            return -1;
        }
        e->pg = q;
        e->cap_pg = n + 64;
        st = kvc_cache_page_table(e->cache, &seq, 1, indptr, e->pg, e->cap_pg, &last, &n);
    }
    return st == KVC_OK ? n : -1;
}

/* Pages of r the connector has not seen final yet and now are: whole
 * prefix units of its computed tokens. */
static void report_final(kvc_engine *e, req *r) {
    const int64_t fin = r->n_done / e->unit * e->unit, P = e->p.page_size;
    if (!e->has_conn || !e->conn.on_final || fin <= r->n_final) return;
    if (seq_pages(e, r->seq) < fin / P) {
        kvc_clear_error(); /* out of memory: these pages go unsaved (a later miss) */
        return;
    }
    e->conn.on_final(e->conn.user, e->cache, r->tok, r->n_final / P, (fin - r->n_final) / P,
                     e->pg + r->n_final / P);
    r->n_final = fin;
}

/* Preempts the most recently admitted running request: its sequence is
 * freed (full pages stay in the prefix cache) and it goes back to the front
 * of the queue. Returns 0 if that request is `self` (nothing done), 1 if
 * another one was preempted, -1 if none is running, -2 out of memory. */
static int preempt_newest(kvc_engine *e, const req *self) {
    int64_t vi = -1;
    for (int64_t i = 0; i < e->n_run; i++)
        if (vi < 0 || e->run[i]->admit > e->run[vi]->admit) vi = i;
    if (vi < 0) return -1;
    req *v = e->run[vi];
    if (v == self) return 0;
    if (!push(&e->wait, &e->n_wait, &e->cap_wait, v, 1)) return -2; /* first: v is never lost */
    drop_seq(e, v);
    remove_at(e->run, &e->n_run, vi);
    e->st.preemptions++;
    return 1;
}

/* Reserves slots up to `upto` tokens of r (admitted), preempting newer
 * requests while pages run out. KVC_ERR_NO_SPACE (status only, no message)
 * when r itself is the newest and still does not fit. */
static kvc_status reserve(kvc_engine *e, req *r, int64_t upto) {
    while (r->n_resv < upto) {
        kvc_status st = kvc_cache_append(e->cache, r->seq, r->tok + r->n_resv, upto - r->n_resv,
                                         NULL);
        if (st == KVC_OK) {
            r->n_resv = upto;
            return KVC_OK;
        }
        if (st != KVC_ERR_NO_SPACE) return st;
        kvc_clear_error();
        int pr = preempt_newest(e, r);
        if (pr == -2) return kvc__error(KVC_ERR_NOMEM, "kvc_engine_step: out of memory");
        if (pr <= 0) return KVC_ERR_NO_SPACE;
    }
    return KVC_OK;
}

static kvc_status ensure_batch(kvc_engine *e, int64_t nb, int64_t rows) {
    if (nb > e->cap_b) {
        int64_t c = nb + 16;
        void *a = realloc(e->b_seq, (size_t)c * sizeof(kvc_seq_id));
        if (a) e->b_seq = a;
        void *b = realloc(e->b_pos0, (size_t)c * sizeof(int64_t));
        if (b) e->b_pos0 = b;
        void *d = realloc(e->b_n, (size_t)c * sizeof(int64_t));
        if (d) e->b_n = d;
        void *h = realloc(e->b_dec, (size_t)c * sizeof(int64_t));
        if (h) e->b_dec = h;
        void *f = realloc(e->b_req, (size_t)c * sizeof(req *));
        if (f) e->b_req = f;
        void *g = realloc(e->logits, (size_t)c * (size_t)e->n_vocab * sizeof(float));
        if (g) e->logits = g;
        void *t = realloc(e->b_new, (size_t)c * sizeof(int32_t));
        if (t) e->b_new = t;
        void *u = realloc(e->b_rng, (size_t)c * sizeof(uint64_t));
        if (u) e->b_rng = u;
        if (!a || !b || !d || !f || !g || !h || !t || !u)
            return kvc__error(KVC_ERR_NOMEM, "kvc_engine_step: out of memory");
        e->cap_b = c;
    }
    if (rows > e->cap_rows) {
        void *a = realloc(e->b_tok, (size_t)rows * sizeof(int32_t));
        if (a) e->b_tok = a;
        void *b = realloc(e->b_want, (size_t)rows);
        if (b) e->b_want = b;
        if (!a || !b) return kvc__error(KVC_ERR_NOMEM, "kvc_engine_step: out of memory");
        e->cap_rows = rows;
    }
    return KVC_OK;
}

/* Undoes a step that failed after reserving (admit0: the admission counter
 * when it began), so that every request is as before it but for
 * preemptions. Requests it admitted go back to the queue in their order,
 * their sequences freed and their prompts uncounted: a prefix hit of theirs
 * may be on pages that another request reserved in this step and never
 * wrote. Every other running request (in the batch or not: a restarted
 * decode scan rebuilds the batch) loses the slots past its computed tokens,
 * so no page stays findable without its K/V. Returns st; the error message
 * stays the one that failed. */
static kvc_status fail_step(kvc_engine *e, int64_t admit0, kvc_status st) {
    /* newest first, each to the queue's front: the queue's order again */
    for (int64_t i = e->n_run - 1; i >= 0; i--) {
        req *r = e->run[i];
        if (r->admit < admit0) continue;
        drop_seq(e, r);
        if (r->admitted_once && r->counted_at >= admit0) {
            r->admitted_once = 0;
            e->st.prompt_tokens -= r->n_prompt;
            e->st.cached_tokens -= r->counted_cached;
            e->st.external_tokens -= r->counted_ext;
            e->st.external_miss_tokens -= r->counted_miss;
        }
        remove_at(e->run, &e->n_run, i);
        if (!push(&e->wait, &e->n_wait, &e->cap_wait, r, 1))
            req_free(r); /* unreachable: admission left the room it takes */
    }
    for (int64_t i = 0; i < e->n_run; i++) {
        req *r = e->run[i];
        if (r->seq >= 0 && r->n_resv > r->n_done &&
            kvc_cache_rollback(e->cache, r->seq, r->n_done) == KVC_OK)
            r->n_resv = r->n_done;
    }
    return st;
}

/* Drops the batch entries of requests that are no longer running (preempted
 * by a reservation), giving their rows back to the budget; the first
 * *n_decode entries are decode rows (step 1 comes first). */
static void compact_batch(kvc_engine *e, int64_t *nb, int64_t *rows, int64_t *budget,
                          int64_t *n_decode) {
    int64_t keep = 0, krows = 0, off = 0, kdec = 0;
    for (int64_t b = 0; b < *nb; b++) {
        int alive = 0;
        for (int64_t j = 0; j < e->n_run; j++) alive |= e->run[j] == e->b_req[b];
        if (alive) {
            if (keep != b) {
                e->b_req[keep] = e->b_req[b];
                e->b_seq[keep] = e->b_seq[b];
                e->b_pos0[keep] = e->b_pos0[b];
                e->b_n[keep] = e->b_n[b];
                memmove(e->b_tok + krows, e->b_tok + off, (size_t)e->b_n[b] * sizeof(int32_t));
                memmove(e->b_want + krows, e->b_want + off, (size_t)e->b_n[b]);
            }
            keep++;
            krows += e->b_n[b];
            kdec += b < *n_decode;
        } else {
            *budget += e->b_n[b];
        }
        off += e->b_n[b];
    }
    *nb = keep;
    *rows = krows;
    *n_decode = kdec;
}

/* Pages the connector offers for r (queued, prefix hit of hit tokens):
 * whole units, never the prompt's last token (its logits are needed); r is
 * marked probed. */
static int64_t probe_pages(kvc_engine *e, req *r, int64_t hit) {
    const int64_t P = e->p.page_size, upp = e->unit / P;
    const int64_t max_units = ((r->n_tok - 1) / e->unit * e->unit - hit) / e->unit;
    int64_t np = 0;
    r->probed = 1;
    if (max_units <= 0) return 0;
    if (e->conn.probe(e->conn.user, e->cache, r->tok, hit / P, max_units * upp, &np) != KVC_OK) {
        kvc_clear_error(); /* the connector counts its failures: recompute */
        return 0;
    }
    if (np > max_units * upp) np = max_units * upp;
    return np > 0 ? np / upp * upp : 0;
}

/* Starts loading whatever the connector has of r's pages after the hit: 1
 * when a load started (r waits for it), 0 when r is to be admitted now.
 * No probe first: the load finds out in the background, so a slow or hung
 * store delays only r, never the step (the others keep running). */
static int start_load(kvc_engine *e, req *r, int64_t hit) {
    const int64_t upp = e->unit / e->p.page_size;
    const int64_t max_units = ((r->n_tok - 1) / e->unit * e->unit - hit) / e->unit;
    r->probed = 1;
    if (max_units <= 0) return 0;
    const int64_t np = max_units * upp;
    r->load = e->conn.load_start(e->conn.user, e->cache, r->tok, hit / e->p.page_size, np);
    kvc_clear_error();
    r->load_first = hit / e->p.page_size;
    r->load_n = np;
    return r->load != NULL;
}

/* 1 when another queued request's load covers r's next unit after its hit
 * (same tokens up to the unit's end): r waits for that load and, once its
 * owner is admitted, takes those pages as a prefix hit instead of reading
 * them from the connector again (a burst of requests with one system
 * prompt reads it once). A request with a load never waits on another. */
static int behind_a_load(const kvc_engine *e, const req *r, int64_t hit) {
    const int64_t P = e->p.page_size, hp = hit / P, upp = e->unit / P, end = hit + e->unit;
    if (end > (r->n_tok - 1) / e->unit * e->unit) return 0; /* nothing r would load */
    for (int64_t j = 0; j < e->n_wait; j++) {
        const req *w = e->wait[j];
        if (w == r || !w->load || hp < w->load_first || hp + upp > w->load_first + w->load_n ||
            w->n_tok < end)
            continue;
        if (memcmp(w->tok, r->tok, (size_t)end * sizeof(int32_t)) == 0) return 1;
    }
    return 0;
}

/* Pages [first, first + n) of e->pg, restored into the cache in this
 * admission, leave it with a rollback: the connector hears of each as of an
 * eviction (it reported them restored; a router must not count on them). */
static void unrestore(kvc_engine *e, int64_t first, int64_t n) {
    if (!e->conn.on_evict) return;
    for (int64_t i = 0; i < n; i++) e->conn.on_evict(e->conn.user, e->cache, e->pg[first + i]);
}

/* The in-line restore (connector restore): *ext tokens after the n_cached
 * hit of r's new sequence seq, reserved with *chunk more. What is not
 * restored is rolled back and computed instead: *ext and *chunk are updated
 * (chunk within budget). KVC_ERR_NO_SPACE (no message) when the
 * re-reservation fails; the caller frees seq. */
static kvc_status restore_ext(kvc_engine *e, req *r, kvc_seq_id seq, int64_t n_cached,
                              int64_t *ext, int64_t *chunk, int64_t budget) {
    const int64_t P = e->p.page_size, upp = e->unit / P;
    int64_t nr = 0;
    if (seq_pages(e, seq) < (n_cached + *ext) / P ||
        e->conn.restore(e->conn.user, e->cache, r->tok, n_cached / P, *ext / P,
                        e->pg + n_cached / P, &nr) != KVC_OK)
        nr = 0;
    kvc_clear_error(); /* the connector counts its failures: recompute */
    if (nr > *ext / P) nr = *ext / P;
    nr = nr / upp * upp;
    if (nr * P == *ext) return KVC_OK;
    /* the unrestored slots were never written: out of the index, then
     * reserve what this step computes instead */
    const int64_t keep = n_cached + nr * P;
    kvc_cache_rollback(e->cache, seq, keep);
    *ext = nr * P;
    *chunk = r->n_tok - keep;
    if (*chunk > budget) *chunk = budget;
    kvc_status st = kvc_cache_append(e->cache, seq, r->tok + keep, *chunk, NULL);
    if (st != KVC_OK) {
        kvc_clear_error();
        unrestore(e, n_cached / P, nr);
        kvc_cache_rollback(e->cache, seq, n_cached);
        return KVC_ERR_NO_SPACE;
    }
    return KVC_OK;
}

/* For r with a load: 1 while it runs; else 0 with *ext the tokens it gives
 * after the prefix hit of hit tokens (the hit may have grown or shrunk
 * since the load started: pages already cached are skipped, *skip; a gap
 * before the loaded pages makes them useless). */
static int load_usable(kvc_engine *e, req *r, int64_t hit, int64_t *skip, int64_t *ext) {
    const int64_t P = e->p.page_size, upp = e->unit / P;
    int64_t ready = 0;
    if (!e->conn.load_poll(e->conn.user, r->load, 0, &ready)) return 1;
    const int64_t hp = hit / P, max_units = ((r->n_tok - 1) / e->unit * e->unit - hit) / e->unit;
    int64_t n = hp >= r->load_first ? r->load_first + ready - hp : 0;
    if (n > max_units * upp) n = max_units * upp;
    n = n > 0 ? n / upp * upp : 0;
    *skip = hp - r->load_first;
    *ext = n * P;
    return 0;
}

kvc_status kvc_engine_step(kvc_engine *e, kvc_engine_event *events, int64_t cap,
                           int64_t *n_events) {
    static const char fn[] = "kvc_engine_step";
    KVC_CHECK(e != NULL && n_events != NULL, "%s: engine and n_events must not be NULL", fn);
    *n_events = 0;
    const int64_t max_b = e->n_run + e->n_wait;
    KVC_CHECK(cap >= 0 && (events != NULL || cap == 0),
              "%s: events must not be NULL (cap %lld) and cap must be >= 0", fn, (long long)cap);
    KVC_CHECK(cap >= (max_b < e->p.max_running ? max_b : e->p.max_running),
              "%s: events must have room for %lld events (one per running request)", fn,
              (long long)(max_b < e->p.max_running ? max_b : e->p.max_running));
    if (max_b == 0) return KVC_OK;
    const double t0 = now_s();
    KVC_TRY(ensure_batch(e, max_b, e->p.max_step_tokens + max_b));
    int64_t budget = e->p.max_step_tokens, nb = 0, rows = 0, n_decode = 0;
    const int64_t admit0 = e->admit_counter; /* requests admitted from here on are this step's */
    kvc_status st = KVC_OK;

    /* 1. decode rows (a preempted request leaves run: restart the scan) */
    for (int64_t i = 0; i < e->n_run && budget > 0; i++) {
        req *r = e->run[i];
        if (r->n_done != r->n_tok - 1 || r->n_gen == 0) continue;
        int64_t before = e->n_run;
        st = reserve(e, r, r->n_tok);
        if (st == KVC_ERR_NO_SPACE) { /* r itself is the newest: preempt it */
            kvc_clear_error();
            st = KVC_OK;
            if (!push(&e->wait, &e->n_wait, &e->cap_wait, r, 1)) /* first: r is never lost */
                return fail_step(e, admit0, kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn));
            drop_seq(e, r);
            remove_at(e->run, &e->n_run, i);
            e->st.preemptions++;
            i = -1, nb = 0, rows = 0, n_decode = 0, budget = e->p.max_step_tokens;
            continue;
        }
        if (st != KVC_OK) return fail_step(e, admit0, st);
        if (e->n_run != before) { /* someone was preempted: rebuild the batch */
            i = -1, nb = 0, rows = 0, n_decode = 0, budget = e->p.max_step_tokens;
            continue;
        }
        e->b_req[nb] = r;
        e->b_seq[nb] = r->seq;
        e->b_pos0[nb] = r->n_done;
        e->b_n[nb] = 1;
        e->b_tok[rows] = r->tok[r->n_done];
        e->b_want[rows] = 1;
        nb++, rows++, budget--, n_decode++;
    }
    /* 2. prompt chunks of running requests */
    for (int64_t i = 0; i < e->n_run && budget > 0; i++) {
        req *r = e->run[i];
        if (r->n_gen > 0 && r->n_done == r->n_tok - 1) continue; /* decoding */
        int in_batch = 0;
        for (int64_t b = 0; b < nb; b++) in_batch |= e->b_req[b] == r;
        if (in_batch) continue;
        int64_t chunk = r->n_tok - r->n_done;
        if (chunk > budget) chunk = budget;
        st = reserve(e, r, r->n_done + chunk);
        /* preemption may have removed requests already in the batch, even
         * when r still did not fit */
        compact_batch(e, &nb, &rows, &budget, &n_decode);
        if (st == KVC_ERR_NO_SPACE) {
            kvc_clear_error();
            st = KVC_OK;
            break;
        }
        if (st != KVC_OK) return fail_step(e, admit0, st);
        /* find r's index again (the run array may have shifted) */
        for (i = 0; i < e->n_run && e->run[i] != r; i++) {}
        e->b_req[nb] = r;
        e->b_seq[nb] = r->seq;
        e->b_pos0[nb] = r->n_done;
        e->b_n[nb] = chunk;
        memcpy(e->b_tok + rows, r->tok + r->n_done, (size_t)chunk * sizeof(int32_t));
        memset(e->b_want + rows, 0, (size_t)chunk);
        e->b_want[rows + chunk - 1] = r->n_done + chunk == r->n_tok;
        nb++, rows += chunk, budget -= chunk;
    }
    int waited = 0; /* for a load, in this step */
admission:
    /* 3. admission, in queue order; a request whose pages the connector is
     * loading keeps its place and is passed over until the load is done */
    for (int64_t wi = 0; budget > 0 && wi < e->n_wait && e->n_run < e->p.max_running;) {
        req *r = e->wait[wi];
        int64_t hit = 0;
        if (e->p.enable_prefix_caching) {
            st = kvc_cache_lookup_prefix(e->cache, r->tok, r->n_tok, 0, &hit);
            if (st != KVC_OK) return fail_step(e, admit0, st);
        }
        int64_t ext = 0, skip = 0; /* tokens to restore; loaded pages before the hit */
        if (e->has_conn) {
            int wait = 0;
            if (!r->load && !r->probed) {
                /* nothing to step meanwhile: restore in line, straight into
                 * the reserved pages (no second copy) */
                if (behind_a_load(e, r, hit))
                    wait = 1;
                else if (e->conn.restore && e->n_run == 0 && nb == 0)
                    ext = probe_pages(e, r, hit) * e->p.page_size;
                else
                    wait = start_load(e, r, hit);
            } else if (r->load) {
                wait = load_usable(e, r, hit, &skip, &ext);
            }
            if (wait) {
                wi++;
                continue;
            }
        }
        int64_t chunk = r->n_tok - hit - ext;
        if (chunk > budget) chunk = budget;
        int64_t n_cached = 0;
        kvc_seq_id seq;
        st = kvc_cache_add_sequence(e->cache, e->p.enable_prefix_caching ? r->tok : NULL,
                                    hit + ext + chunk, 0, &seq, &n_cached);
        if (st == KVC_OK && n_cached != hit) { /* lookup and add agree: never happens */
            kvc_cache_rollback(e->cache, seq, 0);
            kvc_cache_free_sequence(e->cache, seq);
            st = kvc__error(KVC_ERR_INTERNAL, "%s: prefix lookup found %lld tokens, add %lld",
                            fn, (long long)hit, (long long)n_cached);
        }
        if (st == KVC_OK && ext > 0 && !r->load &&
            restore_ext(e, r, seq, n_cached, &ext, &chunk, budget) != KVC_OK) {
            kvc_cache_free_sequence(e->cache, seq);
            st = KVC_ERR_NO_SPACE;
        }
        if (st == KVC_ERR_NO_SPACE) { /* a finished load is kept for the next step */
            kvc_clear_error();
            st = KVC_OK;
            break;
        }
        if (st != KVC_OK) return fail_step(e, admit0, st);
        if (!push(&e->run, &e->n_run, &e->cap_run, r, 0)) {
            if (!r->load) unrestore(e, n_cached / e->p.page_size, ext / e->p.page_size);
            kvc_cache_rollback(e->cache, seq, n_cached); /* reserved, or restored here */
            kvc_cache_free_sequence(e->cache, seq);
            return fail_step(e, admit0, kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn));
        }
        remove_at(e->wait, &e->n_wait, wi);
        if (r->load) { /* the verified pages into the ones just reserved */
            const int ok = ext == 0 || seq_pages(e, seq) >= (hit + ext) / e->p.page_size;
            if (!ok) { /* out of memory for the page list: compute them instead */
                kvc_clear_error();
                kvc_cache_rollback(e->cache, seq, hit + chunk); /* chunk rows stay reserved */
                ext = 0;
            }
            e->conn.load_finish(e->conn.user, r->load, e->cache, skip,
                                ext ? e->pg + hit / e->p.page_size : NULL,
                                ext / e->p.page_size);
            r->load = NULL;
        }
        r->probed = 0;
        r->seq = seq;
        r->admit = e->admit_counter++;
        r->n_done = n_cached + ext;
        r->n_resv = r->n_done + chunk;
        r->n_final = r->n_done / e->unit * e->unit;
        if (e->has_conn && e->conn.on_hit && n_cached >= e->p.page_size &&
            seq_pages(e, seq) >= n_cached / e->p.page_size)
            e->conn.on_hit(e->conn.user, e->cache, r->tok, 0, n_cached / e->p.page_size, e->pg);
        kvc_clear_error();
        if (!r->admitted_once) { /* first admission: count the prompt */
            r->admitted_once = 1;
            r->counted_at = r->admit;
            r->counted_cached = n_cached < r->n_prompt ? n_cached : r->n_prompt;
            /* restored tokens too, once (a failed step uncounts them, and a
             * retry finds them as a prefix hit): cached + restored + missed
             * is the prompt */
            r->counted_ext = n_cached + ext < r->n_prompt ? ext : r->n_prompt - r->counted_cached;
            r->counted_miss = e->has_conn ? r->n_prompt - r->counted_cached - r->counted_ext : 0;
            e->st.prompt_tokens += r->n_prompt;
            e->st.cached_tokens += r->counted_cached;
            e->st.external_tokens += r->counted_ext;
            e->st.external_miss_tokens += r->counted_miss;
        }
        e->b_req[nb] = r;
        e->b_seq[nb] = r->seq;
        e->b_pos0[nb] = r->n_done;
        e->b_n[nb] = chunk;
        memcpy(e->b_tok + rows, r->tok + r->n_done, (size_t)chunk * sizeof(int32_t));
        memset(e->b_want + rows, 0, (size_t)chunk);
        e->b_want[rows + chunk - 1] = r->n_done + chunk == r->n_tok;
        nb++, rows += chunk, budget -= chunk;
    }
    if (nb == 0 && !waited) {
        /* nothing runs: wait for the oldest running load, then admit again
         * (once a step: a finished load that still does not fit waits for
         * room like any request) */
        for (int64_t i = 0; i < e->n_wait; i++) {
            int64_t ready;
            if (e->wait[i]->load &&
                !e->conn.load_poll(e->conn.user, e->wait[i]->load, 0, &ready)) {
                e->conn.load_poll(e->conn.user, e->wait[i]->load, 1, &ready);
                waited = 1;
                goto admission;
            }
        }
    }
    if (nb == 0) {
        for (int64_t i = 0; i < e->n_wait; i++) { /* a load still to come in */
            int64_t ready;
            if (e->wait[i]->load && !e->conn.load_poll(e->conn.user, e->wait[i]->load, 0, &ready))
                return KVC_OK;
        }
        if (e->n_run == 0 && e->n_wait > 0)
            return kvc__error(KVC_ERR_NO_SPACE, "%s: no request fits in the cache", fn);
        return KVC_OK;
    }
    /* 4. forward */
    /* generated tokens (positions >= the prompt length) attend with the decode
     * kernel, prompt tokens with prefill: a rule of the request, not of the
     * schedule, so results do not depend on batching or chunking */
    for (int64_t b = 0; b < nb; b++) e->b_dec[b] = e->b_req[b]->n_prompt;
    st = kvc_model_forward(e->ctx, e->cache, (int32_t)nb, e->b_seq, e->b_pos0, e->b_n, e->b_dec,
                           e->b_tok, e->b_want, e->logits);
    if (st != KVC_OK) return fail_step(e, admit0, st);
    /* 5. sample (all draws before any commit: a failed draw, e.g. NaN
     * logits, leaves every request as it was), then emit and retire */
    for (int64_t b = 0, li = 0, row = 0; b < nb; b++) {
        req *r = e->b_req[b];
        row += e->b_n[b];
        if (!e->b_want[row - 1]) continue;
        e->b_rng[b] = r->rng;
        st = kvc_sample(e->logits + li * e->n_vocab, e->n_vocab, &r->sp, &e->b_rng[b],
                        &e->b_new[b]);
        if (st != KVC_OK) {
            char msg[256];
            snprintf(msg, sizeof msg, "%s", kvc_last_error());
            return fail_step(e, admit0,
                             kvc__error(st, "%s: request %lld: %s", fn, (long long)r->id, msg));
        }
        li++;
    }
    int64_t ne = 0, row = 0;
    for (int64_t b = 0; b < nb; b++) {
        req *r = e->b_req[b];
        const int want = e->b_want[row + e->b_n[b] - 1];
        row += e->b_n[b];
        if (r->n_gen == 0 || r->n_done != r->n_tok - 1) e->st.prefill_tokens += e->b_n[b];
        r->n_done += e->b_n[b];
        report_final(e, r);
        if (!want) continue;
        const int32_t t = e->b_new[b];
        r->rng = e->b_rng[b];
        r->tok[r->n_tok++] = t;
        r->n_gen++;
        e->st.decode_tokens++;
        int32_t fin = KVC_FINISH_NONE;
        if (!r->ignore_eos && kvc_tokenizer_is_eog(kvc_model_tokenizer(e->m), t))
            fin = KVC_FINISH_EOG;
        else if (r->n_gen >= r->max_new)
            fin = KVC_FINISH_LENGTH;
        events[ne].request_id = r->id;
        events[ne].token = t;
        events[ne].finish = fin;
        ne++;
    }
    /* usage peak before retiring */
    kvc_cache_stats cs;
    if (kvc_cache_get_stats(e->cache, &cs) == KVC_OK) {
        int64_t used = cs.used_pages * e->p.page_size;
        if (used > e->st.kv_used_tokens_peak) e->st.kv_used_tokens_peak = used;
    }
    for (int64_t i = 0; i < ne; i++) {
        if (events[i].finish == KVC_FINISH_NONE) continue;
        for (int64_t j = 0; j < e->n_run; j++)
            if (e->run[j]->id == events[i].request_id) {
                req *r = e->run[j];
                drop_seq(e, r);
                remove_at(e->run, &e->n_run, j);
                req_free(r);
                break;
            }
    }
    *n_events = ne;
    const double dt = now_s() - t0;
    e->st.steps++;
    e->st.step_seconds += dt;
    if (n_decode == 0) e->st.prefill_seconds += dt;
    if (n_decode == nb) {
        e->st.decode_seconds += dt;
        e->st.decode_only_tokens += ne;
    }
    return KVC_OK;
}
