"""Architecture variants the loader implements, and what it must refuse.

Implemented (each a tiny random model written by kvcache.gguf_writer and
compared with the independent numpy reference, llama_reference.py, in
logits and in greedy tokens generated through the cache): Llama 3.1's
rope_freqs.weight frequency factors, linear rope scaling (and its older
rope.scale_linear key), q/k/v/o and FFN biases, a head size other than
n_embd / n_head (attention.key_length), rotary on part of each head
(rope.dimension_count), and the qwen2 architecture. Each
test also shows that its feature changes the logits well past the
tolerance (the reference with the feature left out), so a loader that
ignored it would fail.

Refused, with a message naming the key or tensor: every tensor the
architecture does not use, blocks at or past block_count, keys the runtime
does not implement or values it does not follow, other namespaces, and
missing or mistyped required keys.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

import kvcache
from kvcache.model import Model

gguf = pytest.importorskip("gguf")
from llama_reference import LlamaReference  # noqa: E402
from test_model import DEFAULT_MODEL, _check_logits, _greedy_with_cache  # noqa: E402

from kvcache.gguf_writer import ValueType, write_tiny_llama  # noqa: E402

ALL_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
BIAS_BITS = {"attn_q": 1, "attn_k": 2, "attn_v": 4, "attn_output": 8, "ffn_gate": 16,
             "ffn_up": 32, "ffn_down": 64}
TOL = 2e-4  # float weights (test_model.py's tolerance)

# name: (writer arguments, features the reference leaves out to show they
# matter, expected kvc_model_info fields)
VARIANTS = {
    "rope_freqs": (dict(rope_freqs=True), ("rope_freqs",), dict(rope_freq_factors=1)),
    "linear_scaling": (dict(rope_scaling=4.0), ("rope_scale",), dict(rope_scale=4.0)),
    "scale_linear_key": (dict(rope_scale_linear=2.0), ("rope_scale",), dict(rope_scale=2.0)),
    "llama_biases": (dict(biases=ALL_BIASES), ("biases",), dict(biases=127)),
    "llama_qkv_biases": (dict(biases=("attn_q", "attn_k", "attn_v")), ("biases",),
                         dict(biases=7)),
    "head_dim_24": (dict(head_dim=24), (), dict(head_dim=24)),
    "partial_rope": (dict(rope_dim=8, rope_freqs=True), ("rope_freqs",),
                     dict(n_rot=8, rope_freq_factors=1)),
    "qwen2_partial_rope": (dict(arch="qwen2", rope_dim=10), ("neox",),
                           dict(arch="qwen2", n_rot=10)),
    "qwen2_rope": (dict(arch="qwen2"), ("neox",), dict(arch="qwen2")),
    "qwen2_biases": (dict(arch="qwen2"), ("biases",), dict(arch="qwen2")),
    "qwen2_scaled": (dict(arch="qwen2", rope_scaling=3.0), ("rope_scale",),
                     dict(arch="qwen2", rope_scale=3.0)),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_reference(name, tmp_path):
    kw, leave_out, info = VARIANTS[name]
    path = tmp_path / f"{name}.gguf"
    write_tiny_llama(path, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=11,
                     weight_types="F32", attn_gain=4.0, tied_output=False, **kw)
    m = Model(path)
    try:
        for k, v in info.items():
            assert m.info[k] == v, (k, m.info[k])
        qwen2 = kw.get("arch") == "qwen2"
        defaults = dict(arch="llama", rope_neox=int(qwen2), rope_scale=1.0,
                        rope_freq_factors=0, biases=7 if qwen2 else 0)
        for k, v in defaults.items():
            if k not in info:
                assert m.info[k] == v, (k, m.info[k])
        ref = LlamaReference(str(path))
        toks = np.random.default_rng(2).integers(0, m.n_vocab, size=40)
        c = m.eval(toks, kv_dtype="float32", num_threads=2)
        r = ref.logits(toks)
        _check_logits(c, r, TOL)
        if leave_out:  # the feature matters: without it the logits are far off
            r0 = LlamaReference(str(path), ignore=leave_out).logits(toks)
            assert np.abs(c - r0).max() > 50 * TOL * np.abs(r).max()
        # greedy generation through the cache (prefill, then the decode kernel)
        prompt = [int(t) for t in toks[:9]]
        got, _ = _greedy_with_cache(m, prompt, 10, "float32")
        assert got == ref.greedy(prompt, 10)
    finally:
        m.close()


def test_rope_scaling_as_llama_cpp_reads_it(tmp_path):
    """A factor without a type is linear (llama.cpp's default); type "none"
    turns it off; the older rope.scale_linear counts only without a
    rope.scaling.factor key (a factor of 0 is none); accepted keys that
    change nothing leave the logits bitwise the same."""
    def logits(path, **kw):
        write_tiny_llama(path, seed=5, weight_types="F32", **kw)
        m = Model(path)
        try:
            return m.info, m.eval(np.arange(3, 30), kv_dtype="float32")
        finally:
            m.close()

    _, plain = logits(tmp_path / "plain.gguf")
    _, linear = logits(tmp_path / "linear.gguf", rope_scaling=4.0)
    info, untyped = logits(tmp_path / "untyped.gguf",
                           extra_kv={"llama.rope.scaling.factor": 4.0})
    assert info["rope_scale"] == 4.0 and np.array_equal(untyped, linear)
    assert not np.allclose(linear, plain)
    harmless = {
        "llama.rope.scaling.type": "none",  # the factor below is then ignored
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 8192,
        "llama.rope.scaling.finetuned": True,
        "llama.rope.scaling.attn_factor": 1.0,
        "llama.tensor_data_layout": "Meta AI original pth",
        "llama.expert_count": (0, ValueType.UINT32),
        "llama.expert_used_count": (0, ValueType.UINT32),
        "llama.attention.causal": True,
        "llama.attention.key_length": 16,
        "llama.attention.value_length": 16,
        "quantize.imatrix.file": "imatrix.dat",
        "quantize.imatrix.entries_count": 14,
        "split.no": (0, ValueType.UINT16),
        "split.count": (1, ValueType.UINT16),
        "general.license": "apache-2.0",
    }
    info, same = logits(tmp_path / "harmless.gguf", extra_kv=harmless)
    assert info["rope_scale"] == 1.0
    assert np.array_equal(same, plain)
    info, zero = logits(tmp_path / "zero.gguf", extra_kv={"llama.rope.scaling.factor": 0.0,
                                                          "llama.rope.scale_linear": 4.0})
    assert info["rope_scale"] == 1.0
    assert np.array_equal(zero, plain)


# ---- refusals -----------------------------------------------------------

Unsupported, Corrupt = kvcache.UnsupportedError, kvcache.CorruptError
ONES = np.ones(16, np.float32)

# name: (writer arguments, error, regex the message must match)
REFUSED = {
    # tensors the architecture does not use
    "q_norm_tensor": (dict(extra_tensors={"blk.0.attn_q_norm.weight": ONES}), Unsupported,
                      r"tensor blk\.0\.attn_q_norm\.weight is not used by the llama"),
    "unknown_global_tensor": (dict(extra_tensors={"rope_factors_long.weight": np.ones(8)}),
                              Unsupported, r"tensor rope_factors_long\.weight is not used"),
    "qwen2_rope_freqs": (dict(arch="qwen2", rope_freqs=True), Unsupported,
                         r"tensor rope_freqs\.weight is not used by the qwen2"),
    "qwen2_output_bias": (dict(arch="qwen2", biases=("attn_q", "attn_k", "attn_v",
                                                     "attn_output")),
                          Unsupported, r"tensor blk\.0\.attn_output\.bias is not used by the qwen2"),
    "qwen2_without_biases": (dict(arch="qwen2", biases=()), Corrupt,
                             r"block 0 lacks one of the attn_q/attn_k/attn_v biases"),
    "rope_freqs_zero": (dict(rope_freqs=[1.0] * 7 + [0.0]), Corrupt,
                        r"rope_freqs\.weight\[7\] = 0 must be > 0"),
    "rope_freqs_shape": (dict(extra_tensors={"rope_freqs.weight": np.ones(16)}), Corrupt,
                         r"tensor rope_freqs\.weight has shape \(16, 1, 1, 1\), expected \(8, 1\)"),
    "bias_shape": (dict(extra_tensors={"blk.1.attn_k.bias": np.ones(64)}), Corrupt,
                   r"tensor blk\.1\.attn_k\.bias has shape \(64, "),
    # keys that change the computation in ways not implemented
    "yarn": (dict(extra_kv={"llama.rope.scaling.type": "yarn",
                            "llama.rope.scaling.factor": 4.0}),
             Unsupported, r"llama\.rope\.scaling\.type = 'yarn': only linear"),
    "longrope": (dict(extra_kv={"llama.rope.scaling.type": "longrope"}), Unsupported,
                 r"llama\.rope\.scaling\.type = 'longrope'"),
    "yarn_key": (dict(extra_kv={"llama.rope.scaling.yarn_beta_fast": 32.0}), Unsupported,
                 r"key llama\.rope\.scaling\.yarn_beta_fast is not supported"),
    "attn_factor": (dict(extra_kv={"llama.rope.scaling.attn_factor": 1.5}), Unsupported,
                    r"llama\.rope\.scaling\.attn_factor = 1\.5"),
    "experts": (dict(extra_kv={"llama.expert_count": 8, "llama.expert_used_count": 2}),
                Unsupported, r"expert_count.*= 8: mixture of experts"),
    "layer_norm": (dict(extra_kv={"llama.attention.layer_norm_epsilon": 1e-5}), Unsupported,
                   r"llama\.attention\.layer_norm_epsilon asks for LayerNorm"),
    "sliding_window": (dict(extra_kv={"llama.attention.sliding_window": 4096}), Unsupported,
                       r"llama\.attention\.sliding_window asks for sliding-window"),
    "softcap": (dict(extra_kv={"llama.final_logit_softcapping": 30.0}), Unsupported,
                r"llama\.final_logit_softcapping asks for output logit soft-capping"),
    "non_causal": (dict(extra_kv={"llama.attention.causal": False}), Unsupported,
                   r"llama\.attention\.causal = false"),
    "value_length": (dict(extra_kv={"llama.attention.value_length": 8}), Unsupported,
                     r"llama\.attention\.value_length = 8 differs from the key length 16"),
    # absent, the value head size is n_embd / n_head (llama.cpp), not the key length
    "value_length_default": (dict(head_dim=24, omit_kv=("llama.attention.value_length",)),
                             Unsupported, r"llama\.attention\.value_length is absent, so the "
                                          r"value head size is embedding_length / head_count = "
                                          r"16 .*differs from the key length 24"),
    "unknown_arch_key": (dict(extra_kv={"llama.swin_norm": True}), Unsupported,
                         r"key llama\.swin_norm is not supported"),
    "other_arch_keys": (dict(extra_kv={"qwen2.block_count": 2}), Unsupported,
                        r"key qwen2\.block_count is not understood"),
    "other_namespace": (dict(extra_kv={"clip.has_vision_encoder": True}), Unsupported,
                        r"key clip\.has_vision_encoder is not understood"),
    "split_files": (dict(extra_kv={"split.count": (3, ValueType.UINT16)}), Unsupported,
                    r"split into 3 files"),
    "adapter": (dict(omit_kv=("general.type",), extra_kv={"general.type": "adapter"}),
                Unsupported, r"general\.type is 'adapter', not a model"),
    # missing, mistyped, inconsistent metadata
    "missing_key": (dict(omit_kv=("llama.embedding_length",)), Corrupt,
                    r"^model: required metadata key llama\.embedding_length is missing$"),
    # llama.cpp requires it too: a guessed epsilon would change every norm
    "missing_context_length": (dict(omit_kv=("llama.context_length",)), Corrupt,
                               r"^model: required metadata key llama\.context_length is missing$"),
    "missing_rms_eps": (dict(omit_kv=("llama.attention.layer_norm_rms_epsilon",)), Corrupt,
                        r"^model: required metadata key llama\.attention\.layer_norm_rms_epsilon"
                        r" is missing$"),
    "mistyped_int": (dict(omit_kv=("llama.block_count",), extra_kv={"llama.block_count": "2"}),
                     Corrupt, r"^model: metadata key llama\.block_count has type string, "
                              r"expected an integer$"),
    "bool_for_int": (dict(omit_kv=("llama.block_count",), extra_kv={"llama.block_count": True}),
                     Corrupt, r"llama\.block_count has type bool, expected an integer"),
    "mistyped_float": (dict(omit_kv=("llama.rope.freq_base",),
                            extra_kv={"llama.rope.freq_base": "1e4"}),
                       Corrupt, r"llama\.rope\.freq_base has type string, expected a number"),
    # per-layer values (llama.cpp reads these keys as one value or an array)
    "per_layer_int": (dict(omit_kv=("llama.feed_forward_length",),
                           extra_kv={"llama.feed_forward_length": [128, 128]}),
                      Unsupported, r"^model: metadata key llama\.feed_forward_length is an array "
                                   r"of 2 values \(one per layer\); per-layer values are not "
                                   r"supported$"),
    "string_array_for_int": (dict(omit_kv=("llama.feed_forward_length",),
                                  extra_kv={"llama.feed_forward_length": ["128", "128"]}),
                             Corrupt, r"llama\.feed_forward_length has type array of string, "
                                      r"expected an integer"),
    "mistyped_arch": (dict(omit_kv=("general.architecture",),
                           extra_kv={"general.architecture": 7}),
                      Corrupt, r"general\.architecture has type uint32, expected a string"),
    "vocab_size": (dict(omit_kv=("llama.vocab_size",), extra_kv={"llama.vocab_size": 999}),
                   Corrupt, r"llama\.vocab_size = 999 but token_embd has 355 rows"),
    "zero_heads": (dict(omit_kv=("llama.attention.head_count",),
                        extra_kv={"llama.attention.head_count": 0}),
                   Corrupt, r"llama\.attention\.head_count = 0 is outside \[1, "),
    "negative_scale": (dict(extra_kv={"llama.rope.scaling.factor": -2.0}), Corrupt,
                       r"llama\.rope\.scaling\.factor = -2 is outside"),
    # tokenizer keys: what would change the tokens is refused by name
    "add_eos": (dict(extra_kv={"tokenizer.ggml.add_eos_token": True}), Unsupported,
                r"tokenizer\.ggml\.add_eos_token = true is not implemented"),
    "space_prefix": (dict(omit_kv=("tokenizer.ggml.add_space_prefix",),
                          extra_kv={"tokenizer.ggml.add_space_prefix": True}), Unsupported,
                     r"tokenizer\.ggml\.add_space_prefix = true is not implemented"),
    "charsmap": (dict(extra_kv={"tokenizer.ggml.precompiled_charsmap": [1, 2, 3]}),
                 Unsupported, r"key tokenizer\.ggml\.precompiled_charsmap is not understood"),
    "eom_not_eog": (dict(extra_kv={"tokenizer.ggml.eom_token_id": (5, ValueType.UINT32)}),
                    Unsupported, r"eom_token_id 5 is not a token this runtime ends"),
    "no_tokenizer": (dict(omit_kv=("tokenizer.ggml.model", "tokenizer.ggml.pre",
                                   "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                   "tokenizer.ggml.merges")),
                     kvcache.NotFoundError, r"tokenizer"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_with_a_message_naming_it(name, tmp_path):
    kw, err, pattern = REFUSED[name]
    path = tmp_path / f"{name}.gguf"
    write_tiny_llama(path, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, seed=1, **kw)
    with pytest.raises(err, match=pattern):
        Model(path)


def test_vocabulary_and_embedding_rows_must_agree(tmp_path):
    """A tokenizer one token short of token_embd's rows is an inconsistent
    file: CorruptError, as for the other metadata (not an argument error)."""
    path = tmp_path / "short.gguf"
    tiny = write_tiny_llama(path, n_vocab=360)
    write_tiny_llama(path, n_vocab=360,
                     omit_kv=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"),
                     extra_kv={"tokenizer.ggml.tokens": (tiny.tokens[:-1], ValueType.ARRAY,
                                                         ValueType.STRING),
                               "tokenizer.ggml.token_type": (tiny.token_types[:-1],
                                                             ValueType.ARRAY, ValueType.INT32)})
    with pytest.raises(kvcache.CorruptError,
                       match=r"token_embd has 360 rows but the vocabulary 359 tokens"):
        Model(path)


def test_harmless_tokenizer_keys_load(tmp_path):
    """Keys that cannot change the tokens load: scores, FIM ids, named
    templates, switches left off."""
    path = tmp_path / "tok.gguf"
    write_tiny_llama(path, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, seed=1, extra_kv={
        "tokenizer.ggml.fim_pre_token_id": (3, ValueType.UINT32),
        "tokenizer.chat_template.tool_use": "{{ messages }}",
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.remove_extra_whitespaces": False})
    m = Model(path)
    assert m.n_vocab > 0
    m.close()


@pytest.mark.parametrize("count", [1, 2])
def test_blocks_past_block_count_are_refused(tmp_path, count):
    """A file with 3 blocks whose block_count says fewer would run the first
    blocks only and print the output of another model."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, n_layer=3)
    data = bytearray(path.read_bytes())
    key = b"llama.block_count"
    at = data.index(key) + len(key)
    assert struct.unpack_from("<II", data, at) == (4, 3)  # uint32 value 3
    struct.pack_into("<I", data, at + 4, count)
    path.write_bytes(bytes(data))
    with pytest.raises(kvcache.CorruptError,
                       match=rf"tensor blk\.{count}\.\w+\.weight is in block {count} but "
                             rf"llama\.block_count is {count}"):
        Model(path)


@pytest.mark.skipif(not DEFAULT_MODEL.exists(), reason=f"{DEFAULT_MODEL} absent")
def test_default_model_keys_and_tensors_are_all_understood():
    """SmolLM2 (a llama GGUF from llama.cpp's converter) loads: each of its
    keys is informational or read, each tensor used."""
    r = gguf.GGUFReader(str(DEFAULT_MODEL))
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert {k.split(".")[0] for k in keys} == {"general", "llama", "tokenizer"}
    m = Model(DEFAULT_MODEL)
    try:
        info = m.info
        assert (info["arch"], info["rope_neox"], info["rope_scale"], info["rope_freq_factors"],
                info["biases"]) == ("llama", 0, 1.0, 0, 0)
        assert info["n_params"] == sum(int(np.prod(t.shape)) for t in r.tensors)
    finally:
        m.close()
