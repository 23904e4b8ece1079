"""Decode attention over kvcache storage and attention-state merging
(SEMANTICS section 5), mirroring FlashInfer's Python API:

- :func:`merge_state`, :func:`merge_state_in_place`, :func:`merge_states`
  (``flashinfer.cascade``);
- :func:`single_decode_with_kv_cache` (``flashinfer.decode``);
- :class:`BatchDecodeWithPagedKVCacheWrapper` (plan once per batch
  composition, run once per layer).

Math (float32 inside, whatever the storage dtype)::

    s_j = sm_scale * q . k_j              sm_scale defaults to 1/sqrt(Dh)
    s_j = cap * tanh(s_j / cap)           when logits_soft_cap > 0
    o   = sum_j softmax(s)_j v_j
    lse = log2(sum_j exp(s_j))            base 2 (FlashInfer's convention)

Query head ``h`` reads KV head ``h // (Hq // H)``. ``window_left = w >= 0``
keeps the last ``w + 1`` keys. A request with no key gives ``o = 0`` and
``lse = -inf``, never NaN. Outputs have q's dtype; lse is float32.

KV storage: float32, float16, ``ml_dtypes.bfloat16``, int8, or int4 given as
a **uint8** array with last dimension ``Dh / 2`` (element ``2i`` in the low
nibble); int8/int4 need scales (float32 or float16, the cache's shape with
last dimension ``Dh / quant_group``) and are dequantized on the fly
(SEMANTICS section 1).

Every call validates its arguments before writing anything and raises
:class:`kvcache.InvalidArgumentError` on bad input (outputs, and for
:func:`merge_state_in_place` ``v``/``s``, are then untouched).
``num_threads=None`` uses every CPU; results do not depend on the thread
count.
"""

from __future__ import annotations

import ctypes
import functools
import math
import warnings

import numpy as np

from . import _compat, _lib
from .errors import InvalidArgumentError
from .paged import _layout_code, _paged_cache

__all__ = [
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "single_decode_with_kv_cache",
    "BatchDecodeWithPagedKVCacheWrapper",
]

_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)
_KV_CODES = (_lib.KVC_F32, _lib.KVC_F16, _lib.KVC_BF16, _lib.KVC_I8, _lib.KVC_U8)
_SCALE_CODES = (_lib.KVC_F32, _lib.KVC_F16)


_byref = ctypes.byref


def _ref(t):
    return _byref(t) if t is not None else None


# ---------------------------------------------------------------------------
# Attention-state merging


def _v_array(x, name: str) -> np.ndarray:
    return _lib.input_array(x, name, _lib.FLOAT_CODES)


def _s_array(x, name: str) -> np.ndarray:
    """A read-only lse input as float32 (FlashInfer casts s to float32)."""
    if type(x) is np.ndarray and x.dtype == _F32:
        return _lib.input_array(x, name, (_lib.KVC_F32,))
    arr = _lib.as_array(x, name)
    if arr.dtype.kind not in "fiu" and _lib.dtype_code(arr.dtype) not in _lib.FLOAT_CODES:
        raise InvalidArgumentError(f"{name}: unsupported dtype {arr.dtype}")
    if arr.dtype != _F32:
        arr = arr.astype(_F32)
    return _lib.input_array(arr, name, (_lib.KVC_F32,))


def _ndim(arr: np.ndarray, name: str, ndim: int, what: str) -> None:
    if arr.ndim != ndim:
        raise InvalidArgumentError(f"{name} must be {what}, got shape {arr.shape}")


def merge_state(v_a, s_a, v_b, s_b):
    """Merges two attention states (flashinfer.merge_state).

    With ``m = max(s_a, s_b)``, ``w_a = 2^(s_a - m)``, ``w_b = 2^(s_b - m)``:
    ``v = (w_a v_a + w_b v_b) / (w_a + w_b)``, ``s = m + log2(w_a + w_b)``;
    two empty states (``-inf``) give ``v = 0``, ``s = -inf``.

    Args:
        v_a, v_b: (N, H, D), same dtype: float32, float16 or bfloat16.
        s_a, s_b: (N, H) base-2 log-sum-exps (cast to float32), finite or -inf.

    Returns:
        (v (N, H, D) of v_a's dtype, s (N, H) float32).
    """
    va, va_t = _lib.input_tensor(v_a, "v_a", _lib.FLOAT_CODES)
    vb, vb_t = _lib.input_tensor(v_b, "v_b", _lib.FLOAT_CODES)
    sa = _s_array(s_a, "s_a")
    sb = _s_array(s_b, "s_b")
    _ndim(va, "v_a", 3, "(N, H, D)")
    v = np.empty(va.shape, va.dtype)
    s = np.empty(va.shape[:2], _F32)
    mt = _lib.make_tensor
    status = _lib.kvc_merge_state(_byref(va_t), _byref(mt(sa)), _byref(vb_t), _byref(mt(sb)),
                                  _byref(mt(v)), _byref(mt(s)))
    if status:
        _lib.check(status)
    return v, s


def merge_state_in_place(v, s, v_other, s_other, mask=None) -> None:
    """Merges (v_other, s_other) into (v, s) in place
    (flashinfer.merge_state_in_place).

    Args:
        v: (N, H, D) float32/float16/bfloat16 numpy array, updated in place.
        s: (N, H) float32 numpy array, updated in place.
        v_other: (N, H, D), v's dtype.
        s_other: (N, H) (cast to float32).
        mask: optional (N) booleans (or integers, nonzero = merge): rows with
            mask False are left unchanged (and not read).
    """
    v = _lib.inplace_array(v, "v")
    s = _lib.inplace_array(s, "s")
    if s.dtype != _F32:
        raise InvalidArgumentError(f"s must be float32 (it is updated in place), got {s.dtype}")
    vo = _v_array(v_other, "v_other")
    so = _s_array(s_other, "s_other")
    mask_t = None
    if mask is not None:
        m = _lib.as_array(mask, "mask")
        if m.dtype.kind not in "biu":
            raise InvalidArgumentError(f"mask must hold booleans or integers, got {m.dtype}")
        m = np.ascontiguousarray(m != 0, dtype=np.uint8)
        mask_t = _lib.make_tensor(m)
    ts = [_lib.make_tensor(a) for a in (v, s, vo, so)]
    _lib.check(_lib.kvc_merge_state_in_place(*(ctypes.byref(t) for t in ts), _ref(mask_t)))


def merge_states(v, s):
    """Folds n attention states per row (flashinfer.merge_states).

    Args:
        v: (N, n, H, D) float32/float16/bfloat16.
        s: (N, n, H) (cast to float32), finite or -inf.

    Returns:
        (v (N, H, D) of v's dtype, s (N, H) float32); rows whose states are
        all empty (or n == 0) give v = 0, s = -inf.
    """
    va = _v_array(v, "v")
    sa = _s_array(s, "s")
    _ndim(va, "v", 4, "(N, n, H, D)")
    vo = np.empty((va.shape[0], va.shape[2], va.shape[3]), va.dtype)
    so = np.empty((va.shape[0], va.shape[2]), _F32)
    ts = [_lib.make_tensor(a) for a in (va, sa, vo, so)]
    _lib.check(_lib.kvc_merge_states(*(ctypes.byref(t) for t in ts)))
    return vo, so


# ---------------------------------------------------------------------------
# Parameters


def _attn_params(sm_scale, logits_soft_cap, window_left) -> _lib.AttnParams:
    p = _lib.AttnParams()
    if sm_scale is None:
        p.sm_scale = 0.0  # C: 1/sqrt(Dh)
    else:
        try:
            x = float(sm_scale)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"sm_scale must be a number or None, got "
                                       f"{sm_scale!r}") from exc
        if not math.isfinite(x) or x == 0.0:
            raise InvalidArgumentError(f"sm_scale must be finite and nonzero (None: "
                                       f"1/sqrt(head_dim)), got {sm_scale!r}")
        p.sm_scale = x
    if logits_soft_cap is None:
        p.logits_soft_cap = 0.0
    else:
        try:
            c = float(logits_soft_cap)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"logits_soft_cap must be a number or None, got "
                                       f"{logits_soft_cap!r}") from exc
        if not math.isfinite(c) or c < 0.0:
            raise InvalidArgumentError(f"logits_soft_cap must be finite and >= 0 (0 or None: "
                                       f"no cap), got {logits_soft_cap!r}")
        p.logits_soft_cap = c
    w = _lib.int32_attr(window_left, "window_left")
    if w < -1:
        raise InvalidArgumentError(f"window_left must be -1 (no window) or >= 0, got {w}")
    p.window_left = w
    return p


def _kv_array(x, name: str):
    """(array, tensor) for a read-only K or V input; uint8 means packed int4."""
    if type(x) is np.ndarray:
        return _lib.input_tensor(x, name, _KV_CODES, int4=x.dtype == _U8)
    arr = _lib.input_array(x, name, _KV_CODES)
    return arr, _lib.make_tensor(arr, int4=arr.dtype == _U8)


def _threads(num_threads) -> int:
    return _lib.threadpool(num_threads).n_threads


# ---------------------------------------------------------------------------
# Single request


def _scale_pair(k_scale, v_scale, ka, va, names=("k_scale", "v_scale")):
    """[(scale array|None, tensor|None)] for K and V: required exactly for
    int8/int4 (int8 or uint8-packed) K/V, float32/float16. A number is
    FlashInfer's calibration scale, not a group scale (see _split_scales).
    names: what the caller called the two scales, for messages."""
    out = []
    for name, sc, arr, kv in ((names[0], k_scale, ka, "k"), (names[1], v_scale, va, "v")):
        quant = arr.dtype in (np.dtype(np.int8), _U8)
        if sc is None:
            if quant:
                raise InvalidArgumentError(
                    f"{name} is required for an int8/int4 {kv}: an array of float32 or "
                    f"float16 group scales, {kv}'s shape with last dimension "
                    f"Dh / quant_group")
            out.append((None, None))
        else:
            if not quant:
                hint = " (a number is a calibration scale)" if name.endswith("_scale") else ""
                raise InvalidArgumentError(
                    f"{name} as an array is only for int8/int4 {kv}; {kv} is "
                    f"{arr.dtype}{hint}")
            out.append(_lib.input_tensor(sc, name, _SCALE_CODES))
    return out


def _split_scales(k_scale, v_scale):
    """(k group scales|None, v group scales|None, k calibration|None, v
    calibration|None): FlashInfer's k_scale/v_scale are numbers (calibration
    factors); arrays are kvcache's int8/int4 group scales."""
    out = []
    for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        out.append((None, _compat.calib(x, name)) if _compat.is_scalar(x) else (x, None))
    (kg, kc), (vg, vc) = out
    return kg, vg, kc, vc


def _kv_name(dt) -> str:
    """A cache dtype as the plan names it: uint8 arrays hold int4."""
    return "int4 (uint8)" if np.dtype(dt) == _U8 else str(np.dtype(dt))


def _paged_run_inputs(info, q, paged_kv_cache, kv_scale, layout, q_shape):
    """The run() inputs of a planned paged wrapper: q (checked against the
    plan's q_data_type and 3-D), the paged cache (against kv_data_type).
    layout: the wrapper's kvc_kv_layout code. Returns (q array, q tensor,
    PagedCache, arrays to keep alive)."""
    qa, q_t = _lib.input_tensor(q, "q", _lib.FLOAT_CODES)
    if info["q_data_type"] is not None and qa.dtype != info["q_data_type"]:
        raise InvalidArgumentError(f"q is {qa.dtype} but plan() was given q_data_type "
                                   f"{info['q_data_type']}")
    pc, keep = _paged_cache(paged_kv_cache, kv_scale, layout, info["quant_group"], True,
                            writable=False)
    kv_dt = info["kv_data_type"]
    if kv_dt is not None:
        arrays = keep[:1] if isinstance(paged_kv_cache, np.ndarray) else keep[:2]
        for arr in arrays:
            if arr.dtype != kv_dt:
                raise InvalidArgumentError(f"paged_kv_cache is {_kv_name(arr.dtype)} but plan() "
                                           f"was given kv_data_type {_kv_name(kv_dt)}")
    _ndim(qa, "q", 3, q_shape)
    return qa, q_t, pc, keep


def _run_knobs(info, q_scale, k_scale, v_scale, window_left=None, enable_pdl=None, sinks=None):
    """A planned wrapper's run(): (params with q_scale * k_scale folded into
    sm_scale, v_scale as a float or None for _run_outputs). window_left,
    enable_pdl: _compat.run_options; sinks: _compat.with_sinks."""
    if (q_scale is None and k_scale is None and v_scale is None and window_left is None and
            enable_pdl is None and sinks is None):
        return info["params"], None  # what the checks below give for all None
    _compat.run_options(int(info["params"].window_left), window_left, enable_pdl)
    qc, kc = _compat.calib(q_scale, "q_scale"), _compat.calib(k_scale, "k_scale")
    vc = _compat.calib(v_scale, "v_scale")
    params = _compat.scaled_params(info["params"], info["head_dim"], qc, kc)
    if sinks is not None:
        params = _compat.with_sinks(params, sinks, info["num_qo_heads"])
    return params, vc


def _run_outputs(info, qa, return_lse, out, lse, v_scale):
    """_compat.Outputs of a planned wrapper's run(): o of the plan's
    o_data_type (None: q's), lse (o's first two dimensions)."""
    o_dt = info.get("o_data_type")
    o_dt = qa.dtype if o_dt is None else o_dt
    return _compat.Outputs(qa.shape, o_dt, qa.shape[:2], return_lse, out, lse, v_scale)


def single_decode_with_kv_cache(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE",
                                use_tensor_cores=False, q_scale=None, k_scale=None, v_scale=None,
                                window_left=-1, logits_soft_cap=None, sm_scale=None,
                                rope_scale=None, rope_theta=None, return_lse=False, *,
                                quant_group=8, num_threads=None):
    """Decode attention of one query token over one request's K/V
    (flashinfer.single_decode_with_kv_cache; arguments in its order).

    Args:
        q: (Hq, Dh) float32/float16/bfloat16.
        k, v: (kv_len, H, Dh) for "NHD" or (H, kv_len, Dh) for "HND":
            float32, float16, bfloat16, int8, or uint8 (packed int4, last
            dimension Dh / 2). Hq % H == 0.
        kv_layout: "NHD" or "HND".
        pos_encoding_mode: "NONE" only (apply RoPE before storing K);
            use_tensor_cores: a GPU kernel choice, ignored; rope_scale,
            rope_theta: ignored with "NONE".
        q_scale: optional number, multiplies sm_scale (FlashInfer's fp8
            calibration scale).
        k_scale, v_scale: for int8/int4 k/v, arrays of float32/float16 group
            scales, k's shape with last dimension Dh / quant_group; a number
            is FlashInfer's calibration scale instead (k_scale multiplies
            sm_scale, v_scale the output).
        window_left: -1 for none, else only the last window_left + 1 keys.
        logits_soft_cap: None/0 for none, else cap * tanh(s / cap).
        sm_scale: None for 1/sqrt(Dh).
        return_lse: also return the base-2 log-sum-exp.
        quant_group: int8/int4 group size (divides Dh, even for int4).
        num_threads: worker threads (None: all CPUs).

    Returns:
        o (Hq, Dh) of q's dtype, or (o, lse (Hq) float32) with return_lse.
    """
    _compat.neutral("pos_encoding_mode", pos_encoding_mode, ("NONE", None))
    layout = _layout_code(kv_layout)
    params = _attn_params(sm_scale, logits_soft_cap, window_left)
    quant_group = _lib.int32_attr(quant_group, "quant_group")
    qc = _compat.calib(q_scale, "q_scale")
    kg, vg, kc, vc = _split_scales(k_scale, v_scale)
    qa, q_t = _lib.input_tensor(q, "q", _lib.FLOAT_CODES)
    ka, k_t = _kv_array(k, "k")
    va, v_t = _kv_array(v, "v")
    scales = _scale_pair(kg, vg, ka, va)
    _ndim(qa, "q", 2, "(num_qo_heads, head_dim)")
    params = _compat.scaled_params(params, qa.shape[1], qc, kc)
    outs = _compat.Outputs(qa.shape, qa.dtype, qa.shape[:1], return_lse, v_scale=vc)
    o_t, lse_t = outs.tensors()
    _lib.call_pooled(
        _lib.kvc_single_decode,
        (ctypes.byref(q_t), ctypes.byref(k_t), ctypes.byref(v_t), _ref(scales[0][1]),
         _ref(scales[1][1]), quant_group, layout, ctypes.byref(params), ctypes.byref(o_t),
         _ref(lse_t)),
        num_threads)
    del ka, va, scales
    return outs.result(return_lse)


# ---------------------------------------------------------------------------
# Batched decode over a paged cache

def _data_type(x, name: str, allow_quant: bool):
    """numpy dtype for a plan's q_data_type / kv_data_type (None: any): a
    numpy dtype or a name (_lib.DTYPE_ALIASES: FlashInfer's "float32" /
    "float", "float16" / "half", "bfloat16", and "int8", "int4" / "uint8")."""
    if x is None:
        return None
    try:
        dt = _lib.resolve_dtype(x, name)
    except InvalidArgumentError:
        raise InvalidArgumentError(f"{name}: unknown dtype {x!r}") from None
    code = _lib.dtype_code(dt)
    allowed = _KV_CODES if allow_quant else _lib.FLOAT_CODES
    if code not in allowed:
        raise InvalidArgumentError(f"{name}: unsupported dtype {dt}")
    return dt


#: FlashInfer's BatchDecodeWithPagedKVCacheWrapper.plan: the options it still
#: takes positionally after page_size (deprecated), in that order.
_DECODE_PLAN_LEGACY_POS_ARGS = (
    "pos_encoding_mode", "window_left", "logits_soft_cap", "q_data_type", "kv_data_type",
    "o_data_type", "data_type", "sm_scale", "rope_scale", "rope_theta", "non_blocking",
    "block_tables", "seq_lens", "fixed_split_size", "disable_split_kv", "q_len_per_req",
)


class BatchDecodeWithPagedKVCacheWrapper(_lib.NoCopy):
    """Batched decode (one query token per request) over a paged cache
    (flashinfer.BatchDecodeWithPagedKVCacheWrapper).

    ``plan`` validates and copies the page table and partitions the work (do
    it once per batch composition); ``run`` computes attention for one layer
    and may be called any number of times after it.

    Args:
        float_workspace_buffer: accepted for FlashInfer compatibility and
            ignored (the plan owns its memory); workspace_buffer is the same.
        kv_layout: "NHD" or "HND".
        use_cuda_graph: False only; use_tensor_cores, backend: GPU kernel
            choices, ignored.
        paged_kv_indptr_buffer, paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer: FlashInfer's CUDA-graph buffers,
            ignored (it only uses them with use_cuda_graph=True);
            jit_args: None only.
        num_threads: worker threads (None: all CPUs); fixed for the wrapper
            because plan partitions work for it.
    """

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None, *, num_threads=None, workspace_buffer=None):
        _compat.neutral("use_cuda_graph", use_cuda_graph, (False,))
        _compat.backend(backend)
        _compat.no_jit(jit_args)
        self._layout_name = kv_layout
        self._layout = _layout_code(kv_layout)
        self._num_threads = _threads(num_threads)
        self._pool = _lib.threadpool(self._num_threads)  # what call_pooled would look up
        self._plan = None  # kvc_decode_plan pointer
        self._info = None
        self._kvfmt = None  # a compressed-format plan: (KVFormat, page table, sm_scale, dtypes)

    @property
    def kv_layout(self) -> str:
        return "NHD" if self._layout == _lib.KVC_NHD else "HND"

    @_lib.locked
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *deprecated_positional_args, **kwargs) -> None:
        """Plans decode for one batch composition.

        The options after page_size are keyword arguments. As in FlashInfer,
        up to 16 may still be given positionally, in its legacy order
        (pos_encoding_mode, window_left, logits_soft_cap, q_data_type,
        kv_data_type, o_data_type, data_type, sm_scale, rope_scale,
        rope_theta, non_blocking, block_tables, seq_lens, fixed_split_size,
        disable_split_kv, q_len_per_req), with a DeprecationWarning.

        Args:
            indptr (B+1), indices (indptr[B]), last_page_len (B): the CSR page
                table (int32 after conversion; validated).
            num_qo_heads, num_kv_heads, head_dim, page_size: ints
                (num_qo_heads % num_kv_heads == 0).
            kv_data_type: optional cache dtype that run checks ("float32",
                "float16", "bfloat16", "int8", "int4" (uint8 arrays), any
                name of _lib.DTYPE_ALIASES such as FlashInfer's "float"
                (float32) and "half", or a numpy dtype); or a compressed format, "kivi8" or "kivi4"
                (docs/KV_FORMATS.md): run then takes the (pages, tails) pair
                (kivi8) or (pages, tails, sinks) triple (kivi4) that
                append_paged_kv_cache(kv_format=) writes (sm_scale only; no
                soft cap, window, learned sinks or calibration scales). Prefill
                over these formats stores and attends in one call:
                kvcache.kvfmt.append_attention.
            quant_group: int8/int4 caches: group size of the scales.
            q_data_type: optional q dtype that run checks.
            o_data_type: output dtype (float32, float16, bfloat16; None: q's).
            data_type: FlashInfer's deprecated dtype of q and the cache, used
                where q_data_type / kv_data_type is None.
            pos_encoding_mode ("NONE" only), rope_scale, rope_theta (ignored),
            sm_scale, logits_soft_cap, window_left: as
                single_decode_with_kv_cache.
            non_blocking, fixed_split_size, disable_split_kv: checked and
                ignored (no device copies; the split of a request depends on
                its length alone, so results are batch-invariant anyway).
            q_len_per_req: 1 only (one query token per request).
            window_right: keys to the right of the query; it sits at the
                request's last position, so any value >= -1 sees the same keys
                (checked, then ignored).
            block_tables, seq_lens: the page table as FlashInfer's trtllm-gen
                backend takes it; None only (give indptr/indices/last_page_len).
        """
        if deprecated_positional_args:
            kwargs = _compat.legacy_positional(
                "BatchDecodeWithPagedKVCacheWrapper", deprecated_positional_args,
                _DECODE_PLAN_LEGACY_POS_ARGS, kwargs)
        self._plan_impl(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                        page_size, **kwargs)

    def _plan_impl(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                   head_dim, page_size, *, pos_encoding_mode="NONE", window_left=-1,
                   logits_soft_cap=None, q_data_type=None, kv_data_type=None,
                   o_data_type=None, data_type=None, sm_scale=None, rope_scale=None,
                   rope_theta=None, non_blocking=True, fixed_split_size=None,
                   disable_split_kv=False, q_len_per_req=1, window_right=0, block_tables=None,
                   seq_lens=None, quant_group=8) -> None:
        _compat.neutral("pos_encoding_mode", pos_encoding_mode, ("NONE", None))
        _compat.neutral("q_len_per_req", q_len_per_req, (1, None))
        _compat.neutral("block_tables", block_tables, (None,))
        _compat.neutral("seq_lens", seq_lens, (None,))
        if _lib.int32_attr(window_right, "window_right") < -1:
            raise InvalidArgumentError(f"window_right must be >= -1, got {window_right!r}")
        _compat.host_options(non_blocking, fixed_split_size, disable_split_kv)
        if isinstance(kv_data_type, str) and kv_data_type.strip().lower() in ("kivi8", "kivi4"):
            self._plan_compressed(kv_data_type.strip().lower(), indptr, indices, last_page_len,
                                  num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale,
                                  logits_soft_cap, window_left, q_data_type, o_data_type)
            return
        q_data_type, kv_data_type = _compat.data_types(data_type, q_data_type, kv_data_type)
        params = _attn_params(sm_scale, logits_soft_cap, window_left)
        o_dt = _data_type(o_data_type, "o_data_type", False)
        kv_dt = _data_type(kv_data_type, "kv_data_type", True)
        q_dt = _data_type(q_data_type, "q_data_type", False)
        quant_group = _lib.int32_attr(quant_group, "quant_group")
        ints = [_lib.int32_attr(x, n) for x, n in (
            (num_qo_heads, "num_qo_heads"), (num_kv_heads, "num_kv_heads"),
            (head_dim, "head_dim"), (page_size, "page_size"))]
        idx = [_lib.int32_array(x, n) for x, n in (
            (indptr, "indptr"), (indices, "indices"), (last_page_len, "last_page_len"))]
        ts = [_lib.make_tensor(a) for a in idx]
        ptr = ctypes.c_void_p()
        _lib.check(_lib.kvc_decode_plan_create(
            ctypes.byref(ts[0]), ctypes.byref(ts[1]), ctypes.byref(ts[2]), *ints,
            self._num_threads, ctypes.byref(ptr)))
        self._free_plan()
        self._kvfmt = None
        self._plan = ptr.value
        batch = idx[0].shape[0] - 1 if idx[0].ndim == 1 and idx[0].size else 0
        self._info = {
            "batch_size": batch, "num_qo_heads": ints[0], "num_kv_heads": ints[1],
            "head_dim": ints[2], "page_size": ints[3], "kv_data_type": kv_dt,
            "q_data_type": q_dt, "o_data_type": o_dt, "quant_group": quant_group,
            "params": params,
        }

    #: FlashInfer's deprecated name for plan.
    begin_forward = plan

    @_lib.locked
    def run(self, q, paged_kv_cache, *args, kv_scale=None, return_lse=False, q_scale=None,
            k_scale=None, v_scale=None, out=None, lse=None, window_left=None, enable_pdl=None,
            sinks=None, q_len_per_req=None, skip_softmax_threshold_scale_factor=None,
            kv_cache_sf=None):
        """Decode attention for one layer.

        Args:
            q: (B, num_qo_heads, head_dim) float32/float16/bfloat16.
            paged_kv_cache: one array (max_pages, 2, page_size, H, Dh) (NHD)
                / (max_pages, 2, H, page_size, Dh) (HND), or a (k_cache,
                v_cache) pair of (max_pages, page_size, H, Dh) /
                (max_pages, H, page_size, Dh) arrays, as for
                append_paged_kv_cache; uint8 means int4.
            *args: FlashInfer's extra inputs of custom kernel variants;
                none is accepted (UnsupportedError naming them): the options
                below are keyword-only, as FlashInfer's.
            kv_scale: int8/int4 caches only (required there): scales
                mirroring the cache (one array or a pair), last dimension
                Dh / quant_group.
            return_lse: also return the base-2 log-sum-exp.
            q_scale, k_scale, v_scale: optional numbers, FlashInfer's
                calibration scales (q_scale * k_scale multiplies sm_scale,
                v_scale the output).
            out, lse: optional arrays to write o and lse into (the shapes
                and dtypes returned; lse is filled even without return_lse).
            window_left: None or the planned value; enable_pdl: ignored.
            sinks: None, or (num_qo_heads,) attention-sink logits (natural
                units, not scaled by sm_scale; -inf: none): head h's softmax
                also counts exp(sinks[h]), which takes weight from the keys
                and adds to the lse (then log2(2^lse + 2^(sinks[h] log2 e))).
            q_len_per_req: FlashInfer's deprecated run() copy of the plan
                option (a DeprecationWarning): None or 1.
            skip_softmax_threshold_scale_factor, kv_cache_sf: FlashInfer's
                skip-softmax sparsity and NVFP4 block scales; None only.

        Returns:
            o (B, num_qo_heads, head_dim) of o_data_type (None: q's dtype),
            or (o, lse (B, num_qo_heads) float32) with return_lse.
        """
        _compat.no_kernel_args("BatchDecodeWithPagedKVCacheWrapper", args)
        if (q_len_per_req is not None or skip_softmax_threshold_scale_factor is not None or
                kv_cache_sf is not None):
            _compat.no_run_extras(
                skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                kv_cache_sf=kv_cache_sf)
            if q_len_per_req is not None:
                warnings.warn("Passing q_len_per_req to BatchDecodeWithPagedKVCacheWrapper.run() "
                              "is deprecated (as in FlashInfer); pass it to plan() instead.",
                              DeprecationWarning, stacklevel=3)
                _compat.neutral("q_len_per_req", q_len_per_req, (1,))
        if self._kvfmt is not None:
            return self._run_compressed(q, paged_kv_cache, return_lse, kv_scale, q_scale,
                                        k_scale, v_scale, out, lse, window_left, sinks)
        if self._plan is None:
            raise InvalidArgumentError("BatchDecodeWithPagedKVCacheWrapper.run: call plan() first")
        info = self._info
        params, vc = _run_knobs(info, q_scale, k_scale, v_scale, window_left, enable_pdl, sinks)
        qa, q_t, pc, keep = _paged_run_inputs(info, q, paged_kv_cache, kv_scale, self._layout,
                                              "(batch_size, num_qo_heads, head_dim)")
        outs = _run_outputs(info, qa, return_lse, out, lse, vc)
        o_t, lse_t = outs.tensors()
        _lib.call_on(self._pool, _lib.kvc_decode_run,
                     (self._plan, _byref(q_t), _byref(pc), _byref(params), _byref(o_t),
                      _ref(lse_t)))
        del keep
        return outs.result(return_lse)

    #: FlashInfer's run_return_lse: run(..., return_lse=True), returning (o, lse).
    run_return_lse = functools.partialmethod(run, return_lse=True)

    @_lib.locked
    def forward(self, q, paged_kv_cache, pos_encoding_mode="NONE", q_scale=None, k_scale=None,
                v_scale=None, window_left=-1, logits_soft_cap=None, sm_scale=None,
                rope_scale=None, rope_theta=None, *, return_lse=False, kv_scale=None):
        """FlashInfer's deprecated forward(): run() after window_left,
        logits_soft_cap and sm_scale replace the planned ones (for later
        run() calls too, as in FlashInfer; nothing changes if one is
        refused); rope_scale and rope_theta are ignored ("NONE" encoding).
        return_lse (keyword-only: FlashInfer's forward takes only the
        positionals above; forward_return_lse sets it) and kv_scale
        (int8/int4 caches) as run's."""
        if self._plan is None and self._kvfmt is None:
            raise InvalidArgumentError("BatchDecodeWithPagedKVCacheWrapper.forward: call plan() "
                                       "(begin_forward) first")
        _compat.neutral("pos_encoding_mode", pos_encoding_mode, ("NONE", None))
        if self._kvfmt is not None:  # a compressed plan: sm_scale only, as its plan()
            fmt, table, _, hq, q_dt, o_dt = self._kvfmt
            if logits_soft_cap not in (None, 0, 0.0) or window_left not in (None, -1):
                raise InvalidArgumentError(f"logits_soft_cap and window_left are not supported "
                                           f"over {fmt.name} caches")
            self._kvfmt = (fmt, table, sm_scale, hq, q_dt, o_dt)
            return self.run(q, paged_kv_cache, kv_scale=kv_scale, return_lse=return_lse,
                            q_scale=q_scale,
                            k_scale=k_scale, v_scale=v_scale)
        self._info["params"] = _attn_params(sm_scale, logits_soft_cap, window_left)
        return self.run(q, paged_kv_cache, kv_scale=kv_scale, return_lse=return_lse,
                            q_scale=q_scale,
                        k_scale=k_scale, v_scale=v_scale)

    #: FlashInfer's deprecated forward_return_lse: forward(..., return_lse=True).
    forward_return_lse = functools.partialmethod(forward, return_lse=True)

    def end_forward(self) -> None:
        """FlashInfer's deprecated end_forward(): nothing to do."""

    def _plan_compressed(self, name, indptr, indices, last_page_len, num_qo_heads,
                         num_kv_heads, head_dim, page_size, sm_scale, logits_soft_cap,
                         window_left, q_data_type, o_data_type):
        """kv_data_type "kivi8"/"kivi4" (docs/KV_FORMATS.md): run then takes a
        (pages, tails) pair (kivi8) or (pages, tails, sinks) triple (kivi4), as
        append_paged_kv_cache(kv_format=) writes it, and each request's query
        sits at its last position."""
        from . import kvfmt

        if logits_soft_cap not in (None, 0, 0.0) or _lib.int32_attr(window_left,
                                                                    "window_left") != -1:
            raise InvalidArgumentError(f"{name}: logits_soft_cap and window_left are not "
                                       f"supported over compressed formats")
        fmt = kvfmt.KVFormat.member(name, num_kv_heads, head_dim, page_size)
        hq = _lib.int32_attr(num_qo_heads, "num_qo_heads")
        if hq < 1 or hq % fmt.num_kv_heads:
            raise InvalidArgumentError(f"num_qo_heads {hq} must be a multiple of num_kv_heads "
                                       f"{fmt.num_kv_heads}")
        table = (np.array(_lib.int64_array(indptr, "indptr").reshape(-1)),
                 np.array(_lib.int32_array(indices, "indices").reshape(-1)),
                 np.array(_lib.int64_array(last_page_len, "last_page_len").reshape(-1)))
        tails = np.zeros((table[2].shape[0],) + fmt.tail_shape, np.float16)
        sinks = np.zeros((table[2].shape[0],) + fmt.sink_shape, np.float16)
        kvfmt.seqs_from_table(fmt, tails, *table, sinks)  # validates the table now
        self._free_plan()
        self._info = None
        self._kvfmt = (fmt, table, sm_scale, hq, _data_type(q_data_type, "q_data_type", False),
                       _data_type(o_data_type, "o_data_type", False))

    def _run_compressed(self, q, paged_kv_cache, return_lse, kv_scale, q_scale, k_scale,
                        v_scale, out, lse, window_left, sinks):
        from . import kvfmt

        fmt, table, sm_scale, hq, q_dt, o_dt = self._kvfmt
        for name, v in (("kv_scale", kv_scale), ("q_scale", q_scale), ("k_scale", k_scale),
                        ("v_scale", v_scale), ("out", out), ("lse", lse), ("sinks", sinks)):
            if v is not None:
                raise InvalidArgumentError(f"{name} is not supported over {fmt.name} caches")
        if window_left not in (None, -1):
            raise InvalidArgumentError(f"window_left is not supported over {fmt.name} caches")
        what = "(pages, tails, sinks) triple" if fmt.sink else "(pages, tails) pair"
        if not kvfmt.is_compressed_cache(paged_kv_cache):
            raise InvalidArgumentError(
                f"a {fmt.name} plan runs on a {what}: uint8 (max_pages, {fmt.page_bytes}), "
                f"float16 (B, {', '.join(map(str, fmt.tail_shape))})" +
                (f", float16 (B, {', '.join(map(str, fmt.sink_shape))})" if fmt.sink else ""))
        pages, tails, sinks = kvfmt.cache_parts(fmt, paged_kv_cache)
        seqs = kvfmt.seqs_from_table(fmt, tails, *table, sinks)
        qa = _lib.as_array(q, "q")
        if q_dt is not None and qa.dtype != q_dt:
            raise InvalidArgumentError(f"q is {qa.dtype}, the plan said {q_dt}")
        if qa.ndim != 3 or qa.shape[:2] != (len(seqs), hq):
            raise InvalidArgumentError(f"q must be (batch_size, num_qo_heads, head_dim) = "
                                       f"({len(seqs)}, {hq}, {fmt.head_dim}), got {qa.shape}")
        if any(s.n_kv == 0 for s in seqs):
            raise InvalidArgumentError("every request needs at least one token to attend")
        res = kvfmt.attention(fmt, pages, seqs, qa, np.arange(len(seqs)),
                              [s.n_kv - 1 for s in seqs], sm_scale, True, self._num_threads)
        o = res[0] if o_dt is None else res[0].astype(o_dt)
        return (o, res[1]) if return_lse else o

    def _free_plan(self) -> None:
        if self._plan is not None:
            _lib.kvc_decode_plan_destroy(self._plan)
            self._plan = None
        self._kvfmt = None

    def __del__(self):
        try:
            self._free_plan()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass
