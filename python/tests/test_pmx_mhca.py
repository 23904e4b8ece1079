"""kvcache.pmx.dynamic_multi_head_cache_attention
(opmx.dynamic_batching::MultiHeadCacheAttention, pmx-notes section 4)
against the reference in attn_reference.mhca: the store must match the
dynamic KeyValueCache reference byte for byte (kvc_reference, SEMANTICS 3),
and the attention output the float64 reference on the dequantized cache
(SEMANTICS 5 tolerances: 1e-5 for float32 queries, 1e-3 for 16-bit, plus the
rounding step of a bfloat16 output).

Every cache_layout (0-3) x cache_mode (0 offset, 1 paged) x quant_bit
(0, 8, 4) runs two steps on one cache: a prefill of several sequences, then
a mixed batch (decoding_batches decode sequences first, then a chunked
prefill continuing a sequence and a fresh prefill), with no mask, a 2-D mask
or a 3-D mask (additive, with -inf entries), and grouped KV heads.
"""

from __future__ import annotations

import numpy as np
import pytest

import attn_reference as ar
import kvcache
from attn_reference import BF16, F16, F32, assert_close, out_tol
from kvc_reference import assert_same_bytes
from pmx_cases import DynamicSession, Storage

mhca = kvcache.pmx.dynamic_multi_head_cache_attention


def _available() -> str | None:
    try:
        kvcache.pmx.kvc_pmx_mhca_default_params()
    except kvcache.UnsupportedError as exc:
        return str(exc)
    return None


_WHY = _available()
needs_mhca = pytest.mark.skipif(_WHY is not None, reason=f"MHCA not in the library: {_WHY}")

T1S = (F32, F16, BF16)
FLOAT_CACHES = (F32, F16, BF16)
HEAD_DIMS = (16, 32, 64)
PAGE_SIZES = (1, 3, 16, 128)
MASK_KINDS = ("none", "2d", "3d")


class Mhca:
    """A DynamicSession (cache, slot maps) plus the attention attributes."""

    def __init__(self, rng, *, layout, mode, bits, t1=F32, cache_dt=F32, sdt=F32, group=8,
                 num_heads=4, num_kv_heads=2, dh=16, page_size=3, num_layer=1, layer_idx=0,
                 cap=12, n_seqs=4, is_causal=True):
        t2 = {0: cache_dt, 8: np.int8, 4: "int4"}[bits]
        self.rng = rng
        self.kvh = num_kv_heads or num_heads
        self.sess = DynamicSession(rng, Storage(t1, t2, bits, sdt if bits else None, group),
                                   layout=layout, mode=mode, page_size=page_size,
                                   heads=self.kvh, dh=dh, num_layer=num_layer,
                                   layer_idx=layer_idx, n_seqs=n_seqs, cap=cap)
        self.t1 = np.dtype(t1)
        self.attrs = dict(num_heads=num_heads, head_dim=dh, is_causal=is_causal,
                          num_kv_heads=num_kv_heads, num_layer=num_layer, layer_idx=layer_idx,
                          quant_bit=bits, quant_group=group, cache_mode=mode,
                          cache_layout=layout, page_size=page_size)

    def build(self, batch, mask_kind="none", slack=0):
        """Arguments of one call (batch as DynamicSession.build), with
        standard normal K/V/query (moderate scores) and a mask."""
        a = self.sess.build(batch, slack)
        n = int(a["seqstarts"][-1])
        nkv = int(a["kvstarts"][-1])
        h, dh = self.attrs["num_heads"], self.attrs["head_dim"]
        a["current_key"] = ar.random_q(self.rng, (n, self.kvh, dh), self.t1)
        a["current_value"] = ar.random_q(self.rng, (n, self.kvh, dh), self.t1)
        a["query"] = ar.random_q(self.rng, (n, h, dh), self.t1, mag=1.5)
        a["attn_mask"] = None
        if mask_kind != "none":
            shape = (n, nkv + 3) if mask_kind == "2d" else (h, n, nkv + 3)
            m = (0.5 * self.rng.standard_normal(shape)).astype(np.float32)
            m[self.rng.random(shape) < 0.15] = -np.inf
            for b in range(len(batch)):  # key 0 of each batch stays visible to all rows
                m[..., int(a["seqstarts"][b]):int(a["seqstarts"][b + 1]), int(a["kvstarts"][b])] = 0.25
            a["attn_mask"] = m.astype(self.t1)
        return a

    def run(self, a, decoding_batches, what, num_threads=None, check=True):
        """Runs the operator on the session's cache and the reference on
        copies; compares the cache/scale bytes and the output."""
        sess = self.sess
        ecache, escale = sess.cache.copy(), None if sess.scale is None else sess.scale.copy()
        want = ar.mhca(a["query"], a["current_key"], a["current_value"], a["seqstarts"],
                       a["kvstarts"], a["cachestarts"], a["start_pos"], decoding_batches,
                       ecache, escale, a["attn_mask"], **self._ref_attrs())
        out = mhca(a["query"], a["current_key"], a["current_value"], a["seqstarts"],
                   a["kvstarts"], a["cachestarts"], a["start_pos"], decoding_batches,
                   a["max_seqlen"], a["max_kvlen"], sess.cache, sess.scale, a["attn_mask"],
                   num_threads=num_threads, **self.attrs)
        assert out.dtype == self.t1 and out.shape == a["query"].shape
        assert_same_bytes(sess.cache, ecache, what + ": cache")
        if escale is not None:
            assert_same_bytes(sess.scale, escale, what + ": scale")
        if check:
            assert_close(out, want, out_tol(self.t1), what + ": attn_output")
        return out, want

    def _ref_attrs(self):
        a = dict(self.attrs)
        del a["num_layer"]
        return a

    def advance(self, batch):
        for item in batch:
            seq, s_b = item[0], item[1]
            p_b = item[2] if len(item) > 2 else self.sess.lengths[seq]
            self.sess.lengths[seq] = max(self.sess.lengths[seq], p_b + s_b)


STEP1 = [(0, 5), (1, 3), (2, 1)]  # prefills from position 0
STEP2 = [(2, 1), (1, 1), (0, 4), (3, 6)]  # 2 decodes, a chunked prefill, a fresh prefill


def grid():
    cases = []
    i = 0
    for layout in range(4):
        for mode in (0, 1):
            for bits in (0, 8, 4):
                cases.append(dict(layout=layout, mode=mode, bits=bits, i=i))
                i += 1
    return cases


GRID = grid()


def grid_id(c):
    return f"layout{c['layout']}-mode{c['mode']}-q{c['bits']}"


def grid_session(rng, c):
    i = c["i"]
    num_heads, kvh = ((4, 2), (4, 0), (8, 1), (4, 4))[i % 4]
    return Mhca(rng, layout=c["layout"], mode=c["mode"], bits=c["bits"], t1=T1S[i % 3],
                cache_dt=FLOAT_CACHES[(i // 3) % 3], sdt=(F32, F16)[(i // 2) % 2],
                group=(8, 4, 16)[i % 3] if c["bits"] != 4 else (8, 2)[i % 2],
                num_heads=num_heads, num_kv_heads=kvh, dh=HEAD_DIMS[(i // 4) % 3],
                page_size=PAGE_SIZES[i % 4], num_layer=(1, 2)[i % 2], layer_idx=i % 2,
                is_causal=(i % 7 != 3))


@needs_mhca
@pytest.mark.parametrize("c", GRID, ids=[grid_id(c) for c in GRID])
def test_mhca_grid(isa, rng, c):
    m = grid_session(rng, c)
    i = c["i"]
    a = m.build(STEP1, MASK_KINDS[i % 3])
    m.run(a, 0, f"{grid_id(c)} step 1")
    m.advance(STEP1)
    a = m.build(STEP2, MASK_KINDS[(i + 1) % 3], slack=i % 2)
    m.run(a, 2, f"{grid_id(c)} step 2")
    m.advance(STEP2)


@needs_mhca
def test_mhca_every_isa_and_threads(isa, rng):
    """Each ISA; 1 and 2 threads give the same bytes (output, cache, scale)."""
    for bits, layout, mode in ((8, 3, 1), (4, 0, 0), (0, 2, 1)):
        m = Mhca(rng, layout=layout, mode=mode, bits=bits, t1=F16, cache_dt=BF16, dh=32,
                 num_heads=8, num_kv_heads=2)
        a = m.build(STEP1, "2d")
        m.run(a, 0, f"{isa} q{bits} step 1")
        m.advance(STEP1)
        a = m.build(STEP2, "3d")
        cache0 = m.sess.cache.copy()
        scale0 = None if m.sess.scale is None else m.sess.scale.copy()
        out1, _ = m.run(a, 2, f"{isa} q{bits} step 2 (1 thread)", num_threads=1)
        cache1 = m.sess.cache.copy()
        m.sess.cache[...] = cache0
        if scale0 is not None:
            m.sess.scale[...] = scale0
        out2, _ = m.run(a, 2, f"{isa} q{bits} step 2 (2 threads)", num_threads=2)
        assert_same_bytes(out2, out1, "attn_output, 1 vs 2 threads")
        assert_same_bytes(m.sess.cache, cache1, "cache, 1 vs 2 threads")


@needs_mhca
def test_mhca_causal_and_decoding_batches(rng):
    """Prefill batches get the bottom-right causal mask; the first
    decoding_batches batches never do (pmx reference); is_causal=False turns
    it off everywhere."""
    for is_causal in (True, False):
        m = Mhca(rng, layout=0, mode=0, bits=0, t1=F32, num_heads=4, num_kv_heads=2, dh=16,
                 is_causal=is_causal)
        a = m.build(STEP1)
        out, _ = m.run(a, 0, f"is_causal={is_causal}")
        # independent check of row 0 of batch 0 (a 5-token prefill): with
        # causal it sees key 0 only, so its output is V of token 0
        v0 = np.repeat(a["current_value"][0].astype(np.float64), 2, axis=0)
        if is_causal:
            np.testing.assert_allclose(out[0], v0, rtol=1e-6, atol=1e-6)
        else:
            assert not np.allclose(out[0], v0, rtol=1e-3, atol=1e-3)
        m.advance(STEP1)
    # a decoding batch with 2 new tokens (b < decoding_batches) is not
    # causal-masked: its first row also sees the second new token
    m = Mhca(rng, layout=1, mode=1, bits=8, t1=F32, num_heads=2, num_kv_heads=2, dh=16)
    a = m.build(STEP1)
    m.run(a, 0, "step 1")
    m.advance(STEP1)
    a = m.build([(0, 2), (1, 4)])
    as_prefill = ar.mhca(a["query"], a["current_key"], a["current_value"], a["seqstarts"],
                         a["kvstarts"], a["cachestarts"], a["start_pos"], 0,
                         m.sess.cache.copy(), m.sess.scale.copy(), None, **m._ref_attrs())
    _out, as_decode = m.run(a, 1, "decoding batch of 2 tokens")
    assert not np.allclose(as_decode[0], as_prefill[0], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(as_decode[1:], as_prefill[1:], rtol=1e-12, atol=1e-12)


@needs_mhca
def test_mhca_fully_masked_rows_give_zeros(rng):
    """A row whose every key is -inf in attn_mask gives 0 (SEMANTICS 5's
    empty-row rule), never NaN; other rows are unaffected."""
    m = Mhca(rng, layout=3, mode=1, bits=4, t1=F16, num_heads=4, num_kv_heads=2, dh=32)
    a = m.build(STEP1, "2d")
    a["attn_mask"][1, :] = -np.inf  # row 1 (batch 0) sees nothing
    out, want = m.run(a, 0, "masked row")
    assert not np.isnan(out.astype(np.float32)).any()
    assert np.all(out[1].astype(np.float32) == 0)
    assert np.all(want[1] == 0)


@needs_mhca
def test_mhca_huge_finite_mask_values_rank_keys(isa):
    """Finite masks beyond FLT_MAX / log2(e) (~2.36e38; torch.finfo(float32).min
    pads rows) are not -inf: a row masked by finfo.min everywhere attends like
    float32 scores plus that mask do (uniformly, the scores being absorbed),
    and +3e38 puts all the weight on its key. Only -inf hides a key."""
    x = np.ones((1, 1, 8), F32)
    v = np.array([[[1.0] * 8], [[2.0] * 8]], F32)  # V of keys 0 and 1 (key 1 is new)

    def attend(mask):
        cache = np.zeros((16, 1, 2, 1, 8), F32)
        cache[0, 0, 1] = v[0]  # key 0 is in the cache at slot 0
        cache[0, 0, 0] = x[0]
        return mhca(x, x, v[1:], [0, 1], [0, 2], [0], [1], 0, 1, 2, cache, None,
                    np.array([mask], F32), num_heads=1, head_dim=8)[0, 0, 0]

    fmin = np.finfo(F32).min
    assert attend([fmin, fmin]) == pytest.approx(1.5, abs=1e-6)
    assert attend([-2.4e38, -2.4e38]) == pytest.approx(1.5, abs=1e-6)
    assert attend([0.0, 3e38]) == pytest.approx(2.0, abs=1e-6)
    assert attend([3e38, 0.0]) == pytest.approx(1.0, abs=1e-6)
    assert attend([0.0, fmin]) == pytest.approx(1.0, abs=1e-6)
    assert attend([-np.inf, -np.inf]) == 0.0


@needs_mhca
def test_mhca_lengths_the_store_refuses_allocate_nothing_large():
    """kv lengths of 2^31 - 1 per batch that disagree with start_pos + seqlen
    are an argument error, not an out-of-memory after sizing the page list
    from them (1 TiB here: more than overcommit grants, so the old code
    failed with out-of-memory)."""
    B = 64
    x = np.ones((B, 1, 8), F32)
    cache = np.zeros((16, 1, 2, 1, 8), F32)
    kvs = np.arange(B + 1, dtype=np.int64) * (2**31 - 1)
    with pytest.raises(kvcache.InvalidArgumentError, match="start_pos"):
        mhca(x, x, x, np.arange(B + 1), kvs, np.zeros((B, 1), np.int64), np.zeros(B, np.int64),
             0, 1, 2**31, cache, num_heads=1, head_dim=8, cache_mode=1, page_size=1)
    assert not cache.any()


@needs_mhca
def test_mhca_empty_sequences_and_strided_cache(rng):
    """Batches with no new token (S_b = 0: nothing stored, no output row)
    and a cache that is a strided view of a larger buffer."""
    m = Mhca(rng, layout=2, mode=0, bits=8, t1=BF16, num_heads=4, num_kv_heads=1, dh=32,
             sdt=F16)
    a = m.build(STEP1, "3d")
    m.run(a, 0, "step 1")
    m.advance(STEP1)
    a = m.build([(0, 0), (1, 2), (3, 0)], "2d")
    m.run(a, 0, "empty batches")
    # the same operator on a strided view: a cache with padding around Dh
    sess = m.sess
    big = np.zeros(sess.cache.shape[:-1] + (sess.cache.shape[-1] + 8,), sess.cache.dtype)
    big[..., 4:-4] = sess.cache
    bigs = np.zeros(sess.scale.shape[:-1] + (sess.scale.shape[-1] + 2,), sess.scale.dtype)
    bigs[..., 1:-1] = sess.scale
    ecache, escale = sess.cache.copy(), sess.scale.copy()
    a = m.build([(2, 3)], "none")
    want = ar.mhca(a["query"], a["current_key"], a["current_value"], a["seqstarts"],
                   a["kvstarts"], a["cachestarts"], a["start_pos"], 0, ecache, escale, None,
                   **m._ref_attrs())
    out = mhca(a["query"], a["current_key"], a["current_value"], a["seqstarts"], a["kvstarts"],
               a["cachestarts"], a["start_pos"], 0, a["max_seqlen"], a["max_kvlen"],
               big[..., 4:-4], bigs[..., 1:-1], **m.attrs)
    assert_same_bytes(big[..., 4:-4], ecache, "strided cache")
    assert_same_bytes(bigs[..., 1:-1], escale, "strided scale")
    assert np.all(big[..., :4] == 0) and np.all(big[..., -4:] == 0)
    assert_close(out, want, out_tol(BF16), "strided attn_output")


@needs_mhca
def test_mhca_errors_leave_cache_unchanged(rng):
    E = kvcache.InvalidArgumentError
    m = Mhca(rng, layout=0, mode=1, bits=8, t1=F32, num_heads=4, num_kv_heads=2, dh=16)
    a = m.build(STEP1)
    m.run(a, 0, "step 1")
    m.advance(STEP1)
    a = m.build(STEP2, "2d")
    good_mask = a["attn_mask"]

    def call(over_args=None, over_attrs=None, decoding_batches=2):
        args = dict(a)
        args.update(over_args or {})
        attrs = dict(m.attrs)
        attrs.update(over_attrs or {})
        return mhca(args["query"], args["current_key"], args["current_value"],
                    args["seqstarts"], args["kvstarts"], args["cachestarts"],
                    args["start_pos"], decoding_batches, args["max_seqlen"],
                    args["max_kvlen"], m.sess.cache, args.get("scale", m.sess.scale),
                    args["attn_mask"], **attrs)

    cache0, scale0 = m.sess.cache.copy(), m.sess.scale.copy()
    nkv = int(a["kvstarts"][-1])
    bad = [
        ({"attn_mask": good_mask[:-1]}, {}, 2),  # rows != seqstarts[B]
        ({"attn_mask": good_mask[:, :nkv - 1]}, {}, 2),  # columns < kvstarts[B]
        ({"attn_mask": good_mask[None, None]}, {}, 2),  # 4-D
        ({"attn_mask": np.zeros((3,) + good_mask.shape, F32)}, {}, 2),  # 3 != num_heads
        ({"query": a["query"][:, :3]}, {}, 2),
        ({"query": a["query"][:, :, :8]}, {}, 2),
        ({"query": a["query"][:-1]}, {}, 2),
        ({"current_key": a["current_key"][:, :1]}, {}, 2),
        ({}, {"num_heads": 3}, 2),
        ({}, {"num_kv_heads": 3}, 2),
        ({}, {"head_dim": 32}, 2),
        ({}, {}, 5),  # decoding_batches > B
        ({}, {}, -1),
        ({"start_pos": a["start_pos"] + 1}, {}, 2),  # kvlen != start_pos + S
        ({"max_seqlen": 1}, {}, 2),
        ({"max_kvlen": 3}, {}, 2),
        ({"scale": None}, {}, 2),  # int8 without scale
        ({}, {"layer_idx": 1}, 2),  # layer_idx >= num_layer
        ({}, {"quant_group": 3}, 2),
        ({}, {"cache_layout": 4}, 2),
        ({"cachestarts": np.full_like(a["cachestarts"], -1)}, {}, 2),
    ]
    for over_args, over_attrs, dec in bad:
        with pytest.raises(E):
            call(over_args, over_attrs, dec)
        assert_same_bytes(m.sess.cache, cache0, f"cache after error {over_args.keys()} "
                                                f"{over_attrs} {dec}")
        assert_same_bytes(m.sess.scale, scale0, "scale after error")
    with pytest.raises(kvcache.UnsupportedError):
        call(over_attrs={"is_alibi": True})
    assert_same_bytes(m.sess.cache, cache0, "cache after is_alibi")
    with pytest.raises(TypeError):
        mhca(a["query"], a["current_key"], a["current_value"], a["seqstarts"], a["kvstarts"],
             a["cachestarts"], a["start_pos"], 2, a["max_seqlen"], a["max_kvlen"],
             m.sess.cache, m.sess.scale, None, head_dim=16)  # num_heads is required
    m.run(a, 2, "after errors")
