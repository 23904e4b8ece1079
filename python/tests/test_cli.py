"""The `kvcache` CLI's exit statuses and messages (tools/kvcache), for what the
shell tests in tests/CMakeLists.txt cannot set up deterministically: a
standard output whose reader is already gone."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import kvcache


def cli() -> Path:
    env = os.environ.get("KVCACHE_CLI")
    if env:
        return Path(env)  # set by ctest: it must exist
    p = Path(kvcache.library_path).parent / "kvcache"
    if not p.exists():
        pytest.skip(f"the kvcache CLI is not built next to {kvcache.library_path}")
    return p


def run_reader_gone(*args, timeout=300):
    """Runs the CLI with stdout a pipe whose read end is closed: every write
    fails with EPIPE (SIGPIPE, unless ignored, kills the process: -13)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([str(cli()), *map(str, args)], stdout=w, stderr=subprocess.PIPE,
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
