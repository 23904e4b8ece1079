"""Shared fixtures for the kvcache Python tests.

Run with PYTHONPATH=python and KVCACHE_LIBRARY=<libkvcache.so> (ctest sets
both); without KVCACHE_LIBRARY the binding falls back to build/libkvcache.so.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcache

SUPPORTED_ISAS = kvcache.supported_isas()


@pytest.fixture(params=SUPPORTED_ISAS)
def isa(request):
    """Runs the test once per ISA this CPU supports, restoring the ISA after."""
    old = kvcache.get_isa()
    kvcache.set_isa(request.param)
    try:
        yield request.param
    finally:
        kvcache.set_isa(old)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id, so every test is reproducible."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)
