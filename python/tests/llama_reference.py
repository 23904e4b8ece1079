"""Independent numpy implementation of the llama architecture, reading the
GGUF through the `gguf` package and dequantizing with it (nothing from
kvcache). Full causal attention over the whole sequence, float64 math: the
reference the C forward pass is compared with.

Rotary embedding: GGUF llama Q/K weights are stored so that rotation acts on
adjacent pairs (x[2i], x[2i+1]) with angle pos * base^(-2i / n_rot).
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
    def __init__(self, path, dtype=np.float64):
        r = gguf.GGUFReader(path)
        a = _field(r, "general.architecture")
        assert a == "llama", a
        self.n_layer = int(_field(r, "llama.block_count"))
        self.n_embd = int(_field(r, "llama.embedding_length"))
        self.n_head = int(_field(r, "llama.attention.head_count"))
        self.n_head_kv = int(_field(r, "llama.attention.head_count_kv", self.n_head))
        self.head_dim = self.n_embd // self.n_head
        self.n_rot = int(_field(r, "llama.rope.dimension_count", self.head_dim))
        self.base = float(_field(r, "llama.rope.freq_base", 10000.0))
        self.eps = float(_field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5))
        self.dtype = dtype
        self.w = {}
        for t in r.tensors:
            x = gguf.quants.dequantize(t.data, t.tensor_type)
            self.w[t.name] = np.asarray(x, dtype=dtype).reshape([int(d) for d in reversed(t.shape)])
        self.emb = self.w["token_embd.weight"]  # (n_vocab, n_embd)
        self.out = self.w.get("output.weight", self.emb)
        self.n_vocab = self.emb.shape[0]

    def _rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x, pos):
        # x (n, heads, Dh)
        half = self.n_rot // 2
        inv = self.base ** (-2.0 * np.arange(half) / self.n_rot)
        th = pos[:, None].astype(np.float64) * inv[None, :]  # (n, half)
        c, s = np.cos(th)[:, None, :], np.sin(th)[:, None, :]
        y = x.copy()
        a = x[..., 0:2 * half:2]
        b = x[..., 1:2 * half:2]
        y[..., 0:2 * half:2] = a * c - b * s
        y[..., 1:2 * half:2] = a * s + b * c
        return y

    def logits(self, tokens):
        """Logits (n, n_vocab) of every position, full causal attention."""
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
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(n, Hq, Dh)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(n, H, Dh)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(n, H, Dh)
            q, k = self._rope(q, pos), self._rope(k, pos)
            att = np.empty((n, Hq, Dh), self.dtype)
            for hq in range(Hq):
                kh = hq // G
                s = (q[:, hq, :] @ k[:, kh, :].T) / np.sqrt(Dh)
                s = np.where(mask, s, -np.inf)
                s = s - s.max(axis=1, keepdims=True)
                pr = np.exp(s)
                pr /= pr.sum(axis=1, keepdims=True)
                att[:, hq, :] = pr @ v[:, kh, :]
            x = x + att.reshape(n, Hq * Dh) @ self.w[p + "attn_output.weight"].T
            h = self._rms(x, self.w[p + "ffn_norm.weight"])
            g = h @ self.w[p + "ffn_gate.weight"].T
            u = h @ self.w[p + "ffn_up.weight"].T
            x = x + ((g / (1.0 + np.exp(-g))) * u) @ self.w[p + "ffn_down.weight"].T
        h = self._rms(x, self.w["output_norm.weight"])
        return h @ self.out.T
