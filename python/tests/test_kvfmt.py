"""kvcache.kvfmt (kvc_kvfmt_append / kvc_kvfmt_attention, the compressed
paged KV formats kivi8/kivi4 of docs/KV_FORMATS.md) against the independent
numpy reference kvfmt_reference.py (written from the document, not from the
C code).

Bytes: the pages of every complete K group must equal the reference's
``Sequence.pages()`` byte for byte (a page shared by a complete and an
incomplete group, P > G, is compared on the complete group's bytes only), and
tail slot ``t % G`` the reference's float16 tail, bit for bit; pages no
sequence owns are never written. The same bytes for any thread count, any
chunking of the rows and any mix of sequences per call.

Attention: against float64 attention over ``Sequence.values()`` (the
dequantized groups and the float16 tail), causal, with the output multiplied
by the Hadamard matrix when V is rotated. Tolerances as test_attention.py's
for float16 caches (SEMANTICS 5): rtol = atol = 1e-3 on o (atol relative to
the largest |V| of the sequence, as V's scale is arbitrary here) and lse.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvcache
import kvfmt_reference as R
from kvcache import KVFormat, KVSeq

F16, F32, F64 = np.float16, np.float32, np.float64
LN2 = math.log(2.0)
BF16 = kvcache._lib.bfloat16_dtype()
O_TOL = 1e-3  # test_attention.tol(float16)
LSE_TOL = 1e-4  # test_attention.lse_tol(float32 q) is 1e-5: K zero points folded into q cost more
# 8-bit q . k on integer pair dot products (the scaled query rounded to int16
# per group, docs/KV_FORMATS.md section 6): float16's, test_attention.lse_tol
LSE_TOL_INT = 1e-3

kvfmt = kvcache.kvfmt


# ---------------------------------------------------------------------------
# Helpers


def ref_format(fmt: KVFormat) -> R.Format:
    """The reference's Format for a binding KVFormat (checked equal for members)."""
    rf = R.Format(fmt.bits, fmt.group, fmt.v_group, fmt.rotate_v, fmt.num_kv_heads,
                  fmt.head_dim, fmt.page_size, v_sym=not fmt.v_asym, window=fmt.window,
                  sink=fmt.sink)
    rf.check()
    if fmt.name in ("kivi8", "kivi4"):
        assert rf == R.member(fmt.name, fmt.num_kv_heads, fmt.head_dim, fmt.page_size)
    assert fmt.page_bytes == R.page_bytes(rf)
    assert fmt.tail_bytes == 2 * (fmt.group + fmt.window) * fmt.num_kv_heads * fmt.head_dim * 2
    assert fmt.sink_bytes == 2 * fmt.sink * fmt.num_kv_heads * fmt.head_dim * 2
    return rf


def make_kv(rng, n, H, Dh, mild=False):
    """K and V rows (n, H, Dh) float32: channel magnitudes from 1e-3 to 1e2,
    K channels with large offsets (K bias), constant K channels (scale 0, with
    a mix of -0 and +0 in one), zero V rows, tiny values (subnormal scales).
    mild: magnitudes up to ~10 only (for attention)."""
    hi = 1 if mild else 2
    mag = 10.0 ** rng.uniform(-3, hi, (1, H, Dh))
    k = rng.standard_normal((n, H, Dh)) * mag
    v = rng.standard_normal((n, H, Dh)) * 10.0 ** rng.uniform(-3, hi, (1, H, Dh))
    c = rng.permutation(Dh)
    k[:, :, c[0]] += 300.0 if not mild else 20.0  # biased channels
    k[:, :, c[1]] -= 1000.0 if not mild else 8.0
    k[:, :, c[2]] = 1.25  # a constant channel: scale 0, zero 1.25
    k[:, :, c[3]] = 0.0
    k[rng.random(n) < 0.5, :, c[3]] = -0.0  # -0 and +0: the zero point is stored as +0
    k[np.arange(n) % 16 == 5, :, c[3]] = 0.5  # (a group of signed zeros alone: see below)
    k[:, :, c[4]] = rng.standard_normal((n, H)) * 1e-6  # float16 subnormals
    if not mild:
        k[:, :, c[5]] = 3e4 * np.sign(rng.standard_normal((n, H)))  # near float16's max
    v[rng.random(n) < 0.1] = 0.0  # V scale 0 (also after the rotation)
    pos = rng.random(n) < 0.1  # V groups whose minimum is -0 (zero point stored as +0)
    v[pos] = np.abs(v[pos]) + 0.25
    v[pos, :, ::5] = -0.0
    return k.astype(F32), v.astype(F32)


def cast(x, dtype):
    if dtype == "bf16":
        return x.astype(BF16)
    return x.astype(dtype)


def schedule(rng, lens, chunks=(1, 7, 64, 100, 3, 33, 129, 2)):
    """A list of calls; each call a list of (sequence, rows) with rows >= 0, in a
    random order, together covering every row of every sequence once."""
    done = [0] * len(lens)
    calls = []
    while any(d < n for d, n in zip(done, lens)):
        call = []
        for b in rng.permutation(len(lens)):
            b = int(b)
            left = lens[b] - done[b]
            if left == 0:
                if rng.random() < 0.3:
                    call.append((b, 0))  # a sequence with no rows in this call
                continue
            if rng.random() < 0.25:
                continue  # not in this call
            c = min(left, int(rng.choice(chunks)))
            call.append((b, c))
            done[b] += c
        if call:
            calls.append(call)
    return calls


def alloc_ids(rng, lens, P, num_pages):
    """Shuffled, non-contiguous page ids: ceil(n / P) per sequence, and the
    ids no sequence owns."""
    perm = rng.permutation(num_pages).astype(np.int32)
    ids, at = [], 0
    for n in lens:
        k = -(-n // P)
        ids.append(perm[at:at + k].copy())
        at += k
    assert at <= num_pages
    return ids, perm[at:]


class Store:
    """Sequences of one layer in the C format: pages (a copy of init) and one
    KVSeq per entry of ids (tails filled with 7.5: unwritten slots show)."""

    def __init__(self, fmt, ids, init):
        self.fmt = fmt
        self.pages = init.copy()
        self.seqs = [KVSeq(i, 0, np.full(fmt.tail_shape, F16(7.5)),
                           np.full(fmt.sink_shape, F16(7.5)) if fmt.sink else None) for i in ids]

    def run(self, calls, k, v, dtype, num_threads, after=None, queries=None):
        """Appends rows per `calls` (k, v: per sequence (n, H, Dh) float32);
        after(call) runs after each call. With queries: each call is an
        append_attention of queries(call, seqs) -> (q, q_seq, q_pos) (q_seq
        indexing the call's seqs), and after(call, o, lse, q, q_seq, q_pos)."""
        for call in calls:
            seqs, rows_k, rows_v, indptr = [], [], [], [0]
            for b, c in call:
                s = self.seqs[b]
                lo = s.n_kv
                s.n_kv = lo + c
                seqs.append(s)
                rows_k.append(k[b][lo:lo + c])
                rows_v.append(v[b][lo:lo + c])
                indptr.append(indptr[-1] + c)
            kk = cast(np.concatenate(rows_k), dtype)
            vv = cast(np.concatenate(rows_v), dtype)
            if queries is not None:
                q, qs, qp = queries(call, seqs)
                o, lse = kvfmt.append_attention(self.fmt, self.pages, seqs, np.array(indptr), kk,
                                                vv, q, qs, qp, return_lse=True,
                                                num_threads=num_threads)
                after(call, o, lse, q, qs, qp)
                continue
            kvfmt.append(self.fmt, self.pages, seqs, np.array(indptr), kk, vv,
                         num_threads=num_threads)
            if after is not None:
                after(call)

    def check(self, rseqs, what=""):
        check_bytes(self.fmt, self.pages, self.seqs, rseqs, what)


def group_mask(fmt: KVFormat, m: int) -> np.ndarray:
    """Bytes of a page (P > G) that belong to its first m groups (section 5)."""
    H, Dh, P, G, b = fmt.num_kv_heads, fmt.head_dim, fmt.page_size, fmt.group, fmt.bits
    nvg = Dh // fmt.v_group
    kc = np.zeros((H, Dh, P * b // 8), bool)
    if b == 8:  # channel pairs: a pair's first m*G tokens are its first 2*m*G bytes
        e = Dh - Dh % 2
        kc[:, :e].reshape(H, e // 2, 2 * P)[:, :, :2 * m * G] = True
        kc[:, e:, :m * G] = True
    else:
        kc[:, :, :m * G * b // 8] = True
    vc = np.zeros((H, Dh, P * b // 8), bool)
    vc[:, :, :m * G * b // 8] = True
    vp = np.zeros((H, P, nvg, 2), bool)
    vp[:, :m * G] = True
    kp = np.zeros((P // G, H * Dh, 2), bool)
    kp[:m] = True
    parts = [kc, vc, vp] + ([vp] if fmt.v_asym else []) + [kp, kp]
    mask = np.concatenate([x.reshape(-1) for x in parts])
    assert mask.size == fmt.page_bytes
    return mask


def expected_pages(fmt: KVFormat, rseq: R.Sequence):
    """[(page index in the sequence, expected bytes, mask)] for every page
    holding at least one complete group."""
    P, G = fmt.page_size, fmt.group
    n_done = len(rseq.groups) * G
    full = rseq.pages()
    out = [(p, np.frombuffer(full[p], np.uint8), None) for p in range(n_done // P)]
    if n_done % P:  # P > G: a page with complete and incomplete groups
        p = n_done // P
        pad = rseq.fork()
        z = np.zeros(((p + 1) * P - len(pad), fmt.num_kv_heads, fmt.head_dim), F32)
        pad.append(z, z)
        out.append((p, np.frombuffer(pad.pages()[p], np.uint8),
                    group_mask(fmt, (n_done - p * P) // G)))
    return out


def check_bytes(fmt, pages, seqs, rseqs, what=""):
    """The C pages and tails of seqs against the reference sequences rseqs."""
    for b, (s, r) in enumerate(zip(seqs, rseqs)):
        assert s.n_kv == len(r)
        for p, want, mask in expected_pages(fmt, r):
            got = pages[s.pages[p]]
            if mask is None:
                bad = np.flatnonzero(got != want)
            else:
                bad = np.flatnonzero((got != want) & mask)
            assert bad.size == 0, (f"{what} seq {b} page {p} (id {s.pages[p]}): {bad.size} "
                                   f"bytes differ, first at byte {bad[0]}: got {got[bad[0]]} "
                                   f"want {want[bad[0]]}")
        nt = len(r.tail_k)
        assert s.n_kv - nt == len(r.groups) * fmt.group
        # the tail ring: slot t % (G + W) holds position t of [n // G * G - W, n)
        T = fmt.group + fmt.window
        ts = np.arange(max(0, s.n_kv // fmt.group * fmt.group - fmt.window), s.n_kv)
        tk = s.tail[0, ts % T].view(np.uint16)
        tv = s.tail[1, ts % T].view(np.uint16)
        assert np.array_equal(tk, r.all_k[ts].view(np.uint16)), f"{what} seq {b}: K tail differs"
        assert np.array_equal(tv, r.all_v[ts].view(np.uint16)), f"{what} seq {b}: V tail differs"
        # the sink rows: positions [0, S) as float16 (the reference's bytes)
        S = min(fmt.sink, s.n_kv)
        if fmt.sink:
            got = s.sink[:, :S].tobytes()
            want = r.all_k[:S].tobytes() + r.all_v[:S].tobytes()
            assert got == want, f"{what} seq {b}: sink rows differ"
        else:
            assert s.sink is None


def ref_attention(rf: R.Format, rseq: R.Sequence, q, pos, sm_scale=None):
    """Causal float64 attention of q (nq, Hq, Dh) at positions pos (nq), each
    over R.values_at (what a decode at its position sees): (o (nq, Hq, Dh),
    lse (nq, Hq) base 2)."""
    nq, Hq, Dh = q.shape
    grp = Hq // rf.n_kv_heads
    scale = 1.0 / math.sqrt(Dh) if sm_scale is None else sm_scale
    q = q.astype(F64)
    o = np.empty((nq, Hq, Dh))
    lse = np.empty((nq, Hq))
    for i in range(nq):
        n = int(pos[i]) + 1
        k, v = R.values_at(rf, rseq, n - 1)
        k = np.repeat(k, grp, axis=1)  # (n, Hq, Dh): query head h reads KV head h // grp
        v = np.repeat(v, grp, axis=1)
        s = scale * np.einsum("nhd,hd->hn", k[:n], q[i])  # (Hq, n)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        tot = p.sum(axis=1)
        o[i] = np.einsum("hn,nhd->hd", p, v[:n]) / tot[:, None]
        lse[i] = (m[:, 0] + np.log(tot)) / LN2
    if rf.rotate_v:
        o = o @ R.hadamard(Dh).T
    return o, lse


def check_attention(got_o, got_lse, want_o, want_lse, vmax, what, lse_tol=LSE_TOL):
    assert got_o.shape == want_o.shape and got_lse.shape == want_lse.shape
    assert np.isfinite(got_o).all() and np.isfinite(got_lse).all(), what
    np.testing.assert_allclose(got_o.astype(F64) / vmax, want_o / vmax, rtol=O_TOL, atol=O_TOL,
                               err_msg="o " + what)
    np.testing.assert_allclose(got_lse, want_lse, rtol=lse_tol, atol=lse_tol,
                               err_msg="lse " + what)


# ---------------------------------------------------------------------------
# Formats


GRID = ([("kivi8", Dh, P) for Dh in (64, 128, 96) for P in (8, 16, 64, 128)] +
        [("kivi4", Dh, P) for Dh in (64, 128) for P in (8, 16, 64, 128)] +
        [("kivi8", 64, 1), ("kivi4", 64, 2), ("kivi8", 48, 32), ("kivi4", 32, 128),
         ("kivi8", 9, 128)])  # odd Dh: the last K channel outside the pairs


def test_members_match_reference():
    for name, Dh, P in GRID:
        for H in (1, 2, 3):
            if 64 % P == 0 and (H * Dh) % (64 // P):
                continue
            f = KVFormat.member(name, H, Dh, P)
            assert f.name == name and f.bits == (8 if name == "kivi8" else 4)
            assert f.group == 64 and f.v_asym and f.rotate_v == (name == "kivi4")
            assert f.v_group == math.gcd(64, Dh)
            assert f.sink == (name == "kivi4")  # position 0 in float16 (appendix B)
            ref_format(f)
            s = f.new_seq([0])
            if f.sink:
                assert s.sink.shape == f.sink_shape == (2, 1, H, Dh) and s.sink.dtype == F16
                assert f.new_sink().nbytes == f.sink_bytes
            else:
                assert s.sink is None and f.new_sink() is None and f.sink_bytes == 0
            assert f.new_pages(3).shape == (3, f.page_bytes)
            assert f.new_tail().nbytes == f.tail_bytes
    f = KVFormat.member("KiVi4", 3, 64, 16)  # any case
    assert f == KVFormat.member("kivi4", 3, 64, 16)
    assert R.bytes_per_token(ref_format(f), 30) == 6480
    assert f.page_bytes * 30 == 6480 * 16
    assert KVFormat.member("kivi8", 3, 64, 16).page_bytes * 30 == 12240 * 16


@pytest.mark.parametrize("args,match", [
    (("kivi2", 1, 64, 16), "unknown KV format"),
    (("none", 1, 64, 16), "not a compressed format"),
    (("kivi4", 1, 96, 16), "power-of-two"),  # the V rotation
    (("kivi4", 1, 48, 16), "power-of-two"),
    (("kivi4", 1, 64, 1), "even"),  # 4-bit codes: odd page size
    (("kivi8", 1, 64, 48), "divide"),  # G 64, P 48
    (("kivi8", 1, 64, 96), "divide"),
    (("kivi8", 1, 2, 1), "divide"),  # 64 pages per group, H * Dh = 2
    (("kivi8", 1, 1024, 16), "head_dim"),
    (("kivi8", 0, 64, 16), ">= 1"),
])
def test_member_refused(args, match):
    with pytest.raises(kvcache.InvalidArgumentError, match=match):
        KVFormat.member(*args)


def test_custom_format_checked():
    f = KVFormat(4, 32, 16, False, True, 2, 32, 16)
    assert f.name == "custom" and f.page_bytes == R.page_bytes(ref_format(f))
    with pytest.raises(kvcache.InvalidArgumentError, match="divide"):
        KVFormat(8, 64, 48, True, False, 1, 64, 16)  # gv 48 does not divide 64
    with pytest.raises(kvcache.InvalidArgumentError, match="even group"):
        KVFormat(4, 7, 16, True, False, 1, 32, 14)  # 4-bit groups inside a page: even
    with pytest.raises(kvcache.InvalidArgumentError, match="bits"):
        KVFormat(5, 64, 16, True, False, 1, 32, 16)
    with pytest.raises(kvcache.InvalidArgumentError, match="group 1024 above 512"):
        KVFormat(8, 1024, 16, True, False, 1, 32, 16)  # refused here, not at every store
    assert KVFormat(8, 512, 16, True, False, 1, 32, 16).group == 512
    with pytest.raises(kvcache.InvalidArgumentError, match="not kivi8's"):
        KVFormat(8, 64, 16, True, False, 1, 64, 16, name="kivi8")
    with pytest.raises(kvcache.InvalidArgumentError, match="not kivi4's"):  # kivi4 keeps S 1
        KVFormat(4, 64, 64, True, True, 1, 64, 16, name="kivi4")
    assert KVFormat(4, 64, 64, True, True, 1, 64, 16, name="kivi4", sink=1) == \
        KVFormat.member("kivi4", 1, 64, 16)
    for S in (-1, 32, 17):  # [0, min(G - 1, 16)]
        with pytest.raises(kvcache.InvalidArgumentError, match="sink"):
            KVFormat(4, 32, 16, False, True, 2, 32, 16, sink=S)


# ---------------------------------------------------------------------------
# Append: bytes


def _grid_cases():
    out = []
    for name, Dh, P in GRID:
        for H in (1, 2, 3):
            if 64 % P == 0 and (H * Dh) % (64 // P):
                continue
            out.append(pytest.param(name, H, Dh, P, id=f"{name}-H{H}-Dh{Dh}-P{P}"))
    return out


@pytest.mark.parametrize("name,H,Dh,P", _grid_cases())
def test_append_bytes_match_reference(rng, name, H, Dh, P):
    fmt = KVFormat.member(name, H, Dh, P)
    rf = ref_format(fmt)
    n_seq = 3
    lens = [int(x) for x in rng.integers(1, 330, n_seq)]
    lens[0] = max(lens[0], 2 * 64 + 5)  # at least two complete groups somewhere
    data = [make_kv(rng, n, H, Dh) for n in lens]
    k = [d[0] for d in data]
    v = [d[1] for d in data]
    dtypes = [F32, F16] + (["bf16"] if BF16 is not None else [])
    dtype = dtypes[int(rng.integers(len(dtypes)))]
    if dtype != F32:  # the reference is given what C is given
        k = [cast(x, dtype).astype(F32) for x in k]
        v = [cast(x, dtype).astype(F32) for x in v]
    n_pages = sum(-(-n // P) for n in lens) + 5
    init = rng.integers(0, 256, (n_pages, fmt.page_bytes), np.uint8)
    ids, free = alloc_ids(rng, lens, P, n_pages)

    rseqs = [R.Sequence(rf) for _ in lens]
    calls = schedule(rng, lens)
    a = Store(fmt, ids, init)
    n_checks = [0]

    def after(call):  # the reference follows call by call
        for b, c in call:
            lo = len(rseqs[b])
            rseqs[b].append(k[b][lo:lo + c], v[b][lo:lo + c])
        if n_checks[0] < 8:
            n_checks[0] += 1
            a.check(rseqs, f"after call {call}")

    a.run(calls, k, v, dtype, 1, after)
    a.check(rseqs, "threads 1")
    assert np.array_equal(a.pages[free], init[free]), "a page no sequence owns was written"

    # the same calls on 2 threads: every byte the same (pages and tails)
    b2 = Store(fmt, ids, init)
    b2.run(calls, k, v, dtype, 2)
    assert np.array_equal(b2.pages, a.pages)
    for s1, s2 in zip(a.seqs, b2.seqs):
        assert np.array_equal(s1.tail.view(np.uint16), s2.tail.view(np.uint16))
        if fmt.sink:
            assert np.array_equal(s1.sink.view(np.uint16), s2.sink.view(np.uint16))

    # other chunkings (all rows in one call; small chunks): the specified bytes
    for calls2 in ([[(b, n) for b, n in enumerate(lens)]], schedule(rng, lens, (1, 64, 5))):
        c2 = Store(fmt, ids, init)
        c2.run(calls2, k, v, dtype, 2)
        c2.check(rseqs, f"chunking {calls2[:2]}")
        assert np.array_equal(c2.pages[free], init[free])


@pytest.mark.parametrize("v_asym", [True, False])
@pytest.mark.parametrize("bits,G,P,S,Dh,gv", [(4, 32, 16, 0, 32, 16), (8, 32, 64, 3, 32, 16),
                                              (4, 16, 64, 15, 32, 16), (8, 128, 32, 1, 32, 16),
                                              (8, 16, 32, 2, 35, 7), (8, 32, 16, 0, 9, 3)])
def test_append_custom_formats(rng, bits, G, P, S, Dh, gv, v_asym):
    """Custom tuples: symmetric V, other K groups, S sink rows, an odd head
    dimension (8-bit K's last channel outside the pairs), V groups of 7 and
    3 channels (the kernels take any checked format)."""
    H = 2
    fmt = KVFormat(bits, G, gv, v_asym, bits == 4, H, Dh, P, sink=S)
    rf = ref_format(fmt)
    lens = [3 * G + 5, G - 1, 2 * G]
    data = [make_kv(rng, n, H, Dh) for n in lens]
    k = [d[0] for d in data]
    v = [d[1] for d in data]
    n_pages = sum(-(-n // P) for n in lens) + 2
    init = np.zeros((n_pages, fmt.page_bytes), np.uint8)
    st = Store(fmt, alloc_ids(rng, lens, P, n_pages)[0], init)
    st.run(schedule(rng, lens), k, v, F32, 2)
    rseqs = [R.Sequence(rf) for _ in lens]
    for r, kk, vv in zip(rseqs, k, v):
        r.append(kk, vv)
    st.check(rseqs, "custom")


def test_append_bytes_same_on_every_isa(isa):
    rng = np.random.default_rng(11)
    for name, Dh, P in (("kivi4", 64, 16), ("kivi8", 96, 128)):
        fmt = KVFormat.member(name, 2, Dh, P)
        rf = ref_format(fmt)
        lens = [200, 70]
        data = [make_kv(rng, n, 2, Dh) for n in lens]
        k = [d[0] for d in data]
        v = [d[1] for d in data]
        n_pages = sum(-(-n // P) for n in lens)
        st = Store(fmt, alloc_ids(rng, lens, P, n_pages)[0],
                   np.zeros((n_pages, fmt.page_bytes), np.uint8))
        st.run(schedule(rng, lens), k, v, F16, 2)
        rseqs = [R.Sequence(rf) for _ in lens]
        for r, kk, vv in zip(rseqs, k, v):
            r.append(kk.astype(F16).astype(F32), vv.astype(F16).astype(F32))
        st.check(rseqs, f"isa {isa}")


@pytest.mark.parametrize("where", ["K channel", "V group"])
def test_scale_of_a_group_of_negative_zeros(where):
    """A K channel or V group of signed zeros only: scale and zero point are
    both stored as +0 (document section 3), whatever the order of -0 and +0."""
    fmt = KVFormat.member("kivi8", 1, 64, 64)
    rf = ref_format(fmt)
    rng = np.random.default_rng(18)
    k, v = make_kv(rng, 64, 1, 64, mild=True)
    if where == "K channel":
        k[:, 0, 9] = -0.0  # all 64 tokens: scale 0, zero point +0
    else:
        v[17] = -0.0  # one token's V: its only group is all -0
    pages = fmt.new_pages(1)
    s = fmt.new_seq([0], 64)
    kvfmt.append(fmt, pages, [s], [0, 64], k, v)
    r = R.Sequence(rf)
    r.append(k, v)
    check_bytes(fmt, pages, [s], [r], where)


def test_strided_inputs_and_truncate_fork():
    """Row/head strides are free; a fork (pages of complete groups shared,
    tail copied), a truncation into a group followed by the rows appended
    again, and one inside the tail give the bytes of a fresh sequence
    (document section 5)."""
    rng = np.random.default_rng(12)
    fmt = KVFormat.member("kivi4", 2, 64, 16)
    rf = ref_format(fmt)
    k, v = make_kv(rng, 200, 2, 64)
    big_k = np.zeros((200, 3, 80), F32)
    big_k[:, :2, :64] = k
    kview = big_k[:, :2, :64]  # head stride 80, row stride 240
    vview = np.ascontiguousarray(v.transpose(1, 0, 2)).transpose(1, 0, 2)  # row stride 64
    pages = np.zeros((20, fmt.page_bytes + 6), np.uint8)[:, 2:2 + fmt.page_bytes]  # strided
    ids = np.arange(20, dtype=np.int32)[::-1][:13].copy()  # 19 .. 7
    s = fmt.new_seq(ids, 150)
    kvfmt.append(fmt, pages, [s], [0, 150], kview[:150], vview[:150])
    ref = R.Sequence(rf)
    ref.append(k[:150], v[:150])
    check_bytes(fmt, pages, [s], [ref], "strided")
    # fork at 150: shares the pages of groups 0 and 1, own pages from 128 on
    child = KVSeq(np.concatenate([ids[:8], np.arange(5)]), 200, s.tail.copy(), s.sink)
    ck, cv = make_kv(rng, 50, 2, 64)
    kvfmt.append(fmt, pages, [child], [0, 50], ck, cv)
    rchild = ref.fork()
    rchild.append(ck, cv)
    check_bytes(fmt, pages, [child], [rchild], "fork")
    check_bytes(fmt, pages, [s], [ref], "parent after the fork")
    # the parent truncated to 100 (inside group 1) keeps 64 tokens; rows 64.. again
    s.n_kv = 200
    kvfmt.append(fmt, pages, [s], [0, 136], k[64:200], v[64:200])
    fresh = R.Sequence(rf)
    fresh.append(k, v)
    check_bytes(fmt, pages, [s], [fresh], "truncate and recompute")
    # truncated inside the tail (200 -> 195): the rows 195.. again, the same bytes
    before = pages.copy(), s.tail.copy()
    s.n_kv = 200
    kvfmt.append(fmt, pages, [s], [0, 5], k[195:200], v[195:200])
    assert np.array_equal(s.tail.view(np.uint16), before[1].view(np.uint16))
    assert np.array_equal(pages, before[0])


# ---------------------------------------------------------------------------
# Attention


ATTN_CASES = [("kivi8", 1, 64, 16), ("kivi8", 2, 96, 128), ("kivi8", 3, 128, 8),
              ("kivi4", 1, 128, 64), ("kivi4", 2, 64, 16), ("kivi4", 3, 64, 128),
              ("kivi4", 2, 64, 2), ("kivi8", 1, 64, 1)]


@pytest.mark.parametrize("name,H,Dh,P", ATTN_CASES,
                         ids=[f"{n}-H{h}-Dh{d}-P{p}" for n, h, d, p in ATTN_CASES])
def test_attention_matches_reference(rng, isa, name, H, Dh, P):
    fmt = KVFormat.member(name, H, Dh, P)
    attention_case(rng, fmt, 3 if name == "kivi8" else 1 + int(rng.integers(3)))


OUTLIERS = [(name, big) for name in ("kivi8", "kivi4") for big in (0.0, 1e2, 1e3, 3e3)]


@pytest.mark.parametrize("name,big", OUTLIERS, ids=[f"{n}-{b:g}" for n, b in OUTLIERS])
def test_attention_k_outlier_channel(rng, isa, name, big):
    """N(0, 1) K and V at Dh 128, one K channel of +-big (an attention sink's
    channel, massive activations): its scale dwarfs the others' in every
    group, so a query rounded to one int16 scale per group lost them (kivi8's
    SIMD kernels: 3x the tolerance at 100, 10x at 1000); and the int16 P . V
    weights' rounding, common to a group's channels, landed on channel 0 once
    the rotation was undone (kivi4's SIMD kernels: 1.9x at big = 0). Up to
    3000 float32 holds the tolerances (0.36x on every path); from ~1e4 the
    zero points' cancellation in float32 leaves them, the generic path too."""
    def make(rng, n, H, Dh):
        k = rng.standard_normal((n, H, Dh))
        k[:, :, 7] = big * np.sign(rng.standard_normal((n, H)))
        return k.astype(F32), rng.standard_normal((n, H, Dh)).astype(F32)
    attention_case(rng, KVFormat.member(name, 2, 128, 16), 4, make)


# Custom tuples (bits, G, W, S, P), H 2, Dh 64: a float16 window W > 0 (a
# query reads the W positions before its own group in float16 even where
# they are quantized), sinks, groups other than 64, pages of more tokens
# than the generic kernel's 512-token blocks (it read a whole page's codes).
ATTN_CUSTOM = [(8, 64, 64, 0, 16), (4, 32, 64, 3, 16), (8, 32, 128, 1, 64),
               (4, 64, 128, 0, 32), (4, 16, 32, 15, 8), (8, 64, 0, 0, 1024),
               (4, 128, 128, 1, 1024)]


@pytest.mark.parametrize("bits,G,W,S,P", ATTN_CUSTOM,
                         ids=[f"b{b}-G{g}-W{w}-S{s}-P{p}" for b, g, w, s, p in ATTN_CUSTOM])
def test_attention_custom_formats(rng, isa, bits, G, W, S, P):
    fmt = KVFormat(bits, G, 16, True, bits == 4, 2, 64, P, window=W, sink=S)
    attention_case(rng, fmt, 3)


def attention_case(rng, fmt, grp, make=None):
    """Prefill in random chunks, then decode at the last and earlier
    positions, against the float64 reference (1 and 2 threads the same bits).
    make(rng, n, H, Dh): the K and V rows (default make_kv, mild)."""
    H, Dh, P, G = fmt.num_kv_heads, fmt.head_dim, fmt.page_size, fmt.group
    rf = ref_format(fmt)
    lens = [int(x) for x in rng.integers(1, 300, 3)]
    lens[1] = G * int(rng.integers(1, 4))  # ends on a group boundary: empty tail
    data = [(make or (lambda *a: make_kv(*a, mild=True)))(rng, n, H, Dh) for n in lens]
    k = [d[0] for d in data]
    v = [d[1] for d in data]
    n_pages = sum(-(-n // P) for n in lens) + 1
    st = Store(fmt, alloc_ids(rng, lens, P, n_pages)[0],
               np.zeros((n_pages, fmt.page_bytes), np.uint8))
    rseqs = [R.Sequence(rf) for _ in lens]
    vmax = max(float(np.abs(x).max()) for x in v)
    ltol = LSE_TOL_INT if fmt.bits == 8 else LSE_TOL
    sm = None if H != 2 else 0.3

    def queries(call, seqs):  # a forward step's rows: each attends at its position
        qs, qseq, qpos = [], [], []
        for i, (b, c) in enumerate(call):
            lo = seqs[i].n_kv - c
            qs.append(rng.standard_normal((c, H * grp, Dh)).astype(F32))
            qseq += [i] * c
            qpos += list(range(lo, lo + c))
        return np.concatenate(qs), np.array(qseq, np.int32), np.array(qpos, np.int32)

    def prefill(call, o, lse, q, qseq, qpos):
        for b, c in call:
            lo = len(rseqs[b])
            rseqs[b].append(k[b][lo:lo + c], v[b][lo:lo + c])
        assert o.dtype == F32 and lse.dtype == F32
        want_o = np.empty(o.shape)
        want_l = np.empty(lse.shape)
        for i in set(qseq.tolist()):
            sel = qseq == i
            want_o[sel], want_l[sel] = ref_attention(rf, rseqs[call[i][0]], q[sel], qpos[sel],
                                                     None)
        check_attention(o, lse, want_o, want_l, vmax, f"prefill {call}", ltol)

    st.run(schedule(rng, lens, (1, 7, 64, 100, 33)), k, v, F32, 2, prefill, queries)
    st.check(rseqs, "after prefill")

    # decode: one query per sequence at n_kv - 1, and random earlier positions
    nq = 3 + 6
    q = rng.standard_normal((nq, H * grp, Dh)).astype(F32)
    qseq = np.array([0, 1, 2] + [int(x) for x in rng.integers(0, 3, 6)], np.int32)
    # the tail still holds what positions from floor(n / G) * G - 1 on read
    lows = [max(0, n // G * G - 1) for n in lens]
    qpos = np.array([lens[b] - 1 for b in range(3)] +
                    [int(rng.integers(lows[b], lens[b])) for b in qseq[3:]], np.int32)
    for b in range(3):  # an older position's float16 values are gone: refused
        if lows[b] > 0:
            with pytest.raises(kvcache.InvalidArgumentError, match="q_pos"):
                kvfmt.attention(fmt, st.pages, st.seqs, q[:1], [b], [lows[b] - 1], sm)
    o1, l1 = kvfmt.attention(fmt, st.pages, st.seqs, q, qseq, qpos, sm, True, num_threads=1)
    o2, l2 = kvfmt.attention(fmt, st.pages, st.seqs, q, qseq, qpos, sm, True, num_threads=2)
    assert np.array_equal(o1, o2) and np.array_equal(l1, l2)  # thread count: same bits
    o3 = kvfmt.attention(fmt, st.pages, st.seqs, q, qseq, qpos, sm)
    assert np.array_equal(o3, o1)
    want_o = np.empty(o1.shape)
    want_l = np.empty(l1.shape)
    for i in range(nq):
        want_o[i:i + 1], want_l[i:i + 1] = ref_attention(rf, rseqs[qseq[i]], q[i:i + 1],
                                                         qpos[i:i + 1], sm)
    check_attention(o1, l1, want_o, want_l, vmax, "decode", ltol)
    # float16 queries: converted exactly, o in float16
    q16 = q.astype(F16)
    o16 = kvfmt.attention(fmt, st.pages, st.seqs, q16, qseq, qpos, sm)
    assert o16.dtype == F16
    o16_32 = kvfmt.attention(fmt, st.pages, st.seqs, q16.astype(F32), qseq, qpos, sm)
    assert np.array_equal(o16, o16_32.astype(F16))


# (name or custom tuple (bits, G, W, S), Dh): prompts long enough to cross
# the SIMD path's key chunks (1,024 tokens) twice; at Dh 128 the one-call
# prefill's ~1,560 tasks exceed a wave (8 MiB of 8.3 KiB states: 1,008), so
# it also runs in two waves
ROWS_CASES = [("kivi8", 128), ("kivi4", 64), ((4, 32, 64, 3), 64)]


@pytest.mark.parametrize("case,Dh", ROWS_CASES, ids=[f"{c}-Dh{d}" for c, d in ROWS_CASES])
def test_attention_rows_independent_of_the_call(rng, isa, case, Dh):
    """A query row gets the same bits whatever call computes it (section 6):
    a prefill in chunks of any size, one call for the whole prompt, decode
    steps of one row, and batches with other sequences (other numbers of work
    units per call), on every ISA, 1 and 2 threads."""
    # the generic C path (scalar) splits no keys, and is slow: a shorter prompt
    H, P, grp, N = 2, 16, 3, 2 * 1024 + 300 if isa != "scalar" else 600
    if isinstance(case, str):
        fmt = KVFormat.member(case, H, Dh, P)
    else:
        bits, G, W, S = case
        fmt = KVFormat(bits, G, 16, True, bits == 4, H, Dh, P, window=W, sink=S)
    k, v = make_kv(rng, N, H, Dh, mild=True)
    q = rng.standard_normal((N, H * grp, Dh)).astype(F32)
    ko, vo = make_kv(rng, N, H, Dh, mild=True)  # another sequence, batched with it
    qo = rng.standard_normal((N, H * grp, Dh)).astype(F32)
    npg = -(-N // P)

    def run(steps, threads=1):
        """steps: per call, rows of (sequence 0, sequence 1); sequence 0's outputs."""
        pages = np.zeros((2 * npg, fmt.page_bytes), np.uint8)
        seqs = [KVSeq(np.arange(b * npg, (b + 1) * npg, dtype=np.int32), 0,
                      np.zeros(fmt.tail_shape, F16),
                      np.zeros(fmt.sink_shape, F16) if fmt.sink else None) for b in range(2)]
        data = [(k, v, q), (ko, vo, qo)]
        out = np.full((N, H * grp, Dh), np.nan, F32)
        for step in steps:
            call = [(b, c) for b, c in enumerate(step) if c > 0]
            cs, rk, rv, rq, qs, qp, ind = [], [], [], [], [], [], [0]
            for i, (b, c) in enumerate(call):
                s = seqs[b]
                lo = s.n_kv
                s.n_kv = lo + c
                cs.append(s)
                rk.append(data[b][0][lo:lo + c])
                rv.append(data[b][1][lo:lo + c])
                rq.append(data[b][2][lo:lo + c])
                qs += [i] * c
                qp += list(range(lo, lo + c))
                ind.append(ind[-1] + c)
            o = kvfmt.append_attention(fmt, pages, cs, np.array(ind), np.concatenate(rk),
                                       np.concatenate(rv), np.concatenate(rq),
                                       np.array(qs, np.int32), np.array(qp, np.int32),
                                       num_threads=threads)
            if call[0][0] == 0:
                lo = seqs[0].n_kv - call[0][1]
                out[lo:seqs[0].n_kv] = o[:call[0][1]]
        assert seqs[0].n_kv == N and not np.isnan(out).any()
        return out

    want = run([(min(512, N - a), 0) for a in range(0, N, 512)])
    assert np.array_equal(run([(N, 0)], 2), want), "one call"
    # decode steps of one row past a prefill, the last 40 rows alone
    dec = run([(N - 40, 0)] + [(1, 0)] * 40)
    assert np.array_equal(dec, want), "decode steps"
    # batched: sequence 1 in the same calls (more units), in other chunks
    cuts = [int(x) for x in rng.integers(1, 700, 12)]
    steps, a, a1 = [], 0, 0
    for c in cuts:
        steps.append((min(c, N - a), min(c % 300, N - a1)))
        a += steps[-1][0]
        a1 += steps[-1][1]
    steps.append((N - a, 0))
    assert np.array_equal(run([s for s in steps if s[0] or s[1]], 2), want), "batched"
    # the reference, on the last rows (dequantized values, float64)
    rseq = R.Sequence(ref_format(fmt))
    rseq.append(k, v)
    sel = np.arange(N - 8, N)
    wo, _ = ref_attention(ref_format(fmt), rseq, q[sel], sel, None)
    assert np.allclose(want[sel], wo, rtol=O_TOL, atol=O_TOL * float(np.abs(v).max()))


def test_attention_rotation_is_undone():
    """kivi4 and a kivi8-like format without rotation see nearly the same
    output: the rotation only moves the quantization error."""
    rng = np.random.default_rng(13)
    H, Dh, P, n = 1, 64, 16, 100
    k, v = make_kv(rng, n, H, Dh, mild=True)
    q = rng.standard_normal((1, 2, Dh)).astype(F32)
    outs = []
    for rot in (True, False):
        fmt = KVFormat(8, 64, 64, True, rot, H, Dh, P)
        pages = fmt.new_pages(7)
        s = fmt.new_seq(np.arange(7), n)
        kvfmt.append(fmt, pages, [s], [0, n], k, v)
        outs.append(kvfmt.attention(fmt, pages, [s], q, [0], [n - 1]))
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=0.02 * np.abs(v).max())


# ---------------------------------------------------------------------------
# Bad input: an error, nothing written


def _two_seqs(fmt, rng, first=60):
    """Two sequences with `first` rows each already stored; returns (pages,
    seqs, k, v) where k/v hold 200 rows per sequence."""
    n_pages = 2 * (-(-200 // fmt.page_size)) + 2
    pages = rng.integers(0, 256, (n_pages, fmt.page_bytes), np.uint8)
    perm = rng.permutation(n_pages - 2).astype(np.int32)
    half = (n_pages - 2) // 2
    seqs = [fmt.new_seq(perm[:half]), fmt.new_seq(perm[half:])]
    data = [make_kv(rng, 200, fmt.num_kv_heads, fmt.head_dim) for _ in seqs]
    for s, (k, v) in zip(seqs, data):
        s.n_kv = first
    kvfmt.append(fmt, pages, seqs, [0, first, 2 * first],
                 np.concatenate([d[0][:first] for d in data]),
                 np.concatenate([d[1][:first] for d in data]))
    return pages, seqs, data


def _append_rows(fmt, pages, seqs, data, count, k_fix=None, v_fix=None, dtype=F32):
    """Appends count rows to each sequence (completing a group of the first)."""
    ks = [d[0][s.n_kv:s.n_kv + count] for s, d in zip(seqs, data)]
    vs = [d[1][s.n_kv:s.n_kv + count] for s, d in zip(seqs, data)]
    k = np.concatenate(ks)
    v = np.concatenate(vs)
    if k_fix:
        k_fix(k)
    if v_fix:
        v_fix(v)
    for s in seqs:
        s.n_kv += count
    try:
        kvfmt.append(fmt, pages, seqs, [0, count, 2 * count], cast(k, dtype), cast(v, dtype))
    finally:
        for s in seqs:
            s.n_kv -= count


def _snapshot(pages, seqs):
    return (pages.copy(), [s.tail.copy() for s in seqs],
            [None if s.sink is None else s.sink.copy() for s in seqs])


def _unchanged(pages, seqs, snap):
    assert np.array_equal(pages, snap[0]), "pages written by a failing call"
    for s, t, k in zip(seqs, snap[1], snap[2]):
        assert np.array_equal(s.tail.view(np.uint16), t.view(np.uint16)), "tail written"
        if k is not None:
            assert np.array_equal(s.sink.view(np.uint16), k.view(np.uint16)), "sink written"


def _set(idx, val):
    def fix(a):
        a[idx] = val
    return fix


BAD_VALUES = [
    ("nan K", _set((75, 0, 3), np.nan), None, F32),
    ("inf V", None, _set((3, 0, 0), np.inf), F32),
    ("-inf K", _set((10, 0, 1), -np.inf), None, F32),
    ("K beyond float16", _set((70, 0, 2), 65520.0), None, F32),
    ("V beyond float16", None, _set((7, 0, 5), -1e6), F32),
    ("nan float16", _set((75, 0, 3), np.nan), None, F16),
    ("inf float16 V", None, _set((3, 0, 4), np.inf), F16),
    ("bfloat16 beyond float16", None, _set((5, 0, 5), 1e30), "bf16"),
]


@pytest.mark.parametrize("name", ["kivi8", "kivi4"])
@pytest.mark.parametrize("what,kfix,vfix,dtype", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_refused_nothing_written(name, what, kfix, vfix, dtype):
    if dtype == "bf16" and BF16 is None:
        dtype = F32
    rng = np.random.default_rng(14)
    fmt = KVFormat.member(name, 2, 64, 16)
    pages, seqs, data = _two_seqs(fmt, rng)
    snap = _snapshot(pages, seqs)
    with pytest.raises(kvcache.InvalidArgumentError, match="NaN|infinity|float16"):
        _append_rows(fmt, pages, seqs, data, 40, kfix, vfix, dtype)
    _unchanged(pages, seqs, snap)
    _append_rows(fmt, pages, seqs, data, 40)  # the same rows, valid: accepted


def test_overflow_after_rotation():
    """V of 60000 in every channel is a valid float16, but its rotation (first
    element 60000 * sqrt(64) = 480000) is not: kivi4 refuses it, kivi8 stores it."""
    rng = np.random.default_rng(15)
    for name in ("kivi4", "kivi8"):
        fmt = KVFormat.member(name, 2, 64, 16)
        pages, seqs, data = _two_seqs(fmt, rng)
        snap = _snapshot(pages, seqs)
        fix = _set((15, 1, slice(None)), 60000.0)  # seq 1
        if name == "kivi4":
            with pytest.raises(kvcache.InvalidArgumentError, match="float16"):
                _append_rows(fmt, pages, seqs, data, 10, v_fix=fix)
            _unchanged(pages, seqs, snap)
        else:
            _append_rows(fmt, pages, seqs, data, 10, v_fix=fix)
    # 65519 rounds to 65504 (float16's maximum): accepted
    fmt = KVFormat.member("kivi8", 2, 64, 16)
    pages, seqs, data = _two_seqs(fmt, rng)
    _append_rows(fmt, pages, seqs, data, 10, k_fix=_set((3, 0, 0), 65519.0))


@pytest.mark.parametrize("bad_id", [-1, "num_pages", "big"])
def test_page_id_out_of_range_nothing_written(bad_id):
    rng = np.random.default_rng(16)
    fmt = KVFormat.member("kivi4", 2, 64, 16)
    pages, seqs, data = _two_seqs(fmt, rng)
    snap = _snapshot(pages, seqs)
    saved = seqs[1].pages.copy()
    seqs[1].pages[6] = {-1: -1, "num_pages": pages.shape[0], "big": 2**31 - 1}[bad_id]
    with pytest.raises(kvcache.InvalidArgumentError, match="page id"):
        _append_rows(fmt, pages, seqs, data, 40)  # seq 0 completes a group: not written
    _unchanged(pages, seqs, snap)
    seqs[1].pages[:] = saved
    _append_rows(fmt, pages, seqs, data, 40)


def test_binding_and_shape_errors():
    rng = np.random.default_rng(17)
    fmt = KVFormat.member("kivi8", 2, 64, 16)
    pages, seqs, data = _two_seqs(fmt, rng)
    snap = _snapshot(pages, seqs)
    k = np.zeros((4, 2, 64), F32)
    IA = kvcache.InvalidArgumentError
    for s in seqs:
        s.n_kv += 2
    try:
        with pytest.raises(IA, match="row_indptr"):
            kvfmt.append(fmt, pages, seqs, [0, 4], k, k)
        with pytest.raises(IA, match="key"):
            kvfmt.append(fmt, pages, seqs, [0, 2, 4], k[:3], k)
        with pytest.raises(IA, match="key|value"):
            kvfmt.append(fmt, pages, seqs, [0, 2, 4], k, k[:, :1])
        with pytest.raises(IA, match="unsupported dtype"):
            kvfmt.append(fmt, pages, seqs, [0, 2, 4], k.astype(np.int32), k)
        with pytest.raises(IA, match="pages must be uint8"):
            kvfmt.append(fmt, pages[:, 1:], seqs, [0, 2, 4], k, k)
        with pytest.raises(IA, match="pages must be uint8"):
            kvfmt.append(fmt, pages.view(np.int8), seqs, [0, 2, 4], k, k)
        ro = pages.copy()
        ro.flags.writeable = False
        with pytest.raises(IA, match="writeable"):
            kvfmt.append(fmt, ro, seqs, [0, 2, 4], k, k)
        with pytest.raises(IA, match="n_kv"):  # more rows than the sequence's length
            kvfmt.append(fmt, pages, seqs, [0, 2, 4 + 200], np.zeros((204, 2, 64), F32),
                         np.zeros((204, 2, 64), F32))
        with pytest.raises(IA, match="row_indptr"):
            kvfmt.append(fmt, pages, seqs, [1, 2, 4], k[:3], k[:3])
        bad_tail = KVSeq(seqs[0].pages, seqs[0].n_kv, seqs[0].tail.astype(F32))
        with pytest.raises(IA, match="tail must be float16"):
            kvfmt.append(fmt, pages, [bad_tail, seqs[1]], [0, 2, 4], k, k)
        if fmt.sink:  # a format with sink rows needs them
            nosink = KVSeq(seqs[0].pages, seqs[0].n_kv, seqs[0].tail)
            with pytest.raises(IA, match="sink must be float16"):
                kvfmt.append(fmt, pages, [nosink, seqs[1]], [0, 2, 4], k, k)
            ro_sink = seqs[0].sink.copy()
            ro_sink.flags.writeable = False
            with pytest.raises(IA, match="sink must be C-contiguous"):
                kvfmt.append(fmt, pages, [KVSeq(seqs[0].pages, seqs[0].n_kv, seqs[0].tail,
                                                ro_sink), seqs[1]], [0, 2, 4], k, k)
        else:
            with pytest.raises(IA, match="sink must be None"):
                kvfmt.append(fmt, pages, [KVSeq(seqs[0].pages, seqs[0].n_kv, seqs[0].tail,
                                                np.zeros((2, 1, 2, 64), F16)), seqs[1]],
                             [0, 2, 4], k, k)
        short = KVSeq(seqs[0].pages[:2], seqs[0].n_kv, seqs[0].tail, seqs[0].sink)
        with pytest.raises(IA, match="page ids for n_kv"):
            kvfmt.append(fmt, pages, [short, seqs[1]], [0, 2, 4], k, k)
        with pytest.raises(IA, match="KVFormat"):
            kvfmt.append("kivi8", pages, seqs, [0, 2, 4], k, k)
    finally:
        for s in seqs:
            s.n_kv -= 2
    _unchanged(pages, seqs, snap)
    # no rows: fine, nothing changes
    kvfmt.append(fmt, pages, seqs, [0, 0, 0], np.zeros((0, 2, 64), F32),
                 np.zeros((0, 2, 64), F32))
    _unchanged(pages, seqs, snap)

    q = np.zeros((2, 4, 64), F32)
    with pytest.raises(IA, match="q_pos"):
        kvfmt.attention(fmt, pages, seqs, q, [0, 1], [0, 60])
    with pytest.raises(IA, match="q_seq"):
        kvfmt.attention(fmt, pages, seqs, q, [0, 2], [0, 0])
    with pytest.raises(IA, match="q_seq"):
        kvfmt.attention(fmt, pages, seqs, q, [0], [0])
    with pytest.raises(IA, match="multiple"):
        kvfmt.attention(fmt, pages, seqs, np.zeros((2, 3, 64), F32), [0, 1], [0, 0])
    with pytest.raises(IA, match="sm_scale"):
        kvfmt.attention(fmt, pages, seqs, q, [0, 1], [0, 0], sm_scale=float("nan"))
    o = kvfmt.attention(fmt, pages, seqs, np.zeros((0, 4, 64), F32), [], [])
    assert o.shape == (0, 4, 64)
    ro = pages.copy()
    ro.flags.writeable = False  # attention only reads
    kvfmt.attention(fmt, ro, seqs, q, [0, 1], [59, 0])


def test_failed_first_append_leaves_the_sink_rows():
    """A call that stores position 0 and fails (a NaN in a later row) writes
    neither the sink rows nor anything else."""
    fmt = KVFormat.member("kivi4", 2, 64, 16)
    rng = np.random.default_rng(19)
    k, v = make_kv(rng, 70, 2, 64, mild=True)
    pages = fmt.new_pages(5)
    s = fmt.new_seq(np.arange(5), 70)
    s.sink[:] = F16(7.5)
    snap = _snapshot(pages, [s])
    k[66, 1, 3] = np.nan
    with pytest.raises(kvcache.InvalidArgumentError, match="NaN"):
        kvfmt.append(fmt, pages, [s], [0, 70], k, v)
    _unchanged(pages, [s], snap)
    k[66, 1, 3] = 0.5
    kvfmt.append(fmt, pages, [s], [0, 70], k, v)
    r = R.Sequence(ref_format(fmt))
    r.append(k, v)
    check_bytes(fmt, pages, [s], [r], "after the failed call")
