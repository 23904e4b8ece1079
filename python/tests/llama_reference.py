"""Independent numpy implementation of the llama architecture and its qwen2
variant, reading the GGUF through the `gguf` package and dequantizing with
it (nothing from kvcache). Full causal attention over the whole sequence,
float64 math: the reference the C forward pass is compared with.

What it follows (llama.cpp's llama and qwen2 graphs):

* rotary embedding: llama's GGUF Q/K weights are stored so that rotation
  acts on adjacent pairs (x[2i], x[2i+1]); qwen2 (llama.cpp's NEOX rope)
  rotates the halves (x[i], x[i + n_rot/2]). Pair i turns by
  pos / scale * base^(-2i / n_rot) / freq_factor[i], where scale is the
  linear rope scaling factor (``rope.scaling.factor`` with type linear or
  absent, else the older ``rope.scale_linear``; type "none" or 0: 1) and
  freq_factor the ``rope_freqs.weight`` tensor (Llama 3.1+; absent: 1);
* head size ``attention.key_length`` (default n_embd / n_head);
* ``blk.N.<matrix>.bias`` added to the product where present.

``ignore`` names features to leave out ("rope_freqs", "rope_scale",
"biases", "neox"), so that tests can show each one changes the logits.
"""

from __future__ import annotations

import numpy as np

import gguf


def _field(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    v = f.parts[f.data[0]]
    if f.types and f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(v).decode()
    return v[0].item()


class LlamaReference:
    def __init__(self, path, dtype=np.float64, ignore=()):
        r = gguf.GGUFReader(path)
        a = _field(r, "general.architecture")
        assert a in ("llama", "qwen2"), a
        self.arch = a
        self.n_layer = int(_field(r, f"{a}.block_count"))
        self.n_embd = int(_field(r, f"{a}.embedding_length"))
        self.n_head = int(_field(r, f"{a}.attention.head_count"))
        self.n_head_kv = int(_field(r, f"{a}.attention.head_count_kv", self.n_head))
        self.head_dim = int(_field(r, f"{a}.attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(_field(r, f"{a}.rope.dimension_count", self.head_dim))
        self.base = float(_field(r, f"{a}.rope.freq_base", 10000.0))
        self.eps = float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-5))
        kind = _field(r, f"{a}.rope.scaling.type", "linear")
        assert kind in ("none", "linear"), kind
        factor = float(_field(r, f"{a}.rope.scaling.factor", 0.0))
        if factor == 0.0:
            factor = float(_field(r, f"{a}.rope.scale_linear", 0.0))
        self.rope_scale = 1.0 if kind == "none" or factor == 0.0 or "rope_scale" in ignore \
            else factor
        self.neox = a == "qwen2" and "neox" not in ignore
        self.dtype = dtype
        self.w = {}
        for t in r.tensors:
            x = gguf.quants.dequantize(t.data, t.tensor_type)
            self.w[t.name] = np.asarray(x, dtype=dtype).reshape([int(d) for d in reversed(t.shape)])
        self.emb = self.w["token_embd.weight"]  # (n_vocab, n_embd)
        self.out = self.w.get("output.weight", self.emb)
        self.n_vocab = self.emb.shape[0]
        ff = self.w.get("rope_freqs.weight")
        self.freq_factors = (np.ones(self.n_rot // 2) if ff is None or "rope_freqs" in ignore
                             else np.asarray(ff, np.float64))
        self.use_biases = "biases" not in ignore

    def _rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x, pos):
        # x (n, heads, Dh)
        half = self.n_rot // 2
        inv = self.base ** (-2.0 * np.arange(half) / self.n_rot) / self.freq_factors
        th = (pos[:, None].astype(np.float64) / self.rope_scale) * inv[None, :]  # (n, half)
        c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
        if self.neox:
            i0, i1 = slice(0, half), slice(half, 2 * half)
        else:
            i0, i1 = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
        y = x.copy()
        a, b = x[..., i0], x[..., i1]
        y[..., i0] = a * c - b * s
        y[..., i1] = a * s + b * c
        return y

    def _lin(self, h, name):
        """h W^T (+ the bias, if the file has one)."""
        y = h @ self.w[name + ".weight"].T
        b = self.w.get(name + ".bias")
        return y + b if b is not None and self.use_biases else y

    def logits(self, tokens, kv_store=None):
        """Logits (n, n_vocab) of every position, full causal attention.
        kv_store(x) -> x, if given, is applied to every K (after rotary) and
        V array (n, n_head_kv, head_dim) before attention reads it: the
        round trip through a cache's storage type."""
        tokens = np.asarray(tokens)
        n = tokens.size
        pos = np.arange(n)
        x = self.emb[tokens].astype(self.dtype)
        Hq, H, Dh = self.n_head, self.n_head_kv, self.head_dim
        G = Hq // H
        mask = np.tril(np.ones((n, n), bool))
        for l in range(self.n_layer):
            p = f"blk.{l}."
            h = self._rms(x, self.w[p + "attn_norm.weight"])
            q = self._lin(h, p + "attn_q").reshape(n, Hq, Dh)
            k = self._lin(h, p + "attn_k").reshape(n, H, Dh)
            v = self._lin(h, p + "attn_v").reshape(n, H, Dh)
            q, k = self._rope(q, pos), self._rope(k, pos)
            if kv_store is not None:
                k, v = kv_store(k).astype(self.dtype), kv_store(v).astype(self.dtype)
            att = np.empty((n, Hq, Dh), self.dtype)
            for hq in range(Hq):
                kh = hq // G
                s = (q[:, hq, :] @ k[:, kh, :].T) / np.sqrt(Dh)
                s = np.where(mask, s, -np.inf)
                s = s - s.max(axis=1, keepdims=True)
                pr = np.exp(s)
                pr /= pr.sum(axis=1, keepdims=True)
                att[:, hq, :] = pr @ v[:, kh, :]
            x = x + self._lin(att.reshape(n, Hq * Dh), p + "attn_output")
            h = self._rms(x, self.w[p + "ffn_norm.weight"])
            g = self._lin(h, p + "ffn_gate")
            u = self._lin(h, p + "ffn_up")
            x = x + self._lin((g / (1.0 + np.exp(-g))) * u, p + "ffn_down")
        h = self._rms(x, self.w["output_norm.weight"])
        return h @ self.out.T

    def greedy(self, prompt, n_new):
        """n_new greedy tokens after prompt, recomputing the sequence each step."""
        seq = list(prompt)
        for _ in range(n_new):
            seq.append(int(np.argmax(self.logits(seq)[-1])))
        return seq[len(prompt):]
