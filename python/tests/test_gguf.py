"""GGUF: our writer (kvcache.gguf_writer) and C reader (kvcache.GGUFFile)
checked against the independent ``gguf`` package (llama.cpp's gguf-py).

* Files written by gguf_writer are read by gguf.GGUFReader with the same
  metadata (values and types), tensor names, shapes, types and bytes; its
  dequantizer (gguf.quants.dequantize) equals ours bit for bit, and its
  quantizer produces the same blocks as ours.
* The C reader (through ctypes) reads the same files identically.
* write_tiny_llama writes the tensors and metadata a llama GGUF has, with
  shapes in the layout of the real model.
* The real model (models/SmolLM2-135M-Instruct.Q4_1.gguf) opens in the C
  reader and matches the gguf package's metadata and tensor table.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import kvcache
import numpy as np
import pytest
from kvcache import gguf_writer as W
from kvcache.gguf import GGUFFile, ggml_block_bytes, ggml_block_size, ggml_type_name

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install gguf) is not installed")
from gguf.constants import GGMLQuantizationType as QT
from gguf.constants import GGUFValueType as GVT

V = W.ValueType
REPO = Path(__file__).resolve().parents[2]
REAL_MODEL = Path(os.environ.get("KVC_GGUF_MODEL",
                                 REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
WRITER_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


# ---------------------------------------------------------------------------
# helpers


def reader_value(field):
    """A field of gguf.GGUFReader as a plain Python value comparable with ours."""
    types = [GVT(t) for t in field.types]
    if types[0] == GVT.ARRAY:
        if len(types) == 1:  # gguf-py records no element type for an empty array
            return np.array([])
        if types[1] == GVT.ARRAY:
            return None  # we do not expose nested arrays
        if types[1] == GVT.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return np.array([field.parts[i][0] for i in field.data])
    if types[0] == GVT.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    v = field.parts[field.data[0]][0]
    if types[0] == GVT.BOOL:
        return bool(v)
    if types[0] in (GVT.FLOAT32, GVT.FLOAT64):
        return float(v)
    return int(v)


def reader_kv(path):
    r = gguf.GGUFReader(str(path))
    kv = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return r, kv


def assert_same_value(ours, theirs, key):
    if isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), key
        np.testing.assert_array_equal(ours, theirs, err_msg=key)
    else:
        assert ours == theirs, key
        assert type(ours) is type(theirs), key


def all_types_writer(version=3, alignment=None):
    w = W.GGUFWriter(version=version, alignment=alignment)
    w.add("general.architecture", "llama")
    w.add("v.u8", 200, V.UINT8)
    w.add("v.i8", -100, V.INT8)
    w.add("v.u16", 60000, V.UINT16)
    w.add("v.i16", -30000, V.INT16)
    w.add("v.u32", 4000000000, V.UINT32)
    w.add("v.i32", -2000000000, V.INT32)
    w.add("v.f32", 1.5, V.FLOAT32)
    w.add("v.bool_t", True, V.BOOL)
    w.add("v.bool_f", False, V.BOOL)
    w.add("v.u64", 2**63 - 1, V.UINT64)
    w.add("v.u64_max", 2**64 - 1, V.UINT64)  # above int64 and a double's 53 bits
    w.add("v.u64_odd", 2**63 + 1001, V.UINT64)
    w.add("v.i64", -(2**40), V.INT64)
    w.add("v.f64", -2.25, V.FLOAT64)
    w.add("v.str", "héllo wörld ✓")
    w.add("v.str_empty", "")
    for name, code, vals in [
        ("u8", V.UINT8, [0, 255]), ("i8", V.INT8, [-128, 127]), ("u16", V.UINT16, [1, 65535]),
        ("i16", V.INT16, [-5, 5]), ("u32", V.UINT32, [7, 2**32 - 1]), ("i32", V.INT32, [-1, 2]),
        ("f32", V.FLOAT32, [0.5, -1e30]), ("bool", V.BOOL, [True, False, True]),
        ("u64", V.UINT64, [2**64 - 1, 3]), ("i64", V.INT64, [-(2**63), 1]),
        ("f64", V.FLOAT64, [1e300, -0.0]),
    ]:
        w.add_array("arr." + name, vals, code)
    w.add_array("arr.str", ["a", "", "Ġthe", "<|im_end|>", "ünï"], V.STRING)
    w.add_array("arr.empty", [], V.INT32)
    w.add_array("arr.nested", [[1, 2], ["x", "y"]], V.ARRAY)
    return w


def add_tensors(w, rng):
    """Tensors of every writer type and several ranks; returns name -> (type, array)."""
    shapes = {"F32": (3, 5), "F16": (7,), "BF16": (2, 2, 3), "Q8_0": (4, 64),
              "Q4_0": (2, 1, 32), "Q4_1": (1, 1, 3, 96), "Q5_0": (3, 64), "Q5_1": (2, 1, 96)}
    out = {}
    for t in WRITER_TYPES:
        x = (rng.standard_normal(shapes[t]) * 3).astype(np.float32)
        name = f"tensor.{t.lower()}"
        w.add_tensor(name, x, t)
        out[name] = (t, x)
    return out


# ---------------------------------------------------------------------------
# quantizers vs the gguf package


@pytest.mark.parametrize("t", WRITER_TYPES)
def test_quantizers_match_gguf_package(t, rng):
    x = (rng.standard_normal((16, 128)) * rng.uniform(0.01, 10, (16, 1))).astype(np.float32)
    x[0, :32] = 0.0  # zero block: scale 0
    x[1, :32] = 2.5  # constant block
    x[2, 5] = -40.0  # outlier
    x[3, :32] = np.linspace(-1, 1, 32)  # exact ties for the rounding
    ours = W.quantize(x, t)
    theirs = gguf.quants.quantize(x, QT[t])
    assert ours == theirs.tobytes()
    deq = W.dequantize(ours, t, x.shape)
    ref = gguf.quants.dequantize(np.frombuffer(ours, np.uint8).reshape(16, -1), QT[t])
    np.testing.assert_array_equal(deq, ref.reshape(x.shape))
    bs, bb = gguf.constants.GGML_QUANT_SIZES[QT[t]]
    assert len(ours) == x.size // bs * bb


@pytest.mark.parametrize("t", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantization_error_bounds(t, rng):
    x = rng.standard_normal((8, 256)).astype(np.float32)
    deq = W.dequantize(W.quantize(x, t), t, x.shape).reshape(-1, 32)
    b = x.reshape(-1, 32)
    if t == "Q8_0":
        step = np.abs(b).max(1) / 127
    elif t in ("Q4_0", "Q5_0"):
        step = np.abs(b).max(1) / (8 if t == "Q4_0" else 16)
    else:
        step = (b.max(1) - b.min(1)) / (15 if t == "Q4_1" else 31)
    # half a step, plus slack for the float16 scale (and min for Q4_1, Q5_1);
    # Q4_0's codes span [-8, 7] (Q5_0's [-16, 15]): the side opposite the
    # largest magnitude clips by up to one step.
    half = 1.0 if t in ("Q4_0", "Q5_0") else 0.5
    err = np.abs(deq - b).max(1)
    assert np.all(err <= half * step * 1.01 + 2e-3 * np.abs(b).max(1)), (err / step).max()


def test_iq4_nl_writer_decodes_as_the_gguf_package(rng):
    """The writer's IQ4_NL (the package has no quantizer for it): bytes that
    the package decodes bitwise as we do, each element within 14 of the
    block's 127 steps (the largest magnitude maps to -127; the other side
    ends at 113: half the widest gap, 24, is less)."""
    x = (rng.standard_normal((8, 128)) * rng.uniform(0.01, 10, (8, 1))).astype(np.float32)
    x[0, :32] = 0.0
    raw = W.quantize(x, "IQ4_NL")
    assert len(raw) == x.size // 32 * 18
    ours = W.dequantize(raw, "IQ4_NL", x.shape)
    ref = gguf.quants.dequantize(np.frombuffer(raw, np.uint8).reshape(8, -1), QT.IQ4_NL)
    np.testing.assert_array_equal(ours, ref.reshape(x.shape))
    assert not ours[0, :32].any()
    b, deq = x.reshape(-1, 32), ours.reshape(-1, 32)
    step = np.abs(b).max(1) / 127
    assert np.all(np.abs(deq - b).max(1) <= 14 * step * 1.01 + 2e-3 * np.abs(b).max(1))


def test_q4_nibble_order_and_formulas():
    x = np.arange(32, dtype=np.float32) - 8  # -8..23
    raw = np.frombuffer(W.quantize(x, "Q4_0"), np.uint8)
    d = np.frombuffer(raw[:2].tobytes(), "<f2")[0]
    assert d == np.float16(23 / -8)  # element of largest magnitude, sign kept, / -8
    # element j < 16 in the low nibble of byte j, element j + 16 in its high nibble
    q = np.concatenate([raw[2:] & 15, raw[2:] >> 4])
    np.testing.assert_array_equal(q, np.minimum(15, np.trunc(x / np.float32(23 / -8) + 8.5)))
    raw1 = np.frombuffer(W.quantize(x, "Q4_1"), np.uint8)
    d1, m1 = np.frombuffer(raw1[:4].tobytes(), "<f2")
    assert (d1, m1) == (np.float16(31 / 15), np.float16(-8))


# ---------------------------------------------------------------------------
# writer -> gguf package and C reader


@pytest.mark.parametrize("version,alignment", [(3, None), (2, None), (3, 64), (2, 8), (3, 1)])
def test_writer_read_by_gguf_package_and_c_reader(tmp_path, rng, version, alignment):
    w = all_types_writer(version, alignment)
    tensors = add_tensors(w, rng)
    path = w.write(tmp_path / "t.gguf")
    r, kv = reader_kv(path)
    assert int(r.fields["GGUF.version"].parts[-1][0]) == version
    with GGUFFile(path) as f:
        assert f.version == version
        assert f.alignment == (alignment or 32)
        # metadata: same keys in the same order, same types and values
        assert f.keys() == list(kv)
        for key, field in kv.items():
            t, et, n = f.kv_type(key)
            assert t == field.types[0], key
            if t == V.ARRAY and n:
                assert et == field.types[1], key
                if et != V.ARRAY:  # gguf-py flattens nested arrays
                    assert n == len(field.data), key
            theirs = reader_value(field)
            assert_same_value(f.metadata[key], theirs, key)
        assert f.metadata["v.str"] == "héllo wörld ✓"
        assert f.metadata["v.u64"] == 2**63 - 1
        assert f.metadata["v.u64_max"] == 2**64 - 1
        assert f.metadata["v.u64_odd"] == 2**63 + 1001
        assert f.metadata["arr.u64"].tolist() == [2**64 - 1, 3]
        assert f.metadata["arr.str"] == ["a", "", "Ġthe", "<|im_end|>", "ünï"]
        assert f.metadata["arr.nested"] is None
        # tensors: names, types, shapes, bytes and data offsets
        assert [t.name for t in f.tensors] == [t.name for t in r.tensors]
        base_c = f.tensors[0].data_ptr - int(r.tensors[0].data_offset)
        for ct, rt in zip(f.tensors, r.tensors, strict=True):
            assert ct.type == int(rt.tensor_type)
            assert list(ct.ne) == [int(s) for s in rt.shape]
            assert ct.size == int(rt.n_bytes)
            assert ct.data_ptr - base_c == int(rt.data_offset)
            assert (ct.data_ptr - base_c) % f.alignment == 0
            raw = ct.raw()
            assert raw == rt.data.tobytes()
            t, x = tensors[ct.name]
            assert ct.type_name == t
            ours = W.dequantize(raw, t, ct.shape)
            theirs = gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(ct.shape)
            np.testing.assert_array_equal(ours, theirs)
            assert ours.shape == x.shape


def test_c_reader_from_bytes(rng):
    w = all_types_writer()
    add_tensors(w, rng)
    data = w.tobytes()
    f = GGUFFile(data)
    assert f.metadata["v.i8"] == -100
    assert f.metadata["v.bool_t"] is True
    assert f.tensor("tensor.q4_1").ne == (96, 3, 1, 1)
    assert f.tensor("tensor.q4_1").shape == (1, 1, 3, 96)
    with pytest.raises(KeyError):
        f.tensor("nope")
    with pytest.raises(KeyError):
        f.get("nope")
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.keys()


def test_c_reader_errors(tmp_path, rng):
    w = all_types_writer()
    add_tensors(w, rng)  # the last tensor ends at the end of the file
    data = bytearray(w.tobytes())
    with pytest.raises(kvcache.CorruptError, match="bad magic"):
        GGUFFile(b"GGUX" + bytes(data[4:]))
    with pytest.raises(kvcache.UnsupportedError, match="version 1 is not supported"):
        GGUFFile(b"GGUF" + struct.pack("<I", 1) + bytes(data[8:]))
    with pytest.raises(kvcache.CorruptError, match="extends past the end of the file"):
        GGUFFile(bytes(data[:-3]))
    with pytest.raises(kvcache.CorruptError, match="truncated: value type needs 4 bytes"):
        # one key-value pair, no tensors, cut inside the first key's type
        GGUFFile(bytes(data[:8]) + struct.pack("<QQ", 0, 1) + bytes(data[24:24 + 8 + 20 + 2]))
    with pytest.raises(kvcache.CorruptError, match="the header claims 4611686018427387904"):
        GGUFFile(bytes(data[:16]) + struct.pack("<Q", 2**62) + bytes(data[24:]))
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(data[:40]))
    with pytest.raises(kvcache.CorruptError, match="bad.gguf: GGUF: "):
        GGUFFile(p)
    with pytest.raises(kvcache.KvcacheIOError, match="cannot open"):
        GGUFFile(tmp_path / "missing.gguf")


def test_keys_that_are_not_utf8_round_trip():
    """The C reader takes any key bytes; the binding keeps them apart and can
    look them up again (invalid bytes as lone surrogates), instead of merging
    keys that differ only there or failing with KeyError."""
    def kv(key, value):
        return struct.pack("<Q", len(key)) + key + struct.pack("<IB", 0, value)
    keys = [b"general.n\xffme", b"general.n\xfeme", b"general.name"]
    img = b"GGUF" + struct.pack("<IQQ", 3, 0, len(keys)) + b"".join(
        kv(k, i + 5) for i, k in enumerate(keys))
    g = GGUFFile(img)
    assert [k.encode("utf-8", "surrogateescape") for k in g.keys()] == keys
    assert list(g.metadata.values()) == [5, 6, 7]
    assert g.get(g.keys()[1]) == 6 and g.get("general.name") == 7


def test_type_table_matches_gguf_package():
    # every type the package knows (the IQ, TQ and FP4 ones too: named and
    # sized, so a file holding them opens)
    types = [int(t) for t in QT if int(t) != 9]
    assert {16, 20, 23, 29, 34, 39} <= set(types)
    for t in types:
        bs, bb = gguf.constants.GGML_QUANT_SIZES[QT(t)]
        assert (ggml_block_size(t), ggml_block_bytes(t)) == (bs, bb), t
        assert ggml_type_name(t) == QT(t).name
    # Q8_1: ggml's block_q8_1 is {f16 d, f16 s, int8 qs[32]} = 36 bytes; gguf-py
    # still lists the old {f32, f32} layout (40). It never appears in model files.
    assert (ggml_block_size(9), ggml_block_bytes(9)) == (32, 36)
    assert ggml_type_name(4) is None and ggml_block_size(4) == 0
    assert ggml_type_name(31) is None and ggml_block_bytes(43) == 0  # removed; past the last


# ---------------------------------------------------------------------------
# tiny llama


LLAMA_KEYS = [
    "general.architecture", "llama.block_count", "llama.context_length",
    "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
    "llama.attention.head_count_kv", "llama.rope.freq_base",
    "llama.attention.layer_norm_rms_epsilon", "llama.rope.dimension_count", "llama.vocab_size",
    "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.chat_template",
]


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama(tmp_path, tied):
    m = W.write_tiny_llama(tmp_path / "tiny.gguf", tied_output=tied, seed=3)
    cfg = m.config
    r, kv = reader_kv(m.path)
    for key in LLAMA_KEYS:
        assert key in kv, key
    with GGUFFile(m.path) as f:
        md = f.metadata
        assert md["general.architecture"] == "llama"
        assert md["llama.block_count"] == 2
        assert md["llama.embedding_length"] == 64
        assert md["llama.attention.head_count"] == 4
        assert md["llama.attention.head_count_kv"] == 2  # GQA
        assert md["llama.rope.dimension_count"] == 16
        assert md["llama.vocab_size"] == len(m.tokens) == cfg["n_vocab"]
        assert md["tokenizer.ggml.model"] == "gpt2"
        assert md["tokenizer.ggml.tokens"] == m.tokens
        assert md["tokenizer.ggml.merges"] == m.merges
        assert md["tokenizer.ggml.token_type"].tolist() == m.token_types
        assert md["tokenizer.ggml.bos_token_id"] == 1 and m.tokens[1] == "<|im_start|>"
        assert md["tokenizer.ggml.eos_token_id"] == 2 and m.tokens[2] == "<|im_end|>"
        assert "<|im_start|>" in md["tokenizer.chat_template"]
        # every byte token in GPT-2 form; every merge's parts and result in the vocab
        b2u = W.gpt2_byte_to_unicode()
        assert len(set(b2u.values())) == 256
        assert b2u[ord(" ")] == "Ġ" and b2u[ord("\n")] == "Ċ"
        vocab = set(m.tokens)
        assert all(b2u[b] in vocab for b in range(256))
        for merge in m.merges:
            a, b = merge.split(" ")
            assert a in vocab and b in vocab and a + b in vocab, merge
        # tensors: shapes as llama.cpp writes them (ne[0] = input dim)
        e, hd, ff, nv = 64, 16, 128, cfg["n_vocab"]
        want = {"token_embd.weight": (e, nv), "output_norm.weight": (e,)}
        for i in range(2):
            want.update({
                f"blk.{i}.attn_norm.weight": (e,), f"blk.{i}.attn_q.weight": (e, 4 * hd),
                f"blk.{i}.attn_k.weight": (e, 2 * hd), f"blk.{i}.attn_v.weight": (e, 2 * hd),
                f"blk.{i}.attn_output.weight": (4 * hd, e), f"blk.{i}.ffn_norm.weight": (e,),
                f"blk.{i}.ffn_gate.weight": (e, ff), f"blk.{i}.ffn_up.weight": (e, ff),
                f"blk.{i}.ffn_down.weight": (ff, e),
            })
        if not tied:
            want["output.weight"] = (e, nv)
        assert {t.name: t.ne for t in f.tensors} == want
        assert {t.name for t in r.tensors} == set(want)
        types = {t.type_name for t in f.tensors}
        assert len(types) >= 5, types  # mixed weight types in one model
        assert all(f.tensor(n).type_name == "F32" for n in want if "norm" in n)
        # the returned weights are what a reader dequantizes
        for t in f.tensors:
            ours = W.dequantize(t.raw(), t.type, t.shape)
            np.testing.assert_array_equal(ours, m.weights[t.name])
            assert m.types[t.name] == t.type_name


def test_tiny_llama_options(tmp_path):
    m = W.write_tiny_llama(tmp_path / "a.gguf", weight_types="Q8_0", n_vocab=400, n_layer=1,
                           n_head=2, n_head_kv=1, version=2)
    with GGUFFile(m.path) as f:
        assert f.version == 2
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 400
        assert f.metadata["tokenizer.ggml.tokens"][-1] == "<|extra_44|>"
        assert f.metadata["tokenizer.ggml.token_type"][-1] == 4
        assert {t.type_name for t in f.tensors} == {"F32", "Q8_0"}
        assert f.tensor("token_embd.weight").ne == (64, 400)
    small = W.write_tiny_llama(tmp_path / "s.gguf", n_vocab=300)
    assert len(small.tokens) == 300 and len(small.merges) == 300 - 259
    m2 = W.write_tiny_llama(tmp_path / "b.gguf", weight_types={"blk.0.attn_q": "F16"})
    assert m2.types["blk.0.attn_q.weight"] == "F16"
    assert m2.types["blk.1.attn_q.weight"] == W.DEFAULT_WEIGHT_TYPES["attn_q"]
    # deterministic for a seed
    m3 = W.write_tiny_llama(tmp_path / "c.gguf", weight_types={"blk.0.attn_q": "F16"})
    assert m3.path.read_bytes() == m2.path.read_bytes()


def test_fuzz_seeds_are_valid():
    seeds = sorted((REPO / "tests" / "fuzz_corpus" / "gguf").glob("*.gguf"))
    assert seeds
    for p in seeds:
        with GGUFFile(p) as f:
            gguf.GGUFReader(str(p))  # the independent reader accepts them too
            assert f.version in (2, 3)


# ---------------------------------------------------------------------------
# the real model


@pytest.fixture(scope="module")
def real_model():
    if not REAL_MODEL.exists():
        pytest.skip(f"the default model is absent ({REAL_MODEL}): run scripts/fetch_model.sh")
    return REAL_MODEL


def test_real_model_matches_gguf_package(real_model):
    r, kv = reader_kv(real_model)
    with GGUFFile(real_model) as f:
        assert f.version == 3
        assert f.keys() == list(kv)
        for key, field in kv.items():
            assert f.kv_type(key)[0] == field.types[0], key
            assert_same_value(f.metadata[key], reader_value(field), key)
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
        assert len(f.tensors) == len(r.tensors) == 272
        base_c = f.tensors[0].data_ptr - int(r.tensors[0].data_offset)
        for ct, rt in zip(f.tensors, r.tensors, strict=True):
            assert ct.name == rt.name
            assert ct.type == int(rt.tensor_type)
            assert list(ct.ne) == [int(s) for s in rt.shape]
            assert ct.size == int(rt.n_bytes)
            assert ct.data_ptr - base_c == int(rt.data_offset)
        # spot-check data: a norm vector and a Q4_1 matrix, dequantized both ways
        for name in ["output_norm.weight", "blk.0.attn_k.weight"]:
            ct = f.tensor(name)
            rt = next(t for t in r.tensors if t.name == name)
            assert ct.raw() == rt.data.tobytes()
            theirs = gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(ct.shape)
            np.testing.assert_array_equal(W.dequantize(ct.raw(), ct.type, ct.shape), theirs)
