"""Element conversion and int8/int4 group quantization (SEMANTICS section 1).

All three functions work on the flattened, C-contiguous data of their inputs
(a non-contiguous input is copied first) and return new arrays; the groups of
``quant_group`` consecutive elements run along the last axis.

Quantization: ``absmax = max|x|`` per group (float32), ``scale =
max(absmax / qmax, 1e-5)`` (float32, then rounded to the scale dtype),
``q = clip(round_half_even(x / scale), -qmax, qmax)`` with ``qmax`` 127 (8
bits) or 7 (4 bits). int4 values are packed two per byte, element ``2i`` in
the low nibble.
"""

from __future__ import annotations

import numpy as np

from . import _lib
from .errors import InternalError, InvalidArgumentError

__all__ = ["convert", "quantize", "dequantize"]


def _float_input(x, name: str) -> np.ndarray:
    arr = _lib.as_array(x, name)
    code = _lib.dtype_code(arr.dtype)
    if code not in _lib.FLOAT_CODES:
        raise InvalidArgumentError(
            f"{name}: dtype must be float32, float16 or bfloat16, got {arr.dtype}")
    if not (arr.flags.c_contiguous and arr.flags.aligned):  # C reads aligned elements
        arr = arr.copy(order="C")
    return arr


def _float_dtype(dtype, name: str) -> tuple[np.dtype, int]:
    dt = _lib.resolve_dtype(dtype, name)
    code = _lib.dtype_code(dt)
    if code not in _lib.FLOAT_CODES:
        raise InvalidArgumentError(f"{name} must be float32, float16 or bfloat16, got {dt}")
    return dt, code


def _scale_dtype(dtype) -> tuple[np.dtype, int]:
    dt = _lib.resolve_dtype(dtype, "scale_dtype")
    code = _lib.dtype_code(dt)
    if code not in (_lib.KVC_F32, _lib.KVC_F16):
        raise InvalidArgumentError(f"scale dtype must be float32 or float16, got {dt}")
    return dt, code


def _c_rejects(status: int, what: str) -> None:
    """For argument errors the binding leaves to C: raise C's error."""
    _lib.check(status)
    raise InternalError(f"{what}: the C library accepted invalid arguments")


def convert(x, dtype) -> np.ndarray:
    """Converts a float array to another float dtype (round to nearest even).

    Args:
        x: array of float32, float16 or bfloat16, any shape.
        dtype: target dtype: float32, float16 or bfloat16 (numpy dtype, type,
            or name such as "bfloat16").

    Returns:
        A new C-contiguous array of x's shape and the target dtype.
    """
    arr = _float_input(x, "x")
    dt, code = _float_dtype(dtype, "dtype")
    out = np.empty(arr.shape, dt)
    _lib.check(_lib.kvc_convert(arr.ctypes.data, _lib.dtype_code(arr.dtype), out.ctypes.data,
                                code, arr.size))
    return out


def _qmax_args_ok(quant_bit: int, quant_group: int) -> bool:
    return quant_bit in (4, 8) and quant_group >= 1 and (quant_bit != 4 or quant_group % 2 == 0)


def quantize(x, quant_bit: int = 8, quant_group: int = 8, scale_dtype=np.float32):
    """Quantizes x to int8 or int4 with one scale per group.

    Args:
        x: float32, float16 or bfloat16 array of shape (..., D) (a 0-d array
            counts as (1,)); every value must be finite, and with float16
            scales below 65520 * qmax (8321040 for 8 bits, 458640 for 4),
            where a group's float16 scale would round to +inf.
        quant_bit: 8 or 4.
        quant_group: group size g >= 1 dividing D (even for 4 bits).
        scale_dtype: float32 or float16.

    Returns:
        (q, scale): q is int8 (..., D) for 8 bits, uint8 (..., D/2) packed
        bytes for 4 bits; scale is (..., D/g) of scale_dtype.

    Raises:
        InvalidArgumentError: bad quant_bit/quant_group/dtypes, NaN/Inf in x,
            or a float16 scale that would overflow.
    """
    arr = _float_input(x, "x")
    if arr.ndim == 0:
        arr = arr.reshape(1)
    quant_bit = _lib.int32_attr(quant_bit, "quant_bit")
    quant_group = _lib.int32_attr(quant_group, "quant_group")
    sdt, scode = _scale_dtype(scale_dtype)
    xcode = _lib.dtype_code(arr.dtype)
    if not _qmax_args_ok(quant_bit, quant_group):
        _c_rejects(_lib.kvc_quantize(None, xcode, arr.size, quant_bit, quant_group, None, None,
                                     scode), "quantize")
    d = arr.shape[-1]
    if d % quant_group:
        raise InvalidArgumentError(
            f"quantize: quant_group {quant_group} does not divide the last dimension {d}")
    lead = arr.shape[:-1]
    if quant_bit == 8:
        q = np.empty(lead + (d,), np.int8)
    else:
        q = np.empty(lead + (d // 2,), np.uint8)
    scale = np.empty(lead + (d // quant_group,), sdt)
    _lib.check(_lib.kvc_quantize(arr.ctypes.data, xcode, arr.size, quant_bit, quant_group,
                                 q.ctypes.data, scale.ctypes.data, scode))
    return q, scale


def dequantize(q, scale, quant_bit: int = 8, quant_group: int = 8, dtype=np.float32):
    """Dequantizes ``float32(q) * scale``, then converts to dtype.

    Args:
        q: int8 array (..., D) for 8 bits; uint8 (or int8) array (..., D/2) of
            packed nibbles for 4 bits.
        scale: float32 or float16 array holding D/g scales per row (shape
            (..., D/g); only its size is checked).
        quant_bit: 8 or 4.
        quant_group: the group size g used when quantizing.
        dtype: output dtype: float32, float16 or bfloat16.

    Returns:
        A new array (..., D) of dtype.
    """
    quant_bit = _lib.int32_attr(quant_bit, "quant_bit")
    quant_group = _lib.int32_attr(quant_group, "quant_group")
    qa = _lib.as_array(q, "q")
    if qa.ndim == 0:
        qa = qa.reshape(1)
    if quant_bit == 4:
        if qa.dtype not in (np.dtype(np.uint8), np.dtype(np.int8)):
            raise InvalidArgumentError(f"dequantize: int4 data must be uint8 bytes, got {qa.dtype}")
        qa = qa.view(np.uint8) if qa.flags.c_contiguous else qa.copy(order="C").view(np.uint8)
        n = qa.size * 2
        d = qa.shape[-1] * 2
    else:
        if qa.dtype != np.dtype(np.int8):
            raise InvalidArgumentError(f"dequantize: int8 data must be int8, got {qa.dtype}")
        if not qa.flags.c_contiguous:
            qa = qa.copy(order="C")
        n = qa.size
        d = qa.shape[-1]
    sa = _lib.as_array(scale, "scale")
    scode = _lib.dtype_code(sa.dtype)
    if scode not in (_lib.KVC_F32, _lib.KVC_F16):
        raise InvalidArgumentError(f"dequantize: scale dtype must be float32 or float16, "
                                   f"got {sa.dtype}")
    if not (sa.flags.c_contiguous and sa.flags.aligned):
        sa = sa.copy(order="C")
    ydt, ycode = _float_dtype(dtype, "dtype")
    if not _qmax_args_ok(quant_bit, quant_group):
        _c_rejects(_lib.kvc_dequantize(None, quant_bit, None, scode, n, quant_group, None, ycode),
                   "dequantize")
    if d % quant_group:
        raise InvalidArgumentError(
            f"dequantize: quant_group {quant_group} does not divide the row length {d}")
    if sa.size * quant_group != n:
        raise InvalidArgumentError(
            f"dequantize: scale has {sa.size} elements, expected {n // quant_group} "
            f"({n} values / quant_group {quant_group})")
    y = np.empty(qa.shape[:-1] + (d,), ydt)
    _lib.check(_lib.kvc_dequantize(qa.ctypes.data, quant_bit, sa.ctypes.data, scode, n,
                                   quant_group, y.ctypes.data, ycode))
    return y
