"""Bit packing for attention masks (SEMANTICS sections 4 and 5), FlashInfer's
names and numpy's ``packbits`` semantics.

* ``packbits(x, bitorder="big")``: x flattened, every element read for its
  truth value (nonzero = 1), eight per byte, the last byte zero-padded. "big"
  puts element 0 in bit 7, "little" in bit 0.
* ``segment_packbits(x, indptr, bitorder="big")``: each segment
  ``x[indptr[i]:indptr[i+1]]`` packed on its own and padded to a byte; the
  returned indptr counts bytes.
* ``build_packed_custom_mask``: the packed custom-mask layout of a batch,
  request b's ``(qo_len_b, kv_len_b)`` mask row-major, packed little-endian,
  padded to a byte, concatenated; bit ``q * kv_len + k`` at byte offset
  ``mask_indptr[b]`` is 1 to keep, 0 to mask.
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import _lib
from .errors import InternalError, InvalidArgumentError

__all__ = ["build_packed_custom_mask", "packbits", "segment_packbits"]

_BIG, _LITTLE = 0, 1  # kvc_bitorder
_ORDERS = {"big": _BIG, "little": _LITTLE}

_TP = ctypes.POINTER(_lib.Tensor)
_i64 = ctypes.c_int64
_vp = ctypes.c_void_p

# optional_proto: importing kvcache still works against an older libkvcache
# without these symbols; calling them then raises UnsupportedError.
kvc_packbits = _lib.optional_proto("kvc_packbits", ctypes.c_int, _vp, _i64, ctypes.c_int, _vp)
kvc_segment_packbits = _lib.optional_proto(
    "kvc_segment_packbits", ctypes.c_int, _vp, _TP, ctypes.c_int, _vp, _i64, _TP)
kvc_build_packed_custom_mask = _lib.optional_proto(
    "kvc_build_packed_custom_mask", ctypes.c_int, _vp, _TP, _TP, _vp, _i64, _TP)

_INT32_MAX = np.iinfo(np.int32).max


def _bitorder(bitorder) -> int:
    code = _ORDERS.get(bitorder) if isinstance(bitorder, str) else None
    if code is None:
        raise InvalidArgumentError(f"bitorder must be 'big' or 'little', got {bitorder!r}")
    return code


def _truth_bytes(x, name: str) -> np.ndarray:
    """x flattened to one byte per element, nonzero where the element is true.

    bool, uint8 and int8 data are passed as they are (no copy unless the array
    is not contiguous); other numeric dtypes are compared with 0 (NaN is true,
    as in numpy) and object arrays use each element's truth value."""
    arr = _lib.as_array(x, name)
    kind = arr.dtype.kind
    if arr.dtype.itemsize == 1 and kind in "biu":
        flat = arr.reshape(-1)  # a view whenever the data are contiguous
    elif kind in "iufc":
        flat = np.not_equal(arr, 0).reshape(-1)
    elif kind == "O":
        try:
            flat = arr.astype(bool).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{name}: elements have no truth value: {exc}") from exc
    else:
        raise InvalidArgumentError(f"{name}: expected boolean or numeric data, got dtype "
                                   f"{arr.dtype}")
    flat = np.ascontiguousarray(flat)
    return flat.view(np.uint8)


def _index_array(x, name: str, keep_int64: bool) -> np.ndarray:
    """A contiguous 1-D int32 index array (int64 when keep_int64 and x is an
    int64 array; a Python list counts as int32), refusing values that do not
    fit."""
    given_int64 = isinstance(x, np.ndarray) and x.dtype == np.int64
    arr = _lib.as_array(x, name)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-D (B+1,), got shape {arr.shape}")
    if keep_int64 and given_int64:
        return np.ascontiguousarray(arr)
    arr = _lib.int64_array(arr, name)
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > _INT32_MAX):
        raise InvalidArgumentError(f"{name} has values outside int32")
    return arr.astype(np.int32)


def _c_rejects(status: int, what: str) -> None:
    """For argument errors the binding leaves to C: raise C's error."""
    _lib.check(status)
    raise InternalError(f"{what}: the C library accepted invalid arguments")


def _offsets_ok(ip: np.ndarray) -> bool:
    """The C library's own indptr rules (checked again there): starts at 0,
    non-decreasing."""
    return ip.size >= 1 and int(ip[0]) == 0 and bool(np.all(ip[1:] >= ip[:-1]))


def _packed_sizes(lens: np.ndarray) -> np.ndarray:
    return (lens + 7) // 8


def packbits(x, bitorder: str = "big") -> np.ndarray:
    """Packs the truth values of x's elements into bits, like numpy.packbits
    on the flattened array.

    Args:
        x: array-like of any shape (flattened); bool and 1-byte integer data
            are read in place, other numbers are compared with zero.
        bitorder: "big" (element 0 in bit 7, the default) or "little"
            (element 0 in bit 0; what attention masks use).

    Returns:
        uint8 array of shape ((n + 7) // 8,), the last byte zero-padded.

    Raises:
        InvalidArgumentError: bad bitorder or non-numeric data.
    """
    order = _bitorder(bitorder)
    flat = _truth_bytes(x, "x")
    out = np.empty((flat.size + 7) // 8, np.uint8)
    _lib.check(kvc_packbits(flat.ctypes.data, flat.size, order, out.ctypes.data))
    return out


def segment_packbits(x, indptr, bitorder: str = "big"):
    """Packs each segment ``x[indptr[i]:indptr[i+1]]`` separately, each padded
    to a whole byte.

    Args:
        x: array-like holding indptr[-1] elements (flattened; truth values as
            in :func:`packbits`).
        indptr: (B+1,) integers, indptr[0] == 0, non-decreasing.
        bitorder: "big" (default) or "little".

    Returns:
        (y, new_indptr): y uint8 with every packed segment concatenated;
        new_indptr (B+1,) byte offsets into y, int64 if indptr was an int64
        array, else int32.

    Raises:
        InvalidArgumentError: bad bitorder, indptr not (B+1,) integers
            starting at 0 and non-decreasing, or x not of indptr[-1] elements.
    """
    order = _bitorder(bitorder)
    flat = _truth_bytes(x, "x")
    ip = _index_array(indptr, "indptr", keep_int64=True)
    out_ip = np.empty(ip.shape, ip.dtype)
    t_ip, t_out_ip = _lib.make_tensor(ip), _lib.make_tensor(out_ip)
    if not _offsets_ok(ip):
        _c_rejects(kvc_segment_packbits(flat.ctypes.data, t_ip, order, None, 0, t_out_ip),
                   "segment_packbits")
    if int(ip[-1]) != flat.size:
        raise InvalidArgumentError(
            f"segment_packbits: x has {flat.size} elements but indptr[-1] = {int(ip[-1])}")
    cap = int(_packed_sizes(np.diff(ip.astype(np.int64))).sum())
    out = np.empty(cap, np.uint8)
    _lib.check(kvc_segment_packbits(flat.ctypes.data, t_ip, order, out.ctypes.data, cap,
                                    t_out_ip))
    return out, out_ip


def build_packed_custom_mask(masks, qo_indptr=None, kv_indptr=None):
    """Packs the custom attention masks of a batch into FlashInfer's
    ``packed_custom_mask`` layout (SEMANTICS section 5).

    Two forms:

    * ``build_packed_custom_mask(masks)``: masks is a sequence of 2-D arrays,
      one ``(qo_len_b, kv_len_b)`` mask per request (truth values as in
      :func:`packbits`).
    * ``build_packed_custom_mask(custom_mask, qo_indptr, kv_indptr)``:
      custom_mask is the flat concatenation of the row-major masks;
      request b has ``qo_indptr[b+1] - qo_indptr[b]`` queries and
      ``kv_indptr[b+1] - kv_indptr[b]`` keys (both (B+1,), starting at 0,
      non-decreasing, int32 range).

    Returns:
        (packed_custom_mask, mask_indptr): uint8 bytes, request b's packed
        mask at bytes ``mask_indptr[b]:mask_indptr[b+1]`` (int32 (B+1,)); bit
        ``q * kv_len_b + k`` of it, read little-endian, is mask_b[q, k].

    Raises:
        InvalidArgumentError: a mask that is not 2-D, only one indptr given,
            indptrs of different lengths, not starting at 0 or decreasing,
            custom_mask of the wrong size, or a packed size beyond int32.
    """
    if qo_indptr is None and kv_indptr is None:
        if isinstance(masks, np.ndarray) and masks.ndim != 3:
            raise InvalidArgumentError(
                f"build_packed_custom_mask: a single array of masks must be 3-D (B, qo_len, "
                f"kv_len), got shape {masks.shape}; pass qo_indptr and kv_indptr with a flat "
                f"custom_mask")
        try:
            items = list(masks)
        except TypeError as exc:
            raise InvalidArgumentError(
                "build_packed_custom_mask: masks must be a sequence of 2-D arrays") from exc
        flats, qo, kv = [], [0], [0]
        for b, m in enumerate(items):
            arr = _lib.as_array(m, f"masks[{b}]")
            if arr.ndim != 2:
                raise InvalidArgumentError(f"build_packed_custom_mask: masks[{b}] must be 2-D "
                                           f"(qo_len, kv_len), got shape {arr.shape}")
            flats.append(_truth_bytes(arr, f"masks[{b}]"))
            qo.append(qo[-1] + arr.shape[0])
            kv.append(kv[-1] + arr.shape[1])
        flat = np.concatenate(flats) if flats else np.empty(0, np.uint8)
        qo_ip = _index_array(qo, "qo_indptr", keep_int64=False)
        kv_ip = _index_array(kv, "kv_indptr", keep_int64=False)
    elif qo_indptr is None or kv_indptr is None:
        raise InvalidArgumentError(
            "build_packed_custom_mask: pass both qo_indptr and kv_indptr with a flat "
            "custom_mask, or neither with a sequence of 2-D masks")
    else:
        flat = _truth_bytes(masks, "custom_mask")
        qo_ip = _index_array(qo_indptr, "qo_indptr", keep_int64=False)
        kv_ip = _index_array(kv_indptr, "kv_indptr", keep_int64=False)

    mask_ip = np.empty(qo_ip.shape, np.int32)
    t_qo, t_kv, t_m = (_lib.make_tensor(qo_ip), _lib.make_tensor(kv_ip),
                       _lib.make_tensor(mask_ip))
    if not (qo_ip.shape == kv_ip.shape and _offsets_ok(qo_ip) and _offsets_ok(kv_ip)):
        _c_rejects(kvc_build_packed_custom_mask(flat.ctypes.data, t_qo, t_kv, None, 0, t_m),
                   "build_packed_custom_mask")
    bits = np.diff(qo_ip.astype(np.int64)) * np.diff(kv_ip.astype(np.int64))
    cap = int(_packed_sizes(bits).sum())
    if cap > _INT32_MAX:  # beyond int32 byte offsets: C rejects it before reading the mask
        _c_rejects(kvc_build_packed_custom_mask(flat.ctypes.data, t_qo, t_kv, None, 0, t_m),
                   "build_packed_custom_mask")
    need = int(bits.sum())
    if need != flat.size:
        raise InvalidArgumentError(
            f"build_packed_custom_mask: custom_mask has {flat.size} elements, the requests "
            f"need sum(qo_len * kv_len) = {need}")
    out = np.empty(cap, np.uint8)
    _lib.check(kvc_build_packed_custom_mask(flat.ctypes.data, t_qo, t_kv, out.ctypes.data, cap,
                                            t_m))
    return out, mask_ip
