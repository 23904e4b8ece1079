"""Writes a tiny random-weight llama GGUF for the C model suite.

usage: gen_tiny_gguf.py REPO_PYTHON_DIR OUT.gguf [QWEN2.gguf LLAMA31.gguf]

The optional outputs are the architecture variants for the loader suite
(test_model_load.c): a qwen2 (q/k/v biases, NEOX rope) and a llama with
every bias, rope_freqs.weight and linear rope scaling.

Loads python/kvcache/gguf_writer.py on its own (it needs numpy only), not the
kvcache package, which would load libkvcache: the sanitizer builds run this
before any shared library of theirs exists.
"""
import importlib.util
import sys


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
        qwen2, llama31 = sys.argv[3:5]
        mod.write_tiny_llama(qwen2, arch="qwen2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2,
                             n_ff=128, seed=4, attn_gain=4.0, tied_output=True)
        mod.write_tiny_llama(llama31, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                             seed=5, attn_gain=4.0, tied_output=False, rope_freqs=True,
                             rope_scaling=2.0,
                             biases=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                     "ffn_up", "ffn_down"))


if __name__ == "__main__":
    main()
