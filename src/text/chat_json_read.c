/* Chat templates (see chat.c): the reader of kvc_chat_apply_template_json's
 * context, a JSON object whose members become the template's variables.
 *
 * Strict RFC 8259, with Python's json.loads as the reference for what a
 * document means: strings, integers, true / false, null -> None, arrays ->
 * lists, objects -> dicts in document order, a duplicate key keeping its
 * first place and its last value (as Python's dict does). Refused
 * deliberately, KVC_ERR_INVALID_ARG "context JSON, offset N: ...":
 * anything json.loads refuses (trailing commas, leading zeros, control
 * characters in strings, extra data, ...), and also invalid UTF-8, a byte
 * order mark, lone surrogate escapes (\ud800 not followed by a low
 * surrogate: json.loads keeps it, but it is no UTF-8 text) and arrays /
 * objects nested more than MAX_VALUE_DEPTH deep. Refused as
 * KVC_ERR_UNSUPPORTED, naming the value's path, once the whole document has
 * been found well-formed: what json.loads reads as a float (a fraction, an
 * exponent, NaN, Infinity, -Infinity: the interpreter has no floats) and
 * integers beyond 64 bits.
 *
 * Every string, list and dict lives in the interpreter's arena and counts
 * toward its byte cap (MAX_BYTES); objects with many members are
 * de-duplicated through a hash table, so reading is linear in the input.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "chat_internal.h"

/* Where a value sits, for messages: member `key` of the level above, or item `index`. */
typedef struct jpath {
    const struct jpath *up;
    str key;
    size_t index;
    int is_key;
} jpath;

typedef struct jr {
    ctx *c;
    const unsigned char *s;
    size_t n, i;
    char unsup[384]; /* the first unsupported value's message ("" if none) */
} jr;

static kvc_status jerr(const jr *r, size_t at, const char *fmt, ...) KVC_PRINTF(3, 4);
static kvc_status jerr(const jr *r, size_t at, const char *fmt, ...) {
    (void)r;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return kvc__error(KVC_ERR_INVALID_ARG, "context JSON, offset %zu: %s", at, msg);
}

/* An arena allocation failed, in the reader or in a list / dict it called. */
static kvc_status jalloc_failed(const jr *r) {
    if (!r->c->ar.over) return kvc__chat_nomem();
    return jerr(r, r->i, "the context passes %zu MiB (with the template's parse tree)",
                MAX_BYTES >> 20);
}

#define JALLOC(r, ptr, count)                                                                      \
    do {                                                                                           \
        (ptr) = kvc__chat_arena_alloc(&(r)->c->ar, sizeof *(ptr) * (size_t)(count));               \
        if (!(ptr)) return jalloc_failed(r);                                                       \
    } while (0)

#define JTRY(r, expr)                                                                              \
    do {                                                                                           \
        kvc_status st_ = (expr);                                                                   \
        if (st_ != KVC_OK) return (r)->c->ar.over ? jalloc_failed(r) : st_;                        \
    } while (0)

/* The path as Python subscripts: messages[0]['tool_calls'] (keys cut at 40 bytes). */
static void format_path(const jpath *p, char *out, size_t cap) {
    const jpath *chain[MAX_VALUE_DEPTH + 2];
    int n = 0;
    for (; p && n < (int)(sizeof chain / sizeof chain[0]); p = p->up) chain[n++] = p;
    size_t k = 0;
    out[0] = 0;
    for (int i = n - 1; i >= 0 && k + 1 < cap; i--) {
        const jpath *q = chain[i];
        int kn = (int)(q->key.n < 40 ? q->key.n : 40);
        int w;
        if (!q->is_key)
            w = snprintf(out + k, cap - k, "[%zu]", q->index);
        else if (i == n - 1)
            w = snprintf(out + k, cap - k, "%.*s", kn, q->key.p);
        else
            w = snprintf(out + k, cap - k, "['%.*s']", kn, q->key.p);
        if (w < 0) break;
        k += (size_t)w;
        if (k >= cap) k = cap - 1;
    }
}

/* Remembers the first value the interpreter cannot hold; reading goes on so
 * a malformed document is reported as such. */
static void note_unsup(jr *r, size_t at, const jpath *p, const char *what) {
    if (r->unsup[0]) return;
    char path[256];
    format_path(p, path, sizeof path);
    snprintf(r->unsup, sizeof r->unsup, "context JSON, offset %zu (%s): %s", at,
             path[0] ? path : "?", what);
}

static void skip_ws(jr *r) {
    while (r->i < r->n &&
           (r->s[r->i] == ' ' || r->s[r->i] == '\t' || r->s[r->i] == '\n' || r->s[r->i] == '\r'))
        r->i++;
}

static int lit(const jr *r, const char *w) {
    size_t k = strlen(w);
    return r->n - r->i >= k && memcmp(r->s + r->i, w, k) == 0;
}

static kvc_status unexpected(const jr *r, const char *expected) {
    if (r->i >= r->n) return jerr(r, r->i, "the text ends where %s should be", expected);
    unsigned char ch = r->s[r->i];
    if (r->i == 0 && lit(r, "\xEF\xBB\xBF"))
        return jerr(r, 0, "a UTF-8 byte order mark (not allowed)");
    if (ch > 0x20 && ch < 0x7F) return jerr(r, r->i, "'%c' where %s should be", ch, expected);
    return jerr(r, r->i, "byte 0x%02X where %s should be", ch, expected);
}

static int hex4(const unsigned char *p, uint32_t *out) {
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) {
        unsigned ch = p[k];
        int d = ch >= '0' && ch <= '9'   ? (int)(ch - '0')
                : ch >= 'a' && ch <= 'f' ? (int)(ch - 'a' + 10)
                : ch >= 'A' && ch <= 'F' ? (int)(ch - 'A' + 10)
                                         : -1;
        if (d < 0) return 0;
        v = v * 16 + (uint32_t)d;
    }
    *out = v;
    return 1;
}

/* A string at r->i (the opening quote), decoded into the arena. */
static kvc_status read_string(jr *r, str *out) {
    size_t start = r->i + 1, j = start;
    while (j < r->n && r->s[j] != '"') j += r->s[j] == '\\' ? 2 : 1;
    if (j >= r->n) return jerr(r, r->i, "a string that is not closed");
    char *buf; /* escapes only shrink: the raw length is enough */
    JALLOC(r, buf, j - start + 1);
    size_t o = 0;
    for (size_t k = start; k < j;) {
        unsigned char ch = r->s[k];
        if (ch < 0x20) return jerr(r, k, "control character 0x%02X in a string (escape it)", ch);
        if (ch >= 0x80) {
            int adv;
            kvc__utf8_decode(r->s + k, j - k, &adv);
            if (adv == 1) return jerr(r, k, "invalid UTF-8 (byte 0x%02X)", ch);
            memcpy(buf + o, r->s + k, (size_t)adv);
            o += (size_t)adv;
            k += (size_t)adv;
            continue;
        }
        if (ch != '\\') {
            buf[o++] = (char)ch;
            k++;
            continue;
        }
        unsigned char e = r->s[k + 1]; /* k + 1 < j: the scan above skipped it */
        const char *simple = "\"\"\\\\//b\bf\fn\nr\rt\t";
        const char *m = e ? strchr(simple, e) : NULL;
        if (m && (m - simple) % 2 == 0) {
            buf[o++] = m[1];
            k += 2;
            continue;
        }
        if (e != 'u') {
            if (e > 0x20 && e < 0x7F) return jerr(r, k, "invalid escape '\\%c'", e);
            return jerr(r, k, "invalid escape (a backslash before byte 0x%02X)", e);
        }
        uint32_t cp, lo;
        if (j - k < 6 || !hex4(r->s + k + 2, &cp))
            return jerr(r, k, "invalid \\u escape (four hex digits expected)");
        size_t len = 6;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (!(j - k >= 12 && r->s[k + 6] == '\\' && r->s[k + 7] == 'u' &&
                  hex4(r->s + k + 8, &lo) && lo >= 0xDC00 && lo <= 0xDFFF))
                return jerr(r, k, "a lone surrogate \\u%04x (no UTF-8 text holds one)",
                            (unsigned)cp);
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            len = 12;
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return jerr(r, k, "a lone surrogate \\u%04x (no UTF-8 text holds one)", (unsigned)cp);
        }
        o += (size_t)kvc__utf8_encode(cp, (unsigned char *)buf + o);
        k += len;
    }
    buf[o] = 0;
    out->p = buf;
    out->n = o;
    r->i = j + 1;
    return KVC_OK;
}

/* A number at r->i: an int64, or noted as unsupported (None in its place). */
static kvc_status read_number(jr *r, const jpath *p, value *out) {
    size_t start = r->i;
    int neg = 0;
    *out = v_none();
    if (r->s[r->i] == '-') {
        neg = 1;
        r->i++;
        if (lit(r, "Infinity")) {
            r->i += 8;
            note_unsup(r, start, p, "-Infinity (a float: kvcache's templates have no floats)");
            return KVC_OK;
        }
    }
    if (r->i >= r->n || r->s[r->i] < '0' || r->s[r->i] > '9')
        return jerr(r, start, "a '-' without digits");
    uint64_t mag = 0, limit = neg ? (uint64_t)1 << 63 : ((uint64_t)1 << 63) - 1;
    int big = 0, is_float = 0;
    if (r->s[r->i] == '0') {
        r->i++;
        if (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9')
            return jerr(r, start, "a number with a leading zero");
    } else {
        while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') {
            unsigned d = r->s[r->i++] - '0';
            if (!big && mag > (limit - d) / 10)
                big = 1;
            else if (!big)
                mag = mag * 10 + d;
        }
    }
    if (r->i < r->n && r->s[r->i] == '.') {
        r->i++;
        if (r->i >= r->n || r->s[r->i] < '0' || r->s[r->i] > '9')
            return jerr(r, r->i, "a '.' without digits after it");
        while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') r->i++;
        is_float = 1;
    }
    if (r->i < r->n && (r->s[r->i] == 'e' || r->s[r->i] == 'E')) {
        r->i++;
        if (r->i < r->n && (r->s[r->i] == '+' || r->s[r->i] == '-')) r->i++;
        if (r->i >= r->n || r->s[r->i] < '0' || r->s[r->i] > '9')
            return jerr(r, r->i, "an exponent without digits");
        while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') r->i++;
        is_float = 1;
    }
    if (is_float)
        note_unsup(r, start,
                   p, "a number with a fraction or exponent (a float: kvcache's templates have no "
                      "floats)");
    else if (big)
        note_unsup(r, start, p, "an integer beyond 64 bits");
    else
        *out = v_int(neg ? (int64_t)(0 - mag) : (int64_t)mag);
    return KVC_OK;
}

static kvc_status read_value(jr *r, int depth, const jpath *p, value *out);

static uint64_t key_hash(str k) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < k.n; i++) h = (h ^ (unsigned char)k.p[i]) * 1099511628211ull;
    return h;
}

/* An object at r->i ('{'); its members' values sit at depth child_depth
 * (p NULL: the context itself, whose keys start the paths). */
static kvc_status read_object(jr *r, int child_depth, const jpath *p, value *out) {
    r->i++;
    str *keys = NULL;
    value *vals = NULL;
    size_t n = 0, cap = 0;
    skip_ws(r);
    if (r->i < r->n && r->s[r->i] == '}') {
        r->i++;
    } else {
        for (;;) {
            skip_ws(r);
            if (r->i >= r->n || r->s[r->i] != '"') return unexpected(r, "a string key");
            if (n == cap) {
                size_t ncap = cap ? 2 * cap : 8;
                str *nk;
                value *nv;
                JALLOC(r, nk, ncap);
                JALLOC(r, nv, ncap);
                if (n) {
                    memcpy(nk, keys, n * sizeof *nk);
                    memcpy(nv, vals, n * sizeof *nv);
                }
                keys = nk;
                vals = nv;
                cap = ncap;
            }
            KVC_TRY(read_string(r, &keys[n]));
            skip_ws(r);
            if (r->i >= r->n || r->s[r->i] != ':') return unexpected(r, "':'");
            r->i++;
            jpath here = {p, keys[n], 0, 1};
            KVC_TRY(read_value(r, child_depth, &here, &vals[n]));
            n++;
            skip_ws(r);
            if (r->i < r->n && r->s[r->i] == ',') {
                r->i++;
                continue;
            }
            if (r->i < r->n && r->s[r->i] == '}') {
                r->i++;
                break;
            }
            return unexpected(r, "',' or '}'");
        }
    }
    /* duplicate keys: the first place, the last value (in place: u <= i) */
    size_t u = 0;
    if (n <= 8) {
        for (size_t i = 0; i < n; i++) {
            size_t k = 0;
            while (k < u &&
                   !(keys[k].n == keys[i].n && memcmp(keys[k].p, keys[i].p, keys[i].n) == 0))
                k++;
            if (k == u) keys[u++] = keys[i];
            vals[k] = vals[i];
        }
    } else {
        size_t size = 16;
        while (size < 2 * n) size *= 2;
        size_t *slot; /* index + 1 into keys[0..u), 0 for empty */
        JALLOC(r, slot, size);
        memset(slot, 0, size * sizeof *slot);
        for (size_t i = 0; i < n; i++) {
            size_t h = (size_t)key_hash(keys[i]) & (size - 1);
            while (slot[h] && !(keys[slot[h] - 1].n == keys[i].n &&
                                memcmp(keys[slot[h] - 1].p, keys[i].p, keys[i].n) == 0))
                h = (h + 1) & (size - 1);
            size_t k = slot[h] ? slot[h] - 1 : u;
            if (k == u) {
                keys[u++] = keys[i];
                slot[h] = u;
            }
            vals[k] = vals[i];
        }
    }
    JTRY(r, kvc__chat_new_dict(r->c, u, out));
    for (size_t i = 0; i < u; i++) JTRY(r, kvc__chat_dict_add(r->c, out->u.d, keys[i], vals[i]));
    return KVC_OK;
}

static kvc_status read_array(jr *r, int child_depth, const jpath *p, value *out) {
    r->i++;
    JTRY(r, kvc__chat_new_list(r->c, 4, out));
    skip_ws(r);
    if (r->i < r->n && r->s[r->i] == ']') {
        r->i++;
        return KVC_OK;
    }
    for (size_t idx = 0;; idx++) {
        jpath here = {p, {NULL, 0}, idx, 0};
        value v;
        KVC_TRY(read_value(r, child_depth, &here, &v));
        JTRY(r, kvc__chat_list_push(r->c, out->u.l, v));
        skip_ws(r);
        if (r->i < r->n && r->s[r->i] == ',') {
            r->i++;
            continue;
        }
        if (r->i < r->n && r->s[r->i] == ']') {
            r->i++;
            return KVC_OK;
        }
        return unexpected(r, "',' or ']'");
    }
}

/* A value at depth `depth` (the arrays and objects around it, the context not counted). */
static kvc_status read_value(jr *r, int depth, const jpath *p, value *out) {
    skip_ws(r);
    if (r->i >= r->n) return unexpected(r, "a value");
    unsigned char ch = r->s[r->i];
    if ((ch == '[' || ch == '{') && depth >= MAX_VALUE_DEPTH)
        return jerr(r, r->i, "arrays and objects nested more than %d deep", MAX_VALUE_DEPTH);
    switch (ch) {
    case '{': return read_object(r, depth + 1, p, out);
    case '[': return read_array(r, depth + 1, p, out);
    case '"': {
        str s;
        KVC_TRY(read_string(r, &s));
        *out = v_str(s.p, s.n);
        return KVC_OK;
    }
    default: break;
    }
    if (ch == '-' || (ch >= '0' && ch <= '9')) return read_number(r, p, out);
    static const struct {
        const char *w;
        int t; /* 0 false, 1 true, 2 null, 3 a float */
    } words[] = {{"true", 1}, {"false", 0}, {"null", 2}, {"NaN", 3}, {"Infinity", 3}};
    for (size_t k = 0; k < sizeof words / sizeof words[0]; k++)
        if (lit(r, words[k].w)) {
            if (words[k].t == 3)
                note_unsup(r, r->i, p,
                           "NaN or Infinity (a float: kvcache's templates have no floats)");
            *out = words[k].t == 2 || words[k].t == 3 ? v_none() : v_bool(words[k].t);
            r->i += strlen(words[k].w);
            return KVC_OK;
        }
    return unexpected(r, "a value");
}

kvc_status kvc__chat_read_context(ctx *c, const char *json, size_t n, value *out) {
    jr r;
    r.c = c;
    r.s = (const unsigned char *)json;
    r.n = n;
    r.i = 0;
    r.unsup[0] = 0;
    skip_ws(&r);
    if (r.i >= r.n || r.s[r.i] != '{') return unexpected(&r, "an object (the context)");
    KVC_TRY(read_object(&r, 0, NULL, out));
    skip_ws(&r);
    if (r.i < r.n) return jerr(&r, r.i, "extra data after the object");
    if (r.unsup[0]) return kvc__error(KVC_ERR_UNSUPPORTED, "%s", r.unsup);
    return KVC_OK;
}
