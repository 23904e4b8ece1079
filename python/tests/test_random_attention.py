"""Seeded random configurations of the cascade, MLA and pmx
MultiHeadCacheAttention operators against their float64 references, on
every ISA: storages, layouts, page sizes, GQA ratios, lengths (empty
requests and rows included), sm_scale up to 1, soft caps, windows, causal
or not, masks, 1 and 2 threads, with K/V and queries up to a few standard
deviations so that scores reach the tens (where the AMX kernel's 16-bit
query had needed its guard). The fixed grids of test_cascade.py,
test_mla.py and test_pmx_mhca.py cover the named cases; these cover the
combinations between them. Each seed is one test id, so a failure names a
reproducible configuration.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import attn_reference as ar
import test_cascade as tc
import test_mla as tm
import test_pmx_mhca as tp
from attn_reference import BF16, F16, F32, f64, lse_tol, out_tol


def _choice(rng, items):
    return items[int(rng.integers(0, len(items)))]


@tc.needs_cascade
@pytest.mark.parametrize("seed", range(40))
def test_random_cascade(isa, seed):
    rng = np.random.default_rng(1000 + seed)
    storage = _choice(rng, ["f32", "f16", "bf16", "int8", "int4"])
    ps = _choice(rng, [1, 3, 5, 16])
    dh = _choice(rng, [64, 128])
    heads = _choice(rng, [1, 2])
    hq = heads * _choice(rng, [1, 4, 8])
    q_dtype = _choice(rng, [F32, F16, BF16])
    n_req = int(rng.integers(1, 6))
    kw = dict(qo=[_choice(rng, [0, 1, 1, 2, 5, 17]) for _ in range(n_req)],
              unique=[int(x) for x in rng.integers(0, 60, n_req)],
              prefix_len=int(rng.integers(0, 3 * ps + 40)), page_size=ps, heads=heads, dh=dh,
              storage=storage, layout=_choice(rng, ["NHD", "HND"]),
              combined=bool(rng.integers(0, 2)))
    if n_req >= 2 and rng.integers(0, 2):
        cut = int(rng.integers(1, n_req))
        kw.update(groups=[list(range(cut)), list(range(cut, n_req))],
                  group_len=int(rng.integers(0, 40)))
    if sum(kw["qo"]) == 0:
        kw["qo"][0] = 1
    sc = tc.Scenario(rng, **kw)
    q = ar.random_q(rng, (sc.nnz, hq, dh), q_dtype, mag=_choice(rng, [0.5, 2.0]))
    params = {}
    if rng.random() < 0.3:
        params["window_left"] = int(rng.integers(0, 30))
    if rng.random() < 0.3:
        params["logits_soft_cap"] = _choice(rng, [1.0, 5.0, 30.0])
    if rng.random() < 0.5:
        params["sm_scale"] = _choice(rng, [0.05, 0.1, 0.2, 0.3, -0.1])
    causal = bool(rng.integers(0, 2))
    _w, (o, lse) = tc.run_cascade(sc, q, hq, causal=causal,
                                  num_threads=int(rng.integers(1, 3)), **params)
    want_o, want_lse = ar.cascade(f64(q), sc.ref_levels(), causal=causal,
                                  window_left=params.get("window_left", -1),
                                  sm_scale=params.get("sm_scale"),
                                  cap=params.get("logits_soft_cap"))
    what = f"seed {seed}: {kw} causal={causal} {params}"
    ar.assert_close(o, want_o, out_tol(q.dtype), "o " + what)
    ar.assert_close(lse, want_lse, lse_tol(q.dtype), "lse " + what)


@pytest.mark.parametrize("seed", range(30))
def test_random_mla(isa, seed):
    rng = np.random.default_rng(2000 + seed)
    n_req = int(rng.integers(1, 5))
    kv_lens = [_choice(rng, [0, 1, 7, 54, 130, 600]) for _ in range(n_req)]
    qo_lens = [_choice(rng, [0, 1, 1, 3, 17]) for _ in range(n_req)]
    qo_lens[0] = max(qo_lens[0], 1)
    dc, dk = _choice(rng, [64, 128, 512]), _choice(rng, [16, 64])
    kpe_dtype = _choice(rng, [F32, F16, BF16]) if rng.random() < 0.2 else None
    bt = tm.make_batch(rng, kv_lens, qo_lens, _choice(rng, [1, 3, 16]), dc, dk,
                       _choice(rng, [1, 5, 16, 64]), _choice(rng, [F32, F16, BF16]),
                       _choice(rng, [F32, F16, BF16]), kpe_dtype=kpe_dtype,
                       combined=kpe_dtype is None and bool(rng.integers(0, 2)),
                       qmag=_choice(rng, [1.0, 3.0]))
    causal = bool(rng.integers(0, 2))
    sm = _choice(rng, [1 / math.sqrt(dc + dk), 0.1, 0.3, 1.0])
    cap = _choice(rng, [None, None, 2.0, 30.0])
    o, lse = tm.plan_run(bt, causal=causal, sm_scale=sm, cap=cap,
                         num_threads=int(rng.integers(1, 3)))
    tm.check(bt, o, lse, causal=causal, sm_scale=sm, cap=cap)


@tp.needs_mhca
@pytest.mark.parametrize("seed", range(20))
def test_random_mhca(isa, seed):
    """Three steps of decodes and (chunked) prefills on one session."""
    rng = np.random.default_rng(3000 + seed)
    bits = _choice(rng, [0, 8, 4])
    num_heads, kv_heads = _choice(rng, [(4, 2), (4, 0), (8, 1), (4, 4), (9, 3), (32, 8)])
    dh = _choice(rng, [16, 32, 64, 128])
    group = _choice(rng, [8, 4, 16] if bits != 4 else [8, 2, 16])
    n_seqs = int(rng.integers(1, 5))
    m = tp.Mhca(rng, layout=int(rng.integers(0, 4)), mode=int(rng.integers(0, 2)), bits=bits,
                t1=_choice(rng, list(tp.T1S)), cache_dt=_choice(rng, list(tp.FLOAT_CACHES)),
                sdt=_choice(rng, [F32, F16]), group=group if group <= dh else 8,
                num_heads=num_heads, num_kv_heads=kv_heads, dh=dh,
                page_size=_choice(rng, [1, 3, 16, 128]), num_layer=2,
                layer_idx=int(rng.integers(0, 2)), cap=600, n_seqs=n_seqs,
                is_causal=bool(rng.integers(0, 2)))
    threads = int(rng.integers(1, 3))
    ran = 0
    for step in range(12):  # three steps that run (a step may draw an empty batch)
        if ran == 3:
            break
        seqs = [int(s) for s in rng.permutation(n_seqs)]
        batch = [(s, 1) for s in seqs if m.sess.lengths[s] > 0 and rng.random() < 0.6]
        n_dec = len(batch)  # decodes first, as decoding_batches requires
        batch += [(s, _choice(rng, [1, 5, 40, 150])) for s in seqs
                  if all(b[0] != s for b in batch) and rng.random() < 0.7]
        if not batch or any(m.sess.lengths[s] + n > 600 for s, n in batch):
            continue
        a = m.build(batch, _choice(rng, list(tp.MASK_KINDS)))
        m.run(a, n_dec, f"seed {seed} step {step} {batch}", num_threads=threads)
        m.advance(batch)
        ran += 1
    assert ran == 3, "the seed produced fewer than three steps: pick another"
