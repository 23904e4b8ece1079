"""Tokenizer of a GGUF model (byte-level BPE) and its chat template
(include/kvcache/tokenizer.h)::

    tok = kvcache.Tokenizer.from_gguf("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi!"}])
    ids = tok.encode(prompt)                 # special tokens recognised
    text = tok.decode(ids)                   # == prompt

Text is ``str`` (UTF-8 encoded with ``surrogateescape``, so a string from
``bytes.decode("utf-8", "surrogateescape")`` round-trips its invalid bytes)
or ``bytes``. :meth:`Tokenizer.decode` returns ``str`` (invalid UTF-8
replaced, or kept as surrogates with ``errors="surrogateescape"``);
:meth:`Tokenizer.decode_bytes` and :meth:`Tokenizer.token_to_bytes` return
the raw bytes, which a stream of tokens may cut inside a UTF-8 character
(:class:`Utf8Stream` turns them into text as they come).

A Tokenizer is immutable after creation: any number of threads may use one;
close() waits for the calls running in other threads (a model's borrowed
tokenizer: Model.close() does).
Errors raise :class:`kvcache.InvalidArgumentError` (bad ids, a template that
calls ``raise_exception``), :class:`kvcache.UnsupportedError` (a tokenizer
model or pre-tokenizer this library does not implement, template syntax
outside the supported Jinja subset), :class:`kvcache.CorruptError` /
:class:`kvcache.KvcacheIOError` (bad or unreadable GGUF file).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import operator
import os
from collections.abc import Mapping

from . import _lib
from .errors import STATUS_NO_SPACE, InvalidArgumentError, UnsupportedError

__all__ = ["Tokenizer", "Utf8Stream", "TOKEN_NORMAL", "TOKEN_UNKNOWN", "TOKEN_CONTROL",
           "TOKEN_USER_DEFINED", "TOKEN_UNUSED", "TOKEN_BYTE"]

# kvc_token_type
TOKEN_UNDEFINED, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, \
    TOKEN_UNUSED, TOKEN_BYTE = range(7)

_vp = ctypes.c_void_p
_c_int = ctypes.c_int
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_size = ctypes.c_size_t


class _Vocab(ctypes.Structure):
    """ctypes mirror of ``kvc_tokenizer_vocab``."""

    _fields_ = [
        ("n_vocab", _i32),
        ("tokens", ctypes.POINTER(ctypes.c_char_p)),
        ("token_lens", ctypes.POINTER(_size)),
        ("token_types", ctypes.POINTER(_i32)),
        ("n_merges", _i32),
        ("merges", ctypes.POINTER(ctypes.c_char_p)),
        ("merge_lens", ctypes.POINTER(_size)),
        ("pre", ctypes.c_char_p),
        ("bos_id", _i32),
        ("eos_id", _i32),
        ("eot_id", _i32),
        ("unk_id", _i32),
        ("pad_id", _i32),
        ("add_bos", _i32),
    ]


class _Message(ctypes.Structure):
    """ctypes mirror of ``kvc_chat_message``."""

    _fields_ = [("role", ctypes.c_char_p), ("content", ctypes.c_char_p)]


_p = _lib.optional_proto
_gguf_open = _p("kvc_gguf_open", _c_int, ctypes.c_char_p, ctypes.POINTER(_vp))
_gguf_close = _p("kvc_gguf_close", None, _vp)
_create = _p("kvc_tokenizer_create", _c_int, ctypes.POINTER(_Vocab), ctypes.POINTER(_vp))
_from_gguf = _p("kvc_tokenizer_from_gguf", _c_int, _vp, ctypes.POINTER(_vp))
_destroy = _p("kvc_tokenizer_destroy", None, _vp)
_n_vocab = _p("kvc_tokenizer_n_vocab", _i32, _vp)
_bos = _p("kvc_tokenizer_bos", _i32, _vp)
_add_bos = _p("kvc_tokenizer_add_bos", _c_int, _vp)
_eos = _p("kvc_tokenizer_eos", _i32, _vp)
_eot = _p("kvc_tokenizer_eot", _i32, _vp)
_is_eog = _p("kvc_tokenizer_is_eog", _c_int, _vp, _i32)
_token_type = _p("kvc_tokenizer_token_type", _i32, _vp, _i32)
_tokenize = _p("kvc_tokenize", _c_int, _vp, ctypes.c_char_p, _size, _c_int, _c_int,
               ctypes.POINTER(_i32), _i64, ctypes.POINTER(_i64))
_token_to_piece = _p("kvc_token_to_piece", _c_int, _vp, _i32, ctypes.c_char_p, _size,
                     ctypes.POINTER(_size))
_detokenize = _p("kvc_detokenize", _c_int, _vp, ctypes.POINTER(_i32), _i64, ctypes.c_char_p,
                 _size, ctypes.POINTER(_size))
_apply_template = _p("kvc_chat_apply_template", _c_int, _vp, ctypes.c_char_p,
                     ctypes.POINTER(_Message), _i64, _c_int, ctypes.c_char_p, _size,
                     ctypes.POINTER(_size))
_tokenize_spans = _p("kvc_tokenize_spans", _c_int, _vp, ctypes.c_char_p, _size, _c_int,
                     ctypes.POINTER(_size), _i64, ctypes.POINTER(_i32), _i64, ctypes.POINTER(_i64))
_chat_tokenize = _p("kvc_chat_tokenize", _c_int, _vp, ctypes.c_char_p, ctypes.POINTER(_Message),
                    _i64, _c_int, _c_int, _c_int, ctypes.POINTER(_i32), _i64, ctypes.POINTER(_i64))
_u8_init = _p("kvc_utf8_stream_init", None, _vp)
_u8_feed = _p("kvc_utf8_stream_feed", _c_int, _vp, ctypes.c_char_p, _size, ctypes.c_char_p, _size,
              ctypes.POINTER(_size))
_u8_flush = _p("kvc_utf8_stream_flush", _c_int, _vp, ctypes.c_char_p, _size, ctypes.POINTER(_size))
_apply_template_json = _p("kvc_chat_apply_template_json", _c_int, _vp, ctypes.c_char_p,
                          ctypes.c_char_p, _c_int, ctypes.c_char_p, _size, ctypes.POINTER(_size))

_INT32_MAX = 2**31 - 1


class _Utf8State(ctypes.Structure):
    """ctypes mirror of ``kvc_utf8_stream``."""

    _fields_ = [("held", ctypes.c_ubyte * 4), ("n_held", ctypes.c_ubyte)]


class Utf8Stream:
    """Streaming text of token bytes (C: kvc_utf8_stream): ``feed(piece)``
    returns the complete characters so far and holds back an incomplete
    one; ``flush()`` ends the stream (a held incomplete character becomes
    U+FFFD). Ill-formed bytes become U+FFFD exactly as
    ``bytes.decode("utf-8", "replace")`` does, so the joined output equals
    decoding all the bytes at once::

        s = Utf8Stream()
        for t in ids:
            print(s.feed(tok.token_to_bytes(t)), end="", flush=True)
        print(s.flush())
    """

    def __init__(self):
        self._st = _Utf8State()
        _u8_init(ctypes.byref(self._st))

    def _run(self, data: bytes | None) -> str:
        n = 0 if data is None else len(data)
        cap = 3 * (n + 4)
        buf = ctypes.create_string_buffer(cap)
        out = _size()
        if data is None:
            _lib.check(_u8_flush(ctypes.byref(self._st), buf, cap, ctypes.byref(out)))
        else:
            _lib.check(_u8_feed(ctypes.byref(self._st), data, n, buf, cap, ctypes.byref(out)))
        return buf.raw[: out.value].decode("utf-8")

    def feed(self, data) -> str:
        """Appends bytes (a token's piece); returns the text they complete."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"data must be bytes, not {type(data).__name__}")
        return self._run(bytes(data))

    def flush(self) -> str:
        """Ends the stream: "" or U+FFFD for a held incomplete character."""
        return self._run(None)


def _text_bytes(text, name="text") -> bytes:
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    if isinstance(text, str):
        try:
            return text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(f"{name} holds a lone surrogate that is not an escaped "
                                       f"byte: {exc}") from None
    raise InvalidArgumentError(f"{name} must be str or bytes, not {type(text).__name__}")


def _c_string(text, name) -> bytes | None:
    if text is None:
        return None
    b = _text_bytes(text, name)
    if b"\0" in b:
        raise InvalidArgumentError(f"{name} contains a NUL character")
    return b


def _strings(items, name):
    """(char* array, size_t array, keep-alive list) for a list of str/bytes."""
    data = [_text_bytes(x, name) for x in items]
    arr = (ctypes.c_char_p * max(len(data), 1))(*data)
    lens = (_size * max(len(data), 1))(*[len(x) for x in data])
    return arr, lens, data


def _id(value, name) -> int:
    return _lib.int32_attr(value, name)  # an int32 in C: refuse, never wrap


_MAKE = object()  # Tokenizer objects come from from_gguf / from_vocab / Model.tokenizer


def _in_use(method):
    """Runs the method inside a use of the tokenizer's C object (its own, or
    its model's when borrowed), so close() cannot free it meanwhile."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._using():
            return method(self, *args, **kwargs)

    return wrapper


class Tokenizer(_lib.NoCopy):
    """A byte-level BPE tokenizer (see the module docstring). Create one with
    Tokenizer.from_gguf(path) or Tokenizer.from_vocab(...), or take a model's
    with kvcache.model.Model(path).tokenizer."""

    def __init__(self, handle, _key=None, _owner=None):
        self._h = None
        self._owner = None
        self._life = _lib.Lifetime("the tokenizer")
        if _key is not _MAKE:
            raise TypeError("create a Tokenizer with Tokenizer.from_gguf(path), "
                            "Tokenizer.from_vocab(...) or Model(path).tokenizer")
        self._h = handle
        self._owner = _owner  # a Model whose tokenizer this borrows, or None (owned)

    @classmethod
    def _borrowed(cls, handle: int, owner) -> "Tokenizer":
        return cls(handle, _MAKE, owner)

    # ---- construction ------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """Reads the tokenizer (and chat template) of a GGUF model file."""
        g = _vp()
        _lib.check(_gguf_open(os.fsencode(path), ctypes.byref(g)))
        try:
            h = _vp()
            _lib.check(_from_gguf(g, ctypes.byref(h)))
            return cls(h.value, _MAKE)
        finally:
            _gguf_close(g)

    @classmethod
    def from_vocab(cls, tokens, merges=(), token_types=None, pre="gpt2", bos=-1, eos=-1, eot=-1,
                   unk=-1, pad=-1, add_bos=False) -> "Tokenizer":
        """Builds a tokenizer from arrays as a GGUF stores them: token texts in
        GPT-2's byte-to-unicode form, "left right" merges by rank, optional
        kvc_token_type per token, the pre-tokenizer name and special ids."""
        toks, tok_lens, keep1 = _strings(tokens, "token")
        mers, mer_lens, keep2 = _strings(merges, "merge")
        v = _Vocab()
        v.n_vocab = len(keep1)
        v.tokens = toks
        v.token_lens = tok_lens
        types = None
        if token_types is not None:
            types = (_i32 * max(len(token_types), 1))(
                *[_id(x, "token_types[]") for x in token_types])
            if len(token_types) != len(keep1):
                raise InvalidArgumentError(f"token_types has {len(token_types)} entries for "
                                           f"{len(keep1)} tokens")
            v.token_types = types
        v.n_merges = len(keep2)
        v.merges = mers
        v.merge_lens = mer_lens
        v.pre = None if pre is None else pre.encode()
        v.bos_id, v.eos_id, v.eot_id, v.unk_id, v.pad_id = (
            _id(bos, "bos"), _id(eos, "eos"), _id(eot, "eot"), _id(unk, "unk"), _id(pad, "pad"))
        v.add_bos = 1 if add_bos else 0
        h = _vp()
        _lib.check(_create(ctypes.byref(v), ctypes.byref(h)))
        return cls(h.value, _MAKE)

    # ---- lifetime ------------------------------------------------------------------

    def _using(self):
        """A use of the C tokenizer: the model's for a borrowed one (it dies
        with its model), else its own."""
        if self._owner is not None:
            return self._owner._life.use()
        return self._life.use()

    def _ptr(self) -> int:
        if not self._h:
            raise InvalidArgumentError("the tokenizer is closed")
        if self._owner is not None:
            self._owner._live()  # a borrowed tokenizer dies with its model
        return self._h

    def close(self) -> None:
        """Frees the C tokenizer once the calls running in other threads are
        done (idempotent); a model's borrowed tokenizer is only detached (the
        model frees it)."""
        if self._owner is not None:
            self._h = None
            return
        if self._life.close():
            h, self._h = self._h, None
            if h:
                _destroy(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass

    def __repr__(self) -> str:
        if not self._h:
            return "Tokenizer(closed)"
        return f"Tokenizer(n_vocab={self.n_vocab}, bos={self.bos}, eos={self.eos}, eot={self.eot})"

    # ---- properties ----------------------------------------------------------------

    @property
    @_in_use
    def n_vocab(self) -> int:
        return _n_vocab(self._ptr())

    @property
    @_in_use
    def bos(self) -> int:
        """Beginning-of-sequence id, -1 if none."""
        return _bos(self._ptr())

    @property
    @_in_use
    def add_bos(self) -> bool:
        """Whether a fresh prompt starts with BOS (``encode(add_bos=...)``):
        tokenizer.ggml.add_bos_token, or without it llama.cpp's default
        (true for the Llama 3 pre-tokenizers); False when there is no BOS."""
        return bool(_add_bos(self._ptr()))

    @property
    @_in_use
    def eos(self) -> int:
        """End-of-sequence id, -1 if none."""
        return _eos(self._ptr())

    @property
    @_in_use
    def eot(self) -> int:
        """End-of-turn id (<|im_end|>, <|eot_id|>, ...), else eos."""
        return _eot(self._ptr())

    @_in_use
    def is_eog(self, token_id: int) -> bool:
        """True if generation stops at token_id (eos, eot, other end controls)."""
        try:
            tid = operator.index(token_id)
        except TypeError:
            raise InvalidArgumentError(f"token_id must be an integer, not {token_id!r}") from None
        if not -(2**31) <= tid <= _INT32_MAX:
            return False  # no token has that id
        return bool(_is_eog(self._ptr(), tid))

    # ---- encode / decode -----------------------------------------------------------

    @_in_use
    def encode(self, text, add_bos: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of text (str or bytes). add_bos prepends BOS when the
        vocabulary has one; parse_special recognises control-token text such as
        "<|im_start|>" (user-defined tokens are always recognised)."""
        data = _text_bytes(text)
        cap = len(data) + 1  # every byte yields at most one token, plus BOS
        out = (_i32 * cap)()
        n = _i64()
        _lib.check(_tokenize(self._ptr(), data, len(data), 1 if add_bos else 0,
                             1 if parse_special else 0, out, cap, ctypes.byref(n)))
        return out[: n.value]

    def _ids(self, ids):
        try:
            seq = [_id(x, "token id") for x in ids]
        except TypeError:
            raise InvalidArgumentError("ids must be an iterable of integers") from None
        for x in seq:
            if not -(2**31) <= x <= _INT32_MAX:
                raise InvalidArgumentError(f"token id {x} is outside [0, {self.n_vocab})")
        return (_i32 * max(len(seq), 1))(*seq), len(seq)

    @_in_use
    def token_type(self, token_id: int) -> int:
        """kvc_token_type of a token (TOKEN_CONTROL, TOKEN_NORMAL, ...)."""
        tid = _id(token_id, "token_id")
        t = _token_type(self._ptr(), tid) if -(2**31) <= tid <= _INT32_MAX else -1
        if t < 0:
            raise InvalidArgumentError(f"token id {tid} is outside [0, {self.n_vocab})")
        return t

    @_in_use
    def decode_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        """Concatenated raw bytes of the tokens; skip_special_tokens leaves
        out control tokens (bos, eos, <|im_start|>, <|im_end|>, ...) as
        transformers' decode does."""
        arr, n = self._ids(ids)
        if skip_special_tokens:
            keep = [x for x in arr[:n] if _token_type(self._ptr(), x) != TOKEN_CONTROL]
            arr, n = (_i32 * max(len(keep), 1))(*keep), len(keep)
        need = _size()
        cap = 64 * n + 64
        for _ in range(2):
            buf = ctypes.create_string_buffer(max(cap, 1))
            st = _detokenize(self._ptr(), arr, n, buf, cap, ctypes.byref(need))
            if st == 0:
                return buf.raw[: need.value]
            if need.value <= cap:
                _lib.check(st)
            cap = need.value
        _lib.check(st)
        return b""  # not reached

    def decode(self, ids, errors: str = "replace", skip_special_tokens: bool = False) -> str:
        """Text of the tokens; invalid UTF-8 handled by errors (as
        bytes.decode); skip_special_tokens=True leaves out control tokens
        (e.g. the <|im_end|> that ends a generated reply), as transformers'
        decode does."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors)

    @_in_use
    def token_to_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (special tokens give their text)."""
        tid = _id(token_id, "token_id")
        if not -(2**31) <= tid <= _INT32_MAX:
            raise InvalidArgumentError(f"token id {tid} is outside [0, {self.n_vocab})")
        need = _size()
        buf = ctypes.create_string_buffer(256)
        st = _token_to_piece(self._ptr(), tid, buf, 256, ctypes.byref(need))
        if st != 0 and need.value > 256:
            buf = ctypes.create_string_buffer(need.value)
            st = _token_to_piece(self._ptr(), tid, buf, need.value, ctypes.byref(need))
        _lib.check(st)
        return buf.raw[: need.value]

    # ---- chat template -------------------------------------------------------------

    @_in_use
    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            template=None, *, tools=None, documents=None, tokenize: bool = False,
                            add_bos: bool = False, parse_special_content: bool = False,
                            **kwargs):
        """Renders messages with the model's chat template, or with template
        (a Jinja string) if given, as transformers' apply_chat_template does:
        messages are dicts with any keys ("role", "content", "tool_calls",
        "tool_call_id", "name", "reasoning_content", ...), tools a list of
        JSON schemas (dicts), documents a list, and extra keyword arguments
        (enable_thinking=False, date_string=..., bos_token=...) become
        template variables. Returns the prompt text, or with tokenize=True
        its token ids (unlike transformers, tokenize defaults to False).

        Tokenized, message contents are plain text: "<|im_end|>" typed in a
        content is the tokens of those characters, and only the template's
        own markers are control tokens (C: kvc_chat_tokenize);
        parse_special_content=True tokenizes the prompt as one string, as
        ``encode(prompt)`` does. A content holding control-token text must
        appear in the prompt as given (or stripped of surrounding
        whitespace); a template that otherwise changes it raises
        UnsupportedError. add_bos prepends BOS (templates usually write it).
        See :func:`render_chat_template` for what values may hold."""
        if not tokenize:
            return render_chat_template(template, messages, add_generation_prompt, self,
                                        tools=tools, documents=documents, **kwargs)
        msgs = list(messages)
        if (tools is None and documents is None and not kwargs
                and all(map(_plain_message, msgs))):
            tmpl = _c_string(template, "template")
            arr, keep = _message_array(msgs)
            agp, bos, ps = (1 if add_generation_prompt else 0), (1 if add_bos else 0), \
                (1 if parse_special_content else 0)
            n = _i64()
            st = _chat_tokenize(self._ptr(), tmpl, arr, len(msgs), agp, bos, ps, None, 0,
                                ctypes.byref(n))
            if st != STATUS_NO_SPACE:
                _lib.check(st)
            out = (_i32 * max(n.value, 1))()
            _lib.check(_chat_tokenize(self._ptr(), tmpl, arr, len(msgs), agp, bos, ps, out,
                                      n.value, ctypes.byref(n)))
            return out[: n.value]
        text = render_chat_template(template, msgs, add_generation_prompt, self, tools=tools,
                                    documents=documents, **kwargs)
        if parse_special_content:
            return self.encode(text, add_bos=add_bos)
        spans = self._content_spans(text, template, msgs, add_generation_prompt, tools,
                                    documents, kwargs)
        data = _text_bytes(text)
        sp = (_size * max(2 * len(spans), 1))(*[x for ab in spans for x in ab])
        cap = len(data) + 1
        out = (_i32 * cap)()
        n = _i64()
        _lib.check(_tokenize_spans(self._ptr(), data, len(data), 1 if add_bos else 0, sp,
                                   len(spans), out, cap, ctypes.byref(n)))
        return out[: n.value]

    def _content_spans(self, text, template, msgs, agp, tools, documents, kwargs):
        """Byte spans of the prompt where string contents with control-token
        text stand: kvc_chat_tokenize's placeholder method for the JSON path."""
        def special(c):
            return isinstance(c, str) and self.encode(c) != self.encode(c, parse_special=False)

        marked = [i for i, m in enumerate(msgs)
                  if isinstance(m, Mapping) and special(m.get("content"))]
        if not marked:
            return []
        real = _text_bytes(text)
        mark = next((chr(cp) for cp in range(0xE000, 0xE100)
                     if chr(cp) not in text and all(chr(cp) not in str(m.get("content"))
                                                    for m in msgs if isinstance(m, Mapping))),
                    None)
        if mark is None:
            raise UnsupportedError("apply_chat_template: no free placeholder character")
        ph = [dict(m) if isinstance(m, Mapping) else m for m in msgs]
        cores = {}
        for i in marked:
            c = msgs[i]["content"]
            core = c.strip(" \t\n\r\v\f")
            lead = c[: len(c) - len(c.lstrip(" \t\n\r\v\f"))]
            trail = c[len(lead) + len(core):]
            ph[i]["content"] = f"{lead}{mark}{i}{mark}{trail}"
            cores[i] = _text_bytes(core)
        q = render_chat_template(template, ph, agp, self, tools=tools, documents=documents,
                                 **kwargs)
        parts = q.split(mark)
        rebuilt, spans, pos = [], [], 0
        ok = len(parts) % 2 == 1
        for k, part in enumerate(parts if ok else []):
            if k % 2 == 1:
                if not part.isdigit() or int(part) not in cores:
                    ok = False
                    break
                core = cores[int(part)]
                spans.append((pos, pos + len(core)))
                rebuilt.append(core)
                pos += len(core)
            else:
                b = _text_bytes(part)
                rebuilt.append(b)
                pos += len(b)
        if not ok or b"".join(rebuilt) != real:
            raise UnsupportedError(
                "apply_chat_template: a message content holds special-token text and the "
                "template changes that content, so its place in the prompt is unknown: remove "
                "the special-token text, or pass parse_special_content=True")
        return spans


_INT64 = 2**63
_MAX_DEPTH = 500  # the interpreter's nesting cap on lists and dicts


def _path_str(path) -> str:
    """messages[0]['tool_calls'] from the chain (parent, key) _json_value passes."""
    keys = []
    while isinstance(path, tuple):
        path, key = path
        keys.append(f"[{key!r}]" if isinstance(key, (str, int)) else str(key))
    return str(path) + "".join(reversed(keys))


def _json_value(x, path, depth):
    """x checked (and Mappings made dicts) for the JSON context: nothing that
    json.dumps would change silently (tuples, non-str keys) or the C reader
    refuses (floats, big integers, lone surrogates) gets through unnamed.
    path: a name, or (parent path, key or index), formatted only for errors."""
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgumentError(f"{_path_str(path)} holds a lone surrogate (not UTF-8 "
                                       f"text)") from None
        return str(x)
    if isinstance(x, int):
        if not -_INT64 <= x < _INT64:
            raise UnsupportedError(f"{_path_str(path)} is an integer beyond 64 bits (kvcache's "
                                   f"chat templates have no bigger integers)")
        return int(x)
    if isinstance(x, float):
        raise UnsupportedError(f"{_path_str(path)} is a float ({x!r}): kvcache's chat templates "
                               f"have no floats (pass an int or a str)")
    if depth >= _MAX_DEPTH and isinstance(x, (list, Mapping)):
        raise InvalidArgumentError(f"{_path_str(path)}: lists and dicts nested more than "
                                   f"{_MAX_DEPTH} deep (or holding themselves)")
    if isinstance(x, list):
        out = []
        for i, v in enumerate(x):  # a loop, not a comprehension: one frame per level
            out.append(_json_value(v, (path, i), depth + 1))
        return out
    if isinstance(x, Mapping):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise InvalidArgumentError(f"{_path_str(path)} has a key {k!r} that is not a str "
                                           f"(JSON keys are strings)")
            out[k] = _json_value(v, (path, k), depth + 1)
        return out
    what = ("a tuple (jinja2 would print it as one; pass a list)" if isinstance(x, tuple)
            else f"a {type(x).__name__}, not a JSON value (str, int, bool, None, list, dict)")
    raise InvalidArgumentError(f"{_path_str(path)} is {what}")


def _plain_message(m) -> bool:
    """A message the struct API renders exactly: a dict of just role and content."""
    if type(m) is not dict or len(m) != 2 or "role" not in m or "content" not in m:
        return False
    return all(v is None or (isinstance(v, (str, bytes, bytearray, memoryview)) and
                             (b"\0" if not isinstance(v, str) else "\0") not in v)
               for v in m.values())


def _message_array(msgs):
    """(kvc_chat_message array, keep-alive list) for plain messages."""
    arr = (_Message * max(len(msgs), 1))()
    keep = []
    for i, m in enumerate(msgs):
        r = _c_string(m["role"], f"messages[{i}]['role']")
        c = _c_string(m["content"], f"messages[{i}]['content']")
        keep += [r, c]
        arr[i].role = r
        arr[i].content = c
    return arr, keep


def _render(fn, tokenizer, tmpl, *args):
    with tokenizer._using() if tokenizer is not None else contextlib.nullcontext():
        h = tokenizer._ptr() if tokenizer is not None else None
        need = _size()
        cap = 4096
        for _ in range(3):
            buf = ctypes.create_string_buffer(cap)
            st = fn(h, tmpl, *args, buf, cap, ctypes.byref(need))
            if st == 0:
                return buf.raw[: need.value].decode("utf-8", "surrogateescape")
            if need.value <= cap:
                break
            cap = need.value
    _lib.check(st)
    return ""  # not reached


def render_chat_template(template, messages, add_generation_prompt=True, tokenizer=None, *,
                         tools=None, documents=None, **kwargs) -> str:
    """Renders a chat template without a model (bos_token and eos_token are
    then empty strings unless given as keyword arguments), or with
    tokenizer's template when template is None.

    As transformers' apply_chat_template: tools and documents are the
    template's ``tools`` and ``documents`` (None by default), extra keyword
    arguments become variables (and override bos_token / eos_token).
    Messages of just "role" and "content" (str, bytes or None) and no
    tools, documents or extra variables take the struct API
    (kvc_chat_apply_template); anything else is passed whole as JSON
    (kvc_chat_apply_template_json), so no key is ever dropped. Values there
    must be str, int, bool, None, lists and dicts (Mappings) with str keys:
    anything else raises InvalidArgumentError naming its path (tuples too,
    which json.dumps would silently make lists), floats and integers beyond
    64 bits raise UnsupportedError (the interpreter has neither)."""
    msgs = list(messages)
    tmpl = _c_string(template, "template")
    if tokenizer is None and tmpl is None:
        raise InvalidArgumentError("no template given and no tokenizer to take one from")
    agp = 1 if add_generation_prompt else 0
    if tools is None and documents is None and not kwargs and all(map(_plain_message, msgs)):
        arr, keep = _message_array(msgs)
        return _render(_apply_template, tokenizer, tmpl, arr, len(msgs), agp)
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            raise InvalidArgumentError(f"messages[{i}] must be a dict, not {type(m).__name__}")
    context = {"messages": [_json_value(m, ("messages", i), 1) for i, m in enumerate(msgs)]}
    if tools is not None:
        context["tools"] = _json_value(tools, "tools", 0)
    if documents is not None:
        context["documents"] = _json_value(documents, "documents", 0)
    for k, v in kwargs.items():
        context[k] = _json_value(v, k, 0)
    text = json.dumps(context, ensure_ascii=False, allow_nan=False).encode("utf-8")
    return _render(_apply_template_json, tokenizer, tmpl, text, agp)
