"""OpenPPL pmx KV-cache operators (SEMANTICS sections 2 and 3), and the
fused dynamic_batching.MultiHeadCacheAttention
(:func:`dynamic_multi_head_cache_attention`, pmx-notes section 4: the same
store, then attention over the cache).

Both operators store new tokens' K/V into a multi-layer cache (quantizing to
int8/int4 with group scales when ``quant_bit != 0``), then read back every
position of each sequence, dequantized, with each KV head repeated
``num_repeat`` times consecutively, into two new arrays ``(key, value)``.

Dtypes (T1 = inputs/outputs, T2 = cache, T3 = scale):

- T1: float32, float16, ``ml_dtypes.bfloat16``; int8 only as a plain copy into
  an int8 cache with ``quant_bit == 0``.
- T2: float32/float16/bfloat16 (``quant_bit == 0``, converted on store), int8
  (``quant_bit == 8``), int4 (``quant_bit == 4``) given as a **uint8** array
  whose last dimension is ``Dh / 2`` bytes (element ``2i`` in the low nibble).
- T3: float32 or float16, the cache's shape with last dim ``Dh / quant_group``.

``cache`` and ``scale`` are updated in place and therefore never copied: they
must be writeable numpy arrays with a contiguous last dimension (other strides
are free, so slices of larger arrays work). Inputs may be any array-like of a
supported dtype (float32/float16/bfloat16 K/V, so a Python list of floats, which
numpy makes float64, is refused: convert it first); they are copied only if their
layout cannot be passed as is. Every argument is
validated by the C library before anything is written: a failing call raises
:class:`kvcache.InvalidArgumentError` and leaves cache and scale unchanged.

``num_threads=None`` (or ``n_threads=None``) runs on as many threads as the CPUs the process may use (its affinity mask); results are
bitwise identical for any thread count.
"""

from __future__ import annotations

import ctypes

import numpy as np

from . import _lib
from .errors import InvalidArgumentError

__all__ = ["key_value_cache", "dynamic_key_value_cache", "dynamic_multi_head_cache_attention"]

_T1_CODES = (_lib.KVC_F32, _lib.KVC_F16, _lib.KVC_BF16, _lib.KVC_I8)

# Outputs larger than this many elements beyond what the cache could ever
# produce are refused in Python (the arguments are inconsistent anyway, and
# allocating them could exhaust memory before C gets to report the error).
_OUTPUT_SLACK = 1 << 20


def _params(**kw) -> _lib.PmxKvParams:
    p = _lib.kvc_pmx_kv_default_params()
    for name, value in kw.items():
        setattr(p, name, _lib.int32_attr(value, name))
    return p


def _cache_tensors(cache, scale, quant_bit: int):
    """(cache array, cache tensor, scale array|None, scale tensor|None)."""
    cache = _lib.inplace_array(cache, "cache")
    int4 = quant_bit == 4 and cache.dtype == np.dtype(np.uint8)
    cache_t = _lib.make_tensor(cache, int4=int4)
    scale_t = None
    if scale is not None:
        scale = _lib.inplace_array(scale, "scale")
        scale_t = _lib.make_tensor(scale)
    return cache, cache_t, scale, scale_t


def _cache_elements(cache: np.ndarray, cache_t: _lib.Tensor) -> int:
    return cache.size * (2 if cache_t.dtype == _lib.KVC_I4 else 1)


def _outputs(shape, dtype, cache_elems: int, num_repeat: int, what: str, hint: str):
    """Allocates (key, value) of shape (negative dims clamped to 0); refuses
    absurd sizes that no valid call could produce (hint names the inputs the
    length came from)."""
    shape = tuple(max(0, int(d)) for d in shape)
    n = 1
    for d in shape:
        n *= d
    if n > 2 * cache_elems * max(num_repeat, 1) + _OUTPUT_SLACK:
        raise InvalidArgumentError(
            f"{what}: {hint} gives an output of shape {shape}, larger than anything the "
            f"cache ({cache_elems} elements) can hold")
    return np.empty(shape, dtype), np.empty(shape, dtype)


def _ptr(t):
    return ctypes.byref(t) if t is not None else None


def _call(fn, args, n_threads):
    _lib.call_pooled(fn, args, n_threads)


def key_value_cache(current_key, current_value, start_pos, cache, scale=None, num_layer=1,
                    layer_idx=0, quant_bit=0, quant_group=8, num_repeat=1, cache_layout=0,
                    n_threads=None, *, num_threads=None):
    """Static-batching KeyValueCache (opmx::KeyValueCache).

    Args:
        current_key, current_value: (B, S, H, Dh) of T1.
        start_pos: int (or one-element integer array): first position to store.
        cache: T2, layout 0 ``(MaxB, L, 2, MaxS, H, Dh)``, layout 1
            ``(L, MaxB, 2, H, MaxS, Dh)`` (int4: uint8 with last dim Dh/2);
            index 0 of the ``2`` axis is K, 1 is V. Updated in place.
        scale: T3, cache's shape with last dim Dh/quant_group; required when
            quant_bit != 0. Updated in place.
        num_layer, layer_idx, quant_bit (0/8/4), quant_group, num_repeat,
        cache_layout (0/1): the operator's attributes.
        num_threads: worker threads (None: all CPUs); n_threads is the same.

    Returns:
        (key, value): new arrays (B, start_pos + S, H * num_repeat, Dh) of
        current_key's dtype: positions [0, start_pos + S) read back.
    """
    params = _params(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit,
                     quant_group=quant_group, num_repeat=num_repeat, cache_layout=cache_layout)
    ck = _lib.input_array(current_key, "current_key", _T1_CODES)
    cv = _lib.input_array(current_value, "current_value", _T1_CODES)
    sp = _lib.scalar_int64(start_pos, "start_pos")
    cache, cache_t, scale, scale_t = _cache_tensors(cache, scale, params.quant_bit)
    ck_t, cv_t, sp_t = _lib.make_tensor(ck), _lib.make_tensor(cv), _lib.make_tensor(sp)

    if ck.ndim == 4:
        b, s, h, dh = ck.shape
        shape = (b, int(sp) + s, h * params.num_repeat, dh)
        hint = f"start_pos {int(sp)} + S {s}"
    else:  # C reports the bad input shape
        shape, hint = (0, 0, 0, 0), ""
    key, value = _outputs(shape, ck.dtype, _cache_elements(cache, cache_t), params.num_repeat,
                          "key_value_cache", hint)
    key_t, value_t = _lib.make_tensor(key), _lib.make_tensor(value)
    _call(_lib.kvc_pmx_key_value_cache,
          (ctypes.byref(ck_t), ctypes.byref(cv_t), ctypes.byref(sp_t), ctypes.byref(cache_t),
           _ptr(scale_t), ctypes.byref(params), ctypes.byref(key_t), ctypes.byref(value_t)),
          _lib.threads_arg(num_threads, n_threads))
    return key, value


def dynamic_key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts,
                            start_pos, max_seqlen, max_kvlen, cache, scale=None, num_layer=1,
                            layer_idx=0, quant_bit=0, quant_group=8, num_repeat=1, cache_mode=0,
                            cache_layout=0, page_size=128, n_threads=None, *,
                            num_threads=None):
    """dynamic_batching.KeyValueCache (ragged batches, offset or paged cache).

    Args:
        current_key, current_value: (seqstarts[B], H, Dh) of T1.
        seqstarts: (B+1) ints, seqstarts[0] == 0, non-decreasing: new tokens
            of batch b are rows [seqstarts[b], seqstarts[b+1]).
        kvstarts: (B+1) ints, kvstarts[0] == 0, non-decreasing: output rows of
            batch b; kvstarts[b+1]-kvstarts[b] must equal start_pos[b] + S_b.
        cachestarts: cache_mode 0: (B) ints, slot of position 0 of batch b;
            cache_mode 1: (B, MaxP) ints, token offset inside MaxT of each
            page start of batch b (-1 for unused entries).
        start_pos: (B) ints, first position stored for each batch.
        max_seqlen, max_kvlen: ints, at least the largest S_b / kvlen_b.
        cache: T2, layout 0 ``(MaxT, L, 2, H, Dh)``, 1 ``(L, MaxT, 2, H, Dh)``,
            2 ``(L, 2, MaxT, H, Dh)``, 3 ``(L, 2, H, MaxT, Dh)`` (int4: uint8
            with last dim Dh/2). Updated in place.
        scale: T3, cache's shape with last dim Dh/quant_group; required when
            quant_bit != 0. Updated in place.
        num_layer, layer_idx, quant_bit (0/8/4), quant_group, num_repeat,
        cache_mode (0/1), cache_layout (0..3), page_size (>= 1): attributes.
        num_threads: worker threads (None: all CPUs); n_threads is the same.

    Returns:
        (key, value): new arrays (kvstarts[B], H * num_repeat, Dh) of
        current_key's dtype; rows [kvstarts[b], kvstarts[b+1]) hold positions
        [0, kvlen_b) of batch b.
    """
    params = _params(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit,
                     quant_group=quant_group, num_repeat=num_repeat, cache_layout=cache_layout,
                     cache_mode=cache_mode, page_size=page_size)
    ck = _lib.input_array(current_key, "current_key", _T1_CODES)
    cv = _lib.input_array(current_value, "current_value", _T1_CODES)
    seq = _lib.int64_array(seqstarts, "seqstarts")
    kvs = _lib.int64_array(kvstarts, "kvstarts")
    cst = _lib.int64_array(cachestarts, "cachestarts")
    spos = _lib.int64_array(start_pos, "start_pos")
    msl = _lib.scalar_int64(max_seqlen, "max_seqlen")
    mkl = _lib.scalar_int64(max_kvlen, "max_kvlen")
    cache, cache_t, scale, scale_t = _cache_tensors(cache, scale, params.quant_bit)
    ts = [_lib.make_tensor(a) for a in (ck, cv, seq, kvs, cst, spos, msl, mkl)]

    rows = int(kvs[-1]) if kvs.ndim == 1 and kvs.size else 0
    if ck.ndim == 3:
        shape = (rows, ck.shape[1] * params.num_repeat, ck.shape[2])
    else:  # C reports the bad input shape
        shape = (0, 0, 0)
    key, value = _outputs(shape, ck.dtype, _cache_elements(cache, cache_t), params.num_repeat,
                          "dynamic_key_value_cache", f"kvstarts[B] = {rows}")
    key_t, value_t = _lib.make_tensor(key), _lib.make_tensor(value)
    _call(_lib.kvc_pmx_dynamic_key_value_cache,
          tuple(ctypes.byref(t) for t in ts)
          + (ctypes.byref(cache_t), _ptr(scale_t), ctypes.byref(params), ctypes.byref(key_t),
             ctypes.byref(value_t)),
          _lib.threads_arg(num_threads, n_threads))
    return key, value


# ---------------------------------------------------------------------------
# dynamic_batching.MultiHeadCacheAttention (pmx-notes section 4)


class PmxMhcaParams(ctypes.Structure):
    """ctypes mirror of ``kvc_pmx_mhca_params`` (include/kvcache/pmx.h)."""

    _fields_ = [
        ("kv", _lib.PmxKvParams),
        ("num_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("is_causal", ctypes.c_int32),
        ("is_alibi", ctypes.c_int32),
    ]


_TP = ctypes.POINTER(_lib.Tensor)
kvc_pmx_mhca_default_params = _lib.optional_proto("kvc_pmx_mhca_default_params", PmxMhcaParams)
kvc_pmx_dynamic_multi_head_cache_attention = _lib.optional_proto(
    "kvc_pmx_dynamic_multi_head_cache_attention", ctypes.c_int, _TP, _TP, _TP, _TP, _TP, _TP,
    _TP, _TP, _TP, _TP, _TP, _TP, _TP, ctypes.POINTER(PmxMhcaParams), _TP, ctypes.c_void_p)

_Q_CODES = (_lib.KVC_F32, _lib.KVC_F16, _lib.KVC_BF16)


def dynamic_multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts,
                                       cachestarts, start_pos, decoding_batches, max_seqlen,
                                       max_kvlen, cache, scale=None, attn_mask=None, *,
                                       num_heads, head_dim, is_causal=True, num_kv_heads=0,
                                       num_layer=1, layer_idx=0, quant_bit=0, quant_group=8,
                                       cache_mode=0, cache_layout=0, page_size=128,
                                       is_alibi=False, num_threads=None):
    """dynamic_batching.MultiHeadCacheAttention: stores the new K/V into the
    cache exactly as :func:`dynamic_key_value_cache` (with num_repeat 1), then
    runs attention of each batch's queries over its whole history read from
    the cache (dequantized on the fly).

    For batch b with S_b = seqstarts[b+1] - seqstarts[b] queries and
    kvlen_b = kvstarts[b+1] - kvstarts[b] keys (positions [0, kvlen_b)):
    scores q . k / sqrt(head_dim), plus ``attn_mask[..., seqstarts[b]:
    seqstarts[b+1], kvstarts[b]:kvstarts[b+1]]`` when given (added to the
    scores; -inf hides a key), causal bottom-right (query i sees keys
    j <= i + kvlen_b - S_b) when is_causal and b >= decoding_batches (the
    first decoding_batches batches are never causal-masked); softmax in
    float32. Query head h reads KV head h // (num_heads //
    num_kv_heads). A row with no visible key gives 0.

    Args:
        query: (seqstarts[B], num_heads, head_dim) float32/float16/bfloat16.
        current_key, current_value: (seqstarts[B], num_kv_heads, head_dim),
            float32/float16/bfloat16 (stored as by dynamic_key_value_cache).
        seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen:
            as dynamic_key_value_cache (kvlen_b == start_pos[b] + S_b).
        decoding_batches: int, the first decoding_batches batches are decode
            batches (never causal-masked).
        cache, scale: as dynamic_key_value_cache; updated in place.
        attn_mask: optional additive mask, float32/float16 (bfloat16 is
            converted to float32, exactly), (seqstarts[B], >= kvstarts[B])
            or (num_heads, seqstarts[B], >= kvstarts[B]); -inf hides a key
            (finite values, np.finfo(np.float32).min included, never do).
        num_heads, head_dim: required; is_causal (default True);
        num_kv_heads (0: num_heads; divides num_heads); num_layer,
        layer_idx, quant_bit (0/8/4), quant_group, cache_mode (0/1),
        cache_layout (0..3), page_size: the operator's attributes.
        is_alibi: not supported (UnsupportedError when True).
        num_threads: worker threads (None: all CPUs).

    Returns:
        attn_output: new array (seqstarts[B], num_heads, head_dim) of
        query's dtype.

    Raises:
        InvalidArgumentError: as dynamic_key_value_cache, plus bad heads,
            mask shapes, decoding_batches outside [0, B]; cache and scale
            are then unchanged.
    """
    p = kvc_pmx_mhca_default_params()
    kv_attrs = dict(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit,
                    quant_group=quant_group, num_repeat=1, cache_layout=cache_layout,
                    cache_mode=cache_mode, page_size=page_size)
    for name, value in kv_attrs.items():
        setattr(p.kv, name, _lib.int32_attr(value, name))
    for name, value in (("num_heads", num_heads), ("head_dim", head_dim),
                        ("num_kv_heads", num_kv_heads)):
        setattr(p, name, _lib.int32_attr(value, name))
    for name, value in (("is_causal", is_causal), ("is_alibi", is_alibi)):
        setattr(p, name, int(_lib.flag(value, name)))

    qa = _lib.input_array(query, "query", _Q_CODES)
    ck = _lib.input_array(current_key, "current_key", _T1_CODES)
    cv = _lib.input_array(current_value, "current_value", _T1_CODES)
    seq = _lib.int64_array(seqstarts, "seqstarts")
    kvs = _lib.int64_array(kvstarts, "kvstarts")
    cst = _lib.int64_array(cachestarts, "cachestarts")
    spos = _lib.int64_array(start_pos, "start_pos")
    dec = _lib.scalar_int64(decoding_batches, "decoding_batches")
    msl = _lib.scalar_int64(max_seqlen, "max_seqlen")
    mkl = _lib.scalar_int64(max_kvlen, "max_kvlen")
    cache, cache_t, scale, scale_t = _cache_tensors(cache, scale, p.kv.quant_bit)
    mask_t = None
    if attn_mask is not None:
        mask = _lib.input_array(attn_mask, "attn_mask", _Q_CODES)
        if _lib.dtype_code(mask.dtype) == _lib.KVC_BF16:
            mask = mask.astype(np.float32)  # exact; C takes float32/float16 masks
        mask_t = _lib.make_tensor(mask)
    ts = [_lib.make_tensor(a) for a in (qa, ck, cv, seq, kvs, cst, spos, dec, msl, mkl)]
    out = np.empty(qa.shape, qa.dtype)
    out_t = _lib.make_tensor(out)
    _call(kvc_pmx_dynamic_multi_head_cache_attention,
          tuple(ctypes.byref(t) for t in ts)
          + (ctypes.byref(cache_t), _ptr(scale_t), _ptr(mask_t), ctypes.byref(p),
             ctypes.byref(out_t)),
          num_threads)
    return out
