"""FlashInfer's run-time knobs that kvcache maps onto its own (internal).

- Scalar calibration scales (FlashInfer's fp8 ``q_scale``/``k_scale``/``v_scale``):
  q_scale * k_scale multiplies sm_scale, v_scale multiplies the output.
- ``out=``/``lse=`` buffers: the result is written into them (dtype and shape
  must match what the call would return).
- Options that only have a GPU meaning are accepted at their neutral values.
"""
from __future__ import annotations

import ctypes
import math
import numbers
import warnings

import numpy as np

from . import _lib
from .errors import InvalidArgumentError, UnsupportedError

_F32 = np.dtype(np.float32)


def is_scalar(x) -> bool:
    """True for a Python/numpy number or a 0-d array (a calibration scale),
    False for arrays with dimensions (int8/int4 group scales)."""
    if isinstance(x, (numbers.Real, np.number)) and not isinstance(x, bool):
        return True
    return isinstance(x, np.ndarray) and x.ndim == 0


def calib(x, name: str):
    """A scalar calibration scale as float (None: none); finite and > 0."""
    if x is None:
        return None
    if isinstance(x, np.ndarray) and x.ndim == 1:  # FlashInfer's prefill takes one per head
        raise UnsupportedError(
            f"{name} as an array (a calibration scale per head) is not supported: pass one "
            f"number; int8/int4 group scales go in kv_scale")
    if not is_scalar(x):
        raise InvalidArgumentError(
            f"{name} must be a number (FlashInfer's calibration scale) or None; int8/int4 "
            f"group scales go in kv_scale")
    v = float(x)
    if not math.isfinite(v) or v <= 0.0:
        raise InvalidArgumentError(f"{name} must be finite and > 0, got {x!r}")
    return v


def _copy_params(params):
    """A copy of an AttnParams (the plan's own stays as planned)."""
    p = _lib.AttnParams()
    ctypes.memmove(ctypes.byref(p), ctypes.byref(params), ctypes.sizeof(p))
    return p


def scaled_params(params, head_dim: int, q_scale, k_scale):
    """params with sm_scale multiplied by q_scale * k_scale (FlashInfer folds
    both into sm_scale); params itself when neither is given."""
    f = (q_scale or 1.0) * (k_scale or 1.0)
    if f == 1.0:
        return params
    p = _copy_params(params)
    base = params.sm_scale if params.sm_scale != 0.0 else 1.0 / math.sqrt(head_dim)
    s = base * f
    if not math.isfinite(s) or s == 0.0:
        raise InvalidArgumentError(f"sm_scale * q_scale * k_scale = {s!r} is not a usable "
                                   f"scale")
    p.sm_scale = s
    return p


def host_options(non_blocking=True, fixed_split_size=None, disable_split_kv=False) -> None:
    """FlashInfer plan() options about device copies and split-KV scheduling,
    checked and ignored: plan copies nothing to a device, and a request's
    split into chunks is a function of its own length alone (never of the
    batch or the thread count), so results are already deterministic and
    batch-invariant, which is what fixed_split_size asks for."""
    _lib.flag(non_blocking, "non_blocking")
    _lib.flag(disable_split_kv, "disable_split_kv")
    if fixed_split_size is not None and (isinstance(fixed_split_size, (bool, np.bool_)) or
                                         not isinstance(fixed_split_size, numbers.Integral)):
        raise InvalidArgumentError(f"fixed_split_size must be an int or None, got "
                                   f"{fixed_split_size!r}")


def data_types(data_type, q_data_type, kv_data_type):
    """FlashInfer's deprecated plan(data_type=...): the dtype of q and of the
    cache wherever q_data_type / kv_data_type is not given."""
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    return q_data_type, kv_data_type


def run_options(planned_window: int, window_left=None, enable_pdl=None) -> None:
    """FlashInfer run() options: enable_pdl (a GPU launch flag) is ignored;
    window_left must be None or the planned value (FlashInfer's rule outside
    its trtllm-gen backend)."""
    if enable_pdl is not None:
        _lib.flag(enable_pdl, "enable_pdl")
    if window_left is not None:
        if (isinstance(window_left, (bool, np.bool_)) or
                not isinstance(window_left, numbers.Integral)):
            raise InvalidArgumentError(f"window_left must be an int or None, got "
                                       f"{window_left!r}")
        if int(window_left) != planned_window:
            raise InvalidArgumentError(f"run(window_left={window_left}) differs from the "
                                       f"planned window_left={planned_window}; plan again")


def with_sinks(params, sinks, num_qo_heads: int):
    """params for run(sinks=...): params itself for None, else a copy whose
    ``sinks`` points at one attention-sink logit per query head
    ((num_qo_heads,) real numbers, read as float32 like FlashInfer's kernels;
    -inf means no sink; kvc_attn_params.sinks says what C does with them).
    The copy holds the array while it lives."""
    if sinks is None:
        return params
    a = _sinks_array(sinks, num_qo_heads)
    p = _copy_params(params)
    p.sinks = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    p.keep_sinks = a
    return p


def _sinks_array(sinks, num_qo_heads: int):
    """sinks as a contiguous (num_qo_heads,) float32 array, checked."""
    try:
        a = np.asarray(sinks)
    except Exception as e:  # noqa: BLE001 (any object numpy cannot take)
        raise InvalidArgumentError(f"sinks must be an array of numbers: {e}") from None
    if a.dtype == np.bool_ or a.dtype.kind not in "iuf":
        raise InvalidArgumentError(f"sinks must be real numbers, got dtype {a.dtype}")
    if a.shape != (num_qo_heads,):
        raise InvalidArgumentError(f"sinks must have shape (num_qo_heads,) = "
                                   f"({num_qo_heads},), got {a.shape}")
    a = np.ascontiguousarray(a, _F32)
    if np.isnan(a).any() or (a == np.inf).any():
        raise InvalidArgumentError("sinks must not be NaN or +inf (-inf means no sink)")
    return a


def backend(value) -> None:
    """FlashInfer's ``backend=`` ("auto", "fa2", "fa3", "cudnn", "trtllm-gen",
    ...) picks among its GPU kernels, which compute the same function; kvcache
    has one CPU implementation, so any backend name is accepted and ignored."""
    if value is not None and not isinstance(value, str):
        raise InvalidArgumentError(f"backend must be a string such as 'auto', got {value!r}")


def no_jit(jit_args=None, jit_kwargs=None) -> None:
    """FlashInfer's jit_args / jit_kwargs (custom JIT-compiled kernel
    variants) have no CPU meaning: None only."""
    neutral("jit_args", jit_args, (None,))
    neutral("jit_kwargs", jit_kwargs, (None,))


def legacy_positional(api: str, args, names, kwargs) -> dict:
    """FlashInfer's deprecated positional plan() options: args named in the
    order of names and merged into kwargs, with a DeprecationWarning; too
    many, or one also given by keyword, is a TypeError (as in FlashInfer)."""
    if len(args) > len(names):
        raise TypeError(f"{api}.plan() accepts at most {len(names)} deprecated optional "
                        f"positional arguments after page_size; got {len(args)}")
    merged = dict(kwargs)
    for name, value in zip(names, args):
        if name in merged:
            raise TypeError(f"{api}.plan() got multiple values for argument {name!r}")
        merged[name] = value
    warnings.warn(f"Passing optional arguments to {api}.plan() positionally is deprecated "
                  f"(as in FlashInfer); pass them as keyword arguments instead.",
                  DeprecationWarning, stacklevel=4)
    return merged


def no_run_extras(**kwargs) -> None:
    """FlashInfer run() inputs for what kvcache does not have: NVFP4 block
    scales (kv_cache_sf), skip-softmax sparsity
    (skip_softmax_threshold_scale_factor), an fp8 output scale (o_scale),
    fp16 softmax / spcompress switches (use_fp16_softmax, uses_spcompress),
    MLA fp8 scales (ckv_scale, ckv_scale_arr, kpe_scale): None (or False
    for the switches) only, refused otherwise rather than ignored."""
    for name, value in kwargs.items():
        neutral(name, value, (None, False) if name.startswith("use") else (None,))


def no_kernel_args(api: str, args) -> None:
    """FlashInfer's wrapper run(q, cache, *args, ...) passes extra positional
    inputs to custom JIT kernel variants (and, on its fp8 tensor-core path,
    reads per-tensor fp8 scale tensors from them). kvcache has neither, so
    any extra positional is refused, each one named: every option after the
    cache (k/v for ragged) is keyword-only, as in FlashInfer, kvcache's own
    kv_scale= included."""
    if not args:
        return
    named = "; ".join(f"args[{i}]: {_describe(a)}" for i, a in enumerate(args))
    raise UnsupportedError(
        f"{api}.run() got {len(args)} extra positional argument(s) ({named}): FlashInfer "
        f"passes these to custom kernel variants, which kvcache does not have. Options are "
        f"keyword-only, as in FlashInfer: kv_scale= (int8/int4 group scales), return_lse=, "
        f"q_scale=/k_scale=/v_scale=, out=, lse=")


def _describe(x) -> str:
    """A short description of an argument for an error message."""
    if isinstance(x, np.ndarray):
        return f"{x.dtype} array of shape {x.shape}"
    if isinstance(x, (tuple, list)):
        return (f"{type(x).__name__} of {len(x)} (" +
                ", ".join(_describe(a) for a in x[:4]) + (", ..." if len(x) > 4 else "") + ")")
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."


def no_variant_inputs(**kwargs) -> None:
    """FlashInfer plan() inputs of kernel variants kvcache does not have
    (multi-item scoring: prefix_len_ptr, token_pos_in_items_ptr,
    token_pos_in_items_len, max_item_len_ptr) and of its trtllm-gen / cudnn
    backends (seq_lens, seq_lens_q, block_tables, max_token_per_sequence,
    max_sequence_kv, v_indptr, o_indptr): accepted at their defaults (None;
    0 for token_pos_in_items_len) only, refused otherwise rather than
    ignored."""
    for name, value in kwargs.items():
        neutral(name, value, (0,) if name == "token_pos_in_items_len" else (None,))


def neutral(name: str, value, allowed) -> None:
    """A FlashInfer option kvcache accepts only at its neutral value(s)."""

    def same(a) -> bool:
        if a is None or value is None or isinstance(value, np.ndarray):
            return value is a
        try:
            return bool(value == a)
        except (TypeError, ValueError):
            return False

    if not any(same(a) for a in allowed):
        raise UnsupportedError(f"{name}={value!r} is not supported on the CPU (allowed: "
                               f"{', '.join(repr(a) for a in allowed)})")


def _buffer(buf, name: str, shape, dtype) -> np.ndarray:
    if not isinstance(buf, np.ndarray):
        raise InvalidArgumentError(f"{name} must be a numpy array, got {type(buf).__name__}")
    if buf.dtype != dtype or buf.shape != tuple(shape):
        raise InvalidArgumentError(f"{name} is {buf.dtype} {buf.shape}; this call writes "
                                   f"{np.dtype(dtype)} {tuple(shape)}")
    if not buf.flags.writeable:
        raise InvalidArgumentError(f"{name} is read-only")
    return buf


class Outputs:
    """The o/lse arrays a call writes, honouring out=, lse= and v_scale.

    ``o_c``/``lse_c`` are what C writes into; ``result(return_lse)`` returns
    what the Python call returns. With v_scale C writes float32 and the
    scaled values are rounded once into o's dtype."""

    __slots__ = ("v_scale", "out", "lse", "o_c", "lse_c", "o_dtype")

    def __init__(self, o_shape, o_dtype, lse_shape, return_lse, out=None, lse=None,
                 v_scale=None):
        if return_lse is not False and return_lse is not True:
            _lib.flag(return_lse, "return_lse")
        o_dtype = np.dtype(o_dtype)
        self.v_scale = v_scale
        self.o_dtype = o_dtype
        if out is None and lse is None and v_scale is None:  # the common case
            self.out = self.lse = None
            self.o_c = np.empty(o_shape, o_dtype)
            self.lse_c = np.empty(lse_shape, _F32) if return_lse else None
            return
        self.out = None if out is None else _buffer(out, "out", o_shape, o_dtype)
        self.lse = None if lse is None else _buffer(lse, "lse", lse_shape, _F32)
        if v_scale is not None:
            self.o_c = np.empty(o_shape, _F32)
        elif self.out is not None and _lib.layout_ok(self.out):
            self.o_c = self.out
        else:
            self.o_c = np.empty(o_shape, o_dtype)
        if self.lse is not None and _lib.layout_ok(self.lse):
            self.lse_c = self.lse
        elif self.lse is not None or return_lse:
            self.lse_c = np.empty(lse_shape, _F32)
        else:
            self.lse_c = None

    def tensors(self):
        """(o tensor, lse tensor or None) for C."""
        lse_c = self.lse_c
        return _lib.make_tensor(self.o_c), None if lse_c is None else _lib.make_tensor(lse_c)

    def result(self, return_lse: bool):
        o = self.o_c
        if self.v_scale is not None:
            o = (o * np.float32(self.v_scale)).astype(self.o_dtype)
        if self.out is not None and o is not self.out:
            np.copyto(self.out, o)
            o = self.out
        lse = self.lse_c
        if self.lse is not None and lse is not self.lse:
            np.copyto(self.lse, lse)
            lse = self.lse
        return (o, lse) if return_lse else o
