"""The `kvcache` CLI's exit statuses and messages (tools/kvcache), for what the
shell tests in tests/CMakeLists.txt cannot set up deterministically: a
standard output whose reader is already gone."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import kvcache
from cli_path import kvcache_cli



def run_reader_gone(*args, timeout=300):
    """Runs the CLI with stdout a pipe whose read end is closed: every write
    fails with EPIPE (SIGPIPE, unless ignored, kills the process: -13)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([str(kvcache_cli()), *map(str, args)], stdout=w, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True, timeout=timeout)
    finally:
        os.close(w)


@pytest.mark.parametrize("args,who", [
    (["info"], "info"),
    (["version"], "version"),
    (["help"], "help"),
    (["bench", "--help"], "bench"),
    # a target stops at its first case line (kernel: one thread, tiny sizes)
    (["bench", "kernel", "--quick"], "bench kernel"),
    (["bench", "pmx", "--quick", "--threads", "1", "--op", "static", "--cache", "f16"],
     "bench pmx"),
    # cache prints its figures at the end
    (["bench", "cache", "--quick"], "bench"),
])
def test_reader_gone_is_a_write_error(args, who):
    """A closed stdout is a write error (exit 1, said on stderr), not a death
    by SIGPIPE, in every command (run, chat and bench-serve: tests/CMakeLists.txt)."""
    p = run_reader_gone(*args)
    assert p.returncode == 1, (args, p.returncode, p.stderr)
    # the reason is errno's when the last flush failed ("write error" when an
    # earlier write did: stdio keeps only the error flag)
    assert f"kvcache: {who}: cannot write the output: " in p.stderr, p.stderr


def test_kv_store_url_syntax_is_the_stores(tmp_path):
    """The CLI checks --kv-store URLs as the option is parsed (a malformed one
    is a usage error, exit 2, before the model loads): it must refuse exactly
    the URLs kvc_store_open refuses as malformed (InvalidArgumentError)."""
    from kvcache.errors import InvalidArgumentError, UnsupportedError
    from kvcache.store import KVStore

    d = f"dir:{tmp_path}/s"
    urls = [
        "foo:bar", "DIR:/x", " dir:/x", "dir:", d, d + "?", d + "?max_bytes=0", d + "?max_bytes=1",
        d + "?max_bytes=8G&write=back", d + "?write=back&max_bytes=8G",
        d + "?write=back&write=back",
        d + "?max_bytes=1K&max_bytes=2", d + "?max_bytes=1&", d + "?max_bytes=9223372036854775807",
        d + "?max_bytes=9223372036854775808", d + "?max_bytes=8589934591G",
        d + "?max_bytes=8589934592G", d + "?max_bytes=00000000000000000000001K",
        d + "?max_bytes=1X",
        d + "?max_bytes=+1", d + "?b", d + "?b?max_bytes=1", d + "?b?write=back", d + "?write=",
        d + "?write=selective:0", d + "?write=selective:1048576", d + "?write=selective:1048577",
        d + "?write=selective:+3", d + "?write=selective:000000000000000000000003",
        d + "?write=through", d + "?write=Back",
        "redis://h", "redis://h:", "redis://h:0", "redis://h:65535", "redis://h:65536",
        "redis://h:+1", "redis://h:01", "redis://h:0000000001", "redis://h:00000000001",
        "redis://h:6379/0", "redis://:pw@h:1", "redis://u@h:1", "redis://[::1]:6379",
        "redis://[::1]6379", "redis://[::1]:", "redis://[]:1", "redis://:1", "redis://h/x:1",
        "redis://h:1,redis://h:1", "redis://h:1,redis://h:2", "redis://h:1,", ",redis://h:1",
        "redis://h:1,,redis://h:2", "redis://h:1,unix:///s?ttl=1", "redis://h:1?ttl=5",
        "redis://h:1?ttl=0", "redis://h:1?ttl=2147483647", "redis://h:1?ttl=2147483648",
        "redis://h:1?ttl=5&", "redis://h:1?ttl=5&ttl=6", "redis://h:1?ttl=5&write=back",
        "redis://h:1?write=back&ttl=5", "redis://h:1?write=back", "redis://h:1?",
        "redis://h:1?foo=1",
        "redis://h:1?ttl=1?write=back", "redis://h:1?ttl=1?ttl=2", "redis://h:1&write=back",
        "redis://h:1/", "redis://h:1/x", "redis://h:1/00", "redis://h:1/01", "redis://h:1/-1",
        "redis://h:1/2147483647", "redis://h:1/2147483648", "redis://h:1/00000000001",
        "redis://h:1/0?db=1", "redis://h:1,redis://h:2/3?db=1", "redis://h:1,redis://h:2?db=1",
        "redis://h:1?db=0", "redis://h:1?db=00", "redis://h:1?db=2147483648", "redis://h:1?db=",
        "redis://h:1?db=x", "redis://h:1?ttl=5&db=2&write=back", "redis://h:1?db=+1",
        "redis://h:1?db=1&db=2", "redis://h:1?db=1&ttl=3&db=1", "redis://h:1?ttl=3&db=1",
        "redis://:pw@h:1", "redis://u:pw@h:1/2", "redis://u@h:1", "redis://u:@h:1",
        "redis://:@h:1", "redis://:p%41@h:1", "redis://:p%4@h:1", "redis://:p%@h:1",
        "redis://:p%00@h:1", "redis://:p%zz@h:1", "redis://%00:p@h:1", "redis://:a@b@h:1",
        "redis://:pw@h:1,redis://h:1", "redis://:pw@h:1,redis://:pw2@h:1",
        "redis://:pw@h:1,redis://:pw@h:2", "redis://h:1/@x", "redis://u:p/w@h:1",
        "redis://:pw@[::1]:1/4", "redis://:pw@", "redis://@h:1", "rediss://h:1",
        "redis://h:1,rediss://h:2", "unix://:pw@/s", "unix://u:pw@/s?db=3", "unix://:pw@s",
        "unix://:pw@", "unix:///a@/b", "unix://:pw@/s,unix:///s", "unix://:p%2F@/s",
        "unix://u@/s", "unix://:p@w@/s",
        "unix://rel", "unix://", "unix:///", "unix:///tmp/s", "unix:///" + "x" * 106,
        "unix:///" + "x" * 107, ",".join(f"redis://h:{p}" for p in range(1, 65)),
        ",".join(f"redis://h:{p}" for p in range(1, 66)),
    ]
    for url in urls:
        try:
            KVStore([url]).close()
            malformed = False
        except InvalidArgumentError:
            malformed = True
        except UnsupportedError:  # a Redis URL in a build without hiredis: no verdict
            continue
        r = subprocess.run([str(kvcache_cli()), "run", "-m", str(tmp_path / "none.gguf"), "-p", "hi",
                            "--kv-store", url], capture_output=True, text=True, timeout=60)
        if malformed:
            assert r.returncode == 2 and "--kv-store" in r.stderr, (url, r.stderr)
            # a URL that may hold a password is not echoed
            assert ("@" in url) == ("--kv-store '" not in r.stderr), (url, r.stderr)
        else:
            assert r.returncode == 1 and "cannot load" in r.stderr, (url, r.stderr)
