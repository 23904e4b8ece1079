/*
 * Byte-level BPE tokenizer (the GGUF "gpt2" tokenizer model).
 *
 * Encoding, in order:
 *   1. special tokens: the text is cut at every occurrence of a special
 *      token's text (leftmost, longest first). CONTROL tokens take part only
 *      with parse_special; USER_DEFINED tokens (added words) always do, as in
 *      Hugging Face tokenizers and llama.cpp;
 *   2. pre-tokenization: each stretch between special tokens is split into
 *      pieces by the model's regexes (tokenizer.ggml.pre), implemented as
 *      hand-written scanners over code points, not a regex engine;
 *   3. BPE: every byte of a piece becomes its GPT-2 byte token, then adjacent
 *      pairs are merged lowest merge rank first (leftmost on ties) until no
 *      ranked pair is left -- the priority-queue formulation of Sennrich et
 *      al.'s merge loop (as in HF tokenizers' `Word::merge_all`).
 * Decoding maps every character of a token back through GPT-2's
 * unicode -> byte table; special tokens decode to their text. Each token's
 * bytes are precomputed at creation, so decoding is a copy.
 *
 * Invalid UTF-8 never fails: an ill-formed byte is a code point of class
 * "other" (U+DC00 + byte, like Python's surrogateescape), so it forms pieces
 * like punctuation and is encoded through its byte token.
 *
 * The tokenizer is immutable after creation: any number of threads may
 * encode and decode with one tokenizer at once.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "kvcache/tokenizer.h"
#include "tokenizer_internal.h"
#include "unicode.h"

/* ---- pre-tokenizers -------------------------------------------------------- */

typedef enum pre_kind {
    PRE_GPT2,   /* 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
    PRE_SMOLLM, /* \p{N} (each number character alone), then PRE_GPT2 on the rest */
    PRE_LLAMA3, /* (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
                   | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
    PRE_QWEN2   /* PRE_LLAMA3 with \p{N} instead of \p{N}{1,3} */
} pre_kind;

/* tokenizer.ggml.pre values -> regex family. The aliases are the names
 * llama.cpp gives the same regex set (llama-vocab.cpp, pre-type switch);
 * its Llama 3 arm also ignores merges and adds BOS unless the file says. */
static const struct {
    const char *name;
    pre_kind kind;
    int llama3; /* ignore merges (a piece that is itself a token stays whole); BOS by default */
} pre_names[] = {
    {"gpt2", PRE_GPT2, 0},       {"mpt", PRE_GPT2, 0},         {"olmo", PRE_GPT2, 0},
    {"jais", PRE_GPT2, 0},       {"smollm", PRE_SMOLLM, 0},    {"starcoder", PRE_SMOLLM, 0},
    {"refact", PRE_SMOLLM, 0},   {"command-r", PRE_SMOLLM, 0}, {"codeshell", PRE_SMOLLM, 0},
    {"exaone", PRE_SMOLLM, 0},   {"llama3", PRE_LLAMA3, 1},    {"llama-v3", PRE_LLAMA3, 1},
    {"llama-bpe", PRE_LLAMA3, 1}, {"falcon3", PRE_LLAMA3, 1},  {"dbrx", PRE_LLAMA3, 0},
    {"smaug-bpe", PRE_LLAMA3, 0}, {"qwen2", PRE_QWEN2, 0},     {"stablelm2", PRE_QWEN2, 0},
};

/* pre_names' index of name, or -1. */
static int pre_index(const char *name) {
    for (size_t i = 0; i < sizeof pre_names / sizeof pre_names[0]; i++)
        if (strcmp(name, pre_names[i].name) == 0) return (int)i;
    return -1;
}

/* One code point of the text: value, class, UTF-8 length. */
typedef struct cp_info {
    uint32_t cp;
    int cls;
    int len;
} cp_info;

static cp_info cp_at(const unsigned char *s, size_t pos, size_t end) {
    cp_info c;
    c.cp = kvc__utf8_decode(s + pos, end - pos, &c.len);
    c.cls = kvc__cp_class(c.cp);
    return c;
}

static int ascii_lower(uint32_t cp) {
    return cp >= 'A' && cp <= 'Z' ? (int)(cp + 32) : (int)cp;
}

/* Length in bytes of a contraction ('s 't 're 've 'm 'll 'd) at pos, or 0.
 * The characters after the apostrophe are ASCII, so bytes are compared. */
static size_t match_contraction(const unsigned char *s, size_t pos, size_t end, int icase) {
    if (s[pos] != '\'' || pos + 1 >= end) return 0;
    int a = icase ? ascii_lower(s[pos + 1]) : s[pos + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (pos + 2 >= end) return 0;
    int b = icase ? ascii_lower(s[pos + 2]) : s[pos + 2];
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

/* End of the run of code points of class cls starting at pos; at most max
 * code points (max < 0: unbounded). */
static size_t run_of(const unsigned char *s, size_t pos, size_t end, int cls, int max) {
    int n = 0;
    while (pos < end && (max < 0 || n < max)) {
        cp_info c = cp_at(s, pos, end);
        if (c.cls != cls) break;
        pos += (size_t)c.len;
        n++;
    }
    return pos;
}

static int is_cr_lf(uint32_t cp) {
    return cp == '\r' || cp == '\n';
}

/*
 * The whitespace alternatives shared by every pattern, at a whitespace code
 * point: `\s+(?!\S)|\s+`. The whitespace run is [pos, run_end). At the end of
 * the chunk the whole run matches; before a non-space the run minus its last
 * code point does (that one then prefixes the next piece, e.g. " word"), and
 * a lone whitespace code point matches alone through `\s+`.
 * With newline_rule (Llama 3's `\s*[\r\n]+`, tried first) the match instead
 * ends after the run's last \r or \n if it has one.
 */
static size_t match_space(const unsigned char *s, size_t pos, size_t end, int newline_rule) {
    size_t last_start = pos, after_newline = 0, p = pos;
    int n = 0;
    while (p < end) {
        cp_info c = cp_at(s, p, end);
        if (c.cls != KVC__CP_SPACE) break;
        last_start = p;
        p += (size_t)c.len;
        if (is_cr_lf(c.cp)) after_newline = p;
        n++;
    }
    if (newline_rule && after_newline) return after_newline;
    if (p == end || n == 1) return p;
    return last_start;
}

/* GPT-2's pattern: one piece starting at pos (< end); returns its end. */
static size_t next_gpt2(const unsigned char *s, size_t pos, size_t end) {
    size_t m = match_contraction(s, pos, end, 0);
    if (m) return pos + m;
    cp_info c0 = cp_at(s, pos, end);
    if (c0.cp == ' ' && pos + 1 < end) { /* ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` */
        cp_info c1 = cp_at(s, pos + 1, end);
        if (c1.cls != KVC__CP_SPACE) return run_of(s, pos + 1, end, c1.cls, -1);
    }
    if (c0.cls != KVC__CP_SPACE) return run_of(s, pos, end, c0.cls, -1);
    return match_space(s, pos, end, 0);
}

/* [\r\n]* after position p. */
static size_t run_cr_lf(const unsigned char *s, size_t p, size_t end) {
    while (p < end && is_cr_lf(s[p])) p++;
    return p;
}

/* Llama 3's / Qwen 2's pattern (max_digits 3 or 1). */
static size_t next_llama3(const unsigned char *s, size_t pos, size_t end, int max_digits) {
    size_t m = match_contraction(s, pos, end, 1);
    if (m) return pos + m;
    cp_info c0 = cp_at(s, pos, end);
    if (c0.cls == KVC__CP_LETTER) return run_of(s, pos, end, KVC__CP_LETTER, -1);
    size_t p1 = pos + (size_t)c0.len;
    cp_info c1 = {0, -1, 0};
    if (p1 < end) c1 = cp_at(s, p1, end);
    /* `[^\r\n\p{L}\p{N}]?\p{L}+`: one non-letter, non-number, non-newline
     * code point (a space, a tab, punctuation) may lead a word. */
    if (c0.cls != KVC__CP_NUMBER && !is_cr_lf(c0.cp) && c1.cls == KVC__CP_LETTER)
        return run_of(s, p1, end, KVC__CP_LETTER, -1);
    if (c0.cls == KVC__CP_NUMBER) return run_of(s, pos, end, KVC__CP_NUMBER, max_digits);
    /* ` ?[^\s\p{L}\p{N}]+[\r\n]*` */
    if (c0.cp == ' ' && c1.cls == KVC__CP_OTHER)
        return run_cr_lf(s, run_of(s, p1, end, KVC__CP_OTHER, -1), end);
    if (c0.cls == KVC__CP_OTHER) return run_cr_lf(s, run_of(s, pos, end, KVC__CP_OTHER, -1), end);
    return match_space(s, pos, end, 1);
}

/* ---- hash maps ------------------------------------------------------------- */

static uint64_t hash_bytes(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x) { /* splitmix64 finalizer */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Open addressing, power-of-two capacity at most half full. */
typedef struct merge_slot {
    uint64_t key; /* (left id << 32) | right id */
    int32_t rank; /* -1: empty */
    int32_t result;
} merge_slot;

static size_t table_cap(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 2) cap <<= 1;
    return cap;
}

/* ---- the tokenizer -------------------------------------------------------- */

struct kvc_tokenizer {
    int32_t n_vocab;
    char *text;                 /* token texts, concatenated */
    size_t *text_off;           /* (n_vocab + 1) offsets into text */
    int32_t *types;             /* (n_vocab) kvc_token_type */
    char *piece;                /* decoded bytes of every token, concatenated */
    size_t *piece_off;          /* (n_vocab + 1) */
    int32_t *tok_map;           /* text -> id, open addressing (-1 empty) */
    size_t tok_map_cap;         /* power of two */
    merge_slot *merges;         /* (left, right) -> rank, merged id */
    size_t merge_cap;           /* power of two */
    int32_t byte_tok[256];      /* GPT-2 byte token of every byte, -1 if missing */
    int32_t *specials;          /* special-token ids, by first byte then longest first */
    int32_t special_start[257]; /* specials[special_start[b]..special_start[b+1]) start with b */
    pre_kind pre;
    int ignore_merges;
    char pre_name[32];
    int32_t bos, eos, eot, unk, pad;
    int add_bos;
    int32_t eog[16]; /* end-of-generation ids */
    int n_eog;
    char *chat_template; /* NUL-terminated copy, or NULL */
    size_t chat_template_len;
};

static size_t tok_len(const kvc_tokenizer *t, int32_t id) {
    return t->text_off[id + 1] - t->text_off[id];
}

static const char *tok_text(const kvc_tokenizer *t, int32_t id) {
    return t->text + t->text_off[id];
}

/* Id of the token whose text is s[0..n), or -1. */
static int32_t find_token(const kvc_tokenizer *t, const char *s, size_t n) {
    size_t mask = t->tok_map_cap - 1;
    for (size_t i = hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t id = t->tok_map[i];
        if (id < 0) return -1;
        if (tok_len(t, id) == n && memcmp(tok_text(t, id), s, n) == 0) return id;
    }
}

static const merge_slot *find_merge(const kvc_tokenizer *t, int32_t left, int32_t right) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    size_t mask = t->merge_cap - 1;
    for (size_t i = hash_u64(key) & mask;; i = (i + 1) & mask) {
        const merge_slot *m = &t->merges[i];
        if (m->rank < 0) return NULL;
        if (m->key == key) return m;
    }
}

static int is_special_type(int32_t type) {
    return type == KVC_TOKEN_CONTROL || type == KVC_TOKEN_USER_DEFINED;
}

void kvc_tokenizer_destroy(kvc_tokenizer *t) {
    if (!t) return;
    free(t->text);
    free(t->text_off);
    free(t->types);
    free(t->piece);
    free(t->piece_off);
    free(t->tok_map);
    free(t->merges);
    free(t->specials);
    free(t->chat_template);
    free(t);
}

/* Decoded bytes of token id into out (room for 4 * its text length); returns
 * the length. Byte-level tokens go through GPT-2's table character by
 * character; a character outside the table (not produced by GPT-2's mapping)
 * is kept as UTF-8 so nothing is lost. */
static size_t decode_token(const kvc_tokenizer *t, int32_t id, char *out) {
    const unsigned char *s = (const unsigned char *)tok_text(t, id);
    size_t n = tok_len(t, id), o = 0;
    int32_t type = t->types[id];
    if (is_special_type(type) || type == KVC_TOKEN_UNKNOWN) {
        memcpy(out, s, n);
        return n;
    }
    if (type == KVC_TOKEN_BYTE && n == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>') {
        unsigned v = 0; /* "<0xHH>" */
        int ok = 1;
        for (int i = 3; i < 5; i++) {
            int c = s[i], d = c >= '0' && c <= '9'                 ? c - '0'
                              : (c | 32) >= 'a' && (c | 32) <= 'f' ? (c | 32) - 'a' + 10
                                                                   : -1;
            if (d < 0) ok = 0;
            v = v * 16 + (unsigned)(d < 0 ? 0 : d);
        }
        if (ok) {
            out[0] = (char)v;
            return 1;
        }
    }
    for (size_t p = 0; p < n;) {
        int adv;
        uint32_t cp = kvc__utf8_decode(s + p, n - p, &adv);
        int b = kvc__cp_to_byte(cp);
        if (b >= 0)
            out[o++] = (char)b;
        else
            for (int k = 0; k < adv; k++) out[o++] = (char)s[p + k];
        p += (size_t)adv;
    }
    return o;
}

static kvc_status check_id(const kvc_tokenizer_vocab *v, int32_t id, const char *what) {
    if (id < -1 || id >= v->n_vocab)
        return kvc__error(KVC_ERR_INVALID_ARG, "tokenizer: %s %d out of range [-1, %d)", what,
                          (int)id, (int)v->n_vocab);
    return KVC_OK;
}

static size_t text_len(const char *s, const size_t *lens, int64_t i) {
    return lens ? lens[i] : strlen(s);
}

/* Copies the token texts, types and decoded pieces; builds text -> id. */
static kvc_status build_vocab(kvc_tokenizer *t, const kvc_tokenizer_vocab *v) {
    int32_t n = v->n_vocab;
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        KVC_CHECK(v->tokens[i] != NULL, "tokenizer: token %d is NULL", (int)i);
        size_t len = text_len(v->tokens[i], v->token_lens, i);
        KVC_CHECK(len <= ((size_t)1 << 30), "tokenizer: token %d is %zu bytes long", (int)i, len);
        total += len;
        if (v->token_types)
            KVC_CHECK(v->token_types[i] >= KVC_TOKEN_UNDEFINED &&
                          v->token_types[i] <= KVC_TOKEN_BYTE,
                      "tokenizer: token %d has type %d, want 0..6", (int)i, (int)v->token_types[i]);
    }
    t->text = malloc(total ? total : 1);
    t->text_off = malloc(((size_t)n + 1) * sizeof *t->text_off);
    t->types = malloc((size_t)n * sizeof *t->types);
    t->piece = malloc(total ? total * 4 : 1);
    t->piece_off = malloc(((size_t)n + 1) * sizeof *t->piece_off);
    t->tok_map_cap = table_cap((size_t)n);
    t->tok_map = malloc(t->tok_map_cap * sizeof *t->tok_map);
    if (!t->text || !t->text_off || !t->types || !t->piece || !t->piece_off || !t->tok_map)
        return kvc__error(KVC_ERR_NOMEM, "tokenizer: out of memory for %d tokens", (int)n);
    size_t off = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t len = text_len(v->tokens[i], v->token_lens, i);
        memcpy(t->text + off, v->tokens[i], len);
        t->text_off[i] = off;
        off += len;
        t->types[i] = v->token_types ? v->token_types[i] : KVC_TOKEN_NORMAL;
    }
    t->text_off[n] = off;
    memset(t->tok_map, 0xff, t->tok_map_cap * sizeof *t->tok_map);
    size_t mask = t->tok_map_cap - 1, poff = 0;
    for (int32_t i = 0; i < n; i++) {
        if (find_token(t, tok_text(t, i), tok_len(t, i)) < 0) { /* first of duplicates wins */
            size_t h = hash_bytes(tok_text(t, i), tok_len(t, i)) & mask;
            while (t->tok_map[h] >= 0) h = (h + 1) & mask;
            t->tok_map[h] = i;
        }
        t->piece_off[i] = poff;
        poff += decode_token(t, i, t->piece + poff);
    }
    t->piece_off[n] = poff;
    return KVC_OK;
}

/* Parses "left right" merges into the pair table; a merge whose parts or
 * result are not tokens can never apply and is skipped. */
static kvc_status build_merges(kvc_tokenizer *t, const kvc_tokenizer_vocab *v) {
    t->merge_cap = table_cap((size_t)v->n_merges);
    t->merges = malloc(t->merge_cap * sizeof *t->merges);
    if (!t->merges) return kvc__error(KVC_ERR_NOMEM, "tokenizer: out of memory for merges");
    for (size_t i = 0; i < t->merge_cap; i++) t->merges[i].rank = -1;
    char *buf = NULL;
    size_t buf_cap = 0;
    for (int32_t r = 0; r < v->n_merges; r++) {
        const char *m = v->merges[r];
        if (!m) {
            free(buf);
            return kvc__error(KVC_ERR_INVALID_ARG, "tokenizer: merge %d is NULL", (int)r);
        }
        size_t len = text_len(m, v->merge_lens, r), sp = 1;
        while (sp < len && m[sp] != ' ') sp++; /* the first space after the first byte */
        if (sp >= len) {
            free(buf);
            return kvc__error(KVC_ERR_INVALID_ARG,
                              "tokenizer: merge %d (\"%.*s\") is not \"left right\"", (int)r,
                              (int)(len < 64 ? len : 64), m);
        }
        int32_t left = find_token(t, m, sp), right = find_token(t, m + sp + 1, len - sp - 1);
        if (len > buf_cap) {
            char *nb = realloc(buf, len);
            if (!nb) {
                free(buf);
                return kvc__error(KVC_ERR_NOMEM, "tokenizer: out of memory");
            }
            buf = nb;
            buf_cap = len;
        }
        memcpy(buf, m, sp);
        memcpy(buf + sp, m + sp + 1, len - sp - 1);
        int32_t result = find_token(t, buf, len - 1);
        if (left < 0 || right < 0 || result < 0) continue;
        uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
        size_t mask = t->merge_cap - 1, h = hash_u64(key) & mask;
        while (t->merges[h].rank >= 0 && t->merges[h].key != key) h = (h + 1) & mask;
        if (t->merges[h].rank >= 0) continue; /* duplicate pair: the lower rank stays */
        t->merges[h].key = key;
        t->merges[h].rank = r;
        t->merges[h].result = result;
    }
    free(buf);
    return KVC_OK;
}

/* Sort key of a special token: by first byte, then longest first, then id. */
typedef struct special_key {
    unsigned first;
    size_t len;
    int32_t id;
} special_key;

static int special_cmp(const void *a, const void *b) {
    const special_key *x = a, *y = b;
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static kvc_status build_specials(kvc_tokenizer *t) {
    int32_t n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (is_special_type(t->types[i]) && tok_len(t, i) > 0) n++;
    special_key *keys = malloc((size_t)(n ? n : 1) * sizeof *keys);
    t->specials = malloc((size_t)(n ? n : 1) * sizeof *t->specials);
    if (!keys || !t->specials) {
        free(keys);
        return kvc__error(KVC_ERR_NOMEM, "tokenizer: out of memory");
    }
    n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (is_special_type(t->types[i]) && tok_len(t, i) > 0)
            keys[n++] = (special_key){(unsigned char)tok_text(t, i)[0], tok_len(t, i), i};
    qsort(keys, (size_t)n, sizeof *keys, special_cmp);
    int32_t j = 0;
    for (unsigned b = 0; b < 256; b++) {
        t->special_start[b] = j;
        while (j < n && keys[j].first == b) {
            t->specials[j] = keys[j].id;
            j++;
        }
    }
    t->special_start[256] = n;
    free(keys);
    return KVC_OK;
}

/* Texts of the controls that end a turn or a document in common chat
 * models; present ones join eos/eot in kvc_tokenizer_is_eog. */
static const char *const eog_texts[] = {
    "<|im_end|>", "<|eot_id|>",      "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<|end_of_text|>", "<EOT>",   "<|return|>",
};
/* End-of-turn candidates for kvc_tokenizer_eot, in order of preference. */
static const char *const eot_texts[] = {"<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"};

static void add_eog(kvc_tokenizer *t, int32_t id) {
    if (id < 0) return;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return;
    if (t->n_eog < (int)(sizeof t->eog / sizeof t->eog[0])) t->eog[t->n_eog++] = id;
}

static void find_eot_eog(kvc_tokenizer *t, int32_t eot) {
    t->eot = eot;
    for (size_t i = 0; t->eot < 0 && i < sizeof eot_texts / sizeof eot_texts[0]; i++) {
        int32_t id = find_token(t, eot_texts[i], strlen(eot_texts[i]));
        if (id >= 0 && is_special_type(t->types[id])) t->eot = id;
    }
    if (t->eot < 0) t->eot = t->eos;
    add_eog(t, t->eos);
    add_eog(t, t->eot);
    for (size_t i = 0; i < sizeof eog_texts / sizeof eog_texts[0]; i++) {
        int32_t id = find_token(t, eog_texts[i], strlen(eog_texts[i]));
        if (id >= 0 && t->types[id] == KVC_TOKEN_CONTROL) add_eog(t, id);
    }
}

kvc_status kvc_tokenizer_create(const kvc_tokenizer_vocab *v, kvc_tokenizer **out) {
    KVC_CHECK(out != NULL, "kvc_tokenizer_create: out is NULL");
    *out = NULL;
    KVC_CHECK(v != NULL, "kvc_tokenizer_create: vocab is NULL");
    KVC_CHECK(v->n_vocab > 0, "kvc_tokenizer_create: n_vocab is %d, want > 0", (int)v->n_vocab);
    KVC_CHECK(v->tokens != NULL, "kvc_tokenizer_create: tokens is NULL");
    KVC_CHECK(v->n_merges >= 0, "kvc_tokenizer_create: n_merges is %d", (int)v->n_merges);
    KVC_CHECK(v->n_merges == 0 || v->merges != NULL, "kvc_tokenizer_create: merges is NULL");
    KVC_TRY(check_id(v, v->bos_id, "bos_id"));
    KVC_TRY(check_id(v, v->eos_id, "eos_id"));
    KVC_TRY(check_id(v, v->eot_id, "eot_id"));
    KVC_TRY(check_id(v, v->unk_id, "unk_id"));
    KVC_TRY(check_id(v, v->pad_id, "pad_id"));
    const char *pre = v->pre ? v->pre : "gpt2";
    const int kind = pre_index(pre);
    if (kind < 0)
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "tokenizer: pre-tokenizer \"%.40s\" is not supported (supported: gpt2, "
                          "smollm, llama-bpe/llama3, qwen2 and their aliases)",
                          pre);

    kvc_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return kvc__error(KVC_ERR_NOMEM, "tokenizer: out of memory");
    t->n_vocab = v->n_vocab;
    t->pre = pre_names[kind].kind;
    t->ignore_merges = pre_names[kind].llama3;
    snprintf(t->pre_name, sizeof t->pre_name, "%s", pre_names[kind].name);
    t->bos = v->bos_id;
    t->eos = v->eos_id;
    t->unk = v->unk_id;
    t->pad = v->pad_id;
    t->add_bos = v->add_bos != 0;
    kvc_status st = build_vocab(t, v);
    if (st == KVC_OK) st = build_merges(t, v);
    if (st == KVC_OK) st = build_specials(t);
    if (st != KVC_OK) {
        kvc_tokenizer_destroy(t);
        return st;
    }
    for (int b = 0; b < 256; b++) {
        unsigned char u[4];
        int n = kvc__utf8_encode(kvc__byte_to_cp((unsigned char)b), u);
        t->byte_tok[b] = find_token(t, (const char *)u, (size_t)n);
    }
    find_eot_eog(t, v->eot_id);
    *out = t;
    return KVC_OK;
}

/* ---- from GGUF -------------------------------------------------------------- */

/* Optional token id under key: -1 if absent; KVC_ERR_CORRUPT if present but
 * not an integer in [0, n_vocab). */
static kvc_status gguf_token_id(const kvc_gguf *g, const char *key, int32_t n_vocab, int32_t *id) {
    int64_t v;
    *id = -1;
    kvc_status st = kvc_gguf_get_i64(g, key, &v);
    if (st == KVC_ERR_NOT_FOUND) return KVC_OK;
    if (st != KVC_OK) return kvc__error(KVC_ERR_CORRUPT, "tokenizer: %s is not an integer", key);
    if (v < 0 || v >= n_vocab)
        return kvc__error(KVC_ERR_CORRUPT, "tokenizer: %s = %lld is outside the vocabulary (%d)",
                          key, (long long)v, (int)n_vocab);
    *id = (int32_t)v;
    return KVC_OK;
}

/* Pointers and lengths of the n elements of string array key. */
static kvc_status gguf_strings(const kvc_gguf *g, const char *key, int64_t n, const char **s,
                               size_t *lens) {
    for (int64_t i = 0; i < n; i++) {
        kvc_status st = kvc_gguf_get_arr_str(g, key, i, &s[i], &lens[i]);
        if (st != KVC_OK) {
            char why[256]; /* kvc__error reuses the buffer kvc_last_error() points into */
            snprintf(why, sizeof why, "%s", kvc_last_error());
            return kvc__error(st, "tokenizer: cannot read %s[%lld]: %s", key, (long long)i, why);
        }
    }
    return KVC_OK;
}

/*
 * Every tokenizer.* key is one this loader reads, one that cannot change the
 * tokens (listed with why), a switch that is fine while off, or refused by
 * name: a file whose tokenizer does something this one does not must not
 * load and tokenize differently without a word.
 */
static const char *const tok_keys_read[] = {
    "ggml.model", "ggml.pre", "ggml.tokens", "ggml.token_type", "ggml.merges",
    "ggml.add_bos_token", "ggml.bos_token_id", "ggml.eos_token_id", "ggml.eot_token_id",
    "ggml.unknown_token_id", "ggml.padding_token_id", "chat_template",
};
/* ids of tokens nothing here inserts or treats specially (BERT separators,
 * fill-in-the-middle markers), SentencePiece scores (byte-level BPE ranks
 * merges by their order), the Hugging Face tokenizer JSON kept for reference */
static const char *const tok_keys_harmless[] = {
    "ggml.scores", "ggml.token_type_count", "ggml.sep_token_id", "ggml.cls_token_id",
    "ggml.mask_token_id", "ggml.fim_pre_token_id", "ggml.fim_suf_token_id",
    "ggml.fim_mid_token_id", "ggml.fim_pad_token_id", "ggml.fim_rep_token_id",
    "ggml.fim_sep_token_id", "ggml.prefix_token_id", "ggml.suffix_token_id",
    "ggml.middle_token_id", "huggingface.json",
};
/* booleans whose true would change the tokens: not implemented, so refused */
static const char *const tok_keys_off_only[] = {
    "ggml.add_eos_token", "ggml.add_sep_token", "ggml.add_space_prefix",
    "ggml.remove_extra_whitespaces",
};

static int in_list(const char *k, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(k, list[i]) == 0) return 1;
    return 0;
}

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

static kvc_status check_tokenizer_keys(const kvc_gguf *g) {
    const int64_t n = kvc_gguf_n_kv(g);
    for (int64_t i = 0; i < n; i++) {
        const char *key = kvc_gguf_key(g, i);
        if (strncmp(key, "tokenizer.", 10) != 0) continue;
        const char *k = key + 10;
        /* named templates (tool_use, rag, ...): the default one is used */
        if (strncmp(k, "chat_template.", 14) == 0) continue;
        if (in_list(k, tok_keys_read, COUNT(tok_keys_read)) ||
            in_list(k, tok_keys_harmless, COUNT(tok_keys_harmless)))
            continue;
        if (in_list(k, tok_keys_off_only, COUNT(tok_keys_off_only))) {
            int64_t on = 0;
            if (kvc_gguf_get_i64(g, key, &on) != KVC_OK)
                return kvc__error(KVC_ERR_CORRUPT, "tokenizer: %s is not a boolean", key);
            if (on)
                return kvc__error(KVC_ERR_UNSUPPORTED,
                                  "tokenizer: %s = true is not implemented (the tokens would "
                                  "differ): refused rather than ignored",
                                  key);
            continue;
        }
        if (strcmp(k, "ggml.eom_token_id") == 0) continue; /* checked once created */
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "tokenizer: metadata key %.200s is not understood by this tokenizer: "
                          "refused rather than ignored",
                          key);
    }
    return KVC_OK;
}

kvc_status kvc_tokenizer_from_gguf(const kvc_gguf *g, kvc_tokenizer **out) {
    KVC_CHECK(out != NULL, "kvc_tokenizer_from_gguf: out is NULL");
    *out = NULL;
    KVC_CHECK(g != NULL, "kvc_tokenizer_from_gguf: gguf is NULL");
    const char *s;
    size_t len;
    kvc_status st = kvc_gguf_get_str(g, "tokenizer.ggml.model", &s, &len);
    if (st == KVC_ERR_NOT_FOUND)
        return kvc__error(KVC_ERR_NOT_FOUND, "tokenizer: the model has no tokenizer.ggml.model");
    if (st != KVC_OK) return kvc__error(KVC_ERR_CORRUPT, "tokenizer.ggml.model is not a string");
    KVC_TRY(check_tokenizer_keys(g));
    if (len != 4 || memcmp(s, "gpt2", 4) != 0)
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "tokenizer: tokenizer model \"%.*s\" is not supported (only \"gpt2\", "
                          "byte-level BPE)",
                          (int)(len < 40 ? len : 40), s);
    char pre[64];
    st = kvc_gguf_get_str(g, "tokenizer.ggml.pre", &s, &len);
    if (st == KVC_ERR_NOT_FOUND)
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "tokenizer: the model has no tokenizer.ggml.pre, so its pre-tokenizer "
                          "is unknown");
    if (st != KVC_OK) return kvc__error(KVC_ERR_CORRUPT, "tokenizer.ggml.pre is not a string");
    if (len >= sizeof pre || memchr(s, 0, len))
        return kvc__error(KVC_ERR_UNSUPPORTED, "tokenizer: pre-tokenizer \"%.*s\" is not supported",
                          (int)(len < 40 ? len : 40), s);
    memcpy(pre, s, len);
    pre[len] = 0;

    kvc_gguf_type et;
    int64_t n_vocab, n_merges = 0, n_types;
    const void *data;
    st = kvc_gguf_get_arr(g, "tokenizer.ggml.tokens", &et, &n_vocab, &data);
    if (st != KVC_OK || et != KVC_GGUF_STRING || n_vocab <= 0 || n_vocab > INT32_MAX)
        return kvc__error(KVC_ERR_CORRUPT, "tokenizer: tokenizer.ggml.tokens is missing or not a "
                                           "non-empty string array");
    const void *types = NULL;
    st = kvc_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &n_types, &types);
    if (st == KVC_OK && (et != KVC_GGUF_INT32 || n_types != n_vocab))
        return kvc__error(KVC_ERR_CORRUPT,
                          "tokenizer: tokenizer.ggml.token_type must be %lld int32 values",
                          (long long)n_vocab);
    if (st != KVC_OK) types = NULL;
    st = kvc_gguf_get_arr(g, "tokenizer.ggml.merges", &et, &n_merges, &data);
    if (st == KVC_OK && (et != KVC_GGUF_STRING || n_merges > INT32_MAX))
        return kvc__error(KVC_ERR_CORRUPT,
                          "tokenizer: tokenizer.ggml.merges is not a string array");
    if (st != KVC_OK) n_merges = 0;

    kvc_tokenizer_vocab v;
    memset(&v, 0, sizeof v);
    v.n_vocab = (int32_t)n_vocab;
    v.n_merges = (int32_t)n_merges;
    v.pre = pre;
    const char **tok = malloc((size_t)n_vocab * sizeof *tok);
    size_t *tok_lens = malloc((size_t)n_vocab * sizeof *tok_lens);
    int32_t *tt = malloc((size_t)n_vocab * sizeof *tt);
    const char **mer = malloc((size_t)(n_merges ? n_merges : 1) * sizeof *mer);
    size_t *mer_lens = malloc((size_t)(n_merges ? n_merges : 1) * sizeof *mer_lens);
    kvc_tokenizer *t = NULL;
    if (!tok || !tok_lens || !tt || !mer || !mer_lens) {
        st = kvc__error(KVC_ERR_NOMEM, "tokenizer: out of memory");
        goto done;
    }
    st = gguf_strings(g, "tokenizer.ggml.tokens", n_vocab, tok, tok_lens);
    if (st == KVC_OK) st = gguf_strings(g, "tokenizer.ggml.merges", n_merges, mer, mer_lens);
    if (st != KVC_OK) goto done;
    for (int64_t i = 0; i < n_vocab; i++) {
        int32_t x = KVC_TOKEN_NORMAL;
        if (types) memcpy(&x, (const char *)types + 4 * i, 4); /* little-endian int32 */
        if (x < KVC_TOKEN_UNDEFINED || x > KVC_TOKEN_BYTE) {
            st = kvc__error(KVC_ERR_CORRUPT, "tokenizer: token %lld has type %d, want 0..6",
                            (long long)i, (int)x);
            goto done;
        }
        tt[i] = x;
    }
    v.tokens = tok;
    v.token_lens = tok_lens;
    v.token_types = tt;
    v.merges = mer;
    v.merge_lens = mer_lens;
    /* absent: llama.cpp's default, BOS for the Llama 3 family (its files
     * often leave the key out), none otherwise */
    const int pi = pre_index(pre);
    int64_t add_bos = pi >= 0 && pre_names[pi].llama3;
    if (kvc_gguf_find_key(g, "tokenizer.ggml.add_bos_token") >= 0 &&
        kvc_gguf_get_i64(g, "tokenizer.ggml.add_bos_token", &add_bos) != KVC_OK) {
        st = kvc__error(KVC_ERR_CORRUPT, "tokenizer: tokenizer.ggml.add_bos_token is not a "
                        "boolean");
        goto done;
    }
    v.add_bos = add_bos != 0;
    if ((st = gguf_token_id(g, "tokenizer.ggml.bos_token_id", v.n_vocab, &v.bos_id)) ||
        (st = gguf_token_id(g, "tokenizer.ggml.eos_token_id", v.n_vocab, &v.eos_id)) ||
        (st = gguf_token_id(g, "tokenizer.ggml.eot_token_id", v.n_vocab, &v.eot_id)) ||
        (st = gguf_token_id(g, "tokenizer.ggml.unknown_token_id", v.n_vocab, &v.unk_id)) ||
        (st = gguf_token_id(g, "tokenizer.ggml.padding_token_id", v.n_vocab, &v.pad_id)))
        goto done;
    st = kvc_tokenizer_create(&v, &t);
    if (st != KVC_OK) goto done;
    /* an end-of-message token (Llama 3.1's <|eom_id|>) must end generation
     * here too; one that kvc_tokenizer_is_eog does not know is refused */
    int32_t eom = -1;
    if ((st = gguf_token_id(g, "tokenizer.ggml.eom_token_id", v.n_vocab, &eom))) goto done;
    if (eom >= 0 && !kvc_tokenizer_is_eog(t, eom)) {
        st = kvc__error(KVC_ERR_UNSUPPORTED,
                        "tokenizer: tokenizer.ggml.eom_token_id %d is not a token this runtime "
                        "ends generation at: refused rather than ignored",
                        (int)eom);
        goto done;
    }
    st = kvc_gguf_get_str(g, "tokenizer.chat_template", &s, &len);
    if (st == KVC_OK) {
        t->chat_template = malloc(len + 1);
        if (!t->chat_template) {
            st = kvc__error(KVC_ERR_NOMEM, "tokenizer: out of memory");
            goto done;
        }
        memcpy(t->chat_template, s, len);
        t->chat_template[len] = 0;
        t->chat_template_len = len;
    }
    st = KVC_OK;
done:
    free(tok);
    free(tok_lens);
    free(tt);
    free(mer);
    free(mer_lens);
    if (st != KVC_OK) {
        kvc_tokenizer_destroy(t);
        return st;
    }
    *out = t;
    return KVC_OK;
}

/* ---- accessors -------------------------------------------------------------- */

int32_t kvc_tokenizer_n_vocab(const kvc_tokenizer *t) {
    return t ? t->n_vocab : 0;
}
int kvc_tokenizer_add_bos(const kvc_tokenizer *t) { return t ? t->add_bos && t->bos >= 0 : 0; }

int32_t kvc_tokenizer_bos(const kvc_tokenizer *t) {
    return t ? t->bos : -1;
}
int32_t kvc_tokenizer_eos(const kvc_tokenizer *t) {
    return t ? t->eos : -1;
}
int32_t kvc_tokenizer_eot(const kvc_tokenizer *t) {
    return t ? t->eot : -1;
}
int32_t kvc_tokenizer_token_type(const kvc_tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->n_vocab ? t->types[id] : -1;
}

int kvc_tokenizer_is_eog(const kvc_tokenizer *t, int32_t id) {
    if (!t || id < 0) return 0;
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id) return 1;
    return 0;
}

const char *kvc__tokenizer_chat_template(const kvc_tokenizer *t, size_t *len) {
    *len = t ? t->chat_template_len : 0;
    return t ? t->chat_template : NULL;
}

const char *kvc__tokenizer_piece(const kvc_tokenizer *t, int32_t id, size_t *len) {
    if (!t || id < 0 || id >= t->n_vocab) {
        *len = 0;
        return NULL;
    }
    *len = t->piece_off[id + 1] - t->piece_off[id];
    return t->piece + t->piece_off[id];
}

/* ---- encoding --------------------------------------------------------------- */

typedef struct sym {
    int32_t id;         /* -1 once merged into its left neighbour */
    int32_t prev, next; /* neighbours in the piece, -1 at the ends */
} sym;

typedef struct cand { /* a mergeable adjacent pair */
    int32_t rank;
    int32_t left;     /* symbol index of the left part */
    int32_t lid, rid; /* ids when queued: a stale entry no longer matches */
} cand;

typedef struct encoder {
    const kvc_tokenizer *t;
    int32_t *ids; /* output, grown as needed */
    int64_t n, cap;
    sym *syms;
    size_t syms_cap;
    cand *heap;
    size_t heap_n, heap_cap;
    char *mapped; /* the piece in GPT-2 characters (ignore_merges lookups) */
    size_t mapped_cap;
} encoder;

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 1;
    size_t nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    if (nc > SIZE_MAX / elem) return 0;
    void *q = realloc(*p, nc * elem);
    if (!q) return 0;
    *p = q;
    *cap = nc;
    return 1;
}

static kvc_status emit(encoder *e, int32_t id) {
    if (e->n == e->cap) {
        size_t cap = (size_t)e->cap;
        if (!grow((void **)&e->ids, &cap, (size_t)e->n + 1, sizeof *e->ids))
            return kvc__error(KVC_ERR_NOMEM, "kvc_tokenize: out of memory after %lld tokens",
                              (long long)e->n);
        e->cap = (int64_t)cap;
    }
    e->ids[e->n++] = id;
    return KVC_OK;
}

static int cand_less(const cand *a, const cand *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->left < b->left;
}

/* Queues the pair (left, its right neighbour) if the vocabulary merges it. */
static kvc_status push_pair(encoder *e, int32_t left) {
    if (left < 0) return KVC_OK;
    int32_t right = e->syms[left].next;
    if (right < 0) return KVC_OK;
    const merge_slot *m = find_merge(e->t, e->syms[left].id, e->syms[right].id);
    if (!m) return KVC_OK;
    if (!grow((void **)&e->heap, &e->heap_cap, e->heap_n + 1, sizeof *e->heap))
        return kvc__error(KVC_ERR_NOMEM, "kvc_tokenize: out of memory");
    cand c = {m->rank, left, e->syms[left].id, e->syms[right].id};
    size_t i = e->heap_n++;
    while (i > 0) { /* sift up */
        size_t parent = (i - 1) / 2;
        if (!cand_less(&c, &e->heap[parent])) break;
        e->heap[i] = e->heap[parent];
        i = parent;
    }
    e->heap[i] = c;
    return KVC_OK;
}

static cand pop_min(encoder *e) {
    cand top = e->heap[0], last = e->heap[--e->heap_n];
    size_t i = 0, n = e->heap_n;
    for (;;) { /* sift down */
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && cand_less(&e->heap[c + 1], &e->heap[c])) c++;
        if (!cand_less(&e->heap[c], &last)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n) e->heap[i] = last;
    return top;
}

static kvc_status byte_token(const kvc_tokenizer *t, unsigned char b, int32_t *id) {
    *id = t->byte_tok[b] >= 0 ? t->byte_tok[b] : t->unk;
    if (*id < 0)
        return kvc__error(KVC_ERR_INVALID_ARG,
                          "kvc_tokenize: the vocabulary has no token for byte 0x%02x and no "
                          "unknown token",
                          b);
    return KVC_OK;
}

/* BPE of one pre-tokenized piece s[0..n), n >= 1. */
static kvc_status encode_piece(encoder *e, const unsigned char *s, size_t n) {
    const kvc_tokenizer *t = e->t;
    int32_t id;
    if (n == 1) {
        KVC_TRY(byte_token(t, s[0], &id));
        return emit(e, id);
    }
    if (n > INT32_MAX / 2)
        return kvc__error(KVC_ERR_INVALID_ARG, "kvc_tokenize: a %zu-byte piece is too long", n);
    if (t->ignore_merges) { /* a piece that is a token is that token */
        if (!grow((void **)&e->mapped, &e->mapped_cap, 2 * n, 1))
            return kvc__error(KVC_ERR_NOMEM, "kvc_tokenize: out of memory");
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            m += (size_t)kvc__utf8_encode(kvc__byte_to_cp(s[i]), (unsigned char *)e->mapped + m);
        id = find_token(t, e->mapped, m);
        if (id >= 0 && !is_special_type(t->types[id])) return emit(e, id);
    }
    if (!grow((void **)&e->syms, &e->syms_cap, n, sizeof *e->syms))
        return kvc__error(KVC_ERR_NOMEM, "kvc_tokenize: out of memory for a %zu-byte piece", n);
    for (size_t i = 0; i < n; i++) {
        KVC_TRY(byte_token(t, s[i], &e->syms[i].id));
        e->syms[i].prev = (int32_t)i - 1;
        e->syms[i].next = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    e->heap_n = 0;
    for (size_t i = 0; i + 1 < n; i++) KVC_TRY(push_pair(e, (int32_t)i));
    while (e->heap_n) {
        cand c = pop_min(e);
        sym *l = &e->syms[c.left];
        if (l->id != c.lid || l->next < 0 || e->syms[l->next].id != c.rid) continue; /* stale */
        sym *r = &e->syms[l->next];
        l->id = find_merge(t, c.lid, c.rid)->result;
        l->next = r->next;
        if (r->next >= 0) e->syms[r->next].prev = c.left;
        r->id = -1;
        KVC_TRY(push_pair(e, l->prev));
        KVC_TRY(push_pair(e, c.left));
    }
    for (int32_t i = 0; i >= 0; i = e->syms[i].next) KVC_TRY(emit(e, e->syms[i].id));
    return KVC_OK;
}

/* Calls piece(ctx, s + start, length) for every piece of s[a..b) (a stretch
 * without special tokens) under pre-tokenizer pre. */
typedef kvc_status (*piece_fn)(void *ctx, const unsigned char *p, size_t n);

static kvc_status split_text(pre_kind pre, const unsigned char *s, size_t a, size_t b,
                             piece_fn piece, void *ctx) {
    size_t pos = a;
    while (pos < b) {
        size_t end;
        if (pre == PRE_LLAMA3 || pre == PRE_QWEN2) {
            end = next_llama3(s, pos, b, pre == PRE_LLAMA3 ? 3 : 1);
        } else if (pre == PRE_GPT2) {
            end = next_gpt2(s, pos, b);
        } else { /* smollm: every number code point alone, GPT-2 between them */
            cp_info c = cp_at(s, pos, b);
            if (c.cls == KVC__CP_NUMBER) {
                end = pos + (size_t)c.len;
            } else {
                size_t chunk = pos;
                while (chunk < b) {
                    cp_info d = cp_at(s, chunk, b);
                    if (d.cls == KVC__CP_NUMBER) break;
                    chunk += (size_t)d.len;
                }
                while (pos < chunk) {
                    size_t piece_end = next_gpt2(s, pos, chunk);
                    KVC_TRY(piece(ctx, s + pos, piece_end - pos));
                    pos = piece_end;
                }
                continue;
            }
        }
        KVC_TRY(piece(ctx, s + pos, end - pos));
        pos = end;
    }
    return KVC_OK;
}

static kvc_status encode_piece_cb(void *ctx, const unsigned char *p, size_t n) {
    return encode_piece(ctx, p, n);
}

typedef struct split_out {
    const unsigned char *base;
    size_t *ends;
    size_t cap, n;
} split_out;

static kvc_status record_piece(void *ctx, const unsigned char *p, size_t n) {
    split_out *o = ctx;
    if (o->n < o->cap) o->ends[o->n] = (size_t)(p - o->base) + n;
    o->n++;
    return KVC_OK;
}

kvc_status kvc__pretokenize(const char *pre, const char *text, size_t len, size_t *ends, size_t cap,
                            size_t *n) {
    KVC_CHECK(pre && (text || !len) && n && (ends || !cap), "kvc__pretokenize: NULL argument");
    for (size_t i = 0; i < sizeof pre_names / sizeof pre_names[0]; i++) {
        if (strcmp(pre, pre_names[i].name) != 0) continue;
        split_out o = {(const unsigned char *)text, ends, cap, 0};
        KVC_TRY(
            split_text(pre_names[i].kind, (const unsigned char *)text, 0, len, record_piece, &o));
        *n = o.n;
        if (o.n > cap)
            return kvc__error(KVC_ERR_NO_SPACE, "kvc__pretokenize: %zu pieces, cap %zu", o.n, cap);
        return KVC_OK;
    }
    return kvc__error(KVC_ERR_UNSUPPORTED, "kvc__pretokenize: unknown pre-tokenizer \"%.40s\"",
                      pre);
}

/* Id of the special token starting at s[pos] (leftmost-longest), or -1. */
static int32_t match_special(const kvc_tokenizer *t, const unsigned char *s, size_t pos, size_t len,
                             int parse_special) {
    for (int32_t k = t->special_start[s[pos]]; k < t->special_start[s[pos] + 1]; k++) {
        int32_t id = t->specials[k];
        if (!parse_special && t->types[id] == KVC_TOKEN_CONTROL) continue;
        size_t n = tok_len(t, id);
        if (n <= len - pos && memcmp(s + pos, tok_text(t, id), n) == 0) return id;
    }
    return -1;
}

int kvc__has_control_text(const kvc_tokenizer *t, const char *text, size_t len) {
    const unsigned char *s = (const unsigned char *)text;
    for (size_t pos = 0; pos < len; pos++) {
        const int32_t id = match_special(t, s, pos, len, 1);
        if (id >= 0 && t->types[id] == KVC_TOKEN_CONTROL) return 1;
    }
    return 0;
}

/* The CONTROL token at s[pos] allowed where it stands: not overlapping a
 * plain span (spans sorted; *k the first span not ending before pos). */
static int32_t match_outside(const kvc_tokenizer *t, const unsigned char *s, size_t pos,
                             size_t len, int parse_special, const size_t *spans, int64_t n_spans,
                             int64_t *k) {
    while (*k < n_spans && spans[2 * *k + 1] <= pos) (*k)++;
    const int in_span = *k < n_spans && spans[2 * *k] <= pos;
    int32_t id = match_special(t, s, pos, len, parse_special && !in_span);
    if (id >= 0 && t->types[id] == KVC_TOKEN_CONTROL && *k < n_spans &&
        spans[2 * *k] < pos + tok_len(t, id))
        id = match_special(t, s, pos, len, 0); /* it would reach into the span */
    return id;
}

static kvc_status tokenize(const char *fn, const kvc_tokenizer *t, const char *text, size_t len,
                           int add_bos, int parse_special, const size_t *spans, int64_t n_spans,
                           int32_t *tokens, int64_t cap, int64_t *n_tokens) {
    KVC_CHECK(t != NULL, "%s: tokenizer is NULL", fn);
    KVC_CHECK(n_tokens != NULL, "%s: n_tokens is NULL", fn);
    KVC_CHECK(text != NULL || len == 0, "%s: text is NULL", fn);
    KVC_CHECK(cap >= 0, "%s: cap is %lld", fn, (long long)cap);
    KVC_CHECK(tokens != NULL || cap == 0, "%s: tokens is NULL with cap %lld", fn, (long long)cap);
    KVC_CHECK(n_spans >= 0 && (spans != NULL || n_spans == 0), "%s: %lld spans at %p", fn,
              (long long)n_spans, (const void *)spans);
    for (int64_t i = 0; i < n_spans; i++)
        KVC_CHECK(spans[2 * i] <= spans[2 * i + 1] && spans[2 * i + 1] <= len &&
                      (i == 0 || spans[2 * i - 1] <= spans[2 * i]),
                  "%s: span %lld [%zu, %zu) is not sorted, disjoint and within the %zu bytes",
                  fn, (long long)i, spans[2 * i], spans[2 * i + 1], len);
    encoder e;
    memset(&e, 0, sizeof e);
    e.t = t;
    const unsigned char *s = (const unsigned char *)text;
    kvc_status st = KVC_OK;
    if (add_bos && t->bos >= 0) st = emit(&e, t->bos);
    size_t seg = 0;
    int64_t k = 0;
    for (size_t pos = 0; st == KVC_OK && pos < len;) {
        int32_t id = n_spans ? match_outside(t, s, pos, len, parse_special, spans, n_spans, &k)
                             : match_special(t, s, pos, len, parse_special);
        if (id < 0) {
            pos++;
            continue;
        }
        st = split_text(t->pre, s, seg, pos, encode_piece_cb, &e);
        if (st == KVC_OK) st = emit(&e, id);
        pos += tok_len(t, id);
        seg = pos;
    }
    if (st == KVC_OK) st = split_text(t->pre, s, seg, len, encode_piece_cb, &e);
    if (st == KVC_OK) {
        *n_tokens = e.n;
        if (e.n > cap)
            st = kvc__error(KVC_ERR_NO_SPACE, "%s: the text is %lld tokens, cap is %lld", fn,
                            (long long)e.n, (long long)cap);
        else if (e.n)
            memcpy(tokens, e.ids, (size_t)e.n * sizeof *tokens);
    }
    free(e.ids);
    free(e.syms);
    free(e.heap);
    free(e.mapped);
    return st;
}

kvc_status kvc_tokenize(const kvc_tokenizer *t, const char *text, size_t len, int add_bos,
                        int parse_special, int32_t *tokens, int64_t cap, int64_t *n_tokens) {
    return tokenize("kvc_tokenize", t, text, len, add_bos, parse_special, NULL, 0, tokens, cap,
                    n_tokens);
}

kvc_status kvc_tokenize_spans(const kvc_tokenizer *t, const char *text, size_t len, int add_bos,
                              const size_t *plain_spans, int64_t n_spans, int32_t *tokens,
                              int64_t cap, int64_t *n_tokens) {
    return tokenize("kvc_tokenize_spans", t, text, len, add_bos, 1, plain_spans, n_spans, tokens,
                    cap, n_tokens);
}

/* ---- decoding --------------------------------------------------------------- */

kvc_status kvc_token_to_piece(const kvc_tokenizer *t, int32_t id, char *buf, size_t cap,
                              size_t *len) {
    KVC_CHECK(t != NULL, "kvc_token_to_piece: tokenizer is NULL");
    KVC_CHECK(len != NULL, "kvc_token_to_piece: len is NULL");
    KVC_CHECK(buf != NULL || cap == 0, "kvc_token_to_piece: buf is NULL with cap %zu", cap);
    KVC_CHECK(id >= 0 && id < t->n_vocab, "kvc_token_to_piece: token id %d outside [0, %d)",
              (int)id, (int)t->n_vocab);
    size_t n;
    const char *p = kvc__tokenizer_piece(t, id, &n);
    *len = n;
    if (n > cap)
        return kvc__error(KVC_ERR_NO_SPACE, "kvc_token_to_piece: token %d is %zu bytes, cap is %zu",
                          (int)id, n, cap);
    if (n) memcpy(buf, p, n);
    return KVC_OK;
}

kvc_status kvc_detokenize(const kvc_tokenizer *t, const int32_t *ids, int64_t n, char *buf,
                          size_t cap, size_t *len) {
    KVC_CHECK(t != NULL, "kvc_detokenize: tokenizer is NULL");
    KVC_CHECK(len != NULL, "kvc_detokenize: len is NULL");
    KVC_CHECK(n >= 0, "kvc_detokenize: n is %lld", (long long)n);
    KVC_CHECK(ids != NULL || n == 0, "kvc_detokenize: ids is NULL");
    KVC_CHECK(buf != NULL || cap == 0, "kvc_detokenize: buf is NULL with cap %zu", cap);
    size_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        KVC_CHECK(ids[i] >= 0 && ids[i] < t->n_vocab,
                  "kvc_detokenize: ids[%lld] = %d outside [0, %d)", (long long)i, (int)ids[i],
                  (int)t->n_vocab);
        total += t->piece_off[ids[i] + 1] - t->piece_off[ids[i]];
    }
    *len = total;
    if (total > cap)
        return kvc__error(KVC_ERR_NO_SPACE, "kvc_detokenize: the text is %zu bytes, cap is %zu",
                          total, cap);
    size_t o = 0;
    for (int64_t i = 0; i < n; i++) {
        /* ids read again: buf laid over them (core.h: undefined) may have
         * changed them, so the id and the validated total still bound the copy */
        const int32_t id = ids[i];
        if (id < 0 || id >= t->n_vocab) continue;
        size_t k;
        const char *p = kvc__tokenizer_piece(t, id, &k);
        if (k > total - o) k = total - o;
        if (k) memcpy(buf + o, p, k);
        o += k;
    }
    return KVC_OK;
}
