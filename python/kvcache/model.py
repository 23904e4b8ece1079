"""Model runtime: a llama-architecture GGUF model served through kvcache's
paged cache (C: include/kvcache/model.h).

    model = kvcache.Model("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    logits = model.eval(tokens)                       # (n, n_vocab), fresh cache
    out = model.generate([prompt_a, prompt_b], max_new_tokens=32)   # engine

``Model.forward`` is the low-level step (like llama.cpp's llama_decode) over a
:class:`kvcache.PagedKVCache` made by :meth:`Model.new_cache`; :class:`Engine`
is the continuous-batching scheduler (chunked prefill mixed with decode,
prefix caching, preemption by recomputation).
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from . import _lib
from .cache import PagedKVCache
from .errors import InvalidArgumentError

_c_int = ctypes.c_int
_vp = ctypes.c_void_p
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64


class ModelParams(ctypes.Structure):
    _fields_ = [("progress", _vp), ("progress_user", _vp), ("prefault", _i32)]


class ModelInfo(ctypes.Structure):
    _fields_ = [
        ("arch", ctypes.c_char * 32),
        ("name", ctypes.c_char * 128),
        ("n_layer", _i32), ("n_embd", _i32), ("n_head", _i32), ("n_head_kv", _i32),
        ("head_dim", _i32), ("n_ff", _i32), ("n_vocab", _i32), ("n_ctx_train", _i32),
        ("n_rot", _i32),
        ("rope_freq_base", ctypes.c_float), ("rms_eps", ctypes.c_float),
        ("tied_output", _i32),
        ("n_params", _i64),
        ("weight_bytes", ctypes.c_size_t),
    ]


class SamplingParams(ctypes.Structure):
    _fields_ = [("temperature", ctypes.c_float), ("top_k", _i32), ("top_p", ctypes.c_float),
                ("seed", ctypes.c_uint64)]


class EngineParams(ctypes.Structure):
    _fields_ = [
        ("n_threads", _i32), ("kv_dtype", _c_int), ("quant_group", _i32), ("page_size", _i32),
        ("kv_capacity_tokens", _i64), ("max_step_tokens", _i32), ("max_running", _i32),
        ("enable_prefix_caching", _i32),
    ]


class EngineEvent(ctypes.Structure):
    _fields_ = [("request_id", _i64), ("token", _i32), ("finish", _i32)]


class EngineStats(ctypes.Structure):
    _fields_ = [
        ("steps", _i64), ("prompt_tokens", _i64), ("cached_tokens", _i64),
        ("prefill_tokens", _i64), ("decode_tokens", _i64), ("preemptions", _i64),
        ("prefill_seconds", ctypes.c_double), ("decode_seconds", ctypes.c_double),
        ("decode_only_tokens", _i64), ("step_seconds", ctypes.c_double),
        ("kv_bytes_per_token", _i64), ("kv_capacity_tokens", _i64),
        ("kv_used_tokens_peak", _i64),
    ]


_p = _lib.optional_proto
kvc_model_default_params = _p("kvc_model_default_params", ModelParams)
kvc_model_load = _p("kvc_model_load", _c_int, ctypes.c_char_p, ctypes.POINTER(ModelParams),
                    ctypes.POINTER(_vp))
kvc_model_destroy = _p("kvc_model_destroy", None, _vp)
kvc_model_get_info = _p("kvc_model_get_info", _c_int, _vp, ctypes.POINTER(ModelInfo))
kvc_model_tokenizer = _p("kvc_model_tokenizer", _vp, _vp)
kvc_model_ctx_create = _p("kvc_model_ctx_create", _c_int, _vp, _i32, ctypes.POINTER(_vp))
kvc_model_ctx_destroy = _p("kvc_model_ctx_destroy", None, _vp)
kvc_model_forward = _p("kvc_model_forward", _c_int, _vp, _vp, _i32, _vp, _vp, _vp, _vp, _vp, _vp,
                       _vp)
kvc_model_eval = _p("kvc_model_eval", _c_int, _vp, _vp, _i64, _i64, _c_int, _vp, _i32)
kvc_sample = _p("kvc_sample", _c_int, _vp, _i32, ctypes.POINTER(SamplingParams),
                ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(_i32))
kvc_engine_default_params = _p("kvc_engine_default_params", EngineParams)
kvc_engine_create = _p("kvc_engine_create", _c_int, _vp, ctypes.POINTER(EngineParams),
                       ctypes.POINTER(_vp))
kvc_engine_destroy = _p("kvc_engine_destroy", None, _vp)
kvc_engine_add_request = _p("kvc_engine_add_request", _c_int, _vp, _vp, _i64, _i32,
                            ctypes.POINTER(SamplingParams), _i32, ctypes.POINTER(_i64))
kvc_engine_cancel = _p("kvc_engine_cancel", _c_int, _vp, _i64)
kvc_engine_step = _p("kvc_engine_step", _c_int, _vp, ctypes.POINTER(EngineEvent), _i64,
                     ctypes.POINTER(_i64))
kvc_engine_pending = _p("kvc_engine_pending", _i64, _vp)
kvc_engine_get_stats = _p("kvc_engine_get_stats", _c_int, _vp, ctypes.POINTER(EngineStats))

_KV_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, "int4": 4}
_DTYPE_ALIASES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def _kv_dtype(name) -> tuple[str, int]:
    key = _DTYPE_ALIASES.get(str(name), str(name))
    if key not in _KV_DTYPES:
        raise InvalidArgumentError(
            f"kv_dtype {name!r}: expected one of {', '.join(_KV_DTYPES)}")
    code = {"float32": _lib.KVC_F32, "float16": _lib.KVC_F16, "bfloat16": _lib.KVC_BF16,
            "int8": _lib.KVC_I8, "int4": _lib.KVC_I4}[key]
    return key, code


def _threads(num_threads) -> int:
    if num_threads is None:
        return os.cpu_count() or 1
    n = int(num_threads)
    if n < 1:
        raise InvalidArgumentError(f"num_threads {num_threads} must be >= 1")
    return n


def _sampling(temperature, top_k, top_p, seed) -> SamplingParams:
    sp = SamplingParams()
    sp.temperature = float(temperature)
    sp.top_k = int(top_k)
    sp.top_p = float(top_p)
    sp.seed = int(seed) & (2**64 - 1)
    return sp


class Model:
    """A GGUF model (llama architecture) mapped read-only.

    Attributes: ``info`` (dict of the architecture's sizes), ``n_vocab``.
    """

    def __init__(self, path):
        self._ptr = None
        p = kvc_model_default_params()
        h = _vp()
        _lib.check(kvc_model_load(os.fsencode(path), ctypes.byref(p), ctypes.byref(h)))
        self._ptr = h.value
        self._ctx = {}
        self._lock = threading.Lock()
        info = ModelInfo()
        _lib.check(kvc_model_get_info(self._ptr, ctypes.byref(info)))
        self.info = {f: getattr(info, f) for f, _ in ModelInfo._fields_}
        self.info["arch"] = info.arch.decode()
        self.info["name"] = info.name.decode(errors="replace")
        self.n_vocab = info.n_vocab
        self.path = os.fspath(path)

    def close(self):
        for c in self._ctx.values():
            kvc_model_ctx_destroy(c)
        self._ctx = {}
        if self._ptr:
            kvc_model_destroy(self._ptr)
            self._ptr = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _live(self):
        if not self._ptr:
            raise InvalidArgumentError("the model is closed")
        return self._ptr

    @property
    def tokenizer_handle(self) -> int:
        """The C kvc_tokenizer pointer owned by the model."""
        return kvc_model_tokenizer(self._live())

    def eval(self, tokens, kv_dtype="float32", num_threads=None, decode_from=None) -> np.ndarray:
        """Logits (n, n_vocab) float32 of every position of one token
        sequence, computed in one step through a fresh cache: one prefill, or
        with decode_from=p, prefill for positions < p and the decode kernel
        for the rest (as the engine computes generated tokens)."""
        t = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64)).astype(np.int32)
        if t.ndim != 1:
            raise InvalidArgumentError("tokens must be 1-D")
        out = np.empty((t.size, self.n_vocab), np.float32)
        _, code = _kv_dtype(kv_dtype)
        df = -1 if decode_from is None else int(decode_from)
        _lib.check(kvc_model_eval(self._live(), t.ctypes.data, t.size, df, code, out.ctypes.data,
                                  _threads(num_threads)))
        return out

    def new_cache(self, capacity_tokens, kv_dtype="float16", page_size=16,
                  enable_prefix_caching=True, quant_group=8) -> PagedKVCache:
        """A PagedKVCache shaped for this model (layers, KV heads, head dim)."""
        key, _ = _kv_dtype(kv_dtype)
        pages = max(1, -(-int(capacity_tokens) // int(page_size)))
        return PagedKVCache(self.info["n_layer"], self.info["n_head_kv"], self.info["head_dim"],
                            page_size, pages, dtype=key,
                            enable_prefix_caching=enable_prefix_caching, quant_group=quant_group)

    def forward(self, cache: PagedKVCache, seqs, pos0, n, tokens, want_logits=None,
                num_threads=None, decode_from=None) -> np.ndarray:
        """One step over sequences of ``cache`` (slots already reserved):
        sequence s computes positions [pos0[s], pos0[s] + n[s]) for the
        concatenated ``tokens``. Returns the logits of the rows flagged in
        want_logits (default: the last row of each sequence), in row order.
        decode_from (per sequence, or None): positions >= it attend with the
        decode kernel, earlier ones with prefill (C: kvc_model_forward)."""
        seqs = np.ascontiguousarray(seqs, np.int64).reshape(-1)
        pos0 = np.ascontiguousarray(pos0, np.int64).reshape(-1)
        n = np.ascontiguousarray(n, np.int64).reshape(-1)
        tokens = np.ascontiguousarray(tokens, np.int32).reshape(-1)
        if not (seqs.size == pos0.size == n.size):
            raise InvalidArgumentError("seqs, pos0 and n must have the same length")
        if tokens.size != int(n.sum()):
            raise InvalidArgumentError(f"tokens has {tokens.size} entries, n sums to {n.sum()}")
        if want_logits is None:
            n_want = int((n > 0).sum())
            want_ptr = None
        else:
            want = np.ascontiguousarray(want_logits, np.uint8).reshape(-1)
            if want.size != tokens.size:
                raise InvalidArgumentError("want_logits must have one entry per token row")
            n_want = int((want != 0).sum())
            want_ptr = want.ctypes.data
        dec_ptr = None
        if decode_from is not None:
            dec = np.ascontiguousarray(decode_from, np.int64).reshape(-1)
            if dec.size != seqs.size:
                raise InvalidArgumentError("decode_from must have one entry per sequence")
            dec_ptr = dec.ctypes.data
        out = np.empty((n_want, self.n_vocab), np.float32)
        nt = _threads(num_threads)
        with self._lock:
            ctx = self._ctx.get(nt)
            if ctx is None:
                h = _vp()
                _lib.check(kvc_model_ctx_create(self._live(), nt, ctypes.byref(h)))
                ctx = self._ctx[nt] = h.value
            handle = cache._handle
            if handle is None:
                raise InvalidArgumentError("the cache is closed")
            _lib.check(kvc_model_forward(ctx, handle.ptr, seqs.size, seqs.ctypes.data,
                                         pos0.ctypes.data, n.ctypes.data, dec_ptr,
                                         tokens.ctypes.data, want_ptr, out.ctypes.data))
        return out

    def generate(self, prompts, max_new_tokens=32, *, kv_dtype="float16", num_threads=None,
                 temperature=0.0, top_k=0, top_p=1.0, seed=0, ignore_eos=False, **engine_kw):
        """Generates for each prompt (list of token-id lists) through one
        continuous-batching engine; returns the generated token lists."""
        eng = Engine(self, kv_dtype=kv_dtype, num_threads=num_threads, **engine_kw)
        try:
            ids = [eng.add_request(p, max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed, ignore_eos=ignore_eos)
                   for p in prompts]
            out = eng.run()
            return [out[i] for i in ids]
        finally:
            eng.close()


class Engine:
    """Continuous batching over one model (C: kvc_engine)."""

    def __init__(self, model: Model, *, kv_dtype="float16", num_threads=None, page_size=16,
                 kv_capacity_tokens=16384, max_step_tokens=512, max_running=64,
                 enable_prefix_caching=True, quant_group=8):
        self._ptr = None
        self._model = model  # keeps the weights mapped
        p = kvc_engine_default_params()
        p.n_threads = _threads(num_threads)
        p.kv_dtype = _kv_dtype(kv_dtype)[1]
        p.quant_group = int(quant_group)
        p.page_size = int(page_size)
        p.kv_capacity_tokens = int(kv_capacity_tokens)
        p.max_step_tokens = int(max_step_tokens)
        p.max_running = int(max_running)
        p.enable_prefix_caching = 1 if enable_prefix_caching else 0
        h = _vp()
        _lib.check(kvc_engine_create(model._live(), ctypes.byref(p), ctypes.byref(h)))
        self._ptr = h.value
        self._max_running = p.max_running
        self._out: dict[int, list[int]] = {}
        self.finish_reason: dict[int, int] = {}

    def close(self):
        if self._ptr:
            kvc_engine_destroy(self._ptr)
            self._ptr = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def add_request(self, prompt, max_new_tokens, *, temperature=0.0, top_k=0, top_p=1.0,
                    seed=0, ignore_eos=False) -> int:
        t = np.ascontiguousarray(np.asarray(prompt, np.int64)).astype(np.int32).reshape(-1)
        sp = _sampling(temperature, top_k, top_p, seed)
        rid = _i64()
        _lib.check(kvc_engine_add_request(self._ptr, t.ctypes.data, t.size, int(max_new_tokens),
                                          ctypes.byref(sp), 1 if ignore_eos else 0,
                                          ctypes.byref(rid)))
        self._out[rid.value] = []
        return rid.value

    def cancel(self, request_id):
        _lib.check(kvc_engine_cancel(self._ptr, int(request_id)))

    @property
    def pending(self) -> int:
        return kvc_engine_pending(self._ptr)

    def step(self) -> list[tuple[int, int, int]]:
        """One scheduling step; returns (request_id, token, finish) events."""
        cap = max(1, min(self.pending, self._max_running))
        ev = (EngineEvent * cap)()
        n = _i64()
        _lib.check(kvc_engine_step(self._ptr, ev, cap, ctypes.byref(n)))
        out = []
        for i in range(n.value):
            e = ev[i]
            self._out.setdefault(e.request_id, []).append(e.token)
            if e.finish:
                self.finish_reason[e.request_id] = e.finish
            out.append((e.request_id, e.token, e.finish))
        return out

    def run(self) -> dict[int, list[int]]:
        """Steps until no request is pending; returns every request's tokens."""
        while self.pending > 0:
            self.step()
        return dict(self._out)

    def stats(self) -> dict:
        s = EngineStats()
        _lib.check(kvc_engine_get_stats(self._ptr, ctypes.byref(s)))
        return {f: getattr(s, f) for f, _ in EngineStats._fields_}


def sample(logits, temperature=0.0, top_k=0, top_p=1.0, seed=0, state=None):
    """Samples one token id from logits (n_vocab,) as the engine does.
    ``state`` (a one-element uint64 array) carries the generator between
    calls; without it, a fresh state seeded with ``seed`` is used."""
    x = np.ascontiguousarray(logits, np.float32).reshape(-1)
    sp = _sampling(temperature, top_k, top_p, seed)
    st = ctypes.c_uint64(int(seed) if state is None else int(state[0]))
    tok = _i32()
    _lib.check(kvc_sample(x.ctypes.data, x.size, ctypes.byref(sp), ctypes.byref(st),
                          ctypes.byref(tok)))
    if state is not None:
        state[0] = st.value
    return tok.value
