"""float64 numpy references for prefill attention, batched prefill (paged and
ragged), multi-level cascade attention and the pmx
dynamic_batching.MultiHeadCacheAttention operator, written from
shared/docs/SEMANTICS.md section 5 and pmx-notes.md section 4 (not from the C
code), plus storage and page-table builders for their tests.

Attention (SEMANTICS 5), per request with qo_len query rows and kv_len keys:

    s_ij = sm_scale * q_i . k_j                     sm_scale default 1/sqrt(Dh)
    s_ij = cap * tanh(s_ij / cap)                   when logits_soft_cap > 0
    visible(i, j): custom mask if given, else causal (bottom-right)
                   j <= i + kv_len - qo_len, else every j; window_left w >= 0
                   also requires j >= i + kv_len - qo_len - w
    o_i   = sum_j softmax_j(s_i)_j v_j over visible j
    lse_i = log2(sum_j exp(s_ij))                   base 2
    a row with no visible key: o_i = 0, lse_i = -inf
Query head h reads KV head h // (Hq // H).

Everything is computed in float64 from the values the C code is given: q as
stored (float16/bfloat16 values are exact in float64) and K/V dequantized per
SEMANTICS 1 (float32 q * scale, kvc_reference.dequantize).
"""

from __future__ import annotations

import math

import numpy as np

import kvc_reference as ref

F32, F16, BF16, I8, U8 = ref.F32, ref.F16, ref.BF16, ref.I8, ref.U8
LN2 = math.log(2.0)

STORAGES = ("f32", "f16", "bf16", "int8", "int4")
FLOAT_STORAGE = {"f32": F32, "f16": F16, "bf16": BF16}
Q_DTYPES = (F32, F16, BF16)
DT_NAMES = {F32: "f32", F16: "f16", BF16: "bf16"}


def f64(x):
    """float64 copy of a float32/float16/bfloat16 array (exact)."""
    return np.asarray(x).astype(np.float32).astype(np.float64)


# ---------------------------------------------------------------------------
# Tolerances and comparison


def out_tol(dtype):
    """rtol = atol for an output of dtype: 1e-5 float32, 1e-3 16-bit."""
    return 1e-5 if np.dtype(dtype) == F32 else 1e-3


def lse_tol(q_dtype):
    return 1e-5 if np.dtype(q_dtype) == F32 else 1e-3


def half_ulp(x, dtype):
    """Half a unit in the last place of dtype at |x| (0 for float32 and
    float16, whose rounding error is inside the 1e-5 / 1e-3 tolerances): the
    rounding error of storing the exact result in a bfloat16 output, which
    alone can exceed 1e-3 relative (bfloat16 has 8 significant bits)."""
    if np.dtype(dtype) != BF16:
        return 0.0
    mag = np.maximum(np.abs(x), 2.0**-126)
    return np.exp2(np.floor(np.log2(mag)) - 8)


def assert_close(got, want, tol, what, out_dtype=None):
    """got (any float dtype) vs want (float64): same shape, no NaN, the same
    infinities, and |got - want| <= tol * (1 + |want|) (+ one rounding step
    of a bfloat16 output) elsewhere."""
    got = np.asarray(got)
    out_dtype = got.dtype if out_dtype is None else np.dtype(out_dtype)
    g = got.astype(np.float32).astype(np.float64)
    want = np.asarray(want, np.float64)
    assert g.shape == want.shape, f"{what}: shape {g.shape} != {want.shape}"
    assert not np.isnan(g).any(), f"{what}: NaN at {np.argwhere(np.isnan(g))[:4].tolist()}"
    inf_w = np.isinf(want)
    bad_inf = np.isinf(g) != inf_w
    assert not bad_inf.any(), (
        f"{what}: infinities differ at {np.argwhere(bad_inf)[:4].tolist()} (got "
        f"{g[bad_inf][:4]}, expected {want[bad_inf][:4]})")
    assert np.array_equal(g[inf_w], want[inf_w]), f"{what}: signs of infinities differ"
    gf, wf = g[~inf_w], want[~inf_w]
    bound = tol * (1.0 + np.abs(wf)) + half_ulp(wf, out_dtype) * 2
    err = np.abs(gf - wf)
    if not np.all(err <= bound):
        idx = np.argwhere(~inf_w)[np.argmax(err - bound)]
        worst = int(np.argmax(err - bound))
        n_bad = int(np.count_nonzero(err > bound))
        raise AssertionError(
            f"{what}: {n_bad} of {err.size} values off (rtol=atol={tol}); worst at "
            f"{tuple(int(i) for i in idx)}: got {gf[worst]!r}, expected {wf[worst]!r}")


# ---------------------------------------------------------------------------
# Masks


def visible(qo_len, kv_len, causal=False, window_left=-1, custom=None):
    """(qo_len, kv_len) bool: which keys each query row sees (SEMANTICS 5)."""
    i = np.arange(qo_len)[:, None]
    j = np.arange(kv_len)[None, :]
    if custom is not None:
        vis = np.asarray(custom).reshape(qo_len, kv_len) != 0
    elif causal:
        vis = j <= i + kv_len - qo_len
    else:
        vis = np.ones((qo_len, kv_len), bool)
    if window_left >= 0:
        vis = vis & (j >= i + kv_len - qo_len - window_left)
    return np.broadcast_to(vis, (qo_len, kv_len)).copy()


def pack_little(mask_bool):
    """One request's boolean mask packed little-endian (bit n = element n of
    the row-major flattening), padded to a byte; numpy's packbits, not
    kvcache's."""
    return np.packbits(np.asarray(mask_bool, bool).reshape(-1), bitorder="little")


# ---------------------------------------------------------------------------
# Attention


def attention(q, k, v, vis, sm_scale=None, cap=None, bias=None):
    """q (Lq, Hq, D), k/v (Lk, H, D) float64; vis (Lq, Lk) or (Hq, Lq, Lk)
    bool; bias: additive float64 scores (broadcast to (Hq, Lq, Lk)) or None
    (an entry -inf hides the key). Returns o (Lq, Hq, D), lse (Lq, Hq) base 2.
    Computed per KV head on the (Lq * group, Lk) score matrix of its query
    heads."""
    lq, hq, d = q.shape
    lk, h = k.shape[0], k.shape[1]
    assert hq % h == 0
    o = np.zeros((lq, hq, d))
    lse = np.full((lq, hq), -np.inf)
    if lq == 0 or lk == 0:
        return o, lse
    group = hq // h
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    vis = np.asarray(vis, bool)
    if bias is not None:
        bias = np.broadcast_to(bias, (hq, lq, lk))
    for kh in range(h):
        heads = slice(kh * group, (kh + 1) * group)
        qs = np.ascontiguousarray(q[:, heads, :]).reshape(lq * group, d)
        s = (qs @ np.ascontiguousarray(k[:, kh, :]).T).reshape(lq, group, lk)
        s *= scale
        if cap is not None and cap > 0:
            s = cap * np.tanh(s / cap)
        if bias is not None:
            s += bias[heads].transpose(1, 0, 2)
        if vis.ndim == 2:
            vis_g = np.broadcast_to(vis[:, None, :], s.shape)
        else:
            vis_g = vis[heads].transpose(1, 0, 2)
        vis_g = vis_g & ~np.isneginf(s)
        s[~vis_g] = -np.inf
        empty = ~vis_g.any(axis=-1)  # (Lq, group)
        m = np.where(empty, 0.0, s.max(axis=-1))
        s -= m[..., None]
        np.exp(s, out=s)  # exp(-inf) = 0 for hidden keys
        den = s.sum(axis=-1)
        den_safe = np.where(empty, 1.0, den)
        out = (s.reshape(lq * group, lk) @ np.ascontiguousarray(v[:, kh, :])).reshape(
            lq, group, d) / den_safe[..., None]
        o[:, heads] = np.where(empty[..., None], 0.0, out)
        lse[:, heads] = np.where(empty, -np.inf, (m + np.log(den_safe)) / LN2)
    return o, lse


def prefill(q, k, v, causal=False, window_left=-1, custom=None, sm_scale=None, cap=None):
    """One request: q (qo_len, Hq, D), k/v (kv_len, H, D) float64."""
    vis = visible(q.shape[0], k.shape[0], causal, window_left, custom)
    return attention(q, k, v, vis, sm_scale, cap)


def batch_prefill(q, kv, qo_indptr, causal=False, window_left=-1, custom_flat=None,
                  sm_scale=None, cap=None):
    """Batched prefill: q (nnz, Hq, D) float64, kv list of per-request (k, v)
    float64 (kv_len_b, H, D); custom_flat: the flat concatenation of the
    row-major per-request masks, or None. Returns o (nnz, Hq, D), lse (nnz, Hq)."""
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    off = 0
    for b, (k, v) in enumerate(kv):
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        n = (hi - lo) * k.shape[0]
        custom = None
        if custom_flat is not None:
            custom = np.asarray(custom_flat[off:off + n]).reshape(hi - lo, k.shape[0])
            off += n
        o[lo:hi], lse[lo:hi] = prefill(q[lo:hi], k, v, causal, window_left, custom, sm_scale,
                                       cap)
    return o, lse


def cascade(q, levels, causal=False, window_left=-1, sm_scale=None, cap=None):
    """Multi-level cascade, computed as one softmax over the union of every
    level's keys (merging log-sum-exp states of disjoint key sets is exactly
    that): levels is a list of (qo_indptr, kv) with kv the per-request (k, v)
    float64 of that level; causal applies to the last level only, window and
    parameters to every level with that level's qo_len / kv_len.
    Returns o (nnz, Hq, D), lse (nnz, Hq)."""
    nnz = q.shape[0]
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for row in range(nnz):
        ks, vs, vis = [], [], []
        for li, (qo_indptr, kv) in enumerate(levels):
            qo_indptr = np.asarray(qo_indptr)
            b = int(np.searchsorted(qo_indptr, row, side="right")) - 1
            lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
            assert lo <= row < hi
            k, v = kv[b]
            c = causal and li == len(levels) - 1
            vis_req = visible(hi - lo, k.shape[0], c, window_left)
            ks.append(k)
            vs.append(v)
            vis.append(vis_req[row - lo])
        k_all = np.concatenate(ks, axis=0)
        v_all = np.concatenate(vs, axis=0)
        vis_all = np.concatenate(vis)[None, :]
        o[row:row + 1], lse[row:row + 1] = attention(q[row:row + 1], k_all, v_all, vis_all,
                                                     sm_scale, cap)
    return o, lse


# ---------------------------------------------------------------------------
# Storage


def make_storage(rng, shape, storage, group=8, scale_dtype=F32, mag=1.0):
    """Random values of shape (..., Dh) stored as storage ("f32", "f16",
    "bf16", "int8", "int4") -> (stored array, scale array or None, dequantized
    float64 values). int4 arrays are uint8 with last dimension Dh / 2."""
    x = (mag * rng.standard_normal(shape)).astype(np.float32)
    if storage in FLOAT_STORAGE:
        st = x.astype(FLOAT_STORAGE[storage])
        return st, None, f64(st)
    bits = 8 if storage == "int8" else 4
    q, s = ref.quantize(x, bits, group, scale_dtype)
    deq = f64(ref.dequantize(q, s, group, F32))
    return (q if bits == 8 else ref.pack4(q)), s, deq


def random_q(rng, shape, dtype, mag=1.0):
    return (mag * rng.standard_normal(shape)).astype(np.float32).astype(dtype)


def to_layout(arr, layout):
    """NHD (n, H, X) -> the layout's (n, H, X) or (H, n, X), contiguous."""
    if arr is None:
        return None
    return arr if layout == "NHD" else np.ascontiguousarray(arr.transpose(1, 0, 2))


# ---------------------------------------------------------------------------
# Paged caches


class Paged:
    """A paged cache with random page ids (and spare pages full of other
    values) holding requests of the given lengths.

    Attributes: indptr, indices, last (the CSR page table, int32), cache and
    scale (the arguments for run: one combined array, or (k, v) pairs), kv
    (per-request float64 (k, v), (len, H, Dh)), deq (dequantized float64 of
    the whole combined cache, (max_pages, 2, *page_shape))."""

    def __init__(self, rng, lens, page_size, heads, dh, storage, layout="NHD", combined=True,
                 group=8, scale_dtype=None, spare=3, mag=1.0, like=None):
        """like: another Paged whose page table (and cache size) to reuse."""
        self.lens = [int(n) for n in lens]
        self.page_size, self.heads, self.dh, self.layout = page_size, heads, dh, layout
        pages = [-(-n // page_size) for n in self.lens]
        self.max_pages = sum(pages) + spare
        self.indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        self.indices = rng.permutation(self.max_pages)[:int(self.indptr[-1])].astype(np.int32)
        if like is not None:
            assert like.lens == self.lens and like.page_size == page_size
            self.max_pages, self.indices = like.max_pages, like.indices
        self.last = np.array([0 if n == 0 else n - page_size * (p - 1)
                              for n, p in zip(self.lens, pages)], np.int32)
        self.page_shape = (page_size, heads, dh) if layout == "NHD" else (heads, page_size, dh)
        if scale_dtype is None:
            scale_dtype = F16 if storage == "int4" else F32
        st, sc, self.deq = make_storage(rng, (self.max_pages, 2) + self.page_shape, storage,
                                        group, scale_dtype, mag)
        self.storage, self.group = storage, group
        self.stored, self.stored_scale = st, sc
        if combined:
            self.cache, self.scale = st, sc
        else:
            self.cache = (np.ascontiguousarray(st[:, 0]), np.ascontiguousarray(st[:, 1]))
            self.scale = None if sc is None else (np.ascontiguousarray(sc[:, 0]),
                                                  np.ascontiguousarray(sc[:, 1]))
        self.kv = [self.gather(self.indices[self.indptr[b]:self.indptr[b + 1]], n)
                   for b, n in enumerate(self.lens)]

    def gather(self, page_ids, n):
        """(k, v) float64 (n, H, Dh) of the first n tokens of pages page_ids."""
        pg = self.deq[np.asarray(page_ids, np.int64)]  # (p, 2, *page_shape)
        if self.layout == "HND":
            pg = pg.transpose(0, 1, 3, 2, 4)
        pg = pg.transpose(1, 0, 2, 3, 4).reshape(2, -1, self.heads, self.dh)[:, :n]
        return pg[0], pg[1]

    def table(self):
        return self.indptr, self.indices, self.last

    def stored_request(self, b):
        """Request b's K/V as stored (storage dtype, NHD (len, H, last)) and
        their scales (or None): the inputs of an equivalent single prefill."""
        ids = self.indices[self.indptr[b]:self.indptr[b + 1]].astype(np.int64)
        n = self.lens[b]

        def rows(arr):
            pg = arr[ids]  # (p, 2, *page_shape[:-1], last)
            if self.layout == "HND":
                pg = pg.transpose(0, 1, 3, 2, 4)
            last = pg.shape[-1]
            pg = pg.transpose(1, 0, 2, 3, 4).reshape(2, -1, self.heads, last)[:, :n]
            return np.ascontiguousarray(pg[0]), np.ascontiguousarray(pg[1])

        k, v = rows(self.stored)
        if self.stored_scale is None:
            return k, v, None, None
        ks, vs = rows(self.stored_scale)
        return k, v, ks, vs


def indptr_of(lens):
    return np.concatenate([[0], np.cumsum(np.asarray(lens, np.int64))]).astype(np.int32)


# ---------------------------------------------------------------------------
# pmx dynamic_batching.MultiHeadCacheAttention (pmx-notes section 4)


def mhca(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
         decoding_batches, cache, scale, attn_mask=None, *, num_heads, head_dim, is_causal=True,
         num_kv_heads=0, layer_idx=0, quant_bit=0, quant_group=8, cache_mode=0, cache_layout=0,
         page_size=128):
    """Reference of kvcache.pmx.dynamic_multi_head_cache_attention.

    Step 1 stores the new K/V exactly as dynamic_batching.KeyValueCache
    (kvc_reference.dynamic_key_value_cache, mutating cache/scale in place).
    Step 2, per batch b with S_b queries and kvlen_b keys (positions
    [0, kvlen_b) read back from the cache, dequantized to float32 values):
    scores q.k / sqrt(head_dim), plus attn_mask[..., seqstarts[b]:seqstarts[b+1],
    kvstarts[b]:kvstarts[b+1]] (additive; 2-D (sum S, >= sum kvlen) or 3-D
    (num_heads, sum S, >= sum kvlen)), causal bottom-right (key j hidden from
    query i when j > i + kvlen_b - S_b) when is_causal and b >=
    decoding_batches; softmax; rows with no visible key give 0.
    Returns attn_output float64 (seqstarts[B], num_heads, head_dim)."""
    H = num_kv_heads or num_heads
    ref.dynamic_key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts,
                                start_pos, cache, scale, layer_idx=layer_idx,
                                quant_bit=quant_bit, quant_group=quant_group, num_repeat=1,
                                cache_mode=cache_mode, cache_layout=cache_layout,
                                page_size=page_size)
    st = ref.Storage(quant_bit, quant_group)
    q = f64(query)
    out = np.zeros((q.shape[0], num_heads, head_dim))
    mask = None if attn_mask is None else f64(attn_mask)
    B = len(seqstarts) - 1
    for b in range(B):
        s0, s1 = int(seqstarts[b]), int(seqstarts[b + 1])
        k0, k1 = int(kvstarts[b]), int(kvstarts[b + 1])
        sl, kl = s1 - s0, k1 - k0
        if sl == 0:
            continue
        kv = np.zeros((2, kl, H, head_dim))
        for t in range(kl):
            slot = ref.slot_of(cachestarts, cache_mode, page_size, b, t)
            for which in range(2):
                for h in range(H):
                    idx = ref.dynamic_index(cache_layout, layer_idx, which, slot, h)
                    kv[which, t, h] = f64(st.load(cache, scale, idx, F32))
        causal = bool(is_causal) and b >= decoding_batches
        vis = visible(sl, kl, causal)
        bias = None
        if mask is not None:
            bias = mask[..., s0:s1, k0:k1]
            if bias.ndim == 2:
                bias = bias[None]
        o, _ = attention(q[s0:s1], kv[0], kv[1], vis, 1.0 / math.sqrt(head_dim), None, bias)
        out[s0:s1] = o
    return out
