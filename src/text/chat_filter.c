/* Chat templates (see chat.c): filters (`x | name(args)`) and tests (`x is
 * name(args)`), including the ones that take a test or filter by name
 * (select, reject, selectattr, rejectattr, map). */
#define _POSIX_C_SOURCE 200809L /* newlocale, uselocale */
#include <locale.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

/* The whitespace Python's int() and float() strip: str.isspace() but for
 * U+001C..U+001F (which str.strip() does strip). */
static str strip_num_space(str s) {
    size_t i = 0, e = s.n;
    int len;
    while (i < e && !((unsigned char)s.p[i] >= 0x1C && (unsigned char)s.p[i] <= 0x1F) &&
           space_at(s.p, e, i, &len))
        i += (size_t)len;
    while (e > i) {
        size_t j = e - 1;
        while (j > i && ((unsigned char)s.p[j] & 0xC0) == 0x80) j--; /* last code point */
        if (((unsigned char)s.p[j] >= 0x1C && (unsigned char)s.p[j] <= 0x1F) ||
            !space_at(s.p, e, j, &len) || j + (size_t)len != e)
            break;
        e = j;
    }
    str r = {s.p + i, e - i};
    return r;
}

/* Python's argument binding for a filter taking names[0..n_names) (by
 * position or keyword), the first n_required of them required: missing,
 * too many, unknown or repeated arguments are a TypeError in jinja2, so a
 * run-time error here (they were ignored). */
static kvc_status check_params(const node *n, const args *a, const char *fname,
                               const char *const *names, size_t n_names, size_t n_required) {
    if (a->n_pos > n_names)
        return n_names ? kvc__chat_runtime_error(n, "%s() takes at most %zu arguments (%zu given)",
                                                 fname, n_names, a->n_pos)
                       : kvc__chat_runtime_error(n, "%s() takes no arguments (%zu given)", fname,
                                                 a->n_pos + a->n_kw);
    for (size_t k = 0; k < a->n_kw; k++) {
        size_t i = 0;
        while (i < n_names && !str_eq(a->kw_names[k], names[i])) i++;
        if (i == n_names)
            return kvc__chat_runtime_error(n, "%s() got an unexpected keyword argument '%.*s'",
                                           fname, (int)(a->kw_names[k].n < 40 ? a->kw_names[k].n
                                                                                 : 40),
                                           a->kw_names[k].p);
        if (i < a->n_pos)
            return kvc__chat_runtime_error(n, "%s() got multiple values for argument '%s'",
                                           fname, names[i]);
    }
    for (size_t i = a->n_pos; i < n_required; i++)
        if (!kvc__chat_arg(a, i, names[i]))
            return kvc__chat_runtime_error(n, "%s() missing required argument '%s'", fname,
                                           names[i]);
    return KVC_OK;
}

/* The parameters of the filters kvcache has (after the input), as jinja2
 * declares them; the generator filters (select, map, ...) check their own. */
static const struct {
    const char *name;
    const char *params[4];
    size_t n, required;
} filter_params[] = {
    {"default", {"default_value", "boolean"}, 2, 0}, {"d", {"default_value", "boolean"}, 2, 0},
    {"length", {NULL}, 0, 0}, {"count", {NULL}, 0, 0}, /* len(x): nothing more */
    {"first", {NULL}, 0, 0}, {"last", {NULL}, 0, 0}, {"list", {NULL}, 0, 0},
    {"safe", {NULL}, 0, 0}, {"reverse", {NULL}, 0, 0}, {"string", {NULL}, 0, 0},
    {"upper", {NULL}, 0, 0}, {"lower", {NULL}, 0, 0}, {"title", {NULL}, 0, 0},
    {"capitalize", {NULL}, 0, 0}, {"trim", {"chars"}, 1, 0},
    {"join", {"d", "attribute"}, 2, 0}, {"int", {"default", "base"}, 2, 0},
    {"replace", {"old", "new", "count"}, 3, 2},
    {"tojson", {"ensure_ascii", "indent", "separators", "sort_keys"}, 4, 0}};

/* Python's int(t, base) on a stripped string: optional sign, the base's
 * prefix (0x/0o/0b; base 0 takes it from the prefix, and refuses leading
 * zeros in decimal), digits 0-9a-z below the base with single underscores
 * between them. 1 and *v: a valid literal; 0: ValueError (also for a base
 * outside 0 and 2..36); 2: valid but beyond int64 (Python has big ints).
 * ASCII digits only: Python also takes other Unicode decimal digits. */
static int py_int(str t, int64_t base, int64_t *v) {
    size_t i = 0;
    int neg = 0;
    if (base != 0 && (base < 2 || base > 36)) return 0;
    if (i < t.n && (t.p[i] == '+' || t.p[i] == '-')) neg = t.p[i++] == '-';
    if (i + 1 < t.n && t.p[i] == '0') {
        char p = (char)(t.p[i + 1] | 0x20);
        int pb = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
        if (pb && (base == 0 || base == pb)) {
            base = pb;
            i += 2;
            if (i < t.n && t.p[i] == '_') i++; /* 0x_ff */
        }
    }
    int decimal0 = base == 0; /* base 0 without a prefix: decimal, no leading zeros */
    if (base == 0) base = 10;
    uint64_t m = 0, lim = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    int over = 0, nonzero = 0;
    size_t digits = 0, first = i;
    for (; i < t.n; i++) {
        char ch = t.p[i];
        if (ch == '_') {
            if (i + 1 >= t.n || i == first || t.p[i - 1] == '_') return 0;
            continue;
        }
        int dv = ch >= '0' && ch <= '9'   ? ch - '0'
                 : ch >= 'a' && ch <= 'z' ? ch - 'a' + 10
                 : ch >= 'A' && ch <= 'Z' ? ch - 'A' + 10
                                          : 99;
        if (dv >= base) return 0;
        if (dv) nonzero = 1;
        if (m > (lim - (uint64_t)dv) / (uint64_t)base) over = 1;
        else m = m * (uint64_t)base + (uint64_t)dv;
        digits++;
    }
    if (!digits) return 0;
    if (decimal0 && nonzero && t.p[first] == '0') return 0; /* int('010', 0) */
    if (over) return 2;
    *v = !neg ? (int64_t)m : m > (uint64_t)INT64_MAX ? INT64_MIN : -(int64_t)m;
    return 1;
}

static locale_t c_numeric;
static pthread_once_t c_numeric_once = PTHREAD_ONCE_INIT;
static void make_c_numeric(void) { c_numeric = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0); }

/* strtod in the "C" locale whatever the host process set (a decimal comma
 * would stop it at the '.'); uselocale is per thread. */
static double strtod_c(const char *s) {
    pthread_once(&c_numeric_once, make_c_numeric);
    if (c_numeric == (locale_t)0) return strtod(s, NULL); /* no memory: as the process */
    locale_t old = uselocale(c_numeric);
    double f = strtod(s, NULL);
    uselocale(old);
    return f;
}

/* int(float(t)) for a stripped string: Python's float() syntax (decimal
 * with optional fraction and exponent, underscores between digits, inf /
 * infinity / nan in any case, optional sign), parsed in the "C" locale.
 * *r = 1 and *v: the value truncated toward zero; *r = 0: ValueError or
 * OverflowError (NaN, infinity, 1e400), which jinja2 turns into the default;
 * *r = 2: finite but beyond int64. Fails only for the arena. */
static kvc_status py_float_to_int(ctx *c, str t, int64_t *v, int *r) {
    size_t n = 0, i = 0;
    *r = 0;
    if (t.n == 0) return KVC_OK;
    char *buf; /* t without underscores, NUL-terminated */
    ALLOC(c, buf, t.n + 1);
    if (t.p[i] == '+' || t.p[i] == '-') buf[n++] = t.p[i++];
    str rest = {t.p + i, t.n - i};
    static const char *const words[] = {"inf", "infinity", "nan"}; /* int() refuses all */
    for (int w = 0; w < 3; w++) {
        size_t wl = strlen(words[w]);
        if (rest.n != wl) continue;
        size_t k = 0;
        while (k < wl && (rest.p[k] | 0x20) == words[w][k]) k++;
        if (k == wl) return KVC_OK;
    }
    int digits = 0, in_exp = 0, seen_dot = 0;
    for (; i < t.n; i++) {
        char ch = t.p[i];
        int prev_digit = i > 0 && t.p[i - 1] >= '0' && t.p[i - 1] <= '9';
        int next_digit = i + 1 < t.n && t.p[i + 1] >= '0' && t.p[i + 1] <= '9';
        if (ch >= '0' && ch <= '9') {
            digits++;
        } else if (ch == '_') {
            if (!prev_digit || !next_digit) return KVC_OK;
            continue;
        } else if (ch == '.' && !seen_dot && !in_exp) {
            seen_dot = 1;
        } else if ((ch | 0x20) == 'e' && digits && !in_exp) {
            in_exp = 1;
            buf[n++] = 'e';
            if (i + 1 < t.n && (t.p[i + 1] == '+' || t.p[i + 1] == '-')) buf[n++] = t.p[++i];
            if (!next_digit && !(i + 1 < t.n && t.p[i + 1] >= '0' && t.p[i + 1] <= '9'))
                return KVC_OK;
            continue;
        } else {
            return KVC_OK;
        }
        buf[n++] = ch;
    }
    if (!digits) return KVC_OK;
    buf[n] = 0;
    double f = strtod_c(buf);
    if (f - f != 0) return KVC_OK; /* 1e400: infinity */
    if (f >= 9223372036854775808.0 || f < -9223372036854775808.0) {
        *r = 2;
        return KVC_OK;
    }
    *v = (int64_t)f;
    *r = 1;
    return KVC_OK;
}

static kvc_status apply_filter(ctx *c, const node *n, str f, value x, const args *ap,
                               value *out);
static kvc_status apply_test(ctx *c, const node *n, str t, const value *x, const args *a,
                             int *r);

/* jinja2's attribute getter for selectattr / rejectattr / map(attribute=):
 * dotted parts, the all-digit ones as integer indexes, each looked up as
 * jinja2's getitem does (the item, else the attribute: loop.index, d.items). */
static kvc_status get_path(ctx *c, const node *n, const value *item, str path, value *out) {
    value v = *item;
    KVC_TRY(charge(c, path.n));
    for (size_t i = 0; i <= path.n;) {
        size_t j = i;
        while (j < path.n && path.p[j] != '.') j++;
        str part = {path.p + i, j - i};
        int digits = part.n > 0 && part.n < 18;
        int64_t idx = 0;
        for (size_t k = 0; k < part.n && digits; k++) {
            digits = part.p[k] >= '0' && part.p[k] <= '9';
            idx = idx * 10 + (part.p[k] - '0');
        }
        if (v.t == V_UNDEF) return kvc__chat_undefined_error(n);
        value key = digits ? v_int(idx) : v_str(part.p, part.n), next;
        KVC_TRY(kvc__chat_get_item(c, n, &v, &key, &next));
        v = next;
        i = j + 1;
    }
    *out = v;
    return KVC_OK;
}

/* The filters that give a generator in jinja2: select, reject, selectattr,
 * rejectattr, map, items. *handled 0: f is none of them. */
static kvc_status generator_filter(ctx *c, const node *n, str f, const value *x, const args *a,
                                   value *out, int *handled) {
    int sel = str_eq(f, "select"), rej = str_eq(f, "reject");
    int sel_attr = str_eq(f, "selectattr"), rej_attr = str_eq(f, "rejectattr");
    int map = str_eq(f, "map"), items_f = str_eq(f, "items");
    *handled = sel || rej || sel_attr || rej_attr || map || items_f;
    if (!*handled) return KVC_OK;
    value items, res;
    if (items_f) {
        if (a->n_pos || a->n_kw) return kvc__chat_runtime_error(n, "items() takes no arguments");
        if (x->t != V_UNDEF && x->t != V_DICT)
            return kvc__chat_runtime_error(n, "Can only get item pairs from a mapping.");
        KVC_TRY(kvc__chat_new_list(c, x->t == V_DICT ? x->u.d->n : 0, &res));
        res.u.l->kind = L_GEN;
        for (size_t i = 0; x->t == V_DICT && i < x->u.d->n; i++) {
            value pair;
            KVC_TRY(kvc__chat_new_list(c, 2, &pair));
            pair.u.l->kind = L_TUPLE;
            KVC_TRY(kvc__chat_list_push(c, pair.u.l,
                                        v_str(x->u.d->keys[i].p, x->u.d->keys[i].n)));
            KVC_TRY(kvc__chat_list_push(c, pair.u.l, x->u.d->vals[i]));
            KVC_TRY(kvc__chat_list_push(c, res.u.l, pair));
        }
        *out = res;
        return KVC_OK;
    }
    int t;
    KVC_TRY(kvc__chat_truth(c, x, &t));
    if (!t) { /* jinja2 looks at nothing else, not even the names */
        KVC_TRY(kvc__chat_new_list(c, 0, out));
        out->u.l->kind = L_GEN;
        return KVC_OK;
    }
    /* jinja2 takes the test / filter / attribute name, then passes on the
     * rest of the arguments */
    args rest = *a;
    str name = {NULL, 0}, attr = {NULL, 0};
    const value *dflt = NULL;
    int by_attr = sel_attr || rej_attr;
    if (map) {
        const value *at = NULL;
        for (size_t k = 0; k < a->n_kw; k++)
            if (str_eq(a->kw_names[k], "attribute")) at = &a->kw[k];
        if (at) { /* map(attribute=..., default=...) */
            for (size_t k = 0; k < a->n_kw; k++)
                if (str_eq(a->kw_names[k], "default"))
                    dflt = &a->kw[k];
                else if (!str_eq(a->kw_names[k], "attribute"))
                    return kvc__chat_runtime_error(n, "Unexpected keyword argument '%.*s'",
                                                   (int)(a->kw_names[k].n < 40
                                                             ? a->kw_names[k].n : 40),
                                                   a->kw_names[k].p);
            if (a->n_pos) return kvc__chat_runtime_error(n, "map(): positional arguments "
                                                            "with attribute=");
            KVC_TRY(kvc__chat_to_str(c, at, &attr));
            by_attr = 1;
        } else {
            if (!a->n_pos) return kvc__chat_runtime_error(n, "map requires a filter argument");
            KVC_TRY(kvc__chat_want_str(n, &a->pos[0], "map()'s filter name", &name));
            if (!kvc__chat_filter_known(name))
                return kvc__chat_runtime_error(n, "No filter named '%.*s'.",
                                               (int)(name.n < 40 ? name.n : 40), name.p);
        }
    } else {
        size_t skip = 0; /* keyword arguments go to the test, as in jinja2 */
        if (by_attr) {
            if (!a->n_pos) return kvc__chat_runtime_error(n, "Missing parameter for attribute name");
            KVC_TRY(kvc__chat_to_str(c, &a->pos[0], &attr));
            skip = 1;
        }
        if (a->n_pos > skip) {
            KVC_TRY(kvc__chat_want_str(n, &a->pos[skip], "the test name", &name));
            if (!kvc__chat_test_known(name))
                return kvc__chat_runtime_error(n, "No test named '%.*s'.",
                                               (int)(name.n < 40 ? name.n : 40), name.p);
            skip++;
        }
        rest.n_pos = a->n_pos - skip;
        memmove(rest.pos, a->pos + skip, rest.n_pos * sizeof *rest.pos);
    }
    if (map && !by_attr) {
        rest.n_pos = a->n_pos - 1;
        memmove(rest.pos, a->pos + 1, rest.n_pos * sizeof *rest.pos);
    }
    KVC_TRY(kvc__chat_iter_items(c, n, x, &items));
    KVC_TRY(kvc__chat_new_list(c, items.u.l->n, &res));
    res.u.l->kind = L_GEN;
    for (size_t i = 0; i < items.u.l->n; i++) {
        const value *item = &items.u.l->items[i];
        value v = *item;
        if (++c->steps > MAX_STEPS)
            return kvc__chat_runtime_error(n, "more than %lld loop iterations",
                                           (long long)MAX_STEPS);
        if (by_attr) KVC_TRY(get_path(c, n, item, attr, &v));
        if (map) {
            if (by_attr) {
                if (v.t == V_UNDEF && dflt) v = *dflt;
            } else {
                KVC_TRY(apply_filter(c, n, name, v, &rest, &v));
            }
            KVC_TRY(kvc__chat_list_push(c, res.u.l, v));
            continue;
        }
        int keep = 0;
        if (name.p)
            KVC_TRY(apply_test(c, n, name, &v, &rest, &keep));
        else
            KVC_TRY(kvc__chat_truth(c, &v, &keep));
        if (keep == (sel || sel_attr)) KVC_TRY(kvc__chat_list_push(c, res.u.l, *item));
    }
    *out = res;
    return KVC_OK;
}

/* jinja2's TemplateRuntimeError for a name it did not know when compiling. */
static kvc_status unknown_name(const node *n) {
    return kvc__chat_runtime_error(n, "No %s named '%.*s' found.",
                                   n->k == E_FILTER ? "filter" : "test",
                                   (int)(n->name.n < 40 ? n->name.n : 40), n->name.p);
}

kvc_status kvc__chat_eval_filter(ctx *c, const node *n, value *out) {
    value x;
    args a;
    if (n->unknown) return unknown_name(n);
    KVC_TRY(kvc__chat_eval(c, n->a, &x));
    KVC_TRY(kvc__chat_eval_args(c, n, &a));
    return apply_filter(c, n, n->name, x, &a, out);
}

/* Filter f on x with arguments a; n is the node for error lines (its n->a
 * the input's node). map() calls it by name for each item. */
static kvc_status apply_filter(ctx *c, const node *n, str f, value x, const args *ap,
                               value *out) {
    const args a = *ap;
    str s;
    value gen_res;
    int handled = 0;
    KVC_TRY(generator_filter(c, n, f, &x, &a, &gen_res, &handled));
    if (handled) {
        *out = gen_res;
        return KVC_OK;
    }
    for (size_t i = 0; i < sizeof filter_params / sizeof filter_params[0]; i++)
        if (str_eq(f, filter_params[i].name))
            KVC_TRY(check_params(n, &a, filter_params[i].name, filter_params[i].params,
                                 filter_params[i].n, filter_params[i].required));
    if (str_eq(f, "default") || str_eq(f, "d")) {
        const value *dflt = kvc__chat_arg(&a, 0, "default_value");
        const value *boolean = kvc__chat_arg(&a, 1, "boolean");
        int use = x.t == V_UNDEF, b = 0, t = 1;
        if (!use && boolean) KVC_TRY(kvc__chat_truth(c, boolean, &b));
        if (b) KVC_TRY(kvc__chat_truth(c, &x, &t));
        use = use || !t;
        *out = use ? (dflt ? *dflt : v_str("", 0)) : x;
        return KVC_OK;
    }
    if (str_eq(f, "length") || str_eq(f, "count")) {
        switch (x.t) {
        case V_STR:
            KVC_TRY(charge(c, x.u.s.n));
            *out = v_int((int64_t)kvc__chat_str_len_cp(x.u.s));
            return KVC_OK;
        case V_LIST:
            if (x.u.l->kind == L_GEN)
                return kvc__chat_runtime_error(n, "object of type 'generator' has no len()");
            *out = v_int((int64_t)x.u.l->n);
            return KVC_OK;
        case V_DICT: *out = v_int((int64_t)x.u.d->n); return KVC_OK;
        case V_LOOP: /* loop.length */
            KVC_TRY(kvc__chat_loop_pull(c, x.u.lp, INT64_MAX));
            *out = v_int((int64_t)x.u.lp->items->n);
            return KVC_OK;
        case V_UNDEF: *out = v_int(0); return KVC_OK;
        default:
            return kvc__chat_runtime_error(n, "object of type '%s' has no len()",
                                           kvc__chat_type_name(&x));
        }
    }
    if (str_eq(f, "first") || str_eq(f, "last")) {
        value items;
        if (f.p[0] == 'l' && x.t == V_LIST && x.u.l->kind == L_GEN) /* reversed() refuses it */
            return kvc__chat_runtime_error(n, "'generator' object is not reversible");
        KVC_TRY(kvc__chat_iter_items(c, n, &x, &items));
        *out = items.u.l->n ? items.u.l->items[f.p[0] == 'f' ? 0 : items.u.l->n - 1] : v_undef();
        return KVC_OK;
    }
    if (str_eq(f, "list")) {
        KVC_TRY(kvc__chat_iter_items(c, n, &x, out));
        if (out->t == V_LIST && out->u.l->kind != L_LIST) { /* list(pair), list(range) */
            value l;
            KVC_TRY(kvc__chat_new_list(c, out->u.l->n, &l));
            for (size_t i = 0; i < out->u.l->n; i++)
                KVC_TRY(kvc__chat_list_push(c, l.u.l, out->u.l->items[i]));
            *out = l;
        }
        return KVC_OK;
    }
    if (str_eq(f, "safe")) { /* jinja2's Markup(x): a string (that escapes what + adds) */
        if (x.t == V_STR) {
            *out = x;
            return KVC_OK;
        }
        KVC_TRY(kvc__chat_to_str(c, &x, &s));
        *out = v_str(s.p, s.n);
        return KVC_OK;
    }
    if (str_eq(f, "join")) {
        value items;
        str sep = {"", 0}, attr = {NULL, 0};
        const value *d = kvc__chat_arg(&a, 0, "d");
        if (d) KVC_TRY(kvc__chat_to_str(c, d, &sep));
        const value *at = kvc__chat_arg(&a, 1, "attribute"); /* join each item's attribute */
        if (at && at->t != V_NONE) KVC_TRY(kvc__chat_to_str(c, at, &attr));
        KVC_TRY(kvc__chat_iter_items(c, n, &x, &items));
        sbuf b = {NULL, 0, 0};
        for (size_t i = 0; i < items.u.l->n; i++) {
            str e;
            value v = items.u.l->items[i];
            if (i) KVC_TRY(kvc__chat_sb_put(c, &b, sep.p, sep.n));
            if (attr.p) KVC_TRY(get_path(c, n, &items.u.l->items[i], attr, &v));
            KVC_TRY(kvc__chat_to_str(c, &v, &e));
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
        if (x.t != V_STR) { /* reversed(x): a one-shot iterator; a generator (not
                             * reversible) becomes a reversed list */
            if (x.t != V_LIST || x.u.l->kind != L_GEN) res.u.l->kind = L_GEN;
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
        if (x.t == V_UNDEF) return kvc__chat_undefined_error(n->a); /* int(Undefined) raises */
        if (is_num(&x)) {
            *out = v_int(x.u.i);
            return KVC_OK;
        }
        const value *d = kvc__chat_arg(&a, 0, "default"), *b = kvc__chat_arg(&a, 1, "base");
        *out = d ? *d : v_int(0);
        if (x.t != V_STR) return KVC_OK; /* int(None), int([..]): TypeError, the default */
        KVC_TRY(charge(c, x.u.s.n));
        /* jinja2: int(s, base), and when that raises ValueError int(float(s))
         * ("42.23"|int is 42), and when that fails too the default; a base
         * that is not an integer fails the same way as a bad digit. Python's
         * big ints are refused. */
        str t = strip_num_space(x.u.s);
        int64_t v;
        int r = py_int(t, b ? (is_num(b) ? b->u.i : -1) : 10, &v);
        if (r == 0) KVC_TRY(py_float_to_int(c, t, &v, &r));
        if (r == 2) return kvc__chat_runtime_error(n, "int: '%.*s' is beyond 64-bit integers",
                                                   (int)(t.n < 40 ? t.n : 40), t.p);
        if (r == 1) *out = v_int(v);
        return KVC_OK;
    }
    if (str_eq(f, "tojson")) {
        return kvc__chat_tojson(c, n, &x, &a, out);
    }
    static const char *const on_str[] = {"string", "trim",       "upper",  "lower",
                                         "title",  "capitalize", "replace"};
    size_t k = 0;
    while (k < sizeof on_str / sizeof on_str[0] && !str_eq(f, on_str[k])) k++;
    if (k == sizeof on_str / sizeof on_str[0]) /* jinja2 has it (the parser checked), kvcache not */
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: filter '%.*s' is not supported", n->line,
                          (int)(f.n < 40 ? f.n : 40), f.p);
    /* The rest work on str(x). */
    KVC_TRY(kvc__chat_to_str(c, &x, &s));
    if (str_eq(f, "string")) {
        *out = v_str(s.p, s.n);
        return KVC_OK;
    }
    if (str_eq(f, "trim")) {
        const value *ch = kvc__chat_arg(&a, 0, "chars");
        str chars = {NULL, 0};
        if (ch && ch->t != V_NONE) KVC_TRY(kvc__chat_want_str(n, ch, "trim() chars", &chars));
        str r;
        KVC_TRY(kvc__chat_strip_chars(c, s, ch && ch->t != V_NONE ? &chars : NULL, 1, 1, &r));
        *out = v_str(r.p, r.n);
        return KVC_OK;
    }
    if (str_eq(f, "upper")) return kvc__chat_map_case(c, s, 'u', out);
    if (str_eq(f, "lower")) return kvc__chat_map_case(c, s, 'l', out);
    if (str_eq(f, "capitalize")) return kvc__chat_map_case(c, s, 'c', out);
    if (str_eq(f, "title")) return kvc__chat_map_case(c, s, 't', out);
    /* replace: str(s).replace(str(old), str(new), count) without autoescape
     * ('x'|replace('x', 1) is '1'; it was refused) */
    str old = {NULL, 0}, rep = {NULL, 0};
    KVC_TRY(kvc__chat_to_str(c, kvc__chat_arg(&a, 0, "old"), &old));
    KVC_TRY(kvc__chat_to_str(c, kvc__chat_arg(&a, 1, "new"), &rep));
    const value *cnt = kvc__chat_arg(&a, 2, "count");
    if (cnt && cnt->t != V_NONE && !is_num(cnt))
        return kvc__chat_runtime_error(n, "count must be an integer");
    return kvc__chat_str_replace(c, n, s, old, rep, cnt && cnt->t != V_NONE ? cnt->u.i : -1, out);
}

/* ---- tests -------------------------------------------------------------------- */

/* The names jinja2's default environment (and transformers') has. */
static const char *const known_filters[] = {
    "abs",         "attr",     "batch",      "capitalize", "center",       "count",
    "d",           "default",  "dictsort",   "e",          "escape",       "filesizeformat",
    "first",       "float",    "forceescape", "format",    "groupby",      "indent",
    "int",         "items",    "join",       "last",       "length",       "list",
    "lower",       "map",      "max",        "min",        "pprint",       "random",
    "reject",      "rejectattr", "replace",  "reverse",    "round",        "safe",
    "select",      "selectattr", "slice",    "sort",       "string",       "striptags",
    "sum",         "title",    "tojson",     "trim",       "truncate",     "unique",
    "upper",       "urlencode", "urlize",    "wordcount",  "wordwrap",     "xmlattr",
};
static const char *const known_tests[] = {
    "boolean", "callable", "defined",  "divisibleby", "eq",      "equalto",  "escaped",
    "even",    "false",    "filter",   "float",       "ge",      "greaterthan", "gt",
    "in",      "integer",  "iterable", "le",          "lessthan", "lower",   "lt",
    "mapping", "ne",       "none",     "number",      "odd",     "sameas",   "sequence",
    "string",  "test",     "true",     "undefined",   "upper",   "==",       "!=",
    ">",       ">=",       "<",        "<=",
};

static int in_names(str s, const char *const *names, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (str_eq(s, names[i])) return 1;
    return 0;
}
int kvc__chat_filter_known(str name) {
    return in_names(name, known_filters, sizeof known_filters / sizeof known_filters[0]);
}
int kvc__chat_test_known(str name) {
    return in_names(name, known_tests, sizeof known_tests / sizeof known_tests[0]);
}

/* Test t on x with arguments a into *r; n for error lines. */
static kvc_status apply_test(ctx *c, const node *n, str t, const value *x, const args *a,
                             int *r) {
    if (str_eq(t, "None")) t.p = "none"; /* the parser lets None / True / False through */
    if (str_eq(t, "True")) t.p = "true";
    if (str_eq(t, "False")) t.p = "false";
    /* Python's argument binding: the tests taking one argument, and its name */
    static const char *const one_arg[][2] = {
        {"eq", "other"},  {"equalto", "other"}, {"==", "other"},    {"ne", "other"},
        {"!=", "other"},  {"gt", "other"},      {"greaterthan", "other"}, {">", "other"},
        {"ge", "other"},  {">=", "other"},      {"lt", "other"},    {"lessthan", "other"},
        {"<", "other"},   {"le", "other"},      {"<=", "other"},    {"in", "seq"},
        {"divisibleby", "num"}, {"sameas", "other"}};
    const char *param = NULL;
    for (size_t i = 0; i < sizeof one_arg / sizeof one_arg[0]; i++)
        if (str_eq(t, one_arg[i][0])) param = one_arg[i][1];
    if (a->n_pos + a->n_kw > (param ? 1u : 0u) || (a->n_kw && !str_eq(a->kw_names[0], param)))
        return kvc__chat_runtime_error(n, "test '%.*s' got unexpected arguments",
                                       (int)(t.n < 40 ? t.n : 40), t.p);
    const value *y = param ? kvc__chat_arg(a, 0, param) : NULL;
    if (str_eq(t, "defined"))
        *r = x->t != V_UNDEF;
    else if (str_eq(t, "undefined"))
        *r = x->t == V_UNDEF;
    else if (str_eq(t, "none"))
        *r = x->t == V_NONE;
    else if (str_eq(t, "string"))
        *r = x->t == V_STR;
    else if (str_eq(t, "number"))
        *r = is_num(x);
    else if (str_eq(t, "integer"))
        *r = x->t == V_INT;
    else if (str_eq(t, "float")) /* kvcache has no floats */
        *r = 0;
    else if (str_eq(t, "boolean"))
        *r = x->t == V_BOOL;
    else if (str_eq(t, "true"))
        *r = x->t == V_BOOL && x->u.i;
    else if (str_eq(t, "false"))
        *r = x->t == V_BOOL && !x->u.i;
    else if (str_eq(t, "mapping"))
        *r = x->t == V_DICT;
    else if (str_eq(t, "callable"))
        /* Undefined has __call__, and so has LoopContext (for recursive loops) */
        *r = x->t == V_FUNC || x->t == V_MACRO || x->t == V_UNDEF || x->t == V_LOOP;
    else if (str_eq(t, "iterable")) /* Undefined: empty, as jinja2 */
        *r = x->t == V_STR || x->t == V_LIST || x->t == V_DICT || x->t == V_UNDEF ||
             x->t == V_LOOP;
    else if (str_eq(t, "sequence")) { /* len() and [] both work: not on dict views */
        if (x->t == V_LOOP) KVC_TRY(kvc__chat_loop_pull(c, x->u.lp, INT64_MAX)); /* len() */
        *r = x->t == V_STR || (x->t == V_LIST && x->u.l->kind <= L_RANGE) || x->t == V_DICT ||
             x->t == V_UNDEF;
    } else if (str_eq(t, "filter") || str_eq(t, "test")) {
        /* `x in env.filters`: lists, dicts and sets-like views are unhashable */
        if ((x->t == V_DICT && !x->u.d->is_namespace) ||
            (x->t == V_LIST && (x->u.l->kind == L_LIST || x->u.l->kind == L_KEYS ||
                                x->u.l->kind == L_ITEMS)))
            return kvc__chat_runtime_error(n, "unhashable type: '%s'", kvc__chat_type_name(x));
        *r = x->t == V_STR &&
             (t.p[0] == 'f' ? kvc__chat_filter_known(x->u.s) : kvc__chat_test_known(x->u.s));
    }
    else if (str_eq(t, "even") || str_eq(t, "odd")) {
        if (!is_num(x))
            return kvc__chat_runtime_error(n, "'%.*s' test needs an integer", (int)t.n, t.p);
        *r = (x->u.i % 2 != 0) == str_eq(t, "odd");
    } else if (str_eq(t, "divisibleby")) {
        if (!y || !is_num(x) || !is_num(y))
            return kvc__chat_runtime_error(n, "divisibleby needs two integers");
        if (y->u.i == 0) return kvc__chat_runtime_error(n, "integer division or modulo by zero");
        *r = y->u.i == -1 || x->u.i % y->u.i == 0;
    } else if (str_eq(t, "in")) {
        if (!y) return kvc__chat_runtime_error(n, "test 'in' needs an argument");
        KVC_TRY(kvc__chat_contains(c, n, x, y, r));
    } else {
        /* comparisons: eq / equalto / ==, ne / !=, gt / greaterthan / >, ge / >=,
         * lt / lessthan / <, le / <= */
        static const struct {
            const char *name;
            char op; /* '=' '!' '>' 'g' (>=) '<' 'l' (<=) */
        } cmps[] = {{"eq", '='}, {"equalto", '='}, {"==", '='}, {"ne", '!'}, {"!=", '!'},
                    {"gt", '>'}, {"greaterthan", '>'}, {">", '>'}, {"ge", 'g'}, {">=", 'g'},
                    {"lt", '<'}, {"lessthan", '<'}, {"<", '<'}, {"le", 'l'}, {"<=", 'l'}};
        size_t i = 0;
        while (i < sizeof cmps / sizeof cmps[0] && !str_eq(t, cmps[i].name)) i++;
        if (i == sizeof cmps / sizeof cmps[0]) /* known to jinja2 (sameas, lower, ...), not here */
            return kvc__error(KVC_ERR_UNSUPPORTED,
                              "chat template, line %d: test '%.*s' is not supported", n->line,
                              (int)(t.n < 40 ? t.n : 40), t.p);
        if (!y)
            return kvc__chat_runtime_error(n, "test '%.*s' needs an argument", (int)t.n, t.p);
        char op = cmps[i].op;
        if (op == '=' || op == '!') {
            KVC_TRY(charge(c, (x->t == V_STR ? x->u.s.n : 0) + 1));
            KVC_TRY(kvc__chat_equal(n, x, y, r));
            *r = *r == (op == '=');
        } else {
            int cmp = 0;
            KVC_TRY(kvc__chat_order(n, x, y, &cmp));
            *r = op == '>' ? cmp > 0 : op == 'g' ? cmp >= 0 : op == '<' ? cmp < 0 : cmp <= 0;
        }
    }
    return KVC_OK;
}

kvc_status kvc__chat_eval_test(ctx *c, const node *n, value *out) {
    value x;
    args a;
    if (n->unknown) return unknown_name(n);
    KVC_TRY(kvc__chat_eval(c, n->a, &x));
    KVC_TRY(kvc__chat_eval_args(c, n, &a));
    int r = 0;
    KVC_TRY(apply_test(c, n, n->name, &x, &a, &r));
    *out = v_bool(n->neg ? !r : r);
    return KVC_OK;
}
