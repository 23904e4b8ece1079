"""Builders of pmx operator test cases: caches of every storage config and
layout, ragged batches with offset or paged slot maps, and runners that call
the binding and the reference on copies and compare every byte."""

from __future__ import annotations

import numpy as np

import kvcache
import kvc_reference as ref
from kvc_reference import assert_same_bytes


class Storage:
    """A storage config: T1, cache dtype (or "int4"), quant_bit, scale dtype."""

    def __init__(self, t1, t2, bits, sdt, group=8):
        self.t1 = np.dtype(t1)
        self.t2 = t2 if isinstance(t2, str) else np.dtype(t2)
        self.bits = bits
        self.sdt = None if sdt is None else np.dtype(sdt)
        self.group = group

    @classmethod
    def from_config(cls, config, group=8):
        _id, t1, t2, bits, sdt = config
        return cls(t1, t2, bits, sdt, group)

    @property
    def int4(self):
        return self.bits == 4

    def cache_last(self, dh):
        return dh // 2 if self.int4 else dh

    def make(self, rng, float_shape, dh):
        """(cache, scale|None) of a cache whose float shape ends in dh."""
        lead = tuple(float_shape[:-1])
        cache = ref.random_cache(rng, lead + (self.cache_last(dh),), self.t2)
        scale = None
        if self.bits:
            scale = ref.random_scale(rng, lead + (dh // self.group,), self.sdt)
        return cache, scale

    def attrs(self):
        return dict(quant_bit=self.bits, quant_group=self.group)


def copy_or_none(a):
    return None if a is None else a.copy()


def check_bytes_unchanged(before, after, what):
    if before is None:
        assert after is None
        return
    assert_same_bytes(after, before, what + " (must be unchanged)")


# ---------------------------------------------------------------------------
# static


def static_shape(layout, max_b, num_layer, max_s, heads, dh):
    return ref.static_cache_shape(layout, max_b, num_layer, max_s, heads, dh)


def run_static(cache, scale, ck, cv, start_pos, attrs, n_threads=None, what="static"):
    """Runs the binding on cache/scale (in place) and the reference on copies;
    checks outputs and the whole cache/scale bytes. attrs: operator keywords
    (num_layer, layer_idx, quant_bit, quant_group, num_repeat, cache_layout)."""
    ecache, escale = cache.copy(), copy_or_none(scale)
    rattrs = {k: v for k, v in attrs.items() if k != "num_layer"}
    ek, ev = ref.key_value_cache(ck, cv, start_pos, ecache, escale, **rattrs)
    k, v = kvcache.pmx.key_value_cache(ck, cv, start_pos, cache, scale, n_threads=n_threads,
                                       **attrs)
    assert_same_bytes(k, ek, what + ": key")
    assert_same_bytes(v, ev, what + ": value")
    assert_same_bytes(cache, ecache, what + ": cache")
    if scale is not None:
        assert_same_bytes(scale, escale, what + ": scale")
    return k, v


# ---------------------------------------------------------------------------
# dynamic


class DynamicSession:
    """A dynamic-batching cache with n_seqs sequences of capacity cap tokens
    each, placed at random disjoint regions (cache_mode 0) or on random pages
    (cache_mode 1, page_size tokens each) of MaxT, with gaps and spare room."""

    def __init__(self, rng, storage: Storage, *, layout, mode, page_size=128, heads=2, dh=16,
                 num_layer=1, layer_idx=0, num_repeat=1, n_seqs=4, cap=9):
        self.rng = rng
        self.st = storage
        self.layout, self.mode, self.page_size = layout, mode, page_size
        self.heads, self.dh = heads, dh
        self.num_layer, self.layer_idx, self.num_repeat = num_layer, layer_idx, num_repeat
        self.cap = cap
        self.lengths = [0] * n_seqs
        if mode == 0:
            order = rng.permutation(n_seqs)
            self.offsets = [0] * n_seqs
            pos = int(rng.integers(0, 3))
            for s in order:
                self.offsets[s] = pos
                pos += cap + int(rng.integers(0, 3))
            self.max_t = pos + 2
        else:
            self.pages_per_seq = -(-cap // page_size)
            total = n_seqs * self.pages_per_seq + 2
            perm = rng.permutation(total)
            self.pages = [
                [int(p) * page_size for p in perm[s * self.pages_per_seq:
                                                  (s + 1) * self.pages_per_seq]]
                for s in range(n_seqs)]
            self.max_t = total * page_size
            self.max_p = self.pages_per_seq + 1
        shape = ref.dynamic_cache_shape(layout, self.max_t, num_layer, heads, dh)
        self.cache, self.scale = storage.make(rng, shape, dh)

    def attrs(self):
        return dict(num_layer=self.num_layer, layer_idx=self.layer_idx,
                    num_repeat=self.num_repeat, cache_mode=self.mode,
                    cache_layout=self.layout, page_size=self.page_size, **self.st.attrs())

    def build(self, batch, slack=0):
        """Arguments for one call. batch: list of (seq, S_b) to append S_b
        tokens to seq, or (seq, S_b, p_b) to store at p_b explicitly."""
        seqlens, kvlens, spos, cst = [], [], [], []
        for item in batch:
            seq, s_b = item[0], item[1]
            p_b = item[2] if len(item) > 2 else self.lengths[seq]
            seqlens.append(s_b)
            kvlens.append(p_b + s_b)
            spos.append(p_b)
            assert p_b + s_b <= self.cap
            if self.mode == 0:
                cst.append(self.offsets[seq])
            else:
                need = -(-(p_b + s_b) // self.page_size)
                row = self.pages[seq][:need] + [-1] * (self.max_p - need)
                cst.append(row)
        seqstarts = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int64)
        kvstarts = np.concatenate([[0], np.cumsum(kvlens)]).astype(np.int64)
        n = int(seqstarts[-1])
        shape = (n, self.heads, self.dh)
        ck = ref.random_input(self.rng, shape, self.st.t1)
        cv = ref.random_input(self.rng, shape, self.st.t1)
        return dict(
            current_key=ck, current_value=cv, seqstarts=seqstarts, kvstarts=kvstarts,
            cachestarts=np.array(cst, np.int64).reshape((len(batch),) if self.mode == 0
                                                        else (len(batch), self.max_p)),
            start_pos=np.array(spos, np.int64),
            max_seqlen=max(seqlens, default=0) + slack,
            max_kvlen=max(kvlens, default=0) + slack)

    def run(self, args, n_threads=None, what="dynamic", cache=None, scale=None):
        """Calls binding and reference (on copies) with args from build();
        compares outputs and all cache/scale bytes. cache/scale default to the
        session's (pass views to test non-contiguous caches)."""
        cache = self.cache if cache is None else cache
        scale = self.scale if scale is None else scale
        ecache, escale = cache.copy(), copy_or_none(scale)
        a = self.attrs()
        ek, ev = ref.dynamic_key_value_cache(
            args["current_key"], args["current_value"], args["seqstarts"], args["kvstarts"],
            args["cachestarts"], args["start_pos"], ecache, escale,
            layer_idx=a["layer_idx"], quant_bit=a["quant_bit"], quant_group=a["quant_group"],
            num_repeat=a["num_repeat"], cache_mode=a["cache_mode"],
            cache_layout=a["cache_layout"], page_size=a["page_size"])
        k, v = kvcache.pmx.dynamic_key_value_cache(cache=cache, scale=scale, n_threads=n_threads,
                                                   **args, **a)
        assert_same_bytes(k, ek, what + ": key")
        assert_same_bytes(v, ev, what + ": value")
        assert_same_bytes(cache, ecache, what + ": cache")
        if scale is not None:
            assert_same_bytes(scale, escale, what + ": scale")
        return k, v

    def step(self, batch, slack=0, **kw):
        args = self.build(batch, slack)
        out = self.run(args, **kw)
        for item in batch:
            seq, s_b = item[0], item[1]
            p_b = item[2] if len(item) > 2 else self.lengths[seq]
            self.lengths[seq] = max(self.lengths[seq], p_b + s_b)
        return out
