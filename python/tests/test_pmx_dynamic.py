"""kvcache.pmx.dynamic_key_value_cache (SEMANTICS 3) against the per-token
reference, exactly, on every ISA: layouts 0-3, offset and paged modes,
ragged batches with empty sequences, padded page tables."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
import kvc_reference as ref
from kvc_reference import BF16, F16, F32, assert_same_bytes
from pmx_cases import DynamicSession, Storage

CONFIGS = ref.storage_configs()
CONFIG_IDS = [c[0] for c in CONFIGS]
DH_GROUPS = [(16, 8), (40, 8), (32, 16), (128, 32), (24, 2), (64, 64)]
REPEATS = [1, 2, 4]
PAGE_SIZES = [1, 3, 16, 128]

# A ragged schedule over 4 sequences: prefills, decodes, a sequence with no
# new tokens (S_b = 0), sequences with nothing at all (kvlen_b = 0), batch
# order different from sequence order, and B = 1.
SCHEDULE = [
    [(0, 5), (1, 3), (2, 0)],
    [(1, 0), (0, 1), (3, 4), (2, 2)],
    [(3, 3)],
    [(2, 0), (0, 0), (1, 6)],
]


@pytest.mark.parametrize("ci", range(len(CONFIGS)), ids=CONFIG_IDS)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("layout", [0, 1, 2, 3])
def test_dynamic_grid(isa, rng, layout, mode, ci):
    i = ci + 5 * layout + 11 * mode
    dh, group = DH_GROUPS[i % len(DH_GROUPS)]
    num_layer, layer_idx = ((3, 2), (1, 0), (2, 0))[i % 3]
    sess = DynamicSession(rng, Storage.from_config(CONFIGS[ci], group), layout=layout,
                          mode=mode, page_size=PAGE_SIZES[i % 4], heads=2, dh=dh,
                          num_layer=num_layer, layer_idx=layer_idx,
                          num_repeat=REPEATS[(i // 4) % 3])
    for step, batch in enumerate(SCHEDULE):
        k, _ = sess.step(batch, slack=step % 2, what=f"step {step}")
        assert k.shape == (sum(sess.lengths[b[0]] for b in batch), 2 * sess.num_repeat, dh)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("repeat", REPEATS)
@pytest.mark.parametrize("bits", [0, 8, 4])
def test_dynamic_pages_and_repeats(rng, page_size, repeat, bits):
    t2 = {0: BF16, 8: np.int8, 4: "int4"}[bits]
    layout = (page_size + repeat + bits) % 4
    sess = DynamicSession(rng, Storage(F32, t2, bits, F16, 8), layout=layout, mode=1,
                          page_size=page_size, heads=3, dh=16, num_repeat=repeat, cap=20)
    sess.step([(0, 17), (1, 1), (2, 0)])
    sess.step([(1, 19), (0, 3), (3, 20)])


def test_dynamic_offset_regions_with_all_layouts(rng):
    """cache_mode 0 with explicit start_pos values that skip positions (the
    skipped slots are read back as they were)."""
    for layout in range(4):
        sess = DynamicSession(rng, Storage(F16, F16, 0, None), layout=layout, mode=0, cap=12)
        sess.step([(0, 2, 3), (1, 4, 0)])
        sess.step([(0, 1, 8), (1, 0, 2)])


def test_dynamic_unaligned_page_offsets(isa, rng):
    """Page table entries are token offsets inside MaxT, not page numbers:
    pages may start anywhere, including unaligned offsets."""
    page_size, dh, heads = 3, 16, 2
    for bits, t2 in ((0, F32), (8, np.int8), (4, "int4")):
        st = Storage(BF16, t2, bits, F32, 8)
        max_t = 40
        for layout in range(4):
            shape = ref.dynamic_cache_shape(layout, max_t, 1, heads, dh)
            cache, scale = st.make(rng, shape, dh)
            table = np.array([[1, 17, 5, -1], [10, 34, 26, 13]], np.int64)  # disjoint
            ck = ref.random_input(rng, (12, heads, dh), BF16)
            cv = ref.random_input(rng, (12, heads, dh), BF16)
            seqstarts, kvstarts, start_pos = [0, 5, 12], [0, 8, 20], [3, 5]
            ecache, escale = cache.copy(), None if scale is None else scale.copy()
            ek, ev = ref.dynamic_key_value_cache(
                ck, cv, seqstarts, kvstarts, table, start_pos, ecache, escale, quant_bit=bits,
                quant_group=8, cache_mode=1, cache_layout=layout, page_size=page_size)
            k, v = kvcache.pmx.dynamic_key_value_cache(
                ck, cv, seqstarts, kvstarts, table, start_pos, 7, 20, cache, scale,
                quant_bit=bits, quant_group=8, cache_mode=1, cache_layout=layout,
                page_size=page_size)
            assert_same_bytes(k, ek, "key")
            assert_same_bytes(v, ev, "value")
            assert_same_bytes(cache, ecache, "cache")
            if scale is not None:
                assert_same_bytes(scale, escale, "scale")


@pytest.mark.parametrize("layout", [0, 1, 2, 3])
def test_dynamic_noncontiguous(isa, rng, layout):
    """Sliced inputs (strided rows/heads, padded rows, strided last dim that
    the binding copies, non-contiguous index arrays) and a cache/scale that
    are slices of bigger arrays: bytes outside the views stay unchanged."""
    dh, heads = 16, 2
    for bits, t2 in ((0, BF16), (8, np.int8), (4, "int4")):
        st = Storage(F16, t2, bits, F16, 8)
        shape = ref.dynamic_cache_shape(layout, 30, 1, heads, dh)
        big_shape = (shape[0] + 2,) + shape[1:-1] + (st.cache_last(dh) + 6,)
        big_cache = ref.random_cache(rng, big_shape, t2)
        big_scale = ref.random_scale(rng, big_shape[:-1] + (5,), F16) if bits else None
        cache = big_cache[1:1 + shape[0], ..., 2:2 + st.cache_last(dh)]
        scale = None if big_scale is None else big_scale[2:2 + shape[0], ..., 3:5]
        before_cache = big_cache.copy()
        before_scale = None if big_scale is None else big_scale.copy()
        exp_cache = before_cache[1:1 + shape[0], ..., 2:2 + st.cache_last(dh)]
        exp_scale = None if big_scale is None else before_scale[2:2 + shape[0], ..., 3:5]

        kin = ref.random_input(rng, (14, 2 * heads, dh + 3), F16)
        vin = ref.random_input(rng, (7, heads, 2 * dh), F16)
        ck = kin[::2, 1::2, 1:1 + dh]
        cv = vin[:, :, ::2]
        seqstarts = np.array([0, 0, 3, 7], np.int64)
        kvstarts = np.array([[0, 0], [2, 0], [7, 0], [17, 0]], np.int64)[:, 0]  # strided
        cachestarts = np.array([20, 0, 8], np.int32)  # converted to int64
        start_pos = [2, 2, 6]
        ek, ev = ref.dynamic_key_value_cache(ck, cv, seqstarts, kvstarts, cachestarts, start_pos,
                                             exp_cache, exp_scale, quant_bit=bits,
                                             quant_group=8, cache_layout=layout)
        k, v = kvcache.pmx.dynamic_key_value_cache(ck, cv, seqstarts, kvstarts, cachestarts,
                                                   start_pos, 4, 10, cache, scale,
                                                   quant_bit=bits, quant_group=8,
                                                   cache_layout=layout)
        assert_same_bytes(k, ek, "key")
        assert_same_bytes(v, ev, "value")
        assert_same_bytes(big_cache, before_cache, "whole cache buffer")
        if big_scale is not None:
            assert_same_bytes(big_scale, before_scale, "whole scale buffer")


@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize("mode", [0, 1])
def test_dynamic_threads_identical(rng, mode, bits):
    """1, 2 and all threads give the same bytes, equal to the reference."""
    t2 = {0: F16, 8: np.int8, 4: "int4"}[bits]
    sess = DynamicSession(rng, Storage(F32, t2, bits, F32, 16), layout=mode + 1, mode=mode,
                          page_size=16, heads=2, dh=32, n_seqs=3, cap=200)
    args = sess.build([(0, 150), (1, 0, 70), (2, 130, 60)])
    results = []
    for n_threads in (1, 2, None):
        cache = sess.cache.copy()
        scale = None if sess.scale is None else sess.scale.copy()
        k, v = kvcache.pmx.dynamic_key_value_cache(cache=cache, scale=scale,
                                                   n_threads=n_threads, **args, **sess.attrs())
        results.append((k, v, cache, scale))
    for other in results[1:]:
        for a, b, name in zip(results[0], other, ("key", "value", "cache", "scale"), strict=True):
            if a is not None:
                assert_same_bytes(b, a, name)
    sess.run(args, n_threads=2)


def test_dynamic_empty_batches(rng):
    """Every S_b = 0 (read-only call), every kvlen_b = 0 (no output rows), B = 0."""
    sess = DynamicSession(rng, Storage(F32, np.int8, 8, F32), layout=0, mode=1, page_size=4)
    sess.step([(0, 6), (1, 3)])
    k, _ = sess.step([(0, 0), (1, 0)])
    assert k.shape == (9, 2, 16)
    k, _ = sess.step([(2, 0), (3, 0)])
    assert k.shape == (0, 2, 16)
    k, _ = sess.step([])
    assert k.shape == (0, 2, 16)


def test_dynamic_paged_only_needed_entries_read(rng):
    """Entries past the last needed page may be -1 (or anything): only
    positions [0, kvlen_b) are mapped."""
    st = Storage(F32, F32, 0, None)
    sess = DynamicSession(rng, st, layout=2, mode=1, page_size=4, n_seqs=2, cap=8)
    args = sess.build([(0, 3), (1, 4)])
    assert (args["cachestarts"][:, 1:] == -1).all()
    sess.run(args)
    args["cachestarts"][:, 2:] = 10**12  # garbage in never-needed entries
    sess.run(args)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("sdt", [F32, F16], ids=ref.DTYPE_NAMES.get)
def test_dynamic_edge_values(isa, rng, bits, sdt):
    """All-zero groups, exact .5 ties and +-qmax rows through the dynamic
    operator (scale exactly 1 when absmax is qmax)."""
    qm = 127 if bits == 8 else 7
    rows = [
        np.zeros(16),
        [qm, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -qm, 3.5, -3.5, 4.5, -4.5, 5.5, -5.5, qm, -qm],
        [-qm, qm] * 8,
        [1e-7, -1e-7, 0, 0, 0, 0, 0, 0, 6.5, -6.5, 0.5, 0, 0, 0, 0, qm],
    ]
    sess = DynamicSession(rng, Storage(F32, np.int8 if bits == 8 else "int4", bits, sdt, 8),
                          layout=3, mode=1, page_size=3, heads=2, dh=16, n_seqs=2)
    args = sess.build([(0, 2), (1, 2)])
    x = np.array(rows, np.float32).reshape(4, 1, 16).repeat(2, axis=1)
    args["current_key"] = x
    args["current_value"] = x[::-1].copy()
    sess.run(args)
