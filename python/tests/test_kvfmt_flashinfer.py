"""The compressed formats through the FlashInfer-style entry points:
append_paged_kv_cache(kv_format=...) and BatchDecodeWithPagedKVCacheWrapper
with kv_data_type="kivi8"/"kivi4", over a (pages, tails) pair (kivi8) or a
(pages, tails, sinks) triple (kivi4, position 0 in float16). Checked
against the format's own API (kvcache.kvfmt, itself checked byte for byte
against the numpy reference in test_kvfmt.py) and the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
import kvfmt_reference as R
from kvcache import KVFormat, kvfmt
from kvcache.attention import BatchDecodeWithPagedKVCacheWrapper
from kvcache.paged import append_paged_kv_cache, get_batch_indices_positions

IA = kvcache.InvalidArgumentError


def _table(lens, P, rng):
    """CSR page table with shuffled page ids for requests of lens tokens."""
    n_pages = [-(-n // P) for n in lens]
    ids = rng.permutation(sum(n_pages) + 2).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(n_pages)]).astype(np.int32)
    last = np.array([n - P * (k - 1) for n, k in zip(lens, n_pages)], np.int32)
    return indptr, ids[:indptr[-1]].copy(), last, int(ids.size)


@pytest.mark.parametrize("name,H,Dh,P,grp", [("kivi8", 2, 64, 16, 3), ("kivi4", 3, 64, 32, 2),
                                             ("kivi4", 1, 128, 64, 4)])
def test_append_and_decode_wrapper(name, H, Dh, P, grp):
    rng = np.random.default_rng(21)
    fmt = KVFormat.member(name, H, Dh, P)
    steps = [[70, 5, 130], [1, 64, 2], [1, 1, 1]]  # rows per request per step
    lens = [sum(s[b] for s in steps) for b in range(3)]
    indptr, indices, _, n_pages = _table(lens, P, rng)
    pages = fmt.new_pages(n_pages)
    tails = np.zeros((3,) + fmt.tail_shape, np.float16)
    ref_pages = fmt.new_pages(n_pages)
    ref_tails = np.zeros_like(tails)
    sinks = np.zeros((3,) + fmt.sink_shape, np.float16)
    ref_sinks = np.zeros_like(sinks)
    cache = (pages, tails, sinks) if fmt.sink else (pages, tails)
    if fmt.sink:  # kivi4 without its sink rows: refused, nothing written
        with pytest.raises(IA, match="triple"):
            append_paged_kv_cache(np.zeros((70, H, Dh), np.float32),
                                  np.zeros((70, H, Dh), np.float32), np.zeros(70, np.int32),
                                  np.arange(70, dtype=np.int32), (pages, tails),
                                  indices[:-(-70 // P)], np.array([0, -(-70 // P)], np.int32),
                                  np.array([70 - P * (-(-70 // P) - 1)], np.int32),
                                  kv_format=name)
        assert not pages.any() and not tails.any()
    rseqs = [R.Sequence(R.member(name, H, Dh, P)) for _ in range(3)]
    done = [0, 0, 0]
    for step in steps:
        k = [rng.standard_normal((c, H, Dh)).astype(np.float32) * 2 + 1 for c in step]
        v = [rng.standard_normal((c, H, Dh)).astype(np.float32) for c in step]
        done = [d + c for d, c in zip(done, step)]
        # the page table as of this step: each request's pages so far
        cur = [-(-d // P) for d in done]
        ip = np.concatenate([[0], np.cumsum(cur)]).astype(np.int32)
        ix = np.concatenate([indices[indptr[b]:indptr[b] + cur[b]] for b in range(3)])
        last = np.array([d - P * (c - 1) for d, c in zip(done, cur)], np.int32)
        app = np.concatenate([[0], np.cumsum(step)]).astype(np.int32)
        seq_lens = np.array(done, np.int32)
        bi, pos = get_batch_indices_positions(app, seq_lens, int(app[-1]))
        append_paged_kv_cache(np.concatenate(k), np.concatenate(v), bi, pos, cache,
                              ix, ip, last, kv_format=name)
        seqs = [kvfmt.KVSeq(ix[ip[b]:ip[b + 1]], done[b], ref_tails[b],
                            ref_sinks[b] if fmt.sink else None) for b in range(3)]
        kvfmt.append(fmt, ref_pages, seqs, app, np.concatenate(k), np.concatenate(v))
        assert np.array_equal(pages, ref_pages) and np.array_equal(tails, ref_tails)
        assert np.array_equal(sinks, ref_sinks)
        for b in range(3):
            rseqs[b].append(k[b], v[b])
        # decode: each request's query at its last position
        w = BatchDecodeWithPagedKVCacheWrapper(num_threads=2)
        w.plan(ip, ix, last, H * grp, H, Dh, P, kv_data_type=name)
        q = rng.standard_normal((3, H * grp, Dh)).astype(np.float32)
        o, lse = w.run(q, cache, return_lse=True)
        if fmt.sink:
            with pytest.raises(IA, match="triple"):
                w.run(q, (pages, tails))
        o2, lse2 = kvfmt.attention(fmt, pages, seqs, q, [0, 1, 2], [d - 1 for d in done],
                                   return_lse=True, num_threads=2)
        assert np.array_equal(o, o2) and np.array_equal(lse, lse2)
        # FlashInfer's deprecated forward(): the same, and its sm_scale replaces the plan's
        assert np.array_equal(w.forward(q, cache), o)
        o3 = w.forward(q, cache, sm_scale=0.5)
        assert np.array_equal(o3, kvfmt.attention(fmt, pages, seqs, q, [0, 1, 2],
                                                  [d - 1 for d in done], 0.5, num_threads=2))
        with pytest.raises(IA, match="not supported"):
            w.forward(q, cache, logits_soft_cap=30.0)
        w.plan(ip, ix, last, H * grp, H, Dh, P, kv_data_type=name)
        vmax = max(float(np.abs(x).max()) for x in v) + 4
        for b in range(3):
            kk, vv = R.values_at(rseqs[b].fmt, rseqs[b], done[b] - 1)
            for g in range(H * grp):
                s = kk[:, g // grp, :] @ q[b, g].astype(np.float64) / np.sqrt(Dh)
                p = np.exp(s - s.max())
                ref = (p / p.sum()) @ vv[:, g // grp, :]
                if fmt.rotate_v:
                    ref = ref @ R.hadamard(Dh).T
                np.testing.assert_allclose(o[b, g] / vmax, ref / vmax, rtol=1e-3, atol=1e-3)


def test_append_refuses_what_a_compressed_cache_cannot_take():
    rng = np.random.default_rng(3)
    fmt = KVFormat.member("kivi8", 1, 64, 16)
    pages = fmt.new_pages(8)
    tails = np.zeros((1,) + fmt.tail_shape, np.float16)
    ip, ix, last = np.array([0, 2], np.int32), np.array([3, 5], np.int32), np.array([4], np.int32)
    k = rng.standard_normal((20, 1, 64)).astype(np.float32)
    before = pages.copy(), tails.copy()
    with pytest.raises(IA, match="kv_format"):  # which format the pair holds
        append_paged_kv_cache(k, k, np.zeros(20, np.int32), np.arange(20, dtype=np.int32),
                              (pages, tails), ix, ip, last)
    pos = np.arange(20, dtype=np.int32)[::-1].copy()  # not in order
    with pytest.raises(IA, match="in order"):
        append_paged_kv_cache(k, k, np.zeros(20, np.int32), pos, (pages, tails), ix, ip, last,
                              kv_format="kivi8")
    with pytest.raises(IA, match="last positions"):  # not the request's last positions
        append_paged_kv_cache(k[:5], k[:5], np.zeros(5, np.int32),
                              np.arange(5, dtype=np.int32), (pages, tails), ix, ip, last,
                              kv_format="kivi8")
    assert np.array_equal(pages, before[0]) and np.array_equal(tails, before[1])
    w = BatchDecodeWithPagedKVCacheWrapper()
    with pytest.raises(IA, match="not supported"):
        w.plan(ip, ix, last, 2, 1, 64, 16, kv_data_type="kivi8", logits_soft_cap=30.0)
    w.plan(ip, ix, last, 2, 1, 64, 16, kv_data_type="kivi8")
    with pytest.raises(IA, match="pages, tails"):
        w.run(np.zeros((1, 2, 64), np.float32), pages)
    with pytest.raises(IA, match="pair"):  # kivi8 keeps no sink rows
        w.run(np.zeros((1, 2, 64), np.float32),
              (pages, tails, np.zeros((1, 2, 1, 1, 64), np.float16)))
