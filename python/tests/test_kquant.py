"""K-quant and IQ4_XS weights (Q2_K .. Q6_K, IQ4_XS) and ggml block decoding.

* kvc_ggml_dequantize (kvcache.gguf.ggml_dequantize) against the `gguf`
  package's gguf.quants.dequantize, bitwise (float32 bit patterns equal), for
  every type it decodes: random bytes with the float16 scale fields set to
  finite values of every magnitude class (normal, subnormal, zero, both
  signs), so every code, 6-bit scale / min and sign path is hit.
* The writer's super-block encoders/decoders (kvcache.gguf_writer) against
  the same package, and their error against the float input.
* Tiny random llamas whose matrices mix Q4_K, Q5_K and Q6_K (as a Q4_K_M
  file does), or Q2_K, Q3_K and IQ4_XS, against the numpy float64 reference
  (llama_reference.py, which dequantizes with the gguf package): same
  tolerance as test_model.py's quantized models (int16 activations: the
  weights' own quantization is the reference's, so only activation rounding
  and float32 sums remain), every ISA, and the cache exactness of seed 001.
  A type the products do not implement (IQ2_XXS, IQ3_S, TQ2_0, IQ1_S) is
  refused at load.
* Real weights: the default model with its ffn_down matrices re-encoded as
  Q4_K, Q2_K, Q3_K or IQ4_XS (measured 3.3e-4, 6.1e-4, 4.0e-4, 2.8e-4 of the
  logit range off the float32 reference, 5e-3 allowed as for the Q4_1 file;
  generated tokens follow the reference's clear choices; Q4_K still answers
  "Paris", the writer's one-pass Q2_K and IQ4_XS do not), and with its
  embedding (tied: also the output matrix, 49,152 x 576) re-encoded as Q5_0
  or Q5_1, the types llama.cpp's Q4_K_M / Q5_K_M files give matrices whose
  input dimension (576 here) is not a multiple of 256, or as IQ4_NL.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import kvcache
from kvcache.gguf import GGUFFile, ggml_dequantize
from kvcache.model import Model

gguf = pytest.importorskip("gguf")
from kvcache import gguf_writer as W  # noqa: E402
from llama_reference import LlamaReference  # noqa: E402
from test_model import _check_exact, _check_logits, _isa  # noqa: E402

# ggml type -> (block elements, block bytes, offsets of float16 fields)
BLOCKS = {
    "Q8_0": (32, 34, (0,)), "Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)),
    "Q5_0": (32, 22, (0,)), "Q5_1": (32, 24, (0, 2)), "IQ4_NL": (32, 18, (0,)),
    "Q2_K": (256, 84, (80, 82)), "Q3_K": (256, 110, (108,)), "Q4_K": (256, 144, (0, 2)),
    "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)), "IQ4_XS": (256, 136, (0,)),
}


def _qtype(name):
    return gguf.GGMLQuantizationType[name]


def _f16_fields(rng, n):
    """n finite float16 values: mostly moderate (1e-4..1), some subnormal,
    zero and large (up to 1e3), both signs."""
    mag = 10.0 ** rng.uniform(-4, 0, n)
    kind = rng.integers(0, 10, n)
    mag = np.where(kind == 0, rng.uniform(0, 6e-5, n), mag)  # subnormal float16
    mag = np.where(kind == 1, 0.0, mag)
    mag = np.where(kind == 2, 10.0 ** rng.uniform(0, 3, n), mag)
    v = (mag * rng.choice([-1.0, 1.0], n)).astype(np.float16)
    assert np.isfinite(v).all()
    return v


def _random_blocks(rng, name, n_blocks):
    bs, bb, f16_at = BLOCKS[name]
    raw = rng.integers(0, 256, size=(n_blocks, bb), dtype=np.uint8)
    for off in f16_at:
        raw[:, off:off + 2] = _f16_fields(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1), n_blocks * bs


def _bitwise_equal(a, b):
    a = np.ascontiguousarray(a, np.float32).reshape(-1)
    b = np.ascontiguousarray(b, np.float32).reshape(-1)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_dequantize_bitwise_equals_gguf(name):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    raw, n = _random_blocks(rng, name, 512)
    ours = ggml_dequantize(raw, int(_qtype(name)))
    ref = gguf.quants.dequantize(raw, _qtype(name))
    assert ours.shape == (n,)
    ref_bits = np.ascontiguousarray(ref, np.float32).reshape(-1).view(np.uint32)
    bad = np.flatnonzero(ours.view(np.uint32) != ref_bits)
    assert bad.size == 0, f"{name}: {bad.size} elements differ, first {bad[0]}: " \
        f"{ours[bad[0]]!r} vs {ref.reshape(-1)[bad[0]]!r}"
    assert np.isfinite(ours).all()


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_dequantize_float_types_bitwise(name):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(1000) * 10.0 ** rng.uniform(-3, 3, 1000)).astype(np.float32)
    if name == "F32":
        raw, ref = x.view(np.uint8), x
    elif name == "F16":
        h = x.astype(np.float16)
        raw, ref = h.view(np.uint8), gguf.quants.dequantize(h.view(np.uint8), _qtype(name))
    else:
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)
        raw = bits.view(np.uint8)
        ref = gguf.quants.dequantize(raw, _qtype(name))
    assert _bitwise_equal(ggml_dequantize(raw, int(_qtype(name))), ref)


def test_dequantize_errors():
    q4k = int(_qtype("Q4_K"))
    with pytest.raises(kvcache.InvalidArgumentError, match="whole"):
        ggml_dequantize(bytes(143), q4k)
    with pytest.raises(kvcache.InvalidArgumentError, match="Q4_K"):
        ggml_dequantize(bytes(144), q4k, 128)  # not a whole block
    with pytest.raises(kvcache.InvalidArgumentError):
        ggml_dequantize(bytes(144), q4k, 512)  # more than the data holds
    with pytest.raises(kvcache.InvalidArgumentError):
        ggml_dequantize(bytes(32), 99)
    with pytest.raises(kvcache.UnsupportedError, match="IQ2_XXS"):  # known by size only
        ggml_dequantize(bytes(66), int(_qtype("IQ2_XXS")))
    with pytest.raises(kvcache.UnsupportedError, match="TQ2_0"):
        ggml_dequantize(bytes(66), int(_qtype("TQ2_0")))
    assert ggml_dequantize(b"", q4k).shape == (0,)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_writer_k_quants_match_gguf(name):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 768)) * np.exp(rng.uniform(-3, 1, (6, 1)))).astype(np.float32)
    x[1, :256] = 0.0  # an all-zero super-block
    x[2, 256:512] = np.abs(x[2, 256:512])  # no negative values (Q4_K/Q5_K min 0)
    code = W.GGMLType.parse(name)
    data = W.quantize(x, code)
    assert len(data) == x.size // 256 * BLOCKS[name][1]
    ours = W.dequantize(data, code, x.shape)
    ref = gguf.quants.dequantize(np.frombuffer(data, np.uint8), _qtype(name)).reshape(x.shape)
    assert _bitwise_equal(ours, ref)
    assert _bitwise_equal(ggml_dequantize(data, code), ref)
    assert not ours[1, :256].any()
    # one pass, no search: the error of a plain 4/5/6-bit grid (plus 6/8-bit
    # scales). The low-bit types, worst over 200 varied inputs / by
    # construction, of max|x|: Q2_K 0.333 / 1/3 (half a 2-bit step over
    # [min(x, 0), max x]); Q3_K 0.271 / 0.273 (the other sign than the
    # sub-block's largest element, which decodes as -4, clips at +3: 1/4, or
    # 1 - 3/4 * 31/32 where the 6-bit scale clips at 31); IQ4_XS 0.137 / 0.137
    # (likewise 127 -> 113: 14/127, or 18/127 * 31/32)
    rel = {"Q2_K": 0.35, "Q3_K": 0.3, "Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.03,
           "IQ4_XS": 0.15}[name]
    for r in range(x.shape[0]):
        assert np.abs(ours[r] - x[r]).max() <= rel * np.abs(x[r]).max() + 1e-30


# -- tiny llamas with mixed super-block matrices ------------------------------------

# weight types by short name: as a Q4_K_M file mixes them, and the low-bit
# types of Q2_K / Q3_K_M / IQ4_XS files (token_embd in Q3_K: its lookup decodes
# rows of the new types too)
KQ_MIXES = {
    "q456": {"token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K",
             "attn_output": "Q4_K", "ffn_gate": "Q5_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K",
             "output": "Q6_K"},
    "q23_iq4xs": {"token_embd": "Q3_K", "attn_q": "Q2_K", "attn_k": "IQ4_XS", "attn_v": "Q3_K",
                  "attn_output": "IQ4_XS", "ffn_gate": "Q2_K", "ffn_up": "IQ4_XS",
                  "ffn_down": "Q3_K", "output": "Q2_K"},
}


@pytest.fixture(scope="module", params=sorted(KQ_MIXES))
def kq_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("kq") / f"tiny_{request.param}.gguf"
    # every matrix's input dimension a multiple of 256 (the super-block)
    W.write_tiny_llama(path, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, seed=11,
                       weight_types=KQ_MIXES[request.param], tied_output=False, attn_gain=2.0)
    m = Model(path)
    yield path, m, LlamaReference(str(path)), KQ_MIXES[request.param]
    m.close()


def test_kq_model_stores_the_k_quant_types(kq_model):
    path, _, _, mix = kq_model
    with GGUFFile(path) as f:
        types = {t.name: t.type_name for t in f.tensors}
    for name in ("blk.1.attn_k", "blk.0.ffn_down", "blk.1.ffn_up", "token_embd", "output"):
        assert types[name + ".weight"] == mix[name.split(".")[-1]]
    assert set(types.values()) == set(mix.values()) | {"F32"}  # F32: the norms


def test_kq_model_logits_match_numpy_reference(kq_model):
    _, m, ref, _ = kq_model
    rng = np.random.default_rng(2)
    toks = rng.integers(0, m.n_vocab, size=29)
    want = ref.logits(toks)
    base = m.eval(toks, kv_dtype="float32", num_threads=2)
    _check_logits(base, want, 1e-3)
    for isa in kvcache.supported_isas():  # every kernel set the host runs
        with _isa(isa):
            _check_logits(m.eval(toks, kv_dtype="float32", num_threads=2), want, 1e-3)


@pytest.mark.parametrize("kq_model", ["q456"], indirect=True)
@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ3_S", "TQ2_0", "IQ1_S"])
def test_model_refuses_a_weight_type_it_cannot_multiply(kq_model, tmp_path, name):
    """A matrix in a type the products do not implement (Q4_K patched to
    IQ2_XXS / IQ3_S / TQ2_0 / IQ1_S, whose rows are no larger): the file
    opens, the load fails naming the tensor and the type, and the types that
    are supported."""
    bs, bb = gguf.GGML_QUANT_SIZES[_qtype(name)]
    assert bs == 256 and 0 < bb <= BLOCKS["Q4_K"][1]
    path = tmp_path / f"tiny_{name}.gguf"
    shutil.copyfile(kq_model[0], path)
    r = gguf.GGUFReader(path, "r+")
    (t,) = [t for t in r.tensors if t.name == "blk.1.ffn_up.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_K
    t.field.parts[-2][0] = int(_qtype(name))
    r.data.flush()
    del r
    with GGUFFile(path) as f:
        assert {t.name: t.type_name for t in f.tensors}["blk.1.ffn_up.weight"] == name
    with pytest.raises(kvcache.UnsupportedError,
                       match=rf"blk\.1\.ffn_up\.weight has weight type {name} .*Q5_0, Q5_1"):
        Model(path)


def test_kq_model_cache_is_exact_float32(kq_model):
    _, m, _, _ = kq_model
    _check_exact(m, [3, 1, 4, 1, 5, 9, 2, 6], 24, 16)  # eval pages hold 16 tokens too


# -- the default model with its ffn_down matrices in K-quants and IQ4_XS -------------

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _generate_against_reference(m, ref, path, n_gen, n_check=4):
    """Greedy reply to "What is the capital of France?" (n_gen tokens): the
    first n_check tokens' logits against the reference, and each token equal
    to the reference's choice wherever that choice is clear (its top-2 gap
    above 4 times the logit error), at least twice. Returns (tokenizer,
    tokens)."""
    tok = kvcache.Tokenizer.from_gguf(path)
    qn = [{"role": "user", "content": "What is the capital of France?"}]
    p = list(tok.encode(tok.apply_chat_template(qn, add_generation_prompt=True)))
    out = [int(v) for v in m.generate([p], n_gen, num_threads=2)[0]]
    clear = 0
    for i in range(min(n_check, len(out))):
        want = ref.logits(p + out[:i])[-1].astype(np.float64)
        got = m.eval(p + out[:i], num_threads=2)[-1]
        _check_logits(got, want, 5e-3)
        top2 = np.sort(want)[-2:]
        if top2[1] - top2[0] > 4 * np.abs(got - want).max():
            assert out[i] == int(np.argmax(want)), (i, out, tok.decode(out))
            clear += 1
    assert clear >= 2, (clear, out)
    return tok, out


@pytest.mark.skipif(not DEFAULT_MODEL.exists(),
                    reason=f"the default model is absent ({DEFAULT_MODEL}): "
                           "bash scripts/fetch_model.sh")
@pytest.mark.parametrize("name", ["Q4_K", "Q2_K", "Q3_K", "IQ4_XS"])
def test_default_model_with_k_quant_ffn_down(tmp_path, name):
    """Real weights: SmolLM2's 30 ffn_down matrices (576 x 1536, the only
    ones whose input dimension is a multiple of 256) re-encoded as Q4_K,
    Q2_K, Q3_K or IQ4_XS in place (864 / 504 / 660 / 816 bytes a row fit in
    the Q4_1 row's 960; the tensor type is patched), against the float32
    numpy reference of the patched file with test_model.py's default-model
    tolerance on every ISA, and generated tokens against the reference's
    choices where they are clear (Q4_K still answers "Paris")."""
    path = tmp_path / f"smol_{name}.gguf"
    shutil.copyfile(DEFAULT_MODEL, path)
    r = gguf.GGUFReader(path, "r+")
    n = 0
    for t in r.tensors:
        if not t.name.endswith("ffn_down.weight"):
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
        x = gguf.quants.dequantize(t.data, t.tensor_type)
        q = np.frombuffer(W.quantize(x, name), np.uint8)
        flat = t.data.reshape(-1)
        assert q.size == x.size // 256 * BLOCKS[name][1] < flat.size
        flat[:q.size] = q
        # tensor info parts: name length, name, n_dims, dims, type, offset
        type_part = t.field.parts[-2]
        assert type_part.dtype == np.uint32 and int(type_part[0]) == 3
        type_part[0] = int(_qtype(name))
        n += 1
    r.data.flush()
    del r
    assert n == 30
    with GGUFFile(path) as f:
        assert {t.type_name for t in f.tensors if "ffn_down" in t.name} == {name}
    with Model(path) as m:
        ref = LlamaReference(str(path), dtype=np.float32)
        toks = [1, 504, 3458, 282, 4649, 314, 30, 3]
        want = ref.logits(toks).astype(np.float64)
        for isa in kvcache.supported_isas():
            with _isa(isa):
                _check_logits(m.eval(toks, num_threads=2), want, 5e-3)
        tok, out = _generate_against_reference(m, ref, path, 12)
        if name == "Q4_K":
            assert "Paris" in tok.decode(out), tok.decode(out)


@pytest.mark.skipif(not DEFAULT_MODEL.exists(),
                    reason=f"the default model is absent ({DEFAULT_MODEL}): "
                           "bash scripts/fetch_model.sh")
@pytest.mark.parametrize("name", ["Q5_0", "Q5_1", "IQ4_NL"])
def test_default_model_with_a_q5_or_iq4_nl_embedding(tmp_path, name):
    """Real weights: the Q8_0 token embedding, which the model ties to its
    output, re-encoded in place as Q5_0 / Q5_1 / IQ4_NL (18 blocks of 22 /
    24 / 18 bytes a row fit in Q8_0's 612): the embedding lookup and the
    largest matrix product take those types' kernels. Against the float32 numpy reference of the
    patched file, every ISA, and generated tokens against the reference's
    choices where they are clear."""
    path = tmp_path / f"smol_{name}.gguf"
    shutil.copyfile(DEFAULT_MODEL, path)
    r = gguf.GGUFReader(path, "r+")
    (t,) = [t for t in r.tensors if t.name == "token_embd.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    x = gguf.quants.dequantize(t.data, t.tensor_type)
    q = np.frombuffer(W.quantize(x, name), np.uint8)
    flat = t.data.reshape(-1)
    assert q.size == x.size // 32 * BLOCKS[name][1] < flat.size
    flat[:q.size] = q
    type_part = t.field.parts[-2]
    assert type_part.dtype == np.uint32 and int(type_part[0]) == 8
    type_part[0] = int(_qtype(name))
    r.data.flush()
    del r
    with GGUFFile(path) as f:
        assert {u.type_name for u in f.tensors if u.name == "token_embd.weight"} == {name}
        assert "output.weight" not in {u.name for u in f.tensors}
    with Model(path) as m:
        ref = LlamaReference(str(path), dtype=np.float32)
        toks = [1, 504, 3458, 282, 4649, 314, 30, 3]
        want = ref.logits(toks).astype(np.float64)
        for isa in kvcache.supported_isas():
            with _isa(isa):
                _check_logits(m.eval(toks, num_threads=2), want, 5e-3)
        # generated tokens against the reference's choice wherever it is
        # clear (re-encoded as Q5_0 the model answers "La femme de France",
        # and the reference does too: the answer is the weights')
        _generate_against_reference(m, ref, path, 4)
