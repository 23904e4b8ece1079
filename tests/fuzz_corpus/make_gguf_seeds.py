"""Regenerates the GGUF fuzz seeds in tests/fuzz_corpus/gguf/ (small valid
files covering every value type, nested and string arrays, each tensor type
the writer knows, v2/v3, custom alignment and a tiny llama model).

    PYTHONPATH=python python3 tests/fuzz_corpus/make_gguf_seeds.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# Load the writer without importing kvcache (which needs the shared library).
_spec = importlib.util.spec_from_file_location(
    "gguf_writer", HERE.parent.parent / "python" / "kvcache" / "gguf_writer.py")
W = importlib.util.module_from_spec(_spec)
sys.modules["gguf_writer"] = W
_spec.loader.exec_module(W)
V = W.ValueType


def all_types(version: int, alignment: int | None) -> bytes:
    w = W.GGUFWriter(version=version, alignment=alignment)
    w.add("general.architecture", "llama")
    w.add("u8", 200, V.UINT8)
    w.add("i8", -100, V.INT8)
    w.add("u16", 60000, V.UINT16)
    w.add("i16", -30000, V.INT16)
    w.add("u32", 4000000000, V.UINT32)
    w.add("i32", -2000000000, V.INT32)
    w.add("f32", 1.5, V.FLOAT32)
    w.add("b", True, V.BOOL)
    w.add("u64", 2**63 + 5, V.UINT64)
    w.add("i64", -(2**40), V.INT64)
    w.add("f64", -2.25, V.FLOAT64)
    w.add_array("arr.i16", [1, -2, 3], V.INT16)
    w.add_array("arr.str", ["a", "", "Ġhello"], V.STRING)
    w.add_array("arr.bool", [False, True], V.BOOL)
    w.add_array("arr.nested", [[1, 2], ["x"]], V.ARRAY)
    w.add_array("arr.empty", [], V.FLOAT32)
    rng = np.random.default_rng(0)
    w.add_tensor("t.f32", rng.standard_normal((2, 3)), "F32")
    w.add_tensor("t.f16", rng.standard_normal((4,)), "F16")
    w.add_tensor("t.bf16", rng.standard_normal((1, 1, 2)), "BF16")
    w.add_tensor("t.q8_0", rng.standard_normal((2, 32)), "Q8_0")
    w.add_tensor("t.q4_0", rng.standard_normal((32,)), "Q4_0")
    w.add_tensor("t.q4_1", rng.standard_normal((1, 1, 1, 64)), "Q4_1")
    return w.tobytes()


def main() -> None:
    out = HERE / "gguf"
    out.mkdir(exist_ok=True)
    header_only = W.GGUFWriter()
    (out / "header_only.gguf").write_bytes(header_only.tobytes())
    (out / "all_types_v3.gguf").write_bytes(all_types(3, None))
    (out / "all_types_v2_align8.gguf").write_bytes(all_types(2, 8))
    W.write_tiny_llama(out / "tiny_llama.gguf", n_layer=1, n_embd=32, n_head=2, n_head_kv=1,
                       n_ff=32, vocab=(["Ġt", "he"], ["Ġ t", "h e"]), tied_output=True,
                       weight_types={"token_embd": "Q4_0", "ffn_up": "Q4_1"})
    for p in sorted(out.iterdir()):
        print(p.name, p.stat().st_size)


if __name__ == "__main__":
    main()
