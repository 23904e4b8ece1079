"""MLA attention (kvcache.BatchMLAPagedAttentionWrapper) against a float64
numpy reference written from the math in include/kvcache/mla.h and
shared/docs/SEMANTICS.md section 5 (not from the C code), on every ISA.

The reference reads q and the caches as stored (already rounded to their
dtypes), so the only differences are float32 arithmetic and the rounding of
the output: rtol = atol = 2e-5 for float32 outputs, 1e-3 for float16, 1e-2
for bfloat16; lse (float32) 2e-5. Unused cache slots and pages hold NaN, so
a read outside the page table would show.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import kvcache

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
LN2 = math.log(2.0)
SM = 1.0 / math.sqrt(192.0)


def tol(dtype):
    return {F32: 2e-5, F16: 1e-3, BF16: 1e-2}[np.dtype(dtype)]


# ---------------------------------------------------------------------------
# Reference


def ref_mla(qn, qp, ckv, kpe, qo_indptr, kv_indptr, kv_indices, kv_len, causal, sm_scale,
            cap=None):
    """o (N, H, Dc), lse (N, H) base 2, all float64."""
    qn, qp = qn.astype(np.float64), qp.astype(np.float64)
    n_rows, heads, dc = qn.shape
    o = np.zeros((n_rows, heads, dc))
    lse = np.full((n_rows, heads), -np.inf)
    for b in range(len(kv_len)):
        length = int(kv_len[b])
        pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        slots = len(pages) * ckv.shape[1]
        keys = ckv[pages].astype(np.float64).reshape(slots, ckv.shape[-1])[:length]
        kp = kpe[pages].astype(np.float64).reshape(slots, kpe.shape[-1])[:length]
        qo = qo_indptr[b + 1] - qo_indptr[b]
        for i in range(qo):
            n = qo_indptr[b] + i
            last = i + length - qo if causal else length - 1
            if last < 0:
                continue
            s = sm_scale * (qn[n] @ keys[:last + 1].T + qp[n] @ kp[:last + 1].T)  # (H, keys)
            if cap:
                s = cap * np.tanh(s / cap)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            o[n] = (p @ keys[:last + 1]) / p.sum(axis=1, keepdims=True)
            lse[n] = (m[:, 0] + np.log(p.sum(axis=1))) / LN2
    return o, lse


# ---------------------------------------------------------------------------
# Batches


def make_batch(rng, kv_lens, qo_lens, heads, dc, dk, page_size, kv_dtype, q_dtype,
               kpe_dtype=None, combined=False, qmag=1.0):
    """Shuffled pages with NaN in every unused slot; returns a dict."""
    kpe_dtype = kv_dtype if kpe_dtype is None else kpe_dtype
    pages = [(length + page_size - 1) // page_size for length in kv_lens]
    used = sum(pages)
    num_pages = used + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    kv_indices = perm.copy()  # longer than kv_indptr[-1]: allowed
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    if combined:
        both = np.full((num_pages, page_size, dc + dk), np.nan, kv_dtype)
        ckv, kpe = both[..., :dc], both[..., dc:]
    else:
        ckv = np.full((num_pages, page_size, dc), np.nan, kv_dtype)
        kpe = np.full((num_pages, page_size, dk), np.nan, kpe_dtype)
    for b, length in enumerate(kv_lens):
        for j in range(length):
            pg = kv_indices[kv_indptr[b] + j // page_size]
            ckv[pg, j % page_size] = rng.uniform(-1, 1, dc).astype(kv_dtype)
            kpe[pg, j % page_size] = rng.uniform(-1, 1, dk).astype(kpe.dtype)
    n_rows = int(qo_indptr[-1])
    qn = (rng.uniform(-1, 1, (n_rows, heads, dc)) * qmag).astype(q_dtype)
    qp = (rng.uniform(-1, 1, (n_rows, heads, dk)) * qmag).astype(q_dtype)
    return {"qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_indices": kv_indices,
            "kv_len": np.asarray(kv_lens, np.int32), "ckv": ckv, "kpe": kpe, "qn": qn, "qp": qp,
            "heads": heads, "dc": dc, "dk": dk, "page_size": page_size}


def plan_run(bt, causal=False, sm_scale=SM, cap=None, num_threads=1, **run_kw):
    w = kvcache.BatchMLAPagedAttentionWrapper(None, num_threads=num_threads)
    w.plan(bt["qo_indptr"], bt["kv_indptr"], bt["kv_indices"], bt["kv_len"], bt["heads"],
           bt["dc"], bt["dk"], bt["page_size"], causal, sm_scale, bt["qn"].dtype,
           bt["ckv"].dtype if bt["ckv"].dtype == bt["kpe"].dtype else None,
           logits_soft_cap=cap)
    return w.run(bt["qn"], bt["qp"], bt["ckv"], bt["kpe"], return_lse=True, **run_kw)


def check(bt, o, lse, causal=False, sm_scale=SM, cap=None, out_tol=None):
    ro, rl = ref_mla(bt["qn"], bt["qp"], bt["ckv"], bt["kpe"], bt["qo_indptr"],
                     bt["kv_indptr"], bt["kv_indices"], bt["kv_len"], causal, sm_scale, cap)
    t = out_tol or tol(o.dtype)
    np.testing.assert_allclose(o.astype(np.float64), ro, rtol=t, atol=t)
    assert lse.dtype == F32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rl))
    fin = np.isfinite(rl)
    np.testing.assert_allclose(lse[fin], rl[fin], rtol=out_tol or 2e-5, atol=out_tol or 2e-5)
    assert not np.isnan(o.astype(np.float64)).any()


# ---------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("page_size", [1, 5, 64])
@pytest.mark.parametrize("kv_dtype,q_dtype", [(F16, F32), (BF16, BF16), (F32, F16), (F16, F16)])
def test_matches_reference(isa, rng, page_size, kv_dtype, q_dtype):
    bt = make_batch(rng, [0, 1, 17, 300], [1, 1, 1, 1], 16, 128, 32, page_size, kv_dtype,
                    q_dtype)
    o, lse = plan_run(bt)
    assert o.shape == (4, 16, 128) and o.dtype == q_dtype and lse.shape == (4, 16)
    check(bt, o, lse)
    assert np.all(o[0] == 0) and np.all(np.isneginf(lse[0]))  # the empty request


@pytest.mark.parametrize("heads", [1, 128])
def test_deepseek_dims(isa, rng, heads):
    bt = make_batch(rng, [300, 1, 64], [1, 1, 1], heads, 512, 64, 64, BF16, BF16)
    o, lse = plan_run(bt)
    check(bt, o, lse)


@pytest.mark.parametrize("causal", [False, True])
def test_multi_token_causal(isa, rng, causal):
    # qo_len > kv_len (fully masked rows), an empty request, decode rows
    bt = make_batch(rng, [7, 300, 2, 0, 64], [3, 5, 4, 2, 1], 16, 128, 32, 5, F16, F32)
    o, lse = plan_run(bt, causal=causal)
    check(bt, o, lse, causal=causal)
    if causal:  # request 2: rows 0 and 1 see no key (qo 4 > kv 2)
        r0 = bt["qo_indptr"][2]
        assert np.all(np.isneginf(lse[r0:r0 + 2])) and np.all(o[r0:r0 + 2] == 0)


def test_long_context_and_threads(rng):
    bt = make_batch(rng, [3000, 5, 700], [1, 2, 1], 8, 512, 64, 64, F16, F32)
    o1, l1 = plan_run(bt, causal=True, num_threads=1)
    o2, l2 = plan_run(bt, causal=True, num_threads=2)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    check(bt, o1, l1, causal=True)


def test_soft_cap_and_large_logits(isa, rng):
    bt = make_batch(rng, [33, 300], [1, 1], 16, 128, 32, 16, F32, F32, qmag=8.0)
    o, lse = plan_run(bt, cap=5.0)
    check(bt, o, lse, cap=5.0)
    bt = make_batch(rng, [33, 300], [1, 1], 16, 128, 32, 16, F32, F32, qmag=30.0)
    o, lse = plan_run(bt, sm_scale=0.5)
    check(bt, o, lse, sm_scale=0.5, out_tol=2e-4)


def test_mixed_storage_and_nope(isa, rng):
    bt = make_batch(rng, [9, 260], [1, 1], 4, 64, 16, 8, BF16, F16, kpe_dtype=F32)
    o, lse = plan_run(bt)
    check(bt, o, lse)
    bt = make_batch(rng, [9, 260], [1, 1], 4, 64, 0, 8, F16, F32)  # head_dim_kpe 0
    o, lse = plan_run(bt)
    check(bt, o, lse)


def test_append_then_attend_combined(rng):
    """Caches filled by append_paged_mla_kv_cache into one (pages, ps, 576)
    array sliced into ckv/kpe (FlashInfer's layout)."""
    ps, dc, dk, heads = 16, 512, 64, 16
    kv_lens = [40, 17]
    pages = [3, 2]
    kv_indptr = np.array([0, 3, 5], np.int32)
    kv_indices = np.array([4, 0, 2, 1, 3], np.int32)
    last = np.array([40 - 32, 17 - 16], np.int32)
    both = np.zeros((6, ps, dc + dk), BF16)
    ckv, kpe = both[..., :dc], both[..., dc:]
    nnz = sum(kv_lens)
    new_ckv = rng.uniform(-1, 1, (nnz, dc)).astype(F32)
    new_kpe = rng.uniform(-1, 1, (nnz, dk)).astype(F32)
    bi = np.repeat(np.arange(2), kv_lens).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in kv_lens]).astype(np.int32)
    kvcache.append_paged_mla_kv_cache(new_ckv, new_kpe, bi, pos, ckv, kpe, kv_indices,
                                      kv_indptr, last)
    qn = rng.uniform(-1, 1, (2, heads, dc)).astype(BF16)
    qp = rng.uniform(-1, 1, (2, heads, dk)).astype(BF16)
    w = kvcache.BatchMLAPagedAttentionWrapper()
    w.plan(np.array([0, 1, 2]), kv_indptr, kv_indices, np.array(kv_lens), heads, dc, dk, ps,
           True, SM, "bfloat16", "bfloat16")
    o, lse = w.run(qn, qp, ckv, kpe, return_lse=True)
    # reference straight from the appended rows (rounded as the cache stores them)
    rows = np.split(np.arange(nnz), np.cumsum(kv_lens)[:-1])
    for b in range(2):
        k = new_ckv[rows[b]].astype(BF16).astype(np.float64)
        p = new_kpe[rows[b]].astype(BF16).astype(np.float64)
        s = SM * (qn[b].astype(np.float64) @ k.T + qp[b].astype(np.float64) @ p.T)
        m = s.max(1, keepdims=True)
        e = np.exp(s - m)
        np.testing.assert_allclose(o[b].astype(np.float64), e @ k / e.sum(1, keepdims=True),
                                   rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(lse[b], (m[:, 0] + np.log(e.sum(1))) / LN2, rtol=2e-5,
                                   atol=2e-5)
    assert pages == [3, 2]


def test_out_lse_buffers_and_base_e(rng):
    bt = make_batch(rng, [50, 3], [1, 1], 4, 32, 16, 4, F32, F32)
    o_ref, l_ref = plan_run(bt)
    w = kvcache.BatchMLAPagedAttentionWrapper()
    w.plan(bt["qo_indptr"], bt["kv_indptr"], bt["kv_indices"], bt["kv_len"], 4, 32, 16, 4,
           False, SM)
    out = np.empty((2, 4, 32), F16)
    lse = np.empty((2, 4), F32)
    r = w.run(bt["qn"], bt["qp"], bt["ckv"], bt["kpe"], out=out, lse=lse)
    assert r is out
    np.testing.assert_allclose(out.astype(np.float64), o_ref, rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(lse, l_ref)
    _, l2 = w.run(bt["qn"], bt["qp"], bt["ckv"], bt["kpe"], return_lse=True,
                  return_lse_base_on_e=True)
    np.testing.assert_allclose(l2, l_ref * LN2, rtol=1e-6)
    # several runs of one plan (one per layer)
    np.testing.assert_array_equal(w.run(bt["qn"], bt["qp"], bt["ckv"], bt["kpe"]), o_ref)


def test_plan_errors(rng):
    w = kvcache.BatchMLAPagedAttentionWrapper()
    qo, kvp, idx = np.array([0, 1]), np.array([0, 2]), np.array([0, 1])
    w.plan(qo, kvp, idx, np.array([100]), 16, 512, 64, 64, False, SM)
    with pytest.raises(kvcache.InvalidArgumentError, match="needs 3 pages"):
        w.plan(qo, kvp, idx, np.array([129]), 16, 512, 64, 64, False, SM)
    with pytest.raises(kvcache.InvalidArgumentError, match="sm_scale"):
        w.plan(qo, kvp, idx, np.array([100]), 16, 512, 64, 64, False, None)
    with pytest.raises(kvcache.InvalidArgumentError, match="sm_scale"):
        w.plan(qo, kvp, idx, np.array([100]), 16, 512, 64, 64, False, 0.0)
    with pytest.raises(kvcache.UnsupportedError, match="multiples of 16"):
        w.plan(qo, kvp, idx, np.array([100]), 16, 520, 64, 64, False, SM)
    with pytest.raises(kvcache.InvalidArgumentError, match="kv_indices"):
        w.plan(qo, kvp, np.array([0, -1]), np.array([100]), 16, 512, 64, 64, False, SM)
    with pytest.raises(kvcache.InvalidArgumentError, match="logits_soft_cap"):
        w.plan(qo, kvp, idx, np.array([100]), 16, 512, 64, 64, False, SM, logits_soft_cap=-1)
    with pytest.raises(kvcache.InvalidArgumentError, match="q_data_type"):
        w.plan(qo, kvp, idx, np.array([100]), 16, 512, 64, 64, False, SM, q_data_type="int8")
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.BatchMLAPagedAttentionWrapper().run(None, None, None, None)  # no plan
    # like the other wrappers: workspace_buffer names the ignored workspace too
    kvcache.BatchMLAPagedAttentionWrapper(workspace_buffer=np.empty(16, np.uint8), backend="fa3")
    with pytest.raises(kvcache.InvalidArgumentError, match="backend"):
        kvcache.BatchMLAPagedAttentionWrapper(backend=3)


def test_run_errors_write_nothing(rng):
    bt = make_batch(rng, [10, 3], [1, 1], 4, 32, 16, 4, F32, F32)
    w = kvcache.BatchMLAPagedAttentionWrapper()
    w.plan(bt["qo_indptr"], bt["kv_indptr"], bt["kv_indices"], bt["kv_len"], 4, 32, 16, 4,
           False, SM, "float32", "float32")
    out = np.full((2, 4, 32), 7.0, F32)
    lse = np.full((2, 4), 7.0, F32)
    qn, qp, ckv, kpe = bt["qn"], bt["qp"], bt["ckv"], bt["kpe"]
    bad_calls = [
        (qn[:, :3], qp, ckv, kpe),                 # heads
        (qn, qp[..., :8], ckv, kpe),               # D_kpe
        (qn, qp, ckv[:1], kpe),                    # page ids beyond the cache
        (qn, qp, ckv[:, :2], kpe),                 # page size
        (qn, qp, ckv.astype(F16), kpe),            # kv_data_type
        (qn.astype(F16), qp, ckv, kpe),            # q_data_type
        (qn, qp, np.zeros(ckv.shape, np.int8), kpe),  # not a float cache
    ]
    for args in bad_calls:
        with pytest.raises(kvcache.InvalidArgumentError):
            w.run(*args, out=out, lse=lse)
        assert np.all(out == 7.0) and np.all(lse == 7.0)
    with pytest.raises(kvcache.InvalidArgumentError, match=r"uint8 \(accepted: float32, "
                       r"float16, bfloat16\)"):
        w.run(qn, qp, np.zeros(ckv.shape, np.uint8), kpe)
    with pytest.raises(kvcache.InvalidArgumentError):
        w.run(qn, qp, ckv, kpe, out=np.empty((2, 4, 16), F32))
    with pytest.raises(kvcache.InvalidArgumentError, match="float32"):
        w.run(qn, qp, ckv, kpe, lse=np.empty((2, 4), F16))
    with pytest.raises(kvcache.UnsupportedError, match="page_table"):
        w.run(qn, qp, ckv, kpe, page_table=np.zeros(3))
    w.run(qn, qp, ckv, kpe, out=out, lse=lse)
    assert not np.any(out == 7.0)
