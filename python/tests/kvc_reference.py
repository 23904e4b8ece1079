"""numpy reference implementations for the kvcache tests, written from
shared/docs/SEMANTICS.md sections 1-3 (not from the C code).

Quantization is computed in float32 exactly as SEMANTICS 1 says, so the C
results must match these bit for bit:

    absmax = max|x| (float32)
    scale  = max(absmax / qmax, float32(1e-5)), float32 division, then rounded
             to the scale dtype; the rounded value is used below
    q      = clip(rint(x32 / scale32), -qmax, qmax)     (rint: half to even)
    dequant = (float32(q) * scale32) converted to the output dtype

Float storage conversions are numpy / ml_dtypes ``astype`` (round to nearest
even). The operator references are plain per-token Python loops that mutate
the cache/scale arrays they are given in place.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.dtype(np.float32)
F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
I8 = np.dtype(np.int8)
U8 = np.dtype(np.uint8)
FLOATS = (F32, F16, BF16)
EPS = np.float32(1e-5)

DTYPE_NAMES = {F32: "f32", F16: "f16", BF16: "bf16", I8: "i8", U8: "u8"}


def qmax(bits: int) -> int:
    return 127 if bits == 8 else 7


# ---------------------------------------------------------------------------
# Section 1: quantization


def quantize(x, bits: int, group: int, scale_dtype):
    """x (..., D) float -> (q, scale): q int8 values (..., D) in [-qmax, qmax]
    (unpacked, also for 4 bits), scale (..., D/group) of scale_dtype."""
    x32 = np.asarray(x).astype(F32)
    shape = x32.shape
    g = x32.reshape(-1, group)
    absmax = np.abs(g).max(axis=1)
    assert absmax.dtype == F32
    scale = np.maximum(absmax / np.float32(qmax(bits)), EPS).astype(scale_dtype)
    s32 = scale.astype(F32)
    ratio = g / s32[:, None]
    assert ratio.dtype == F32
    q = np.clip(np.rint(ratio), -qmax(bits), qmax(bits)).astype(np.int8)
    return q.reshape(shape), scale.reshape(shape[:-1] + (shape[-1] // group,))


def dequantize(q, scale, group: int, out_dtype):
    """q int values (..., D) (unpacked), scale (..., D/group) -> (..., D) out_dtype."""
    q32 = np.asarray(q).astype(F32)
    shape = q32.shape
    s32 = np.asarray(scale).astype(F32).reshape(-1)
    y = q32.reshape(-1, group) * s32[:, None]
    assert y.dtype == F32
    return y.reshape(shape).astype(out_dtype)


def pack4(q):
    """int values (..., D) in [-8, 7] -> uint8 (..., D/2): element 2i in the low nibble."""
    u = np.asarray(q).astype(np.int8).view(np.uint8) & 0x0F
    return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)


def unpack4(b):
    """uint8 (..., D/2) -> int8 (..., D), each nibble a 4-bit two's complement number."""
    b = np.asarray(b).astype(np.uint8)
    lo = (b & 0x0F).astype(np.int8)
    hi = (b >> 4).astype(np.int8)
    lo = np.where(lo >= 8, lo - 16, lo).astype(np.int8)
    hi = np.where(hi >= 8, hi - 16, hi).astype(np.int8)
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), np.int8)
    out[..., 0::2] = lo
    out[..., 1::2] = hi
    return out


# ---------------------------------------------------------------------------
# Storage of one row (one token, one head: Dh values)


class Storage:
    """How rows are stored: quant_bit, quant_group, cache/scale dtypes."""

    def __init__(self, quant_bit: int, quant_group: int):
        self.bits = quant_bit
        self.group = quant_group

    def store(self, cache, scale, idx, row):
        """cache[idx] <- row (Dh values of T1), quantized when bits != 0."""
        if self.bits == 0:
            cache[idx] = np.asarray(row).astype(cache.dtype)
            return
        q, s = quantize(row, self.bits, self.group, scale.dtype)
        cache[idx] = q if self.bits == 8 else pack4(q)
        scale[idx] = s

    def load(self, cache, scale, idx, out_dtype):
        """The Dh values at cache[idx], dequantized, as out_dtype."""
        if self.bits == 0:
            return np.asarray(cache[idx]).astype(out_dtype)
        q = cache[idx] if self.bits == 8 else unpack4(cache[idx])
        return dequantize(q, scale[idx], self.group, out_dtype)


# ---------------------------------------------------------------------------
# Section 2: static KeyValueCache


def static_index(layout: int, b: int, layer: int, kv: int, t: int, h: int):
    if layout == 0:  # (MaxB, L, 2, MaxS, H, Dh)
        return (b, layer, kv, t, h)
    return (layer, b, kv, h, t)  # (L, MaxB, 2, H, MaxS, Dh)


def static_cache_shape(layout, max_b, num_layer, max_s, heads, last):
    if layout == 0:
        return (max_b, num_layer, 2, max_s, heads, last)
    return (num_layer, max_b, 2, heads, max_s, last)


def key_value_cache(ck, cv, start_pos, cache, scale, *, layer_idx=0, quant_bit=0,
                    quant_group=8, num_repeat=1, cache_layout=0):
    """Reference of kvcache.pmx.key_value_cache; mutates cache/scale in place
    and returns (key, value)."""
    st = Storage(quant_bit, quant_group)
    ck, cv = np.asarray(ck), np.asarray(cv)
    B, S, H, Dh = ck.shape
    for kv, x in enumerate((ck, cv)):
        for b in range(B):
            for s in range(S):
                for h in range(H):
                    idx = static_index(cache_layout, b, layer_idx, kv, start_pos + s, h)
                    st.store(cache, scale, idx, x[b, s, h])
    T = start_pos + S
    outs = []
    for kv in range(2):
        out = np.empty((B, T, H * num_repeat, Dh), ck.dtype)
        for b in range(B):
            for t in range(T):
                for h in range(H):
                    idx = static_index(cache_layout, b, layer_idx, kv, t, h)
                    out[b, t, h * num_repeat:(h + 1) * num_repeat] = st.load(
                        cache, scale, idx, ck.dtype)
        outs.append(out)
    return outs[0], outs[1]


# ---------------------------------------------------------------------------
# Section 3: dynamic_batching.KeyValueCache


def dynamic_index(layout: int, layer: int, kv: int, slot: int, h: int):
    return {
        0: (slot, layer, kv, h),  # (MaxT, L, 2, H, Dh)
        1: (layer, slot, kv, h),  # (L, MaxT, 2, H, Dh)
        2: (layer, kv, slot, h),  # (L, 2, MaxT, H, Dh)
        3: (layer, kv, h, slot),  # (L, 2, H, MaxT, Dh)
    }[layout]


def dynamic_cache_shape(layout, max_t, num_layer, heads, last):
    return {
        0: (max_t, num_layer, 2, heads, last),
        1: (num_layer, max_t, 2, heads, last),
        2: (num_layer, 2, max_t, heads, last),
        3: (num_layer, 2, heads, max_t, last),
    }[layout]


def slot_of(cachestarts, cache_mode, page_size, b, t):
    """Index along MaxT of position t of batch b (SEMANTICS 3)."""
    cachestarts = np.asarray(cachestarts)
    if cache_mode == 0:
        return int(cachestarts[b]) + t
    page = int(cachestarts[b, t // page_size])
    assert page >= 0, "reference asked to read an unused page entry"
    return page + t % page_size


def dynamic_key_value_cache(ck, cv, seqstarts, kvstarts, cachestarts, start_pos, cache, scale,
                            *, layer_idx=0, quant_bit=0, quant_group=8, num_repeat=1,
                            cache_mode=0, cache_layout=0, page_size=128):
    """Reference of kvcache.pmx.dynamic_key_value_cache; mutates cache/scale in
    place and returns (key, value)."""
    st = Storage(quant_bit, quant_group)
    ck, cv = np.asarray(ck), np.asarray(cv)
    _, H, Dh = ck.shape
    B = len(seqstarts) - 1
    for b in range(B):
        s_b = int(seqstarts[b + 1] - seqstarts[b])
        p_b = int(start_pos[b])
        assert int(kvstarts[b + 1] - kvstarts[b]) == p_b + s_b
        for kv, x in enumerate((ck, cv)):
            for s in range(s_b):
                slot = slot_of(cachestarts, cache_mode, page_size, b, p_b + s)
                for h in range(H):
                    st.store(cache, scale, dynamic_index(cache_layout, layer_idx, kv, slot, h),
                             x[int(seqstarts[b]) + s, h])
    outs = []
    for kv in range(2):
        out = np.empty((int(kvstarts[B]), H * num_repeat, Dh), ck.dtype)
        for b in range(B):
            for t in range(int(kvstarts[b + 1] - kvstarts[b])):
                slot = slot_of(cachestarts, cache_mode, page_size, b, t)
                for h in range(H):
                    out[int(kvstarts[b]) + t, h * num_repeat:(h + 1) * num_repeat] = st.load(
                        cache, scale, dynamic_index(cache_layout, layer_idx, kv, slot, h),
                        ck.dtype)
        outs.append(out)
    return outs[0], outs[1]


# ---------------------------------------------------------------------------
# Test helpers


def storage_configs():
    """(id, t1, cache dtype ('int4' for packed), quant_bit, scale dtype|None):
    every float T1 x float T2 with quant_bit 0, the int8 plain copy, and every
    float T1 x scale dtype for int8 and int4."""
    out = []
    for t1 in FLOATS:
        for t2 in FLOATS:
            out.append((f"{DTYPE_NAMES[t1]}->{DTYPE_NAMES[t2]}", t1, t2, 0, None))
    out.append(("i8->i8", I8, I8, 0, None))
    for bits in (8, 4):
        for t1 in FLOATS:
            for sdt in (F32, F16):
                out.append((f"{DTYPE_NAMES[t1]}->q{bits}/{DTYPE_NAMES[sdt]}", t1,
                            I8 if bits == 8 else "int4", bits, sdt))
    return out


def random_input(rng, shape, dtype, spread=True):
    """Finite random values of dtype; with spread, magnitudes vary per row so
    that scales cover several binades."""
    dtype = np.dtype(dtype)
    if dtype == I8:
        return rng.integers(-128, 128, size=shape, dtype=np.int8)
    x = rng.standard_normal(shape).astype(np.float32)
    if spread and len(shape):
        mag = np.float32(2.0) ** rng.integers(-6, 6, size=shape[:-1] + (1,)).astype(np.float32)
        x = x * mag
    return x.astype(dtype)


def random_cache(rng, shape, cache_dtype):
    """Garbage cache contents (finite): the operators must leave untouched
    bytes as they are and read stored ones back."""
    if isinstance(cache_dtype, str) and cache_dtype == "int4":
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    cache_dtype = np.dtype(cache_dtype)
    if cache_dtype == I8:
        return rng.integers(-128, 128, size=shape, dtype=np.int8)
    return rng.standard_normal(shape).astype(np.float32).astype(cache_dtype)


def random_scale(rng, shape, scale_dtype):
    return rng.uniform(0.001, 0.1, size=shape).astype(np.float32).astype(scale_dtype)


def assert_same_bytes(actual, expected, what="array"):
    """Exact comparison (tolerance 0) of dtype, shape and every byte, with a
    report of the first mismatches."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.size == 0:
        return
    a = np.ascontiguousarray(actual)
    e = np.ascontiguousarray(expected)
    if a.tobytes() == e.tobytes():
        return
    ui = np.dtype(f"u{a.itemsize}")
    au, eu = a.view(ui), e.view(ui)
    bad = np.argwhere(au != eu)
    lines = []
    for idx in bad[:6]:
        idx = tuple(int(i) for i in idx)
        lines.append(f"  at {idx}: got {a[idx]!r} (0x{int(au[idx]):x}), "
                     f"expected {e[idx]!r} (0x{int(eu[idx]):x})")
    raise AssertionError(f"{what}: {len(bad)} of {a.size} elements differ "
                         f"(shape {a.shape}, dtype {a.dtype}):\n" + "\n".join(lines))
