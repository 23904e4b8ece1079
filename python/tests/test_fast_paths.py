"""The binding's per-call fast paths (python/kvcache/_lib.py, paged.py,
cache.py) give what the general paths give and keep every check:

- the data pointer read from the ndarray object equals ``arr.ctypes.data``;
- the layout table (dtype/shape/strides -> kvc_tensor template) builds the
  same tensors as the general path, never leaks a data pointer from one
  array to another, and still reads per call what an array can change on
  itself (alignment and writeability flags, in-place shape/dtype/strides
  changes, resize);
- input arrays are still copied (non-contiguous last dimension, negative
  strides, misaligned data) or refused (dtype) after the same layout was
  seen in a valid array; in-place arrays still refused (read-only,
  misaligned, broadcast views);
- the combined paged cache remembered for a layout and pointer follows the
  arrays a caller passes (another cache, new contents, flags turned off);
- out= buffers of every kind, and q/cache changing between calls;
- page tables larger than the first call's capacity, and the index fast
  path of int32_array;
- threads sharing the tables.

No timing here (python3 -m kvcache.bench_overhead measures the overhead).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import kvcache
from kvcache import _lib, paged
from kvcache.errors import InvalidArgumentError

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)


def _misaligned(shape, dtype):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    a = np.zeros(n + 1, np.uint8)[1:].view(dtype).reshape(shape)
    assert not a.flags.aligned
    return a


def _reference_tensor(arr, int4=False):
    """kvc_tensor built field by field from numpy's own description (the
    general path's rules: strides in elements, size-1 dims normalised)."""
    strides = _lib._element_strides(arr)
    assert strides is not None
    t = _lib.Tensor()
    t.data = arr.ctypes.data
    code = _lib.dtype_code(arr.dtype)
    t.dtype = _lib.KVC_I4 if int4 else code
    t.ndim = arr.ndim
    for d in range(arr.ndim):
        last = d == arr.ndim - 1
        t.shape[d] = arr.shape[d] * 2 if int4 and last else arr.shape[d]
        t.stride[d] = (1 if last else strides[d] * 2) if int4 else strides[d]
    return t


def _arrays():
    base = np.arange(2 * 3 * 4 * 8, dtype=np.float32).reshape(2, 3, 4, 8)
    ro = np.ones((3, 5), np.float16)
    ro.flags.writeable = False
    return [
        base, base[1:], base[:, ::2], base[:, :, 1:3, :5], base[..., 0:1],
        np.zeros((), np.float32), np.zeros((0, 4), np.float16), np.zeros((4, 0), np.int32),
        np.zeros((1, 1, 1), np.int8), ro, np.zeros((5, 1, 6), np.int64)[:, :, 1:],
        np.zeros((3, 4), np.float32, order="F")[:, :1], np.zeros((2, 2, 2, 2, 2, 2, 2, 2), np.uint8),
    ]


def test_data_pointer_matches_numpy():
    class Sub(np.ndarray):
        pass

    arrays = _arrays() + [np.frombuffer(b"0123456789", np.uint8)[3:], np.arange(9.0).view(Sub)[2:],
                          _misaligned((4,), np.float32), np.zeros(10)[::-2]]
    for a in arrays:
        assert _lib.data_ptr(a) == a.ctypes.data
    # CPython with numpy's usual object layout takes the fast read
    if _lib.sys.implementation.name == "cpython":
        assert _lib.data_ptr is _lib._data_ptr_field


@pytest.mark.parametrize("int4", [False, True])
def test_tensors_match_the_general_path_first_and_later(int4):
    for a in _arrays():
        if int4:
            a = np.ascontiguousarray(a).view(np.uint8) if a.ndim else a.astype(np.uint8)
            if a.ndim == 0:
                continue
        want = bytes(_reference_tensor(a, int4))
        for _ in range(2):  # a miss that fills the table, then a hit
            assert bytes(_lib.make_tensor(a, int4=int4)) == want


def test_table_never_carries_a_data_pointer_across_arrays():
    a, b = np.zeros((3, 8), np.float16), np.ones((3, 8), np.float16)
    ta, tb = _lib.make_tensor(a), _lib.make_tensor(b)
    assert ta.data == a.ctypes.data and tb.data == b.ctypes.data and ta.data != tb.data
    assert bytes(ta)[8:] == bytes(tb)[8:]  # everything but the pointer is shared


def test_in_place_metadata_changes_are_seen():
    a = np.zeros((4, 6), np.float32)
    _lib.make_tensor(a)
    a.shape = (6, 4)  # shape set in place on the same object
    t = _lib.make_tensor(a)
    assert list(t.shape[:2]) == [6, 4] and list(t.stride[:2]) == [4, 1]
    a.dtype = np.int32  # dtype set in place
    assert _lib.make_tensor(a).dtype == _lib.KVC_I32
    r = np.zeros(16, np.float32)
    old = _lib.make_tensor(r).data
    r.resize(1 << 16, refcheck=False)  # the data moves
    r.resize(16, refcheck=False)
    assert _lib.make_tensor(r).data == r.ctypes.data  # whether or not it moved back
    del old


def test_input_copies_and_refusals_survive_a_seen_layout():
    good = np.zeros((3, 16), np.float32)
    assert _lib.input_array(good, "x") is good
    assert _lib.input_tensor(good, "x")[0] is good
    # same dtype/shape/strides, data 1 byte off: copied, every time
    m = _misaligned((3, 16), np.float32)
    m[:] = np.arange(48, dtype=np.float32).reshape(3, 16)
    for _ in range(2):
        a, t = _lib.input_tensor(m, "x")
        assert a is not m and a.flags.aligned and (a == m).all() and t.data == a.ctypes.data
        assert _lib.input_array(m, "x") is not m
    # aligned data the caller marked unaligned: copied as before
    marked = np.zeros((3, 16), np.float32)
    marked.flags.aligned = False
    assert _lib.input_array(marked, "x") is not marked
    # a dtype outside `allowed` is refused even though the layout is known
    with pytest.raises(InvalidArgumentError, match="dtype"):
        _lib.input_tensor(good, "x", (_lib.KVC_F16,))
    # non-contiguous last dimension and negative strides: copied
    wide = np.zeros((3, 32), np.float32)
    for v in (wide[:, ::2], good[::-1]):
        a = _lib.input_array(v, "x")
        assert a is not v and a.flags.c_contiguous and (a == v).all()
    # subclasses take the general path (np.asarray gives a base-class array)
    class Sub(np.ndarray):
        pass

    s = good.view(Sub)
    a = _lib.input_array(s, "x")
    assert type(a) is np.ndarray and _lib.data_ptr(a) == s.ctypes.data


def test_in_place_refusals_survive_a_seen_layout():
    c = np.zeros((4, 8), np.float32)
    assert _lib.inplace_array(c, "cache") is c  # fills the table
    ro = np.zeros((4, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="writeable"):
        _lib.inplace_tensor(ro, "cache")
    assert _lib.inplace_tensor(ro, "cache", writable=False)[0] is ro  # readers take it
    with pytest.raises(InvalidArgumentError, match="aligned"):
        _lib.inplace_tensor(_misaligned((4, 8), np.float32), "cache", writable=False)
    marked = np.zeros((4, 8), np.float32)
    marked.flags.aligned = False
    with pytest.raises(InvalidArgumentError, match="aligned"):
        _lib.inplace_array(marked, "cache")
    # a broadcast view made writeable: the same layout is fine to read, refused to write
    row = np.zeros(8, np.float32)
    bc = np.lib.stride_tricks.as_strided(row, (4, 8), (0, 4), writeable=True)
    assert _lib.inplace_array(bc, "cache", writable=False) is bc
    with pytest.raises(InvalidArgumentError, match="zero stride"):
        _lib.inplace_array(bc, "cache")
    with pytest.raises(InvalidArgumentError, match="zero stride"):
        _lib.inplace_tensor(bc, "cache")
    with pytest.raises(InvalidArgumentError, match="numpy"):
        _lib.inplace_tensor([[0.0] * 8] * 4, "cache")


def test_table_bound(monkeypatch):
    monkeypatch.setattr(_lib, "_LAYOUTS_MAX", 4)
    _lib._LAYOUTS.clear()
    arrays = [np.zeros((n, 3), np.float32) for n in range(2, 12)]
    for _ in range(2):
        for a in arrays:
            assert bytes(_lib.make_tensor(a)) == bytes(_reference_tensor(a))
            assert len(_lib._LAYOUTS) <= 4


def test_int32_index_fast_path():
    a = np.arange(6, dtype=np.int32)
    assert _lib.int32_array(a, "x") is a
    v = np.arange(12, dtype=np.int32)[::2]
    c = _lib.int32_array(v, "x")
    assert c is not v and c.flags.c_contiguous and (c == v).all()
    assert _lib.int32_array(np.arange(4, dtype=np.int64), "x").dtype == np.int32
    with pytest.raises(InvalidArgumentError, match="int32"):
        _lib.int32_array(np.array([2**31], np.int64), "x")
    b = np.arange(4, dtype=np.int64)
    assert _lib.int64_array(b, "x") is b
    # int32_tensor: the array int32_array gives and its tensor, fast path or not
    for x in (a, v, b, [1, 2, 3], np.arange(3, dtype=np.int32).view(type("Sub", (np.ndarray,), {})),
              np.zeros((2, 3), np.int32)[:, :2], np.zeros((2, 0), np.int32)):
        for _ in range(2):
            arr, t = _lib.int32_tensor(x, "x")
            want = _lib.int32_array(x, "x")
            assert arr.dtype == np.int32 and arr.flags.c_contiguous and (arr == want).all()
            assert bytes(t) == bytes(_reference_tensor(arr))
    assert _lib.int32_tensor(a, "x")[0] is a
    with pytest.raises(InvalidArgumentError, match="integers"):
        _lib.int32_tensor(np.zeros(3, np.float32), "x")
    with pytest.raises(InvalidArgumentError, match="dimensions"):
        _lib.int32_array(np.zeros((1,) * 9, np.int32), "x")


# ---------------------------------------------------------------------------
# Wrappers and appends across calls


def _decode_setup(rng, pages=6, ps=4, h=2, d=16, hq=4):
    cache = rng.standard_normal((pages, 2, ps, h, d)).astype(np.float32)
    indptr = np.array([0, 2, 6], np.int32)
    indices = np.array([5, 0, 1, 2, 3, 4], np.int32)
    last = np.array([3, 4], np.int32)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(num_threads=1)
    w.plan(indptr, indices, last, hq, h, d, ps)
    q = rng.standard_normal((2, hq, d)).astype(np.float32)
    return w, cache, q, (indptr, indices, last)


def _fresh_run(cache, q, table, **kw):
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(num_threads=1)
    w.plan(*table, q.shape[1], cache.shape[3], cache.shape[4], cache.shape[2])
    return w.run(q, cache, **kw)


def test_decode_follows_the_arrays_passed_each_call(rng):
    w, cache, q, table = _decode_setup(rng)
    first = w.run(q, cache)
    other = rng.standard_normal(cache.shape).astype(np.float32)  # same layout, other memory
    np.testing.assert_array_equal(w.run(q, other), _fresh_run(other, q, table))
    cache[:] = other  # same memory, new contents
    np.testing.assert_array_equal(w.run(q, cache), w.run(q, other))
    q2 = rng.standard_normal(q.shape).astype(np.float32)
    np.testing.assert_array_equal(w.run(q2, cache), _fresh_run(cache, q2, table))
    assert not np.array_equal(first, w.run(q, cache))
    # a read-only cache reads fine; a misaligned copy of the layout is refused each time
    cache.flags.writeable = False
    np.testing.assert_array_equal(w.run(q, cache), w.run(q, other))
    bad = _misaligned(cache.shape, np.float32)
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="aligned"):
            w.run(q, bad)
    marked = cache.copy()
    marked.flags.aligned = False
    with pytest.raises(InvalidArgumentError, match="aligned"):
        w.run(q, marked)
    # q of the wrong dtype or rank after good calls: still refused
    with pytest.raises(InvalidArgumentError, match="dtype"):
        w.run(q.astype(np.float64), cache)
    with pytest.raises(InvalidArgumentError):
        w.run(q[0], cache)


def test_decode_out_and_lse_buffers(rng):
    w, cache, q, _table = _decode_setup(rng)
    ref_o, ref_lse = w.run(q, cache, return_lse=True)
    out, lse = np.empty_like(ref_o), np.empty_like(ref_lse)
    for _ in range(2):
        o, s = w.run(q, cache, return_lse=True, out=out, lse=lse)
        assert o is out and s is lse
        np.testing.assert_array_equal(out, ref_o)
        np.testing.assert_array_equal(lse, ref_lse)
    # strided out/lse (last dimension not contiguous): written through a copy
    big = np.zeros(ref_o.shape[:2] + (ref_o.shape[2] * 2,), np.float32)
    big_lse = np.zeros((ref_lse.shape[0], ref_lse.shape[1] * 2), np.float32)
    o, s = w.run(q, cache, return_lse=True, out=big[..., ::2], lse=big_lse[:, ::2])
    np.testing.assert_array_equal(big[..., ::2], ref_o)
    np.testing.assert_array_equal(big_lse[:, ::2], ref_lse)
    assert (big[..., 1::2] == 0).all() and (big_lse[:, 1::2] == 0).all()
    # lse= without return_lse fills it and returns o alone
    lse2 = np.empty_like(ref_lse)
    o = w.run(q, cache, lse=lse2)
    np.testing.assert_array_equal(o, ref_o)
    np.testing.assert_array_equal(lse2, ref_lse)
    # wrong out buffers: refused before anything is written
    ro = np.empty_like(ref_o)
    ro.flags.writeable = False
    for bad in (np.empty(ref_o.shape, np.float16), np.empty(ref_o.shape[1:], np.float32), ro,
                list(ref_o)):
        with pytest.raises(InvalidArgumentError):
            w.run(q, cache, out=bad)
    with pytest.raises(InvalidArgumentError, match="return_lse"):
        w.run(q, cache, return_lse=2)


def test_int8_decode_scales_change_between_calls(rng):
    pages, ps, h, d, hq, g = 4, 4, 2, 16, 4, 8
    kv = rng.standard_normal((pages, 2, ps, h, d)).astype(np.float32)
    cache = np.zeros(kv.shape, np.int8)
    scale = np.zeros(kv.shape[:-1] + (d // g,), np.float32)
    indptr, indices, last = np.array([0, 4], np.int32), np.arange(4, dtype=np.int32), \
        np.array([4], np.int32)
    bi = np.zeros(16, np.int32)
    pos = np.arange(16, dtype=np.int32)
    rows = kv.transpose(1, 0, 2, 3, 4).reshape(2, 16, h, d)
    kvcache.append_paged_kv_cache(rows[0], rows[1], bi, pos, cache, indices, indptr, last,
                                  kv_scale=scale, quant_group=g, num_threads=1)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(num_threads=1)
    w.plan(indptr, indices, last, hq, h, d, ps, kv_data_type="int8", quant_group=g)
    q = rng.standard_normal((1, hq, d)).astype(np.float32)
    o1 = w.run(q, cache, kv_scale=scale)
    # other scale array, same layout: V doubles, scores change
    o2 = w.run(q, cache, kv_scale=scale * 2)
    assert not np.array_equal(o1, o2)
    np.testing.assert_array_equal(w.run(q, cache, kv_scale=scale), o1)
    with pytest.raises(InvalidArgumentError, match="kv_scale"):
        w.run(q, cache)  # the scale is still required after calls that had one
    with pytest.raises(InvalidArgumentError):
        w.run(q, cache, kv_scale=(scale, scale))


def test_append_follows_the_arrays_and_flags(rng):
    ps, h, d = 4, 2, 8
    cache = np.zeros((3, 2, ps, h, d), np.float32)
    indptr, indices, last = np.array([0, 1], np.int32), np.array([2], np.int32), \
        np.array([1], np.int32)
    bi, pos = np.zeros(1, np.int32), np.zeros(1, np.int32)
    k = rng.standard_normal((1, h, d)).astype(np.float32)
    v = rng.standard_normal((1, h, d)).astype(np.float32)
    kvcache.append_paged_kv_cache(k, v, bi, pos, cache, indices, indptr, last, num_threads=1)
    np.testing.assert_array_equal(cache[2, 0, 0], k[0])
    other = np.zeros_like(cache)
    kvcache.append_paged_kv_cache(v, k, bi, pos, other, indices, indptr, last, num_threads=1)
    np.testing.assert_array_equal(other[2, 0, 0], v[0])
    np.testing.assert_array_equal(cache[2, 0, 0], k[0])  # the first cache is left alone
    cache.flags.writeable = False  # same cache object, now read-only
    with pytest.raises(InvalidArgumentError, match="writeable"):
        kvcache.append_paged_kv_cache(k, v, bi, pos, cache, indices, indptr, last)
    cache.flags.writeable = True
    # a non-contiguous key (strided rows) is copied; a strided view cache is used in place
    k2 = np.repeat(k, 2, axis=-1)[..., ::2]
    kvcache.append_paged_kv_cache(k2, v, bi, pos, cache, indices, indptr, last, num_threads=1)
    np.testing.assert_array_equal(cache[2, 0, 0], k[0])


def test_layout_names_as_before():
    for name in ("NHD", "nhd", " HND ", "hnd"):
        assert paged._layout_code(name) in (_lib.KVC_NHD, _lib.KVC_HND)
    for bad in ("NDH", None, 0, b"NHD"):
        with pytest.raises(InvalidArgumentError):
            paged._layout_code(bad)


def test_combined_cache_table_is_keyed_by_everything(rng):
    paged._COMBINED.clear()
    cache = np.zeros((2, 2, 4, 2, 8), np.float32)
    pc1, _ = paged._paged_cache(cache, None, _lib.KVC_NHD, 8, True, writable=False)
    pc2, _ = paged._paged_cache(cache, None, _lib.KVC_HND, 8, True, writable=False)
    assert pc1.layout == _lib.KVC_NHD and pc2.layout == _lib.KVC_HND
    w1, _ = paged._paged_cache(cache, None, _lib.KVC_NHD, 8, True, writable=True)
    w2, _ = paged._paged_cache(cache, None, _lib.KVC_NHD, 8, True, writable=True)
    assert w1 is not w2 and bytes(w1) == bytes(w2) == bytes(pc1)  # writers get copies
    other = np.zeros_like(cache)
    pc3, keep = paged._paged_cache(other, None, _lib.KVC_NHD, 8, True, writable=False)
    assert pc3.k.data == other.ctypes.data and keep[0] is other
    with pytest.raises(InvalidArgumentError):  # 4-D is not a combined cache, seen or not
        paged._paged_cache(cache[0], None, _lib.KVC_NHD, 8, True, writable=False)


def test_page_table_grows_past_its_first_capacity():
    pc = kvcache.PagedKVCache(1, 1, 8, 1, num_pages=512, enable_prefix_caching=False)
    small, _ = pc.add_sequence(3)
    big, _ = pc.add_sequence(200)  # 200 pages: more than the first call has room for
    for _ in range(2):  # the second time the capacity has grown: one call
        indptr, indices, last = pc.page_table([small, big, small])
        assert indptr.tolist() == [0, 3, 203, 206] and last.tolist() == [1, 1, 1]
        assert len(indices) == 206 and len(set(indices[3:203].tolist())) == 200
        np.testing.assert_array_equal(indices[:3], indices[203:])
    assert pc.cachestarts([small, big]).shape == (2, 200)
    assert [len(x) for x in pc.page_table([])] == [1, 0, 0]
    empty, _ = pc.add_sequence(None)
    ip, ind, la = pc.page_table([empty, small])
    assert ip.tolist() == [0, 0, 3] and la.tolist() == [0, 1] and len(ind) == 3
    assert pc.cachestarts([empty]).tolist() == [[-1]]
    with pytest.raises(kvcache.NotFoundError):
        pc.page_table([small, 12345])
    pc.check()


# ---------------------------------------------------------------------------
# Threads sharing the layout tables


def test_threads_share_the_tables(rng):
    setups = [_decode_setup(np.random.default_rng(i)) for i in range(3)]
    refs = [w.run(q, cache) for w, cache, q, _ in setups]
    wrong, errors = [], []

    def loop(i):
        w, cache, q, _ = setups[i]
        try:
            for _ in range(300):
                if not np.array_equal(w.run(q, cache), refs[i]):
                    wrong.append(i)
                t = _lib.make_tensor(cache)
                if t.data != cache.ctypes.data:
                    wrong.append(-i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not wrong


def test_pointers_passed_to_the_cache_manager():
    # _i32p/_i64p point at the arrays' first elements
    from kvcache import cache as cache_mod

    a = np.arange(5, dtype=np.int32)[1:]
    assert ctypes.addressof(cache_mod._i32p(a)._obj) == a.ctypes.data
    assert cache_mod._i32p(None) is None
    b = np.arange(3, dtype=np.int64)
    assert ctypes.addressof(cache_mod._i64p(b)._obj) == b.ctypes.data


def test_overhead_benchmark_runs_and_both_sides_agree(capsys):
    """python3 -m kvcache.bench_overhead: every case's public call and its
    prebuilt C call give the same outputs (each case checks that before
    timing); no timing is asserted."""
    import json

    from kvcache import bench_overhead

    assert bench_overhead.main(["--calls", "2", "--rounds", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == len(bench_overhead.CASE_KEYS)
    assert all(r["py_us"] > 0 and r["c_us"] > 0 for r in rows)
