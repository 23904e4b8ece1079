"""Runs the C and Python examples of README.md exactly as written.

usage: readme_test.py README.md INCLUDE_DIR LIBKVCACHE.so PYTHON_DIR
"""
import os
import re
import subprocess
import sys
import tempfile

import numpy as np


def blocks(text, lang):
    return re.findall(r"```" + lang + r"\n(.*?)```", text, re.S)


def check_c(out):
    """key[1][2][1][7] is k[1][0][1][7] = 0.01 * 31 read back from int8: the
    largest of its group of 8 (k[1][0][1][0:8] = 0.24..0.31), so stored as 127
    and read back within half a step (0.31 / 254)."""
    m = re.fullmatch(r"key\[1\]\[2\]\[1\]\[7\] = (\S+) \(stored (\S+) as int8 (-?\d+)\)", out)
    assert m, f"unexpected output {out!r}"
    got, stored, q = float(m[1]), float(m[2]), int(m[3])
    assert stored == 0.31 and q == 127, out
    assert abs(got - 0.31) <= 0.31 / 254, out


def check_pmx(out):
    """Prints the ISA in use, key's shape (B * S, H, Dh) and the largest int8
    round-trip error of k (the example's seeded data): nonzero, and at most
    half a step of its group (absmax / 254) plus float16 rounding."""
    m = re.fullmatch(r"(\w+) \(6, 2, 16\) (\S+)", out)
    assert m, f"unexpected output {out!r}"
    isa, err = m.groups()
    assert isa in ("scalar", "avx2", "avx512", "amx"), out
    k = np.random.default_rng(0).standard_normal((6, 2, 16)).astype(np.float16).astype(np.float64)
    bound = (np.abs(k.reshape(-1, 8)).max(axis=1) / 254).max() + np.abs(k).max() * 2.0**-11
    assert 0 < float(err) <= bound, (out, bound)


def check_paged(out):
    """seq_lens from (indptr, last_page_len, page_size 4): 4 + 3 and 2; the
    positions of the 9 appended tokens; token 6 in page 1, slot 2."""
    assert out == "[7 2] [0 1 2 3 4 5 6 0 1] True", f"unexpected output {out!r}"


def check_model(out):
    """Two greedy chat answers through the engine: one line per question,
    the first naming Paris, the second not empty."""
    lines = out.splitlines()
    assert len(lines) == 2, out
    assert lines[0].startswith("What is the capital of France? -> ") and "Paris" in lines[0], out
    assert re.fullmatch(r"Name a primary color\. -> '.+'", lines[1]), out


# Each Python example is recognized by a call it makes; a new example needs a
# check here (one that prints nothing checkable fails).
PY_CHECKS = [("dynamic_key_value_cache", check_pmx), ("append_paged_kv_cache", check_paged),
             ("model.generate", check_model)]


def main():
    readme, include, lib, pydir = sys.argv[1:5]
    text = open(readme, encoding="utf-8").read()
    c_blocks, py_blocks = blocks(text, "c"), blocks(text, "python")
    assert c_blocks and py_blocks, "README lost its C or Python example"
    with tempfile.TemporaryDirectory() as tmp:
        for i, code in enumerate(c_blocks):
            src, exe = os.path.join(tmp, f"ex{i}.c"), os.path.join(tmp, f"ex{i}")
            open(src, "w").write(code)
            libdir = os.path.dirname(lib)
            subprocess.run(["cc", "-std=c11", "-Wall", "-Werror", "-I", include, src, "-o", exe,
                            lib, f"-Wl,-rpath,{libdir}", "-lm"], check=True)
            out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
            print(f"C example {i}: {out.strip()}")
            check_c(out.strip())
        for i, code in enumerate(py_blocks):
            env = dict(os.environ, PYTHONPATH=pydir, KVCACHE_LIBRARY=lib)
            # from the repository root, as the README says to run them
            out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                 text=True, env=env,
                                 cwd=os.path.dirname(os.path.abspath(readme))).stdout
            print(f"Python example {i}: {out.strip()}")
            checks = [f for key, f in PY_CHECKS if key in code]
            assert len(checks) == 1, f"Python example {i} has no check in readme_test.py"
            checks[0](out.strip())
    print(f"README examples: {len(c_blocks) + len(py_blocks)} passed, 0 failed")


if __name__ == "__main__":
    main()
