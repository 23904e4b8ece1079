/*
 * kvc_chat_tokenize: a chat rendered and tokenized with the message contents
 * as plain text. The renderer does not track where output bytes came from,
 * so a content holding control-token text is located by rendering again
 * with a unique placeholder in its place (keeping its leading and trailing
 * whitespace, so a template's `| trim` acts the same) and putting the
 * content back: if that reproduces the real prompt byte for byte, the
 * placeholder's places are exactly the content's, else the template
 * transformed the content and the call is refused rather than guessed.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "tokenizer_internal.h"

static kvc_status render(const kvc_tokenizer *t, const char *tmpl, const kvc_chat_message *m,
                         int64_t n, int agp, char **out, size_t *len) {
    *out = NULL;
    size_t need = 0;
    kvc_status st = kvc_chat_apply_template(t, tmpl, m, n, agp, NULL, 0, &need);
    if (st != KVC_OK && st != KVC_ERR_NO_SPACE) return st;
    char *b = malloc(need + 1);
    if (!b) return kvc__error(KVC_ERR_NOMEM, "kvc_chat_tokenize: out of memory");
    st = kvc_chat_apply_template(t, tmpl, m, n, agp, b, need, len);
    if (st != KVC_OK) {
        free(b);
        return st;
    }
    b[*len] = 0;
    *out = b;
    return KVC_OK;
}

static const char *find(const char *h, size_t hn, const char *s, size_t sn) {
    for (size_t i = 0; sn <= hn && i <= hn - sn; i++)
        if (memcmp(h + i, s, sn) == 0) return h + i;
    return NULL;
}

static int is_ws(char c) { /* ASCII whitespace, what trim strips of it */
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

typedef struct {
    char mark[8]; /* a private-use character (3 bytes) found in no input */
    size_t mark_n;
    char *r;      /* the real prompt */
    size_t rn;
    kvc_chat_message *m; /* messages with placeholders */
    char **ph;           /* placeholder strings, NULL for untouched messages */
    size_t *spans;       /* 2 per content placed */
    int64_t n_spans;
} locate;

/* Placeholder of message i: its leading whitespace, mark, i, mark, its trailing whitespace. */
static char *placeholder(const locate *L, const char *c, int64_t i) {
    const size_t n = strlen(c);
    size_t a = 0, b = n;
    while (a < n && is_ws(c[a])) a++;
    while (b > a && is_ws(c[b - 1])) b--;
    char *p = malloc(a + (n - b) + 2 * L->mark_n + 24);
    if (!p) return NULL;
    sprintf(p, "%.*s%s%lld%s%s", (int)a, c, L->mark, (long long)i, L->mark, c + b);
    return p;
}

/* Rebuilds the real prompt from the placeholder rendering q; the contents'
 * (trimmed) places go to L->spans. 1 if the rebuild equals L->r. */
static int rebuild(locate *L, const kvc_chat_message *msgs, int64_t n, const char *q, size_t qn) {
    size_t ri = 0, qi = 0;
    L->n_spans = 0;
    while (qi < qn) {
        const char *mk = find(q + qi, qn - qi, L->mark, L->mark_n);
        const size_t lit = mk ? (size_t)(mk - (q + qi)) : qn - qi;
        if (lit > L->rn - ri || memcmp(L->r + ri, q + qi, lit) != 0) return 0;
        ri += lit;
        qi += lit;
        if (!mk) break;
        char *end;
        const long long i = strtoll(mk + L->mark_n, &end, 10);
        const char *close = find(end, qn - (size_t)(end - q), L->mark, L->mark_n);
        if (close != end || i < 0 || i >= n || !L->ph[i]) return 0;
        const char *c = msgs[i].content;
        size_t a = 0, b = strlen(c);
        while (a < b && is_ws(c[a])) a++;
        while (b > a && is_ws(c[b - 1])) b--;
        if (b - a > L->rn - ri || memcmp(L->r + ri, c + a, b - a) != 0) return 0;
        L->spans[2 * L->n_spans] = ri;
        L->spans[2 * L->n_spans + 1] = ri + (b - a);
        L->n_spans++;
        ri += b - a;
        qi = (size_t)(close + L->mark_n - q);
    }
    return ri == L->rn;
}

kvc_status kvc_chat_tokenize(const kvc_tokenizer *t, const char *template_str,
                             const kvc_chat_message *messages, int64_t n_messages,
                             int add_generation_prompt, int add_bos, int parse_special_content,
                             int32_t *tokens, int64_t cap, int64_t *n_tokens) {
    static const char fn[] = "kvc_chat_tokenize";
    KVC_CHECK(t != NULL, "%s: tokenizer is NULL", fn);
    KVC_CHECK(n_tokens != NULL, "%s: n_tokens is NULL", fn);
    KVC_CHECK(messages != NULL || n_messages == 0, "%s: messages is NULL", fn);
    locate L;
    memset(&L, 0, sizeof L);
    KVC_TRY(render(t, template_str, messages, n_messages, add_generation_prompt, &L.r, &L.rn));
    int64_t n_marked = 0;
    if (!parse_special_content)
        for (int64_t i = 0; i < n_messages; i++)
            if (messages[i].content &&
                kvc__has_control_text(t, messages[i].content, strlen(messages[i].content)))
                n_marked++;
    kvc_status st = KVC_OK;
    char *q = NULL;
    if (n_marked > 0) {
        /* a mark no content and no prompt holds: U+E000.. (private use) */
        for (unsigned cp = 0xE000; cp < 0xE100 && !L.mark_n; cp++) {
            const char mk[4] = {(char)0xEE, (char)(0x80 | ((cp >> 6) & 0x3F)),
                                (char)(0x80 | (cp & 0x3F)), 0};
            int used = find(L.r, L.rn, mk, 3) != NULL;
            for (int64_t i = 0; i < n_messages && !used; i++)
                used = messages[i].content && strstr(messages[i].content, mk);
            if (!used) {
                memcpy(L.mark, mk, 4);
                L.mark_n = 3;
            }
        }
        L.m = malloc((size_t)n_messages * sizeof *L.m);
        L.ph = calloc((size_t)n_messages, sizeof *L.ph);
        if (!L.mark_n) st = kvc__error(KVC_ERR_UNSUPPORTED, "%s: no free placeholder", fn);
        else if (!L.m || !L.ph) st = kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
        for (int64_t i = 0; st == KVC_OK && i < n_messages; i++) {
            L.m[i] = messages[i];
            const char *c = messages[i].content;
            if (!c || !kvc__has_control_text(t, c, strlen(c))) continue;
            if (!(L.ph[i] = placeholder(&L, c, i)))
                st = kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
            L.m[i].content = L.ph[i];
        }
        size_t qn = 0;
        if (st == KVC_OK)
            st = render(t, template_str, L.m, n_messages, add_generation_prompt, &q, &qn);
        if (st == KVC_OK) {
            /* each place of a content holds one mark pair: at most qn / 6 of them */
            L.spans = malloc((qn / 6 + 1) * 2 * sizeof *L.spans);
            if (!L.spans) st = kvc__error(KVC_ERR_NOMEM, "%s: out of memory", fn);
            else if (!rebuild(&L, messages, n_messages, q, qn))
                st = kvc__error(KVC_ERR_UNSUPPORTED,
                                "%s: a message content holds special-token text and the "
                                "template changes that content, so its place in the prompt is "
                                "unknown: remove the special-token text, or allow special "
                                "tokens in contents (parse_special_content)", fn);
        }
    }
    if (st == KVC_OK) {
        if (parse_special_content || n_marked == 0)
            st = kvc_tokenize(t, L.r, L.rn, add_bos, 1, tokens, cap, n_tokens);
        else
            st = kvc_tokenize_spans(t, L.r, L.rn, add_bos, L.spans, L.n_spans, tokens, cap,
                                    n_tokens);
    }
    for (int64_t i = 0; L.ph && i < n_messages; i++) free(L.ph[i]);
    free(L.ph);
    free(L.m);
    free(L.spans);
    free(q);
    free(L.r);
    return st;
}
