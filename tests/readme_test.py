"""Runs the C and Python examples of README.md exactly as written.

usage: readme_test.py README.md INCLUDE_DIR LIBKVCACHE.so PYTHON_DIR
"""
import os
import re
import subprocess
import sys
import tempfile


def blocks(text, lang):
    return re.findall(r"```" + lang + r"\n(.*?)```", text, re.S)


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
            assert "key[1][2][1][7]" in out
        for i, code in enumerate(py_blocks):
            env = dict(os.environ, PYTHONPATH=pydir, KVCACHE_LIBRARY=lib)
            # from the repository root, as the README says to run them
            out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                 text=True, env=env,
                                 cwd=os.path.dirname(os.path.abspath(readme))).stdout
            print(f"Python example {i}: {out.strip()}")
            assert out.strip(), "Python example printed nothing"
    print(f"README examples: {len(c_blocks) + len(py_blocks)} passed, 0 failed")


if __name__ == "__main__":
    main()
