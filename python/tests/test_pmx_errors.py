"""Every invalid input of SEMANTICS 2/3 raises InvalidArgumentError with a
message naming the problem, and leaves cache and scale bytes unchanged."""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvcache
import kvc_reference as ref
from kvc_reference import BF16, F16, F32, assert_same_bytes
from pmx_cases import Storage

H, DH, L = 2, 16, 2


def _storage(bits):
    return Storage(F32, {0: F16, 8: np.int8, 4: "int4"}[bits], bits, F16, 8)


def expect_rejected(fn, args, match):
    """Calls fn(**args); expects InvalidArgumentError whose message matches
    `match` (case-insensitive regex) and unchanged cache/scale bytes."""
    cache, scale = args.get("cache"), args.get("scale")
    before_c = cache.copy() if isinstance(cache, np.ndarray) else None
    before_s = scale.copy() if isinstance(scale, np.ndarray) else None
    with pytest.raises(kvcache.InvalidArgumentError) as ei:
        fn(**args)
    msg = str(ei.value)
    assert ei.value.status == -2
    assert msg.strip() and msg != "invalid argument", "no detail message"
    assert re.search(match, msg, re.IGNORECASE), f"message {msg!r} does not match {match!r}"
    if before_c is not None:
        assert_same_bytes(cache, before_c, "cache after a rejected call")
    if before_s is not None:
        assert_same_bytes(scale, before_s, "scale after a rejected call")
    return msg


# ---------------------------------------------------------------------------
# static


def static_args(rng, bits, layout=0):
    """A valid call: B=2 of MaxB=2, S=3 at start_pos 1 of MaxS=6, layer 1 of 2."""
    st = _storage(bits)
    shape = ref.static_cache_shape(layout, 2, L, 6, H, DH)
    cache, scale = st.make(rng, shape, DH)
    return dict(current_key=ref.random_input(rng, (2, 3, H, DH), F32),
                current_value=ref.random_input(rng, (2, 3, H, DH), F32),
                start_pos=1, cache=cache, scale=scale, num_layer=L, layer_idx=1,
                quant_bit=bits, quant_group=8, cache_layout=layout)


def _inputs(a, shape, dtype=F32, which=("current_key", "current_value")):
    for w in which:
        a[w] = np.ones(shape, dtype)


def _cache_like(a, dtype=None, last=None, lead=None):
    c = a["cache"]
    shape = (lead or c.shape[:-1]) + (last or c.shape[-1],)
    a["cache"] = np.zeros(shape, dtype or c.dtype)


def _scale_like(a, dtype=None, last=None, lead=None):
    s = a["scale"]
    shape = (lead or s.shape[:-1]) + (last or s.shape[-1],)
    a["scale"] = np.ones(shape, dtype or s.dtype)


def _poison(a, which, index, value):
    x = a[which].copy()
    x[index] = value
    a[which] = x


ANY_BITS = (0, 8, 4)
QUANT = (8, 4)

# (id, bits it applies to, mutation, message regex)
STATIC_CASES = [
    ("B>MaxB", ANY_BITS, lambda a: _inputs(a, (3, 3, H, DH)), r"batch|MaxB"),
    ("start_pos<0", ANY_BITS, lambda a: a.update(start_pos=-1), r"start_pos"),
    ("start_pos<<0", ANY_BITS, lambda a: a.update(start_pos=-(2**40)), r"start_pos"),
    ("start_pos+S>MaxS", ANY_BITS, lambda a: a.update(start_pos=4), r"start_pos|MaxS"),
    ("start_pos>MaxS,S=0", ANY_BITS,
     lambda a: (_inputs(a, (2, 0, H, DH)), a.update(start_pos=7)), r"start_pos|MaxS"),
    ("start_pos huge", ANY_BITS, lambda a: a.update(start_pos=2**40), r"start_pos"),
    ("layer_idx>=num_layer", ANY_BITS, lambda a: a.update(layer_idx=2), r"layer_idx"),
    ("layer_idx<0", ANY_BITS, lambda a: a.update(layer_idx=-1), r"layer_idx"),
    ("num_layer!=cache", ANY_BITS, lambda a: a.update(num_layer=3, layer_idx=0),
     r"num_layer|L=|cache"),
    ("num_layer=0", ANY_BITS, lambda a: a.update(num_layer=0, layer_idx=0), r"num_layer|layer"),
    ("value S mismatch", ANY_BITS,
     lambda a: _inputs(a, (2, 2, H, DH), which=("current_value",)), r"current_value|shape"),
    ("value dtype mismatch", ANY_BITS,
     lambda a: _inputs(a, (2, 3, H, DH), F16, which=("current_value",)),
     r"current_value|dtype"),
    ("key ndim 3", ANY_BITS, lambda a: _inputs(a, (2, 3, H * DH)), r"current_key"),
    ("H!=cache", ANY_BITS, lambda a: _inputs(a, (2, 3, 1, DH)), r"cache|H"),
    ("Dh!=cache", ANY_BITS, lambda a: _inputs(a, (2, 3, H, 8)), r"cache|Dh|head"),
    ("cache ndim 5", ANY_BITS, lambda a: a.update(cache=a["cache"][0]), r"cache"),
    ("cache 2-axis 3", ANY_BITS,
     lambda a: _cache_like(a, lead=a["cache"].shape[:2] + (3,) + a["cache"].shape[3:-1]),
     r"cache"),
    ("float cache with quant 8", (8,), lambda a: _cache_like(a, F32, DH),
     r"cache|dtype"),
    ("int8 cache with quant 4", (4,), lambda a: _cache_like(a, np.int8), r"cache|dtype|int"),
    ("int4 cache with full Dh bytes", (4,), lambda a: _cache_like(a, last=DH), r"cache|Dh"),
    ("float cache with quant 4", (4,), lambda a: _cache_like(a, F16, DH), r"cache|dtype"),
    ("int8 input with quant 8", (8,), lambda a: _inputs(a, (2, 3, H, DH), np.int8),
     r"int8|dtype|current_key"),
    ("int8 input into float cache", (0,), lambda a: _inputs(a, (2, 3, H, DH), np.int8),
     r"int8|dtype|cache"),
    ("float input into int8 cache, quant 0", (0,), lambda a: _cache_like(a, np.int8),
     r"int8|dtype|cache"),
    ("missing scale", QUANT, lambda a: a.update(scale=None), r"scale"),
    ("scale bf16", QUANT, lambda a: _scale_like(a, BF16), r"scale"),
    ("scale int8", QUANT, lambda a: _scale_like(a, np.int8), r"scale"),
    ("scale last dim", QUANT, lambda a: _scale_like(a, last=4), r"scale"),
    ("scale lead dims", QUANT,
     lambda a: _scale_like(a, lead=(1,) + a["scale"].shape[1:-1]), r"scale"),
    ("quant_bit 5", ANY_BITS, lambda a: a.update(quant_bit=5), r"quant_bit"),
    ("quant_bit -8", ANY_BITS, lambda a: a.update(quant_bit=-8), r"quant_bit"),
    ("quant_group 3", QUANT, lambda a: a.update(quant_group=3), r"quant_group"),
    ("quant_group 0", QUANT, lambda a: a.update(quant_group=0), r"quant_group"),
    ("quant_group 32>Dh", QUANT, lambda a: a.update(quant_group=32), r"quant_group"),
    ("odd quant_group int4", (4,),
     lambda a: (a.update(quant_group=1), _scale_like(a, last=DH)), r"quant_group|even"),
    ("cache_layout 2", ANY_BITS, lambda a: a.update(cache_layout=2), r"layout"),
    ("cache_layout -1", ANY_BITS, lambda a: a.update(cache_layout=-1), r"layout"),
    ("num_repeat 0", ANY_BITS, lambda a: a.update(num_repeat=0), r"num_repeat|repeat"),
    ("num_repeat -2", ANY_BITS, lambda a: a.update(num_repeat=-2), r"num_repeat|repeat"),
    ("NaN key", QUANT, lambda a: _poison(a, "current_key", (0, 0, 0, 0), np.nan),
     r"NaN|Inf|finite"),
    ("float16 scale overflow", QUANT,
     lambda a: _poison(a, "current_key", (1, 0, 1, 9), 1e7), r"float16 scale"),
    ("Inf value last", QUANT, lambda a: _poison(a, "current_value", (1, 2, 1, 15), np.inf),
     r"NaN|Inf|finite"),
    ("-Inf key last", QUANT, lambda a: _poison(a, "current_key", (1, 2, 1, 15), -np.inf),
     r"NaN|Inf|finite"),
    ("start_pos float", ANY_BITS, lambda a: a.update(start_pos=1.5), r"start_pos"),
    ("start_pos 2 values", ANY_BITS, lambda a: a.update(start_pos=[1, 1]), r"start_pos"),
    ("input float64", ANY_BITS,
     lambda a: a.update(current_key=a["current_key"].astype(np.float64)), r"current_key"),
    ("cache read-only", ANY_BITS,
     lambda a: (a.update(cache=a["cache"].copy()), a["cache"].setflags(write=False)),
     r"writeable"),
    ("cache strided last dim", ANY_BITS,
     lambda a: a.update(cache=np.repeat(a["cache"], 2, axis=-1)[..., ::2]), r"contiguous"),
    ("cache is a list", (0,), lambda a: a.update(cache=a["cache"].tolist()), r"numpy"),
    ("scale strided last dim", QUANT,
     lambda a: a.update(scale=np.repeat(a["scale"], 2, axis=-1)[..., ::2]), r"contiguous"),
    ("attribute beyond int32", ANY_BITS, lambda a: a.update(num_layer=2**31), r"num_layer"),
]


def _static_params():
    for cid, bits_list, mutate, match in STATIC_CASES:
        for bits in bits_list:
            for layout in (0, 1):
                yield pytest.param(bits, layout, mutate, match, id=f"{cid}-q{bits}-l{layout}")


def test_static_base_is_valid(rng):
    for bits in ANY_BITS:
        for layout in (0, 1):
            a = static_args(rng, bits, layout)
            k, _ = kvcache.pmx.key_value_cache(**a)
            assert k.shape == (2, 4, H, DH)


@pytest.mark.parametrize("bits,layout,mutate,match", list(_static_params()))
def test_static_rejects(rng, bits, layout, mutate, match):
    a = static_args(rng, bits, layout)
    mutate(a)
    expect_rejected(kvcache.pmx.key_value_cache, a, match)


# ---------------------------------------------------------------------------
# dynamic

MAX_T, PAGE = 32, 4


def dynamic_args(rng, bits, mode, layout=0):
    """A valid call: B=3 with S = [2, 0, 3], start_pos = [1, 3, 2] (kvlen
    3, 3, 5); offsets 0/10/20 (mode 0) or pages of 4 (mode 1, -1 padded)."""
    st = _storage(bits)
    cache, scale = st.make(rng, ref.dynamic_cache_shape(layout, MAX_T, L, H, DH), DH)
    if mode == 0:
        cachestarts = np.array([0, 10, 20], np.int64)
    else:
        cachestarts = np.array([[0, -1, -1], [8, -1, -1], [16, 24, -1]], np.int64)
    return dict(current_key=ref.random_input(rng, (5, H, DH), F32),
                current_value=ref.random_input(rng, (5, H, DH), F32),
                seqstarts=np.array([0, 2, 2, 5], np.int64),
                kvstarts=np.array([0, 3, 6, 11], np.int64),
                cachestarts=cachestarts, start_pos=np.array([1, 3, 2], np.int64),
                max_seqlen=3, max_kvlen=5, cache=cache, scale=scale, num_layer=L, layer_idx=1,
                quant_bit=bits, quant_group=8, cache_mode=mode, cache_layout=layout,
                page_size=PAGE)


def _set(**kw):
    def mutate(a):
        for k, v in kw.items():
            a[k] = np.array(v, np.int64) if isinstance(v, list) else v
    return mutate


def _rows(n):
    return lambda a: _inputs(a, (n, H, DH))


def _cst(mode0, mode1):
    def mutate(a):
        a["cachestarts"] = np.array(mode0 if a["cache_mode"] == 0 else mode1, np.int64)
    return mutate


MODES = (0, 1)
DYNAMIC_CASES = [
    # (id, bits, modes, mutation, message regex)
    ("kvlen != p+S", ANY_BITS, MODES, _set(kvstarts=[0, 3, 7, 12]), r"kvstarts|kvlen|start_pos"),
    ("start_pos<0", ANY_BITS, MODES, _set(start_pos=[-1, 3, 2], kvstarts=[0, 1, 4, 9]),
     r"start_pos|negative"),
    ("seqstarts non-monotonic", ANY_BITS, MODES,
     _set(seqstarts=[0, 3, 2, 5], kvstarts=[0, 4, 6, 11]), r"seqstarts"),
    ("kvstarts non-monotonic", ANY_BITS, MODES,
     _set(kvstarts=[0, 3, 2, 7], start_pos=[1, -1, 2]), r"kvstarts|start_pos"),
    ("seqstarts[0]!=0", ANY_BITS, MODES,
     lambda a: (_set(seqstarts=[1, 3, 3, 6])(a), _rows(6)(a)), r"seqstarts"),
    ("kvstarts[0]!=0", ANY_BITS, MODES, _set(kvstarts=[1, 4, 7, 12]), r"kvstarts"),
    ("seqstarts[B]!=rows", ANY_BITS, MODES,
     _set(seqstarts=[0, 2, 2, 4], start_pos=[1, 3, 3]), r"seqstarts|current_key|rows"),
    ("seqstarts too long", ANY_BITS, MODES, _set(seqstarts=[0, 2, 2, 5, 5]),  # B from seqstarts
     r"seqstarts|kvstarts|shape"),
    ("kvstarts too short", ANY_BITS, MODES, _set(kvstarts=[0, 3, 6]), r"kvstarts|B"),
    ("start_pos too long", ANY_BITS, MODES, _set(start_pos=[1, 3, 2, 0]), r"start_pos|B"),
    ("seqstarts 2-d", ANY_BITS, MODES, _set(seqstarts=[[0, 2, 2, 5]]), r"seqstarts"),
    ("cachestarts wrong rank", ANY_BITS, MODES, _cst([[0], [10], [20]], [0, 8, 16]),
     r"cachestarts"),
    ("cachestarts wrong B", ANY_BITS, MODES, _cst([0, 10], [[0, -1, -1], [8, -1, -1]]),
     r"cachestarts"),
    ("slot >= MaxT", ANY_BITS, MODES,
     _cst([0, 10, 28], [[0, -1, -1], [8, -1, -1], [16, 32, -1]]), r"MaxT|slot|cachestarts|page"),
    ("slot < 0", ANY_BITS, MODES,
     _cst([0, -1, 20], [[0, -1, -1], [-3, -1, -1], [16, 24, -1]]), r"MaxT|slot|cachestarts|page"),
    ("needed page -1", ANY_BITS, (1,), _cst(None, [[0, -1, -1], [8, -1, -1], [16, -1, -1]]),
     r"page|cachestarts|-1"),
    ("too few pages", ANY_BITS, (1,), _cst(None, [[0], [8], [16]]), r"page|MaxP|cachestarts"),
    ("max_seqlen too small", ANY_BITS, MODES, _set(max_seqlen=2), r"max_seqlen"),
    ("max_kvlen too small", ANY_BITS, MODES, _set(max_kvlen=4), r"max_kvlen"),
    ("max_seqlen 2 values", ANY_BITS, MODES, _set(max_seqlen=[3, 3]), r"max_seqlen"),
    ("kvstarts[B] huge", ANY_BITS, MODES, _set(kvstarts=[0, 3, 6, 10**13]), r"kvstarts"),
    ("cache_mode 2", ANY_BITS, MODES, _set(cache_mode=2), r"cache_mode|mode"),
    ("cache_mode -1", ANY_BITS, MODES, _set(cache_mode=-1), r"cache_mode|mode"),
    ("cache_layout 4", ANY_BITS, MODES, _set(cache_layout=4), r"layout"),
    ("cache_layout -1", ANY_BITS, MODES, _set(cache_layout=-1), r"layout"),
    ("page_size 0", ANY_BITS, MODES, _set(page_size=0), r"page_size"),
    ("page_size -4", ANY_BITS, MODES, _set(page_size=-4), r"page_size"),
    ("num_repeat 0", ANY_BITS, MODES, _set(num_repeat=0), r"num_repeat|repeat"),
    ("layer_idx>=num_layer", ANY_BITS, MODES, _set(layer_idx=2), r"layer_idx"),
    ("num_layer!=cache", ANY_BITS, MODES, _set(num_layer=1, layer_idx=0),
     r"num_layer|L=|cache"),
    ("value rows mismatch", ANY_BITS, MODES,
     lambda a: _inputs(a, (4, H, DH), which=("current_value",)), r"current_value|shape"),
    ("value dtype mismatch", ANY_BITS, MODES,
     lambda a: _inputs(a, (5, H, DH), BF16, which=("current_value",)), r"current_value|dtype"),
    ("key ndim 4", ANY_BITS, MODES, lambda a: _inputs(a, (5, 1, H, DH)), r"current_key"),
    ("H!=cache", ANY_BITS, MODES, lambda a: _inputs(a, (5, 1, DH)), r"cache|H"),
    ("cache ndim 4", ANY_BITS, MODES, lambda a: a.update(cache=a["cache"][0]), r"cache"),
    ("float cache with quant 8", (8,), MODES, lambda a: _cache_like(a, F32), r"cache|dtype"),
    ("missing scale", QUANT, MODES, _set(scale=None), r"scale"),
    ("scale last dim", QUANT, MODES, lambda a: _scale_like(a, last=1), r"scale"),
    ("quant_bit 5", ANY_BITS, MODES, _set(quant_bit=5), r"quant_bit"),
    ("quant_group 3", QUANT, MODES, _set(quant_group=3), r"quant_group"),
    ("odd quant_group int4", (4,), MODES,
     lambda a: (a.update(quant_group=1), _scale_like(a, last=DH)), r"quant_group|even"),
    ("NaN key last row", QUANT, MODES, lambda a: _poison(a, "current_key", (4, 1, 7), np.nan),
     r"NaN|Inf|finite"),
    ("float16 scale overflow", QUANT, MODES,
     lambda a: _poison(a, "current_value", (2, 1, 5), -1e7), r"float16 scale"),
    ("Inf value", QUANT, MODES, lambda a: _poison(a, "current_value", (0, 0, 0), np.inf),
     r"NaN|Inf|finite"),
    ("seqstarts float", ANY_BITS, MODES,
     lambda a: a.update(seqstarts=a["seqstarts"].astype(np.float32)), r"seqstarts"),
    ("cache read-only", ANY_BITS, MODES,
     lambda a: (a.update(cache=a["cache"].copy()), a["cache"].setflags(write=False)),
     r"writeable"),
]


def _dynamic_params():
    for cid, bits_list, modes, mutate, match in DYNAMIC_CASES:
        for bits in bits_list:
            for mode in modes:
                layout = (bits + mode + len(cid)) % 4
                yield pytest.param(bits, mode, layout, mutate, match,
                                   id=f"{cid}-q{bits}-m{mode}-l{layout}")


def test_dynamic_base_is_valid(rng):
    for bits in ANY_BITS:
        for mode in MODES:
            for layout in range(4):
                a = dynamic_args(rng, bits, mode, layout)
                k, _ = kvcache.pmx.dynamic_key_value_cache(**a)
                assert k.shape == (11, H, DH)


@pytest.mark.parametrize("bits,mode,layout,mutate,match", list(_dynamic_params()))
def test_dynamic_rejects(rng, bits, mode, layout, mutate, match):
    a = dynamic_args(rng, bits, mode, layout)
    mutate(a)
    expect_rejected(kvcache.pmx.dynamic_key_value_cache, a, match)


def test_dynamic_page_tail_beyond_maxt_is_fine(rng):
    """Only slots that are read or written must lie in [0, MaxT): a last page
    starting 1 slot before MaxT holding one position is valid."""
    a = dynamic_args(rng, 8, 1, 2)
    a["cachestarts"] = np.array([[0, -1, -1], [8, -1, -1], [16, MAX_T - 1, -1]], np.int64)
    ecache, escale = a["cache"].copy(), a["scale"].copy()
    ek, _ = ref.dynamic_key_value_cache(
        a["current_key"], a["current_value"], a["seqstarts"], a["kvstarts"], a["cachestarts"],
        a["start_pos"], ecache, escale, layer_idx=1, quant_bit=8, cache_mode=1, cache_layout=2,
        page_size=PAGE)
    k, _ = kvcache.pmx.dynamic_key_value_cache(**a)
    assert_same_bytes(k, ek)
    assert_same_bytes(a["cache"], ecache)


@pytest.mark.parametrize("bits", QUANT)
def test_non_finite_rejected_on_every_isa(isa, rng, bits):
    """The finiteness check runs on the selected ISA's kernels."""
    for pos in [(0, 0, 0, 0), (1, 2, 1, 15), (0, 1, 0, 9)]:
        for bad in (np.nan, np.inf, -np.inf):
            a = static_args(rng, bits)
            _poison(a, "current_value", pos, bad)
            expect_rejected(kvcache.pmx.key_value_cache, a, r"NaN|Inf|finite")
    a = dynamic_args(rng, bits, 1, 3)
    _poison(a, "current_key", (3, 0, 3), np.nan)
    expect_rejected(kvcache.pmx.dynamic_key_value_cache, a, r"NaN|Inf|finite")


GARBAGE = [None, "x", 1.5, [[1, 2], [3]], np.zeros((2,) * 9, np.float32), object()]


@pytest.mark.parametrize("bits", [0, 8])
def test_garbage_arguments_raise_invalid_argument(rng, bits):
    """Any argument replaced by garbage gives InvalidArgumentError (never a
    numpy/ctypes error or a crash) and leaves cache and scale unchanged."""
    names = ["current_key", "current_value", "seqstarts", "kvstarts", "cachestarts",
             "start_pos", "max_seqlen", "max_kvlen", "cache", "num_layer", "layer_idx",
             "quant_bit", "quant_group", "num_repeat", "cache_mode", "cache_layout",
             "page_size", "n_threads"] + (["scale"] if bits else [])
    for name in names:
        for junk in GARBAGE:
            if junk is None and name in ("n_threads",):
                continue
            a = dynamic_args(rng, bits, 1, 1)
            keep_c, keep_s = a["cache"], a["scale"]
            a[name] = junk
            before_c = keep_c.copy()
            before_s = None if keep_s is None else keep_s.copy()
            with pytest.raises(kvcache.InvalidArgumentError):
                kvcache.pmx.dynamic_key_value_cache(**a)
            assert_same_bytes(keep_c, before_c, f"cache after {name}={junk!r}")
            if keep_s is not None:
                assert_same_bytes(keep_s, before_s, f"scale after {name}={junk!r}")
    for name in ["current_key", "current_value", "start_pos", "cache", "num_layer",
                 "quant_group", "cache_layout"]:
        for junk in GARBAGE:
            a = static_args(rng, bits)
            a[name] = junk
            with pytest.raises(kvcache.InvalidArgumentError):
                kvcache.pmx.key_value_cache(**a)
