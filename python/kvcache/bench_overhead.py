"""Per-call overhead of the Python binding on the hot paths.

Run from the repository root (after building libkvcache)::

    PYTHONPATH=python python3 -m kvcache.bench_overhead            # every case
    PYTHONPATH=python python3 -m kvcache.bench_overhead --quick    # smoke run, < 2 s
    PYTHONPATH=python python3 -m kvcache.bench_overhead --help

For each case (small shapes, where the kernel takes microseconds and the
binding's share is largest) it times, in the same run:

- **py**: the public call as an engine makes it (``wrapper.run(q, cache)``,
  ``append_paged_kv_cache(...)``, ``merge_state(...)``), arguments already
  numpy arrays of the right dtype, outputs allocated by the call unless the
  case passes ``out=``;
- **C**: the same C function called through the binding's own ctypes
  prototype with every argument (tensors, paged cache, parameters, output
  buffers, thread pool) built once before the loop: the kernel plus the
  ctypes call itself, which is the floor for any ctypes binding.

Samples of ``--calls`` back-to-back calls alternate between the two for
``--rounds`` rounds (so both see the same machine load) and each side
reports its fastest sample's time per call: the minimum is the figure
least disturbed by other processes on a shared machine. **overhead** is py
- C, **ratio** py / C. Both sides run on the same thread pool
(``--threads``, default 1) and the same data; outputs of the two sides are
compared once before timing, so the C side computes what the public call
does.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time

import numpy as np

from . import _lib

_BR = ctypes.byref


def _tensor(a, int4: bool = False):
    return _lib.make_tensor(a, int4=int4)


def _combined_cache(cache, scale, layout, quant_group):
    pc = _lib.PagedCache()
    cache_t = _tensor(cache, int4=cache.dtype == np.uint8)
    scale_t = None if scale is None else _tensor(scale)
    _lib.check(_lib.kvc_paged_cache_from_combined(
        _BR(cache_t), None if scale_t is None else _BR(scale_t), layout, quant_group, _BR(pc)))
    return pc, (cache_t, scale_t)


class Case:
    """One hot path: ``py()`` the public call, ``c()`` the prebuilt C call,
    ``check()`` compares their outputs once."""

    def __init__(self, name, shape, py, c, check):
        self.name, self.shape, self.py, self.c, self.check = name, shape, py, c, check


def _status(fn, args):
    def call():
        status = fn(*args)
        if status:
            _lib.check(status)

    return call


def _same(a, b, what):
    if not np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True):
        raise AssertionError(f"bench_overhead: {what}: the public call and the direct C call "
                             f"disagree")


# ---------------------------------------------------------------------------
# Cases


def _page_table(batch, kv_len, page_size):
    pages = -(-kv_len // page_size)
    indptr = np.arange(batch + 1, dtype=np.int32) * pages
    indices = np.arange(batch * pages, dtype=np.int32)
    last = np.full(batch, kv_len - (pages - 1) * page_size, np.int32)
    return indptr, indices, last, batch * pages


def _decode_case(rng, threads, batch, kv_len, cache_dtype, *, use_out=False, return_lse=False):
    import kvcache  # noqa: PLC0415 (the package that imports this module)

    hq, h, dh, page, group = 32, 8, 128, 16, 32
    indptr, indices, last, n_pages = _page_table(batch, kv_len, page)
    if cache_dtype == "int8":
        cache = rng.integers(-127, 128, (n_pages, 2, page, h, dh), dtype=np.int8)
        scale = (rng.random((n_pages, 2, page, h, dh // group), dtype=np.float32) * 0.01 + 1e-3)
        scale = scale.astype(np.float16)
    else:
        cache = rng.standard_normal((n_pages, 2, page, h, dh)).astype(np.float16)
        scale = None
    q = rng.standard_normal((batch, hq, dh)).astype(np.float16)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(None, "NHD", num_threads=threads)
    w.plan(indptr, indices, last, hq, h, dh, page, q_data_type="float16",
           kv_data_type=cache_dtype, quant_group=group)
    out = np.empty_like(q) if use_out else None
    lse = np.empty((batch, hq), np.float32) if use_out else None

    if use_out:
        def py():
            return w.run(q, cache, kv_scale=scale, return_lse=return_lse, out=out, lse=lse)
    elif return_lse:
        def py():
            return w.run(q, cache, kv_scale=scale, return_lse=True)
    else:
        def py():
            return w.run(q, cache, kv_scale=scale)

    pc, keep = _combined_cache(cache, scale, _lib.KVC_NHD, group)
    params = _lib.kvc_attn_default_params()
    o_c = np.empty_like(q)
    lse_c = np.empty((batch, hq), np.float32)
    q_t, o_t, lse_t = _tensor(q), _tensor(o_c), _tensor(lse_c)
    pool = _lib.threadpool(threads)
    args = (w._plan, _BR(q_t), _BR(pc), _BR(params), _BR(o_t),
            _BR(lse_t) if (use_out or return_lse) else None, pool.ptr)
    c = _status(_lib.kvc_decode_run, args)

    def check():
        r = py()
        c()
        _same(r[0] if isinstance(r, tuple) else r, o_c, "decode o")

    name = f"decode {cache_dtype}" + (" out=,lse=" if use_out else "") + (
        " +lse" if return_lse and not use_out else "")
    shape = f"B={batch} Hq={hq} H={h} Dh={dh} kv={kv_len} page={page}"
    c_keep = (keep, q_t, o_t, lse_t, params, pc)
    case = Case(name, shape, py, c, check)
    case.keep = c_keep
    return case


def _append_case(rng, threads, batch):
    import kvcache  # noqa: PLC0415

    h, dh, page, kv_len = 8, 128, 16, 16
    indptr, indices, last, n_pages = _page_table(batch, kv_len, page)
    cache = np.zeros((n_pages, 2, page, h, dh), np.float16)
    k = rng.standard_normal((batch, h, dh)).astype(np.float16)
    v = rng.standard_normal((batch, h, dh)).astype(np.float16)
    batch_indices = np.arange(batch, dtype=np.int32)
    positions = np.full(batch, kv_len - 1, np.int32)

    def py():
        kvcache.append_paged_kv_cache(k, v, batch_indices, positions, cache, indices, indptr,
                                      last, num_threads=threads)

    cache_c = np.zeros_like(cache)
    pc, keep = _combined_cache(cache_c, None, _lib.KVC_NHD, 8)
    ts = [_tensor(a) for a in (k, v, batch_indices, positions, indices, indptr, last)]
    pool = _lib.threadpool(threads)
    args = (_BR(ts[0]), _BR(ts[1]), _BR(ts[2]), _BR(ts[3]), _BR(pc), _BR(ts[4]), _BR(ts[5]),
            _BR(ts[6]), pool.ptr)
    c = _status(_lib.kvc_append_paged_kv_cache, args)

    def check():
        py()
        c()
        _same(cache, cache_c, "append cache")

    case = Case("append_paged_kv_cache f16", f"B={batch} (1 token each) H={h} Dh={dh} "
                f"page={page}", py, c, check)
    case.keep = (keep, ts, pc, cache_c)
    return case


def _prefill_case(rng, threads, batch, qo_len, kv_len):
    import kvcache  # noqa: PLC0415
    from . import prefill  # noqa: PLC0415

    hq, h, dh, page = 32, 8, 128, 16
    indptr, indices, last, n_pages = _page_table(batch, kv_len, page)
    qo_indptr = np.arange(batch + 1, dtype=np.int32) * qo_len
    cache = rng.standard_normal((n_pages, 2, page, h, dh)).astype(np.float16)
    q = rng.standard_normal((batch * qo_len, hq, dh)).astype(np.float16)
    w = kvcache.BatchPrefillWithPagedKVCacheWrapper(None, "NHD", num_threads=threads)
    w.plan(qo_indptr, indptr, indices, last, hq, h, dh, page, causal=True,
           q_data_type="float16", kv_data_type="float16")

    def py():
        return w.run(q, cache)

    pc, keep = _combined_cache(cache, None, _lib.KVC_NHD, 8)
    params = _lib.kvc_attn_default_params()
    o_c = np.empty_like(q)
    q_t, o_t = _tensor(q), _tensor(o_c)
    pool = _lib.threadpool(threads)
    args = (w._plan, _BR(q_t), _BR(pc), _BR(params), _BR(o_t), None, pool.ptr)
    c = _status(prefill.kvc_prefill_run_paged, args)

    def check():
        o = py()
        c()
        _same(o, o_c, "prefill o")

    case = Case("prefill paged f16", f"B={batch} qo={qo_len} Hq={hq} H={h} Dh={dh} "
                f"kv={kv_len} causal", py, c, check)
    case.keep = (keep, pc, params, q_t, o_t)
    return case


def _merge_case(rng, n):
    import kvcache  # noqa: PLC0415

    h, d = 32, 128
    va = rng.standard_normal((n, h, d)).astype(np.float16)
    vb = rng.standard_normal((n, h, d)).astype(np.float16)
    sa = rng.standard_normal((n, h)).astype(np.float32)
    sb = rng.standard_normal((n, h)).astype(np.float32)

    def py():
        return kvcache.merge_state(va, sa, vb, sb)

    v_c = np.empty_like(va)
    s_c = np.empty_like(sa)
    ts = [_tensor(a) for a in (va, sa, vb, sb, v_c, s_c)]
    c = _status(_lib.kvc_merge_state, tuple(_BR(t) for t in ts))

    def check():
        v, s = py()
        c()
        _same(v, v_c, "merge_state v")
        _same(s, s_c, "merge_state s")

    case = Case("merge_state f16", f"N={n} H={h} D={d}", py, c, check)
    case.keep = ts
    return case


def _mla_case(rng, threads, batch, kv_len):
    import kvcache  # noqa: PLC0415
    from . import mla  # noqa: PLC0415

    heads, ckv_d, kpe_d, page = 16, 512, 64, 16
    indptr, indices, _last, n_pages = _page_table(batch, kv_len, page)
    qo_indptr = np.arange(batch + 1, dtype=np.int32)
    kv_lens = np.full(batch, kv_len, np.int32)
    ckv = rng.standard_normal((n_pages, page, ckv_d)).astype(np.float16)
    kpe = rng.standard_normal((n_pages, page, kpe_d)).astype(np.float16)
    q_nope = rng.standard_normal((batch, heads, ckv_d)).astype(np.float16)
    q_pe = rng.standard_normal((batch, heads, kpe_d)).astype(np.float16)
    w = kvcache.BatchMLAPagedAttentionWrapper(None, num_threads=threads)
    w.plan(qo_indptr, indptr, indices, kv_lens, heads, ckv_d, kpe_d, page, True,
           1.0 / np.sqrt(192.0), np.float16, np.float16)

    def py():
        return w.run(q_nope, q_pe, ckv, kpe)

    o_c = np.empty_like(q_nope)
    ts = [_tensor(a) for a in (q_nope, q_pe, ckv, kpe, o_c)]
    pool = _lib.threadpool(threads)
    args = (w._plan, *(_BR(t) for t in ts), None, pool.ptr)
    c = _status(mla._kvc_mla_run, args)

    def check():
        o = py()
        c()
        _same(o, o_c, "mla o")

    case = Case("MLA decode f16", f"B={batch} heads={heads} ckv={ckv_d} kpe={kpe_d} "
                f"kv={kv_len}", py, c, check)
    case.keep = ts
    return case


def _page_table_case(batch, seq_len):
    import kvcache  # noqa: PLC0415

    page = 16
    pages = batch * -(-seq_len // page) + 8
    pc = kvcache.PagedKVCache(1, 8, 128, page, pages, enable_prefix_caching=False)
    seqs = np.array([pc.add_sequence(seq_len)[0] for _ in range(batch)], np.int64)

    def py():
        return pc.page_table(seqs)

    indptr = np.empty(batch + 1, np.int32)
    indices = np.empty(pages, np.int32)
    last = np.empty(batch, np.int32)
    n = ctypes.c_int64(0)
    i32 = ctypes.POINTER(ctypes.c_int32)
    args = (pc._handle.ptr, seqs.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), batch,
            indptr.ctypes.data_as(i32), indices.ctypes.data_as(i32), pages,
            last.ctypes.data_as(i32), _BR(n))
    c = _status(_lib.kvc_cache_page_table, args)

    def check():
        ip, ind, la = py()
        c()
        _same(ip, indptr, "page_table indptr")
        _same(ind, indices[:n.value], "page_table indices")
        _same(la, last, "page_table last_page_len")

    case = Case("PagedKVCache.page_table", f"B={batch} seq_len={seq_len} page={page}", py, c,
                check)
    case.keep = (pc, n)
    return case


def _cases(threads, rng, only=None):
    makers = [
        ("decode", lambda: _decode_case(rng, threads, 1, 16, "float16")),
        ("decode-int8", lambda: _decode_case(rng, threads, 1, 16, "int8")),
        ("decode-lse", lambda: _decode_case(rng, threads, 1, 16, "float16", return_lse=True)),
        ("decode-out", lambda: _decode_case(rng, threads, 1, 16, "float16", use_out=True)),
        ("decode-b16", lambda: _decode_case(rng, threads, 16, 16, "float16")),
        ("append-b1", lambda: _append_case(rng, threads, 1)),
        ("append-b16", lambda: _append_case(rng, threads, 16)),
        ("prefill-qo1", lambda: _prefill_case(rng, threads, 1, 1, 16)),
        ("merge", lambda: _merge_case(rng, 4)),
        ("mla", lambda: _mla_case(rng, threads, 1, 16)),
        ("page-table-b1", lambda: _page_table_case(1, 100)),
        ("page-table-b64", lambda: _page_table_case(64, 100)),
    ]
    out = []
    for key, make in makers:
        if only and key not in only:
            continue
        case = make()
        case.key = key
        out.append(case)
    return out


CASE_KEYS = ("decode", "decode-int8", "decode-lse", "decode-out", "decode-b16", "append-b1",
             "append-b16", "prefill-qo1", "merge", "mla", "page-table-b1", "page-table-b64")


# ---------------------------------------------------------------------------
# Timing


def _sample(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def measure(case, calls: int, rounds: int) -> dict:
    """Fastest per-call time (seconds) of the public and the direct C call,
    samples alternating."""
    case.check()
    for _ in range(3):  # warm-up: caches, branch predictors, lazy imports
        _sample(case.py, max(1, calls // 10))
        _sample(case.c, max(1, calls // 10))
    py = c = float("inf")
    for _ in range(rounds):
        py = min(py, _sample(case.py, calls))
        c = min(c, _sample(case.c, calls))
    return {"case": case.name, "shape": case.shape, "py_us": py * 1e6, "c_us": c * 1e6,
            "overhead_us": (py - c) * 1e6, "ratio": py / c}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python3 -m kvcache.bench_overhead",
        description="Per-call overhead of the Python binding: each hot path's public call "
                    "against the same C function called with prebuilt ctypes arguments.")
    ap.add_argument("--threads", type=int, default=1, help="thread pool size (default 1)")
    ap.add_argument("--calls", type=int, default=2000, help="calls per sample (default 2000)")
    ap.add_argument("--rounds", type=int, default=15,
                    help="samples per side, alternating (default 15)")
    ap.add_argument("--case", action="append", choices=CASE_KEYS,
                    help="run only this case (repeatable)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 50 calls x 3 rounds")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args(argv)
    if args.quick:
        args.calls, args.rounds = 50, 3
    if args.calls < 1 or args.rounds < 1:
        ap.error("--calls and --rounds must be >= 1")
    rng = np.random.default_rng(0)
    cases = _cases(args.threads, rng, args.case)
    if not args.json:
        import kvcache  # noqa: PLC0415

        print(f"kvcache {kvcache.version()}, isa {kvcache.get_isa()}, numpy {np.__version__}, "
              f"Python {sys.version.split()[0]}, threads {args.threads}, "
              f"min of {args.rounds} x {args.calls} calls")
        print(f"{'case':<30} {'shape':<42} {'py us':>7} {'C us':>7} {'ovh us':>7} "
              f"{'py/C':>5}")
    for case in cases:
        r = measure(case, args.calls, args.rounds)
        r["threads"] = args.threads
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"{r['case']:<30} {r['shape']:<42} {r['py_us']:7.2f} {r['c_us']:7.2f} "
                  f"{r['overhead_us']:7.2f} {r['ratio']:5.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
