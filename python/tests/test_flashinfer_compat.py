"""FlashInfer's argument names and run-time knobs (flashinfer-notes.md 1.5-1.8):
float_workspace_buffer, use_cuda_graph / use_tensor_cores, pos_encoding_mode,
o_dtype / o_data_type, scalar q_scale / k_scale / v_scale (k_scale * q_scale
multiply sm_scale, v_scale the output), out= / lse= buffers, positional order
of the single-request functions. Against float64 references (attn_reference).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import attn_reference as ar
import kvcache

F32, F16 = np.float32, np.float16
E = kvcache.KvcacheError


@pytest.fixture
def rng():
    return np.random.default_rng(20261125)


def _paged(rng, lens, page_size=4, h=2, dh=32):
    """A paged float32 cache holding random K/V for requests of lens tokens:
    (cache (P, 2, ps, H, Dh) NHD, indptr, indices, last_page_len, per-request
    (k, v) (kv_len, H, Dh))."""
    pages = [max(1, -(-n // page_size)) for n in lens]
    n_pages = sum(pages)
    cache = np.zeros((n_pages, 2, page_size, h, dh), F32)
    order = rng.permutation(n_pages).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * page_size for n, p in zip(lens, pages)], np.int32)
    kv = []
    for b, n in enumerate(lens):
        k = rng.standard_normal((n, h, dh)).astype(F32)
        v = rng.standard_normal((n, h, dh)).astype(F32)
        for t in range(n):
            pg = order[indptr[b] + t // page_size]
            cache[pg, 0, t % page_size] = k[t]
            cache[pg, 1, t % page_size] = v[t]
        kv.append((k, v))
    return cache, indptr, order, last, kv


def _decode_ref(q, kv, sm_scale):
    """(o (B, Hq, Dh), lse (B, Hq)) in float64 for one query row per request."""
    os_, ls = [], []
    for b, (k, v) in enumerate(kv):
        o, lse = ar.prefill(ar.f64(q[b:b + 1]), ar.f64(k), ar.f64(v), sm_scale=sm_scale)
        os_.append(o[0])
        ls.append(lse[0])
    return np.stack(os_), np.stack(ls)


def test_constructor_names():
    ws = np.empty(1 << 10, np.uint8)
    for make in (kvcache.BatchDecodeWithPagedKVCacheWrapper,
                 kvcache.BatchPrefillWithPagedKVCacheWrapper,
                 kvcache.BatchPrefillWithRaggedKVCacheWrapper):
        assert make(float_workspace_buffer=ws, kv_layout="HND").kv_layout == "HND"
        assert make(ws, "NHD", False).kv_layout == "NHD"
        assert make(workspace_buffer=ws).kv_layout == "NHD"
        with pytest.raises(kvcache.UnsupportedError, match="use_cuda_graph"):
            make(ws, "NHD", True)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", False, True)  # use_tensor_cores
    assert w.kv_layout == "NHD"
    c = kvcache.MultiLevelCascadeAttentionWrapper(2, float_workspace_buffer=ws, kv_layout="NHD")
    assert c.num_levels == 2
    with pytest.raises(kvcache.UnsupportedError):
        kvcache.MultiLevelCascadeAttentionWrapper(2, ws, "NHD", True)


def test_single_decode_flashinfer_order_and_scalar_scales(rng):
    hq, h, dh, n = 4, 2, 32, 9
    q = rng.standard_normal((hq, dh)).astype(F32)
    k = rng.standard_normal((n, h, dh)).astype(F32)
    v = rng.standard_normal((n, h, dh)).astype(F32)
    # FlashInfer's positions: kv_layout, pos_encoding_mode, use_tensor_cores,
    # q_scale, k_scale, v_scale, window_left, logits_soft_cap, sm_scale
    o = kvcache.single_decode_with_kv_cache(q, k, v, "NHD", "NONE", False, None, None, None, -1,
                                            None, 0.3)
    want, _ = ar.prefill(ar.f64(q[None]), ar.f64(k), ar.f64(v), sm_scale=0.3)
    ar.assert_close(o, want[0], 1e-5, "positional sm_scale")
    o, lse = kvcache.single_decode_with_kv_cache(q, k, v, q_scale=2.0, k_scale=1.5, v_scale=0.25,
                                                 sm_scale=0.1, return_lse=True)
    want, want_lse = ar.prefill(ar.f64(q[None]), ar.f64(k), ar.f64(v), sm_scale=0.1 * 3.0)
    ar.assert_close(o, 0.25 * want[0], 1e-5, "calibration scales")
    np.testing.assert_allclose(lse, want_lse[0], rtol=1e-5, atol=1e-5)
    # k_scale alone with the default sm_scale
    o = kvcache.single_decode_with_kv_cache(q, k, v, k_scale=np.float32(0.5))
    want, _ = ar.prefill(ar.f64(q[None]), ar.f64(k), ar.f64(v), sm_scale=0.5 / math.sqrt(dh))
    ar.assert_close(o, want[0], 1e-5, "k_scale with default sm_scale")
    for bad in ({"k_scale": 0.0}, {"v_scale": -1.0}, {"q_scale": float("nan")},
                {"k_scale": np.ones((n, h, 4), F32)}):  # group scales for a float k
        with pytest.raises(kvcache.InvalidArgumentError):
            kvcache.single_decode_with_kv_cache(q, k, v, **bad)
    with pytest.raises(kvcache.UnsupportedError, match="pos_encoding_mode"):
        kvcache.single_decode_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA")


def test_single_decode_int8_group_scales_with_v_scale(rng):
    """Arrays are group scales, numbers calibration scales: both in one call."""
    hq, h, dh, n, group = 4, 2, 32, 11, 8
    q = rng.standard_normal((hq, dh)).astype(F32)
    (kq, ks, kd), (vq, vs, vd) = (ar.make_storage(rng, (n, h, dh), "int8", group)
                                  for _ in range(2))
    o = kvcache.single_decode_with_kv_cache(q, kq, vq, k_scale=ks, v_scale=vs,
                                            quant_group=group)
    o2 = kvcache.single_decode_with_kv_cache(q, kq, vq, k_scale=ks, v_scale=vs,
                                             quant_group=group, num_threads=1)
    want, _ = ar.prefill(ar.f64(q[None]), kd, vd)
    ar.assert_close(o, want[0], 1e-5, "int8")
    np.testing.assert_array_equal(o, o2)


def test_single_prefill_o_dtype(rng):
    q = rng.standard_normal((5, 4, 32)).astype(F16)
    k = rng.standard_normal((7, 2, 32)).astype(F16)
    v = rng.standard_normal((7, 2, 32)).astype(F16)
    a = kvcache.single_prefill_with_kv_cache(q, k, v, o_dtype="float32", causal=True)
    b = kvcache.single_prefill_with_kv_cache(q, k, v, out_dtype=np.float32, causal=True)
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    want, _ = ar.prefill(ar.f64(q), ar.f64(k), ar.f64(v), causal=True)
    ar.assert_close(a, want, 1e-5, "o_dtype float32")
    with pytest.raises(kvcache.InvalidArgumentError, match="not both"):
        kvcache.single_prefill_with_kv_cache(q, k, v, o_dtype="float32", out_dtype="float32")
    for kw in ({"scale_q": np.ones(4, F32)}, {"kv_cache_sf": np.ones(1, F32)},
               {"pos_encoding_mode": "ALIBI"}):
        with pytest.raises(kvcache.UnsupportedError):
            kvcache.single_prefill_with_kv_cache(q, k, v, **kw)
    o = kvcache.single_prefill_with_kv_cache(q, k, v, pos_encoding_mode="NONE", backend="auto",
                                             k_scale=2.0, v_scale=3.0)
    want, _ = ar.prefill(ar.f64(q), ar.f64(k), ar.f64(v), sm_scale=2.0 / math.sqrt(32))
    ar.assert_close(o, 3.0 * want, 1e-3, "prefill calibration scales", out_dtype=F16)


def test_single_prefill_return_lse_variant(rng):
    """single_prefill_with_kv_cache_return_lse: (o, lse) by default, the same
    bits as single_prefill_with_kv_cache(..., return_lse=True), FlashInfer's
    positional order, o alone with return_lse=False, the extras by keyword."""
    q = rng.standard_normal((6, 4, 32)).astype(F32)
    k = rng.standard_normal((9, 2, 32)).astype(F32)
    v = rng.standard_normal((9, 2, 32)).astype(F32)
    o, lse = kvcache.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True)
    want_o, want_l = ar.prefill(ar.f64(q), ar.f64(k), ar.f64(v), causal=True)
    ar.assert_close(o, want_o, 1e-5, "return_lse variant o")
    ar.assert_close(lse, want_l, 1e-5, "return_lse variant lse")
    o2, lse2 = kvcache.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)
    # positional: scale_q .. o_dtype, custom_mask, packed_custom_mask, causal, kv_layout
    o3, _ = kvcache.single_prefill_with_kv_cache_return_lse(q, k, v, None, None, None, "float16",
                                                            None, None, True, "NHD")
    assert o3.dtype == F16
    ar.assert_close(o3, want_o, 1e-3, "return_lse variant o_dtype")
    o4 = kvcache.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True, return_lse=False,
                                                         num_threads=1)
    np.testing.assert_array_equal(o4, o)
    with pytest.raises(kvcache.UnsupportedError):
        kvcache.single_prefill_with_kv_cache_return_lse(q, k, v, pos_encoding_mode="ROPE_LLAMA")
    # a FlashInfer backend name picks among GPU kernels: same function here
    o5 = kvcache.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True, return_lse=False,
                                                         num_threads=1, backend="fa3")
    np.testing.assert_array_equal(o5, o)


def test_batch_decode_knobs(rng):
    lens = [5, 1, 13]
    hq, h, dh = 4, 2, 32
    cache, indptr, indices, last, kv = _paged(rng, lens)
    q = rng.standard_normal((len(lens), hq, dh)).astype(F16)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer=None, kv_layout="NHD")
    w.plan(indptr, indices, last, hq, h, dh, 4, pos_encoding_mode="NONE", o_data_type="float32",
           q_data_type="float16", sm_scale=0.2)
    o, lse = w.run(q, cache, return_lse=True)
    assert o.dtype == np.float32 and lse.shape == (len(lens), hq)
    want, want_lse = _decode_ref(q, kv, 0.2)
    ar.assert_close(o, want, 1e-5, "o_data_type float32 from float16 q")
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    # calibration scales: q_scale * k_scale multiply sm_scale, v_scale the output
    o2 = w.run(q, cache, q_scale=0.5, k_scale=3.0, v_scale=2.0)
    want2, _ = _decode_ref(q, kv, 0.2 * 1.5)
    ar.assert_close(o2, 2.0 * want2, 1e-5, "scalar scales")
    # out= / lse= buffers (also strided ones), filled and returned
    out = np.full((len(lens), hq, dh), np.nan, F32)
    lse_buf = np.full((len(lens), hq), np.nan, F32)
    r = w.run(q, cache, out=out, lse=lse_buf)
    assert r is out
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(lse_buf, lse)
    big = np.zeros((len(lens), hq, 2 * dh), F32)
    view = big[:, :, ::2]
    r, rl = w.run(q, cache, out=view, return_lse=True)
    assert r is view
    np.testing.assert_array_equal(view, o)
    np.testing.assert_array_equal(big[:, :, 1::2], 0)
    np.testing.assert_array_equal(rl, lse)
    r = w.run(q, cache, out=out, v_scale=0.5)
    assert r is out
    ar.assert_close(out, 0.5 * want, 1e-5, "out with v_scale")
    for bad in ({"out": np.empty((len(lens), hq, dh), F16)},       # plan says float32
                {"out": np.empty((len(lens), hq, dh + 1), F32)},
                {"out": np.empty((len(lens), hq, dh), F32)[::-1].copy().T},
                {"lse": np.empty((len(lens),), F32)},
                {"k_scale": np.ones((4, 4), F32)},                  # group scales: kv_scale
                {"v_scale": 0}):
        with pytest.raises(kvcache.InvalidArgumentError):
            w.run(q, cache, **bad)
    # FlashInfer's per-head calibration scales (prefill): refused as unsupported
    for name in ("q_scale", "k_scale", "v_scale"):
        with pytest.raises(kvcache.UnsupportedError, match=f"{name} as an array"):
            w.run(q, cache, **{name: np.ones(hq, F32)})
    ro = np.empty((len(lens), hq, dh), F32)
    ro.flags.writeable = False
    with pytest.raises(kvcache.InvalidArgumentError, match="read-only"):
        w.run(q, cache, out=ro)
    with pytest.raises(kvcache.UnsupportedError):
        w.plan(indptr, indices, last, hq, h, dh, 4, pos_encoding_mode="ROPE_LLAMA")


def test_batch_prefill_and_cascade_knobs(rng):
    lens = [6, 9]
    hq, h, dh = 4, 2, 32
    cache, indptr, indices, last, kv = _paged(rng, lens)
    qo = np.array([0, 3, 7], np.int32)
    q = rng.standard_normal((7, hq, dh)).astype(F32)
    want = []
    for b, (k, v) in enumerate(kv):
        o, _ = ar.prefill(ar.f64(q[qo[b]:qo[b + 1]]), ar.f64(k), ar.f64(v), causal=True,
                          sm_scale=0.25 / math.sqrt(dh))
        want.append(o)
    want = np.concatenate(want)
    w = kvcache.BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer=None)
    w.plan(qo, indptr, indices, last, hq, h, dh, 4, causal=True)
    out = np.empty_like(q)
    r = w.run(q, cache, out=out, k_scale=0.5, q_scale=0.5, v_scale=4.0)
    assert r is out
    ar.assert_close(out, 4.0 * want, 1e-5, "paged prefill knobs")
    # ragged: the same K/V as ragged rows
    k_r = np.concatenate([k for k, _ in kv])
    v_r = np.concatenate([v for _, v in kv])
    kv_indptr = np.array([0, 6, 15], np.int32)
    rw = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    rw.plan(qo, kv_indptr, hq, h, dh, causal=True)
    lse_buf = np.empty((7, hq), F32)
    o = rw.run(q, k_r, v_r, k_scale=0.25, v_scale=4.0, lse=lse_buf)
    ar.assert_close(o, 4.0 * want, 1e-5, "ragged prefill knobs")
    assert np.all(np.isfinite(lse_buf))
    # cascade, one level = the paged prefill
    c = kvcache.MultiLevelCascadeAttentionWrapper(1, float_workspace_buffer=None)
    c.plan([qo], [indptr], [indices], [last], hq, h, dh, 4, causal=True)
    out2 = np.empty_like(q)
    r = c.run(q, cache, out=out2, k_scale=0.25, v_scale=4.0)
    assert r is out2
    ar.assert_close(out2, 4.0 * want, 1e-5, "cascade knobs")


def _sink_ref(q, k, v, vis, sm_scale, sinks):
    """Attention with one sink logit per query head, as a softmax over the
    visible scores plus a column holding sinks[h] (natural units, not scaled):
    q (n, Hq, D), k/v (kv, H, D), vis (n, kv) bool, all float64. Returns
    (o (n, Hq, D), lse (n, Hq) base 2, the sink counted)."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    o = np.zeros(q.shape)
    lse = np.full((n, hq), -np.inf)
    for i in range(n):
        for h in range(hq):
            logits = np.append(sm_scale * (k[vis[i], h // g] @ q[i, h]), sinks[h])
            m = logits.max()
            if m == -np.inf:
                continue
            e = np.exp(logits - m)
            o[i, h] = e[:-1] @ v[vis[i], h // g] / e.sum()
            lse[i, h] = (m + np.log(e.sum())) / np.log(2.0)
    return o, lse


def test_run_sinks(rng):
    """run(sinks=...) of the batch decode and paged / ragged prefill wrappers
    against a float64 softmax with the sink as one more logit per head: sinks
    of -inf (no sink), small and dominant values, rows with no visible key
    (o 0, lse the sink's), float32 and float16 outputs, out= / lse= buffers and
    v_scale with it; bad sinks are refused."""
    hq, h, dh = 4, 2, 32
    sm = 1.0 / math.sqrt(dh)
    sinks = np.array([-np.inf, 0.5, 6.0, -3.0], F32)
    lens = [5, 1, 13]
    cache, indptr, indices, last, kv = _paged(rng, lens)
    q = rng.standard_normal((len(lens), hq, dh)).astype(F32)
    want_o, want_l = zip(*[_sink_ref(ar.f64(q[b:b + 1]), ar.f64(k), ar.f64(v),
                                     np.ones((1, len(k)), bool), sm, ar.f64(sinks))
                           for b, (k, v) in enumerate(kv)])
    want_o, want_l = np.concatenate(want_o), np.concatenate(want_l)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    for o_dt in (F32, F16):
        w.plan(indptr, indices, last, hq, h, dh, 4, o_data_type=o_dt)
        o, lse = w.run(q, cache, return_lse=True, sinks=sinks)
        assert o.dtype == o_dt
        ar.assert_close(o, want_o, ar.out_tol(o_dt), f"decode sinks {o_dt.__name__}")
        ar.assert_close(lse, want_l, 1e-5, "decode sinks lse")
    # without a sink (all -inf) the result is the plain one
    w.plan(indptr, indices, last, hq, h, dh, 4)
    none = np.full(hq, -np.inf, F32)
    o0, l0 = w.run(q, cache, return_lse=True)
    o1, l1 = w.run(q, cache, return_lse=True, sinks=none)
    np.testing.assert_array_equal(o1, o0)
    np.testing.assert_array_equal(l1, l0)
    out, lse_buf = np.empty_like(q), np.empty((len(lens), hq), F32)
    r = w.run(q, cache, sinks=list(sinks), out=out, lse=lse_buf, v_scale=2.0)
    assert r is out
    ar.assert_close(out, 2.0 * want_o, 1e-5, "decode sinks out= v_scale")
    ar.assert_close(lse_buf, want_l, 1e-5, "decode sinks lse=")
    for bad in (np.zeros(hq + 1, F32), np.zeros((1, hq), F32), np.array([0, 0, np.nan, 0]),
                np.array([0, np.inf, 0, 0]), np.array(["a"] * hq), np.ones(hq, bool)):
        with pytest.raises(kvcache.InvalidArgumentError, match="sinks"):
            w.run(q, cache, sinks=bad)

    # prefill, causal with qo > kv for request 1: its first rows see no key
    plens, qlens = [6, 2, 9], [3, 4, 5]
    cache, indptr, indices, last, kv = _paged(rng, plens)
    qo = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    q = rng.standard_normal((int(qo[-1]), hq, dh)).astype(F16)
    want_o, want_l = zip(*[_sink_ref(ar.f64(q[qo[b]:qo[b + 1]]), ar.f64(k), ar.f64(v),
                                     ar.visible(qlens[b], len(k), causal=True), sm,
                                     ar.f64(sinks))
                           for b, (k, v) in enumerate(kv)])
    want_o, want_l = np.concatenate(want_o), np.concatenate(want_l)
    assert np.isinf(want_l[3:5, 0]).all() and np.isfinite(want_l[3:5, 1:]).all()
    pw = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    pw.plan(qo, indptr, indices, last, hq, h, dh, 4, causal=True, q_data_type="float16",
            kv_data_type="float32")
    o, lse = pw.run(q, cache, return_lse=True, sinks=sinks)
    assert o.dtype == F16
    ar.assert_close(o, want_o, 1e-3, "paged prefill sinks")
    ar.assert_close(lse, want_l, 1e-3, "paged prefill sinks lse")
    assert not o[3:5].any()
    rw = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    kv_indptr = np.concatenate([[0], np.cumsum(plens)]).astype(np.int32)
    rw.plan(qo, kv_indptr, hq, h, dh, causal=True, q_data_type="float16",
            kv_data_type="float32")
    o, lse = rw.run(q, np.concatenate([k for k, _ in kv]), np.concatenate([v for _, v in kv]),
                    return_lse=True, sinks=sinks)
    ar.assert_close(o, want_o, 1e-3, "ragged prefill sinks")
    ar.assert_close(lse, want_l, 1e-3, "ragged prefill sinks lse")


def test_run_return_lse(rng):
    """wrapper.run_return_lse(...) is run(..., return_lse=True), as in FlashInfer."""
    hq, h, dh = 4, 2, 32
    lens = [5, 12]
    cache, indptr, indices, last, kv = _paged(rng, lens)
    q = rng.standard_normal((2, hq, dh)).astype(F32)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    w.plan(indptr, indices, last, hq, h, dh, 4)
    o, lse = w.run_return_lse(q, cache)
    want_o, want_l = _decode_ref(q, kv, 1.0 / math.sqrt(dh))
    ar.assert_close(o, want_o, 1e-5, "decode run_return_lse")
    ar.assert_close(lse, want_l, 1e-5, "decode run_return_lse lse")
    qo = np.array([0, 3, 7], np.int32)
    qp = rng.standard_normal((7, hq, dh)).astype(F32)
    pw = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    pw.plan(qo, indptr, indices, last, hq, h, dh, 4, causal=True)
    got = pw.run_return_lse(qp, cache)
    for a, b in zip(got, pw.run(qp, cache, return_lse=True)):
        np.testing.assert_array_equal(a, b)
    rw = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    rw.plan(qo, np.array([0, 5, 17], np.int32), hq, h, dh, causal=True)
    k_r = np.concatenate([k for k, _ in kv])
    v_r = np.concatenate([v for _, v in kv])
    o_r, l_r = rw.run_return_lse(qp, k_r, v_r)
    np.testing.assert_array_equal(o_r, got[0])
    np.testing.assert_array_equal(l_r, got[1])


def test_deprecated_forward_api(rng):
    """begin_forward / forward / forward_return_lse / end_forward, FlashInfer's
    deprecated names some engines still call: forward's options (causal,
    window_left, logits_soft_cap, sm_scale) replace the planned ones, for
    later run() calls too, as in FlashInfer; a refused option changes
    nothing."""
    hq, h, dh = 4, 2, 32
    lens = [6, 13]
    cache, indptr, indices, last, kv = _paged(rng, lens)
    q = rng.standard_normal((2, hq, dh)).astype(F32)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    w.begin_forward(indptr, indices, last, hq, h, dh, 4)
    plain = w.run(q, cache)
    o = w.forward(q, cache, sm_scale=0.3, logits_soft_cap=5.0, window_left=3)
    want = np.stack([ar.prefill(ar.f64(q[b:b + 1]), ar.f64(k), ar.f64(v), window_left=3,
                                sm_scale=0.3, cap=5.0)[0][0] for b, (k, v) in enumerate(kv)])
    ar.assert_close(o, want, 1e-5, "decode forward")
    np.testing.assert_array_equal(w.run(q, cache), o)  # the options stay
    o2, lse = w.forward_return_lse(q, cache, sm_scale=0.3, logits_soft_cap=5.0, window_left=3)
    np.testing.assert_array_equal(o2, o)
    assert lse.shape == (2, hq)
    with pytest.raises(kvcache.UnsupportedError):
        w.forward(q, cache, pos_encoding_mode="ROPE_LLAMA")
    np.testing.assert_array_equal(w.run(q, cache), o)
    assert w.end_forward() is None
    np.testing.assert_array_equal(w.forward(q, cache), plain)
    # an int8 cache: kv_scale passes through
    c8 = rng.integers(-127, 128, cache.shape).astype(np.int8)
    s8 = (0.01 + 0.02 * rng.random(cache.shape[:-1] + (dh // 8,))).astype(F32)
    w.plan(indptr, indices, last, hq, h, dh, 4, kv_data_type="int8", quant_group=8)
    np.testing.assert_array_equal(w.forward(q, c8, kv_scale=s8), w.run(q, c8, kv_scale=s8))

    # paged prefill planned without causal, forward(causal=True) = a causal plan
    qo = np.array([0, 4, 9], np.int32)
    qp = rng.standard_normal((9, hq, dh)).astype(F32)
    causal_plan = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    causal_plan.plan(qo, indptr, indices, last, hq, h, dh, 4, causal=True)
    want_c, want_cl = causal_plan.run_return_lse(qp, cache)
    ref = np.concatenate([ar.prefill(ar.f64(qp[qo[b]:qo[b + 1]]), ar.f64(k), ar.f64(v),
                                     causal=True)[0] for b, (k, v) in enumerate(kv)])
    ar.assert_close(want_c, ref, 1e-5, "causal prefill")
    pw = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    pw.begin_forward(qo, indptr, indices, last, hq, h, dh, 4)
    not_causal = pw.run(qp, cache)
    assert not np.array_equal(not_causal, want_c)
    np.testing.assert_array_equal(pw.forward(qp, cache, causal=True), want_c)
    np.testing.assert_array_equal(pw.run(qp, cache), want_c)  # causal stays
    with pytest.raises(kvcache.InvalidArgumentError):
        pw.forward(qp, cache, causal=False, sm_scale=float("nan"))
    np.testing.assert_array_equal(pw.run(qp, cache), want_c)  # nothing changed
    o_l, l_l = pw.forward_return_lse(qp, cache, causal=False)
    np.testing.assert_array_equal(o_l, not_causal)
    pw.end_forward()

    # ragged
    rw = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    rw.begin_forward(qo, np.array([0, 6, 19], np.int32), hq, h, dh)
    k_r = np.concatenate([k for k, _ in kv])
    v_r = np.concatenate([v for _, v in kv])
    o_r, l_r = rw.forward_return_lse(qp, k_r, v_r, causal=True)
    np.testing.assert_array_equal(o_r, want_c)
    np.testing.assert_array_equal(l_r, want_cl)
    np.testing.assert_array_equal(rw.forward(qp, k_r, v_r), not_causal)


def test_host_and_split_options(rng):
    """plan(non_blocking=, fixed_split_size=, disable_split_kv=, data_type=,
    rope_scale=, rope_theta=) and run(window_left=, enable_pdl=, sinks=None) as
    engines pass them to FlashInfer: accepted where they change nothing on
    the CPU (the results are the same bits as without them), refused
    otherwise."""
    lens = [5, 1, 13]
    hq, h, dh = 4, 2, 32
    cache, indptr, indices, last, kv = _paged(rng, lens)
    q = rng.standard_normal((len(lens), hq, dh)).astype(F32)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    w.plan(indptr, indices, last, hq, h, dh, 4, window_left=6)
    base = w.run(q, cache)
    w.plan(indptr, indices, last, hq, h, dh, 4, window_left=6, non_blocking=True,
           fixed_split_size=8, disable_split_kv=True, q_len_per_req=1, data_type="float32",
           rope_scale=None, rope_theta=None)
    np.testing.assert_array_equal(w.run(q, cache, window_left=6, enable_pdl=True), base)
    np.testing.assert_array_equal(w.run(q, cache, window_left=None, enable_pdl=False,
                                        sinks=None), base)
    # data_type is the dtype of q and the cache where q_data_type / kv_data_type are None
    w.plan(indptr, indices, last, hq, h, dh, 4, data_type="float16")
    with pytest.raises(kvcache.InvalidArgumentError):
        w.run(q, cache)  # float32 q against the planned float16
    w.plan(indptr, indices, last, hq, h, dh, 4, data_type="float16", q_data_type="float32",
           kv_data_type="float32")
    want, _ = _decode_ref(q, kv, 1.0 / math.sqrt(dh))
    ar.assert_close(w.run(q, cache), want, 1e-5, "explicit dtypes over data_type")
    w.plan(indptr, indices, last, hq, h, dh, 4, window_left=6)
    with pytest.raises(kvcache.InvalidArgumentError, match="window_left"):
        w.run(q, cache, window_left=7)
    for bad in ({"non_blocking": "yes"}, {"fixed_split_size": 2.5},
                {"disable_split_kv": None}):
        with pytest.raises(kvcache.InvalidArgumentError):
            w.plan(indptr, indices, last, hq, h, dh, 4, **bad)
    with pytest.raises(kvcache.UnsupportedError, match="q_len_per_req"):
        w.plan(indptr, indices, last, hq, h, dh, 4, q_len_per_req=2)
    # prefill (paged and ragged) and cascade
    qo = np.array([0, 2, 3, 7], np.int32)
    qp = rng.standard_normal((7, hq, dh)).astype(F32)
    pw = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    pw.plan(qo, indptr, indices, last, hq, h, dh, 4, causal=True)
    pbase = pw.run(qp, cache)
    pw.plan(qo, indptr, indices, last, hq, h, dh, 4, causal=True, rope_scale=1.0,
            rope_theta=1e4, non_blocking=False, fixed_split_size=None, disable_split_kv=False)
    np.testing.assert_array_equal(pw.run(qp, cache, window_left=-1, enable_pdl=None), pbase)
    with pytest.raises(kvcache.InvalidArgumentError, match="window_left"):
        pw.run(qp, cache, window_left=3)
    k_r = np.concatenate([k for k, _ in kv]).astype(F32)
    v_r = np.concatenate([v for _, v in kv]).astype(F32)
    rw = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    rw.plan(qo, np.array([0, 5, 6, 19], np.int32), hq, h, dh, causal=True, non_blocking=True,
            rope_scale=None, rope_theta=None)
    np.testing.assert_array_equal(rw.run(qp, k_r, v_r, window_left=-1, enable_pdl=True), pbase)
    c = kvcache.MultiLevelCascadeAttentionWrapper(1, None, "NHD")
    c.plan([qo], [indptr], [indices], [last], hq, h, dh, 4, causal=True, rope_scale=1.0,
           rope_theta=1e4)
    ar.assert_close(c.run(qp, cache), pbase.astype(np.float64), 1e-5, "cascade with rope args")


def test_num_threads_everywhere(rng):
    """append_paged_kv_cache takes num_threads like the attention calls (n_threads too)."""
    cache = np.zeros((2, 2, 4, 1, 8), F32)
    key = rng.standard_normal((3, 1, 8)).astype(F32)
    args = (key, key, np.zeros(3, np.int32), np.arange(3, dtype=np.int32), cache,
            np.array([1], np.int32), np.array([0, 1], np.int32), np.array([3], np.int32))
    kvcache.append_paged_kv_cache(*args, num_threads=1)
    np.testing.assert_array_equal(cache[1, 0, :3], key)
    kvcache.append_paged_kv_cache(*args, n_threads=2)
    with pytest.raises(kvcache.InvalidArgumentError, match="not both"):
        kvcache.append_paged_kv_cache(*args, num_threads=1, n_threads=1)


def test_error_messages_name_the_problem(rng):
    """A negative page id, an int4 cache passed unpacked and an int4 plan say so."""
    hq, h, dh, ps = 4, 2, 32, 4
    q = rng.standard_normal((1, hq, dh)).astype(F32)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    with pytest.raises(kvcache.InvalidArgumentError, match=r"kv_indices\[1\] = -2 is negative"):
        w.plan(np.array([0, 2], np.int32), np.array([0, -2], np.int32), np.array([1], np.int32),
               hq, h, dh, ps)
    w.plan(np.array([0, 1], np.int32), np.array([0], np.int32), np.array([3], np.int32), hq, h,
           dh, ps, kv_data_type="int4", quant_group=8)
    unpacked = np.zeros((2, 2, ps, h, dh), np.uint8)  # int4 rows must hold Dh / 2 bytes
    scale = np.ones((2, 2, ps, h, dh // 8), F32)
    with pytest.raises(kvcache.InvalidArgumentError, match="does not match the plan"):
        w.run(q, unpacked, kv_scale=scale)
    with pytest.raises(kvcache.InvalidArgumentError, match=r"kv_data_type int4 \(uint8\)"):
        w.run(q, np.zeros((2, 2, ps, h, dh), np.int8), kv_scale=scale)


def test_get_batch_indices_positions_out_buffers():
    """flashinfer.get_batch_indices_positions(append_indptr, seq_lens, nnz,
    batch_indices=None, positions=None): pre-allocated int32 (nnz,) outputs
    are written and returned; wrong ones are refused before anything is
    written."""
    bi_buf = np.full(10, 99, np.int32)
    pos_buf = np.full(10, 99, np.int32)
    bi, pos = kvcache.get_batch_indices_positions([0, 1, 3, 6, 10], [5, 5, 5, 5], 10,
                                                  bi_buf, pos_buf)
    assert bi is bi_buf and pos is pos_buf
    assert bi.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert pos.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]
    only = np.zeros(10, np.int32)
    bi, pos = kvcache.get_batch_indices_positions([0, 1, 3, 6, 10], [5, 5, 5, 5], 10,
                                                  positions=only)
    assert pos is only and pos.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]
    assert bi.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    ro = np.zeros(10, np.int32)
    ro.flags.writeable = False
    for bad in ({"batch_indices": np.zeros(10, np.int64)}, {"positions": np.zeros(9, np.int32)},
                {"positions": [0] * 10}, {"batch_indices": ro},
                {"batch_indices": bi_buf, "positions": bi_buf}):
        keep = {k: np.array(v) for k, v in bad.items() if isinstance(v, np.ndarray)}
        with pytest.raises(kvcache.InvalidArgumentError):
            kvcache.get_batch_indices_positions([0, 1, 3, 6, 10], [5, 5, 5, 5], 10, **bad)
        for k, v in keep.items():
            np.testing.assert_array_equal(bad[k], v)
    # a failing call (bad seq_lens) leaves the buffers untouched
    bi_buf[:] = 7
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.get_batch_indices_positions([0, 1, 3, 6, 10], [5, 5, 5, 2], 10, bi_buf)
    assert (bi_buf == 7).all()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_page_size_one_squeezed_cache(rng, layout, dtype):
    """FlashInfer's _expand_5d / _expand_4d: with page_size 1 a paged cache
    may leave the page axis out ((max_pages, 2, H, Dh) combined, (max_pages,
    H, Dh) per K/V; scales likewise). Appends write through to the caller's
    array and every paged run gives what the 5-D form gives."""
    h, hq, dh, n_pages, group = 2, 4, 32, 7, 8
    lens = [3, 4]
    indptr = np.array([0, 3, 7], np.int32)
    indices = rng.permutation(n_pages).astype(np.int32)
    last = np.ones(2, np.int32)
    k = rng.standard_normal((7, h, dh)).astype(F32)
    v = rng.standard_normal((7, h, dh)).astype(F32)
    bi, pos = kvcache.get_batch_indices_positions([0, 3, 7], lens, 7)
    cdt = np.int8 if dtype == "int8" else F32
    squeezed = np.zeros((n_pages, 2, h, dh), cdt)
    scale = np.zeros((n_pages, 2, h, dh // group), F32) if dtype == "int8" else None
    kw = {"kv_scale": scale, "quant_group": group} if dtype == "int8" else {}
    kvcache.append_paged_kv_cache(k, v, bi, pos, squeezed, indices, indptr, last, layout, **kw)
    full_shape = (n_pages, 2, 1, h, dh) if layout == "NHD" else (n_pages, 2, h, 1, dh)
    full = np.zeros(full_shape, cdt)
    full_scale = None if scale is None else np.zeros(full_shape[:-1] + (dh // group,), F32)
    kw5 = {"kv_scale": full_scale, "quant_group": group} if dtype == "int8" else {}
    kvcache.append_paged_kv_cache(k, v, bi, pos, full, indices, indptr, last, layout, **kw5)
    np.testing.assert_array_equal(squeezed, full.reshape(squeezed.shape))
    if scale is not None:
        np.testing.assert_array_equal(scale, full_scale.reshape(scale.shape))
    pair = (squeezed[:, 0], squeezed[:, 1])
    pair_scale = None if scale is None else (scale[:, 0], scale[:, 1])
    runs = {"kv_scale": scale} if scale is not None else {}
    runs_pair = {"kv_scale": pair_scale} if scale is not None else {}
    runs5 = {"kv_scale": full_scale} if scale is not None else {}
    plan_kw = {"quant_group": group} if dtype == "int8" else {}

    q = rng.standard_normal((2, hq, dh)).astype(F32)
    dec = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, layout)
    dec.plan(indptr, indices, last, hq, h, dh, 1, **plan_kw)
    want = dec.run(q, full, **runs5)
    np.testing.assert_array_equal(dec.run(q, squeezed, **runs), want)
    np.testing.assert_array_equal(dec.run(q, pair, **runs_pair), want)

    qp = rng.standard_normal((5, hq, dh)).astype(F32)
    qo = np.array([0, 2, 5], np.int32)
    pre = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, layout)
    pre.plan(qo, indptr, indices, last, hq, h, dh, 1, causal=True, **plan_kw)
    want = pre.run(qp, full, **runs5)
    np.testing.assert_array_equal(pre.run(qp, squeezed, **runs), want)
    np.testing.assert_array_equal(pre.run(qp, pair, **runs_pair), want)

    cas = kvcache.MultiLevelCascadeAttentionWrapper(2, None, layout)
    cas.plan([np.array([0, 5], np.int32), qo], [np.array([0, 1], np.int32), indptr],
             [indices[:1], indices], [np.ones(1, np.int32), last], hq, h, dh, 1, True,
             **plan_kw)
    want = cas.run(qp, full, **runs5)
    np.testing.assert_array_equal(cas.run(qp, squeezed, **runs), want)
    # a squeezed cache is page_size 1: a plan for another page size refuses it
    dec.plan(np.array([0, 1, 2], np.int32), indices[:2], last, hq, h, dh, 4, **plan_kw)
    with pytest.raises(kvcache.InvalidArgumentError):
        dec.run(q, squeezed, **runs)


def test_plan_positional_order(rng):
    """The wrappers' plan() options in FlashInfer's positional order (the
    paged and ragged prefill wrappers order sm_scale / window_left /
    logits_soft_cap differently); decode's legacy positional options warn
    as FlashInfer's do; the cascade wrapper has FlashInfer's forward alias."""
    h, hq, dh, ps = 2, 4, 32, 4
    cache, indptr, indices, last, kv = _paged(rng, [9, 6], ps, h, dh)
    qo = np.array([0, 3, 5], np.int32)
    q = rng.standard_normal((5, hq, dh)).astype(F32)
    knobs = dict(causal=True, sm_scale=0.3, window_left=2, logits_soft_cap=5.0)

    paged = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    paged.plan(qo, indptr, indices, last, hq, h, dh, ps, **knobs)
    want = paged.run(q, cache)
    # head_dim_vo, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
    # use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale,
    # rope_theta, q_data_type, kv_data_type, o_data_type, non_blocking
    paged.plan(qo, indptr, indices, last, hq, h, dh, ps, None, None, None, True, "NONE", False,
               0.3, 2, 5.0, None, None, "float32", "float32", "float32", True)
    np.testing.assert_array_equal(paged.run(q, cache), want)

    k = np.concatenate([a for a, _ in kv])
    v = np.concatenate([b for _, b in kv])
    kvp = np.array([0, 9, 15], np.int32)
    ragged = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    ragged.plan(qo, kvp, hq, h, dh, **knobs)
    want_r = ragged.run(q, k, v)
    np.testing.assert_array_equal(want_r, want)
    # ..., causal, pos_encoding_mode, use_fp16_qk_reduction, window_left,
    # logits_soft_cap, sm_scale, rope_scale, rope_theta, q/kv/o_data_type
    ragged.plan(qo, kvp, hq, h, dh, None, None, None, True, "NONE", False, 2, 5.0, 0.3, None,
                None, "float32", "float32", "float32")
    np.testing.assert_array_equal(ragged.run(q, k, v), want_r)

    # kernel-variant / other-backend inputs are refused, not ignored
    for name in ("prefix_len_ptr", "seq_lens", "block_tables", "max_sequence_kv",
                 "token_pos_in_items_len"):
        with pytest.raises(kvcache.UnsupportedError, match=name):
            paged.plan(qo, indptr, indices, last, hq, h, dh, ps, **{name: 3})
    for name in ("v_indptr", "o_indptr", "seq_lens_q", "max_item_len_ptr"):
        with pytest.raises(kvcache.UnsupportedError, match=name):
            ragged.plan(qo, kvp, hq, h, dh, **{name: kvp})

    top = np.array([0, 5], np.int32)
    cas = kvcache.MultiLevelCascadeAttentionWrapper(2, None, "NHD")
    levels = ([top, qo], [np.array([0, 0], np.int32), indptr],
              [np.zeros(0, np.int32), indices], [np.zeros(1, np.int32), last])
    cas.plan(*levels, hq, h, dh, ps, True, sm_scale=0.3, window_left=2, logits_soft_cap=5.0)
    want_c = cas.run(q, cache)
    # causal, pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left,
    # logits_soft_cap, rope_scale, rope_theta, q_data_type, kv_data_type
    cas.plan(*levels, hq, h, dh, ps, True, "NONE", False, 0.3, 2, 5.0, None, None, "float32",
             "float32")
    np.testing.assert_array_equal(cas.forward(q, cache), want_c)
    ar.assert_close(want_c, want, 1e-5, "cascade with an empty top level")

    qd = rng.standard_normal((2, hq, dh)).astype(F32)
    dec = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    dec.plan(indptr, indices, last, hq, h, dh, ps, window_left=3, logits_soft_cap=5.0,
             sm_scale=0.3)
    want_d = dec.run(qd, cache)
    # legacy order: pos_encoding_mode, window_left, logits_soft_cap, q_data_type,
    # kv_data_type, o_data_type, data_type, sm_scale
    with pytest.warns(DeprecationWarning, match="positionally"):
        dec.plan(indptr, indices, last, hq, h, dh, ps, "NONE", 3, 5.0, "float32", "float32",
                 None, None, 0.3)
    np.testing.assert_array_equal(dec.run(qd, cache), want_d)
    with pytest.raises(TypeError, match="multiple values"):
        dec.plan(indptr, indices, last, hq, h, dh, ps, "NONE", 3, window_left=3)
    with pytest.raises(TypeError, match="at most 16"):
        dec.plan(indptr, indices, last, hq, h, dh, ps, *([None] * 17))
    with pytest.raises(TypeError):
        dec.plan(indptr, indices, last, hq, h, dh, ps, no_such_option=1)
    np.testing.assert_array_equal(dec.run(qd, cache), want_d)  # failed plans changed nothing


def test_run_extras_refused_not_ignored(rng):
    """run() inputs FlashInfer has for features kvcache lacks (NVFP4 block
    scales, skip-softmax sparsity, fp8 output / MLA cache scales, fp16
    softmax) are accepted at their defaults and refused otherwise, never
    silently ignored; decode's deprecated run(q_len_per_req=) warns as
    FlashInfer's and takes 1 only."""
    h, hq, dh, ps = 2, 4, 32, 4
    cache, indptr, indices, last, kv = _paged(rng, [9, 6], ps, h, dh)
    qd = rng.standard_normal((2, hq, dh)).astype(F32)
    dec = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    dec.plan(indptr, indices, last, hq, h, dh, ps)
    want = dec.run(qd, cache)
    np.testing.assert_array_equal(
        dec.run(qd, cache, skip_softmax_threshold_scale_factor=None, kv_cache_sf=None), want)
    with pytest.warns(DeprecationWarning, match="q_len_per_req"):
        np.testing.assert_array_equal(dec.run(qd, cache, q_len_per_req=1), want)
    with pytest.warns(DeprecationWarning), pytest.raises(kvcache.UnsupportedError):
        dec.run(qd, cache, q_len_per_req=2)
    for bad in ({"kv_cache_sf": cache}, {"skip_softmax_threshold_scale_factor": 0.5}):
        with pytest.raises(kvcache.UnsupportedError, match=next(iter(bad))):
            dec.run(qd, cache, **bad)
        with pytest.raises(kvcache.UnsupportedError):
            dec.run_return_lse(qd, cache, **bad)

    qo = np.array([0, 3, 5], np.int32)
    q = rng.standard_normal((5, hq, dh)).astype(F32)
    paged = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    paged.plan(qo, indptr, indices, last, hq, h, dh, ps, causal=True)
    want = paged.run(q, cache)
    np.testing.assert_array_equal(paged.run(q, cache, use_fp16_softmax=False, kv_cache_sf=None,
                                            uses_spcompress=None), want)
    for bad in ({"kv_cache_sf": cache}, {"skip_softmax_threshold_scale_factor": 0.5},
                {"use_fp16_softmax": True}, {"uses_spcompress": True}):
        with pytest.raises(kvcache.UnsupportedError, match=next(iter(bad))):
            paged.run(q, cache, **bad)

    k = np.concatenate([a for a, _ in kv])
    v = np.concatenate([b for _, b in kv])
    ragged = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    ragged.plan(qo, np.array([0, 9, 15], np.int32), hq, h, dh, causal=True)
    np.testing.assert_array_equal(ragged.run(q, k, v, o_scale=None), want)
    for bad in ({"o_scale": 2.0}, {"kv_cache_sf": (k, v)}):
        with pytest.raises(kvcache.UnsupportedError, match=next(iter(bad))):
            ragged.run(q, k, v, **bad)

    heads, d_ckv, d_kpe = 2, 32, 16
    ckv = rng.standard_normal((4, ps, d_ckv)).astype(F32)
    kpe = rng.standard_normal((4, ps, d_kpe)).astype(F32)
    mla = kvcache.BatchMLAPagedAttentionWrapper(None)
    mla.plan(np.array([0, 1], np.int32), np.array([0, 2], np.int32), np.array([1, 3], np.int32),
             np.array([7], np.int32), heads, d_ckv, d_kpe, ps, False, 0.2)
    qn = rng.standard_normal((1, heads, d_ckv)).astype(F32)
    qp = rng.standard_normal((1, heads, d_kpe)).astype(F32)
    want = mla.run(qn, qp, ckv, kpe)
    # o_scale is FlashInfer's 12th positional argument
    np.testing.assert_array_equal(
        mla.run(qn, qp, ckv, kpe, None, None, False, None, None, None, False, None), want)
    for bad in ({"o_scale": 1.0}, {"ckv_scale": 1.0}, {"kpe_scale": 1.0},
                {"ckv_scale_arr": np.ones((4, ps, 1), F32)}):
        with pytest.raises(kvcache.UnsupportedError, match=next(iter(bad))):
            mla.run(qn, qp, ckv, kpe, **bad)


def test_run_takes_flashinfer_positionals_only(rng):
    """FlashInfer's wrappers are run(q, paged_kv_cache, *args, q_scale=...,
    return_lse=..., ...) (ragged: run(q, k, v, *args, ...)): *args are inputs
    of custom kernel variants, and everything after them is keyword-only.
    kvcache has no kernel variants, so an extra positional is refused with
    UnsupportedError naming it (a stale run(q, cache, kv_scale) call is not
    read as anything); kv_scale= and return_lse= work by keyword, against
    float64 references of the dequantized int8 cache."""
    import inspect

    h, hq, dh, ps, group = 2, 4, 16, 4, 8
    pg = ar.Paged(rng, [9, 5], ps, h, dh, "int8", group=group)
    s8 = pg.scale
    sm = 1.0 / math.sqrt(dh)
    keyword_only = ("kv_scale", "return_lse", "q_scale", "k_scale", "v_scale", "out", "lse")

    def check_signature(fn, fixed):
        ps_ = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in ps_[:len(fixed)]] == list(fixed)
        assert ps_[len(fixed)].kind is inspect.Parameter.VAR_POSITIONAL
        kinds = {p.name: p.kind for p in ps_}
        for name in keyword_only:
            assert kinds[name] is inspect.Parameter.KEYWORD_ONLY, name

    def refused(call, n):
        with pytest.raises(kvcache.UnsupportedError) as e:
            call()
        msg = str(e.value)
        assert f"got {n} extra positional argument" in msg and "args[0]" in msg
        assert "kv_scale=" in msg
        return msg

    # decode
    qd = ar.random_q(rng, (2, hq, dh), F32)
    dec = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    check_signature(dec.run, ("q", "paged_kv_cache"))
    dec.plan(*pg.table(), hq, h, dh, ps, kv_data_type="int8", quant_group=group)
    o, lse = dec.run(qd, pg.cache, kv_scale=s8, return_lse=True)
    want_o, want_lse = _decode_ref(qd, pg.kv, sm)
    ar.assert_close(o, want_o, 1e-5, "decode o")
    ar.assert_close(lse, want_lse, 1e-5, "decode lse")
    msg = refused(lambda: dec.run(qd, pg.cache, s8), 1)
    assert f"float32 array of shape {s8.shape}" in msg
    refused(lambda: dec.run_return_lse(qd, pg.cache, s8), 1)
    msg = refused(lambda: dec.run(qd, pg.cache, s8, True), 2)
    assert "args[1]: True" in msg
    dec.plan(*pg.table(), hq, h, dh, ps)  # float cache: a positional None is refused too
    fcache = pg.deq.astype(F32)
    refused(lambda: dec.run(qd, fcache, None), 1)
    np.testing.assert_array_equal(dec.run(qd, fcache, kv_scale=None),
                                  dec.run(qd, fcache))

    # paged prefill
    qo = np.array([0, 3, 5], np.int32)
    qp = ar.random_q(rng, (5, hq, dh), F32)
    paged = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    check_signature(paged.run, ("q", "paged_kv_cache"))
    paged.plan(qo, *pg.table(), hq, h, dh, ps, causal=True, kv_data_type="int8",
               quant_group=group)
    o, lse = paged.run(qp, pg.cache, kv_scale=s8, return_lse=True)
    want_o, want_lse = ar.batch_prefill(ar.f64(qp), pg.kv, qo, causal=True)
    ar.assert_close(o, want_o, 1e-5, "paged prefill o")
    ar.assert_close(lse, want_lse, 1e-5, "paged prefill lse")
    refused(lambda: paged.run(qp, pg.cache, s8), 1)
    refused(lambda: paged.run_return_lse(qp, pg.cache, s8), 1)

    # ragged prefill: k, v and their (k_scale, v_scale) pair
    ragged = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    check_signature(ragged.run, ("q", "k", "v"))
    parts = [pg.stored_request(b) for b in range(2)]
    k, v, ks, vs = (np.concatenate([p[i] for p in parts]) for i in range(4))
    ragged.plan(qo, np.array([0, 9, 14], np.int32), hq, h, dh, causal=True,
                kv_data_type="int8", quant_group=group)
    o, lse = ragged.run(qp, k, v, kv_scale=(ks, vs), return_lse=True)
    ar.assert_close(o, want_o, 1e-5, "ragged o")
    ar.assert_close(lse, want_lse, 1e-5, "ragged lse")
    msg = refused(lambda: ragged.run(qp, k, v, (ks, vs)), 1)
    assert "tuple of 2" in msg

    # cascade: one level, the same causal prefill
    cas = kvcache.MultiLevelCascadeAttentionWrapper(1, None, "NHD")
    check_signature(cas.run, ("q", "paged_kv_cache"))
    cas.plan([qo], [pg.indptr], [pg.indices], [pg.last], hq, h, dh, ps, causal=True,
             kv_data_type="int8", quant_group=group)
    o, lse = cas.run(qp, pg.cache, kv_scale=s8, return_lse=True)
    ar.assert_close(o, want_o, 1e-5, "cascade o")
    ar.assert_close(lse, want_lse, 1e-5, "cascade lse")
    refused(lambda: cas.run(qp, pg.cache, s8), 1)
    refused(lambda: cas.forward(qp, pg.cache, s8, True), 2)


# FlashInfer reads dtype strings as torch attribute names (utils.py
# canonicalize_torch_dtype: getattr(torch, name)): "float" is float32 and
# "half" float16 there, unlike numpy's "float" (float64).
_FLOAT_NAMES = [("float", F32), ("float32", F32), ("half", F16), ("float16", F16),
                (" Float ", F32), ("fp16", F16), ("f32", F32)]


@pytest.mark.parametrize("name,dt", _FLOAT_NAMES, ids=[n.strip() + "-" + np.dtype(d).name
                                                        for n, d in _FLOAT_NAMES])
def test_dtype_names_as_flashinfer(rng, name, dt):
    """Every place that takes a dtype by name reads FlashInfer's names the
    same way: plan q/kv/o_data_type of the decode, prefill, cascade and MLA
    wrappers, single_prefill's o_dtype, PagedKVCache dtype/scale_dtype,
    quant.convert/quantize/dequantize and Model kv_dtype. The outputs have
    that dtype and match float64 references; float64 names stay refused."""
    from kvcache import model as kv_model
    from kvcache import quant

    h, hq, dh, ps = 2, 4, 16, 4
    tol = 1e-5 if dt == F32 else 2e-3
    cache, indptr, indices, last, kv = _paged(rng, [7, 5], ps, h, dh)
    cache = cache.astype(dt)
    kv = [(ar.f64(k.astype(dt)), ar.f64(v.astype(dt))) for k, v in kv]
    qd = ar.random_q(rng, (2, hq, dh), dt)
    dec = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    dec.plan(indptr, indices, last, hq, h, dh, ps, q_data_type=name, kv_data_type=name,
             o_data_type=name)
    o = dec.run(qd, cache)
    assert o.dtype == dt
    ar.assert_close(o, _decode_ref(qd, kv, 1.0 / math.sqrt(dh))[0], tol, f"decode {name}")
    other = F16 if dt == F32 else F32
    with pytest.raises(kvcache.InvalidArgumentError):  # the plan's q dtype is checked
        dec.run(qd.astype(other), cache)
    dec.plan(indptr, indices, last, hq, h, dh, ps, data_type=name)  # FlashInfer's deprecated
    assert dec.run(qd, cache).dtype == dt

    qo = np.array([0, 3, 5], np.int32)
    qp = ar.random_q(rng, (5, hq, dh), dt)
    want_o, _ = ar.batch_prefill(ar.f64(qp), kv, qo, causal=True)
    paged = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    paged.plan(qo, indptr, indices, last, hq, h, dh, ps, causal=True, q_data_type=name,
               kv_data_type=name, o_data_type=name)
    o = paged.run(qp, cache)
    assert o.dtype == dt
    ar.assert_close(o, want_o, tol, f"paged prefill {name}")
    ragged = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    ragged.plan(qo, np.array([0, 7, 12], np.int32), hq, h, dh, causal=True, q_data_type=name,
                kv_data_type=name, o_data_type=name)
    k = np.concatenate([a for a, _ in kv]).astype(dt)
    v = np.concatenate([b for _, b in kv]).astype(dt)
    o = ragged.run(qp, k, v)
    assert o.dtype == dt
    ar.assert_close(o, want_o, tol, f"ragged {name}")
    cas = kvcache.MultiLevelCascadeAttentionWrapper(1, None, "NHD")
    cas.plan([qo], [indptr], [indices], [last], hq, h, dh, ps, causal=True, q_data_type=name,
             kv_data_type=name, o_data_type=name)
    o = cas.run(qp, cache)
    assert o.dtype == dt
    ar.assert_close(o, want_o, tol, f"cascade {name}")
    o = kvcache.single_prefill_with_kv_cache(qp[:3], kv[0][0].astype(dt), kv[0][1].astype(dt),
                                             causal=True, o_dtype=name)
    assert o.dtype == dt
    ar.assert_close(o, want_o[:3], tol, f"single prefill {name}")

    mla = kvcache.BatchMLAPagedAttentionWrapper(None)
    mla.plan(np.array([0, 1], np.int32), np.array([0, 2], np.int32), np.array([1, 3], np.int32),
             np.array([7], np.int32), 2, 32, 16, ps, False, 0.2, q_data_type=name,
             kv_data_type=name)
    ckv = ar.random_q(rng, (4, ps, 32), dt)
    kpe = ar.random_q(rng, (4, ps, 16), dt)
    qn, qpe = ar.random_q(rng, (1, 2, 32), dt), ar.random_q(rng, (1, 2, 16), dt)
    assert mla.run(qn, qpe, ckv, kpe).shape == (1, 2, 32)
    with pytest.raises(kvcache.InvalidArgumentError):
        mla.run(qn.astype(other), qpe.astype(other), ckv, kpe)

    pc = kvcache.PagedKVCache(1, h, dh, ps, 4, dtype=name)
    assert pc.dtype == np.dtype(dt).name
    pc.close()
    pc = kvcache.PagedKVCache(1, h, dh, ps, 4, dtype="int8", scale_dtype=name)
    assert pc.scale_dtype == np.dtype(dt).name
    pc.close()
    x = rng.standard_normal((3, 16)).astype(np.float32)
    y = quant.convert(x, name)
    assert y.dtype == dt
    np.testing.assert_array_equal(y, x.astype(dt))
    qx, s = quant.quantize(x, 8, 8, scale_dtype=name)
    assert s.dtype == dt
    assert quant.dequantize(qx, s, 8, 8, dtype=name).dtype == dt
    assert kv_model._kv_storage(name)[:2] == (np.dtype(dt).name,
                                              {F32: 0, F16: 1}[dt])

    for bad in ("float64", "double"):
        with pytest.raises(kvcache.InvalidArgumentError):
            dec.plan(indptr, indices, last, hq, h, dh, ps, q_data_type=bad)
        with pytest.raises(kvcache.InvalidArgumentError):
            kvcache.PagedKVCache(1, h, dh, ps, 4, dtype=bad)
        with pytest.raises(kvcache.InvalidArgumentError):
            quant.convert(x, bad)
        with pytest.raises(kvcache.InvalidArgumentError):
            kv_model._kv_storage(bad)


def test_quantized_dtype_names(rng):
    """kv_data_type "int8"/"i8" and "int4"/"i4"/"uint8" (int4 lives in uint8
    arrays) name the same cache dtypes in every wrapper."""
    h, hq, dh, ps = 2, 4, 16, 4
    pg = ar.Paged(rng, [6, 3], ps, h, dh, "int4", group=8)
    qd = ar.random_q(rng, (2, hq, dh), F32)
    dec = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    outs = []
    for name in ("int4", "I4", "uint8"):
        dec.plan(*pg.table(), hq, h, dh, ps, kv_data_type=name, quant_group=8)
        outs.append(dec.run(qd, pg.cache, kv_scale=pg.scale))
    want, _ = _decode_ref(qd, pg.kv, 1.0 / math.sqrt(dh))
    ar.assert_close(outs[0], want, 1e-5, "int4 decode")
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    for name in ("int8", "i8"):
        dec.plan(*pg.table(), hq, h, dh, ps, kv_data_type=name, quant_group=8)
        with pytest.raises(kvcache.InvalidArgumentError, match="int8"):
            dec.run(qd, pg.cache, kv_scale=pg.scale)  # a uint8 (int4) cache
    pc = kvcache.PagedKVCache(1, h, dh, ps, 4, dtype="i4")
    assert pc.dtype == "int4"
    pc.close()


def test_gpu_switches_refused_by_value_not_truth(rng):
    """Options accepted only at their neutral value (head_dim_vo,
    pos_encoding_mode, use_fp16_qk_reduction, run's use_fp16_softmax /
    uses_spcompress, MLA's use_profiler) refuse arrays and other odd values
    with kvcache's errors; they were tested by truth value, so an array
    raised numpy's own ValueError ("truth value of an array is ambiguous")
    and a string such as "False" counted as true."""
    h, hq, dh, ps = 2, 4, 16, 4
    cache, indptr, indices, last, kv = _paged(rng, [6, 3], ps, h, dh)
    qo = np.array([0, 2, 3], np.int32)
    q = rng.standard_normal((3, hq, dh)).astype(F32)
    odd = (np.zeros(2), np.array([]), np.array([True, False]), "False", 2)
    paged = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    ragged = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    cas = kvcache.MultiLevelCascadeAttentionWrapper(1, None, "NHD")
    plans = {
        "paged": lambda **kw: paged.plan(qo, indptr, indices, last, hq, h, dh, ps, **kw),
        "ragged": lambda **kw: ragged.plan(qo, np.array([0, 6, 9], np.int32), hq, h, dh, **kw),
        "cascade": lambda **kw: cas.plan([qo], [indptr], [indices], [last], hq, h, dh, ps, **kw),
        "single": lambda **kw: kvcache.single_prefill_with_kv_cache(q[:2], kv[0][0], kv[0][1],
                                                                    **kw),
    }
    for name, plan in plans.items():
        for bad in odd:
            for opt in ("use_fp16_qk_reduction", "pos_encoding_mode"):
                with pytest.raises(E):
                    plan(**{opt: bad})
            if name in ("paged", "ragged"):
                with pytest.raises(E):
                    plan(head_dim_vo=bad)
        plan(use_fp16_qk_reduction=False, pos_encoding_mode="NONE")  # the neutral values
        plan(use_fp16_qk_reduction=None, pos_encoding_mode=None)
    with pytest.raises(kvcache.UnsupportedError, match="use_fp16_qk_reduction"):
        plans["paged"](use_fp16_qk_reduction=True)
    with pytest.raises(kvcache.UnsupportedError, match="head_dim_vo"):
        plans["paged"](head_dim_vo=dh * 2)
    plans["paged"](head_dim_vo=dh)
    want = ar.batch_prefill(ar.f64(q), [(ar.f64(k), ar.f64(v)) for k, v in kv], qo)[0]
    ar.assert_close(paged.run(q, cache, use_fp16_softmax=False, uses_spcompress=None), want,
                    1e-5, "paged prefill")
    for opt in ("use_fp16_softmax", "uses_spcompress"):
        for bad in odd + (True,):
            with pytest.raises(kvcache.UnsupportedError, match=opt):
                paged.run(q, cache, **{opt: bad})

    mla = kvcache.BatchMLAPagedAttentionWrapper(None)
    margs = (np.array([0, 1], np.int32), np.array([0, 2], np.int32), np.array([1, 3], np.int32),
             np.array([7], np.int32), 2, 32, 16, ps, False, 0.2)
    for bad in odd:
        with pytest.raises(E):
            mla.plan(*margs, use_profiler=bad)
    with pytest.raises(kvcache.UnsupportedError, match="use_profiler"):
        mla.plan(*margs, use_profiler=True)
    mla.plan(*margs, use_profiler=False)


def test_forward_positionals_as_flashinfer(rng):
    """The deprecated forward()s take FlashInfer's positionals only (its
    forward has no return_lse; forward_return_lse sets it): a further
    positional is a TypeError, as in FlashInfer, not read as return_lse."""
    import inspect

    fi_forward = {  # flashinfer decode.py / prefill.py forward(self, ...)
        kvcache.BatchDecodeWithPagedKVCacheWrapper: [
            "q", "paged_kv_cache", "pos_encoding_mode", "q_scale", "k_scale", "v_scale",
            "window_left", "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta"],
        kvcache.BatchPrefillWithPagedKVCacheWrapper: [
            "q", "paged_kv_cache", "causal", "pos_encoding_mode", "use_fp16_qk_reduction",
            "k_scale", "v_scale", "window_left", "logits_soft_cap", "sm_scale", "rope_scale",
            "rope_theta"],
        kvcache.BatchPrefillWithRaggedKVCacheWrapper: [
            "q", "k", "v", "causal", "pos_encoding_mode", "use_fp16_qk_reduction",
            "window_left", "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta"],
    }
    for cls, names in fi_forward.items():
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        positional = [p.name for p in params
                      if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert positional == names, cls.__name__
        assert inspect.signature(cls.forward).parameters["return_lse"].kind is \
            inspect.Parameter.KEYWORD_ONLY

    h, hq, dh, ps = 2, 4, 16, 4
    cache, indptr, indices, last, kv = _paged(rng, [5, 3], ps, h, dh)
    q = rng.standard_normal((2, hq, dh)).astype(F32)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
    w.plan(indptr, indices, last, hq, h, dh, ps)
    with pytest.raises(TypeError):
        w.forward(q, cache, "NONE", None, None, None, -1, None, None, None, None, True)
    o, lse = w.forward(q, cache, return_lse=True)
    want_o, want_lse = _decode_ref(q, kv, 1.0 / math.sqrt(dh))
    ar.assert_close(o, want_o, 1e-5, "forward o")
    ar.assert_close(lse, want_lse, 1e-5, "forward lse")
    o2, lse2 = w.forward_return_lse(q, cache)
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(lse2, lse)
    qo = np.array([0, 2, 3], np.int32)
    qp = rng.standard_normal((3, hq, dh)).astype(F32)
    p = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    p.plan(qo, indptr, indices, last, hq, h, dh, ps)
    with pytest.raises(TypeError):
        p.forward(qp, cache, False, "NONE", False, None, None, -1, None, None, None, None, True)
    r = kvcache.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD")
    r.plan(qo, np.array([0, 5, 8], np.int32), hq, h, dh)
    k = np.concatenate([a for a, _ in kv])
    v = np.concatenate([b for _, b in kv])
    with pytest.raises(TypeError):
        r.forward(qp, k, v, False, "NONE", False, -1, None, None, None, None, True)
    np.testing.assert_array_equal(r.forward(qp, k, v, return_lse=True)[0],
                                  p.forward(qp, cache, return_lse=True)[0])


def test_fp8_dtype_names_unsupported(rng):
    """FlashInfer's fp8 / fp4 dtype names (torch's float8_e4m3fn, ...) are
    valid names of storage kvcache lacks: UnsupportedError naming the
    argument, wherever a dtype is given by name (they were 'unknown dtype'
    InvalidArgumentErrors, or 'must be one of' ones)."""
    from kvcache import model as kv_model
    from kvcache import quant

    h, hq, dh, ps = 2, 4, 16, 4
    _, indptr, indices, last, _ = _paged(rng, [5], ps, h, dh)
    x = rng.standard_normal((2, 16)).astype(F32)
    for name in ("float8_e4m3fn", "float8_e5m2", " Float8_E4M3FN "):
        calls = {
            "kv_data_type": lambda: kvcache.BatchDecodeWithPagedKVCacheWrapper().plan(
                indptr, indices, last, hq, h, dh, ps, kv_data_type=name),
            "q_data_type": lambda: kvcache.BatchPrefillWithPagedKVCacheWrapper().plan(
                np.array([0, 1], np.int32), indptr, indices, last, hq, h, dh, ps,
                q_data_type=name),
            "o_dtype": lambda: kvcache.single_prefill_with_kv_cache(
                rng.standard_normal((1, hq, dh)).astype(F32),
                rng.standard_normal((3, h, dh)).astype(F32),
                rng.standard_normal((3, h, dh)).astype(F32), o_dtype=name),
            "dtype": lambda: kvcache.PagedKVCache(1, h, dh, ps, 4, dtype=name),
            "scale_dtype": lambda: quant.quantize(x, 8, 8, scale_dtype=name),
            "kv_dtype": lambda: kv_model._kv_storage(name),
        }
        for what, call in calls.items():
            with pytest.raises(kvcache.UnsupportedError, match=f"{what} .*fp8"):
                call()
        with pytest.raises(kvcache.UnsupportedError, match="fp8"):
            quant.convert(x, name)
        mla = kvcache.BatchMLAPagedAttentionWrapper(None)
        with pytest.raises(kvcache.UnsupportedError, match="kv_data_type .*fp8"):
            mla.plan(np.array([0, 1], np.int32), np.array([0, 2], np.int32),
                     np.array([1, 3], np.int32), np.array([7], np.int32), 2, 32, 16, ps, False,
                     0.2, kv_data_type=name)
