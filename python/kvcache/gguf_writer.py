"""A small GGUF writer for tests (numpy only), plus numpy quantizers and
dequantizers for the ggml block formats it writes, and a random-weight
llama- or qwen2-architecture model generator (:func:`write_tiny_llama`).

File layout written (GGUF v3 by default, v2 on request; little-endian)::

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv  x (string key, u32 value type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)
    zero padding to the alignment | tensor data, each tensor at an aligned offset

Strings are a u64 byte length followed by the UTF-8 bytes (no NUL); arrays are
a u32 element type, a u64 count and the elements. ``ne`` lists dimensions
innermost first, so a numpy array of shape (rows, cols) is written with
ne = [cols, rows].

Block formats (ggml): every quantized type packs 32 consecutive elements of a
row into one block.

=====  =====  ==========================================================
type   bytes  layout, value of element j
=====  =====  ==========================================================
Q8_0   34     f16 d, int8 q[32];            x_j = d * q[j]
Q4_0   18     f16 d, u8 qs[16];             x_j = d * (nib_j - 8)
Q4_1   20     f16 d, f16 m, u8 qs[16];      x_j = d * nib_j + m
Q5_0   22     f16 d, u32 qh, u8 qs[16];     x_j = d * (q_j - 16)
Q5_1   24     f16 d, f16 m, u32 qh, u8 qs[16];  x_j = d * q_j + m
IQ4_NL 18     f16 d, u8 qs[16];             x_j = d * IQ4_NL_VALUES[nib_j]
=====  =====  ==========================================================

where nib_j is the low nibble of qs[j] for j < 16 and the high nibble of
qs[j - 16] for j >= 16, and q_j = nib_j + 16 * (bit j of the little-endian
qh). Quantization (what ggml's reference quantizers do):

* Q8_0: d = max|x| / 127, q = round-half-away(x / d).
* Q4_0: m = the element of largest magnitude (sign kept), d = m / -8,
  q = min(15, trunc(x / d + 8.5)).
* Q4_1: lo = min, hi = max, d = (hi - lo) / 15, q = min(15, trunc((x - lo) / d + 0.5)).
* Q5_0: as Q4_0 with d = m / -16, q = min(31, trunc(x / d + 16.5)).
* Q5_1: as Q4_1 with d = (hi - lo) / 31, q = min(31, trunc((x - lo) / d + 0.5)).
* IQ4_NL (simpler than ggml's, which searches scales): d = m / -127 (m as for
  Q4_0), each element the nearest value (ties to the lower index).

A zero scale gives q = 0 (Q4_0: nibble 8). Scales are stored as float16; the
codes are computed with the unrounded scale, as ggml does.

K-quants and IQ4_XS pack 256 consecutive elements (a super-block) of a row:

======  =====  =========================================================
type    bytes  layout, value of element e = 32 j + l (sub-block j)
======  =====  =========================================================
Q2_K    84     u8 scales[16], u8 qs[64], f16 d, f16 dmin;
               x_e = (d * sc) * q_e - dmin * m, sc | m << 4 = scales[e // 16]
Q3_K    110    u8 hmask[32], u8 qs[64], u8 scales[12], f16 d;
               x_e = (d * (sc_{e // 16} - 32)) * q_e, q_e in -4..3
Q4_K    144    f16 d, f16 dmin, u8 scales[12], u8 qs[128];
               x_e = (d * sc_j) * q_e - dmin * m_j
Q5_K    176    f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128];
               as Q4_K with bit j of qh[l] as bit 4 of q_e
Q6_K    210    u8 ql[128], u8 qh[64], int8 scales[16], f16 d;
               x_e = (d * scales[e // 16]) * (q_e - 32)
IQ4_XS  136    f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128];
               x_e = (d * (ls_j - 32)) * IQ4_NL_VALUES[nib_e]
======  =====  =========================================================

Q2_K/Q3_K: element e = 128 h + 32 i + l takes its 2 low bits from bits
2 i of qs[32 h + l]; Q3_K's bit 2 is bit 4 h + i of hmask[l] (clear: q_e is
4 less), and its 6-bit sc_k has the low nibble of scales[k % 8] (high nibble
for k >= 8) and bits 4-5 from bits 2 (k // 4) of scales[8 + k % 4].
Q4_K/Q5_K: q_e is nibble j % 2 of qs[32 (j // 2) + l]; sc_j, m_j are 6-bit,
j < 4 in the low 6 bits of scales[j] / scales[j + 4], j >= 4 in the nibbles
of scales[j + 4] (low: sc, high: m) with their top 2 bits in bits 6-7 of
scales[j - 4] / scales[j]. Q6_K: element e = 128 h + r takes its low 4 bits
from ql[64 h + r % 64] (high nibble when r >= 64) and bits 4-5 from bits
2 (r // 32) of qh[32 h + r % 32]. IQ4_XS: ls_j is nibble j % 2 of
scales_l[j // 2] with bits 2 j, 2 j + 1 of scales_h as bits 4-5; sub-block j
is packed as an IQ4_NL block's qs at qs[16 j].

The quantizers here are simple (one pass, no search like ggml's). Per
sub-block, Q2_K/Q4_K/Q5_K take the range [min(x, 0), max x], Q6_K max|x| / 31,
Q3_K m / -4 and IQ4_XS m / -127 (m: the element of largest magnitude, sign
kept; it decodes as -4 / -127, the other sign clips at 3 / 113). The
sub-block scales are then quantized against d = max scale / 63 (Q2_K: / 15,
dmin likewise; Q6_K: / 127; Q3_K/IQ4_XS, signed: the scale of largest
magnitude / -32, the other sign clipping at 31), and the codes computed with
the stored (float16 d times integer scale) factors, so they always decode in
range. (Below max|x| ~ 3e-3 a row's Q6_K / IQ4_XS d is a coarse float16
subnormal, and the error grows.)
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

__all__ = [
    "BLOCK_SIZES",
    "GGMLType",
    "GGUFWriter",
    "TinyLlama",
    "ValueType",
    "dequantize",
    "gpt2_byte_to_unicode",
    "quantize",
    "write_tiny_llama",
]


class ValueType:
    """GGUF metadata value types."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_FMT = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}

_NUMPY_VALUE_TYPE = {
    np.dtype(np.uint8): ValueType.UINT8,
    np.dtype(np.int8): ValueType.INT8,
    np.dtype(np.uint16): ValueType.UINT16,
    np.dtype(np.int16): ValueType.INT16,
    np.dtype(np.uint32): ValueType.UINT32,
    np.dtype(np.int32): ValueType.INT32,
    np.dtype(np.float32): ValueType.FLOAT32,
    np.dtype(np.bool_): ValueType.BOOL,
    np.dtype(np.uint64): ValueType.UINT64,
    np.dtype(np.int64): ValueType.INT64,
    np.dtype(np.float64): ValueType.FLOAT64,
}


class GGMLType:
    """ggml tensor types the writer can produce (ggml numbering)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    IQ4_NL = 20
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_XS = 23
    BF16 = 30

    NAMES: ClassVar[dict[int, str]] = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0",
                                       7: "Q5_1", 8: "Q8_0", 20: "IQ4_NL", 10: "Q2_K",
                                       11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
                                       23: "IQ4_XS", 30: "BF16"}

    @classmethod
    def parse(cls, t) -> int:
        """Type code from a code or a name ("Q4_1", "q4_1")."""
        if isinstance(t, str):
            for code, name in cls.NAMES.items():
                if name == t.upper():
                    return code
            raise ValueError(f"unsupported ggml type {t!r} (writer supports "
                             f"{', '.join(cls.NAMES.values())})")
        t = int(t)
        if t not in cls.NAMES:
            raise ValueError(f"unsupported ggml type code {t}")
        return t


# (elements per block, bytes per block)
BLOCK_SIZES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18), 3: (32, 20),
               6: (32, 22), 7: (32, 24), 20: (32, 18), 10: (256, 84), 11: (256, 110),
               12: (256, 144), 13: (256, 176), 14: (256, 210), 23: (256, 136)}

# the types packed in 256-element super-blocks (_quantize_k / _dequantize_k)
_SUPER_BLOCK_TYPES = (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K,
                      GGMLType.Q6_K, GGMLType.IQ4_XS)

# IQ4_NL's 16 values (ggml's kvalues_iq4nl)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                          113], dtype=np.int8)


# ---------------------------------------------------------------------------
# Quantizers / dequantizers (rows are quantized independently; the last
# dimension must be a multiple of the block size).


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C roundf: halves round away from zero (numpy's rint rounds to even)."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, NaN kept quiet."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = np.where(nan, (u >> 16) | 0x40, r)
    return r.astype(np.uint16)


def _blocks(x: np.ndarray, name: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % 32:
        raise ValueError(f"{name}: the last dimension ({x.shape[-1] if x.ndim else 0}) must be "
                         f"a multiple of 32")
    return x.reshape(-1, 32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) codes 0..15 -> (n, 16) bytes: element j low nibble, j+16 high."""
    q = q.astype(np.uint8)
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _pack_q5(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 32) codes 0..31 -> (n, 4) qh bytes (bit j: bit 4 of element j), (n, 16) qs."""
    q = q.astype(np.uint32)
    qh = (((q >> 4) & 1) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return qh.astype("<u4").view(np.uint8).reshape(-1, 4), _pack_nibbles(q & 15)


def _unpack_q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    h = qh.copy().view("<u4").astype(np.uint32)  # (n, 1)
    bits = (h >> np.arange(32, dtype=np.uint32)) & 1
    return _unpack_nibbles(qs) + 16.0 * bits.astype(np.float32)


def _inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, 1.0 / np.where(d != 0, d, 1), 0).astype(np.float32)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """(n,) float -> (n, 2) bytes of the float16 values."""
    return v.astype("<f2").view(np.uint8).reshape(-1, 2)


def _signed_absmax(s: np.ndarray) -> np.ndarray:
    """The element of largest magnitude along the last axis, sign kept."""
    return np.take_along_axis(s, np.abs(s).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _signed_scales6(sub: np.ndarray):
    """(n, k) signed sub-block scales -> float16 d, 6-bit integer scales
    sc (-32..31) and the decoded factors d * sc; as ggml's Q3_K / IQ4_XS, the
    scale of largest magnitude is -32 d (the other sign clips at 31)."""
    d16 = (_signed_absmax(sub) / -32.0).astype(np.float16)
    d = d16.astype(np.float32)
    sc = np.clip(_round_half_away(sub * _inv(d)[:, None]), -32, 31).astype(np.int32)
    return d16, sc, (d[:, None] * sc.astype(np.float32)).astype(np.float32)


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """(n, 256) codes 0..3 -> (n, 64) bytes: element 128 h + 32 j + l in bits
    2 j of byte 32 h + l (Q2_K / Q3_K)."""
    q = q.astype(np.int32).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)


def _unpack_2bit(qs: np.ndarray) -> np.ndarray:
    """(n, 64) bytes -> (n, 256) codes 0..3 (the inverse of _pack_2bit)."""
    qs = qs.astype(np.int32).reshape(-1, 2, 1, 32)
    return ((qs >> 2 * np.arange(4).reshape(1, 1, 4, 1)) & 3).reshape(-1, 256)


def _quantize_k(x: np.ndarray, t: int) -> bytes:
    if x.ndim == 0 or x.shape[-1] % 256:
        raise ValueError(f"quantize: the last dimension ({x.shape[-1] if x.ndim else 0}) must "
                         f"be a multiple of 256 for {GGMLType.NAMES[t]}")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, 256)
    n = x.shape[0]
    if t == GGMLType.Q2_K:
        s = x.reshape(n, 16, 16)
        mn = np.minimum(s.min(axis=-1), 0.0)  # x = scale q - min: min <= 0
        scale = (s.max(axis=-1) - mn) / 3.0
        d16 = (scale.max(axis=-1) / 15.0).astype(np.float16)
        dmin16 = (-mn.min(axis=-1) / 15.0).astype(np.float16)
        d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
        sc = np.clip(_round_half_away(scale * _inv(d)[:, None]), 0, 15).astype(np.int32)
        m = np.clip(_round_half_away(-mn * _inv(dmin)[:, None]), 0, 15).astype(np.int32)
        dj = (d[:, None] * sc.astype(np.float32)).astype(np.float32)
        mj = (dmin[:, None] * m.astype(np.float32)).astype(np.float32)
        q = np.clip(_round_half_away((s + mj[:, :, None]) * _inv(dj)[:, :, None]), 0, 3)
        out = np.zeros((n, 84), np.uint8)
        out[:, 0:16] = sc | m << 4
        out[:, 16:80] = _pack_2bit(q)
        out[:, 80:82] = _f16_bytes(d16)
        out[:, 82:84] = _f16_bytes(dmin16)
        return out.tobytes()
    if t == GGMLType.Q3_K:
        s = x.reshape(n, 16, 16)
        # ggml's make_q3_quants without its search: the element of largest
        # magnitude decodes as -4 (the other sign clips at +3)
        d16, sc, eff = _signed_scales6(_signed_absmax(s) / -4.0)
        q = np.clip(_round_half_away(s * _inv(eff)[:, :, None]), -4, 3).astype(np.int32) + 4
        u = sc + 32  # stored 6-bit scales
        scales = np.zeros((n, 12), np.int32)
        scales[:, 0:8] = (u[:, 0:8] & 15) | (u[:, 8:16] & 15) << 4
        for g in range(4):  # bits 4-5 of scale 4 g + i in bits 2 g of byte 8 + i
            scales[:, 8:12] |= (u[:, 4 * g:4 * g + 4] >> 4) << 2 * g
        hm = (q >> 2).reshape(n, 2, 4, 32)  # (h, i, l): bit 4 h + i of hmask[l]
        hmask = np.zeros((n, 32), np.int32)
        for h in range(2):
            for i in range(4):
                hmask |= hm[:, h, i] << (4 * h + i)
        out = np.zeros((n, 110), np.uint8)
        out[:, 0:32] = hmask
        out[:, 32:96] = _pack_2bit(q & 3)
        out[:, 96:108] = scales
        out[:, 108:110] = _f16_bytes(d16)
        return out.tobytes()
    if t == GGMLType.IQ4_XS:
        s = x.reshape(n, 8, 32)
        d16, sc, eff = _signed_scales6(_signed_absmax(s) / -127.0)  # IQ4_NL's block scale
        y = s * _inv(eff)[:, :, None]
        q = np.abs(y[..., None] - IQ4_NL_VALUES.astype(np.float32)).argmin(axis=-1)
        u = (sc + 32).astype(np.uint32)
        scales_h = (((u >> 4) & 3) << (2 * np.arange(8, dtype=np.uint32))).sum(axis=1)
        out = np.zeros((n, 136), np.uint8)
        out[:, 0:2] = _f16_bytes(d16)
        out[:, 2:4] = scales_h.astype("<u2").view(np.uint8).reshape(n, 2)
        out[:, 4:8] = (u[:, 0::2] & 15) | (u[:, 1::2] & 15) << 4
        out[:, 8:136] = _pack_nibbles(q.reshape(n * 8, 32)).reshape(n, 128)
        return out.tobytes()
    if t == GGMLType.Q6_K:
        s = x.reshape(n, 16, 16)
        sub = np.abs(s).max(axis=-1) / 31.0  # (n, 16) sub-block scales
        d16 = (sub.max(axis=-1) / 127.0).astype(np.float16)
        d = d16.astype(np.float32)
        sc = np.clip(_round_half_away(sub * _inv(d)[:, None]), -128, 127)
        eff = (d[:, None] * sc.astype(np.float32)).astype(np.float32)
        q = np.clip(_round_half_away(s * _inv(eff)[:, :, None]), -32, 31).astype(np.int32) + 32
        q = q.reshape(n, 2, 128)  # halves h of 128
        ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # (n, 2, 64)
        hi = q >> 4
        qh = hi[:, :, 0:32] | hi[:, :, 32:64] << 2 | hi[:, :, 64:96] << 4 | hi[:, :, 96:] << 6
        out = np.zeros((n, 210), np.uint8)
        out[:, 0:128] = ql.reshape(n, 128)
        out[:, 128:192] = qh.reshape(n, 64)
        out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
        out[:, 208:210] = _f16_bytes(d16)
        return out.tobytes()
    nmax = 15 if t == GGMLType.Q4_K else 31
    s = x.reshape(n, 8, 32)
    mn = np.minimum(s.min(axis=-1), 0.0)  # x = scale q - min: min <= 0
    scale = (s.max(axis=-1) - mn) / nmax
    d16 = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin16 = (-mn.min(axis=-1) / 63.0).astype(np.float16)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = np.clip(_round_half_away(scale * _inv(d)[:, None]), 0, 63).astype(np.int32)
    m = np.clip(_round_half_away(-mn * _inv(dmin)[:, None]), 0, 63).astype(np.int32)
    dj = (d[:, None] * sc.astype(np.float32)).astype(np.float32)
    mj = (dmin[:, None] * m.astype(np.float32)).astype(np.float32)
    q = np.clip(_round_half_away((s + mj[:, :, None]) * _inv(dj)[:, :, None]), 0, nmax)
    q = q.astype(np.int32)  # (n, 8, 32)
    scales = np.zeros((n, 12), np.int32)
    scales[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    scales[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    scales[:, 8:12] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    qs = (q[:, 0::2] & 15) | (q[:, 1::2] & 15) << 4  # (n, 4, 32): sub-blocks 2g, 2g + 1
    out = np.zeros((n, 144 if nmax == 15 else 176), np.uint8)
    out[:, 0:2] = _f16_bytes(d16)
    out[:, 2:4] = _f16_bytes(dmin16)
    out[:, 4:16] = scales
    if nmax == 31:
        qh = np.zeros((n, 32), np.int32)
        for j in range(8):
            qh |= (q[:, j] >> 4) << j
        out[:, 16:48] = qh
    out[:, -128:] = qs.reshape(n, 128)
    return out.tobytes()


def _dequantize_k(blk: np.ndarray, t: int) -> np.ndarray:
    """(n, block bytes) super-blocks (K-quants, IQ4_XS) -> (n, 256) float32,
    ggml's order of float32 operations."""
    n = blk.shape[0]
    if t == GGMLType.Q2_K:
        d = blk[:, 80:82].copy().view("<f2").astype(np.float32)  # (n, 1)
        dmin = blk[:, 82:84].copy().view("<f2").astype(np.float32)
        sc = blk[:, 0:16].astype(np.int32)
        dl = d * (sc & 15).astype(np.float32)  # (n, 16)
        ml = dmin * (sc >> 4).astype(np.float32)
        q = _unpack_2bit(blk[:, 16:80]).astype(np.float32).reshape(n, 16, 16)
        return (dl[:, :, None] * q - ml[:, :, None]).reshape(n, 256)
    if t == GGMLType.Q3_K:
        d = blk[:, 108:110].copy().view("<f2").astype(np.float32)
        s = blk[:, 96:108].astype(np.int32)
        j = np.arange(16)
        sc = ((s[:, j % 8] >> 4 * (j // 8)) & 15) | ((s[:, 8 + j % 4] >> 2 * (j // 4)) & 3) << 4
        dl = d * (sc - 32).astype(np.float32)
        hm = blk[:, 0:32].astype(np.int32).reshape(n, 1, 1, 32)
        hbit = (hm >> np.arange(8).reshape(1, 2, 4, 1)) & 1  # bit 4 h + j of hmask[l]
        q = _unpack_2bit(blk[:, 32:96]) - 4 * (1 - hbit.reshape(n, 256))
        return (dl[:, :, None] * q.astype(np.float32).reshape(n, 16, 16)).reshape(n, 256)
    if t == GGMLType.IQ4_XS:
        d = blk[:, 0:2].copy().view("<f2").astype(np.float32)
        sh = blk[:, 2:4].copy().view("<u2").astype(np.int32)  # (n, 1)
        ib = np.arange(8)
        sl = blk[:, 4 + ib // 2].astype(np.int32)
        ls = ((sl >> 4 * (ib % 2)) & 15) | ((sh >> 2 * ib) & 3) << 4
        dl = d * (ls - 32).astype(np.float32)  # (n, 8)
        q = _unpack_nibbles(blk[:, 8:136].reshape(n * 8, 16)).astype(np.int64)
        v = IQ4_NL_VALUES[q].astype(np.float32).reshape(n, 8, 32)
        return (dl[:, :, None] * v).reshape(n, 256)
    if t == GGMLType.Q6_K:
        d = blk[:, 208:210].copy().view("<f2").astype(np.float32)  # (n, 1)
        sc = blk[:, 192:208].copy().view(np.int8).astype(np.float32)  # (n, 16)
        ql = blk[:, 0:128].reshape(n, 2, 64).astype(np.int32)
        qh = blk[:, 128:192].reshape(n, 2, 32).astype(np.int32)
        lo = np.concatenate([ql & 15, ql >> 4], axis=-1)  # (n, 2, 128)
        hi = np.concatenate([(qh >> k) & 3 for k in (0, 2, 4, 6)], axis=-1)
        q = ((lo | hi << 4) - 32).astype(np.float32).reshape(n, 16, 16)
        return ((d * sc)[:, :, None] * q).reshape(n, 256)
    five = t == GGMLType.Q5_K
    d = blk[:, 0:2].copy().view("<f2").astype(np.float32)
    dmin = blk[:, 2:4].copy().view("<f2").astype(np.float32)
    s = blk[:, 4:16].astype(np.int32)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | (s[:, 0:4] >> 6) << 4], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | (s[:, 4:8] >> 6) << 4], axis=1)
    qs = blk[:, -128:].reshape(n, 4, 32).astype(np.int32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(n, 8, 32)
    if five:
        qh = blk[:, 16:48].astype(np.int32)
        q = q | np.stack([(qh >> j) & 1 for j in range(8)], axis=1) << 4
    dj = d * sc.astype(np.float32)
    mj = dmin * m.astype(np.float32)
    return (dj[:, :, None] * q.astype(np.float32) - mj[:, :, None]).reshape(n, 256)


def quantize(x, ggml_type) -> bytes:
    """Encodes float data (any shape; rows along the last axis) in a ggml type."""
    t = GGMLType.parse(ggml_type)
    x = np.asarray(x, dtype=np.float32)
    if t == GGMLType.F32:
        return np.ascontiguousarray(x, dtype="<f4").tobytes()
    if t == GGMLType.F16:
        return np.ascontiguousarray(x, dtype="<f2").tobytes()
    if t == GGMLType.BF16:
        return _f32_to_bf16_bits(x).astype("<u2").tobytes()
    if t in _SUPER_BLOCK_TYPES:
        return _quantize_k(x, t)
    b = _blocks(x, "quantize")
    n = b.shape[0]
    if t == GGMLType.Q8_0:
        d = (np.abs(b).max(axis=1) / 127.0).astype(np.float32)
        q = np.clip(_round_half_away(b * _inv(d)[:, None]), -128, 127).astype(np.int8)
        out = np.zeros((n, 34), np.uint8)
        out[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 2:] = q.view(np.uint8)
        return out.tobytes()
    if t == GGMLType.Q4_0:
        idx = np.abs(b).argmax(axis=1)
        m = b[np.arange(n), idx]
        d = (m / -8.0).astype(np.float32)
        q = np.minimum(15, np.trunc(b * _inv(d)[:, None] + 8.5)).astype(np.int32)
        q = np.clip(q, 0, 15)
        out = np.zeros((n, 18), np.uint8)
        out[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 2:] = _pack_nibbles(q)
        return out.tobytes()
    if t == GGMLType.Q4_1:
        lo = b.min(axis=1)
        hi = b.max(axis=1)
        d = ((hi - lo) / 15.0).astype(np.float32)
        q = np.minimum(15, np.trunc((b - lo[:, None]) * _inv(d)[:, None] + 0.5)).astype(np.int32)
        q = np.clip(q, 0, 15)
        out = np.zeros((n, 20), np.uint8)
        out[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 2:4] = lo.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 4:] = _pack_nibbles(q)
        return out.tobytes()
    if t == GGMLType.Q5_0:
        idx = np.abs(b).argmax(axis=1)
        m = b[np.arange(n), idx]
        d = (m / -16.0).astype(np.float32)
        q = np.clip(np.minimum(31, np.trunc(b * _inv(d)[:, None] + 16.5)), 0, 31)
        out = np.zeros((n, 22), np.uint8)
        out[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 2:6], out[:, 6:] = _pack_q5(q)
        return out.tobytes()
    if t == GGMLType.Q5_1:
        lo = b.min(axis=1)
        hi = b.max(axis=1)
        d = ((hi - lo) / 31.0).astype(np.float32)
        q = np.clip(np.trunc((b - lo[:, None]) * _inv(d)[:, None] + 0.5), 0, 31)
        out = np.zeros((n, 24), np.uint8)
        out[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 2:4] = lo.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 4:8], out[:, 8:] = _pack_q5(q)
        return out.tobytes()
    if t == GGMLType.IQ4_NL:
        idx = np.abs(b).argmax(axis=1)
        d = (b[np.arange(n), idx] / -127.0).astype(np.float32)
        y = b * _inv(d)[:, None]
        q = np.abs(y[:, :, None] - IQ4_NL_VALUES.astype(np.float32)).argmin(axis=2)
        out = np.zeros((n, 18), np.uint8)
        out[:, 0:2] = d.astype("<f2").view(np.uint8).reshape(n, 2)
        out[:, 2:] = _pack_nibbles(q)
        return out.tobytes()
    raise AssertionError(t)


def dequantize(data, ggml_type, shape) -> np.ndarray:
    """Decodes raw ggml data to float32 of the given numpy shape (rows last)."""
    t = GGMLType.parse(ggml_type)
    raw = np.frombuffer(bytes(data) if not isinstance(data, np.ndarray) else data.tobytes(),
                        dtype=np.uint8)
    shape = tuple(int(s) for s in shape)
    numel = int(np.prod(shape)) if shape else 1
    bs, bb = BLOCK_SIZES[t]
    if numel % bs or raw.size != numel // bs * bb:
        raise ValueError(f"{GGMLType.NAMES[t]}: {raw.size} bytes do not hold shape {shape}")
    if t == GGMLType.F32:
        return raw.view("<f4").astype(np.float32).reshape(shape)
    if t == GGMLType.F16:
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if t == GGMLType.BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    blk = raw.reshape(-1, bb)
    if t in _SUPER_BLOCK_TYPES:
        return _dequantize_k(blk, t).reshape(shape)
    d = blk[:, 0:2].copy().view("<f2").astype(np.float32)  # (n, 1)
    if t == GGMLType.Q8_0:
        q = blk[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(shape)
    if t == GGMLType.Q4_0:
        return (d * (_unpack_nibbles(blk[:, 2:]) - 8.0)).reshape(shape)
    if t == GGMLType.Q4_1:
        m = blk[:, 2:4].copy().view("<f2").astype(np.float32)
        return (d * _unpack_nibbles(blk[:, 4:]) + m).reshape(shape)
    if t == GGMLType.Q5_0:
        return (d * (_unpack_q5(blk[:, 2:6], blk[:, 6:]) - 16.0)).reshape(shape)
    if t == GGMLType.Q5_1:
        m = blk[:, 2:4].copy().view("<f2").astype(np.float32)
        return (d * _unpack_q5(blk[:, 4:8], blk[:, 8:]) + m).reshape(shape)
    if t == GGMLType.IQ4_NL:
        q = _unpack_nibbles(blk[:, 2:]).astype(np.int64)
        return (d * IQ4_NL_VALUES[q].astype(np.float32)).reshape(shape)
    raise AssertionError(t)


# ---------------------------------------------------------------------------
# Writer


def _gguf_string(s) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _infer_type(value) -> int:
    if isinstance(value, (bool, np.bool_)):
        return ValueType.BOOL
    if isinstance(value, (int, np.integer)):
        if isinstance(value, np.integer):
            return _NUMPY_VALUE_TYPE[np.dtype(type(value))]
        if 0 <= value < 2**32:
            return ValueType.UINT32
        if -(2**31) <= value < 0:
            return ValueType.INT32
        return ValueType.INT64 if value < 2**63 else ValueType.UINT64
    if isinstance(value, (float, np.floating)):
        return ValueType.FLOAT64 if isinstance(value, np.float64) else ValueType.FLOAT32
    if isinstance(value, (str, bytes)):
        return ValueType.STRING
    if isinstance(value, (list, tuple, np.ndarray)):
        return ValueType.ARRAY
    raise TypeError(f"cannot infer a GGUF value type for {type(value).__name__}")


def _encode_value(vtype: int, value, elem_type: int | None = None) -> bytes:
    if vtype == ValueType.STRING:
        return _gguf_string(value)
    if vtype == ValueType.ARRAY:
        if isinstance(value, np.ndarray):
            et = elem_type if elem_type is not None else _NUMPY_VALUE_TYPE[value.dtype]
            items = value.tolist()
        else:
            items = list(value)
            if elem_type is not None:
                et = elem_type
            elif items:
                et = _infer_type(items[0])
            else:
                et = ValueType.UINT8
        head = struct.pack("<IQ", et, len(items))
        if et in _SCALAR_FMT:
            fmt = "<" + str(len(items)) + _SCALAR_FMT[et][1]
            return head + struct.pack(fmt, *items)
        # strings or nested arrays (nested element type inferred per element)
        return head + b"".join(_encode_value(et, v) for v in items)
    return struct.pack(_SCALAR_FMT[vtype], value)


@dataclasses.dataclass
class _Tensor:
    name: str
    ggml_type: int
    ne: list[int]
    data: bytes


class GGUFWriter:
    """Collects key-values and tensors, then writes a GGUF file.

    >>> w = GGUFWriter()
    >>> w.add("general.architecture", "llama")
    >>> w.add("llama.block_count", 2, ValueType.UINT32)
    >>> w.add_tensor("x", np.ones((4, 32), np.float32), "Q8_0")   # ne = [32, 4]
    >>> w.write("tiny.gguf")

    version: 3 (default) or 2 (same layout). alignment: written as the
    uint32 ``general.alignment`` key when not None (default 32 is implied).
    """

    def __init__(self, *, version: int = 3, alignment: int | None = None):
        if version not in (2, 3):
            raise ValueError("GGUFWriter writes versions 2 and 3 only")
        if alignment is not None and (alignment <= 0 or alignment & (alignment - 1)):
            raise ValueError(f"alignment {alignment} is not a power of two")
        self.version = version
        self.alignment = alignment or 32
        self._kv: list[tuple[str, int, object, int | None]] = []
        self._tensors: list[_Tensor] = []
        if alignment is not None:
            self.add("general.alignment", alignment, ValueType.UINT32)

    # -- key-values -------------------------------------------------------
    def add(self, key: str, value, vtype: int | None = None, elem_type: int | None = None):
        """Adds a key-value pair; the type is inferred when not given (int ->
        uint32/int32/int64, float -> float32, list -> array of the first
        element's type; numpy arrays/scalars keep their dtype)."""
        if any(k == key for k, *_ in self._kv):
            raise ValueError(f"duplicate key {key!r}")
        vtype = _infer_type(value) if vtype is None else vtype
        self._kv.append((key, vtype, value, elem_type))

    def add_array(self, key: str, values, elem_type: int):
        self.add(key, values, ValueType.ARRAY, elem_type)

    # -- tensors ----------------------------------------------------------
    def add_tensor(self, name: str, array, ggml_type="F32"):
        """Adds a tensor from a float numpy array (numpy shape (..., rows,
        cols) is written as ne = [cols, rows, ...]), quantized to ggml_type."""
        arr = np.asarray(array, dtype=np.float32)
        t = GGMLType.parse(ggml_type)
        ne = [int(s) for s in reversed(arr.shape)]
        self.add_tensor_raw(name, t, ne, quantize(arr, t))

    def add_tensor_raw(self, name: str, ggml_type: int, ne: Sequence[int], data: bytes):
        """Adds already-encoded tensor data (any type code; no checks)."""
        if any(t.name == name for t in self._tensors):
            raise ValueError(f"duplicate tensor {name!r}")
        self._tensors.append(_Tensor(name, int(ggml_type), [int(x) for x in ne], bytes(data)))

    # -- output -----------------------------------------------------------
    def tobytes(self) -> bytes:
        a = self.alignment
        out = bytearray()
        out += b"GGUF" + struct.pack("<IQQ", self.version, len(self._tensors), len(self._kv))
        for key, vtype, value, elem_type in self._kv:
            out += _gguf_string(key) + struct.pack("<I", vtype)
            out += _encode_value(vtype, value, elem_type)
        offset = 0
        offsets = []
        for t in self._tensors:
            offsets.append(offset)
            out += _gguf_string(t.name) + struct.pack("<I", len(t.ne))
            out += struct.pack(f"<{len(t.ne)}Q", *t.ne)
            out += struct.pack("<IQ", t.ggml_type, offset)
            offset += len(t.data)
            offset += (-offset) % a
        out += b"\0" * ((-len(out)) % a)
        for t, off in zip(self._tensors, offsets, strict=True):
            assert len(out) % a == 0
            out += t.data
            out += b"\0" * ((-len(out)) % a) if t is not self._tensors[-1] else b""
        return bytes(out)

    def write(self, path) -> Path:
        path = Path(path)
        path.write_bytes(self.tobytes())
        return path


# ---------------------------------------------------------------------------
# Tiny llama model


def gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: printable Latin-1
    bytes map to themselves, the other 68 bytes to U+0100.. in byte order
    (so space 0x20 -> 'Ġ', newline 0x0A -> 'Ċ')."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


_CORPUS = (
    "Hello world! The quick brown fox jumps over the lazy dog. "
    "The cache stores keys and values for the attention of the model. "
    "user assistant system: what is the capital of France? The capital of France is Paris. "
    "You are a helpful assistant. Tell me a story about a small robot that learns to read. "
    "Once upon a time there was a little model that liked to predict the next token.\n"
    "def hello():\n    return 'world'\n"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_bpe(corpus: str, n_merges: int) -> tuple[list[str], list[str]]:
    """Byte-level BPE on corpus (words split before spaces, GPT-2 style, in
    the byte-to-unicode alphabet). Returns (merged tokens in merge order,
    merges as "left right"). Ties go to the lexicographically smallest pair,
    so the result is deterministic."""
    b2u = gpt2_byte_to_unicode()
    words: dict[tuple[str, ...], int] = {}
    piece = ""
    for ch in corpus:
        if ch == " " and piece:
            words[tuple(piece)] = words.get(tuple(piece), 0) + 1
            piece = ""
        piece += "".join(b2u[b] for b in ch.encode("utf-8"))
    if piece:
        words[tuple(piece)] = words.get(tuple(piece), 0) + 1
    merged, merges = [], []
    for _ in range(n_merges):
        pairs: dict[tuple[str, str], int] = {}
        for w, c in words.items():
            for p in itertools.pairwise(w):
                pairs[p] = pairs.get(p, 0) + c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        new = best[0] + best[1]
        if new in merged:  # cannot happen for BPE, but keep tokens unique
            break
        merged.append(new)
        merges.append(f"{best[0]} {best[1]}")
        nw: dict[tuple[str, ...], int] = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            nw[tuple(out)] = nw.get(tuple(out), 0) + c
        words = nw
    return merged, merges


@dataclasses.dataclass
class TinyLlama:
    """What write_tiny_llama wrote.

    weights: name -> float32 array in numpy shape (ne reversed, e.g.
    attn_q (n_embd_out, n_embd_in)) holding exactly the values a reader
    gets by dequantizing the stored data. types: name -> ggml type name.
    """

    path: Path
    config: dict
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    weights: dict[str, np.ndarray]
    types: dict[str, str]


# Default weight types: several formats in one model, as the runtime must
# handle (norms are always F32).
DEFAULT_WEIGHT_TYPES = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_1",
    "attn_k": "Q4_0",
    "attn_v": "Q8_0",
    "attn_output": "F16",
    "ffn_gate": "Q4_1",
    "ffn_up": "BF16",
    "ffn_down": "Q4_0",
    "output": "F32",
}


def write_tiny_llama(
    path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int | None = None,
    n_merges: int = 96,
    n_ctx: int = 256,
    rope_freq_base: float = 10000.0,
    rms_eps: float = 1e-5,
    weight_types: str | Mapping[str, str] | None = None,
    seed: int = 0,
    attn_gain: float = 1.0,
    tied_output: bool = True,
    vocab: tuple[Sequence[str], Sequence[str]] | None = None,
    version: int = 3,
    arch: str = "llama",
    biases: Sequence[str] | None = None,
    head_dim: int | None = None,
    rope_dim: int | None = None,
    rope_freqs: bool | Sequence[float] = False,
    rope_scaling: float | None = None,
    rope_scale_linear: float | None = None,
    extra_kv: Mapping[str, object] | None = None,
    omit_kv: Sequence[str] = (),
    extra_tensors: Mapping[str, np.ndarray] | None = None,
    add_bos: bool = False,
) -> TinyLlama:
    """Writes a random-weight llama model with the metadata and tensor
    layout llama.cpp writes (checked against SmolLM2-135M-Instruct):

    * tensors ``token_embd.weight`` ne=[n_embd, n_vocab];
      ``blk.N.attn_norm/ffn_norm.weight`` [n_embd] (F32);
      ``blk.N.attn_q.weight`` [n_embd, n_head*hd], ``attn_k``/``attn_v``
      [n_embd, n_head_kv*hd], ``attn_output`` [n_head*hd, n_embd],
      ``ffn_gate``/``ffn_up`` [n_embd, n_ff], ``ffn_down`` [n_ff, n_embd];
      ``output_norm.weight`` [n_embd]; ``output.weight`` [n_embd, n_vocab]
      unless tied_output (then the output projection is token_embd). ne[0] is
      the input dimension: y = W x with W in numpy shape (out, in).
    * vocabulary: tokens = the 3 ChatML specials (<|endoftext|> = 0,
      <|im_start|> = 1 = BOS, <|im_end|> = 2 = EOS), then all 256 byte
      tokens in GPT-2 byte-to-unicode form (in byte order), then the
      tokens of n_merges BPE merges learnt on a small built-in corpus
      (or ``vocab=(extra_tokens, merges)``), then ``<|extra_K|>`` padding
      (type USER_DEFINED) up to n_vocab. A smaller n_vocab learns fewer
      merges; n_vocab=None is exactly the tokens above (355 by default).

    Rotary convention: the weights are random, so there is no source
    checkpoint whose Q/K rows were permuted; the tensors are to be used as
    stored, with llama.cpp's "normal" rope as for every llama GGUF: within
    each head of size hd, the pairs (x[2i], x[2i+1]) for i < rope_dim/2 are
    rotated by angle pos * rope_freq_base^(-2i/rope_dim) (rope_dim = hd
    unless given). (HF checkpoints rotate (x[i], x[i+hd/2]); llama.cpp's
    converter permutes the Q/K rows so that the adjacent-pair rule gives the
    same result; for qwen2 it does not, and llama.cpp rotates the halves.)

    weight_types: one type for every matrix, or {short name or tensor name
    (with or without ".weight"): type} overriding DEFAULT_WEIGHT_TYPES (short names: token_embd,
    attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down, output).
    attn_gain: a factor on the attn_v and attn_output weights (1: the usual
    1/sqrt(fan-in) scale, at which a 2-layer model's next token follows the
    last token alone; 4 makes it depend on the context).

    Variants (as llama.cpp's converter writes them):

    * arch "qwen2": every key under ``qwen2.`` instead of ``llama.``,
      q/k/v biases by default, pre-tokenizer "qwen2"; its rope rotates the
      halves (x[i], x[i + rope_dim/2]) of each head (NEOX), not adjacent pairs.
    * biases: short names (attn_q, attn_k, attn_v, attn_output, ffn_gate,
      ffn_up, ffn_down) whose ``blk.N.<name>.bias`` (F32, the product's output
      size) is written, added after the product.
    * head_dim: writes ``attention.key_length``/``value_length`` (the head
      size when it is not n_embd / n_head). rope_dim: the rotated dims of
      each head (``rope.dimension_count``, default the head size); the rest
      pass through unrotated.
    * rope_freqs: True for random factors in [1, 8] (or the n_rot/2 values),
      written as the F32 tensor ``rope_freqs.weight``; pair i's angle is
      divided by factor i (Llama 3.1's long-context frequencies).
    * rope_scaling: a linear factor F (``rope.scaling.type`` = "linear",
      ``rope.scaling.factor`` = F): positions are divided by F.
      rope_scale_linear: the same factor under the older ``rope.scale_linear``.
    * extra_kv: more keys, {key: value or (value, ValueType[, element
      type])}; omit_kv: keys not to write; extra_tensors: more F32 tensors
      {name: array} (for tests of what a loader must refuse).
    add_bos: tokenizer.ggml.add_bos_token (SmolLM2's is false; SentencePiece
    llamas' true).
    """
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch {arch!r}: llama or qwen2")
    hd = head_dim if head_dim is not None else n_embd // n_head
    if (head_dim is None and n_embd % n_head) or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    n_rot = hd if rope_dim is None else rope_dim
    if n_rot % 2 or not 0 < n_rot <= hd:
        raise ValueError("the rotated dims must be even and at most the head dim")
    if biases is None:
        biases = ("attn_q", "attn_k", "attn_v") if arch == "qwen2" else ()

    if vocab is None:
        if n_vocab is not None:  # fewer merges if the vocabulary is to be smaller
            n_merges = min(n_merges, n_vocab - len(SPECIAL_TOKENS) - 256)
            if n_merges < 0:
                raise ValueError(f"n_vocab must be at least {len(SPECIAL_TOKENS) + 256}")
        extra, merges = train_bpe(_CORPUS, n_merges)
    else:
        extra, merges = list(vocab[0]), list(vocab[1])
    b2u = gpt2_byte_to_unicode()
    tokens = list(SPECIAL_TOKENS) + [b2u[b] for b in range(256)] + list(extra)
    token_types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    if len(set(tokens)) != len(tokens):
        raise ValueError("vocabulary has duplicate tokens")
    if n_vocab is None:
        n_vocab = len(tokens)
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab {n_vocab} is smaller than the {len(tokens)} tokens")
    k = 0
    while len(tokens) < n_vocab:
        tokens.append(f"<|extra_{k}|>")
        token_types.append(4)
        k += 1

    types = dict(DEFAULT_WEIGHT_TYPES)
    if isinstance(weight_types, str):
        types = {key: weight_types for key in types}
    elif weight_types is not None:
        types.update(weight_types)

    def type_of(name: str) -> str:  # "blk.0.attn_q.weight", "blk.0.attn_q", "attn_q"
        for k in (name, name.removesuffix(".weight"), name.split(".")[-2]):
            if k in types:
                return types[k]
        raise KeyError(name)

    rng = np.random.default_rng(seed)
    kv_dim = n_head_kv * hd
    q_dim = n_head * hd
    bias_size = {"attn_q": q_dim, "attn_k": kv_dim, "attn_v": kv_dim, "attn_output": n_embd,
                 "ffn_gate": n_ff, "ffn_up": n_ff, "ffn_down": n_embd}
    for b in biases:
        if b not in bias_size:
            raise ValueError(f"bias {b!r}: one of {sorted(bias_size)}")
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (n_vocab, n_embd))]
    for i in range(n_layer):
        p = f"blk.{i}."
        shapes += [
            (p + "attn_norm.weight", (n_embd,)),
            (p + "attn_q.weight", (q_dim, n_embd)),
            (p + "attn_k.weight", (kv_dim, n_embd)),
            (p + "attn_v.weight", (kv_dim, n_embd)),
            (p + "attn_output.weight", (n_embd, q_dim)),
            (p + "ffn_norm.weight", (n_embd,)),
            (p + "ffn_gate.weight", (n_ff, n_embd)),
            (p + "ffn_up.weight", (n_ff, n_embd)),
            (p + "ffn_down.weight", (n_embd, n_ff)),
        ]
        shapes += [(p + b + ".bias", (bias_size[b],)) for b in biases]
    shapes.append(("output_norm.weight", (n_embd,)))
    if not tied_output:
        shapes.append(("output.weight", (n_vocab, n_embd)))

    a = arch + "."
    kv: list[tuple[str, object, int | None, int | None]] = []  # key, value, type, elem type

    def add(key, value, vtype=None, elem_type=None):
        kv.append((key, value, vtype, elem_type))

    add("general.architecture", arch)
    add("general.type", "model")
    add("general.name", f"kvcache tiny {arch}")
    add(a + "block_count", n_layer, ValueType.UINT32)
    add(a + "context_length", n_ctx, ValueType.UINT32)
    add(a + "embedding_length", n_embd, ValueType.UINT32)
    add(a + "feed_forward_length", n_ff, ValueType.UINT32)
    add(a + "attention.head_count", n_head, ValueType.UINT32)
    add(a + "attention.head_count_kv", n_head_kv, ValueType.UINT32)
    add(a + "rope.freq_base", float(rope_freq_base), ValueType.FLOAT32)
    add(a + "attention.layer_norm_rms_epsilon", float(rms_eps), ValueType.FLOAT32)
    add("general.file_type", 3, ValueType.UINT32)  # informational ("mostly Q4_1")
    add(a + "vocab_size", n_vocab, ValueType.UINT32)
    add(a + "rope.dimension_count", n_rot, ValueType.UINT32)
    if head_dim is not None:
        add(a + "attention.key_length", hd, ValueType.UINT32)
        add(a + "attention.value_length", hd, ValueType.UINT32)
    if rope_scaling is not None:
        add(a + "rope.scaling.type", "linear")
        add(a + "rope.scaling.factor", float(rope_scaling), ValueType.FLOAT32)
    if rope_scale_linear is not None:
        add(a + "rope.scale_linear", float(rope_scale_linear), ValueType.FLOAT32)
    add("tokenizer.ggml.add_space_prefix", False, ValueType.BOOL)
    add("tokenizer.ggml.add_bos_token", bool(add_bos), ValueType.BOOL)
    add("tokenizer.ggml.model", "gpt2")
    add("tokenizer.ggml.pre", "qwen2" if arch == "qwen2" else "smollm")
    add("tokenizer.ggml.tokens", tokens, ValueType.ARRAY, ValueType.STRING)
    add("tokenizer.ggml.token_type", token_types, ValueType.ARRAY, ValueType.INT32)
    add("tokenizer.ggml.merges", merges, ValueType.ARRAY, ValueType.STRING)
    add("tokenizer.ggml.bos_token_id", 1, ValueType.UINT32)
    add("tokenizer.ggml.eos_token_id", 2, ValueType.UINT32)
    add("tokenizer.ggml.unknown_token_id", 0, ValueType.UINT32)
    add("tokenizer.ggml.padding_token_id", 2, ValueType.UINT32)
    add("tokenizer.chat_template", CHATML_TEMPLATE)
    add("general.quantization_version", 2, ValueType.UINT32)
    kv = [e for e in kv if e[0] not in omit_kv]  # (extra_kv may put one back)
    for key, value in (extra_kv or {}).items():  # a tuple: (value, type[, element type])
        if isinstance(value, tuple):
            add(key, *value)
        else:
            add(key, value)
    w = GGUFWriter(version=version)
    for key, value, vtype, elem_type in kv:
        if vtype == ValueType.ARRAY:
            w.add_array(key, value, elem_type)
        else:
            w.add(key, value, vtype)

    weights: dict[str, np.ndarray] = {}
    used_types: dict[str, str] = {}
    for name, shape in shapes:
        if name.endswith(".bias"):
            t = "F32"
            x = 0.5 * rng.standard_normal(shape)
        elif len(shape) == 1:
            t = "F32"
            x = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            t = type_of(name)
            scale = 1.0 if name == "token_embd.weight" else 1.0 / np.sqrt(shape[1])
            if name.endswith(("attn_v.weight", "attn_output.weight")):
                scale *= attn_gain  # > 1: the context weighs more against the token
            x = scale * rng.standard_normal(shape)
        x = x.astype(np.float32)
        code = GGMLType.parse(t)
        data = quantize(x, code)
        w.add_tensor_raw(name, code, list(reversed(shape)), data)
        weights[name] = dequantize(data, code, shape)
        used_types[name] = GGMLType.NAMES[code]
    extra = dict(extra_tensors or {})
    if rope_freqs is not False:
        f = (rng.uniform(1.0, 8.0, n_rot // 2) if rope_freqs is True
             else np.asarray(rope_freqs, np.float64))
        if f.shape != (n_rot // 2,):
            raise ValueError(f"rope_freqs: {n_rot // 2} factors, got shape {f.shape}")
        extra["rope_freqs.weight"] = f
    for name, x in extra.items():
        x = np.asarray(x, np.float32)
        w.add_tensor(name, x, "F32")
        weights[name] = x
        used_types[name] = "F32"
    path = w.write(path)
    scale = rope_scaling if rope_scaling else (rope_scale_linear or 1.0)
    config = {
        "n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "n_head_kv": n_head_kv,
        "n_ff": n_ff, "n_vocab": n_vocab, "n_ctx": n_ctx, "head_dim": hd, "rope_dim": n_rot,
        "rope_freq_base": rope_freq_base, "rms_eps": rms_eps, "tied_output": tied_output,
        "bos_id": 1, "eos_id": 2, "arch": arch, "rope_neox": arch == "qwen2",
        "rope_scale": scale, "biases": tuple(biases),
    }
    return TinyLlama(path, config, tokens, token_types, merges, weights, used_types)
