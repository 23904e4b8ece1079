/*
 * libFuzzer target for the tokenizer. The first input byte picks the setup,
 * the rest is the text:
 *   bits 0-3  pre-tokenizer (index into pres[], every regex family and the
 *             ignore_merges variant)
 *   bit 4     add_bos          bit 5  parse_special
 *   bit 6     drop the byte token of 0xFF (the unknown-byte path)
 *   bit 7     with bit 6: no unknown token either (encoding must fail)
 * The vocabulary is built here: GPT-2's 256 byte tokens, merges that spell a
 * list of words (ASCII, accented, CJK, digits, contractions), a few CONTROL
 * tokens and USER_DEFINED words. Checked on every input:
 *   - encoding never fails except for an unmapped byte with no unknown token,
 *     and then leaves the caller's buffer untouched;
 *   - count <= len + 1; measuring (cap 0) gives the same count; cap = count - 1
 *     is KVC_ERR_NO_SPACE with nothing written; every id is in range;
 *   - decoding gives the text back byte for byte (after the BOS), unless the
 *     unknown token stood in for a byte; token_to_piece agrees with detokenize;
 *   - the pre-tokenizer's pieces are non-empty and cover the text;
 *   - the text read as ids detokenizes, or fails as documented for an id out
 *     of range, leaving the buffer untouched.
 * Built with clang -fsanitize=fuzzer,address,undefined when -DKVC_FUZZ=ON;
 * otherwise fuzz_replay.c replays the seed corpus through the same entry.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/tokenizer.h"
#include "../src/text/tokenizer_internal.h"
#include "fuzz.h"

static const char *const pres[16] = {
    "gpt2",   "smollm", "llama-bpe", "llama3",    "qwen2", "starcoder", "dbrx", "mpt",
    "refact", "olmo",   "stablelm2", "smaug-bpe", "jais",  "command-r", "exaone", "codeshell",
};

/* Words spelled by merges, left to right (each prefix becomes a token). A
 * leading space is written as such and becomes GPT-2's "Ġ". */
static const char *const words[] = {
    " the", " and", "ing", " in", "er", "he", " is", "'s", "'ll", "'re", " world", "hello",
    "Hello", " Hello", "123", "2024", " 42", "\n\n", "  ", "    ", "é", " café", "日本",
    " 日本語", "über", "ÅÄÖ", "!!", "...", " (", "),", "\r\n", "ab", " naïve", "🙂", "x1",
};

/* CONTROL, USER_DEFINED and UNKNOWN tokens; "ab" repeats a merged word's
 * text on purpose (of duplicate texts the first id wins), "<|im" is a prefix
 * of longer CONTROL tokens (leftmost-longest matching). */
static const struct {
    const char *text;
    int type;
} specials[] = {
    {"<|endoftext|>", KVC_TOKEN_CONTROL}, {"<|im_start|>", KVC_TOKEN_CONTROL},
    {"<|im_end|>", KVC_TOKEN_CONTROL},    {"<|im", KVC_TOKEN_CONTROL},
    {"<tool>", KVC_TOKEN_USER_DEFINED},   {"ab", KVC_TOKEN_USER_DEFINED},
    {"<unk>", KVC_TOKEN_UNKNOWN},
};

enum { MAX_TOK = 1024, MAX_TEXT = 64 };

typedef struct vocab_store {
    char text[MAX_TOK][MAX_TEXT];
    const char *tokens[MAX_TOK];
    size_t lens[MAX_TOK];
    int32_t types[MAX_TOK];
    char merge_text[MAX_TOK][2 * MAX_TEXT];
    const char *merges[MAX_TOK];
    int32_t n, n_merges;
} vocab_store;

/* GPT-2 bytes_to_unicode: printable bytes map to themselves, the others to
 * U+0100 upwards in byte order. Writes the UTF-8 of byte b's code point. */
static size_t byte_unicode(uint8_t b, char *out) {
    uint32_t cp = b;
    if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174)) {
        uint32_t k = 0;
        for (uint32_t x = 0; x < b; x++)
            if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174)) k++;
        cp = 256 + k;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

static size_t to_unicode(const char *s, size_t n, char *out) {
    size_t m = 0;
    for (size_t i = 0; i < n; i++) m += byte_unicode((uint8_t)s[i], out + m);
    return m;
}

static int32_t find_token(const vocab_store *v, const char *s, size_t n) {
    for (int32_t i = 0; i < v->n; i++)
        if (v->lens[i] == n && memcmp(v->tokens[i], s, n) == 0) return i;
    return -1;
}

static int32_t add_token(vocab_store *v, const char *s, size_t n, int type) {
    int32_t id = find_token(v, s, n);
    if (id >= 0 && type == KVC_TOKEN_NORMAL) return id;
    if (v->n == MAX_TOK || n >= MAX_TEXT) __builtin_trap();
    id = v->n++;
    memcpy(v->text[id], s, n);
    v->text[id][n] = 0;
    v->tokens[id] = v->text[id];
    v->lens[id] = n;
    v->types[id] = type;
    return id;
}

/* Builds the vocabulary; drop_ff leaves out the byte token of 0xFF. */
static void build_vocab(vocab_store *v, int drop_ff) {
    v->n = v->n_merges = 0;
    char u[8];
    for (int b = 0; b < 256; b++) {
        if (drop_ff && b == 0xFF) continue;
        add_token(v, u, byte_unicode((uint8_t)b, u), KVC_TOKEN_NORMAL);
    }
    for (size_t w = 0; w < sizeof words / sizeof words[0]; w++) {
        char full[MAX_TEXT];
        size_t n = to_unicode(words[w], strlen(words[w]), full);
        /* merge "prefix next" for each code point of the GPT-2 form */
        size_t prev = 0, i = 0;
        while (i < n) {
            size_t cl = 1;
            while (i + cl < n && ((uint8_t)full[i + cl] & 0xC0) == 0x80) cl++;
            if (prev > 0) {
                add_token(v, full, i + cl, KVC_TOKEN_NORMAL);
                if (v->n_merges == MAX_TOK) __builtin_trap();
                char *m = v->merge_text[v->n_merges];
                snprintf(m, 2 * MAX_TEXT, "%.*s %.*s", (int)i, full, (int)cl, full + i);
                v->merges[v->n_merges] = m;
                v->n_merges++;
            }
            prev = i + cl;
            i += cl;
        }
    }
    for (size_t k = 0; k < sizeof specials / sizeof specials[0]; k++)
        add_token(v, specials[k].text, strlen(specials[k].text), specials[k].type);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static vocab_store vs[2];
    static kvc_tokenizer *toks[64];
    if (size < 1) return 0;
    uint8_t mode = data[0];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int pre = mode & 15, add_bos = (mode >> 4) & 1, special = (mode >> 5) & 1;
    int drop_ff = (mode >> 6) & 1, no_unk = drop_ff && (mode >> 7);
    int slot = pre * 4 + drop_ff * 2 + no_unk;
    if (!toks[slot]) { /* built once per setup and kept: creation is not the target here */
        vocab_store *v = &vs[drop_ff];
        if (v->n == 0) build_vocab(v, drop_ff);
        kvc_tokenizer_vocab tv = {0};
        tv.n_vocab = v->n;
        tv.tokens = v->tokens;
        tv.token_lens = v->lens;
        tv.token_types = v->types;
        tv.n_merges = v->n_merges;
        tv.merges = v->merges;
        tv.pre = pres[pre];
        tv.bos_id = tv.eos_id = find_token(v, "<|endoftext|>", 13);
        tv.eot_id = tv.pad_id = -1;
        tv.unk_id = no_unk ? -1 : find_token(v, "<unk>", 5);
        CHECK(kvc_tokenizer_create(&tv, &toks[slot]) == KVC_OK);
    }
    kvc_tokenizer *t = toks[slot];
    int32_t n_vocab = kvc_tokenizer_n_vocab(t), bos = kvc_tokenizer_bos(t);
    /* 0xFF has no byte token when drop_ff: the unknown token stands in for
     * it, and without one encoding fails (no special token contains 0xFF). */
    int has_ff = len > 0 && memchr(text, 0xFF, len) != NULL;
    int32_t unk = find_token(&vs[drop_ff], "<unk>", 5);

    int64_t n = -1;
    kvc_status st;
    if (no_unk && has_ff) {
        int32_t canary[4] = {-7, -7, -7, -7};
        CHECK(kvc_tokenize(t, text, len, add_bos, special, canary, 4, &n) == KVC_ERR_INVALID_ARG);
        CHECK(canary[0] == -7 && canary[3] == -7 && kvc_last_error()[0] != 0);
        return 0;
    }
    st = kvc_tokenize(t, text, len, add_bos, special, NULL, 0, &n);
    CHECK(st == KVC_OK || st == KVC_ERR_NO_SPACE);
    CHECK(n >= 0 && (uint64_t)n <= len + 1);
    CHECK((st == KVC_OK) == (n == 0));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n + 1));
    if (!ids) return 0;
    for (int64_t i = 0; i <= n; i++) ids[i] = -7;
    int64_t n2 = -1;
    if (n > 0) { /* one short: refused with nothing written */
        CHECK(kvc_tokenize(t, text, len, add_bos, special, ids, n - 1, &n2) == KVC_ERR_NO_SPACE);
        CHECK(n2 == n);
        for (int64_t i = 0; i <= n; i++) CHECK(ids[i] == -7);
    }
    CHECK(kvc_tokenize(t, text, len, add_bos, special, ids, n, &n2) == KVC_OK);
    CHECK(n2 == n && ids[n] == -7);
    int used_unk = 0;
    for (int64_t i = 0; i < n; i++) {
        CHECK(ids[i] >= 0 && ids[i] < n_vocab);
        if (ids[i] == unk) used_unk = 1;
    }
    CHECK(used_unk == (drop_ff && has_ff));
    int64_t skip = (add_bos && bos >= 0) ? 1 : 0;
    if (skip) CHECK(n >= 1 && ids[0] == bos);

    /* decoding gives the text back: measured, one byte short (refused,
     * nothing written), then exact */
    size_t got = 0;
    st = kvc_detokenize(t, ids + skip, n - skip, NULL, 0, &got);
    CHECK(st == (got ? KVC_ERR_NO_SPACE : KVC_OK));
    size_t cap = got + 16 * (len + 1); /* also room for the text read as ids below */
    char *buf = malloc(cap);
    if (!buf) {
        free(ids);
        return 0;
    }
    memset(buf, 0x5A, cap);
    size_t need = got;
    if (need) {
        CHECK(kvc_detokenize(t, ids + skip, n - skip, buf, need - 1, &got) == KVC_ERR_NO_SPACE);
        CHECK(got == need);
        for (size_t i = 0; i < cap; i++) CHECK(buf[i] == 0x5A);
    }
    CHECK(kvc_detokenize(t, ids + skip, n - skip, buf, need, &got) == KVC_OK && got == need);
    if (!used_unk) CHECK(got == len && (len == 0 || memcmp(buf, text, len) == 0));
    size_t at = 0;
    for (int64_t i = skip; i < n; i++) {
        char piece[MAX_TEXT];
        size_t pl = 0;
        CHECK(kvc_token_to_piece(t, ids[i], piece, sizeof piece, &pl) == KVC_OK);
        CHECK(pl > 0 && at + pl <= got && memcmp(buf + at, piece, pl) == 0);
        at += pl;
    }
    CHECK(at == got);

    /* pre-tokenizer pieces: strictly increasing ends covering the text */
    size_t np = 0;
    st = kvc__pretokenize(pres[pre], text, len, NULL, 0, &np);
    CHECK(st == (np ? KVC_ERR_NO_SPACE : KVC_OK) && np <= len);
    size_t *ends = malloc(sizeof(size_t) * (np + 1));
    if (ends) {
        CHECK(kvc__pretokenize(pres[pre], text, len, ends, np, &np) == KVC_OK);
        for (size_t i = 0; i < np; i++) CHECK(ends[i] > (i ? ends[i - 1] : 0));
        CHECK(np == 0 ? len == 0 : ends[np - 1] == len);
        free(ends);
    }

    /* the text read as ids: out-of-range ids refused, buffer untouched */
    int64_t m = (int64_t)(len / 2);
    for (int64_t i = 0; i < m && i < n + 1; i++) {
        int v = (uint8_t)text[2 * i] | ((uint8_t)text[2 * i + 1] << 8);
        ids[i] = v % (n_vocab + 2) - 1; /* -1 .. n_vocab */
    }
    if (m > n + 1) m = n + 1;
    int bad = 0;
    for (int64_t i = 0; i < m; i++) bad |= ids[i] < 0 || ids[i] >= n_vocab;
    memset(buf, 0x5A, cap);
    st = kvc_detokenize(t, ids, m, buf, cap, &got);
    if (bad) {
        CHECK(st == KVC_ERR_INVALID_ARG);
        for (size_t i = 0; i < cap; i++) CHECK(buf[i] == 0x5A);
    } else {
        CHECK(st == KVC_OK && got <= cap); /* pieces are at most 16 bytes */
    }
    free(buf);
    free(ids);
    return 0;
}
