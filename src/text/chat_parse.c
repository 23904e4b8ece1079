/* Chat templates (see chat.c): the recursive-descent parser from tokens to an
 * AST (Jinja's grammar and precedence, for the supported subset). */
#include <stdio.h>
#include <string.h>

#include "chat_internal.h"

/* ---- AST ---------------------------------------------------------------------- */

static kvc_status new_node(ctx *c, nkind k, node **out) {
    node *n;
    ALLOC(c, n, 1);
    memset(n, 0, sizeof *n);
    n->k = k;
    n->line = c->toks[c->pos < c->n_toks ? c->pos : c->n_toks - 1].line;
    n->tok = c->pos;
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
        node *x = NULL;
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
    } else if (t->k == T_FLOAT) { /* refused only if evaluated: dead branches may hold one */
        KVC_TRY(new_node(c, E_UNSUP, &n));
        n->name.p = "float literals are";
        n->name.n = strlen(n->name.p);
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
            if (str_eq(t->s, "varargs") || str_eq(t->s, "kwargs") || str_eq(t->s, "caller"))
                c->macro_special = 1; /* jinja2 changes a macro's signature for these */
        }
        c->pos++;
    } else if (is_op(t, "(")) {
        c->pos++;
        int empty = is_op(peek(c), ")"); /* () */
        if (!empty) KVC_TRY(parse_expr(c, &n));
        if (empty || is_op(peek(c), ",")) { /* a tuple: refused if evaluated */
            while (is_op(peek(c), ",")) {
                c->pos++;
                if (is_op(peek(c), ")")) break;
                node *x;
                KVC_TRY(parse_expr(c, &x));
            }
            KVC_TRY(new_node(c, E_UNSUP, &n));
            n->name.p = "tuples are";
            n->name.n = strlen(n->name.p);
        }
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

/* A filter or test name jinja2 does not know (see node.unknown). */
static kvc_status mark_unknown(ctx *c, node *n) {
    n->unknown = 1;
    n->soft = c->soft;
    return push_node(c, &c->unknown, &c->n_unknown, n);
}

/* Filters `| name(args)` and tests `is [not] name(args)` after a unary. */
static kvc_status parse_filter_expr(ctx *c, node **io) {
    for (;;) {
        node *n;
        if (is_op(peek(c), "|")) {
            c->pos++;
            KVC_TRY(new_node(c, E_FILTER, &n));
            KVC_TRY(expect_name(c, &n->name));
            if (!kvc__chat_filter_known(n->name)) KVC_TRY(mark_unknown(c, n));
            if (is_op(peek(c), "(")) KVC_TRY(parse_args(c, n));
        } else if (is_name(peek(c), "is")) {
            c->pos++;
            KVC_TRY(new_node(c, E_TEST, &n));
            if (is_name(peek(c), "not")) {
                n->neg = 1;
                c->pos++;
            }
            KVC_TRY(expect_name(c, &n->name));
            if (str_eq(n->name, "None")) n->name.p = "none"; /* the parser's constants */
            if (str_eq(n->name, "True")) n->name.p = "true";
            if (str_eq(n->name, "False")) n->name.p = "false";
            if (!kvc__chat_test_known(n->name)) KVC_TRY(mark_unknown(c, n));
            if (is_op(peek(c), "(")) {
                KVC_TRY(parse_args(c, n));
            } else { /* one argument without parentheses, as jinja2 reads it */
                token *t = peek(c);
                if ((t->k == T_NAME && !is_name(t, "else") && !is_name(t, "or") &&
                     !is_name(t, "and")) ||
                    t->k == T_STRING || t->k == T_INT || t->k == T_FLOAT || is_op(t, "[") ||
                    is_op(t, "{")) {
                    node *x;
                    if (++c->depth > MAX_DEPTH)
                        return kvc__chat_syntax_error(c, t, "expression nested too deeply");
                    KVC_TRY(parse_primary(c, &x));
                    KVC_TRY(parse_postfix(c, &x));
                    c->depth--;
                    KVC_TRY(push_node(c, &n->v, &n->nv, x));
                }
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
    while (is_op(peek(c), "**")) { /* refused when evaluated */
        c->pos++;
        node *b;
        KVC_TRY(parse_unary(c, 1, &b));
        KVC_TRY(make_bin(c, E_BIN, "**", *out, b, out));
    }
    return KVC_OK;
}

static kvc_status parse_math2(ctx *c, node **out) {
    KVC_TRY(parse_pow(c, out));
    for (;;) {
        token *t = peek(c);
        if (!is_op(t, "*") && !is_op(t, "//") && !is_op(t, "%") && !is_op(t, "/")) return KVC_OK;
        c->pos++;
        node *b;
        KVC_TRY(parse_pow(c, &b));
        KVC_TRY(make_bin(c, E_BIN,
                         is_op(t, "*")    ? "*"
                         : is_op(t, "//") ? "//"
                         : is_op(t, "/")  ? "/" /* refused when evaluated */
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
    size_t start = c->pos;
    int soft = c->soft;
    KVC_TRY(parse_or(c, out));
    while (is_name(peek(c), "if")) {
        c->pos++;
        c->soft = 1; /* jinja2 compiles a conditional expression's three parts softly */
        for (size_t i = c->n_unknown; i-- > 0 && c->unknown[i]->tok >= start;)
            c->unknown[i]->soft = 1;
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
    c->soft = soft;
    c->depth--;
    return KVC_OK;
}

/* ---- parser: statements ------------------------------------------------------- */

static kvc_status end_tag(ctx *c) {
    return expect_kind(c, T_BEND, "'%}'");
}

static kvc_status parse_if(ctx *c, node **out) {
    static const char *const stops[] = {"elif", "else", "endif"};
    node *n = NULL;
    int soft = c->soft;
    c->soft = 1;
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
    c->soft = soft;
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
    if (++c->depth > MAX_DEPTH) return kvc__chat_syntax_error(c, peek(c), "expression nested too deeply");
    KVC_TRY(parse_or(c, &n->a));
    c->depth--;
    int soft = c->soft;
    c->soft = 0; /* the loop has a frame of its own */
    if (is_name(peek(c), "if")) {
        c->pos++;
        KVC_TRY(parse_expr(c, &n->d));
    }
    if (is_name(peek(c), "recursive"))
        return kvc__chat_syntax_error(c, peek(c), "recursive loops are not supported");
    KVC_TRY(end_tag(c));
    int which = 0;
    c->loop_depth++;
    KVC_TRY(kvc__chat_parse_block(c, stops, 2, &n->b, &which));
    c->loop_depth--; /* the else block is outside the loop */
    c->pos++;
    KVC_TRY(end_tag(c));
    if (which == 0) {
        KVC_TRY(kvc__chat_parse_block(c, stops + 1, 1, &n->c, &which));
        c->pos++;
        KVC_TRY(end_tag(c));
    }
    c->soft = soft;
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
        int soft = c->soft;
        c->soft = 0;
        KVC_TRY(kvc__chat_parse_block(c, stops, 1, &n->b, &which));
        c->soft = soft;
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

/* {% macro name(a, b=default, ...) %}body{% endmacro %} */
static kvc_status parse_macro(ctx *c, node **out) {
    static const char *const stops[] = {"endmacro"};
    node *n;
    int which = 0, defaults = 0;
    KVC_TRY(new_node(c, S_MACRO, &n));
    KVC_TRY(expect_name(c, &n->name));
    KVC_TRY(expect_op(c, "("));
    while (!is_op(peek(c), ")")) {
        if (n->nnames) KVC_TRY(expect_op(c, ","));
        str p = {NULL, 0};
        node *d = NULL;
        token *at = peek(c);
        KVC_TRY(expect_name(c, &p));
        for (size_t i = 0; i < n->nnames; i++)
            if (n->names[i].n == p.n && memcmp(n->names[i].p, p.p, p.n) == 0)
                return kvc__chat_syntax_error(c, at, "duplicate argument '%.*s'",
                                              (int)(p.n < 40 ? p.n : 40), p.p);
        if (is_op(peek(c), "=")) {
            c->pos++;
            KVC_TRY(parse_expr(c, &d));
            defaults = 1;
        } else if (defaults) {
            return kvc__chat_syntax_error(c, at, "non-default argument follows default argument");
        }
        KVC_TRY(push_str(c, &n->names, &n->nnames, p));
        KVC_TRY(push_node(c, &n->w, &n->nw, d));
    }
    c->pos++;
    KVC_TRY(end_tag(c));
    int loop_depth = c->loop_depth, special = c->macro_special, soft = c->soft;
    c->loop_depth = 0; /* break / continue cannot leave the macro */
    c->macro_special = 0;
    c->soft = 0;
    KVC_TRY(kvc__chat_parse_block(c, stops, 1, &n->b, &which));
    n->neg = c->macro_special;
    c->loop_depth = loop_depth;
    c->macro_special = special;
    c->soft = soft;
    c->pos++;
    KVC_TRY(end_tag(c));
    KVC_TRY(push_str(c, &c->macro_names, &c->n_macro_names, n->name));
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
    if (str_eq(t->s, "macro")) return parse_macro(c, out);
    if (str_eq(t->s, "break") || str_eq(t->s, "continue")) {
        if (c->loop_depth == 0) /* jinja2 refuses the template, even if never run there */
            return kvc__chat_syntax_error(c, t, "'%.*s' outside a loop", (int)t->s.n, t->s.p);
        KVC_TRY(new_node(c, str_eq(t->s, "break") ? S_BREAK : S_CONTINUE, out));
        return end_tag(c);
    }
    if (str_eq(t->s, "generation")) { /* transformers' assistant-mask marker: transparent */
        static const char *const stops[] = {"endgeneration"};
        int which = 0, soft = c->soft;
        KVC_TRY(end_tag(c));
        c->soft = 0; /* a scope of its own */
        KVC_TRY(kvc__chat_parse_block(c, stops, 1, out, &which));
        c->soft = soft;
        c->pos++;
        return end_tag(c);
    }
    return kvc__chat_syntax_error(c, t, "statement '%.*s' is not supported",
                                  (int)(t->s.n < 40 ? t->s.n : 40), t->s.p);
}

kvc_status kvc__chat_parse_block(ctx *c, const char *const *stop, int n_stop, node **out,
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
                                    str_eq(kw->s, "endset") || str_eq(kw->s, "endgeneration") ||
                                    str_eq(kw->s, "endmacro")))
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
