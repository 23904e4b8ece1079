"""KV store binding (kvcache.KVStore, kvcache.store_*; C: include/kvcache/store.h)
against docs/KV_STORE.md, read independently: keys and namespace digests
recomputed with the `xxhash` package from the documented bytes, page objects
parsed with struct and their checksums (and BLAKE2b tags, with hashlib)
recomputed, corrupted objects refused with the documented miss reason; and
the engine through a directory and a Redis store (a second Model, and a
second process, restore the prompt's pages and generate the same tokens).

Nothing here skips: a missing libkvcache_store, xxhash or redis-server is a
failure naming what installs it (scripts/setup.sh).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import kvcache
from kvcache.gguf_writer import write_tiny_llama
from kvcache.model import Engine, Model

try:
    import xxhash
except ImportError:  # pragma: no cover - a failure, not a skip
    xxhash = None

PYDIR = Path(kvcache.__file__).resolve().parents[1]


def _xxh(data: bytes) -> bytes:
    if xxhash is None:
        pytest.fail("the xxhash package is missing (python/requirements.txt; scripts/setup.sh "
                    "installs it)")
    return xxhash.xxh3_128(data).digest()  # canonical: high 64 bits first, big-endian


@pytest.fixture(scope="module", autouse=True)
def _store_library():
    if not kvcache.store_available():
        try:
            kvcache.store.library_path()
        except kvcache.StoreUnavailableError as e:
            pytest.fail(f"libkvcache_store is not available: {e}")


# ---- keys and namespaces ------------------------------------------------------


def _ref_keys(ns: bytes, tokens, page_size: int, unit_pages: int = 1) -> list[bytes]:
    """docs/KV_STORE.md section 2: key[i] = XXH3-128(key[i-1] || int32 LE ids
    of page i); with units of several pages, the ids of page i's whole unit
    and then i's index in the unit (int32 LE)."""
    keys, parent, unit = [], ns, page_size * unit_pages
    for i in range(len(tokens) // unit * unit_pages):
        u0 = i // unit_pages * unit
        ids = struct.pack(f"<{unit}i", *tokens[u0:u0 + unit])
        if unit_pages > 1:
            ids += struct.pack("<i", i % unit_pages)
        parent = _xxh(parent + ids)
        keys.append(parent)
    return keys


@pytest.mark.parametrize("page_size", [1, 4, 16, 300])
def test_page_keys_match_an_independent_xxh3(rng, page_size):
    ns = rng.bytes(16)
    tokens = rng.integers(-(2**31), 2**31, size=3 * page_size + page_size // 2 + 1,
                          dtype=np.int64).astype(np.int32).tolist()
    got = kvcache.store_page_keys(ns, tokens, page_size)
    assert got == _ref_keys(ns, tokens, page_size)
    assert len(got) == len(tokens) // page_size
    # hex namespaces are the same namespace; a prefix's keys are a prefix
    assert kvcache.store_page_keys(ns.hex(), tokens[:page_size], page_size) == got[:1]
    assert kvcache.store_page_keys(ns, [], page_size) == []
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.store_page_keys(ns[:15], tokens, page_size)


@pytest.mark.parametrize("page_size,unit_pages", [(16, 4), (4, 2), (1, 64)])
def test_unit_keys_cover_the_whole_group(rng, page_size, unit_pages):
    ns = rng.bytes(16)
    n = 2 * page_size * unit_pages + page_size  # the trailing page fills no unit
    tokens = rng.integers(0, 50000, size=n).tolist()
    got = kvcache.store_page_keys(ns, tokens, page_size, unit_pages)
    assert got == _ref_keys(ns, tokens, page_size, unit_pages)
    assert len(got) == 2 * unit_pages
    # a page whose own ids match but whose group differs has another key
    other = list(tokens)
    other[unit_pages * page_size - 1] += 1  # the first unit's last id
    if unit_pages > 1:
        assert kvcache.store_page_keys(ns, other, page_size, unit_pages)[0] != got[0]


def _f32_hex(x: float) -> str:
    return struct.pack(">f", x).hex()


def _ref_namespace(d: dict, kv_line: str, salt: bytes) -> bytes:
    text = (
        "kvcache-namespace 1\n"
        f"model {d['model_digest'].hex()}\n"
        f"tokenizer {d['tokenizer_digest'].hex()}\n"
        f"layers {d['n_layers']}\n"
        f"kv_heads {d['n_kv_heads']}\n"
        f"head_dim {d['head_dim']}\n"
        f"rope n_rot {d['n_rot']} neox {int(d['rope_neox'])} freq_factors "
        f"{int(d['rope_freq_factors'])} base {_f32_hex(d['rope_freq_base'])} scale "
        f"{_f32_hex(d['rope_scale'])}\n"
        f"page_size {d['cache']['page_size']}\n"
        f"kv {kv_line}\n"
        f"salt {len(salt)}:"
    )
    return _xxh(text.encode("utf-8") + salt)


def test_namespace_digest_matches_the_documented_text(rng):
    base = dict(model_digest=rng.bytes(16), tokenizer_digest=rng.bytes(16), n_layers=3,
                n_kv_heads=2, head_dim=64, n_rot=32, rope_neox=True, rope_freq_factors=False,
                rope_freq_base=500000.0, rope_scale=0.25)
    fmt = kvcache.KVFormat.member("kivi4", 2, 64, 16)
    cases = [
        (dict(page_size=16, dtype="float16"), "float16 layout NHD"),
        (dict(page_size=8, dtype="bfloat16", kv_layout="HND"), "bfloat16 layout HND"),
        (dict(page_size=16, dtype="int8", quant_group=16, scale_dtype="float32"),
         "int8 layout NHD group 16 scale float32"),
        (dict(page_size=4, dtype="int4", kv_layout="HND"), "int4 layout HND group 8 scale float16"),
        (dict(page_size=16, kv_format="kivi4"),  # its sink row: " sink 1"
         f"kivi4 bits {fmt.bits} group {fmt.group} v_group {fmt.v_group} v_asym "
         f"{int(fmt.v_asym)} rotate_v {int(fmt.rotate_v)} window {fmt.window} "
         f"k_codes channel-major sink {fmt.sink}"),
        (dict(page_size=16, kv_format="kivi8"),  # no sink rows: no field
         "kivi8 bits 8 group 64 v_group 64 v_asym 1 rotate_v 0 window 0 k_codes channel-pairs"),
    ]
    for cache, kv_line in cases:
        for salt in (b"", b"tenant\x00\xff-7"):
            d = dict(base, cache=cache)
            got = kvcache.store_namespace(d, salt=salt)
            assert got == _ref_namespace(d, kv_line, salt), (cache, salt)
    # a str salt is its UTF-8; hex digests are the same digests
    d = dict(base, cache=cases[0][0])
    assert kvcache.store_namespace(d, salt="é") == _ref_namespace(d, cases[0][1],
                                                                 "é".encode())
    assert kvcache.store_namespace(dict(d, model_digest=d["model_digest"].hex())) == \
        kvcache.store_namespace(d)
    # a PagedKVCache gives its own params
    pc = kvcache.PagedKVCache(3, 2, 64, 16, 4, dtype="float16")
    assert kvcache.store_namespace(dict(base, cache=pc)) == _ref_namespace(
        dict(base, cache={"page_size": 16}), "float16 layout NHD", b"")
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.store_namespace(dict(base))  # no cache


# ---- page objects ---------------------------------------------------------------

HDR = struct.Struct("<8sHHI16s16s16sqIIQQ16s16s")
assert HDR.size == 128


def _filled_cache(rng, dtype="float16", page_size=4, n_tokens=10):
    pc = kvcache.PagedKVCache(2, 2, 16, page_size, 8, dtype=dtype)
    tokens = rng.integers(0, 1000, size=n_tokens).astype(np.int32)
    seq, _ = pc.add_sequence(tokens)
    for layer in range(2):
        kv = pc.kv_cache(layer)
        kv[...] = rng.standard_normal(kv.shape).astype(kv.dtype) if kv.dtype.kind == "f" else \
            rng.integers(-100, 100, size=kv.shape).astype(kv.dtype)
        sc = pc.kv_scale(layer)
        if sc is not None:
            sc[...] = rng.random(sc.shape).astype(sc.dtype)
    return pc, seq, tokens


def _parse(obj: bytes, cache) -> dict:
    (magic, version, hdr_bytes, flags, ns, key, parent, position, n_tok, n_layers, layer_bytes,
     payload_bytes, payload_sum, header_sum) = HDR.unpack_from(obj, 0)
    P = n_tok
    ids = np.frombuffer(obj, "<i4", P, 128)
    payload = obj[128 + 4 * P:128 + 4 * P + payload_bytes]
    return dict(magic=magic, version=version, hdr_bytes=hdr_bytes, flags=flags, ns=ns, key=key,
                parent=parent, position=position, n_tok=n_tok, n_layers=n_layers,
                layer_bytes=layer_bytes, payload_bytes=payload_bytes, payload_sum=payload_sum,
                header_sum=header_sum, ids=ids, payload=payload,
                tag=obj[128 + 4 * P + payload_bytes:])


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_object_format_read_independently(rng, dtype):
    pc, seq, tokens = _filled_cache(rng, dtype)
    P = pc.page_size
    ns = rng.bytes(16)
    keys = _ref_keys(ns, tokens.tolist(), P)
    _, pages, _ = pc.page_table([seq])
    i = 1  # the second page: parent = key[0]
    obj = kvcache.store_serialize_page(pc, pages[i], ns, keys[i], keys[i - 1], i * P,
                                       tokens[i * P:(i + 1) * P])
    h = _parse(obj, pc)
    assert h["magic"] == b"KVCPAGE\0" and h["version"] == 1 and h["hdr_bytes"] == 128
    assert h["flags"] == 0 and h["tag"] == b""
    assert (h["ns"], h["key"], h["parent"]) == (ns, keys[i], keys[i - 1])
    assert h["position"] == i * P and h["n_tok"] == P and h["n_layers"] == 2
    assert h["payload_bytes"] == 2 * h["layer_bytes"] == pc.page_bytes
    assert len(obj) == 128 + 4 * P + pc.page_bytes == kvcache.store_object_bytes(pc)
    assert h["ids"].tolist() == tokens[i * P:(i + 1) * P].tolist()
    assert h["header_sum"] == _xxh(obj[:112])
    assert h["payload_sum"] == _xxh(obj[128:128 + 4 * P] + h["payload"])
    # the payload: per layer, the page's data block then (int8) its scale block
    assert h["payload"] == pc.read_page(pages[i]).tobytes()
    want = b""
    for layer in range(2):
        want += pc.kv_cache(layer)[pages[i]].tobytes()
        sc = pc.kv_scale(layer)
        if sc is not None:
            want += sc[pages[i]].tobytes()
    assert h["payload"] == want
    kvcache.store_verify_object(pc, obj, ns, keys[i], keys[i - 1], i * P,
                                tokens[i * P:(i + 1) * P])

    # with an authentication key: flag bit 0 and a keyed BLAKE2b-256 tag
    secret = rng.bytes(32)
    signed = kvcache.store_serialize_page(pc, pages[i], ns, keys[i], keys[i - 1], i * P,
                                          tokens[i * P:(i + 1) * P], auth_key=secret)
    hs = _parse(signed, pc)
    assert hs["flags"] == 1 and len(hs["tag"]) == 32
    assert hs["tag"] == hashlib.blake2b(signed[:-32], key=secret, digest_size=32).digest()
    assert signed[128:-32] == obj[128:]


def _refused(pc, obj, expect, reason, auth_key=None):
    with pytest.raises(kvcache.StoreMissError) as ei:
        kvcache.store_verify_object(pc, obj, *expect, auth_key=auth_key)
    assert ei.value.miss == reason, (reason, str(ei.value))
    assert ei.value.miss_code == kvcache.store.MISS_REASONS.index(reason)
    assert isinstance(ei.value, kvcache.CorruptError)


def _reheader(obj: bytes, offset: int, fmt: str, value) -> bytes:
    """obj with one header field rewritten and the header checksum fixed."""
    b = bytearray(obj)
    struct.pack_into(fmt, b, offset, value)
    b[112:128] = _xxh(bytes(b[:112]))
    return bytes(b)


def test_corrupt_objects_are_refused_with_their_reason(rng):
    pc, seq, tokens = _filled_cache(rng)
    P = pc.page_size
    ns = rng.bytes(16)
    keys = _ref_keys(ns, tokens.tolist(), P)
    _, pages, _ = pc.page_table([seq])
    ids = tokens[:P]
    obj = kvcache.store_serialize_page(pc, pages[0], ns, keys[0], ns, 0, ids)
    ok = (ns, keys[0], ns, 0, ids)
    kvcache.store_verify_object(pc, obj, *ok)

    def flip(o, at):
        b = bytearray(o)
        b[at] ^= 0x40
        return bytes(b)

    _refused(pc, obj[:100], ok, "truncated")
    _refused(pc, obj[:-1], ok, "truncated")
    _refused(pc, obj + b"\0", ok, "truncated")
    _refused(pc, flip(obj, 0), ok, "magic")
    _refused(pc, _reheader(obj, 8, "<H", 2), ok, "version")
    _refused(pc, flip(obj, 70), ok, "header")  # position, checksum not fixed
    _refused(pc, _reheader(obj, 72, "<I", P * 2), ok, "geometry")
    _refused(pc, _reheader(obj, 76, "<I", 3), ok, "geometry")
    _refused(pc, flip(obj, 128 + 4 * P + 5), ok, "payload")
    _refused(pc, flip(obj, 128), ok, "payload")  # token ids are under the payload checksum
    secret = rng.bytes(32)
    _refused(pc, obj, ok, "auth", auth_key=secret)  # no tag
    signed = kvcache.store_serialize_page(pc, pages[0], ns, keys[0], ns, 0, ids,
                                          auth_key=secret)
    kvcache.store_verify_object(pc, signed, *ok, auth_key=secret)
    _refused(pc, signed, ok, "auth", auth_key=rng.bytes(32))
    _refused(pc, signed[:-1] + bytes([signed[-1] ^ 1]), ok, "auth", auth_key=secret)
    _refused(pc, obj, (rng.bytes(16), keys[0], ns, 0, ids), "namespace")
    _refused(pc, obj, (ns, keys[1], ns, 0, ids), "key")
    _refused(pc, obj, (ns, keys[0], keys[1], 0, ids), "key")
    _refused(pc, obj, (ns, keys[0], ns, P, ids), "tokens")
    _refused(pc, obj, (ns, keys[0], ns, 0, tokens[P:2 * P]), "tokens")
    # a refused restore writes nothing; a good one writes the payload
    other = kvcache.PagedKVCache(2, 2, 16, P, 8, dtype="float16")
    s2, _ = other.add_sequence(tokens)
    _, p2, _ = other.page_table([s2])
    before = other.read_page(p2[0])
    with pytest.raises(kvcache.StoreMissError) as ei:
        kvcache.store_restore_page(other, p2[0], flip(obj, 128 + 4 * P + 5), *ok)
    assert ei.value.miss == "payload"
    assert np.array_equal(other.read_page(p2[0]), before)
    kvcache.store_restore_page(other, p2[0], obj, *ok)
    assert np.array_equal(other.read_page(p2[0]), pc.read_page(pages[0]))
    # write_page takes bytes: float64 values are refused, not reinterpreted
    page = pc.read_page(pages[0])
    with pytest.raises(kvcache.InvalidArgumentError, match="uint8"):
        other.write_page(p2[0], page.view(np.float64))
    assert np.array_equal(other.read_page(p2[0]), page)
    other.check()


def test_paged_cache_save_and_restore_through_a_dir_store(rng, tmp_path):
    pc, seq, tokens = _filled_cache(rng, "int8", page_size=4, n_tokens=14)
    P = pc.page_size
    ns = rng.bytes(16)
    with kvcache.KVStore(f"dir:{tmp_path}") as st:
        assert pc.save_to_store(st, ns, seq, tokens) == 3  # 3 whole pages of 14 ids
        st.flush(30)
        s = st.stats()
        assert s["writes_done"] == 3 and s["bytes_written"] == 3 * kvcache.store_object_bytes(pc)
        files = sorted(p.stem for p in (tmp_path / ns.hex()).glob("*/*.kvp"))
        assert files == sorted(k.hex() for k in _ref_keys(ns, tokens.tolist(), P))
        other = kvcache.PagedKVCache(2, 2, 16, P, 8, dtype="int8")
        s2, _ = other.add_sequence(tokens)
        assert other.restore_from_store(st, ns, s2, tokens) == 3
        _, a, _ = pc.page_table([seq])
        _, b, _ = other.page_table([s2])
        for i in range(3):
            assert np.array_equal(other.read_page(b[i]), pc.read_page(a[i]))
        # another prompt shares the first page only; another namespace none
        t2 = tokens.copy()
        t2[P + 1] += 1
        other2 = kvcache.PagedKVCache(2, 2, 16, P, 8, dtype="int8")
        s4, _ = other2.add_sequence(t2)
        assert other2.restore_from_store(st, ns, s4, t2) == 1
        assert other2.restore_from_store(st, rng.bytes(16), s4, t2, 1) == 0
        s = st.stats()
        assert s["hit_pages"] == 4 and s["miss_pages"] >= 2 and s["verify_failures"] == 0
        # invalidate removes the namespace's files
        st.invalidate(ns)
        st.flush(30)
        assert not list((tmp_path / ns.hex()).glob("*/*.kvp"))


def test_store_errors_reach_kvc_last_error(tmp_path):
    # the store library sets errors through the loaded libkvcache (kvc__error)
    with pytest.raises(kvcache.InvalidArgumentError, match="bogus:nowhere"):
        kvcache.KVStore("bogus:nowhere")
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.KVStore(f"dir:{tmp_path}", write_policy="sometimes")
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.KVStore(f"dir:{tmp_path}", auth_key=b"short")
    with pytest.raises(kvcache.InvalidArgumentError, match="write= takes"):
        kvcache.KVStore(f"dir:{tmp_path}?write=sometimes")
    with pytest.raises(kvcache.InvalidArgumentError):
        kvcache.KVStore(f"dir:{tmp_path}", writer_nice=-1)
    with pytest.raises(kvcache.InvalidArgumentError, match="object_pool_bytes"):
        kvcache.KVStore(f"dir:{tmp_path}", object_pool_bytes=-1)
    # int64 fields: ctypes would wrap 2**64 + 1024 into a 1,024-byte queue
    with pytest.raises(kvcache.InvalidArgumentError, match="queue_bytes"):
        kvcache.KVStore(f"dir:{tmp_path}", queue_bytes=2**64 + 1024)
    with pytest.raises(kvcache.InvalidArgumentError, match="object_pool_bytes"):
        kvcache.KVStore(f"dir:{tmp_path}", object_pool_bytes=2**64 - 5)
    st = kvcache.KVStore([f"dir:{tmp_path}?write=back", f"dir:{tmp_path}/b"],
                         write_policy="selective:3", writer_nice=0, object_pool_bytes=0,
                         auth_key=bytes(range(32)), queue_objects=8, queue_bytes=1 << 20)
    st.close()
    st.close()  # idempotent
    with pytest.raises(kvcache.InvalidArgumentError, match="closed"):
        st.stats()
    # put: a queued copy of any bytes, written as is
    ns, key = bytes(16), bytes(range(16))
    with kvcache.KVStore(f"dir:{tmp_path}") as st:
        st.put(ns, key, b"not a page object")
        st.flush()
        assert (tmp_path / ns.hex() / key.hex()[:2] / f"{key.hex()}.kvp").read_bytes() == \
            b"not a page object"


def test_passwords_stay_out_of_repr_and_errors():
    # connections are made on use: a store of unreachable servers opens
    urls = ["redis://user:s3cr3t@127.0.0.1:1,unix://:s3cr3t2@/nonexistent.sock?ttl=5&db=1"]
    try:
        st = kvcache.KVStore(urls)
    except kvcache.UnsupportedError:  # a build without hiredis: nothing to show
        pytest.fail("this build has no Redis tier (scripts/setup.sh installs libhiredis-dev)")
    with st:
        assert st.urls == urls  # as given
        assert repr(st) == ("KVStore(['redis://127.0.0.1:1,unix:///nonexistent.sock?ttl=5&db=1']"
                            ", open)")
    for bad in ("redis://u:s3cr3t@h", "redis://u@h:1", "unix://:s3cr3t@rel.sock",
                "redis://:s3cr3t@h:1/x"):
        with pytest.raises(kvcache.InvalidArgumentError) as e:
            kvcache.KVStore(bad)
        assert "s3cr3t" not in str(e.value), str(e.value)


def test_last_tier_error_says_why_writes_failed(tmp_path):
    try:
        st = kvcache.KVStore(f"unix://:pw@{tmp_path}/nobody.sock")
    except kvcache.UnsupportedError:
        pytest.fail("this build has no Redis tier (scripts/setup.sh installs libhiredis-dev)")
    with st:
        assert st.last_tier_error() == ""
        st.put(bytes(16), bytes(range(16)), b"object")
        st.flush()
        assert st.stats()["errors"] == 1
        why = st.last_tier_error()
        assert "nobody.sock" in why and "cannot connect" in why and ":pw@" not in why, why


def _run_py(code: str, env_over: dict, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PYDIR) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_over)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_library_lookup(tmp_path):
    # KVCACHE_STORE_LIBRARY that does not exist: no fallback, a clear error
    r = _run_py("import kvcache\n"
                "try:\n    kvcache.KVStore('dir:/tmp')\n"
                "except ImportError as e:\n    print('ERR', type(e).__name__, e)\n",
                {"KVCACHE_STORE_LIBRARY": str(tmp_path / "nope.so")})
    assert r.returncode == 0, r.stderr
    assert "ERR StoreUnavailableError" in r.stdout and "KVCACHE_STORE_LIBRARY" in r.stdout
    # a libkvcache without libkvcache_store beside it: import works; the store
    # is the system's if it has one, else an error naming libxxhash-dev
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(kvcache.library_path, lone / "libkvcache.so")
    env = {"KVCACHE_LIBRARY": str(lone / "libkvcache.so")}
    env.pop("KVCACHE_STORE_LIBRARY", None)
    code = ("import os; os.environ.pop('KVCACHE_STORE_LIBRARY', None)\n"
            "import ctypes.util, kvcache\n"
            "print('SYS', ctypes.util.find_library('kvcache_store'))\n"
            "try:\n    kvcache.store_page_keys(bytes(16), [1], 1); print('LOADED')\n"
            "except kvcache.UnsupportedError as e:\n    print('ERR', e)\n")
    r = _run_py(code, env)
    assert r.returncode == 0, r.stderr
    if "SYS None" in r.stdout:
        assert "ERR" in r.stdout and "libxxhash-dev" in r.stdout and "setup.sh" in r.stdout
    else:
        assert "LOADED" in r.stdout or "another copy of libkvcache" in r.stdout
    # next to the loaded libkvcache (what ctest and the build tree use)
    r = _run_py(code + "print(kvcache.store.library_path())\n",
                {"KVCACHE_LIBRARY": kvcache.library_path})
    assert r.returncode == 0 and "LOADED" in r.stdout, r.stdout + r.stderr


# ---- the engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    # the C store suite's tiny llama (tests/gen_tiny_gguf.py)
    path = tmp_path_factory.mktemp("tiny_store") / "tiny.gguf"
    write_tiny_llama(path, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=3,
                     attn_gain=4.0, tied_output=False)
    return path


def _prompts(n_vocab, shared=80):
    r = np.random.default_rng(11)
    a = r.integers(1, n_vocab, size=150).tolist()
    b = a[:shared] + r.integers(1, n_vocab, size=140 - shared).tolist()  # a's first tokens
    return [a, b]


# kivi with prompts sharing 80 tokens: the second prompt's page 4 holds
# the same ids as the first's but belongs to another K group (other
# quantization parameters), so page keys must cover the whole group (the
# bug this case found: the two pages once had one key).


@pytest.mark.parametrize("kv_dtype,shared", [
    ("float16", 80), ("kivi4", 64),
    ("kivi4", 80), ("kivi8", 80),
])
def test_generate_restores_from_a_dir_store_in_a_new_model(tiny_path, tmp_path, kv_dtype,
                                                           shared):
    kw = dict(kv_dtype=kv_dtype, ignore_eos=True, page_size=16, num_threads=2)
    with Model(tiny_path) as m:
        prompts = _prompts(m.n_vocab, shared)
        ref = m.generate(prompts, 8, **kw)
        assert ref.external_tokens == 0
        with kvcache.KVStore(f"dir:{tmp_path}") as st:
            first = m.generate(prompts, 8, kv_store=st, salt=b"t1", **kw)
            assert first == ref and first.external_tokens == 0
            st.flush(60)
            assert st.stats()["writes_done"] > 0
    unit = 16 if kv_dtype == "float16" else 64  # kivi4: whole K groups of 64
    with Model(tiny_path) as m2, kvcache.KVStore(f"dir:{tmp_path}") as st:
        out = m2.generate(prompts, 8, kv_store=st, salt=b"t1", **kw)
        assert out == ref
        # whole units within each prompt's first n - 1 tokens
        want = sum((len(p) - 1) // unit * unit for p in prompts)
        from_cache = shared // unit * unit  # b's shared prefix may come from the prefix cache
        assert want - from_cache <= out.external_tokens <= want
        assert out.external_tokens + out.cached_tokens == want
        # loads start when requests are queued: a page another load brings
        # may be read twice, and applied once
        assert st.stats()["hit_pages"] * 16 >= out.external_tokens
        # another salt (tenant) restores nothing
        other = m2.generate(prompts, 8, kv_store=st, salt="t2", **kw)
        assert other == ref and other.external_tokens == 0
        assert other.stats["external_miss_tokens"] >= 0


def test_a_burst_with_one_prompt_reads_it_once(tiny_path, tmp_path):
    """Requests with one prompt arriving while another runs: the first
    loads the prompt's pages from the store, the others wait for that load
    and take the pages from the prefix cache (one read, not one each)."""
    with Model(tiny_path) as m:
        a, b = _prompts(m.n_vocab)
        kw = dict(kv_dtype="float16", page_size=16, num_threads=2)
        with kvcache.KVStore(f"dir:{tmp_path}") as st:
            ref = m.generate([a], 6, kv_store=st, salt=b"burst", ignore_eos=True, **kw)[0]
            st.flush(60)
        with kvcache.KVStore(f"dir:{tmp_path}") as st:
            eng = Engine(m, kv_dtype="float16", page_size=16, kv_store=st, salt=b"burst")
            eng.add_request(b[:40], 30, ignore_eos=True)  # not stored: runs meanwhile
            eng.step()
            ids = [eng.add_request(a, 6, ignore_eos=True) for _ in range(3)]
            out = eng.run()
            assert all(out[i] == ref for i in ids)
            pages = (len(a) - 1) // 16
            assert st.stats()["hit_pages"] == pages  # read once
            s = eng.stats()
            assert s["external_tokens"] == pages * 16
            assert s["cached_tokens"] >= 2 * pages * 16  # the others' prefix hits
            eng.close()


def test_a_store_of_no_tiers_reports_the_cache_alone(tiny_path, tmp_path):
    """KVStore([]): no tier to find or write; an attached engine's cache
    events are those it reports beside a directory tier."""
    def cache_events(urls):
        events = []
        with Model(tiny_path) as m, kvcache.KVStore(urls) as st:
            st.set_event_callback(events.append)
            eng = Engine(m, kv_dtype="float16", page_size=16, kv_store=st, salt=b"ev")
            for p in _prompts(m.n_vocab):
                eng.add_request(p, 4, ignore_eos=True)
            out = eng.run()
            st.flush(60)
            stats = st.stats()
            ns = eng.store_namespace
            eng.close()
        return events, sorted(out.values()), stats, ns

    ev0, out0, st0, ns = cache_events([])
    ev1, out1, _, _ = cache_events([f"dir:{tmp_path}"])
    assert out0 == out1
    assert ev0 and all(e["tier"] == kvcache.store.TIER_CACHE for e in ev0)
    assert st0["writes_queued"] == 0 and st0["hit_pages"] == 0 and st0["bytes_written"] == 0
    cache1 = [e for e in ev1 if e["tier"] == kvcache.store.TIER_CACHE]
    assert [(e["kind"], e["key"], e["parent"], e["tokens"]) for e in ev0] == \
        [(e["kind"], e["key"], e["parent"], e["tokens"]) for e in cache1]
    assert all(e["ns"] == ns for e in ev0)
    with kvcache.KVStore([]) as st:  # puts go nowhere and are not queued
        st.put(ns, bytes(16), b"x" * 100)
        st.flush(1)
        assert st.stats()["writes_queued"] == 0


def test_detached_engines_leave_no_pages_in_the_events(tiny_path):
    """Engine.close and KVStore.close detach (kvc_store_detach_engine): the
    pages the events named stored in the engine's cache are then named
    removed, so a subscriber rebuilding the set is left with none; engines
    attached in turn to one store each report only their own."""
    def follow(events):
        live, ever = set(), 0
        for e in events:
            assert e["tier"] == kvcache.store.TIER_CACHE
            if e["kind"] == "stored":
                assert e["key"] not in live
                live.add(e["key"])
                ever += 1
            else:
                assert e["kind"] == "removed" and e["key"] in live
                live.remove(e["key"])
        return live, ever

    with Model(tiny_path) as m:
        prompts = _prompts(m.n_vocab)
        events = []
        with kvcache.KVStore([]) as st:
            st.set_event_callback(events.append)
            for p in prompts:  # an engine per prompt, as Model.generate makes
                eng = Engine(m, kv_dtype="float16", page_size=16, kv_store=st)
                eng.add_request(p, 2, ignore_eos=True)
                eng.run()
                live, ever = follow(events)
                assert len(live) == len(p) // 16
                eng.close()
                assert follow(events) == (set(), ever)
                assert eng.kv_store is None
            m.generate([prompts[0]], 2, kv_store=st)
            assert follow(events)[0] == set()
            eng = Engine(m, kv_dtype="float16", page_size=16, kv_store=st)
            eng.add_request(prompts[1], 2, ignore_eos=True)
            eng.run()
            assert follow(events)[0]
        assert follow(events)[0] == set()  # the store's close detached it
        assert eng.kv_store is None
        eng.close()


def test_engine_attach_detach_and_events(tiny_path, tmp_path):
    events = []
    with Model(tiny_path) as m:
        prompts = _prompts(m.n_vocab)
        st = kvcache.KVStore(f"dir:{tmp_path}")
        st.set_event_callback(events.append)
        eng = Engine(m, kv_dtype="float16", page_size=16, kv_store=st, salt=b"ev")
        assert eng.kv_store is st and eng.store_namespace == m.store_namespace(
            {"page_size": 16, "dtype": "float16"}, b"ev")
        ids = [eng.add_request(p, 4, ignore_eos=True) for p in prompts]
        out = eng.run()
        st.flush(60)
        ns = eng.store_namespace
        stored = {e["key"] for e in events if e["kind"] == "stored" and e["tier"] == 0}
        files = {p.stem for p in (tmp_path / ns.hex()).glob("*/*.kvp")}
        assert stored and {k.hex() for k in stored} == files
        for p in (tmp_path / ns.hex()).glob("*/*.kvp"):
            assert p.parent.name == p.stem[:2]
        # events carry the page's parent and ids, chained as section 2 says
        keys = {}
        for p in prompts:
            ks = _ref_keys(ns, p, 16)
            for i, k in enumerate(ks):
                keys[k] = (ks[i - 1] if i else ns, p[i * 16:(i + 1) * 16])
        for e in events:
            if e["kind"] == "stored":
                assert e["ns"] == ns
                assert (e["parent"], e["tokens"]) == keys[e["key"]]
        assert any(e["tier"] == kvcache.store.TIER_CACHE for e in events)
        # a callback that raises does not take the process down
        st.set_event_callback(lambda ev: 1 / 0)
        eng.add_request(prompts[0][:40] + [5] * 40, 2, ignore_eos=True)
        eng.run()
        st.flush(60)
        st.set_event_callback(None)
        # closing the store detaches the engine, which keeps working
        st.close()
        assert eng.kv_store is None
        r = eng.add_request(prompts[1], 4, ignore_eos=True)
        assert eng.run()[r] == out[ids[1]]
        eng.close()
        with pytest.raises(kvcache.InvalidArgumentError):
            Engine(m, kv_store=kvcache.KVStore(f"dir:{tmp_path}"), enable_prefix_caching=False)
        with pytest.raises(kvcache.InvalidArgumentError):
            Engine(m, salt=b"x")  # a salt without a store


# ---- Redis ------------------------------------------------------------------------


@contextlib.contextmanager
def _redis_server(tmp_path, *extra):
    """A throw-away redis-server on a Unix socket (extra: its options); its URL."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server not found on PATH (Debian package: redis-server; "
                    "scripts/setup.sh installs it)")
    d = tmp_path
    if len(str(d / "redis.sock")) > 100:  # sun_path holds 108 bytes
        d = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
    sock = d / "redis.sock"
    proc = subprocess.Popen([server, "--port", "0", "--unixsocket", str(sock),
                             "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
                             "--daemonize", "no", "--dir", str(d), "--logfile",
                             str(d / "redis.log"), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                log = (d / "redis.log").read_text() if (d / "redis.log").exists() else ""
                pytest.fail(f"redis-server exited ({proc.returncode}): {log[-2000:]}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(sock))
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("redis-server did not answer PING within 10 s")
            time.sleep(0.05)
        yield f"unix://{sock}"
    finally:
        proc.kill()
        proc.wait()
        if d != tmp_path:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def redis_url(tmp_path):
    with _redis_server(tmp_path) as url:
        yield url


def test_redis_password_outside_the_url(tiny_path, tmp_path):
    pw = "py pw:@/%,?&"  # as is: no %-encoding outside a URL
    kw = dict(kv_dtype="float16", page_size=16, ignore_eos=True)
    with _redis_server(tmp_path, "--requirepass", pw) as url, Model(tiny_path) as m:
        prompts = _prompts(m.n_vocab)
        ref = m.generate(prompts, 8, **kw)
        with kvcache.KVStore(url, redis_password=pw) as st:
            assert pw not in repr(st)
            assert m.generate(prompts, 8, kv_store=st, salt=b"pw", **kw) == ref
            st.flush(60)
            s = st.stats()
            assert s["writes_done"] > 0 and s["errors"] == 0, s
        with kvcache.KVStore(url, redis_password=pw.encode()) as st:
            again = m.generate(prompts, 8, kv_store=st, salt=b"pw", **kw)
            assert again == ref and again.external_tokens > 0
        # without it, or with a URL's own wrong one (which wins): misses, and why
        for st in (kvcache.KVStore(url), kvcache.KVStore(url.replace("unix://", "unix://:x@"),
                                                          redis_password=pw)):
            with st:
                out = m.generate(prompts, 8, kv_store=st, salt=b"pw", **kw)
                assert out == ref and out.external_tokens == 0
                st.flush(60)
                assert st.stats()["errors"] > 0
                why = st.last_tier_error()
                assert ("NOAUTH" in why or "unauthenticated" in why or "WRONGPASS" in why), why
                assert pw not in why
    for bad, msg in (({"redis_user": "u"}, "needs redis_password"),
                     ({"redis_password": ""}, "empty"),
                     ({"redis_password": "a\0b"}, "NUL"),
                     ({"redis_password": 5}, "str or bytes")):
        with pytest.raises(kvcache.InvalidArgumentError, match=msg):
            kvcache.KVStore("unix:///nonexistent.sock", **bad)


_CHILD = """
import json, sys
import kvcache
path, url, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with kvcache.Model(path) as m, kvcache.KVStore(url) as st:
    out = m.generate(prompts, 8, kv_dtype="float16", page_size=16, ignore_eos=True,
                     kv_store=st, salt=b"redis")
    print(json.dumps({"out": list(out), "external": out.external_tokens,
                      "hits": st.stats()["hit_pages"]}))
"""


def test_generate_restores_from_redis_in_another_process(tiny_path, redis_url):
    kw = dict(kv_dtype="float16", page_size=16, ignore_eos=True)
    with Model(tiny_path) as m:
        prompts = _prompts(m.n_vocab)
        ref = m.generate(prompts, 8, **kw)
        with kvcache.KVStore(redis_url) as st:
            first = m.generate(prompts, 8, kv_store=st, salt=b"redis", **kw)
            assert first == ref and first.external_tokens == 0
            st.flush(60)
            s = st.stats()
            assert s["writes_done"] > 0 and s["errors"] == 0 and s["writes_failed"] == 0
        # a second Model in this process
        with Model(tiny_path) as m2, kvcache.KVStore(redis_url) as st:
            again = m2.generate(prompts, 8, kv_store=st, salt=b"redis", **kw)
            assert again == ref and again.external_tokens > 0
    # a second process
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PYDIR) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tiny_path), redis_url,
                        json.dumps(prompts)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    child = json.loads(r.stdout.strip().splitlines()[-1])
    assert child["out"] == ref
    want = sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert 0 < child["external"] <= want and child["hits"] * 16 >= child["external"]
