"""Random differential testing of kvcache's chat templates against jinja2.

A grammar-based generator writes random templates in the Jinja subset that
kvc_chat_apply_template documents (biased towards what real chat templates
do: loops over messages, role tests, string building, namespace counters,
whitespace control), with random contexts, and renders each with both
kvcache and jinja2 in the environment transformers uses. The verdicts:

  same        both rendered, same text (or both failed)
  outside     kvcache said UNSUPPORTED for a template the generator marked
              as leaving the subset (float literals, '/', '**', a macro in
              a macro, a printed generator, unlisted filters or methods),
              or where jinja2 printed an object's address: expected
  case        outputs differ only where cased non-ASCII text meets a case
              mapping (documented: kvcache's case mapping is ASCII-only)
  bigint      jinja2 computed an integer beyond 64 bits, kvcache refused it
              (documented)
  constfold   jinja2 folded a slice of constants at compile time, where a
              bad slice (of an int, with step 0) becomes undefined instead
              of the TypeError / ValueError the same slice of a variable
              raises; kvcache raises for both
  object      jinja2 printed a Python object kvcache has as a plain string:
              Markup
  DIFF        anything else: a bug (or an undocumented difference)

test_tokenizer.py runs a short seeded batch in CI; for long runs:

    KVCACHE_LIBRARY=build/libkvcache.so python3 python/tests/chat_diff.py \
        --seed 1 -n 100000 [--cased] [--show 5]
"""

from __future__ import annotations

import datetime
import json
import random
import re
import sys
import warnings

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

import kvcache
from bpe_reference import BYTE_ENCODER, CONTROL

# ---------------------------------------------------------------------------
# the reference


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _hf_tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' replacement for jinja2's tojson
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                     extensions=["jinja2.ext.loopcontrols"])
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
_ENV.filters["tojson"] = _hf_tojson


def render_jinja(template, messages, add_generation_prompt, bos_token="", eos_token="",
                 tools=None, documents=None, **kwargs):
    """As transformers renders (extra variables may override bos / eos)."""
    variables = {"bos_token": bos_token, "eos_token": eos_token, **kwargs}
    with warnings.catch_warnings():  # Python's compile() warns about 1[0] in generated code
        warnings.simplefilter("ignore", SyntaxWarning)
        return _ENV.from_string(template).render(
            messages=messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **variables)


# ---------------------------------------------------------------------------
# pools

STRINGS = [
    "", " ", "  ", "Hello", "hello world", "  padded  ", "a,b,c", "a, b ,c", "x\ny", "\n", "\t",
    "ABC def", "it's", 'say "hi"', "mIxEd CaSe", "a-b(c)d[e]f{g}h<i", "user", "assistant",
    "system", "tool", "<|im_start|>", "<|im_end|>", "[INST]", "-", "1", "42", " 7 ", "-3", "0x1f",
    "3.5", "1e3", "None", "true", "a_b", "x y  z", "aaa", "ab", "ba", "a\\b",
    "日本語", "🎉 party", "→", "a\u3000b", "\xa0x\xa0", "\u2028", "x\x1fy", "\x1c", "tab\there",
    "é", "\u0301", "ÿ", "ß",  # non-ASCII but no change under upper/lower/title with ASCII rules
]
# Cased non-ASCII text: kvcache's case mapping is ASCII-only (documented), so
# these only enter with --cased, where a difference they explain is 'case'.
CASED = ["Σίσυφος", "ÉCOLE école", "straße", "ǅemal", "İstanbul", "ﬁne"]

ROLES = ["system", "user", "assistant", "tool", "", "User", "ipython", None]
NAMES_UNDEF = ["nope", "undefined_x", "tool_calls", "system_message", "x"]
KEYS = ["role", "content", "name", "a", "b", "type", "arguments", "function", "", "é"]
INT_LITS = [0, 1, 2, 3, 5, 7, 10, 100, 255, 2 ** 31, 2 ** 62, 9223372036854775807]
CASE_OPS = re.compile(r"upper|lower|title|capitalize")
# Python objects kvcache has as plain strings (documented): Markup from safe,
# and anything printed with its address.
OBJECTS = re.compile(r"Markup\(| object at 0x|<built-in", re.IGNORECASE)


def _is_cased_nonascii(ch):
    return ord(ch) > 127 and (ch.upper() != ch or ch.lower() != ch or ch.title() != ch)


def _str_lit(s, rng):
    """A Jinja string literal for s (Python's repr is valid Jinja), now and
    then double-quoted or with escapes."""
    r = rng.random()
    if r < 0.1 and '"' not in s and "\\" not in s and "\n" not in s:
        return '"' + s + '"'
    if r < 0.15:
        return "'" + "".join("\\x%02x" % ord(ch) if ord(ch) < 0x100 and ch.isalpha()
                             else ("\\u%04x" % ord(ch) if 0x100 <= ord(ch) < 0x10000
                                   else repr(ch)[1:-1]) for ch in s) + "'"
    return repr(s)


# ---------------------------------------------------------------------------
# the generator


class Gen:
    """Writes one random template. Expressions are generated for a wanted
    type ('str', 'int', 'bool', 'list', 'dict', 'any') so most of them make
    sense, with a small chance of any other type to reach the error paths.
    self.outside collects the constructs used that the subset leaves out."""

    def __init__(self, rng, cased=False):
        self.r = rng
        self.strings = STRINGS + (CASED if cased else [])
        self.vars = {}  # variable -> type, as the template sets them
        self.loops = []  # loop variables in scope: (name, type)
        self.ns = []  # namespace variables: name -> [attrs]
        self.nsattrs = {}
        self.macros = []  # (name, number of parameters, number with defaults)
        self.in_macro = 0
        self.outside = []

    def chance(self, p):
        return self.r.random() < p

    def pick(self, xs):
        return self.r.choice(xs)

    # ---- expressions

    def s(self):
        return _str_lit(self.pick(self.strings), self.r)

    def i(self):
        v = self.pick(INT_LITS) if self.chance(0.3) else self.r.randint(0, 12)
        return str(v) if not self.chance(0.15) else "-" + str(v)

    def var_of(self, t):
        names = [n for n, vt in self.vars.items() if vt == t]
        names += [n for n, vt in self.loops if vt == t]
        return self.pick(names) if names else None

    def msg(self, d):
        """An expression for one message (a dict)."""
        v = self.var_of("msg")
        opts = ["messages[%s]" % self.pick(["0", "-1", "1", "loop.index0" if self.loops else "0",
                                            "2", "-2", "5"]),
                "(messages | first)", "(messages | last)"]
        if v:
            opts += [v] * 4
        if self.chance(0.1):
            return "{%s: %s, %s: %s}" % (self.s() if self.chance(0.2) else "'role'", self.expr(d, "str"),
                                         "'content'", self.expr(d, "str"))
        return self.pick(opts)

    def field(self, d):
        m = self.msg(d)
        k = self.pick(["role", "content", "role", "content", "name", "tool_calls"])
        form = self.r.randint(0, 3)
        if form == 0:
            return "%s.%s" % (m, k)
        if form == 1:
            return "%s[%r]" % (m, k)
        if form == 2:
            return "%s.get(%r%s)" % (m, k, ", " + self.expr(d, "str") if self.chance(0.4) else "")
        return "%s['%s'] | default(%s)" % (m, k, self.expr(d, "any"))

    def wrap(self, e):
        return "(" + e + ")"

    def expr(self, d, want="any"):
        if want == "any" or self.chance(0.06):
            want = self.pick(["str", "str", "int", "bool", "list", "dict", "none", "undef",
                              "msg"])
        d -= 1
        if want == "none":
            return self.pick(["none", "None", "tools", "documents", "messages[0].nothing"])
        if want == "undef":
            e = self.pick(NAMES_UNDEF)
            if self.chance(0.3):
                e += "." + self.pick(KEYS[:4])  # an error in both
            return e
        if want == "msg":
            return self.msg(d)
        if d <= 0:
            return self.leaf(want)
        return getattr(self, "e_" + want)(d)

    def leaf(self, want):
        v = self.var_of(want)
        if v and self.chance(0.5):
            return v
        if want == "str":
            return self.pick([self.s(), self.s(), self.s(), "bos_token", "eos_token"])
        if want == "int":
            return self.i()
        if want == "bool":
            return self.pick(["true", "false", "True", "add_generation_prompt", "not true"])
        if want == "list":
            return self.pick(["messages", "[]", "[1, 2, 3]", "['a', 'b']", "range(3)",
                              "[" + self.s() + ", " + self.i() + "]"])
        return self.pick(["{}", "{'a': 1}", "{'role': 'user', 'content': 'hi'}"])

    def e_str(self, d):
        k = self.r.randint(0, 26)
        x = lambda: self.expr(d, "str")  # noqa: E731
        if k <= 2:
            return self.field(d)
        if k == 3:
            return "%s + %s" % (x(), x())
        if k == 4:
            return "%s ~ %s" % (x(), self.expr(d, "any"))
        if k == 5:
            f = self.pick(["trim", "upper", "lower", "title", "capitalize", "string", "safe",
                           "trim", "reverse"])
            return "%s | %s" % (self.wrap(x()) if self.chance(0.5) else x(), f)
        if k == 6:
            m = self.pick(["strip", "lstrip", "rstrip", "upper", "lower", "title", "capitalize"])
            arg = ""
            if m.endswith("strip") and self.chance(0.4):
                arg = self.pick([self.s(), "none", "' \\n'", "'ab'"])
            return "%s.%s(%s)" % (self.wrap(x()), m, arg)
        if k == 7:
            old, new = self.s(), self.s()
            cnt = ", " + self.i() if self.chance(0.3) else ""
            if self.chance(0.5):
                return "%s | replace(%s, %s%s)" % (self.wrap(x()), old, new, cnt)
            return "%s.replace(%s, %s%s)" % (self.wrap(x()), old, new, cnt)
        if k == 8:
            sep = self.s() if self.chance(0.7) else ""
            args = "(" + sep + ")" if sep or self.chance(0.5) else ""
            if self.chance(0.2):
                args = "(d=%s)" % self.s()
            return "%s | join%s" % (self.wrap(self.expr(d, "list")), args)
        if k == 9:
            return "%s[%s]" % (self.wrap(x()), self.slice_or_index(d))
        if k == 10:
            return "%s if %s else %s" % (x(), self.expr(d, "bool"), x()) if self.chance(0.9) \
                else "%s if %s" % (x(), self.expr(d, "bool"))
        if k == 11:
            return "%s * %s" % (self.wrap(x()), self.pick(["0", "1", "2", "3", "-1", "true"]))
        if k == 12:
            return "%s | first" % self.wrap(self.expr(d, "list"))
        if k == 13:
            return "%s | last" % self.wrap(self.expr(d, "list"))
        if k == 14:
            return "%s | default(%s%s)" % (self.expr(d, self.pick(["undef", "str", "none"])), x(),
                                          ", true" if self.chance(0.3) else "")
        if k == 15:
            return "%s | string" % self.expr(d, "any")
        if k == 16 and self.ns:
            ns = self.pick(self.ns)
            return "%s.%s" % (ns, self.pick(self.nsattrs[ns] + ["missing"]))
        if k == 17:
            return "%s[%s]" % (self.wrap(self.expr(d, "list")), self.i())
        if k == 18:
            return "(%s)" % x()
        if k == 19:
            return "%s.split(%s)[%s]" % (self.wrap(x()), self.pick(["", "','", "' '", self.s()]),
                                         self.i())
        if k == 20 and self.chance(0.3):  # outside the subset
            self.outside.append("unlisted")
            return self.pick(["%s | indent(2)", "%s.format(1)",
                              "%s | wordcount | string", "%s.find('a') | string",
                              "%s | center(9)"]) % self.wrap(x())
        if k == 21:
            return "%s | tojson%s" % (self.wrap(self.expr(d, "any")), self.tojson_args())
        if k == 22 and self.macros:
            return self.macro_call(d)
        if k == 23:
            return "%s | join(%s)" % (self.wrap(self.e_gen(d)), self.pick(["", "','", "' '"]))
        return self.leaf("str")

    def tojson_args(self):
        opts = []
        if self.chance(0.3):
            opts.append("indent=%s" % self.pick(["2", "4", "0", "-1", "'\\t'", "' '", "true",
                                                 "none"]))
        if self.chance(0.2):
            opts.append("ensure_ascii=%s" % self.pick(["true", "false", "1"]))
        if self.chance(0.2):
            opts.append("sort_keys=%s" % self.pick(["true", "false"]))
        if self.chance(0.1):
            opts.append("separators=%s" % self.pick(["[',', ':']", "[';', '=']", "none"]))
        if not opts:
            return "" if self.chance(0.7) else "()"
        self.r.shuffle(opts)
        return "(" + ", ".join(opts) + ")"

    def macro_call(self, d):
        name, n, nd = self.pick(self.macros)
        k = self.r.randint(n - nd, n) if self.chance(0.9) else n + 1  # too many: an error
        pos = [self.expr(d, "any") for _ in range(min(k, n + 1))]
        if self.chance(0.3) and 0 < k <= n:  # the last ones by keyword
            j = self.r.randint(1, k)
            pos = pos[:k - j] + ["p%d=%s" % (i, pos[i]) for i in range(k - j, k)]
        return "%s(%s)" % (name, ", ".join(pos))

    def e_gen(self, d):
        """A generator (select, reject, selectattr, rejectattr, map, items)."""
        k = self.r.randint(0, 7)
        lst = lambda: self.wrap(self.expr(d, "list"))  # noqa: E731
        if k == 0:
            t = self.pick(["odd", "even", "none", "string", "defined", "number", "true"])
            return "%s | %s('%s')" % (lst(), self.pick(["select", "reject"]), t)
        if k == 1:
            return "%s | %s" % (lst(), self.pick(["select", "reject"]))
        if k == 2:
            t = self.pick(["'equalto', %s" % self.s(), "'eq', 'user'", "'ne', 'system'",
                           "'in', ['user', 'tool']", "'defined'", "'none'", "'string'"])
            attr = self.pick(["'role'", "'content'", "'name'", "'0'", "'role.x'"])
            return "messages | %s(%s%s)" % (self.pick(["selectattr", "rejectattr"]), attr,
                                            ", " + t if self.chance(0.8) else "")
        if k == 3:
            t = self.pick(["'gt', 2", "'lessthan', 5", "'ge', %s" % self.i(), "'==', 3",
                           "'divisibleby', 2", "'in', [1, 2]"])
            return "%s | %s(%s)" % (self.wrap(self.pick(["[1, 2, 3, 4]", "range(6)",
                                                          "[0, 5, -1]"])),
                                    self.pick(["select", "reject"]), t)
        if k == 4:
            return "messages | map(attribute=%s%s)" % (
                self.pick(["'role'", "'content'", "'nope'"]),
                ", default=%s" % self.s() if self.chance(0.3) else "")
        if k == 5:
            return "%s | map(%s)" % (lst(), self.pick(["'string'", "'upper'", "'trim'",
                                                       "'length'", "'tojson'", "'int'"]))
        if k == 6:
            return "%s | items" % self.wrap(self.expr(d, "dict"))
        return "%s | map('string')" % lst()

    def slice_or_index(self, d):
        if self.chance(0.4):
            return self.i()
        parts = [self.i() if self.chance(0.6) else "" for _ in range(3)]
        if self.chance(0.2):
            parts[2] = self.pick(["-1", "2", "-2", "0", "none"])
        return ":".join(parts[:2]) + ((":" + parts[2]) if parts[2] or self.chance(0.3) else "")

    def e_int(self, d):
        k = self.r.randint(0, 13)
        x = lambda: self.expr(d, "int")  # noqa: E731
        if k <= 2:
            op = self.pick(["+", "-", "*", "//", "%", "+", "-"])
            if op == "*":  # a small factor: chained products of big ints would run for ages
                return "%s * %s" % (x(), self.r.randint(-3, 9))
            return "%s %s %s" % (x(), op, x())
        if k == 3:
            return "%s | %s" % (self.wrap(self.expr(d, self.pick(["str", "list", "dict"]))),
                                self.pick(["length", "count"]))
        if k == 4 and self.loops:
            return "loop." + self.pick(["index", "index0", "revindex", "revindex0", "length"])
        if k == 5:
            call = self.pick(["", "(7)", "(0, 16)", "(base=2)", "(default=-1)"])
            return "%s | int%s" % (self.wrap(self.expr(d, self.pick(["str", "str", "int",
                                                                      "none", "bool"]))), call)
        if k == 6:
            return "-" + self.wrap(x())
        if k == 7:
            return "%s if %s else %s" % (x(), self.expr(d, "bool"), x())
        if k == 8 and self.ns:
            ns = self.pick(self.ns)
            return "%s.%s" % (ns, self.pick(self.nsattrs[ns]))
        if k == 9:
            return "%s[%s]" % (self.wrap(self.pick(["[1, 2, 3]", "range(10)", "[7]"])),
                               self.i())
        if k == 10 and self.chance(0.3):
            self.outside.append("float or power")
            if self.chance(0.3):  # a small exponent: Python's 7 ** 2 ** 62 never ends
                return "%s ** %d" % (self.wrap(x()), self.r.randint(0, 3))
            return self.pick(["%s / %s", "%s + 1.5 * %s"]) % (x(), x())
        if k == 11:
            return "(%s)" % x()
        return self.leaf("int")

    def e_bool(self, d):
        k = self.r.randint(0, 14)
        if k <= 2:
            t = self.pick(["str", "int", "str", "any"])
            ops = ["==", "!=", "<", ">", "<=", ">="]
            e = "%s %s %s" % (self.expr(d, t), self.pick(ops), self.expr(d, t))
            if self.chance(0.15):
                e += " %s %s" % (self.pick(ops), self.expr(d, t))
            return e
        if k == 3:
            return "%s %s %s" % (self.expr(d, "bool"), self.pick(["and", "or"]),
                                 self.expr(d, "bool"))
        if k == 4:
            return "not " + self.expr(d, "bool")
        if k == 5:
            tests = ["defined", "undefined", "none", "string", "number", "integer", "boolean",
                     "true", "false", "mapping", "sequence", "iterable", "even", "odd"]
            t = self.pick(tests)
            v = self.expr(d, "int" if t in ("even", "odd") and self.chance(0.8) else "any")
            return "%s is %s%s" % (v, "not " if self.chance(0.3) else "", t)
        if k == 6:
            coll = self.pick(["str", "list", "dict"])
            item = "str" if coll != "list" or self.chance(0.5) else "any"
            return "%s %sin %s" % (self.expr(d, item), "not " if self.chance(0.3) else "",
                                   self.expr(d, coll))
        if k == 7:
            return "%s.%s(%s)" % (self.wrap(self.expr(d, "str")),
                                  self.pick(["startswith", "endswith"]), self.expr(d, "str"))
        if k == 8 and self.loops:
            return "loop." + self.pick(["first", "last"])
        if k == 9:
            return "%s and %s" % (self.expr(d, "any"), self.expr(d, "any"))  # a value, not bool
        if k == 10:
            return "(%s)" % self.expr(d, "bool")
        if k == 11:
            t = self.pick(["eq %s" % self.s(), "equalto(%s)" % self.i(), "ne(1)", "gt 2",
                           "lessthan(%s)" % self.i(), "in ['user', 'assistant']", "in 'abc'",
                           "divisibleby 3", "callable", "filter", "test", "float",
                           "ge(%s)" % self.i()])
            return "%s is %s%s" % (self.expr(d, self.pick(["str", "int", "any"])),
                                   "not " if self.chance(0.3) else "", t)
        if k == 12:
            return "%s | list | length > %s" % (self.wrap(self.e_gen(d)), self.i())
        return self.leaf("bool")

    def e_list(self, d):
        k = self.r.randint(0, 14)
        if k <= 1:
            return "[" + ", ".join(self.expr(d, self.pick(["str", "int", "any"]))
                                   for _ in range(self.r.randint(0, 4))) + \
                   ("," if self.chance(0.1) else "") + "]"
        if k == 2:
            return "messages" + ("[%s]" % self.slice_or_index(d) if self.chance(0.5) else "")
        if k == 3:
            return "%s.split(%s)" % (self.wrap(self.expr(d, "str")),
                                     self.pick(["", "','", "' '", self.s(), "none",
                                                "' ', 1", "maxsplit=1"]))
        if k == 4:
            return "%s + %s" % (self.expr(d, "list"), self.expr(d, "list"))
        if k == 5:
            t = self.pick(["list", "str", "dict"])
            x, f = self.wrap(self.expr(d, t)), self.pick(["list", "reverse"])
            if f == "reverse" and t != "str":  # an iterator: printed, it shows its address
                self.outside.append("generator")
            return "%s | %s" % (x, f)
        if k == 6:
            return "%s.%s()" % (self.wrap(self.expr(d, "dict")),
                                self.pick(["items", "keys", "values"]))
        if k == 7:
            args = self.pick(["%s", "%s, %s", "%s, %s, %s"])
            return "range(%s)" % (args % tuple(self.pick(["0", "1", "3", "-2", "5", "-1", "2"])
                                               for _ in range(args.count("%s"))))
        if k == 8:
            return "%s[%s]" % (self.wrap(self.expr(d, "list")), self.slice_or_index(d))
        if k == 9:
            return "%s if %s else %s" % (self.expr(d, "list"), self.expr(d, "bool"),
                                         self.expr(d, "list"))
        if k == 10:
            return "%s | list" % self.wrap(self.e_gen(d))
        if k == 11 and self.chance(0.2):  # printed, a generator shows its address
            self.outside.append("generator")
            return self.e_gen(d)
        return self.leaf("list")

    def e_dict(self, d):
        k = self.r.randint(0, 5)
        if k <= 2:
            items = []
            for _ in range(self.r.randint(0, 3)):
                key = _str_lit(self.pick(KEYS), self.r)
                if self.chance(0.05):
                    self.outside.append("non-string dict key")
                    key = self.i()
                items.append("%s: %s" % (key, self.expr(d, "any")))
            return "{" + ", ".join(items) + "}"
        if k == 3:
            return self.msg(d)
        if k == 4:  # a nested, tool-call-like value
            return ("{'type': 'function', 'function': {'name': %s, 'arguments': {'x': %s, "
                    "'y': [%s]}}}" % (self.s(), self.i(), self.s()))
        return self.leaf("dict")

    # ---- statements

    def tag(self, body, kind="%"):
        left = self.pick(["", "", "", "-", "+"]) if kind == "%" else self.pick(["", "", "-"])
        right = self.pick(["", "", "", "-", "+"]) if kind == "%" else self.pick(["", "", "-"])
        sp = self.pick([" ", " ", "", "  ", "\n"])
        open_, close = ("{%", "%}") if kind == "%" else ("{{", "}}")
        return open_ + left + sp + body + sp.replace("\n", " ") + right + close

    def text(self):
        parts = ["", "x", " ", "\n", "  ", "\t", "<s>", "[", "]", "\n\n", " | ", "A\n  ", "é",
                 "{", "}", "%"]
        t = "".join(self.pick(parts) for _ in range(self.r.randint(1, 4)))
        # avoid forming a tag opener with the next tag: '{' followed by '{%'
        return t.rstrip("{") if "{" in t else t

    def block(self, d, n=None):
        out = []
        for _ in range(n if n is not None else self.r.randint(1, 4)):
            out.append(self.stmt(d))
        return "".join(out)

    def stmt(self, d):
        k = self.r.randint(0, 15)
        if d <= 0 or k <= 2:
            return self.text()
        if k <= 5:
            return self.tag(self.expr(3, "any" if self.chance(0.3) else "str"), "{") + \
                (self.text() if self.chance(0.5) else "")
        if k == 6:
            return self.s_if(d)
        if k == 7 or k == 8:
            return self.s_for(d)
        if k == 9:
            return self.s_set(d)
        if k == 10:
            return self.s_ns(d)
        if k == 11 and self.loops:
            return self.tag(self.pick(["if %s" % self.expr(2, "bool")])) + \
                self.tag(self.pick(["break", "continue"])) + self.tag("endif")
        if k == 12:
            return "{#%s %s %s#}" % (self.pick(["", "-", "+"]), self.pick(["c", "note\n",
                                                                          "{{ x }}"]),
                                     self.pick(["", "-", "+"]))
        if k == 13:
            return self.s_macro(d)
        if k == 14 and self.macros:
            return self.tag(self.macro_call(2), "{")
        if k == 15 and self.chance(0.2):  # in a dead branch only: renders
            return self.tag("if false") + self.tag(self.pick(["1.5", "3 / 2", "(1, 2)",
                                                               "2 ** 3", "x | wordcount"]),
                                                   "{") + self.tag("endif")
        return self.text()

    def s_macro(self, d):
        name = self.pick(["m", "fmt", "render_tool", "m2"])
        n = self.r.randint(0, 3)
        nd = self.r.randint(0, n)
        params = ["p%d" % i for i in range(n)]
        sig = ", ".join(p if i < n - nd else "%s=%s" % (p, self.expr(1, "any"))
                        for i, p in enumerate(params))
        if self.in_macro:  # kvcache refuses a macro defined in a macro
            if not self.chance(0.1):
                return self.text()
            self.outside.append("nested macro")
        self.in_macro += 1
        saved = list(self.loops), dict(self.vars), list(self.macros)
        self.loops = [(p, "any") for p in params]  # the body sees its parameters
        self.vars = {}  # and top-level variables only as they are when called: keep it simple
        body = self.block(d - 1, self.r.randint(1, 3))
        self.loops, self.vars, self.macros = saved
        self.in_macro -= 1
        self.macros = [m for m in self.macros if m[0] != name] + [(name, n, nd)]
        return self.tag("macro %s(%s)" % (name, sig)) + body + self.tag("endmacro")

    def s_if(self, d):
        out = self.tag("if " + self.expr(3, "bool" if self.chance(0.8) else "any")) + \
            self.block(d - 1)
        for _ in range(self.r.randint(0, 2)):
            out += self.tag("elif " + self.expr(3, "bool")) + self.block(d - 1)
        if self.chance(0.5):
            out += self.tag("else") + self.block(d - 1)
        return out + self.tag("endif")

    def s_for(self, d):
        k = self.r.randint(0, 6)
        saved = list(self.loops), dict(self.vars)
        if k <= 2:
            name, t = self.pick(["message", "m", "msg"]), "msg"
            it = "messages" + self.pick(["", "", "[1:]", "[::-1]", "[:-1]", " | reverse"])
            head = name
            self.loops.append((name, t))
        elif k == 3:
            head, it = "k, v", "%s.items()" % self.wrap(self.expr(2, "dict"))
            self.loops += [("k", "str"), ("v", "any")]
        elif k == 4:
            head, it = "c", self.wrap(self.expr(2, "str"))
            self.loops.append(("c", "str"))
        else:
            head, it = "i", self.pick(["range(%s)" % self.pick(["3", "0", "5", "-1"]),
                                       self.expr(2, "list")])
            self.loops.append(("i", "int" if it.startswith("range") else "any"))
        cond = " if " + self.expr(2, "bool") if self.chance(0.2) else ""
        bump = ""
        if cond and self.ns and self.chance(0.5):  # a counter the body moves: tested lazily
            ns = self.pick(self.ns)
            cond = " if %s.count %s %s" % (ns, self.pick(["<", "<=", ">", "!="]),
                                           self.r.randint(0, 3))
            bump = self.tag("set %s.count = %s.count + 1" % (ns, ns))
        out = self.tag("for %s in %s%s" % (head, it, cond)) + bump + self.block(d - 1)
        if self.chance(0.25):
            out += self.tag("else") + self.block(d - 1)
        self.loops, self.vars = saved
        return out + self.tag("endfor")

    def s_set(self, d):
        name = self.pick(["content", "sys", "out", "n", "items", "flag"])
        t = self.pick(["str", "str", "int", "bool", "list", "dict", "msg"])
        if self.chance(0.15):
            body = self.block(d - 1, 2)
            self.vars[name] = "str"
            return self.tag("set " + name) + body + self.tag("endset")
        e = self.expr(3, t)
        self.vars[name] = t if t != "msg" else "msg"
        return self.tag("set %s = %s" % (name, e))

    def s_ns(self, d):
        if not self.ns or self.chance(0.3):
            name = self.pick(["ns", "state"])
            attrs = self.r.sample(["count", "text", "flag", "last"], self.r.randint(0, 3))
            vals = {"count": self.i(), "text": self.s(), "flag": "false", "last": "none"}
            if name not in self.ns:
                self.ns.append(name)
            self.nsattrs[name] = attrs + ["count"]
            inits = ", ".join("%s=%s" % (a, vals[a]) for a in attrs)
            if "count" not in attrs:
                inits = ("count=0, " + inits) if inits else "count=0"
            return self.tag("set %s = namespace(%s)" % (name, inits))
        name = self.pick(self.ns)
        attr = self.pick(self.nsattrs[name])
        e = "%s.count + %s" % (name, self.i()) if attr == "count" else self.expr(2, "any")
        return self.tag("set %s.%s = %s" % (name, attr, e))

    def template(self):
        return self.block(4, self.r.randint(1, 6)) + ("\n" if self.chance(0.2) else "")


def random_messages(rng, strings):
    msgs = []
    for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 3, 4, 5])):
        role = rng.choice(ROLES)
        content = rng.choice(strings) if rng.random() < 0.95 else None
        msgs.append({"role": role, "content": content})
    return msgs


def _json_leaf(rng, strings, depth=0):
    r = rng.random()
    if r < 0.4:
        return rng.choice(strings)
    if r < 0.6:
        return rng.choice(INT_LITS + [-1, 0])
    if r < 0.7:
        return rng.random() < 0.5
    if r < 0.75:
        return None
    if depth >= 2:
        return []
    if r < 0.87:
        return [_json_leaf(rng, strings, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(KEYS): _json_leaf(rng, strings, depth + 1) for _ in range(rng.randint(0, 3))}


def random_extras(rng, msgs, strings):
    """For some cases, what only the JSON context carries: messages with
    name / tool_calls / reasoning_content or without content, tools,
    documents, and variables under names the templates use (messages,
    tools and the rest render through kvc_chat_apply_template_json).
    Returns (messages, keyword arguments)."""
    if rng.random() < 0.6:
        return msgs, {}
    msgs = [dict(m) for m in msgs]
    for m in msgs:
        r = rng.random()
        if r < 0.2:
            m["name"] = rng.choice(strings)
        elif r < 0.45:
            m["tool_calls"] = [
                {"id": rng.choice(strings), "type": "function",
                 "function": {"name": rng.choice(strings),
                              "arguments": {rng.choice(KEYS): _json_leaf(rng, strings)
                                            for _ in range(rng.randint(0, 3))}}}
                for _ in range(rng.randint(1, 2))]
        elif r < 0.55:
            m.pop("content", None)
        elif r < 0.65:
            m["reasoning_content"] = rng.choice(strings)
    kwargs = {}
    if rng.random() < 0.5:
        kwargs["tools"] = [{"type": "function", "function": {
            "name": rng.choice(strings), "description": rng.choice(strings),
            "parameters": {"type": "object", "properties": {
                rng.choice(KEYS): {"type": rng.choice(["string", "integer", "array"])}
                for _ in range(rng.randint(0, 2))}}}} for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.2:
        kwargs["documents"] = [{"title": rng.choice(strings), "text": rng.choice(strings)}]
    if rng.random() < 0.4:
        kwargs[rng.choice(NAMES_UNDEF + ["enable_thinking", "bos_token"])] = \
            _json_leaf(rng, strings)
    return msgs, kwargs


# ---------------------------------------------------------------------------
# one case


_TOKENIZER = None


def _tokenizer():
    """A byte-level vocabulary with bos '<s>' and eos '</s>' so bos_token
    and eos_token are not empty."""
    global _TOKENIZER
    if _TOKENIZER is None:
        tokens = [BYTE_ENCODER[b] for b in range(256)] + ["<s>", "</s>"]
        types = [1] * 256 + [CONTROL, CONTROL]
        _TOKENIZER = kvcache.Tokenizer.from_vocab(tokens, [], types, bos=256, eos=257)
    return _TOKENIZER


def run_case(template, messages, agp, with_tokens, outside, extras=None):
    """Returns (verdict, jinja result, kvcache result); results are
    ('ok', text) or ('err', description). extras: tools, documents and
    other variables (keyword arguments of apply_chat_template)."""
    extras = extras or {}
    bos, eos = ("<s>", "</s>") if with_tokens else ("", "")
    try:
        variables = {"bos_token": bos, "eos_token": eos, **extras}  # extras override
        want = ("ok", render_jinja(template, messages, agp, **variables))
    except Exception as exc:  # any jinja2 failure: kvcache must fail too
        want = ("err", "%s: %s" % (type(exc).__name__, exc))
    try:
        if with_tokens:
            got = ("ok", _tokenizer().apply_chat_template(messages, agp, template=template,
                                                          **extras))
        else:
            got = ("ok", kvcache.render_chat_template(template, messages, agp, **extras))
    except kvcache.UnsupportedError as exc:
        got = ("unsupported", str(exc))
    except kvcache.KvcacheError as exc:
        got = ("err", "%s: %s" % (type(exc).__name__, exc))
    if want == got or (want[0] == "err" and got[0] != "ok"):
        return "same", want, got
    if got[0] == "unsupported" and (outside or (want[0] == "ok" and " at 0x" in want[1])):
        return "outside", want, got  # (jinja2 printed an address: kvcache refuses to)
    if want[0] == "ok" and got[0] == "err" and ("integer overflow" in got[1] or
                                                "64-bit" in got[1]):
        return "bigint", want, got
    if want[0] == "ok" and got[0] == "err" and "slice" in got[1]:
        return "constfold", want, got
    if want[0] == "ok" and got[0] == "ok" and OBJECTS.search(want[1]):
        return "object", want, got
    if want[0] == "ok" and got[0] == "ok" and CASE_OPS.search(template) and \
            any(_is_cased_nonascii(ch) for ch in template + repr(messages)):
        return "case", want, got
    return "DIFF", want, got


def generate(seed, cased=False):
    """(template, messages, add_generation_prompt, with_tokens, outside,
    extras) for one seed."""
    rng = random.Random(seed)
    g = Gen(rng, cased)
    template = g.template()
    msgs = random_messages(rng, g.strings)
    agp, tokens = rng.random() < 0.5, rng.random() < 0.3
    # a stream of its own, so the other draws stay what they were for each seed
    msgs, extras = random_extras(random.Random(seed * 7919 + 17), msgs, g.strings)
    return template, msgs, agp, tokens, g.outside, extras


def run(seeds, cased=False):
    """Runs the cases for seeds; returns {verdict: count} and the DIFF cases."""
    counts, diffs = {}, []
    for seed in seeds:
        template, msgs, agp, tokens, outside, extras = generate(seed, cased)
        verdict, want, got = run_case(template, msgs, agp, tokens, outside, extras)
        counts[verdict] = counts.get(verdict, 0) + 1
        if verdict == "DIFF":
            diffs.append((seed, template, msgs, agp, tokens, extras, want, got))
    return counts, diffs


def describe(diff):
    seed, template, msgs, agp, tokens, extras, want, got = diff
    return ("seed %d  add_generation_prompt=%s bos/eos=%s\ntemplate: %r\nmessages: %r\n"
            "variables: %r\njinja2:  %r\nkvcache: %r\n" % (seed, agp, tokens, template, msgs,
                                                          extras, want, got))


def main(argv):
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("-n", type=int, default=10000, help="number of cases")
    p.add_argument("--cased", action="store_true", help="include cased non-ASCII strings")
    p.add_argument("--show", type=int, default=3, help="differences to print")
    a = p.parse_args(argv)
    counts, diffs = run(range(a.seed, a.seed + a.n), a.cased)
    for diff in diffs[:a.show]:
        print(describe(diff))
    print(counts)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
