"""Low-level ctypes layer: loading libkvcache, C prototypes, status checking,
numpy <-> ``kvc_tensor`` conversion and the thread-pool cache.

Library lookup order:

1. the environment variable ``KVCACHE_LIBRARY`` (a path; if it is set and
   cannot be loaded, import fails: there is no silent fallback),
2. the repository's build tree, ``python/../build/libkvcache.so``,
3. the system (``ctypes.util.find_library("kvcache")``).

Nothing here is public API; use the functions re-exported by ``kvcache``.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import ctypes.util
import functools
import operator
import os
import sys
import threading
from pathlib import Path

import numpy as np

from .errors import (
    STATUS_INTERNAL,
    InternalError,
    InvalidArgumentError,
    UnsupportedError,
    error_for_status,
)

# ---------------------------------------------------------------------------
# Loading

_ENV_VAR = "KVCACHE_LIBRARY"


def _library_file_names() -> list[str]:
    if sys.platform == "darwin":
        return ["libkvcache.dylib"]
    if sys.platform == "win32":
        return ["kvcache.dll", "libkvcache.dll"]
    return ["libkvcache.so"]


def _load_library() -> tuple[ctypes.CDLL, str]:
    """Finds and loads libkvcache; returns (handle, path). Raises ImportError."""
    env = os.environ.get(_ENV_VAR)
    if env:
        if not os.path.exists(env):
            raise ImportError(
                f"kvcache: {_ENV_VAR}={env!r} does not exist; point it at a built "
                f"libkvcache shared library or unset it to search the build tree and the system"
            )
        try:
            return ctypes.CDLL(env), env
        except OSError as exc:
            raise ImportError(f"kvcache: cannot load {_ENV_VAR}={env!r}: {exc}") from exc

    tried = []
    build_dir = Path(__file__).resolve().parent.parent.parent / "build"
    for name in _library_file_names():
        candidate = build_dir / name
        tried.append(str(candidate))
        if candidate.exists():
            try:
                return ctypes.CDLL(str(candidate)), str(candidate)
            except OSError as exc:
                raise ImportError(f"kvcache: cannot load {str(candidate)!r}: {exc}") from exc

    found = ctypes.util.find_library("kvcache")
    tried.append('ctypes.util.find_library("kvcache")')
    if found:
        try:
            return ctypes.CDLL(found), found
        except OSError as exc:
            raise ImportError(f"kvcache: cannot load system library {found!r}: {exc}") from exc

    raise ImportError(
        "kvcache: libkvcache shared library not found (tried: "
        + ", ".join(tried)
        + f"). Build it (cmake -S . -B build -G Ninja && cmake --build build), install it "
        f"where the loader looks (cmake --install build --prefix PREFIX; PREFIX/lib in "
        f"LD_LIBRARY_PATH or the ldconfig cache), or set {_ENV_VAR} to its path."
    )


lib, library_path = _load_library()

# ---------------------------------------------------------------------------
# C types

KVC_MAX_DIMS = 8

# kvc_dtype
KVC_F32, KVC_F16, KVC_BF16, KVC_I8, KVC_I4, KVC_FP8_E4M3, KVC_I32, KVC_I64, KVC_U8 = range(9)

# kvc_isa
ISA_NAMES = ("scalar", "avx2", "avx512", "amx")


class Tensor(ctypes.Structure):
    """ctypes mirror of ``kvc_tensor`` (strides in elements, nibbles for int4)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.c_int64 * KVC_MAX_DIMS),
        ("stride", ctypes.c_int64 * KVC_MAX_DIMS),
    ]


class PmxKvParams(ctypes.Structure):
    """ctypes mirror of ``kvc_pmx_kv_params``."""

    _fields_ = [
        ("num_layer", ctypes.c_int32),
        ("layer_idx", ctypes.c_int32),
        ("quant_bit", ctypes.c_int32),
        ("quant_group", ctypes.c_int32),
        ("num_repeat", ctypes.c_int32),
        ("cache_layout", ctypes.c_int32),
        ("cache_mode", ctypes.c_int32),
        ("page_size", ctypes.c_int32),
    ]


_c_int = ctypes.c_int
_vp = ctypes.c_void_p
_TP = ctypes.POINTER(Tensor)


def _proto(name, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


kvc_status_str = _proto("kvc_status_str", ctypes.c_char_p, _c_int)
kvc_last_error = _proto("kvc_last_error", ctypes.c_char_p)
kvc_clear_error = _proto("kvc_clear_error", None)
kvc_version_number = _proto("kvc_version_number", ctypes.c_uint)
kvc_version_string = _proto("kvc_version_string", ctypes.c_char_p)
kvc_dtype_name = _proto("kvc_dtype_name", ctypes.c_char_p, _c_int)
kvc_get_isa = _proto("kvc_get_isa", _c_int)
kvc_best_isa = _proto("kvc_best_isa", _c_int)
kvc_isa_supported = _proto("kvc_isa_supported", _c_int, _c_int)
kvc_isa_name = _proto("kvc_isa_name", ctypes.c_char_p, _c_int)
kvc_set_isa = _proto("kvc_set_isa", _c_int, _c_int)
kvc_threadpool_create = _proto("kvc_threadpool_create", _c_int, _c_int, ctypes.POINTER(_vp))
kvc_threadpool_destroy = _proto("kvc_threadpool_destroy", None, _vp)
kvc_threadpool_n_threads = _proto("kvc_threadpool_n_threads", _c_int, _vp)
kvc_cpu_count = _proto("kvc_cpu_count", _c_int)
kvc_convert = _proto("kvc_convert", _c_int, _vp, _c_int, _vp, _c_int, ctypes.c_int64)
kvc_quantize = _proto(
    "kvc_quantize", _c_int, _vp, _c_int, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, _vp,
    _vp, _c_int,
)
kvc_dequantize = _proto(
    "kvc_dequantize", _c_int, _vp, ctypes.c_int32, _vp, _c_int, ctypes.c_int64,
    ctypes.c_int32, _vp, _c_int,
)
kvc_pmx_kv_default_params = _proto("kvc_pmx_kv_default_params", PmxKvParams)
kvc_pmx_key_value_cache = _proto(
    "kvc_pmx_key_value_cache", _c_int, _TP, _TP, _TP, _TP, _TP,
    ctypes.POINTER(PmxKvParams), _TP, _TP, _vp,
)
kvc_pmx_dynamic_key_value_cache = _proto(
    "kvc_pmx_dynamic_key_value_cache", _c_int, _TP, _TP, _TP, _TP, _TP, _TP, _TP, _TP, _TP,
    _TP, ctypes.POINTER(PmxKvParams), _TP, _TP, _vp,
)


class PagedCache(ctypes.Structure):
    """ctypes mirror of ``kvc_paged_cache`` (include/kvcache/paged.h)."""

    _fields_ = [
        ("k", Tensor),
        ("v", Tensor),
        ("k_scale", Tensor),
        ("v_scale", Tensor),
        ("layout", ctypes.c_int),
        ("quant_group", ctypes.c_int32),
    ]


# kvc_kv_layout
KVC_NHD, KVC_HND = 0, 1


def optional_proto(name, restype, *argtypes):
    """Like _proto, for functions an older libkvcache may lack: import still
    works, and calling the missing function raises UnsupportedError naming the
    library and the symbol."""
    if hasattr(lib, name):
        return _proto(name, restype, *argtypes)

    def missing(*_args, **_kwargs):
        raise UnsupportedError(f"{library_path} has no {name}(); rebuild libkvcache from this "
                               f"source tree")

    missing.__name__ = name
    return missing


kvc_paged_cache_from_combined = optional_proto(
    "kvc_paged_cache_from_combined", _c_int, _TP, _TP, _c_int, ctypes.c_int32,
    ctypes.POINTER(PagedCache),
)
kvc_page_table_check = optional_proto(
    "kvc_page_table_check", _c_int, _TP, _TP, _TP, ctypes.c_int64, ctypes.c_int64,
)
kvc_get_seq_lens = optional_proto("kvc_get_seq_lens", _c_int, _TP, _TP, ctypes.c_int32, _TP)
kvc_get_batch_indices_positions = optional_proto(
    "kvc_get_batch_indices_positions", _c_int, _TP, _TP, ctypes.c_int64, _TP, _TP,
)
kvc_append_paged_kv_cache = optional_proto(
    "kvc_append_paged_kv_cache", _c_int, _TP, _TP, _TP, _TP, ctypes.POINTER(PagedCache), _TP,
    _TP, _TP, _vp,
)
kvc_append_paged_mla_kv_cache = optional_proto(
    "kvc_append_paged_mla_kv_cache", _c_int, _TP, _TP, _TP, _TP, _TP, _TP, _TP, _TP, _TP, _vp,
)
kvc_page_table_to_pmx = optional_proto(
    "kvc_page_table_to_pmx", _c_int, _TP, _TP, ctypes.c_int32, _TP,
)
kvc_pmx_to_page_table = optional_proto(
    "kvc_pmx_to_page_table", _c_int, _TP, _TP, ctypes.c_int32, _TP, _TP, _TP,
    ctypes.POINTER(ctypes.c_int64),
)


# ---------------------------------------------------------------------------
# Cache manager (include/kvcache/cache.h)


class CacheAllocator(ctypes.Structure):
    """ctypes mirror of ``kvc_allocator`` (the binding always passes NULLs:
    the library's malloc)."""

    _fields_ = [
        ("alloc", ctypes.c_void_p),
        ("free", ctypes.c_void_p),
        ("user", ctypes.c_void_p),
    ]


class CacheParams(ctypes.Structure):
    """ctypes mirror of ``kvc_cache_params``."""

    _fields_ = [
        ("num_layers", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("page_size", ctypes.c_int32),
        ("num_pages", ctypes.c_int64),
        ("max_bytes", ctypes.c_int64),
        ("dtype", ctypes.c_int),
        ("scale_dtype", ctypes.c_int),
        ("quant_group", ctypes.c_int32),
        ("layout", ctypes.c_int),
        ("allocator", CacheAllocator),
        ("enable_prefix_caching", ctypes.c_int32),
        ("kv_format", ctypes.c_int),  # kvc_kv_format: 0 none, 1 kivi8, 2 kivi4
    ]


class KvfmtSeq(ctypes.Structure):
    """ctypes mirror of ``kvc_kvfmt_seq``."""

    _fields_ = [
        ("pages", ctypes.POINTER(ctypes.c_int32)),
        ("n_kv", ctypes.c_int64),
        ("tail", ctypes.c_void_p),
        ("sink", ctypes.c_void_p),
    ]


class Kvfmt(ctypes.Structure):
    """ctypes mirror of ``kvc_kvfmt``."""

    _fields_ = [
        ("id", ctypes.c_int),  # kvc_kv_format
        ("bits", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("v_group", ctypes.c_int32),
        ("v_asym", ctypes.c_int32),
        ("rotate_v", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("page_size", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("sink", ctypes.c_int32),
    ]


class CacheStats(ctypes.Structure):
    """ctypes mirror of ``kvc_cache_stats``."""

    _fields_ = [
        ("free_pages", ctypes.c_int64),
        ("cached_pages", ctypes.c_int64),
        ("used_pages", ctypes.c_int64),
        ("hit_tokens", ctypes.c_int64),
        ("miss_tokens", ctypes.c_int64),
        ("evictions", ctypes.c_int64),
        ("cow_copies", ctypes.c_int64),
        ("failed_allocs", ctypes.c_int64),
    ]


_i32p = ctypes.POINTER(ctypes.c_int32)
_i64p = ctypes.POINTER(ctypes.c_int64)
_seq = ctypes.c_int64  # kvc_seq_id

kvc_cache_default_params = optional_proto("kvc_cache_default_params", CacheParams)
kvc_cache_create = optional_proto(
    "kvc_cache_create", _c_int, ctypes.POINTER(CacheParams), ctypes.POINTER(_vp),
)
kvc_cache_destroy = optional_proto("kvc_cache_destroy", None, _vp)
kvc_cache_bytes_per_token = optional_proto("kvc_cache_bytes_per_token", ctypes.c_size_t, _vp)
kvc_cache_capacity_tokens = optional_proto("kvc_cache_capacity_tokens", ctypes.c_int64, _vp)
kvc_cache_num_pages = optional_proto("kvc_cache_num_pages", ctypes.c_int64, _vp)
kvc_cache_layer = optional_proto(
    "kvc_cache_layer", _c_int, _vp, ctypes.c_int32, ctypes.POINTER(PagedCache),
)
kvc_cache_layer_tensors = optional_proto(
    "kvc_cache_layer_tensors", _c_int, _vp, ctypes.c_int32, _TP, _TP,
)
kvc_cache_add_sequence = optional_proto(
    "kvc_cache_add_sequence", _c_int, _vp, _i32p, ctypes.c_int64, ctypes.c_uint64,
    ctypes.POINTER(_seq), _i64p,
)
kvc_cache_append = optional_proto(
    "kvc_cache_append", _c_int, _vp, _seq, _i32p, ctypes.c_int64, _i32p,
)
kvc_cache_fork = optional_proto("kvc_cache_fork", _c_int, _vp, _seq, ctypes.POINTER(_seq))
kvc_cache_truncate = optional_proto("kvc_cache_truncate", _c_int, _vp, _seq, ctypes.c_int64)
kvc_cache_lookup_prefix = optional_proto(
    "kvc_cache_lookup_prefix", _c_int, _vp, _i32p, ctypes.c_int64, ctypes.c_uint64, _i64p)
kvc_cache_rollback = optional_proto("kvc_cache_rollback", _c_int, _vp, _seq, ctypes.c_int64)
kvc_cache_free_sequence = optional_proto("kvc_cache_free_sequence", _c_int, _vp, _seq)
kvc_cache_seq_len = optional_proto("kvc_cache_seq_len", _c_int, _vp, _seq, _i64p)
kvc_cache_page_table = optional_proto(
    "kvc_cache_page_table", _c_int, _vp, _i64p, ctypes.c_int64, _i32p, _i32p, ctypes.c_int64,
    _i32p, _i64p,
)
kvc_cache_cachestarts = optional_proto(
    "kvc_cache_cachestarts", _c_int, _vp, _i64p, ctypes.c_int64, _i64p, ctypes.c_int64,
)
kvc_cache_get_stats = optional_proto(
    "kvc_cache_get_stats", _c_int, _vp, ctypes.POINTER(CacheStats),
)
kvc_cache_check = optional_proto("kvc_cache_check", _c_int, _vp)
kvc_cache_truncate_ex = optional_proto(
    "kvc_cache_truncate_ex", _c_int, _vp, _seq, ctypes.c_int64, _i64p)
kvc_cache_kvfmt = optional_proto("kvc_cache_kvfmt", _c_int, _vp, ctypes.POINTER(Kvfmt))
kvc_cache_kvfmt_layer = optional_proto("kvc_cache_kvfmt_layer", _c_int, _vp, ctypes.c_int32, _TP)
kvc_cache_kvfmt_seqs = optional_proto(
    "kvc_cache_kvfmt_seqs", _c_int, _vp, ctypes.c_int32, _i64p, ctypes.c_int64,
    ctypes.POINTER(KvfmtSeq))
kvc_cache_get_params = optional_proto(
    "kvc_cache_get_params", _c_int, _vp, ctypes.POINTER(CacheParams))
kvc_cache_page_bytes = optional_proto("kvc_cache_page_bytes", ctypes.c_size_t, _vp)
kvc_cache_sink_bytes = optional_proto("kvc_cache_sink_bytes", ctypes.c_size_t, _vp)
kvc_cache_read_sink = optional_proto(
    "kvc_cache_read_sink", _c_int, _vp, ctypes.c_int32, _vp, ctypes.c_size_t)
kvc_cache_read_page = optional_proto(
    "kvc_cache_read_page", _c_int, _vp, ctypes.c_int32, _vp, ctypes.c_size_t)
kvc_cache_write_page = optional_proto(
    "kvc_cache_write_page", _c_int, _vp, ctypes.c_int32, _vp, ctypes.c_size_t)
kvc_cache_page_tokens = optional_proto(
    "kvc_cache_page_tokens", _c_int, _vp, ctypes.c_int32, _i32p)


def check(status: int) -> None:
    """Raises the exception matching a negative kvc_status, with kvc_last_error()."""
    if status == 0:
        return
    if status > 0:  # not a kvc_status value at all
        raise InternalError(f"kvcache returned unexpected status {status}", STATUS_INTERNAL)
    raw = kvc_last_error()
    message = raw.decode("utf-8", "replace") if raw else ""
    if not message:
        name = kvc_status_str(status)
        message = name.decode() if name else f"status {status}"
    raise error_for_status(status, message)


# ---------------------------------------------------------------------------
# dtypes

_bf16_dtype = None
_bf16_tried = False


def bfloat16_dtype():
    """numpy dtype of ml_dtypes.bfloat16, or None if ml_dtypes is not installed."""
    global _bf16_dtype, _bf16_tried
    if not _bf16_tried:
        _bf16_tried = True
        try:
            import ml_dtypes  # noqa: PLC0415 (optional dependency, imported lazily)

            _bf16_dtype = np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            _bf16_dtype = None
    return _bf16_dtype


_NUMPY_CODES = {
    np.dtype(np.float32): KVC_F32,
    np.dtype(np.float16): KVC_F16,
    np.dtype(np.int8): KVC_I8,
    np.dtype(np.int32): KVC_I32,
    np.dtype(np.int64): KVC_I64,
    np.dtype(np.uint8): KVC_U8,
}

FLOAT_CODES = (KVC_F32, KVC_F16, KVC_BF16)
_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)

_CODE_NAMES = {KVC_F32: "float32", KVC_F16: "float16", KVC_BF16: "bfloat16", KVC_I8: "int8",
               KVC_I4: "int4", KVC_FP8_E4M3: "float8_e4m3", KVC_I32: "int32", KVC_I64: "int64",
               KVC_U8: "uint8"}


def _accepted(allowed) -> str:
    """' (accepted: float32, float16, bfloat16)' for an error message."""
    if not allowed:
        return ""
    return " (accepted: " + ", ".join(_CODE_NAMES.get(c, str(c)) for c in allowed) + ")"


#: The names a dtype may be given by, wherever kvcache takes one as a string
#: (plan q/kv/o_data_type, o_dtype, PagedKVCache dtype and scale_dtype, quant
#: dtypes, Model kv_dtype, KV store configs): FlashInfer's, which are torch
#: attribute names (getattr(torch, name), so "float" is float32 and "half"
#: float16, unlike numpy's "float" = float64), and kvcache's short forms
#: ("f32", "fp16", "bf16", "i8", "i4"; "i8" is int8 here, not numpy's int64).
#: Case and surrounding blanks are ignored. Other strings fall back to numpy's
#: dtype names ("single", "f4", ...) where a numpy dtype is wanted.
DTYPE_ALIASES = {
    "float32": KVC_F32, "float": KVC_F32, "fp32": KVC_F32, "f32": KVC_F32,
    "float16": KVC_F16, "half": KVC_F16, "fp16": KVC_F16, "f16": KVC_F16,
    "bfloat16": KVC_BF16, "bf16": KVC_BF16,
    "int8": KVC_I8, "i8": KVC_I8,
    "int4": KVC_I4, "i4": KVC_I4,
    "uint8": KVC_U8,
}


#: FlashInfer's (torch's) low-precision float dtypes, for which kvcache has no
#: storage: a valid name of a feature kvcache lacks, so UnsupportedError.
UNSUPPORTED_DTYPE_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                           "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")


def dtype_alias(name, what: str = "dtype") -> int | None:
    """kvc_dtype code of a dtype name of DTYPE_ALIASES, or None; raises
    UnsupportedError for the names of UNSUPPORTED_DTYPE_NAMES (what: the
    argument, for the message)."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    if key in UNSUPPORTED_DTYPE_NAMES:
        raise UnsupportedError(f"{what} {name!r} (FlashInfer's fp8/fp4) is not supported: "
                               f"kvcache stores float32, float16, bfloat16, int8 or int4")
    return DTYPE_ALIASES.get(key)


def resolve_dtype(dtype, what: str = "dtype") -> np.dtype:
    """numpy dtype from a numpy dtype/type or a name (DTYPE_ALIASES first:
    "float32"/"float", "float16"/"half", "bfloat16", ...; "int4" is uint8,
    the arrays that hold packed int4)."""
    code = dtype_alias(dtype, what)
    if code == KVC_BF16:
        bf = bfloat16_dtype()
        if bf is None:
            raise InvalidArgumentError("bfloat16 needs the ml_dtypes package")
        return bf
    if code is not None:
        return np.dtype({KVC_F32: np.float32, KVC_F16: np.float16, KVC_I8: np.int8,
                         KVC_I4: np.uint8, KVC_U8: np.uint8}[code])
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise InvalidArgumentError(f"not a dtype: {dtype!r}") from exc


def dtype_code(dtype: np.dtype) -> int | None:
    """kvc_dtype code of a numpy dtype, or None if kvcache has no such dtype."""
    if not isinstance(dtype, np.dtype):
        dtype = np.dtype(dtype)
    code = _NUMPY_CODES.get(dtype)
    if code is not None:
        return code
    bf = bfloat16_dtype()
    if bf is not None and dtype == bf:
        return KVC_BF16
    return None


def flag(x, name: str) -> bool:
    """A boolean argument: True/False, numpy bools, or the integers 0 and 1 (as
    C callers pass them); anything else (None, strings, 2) is refused rather than
    read by its truthiness."""
    if isinstance(x, (bool, np.bool_, int, np.integer)) and int(x) in (0, 1):
        return bool(x)
    raise InvalidArgumentError(f"{name} must be a bool, got {x!r}")


# ---------------------------------------------------------------------------
# Threads. ctypes releases the GIL during C calls, so Python threads that share
# an object run its C code at the same time. Objects whose C side is used by
# one thread at a time (plans, engines) serialize their methods with
# `locked`; shareable ones (models, tokenizers, GGUF files) count their calls
# in flight with a Lifetime, so that close() waits for them instead of
# freeing the C object under them.


def locked(method):
    """Runs the method holding the object's own lock (an RLock made on first
    use): its C object is used by one thread at a time, and a plan() or
    close() cannot free it under another thread's run()."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        lock = self.__dict__.get("_call_lock")
        if lock is None:  # setdefault is atomic: racing threads get one lock
            lock = self.__dict__.setdefault("_call_lock", threading.RLock())
        with lock:
            return method(self, *args, **kwargs)

    return wrapper


class Lifetime:
    """The calls in flight on a shareable C object. Each C call runs inside
    ``with life.use():`` (raising InvalidArgumentError "<what> is closed"
    once closed); close() refuses new calls, waits for those running, and
    returns True to the one caller that must then free the object. Do not
    close from inside a call on the same thread (it would wait forever).
    A use is two acquisitions of a plain lock: no generator, and an Event
    only once a close() is waiting."""

    __slots__ = ("_lock", "_n", "_closed", "_what", "_idle")

    def __init__(self, what: str):
        self._lock = threading.Lock()
        self._n = 0
        self._closed = False
        self._what = what
        self._idle = None  # set by close() while calls are running

    def use(self) -> "Lifetime":
        return self

    def __enter__(self) -> None:
        with self._lock:
            if self._closed:
                raise InvalidArgumentError(f"{self._what} is closed")
            self._n += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._n -= 1
            if self._n == 0 and self._idle is not None:
                self._idle.set()

    def close(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            if self._n == 0:
                return True
            self._idle = threading.Event()
        self._idle.wait()
        return True

    @property
    def closed(self) -> bool:
        return self._closed


class NoCopy:
    """Base of the classes that own a C object (a plan, cache, file, model...):
    a copy or a pickle would carry the raw pointer and free it twice, so
    both are refused with TypeError (as for any unpicklable object)."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):  # pickle, copy.copy and copy.deepcopy all use it
        raise TypeError(f"{type(self).__name__} owns a C object and cannot be copied or "
                        f"pickled; create another one instead")


def dtype_str(dtype) -> str:
    return str(np.dtype(dtype))


# ---------------------------------------------------------------------------
# numpy -> kvc_tensor


def _element_strides(arr: np.ndarray) -> list[int] | None:
    """Strides of arr in elements, or None if they cannot be expressed as
    non-negative element strides with a contiguous last dimension. Strides of
    dimensions of size <= 1 are irrelevant and are normalised (0, or 1 for the
    last dimension); an empty array gets contiguous strides."""
    n = arr.ndim
    if n == 0:
        return []
    item = arr.itemsize
    if arr.size == 0:
        out = [0] * n
        acc = 1
        for d in range(n - 1, -1, -1):
            out[d] = acc
            acc *= max(arr.shape[d], 1)
        return out
    out = []
    for d in range(n):
        size, s = arr.shape[d], arr.strides[d]
        if size <= 1:
            out.append(1 if d == n - 1 else 0)
            continue
        if s < 0 or s % item:
            return None
        out.append(s // item)
    if arr.shape[-1] > 1 and out[-1] != 1:
        return None
    return out


def _data_ptr_numpy(arr: np.ndarray) -> int | None:
    return arr.ctypes.data


_DATA_OFFSET = object.__basicsize__
_vp_at = ctypes.c_void_p.from_address


def _data_ptr_field(arr: np.ndarray) -> int | None:
    """arr's data pointer read from the ndarray object itself: numpy's
    PyArrayObject starts with the object header and then ``char *data`` (the
    field numpy's own PyArray_DATA reads, part of its stable C ABI). A tenth
    of the cost of ``arr.ctypes.data``, which builds a helper object per call.
    Used only after _pick_data_ptr verified it on this interpreter."""
    return _vp_at(id(arr) + _DATA_OFFSET).value


def _pick_data_ptr():
    """_data_ptr_field where it gives what ``arr.ctypes.data`` gives for a
    set of probe arrays (CPython: id() is the address), else ``arr.ctypes.data``."""
    if sys.implementation.name != "cpython":
        return _data_ptr_numpy
    try:
        base = np.arange(64, dtype=np.float64)
        ro = np.zeros((3, 4), np.int8)
        ro.flags.writeable = False

        class Sub(np.ndarray):
            pass

        probes = [base, base[3:], base[1::3], base.reshape(8, 8).T, base[::-1], ro,
                  np.empty(0, np.float16), np.zeros(()), np.frombuffer(b"abcdefgh", np.uint8)[1:],
                  base.view(Sub)[5:], np.zeros((2, 3), np.float32, order="F")]
        if all(_data_ptr_field(a) == a.ctypes.data for a in probes):
            return _data_ptr_field
    except Exception:  # noqa: BLE001 (any surprise: use numpy's own accessor)
        pass
    return _data_ptr_numpy


data_ptr = _pick_data_ptr()


def _make_template(arr: np.ndarray, code: int | None, int4: bool) -> Tensor:
    """kvc_tensor for arr's dtype/shape/strides with a NULL data pointer;
    raises as make_tensor does."""
    if arr.ndim > KVC_MAX_DIMS:
        raise InvalidArgumentError(f"array has {arr.ndim} dimensions; kvcache supports at most "
                                   f"{KVC_MAX_DIMS}")
    strides = _element_strides(arr)
    if strides is None:
        raise InternalError("make_tensor: array layout not representable")
    t = Tensor()
    if code is None:
        code = dtype_code(arr.dtype)
        if code is None:
            raise InvalidArgumentError(f"unsupported dtype {arr.dtype}")
    t.dtype = KVC_I4 if int4 else code
    t.ndim = arr.ndim
    for d in range(arr.ndim):
        if int4:
            last = d == arr.ndim - 1
            t.shape[d] = arr.shape[d] * 2 if last else arr.shape[d]
            t.stride[d] = 1 if last else strides[d] * 2
        else:
            t.shape[d] = arr.shape[d]
            t.stride[d] = strides[d]
    return t


# Layouts seen before: (dtype, shape, strides, int4) -> _Layout. A hit means
# the array's dtype is one kvcache knows, it has at most KVC_MAX_DIMS
# dimensions and its strides are representable (_element_strides is not
# None): everything about an array that decides those is in the key, so the
# hot paths (a run() per layer per step sees the same few layouts) look them
# up instead of recomputing them. Alignment, writeability and the data
# pointer are per array and are read on every call. Entries are immutable;
# dict get/set are atomic, so threads share the table without a lock.
_LAYOUTS: dict = {}
_LAYOUTS_MAX = 4096


class _Layout:
    __slots__ = ("template", "code", "overlaps")

    def __init__(self, template: Tensor, code: int, overlaps: bool):
        self.template = template  # kvc_tensor with data NULL, copied per call
        self.code = code  # kvc_dtype of the numpy dtype (KVC_U8 for int4 bytes)
        self.overlaps = overlaps  # a zero stride over a dimension > 1 of a non-empty array


def _layout(arr: np.ndarray, int4: bool = False) -> _Layout | None:
    """arr's _Layout, None if make_tensor would refuse arr (unknown dtype,
    too many dimensions, strides not representable)."""
    key = (arr.dtype, arr.shape, arr.strides, int4)
    entry = _LAYOUTS.get(key)
    if entry is not None:
        return entry
    code = dtype_code(arr.dtype)
    if code is None or arr.ndim > KVC_MAX_DIMS or _element_strides(arr) is None:
        return None
    overlaps = bool(arr.size) and any(size > 1 and st == 0
                                      for size, st in zip(arr.shape, arr.strides, strict=True))
    entry = _Layout(_make_template(arr, code, int4), code, overlaps)
    if len(_LAYOUTS) >= _LAYOUTS_MAX:
        _LAYOUTS.clear()
    _LAYOUTS[key] = entry
    return entry


_copy_tensor = Tensor.from_buffer_copy


def make_tensor(arr: np.ndarray, code: int | None = None, int4: bool = False) -> Tensor:
    """kvc_tensor describing arr's memory (arr must be valid for _element_strides).

    With int4=True, arr is a uint8 array whose bytes hold two 4-bit elements
    each: the tensor's last dimension is doubled and every stride is counted in
    nibbles (doubled)."""
    if code is None:
        entry = _LAYOUTS.get((arr.dtype, arr.shape, arr.strides, int4)) or _layout(arr, int4)
        if entry is not None:
            t = _copy_tensor(entry.template)
            t.data = data_ptr(arr)
            return t
    t = _make_template(arr, code, int4)  # raises what the layout check refused
    t.data = data_ptr(arr)
    return t


def as_array(x, name: str) -> np.ndarray:
    """np.asarray(x), with numpy's conversion errors (ragged lists, objects)
    reported as InvalidArgumentError naming the argument."""
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"{name}: cannot convert to an array: {exc}") from exc


def input_array(x, name: str, allowed=None) -> np.ndarray:
    """A numpy array for a read-only operator input, copied only when its
    strides cannot be passed as they are (last dim not contiguous, negative or
    misaligned strides). allowed: tuple of kvc_dtype codes, or None for any
    dtype kvcache knows."""
    if type(x) is np.ndarray:  # fast path: a known layout, aligned, allowed dtype
        entry = _LAYOUTS.get((x.dtype, x.shape, x.strides, False))
        if (entry is not None and x.flags.aligned and
                (allowed is None or entry.code in allowed)):
            return x
    arr = as_array(x, name)
    code = dtype_code(arr.dtype)
    if code is None or (allowed is not None and code not in allowed):
        raise InvalidArgumentError(f"{name}: unsupported dtype {arr.dtype}{_accepted(allowed)}")
    if arr.ndim > KVC_MAX_DIMS:
        raise InvalidArgumentError(f"{name}: {arr.ndim} dimensions, at most {KVC_MAX_DIMS}")
    if _element_strides(arr) is None or not arr.flags.aligned:
        arr = arr.copy(order="C")  # C needs element strides and aligned data
    return arr


def input_tensor(x, name: str, allowed=None, int4: bool = False):
    """(input_array(x, name, allowed), its kvc_tensor): the same checks and
    copies, one layout lookup for both on the fast path."""
    if type(x) is np.ndarray:
        entry = _LAYOUTS.get((x.dtype, x.shape, x.strides, int4))
        if (entry is not None and x.flags.aligned and
                (allowed is None or entry.code in allowed)):
            t = _copy_tensor(entry.template)
            t.data = data_ptr(x)
            return x, t
    arr = input_array(x, name, allowed)
    return arr, make_tensor(arr, int4=int4)


def inplace_array(x, name: str, writable: bool = True) -> np.ndarray:
    """Checks that C can use x in place (a numpy array with a contiguous last
    dimension and non-negative, element-aligned strides; writeable unless
    writable is False, for arrays C only reads); never copies."""
    if isinstance(x, np.ndarray):  # fast path: every check below, from a known layout
        entry = _LAYOUTS.get((x.dtype, x.shape, x.strides, False))
        if entry is not None:
            flags = x.flags
            if flags.aligned and (not writable or (flags.writeable and not entry.overlaps)):
                return x
    how = "updated in place" if writable else "read in place"
    if not isinstance(x, np.ndarray):
        raise InvalidArgumentError(f"{name} must be a numpy.ndarray (it is {how}), "
                                   f"got {type(x).__name__}")
    if dtype_code(x.dtype) is None:
        raise InvalidArgumentError(f"{name}: unsupported dtype {x.dtype}")
    if x.ndim > KVC_MAX_DIMS:
        raise InvalidArgumentError(f"{name}: {x.ndim} dimensions, at most {KVC_MAX_DIMS}")
    if writable and not x.flags.writeable:
        raise InvalidArgumentError(f"{name} is not writeable (it is updated in place)")
    if _element_strides(x) is None:
        raise InvalidArgumentError(
            f"{name} must have a contiguous last dimension and non-negative strides "
            f"(got strides {x.strides} bytes for dtype {x.dtype}); it is {how}, "
            f"so it cannot be copied"
        )
    if not x.flags.aligned:
        raise InvalidArgumentError(f"{name}'s data is not aligned to its {x.itemsize}-byte "
                                   f"elements; it is {how}, so it cannot be copied")
    if writable and x.size:  # an empty array's strides may be 0: nothing overlaps
        for size, st in zip(x.shape, x.strides, strict=True):
            if size > 1 and st == 0:
                raise InvalidArgumentError(f"{name} has a zero stride (a broadcast view); it "
                                           f"is updated in place, so its elements must not "
                                           f"overlap")
    return x


def inplace_tensor(x, name: str, writable: bool = True, int4: bool = False):
    """(inplace_array(x, name, writable), its kvc_tensor): the same checks,
    one layout lookup for both on the fast path."""
    if isinstance(x, np.ndarray):
        entry = _LAYOUTS.get((x.dtype, x.shape, x.strides, int4))
        if entry is not None:
            flags = x.flags
            if flags.aligned and (not writable or (flags.writeable and not entry.overlaps)):
                t = _copy_tensor(entry.template)
                t.data = data_ptr(x)
                return x, t
    arr = inplace_array(x, name, writable)
    return arr, make_tensor(arr, int4=int4)


def layout_ok(arr: np.ndarray) -> bool:
    """_element_strides(arr) is not None, from the layout table when it can."""
    if _LAYOUTS.get((arr.dtype, arr.shape, arr.strides, False)) is not None:
        return True
    return _element_strides(arr) is not None


def int64_array(x, name: str) -> np.ndarray:
    """A C-contiguous int64 copy (or view) of an index input (ints, lists, any
    integer array). Refuses non-integer data rather than truncating it."""
    if type(x) is np.ndarray and x.dtype == _I64 and x.flags.c_contiguous and (
            x.ndim <= KVC_MAX_DIMS):
        return x  # what the general path returns for it (np.array(copy=False))
    arr = as_array(x, name)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and arr.size == 0:
            arr = arr.astype(np.int64)
        else:
            raise InvalidArgumentError(f"{name} must hold integers"
                                       f"{' within int64' if arr.dtype.kind == 'O' else ''}, "
                                       f"got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"{name} has values beyond int64")
    if arr.ndim > KVC_MAX_DIMS:
        raise InvalidArgumentError(f"{name}: {arr.ndim} dimensions, at most {KVC_MAX_DIMS}")
    return np.array(arr, dtype=np.int64, order="C", copy=not (
        arr.dtype == np.int64 and arr.flags.c_contiguous))


def int32_array(x, name: str) -> np.ndarray:
    """A C-contiguous int32 copy (or view) of an index input (ints, lists, any
    integer array). Refuses non-integer data and values outside int32 rather
    than truncating them."""
    if type(x) is np.ndarray and x.dtype == _I32 and x.flags.c_contiguous and (
            x.ndim <= KVC_MAX_DIMS):
        return x  # what the general path returns for it (np.array(copy=False))
    arr = as_array(x, name)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and arr.size == 0:
            arr = arr.astype(np.int32)
        else:
            raise InvalidArgumentError(f"{name} must hold integers"
                                       f"{' within int64' if arr.dtype.kind == 'O' else ''}, "
                                       f"got dtype {arr.dtype}")
    if arr.ndim > KVC_MAX_DIMS:
        raise InvalidArgumentError(f"{name}: {arr.ndim} dimensions, at most {KVC_MAX_DIMS}")
    if arr.dtype != np.int32 and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < -(2**31) or hi >= 2**31:
            bad = lo if lo < -(2**31) else hi
            raise InvalidArgumentError(f"{name} holds {bad}, which does not fit in int32")
    return np.array(arr, dtype=np.int32, order="C", copy=not (
        arr.dtype == np.int32 and arr.flags.c_contiguous))


def int32_tensor(x, name: str):
    """(int32_array(x, name), its kvc_tensor): an index input already int32
    and C-contiguous passes with one layout lookup."""
    if type(x) is np.ndarray:
        entry = _LAYOUTS.get((x.dtype, x.shape, x.strides, False))
        if entry is not None and entry.code == KVC_I32 and x.flags.c_contiguous:
            t = _copy_tensor(entry.template)
            t.data = data_ptr(x)
            return x, t
    arr = int32_array(x, name)
    return arr, make_tensor(arr)


def scalar_int64(x, name: str) -> np.ndarray:
    """A 0-d int64 array from an int or a one-element integer array."""
    arr = int64_array(x, name)
    if arr.size != 1:
        raise InvalidArgumentError(f"{name} must be a single integer, got shape {arr.shape}")
    return arr.reshape(())


def int32_attr(value, name: str) -> int:
    """An integer attribute that must fit the C int32_t it is passed as."""
    try:
        v = operator.index(value)
    except TypeError as exc:
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}") from exc
    if not -(2**31) <= v < 2**31:
        raise InvalidArgumentError(f"{name} = {v} does not fit in int32")
    return v


# ---------------------------------------------------------------------------
# Thread pools: one per thread count, the POOL_CACHE_SIZE most recently used
# kept. A pool is destroyed when the cache and every wrapper that keeps it
# (wrappers hold their Pool) have let it go, so calling with many different
# thread counts leaves at most POOL_CACHE_SIZE cached pools' threads alive.

POOL_CACHE_SIZE = 4


class Pool:
    """A kvc_threadpool and the lock its callers hold for the duration of a
    C call (a pool runs one operator at a time). Read ``ptr`` while holding
    ``lock``: at interpreter exit the pools are destroyed under their locks
    and ptr becomes None (the calling thread alone, as C's NULL pool). A call
    keeps a reference for its duration, so the pool cannot be freed under
    it."""

    __slots__ = ("ptr", "lock", "n_threads")

    def __init__(self, ptr, n_threads: int = 1):
        self.ptr = ptr
        self.lock = threading.Lock()
        self.n_threads = n_threads  # what kvc_threadpool_n_threads(ptr) says

    def close(self) -> None:
        """Destroys the C pool (joins its threads) once running calls end."""
        with self.lock:
            ptr, self.ptr = self.ptr, None
            if ptr and kvc_threadpool_destroy is not None:
                kvc_threadpool_destroy(ptr)

    def __del__(self):
        ptr, self.ptr = self.ptr, None
        destroy = globals().get("kvc_threadpool_destroy")
        if ptr and destroy is not None:
            destroy(ptr)


_pools: "collections.OrderedDict[int, Pool]" = collections.OrderedDict()
_pools_lock = threading.Lock()
_pools_closed = False


def cpu_count() -> int:
    """The CPUs this process may run on (kvc_cpu_count: the affinity mask)."""
    return int(kvc_cpu_count())


def threadpool(n_threads: int | None) -> Pool:
    """The Pool for n_threads (None: cpu_count()), made on first use; the
    least recently used cached pool beyond POOL_CACHE_SIZE is let go."""
    if n_threads is None:
        n = cpu_count()
    else:
        try:
            n = operator.index(n_threads)
        except TypeError as exc:
            raise InvalidArgumentError(f"num_threads must be an integer or None, "
                                       f"got {n_threads!r}") from exc
        if n < 1 or n > 1024:
            raise InvalidArgumentError(f"num_threads must be in [1, 1024] or None, got {n}")
    evicted = []
    with _pools_lock:
        entry = _pools.get(n)
        if entry is not None:
            _pools.move_to_end(n)
            return entry
        if _pools_closed:  # exiting: no new pools
            return Pool(None)
        ptr = ctypes.c_void_p()
        check(kvc_threadpool_create(n, ctypes.byref(ptr)))
        entry = _pools[n] = Pool(ptr.value, int(kvc_threadpool_n_threads(ptr.value)))
        while len(_pools) > POOL_CACHE_SIZE:
            evicted.append(_pools.popitem(last=False)[1])
    # Dropped outside the lock: a pool no wrapper keeps is destroyed here
    # (after any call running on it, which holds a reference).
    del evicted
    return entry


def threads_arg(num_threads, n_threads):
    """The thread count of a function that takes num_threads and, under its
    older name, n_threads (give one of them)."""
    if num_threads is not None and n_threads is not None:
        raise InvalidArgumentError("give num_threads or n_threads (the same), not both")
    return n_threads if num_threads is None else num_threads


def call_pooled(fn, args, n_threads) -> None:
    """fn(*args, pool) on the pool for n_threads, holding its lock; raises the
    C error if the status is not KVC_OK."""
    call_on(threadpool(n_threads), fn, args)


def call_on(pool: Pool, fn, args) -> None:
    """fn(*args, pool.ptr) holding pool.lock (call_pooled for a Pool already
    looked up, as wrappers keep theirs); raises the C error if the status is
    not KVC_OK."""
    with pool.lock:
        status = fn(*args, pool.ptr)
    if status:
        check(status)


@atexit.register
def _destroy_pools() -> None:
    """Each pool is destroyed holding its lock, so a call still running in a
    daemon thread finishes first; later calls run on their own thread."""
    global _pools_closed
    with _pools_lock:
        _pools_closed = True
        pools = list(_pools.values())
    for pool in pools:
        pool.close()


# ---------------------------------------------------------------------------
# Attention (include/kvcache/attention.h)


class AttnParams(ctypes.Structure):
    """ctypes mirror of ``kvc_attn_params``."""

    _fields_ = [
        ("sm_scale", ctypes.c_float),         # 0: 1/sqrt(Dh)
        ("logits_soft_cap", ctypes.c_float),  # > 0 enables cap * tanh(s / cap)
        ("window_left", ctypes.c_int32),      # -1: no window
        ("sinks", ctypes.POINTER(ctypes.c_float)),  # (Hq) sink logits or NULL
    ]


kvc_attn_default_params = optional_proto("kvc_attn_default_params", AttnParams)
kvc_single_decode = optional_proto(
    "kvc_single_decode", _c_int, _TP, _TP, _TP, _TP, _TP, ctypes.c_int32, _c_int,
    ctypes.POINTER(AttnParams), _TP, _TP, _vp,
)
kvc_decode_plan_create = optional_proto(
    "kvc_decode_plan_create", _c_int, _TP, _TP, _TP, ctypes.c_int32, ctypes.c_int32,
    ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(_vp),
)
kvc_decode_plan_destroy = optional_proto("kvc_decode_plan_destroy", None, _vp)
kvc_decode_run = optional_proto(
    "kvc_decode_run", _c_int, _vp, _TP, ctypes.POINTER(PagedCache), ctypes.POINTER(AttnParams),
    _TP, _TP, _vp,
)
kvc_merge_state = optional_proto("kvc_merge_state", _c_int, _TP, _TP, _TP, _TP, _TP, _TP)
kvc_merge_state_in_place = optional_proto(
    "kvc_merge_state_in_place", _c_int, _TP, _TP, _TP, _TP, _TP,
)
kvc_merge_states = optional_proto("kvc_merge_states", _c_int, _TP, _TP, _TP, _TP)


# ---------------------------------------------------------------------------
# Compressed paged KV formats (include/kvcache/kvfmt.h)

# kvc_kv_format
KVC_KVFMT_NONE, KVC_KVFMT_KIVI8, KVC_KVFMT_KIVI4 = 0, 1, 2


KvFmt = Kvfmt


class KvFmtSeq(ctypes.Structure):
    """ctypes mirror of ``kvc_kvfmt_seq``."""

    _fields_ = [
        ("pages", ctypes.POINTER(ctypes.c_int32)),
        ("n_kv", ctypes.c_int64),
        ("tail", ctypes.POINTER(ctypes.c_uint16)),
        ("sink", ctypes.POINTER(ctypes.c_uint16)),
    ]


_FP = ctypes.POINTER(KvFmt)
_SP = ctypes.POINTER(KvFmtSeq)

kvc_kv_format_name = optional_proto("kvc_kv_format_name", ctypes.c_char_p, _c_int)
kvc_kv_format_from_name = optional_proto(
    "kvc_kv_format_from_name", _c_int, ctypes.c_char_p, ctypes.POINTER(_c_int),
)
kvc_kvfmt_make = optional_proto(
    "kvc_kvfmt_make", _c_int, _c_int, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, _FP,
)
kvc_kvfmt_check = optional_proto("kvc_kvfmt_check", _c_int, _FP)
kvc_kvfmt_page_bytes = optional_proto("kvc_kvfmt_page_bytes", ctypes.c_size_t, _FP)
kvc_kvfmt_tail_bytes = optional_proto("kvc_kvfmt_tail_bytes", ctypes.c_size_t, _FP)
kvc_kvfmt_sink_bytes = optional_proto("kvc_kvfmt_sink_bytes", ctypes.c_size_t, _FP)
kvc_kvfmt_append = optional_proto(
    "kvc_kvfmt_append", _c_int, _FP, _TP, _SP, ctypes.c_int64, _i64p, _TP, _TP, _vp,
)
kvc_kvfmt_attention = optional_proto(
    "kvc_kvfmt_attention", _c_int, _FP, _TP, _SP, ctypes.c_int64, _TP, _i32p, _i32p,
    ctypes.POINTER(AttnParams), _TP, _TP, _vp,
)
kvc_kvfmt_append_attention = optional_proto(
    "kvc_kvfmt_append_attention", _c_int, _FP, _TP, _SP, ctypes.c_int64, _i64p, _TP, _TP, _TP,
    _i32p, _i32p, ctypes.POINTER(AttnParams), _TP, _TP, _vp,
)
