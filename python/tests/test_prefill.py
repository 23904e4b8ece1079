"""Prefill attention (kvcache.prefill: single_prefill_with_kv_cache,
BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper)
against the float64 numpy reference of attn_reference.py, written from
shared/docs/SEMANTICS.md section 5 (not from the C code). Quantized K/V are
made with kvc_reference (SEMANTICS 1) and the reference runs on their
dequantized values.

Tolerances (SEMANTICS 5): rtol = atol = 1e-5 for float32 outputs, 1e-3 for
16-bit ones (plus the rounding step of a bfloat16 output); lse (float32) 1e-5
for a float32 q, 1e-3 otherwise.

The grids sample the cross product of batch {1, 3, 17}, kv_len {1, 7, 54,
512, 2048}, qo_len {1, 17, 127}, page_size {1, 5, 16}, Hq/H {1, 4, 8},
Dh {64, 128}, NHD/HND, storage {f32, f16, bf16, int8, int4}, q dtype and mask
kind so that every value of every axis appears (checked by
test_grids_cover_every_axis_value); every grid runs on every ISA the CPU
supports (kvcache.supported_isas()).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import attn_reference as ar
import kvcache
import kvc_reference as ref
from attn_reference import BF16, F16, F32, assert_close, f64, lse_tol, out_tol

KV_LENS = (1, 7, 54, 512, 2048)
QO_LENS = (1, 17, 127)
GROUPS = (1, 4, 8)
HEAD_DIMS = (64, 128)
LAYOUTS = ("NHD", "HND")
PAGE_SIZES = (1, 5, 16)
BATCHES = (1, 3, 17)
MASKS = ("none", "causal", "custom", "packed", "window", "causal_window")


def _available() -> str | None:
    q = np.zeros((1, 1, 8), F32)
    try:
        kvcache.single_prefill_with_kv_cache(q, q, q, num_threads=1)
    except kvcache.UnsupportedError as exc:
        return str(exc)
    except kvcache.KvcacheError:
        return None  # a real error: the tests will show it
    return None


_WHY = _available()
needs_prefill = pytest.mark.skipif(_WHY is not None, reason=f"prefill not in the library: {_WHY}")


def heads_for(group):
    """(Hq, H) for a GQA group size: H = 2 except for group 8 (H = 1)."""
    h = 1 if group == 8 else 2
    return group * h, h


def mask_args(rng, kind, qo_len, kv_len):
    """(kwargs for kvcache, kwargs for the reference) of a mask kind."""
    if kind == "none":
        return {}, {}
    if kind == "causal":
        return {"causal": True}, {"causal": True}
    if kind in ("window", "causal_window"):
        w = int(rng.integers(0, max(1, kv_len // 2) + 1))
        causal = kind == "causal_window"
        return {"causal": causal, "window_left": w}, {"causal": causal, "window_left": w}
    m = rng.random((qo_len, kv_len)) < 0.7
    if qo_len > 2:
        m[1] = False  # a fully masked row
    if kind == "custom":
        return {"custom_mask": m, "causal": True}, {"custom": m}  # the mask replaces causal
    return {"packed_custom_mask": ar.pack_little(m)}, {"custom": m}


# ---------------------------------------------------------------------------
# Single prefill


def single_cases():
    """16 cases covering every axis value (see the module docstring)."""
    cases = []
    for i in range(16):
        cases.append(dict(
            storage=ar.STORAGES[i % 5], kv_len=KV_LENS[(2 * i + i // 5) % 5],
            qo_len=QO_LENS[i % 3], group=GROUPS[(i // 3) % 3], dh=HEAD_DIMS[(i // 2) % 2],
            layout=LAYOUTS[(i + i // 4) % 2], q_dtype=ar.Q_DTYPES[(i + i // 3) % 3],
            mask=MASKS[i % 6]))
    # the most expensive shape, limited to one case
    for c in cases:
        if c["kv_len"] == 2048 and c["qo_len"] == 127:
            c["qo_len"] = 17
    cases[15].update(kv_len=2048, qo_len=127, group=8, dh=128, mask="causal")
    return cases


SINGLE = single_cases()


def case_id(c):
    return (f"{c['storage']}-kv{c['kv_len']}-qo{c['qo_len']}-g{c['group']}-d{c['dh']}-"
            f"{c['layout']}-{ar.DT_NAMES[np.dtype(c['q_dtype'])]}-{c['mask']}")


def run_single_case(rng, c, num_threads=2):
    hq, h = heads_for(c["group"])
    dh, kv_len, qo_len, layout = c["dh"], c["kv_len"], c["qo_len"], c["layout"]
    k, ks, kd = ar.make_storage(rng, (kv_len, h, dh), c["storage"], scale_dtype=F32)
    v, vs, vd = ar.make_storage(rng, (kv_len, h, dh), c["storage"], scale_dtype=F16)
    q = ar.random_q(rng, (qo_len, hq, dh), c["q_dtype"], mag=2.0)
    kw, rkw = mask_args(rng, c["mask"], qo_len, kv_len)
    want_o, want_lse = ar.prefill(f64(q), kd, vd, **rkw)
    args = (q, ar.to_layout(k, layout), ar.to_layout(v, layout))
    scales = dict(k_scale=ar.to_layout(ks, layout), v_scale=ar.to_layout(vs, layout))
    o, lse = kvcache.single_prefill_with_kv_cache(*args, kv_layout=layout, return_lse=True,
                                                  num_threads=num_threads, **scales, **kw)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == F32 and lse.shape == (qo_len, hq)
    what = case_id(c)
    assert_close(o, want_o, out_tol(q.dtype), "o " + what)
    assert_close(lse, want_lse, lse_tol(q.dtype), "lse " + what)
    return args, scales, kw, o, lse


@needs_prefill
@pytest.mark.parametrize("c", SINGLE, ids=[case_id(c) for c in SINGLE])
def test_single_prefill_grid(isa, rng, c):
    args, scales, kw, o, _lse = run_single_case(rng, c)
    # one thread, without lse: the same bytes
    o1 = kvcache.single_prefill_with_kv_cache(*args, kv_layout=c["layout"], num_threads=1,
                                              **scales, **kw)
    assert isinstance(o1, np.ndarray)
    ref.assert_same_bytes(o1, o, "o with 1 thread and no lse vs 2 threads with lse")


@needs_prefill
def test_single_prefill_every_isa(isa, rng):
    for i, storage in enumerate(ar.STORAGES):
        c = dict(storage=storage, kv_len=54 + 7 * i, qo_len=17, group=GROUPS[i % 3],
                 dh=HEAD_DIMS[i % 2], layout=LAYOUTS[i % 2], q_dtype=F32,
                 mask=("causal", "custom", "causal_window", "packed", "none")[i])
        run_single_case(rng, c)


@needs_prefill
@pytest.mark.parametrize("dh,kv_len", [(128, 512), (64, 64)])
def test_large_scores_float32_accuracy(isa, dh, kv_len):
    """q and K of standard deviation 3 (scores of standard deviation 9, a
    sharp softmax): float32 prefill and decode stay within rtol = atol =
    1e-5 of float64 on the same inputs. One FMA chain of Dh products per
    score missed it (up to 1.75x the tolerance; decode was within 0.6x)."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        k = (3.0 * rng.standard_normal((kv_len, 2, dh))).astype(F32)
        v = rng.standard_normal((kv_len, 2, dh)).astype(F32)
        q = (3.0 * rng.standard_normal((5, 8, dh))).astype(F32)
        for causal in (False, True):
            want, want_lse = ar.prefill(f64(q), f64(k), f64(v), causal=causal)
            o, lse = kvcache.single_prefill_with_kv_cache(q, k, v, causal=causal,
                                                          return_lse=True)
            assert_close(o, want, 1e-5, f"prefill seed {seed} causal {causal}")
            assert_close(lse, want_lse, 1e-5, f"prefill lse seed {seed} causal {causal}")
        want, _ = ar.prefill(f64(q[:1]), f64(k), f64(v))
        o = kvcache.single_decode_with_kv_cache(q[0], k, v)
        assert_close(o, want[0], 1e-5, f"decode seed {seed}")


@needs_prefill
@pytest.mark.parametrize("q_dtype", [F32, F16], ids=["f32", "f16"])
def test_single_prefill_params(rng, q_dtype):
    """sm_scale, logits_soft_cap and window_left, with and without causal."""
    hq, h, dh, qo_len, kv_len = 8, 2, 64, 17, 60
    k = rng.standard_normal((kv_len, h, dh)).astype(np.float32)
    v = rng.standard_normal((kv_len, h, dh)).astype(np.float32)
    q = ar.random_q(rng, (qo_len, hq, dh), q_dtype, mag=3.0)
    for sm_scale, cap, w, causal in ((0.3, None, -1, True), (None, 2.5, -1, False),
                                     (None, None, 0, True), (None, None, 5, False),
                                     (0.05, 1.0, 17, True), (None, None, 1000, True),
                                     (-0.2, 0.0, -1, False), (None, 30.0, 3, True)):
        want_o, want_lse = ar.prefill(f64(q), f64(k), f64(v), causal, w, None, sm_scale, cap)
        o, lse = kvcache.single_prefill_with_kv_cache(
            q, k, v, causal=causal, sm_scale=sm_scale, logits_soft_cap=cap, window_left=w,
            return_lse=True)
        what = f"sm_scale={sm_scale} cap={cap} window={w} causal={causal}"
        assert_close(o, want_o, out_tol(q_dtype), "o " + what)
        assert_close(lse, want_lse, lse_tol(q_dtype), "lse " + what)


@needs_prefill
@pytest.mark.parametrize("out_dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_single_prefill_out_dtype(rng, out_dtype):
    k = rng.standard_normal((30, 2, 64)).astype(F16)
    v = rng.standard_normal((30, 2, 64)).astype(F16)
    q = ar.random_q(rng, (9, 4, 64), F16)
    want_o, _ = ar.prefill(f64(q), f64(k), f64(v), causal=True)
    o = kvcache.single_prefill_with_kv_cache(q, k, v, causal=True, out_dtype=out_dtype)
    assert o.dtype == out_dtype and o.shape == q.shape
    assert_close(o, want_o, out_tol(F16), f"o out_dtype={out_dtype}", out_dtype=out_dtype)
    name = {F32: "float32", F16: "float16", BF16: "bfloat16"}[np.dtype(out_dtype)]
    o2 = kvcache.single_prefill_with_kv_cache(q, k, v, causal=True, out_dtype=name)
    ref.assert_same_bytes(o2, o, "out_dtype by name")


# ---------------------------------------------------------------------------
# Edge cases


@needs_prefill
@pytest.mark.parametrize("storage", ["f32", "f16", "bf16"])
def test_extreme_negative_scores_beat_masked_keys(rng, storage):
    """Visible scores of -524288 (sm_scale 1, q = 1, k = -8192, Dh 64) still
    win over masked keys whose scores are large and positive: masked keys are
    -inf, not a finite sentinel."""
    dt = ar.FLOAT_STORAGE[storage]
    dh, qo_len, kv_len = 64, 4, 6
    q = np.ones((qo_len, 1, dh), F32)
    k = np.full((kv_len, 1, dh), 100.0, F32)  # masked keys: score +6400
    vis_keys = [0, 2]
    k[vis_keys] = -8192.0
    v = rng.standard_normal((kv_len, 1, dh)).astype(np.float32).astype(dt)
    k = k.astype(dt)
    mask = np.zeros((qo_len, kv_len), bool)
    mask[:, vis_keys] = True
    mask[3] = False  # and a fully masked row
    for kw in ({"custom_mask": mask}, {"packed_custom_mask": ar.pack_little(mask)}):
        o, lse = kvcache.single_prefill_with_kv_cache(q, k, v, sm_scale=1.0, return_lse=True,
                                                      **kw)
        want = (f64(v[0]) + f64(v[2])) / 2
        for i in range(3):
            np.testing.assert_allclose(o[i, 0], want[0], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(lse[i, 0], 1.0 - 524288.0 / ar.LN2, rtol=1e-6)
        assert np.all(o[3] == 0) and lse[3, 0] == -np.inf
    if storage != "f32":
        return
    # causal (row i sees keys j <= i + 2): past keys score -524288 (q one-hot,
    # so the scores are exact), future keys +6400. (Distinct scores near -5e5:
    # test_attention.test_large_scores_keep_their_differences.)
    q1 = np.zeros((qo_len, 1, dh), F32)
    q1[:, 0, 0] = 1.0
    k2 = rng.standard_normal((kv_len, 1, dh)).astype(F32)
    k2[:, 0, 0] = -524288.0
    k2[3:, 0, 0] = 6400.0  # hidden from row 0 (it sees j <= 2)
    o, lse = kvcache.single_prefill_with_kv_cache(q1, k2, v, sm_scale=1.0, causal=True,
                                                  return_lse=True)
    want_o, want_lse = ar.prefill(f64(q1), f64(k2), f64(v), causal=True, sm_scale=1.0)
    assert_close(o, want_o, 1e-5, "o causal extreme")
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    np.testing.assert_allclose(o[0, 0], f64(v[:3, 0]).mean(axis=0), rtol=1e-6, atol=1e-6)


@needs_prefill
def test_fully_masked_rows_and_empty_kv(rng):
    """Rows that see no key give exactly 0 and lse -inf, never NaN."""
    dh = 64
    # qo_len 34 > kv_len 1 with causal: rows 0..32 see nothing, row 33 sees key 0
    q = ar.random_q(rng, (34, 4, dh), F32)
    k = rng.standard_normal((1, 2, dh)).astype(F32)
    v = rng.standard_normal((1, 2, dh)).astype(F32)
    for layout in LAYOUTS:
        o, lse = kvcache.single_prefill_with_kv_cache(
            q, ar.to_layout(k, layout), ar.to_layout(v, layout), causal=True,
            kv_layout=layout, return_lse=True)
        assert not np.isnan(o).any() and not np.isnan(lse).any()
        assert np.all(o[:33] == 0) and np.all(np.isneginf(lse[:33]))
        np.testing.assert_allclose(o[33], np.repeat(v[0], 2, axis=0), rtol=1e-6, atol=1e-7)
        s = (f64(q[33]) * np.repeat(f64(k[0]), 2, axis=0)).sum(-1) / math.sqrt(dh)
        np.testing.assert_allclose(lse[33], s / ar.LN2, rtol=1e-5, atol=1e-5)
    # kv_len 0 (every storage): all rows empty
    for storage in ar.STORAGES:
        k0, ks0, _ = ar.make_storage(rng, (0, 2, dh), storage)
        v0, vs0, _ = ar.make_storage(rng, (0, 2, dh), storage)
        for causal in (False, True):
            o, lse = kvcache.single_prefill_with_kv_cache(q[:5], k0, v0, causal=causal,
                                                          k_scale=ks0, v_scale=vs0,
                                                          return_lse=True)
            assert np.all(o == 0) and np.all(np.isneginf(lse)), storage
    # qo_len 0
    o, lse = kvcache.single_prefill_with_kv_cache(q[:0], k, v, causal=True, return_lse=True)
    assert o.shape == (0, 4, dh) and lse.shape == (0, 4)
    # a mask with zero rows and a window that hides everything of early rows
    mask = np.ones((5, 1), bool)
    mask[[0, 3]] = False
    o, lse = kvcache.single_prefill_with_kv_cache(q[:5], k, v, custom_mask=mask,
                                                  return_lse=True)
    assert np.all(o[[0, 3]] == 0) and np.all(np.isneginf(lse[[0, 3]]))
    assert np.all(np.isfinite(lse[[1, 2, 4]]))


@needs_prefill
@pytest.mark.parametrize("layout", LAYOUTS)
def test_window_zero_and_qo_longer_than_kv(rng, layout):
    """window_left 0 with causal: row i sees only key i + kv_len - qo_len;
    qo_len > kv_len with causal (and with a window)."""
    hq, h, dh = 4, 2, 64
    for qo_len, kv_len in ((17, 54), (17, 7), (127, 54)):
        k = rng.standard_normal((kv_len, h, dh)).astype(F32)
        v = rng.standard_normal((kv_len, h, dh)).astype(F32)
        q = ar.random_q(rng, (qo_len, hq, dh), F32)
        kl, vl = ar.to_layout(k, layout), ar.to_layout(v, layout)
        o, lse = kvcache.single_prefill_with_kv_cache(q, kl, vl, causal=True, window_left=0,
                                                      kv_layout=layout, return_lse=True)
        for i in range(qo_len):
            j = i + kv_len - qo_len
            if j < 0:
                assert np.all(o[i] == 0) and np.all(np.isneginf(lse[i]))
            else:
                np.testing.assert_allclose(o[i], np.repeat(v[j], hq // h, axis=0), rtol=1e-6,
                                           atol=1e-7)
        for causal, w in ((True, -1), (True, 3), (False, 0), (False, 2)):
            want_o, want_lse = ar.prefill(f64(q), f64(k), f64(v), causal, w)
            o, lse = kvcache.single_prefill_with_kv_cache(
                q, kl, vl, causal=causal, window_left=w, kv_layout=layout, return_lse=True)
            what = f"qo={qo_len} kv={kv_len} causal={causal} w={w}"
            assert_close(o, want_o, 1e-5, "o " + what)
            assert_close(lse, want_lse, 1e-5, "lse " + what)


@needs_prefill
def test_custom_mask_forms(rng):
    """A custom mask equal to the causal mask gives the causal result; the
    packed mask gives the same bytes as the boolean one; a mask of ints,
    a flat mask and a mask with causal=True (ignored) all agree."""
    hq, h, dh = 8, 2, 64
    for qo_len, kv_len in ((17, 54), (1, 7), (127, 512), (9, 3)):
        k = rng.standard_normal((kv_len, h, dh)).astype(F16)
        v = rng.standard_normal((kv_len, h, dh)).astype(F16)
        q = ar.random_q(rng, (qo_len, hq, dh), F32)
        tril = np.tril(np.ones((qo_len, kv_len), bool), k=kv_len - qo_len)
        oc, lc = kvcache.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
        om, lm = kvcache.single_prefill_with_kv_cache(q, k, v, custom_mask=tril,
                                                      return_lse=True)
        assert_close(om, f64(oc), 1e-5, "custom == causal: o")
        assert_close(lm, f64(lc), 1e-5, "custom == causal: lse")
        rnd = rng.random((qo_len, kv_len)) < 0.5
        want_o, want_lse = ar.prefill(f64(q), f64(k), f64(v), custom=rnd)
        ob, lb = kvcache.single_prefill_with_kv_cache(q, k, v, custom_mask=rnd, return_lse=True)
        assert_close(ob, want_o, 1e-5, "o random mask")
        assert_close(lb, want_lse, 1e-5, "lse random mask")
        for kw in ({"packed_custom_mask": ar.pack_little(rnd)},
                   {"packed_custom_mask": kvcache.packbits(rnd, bitorder="little")},
                   {"custom_mask": rnd.astype(np.int32) * 7},
                   {"custom_mask": rnd.reshape(-1)},
                   {"custom_mask": rnd, "causal": True}):
            o, lse = kvcache.single_prefill_with_kv_cache(q, k, v, return_lse=True, **kw)
            ref.assert_same_bytes(o, ob, f"o with {sorted(kw)} vs boolean mask")
            ref.assert_same_bytes(lse, lb, f"lse with {sorted(kw)} vs boolean mask")


@needs_prefill
def test_causal_row_equals_one_row_request(rng):
    """prefill.h's row-independence contract: a row of a causal prefill is
    bitwise equal to the same row run alone over the keys it sees; and rows
    do not depend on qo_len or the thread count."""
    for storage, qdt in (("f32", F32), ("int4", F16), ("bf16", BF16)):
        hq, h, dh, qo_len, kv_len = 8, 2, 128, 17, 300
        k, ks, _ = ar.make_storage(rng, (kv_len, h, dh), storage)
        v, vs, _ = ar.make_storage(rng, (kv_len, h, dh), storage)
        q = ar.random_q(rng, (qo_len, hq, dh), qdt)
        o, lse = kvcache.single_prefill_with_kv_cache(q, k, v, causal=True, k_scale=ks,
                                                      v_scale=vs, return_lse=True,
                                                      num_threads=2)
        for i in (0, 5, qo_len - 1):
            n = i + kv_len - qo_len + 1

            def sub(a, n=n):
                return None if a is None else np.ascontiguousarray(a[:n])

            oi, li = kvcache.single_prefill_with_kv_cache(
                q[i:i + 1], sub(k), sub(v), k_scale=sub(ks), v_scale=sub(vs), return_lse=True,
                num_threads=1)
            ref.assert_same_bytes(oi[0], o[i], f"{storage} row {i} alone")
            ref.assert_same_bytes(li[0], lse[i], f"{storage} lse row {i} alone")
        # the last 5 rows as a shorter prefill over the same keys
        o5 = kvcache.single_prefill_with_kv_cache(q[-5:], k, v, causal=True, k_scale=ks,
                                                  v_scale=vs, num_threads=1)
        ref.assert_same_bytes(o5, o[-5:], f"{storage} last rows as a shorter prefill")


@needs_prefill
def test_single_prefill_strided_inputs(rng):
    """K/V/q slices of larger arrays (head and row strides, not contiguous)."""
    base = rng.standard_normal((40, 3, 2, 72)).astype(F32)
    k = base[:, 0, :, 4:68]  # (40, 2, 64), strided
    v = base[:, 2, :, 8:72]
    qb = rng.standard_normal((9, 8, 80)).astype(F32)
    q = qb[:, :, 16:]
    want_o, want_lse = ar.prefill(f64(q), f64(k), f64(v), causal=True)
    o, lse = kvcache.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    assert_close(o, want_o, 1e-5, "o strided")
    assert_close(lse, want_lse, 1e-5, "lse strided")
    ro = np.ascontiguousarray(k)
    ro.flags.writeable = False
    o2 = kvcache.single_prefill_with_kv_cache(q, ro, v, causal=True)
    assert_close(o2, want_o, 1e-5, "o read-only k")


@needs_prefill
def test_single_prefill_errors(rng):
    E = kvcache.InvalidArgumentError
    q = rng.standard_normal((5, 8, 16)).astype(F32)
    k = rng.standard_normal((7, 2, 16)).astype(F32)
    k8, ks, _ = ar.make_storage(rng, (7, 2, 16), "int8")
    k4, ks4, _ = ar.make_storage(rng, (7, 2, 16), "int4")
    m = np.ones((5, 7), bool)
    for kwargs in ({"k": k[:, :, :8]}, {"q": q[:, :5]}, {"q": q.astype(np.int8)},
                   {"q": q[0]}, {"v": k[:6]}, {"k": np.zeros((7, 3, 16), F32),
                                               "v": np.zeros((7, 3, 16), F32)},
                   {"window_left": -2}, {"sm_scale": float("nan")}, {"sm_scale": 0.0},
                   {"logits_soft_cap": -1.0}, {"kv_layout": "NDH"}, {"k": k8, "v": k8},
                   {"k_scale": ks}, {"k": k8, "v": k8, "k_scale": ks, "v_scale": ks[:, :1]},
                   {"k": k8, "v": k8, "k_scale": ks, "v_scale": ks, "quant_group": 3},
                   {"k": k4, "v": k4, "k_scale": ks4, "v_scale": ks4, "quant_group": 5},
                   {"custom_mask": m[:, :6]}, {"custom_mask": m[:4]},
                   {"custom_mask": m.reshape(-1)[:34]},
                   {"packed_custom_mask": ar.pack_little(m)[:-1]},
                   {"packed_custom_mask": ar.pack_little(m).astype(np.int32)},
                   {"custom_mask": m, "packed_custom_mask": ar.pack_little(m)},
                   {"causal": 2}, {"out_dtype": np.int8}, {"out_dtype": "int4"}):
        args = {"q": q, "k": k, "v": k}
        args.update(kwargs)
        with pytest.raises(E):
            kvcache.single_prefill_with_kv_cache(**args)
    with pytest.raises(kvcache.KvcacheError):  # head_dim above 512
        big = np.zeros((1, 1, 520), F32)
        kvcache.single_prefill_with_kv_cache(big, big, big)


# ---------------------------------------------------------------------------
# Batched prefill: paged and ragged


def lens_for(rng, batch, i):
    """(qo_lens, kv_lens) of a batch: every request kind appears across
    cases, including empty requests (kv 0), requests with no query row and
    qo_len > kv_len; long lengths only in small batches."""
    if batch == 17:
        kv = [int(x) for x in rng.choice([0, 1, 7, 54], size=batch)]
        qo = [int(x) for x in rng.choice([0, 1, 17], size=batch)]
        kv[3], qo[3] = 0, 1  # empty request with a query row
        kv[5], qo[5] = 7, 17  # qo_len > kv_len
        return qo, kv
    if batch == 3:
        kv = [KV_LENS[(i + j) % 5] for j in range(3)]
        kv = [min(n, 512) for n in kv]
        qo = [QO_LENS[(i + 2 * j) % 3] for j in range(3)]
        qo[i % 3] = min(qo[i % 3], kv[i % 3]) if i % 2 else qo[i % 3]
        if i % 4 == 1:
            kv[1], qo[1] = 0, 17
        if i % 4 == 2:
            qo[2] = 0
        return qo, kv
    return [QO_LENS[i % 3]], [KV_LENS[(i * 3) % 5]]


def batch_cases():
    cases = []
    for i in range(12):
        cases.append(dict(
            batch=BATCHES[i % 3], page_size=PAGE_SIZES[(i // 3 + i) % 3],
            storage=ar.STORAGES[i % 5], group=GROUPS[(i // 2) % 3], dh=HEAD_DIMS[(i // 3) % 2],
            layout=LAYOUTS[(i // 2) % 2], combined=bool(i % 2 == 0 or i % 5 == 1),
            q_dtype=ar.Q_DTYPES[(i // 4 + i) % 3], mask=MASKS[i % 6], i=i))
    return cases


BATCH = batch_cases()


def batch_id(c):
    return (f"B{c['batch']}-ps{c['page_size']}-{c['storage']}-g{c['group']}-d{c['dh']}-"
            f"{c['layout']}-{'comb' if c['combined'] else 'pair'}-"
            f"{ar.DT_NAMES[np.dtype(c['q_dtype'])]}-{c['mask']}")


def batch_masks(rng, kind, qo, kv):
    """(plan kwargs, reference kwargs) for a batch: per-request masks
    flattened and concatenated (packed: each request padded to a byte)."""
    if kind in ("none", "causal", "window", "causal_window"):
        kw, rkw = mask_args(rng, kind, 1, max(kv) if kv else 1)
        return kw, rkw
    masks = []
    for a, b in zip(qo, kv):
        m = rng.random((a, b)) < 0.6
        if a > 1:
            m[0] = False
        masks.append(m)
    flat = np.concatenate([m.reshape(-1) for m in masks]) if masks else np.zeros(0, bool)
    if kind == "custom":
        return {"custom_mask": flat}, {"custom_flat": flat}
    packed = np.concatenate([ar.pack_little(m) for m in masks])
    return {"packed_custom_mask": packed}, {"custom_flat": flat}


def check_batch(o, lse, q, want_o, want_lse, qo_indptr, what):
    assert o.shape == q.shape and lse.shape == q.shape[:2] and lse.dtype == F32
    for b in range(len(qo_indptr) - 1):
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        assert_close(o[lo:hi], want_o[lo:hi], out_tol(q.dtype), f"o {what} request {b}")
        assert_close(lse[lo:hi], want_lse[lo:hi], lse_tol(q.dtype), f"lse {what} request {b}")


def run_paged_case(rng, c, num_threads=2):
    hq, h = heads_for(c["group"])
    qo, kv = lens_for(rng, c["batch"], c["i"])
    pg = ar.Paged(rng, kv, c["page_size"], h, c["dh"], c["storage"], c["layout"],
                  c["combined"])
    qo_indptr = ar.indptr_of(qo)
    q = ar.random_q(rng, (int(qo_indptr[-1]), hq, c["dh"]), c["q_dtype"], mag=2.0)
    kw, rkw = batch_masks(rng, c["mask"], qo, kv)
    want_o, want_lse = ar.batch_prefill(f64(q), pg.kv, qo_indptr, **rkw)
    w = kvcache.BatchPrefillWithPagedKVCacheWrapper(kv_layout=c["layout"],
                                                    num_threads=num_threads)
    w.plan(qo_indptr, *pg.table(), hq, h, c["dh"], c["page_size"], **kw)
    o, lse = w.run(q, pg.cache, kv_scale=pg.scale, return_lse=True)
    assert o.dtype == q.dtype
    check_batch(o, lse, q, want_o, want_lse, qo_indptr, batch_id(c))
    return w, pg, q, qo_indptr, kw, o, lse


@needs_prefill
@pytest.mark.parametrize("c", BATCH, ids=[batch_id(c) for c in BATCH])
def test_batch_prefill_paged_grid(isa, rng, c):
    w, pg, q, _qo_indptr, _kw, o, _lse = run_paged_case(rng, c)
    o2 = w.run(q, pg.cache, kv_scale=pg.scale)  # run again, without lse: same bytes
    ref.assert_same_bytes(o2, o, "o of a second run without lse")


@needs_prefill
def test_batch_prefill_random_shapes(isa):
    """Head dims and quant groups off the grid (Dh 8-256: 40, 72, 80, 96, ...;
    groups 4-64, half or not a multiple of a vector), every storage, both
    layouts, masks, 1 and 2 threads: 10 seeded random cases per ISA against
    the float64 reference."""
    rng = np.random.default_rng(20261125)
    for i in range(10):
        dh = int(rng.choice([8, 24, 40, 48, 72, 80, 96, 112, 160, 256]))
        storage = ar.STORAGES[i % len(ar.STORAGES)]
        group = int(rng.choice([g for g in (4, 8, 16, 24, 32, 40, 64) if dh % g == 0]))
        h, g = int(rng.choice([1, 2])), int(rng.choice([1, 3, 4, 8]))
        batch = int(rng.choice([1, 3]))
        kv = [int(rng.choice([0, 1, 7, 54, 200])) for _ in range(batch)]
        qo = [int(rng.choice([0, 1, 17])) for _ in range(batch)]
        layout, ps = LAYOUTS[i % 2], int(rng.choice(PAGE_SIZES))
        q_dtype = (F32, F16)[i % 2]
        pg = ar.Paged(rng, kv, ps, h, dh, storage, layout, bool(i % 3), group=group)
        qo_indptr = ar.indptr_of(qo)
        q = ar.random_q(rng, (int(qo_indptr[-1]), h * g, dh), q_dtype)
        kw, rkw = batch_masks(rng, MASKS[i % len(MASKS)], qo, kv)
        want_o, want_lse = ar.batch_prefill(f64(q), pg.kv, qo_indptr, **rkw)
        w = kvcache.BatchPrefillWithPagedKVCacheWrapper(kv_layout=layout,
                                                        num_threads=1 + i % 2)
        w.plan(qo_indptr, *pg.table(), h * g, h, dh, ps, quant_group=group, **kw)
        o, lse = w.run(q, pg.cache, kv_scale=pg.scale, return_lse=True)
        check_batch(o, lse, q, want_o, want_lse, qo_indptr,
                    f"case {i}: {storage} Dh {dh} group {group} H {h} G {g} {layout}")


@needs_prefill
def test_batch_prefill_long_requests(rng):
    """kv_len 2048 with qo_len 127 and 1 in one batch (page size 16, f16)."""
    hq, h, dh = 8, 1, 128
    qo, kv = [127, 1, 17], [2048, 2048, 512]
    pg = ar.Paged(rng, kv, 16, h, dh, "f16", "NHD", True)
    qo_indptr = ar.indptr_of(qo)
    q = ar.random_q(rng, (int(qo_indptr[-1]), hq, dh), F16)
    w = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD")
    w.plan(qo_indptr, *pg.table(), hq, h, dh, 16, causal=True, q_data_type="float16",
           kv_data_type="float16", o_data_type="float32")
    o, lse = w.run(q, pg.cache, return_lse=True)
    assert o.dtype == F32
    want_o, want_lse = ar.batch_prefill(f64(q), pg.kv, qo_indptr, causal=True)
    check_batch(o, lse, q, want_o, want_lse, qo_indptr, "long")


def run_ragged_case(rng, c, num_threads=2):
    hq, h = heads_for(c["group"])
    qo, kv = lens_for(rng, c["batch"], c["i"])
    qo_indptr, kv_indptr = ar.indptr_of(qo), ar.indptr_of(kv)
    nkv = int(kv_indptr[-1])
    k, ks, kd = ar.make_storage(rng, (nkv, h, c["dh"]), c["storage"])
    v, vs, vd = ar.make_storage(rng, (nkv, h, c["dh"]), c["storage"], scale_dtype=F16)
    kvs = [(kd[kv_indptr[b]:kv_indptr[b + 1]], vd[kv_indptr[b]:kv_indptr[b + 1]])
           for b in range(len(kv))]
    q = ar.random_q(rng, (int(qo_indptr[-1]), hq, c["dh"]), c["q_dtype"], mag=2.0)
    kw, rkw = batch_masks(rng, c["mask"], qo, kv)
    want_o, want_lse = ar.batch_prefill(f64(q), kvs, qo_indptr, **rkw)
    w = kvcache.BatchPrefillWithRaggedKVCacheWrapper(kv_layout=c["layout"],
                                                     num_threads=num_threads)
    w.plan(qo_indptr, kv_indptr, hq, h, c["dh"], **kw)
    lay = c["layout"]
    kv_scale = None if ks is None else (ar.to_layout(ks, lay), ar.to_layout(vs, lay))
    kl, vl = ar.to_layout(k, lay), ar.to_layout(v, lay)
    o, lse = w.run(q, kl, vl, kv_scale=kv_scale, return_lse=True)
    check_batch(o, lse, q, want_o, want_lse, qo_indptr, "ragged " + batch_id(c))
    return w, (q, kl, vl, kv_scale), qo_indptr, kv_indptr, kw, o, lse


@needs_prefill
@pytest.mark.parametrize("c", BATCH[::2], ids=[batch_id(c) for c in BATCH[::2]])
def test_batch_prefill_ragged_grid(isa, rng, c):
    c = dict(c, storage=ar.STORAGES[(c["i"] + 1) % 5], layout=LAYOUTS[(c["i"] // 2 + 1) % 2])
    w, args, _qi, _ki, _kw, o, _lse = run_ragged_case(rng, c)
    o2 = w.run(*args[:3], kv_scale=args[3])
    ref.assert_same_bytes(o2, o, "o of a second run without lse")


@needs_prefill
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_batch_rows_equal_single_requests(rng, kind):
    """Row independence (prefill.h): each request of a batch gives the same
    bytes as single_prefill_with_kv_cache on that request alone; results do
    not depend on the thread count."""
    for c in (dict(batch=3, page_size=5, storage="int8", group=4, dh=64, layout="HND",
                   combined=False, q_dtype=F16, mask="causal", i=0),
              dict(batch=17, page_size=16, storage="bf16", group=1, dh=128, layout="NHD",
                   combined=True, q_dtype=F32, mask="custom", i=1),
              dict(batch=3, page_size=1, storage="int4", group=8, dh=64, layout="NHD",
                   combined=True, q_dtype=BF16, mask="causal_window", i=2)):
        if kind == "paged":
            _w, pg, q, qo_indptr, kw, o, lse = run_paged_case(rng, c, num_threads=2)
            per_req = [pg.stored_request(b) for b in range(len(pg.lens))]
            w1 = kvcache.BatchPrefillWithPagedKVCacheWrapper(kv_layout=c["layout"],
                                                             num_threads=1)
            w1.plan(qo_indptr, *pg.table(), q.shape[1], pg.heads, c["dh"], c["page_size"],
                    **kw)
            o1, lse1 = w1.run(q, pg.cache, kv_scale=pg.scale, return_lse=True)
        else:
            _w, args, qo_indptr, kv_indptr, kw, o, lse = run_ragged_case(rng, c, num_threads=2)
            q, kl, vl, kv_scale = args
            lay = c["layout"]

            def back(a, lay=lay):
                if a is None or lay == "NHD":
                    return a
                return np.ascontiguousarray(a.transpose(1, 0, 2))

            k, v = back(kl), back(vl)
            ks, vs = (None, None) if kv_scale is None else (back(kv_scale[0]),
                                                            back(kv_scale[1]))
            per_req = []
            for b in range(len(qo_indptr) - 1):
                sl = slice(int(kv_indptr[b]), int(kv_indptr[b + 1]))
                per_req.append((k[sl], v[sl], None if ks is None else ks[sl],
                                None if vs is None else vs[sl]))
            w1 = kvcache.BatchPrefillWithRaggedKVCacheWrapper(kv_layout=lay, num_threads=1)
            w1.plan(qo_indptr, kv_indptr, q.shape[1], per_req[0][0].shape[1], c["dh"], **kw)
            o1, lse1 = w1.run(q, kl, vl, kv_scale=kv_scale, return_lse=True)
        ref.assert_same_bytes(o1, o, f"{kind} o, 1 vs 2 threads")
        ref.assert_same_bytes(lse1, lse, f"{kind} lse, 1 vs 2 threads")
        off = 0
        for b, (k, v, ks, vs) in enumerate(per_req):
            lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
            skw = dict(kw)
            if "custom_mask" in skw:
                n = (hi - lo) * k.shape[0]
                skw["custom_mask"] = kw["custom_mask"][off:off + n].reshape(hi - lo, k.shape[0])
                off += n
            os_, ls_ = kvcache.single_prefill_with_kv_cache(
                q[lo:hi], k, v, k_scale=ks, v_scale=vs, return_lse=True, num_threads=1, **skw)
            ref.assert_same_bytes(os_, o[lo:hi], f"{kind} request {b} vs single prefill")
            ref.assert_same_bytes(ls_, lse[lo:hi], f"{kind} lse request {b} vs single prefill")


@needs_prefill
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_packed_mask_equals_boolean_and_views(rng, layout):
    """Batched masks: the flat boolean mask, the packed form built with
    numpy, and the one kvcache.build_packed_custom_mask builds give the same
    bytes; K/V views of a combined cache give the same bytes as the combined
    cache; quant groups other than 8."""
    hq, h, dh, ps = 8, 2, 64, 5
    qo, kv = [17, 0, 3, 1], [54, 7, 0, 9]
    qo_indptr = ar.indptr_of(qo)
    masks = [rng.random((a, b)) < 0.5 for a, b in zip(qo, kv)]
    flat = np.concatenate([m.reshape(-1) for m in masks])
    packed_np = np.concatenate([ar.pack_little(m) for m in masks])
    packed_kvc, mask_indptr = kvcache.build_packed_custom_mask(masks)
    np.testing.assert_array_equal(packed_kvc, packed_np)
    assert mask_indptr[-1] == packed_np.size
    for storage, group in (("int8", 32), ("int4", 2), ("int4", 16), ("f16", 8)):
        pg = ar.Paged(rng, kv, ps, h, dh, storage, layout, True, group=group)
        q = ar.random_q(rng, (int(qo_indptr[-1]), hq, dh), F32)
        want_o, want_lse = ar.batch_prefill(f64(q), pg.kv, qo_indptr, custom_flat=flat)
        outs = []
        for kw in ({"custom_mask": flat}, {"packed_custom_mask": packed_np},
                   {"packed_custom_mask": packed_kvc}):
            w = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, layout)
            w.plan(qo_indptr, *pg.table(), hq, h, dh, ps, quant_group=group, **kw)
            outs.append(w.run(q, pg.cache, kv_scale=pg.scale, return_lse=True))
        check_batch(*outs[0], q, want_o, want_lse, qo_indptr, f"{storage} group {group}")
        for o, lse in outs[1:]:
            ref.assert_same_bytes(o, outs[0][0], "o packed vs boolean batch mask")
            ref.assert_same_bytes(lse, outs[0][1], "lse packed vs boolean batch mask")
        sc = None if pg.scale is None else (pg.scale[:, 0], pg.scale[:, 1])
        ov, lv = w.run(q, (pg.cache[:, 0], pg.cache[:, 1]), kv_scale=sc, return_lse=True)
        ref.assert_same_bytes(ov, outs[0][0], "o of K/V views vs combined cache")
        ref.assert_same_bytes(lv, outs[0][1], "lse of K/V views vs combined cache")


@needs_prefill
def test_ragged_strided_kv_views(rng):
    """Ragged K and V as strided views of one (nnz_kv, 2, H, Dh) array (and
    HND views of an (H, 2, nnz_kv, Dh) one) give the same bytes as contiguous
    copies."""
    hq, h, dh = 8, 2, 64
    qo, kv = [5, 17, 1], [9, 30, 0]
    qo_indptr, kv_indptr = ar.indptr_of(qo), ar.indptr_of(kv)
    q = ar.random_q(rng, (int(qo_indptr[-1]), hq, dh), F16)
    for layout, shape, split in (("NHD", (39, 2, h, dh), lambda a, i: a[:, i]),
                                 ("HND", (h, 2, 39, dh), lambda a, i: a[:, i])):
        kvbuf = rng.standard_normal(shape).astype(BF16)
        k, v = split(kvbuf, 0), split(kvbuf, 1)
        w = kvcache.BatchPrefillWithRaggedKVCacheWrapper(kv_layout=layout)
        w.plan(qo_indptr, kv_indptr, hq, h, dh, causal=True, kv_data_type="bfloat16")
        o, lse = w.run(q, k, v, return_lse=True)
        o2, lse2 = w.run(q, np.ascontiguousarray(k), np.ascontiguousarray(v), return_lse=True)
        ref.assert_same_bytes(o, o2, f"{layout} o of views vs copies")
        ref.assert_same_bytes(lse, lse2, f"{layout} lse of views vs copies")
        kn = k if layout == "NHD" else k.transpose(1, 0, 2)
        vn = v if layout == "NHD" else v.transpose(1, 0, 2)
        kvs = [(f64(kn[kv_indptr[b]:kv_indptr[b + 1]]), f64(vn[kv_indptr[b]:kv_indptr[b + 1]]))
               for b in range(3)]
        want_o, want_lse = ar.batch_prefill(f64(q), kvs, qo_indptr, causal=True)
        check_batch(o, lse, q, want_o, want_lse, qo_indptr, f"{layout} views")


@needs_prefill
def test_batch_extreme_negative_scores(rng):
    """FlashInfer's test_ragged_prefill_one_valid_key: one visible key with
    score -524288 per row, the others masked with score +6400."""
    dh, hq, h = 64, 2, 1
    qo, kv = [3, 2], [5, 4]
    qo_indptr, kv_indptr = ar.indptr_of(qo), ar.indptr_of(kv)
    q = np.ones((5, hq, dh), F32)
    k = np.full((9, h, dh), 100.0, F32)
    v = rng.standard_normal((9, h, dh)).astype(F32)
    masks, want = [], []
    for b in range(2):
        m = np.zeros((qo[b], kv[b]), bool)
        for i in range(qo[b]):
            j = (i + b) % kv[b]
            m[i, j] = True
            k[kv_indptr[b] + j] = -8192.0
            want.append(v[kv_indptr[b] + j, 0])
        masks.append(m)
    # keys visible to some row are -8192 everywhere; masked ones stay +100
    packed = np.concatenate([ar.pack_little(m) for m in masks])
    w = kvcache.BatchPrefillWithRaggedKVCacheWrapper()
    w.plan(qo_indptr, kv_indptr, hq, h, dh, packed_custom_mask=packed, sm_scale=1.0)
    o, lse = w.run(q, k, v, return_lse=True)
    for r in range(5):
        for hh in range(hq):
            np.testing.assert_allclose(o[r, hh], want[r], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lse, np.full((5, hq), -524288.0 / ar.LN2), rtol=1e-6)


@needs_prefill
def test_batch_plan_reuse_and_qo_only_requests(rng):
    """One plan, several layers (caches); requests with 0 query rows and
    empty requests; a read-only cache."""
    hq, h, dh, ps = 4, 2, 64, 5
    qo, kv = [0, 3, 0, 1, 4], [9, 0, 0, 12, 4]
    qo_indptr = ar.indptr_of(qo)
    w = kvcache.BatchPrefillWithPagedKVCacheWrapper(kv_layout="HND", num_threads=2)
    pg0 = ar.Paged(rng, kv, ps, h, dh, "f32", "HND", True)
    w.plan(qo_indptr, *pg0.table(), hq, h, dh, ps, causal=True)
    for layer in range(3):
        st = ("f32", "bf16", "int8")[layer]
        pg = ar.Paged(rng, kv, ps, h, dh, st, "HND", True, like=pg0)  # same page table
        q = ar.random_q(rng, (8, hq, dh), F32)
        cache = pg.cache.copy()
        cache.flags.writeable = False
        scale = None if pg.scale is None else pg.scale.copy()
        o, lse = w.run(q, cache, kv_scale=scale, return_lse=True)
        want_o, want_lse = ar.batch_prefill(f64(q), pg.kv, qo_indptr, causal=True)
        check_batch(o, lse, q, want_o, want_lse, qo_indptr, f"layer {layer}")
        assert np.all(o[0:3] == 0) and np.all(np.isneginf(lse[0:3]))  # request 1: no keys


@needs_prefill
def test_batch_prefill_errors(rng):
    E = kvcache.InvalidArgumentError
    hq, h, dh, ps = 4, 2, 32, 16
    qo, kv = [3, 2], [20, 3]
    qo_indptr = ar.indptr_of(qo)
    pg = ar.Paged(rng, kv, ps, h, dh, "int8", "NHD", True)
    q = ar.random_q(rng, (5, hq, dh), F32)
    w = kvcache.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD")
    with pytest.raises(E, match="plan"):
        w.run(q, pg.cache, kv_scale=pg.scale)
    # FlashInfer's positional arguments (buffers, backend, jit_args, jit_kwargs)
    # are taken and ignored; num_threads after them is keyword-only
    fi_args = (None, "NHD", False) + (None,) * 6 + ("fa3", None, None)
    kvcache.BatchPrefillWithPagedKVCacheWrapper(*fi_args)
    kvcache.BatchPrefillWithRaggedKVCacheWrapper(*fi_args[:5], *fi_args[7:])
    with pytest.raises(TypeError):
        kvcache.BatchPrefillWithPagedKVCacheWrapper(*fi_args, 2)
    with pytest.raises(TypeError):
        kvcache.BatchPrefillWithRaggedKVCacheWrapper(*fi_args[:5], *fi_args[7:], 2)
    with pytest.raises(kvcache.UnsupportedError, match="jit_kwargs"):
        kvcache.BatchPrefillWithRaggedKVCacheWrapper(kv_layout="NHD", jit_kwargs={"a": 1})
    with pytest.raises(E):
        kvcache.BatchPrefillWithPagedKVCacheWrapper(kv_layout="XYZ")
    indptr, indices, last = pg.table()
    good_mask = np.ones(sum(a * b for a, b in zip(qo, kv)), bool)
    for args, kw in (
            ((qo_indptr[::-1].copy(), indptr, indices, last), {}),
            ((qo_indptr[:2], indptr, indices, last), {}),  # B mismatch
            ((qo_indptr - 1, indptr, indices, last), {}),
            ((qo_indptr, indptr[::-1].copy(), indices, last), {}),
            ((qo_indptr, indptr, indices, last + 16), {}),
            ((qo_indptr, indptr, indices[:1], last), {}),
            ((qo_indptr, indptr, indices, last), {"custom_mask": good_mask[:-1]}),
            ((qo_indptr, indptr, indices, last), {"packed_custom_mask": np.zeros(1, np.uint8)}),
            ((qo_indptr, indptr, indices, last), {"custom_mask": good_mask,
                                                  "packed_custom_mask": np.zeros(9, np.uint8)}),
            ((qo_indptr, indptr, indices, last), {"window_left": -3}),
            ((qo_indptr, indptr, indices, last), {"kv_data_type": "int3"})):
        with pytest.raises(E):
            w.plan(*args, hq, h, dh, ps, **kw)
    with pytest.raises(E):
        w.plan(qo_indptr, indptr, indices, last, 5, h, dh, ps)  # Hq % H
    with pytest.raises(kvcache.UnsupportedError):
        w.plan(qo_indptr, indptr, indices, last, hq, h, dh, ps, head_dim_vo=16)
    with pytest.raises(kvcache.UnsupportedError):
        w.plan(qo_indptr, indptr, indices, last, hq, h, dh, ps, pos_encoding_mode="ROPE_LLAMA")
    w.plan(qo_indptr, indptr, indices, last, hq, h, dh, ps, causal=True, kv_data_type="int8",
           q_data_type="float32")
    cache0, scale0 = pg.cache.copy(), pg.scale.copy()
    o = w.run(q, pg.cache, kv_scale=pg.scale)
    for args, scale in (((q, pg.cache), None), ((q[:4], pg.cache), pg.scale),
                        ((q[:, :, :16], pg.cache), pg.scale), ((q[:, :2], pg.cache), pg.scale),
                        ((q.astype(F16), pg.cache), pg.scale), ((q, pg.cache.astype(F32)), None),
                        ((q, pg.cache[:2]), pg.scale[:2]),
                        ((q, (pg.cache[:, 0], pg.cache[:, 1])), pg.scale)):
        with pytest.raises(E):
            w.run(*args, kv_scale=scale)
    ref.assert_same_bytes(w.run(q, pg.cache, kv_scale=pg.scale), o, "o after errors")
    ref.assert_same_bytes(pg.cache, cache0, "cache (only read)")
    ref.assert_same_bytes(pg.scale, scale0, "scale (only read)")
    # ragged
    wr = kvcache.BatchPrefillWithRaggedKVCacheWrapper()
    kv_indptr = ar.indptr_of(kv)
    with pytest.raises(E, match="plan"):
        wr.run(q, np.zeros((23, h, dh), F32), np.zeros((23, h, dh), F32))
    for args in ((qo_indptr, kv_indptr[:2]), (qo_indptr, kv_indptr[::-1].copy())):
        with pytest.raises(E):
            wr.plan(*args, hq, h, dh)
    wr.plan(qo_indptr, kv_indptr, hq, h, dh, causal=True)
    kk = np.zeros((23, h, dh), F32)
    wr.run(q, kk, kk)
    k8, ks, _ = ar.make_storage(rng, (23, h, dh), "int8")
    for args, kw in (((q, kk[:22], kk[:22]), {}), ((q, kk, kk[:, :1]), {}),
                     ((q[:4], kk, kk), {}), ((q, k8, k8), {}), ((q, k8, k8), {"kv_scale": ks}),
                     ((q, kk, kk), {"kv_scale": (ks, ks)})):
        with pytest.raises(E):
            wr.run(*args, **kw)


def test_grids_cover_every_axis_value():
    """Every value of every axis of the module docstring appears."""
    seen = {k: set() for k in ("kv", "qo", "group", "dh", "layout", "storage", "q", "mask")}
    for c in SINGLE:
        seen["kv"].add(c["kv_len"])
        seen["qo"].add(c["qo_len"])
        for k, n in (("group", "group"), ("dh", "dh"), ("layout", "layout"),
                     ("storage", "storage"), ("mask", "mask")):
            seen[k].add(c[n])
        seen["q"].add(np.dtype(c["q_dtype"]))
    assert seen["kv"] == set(KV_LENS) and seen["qo"] == set(QO_LENS)
    assert seen["group"] == set(GROUPS) and seen["dh"] == set(HEAD_DIMS)
    assert seen["layout"] == set(LAYOUTS) and seen["storage"] == set(ar.STORAGES)
    assert seen["q"] == set(ar.Q_DTYPES) and seen["mask"] == set(MASKS)
    for key, axis in (("batch", BATCHES), ("page_size", PAGE_SIZES), ("storage", ar.STORAGES),
                      ("group", GROUPS), ("dh", HEAD_DIMS), ("layout", LAYOUTS),
                      ("combined", (True, False)), ("mask", MASKS)):
        assert {c[key] for c in BATCH} == set(axis), key
    assert {np.dtype(c["q_dtype"]) for c in BATCH} == set(ar.Q_DTYPES)
    rng = np.random.default_rng(0)
    kv_seen, qo_seen = set(), set()
    for c in BATCH:
        qo, kv = lens_for(rng, c["batch"], c["i"])
        kv_seen |= set(kv)
        qo_seen |= set(qo)
    assert set(KV_LENS) <= kv_seen and set(QO_LENS) <= qo_seen
