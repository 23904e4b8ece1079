"""KV store: pages of a cache that outlive the process (C: include/kvcache/store.h,
library ``libkvcache_store``; docs/KV_STORE.md is the contract).

A full page of K/V is kept as one object (every layer) under a 128-bit key
chained from a namespace digest (model, tokenizer, geometry, KV format, salt)
over the page's token ids, in tiers looked up in order: ``"dir:PATH"`` (one
file per page) and ``"redis://[[USER]:PASSWORD@]HOST:PORT[/DB]"`` /
``"unix:///PATH"`` (Redis or Valkey). Any process of any build on any machine computes the same keys, so
independent processes share pages::

    with kvcache.KVStore(["dir:/var/cache/kv", "unix:///run/redis.sock"]) as st:
        out = model.generate([prompt], 32, kv_store=st, salt=b"tenant-7")
        out.external_tokens       # prompt tokens restored from the store
        st.flush()                # wait for the queued writes

:class:`KVStore` wraps a ``kvc_store``; :meth:`kvcache.Model.generate` and
:class:`kvcache.Engine` take ``kv_store=`` (and ``salt=``) to attach it;
:class:`kvcache.PagedKVCache` saves and restores a sequence's pages
(``save_to_store`` / ``restore_from_store``). The free functions
(:func:`store_namespace`, :func:`store_page_keys`, :func:`store_serialize_page`,
:func:`store_verify_object`, ...) expose the format itself, for other engines.

128-bit values (namespaces, keys) are 16-byte ``bytes`` (XXH3-128 in
canonical big-endian form); functions also accept them as 32 hex digits.

Library lookup (only when the store is first used, so ``import kvcache``
works on builds without it): the environment variable
``KVCACHE_STORE_LIBRARY`` (a path; no fallback when set), else
``libkvcache_store.so`` next to the loaded libkvcache, else the system
(``ctypes.util.find_library("kvcache_store")``). It is checked to use the
same libkvcache as the binding (its errors then reach ``kvc_last_error``).
Without it, store calls raise :class:`StoreUnavailableError` (an
:class:`~kvcache.UnsupportedError` and an ``ImportError``).

Security (docs/KV_STORE.md section 6): without ``auth_key``, anyone who can
write to a tier can make this process serve K/V of their choosing; choose
salts on the server, never from a client's value.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import sys
import threading
import traceback
import weakref

import numpy as np

from . import _lib
from .cache import _int  # an int64 argument, range-checked (ctypes would wrap it)
from .errors import (
    CorruptError,
    InvalidArgumentError,
    KvcacheIOError,
    NoSpaceError,
    UnsupportedError,
)

__all__ = [
    "KVStore",
    "StoreMissError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "MISS_REASONS",
    "store_available",
    "store_namespace",
    "store_gguf_digests",
    "store_model_namespace",
    "store_page_keys",
    "store_object_bytes",
    "store_serialize_page",
    "store_verify_object",
    "store_restore_page",
]

_ENV_VAR = "KVCACHE_STORE_LIBRARY"

# kvc_store_miss, in the enum's order (docs/KV_STORE.md section 4); checked
# against kvc_store_miss_name when the library loads.
MISS_REASONS = ("absent", "truncated", "magic", "version", "header", "geometry", "payload",
                "auth", "namespace", "key", "tokens")
_MISS_COUNT = len(MISS_REASONS)
AUTH_KEY_BYTES = 32
TIER_CACHE = -1  # KVC_STORE_TIER_CACHE: the cache of an attached engine
_EVENT_KINDS = ("stored", "removed", "cleared")
_POLICIES = {"through": 0, "back": 1}


class StoreUnavailableError(UnsupportedError, ImportError):
    """libkvcache_store could not be found or loaded (this build has no KV
    store: it needs libxxhash, Debian libxxhash-dev, which scripts/setup.sh
    installs)."""


class StoreMissError(CorruptError):
    """An object was refused (KVC_ERR_CORRUPT). ``miss`` is the reason's name
    (one of :data:`MISS_REASONS`: "truncated", "magic", ..., "tokens") and
    ``miss_code`` its kvc_store_miss value."""

    def __init__(self, message: str, status: int | None = None, miss: str = "",
                 miss_code: int = -1):
        super().__init__(message, status)
        self.miss = miss
        self.miss_code = miss_code


class StoreTimeoutError(KvcacheIOError, TimeoutError):
    """:meth:`KVStore.flush` ran out of time before the queued writes were
    written (KVC_ERR_IO)."""


# ---------------------------------------------------------------------------
# C types


class Key(ctypes.Structure):
    """ctypes mirror of ``kvc_store_key``."""

    _fields_ = [("b", ctypes.c_uint8 * 16)]


class NamespaceDesc(ctypes.Structure):
    """ctypes mirror of ``kvc_store_namespace_desc``."""

    _fields_ = [
        ("model_digest", Key),
        ("tokenizer_digest", Key),
        ("n_layers", ctypes.c_int32),
        ("n_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("n_rot", ctypes.c_int32),
        ("rope_neox", ctypes.c_int32),
        ("rope_freq_factors", ctypes.c_int32),
        ("rope_freq_base", ctypes.c_float),
        ("rope_scale", ctypes.c_float),
        ("cache", _lib.CacheParams),
        ("salt", ctypes.c_void_p),
        ("salt_len", ctypes.c_size_t),
    ]


class Expect(ctypes.Structure):
    """ctypes mirror of ``kvc_store_expect``."""

    _fields_ = [
        ("ns", Key),
        ("key", Key),
        ("parent", Key),
        ("position", ctypes.c_int64),
        ("tokens", ctypes.POINTER(ctypes.c_int32)),
    ]


class StoreParams(ctypes.Structure):
    """ctypes mirror of ``kvc_store_params``."""

    _fields_ = [
        ("queue_objects", ctypes.c_int32),
        ("queue_bytes", ctypes.c_int64),
        ("auth_key", ctypes.c_void_p),
        ("load_timeout_s", ctypes.c_double),
        ("write_policy", ctypes.c_int),
        ("selective_hits", ctypes.c_int32),
        ("writer_nice", ctypes.c_int32),
        ("promote", ctypes.c_int32),
        ("object_pool_bytes", ctypes.c_int64),
        ("redis_user", ctypes.c_char_p),
        ("redis_password", ctypes.c_char_p),
    ]


class StoreStats(ctypes.Structure):
    """ctypes mirror of ``kvc_store_stats``."""

    _fields_ = [
        ("hit_pages", ctypes.c_int64),
        ("miss_pages", ctypes.c_int64),
        ("verify_failures", ctypes.c_int64),
        ("misses", ctypes.c_int64 * _MISS_COUNT),
        ("errors", ctypes.c_int64),
        ("bytes_read", ctypes.c_int64),
        ("bytes_written", ctypes.c_int64),
        ("writes_queued", ctypes.c_int64),
        ("writes_done", ctypes.c_int64),
        ("writes_dropped", ctypes.c_int64),
        ("writes_failed", ctypes.c_int64),
        ("timeouts", ctypes.c_int64),
    ]


class StoreEvent(ctypes.Structure):
    """ctypes mirror of ``kvc_store_event``."""

    _fields_ = [
        ("kind", ctypes.c_int),
        ("tier", ctypes.c_int32),
        ("ns", Key),
        ("key", Key),
        ("parent", Key),
        ("tokens", ctypes.POINTER(ctypes.c_int32)),
        ("n_tokens", ctypes.c_int32),
    ]


EVENT_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(StoreEvent))

# ---------------------------------------------------------------------------
# Loading (lazy)

_vp = ctypes.c_void_p
_c_int = ctypes.c_int
_KP = ctypes.POINTER(Key)
_EP = ctypes.POINTER(Expect)
_i32p = ctypes.POINTER(ctypes.c_int32)
_i64p = ctypes.POINTER(ctypes.c_int64)

_PROTOS = {
    "kvc_store_namespace": (_c_int, ctypes.POINTER(NamespaceDesc), _KP),
    "kvc_store_gguf_digests": (_c_int, ctypes.c_char_p, _KP, _KP),
    "kvc_store_model_namespace": (_c_int, ctypes.c_char_p, _vp, ctypes.POINTER(_lib.CacheParams),
                                  _vp, ctypes.c_size_t, _KP),
    "kvc_store_page_keys": (_c_int, _KP, _i32p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                            _KP),
    "kvc_store_miss_name": (ctypes.c_char_p, _c_int),
    "kvc_store_object_bytes": (ctypes.c_size_t, _vp, _c_int),
    "kvc_store_serialize_page": (_c_int, _vp, ctypes.c_int32, _EP, _vp, _vp, ctypes.c_size_t,
                                 ctypes.POINTER(ctypes.c_size_t)),
    "kvc_store_verify_object": (_c_int, _vp, _vp, ctypes.c_size_t, _EP, _vp,
                                ctypes.POINTER(_c_int)),
    "kvc_store_restore_page": (_c_int, _vp, ctypes.c_int32, _vp, ctypes.c_size_t, _EP, _vp,
                               ctypes.POINTER(_c_int)),
    "kvc_store_default_params": (StoreParams,),
    "kvc_store_open": (_c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int32,
                       ctypes.POINTER(StoreParams), ctypes.POINTER(_vp)),
    "kvc_store_close": (None, _vp),
    "kvc_store_flush": (_c_int, _vp, ctypes.c_double),
    "kvc_store_invalidate": (_c_int, _vp, _KP),
    "kvc_store_put": (_c_int, _vp, _KP, _KP, _vp, ctypes.c_size_t),
    "kvc_store_restore_run": (_c_int, _vp, _vp, _KP, _i32p, ctypes.c_int64, ctypes.c_int64,
                              _i32p, _i64p),
    "kvc_store_save_run": (_c_int, _vp, _vp, _KP, _i32p, ctypes.c_int64, ctypes.c_int64, _i32p),
    "kvc_store_get_stats": (_c_int, _vp, ctypes.POINTER(StoreStats)),
    "kvc_store_last_tier_error": (_c_int, _vp, ctypes.c_char_p, ctypes.c_size_t),
    "kvc_store_set_event_callback": (_c_int, _vp, EVENT_FN, _vp),
    "kvc_store_attach_engine": (_c_int, _vp, _vp, _KP),
    "kvc_store_detach_engine": (_c_int, _vp, _vp),
}


class _StoreLib:
    """The loaded libkvcache_store: its path and one attribute per C function."""

    def __init__(self, handle: ctypes.CDLL, path: str):
        self.handle = handle
        self.path = path
        for name, (restype, *argtypes) in _PROTOS.items():
            try:
                fn = getattr(handle, name)
            except AttributeError as exc:
                raise StoreUnavailableError(f"kvcache: {path} has no {name}(); rebuild "
                                            f"libkvcache_store from this source tree") from exc
            fn.restype = restype
            fn.argtypes = list(argtypes)
            setattr(self, name, fn)


_store_lib: _StoreLib | None = None
_load_lock = threading.Lock()

_ABSENT_HINT = ("this build of kvcache has no KV store: libkvcache_store is built when "
                "libxxhash is found (Debian: libxxhash-dev; Redis needs libhiredis-dev, "
                "authentication libsodium-dev); scripts/setup.sh installs them, then rebuild "
                "(cmake --build build)")


def _store_file_names() -> list[str]:
    if sys.platform == "darwin":
        return ["libkvcache_store.dylib"]
    if sys.platform == "win32":
        return ["kvcache_store.dll", "libkvcache_store.dll"]
    return ["libkvcache_store.so"]


def _candidates() -> tuple[list[str], list[str]]:
    """(paths to try in order, what was tried, for the message)."""
    env = os.environ.get(_ENV_VAR)
    if env:
        return [env], [f"{_ENV_VAR}={env!r}"]
    paths, tried = [], []
    lib_dir = os.path.dirname(os.path.abspath(_lib.library_path)) if os.path.dirname(
        _lib.library_path) else ""
    if lib_dir:
        for name in _store_file_names():
            p = os.path.join(lib_dir, name)
            tried.append(p)
            if os.path.exists(p):
                paths.append(p)
    found = ctypes.util.find_library("kvcache_store")
    tried.append('ctypes.util.find_library("kvcache_store")')
    if found:
        paths.append(found)
    return paths, tried


def _check_same_core(sl: _StoreLib) -> None:
    """The store library must call the libkvcache this binding loaded: its
    errors are set through libkvcache's kvc__error and read back with the
    binding's kvc_last_error. A failing kvc_store_open (-1 tiers) must leave
    its message there."""
    _lib.kvc_clear_error()
    out = _vp()
    st = sl.kvc_store_open(None, -1, None, ctypes.byref(out))
    msg = _lib.kvc_last_error()
    msg = msg.decode("utf-8", "replace") if msg else ""
    _lib.kvc_clear_error()
    if out.value:  # cannot happen with -1 tiers; never leak one
        sl.kvc_store_close(out.value)
    if st == 0 or "kvc_store_open" not in msg:
        raise StoreUnavailableError(
            f"kvcache: {sl.path} does not report its errors through the loaded libkvcache "
            f"({_lib.library_path}): it is bound to another copy of libkvcache. Point "
            f"{_ENV_VAR} at the libkvcache_store built with {_lib.library_path}")


def _load() -> _StoreLib:
    """Loads libkvcache_store once (thread-safe); raises StoreUnavailableError."""
    global _store_lib
    if _store_lib is not None:
        return _store_lib
    with _load_lock:
        if _store_lib is not None:
            return _store_lib
        paths, tried = _candidates()
        env = os.environ.get(_ENV_VAR)
        if env and not os.path.exists(env):
            raise StoreUnavailableError(f"kvcache: {_ENV_VAR}={env!r} does not exist; point it "
                                        f"at a built libkvcache_store or unset it")
        if not paths:
            raise StoreUnavailableError("kvcache: libkvcache_store not found (tried: " +
                                        ", ".join(tried) + f"): {_ABSENT_HINT}")
        errors = []
        for p in paths:
            try:
                # RTLD_GLOBAL: nothing loaded later binds to another copy of
                # the store's symbols. Its libkvcache dependency resolves by
                # soname to the libkvcache already loaded (checked below).
                handle = ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                errors.append(f"{p}: {exc}")
                if env:
                    break
                continue
            sl = _StoreLib(handle, p)
            names = tuple(sl.kvc_store_miss_name(i).decode() for i in range(_MISS_COUNT))
            if names != MISS_REASONS:
                raise StoreUnavailableError(f"kvcache: {p} names its miss reasons {names}, "
                                            f"this binding expects {MISS_REASONS}")
            _check_same_core(sl)
            _store_lib = sl
            return sl
        raise StoreUnavailableError("kvcache: cannot load libkvcache_store (" +
                                    "; ".join(errors) + f"): {_ABSENT_HINT}")


def store_available() -> bool:
    """Whether libkvcache_store can be loaded (loads it)."""
    try:
        _load()
    except StoreUnavailableError:
        return False
    return True


def library_path() -> str:
    """The path of the loaded libkvcache_store (loads it)."""
    return _load().path


# ---------------------------------------------------------------------------
# Argument conversion


def _key(x, name: str) -> Key:
    """A Key from 16 bytes (bytes-like) or 32 hex digits."""
    if isinstance(x, Key):
        return x
    if isinstance(x, str):
        try:
            raw = bytes.fromhex(x)
        except ValueError:
            raw = b""
        if len(raw) != 16:
            raise InvalidArgumentError(f"{name} must be 16 bytes or 32 hex digits, got {x!r}")
    elif isinstance(x, (bytes, bytearray, memoryview)):
        raw = bytes(x)
        if len(raw) != 16:
            raise InvalidArgumentError(f"{name} must be 16 bytes, got {len(raw)}")
    else:
        raise InvalidArgumentError(f"{name} must be 16 bytes or 32 hex digits, got "
                                   f"{type(x).__name__}")
    k = Key()
    ctypes.memmove(k.b, raw, 16)
    return k


def _kbytes(k: Key) -> bytes:
    return bytes(k.b)


def _salt_bytes(salt) -> bytes:
    if salt is None:
        return b""
    if isinstance(salt, str):
        return salt.encode("utf-8")
    if isinstance(salt, (bytes, bytearray, memoryview)):
        return bytes(salt)
    raise InvalidArgumentError(f"salt must be bytes, str or None, got {type(salt).__name__}")


def _auth(auth_key):
    """(bytes or None): a 32-byte authentication key."""
    if auth_key is None:
        return None
    if not isinstance(auth_key, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"auth_key must be {AUTH_KEY_BYTES} bytes or None, got "
                                   f"{type(auth_key).__name__}")
    b = bytes(auth_key)
    if len(b) != AUTH_KEY_BYTES:
        raise InvalidArgumentError(f"auth_key must be {AUTH_KEY_BYTES} bytes, got {len(b)}")
    return b


def _tokens(tokens, name: str = "tokens") -> np.ndarray:
    t = _lib.int32_array(tokens, name)
    if t.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-D token ids, got shape {t.shape}")
    return t


def _i32ptr(arr: np.ndarray):
    if arr.size == 0:
        return None
    return arr.ctypes.data_as(_i32p)


def _cache_of(cache):
    """The PagedKVCache argument (checked)."""
    from .cache import PagedKVCache

    if not isinstance(cache, PagedKVCache):
        raise InvalidArgumentError(f"cache must be a kvcache.PagedKVCache, got "
                                   f"{type(cache).__name__}")
    return cache


def _cache_params(cache) -> _lib.CacheParams:
    """kvc_cache_params of a PagedKVCache (kvc_cache_get_params), or of a dict
    with page_size and optionally dtype ("float16"; or "kivi8"/"kivi4"),
    scale_dtype ("float16"), quant_group (8), kv_layout ("NHD"), kv_format
    (None) and num_layers/num_kv_heads/head_dim."""
    from .cache import PagedKVCache, _dtype_code, _DTYPE_NAMES, _kv_format_code
    from .paged import _layout_code

    if isinstance(cache, PagedKVCache):
        p = _lib.CacheParams()
        with cache._lock:
            _lib.check(_lib.kvc_cache_get_params(cache._ptr(), ctypes.byref(p)))
        return p
    if not isinstance(cache, dict):
        raise InvalidArgumentError(f"cache must be a PagedKVCache or a dict of cache params, "
                                   f"got {type(cache).__name__}")
    known = {"page_size", "dtype", "scale_dtype", "quant_group", "kv_layout", "layout",
             "kv_format", "num_layers", "num_kv_heads", "head_dim", "num_pages"}
    extra = set(cache) - known
    if extra:
        raise InvalidArgumentError(f"unknown cache params {sorted(extra)} (known: "
                                   f"{sorted(known)})")
    if "page_size" not in cache:
        raise InvalidArgumentError("cache params need page_size")
    p = _lib.kvc_cache_default_params()
    p.page_size = _lib.int32_attr(cache["page_size"], "page_size")
    for f in ("num_layers", "num_kv_heads", "head_dim"):
        if f in cache:
            setattr(p, f, _lib.int32_attr(cache[f], f))
    if "num_pages" in cache:
        p.num_pages = _int(cache["num_pages"], "num_pages", -(2**63))
    dtype = cache.get("dtype", "float16")
    fmt = cache.get("kv_format")
    if isinstance(dtype, str) and dtype.strip().lower() in ("kivi8", "kivi4"):
        fmt, dtype = dtype, "float16"
    p.dtype = _dtype_code(dtype, "dtype", tuple(_DTYPE_NAMES))
    p.scale_dtype = _dtype_code(cache.get("scale_dtype", "float16"), "scale_dtype",
                                (_lib.KVC_F32, _lib.KVC_F16))
    p.quant_group = _lib.int32_attr(cache.get("quant_group", 8), "quant_group")
    p.layout = _layout_code(cache.get("kv_layout", cache.get("layout", "NHD")))
    p.kv_format = _kv_format_code(fmt)
    return p


def _expect(ns, key, parent, position, tokens, page_size: int):
    """(Expect, the token array it points into)."""
    t = _tokens(tokens)
    if t.size != page_size:
        raise InvalidArgumentError(f"tokens must hold one page: {page_size} ids, got {t.size}")
    e = Expect()
    e.ns = _key(ns, "ns")
    e.key = _key(key, "key")
    e.parent = _key(parent, "parent")
    e.position = int(position)
    e.tokens = t.ctypes.data_as(_i32p)
    return e, t


def _miss_error(miss: int):
    """The StoreMissError for a failed verify (the C message included)."""
    raw = _lib.kvc_last_error()
    msg = raw.decode("utf-8", "replace") if raw else ""
    name = MISS_REASONS[miss] if 0 <= miss < _MISS_COUNT else "?"
    return StoreMissError(msg or f"store object refused ({name})", -7, name, miss)


def _check_verify(status: int, miss: ctypes.c_int) -> None:
    if status == 0:
        return
    if status == -7 and 0 <= miss.value < _MISS_COUNT:
        raise _miss_error(miss.value)
    _lib.check(status)


# ---------------------------------------------------------------------------
# Namespace and keys


def store_namespace(desc: dict | None = None, **fields) -> bytes:
    """The namespace digest (kvc_store_namespace) of a description given as a
    dict and/or keyword arguments, the fields of ``kvc_store_namespace_desc``:

    - model_digest, tokenizer_digest: 16 bytes or 32 hex digits (e.g. from
      :func:`store_gguf_digests`);
    - n_layers, n_kv_heads, head_dim (required), n_rot (default head_dim),
      rope_neox, rope_freq_factors (bools, default 0), rope_freq_base
      (default 10000.0), rope_scale (default 1.0; float32 in C);
    - cache: a :class:`kvcache.PagedKVCache` or a dict of cache params
      (page_size, dtype, scale_dtype, quant_group, kv_layout, kv_format);
    - salt: bytes or str (UTF-8), default none.
    """
    d = dict(desc or {})
    d.update(fields)
    known = {"model_digest", "tokenizer_digest", "n_layers", "n_kv_heads", "head_dim", "n_rot",
             "rope_neox", "rope_freq_factors", "rope_freq_base", "rope_scale", "cache", "salt"}
    extra = set(d) - known
    if extra:
        raise InvalidArgumentError(f"unknown namespace fields {sorted(extra)}")
    missing = {"model_digest", "tokenizer_digest", "n_layers", "n_kv_heads", "head_dim",
               "cache"} - set(d)
    if missing:
        raise InvalidArgumentError(f"namespace description lacks {sorted(missing)}")
    sl = _load()
    nd = NamespaceDesc()
    nd.model_digest = _key(d["model_digest"], "model_digest")
    nd.tokenizer_digest = _key(d["tokenizer_digest"], "tokenizer_digest")
    nd.n_layers = _lib.int32_attr(d["n_layers"], "n_layers")
    nd.n_kv_heads = _lib.int32_attr(d["n_kv_heads"], "n_kv_heads")
    nd.head_dim = _lib.int32_attr(d["head_dim"], "head_dim")
    nd.n_rot = _lib.int32_attr(d.get("n_rot", nd.head_dim), "n_rot")
    nd.rope_neox = 1 if _lib.flag(d.get("rope_neox", False), "rope_neox") else 0
    nd.rope_freq_factors = 1 if _lib.flag(d.get("rope_freq_factors", False),
                                          "rope_freq_factors") else 0
    nd.rope_freq_base = float(d.get("rope_freq_base", 10000.0))
    nd.rope_scale = float(d.get("rope_scale", 1.0))
    nd.cache = _cache_params(d["cache"])
    salt = _salt_bytes(d.get("salt"))
    buf = ctypes.create_string_buffer(salt, len(salt)) if salt else None
    nd.salt = ctypes.cast(buf, _vp) if buf is not None else None
    nd.salt_len = len(salt)
    out = Key()
    _lib.check(sl.kvc_store_namespace(ctypes.byref(nd), ctypes.byref(out)))
    return _kbytes(out)


def store_gguf_digests(path) -> tuple[bytes, bytes]:
    """(model digest, tokenizer digest) of a GGUF file
    (kvc_store_gguf_digests; reads all its tensor data, ~0.1 s per GB)."""
    sl = _load()
    m, t = Key(), Key()
    _lib.check(sl.kvc_store_gguf_digests(os.fsencode(path), ctypes.byref(m), ctypes.byref(t)))
    return _kbytes(m), _kbytes(t)


def store_model_namespace(gguf_path, model, cache, salt=b"") -> bytes:
    """The namespace of ``model`` (a :class:`kvcache.Model` loaded from
    gguf_path) served through ``cache`` (a PagedKVCache, or a dict of cache
    params as :func:`store_namespace` takes), for a salt (bytes or str)
    (kvc_store_model_namespace)."""
    from .model import Model

    if not isinstance(model, Model):
        raise InvalidArgumentError(f"model must be a kvcache.Model, got {type(model).__name__}")
    sl = _load()
    cp = _cache_params(cache)
    s = _salt_bytes(salt)
    out = Key()
    with model._life.use():
        _lib.check(sl.kvc_store_model_namespace(os.fsencode(gguf_path), model._ptr,
                                                ctypes.byref(cp), s or None, len(s),
                                                ctypes.byref(out)))
    return _kbytes(out)


def store_page_keys(ns, tokens, page_size, unit_pages: int = 1) -> list[bytes]:
    """Keys of the whole units of tokens (units of ``unit_pages`` pages of
    ``page_size`` ids): key[i] = XXH3-128(key[i-1] || ids of page i), with
    key[-1] = ns; with unit_pages > 1 (compressed formats whose K groups span
    pages) a page's key covers the ids of its whole unit and its index in it
    (kvc_store_page_keys, docs/KV_STORE.md section 2). Trailing ids that do
    not fill a unit get no key."""
    sl = _load()
    k = _key(ns, "ns")
    t = _tokens(tokens)
    ps = _lib.int32_attr(page_size, "page_size")
    up = _lib.int32_attr(unit_pages, "unit_pages")
    if ps < 1 or up < 1:
        raise InvalidArgumentError(f"page_size ({ps}) and unit_pages ({up}) must be >= 1")
    n = t.size // (ps * up) * up
    keys = (Key * max(n, 1))()
    _lib.check(sl.kvc_store_page_keys(ctypes.byref(k), _i32ptr(t), n, ps, up, keys))
    return [_kbytes(keys[i]) for i in range(n)]


# ---------------------------------------------------------------------------
# Page objects


def store_object_bytes(cache, auth: bool = False) -> int:
    """Bytes of one page's object for cache (header, ids, payload, tag); the
    larger size, a first page's, for a format with sink rows (kivi4 carries
    position 0's in float16 with the sequence's first page)."""
    c = _cache_of(cache)
    sl = _load()
    with c._lock:
        return int(sl.kvc_store_object_bytes(c._ptr(), 1 if auth else 0))


def store_serialize_page(cache, page_id, ns, key, parent, position, tokens,
                         auth_key=None) -> bytes:
    """Page ``page_id`` of ``cache`` (every layer) as a store object
    (kvc_store_serialize_page): the page holds the K/V of ``tokens`` (one
    page of ids, the caller vouches for it) at ``position`` (page index *
    page_size), under ``key`` whose parent is ``parent`` (ns for page 0).
    auth_key: None or 32 bytes (adds the BLAKE2b tag)."""
    c = _cache_of(cache)
    sl = _load()
    a = _auth(auth_key)
    e, _t = _expect(ns, key, parent, position, tokens, c.page_size)
    pid = _lib.int32_attr(page_id, "page_id")
    with c._lock:
        ptr = c._ptr()
        cap = int(sl.kvc_store_object_bytes(ptr, 1 if a else 0))
        buf = ctypes.create_string_buffer(cap)
        size = ctypes.c_size_t(0)
        _lib.check(sl.kvc_store_serialize_page(ptr, pid, ctypes.byref(e), a, buf, cap,
                                               ctypes.byref(size)))
    return buf.raw[:size.value]


def store_verify_object(cache, obj, ns, key, parent, position, tokens, auth_key=None) -> None:
    """Checks a store object against what ``cache`` expects of the page
    (kvc_store_verify_object): returns None when it may be applied, else
    raises :class:`StoreMissError` whose ``miss`` names the first check that
    failed (docs/KV_STORE.md section 4)."""
    c = _cache_of(cache)
    sl = _load()
    a = _auth(auth_key)
    e, _t = _expect(ns, key, parent, position, tokens, c.page_size)
    data = bytes(obj)
    miss = ctypes.c_int(_MISS_COUNT)
    with c._lock:
        st = sl.kvc_store_verify_object(c._ptr(), data, len(data), ctypes.byref(e), a,
                                        ctypes.byref(miss))
    _check_verify(st, miss)


def store_restore_page(cache, page_id, obj, ns, key, parent, position, tokens,
                       auth_key=None) -> None:
    """Verifies ``obj`` as :func:`store_verify_object` does, then writes its
    K/V into page ``page_id`` of ``cache`` (kvc_store_restore_page; a page
    held by exactly one sequence). Nothing is written unless every check
    passes; a refusal raises :class:`StoreMissError`."""
    c = _cache_of(cache)
    sl = _load()
    a = _auth(auth_key)
    e, _t = _expect(ns, key, parent, position, tokens, c.page_size)
    pid = _lib.int32_attr(page_id, "page_id")
    data = bytes(obj)
    miss = ctypes.c_int(_MISS_COUNT)
    with c._lock:
        st = sl.kvc_store_restore_page(c._ptr(), pid, data, len(data), ctypes.byref(e), a,
                                       ctypes.byref(miss))
    _check_verify(st, miss)


# ---------------------------------------------------------------------------
# The store

_in_callback = threading.local()
_open_stores: "weakref.WeakSet[KVStore]" = weakref.WeakSet()


def _policy(write_policy) -> tuple[int, int | None]:
    if isinstance(write_policy, str):
        p = write_policy.strip().lower()
        if p in _POLICIES:
            return _POLICIES[p], None
        if p.startswith("selective:"):
            try:
                n = int(p[len("selective:"):])
            except ValueError:
                n = 0
            if n >= 1:
                return 2, n
    raise InvalidArgumentError(f"write_policy must be 'through', 'back' or 'selective:N' "
                               f"(N >= 1), got {write_policy!r}")


def _shown(url: str) -> str:
    """url less the credentials of its Redis servers (as the C tier's name)."""
    if not url.startswith(("redis://", "unix://")):
        return url
    head, q, rest = url.partition("?")
    out = []
    for srv in head.split(","):
        if srv.startswith("unix://"):
            r = srv[7:]
            at = -1 if r.startswith("/") else r.find("@/")
            out.append("unix://" + r[at + 1:])
        elif srv.startswith("redis://"):
            r = srv[8:]
            at = r.split("/", 1)[0].rfind("@")
            out.append("redis://" + r[at + 1:])
        else:
            out.append(srv)
    return ",".join(out) + q + rest


def _credential(v, name):
    """None, or v (str or bytes) as bytes for C: no NUL, which would cut it."""
    if v is None:
        return None
    if isinstance(v, str):
        v = v.encode("utf-8")
    if not isinstance(v, bytes):
        raise InvalidArgumentError(f"{name} must be str or bytes, not {type(v).__name__}")
    if b"\0" in v:
        raise InvalidArgumentError(f"{name} holds a NUL byte")
    return v


class KVStore(_lib.NoCopy):
    """A KV store (C: kvc_store): tiers looked up in the order of ``urls``,
    written by a background thread through a bounded queue.

    Args:
        urls: one URL or a list: ``"dir:PATH[?max_bytes=N]"``,
            ``"redis://[[USER]:PASSWORD@]HOST:PORT[/DB]"``,
            ``"unix://[[USER]:PASSWORD@]/PATH"`` (``?ttl=SECONDS&db=N``;
            credentials ``%XX``-encoded, never shown in messages; several
            Redis servers in one comma-separated URL share the keys);
            any of them may name its own write policy with ``write=`` (``"dir:/k?write=back"``,
            ``"dir:/k?max_bytes=1G&write=selective:2"``). An empty list opens
            a store of no tiers: it finds and writes nothing, and an attached
            engine reports its cache's pages to the event callback.
        queue_objects, queue_bytes: writes waiting at most (None: the C
            defaults, 4096 objects and 512 MiB); a full queue drops writes.
        auth_key: None or 32 secret bytes: objects carry a keyed BLAKE2b tag
            and objects without a valid one are refused.
        load_timeout_s: a restore gives up after this many seconds.
        write_policy: for attached engines, the tiers' whose URL names none:
            "through" (a page is saved when it becomes final), "back" (when
            the cache evicts it) or "selective:N" (once it served N prefix hits).
        writer_nice: added to the writer thread's nice value (Linux; None:
            the C default 19, the lowest priority; 0 keeps the caller's).
        promote: a page restored from a later tier is also written to the
            earlier ones (so a local directory keeps what Redis served).
        object_pool_bytes: object buffers kept for reuse (None: the C
            default, 64 MiB; 0: none); fresh ones cost the kernel's page
            faults as they are filled.
        redis_user, redis_password: AUTH credentials (str or bytes) for the
            Redis servers whose URL gives none, as with redis-py's
            ``from_url(url, password=...)``: a password kept out of URLs,
            which logs and process lists show. A URL's own credentials win.

    A Redis server that does not answer is not an error (retried with
    back-off); a bad URL or an unusable directory is (InvalidArgumentError,
    KvcacheIOError). Thread-safe; :meth:`close` waits for the calls running
    in other threads. Engines attached to the store (``kv_store=``) keep it
    alive; closing it detaches them first.
    """

    def __init__(self, urls, *, queue_objects=None, queue_bytes=None, auth_key=None,
                 load_timeout_s=2.0, write_policy="through", writer_nice=None,
                 promote=True, object_pool_bytes=None, redis_user=None, redis_password=None):
        self._ptr = None
        self._life = _lib.Lifetime("the KV store")
        self._callbacks = []  # every ctypes callback ever set: C may still be in one
        self._engines: "weakref.WeakSet" = weakref.WeakSet()
        self._elock = threading.Lock()
        sl = _load()
        if isinstance(urls, (str, bytes, os.PathLike)):
            urls = [urls]
        urls = [os.fsdecode(u) for u in urls]
        p = sl.kvc_store_default_params()
        if queue_objects is not None:
            p.queue_objects = _lib.int32_attr(queue_objects, "queue_objects")
        if queue_bytes is not None:
            p.queue_bytes = _int(queue_bytes, "queue_bytes", -(2**63))
        self._auth = _auth(auth_key)
        p.auth_key = ctypes.cast(ctypes.c_char_p(self._auth), _vp) if self._auth else None
        p.load_timeout_s = float(load_timeout_s)
        p.write_policy, hits = _policy(write_policy)
        if hits is not None:
            p.selective_hits = hits
        if writer_nice is not None:
            p.writer_nice = _lib.int32_attr(writer_nice, "writer_nice")
        p.promote = 1 if promote else 0
        if object_pool_bytes is not None:
            p.object_pool_bytes = _int(object_pool_bytes, "object_pool_bytes", -(2**63))
        creds = [_credential(redis_user, "redis_user"),
                 _credential(redis_password, "redis_password")]
        p.redis_user, p.redis_password = creds  # the C library copies them
        arr = (ctypes.c_char_p * max(len(urls), 1))(*[u.encode("utf-8") for u in urls])
        h = _vp()
        _lib.check(sl.kvc_store_open(arr, len(urls), ctypes.byref(p), ctypes.byref(h)))
        self._ptr = h.value
        self._lib = sl
        self.urls = urls
        self.write_policy = write_policy
        _open_stores.add(self)

    # -- lifetime -----------------------------------------------------------

    def _use(self):
        if getattr(_in_callback, "store", None) is not None:
            raise InvalidArgumentError("a KVStore event callback must not call the store")
        return self._life.use()

    def close(self) -> None:
        """Detaches the engines attached to the store, stops the writer and
        frees the store (queued writes not yet written are dropped: call
        :meth:`flush` first to keep them). Idempotent."""
        life = getattr(self, "_life", None)
        if life is None or not life.close():
            return
        for eng in list(self._engines):
            eng._detach_store(self)
        ptr, self._ptr = self._ptr, None
        if ptr:
            self._lib.kvc_store_close(ptr)  # joins the writer: no callback runs after
        self._callbacks = []

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"KVStore({[_shown(u) for u in self.urls]!r}, {state})"

    # -- operations ---------------------------------------------------------

    def flush(self, timeout_s=None) -> None:
        """Waits until every write queued so far is written (or failed), at
        most timeout_s seconds (None: no limit); raises
        :class:`StoreTimeoutError` on timeout."""
        t = -1.0 if timeout_s is None else float(timeout_s)
        if timeout_s is not None and t < 0:
            raise InvalidArgumentError(f"timeout_s must be >= 0 or None, got {timeout_s}")
        with self._use():
            st = self._lib.kvc_store_flush(self._ptr, t)
        if st == -6:  # KVC_ERR_IO: timed out
            raw = _lib.kvc_last_error()
            raise StoreTimeoutError(raw.decode("utf-8", "replace") if raw else
                                    "kvc_store_flush timed out", -6)
        _lib.check(st)

    def stats(self) -> dict:
        """Counters: hit_pages (pages restored into a cache; an engine's
        load counts those it used), miss_pages, verify_failures, misses (a dict by
        reason name: "absent", "truncated", ...), errors, bytes_read,
        bytes_written, writes_queued, writes_done, writes_dropped,
        writes_failed, timeouts. Writes count objects, once each whatever
        their tiers (writes_failed: objects some tier did not store);
        bytes_written sums the tiers' bytes (kvc_store_stats, store.h)."""
        s = StoreStats()
        with self._use():
            _lib.check(self._lib.kvc_store_get_stats(self._ptr, ctypes.byref(s)))
        out = {}
        for f, _t in StoreStats._fields_:
            if f == "misses":
                out[f] = {MISS_REASONS[i]: int(s.misses[i]) for i in range(_MISS_COUNT)}
            else:
                out[f] = int(getattr(s, f))
        return out

    def last_tier_error(self) -> str:
        """The message of the most recent failed tier call counted in
        stats()["errors"] ("" while none failed): why a tier failed on the
        writer thread or in a restore (kvc_store_last_tier_error)."""
        buf = ctypes.create_string_buffer(512)
        with self._use():
            _lib.check(self._lib.kvc_store_last_tier_error(self._ptr, buf, len(buf)))
        return buf.value.decode("utf-8", "replace")

    def invalidate(self, ns) -> None:
        """Removes every object of namespace ns from every tier
        (kvc_store_invalidate: a tier that fails does not stop the others;
        its cleared event still goes out when it may have removed some)."""
        k = _key(ns, "ns")
        with self._use():
            _lib.check(self._lib.kvc_store_invalidate(self._ptr, ctypes.byref(k)))

    def put(self, ns, key, obj) -> None:
        """Queues a copy of obj (bytes) under (ns, key) for every tier; never
        waits. Raises NoSpaceError when the queue is full (the write is
        dropped and counted)."""
        n, k = _key(ns, "ns"), _key(key, "key")
        data = bytes(obj)
        with self._use():
            st = self._lib.kvc_store_put(self._ptr, ctypes.byref(n), ctypes.byref(k), data,
                                         len(data))
        if st == -3:
            raw = _lib.kvc_last_error()
            raise NoSpaceError(raw.decode("utf-8", "replace") if raw else "store queue full", -3)
        _lib.check(st)

    def set_event_callback(self, fn) -> None:
        """Sets (fn None: clears) the event callback: fn(event) with event a
        dict: kind ("stored", "removed" or "cleared"), tier (the index in
        urls, or -1 (TIER_CACHE) for an attached engine's cache), ns, key,
        parent (16 bytes each) and tokens (a list of ids, or None for
        removals and clears). It runs on the store's writer thread or on the
        thread stepping an attached engine; it must not call the store.
        Exceptions it raises are printed and swallowed."""
        if fn is not None and not callable(fn):
            raise InvalidArgumentError(f"fn must be callable or None, got {type(fn).__name__}")
        if fn is None:
            with self._use():
                _lib.check(self._lib.kvc_store_set_event_callback(self._ptr, EVENT_FN(), None))
            return
        store_ref = weakref.ref(self)

        def trampoline(_user, ev_p):
            try:
                ev = ev_p.contents
                kind = ev.kind
                event = {
                    "kind": _EVENT_KINDS[kind] if 0 <= kind < len(_EVENT_KINDS) else kind,
                    "tier": int(ev.tier),
                    "ns": _kbytes(ev.ns),
                    "key": _kbytes(ev.key),
                    "parent": _kbytes(ev.parent),
                    "tokens": ([int(ev.tokens[i]) for i in range(ev.n_tokens)]
                               if ev.tokens and ev.n_tokens > 0 else None),
                }
                _in_callback.store = store_ref
                try:
                    fn(event)
                finally:
                    _in_callback.store = None
            except BaseException:  # noqa: BLE001 - never unwind into C
                try:
                    print("kvcache: exception in a KVStore event callback (ignored):",
                          file=sys.stderr)
                    traceback.print_exc()
                except Exception:  # noqa: BLE001 - interpreter shutdown
                    pass

        cb = EVENT_FN(trampoline)
        with self._use():
            self._callbacks.append(cb)
            _lib.check(self._lib.kvc_store_set_event_callback(self._ptr, cb, None))

    # -- runs over a cache ----------------------------------------------------

    def restore_run(self, cache, ns, tokens, first_page, max_pages, page_ids) -> int:
        """kvc_store_restore_run: the run of tokens' pages [first_page,
        first_page + max_pages) the tiers hold and that verify, written into
        page_ids (pages the caller owns; page_ids[i] receives page
        first_page + i). Returns the run's length."""
        c = _cache_of(cache)
        t = _tokens(tokens)
        ids = _lib.int32_array(page_ids, "page_ids").reshape(-1)
        fp, mp = _int(first_page, "first_page"), _int(max_pages, "max_pages")
        if fp < 0 or mp < 0 or ids.size < mp or t.size < (fp + mp) * c.page_size:
            raise InvalidArgumentError(
                f"restore_run: first_page {fp}, max_pages {mp} need {mp} page ids (got "
                f"{ids.size}) and {(fp + mp) * c.page_size} tokens (got {t.size})")
        k = _key(ns, "ns")
        n = ctypes.c_int64(0)
        with self._use(), c._lock:
            _lib.check(self._lib.kvc_store_restore_run(self._ptr, c._ptr(), ctypes.byref(k),
                                                       _i32ptr(t), fp, mp, _i32ptr(ids),
                                                       ctypes.byref(n)))
        return int(n.value)

    def save_run(self, cache, ns, tokens, first_page, n_pages, page_ids) -> None:
        """kvc_store_save_run: serializes pages [first_page, first_page +
        n_pages) of tokens (page ids page_ids) and queues them, all or none:
        on an error (:class:`kvcache.NoSpaceError` for a write queue without
        room for the whole run) nothing is queued."""
        c = _cache_of(cache)
        t = _tokens(tokens)
        ids = _lib.int32_array(page_ids, "page_ids").reshape(-1)
        fp, n = _int(first_page, "first_page"), _int(n_pages, "n_pages")
        if fp < 0 or n < 0 or ids.size < n or t.size < (fp + n) * c.page_size:
            raise InvalidArgumentError(
                f"save_run: first_page {fp}, n_pages {n} need {n} page ids (got {ids.size}) "
                f"and {(fp + n) * c.page_size} tokens (got {t.size})")
        k = _key(ns, "ns")
        with self._use(), c._lock:
            _lib.check(self._lib.kvc_store_save_run(self._ptr, c._ptr(), ctypes.byref(k),
                                                    _i32ptr(t), fp, n, _i32ptr(ids)))

    # -- engines --------------------------------------------------------------

    def _attach(self, engine, engine_ptr: int, ns: bytes) -> None:
        """kvc_store_attach_engine (Engine calls it, holding its lock)."""
        k = _key(ns, "ns")
        with self._use():
            _lib.check(self._lib.kvc_store_attach_engine(self._ptr, engine_ptr, ctypes.byref(k)))
            with self._elock:
                self._engines.add(engine)

    def _detach(self, engine, engine_ptr: int) -> None:
        """kvc_store_detach_engine (Engine.close calls it, holding its lock):
        the store frees what it kept for the engine and reports the pages of
        its cache removed. A store closing meanwhile detaches it itself."""
        with self._elock:
            self._engines.discard(engine)
        try:
            with self._use():
                _lib.check(self._lib.kvc_store_detach_engine(self._ptr, engine_ptr))
        except InvalidArgumentError:
            if not self._life.closed:
                raise


@atexit.register
def _close_stores_at_exit() -> None:
    """Stops every open store's writer before the interpreter goes away (a
    writer thread must not call into Python during finalization)."""
    for s in list(_open_stores):
        try:
            s.close()
        except Exception:  # noqa: BLE001
            pass
