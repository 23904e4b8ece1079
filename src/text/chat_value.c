/* Chat templates (see chat.c): the arena, errors, values, lists and dicts,
 * scopes, and the string operations the evaluator calls. */
#define _GNU_SOURCE /* memmem */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

/* ---- arena ------------------------------------------------------------------ */

void kvc__chat_arena_free(arena *a) {
    while (a->head) {
        chunk *c = a->head;
        a->head = c->next;
        free(c);
    }
}

/* ---- errors ------------------------------------------------------------------ */

kvc_status kvc__chat_syntax_error(ctx *c, const token *t, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvc__error(KVC_ERR_UNSUPPORTED, "chat template, line %d: %s", t ? t->line : c->lex_line,
                      msg);
}

kvc_status kvc__chat_nomem(void) {
    return kvc__error(KVC_ERR_NOMEM, "chat template: out of memory");
}

kvc_status kvc__chat_over_cap(const ctx *c) {
    return kvc__error(KVC_ERR_INVALID_ARG,
                      "chat template, line %d: the template's strings, lists and parse tree "
                      "pass %zu MiB (a template this large is refused)",
                      c->cur ? c->cur->line : c->lex_line, MAX_BYTES >> 20);
}

kvc_status kvc__chat_alloc_failed(const ctx *c) {
    return c->ar.over ? kvc__chat_over_cap(c) : kvc__chat_nomem();
}

kvc_status kvc__chat_runtime_error(const node *n, const char *fmt, ...) {
    char msg[512]; /* room for a raise_exception message of 400 bytes */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvc__error(KVC_ERR_INVALID_ARG, "chat template, line %d: %s", n ? n->line : 0, msg);
}

/* ---- evaluation helpers ------------------------------------------------------ */

const char *kvc__chat_type_name(const value *v) {
    switch (v->t) {
    case V_UNDEF: return "undefined";
    case V_NONE: return "NoneType";
    case V_BOOL: return "bool";
    case V_INT: return "int";
    case V_STR: return "str";
    case V_LIST: {
        static const char *const names[] = {"list",        "tuple",      "range",    "dict_keys",
                                            "dict_values", "dict_items", "generator"};
        return names[v->u.l->kind];
    }
    case V_DICT: return "dict";
    case V_MACRO: return "Macro";
    case V_LOOP: return "LoopContext";
    default: return "function";
    }
}

kvc_status kvc__chat_sb_put(ctx *c, sbuf *b, const char *p, size_t n) {
    KVC_TRY(charge(c, n));
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n) cap *= 2;
        if (cap > MAX_BYTES) return kvc__chat_over_cap(c);
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

/* Python's repr() of a string: single quotes unless it holds ' and no ";
 * code points str.isprintable() refuses as \xhh, \uhhhh or \Uhhhhhhhh (an
 * invalid byte b is U+DC00 + b, as Python's surrogateescape has it). */
static kvc_status repr_str(ctx *c, sbuf *b, str s) {
    char q = memchr(s.p, '\'', s.n) && !memchr(s.p, '"', s.n) ? '"' : '\'';
    KVC_TRY(kvc__chat_sb_put(c, b, &q, 1));
    for (size_t i = 0; i < s.n;) {
        int len;
        uint32_t cp = kvc__utf8_decode((const unsigned char *)s.p + i, s.n - i, &len);
        char esc[16];
        if (cp == '\\' || cp == (unsigned char)q) {
            esc[0] = '\\';
            esc[1] = (char)cp;
            KVC_TRY(kvc__chat_sb_put(c, b, esc, 2));
        } else if (cp == '\n' || cp == '\r' || cp == '\t') {
            KVC_TRY(sb_cstr(c, b, cp == '\n' ? "\\n" : cp == '\r' ? "\\r" : "\\t"));
        } else if (!kvc__py_isprintable(cp)) {
            snprintf(esc, sizeof esc, cp < 0x100 ? "\\x%02x" : cp < 0x10000 ? "\\u%04x" : "\\U%08x",
                     (unsigned)cp);
            KVC_TRY(sb_cstr(c, b, esc));
        } else {
            KVC_TRY(kvc__chat_sb_put(c, b, s.p + i, (size_t)len));
        }
        i += (size_t)len;
    }
    return kvc__chat_sb_put(c, b, &q, 1);
}

static kvc_status write_value(ctx *c, sbuf *b, const value *v, int repr) {
    char num[48];
    switch (v->t) {
    case V_UNDEF: return repr ? sb_cstr(c, b, "Undefined") : KVC_OK; /* jinja2's repr */
    case V_NONE: return sb_cstr(c, b, "None");
    case V_BOOL: return sb_cstr(c, b, v->u.i ? "True" : "False");
    case V_INT: snprintf(num, sizeof num, "%lld", (long long)v->u.i); return sb_cstr(c, b, num);
    case V_STR: return repr ? repr_str(c, b, v->u.s) : kvc__chat_sb_put(c, b, v->u.s.p, v->u.s.n);
    case V_LIST:
        if (v->u.l->kind == L_GEN) /* jinja2 prints <generator object ... at 0x...> */
            return kvc__error(KVC_ERR_UNSUPPORTED,
                              "chat template, line %d: printing a generator (what select, "
                              "reject, selectattr, rejectattr, map, items and reverse give; "
                              "add |list) is not supported", c->cur ? c->cur->line : 0);
        if (v->u.l->kind == L_RANGE) { /* Python's repr: range(0, 3), range(0, 9, 2) */
            snprintf(num, sizeof num, "%lld", (long long)v->u.l->start);
            KVC_TRY(sb_cstr(c, b, "range("));
            KVC_TRY(sb_cstr(c, b, num));
            snprintf(num, sizeof num, ", %lld", (long long)v->u.l->stop);
            KVC_TRY(sb_cstr(c, b, num));
            snprintf(num, sizeof num, ", %lld", (long long)v->u.l->step);
            if (v->u.l->step != 1) KVC_TRY(sb_cstr(c, b, num));
            return sb_cstr(c, b, ")");
        }
        lkind k = v->u.l->kind;
        int view = k == L_KEYS || k == L_VALUES || k == L_ITEMS; /* dict_keys([...]), ... */
        if (view) KVC_TRY(sb_cstr(c, b, k == L_KEYS ? "dict_keys(" : k == L_VALUES ?
                                  "dict_values(" : "dict_items("));
        KVC_TRY(sb_cstr(c, b, k == L_TUPLE ? "(" : "["));
        for (size_t i = 0; i < v->u.l->n; i++) {
            if (i) KVC_TRY(sb_cstr(c, b, ", "));
            KVC_TRY(write_value(c, b, &v->u.l->items[i], 1));
        }
        return sb_cstr(c, b, k == L_TUPLE ? ")" : view ? "])" : "]");
    case V_DICT: /* a namespace() prints as Jinja's Namespace object */
        KVC_TRY(sb_cstr(c, b, v->u.d->is_namespace ? "<Namespace {" : "{"));
        for (size_t i = 0; i < v->u.d->n; i++) {
            if (i) KVC_TRY(sb_cstr(c, b, ", "));
            KVC_TRY(repr_str(c, b, v->u.d->keys[i]));
            KVC_TRY(sb_cstr(c, b, ": "));
            KVC_TRY(write_value(c, b, &v->u.d->vals[i], 1));
        }
        return sb_cstr(c, b, v->u.d->is_namespace ? "}>" : "}");
    case V_MACRO: /* jinja2: <Macro 'name'> */
        KVC_TRY(sb_cstr(c, b, "<Macro '"));
        KVC_TRY(kvc__chat_sb_put(c, b, v->u.m->def->name.p, v->u.m->def->name.n));
        return sb_cstr(c, b, "'>");
    case V_LOOP: /* jinja2's repr: <LoopContext index/length> */
        KVC_TRY(kvc__chat_loop_pull(c, v->u.lp, INT64_MAX));
        snprintf(num, sizeof num, "%lld/%zu>", (long long)v->u.lp->index0 + 1,
                 v->u.lp->items->n);
        KVC_TRY(sb_cstr(c, b, "<LoopContext "));
        return sb_cstr(c, b, num);
    default: /* jinja2 prints its address (<function safe_range at 0x...>) */
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: printing a %s taken as a value (%s without "
                          "a call) is not supported", c->cur ? c->cur->line : 0,
                          v->u.i == F_METHOD ? "method" : "function",
                          v->u.i == F_METHOD ? "x.items" : "range");
    }
}

/* str(v) as Jinja prints it (undefined prints nothing). */
kvc_status kvc__chat_to_str(ctx *c, const value *v, str *out) {
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

/* Python's a == b: 1 or 0, or -1 where kvcache cannot know it: two methods
 * taken as values are equal when bound to the same object (identity, which
 * kvcache does not track for strings) and the same method. */
static int equal3(const value *a, const value *b) {
    if (is_num(a) && is_num(b)) return a->u.i == b->u.i;
    if (a->t != b->t) return 0;
    switch (a->t) {
    case V_UNDEF:
    case V_NONE: return 1;
    case V_STR: return a->u.s.n == b->u.s.n && memcmp(a->u.s.p, b->u.s.p, a->u.s.n) == 0;
    case V_LIST: /* a tuple, range or view never equals a list, as in Python */
        if (a->u.l->kind == L_GEN || b->u.l->kind == L_GEN) return a->u.l == b->u.l; /* identity */
        if (a->u.l->n != b->u.l->n || a->u.l->kind != b->u.l->kind) return 0;
        if (a->u.l->kind == L_VALUES) return 0; /* values views compare by identity */
        for (size_t i = 0; i < a->u.l->n; i++) {
            int e;
            if (a->u.l->kind == L_KEYS || a->u.l->kind == L_ITEMS) { /* as sets */
                size_t j = 0;
                while (j < b->u.l->n && (e = equal3(&a->u.l->items[i], &b->u.l->items[j])) == 0)
                    j++;
                if (j == b->u.l->n) return 0;
            } else {
                e = equal3(&a->u.l->items[i], &b->u.l->items[i]);
            }
            if (e != 1) return e;
        }
        return 1;
    case V_DICT:
        /* jinja2's Namespace has no __eq__: identity (namespace(a=1) == namespace(a=1) was
         * true) */
        if (a->u.d->is_namespace || b->u.d->is_namespace) return a->u.d == b->u.d;
        if (a->u.d->n != b->u.d->n) return 0;
        for (size_t i = 0; i < a->u.d->n; i++) {
            size_t j = 0;
            while (j < b->u.d->n &&
                   !(a->u.d->keys[i].n == b->u.d->keys[j].n &&
                     memcmp(a->u.d->keys[i].p, b->u.d->keys[j].p, a->u.d->keys[i].n) == 0))
                j++;
            if (j == b->u.d->n) return 0;
            int e = equal3(&a->u.d->vals[i], &b->u.d->vals[j]);
            if (e != 1) return e;
        }
        return 1;
    case V_FUNC:
        if (a->u.i == F_METHOD && b->u.i == F_METHOD) return -1;
        return a->u.i == b->u.i; /* builtins: the same function or not */
    case V_MACRO: return a->u.m == b->u.m;
    case V_LOOP: return a->u.lp == b->u.lp; /* identity */
    default: return 0;
    }
}

kvc_status kvc__chat_equal(const node *n, const value *a, const value *b, int *r) {
    *r = equal3(a, b);
    if (*r < 0)
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: comparing methods taken as values (x.items "
                          "without a call) is not supported", n ? n->line : 0);
    return KVC_OK;
}

/* Python's a < b (-1 / 0 / 1 into *cmp) for numbers, strings, lists and
 * tuples (not ranges; views order as sets in Python: refused here). */
kvc_status kvc__chat_order(const node *n, const value *a, const value *b, int *cmp) {
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
    if (a->t == V_LIST && b->t == V_LIST && a->u.l->kind == b->u.l->kind &&
        a->u.l->kind <= L_TUPLE) {
        for (size_t i = 0; i < a->u.l->n && i < b->u.l->n; i++) {
            int e;
            KVC_TRY(kvc__chat_equal(n, &a->u.l->items[i], &b->u.l->items[i], &e));
            if (e) continue;
            return kvc__chat_order(n, &a->u.l->items[i], &b->u.l->items[i], cmp);
        }
        *cmp = a->u.l->n < b->u.l->n ? -1 : a->u.l->n > b->u.l->n;
        return KVC_OK;
    }
    return kvc__chat_runtime_error(n, "cannot order %s and %s", kvc__chat_type_name(a),
                                   kvc__chat_type_name(b));
}

kvc_status kvc__chat_new_list(ctx *c, size_t cap, value *out) {
    list *l;
    ALLOC(c, l, 1);
    l->n = 0;
    l->kind = L_LIST;
    l->consumed = 0;
    l->depth = 0;
    l->has_ns = 0;
    l->start = l->stop = 0;
    l->step = 1;
    l->cap = cap ? cap : 1;
    ALLOC(c, l->items, l->cap);
    out->t = V_LIST;
    out->u.l = l;
    return KVC_OK;
}

/* The depth and namespace marks a container takes from a new item v. */
static kvc_status take_marks(ctx *c, int *depth, int *has_ns, const value *v) {
    int d = v->t == V_LIST ? v->u.l->depth : v->t == V_DICT ? v->u.d->depth : 0;
    if (d + 1 > *depth) {
        if (d + 1 > MAX_VALUE_DEPTH)
            return kvc__chat_runtime_error(c->cur, "lists and dicts nested more than %d deep",
                                           MAX_VALUE_DEPTH);
        *depth = d + 1;
    }
    if ((v->t == V_LIST && v->u.l->has_ns) ||
        (v->t == V_DICT && (v->u.d->has_ns || v->u.d->is_namespace)))
        *has_ns = 1;
    return KVC_OK;
}

kvc_status kvc__chat_list_push(ctx *c, list *l, value v) {
    KVC_TRY(take_marks(c, &l->depth, &l->has_ns, &v));
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

kvc_status kvc__chat_new_dict(ctx *c, size_t cap, value *out) {
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

value *kvc__chat_dict_find(dict *d, str key) {
    for (size_t i = 0; i < d->n; i++)
        if (d->keys[i].n == key.n && memcmp(d->keys[i].p, key.p, key.n) == 0) return &d->vals[i];
    return NULL;
}

kvc_status kvc__chat_dict_set(ctx *c, dict *d, str key, value v) {
    KVC_TRY(take_marks(c, &d->depth, &d->has_ns, &v));
    if (d->is_namespace && d->has_ns) /* it could come to hold itself */
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: a namespace holding a namespace is not "
                          "supported", c->cur ? c->cur->line : 0);
    value *slot = kvc__chat_dict_find(d, key);
    if (slot) {
        *slot = v;
        return KVC_OK;
    }
    return kvc__chat_dict_add(c, d, key, v);
}

kvc_status kvc__chat_dict_add(ctx *c, dict *d, str key, value v) {
    KVC_TRY(take_marks(c, &d->depth, &d->has_ns, &v));
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

/* Code points of a string, as a list of one-character strings. */
kvc_status kvc__chat_str_chars(ctx *c, str s, value *out) {
    KVC_TRY(kvc__chat_new_list(c, s.n, out));
    for (size_t i = 0; i < s.n;) {
        int len;
        kvc__utf8_decode((const unsigned char *)s.p + i, s.n - i, &len);
        KVC_TRY(kvc__chat_list_push(c, out->u.l, v_str(s.p + i, (size_t)len)));
        i += (size_t)len;
    }
    return KVC_OK;
}

size_t kvc__chat_str_len_cp(str s) {
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
kvc_status kvc__chat_iter_items(ctx *c, const node *n, const value *v, value *out) {
    if (v->t == V_LIST) {
        if (v->u.l->kind == L_GEN) { /* Python's generators run once */
            if (v->u.l->consumed)
                return kvc__error(KVC_ERR_UNSUPPORTED,
                                  "chat template, line %d: a generator (select, map, ...) used "
                                  "a second time is not supported", n ? n->line : 0);
            v->u.l->consumed = 1;
        }
        *out = *v;
        return KVC_OK;
    }
    if (v->t == V_STR) return kvc__chat_str_chars(c, v->u.s, out);
    if (v->t == V_UNDEF) return kvc__chat_new_list(c, 0, out);
    if (v->t == V_LOOP) /* jinja2's LoopContext iterates by advancing the loop itself */
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: iterating `loop` (for, in, join, list, ...) "
                          "is not supported", n ? n->line : 0);
    if (v->t == V_DICT) {
        KVC_TRY(kvc__chat_new_list(c, v->u.d->n, out));
        for (size_t i = 0; i < v->u.d->n; i++)
            KVC_TRY(kvc__chat_list_push(c, out->u.l, v_str(v->u.d->keys[i].p, v->u.d->keys[i].n)));
        return KVC_OK;
    }
    return kvc__chat_runtime_error(n, "'%s' object is not iterable", kvc__chat_type_name(v));
}

/* ---- scopes ------------------------------------------------------------------- */

int kvc__chat_lookup(ctx *c, str name, value *out) {
    for (int f = c->n_frames - 1; f >= 0; f--) {
        if (f >= c->hide_lo && f < c->hide_hi) continue; /* a loop's body, from its filter */
        if (f < c->scope_floor && f >= c->def_depth) { /* in a macro: skip to its definer's */
            f = c->def_depth;
            continue;
        }
        frame *fr = &c->frames[f];
        for (size_t i = fr->n; i-- > 0;)
            if (fr->names[i].n == name.n && memcmp(fr->names[i].p, name.p, name.n) == 0) {
                *out = fr->vals[i];
                return 1;
            }
    }
    if (c->vars) { /* the context JSON's members */
        const value *v = kvc__chat_dict_find(c->vars, name);
        if (v) {
            *out = *v;
            return 1;
        }
    }
    static const struct {
        const char *name;
        int fn;
    } fns[] = {{"raise_exception", F_RAISE},
           {"namespace", F_NAMESPACE},
           {"range", F_RANGE},
           {"strftime_now", F_STRFTIME}};
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

kvc_status kvc__chat_set_var(ctx *c, str name, value v) {
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
 * letter of every item split at runs of [-\s({[<] upper, rest lower; \s is
 * str.isspace()), 'T' Python's str.title() (upper after a code point that
 * is not cased, lower after a cased one). Other code points are copied. */
kvc_status kvc__chat_map_case(ctx *c, str s, char mode, value *out) {
    char *p;
    ALLOC(c, p, s.n + 1);
    memcpy(p, s.p, s.n);
    int word_start = 1;
    for (size_t i = 0; i < s.n;) {
        int len;
        uint32_t cp = kvc__utf8_decode((const unsigned char *)s.p + i, s.n - i, &len);
        int ch = (unsigned char)s.p[i]; /* mapped only when ASCII (cp < 128) */
        switch (mode) {
        case 'u': ch = ascii_upper(ch); break;
        case 'l': ch = ascii_lower_ch(ch); break;
        case 'c': ch = i == 0 ? ascii_upper(ch) : ascii_lower_ch(ch); break;
        case 't': {
            int sep = cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' ||
                      kvc__py_isspace(cp);
            ch = word_start && !sep ? ascii_upper(ch) : ascii_lower_ch(ch);
            word_start = sep;
            break;
        }
        default: /* 'T' */
            ch = word_start ? ascii_upper(ch) : ascii_lower_ch(ch);
            word_start = !kvc__is_cased(cp);
            break;
        }
        if (cp < 128) p[i] = (char)ch;
        i += (size_t)len;
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

/* strip/lstrip/rstrip with chars (NULL: whitespace) as the template calls
 * them: the chars made into a set first, the bytes charged to MAX_WORK. */
kvc_status kvc__chat_strip_chars(ctx *c, str s, const str *chars, int left, int right, str *out) {
    KVC_TRY(charge(c, s.n + (chars ? chars->n : 0)));
    uint32_t local[64]; /* short chars (the usual case): no arena allocation per call */
    cp_set set = {local, 0};
    if (chars) KVC_TRY(cp_set_make(c, *chars, &set));
    *out = strip_set(s, chars ? &set : NULL, left, right);
    return KVC_OK;
}

/* First occurrence of needle in hay at or after from (memmem: linear, not
 * n * m as a naive scan is on 'aaa...ab' needles). */
const char *kvc__chat_find_sub(str hay, str needle, size_t from) {
    if (needle.n == 0) return hay.p + from;
    if (from > hay.n || needle.n > hay.n - from) return NULL;
    return memmem(hay.p + from, hay.n - from, needle.p, needle.n);
}

kvc_status kvc__chat_str_replace(ctx *c, const node *n, str s, str old, str rep, int64_t count,
                                 value *out) {
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
kvc_status kvc__chat_str_split(ctx *c, const node *n, str s, const value *sep, int64_t maxsplit,
                               value *out) {
    KVC_TRY(charge(c, s.n));
    KVC_TRY(kvc__chat_new_list(c, 4, out));
    if (!sep || sep->t == V_NONE) {
        size_t i = 0;
        int64_t splits = 0;
        for (;;) {
            int len;
            while (i < s.n && space_at(s.p, s.n, i, &len)) i += (size_t)len;
            if (i >= s.n) break;
            if (maxsplit >= 0 && splits >= maxsplit) { /* the rest keeps its trailing space */
                KVC_TRY(kvc__chat_list_push(c, out->u.l, v_str(s.p + i, s.n - i)));
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

kvc_status kvc__chat_concat(ctx *c, str a, str b, value *out) {
    if (a.n + b.n > MAX_BYTES) return kvc__chat_over_cap(c);
    KVC_TRY(charge(c, a.n + b.n));
    char *p;
    ALLOC(c, p, a.n + b.n + 1);
    if (a.n) memcpy(p, a.p, a.n);
    if (b.n) memcpy(p + a.n, b.p, b.n);
    *out = v_str(p, a.n + b.n);
    return KVC_OK;
}
