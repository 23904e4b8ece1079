"""Multi-level cascade attention over one paged cache (SEMANTICS section 5),
mirroring ``flashinfer.MultiLevelCascadeAttentionWrapper``.

Level ``l`` is a batched prefill with its own ``qo_indptr[l]`` (every level
covers the same query rows, so all end at the same total) and its own CSR
page table into the one shared paged cache; typically the top level maps all
queries (``qo_indptr = [0, nnz]``) to shared-prefix pages and the last level
maps each request's queries to its own pages. ``causal`` applies to the last
level only; sm_scale, logits_soft_cap and window_left apply to every level
as to a batched prefill (with that level's qo_len / kv_len). The levels'
attention states are merged with ``merge_state`` in level order, which gives
the softmax over the union of the keys every level shows a row.
"""

from __future__ import annotations

import ctypes

from . import _compat, _lib
from .attention import (
    _attn_params,
    _data_type,
    _paged_run_inputs,
    _ref,
    _run_knobs,
    _run_outputs,
    _threads,
)
from .errors import InvalidArgumentError
from .paged import _layout_code
from .prefill import _causal_flag, _check_flashinfer_only

__all__ = ["MultiLevelCascadeAttentionWrapper"]

_TP = ctypes.POINTER(_lib.Tensor)
_vp = ctypes.c_void_p
_i32 = ctypes.c_int32

kvc_cascade_plan_create = _lib.optional_proto(
    "kvc_cascade_plan_create", ctypes.c_int, _i32, _TP, _TP, _TP, _TP, _i32, _i32, _i32, _i32,
    _i32, _i32, ctypes.POINTER(_vp))
kvc_cascade_plan_destroy = _lib.optional_proto("kvc_cascade_plan_destroy", None, _vp)
kvc_cascade_run = _lib.optional_proto(
    "kvc_cascade_run", ctypes.c_int, _vp, _TP, ctypes.POINTER(_lib.PagedCache),
    ctypes.POINTER(_lib.AttnParams), _TP, _TP, _vp)


def _level_list(x, name: str, num_levels: int):
    try:
        items = list(x)
    except TypeError as exc:
        raise InvalidArgumentError(f"{name} must be a list of {num_levels} arrays, one per "
                                   f"level") from exc
    if len(items) != num_levels:
        raise InvalidArgumentError(f"{name} has {len(items)} entries, the wrapper has "
                                   f"{num_levels} levels")
    return [_lib.int32_array(a, f"{name}[{i}]") for i, a in enumerate(items)]


class MultiLevelCascadeAttentionWrapper(_lib.NoCopy):
    """Cascade attention with ``num_levels`` page-table levels over one paged
    cache (flashinfer.MultiLevelCascadeAttentionWrapper).

    Args:
        num_levels: number of levels (>= 1).
        float_workspace_buffer: accepted for FlashInfer compatibility and
            ignored; workspace_buffer is the same.
        kv_layout: "NHD" or "HND".
        use_cuda_graph: False only.
        qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr,
            paged_kv_last_page_len_buf_arr: FlashInfer's CUDA-graph buffers,
            ignored (it only uses them with use_cuda_graph=True).
        num_threads: worker threads (None: all CPUs); fixed for the wrapper.
    """

    def __init__(self, num_levels, float_workspace_buffer=None, kv_layout="NHD",
                 use_cuda_graph=False, qo_indptr_buf_arr=None, paged_kv_indptr_buf_arr=None,
                 paged_kv_indices_buf_arr=None, paged_kv_last_page_len_buf_arr=None, *,
                 num_threads=None, workspace_buffer=None):
        _compat.neutral("use_cuda_graph", use_cuda_graph, (False,))
        n = _lib.int32_attr(num_levels, "num_levels")
        if n < 1:
            raise InvalidArgumentError(f"num_levels must be >= 1, got {n}")
        self._num_levels = n
        self._layout_name = kv_layout
        self._layout = _layout_code(kv_layout)
        self._num_threads = _threads(num_threads)
        self._pool = _lib.threadpool(self._num_threads)  # what call_pooled would look up
        self._plan = None  # kvc_cascade_plan pointer
        self._info = None

    @property
    def num_levels(self) -> int:
        return self._num_levels

    @property
    def kv_layout(self) -> str:
        return "NHD" if self._layout == _lib.KVC_NHD else "HND"

    @_lib.locked
    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
             paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
             sm_scale=None, window_left=-1, logits_soft_cap=None, rope_scale=None,
             rope_theta=None, q_data_type=None, kv_data_type=None, *, o_data_type=None,
             quant_group=8) -> None:
        """Plans every level for one batch composition (FlashInfer's
        arguments in its order; o_data_type and quant_group by keyword).

        Args:
            qo_indptr_arr: num_levels arrays (B_l + 1): level l's requests'
                query rows (each starts at 0 and ends at the same nnz).
            paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len:
                num_levels arrays each, level l's CSR page table (B_l + 1,
                indptr[-1], B_l) (FlashInfer's name for the last-page-length
                list has no _arr suffix).
            num_qo_heads, num_kv_heads, head_dim, page_size: ints.
            causal: bottom-right causal mask on the last level only.
            pos_encoding_mode: "NONE" only; use_fp16_qk_reduction: False only;
                rope_scale, rope_theta: ignored.
            sm_scale, window_left, logits_soft_cap: as
                kvcache.single_prefill_with_kv_cache, for every level.
            q_data_type, kv_data_type: optional dtypes that run checks.
            o_data_type: output dtype (None: q's).
            quant_group: int8/int4 caches: group size of the scales.
        """
        _check_flashinfer_only(head_dim, None, pos_encoding_mode, use_fp16_qk_reduction)
        n = self._num_levels
        params = _attn_params(sm_scale, logits_soft_cap, window_left)
        info = {
            "params": params,
            "q_data_type": _data_type(q_data_type, "q_data_type", False),
            "kv_data_type": _data_type(kv_data_type, "kv_data_type", True),
            "o_data_type": _data_type(o_data_type, "o_data_type", False),
            "quant_group": _lib.int32_attr(quant_group, "quant_group"),
            "head_dim": _lib.int32_attr(head_dim, "head_dim"),
        }
        causal = _causal_flag(causal)
        ints = [_lib.int32_attr(x, name) for x, name in (
            (num_qo_heads, "num_qo_heads"), (num_kv_heads, "num_kv_heads"),
            (head_dim, "head_dim"), (page_size, "page_size"))]
        lists = [_level_list(x, name, n) for x, name in (
            (qo_indptr_arr, "qo_indptr_arr"), (paged_kv_indptr_arr, "paged_kv_indptr_arr"),
            (paged_kv_indices_arr, "paged_kv_indices_arr"),
            (paged_kv_last_page_len, "paged_kv_last_page_len"))]
        tensor_arrays = [(_lib.Tensor * n)(*(_lib.make_tensor(a) for a in arrs))
                         for arrs in lists]
        ptr = ctypes.c_void_p()
        _lib.check(kvc_cascade_plan_create(n, *tensor_arrays, *ints, causal, self._num_threads,
                                           ctypes.byref(ptr)))
        del lists, tensor_arrays
        self._free_plan()
        self._plan = ptr.value
        self._info = info

    #: FlashInfer's deprecated name for plan.
    begin_forward = plan

    def end_forward(self) -> None:
        """FlashInfer's deprecated end_forward(): nothing to do."""

    @_lib.locked
    def run(self, q, paged_kv_cache, *args, kv_scale=None, return_lse=False, q_scale=None,
            k_scale=None, v_scale=None, out=None, lse=None):
        """Cascade attention for one layer.

        Args:
            q: (nnz, num_qo_heads, head_dim) float32/float16/bfloat16.
            paged_kv_cache: one array or a (k_cache, v_cache) pair, as for
                BatchPrefillWithPagedKVCacheWrapper.run (only read).
            *args: none accepted (FlashInfer's run takes q and the cache
                only); the options below are keyword-only.
            kv_scale: int8/int4 caches only: scales mirroring the cache.
            return_lse: also return the base-2 log-sum-exp of the merged
                state.
            q_scale, k_scale, v_scale, out, lse: as
                BatchPrefillWithPagedKVCacheWrapper.run.

        Returns:
            o (nnz, num_qo_heads, head_dim), or (o, lse (nnz, num_qo_heads)
            float32) with return_lse.
        """
        _compat.no_kernel_args("MultiLevelCascadeAttentionWrapper", args)
        if self._plan is None:
            raise InvalidArgumentError("MultiLevelCascadeAttentionWrapper.run: call plan() first")
        info = self._info
        params, vc = _run_knobs(info, q_scale, k_scale, v_scale)
        qa, q_t, pc, keep = _paged_run_inputs(info, q, paged_kv_cache, kv_scale, self._layout,
                                              "(nnz, num_qo_heads, head_dim)")
        outs = _run_outputs(info, qa, return_lse, out, lse, vc)
        o_t, lse_t = outs.tensors()
        br = ctypes.byref
        _lib.call_on(self._pool, kvc_cascade_run,
                     (self._plan, br(q_t), br(pc), br(params), br(o_t), _ref(lse_t)))
        del keep
        return outs.result(return_lse)

    #: FlashInfer's alias of run.
    forward = run

    def _free_plan(self) -> None:
        if self._plan is not None:
            kvc_cascade_plan_destroy(self._plan)
            self._plan = None

    def __del__(self):
        try:
            self._free_plan()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass
