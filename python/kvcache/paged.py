"""FlashInfer-compatible paged KV caches (SEMANTICS section 4).

The functions mirror ``flashinfer.page`` (same names and argument order) on
numpy arrays, plus conversions between FlashInfer's CSR page tables and the
pmx page-mode ``cachestarts`` table.

Paged cache forms (index 0 of the ``2`` axis is K, 1 is V):

- ``kv_layout="NHD"``: one array ``(max_pages, 2, page_size, H, Dh)`` or a
  tuple ``(k_cache, v_cache)`` of ``(max_pages, page_size, H, Dh)`` arrays;
- ``kv_layout="HND"``: ``(max_pages, 2, H, page_size, Dh)`` or a tuple of
  ``(max_pages, H, page_size, Dh)``;
- with ``page_size`` 1 the page axis may be left out, as FlashInfer allows:
  ``(max_pages, 2, H, Dh)`` or a tuple of ``(max_pages, H, Dh)`` (either
  layout; int8/int4 scales likewise).

Storage dtypes: float32, float16, ``ml_dtypes.bfloat16`` (inputs converted,
round to nearest even), int8, and int4 given as a **uint8** array whose last
dimension is ``Dh / 2`` bytes (element ``2i`` in the low nibble). int8/int4
caches need ``kv_scale`` for float inputs (int8 rows into an int8 cache are a
plain copy): float32 or float16 scales of the cache's shape with
last dimension ``Dh / quant_group``, in the same form as the cache (one array
for a combined cache, a ``(k_scale, v_scale)`` tuple for a tuple); inputs are
quantized per SEMANTICS section 1.

Page tables are CSR, int32, for a batch of ``B`` requests:
``kv_indptr (B+1)`` (starts at 0, non-decreasing), ``kv_indices
(kv_indptr[B])`` (page ids in ``[0, max_pages)``) and ``kv_last_page_len
(B)`` (``1..page_size`` for a request with pages, 0 for an empty one).
Request ``b`` holds ``page_size * (pages_b - 1) + kv_last_page_len[b]``
tokens. Unlike FlashInfer, every function validates the tables it reads.

Caches and scales are updated in place and never copied: they must be
writeable numpy arrays with a contiguous last dimension (page, row and head
strides are free, so slices of larger arrays work; K and V may have different
strides). Index inputs may be any integer array-likes: they are converted to
int32 (copied if needed); non-integer data and values outside int32 are
refused. Every argument is validated before anything is written: a failing
call raises :class:`kvcache.InvalidArgumentError` and leaves caches and
scales unchanged.

``num_threads=None`` (or ``n_threads=None``) runs on as many threads as the
CPUs the process may use (its affinity mask); results are bitwise identical
for any thread count and any ISA.
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import _lib
from .errors import InvalidArgumentError

__all__ = [
    "append_paged_kv_cache",
    "append_paged_mla_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
    "page_table_to_pmx",
    "pmx_to_page_table",
]

_APPEND_CODES = (_lib.KVC_F32, _lib.KVC_F16, _lib.KVC_BF16, _lib.KVC_I8)
_U8 = np.dtype(np.uint8)
_QUANT_CACHE_DTYPES = (np.dtype(np.int8), _U8)


def _ref(t):
    return ctypes.byref(t) if t is not None else None


_LAYOUT_NAMES = {"NHD": _lib.KVC_NHD, "HND": _lib.KVC_HND}


def _layout_code(kv_layout) -> int:
    if type(kv_layout) is str:
        code = _LAYOUT_NAMES.get(kv_layout)  # the usual spelling, as it is
        if code is not None:
            return code
    if isinstance(kv_layout, str):
        key = kv_layout.strip().upper()
        if key == "NHD":
            return _lib.KVC_NHD
        if key == "HND":
            return _lib.KVC_HND
    raise InvalidArgumentError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")


def _cache_tensor(arr, name: str, writable: bool = True):
    """(array, tensor) for an in-place cache; uint8 means packed int4."""
    return _lib.inplace_tensor(arr, name, writable,
                               int4=isinstance(arr, np.ndarray) and arr.dtype == _U8)


def _scale_tensor(arr, name: str, writable: bool = True):
    return _lib.inplace_tensor(arr, name, writable)


def _is_pair(x) -> bool:
    return isinstance(x, (tuple, list))


# A combined cache's PagedCache by what decides it and its checks:
# (cache dtype, shape, strides, data pointer, the same for kv_scale or None,
# layout, quant_group, quantizing, writable) -> PagedCache. Everything the
# checks of the general path look at is in the key except the flags a
# caller can change on the array itself (aligned, writeable), which a hit
# still reads; and kvc_paged_cache_from_combined reads only the tensors'
# descriptions, never the data, so a hit is what it would return. The key
# holds data pointers and the caller's arrays are alive for the call, so the
# views are valid. Only successes are kept; errors are raised each time.
_COMBINED: dict = {}
_COMBINED_MAX = 1024


def _flags_ok(a, writable: bool) -> bool:
    f = a.flags
    return f.aligned and (not writable or f.writeable)


def _unsqueeze_page(x, layout, ndim: int):
    """FlashInfer's _expand_5d / _expand_4d: with page_size 1 the page axis
    may be left out, a combined cache (max_pages, 2, H, Dh) or a K/V array
    (max_pages, H, Dh) (any layout). x itself unless it is a numpy array
    with ndim - 1 dimensions; then a view with the size-1 page axis put back
    where the layout has it (NHD: before H, HND: after H), so writes reach
    x."""
    if isinstance(x, np.ndarray) and x.ndim == ndim - 1:
        return np.expand_dims(x, -3 if layout == _lib.KVC_NHD else -2)
    return x


def _paged_cache(paged_kv_cache, kv_scale, layout, quant_group, quantizing,
                 writable: bool = True):
    """kvc_paged_cache for the cache/scale arguments of append_paged_kv_cache,
    plus the arrays it points into (kept alive by the caller). layout: a
    kvc_kv_layout code (_layout_code); quant_group: checked by int32_attr;
    quantizing: the inputs are floats (so an int8/int4 cache needs scales);
    writable False for readers (attention), which accept read-only arrays.
    A reader gets a PagedCache it must not modify (C takes it as const).
    Page size 1 caches (and scales) may leave the page axis out, as
    FlashInfer allows (_unsqueeze_page)."""
    if isinstance(paged_kv_cache, np.ndarray):
        if paged_kv_cache.ndim == 4:
            paged_kv_cache = _unsqueeze_page(paged_kv_cache, layout, 5)
            kv_scale = _unsqueeze_page(kv_scale, layout, 5)
    elif _is_pair(paged_kv_cache) and len(paged_kv_cache) == 2 and any(
            isinstance(a, np.ndarray) and a.ndim == 3 for a in paged_kv_cache):
        paged_kv_cache = tuple(_unsqueeze_page(a, layout, 4) for a in paged_kv_cache)
        if _is_pair(kv_scale) and len(kv_scale) == 2:
            kv_scale = tuple(_unsqueeze_page(a, layout, 4) for a in kv_scale)
    key = None
    if isinstance(paged_kv_cache, np.ndarray) and (
            kv_scale is None or isinstance(kv_scale, np.ndarray)):
        c = paged_kv_cache
        sk = None if kv_scale is None else (kv_scale.dtype, kv_scale.shape, kv_scale.strides,
                                            _lib.data_ptr(kv_scale))
        key = (c.dtype, c.shape, c.strides, _lib.data_ptr(c), sk, layout, quant_group,
               quantizing, writable)
        pc = _COMBINED.get(key)
        if pc is not None and _flags_ok(c, writable) and (
                kv_scale is None or _flags_ok(kv_scale, writable)):
            keep = [c] if kv_scale is None else [c, kv_scale]
            # a writer gets its own copy (C's parameter is not const)
            return (_lib.PagedCache.from_buffer_copy(pc) if writable else pc), keep
    keep = []
    if isinstance(paged_kv_cache, np.ndarray):
        cache, cache_t = _cache_tensor(paged_kv_cache, "paged_kv_cache", writable)
        keep.append(cache)
        _check_scale_presence((cache.dtype,), kv_scale, quantizing)
        scale_t = None
        if kv_scale is not None:
            if _is_pair(kv_scale):
                raise InvalidArgumentError(
                    "kv_scale must mirror paged_kv_cache: one combined scale array for a "
                    "combined cache, got a pair")
            scale, scale_t = _scale_tensor(kv_scale, "kv_scale", writable)
            keep.append(scale)
        pc = _lib.PagedCache()
        _lib.check(_lib.kvc_paged_cache_from_combined(
            ctypes.byref(cache_t), _ref(scale_t), layout, quant_group, ctypes.byref(pc)))
        if key is not None:
            if len(_COMBINED) >= _COMBINED_MAX:
                _COMBINED.clear()
            _COMBINED[key] = _lib.PagedCache.from_buffer_copy(pc)
        return pc, keep
    if _is_pair(paged_kv_cache):
        if len(paged_kv_cache) != 2:
            raise InvalidArgumentError(
                f"paged_kv_cache must be one array or a (k_cache, v_cache) pair, got a "
                f"sequence of {len(paged_kv_cache)}")
        k, k_t = _cache_tensor(paged_kv_cache[0], "paged_kv_cache[0] (k_cache)", writable)
        v, v_t = _cache_tensor(paged_kv_cache[1], "paged_kv_cache[1] (v_cache)", writable)
        keep += [k, v]
        _check_scale_presence((k.dtype, v.dtype), kv_scale, quantizing)
        pc = _lib.PagedCache()
        pc.k, pc.v = k_t, v_t
        if kv_scale is not None:
            if not _is_pair(kv_scale) or len(kv_scale) != 2:
                raise InvalidArgumentError(
                    "kv_scale must mirror paged_kv_cache: a (k_scale, v_scale) pair for a "
                    "(k_cache, v_cache) pair")
            ks, ks_t = _scale_tensor(kv_scale[0], "kv_scale[0] (k_scale)", writable)
            vs, vs_t = _scale_tensor(kv_scale[1], "kv_scale[1] (v_scale)", writable)
            keep += [ks, vs]
            pc.k_scale, pc.v_scale = ks_t, vs_t
        pc.layout = layout
        pc.quant_group = quant_group
        return pc, keep
    raise InvalidArgumentError(
        f"paged_kv_cache must be a numpy.ndarray or a (k_cache, v_cache) pair of them, got "
        f"{type(paged_kv_cache).__name__}")


def _check_scale_presence(cache_dtypes, kv_scale, quantizing) -> None:
    quantized = False
    for dt in cache_dtypes:
        if dt in _QUANT_CACHE_DTYPES:
            quantized = True
    if quantized and quantizing and kv_scale is None:
        kind = "int4 (uint8)" if any(dt == _U8 for dt in cache_dtypes) else "int8"
        raise InvalidArgumentError(f"an {kind} paged cache needs kv_scale (float32 or float16 "
                                   f"scales, last dimension Dh / quant_group)")
    if not quantized and kv_scale is not None:
        raise InvalidArgumentError(
            f"kv_scale is only for int8/int4 caches; this cache is {cache_dtypes[0]}")


# ---------------------------------------------------------------------------
# Page-table helpers


def get_seq_lens(kv_indptr, kv_last_page_len, page_size) -> np.ndarray:
    """Sequence lengths of a CSR page table.

    Args:
        kv_indptr: (B+1) ints, starts at 0, non-decreasing.
        kv_last_page_len: (B) ints, 1..page_size for a request with pages, 0
            for an empty one.
        page_size: int >= 1.

    Returns:
        int32 (B): ``page_size * (pages_b - 1) + kv_last_page_len[b]`` (0 for
        an empty request), with ``pages_b = kv_indptr[b+1] - kv_indptr[b]``.
    """
    page_size = _lib.int32_attr(page_size, "page_size")
    indptr = _lib.int32_array(kv_indptr, "kv_indptr")
    last = _lib.int32_array(kv_last_page_len, "kv_last_page_len")
    out = np.empty(last.shape[0] if last.ndim == 1 else 0, np.int32)
    ts = [_lib.make_tensor(a) for a in (indptr, last, out)]
    _lib.check(_lib.kvc_get_seq_lens(ctypes.byref(ts[0]), ctypes.byref(ts[1]), page_size,
                                     ctypes.byref(ts[2])))
    return out


def _index_out(buf, name: str, nnz: int):
    """A caller's output buffer for get_batch_indices_positions: an int32
    numpy array of shape (nnz,), writeable (FlashInfer checks shape, dtype
    and device the same way)."""
    if buf is None:
        return None
    if not isinstance(buf, np.ndarray):
        raise InvalidArgumentError(f"get_batch_indices_positions: {name} must be a numpy "
                                   f"array (int32, ({nnz},)) or None, got "
                                   f"{type(buf).__name__}")
    if buf.dtype != np.int32 or buf.shape != (nnz,):
        raise InvalidArgumentError(f"get_batch_indices_positions: {name} is {buf.dtype} "
                                   f"{buf.shape}; this call writes int32 ({nnz},)")
    if not buf.flags.writeable:
        raise InvalidArgumentError(f"get_batch_indices_positions: {name} is read-only")
    return buf


def get_batch_indices_positions(append_indptr, seq_lens, nnz, batch_indices=None,
                                positions=None):
    """Maps the rows of a ragged append to (request, position).

    Args:
        append_indptr: (B+1) ints, starts at 0, non-decreasing: rows
            ``[append_indptr[b], append_indptr[b+1])`` are request b's new
            tokens.
        seq_lens: (B) ints, each request's length *including* the appended
            tokens (so ``append_indptr[b+1] - append_indptr[b] <= seq_lens[b]``).
        nnz: int, the number of rows, ``append_indptr[B]``.
        batch_indices, positions: optional pre-allocated outputs
            (FlashInfer's), writeable int32 numpy arrays of shape (nnz,);
            written (only when the call succeeds) and returned.

    Returns:
        (batch_indices, positions), int32 (nnz) each: for row j of request b,
        ``batch_indices[j] = b`` and
        ``positions[j] = seq_lens[b] - (append_indptr[b+1] - j)``.

    Example (FlashInfer's): append_indptr [0, 1, 3, 6, 10] and seq_lens
    [5, 5, 5, 5] give positions [4, 3, 4, 2, 3, 4, 1, 2, 3, 4].
    """
    indptr = _lib.int32_array(append_indptr, "append_indptr")
    lens = _lib.int32_array(seq_lens, "seq_lens")
    if indptr.ndim != 1 or indptr.size == 0:
        raise InvalidArgumentError(f"get_batch_indices_positions: append_indptr must be 1-D "
                                   f"(B+1), got shape {indptr.shape}")
    nnz_arr = _lib.scalar_int64(nnz, "nnz")
    n = int(nnz_arr)
    total = int(indptr[-1]) if indptr.ndim == 1 and indptr.size else 0
    if n != total:
        raise InvalidArgumentError(
            f"get_batch_indices_positions: nnz = {n} but append_indptr[B] = {total}")
    out_bi = _index_out(batch_indices, "batch_indices", n)
    out_pos = _index_out(positions, "positions", n)
    if out_bi is not None and out_pos is not None and np.shares_memory(out_bi, out_pos):
        raise InvalidArgumentError("get_batch_indices_positions: batch_indices and positions "
                                   "must not share memory")
    bi = np.empty(n, np.int32)
    pos = np.empty(n, np.int32)
    ts = [_lib.make_tensor(a) for a in (indptr, lens, bi, pos)]
    _lib.check(_lib.kvc_get_batch_indices_positions(
        ctypes.byref(ts[0]), ctypes.byref(ts[1]), n, ctypes.byref(ts[2]), ctypes.byref(ts[3])))
    if out_bi is not None:
        np.copyto(out_bi, bi)
        bi = out_bi
    if out_pos is not None:
        np.copyto(out_pos, pos)
        pos = out_pos
    return bi, pos


# ---------------------------------------------------------------------------
# Appends


def _append_tables(batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len):
    """The appends' index arrays as int32: (arrays to keep alive, their
    kvc_tensors in the order given)."""
    i32 = _lib.int32_tensor  # straight-line: a per-call hot path
    bi, bi_t = i32(batch_indices, "batch_indices")
    pos, pos_t = i32(positions, "positions")
    ind, ind_t = i32(kv_indices, "kv_indices")
    ptr, ptr_t = i32(kv_indptr, "kv_indptr")
    last, last_t = i32(kv_last_page_len, "kv_last_page_len")
    return (bi, pos, ind, ptr, last), (bi_t, pos_t, ind_t, ptr_t, last_t)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD",
                          kv_scale=None, quant_group=8, n_threads=None, *,
                          num_threads=None, kv_format=None) -> None:
    """Writes ragged new K/V rows into a paged cache (flashinfer.append_paged_kv_cache).

    Row j goes to page ``kv_indices[kv_indptr[b] + positions[j] // page_size]``,
    slot ``positions[j] % page_size``, of request ``b = batch_indices[j]``, for
    K and V. The page table must already include the appended tokens (use
    :func:`get_batch_indices_positions` to build batch_indices/positions).

    Args:
        append_key, append_value: (nnz, H, Dh), same dtype: float32, float16
            or bfloat16 (an int8 cache also takes int8 rows, copied as they
            are). Row and head strides are free.
        batch_indices, positions: (nnz) ints: request in ``[0, B)`` and
            position in ``[0, seq_len_b)`` of each row.
        paged_kv_cache: one array ``(max_pages, 2, page_size, H, Dh)`` (NHD) /
            ``(max_pages, 2, H, page_size, Dh)`` (HND), or a ``(k_cache,
            v_cache)`` pair of ``(max_pages, page_size, H, Dh)`` /
            ``(max_pages, H, page_size, Dh)`` arrays; float32, float16,
            bfloat16, int8, or uint8 with last dimension Dh/2 for int4.
            Updated in place.
        kv_indices: (kv_indptr[B]) ints, page ids in ``[0, max_pages)``.
        kv_indptr: (B+1) ints.
        kv_last_page_len: (B) ints.
        kv_layout: "NHD" or "HND".
        kv_scale: int8/int4 caches only (required there for float inputs;
            optional and untouched for an int8 copy): float32 or float16
            scales of the cache's shape with last dimension Dh/quant_group,
            one array for a combined cache or a ``(k_scale, v_scale)`` pair
            for a pair. Updated in place.
        quant_group: int8/int4 caches only: group size dividing Dh (even for
            int4).
        num_threads: worker threads (None: all CPUs); n_threads is the same.
        kv_format: "kivi8" or "kivi4" for a compressed-format cache
            (docs/KV_FORMATS.md): paged_kv_cache is then a ``(pages, tails)``
            pair (kivi8) or ``(pages, tails, sinks)`` triple (kivi4, which
            keeps position 0 in float16), pages uint8 (max_pages, page_bytes),
            tails float16 (B, 2, G, H, Dh) and sinks float16 (B, 2, S, H, Dh),
            all updated in place; each request's rows
            must be its last positions in order (as get_batch_indices_positions
            makes them); kv_layout, kv_scale and quant_group do not apply.

    Raises:
        InvalidArgumentError: bad page table, batch index or position out of
            range, shape/dtype mismatch, missing kv_scale, NaN/Inf into an
            int8/int4 cache (or, with float16 scales, a value of magnitude
            65520 * qmax or more, whose scale would overflow). Nothing is
            written then. If two rows name the same slot, which one is
            stored is unspecified.
    """
    from . import kvfmt as _kvfmt  # here: kvfmt imports attention, which imports this module

    if kv_format is not None or _kvfmt.is_compressed_cache(paged_kv_cache):
        _append_compressed(append_key, append_value, batch_indices, positions, paged_kv_cache,
                           kv_indices, kv_indptr, kv_last_page_len, kv_format,
                           _lib.threads_arg(num_threads, n_threads))
        return
    ak, ak_t = _lib.input_tensor(append_key, "append_key", _APPEND_CODES)
    av, av_t = _lib.input_tensor(append_value, "append_value", _APPEND_CODES)
    quantizing = ak_t.dtype in _lib.FLOAT_CODES  # the tensor's dtype is ak's kvc_dtype
    pc, keep = _paged_cache(paged_kv_cache, kv_scale, _layout_code(kv_layout),
                            _lib.int32_attr(quant_group, "quant_group"), quantizing)
    br = ctypes.byref
    rows, (bi_t, pos_t, ind_t, ptr_t, last_t) = _append_tables(
        batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len)
    _lib.call_pooled(
        _lib.kvc_append_paged_kv_cache,
        (br(ak_t), br(av_t), br(bi_t), br(pos_t), br(pc), br(ind_t), br(ptr_t), br(last_t)),
        _lib.threads_arg(num_threads, n_threads))
    del keep, ak, av, rows


def _append_compressed(append_key, append_value, batch_indices, positions, paged_kv_cache,
                       kv_indices, kv_indptr, kv_last_page_len, kv_format, num_threads):
    from . import kvfmt as _kvfmt

    if not _kvfmt.is_compressed_cache(paged_kv_cache):
        raise InvalidArgumentError("kv_format: paged_kv_cache must be a (pages, tails) pair "
                                   "(kivi8) or (pages, tails, sinks) triple (kivi4): uint8 "
                                   "(max_pages, page_bytes), float16 (B, 2, G, H, Dh), float16 "
                                   "(B, 2, S, H, Dh)")
    if kv_format is None:
        raise InvalidArgumentError("a (pages, tails) cache needs kv_format='kivi8' or 'kivi4'")
    pages, tails = paged_kv_cache[:2]
    H, Dh = int(tails.shape[3]), int(tails.shape[4])
    last = _lib.int64_array(kv_last_page_len, "kv_last_page_len").reshape(-1)
    ip = _lib.int64_array(kv_indptr, "kv_indptr").reshape(-1)
    # page_size: from the format's page bytes (a member's pages have P * bytes/token)
    P = _kvfmt.page_size_of(kv_format, H, Dh, int(pages.shape[1]))
    fmt = _kvfmt.KVFormat.member(kv_format, H, Dh, P)
    _, _, sinks = _kvfmt.cache_parts(fmt, paged_kv_cache)
    seqs = _kvfmt.seqs_from_table(fmt, tails, ip, kv_indices, last, sinks)
    bi = _lib.int64_array(batch_indices, "batch_indices").reshape(-1)
    pos = _lib.int64_array(positions, "positions").reshape(-1)
    nnz = bi.shape[0]
    if pos.shape != (nnz,):
        raise InvalidArgumentError(f"positions must be ({nnz},), got {pos.shape}")
    B = len(seqs)
    if nnz and (bi.min() < 0 or bi.max() >= B):
        raise InvalidArgumentError(f"batch_indices must lie in [0, {B})")
    if nnz and np.any(np.diff(bi) < 0):
        raise InvalidArgumentError("a compressed cache takes each request's rows together, "
                                   "requests in order (batch_indices non-decreasing)")
    counts = np.bincount(bi, minlength=B) if nnz else np.zeros(B, np.int64)
    indptr = np.zeros(B + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    for b in range(B):
        want = np.arange(seqs[b].n_kv - counts[b], seqs[b].n_kv)
        if not np.array_equal(pos[indptr[b]:indptr[b + 1]], want):
            raise InvalidArgumentError(f"request {b}: a compressed cache stores a request's "
                                       f"last positions in order, here {want[:1]}.."
                                       f"{want[-1:]} (positions {pos[indptr[b]:indptr[b + 1]]})")
    _kvfmt.append(fmt, pages, seqs, indptr, append_key, append_value, num_threads=num_threads)


def append_paged_mla_kv_cache(append_ckv, append_kpe, batch_indices, positions, ckv_cache,
                              kpe_cache, kv_indices, kv_indptr, kv_last_page_len,
                              n_threads=None, *, num_threads=None) -> None:
    """Writes ragged new MLA rows into paged caches (flashinfer.append_paged_mla_kv_cache).

    Same addressing and page-table rules as :func:`append_paged_kv_cache`,
    without a head axis; any D_ckv / D_kpe (DeepSeek: 512 / 64).

    Args:
        append_ckv: (nnz, D_ckv) float32, float16 or bfloat16.
        append_kpe: (nnz, D_kpe) float32, float16 or bfloat16.
        batch_indices, positions: (nnz) ints.
        ckv_cache: (max_pages, page_size, D_ckv) float32/float16/bfloat16,
            updated in place.
        kpe_cache: (max_pages, page_size, D_kpe) float32/float16/bfloat16
            (its dtype may differ from ckv_cache's), updated in place. The
            two may be slices of one (max_pages, page_size, D_ckv + D_kpe)
            array.
        kv_indices, kv_indptr, kv_last_page_len: the CSR page table.
        num_threads: worker threads (None: all CPUs); n_threads is the same.

    Raises:
        InvalidArgumentError: as append_paged_kv_cache; nothing is written.
    """
    ckv, ckv_t = _cache_tensor(ckv_cache, "ckv_cache")
    kpe, kpe_t = _cache_tensor(kpe_cache, "kpe_cache")
    ac, ac_t = _lib.input_tensor(append_ckv, "append_ckv", _lib.FLOAT_CODES)
    ap, ap_t = _lib.input_tensor(append_kpe, "append_kpe", _lib.FLOAT_CODES)
    br = ctypes.byref
    rows, (bi_t, pos_t, ind_t, ptr_t, last_t) = _append_tables(
        batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len)
    _lib.call_pooled(
        _lib.kvc_append_paged_mla_kv_cache,
        (br(ac_t), br(ap_t), br(bi_t), br(pos_t), br(ckv_t), br(kpe_t), br(ind_t), br(ptr_t),
         br(last_t)),
        _lib.threads_arg(num_threads, n_threads))
    del ckv, kpe, ac, ap, rows


# ---------------------------------------------------------------------------
# pmx page-mode tables


def page_table_to_pmx(kv_indptr, kv_indices, page_size, max_pages_per_seq=None) -> np.ndarray:
    """CSR page table -> pmx page-mode ``cachestarts`` (cache_mode 1).

    Args:
        kv_indptr: (B+1) ints; kv_indices: (kv_indptr[B]) ints >= 0.
        page_size: int >= 1.
        max_pages_per_seq: columns of the result (MaxP); None: the largest
            number of pages of a request, at least 1.

    Returns:
        int64 (B, MaxP): ``cachestarts[b, j] = kv_indices[kv_indptr[b] + j] *
        page_size`` for ``j < pages_b``, -1 after. When the K and V page
        arrays are NHD and back to back in one buffer ``(2, max_pages,
        page_size, H, Dh)``, that buffer viewed as ``(1, 2, max_pages *
        page_size, H, Dh)`` is a pmx cache_layout 2 cache with num_layer 1
        that :func:`kvcache.pmx.dynamic_key_value_cache` reads with these
        cachestarts (cache_mode=1, same page_size).
    """
    page_size = _lib.int32_attr(page_size, "page_size")
    indptr = _lib.int32_array(kv_indptr, "kv_indptr")
    indices = _lib.int32_array(kv_indices, "kv_indices")
    b = indptr.shape[0] - 1 if indptr.ndim == 1 and indptr.size else 0
    if max_pages_per_seq is None:
        most = int(np.diff(indptr.astype(np.int64)).max()) if b > 0 else 0
        # Never more than there are indices: a larger value means a bad table,
        # which C reports; this only keeps the allocation bounded.
        max_p = max(1, min(most, indices.size))
    else:
        max_p = _lib.int32_attr(max_pages_per_seq, "max_pages_per_seq")
        if max_p < 0:
            raise InvalidArgumentError(f"max_pages_per_seq must be >= 0, got {max_p}")
    out = np.empty((b, max_p), np.int64)
    ts = [_lib.make_tensor(a) for a in (indptr, indices, out)]
    _lib.check(_lib.kvc_page_table_to_pmx(ctypes.byref(ts[0]), ctypes.byref(ts[1]), page_size,
                                          ctypes.byref(ts[2])))
    return out


def pmx_to_page_table(cachestarts, seq_lens, page_size):
    """pmx page-mode ``cachestarts`` -> CSR page table.

    Args:
        cachestarts: (B, MaxP) ints: token offset of each page start of
            request b; the first ``ceil(seq_lens[b] / page_size)`` entries
            must be non-negative multiples of page_size (the rest are
            ignored, typically -1).
        seq_lens: (B) ints, tokens of each request.
        page_size: int >= 1.

    Returns:
        (kv_indptr (B+1), kv_indices (kv_indptr[B]), kv_last_page_len (B)),
        all int32, with ``kv_indices = cachestarts / page_size`` per used
        entry.
    """
    page_size = _lib.int32_attr(page_size, "page_size")
    cst = _lib.int64_array(cachestarts, "cachestarts")
    lens = _lib.int64_array(seq_lens, "seq_lens")
    b = cst.shape[0] if cst.ndim >= 1 else 0
    indptr = np.empty(b + 1, np.int32)
    indices = np.empty(cst.size, np.int32)
    last = np.empty(b, np.int32)
    n = ctypes.c_int64(0)
    ts = [_lib.make_tensor(a) for a in (cst, lens, indptr, indices, last)]
    _lib.check(_lib.kvc_pmx_to_page_table(
        ctypes.byref(ts[0]), ctypes.byref(ts[1]), page_size, ctypes.byref(ts[2]),
        ctypes.byref(ts[3]), ctypes.byref(ts[4]), ctypes.byref(n)))
    return indptr, indices[:n.value].copy(), last
