"""Where the tests find the `kvcache` CLI: $KVCACHE_CLI (ctest sets it, and
then it must exist), else next to the library under test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvcache


def kvcache_cli() -> Path:
    env = os.environ.get("KVCACHE_CLI")
    if env:
        return Path(env)
    p = Path(kvcache.library_path).parent / "kvcache"
    if not p.exists():
        pytest.skip(f"the kvcache CLI is not built next to {kvcache.library_path}")
    return p
