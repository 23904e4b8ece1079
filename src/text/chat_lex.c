/* Chat templates (see chat.c): the lexer, which splits the normalised source
 * into text and tag tokens with Jinja's whitespace rules. */
#include <stdint.h>
#include <string.h>

#include "chat_internal.h"

/* ---- lexer ----------------------------------------------------------------------- */

static kvc_status add_token(ctx *c, tkind k, const char *p, size_t n, int line) {
    if (c->n_toks == c->cap_toks) {
        size_t cap = c->cap_toks ? 2 * c->cap_toks : 256;
        token *nt = kvc__chat_arena_alloc(&c->ar, cap * sizeof *nt);
        if (!nt) return kvc__chat_alloc_failed(c);
        if (c->n_toks) memcpy(nt, c->toks, c->n_toks * sizeof *nt);
        c->toks = nt;
        c->cap_toks = cap;
    }
    token *t = &c->toks[c->n_toks++];
    memset(t, 0, sizeof *t);
    t->k = k;
    t->s.p = p;
    t->s.n = n;
    t->line = line;
    return KVC_OK;
}

static int count_lines(const char *p, size_t n) {
    int k = 0;
    for (size_t i = 0; i < n; i++) k += p[i] == '\n';
    return k;
}

/* Length of s[0..n) without trailing Python whitespace (str.rstrip()). */
static size_t rstrip_len(const char *s, size_t n) {
    size_t keep = 0;
    for (size_t i = 0; i < n;) {
        int len;
        int sp = space_at(s, n, i, &len);
        i += (size_t)len;
        if (!sp) keep = i;
    }
    return keep;
}

/* Index after the leading Python whitespace of s[i..n) (the `\s*` after `-%}`). */
static size_t skip_space(const char *s, size_t n, size_t i) {
    while (i < n) {
        int len;
        if (!space_at(s, n, i, &len)) break;
        i += (size_t)len;
    }
    return i;
}

static int is_name_start(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_';
}
static int is_name_char(char ch) {
    return is_name_start(ch) || (ch >= '0' && ch <= '9');
}

static int hex_val(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

/* Decodes a string literal body s[0..n) with Python's escapes into the arena. */
static kvc_status decode_string(ctx *c, const char *s, size_t n, str *out) {
    char *o;
    ALLOC(c, o, n + 1);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\' || i + 1 >= n) {
            o[k++] = s[i];
            continue;
        }
        char e = s[++i];
        int digits = 0;
        switch (e) {
        case 'n': o[k++] = '\n'; break;
        case 't': o[k++] = '\t'; break;
        case 'r': o[k++] = '\r'; break;
        case '\\': o[k++] = '\\'; break;
        case '\'': o[k++] = '\''; break;
        case '"': o[k++] = '"'; break;
        case 'a': o[k++] = '\a'; break;
        case 'b': o[k++] = '\b'; break;
        case 'f': o[k++] = '\f'; break;
        case 'v': o[k++] = '\v'; break;
        case '\n': break; /* line continuation */
        case 'x': digits = 2; break;
        case 'u': digits = 4; break;
        case 'U': digits = 8; break;
        case 'N': /* \N{name}: the Unicode name table is not here; never kept as written */
            return kvc__chat_syntax_error(c, NULL, "\\N{...} escapes are not supported");
        default:
            if (e >= '0' && e <= '7') { /* up to three octal digits */
                unsigned v = 0;
                int m = 0;
                while (m < 3 && i < n && s[i] >= '0' && s[i] <= '7')
                    v = v * 8 + (unsigned)(s[i++] - '0'), m++;
                i--;
                k += (size_t)kvc__utf8_encode(v, (unsigned char *)o + k);
            } else { /* unknown escape: kept as written */
                o[k++] = '\\';
                o[k++] = e;
            }
        }
        if (digits) {
            uint32_t v = 0;
            for (int m = 0; m < digits; m++) {
                int h = i + 1 + (size_t)m < n ? hex_val(s[i + 1 + (size_t)m]) : -1;
                if (h < 0) return kvc__chat_syntax_error(c, NULL, "bad \\%c escape", e);
                v = v * 16 + (uint32_t)h;
            }
            if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
                return kvc__chat_syntax_error(c, NULL, "escape U+%X is not a character",
                                              (unsigned)v);
            i += (size_t)digits;
            k += (size_t)kvc__utf8_encode(v, (unsigned char *)o + k);
        }
    }
    out->p = o;
    out->n = k;
    return KVC_OK;
}

static const char *const ops2[] = {"//", "**", "==", "!=", ">=", "<="};

/* Lexes the inside of a {{ }} or {% %} tag starting at *pos; stops after the
 * end marker (and the whitespace it eats), leaving *pos there and
 * *newline_end whether the consumed text ended with '\n'. */
static kvc_status lex_tag(ctx *c, size_t *pos, int is_block, int *line, int *newline_end) {
    const char *s = c->src;
    size_t n = c->src_n, i = *pos;
    int balance = 0;
    for (;;) {
        c->lex_line = *line;
        while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r' ||
                         s[i] == '\f' || s[i] == '\v')) {
            if (s[i] == '\n') (*line)++;
            i++;
        }
        if (i >= n)
            return kvc__chat_syntax_error(c, NULL, "unterminated %s tag", is_block ? "{%" : "{{");
        char ch = s[i];
        if (balance == 0) {
            const char *end = is_block ? "%}" : "}}";
            int ctl = (ch == '-' || (is_block && ch == '+')) && i + 2 < n &&
                      memcmp(s + i + 1, end, 2) == 0;
            if (ctl || (i + 1 < n && memcmp(s + i, end, 2) == 0)) {
                size_t e = i + (ctl ? 3 : 2);
                KVC_TRY(add_token(c, is_block ? T_BEND : T_VEND, s + i, e - i, *line));
                if (ctl && ch == '-') {
                    size_t f = skip_space(s, n, e);
                    *line += count_lines(s + e, f - e);
                    e = f;
                } else if (is_block && !ctl && e < n && s[e] == '\n') { /* trim_blocks */
                    e++;
                    (*line)++;
                }
                *newline_end = e > 0 && s[e - 1] == '\n';
                *pos = e;
                return KVC_OK;
            }
        }
        if (is_name_start(ch)) {
            size_t j = i;
            while (j < n && is_name_char(s[j])) j++;
            KVC_TRY(add_token(c, T_NAME, s + i, j - i, *line));
            i = j;
        } else if (ch >= '0' && ch <= '9') {
            size_t j = i;
            int64_t v = 0;
            while (j < n && ((s[j] >= '0' && s[j] <= '9') || s[j] == '_')) {
                if (s[j] != '_') {
                    if (v > (INT64_MAX - (s[j] - '0')) / 10)
                        return kvc__chat_syntax_error(c, NULL, "integer literal too large");
                    v = v * 10 + (s[j] - '0');
                }
                j++;
            }
            /* a float: digits '.' digits, and / or an exponent (not after a '.':
             * x.0.1 is two subscripts, as in jinja2) */
            size_t k = j;
            int is_float = 0;
            if (!(i > 0 && s[i - 1] == '.')) {
                if (k + 1 < n && s[k] == '.' && s[k + 1] >= '0' && s[k + 1] <= '9') {
                    k++;
                    while (k < n && ((s[k] >= '0' && s[k] <= '9') || s[k] == '_')) k++;
                    is_float = 1;
                }
                if (k < n && (s[k] == 'e' || s[k] == 'E')) {
                    size_t m = k + 1;
                    if (m < n && (s[m] == '+' || s[m] == '-')) m++;
                    if (m < n && s[m] >= '0' && s[m] <= '9') {
                        k = m;
                        while (k < n && ((s[k] >= '0' && s[k] <= '9') || s[k] == '_')) k++;
                        is_float = 1;
                    }
                }
            }
            if (is_float) {
                KVC_TRY(add_token(c, T_FLOAT, s + i, k - i, *line));
                i = k;
                continue;
            }
            if (j < n &&
                (s[j] == '.' || s[j] == 'e' || s[j] == 'E' || s[j] == 'x' || s[j] == 'o' ||
                 s[j] == 'b') &&
                j + 1 < n && s[j + 1] != '.' && !(s[j] == '.' && is_name_start(s[j + 1])))
                return kvc__chat_syntax_error(c, NULL,
                                              "only decimal integer literals are supported");
            if (s[i] == '0' && v != 0) /* as jinja2 (and Python 3): 07 is an error, 00 is 0 */
                return kvc__chat_syntax_error(c, NULL,
                                              "leading zeros in a decimal integer literal");
            KVC_TRY(add_token(c, T_INT, s + i, j - i, *line));
            c->toks[c->n_toks - 1].i = v;
            i = j;
        } else if (ch == '\'' || ch == '"') {
            size_t j = i + 1;
            while (j < n && s[j] != ch) j += s[j] == '\\' ? 2 : 1;
            if (j >= n) return kvc__chat_syntax_error(c, NULL, "unterminated string literal");
            KVC_TRY(add_token(c, T_STRING, s + i, j + 1 - i, *line));
            token *t = &c->toks[c->n_toks - 1];
            KVC_TRY(decode_string(c, s + i + 1, j - i - 1, &t->s));
            *line += count_lines(s + i, j - i);
            i = j + 1;
        } else {
            size_t len = 0;
            for (size_t k = 0; k < sizeof ops2 / sizeof ops2[0]; k++)
                if (i + 1 < n && memcmp(s + i, ops2[k], 2) == 0) len = 2;
            if (!len && strchr("+-/*%~[](){}=.:|,<>!", ch) && ch) len = 1;
            if (!len || (len == 1 && ch == '!'))
                return kvc__chat_syntax_error(c, NULL, "unexpected character '%c' in a tag", ch);
            if (ch == '(' || ch == '[' || ch == '{') balance++;
            if ((ch == ')' || ch == ']' || ch == '}') && len == 1) {
                if (balance == 0) return kvc__chat_syntax_error(c, NULL, "unbalanced '%c'", ch);
                balance--;
            }
            KVC_TRY(add_token(c, T_OP, s + i, len, *line));
            i += len;
        }
    }
}

/* Splits the normalised source into tokens (Jinja's lexer rules for
 * trim_blocks, lstrip_blocks and `-`/`+` whitespace control). */
kvc_status kvc__chat_lex(ctx *c) {
    const char *s = c->src;
    size_t n = c->src_n, pos = 0;
    int line = 1, line_starting = 1;
    while (pos <= n) {
        size_t q = pos;
        c->lex_line = line;
        while (q + 1 < n &&
               !(s[q] == '{' && (s[q + 1] == '{' || s[q + 1] == '%' || s[q + 1] == '#')))
            q++;
        if (q + 1 >= n) { /* no tag left */
            if (n > pos) KVC_TRY(add_token(c, T_TEXT, s + pos, n - pos, line));
            break;
        }
        char kind = s[q + 1];
        char ctl = q + 2 < n && (s[q + 2] == '-' || s[q + 2] == '+') ? s[q + 2] : 0;
        size_t text_n = q - pos;
        if (ctl == '-') {
            text_n = rstrip_len(s + pos, text_n);
        } else if (ctl != '+' && kind != '{') { /* lstrip_blocks */
            size_t l = text_n;
            while (l > 0 && s[pos + l - 1] != '\n') l--;
            if ((l > 0 || line_starting) && l < text_n && skip_space(s + pos, text_n, l) == text_n)
                text_n = l;
        }
        if (text_n) KVC_TRY(add_token(c, T_TEXT, s + pos, text_n, line));
        line += count_lines(s + pos, q - pos);
        size_t body = q + 2 + (ctl ? 1 : 0);
        if (kind == '#') {
            size_t e = body;
            while (e + 1 < n && !(s[e] == '#' && s[e + 1] == '}')) e++;
            if (e + 1 >= n) {
                c->lex_line = line; /* where the comment starts */
                return kvc__chat_syntax_error(c, NULL, "unterminated comment");
            }
            char ectl = e > body && (s[e - 1] == '-' || s[e - 1] == '+') ? s[e - 1] : 0;
            line += count_lines(s + q, e - q);
            e += 2;
            if (ectl == '-') {
                size_t f = skip_space(s, n, e);
                line += count_lines(s + e, f - e);
                e = f;
            } else if (ectl != '+' && e < n && s[e] == '\n') {
                e++;
                line++;
            }
            line_starting = s[e - 1] == '\n';
            pos = e;
            continue;
        }
        int is_block = kind == '%';
        if (is_block && ctl == '+') ctl = 0;
        KVC_TRY(add_token(c, is_block ? T_BBEGIN : T_VBEGIN, s + q, body - q, line));
        pos = body;
        KVC_TRY(lex_tag(c, &pos, is_block, &line, &line_starting));
    }
    return add_token(c, T_EOF, s + n, 0, line);
}
