"""kvcache.pmx.key_value_cache (static batching, SEMANTICS 2) against the
per-token reference, exactly, on every ISA."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
import kvc_reference as ref
from kvc_reference import F16, F32, assert_same_bytes
from pmx_cases import Storage, run_static, static_shape

CONFIGS = ref.storage_configs()
CONFIG_IDS = [c[0] for c in CONFIGS]
# (Dh, quant_group) pairs cycled over the grid: SIMD bodies and tails.
DH_GROUPS = [(16, 8), (40, 8), (32, 16), (128, 32), (24, 2), (64, 64), (256, 128)]
REPEATS = [1, 2, 4]


@pytest.mark.parametrize("ci", range(len(CONFIGS)), ids=CONFIG_IDS)
@pytest.mark.parametrize("layout", [0, 1])
def test_static_grid(isa, rng, layout, ci):
    """Prefill, decode, fill to MaxS with fewer batches, then a read-only call."""
    dh, group = DH_GROUPS[(ci + layout) % len(DH_GROUPS)]
    st = Storage.from_config(CONFIGS[ci], group)
    repeat = REPEATS[(ci + 2 * layout) % 3]
    num_layer, layer_idx = (2, 1) if ci % 2 else (1, 0)
    max_b, max_s, heads = 3, 7, 2
    cache, scale = st.make(rng, static_shape(layout, max_b, num_layer, max_s, heads, dh), dh)
    attrs = dict(num_layer=num_layer, layer_idx=layer_idx, num_repeat=repeat,
                 cache_layout=layout, **st.attrs())
    for step, (b, start, s) in enumerate([(2, 0, 3), (2, 3, 1), (1, 4, 3), (3, 7, 0)]):
        ck = ref.random_input(rng, (b, s, heads, dh), st.t1)
        cv = ref.random_input(rng, (b, s, heads, dh), st.t1)
        k, _ = run_static(cache, scale, ck, cv, start, attrs, what=f"step {step}")
        assert k.shape == (b, start + s, heads * repeat, dh)


@pytest.mark.parametrize("repeat", REPEATS)
@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize("layout", [0, 1])
def test_static_repeat(rng, layout, bits, repeat):
    st = Storage(F16, F32 if bits == 0 else ("int4" if bits == 4 else np.int8), bits, F16, 8)
    cache, scale = st.make(rng, static_shape(layout, 2, 1, 5, 3, 16), 16)
    attrs = dict(num_repeat=repeat, cache_layout=layout, **st.attrs())
    ck = ref.random_input(rng, (2, 5, 3, 16), F16)
    cv = ref.random_input(rng, (2, 5, 3, 16), F16)
    k, v = run_static(cache, scale, ck, cv, 0, attrs)
    # output head h is cache head h // repeat
    for h in range(3 * repeat):
        assert_same_bytes(k[:, :, h], k[:, :, (h // repeat) * repeat])


@pytest.mark.parametrize("layout", [0, 1])
def test_static_noncontiguous(isa, rng, layout):
    """Sliced inputs (strided heads and tokens, padded rows, a strided last
    dim that the binding copies) and a cache/scale that are slices of bigger
    arrays along a leading dim and in the last dim: bytes outside the views
    must stay as they were."""
    dh, heads = 16, 2
    for bits, t2 in ((0, F16), (8, np.int8), (4, "int4")):
        st = Storage(F32, t2, bits, F32, 8)
        shape = static_shape(layout, 2, 1, 6, heads, dh)
        big_shape = (shape[0] * 2,) + shape[1:-1] + (st.cache_last(dh) + 5,)
        big_cache = ref.random_cache(rng, big_shape, t2)
        big_scale = None
        if bits:
            big_scale = ref.random_scale(rng, big_shape[:-1] + (dh // 8 + 3,), F32)
        cache = big_cache[1::2, ..., 3:3 + st.cache_last(dh)]
        scale = None if big_scale is None else big_scale[::2, ..., 1:1 + dh // 8]
        assert not cache.flags.c_contiguous
        before_cache = big_cache.copy()
        before_scale = None if big_scale is None else big_scale.copy()
        exp_cache = before_cache[1::2, ..., 3:3 + st.cache_last(dh)]
        exp_scale = None if big_scale is None else before_scale[::2, ..., 1:1 + dh // 8]

        kin = ref.random_input(rng, (2, 3, 2 * heads, dh + 4), F32)
        vin = ref.random_input(rng, (2, 6, heads, 2 * dh), F32)
        ck = kin[:, :, ::2, 2:2 + dh]       # strided heads, padded rows
        cv = vin[:, ::2, :, ::2]            # strided tokens and last dim (copied)
        ek, ev = ref.key_value_cache(ck, cv, 2, exp_cache, exp_scale, quant_bit=bits,
                                     quant_group=8, cache_layout=layout)
        k, v = kvcache.pmx.key_value_cache(ck, cv, 2, cache, scale, quant_bit=bits,
                                           quant_group=8, cache_layout=layout)
        assert_same_bytes(k, ek, "key")
        assert_same_bytes(v, ev, "value")
        assert_same_bytes(big_cache, before_cache, "whole cache buffer")
        if big_scale is not None:
            assert_same_bytes(big_scale, before_scale, "whole scale buffer")


@pytest.mark.parametrize("bits", [0, 8, 4])
def test_static_threads_identical(rng, bits):
    """Long sequences (several 64-token chunks): 1, 2 and all threads give
    the same bytes, equal to the reference."""
    st = Storage(F16, F32 if bits == 0 else ("int4" if bits == 4 else np.int8), bits, F32, 8)
    shape = static_shape(1, 3, 1, 200, 2, 16)
    cache0, scale0 = st.make(rng, shape, 16)
    ck = ref.random_input(rng, (3, 150, 2, 16), F16)
    cv = ref.random_input(rng, (3, 150, 2, 16), F16)
    results = []
    for n_threads in (1, 2, None):
        cache, scale = cache0.copy(), None if scale0 is None else scale0.copy()
        k, v = kvcache.pmx.key_value_cache(ck, cv, 40, cache, scale, cache_layout=1,
                                           n_threads=n_threads, **st.attrs())
        results.append((k, v, cache, scale))
    for other in results[1:]:
        for a, b, name in zip(results[0], other, ("key", "value", "cache", "scale"), strict=True):
            if a is not None:
                assert_same_bytes(b, a, name)
    run_static(cache0, scale0, ck, cv, 40, dict(cache_layout=1, **st.attrs()), n_threads=2)


def test_static_edge_values(isa):
    """All-zero groups (eps scale), exact ties, -qmax/qmax and the int4 nibble
    order, through the operator."""
    dh = 16
    row8 = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -127,
                     0, 0, 0, 0, 0, 0, 0, 0], np.float32)
    row4 = np.array([7, -7, 1, -1, 0, 3, -3, 2, 0.5, 1.5, 2.5, -2.5, 3.5, -3.5, 6.5, 7],
                    np.float32)
    for bits, row in ((8, row8), (4, row4)):
        for sdt in (F32, F16):
            st = Storage(F32, np.int8 if bits == 8 else "int4", bits, sdt, 8)
            cache = np.zeros(static_shape(0, 1, 1, 2, 1, dh)[:-1] + (st.cache_last(dh),),
                             np.int8 if bits == 8 else np.uint8)
            scale = np.zeros(static_shape(0, 1, 1, 2, 1, dh // 8), sdt)
            ck = row.reshape(1, 1, 1, dh)
            cv = np.zeros_like(ck)
            k, v = run_static(cache, scale, ck, cv, 1, dict(**st.attrs()))
            ks, vs = scale[0, 0, 0, 1, 0], scale[0, 0, 1, 1, 0]
            eps = float(np.float32(1e-5).astype(sdt))
            assert vs.tolist() == [eps, eps]
            assert not cache[0, 0, 1, 1].any()
            if bits == 8:
                assert ks.tolist() == [1.0, eps]
                assert cache[0, 0, 0, 1, 0].tolist() == [127, 0, 2, 2, 0, -2, -2, -127] + [0] * 8
            else:
                assert ks.tolist() == [1.0, 1.0]
                assert cache[0, 0, 0, 1, 0].tolist() == [0x97, 0xF1, 0x30, 0x2D,
                                                         0x20, 0xE2, 0xC4, 0x76]
            assert v[0, 1].tolist() == [[0.0] * dh]


def test_static_int8_plain_copy_keeps_all_values(isa):
    x = np.arange(-128, 128, dtype=np.int8).reshape(1, 4, 2, 32)
    cache = np.zeros(static_shape(0, 1, 1, 4, 2, 32), np.int8)
    k, v = kvcache.pmx.key_value_cache(x, x[:, ::-1], 0, cache)
    assert_same_bytes(cache[0, 0, 0], x[0])
    assert_same_bytes(cache[0, 0, 1], x[0, ::-1])
    assert_same_bytes(k, x)


def test_static_nan_copied_as_is_without_quant():
    x = np.full((1, 1, 1, 8), np.nan, np.float32)
    x[..., 1] = np.inf
    cache = np.zeros(static_shape(0, 1, 1, 1, 1, 8), np.float32)
    k, v = kvcache.pmx.key_value_cache(x, x, 0, cache)
    assert np.isnan(k[0, 0, 0, 0]) and k[0, 0, 0, 1] == np.inf
    assert np.isnan(cache[0, 0, 0, 0, 0, 0])


def test_static_defaults_and_keywords(rng):
    """Positional call with defaults (layout 0, no quant, one layer, all threads)."""
    cache = ref.random_cache(rng, (2, 1, 2, 4, 2, 8), F32)
    ck = ref.random_input(rng, (2, 4, 2, 8), F32)
    exp = cache.copy()
    ek, ev = ref.key_value_cache(ck, ck, 0, exp, None)
    k, v = kvcache.pmx.key_value_cache(ck, ck, np.int64(0), cache)
    assert_same_bytes(k, ek)
    assert_same_bytes(cache, exp)
    k2, _ = kvcache.pmx.key_value_cache(ck[:, :0], ck[:, :0], np.array([4]), cache)
    assert_same_bytes(k2, ek)


def test_static_concurrent_python_threads(rng):
    """Python threads sharing the cached thread pools (ctypes releases the
    GIL) get the same results as sequential calls."""
    import threading

    st = Storage(F32, np.int8, 8, F32)
    shape = static_shape(0, 2, 1, 40, 2, 32)
    jobs = []
    for _ in range(6):
        cache, scale = st.make(rng, shape, 32)
        ck = ref.random_input(rng, (2, 40, 2, 32), F32)
        cv = ref.random_input(rng, (2, 40, 2, 32), F32)
        ecache, escale = cache.copy(), scale.copy()
        ek, ev = kvcache.pmx.key_value_cache(ck, cv, 0, ecache, escale, n_threads=1, **st.attrs())
        jobs.append((ck, cv, cache, scale, ek, ev, ecache, escale))
    errors = []

    def work(job):
        ck, cv, cache, scale, ek, ev, ecache, escale = job
        try:
            for _ in range(5):
                c, s = cache.copy(), scale.copy()
                k, v = kvcache.pmx.key_value_cache(ck, cv, 0, c, s, n_threads=2, **st.attrs())
                assert_same_bytes(k, ek)
                assert_same_bytes(v, ev)
                assert_same_bytes(c, ecache)
                assert_same_bytes(s, escale)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_static_empty_batch_and_bad_thread_count(rng):
    cache = ref.random_cache(rng, static_shape(1, 2, 1, 4, 2, 8), F16)
    before = cache.copy()
    x = np.zeros((0, 2, 2, 8), np.float16)
    k, v = kvcache.pmx.key_value_cache(x, x, 1, cache, cache_layout=1)
    assert k.shape == (0, 3, 2, 8) and v.dtype == F16
    assert_same_bytes(cache, before)
    for bad in (0, -1, 1.5):
        for kw in ("num_threads", "n_threads"):  # the second is the older name
            with pytest.raises(kvcache.InvalidArgumentError, match="num_threads"):
                kvcache.pmx.key_value_cache(x, x, 1, cache, cache_layout=1, **{kw: bad})
    with pytest.raises(kvcache.InvalidArgumentError, match="not both"):
        kvcache.pmx.key_value_cache(x, x, 1, cache, cache_layout=1, n_threads=1, num_threads=1)
