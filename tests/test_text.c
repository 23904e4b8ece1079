/*
 * Text in, text out: streaming UTF-8 repair of detokenized bytes
 * (kvc_utf8_stream) and chat prompts whose message contents are plain text
 * (kvc_chat_tokenize). Expected UTF-8 outputs follow the Unicode standard's
 * "maximal subpart" replacement (Table 3-8 practice), which is what
 * Python's bytes.decode("utf-8", "replace") gives; python/tests/
 * test_tokenizer.py also compares random streams with Python's decoder.
 */
#include <stdlib.h>

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
    return 0;
}

const char *test_suite_name = "text";
const test_case test_suite[] = {
    TEST_ENTRY(utf8_stream_cases),
    TEST_ENTRY(utf8_stream_holds_back),
    {0, 0},
};
