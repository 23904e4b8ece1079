/* Chat templates (see chat.c): the two functions transformers adds to
 * jinja2's environment: the tojson filter (its own, replacing jinja2's: it
 * returns Python's json.dumps(x, ensure_ascii=False, indent=None,
 * separators=None, sort_keys=False) unescaped) and strftime_now(format)
 * (datetime.now().strftime(format)). */
#define _POSIX_C_SOURCE 200809L /* localtime_r, clock_gettime, newlocale, strftime_l */
#include <locale.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chat_internal.h"

/* ---- tojson ----------------------------------------------------------------------- */

typedef struct json_opts {
    int ascii;       /* ensure_ascii */
    int sort;        /* sort_keys */
    int indent;      /* indent is not None */
    str indent_str;  /* one level of indentation */
    str item_sep;    /* separators */
    str key_sep;
} json_opts;

/* A JSON string literal, escaped as json.dumps escapes it. */
static kvc_status json_str(ctx *c, sbuf *b, str s, const json_opts *o) {
    KVC_TRY(kvc__chat_sb_put(c, b, "\"", 1));
    size_t run = 0; /* start of the bytes copied as they are */
    for (size_t i = 0; i < s.n;) {
        unsigned char ch = (unsigned char)s.p[i];
        int len = 1;
        uint32_t cp = ch;
        if (ch >= 0x80) cp = kvc__utf8_decode((const unsigned char *)s.p + i, s.n - i, &len);
        /* ensure_ascii escapes all but ' '..'~'; else only '"', '\\' and controls */
        int esc = ch == '"' || ch == '\\' || ch < 0x20 || (o->ascii && (cp > 0x7E));
        if (!esc) {
            i += (size_t)len;
            continue;
        }
        KVC_TRY(kvc__chat_sb_put(c, b, s.p + run, i - run));
        char e[16];
        const char *short_esc = ch == '"'    ? "\\\""
                                : ch == '\\' ? "\\\\"
                                : ch == '\n' ? "\\n"
                                : ch == '\r' ? "\\r"
                                : ch == '\t' ? "\\t"
                                : ch == '\b' ? "\\b"
                                : ch == '\f' ? "\\f"
                                             : NULL;
        if (short_esc) {
            KVC_TRY(kvc__chat_sb_put(c, b, short_esc, strlen(short_esc)));
        } else if (cp >= 0x10000) { /* a surrogate pair */
            uint32_t v = cp - 0x10000;
            snprintf(e, sizeof e, "\\u%04x\\u%04x", (unsigned)(0xD800 + (v >> 10)),
                     (unsigned)(0xDC00 + (v & 0x3FF)));
            KVC_TRY(kvc__chat_sb_put(c, b, e, 12));
        } else {
            snprintf(e, sizeof e, "\\u%04x", (unsigned)cp);
            KVC_TRY(kvc__chat_sb_put(c, b, e, 6));
        }
        i += (size_t)len;
        run = i;
    }
    KVC_TRY(kvc__chat_sb_put(c, b, s.p + run, s.n - run));
    return kvc__chat_sb_put(c, b, "\"", 1);
}

/* A newline and `level` indentations (json.dumps with indent). */
static kvc_status json_newline(ctx *c, sbuf *b, const json_opts *o, int level) {
    KVC_TRY(kvc__chat_sb_put(c, b, "\n", 1));
    for (int i = 0; i < level; i++) KVC_TRY(kvc__chat_sb_put(c, b, o->indent_str.p, o->indent_str.n));
    return KVC_OK;
}

static int key_less(const str *x, const str *y) {
    size_t n = x->n < y->n ? x->n : y->n;
    int r = memcmp(x->p, y->p, n);
    return r < 0 || (r == 0 && x->n < y->n);
}

static kvc_status json_value(ctx *c, const node *n, sbuf *b, const value *v, const json_opts *o,
                             int level) {
    char num[32];
    if (level > MAX_EVAL_DEPTH) /* Python: RecursionError */
        return kvc__chat_runtime_error(n, "tojson: values nested too deeply");
    switch (v->t) {
    case V_NONE: return kvc__chat_sb_put(c, b, "null", 4);
    case V_BOOL: return v->u.i ? kvc__chat_sb_put(c, b, "true", 4) : kvc__chat_sb_put(c, b, "false", 5);
    case V_INT:
        snprintf(num, sizeof num, "%lld", (long long)v->u.i);
        return kvc__chat_sb_put(c, b, num, strlen(num));
    case V_STR: return json_str(c, b, v->u.s, o);
    case V_LIST:
        if (v->u.l->kind > L_TUPLE) break; /* range, views, generators: not serializable */
        if (v->u.l->n == 0) return kvc__chat_sb_put(c, b, "[]", 2);
        KVC_TRY(kvc__chat_sb_put(c, b, "[", 1));
        for (size_t i = 0; i < v->u.l->n; i++) {
            if (i) KVC_TRY(kvc__chat_sb_put(c, b, o->item_sep.p, o->item_sep.n));
            if (o->indent) KVC_TRY(json_newline(c, b, o, level + 1));
            KVC_TRY(json_value(c, n, b, &v->u.l->items[i], o, level + 1));
        }
        if (o->indent) KVC_TRY(json_newline(c, b, o, level));
        return kvc__chat_sb_put(c, b, "]", 1);
    case V_DICT: {
        const dict *d = v->u.d;
        if (d->is_namespace) break;
        if (d->n == 0) return kvc__chat_sb_put(c, b, "{}", 2);
        size_t *order;
        ALLOC(c, order, d->n);
        for (size_t i = 0; i < d->n; i++) order[i] = i;
        if (o->sort) { /* insertion sort by code point order (UTF-8 bytes sort the same) */
            KVC_TRY(charge(c, d->n * d->n));
            for (size_t i = 1; i < d->n; i++)
                for (size_t j = i; j > 0 && key_less(&d->keys[order[j]], &d->keys[order[j - 1]]);
                     j--) {
                    size_t t = order[j];
                    order[j] = order[j - 1];
                    order[j - 1] = t;
                }
        }
        KVC_TRY(kvc__chat_sb_put(c, b, "{", 1));
        for (size_t i = 0; i < d->n; i++) {
            if (i) KVC_TRY(kvc__chat_sb_put(c, b, o->item_sep.p, o->item_sep.n));
            if (o->indent) KVC_TRY(json_newline(c, b, o, level + 1));
            KVC_TRY(json_str(c, b, d->keys[order[i]], o));
            KVC_TRY(kvc__chat_sb_put(c, b, o->key_sep.p, o->key_sep.n));
            KVC_TRY(json_value(c, n, b, &d->vals[order[i]], o, level + 1));
        }
        if (o->indent) KVC_TRY(json_newline(c, b, o, level));
        return kvc__chat_sb_put(c, b, "}", 1);
    }
    default: break;
    }
    const char *type = v->t == V_UNDEF ? "Undefined"
                       : v->t == V_DICT ? "Namespace"
                                        : kvc__chat_type_name(v);
    return kvc__chat_runtime_error(n, "tojson: Object of type %s is not JSON serializable", type);
}

kvc_status kvc__chat_tojson(ctx *c, const node *n, const value *x, const args *a, value *out) {
    const value *ascii = kvc__chat_arg(a, 0, "ensure_ascii"), *indent = kvc__chat_arg(a, 1, "indent");
    const value *seps = kvc__chat_arg(a, 2, "separators"), *sort = kvc__chat_arg(a, 3, "sort_keys");
    json_opts o;
    memset(&o, 0, sizeof o);
    if (ascii) KVC_TRY(kvc__chat_truth(c, ascii, &o.ascii));
    if (sort) KVC_TRY(kvc__chat_truth(c, sort, &o.sort));
    if (indent && indent->t != V_NONE) {
        o.indent = 1;
        if (is_num(indent)) { /* ' ' * n: nothing for n <= 0 */
            int64_t k = indent->u.i;
            if (k > 1 << 20) return kvc__chat_over_cap(c);
            char *sp;
            ALLOC(c, sp, k > 0 ? (size_t)k : 1);
            if (k > 0) memset(sp, ' ', (size_t)k);
            o.indent_str.p = sp;
            o.indent_str.n = k > 0 ? (size_t)k : 0;
        } else if (indent->t == V_STR) {
            o.indent_str = indent->u.s;
        } else {
            return kvc__chat_runtime_error(n, "tojson: indent must be an integer or a string");
        }
    }
    o.item_sep.p = o.indent ? "," : ", ";
    o.item_sep.n = o.indent ? 1 : 2;
    o.key_sep.p = ": ";
    o.key_sep.n = 2;
    if (seps && seps->t != V_NONE) { /* (item_separator, key_separator) */
        if (seps->t != V_LIST || seps->u.l->kind > L_TUPLE || seps->u.l->n != 2 ||
            seps->u.l->items[0].t != V_STR || seps->u.l->items[1].t != V_STR)
            return kvc__chat_runtime_error(n, "tojson: separators must be two strings");
        o.item_sep = seps->u.l->items[0].u.s;
        o.key_sep = seps->u.l->items[1].u.s;
    }
    sbuf b = {NULL, 0, 0};
    KVC_TRY(json_value(c, n, &b, x, &o, 0));
    *out = v_str(b.p ? b.p : "", b.n);
    return KVC_OK;
}

/* ---- strftime_now ---------------------------------------------------------------- */

static locale_t c_time;
static pthread_once_t c_time_once = PTHREAD_ONCE_INIT;
static void make_c_time(void) {
    c_time = newlocale(LC_TIME_MASK, "C", (locale_t)0);
}

/* Python's datetime.now().strftime(fmt) for a naive local time: %f is the
 * microseconds, %z and %Z are empty, the rest is the C library's strftime
 * in the "C" locale (Python leaves LC_TIME alone), its result up to 256
 * bytes per format byte. */
kvc_status kvc__chat_strftime_now(ctx *c, const node *n, const args *a, value *out) {
    if (a->n_pos + a->n_kw != 1)
        return kvc__chat_runtime_error(n, "strftime_now() takes exactly one argument");
    str fmt;
    KVC_TRY(kvc__chat_want_str(n, kvc__chat_arg(a, 0, "format"), "strftime_now()'s format", &fmt));
    if (memchr(fmt.p, 0, fmt.n)) return kvc__chat_runtime_error(n, "embedded null character");
    if (fmt.n > 4096) return kvc__chat_runtime_error(n, "strftime_now(): format too long");
    KVC_TRY(charge(c, fmt.n * 256));
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    time_t now = ts.tv_sec;
    if (!localtime_r(&now, &tm)) return kvc__chat_runtime_error(n, "strftime_now(): no local time");
    /* the format with %f, %z, %Z replaced, as datetime.strftime does */
    char *f2;
    ALLOC(c, f2, fmt.n * 3 + 1);
    size_t k = 0;
    for (size_t i = 0; i < fmt.n; i++) {
        if (fmt.p[i] == '%' && i + 1 < fmt.n) {
            char d = fmt.p[i + 1];
            if (d == 'f') {
                k += (size_t)snprintf(f2 + k, 7, "%06ld", (long)(ts.tv_nsec / 1000));
                i++;
                continue;
            }
            if (d == 'z' || d == 'Z') {
                i++;
                continue;
            }
            f2[k++] = '%';
            f2[k++] = d;
            i++;
            continue;
        }
        f2[k++] = fmt.p[i];
    }
    f2[k] = 0;
    if (k == 0) {
        *out = v_str("", 0);
        return KVC_OK;
    }
    pthread_once(&c_time_once, make_c_time);
    size_t cap = 1024;
    /* the format comes from the template: strftime is what Python calls with it */
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
#endif
    for (;;) {
        char *buf;
        ALLOC(c, buf, cap);
        size_t r = c_time != (locale_t)0 ? strftime_l(buf, cap, f2, &tm, c_time)
                                         : strftime(buf, cap, f2, &tm);
        if (r > 0 || cap >= 256 * k) {
            *out = v_str(buf, r);
            return KVC_OK;
        }
        cap *= 2;
    }
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
}
