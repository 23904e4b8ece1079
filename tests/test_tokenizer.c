/*
 * Tokenizer and chat-template tests on a tiny hand-made vocabulary (every
 * GPT-2 byte token, a few merges, control and user-defined tokens), the
 * pre-tokenizer scanners' piece boundaries (expected splits computed with
 * Python's `regex` package on the published patterns), and the real SmolLM2
 * vocabulary when the model file is present. The exhaustive comparison with
 * an independent BPE lives in python/tests/test_tokenizer.py.
 */
#include <stdlib.h>
#include <sys/stat.h>

#include "test.h"
#include "text/tokenizer_internal.h"
#include "text/unicode.h"

/* ---- a tiny vocabulary ----------------------------------------------------- */

enum { N_BYTES = 256 };
static const char *const extra_tokens[] = {
    "he",     "ll",           "hell",       "hello",  "Ġw",  "or",   "Ġwor", "Ġworl",
    "Ġworld", "<|im_start|>", "<|im_end|>", "<tool>", "<a>", "<a>b", "ĠĠ"};
static const int32_t extra_types[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 4, 3, 3, 1};
static const char *const merges[] = {"h e", "l l",   "he ll",  "hell o",  "Ġ w",
                                     "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ Ġ"};
enum { N_EXTRA = sizeof extra_tokens / sizeof extra_tokens[0] };
enum {
    ID_HELLO = N_BYTES + 3,
    ID_WORLD = N_BYTES + 8,
    ID_START = N_BYTES + 9,
    ID_END = N_BYTES + 10,
    ID_TOOL = N_BYTES + 11,
    ID_A = N_BYTES + 12,
    ID_AB = N_BYTES + 13,
    ID_SPACE2 = N_BYTES + 14
};

typedef struct tiny {
    char bytes[N_BYTES][4];
    const char *tokens[N_BYTES + N_EXTRA];
    int32_t types[N_BYTES + N_EXTRA];
    kvc_tokenizer_vocab v;
} tiny;

/* Byte tokens are the GPT-2 characters of bytes 0..255, so token id b is byte b. */
static void tiny_init(tiny *t, const char *pre) {
    memset(t, 0, sizeof *t);
    for (int b = 0; b < N_BYTES; b++) {
        int n = kvc__utf8_encode(kvc__byte_to_cp((unsigned char)b), (unsigned char *)t->bytes[b]);
        t->bytes[b][n] = 0;
        t->tokens[b] = t->bytes[b];
        t->types[b] = KVC_TOKEN_NORMAL;
    }
    for (int i = 0; i < N_EXTRA; i++) {
        t->tokens[N_BYTES + i] = extra_tokens[i];
        t->types[N_BYTES + i] = extra_types[i];
    }
    t->v.n_vocab = N_BYTES + N_EXTRA;
    t->v.tokens = t->tokens;
    t->v.token_lens = NULL; /* NUL-terminated */
    t->v.token_types = t->types;
    t->v.n_merges = (int32_t)(sizeof merges / sizeof merges[0]);
    t->v.merges = merges;
    t->v.pre = pre;
    t->v.bos_id = ID_START;
    t->v.eos_id = ID_END;
    t->v.eot_id = -1;
    t->v.unk_id = -1;
    t->v.pad_id = -1;
}

static kvc_tokenizer *make_tiny(const char *pre) {
    tiny t;
    tiny_init(&t, pre);
    kvc_tokenizer *tok = NULL;
    if (kvc_tokenizer_create(&t.v, &tok) != KVC_OK) {
        fprintf(stderr, "  create failed: %s\n", kvc_last_error());
        return NULL;
    }
    return tok;
}

/* Tokenizes text (NUL-terminated) into ids[]; returns the count or -1. */
static int64_t enc(const kvc_tokenizer *t, const char *text, int special, int32_t *ids,
                   int64_t cap) {
    int64_t n = -1;
    kvc_status st = kvc_tokenize(t, text, strlen(text), 0, special, ids, cap, &n);
    if (st != KVC_OK) {
        fprintf(stderr, "  kvc_tokenize(\"%s\"): %s\n", text, kvc_last_error());
        return -1;
    }
    return n;
}

/* Decodes ids and compares with want (len bytes). */
static int decodes_to(const kvc_tokenizer *t, const int32_t *ids, int64_t n, const char *want,
                      size_t len) {
    char buf[256];
    size_t got = 0;
    if (kvc_detokenize(t, ids, n, buf, sizeof buf, &got) != KVC_OK) return 0;
    return got == len && memcmp(buf, want, len) == 0;
}

TEST(gpt2_byte_table) {
    /* bytes_to_unicode: printable Latin-1 stays, the rest go to U+0100.. in order */
    ASSERT_EQ_I64(kvc__byte_to_cp('!'), '!');
    ASSERT_EQ_I64(kvc__byte_to_cp(' '), 0x120);  /* 'Ġ' */
    ASSERT_EQ_I64(kvc__byte_to_cp('\n'), 0x10A); /* 'Ċ' */
    ASSERT_EQ_I64(kvc__byte_to_cp(0x00), 0x100);
    ASSERT_EQ_I64(kvc__byte_to_cp(0x7F), 0x121);
    ASSERT_EQ_I64(kvc__byte_to_cp(0xA0), 0x142);
    ASSERT_EQ_I64(kvc__byte_to_cp(0xAD), 0x143);
    ASSERT_EQ_I64(kvc__byte_to_cp(0xFF), 0xFF);
    for (int b = 0; b < 256; b++)
        ASSERT_EQ_I64(kvc__cp_to_byte(kvc__byte_to_cp((unsigned char)b)), b);
    ASSERT_EQ_I64(kvc__cp_to_byte(0x20), -1);
    ASSERT_EQ_I64(kvc__cp_to_byte(0x144), -1);
    return 0;
}

TEST(utf8_and_classes) {
    int adv;
    ASSERT_EQ_I64(kvc__utf8_decode((const unsigned char *)"\xe6\x97\xa5", 3, &adv), 0x65E5);
    ASSERT_EQ_I64(adv, 3);
    ASSERT_EQ_I64(kvc__utf8_decode((const unsigned char *)"\xf0\x9f\x8e\x89", 4, &adv), 0x1F389);
    /* ill-formed: one byte at a time, as U+DC00 + byte */
    ASSERT_EQ_I64(kvc__utf8_decode((const unsigned char *)"\xe6\x97", 2, &adv), 0xDCE6);
    ASSERT_EQ_I64(adv, 1);
    ASSERT_EQ_I64(kvc__utf8_decode((const unsigned char *)"\xc0\x80", 2, &adv), 0xDCC0);
    ASSERT_EQ_I64(kvc__utf8_decode((const unsigned char *)"\xed\xa0\x80", 3, &adv), 0xDCED);
    ASSERT_EQ_I64(kvc__utf8_decode((const unsigned char *)"\xf4\x90\x80\x80", 4, &adv), 0xDCF4);
    ASSERT_EQ_I64(kvc__utf8_decode((const unsigned char *)"\xe0\x9f\xbf", 3, &adv), 0xDCE0);
    ASSERT_EQ_I64(kvc__cp_class('a'), KVC__CP_LETTER);
    ASSERT_EQ_I64(kvc__cp_class(0x65E5), KVC__CP_LETTER); /* 日 */
    ASSERT_EQ_I64(kvc__cp_class(0x0661), KVC__CP_NUMBER); /* Arabic-Indic one */
    ASSERT_EQ_I64(kvc__cp_class(0x216B), KVC__CP_NUMBER); /* Ⅻ (Nl) */
    ASSERT_EQ_I64(kvc__cp_class(0x00BD), KVC__CP_NUMBER); /* ½ (No) */
    ASSERT_EQ_I64(kvc__cp_class(0x3000), KVC__CP_SPACE);
    ASSERT_EQ_I64(kvc__cp_class(0x0085), KVC__CP_SPACE);
    ASSERT_EQ_I64(kvc__cp_class(0x200B), KVC__CP_OTHER);  /* zero width space: Cf */
    ASSERT_EQ_I64(kvc__cp_class(0x1F389), KVC__CP_OTHER); /* emoji: So */
    ASSERT_EQ_I64(kvc__cp_class(0xDCFF), KVC__CP_OTHER);  /* an escaped bad byte */
    ASSERT_EQ_I64(kvc__cp_class(0x10FFFF), KVC__CP_OTHER);
    /* the classes are Unicode 16.0's, as Hugging Face tokenizers' (gen_unicode_tables.py):
     * letters and digits of 15.0, 15.1 and 16.0, and one that 17.0 assigned */
    ASSERT_EQ_I64(kvc__cp_class(0x31350), KVC__CP_LETTER); /* CJK extension H (15.0) */
    ASSERT_EQ_I64(kvc__cp_class(0x1E4D0), KVC__CP_LETTER); /* Nag Mundari letter O (15.0) */
    ASSERT_EQ_I64(kvc__cp_class(0x11F50), KVC__CP_NUMBER); /* Kawi digit zero (15.0) */
    ASSERT_EQ_I64(kvc__cp_class(0x2EBF0), KVC__CP_LETTER); /* CJK extension I (15.1) */
    ASSERT_EQ_I64(kvc__cp_class(0x1C89), KVC__CP_LETTER);  /* Cyrillic capital TJE (16.0) */
    ASSERT_EQ_I64(kvc__cp_class(0x16130), KVC__CP_NUMBER); /* Gurung Khema digit zero (16.0) */
    ASSERT_EQ_I64(kvc__cp_class(0x16EA0), KVC__CP_OTHER);  /* Beria Erfe letter (17.0) */
    ASSERT_TRUE(kvc__py_isspace(0x1C) && !kvc__py_isspace(0x200B) && kvc__py_isspace(' '));
    return 0;
}

/* Expected splits computed with Python's `regex` package on the patterns
 * (python/tests/bpe_reference.py), at every class boundary. */
static const struct {
    const char *pre, *text;
    size_t ends[8];
    size_t n;
} splits[] = {
    {"gpt2", "Hello world", {5, 11}, 2},
    {"gpt2", "a  b", {1, 2, 4}, 3},
    {"gpt2", "it's", {2, 4}, 2},
    {"gpt2", "x'S", {1, 2, 3}, 3},
    {"gpt2", " 123", {4}, 1},
    {"gpt2", "a!!b", {1, 3, 4}, 3},
    {"gpt2", " !!", {3}, 1},
    {"gpt2", "end  ", {3, 5}, 2},
    {"gpt2", "\t\tb", {1, 2, 3}, 3},
    {"gpt2", "a \n b", {1, 3, 5}, 3},
    {"gpt2", "ab12cd", {2, 4, 6}, 3},
    {"gpt2", "x  \n\ny", {1, 4, 5, 6}, 4},
    {"gpt2",
     "a\xff\xfe"
     "b \xc3( \xe2\x82x",
     {1, 3, 4, 7, 10, 11},
     6},
    {"smollm", "a 12", {1, 2, 3, 4}, 4},
    {"smollm", "x1y", {1, 2, 3}, 3},
    {"smollm", " 42 ", {1, 2, 3, 4}, 4},
    {"smollm", "v2.0", {1, 2, 3, 4}, 4},
    {"llama-bpe", "x'S", {1, 3}, 2},
    {"llama-bpe", "1234567", {3, 6, 7}, 3},
    {"llama-bpe", " !!\n\nz", {5, 6}, 2},
    {"llama-bpe", "a\n\n  b", {1, 3, 4, 6}, 4},
    {"llama-bpe", "\tword", {5}, 1},
    {"llama-bpe", "(word", {5}, 1},
    {"llama-bpe", "a\r\nb", {1, 3, 4}, 3},
    {"llama-bpe", "  ", {2}, 1},
    {"llama-bpe",
     "a\xff\xfe"
     "b \xc3( \xe2\x82x",
     {1, 3, 4, 7, 10, 11},
     6},
    {"qwen2", "123", {1, 2, 3}, 3},
    {"qwen2", "x'LL y", {1, 4, 6}, 3},
};

TEST(pre_tokenizer_boundaries) {
    for (size_t k = 0; k < sizeof splits / sizeof splits[0]; k++) {
        size_t ends[16], n = 0;
        ASSERT_OK(
            kvc__pretokenize(splits[k].pre, splits[k].text, strlen(splits[k].text), ends, 16, &n));
        if (n != splits[k].n)
            TEST_FAIL_("%s \"%s\": %zu pieces, want %zu", splits[k].pre, splits[k].text, n,
                       splits[k].n);
        for (size_t i = 0; i < n; i++)
            if (ends[i] != splits[k].ends[i])
                TEST_FAIL_("%s \"%s\": piece %zu ends at %zu, want %zu", splits[k].pre,
                           splits[k].text, i, ends[i], splits[k].ends[i]);
    }
    size_t ends[1], n = 0;
    ASSERT_STATUS(kvc__pretokenize("gpt2", "a b c", 5, ends, 1, &n), KVC_ERR_NO_SPACE);
    ASSERT_EQ_I64(n, 3);
    ASSERT_STATUS(kvc__pretokenize("nope", "a", 1, ends, 1, &n), KVC_ERR_UNSUPPORTED);
    return 0;
}

TEST(merges_and_bytes) {
    kvc_tokenizer *t = make_tiny("gpt2");
    ASSERT_TRUE(t != NULL);
    int32_t ids[64];
    int64_t n = enc(t, "hello world", 1, ids, 64);
    ASSERT_EQ_I64(n, 2);
    ASSERT_EQ_I64(ids[0], ID_HELLO);
    ASSERT_EQ_I64(ids[1], ID_WORLD);
    /* "helo": he + l + o -- "he ll" never forms */
    n = enc(t, "helo", 1, ids, 64);
    ASSERT_EQ_I64(n, 3);
    ASSERT_EQ_I64(ids[0], N_BYTES + 0);
    ASSERT_EQ_I64(ids[1], 'l');
    ASSERT_EQ_I64(ids[2], 'o');
    /* "hello  world": "  " before a word is " " + " world" */
    n = enc(t, "hello  world", 1, ids, 64);
    ASSERT_EQ_I64(n, 3);
    ASSERT_EQ_I64(ids[1], ' ');
    ASSERT_EQ_I64(ids[2], ID_WORLD);
    /* a trailing run of spaces is one piece: merged pairwise by "Ġ Ġ" */
    n = enc(t, "x     ", 1, ids, 64);
    ASSERT_EQ_I64(n, 4);
    ASSERT_EQ_I64(ids[1], ID_SPACE2);
    ASSERT_EQ_I64(ids[2], ID_SPACE2);
    ASSERT_EQ_I64(ids[3], ' ');
    ASSERT_TRUE(decodes_to(t, ids, n, "x     ", 6));
    /* every byte value round-trips through its byte token */
    char all[256];
    for (int b = 0; b < 256; b++) all[b] = (char)b;
    int64_t m = -1;
    int32_t big[300];
    ASSERT_OK(kvc_tokenize(t, all, 256, 0, 0, big, 300, &m));
    ASSERT_TRUE(m > 0 && m <= 256);
    ASSERT_TRUE(decodes_to(t, big, m, all, 256) || m > 0);
    char back[256];
    size_t len = 0;
    ASSERT_OK(kvc_detokenize(t, big, m, back, sizeof back, &len));
    ASSERT_EQ_I64(len, 256);
    ASSERT_MEM_EQ(back, all, 256);
    kvc_tokenizer_destroy(t);
    return 0;
}

TEST(add_bos_flag) {
    tiny v;
    tiny_init(&v, "gpt2");
    kvc_tokenizer *t = NULL;
    ASSERT_OK(kvc_tokenizer_create(&v.v, &t));
    ASSERT_EQ_I64(kvc_tokenizer_add_bos(t), 0);
    kvc_tokenizer_destroy(t);
    v.v.add_bos = 1;
    ASSERT_OK(kvc_tokenizer_create(&v.v, &t));
    ASSERT_EQ_I64(kvc_tokenizer_add_bos(t), 1);
    kvc_tokenizer_destroy(t);
    v.v.bos_id = -1; /* asked for, but there is no BOS token */
    ASSERT_OK(kvc_tokenizer_create(&v.v, &t));
    ASSERT_EQ_I64(kvc_tokenizer_add_bos(t), 0);
    kvc_tokenizer_destroy(t);
    ASSERT_EQ_I64(kvc_tokenizer_add_bos(NULL), 0);
    return 0;
}

TEST(special_tokens) {
    kvc_tokenizer *t = make_tiny("smollm");
    ASSERT_TRUE(t != NULL);
    int32_t ids[64];
    int64_t n = enc(t, "<|im_start|>hello<|im_end|>", 1, ids, 64);
    ASSERT_EQ_I64(n, 3);
    ASSERT_EQ_I64(ids[0], ID_START);
    ASSERT_EQ_I64(ids[1], ID_HELLO);
    ASSERT_EQ_I64(ids[2], ID_END);
    ASSERT_TRUE(decodes_to(t, ids, n, "<|im_start|>hello<|im_end|>", 27));
    /* without parse_special control tokens are plain text, never produced by BPE */
    n = enc(t, "<|im_start|>", 0, ids, 64);
    ASSERT_EQ_I64(n, 12);
    for (int64_t i = 0; i < n; i++) ASSERT_TRUE(ids[i] < N_BYTES);
    ASSERT_TRUE(decodes_to(t, ids, n, "<|im_start|>", 12));
    /* user-defined tokens are always recognised */
    n = enc(t, "x<tool>y", 0, ids, 64);
    ASSERT_EQ_I64(n, 3);
    ASSERT_EQ_I64(ids[1], ID_TOOL);
    /* leftmost, then longest: "<a>b" wins over "<a>" */
    n = enc(t, "<a>b<a>c", 1, ids, 64);
    ASSERT_EQ_I64(n, 3);
    ASSERT_EQ_I64(ids[0], ID_AB);
    ASSERT_EQ_I64(ids[1], ID_A);
    ASSERT_EQ_I64(ids[2], 'c');
    /* an unterminated special is text */
    n = enc(t, "<|im_start", 1, ids, 64);
    ASSERT_EQ_I64(n, 10);
    /* bos / eos / eot / eog */
    ASSERT_EQ_I64(kvc_tokenizer_bos(t), ID_START);
    ASSERT_EQ_I64(kvc_tokenizer_eos(t), ID_END);
    ASSERT_EQ_I64(kvc_tokenizer_eot(t), ID_END); /* "<|im_end|>" is present */
    ASSERT_TRUE(kvc_tokenizer_is_eog(t, ID_END));
    ASSERT_TRUE(!kvc_tokenizer_is_eog(t, ID_START) && !kvc_tokenizer_is_eog(t, -5) &&
                !kvc_tokenizer_is_eog(t, 1 << 30));
    int64_t m = -1;
    ASSERT_OK(kvc_tokenize(t, "hello", 5, 1, 1, ids, 64, &m));
    ASSERT_EQ_I64(m, 2);
    ASSERT_EQ_I64(ids[0], ID_START);
    kvc_tokenizer_destroy(t);
    return 0;
}

TEST(invalid_utf8_and_empty) {
    kvc_tokenizer *t = make_tiny("llama-bpe");
    ASSERT_TRUE(t != NULL);
    int32_t ids[64];
    const char bad[] = "\xff\xc3(\xe2\x82 \xed\xa0\x80";
    int64_t n = -1;
    ASSERT_OK(kvc_tokenize(t, bad, sizeof bad - 1, 0, 1, ids, 64, &n));
    ASSERT_EQ_I64(n, (int64_t)(sizeof bad - 1)); /* no merges apply: one byte token each */
    for (int64_t i = 0; i < n; i++) ASSERT_EQ_I64(ids[i], (unsigned char)bad[i]);
    ASSERT_TRUE(decodes_to(t, ids, n, bad, sizeof bad - 1));
    /* embedded NUL is text too */
    ASSERT_OK(kvc_tokenize(t, "a\0b", 3, 0, 1, ids, 64, &n));
    ASSERT_EQ_I64(n, 3);
    ASSERT_EQ_I64(ids[1], 0);
    /* empty text: no tokens (BOS alone if asked); NULL text with len 0 is fine */
    ASSERT_OK(kvc_tokenize(t, "", 0, 0, 1, NULL, 0, &n));
    ASSERT_EQ_I64(n, 0);
    ASSERT_OK(kvc_tokenize(t, NULL, 0, 1, 1, ids, 1, &n));
    ASSERT_EQ_I64(n, 1);
    ASSERT_EQ_I64(ids[0], ID_START);
    size_t len = 7;
    ASSERT_OK(kvc_detokenize(t, NULL, 0, NULL, 0, &len));
    ASSERT_EQ_I64(len, 0);
    kvc_tokenizer_destroy(t);
    return 0;
}

TEST(no_space_and_bad_args) {
    kvc_tokenizer *t = make_tiny("gpt2");
    ASSERT_TRUE(t != NULL);
    int32_t ids[4] = {-7, -7, -7, -7};
    int64_t n = -1;
    ASSERT_STATUS(kvc_tokenize(t, "a b c d e", 9, 0, 1, ids, 2, &n), KVC_ERR_NO_SPACE);
    ASSERT_EQ_I64(n, 9); /* a, Ġ, b, ...: the tiny vocabulary has no "Ġb" */
    ASSERT_STR_CONTAINS(kvc_last_error(), "9 tokens");
    ASSERT_EQ_I64(ids[0], -7); /* a failed call leaves the buffer alone */
    ASSERT_STATUS(kvc_tokenize(t, "a b", 3, 0, 1, NULL, 0, &n), KVC_ERR_NO_SPACE);
    ASSERT_EQ_I64(n, 3);
    ASSERT_STATUS(kvc_tokenize(NULL, "a", 1, 0, 1, ids, 4, &n), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_tokenize(t, NULL, 1, 0, 1, ids, 4, &n), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_tokenize(t, "a", 1, 0, 1, NULL, 4, &n), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_tokenize(t, "a", 1, 0, 1, ids, -1, &n), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_tokenize(t, "a", 1, 0, 1, ids, 4, NULL), KVC_ERR_INVALID_ARG);

    char buf[8];
    size_t len = 0;
    ASSERT_STATUS(kvc_token_to_piece(t, -1, buf, sizeof buf, &len), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_token_to_piece(t, kvc_tokenizer_n_vocab(t), buf, sizeof buf, &len),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "outside");
    ASSERT_STATUS(kvc_token_to_piece(t, ID_START, buf, 4, &len), KVC_ERR_NO_SPACE);
    ASSERT_EQ_I64(len, 12);
    ASSERT_OK(kvc_token_to_piece(t, ID_WORLD, buf, sizeof buf, &len));
    ASSERT_EQ_I64(len, 6);
    ASSERT_MEM_EQ(buf, " world", 6);
    int32_t bad_ids[] = {ID_HELLO, 1 << 20};
    ASSERT_STATUS(kvc_detokenize(t, bad_ids, 2, buf, sizeof buf, &len), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "ids[1]");
    int32_t two[] = {ID_HELLO, ID_WORLD};
    ASSERT_STATUS(kvc_detokenize(t, two, 2, buf, sizeof buf, &len), KVC_ERR_NO_SPACE);
    ASSERT_EQ_I64(len, 11);
    ASSERT_STATUS(kvc_detokenize(t, two, -1, buf, sizeof buf, &len), KVC_ERR_INVALID_ARG);
    /* buf laid over ids (core.h: undefined, but in bounds): token 256 here
     * decodes to "aaaa" 09 01 00 00, which turns ids[1] from byte 0 (one byte)
     * into 265, <|im_start|> (12): the old code copied those 12 bytes past
     * the 9 validated (cap) */
    tiny tv;
    tiny_init(&tv, "gpt2");
    tv.tokens[256] = "aaaa\xC4\x89\xC4\x81\xC4\x80\xC4\x80"; /* a a a a U+0109 U+0101 U+0100 U+0100 */
    kvc_tokenizer *t2 = NULL;
    ASSERT_OK(kvc_tokenizer_create(&tv.v, &t2));
    ASSERT_EQ_I64(ID_START, 265);
    int32_t *over = malloc(4 * sizeof(int32_t) + 64);
    ASSERT_TRUE(over != NULL);
    memset(over, 0x5a, 4 * sizeof(int32_t) + 64);
    over[0] = 256, over[1] = 0;
    ASSERT_OK(kvc_detokenize(t2, over, 2, (char *)over, 9, &len));
    ASSERT_EQ_I64(len, 9);
    for (size_t i = 9; i < 4 * sizeof(int32_t) + 64; i++) /* nothing past the 9 bytes */
        ASSERT_TRUE(((unsigned char *)over)[i] == 0x5a);
    free(over);
    kvc_tokenizer_destroy(t2);
    ASSERT_EQ_I64(kvc_tokenizer_n_vocab(NULL), 0);
    ASSERT_EQ_I64(kvc_tokenizer_bos(NULL), -1);
    kvc_tokenizer_destroy(NULL);
    kvc_tokenizer_destroy(t);
    return 0;
}

TEST(create_validation) {
    tiny v;
    kvc_tokenizer *t = (kvc_tokenizer *)&v;
    tiny_init(&v, "no-such-pre");
    ASSERT_STATUS(kvc_tokenizer_create(&v.v, &t), KVC_ERR_UNSUPPORTED);
    ASSERT_TRUE(t == NULL);
    ASSERT_STR_CONTAINS(kvc_last_error(), "no-such-pre");
    tiny_init(&v, "gpt2");
    v.v.bos_id = v.v.n_vocab;
    ASSERT_STATUS(kvc_tokenizer_create(&v.v, &t), KVC_ERR_INVALID_ARG);
    tiny_init(&v, "gpt2");
    v.types[3] = 9;
    ASSERT_STATUS(kvc_tokenizer_create(&v.v, &t), KVC_ERR_INVALID_ARG);
    tiny_init(&v, "gpt2");
    const char *bad_merges[] = {"nospace"};
    v.v.merges = bad_merges;
    v.v.n_merges = 1;
    ASSERT_STATUS(kvc_tokenizer_create(&v.v, &t), KVC_ERR_INVALID_ARG);
    tiny_init(&v, "gpt2");
    v.v.n_vocab = 0;
    ASSERT_STATUS(kvc_tokenizer_create(&v.v, &t), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_tokenizer_create(NULL, &t), KVC_ERR_INVALID_ARG);
    /* merges naming unknown tokens are skipped, not fatal */
    tiny_init(&v, "gpt2");
    const char *odd_merges[] = {"zz qq", "h e"};
    v.v.merges = odd_merges;
    v.v.n_merges = 2;
    ASSERT_OK(kvc_tokenizer_create(&v.v, &t));
    int32_t ids[8];
    ASSERT_EQ_I64(enc(t, "he", 1, ids, 8), 1);
    kvc_tokenizer_destroy(t);
    /* a vocabulary without byte tokens: the unknown token, or an error */
    const char *toks[] = {"a", "<unk>"};
    int32_t types[] = {1, 2};
    kvc_tokenizer_vocab small;
    memset(&small, 0, sizeof small);
    small.n_vocab = 2;
    small.tokens = toks;
    small.token_types = types;
    small.bos_id = small.eos_id = small.eot_id = small.pad_id = -1;
    small.unk_id = 1;
    ASSERT_OK(kvc_tokenizer_create(&small, &t));
    int64_t n = 0;
    ASSERT_OK(kvc_tokenize(t, "ab", 2, 0, 1, ids, 8, &n));
    ASSERT_EQ_I64(n, 2);
    ASSERT_EQ_I64(ids[0], 0);
    ASSERT_EQ_I64(ids[1], 1);
    kvc_tokenizer_destroy(t);
    small.unk_id = -1;
    ASSERT_OK(kvc_tokenizer_create(&small, &t));
    ASSERT_STATUS(kvc_tokenize(t, "ab", 2, 0, 1, ids, 8, &n), KVC_ERR_INVALID_ARG);
    kvc_tokenizer_destroy(t);
    return 0;
}

TEST(long_inputs) {
    kvc_tokenizer *t = make_tiny("smollm");
    ASSERT_TRUE(t != NULL);
    size_t len = 1 << 20;
    char *text = malloc(len);
    int32_t *ids = malloc(len * sizeof *ids);
    ASSERT_TRUE(text && ids);
    uint64_t seed = test_seed;
    for (size_t i = 0; i < len; i++) text[i] = (char)(test_rng_next(&seed) & 0xFF);
    int64_t n = 0;
    ASSERT_OK(kvc_tokenize(t, text, len, 0, 1, ids, (int64_t)len, &n));
    char *back = malloc(len);
    size_t blen = 0;
    ASSERT_OK(kvc_detokenize(t, ids, n, back, len, &blen));
    ASSERT_EQ_I64(blen, len);
    ASSERT_MEM_EQ(back, text, len);
    memset(text, ' ', len); /* one long whitespace run, then one long word */
    ASSERT_OK(kvc_tokenize(t, text, len, 0, 1, ids, (int64_t)len, &n));
    ASSERT_EQ_I64(n, (int64_t)len / 2);
    memset(text, 'l', len);
    ASSERT_OK(kvc_tokenize(t, text, len, 0, 1, ids, (int64_t)len, &n));
    ASSERT_EQ_I64(n, (int64_t)len / 2);
    free(text);
    free(ids);
    free(back);
    kvc_tokenizer_destroy(t);
    return 0;
}

/* ---- chat templates ---------------------------------------------------------- */

static const char smollm_template[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}";

static int render(const char *tmpl, const kvc_chat_message *m, int64_t n, int agp, char *buf,
                  size_t cap, kvc_status *st) {
    size_t len = 0;
    *st = kvc_chat_apply_template(NULL, tmpl, m, n, agp, buf, cap, &len);
    if (*st == KVC_OK && len < cap) buf[len] = 0;
    return (int)len;
}

TEST(chat_smollm_template) {
    kvc_chat_message m[] = {{"user", "Hi"}, {"assistant", "Hello!"}, {"user", "2+2?"}};
    char buf[1024];
    kvc_status st;
    render(smollm_template, m, 1, 1, buf, sizeof buf, &st);
    ASSERT_OK(st);
    const char *want1 = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                        "by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\n";
    if (strcmp(buf, want1) != 0) TEST_FAIL_("got \"%s\"", buf);
    kvc_chat_message sys[] = {{"system", "Be brief."}, {"user", "Hi"}};
    render(smollm_template, sys, 2, 0, buf, sizeof buf, &st);
    ASSERT_OK(st);
    const char *want2 = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n";
    if (strcmp(buf, want2) != 0) TEST_FAIL_("got \"%s\"", buf);
    int len = render(smollm_template, m, 3, 1, buf, 10, &st);
    ASSERT_EQ_I64(st, KVC_ERR_NO_SPACE);
    ASSERT_TRUE(len > 10);
    render(smollm_template, m, 0, 1, buf, sizeof buf, &st);
    ASSERT_OK(st);
    ASSERT_TRUE(strcmp(buf, "<|im_start|>assistant\n") == 0);
    return 0;
}

TEST(chat_whitespace_and_expressions) {
    kvc_chat_message m[] = {{"user", "  hi  "}, {"assistant", "yo"}};
    char buf[512];
    kvc_status st;
    static const struct {
        const char *tmpl, *want;
    } cases[] = {
        /* trim_blocks + lstrip_blocks; one trailing newline dropped */
        {"a\n  {% if true %}\n  b\n  {% endif %}\nc\n", "a\n  b\nc"},
        {"a  {%- if true -%}  b  {%- endif %}\n\nc", "ab\nc"},
        {"x {{- ' y ' -}} z", "x y z"},
        {"{# c #}\n{{ messages | length }}", "2"},
        {"{% for m in messages %}{{ loop.index }}{{ m.role[0] }}{{ '|' if not loop.last }}{% "
         "endfor %}",
         "1u|2a"},
        {"{{ messages[0]['content'] | trim }}!{{ messages[-1].content | upper }}", "hi!YO"},
        {"{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 2 %}{% endfor "
         "%}{{ ns.n }}",
         "4"},
        {"{% set x = 1 %}{% for m in messages %}{% set x = 5 %}{% endfor %}{{ x }}", "1"},
        {"{{ 'a' ~ 1 ~ none ~ true }} {{ 7 // 2 }} {{ -7 % 3 }} {{ [1, 2] + [3] }}",
         "a1NoneTrue 3 2 [1, 2, 3]"},
        {"{{ 'x' in 'axb' }} {{ 'q' not in ['a'] }} {{ undefined_thing is defined }} {{ 1 < 2 < 3 "
         "}}",
         "True True False True"},
        {"{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}", "012"},
        {"{{ 'abc'[1:] }}{{ messages[::-1][0].role }}{{ 'a,b'.split(',') | join('+') }}",
         "bcassistanta+b"},
        {"{{ '\\u00e9\\n' | length }} {{ 'x' if false }}|{{ bos_token }}|", "2 ||"},
        {"x\r\ny\r\n", "x\ny"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        render(cases[i].tmpl, m, 2, 1, buf, sizeof buf, &st);
        if (st != KVC_OK) TEST_FAIL_("case %zu: %s", i, kvc_last_error());
        if (strcmp(buf, cases[i].want) != 0)
            TEST_FAIL_("case %zu: got \"%s\", want \"%s\"", i, buf, cases[i].want);
    }
    return 0;
}

/* Differences from jinja2 that the random differential test
 * (python/tests/chat_diff.py) found, minimized; the outputs are jinja2's. */
TEST(chat_differential_regressions) {
    kvc_chat_message m[] = {{"user", "hi"}};
    char buf[512];
    kvc_status st;
    static const struct {
        const char *tmpl, *want; /* want NULL: an error */
    } cases[] = {
        {"{% for i in [1, 2] %}{{ i }}{% break %}{% else %}E{% endfor %}", "1E"},
        {"{% for i in [1, 2] %}{% continue %}{% else %}E{% endfor %}", "E"},
        {"{% for i in [1] %}{% else %}E{% endfor %}", ""},
        {"{% set y = 0 %}{% for x in [] %}{% else %}{% set y = 1 %}{{ y }}{% endfor %}{{ y }}",
         "10"},
        {"{% set x %}{% set y = 1 %}{{ y }}{% endset %}{{ x }}[{{ y }}]", "1[]"},
        {"{% if false %}{% break %}{% endif %}", NULL},
        {"{% for k, v in {'a': 1, 'b': 2}.items() if v > 1 %}{{ k }}{% endfor %}", "b"},
        {"{{ ['\\u2028', '\\xa0', '\\U000e0001', '\\u00e9'] }}",
         "['\\u2028', '\\xa0', '\\U000e0001', '\xc3\xa9']"},
        {"{{ 'a\\u3000b' | title }} {{ '\\u65e5x'.title() }}", "A\xe3\x80\x80" "B \xe6\x97\xa5" "X"},
        {"{{ range(3) + [1] }}", NULL},
        {"{{ {'a': 1}.keys()[0] }}|{{ {'a': 1}.keys() is sequence }}", "|False"},
        {"{{ [1, 'a'] * 2 }}", "[1, 'a', 1, 'a']"},
        {"{{ {} in {} }}", NULL},
        {"{{ [7, 8][1::9223372036854775807] }}", "[8]"},
        {"{{ [1, 2, 3][::-9223372036854775807 - 1] }}", "[3]"}, /* step INT64_MIN */
        {"{{ 'x' * 1 | safe }}", NULL},
        /* loop.depth was missing: undefined, so it printed nothing */
        {"{% for i in [1, 2] %}{{ loop.depth }}{{ loop.depth0 }}{% endfor %}", "1010"},
        /* jinja2 looks the attribute up first: d.items is the method, never d['items'] */
        {"{% set d = {'items': {'type': 'int'}, 'pop': 2} %}{{ d.items is defined }} "
         "{{ d.items.type is defined }} {{ d['items'].type }} {{ d.pop is defined }} "
         "{{ {}['get'] is callable }}",
         "True False int False True"},
        /* join's attribute= was ignored: the whole items were joined */
        {"{{ [{'a': 'x'}, {'a': 2}, {'b': 1}] | join(', ', attribute='a') }}", "x, 2, "},
        {"{{ [1, 2] | join('-', 'x', 3) }}", NULL},
        /* a range's attributes were undefined, and it printed as a list */
        {"{{ range(5).start }} {{ range(1, 9, 2).step }} {{ range(5)[1:3].stop }} "
         "{{ range(3)[::-1] }} {{ [range(2)] }} {{ range(5).count is defined }}",
         "0 2 3 range(2, -1, -1) [range(0, 2)] True"},
        /* `loop` was a dict: loop.keys(), 'index' in loop and loop|length (its 11 keys)
         * worked; now jinja2's LoopContext, with cycle() and changed() */
        {"{% for x in [1, 1, 2] %}{{ loop|length }}{{ loop.cycle('a', 'b') }}"
         "{{ loop.changed(x) }}{{ loop is mapping }}{{ loop['index'] }}{{ loop }};{% endfor %}",
         "3aTrueFalse1<LoopContext 1/3>;3bFalseFalse2<LoopContext 2/3>;"
         "3aTrueFalse3<LoopContext 3/3>;"},
        {"{% for x in [1] %}{{ loop.keys() }}{% endfor %}", NULL},
        {"{% for x in [1] %}{{ loop.get('index') }}{% endfor %}", NULL},
        {"{% set ns = namespace(l=0) %}{% for x in [1, 2, 3] %}{% set ns.l = loop %}"
         "{% if x == 2 %}{% break %}{% endif %}{% endfor %}{{ ns.l.index }}{{ ns.l.last }}",
         "2False"},
        /* a namespace equals only itself (compared as a dict, and `in {}` refused it) */
        {"{% set n = namespace(a=1) %}{{ n == namespace(a=1) }} {{ n == n }} {{ n in {} }}",
         "False True False"},
        /* reverse gives an iterator, as reversed() (it was a list: + and len() took it) */
        {"{{ [1, 2] | reverse | join }} {{ [1, 2] | reverse | list }} {{ 'ab' | reverse }}",
         "21 [2, 1] ba"},
        {"{{ [1, 2] | reverse | length }}", NULL},
        {"{{ ([1, 2] | reverse) + [3] }}", NULL},
        /* replace's old and new go through str(): a number was refused */
        {"{{ 'x1' | replace('x', 1) }}", "11"},
        /* split(None, maxsplit): the rest kept its trailing whitespace stripped */
        {"{{ 'a  b '.split(none, 1) }}{{ ' a  b '.split(none, 0) }}", "['a', 'b ']['a  b ']"},
        /* a loop's `if` filter ran over every item before the body: jinja2 tests each
         * one as the loop reaches it (peeking ahead for loop.last, all for length) */
        {"{% set ns = namespace(n=0) %}{% for x in [1, 2, 3] if x > ns.n %}{% set ns.n = 5 %}"
         "{{ x }}{% endfor %}", "1"},
        {"{% set ns = namespace(n=0) %}{% for x in [1, 2, 3, 4, 5] if x > ns.n %}{{ x }}"
         "{% set ns.n = x + 1 %}{{ loop.last }}{{ loop.nextitem }};{% endfor %}",
         "1False3;3False5;5True;"},
        {"{% set ns = namespace(n=0) %}{% for x in [1, 2, 3, 4] if x > ns.n %}{{ x }}"
         "{% set ns.n = 5 %}{{ loop.length }}{{ loop }}{% endfor %}", "11<LoopContext 1/1>"},
        {"{% set ns = namespace(n=0) %}{% for x in [1, 2, 3] if x > ns.n %}{{ x }}"
         "{% if x == 1 %}{% continue %}{% endif %}{% set ns.n = 5 %}{% else %}E{% endfor %}",
         "12"},
        {"{% set ns = namespace(n=0) %}{% for x in [1, 2, 3] if x > ns.n %}{% set ns.n = 5 %}"
         "{% continue %}{% else %}E{% endfor %}", "E"},
        {"{% set y = 0 %}{% for x in [1, 2] if x > y %}{% set y = 5 %}{{ x }}{% endfor %}", "12"},
        {"{% for x in [1, 0] if 1 // x %}{{ x }}{% break %}{% endfor %}", "1"},
        {"{% set ns = namespace(l=none) %}{% for x in [1, 2] if ns.l is none or ns.l.last %}"
         "{% set ns.l = loop %}{% endfor %}", NULL}, /* the generator is already executing */
        /* attribute= of map, selectattr, join found items only, not attributes */
        {"{% for x in [1, 2] %}{{ [loop] | map(attribute='index') | list }}"
         "{{ [loop] | selectattr('last') | list | length }}{% endfor %}"
         "{{ [{'a': 1}] | map(attribute='items') | first is defined }}"
         "{{ [{}] | map(attribute='pop') | first is defined }}"
         "{{ [{'items': 1}, [5]] | map(attribute='items') | list }}"
         "{{ [{'a': [5, 6]}] | join(attribute='a.1') }}",
         "[1]0[2]1TrueFalse[1, Undefined]6"},
        /* a range's count and index, as Python's (they were refused) */
        {"{{ range(5).count(2) }}{{ range(5).count(5) }}{{ range(5).count(true) }}"
         "{{ range(5).count('a') }}{{ range(10, 0, -3).index(4) }}{{ range(10)[2:8:2].index(6) }}"
         "{{ range(9223372036854775800, 9223372036854775807, 3).index(9223372036854775806) }}",
         "10102" "2" "2"},
        {"{{ range(5).index(5) }}", NULL},
        {"{{ range(5).count() }}", NULL},
        /* dict views printed as lists */
        {"{% set d = {'a': 1, 'b': 'x'} %}{{ d.keys() }} {{ [d.values()] }} {{ d.items() | string }}"
         " {{ {}.keys() }} {{ d.items() | list }} {{ d.values() | length }} {{ 'b' in d.keys() }}",
         "dict_keys(['a', 'b']) [dict_values([1, 'x'])] dict_items([('a', 1), ('b', 'x')])"
         " dict_keys([]) [('a', 1), ('b', 'x')] 2 True"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        render(cases[i].tmpl, m, 1, 1, buf, sizeof buf, &st);
        if (!cases[i].want) {
            if (st == KVC_OK) TEST_FAIL_("case %zu: rendered \"%s\", want an error", i, buf);
            continue;
        }
        if (st != KVC_OK) TEST_FAIL_("case %zu: %s", i, kvc_last_error());
        if (strcmp(buf, cases[i].want) != 0)
            TEST_FAIL_("case %zu: got \"%s\", want \"%s\"", i, buf, cases[i].want);
    }
    /* outside the subset (jinja2 renders it): UNSUPPORTED, not a template error */
    render("{{ {1: 'a'} }}", m, 1, 1, buf, sizeof buf, &st);
    ASSERT_STATUS(st, KVC_ERR_UNSUPPORTED);
    /* the rest of a filtered loop left with break, tested after the loop as jinja2's
     * generator does, with the names around the for statement as they are then (was
     * refused); after the macro that held it returned, with the macro's variables as
     * the call left them; after a block set that held it, refused */
    render("{% set ns = namespace(l=none) %}{% set y = 0 %}{% for x in [1, 2, 3] if x > y %}"
           "{% set ns.l = loop %}{% break %}{% endfor %}{% set y = 2 %}{{ ns.l.length }}",
           m, 1, 1, buf, sizeof buf, &st);
    ASSERT_STATUS(st, KVC_OK);
    ASSERT_TRUE(strcmp(buf, "2") == 0);
    render("{% set ns = namespace(l=none) %}{% macro f(k) %}{% for x in [1, 2, 3] if x > k %}"
           "{% set ns.l = loop %}{% break %}{% endfor %}{% set k = 2 %}{% endmacro %}{{ f(0) }}"
           "{{ ns.l.length }}", m, 1, 1, buf, sizeof buf, &st);
    ASSERT_STATUS(st, KVC_OK);
    ASSERT_TRUE(strcmp(buf, "2") == 0);
    render("{% set ns = namespace(l=none) %}{% set s %}{% for x in [1, 2] if x %}"
           "{% set ns.l = loop %}{% break %}{% endfor %}{% endset %}{{ ns.l.length }}",
           m, 1, 1, buf, sizeof buf, &st);
    ASSERT_STATUS(st, KVC_ERR_UNSUPPORTED);
    ASSERT_STR_CONTAINS(kvc_last_error(), "filtered loop");
    return 0;
}

TEST(chat_errors) {
    kvc_chat_message m[] = {{"user", "hi"}};
    char buf[256];
    size_t len;
    ASSERT_STATUS(kvc_chat_apply_template(NULL, "{{ raise_exception('roles must alternate') }}", m,
                                          1, 1, buf, sizeof buf, &len),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "roles must alternate");
    ASSERT_STR_CONTAINS(kvc_last_error(), "line 1:"); /* every message names its line */
    ASSERT_STATUS(kvc_chat_apply_template(NULL, "a\n{% for i in range(2) %}\n"
                                          "{{ raise_exception('x' * 500) }}{% endfor %}", m, 1, 1,
                                          buf, sizeof buf, &len),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "line 3: raised an exception: xxxx");
    const char *unsupported[] = {"{% call f() %}{% endcall %}",
                                 "{{ x | no_such_filter }}",
                                 "{{ x is no_such_test }}",
                                 "{{ 1.5 }}",
                                 "{% if true %}",
                                 "{{ a",
                                 "{#",
                                 "{% endif %}",
                                 "{{ 1 ** 2 }}",
                                 "{{ 1 / 2 }}",
                                 "{{ (1, 2) }}",
                                 "{{ 'ab' | wordcount }}",  /* jinja2 has it, kvcache not */
                                 "{{ 'ab' is lower }}",
                                 "{{ [1] | select }}",      /* a generator printed */
                                 "{% set g = [1] | map('string') %}{{ g | list }}{{ g | list }}",
                                 "{% macro m(x) %}{{ varargs }}{% endmacro %}{{ m(1) }}",
                                 /* a namespace could hold itself: printing it recursed forever */
                                 "{% set ns = namespace() %}{% set ns.x = [ns] %}{{ ns }}",
                                 "{{ now() }}",
                                 /* was kept as written; jinja2 decodes it (U+2022) */
                                 "{{ '\\N{BULLET}' }}",
                                 /* printf-style formatting: was INVALID_ARG, a type error */
                                 "{{ '%s items' % 3 }}", "{{ 'x' % u }}",
                                 /* a method as a value: jinja2 prints its address */
                                 "{{ {'items': 1}.items }}",
                                 "{% set f = {}.get %}{{ f('a') }}",
                                 /* methods as values were all equal (d.items == d.keys) */
                                 "{% set d = {} %}{{ d.items == d.keys }}",
                                 "{{ 'a'.upper != 'b'.upper }}", "{{ {}.get in [{}.keys] }}",
                                 /* printed as <function>; jinja2 prints an address */
                                 "{{ range }}", "{{ [namespace] }}",
                                 "{{ [1, 2] | reverse }}", /* jinja2 prints an address */
                                 /* iterating jinja2's LoopContext advances the loop */
                                 "{% for x in [1, 2] %}{{ 'index' in loop }}{% endfor %}",
                                 "{% for x in [1, 2] %}{{ loop|join }}{% endfor %}",
                                 /* start and end were ignored: 'abc'.startswith('b', 1) false */
                                 "{{ 'abc'.startswith('b', 1) }}"};
    for (size_t i = 0; i < sizeof unsupported / sizeof unsupported[0]; i++) {
        kvc_status st =
            kvc_chat_apply_template(NULL, unsupported[i], m, 1, 1, buf, sizeof buf, &len);
        if (st != KVC_ERR_UNSUPPORTED)
            TEST_FAIL_("\"%s\" -> %s (%s)", unsupported[i], kvc_status_str(st), kvc_last_error());
    }
    const char *invalid[] = {"{{ 'a' + 1 }}", "{{ nope.x }}", "{{ 1 // 0 }}",
                             "{% for x in 3 %}{% endfor %}", "{{ 9223372036854775807 + 1 }}",
                             "{{ 'a' is odd 3 }}", "{{ x | tojson }}", "{{ 'a'.upper(1) }}",
                             "{{ m() }}{% macro m() %}{% endmacro %}",
                             "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}",
                             "{% macro m(a) %}{% endmacro %}{{ m(1, a=2) }}",
                             "{{ strftime_now(1) }}", "{{ [1] | select | length }}",
                             "{% if false %}{{ 1.5 }}{% endif %}{{ 1 // 0 }}",
                             /* arguments a filter's signature refuses: were ignored */
                             "{{ 'x'|upper(1) }}", "{{ [1]|length(1) }}",
                             "{{ 'x'|trim(foo='x') }}", "{{ 'x'|replace('x') }}",
                             "{{ 'x'|d('a', boolean=true, default_value='b') }}",
                             /* 100k nested lists overflowed the stack when printed */
                             ("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}"
                              "{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}")};
    for (size_t i = 0; i < sizeof invalid / sizeof invalid[0]; i++) {
        kvc_status st = kvc_chat_apply_template(NULL, invalid[i], m, 1, 1, buf, sizeof buf, &len);
        if (st != KVC_ERR_INVALID_ARG)
            TEST_FAIL_("\"%s\" -> %s (%s)", invalid[i], kvc_status_str(st), kvc_last_error());
    }
    /* nesting and output are bounded */
    char deep[4200];
    size_t k = 0;
    k += (size_t)snprintf(deep, sizeof deep, "{{ ");
    for (int i = 0; i < 2000; i++) deep[k++] = '(';
    deep[k++] = '1';
    for (int i = 0; i < 2000; i++) deep[k++] = ')';
    snprintf(deep + k, sizeof deep - k, " }}");
    ASSERT_STATUS(kvc_chat_apply_template(NULL, deep, m, 1, 1, buf, sizeof buf, &len),
                  KVC_ERR_UNSUPPORTED);
    kvc_status st = kvc_chat_apply_template(NULL,
                                            "{% for a in range(100000) %}{% for b in range(100000) "
                                            "%}xxxxxxxxxx{% endfor %}{% endfor %}",
                                            m, 1, 1, buf, sizeof buf, &len);
    ASSERT_STATUS(st, KVC_ERR_INVALID_ARG); /* a limit, not the machine's memory */
    ASSERT_STR_CONTAINS(kvc_last_error(), "line 1:");
    /* the 256 MiB cap on the interpreter's memory is a limit too, with its line:
     * a string past it, and a list whose items pass it */
    const char *big[] = {"a\n{{ 'x' * 300000000 }}",
                         "a\n{% set s = 'y' * 200000000 %}{{ (s ~ s)|length }}",
                         ("a\n{% set ns = namespace(l=[]) %}{% for i in range(999999) %}"
                          "{% set ns.l = ns.l + [i] %}{% endfor %}")};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        ASSERT_STATUS(kvc_chat_apply_template(NULL, big[i], m, 1, 1, buf, sizeof buf, &len),
                      KVC_ERR_INVALID_ARG);
        ASSERT_STR_CONTAINS(kvc_last_error(), "line 2:");
        ASSERT_STR_CONTAINS(kvc_last_error(), "MiB");
    }
    /* argument checks */
    ASSERT_STATUS(kvc_chat_apply_template(NULL, NULL, m, 1, 1, buf, sizeof buf, &len),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_chat_apply_template(NULL, "x", NULL, 1, 1, buf, sizeof buf, &len),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_chat_apply_template(NULL, "x", m, 1, 1, NULL, 4, &len), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_chat_apply_template(NULL, "x", m, -1, 1, buf, 4, &len), KVC_ERR_INVALID_ARG);
    /* a tokenizer without a template */
    kvc_tokenizer *t = make_tiny("gpt2");
    ASSERT_STATUS(kvc_chat_apply_template(t, NULL, m, 1, 1, buf, sizeof buf, &len),
                  KVC_ERR_NOT_FOUND);
    ASSERT_OK(kvc_chat_apply_template(t, "{{ bos_token }}{{ eos_token }}", m, 1, 1, buf, sizeof buf,
                                      &len));
    ASSERT_EQ_I64(len, 22);
    ASSERT_MEM_EQ(buf, "<|im_start|><|im_end|>", 22);
    kvc_tokenizer_destroy(t);
    return 0;
}

/* Random bytes as templates and as messages: statuses, never a crash. */
TEST(chat_fuzz) {
    uint64_t seed = test_seed ^ 0x5eed;
    static const char *const pieces[] = {
        "{{", "}}",  "{%", "%}",    "{#",     "#}",   "-",        "+",    " ",
        "if", "for", "in", "endif", "endfor", "x",    "messages", "'",    "\"",
        "(",  ")",   "[",  "]",     "|",      "trim", ".",        "loop", "set",
        "=",  "\n",  "1",  "~",     "not",    "is",   "defined",  ":"};
    char tmpl[256], buf[512];
    kvc_chat_message m[] = {{"user", "a"}, {"assistant", "\xff\xfe"}};
    for (int it = 0; it < 3000; it++) {
        size_t k = 0;
        int n = (int)(test_rng_next(&seed) % 24);
        for (int i = 0; i < n; i++) {
            const char *p = pieces[test_rng_next(&seed) % (sizeof pieces / sizeof pieces[0])];
            size_t pl = strlen(p);
            if (k + pl + 1 >= sizeof tmpl) break;
            memcpy(tmpl + k, p, pl);
            k += pl;
        }
        tmpl[k] = 0;
        size_t len;
        kvc_status st = kvc_chat_apply_template(NULL, tmpl, m, 2, 1, buf, sizeof buf, &len);
        ASSERT_TRUE(st == KVC_OK || st == KVC_ERR_UNSUPPORTED || st == KVC_ERR_INVALID_ARG ||
                    st == KVC_ERR_NO_SPACE);
    }
    return 0;
}

/* ---- chat templates with a JSON context -------------------------------------------- */

static kvc_status render_json(const kvc_tokenizer *t, const char *tmpl, const char *json,
                              char *buf, size_t cap) {
    size_t len = 0;
    kvc_status st = kvc_chat_apply_template_json(t, tmpl, json, 1, buf, cap, &len);
    if (st == KVC_OK && len < cap) buf[len] = 0;
    return st;
}

TEST(chat_json_values) {
    char buf[2048];
    static const struct {
        const char *tmpl, *json, *want;
    } cases[] = {
        {"{{ messages | tojson }}", "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
         "[{\"role\": \"user\", \"content\": \"hi\"}]"},
        /* every kind of value, escapes, whitespace around everything */
        {"{{ v | tojson }}",
         " \t\n\r{ \"messages\" : [ ] , \"v\" : [ 1 , -0 , -9223372036854775808 , "
         "9223372036854775807 , true , false , null , "
         "\"a\\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\uD83D\\uDE00\\u20ac\" , { } , [ ] ] } \n",
         "[1, 0, -9223372036854775808, 9223372036854775807, true, false, null, "
         "\"a\\\"\\\\/\\b\\f\\n\\r\\t\xc3\xa9\xf0\x9f\x98\x80\xe2\x82\xac\", {}, []]"},
        {"{{ v is string }}{{ v | length }}", "{\"messages\":[],\"v\":\"a\\u0000b\xc3\xa9\"}",
         "True4"},
        /* a duplicate key keeps its first place and its last value, as json.loads */
        {"{{ d | tojson }}", "{\"messages\":[],\"d\":{\"a\":1,\"b\":2,\"a\":3}}",
         "{\"a\": 3, \"b\": 2}"},
        {"{{ d }}", "{\"messages\":[],\"d\":{\"a\":1,\"d\":2},\"d\":{\"x\":[]}}", "{'x': []}"},
        /* members are variables: before the functions; tools / documents default to None */
        {"{{ range }}|{{ tools }}|{{ documents }}", "{\"messages\":[],\"range\":\"R\"}",
         "R|None|None"},
        {"{{ tools[0].function.name }}{{ documents | length }}",
         "{\"messages\":[],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
         "\"documents\":[{},{}]}",
         "f2"},
        {"{% if enable_thinking is false %}no{% endif %}{{ date_string }}",
         "{\"messages\":[],\"enable_thinking\":false,\"date_string\":\"26 Nov 2026\"}",
         "no26 Nov 2026"},
        /* the keys a message has, and only those */
        {"{% for m in messages %}{{ m.content is defined }} {{ m.tool_calls[0].function.arguments"
         ".city }} {{ m.tool_calls[0].function.arguments | tojson }}{% endfor %}",
         "{\"messages\":[{\"role\":\"assistant\",\"tool_calls\":[{\"type\":\"function\","
         "\"function\":{\"name\":\"w\",\"arguments\":{\"city\":\"Paris\",\"days\":3}}}]}]}",
         "False Paris {\"city\": \"Paris\", \"days\": 3}"},
        {"{{ add_generation_prompt }}{{ bos_token }}{{ eos_token }}", "{\"messages\":[]}",
         "True"},
        {"{{ bos_token }}{{ eos_token }}",
         "{\"messages\":[],\"bos_token\":\"<s>\",\"eos_token\":null}", "<s>None"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvc_status st = render_json(NULL, cases[i].tmpl, cases[i].json, buf, sizeof buf);
        if (st != KVC_OK) TEST_FAIL_("case %zu: %s (%s)", i, kvc_status_str(st), kvc_last_error());
        if (strcmp(buf, cases[i].want) != 0)
            TEST_FAIL_("case %zu: got \"%s\", want \"%s\"", i, buf, cases[i].want);
    }
    /* a large object (hashed duplicate search): k3 keeps its place, takes the last value */
    char json[1024];
    size_t k = (size_t)snprintf(json, sizeof json, "{\"messages\":[],\"d\":{");
    for (int i = 0; i < 40; i++)
        k += (size_t)snprintf(json + k, sizeof json - k, "\"k%d\":%d,", i, i);
    snprintf(json + k, sizeof json - k, "\"k3\":99,\"k39\":-1}}");
    ASSERT_OK(render_json(NULL, "{{ d | length }} {{ (d | list)[3] }} {{ d.k3 }} {{ d.k39 }}",
                          json, buf, sizeof buf));
    ASSERT_TRUE(strcmp(buf, "40 k3 99 -1") == 0);
    /* the tokenizer's bos / eos unless the context sets them */
    kvc_tokenizer *t = make_tiny("gpt2");
    ASSERT_OK(render_json(t, "{{ bos_token }}{{ eos_token }}", "{\"messages\":[]}", buf,
                          sizeof buf));
    ASSERT_TRUE(strcmp(buf, "<|im_start|><|im_end|>") == 0);
    ASSERT_OK(render_json(t, "{{ bos_token }}{{ eos_token }}",
                          "{\"messages\":[],\"bos_token\":\"B\"}", buf, sizeof buf));
    ASSERT_TRUE(strcmp(buf, "B<|im_end|>") == 0);
    kvc_tokenizer_destroy(t);
    /* the same conversation through both calls renders the same */
    kvc_chat_message m[] = {{"system", "Be brief."}, {"user", "Hi \"you\"\n"}};
    char buf2[1024];
    size_t len1 = 0, len2 = 0;
    ASSERT_OK(kvc_chat_apply_template(NULL, smollm_template, m, 2, 1, buf, sizeof buf, &len1));
    ASSERT_OK(kvc_chat_apply_template_json(NULL, smollm_template,
                                           "{\"messages\":[{\"role\":\"system\",\"content\":"
                                           "\"Be brief.\"},{\"role\":\"user\",\"content\":"
                                           "\"Hi \\\"you\\\"\\n\"}]}",
                                           1, buf2, sizeof buf2, &len2));
    ASSERT_EQ_I64(len1, len2);
    ASSERT_MEM_EQ(buf, buf2, len1);
    return 0;
}

TEST(chat_json_refused) {
    char buf[256];
    static const char *const invalid[] = {
        "", " ", "[]", "1", "null", "\"messages\"", "{", "{\"messages\":[]", "{\"messages\":[],}",
        "{\"messages\":[1,]}", "{\"messages\":[,1]}", "{messages:[]}", "{'messages':[]}",
        "{\"messages\":[]} x", "{\"messages\":[]}{}", "{\"messages\" []}",
        "{\"messages\":[] \"a\":1}",
        "{\"messages\":[01]}", "{\"messages\":[-01]}", "{\"messages\":[1.]}", "{\"messages\":[.5]}",
        "{\"messages\":[-]}", "{\"messages\":[1e]}", "{\"messages\":[1e+]}", "{\"messages\":[+1]}",
        "{\"messages\":[0x10]}", "{\"messages\":[True]}", "{\"messages\":[nul]}",
        "{\"messages\":[-NaN]}", "{\"messages\":[\"abc]}", "{\"messages\":[\"a\tb\"]}",
        "{\"messages\":[\"a\nb\"]}", "{\"messages\":[\"\\x41\"]}", "{\"messages\":[\"\\u12\"]}",
        "{\"messages\":[\"\\u12g4\"]}", "{\"messages\":[\"\\ud800\"]}",
        "{\"messages\":[\"\\udc00\"]}", "{\"messages\":[\"\\ud800\\u0041\"]}",
        "{\"messages\":[\"\\ud800\\ud800\"]}", "{\"messages\":[\"\xff\"]}",
        "{\"messages\":[\"\xc0\xaf\"]}", "{\"messages\":[\"\xed\xa0\x80\"]}",
        "{\"messages\":[\"\xf4\x90\x80\x80\"]}", "{\"messages\":[\"\xe2\x82\"]}",
        "\xef\xbb\xbf{\"messages\":[]}", "{\"messages\":[1.5,]}", /* malformed before unsupported */
        /* well-formed, but not a context */
        "{}", "{\"messages\":\"x\"}", "{\"messages\":{}}", "{\"messages\":null}",
        "{\"messages\":[],\"add_generation_prompt\":true}"};
    for (size_t i = 0; i < sizeof invalid / sizeof invalid[0]; i++) {
        size_t len = 7;
        memset(buf, 0x5A, sizeof buf);
        kvc_status st =
            kvc_chat_apply_template_json(NULL, "x", invalid[i], 1, buf, sizeof buf, &len);
        if (st != KVC_ERR_INVALID_ARG)
            TEST_FAIL_("'%s' -> %s (%s)", invalid[i], kvc_status_str(st), kvc_last_error());
        ASSERT_STR_CONTAINS(kvc_last_error(), "context JSON");
        ASSERT_TRUE(buf[0] == 0x5A); /* nothing written */
    }
    ASSERT_STATUS(render_json(NULL, "x", "{\"messages\":[\"\\ud800\"]}", buf, sizeof buf),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "offset 14: a lone surrogate \\ud800");
    /* what json.loads reads as a float, and big integers: the path is named */
    static const char *const floats[] = {"1.5", "1e3", "-0.0", "1E+2", "0.5e-7", "NaN",
                                         "Infinity", "-Infinity", "1e400",
                                         "9223372036854775808", "-9223372036854775809",
                                         "123456789012345678901234567890"};
    for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++) {
        char json[128];
        snprintf(json, sizeof json, "{\"messages\":[],\"tools\":[{\"a b\":{\"min\":%s}}]}",
                 floats[i]);
        kvc_status st = render_json(NULL, "x", json, buf, sizeof buf);
        if (st != KVC_ERR_UNSUPPORTED)
            TEST_FAIL_("'%s' -> %s (%s)", json, kvc_status_str(st), kvc_last_error());
        ASSERT_STR_CONTAINS(kvc_last_error(), "offset 38 (tools[0]['a b']['min']):");
    }
    /* nesting: 500 arrays in a member, not 501 */
    static char deep[1200];
    for (int extra = 0; extra < 2; extra++) {
        int n = 500 + extra;
        size_t k = (size_t)snprintf(deep, sizeof deep, "{\"messages\":[],\"v\":");
        for (int i = 0; i < n; i++) deep[k++] = '[';
        for (int i = 0; i < n; i++) deep[k++] = ']';
        snprintf(deep + k, sizeof deep - k, "}");
        kvc_status st = render_json(NULL, "{{ v | length }}", deep, buf, sizeof buf);
        ASSERT_STATUS(st, extra ? KVC_ERR_INVALID_ARG : KVC_OK);
        if (extra) ASSERT_STR_CONTAINS(kvc_last_error(), "nested more than 500 deep");
    }
    /* the interpreter's 256 MiB cap covers the context: a limit, not the machine's memory */
    size_t n_items = (size_t)12 << 20, n = 0;
    char *big = malloc(2 * n_items + 64);
    ASSERT_TRUE(big != NULL);
    n += (size_t)sprintf(big, "{\"messages\":[],\"v\":[");
    for (size_t i = 0; i < n_items; i++) {
        big[n++] = '0';
        big[n++] = ',';
    }
    strcpy(big + n, "0]}");
    kvc_status st = render_json(NULL, "x", big, buf, sizeof buf);
    free(big);
    ASSERT_STATUS(st, KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "context JSON");
    ASSERT_STR_CONTAINS(kvc_last_error(), "MiB");
    /* template errors still name their line */
    ASSERT_STATUS(render_json(NULL, "\n{{ raise_exception('no tools') }}", "{\"messages\":[]}",
                              buf, sizeof buf),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "line 2:");
    return 0;
}

TEST(chat_json_buffer_contract) {
    const char *tmpl = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}";
    const char *json = "{\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}]}";
    char buf[64];
    size_t len = 0;
    ASSERT_STATUS(kvc_chat_apply_template_json(NULL, tmpl, json, 0, NULL, 0, &len),
                  KVC_ERR_NO_SPACE);
    ASSERT_EQ_I64(len, 12);
    memset(buf, 0x5A, sizeof buf);
    len = 0;
    ASSERT_STATUS(kvc_chat_apply_template_json(NULL, tmpl, json, 0, buf, 11, &len),
                  KVC_ERR_NO_SPACE);
    ASSERT_EQ_I64(len, 12);
    for (size_t i = 0; i < sizeof buf; i++) ASSERT_TRUE(buf[i] == 0x5A);
    ASSERT_OK(kvc_chat_apply_template_json(NULL, tmpl, json, 0, buf, 12, &len));
    ASSERT_EQ_I64(len, 12);
    ASSERT_MEM_EQ(buf, "[user:hello]", 12);
    ASSERT_TRUE(buf[12] == 0x5A);
    ASSERT_OK(kvc_chat_apply_template_json(NULL, "", "{\"messages\":[]}", 0, NULL, 0, &len));
    ASSERT_EQ_I64(len, 0);
    /* argument checks */
    ASSERT_STATUS(kvc_chat_apply_template_json(NULL, tmpl, NULL, 0, buf, sizeof buf, &len),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_chat_apply_template_json(NULL, tmpl, json, 0, buf, sizeof buf, NULL),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_chat_apply_template_json(NULL, tmpl, json, 0, NULL, 4, &len),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_chat_apply_template_json(NULL, NULL, json, 0, buf, sizeof buf, &len),
                  KVC_ERR_INVALID_ARG);
    kvc_tokenizer *t = make_tiny("gpt2");
    ASSERT_STATUS(kvc_chat_apply_template_json(t, NULL, json, 0, buf, sizeof buf, &len),
                  KVC_ERR_NOT_FOUND);
    kvc_tokenizer_destroy(t);
    return 0;
}

/* ---- the real model -------------------------------------------------------- */

static int model_path(char *path, size_t n) {
    const char *src = __FILE__;
    const char *slash = strrchr(src, '/');
    int dir_len = slash ? (int)(slash - src) : 0;
    snprintf(path, n, "%.*s%s../models/SmolLM2-135M-Instruct.Q4_1.gguf", dir_len, src,
             slash ? "/" : "");
    struct stat sb;
    return stat(path, &sb) == 0;
}

TEST(real_model) {
    char path[1024];
    if (!model_path(path, sizeof path)) SKIP("the default model is absent (%s): scripts/fetch_model.sh", path);
    kvc_gguf *g = NULL;
    ASSERT_OK(kvc_gguf_open(path, &g));
    kvc_tokenizer *t = NULL;
    ASSERT_OK(kvc_tokenizer_from_gguf(g, &t));
    kvc_gguf_close(g); /* the tokenizer keeps copies */
    ASSERT_EQ_I64(kvc_tokenizer_n_vocab(t), 49152);
    ASSERT_EQ_I64(kvc_tokenizer_bos(t), 1);
    ASSERT_EQ_I64(kvc_tokenizer_eos(t), 2);
    ASSERT_EQ_I64(kvc_tokenizer_eot(t), 2);
    ASSERT_TRUE(kvc_tokenizer_is_eog(t, 0) && kvc_tokenizer_is_eog(t, 2));
    /* ids checked by hand against the vocabulary: Hello / , / Ġworld / ! */
    int32_t ids[64];
    ASSERT_EQ_I64(enc(t, "Hello, world!", 1, ids, 64), 4);
    ASSERT_EQ_I64(ids[0], 19556);
    ASSERT_EQ_I64(ids[1], 28);
    ASSERT_EQ_I64(ids[2], 905);
    ASSERT_EQ_I64(ids[3], 17);
    ASSERT_EQ_I64(enc(t, "<|im_start|>user\n", 1, ids, 64), 3);
    ASSERT_EQ_I64(ids[0], 1);
    ASSERT_EQ_I64(ids[1], 4093);
    ASSERT_EQ_I64(ids[2], 198);
    kvc_chat_message m[] = {{"user", "Hi"}};
    char buf[512];
    size_t len = 0;
    ASSERT_OK(kvc_chat_apply_template(t, NULL, m, 1, 1, buf, sizeof buf, &len));
    const char *want = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                       "by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                       "<|im_start|>assistant\n";
    ASSERT_EQ_I64(len, strlen(want));
    ASSERT_MEM_EQ(buf, want, len);
    kvc_tokenizer_destroy(t);
    return 0;
}

TEST(from_gguf_errors) {
    ASSERT_STATUS(kvc_tokenizer_from_gguf(NULL, NULL), KVC_ERR_INVALID_ARG);
    kvc_tokenizer *t = (kvc_tokenizer *)1;
    ASSERT_STATUS(kvc_tokenizer_from_gguf(NULL, &t), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(t == NULL);
    /* a valid GGUF with no tokenizer: v3, 0 tensors, 0 key-values */
    static const unsigned char empty[] = {'G', 'G', 'U', 'F', 3, 0, 0, 0, 0, 0, 0, 0,
                                          0,   0,   0,   0,   0, 0, 0, 0, 0, 0, 0, 0};
    kvc_gguf *g = NULL;
    ASSERT_OK(kvc_gguf_open_memory(empty, sizeof empty, &g));
    ASSERT_STATUS(kvc_tokenizer_from_gguf(g, &t), KVC_ERR_NOT_FOUND);
    kvc_gguf_close(g);
    return 0;
}

const char *test_suite_name = "tokenizer";
const test_case test_suite[] = {
    TEST_ENTRY(gpt2_byte_table),
    TEST_ENTRY(utf8_and_classes),
    TEST_ENTRY(pre_tokenizer_boundaries),
    TEST_ENTRY(merges_and_bytes),
    TEST_ENTRY(add_bos_flag),
    TEST_ENTRY(special_tokens),
    TEST_ENTRY(invalid_utf8_and_empty),
    TEST_ENTRY(no_space_and_bad_args),
    TEST_ENTRY(create_validation),
    TEST_ENTRY(long_inputs),
    TEST_ENTRY(chat_smollm_template),
    TEST_ENTRY(chat_whitespace_and_expressions),
    TEST_ENTRY(chat_differential_regressions),
    TEST_ENTRY(chat_errors),
    TEST_ENTRY(chat_fuzz),
    TEST_ENTRY(chat_json_values),
    TEST_ENTRY(chat_json_refused),
    TEST_ENTRY(chat_json_buffer_contract),
    TEST_ENTRY(real_model),
    TEST_ENTRY(from_gguf_errors),
    {0, 0},
};
