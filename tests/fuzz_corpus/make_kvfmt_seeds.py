#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_kvfmt (tests/fuzz_corpus/kvfmt/).

Input layout (tests/fuzz_kvfmt.c): byte 0 the operation (append, attention,
append_attention), bytes 1-2 the PRNG seed of the values, byte 3 flags
(bits 0-1 the number of corruptions), then the bytes the generators read
(format, geometry, sequences, queries, threads, key dtype, corruptions);
missing bytes read as 0. Per operation: the two members at the default
geometry bytes, six calls with pseudo-random generator bytes (members and
custom tuples), and three corrupted calls. Run from anywhere; it writes next
to itself.
"""
import os
import random

here = os.path.dirname(os.path.abspath(__file__))
OPS = ["append", "attention", "append_attention"]


def main() -> None:
    out = os.path.join(here, "kvfmt")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(2026)
    for op, name in enumerate(OPS):
        seeds = {}
        # H 2, Dh 64, P 16 (dims[3], sizes[0]); kivi8 / kivi4; 2 sequences
        for kind, member in ((0, "kivi8"), (1, "kivi4")):
            seeds[f"{name}_{member}"] = bytes([op, 7, kind, 0, 1, 3, 0, kind, 3, 1, 2, 200,
                                               3, 1, 150, 2, 5, 30, 1, 0])
        for k in range(6):
            body = bytes(rng.randrange(256) for _ in range(40))
            seeds[f"{name}_{k}"] = bytes([op, k, rng.randrange(256), 0]) + body
        for k in range(3):
            body = bytes(rng.randrange(256) for _ in range(48))
            seeds[f"{name}_corrupt_{k}"] = bytes([op, k + 10, rng.randrange(256), 1 + k % 2]) + body
        for fname, data in seeds.items():
            with open(os.path.join(out, fname), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
