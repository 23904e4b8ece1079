/*
 * libFuzzer target for the chat-template interpreter (templates come from
 * model files, so they are untrusted input) and the JSON context reader of
 * kvc_chat_apply_template_json. Input layout:
 *   byte 0     bits 0-2 number of messages (0-7), bit 3 add_generation_prompt,
 *              bit 4 a tokenizer (bos/eos texts) instead of none,
 *              bit 5 the last message has a NULL role, bit 6 a NULL content,
 *              bit 7 JSON mode (below)
 *   then       the template text up to the first NUL byte, then the
 *              messages' contents separated by NUL bytes (missing ones "");
 *              in JSON mode, the context JSON up to the next NUL instead
 * Roles cycle system, user, assistant. Checked on every input:
 *   - the status is OK or a documented error (UNSUPPORTED, INVALID_ARG for
 *     run-time errors and the caps) whose message names a template line
 *     (>= 1) or, in JSON mode, a context JSON offset, or NOMEM (the
 *     machine's memory);
 *   - measuring (cap 0) and rendering agree on the length; one byte short is
 *     KVC_ERR_NO_SPACE with nothing written; a failed render writes nothing;
 *   - rendering is deterministic (twice, byte for byte);
 *   - outside JSON mode, when roles and contents are valid UTF-8, the same
 *     messages written as a context JSON (with escapes, \u ones included)
 *     render through kvc_chat_apply_template_json exactly as through the
 *     struct API, or fail with the same status (a cap passed on one side
 *     only is let go: the JSON side holds the strings in the arena);
 *   - with a tokenizer, kvc_chat_tokenize with special contents gives the
 *     rendered prompt's kvc_tokenize (same status, same ids); with plain
 *     contents it succeeds or refuses with a documented status, and its ids
 *     decode to the prompt, with no more control tokens than the former.
 * The fuzz build lowers the interpreter's caps (KVC_CHAT_MAX_* below, set in
 * tests/CMakeLists.txt) so a run stays short under the sanitizers; the
 * library's own caps are the same code with larger numbers.
 * Built with clang -fsanitize=fuzzer,address,undefined when -DKVC_FUZZ=ON;
 * otherwise fuzz_replay.c replays the seed corpus through the same entry.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/tokenizer.h"
#include "fuzz.h"

/* A minimal vocabulary whose BOS/EOS texts the templates can print, with a
 * token for every printable ASCII byte, space and newline (GPT-2 byte
 * forms), so that prompts of those tokenize (kvc_chat_tokenize's checks). */
static kvc_tokenizer *make_tokenizer(void) {
    enum { N = 5 + 94 + 2 };
    static const char *toks[N] = {"a", "b", "<|im_start|>", "<|im_end|>", "<s>"};
    static int32_t types[N] = {KVC_TOKEN_NORMAL, KVC_TOKEN_NORMAL, KVC_TOKEN_CONTROL,
                               KVC_TOKEN_CONTROL, KVC_TOKEN_CONTROL};
    static char ascii[94][2];
    for (int c = '!'; c <= '~'; c++) { /* 'a' and 'b' again: the first id wins */
        ascii[c - '!'][0] = (char)c;
        toks[5 + c - '!'] = ascii[c - '!'];
    }
    toks[N - 2] = "\xC4\xA0"; /* U+0120, GPT-2's form of the space byte */
    toks[N - 1] = "\xC4\x8A"; /* U+010A, newline */
    for (int i = 5; i < N; i++) types[i] = KVC_TOKEN_NORMAL;
    kvc_tokenizer_vocab v = {0};
    v.n_vocab = N;
    v.tokens = toks;
    v.token_types = types;
    v.bos_id = 4;
    v.eos_id = 3;
    v.eot_id = v.unk_id = v.pad_id = -1;
    kvc_tokenizer *t = NULL;
    CHECK(kvc_tokenizer_create(&v, &t) == KVC_OK);
    return t;
}

/* 1 if msg names a template line: "chat template, line N: ..." with N >= 1. */
static int line_named(const char *msg) {
    const char *p = strstr(msg, "chat template, line ");
    if (!p) return 0;
    char *end;
    long line = strtol(p + strlen("chat template, line "), &end, 10);
    return line >= 1 && *end == ':';
}

/* One call: the struct API (json NULL) or the JSON one. */
typedef struct call {
    const kvc_tokenizer *t;
    const char *tmpl;
    const kvc_chat_message *msgs;
    int n_msgs;
    const char *json;
    int gen;
} call;

static kvc_status run(const call *k, char *buf, size_t cap, size_t *len) {
    if (k->json) return kvc_chat_apply_template_json(k->t, k->tmpl, k->json, k->gen, buf, cap, len);
    return kvc_chat_apply_template(k->t, k->tmpl, k->msgs, k->n_msgs, k->gen, buf, cap, len);
}

/* The buffer contract and determinism; the rendered text (malloc'ed, *n
 * bytes; NULL if the call failed or memory ran short), the status, and
 * whether it failed on a cap or the machine's memory. */
static char *check_call(const call *k, kvc_status *status, size_t *n, int *capped) {
    size_t need = 12345;
    kvc_status st = run(k, NULL, 0, &need);
    *status = st;
    *n = 0;
    *capped = 0;
    if (st != KVC_OK && st != KVC_ERR_NO_SPACE) {
        *capped = st == KVC_ERR_NOMEM || strstr(kvc_last_error(), "MiB") != NULL;
        CHECK(st == KVC_ERR_UNSUPPORTED || st == KVC_ERR_INVALID_ARG || st == KVC_ERR_NOMEM);
        CHECK(kvc_last_error()[0] != 0);
        /* only the machine running out of memory may not know the line */
        if (st != KVC_ERR_NOMEM)
            CHECK(line_named(kvc_last_error()) ||
                  (k->json && strncmp(kvc_last_error(), "context JSON", 12) == 0));
        char canary[8];
        memset(canary, 0x5A, sizeof canary);
        size_t n2 = 0;
        CHECK(run(k, canary, sizeof canary, &n2) == st);
        for (size_t i = 0; i < sizeof canary; i++) CHECK(canary[i] == 0x5A);
        return NULL;
    }
    *status = KVC_OK;
    CHECK((st == KVC_OK) == (need == 0));
    char *a = malloc(need + 1), *b = malloc(need + 1);
    if (a && b) {
        size_t n1 = 0, n2 = 0;
        if (need) {
            memset(a, 0x5A, need + 1);
            CHECK(run(k, a, need - 1, &n1) == KVC_ERR_NO_SPACE);
            CHECK(n1 == need);
            for (size_t i = 0; i <= need; i++) CHECK(a[i] == 0x5A);
        }
        CHECK(run(k, a, need, &n1) == KVC_OK);
        CHECK(run(k, b, need, &n2) == KVC_OK);
        CHECK(n1 == need && n2 == need && (need == 0 || memcmp(a, b, need) == 0));
        if (need) CHECK(a[need] == 0x5A); /* nothing past the reported length */
    }
    free(b);
    if (!b) {
        free(a);
        return NULL;
    }
    *n = need;
    return a;
}

/* Length of the UTF-8 character at s (RFC 3629), 0 if ill-formed; *cp its code point. */
static int utf8_char(const unsigned char *s, uint32_t *cp) {
    unsigned c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    int n = c >= 0xC2 && c <= 0xDF   ? 2
            : c >= 0xE0 && c <= 0xEF ? 3
            : c >= 0xF0 && c <= 0xF4 ? 4
                                     : 0;
    if (!n) return 0;
    uint32_t v = c & (0x7F >> n);
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0; /* also stops at the NUL */
        v = (v << 6) | (s[i] & 0x3F);
    }
    static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min[n] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
    *cp = v;
    return n;
}

/* Appends s as a JSON string literal to out (room checked by the caller:
 * 12 bytes per input byte is enough); non-ASCII as \u escapes when
 * escape_all, else raw. 0 if s is not valid UTF-8. */
static int put_json_str(char **out, const char *s, int escape_all) {
    char *o = *out;
    if (!s) {
        memcpy(o, "null", 4);
        *out = o + 4;
        return 1;
    }
    *o++ = '"';
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        uint32_t cp;
        int n = utf8_char(p, &cp);
        if (!n) return 0;
        if (cp == '"' || cp == '\\') {
            *o++ = '\\';
            *o++ = (char)cp;
        } else if (cp == '/' && escape_all) {
            o += sprintf(o, "\\/");
        } else if (cp < 0x20 || (escape_all && cp >= 0x80 && cp < 0x10000)) {
            o += sprintf(o, "\\u%04X", (unsigned)cp);
        } else if (escape_all && cp >= 0x10000) {
            o += sprintf(o, "\\u%04x\\u%04x", (unsigned)(0xD800 + ((cp - 0x10000) >> 10)),
                         (unsigned)(0xDC00 + ((cp - 0x10000) & 0x3FF)));
        } else {
            memcpy(o, p, (size_t)n);
            o += n;
        }
        p += n;
    }
    *o++ = '"';
    *out = o;
    return 1;
}

/* The messages as a context JSON (malloc'ed), or NULL if a string is not UTF-8. */
static char *messages_json(const kvc_chat_message *m, int n, size_t in_bytes, int escape_all) {
    char *j = malloc(64 + 64 * (size_t)n + 12 * in_bytes), *o = j;
    if (!j) return NULL;
    o += sprintf(o, " {\"messages\" : [");
    for (int i = 0; i < n; i++) {
        o += sprintf(o, "%s{\"role\":", i ? ", " : "");
        if (!put_json_str(&o, m[i].role, escape_all)) goto bad;
        o += sprintf(o, ",\n\"content\": ");
        if (!put_json_str(&o, m[i].content, escape_all)) goto bad;
        *o++ = '}';
    }
    strcpy(o, "]}\r\n");
    return j;
bad:
    free(j);
    return NULL;
}

static int64_t count_control(const kvc_tokenizer *t, const int32_t *ids, int64_t n) {
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += kvc_tokenizer_token_type(t, ids[i]) == KVC_TOKEN_CONTROL;
    return c;
}

/* The checks of kvc_chat_tokenize on a chat that rendered to prompt[0..n). */
static void check_chat_tokenize(const call *k, const char *prompt, size_t n) {
    int64_t nw = -1, ns = -1, np = -1;
    const kvc_status sw = kvc_tokenize(k->t, prompt, n, 0, 1, NULL, 0, &nw);
    const kvc_status ss = kvc_chat_tokenize(k->t, k->tmpl, k->msgs, k->n_msgs, k->gen, 0, 1, NULL,
                                            0, &ns);
    const int cap_hit = ss == KVC_ERR_NOMEM || strstr(kvc_last_error(), "MiB") != NULL;
    if (!cap_hit) CHECK(ss == sw);
    const kvc_status sp = kvc_chat_tokenize(k->t, k->tmpl, k->msgs, k->n_msgs, k->gen, 0, 0, NULL,
                                            0, &np);
    if (sp != KVC_OK && sp != KVC_ERR_NO_SPACE) {
        CHECK(sp == KVC_ERR_UNSUPPORTED || sp == KVC_ERR_INVALID_ARG || sp == KVC_ERR_NOMEM);
        CHECK(kvc_last_error()[0] != 0);
    }
    if (sw != KVC_OK && sw != KVC_ERR_NO_SPACE) return;
    int32_t *a = malloc((size_t)(nw + 1) * sizeof *a);
    int32_t *b = malloc((size_t)(ns > 0 ? ns : 1) * sizeof *b);
    char *txt = malloc(n + 1);
    if (a && b && txt && (ss == KVC_OK || ss == KVC_ERR_NO_SPACE)) {
        int64_t n1 = 0, n2 = 0;
        CHECK(kvc_tokenize(k->t, prompt, n, 0, 1, a, nw, &n1) == KVC_OK && n1 == nw);
        CHECK(kvc_chat_tokenize(k->t, k->tmpl, k->msgs, k->n_msgs, k->gen, 0, 1, b, ns, &n2) ==
                  KVC_OK &&
              n2 == nw && (nw == 0 || memcmp(a, b, (size_t)nw * sizeof *a) == 0));
        if ((sp == KVC_OK || sp == KVC_ERR_NO_SPACE) && np >= 0) {
            int32_t *c = malloc((size_t)(np > 0 ? np : 1) * sizeof *c);
            size_t len = 0;
            if (c && kvc_chat_tokenize(k->t, k->tmpl, k->msgs, k->n_msgs, k->gen, 0, 0, c, np,
                                       &n2) == KVC_OK) {
                CHECK(n2 == np);
                CHECK(kvc_detokenize(k->t, c, np, txt, n, &len) == KVC_OK && len == n &&
                      memcmp(txt, prompt, n) == 0);
                CHECK(count_control(k->t, c, np) <= count_control(k->t, a, nw));
            }
            free(c);
        }
    }
    free(a);
    free(b);
    free(txt);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static kvc_tokenizer *tok;
    if (!tok) tok = make_tokenizer();
    if (size < 1) return 0;
    uint8_t mode = data[0];
    /* one NUL-terminated copy: template, then contents, each ending in NUL */
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data + 1, size - 1);
    text[size - 1] = 0;
    const char *end = text + size - 1;
    const char *tmpl = text;
    const char *p = tmpl + strlen(tmpl) + (tmpl + strlen(tmpl) < end);
    static const char *const roles[] = {"system", "user", "assistant"};
    kvc_chat_message msgs[7];
    int n_msgs = mode & 7;
    for (int i = 0; i < n_msgs; i++) {
        msgs[i].role = roles[i % 3];
        msgs[i].content = p < end ? p : "";
        if (p < end) p += strlen(p) + 1;
    }
    if (n_msgs > 0 && (mode & 32)) msgs[n_msgs - 1].role = NULL;
    if (n_msgs > 0 && (mode & 64)) msgs[n_msgs - 1].content = NULL;
    int gen = (mode >> 3) & 1;
    const kvc_tokenizer *t = (mode & 16) ? tok : NULL;

    call k = {t, tmpl, msgs, n_msgs, NULL, gen};
    if (mode & 128) { /* the bytes after the template are the context JSON */
        k.json = tmpl + strlen(tmpl) + (tmpl + strlen(tmpl) < end);
        kvc_status st;
        size_t n;
        int capped;
        free(check_call(&k, &st, &n, &capped));
        free(text);
        return 0;
    }
    kvc_status st1, st2;
    size_t n1, n2;
    int capped1, capped2;
    char *out1 = check_call(&k, &st1, &n1, &capped1);
    if (out1 && t) check_chat_tokenize(&k, out1, n1);
    /* the same messages as a context JSON render the same */
    k.json = messages_json(msgs, n_msgs, size, (int)(size & 1));
    if (k.json) {
        char *out2 = check_call(&k, &st2, &n2, &capped2);
        if (!capped1 && !capped2) {
            CHECK(st1 == st2);
            if (out1 && out2) CHECK(n1 == n2 && memcmp(out1, out2, n1) == 0);
        }
        free(out2);
        free((char *)k.json);
    }
    free(out1);
    free(text);
    return 0;
}
