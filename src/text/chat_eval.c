/* Chat templates (see chat.c): evaluation of expressions: names, attributes,
 * subscripts and slices, calls (string and dict methods, the builtins,
 * macros), arithmetic and comparisons; filters and tests are in
 * chat_filter.c. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

/* ---- expressions --------------------------------------------------------------- */

kvc_status kvc__chat_undefined_error(const node *n) {
    if (n->k == E_NAME)
        return kvc__chat_runtime_error(n, "'%.*s' is undefined",
                                       (int)(n->name.n < 60 ? n->name.n : 60), n->name.p);
    return kvc__chat_runtime_error(n, "an undefined value is used");
}

static int name_in(str name, const char *const *names) {
    for (; *names; names++)
        if (str_eq(name, *names)) return 1;
    return 0;
}

/* The attributes of jinja2's LoopContext that kvcache has (recursive loops
 * are refused, so every loop is at depth 1); 0 for any other name. */
static int loop_attr(const loop_ctx *lp, str name, value *out) {
    int64_t i = lp->index0, len = (int64_t)lp->items->n;
    static const char *const names[] = {"index", "index0", "revindex", "revindex0", "first",
                                        "last",  "length", "depth",    "depth0",    "previtem",
                                        "nextitem", "cycle", "changed", NULL};
    int k = 0;
    while (names[k] && !str_eq(name, names[k])) k++;
    switch (k) {
    case 0: *out = v_int(i + 1); return 1;
    case 1: *out = v_int(i); return 1;
    case 2: *out = v_int(len - i); return 1;
    case 3: *out = v_int(len - i - 1); return 1;
    case 4: *out = v_bool(i == 0); return 1;
    case 5: *out = v_bool(i == len - 1); return 1;
    case 6: *out = v_int(len); return 1;
    case 7: *out = v_int(1); return 1;
    case 8: *out = v_int(0); return 1;
    case 9: *out = i > 0 ? lp->items->items[i - 1] : v_undef(); return 1;
    case 10: *out = i + 1 < len ? lp->items->items[i + 1] : v_undef(); return 1;
    case 11:
    case 12: out->t = V_FUNC; out->u.i = F_METHOD; return 1;
    default: return 0;
    }
}

/* Reading loop.last or nextitem peeks at the next item, and loop.length,
 * revindex or revindex0 needs them all: a filtered loop tests them then,
 * as jinja2's LoopContext does. */
static kvc_status loop_ahead(ctx *c, const value *obj, str name) {
    if (obj->t != V_LOOP) return KVC_OK;
    loop_ctx *lp = obj->u.lp;
    if (str_eq(name, "last") || str_eq(name, "nextitem"))
        return kvc__chat_loop_pull(c, lp, lp->index0 + 1);
    if (str_eq(name, "length") || str_eq(name, "revindex") || str_eq(name, "revindex0"))
        return kvc__chat_loop_pull(c, lp, INT64_MAX);
    return KVC_OK;
}

/* The Python attribute `name` of obj, where it has one jinja2 lets templates
 * see: the method as a value (F_METHOD), or undefined for the methods that
 * modify (ImmutableSandboxedEnvironment) -- never the dict's item of that
 * name. 0 if obj has no such attribute. */
static int py_attr(const value *obj, str name, value *out) {
    static const char *const str_methods[] = {
        "capitalize", "casefold",  "center",     "count",        "encode",     "endswith",
        "expandtabs", "find",      "format",     "format_map",   "index",      "isalnum",
        "isalpha",    "isascii",   "isdecimal",  "isdigit",      "isidentifier", "islower",
        "isnumeric",  "isprintable", "isspace",  "istitle",      "isupper",    "join",
        "ljust",      "lower",     "lstrip",     "maketrans",    "partition",  "removeprefix",
        "removesuffix", "replace", "rfind",      "rindex",       "rjust",      "rpartition",
        "rsplit",     "rstrip",    "split",      "splitlines",   "startswith", "strip",
        "swapcase",   "title",     "translate",  "upper",        "zfill",      NULL};
    static const char *const dict_methods[] = {"copy", "fromkeys", "get", "items", "keys",
                                               "values", NULL};
    static const char *const dict_modifiers[] = {"clear", "pop", "popitem", "setdefault",
                                                 "update", NULL};
    static const char *const list_methods[] = {"copy", "count", "index", NULL};
    static const char *const tuple_methods[] = {"count", "index", NULL};
    int method = 0;
    if (obj->t == V_LOOP) return loop_attr(obj->u.lp, name, out);
    if (obj->t == V_LIST && obj->u.l->kind == L_RANGE) { /* range(5).stop was undefined */
        const list *r = obj->u.l;
        if (str_eq(name, "start") || str_eq(name, "stop") || str_eq(name, "step")) {
            *out = v_int(name.p[2] == 'a' ? r->start : name.p[2] == 'o' ? r->stop : r->step);
            return 1;
        }
        method = name_in(name, tuple_methods);
    }
    if (obj->t == V_STR) {
        method = name_in(name, str_methods);
    } else if (obj->t == V_DICT && !obj->u.d->is_namespace) { /* a Namespace has no methods */
        if (name_in(name, dict_modifiers)) {
            *out = v_undef();
            return 1;
        }
        method = name_in(name, dict_methods);
    } else if (obj->t == V_LIST && obj->u.l->kind == L_LIST) {
        method = name_in(name, list_methods);
    } else if (obj->t == V_LIST && obj->u.l->kind == L_TUPLE) {
        method = name_in(name, tuple_methods);
    }
    if (method) {
        out->t = V_FUNC;
        out->u.i = F_METHOD;
    }
    return method;
}

/* Python indexing: list/str by (possibly negative) int, dict by key; a
 * string key that is no item is looked up as an attribute, as jinja2 does. */
kvc_status kvc__chat_get_item(ctx *c, const node *n, const value *obj, const value *key,
                              value *out) {
    *out = v_undef();
    if (obj->t == V_UNDEF) return kvc__chat_undefined_error(n->a);
    if (obj->t == V_DICT) {
        if (key->t == V_STR) {
            KVC_TRY(charge(c, key->u.s.n));
            value *v = kvc__chat_dict_find(obj->u.d, key->u.s);
            if (v)
                *out = *v;
            else
                py_attr(obj, key->u.s, out);
        }
        return KVC_OK;
    }
    if (key->t == V_STR) {
        KVC_TRY(loop_ahead(c, obj, key->u.s));
        py_attr(obj, key->u.s, out);
        return KVC_OK;
    }
    if ((obj->t == V_STR || (obj->t == V_LIST && obj->u.l->kind <= L_RANGE)) && is_num(key)) {
        value items = *obj;
        if (obj->t == V_STR) KVC_TRY(kvc__chat_str_chars(c, obj->u.s, &items));
        int64_t len = (int64_t)items.u.l->n, i = key->u.i;
        if (i < 0) i += len;
        if (i >= 0 && i < len) *out = items.u.l->items[i];
    }
    return KVC_OK;
}

/* jinja2's attribute lookup: the Python attribute first (d.items is the
 * method, whatever d['items'] holds), then the item. */
static kvc_status get_attr(ctx *c, const node *n, const value *obj, str name, value *out) {
    *out = v_undef();
    if (obj->t == V_UNDEF) return kvc__chat_undefined_error(n->a);
    KVC_TRY(loop_ahead(c, obj, name));
    if (py_attr(obj, name, out)) return KVC_OK;
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
    if (obj.t == V_UNDEF) return kvc__chat_undefined_error(n->a);
    if ((obj.t != V_LIST && obj.t != V_STR) || (obj.t == V_LIST && obj.u.l->kind > L_RANGE))
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
    res.u.l->kind = obj.t == V_LIST ? obj.u.l->kind : L_LIST; /* a range's slice is a range */
    if (obj.t == V_LIST && obj.u.l->kind == L_RANGE) { /* Python's range slicing */
        const list *r = obj.u.l;
        int64_t a0, a1, s0;
        if (__builtin_mul_overflow(start, r->step, &a0) ||
            __builtin_add_overflow(a0, r->start, &res.u.l->start) ||
            __builtin_mul_overflow(stop, r->step, &a1) ||
            __builtin_add_overflow(a1, r->start, &res.u.l->stop) ||
            __builtin_mul_overflow(step, r->step, &s0))
            return kvc__chat_runtime_error(n, "a range slice beyond 64-bit integers");
        res.u.l->step = s0;
    }
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        KVC_TRY(kvc__chat_list_push(c, res.u.l, items.u.l->items[i]));
        /* stop on the last index before i + step could overflow (|step| in
         * unsigned: step may be INT64_MIN) */
        if (step > 0 ? stop - i <= step : (uint64_t)(i - stop) <= 0 - (uint64_t)step) break;
    }
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

kvc_status kvc__chat_eval_args(ctx *c, const node *n, args *a) {
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

kvc_status kvc__chat_want_str(const node *n, const value *v, const char *what, str *out) {
    if (!v || v->t != V_STR) return kvc__chat_runtime_error(n, "%s must be a string", what);
    *out = v->u.s;
    return KVC_OK;
}

/* Python's positional argument count of the methods below: more is a
 * TypeError, except startswith / endswith's start and end (not here). */
static kvc_status method_arity(const node *n, const value *obj, str m, const args *a) {
    static const struct {
        const char *name;
        size_t max;
    } arity[] = {{"strip", 1},  {"lstrip", 1},     {"rstrip", 1},     {"startswith", 1},
                 {"endswith", 1}, {"upper", 0},    {"lower", 0},      {"title", 0},
                 {"capitalize", 0}, {"split", 2},  {"replace", 3},    {"get", 2},
                 {"items", 0},  {"keys", 0},       {"values", 0}};
    for (size_t i = 0; i < sizeof arity / sizeof arity[0]; i++) {
        if (!str_eq(m, arity[i].name) || a->n_pos <= arity[i].max) continue;
        if (str_eq(m, "startswith") || str_eq(m, "endswith")) /* (prefix, start, end) */
            return kvc__error(KVC_ERR_UNSUPPORTED,
                              "chat template, line %d: %s.%s() with start or end is not "
                              "supported",
                              n->line, kvc__chat_type_name(obj), arity[i].name);
        return kvc__chat_runtime_error(n, "%s.%s() takes at most %zu arguments (%zu given)",
                                       kvc__chat_type_name(obj), arity[i].name, arity[i].max,
                                       a->n_pos);
    }
    return KVC_OK;
}

/* loop.cycle(*values) and loop.changed(*values), as jinja2's LoopContext has them. */
static kvc_status call_loop_method(ctx *c, const node *n, loop_ctx *lp, str m, const args *a,
                                   value *out) {
    int cycle = str_eq(m, "cycle");
    if (!cycle && !str_eq(m, "changed")) {
        value v;
        if (loop_attr(lp, m, &v)) /* loop.index(): an int called */
            return kvc__chat_runtime_error(n, "'%s' object is not callable",
                                           kvc__chat_type_name(&v));
        return kvc__chat_runtime_error(n, "'LoopContext' object has no attribute '%.*s'",
                                       (int)(m.n < 40 ? m.n : 40), m.p);
    }
    if (a->n_kw)
        return kvc__chat_runtime_error(n, "loop.%s() got an unexpected keyword argument '%.*s'",
                                       cycle ? "cycle" : "changed",
                                       (int)(a->kw_names[0].n < 40 ? a->kw_names[0].n : 40),
                                       a->kw_names[0].p);
    if (cycle) {
        if (!a->n_pos) return kvc__chat_runtime_error(n, "no items for cycling given");
        *out = a->pos[lp->index0 % (int64_t)a->n_pos];
        return KVC_OK;
    }
    /* changed: whether the arguments differ from the last call's (Python's
     * tuple !=), true on the first call */
    int same = lp->last_changed && lp->n_changed == a->n_pos;
    for (size_t i = 0; same && i < a->n_pos; i++)
        KVC_TRY(kvc__chat_equal(n, &lp->last_changed[i], &a->pos[i], &same));
    if (!same) {
        value *keep;
        ALLOC(c, keep, a->n_pos + 1);
        memcpy(keep, a->pos, a->n_pos * sizeof *keep);
        lp->last_changed = keep;
        lp->n_changed = a->n_pos;
    }
    *out = v_bool(!same);
    return KVC_OK;
}

/* range.count(x) and range.index(x), as Python's: an int (or bool) is looked
 * up arithmetically (a range is what start, stop and step say; its items are
 * those too), anything else equals no item (no floats here), so its count is
 * 0 and its index a ValueError. Exactly one positional argument. */
static kvc_status call_range_method(const node *n, const list *r, str m, const args *a,
                                    value *out) {
    int count = str_eq(m, "count");
    if (a->n_kw)
        return kvc__chat_runtime_error(n, "range.%s() takes no keyword arguments",
                                       count ? "count" : "index");
    if (a->n_pos != 1)
        return kvc__chat_runtime_error(n, "range.%s() takes exactly one argument (%zu given)",
                                       count ? "count" : "index", a->n_pos);
    const value *x = &a->pos[0];
    int hit = 0;
    uint64_t pos = 0;
    if (is_num(x)) {
        int64_t v = x->u.i;
        /* differences in unsigned arithmetic: exact, as they lie in [0, 2^64) */
        if (r->step > 0 && v >= r->start && v < r->stop) {
            uint64_t d = (uint64_t)v - (uint64_t)r->start, s = (uint64_t)r->step;
            hit = d % s == 0;
            pos = d / s;
        } else if (r->step < 0 && v <= r->start && v > r->stop) {
            uint64_t d = (uint64_t)r->start - (uint64_t)v, s = 0 - (uint64_t)r->step;
            hit = d % s == 0;
            pos = d / s;
        }
    }
    if (count) {
        *out = v_int(hit);
        return KVC_OK;
    }
    if (!hit) {
        if (is_num(x))
            return kvc__chat_runtime_error(n, "%lld is not in range", (long long)x->u.i);
        return kvc__chat_runtime_error(n, "sequence.index(x): x not in sequence");
    }
    *out = v_int((int64_t)pos); /* < the range's length, which fits */
    return KVC_OK;
}

static kvc_status call_method(ctx *c, const node *n, const value *obj, str m, const args *a,
                              value *out) {
    if (obj->t == V_UNDEF) return kvc__chat_undefined_error(n->a->a);
    if (obj->t == V_LOOP) return call_loop_method(c, n, obj->u.lp, m, a, out);
    if (obj->t == V_LIST && obj->u.l->kind == L_RANGE && (str_eq(m, "count") || str_eq(m, "index")))
        return call_range_method(n, obj->u.l, m, a, out);
    if (obj->t == V_STR || obj->t == V_DICT) KVC_TRY(method_arity(n, obj, m, a));
    if (obj->t == V_STR) {
        str s = obj->u.s, x = {NULL, 0};
        if (str_eq(m, "strip") || str_eq(m, "lstrip") || str_eq(m, "rstrip")) {
            const value *ch = kvc__chat_arg(a, 0, "chars");
            str chars = {NULL, 0};
            if (ch && ch->t != V_NONE) KVC_TRY(kvc__chat_want_str(n, ch, "strip() chars", &chars));
            str r;
            KVC_TRY(kvc__chat_strip_chars(c, s, ch && ch->t != V_NONE ? &chars : NULL,
                                          m.p[0] != 'r', m.p[0] != 'l', &r));
            *out = v_str(r.p, r.n);
            return KVC_OK;
        }
        if (str_eq(m, "startswith") || str_eq(m, "endswith")) {
            KVC_TRY(kvc__chat_want_str(n, kvc__chat_arg(a, 0, "prefix"), "the prefix", &x));
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
            const value *ms = kvc__chat_arg(a, 1, "maxsplit");
            if (ms && !is_num(ms)) return kvc__chat_runtime_error(n, "maxsplit must be an integer");
            return kvc__chat_str_split(c, n, s, kvc__chat_arg(a, 0, "sep"), ms ? ms->u.i : -1, out);
        }
        if (str_eq(m, "replace")) {
            str old = {NULL, 0}, rep = {NULL, 0};
            KVC_TRY(kvc__chat_want_str(n, kvc__chat_arg(a, 0, "old"), "replace() old", &old));
            KVC_TRY(kvc__chat_want_str(n, kvc__chat_arg(a, 1, "new"), "replace() new", &rep));
            const value *cnt = kvc__chat_arg(a, 2, "count");
            if (cnt && !is_num(cnt)) return kvc__chat_runtime_error(n, "count must be an integer");
            return kvc__chat_str_replace(c, n, s, old, rep, cnt ? cnt->u.i : -1, out);
        }
    } else if (obj->t == V_DICT) {
        dict *d = obj->u.d;
        if (str_eq(m, "get")) {
            str key = {NULL, 0};
            const value *dflt = kvc__chat_arg(a, 1, "default");
            KVC_TRY(kvc__chat_want_str(n, kvc__chat_arg(a, 0, "key"), "get() key", &key));
            KVC_TRY(charge(c, key.n));
            value *v = kvc__chat_dict_find(d, key);
            *out = v ? *v : dflt ? *dflt : v_none();
            return KVC_OK;
        }
        if (str_eq(m, "items") || str_eq(m, "keys") || str_eq(m, "values")) {
            KVC_TRY(kvc__chat_new_list(c, d->n, out));
            out->u.l->kind = m.p[0] == 'k' ? L_KEYS : m.p[0] == 'v' ? L_VALUES : L_ITEMS;
            for (size_t i = 0; i < d->n; i++) {
                value k = v_str(d->keys[i].p, d->keys[i].n), item;
                if (m.p[0] == 'k') {
                    item = k;
                } else if (m.p[0] == 'v') {
                    item = d->vals[i];
                } else {
                    KVC_TRY(kvc__chat_new_list(c, 2, &item));
                    item.u.l->kind = L_TUPLE;
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
        return kvc__chat_runtime_error(n, "raised an exception: %.*s",
                                       (int)(msg.n < 400 ? msg.n : 400), msg.p);
    }
    if (fn == F_STRFTIME) return kvc__chat_strftime_now(c, n, a, out);
    if (fn == F_METHOD)
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: calling a method taken as a value is not "
                          "supported (call it where it is looked up: x.get(...))",
                          n->line);
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
    out->u.l->kind = L_RANGE;
    out->u.l->start = r[0];
    out->u.l->stop = r[1];
    out->u.l->step = r[2];
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
        KVC_TRY(kvc__chat_eval_args(c, n, &a));
        return call_method(c, n, &obj, n->a->name, &a, out);
    }
    value f;
    if (n->a->k == E_NAME) {
        if (!kvc__chat_lookup(c, n->a->name, &f)) {
            for (size_t i = 0; i < c->n_macro_names; i++) /* a macro not defined (yet) */
                if (c->macro_names[i].n == n->a->name.n &&
                    memcmp(c->macro_names[i].p, n->a->name.p, n->a->name.n) == 0)
                    return kvc__chat_undefined_error(n->a);
            return kvc__error(KVC_ERR_UNSUPPORTED,
                              "chat template, line %d: function '%.*s' is not "
                              "supported",
                              n->line, (int)(n->a->name.n < 40 ? n->a->name.n : 40), n->a->name.p);
        }
    } else {
        KVC_TRY(kvc__chat_eval(c, n->a, &f));
    }
    if (f.t == V_UNDEF) return kvc__chat_undefined_error(n->a);
    if (f.t != V_FUNC && f.t != V_MACRO)
        return kvc__chat_runtime_error(n, "'%s' object is not callable", kvc__chat_type_name(&f));
    KVC_TRY(kvc__chat_eval_args(c, n, &a));
    if (f.t == V_MACRO) return kvc__chat_call_macro(c, n, f.u.m, &a, out);
    return call_builtin(c, n, (int)f.u.i, &a, out);
}

static kvc_status arith(ctx *c, const node *n, const value *a, const value *b, value *out) {
    char op = n->name.p[0];
    int floor_div = str_eq(n->name, "//");
    if (str_eq(n->name, "/") || str_eq(n->name, "**")) /* float results (and big ints) */
        return kvc__error(KVC_ERR_UNSUPPORTED, "chat template, line %d: '%.*s' is not supported",
                          n->line, (int)n->name.n, n->name.p);
    if (op == '~') {
        str x = {NULL, 0}, y = {NULL, 0};
        KVC_TRY(kvc__chat_to_str(c, a, &x));
        KVC_TRY(kvc__chat_to_str(c, b, &y));
        return kvc__chat_concat(c, x, y, out);
    }
    if (op == '%' && a->t == V_STR) /* Python's printf-style formatting, not a type error */
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: string formatting with '%%' is not supported",
                          n->line);
    if (a->t == V_UNDEF || b->t == V_UNDEF) return kvc__chat_undefined_error(a->t == V_UNDEF ? n->a : n->b);
    if (op == '+' && a->t == V_STR && b->t == V_STR)
        return kvc__chat_concat(c, a->u.s, b->u.s, out);
    /* list + list, tuple + tuple; not ranges or views (TypeError in Python) */
    if (op == '+' && a->t == V_LIST && b->t == V_LIST && a->u.l->kind == b->u.l->kind &&
        a->u.l->kind <= L_TUPLE) {
        KVC_TRY(kvc__chat_new_list(c, a->u.l->n + b->u.l->n, out));
        out->u.l->kind = a->u.l->kind;
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
        if ((uint64_t)k > MAX_BYTES / s.n) return kvc__chat_over_cap(c);
        sbuf buf = {NULL, 0, 0};
        for (int64_t i = 0; i < k; i++) KVC_TRY(kvc__chat_sb_put(c, &buf, s.p, s.n));
        *out = v_str(buf.p ? buf.p : "", buf.n);
        return KVC_OK;
    }
    if (op == '*' && ((a->t == V_LIST && is_num(b)) || (is_num(a) && b->t == V_LIST)) &&
        (a->t == V_LIST ? a : b)->u.l->kind <= L_TUPLE) { /* list or tuple * n */
        const list *l = (a->t == V_LIST ? a : b)->u.l;
        int64_t k = a->t == V_LIST ? b->u.i : a->u.i;
        KVC_TRY(kvc__chat_new_list(c, 4, out));
        out->u.l->kind = l->kind;
        if (k <= 0 || l->n == 0) return KVC_OK;
        if ((uint64_t)k > MAX_BYTES / sizeof(value) / l->n) return kvc__chat_over_cap(c);
        for (int64_t i = 0; i < k; i++)
            for (size_t j = 0; j < l->n; j++) KVC_TRY(kvc__chat_list_push(c, out->u.l, l->items[j]));
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

/* What comparing or looking up v costs, for charge(): a string's bytes, a
 * list's or dict's entries (their strings are charged as they are compared
 * in turn only when equal in length, rare enough to leave out). */
static size_t cost_of(const value *v) {
    return v->t == V_STR ? v->u.s.n : v->t == V_LIST ? v->u.l->n : v->t == V_DICT ? v->u.d->n : 0;
}

kvc_status kvc__chat_contains(ctx *c, const node *n, const value *x, const value *coll, int *r) {
    if (coll->t == V_STR) {
        if (x->t != V_STR)
            return kvc__chat_runtime_error(n, "'in <string>' requires a string on the left");
        KVC_TRY(charge(c, coll->u.s.n));
        *r = kvc__chat_find_sub(coll->u.s, x->u.s, 0) != NULL;
    } else if (coll->t == V_LIST) {
        KVC_TRY(charge(c, (cost_of(x) + 1) * coll->u.l->n));
        *r = 0;
        for (size_t i = 0; i < coll->u.l->n && !*r; i++)
            KVC_TRY(kvc__chat_equal(n, x, &coll->u.l->items[i], r));
    } else if (coll->t == V_DICT) {
        /* a Namespace is hashable (by identity): never a key here */
        if ((x->t == V_DICT && !x->u.d->is_namespace) ||
            (x->t == V_LIST && x->u.l->kind != L_TUPLE && x->u.l->kind != L_RANGE))
            return kvc__chat_runtime_error(n, "unhashable type: '%s'", kvc__chat_type_name(x));
        KVC_TRY(charge(c, cost_of(x)));
        *r = x->t == V_STR && kvc__chat_dict_find(coll->u.d, x->u.s) != NULL;
    } else if (coll->t == V_UNDEF) {
        *r = 0; /* iterating an undefined value gives nothing */
    } else if (coll->t == V_LOOP) {
        value items; /* refused: it would advance the loop */
        return kvc__chat_iter_items(c, n, coll, &items);
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
        if (str_eq(op, "==") || str_eq(op, "!=")) {
            KVC_TRY(kvc__chat_equal(n, &left, &right, &r));
            if (op.p[0] == '!') r = !r;
        } else if (str_eq(op, "in") || str_eq(op, "not in")) {
            KVC_TRY(kvc__chat_contains(c, n, &left, &right, &r));
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
kvc_status kvc__chat_eval(ctx *c, const node *n, value *out) {
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
    int t;
    switch (n->k) {
    case E_LIT: *out = n->lit; return KVC_OK;
    case E_NAME: kvc__chat_lookup(c, n->name, out); return KVC_OK;
    case E_ATTR: KVC_TRY(kvc__chat_eval(c, n->a, &a)); return get_attr(c, n, &a, n->name, out);
    case E_INDEX:
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        KVC_TRY(kvc__chat_eval(c, n->b, &b));
        return kvc__chat_get_item(c, n, &a, &b, out);
    case E_SLICE: return eval_slice(c, n, out);
    case E_CALL: return eval_call(c, n, out);
    case E_FILTER: return kvc__chat_eval_filter(c, n, out);
    case E_TEST: return kvc__chat_eval_test(c, n, out);
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
        KVC_TRY(kvc__chat_truth(c, &a, &t));
        *out = v_bool(!t);
        return KVC_OK;
    case E_AND: /* Python: the deciding operand itself */
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        KVC_TRY(kvc__chat_truth(c, &a, &t));
        if (!t) {
            *out = a;
            return KVC_OK;
        }
        return kvc__chat_eval(c, n->b, out);
    case E_OR:
        KVC_TRY(kvc__chat_eval(c, n->a, &a));
        KVC_TRY(kvc__chat_truth(c, &a, &t));
        if (t) {
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
        KVC_TRY(kvc__chat_truth(c, &a, &t));
        if (t) return kvc__chat_eval(c, n->b, out);
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
            if (a.t != V_STR) /* outside the subset, not an error in jinja2 */
                return kvc__error(KVC_ERR_UNSUPPORTED,
                                  "chat template, line %d: only string dictionary keys are "
                                  "supported (got a %s)", n->line, kvc__chat_type_name(&a));
            KVC_TRY(kvc__chat_dict_set(c, out->u.d, a.u.s, b));
        }
        return KVC_OK;
    case E_UNSUP:
        return kvc__error(KVC_ERR_UNSUPPORTED, "chat template, line %d: %.*s not supported",
                          n->line, (int)n->name.n, n->name.p);
    default:
        return kvc__error(KVC_ERR_INTERNAL, "chat template: bad expression node %d", (int)n->k);
    }
}
