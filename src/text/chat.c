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
 * bos_token, eos_token, tools and documents (None unless given, as
 * transformers passes them), the members of a context JSON
 * (kvc_chat_apply_template_json, read by chat_json_read.c) and the
 * functions raise_exception, namespace, range and strftime_now; its
 * filters include transformers' tojson.
 *
 * The supported subset is listed at kvc_chat_apply_template (tokenizer.h).
 * What jinja2 compiles but kvcache lacks (floats, '/', tuples, jinja2's
 * other filters and tests) parses into nodes that are refused
 * (KVC_ERR_UNSUPPORTED) only when evaluated, so templates whose tool or
 * float branches do not run still render; a filter or test jinja2 does not
 * know at all is refused when parsed, as jinja2 refuses it, except where
 * jinja2 defers that to run time (if statements, conditional expressions).
 * Macros are values holding their definition and the scopes they see
 * (scope_floor / def_depth in ctx); a call renders the body into the output
 * buffer and takes the text back out, as a block set does.
 *
 * Memory: everything (tokens, AST, values, strings) lives in one arena freed
 * at the end of the call; output and arena are capped so no template can
 * exhaust memory, and parser nesting is capped so none can exhaust the stack.
 * Time (templates come from model files): loop iterations are capped, and
 * so are the bytes string operations go through (MAX_WORK); substring
 * search and strip(chars) are linear-ish, not n * m.
 *
 * Files: chat_internal.h (the shared types), chat_lex.c (lexer), chat_parse.c
 * (parser), chat_value.c (arena, errors, values, scopes, string operations),
 * chat_eval.c (expressions, calls), chat_filter.c (filters, tests),
 * chat_json.c (transformers' tojson and strftime_now), chat_json_read.c
 * (the context JSON) and this file
 * (normalisation, statements, macro calls, output, the entry point).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"
#include "kvcache/tokenizer.h"
#include "tokenizer_internal.h"

/* ---- statements ----------------------------------------------------------------- */

static str cstr(const char *s) {
    str r = {s, strlen(s)};
    return r;
}

/* Appends n bytes that statement `at` produced (its line goes in errors). */
static kvc_status out_put(ctx *c, const node *at, const char *p, size_t n) {
    if (c->out_n + n > c->out_cap) {
        if (c->out_n + n > MAX_BYTES)
            return kvc__chat_runtime_error(at, "output exceeds %zu MiB", MAX_BYTES >> 20);
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

/* Sets the loop's target names to item: `for x in ...` or, with several
 * names, `for a, b in ...` unpacking a list, pair or string. */
static kvc_status bind_targets(ctx *c, const node *n, value item) {
    if (n->nnames == 1) return kvc__chat_set_var(c, n->names[0], item);
    value parts = item;
    if (item.t == V_STR) KVC_TRY(kvc__chat_str_chars(c, item.u.s, &parts));
    if (parts.t != V_LIST || parts.u.l->n != n->nnames)
        return kvc__chat_runtime_error(n, "cannot unpack a %s into %zu names",
                                       kvc__chat_type_name(&item), n->nnames);
    for (size_t k = 0; k < n->nnames; k++)
        KVC_TRY(kvc__chat_set_var(c, n->names[k], parts.u.l->items[k]));
    return KVC_OK;
}

/* A loop's `if` filter, run as jinja2 runs it: a generator the loop pulls
 * each item from as it reaches it (and further ahead when loop.last,
 * nextitem or length is read), so what the body changes (a namespace) is
 * seen by the tests of the items after.
 *
 * jinja2's generator is a Python function nested in the one that runs the
 * for statement, so the names its condition reads are closure variables:
 * each test sees their values at that moment. A loop left with break and
 * read later (a `loop` kept in a namespace) tests the rest of its items then,
 * with the values the scopes around the for statement have then (set after
 * the loop, or in a later iteration of an enclosing loop): while those
 * scopes are live, this is what looking them up finds. When the for
 * statement sits directly in a macro's body, the macro's scope outlives the
 * call in jinja2's closure with its last values: kvcache keeps a copy of it
 * when the call returns (`saved`). Once a loop or block set that held the
 * for statement has ended, jinja2 reads Python's `missing` in the names it
 * declares (it clears them when leaving: an error), and the outer names as
 * they are; kvcache does not track which names those are, and refuses. */
struct loop_filter {
    const node *n;   /* the for statement: targets, condition n->d */
    const list *src; /* every item */
    size_t next;     /* the first one not tested */
    int frame;       /* the loop's frame: the condition sees the scopes below it */
    uint64_t serial; /* frames[frame - 1].serial at the loop's start */
    int floor, def_depth; /* the view of the for statement (see ctx) */
    uint64_t def_serial;  /* in a macro (floor > 0): frames[def_depth - 1].serial */
    int busy;        /* the condition is running */
    int ended;       /* the loop is over (left with break) */
    int saved;       /* the macro frame at floor returned: its copy below */
    str *saved_names;
    value *saved_vals;
    size_t saved_n;
    loop_filter *next_left; /* ctx.left: the next one, from a shallower or earlier loop */
};

/* A macro call at frames[depth] returns: the filtered loops left with break
 * directly in its body (the head of ctx.left: deeper calls took theirs off
 * when they returned) keep a copy of its scope, as jinja2's closure keeps
 * it, and leave the list. */
static kvc_status keep_macro_scope(ctx *c, int depth) {
    const frame *fr = &c->frames[depth];
    while (c->left && c->left->frame > depth) {
        loop_filter *f = c->left;
        c->left = f->next_left;
        if (f->serial != fr->serial || f->next >= f->src->n) continue;
        ALLOC(c, f->saved_names, fr->n + 1);
        ALLOC(c, f->saved_vals, fr->n + 1);
        if (fr->n) {
            memcpy(f->saved_names, fr->names, fr->n * sizeof *fr->names);
            memcpy(f->saved_vals, fr->vals, fr->n * sizeof *fr->vals);
        }
        f->saved_n = fr->n;
        f->saved = 1;
    }
    return KVC_OK;
}

kvc_status kvc__chat_loop_pull(ctx *c, loop_ctx *lp, int64_t want) {
    loop_filter *f = lp->filter;
    if (!f || (int64_t)lp->items->n > want) return KVC_OK;
    /* After the loop, the scopes below its frame are still the same pushes
     * (the stack only grows and shrinks at the top, and a push takes a new
     * serial) when the innermost of them is; the frames from the loop's up
     * are others now, hidden below as the loop's body was. */
    int gone = f->ended &&
               (f->frame > c->n_frames || c->frames[f->frame - 1].serial != f->serial);
    /* the for statement's macro returned: its saved scope stands in for it, and the
     * macro's definer's scopes must be the same pushes */
    if (gone && !(f->saved && f->def_depth >= 1 && f->def_depth <= c->n_frames &&
                  c->frames[f->def_depth - 1].serial == f->def_serial))
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: loop.last, nextitem, length or revindex of "
                          "a filtered loop (for ... if) left with break, read after the loop "
                          "or block set that held it has ended, is not supported",
                          c->cur ? c->cur->line : f->n->line);
    if (f->busy) /* the condition reads its own loop ahead: Python's ValueError */
        return kvc__chat_runtime_error(f->n->d, "generator already executing");
    if (c->n_frames >= MAX_DEPTH + 1 - gone)
        return kvc__chat_runtime_error(f->n, "nested too deeply");
    const node *cur = c->cur;
    int floor = c->scope_floor, def_depth = c->def_depth, lo = c->hide_lo, hi = c->hide_hi;
    frame keep = {0}, *saved = NULL;
    if (gone) { /* the macro's scope, back on top for the test (the slot's own arrays kept) */
        saved = &c->frames[c->n_frames++];
        keep = *saved;
        saved->names = f->saved_names;
        saved->vals = f->saved_vals;
        saved->n = saved->cap = f->saved_n; /* full: nothing is added in place */
        saved->serial = ++c->next_serial;
    }
    frame *fr = &c->frames[c->n_frames++];
    fr->n = 0;
    fr->serial = ++c->next_serial;
    c->scope_floor = gone ? c->n_frames - 2 : f->floor;
    c->def_depth = f->def_depth;
    c->hide_lo = gone ? 0 : f->frame;
    c->hide_hi = gone ? 0 : c->n_frames - 1;
    f->busy = 1;
    kvc_status st = KVC_OK;
    while (st == KVC_OK && (int64_t)lp->items->n <= want && f->next < f->src->n) {
        value item = f->src->items[f->next++], ok;
        int pass = 0;
        fr->n = 0;
        st = bind_targets(c, f->n, item);
        if (st == KVC_OK) st = kvc__chat_eval(c, f->n->d, &ok);
        if (st == KVC_OK) st = kvc__chat_truth(c, &ok, &pass);
        if (st == KVC_OK && pass) st = kvc__chat_list_push(c, lp->items, item);
    }
    f->busy = 0;
    c->n_frames--;
    if (saved) {
        *saved = keep;
        c->n_frames--;
    }
    c->scope_floor = floor;
    c->def_depth = def_depth;
    c->hide_lo = lo;
    c->hide_hi = hi;
    c->cur = cur;
    if (st == KVC_OK && f->next == f->src->n) lp->filter = NULL; /* all tested */
    return st;
}

kvc_status kvc__chat_truth(ctx *c, const value *v, int *r) {
    if (v->t == V_LOOP) KVC_TRY(kvc__chat_loop_pull(c, v->u.lp, INT64_MAX));
    *r = truthy(v);
    return KVC_OK;
}

static kvc_status exec_for(ctx *c, const node *n) {
    value iter, items;
    KVC_TRY(kvc__chat_eval(c, n->a, &iter));
    KVC_TRY(kvc__chat_iter_items(c, n, &iter, &items));
    if (c->n_frames >= MAX_DEPTH + 1) return kvc__chat_runtime_error(n, "loops nested too deeply");
    loop_ctx *lp;
    ALLOC(c, lp, 1);
    memset(lp, 0, sizeof *lp);
    lp->items = items.u.l;
    if (n->d) { /* `for x in xs if cond`: items are tested as the loop reaches them */
        value kept;
        KVC_TRY(kvc__chat_new_list(c, 0, &kept));
        ALLOC(c, lp->filter, 1);
        memset(lp->filter, 0, sizeof *lp->filter);
        lp->filter->n = n;
        lp->filter->src = items.u.l;
        lp->filter->frame = c->n_frames;
        lp->filter->serial = c->frames[c->n_frames - 1].serial;
        lp->filter->floor = c->scope_floor;
        lp->filter->def_depth = c->def_depth;
        if (c->scope_floor > 0 && c->def_depth >= 1)
            lp->filter->def_serial = c->frames[c->def_depth - 1].serial;
        lp->items = kept.u.l;
    }
    frame *fr = &c->frames[c->n_frames++];
    fr->n = 0;
    fr->serial = ++c->next_serial;
    value loop = {V_LOOP, {0}};
    loop.u.lp = lp;
    kvc_status st = KVC_OK;
    int completed = 0; /* an iteration ran to the end of the body */
    for (int64_t i = 0; st == KVC_OK; i++) {
        st = kvc__chat_loop_pull(c, lp, i);
        if (st != KVC_OK || i >= (int64_t)lp->items->n) break;
        if (++c->steps > MAX_STEPS) {
            st = kvc__chat_runtime_error(n, "more than %lld loop iterations", (long long)MAX_STEPS);
            break;
        }
        fr->n = 0; /* every iteration starts a fresh scope, as in Jinja */
        lp->index0 = i; /* `loop` is the same object every iteration, as in jinja2 */
        st = bind_targets(c, n, lp->items->items[i]);
        if (st == KVC_OK) st = kvc__chat_set_var(c, cstr("loop"), loop);
        if (st == KVC_OK) st = exec(c, n->b);
        if (st == KVC_OK && !c->loop_ctl) completed = 1;
        if (c->loop_ctl == 1) {
            c->loop_ctl = 0;
            break;
        }
        c->loop_ctl = 0;
    }
    if (lp->filter) { /* left with break, items untested */
        lp->filter->ended = 1;
        if (c->scope_floor > 0 && c->scope_floor == lp->filter->frame - 1) {
            /* directly in a macro's body: keep_macro_scope saves its scope */
            lp->filter->next_left = c->left;
            c->left = lp->filter;
        }
    }
    /* jinja2 runs the else block unless some iteration reached the end of
     * the body: an empty loop, but also one whose every iteration ended in
     * break or continue. It has a scope of its own (without the loop's
     * variables): what it sets stays there. */
    if (st == KVC_OK && !completed && n->c) {
        fr->n = 0;
        st = exec(c, n->c);
    }
    c->n_frames--;
    return st;
}

static kvc_status exec(ctx *c, const node *n) {
    value v;
    c->cur = n;
    switch (n->k) {
    case S_BLOCK:
        for (size_t i = 0; i < n->nv && !c->loop_ctl; i++) KVC_TRY(exec(c, n->v[i]));
        return KVC_OK;
    case S_TEXT: return out_put(c, n, n->name.p, n->name.n);
    case S_OUT: {
        str s;
        KVC_TRY(kvc__chat_eval(c, n->a, &v));
        KVC_TRY(kvc__chat_to_str(c, &v, &s));
        return out_put(c, n, s.p, s.n);
    }
    case S_IF: {
        int t;
        KVC_TRY(kvc__chat_eval(c, n->a, &v));
        KVC_TRY(kvc__chat_truth(c, &v, &t));
        if (t) return exec(c, n->b);
        return n->c ? exec(c, n->c) : KVC_OK;
    }
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
        /* the body has a scope of its own, as in jinja2: what it sets stays there */
        if (c->n_frames >= MAX_DEPTH + 1) return kvc__chat_runtime_error(n, "nested too deeply");
        c->frames[c->n_frames].n = 0;
        c->frames[c->n_frames++].serial = ++c->next_serial;
        kvc_status st = exec(c, n->b);
        c->n_frames--;
        KVC_TRY(st);
        char *p;
        ALLOC(c, p, c->out_n - mark + 1);
        if (c->out_n > mark) memcpy(p, c->out + mark, c->out_n - mark); /* out may be NULL */
        v = v_str(p, c->out_n - mark);
        c->out_n = mark;
        return kvc__chat_set_var(c, n->name, v);
    }
    case S_MACRO: {
        if (c->scope_floor > 0) /* its scopes would be the macro's and the macro's definer's */
            return kvc__error(KVC_ERR_UNSUPPORTED,
                              "chat template, line %d: a macro defined inside a macro is not "
                              "supported", n->line);
        macro_ref *m;
        ALLOC(c, m, 1);
        m->def = n;
        m->depth = c->n_frames;
        m->serial = c->frames[c->n_frames - 1].serial;
        v.t = V_MACRO;
        v.u.m = m;
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

/* ---- macros ------------------------------------------------------------------------ */

kvc_status kvc__chat_call_macro(ctx *c, const node *n, const macro_ref *m, const args *a,
                                value *out) {
    const node *d = m->def;
    int name_n = (int)(d->name.n < 40 ? d->name.n : 40);
    if (m->depth > c->n_frames || c->frames[m->depth - 1].serial != m->serial)
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: macro '%.*s' called outside the scope it "
                          "was defined in is not supported", n->line, name_n, d->name.p);
    if (d->neg)
        return kvc__error(KVC_ERR_UNSUPPORTED,
                          "chat template, line %d: macro '%.*s' uses varargs, kwargs or caller "
                          "(not supported)", n->line, name_n, d->name.p);
    if (a->n_pos > d->nnames)
        return kvc__chat_runtime_error(n, "macro '%.*s' takes not more than %zu argument(s)",
                                       name_n, d->name.p, d->nnames);
    const value *bound[256];
    if (d->nnames > sizeof bound / sizeof bound[0])
        return kvc__error(KVC_ERR_UNSUPPORTED, "chat template, line %d: a macro with more than "
                          "256 parameters", n->line);
    for (size_t i = 0; i < d->nnames; i++) bound[i] = i < a->n_pos ? &a->pos[i] : NULL;
    for (size_t k = 0; k < a->n_kw; k++) {
        size_t i = 0;
        while (i < d->nnames && !(d->names[i].n == a->kw_names[k].n &&
                                  memcmp(d->names[i].p, a->kw_names[k].p, d->names[i].n) == 0))
            i++;
        if (i == d->nnames || bound[i]) /* jinja2 says the same for both */
            return kvc__chat_runtime_error(n, "macro '%.*s' takes no keyword argument '%.*s'",
                                           name_n, d->name.p,
                                           (int)(a->kw_names[k].n < 40 ? a->kw_names[k].n : 40),
                                           a->kw_names[k].p);
        bound[i] = &a->kw[k];
    }
    if (++c->steps > MAX_STEPS) /* a macro calling itself twice per call would run for ages */
        return kvc__chat_runtime_error(n, "more than %lld loop iterations and macro calls",
                                       (long long)MAX_STEPS);
    if (c->n_frames >= MAX_DEPTH + 1)
        return kvc__chat_runtime_error(n, "macro calls and loops nested too deeply");
    frame *fr = &c->frames[c->n_frames++];
    fr->n = 0;
    fr->serial = ++c->next_serial;
    int floor = c->scope_floor, def_depth = c->def_depth, lo = c->hide_lo, hi = c->hide_hi;
    c->scope_floor = c->n_frames - 1; /* the body sees its own scope and its definer's */
    c->def_depth = m->depth;
    c->hide_lo = c->hide_hi = 0;
    size_t mark = c->out_n;
    kvc_status st = KVC_OK;
    for (size_t i = 0; st == KVC_OK && i < d->nnames; i++) {
        value v = v_undef();
        if (bound[i])
            v = *bound[i];
        else if (d->w[i]) /* defaults are evaluated in the macro's scope, at each call */
            st = kvc__chat_eval(c, d->w[i], &v);
        if (st == KVC_OK) st = kvc__chat_set_var(c, d->names[i], v);
    }
    if (st == KVC_OK) st = exec(c, d->b);
    if (st == KVC_OK && c->left) st = keep_macro_scope(c, c->n_frames - 1);
    c->scope_floor = floor;
    c->def_depth = def_depth;
    c->hide_lo = lo;
    c->hide_hi = hi;
    c->n_frames--;
    KVC_TRY(st);
    char *p;
    ALLOC(c, p, c->out_n - mark + 1);
    if (c->out_n > mark) memcpy(p, c->out + mark, c->out_n - mark);
    *out = v_str(p, c->out_n - mark);
    c->out_n = mark;
    return KVC_OK;
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

/* The inputs of one call: messages (the struct API) or a context JSON. */
typedef struct call_in {
    const char *fn; /* the public function's name, for messages */
    const kvc_chat_message *messages;
    int64_t n_messages;
    const char *json; /* NULL: messages */
    int add_gen;
} call_in;

/* The context JSON's members become the variables (c->vars); messages must
 * be a list, add_generation_prompt is the call's argument. */
static kvc_status read_context(ctx *c, const char *json) {
    value vars;
    KVC_TRY(kvc__chat_read_context(c, json, strlen(json), &vars));
    value *m = kvc__chat_dict_find(vars.u.d, cstr("messages"));
    if (!m) return kvc__error(KVC_ERR_INVALID_ARG, "context JSON: no \"messages\" member");
    if (m->t != V_LIST)
        return kvc__error(KVC_ERR_INVALID_ARG, "context JSON: \"messages\" must be an array, "
                          "not %s", m->t == V_DICT ? "an object" : kvc__chat_type_name(m));
    if (kvc__chat_dict_find(vars.u.d, cstr("add_generation_prompt")))
        return kvc__error(KVC_ERR_INVALID_ARG,
                          "context JSON: \"add_generation_prompt\" is the call's argument, "
                          "not a member of the context");
    c->messages = *m;
    c->vars = vars.u.d;
    return KVC_OK;
}

static kvc_status render(ctx *c, const char *tmpl, size_t tmpl_n, const kvc_tokenizer *t,
                         const call_in *in) {
    if (in->json) KVC_TRY(read_context(c, in->json)); /* the caller's input first */
    KVC_TRY(normalise(c, tmpl, tmpl_n));
    KVC_TRY(kvc__chat_lex(c));
    node *root;
    int which = 0;
    KVC_TRY(kvc__chat_parse_block(c, NULL, 0, &root, &which));
    for (size_t i = 0; i < c->n_unknown; i++) /* jinja2 refuses these when compiling */
        if (!c->unknown[i]->soft)
            return kvc__error(KVC_ERR_UNSUPPORTED, "chat template, line %d: no %s named '%.*s'",
                              c->unknown[i]->line,
                              c->unknown[i]->k == E_FILTER ? "filter" : "test",
                              (int)(c->unknown[i]->name.n < 40 ? c->unknown[i]->name.n : 40),
                              c->unknown[i]->name.p);
    if (!in->json) {
        KVC_TRY(kvc__chat_new_list(c, (size_t)in->n_messages, &c->messages));
        for (int64_t i = 0; i < in->n_messages; i++) {
            value m;
            KVC_TRY(kvc__chat_new_dict(c, 2, &m));
            const kvc_chat_message *msg = &in->messages[i];
            KVC_TRY(kvc__chat_dict_set(c, m.u.d, cstr("role"),
                                       msg->role ? v_cstr(msg->role) : v_none()));
            KVC_TRY(kvc__chat_dict_set(c, m.u.d, cstr("content"),
                                       msg->content ? v_cstr(msg->content) : v_none()));
            KVC_TRY(kvc__chat_list_push(c, c->messages.u.l, m));
        }
    }
    c->add_generation_prompt = v_bool(in->add_gen);
    KVC_TRY(token_value(t, t ? kvc_tokenizer_bos(t) : -1, &c->bos_token));
    KVC_TRY(token_value(t, t ? kvc_tokenizer_eos(t) : -1, &c->eos_token));
    c->n_frames = 1;
    c->frames[0].serial = ++c->next_serial;
    return exec(c, root);
}

static kvc_status apply(const kvc_tokenizer *t, const char *template_str, const call_in *in,
                        char *buf, size_t cap, size_t *len) {
    size_t tmpl_n;
    const char *tmpl = template_str;
    if (tmpl) {
        tmpl_n = strlen(tmpl);
    } else {
        tmpl = kvc__tokenizer_chat_template(t, &tmpl_n);
        if (!tmpl)
            return kvc__error(KVC_ERR_NOT_FOUND, "%s: the model has no tokenizer.chat_template; "
                              "pass a template", in->fn);
    }
    ctx *c = calloc(1, sizeof *c);
    if (!c) return kvc__chat_nomem();
    kvc_status st = render(c, tmpl, tmpl_n, t, in);
    if (st == KVC_OK && c->loop_ctl)
        st = kvc__error(KVC_ERR_INTERNAL, "chat template: stray break");
    if (st == KVC_OK) {
        *len = c->out_n;
        if (c->out_n > cap)
            st = kvc__error(KVC_ERR_NO_SPACE, "%s: the prompt is %zu bytes, cap is %zu", in->fn,
                            c->out_n, cap);
        else if (c->out_n)
            memcpy(buf, c->out, c->out_n);
    }
    free(c->out);
    kvc__chat_arena_free(&c->ar);
    free(c);
    return st;
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
    call_in in = {"kvc_chat_apply_template", messages, n_messages, NULL, add_generation_prompt};
    return apply(t, template_str, &in, buf, cap, len);
}

kvc_status kvc_chat_apply_template_json(const kvc_tokenizer *t, const char *template_str,
                                        const char *context_json, int add_generation_prompt,
                                        char *buf, size_t cap, size_t *len) {
    KVC_CHECK(len != NULL, "kvc_chat_apply_template_json: len is NULL");
    KVC_CHECK(context_json != NULL, "kvc_chat_apply_template_json: context_json is NULL");
    KVC_CHECK(buf != NULL || cap == 0, "kvc_chat_apply_template_json: buf is NULL with cap %zu",
              cap);
    KVC_CHECK(template_str != NULL || t != NULL,
              "kvc_chat_apply_template_json: no template and no tokenizer to take one from");
    call_in in = {"kvc_chat_apply_template_json", NULL, 0, context_json, add_generation_prompt};
    return apply(t, template_str, &in, buf, cap, len);
}
