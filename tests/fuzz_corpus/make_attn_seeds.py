#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_attn (tests/fuzz_corpus/attn/).

Input layout (tests/fuzz_attn.c): byte 0 the operation (15 of them), bytes
1-2 the PRNG seed of the tensor contents, byte 3 flags (bits 0-1 the number
of corruptions, bit 2 NaN/Inf values), then the bytes the operation's
generator reads (shapes, dtypes, layout, page table, strides, parameters,
pool); missing bytes read as 0. Four valid calls per operation (flags 0)
with deterministic pseudo-random generator bytes, and one corrupted call
per operation. Run from anywhere; it writes next to itself.
"""
import os
import random

here = os.path.dirname(os.path.abspath(__file__))
OPS = ["append", "append_mla", "single_decode", "batch_decode", "single_prefill",
       "paged_prefill", "ragged_prefill", "cascade", "mla", "merge_state", "merge_in_place",
       "merge_states", "pmx_static", "pmx_dynamic", "pmx_mhca"]


def main() -> None:
    out = os.path.join(here, "attn")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(2024)
    for op, name in enumerate(OPS):
        for k in range(4):
            body = bytes(rng.randrange(256) for _ in range(40))
            data = bytes([op, k, 0, 0]) + body
            with open(os.path.join(out, f"{name}_{k}"), "wb") as f:
                f.write(data)
        body = bytes(rng.randrange(256) for _ in range(48))
        with open(os.path.join(out, f"{name}_corrupt"), "wb") as f:
            f.write(bytes([op, 9, 0, 1]) + body)


if __name__ == "__main__":
    main()
