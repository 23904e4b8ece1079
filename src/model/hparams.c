/*
 * Model metadata (hparams.h). The runtime refuses rather than ignores: a
 * file whose keys ask for something the forward pass does not do (another
 * rope scaling, experts, soft-capping, a LayerNorm, ...) would otherwise run
 * and print plausible wrong text. So every key of the file is classified:
 * an <arch>.* key must be one of the table below, any other namespace but
 * the informational ones is refused.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "../core/internal.h"
#include "hparams.h"

static const kvc__arch ARCHS[] = {
    /* llama.cpp's LLM_ARCH_LLAMA: biases and rope_freqs optional, normal rope */
    {"llama", 0, 1, 1, 1},
    /* LLM_ARCH_QWEN2: llama with required q/k/v biases and NEOX rope */
    {"qwen2", 1, 2, 0, 0},
};

typedef enum { K_INT, K_FLOAT, K_BOOL, K_STR } kind;

/* How each <arch>.* key is treated. */
typedef enum {
    READ,    /* read below into kvc_model_info */
    IGNORED, /* cannot change what this runtime computes (reason in the table) */
    REFUSED  /* changes the computation in a way not implemented (reason given) */
} key_use;

typedef struct key_rule {
    const char *suffix; /* after "<arch>." */
    key_use use;
    const char *why; /* REFUSED: what the key means, for the message */
} key_rule;

static const key_rule RULES[] = {
    {"block_count", READ, NULL},
    {"context_length", READ, NULL},
    {"embedding_length", READ, NULL},
    {"feed_forward_length", READ, NULL},
    {"vocab_size", READ, NULL}, /* checked against token_embd's rows */
    {"attention.head_count", READ, NULL},
    {"attention.head_count_kv", READ, NULL},
    {"attention.key_length", READ, NULL},
    {"attention.value_length", READ, NULL},
    {"attention.layer_norm_rms_epsilon", READ, NULL},
    {"attention.causal", READ, NULL},       /* accepted when true */
    {"rope.dimension_count", READ, NULL},
    {"rope.freq_base", READ, NULL},
    {"rope.scaling.type", READ, NULL},      /* none or linear */
    {"rope.scaling.factor", READ, NULL},
    {"rope.scale_linear", READ, NULL},      /* the older spelling of a linear factor */
    {"rope.scaling.attn_factor", READ, NULL}, /* accepted when 1 */
    {"expert_count", READ, NULL},           /* accepted when 0 */
    {"expert_used_count", READ, NULL},      /* accepted when 0 */
    /* only YaRN reads it (llama.cpp's n_ctx_orig_yarn), and YaRN is refused */
    {"rope.scaling.original_context_length", IGNORED, NULL},
    /* whether the checkpoint was fine-tuned at its scaled length: informational */
    {"rope.scaling.finetuned", IGNORED, NULL},
    /* how an old converter permuted Q/K rows: the stored tensors already are
     * in GGUF layout, llama.cpp does not read it either */
    {"tensor_data_layout", IGNORED, NULL},
    /* refused with a reason (any other key is refused too, without one) */
    {"attention.layer_norm_epsilon", REFUSED, "LayerNorm with a mean, not RMSNorm"},
    {"attention.sliding_window", REFUSED, "sliding-window attention"},
    {"attention.sliding_window_pattern", REFUSED, "sliding-window attention"},
    {"attn_logit_softcapping", REFUSED, "attention logit soft-capping"},
    {"final_logit_softcapping", REFUSED, "output logit soft-capping"},
    {"attention.clamp_kqv", REFUSED, "clamped Q/K/V"},
    {"attention.max_alibi_bias", REFUSED, "ALiBi position bias"},
    {"attention.scale", REFUSED, "a custom attention scale"},
    {"logit_scale", REFUSED, "scaled output logits"},
    {"embedding_scale", REFUSED, "scaled embeddings"},
    {"residual_scale", REFUSED, "scaled residuals"},
    {"rope.dimension_sections", REFUSED, "sectioned (multimodal) rope"},
    {"pooling_type", REFUSED, "an embedding model's pooling"},
    {"expert_feed_forward_length", REFUSED, "mixture of experts"},
    {"expert_shared_count", REFUSED, "mixture of experts"},
    {"expert_weights_scale", REFUSED, "mixture of experts"},
    {"attention.q_lora_rank", REFUSED, "low-rank (MLA) attention"},
    {"attention.kv_lora_rank", REFUSED, "low-rank (MLA) attention"},
};

static const char *type_name(kvc_gguf_type t) {
    static const char *const names[] = {"uint8",  "int8",   "uint16", "int16", "uint32",
                                        "int32",  "float32", "bool",  "string", "array",
                                        "uint64", "int64",  "float64"};
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

static int is_int_type(kvc_gguf_type t) {
    return t == KVC_GGUF_UINT8 || t == KVC_GGUF_INT8 || t == KVC_GGUF_UINT16 ||
           t == KVC_GGUF_INT16 || t == KVC_GGUF_UINT32 || t == KVC_GGUF_INT32 ||
           t == KVC_GGUF_UINT64 || t == KVC_GGUF_INT64;
}

static int fits(kvc_gguf_type t, kind k) {
    switch (k) {
    case K_INT: return is_int_type(t);
    case K_FLOAT: return t == KVC_GGUF_FLOAT32 || t == KVC_GGUF_FLOAT64 || is_int_type(t);
    case K_BOOL: return t == KVC_GGUF_BOOL;
    case K_STR: return t == KVC_GGUF_STRING;
    }
    return 0;
}

/* *found = 1 if key is present with a type of kind k, 0 if absent and not
 * required; an error naming the key otherwise. */
static kvc_status find(const kvc_gguf *g, const char *key, kind k, int required, int *found) {
    static const char *const kind_names[] = {"an integer", "a number", "a bool", "a string"};
    *found = 0;
    const int64_t i = kvc_gguf_find_key(g, key);
    if (i < 0) {
        if (!required) return KVC_OK;
        return kvc__error(KVC_ERR_CORRUPT, "model: required metadata key %s is missing", key);
    }
    kvc_gguf_type t, et;
    int64_t n;
    KVC_TRY(kvc_gguf_kv_type(g, i, &t, &et, &n));
    /* llama.cpp reads some numbers as one value per layer (head counts,
     * feed-forward lengths of OpenELM-like models): a real file's feature,
     * which this runtime does not follow */
    if (t == KVC_GGUF_ARRAY && (k == K_INT || k == K_FLOAT) && fits(et, k))
        return kvc__error(KVC_ERR_UNSUPPORTED, "model: metadata key %s is an array of %lld "
                          "values (one per layer); per-layer values are not supported",
                          key, (long long)n);
    if (!fits(t, k))
        return kvc__error(KVC_ERR_CORRUPT, "model: metadata key %s has type %s%s%s, expected %s",
                          key, type_name(t), t == KVC_GGUF_ARRAY ? " of " : "",
                          t == KVC_GGUF_ARRAY ? type_name(et) : "", kind_names[k]);
    *found = 1;
    return KVC_OK;
}

static void arch_key(char *key, size_t n, const kvc__arch *a, const char *suffix) {
    snprintf(key, n, "%s.%s", a->name, suffix);
}

/* An integer key in [lo, hi]; dflt if absent and not required. */
static kvc_status get_int(const kvc_gguf *g, const kvc__arch *a, const char *suffix, int required,
                          int64_t dflt, int64_t lo, int64_t hi, int64_t *out) {
    char key[128];
    arch_key(key, sizeof key, a, suffix);
    int found;
    KVC_TRY(find(g, key, K_INT, required, &found));
    int64_t v = dflt;
    if (found && kvc_gguf_get_i64(g, key, &v) != KVC_OK) /* a uint64 past INT64_MAX */
        return kvc__error(KVC_ERR_CORRUPT, "model: metadata key %s is out of range", key);
    if (found && (v < lo || v > hi))
        return kvc__error(KVC_ERR_CORRUPT, "model: metadata key %s = %lld is outside [%lld, %lld]",
                          key, (long long)v, (long long)lo, (long long)hi);
    *out = v;
    return KVC_OK;
}

/* A finite number key (integers widened); dflt if absent. */
static kvc_status get_num(const kvc_gguf *g, const kvc__arch *a, const char *suffix, double dflt,
                          double *out, int *found) {
    char key[128];
    arch_key(key, sizeof key, a, suffix);
    KVC_TRY(find(g, key, K_FLOAT, 0, found));
    double v = dflt;
    if (*found) {
        KVC_TRY(kvc_gguf_get_f64(g, key, &v));
        if (!isfinite(v))
            return kvc__error(KVC_ERR_CORRUPT, "model: metadata key %s = %g is not finite", key, v);
    }
    *out = v;
    return KVC_OK;
}

/* A number key that must be > 0. */
static kvc_status get_pos(const kvc_gguf *g, const kvc__arch *a, const char *suffix, double dflt,
                          float *out) {
    double v = dflt;
    int found;
    KVC_TRY(get_num(g, a, suffix, dflt, &v, &found));
    if (!(v > 0) || v > 3e38)
        return kvc__error(KVC_ERR_CORRUPT, "model: metadata key %s.%s = %g must be > 0",
                          a->name, suffix, v);
    *out = (float)v;
    return KVC_OK;
}

static int32_t i32(int64_t v) { return (int32_t)v; } /* callers bound v to int32 */

/* Every key of the file is classified (file header comment). */
static kvc_status check_keys(const kvc_gguf *g, const kvc__arch *a) {
    const size_t alen = strlen(a->name);
    const int64_t n = kvc_gguf_n_kv(g);
    for (int64_t i = 0; i < n; i++) {
        const char *k = kvc_gguf_key(g, i);
        /* informational; general.alignment is the reader's */
        if (strncmp(k, "general.", 8) == 0) continue;
        /* the tokenizer loader's (kvc_tokenizer_from_gguf) */
        if (strncmp(k, "tokenizer.", 10) == 0) continue;
        /* llama-quantize's record of its importance matrix: informational */
        if (strncmp(k, "quantize.", 9) == 0) continue;
        if (strncmp(k, "split.", 6) == 0) { /* gguf-split: only a one-file split loads */
            int64_t parts = 1;
            if (strcmp(k, "split.count") == 0 && kvc_gguf_get_i64(g, k, &parts) != KVC_OK)
                return kvc__error(KVC_ERR_CORRUPT, "model: metadata key split.count is not an "
                                  "integer");
            if (parts != 1)
                return kvc__error(KVC_ERR_UNSUPPORTED, "model: the model is split into %lld "
                                  "files (split.count): not supported, merge them first "
                                  "(llama-gguf-split --merge)", (long long)parts);
            continue;
        }
        if (strncmp(k, a->name, alen) != 0 || k[alen] != '.')
            return kvc__error(KVC_ERR_UNSUPPORTED,
                              "model: metadata key %.200s is not understood by this runtime (it "
                              "reads general.*, tokenizer.*, quantize.*, split.* and %s.*): "
                              "refused rather than ignored",
                              k, a->name);
        const char *suffix = k + alen + 1;
        const key_rule *r = NULL;
        for (size_t j = 0; j < sizeof RULES / sizeof RULES[0] && !r; j++)
            if (strcmp(suffix, RULES[j].suffix) == 0) r = &RULES[j];
        if (!r)
            return kvc__error(KVC_ERR_UNSUPPORTED,
                              "model: metadata key %.200s is not supported by this runtime (it "
                              "may change the computation): refused rather than ignored", k);
        if (r->use == REFUSED)
            return kvc__error(KVC_ERR_UNSUPPORTED,
                              "model: metadata key %.200s asks for %s, which this runtime does "
                              "not implement", k, r->why);
    }
    return KVC_OK;
}

/* Linear rope scaling, as llama.cpp reads it: the factor from
 * rope.scaling.factor, or from rope.scale_linear when that key is absent
 * (a factor of 0 is none, the older key then unread); the type defaults to
 * linear, "none" disables the factor, others are refused. */
static kvc_status read_rope_scaling(const kvc_gguf *g, const kvc__arch *a, kvc_model_info *in) {
    char key[128];
    arch_key(key, sizeof key, a, "rope.scaling.type");
    int found;
    KVC_TRY(find(g, key, K_STR, 0, &found));
    int none = 0;
    if (found) {
        const char *s;
        size_t len;
        KVC_TRY(kvc_gguf_get_str(g, key, &s, &len));
        if (len == 4 && memcmp(s, "none", 4) == 0)
            none = 1;
        else if (!(len == 6 && memcmp(s, "linear", 6) == 0))
            return kvc__error(KVC_ERR_UNSUPPORTED,
                              "model: metadata key %s = '%.*s': only linear rope scaling (or "
                              "none) is implemented", key, (int)(len < 40 ? len : 40), s);
    }
    double f = 0;
    KVC_TRY(get_num(g, a, "rope.scaling.factor", 0.0, &f, &found));
    const char *which = "rope.scaling.factor";
    if (!found) {
        KVC_TRY(get_num(g, a, "rope.scale_linear", 0.0, &f, &found));
        which = "rope.scale_linear";
    }
    if (f < 0 || f > 1e6)
        return kvc__error(KVC_ERR_CORRUPT, "model: metadata key %s.%s = %g is outside [0, 1e6]",
                          a->name, which, f);
    in->rope_scale = none || f == 0 ? 1.0f : (float)f;
    double af = 1;
    KVC_TRY(get_num(g, a, "rope.scaling.attn_factor", 1.0, &af, &found));
    if (af != 1.0)
        return kvc__error(KVC_ERR_UNSUPPORTED, "model: metadata key %s.rope.scaling.attn_factor "
                          "= %g: a rope attention factor other than 1 is not implemented",
                          a->name, af);
    return KVC_OK;
}

kvc_status kvc__model_hparams(const kvc_gguf *g, kvc_model_info *in, kvc__hparams *hp) {
    int found;
    KVC_TRY(find(g, "general.architecture", K_STR, 1, &found));
    const char *s;
    size_t len;
    KVC_TRY(kvc_gguf_get_str(g, "general.architecture", &s, &len));
    const kvc__arch *a = NULL;
    for (size_t i = 0; i < sizeof ARCHS / sizeof ARCHS[0]; i++)
        if (strlen(ARCHS[i].name) == len && memcmp(s, ARCHS[i].name, len) == 0) a = &ARCHS[i];
    if (!a)
        return kvc__error(KVC_ERR_UNSUPPORTED, "model: architecture '%.*s' is not supported "
                          "(llama and qwen2 are)", (int)(len < 64 ? len : 64), s);
    hp->arch = a;
    snprintf(in->arch, sizeof in->arch, "%s", a->name);
    in->rope_neox = a->rope_neox;
    KVC_TRY(find(g, "general.type", K_STR, 0, &found));
    if (found) { /* an adapter or projector file is not a model */
        KVC_TRY(kvc_gguf_get_str(g, "general.type", &s, &len));
        if (!(len == 5 && memcmp(s, "model", 5) == 0))
            return kvc__error(KVC_ERR_UNSUPPORTED, "model: general.type is '%.*s', not a model",
                              (int)(len < 40 ? len : 40), s);
    }
    if (kvc_gguf_get_str(g, "general.name", &s, &len) == KVC_OK)
        snprintf(in->name, sizeof in->name, "%.*s", (int)(len < 127 ? len : 127), s);
    else
        kvc_clear_error();
    KVC_TRY(check_keys(g, a));

    const int64_t BIG = 1 << 30;
    int64_t v;
    KVC_TRY(get_int(g, a, "block_count", 1, 0, 1, BIG, &v));
    in->n_layer = i32(v);
    KVC_TRY(get_int(g, a, "embedding_length", 1, 0, 1, BIG, &v));
    in->n_embd = i32(v);
    KVC_TRY(get_int(g, a, "feed_forward_length", 1, 0, 1, BIG, &v));
    in->n_ff = i32(v);
    KVC_TRY(get_int(g, a, "attention.head_count", 1, 0, 1, BIG, &v));
    in->n_head = i32(v);
    KVC_TRY(get_int(g, a, "attention.head_count_kv", 0, in->n_head, 1, BIG, &v));
    in->n_head_kv = i32(v);
    KVC_TRY(get_int(g, a, "context_length", 1, 0, 1, BIG, &v));
    in->n_ctx_train = i32(v);
    KVC_TRY(get_int(g, a, "vocab_size", 0, -1, 1, BIG, &hp->vocab_size));
    KVC_TRY(get_pos(g, a, "rope.freq_base", 10000.0, &in->rope_freq_base));
    /* required, as llama.cpp requires it of both architectures: a guessed
     * epsilon would change every norm */
    char key[128];
    arch_key(key, sizeof key, a, "attention.layer_norm_rms_epsilon");
    KVC_TRY(find(g, key, K_FLOAT, 1, &found));
    KVC_TRY(get_pos(g, a, "attention.layer_norm_rms_epsilon", 0.0, &in->rms_eps));
    if (in->n_head % in->n_head_kv != 0)
        return kvc__error(KVC_ERR_CORRUPT, "model: %d heads are not a multiple of %d kv heads",
                          (int)in->n_head, (int)in->n_head_kv);
    /* head dim: attention.key_length, else n_embd / n_head (llama.cpp's rule) */
    const int64_t dflt_dh = in->n_embd % in->n_head == 0 ? in->n_embd / in->n_head : -1;
    KVC_TRY(get_int(g, a, "attention.key_length", 0, dflt_dh, 1, BIG, &v));
    if (v < 0)
        return kvc__error(KVC_ERR_CORRUPT, "model: embedding_length %d is not a multiple of "
                          "head_count %d", (int)in->n_embd, (int)in->n_head);
    if (v > 512)
        return kvc__error(KVC_ERR_UNSUPPORTED, "model: head dim %lld > 512", (long long)v);
    in->head_dim = i32(v);
    /* value head size: attention.value_length, else n_embd / n_head as for
     * the key (llama.cpp's default: not the key length when that is given) */
    arch_key(key, sizeof key, a, "attention.value_length");
    KVC_TRY(get_int(g, a, "attention.value_length", 0, in->n_embd / in->n_head, 1, BIG, &v));
    if (v != in->head_dim && kvc_gguf_find_key(g, key) < 0)
        return kvc__error(KVC_ERR_UNSUPPORTED, "model: metadata key %s is absent, so the value "
                          "head size is embedding_length / head_count = %lld (as llama.cpp "
                          "reads it), which differs from the key length %d: not implemented",
                          key, (long long)v, (int)in->head_dim);
    if (v != in->head_dim)
        return kvc__error(KVC_ERR_UNSUPPORTED, "model: metadata key %s = %lld differs from the "
                          "key length %d: not implemented", key, (long long)v,
                          (int)in->head_dim);
    KVC_TRY(get_int(g, a, "rope.dimension_count", 0, in->head_dim, 2, in->head_dim, &v));
    if (v % 2 != 0)
        return kvc__error(KVC_ERR_CORRUPT, "model: metadata key %s.rope.dimension_count = %lld "
                          "is odd", a->name, (long long)v);
    in->n_rot = i32(v);
    KVC_TRY(read_rope_scaling(g, a, in));

    /* accepted at the value that changes nothing */
    KVC_TRY(get_int(g, a, "expert_count", 0, 0, 0, BIG, &v));
    if (v == 0) KVC_TRY(get_int(g, a, "expert_used_count", 0, 0, 0, BIG, &v));
    if (v != 0)
        return kvc__error(KVC_ERR_UNSUPPORTED, "model: metadata key %s.expert_count/"
                          "expert_used_count = %lld: mixture of experts is not implemented",
                          a->name, (long long)v);
    arch_key(key, sizeof key, a, "attention.causal");
    KVC_TRY(find(g, key, K_BOOL, 0, &found));
    if (found) {
        KVC_TRY(kvc_gguf_get_i64(g, key, &v));
        if (v != 1)
            return kvc__error(KVC_ERR_UNSUPPORTED, "model: metadata key %s = false: "
                              "non-causal attention is not implemented", key);
    }
    return KVC_OK;
}
