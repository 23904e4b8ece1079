/*
 * Text in, text out: streaming UTF-8 repair of detokenized bytes
 * (kvc_utf8_stream) and chat prompts whose message contents are plain text
 * (kvc_chat_tokenize). Expected UTF-8 outputs follow the Unicode standard's
 * "maximal subpart" replacement (Table 3-8 practice), which is what
 * Python's bytes.decode("utf-8", "replace") gives; python/tests/
 * test_tokenizer.py also compares random streams with Python's decoder.
 */
#define _POSIX_C_SOURCE 200809L /* setenv, fork */
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

#define R "\xEF\xBF\xBD" /* U+FFFD */

/* Feeds in[0..n) split at a, then b (a <= b <= n), flushes; the output. */
static int stream3(const char *in, size_t n, size_t a, size_t b, char *out, size_t *len) {
    kvc_utf8_stream s;
    kvc_utf8_stream_init(&s);
    size_t o = 0, k = 0;
    const size_t cut[4] = {0, a, b, n};
    for (int i = 0; i < 3; i++) {
        if (kvc_utf8_stream_feed(&s, in + cut[i], cut[i + 1] - cut[i], out + o,
                                 kvc_utf8_stream_bound(cut[i + 1] - cut[i]), &k) != KVC_OK)
            return 1;
        o += k;
    }
    if (kvc_utf8_stream_flush(&s, out + o, 3, &k) != KVC_OK) return 1;
    *len = o + k;
    return 0;
}

TEST(utf8_stream_cases) {
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"a\xC3\xA9z", "a\xC3\xA9z"},                 /* 2-byte */
        {"\xE2\x82\xAC", "\xE2\x82\xAC"},             /* 3-byte */
        {"\xF0\x9F\x8E\x89!", "\xF0\x9F\x8E\x89!"},   /* 4-byte */
        {"\xF0\x9F\x8E", R},                          /* cut short at the end */
        {"\xF0\x9F\x8E" "A", R "A"},                  /* one U+FFFD per maximal subpart */
        {"\xE2\x82x", R "x"},
        {"\x80", R},                                  /* stray continuation */
        {"\xBF\x80", R R},
        {"\xFF\xFE", R R},                            /* never valid */
        {"\xF5\x80\x80\x80", R R R R},                /* above U+10FFFF */
        {"\xC0\xAF", R R},                            /* overlong '/' */
        {"\xC1\xBF", R R},
        {"\xE0\x80\xAF", R R R},                      /* overlong, 3 bytes */
        {"\xE0\x9F\xBF", R R R},
        {"\xE0\xA0\x80", "\xE0\xA0\x80"},             /* smallest 3-byte */
        {"\xF0\x8F\xBF\xBF", R R R R},                /* overlong, 4 bytes */
        {"\xED\xA0\x80", R R R},                      /* surrogate U+D800 */
        {"\xED\x9F\xBF", "\xED\x9F\xBF"},             /* U+D7FF */
        {"\xF4\x8F\xBF\xBF", "\xF4\x8F\xBF\xBF"},     /* U+10FFFF */
        {"\xF4\x90\x80\x80", R R R R},                /* U+110000 */
        {"\xC3", R},
        {"\xC3\xC3\xA9", R "\xC3\xA9"},               /* a lead restarts the sequence */
        {"a\x00" "b", "a\x00" "b"},
    };
    char out[64];
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        /* "a\0b" holds a NUL: its length is 3 */
        const size_t n = c == sizeof cases / sizeof cases[0] - 1 ? 3 : strlen(cases[c].in);
        const size_t wn = c == sizeof cases / sizeof cases[0] - 1 ? 3 : strlen(cases[c].want);
        for (size_t a = 0; a <= n; a++)
            for (size_t b = a; b <= n; b++) {
                size_t len = 0;
                if (stream3(cases[c].in, n, a, b, out, &len))
                    TEST_FAIL_("case %zu split %zu/%zu: %s", c, a, b, kvc_last_error());
                if (len != wn || memcmp(out, cases[c].want, wn) != 0)
                    TEST_FAIL_("case %zu split %zu/%zu: %zu bytes, want %zu", c, a, b, len, wn);
            }
    }
    return 0;
}

TEST(utf8_stream_holds_back) {
    kvc_utf8_stream s;
    kvc_utf8_stream_init(&s);
    char out[32];
    size_t len = 99;
    /* an emoji arriving a byte at a time: nothing until it is complete */
    const char emoji[] = "\xF0\x9F\x8E\x89";
    for (int i = 0; i < 3; i++) {
        ASSERT_OK(kvc_utf8_stream_feed(&s, emoji + i, 1, out, sizeof out, &len));
        ASSERT_EQ_I64(len, 0);
    }
    ASSERT_OK(kvc_utf8_stream_feed(&s, emoji + 3, 1, out, sizeof out, &len));
    ASSERT_EQ_I64(len, 4);
    ASSERT_MEM_EQ(out, emoji, 4);
    ASSERT_OK(kvc_utf8_stream_flush(&s, out, sizeof out, &len));
    ASSERT_EQ_I64(len, 0);
    /* buffer contract: too small a cap writes nothing and keeps the state */
    ASSERT_OK(kvc_utf8_stream_feed(&s, "\xE2\x82", 2, out, sizeof out, &len));
    ASSERT_EQ_I64(len, 0);
    memset(out, 'z', sizeof out);
    ASSERT_STATUS(kvc_utf8_stream_feed(&s, "\xAC" "abc", 4, out, 5, &len), KVC_ERR_NO_SPACE);
    ASSERT_EQ_I64(len, 6);
    ASSERT_TRUE(out[0] == 'z');
    ASSERT_OK(kvc_utf8_stream_feed(&s, "\xAC" "abc", 4, out, 6, &len));
    ASSERT_MEM_EQ(out, "\xE2\x82\xAC" "abc", 6);
    /* flush of a held tail: U+FFFD, then the stream is reusable */
    ASSERT_OK(kvc_utf8_stream_feed(&s, "\xC3", 1, out, sizeof out, &len));
    ASSERT_STATUS(kvc_utf8_stream_flush(&s, out, 2, &len), KVC_ERR_NO_SPACE);
    ASSERT_OK(kvc_utf8_stream_flush(&s, out, 3, &len));
    ASSERT_EQ_I64(len, 3);
    ASSERT_MEM_EQ(out, R, 3);
    ASSERT_OK(kvc_utf8_stream_feed(&s, "ok", 2, out, sizeof out, &len));
    ASSERT_MEM_EQ(out, "ok", 2);
    /* the bound covers the worst case: held bytes flushed as U+FFFD, then
     * every input byte replaced */
    ASSERT_OK(kvc_utf8_stream_feed(&s, "\xF0\x9F\x8E", 3, out, sizeof out, &len));
    ASSERT_OK(kvc_utf8_stream_feed(&s, "\xFF\xFF", 2, out, kvc_utf8_stream_bound(2), &len));
    ASSERT_EQ_I64(len, 9);
    ASSERT_STATUS(kvc_utf8_stream_feed(NULL, "a", 1, out, 4, &len), KVC_ERR_INVALID_ARG);
    ASSERT_STATUS(kvc_utf8_stream_feed(&s, NULL, 1, out, 4, &len), KVC_ERR_INVALID_ARG);
    kvc_utf8_stream_init(NULL); /* a no-op (tokenizer.h) */
    /* in place (out over in: core.h: undefined, but in bounds): the first
     * U+FFFD overwrites "é", which the old code's writing pass then read as
     * two stray bytes, writing 9 bytes where the counting pass allowed 5 */
    kvc_utf8_stream_init(&s);
    unsigned char *b = malloc(5 + 64);
    ASSERT_TRUE(b != NULL);
    memset(b, 0x5a, 5 + 64);
    memcpy(b, "\xFF\xC3\xA9\xC3", 4);
    ASSERT_OK(kvc_utf8_stream_feed(&s, (const char *)b, 4, (char *)b, 5, &len));
    ASSERT_EQ_I64(len, 5);
    for (int i = 5; i < 5 + 64; i++) ASSERT_TRUE(b[i] == 0x5a);
    free(b);
    return 0;
}


/* ---- chat contents as plain text ---------------------------------------- */

static kvc_tokenizer *load_model_tokenizer(void) {
    const char *src = __FILE__;
    const char *slash = strrchr(src, '/');
    char path[1024];
    snprintf(path, sizeof path, "%.*s%s../models/SmolLM2-135M-Instruct.Q4_1.gguf",
             slash ? (int)(slash - src) : 0, src, slash ? "/" : "");
    struct stat sb;
    kvc_gguf *g = NULL;
    kvc_tokenizer *t = NULL;
    if (stat(path, &sb) != 0 || kvc_gguf_open(path, &g) != KVC_OK) return NULL;
    if (kvc_tokenizer_from_gguf(g, &t) != KVC_OK) t = NULL;
    kvc_gguf_close(g);
    return t;
}

/* Appends the tokens of text (special tokens parsed or not) to ids. */
static int append_ids(const kvc_tokenizer *t, const char *text, int special, int32_t *ids,
                      int64_t *n) {
    int64_t k = 0;
    if (kvc_tokenize(t, text, strlen(text), 0, special, ids + *n, 4096 - *n, &k) != KVC_OK)
        return 1;
    *n += k;
    return 0;
}

static int count_id(const int32_t *ids, int64_t n, int32_t id) {
    int c = 0;
    for (int64_t i = 0; i < n; i++) c += ids[i] == id;
    return c;
}

TEST(chat_contents_plain_text) {
    kvc_tokenizer *t = load_model_tokenizer();
    if (!t) SKIP("the default model is absent (scripts/fetch_model.sh)");
    static int32_t got[4096], want[4096], str[4096];
    int64_t ng = 0, nw = 0, ns = 0;
    const int32_t im_end = 2; /* SmolLM2: <|im_end|> is eos */
    const kvc_chat_message m[2] = {{"system", "S"}, {"user", "a <|im_end|> b"}};
    /* the string path: the user's <|im_end|> becomes the control token */
    char prompt[512];
    size_t plen = 0;
    ASSERT_OK(kvc_chat_apply_template(t, NULL, m, 2, 1, prompt, sizeof prompt, &plen));
    ASSERT_OK(kvc_tokenize(t, prompt, plen, 0, 1, str, 4096, &ns));
    ASSERT_EQ_I64(count_id(str, ns, im_end), 3);
    ASSERT_OK(kvc_chat_tokenize(t, NULL, m, 2, 1, 0, 1, got, 4096, &ng)); /* contents special */
    ASSERT_EQ_I64(ng, ns);
    ASSERT_MEM_EQ(got, str, (size_t)ns * 4);
    /* plain contents: the template's markers are control tokens, the
     * content's characters are text, and the text between markers is one
     * segment (split and merged across the content's edges) */
    ASSERT_OK(kvc_chat_tokenize(t, NULL, m, 2, 1, 0, 0, got, 4096, &ng));
    ASSERT_TRUE(!append_ids(t, "<|im_start|>system\nS<|im_end|>\n<|im_start|>", 1, want, &nw));
    ASSERT_TRUE(!append_ids(t, "user\na <|im_end|> b", 0, want, &nw));
    ASSERT_TRUE(!append_ids(t, "<|im_end|>\n<|im_start|>assistant\n", 1, want, &nw));
    ASSERT_EQ_I64(ng, nw);
    ASSERT_MEM_EQ(got, want, (size_t)nw * 4);
    ASSERT_EQ_I64(count_id(got, ng, im_end), 2);
    /* measuring: cap 0 gives the count and writes nothing */
    int64_t need = 0;
    ASSERT_STATUS(kvc_chat_tokenize(t, NULL, m, 2, 1, 0, 0, NULL, 0, &need), KVC_ERR_NO_SPACE);
    ASSERT_EQ_I64(need, nw);
    /* contents without control text: the string path's tokens exactly */
    const kvc_chat_message p[1] = {{"user", "plain <b>text</b> 1234"}};
    ASSERT_OK(kvc_chat_apply_template(t, NULL, p, 1, 1, prompt, sizeof prompt, &plen));
    ASSERT_OK(kvc_tokenize(t, prompt, plen, 1, 1, str, 4096, &ns));
    ASSERT_OK(kvc_chat_tokenize(t, NULL, p, 1, 1, 1, 0, got, 4096, &ng)); /* with BOS */
    ASSERT_EQ_I64(ng, ns);
    ASSERT_MEM_EQ(got, str, (size_t)ns * 4);
    ASSERT_EQ_I64(got[0], kvc_tokenizer_bos(t));
    kvc_tokenizer_destroy(t);
    return 0;
}

TEST(chat_contents_templates) {
    kvc_tokenizer *t = load_model_tokenizer();
    if (!t) SKIP("the default model is absent (scripts/fetch_model.sh)");
    static int32_t got[4096], want[4096];
    int64_t ng = 0, nw = 0;
    /* a template that trims and prints the content twice: both places plain */
    const char *trim2 = "{% for m in messages %}<|im_start|>{{ m.content | trim }}<|im_end|>"
                        "{{ m.content }}{% endfor %}";
    const kvc_chat_message m[2] = {{"user", "  x<|im_end|>y \n"}, {"user", "<|im_start|>"}};
    ASSERT_OK(kvc_chat_tokenize(t, trim2, m, 2, 0, 0, 0, got, 4096, &ng));
    ASSERT_TRUE(!append_ids(t, "<|im_start|>", 1, want, &nw));
    ASSERT_TRUE(!append_ids(t, "x<|im_end|>y", 0, want, &nw));
    ASSERT_TRUE(!append_ids(t, "<|im_end|>", 1, want, &nw));
    ASSERT_TRUE(!append_ids(t, "  x<|im_end|>y \n", 0, want, &nw));
    ASSERT_TRUE(!append_ids(t, "<|im_start|>", 1, want, &nw));
    ASSERT_TRUE(!append_ids(t, "<|im_start|>", 0, want, &nw));
    ASSERT_TRUE(!append_ids(t, "<|im_end|>", 1, want, &nw));
    ASSERT_TRUE(!append_ids(t, "<|im_start|>", 0, want, &nw));
    ASSERT_EQ_I64(ng, nw);
    ASSERT_MEM_EQ(got, want, (size_t)nw * 4);
    /* a template that changes the content: its place is unknown, refused */
    const char *up = "{% for m in messages %}<|im_start|>{{ m.content | upper }}<|im_end|>"
                     "{% endfor %}";
    ASSERT_STATUS(kvc_chat_tokenize(t, up, m, 1, 0, 0, 0, got, 4096, &ng), KVC_ERR_UNSUPPORTED);
    ASSERT_STR_CONTAINS(kvc_last_error(), "parse_special_content");
    /* ... unless special tokens are allowed in contents, or there are none */
    ASSERT_OK(kvc_chat_tokenize(t, up, m, 1, 0, 0, 1, got, 4096, &ng));
    const kvc_chat_message plain[1] = {{"user", "hi"}};
    ASSERT_OK(kvc_chat_tokenize(t, up, plain, 1, 0, 0, 0, got, 4096, &ng));
    /* spans: checked */
    const size_t bad[4] = {3, 5, 4, 6};
    ASSERT_STATUS(kvc_tokenize_spans(t, "abcdefgh", 8, 0, bad, 2, got, 64, &ng),
                  KVC_ERR_INVALID_ARG);
    const size_t past[2] = {3, 9};
    ASSERT_STATUS(kvc_tokenize_spans(t, "abcdefgh", 8, 0, past, 1, got, 64, &ng),
                  KVC_ERR_INVALID_ARG);
    /* a control token straddling a span edge is not taken */
    const size_t edge[2] = {5, 10};
    nw = 0;
    ASSERT_OK(kvc_tokenize_spans(t, "<|im_end|>", 10, 0, edge, 1, got, 64, &ng));
    ASSERT_TRUE(!append_ids(t, "<|im_end|>", 0, want, &nw));
    ASSERT_EQ_I64(ng, nw);
    ASSERT_MEM_EQ(got, want, (size_t)nw * 4);
    kvc_tokenizer_destroy(t);
    return 0;
}

/* With KVC_ISA=Avx3 the library refuses it where it selects kernels, naming
 * the valid values. The variable is read once per process, so without it
 * this case runs itself again in a child with it set (ctest also runs
 * c_text_isa_env_unknown so). */
TEST(isa_env_unknown) {
    const char *env = getenv("KVC_ISA");
    if (!env || strcmp(env, "Avx3") != 0) {
        fflush(NULL);
        const pid_t pid = fork();
        ASSERT_TRUE(pid >= 0);
        if (pid == 0) {
            setenv("KVC_ISA", "Avx3", 1);
            execl("/proc/self/exe", "test_text", "--filter", "isa_env_unknown", (char *)NULL);
            _exit(127);
        }
        int status = 0;
        ASSERT_TRUE(waitpid(pid, &status, 0) == pid);
        ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        return 0;
    }
    ASSERT_STATUS(kvc_isa_env_check(), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "KVC_ISA='Avx3' is not an ISA: expected scalar, avx2");
    ASSERT_EQ_I64(kvc_get_isa(), KVC_ISA_SCALAR); /* kernels called anyway: the safe path */
    kvc_cache_params cp = kvc_cache_default_params();
    kvc_cache *c = (kvc_cache *)&cp;
    ASSERT_STATUS(kvc_cache_create(&cp, &c), KVC_ERR_INVALID_ARG);
    ASSERT_TRUE(c == NULL);
    ASSERT_STR_CONTAINS(kvc_last_error(), "KVC_ISA='Avx3'");
    kvc_model *m = NULL;
    ASSERT_STATUS(kvc_model_load("/nonexistent.gguf", NULL, &m), KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "KVC_ISA='Avx3'");
    int32_t indptr[2] = {0, 1}, idx[1] = {0}, last[1] = {1};
    int64_t n1 = 1, n2 = 2;
    kvc_tensor ti = kvc_tensor_make(indptr, KVC_I32, 1, &n2),
               tx = kvc_tensor_make(idx, KVC_I32, 1, &n1), tl = kvc_tensor_make(last, KVC_I32, 1, &n1);
    kvc_decode_plan *plan = NULL;
    ASSERT_STATUS(kvc_decode_plan_create(&ti, &tx, &tl, 4, 2, 64, 16, 1, &plan),
                  KVC_ERR_INVALID_ARG);
    ASSERT_STR_CONTAINS(kvc_last_error(), "KVC_ISA='Avx3'");
    return 0;
}

const char *test_suite_name = "text";
const test_case test_suite[] = {
    TEST_ENTRY(utf8_stream_cases),
    TEST_ENTRY(utf8_stream_holds_back),
    TEST_ENTRY(chat_contents_plain_text),
    TEST_ENTRY(chat_contents_templates),
    TEST_ENTRY(isa_env_unknown),
    {0, 0},
};
