"""Prefill attention over kvcache storage (SEMANTICS section 5), mirroring
FlashInfer's Python API:

- :func:`single_prefill_with_kv_cache` (``flashinfer.single_prefill_with_kv_cache``);
- :class:`BatchPrefillWithPagedKVCacheWrapper` and
  :class:`BatchPrefillWithRaggedKVCacheWrapper` (plan once per batch
  composition, run once per layer).

Math (float32 inside, whatever the storage dtype), for a request with
``qo_len`` query rows and ``kv_len`` keys::

    s_ij = sm_scale * q_i . k_j           sm_scale defaults to 1/sqrt(Dh)
    s_ij = cap * tanh(s_ij / cap)         when logits_soft_cap > 0
    o_i  = sum_j softmax_j(s_i)_j v_j     over the keys row i sees
    lse_i = log2(sum_j exp(s_ij))         base 2 (FlashInfer's convention)

Row ``i`` sees key ``j`` when: with ``causal``, ``j <= i + kv_len - qo_len``
(bottom-right aligned; ``qo_len > kv_len`` is allowed, the first rows then
see nothing); with ``window_left = w >= 0`` also ``j >= i + kv_len - qo_len -
w``; a custom mask, when given, replaces causal (the window still applies).
A row that sees no key gives ``o = 0`` and ``lse = -inf``, never NaN. Query
head ``h`` reads KV head ``h // (Hq // H)``.

Masks: ``custom_mask`` holds truth values (nonzero = visible), one
``(qo_len, kv_len)`` row-major mask per request; ``packed_custom_mask`` is
the same bits packed little-endian (``kvcache.packbits(mask,
bitorder="little")``), each request padded to a whole byte. In batches both
are flat 1-D arrays with the requests concatenated in order
(:func:`kvcache.build_packed_custom_mask` builds the packed form). Give at
most one of them.

KV storage: float32, float16, ``ml_dtypes.bfloat16``, int8, or int4 given as
a **uint8** array with last dimension ``Dh / 2`` (element ``2i`` in the low
nibble); int8/int4 need scales (float32 or float16, the K/V shape with last
dimension ``Dh / quant_group``), dequantized on the fly (SEMANTICS 1).

Row independence (include/kvcache/prefill.h): a row's result depends only on
that row, the keys it sees and their positions, the parameters and the ISA;
not on the other rows or requests of the batch nor on the thread count.

Every call validates its arguments before writing anything and raises
:class:`kvcache.InvalidArgumentError` on bad input. ``num_threads=None`` uses
every CPU.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from . import _compat, _lib
from .attention import (
    _attn_params,
    _data_type,
    _kv_array,
    _kv_name,
    _ndim,
    _paged_run_inputs,
    _ref,
    _run_knobs,
    _run_outputs,
    _scale_pair,
    _split_scales,
    _threads,
)
from .errors import InvalidArgumentError, UnsupportedError
from .paged import _layout_code

__all__ = [
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
]

_F32 = np.dtype(np.float32)
_U8 = np.dtype(np.uint8)

# ---------------------------------------------------------------------------
# C prototypes (include/kvcache/prefill.h). optional_proto: importing kvcache
# still works against a libkvcache without them; calling raises
# UnsupportedError.

_TP = ctypes.POINTER(_lib.Tensor)
_vp = ctypes.c_void_p
_i32 = ctypes.c_int32
_c_int = ctypes.c_int
_AP = ctypes.POINTER(_lib.AttnParams)
_PCP = ctypes.POINTER(_lib.PagedCache)

kvc_single_prefill = _lib.optional_proto(
    "kvc_single_prefill", _c_int, _TP, _TP, _TP, _TP, _TP, _i32, _c_int, _i32, _TP, _TP, _AP,
    _TP, _TP, _vp)
kvc_prefill_plan_create_paged = _lib.optional_proto(
    "kvc_prefill_plan_create_paged", _c_int, _TP, _TP, _TP, _TP, _i32, _i32, _i32, _i32, _i32,
    _TP, _TP, _i32, ctypes.POINTER(_vp))
kvc_prefill_plan_create_ragged = _lib.optional_proto(
    "kvc_prefill_plan_create_ragged", _c_int, _TP, _TP, _i32, _i32, _i32, _i32, _TP, _TP, _i32,
    ctypes.POINTER(_vp))
kvc_prefill_plan_destroy = _lib.optional_proto("kvc_prefill_plan_destroy", None, _vp)
kvc_prefill_plan_set_causal = _lib.optional_proto("kvc_prefill_plan_set_causal", _c_int, _vp,
                                                  _i32)
kvc_prefill_run_paged = _lib.optional_proto(
    "kvc_prefill_run_paged", _c_int, _vp, _TP, _PCP, _AP, _TP, _TP, _vp)
kvc_prefill_run_ragged = _lib.optional_proto(
    "kvc_prefill_run_ragged", _c_int, _vp, _TP, _TP, _TP, _TP, _TP, _i32, _c_int, _AP, _TP,
    _TP, _vp)


# ---------------------------------------------------------------------------
# Argument helpers (shared with kvcache.cascade)


def _causal_flag(causal) -> int:
    return int(_lib.flag(causal, "causal"))


def _mask_arrays(custom_mask, packed_custom_mask):
    """(custom uint8 array|None, packed uint8 array|None) for C. custom_mask
    keeps its shape, each element 1 where true; packed_custom_mask must be
    uint8 bytes. Sizes are checked by C."""
    custom = packed = None
    if custom_mask is not None:
        arr = _lib.as_array(custom_mask, "custom_mask")
        if arr.dtype == np.bool_:
            custom = np.ascontiguousarray(arr).view(_U8)
        elif arr.dtype.kind in "iuf":
            custom = np.ascontiguousarray(np.not_equal(arr, 0)).view(_U8)
        else:
            raise InvalidArgumentError(f"custom_mask must hold booleans or numbers, got dtype "
                                       f"{arr.dtype}")
        if custom.ndim > _lib.KVC_MAX_DIMS:
            raise InvalidArgumentError(f"custom_mask: {custom.ndim} dimensions")
    if packed_custom_mask is not None:
        arr = _lib.as_array(packed_custom_mask, "packed_custom_mask")
        if arr.dtype != _U8:
            raise InvalidArgumentError(
                f"packed_custom_mask must be uint8 bytes (kvcache.packbits(mask, "
                f"bitorder='little')), got dtype {arr.dtype}")
        packed = _lib.input_array(arr, "packed_custom_mask", (_lib.KVC_U8,))
    return custom, packed


def _opt_tensor(arr):
    return None if arr is None else _lib.make_tensor(arr)


def _check_flashinfer_only(head_dim_qk, head_dim_vo, pos_encoding_mode,
                           use_fp16_qk_reduction=False) -> None:
    """FlashInfer options kvcache accepts only at their neutral values (an
    array or other odd value is refused as such, not by its truth value)."""
    if head_dim_vo is not None and _lib.int32_attr(head_dim_vo, "head_dim_vo") != head_dim_qk:
        raise UnsupportedError(f"head_dim_vo ({head_dim_vo}) must equal head_dim_qk "
                               f"({head_dim_qk}) or be None")
    if not (pos_encoding_mode is None or
            (isinstance(pos_encoding_mode, str) and pos_encoding_mode == "NONE")):
        raise UnsupportedError(f"pos_encoding_mode {pos_encoding_mode!r}: only 'NONE' (apply "
                               f"RoPE before storing K and before attention)")
    if use_fp16_qk_reduction is not None and _lib.flag(use_fp16_qk_reduction,
                                                       "use_fp16_qk_reduction"):
        raise UnsupportedError("use_fp16_qk_reduction: q.k is always accumulated in float32")


def single_prefill_with_kv_cache(q, k, v, scale_q=None, scale_k=None, scale_v=None,
                                 o_dtype=None, custom_mask=None, packed_custom_mask=None,
                                 causal=False, kv_layout="NHD", pos_encoding_mode="NONE",
                                 use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
                                 logits_soft_cap=None, rope_scale=None, rope_theta=None,
                                 backend="auto", return_lse=False, kv_cache_sf=None,
                                 k_scale=None, v_scale=None, *, quant_group=8,
                                 num_threads=None, out_dtype=None):
    """Prefill attention of one request's query rows over its K/V
    (flashinfer.single_prefill_with_kv_cache; arguments in its order).

    Args:
        q: (qo_len, Hq, Dh) float32/float16/bfloat16.
        k, v: (kv_len, H, Dh) for "NHD" or (H, kv_len, Dh) for "HND":
            float32, float16, bfloat16, int8, or uint8 (packed int4, last
            dimension Dh / 2). Hq % H == 0.
        scale_q, scale_k, scale_v, kv_cache_sf: FlashInfer's fp8/fp4 inputs,
            None only.
        o_dtype: output dtype (float32, float16, bfloat16; None: q's);
            out_dtype is the same.
        custom_mask: optional (qo_len, kv_len) (or flat) truth values,
            nonzero = visible; replaces causal.
        packed_custom_mask: optional uint8, the mask packed little-endian
            (ceil(qo_len * kv_len / 8) bytes).
        causal: bottom-right causal mask (ignored with a custom mask).
        kv_layout: "NHD" or "HND".
        pos_encoding_mode: "NONE" only; use_fp16_qk_reduction: False only;
            backend: a FlashInfer kernel choice, ignored; rope_scale, rope_theta:
            ignored.
        sm_scale: None for 1/sqrt(Dh).
        window_left: -1 for none, else row i sees keys
            j >= i + kv_len - qo_len - window_left.
        logits_soft_cap: None/0 for none, else cap * tanh(s / cap).
        return_lse: also return the base-2 log-sum-exp.
        k_scale, v_scale: for int8/int4 k/v, arrays of float32/float16 group
            scales, k's shape with last dimension Dh / quant_group; a number
            is FlashInfer's calibration scale instead (k_scale multiplies
            sm_scale, v_scale the output).
        quant_group: int8/int4 group size (divides Dh, even for int4).
        num_threads: worker threads (None: all CPUs).

    Returns:
        o (qo_len, Hq, Dh), or (o, lse (qo_len, Hq) float32) with return_lse.
    """
    for name, x in (("scale_q", scale_q), ("scale_k", scale_k), ("scale_v", scale_v),
                    ("kv_cache_sf", kv_cache_sf)):
        _compat.neutral(name, x, (None,))
    _compat.backend(backend)
    _check_flashinfer_only(None, None, pos_encoding_mode, use_fp16_qk_reduction)
    if o_dtype is not None and out_dtype is not None:
        raise InvalidArgumentError("give o_dtype or out_dtype (the same), not both")
    o_dtype = o_dtype if o_dtype is not None else out_dtype
    layout = _layout_code(kv_layout)
    params = _attn_params(sm_scale, logits_soft_cap, window_left)
    quant_group = _lib.int32_attr(quant_group, "quant_group")
    causal = _causal_flag(causal)
    kg, vg, kc, vc = _split_scales(k_scale, v_scale)
    qa, q_t = _lib.input_tensor(q, "q", _lib.FLOAT_CODES)
    ka, k_t = _kv_array(k, "k")
    va, v_t = _kv_array(v, "v")
    scales = _scale_pair(kg, vg, ka, va)
    custom, packed = _mask_arrays(custom_mask, packed_custom_mask)
    _ndim(qa, "q", 3, "(qo_len, num_qo_heads, head_dim)")
    params = _compat.scaled_params(params, qa.shape[2], None, kc)
    o_dt = qa.dtype if o_dtype is None else _data_type(o_dtype, "o_dtype", False)
    outs = _compat.Outputs(qa.shape, o_dt, qa.shape[:2], return_lse, v_scale=vc)
    o_t, lse_t = outs.tensors()
    cm_t, pm_t = _opt_tensor(custom), _opt_tensor(packed)
    _lib.call_pooled(
        kvc_single_prefill,
        (ctypes.byref(q_t), ctypes.byref(k_t), ctypes.byref(v_t), _ref(scales[0][1]),
         _ref(scales[1][1]), quant_group, layout, causal, _ref(cm_t), _ref(pm_t),
         ctypes.byref(params), ctypes.byref(o_t), _ref(lse_t)),
        num_threads)
    del ka, va, scales, custom, packed
    return outs.result(return_lse)


def single_prefill_with_kv_cache_return_lse(q, k, v, scale_q=None, scale_k=None, scale_v=None,
                                            o_dtype=None, custom_mask=None,
                                            packed_custom_mask=None, causal=False,
                                            kv_layout="NHD", pos_encoding_mode="NONE",
                                            use_fp16_qk_reduction=False, sm_scale=None,
                                            window_left=-1, logits_soft_cap=None,
                                            rope_scale=None, rope_theta=None, backend="auto", *,
                                            return_lse=True, **kwargs):
    """flashinfer.single_prefill_with_kv_cache_return_lse: the same call as
    single_prefill_with_kv_cache (arguments in FlashInfer's order, the rest
    (kv_cache_sf, k_scale, v_scale, quant_group, num_threads, out_dtype) by
    keyword), returning (o, lse) unless return_lse=False."""
    return single_prefill_with_kv_cache(
        q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal,
        kv_layout, pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left,
        logits_soft_cap, rope_scale, rope_theta, backend, return_lse, **kwargs)


# ---------------------------------------------------------------------------
# Batched prefill


class _PrefillWrapperBase(_lib.NoCopy):
    """Shared plan state of the paged and ragged wrappers."""

    _name = "BatchPrefillWrapper"

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False, *,
                 num_threads=None, workspace_buffer=None):
        _compat.neutral("use_cuda_graph", use_cuda_graph, (False,))
        self._layout_name = kv_layout
        self._layout = _layout_code(kv_layout)
        self._num_threads = _threads(num_threads)
        self._pool = _lib.threadpool(self._num_threads)  # what call_pooled would look up
        self._plan = None  # kvc_prefill_plan pointer
        self._info = None

    @property
    def kv_layout(self) -> str:
        return "NHD" if self._layout == _lib.KVC_NHD else "HND"

    def _plan_common(self, qo_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                     custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                     use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap,
                     q_data_type, kv_data_type, o_data_type, quant_group):
        _check_flashinfer_only(head_dim_qk, head_dim_vo, pos_encoding_mode,
                               use_fp16_qk_reduction)
        params = _attn_params(sm_scale, logits_soft_cap, window_left)
        info = {
            "params": params,
            "q_data_type": _data_type(q_data_type, "q_data_type", False),
            "kv_data_type": _data_type(kv_data_type, "kv_data_type", True),
            "o_data_type": _data_type(o_data_type, "o_data_type", False),
            "quant_group": _lib.int32_attr(quant_group, "quant_group"),
            "causal": _causal_flag(causal),
        }
        heads = [_lib.int32_attr(x, n) for x, n in (
            (num_qo_heads, "num_qo_heads"), (num_kv_heads, "num_kv_heads"),
            (head_dim_qk, "head_dim_qk"))]
        qo = _lib.int32_array(qo_indptr, "qo_indptr")
        custom, packed = _mask_arrays(custom_mask, packed_custom_mask)
        info["num_qo_heads"], info["num_kv_heads"], info["head_dim"] = heads
        info["nnz_qo"] = int(qo[-1]) if qo.ndim == 1 and qo.size else 0
        return info, heads, qo, custom, packed

    def _install(self, ptr, info) -> None:
        self._free_plan()
        self._plan = ptr.value
        self._info = info

    def _forward_options(self, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left,
                         logits_soft_cap, sm_scale) -> None:
        """FlashInfer's deprecated forward(): its attention options replace
        the planned ones, for later run() calls too (as FlashInfer keeps
        them); nothing changes if one is refused."""
        if self._plan is None:
            raise InvalidArgumentError(f"{self._name}.forward: call plan() (begin_forward) "
                                       f"first")
        _check_flashinfer_only(None, None, pos_encoding_mode, use_fp16_qk_reduction)
        params = _attn_params(sm_scale, logits_soft_cap, window_left)
        c = _causal_flag(causal)
        _lib.check(kvc_prefill_plan_set_causal(self._plan, c))
        self._info["causal"], self._info["params"] = c, params

    def end_forward(self) -> None:
        """FlashInfer's deprecated end_forward(): nothing to do."""

    def _check_q(self, q):
        """(q array, q tensor), checked against the plan."""
        if self._plan is None:
            raise InvalidArgumentError(f"{self._name}.run: call plan() first")
        info = self._info
        qa, q_t = _lib.input_tensor(q, "q", _lib.FLOAT_CODES)
        if info["q_data_type"] is not None and qa.dtype != info["q_data_type"]:
            raise InvalidArgumentError(f"q is {qa.dtype} but plan() was given q_data_type "
                                       f"{info['q_data_type']}")
        _ndim(qa, "q", 3, "(qo_indptr[-1], num_qo_heads, head_dim)")
        return qa, q_t

    def _check_kv_dtype(self, arrays, what) -> None:
        kv_dt = self._info["kv_data_type"]
        if kv_dt is None:
            return
        for a in arrays:
            if a.dtype != kv_dt:
                raise InvalidArgumentError(f"{what} is {_kv_name(a.dtype)} but plan() was "
                                           f"given kv_data_type {_kv_name(kv_dt)}")

    def _free_plan(self) -> None:
        if self._plan is not None:
            kvc_prefill_plan_destroy(self._plan)
            self._plan = None

    def __del__(self):
        try:
            self._free_plan()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


class BatchPrefillWithPagedKVCacheWrapper(_PrefillWrapperBase):
    """Batched prefill (any number of query rows per request) over a paged
    cache (flashinfer.BatchPrefillWithPagedKVCacheWrapper).

    ``plan`` validates and copies the page table, qo_indptr and masks and
    partitions the work (once per batch composition); ``run`` computes one
    layer and may be called any number of times after it.

    Args:
        float_workspace_buffer: accepted for FlashInfer compatibility and
            ignored (the plan owns its memory); workspace_buffer is the same.
        kv_layout: "NHD" or "HND".
        use_cuda_graph: False only.
        qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
            paged_kv_last_page_len_buf, custom_mask_buf, mask_indptr_buf:
            FlashInfer's CUDA-graph buffers, ignored (it only uses them with
            use_cuda_graph=True); backend: a GPU kernel choice, ignored;
            jit_args, jit_kwargs: None only.
        num_threads: worker threads (None: all CPUs); fixed for the wrapper
            because plan partitions work for it.
    """

    _name = "BatchPrefillWithPagedKVCacheWrapper"

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend="auto", jit_args=None, jit_kwargs=None, *, num_threads=None,
                 workspace_buffer=None):
        _compat.backend(backend)
        _compat.no_jit(jit_args, jit_kwargs)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph,
                         num_threads=num_threads, workspace_buffer=workspace_buffer)

    @_lib.locked
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
             window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type=None, kv_data_type=None, o_data_type=None, non_blocking=True,
             prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0,
             max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None,
             disable_split_kv=False, *, quant_group=8) -> None:
        """Plans prefill for one batch composition (FlashInfer's arguments in
        its order, so positional calls mean the same).

        Args:
            qo_indptr (B+1): request b's query rows are
                [qo_indptr[b], qo_indptr[b+1]) (0 rows allowed).
            paged_kv_indptr (B+1), paged_kv_indices, paged_kv_last_page_len
                (B): the CSR page table (int32 after conversion; validated).
            num_qo_heads, num_kv_heads, head_dim_qk, page_size: ints
                (num_qo_heads % num_kv_heads == 0).
            head_dim_vo: None or head_dim_qk.
            custom_mask: optional flat truth values, request b's
                (qo_len_b, kv_len_b) mask row-major, concatenated.
            packed_custom_mask: optional uint8, each request's mask packed
                little-endian and padded to a byte, concatenated.
            causal: bottom-right causal mask (ignored with a custom mask).
            pos_encoding_mode: "NONE" only; use_fp16_qk_reduction: False only.
            sm_scale, window_left, logits_soft_cap: as
                single_prefill_with_kv_cache.
            q_data_type, kv_data_type: optional dtypes that run checks
                ("float32", "float16", "bfloat16"; kv also "int8", "int4"; any
                name of _lib.DTYPE_ALIASES, FlashInfer's "float" and "half" too).
            o_data_type: output dtype (None: q's).
            rope_scale, rope_theta: ignored ("NONE" encoding).
            non_blocking, fixed_split_size, disable_split_kv: checked and
                ignored (no device copies; the split of a request depends on
                its length alone, so results are batch-invariant anyway).
            prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len,
                max_item_len_ptr (multi-item scoring), seq_lens, seq_lens_q,
                block_tables, max_token_per_sequence, max_sequence_kv
                (FlashInfer's trtllm-gen/cudnn forms of the page table):
                None (and 0) only.
            quant_group: int8/int4 caches: group size of the scales.
        """
        _compat.host_options(non_blocking, fixed_split_size, disable_split_kv)
        _compat.no_variant_inputs(
            prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
            token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr,
            seq_lens=seq_lens, seq_lens_q=seq_lens_q, block_tables=block_tables,
            max_token_per_sequence=max_token_per_sequence, max_sequence_kv=max_sequence_kv)
        info, heads, qo, custom, packed = self._plan_common(
            qo_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, custom_mask,
            packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction, sm_scale,
            window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, quant_group)
        page_size = _lib.int32_attr(page_size, "page_size")
        idx = [_lib.int32_array(x, n) for x, n in (
            (paged_kv_indptr, "paged_kv_indptr"), (paged_kv_indices, "paged_kv_indices"),
            (paged_kv_last_page_len, "paged_kv_last_page_len"))]
        ts = [_lib.make_tensor(a) for a in [qo] + idx]
        cm_t, pm_t = _opt_tensor(custom), _opt_tensor(packed)
        ptr = ctypes.c_void_p()
        _lib.check(kvc_prefill_plan_create_paged(
            *(ctypes.byref(t) for t in ts), *heads, page_size, info["causal"], _ref(cm_t),
            _ref(pm_t), self._num_threads, ctypes.byref(ptr)))
        info["page_size"] = page_size
        self._install(ptr, info)

    #: FlashInfer's deprecated name for plan.
    begin_forward = plan

    @_lib.locked
    def run(self, q, paged_kv_cache, *args, kv_scale=None, return_lse=False, q_scale=None,
            k_scale=None, v_scale=None, out=None, lse=None, window_left=None, enable_pdl=None,
            sinks=None, kv_cache_sf=None, skip_softmax_threshold_scale_factor=None,
            use_fp16_softmax=None, uses_spcompress=None):
        """Prefill attention for one layer.

        Args:
            q: (qo_indptr[-1], num_qo_heads, head_dim) float32/float16/bfloat16.
            paged_kv_cache: one array (max_pages, 2, page_size, H, Dh) (NHD)
                / (max_pages, 2, H, page_size, Dh) (HND), or a (k_cache,
                v_cache) pair of (max_pages, page_size, H, Dh) /
                (max_pages, H, page_size, Dh) arrays; uint8 means int4. Only
                read (read-only arrays are fine).
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
            sinks: as BatchDecodeWithPagedKVCacheWrapper.run: None or
                (num_qo_heads,) attention-sink logits.
            kv_cache_sf, skip_softmax_threshold_scale_factor: FlashInfer's
                NVFP4 block scales and skip-softmax sparsity, None only;
                use_fp16_softmax, uses_spcompress: None or False (the
                softmax is float32).

        Returns:
            o (qo_indptr[-1], num_qo_heads, head_dim), or (o, lse
            (qo_indptr[-1], num_qo_heads) float32) with return_lse.
        """
        _compat.no_kernel_args(self._name, args)
        if (kv_cache_sf is not None or skip_softmax_threshold_scale_factor is not None or
                use_fp16_softmax is not None or uses_spcompress is not None):
            _compat.no_run_extras(
                kv_cache_sf=kv_cache_sf,
                skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                use_fp16_softmax=use_fp16_softmax, uses_spcompress=uses_spcompress)
        if self._plan is None:
            raise InvalidArgumentError(f"{self._name}.run: call plan() first")
        info = self._info
        params, vc = _run_knobs(info, q_scale, k_scale, v_scale, window_left, enable_pdl, sinks)
        qa, q_t, pc, keep = _paged_run_inputs(info, q, paged_kv_cache, kv_scale, self._layout,
                                              "(qo_indptr[-1], num_qo_heads, head_dim)")
        outs = _run_outputs(info, qa, return_lse, out, lse, vc)
        o_t, lse_t = outs.tensors()
        br = ctypes.byref
        _lib.call_on(self._pool, kvc_prefill_run_paged,
                     (self._plan, br(q_t), br(pc), br(params), br(o_t), _ref(lse_t)))
        del keep
        return outs.result(return_lse)

    #: FlashInfer's run_return_lse: run(..., return_lse=True), returning (o, lse).
    run_return_lse = functools.partialmethod(run, return_lse=True)

    @_lib.locked
    def forward(self, q, paged_kv_cache, causal=False, pos_encoding_mode="NONE",
                use_fp16_qk_reduction=False, k_scale=None, v_scale=None, window_left=-1,
                logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, *,
                return_lse=False, kv_scale=None):
        """FlashInfer's deprecated forward(): run() after these options
        replace the planned causal, window_left, logits_soft_cap and sm_scale
        (for later run() calls too, as in FlashInfer); rope_scale and
        rope_theta are ignored ("NONE" encoding). return_lse (keyword-only,
        as FlashInfer's forward has no such positional; forward_return_lse
        sets it) and kv_scale (int8/int4 caches) as run's."""
        self._forward_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left,
                              logits_soft_cap, sm_scale)
        return self.run(q, paged_kv_cache, kv_scale=kv_scale, return_lse=return_lse,
                        k_scale=k_scale, v_scale=v_scale)

    #: FlashInfer's deprecated forward_return_lse: forward(..., return_lse=True).
    forward_return_lse = functools.partialmethod(forward, return_lse=True)


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapperBase):
    """Batched prefill over ragged K/V (flashinfer.BatchPrefillWithRaggedKVCacheWrapper):
    request b's keys are rows [kv_indptr[b], kv_indptr[b+1]) of k and v.

    Args:
        float_workspace_buffer (workspace_buffer): accepted for FlashInfer
            compatibility and ignored; use_cuda_graph: False only.
        kv_layout: "NHD" (k/v (kv_indptr[-1], H, Dh)) or "HND"
            ((H, kv_indptr[-1], Dh)).
        qo_indptr_buf, kv_indptr_buf, custom_mask_buf, mask_indptr_buf:
            FlashInfer's CUDA-graph buffers, ignored; backend: a GPU kernel
            choice, ignored; jit_args, jit_kwargs: None only.
        num_threads: worker threads (None: all CPUs); fixed for the wrapper.
    """

    _name = "BatchPrefillWithRaggedKVCacheWrapper"

    def __init__(self, float_workspace_buffer=None, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None,
                 mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None, *,
                 num_threads=None, workspace_buffer=None):
        _compat.backend(backend)
        _compat.no_jit(jit_args, jit_kwargs)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph,
                         num_threads=num_threads, workspace_buffer=workspace_buffer)

    @_lib.locked
    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk,
             head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, window_left=-1,
             logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None,
             q_data_type=None, kv_data_type=None, o_data_type=None, non_blocking=True,
             prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0,
             max_item_len_ptr=None, fixed_split_size=None, disable_split_kv=False,
             seq_lens=None, seq_lens_q=None, max_token_per_sequence=None,
             max_sequence_kv=None, v_indptr=None, o_indptr=None, *, quant_group=8) -> None:
        """Plans prefill for one batch composition (FlashInfer's arguments in
        its order, which differs from the paged wrapper's: window_left,
        logits_soft_cap, then sm_scale).

        Args:
            qo_indptr (B+1), kv_indptr (B+1): query rows and key rows of each
                request (both start at 0, non-decreasing; validated).
            v_indptr, o_indptr: FlashInfer's cudnn-only separate V / output
                offsets; None only.
            Others: as BatchPrefillWithPagedKVCacheWrapper.plan.
        """
        _compat.host_options(non_blocking, fixed_split_size, disable_split_kv)
        _compat.no_variant_inputs(
            prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
            token_pos_in_items_len=token_pos_in_items_len, max_item_len_ptr=max_item_len_ptr,
            seq_lens=seq_lens, seq_lens_q=seq_lens_q,
            max_token_per_sequence=max_token_per_sequence, max_sequence_kv=max_sequence_kv,
            v_indptr=v_indptr, o_indptr=o_indptr)
        info, heads, qo, custom, packed = self._plan_common(
            qo_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, custom_mask,
            packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction, sm_scale,
            window_left, logits_soft_cap, q_data_type, kv_data_type, o_data_type, quant_group)
        kv = _lib.int32_array(kv_indptr, "kv_indptr")
        qo_t, kv_t = _lib.make_tensor(qo), _lib.make_tensor(kv)
        cm_t, pm_t = _opt_tensor(custom), _opt_tensor(packed)
        ptr = ctypes.c_void_p()
        _lib.check(kvc_prefill_plan_create_ragged(
            ctypes.byref(qo_t), ctypes.byref(kv_t), *heads, info["causal"], _ref(cm_t),
            _ref(pm_t), self._num_threads, ctypes.byref(ptr)))
        self._install(ptr, info)

    #: FlashInfer's deprecated name for plan.
    begin_forward = plan

    @_lib.locked
    def run(self, q, k, v, *args, kv_scale=None, return_lse=False, q_scale=None, k_scale=None,
            v_scale=None, o_scale=None, out=None, lse=None, window_left=None, enable_pdl=None,
            sinks=None, kv_cache_sf=None):
        """Prefill attention for one layer.

        Args:
            q: (qo_indptr[-1], num_qo_heads, head_dim) float32/float16/bfloat16.
            k, v: (kv_indptr[-1], H, Dh) (NHD) or (H, kv_indptr[-1], Dh)
                (HND): float32, float16, bfloat16, int8 or uint8 (int4).
            *args: none accepted, as the paged wrapper's run (options are
                keyword-only).
            kv_scale: int8/int4 only (required there): a (k_scale, v_scale)
                pair of float32/float16 arrays, k's shape with last
                dimension Dh / quant_group.
            return_lse: also return the base-2 log-sum-exp.
            q_scale, k_scale, v_scale, out, lse, window_left, enable_pdl,
                sinks: as the paged wrapper's run.
            o_scale, kv_cache_sf: FlashInfer's fp8 output scale and NVFP4
                block scales; None only.

        Returns:
            o, or (o, lse) with return_lse, as the paged wrapper.
        """
        _compat.no_kernel_args(self._name, args)
        if o_scale is not None or kv_cache_sf is not None:
            _compat.no_run_extras(o_scale=o_scale, kv_cache_sf=kv_cache_sf)
        qa, q_t = self._check_q(q)
        info = self._info
        params, vc = _run_knobs(info, q_scale, k_scale, v_scale, window_left, enable_pdl, sinks)
        ka, k_t = _kv_array(k, "k")
        va, v_t = _kv_array(v, "v")
        self._check_kv_dtype((ka, va), "k/v")
        if kv_scale is None:
            kg = vg = None
        elif isinstance(kv_scale, (tuple, list)) and len(kv_scale) == 2:
            kg, vg = kv_scale
        else:
            raise InvalidArgumentError("kv_scale must be a (k_scale, v_scale) pair for ragged "
                                       "k and v")
        scales = _scale_pair(kg, vg, ka, va, ("kv_scale[0]", "kv_scale[1]"))
        outs = _run_outputs(info, qa, return_lse, out, lse, vc)
        o_t, lse_t = outs.tensors()
        br = ctypes.byref
        _lib.call_on(
            self._pool, kvc_prefill_run_ragged,
            (self._plan, br(q_t), br(k_t), br(v_t), _ref(scales[0][1]), _ref(scales[1][1]),
             info["quant_group"], self._layout, br(params), br(o_t), _ref(lse_t)))
        del ka, va, scales
        return outs.result(return_lse)

    #: FlashInfer's run_return_lse: run(..., return_lse=True), returning (o, lse).
    run_return_lse = functools.partialmethod(run, return_lse=True)

    @_lib.locked
    def forward(self, q, k, v, causal=False, pos_encoding_mode="NONE",
                use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None,
                sm_scale=None, rope_scale=None, rope_theta=None, *, return_lse=False,
                kv_scale=None):
        """FlashInfer's deprecated forward(): run() after these options
        replace the planned ones (as BatchPrefillWithPagedKVCacheWrapper.forward;
        kv_scale: int8/int4 k/v, as run's)."""
        self._forward_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left,
                              logits_soft_cap, sm_scale)
        return self.run(q, k, v, kv_scale=kv_scale, return_lse=return_lse)

    #: FlashInfer's deprecated forward_return_lse: forward(..., return_lse=True).
    forward_return_lse = functools.partialmethod(forward, return_lse=True)
