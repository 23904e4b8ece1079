/*
 * Chat templates: a small interpreter for the subset of Jinja that model
 * chat templates use, rendering exactly what Python's jinja2 renders in the
 * environment Hugging Face transformers builds for apply_chat_template
 * (ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with
 * the loopcontrols extension; keep_trailing_newline False).
 *
 * Pipeline: the template source is normalised (every \r\n or \r becomes \n,
 * one trailing newline is dropped), lexed into text and tag tokens with
 * Jinja's whitespace rules, parsed by recursive descent into an AST, and
 * evaluated against the variables messages, add_generation_prompt,
 * bos_token, eos_token, tools and documents (both None, as transformers
 * passes them) and the functions raise_exception, namespace and range.
 *
 * Supported: {{ }}, {% %}, {# #} with `-`/`+` whitespace control; if / elif
 * / else, for (with else, an `if` filter, tuple targets, loop.index,
 * index0, revindex, revindex0, first, last, length, previtem, nextitem),
 * set (also `set ns.attr = ...` and block set), break, continue,
 * generation; literals (strings with Python escapes, integers, true /
 * false / none, lists, dicts); names, attributes, subscripts and slices;
 * + - * // % ~, comparisons (chained), in / not in, and / or / not,
 * `x if c else y`; tests defined, undefined, none, string, number,
 * integer, boolean, true, false, mapping, sequence, iterable, even, odd;
 * filters trim, length / count, upper, lower, capitalize, title, first,
 * last, join, default / d, string, int, list, reverse, replace, safe;
 * string methods strip, lstrip, rstrip, startswith, endswith, upper,
 * lower, split, replace, title, capitalize; dict methods get, items, keys,
 * values. Anything else (macros, floats, `/`, tuples, tojson, ...) is
 * KVC_ERR_UNSUPPORTED with a message naming it. Case mapping is ASCII-only.
 *
 * Memory: everything (tokens, AST, values, strings) lives in one arena freed
 * at the end of the call; output and arena are capped so no template can
 * exhaust memory, and parser nesting is capped so none can exhaust the stack.
 * Time (templates come from model files): loop iterations are capped, and
 * so are the bytes string operations go through (MAX_WORK); substring
 * search and strip(chars) are linear-ish, not n * m.
 */
#define _GNU_SOURCE /* memmem */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "kvcache/tokenizer.h"
#include "tokenizer_internal.h"
#include "unicode.h"

#define MAX_DEPTH 200                         /* parser / evaluator nesting */
#define MAX_EVAL_DEPTH 1000                   /* expression tree depth when evaluated */
#define MAX_BYTES ((size_t)256 << 20)         /* arena and output, each */
#define MAX_STEPS ((int64_t)50 * 1000 * 1000) /* loop iterations, all loops */
#define MAX_WORK ((int64_t)4 << 30) /* bytes searched, stripped, split, copied: a few s */

/* ---- arena ------------------------------------------------------------------ */

typedef struct chunk {
    struct chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
} chunk;

typedef struct arena {
    chunk *head;
    size_t total;
} arena;

static void *kvc__chat_arena_alloc(arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->total + cap > MAX_BYTES) return NULL;
        chunk *c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
        a->total += cap;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

static void kvc__chat_arena_free(arena *a) {
    while (a->head) {
        chunk *c = a->head;
        a->head = c->next;
        free(c);
    }
}

/* ---- values ----------------------------------------------------------------- */

typedef enum vtype { V_UNDEF, V_NONE, V_BOOL, V_INT, V_STR, V_LIST, V_DICT, V_FUNC } vtype;

typedef enum builtin { F_RAISE, F_NAMESPACE, F_RANGE } builtin;

typedef struct str {
    const char *p;
    size_t n;
} str;

typedef struct list list;
typedef struct dict dict;

typedef struct value {
    vtype t;
    union {
        int64_t i; /* V_BOOL, V_INT, V_FUNC (builtin) */
        str s;
        list *l;
        dict *d;
    } u;
} value;

struct list {
    value *items;
    size_t n, cap;
    int is_tuple; /* an items() pair: prints as (k, v), like Python's tuple */
};

struct dict {
    str *keys;
    value *vals;
    size_t n, cap;
    int is_namespace;
};

static value v_undef(void) {
    value v = {V_UNDEF, {0}};
    return v;
}
static value v_none(void) {
    value v = {V_NONE, {0}};
    return v;
}
static value v_bool(int b) {
    value v = {V_BOOL, {0}};
    v.u.i = b != 0;
    return v;
}
static value v_int(int64_t i) {
    value v = {V_INT, {0}};
    v.u.i = i;
    return v;
}
static value v_str(const char *p, size_t n) {
    value v = {V_STR, {0}};
    v.u.s.p = p;
    v.u.s.n = n;
    return v;
}
static value v_cstr(const char *p) {
    return v_str(p, strlen(p));
}

static int str_eq(str a, const char *b) {
    size_t n = strlen(b);
    return a.n == n && memcmp(a.p, b, n) == 0;
}

/* ---- tokens ----------------------------------------------------------------- */

typedef enum tkind {
    T_TEXT,   /* template data */
    T_VBEGIN, /* {{ */
    T_VEND,   /* }} */
    T_BBEGIN, /* {% */
    T_BEND,   /* %} */
    T_NAME,
    T_STRING, /* decoded value in s */
    T_INT,
    T_OP, /* s: the operator */
    T_EOF
} tkind;

typedef struct token {
    tkind k;
    str s;
    int64_t i;
    int line;
} token;

/* ---- interpreter state ---------------------------------------------------------- */

typedef struct node node;

typedef struct frame { /* one scope: the template's top level or one loop iteration */
    str *names;
    value *vals;
    size_t n, cap;
} frame;

typedef struct ctx {
    arena ar;
    /* lexer */
    char *src; /* normalised source */
    size_t src_n;
    token *toks;
    size_t n_toks, cap_toks;
    size_t pos;   /* parser position */
    int lex_line; /* line the lexer is on (for its error messages) */
    int depth;
    /* evaluation */
    frame frames[MAX_DEPTH + 2];
    int n_frames;
    int eval_depth; /* eval recursion: chains (a.b.c, x + y + z, |f|g) nest too */
    char *out;
    size_t out_n, out_cap;
    int64_t steps;
    int64_t work;     /* bytes string operations went through (MAX_WORK) */
    const node *cur;  /* the node being evaluated or executed (error lines) */
    int loop_ctl; /* 1 break, 2 continue, pending */
    /* globals */
    value messages, add_generation_prompt, bos_token, eos_token;
} ctx;

/* ---- errors ------------------------------------------------------------------ */

static kvc_status kvc__chat_syntax_error(ctx *c, const token *t, const char *fmt, ...)
    KVC_PRINTF(3, 4);
static kvc_status kvc__chat_syntax_error(ctx *c, const token *t, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvc__error(KVC_ERR_UNSUPPORTED, "chat template, line %d: %s", t ? t->line : c->lex_line,
                      msg);
}

static kvc_status kvc__chat_nomem(void) {
    return kvc__error(KVC_ERR_NOMEM, "chat template: out of memory (or over the %zu MiB limit)",
                      MAX_BYTES >> 20);
}

/* Counts bytes a string operation goes through: a loop of 50 million steps
 * over 100 MB strings would otherwise run for weeks within every cap. */
static kvc_status kvc__chat_runtime_error(const node *n, const char *fmt, ...) KVC_PRINTF(2, 3);

static kvc_status charge(ctx *c, size_t bytes) {
    c->work += (int64_t)(bytes < (size_t)MAX_WORK ? bytes : (size_t)MAX_WORK);
    if (c->work > MAX_WORK)
        return kvc__chat_runtime_error(c->cur,
                                       "string operations over %lld GiB in all (a template this "
                                       "expensive is refused)",
                                       (long long)(MAX_WORK >> 30));
    return KVC_OK;
}

#define ALLOC(c, ptr, count)                                                                       \
    do {                                                                                           \
        (ptr) = kvc__chat_arena_alloc(&(c)->ar, sizeof *(ptr) * (size_t)(count));                  \
        if (!(ptr)) return kvc__chat_nomem();                                                      \
    } while (0)

/* ---- lexer ----------------------------------------------------------------------- */

static kvc_status add_token(ctx *c, tkind k, const char *p, size_t n, int line) {
    if (c->n_toks == c->cap_toks) {
        size_t cap = c->cap_toks ? 2 * c->cap_toks : 256;
        token *nt = kvc__chat_arena_alloc(&c->ar, cap * sizeof *nt);
        if (!nt) return kvc__chat_nomem();
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

/* Python str.isspace() on the code point at s[i]; *len receives its length. */
static int space_at(const char *s, size_t n, size_t i, int *len) {
    uint32_t cp = kvc__utf8_decode((const unsigned char *)s + i, n - i, len);
    return kvc__py_isspace(cp);
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
            int ctl = (ch == '-' || (is_block && ch == '+')) && i + 2 < n + 0 &&
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
static kvc_status kvc__chat_lex(ctx *c) {
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
            if (e + 1 >= n)
                return kvc__chat_syntax_error(c, NULL, "unterminated comment (line %d)", line);
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

/* ---- AST ---------------------------------------------------------------------- */

typedef enum nkind {
    /* statements */
    S_BLOCK,    /* v: statements */
    S_TEXT,     /* name: the text */
    S_OUT,      /* a: expression */
    S_IF,       /* a: condition, b: then block, c: else block (or NULL) */
    S_FOR,      /* names: targets, a: iterable, b: body, c: else, d: filter */
    S_SET,      /* name: variable, a: value */
    S_SETATTR,  /* name: namespace variable, attr: attribute, a: value */
    S_SETBLOCK, /* name: variable, b: body */
    S_BREAK,
    S_CONTINUE,
    /* expressions */
    E_LIT,    /* lit */
    E_NAME,   /* name */
    E_ATTR,   /* a.name */
    E_INDEX,  /* a[b] */
    E_SLICE,  /* a[b:c:d], each of b c d may be NULL */
    E_CALL,   /* a(v..., names[i]=w[i]...) */
    E_FILTER, /* a | name(v..., names=w...) */
    E_TEST,   /* a is [not] name(v...) */
    E_NEG,
    E_POS, /* unary +: numbers only, as in Python */
    E_NOT,
    E_AND,
    E_OR,
    E_BIN,  /* a op b, op in name */
    E_CMP,  /* a (names[i] v[i])... chained */
    E_COND, /* b if a else c */
    E_LIST, /* v */
    E_DICT  /* v: keys, w: values */
} nkind;

struct node {
    nkind k;
    int line;
    int neg;  /* E_TEST: `is not` */
    str name; /* names, operators, texts */
    str attr;
    value lit;
    node *a, *b, *c, *d;
    node **v, **w;
    size_t nv, nw;
    str *names;
    size_t nnames;
};

static kvc_status new_node(ctx *c, nkind k, node **out) {
    node *n;
    ALLOC(c, n, 1);
    memset(n, 0, sizeof *n);
    n->k = k;
    n->line = c->toks[c->pos < c->n_toks ? c->pos : c->n_toks - 1].line;
    *out = n;
    return KVC_OK;
}

/* Appends x to an arena vector (doubling; the old storage is abandoned). */
static kvc_status push_node(ctx *c, node ***v, size_t *n, node *x) {
    if ((*n & (*n - 1)) == 0) { /* n is 0 or a power of two: grow */
        node **nv;
        ALLOC(c, nv, *n ? 2 * *n : 4);
        if (*n) memcpy(nv, *v, *n * sizeof *nv);
        *v = nv;
    }
    (*v)[(*n)++] = x;
    return KVC_OK;
}

static kvc_status push_str(ctx *c, str **v, size_t *n, str x) {
    if ((*n & (*n - 1)) == 0) {
        str *nv;
        ALLOC(c, nv, *n ? 2 * *n : 4);
        if (*n) memcpy(nv, *v, *n * sizeof *nv);
        *v = nv;
    }
    (*v)[(*n)++] = x;
    return KVC_OK;
}

/* ---- parser: token helpers ---------------------------------------------------- */

static token *peek(ctx *c) {
    return &c->toks[c->pos];
}
static token *peek_at(ctx *c, size_t k) {
    return &c->toks[c->pos + k < c->n_toks ? c->pos + k : c->n_toks - 1];
}
static int is_op(const token *t, const char *op) {
    return t->k == T_OP && str_eq(t->s, op);
}
static int is_name(const token *t, const char *name) {
    return t->k == T_NAME && str_eq(t->s, name);
}
static const char *tok_desc(const token *t, char *buf, size_t n) {
    switch (t->k) {
    case T_EOF: return "end of template";
    case T_VEND: return "'}}'";
    case T_BEND: return "'%}'";
    case T_TEXT: return "template text";
    default: snprintf(buf, n, "'%.*s'", (int)(t->s.n < 40 ? t->s.n : 40), t->s.p); return buf;
    }
}
static kvc_status unexpected(ctx *c, const char *want) {
    char buf[64];
    return kvc__chat_syntax_error(c, peek(c), "expected %s, got %s", want,
                                  tok_desc(peek(c), buf, sizeof buf));
}
static kvc_status expect_op(ctx *c, const char *op) {
    if (!is_op(peek(c), op)) {
        char want[16];
        snprintf(want, sizeof want, "'%s'", op);
        return unexpected(c, want);
    }
    c->pos++;
    return KVC_OK;
}
static kvc_status expect_name(ctx *c, str *out) {
    if (peek(c)->k != T_NAME) return unexpected(c, "a name");
    *out = peek(c)->s;
    c->pos++;
    return KVC_OK;
}
static kvc_status expect_kind(ctx *c, tkind k, const char *want) {
    if (peek(c)->k != k) return unexpected(c, want);
    c->pos++;
    return KVC_OK;
}

/* ---- parser: expressions (Jinja's precedence, lowest first) ------------------- */

static kvc_status parse_expr(ctx *c, node **out);
static kvc_status parse_or(ctx *c, node **out);
static kvc_status parse_unary(ctx *c, int with_filter, node **out);

/* Positional and keyword arguments after '(' up to ')'. */
static kvc_status parse_args(ctx *c, node *n) {
    KVC_TRY(expect_op(c, "("));
    while (!is_op(peek(c), ")")) {
        if (n->nv + n->nw) KVC_TRY(expect_op(c, ","));
        if (is_op(peek(c), ")")) break; /* trailing comma */
        node *x;
        if (peek(c)->k == T_NAME && is_op(peek_at(c, 1), "=")) {
            str key = peek(c)->s;
            c->pos += 2;
            KVC_TRY(parse_expr(c, &x));
            KVC_TRY(push_str(c, &n->names, &n->nnames, key));
            KVC_TRY(push_node(c, &n->w, &n->nw, x));
        } else {
            if (n->nw)
                return kvc__chat_syntax_error(c, peek(c),
                                              "positional argument after keyword argument");
            KVC_TRY(parse_expr(c, &x));
            KVC_TRY(push_node(c, &n->v, &n->nv, x));
        }
    }
    c->pos++;
    return KVC_OK;
}

static kvc_status parse_primary(ctx *c, node **out) {
    token *t = peek(c);
    node *n;
    if (t->k == T_STRING) {
        KVC_TRY(new_node(c, E_LIT, &n));
        n->lit = v_str(t->s.p, t->s.n);
        c->pos++;
        while (peek(c)->k == T_STRING) { /* adjacent literals concatenate */
            token *u = peek(c);
            char *p;
            ALLOC(c, p, n->lit.u.s.n + u->s.n + 1);
            memcpy(p, n->lit.u.s.p, n->lit.u.s.n);
            memcpy(p + n->lit.u.s.n, u->s.p, u->s.n);
            n->lit = v_str(p, n->lit.u.s.n + u->s.n);
            c->pos++;
        }
    } else if (t->k == T_INT) {
        KVC_TRY(new_node(c, E_LIT, &n));
        n->lit = v_int(t->i);
        c->pos++;
    } else if (t->k == T_NAME) {
        KVC_TRY(new_node(c, E_LIT, &n));
        if (str_eq(t->s, "true") || str_eq(t->s, "True"))
            n->lit = v_bool(1);
        else if (str_eq(t->s, "false") || str_eq(t->s, "False"))
            n->lit = v_bool(0);
        else if (str_eq(t->s, "none") || str_eq(t->s, "None"))
            n->lit = v_none();
        else {
            n->k = E_NAME;
            n->name = t->s;
        }
        c->pos++;
    } else if (is_op(t, "(")) {
        c->pos++;
        KVC_TRY(parse_expr(c, &n));
        if (is_op(peek(c), ","))
            return kvc__chat_syntax_error(c, peek(c), "tuples are not supported");
        KVC_TRY(expect_op(c, ")"));
    } else if (is_op(t, "[")) {
        c->pos++;
        KVC_TRY(new_node(c, E_LIST, &n));
        while (!is_op(peek(c), "]")) {
            if (n->nv) KVC_TRY(expect_op(c, ","));
            if (is_op(peek(c), "]")) break;
            node *x;
            KVC_TRY(parse_expr(c, &x));
            KVC_TRY(push_node(c, &n->v, &n->nv, x));
        }
        c->pos++;
    } else if (is_op(t, "{")) {
        c->pos++;
        KVC_TRY(new_node(c, E_DICT, &n));
        while (!is_op(peek(c), "}")) {
            if (n->nv) KVC_TRY(expect_op(c, ","));
            if (is_op(peek(c), "}")) break;
            node *k, *x;
            KVC_TRY(parse_expr(c, &k));
            KVC_TRY(expect_op(c, ":"));
            KVC_TRY(parse_expr(c, &x));
            KVC_TRY(push_node(c, &n->v, &n->nv, k));
            KVC_TRY(push_node(c, &n->w, &n->nw, x));
        }
        c->pos++;
    } else {
        return unexpected(c, "an expression");
    }
    *out = n;
    return KVC_OK;
}

/* `.name`, `[index]`, `[a:b:c]` and calls after a primary. */
static kvc_status parse_postfix(ctx *c, node **io) {
    for (;;) {
        node *n;
        if (is_op(peek(c), ".")) {
            c->pos++;
            KVC_TRY(new_node(c, E_ATTR, &n));
            n->a = *io;
            if (peek(c)->k == T_INT) { /* foo.0 is foo[0] */
                n->k = E_INDEX;
                KVC_TRY(new_node(c, E_LIT, &n->b));
                n->b->lit = v_int(peek(c)->i);
                c->pos++;
            } else {
                KVC_TRY(expect_name(c, &n->name));
            }
        } else if (is_op(peek(c), "[")) {
            c->pos++;
            KVC_TRY(new_node(c, E_INDEX, &n));
            n->a = *io;
            node *parts[3] = {NULL, NULL, NULL};
            int np = 0;
            for (;;) {
                if (!is_op(peek(c), ":") && !is_op(peek(c), "]"))
                    KVC_TRY(parse_expr(c, &parts[np]));
                if (is_op(peek(c), ":") && np < 2) {
                    c->pos++;
                    np++;
                    continue;
                }
                break;
            }
            KVC_TRY(expect_op(c, "]"));
            if (np == 0) {
                if (!parts[0]) return kvc__chat_syntax_error(c, peek(c), "empty subscript");
                n->b = parts[0];
            } else {
                n->k = E_SLICE;
                n->b = parts[0];
                n->c = parts[1];
                n->d = parts[2];
            }
        } else if (is_op(peek(c), "(")) {
            KVC_TRY(new_node(c, E_CALL, &n));
            n->a = *io;
            KVC_TRY(parse_args(c, n));
        } else {
            return KVC_OK;
        }
        *io = n;
    }
}

static const char *const filter_names[] = {
    "trim", "length",  "count", "upper",  "lower", "capitalize", "title",   "first",   "last",
    "join", "default", "d",     "string", "int",   "list",       "reverse", "replace", "safe",
};
static const char *const test_names[] = {
    "defined", "undefined", "none",    "string",   "number",   "integer", "boolean",
    "true",    "false",     "mapping", "sequence", "iterable", "even",    "odd",
};

static int in_list(str s, const char *const *names, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (str_eq(s, names[i])) return 1;
    return 0;
}

/* Filters `| name(args)` and tests `is [not] name(args)` after a unary. */
static kvc_status parse_filter_expr(ctx *c, node **io) {
    for (;;) {
        node *n;
        if (is_op(peek(c), "|")) {
            c->pos++;
            KVC_TRY(new_node(c, E_FILTER, &n));
            KVC_TRY(expect_name(c, &n->name));
            if (!in_list(n->name, filter_names, sizeof filter_names / sizeof filter_names[0]))
                return kvc__chat_syntax_error(c, peek(c), "filter '%.*s' is not supported",
                                              (int)n->name.n, n->name.p);
            if (is_op(peek(c), "(")) KVC_TRY(parse_args(c, n));
        } else if (is_name(peek(c), "is")) {
            c->pos++;
            KVC_TRY(new_node(c, E_TEST, &n));
            if (is_name(peek(c), "not")) {
                n->neg = 1;
                c->pos++;
            }
            KVC_TRY(expect_name(c, &n->name));
            if (str_eq(n->name, "none") || str_eq(n->name, "None")) n->name.p = "none";
            if (str_eq(n->name, "true") || str_eq(n->name, "True")) n->name.p = "true";
            if (str_eq(n->name, "false") || str_eq(n->name, "False")) n->name.p = "false";
            if (!in_list(n->name, test_names, sizeof test_names / sizeof test_names[0]))
                return kvc__chat_syntax_error(c, peek(c), "test '%.*s' is not supported",
                                              (int)n->name.n, n->name.p);
            if (is_op(peek(c), "(")) {
                KVC_TRY(parse_args(c, n));
            } else { /* Jinja would read one argument here, without parentheses */
                token *t = peek(c);
                if ((t->k == T_NAME && !is_name(t, "else") && !is_name(t, "or") &&
                     !is_name(t, "and")) ||
                    t->k == T_STRING || t->k == T_INT || is_op(t, "[") || is_op(t, "{"))
                    return kvc__chat_syntax_error(c, t,
                                                  "test arguments without parentheses are not "
                                                  "supported");
            }
        } else {
            return KVC_OK;
        }
        n->a = *io;
        *io = n;
    }
}

static kvc_status parse_unary(ctx *c, int with_filter, node **out) {
    if (++c->depth > MAX_DEPTH)
        return kvc__chat_syntax_error(c, peek(c), "expression nested too deeply");
    node *n;
    if (is_op(peek(c), "-") || is_op(peek(c), "+")) {
        int neg = is_op(peek(c), "-");
        c->pos++;
        KVC_TRY(parse_unary(c, 0, &n));
        node *m;
        KVC_TRY(new_node(c, neg ? E_NEG : E_POS, &m));
        m->a = n;
        n = m;
    } else {
        KVC_TRY(parse_primary(c, &n));
        KVC_TRY(parse_postfix(c, &n));
    }
    if (with_filter) KVC_TRY(parse_filter_expr(c, &n));
    c->depth--;
    *out = n;
    return KVC_OK;
}

static kvc_status make_bin(ctx *c, nkind k, const char *op, node *a, node *b, node **out) {
    KVC_TRY(new_node(c, k, out));
    (*out)->name.p = op;
    (*out)->name.n = strlen(op);
    (*out)->a = a;
    (*out)->b = b;
    return KVC_OK;
}

static kvc_status parse_pow(ctx *c, node **out) {
    KVC_TRY(parse_unary(c, 1, out));
    if (is_op(peek(c), "**")) return kvc__chat_syntax_error(c, peek(c), "'**' is not supported");
    return KVC_OK;
}

static kvc_status parse_math2(ctx *c, node **out) {
    KVC_TRY(parse_pow(c, out));
    for (;;) {
        token *t = peek(c);
        if (is_op(t, "/"))
            return kvc__chat_syntax_error(c, t, "'/' (float division) is not supported");
        if (!is_op(t, "*") && !is_op(t, "//") && !is_op(t, "%")) return KVC_OK;
        c->pos++;
        node *b;
        KVC_TRY(parse_pow(c, &b));
        KVC_TRY(make_bin(c, E_BIN,
                         is_op(t, "*")    ? "*"
                         : is_op(t, "//") ? "//"
                                          : "%",
                         *out, b, out));
    }
}

static kvc_status parse_concat(ctx *c, node **out) {
    KVC_TRY(parse_math2(c, out));
    while (is_op(peek(c), "~")) {
        c->pos++;
        node *b;
        KVC_TRY(parse_math2(c, &b));
        KVC_TRY(make_bin(c, E_BIN, "~", *out, b, out));
    }
    return KVC_OK;
}

static kvc_status parse_math1(ctx *c, node **out) {
    KVC_TRY(parse_concat(c, out));
    for (;;) {
        token *t = peek(c);
        if (!is_op(t, "+") && !is_op(t, "-")) return KVC_OK;
        c->pos++;
        node *b;
        KVC_TRY(parse_concat(c, &b));
        KVC_TRY(make_bin(c, E_BIN, is_op(t, "+") ? "+" : "-", *out, b, out));
    }
}

static kvc_status parse_compare(ctx *c, node **out) {
    node *first, *n = NULL;
    KVC_TRY(parse_math1(c, &first));
    for (;;) {
        token *t = peek(c);
        const char *op = NULL;
        static const char *const cmp_ops[] = {"==", "!=", "<", ">", "<=", ">="};
        for (size_t i = 0; i < sizeof cmp_ops / sizeof cmp_ops[0]; i++)
            if (is_op(t, cmp_ops[i])) op = cmp_ops[i];
        if (op) {
            c->pos++;
        } else if (is_name(t, "in")) {
            op = "in";
            c->pos++;
        } else if (is_name(t, "not") && is_name(peek_at(c, 1), "in")) {
            op = "not in";
            c->pos += 2;
        } else {
            break;
        }
        if (!n) {
            KVC_TRY(new_node(c, E_CMP, &n));
            n->a = first;
        }
        node *b;
        KVC_TRY(parse_math1(c, &b));
        str s = {op, strlen(op)};
        KVC_TRY(push_str(c, &n->names, &n->nnames, s));
        KVC_TRY(push_node(c, &n->v, &n->nv, b));
    }
    *out = n ? n : first;
    return KVC_OK;
}

static kvc_status parse_not(ctx *c, node **out) {
    if (is_name(peek(c), "not")) {
        if (++c->depth > MAX_DEPTH)
            return kvc__chat_syntax_error(c, peek(c), "expression nested too deeply");
        c->pos++;
        node *n;
        KVC_TRY(new_node(c, E_NOT, &n));
        KVC_TRY(parse_not(c, &n->a));
        c->depth--;
        *out = n;
        return KVC_OK;
    }
    return parse_compare(c, out);
}

static kvc_status parse_and(ctx *c, node **out) {
    KVC_TRY(parse_not(c, out));
    while (is_name(peek(c), "and")) {
        c->pos++;
        node *b;
        KVC_TRY(parse_not(c, &b));
        KVC_TRY(make_bin(c, E_AND, "and", *out, b, out));
    }
    return KVC_OK;
}

static kvc_status parse_or(ctx *c, node **out) {
    KVC_TRY(parse_and(c, out));
    while (is_name(peek(c), "or")) {
        c->pos++;
        node *b;
        KVC_TRY(parse_and(c, &b));
        KVC_TRY(make_bin(c, E_OR, "or", *out, b, out));
    }
    return KVC_OK;
}

/* `x if cond else y` (else optional), Jinja's condexpr. */
static kvc_status parse_expr(ctx *c, node **out) {
    if (++c->depth > MAX_DEPTH)
        return kvc__chat_syntax_error(c, peek(c), "expression nested too deeply");
    KVC_TRY(parse_or(c, out));
    while (is_name(peek(c), "if")) {
        c->pos++;
        node *n;
        KVC_TRY(new_node(c, E_COND, &n));
        n->b = *out;
        KVC_TRY(parse_or(c, &n->a));
        if (is_name(peek(c), "else")) {
            c->pos++;
            KVC_TRY(parse_expr(c, &n->c));
        }
        *out = n;
    }
    c->depth--;
    return KVC_OK;
}

/* ---- parser: statements ------------------------------------------------------- */

/* Parses statements until `{% word` with word in stop[]; leaves the parser
 * on that word (after the {%) and its index in *which. stop NULL: until EOF. */
static kvc_status kvc__chat_parse_block(ctx *c, const char *const *stop, int n_stop, node **out,
                                        int *which);

static kvc_status end_tag(ctx *c) {
    return expect_kind(c, T_BEND, "'%}'");
}

static kvc_status parse_if(ctx *c, node **out) {
    static const char *const stops[] = {"elif", "else", "endif"};
    node *n = NULL;
    KVC_TRY(new_node(c, S_IF, &n));
    KVC_TRY(parse_or(c, &n->a)); /* no `x if y` here, as in jinja2 (parentheses allow it) */
    KVC_TRY(end_tag(c));
    int which = 0;
    KVC_TRY(kvc__chat_parse_block(c, stops, 3, &n->b, &which));
    c->pos++; /* the stop word */
    if (which == 0) {
        KVC_TRY(parse_if(c, &n->c)); /* elif: a nested if that consumes endif */
    } else if (which == 1) {
        KVC_TRY(end_tag(c));
        KVC_TRY(kvc__chat_parse_block(c, stops + 2, 1, &n->c, &which));
        c->pos++;
        KVC_TRY(end_tag(c));
    } else {
        KVC_TRY(end_tag(c));
    }
    *out = n;
    return KVC_OK;
}

static kvc_status parse_for(ctx *c, node **out) {
    static const char *const stops[] = {"else", "endfor"};
    node *n;
    KVC_TRY(new_node(c, S_FOR, &n));
    do {
        str name = {NULL, 0};
        if (n->nnames) c->pos++; /* the comma */
        KVC_TRY(expect_name(c, &name));
        KVC_TRY(push_str(c, &n->names, &n->nnames, name));
    } while (is_op(peek(c), ","));
    if (!is_name(peek(c), "in")) return unexpected(c, "'in'");
    c->pos++;
    /* The iterable is parsed without condexpr so `if` starts the filter. */
    if (++c->depth > MAX_DEPTH) return kvc__chat_syntax_error(c, peek(c), "nested too deeply");
    KVC_TRY(parse_or(c, &n->a));
    c->depth--;
    if (is_name(peek(c), "if")) {
        c->pos++;
        KVC_TRY(parse_expr(c, &n->d));
    }
    if (is_name(peek(c), "recursive"))
        return kvc__chat_syntax_error(c, peek(c), "recursive loops are not supported");
    KVC_TRY(end_tag(c));
    int which = 0;
    KVC_TRY(kvc__chat_parse_block(c, stops, 2, &n->b, &which));
    c->pos++;
    KVC_TRY(end_tag(c));
    if (which == 0) {
        KVC_TRY(kvc__chat_parse_block(c, stops + 1, 1, &n->c, &which));
        c->pos++;
        KVC_TRY(end_tag(c));
    }
    *out = n;
    return KVC_OK;
}

static kvc_status parse_set(ctx *c, node **out) {
    node *n;
    KVC_TRY(new_node(c, S_SET, &n));
    KVC_TRY(expect_name(c, &n->name));
    if (is_op(peek(c), ".")) {
        c->pos++;
        n->k = S_SETATTR;
        KVC_TRY(expect_name(c, &n->attr));
    }
    if (is_op(peek(c), ","))
        return kvc__chat_syntax_error(c, peek(c), "tuple assignment is not supported");
    if (n->k == S_SET && peek(c)->k == T_BEND) { /* {% set x %}...{% endset %} */
        static const char *const stops[] = {"endset"};
        int which = 0;
        c->pos++;
        n->k = S_SETBLOCK;
        KVC_TRY(kvc__chat_parse_block(c, stops, 1, &n->b, &which));
        c->pos++;
        KVC_TRY(end_tag(c));
        *out = n;
        return KVC_OK;
    }
    KVC_TRY(expect_op(c, "="));
    KVC_TRY(parse_expr(c, &n->a));
    KVC_TRY(end_tag(c));
    *out = n;
    return KVC_OK;
}

/* One statement after `{%` (the parser is on its keyword). */
static kvc_status parse_statement(ctx *c, node **out) {
    token *t = peek(c);
    if (t->k != T_NAME) return unexpected(c, "a statement keyword");
    c->pos++;
    if (str_eq(t->s, "if")) return parse_if(c, out);
    if (str_eq(t->s, "for")) return parse_for(c, out);
    if (str_eq(t->s, "set")) return parse_set(c, out);
    if (str_eq(t->s, "break") || str_eq(t->s, "continue")) {
        KVC_TRY(new_node(c, str_eq(t->s, "break") ? S_BREAK : S_CONTINUE, out));
        return end_tag(c);
    }
    if (str_eq(t->s, "generation")) { /* transformers' assistant-mask marker: transparent */
        static const char *const stops[] = {"endgeneration"};
        int which = 0;
        KVC_TRY(end_tag(c));
        KVC_TRY(kvc__chat_parse_block(c, stops, 1, out, &which));
        c->pos++;
        return end_tag(c);
    }
    return kvc__chat_syntax_error(c, t, "statement '%.*s' is not supported",
                                  (int)(t->s.n < 40 ? t->s.n : 40), t->s.p);
}

static kvc_status kvc__chat_parse_block(ctx *c, const char *const *stop, int n_stop, node **out,
                                        int *which) {
    if (++c->depth > MAX_DEPTH)
        return kvc__chat_syntax_error(c, peek(c), "blocks nested too deeply");
    node *blk;
    KVC_TRY(new_node(c, S_BLOCK, &blk));
    for (;;) {
        token *t = peek(c);
        node *n = NULL;
        if (t->k == T_EOF) {
            if (stop) return kvc__chat_syntax_error(c, t, "missing {%% %s %%}", stop[n_stop - 1]);
            break;
        }
        if (t->k == T_TEXT) {
            KVC_TRY(new_node(c, S_TEXT, &n));
            n->name = t->s;
            c->pos++;
        } else if (t->k == T_VBEGIN) {
            c->pos++;
            KVC_TRY(new_node(c, S_OUT, &n));
            KVC_TRY(parse_expr(c, &n->a));
            KVC_TRY(expect_kind(c, T_VEND, "'}}'"));
        } else if (t->k == T_BBEGIN) {
            c->pos++;
            token *kw = peek(c);
            for (int i = 0; stop && i < n_stop; i++) {
                if (is_name(kw, stop[i])) {
                    *which = i;
                    *out = blk;
                    c->depth--;
                    return KVC_OK;
                }
            }
            if (kw->k == T_NAME && (str_eq(kw->s, "elif") || str_eq(kw->s, "else") ||
                                    str_eq(kw->s, "endif") || str_eq(kw->s, "endfor") ||
                                    str_eq(kw->s, "endset") || str_eq(kw->s, "endgeneration")))
                return kvc__chat_syntax_error(c, kw, "unexpected '%.*s'", (int)kw->s.n, kw->s.p);
            KVC_TRY(parse_statement(c, &n));
        } else {
            return unexpected(c, "template text or a tag");
        }
        KVC_TRY(push_node(c, &blk->v, &blk->nv, n));
    }
    c->depth--;
    *out = blk;
    return KVC_OK;
}

/* ---- evaluation helpers ------------------------------------------------------ */

static kvc_status kvc__chat_runtime_error(const node *n, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvc__error(KVC_ERR_INVALID_ARG, "chat template, line %d: %s", n ? n->line : 0, msg);
}

static const char *kvc__chat_type_name(const value *v) {
    switch (v->t) {
    case V_UNDEF: return "undefined";
    case V_NONE: return "NoneType";
    case V_BOOL: return "bool";
    case V_INT: return "int";
    case V_STR: return "str";
    case V_LIST: return "list";
    case V_DICT: return "dict";
    default: return "function";
    }
}

/* A growable string in the arena (old storage is abandoned on growth). */
typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

static kvc_status kvc__chat_sb_put(ctx *c, sbuf *b, const char *p, size_t n) {
    KVC_TRY(charge(c, n));
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n) cap *= 2;
        if (cap > MAX_BYTES) return kvc__chat_nomem();
        char *q;
        ALLOC(c, q, cap);
        if (b->n) memcpy(q, b->p, b->n);
        b->p = q;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, p, n);
    b->n += n;
    return KVC_OK;
}

static kvc_status sb_cstr(ctx *c, sbuf *b, const char *s) {
    return kvc__chat_sb_put(c, b, s, strlen(s));
}

/* Python's repr() of a string: single quotes unless it holds ' and no ". */
static kvc_status repr_str(ctx *c, sbuf *b, str s) {
    char q = memchr(s.p, '\'', s.n) && !memchr(s.p, '"', s.n) ? '"' : '\'';
    KVC_TRY(kvc__chat_sb_put(c, b, &q, 1));
    for (size_t i = 0; i < s.n; i++) {
        unsigned char ch = (unsigned char)s.p[i];
        char esc[8];
        if (ch == '\\' || ch == (unsigned char)q) {
            esc[0] = '\\';
            esc[1] = (char)ch;
            KVC_TRY(kvc__chat_sb_put(c, b, esc, 2));
        } else if (ch == '\n' || ch == '\r' || ch == '\t') {
            KVC_TRY(sb_cstr(c, b, ch == '\n' ? "\\n" : ch == '\r' ? "\\r" : "\\t"));
        } else if (ch < 0x20 || ch == 0x7F) {
            snprintf(esc, sizeof esc, "\\x%02x", ch);
            KVC_TRY(sb_cstr(c, b, esc));
        } else {
            KVC_TRY(kvc__chat_sb_put(c, b, (const char *)&ch, 1));
        }
    }
    return kvc__chat_sb_put(c, b, &q, 1);
}

static kvc_status write_value(ctx *c, sbuf *b, const value *v, int repr);

static kvc_status write_value(ctx *c, sbuf *b, const value *v, int repr) {
    char num[32];
    switch (v->t) {
    case V_UNDEF: return repr ? sb_cstr(c, b, "Undefined") : KVC_OK; /* jinja2's repr */
    case V_NONE: return sb_cstr(c, b, "None");
    case V_BOOL: return sb_cstr(c, b, v->u.i ? "True" : "False");
    case V_INT: snprintf(num, sizeof num, "%lld", (long long)v->u.i); return sb_cstr(c, b, num);
    case V_STR: return repr ? repr_str(c, b, v->u.s) : kvc__chat_sb_put(c, b, v->u.s.p, v->u.s.n);
    case V_LIST:
        KVC_TRY(sb_cstr(c, b, v->u.l->is_tuple ? "(" : "["));
        for (size_t i = 0; i < v->u.l->n; i++) {
            if (i) KVC_TRY(sb_cstr(c, b, ", "));
            KVC_TRY(write_value(c, b, &v->u.l->items[i], 1));
        }
        return sb_cstr(c, b, v->u.l->is_tuple ? ")" : "]");
    case V_DICT: /* a namespace() prints as Jinja's Namespace object */
        KVC_TRY(sb_cstr(c, b, v->u.d->is_namespace ? "<Namespace {" : "{"));
        for (size_t i = 0; i < v->u.d->n; i++) {
            if (i) KVC_TRY(sb_cstr(c, b, ", "));
            KVC_TRY(repr_str(c, b, v->u.d->keys[i]));
            KVC_TRY(sb_cstr(c, b, ": "));
            KVC_TRY(write_value(c, b, &v->u.d->vals[i], 1));
        }
        return sb_cstr(c, b, v->u.d->is_namespace ? "}>" : "}");
    default: return sb_cstr(c, b, "<function>");
    }
}

/* str(v) as Jinja prints it (undefined prints nothing). */
static kvc_status kvc__chat_to_str(ctx *c, const value *v, str *out) {
    if (v->t == V_STR) {
        *out = v->u.s;
        return KVC_OK;
    }
    sbuf b = {NULL, 0, 0};
    KVC_TRY(write_value(c, &b, v, 0));
    out->p = b.p ? b.p : "";
    out->n = b.n;
    return KVC_OK;
}

static int truthy(const value *v) {
    switch (v->t) {
    case V_BOOL:
    case V_INT: return v->u.i != 0;
    case V_STR: return v->u.s.n != 0;
    case V_LIST: return v->u.l->n != 0;
    case V_DICT: return v->u.d->n != 0;
    case V_FUNC: return 1;
    default: return 0;
    }
}

static int is_num(const value *v) {
    return v->t == V_INT || v->t == V_BOOL;
}

static int kvc__chat_values_equal(const value *a, const value *b) {
    if (is_num(a) && is_num(b)) return a->u.i == b->u.i;
    if (a->t != b->t) return 0;
    switch (a->t) {
    case V_UNDEF:
    case V_NONE: return 1;
    case V_STR: return a->u.s.n == b->u.s.n && memcmp(a->u.s.p, b->u.s.p, a->u.s.n) == 0;
    case V_LIST:
        if (a->u.l->n != b->u.l->n) return 0;
        for (size_t i = 0; i < a->u.l->n; i++)
            if (!kvc__chat_values_equal(&a->u.l->items[i], &b->u.l->items[i])) return 0;
        return 1;
    case V_DICT:
        if (a->u.d->n != b->u.d->n) return 0;
        for (size_t i = 0; i < a->u.d->n; i++) {
            size_t j = 0;
            while (j < b->u.d->n &&
                   !(a->u.d->keys[i].n == b->u.d->keys[j].n &&
                     memcmp(a->u.d->keys[i].p, b->u.d->keys[j].p, a->u.d->keys[i].n) == 0))
                j++;
            if (j == b->u.d->n || !kvc__chat_values_equal(&a->u.d->vals[i], &b->u.d->vals[j]))
                return 0;
        }
        return 1;
    case V_FUNC: return a->u.i == b->u.i;
    default: return 0;
    }
}

/* Python's a < b (-1 / 0 / 1 into *cmp) for numbers, strings and lists. */
static kvc_status kvc__chat_order(const node *n, const value *a, const value *b, int *cmp) {
    if (is_num(a) && is_num(b)) {
        *cmp = a->u.i < b->u.i ? -1 : a->u.i > b->u.i;
        return KVC_OK;
    }
    if (a->t == V_STR && b->t == V_STR) { /* UTF-8 byte order is code point order */
        size_t m = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        int r = m ? memcmp(a->u.s.p, b->u.s.p, m) : 0;
        *cmp = r ? (r < 0 ? -1 : 1) : a->u.s.n < b->u.s.n ? -1 : a->u.s.n > b->u.s.n;
        return KVC_OK;
    }
    if (a->t == V_LIST && b->t == V_LIST) {
        for (size_t i = 0; i < a->u.l->n && i < b->u.l->n; i++) {
            if (kvc__chat_values_equal(&a->u.l->items[i], &b->u.l->items[i])) continue;
            return kvc__chat_order(n, &a->u.l->items[i], &b->u.l->items[i], cmp);
        }
        *cmp = a->u.l->n < b->u.l->n ? -1 : a->u.l->n > b->u.l->n;
        return KVC_OK;
    }
    return kvc__chat_runtime_error(n, "cannot order %s and %s", kvc__chat_type_name(a),
                                   kvc__chat_type_name(b));
}

static kvc_status kvc__chat_new_list(ctx *c, size_t cap, value *out) {
    list *l;
    ALLOC(c, l, 1);
    l->n = 0;
    l->is_tuple = 0;
    l->cap = cap ? cap : 1;
    ALLOC(c, l->items, l->cap);
    out->t = V_LIST;
    out->u.l = l;
    return KVC_OK;
}

static kvc_status kvc__chat_list_push(ctx *c, list *l, value v) {
    if (l->n == l->cap) {
        value *items;
        ALLOC(c, items, 2 * l->cap);
        memcpy(items, l->items, l->n * sizeof *items);
        l->items = items;
        l->cap *= 2;
    }
    l->items[l->n++] = v;
    return KVC_OK;
}

static kvc_status kvc__chat_new_dict(ctx *c, size_t cap, value *out) {
    dict *d;
    ALLOC(c, d, 1);
    memset(d, 0, sizeof *d);
    d->cap = cap ? cap : 1;
    ALLOC(c, d->keys, d->cap);
    ALLOC(c, d->vals, d->cap);
    out->t = V_DICT;
    out->u.d = d;
    return KVC_OK;
}

/* What comparing or looking up v costs, for charge(): a string's bytes, a
 * list's or dict's entries (their strings are charged as they are compared
 * in turn only when equal in length, rare enough to leave out). */
static size_t cost_of(const value *v) {
    return v->t == V_STR ? v->u.s.n : v->t == V_LIST ? v->u.l->n : v->t == V_DICT ? v->u.d->n : 0;
}

static value *kvc__chat_dict_find(dict *d, str key) {
    for (size_t i = 0; i < d->n; i++)
        if (d->keys[i].n == key.n && memcmp(d->keys[i].p, key.p, key.n) == 0) return &d->vals[i];
    return NULL;
}

static kvc_status kvc__chat_dict_set(ctx *c, dict *d, str key, value v) {
    value *slot = kvc__chat_dict_find(d, key);
    if (slot) {
        *slot = v;
        return KVC_OK;
    }
    if (d->n == d->cap) {
        str *keys;
        value *vals;
        ALLOC(c, keys, 2 * d->cap);
        ALLOC(c, vals, 2 * d->cap);
        memcpy(keys, d->keys, d->n * sizeof *keys);
        memcpy(vals, d->vals, d->n * sizeof *vals);
        d->keys = keys;
        d->vals = vals;
        d->cap *= 2;
    }
    d->keys[d->n] = key;
    d->vals[d->n++] = v;
    return KVC_OK;
}

static str cstr(const char *s) {
    str r = {s, strlen(s)};
    return r;
}

/* Code points of a string, as a list of one-character strings. */
static kvc_status kvc__chat_str_chars(ctx *c, str s, value *out) {
    KVC_TRY(kvc__chat_new_list(c, s.n, out));
    for (size_t i = 0; i < s.n;) {
        int len;
        kvc__utf8_decode((const unsigned char *)s.p + i, s.n - i, &len);
        KVC_TRY(kvc__chat_list_push(c, out->u.l, v_str(s.p + i, (size_t)len)));
        i += (size_t)len;
    }
    return KVC_OK;
}

static size_t kvc__chat_str_len_cp(str s) {
    size_t k = 0;
    for (size_t i = 0; i < s.n; k++) {
        int len;
        kvc__utf8_decode((const unsigned char *)s.p + i, s.n - i, &len);
        i += (size_t)len;
    }
    return k;
}

/* Items a for loop visits: a list's items, a dict's keys, a string's
 * characters; undefined iterates as empty. */
static kvc_status kvc__chat_iter_items(ctx *c, const node *n, const value *v, value *out) {
    if (v->t == V_LIST) {
        *out = *v;
        return KVC_OK;
    }
    if (v->t == V_STR) return kvc__chat_str_chars(c, v->u.s, out);
    if (v->t == V_UNDEF) return kvc__chat_new_list(c, 0, out);
    if (v->t == V_DICT) {
        KVC_TRY(kvc__chat_new_list(c, v->u.d->n, out));
        for (size_t i = 0; i < v->u.d->n; i++)
            KVC_TRY(kvc__chat_list_push(c, out->u.l, v_str(v->u.d->keys[i].p, v->u.d->keys[i].n)));
        return KVC_OK;
    }
    return kvc__chat_runtime_error(n, "'%s' object is not iterable", kvc__chat_type_name(v));
}

/* ---- scopes ------------------------------------------------------------------- */

static int kvc__chat_lookup(ctx *c, str name, value *out) {
    for (int f = c->n_frames - 1; f >= 0; f--) {
        frame *fr = &c->frames[f];
        for (size_t i = fr->n; i-- > 0;)
            if (fr->names[i].n == name.n && memcmp(fr->names[i].p, name.p, name.n) == 0) {
                *out = fr->vals[i];
                return 1;
            }
    }
    static const struct {
        const char *name;
        int fn;
    } fns[] = {{"raise_exception", F_RAISE}, {"namespace", F_NAMESPACE}, {"range", F_RANGE}};
    for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++)
        if (str_eq(name, fns[i].name)) {
            out->t = V_FUNC;
            out->u.i = fns[i].fn;
            return 1;
        }
    if (str_eq(name, "messages"))
        *out = c->messages;
    else if (str_eq(name, "add_generation_prompt"))
        *out = c->add_generation_prompt;
    else if (str_eq(name, "bos_token"))
        *out = c->bos_token;
    else if (str_eq(name, "eos_token"))
        *out = c->eos_token;
    else if (str_eq(name, "tools") || str_eq(name, "documents"))
        *out = v_none();
    else {
        *out = v_undef();
        return 0;
    }
    return 1;
}

static kvc_status kvc__chat_set_var(ctx *c, str name, value v) {
    frame *fr = &c->frames[c->n_frames - 1];
    for (size_t i = 0; i < fr->n; i++)
        if (fr->names[i].n == name.n && memcmp(fr->names[i].p, name.p, name.n) == 0) {
            fr->vals[i] = v;
            return KVC_OK;
        }
    if (fr->n == fr->cap) {
        size_t cap = fr->cap ? 2 * fr->cap : 8;
        str *names;
        value *vals;
        ALLOC(c, names, cap);
        ALLOC(c, vals, cap);
        if (fr->n) {
            memcpy(names, fr->names, fr->n * sizeof *names);
            memcpy(vals, fr->vals, fr->n * sizeof *vals);
        }
        fr->names = names;
        fr->vals = vals;
        fr->cap = cap;
    }
    fr->names[fr->n] = name;
    fr->vals[fr->n++] = v;
    return KVC_OK;
}

/* ---- strings ------------------------------------------------------------------ */

static int ascii_upper(int ch) {
    return ch >= 'a' && ch <= 'z' ? ch - 32 : ch;
}
static int ascii_lower_ch(int ch) {
    return ch >= 'A' && ch <= 'Z' ? ch + 32 : ch;
}

/* Copy of s with every ASCII letter mapped by mode: 'u' upper, 'l' lower,
 * 'c' capitalize (first upper, rest lower), 't' Jinja's title filter (first
 * letter of every item split at runs of [-\s({[<] upper, rest lower),
 * 'T' Python's str.title() (upper after a non-letter, lower after a letter). */
static kvc_status kvc__chat_map_case(ctx *c, str s, char mode, value *out) {
    char *p;
    ALLOC(c, p, s.n + 1);
    int word_start = 1;
    for (size_t i = 0; i < s.n; i++) {
        int ch = (unsigned char)s.p[i];
        int letter = (ch | 32) >= 'a' && (ch | 32) <= 'z';
        switch (mode) {
        case 'u': ch = ascii_upper(ch); break;
        case 'l': ch = ascii_lower_ch(ch); break;
        case 'c': ch = i == 0 ? ascii_upper(ch) : ascii_lower_ch(ch); break;
        case 't': {
            int sep = ch == '-' || ch == '(' || ch == '{' || ch == '[' || ch == '<' || ch == ' ' ||
                      (ch >= '\t' && ch <= '\r');
            ch = word_start && !sep ? ascii_upper(ch) : ascii_lower_ch(ch);
            word_start = sep;
            break;
        }
        default: /* 'T' */
            ch = word_start ? ascii_upper(ch) : ascii_lower_ch(ch);
            word_start = !letter && !(ch & 0x80);
            break;
        }
        p[i] = (char)ch;
    }
    *out = v_str(p, s.n);
    return KVC_OK;
}

static int cmp_u32(const void *x, const void *y) {
    const uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return (a > b) - (a < b);
}

/* The code points of chars, sorted (set->n 0 if there are none), so that
 * strip(chars) looks each code point up instead of scanning chars (n * m). */
typedef struct cp_set {
    uint32_t *cp;
    size_t n;
} cp_set;

/* set->cp: room for 64 code points, or NULL; the arena is used for more. */
static kvc_status cp_set_make(ctx *c, str chars, cp_set *set) {
    if (chars.n > 64 || !set->cp) ALLOC(c, set->cp, chars.n + 1); /* <= 1 code point a byte */
    set->n = 0;
    for (size_t j = 0; j < chars.n;) {
        int l2;
        set->cp[set->n++] = kvc__utf8_decode((const unsigned char *)chars.p + j, chars.n - j, &l2);
        j += (size_t)l2;
    }
    qsort(set->cp, set->n, sizeof(uint32_t), cmp_u32);
    return KVC_OK;
}

static int strip_hit(uint32_t cp, const cp_set *set) {
    if (!set) return kvc__py_isspace(cp);
    return set->n && bsearch(&cp, set->cp, set->n, sizeof(uint32_t), cmp_u32) != NULL;
}

/* Python strip/lstrip/rstrip: set NULL strips str.isspace()
 * code points, else those in the set. */
static str strip_set(str s, const cp_set *set, int left, int right) {
    size_t a = 0, b = s.n;
    for (;;) { /* from the left */
        if (!left || a >= b) break;
        int len;
        uint32_t cp = kvc__utf8_decode((const unsigned char *)s.p + a, b - a, &len);
        if (!strip_hit(cp, set)) break;
        a += (size_t)len;
    }
    while (right && b > a) { /* from the right: find the last code point's start */
        size_t st = b - 1;
        while (st > a && ((unsigned char)s.p[st] & 0xC0) == 0x80 && b - st < 4) st--;
        int len;
        uint32_t cp = kvc__utf8_decode((const unsigned char *)s.p + st, b - st, &len);
        if (st + (size_t)len != b) { /* not one well-formed sequence: the last byte alone */
            st = b - 1;
            cp = kvc__utf8_decode((const unsigned char *)s.p + st, 1, &len);
        }
        if (!strip_hit(cp, set)) break;
        b = st;
    }
    str r = {s.p + a, b - a};
    return r;
}

/* strip_set for whitespace (no set). */
static str kvc__chat_strip_str(str s, int left, int right) {
    return strip_set(s, NULL, left, right);
}

/* strip/lstrip/rstrip with chars (NULL: whitespace) as the template calls
 * them: the chars made into a set first, the bytes charged to MAX_WORK. */
static kvc_status kvc__chat_strip_chars(ctx *c, str s, const str *chars, int left, int right,
                                        str *out) {
    KVC_TRY(charge(c, s.n + (chars ? chars->n : 0)));
    uint32_t local[64]; /* short chars (the usual case): no arena allocation per call */
    cp_set set = {local, 0};
    if (chars) KVC_TRY(cp_set_make(c, *chars, &set));
    *out = strip_set(s, chars ? &set : NULL, left, right);
    return KVC_OK;
}

/* First occurrence of needle in hay at or after from (memmem: linear, not
 * n * m as a naive scan is on 'aaa...ab' needles). */
static const char *kvc__chat_find_sub(str hay, str needle, size_t from) {
    if (needle.n == 0) return hay.p + from;
    if (from > hay.n || needle.n > hay.n - from) return NULL;
    return memmem(hay.p + from, hay.n - from, needle.p, needle.n);
}

static kvc_status kvc__chat_str_replace(ctx *c, const node *n, str s, str old, str rep,
                                        int64_t count, value *out) {
    KVC_TRY(charge(c, s.n)); /* the search; sb_put charges the copies */
    sbuf b = {NULL, 0, 0};
    if (old.n == 0) { /* Python inserts rep around every character */
        value chars;
        KVC_TRY(kvc__chat_str_chars(c, s, &chars));
        for (size_t i = 0; i <= chars.u.l->n; i++) {
            if (count < 0 || (int64_t)i < count) KVC_TRY(kvc__chat_sb_put(c, &b, rep.p, rep.n));
            if (i < chars.u.l->n)
                KVC_TRY(
                    kvc__chat_sb_put(c, &b, chars.u.l->items[i].u.s.p, chars.u.l->items[i].u.s.n));
        }
    } else {
        size_t pos = 0;
        int64_t done = 0;
        const char *hit;
        while ((count < 0 || done < count) && (hit = kvc__chat_find_sub(s, old, pos)) != NULL) {
            KVC_TRY(kvc__chat_sb_put(c, &b, s.p + pos, (size_t)(hit - s.p) - pos));
            KVC_TRY(kvc__chat_sb_put(c, &b, rep.p, rep.n));
            pos = (size_t)(hit - s.p) + old.n;
            done++;
        }
        KVC_TRY(kvc__chat_sb_put(c, &b, s.p + pos, s.n - pos));
    }
    (void)n;
    *out = v_str(b.p ? b.p : "", b.n);
    return KVC_OK;
}

/* Python str.split(sep=None, maxsplit=-1). */
static kvc_status kvc__chat_str_split(ctx *c, const node *n, str s, const value *sep,
                                      int64_t maxsplit, value *out) {
    KVC_TRY(charge(c, s.n));
    KVC_TRY(kvc__chat_new_list(c, 4, out));
    if (!sep || sep->t == V_NONE) {
        size_t i = 0;
        int64_t splits = 0;
        for (;;) {
            int len;
            while (i < s.n && space_at(s.p, s.n, i, &len)) i += (size_t)len;
            if (i >= s.n) break;
            if (maxsplit >= 0 && splits >= maxsplit) {
                str rest = kvc__chat_strip_str((str){s.p + i, s.n - i}, 0, 1);
                KVC_TRY(kvc__chat_list_push(c, out->u.l, v_str(rest.p, rest.n)));
                break;
            }
            size_t j = i;
            while (j < s.n && !space_at(s.p, s.n, j, &len)) j += (size_t)len;
            KVC_TRY(kvc__chat_list_push(c, out->u.l, v_str(s.p + i, j - i)));
            splits++;
            i = j;
        }
        return KVC_OK;
    }
    if (sep->t != V_STR) return kvc__chat_runtime_error(n, "split() separator must be a string");
    if (sep->u.s.n == 0) return kvc__chat_runtime_error(n, "split(): empty separator");
    size_t pos = 0;
    int64_t splits = 0;
    const char *hit;
    while ((maxsplit < 0 || splits < maxsplit) &&
           (hit = kvc__chat_find_sub(s, sep->u.s, pos)) != NULL) {
        KVC_TRY(kvc__chat_list_push(c, out->u.l, v_str(s.p + pos, (size_t)(hit - s.p) - pos)));
        pos = (size_t)(hit - s.p) + sep->u.s.n;
        splits++;
    }
    return kvc__chat_list_push(c, out->u.l, v_str(s.p + pos, s.n - pos));
}

static kvc_status kvc__chat_concat(ctx *c, str a, str b, value *out) {
    if (a.n + b.n > MAX_BYTES) return kvc__chat_nomem();
    KVC_TRY(charge(c, a.n + b.n));
    char *p;
    ALLOC(c, p, a.n + b.n + 1);
    if (a.n) memcpy(p, a.p, a.n);
    if (b.n) memcpy(p + a.n, b.p, b.n);
    *out = v_str(p, a.n + b.n);
    return KVC_OK;
}

/* ---- expressions --------------------------------------------------------------- */

static kvc_status kvc__chat_eval(ctx *c, const node *n, value *out);

static kvc_status undefined_error(const node *n) {
    if (n->k == E_NAME)
        return kvc__chat_runtime_error(n, "'%.*s' is undefined",
                                       (int)(n->name.n < 60 ? n->name.n : 60), n->name.p);
    return kvc__chat_runtime_error(n, "an undefined value is used");
}

/* Python indexing: list/str by (possibly negative) int, dict by key. */
static kvc_status get_item(ctx *c, const node *n, const value *obj, const value *key, value *out) {
    *out = v_undef();
    if (obj->t == V_UNDEF) return undefined_error(n->a);
    if (obj->t == V_DICT) {
        if (key->t == V_STR) {
            KVC_TRY(charge(c, key->u.s.n));
            value *v = kvc__chat_dict_find(obj->u.d, key->u.s);
            if (v) *out = *v;
        }
        return KVC_OK;
    }
    if ((obj->t == V_LIST || obj->t == V_STR) && is_num(key)) {
        value items = *obj;
        if (obj->t == V_STR) KVC_TRY(kvc__chat_str_chars(c, obj->u.s, &items));
        int64_t len = (int64_t)items.u.l->n, i = key->u.i;
        if (i < 0) i += len;
        if (i >= 0 && i < len) *out = items.u.l->items[i];
    }
    return KVC_OK;
}

static kvc_status get_attr(const node *n, const value *obj, str name, value *out) {
    *out = v_undef();
    if (obj->t == V_UNDEF) return undefined_error(n->a);
    if (obj->t == V_DICT) {
        value *v = kvc__chat_dict_find(obj->u.d, name);
        if (v) *out = *v;
    }
    return KVC_OK;
}

static kvc_status eval_slice(ctx *c, const node *n, value *out) {
    value obj, bounds[3];
    KVC_TRY(kvc__chat_eval(c, n->a, &obj));
    const node *parts[3] = {n->b, n->c, n->d};
    for (int i = 0; i < 3; i++) {
        bounds[i] = v_none();
        if (parts[i]) KVC_TRY(kvc__chat_eval(c, parts[i], &bounds[i]));
        if (bounds[i].t != V_NONE && !is_num(&bounds[i]))
            return kvc__chat_runtime_error(n, "slice indices must be integers");
    }
    if (obj.t == V_UNDEF) return undefined_error(n->a);
    if (obj.t != V_LIST && obj.t != V_STR)
        return kvc__chat_runtime_error(n, "cannot slice a %s", kvc__chat_type_name(&obj));
    value items = obj;
    if (obj.t == V_STR) KVC_TRY(kvc__chat_str_chars(c, obj.u.s, &items));
    int64_t len = (int64_t)items.u.l->n;
    int64_t step = bounds[2].t == V_NONE ? 1 : bounds[2].u.i;
    if (step == 0) return kvc__chat_runtime_error(n, "slice step cannot be zero");
    int64_t start, stop;
    for (int i = 0; i < 2; i++) {
        int64_t *dst = i == 0 ? &start : &stop;
        if (bounds[i].t == V_NONE) {
            *dst = step > 0 ? (i == 0 ? 0 : len) : (i == 0 ? len - 1 : -1);
            continue;
        }
        int64_t x = bounds[i].u.i;
        if (x < 0) x += len;
        if (step > 0)
            x = x < 0 ? 0 : x > len ? len : x;
        else
            x = x < 0 ? -1 : x >= len ? len - 1 : x;
        *dst = x;
    }
    value res;
    KVC_TRY(kvc__chat_new_list(c, 4, &res));
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
        KVC_TRY(kvc__chat_list_push(c, res.u.l, items.u.l->items[i]));
    if (obj.t == V_LIST) {
        *out = res;
        return KVC_OK;
    }
    sbuf b = {NULL, 0, 0};
    for (size_t i = 0; i < res.u.l->n; i++)
        KVC_TRY(kvc__chat_sb_put(c, &b, res.u.l->items[i].u.s.p, res.u.l->items[i].u.s.n));
    *out = v_str(b.p ? b.p : "", b.n);
    return KVC_OK;
}

/* Evaluates call arguments into pos[] / kw[] (at most 8 of each). */
typedef struct args {
    value pos[8];
    size_t n_pos;
    str kw_names[8];
    value kw[8];
    size_t n_kw;
} args;

static kvc_status eval_args(ctx *c, const node *n, args *a) {
    if (n->nv > 8 || n->nw > 8) return kvc__chat_runtime_error(n, "too many arguments");
    a->n_pos = n->nv;
    a->n_kw = n->nw;
    for (size_t i = 0; i < n->nv; i++) KVC_TRY(kvc__chat_eval(c, n->v[i], &a->pos[i]));
    for (size_t i = 0; i < n->nw; i++) {
        a->kw_names[i] = n->names[i];
        KVC_TRY(kvc__chat_eval(c, n->w[i], &a->kw[i]));
    }
    return KVC_OK;
}

/* Argument i by position or by keyword name; NULL if absent. */
static const value *arg(const args *a, size_t i, const char *name) {
    if (i < a->n_pos) return &a->pos[i];
    for (size_t k = 0; k < a->n_kw; k++)
        if (str_eq(a->kw_names[k], name)) return &a->kw[k];
    return NULL;
}

static kvc_status want_str(const node *n, const value *v, const char *what, str *out) {
    if (!v || v->t != V_STR) return kvc__chat_runtime_error(n, "%s must be a string", what);
    *out = v->u.s;
    return KVC_OK;
}

static kvc_status call_method(ctx *c, const node *n, const value *obj, str m, const args *a,
                              value *out) {
    if (obj->t == V_UNDEF) return undefined_error(n->a->a);
    if (obj->t == V_STR) {
        str s = obj->u.s, x = {NULL, 0};
        if (str_eq(m, "strip") || str_eq(m, "lstrip") || str_eq(m, "rstrip")) {
            const value *ch = arg(a, 0, "chars");
            str chars = {NULL, 0};
            if (ch && ch->t != V_NONE) KVC_TRY(want_str(n, ch, "strip() chars", &chars));
            str r;
            KVC_TRY(kvc__chat_strip_chars(c, s, ch && ch->t != V_NONE ? &chars : NULL,
                                          m.p[0] != 'r', m.p[0] != 'l', &r));
            *out = v_str(r.p, r.n);
            return KVC_OK;
        }
        if (str_eq(m, "startswith") || str_eq(m, "endswith")) {
            KVC_TRY(want_str(n, arg(a, 0, "prefix"), "the prefix", &x));
            KVC_TRY(charge(c, x.n));
            int hit = x.n <= s.n && memcmp(m.p[0] == 's' ? s.p : s.p + s.n - x.n, x.p, x.n) == 0;
            *out = v_bool(hit);
            return KVC_OK;
        }
        if (str_eq(m, "upper")) return kvc__chat_map_case(c, s, 'u', out);
        if (str_eq(m, "lower")) return kvc__chat_map_case(c, s, 'l', out);
        if (str_eq(m, "title")) return kvc__chat_map_case(c, s, 'T', out);
        if (str_eq(m, "capitalize")) return kvc__chat_map_case(c, s, 'c', out);
        if (str_eq(m, "split")) {
            const value *ms = arg(a, 1, "maxsplit");
            if (ms && !is_num(ms)) return kvc__chat_runtime_error(n, "maxsplit must be an integer");
            return kvc__chat_str_split(c, n, s, arg(a, 0, "sep"), ms ? ms->u.i : -1, out);
        }
        if (str_eq(m, "replace")) {
            str old = {NULL, 0}, rep = {NULL, 0};
            KVC_TRY(want_str(n, arg(a, 0, "old"), "replace() old", &old));
            KVC_TRY(want_str(n, arg(a, 1, "new"), "replace() new", &rep));
            const value *cnt = arg(a, 2, "count");
            if (cnt && !is_num(cnt)) return kvc__chat_runtime_error(n, "count must be an integer");
            return kvc__chat_str_replace(c, n, s, old, rep, cnt ? cnt->u.i : -1, out);
        }
    } else if (obj->t == V_DICT) {
        dict *d = obj->u.d;
        if (str_eq(m, "get")) {
            str key = {NULL, 0};
            const value *dflt = arg(a, 1, "default");
            KVC_TRY(want_str(n, arg(a, 0, "key"), "get() key", &key));
            KVC_TRY(charge(c, key.n));
            value *v = kvc__chat_dict_find(d, key);
            *out = v ? *v : dflt ? *dflt : v_none();
            return KVC_OK;
        }
        if (str_eq(m, "items") || str_eq(m, "keys") || str_eq(m, "values")) {
            KVC_TRY(kvc__chat_new_list(c, d->n, out));
            for (size_t i = 0; i < d->n; i++) {
                value k = v_str(d->keys[i].p, d->keys[i].n), item;
                if (m.p[0] == 'k') {
                    item = k;
                } else if (m.p[0] == 'v') {
                    item = d->vals[i];
                } else {
                    KVC_TRY(kvc__chat_new_list(c, 2, &item));
                    item.u.l->is_tuple = 1;
                    KVC_TRY(kvc__chat_list_push(c, item.u.l, k));
                    KVC_TRY(kvc__chat_list_push(c, item.u.l, d->vals[i]));
                }
                KVC_TRY(kvc__chat_list_push(c, out->u.l, item));
            }
            return KVC_OK;
        }
    }
    return kvc__error(KVC_ERR_UNSUPPORTED,
                      "chat template, line %d: method %s.%.*s() is not supported", n->line,
                      kvc__chat_type_name(obj), (int)(m.n < 40 ? m.n : 40), m.p);
}

static kvc_status call_builtin(ctx *c, const node *n, int fn, const args *a, value *out) {
    if (fn == F_RAISE) {
        str msg = {"", 0};
        if (a->n_pos) KVC_TRY(kvc__chat_to_str(c, &a->pos[0], &msg));
        return kvc__error(KVC_ERR_INVALID_ARG, "chat template raised an exception: %.*s",
                          (int)(msg.n < 400 ? msg.n : 400), msg.p);
    }
    if (fn == F_NAMESPACE) {
        if (a->n_pos)
            return kvc__chat_runtime_error(n, "namespace() takes keyword arguments only here");
        KVC_TRY(kvc__chat_new_dict(c, a->n_kw, out));
        out->u.d->is_namespace = 1;
        for (size_t i = 0; i < a->n_kw; i++)
            KVC_TRY(kvc__chat_dict_set(c, out->u.d, a->kw_names[i], a->kw[i]));
        return KVC_OK;
    }
    /* range(stop) / range(start, stop[, step]) */
    int64_t r[3] = {0, 0, 1};
    if (a->n_pos < 1 || a->n_pos > 3 || a->n_kw)
        return kvc__chat_runtime_error(n, "range() takes 1 to 3 integers");
    for (size_t i = 0; i < a->n_pos; i++)
        if (!is_num(&a->pos[i])) return kvc__chat_runtime_error(n, "range() takes integers");
    if (a->n_pos == 1)
        r[1] = a->pos[0].u.i;
    else
        for (size_t i = 0; i < a->n_pos; i++) r[i] = a->pos[i].u.i;
    if (r[2] == 0) return kvc__chat_runtime_error(n, "range() step must not be zero");
    KVC_TRY(kvc__chat_new_list(c, 4, out));
    for (int64_t i = r[0]; r[2] > 0 ? i < r[1] : i > r[1]; i += r[2]) {
        if (out->u.l->n >= 1000000) return kvc__chat_runtime_error(n, "range() is too long");
        KVC_TRY(kvc__chat_list_push(c, out->u.l, v_int(i)));
        if ((r[2] > 0 && i > INT64_MAX - r[2]) || (r[2] < 0 && i < INT64_MIN - r[2])) break;
    }
    return KVC_OK;
}

static kvc_status eval_call(ctx *c, const node *n, value *out) {
    args a;
    if (n->a->k == E_ATTR) { /* method call */
        value obj;
        KVC_TRY(kvc__chat_eval(c, n->a->a, &obj));
        KVC_TRY(eval_args(c, n, &a));
        return call_method(c, n, &obj, n->a->name, &a, out);
    }
    value f;
    if (n->a->k == E_NAME) {
        if (!kvc__chat_lookup(c, n->a->name, &f))
            return kvc__error(KVC_ERR_UNSUPPORTED,
                              "chat template, line %d: function '%.*s' is not "
                              "supported",
                              n->line, (int)(n->a->name.n < 40 ? n->a->name.n : 40), n->a->name.p);
    } else {
        KVC_TRY(kvc__chat_eval(c, n->a, &f));
    }
    if (f.t != V_FUNC)
        return kvc__chat_runtime_error(n, "'%s' object is not callable", kvc__chat_type_name(&f));
    KVC_TRY(eval_args(c, n, &a));
    return call_builtin(c, n, (int)f.u.i, &a, out);
}

static kvc_status eval_filter(ctx *c, const node *n, value *out) {
    value x;
    args a;
    KVC_TRY(kvc__chat_eval(c, n->a, &x));
    KVC_TRY(eval_args(c, n, &a));
    str f = n->name, s;
    if (str_eq(f, "default") || str_eq(f, "d")) {
        const value *dflt = arg(&a, 0, "default_value");
        const value *boolean = arg(&a, 1, "boolean");
        int use = x.t == V_UNDEF || (boolean && truthy(boolean) && !truthy(&x));
        *out = use ? (dflt ? *dflt : v_str("", 0)) : x;
        return KVC_OK;
    }
    if (str_eq(f, "length") || str_eq(f, "count")) {
        switch (x.t) {
        case V_STR:
            KVC_TRY(charge(c, x.u.s.n));
            *out = v_int((int64_t)kvc__chat_str_len_cp(x.u.s));
            return KVC_OK;
        case V_LIST: *out = v_int((int64_t)x.u.l->n); return KVC_OK;
        case V_DICT: *out = v_int((int64_t)x.u.d->n); return KVC_OK;
        case V_UNDEF: *out = v_int(0); return KVC_OK;
        default:
            return kvc__chat_runtime_error(n, "object of type '%s' has no len()",
                                           kvc__chat_type_name(&x));
        }
    }
    if (str_eq(f, "first") || str_eq(f, "last")) {
        value items;
        KVC_TRY(kvc__chat_iter_items(c, n, &x, &items));
        *out = items.u.l->n ? items.u.l->items[f.p[0] == 'f' ? 0 : items.u.l->n - 1] : v_undef();
        return KVC_OK;
    }
    if (str_eq(f, "list")) {
        KVC_TRY(kvc__chat_iter_items(c, n, &x, out));
        if (out->t == V_LIST && out->u.l->is_tuple) { /* list(pair) is a list */
            value l;
            KVC_TRY(kvc__chat_new_list(c, out->u.l->n, &l));
            for (size_t i = 0; i < out->u.l->n; i++)
                KVC_TRY(kvc__chat_list_push(c, l.u.l, out->u.l->items[i]));
            *out = l;
        }
        return KVC_OK;
    }
    if (str_eq(f, "safe")) {
        *out = x;
        return KVC_OK;
    }
    if (str_eq(f, "join")) {
        value items;
        str sep = {"", 0};
        const value *d = arg(&a, 0, "d");
        if (d) KVC_TRY(kvc__chat_to_str(c, d, &sep));
        KVC_TRY(kvc__chat_iter_items(c, n, &x, &items));
        sbuf b = {NULL, 0, 0};
        for (size_t i = 0; i < items.u.l->n; i++) {
            str e;
            if (i) KVC_TRY(kvc__chat_sb_put(c, &b, sep.p, sep.n));
            KVC_TRY(kvc__chat_to_str(c, &items.u.l->items[i], &e));
            KVC_TRY(kvc__chat_sb_put(c, &b, e.p, e.n));
        }
        *out = v_str(b.p ? b.p : "", b.n);
        return KVC_OK;
    }
    if (str_eq(f, "reverse")) {
        value items, res;
        KVC_TRY(kvc__chat_iter_items(c, n, &x, &items));
        KVC_TRY(kvc__chat_new_list(c, items.u.l->n, &res));
        for (size_t i = items.u.l->n; i-- > 0;)
            KVC_TRY(kvc__chat_list_push(c, res.u.l, items.u.l->items[i]));
        if (x.t != V_STR) {
            *out = res;
            return KVC_OK;
        }
        sbuf b = {NULL, 0, 0};
        for (size_t i = 0; i < res.u.l->n; i++)
            KVC_TRY(kvc__chat_sb_put(c, &b, res.u.l->items[i].u.s.p, res.u.l->items[i].u.s.n));
        *out = v_str(b.p ? b.p : "", b.n);
        return KVC_OK;
    }
    if (str_eq(f, "int")) {
        if (is_num(&x)) {
            *out = v_int(x.u.i);
            return KVC_OK;
        }
        const value *d = arg(&a, 0, "default");
        *out = d ? *d : v_int(0);
        if (x.t == V_STR) { /* Python int(): optional sign, digits, surrounding spaces */
            KVC_TRY(charge(c, x.u.s.n));
            str t = kvc__chat_strip_str(x.u.s, 1, 1);
            size_t i = 0;
            int neg = 0;
            if (i < t.n && (t.p[i] == '+' || t.p[i] == '-')) neg = t.p[i++] == '-';
            int64_t v = 0;
            size_t digits = 0;
            for (; i < t.n && t.p[i] >= '0' && t.p[i] <= '9' && v < INT64_MAX / 10 - 9;
                 i++, digits++)
                v = v * 10 + (t.p[i] - '0');
            if (digits && i == t.n) *out = v_int(neg ? -v : v);
        }
        return KVC_OK;
    }
    /* The rest work on str(x). */
    KVC_TRY(kvc__chat_to_str(c, &x, &s));
    if (str_eq(f, "string")) {
        *out = v_str(s.p, s.n);
        return KVC_OK;
    }
    if (str_eq(f, "trim")) {
        const value *ch = arg(&a, 0, "chars");
        str chars = {NULL, 0};
        if (ch && ch->t != V_NONE) KVC_TRY(want_str(n, ch, "trim() chars", &chars));
        str r;
        KVC_TRY(kvc__chat_strip_chars(c, s, ch && ch->t != V_NONE ? &chars : NULL, 1, 1, &r));
        *out = v_str(r.p, r.n);
        return KVC_OK;
    }
    if (str_eq(f, "upper")) return kvc__chat_map_case(c, s, 'u', out);
    if (str_eq(f, "lower")) return kvc__chat_map_case(c, s, 'l', out);
    if (str_eq(f, "capitalize")) return kvc__chat_map_case(c, s, 'c', out);
    if (str_eq(f, "title")) return kvc__chat_map_case(c, s, 't', out);
    /* replace */
    str old = {NULL, 0}, rep = {NULL, 0};
    KVC_TRY(want_str(n, arg(&a, 0, "old"), "replace() old", &old));
    KVC_TRY(want_str(n, arg(&a, 1, "new"), "replace() new", &rep));
    const value *cnt = arg(&a, 2, "count");
    if (cnt && cnt->t != V_NONE && !is_num(cnt))
        return kvc__chat_runtime_error(n, "count must be an integer");
    return kvc__chat_str_replace(c, n, s, old, rep, cnt && cnt->t != V_NONE ? cnt->u.i : -1, out);
}

static kvc_status eval_test(ctx *c, const node *n, value *out) {
    value x;
    KVC_TRY(kvc__chat_eval(c, n->a, &x));
    str t = n->name;
    int r;
    if (str_eq(t, "defined"))
        r = x.t != V_UNDEF;
    else if (str_eq(t, "undefined"))
        r = x.t == V_UNDEF;
    else if (str_eq(t, "none"))
        r = x.t == V_NONE;
    else if (str_eq(t, "string"))
        r = x.t == V_STR;
    else if (str_eq(t, "number"))
        r = is_num(&x);
    else if (str_eq(t, "integer"))
        r = x.t == V_INT;
    else if (str_eq(t, "boolean"))
        r = x.t == V_BOOL;
    else if (str_eq(t, "true"))
        r = x.t == V_BOOL && x.u.i;
    else if (str_eq(t, "false"))
        r = x.t == V_BOOL && !x.u.i;
    else if (str_eq(t, "mapping"))
        r = x.t == V_DICT;
    else if (str_eq(t, "sequence") || str_eq(t, "iterable")) /* Undefined: empty, as jinja2 */
        r = x.t == V_STR || x.t == V_LIST || x.t == V_DICT || x.t == V_UNDEF;
    else { /* even / odd */
        if (!is_num(&x))
            return kvc__chat_runtime_error(n, "'%.*s' test needs an integer", (int)t.n, t.p);
        r = (x.u.i % 2 != 0) == str_eq(t, "odd");
    }
    *out = v_bool(n->neg ? !r : r);
    return KVC_OK;
}

static kvc_status arith(ctx *c, const node *n, const value *a, const value *b, value *out) {
    char op = n->name.p[0];
    int floor_div = str_eq(n->name, "//");
    if (op == '~') {
        str x = {NULL, 0}, y = {NULL, 0};
        KVC_TRY(kvc__chat_to_str(c, a, &x));
        KVC_TRY(kvc__chat_to_str(c, b, &y));
        return kvc__chat_concat(c, x, y, out);
    }
    if (a->t == V_UNDEF || b->t == V_UNDEF) return undefined_error(a->t == V_UNDEF ? n->a : n->b);
    if (op == '+' && a->t == V_STR && b->t == V_STR)
        return kvc__chat_concat(c, a->u.s, b->u.s, out);
    if (op == '+' && a->t == V_LIST && b->t == V_LIST) {
        KVC_TRY(kvc__chat_new_list(c, a->u.l->n + b->u.l->n, out));
        for (size_t i = 0; i < a->u.l->n; i++)
            KVC_TRY(kvc__chat_list_push(c, out->u.l, a->u.l->items[i]));
        for (size_t i = 0; i < b->u.l->n; i++)
            KVC_TRY(kvc__chat_list_push(c, out->u.l, b->u.l->items[i]));
        return KVC_OK;
    }
    if (op == '*' && ((a->t == V_STR && is_num(b)) || (is_num(a) && b->t == V_STR))) {
        str s = a->t == V_STR ? a->u.s : b->u.s;
        int64_t k = a->t == V_STR ? b->u.i : a->u.i;
        if (k <= 0 || s.n == 0) { /* '' * 10**18 must not loop 10**18 times */
            *out = v_str("", 0);
            return KVC_OK;
        }
        if ((uint64_t)k > MAX_BYTES / s.n) return kvc__chat_nomem();
        sbuf buf = {NULL, 0, 0};
        for (int64_t i = 0; i < k; i++) KVC_TRY(kvc__chat_sb_put(c, &buf, s.p, s.n));
        *out = v_str(buf.p ? buf.p : "", buf.n);
        return KVC_OK;
    }
    if (!is_num(a) || !is_num(b))
        return kvc__chat_runtime_error(n, "unsupported operand types for %.*s: '%s' and '%s'",
                                       (int)n->name.n, n->name.p, kvc__chat_type_name(a),
                                       kvc__chat_type_name(b));
    int64_t x = a->u.i, y = b->u.i, r;
    int ovf = 0;
    switch (op) {
    case '+':
        ovf = (y > 0 && x > INT64_MAX - y) || (y < 0 && x < INT64_MIN - y);
        r = ovf ? 0 : x + y;
        break;
    case '-':
        ovf = (y < 0 && x > INT64_MAX + y) || (y > 0 && x < INT64_MIN + y);
        r = ovf ? 0 : x - y;
        break;
    case '*': /* CERT INT32-C's pre-check, without the undefined multiply */
        ovf = x > 0 ? (y > 0 ? x > INT64_MAX / y : y < INT64_MIN / x)
                    : (y > 0 ? x < INT64_MIN / y : x != 0 && y < INT64_MAX / x);
        r = ovf ? 0 : x * y;
        break;
    default: /* // and %, Python's floor semantics */
        if (y == 0) return kvc__chat_runtime_error(n, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) {
            ovf = 1;
            r = 0;
            break;
        }
        r = x / y;
        if (x % y != 0 && ((x < 0) != (y < 0))) r--;
        if (!floor_div) r = x - r * y;
    }
    if (ovf) return kvc__chat_runtime_error(n, "integer overflow");
    *out = v_int(r);
    return KVC_OK;
}

static kvc_status contains(ctx *c, const node *n, const value *x, const value *coll, int *r) {
    if (coll->t == V_STR) {
        if (x->t != V_STR)
            return kvc__chat_runtime_error(n, "'in <string>' requires a string on the left");
        KVC_TRY(charge(c, coll->u.s.n));
        *r = kvc__chat_find_sub(coll->u.s, x->u.s, 0) != NULL;
    } else if (coll->t == V_LIST) {
        KVC_TRY(charge(c, (cost_of(x) + 1) * coll->u.l->n));
        *r = 0;
        for (size_t i = 0; i < coll->u.l->n && !*r; i++)
            *r = kvc__chat_values_equal(x, &coll->u.l->items[i]);
    } else if (coll->t == V_DICT) {
        KVC_TRY(charge(c, cost_of(x)));
        *r = x->t == V_STR && kvc__chat_dict_find(coll->u.d, x->u.s) != NULL;
    } else if (coll->t == V_UNDEF) {
        *r = 0; /* iterating an undefined value gives nothing */
    } else {
        return kvc__chat_runtime_error(n, "argument of type '%s' is not iterable",
                                       kvc__chat_type_name(coll));
    }
    return KVC_OK;
}

static kvc_status eval_cmp(ctx *c, const node *n, value *out) {
    value left;
    KVC_TRY(kvc__chat_eval(c, n->a, &left));
    for (size_t i = 0; i < n->nv; i++) {
        value right;
        KVC_TRY(kvc__chat_eval(c, n->v[i], &right));
        str op = n->names[i];
        int r = 0;
        KVC_TRY(charge(c, cost_of(&left) + cost_of(&right)));
        if (str_eq(op, "=="))
            r = kvc__chat_values_equal(&left, &right);
        else if (str_eq(op, "!="))
            r = !kvc__chat_values_equal(&left, &right);
        else if (str_eq(op, "in") || str_eq(op, "not in")) {
            KVC_TRY(contains(c, n, &left, &right, &r));
            if (op.p[0] == 'n') r = !r;
        } else {
            int cmp = 0;
            KVC_TRY(kvc__chat_order(n, &left, &right, &cmp));
            r = str_eq(op, "<")    ? cmp < 0
                : str_eq(op, ">")  ? cmp > 0
                : str_eq(op, "<=") ? cmp <= 0
                                   : cmp >= 0;
        }
        if (!r) {
            *out = v_bool(0);
            return KVC_OK;
        }
        left = right;
    }
    *out = v_bool(1);
    return KVC_OK;
}

static kvc_status eval_node(ctx *c, const node *n, value *out);

/* The parser bounds bracket nesting, but attribute, subscript, filter and
 * operator chains build trees as deep as they are long (a 100k-link chain
 * overflowed the stack): evaluation depth is bounded here. */
static kvc_status kvc__chat_eval(ctx *c, const node *n, value *out) {
    c->cur = n;
    if (c->eval_depth >= MAX_EVAL_DEPTH)
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: expression nested too deeply (chains of more "
                          "than %d links)", n->line, MAX_EVAL_DEPTH);
    c->eval_depth++;
    const kvc_status st = eval_node(c, n, out);
    c->eval_depth--;
    return st;
}

static kvc_status eval_node(ctx *c, const node *n, value *out) {
    value a, b;
    switch (n->k) {
    case E_LIT: *out = n->lit; return KVC_OK;
    case E_NAME: kvc__chat_lookup(c, n->name, out); return KVC_OK;
    case E_ATTR: KVC_TRY(kvc__chat_eval(c, n->a, &a)); return get_attr(n, &a, n->name, out);
    case E_INDEX:
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        KVC_TRY(kvc__chat_eval(c, n->b, &b));
        return get_item(c, n, &a, &b, out);
    case E_SLICE: return eval_slice(c, n, out);
    case E_CALL: return eval_call(c, n, out);
    case E_FILTER: return eval_filter(c, n, out);
    case E_TEST: return eval_test(c, n, out);
    case E_NEG:
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        if (!is_num(&a))
            return kvc__chat_runtime_error(n, "bad operand type for unary -: '%s'",
                                           kvc__chat_type_name(&a));
        if (a.u.i == INT64_MIN) return kvc__chat_runtime_error(n, "integer overflow");
        *out = v_int(-a.u.i);
        return KVC_OK;
    case E_POS:
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        if (!is_num(&a))
            return kvc__chat_runtime_error(n, "bad operand type for unary +: '%s'",
                                           kvc__chat_type_name(&a));
        *out = v_int(a.u.i);
        return KVC_OK;
    case E_NOT:
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        *out = v_bool(!truthy(&a));
        return KVC_OK;
    case E_AND: /* Python: the deciding operand itself */
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        if (!truthy(&a)) {
            *out = a;
            return KVC_OK;
        }
        return kvc__chat_eval(c, n->b, out);
    case E_OR:
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        if (truthy(&a)) {
            *out = a;
            return KVC_OK;
        }
        return kvc__chat_eval(c, n->b, out);
    case E_BIN:
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        KVC_TRY(kvc__chat_eval(c, n->b, &b));
        return arith(c, n, &a, &b, out);
    case E_CMP: return eval_cmp(c, n, out);
    case E_COND:
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        if (truthy(&a)) return kvc__chat_eval(c, n->b, out);
        if (n->c) return kvc__chat_eval(c, n->c, out);
        *out = v_undef();
        return KVC_OK;
    case E_LIST:
        KVC_TRY(kvc__chat_new_list(c, n->nv, out));
        for (size_t i = 0; i < n->nv; i++) {
            KVC_TRY(kvc__chat_eval(c, n->v[i], &a));
            KVC_TRY(kvc__chat_list_push(c, out->u.l, a));
        }
        return KVC_OK;
    case E_DICT:
        KVC_TRY(kvc__chat_new_dict(c, n->nv, out));
        for (size_t i = 0; i < n->nv; i++) {
            KVC_TRY(kvc__chat_eval(c, n->v[i], &a));
            KVC_TRY(kvc__chat_eval(c, n->w[i], &b));
            if (a.t != V_STR)
                return kvc__chat_runtime_error(n, "only string dictionary keys are supported");
            KVC_TRY(kvc__chat_dict_set(c, out->u.d, a.u.s, b));
        }
        return KVC_OK;
    default:
        return kvc__error(KVC_ERR_INTERNAL, "chat template: bad expression node %d", (int)n->k);
    }
}

/* ---- statements ----------------------------------------------------------------- */

static kvc_status out_put(ctx *c, const char *p, size_t n) {
    if (c->out_n + n > c->out_cap) {
        if (c->out_n + n > MAX_BYTES)
            return kvc__error(KVC_ERR_INVALID_ARG, "chat template: output exceeds %zu MiB",
                              MAX_BYTES >> 20);
        size_t cap = c->out_cap ? c->out_cap : 4096;
        while (cap < c->out_n + n) cap *= 2;
        char *q = realloc(c->out, cap);
        if (!q) return kvc__chat_nomem();
        c->out = q;
        c->out_cap = cap;
    }
    if (n) memcpy(c->out + c->out_n, p, n);
    c->out_n += n;
    return KVC_OK;
}

static kvc_status exec(ctx *c, const node *n);

static kvc_status exec_for(ctx *c, const node *n) {
    value iter, items;
    KVC_TRY(kvc__chat_eval(c, n->a, &iter));
    KVC_TRY(kvc__chat_iter_items(c, n, &iter, &items));
    if (c->n_frames >= MAX_DEPTH + 1) return kvc__chat_runtime_error(n, "loops nested too deeply");
    frame *fr = &c->frames[c->n_frames++];
    fr->n = 0;
    list *all = items.u.l;
    kvc_status st = KVC_OK;
    if (n->d) { /* `for x in xs if cond`: loop over the items that pass */
        value kept;
        st = kvc__chat_new_list(c, all->n, &kept);
        for (size_t i = 0; st == KVC_OK && i < all->n; i++) {
            fr->n = 0;
            value ok;
            st = kvc__chat_set_var(c, n->names[0], all->items[i]);
            if (st == KVC_OK && n->nnames > 1)
                st = kvc__chat_runtime_error(n,
                                             "tuple targets with a loop filter are not supported");
            if (st == KVC_OK) st = kvc__chat_eval(c, n->d, &ok);
            if (st == KVC_OK && truthy(&ok)) st = kvc__chat_list_push(c, kept.u.l, all->items[i]);
        }
        if (st == KVC_OK) all = kept.u.l;
    }
    value loop;
    if (st == KVC_OK) st = kvc__chat_new_dict(c, 10, &loop);
    int64_t len = (int64_t)all->n;
    for (int64_t i = 0; st == KVC_OK && i < len; i++) {
        if (++c->steps > MAX_STEPS) {
            st = kvc__chat_runtime_error(n, "more than %lld loop iterations", (long long)MAX_STEPS);
            break;
        }
        fr->n = 0; /* every iteration starts a fresh scope, as in Jinja */
        value item = all->items[i];
        if (n->nnames == 1) {
            st = kvc__chat_set_var(c, n->names[0], item);
        } else { /* for a, b in pairs */
            value parts = item;
            if (item.t == V_STR) st = kvc__chat_str_chars(c, item.u.s, &parts);
            if (st == KVC_OK && (parts.t != V_LIST || parts.u.l->n != n->nnames))
                st = kvc__chat_runtime_error(n, "cannot unpack a %s into %zu names",
                                             kvc__chat_type_name(&item), n->nnames);
            for (size_t k = 0; st == KVC_OK && k < n->nnames; k++)
                st = kvc__chat_set_var(c, n->names[k], parts.u.l->items[k]);
        }
        dict *d = loop.u.d;
        d->n = 0;
        if (st == KVC_OK) st = kvc__chat_dict_set(c, d, cstr("index"), v_int(i + 1));
        if (st == KVC_OK) st = kvc__chat_dict_set(c, d, cstr("index0"), v_int(i));
        if (st == KVC_OK) st = kvc__chat_dict_set(c, d, cstr("revindex"), v_int(len - i));
        if (st == KVC_OK) st = kvc__chat_dict_set(c, d, cstr("revindex0"), v_int(len - i - 1));
        if (st == KVC_OK) st = kvc__chat_dict_set(c, d, cstr("first"), v_bool(i == 0));
        if (st == KVC_OK) st = kvc__chat_dict_set(c, d, cstr("last"), v_bool(i == len - 1));
        if (st == KVC_OK) st = kvc__chat_dict_set(c, d, cstr("length"), v_int(len));
        if (st == KVC_OK)
            st = kvc__chat_dict_set(c, d, cstr("previtem"), i > 0 ? all->items[i - 1] : v_undef());
        if (st == KVC_OK)
            st = kvc__chat_dict_set(c, d, cstr("nextitem"),
                                    i + 1 < len ? all->items[i + 1] : v_undef());
        if (st == KVC_OK) st = kvc__chat_set_var(c, cstr("loop"), loop);
        if (st == KVC_OK) st = exec(c, n->b);
        if (c->loop_ctl == 1) {
            c->loop_ctl = 0;
            break;
        }
        c->loop_ctl = 0;
    }
    c->n_frames--;
    if (st == KVC_OK && len == 0 && n->c) st = exec(c, n->c);
    return st;
}

static kvc_status exec(ctx *c, const node *n) {
    value v;
    c->cur = n;
    switch (n->k) {
    case S_BLOCK:
        for (size_t i = 0; i < n->nv && !c->loop_ctl; i++) KVC_TRY(exec(c, n->v[i]));
        return KVC_OK;
    case S_TEXT: return out_put(c, n->name.p, n->name.n);
    case S_OUT: {
        str s;
        KVC_TRY(kvc__chat_eval(c, n->a, &v));
        KVC_TRY(kvc__chat_to_str(c, &v, &s));
        return out_put(c, s.p, s.n);
    }
    case S_IF:
        KVC_TRY(kvc__chat_eval(c, n->a, &v));
        if (truthy(&v)) return exec(c, n->b);
        return n->c ? exec(c, n->c) : KVC_OK;
    case S_FOR: return exec_for(c, n);
    case S_SET: KVC_TRY(kvc__chat_eval(c, n->a, &v)); return kvc__chat_set_var(c, n->name, v);
    case S_SETATTR: {
        value ns;
        kvc__chat_lookup(c, n->name, &ns);
        if (ns.t != V_DICT || !ns.u.d->is_namespace)
            return kvc__chat_runtime_error(
                n, "cannot assign attribute on a %s (only on a namespace())",
                kvc__chat_type_name(&ns));
        KVC_TRY(kvc__chat_eval(c, n->a, &v));
        return kvc__chat_dict_set(c, ns.u.d, n->attr, v);
    }
    case S_SETBLOCK: { /* render the body, then take it back out of the output */
        size_t mark = c->out_n;
        KVC_TRY(exec(c, n->b));
        char *p;
        ALLOC(c, p, c->out_n - mark + 1);
        if (c->out_n > mark) memcpy(p, c->out + mark, c->out_n - mark); /* out may be NULL */
        v = v_str(p, c->out_n - mark);
        c->out_n = mark;
        return kvc__chat_set_var(c, n->name, v);
    }
    case S_BREAK:
    case S_CONTINUE:
        if (c->n_frames < 2)
            return kvc__chat_runtime_error(n, "'break' / 'continue' outside a loop");
        c->loop_ctl = n->k == S_BREAK ? 1 : 2;
        return KVC_OK;
    default: return kvc__error(KVC_ERR_INTERNAL, "chat template: bad statement node %d", (int)n->k);
    }
}

/* ---- entry point ------------------------------------------------------------------ */

/* Copies the template with Jinja's newline handling: \r\n and \r become \n,
 * and one trailing newline is dropped (keep_trailing_newline=False). */
static kvc_status normalise(ctx *c, const char *t, size_t n) {
    ALLOC(c, c->src, n + 1);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (t[i] == '\r') {
            c->src[k++] = '\n';
            if (i + 1 < n && t[i + 1] == '\n') i++;
        } else {
            c->src[k++] = t[i];
        }
    }
    if (k && c->src[k - 1] == '\n') k--;
    c->src[k] = 0;
    c->src_n = k;
    return KVC_OK;
}

static kvc_status token_value(const kvc_tokenizer *t, int32_t id, value *out) {
    size_t n = 0;
    const char *p = id >= 0 ? kvc__tokenizer_piece(t, id, &n) : NULL;
    *out = p ? v_str(p, n) : v_str("", 0);
    return KVC_OK;
}

static kvc_status render(ctx *c, const char *tmpl, size_t tmpl_n, const kvc_tokenizer *t,
                         const kvc_chat_message *messages, int64_t n_messages, int add_gen) {
    KVC_TRY(normalise(c, tmpl, tmpl_n));
    KVC_TRY(kvc__chat_lex(c));
    node *root;
    int which = 0;
    KVC_TRY(kvc__chat_parse_block(c, NULL, 0, &root, &which));
    KVC_TRY(kvc__chat_new_list(c, (size_t)n_messages, &c->messages));
    for (int64_t i = 0; i < n_messages; i++) {
        value m;
        KVC_TRY(kvc__chat_new_dict(c, 2, &m));
        const kvc_chat_message *msg = &messages[i];
        KVC_TRY(
            kvc__chat_dict_set(c, m.u.d, cstr("role"), msg->role ? v_cstr(msg->role) : v_none()));
        KVC_TRY(kvc__chat_dict_set(c, m.u.d, cstr("content"),
                                   msg->content ? v_cstr(msg->content) : v_none()));
        KVC_TRY(kvc__chat_list_push(c, c->messages.u.l, m));
    }
    c->add_generation_prompt = v_bool(add_gen);
    KVC_TRY(token_value(t, t ? kvc_tokenizer_bos(t) : -1, &c->bos_token));
    KVC_TRY(token_value(t, t ? kvc_tokenizer_eos(t) : -1, &c->eos_token));
    c->n_frames = 1;
    return exec(c, root);
}

kvc_status kvc_chat_apply_template(const kvc_tokenizer *t, const char *template_str,
                                   const kvc_chat_message *messages, int64_t n_messages,
                                   int add_generation_prompt, char *buf, size_t cap, size_t *len) {
    KVC_CHECK(len != NULL, "kvc_chat_apply_template: len is NULL");
    KVC_CHECK(n_messages >= 0, "kvc_chat_apply_template: n_messages is %lld",
              (long long)n_messages);
    KVC_CHECK(messages != NULL || n_messages == 0, "kvc_chat_apply_template: messages is NULL");
    KVC_CHECK(n_messages <= 10000000, "kvc_chat_apply_template: %lld messages is too many",
              (long long)n_messages);
    KVC_CHECK(buf != NULL || cap == 0, "kvc_chat_apply_template: buf is NULL with cap %zu", cap);
    KVC_CHECK(template_str != NULL || t != NULL,
              "kvc_chat_apply_template: no template and no tokenizer to take one from");
    size_t tmpl_n;
    const char *tmpl = template_str;
    if (tmpl) {
        tmpl_n = strlen(tmpl);
    } else {
        tmpl = kvc__tokenizer_chat_template(t, &tmpl_n);
        if (!tmpl)
            return kvc__error(KVC_ERR_NOT_FOUND, "kvc_chat_apply_template: the model has no "
                                                 "tokenizer.chat_template; pass a template");
    }
    ctx *c = calloc(1, sizeof *c);
    if (!c) return kvc__chat_nomem();
    kvc_status st = render(c, tmpl, tmpl_n, t, messages, n_messages, add_generation_prompt);
    if (st == KVC_OK && c->loop_ctl)
        st = kvc__error(KVC_ERR_INTERNAL, "chat template: stray break");
    if (st == KVC_OK) {
        *len = c->out_n;
        if (c->out_n > cap)
            st = kvc__error(KVC_ERR_NO_SPACE,
                            "kvc_chat_apply_template: the prompt is %zu bytes, "
                            "cap is %zu",
                            c->out_n, cap);
        else if (c->out_n)
            memcpy(buf, c->out, c->out_n);
    }
    free(c->out);
    kvc__chat_arena_free(&c->ar);
    free(c);
    return st;
}
