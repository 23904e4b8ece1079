/*
 * Llama-architecture forward pass (model.h) over kvcache's paged cache.
 *
 * Loading checks every tensor the architecture needs against the metadata
 * (shapes, supported weight types) so the forward pass never meets a
 * surprise. A step: embed the batch's token rows, then per layer rmsnorm ->
 * Q/K/V products -> rotary -> append K/V to the layer's pages -> batched
 * causal prefill attention over the pages (one plan per step, run per layer)
 * -> output product + residual -> rmsnorm -> SwiGLU FFN + residual; finally
 * the output head for the rows whose logits are wanted.
 *
 * Every stage works row by row with the same arithmetic whatever the batch
 * (see gemm.h and prefill.h on row independence), which is what makes cached
 * generation equal to recomputation.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/gguf.h"
#include "kvcache/model.h"
#include "kvcache/paged.h"
#include "kvcache/prefill.h"
#include "../core/internal.h"
#include "../gguf/gguf_internal.h"
#include "../kvfmt/kvfmt_internal.h"
#include "model_internal.h"
#include "../paged/paged_internal.h"
#include "gemm.h"
#include "hparams.h"
#include "../kernels/kernels.h"

typedef struct weight {
    int32_t type;
    const void *data;
    int64_t rows, cols; /* W (rows, cols): y = x W^T, cols = input dim */
} weight;

typedef struct layer {
    float *attn_norm, *ffn_norm; /* (n_embd) owned float32 copies */
    /* biases added after the products (owned float32 copies), NULL if absent */
    float *bq, *bk, *bv, *bo, *bg, *bu, *bd;
    weight wq, wk, wv, wo, wg, wu, wd;
} layer;

struct kvc_model {
    kvc_gguf *g;
    kvc_tokenizer *tok;
    kvc_model_info info;
    weight tok_embd, output;
    float *out_norm;
    layer *layers;
    /* (n_rot / 2) base^(-2i / n_rot) / (rope_scale * freq_factor[i]) */
    double *inv_freq;
    const kvc__arch *arch;
    unsigned char *used; /* while loading: 1 for each tensor the architecture took */
};

/* A growable int32/int64 array of the step scratch. */
typedef struct ibuf {
    void *p;
    int64_t cap; /* elements */
} ibuf;

struct kvc_model_ctx {
    const kvc_model *m;
    kvc_threadpool *pool;
    int32_t n_threads;
    int64_t cap_rows, cap_logit_rows;
    float *x, *h, *q, *k, *v, *att, *gate, *up, *tmp; /* (rows, *) row scratch */
    float *fin;                                       /* (wanted rows, n_embd) */
    /* per internal row: original row, append table entry, position */
    ibuf orig, inv, batch_idx, positions;
    /* page tables: the batch's full tables, the append table (pos0 + n
     * tokens per sequence), the prefill table and the per-row decode table */
    ibuf full_indptr, full_last, full_indices;
    ibuf a_indptr, a_last, a_indices;
    ibuf p_qo, p_indptr, p_last, p_indices;
    ibuf d_indptr, d_last, d_indices;
    kvc_seq_id *act;
    int64_t cap_act;
    /* compressed-format caches: rows per sequence, the sequences' views */
    ibuf k_rows, k_seqs;
};


/* ---- loading ---------------------------------------------------------------- */

/* Finds tensor `name` with ne = (cols, rows) (rows 0: 1-D of cols). */
static kvc_status find_tensor(kvc_model *m, const char *name, int64_t cols, int64_t rows,
                              kvc_gguf_tensor *t) {
    int64_t i = kvc_gguf_find_tensor(m->g, name);
    if (i < 0) return kvc__error(KVC_ERR_CORRUPT, "model: tensor %s is missing", name);
    KVC_TRY(kvc_gguf_get_tensor(m->g, i, t));
    m->used[i] = 1;
    const int want_dims = rows ? 2 : 1;
    int ok = t->ne[0] == cols && (rows ? t->ne[1] == rows : 1);
    for (int d = want_dims; d < 4; d++) ok = ok && t->ne[d] == 1;
    if (!ok)
        return kvc__error(KVC_ERR_CORRUPT,
                          "model: tensor %s has shape (%lld, %lld, %lld, %lld), expected (%lld, "
                          "%lld) (innermost first)",
                          name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                          (long long)t->ne[3], (long long)cols, (long long)(rows ? rows : 1));
    return KVC_OK;
}

static kvc_status load_weight(kvc_model *m, const char *name, int64_t cols, int64_t rows,
                              weight *w) {
    kvc_gguf_tensor t;
    KVC_TRY(find_tensor(m, name, cols, rows, &t));
    if (!kvc__gemm_supported(t.type)) {
        const char *tn = kvc_ggml_type_name(t.type);
        return kvc__error(KVC_ERR_UNSUPPORTED, "model: tensor %s has weight type %s (%d), not "
                          "supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, "
                          "IQ4_XS, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K are)",
                          name, tn ? tn : "unknown", (int)t.type);
    }
    w->type = t.type;
    w->data = t.data;
    w->rows = rows;
    w->cols = cols;
    m->info.n_params += rows * cols;
    m->info.weight_bytes += t.size;
    return KVC_OK;
}

/* A 1-D weight as an owned float32 copy. */
static kvc_status load_vector(kvc_model *m, const char *name, int64_t n, float **out) {
    kvc_gguf_tensor t;
    KVC_TRY(find_tensor(m, name, n, 0, &t));
    float *v = malloc((size_t)n * sizeof(float));
    if (!v) return kvc__error(KVC_ERR_NOMEM, "model: out of memory");
    kvc_status st = kvc__ggml_dequant_row(t.type, t.data, n, v);
    if (st != KVC_OK) {
        free(v);
        char why[256]; /* kvc__error formats into the buffer kvc_last_error() reads */
        snprintf(why, sizeof why, "%s", kvc_last_error());
        return kvc__error(st, "model: tensor %s: %s", name, why);
    }
    m->info.n_params += n;
    m->info.weight_bytes += t.size;
    *out = v;
    return KVC_OK;
}

/* load_vector for a tensor that may be absent (*out NULL then); allowed 0:
 * not taken, so that one present is refused as unused. */
static kvc_status load_optional(kvc_model *m, const char *name, int64_t n, int allowed,
                                float **out) {
    *out = NULL;
    if (!allowed || kvc_gguf_find_tensor(m->g, name) < 0) return KVC_OK;
    return load_vector(m, name, n, out);
}

kvc_model_params kvc_model_default_params(void) {
    kvc_model_params p;
    memset(&p, 0, sizeof p);
    p.prefault = 1;
    p.use_mmap = 1;
    return p;
}

void kvc_model_destroy(kvc_model *m) {
    if (!m) return;
    if (m->layers)
        for (int32_t l = 0; l < m->info.n_layer; l++) {
            layer *L = &m->layers[l];
            float *v[] = {L->attn_norm, L->ffn_norm, L->bq, L->bk, L->bv, L->bo, L->bg, L->bu,
                          L->bd};
            for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) free(v[i]);
        }
    free(m->layers);
    free(m->out_norm);
    free(m->inv_freq);
    free(m->used);
    kvc_tokenizer_destroy(m->tok);
    kvc_gguf_close(m->g);
    free(m);
}

static void progress(const kvc_model_params *p, float f) {
    if (p->progress) p->progress(f, p->progress_user);
}

/* use_mmap 0: the file's read is the first 90% of the load */
static void read_progress(float f, void *user) { progress(user, 0.9f * f); }

/* Every tensor of the file must have been taken: one the runtime would not
 * read (another architecture's, a block past block_count) is refused. */
static kvc_status check_all_used(const kvc_model *m) {
    const int64_t nt = kvc_gguf_n_tensors(m->g);
    for (int64_t i = 0; i < nt; i++) {
        if (m->used[i]) continue;
        kvc_gguf_tensor t;
        KVC_TRY(kvc_gguf_get_tensor(m->g, i, &t));
        char *end = NULL;
        const long blk = strncmp(t.name, "blk.", 4) == 0 ? strtol(t.name + 4, &end, 10) : -1;
        if (end && end != t.name + 4 && *end == '.' && blk >= m->info.n_layer)
            return kvc__error(KVC_ERR_CORRUPT, "model: tensor %.200s is in block %ld but %s."
                              "block_count is %d: the metadata does not count every block",
                              t.name, blk, m->arch->name, (int)m->info.n_layer);
        return kvc__error(KVC_ERR_UNSUPPORTED, "model: tensor %.200s is not used by the %s "
                          "architecture as implemented here: refused rather than ignored",
                          t.name, m->arch->name);
    }
    return KVC_OK;
}

/* inv_freq[i] = base^(-2i / n_rot) / (rope_scale * factor[i]): linear
 * scaling divides positions by rope_scale, rope_freqs.weight (Llama 3.1's
 * long-context factors) divides each frequency's angle, as llama.cpp does. */
static kvc_status rope_frequencies(kvc_model *m) {
    kvc_model_info *in = &m->info;
    const int64_t half = in->n_rot / 2;
    float *ff = NULL;
    KVC_TRY(load_optional(m, "rope_freqs.weight", half, m->arch->rope_freqs, &ff));
    m->inv_freq = malloc((size_t)(half + 1) * sizeof(double));
    if (!m->inv_freq) {
        free(ff);
        return kvc__error(KVC_ERR_NOMEM, "model: out of memory");
    }
    for (int64_t i = 0; i < half; i++) {
        if (ff && !(isfinite(ff[i]) && ff[i] > 0)) {
            const double bad = ff[i];
            free(ff);
            return kvc__error(KVC_ERR_CORRUPT, "model: tensor rope_freqs.weight[%lld] = %g must "
                              "be > 0", (long long)i, bad);
        }
        m->inv_freq[i] = pow((double)in->rope_freq_base, -2.0 * (double)i / (double)in->n_rot) /
                         ((double)in->rope_scale * (ff ? (double)ff[i] : 1.0));
    }
    in->rope_freq_factors = ff != NULL;
    free(ff);
    return KVC_OK;
}

static kvc_status load_all(kvc_model *m, const kvc_model_params *p) {
    kvc_model_info *in = &m->info;
    kvc__hparams hp;
    KVC_TRY(kvc__model_hparams(m->g, in, &hp));
    m->arch = hp.arch;
    const kvc__arch *arch = hp.arch;
    m->used = calloc((size_t)kvc_gguf_n_tensors(m->g) + 1, 1);
    if (!m->used) return kvc__error(KVC_ERR_NOMEM, "model: out of memory");

    /* tokenizer first: it also tells the vocabulary size */
    KVC_TRY(kvc_tokenizer_from_gguf(m->g, &m->tok));
    const int64_t E = in->n_embd, F = in->n_ff, Dh = in->head_dim;
    const int64_t QD = (int64_t)in->n_head * Dh, KD = (int64_t)in->n_head_kv * Dh;
    int64_t ti = kvc_gguf_find_tensor(m->g, "token_embd.weight");
    if (ti < 0) return kvc__error(KVC_ERR_CORRUPT, "model: tensor token_embd.weight is missing");
    kvc_gguf_tensor te;
    KVC_TRY(kvc_gguf_get_tensor(m->g, ti, &te));
    in->n_vocab = (int32_t)te.ne[1];
    if (te.ne[1] != kvc_tokenizer_n_vocab(m->tok)) /* the file's inconsistency, not the caller's */
        return kvc__error(KVC_ERR_CORRUPT, "model: token_embd has %lld rows but the vocabulary "
                          "%d tokens", (long long)te.ne[1], (int)kvc_tokenizer_n_vocab(m->tok));
    if (hp.vocab_size >= 0 && hp.vocab_size != in->n_vocab)
        return kvc__error(KVC_ERR_CORRUPT, "model: metadata key %s.vocab_size = %lld but "
                          "token_embd has %d rows", arch->name, (long long)hp.vocab_size,
                          (int)in->n_vocab);
    KVC_TRY(load_weight(m, "token_embd.weight", E, in->n_vocab, &m->tok_embd));
    KVC_TRY(load_vector(m, "output_norm.weight", E, &m->out_norm));
    if (kvc_gguf_find_tensor(m->g, "output.weight") >= 0) {
        KVC_TRY(load_weight(m, "output.weight", E, in->n_vocab, &m->output));
    } else {
        m->output = m->tok_embd;
        in->tied_output = 1;
    }
    /* each block has 9 tensors: a corrupt count is refused before the layer
     * table is allocated for it */
    if (in->n_layer > kvc_gguf_n_tensors(m->g) / 9)
        return kvc__error(KVC_ERR_CORRUPT,
                          "model: block_count %d but the file has %lld tensors (9 per block)",
                          (int)in->n_layer, (long long)kvc_gguf_n_tensors(m->g));
    m->layers = calloc((size_t)in->n_layer, sizeof(layer));
    if (!m->layers) return kvc__error(KVC_ERR_NOMEM, "model: out of memory");
    KVC_TRY(rope_frequencies(m));
    for (int32_t l = 0; l < in->n_layer; l++) {
        layer *L = &m->layers[l];
        char nm[96];
#define W(field, suffix, cols, rows)                                                               \
    snprintf(nm, sizeof nm, "blk.%d." suffix ".weight", (int)l);                                   \
    KVC_TRY(load_weight(m, nm, cols, rows, &L->field))
#define B(field, suffix, n, allowed, bit)                                                          \
    snprintf(nm, sizeof nm, "blk.%d." suffix ".bias", (int)l);                                     \
    KVC_TRY(load_optional(m, nm, n, allowed, &L->field));                                          \
    if (L->field) in->biases |= (bit)
        snprintf(nm, sizeof nm, "blk.%d.attn_norm.weight", (int)l);
        KVC_TRY(load_vector(m, nm, E, &L->attn_norm));
        snprintf(nm, sizeof nm, "blk.%d.ffn_norm.weight", (int)l);
        KVC_TRY(load_vector(m, nm, E, &L->ffn_norm));
        W(wq, "attn_q", E, QD);
        W(wk, "attn_k", E, KD);
        W(wv, "attn_v", E, KD);
        W(wo, "attn_output", QD, E);
        W(wg, "ffn_gate", E, F);
        W(wu, "ffn_up", E, F);
        W(wd, "ffn_down", F, E);
        B(bq, "attn_q", QD, arch->qkv_bias, KVC_MODEL_BIAS_Q);
        B(bk, "attn_k", KD, arch->qkv_bias, KVC_MODEL_BIAS_K);
        B(bv, "attn_v", KD, arch->qkv_bias, KVC_MODEL_BIAS_V);
        B(bo, "attn_output", E, arch->other_bias, KVC_MODEL_BIAS_O);
        B(bg, "ffn_gate", F, arch->other_bias, KVC_MODEL_BIAS_FFN_GATE);
        B(bu, "ffn_up", F, arch->other_bias, KVC_MODEL_BIAS_FFN_UP);
        B(bd, "ffn_down", E, arch->other_bias, KVC_MODEL_BIAS_FFN_DOWN);
#undef W
#undef B
        if (arch->qkv_bias == 2 && !(L->bq && L->bk && L->bv))
            return kvc__error(KVC_ERR_CORRUPT, "model: block %d lacks one of the attn_q/attn_k/"
                              "attn_v biases the %s architecture has", (int)l, arch->name);
        /* mapped: setup 0-10%, the prefault after it; read: the read 0-90% */
        progress(p, (p->use_mmap ? 0.0f : 0.9f) + 0.1f * (float)(l + 1) / (float)in->n_layer);
    }
    KVC_TRY(check_all_used(m));
    free(m->used);
    m->used = NULL;
    if (p->prefault && p->use_mmap) { /* touch every weight page now, not during the first step */
        int64_t nt = kvc_gguf_n_tensors(m->g);
        volatile unsigned char sink = 0;
        size_t done = 0;
        for (int64_t i = 0; i < nt; i++) {
            kvc_gguf_tensor t;
            KVC_TRY(kvc_gguf_get_tensor(m->g, i, &t));
            const unsigned char *b = t.data;
            for (size_t o = 0; o < t.size; o += 4096) sink ^= b[o];
            done += t.size;
            if (in->weight_bytes) progress(p, 0.1f + 0.9f * (float)done / (float)in->weight_bytes);
        }
        (void)sink;
    }
    progress(p, 1.0f);
    return KVC_OK;
}

kvc_status kvc_model_load(const char *path, const kvc_model_params *params, kvc_model **out) {
    if (out) *out = NULL; /* what a failure leaves */
    KVC_CHECK(path != NULL && out != NULL, "kvc_model_load: path and out must not be NULL");
    KVC_TRY(kvc_isa_env_check());
    kvc_model_params p = params ? *params : kvc_model_default_params();
    KVC_CHECK(p.n_ctx >= 0, "kvc_model_load: n_ctx %d must be >= 0 (0: the model's own)",
              (int)p.n_ctx);
    KVC_CHECK(p.use_mmap == 0 || p.use_mmap == 1, "kvc_model_load: use_mmap %d must be 0 or 1",
              (int)p.use_mmap);
    kvc_model *m = calloc(1, sizeof *m);
    if (!m) return kvc__error(KVC_ERR_NOMEM, "kvc_model_load: out of memory");
    kvc_status st = p.use_mmap ? kvc_gguf_open(path, &m->g)
                               : kvc__gguf_open_read(path, p.progress ? read_progress : NULL, &p,
                                                     &m->g);
    if (st == KVC_OK) st = load_all(m, &p);
    if (st == KVC_OK) m->info.n_ctx = p.n_ctx > 0 ? p.n_ctx : m->info.n_ctx_train;
    if (st != KVC_OK) {
        kvc_model_destroy(m);
        return st;
    }
    *out = m;
    return KVC_OK;
}

kvc_status kvc__model_check_ctx(const kvc_model *m, const char *fn, const char *what,
                                int64_t n) {
    if (n <= m->info.n_ctx) return KVC_OK;
    return kvc__error(KVC_ERR_INVALID_ARG,
                      "%s: %s %lld tokens, past the context limit of %d tokens (the model's "
                      "n_ctx_train is %d; set another limit with kvc_model_params.n_ctx, "
                      "Python Model(n_ctx=...), CLI -c)",
                      fn, what, (long long)n, (int)m->info.n_ctx, (int)m->info.n_ctx_train);
}

kvc_status kvc_model_get_info(const kvc_model *m, kvc_model_info *out) {
    KVC_CHECK(m != NULL && out != NULL, "kvc_model_get_info: model and out must not be NULL");
    *out = m->info;
    return KVC_OK;
}

const kvc_tokenizer *kvc_model_tokenizer(const kvc_model *m) { return m ? m->tok : NULL; }

kvc_cache_params kvc_model_cache_params(const kvc_model *m, kvc_dtype kv_dtype,
                                        int64_t capacity_tokens) {
    kvc_cache_params p = kvc_cache_default_params();
    if (!m) return p;
    p.num_layers = m->info.n_layer;
    p.num_kv_heads = m->info.n_head_kv;
    p.head_dim = m->info.head_dim;
    p.dtype = kv_dtype;
    /* ceil without overflow; a negative capacity gives num_pages < 0 (refused
     * by kvc_cache_create) */
    p.num_pages = capacity_tokens / p.page_size + (capacity_tokens % p.page_size > 0);
    if (capacity_tokens < 0) p.num_pages = -1;
    return p;
}

/* ---- context ---------------------------------------------------------------- */

void kvc_model_ctx_destroy(kvc_model_ctx *c) {
    if (!c) return;
    float *fl[] = {c->x, c->h, c->q, c->k, c->v, c->att, c->gate, c->up, c->tmp, c->fin};
    for (size_t i = 0; i < sizeof fl / sizeof fl[0]; i++) free(fl[i]);
    ibuf *ib[] = {&c->orig,      &c->inv,       &c->batch_idx,    &c->positions, &c->full_indptr,
                  &c->full_last, &c->full_indices, &c->a_indptr, &c->a_last,    &c->a_indices,
                  &c->p_qo,      &c->p_indptr,  &c->p_last,       &c->p_indices, &c->d_indptr,
                  &c->d_last,    &c->d_indices, &c->k_rows,     &c->k_seqs};
    for (size_t i = 0; i < sizeof ib / sizeof ib[0]; i++) free(ib[i]->p);
    free(c->act);
    kvc_threadpool_destroy(c->pool);
    free(c);
}

kvc_status kvc_model_ctx_create(const kvc_model *m, int32_t n_threads, kvc_model_ctx **out) {
    if (out) *out = NULL; /* what a failure leaves */
    KVC_CHECK(m != NULL && out != NULL, "kvc_model_ctx_create: model and out must not be NULL");
    KVC_CHECK(n_threads >= 1 && n_threads <= 1024, "kvc_model_ctx_create: n_threads %d "
              "outside [1, 1024]", (int)n_threads);
    kvc_model_ctx *c = calloc(1, sizeof *c);
    if (!c) return kvc__error(KVC_ERR_NOMEM, "kvc_model_ctx_create: out of memory");
    c->m = m;
    c->n_threads = n_threads;
    /* a pool even for one thread (no workers then): it keeps the scratch a
     * step reserves before writing the cache (reserve_scratch) */
    kvc_status st = kvc_threadpool_create(n_threads, &c->pool);
    if (st != KVC_OK) {
        free(c);
        return st;
    }
    *out = c;
    return KVC_OK;
}

static int grow(void **p, int64_t n, size_t elem) {
    void *q = realloc(*p, (size_t)(n > 0 ? n : 1) * elem);
    if (!q) return 0;
    *p = q;
    return 1;
}

/* b holds at least n elements of elem bytes. */
static int need(ibuf *b, int64_t n, size_t elem) {
    if (n <= b->cap) return 1;
    int64_t c = n + n / 2 + 16;
    if (!grow(&b->p, c, elem)) return 0;
    b->cap = c;
    return 1;
}

#define I32(b) ((int32_t *)(b).p)
#define I64(b) ((int64_t *)(b).p)

/* Gets the pool's scratch for the step's largest matrix product (N rows;
 * n_want for the output head) and K/V append into pc's dtype, so that
 * neither can fail for want of memory once layer 0 has written the cache:
 * a step that runs out of memory then fails before changing anything. */
static int reserve_scratch(kvc_model_ctx *c, const kvc_paged_cache *pc, size_t kv_bytes,
                           int64_t N, int64_t n_want) {
    const kvc_model *m = c->m;
    const kvc_model_info *in = &m->info;
    size_t need = pc ? kvc__append_scratch_bytes(N, in->n_head_kv, in->head_dim,
                                                 pc->quant_group, pc->k.dtype)
                     : kv_bytes;
    size_t g = kvc__gemm_scratch_bytes(m->output.type, m->output.cols, n_want);
    if (g > need) need = g;
    for (int32_t l = 0; l < in->n_layer; l++) {
        const layer *L = &m->layers[l];
        const weight *w[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->wg, &L->wu, &L->wd};
        for (int i = 0; i < 7; i++) {
            g = kvc__gemm_scratch_bytes(w[i]->type, w[i]->cols, N);
            if (g > need) need = g;
        }
    }
    if (need == 0) return 1;
    void *p = kvc__scratch_get(c->pool, need); /* kept by the pool for the step's operators */
    if (p) kvc__scratch_release(c->pool, p);
    return p != NULL;
}

static kvc_status ensure_rows(kvc_model_ctx *c, int64_t rows, int64_t logit_rows) {
    const kvc_model_info *in = &c->m->info;
    const int64_t E = in->n_embd, QD = (int64_t)in->n_head * in->head_dim;
    const int64_t KD = (int64_t)in->n_head_kv * in->head_dim, F = in->n_ff;
    int ok = 1;
    if (rows > c->cap_rows) {
        ok = ok && grow((void **)&c->x, rows * E, sizeof(float));
        ok = ok && grow((void **)&c->h, rows * E, sizeof(float));
        ok = ok && grow((void **)&c->tmp, rows * E, sizeof(float));
        ok = ok && grow((void **)&c->q, rows * QD, sizeof(float));
        ok = ok && grow((void **)&c->att, rows * QD, sizeof(float));
        ok = ok && grow((void **)&c->k, rows * KD, sizeof(float));
        ok = ok && grow((void **)&c->v, rows * KD, sizeof(float));
        ok = ok && grow((void **)&c->gate, rows * F, sizeof(float));
        ok = ok && grow((void **)&c->up, rows * F, sizeof(float));
        if (ok) c->cap_rows = rows;
    }
    if (ok && logit_rows > c->cap_logit_rows) {
        ok = grow((void **)&c->fin, logit_rows * E, sizeof(float));
        if (ok) c->cap_logit_rows = logit_rows;
    }
    ok = ok && need(&c->orig, rows, sizeof(int64_t)) && need(&c->inv, rows, sizeof(int64_t));
    ok = ok && need(&c->batch_idx, rows, 4) && need(&c->positions, rows, 4);
    return ok ? KVC_OK : kvc__error(KVC_ERR_NOMEM, "kvc_model_forward: out of memory");
}

/* ---- row operations --------------------------------------------------------- */

/* y = x / rms(x) * w over E elements (sum of squares in double: exact enough
 * and the same for every row). */
static void rmsnorm(const float *x, const float *w, int64_t E, float eps, float *y) {
    double ss = 0;
    for (int64_t i = 0; i < E; i++) ss += (double)x[i] * x[i];
    const float r = (float)(1.0 / sqrt(ss / (double)E + eps));
    for (int64_t i = 0; i < E; i++) y[i] = x[i] * r * w[i];
}

/* Rotates pairs of the first n_rot dims of each of nh heads: adjacent
 * pairs (x[2i], x[2i+1]) (llama), or halves (x[i], x[i + n_rot/2]) (neox,
 * qwen2), pair i by pos * inv_freq[i]. */
static void rope(float *x, int64_t nh, int64_t Dh, int64_t n_rot, const double *inv_freq,
                 int64_t pos, int neox) {
    const int64_t half = n_rot / 2;
    for (int64_t i = 0; i < half; i++) {
        const double th = (double)pos * inv_freq[i];
        const float c = (float)cos(th), s = (float)sin(th);
        const int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        for (int64_t h = 0; h < nh; h++) {
            float *p = x + h * Dh;
            const float a = p[i0], b = p[i1];
            p[i0] = a * c - b * s;
            p[i1] = a * s + b * c;
        }
    }
}

static void add_bias(float *y, const float *b, int64_t n) {
    if (b)
        for (int64_t i = 0; i < n; i++) y[i] += b[i];
}

typedef struct rows_job {
    kvc_model_ctx *c;
    const layer *L;
    int stage; /* 0: attn norm, 1: q/k/v biases + rope, 2: o bias + residual, 3: ffn norm,
                  4: gate/up biases + swiglu, 5: down bias + residual */
    int64_t n;
} rows_job;

#define ROWS_PER_TASK 8

static void rows_task(void *ctx, int64_t t) {
    const rows_job *j = ctx;
    kvc_model_ctx *c = j->c;
    const kvc_model_info *in = &c->m->info;
    const int64_t E = in->n_embd, Dh = in->head_dim, F = in->n_ff;
    const int64_t QD = (int64_t)in->n_head * Dh, KD = (int64_t)in->n_head_kv * Dh;
    const int64_t r0 = t * ROWS_PER_TASK, r1 = r0 + ROWS_PER_TASK < j->n ? r0 + ROWS_PER_TASK : j->n;
    for (int64_t r = r0; r < r1; r++) {
        switch (j->stage) {
        case 0: rmsnorm(c->x + r * E, j->L->attn_norm, E, in->rms_eps, c->h + r * E); break;
        case 1:
            add_bias(c->q + r * QD, j->L->bq, QD);
            add_bias(c->k + r * KD, j->L->bk, KD);
            add_bias(c->v + r * KD, j->L->bv, KD);
            rope(c->q + r * QD, in->n_head, Dh, in->n_rot, c->m->inv_freq, I32(c->positions)[r],
                 in->rope_neox);
            rope(c->k + r * KD, in->n_head_kv, Dh, in->n_rot, c->m->inv_freq,
                 I32(c->positions)[r], in->rope_neox);
            break;
        case 2:
        case 5:
            add_bias(c->tmp + r * E, j->stage == 2 ? j->L->bo : j->L->bd, E);
            for (int64_t i = 0; i < E; i++) c->x[r * E + i] += c->tmp[r * E + i];
            break;
        case 3: rmsnorm(c->x + r * E, j->L->ffn_norm, E, in->rms_eps, c->h + r * E); break;
        case 4:
            add_bias(c->gate + r * F, j->L->bg, F);
            add_bias(c->up + r * F, j->L->bu, F);
            for (int64_t i = 0; i < F; i++) {
                const float g = c->gate[r * F + i];
                c->gate[r * F + i] = g / (1.0f + expf(-g)) * c->up[r * F + i];
            }
            break;
        }
    }
}

static void run_rows(kvc_model_ctx *c, const layer *L, int stage, int64_t n) {
    rows_job j = {c, L, stage, n};
    kvc__parallel_for(c->pool, (n + ROWS_PER_TASK - 1) / ROWS_PER_TASK, rows_task, &j);
}

static kvc_status gemm(kvc_model_ctx *c, const weight *w, const float *x, int64_t n, float *y) {
    return kvc__gemm(w->type, w->data, w->rows, w->cols, x, w->cols, n, y, w->rows, c->pool);
}

/* ---- forward ------------------------------------------------------------------ */

/* 1-D int32 tensor view of n elements. */
static kvc_tensor t1(void *p, int64_t n) {
    int64_t sh[1] = {n};
    return kvc_tensor_make(p, KVC_I32, 1, sh);
}

kvc_status kvc_model_forward(kvc_model_ctx *c, kvc_cache *cache, int32_t n_seqs,
                             const kvc_seq_id *seqs, const int64_t *pos0, const int64_t *n,
                             const int64_t *decode_from, const int32_t *tokens,
                             const uint8_t *want_logits, float *logits) {
    static const char fn[] = "kvc_model_forward";
    KVC_CHECK(c != NULL && cache != NULL, "%s: ctx and cache must not be NULL", fn);
    KVC_CHECK(n_seqs >= 0 && (n_seqs == 0 || (seqs && pos0 && n)),
              "%s: n_seqs %d with NULL seqs/pos0/n", fn, (int)n_seqs);
    const kvc_model *m = c->m;
    const kvc_model_info *in = &m->info;
    kvc_paged_cache pc;
    kvc_kvfmt fmt;
    kvc_tensor kpages;
    const int cmp = kvc_cache_kvfmt(cache, &fmt) == KVC_OK; /* a compressed format */
    int64_t ps;
    if (cmp) {
        memset(&pc, 0, sizeof pc);
        ps = fmt.page_size;
        KVC_CHECK(fmt.num_kv_heads == in->n_head_kv && fmt.head_dim == in->head_dim &&
                      kvc_cache_kvfmt_layer(cache, in->n_layer - 1, &kpages) == KVC_OK,
                  "%s: the cache does not fit the model (make it with kvc_model_cache_params)",
                  fn);
    } else {
        kvc_clear_error();
        KVC_TRY(kvc_cache_layer(cache, 0, &pc));
        const int nhd = pc.layout == KVC_NHD;
        ps = nhd ? pc.k.shape[1] : pc.k.shape[2];
        const int64_t cH = nhd ? pc.k.shape[2] : pc.k.shape[1];
        KVC_CHECK(cH == in->n_head_kv && pc.k.shape[3] == in->head_dim &&
                      kvc_cache_layer(cache, in->n_layer - 1, &pc) == KVC_OK,
                  "%s: the cache does not fit the model (make it with kvc_model_cache_params)",
                  fn);
    }
    /* validate everything first */
    int64_t N = 0, n_want = 0, n_active = 0, N_dec = 0, dec_pages = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        int64_t len;
        KVC_TRY(kvc_cache_seq_len(cache, seqs[s], &len));
        KVC_CHECK(n[s] >= 0 && pos0[s] >= 0 && n[s] <= len && pos0[s] <= len - n[s],
                  "%s: sequence %lld: %lld positions from %lld outside its %lld reserved slots",
                  fn, (long long)seqs[s], (long long)n[s], (long long)pos0[s], (long long)len);
        KVC_CHECK(pos0[s] + n[s] <= INT32_MAX, "%s: position overflow", fn);
        KVC_TRY(kvc__model_check_ctx(m, fn, "a sequence reaches", pos0[s] + n[s]));
        N += n[s];
        if (n[s] > 0) n_active++;
        const int64_t d0 = decode_from && decode_from[s] >= 0 ? decode_from[s] : INT64_MAX;
        for (int64_t p = pos0[s] > d0 ? pos0[s] : d0; p < pos0[s] + n[s]; p++) {
            N_dec++;
            dec_pages += p / ps + 1;
        }
    }
    KVC_CHECK(N == 0 || tokens != NULL, "%s: tokens is NULL", fn);
    for (int64_t r = 0; r < N; r++)
        KVC_CHECK(tokens[r] >= 0 && tokens[r] < in->n_vocab, "%s: token %d at row %lld outside "
                  "[0, %d)", fn, (int)tokens[r], (long long)r, (int)in->n_vocab);
    if (want_logits) {
        for (int64_t r = 0; r < N; r++) n_want += want_logits[r] != 0;
    } else {
        n_want = n_active;
    }
    KVC_CHECK(n_want == 0 || logits != NULL, "%s: logits is NULL", fn);
    if (N == 0) return KVC_OK;
    const int64_t N_pre = N - N_dec;

    /* scratch and the batch's page tables */
    KVC_TRY(ensure_rows(c, N, n_want));
    if (n_active > c->cap_act) {
        if (!grow((void **)&c->act, n_active, sizeof(kvc_seq_id)))
            return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
        c->cap_act = n_active;
    }
    for (int32_t s = 0, a = 0; s < n_seqs; s++)
        if (n[s] > 0) c->act[a++] = seqs[s];
    int ok = need(&c->full_indptr, n_active + 1, 4) && need(&c->full_last, n_active, 4) &&
             need(&c->a_indptr, n_active + 1, 4) && need(&c->a_last, n_active, 4) &&
             need(&c->p_qo, n_active + 1, 4) && need(&c->p_indptr, n_active + 1, 4) &&
             need(&c->p_last, n_active, 4) && need(&c->d_indptr, N_dec + 1, 4) &&
             need(&c->d_last, N_dec, 4) && need(&c->d_indices, dec_pages, 4);
    if (!ok) return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    int64_t total = 0;
    kvc_status st = kvc_cache_page_table(cache, c->act, n_active, I32(c->full_indptr), NULL, 0,
                                         I32(c->full_last), &total);
    if (st != KVC_OK && total == 0) return st;
    kvc_clear_error();
    if (!need(&c->full_indices, total, 4) || !need(&c->a_indices, total, 4) ||
        !need(&c->p_indices, total, 4))
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    st = kvc_cache_page_table(cache, c->act, n_active, I32(c->full_indptr),
                              I32(c->full_indices), c->full_indices.cap, I32(c->full_last),
                              &total);
    KVC_TRY(st);
    if (cmp && (!need(&c->k_rows, n_active + 1, sizeof(int64_t)) ||
                !need(&c->k_seqs, n_active, sizeof(kvc_kvfmt_seq))))
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
    if (!cmp && !reserve_scratch(c, &pc, 0, N, n_want))
        return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (work buffers)", fn);

    /* internal row order: every prefill row (sequence by sequence), then every
     * decode row; append / prefill / decode tables */
    int32_t *ai = I32(c->a_indptr), *al = I32(c->a_last), *ax = I32(c->a_indices);
    int32_t *pq = I32(c->p_qo), *pi = I32(c->p_indptr), *pl = I32(c->p_last);
    int32_t *px = I32(c->p_indices), *di = I32(c->d_indptr), *dl = I32(c->d_last);
    int32_t *dx = I32(c->d_indices), *bi = I32(c->batch_idx), *po = I32(c->positions);
    const int32_t *fi = I32(c->full_indptr), *fx = I32(c->full_indices);
    int64_t *orig = I64(c->orig), *inv = I64(c->inv);
    ai[0] = pi[0] = pq[0] = di[0] = 0;
    int64_t rp = 0, rd = N_pre, np_seq = 0, in_row = 0, a = 0;
    for (int32_t s = 0; s < n_seqs; s++) {
        if (n[s] == 0) continue;
        const int64_t L = pos0[s] + n[s], np = (L + ps - 1) / ps;
        const int32_t *pages = fx + fi[a];
        for (int64_t p = 0; p < np; p++) ax[ai[a] + p] = pages[p];
        ai[a + 1] = (int32_t)(ai[a] + np);
        al[a] = (int32_t)(L - (np - 1) * ps);
        if (cmp) { /* rows in the caller's order: the store needs each sequence's
                      rows together and in position order; one attention call
                      serves prefill and decode rows alike */
            I64(c->k_rows)[a] = in_row;
            for (int64_t i = 0; i < n[s]; i++, in_row++) {
                orig[in_row] = inv[in_row] = in_row;
                bi[in_row] = (int32_t)a;
                po[in_row] = (int32_t)(pos0[s] + i);
            }
            I64(c->k_rows)[++a] = in_row;
            continue;
        }
        const int64_t d0 = decode_from && decode_from[s] >= 0 ? decode_from[s] : INT64_MAX;
        const int64_t pe = L < d0 ? L : (pos0[s] > d0 ? pos0[s] : d0); /* prefill rows end */
        if (pe > pos0[s]) { /* prefill request: rows [pos0, pe), keys [0, pe) */
            const int64_t pp = (pe + ps - 1) / ps;
            for (int64_t p = 0; p < pp; p++) px[pi[np_seq] + p] = pages[p];
            pi[np_seq + 1] = (int32_t)(pi[np_seq] + pp);
            pl[np_seq] = (int32_t)(pe - (pp - 1) * ps);
            pq[np_seq + 1] = (int32_t)(pq[np_seq] + (pe - pos0[s]));
            np_seq++;
        }
        for (int64_t i = 0; i < n[s]; i++, in_row++) {
            const int64_t pos = pos0[s] + i;
            int64_t r;
            if (pos < pe) {
                r = rp++;
            } else { /* decode row: keys [0, pos] */
                r = rd++;
                const int64_t k = r - N_pre, pp = pos / ps + 1;
                for (int64_t p = 0; p < pp; p++) dx[di[k] + p] = pages[p];
                di[k + 1] = (int32_t)(di[k] + pp);
                dl[k] = (int32_t)(pos + 1 - (pp - 1) * ps);
            }
            orig[r] = in_row;
            inv[in_row] = r;
            bi[r] = (int32_t)a;
            po[r] = (int32_t)pos;
        }
        a++;
    }
    const int64_t E = in->n_embd, Dh = in->head_dim, Hq = in->n_head, H = in->n_head_kv;
    kvc_kvfmt_seq *kseq = (kvc_kvfmt_seq *)c->k_seqs.p;
    if (cmp) { /* the store-and-attend's scratch, with this step's rows and queries */
        KVC_TRY(kvc_cache_kvfmt_seqs(cache, 0, c->act, n_active, kseq));
        for (int64_t i = 0; i < n_active; i++) kseq[i].n_kv = po[I64(c->k_rows)[i + 1] - 1] + 1;
        const size_t kb = kvc__kvfmt_step_scratch_bytes(&fmt, kseq, n_active, I64(c->k_rows), N,
                                                        Hq, bi, po);
        if (!reserve_scratch(c, NULL, kb, N, n_want))
            return kvc__error(KVC_ERR_NOMEM, "%s: out of memory (work buffers)", fn);
    }
    for (int64_t r = 0; r < N; r++) {
        const char *row = (const char *)m->tok_embd.data +
                          kvc__ggml_row_bytes(m->tok_embd.type, E) * (int64_t)tokens[orig[r]];
        KVC_TRY(kvc__ggml_dequant_row(m->tok_embd.type, row, E, c->x + r * E));
    }
    kvc_tensor a_indptr = t1(ai, n_active + 1), a_last = t1(al, n_active);
    kvc_tensor a_indices = t1(ax, ai[n_active]);
    kvc_tensor bidx = t1(bi, N), posn = t1(po, N);
    int64_t shk[3] = {N, H, Dh};
    int64_t shp[3] = {N_pre, Hq, Dh}, shd[3] = {N_dec, Hq, Dh};
    kvc_tensor tk = kvc_tensor_make(c->k, KVC_F32, 3, shk);
    kvc_tensor tv = kvc_tensor_make(c->v, KVC_F32, 3, shk);
    kvc_tensor tq_p = kvc_tensor_make(c->q, KVC_F32, 3, shp);
    kvc_tensor to_p = kvc_tensor_make(c->att, KVC_F32, 3, shp);
    kvc_tensor tq_d = kvc_tensor_make(c->q + N_pre * Hq * Dh, KVC_F32, 3, shd);
    kvc_tensor to_d = kvc_tensor_make(c->att + N_pre * Hq * Dh, KVC_F32, 3, shd);

    int64_t shq[3] = {N, Hq, Dh};
    kvc_tensor tq_all = kvc_tensor_make(c->q, KVC_F32, 3, shq);
    kvc_tensor to_all = kvc_tensor_make(c->att, KVC_F32, 3, shq);
    kvc_prefill_plan *pplan = NULL;
    kvc_decode_plan *dplan = NULL;
    if (cmp) {
        /* nothing to plan */
    } else if (N_pre > 0) {
        kvc_tensor qo = t1(pq, np_seq + 1), ip = t1(pi, np_seq + 1), la = t1(pl, np_seq);
        kvc_tensor ix = t1(px, pi[np_seq]);
        st = kvc_prefill_plan_create_paged(&qo, &ip, &ix, &la, (int32_t)Hq, (int32_t)H,
                                           (int32_t)Dh, (int32_t)ps, 1, NULL, NULL, c->n_threads,
                                           &pplan);
    }
    if (!cmp && st == KVC_OK && N_dec > 0) {
        kvc_tensor ip = t1(di, N_dec + 1), la = t1(dl, N_dec), ix = t1(dx, di[N_dec]);
        st = kvc_decode_plan_create(&ip, &ix, &la, (int32_t)Hq, (int32_t)H, (int32_t)Dh,
                                    (int32_t)ps, c->n_threads, &dplan);
    }
    kvc_attn_params ap = kvc_attn_default_params();
    for (int32_t l = 0; l < in->n_layer && st == KVC_OK; l++) {
        const layer *L = &m->layers[l];
        run_rows(c, L, 0, N);
        if ((st = gemm(c, &L->wq, c->h, N, c->q)) != KVC_OK) break;
        if ((st = gemm(c, &L->wk, c->h, N, c->k)) != KVC_OK) break;
        if ((st = gemm(c, &L->wv, c->h, N, c->v)) != KVC_OK) break;
        run_rows(c, L, 1, N);
        /* attention reads a NaN score like a masked key (a row of them gives
         * zeros), so a broken model would go on silently: refuse it here,
         * before its K/V are stored */
        const kvc_kernels *kk = kvc__kernels(); /* the stores' finiteness check */
        if (!kk->all_finite(c->q, KVC_F32, N * Hq * Dh, INFINITY) ||
            !kk->all_finite(c->k, KVC_F32, N * H * Dh, INFINITY) ||
            !kk->all_finite(c->v, KVC_F32, N * H * Dh, INFINITY)) {
            st = kvc__error(KVC_ERR_CORRUPT, "kvc_model_forward: layer %d: the queries, keys or "
                            "values are not finite (NaN/Inf weights or activations)", (int)l);
            break;
        }
        if (cmp) {
            if ((st = kvc_cache_kvfmt_layer(cache, l, &kpages)) != KVC_OK ||
                (st = kvc_cache_kvfmt_seqs(cache, l, c->act, n_active, kseq)) != KVC_OK)
                break;
            for (int64_t i = 0; i < n_active; i++) /* written so far: this step's end */
                kseq[i].n_kv = po[I64(c->k_rows)[i + 1] - 1] + 1;
            if ((st = kvc_kvfmt_append_attention(&fmt, &kpages, kseq, n_active, I64(c->k_rows),
                                                 &tk, &tv, &tq_all, bi, po, &ap, &to_all, NULL,
                                                 c->pool)) != KVC_OK)
                break;
            goto attended;
        }
        if ((st = kvc_cache_layer(cache, l, &pc)) != KVC_OK) break;
        if ((st = kvc_append_paged_kv_cache(&tk, &tv, &bidx, &posn, &pc, &a_indices, &a_indptr,
                                            &a_last, c->pool)) != KVC_OK)
            break;
        if (pplan && (st = kvc_prefill_run_paged(pplan, &tq_p, &pc, &ap, &to_p, NULL,
                                                 c->pool)) != KVC_OK)
            break;
        if (dplan &&
            (st = kvc_decode_run(dplan, &tq_d, &pc, &ap, &to_d, NULL, c->pool)) != KVC_OK)
            break;
    attended:
        if ((st = gemm(c, &L->wo, c->att, N, c->tmp)) != KVC_OK) break;
        run_rows(c, L, 2, N);
        run_rows(c, L, 3, N);
        if ((st = gemm(c, &L->wg, c->h, N, c->gate)) != KVC_OK) break;
        if ((st = gemm(c, &L->wu, c->h, N, c->up)) != KVC_OK) break;
        run_rows(c, L, 4, N);
        if ((st = gemm(c, &L->wd, c->gate, N, c->tmp)) != KVC_OK) break;
        run_rows(c, L, 5, N);
    }
    kvc_prefill_plan_destroy(pplan);
    kvc_decode_plan_destroy(dplan);
    KVC_TRY(st);
    /* output head for the wanted rows, in the caller's row order */
    int64_t w = 0;
    for (int32_t s = 0, r = 0; s < n_seqs; s++)
        for (int64_t i = 0; i < n[s]; i++, r++) {
            const int want = want_logits ? want_logits[r] != 0 : i + 1 == n[s];
            if (want) rmsnorm(c->x + inv[r] * E, m->out_norm, E, in->rms_eps, c->fin + (w++) * E);
        }
    if (w > 0) KVC_TRY(gemm(c, &m->output, c->fin, w, logits));
    return KVC_OK;
}

kvc_status kvc_model_eval(const kvc_model *m, const int32_t *tokens, int64_t n_tokens,
                          int64_t decode_from, kvc_dtype kv_dtype, float *logits,
                          int32_t n_threads) {
    static const char fn[] = "kvc_model_eval";
    KVC_CHECK(m != NULL && (tokens != NULL || n_tokens == 0) && (logits != NULL || n_tokens == 0),
              "%s: model, tokens and logits must not be NULL", fn);
    KVC_CHECK(n_tokens >= 0, "%s: n_tokens %lld < 0", fn, (long long)n_tokens);
    KVC_TRY(kvc__model_check_ctx(m, fn, "the sequence has", n_tokens));
    if (n_tokens == 0) return KVC_OK;
    kvc_cache_params cp = kvc_model_cache_params(m, kv_dtype, n_tokens);
    cp.enable_prefix_caching = 0;
    kvc_cache *cache = NULL;
    kvc_model_ctx *ctx = NULL;
    KVC_TRY(kvc_cache_create(&cp, &cache));
    kvc_seq_id seq;
    kvc_status st = kvc_cache_add_sequence(cache, NULL, n_tokens, 0, &seq, NULL);
    if (st == KVC_OK) st = kvc_model_ctx_create(m, n_threads, &ctx);
    uint8_t *want = NULL;
    if (st == KVC_OK) {
        want = malloc((size_t)n_tokens);
        if (!want) st = kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
        else memset(want, 1, (size_t)n_tokens);
    }
    const int64_t pos0 = 0;
    if (st == KVC_OK)
        st = kvc_model_forward(ctx, cache, 1, &seq, &pos0, &n_tokens, &decode_from, tokens, want,
                               logits);
    free(want);
    kvc_model_ctx_destroy(ctx);
    kvc_cache_destroy(cache);
    return st;
}
