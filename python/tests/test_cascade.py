"""MultiLevelCascadeAttentionWrapper (kvcache.cascade) against the float64
reference of attn_reference.py (SEMANTICS section 5: one softmax over the
union of the keys each level shows a query row, causal on the last level
only), and against a plain prefill over the concatenated pages.

Scenario: one paged cache holding "segments" (a shared prefix, group
prefixes, each request's own tokens); level 0 maps every query row to the
shared prefix, a middle level maps groups of requests to their group prefix,
the last level maps each request to its own pages.
"""

from __future__ import annotations

import numpy as np
import pytest

import attn_reference as ar
import kvcache
import kvc_reference as ref
from attn_reference import BF16, F16, F32, assert_close, f64, lse_tol, out_tol


def _available() -> str | None:
    try:
        kvcache.MultiLevelCascadeAttentionWrapper(1).plan(
            [[0, 1]], [[0, 1]], [[0]], [[1]], 1, 1, 8, 1)
    except kvcache.UnsupportedError as exc:
        return str(exc)
    except kvcache.KvcacheError:
        return None
    return None


_WHY = _available()
needs_cascade = pytest.mark.skipif(_WHY is not None, reason=f"cascade not in the library: {_WHY}")


class Scenario:
    """Segments in one paged cache and the per-level page tables.

    qo: query rows of each request; unique: own tokens of each request;
    groups: list of lists of request indices sharing a group prefix (None
    for no middle level); prefix_len, group_len: tokens of the shared prefix
    and of each group prefix."""

    def __init__(self, rng, *, qo, unique, prefix_len, groups=None, group_len=0, page_size=16,
                 heads=2, dh=64, storage="f16", layout="NHD", combined=True):
        self.qo, self.unique = list(qo), list(unique)
        self.B = len(qo)
        self.groups = groups
        segs = [prefix_len]
        if groups is not None:
            segs += [group_len] * len(groups)
        segs += self.unique
        self.pg = ar.Paged(rng, segs, page_size, heads, dh, storage, layout, combined)
        self.page_size = page_size
        self.qo_indptr = ar.indptr_of(qo)
        self.nnz = int(self.qo_indptr[-1])
        n_groups = 0 if groups is None else len(groups)
        self.levels = []  # (qo_indptr, segment ids per request)
        self.levels.append((np.array([0, self.nnz], np.int32), [0]))
        if groups is not None:
            order = [r for g in groups for r in g]
            assert order == list(range(self.B)), "groups must be consecutive requests"
            g_qo = ar.indptr_of([sum(qo[r] for r in g) for g in groups])
            self.levels.append((g_qo, [1 + i for i in range(n_groups)]))
        self.levels.append((self.qo_indptr, [1 + n_groups + b for b in range(self.B)]))
        self.seg_of_request = []  # segments whose keys request b sees, in order
        for b in range(self.B):
            segs_b = [0]
            if groups is not None:
                segs_b.append(1 + next(i for i, g in enumerate(groups) if b in g))
            segs_b.append(1 + n_groups + b)
            self.seg_of_request.append(segs_b)

    def seg_pages(self, s):
        pg = self.pg
        return pg.indices[pg.indptr[s]:pg.indptr[s + 1]], int(pg.last[s])

    def tables(self):
        """(qo_indptr_arr, kv_indptr_arr, kv_indices_arr, last_page_len_arr)."""
        out = ([], [], [], [])
        for qo_indptr, segs in self.levels:
            ids = [self.seg_pages(s) for s in segs]
            out[0].append(qo_indptr)
            out[1].append(ar.indptr_of([len(i) for i, _ in ids]))
            out[2].append(np.concatenate([i for i, _ in ids]).astype(np.int32))
            out[3].append(np.array([last for _, last in ids], np.int32))
        return out

    def ref_levels(self):
        return [(qo_indptr, [self.pg.kv[s] for s in segs]) for qo_indptr, segs in self.levels]

    def flat_table(self):
        """Each request's pages concatenated over its segments (valid when
        every segment but the last is made of full pages)."""
        indptr, indices, last = [0], [], []
        for segs in self.seg_of_request:
            for s in segs[:-1]:
                ids, ln = self.seg_pages(s)
                assert ln in (0, self.page_size)
                indices.extend(ids)
            ids, ln = self.seg_pages(segs[-1])
            indices.extend(ids)
            indptr.append(len(indices))
            last.append(ln if len(ids) else 0)
        return (np.array(indptr, np.int32), np.array(indices, np.int32),
                np.array(last, np.int32))

    def request_stored(self, b):
        """Request b's stored K/V (and scales) over all its segments, NHD."""
        parts = [self.pg.stored_request(s) for s in self.seg_of_request[b]]
        cat = [None if parts[0][i] is None else np.concatenate([p[i] for p in parts])
               for i in range(4)]
        return cat


def run_cascade(sc, q, hq, *, causal, num_threads=2, **params):
    w = kvcache.MultiLevelCascadeAttentionWrapper(len(sc.levels), None, sc.pg.layout,
                                                  num_threads=num_threads)
    w.plan(*sc.tables(), hq, sc.pg.heads, sc.pg.dh, sc.page_size, causal=causal, **params)
    return w, w.run(q, sc.pg.cache, kv_scale=sc.pg.scale, return_lse=True)


CASES = [
    dict(storage="f16", layout="NHD", ps=16, three=False, q=F16, group=4, dh=128,
         combined=True),
    dict(storage="int8", layout="HND", ps=5, three=True, q=F32, group=1, dh=64,
         combined=False),
    dict(storage="int4", layout="NHD", ps=1, three=True, q=BF16, group=8, dh=64,
         combined=True),
    dict(storage="bf16", layout="HND", ps=16, three=False, q=F32, group=8, dh=64,
         combined=False),
    dict(storage="f32", layout="NHD", ps=5, three=True, q=F32, group=4, dh=128,
         combined=True),
]


def make_scenario(rng, c, full_pages=True):
    ps = c["ps"]
    h = 1 if c["group"] == 8 else 2
    prefix = 3 * ps if full_pages else 3 * ps - 2
    kw = dict(qo=[17, 1, 5, 0, 9], unique=[54, 7, 5, 3, 20], prefix_len=prefix, page_size=ps,
              heads=h, dh=c["dh"], storage=c["storage"], layout=c["layout"],
              combined=c["combined"])
    if c["three"]:
        kw.update(groups=[[0, 1], [2, 3, 4]], group_len=2 * ps if full_pages else ps + 3)
    return Scenario(rng, **kw), c["group"] * h


def case_id(c):
    return (f"{c['storage']}-{c['layout']}-ps{c['ps']}-{'3' if c['three'] else '2'}lvl-"
            f"{ar.DT_NAMES[np.dtype(c['q'])]}-g{c['group']}-d{c['dh']}")


@needs_cascade
@pytest.mark.parametrize("c", CASES, ids=[case_id(c) for c in CASES])
def test_cascade_vs_reference_and_flat_prefill(isa, rng, c):
    sc, hq = make_scenario(rng, c)
    q = ar.random_q(rng, (sc.nnz, hq, c["dh"]), c["q"], mag=2.0)
    for causal in (True, False):
        _w, (o, lse) = run_cascade(sc, q, hq, causal=causal)
        assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == (sc.nnz, hq)
        want_o, want_lse = ar.cascade(f64(q), sc.ref_levels(), causal=causal)
        what = f"{case_id(c)} causal={causal}"
        assert_close(o, want_o, out_tol(q.dtype), "o " + what)
        assert_close(lse, want_lse, lse_tol(q.dtype), "lse " + what)
        # the same as one prefill over each request's full pages (qo <= unique
        # keeps every prefix key visible to every row with causal)
        wb = kvcache.BatchPrefillWithPagedKVCacheWrapper(kv_layout=sc.pg.layout)
        wb.plan(sc.qo_indptr, *sc.flat_table(), hq, sc.pg.heads, c["dh"], sc.page_size,
                causal=causal)
        ob, lb = wb.run(q, sc.pg.cache, kv_scale=sc.pg.scale, return_lse=True)
        assert_close(o, f64(ob), out_tol(q.dtype), "o vs batch prefill " + what)
        assert_close(lse, f64(lb), lse_tol(q.dtype), "lse vs batch prefill " + what)
        # and per request, a single prefill over the concatenated K/V
        for b in range(sc.B):
            lo, hi = int(sc.qo_indptr[b]), int(sc.qo_indptr[b + 1])
            k, v, ks, vs = sc.request_stored(b)
            os_, ls_ = kvcache.single_prefill_with_kv_cache(q[lo:hi], k, v, causal=causal,
                                                            k_scale=ks, v_scale=vs,
                                                            return_lse=True)
            assert_close(o[lo:hi], f64(os_), out_tol(q.dtype), f"o vs single {what} req {b}")
            assert_close(lse[lo:hi], f64(ls_), lse_tol(q.dtype), f"lse vs single {what} {b}")


@needs_cascade
def test_cascade_partial_pages_params_and_threads(rng):
    """Prefix segments ending in partial pages, a request with no own keys
    (its causal last level is empty for every row), window / soft cap /
    sm_scale on every level, and bitwise-equal results for 1 and 2 threads."""
    c = dict(storage="f16", layout="HND", ps=5, three=True, q=F32, group=4, dh=64,
             combined=True)
    sc, hq = make_scenario(rng, c, full_pages=False)
    sc2 = Scenario(rng, qo=[4, 3, 0, 2], unique=[0, 9, 2, 11], prefix_len=7, groups=[[0, 1],
                   [2, 3]], group_len=6, page_size=5, heads=2, dh=64, storage="int8",
                   layout="NHD")
    for scen in (sc, sc2):
        q = ar.random_q(rng, (scen.nnz, hq, 64), F32, mag=2.0)
        for params in ({}, {"window_left": 4}, {"logits_soft_cap": 2.0, "sm_scale": 0.2},
                       {"window_left": 0, "logits_soft_cap": 5.0}):
            outs = []
            for nt in (1, 2):
                _w, (o, lse) = run_cascade(scen, q, hq, causal=True, num_threads=nt, **params)
                outs.append((o, lse))
            ref.assert_same_bytes(outs[1][0], outs[0][0], f"o 1 vs 2 threads {params}")
            ref.assert_same_bytes(outs[1][1], outs[0][1], f"lse 1 vs 2 threads {params}")
            want_o, want_lse = ar.cascade(
                f64(q), scen.ref_levels(), causal=True,
                window_left=params.get("window_left", -1), sm_scale=params.get("sm_scale"),
                cap=params.get("logits_soft_cap"))
            assert_close(outs[0][0], want_o, 1e-5, f"o {params}")
            assert_close(outs[0][1], want_lse, 1e-5, f"lse {params}")


@needs_cascade
def test_cascade_one_level_is_batch_prefill(rng):
    pg = ar.Paged(rng, [54, 0, 7], 16, 2, 64, "bf16", "NHD", True)
    qo_indptr = ar.indptr_of([17, 3, 7])
    q = ar.random_q(rng, (27, 8, 64), F16)
    w = kvcache.MultiLevelCascadeAttentionWrapper(1, kv_layout="NHD")
    w.plan([qo_indptr], [pg.indptr], [pg.indices], [pg.last], 8, 2, 64, 16, causal=True)
    o, lse = w.run(q, pg.cache, return_lse=True)
    want_o, want_lse = ar.batch_prefill(f64(q), pg.kv, qo_indptr, causal=True)
    assert_close(o, want_o, 1e-3, "o")
    assert_close(lse, want_lse, 1e-3, "lse")
    assert np.all(o[17:20] == 0) and np.all(np.isneginf(lse[17:20]))
    o2 = w.run(q, pg.cache)
    ref.assert_same_bytes(o2, o, "o without lse")
    # FlashInfer's deprecated begin_forward / end_forward names
    w2 = kvcache.MultiLevelCascadeAttentionWrapper(1, kv_layout="NHD")
    w2.begin_forward([qo_indptr], [pg.indptr], [pg.indices], [pg.last], 8, 2, 64, 16,
                     causal=True)
    ref.assert_same_bytes(w2.run(q, pg.cache), o, "o after begin_forward")
    w2.end_forward()


@needs_cascade
def test_cascade_errors(rng):
    E = kvcache.InvalidArgumentError
    c = dict(storage="int8", layout="NHD", ps=5, three=True, q=F32, group=4, dh=64,
             combined=True)
    sc, hq = make_scenario(rng, c)
    qo, ip, idx, last = sc.tables()
    q = ar.random_q(rng, (sc.nnz, hq, 64), F32)
    h = sc.pg.heads
    with pytest.raises(E):
        kvcache.MultiLevelCascadeAttentionWrapper(0)
    kvcache.MultiLevelCascadeAttentionWrapper(3, None, "NHD", False, None, None, None, None)
    with pytest.raises(TypeError):  # num_threads is keyword-only
        kvcache.MultiLevelCascadeAttentionWrapper(3, None, "NHD", False, None, None, None, None, 2)
    w = kvcache.MultiLevelCascadeAttentionWrapper(3, kv_layout="NHD")
    with pytest.raises(E, match="plan"):
        w.run(q, sc.pg.cache, kv_scale=sc.pg.scale)
    bad_qo_end = [a.copy() for a in qo]
    bad_qo_end[1][-1] -= 1  # levels no longer end at the same total
    bad_last = [a.copy() for a in last]
    bad_last[2][0] = 6  # > page_size
    for args in ((qo[:2], ip, idx, last), (qo, ip[:2], idx, last),
                 (bad_qo_end, ip, idx, last), (qo, ip, idx, bad_last),
                 (qo, ip, [a[:1] for a in idx], last), (qo, [a[::-1].copy() for a in ip], idx,
                                                        last)):
        with pytest.raises(E):
            w.plan(*args, hq, h, 64, 5, causal=True)
    with pytest.raises(E):
        w.plan(qo, ip, idx, last, hq + 1, h, 64, 5)
    with pytest.raises(E):
        w.plan(qo, ip, idx, last, hq, h, 64, 5, window_left=-2)
    w.plan(qo, ip, idx, last, hq, h, 64, 5, causal=True, kv_data_type="int8")
    o = w.run(q, sc.pg.cache, kv_scale=sc.pg.scale)
    for args, scale in (((q, sc.pg.cache), None), ((q[:-1], sc.pg.cache), sc.pg.scale),
                        ((q[:, :, :32], sc.pg.cache), sc.pg.scale),
                        ((q, sc.pg.cache[:3]), sc.pg.scale[:3]),
                        ((q, sc.pg.cache.astype(F32)), None)):
        with pytest.raises(E):
            w.run(*args, kv_scale=scale)
    ref.assert_same_bytes(w.run(q, sc.pg.cache, kv_scale=sc.pg.scale), o, "o after errors")
