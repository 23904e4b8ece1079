"""GGUF files through the C reader (include/kvcache/gguf.h).

>>> with GGUFFile("model.gguf") as f:
...     f.metadata["llama.block_count"]           # int
...     t = f.tensor("blk.0.attn_q.weight")
...     t.type_name, t.ne, t.shape                 # "Q4_1", (576, 576), (576, 576)
...     raw = t.raw()                              # bytes of the stored blocks

Metadata values become Python objects: integers -> int, bool -> bool,
float32/float64 -> float, string -> str (UTF-8, invalid bytes replaced),
numeric arrays -> numpy arrays (little-endian copies), string arrays ->
list[str], arrays of arrays -> None (the C API does not expose their
elements). A uint64 value is exact up to 2**64 - 1 (kvc_gguf_get_u64).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import operator
import os
from typing import Self

import numpy as np

from . import _lib
from ._lib import Lifetime, NoCopy, check, optional_proto
from .errors import InvalidArgumentError

__all__ = ["GGUFFile", "GGUFTensor", "ggml_block_bytes", "ggml_block_size", "ggml_dequantize",
           "ggml_type_name"]

_vp = ctypes.c_void_p
_i64 = ctypes.c_int64
_I64P = ctypes.POINTER(ctypes.c_int64)
_IP = ctypes.POINTER(ctypes.c_int)

# kvc_gguf_type
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, \
    FLOAT64 = range(13)
_NUMPY = {
    UINT8: "<u1", INT8: "<i1", UINT16: "<u2", INT16: "<i2", UINT32: "<u4", INT32: "<i4",
    FLOAT32: "<f4", BOOL: "?", UINT64: "<u8", INT64: "<i8", FLOAT64: "<f8",
}


class _CTensor(ctypes.Structure):
    """ctypes mirror of ``kvc_gguf_tensor``."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("type", ctypes.c_int32),
        ("n_dims", ctypes.c_int32),
        ("ne", ctypes.c_int64 * 4),
        ("data", ctypes.c_void_p),
        ("size", ctypes.c_size_t),
    ]


_c_int = ctypes.c_int
_CSTR = ctypes.c_char_p
_SZP = ctypes.POINTER(ctypes.c_size_t)
_STRP = ctypes.POINTER(ctypes.c_void_p)  # const char ** (not NUL-terminated: read by length)

kvc_ggml_type_name = optional_proto("kvc_ggml_type_name", ctypes.c_char_p, ctypes.c_int32)
kvc_ggml_block_size = optional_proto("kvc_ggml_block_size", _i64, ctypes.c_int32)
kvc_ggml_block_bytes = optional_proto("kvc_ggml_block_bytes", _i64, ctypes.c_int32)
kvc_ggml_dequantize = optional_proto("kvc_ggml_dequantize", _c_int, ctypes.c_int32, _vp, _i64,
                                     _vp)
kvc_gguf_open = optional_proto("kvc_gguf_open", _c_int, _CSTR, ctypes.POINTER(_vp))
kvc_gguf_open_memory = optional_proto("kvc_gguf_open_memory", _c_int, _vp, ctypes.c_size_t,
                                      ctypes.POINTER(_vp))
kvc_gguf_close = optional_proto("kvc_gguf_close", None, _vp)
kvc_gguf_version = optional_proto("kvc_gguf_version", ctypes.c_uint32, _vp)
kvc_gguf_alignment = optional_proto("kvc_gguf_alignment", ctypes.c_uint32, _vp)
kvc_gguf_n_kv = optional_proto("kvc_gguf_n_kv", _i64, _vp)
kvc_gguf_find_key = optional_proto("kvc_gguf_find_key", _i64, _vp, _CSTR)
kvc_gguf_key = optional_proto("kvc_gguf_key", ctypes.c_char_p, _vp, _i64)
kvc_gguf_kv_type = optional_proto("kvc_gguf_kv_type", _c_int, _vp, _i64, _IP, _IP, _I64P)
kvc_gguf_get_i64 = optional_proto("kvc_gguf_get_i64", _c_int, _vp, _CSTR, _I64P)
kvc_gguf_get_u64 = optional_proto("kvc_gguf_get_u64", _c_int, _vp, _CSTR,
                                  ctypes.POINTER(ctypes.c_uint64))
kvc_gguf_get_f64 = optional_proto("kvc_gguf_get_f64", _c_int, _vp, _CSTR,
                                  ctypes.POINTER(ctypes.c_double))
kvc_gguf_get_str = optional_proto("kvc_gguf_get_str", _c_int, _vp, _CSTR, _STRP, _SZP)
kvc_gguf_get_arr = optional_proto("kvc_gguf_get_arr", _c_int, _vp, _CSTR, _IP, _I64P,
                                  ctypes.POINTER(_vp))
kvc_gguf_get_arr_str = optional_proto("kvc_gguf_get_arr_str", _c_int, _vp, _CSTR, _i64, _STRP,
                                      _SZP)
kvc_gguf_n_tensors = optional_proto("kvc_gguf_n_tensors", _i64, _vp)
kvc_gguf_find_tensor = optional_proto("kvc_gguf_find_tensor", _i64, _vp, _CSTR)
kvc_gguf_get_tensor = optional_proto("kvc_gguf_get_tensor", _c_int, _vp, _i64,
                                     ctypes.POINTER(_CTensor))


def _ggml_type(t) -> int | None:
    """t as a C int, or None when no ggml type can have it."""
    try:
        v = _lib.int32_attr(t, "ggml type")
    except _lib.InvalidArgumentError:
        return None
    return v


def ggml_type_name(t: int) -> str | None:
    v = _ggml_type(t)
    name = kvc_ggml_type_name(v) if v is not None else None
    return name.decode() if name else None


def ggml_block_size(t: int) -> int:
    v = _ggml_type(t)
    return int(kvc_ggml_block_size(v)) if v is not None else 0


def ggml_block_bytes(t: int) -> int:
    v = _ggml_type(t)
    return int(kvc_ggml_block_bytes(v)) if v is not None else 0


def ggml_dequantize(data, t, n: int | None = None) -> np.ndarray:
    """n elements of ggml type t (a code, e.g. 12 for Q4_K) decoded from the
    raw blocks in data (bytes-like or a uint8 array) to float32 by the C
    library (kvc_ggml_dequantize: bitwise ggml's float32 dequantization).
    n defaults to all the elements data holds. InvalidArgumentError for an
    unknown type or a size that is not whole blocks, UnsupportedError for a
    type the library does not decode."""
    v = _ggml_type(t)
    if v is None:
        raise InvalidArgumentError(f"ggml type {t!r} is not an int32")
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    bs, bb = ggml_block_size(v), ggml_block_bytes(v)
    if n is None:
        if bb == 0 or raw.size % bb:
            raise InvalidArgumentError(f"{raw.size} bytes are not whole blocks of ggml type {t}")
        n = raw.size // bb * bs
    try:
        n = operator.index(n)
    except TypeError as exc:
        raise InvalidArgumentError(f"n must be an integer, got {n!r}") from exc
    if not -(2**63) <= n < 2**63:
        raise InvalidArgumentError(f"n = {n} does not fit in int64")
    if bs and n >= 0 and n % bs == 0 and n // bs * bb > raw.size:
        raise InvalidArgumentError(f"{n} elements need {n // bs * bb} bytes, data has {raw.size}")
    out = np.empty(max(n, 0), np.float32)
    check(kvc_ggml_dequantize(v, raw.ctypes.data if raw.size else None, n,
                              out.ctypes.data if out.size else None))
    return out


def _bytes_at(ptr: int | None, n: int) -> bytes:
    return ctypes.string_at(ptr, n) if n else b""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """A tensor of an open GGUFFile. ne: dims innermost first; shape: numpy
    order (ne reversed). raw() copies the stored bytes."""

    file: GGUFFile
    index: int
    name: str
    type: int
    n_dims: int
    ne: tuple[int, ...]
    size: int
    data_ptr: int  # address inside the file's mapping (valid while it is open)

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.type) or str(self.type)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    def raw(self) -> bytes:
        with self.file._life.use():  # the mapping stays while the bytes are copied
            return _bytes_at(self.data_ptr, self.size)


def _name(b: bytes) -> str:
    """A key or tensor name as str: invalid UTF-8 bytes become lone
    surrogates (surrogateescape), so names stay distinct and _name_bytes
    gives the file's bytes back for lookups."""
    return b.decode("utf-8", "surrogateescape")


def _name_bytes(name: str) -> bytes:
    if not isinstance(name, str):
        raise InvalidArgumentError(f"a key or tensor name must be a str, got "
                                   f"{type(name).__name__}")
    return name.encode("utf-8", "surrogateescape")


def _in_use(method):
    """Runs the method inside a use of the file (close() waits for it)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._life.use():
            return method(self, *args, **kwargs)

    return wrapper


class GGUFFile(NoCopy):
    """A GGUF file opened (mmapped and validated) by the C reader; or an
    in-memory image (bytes), which is copied and kept alive with the handle.
    Errors are raised as kvcache exceptions (CorruptError, UnsupportedError,
    KvcacheIOError) carrying the C message. Threads may share one; close()
    waits for the calls running in others."""

    def __init__(self, source: str | os.PathLike | bytes | bytearray | memoryview):
        self._h = None
        self._life = Lifetime("GGUFFile")
        self._buf = None
        h = ctypes.c_void_p()
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            self._buf = ctypes.create_string_buffer(data, len(data)) if data else None
            ptr = ctypes.addressof(self._buf) if self._buf is not None else None
            check(kvc_gguf_open_memory(ptr, len(data), ctypes.byref(h)))
        else:
            check(kvc_gguf_open(os.fsencode(source), ctypes.byref(h)))
        self._h = h.value
        self._metadata = None
        self._tensors = None

    # -- lifetime ------------------------------------------------------------
    def close(self) -> None:
        if self._life.close() and self._h:
            kvc_gguf_close(self._h)
            self._h = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    def _check_open(self) -> None:
        if not self._h:
            raise InvalidArgumentError("GGUFFile is closed")
    # -- header ----------------------------------------------------------------
    @property
    @_in_use
    def version(self) -> int:
        self._check_open()
        return int(kvc_gguf_version(self._h))

    @property
    @_in_use
    def alignment(self) -> int:
        self._check_open()
        return int(kvc_gguf_alignment(self._h))

    # -- key-values --------------------------------------------------------------
    @_in_use
    def keys(self) -> list[str]:
        self._check_open()
        return [_name(kvc_gguf_key(self._h, i)) for i in range(kvc_gguf_n_kv(self._h))]

    @_in_use
    def kv_type(self, key: str) -> tuple[int, int, int]:
        """(value type, element type, count) of key (scalars: (t, t, 1))."""
        self._check_open()
        i = kvc_gguf_find_key(self._h, _name_bytes(key))
        if i < 0:
            raise KeyError(key)
        t, et, n = ctypes.c_int(), ctypes.c_int(), ctypes.c_int64()
        check(kvc_gguf_kv_type(self._h, i, ctypes.byref(t), ctypes.byref(et), ctypes.byref(n)))
        return t.value, et.value, n.value

    @_in_use
    def get(self, key: str):
        """Value of key as a Python object (see the module doc); KeyError if absent."""
        t, et, n = self.kv_type(key)
        k = _name_bytes(key)
        h = self._h
        if t == STRING:
            s, ln = ctypes.c_void_p(), ctypes.c_size_t()
            check(kvc_gguf_get_str(h, k, ctypes.byref(s), ctypes.byref(ln)))
            return _bytes_at(s.value, ln.value).decode("utf-8", "replace")
        if t in (FLOAT32, FLOAT64):
            d = ctypes.c_double()
            check(kvc_gguf_get_f64(h, k, ctypes.byref(d)))
            return d.value
        if t == ARRAY:
            if et == STRING:
                out = []
                s, ln = ctypes.c_void_p(), ctypes.c_size_t()
                for i in range(n):
                    check(kvc_gguf_get_arr_str(h, k, i, ctypes.byref(s), ctypes.byref(ln)))
                    out.append(_bytes_at(s.value, ln.value).decode("utf-8", "replace"))
                return out
            if et == ARRAY:
                return None
            data = ctypes.c_void_p()
            check(kvc_gguf_get_arr(h, k, None, None, ctypes.byref(data)))
            dt = np.dtype(_NUMPY[et])
            return np.frombuffer(_bytes_at(data.value, n * dt.itemsize), dtype=dt).copy()
        if t == UINT64:  # all 64 bits (a double would round those above 2**53)
            u = ctypes.c_uint64()
            check(kvc_gguf_get_u64(h, k, ctypes.byref(u)))
            return u.value
        v = ctypes.c_int64()
        check(kvc_gguf_get_i64(h, k, ctypes.byref(v)))
        return bool(v.value) if t == BOOL else v.value

    @property
    @_in_use
    def metadata(self) -> dict:
        """All key-values, in file order (computed once)."""
        if self._metadata is None:
            self._metadata = {k: self.get(k) for k in self.keys()}
        return self._metadata

    # -- tensors -------------------------------------------------------------------
    def _tensor_at(self, i: int) -> GGUFTensor:
        ct = _CTensor()
        check(kvc_gguf_get_tensor(self._h, i, ctypes.byref(ct)))
        ne = tuple(int(ct.ne[d]) for d in range(ct.n_dims))
        return GGUFTensor(self, i, _name(ct.name), int(ct.type),
                          int(ct.n_dims), ne, int(ct.size), int(ct.data))

    @property
    @_in_use
    def tensors(self) -> list[GGUFTensor]:
        self._check_open()
        if self._tensors is None:
            self._tensors = [self._tensor_at(i) for i in range(kvc_gguf_n_tensors(self._h))]
        return self._tensors

    @_in_use
    def tensor(self, name: str) -> GGUFTensor:
        self._check_open()
        i = kvc_gguf_find_tensor(self._h, _name_bytes(name))
        if i < 0:
            raise KeyError(name)
        return self.tensors[i]


_ = _lib  # the library handle is loaded by _lib
