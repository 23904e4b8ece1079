"""kvcache.packbits / segment_packbits / build_packed_custom_mask against
numpy.packbits (SEMANTICS sections 4 and 5): every size up to 64 and random
sizes up to 1e6, both bit orders, bool / uint8 / int / float inputs, unaligned
views, empty segments, the packed custom-mask bit layout, and rejected calls."""

from __future__ import annotations

import kvcache
import numpy as np
import pytest
from kvcache import mask as kmask

ORDERS = ("big", "little")


def _random_bools(rng, n, p=0.5):
    return rng.random(n) < p


def _np_segment_packbits(x, indptr, bitorder):
    x = np.asarray(x).reshape(-1)
    parts = [np.packbits(x[indptr[i]:indptr[i + 1]], bitorder=bitorder)
             for i in range(len(indptr) - 1)]
    sizes = [len(p) for p in parts]
    y = np.concatenate(parts) if parts else np.empty(0, np.uint8)
    return y, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


# ---------------------------------------------------------------------------
# packbits


@pytest.mark.parametrize("bitorder", ORDERS)
def test_packbits_every_small_size(rng, bitorder):
    for n in range(65):
        for _ in range(3):
            x = _random_bools(rng, n)
            y = kvcache.packbits(x, bitorder)
            assert y.dtype == np.uint8 and y.shape == ((n + 7) // 8,)
            np.testing.assert_array_equal(y, np.packbits(x, bitorder=bitorder), err_msg=f"n={n}")


@pytest.mark.parametrize("bitorder", ORDERS)
def test_packbits_random_large_sizes(rng, bitorder):
    sizes = [1_000_000, 999_999, 256, 257, 255, 4095] + list(rng.integers(65, 1_000_000, 4))
    for n in sizes:
        x = _random_bools(rng, int(n), p=rng.random())
        np.testing.assert_array_equal(kvcache.packbits(x, bitorder),
                                      np.packbits(x, bitorder=bitorder), err_msg=f"n={n}")


def test_packbits_default_is_big_and_flashinfer_example():
    x = np.array([1, 0, 1, 1, 0, 0, 1, 1], np.uint8)
    assert kvcache.packbits(x).tolist() == [0b10110011]
    assert kvcache.packbits(x, "little").tolist() == [0b11001101]
    assert kvcache.packbits([True, False, True]).tolist() == [0b10100000]


@pytest.mark.parametrize("dtype", [np.bool_, np.uint8, np.int8, np.int32, np.int64, np.uint16,
                                   np.float32, np.float64])
@pytest.mark.parametrize("bitorder", ORDERS)
def test_packbits_dtypes_use_truth_values(rng, dtype, bitorder):
    n = 1000
    if dtype == np.bool_:
        x = _random_bools(rng, n)
    else:
        # Zeros, and values whose only set bits are high or low ones (so that
        # looking at one byte of a wide element would be caught).
        choices = np.array([0, 0, 0, 1, 2, 64, 127], dtype=np.int64)
        if np.dtype(dtype).itemsize >= 2:
            choices = np.append(choices, [256, 512, 0x100 * 0x7f])
        x = rng.choice(choices, n).astype(dtype)
        if np.dtype(dtype).kind == "i":
            x[rng.random(n) < 0.1] = -1
        if np.dtype(dtype).kind == "f":
            x[rng.random(n) < 0.1] = 0.5
            x[3] = np.nan  # truthy, as np.array(np.nan).astype(bool)
            x[4] = -0.0  # falsy
    want = np.packbits(x.astype(bool), bitorder=bitorder)
    np.testing.assert_array_equal(kvcache.packbits(x, bitorder), want)
    if x.dtype.kind in "biu":
        np.testing.assert_array_equal(np.packbits(x, bitorder=bitorder), want)


def test_packbits_uint8_values_above_one_are_true():
    x = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(kvcache.packbits(x), np.packbits(x))
    np.testing.assert_array_equal(kvcache.packbits(x, "little"), np.packbits(x, bitorder="little"))


@pytest.mark.parametrize("bitorder", ORDERS)
def test_packbits_unaligned_and_strided_views(rng, bitorder):
    base = _random_bools(rng, 5000)
    for off in range(1, 9):
        v = base[off:]
        np.testing.assert_array_equal(kvcache.packbits(v, bitorder),
                                      np.packbits(v, bitorder=bitorder))
    u8 = base.view(np.uint8)
    for v in (u8[3:], u8[::3], u8[::-1], base.reshape(50, 100)[:, 7:], base.reshape(100, 50).T):
        np.testing.assert_array_equal(kvcache.packbits(v, bitorder),
                                      np.packbits(v.reshape(-1), bitorder=bitorder))


def test_packbits_flattens_any_shape_and_lists(rng):
    x = _random_bools(rng, 2 * 3 * 5).reshape(2, 3, 5)
    np.testing.assert_array_equal(kvcache.packbits(x), np.packbits(x.reshape(-1)))
    np.testing.assert_array_equal(kvcache.packbits(x.tolist()), np.packbits(x.reshape(-1)))
    assert kvcache.packbits(np.bool_(True)).tolist() == [0x80]
    assert kvcache.packbits([]).shape == (0,)


def test_packbits_bool_and_byte_inputs_are_not_copied(rng):
    base = _random_bools(rng, 100)
    for v in (base, base[1:], base.view(np.uint8)[3:], base.view(np.int8).reshape(10, 10)):
        assert np.shares_memory(kmask._truth_bytes(v, "x"), base)


def test_packbits_does_not_modify_input(rng):
    x = rng.integers(0, 4, 333).astype(np.uint8)
    before = x.copy()
    kvcache.packbits(x[1:], "little")
    np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize("bad", ["middle", "BIG", "", None, 0, 1])
def test_packbits_bad_bitorder(bad):
    with pytest.raises(kvcache.InvalidArgumentError, match="bitorder"):
        kvcache.packbits(np.ones(8, bool), bad)
    with pytest.raises(ValueError):
        kvcache.packbits(np.ones(8, bool), bad)


def test_packbits_rejects_non_numeric():
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.packbits(np.array(["a", "b"]))


def test_c_packbits_rejects_and_leaves_output():
    out = np.full(4, 0x5A, np.uint8)
    x = np.ones(16, np.uint8)
    for n, order in ((-1, 0), (16, 2), (16, -1)):
        with pytest.raises(kvcache.InvalidArgumentError):
            kvcache._lib.check(kmask.kvc_packbits(x.ctypes.data, n, order, out.ctypes.data))
    with pytest.raises(kvcache.InvalidArgumentError, match="x is NULL"):
        kvcache._lib.check(kmask.kvc_packbits(None, 3, 0, out.ctypes.data))
    assert (out == 0x5A).all()


# ---------------------------------------------------------------------------
# segment_packbits


@pytest.mark.parametrize("bitorder", ORDERS)
@pytest.mark.parametrize("idx_dtype", [np.int32, np.int64])
def test_segment_packbits_random(rng, bitorder, idx_dtype):
    for trial in range(60):
        B = int(rng.integers(0, 20))
        maxlen = (20, 70, 600)[trial % 3]
        lens = rng.integers(0, maxlen + 1, B)
        lens[rng.random(B) < 0.25] = 0
        indptr = np.concatenate([[0], np.cumsum(lens)]).astype(idx_dtype)
        x = _random_bools(rng, int(indptr[-1]))
        y, new_indptr = kvcache.segment_packbits(x, indptr, bitorder)
        want_y, want_ip = _np_segment_packbits(x, indptr, bitorder)
        np.testing.assert_array_equal(y, want_y)
        np.testing.assert_array_equal(new_indptr, want_ip)
        assert new_indptr.dtype == np.dtype(idx_dtype)
        assert y.dtype == np.uint8


def test_segment_packbits_flashinfer_example_and_dtypes():
    x = np.array([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], bool)
    y, ip = kvcache.segment_packbits(x, [0, 4, 7, 11])
    assert y.tolist() == [0b10110000, 0b00100000, 0b11010000]
    assert ip.tolist() == [0, 1, 2, 3] and ip.dtype == np.int32
    _, ip = kvcache.segment_packbits(x, np.array([0, 4, 7, 11], np.int64))
    assert ip.dtype == np.int64
    _, ip = kvcache.segment_packbits(x, np.array([0, 4, 7, 11], np.uint16))
    assert ip.dtype == np.int32


def test_segment_packbits_large_and_unaligned(rng):
    n = 1_000_000
    base = _random_bools(rng, n + 1).view(np.uint8) * rng.integers(1, 256, n + 1).astype(np.uint8)
    x = base[1:]
    cuts = np.sort(rng.integers(0, n + 1, 500))
    indptr = np.concatenate([[0], cuts, cuts[-1:], [n]]).astype(np.int64)  # one empty segment
    for bitorder in ORDERS:
        y, ip = kvcache.segment_packbits(x, indptr, bitorder)
        want_y, want_ip = _np_segment_packbits(x, indptr, bitorder)
        np.testing.assert_array_equal(y, want_y)
        np.testing.assert_array_equal(ip, want_ip)


def test_segment_packbits_empty_batch_and_empty_segments():
    y, ip = kvcache.segment_packbits(np.zeros(0, bool), [0])
    assert y.shape == (0,) and ip.tolist() == [0]
    y, ip = kvcache.segment_packbits(np.zeros(0, bool), [0, 0, 0])
    assert y.shape == (0,) and ip.tolist() == [0, 0, 0]
    y, ip = kvcache.segment_packbits([1, 1], [0, 0, 2, 2], "little")
    assert y.tolist() == [3] and ip.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("indptr, match", [
    ([], "B\\+1 >= 1"),
    ([1, 4, 8], "indptr\\[0\\] must be 0"),
    ([0, 5, 3, 8], "indptr\\[2\\] = 3 < indptr\\[1\\] = 5"),
    ([0, 4, 9], "x has 8 elements but indptr\\[-1\\] = 9"),
    ([0, 4, 7], "x has 8 elements but indptr\\[-1\\] = 7"),
    ([[0, 8]], "1-D"),
    ([0.0, 8.0], "integers"),
    ([0, 2**31], "outside int32"),
])
def test_segment_packbits_rejects(indptr, match):
    with pytest.raises(kvcache.InvalidArgumentError, match=match):
        kvcache.segment_packbits(np.ones(8, bool), indptr)


def test_segment_packbits_bad_bitorder():
    with pytest.raises(kvcache.InvalidArgumentError, match="bitorder"):
        kvcache.segment_packbits(np.ones(8, bool), [0, 8], "native")


def test_c_segment_packbits_rejects_leave_outputs_unchanged():
    x = np.ones(30, np.uint8)
    out = np.full(16, 0x5A, np.uint8)
    ip = np.array([0, 10, 20, 30], np.int32)
    out_ip = np.full(4, -7, np.int32)
    t_ip, t_out = kvcache._lib.make_tensor(ip), kvcache._lib.make_tensor(out_ip)
    calls = [
        (x.ctypes.data, t_ip, 0, out.ctypes.data, 5, t_out),  # needs 6 bytes
        (x.ctypes.data, t_ip, 3, out.ctypes.data, 16, t_out),  # bitorder
        (None, t_ip, 0, out.ctypes.data, 16, t_out),  # x NULL
    ]
    for args in calls:
        with pytest.raises(kvcache.InvalidArgumentError):
            kvcache._lib.check(kmask.kvc_segment_packbits(*args))
    bad_ip = np.array([0, 10, 9, 30], np.int32)
    with pytest.raises(kvcache.InvalidArgumentError, match="non-decreasing"):
        kvcache._lib.check(kmask.kvc_segment_packbits(
            x.ctypes.data, kvcache._lib.make_tensor(bad_ip), 0, out.ctypes.data, 16, t_out))
    out64 = np.full(4, -7, np.int64)
    with pytest.raises(kvcache.InvalidArgumentError, match="dtype"):
        kvcache._lib.check(kmask.kvc_segment_packbits(
            x.ctypes.data, t_ip, 0, out.ctypes.data, 16, kvcache._lib.make_tensor(out64)))
    assert (out == 0x5A).all() and (out_ip == -7).all() and (out64 == -7).all()


# ---------------------------------------------------------------------------
# build_packed_custom_mask


def _random_masks(rng, B, qmax=12, kmax=40):
    masks = []
    for _ in range(B):
        q = int(rng.integers(0, qmax + 1)) if rng.random() > 0.15 else 0
        k = int(rng.integers(0, kmax + 1)) if rng.random() > 0.15 else 0
        masks.append(_random_bools(rng, q * k).reshape(q, k))
    return masks


def _check_layout(masks, packed, mask_indptr):
    assert packed.dtype == np.uint8 and mask_indptr.dtype == np.int32
    assert mask_indptr.shape == (len(masks) + 1,) and mask_indptr[0] == 0
    assert mask_indptr[-1] == packed.size
    for b, m in enumerate(masks):
        q_len, kv_len = m.shape
        assert mask_indptr[b + 1] - mask_indptr[b] == (q_len * kv_len + 7) // 8
        p = packed[mask_indptr[b]:mask_indptr[b + 1]]
        # Bit q * kv_len + k, read little-endian: (byte[off // 8] >> (off % 8)) & 1.
        q, k = np.meshgrid(np.arange(q_len), np.arange(kv_len), indexing="ij")
        off = q * kv_len + k
        bits = (p[off // 8] >> (off % 8)) & 1
        np.testing.assert_array_equal(bits.astype(bool), m.astype(bool), err_msg=f"request {b}")
        if (q_len * kv_len) % 8:  # padding bits are zero
            assert p[-1] >> ((q_len * kv_len) % 8) == 0


def test_custom_mask_from_list_layout(rng):
    for _ in range(40):
        masks = _random_masks(rng, int(rng.integers(0, 8)))
        packed, mask_indptr = kvcache.build_packed_custom_mask(masks)
        _check_layout(masks, packed, mask_indptr)


def test_custom_mask_flat_form_matches_list_form_and_segment_packbits(rng):
    for _ in range(30):
        masks = _random_masks(rng, int(rng.integers(1, 8)))
        qo = np.concatenate([[0], np.cumsum([m.shape[0] for m in masks])]).astype(np.int32)
        kv = np.concatenate([[0], np.cumsum([m.shape[1] for m in masks])]).astype(np.int32)
        flat = np.concatenate([m.reshape(-1) for m in masks])
        packed, mask_indptr = kvcache.build_packed_custom_mask(flat, qo, kv)
        _check_layout(masks, packed, mask_indptr)
        p2, ip2 = kvcache.build_packed_custom_mask(masks)
        np.testing.assert_array_equal(packed, p2)
        np.testing.assert_array_equal(mask_indptr, ip2)
        # FlashInfer's recipe: segment_packbits(custom_mask, cumsum(qo*kv), "little").
        seg = np.concatenate([[0], np.cumsum(np.diff(qo) * np.diff(kv))])
        p3, ip3 = kvcache.segment_packbits(flat, seg, "little")
        np.testing.assert_array_equal(packed, p3)
        np.testing.assert_array_equal(mask_indptr, ip3)
        # The flat mask may be an unaligned view, uint8 or int.
        shifted = np.concatenate([[True], flat])[1:]
        np.testing.assert_array_equal(
            kvcache.build_packed_custom_mask(shifted.astype(np.int64), qo, kv)[0], packed)


def test_custom_mask_3d_array_and_qo_longer_than_kv(rng):
    m = _random_bools(rng, 3 * 9 * 4).reshape(3, 9, 4)  # qo_len 9 > kv_len 4
    packed, ip = kvcache.build_packed_custom_mask(m)
    _check_layout(list(m), packed, ip)
    assert ip.tolist() == [0, 5, 10, 15]


def test_custom_mask_causal_example():
    # One request, qo_len 2, kv_len 3, bottom-right causal: row 0 sees keys
    # 0..1, row 1 sees 0..2 -> bits 110 111 little-endian = 0b111011.
    m = np.array([[1, 1, 0], [1, 1, 1]], bool)
    packed, ip = kvcache.build_packed_custom_mask([m])
    assert packed.tolist() == [0b111011] and ip.tolist() == [0, 1]


def test_custom_mask_empty_batch():
    packed, ip = kvcache.build_packed_custom_mask([])
    assert packed.shape == (0,) and ip.tolist() == [0]
    packed, ip = kvcache.build_packed_custom_mask(np.zeros(0, bool), [0], [0])
    assert packed.shape == (0,) and ip.tolist() == [0]


@pytest.mark.parametrize("args, match", [
    (([np.ones(4, bool)],), "masks\\[0\\] must be 2-D"),
    ((np.ones(4, bool),), "3-D"),
    ((np.ones(4, bool), [0, 2]), "both qo_indptr and kv_indptr"),
    ((np.ones(4, bool), [0, 2], [0, 2, 3]), "kv_indptr has 3 elements"),
    ((np.ones(4, bool), [0, 2], [0, 3]), "custom_mask has 4 elements.*need .* = 6"),
    ((np.ones(4, bool), [1, 3], [0, 2]), "qo_indptr\\[0\\] must be 0"),
    ((np.ones(4, bool), [0, 2, 1], [0, 2, 2]), "qo_indptr\\[2\\] = 1 < qo_indptr\\[1\\] = 2"),
    ((np.ones(4, bool), [0, 2**20], [0, 2**20]), "int32 mask_indptr"),
    ((np.ones(4, bool), [0, 2**31], [0, 1]), "outside int32"),
])
def test_custom_mask_rejects(args, match):
    with pytest.raises(kvcache.InvalidArgumentError, match=match):
        kvcache.build_packed_custom_mask(*args)


def test_c_custom_mask_rejects_leave_outputs_unchanged():
    m = np.ones(64, np.uint8)
    out = np.full(8, 0x5A, np.uint8)
    qo, kv = np.array([0, 2, 5], np.int32), np.array([0, 4, 8], np.int32)  # 1 + 2 bytes
    mip = np.full(3, -7, np.int32)
    t = kvcache._lib.make_tensor
    cases = [
        (m.ctypes.data, t(qo), t(kv), out.ctypes.data, 2, t(mip)),
        (None, t(qo), t(kv), out.ctypes.data, 8, t(mip)),
        (m.ctypes.data, t(qo.astype(np.int64)), t(kv), out.ctypes.data, 8, t(mip)),
        (m.ctypes.data, t(np.array([0, 5, 2], np.int32)), t(kv), out.ctypes.data, 8, t(mip)),
    ]
    for args in cases:
        with pytest.raises(kvcache.InvalidArgumentError):
            kvcache._lib.check(kmask.kvc_build_packed_custom_mask(*args))
    assert (out == 0x5A).all() and (mip == -7).all()
    kvcache._lib.check(kmask.kvc_build_packed_custom_mask(m.ctypes.data, t(qo), t(kv),
                                                          out.ctypes.data, 3, t(mip)))
    assert mip.tolist() == [0, 1, 3] and out[:3].tolist() == [0xFF, 0xFF, 0x0F]
    assert (out[3:] == 0x5A).all()
