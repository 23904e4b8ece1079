/*
 * Streaming UTF-8 repair for detokenized output (kvc_utf8_stream_*): tokens
 * may end inside a character, and byte tokens can form ill-formed sequences.
 * Ill-formed input is replaced as Python's bytes.decode("utf-8", "replace")
 * and the Unicode "maximal subpart" practice do: one U+FFFD per maximal
 * prefix of a valid sequence (or per lone bad byte), so a stream fed in any
 * split gives exactly the text the whole byte string decodes to.
 */
#include <string.h>

#include "../core/internal.h"
#include "kvcache/tokenizer.h"

static const unsigned char fffd[3] = {0xEF, 0xBF, 0xBD};

/* Sequence length for a lead byte, 0 if it cannot start one. */
static int seq_len(unsigned char b) {
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0; /* continuation bytes, C0/C1 (overlong), F5..FF */
}

/* Whether b may follow the bytes held so far (lead at p[0], k bytes held). */
static int continues(const unsigned char *p, int k, unsigned char b) {
    if (k == 1) { /* the second byte excludes overlongs, surrogates, > U+10FFFF */
        switch (p[0]) {
        case 0xE0: return b >= 0xA0 && b <= 0xBF;
        case 0xED: return b >= 0x80 && b <= 0x9F;
        case 0xF0: return b >= 0x90 && b <= 0xBF;
        case 0xF4: return b >= 0x80 && b <= 0x8F;
        default: break;
        }
    }
    return b >= 0x80 && b <= 0xBF;
}

void kvc_utf8_stream_init(kvc_utf8_stream *s) {
    if (s) memset(s, 0, sizeof *s);
}

size_t kvc_utf8_stream_bound(size_t n) { return 3 * (n + 4); }

static kvc_status check_args(const char *fn, const kvc_utf8_stream *s, const char *in, size_t n,
                             const char *out, size_t cap, const size_t *out_len) {
    KVC_CHECK(s != NULL && out_len != NULL, "%s: stream and out_len must not be NULL", fn);
    KVC_CHECK(s->n_held <= 3, "%s: stream not initialised (kvc_utf8_stream_init)", fn);
    KVC_CHECK(in != NULL || n == 0, "%s: in is NULL with n %zu", fn, n);
    KVC_CHECK(out != NULL || cap == 0, "%s: out is NULL with cap %zu", fn, cap);
    return KVC_OK;
}

/* Runs the decoder over held + in, writing to out (NULL: count only) at most
 * limit bytes. Returns the output length; held and n_held receive the
 * incomplete tail. The limit matters only when out overlaps in (core.h:
 * undefined): the writing pass then reads other bytes than the counting one
 * and must still stop at the length that pass found. */
static size_t run(const unsigned char *held0, int n_held0, const unsigned char *in, size_t n,
                  int final, unsigned char *out, size_t limit, unsigned char held[4],
                  int *n_held) {
    unsigned char p[4];
    int k = n_held0;
    memcpy(p, held0, (size_t)k);
    size_t o = 0;
#define PUT(src, len)                                                                              \
    do {                                                                                           \
        if (out && o <= limit && (len) <= limit - o) memcpy(out + o, (src), (len));               \
        o += (len);                                                                                \
    } while (0)
    for (size_t i = 0; i < n;) {
        const unsigned char b = in[i];
        if (k == 0) {
            const int l = seq_len(b);
            i++;
            if (l == 1) PUT(&b, 1);
            else if (l == 0) PUT(fffd, 3);
            else p[k++] = b;
            continue;
        }
        if (!continues(p, k, b)) { /* the maximal subpart held so far is one U+FFFD; b restarts */
            PUT(fffd, 3);
            k = 0;
            continue;
        }
        p[k++] = b;
        i++;
        if (k == seq_len(p[0])) {
            PUT(p, (size_t)k);
            k = 0;
        }
    }
    if (final && k > 0) { /* an incomplete tail at the end of the text */
        PUT(fffd, 3);
        k = 0;
    }
#undef PUT
    memcpy(held, p, (size_t)k);
    *n_held = k;
    return o;
}

static kvc_status step(const char *fn, kvc_utf8_stream *s, const char *in, size_t n, int final,
                       char *out, size_t cap, size_t *out_len) {
    KVC_TRY(check_args(fn, s, in, n, out, cap, out_len));
    unsigned char held[4];
    int nh;
    const unsigned char *u = (const unsigned char *)in;
    const size_t need = run(s->held, s->n_held, u, n, final, NULL, 0, held, &nh);
    *out_len = need;
    if (need > cap)
        return kvc__error(KVC_ERR_NO_SPACE, "%s: %zu bytes of output, cap is %zu", fn, need, cap);
    run(s->held, s->n_held, u, n, final, (unsigned char *)out, need, held, &nh);
    memcpy(s->held, held, (size_t)nh);
    s->n_held = (unsigned char)nh;
    return KVC_OK;
}

kvc_status kvc_utf8_stream_feed(kvc_utf8_stream *s, const char *in, size_t n, char *out,
                                size_t cap, size_t *out_len) {
    return step("kvc_utf8_stream_feed", s, in, n, 0, out, cap, out_len);
}

kvc_status kvc_utf8_stream_flush(kvc_utf8_stream *s, char *out, size_t cap, size_t *out_len) {
    return step("kvc_utf8_stream_flush", s, NULL, 0, 1, out, cap, out_len);
}
