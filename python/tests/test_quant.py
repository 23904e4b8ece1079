"""kvcache.convert / quantize / dequantize against the SEMANTICS 1 reference,
exactly (tolerance 0), on every ISA."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
import kvc_reference as ref
from kvc_reference import BF16, F16, F32, FLOATS, assert_same_bytes

NAMES = ref.DTYPE_NAMES


# ---------------------------------------------------------------------------
# convert


def _special_values():
    v = [0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 70000.0, -70000.0, 1e-8, -1e-8, 6e-5, 5.9e-8,
         2.9e-8, 3.0e-8, np.inf, -np.inf, 3.4e38, 1e-40, -1e-40,
         # bf16 ties (8 significant bits): 1 + 2^-8 ties to 1, 1 + 3*2^-8 to 1 + 2^-6
         1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8),
         # f16 ties (11 significant bits)
         1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2048 + 1, 2048 + 3]
    return np.array(v, np.float32)


@pytest.mark.parametrize("src", FLOATS, ids=NAMES.get)
@pytest.mark.parametrize("dst", FLOATS, ids=NAMES.get)
@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_convert_matches_astype(isa, rng, src, dst):
    for n in (0, 1, 7, 16, 33, 257):
        x = (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20, n)).astype(np.float32)
        x = x.astype(src)
        assert_same_bytes(kvcache.convert(x, dst), x.astype(dst), f"convert n={n}")
    x = _special_values().astype(src)
    assert_same_bytes(kvcache.convert(x, dst), x.astype(dst), "convert special values")


@pytest.mark.parametrize("src", FLOATS, ids=NAMES.get)
@pytest.mark.parametrize("dst", FLOATS, ids=NAMES.get)
def test_convert_nan_stays_nan(isa, src, dst):
    x = np.array([np.nan, -np.nan, 1.0, np.nan], np.float32).astype(src)
    y = kvcache.convert(x, dst)
    assert np.isnan(y.astype(np.float32)).tolist() == [True, True, False, True]


def test_convert_shapes_and_names():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, ::2]  # non-contiguous
    y = kvcache.convert(x, "bfloat16")
    assert y.shape == (2, 2, 4) and y.dtype == BF16
    assert_same_bytes(y, x.astype(BF16))
    assert kvcache.convert(np.float32(3.5), np.float16).shape == ()
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.convert(np.zeros(3, np.float64), np.float32)
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.convert(np.zeros(3, np.float32), np.int8)


# ---------------------------------------------------------------------------
# quantize / dequantize

QUANT_SHAPES = [((4, 64), 8), ((3, 40), 8), ((2, 3, 32), 32), ((5, 2), 2), ((1, 128), 16),
                ((7, 24), 4), ((2, 96), 96), ((3, 1024), 128), ((2, 256), 64), ((9, 6), 6)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("xdt", FLOATS, ids=NAMES.get)
@pytest.mark.parametrize("sdt", [F32, F16], ids=NAMES.get)
def test_quantize_matches_reference(isa, rng, bits, xdt, sdt):
    for shape, group in QUANT_SHAPES:
        x = ref.random_input(rng, shape, xdt)
        # a few all-zero groups and tiny groups (scale = eps)
        flat = x.reshape(-1, group)
        flat[0] = 0
        if len(flat) > 2:
            flat[2] = (flat[2].astype(np.float32) * np.float32(1e-6)).astype(xdt)
        q, s = kvcache.quantize(x, bits, group, sdt)
        eq, es = ref.quantize(x, bits, group, sdt)
        what = f"quantize {shape} g={group}"
        assert_same_bytes(s, es, what + " scale")
        assert_same_bytes(q, eq if bits == 8 else ref.pack4(eq), what + " q")
        for ydt in FLOATS:
            y = kvcache.dequantize(q, s, bits, group, ydt)
            assert_same_bytes(y, ref.dequantize(eq, es, group, ydt), what + f" dequant {ydt}")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("sdt", [F32, F16], ids=NAMES.get)
def test_dequantize_any_bytes(isa, rng, bits, sdt):
    """Every byte pattern dequantizes as float32(q) * scale (int4 nibbles are
    two's complement, so -8 reads as -8)."""
    group = 8
    if bits == 8:
        q = np.arange(-128, 128, dtype=np.int8).reshape(-1, 32)
        vals = q
    else:
        q = np.arange(256, dtype=np.uint8).reshape(-1, 32)
        vals = ref.unpack4(q)
    s = ref.random_scale(rng, (q.shape[0], vals.shape[1] // group), sdt)
    for ydt in FLOATS:
        assert_same_bytes(kvcache.dequantize(q, s, bits, group, ydt),
                          ref.dequantize(vals, s, group, ydt), f"dequantize {ydt}")


def test_zero_group_gets_eps_scale(isa):
    for sdt in (F32, F16):
        for bits in (8, 4):
            q, s = kvcache.quantize(np.zeros((2, 16), np.float32), bits, 8, sdt)
            assert_same_bytes(s, np.full((2, 2), np.float32(1e-5)).astype(sdt))
            assert not q.any()


@pytest.mark.parametrize("sdt", [F32, F16], ids=NAMES.get)
def test_rounding_ties_go_to_even(isa, sdt):
    # absmax 127 -> scale exactly 1: x / scale is x, and .5 ties round to even.
    x8 = np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5,
                   -127, 3.5, 4.5, -3.5, -4.5, 0.49999997, 100.5, -126.5], np.float32)
    q, s = kvcache.quantize(x8, 8, 8, sdt)
    assert s.astype(np.float32).tolist() == [1.0, 1.0]
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -127, 4, 4, -4, -4, 0, 100, -126]
    # absmax 7 -> scale exactly 1 for int4.
    x4 = np.array([7, 0.5, 1.5, 2.5, -2.5, 3.5, -3.5, 6.5,
                   -7, 4.5, -4.5, 5.5, -5.5, -0.5, -1.5, -6.5], np.float32)
    q, s = kvcache.quantize(x4, 4, 8, sdt)
    assert s.astype(np.float32).tolist() == [1.0, 1.0]
    assert ref.unpack4(q).tolist() == [7, 0, 2, 2, -2, 4, -4, 6, -7, 4, -4, 6, -6, 0, -2, -6]


@pytest.mark.parametrize("xdt", FLOATS, ids=NAMES.get)
def test_extremes(isa, rng, xdt):
    x = ref.random_input(rng, (6, 16), xdt, spread=False)
    x[:, 3] = np.abs(x).max(axis=1) * 2
    x[:, 11] = -np.abs(x).max(axis=1) * 2
    for bits, qm in ((8, 127), (4, 7)):
        for sdt in (F32, F16):
            q, s = kvcache.quantize(x, bits, 8, sdt)
            eq, es = ref.quantize(x, bits, 8, sdt)
            vals = q if bits == 8 else ref.unpack4(q)
            assert_same_bytes(vals, eq)
            assert (vals[:, 3] == qm).all() and (vals[:, 11] == -qm).all()
            assert vals.max() <= qm and vals.min() >= -qm


def test_int4_nibble_order():
    x = np.array([7, -7, 1, -1, 0, 3, -3, 2], np.float32)
    q, s = kvcache.quantize(x, 4, 8)
    assert s.tolist() == [1.0]
    assert q.dtype == np.uint8 and q.tolist() == [0x97, 0xF1, 0x30, 0x2D]
    y = kvcache.dequantize(q, s, 4, 8)
    assert y.tolist() == x.tolist()


def test_quantize_noncontiguous_input(rng):
    big = ref.random_input(rng, (4, 3, 32), F16)
    x = big[:, 1, :]
    q, s = kvcache.quantize(x, 8, 8, F16)
    eq, es = ref.quantize(x, 8, 8, F16)
    assert_same_bytes(q, eq)
    assert_same_bytes(s, es)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("xdt", FLOATS, ids=NAMES.get)
def test_quantize_rejects_non_finite(isa, xdt, bad):
    x = np.ones((3, 32), np.float32)
    x[2, 31] = bad
    with pytest.raises(kvcache.InvalidArgumentError, match="NaN or Inf"):
        kvcache.quantize(x.astype(xdt), 8, 8)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_float16_scale_overflow(isa, bits):
    """A group whose absmax / qmax reaches 65520 would store a float16 scale of
    +inf (and read back NaN): refused with float16 scales, at 65520 * qmax
    exactly, while the float32 just below stores 65504 and float32 scales take
    any finite input."""
    qmax = 127 if bits == 8 else 7
    lim = np.float32(65520 * qmax)
    x = np.ones((4, 32), np.float32)
    x[2, 17] = -lim
    with pytest.raises(kvcache.InvalidArgumentError, match="float16 scale"):
        kvcache.quantize(x, bits, 8, scale_dtype=np.float16)
    q, s = kvcache.quantize(x, bits, 8, scale_dtype=np.float32)
    assert s[2, 2] == np.float32(lim / qmax)
    x[2, 17] = -np.nextafter(lim, np.float32(0))
    q, s = kvcache.quantize(x, bits, 8, scale_dtype=np.float16)
    assert s[2, 2] == np.float16(65504)
    assert np.isfinite(kvcache.dequantize(q, s, bits, 8)).all()


def test_quant_argument_errors():
    x = np.ones((2, 16), np.float32)
    with pytest.raises(kvcache.InvalidArgumentError, match="quant_bit"):
        kvcache.quantize(x, 5, 8)
    with pytest.raises(kvcache.InvalidArgumentError, match="quant_group"):
        kvcache.quantize(x, 8, 0)
    with pytest.raises(kvcache.InvalidArgumentError, match="even"):
        kvcache.quantize(x, 4, 1)
    with pytest.raises(kvcache.InvalidArgumentError, match="divide"):
        kvcache.quantize(x, 8, 3)
    with pytest.raises(kvcache.InvalidArgumentError, match="scale dtype"):
        kvcache.quantize(x, 8, 8, BF16)
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.quantize(x.astype(np.float64), 8, 8)
    q, s = kvcache.quantize(x, 8, 8)
    with pytest.raises(kvcache.InvalidArgumentError, match="scale has"):
        kvcache.dequantize(q, s[:, :1], 8, 8)
    with pytest.raises(kvcache.InvalidArgumentError, match="int8"):
        kvcache.dequantize(q.view(np.uint8), s, 8, 8)
    with pytest.raises(kvcache.InvalidArgumentError, match="quant_bit"):
        kvcache.dequantize(q, s, 6, 8)
