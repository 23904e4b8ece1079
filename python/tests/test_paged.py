"""kvcache.paged (SEMANTICS section 4) against the per-token numpy reference in
paged_reference.py, exactly (tolerance 0: every byte of the whole cache, and of
the buffers the cache views are sliced from), on every ISA and with 1 and 2
threads: NHD/HND, combined and (K, V) caches, strided views, page sizes 1, 5,
16, 128, ragged prefill + decode batches with empty requests, float and
int8/int4 storage, MLA, pmx page-table conversion, and argument errors."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import kvcache
import kvc_reference as ref
import paged_reference as pr
import skip_check
from kvc_reference import BF16, F16, F32, FLOATS, I8, assert_same_bytes

NAMES = ref.DTYPE_NAMES
THREADS = (1, 2)
LAYOUTS = ("NHD", "HND")
FORMS = ("combined", "split", "combined_strided", "split_strided", "split_distinct")
PAGE_SIZES = (1, 5, 16, 128)


@contextlib.contextmanager
def using_isa(name):
    old = kvcache.get_isa()
    kvcache.set_isa(name)
    try:
        yield
    finally:
        kvcache.set_isa(old)


def variants():
    """(isa, n_threads) for every ISA this CPU runs and 1 and 2 threads (the
    others are reported as paths not run)."""
    for isa in skip_check.isas_to_run("test_paged.py::variants"):
        for nt in THREADS:
            yield isa, nt


# ---------------------------------------------------------------------------
# Cache construction: base buffers and the views of them passed to kvcache


class Buffers:
    """A K/V cache (or its scales) in one of the FORMS.

    bases: the numpy buffers that own the memory (compared whole, so bytes
    outside the views must stay untouched); views(bases) -> (argument passed
    to kvcache, 4-D K view, 4-D V view)."""

    def __init__(self, form, fill, max_pages, d1, d2, last):
        self.form = form
        m = max_pages
        if form == "combined":
            self.bases = [fill((m, 2, d1, d2, last))]
            self._views = lambda bs: (bs[0], bs[0][:, 0], bs[0][:, 1])
        elif form == "split":
            self.bases = [fill((2, m, d1, d2, last))]
            self._views = lambda bs: ((bs[0][0], bs[0][1]), bs[0][0], bs[0][1])
        elif form == "combined_strided":
            # every other page of a bigger array, padded rows, heads and features
            self.bases = [fill((2 * m + 1, 2, d1 + 2, d2 + 1, last + 3))]

            def views(bs):
                c = bs[0][1::2, :, 1:1 + d1, :d2, 2:2 + last]
                return c, c[:, 0], c[:, 1]

            self._views = views
        elif form == "split_strided":
            # K and V sliced from one bigger buffer, same strides
            self.bases = [fill((2, m + 2, d1 + 1, d2 + 2, last + 5))]

            def views(bs):
                k = bs[0][0, 2:, :d1, 1:1 + d2, 2:2 + last]
                v = bs[0][1, :m, 1:, :d2, :last]
                return (k, v), k, v

            self._views = views
        elif form == "split_distinct":
            # K and V in separate buffers with different strides
            self.bases = [fill((m, d1, d2, last)), fill((m + 1, d1 + 3, d2, last + 1))]

            def views(bs):
                k, v = bs[0], bs[1][1:, 3:, :, :last]
                return (k, v), k, v

            self._views = views
        else:
            raise AssertionError(form)
        for b in self.bases:
            assert b.flags.c_contiguous

    def copy(self):
        return [b.copy() for b in self.bases]

    def views(self, bases):
        return self._views(bases)


def cache_buffers(rng, form, layout, max_pages, page_size, heads, dh, cache_dtype):
    d1, d2 = (page_size, heads) if layout == "NHD" else (heads, page_size)
    last = dh // 2 if cache_dtype == "int4" else dh
    return Buffers(form, lambda s: ref.random_cache(rng, s, cache_dtype), max_pages, d1, d2,
                   last)


def scale_buffers(rng, form, layout, max_pages, page_size, heads, dh, group, sdt):
    d1, d2 = (page_size, heads) if layout == "NHD" else (heads, page_size)
    return Buffers(form, lambda s: ref.random_scale(rng, s, sdt), max_pages, d1, d2, dh // group)


def assert_buffers(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_same_bytes(a, e, f"{what} buffer {i}")


# ---------------------------------------------------------------------------
# One append scenario, checked on every ISA and thread count


def check_append(rng, batch, layout, form, t1, cache_dtype, heads, dh, *, quant_bit=0,
                 sdt=None, group=8, key=None, value=None, what=""):
    """Appends batch's rows via kvcache and via the reference; the whole cache
    (and scale) buffers must be equal byte for byte. Returns (key, value, the
    reference K/V/scale views) for extra checks."""
    ps = batch.page_size
    cache = cache_buffers(rng, form, layout, batch.max_pages, ps, heads, dh, cache_dtype)
    scale = (scale_buffers(rng, form, layout, batch.max_pages, ps, heads, dh, group, sdt)
             if quant_bit else None)
    if key is None:
        key = ref.random_input(rng, (batch.nnz, heads, dh), t1)
        value = ref.random_input(rng, (batch.nnz, heads, dh), t1)

    bi, pos = kvcache.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    assert_same_bytes(bi, batch.batch_indices, "batch_indices")
    assert_same_bytes(pos, batch.positions, "positions")

    ref_cache = cache.copy()
    _, rk, rv = cache.views(ref_cache)
    ref_scale = scale.copy() if scale else None
    rks = rvs = None
    if scale:
        _, rks, rvs = scale.views(ref_scale)
    pr.append_paged_kv_cache(key, value, bi, pos, rk, rv, batch.kv_indices, batch.kv_indptr, ps,
                             layout, k_scale=rks, v_scale=rvs, quant_bit=quant_bit,
                             quant_group=group)

    for isa, nt in variants():
        got_cache = cache.copy()
        arg, _, _ = cache.views(got_cache)
        kw = {}
        if scale:
            got_scale = scale.copy()
            kw = {"kv_scale": scale.views(got_scale)[0], "quant_group": group}
        with using_isa(isa):
            kvcache.append_paged_kv_cache(key, value, bi, pos, arg, *batch.table(),
                                          kv_layout=layout, n_threads=nt, **kw)
        tag = f"{what} {layout} {form} ps={ps} isa={isa} threads={nt}"
        assert_buffers(got_cache, ref_cache, f"cache ({tag})")
        if scale:
            assert_buffers(got_scale, ref_scale, f"scale ({tag})")
    return key, value, (rk, rv, rks, rvs)


# ---------------------------------------------------------------------------
# get_seq_lens / get_batch_indices_positions


def test_flashinfer_docstring_example():
    bi, pos = kvcache.get_batch_indices_positions([0, 1, 3, 6, 10], [5, 5, 5, 5], 10)
    assert bi.dtype == np.int32 and pos.dtype == np.int32
    assert bi.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert pos.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_get_seq_lens_and_positions(rng, page_size):
    for trial in range(6):
        batch = pr.mixed_batch(rng, page_size, n_req=1 + 3 * trial)
        lens = kvcache.get_seq_lens(batch.kv_indptr, batch.kv_last_page_len, page_size)
        assert lens.dtype == np.int32 and lens.shape == (batch.B,)
        assert_same_bytes(lens, batch.seq_lens, "seq_lens")
        assert_same_bytes(lens, pr.seq_lens(batch.kv_indptr, batch.kv_last_page_len, page_size))
        # FlashInfer's formula: clamp(pages - 1, 0) * page_size + last_page_len
        pages = np.diff(batch.kv_indptr)
        fi = np.maximum(pages - 1, 0) * page_size + batch.kv_last_page_len
        assert lens.tolist() == fi.tolist()
        # int64 and list inputs are accepted
        lens64 = kvcache.get_seq_lens(batch.kv_indptr.astype(np.int64),
                                      batch.kv_last_page_len.tolist(), page_size)
        assert_same_bytes(lens64, lens)
        bi, pos = kvcache.get_batch_indices_positions(batch.append_indptr, lens, batch.nnz)
        assert_same_bytes(bi, batch.batch_indices, "batch_indices")
        assert_same_bytes(pos, batch.positions, "positions")


def test_seq_lens_and_positions_edge_cases():
    assert kvcache.get_seq_lens([0], np.zeros(0, np.int32), 4).shape == (0,)
    assert kvcache.get_seq_lens([0, 0, 0], [0, 0], 4).tolist() == [0, 0]
    assert kvcache.get_seq_lens([0, 0, 3], [0, 1], 16).tolist() == [0, 33]  # FlashInfer test
    bi, pos = kvcache.get_batch_indices_positions([0], np.zeros(0, np.int32), 0)
    assert bi.shape == pos.shape == (0,)
    bi, pos = kvcache.get_batch_indices_positions([0, 0, 2, 2], [3, 2, 0], 2)
    assert bi.tolist() == [1, 1] and pos.tolist() == [0, 1]


@pytest.mark.parametrize("args", [
    ([1, 2], [1], 4),         # indptr[0] != 0
    ([0, 2, 1], [1, 1], 4),   # decreasing
    ([0, 1], [0], 4),         # last_page_len 0 with pages
    ([0, 1], [5], 4),         # last_page_len > page_size
    ([0, 0], [1], 4),         # empty request with last_page_len != 0
    ([0, 1], [-1], 4),
    ([0, 1, 2], [1], 4),      # shape mismatch
    ([0, 1], [1], 0),         # page_size 0
    ([0.0, 1.0], [1], 4),     # non-integer indptr
])
def test_get_seq_lens_rejects(args):
    with pytest.raises(kvcache.InvalidArgumentError, match=r"\S"):
        kvcache.get_seq_lens(*args)


@pytest.mark.parametrize("args", [
    ([0, 3], [2], 3),          # more appended rows than seq_len
    ([1, 3], [5], 2),          # indptr[0] != 0
    ([0, 3, 2], [5, 5], 2),    # decreasing
    ([0, 3], [5], 4),          # nnz != indptr[B]
    ([0, 3], [5, 5], 3),       # shape mismatch
    ([0, 1], [-1], 1),         # negative seq_len
    ([0, 1.5], [5], 1),        # non-integer
])
def test_get_batch_indices_positions_rejects(args):
    with pytest.raises(kvcache.InvalidArgumentError, match=r"\S"):
        kvcache.get_batch_indices_positions(*args)


# ---------------------------------------------------------------------------
# Float appends


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_float(rng, layout, form, page_size):
    heads, dh = (2, 16) if page_size < 128 else (1, 8)
    for t1 in FLOATS:
        for t2 in FLOATS:
            batch = pr.mixed_batch(rng, page_size, n_req=6, max_prefill=3 * page_size + 4
                                   if page_size < 16 else 40)
            check_append(rng, batch, layout, form, t1, t2, heads, dh,
                         what=f"{NAMES[t1]}->{NAMES[t2]}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_sequence_of_steps(rng, layout):
    """Prefill then several decode steps into the same cache, through
    kvcache and the reference side by side."""
    ps, heads, dh = 4, 3, 8
    batch = pr.Batch(rng, ps, [0, 0, 0], [0, 0, 0], spare_pages=20)
    pool = list(rng.permutation(batch.max_pages))
    pages = [[], [], []]
    lens = [0, 0, 0]
    cache = np.zeros((batch.max_pages, 2, ps, heads, dh) if layout == "NHD"
                     else (batch.max_pages, 2, heads, ps, dh), BF16)
    expect = cache.copy()
    for step, new in enumerate([[7, 0, 3], [1, 1, 1], [1, 5, 1], [0, 1, 1], [1, 1, 0]]):
        for b in range(3):
            lens[b] += new[b]
            while len(pages[b]) * ps < lens[b]:
                pages[b].append(int(pool.pop()))
        indptr = np.cumsum([0] + [len(p) for p in pages]).astype(np.int32)
        indices = np.array([p for pp in pages for p in pp], np.int32)
        last = np.array([0 if not p else n - ps * (len(p) - 1) for p, n in zip(pages, lens)],
                        np.int32)
        append_indptr = np.cumsum([0] + new).astype(np.int32)
        nnz = int(append_indptr[-1])
        seq = kvcache.get_seq_lens(indptr, last, ps)
        assert seq.tolist() == lens
        bi, pos = kvcache.get_batch_indices_positions(append_indptr, seq, nnz)
        k = ref.random_input(rng, (nnz, heads, dh), F32)
        v = ref.random_input(rng, (nnz, heads, dh), F32)
        pr.append_paged_kv_cache(k, v, bi, pos, expect[:, 0], expect[:, 1], indices, indptr, ps,
                                 layout)
        kvcache.append_paged_kv_cache(k, v, bi, pos, cache, indices, indptr, last,
                                      kv_layout=layout, n_threads=2)
        assert_same_bytes(cache, expect, f"step {step}")


def test_append_strided_inputs(rng):
    """append_key/append_value with row and head strides (only the last dim
    contiguous), and non-contiguous inputs that must be copied."""
    batch = pr.mixed_batch(rng, 5, n_req=5)
    heads, dh = 2, 16
    big_k = ref.random_input(rng, (batch.nnz, 2 * heads, dh + 4), F32)
    big_v = ref.random_input(rng, (2 * batch.nnz, heads, dh), F32)
    k = big_k[:, ::2, 1:1 + dh]
    v = big_v[::2]
    check_append(rng, batch, "NHD", "split", None, F32, heads, dh, key=k, value=v)
    kt = np.ascontiguousarray(ref.random_input(rng, (batch.nnz, heads, dh), BF16)
                              .transpose(2, 0, 1)).transpose(1, 2, 0)  # last dim strided
    check_append(rng, batch, "HND", "combined", None, F16, heads, dh, key=kt, value=kt)


def test_append_index_inputs_any_integer_type(rng):
    batch = pr.mixed_batch(rng, 16, n_req=5)
    heads, dh = 2, 8
    k = ref.random_input(rng, (batch.nnz, heads, dh), F32)
    cache = ref.random_cache(rng, (batch.max_pages, 2, 16, heads, dh), F32)
    expect = cache.copy()
    pr.append_paged_kv_cache(k, k, batch.batch_indices, batch.positions, expect[:, 0],
                             expect[:, 1], batch.kv_indices, batch.kv_indptr, 16, "NHD")
    kvcache.append_paged_kv_cache(k, k, batch.batch_indices.astype(np.int64),
                                  batch.positions.astype(np.uint16), cache,
                                  batch.kv_indices.tolist(), batch.kv_indptr.astype(np.int16),
                                  batch.kv_last_page_len.astype(np.uint8))
    assert_same_bytes(cache, expect)


def test_append_empty_batches(rng):
    heads, dh, ps = 2, 8, 4
    cache = ref.random_cache(rng, (3, 2, ps, heads, dh), F32)
    before = cache.copy()
    none = np.zeros((0, heads, dh), F32)
    # B = 0
    kvcache.append_paged_kv_cache(none, none, [], [], cache, [], [0], [])
    # all requests empty or idle (nothing appended)
    kvcache.append_paged_kv_cache(none, none, [], [], cache, [2], [0, 0, 1, 1], [0, 3, 0])
    assert_same_bytes(cache, before)


def test_append_float_storage_copies_nan_and_inf(rng):
    """Float storage copies NaN and Inf as they are (SEMANTICS 1)."""
    batch = pr.Batch(rng, 4, [2, 0], [1, 3])
    heads, dh = 1, 8
    k = ref.random_input(rng, (batch.nnz, heads, dh), F32)
    k[0, 0, :3] = [np.nan, np.inf, -np.inf]
    k[3, 0, 7] = np.nan
    for t2 in FLOATS:
        cache = np.zeros((batch.max_pages, 2, 4, heads, dh), t2)
        kvcache.append_paged_kv_cache(k, k, batch.batch_indices, batch.positions, cache,
                                      *batch.table())
        expect = np.zeros_like(cache)
        pr.append_paged_kv_cache(k, k, batch.batch_indices, batch.positions, expect[:, 0],
                                 expect[:, 1], batch.kv_indices, batch.kv_indptr, 4, "NHD")
        c32, e32 = cache.astype(F32), expect.astype(F32)
        assert np.array_equal(np.isnan(c32), np.isnan(e32))
        assert np.array_equal(c32[~np.isnan(c32)], e32[~np.isnan(e32)])


# ---------------------------------------------------------------------------
# Quantized appends

QUANT_CASES = [("combined", 16, 8), ("split", 5, 4), ("combined_strided", 1, 16),
               ("split_strided", 16, 2), ("split_distinct", 128, 8)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sdt", [F32, F16], ids=NAMES.get)
@pytest.mark.parametrize("t1", FLOATS, ids=NAMES.get)
@pytest.mark.parametrize("bits", [8, 4])
def test_append_quantized(rng, bits, t1, sdt, layout):
    heads, dh = 2, 16
    cache_dtype = I8 if bits == 8 else "int4"
    for form, ps, group in QUANT_CASES:
        batch = pr.mixed_batch(rng, ps, n_req=5, max_prefill=12 if ps < 16 else 24)
        key = ref.random_input(rng, (batch.nnz, heads, dh), t1)
        value = ref.random_input(rng, (batch.nnz, heads, dh), t1)
        if batch.nnz:  # an all-zero row and a tiny one (scale = 1e-5)
            key[0, 0] = 0
            value[-1, -1] = (value[-1, -1].astype(F32) * np.float32(1e-7)).astype(t1)
        _, _, (rk, rv, rks, rvs) = check_append(
            rng, batch, layout, form, t1, cache_dtype, heads, dh, quant_bit=bits, sdt=sdt,
            group=group, key=key, value=value, what=f"{NAMES[t1]}->q{bits}/{NAMES[sdt]}")
        # The stored rows equal kvcache.quantize on the same rows.
        for x, c, s, name in ((key, rk, rks, "K"), (value, rv, rvs, "V")):
            if not batch.nnz:
                continue
            q, sc = kvcache.quantize(x, bits, group, sdt)
            got_q = np.empty_like(q)
            got_s = np.empty_like(sc)
            for j in range(batch.nnz):
                page, slot = pr.page_and_slot(batch.kv_indices, batch.kv_indptr, ps,
                                              int(batch.batch_indices[j]),
                                              int(batch.positions[j]))
                for h in range(heads):
                    idx = pr.row_index(layout, page, slot, h)
                    got_q[j, h] = c[idx]
                    got_s[j, h] = s[idx]
            assert_same_bytes(got_q, q, f"{name} rows vs kvcache.quantize ({form})")
            assert_same_bytes(got_s, sc, f"{name} scales vs kvcache.quantize ({form})")


def test_append_quantized_dequantizes_close(rng):
    """Sanity: what an int8 cache holds dequantizes to within half a step."""
    batch = pr.mixed_batch(rng, 16, n_req=5)
    heads, dh, group = 2, 32, 8
    k = ref.random_input(rng, (batch.nnz, heads, dh), F32)
    cache = np.zeros((batch.max_pages, 2, 16, heads, dh), np.int8)
    scale = np.zeros((batch.max_pages, 2, 16, heads, dh // group), F32)
    kvcache.append_paged_kv_cache(k, k, batch.batch_indices, batch.positions, cache,
                                  *batch.table(), kv_scale=scale, quant_group=group)
    for j in range(batch.nnz):
        page, slot = pr.page_and_slot(batch.kv_indices, batch.kv_indptr, 16,
                                      int(batch.batch_indices[j]), int(batch.positions[j]))
        y = kvcache.dequantize(cache[page, 1, slot], scale[page, 1, slot], 8, group)
        step = np.repeat(scale[page, 1, slot], group, axis=-1)
        assert np.all(np.abs(y - k[j]) <= step / 2 * (1 + 1e-6))


CACHE_KINDS = [  # (id, cache dtype, quant_bit, scale dtype)
    ("f32", F32, 0, None), ("bf16", BF16, 0, None), ("f16", F16, 0, None),
    ("q8-f16", I8, 8, F16), ("q8-f32", I8, 8, F32), ("q4-f32", "int4", 4, F32),
    ("q4-f16", "int4", 4, F16)]


def _shuffled(rng, batch, key, value):
    perm = rng.permutation(batch.nnz)
    batch.batch_indices = batch.batch_indices[perm]
    batch.positions = batch.positions[perm]
    return key[perm], value[perm]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", CACHE_KINDS, ids=lambda k: k[0])
def test_append_large_batch_rows_in_any_order(rng, kind, layout):
    """Several 64-row tasks, long prefills crossing pages, and rows given in
    a random order (FlashInfer allows any order of (batch index, position))."""
    _, cdt, bits, sdt = kind
    heads, dh, group = 2, 32, 8
    for shuffle, form, ps in ((False, "combined", 16), (True, "split_distinct", 5),
                              (True, "combined_strided", 128)):
        batch = pr.Batch(rng, ps, [0, 37, 0, 3, 200, 0, 12, 1],
                         [0, 1, 150, 70, 1, 0, 64, 1])
        key = ref.random_input(rng, (batch.nnz, heads, dh), BF16 if bits else F32)
        value = ref.random_input(rng, (batch.nnz, heads, dh), BF16 if bits else F32)
        if shuffle:
            key, value = _shuffled(rng, batch, key, value)
        _check_append_rows(rng, batch, layout, form, cdt, heads, dh, bits, sdt, group, key,
                           value, shuffle)


def _check_append_rows(rng, batch, layout, form, cdt, heads, dh, bits, sdt, group, key, value,
                       shuffled):
    if not shuffled:
        check_append(rng, batch, layout, form, None, cdt, heads, dh, quant_bit=bits, sdt=sdt,
                     group=group, key=key, value=value)
        return
    # check_append recomputes (and checks) batch_indices/positions in order;
    # for shuffled rows run the same comparison by hand.
    ps = batch.page_size
    cache = cache_buffers(rng, form, layout, batch.max_pages, ps, heads, dh, cdt)
    scale = (scale_buffers(rng, form, layout, batch.max_pages, ps, heads, dh, group, sdt)
             if bits else None)
    ref_cache = cache.copy()
    _, rk, rv = cache.views(ref_cache)
    ref_scale = scale.copy() if scale else None
    rks = rvs = None
    if scale:
        _, rks, rvs = scale.views(ref_scale)
    pr.append_paged_kv_cache(key, value, batch.batch_indices, batch.positions, rk, rv,
                             batch.kv_indices, batch.kv_indptr, ps, layout, k_scale=rks,
                             v_scale=rvs, quant_bit=bits, quant_group=group)
    for isa, nt in variants():
        got_cache = cache.copy()
        kw = {}
        if scale:
            got_scale = scale.copy()
            kw = {"kv_scale": scale.views(got_scale)[0], "quant_group": group}
        with using_isa(isa):
            kvcache.append_paged_kv_cache(key, value, batch.batch_indices, batch.positions,
                                          cache.views(got_cache)[0], *batch.table(),
                                          kv_layout=layout, n_threads=nt, **kw)
        tag = f"shuffled {layout} {form} ps={ps} isa={isa} threads={nt}"
        assert_buffers(got_cache, ref_cache, f"cache ({tag})")
        if scale:
            assert_buffers(got_scale, ref_scale, f"scale ({tag})")


@pytest.mark.parametrize("dh, group", [(2, 2), (8, 8), (24, 4), (40, 8), (64, 16), (128, 32),
                                       (256, 128), (96, 96)])
def test_append_head_dims(rng, dh, group):
    """Head dims around every vector width (SIMD main loops and tails)."""
    batch = pr.mixed_batch(rng, 5, n_req=5, max_prefill=12)
    for i, (_, cdt, bits, sdt) in enumerate(CACHE_KINDS):
        layout = LAYOUTS[i % 2]
        for t1 in FLOATS:
            check_append(rng, batch, layout, "split_strided", t1, cdt, 2, dh, quant_bit=bits,
                         sdt=sdt, group=group, what=f"dh={dh} {NAMES[t1]}")


def test_append_int8_rows_into_int8_cache_are_copied(rng):
    """int8 inputs into an int8 cache are a plain copy: no kv_scale needed,
    and a given kv_scale is left untouched."""
    batch = pr.mixed_batch(rng, 5, n_req=6, max_prefill=80)
    heads, dh = 2, 16
    for layout in LAYOUTS:
        check_append(rng, batch, layout, "split_distinct", I8, I8, heads, dh)
        k = ref.random_input(rng, (batch.nnz, heads, dh), I8)
        shape = ((batch.max_pages, 2, 5, heads) if layout == "NHD"
                 else (batch.max_pages, 2, heads, 5))
        cache = ref.random_cache(rng, shape + (dh,), I8)
        scale = ref.random_scale(rng, shape + (dh // 8,), F32)
        s0 = scale.copy()
        expect = cache.copy()
        pr.append_paged_kv_cache(k, k, batch.batch_indices, batch.positions, expect[:, 0],
                                 expect[:, 1], batch.kv_indices, batch.kv_indptr, 5, layout)
        kvcache.append_paged_kv_cache(k, k, batch.batch_indices, batch.positions, cache,
                                      *batch.table(), kv_layout=layout, kv_scale=scale)
        assert_same_bytes(cache, expect, "int8 copy")
        assert_same_bytes(scale, s0, "scale untouched by an int8 copy")


# ---------------------------------------------------------------------------
# MLA


@pytest.mark.parametrize("dims", [(512, 64), (16, 8), (40, 24), (6, 2)], ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("one_tensor", [False, True])
def test_append_mla(rng, dims, page_size, one_tensor):
    d_ckv, d_kpe = dims
    # (ckv input, kpe input, ckv cache, kpe cache): the two halves are
    # independent and may have different dtypes (not in one tensor)
    combos = [(F32, F32, F32, F32), (F32, F32, BF16, BF16), (BF16, BF16, F16, F16),
              (F16, F16, F32, F32)]
    if not one_tensor:
        combos += [(F32, BF16, F16, BF16), (BF16, F16, F32, F16)]
    for t1c, t1p, t2c, t2p in combos:
        batch = pr.mixed_batch(rng, page_size, n_req=5, max_prefill=20 if d_ckv > 64 else 90)
        ckv = ref.random_input(rng, (batch.nnz, d_ckv), t1c)
        kpe = ref.random_input(rng, (batch.nnz, d_kpe), t1p)
        t1, t2 = t1c, t2c
        if one_tensor:  # FlashInfer: slices of one (pages, page_size, D_ckv + D_kpe) tensor
            init = [ref.random_cache(rng, (batch.max_pages, page_size, d_ckv + d_kpe), t2)]

            def views(bs):
                return bs[0][..., :d_ckv], bs[0][..., d_ckv:]
        else:  # separate buffers, strided pages
            init = [ref.random_cache(rng, (2 * batch.max_pages, page_size, d_ckv), t2c),
                    ref.random_cache(rng, (batch.max_pages, page_size + 1, d_kpe + 3), t2p)]

            def views(bs):
                return bs[0][::2], bs[1][:, 1:, 3:]
        expect = [b.copy() for b in init]
        pr.append_paged_mla_kv_cache(ckv, kpe, batch.batch_indices, batch.positions,
                                     *views(expect), batch.kv_indices, batch.kv_indptr,
                                     page_size)
        for isa, nt in variants():
            got = [b.copy() for b in init]
            with using_isa(isa):
                kvcache.append_paged_mla_kv_cache(ckv, kpe, batch.batch_indices,
                                                  batch.positions, *views(got), *batch.table(),
                                                  n_threads=nt)
            assert_buffers(got, expect, f"MLA {NAMES[t1]}->{NAMES[t2]} isa={isa} threads={nt}")


def _mla_case(rng):
    batch = pr.mixed_batch(rng, 4, n_req=5)
    ckv_cache = ref.random_cache(rng, (batch.max_pages, 4, 16), F32)
    kpe_cache = ref.random_cache(rng, (batch.max_pages, 4, 8), F32)
    kw = {"append_ckv": ref.random_input(rng, (batch.nnz, 16), F32),
          "append_kpe": ref.random_input(rng, (batch.nnz, 8), F32),
          "batch_indices": batch.batch_indices.copy(), "positions": batch.positions.copy(),
          "ckv_cache": ckv_cache, "kpe_cache": kpe_cache,
          "kv_indices": batch.kv_indices.copy(), "kv_indptr": batch.kv_indptr.copy(),
          "kv_last_page_len": batch.kv_last_page_len.copy()}
    return batch, kw


MLA_BAD = {
    "ckv_dim": lambda b, kw: kw.update(append_ckv=kw["append_ckv"][:, :8]),
    "kpe_rows": lambda b, kw: kw.update(append_kpe=kw["append_kpe"][1:]),
    "cache_pages": lambda b, kw: kw.update(kpe_cache=kw["kpe_cache"][:-1]),
    "cache_page_size": lambda b, kw: kw.update(kpe_cache=kw["kpe_cache"][:, :3]),
    "cache_f64": lambda b, kw: kw.update(kpe_cache=kw["kpe_cache"].astype(np.float64)),
    "cache_int8": lambda b, kw: kw.update(ckv_cache=np.zeros(kw["ckv_cache"].shape, I8)),
    "input_f64": lambda b, kw: kw.update(append_ckv=kw["append_ckv"].astype(np.float64)),
    "page_id": lambda b, kw: kw["kv_indices"].__setitem__(0, b.max_pages),
    "position": lambda b, kw: kw["positions"].__setitem__(-1, b.seq_lens[-1] + 100),
    "batch_index": lambda b, kw: kw["batch_indices"].__setitem__(0, b.B),
    "last_page_len": lambda b, kw: kw["kv_last_page_len"].__setitem__(2, 5),
    "readonly": lambda b, kw: kw["ckv_cache"].setflags(write=False),
}


@pytest.mark.parametrize("case", list(MLA_BAD))
def test_append_mla_rejects(rng, case):
    batch, kw = _mla_case(rng)
    assert batch.seq_lens[2] > 0
    MLA_BAD[case](batch, kw)
    before = [kw["ckv_cache"].copy(), kw["kpe_cache"].copy()]
    with pytest.raises(kvcache.InvalidArgumentError, match=r"\S"):
        kvcache.append_paged_mla_kv_cache(**kw)
    assert_same_bytes(kw["ckv_cache"], before[0], "ckv_cache")
    assert_same_bytes(kw["kpe_cache"], before[1], "kpe_cache")


# ---------------------------------------------------------------------------
# Rejected appends: InvalidArgumentError, cache and scales unchanged


def _valid_case(rng, cache_kind, form="combined", layout="NHD"):
    """kwargs for a valid append_paged_kv_cache call (cache_kind: a float dtype,
    'int8' or 'int4'), plus the batch and the buffers to watch."""
    ps, heads, dh, group = 4, 2, 8, 4
    batch = pr.mixed_batch(rng, ps, n_req=6, max_prefill=9)
    assert batch.nnz > 3
    cdt = {"int8": I8, "int4": "int4"}.get(cache_kind, cache_kind)
    cache = cache_buffers(rng, form, layout, batch.max_pages, ps, heads, dh, cdt)
    bases = cache.copy()
    kw = {"append_key": ref.random_input(rng, (batch.nnz, heads, dh), F32),
          "append_value": ref.random_input(rng, (batch.nnz, heads, dh), F32),
          "batch_indices": batch.batch_indices.copy(), "positions": batch.positions.copy(),
          "paged_kv_cache": cache.views(bases)[0], "kv_indices": batch.kv_indices.copy(),
          "kv_indptr": batch.kv_indptr.copy(),
          "kv_last_page_len": batch.kv_last_page_len.copy(), "kv_layout": layout}
    if cache_kind in ("int8", "int4"):
        scale = scale_buffers(rng, form, layout, batch.max_pages, ps, heads, dh, group, F16)
        sbases = scale.copy()
        bases += sbases
        kw.update(kv_scale=scale.views(sbases)[0], quant_group=group)
    return batch, kw, bases


def _set(name, i, value):
    def f(b, kw):
        arr = kw[name]
        arr[i if i >= 0 else len(arr) + i] = value(b) if callable(value) else value
    return f


def _first_nonempty(b):
    return int(np.nonzero(b.seq_lens > 0)[0][0])


def _first_empty(b):
    return int(np.nonzero(b.seq_lens == 0)[0][0])


def _decreasing(b, kw):
    p = kw["kv_indptr"]
    i = int(np.nonzero(np.diff(p) > 0)[0][0]) + 1  # p[i] > p[i-1]
    p[i] = p[i - 1] - 1


def _last_len(value):
    def f(b, kw):
        kw["kv_last_page_len"][_first_nonempty(b)] = value(b)
    return f


def _empty_last_len(b, kw):
    kw["kv_last_page_len"][_first_empty(b)] = 1


def _position_at_seq_len(b, kw):
    j = int(np.nonzero(b.app_lens > 0)[0][0])
    row = int(b.append_indptr[j])
    kw["positions"][row] = b.seq_lens[j]


def _swap_cache(kind):
    def f(b, kw):
        c = kw["paged_kv_cache"]
        if isinstance(c, tuple):
            assert kind in ("v_dtype", "v_pages", "v_shape"), kind
            k, v = c
        else:
            k, v = c[:, 0], c[:, 1]
        if kind == "readonly":
            c.setflags(write=False)
        elif kind == "last_dim_strided":
            kw["paged_kv_cache"] = np.zeros(c.shape[:-1] + (2 * c.shape[-1],), c.dtype)[..., ::2]
        elif kind == "f64":
            kw["paged_kv_cache"] = np.zeros(c.shape, np.float64)
        elif kind == "two_axis_3":
            kw["paged_kv_cache"] = np.zeros((c.shape[0], 3) + c.shape[2:], c.dtype)
        elif kind == "rank4":
            kw["paged_kv_cache"] = k
        elif kind == "list":
            kw["paged_kv_cache"] = c.tolist()
        elif kind == "triple":
            kw["paged_kv_cache"] = (k, v, v)
        elif kind == "v_dtype":
            other = F32 if v.dtype != F32 else F16
            kw["paged_kv_cache"] = (k, np.zeros(v.shape, other))
        elif kind == "v_pages":
            kw["paged_kv_cache"] = (k, v[:-1])
        elif kind == "v_shape":
            kw["paged_kv_cache"] = (k, np.zeros(v.shape[:2] + (v.shape[2] + 1, v.shape[3]),
                                                v.dtype))
        elif kind == "dh":
            kw["paged_kv_cache"] = np.zeros(c.shape[:-1] + (c.shape[-1] * 2,), c.dtype)
        else:
            raise AssertionError(kind)
    return f


def _upd(**values):
    def f(b, kw):
        for k, v in values.items():
            kw[k] = v(b, kw) if callable(v) else v
    return f


FLOAT_BAD = {
    "indptr_start": _upd(kv_indptr=lambda b, kw: kw["kv_indptr"] + 1),
    "indptr_decreasing": _decreasing,
    "page_id_too_big": _set("kv_indices", 0, lambda b: b.max_pages),
    "page_id_negative": _set("kv_indices", -1, -1),
    "indices_short": _upd(kv_indices=lambda b, kw: kw["kv_indices"][:-1]),
    "last_len_zero": _last_len(lambda b: 0),
    "last_len_above_page": _last_len(lambda b: b.page_size + 1),
    "last_len_negative": _last_len(lambda b: -1),
    "empty_request_last_len": _empty_last_len,
    "last_len_shape": _upd(kv_last_page_len=lambda b, kw: np.append(kw["kv_last_page_len"], 1)),
    "batch_index_B": _set("batch_indices", 1, lambda b: b.B),
    "batch_index_negative": _set("batch_indices", -1, -1),
    "position_negative": _set("positions", -1, -1),
    "position_seq_len": _position_at_seq_len,
    "position_huge": _set("positions", 0, 2**31 - 1),
    "position_beyond_int32": _upd(positions=lambda b, kw: kw["positions"].astype(np.int64)
                                  + 2**32),
    "position_float": _upd(positions=lambda b, kw: kw["positions"].astype(np.float32)),
    "batch_indices_short": _upd(batch_indices=lambda b, kw: kw["batch_indices"][:-1]),
    "positions_long": _upd(positions=lambda b, kw: np.append(kw["positions"], 0)),
    "key_heads": _upd(append_key=lambda b, kw: kw["append_key"][:, :1]),
    "key_dh": _upd(append_key=lambda b, kw: kw["append_key"][..., :4]),
    "key_rank": _upd(append_key=lambda b, kw: kw["append_key"].reshape(b.nnz, -1)),
    "value_rows": _upd(append_value=lambda b, kw: kw["append_value"][1:]),
    "key_f64": _upd(append_key=lambda b, kw: kw["append_key"].astype(np.float64)),
    "key_int32": _upd(append_key=lambda b, kw: kw["append_key"].astype(np.int32)),
    "cache_readonly": _swap_cache("readonly"),
    "cache_last_dim_strided": _swap_cache("last_dim_strided"),
    "cache_f64": _swap_cache("f64"),
    "cache_two_axis_3": _swap_cache("two_axis_3"),
    "cache_rank4": _swap_cache("rank4"),
    "cache_list": _swap_cache("list"),
    "cache_triple": _swap_cache("triple"),
    "cache_v_dtype": _swap_cache("v_dtype"),
    "cache_v_pages": _swap_cache("v_pages"),
    "cache_v_shape": _swap_cache("v_shape"),
    "cache_dh": _swap_cache("dh"),
    "layout_name": _upd(kv_layout="NDH"),
    "scale_for_float": _upd(kv_scale=lambda b, kw: np.zeros(
        kw["paged_kv_cache"].shape[:-1] + (1,), F32)),
    "n_threads_0": _upd(n_threads=0),
}


@pytest.mark.parametrize("case", list(FLOAT_BAD))
def test_append_rejects_float_cache(rng, case):
    _check_rejected(rng, F16, case, FLOAT_BAD[case])


def _scale_swap(kind):
    def f(b, kw):
        s = kw["kv_scale"]
        if kind == "missing":
            del kw["kv_scale"]
        elif kind == "last_dim":
            kw["kv_scale"] = np.zeros(s.shape[:-1] + (s.shape[-1] + 1,), s.dtype)
        elif kind == "pages":
            kw["kv_scale"] = s[:-1]
        elif kind == "bf16":
            kw["kv_scale"] = np.zeros(s.shape, BF16)
        elif kind == "f64":
            kw["kv_scale"] = np.zeros(s.shape, np.float64)
        elif kind == "pair":
            kw["kv_scale"] = (s[:, 0], s[:, 1])
        elif kind == "readonly":
            s.setflags(write=False)
    return f


def _nan_row(value, where):
    def f(b, kw):
        x = kw["append_value" if where == "value" else "append_key"]
        x[-1, -1, -1] = value  # the last row: nothing before it may be written either
    return f


QUANT_BAD = {
    "scale_missing": _scale_swap("missing"),
    "scale_last_dim": _scale_swap("last_dim"),
    "scale_pages": _scale_swap("pages"),
    "scale_bf16": _scale_swap("bf16"),
    "scale_f64": _scale_swap("f64"),
    "scale_pair_for_combined": _scale_swap("pair"),
    "scale_readonly": _scale_swap("readonly"),
    "nan_key": _nan_row(np.nan, "key"),
    "inf_value": _nan_row(np.inf, "value"),
    "neg_inf_key": _nan_row(-np.inf, "key"),
    "group_not_dividing": _upd(quant_group=3),
    "group_zero": _upd(quant_group=0),
    "group_too_big": _upd(quant_group=16),
    "page_id_too_big": FLOAT_BAD["page_id_too_big"],
    "position_seq_len": _position_at_seq_len,
    "last_len_above_page": FLOAT_BAD["last_len_above_page"],
}


@pytest.mark.parametrize("case", list(QUANT_BAD))
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_append_rejects_quantized_cache(rng, kind, case):
    _check_rejected(rng, kind, case, QUANT_BAD[case])


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_append_rejects_odd_group_for_int4_and_split_scale_mismatch(rng, kind):
    if kind == "int4":
        _check_rejected(rng, kind, "odd group", _upd(quant_group=1))
    _check_rejected(rng, kind, "combined scale for a pair",
                    lambda b, kw: kw.update(kv_scale=kw["kv_scale"][0]), form="split")
    _check_rejected(rng, kind, "missing scale (pair)", lambda b, kw: kw.pop("kv_scale"),
                    form="split_distinct", layout="HND")
    _check_rejected(rng, kind, "nan (pair)", _nan_row(np.nan, "value"), form="split_strided")


@pytest.mark.parametrize("case", ["page_id_too_big", "position_seq_len", "last_len_zero",
                                  "batch_index_B", "cache_v_pages", "cache_v_dtype",
                                  "cache_v_shape"])
def test_append_rejects_split_hnd(rng, case):
    _check_rejected(rng, BF16, case, FLOAT_BAD[case], form="split_distinct", layout="HND")


def _check_rejected(rng, kind, case, mutate, form="combined", layout="NHD"):
    batch, kw, bases = _valid_case(rng, kind, form, layout)
    before = [b.copy() for b in bases]
    mutate(batch, kw)
    with pytest.raises(kvcache.InvalidArgumentError, match=r"\S") as info:
        kvcache.append_paged_kv_cache(**kw)
    assert len(str(info.value)) > 10, f"{case}: message too short: {info.value!r}"
    for i, (a, e) in enumerate(zip(bases, before, strict=True)):
        assert_same_bytes(a, e, f"{case}: buffer {i} changed by a rejected call")


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("t1", FLOATS, ids=NAMES.get)
def test_append_rejects_non_finite_anywhere(rng, kind, t1):
    """NaN/Inf in any row (first, chunk edges at 63/64, last) and any element
    (vector bodies and tails, Dh = 40) of K or V: rejected on every ISA and
    thread count, nothing written."""
    heads, dh, group, ps = 2, 40, 8, 16
    batch = pr.Batch(rng, ps, [0, 5, 0, 30], [0, 100, 1, 60])
    cdt = I8 if kind == "int8" else "int4"
    cache = cache_buffers(rng, "combined", "HND", batch.max_pages, ps, heads, dh, cdt)
    scale = scale_buffers(rng, "combined", "HND", batch.max_pages, ps, heads, dh, group, F32)
    key = ref.random_input(rng, (batch.nnz, heads, dh), t1)
    value = ref.random_input(rng, (batch.nnz, heads, dh), t1)
    cases = [(0, 0, 0), (63, 1, 39), (64, 0, 17), (batch.nnz - 1, 1, 39), (100, 1, 32)]
    for n, (row, h, e) in enumerate(cases):
        bad = np.array([np.nan, np.inf, -np.inf][n % 3], F32).astype(t1)
        x = (key if n % 2 else value).copy()
        x[row, h, e] = bad
        k, v = (x, value) if n % 2 else (key, x)
        for isa, nt in variants():
            c, sc = cache.copy(), scale.copy()
            with using_isa(isa), pytest.raises(kvcache.InvalidArgumentError, match=r"\S"):
                kvcache.append_paged_kv_cache(k, v, batch.batch_indices, batch.positions,
                                              c[0], *batch.table(), kv_layout="HND",
                                              kv_scale=sc[0], quant_group=group, n_threads=nt)
            assert_buffers(c, cache.bases, f"cache after {bad} at {(row, h, e)} {isa}/{nt}")
            assert_buffers(sc, scale.bases, f"scale after {bad} at {(row, h, e)} {isa}/{nt}")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_append_rejects_float16_scale_overflow(rng, kind):
    """A value whose group's float16 scale would round to +inf (|x| >= 65520 *
    qmax) is refused like NaN, nothing written, on every ISA; float32 scales
    store it."""
    heads, dh, group, ps = 2, 40, 8, 16
    batch = pr.Batch(rng, ps, [0, 5], [0, 70])
    cdt = I8 if kind == "int8" else "int4"
    key = ref.random_input(rng, (batch.nnz, heads, dh), F32)
    value = ref.random_input(rng, (batch.nnz, heads, dh), F32)
    value[64, 1, 33] = -1e7
    for sdt in (F16, F32):
        cache = cache_buffers(rng, "combined", "NHD", batch.max_pages, ps, heads, dh, cdt)
        scale = scale_buffers(rng, "combined", "NHD", batch.max_pages, ps, heads, dh, group, sdt)
        for isa, nt in variants():
            c, sc = cache.copy(), scale.copy()
            args = (key, value, batch.batch_indices, batch.positions, c[0], *batch.table())
            kw = dict(kv_layout="NHD", kv_scale=sc[0], quant_group=group, n_threads=nt)
            with using_isa(isa):
                if sdt == F32:
                    kvcache.append_paged_kv_cache(*args, **kw)
                    continue
                with pytest.raises(kvcache.InvalidArgumentError,
                                   match=r"append_value \(row 64, head 1\).*float16 scale"):
                    kvcache.append_paged_kv_cache(*args, **kw)
            assert_buffers(c, cache.bases, f"cache after a refused append {isa}/{nt}")
            assert_buffers(sc, scale.bases, f"scale after a refused append {isa}/{nt}")


def test_missing_c_function_raises_unsupported():
    fn = kvcache._lib.optional_proto("kvc_no_such_function_for_tests", None)
    with pytest.raises(kvcache.UnsupportedError, match="kvc_no_such_function_for_tests"):
        fn()


def test_rejected_message_is_readable(rng):
    batch, kw, _ = _valid_case(rng, F32)
    kw["kv_indices"][0] = batch.max_pages
    with pytest.raises(kvcache.InvalidArgumentError) as info:
        kvcache.append_paged_kv_cache(**kw)
    assert "kv_indices" in str(info.value) or "page" in str(info.value), str(info.value)
    batch, kw, _ = _valid_case(rng, "int8")
    del kw["kv_scale"]
    with pytest.raises(kvcache.InvalidArgumentError, match="kv_scale"):
        kvcache.append_paged_kv_cache(**kw)


# ---------------------------------------------------------------------------
# pmx page-mode tables


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_page_table_pmx_round_trip(rng, page_size):
    for n_req in (1, 4, 9):
        batch = pr.mixed_batch(rng, page_size, n_req=n_req)
        pages = np.diff(batch.kv_indptr)
        max_p = max(1, int(pages.max()))
        cst = kvcache.page_table_to_pmx(batch.kv_indptr, batch.kv_indices, page_size)
        assert cst.dtype == np.int64
        assert_same_bytes(cst, pr.page_table_to_pmx(batch.kv_indptr, batch.kv_indices,
                                                    page_size, max_p))
        wide = kvcache.page_table_to_pmx(batch.kv_indptr, batch.kv_indices, page_size,
                                         max_pages_per_seq=max_p + 3)
        assert_same_bytes(wide, pr.page_table_to_pmx(batch.kv_indptr, batch.kv_indices,
                                                     page_size, max_p + 3))
        for table in (cst, wide):
            indptr, indices, last = kvcache.pmx_to_page_table(table, batch.seq_lens, page_size)
            assert_same_bytes(indptr, batch.kv_indptr, "kv_indptr")
            assert_same_bytes(indices, batch.kv_indices, "kv_indices")
            assert_same_bytes(last, batch.kv_last_page_len, "kv_last_page_len")
        # int64 seq_lens, and entries after the used ones are ignored
        junk = wide.copy()
        for b in range(batch.B):
            junk[b, pages[b]:] = 7
        indptr, indices, last = kvcache.pmx_to_page_table(junk, batch.seq_lens.astype(np.int64),
                                                          page_size)
        assert_same_bytes(indices, batch.kv_indices, "kv_indices (junk after)")


def test_page_table_pmx_edge_cases():
    assert kvcache.page_table_to_pmx([0], [], 4).shape == (0, 1)
    assert kvcache.page_table_to_pmx([0, 0, 0], [], 4).tolist() == [[-1], [-1]]
    assert kvcache.page_table_to_pmx([0, 0], [], 4, max_pages_per_seq=0).shape == (1, 0)
    indptr, indices, last = kvcache.pmx_to_page_table([[-1], [8]], [0, 3], 4)
    assert indptr.tolist() == [0, 0, 1] and indices.tolist() == [2] and last.tolist() == [0, 3]
    assert all(a.dtype == np.int32 for a in (indptr, indices, last))


@pytest.mark.parametrize("fn, args", [
    ("to", ([0, 3], [1, 2, 3], 4, 2)),        # max_pages_per_seq too small
    ("to", ([1, 3], [1, 2, 3], 4, None)),     # indptr[0] != 0
    ("to", ([0, 2, 1], [1, 2], 4, None)),     # decreasing
    ("to", ([0, 3], [1, 2], 4, None)),        # indices shorter than indptr[B]
    ("to", ([0, 1], [-1], 4, None)),          # negative page id
    ("to", ([0, 1], [1], 0, None)),           # page_size 0
    ("to", ([0, 1], [1.0], 4, None)),         # non-integer
    ("from", ([[4, 6]], [6], 4)),             # not a multiple of page_size
    ("from", ([[-4, 8]], [6], 4)),            # negative entry in use
    ("from", ([[-1, 8]], [6], 4)),            # -1 in use
    ("from", ([[4]], [6], 4)),                # needs 2 pages, MaxP 1
    ("from", ([[4]], [-1], 4)),               # negative seq_len
    ("from", ([[4], [8]], [1], 4)),           # shape mismatch
    ("from", ([[4]], [1], 0)),                # page_size 0
])
def test_page_table_pmx_rejects(fn, args):
    with pytest.raises(kvcache.InvalidArgumentError, match=r"\S"):
        if fn == "to":
            kvcache.page_table_to_pmx(*args[:3], max_pages_per_seq=args[3])
        else:
            kvcache.pmx_to_page_table(*args)


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("t2", [F32, F16, BF16], ids=NAMES.get)
def test_end_to_end_append_then_pmx_read(rng, page_size, t2):
    """append_paged_kv_cache into NHD K/V back to back in one buffer, then
    read every request through pmx.dynamic_key_value_cache (cache_mode 1,
    cache_layout 2, L = 1) with cachestarts from page_table_to_pmx and no new
    tokens: the outputs are the stored rows, appended ones included."""
    heads, dh = 2, 16
    batch = pr.mixed_batch(rng, page_size, n_req=7, max_prefill=30)
    m = batch.max_pages
    buf = ref.random_cache(rng, (2, m, page_size, heads, dh), t2)
    key = ref.random_input(rng, (batch.nnz, heads, dh), F32)
    value = ref.random_input(rng, (batch.nnz, heads, dh), F32)
    bi, pos = kvcache.get_batch_indices_positions(batch.append_indptr, batch.seq_lens, batch.nnz)
    kvcache.append_paged_kv_cache(key, value, bi, pos, (buf[0], buf[1]), *batch.table())

    cst = kvcache.page_table_to_pmx(batch.kv_indptr, batch.kv_indices, page_size)
    lens = batch.seq_lens.astype(np.int64)
    kvstarts = np.concatenate([[0], np.cumsum(lens)])
    none = np.zeros((0, heads, dh), t2)
    k_out, v_out = kvcache.pmx.dynamic_key_value_cache(
        none, none, np.zeros(batch.B + 1, np.int64), kvstarts, cst, lens, 0,
        int(lens.max()), buf.reshape(1, 2, m * page_size, heads, dh), num_layer=1,
        cache_mode=1, cache_layout=2, page_size=page_size)
    assert k_out.shape == (int(kvstarts[-1]), heads, dh)
    # every position through the page table ...
    exp_k = np.empty_like(k_out)
    exp_v = np.empty_like(v_out)
    for b in range(batch.B):
        for t in range(int(lens[b])):
            page, slot = pr.page_and_slot(batch.kv_indices, batch.kv_indptr, page_size, b, t)
            exp_k[kvstarts[b] + t] = buf[0, page, slot]
            exp_v[kvstarts[b] + t] = buf[1, page, slot]
    assert_same_bytes(k_out, exp_k, "K read back")
    assert_same_bytes(v_out, exp_v, "V read back")
    # ... and the appended positions hold exactly the appended rows
    rows = kvstarts[bi] + pos
    assert_same_bytes(k_out[rows], key.astype(t2), "appended K")
    assert_same_bytes(v_out[rows], value.astype(t2), "appended V")
