"""Multi-head latent attention (MLA) over paged ckv/kpe caches, mirroring
``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (include/kvcache/mla.h).

DeepSeek-style absorbed MLA: all ``num_heads`` query heads share one latent
KV per token, ``ckv`` (``head_dim_ckv``) and ``kpe`` (``head_dim_kpe``)::

    s_j  = sm_scale * (q_nope[h] . ckv_j + q_pe[h] . kpe_j)
    s_j  = cap * tanh(s_j / cap)           when logits_soft_cap > 0
    o[h] = sum_j softmax(s)_j ckv_j        (head_dim_ckv wide, float32 inside)
    lse  = log2(sum_j exp(s_j))            base 2 (return_lse_base_on_e: base e)

With ``causal=True`` query row ``i`` of a request with ``qo_len`` rows sees
key ``j`` iff ``j <= i + kv_len - qo_len`` (bottom-right aligned: decode,
qo_len 1, sees everything; several rows verify speculative tokens). A row
that sees no key gives o = 0 and lse = -inf.

Caches: ``ckv_cache`` (num_pages, page_size, head_dim_ckv) and ``kpe_cache``
(num_pages, page_size, head_dim_kpe), float32/float16/``ml_dtypes.bfloat16``
(possibly different, possibly slices of one (num_pages, page_size,
head_dim_ckv + head_dim_kpe) array), as :func:`kvcache.append_paged_mla_kv_cache`
writes them. head_dim_ckv: a multiple of 16 up to 512; head_dim_kpe: a
multiple of 16 up to 128, or 0.

Every call validates before writing anything and raises
:class:`kvcache.InvalidArgumentError` (or :class:`kvcache.UnsupportedError`
for head dims) on bad input. Results do not depend on ``num_threads``.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from . import _compat, _lib
from .errors import InvalidArgumentError, UnsupportedError

__all__ = ["BatchMLAPagedAttentionWrapper"]

_F32 = np.dtype(np.float32)
_vp = ctypes.c_void_p
_TP = ctypes.POINTER(_lib.Tensor)
_i32 = ctypes.c_int32

_kvc_mla_plan_create = _lib.optional_proto(
    "kvc_mla_plan_create", ctypes.c_int, _TP, _TP, _TP, _TP, _i32, _i32, _i32, _i32, _i32,
    ctypes.c_float, ctypes.c_float, ctypes.POINTER(_vp),
)
_kvc_mla_plan_destroy = _lib.optional_proto("kvc_mla_plan_destroy", None, _vp)
_kvc_mla_run = _lib.optional_proto(
    "kvc_mla_run", ctypes.c_int, _vp, _TP, _TP, _TP, _TP, _TP, _TP, _vp,
)
_kvc_mla_plan_chunk = _lib.optional_proto("kvc_mla_plan_chunk", ctypes.c_int64, _vp)


def _ref(t):
    return ctypes.byref(t) if t is not None else None


def _float_type(x, name: str):
    """numpy dtype of a plan's q_data_type / kv_data_type (None: not checked)."""
    if x is None:
        return None
    dt = _lib.resolve_dtype(x, name)
    if _lib.dtype_code(dt) not in _lib.FLOAT_CODES:
        raise InvalidArgumentError(f"{name} must be float32, float16 or bfloat16, got {dt}")
    return dt


def _number(x, name: str, what: str) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{name} must be a number, got {x!r}") from exc
    if not math.isfinite(v):
        raise InvalidArgumentError(f"{name} must be finite ({what}), got {x!r}")
    return v


class BatchMLAPagedAttentionWrapper(_lib.NoCopy):
    """Batched MLA attention over paged ckv/kpe caches
    (flashinfer.mla.BatchMLAPagedAttentionWrapper).

    ``plan`` validates and copies the page table and splits the work (once
    per batch composition); ``run`` computes one layer and may be called any
    number of times after it.

    Args:
        float_workspace_buffer: accepted for FlashInfer compatibility and
            ignored (the plan owns its memory); workspace_buffer is the same.
        use_cuda_graph, qo_indptr, kv_indptr, kv_indices, kv_len_arr, backend:
            FlashInfer's CUDA-graph buffers and backend choice; accepted and
            ignored.
        num_threads: worker threads (None: all CPUs).
    """

    def __init__(self, float_workspace_buffer=None, use_cuda_graph=False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto", *,
                 num_threads=None, workspace_buffer=None):
        _compat.backend(backend)
        _lib.threadpool(num_threads)  # validates num_threads early
        self._num_threads = num_threads
        self._plan = None  # kvc_mla_plan pointer
        self._info = None

    @_lib.locked
    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type=None, kv_data_type=None,
             use_profiler=False, *, logits_soft_cap=None) -> None:
        """Plans MLA attention for one batch composition.

        Args:
            qo_indptr: (B+1) ints, request b owns query rows
                [qo_indptr[b], qo_indptr[b+1]).
            kv_indptr: (B+1), kv_indices: (>= kv_indptr[B]): the CSR page table.
            kv_len_arr: (B) keys per request; request b must own exactly
                ceil(kv_len_arr[b] / page_size) pages.
            num_heads, head_dim_ckv, head_dim_kpe, page_size: ints.
            causal: bottom-right causal mask over each request's query rows.
            sm_scale: required, finite and nonzero (e.g. 1/sqrt(128 + 64) for
                DeepSeek's pre-absorption head dim).
            q_data_type, kv_data_type: optional dtypes run checks q_nope/q_pe
                and ckv_cache/kpe_cache against ("float32", "float16",
                "bfloat16", FlashInfer's "float" (float32) and "half", or
                numpy dtypes).
            use_profiler: must be False (no profiler here).
            logits_soft_cap: None or 0 for none, else cap * tanh(s / cap).
        """
        if use_profiler is not None and _lib.flag(use_profiler, "use_profiler"):
            raise UnsupportedError("BatchMLAPagedAttentionWrapper.plan: use_profiler is not "
                                   "supported")
        ints = [_lib.int32_attr(x, n) for x, n in (
            (num_heads, "num_heads"), (head_dim_ckv, "head_dim_ckv"),
            (head_dim_kpe, "head_dim_kpe"), (page_size, "page_size"))]
        causal = _lib.flag(causal, "causal")
        if sm_scale is None:
            raise InvalidArgumentError("sm_scale is required for MLA (e.g. 1/sqrt(128 + 64))")
        scale = _number(sm_scale, "sm_scale", "and nonzero")
        cap = 0.0 if logits_soft_cap is None else _number(logits_soft_cap, "logits_soft_cap",
                                                           ">= 0")
        q_dt = _float_type(q_data_type, "q_data_type")
        kv_dt = _float_type(kv_data_type, "kv_data_type")
        idx = [_lib.int32_array(x, n) for x, n in (
            (qo_indptr, "qo_indptr"), (kv_indptr, "kv_indptr"), (kv_indices, "kv_indices"),
            (kv_len_arr, "kv_len_arr"))]
        ts = [_lib.make_tensor(a) for a in idx]
        ptr = ctypes.c_void_p()
        _lib.check(_kvc_mla_plan_create(*(ctypes.byref(t) for t in ts), *ints, int(causal),
                                        scale, cap, ctypes.byref(ptr)))
        self._free_plan()
        self._plan = ptr.value
        rows = int(idx[0][-1]) if idx[0].ndim == 1 and idx[0].size else 0
        self._info = {"rows": rows, "num_heads": ints[0], "head_dim_ckv": ints[1],
                      "head_dim_kpe": ints[2], "q_data_type": q_dt, "kv_data_type": kv_dt}

    @_lib.locked
    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False,
            profiler_buffer=None, kv_len=None, page_table=None, return_lse_base_on_e=False,
            o_scale=None, *, ckv_scale=None, ckv_scale_arr=None, kpe_scale=None):
        """MLA attention for one layer.

        Args:
            q_nope: (N, num_heads, head_dim_ckv) float32/float16/bfloat16,
                N = qo_indptr[-1].
            q_pe: (N, num_heads, head_dim_kpe), same choice of dtypes.
            ckv_cache: (num_pages, page_size, head_dim_ckv).
            kpe_cache: (num_pages, page_size, head_dim_kpe).
            out: optional (N, num_heads, head_dim_ckv) float array written in
                place (default: a new array of q_nope's dtype).
            lse: optional (N, num_heads) float32 array written in place.
            return_lse: also return lse.
            profiler_buffer, kv_len, page_table: FlashInfer backend-specific
                inputs; must be None.
            return_lse_base_on_e: lse in natural log instead of base 2.
            o_scale (FlashInfer's cutlass fp8 output scale), ckv_scale,
                ckv_scale_arr, kpe_scale (its fp8 cache scales): None only
                (FlashInfer too refuses them for a 16-bit cache).

        Returns:
            out, or (out, lse (N, num_heads) float32) with return_lse.
        """
        if self._plan is None:
            raise InvalidArgumentError("BatchMLAPagedAttentionWrapper.run: call plan() first")
        for v, n in ((profiler_buffer, "profiler_buffer"), (kv_len, "kv_len"),
                     (page_table, "page_table")):
            if v is not None:
                raise UnsupportedError(f"BatchMLAPagedAttentionWrapper.run: {n} is not "
                                       f"supported (the plan holds the page table)")
        if (o_scale is not None or ckv_scale is not None or ckv_scale_arr is not None or
                kpe_scale is not None):
            _compat.no_run_extras(o_scale=o_scale, ckv_scale=ckv_scale,
                                  ckv_scale_arr=ckv_scale_arr, kpe_scale=kpe_scale)
        info = self._info
        return_lse = _lib.flag(return_lse, "return_lse")
        _lib.flag(return_lse_base_on_e, "return_lse_base_on_e")
        qn, qn_t = _lib.input_tensor(q_nope, "q_nope", _lib.FLOAT_CODES)
        qp, qp_t = _lib.input_tensor(q_pe, "q_pe", _lib.FLOAT_CODES)
        ckv, ckv_t = _lib.input_tensor(ckv_cache, "ckv_cache", _lib.FLOAT_CODES)
        kpe, kpe_t = _lib.input_tensor(kpe_cache, "kpe_cache", _lib.FLOAT_CODES)
        for arr, name, key in ((qn, "q_nope", "q_data_type"), (qp, "q_pe", "q_data_type"),
                               (ckv, "ckv_cache", "kv_data_type"),
                               (kpe, "kpe_cache", "kv_data_type")):
            want = info[key]
            if want is not None and arr.dtype != want:
                raise InvalidArgumentError(f"{name} is {arr.dtype} but plan() was given "
                                           f"{key} {want}")
        shape = (info["rows"], info["num_heads"], info["head_dim_ckv"])
        if out is None:
            if qn.ndim != 3:
                raise InvalidArgumentError(f"q_nope must be (N, num_heads, head_dim_ckv), got "
                                           f"shape {qn.shape}")
            o = np.empty(qn.shape, qn.dtype)
        else:
            o = _lib.inplace_array(out, "out")
            if o.shape != shape:
                raise InvalidArgumentError(f"out has shape {o.shape}, expected {shape}")
        if lse is not None:
            lse_arr = _lib.inplace_array(lse, "lse")
            if lse_arr.dtype != _F32:
                raise InvalidArgumentError(f"lse must be float32, got {lse_arr.dtype}")
        elif return_lse:
            lse_arr = np.empty(qn.shape[:2] if qn.ndim == 3 else (0, 0), _F32)
        else:
            lse_arr = None
        o_t = _lib.make_tensor(o)
        lse_t = _lib.make_tensor(lse_arr) if lse_arr is not None else None
        br = ctypes.byref
        _lib.call_pooled(_kvc_mla_run,
                         (self._plan, br(qn_t), br(qp_t), br(ckv_t), br(kpe_t), br(o_t),
                          _ref(lse_t)),
                         self._num_threads)
        if lse_arr is not None and return_lse_base_on_e:
            lse_arr *= np.float32(math.log(2.0))
        del qn, qp, ckv, kpe
        return (o, lse_arr) if return_lse else o

    def _free_plan(self) -> None:
        if self._plan is not None:
            _kvc_mla_plan_destroy(self._plan)
            self._plan = None

    def __del__(self):
        try:
            self._free_plan()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass
