"""kvcache.PagedKVCache (include/kvcache/cache.h) through the Python binding:
lifecycle, sequences against a plain Python model (lengths, tokens and the
K/V every slot must hold, written with kvcache.append_paged_kv_cache and read
back through the page tables), page tables vs cachestarts, prefix hits and
salts, copy-on-write forks, out-of-pages and unknown-id errors, int8/int4
storage with scales, and the lifetime of the storage views."""

from __future__ import annotations

import gc
import threading
import weakref

import kvcache
import numpy as np
import pytest
from kvcache import InvalidArgumentError, NoSpaceError, NotFoundError

LAYOUTS = ("NHD", "HND")


def make(**kw):
    args = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "page_size": 4, "num_pages": 16}
    args.update(kw)
    return kvcache.PagedKVCache(**args)


def gather(kv, layout, pages, length):
    """(K, V) of one sequence, (length, H, Dh), read through its pages."""
    p = kv[np.asarray(pages, np.int64)]
    k, v = p[:, 0], p[:, 1]
    if layout == "HND":
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    h, dh = k.shape[2], k.shape[3]
    return (k.reshape(-1, h, dh)[:length], v.reshape(-1, h, dh)[:length])


def seq_pages(pc, seq):
    indptr, indices, _last = pc.page_table([seq])
    return indices[indptr[0]:indptr[1]]


def flashinfer_table(pc, seqs):
    """page_table's (kv_indptr, kv_indices, kv_last_page_len) in the argument
    order of append_paged_kv_cache: (kv_indices, kv_indptr, kv_last_page_len)."""
    indptr, indices, last = pc.page_table(seqs)
    return indices, indptr, last


def tables(pc, seqs):
    return [pc.page_table([s]) for s in seqs]


def assert_tables_equal(a, b):
    for ta, tb in zip(a, b, strict=True):
        for x, y in zip(ta, tb, strict=True):
            np.testing.assert_array_equal(x, y)


# ---------------------------------------------------------------------------
# Content model: the K/V row of a slot is a function of the sequence's prefix
# (salt + every token up to and including it), exactly representable in
# float16/bfloat16, so prefix-cache hits must find exactly these values.


def chain(prev: int, token) -> int:
    return hash((prev, token)) & 0x7FFFFFFF


def rows(hashes, layer, h, dh, kv):
    hs = np.asarray(hashes, np.int64)[:, None]
    j = np.arange(h * dh, dtype=np.int64)[None, :]
    x = ((hs * 7 + j * 131 + layer * 977 + kv * 3001) % 255) - 127
    return x.reshape(len(hashes), h, dh).astype(np.float32)


def write_rows(pc, seq, positions, hashes, dtype=np.float16):
    """Writes the model rows of `positions` of seq into every layer (an int8
    cache gets the int8 rows as they are: a plain copy, scales untouched)."""
    if pc.dtype == "int8":
        dtype = np.int8
    positions = np.asarray(positions, np.int32)
    if positions.size == 0:
        return
    table = flashinfer_table(pc, [seq])
    bi = np.zeros(positions.size, np.int32)
    for layer in range(pc.num_layers):
        k = rows(hashes, layer, pc.num_kv_heads, pc.head_dim, 0).astype(dtype)
        v = rows(hashes, layer, pc.num_kv_heads, pc.head_dim, 1).astype(dtype)
        kvcache.append_paged_kv_cache(k, v, bi, positions, pc.kv_cache(layer), *table,
                                      kv_layout=pc.kv_layout, kv_scale=pc.kv_scale(layer),
                                      quant_group=pc.quant_group or 8, n_threads=1)


def assert_content(pc, seq, hashes):
    pages = seq_pages(pc, seq)
    for layer in range(pc.num_layers):
        k, v = gather(pc.kv_cache(layer), pc.kv_layout, pages, len(hashes))
        np.testing.assert_array_equal(
            k.astype(np.float32), rows(hashes, layer, pc.num_kv_heads, pc.head_dim, 0),
            err_msg=f"K of seq {seq}, layer {layer}")
        np.testing.assert_array_equal(
            v.astype(np.float32), rows(hashes, layer, pc.num_kv_heads, pc.head_dim, 1),
            err_msg=f"V of seq {seq}, layer {layer}")


# ---------------------------------------------------------------------------
# Lifecycle


def test_lifecycle_and_properties():
    pc = make(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, num_pages=10)
    assert pc.num_pages == 10
    assert pc.page_size == 4
    assert pc.capacity_tokens == 40
    assert pc.bytes_per_token == 3 * 2 * 2 * 8 * 2
    assert pc.dtype == "float16" and pc.kv_layout == "NHD"
    st = pc.stats()
    assert set(st) >= {"free_pages", "cached_pages", "used_pages", "hit_tokens", "miss_tokens",
                       "evictions", "cow_copies", "failed_allocs"}
    assert st["free_pages"] == 10
    assert all(st[k] == 0 for k in st if k != "free_pages")
    pc.check()
    assert "PagedKVCache" in repr(pc)
    pc.close()
    assert pc.closed
    pc.close()  # idempotent
    for call in (lambda: pc.add_sequence([1, 2]), lambda: pc.stats(), lambda: pc.check(),
                 lambda: pc.kv_cache(0), lambda: pc.seq_len(0)):
        with pytest.raises(InvalidArgumentError):
            call()

    with make() as pc2:
        seq, n = pc2.add_sequence([1, 2, 3])
        assert (seq, n) == (seq, 0) and seq >= 0
        assert pc2.seq_len(seq) == 3
    assert pc2.closed


def test_constructor_arguments():
    bpt = make(num_pages=1).bytes_per_token
    page_bytes = bpt * 4
    pc = make(num_pages=None, max_bytes=page_bytes * 7 + page_bytes // 2)
    assert pc.num_pages == 7
    assert pc.capacity_tokens == 28
    with pytest.raises(InvalidArgumentError):
        make(num_pages=4, max_bytes=1 << 20)
    with pytest.raises(InvalidArgumentError):
        make(num_pages=None)
    with pytest.raises(InvalidArgumentError):
        make(num_pages=None, max_bytes=page_bytes - 1)  # not even one page
    with pytest.raises(InvalidArgumentError):
        make(dtype="float64")
    with pytest.raises(InvalidArgumentError):
        make(kv_layout="HDN")
    with pytest.raises(InvalidArgumentError):
        make(page_size=0)
    with pytest.raises(InvalidArgumentError):
        make(dtype="int8", quant_group=3)
    with pytest.raises(InvalidArgumentError):
        make(dtype="int4", head_dim=8, quant_group=8, scale_dtype="int8")
    assert make(dtype=np.float32).dtype == "float32"
    assert make(dtype="int4", kv_layout="hnd").kv_layout == "HND"


# ---------------------------------------------------------------------------
# Random operations against a Python model


def check_state(pc, model):
    pc.check()
    st = pc.stats()
    assert st["free_pages"] + st["cached_pages"] + st["used_pages"] == pc.num_pages
    used = set()
    ps = pc.page_size
    for seq, (tokens, hashes) in model.items():
        n = len(tokens)
        assert pc.seq_len(seq) == n
        indptr, indices, last = pc.page_table([seq])
        pages = (n + ps - 1) // ps
        assert indptr.tolist() == [0, pages]
        assert len(set(indices.tolist())) == pages
        assert last[0] == (n - ps * (pages - 1) if pages else 0)
        assert ((indices >= 0) & (indices < pc.num_pages)).all()
        used.update(indices.tolist())
    assert st["used_pages"] == len(used)
    if model:
        seqs = list(model)
        indptr, indices, last = pc.page_table(seqs)
        for b, seq in enumerate(seqs):
            np.testing.assert_array_equal(indices[indptr[b]:indptr[b + 1]], seq_pages(pc, seq))


def test_random_operations_against_model():
    rng = np.random.default_rng(1234)
    pc = make(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, num_pages=32)
    ps = pc.page_size
    bases = [rng.integers(0, 50, 40).tolist() for _ in range(3)]
    model = {}  # seq -> (tokens, prefix hashes); id-less tokens get unique negative ids
    freed = []
    fresh = [-1]
    salts = [None, 7, "tenant"]

    def new_tokens(n, with_ids):
        if with_ids:
            return rng.integers(0, 50, n).tolist(), True
        out = list(range(fresh[0], fresh[0] - n, -1))
        fresh[0] -= n
        return out, False

    def extend(hashes, start_hash, tokens):
        h = hashes[-1] if hashes else start_hash
        out = list(hashes)
        for t in tokens:
            h = chain(h, t)
            out.append(h)
        return out

    salt_of = {}
    n_hits = 0
    for step in range(300):
        live = list(model)
        before_stats = pc.stats()
        ops = ["add", "add", "append", "append", "fork", "truncate", "free"]
        if before_stats["used_pages"] > pc.num_pages * 3 // 4:
            ops += ["free", "free", "truncate"]
        op = ops[int(rng.integers(0, len(ops)))]
        before_tables = tables(pc, live)
        try:
            if op == "add" or not live:
                salt = salts[int(rng.integers(0, 3))]
                if rng.random() < 0.8:
                    base = bases[int(rng.integers(0, 3))]
                    tokens = base[:int(rng.integers(1, 30))] + rng.integers(
                        0, 50, int(rng.integers(0, 4))).tolist()
                    arg = np.asarray(tokens, np.int64) if rng.random() < 0.5 else tokens
                else:
                    tokens, _ = new_tokens(int(rng.integers(0, 10)), False)
                    arg = len(tokens)
                seq, n_cached = pc.add_sequence(arg, salt=salt)
                assert seq not in model and seq not in freed
                n = len(tokens)
                assert n_cached % ps == 0 and 0 <= n_cached <= max(n - 1, 0) // ps * ps
                if not isinstance(arg, int):
                    n_hits += n_cached > 0
                else:
                    assert n_cached == 0
                start = chain(0, ("salt", kvcache.cache.salt_hash(salt)))
                salt_of[seq] = start
                hashes = extend([], start, tokens)
                model[seq] = (tokens, hashes)
                write_rows(pc, seq, np.arange(n_cached, n), hashes[n_cached:])
            elif op == "append":
                seq = live[int(rng.integers(0, len(live)))]
                tokens, hashes = model[seq]
                k = int(rng.integers(0, 7))
                new, with_ids = new_tokens(k, rng.random() < 0.7)
                pos = pc.append(seq, new if with_ids else k)
                assert pos.dtype == np.int32
                np.testing.assert_array_equal(pos, np.arange(len(tokens), len(tokens) + k))
                hashes = extend(hashes, salt_of[seq], new)
                model[seq] = (tokens + new, hashes)
                write_rows(pc, seq, pos, hashes[len(tokens):])
            elif op == "fork":
                seq = live[int(rng.integers(0, len(live)))]
                child = pc.fork(seq)
                assert child not in model and child not in freed
                model[child] = (list(model[seq][0]), list(model[seq][1]))
                salt_of[child] = salt_of[seq]
                np.testing.assert_array_equal(seq_pages(pc, child), seq_pages(pc, seq))
            elif op == "truncate":
                seq = live[int(rng.integers(0, len(live)))]
                tokens, hashes = model[seq]
                n = int(rng.integers(0, len(tokens) + 1))
                pc.truncate(seq, n)
                model[seq] = (tokens[:n], hashes[:n])
            else:
                seq = live[int(rng.integers(0, len(live)))]
                pc.free(seq)
                del model[seq]
                freed.append(seq)
        except NoSpaceError:
            after = pc.stats()
            assert after["failed_allocs"] == before_stats["failed_allocs"] + 1
            after["failed_allocs"] = before_stats["failed_allocs"]
            assert after == before_stats, f"step {step} {op}"
            assert list(model) == live
            assert_tables_equal(tables(pc, live), before_tables)
        check_state(pc, model)
        for seq, (_tokens, hashes) in model.items():
            assert_content(pc, seq, hashes)
        if freed and rng.random() < 0.2:
            with pytest.raises(NotFoundError):
                pc.seq_len(freed[int(rng.integers(0, len(freed)))])
    st = pc.stats()
    assert n_hits > 0 and st["hit_tokens"] > 0
    assert st["failed_allocs"] > 0 and st["evictions"] > 0 and st["cow_copies"] > 0


# ---------------------------------------------------------------------------
# Page tables


def test_page_table_and_cachestarts_consistent():
    pc = make(page_size=4, num_pages=32)
    lens = [0, 1, 4, 5, 9, 16]
    seqs = [pc.add_sequence(n)[0] for n in lens]
    indptr, indices, last = pc.page_table(seqs)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    pages = [(n + 3) // 4 for n in lens]
    assert np.diff(indptr).tolist() == pages
    assert last.tolist() == [0, 1, 4, 1, 1, 4]
    np.testing.assert_array_equal(kvcache.get_seq_lens(indptr, last, 4), lens)
    assert len(set(indices.tolist())) == sum(pages)
    cst = pc.cachestarts(seqs)
    assert cst.dtype == np.int64 and cst.shape == (len(seqs), max(pages))
    for b in range(len(seqs)):
        row = indices[indptr[b]:indptr[b + 1]].astype(np.int64) * 4
        np.testing.assert_array_equal(cst[b, :pages[b]], row)
        assert (cst[b, pages[b]:] == -1).all()
    wide = pc.cachestarts(seqs, max_pages=7)
    assert wide.shape == (len(seqs), 7)
    np.testing.assert_array_equal(wide[:, :max(pages)], cst)
    assert (wide[:, max(pages):] == -1).all()
    np.testing.assert_array_equal(kvcache.page_table_to_pmx(indptr, indices, 4, 7), wide)
    with pytest.raises(InvalidArgumentError):
        pc.cachestarts(seqs, max_pages=3)
    # one sequence as an int, repeated sequences, empty batch
    np.testing.assert_array_equal(pc.page_table(seqs[4])[1], pc.page_table([seqs[4]])[1])
    ip, ind, la = pc.page_table([seqs[3], seqs[3]])
    assert ip.tolist() == [0, 2, 4] and ind[:2].tolist() == ind[2:].tolist()
    ip, ind, la = pc.page_table([])
    assert ip.tolist() == [0] and ind.size == 0 and la.size == 0
    assert pc.cachestarts([seqs[0]]).tolist() == [[-1]]


# ---------------------------------------------------------------------------
# End to end with append_paged_kv_cache


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_end_to_end_batched_writes(layout, dtype):
    rng = np.random.default_rng(5)
    h, dh, ps = 3, 16, 5
    pc = make(num_layers=2, num_kv_heads=h, head_dim=dh, page_size=ps, num_pages=40,
              kv_layout=layout, dtype=dtype, enable_prefix_caching=False)
    kv0 = pc.kv_cache(0)
    shape = (40, 2, ps, h, dh) if layout == "NHD" else (40, 2, h, ps, dh)
    assert kv0.shape == shape
    assert kv0.dtype == kvcache._lib.resolve_dtype(dtype)
    kv0[...] = 0
    pc.kv_cache(1)[...] = 0
    lens = [7, 1, 12, 5]
    seqs = []
    want = {}
    for n in lens:
        s, cached = pc.add_sequence(rng.integers(0, 100, n))
        assert cached == 0
        seqs.append(s)
        want[s] = [[np.empty((0, h, dh), np.float32)] * 2 for _ in range(2)]
    new = {s: np.arange(n, dtype=np.int32) for s, n in zip(seqs, lens, strict=True)}
    for step in range(4):
        bi = np.concatenate([np.full(len(new[s]), b, np.int32) for b, s in enumerate(seqs)])
        pos = np.concatenate([new[s] for s in seqs])
        table = flashinfer_table(pc, seqs)
        for layer in range(2):
            k = rng.standard_normal((len(pos), h, dh)).astype(np.float32)
            v = rng.standard_normal((len(pos), h, dh)).astype(np.float32)
            k = k.astype(kvcache._lib.resolve_dtype(dtype))
            v = v.astype(kvcache._lib.resolve_dtype(dtype))
            kvcache.append_paged_kv_cache(k, v, bi, pos, pc.kv_cache(layer), *table,
                                          kv_layout=layout, n_threads=2)
            for b, s in enumerate(seqs):
                w = want[s][layer]
                w[0] = np.concatenate([w[0], k[bi == b].astype(np.float32)])
                w[1] = np.concatenate([w[1], v[bi == b].astype(np.float32)])
        for s in seqs:  # decode: one more slot each
            new[s] = pc.append(s, 1)
            assert new[s].tolist() == [pc.seq_len(s) - 1]
    for s in seqs:
        pc.truncate(s, pc.seq_len(s) - 1)  # drop the unwritten decode slot
    for layer in range(2):
        kv = pc.kv_cache(layer)
        for s in seqs:
            k, v = gather(kv, layout, seq_pages(pc, s), pc.seq_len(s))
            np.testing.assert_array_equal(k.astype(np.float32), want[s][layer][0])
            np.testing.assert_array_equal(v.astype(np.float32), want[s][layer][1])
    pc.check()


# ---------------------------------------------------------------------------
# Prefix caching


def test_prefix_hits_reuse_pages_and_data():
    pc = make(page_size=4, num_pages=16)
    prompt = list(range(100, 110))  # 10 tokens: 2 full pages within the first 9
    hashes = [chain(0, t) for t in prompt]  # any content; written once
    s1, c1 = pc.add_sequence(prompt)
    assert c1 == 0
    write_rows(pc, s1, np.arange(10), hashes)
    st = pc.stats()
    assert st["miss_tokens"] == 10 and st["hit_tokens"] == 0

    s2, c2 = pc.add_sequence(np.asarray(prompt, np.int32))
    assert c2 == 8
    p1, p2 = seq_pages(pc, s1), seq_pages(pc, s2)
    np.testing.assert_array_equal(p2[:2], p1[:2])
    assert p2[2] != p1[2]
    st = pc.stats()
    assert st["hit_tokens"] == 8 and st["miss_tokens"] == 12
    assert st["used_pages"] == 4
    write_rows(pc, s2, np.arange(8, 10), hashes[8:])
    assert_content(pc, s2, hashes)

    # exactly two full pages: the last token is never served from the cache
    s3, c3 = pc.add_sequence(prompt[:8])
    assert c3 == 4
    # a different second page: one page hit
    s4, c4 = pc.add_sequence(prompt[:4] + [1, 2, 3, 4, 5])
    assert c4 == 4
    for s in (s1, s2, s3, s4):
        pc.free(s)
    pc.check()
    st = pc.stats()
    assert st["used_pages"] == 0 and st["cached_pages"] >= 2

    # freed pages stay findable and keep the first prompt's K/V
    s5, c5 = pc.add_sequence(prompt + [7, 7])
    assert c5 == 8
    np.testing.assert_array_equal(seq_pages(pc, s5)[:2], p1[:2])
    for layer in range(pc.num_layers):
        k, v = gather(pc.kv_cache(layer), "NHD", seq_pages(pc, s5), 8)
        np.testing.assert_array_equal(k.astype(np.float32), rows(hashes[:8], layer, 2, 8, 0))
        np.testing.assert_array_equal(v.astype(np.float32), rows(hashes[:8], layer, 2, 8, 1))
    pc.check()


def test_salt_separates_and_ids_less_sequences_do_not_hit():
    pc = make(page_size=4, num_pages=32)
    prompt = list(range(9))
    _a, ca = pc.add_sequence(prompt, salt="tenant-a")
    assert ca == 0
    expected = [(None, 0), (0, 8), ("tenant-b", 0), (b"tenant-b", 8), (12345, 0)]
    for salt, want in expected:
        _s, c = pc.add_sequence(prompt, salt=salt)
        assert c == want, salt
    _s, c = pc.add_sequence(prompt, salt="tenant-a")
    assert c == 8
    _s, c = pc.add_sequence(prompt, salt=b"tenant-a")  # str salts hash as UTF-8 bytes
    assert c == 8
    _s, c = pc.add_sequence(prompt, salt=12345)
    assert c == 8
    _s, c = pc.add_sequence(prompt, salt=12346)
    assert c == 0
    assert kvcache.cache.salt_hash("x") == kvcache.cache.salt_hash(b"x") != 0
    assert kvcache.cache.salt_hash(None) == 0
    with pytest.raises(InvalidArgumentError):
        pc.add_sequence(prompt, salt=-1)
    with pytest.raises(InvalidArgumentError):
        pc.add_sequence(prompt, salt=2**64)
    # no token ids: nothing looked up
    _s, c = pc.add_sequence(9)
    assert c == 0
    pc.check()


def test_salt_none_is_zero_and_prefix_caching_off():
    pc = make(page_size=4, num_pages=32)
    pc.add_sequence(list(range(9)))
    assert pc.add_sequence(list(range(9)), salt=0)[1] == 8
    assert pc.add_sequence(list(range(9)), salt="")[1] == 0
    off = make(page_size=4, num_pages=32, enable_prefix_caching=False)
    off.add_sequence(list(range(9)))
    assert off.add_sequence(list(range(9)))[1] == 0
    assert off.stats()["hit_tokens"] == 0
    off.check()


def test_appended_full_pages_become_findable():
    pc = make(page_size=4, num_pages=16)
    s, _ = pc.add_sequence([1, 2])
    pc.append(s, [3, 4, 5])
    pc.append(s, [6, 7, 8, 9])
    _t, c = pc.add_sequence([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert c == 8
    pc.check()


def test_rewritten_pages_are_not_served_stale():
    """Truncating into a full registered page and writing other tokens there
    must not leave the old tokens findable with the new data."""
    pc = make(page_size=4, num_pages=16)
    prompt = list(range(20, 28))
    hashes = [chain(0, t) for t in prompt]
    s, _ = pc.add_sequence(prompt)
    write_rows(pc, s, np.arange(8), hashes)
    pc.append(s, [1])  # page 2 is full and findable now
    write_rows(pc, s, [8], [chain(hashes[-1], 1)])
    pc.truncate(s, 6)
    pos = pc.append(s, [90, 91])
    other = hashes[:6] + [chain(hashes[5], 90)]
    other.append(chain(other[-1], 91))
    write_rows(pc, s, pos, other[6:])
    t, c = pc.add_sequence(prompt + [1])
    assert c in (4, 8)
    write_rows(pc, t, np.arange(c, 9), (hashes + [chain(hashes[-1], 1)])[c:])
    assert_content(pc, t, hashes + [chain(hashes[-1], 1)])
    assert_content(pc, s, other)
    pc.check()


# ---------------------------------------------------------------------------
# Forks and copy-on-write


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_fork_copy_on_write(dtype):
    pc = make(page_size=4, num_pages=16, dtype=dtype)
    toks = [5, 6, 7, 8, 9, 10]
    parent, _ = pc.add_sequence(toks)
    ph = [chain(0, t) for t in toks]
    write_rows(pc, parent, np.arange(6), ph)
    scale_before = [None, None]
    if dtype == "int8":
        for layer in range(2):
            sc = pc.kv_scale(layer)
            sc[...] = np.arange(sc.size).reshape(sc.shape) % 1000 + layer
            scale_before[layer] = sc.copy()
    child = pc.fork(parent)
    np.testing.assert_array_equal(seq_pages(pc, child), seq_pages(pc, parent))
    assert pc.stats()["cow_copies"] == 0
    assert pc.stats()["used_pages"] == 2
    pos = pc.append(child, [99])
    assert pos.tolist() == [6]
    assert pc.stats()["cow_copies"] == 1
    pp, cp = seq_pages(pc, parent), seq_pages(pc, child)
    assert pp[0] == cp[0] and pp[1] != cp[1]
    ch = ph + [chain(ph[-1], 99)]
    write_rows(pc, child, pos, ch[6:])
    # the copy carried the parent's data (and scales) of every layer
    assert_content(pc, child, ch)
    assert_content(pc, parent, ph)
    if dtype == "int8":
        for layer in range(2):
            sc = pc.kv_scale(layer)
            np.testing.assert_array_equal(sc[pp[1], :, :2], sc[cp[1], :, :2])
            np.testing.assert_array_equal(sc[pp[1]], scale_before[layer][pp[1]])
    # the parent's last page is its own now: no further copy
    pos = pc.append(parent, [42, 43])
    assert pos.tolist() == [6, 7]
    assert pc.stats()["cow_copies"] == 1
    ph2 = ph + [chain(ph[-1], 42)]
    ph2.append(chain(ph2[-1], 43))
    write_rows(pc, parent, pos, ph2[6:])
    assert_content(pc, parent, ph2)
    assert_content(pc, child, ch)
    # fork at a page boundary: the next append takes a new page, no copy
    s8, _ = pc.add_sequence(8)
    f8 = pc.fork(s8)
    pc.append(f8, 1)
    assert pc.stats()["cow_copies"] == 1
    np.testing.assert_array_equal(seq_pages(pc, f8)[:2], seq_pages(pc, s8))
    # truncating a fork into a shared page, then appending, copies
    pc.truncate(f8, 6)
    pc.append(f8, 1)
    assert pc.stats()["cow_copies"] == 2
    assert seq_pages(pc, f8)[1] != seq_pages(pc, s8)[1]
    pc.free(parent)
    assert_content(pc, child, ch)
    pc.check()


# ---------------------------------------------------------------------------
# Errors


def test_out_of_pages_changes_nothing():
    pc = make(page_size=4, num_pages=6)
    a, _ = pc.add_sequence(list(range(10)))  # 3 pages
    b, _ = pc.add_sequence(7)  # 2 pages
    f = pc.fork(b)
    seqs = [a, b, f]
    before = pc.stats()
    before_t = tables(pc, seqs)
    lens = [pc.seq_len(s) for s in seqs]

    def unchanged(n_failed):
        st = pc.stats()
        assert st["failed_allocs"] == before["failed_allocs"] + n_failed
        st["failed_allocs"] = before["failed_allocs"]
        assert st == before
        assert_tables_equal(tables(pc, seqs), before_t)
        assert [pc.seq_len(s) for s in seqs] == lens
        pc.check()

    with pytest.raises(NoSpaceError):
        pc.add_sequence(list(range(50, 59)))  # 3 pages, 1 free
    unchanged(1)
    with pytest.raises(NoSpaceError):
        pc.append(a, 7)  # 2 more pages
    unchanged(2)
    # b's last page is shared with f: the copy plus a new page do not fit
    with pytest.raises(NoSpaceError):
        pc.append(b, 2)
    unchanged(3)
    pc.append(a, 2)  # fills a's last page: no new page
    pc.free(a)
    pc.add_sequence(list(range(50, 59)))  # now fits
    pc.check()


def test_more_than_the_capacity_is_invalid():
    """A request that could never fit, more slots than the whole pool holds, is
    an invalid argument (cache.h), not a transient lack of pages: preempting
    other sequences would not help. Nothing changes and it is not counted as a
    failed allocation."""
    pc = make(page_size=4, num_pages=6)
    s, _ = pc.add_sequence(7)
    before = pc.stats()
    for call in (lambda: pc.append(s, 10**9), lambda: pc.append(s, 18),
                 lambda: pc.add_sequence(25), lambda: pc.add_sequence(list(range(25)))):
        with pytest.raises(InvalidArgumentError, match="capacity"):
            call()
    assert pc.stats() == before
    assert pc.seq_len(s) == 7
    pc.check()


def test_unknown_and_freed_ids():
    pc = make()
    s, _ = pc.add_sequence([1, 2, 3])
    live, _ = pc.add_sequence([4])
    pc.free(s)
    calls = (lambda b: pc.seq_len(b), lambda b: pc.append(b, 1), lambda b: pc.append(b, [1]),
             lambda b: pc.fork(b), lambda b: pc.truncate(b, 0), lambda b: pc.free(b),
             lambda b: pc.page_table([live, b]), lambda b: pc.cachestarts([live, b]))
    for bad in (s, 999999, -1):
        for call in calls:
            with pytest.raises(NotFoundError):
                call(bad)
    assert pc.seq_len(live) == 1
    with pytest.raises(InvalidArgumentError):
        pc.truncate(live, 2)
    with pytest.raises(InvalidArgumentError):
        pc.truncate(live, -1)
    with pytest.raises(InvalidArgumentError):
        pc.append(live, -1)
    with pytest.raises(InvalidArgumentError):
        pc.append(live, [[1, 2]])
    with pytest.raises(InvalidArgumentError):
        pc.append(live, [2**31])
    with pytest.raises(InvalidArgumentError):
        pc.add_sequence([1.5, 2.0])
    with pytest.raises(InvalidArgumentError):
        pc.kv_cache(2)
    with pytest.raises(InvalidArgumentError):
        pc.kv_cache(-1)
    with pytest.raises(InvalidArgumentError):
        pc.seq_len(2**63)
    # a new id is never a reused one
    t, _ = pc.add_sequence([1])
    assert t not in (s, live)
    assert pc.stats()["used_pages"] == 2
    pc.check()


# ---------------------------------------------------------------------------
# Quantized storage


@pytest.mark.parametrize("dtype,sdt", [("int8", "float16"), ("int8", "float32"),
                                       ("int4", "float16")])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantized_storage_and_scales(dtype, sdt, layout):
    rng = np.random.default_rng(9)
    h, dh, ps, g, pages = 2, 16, 4, 8, 12
    pc = make(num_layers=2, num_kv_heads=h, head_dim=dh, page_size=ps, num_pages=pages,
              dtype=dtype, scale_dtype=sdt, quant_group=g, kv_layout=layout)
    last = dh // 2 if dtype == "int4" else dh
    mid = (ps, h) if layout == "NHD" else (h, ps)
    data_bytes = dh // 2 if dtype == "int4" else dh
    sbytes = np.dtype(sdt).itemsize
    assert pc.bytes_per_token == 2 * 2 * h * (data_bytes + dh // g * sbytes)
    assert pc.scale_dtype == sdt and pc.quant_group == g
    for layer in range(2):
        kv, sc = pc.kv_cache(layer), pc.kv_scale(layer)
        assert kv.shape == (pages, 2) + mid + (last,)
        assert kv.dtype == (np.uint8 if dtype == "int4" else np.int8)
        assert sc.shape == (pages, 2) + mid + (dh // g,)
        assert sc.dtype == np.dtype(sdt)
        assert kv.flags.writeable and sc.flags.writeable
        assert not np.shares_memory(kv, sc)
        kv[...] = 0
        sc[...] = 0
    assert not np.shares_memory(pc.kv_cache(0), pc.kv_cache(1))
    assert not np.shares_memory(pc.kv_scale(0), pc.kv_scale(1))

    seqs = [pc.add_sequence(n)[0] for n in (5, 9, 3)]
    table = flashinfer_table(pc, seqs)
    bi, pos = kvcache.get_batch_indices_positions([0, 5, 14, 17], [5, 9, 3], 17)
    # reference: the same append into plain numpy arrays of the same shape
    for layer in range(2):
        k = rng.standard_normal((17, h, dh)).astype(np.float16)
        v = rng.standard_normal((17, h, dh)).astype(np.float16)
        ref_kv = np.zeros_like(pc.kv_cache(layer))
        ref_sc = np.zeros_like(pc.kv_scale(layer))
        kvcache.append_paged_kv_cache(k, v, bi, pos, ref_kv, *table, kv_layout=layout,
                                      kv_scale=ref_sc, quant_group=g)
        kvcache.append_paged_kv_cache(k, v, bi, pos, pc.kv_cache(layer), *table,
                                      kv_layout=layout, kv_scale=pc.kv_scale(layer),
                                      quant_group=g)
        np.testing.assert_array_equal(pc.kv_cache(layer), ref_kv)
        np.testing.assert_array_equal(pc.kv_scale(layer), ref_sc)
        assert np.abs(ref_sc.astype(np.float32)).max() > 0
        # dequantized read-back through the page table is close to the input
        kq, _vq = gather(pc.kv_cache(layer), layout, seq_pages(pc, seqs[1]), 9)
        ks, _vs = gather(pc.kv_scale(layer), layout, seq_pages(pc, seqs[1]), 9)
        if dtype == "int4":
            lo = (kq & 0xF).astype(np.int16)
            hi = (kq >> 4).astype(np.int16)
            q = np.stack([lo, hi], -1).reshape(9, h, dh)
            q = np.where(q >= 8, q - 16, q)
            tol = 0.2
        else:
            q = kq.astype(np.int16)
            tol = 0.02
        deq = q.reshape(9, h, dh // g, g) * ks.astype(np.float32)[..., None]
        err = np.abs(deq.reshape(9, h, dh) - k[5:14].astype(np.float32))
        assert err.max() <= tol * np.abs(k[5:14].astype(np.float32)).max()
    assert make(dtype="float16").kv_scale(0) is None
    pc.check()


# ---------------------------------------------------------------------------
# Storage views


def test_views_are_live_writable_and_keep_the_cache_alive():
    pc = make(page_size=4, num_pages=8)
    a = pc.kv_cache(0)
    b = pc.kv_cache(0)
    assert a.flags.writeable and not a.flags.owndata
    assert np.shares_memory(a, b)
    assert a.ctypes.data == b.ctypes.data
    a[3, 1, 2, 1, 5] = 7.5
    assert b[3, 1, 2, 1, 5] == 7.5
    assert not np.shares_memory(a, pc.kv_cache(1))
    s, _ = pc.add_sequence(5)
    write_rows(pc, s, np.arange(5), [11, 12, 13, 14, 15])
    assert_content(pc, s, [11, 12, 13, 14, 15])
    # the view keeps the cache object alive
    ref = weakref.ref(pc)
    handle_ref = weakref.ref(pc._handle)
    del pc, b
    gc.collect()
    assert ref() is not None
    a[0, 0, 0, 0, 0] = 1.0
    del a
    gc.collect()
    assert ref() is None and handle_ref() is None

    # after close(), a live view keeps the storage valid and writable
    pc = make(page_size=4, num_pages=8)
    s, _ = pc.add_sequence(4)
    write_rows(pc, s, np.arange(4), [1, 2, 3, 4])
    view = pc.kv_cache(1)
    pages = seq_pages(pc, s)
    handle_ref = weakref.ref(pc._handle)
    pc.close()
    gc.collect()
    assert handle_ref() is not None  # storage not destroyed yet
    k, v = gather(view, "NHD", pages, 4)
    np.testing.assert_array_equal(k.astype(np.float32), rows([1, 2, 3, 4], 1, 2, 8, 0))
    view[...] = 3
    assert (view == 3).all()
    with pytest.raises(InvalidArgumentError):
        pc.kv_cache(0)
    del view, k, v
    gc.collect()
    assert handle_ref() is None  # destroyed with the last view

    # without views, close() destroys at once
    pc = make()
    handle_ref = weakref.ref(pc._handle)
    pc.close()
    assert handle_ref() is None


def test_page_tables_consistent_while_another_thread_appends():
    """page_table / cachestarts size their output and fill it under one lock:
    a concurrent append (the class may be shared between threads) can never
    make the table disagree with the lengths it was sized for."""
    pc = kvcache.PagedKVCache(1, 1, 8, 2, num_pages=4000, dtype="float32",
                              enable_prefix_caching=False)
    s, _ = pc.add_sequence(1)
    done = threading.Event()
    errors = []

    def grow():
        try:
            for _ in range(3000):
                pc.append(s, 1)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))
        done.set()

    t = threading.Thread(target=grow)
    t.start()
    tables = 0
    while not done.is_set() or tables < 10:
        indptr, indices, last = pc.page_table([s])
        assert indptr[-1] == len(indices) >= 1 and 1 <= last[0] <= 2
        cs = pc.cachestarts([s])
        assert (cs[0] >= 0).all()  # sized for exactly its pages: no -1 column
        tables += 1
    t.join()
    assert not errors, errors
    assert pc.seq_len(s) == 3001


def test_rollback_unregisters_pages_whose_slots_were_never_written():
    """Pages are findable once their slots are reserved; rollback (the step
    that would write them did not run) takes dropped ones out of the index,
    truncate (they were written) leaves them findable."""
    for undo, want in (("truncate", 4), ("rollback", 2)):
        pc = kvcache.PagedKVCache(1, 1, 8, 2, num_pages=8, dtype="float32")
        s, _ = pc.add_sequence([1, 2])
        pc.append(s, [3, 4])
        assert pc.lookup_prefix([1, 2, 3, 4, 5]) == 4
        getattr(pc, undo)(s, 2)
        pc.free(s)
        assert pc.lookup_prefix([1, 2, 3, 4, 5]) == want, undo
        pc.check()


# -- compressed formats (kv_format) ------------------------------------------


@pytest.mark.parametrize("fmt,bpt", [("kivi8", 12240), ("kivi4", 6480)])
def test_kvfmt_bytes_per_token_and_views(fmt, bpt):
    # SmolLM2-135M geometry (docs/KV_FORMATS.md section 5)
    with kvcache.PagedKVCache(30, 3, 64, 16, num_pages=4, kv_format=fmt) as pc:
        assert pc.kv_format == fmt and pc.kv_group == 64 and pc.dtype is None
        assert pc.bytes_per_token == bpt
        pages = pc.kvfmt_pages(29)
        assert pages.dtype == np.uint8 and pages.shape == (4, bpt * 16 // 30)
        pages[:] = 7  # writable
        with pytest.raises(InvalidArgumentError, match="kvc_cache_kvfmt_layer"):
            pc.kv_cache(0)
        seq, _ = pc.add_sequence(10)
        assert pc.tail(seq, 0).shape == (2, 64, 3, 64)
        assert pc.tail(seq, 0).dtype == np.float16
        # kivi4 keeps position 0 in float16 with the first page (zeroed until written)
        sink = pc.sink(seq, 29)
        if fmt == "kivi4":
            assert sink.shape == (2, 1, 3, 64) and sink.dtype == np.float16 and not sink.any()
            assert pc.sink_bytes == 30 * 2 * 1 * 3 * 64 * 2
            first = pc.page_table([seq])[1][0]
            assert pc.read_sink(first).shape == (pc.sink_bytes,)
        else:
            assert sink is None and pc.sink_bytes == 0
            with pytest.raises(InvalidArgumentError, match="no sink rows"):
                pc.read_sink(0)
        pc.check()
    with pytest.raises(InvalidArgumentError, match="kv_format"):
        kvcache.PagedKVCache(1, 1, 8, 16, num_pages=4, kv_format="kivi2")
    with pytest.raises(InvalidArgumentError, match="power-of-two"):  # kivi4 rotates V
        kvcache.PagedKVCache(1, 1, 48, 16, num_pages=4, kv_format="kivi4")
    with kvcache.PagedKVCache(1, 1, 8, 16, num_pages=4) as pc:
        assert pc.kv_format is None and pc.kv_group is None


def test_kvfmt_prefix_hits_whole_groups():
    # P 16, G 64: a 100-token shared prefix of a 128-token prompt hits 64, not 96
    pc = kvcache.PagedKVCache(2, 2, 8, 16, num_pages=32, kv_format="kivi8")
    a = list(range(128))
    b = list(range(100)) + [1000 + i for i in range(20)]
    pc.add_sequence(a)
    assert pc.lookup_prefix(b) == 64
    _seq, hit = pc.add_sequence(b)
    assert hit == 64
    assert pc.lookup_prefix(a + [5]) == 128
    pc.check()


def test_kvfmt_truncate_ex_and_rollback():
    pc = kvcache.PagedKVCache(2, 2, 8, 16, num_pages=32, kv_format="kivi4")
    seq, _ = pc.add_sequence(150)  # groups [0, 64), [64, 128) quantized; tail 128..149
    with pytest.raises(InvalidArgumentError, match="truncate_ex"):
        pc.truncate(seq, 100)
    assert pc.seq_len(seq) == 150
    assert pc.truncate_ex(seq, 140) == 140  # within the tail
    assert pc.truncate_ex(seq, 100) == 64
    assert pc.seq_len(seq) == 64
    pc.append(seq, 86)
    pc.rollback(seq, 100)  # slots never written: exact
    assert pc.seq_len(seq) == 100
    pc.check()
    plain = kvcache.PagedKVCache(1, 1, 8, 4, num_pages=16)
    s2, _ = plain.add_sequence(30)
    assert plain.truncate_ex(s2, 13) == 13


def test_kvfmt_fork_copies_tail():
    pc = kvcache.PagedKVCache(2, 2, 8, 16, num_pages=16, kv_format="kivi8")
    a, _ = pc.add_sequence(40)
    b = pc.fork(a)
    np.testing.assert_array_equal(pc.tail(a, 1), pc.tail(b, 1))
    pc.free(a)
    assert pc.tail(b, 1).shape == (2, 64, 2, 8)
    pc.check()
