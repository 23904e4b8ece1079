/*
 * Internal to the chat-template interpreter (see chat.c): the types all its
 * parts share and the functions they call across files. Nothing here is
 * exported: the shared functions carry the library's kvc__ prefix and
 * hidden visibility. chat_lex.c turns the source into tokens, chat_parse.c
 * tokens into an AST, chat_eval.c evaluates expressions over the values and
 * helpers of chat_value.c, and chat.c runs the statements.
 */
#ifndef KVC_MODEL_CHAT_INTERNAL_H
#define KVC_MODEL_CHAT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"
#include "unicode.h"

#define MAX_DEPTH 200                         /* parser / evaluator nesting */
#define MAX_EVAL_DEPTH 1000                   /* expression tree depth when evaluated */
/* The caps below can be lowered at compile time: the fuzz target
 * (tests/fuzz_chat.c) builds these files with smaller ones so every input
 * runs in milliseconds under the sanitizers. */
#ifndef KVC_CHAT_MAX_BYTES
#define KVC_CHAT_MAX_BYTES ((size_t)256 << 20)
#endif
#ifndef KVC_CHAT_MAX_STEPS
#define KVC_CHAT_MAX_STEPS ((int64_t)50 * 1000 * 1000)
#endif
#ifndef KVC_CHAT_MAX_WORK
#define KVC_CHAT_MAX_WORK ((int64_t)4 << 30)
#endif
#define MAX_BYTES KVC_CHAT_MAX_BYTES /* arena and output, each */
#define MAX_STEPS KVC_CHAT_MAX_STEPS /* loop iterations, all loops */
#define MAX_WORK KVC_CHAT_MAX_WORK   /* bytes searched, stripped, split, copied: a few s */

/* ---- arena ------------------------------------------------------------------ */

typedef struct chunk {
    struct chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
} chunk;

typedef struct arena {
    chunk *head;
    size_t total;
    int over; /* an allocation was refused for passing MAX_BYTES */
} arena;

/* 16-byte aligned n bytes that live until kvc__chat_arena_free, or NULL (out
 * of memory, or the arena would pass MAX_BYTES). Inline: every token, node,
 * value and string is allocated here. */
static inline void *kvc__chat_arena_alloc(arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->total + cap > MAX_BYTES) {
            a->over = 1;
            return NULL;
        }
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

void kvc__chat_arena_free(arena *a);

/* ---- values ----------------------------------------------------------------- */

typedef enum vtype {
    V_UNDEF,
    V_NONE,
    V_BOOL,
    V_INT,
    V_STR,
    V_LIST,
    V_DICT,
    V_FUNC,
    V_MACRO,
    V_LOOP /* a for loop's `loop` (jinja2's LoopContext) */
} vtype;

/* F_METHOD: a method of a str, list or dict taken as a value (d.items without a
 * call), as jinja2's attribute lookup finds it: defined, truthy and callable. */
typedef enum builtin { F_RAISE, F_NAMESPACE, F_RANGE, F_STRFTIME, F_METHOD } builtin;

typedef struct node node;

/* A macro as a value: its {% macro %} node and the scopes it sees (the
 * frames below `depth` that were live where it was defined; `serial` is the
 * serial of the innermost of them, to tell it from a later frame at the
 * same depth). */
typedef struct macro_ref {
    const node *def;
    int depth;
    uint64_t serial;
} macro_ref;

typedef struct str {
    const char *p;
    size_t n;
} str;

typedef struct list list;
typedef struct dict dict;
typedef struct value value;

/* A loop's `if` filter (chat.c): jinja2 runs it as a generator, testing
 * each item when the loop reaches it, so the body can change what it sees. */
typedef struct loop_filter loop_filter;

/* jinja2's LoopContext, one per loop run, updated in place as it advances
 * (a copy kept past the loop sees its last iteration, as in jinja2). Not a
 * dict: it has no items, keys or get, and is not a mapping. */
typedef struct loop_ctx {
    list *items; /* what the loop visits: with an `if` filter, the items that passed so far */
    int64_t index0;
    value *last_changed; /* changed(...)'s previous arguments (NULL: never called) */
    size_t n_changed;
    loop_filter *filter; /* NULL: no filter, or every item tested */
} loop_ctx;

struct value {
    vtype t;
    union {
        int64_t i; /* V_BOOL, V_INT, V_FUNC (builtin) */
        str s;
        list *l;
        dict *d;
        const macro_ref *m; /* V_MACRO */
        loop_ctx *lp;       /* V_LOOP */
    } u;
};

/* What Python object a list stands for. jinja2 hands templates these as
 * they are; kvcache keeps their items in a list and their kind, which
 * decides +, *, subscripts, comparisons, the sequence test and how it prints
 * (dict_keys([...]), range(0, 3)) as Python would. */
typedef enum lkind {
    L_LIST,
    L_TUPLE,  /* an items() pair: prints as (k, v) */
    L_RANGE,  /* range(...) */
    L_KEYS,   /* dict.keys(), dict.values(), dict.items(): views, not */
    L_VALUES, /* subscriptable, no + or * */
    L_ITEMS,
    L_GEN /* what select, map, items, reverse, ... give: a generator or iterator,
           * always true, no len(),
           * iterated once (a second time is refused), printing it is refused */
} lkind;

struct list {
    value *items;
    size_t n, cap;
    lkind kind;
    int consumed; /* L_GEN: iterated */
    int depth;    /* nesting (see MAX_VALUE_DEPTH) */
    int has_ns;   /* holds a namespace, at any depth */
    int64_t start, stop, step; /* L_RANGE: its attributes (and how it prints) */
};

struct dict {
    str *keys;
    value *vals;
    size_t n, cap;
    int is_namespace;
    int depth, has_ns;
};

/* Lists and dicts nest at most this deep when built, and a namespace holds
 * no namespace (so none holds itself): printing, comparing and tojson
 * recurse at most twice this deep (a namespace can deepen after a list
 * took it in). */
#define MAX_VALUE_DEPTH 500

static inline value v_undef(void) {
    value v = {V_UNDEF, {0}};
    return v;
}
static inline value v_none(void) {
    value v = {V_NONE, {0}};
    return v;
}
static inline value v_bool(int b) {
    value v = {V_BOOL, {0}};
    v.u.i = b != 0;
    return v;
}
static inline value v_int(int64_t i) {
    value v = {V_INT, {0}};
    v.u.i = i;
    return v;
}
static inline value v_str(const char *p, size_t n) {
    value v = {V_STR, {0}};
    v.u.s.p = p;
    v.u.s.n = n;
    return v;
}
static inline value v_cstr(const char *p) {
    return v_str(p, strlen(p));
}

static inline int str_eq(str a, const char *b) {
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
    T_FLOAT, /* s: the literal (refused when evaluated) */
    T_OP,    /* s: the operator */
    T_EOF
} tkind;

typedef struct token {
    tkind k;
    str s;
    int64_t i;
    int line;
} token;

/* ---- interpreter state ---------------------------------------------------------- */

typedef struct frame { /* one scope: the top level, a loop iteration, a macro call */
    str *names;
    value *vals;
    size_t n, cap;
    uint64_t serial; /* unique per push (see macro_ref) */
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
    int loop_depth; /* for bodies the parser is in (break / continue need one) */
    int macro_special; /* a macro body being parsed names varargs, kwargs or caller */
    int soft;          /* parsing inside an if statement or a conditional expression */
    node **unknown;    /* the filter / test nodes of names jinja2 does not know */
    size_t n_unknown;
    str *macro_names;  /* every macro the template defines (an undefined one called: */
    size_t n_macro_names; /* an error, not an unknown function) */
    /* evaluation */
    frame frames[MAX_DEPTH + 2];
    int n_frames;
    uint64_t next_serial;
    /* Inside a macro call, lookup sees frames[scope_floor..n_frames) and
     * then the frames below def_depth (where the macro was defined). */
    int scope_floor, def_depth;
    /* Frames [hide_lo, hide_hi) are not seen: a loop's filter, run in a frame
     * of its own on top, does not see the loop's body (0, 0: none hidden). */
    int hide_lo, hide_hi;
    int eval_depth; /* eval recursion: chains (a.b.c, x + y + z, |f|g) nest too */
    char *out;
    size_t out_n, out_cap;
    int64_t steps;
    int64_t work;     /* bytes string operations went through (MAX_WORK) */
    const node *cur;  /* the node being evaluated or executed (error lines) */
    int loop_ctl; /* 1 break, 2 continue, pending */
    loop_filter *left; /* filtered loops left with break, items untested, directly in the
                        * bodies of the macro calls running (chat.c) */
    /* globals */
    value messages, add_generation_prompt, bos_token, eos_token;
    dict *vars; /* kvc_chat_apply_template_json: the context's members (NULL: none); they
                 * come before the functions and the globals above, as render()'s
                 * variables come before jinja2's globals */
} ctx;

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
    S_MACRO, /* name, names: parameters, w: their defaults (NULL: none), b: body,
              * neg: the body names varargs / kwargs / caller */
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
    E_DICT, /* v: keys, w: values */
    E_UNSUP /* name: a construct outside the subset, refused when evaluated */
} nkind;

struct node {
    nkind k;
    int line;
    int neg;  /* E_TEST: `is not` */
    /* E_FILTER / E_TEST of a name jinja2 does not know: jinja2 refuses the
     * template when compiling it, unless the node sits in an if statement or
     * a conditional expression (a "soft" frame; not in a loop, macro or
     * block set inside it), where it fails only when evaluated */
    int unknown, soft;
    size_t tok; /* the parser's token position when the node was made */
    str name; /* names, operators, texts */
    str attr;
    value lit;
    node *a, *b, *c, *d;
    node **v, **w;
    size_t nv, nw;
    str *names;
    size_t nnames;
};

/* ---- errors ------------------------------------------------------------------ */

/* KVC_ERR_UNSUPPORTED "chat template, line N: ..." with the line of token t
 * (NULL: the line the lexer is on). */
kvc_status kvc__chat_syntax_error(ctx *c, const token *t, const char *fmt, ...) KVC_PRINTF(3, 4);

/* KVC_ERR_NOMEM (also for what would pass MAX_BYTES). */
kvc_status kvc__chat_nomem(void);
/* A template past the MAX_BYTES cap (arena, a string or list being built):
 * KVC_ERR_INVALID_ARG with the line, as the other run-time limits. */
kvc_status kvc__chat_over_cap(const ctx *c);
/* What an arena allocation that returned NULL means: the cap, or memory. */
kvc_status kvc__chat_alloc_failed(const ctx *c);

/* KVC_ERR_INVALID_ARG "chat template, line N: ..." with the line of node n (NULL: 0). */
kvc_status kvc__chat_runtime_error(const node *n, const char *fmt, ...) KVC_PRINTF(2, 3);

/* Counts bytes a string operation goes through: a loop of 50 million steps
 * over 100 MB strings would otherwise run for weeks within every cap. */
static inline kvc_status charge(ctx *c, size_t bytes) {
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
        if (!(ptr)) return kvc__chat_alloc_failed(c);                                              \
    } while (0)

/* ---- values, lists, dicts, scopes, strings (chat_value.c) ------------------- */

/* A growable string in the arena (old storage is abandoned on growth). */
typedef struct sbuf {
    char *p;
    size_t n, cap;
} sbuf;

/* Appends p[0..n) to b (charged to MAX_WORK). */
kvc_status kvc__chat_sb_put(ctx *c, sbuf *b, const char *p, size_t n);

/* Python's type name of v, for messages. */
const char *kvc__chat_type_name(const value *v);

/* str(v) as Jinja prints it (undefined prints nothing). */
kvc_status kvc__chat_to_str(ctx *c, const value *v, str *out);

static inline int truthy(const value *v) {
    switch (v->t) {
    case V_BOOL:
    case V_INT: return v->u.i != 0;
    case V_STR: return v->u.s.n != 0;
    case V_LIST: return v->u.l->n != 0 || v->u.l->kind == L_GEN;
    case V_DICT: return v->u.d->n != 0;
    case V_FUNC:
    case V_MACRO: return 1;
    case V_LOOP: return v->u.lp->items->n != 0; /* len(loop): see kvc__chat_truth */
    default: return 0;
    }
}

/* bool(v) for a template: bool(loop) is len(loop), which first tests the
 * rest of a filtered loop's items, as jinja2 does (chat.c). */
kvc_status kvc__chat_truth(ctx *c, const value *v, int *r);

/* Tests a filtered loop's items until more than `want` passed or none is
 * left (INT64_MAX: all), as jinja2's LoopContext does when loop.last or
 * nextitem peeks ahead and when its length is needed (chat.c). */
kvc_status kvc__chat_loop_pull(ctx *c, loop_ctx *lp, int64_t want);

static inline int is_num(const value *v) {
    return v->t == V_INT || v->t == V_BOOL;
}

/* Python's == into *r (refused where kvcache cannot know it: two methods
 * taken as values), and a < b (-1 / 0 / 1 into *cmp) for numbers, strings
 * and lists; n for error lines. */
kvc_status kvc__chat_equal(const node *n, const value *a, const value *b, int *r);
kvc_status kvc__chat_order(const node *n, const value *a, const value *b, int *cmp);

/* Lists and dicts in the arena; dict_find gives NULL for a missing key. */
kvc_status kvc__chat_new_list(ctx *c, size_t cap, value *out);
kvc_status kvc__chat_list_push(ctx *c, list *l, value v);
kvc_status kvc__chat_new_dict(ctx *c, size_t cap, value *out);
value *kvc__chat_dict_find(dict *d, str key);
kvc_status kvc__chat_dict_set(ctx *c, dict *d, str key, value v);
/* dict_set for a key the caller knows d does not hold (no search). */
kvc_status kvc__chat_dict_add(ctx *c, dict *d, str key, value v);

/* The code points of s as one-character strings, and their count. */
kvc_status kvc__chat_str_chars(ctx *c, str s, value *out);
size_t kvc__chat_str_len_cp(str s);

/* Items a for loop visits: a list's items, a dict's keys, a string's
 * characters; undefined iterates as empty. */
kvc_status kvc__chat_iter_items(ctx *c, const node *n, const value *v, value *out);

/* Variables: lookup searches the scopes (innermost first), then the builtins
 * and the globals, and returns 0 (*out undefined) for an unknown name; set_var
 * sets in the innermost scope. */
int kvc__chat_lookup(ctx *c, str name, value *out);
kvc_status kvc__chat_set_var(ctx *c, str name, value v);

/* String methods and filters (see their definitions). */
kvc_status kvc__chat_map_case(ctx *c, str s, char mode, value *out);
kvc_status kvc__chat_strip_chars(ctx *c, str s, const str *chars, int left, int right, str *out);
const char *kvc__chat_find_sub(str hay, str needle, size_t from);
kvc_status kvc__chat_str_replace(ctx *c, const node *n, str s, str old, str rep, int64_t count,
                                 value *out);
kvc_status kvc__chat_str_split(ctx *c, const node *n, str s, const value *sep, int64_t maxsplit,
                               value *out);
kvc_status kvc__chat_concat(ctx *c, str a, str b, value *out);

/* Python str.isspace() on the code point at s[i]; *len receives its length. */
static inline int space_at(const char *s, size_t n, size_t i, int *len) {
    uint32_t cp = kvc__utf8_decode((const unsigned char *)s + i, n - i, len);
    return kvc__py_isspace(cp);
}

/* ---- lexer (chat_lex.c), parser (chat_parse.c), evaluator (chat_eval.c) ---- */

/* Splits the normalised source c->src into c->toks. */
kvc_status kvc__chat_lex(ctx *c);

/* Parses statements until `{% word` with word in stop[]; leaves the parser
 * on that word (after the {%) and its index in *which. stop NULL: until EOF. */
kvc_status kvc__chat_parse_block(ctx *c, const char *const *stop, int n_stop, node **out,
                                 int *which);

/* Evaluates expression n into *out. */
kvc_status kvc__chat_eval(ctx *c, const node *n, value *out);

/* ---- shared by the evaluator's files (chat_eval.c, chat_filter.c, chat_json.c) ---- */

/* Call arguments, evaluated: pos[] and kw[] (at most 8 of each). */
typedef struct args {
    value pos[8];
    size_t n_pos;
    str kw_names[8];
    value kw[8];
    size_t n_kw;
} args;

/* Evaluates the arguments of call / filter / test node n (n->v, n->names = n->w). */
kvc_status kvc__chat_eval_args(ctx *c, const node *n, args *a);

/* Argument i by position or by keyword name; NULL if absent. */
static inline const value *kvc__chat_arg(const args *a, size_t i, const char *name) {
    if (i < a->n_pos) return &a->pos[i];
    for (size_t k = 0; k < a->n_kw; k++)
        if (str_eq(a->kw_names[k], name)) return &a->kw[k];
    return NULL;
}

/* The string in v (not NULL), else a run-time error "<what> must be a string". */
kvc_status kvc__chat_want_str(const node *n, const value *v, const char *what, str *out);

/* "'name' is undefined" for a name node, else "an undefined value is used". */
kvc_status kvc__chat_undefined_error(const node *n);

/* jinja2's getitem, obj[key] (n->a the object's node): a list's or string's item by
 * int, a dict's by key, else the Python attribute named key (as for d.items). */
kvc_status kvc__chat_get_item(ctx *c, const node *n, const value *obj, const value *key,
                              value *out);

/* Python's `x in coll` into *r. */
kvc_status kvc__chat_contains(ctx *c, const node *n, const value *x, const value *coll, int *r);

/* The filter, or test, node n (chat_filter.c). */
kvc_status kvc__chat_eval_filter(ctx *c, const node *n, value *out);
kvc_status kvc__chat_eval_test(ctx *c, const node *n, value *out);
/* Whether jinja2 has a filter / test of this name (else the template is
 * refused when parsed, as jinja2 refuses it when compiled). */
int kvc__chat_filter_known(str name);
int kvc__chat_test_known(str name);

/* HF's tojson filter (json.dumps) of x into *out; strftime_now(fmt) (chat_json.c). */
kvc_status kvc__chat_tojson(ctx *c, const node *n, const value *x, const args *a, value *out);
kvc_status kvc__chat_strftime_now(ctx *c, const node *n, const args *a, value *out);

/* Reads the context JSON of kvc_chat_apply_template_json (n bytes) into a
 * dict in the arena (chat_json_read.c). */
kvc_status kvc__chat_read_context(ctx *c, const char *json, size_t n, value *out);

/* Calls macro m with arguments a: its rendered body into *out (chat.c). */
kvc_status kvc__chat_call_macro(ctx *c, const node *n, const macro_ref *m, const args *a,
                                value *out);

#endif
