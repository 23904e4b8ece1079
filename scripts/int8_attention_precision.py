#!/usr/bin/env python3
"""Would integer dot products (AVX-512 VNNI) keep int8 decode attention within
the test tolerance? An analysis for docs/BENCHMARKS.md (decode attention,
int8 vs float16), not a test.

Decode over an int8 cache (quant group 32, per SEMANTICS section 1) with
q . k done on integers: q quantized to `bits` (one scale per head), the int32
group sums scaled by the K group scales; P . V likewise, with the softmax
weights times the V group scales quantized to `bits` per block of 16 keys.
Compared with float64 attention over the dequantized K/V, the reference
SEMANTICS section 5 fixes, as worst |err| / (atol + rtol |ref|) with
rtol = atol = 1e-5 (float32 inputs) over random cases; <= 1 passes.

    python3 scripts/int8_attention_precision.py
"""
import numpy as np

DH, GROUP, BLOCK = 128, 32, 16


def quantize_rows(x):
    """int8 codes and scales of (L, DH) rows, groups of GROUP (SEMANTICS 1)."""
    g = x.reshape(x.shape[0], DH // GROUP, GROUP)
    s = np.maximum(np.abs(g).max(-1) / 127.0, 1e-5).astype(np.float32).astype(np.float64)
    return np.clip(np.rint(g / s[..., None]), -127, 127), s


def worst_ratio(rng, L, spread, bits):
    q = rng.standard_normal(DH)
    kc, ks = quantize_rows(rng.standard_normal((L, DH)) * spread)
    vc, vs = quantize_rows(rng.standard_normal((L, DH)))
    kd = (kc * ks[..., None]).reshape(L, DH)
    vd = (vc * vs[..., None]).reshape(L, DH)
    sm = 1.0 / np.sqrt(DH)
    s = kd @ q * sm
    p = np.exp(s - s.max())
    ref = p @ vd / p.sum()

    qmax = 2.0 ** (bits - 1) - 1
    sq = np.abs(q).max() / qmax
    qi = np.rint(q / sq).reshape(DH // GROUP, GROUP)
    scores = ((kc * qi).sum(-1) * ks).sum(-1) * sq * sm  # exact int32 group sums, then float
    scores = scores.astype(np.float32).astype(np.float64)
    m, lsum, acc = -np.inf, 0.0, np.zeros(DH)
    for b in range(0, L, BLOCK):
        blk = scores[b:b + BLOCK]
        mn = max(m, blk.max())
        a = np.exp(m - mn) if m > -np.inf else 0.0
        acc, lsum, m = acc * a, lsum * a, mn
        pb = np.exp(blk - mn)
        lsum += pb.sum()
        w = pb[:, None] * vs[b:b + BLOCK]  # (keys, groups): weight x V scale
        sw = w.max() / (2.0 ** bits - 1)    # non-negative: unsigned digits
        wi = np.rint(w / sw)
        acc += (wi[:, :, None] * vc[b:b + BLOCK]).sum(0).reshape(DH) * sw
    out = acc / lsum
    return (np.abs(out - ref) / (1e-5 + 1e-5 * np.abs(ref))).max()


def main():
    rng = np.random.default_rng(0)
    print("kv_len  K spread  worst err/tol: 16-bit operands  24-bit operands")
    for L in (7, 54, 512, 2048):
        for spread in (0.3, 1.0, 3.0, 10.0):
            r16 = max(worst_ratio(rng, L, spread, 16) for _ in range(4))
            r24 = max(worst_ratio(rng, L, spread, 24) for _ in range(4))
            print(f"{L:6d}  {spread:8.1f}  {r16:31.3f}  {r24:15.3f}")


if __name__ == "__main__":
    main()
