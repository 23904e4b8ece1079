"""numpy reference of the compressed paged KV formats kivi8/kivi4, written from
docs/KV_FORMATS.md (not from any C code), so the kernels can be checked against
it byte for byte.

Quantizer (document section 3), for a set X of float16 values (one K channel of
a group of G tokens, or gv consecutive V channels of one token):

    lo = min X, hi = max X                     (float16 values, exact)
    s  = smallest float16 >= 0 with s * L >= hi - lo   (exact comparison)
    q  = round_half_to_even((x - lo) / s)      (exact quotient; 0 when s == 0)
    x' = float32(q * s + lo)                   (one rounding)

with L = 2**bits - 1. Every step is exact in float64 (the document shows why),
so float64 here gives the bytes the C code must produce. The V rotation is the
float32 butterfly of section 4, done in numpy float32 (IEEE single, the same
operations in the same order).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np

F16 = np.float16
F32 = np.float32
F64 = np.float64
F16_MAX = 65504.0


@dataclass(frozen=True)
class Format:
    bits: int  # 8 (kivi8) or 4 (kivi4)
    group: int  # G: tokens per K group (a page, part of a page or a run of pages)
    v_group: int  # gv: V channels per scale/zero, divides Dh
    rotate_v: bool  # normalized Sylvester Hadamard on V (Dh a power of two)
    n_kv_heads: int
    head_dim: int
    page_size: int
    v_sym: bool = False  # V symmetric (scale only) instead of scale and zero point
    window: int = 0  # W: positions of complete groups a query still reads in float16
    sink: int = 0  # S: positions [0, S) kept in float16, out of group 0's K statistics

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def qmax(self) -> int:  # symmetric codes lie in [-qmax, qmax]
        return (1 << (self.bits - 1)) - 1

    def check(self) -> None:
        H, Dh, P, G = self.n_kv_heads, self.head_dim, self.page_size, self.group
        if self.bits not in (4, 8):
            raise ValueError("bits must be 4 or 8")
        if min(H, Dh, P, G, self.v_group) < 1 or Dh % self.v_group:
            raise ValueError("sizes must be >= 1 and v_group must divide head_dim")
        if P % G and G % P:
            raise ValueError("group and page_size: one must divide the other")
        if G > P and (H * Dh) % (G // P):
            raise ValueError("G / page_size must divide H * Dh")
        if self.bits == 4 and (Dh % 2 or P % 2):
            raise ValueError("int4 needs even head_dim and page_size")
        if self.bits == 4 and G < P and G % 2:
            raise ValueError("int4 with groups smaller than a page needs an even group")
        if self.rotate_v and Dh & (Dh - 1):
            raise ValueError("rotate_v needs a power-of-two head_dim")
        if self.window < 0 or self.window % G:
            raise ValueError("window must be a multiple of the group")
        if not 0 <= self.sink < G or self.sink > 16:
            raise ValueError("sink must be in [0, min(G - 1, 16)]")


def member(name: str, n_kv_heads: int, head_dim: int, page_size: int = 16) -> Format:
    """The named members of section 2 (V groups of gcd(gv, Dh) channels)."""
    bits, gv, rot, sym, sink = {"kivi8": (8, 64, False, False, 0),
                                "kivi4": (4, 64, True, False, 1)}[name]
    f = Format(bits, 64, math.gcd(gv, head_dim), rot, n_kv_heads, head_dim, page_size, sym,
               sink=sink)
    f.check()
    return f


def bytes_per_token(fmt: Format, n_layers: int) -> float:
    """Section 6: page storage per token, all layers (the float16 tail excluded)."""
    HD = fmt.n_kv_heads * fmt.head_dim
    v_params = (2 if fmt.v_sym else 4) * HD / fmt.v_group
    per_layer = 2 * HD * fmt.bits / 8 + 4 * HD / fmt.group + v_params
    return n_layers * per_layer


def page_bytes(fmt: Format) -> int:
    """Bytes of one page of one layer."""
    b = bytes_per_token(fmt, 1) * fmt.page_size
    assert b == int(b)
    return int(b)


# ---------------------------------------------------------------------------
# float16 helpers


def f16_up(x: np.ndarray) -> np.ndarray:
    """Smallest float16 >= x (x float64, >= 0, below the float16 maximum)."""
    c = np.asarray(x).astype(F16)
    return np.where(c.astype(F64) < x, np.nextafter(c, F16(np.inf)), c)


def scale_for(lo16: np.ndarray, hi16: np.ndarray, levels: int) -> np.ndarray:
    """Smallest float16 s >= 0 with s * levels >= hi - lo, exactly."""
    d = hi16.astype(F64) - lo16.astype(F64) + 0.0  # exact: both float16; -0 becomes +0
    s = f16_up(d / levels)
    for _ in range(4):  # at most one step either way is ever needed
        dn = np.nextafter(s, F16(-np.inf))
        down = (s > 0) & (dn.astype(F64) * levels >= d)
        up = s.astype(F64) * levels < d  # exact: 11-bit s times <= 8-bit L
        if not (down.any() or up.any()):
            return s
        s = np.where(down, dn, np.where(up, np.nextafter(s, F16(np.inf)), s))
    raise AssertionError("scale did not settle")


def quantize(x16: np.ndarray, axis: int, levels: int):
    """Quantize float16 x over `axis`: returns codes (uint8, x's shape), scale
    and zero (float16, `axis` removed)."""
    lo = x16.min(axis=axis)
    lo = np.where(lo == 0, F16(0), lo)  # a zero point of -0 is stored as +0
    hi = x16.max(axis=axis)
    s = scale_for(lo, hi, levels)
    lo_e = np.expand_dims(lo, axis).astype(F64)
    s_e = np.expand_dims(s, axis).astype(F64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (x16.astype(F64) - lo_e) / s_e
    q = np.where(s_e > 0, np.rint(t), 0.0)
    assert q.min() >= 0 and q.max() <= levels  # s is large enough: no clamping
    return q.astype(np.uint8), s, lo


def quantize_sym(x16: np.ndarray, axis: int, qmax: int):
    """Symmetric: s = smallest float16 with s * qmax >= max|x|, q = rint(x / s)
    in [-qmax, qmax] (int8 values), 0 when s == 0. Returns codes and scale."""
    a = np.abs(x16).max(axis=axis)
    s = scale_for(np.zeros_like(a), a, qmax)
    s_e = np.expand_dims(s, axis).astype(F64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = x16.astype(F64) / s_e
    q = np.where(s_e > 0, np.rint(t), 0.0)
    assert np.abs(q).max() <= qmax
    return q.astype(np.int8), s


def dequantize_sym(q: np.ndarray, s: np.ndarray, axis: int) -> np.ndarray:
    """float32(q * s), exact (at most 8 by 11 significant bits)."""
    return (q.astype(F64) * np.expand_dims(s, axis).astype(F64)).astype(F32)


def dequantize(q: np.ndarray, s: np.ndarray, zero: np.ndarray, axis: int) -> np.ndarray:
    """float32(q * s + zero): q*s and the sum are exact in float64, one rounding."""
    s_e = np.expand_dims(s, axis).astype(F64)
    z_e = np.expand_dims(zero, axis).astype(F64)
    return (q.astype(F64) * s_e + z_e).astype(F32)


def pack4(q: np.ndarray) -> np.ndarray:
    """Pairs along the last axis: element 2i in the low nibble, 2i+1 in the high."""
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def unpack4(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.uint8)
    out[..., 0::2] = b & 15
    out[..., 1::2] = b >> 4
    return out


# ---------------------------------------------------------------------------
# V rotation (section 4)


def hadamard(n: int) -> np.ndarray:
    """Normalized Sylvester Hadamard matrix, float64: H = [[A, A], [A, -A]] / sqrt 2."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rotate32(v: np.ndarray) -> np.ndarray:
    """float32 fast Walsh-Hadamard transform over the last axis (stages h = 1, 2,
    4, ...: (a, b) -> (a + b, a - b) for i with i & h == 0), then times
    float32(1 / sqrt(Dh)). Each step is one IEEE float32 operation."""
    x = np.array(v, dtype=F32, copy=True)
    n = x.shape[-1]
    h = 1
    while h < n:
        y = x.reshape(x.shape[:-1] + (n // (2 * h), 2, h))
        a = y[..., 0, :].copy()
        b = y[..., 1, :].copy()
        y[..., 0, :] = a + b
        y[..., 1, :] = a - b
        x = y.reshape(x.shape)
        h *= 2
    return x * F32(1.0 / np.sqrt(n))


# ---------------------------------------------------------------------------
# A sequence of one layer: f16 tail + quantized groups (section 5)


def to_stored(fmt: Format, k: np.ndarray, v: np.ndarray):
    """Token rows (n, H, Dh) -> the float16 values a store keeps (V rotated when
    the format says so). Non-finite input or float16 overflow is an error."""
    k32 = np.asarray(k, F32)
    v32 = np.asarray(v, F32)
    if not (np.isfinite(k32).all() and np.isfinite(v32).all()):
        raise ValueError("non-finite K or V")
    if fmt.rotate_v:
        v32 = rotate32(v32)
    with np.errstate(over="ignore"):
        k16, v16 = k32.astype(F16), v32.astype(F16)
    if not (np.isfinite(k16).all() and np.isfinite(v16).all()):
        raise ValueError("K or V beyond the float16 range")
    return k16, v16


def encode_group(fmt: Format, k16: np.ndarray, v16: np.ndarray, first: bool = False) -> dict:
    """G tokens (G, H, Dh) float16 -> the group's quantized arrays. In a
    sequence's first group the sink positions [0, S) are left out of the K
    statistics and get K code 0 (attention reads them in float16)."""
    G, H, Dh = k16.shape
    s0 = fmt.sink if first else 0
    kq, ks, kz = quantize(k16[s0:], 0, fmt.levels)  # per (head, channel) over tokens
    kq = np.concatenate([np.zeros((s0, H, Dh), np.uint8), kq])
    vg = v16.reshape(G, H, Dh // fmt.v_group, fmt.v_group)
    if fmt.v_sym:  # per (token, head, channel group)
        vq, vs = quantize_sym(vg, 3, fmt.qmax)
        vz = None
    else:
        vq, vs, vz = quantize(vg, 3, fmt.levels)
    return {"kq": kq, "ks": ks, "kz": kz, "vq": vq.reshape(G, H, Dh), "vs": vs, "vz": vz}


def decode_group(fmt: Format, g: dict):
    """Dequantized K, V (G, H, Dh) float32 (V still rotated when rotate_v)."""
    k = dequantize(g["kq"], g["ks"], g["kz"], 0)
    G, H, Dh = g["vq"].shape
    vq = g["vq"].reshape(G, H, Dh // fmt.v_group, fmt.v_group)
    if fmt.v_sym:
        v = dequantize_sym(vq, g["vs"], 3).reshape(G, H, Dh)
    else:
        v = dequantize(vq, g["vs"], g["vz"], 3).reshape(G, H, Dh)
    return k, v


def _codes(fmt: Format, q: np.ndarray) -> bytes:
    """Unsigned codes as they are; signed ones in two's complement (a nibble for int4)."""
    u = q.view(np.uint8) if q.dtype == np.int8 else q
    return (pack4(u & 15) if fmt.bits == 4 else u).tobytes()


def _k_codes_layout(fmt: Format, kq: np.ndarray) -> np.ndarray:
    """K codes (H, Dh, P) in page order: 4-bit channel-major as given; 8-bit
    channels 2i and 2i+1 interleaved token by token in a run of 2P codes
    (an odd Dh's last channel stays a run of P)."""
    if fmt.bits == 4:
        return kq
    H, Dh, P = kq.shape
    e = Dh - Dh % 2
    pairs = kq[:, :e].reshape(H, e // 2, 2, P).transpose(0, 1, 3, 2).reshape(H, e * P)
    return np.concatenate([pairs, kq[:, e:].reshape(H, -1)], axis=1)


def page_records(fmt: Format, groups: list) -> list:
    """The bytes of every page that the given complete groups fill (section 5).
    Page p holds tokens [pP, (p+1)P); order inside a page: K codes (H, Dh, P;
    8-bit in channel pairs),
    V codes (H, Dh, P), V scale (H, P, Dh/gv), V zero (same), K scale share,
    K zero share. Pages not yet filled by complete groups are not returned."""
    P, G = fmt.page_size, fmt.group
    if not groups:
        return []
    keys = ("kq", "vq", "vs") if fmt.v_sym else ("kq", "vq", "vs", "vz")
    cat = {key: np.concatenate([g[key] for g in groups]) for key in keys}
    ks = np.stack([g["ks"] for g in groups])  # (n_groups, H, Dh)
    kz = np.stack([g["kz"] for g in groups])
    n_tok = len(groups) * G
    HD = fmt.n_kv_heads * fmt.head_dim
    share = HD * P // G  # K scale entries per page
    pages = []
    for p in range(n_tok // P):
        t = slice(p * P, (p + 1) * P)
        kq = _k_codes_layout(fmt, cat["kq"][t].transpose(1, 2, 0))  # (H, Dh, P)
        vq = cat["vq"][t].transpose(1, 2, 0)  # (H, Dh, P)
        vs = cat["vs"][t].transpose(1, 0, 2)  # (H, P, Dh/gv)
        vz = b"" if fmt.v_sym else cat["vz"][t].transpose(1, 0, 2).astype(F16).tobytes()
        if P >= G:
            g0 = p * P // G
            kss = ks[g0:g0 + P // G].reshape(-1)
            kzs = kz[g0:g0 + P // G].reshape(-1)
        else:
            g0, r = divmod(p * P, G)
            r //= P
            kss = ks[g0].reshape(-1)[r * share:(r + 1) * share]
            kzs = kz[g0].reshape(-1)[r * share:(r + 1) * share]
        rec = (_codes(fmt, kq) + _codes(fmt, vq) + vs.astype(F16).tobytes() + vz +
               kss.astype(F16).tobytes() + kzs.astype(F16).tobytes())
        assert len(rec) == page_bytes(fmt)
        pages.append(rec)
    return pages


class Sequence:
    """One layer of one sequence: complete groups (quantized) and the float16 tail."""

    def __init__(self, fmt: Format):
        fmt.check()
        self.fmt = fmt
        self.groups: list = []
        shape = (0, fmt.n_kv_heads, fmt.head_dim)
        self.tail_k = np.zeros(shape, F16)
        self.tail_v = np.zeros(shape, F16)
        self.all_k = np.zeros(shape, F16)  # every position's stored float16 values
        self.all_v = np.zeros(shape, F16)

    def __len__(self) -> int:
        return len(self.groups) * self.fmt.group + len(self.tail_k)

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Store token rows (n, H, Dh); a group is quantized as soon as its G-th
        token is stored. On error nothing changes."""
        k16, v16 = to_stored(self.fmt, k, v)
        tk = np.concatenate([self.tail_k, k16])
        tv = np.concatenate([self.tail_v, v16])
        G = self.fmt.group
        first = not self.groups
        new = [encode_group(self.fmt, tk[i:i + G], tv[i:i + G], first and i == 0)
               for i in range(0, len(tk) - G + 1, G)]
        done = len(new) * G
        self.groups += new
        self.tail_k, self.tail_v = tk[done:], tv[done:]
        self.all_k = np.concatenate([self.all_k, k16])
        self.all_v = np.concatenate([self.all_v, v16])

    def truncate(self, m: int) -> int:
        """Keep the first m tokens when the cut is in the tail; a cut inside a
        quantized group keeps only the groups before it. Returns the length kept."""
        if not 0 <= m <= len(self):
            raise ValueError("bad length")
        G = self.fmt.group
        q = len(self.groups) * G
        if m >= q:
            self.tail_k, self.tail_v = self.tail_k[:m - q], self.tail_v[:m - q]
        else:
            del self.groups[m // G:]
            self.tail_k = self.tail_k[:0]
            self.tail_v = self.tail_v[:0]
        self.all_k, self.all_v = self.all_k[:len(self)], self.all_v[:len(self)]
        return len(self)

    def fork(self) -> "Sequence":
        """Quantized groups are shared (immutable); the tail is copied."""
        other = copy.copy(self)
        other.groups = list(self.groups)
        other.tail_k, other.tail_v = self.tail_k.copy(), self.tail_v.copy()
        other.all_k, other.all_v = self.all_k.copy(), self.all_v.copy()
        return other

    def pages(self) -> list:
        return page_records(self.fmt, self.groups)

    def tail_bytes(self) -> bytes:
        return self.tail_k.tobytes() + self.tail_v.tobytes()

    def sink_bytes(self) -> bytes:
        """The sink rows (2, S, H, Dh) float16: K then V of positions [0, S)
        (of those stored)."""
        S = self.fmt.sink
        return self.all_k[:S].tobytes() + self.all_v[:S].tobytes()

    def values(self):
        """K, V (n, H, Dh) float64 as attention sees them (V in the rotated basis
        when rotate_v): dequantized groups (the sink positions in float16), then
        the tail."""
        parts = [decode_group(self.fmt, g) for g in self.groups]
        k = np.concatenate([p[0] for p in parts] + [self.tail_k.astype(F32)]).astype(F64)
        v = np.concatenate([p[1] for p in parts] + [self.tail_v.astype(F32)]).astype(F64)
        S = self.fmt.sink
        k[:S], v[:S] = self.all_k[:S].astype(F64), self.all_v[:S].astype(F64)
        return k, v


def f16_from(fmt: Format, p: int) -> int:
    """Section 6: a query at position p reads positions before this from their
    quantized groups and the rest, up to p, in float16."""
    return max(0, (p + 1) // fmt.group * fmt.group - fmt.window)


def values_at(fmt: Format, seq: Sequence, p: int):
    """K, V (p + 1, H, Dh) float64 as a query at position p sees them (V in the
    rotated basis when rotate_v): whole groups before f16_from(p) dequantized
    but for the sink positions [0, S), the stored float16 values of those and
    of positions from f16_from(p) on."""
    e = f16_from(fmt, p)
    parts = [decode_group(fmt, g) for g in seq.groups[:e // fmt.group]]
    k = np.concatenate([x[0] for x in parts] + [seq.all_k[e:p + 1].astype(F32)]).astype(F64)
    v = np.concatenate([x[1] for x in parts] + [seq.all_v[e:p + 1].astype(F32)]).astype(F64)
    S = min(fmt.sink, e)
    k[:S], v[:S] = seq.all_k[:S].astype(F64), seq.all_v[:S].astype(F64)
    return k, v


def attention(fmt: Format, seq: Sequence, q: np.ndarray) -> np.ndarray:
    """Decode attention of query rows q (Hq, Dh) at the sequence's last position,
    float64: softmax over K, times V, as values_at gives them, then H^T when
    rotate_v."""
    k, v = values_at(fmt, seq, len(seq) - 1)
    Hq, Dh = q.shape
    grp = Hq // fmt.n_kv_heads
    out = np.empty((Hq, Dh))
    for h in range(Hq):
        s = k[:, h // grp, :] @ q[h] / np.sqrt(Dh)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, h // grp, :]
    return out @ hadamard(Dh).T if fmt.rotate_v else out
