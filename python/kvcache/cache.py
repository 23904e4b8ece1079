"""Cache manager: a pool of KV pages shared by all layers, sequences with page
tables, copy-on-write forks and prefix caching (include/kvcache/cache.h).

:class:`PagedKVCache` owns the K/V storage of every layer; it only reserves
slots and keeps page tables. K/V are written with
:func:`kvcache.append_paged_kv_cache` (or the pmx operators) into the
writable numpy views returned by :meth:`PagedKVCache.kv_cache`, addressed by
the positions that :meth:`~PagedKVCache.add_sequence` /
:meth:`~PagedKVCache.append` reserve and the page tables of
:meth:`~PagedKVCache.page_table`::

    pc = kvcache.PagedKVCache(num_layers=2, num_kv_heads=4, head_dim=64,
                              page_size=16, num_pages=256)
    seq, n_cached = pc.add_sequence(prompt_ids)      # slots 0..len-1
    rows = np.arange(n_cached, len(prompt_ids))      # only these need K/V
    indptr, indices, last = pc.page_table([seq])
    for layer in range(2):
        kvcache.append_paged_kv_cache(k[layer][rows], v[layer][rows],
                                      np.zeros(len(rows), np.int32), rows,
                                      pc.kv_cache(layer), indices, indptr, last)
    pos = pc.append(seq, [next_id])                  # one decode slot

Storage per layer is FlashInfer's combined paged cache: ``(num_pages, 2,
page_size, H, Dh)`` for ``kv_layout="NHD"``, ``(num_pages, 2, H, page_size,
Dh)`` for ``"HND"`` (index 0 of the ``2`` axis is K, 1 is V); int8 storage is
int8, int4 storage is uint8 with last dimension ``Dh / 2`` (element ``2i`` in
the low nibble), bfloat16 is ``ml_dtypes.bfloat16``. int8/int4 caches also
have scales (:meth:`PagedKVCache.kv_scale`), the same shape with last
dimension ``Dh / quant_group``. One page id names the same slots in every
layer.

Lifetime: the views returned by :meth:`~PagedKVCache.kv_cache` and
:meth:`~PagedKVCache.kv_scale` are never copies; each holds a reference to
the cache (through its ``base``), so the storage stays valid for as long as
any view is alive. :meth:`~PagedKVCache.close` (also called by ``with`` and
when the object is collected) makes the cache refuse every further call at
once, but the C cache and its storage are destroyed only when the last view
is gone as well: a view never dangles. Without live views, ``close()``
frees the storage immediately.

Errors: failing calls change nothing and raise :class:`kvcache.NoSpaceError`
(out of pages), :class:`kvcache.NotFoundError` (unknown or freed sequence
id), :class:`kvcache.InvalidArgumentError` (bad arguments, or a closed cache)
or :class:`kvcache.CorruptError` (:meth:`~PagedKVCache.check`). A
``PagedKVCache`` serializes its own calls with a lock, so it may be shared
between threads (the C object is not thread-safe by itself).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import operator
import threading

import numpy as np

from . import _lib
from .errors import InternalError, InvalidArgumentError
from .paged import _layout_code

__all__ = ["PagedKVCache", "salt_hash"]

_DTYPE_NAMES = {
    _lib.KVC_F32: "float32",
    _lib.KVC_F16: "float16",
    _lib.KVC_BF16: "bfloat16",
    _lib.KVC_I8: "int8",
    _lib.KVC_I4: "int4",
}
_QUANT_CODES = (_lib.KVC_I8, _lib.KVC_I4)
_INT64_MAX = 2**63 - 1


def _dtype_code(dtype, name: str, allowed) -> int:
    """kvc_dtype code of a storage/scale dtype given by name or numpy dtype."""
    if isinstance(dtype, str):
        code = _lib.dtype_alias(dtype, name)  # FlashInfer's names ("float", "half", ...) too
    else:
        try:
            code = _lib.dtype_code(np.dtype(dtype))
        except TypeError:
            code = None
    if code is None or code not in allowed:
        names = ", ".join(repr(_DTYPE_NAMES[c]) for c in allowed)
        raise InvalidArgumentError(f"{name} must be one of {names}, got {dtype!r}")
    return code


def _int(value, name: str, lo: int = 0, hi: int = _INT64_MAX) -> int:
    """A Python int in [lo, hi] (anything operator.index accepts)."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError as exc:
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}") from exc
    if not lo <= v <= hi:
        raise InvalidArgumentError(f"{name} = {v} is outside [{lo}, {hi}]")
    return v


def _seq_id(seq_id) -> int:
    """A sequence id as an int64 (ids are >= 0; negative ones are passed to C,
    which reports them as unknown)."""
    return _int(seq_id, "seq_id", -(2**63), _INT64_MAX)


def salt_hash(salt) -> int:
    """The 64-bit salt passed to C for a salt argument.

    ``None`` -> 0; an int in ``[0, 2**64)`` -> itself; ``str`` (UTF-8) or
    bytes-like -> the little-endian value of its 8-byte BLAKE2b digest
    (``hashlib.blake2b(data, digest_size=8)``), deterministic across runs
    and processes.
    """
    if salt is None:
        return 0
    if isinstance(salt, str):
        salt = salt.encode("utf-8")
    if isinstance(salt, (bytes, bytearray, memoryview)):
        digest = hashlib.blake2b(bytes(salt), digest_size=8).digest()
        return int.from_bytes(digest, "little")
    return _int(salt, "salt", 0, 2**64 - 1)


def _i32p(arr):
    """A pointer to an int32 array's first element (arr.ctypes.data_as,
    without building numpy's ctypes helper object)."""
    if arr is None:
        return None
    return ctypes.byref(ctypes.c_int32.from_address(_lib.data_ptr(arr)))


def _i64p(arr):
    return ctypes.byref(ctypes.c_int64.from_address(_lib.data_ptr(arr)))


def _token_ids(x, name: str):
    """(n_tokens, int32 token-id array or None) for an int count or a 1-D
    sequence of token ids."""
    if x is None:
        return 0, None
    if not isinstance(x, (np.ndarray, list, tuple)) or (isinstance(x, np.ndarray)
                                                       and x.ndim == 0):
        try:
            n = operator.index(x)
        except TypeError:
            pass
        else:
            return _int(n, name), None
    ids = _lib.int32_array(x, name)
    if ids.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-D token ids, got shape {ids.shape}")
    return ids.shape[0], ids


def _seq_ids(seq_ids) -> np.ndarray:
    arr = _lib.int64_array(seq_ids, "seq_ids")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"seq_ids must be 1-D, got shape {arr.shape}")
    return arr


class _Handle(_lib.NoCopy):
    """Owns the kvc_cache pointer; destroys it when the last reference (the
    PagedKVCache or any view of its storage) goes away."""

    __slots__ = ("__weakref__", "ptr")

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self):
        ptr, self.ptr = self.ptr, None
        if ptr:
            with contextlib.suppress(Exception):  # interpreter shutdown
                _lib.kvc_cache_destroy(ptr)


class _Memory:
    """A byte range of the cache's storage exposed through
    ``__array_interface__``; the numpy arrays built on it keep it (and so the
    cache and its handle) alive through their ``base``."""

    __slots__ = ("__array_interface__", "cache", "handle")

    def __init__(self, address: int, nbytes: int, cache, handle):
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),  # writable
            "version": 3,
        }
        self.cache = cache
        self.handle = handle


_NP_DTYPES = {
    _lib.KVC_F32: np.dtype(np.float32),
    _lib.KVC_F16: np.dtype(np.float16),
    _lib.KVC_I8: np.dtype(np.int8),
    _lib.KVC_U8: np.dtype(np.uint8),  # compressed formats' pages
}
_KV_FORMATS = {"none": 0, "kivi8": 1, "kivi4": 2}  # kvc_kv_format


def _kv_format_code(kv_format) -> int:
    if kv_format is None:
        return 0
    code = _KV_FORMATS.get(kv_format.strip().lower()) if isinstance(kv_format, str) else None
    if code is None:
        raise InvalidArgumentError(f"kv_format must be None, 'kivi8' or 'kivi4', got "
                                   f"{kv_format!r}")
    return code


def _tensor_dtype(code: int) -> np.dtype:
    if code == _lib.KVC_BF16:
        return _lib.resolve_dtype("bfloat16")  # InvalidArgumentError without ml_dtypes
    if code == _lib.KVC_I4:
        return np.dtype(np.uint8)
    dt = _NP_DTYPES.get(code)
    if dt is None:
        raise InternalError(f"kvc_cache_layer_tensors returned dtype code {code}")
    return dt


def _view(t: _lib.Tensor, cache, handle) -> np.ndarray:
    """A writable numpy array over the memory a kvc_tensor describes (int4 as
    uint8 with the last dimension halved)."""
    if not t.data:
        raise InternalError("kvc_cache_layer_tensors returned a NULL tensor")
    dtype = _tensor_dtype(t.dtype)
    nd = t.ndim
    shape = [int(t.shape[d]) for d in range(nd)]
    if t.dtype == _lib.KVC_I4:
        if shape[-1] % 2 or any(t.stride[d] % 2 for d in range(nd - 1)):
            raise InternalError("kvc_cache_layer_tensors returned an odd int4 shape/stride")
        shape[-1] //= 2
        strides = [int(t.stride[d]) // 2 for d in range(nd - 1)] + [1]
    else:
        strides = [int(t.stride[d]) * dtype.itemsize for d in range(nd)]
    if any(s < 0 for s in strides):
        raise InternalError("kvc_cache_layer_tensors returned negative strides")
    if 0 in shape:
        nbytes = 0
    else:
        nbytes = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + dtype.itemsize
    raw = np.asarray(_Memory(t.data, nbytes, cache, handle))
    return np.ndarray(tuple(shape), dtype=dtype, buffer=raw, offset=0, strides=tuple(strides))


class PagedKVCache(_lib.NoCopy):
    """A multi-layer paged KV cache with sequences, forks and prefix caching.

    Args:
        num_layers, num_kv_heads, head_dim, page_size: ints >= 1 (head_dim
            even for int4).
        num_pages: pages in the pool (> 0), or None to derive it from
            max_bytes.
        dtype: storage: "float32", "float16", "bfloat16", "int8" or "int4"
            (or a numpy dtype for the first four; FlashInfer's "float" and
            "half" and the short forms of _lib.DTYPE_ALIASES are accepted).
        kv_layout: "NHD" or "HND".
        enable_prefix_caching: look up / register full pages by their token
            ids (needs token ids in add_sequence/append).
        quant_group: int8/int4 only: group size dividing head_dim (even for
            int4).
        scale_dtype: int8/int4 only: "float16" (default) or "float32".
        max_bytes: storage budget (data + scales, all layers) when num_pages
            is None.
        kv_format: None (a per-token cache of dtype) or a compressed paged
            format, "kivi8" or "kivi4" (docs/KV_FORMATS.md): dtype,
            scale_dtype, quant_group and kv_layout are then ignored, storage
            is :meth:`kvfmt_pages` per layer, each sequence has a float16
            tail per layer (:meth:`tail`), prefix hits come in whole K
            groups and truncate may refuse a cut inside a quantized group
            (:meth:`truncate_ex`).

    Raises:
        InvalidArgumentError: a bad parameter (or both/neither of num_pages
            and max_bytes, or a budget below one page).
        OutOfMemoryError: the storage could not be allocated.
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, page_size, num_pages=None,
                 dtype="float16", kv_layout="NHD", enable_prefix_caching=True, quant_group=8,
                 *, scale_dtype="float16", max_bytes=None, kv_format=None):
        self._handle = None
        self._lock = threading.Lock()
        self._table_capacity = 64  # page ids a page table's first C call has room for
        p = _lib.kvc_cache_default_params()
        p.num_layers = _lib.int32_attr(num_layers, "num_layers")
        p.num_kv_heads = _lib.int32_attr(num_kv_heads, "num_kv_heads")
        p.head_dim = _lib.int32_attr(head_dim, "head_dim")
        p.page_size = _lib.int32_attr(page_size, "page_size")
        if (num_pages is None) == (max_bytes is None):
            raise InvalidArgumentError("give exactly one of num_pages and max_bytes")
        if num_pages is not None:
            p.num_pages = _int(num_pages, "num_pages", 1)
            p.max_bytes = 0
        else:
            p.num_pages = 0
            p.max_bytes = _int(max_bytes, "max_bytes", 1)
        p.dtype = _dtype_code(dtype, "dtype", tuple(_DTYPE_NAMES))
        p.scale_dtype = _dtype_code(scale_dtype, "scale_dtype", (_lib.KVC_F32, _lib.KVC_F16))
        p.quant_group = _lib.int32_attr(quant_group, "quant_group")
        p.layout = _layout_code(kv_layout)
        p.enable_prefix_caching = 1 if enable_prefix_caching else 0
        p.kv_format = _kv_format_code(kv_format)
        ptr = ctypes.c_void_p()
        _lib.check(_lib.kvc_cache_create(ctypes.byref(p), ctypes.byref(ptr)))
        if not ptr.value:
            raise InternalError("kvc_cache_create returned OK and a NULL cache")
        self._handle = _Handle(ptr.value)
        self._num_layers = p.num_layers
        self._num_kv_heads = p.num_kv_heads
        self._head_dim = p.head_dim
        self._page_size = p.page_size
        self._dtype = _DTYPE_NAMES[p.dtype]
        self._scale_dtype = _DTYPE_NAMES[p.scale_dtype] if p.dtype in _QUANT_CODES else None
        self._quant_group = p.quant_group if p.dtype in _QUANT_CODES else None
        self._kv_layout = "NHD" if p.layout == _lib.KVC_NHD else "HND"
        self._prefix_caching = bool(p.enable_prefix_caching)
        self._num_pages = int(_lib.kvc_cache_num_pages(ptr.value))
        self._capacity = int(_lib.kvc_cache_capacity_tokens(ptr.value))
        self._bytes_per_token = int(_lib.kvc_cache_bytes_per_token(ptr.value))
        self._kv_format = None
        self._group = None
        if p.kv_format:
            fmt = _lib.Kvfmt()
            _lib.check(_lib.kvc_cache_kvfmt(ptr.value, ctypes.byref(fmt)))
            self._kv_format = next(k for k, v in _KV_FORMATS.items() if v == p.kv_format)
            self._group = int(fmt.group)
            self._dtype = None  # no per-token storage dtype
            self._scale_dtype = None
            self._quant_group = None

    # -- lifetime -----------------------------------------------------------

    def _ptr(self) -> int:
        h = self._handle
        if h is None:
            raise InvalidArgumentError("PagedKVCache is closed")
        return h.ptr

    def _call(self, fn, *args) -> None:
        with self._lock:
            _lib.check(fn(self._ptr(), *args))

    def close(self) -> None:
        """Closes the cache: every later call raises InvalidArgumentError.
        The storage is freed now, or when the last kv_cache/kv_scale view
        is collected if some are still alive. Idempotent."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return
        with lock:
            self._handle = None  # _Handle.__del__ destroys once unreferenced

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __enter__(self):
        self._ptr()
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"num_pages={self._num_pages}"
        return (f"PagedKVCache(num_layers={self._num_layers}, num_kv_heads={self._num_kv_heads}, "
                f"head_dim={self._head_dim}, page_size={self._page_size}, {state}, "
                f"dtype={self._dtype!r}, kv_layout={self._kv_layout!r})")

    # -- properties ---------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_kv_heads(self) -> int:
        return self._num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def capacity_tokens(self) -> int:
        """num_pages * page_size."""
        return self._capacity

    @property
    def bytes_per_token(self) -> int:
        """Bytes of storage (data + scales, all layers) per token slot."""
        return self._bytes_per_token

    @property
    def dtype(self) -> str:
        """Storage dtype name: "float32", "float16", "bfloat16", "int8", "int4"."""
        return self._dtype

    @property
    def scale_dtype(self) -> str | None:
        """"float16"/"float32" for int8/int4 storage, else None."""
        return self._scale_dtype

    @property
    def quant_group(self) -> int | None:
        """Quantization group for int8/int4 storage, else None."""
        return self._quant_group

    @property
    def kv_layout(self) -> str:
        return self._kv_layout

    @property
    def kv_format(self) -> str | None:
        """"kivi8"/"kivi4" for a compressed-format cache, else None."""
        return self._kv_format

    @property
    def kv_group(self) -> int | None:
        """Tokens per K group (G) of a compressed format, else None."""
        return self._group

    @property
    def enable_prefix_caching(self) -> bool:
        return self._prefix_caching

    # -- sequences ----------------------------------------------------------

    def add_sequence(self, token_ids=None, salt=None) -> tuple[int, int]:
        """Creates a sequence holding a prompt and reserves its slots
        (positions ``0 .. n-1``).

        Args:
            token_ids: the prompt's token ids (1-D ints, int32 range), or an
                int n to reserve n slots without ids (nothing is then looked
                up or registered in the prefix cache), or None for an empty
                sequence.
            salt: separates tenants/adapters in the prefix cache: None (0), an
                int in [0, 2**64), or str/bytes hashed by :func:`salt_hash`.

        Returns:
            (seq_id, num_cached_tokens): the leading tokens found in the
            prefix cache (whole pages within the first n - 1 tokens), whose
            K/V are already stored and must not be written again.

        Raises:
            NoSpaceError: not enough pages; InvalidArgumentError: more tokens
                than the whole capacity. Nothing changes.
        """
        n, ids = _token_ids(token_ids, "token_ids")
        s = salt_hash(salt)
        seq = ctypes.c_int64(-1)
        cached = ctypes.c_int64(0)
        self._call(_lib.kvc_cache_add_sequence, _i32p(ids), n, s, ctypes.byref(seq),
                   ctypes.byref(cached))
        return seq.value, cached.value

    def lookup_prefix(self, token_ids, salt=None) -> int:
        """How many leading tokens of a prompt add_sequence would find in the
        prefix cache now (whole pages within the first n - 1 tokens), without
        reserving anything: an engine's probe before admitting a request.

        Args:
            token_ids: the prompt's token ids (1-D ints, int32 range).
            salt: as add_sequence's.
        """
        n, ids = _token_ids(token_ids, "token_ids")
        if ids is None:
            raise InvalidArgumentError("lookup_prefix needs token ids, not a count")
        hit = ctypes.c_int64(0)
        with self._lock:
            _lib.check(_lib.kvc_cache_lookup_prefix(self._ptr(), _i32p(ids), n,
                                                    salt_hash(salt), ctypes.byref(hit)))
        return hit.value

    def append(self, seq_id, n_or_token_ids) -> np.ndarray:
        """Reserves slots for new tokens at the end of a sequence.

        Args:
            seq_id: the sequence.
            n_or_token_ids: an int n (slots without token ids) or the new
                tokens' ids (1-D ints; pages they fill are registered in the
                prefix cache).

        Returns:
            int32 (n): the positions of the reserved slots (the old length
            and up), to pass to append_paged_kv_cache with page_table([seq]).

        Raises:
            NoSpaceError: not enough free or cached pages; NotFoundError: no
                such sequence; InvalidArgumentError: the new length would pass
                the whole capacity (it can never fit). Nothing changes.
        """
        sid = _seq_id(seq_id)
        n, ids = _token_ids(n_or_token_ids, "n_or_token_ids")
        if n > self._capacity:
            # cannot fit; let C report it without allocating a huge output
            self._call(_lib.kvc_cache_append, sid, _i32p(ids), n, None)
            raise InternalError(f"kvc_cache_append reserved {n} slots in a cache of "
                                f"{self._capacity}")
        positions = np.empty(n, np.int32)
        self._call(_lib.kvc_cache_append, sid, _i32p(ids), n, _i32p(positions))
        return positions

    def fork(self, seq_id) -> int:
        """A new sequence sharing every page of seq_id (copy on write).
        Returns its id."""
        child = ctypes.c_int64(-1)
        self._call(_lib.kvc_cache_fork, _seq_id(seq_id), ctypes.byref(child))
        return child.value

    def truncate(self, seq_id, n_tokens) -> None:
        """Keeps the first n_tokens (0 <= n_tokens <= seq_len) of a sequence."""
        self._call(_lib.kvc_cache_truncate, _seq_id(seq_id), _int(n_tokens, "n_tokens"))

    def truncate_ex(self, seq_id, n_tokens) -> int:
        """truncate keeping at most n_tokens; returns the length kept. In a
        compressed-format cache a cut inside a quantized K group keeps only
        the whole groups before it (the caller recomputes and appends the
        rest), where truncate raises InvalidArgumentError; otherwise the
        same as truncate."""
        kept = ctypes.c_int64(-1)
        self._call(_lib.kvc_cache_truncate_ex, _seq_id(seq_id), _int(n_tokens, "n_tokens"),
                   ctypes.byref(kept))
        return kept.value

    def rollback(self, seq_id, n_tokens) -> None:
        """truncate for slots that were reserved but whose K/V were never
        written (the step that would have written them did not run). Pages
        are findable from the moment their slots are reserved; here the
        dropped pages this sequence holds alone leave the prefix index
        instead of staying findable without their K/V."""
        self._call(_lib.kvc_cache_rollback, _seq_id(seq_id), _int(n_tokens, "n_tokens"))

    def free(self, seq_id) -> None:
        """Releases a sequence (its full pages stay findable while cached)."""
        self._call(_lib.kvc_cache_free_sequence, _seq_id(seq_id))

    def seq_len(self, seq_id) -> int:
        """Number of tokens (reserved slots) of a sequence."""
        n = ctypes.c_int64(0)
        self._call(_lib.kvc_cache_seq_len, _seq_id(seq_id), ctypes.byref(n))
        return n.value

    def _table_locked(self, ptr: int, seqs: np.ndarray):
        """(kv_indptr, kv_indices (at least the total), kv_last_page_len,
        total) of seqs; the caller holds self._lock, so no append comes
        between sizing the table and filling it. One C call sizes and fills
        it when the indices fit the capacity the last tables needed; if not,
        C reports the total it needs (KVC_ERR_INVALID_ARG with the total in
        *n_indices, nothing written) and a second call fills an array of
        that size. (Sizing by a kvc_cache_seq_len per sequence cost a ctypes
        call per request.)"""
        b = seqs.shape[0]
        indptr = np.empty(b + 1, np.int32)
        last = np.empty(b, np.int32)
        n = ctypes.c_int64(-1)
        cap = self._table_capacity
        indices = np.empty(cap, np.int32)
        status = _lib.kvc_cache_page_table(ptr, _i64p(seqs), b, _i32p(indptr), _i32p(indices),
                                           cap, _i32p(last), ctypes.byref(n))
        if status and n.value > cap:  # too small; n.value is the total
            cap = n.value
            self._table_capacity = max(64, 1 << (cap - 1).bit_length())
            indices = np.empty(cap, np.int32)
            n.value = -1
            status = _lib.kvc_cache_page_table(ptr, _i64p(seqs), b, _i32p(indptr),
                                               _i32p(indices), cap, _i32p(last),
                                               ctypes.byref(n))
            if not status and n.value != cap:
                raise InternalError(f"kvc_cache_page_table wrote {n.value} indices, expected "
                                    f"{cap}")
        _lib.check(status)
        return indptr, indices, last, n.value

    # -- page tables --------------------------------------------------------

    def page_table(self, seq_ids):
        """FlashInfer CSR page table of a batch of sequences.

        Args:
            seq_ids: 1-D ints (an int is a batch of one).

        Returns:
            (kv_indptr (B+1), kv_indices (kv_indptr[B]), kv_last_page_len
            (B)), int32. Note append_paged_kv_cache takes them in
            FlashInfer's order (kv_indices, kv_indptr, kv_last_page_len).
        """
        seqs = _seq_ids(seq_ids)
        with self._lock:
            indptr, indices, last, total = self._table_locked(self._ptr(), seqs)
        return indptr, indices[:total].copy(), last

    def cachestarts(self, seq_ids, max_pages=None) -> np.ndarray:
        """pmx page-mode table: int64 (B, max_pages), ``page id * page_size``
        of each page of each sequence, -1 after its last page.

        max_pages: columns; None = the most pages of any sequence (at least
        1). Must be >= the pages of every sequence and <= num_pages.
        """
        seqs = _seq_ids(seq_ids)
        if max_pages is not None:
            max_pages = _int(max_pages, "max_pages", 0, max(self._num_pages, 1))
        with self._lock:
            ptr = self._ptr()
            if max_pages is None:
                indptr = self._table_locked(ptr, seqs)[0]
                max_p = max(1, int(np.diff(indptr).max())) if seqs.shape[0] else 1
            else:
                max_p = max_pages
            out = np.empty((seqs.shape[0], max_p), np.int64)
            _lib.check(_lib.kvc_cache_cachestarts(ptr, _i64p(seqs), seqs.shape[0], _i64p(out),
                                                  max_p))
        return out

    # -- storage ------------------------------------------------------------

    def _layer_tensors(self, layer):
        layer = _lib.int32_attr(layer, "layer")
        kv = _lib.Tensor()
        scale = _lib.Tensor()
        with self._lock:
            ptr = self._ptr()
            _lib.check(_lib.kvc_cache_layer_tensors(ptr, layer, ctypes.byref(kv),
                                                    ctypes.byref(scale)))
            return kv, scale, self._handle

    def kv_cache(self, layer) -> np.ndarray:
        """Layer ``layer``'s storage as a writable numpy view (no copy):
        ``(num_pages, 2, page_size, H, Dh)`` NHD or ``(num_pages, 2, H,
        page_size, Dh)`` HND; float32/float16/bfloat16/int8, or uint8 with
        last dimension Dh / 2 for int4. Valid while it is alive (it keeps the
        storage alive, even past close())."""
        kv, _scale, handle = self._layer_tensors(layer)
        return _view(kv, self, handle)

    def kv_scale(self, layer) -> np.ndarray | None:
        """Layer ``layer``'s scales (int8/int4 storage) as a writable numpy
        view of kv_cache's shape with last dimension Dh / quant_group; None
        for float storage (so it can always be passed as kv_scale=)."""
        _kv, scale, handle = self._layer_tensors(layer)
        if self._dtype not in ("int8", "int4"):
            return None
        return _view(scale, self, handle)

    def kvfmt_pages(self, layer) -> np.ndarray:
        """A compressed-format cache's pages of layer ``layer``: a writable
        uint8 view ``(num_pages, page_bytes)`` (no copy; it keeps the
        storage alive, as kv_cache's views do)."""
        layer = _lib.int32_attr(layer, "layer")
        t = _lib.Tensor()
        with self._lock:
            _lib.check(_lib.kvc_cache_kvfmt_layer(self._ptr(), layer, ctypes.byref(t)))
            handle = self._handle
        return _view(t, self, handle)

    def tail(self, seq_id, layer) -> np.ndarray:
        """A copy of a sequence's float16 tail in layer ``layer``, ``(2, G,
        H, Dh)``: K then V of its positions not yet in a complete K group,
        slot ``t % G`` holding position t. A copy, since the tail goes with
        the sequence (a view would dangle after free)."""
        layer = _lib.int32_attr(layer, "layer")
        seqs = np.array([_seq_id(seq_id)], np.int64)
        out = _lib.KvfmtSeq()
        with self._lock:
            _lib.check(_lib.kvc_cache_kvfmt_seqs(self._ptr(), layer, _i64p(seqs), 1,
                                                 ctypes.byref(out)))
            shape = (2, self._group, self._num_kv_heads, self._head_dim)
            n = int(np.prod(shape)) * 2
            return np.frombuffer(ctypes.string_at(out.tail, n), np.float16).reshape(shape)

    def sink(self, seq_id, layer):
        """A copy of a sequence's sink rows in layer ``layer``, ``(2, S, H,
        Dh)`` float16 (K then V of positions ``[0, S)``; kivi4: S = 1), kept
        with its first page and shared with every sequence that shares that
        page; None for a format without them or a sequence with no tokens."""
        layer = _lib.int32_attr(layer, "layer")
        seqs = np.array([_seq_id(seq_id)], np.int64)
        out = _lib.KvfmtSeq()
        fmt = _lib.Kvfmt()
        with self._lock:
            _lib.check(_lib.kvc_cache_kvfmt(self._ptr(), ctypes.byref(fmt)))
            _lib.check(_lib.kvc_cache_kvfmt_seqs(self._ptr(), layer, _i64p(seqs), 1,
                                                 ctypes.byref(out)))
            if not out.sink:
                return None
            shape = (2, fmt.sink, self._num_kv_heads, self._head_dim)
            n = int(np.prod(shape)) * 2
            return np.frombuffer(ctypes.string_at(out.sink, n), np.float16).reshape(shape)

    # -- pages and the KV store -------------------------------------------------

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers: what read_page / write_page
        move and a KV store object's payload (kvc_cache_page_bytes; a first
        page's object also carries its sink rows, sink_bytes)."""
        with self._lock:
            return int(_lib.kvc_cache_page_bytes(self._ptr()))

    @property
    def sink_bytes(self) -> int:
        """Bytes of a first page's sink rows over all layers ((L, 2, S, H, Dh)
        float16; 0 for a cache without them) (kvc_cache_sink_bytes)."""
        with self._lock:
            return int(_lib.kvc_cache_sink_bytes(self._ptr()))

    def read_sink(self, page_id) -> np.ndarray:
        """A copy of first page ``page_id``'s sink rows, uint8 (sink_bytes,)
        (kvc_cache_read_sink); InvalidArgumentError for a page that holds none."""
        return self._read_bytes(page_id, _lib.kvc_cache_sink_bytes, _lib.kvc_cache_read_sink)

    def _read_bytes(self, page_id, size_fn, read_fn) -> np.ndarray:
        pid = _lib.int32_attr(page_id, "page_id")
        with self._lock:
            ptr = self._ptr()
            out = np.empty(int(size_fn(ptr)), np.uint8)
            _lib.check(read_fn(ptr, pid, out.ctypes.data, out.size))
        return out

    def read_page(self, page_id) -> np.ndarray:
        """A copy of page ``page_id``'s bytes (every layer's data block and,
        for int8/int4, scale block): uint8 (page_bytes,)
        (kvc_cache_read_page)."""
        return self._read_bytes(page_id, _lib.kvc_cache_page_bytes, _lib.kvc_cache_read_page)

    def write_page(self, page_id, data) -> None:
        """Overwrites page ``page_id`` with ``data`` (page_bytes bytes, as
        read_page gives them; bytes or a uint8 array). Only a page held by
        exactly one sequence may be written (kvc_cache_write_page)."""
        pid = _lib.int32_attr(page_id, "page_id")
        if isinstance(data, (bytes, bytearray, memoryview)):
            buf = np.frombuffer(bytes(data), np.uint8)
        else:
            arr = _lib.as_array(data, "data")
            if arr.dtype not in (np.uint8, np.int8):  # bytes, not values to reinterpret
                raise InvalidArgumentError(f"data must be bytes or a uint8 array, got {arr.dtype}")
            buf = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        with self._lock:
            _lib.check(_lib.kvc_cache_write_page(self._ptr(), pid, buf.ctypes.data, buf.size))

    def page_tokens(self, page_id) -> np.ndarray | None:
        """The token ids (page_size, int32) of a page in the prefix index,
        or None when it is not findable (not full, never registered, or
        prefix caching off) (kvc_cache_page_tokens)."""
        pid = _lib.int32_attr(page_id, "page_id")
        out = np.empty(self._page_size, np.int32)
        with self._lock:
            st = _lib.kvc_cache_page_tokens(self._ptr(), pid, _i32p(out))
        if st == -4:  # KVC_ERR_NOT_FOUND
            _lib.kvc_clear_error()
            return None
        _lib.check(st)
        return out

    def _seq_pages(self, seq_id) -> np.ndarray:
        """The page ids of one sequence, in order."""
        _indptr, indices, _last = self.page_table([_seq_id(seq_id)])
        return indices

    def save_to_store(self, store, ns, seq_id, tokens, first_page=0, n_pages=None) -> int:
        """Queues pages [first_page, first_page + n_pages) of sequence
        ``seq_id`` to a :class:`kvcache.KVStore` under namespace ``ns``
        (kvc_store_save_run). ``tokens`` are the sequence's ids from
        position 0 (at least (first_page + n_pages) * page_size); n_pages
        None: every whole page of tokens the sequence holds from first_page.
        The caller vouches that those pages hold the K/V of those tokens
        (written, and for a compressed format their K groups complete).
        Returns the number of pages queued: all of them, or none and an
        error (writes never wait: a queue without room for the whole run
        raises :class:`kvcache.NoSpaceError`, the pages counted dropped in
        the store's stats)."""
        from .store import _tokens

        t = _tokens(tokens)
        pages = self._seq_pages(seq_id)
        fp = _int(first_page, "first_page")
        whole = min(t.size // self._page_size, pages.size)
        n = max(whole - fp, 0) if n_pages is None else _int(n_pages, "n_pages")
        if fp + n > pages.size:
            raise InvalidArgumentError(f"pages [{fp}, {fp + n}) but sequence {seq_id} holds "
                                       f"{pages.size} pages")
        if n == 0:
            return 0
        store.save_run(self, ns, t[:(fp + n) * self._page_size], fp, n, pages[fp:fp + n])
        return n

    def restore_from_store(self, store, ns, seq_id, tokens, first_page=0, max_pages=None) -> int:
        """Restores the run of pages [first_page, first_page + max_pages) of
        ``tokens`` that a :class:`kvcache.KVStore` holds under ``ns`` and
        that verify, into the pages sequence ``seq_id`` reserved for them
        (kvc_store_restore_run; e.g. just after add_sequence(tokens)); each
        page must be held by this sequence alone. max_pages None: every
        whole page of tokens the sequence holds from first_page. Returns
        the run's length; the caller computes the K/V of the rest (or rolls
        it back: pages reserved are findable in the prefix index)."""
        from .store import _tokens

        t = _tokens(tokens)
        pages = self._seq_pages(seq_id)
        fp = _int(first_page, "first_page")
        whole = min(t.size // self._page_size, pages.size)
        n = max(whole - fp, 0) if max_pages is None else _int(max_pages, "max_pages")
        if fp + n > pages.size:
            raise InvalidArgumentError(f"pages [{fp}, {fp + n}) but sequence {seq_id} holds "
                                       f"{pages.size} pages")
        if n == 0:
            return 0
        return store.restore_run(self, ns, t[:(fp + n) * self._page_size], fp, n,
                                 pages[fp:fp + n])

    # -- introspection ------------------------------------------------------

    def stats(self) -> dict:
        """Counters: free_pages, cached_pages, used_pages (pages by state) and
        hit_tokens, miss_tokens, evictions, cow_copies, failed_allocs."""
        st = _lib.CacheStats()
        self._call(_lib.kvc_cache_get_stats, ctypes.byref(st))
        return {name: int(getattr(st, name)) for name, _t in _lib.CacheStats._fields_}

    def check(self) -> None:
        """Verifies every invariant of the C cache; raises CorruptError
        naming the first broken one."""
        self._call(_lib.kvc_cache_check)
