"""Writes a tiny random-weight llama GGUF for the C model suite, and the
logits of the independent numpy llama (python/tests/llama_reference.py,
float64, weights dequantized by the `gguf` package) for test_model.c's
tiny_eval_matches_numpy_reference.

usage: gen_tiny_gguf.py REPO_PYTHON_DIR OUT.gguf [OUT.ref [QWEN2.gguf LLAMA31.gguf]]

OUT.ref (little endian): "KVCREF1" and a NUL, int32 n_tokens, n_vocab,
decode_from and 0, the n_tokens int32 token ids, then the float64 logits
(n_tokens, n_vocab). Without the gguf package no OUT.ref is written (the C
test then reports an unexpected skip: scripts/setup.sh installs gguf).

The other outputs are the architecture variants for the loader suite
(test_model_load.c): a qwen2 (q/k/v biases, NEOX rope) and a llama with
every bias, rope_freqs.weight and linear rope scaling.

Loads python/kvcache/gguf_writer.py on its own (it needs numpy only), not the
kvcache package, which would load libkvcache: the sanitizer builds run this
before any shared library of theirs exists.
"""
import importlib.util
import os
import struct
import sys


def write_reference(pydir, gguf_path, out):
    try:
        import numpy as np
        sys.path.insert(0, os.path.join(pydir, "tests"))
        from llama_reference import LlamaReference
    except ImportError as e:
        print(f"gen_tiny_gguf: no reference logits ({e}); pip install -r python/requirements.txt")
        if os.path.exists(out):
            os.remove(out)
        return
    ref = LlamaReference(gguf_path)
    n, decode_from = 23, 15  # prompt rows through prefill, the rest through decode
    tokens = (np.arange(n, dtype=np.int64) * 37 + 11) % ref.n_vocab
    logits = ref.logits(tokens).astype("<f8")
    with open(out, "wb") as f:
        f.write(b"KVCREF1\0" + struct.pack("<4i", n, ref.n_vocab, decode_from, 0))
        f.write(tokens.astype("<i4").tobytes())
        f.write(logits.tobytes())


def main():
    pydir, out = sys.argv[1:3]
    spec = importlib.util.spec_from_file_location("kvc_gguf_writer",
                                                  f"{pydir}/kvcache/gguf_writer.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    # GQA (4 query / 2 KV heads) and the writer's default mix of weight types;
    # attention weighted up so that generated tokens depend on the context
    # (at gain 1 they follow the last token alone, and the engine tests could
    # not tell K/V read from the cache from garbage); an output matrix of its
    # own, so that one token's embedding can be broken without its logit; an
    # FFN wider than the model (n_ff 1024), so that ffn_down's product needs
    # more scratch than layer 0's first product: without the forward step's
    # scratch reservation tiny_forward_out_of_memory_writes_nothing fails
    mod.write_tiny_llama(out, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=1024, seed=3,
                         attn_gain=4.0, tied_output=False)
    if len(sys.argv) > 3:
        write_reference(pydir, out, sys.argv[3])
    if len(sys.argv) > 5:
        qwen2, llama31 = sys.argv[4:6]
        mod.write_tiny_llama(qwen2, arch="qwen2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2,
                             n_ff=128, seed=4, attn_gain=4.0, tied_output=True)
        mod.write_tiny_llama(llama31, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                             seed=5, attn_gain=4.0, tied_output=False, rope_freqs=True,
                             rope_scaling=2.0,
                             biases=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                     "ffn_up", "ffn_down"))


if __name__ == "__main__":
    main()
