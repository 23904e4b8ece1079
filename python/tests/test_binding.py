"""Library loading, version, ISA selection, error mapping and the binding's
own argument checks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvcache
from kvcache import _lib

PYTHON_DIR = Path(kvcache.__file__).resolve().parent.parent


def _run_import(env_updates, code="import kvcache; print(kvcache.library_path)"):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PYTHON_DIR)
    for k, v in env_updates.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


def test_missing_library_env_gives_clear_import_error(tmp_path):
    missing = tmp_path / "nope" / "libkvcache.so"
    r = _run_import({"KVCACHE_LIBRARY": str(missing)})
    assert r.returncode != 0
    assert "ImportError" in r.stderr
    assert "KVCACHE_LIBRARY" in r.stderr and str(missing) in r.stderr


def test_unloadable_library_env_gives_import_error(tmp_path):
    bogus = tmp_path / "libkvcache.so"
    bogus.write_text("not a shared library")
    r = _run_import({"KVCACHE_LIBRARY": str(bogus)})
    assert r.returncode != 0
    assert "ImportError" in r.stderr and str(bogus) in r.stderr


def test_no_library_anywhere_gives_clear_import_error(tmp_path):
    """Without KVCACHE_LIBRARY and without a build tree next to the package,
    only the system is searched; if it has no libkvcache, import fails with a
    message saying what was tried and how to fix it."""
    import ctypes.util
    import shutil

    if ctypes.util.find_library("kvcache"):
        pytest.skip("a system libkvcache is installed")
    shutil.copytree(PYTHON_DIR / "kvcache", tmp_path / "python" / "kvcache",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "KVCACHE_LIBRARY"}
    env["PYTHONPATH"] = str(tmp_path / "python")
    r = subprocess.run([sys.executable, "-c", "import kvcache"], env=env, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "not found" in r.stderr
    assert "KVCACHE_LIBRARY" in r.stderr and str(tmp_path / "build") in r.stderr


def test_env_library_is_used():
    r = _run_import({"KVCACHE_LIBRARY": kvcache.library_path})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == kvcache.library_path


def test_build_tree_fallback():
    build_lib = PYTHON_DIR.parent / "build" / "libkvcache.so"
    if not build_lib.exists():
        pytest.skip("no build/libkvcache.so in this checkout")
    r = _run_import({"KVCACHE_LIBRARY": None})
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).resolve() == build_lib.resolve()


def test_version():
    assert kvcache.__version__ == kvcache.version()
    parts = kvcache.__version__.split(".")
    assert len(parts) >= 3 and all(p.isdigit() for p in parts[:3])
    major, minor, patch = (int(p) for p in parts[:3])
    # KVC_VERSION_NUMBER is MAJOR*10000 + MINOR*100 + PATCH (version.h).
    assert kvcache.version_number() == major * 10000 + minor * 100 + patch


def test_package_version_is_the_library_version():
    """python/pyproject.toml (pip install ./python) carries the C library's version."""
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    m = re.search(r'^version = "([^"]+)"', text, re.M)
    assert m, "pyproject.toml has no version"
    assert m.group(1) == kvcache.__version__


def test_isa_queries():
    isas = kvcache.supported_isas()
    assert isas[0] == "scalar"
    assert set(isas) <= {"scalar", "avx2", "avx512", "amx"}
    assert isas == list(kvcache.ISA_NAMES[: len(isas)])  # each level includes the ones below
    assert kvcache.best_isa() == isas[-1]
    assert kvcache.get_isa() in isas
    for name in ("scalar", "avx2", "avx512", "amx"):
        assert kvcache.isa_supported(name) == (name in isas)


def test_set_isa_roundtrip():
    old = kvcache.get_isa()
    try:
        for name in kvcache.supported_isas():
            kvcache.set_isa(name)
            assert kvcache.get_isa() == name
    finally:
        kvcache.set_isa(old)
    assert kvcache.get_isa() == old


def test_set_isa_errors():
    with pytest.raises(kvcache.InvalidArgumentError, match="unknown ISA"):
        kvcache.set_isa("sse9")
    with pytest.raises(ValueError):
        kvcache.isa_supported("neon")
    unsupported = [n for n in kvcache.ISA_NAMES if not kvcache.isa_supported(n)]
    if not unsupported:
        pytest.skip("this CPU supports every ISA")
    old = kvcache.get_isa()
    with pytest.raises(kvcache.UnsupportedError) as ei:
        kvcache.set_isa(unsupported[0])
    assert ei.value.status == -5
    assert kvcache.get_isa() == old


def test_error_classes():
    assert issubclass(kvcache.KvcacheError, RuntimeError)
    assert issubclass(kvcache.InvalidArgumentError, kvcache.KvcacheError)
    assert issubclass(kvcache.InvalidArgumentError, ValueError)
    assert issubclass(kvcache.UnsupportedError, kvcache.KvcacheError)
    with pytest.raises(kvcache.InvalidArgumentError) as ei:
        # kvc_convert rejects int8: a C-side error with C's message.
        _lib.check(_lib.kvc_convert(None, _lib.KVC_I8, None, _lib.KVC_F32, 4))
    assert ei.value.status == -2
    assert "kvc_convert" in str(ei.value)


def test_thread_pool_cache():
    p1, p2 = _lib.threadpool(1).ptr, _lib.threadpool(2).ptr
    assert p1 and p2 and p1 != p2
    assert _lib.threadpool(2).ptr == p2
    assert _lib.kvc_threadpool_n_threads(p2) == 2
    with pytest.raises(kvcache.InvalidArgumentError):
        _lib.threadpool(0)


# ---------------------------------------------------------------------------
# numpy -> kvc_tensor


def test_tensor_strides_in_elements():
    a = np.zeros((4, 6, 8), np.float16)[1:, ::2, :5]
    t = _lib.make_tensor(a)
    assert t.dtype == _lib.KVC_F16 and t.ndim == 3
    assert list(t.shape[:3]) == [3, 3, 5]
    assert list(t.stride[:3]) == [48, 16, 1]
    assert t.data == a.ctypes.data


def test_tensor_int4_doubles_last_dim_and_strides():
    a = np.zeros((3, 5, 4), np.uint8)[:, 1:4]
    t = _lib.make_tensor(a, int4=True)
    assert t.dtype == _lib.KVC_I4
    assert list(t.shape[:3]) == [3, 3, 8]
    assert list(t.stride[:3]) == [40, 8, 1]


def test_tensor_bfloat16_and_scalars():
    import ml_dtypes

    t = _lib.make_tensor(np.zeros((2, 2), ml_dtypes.bfloat16))
    assert t.dtype == _lib.KVC_BF16
    s = _lib.scalar_int64(7, "x")
    assert s.shape == () and s.dtype == np.int64
    ts = _lib.make_tensor(s)
    assert ts.ndim == 0 and ts.dtype == _lib.KVC_I64


def test_index_inputs_are_converted_to_int64():
    a = _lib.int64_array([0, 3, 5], "seqstarts")
    assert a.dtype == np.int64 and a.flags.c_contiguous
    b = _lib.int64_array(np.array([[1, 2], [3, 4]], np.int32).T, "cachestarts")
    assert b.dtype == np.int64 and b.flags.c_contiguous and b.tolist() == [[1, 3], [2, 4]]
    with pytest.raises(kvcache.InvalidArgumentError, match="integers"):
        _lib.int64_array([0.5, 1.0], "seqstarts")
    with pytest.raises(kvcache.InvalidArgumentError, match="single integer"):
        _lib.scalar_int64([1, 2], "max_seqlen")


def test_inplace_rules():
    c = np.zeros((2, 8), np.float32)
    assert _lib.inplace_array(c, "cache") is c
    with pytest.raises(kvcache.InvalidArgumentError, match="contiguous last"):
        _lib.inplace_array(np.zeros((2, 8), np.float32)[:, ::2], "cache")
    ro = np.zeros((2, 8), np.float32)
    ro.flags.writeable = False
    with pytest.raises(kvcache.InvalidArgumentError, match="writeable"):
        _lib.inplace_array(ro, "cache")
    with pytest.raises(kvcache.InvalidArgumentError, match="numpy"):
        _lib.inplace_array([[0.0] * 8], "cache")
    with pytest.raises(kvcache.InvalidArgumentError, match="dtype"):
        _lib.inplace_array(np.zeros((2, 8)), "cache")
    # Reversed leading dim: negative stride cannot be passed and must not be copied.
    with pytest.raises(kvcache.InvalidArgumentError):
        _lib.inplace_array(np.zeros((2, 8), np.float32)[::-1], "cache")
    # C needs data aligned to the elements (the library refuses it otherwise)
    with pytest.raises(kvcache.InvalidArgumentError, match="aligned"):
        _lib.inplace_array(_misaligned((2, 8), np.float32), "cache")


def _misaligned(shape, dtype):
    """A writeable array of zeros whose data sits 1 byte off its alignment."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    a = np.zeros(n + 1, np.uint8)[1:].view(dtype).reshape(shape)
    assert not a.flags.aligned
    return a


def test_input_copied_only_when_needed():
    x = np.zeros((3, 4, 8), np.float32)[:, ::2]
    assert _lib.input_array(x, "x") is x
    y = np.zeros((3, 8), np.float32)[:, ::2]
    z = _lib.input_array(y, "x")
    assert z is not y and z.flags.c_contiguous
    with pytest.raises(kvcache.InvalidArgumentError, match="dtype"):
        _lib.input_array(np.zeros(3), "x")
    m = _misaligned((3, 16), np.float32)
    m[:] = np.arange(48, dtype=np.float32).reshape(3, 16)
    a = _lib.input_array(m, "x")
    assert a.flags.aligned and (a == m).all()  # copied: C requires alignment
    q, s = kvcache.quantize(m, 8, 8)
    q2, s2 = kvcache.quantize(np.ascontiguousarray(m), 8, 8)
    assert (q == q2).all() and (s == s2).all()
    # convert and dequantize copy misaligned floats too (the C calls refuse them)
    np.testing.assert_array_equal(kvcache.convert(m, np.float16),
                                  kvcache.convert(np.ascontiguousarray(m), np.float16))
    sm = _misaligned(s.shape, np.float32)
    sm[:] = s
    np.testing.assert_array_equal(kvcache.dequantize(q, sm, 8, 8), kvcache.dequantize(q, s, 8, 8))


def test_boolean_arguments_take_bools_and_0_1_only():
    """Every boolean argument goes through one rule: bools, numpy bools and the
    integers 0/1 are accepted; None, strings and other integers are refused
    rather than read by their truthiness."""
    for ok in (True, False, np.bool_(True), 0, 1, np.int32(1)):
        assert _lib.flag(ok, "x") is bool(ok)
    for bad in (None, "yes", 2, -1, 0.0, np.float32(1)):
        with pytest.raises(kvcache.InvalidArgumentError, match="x must be a bool"):
            _lib.flag(bad, "x")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = rng.standard_normal((5, 2, 16)).astype(np.float32)
    o = kvcache.single_decode_with_kv_cache(q, k, k, return_lse=1)
    assert isinstance(o, tuple) and len(o) == 2
    with pytest.raises(kvcache.InvalidArgumentError, match="return_lse"):
        kvcache.single_decode_with_kv_cache(q, k, k, return_lse="no")
    qp = rng.standard_normal((3, 4, 16)).astype(np.float32)
    o1 = kvcache.single_prefill_with_kv_cache(qp, k, k, causal=1)
    o2 = kvcache.single_prefill_with_kv_cache(qp, k, k, causal=True)
    np.testing.assert_array_equal(o1, o2)
    with pytest.raises(kvcache.InvalidArgumentError, match="causal"):
        kvcache.single_prefill_with_kv_cache(qp, k, k, causal=2)
    w = kvcache.BatchDecodeWithPagedKVCacheWrapper(kv_layout="NHD")
    one = np.array([0, 1], np.int32)
    w.plan(one, np.array([0], np.int32), np.array([5], np.int32), 4, 2, 16, 5,
           non_blocking=1)
    with pytest.raises(kvcache.InvalidArgumentError, match="non_blocking"):
        w.plan(one, np.array([0], np.int32), np.array([5], np.int32), 4, 2, 16, 5,
               non_blocking="yes")
