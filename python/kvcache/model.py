"""Model runtime: a llama- or qwen2-architecture GGUF model served through
kvcache's paged cache (C: include/kvcache/model.h; loading refuses keys and
tensors the runtime does not implement, naming them).

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
import operator
import os
import threading

import numpy as np

from . import _lib
from .cache import PagedKVCache
from .errors import InvalidArgumentError

__all__ = ["Engine", "GenerateOutput", "Model", "sample"]

_c_int = ctypes.c_int
_vp = ctypes.c_void_p
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64


class ModelParams(ctypes.Structure):
    _fields_ = [("progress", _vp), ("progress_user", _vp), ("prefault", _i32), ("n_ctx", _i32),
                ("use_mmap", _i32)]


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
        ("rope_neox", _i32), ("rope_scale", ctypes.c_float), ("rope_freq_factors", _i32),
        ("biases", _i32),
        ("n_ctx", _i32),
    ]


class SamplingParams(ctypes.Structure):
    _fields_ = [("temperature", ctypes.c_float), ("top_k", _i32), ("top_p", ctypes.c_float),
                ("seed", ctypes.c_uint64)]


class EngineParams(ctypes.Structure):
    _fields_ = [
        ("n_threads", _i32), ("kv_dtype", _c_int), ("quant_group", _i32), ("page_size", _i32),
        ("kv_capacity_tokens", _i64), ("max_step_tokens", _i32), ("max_running", _i32),
        ("enable_prefix_caching", _i32), ("kv_format", _c_int),
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
        ("external_tokens", _i64),       # prompt tokens restored from a KV store
        ("external_miss_tokens", _i64),  # prompt tokens probed there and not restored
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
kvc_engine_cache = _p("kvc_engine_cache", _vp, _vp)

# "int8"/"int4" are the per-token caches (SEMANTICS section 1); "kivi8"/"kivi4"
# the compressed formats of docs/KV_FORMATS.md (kv format codes 1, 2).
_KV_DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, "int4": 4}
_KV_FORMATS = {"kivi8": 1, "kivi4": 2}
_CODE_KEYS = {_lib.KVC_F32: "float32", _lib.KVC_F16: "float16", _lib.KVC_BF16: "bfloat16",
              _lib.KVC_I8: "int8", _lib.KVC_I4: "int4"}


def _kv_dtype(name) -> tuple[str, int]:
    """(name, kvc_dtype code) of a per-token cache dtype, by any name of
    _lib.DTYPE_ALIASES ("float16"/"half"/"f16", "float32"/"float", ...)."""
    code = _lib.dtype_alias(name, "kv_dtype")
    if code not in _CODE_KEYS:
        raise InvalidArgumentError(
            f"kv_dtype {name!r}: expected one of {', '.join(_KV_DTYPES)}")
    return _CODE_KEYS[code], code


def _kv_storage(name) -> tuple[str, int, int]:
    """(name, kvc_dtype code, kvc_kv_format code) of a kv_dtype that may also
    name a compressed format (then the dtype code is float16's, unused)."""
    fmt = name.strip().lower() if isinstance(name, str) else None
    if fmt in _KV_FORMATS:
        return fmt, _lib.KVC_F16, _KV_FORMATS[fmt]
    try:
        key, code = _kv_dtype(name)
    except InvalidArgumentError:
        raise InvalidArgumentError(
            f"kv_dtype {name!r}: expected one of {', '.join([*_KV_DTYPES, *_KV_FORMATS])}"
        ) from None
    return key, code, 0


def _threads(num_threads) -> int:
    if num_threads is None:
        return _lib.cpu_count()  # the affinity mask, as the C default
    n = _lib.int32_attr(num_threads, "num_threads")
    if n < 1:
        raise InvalidArgumentError(f"num_threads {num_threads} must be >= 1")
    return n


def _index(x, name: str) -> int:
    """An integer argument (ints and numpy integers; not floats or bools)."""
    if isinstance(x, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name} must be an integer, got {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an integer, got {x!r}") from None


def _real(x, name: str) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a number, got {x!r}") from None


def _sampling(temperature, top_k, top_p, seed) -> SamplingParams:
    sp = SamplingParams()
    sp.temperature = _real(temperature, "temperature")
    sp.top_k = _lib.int32_attr(top_k, "top_k")
    sp.top_p = _real(top_p, "top_p")
    s = _index(seed, "seed")
    if not 0 <= s < 2**64:  # a uint64 in C: no silent wrap of -1 or 2**64
        raise InvalidArgumentError(f"seed must be in [0, 2**64), got {s}")
    sp.seed = s
    return sp


class Model(_lib.NoCopy):
    """A GGUF model (llama or qwen2 architecture), mapped read-only (use_mmap).

    Attributes: ``info`` (dict of kvc_model_info: the architecture's sizes,
    rope variant and scaling, bias bits), ``n_vocab``, ``n_ctx``.
    n_ctx: the context limit in tokens for eval, forward, generate and
    engine requests; None (default) is the model's trained context
    (``info["n_ctx_train"]``), past which RoPE positions were never trained.
    Longer sequences raise InvalidArgumentError naming the limit.
    use_mmap: True (default) uses the weights in place from the mapped file;
    False reads the file into memory of the model's own, on transparent huge
    pages where Linux gives them (llama.cpp's --no-mmap; faster decode, memory
    not shared with other processes).
    Threads: any number may call eval/forward/generate and use Engines and
    the tokenizer of one model at once; close() waits for the calls running
    in other threads, and later calls raise.
    """

    def __init__(self, path, *, n_ctx=None, use_mmap=True):
        self._ptr = None
        self._life = _lib.Lifetime("the model")
        p = kvc_model_default_params()
        if not isinstance(use_mmap, bool):
            raise InvalidArgumentError(f"use_mmap must be True or False, got {use_mmap!r}")
        p.use_mmap = int(use_mmap)
        if n_ctx is not None:
            p.n_ctx = _lib.int32_attr(n_ctx, "n_ctx")
            if p.n_ctx < 1:
                raise InvalidArgumentError(f"n_ctx must be >= 1 (None: the model's own), got "
                                           f"{n_ctx}")
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
        self.n_ctx = info.n_ctx
        self.path = os.fspath(path)  # the GGUF file: KV store namespaces digest it
        self._store_ns: dict = {}  # (cache params, salt) -> KV store namespace

    def close(self):
        """Frees the model once the calls running in other threads are done
        (engines and the borrowed tokenizer then raise). Idempotent."""
        if not self._life.close():
            return
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
        """The C kvc_tokenizer pointer owned by the model (for C callers; from
        Python use ``tokenizer``)."""
        with self._life.use():
            return kvc_model_tokenizer(self._ptr)

    @property
    def tokenizer(self):
        """The model's tokenizer as a kvcache.Tokenizer that borrows it: it
        keeps this model alive, raises once the model is closed, and its
        close() frees nothing."""
        from .tokenizer import Tokenizer

        return Tokenizer._borrowed(self.tokenizer_handle, self)

    def eval(self, tokens, kv_dtype="float32", num_threads=None, decode_from=None) -> np.ndarray:
        """Logits (n, n_vocab) float32 of every position of one token
        sequence, computed in one step through a fresh cache: one prefill, or
        with decode_from=p, prefill for positions < p and the decode kernel
        for the rest (as the engine computes generated tokens). At most
        ``n_ctx`` tokens (InvalidArgumentError past it)."""
        t = _lib.int32_array(tokens, "tokens")  # refuses non-integers and out-of-range ids
        if t.ndim != 1:
            raise InvalidArgumentError("tokens must be 1-D")
        out = np.empty((t.size, self.n_vocab), np.float32)
        _, code = _kv_dtype(kv_dtype)
        df = -1 if decode_from is None else _index(decode_from, "decode_from")
        if not -(2**63) <= df < 2**63:  # an int64 in C: no silent wrap
            raise InvalidArgumentError(f"decode_from = {df} does not fit in int64")
        nt = _threads(num_threads)
        with self._life.use():
            _lib.check(kvc_model_eval(self._ptr, t.ctypes.data, t.size, df, code,
                                      out.ctypes.data, nt))
        return out

    def new_cache(self, capacity_tokens, kv_dtype="float16", page_size=16,
                  enable_prefix_caching=True, quant_group=8) -> PagedKVCache:
        """A PagedKVCache shaped for this model (layers, KV heads, head dim);
        kv_dtype may name a compressed format ("kivi8", "kivi4")."""
        key, _, fmt = _kv_storage(kv_dtype)
        cap, ps = _index(capacity_tokens, "capacity_tokens"), _index(page_size, "page_size")
        if cap < 1 or ps < 1:
            raise InvalidArgumentError(f"capacity_tokens ({cap}) and page_size ({ps}) must be "
                                       f">= 1")
        pages = -(-cap // ps)
        if fmt:
            return PagedKVCache(self.info["n_layer"], self.info["n_head_kv"],
                                self.info["head_dim"], page_size, pages, kv_format=key,
                                enable_prefix_caching=enable_prefix_caching)
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
        if not isinstance(cache, PagedKVCache):
            raise InvalidArgumentError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        seqs = _lib.int64_array(seqs, "seqs").reshape(-1)
        pos0 = _lib.int64_array(pos0, "pos0").reshape(-1)
        n = _lib.int64_array(n, "n").reshape(-1)
        tokens = _lib.int32_array(tokens, "tokens").reshape(-1)
        if not (seqs.size == pos0.size == n.size):
            raise InvalidArgumentError("seqs, pos0 and n must have the same length")
        if tokens.size != int(n.sum()):
            raise InvalidArgumentError(f"tokens has {tokens.size} entries, n sums to {n.sum()}")
        if want_logits is None:
            n_want = int((n > 0).sum())
            want_ptr = None
        else:
            w = _lib.as_array(want_logits, "want_logits").reshape(-1)
            if w.dtype.kind not in "biu":
                raise InvalidArgumentError(f"want_logits must hold bools or integers, got dtype "
                                           f"{w.dtype}")
            want = np.ascontiguousarray(w != 0, np.uint8)
            if want.size != tokens.size:
                raise InvalidArgumentError("want_logits must have one entry per token row")
            n_want = int((want != 0).sum())
            want_ptr = want.ctypes.data
        dec_ptr = None
        if decode_from is not None:
            dec = _lib.int64_array(decode_from, "decode_from").reshape(-1)
            if dec.size != seqs.size:
                raise InvalidArgumentError("decode_from must have one entry per sequence")
            dec_ptr = dec.ctypes.data
        out = np.empty((n_want, self.n_vocab), np.float32)
        nt = _threads(num_threads)
        # the model stays open, one forward at a time uses the contexts, and
        # the cache's own lock keeps its other users (append, free...) out
        with self._life.use(), self._lock, cache._lock:
            ctx = self._ctx.get(nt)
            if ctx is None:
                h = _vp()
                _lib.check(kvc_model_ctx_create(self._ptr, nt, ctypes.byref(h)))
                ctx = self._ctx[nt] = h.value
            handle = cache._handle
            if handle is None:
                raise InvalidArgumentError("the cache is closed")
            _lib.check(kvc_model_forward(ctx, handle.ptr, seqs.size, seqs.ctypes.data,
                                         pos0.ctypes.data, n.ctypes.data, dec_ptr,
                                         tokens.ctypes.data, want_ptr, out.ctypes.data))
        return out

    def store_namespace(self, cache_params, salt=None) -> bytes:
        """The KV store namespace (16 bytes) of this model served through a
        cache with ``cache_params`` (a ctypes CacheParams, a PagedKVCache or
        a dict as :func:`kvcache.store_namespace` takes), for a salt (bytes,
        str or None): kvc_store_model_namespace over the GGUF file this
        model was loaded from. The file's digests are computed once per
        (cache params, salt) and remembered."""
        from . import store as _store

        if not isinstance(cache_params, _lib.CacheParams):
            cache_params = _store._cache_params(cache_params)
        s = _store._salt_bytes(salt)
        cp = cache_params
        key = (cp.page_size, cp.dtype, cp.scale_dtype, cp.quant_group, cp.layout, cp.kv_format, s)
        ns = self._store_ns.get(key)
        if ns is None:
            sl = _store._load()
            out = _store.Key()
            with self._life.use():
                _lib.check(sl.kvc_store_model_namespace(os.fsencode(self.path), self._ptr,
                                                        ctypes.byref(cp), s or None, len(s),
                                                        ctypes.byref(out)))
            ns = self._store_ns[key] = bytes(out.b)
        return ns

    def generate(self, prompts, max_new_tokens=32, *, kv_dtype="float16", num_threads=None,
                 temperature=0.0, top_k=0, top_p=1.0, seed=0, ignore_eos=False,
                 return_text=False, skip_special_tokens=True, kv_store=None, salt=None,
                 **engine_kw):
        """Generates for each prompt (list of token-id lists) through one
        continuous-batching engine.

        Returns the generated token lists; as transformers' generate, a
        request that stopped at an end-of-generation token (eos,
        <|im_end|>, ...) ends with it. return_text=True returns the decoded
        text instead (invalid UTF-8 replaced), with control tokens such as
        that <|im_end|> left out unless skip_special_tokens=False; the same
        as ``tokenizer.decode(ids, skip_special_tokens=True)``.
        prompt + max_new_tokens must fit the context limit (``n_ctx``).

        kv_store: a :class:`kvcache.KVStore` the engine restores prompt
        pages from and saves them to (its write policy), under the namespace
        of this model, the cache format and ``salt`` (bytes or str: the
        tenant; choose it on the server, never from a client's value).
        Writes are queued: ``kv_store.flush()`` waits for them.

        The result is a :class:`GenerateOutput`, a list with ``stats`` (the
        engine's counters) and ``external_tokens`` (prompt tokens restored
        from the store) attached."""
        eng = Engine(self, kv_dtype=kv_dtype, num_threads=num_threads, kv_store=kv_store,
                     salt=salt, **engine_kw)
        try:
            ids = [eng.add_request(p, max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed, ignore_eos=ignore_eos)
                   for p in prompts]
            out = eng.run()
            res = [out[i] for i in ids]
            stats = eng.stats()
        finally:
            eng.close()
        if return_text:
            tok = self.tokenizer
            res = [tok.decode(r, skip_special_tokens=skip_special_tokens) for r in res]
        return GenerateOutput(res, stats)


class GenerateOutput(list):
    """What :meth:`Model.generate` returns: the list of outputs (token lists
    or texts; it compares equal to a plain list) with the engine's counters
    attached: ``stats`` (:meth:`Engine.stats`), ``external_tokens`` (prompt
    tokens restored from a KV store), ``cached_tokens`` (prompt tokens
    served from the engine's own prefix cache)."""

    def __init__(self, items, stats: dict):
        super().__init__(items)
        self.stats = stats

    @property
    def external_tokens(self) -> int:
        return int(self.stats.get("external_tokens", 0))

    @property
    def cached_tokens(self) -> int:
        return int(self.stats.get("cached_tokens", 0))


class Engine(_lib.NoCopy):
    """Continuous batching over one model (C: kvc_engine). Its methods are
    serialized (one C engine, one thread at a time); engines of one model
    run in parallel.

    kv_store: a :class:`kvcache.KVStore` to attach (kvc_store_attach_engine):
    at admission the engine restores the prompt's pages the store holds
    (after its own prefix cache) and saves pages by the store's write
    policy, under the namespace of the model's GGUF file, this engine's
    cache format and ``salt`` (bytes or str; the tenant, chosen by the
    server). Needs enable_prefix_caching. ``stats()["external_tokens"]``
    counts the prompt tokens restored. The engine keeps the store alive;
    closing the store detaches it."""

    def __init__(self, model: Model, *, kv_dtype="float16", num_threads=None, page_size=16,
                 kv_capacity_tokens=16384, max_step_tokens=512, max_running=64,
                 enable_prefix_caching=True, quant_group=8, kv_store=None, salt=None):
        self._ptr = None
        self._store = None
        self.store_namespace = None
        if not isinstance(model, Model):
            raise InvalidArgumentError(f"model must be a kvcache.model.Model, got "
                                       f"{type(model).__name__}")
        self._model = model  # its methods check the model is still open
        p = kvc_engine_default_params()
        p.n_threads = _threads(num_threads)
        _, p.kv_dtype, p.kv_format = _kv_storage(kv_dtype)
        p.quant_group = _lib.int32_attr(quant_group, "quant_group")
        p.page_size = _lib.int32_attr(page_size, "page_size")
        cap = _index(kv_capacity_tokens, "kv_capacity_tokens")
        if not -(2**63) <= cap < 2**63:
            raise InvalidArgumentError(f"kv_capacity_tokens = {cap} does not fit in int64")
        p.kv_capacity_tokens = cap
        p.max_step_tokens = _lib.int32_attr(max_step_tokens, "max_step_tokens")
        p.max_running = _lib.int32_attr(max_running, "max_running")
        p.enable_prefix_caching = 1 if enable_prefix_caching else 0
        h = _vp()
        with model._life.use():  # the engine reads the model's sizes
            _lib.check(kvc_engine_create(model._ptr, ctypes.byref(p), ctypes.byref(h)))
        self._ptr = h.value
        self._max_running = p.max_running
        self._out: dict[int, list[int]] = {}
        self.finish_reason: dict[int, int] = {}
        if kv_store is not None:
            try:
                self._attach_store(kv_store, salt)
            except BaseException:
                self.close()
                raise
        elif salt is not None:
            raise InvalidArgumentError("salt is the KV store's tenant: it needs kv_store=")

    def _attach_store(self, kv_store, salt) -> None:
        """kvc_store_attach_engine under the namespace of the model, this
        engine's cache format and salt."""
        from .store import KVStore

        if not isinstance(kv_store, KVStore):
            raise InvalidArgumentError(f"kv_store must be a kvcache.KVStore, got "
                                       f"{type(kv_store).__name__}")
        cp = _lib.CacheParams()
        _lib.check(_lib.kvc_cache_get_params(kvc_engine_cache(self._ptr), ctypes.byref(cp)))
        ns = self._model.store_namespace(cp, salt)
        kv_store._attach(self, self._ptr, ns)
        self._store = kv_store  # the store must outlive the engine's use of it
        self.store_namespace = ns

    @_lib.locked
    def _detach_store(self, store) -> None:
        """Called by KVStore.close (its pointer still set): the engine stops
        using the store, which reports the engine cache's pages removed."""
        if self._ptr and self._store is store:
            _lib.check(store._lib.kvc_store_detach_engine(store._ptr, self._ptr))
        self._store = None

    @property
    def kv_store(self):
        """The attached :class:`kvcache.KVStore`, or None."""
        return self._store

    @_lib.locked
    def close(self):
        """Frees the engine, detaching it from its KVStore first (the store's
        events then report its cache's pages removed)."""
        if self._ptr:
            if self._store is not None:
                self._store._detach(self, self._ptr)
            kvc_engine_destroy(self._ptr)
            self._ptr = None
        self._store = None

    def __del__(self):
        try:
            if self._ptr:  # nobody else holds it: no lock needed
                kvc_engine_destroy(self._ptr)
                self._ptr = None
        except Exception:
            pass

    def _live(self) -> int:
        """The engine pointer; raises once the engine or its model is closed."""
        if not self._ptr:
            raise InvalidArgumentError("the engine is closed")
        self._model._live()  # the weights it reads must still be mapped
        return self._ptr

    @_lib.locked
    def add_request(self, prompt, max_new_tokens, *, temperature=0.0, top_k=0, top_p=1.0,
                    seed=0, ignore_eos=False) -> int:
        t = _lib.int32_array(prompt, "prompt").reshape(-1)
        n_new = _lib.int32_attr(max_new_tokens, "max_new_tokens")
        sp = _sampling(temperature, top_k, top_p, seed)
        rid = _i64()
        _lib.check(kvc_engine_add_request(self._live(), t.ctypes.data, t.size, n_new,
                                          ctypes.byref(sp), 1 if ignore_eos else 0,
                                          ctypes.byref(rid)))
        self._out[rid.value] = []
        return rid.value

    @_lib.locked
    def cancel(self, request_id):
        rid = _index(request_id, "request_id")
        if not -(2**63) <= rid < 2**63:
            raise InvalidArgumentError(f"no pending request {rid}")
        _lib.check(kvc_engine_cancel(self._live(), rid))

    @property
    @_lib.locked
    def pending(self) -> int:
        return kvc_engine_pending(self._live())

    @_lib.locked
    def step(self) -> list[tuple[int, int, int]]:
        """One scheduling step; returns (request_id, token, finish) events."""
        cap = max(1, min(self.pending, self._max_running))
        ev = (EngineEvent * cap)()
        n = _i64()
        with self._model._life.use():  # the step reads the model's weights
            _lib.check(kvc_engine_step(self._live(), ev, cap, ctypes.byref(n)))
        out = []
        for i in range(n.value):
            e = ev[i]
            self._out.setdefault(e.request_id, []).append(e.token)
            if e.finish:
                self.finish_reason[e.request_id] = e.finish
            out.append((e.request_id, e.token, e.finish))
        return out

    @_lib.locked
    def run(self) -> dict[int, list[int]]:
        """Steps until no request is pending; returns every request's tokens."""
        while self.pending > 0:
            self.step()
        return dict(self._out)

    @_lib.locked
    def stats(self) -> dict:
        """Counters of kvc_engine_stats: steps, prompt_tokens, cached_tokens
        (from the prefix cache), prefill_tokens, decode_tokens, preemptions,
        timings, KV sizes, external_tokens (prompt tokens restored from the
        KV store) and external_miss_tokens (probed there, not restored)."""
        s = EngineStats()
        _lib.check(kvc_engine_get_stats(self._live(), ctypes.byref(s)))
        return {f: getattr(s, f) for f, _ in EngineStats._fields_}


def sample(logits, temperature=0.0, top_k=0, top_p=1.0, seed=0, state=None):
    """Samples one token id from logits (n_vocab,) as the engine does.
    ``state`` (a one-element uint64 array) carries the generator between
    calls; without it, a fresh state seeded with ``seed`` is used."""
    x = _lib.as_array(logits, "logits")
    if x.ndim != 1 or x.dtype.kind not in "fiu":
        raise InvalidArgumentError(f"logits must be a 1-D array of numbers (n_vocab,), got shape "
                                   f"{x.shape} dtype {x.dtype}")
    x = np.ascontiguousarray(x, np.float32)
    sp = _sampling(temperature, top_k, top_p, seed)
    if state is not None and not (isinstance(state, np.ndarray) and state.dtype == np.uint64
                                  and state.shape == (1,) and state.flags.writeable):
        raise InvalidArgumentError("state must be a writeable numpy uint64 array of shape (1,)")
    st = ctypes.c_uint64(sp.seed if state is None else int(state[0]))
    tok = _i32()
    _lib.check(kvc_sample(x.ctypes.data, x.size, ctypes.byref(sp), ctypes.byref(st),
                          ctypes.byref(tok)))
    if state is not None:
        state[0] = st.value
    return tok.value
