"""Python threads sharing one kvcache object (ctypes releases the GIL, so
their C calls overlap): a wrapper's plan() against its run(), an Engine
stepped from two threads, and close() of a model, tokenizer or GGUF file
while other threads are inside calls. Each case used to crash (use after
free), corrupt the heap or give wrong results; now calls are serialized or
close() waits for them, and later calls raise InvalidArgumentError.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import kvcache
from kvcache.gguf import GGUFFile
from kvcache.gguf_writer import write_tiny_llama
from kvcache.model import Engine, Model

SECONDS = 0.6  # per case: enough for thousands of overlapping calls


def hammer(fns, seconds=SECONDS):
    """Runs each fn in a loop on its own thread for `seconds`; returns the
    exceptions raised (by type name), failing on a hang."""
    stop = time.monotonic() + seconds
    errors: list[BaseException] = []

    def loop(fn):
        try:
            while time.monotonic() < stop:
                fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(fn,), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
        assert not t.is_alive(), "a thread hung"
    return errors


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("threads") / "tiny.gguf"
    write_tiny_llama(path, n_layer=2)
    return path


def paged(rng, pages=48, ps=16, h=2, d=64):
    cache = rng.standard_normal((pages, 2, ps, h, d)).astype(np.float32)
    indptr = np.array([0, 10, 30, 48], np.int32)
    indices = rng.permutation(pages).astype(np.int32)
    last = np.array([5, 16, 1], np.int32)
    return cache, indptr, indices, last


def test_decode_plan_against_run(rng):
    cache, indptr, indices, last = paged(rng)
    q = rng.standard_normal((3, 8, 64)).astype(np.float32)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD", num_threads=2)
    w.plan(indptr, indices, last, 8, 2, 64, 16)
    ref = w.run(q, cache)
    wrong = []

    def run():
        if not np.array_equal(w.run(q, cache), ref):
            wrong.append(1)

    assert hammer([run, lambda: w.plan(indptr, indices, last, 8, 2, 64, 16)]) == []
    assert not wrong


def test_prefill_forward_options_are_atomic(rng):
    cache, indptr, indices, last = paged(rng)
    qo = np.array([0, 4, 8, 12], np.int32)
    q = rng.standard_normal((12, 8, 64)).astype(np.float32)
    w = kvcache.BatchPrefillWithPagedKVCacheWrapper(kv_layout="NHD", num_threads=1)
    w.plan(qo, indptr, indices, last, 8, 2, 64, 16)
    ref = {c: w.forward(q, cache, causal=c) for c in (False, True)}
    wrong = []

    def forward(causal):
        if not np.array_equal(w.forward(q, cache, causal=causal), ref[causal]):
            wrong.append(causal)

    assert hammer([lambda: forward(False), lambda: forward(True)]) == []
    assert not wrong


def test_engine_stepped_from_two_threads(tiny_path):
    with Model(tiny_path) as m:
        prompts = [[5 + i, 9, 13 + 2 * i, 4] for i in range(6)]
        alone = m.generate(prompts, 6, ignore_eos=True)
        eng = Engine(m, kv_capacity_tokens=256, page_size=4)
        ids = [eng.add_request(p, 6, ignore_eos=True) for p in prompts]

        def step():
            if eng.pending:
                eng.step()

        assert hammer([step, step]) == []
        out = eng.run()
        eng.close()
        assert [out[i] for i in ids] == alone


def test_close_waits_for_running_calls(tiny_path):
    """close() in the middle of other threads' calls: they finish or raise
    'closed'; nothing is freed under them."""
    m = Model(tiny_path)
    tok = m.tokenizer
    eng = Engine(m, kv_capacity_tokens=256, page_size=4)
    eng.add_request([3, 4, 5], 4, ignore_eos=True)

    def calls():
        m.eval([1, 2, 3, 4])
        tok.encode("hello world, threads")
        if eng.pending:
            eng.step()

    closer = threading.Timer(SECONDS / 3, m.close)
    closer.start()
    errors = hammer([calls, calls])
    closer.join()
    assert errors and all(isinstance(e, kvcache.InvalidArgumentError) and "closed" in str(e)
                          for e in errors), errors
    with pytest.raises(kvcache.InvalidArgumentError, match="closed"):
        m.eval([1])
    m.close()  # idempotent, from any thread
    eng.close()


def test_owned_tokenizer_and_gguf_close_under_use(tiny_path):
    for make, use in ((lambda: kvcache.Tokenizer.from_gguf(tiny_path),
                       lambda t: t.encode("some text " * 20)),
                      (lambda: GGUFFile(tiny_path),
                       lambda g: g.get("tokenizer.ggml.tokens"))):
        obj = make()
        closer = threading.Timer(SECONDS / 3, obj.close)
        closer.start()
        errors = hammer([lambda: use(obj), lambda: use(obj)])
        closer.join()
        assert errors and all(isinstance(e, kvcache.InvalidArgumentError) for e in errors)



def _live_threads() -> int:
    import os
    return len(os.listdir("/proc/self/task"))


def test_pools_are_bounded_and_freed(rng):
    """single_decode with num_threads=1..128 used to leave a pool per count
    alive (8,130 threads); the cache keeps the POOL_CACHE_SIZE most recently
    used pools, and a pool is freed once nothing keeps it."""
    from kvcache import _lib
    q = rng.standard_normal((4, 64)).astype(np.float32)
    k = rng.standard_normal((40, 2, 64)).astype(np.float32)
    v = rng.standard_normal((40, 2, 64)).astype(np.float32)
    want = kvcache.single_decode_with_kv_cache(q, k, v, num_threads=1)
    before = _live_threads()
    for n in range(1, 129):
        out = kvcache.single_decode_with_kv_cache(q, k, v, num_threads=n)
        np.testing.assert_array_equal(out, want)  # any thread count: same bytes
    # The cached pools are those of the last POOL_CACHE_SIZE counts at most.
    bound = sum(range(128 - _lib.POOL_CACHE_SIZE + 1, 129))
    assert _live_threads() - before <= bound, (_live_threads(), before, bound)
    assert len(_lib._pools) <= _lib.POOL_CACHE_SIZE
    # Cycling through more counts than the cache holds frees the evicted ones.
    for n in (2, 3, 5, 7, 11, 13):
        kvcache.single_decode_with_kv_cache(q, k, v, num_threads=n)
    assert _live_threads() - before <= 13 + 11 + 7 + 5


def test_default_thread_count_is_the_affinity_mask():
    import os
    from kvcache import _lib
    assert _lib.cpu_count() == len(os.sched_getaffinity(0))
    assert _lib.threadpool(None).n_threads == len(os.sched_getaffinity(0))
