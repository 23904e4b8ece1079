"""Shared fixtures for the kvcache Python tests, and the skip check.

Run with PYTHONPATH=python and KVCACHE_LIBRARY=<libkvcache.so> (ctest sets
both); without KVCACHE_LIBRARY the binding falls back to build/libkvcache.so.

Every skip (a test, a module, or an ISA path a test could not run) is listed
at the end of the run with its reason, and the session fails (exit 1) on any
skip that tests/expected_skips.txt does not excuse on this machine
(skip_check.py): a missing gguf or jinja2, a probe that raised, an ISA the CPU
has but the library refuses.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
import skip_check


@pytest.fixture(params=kvcache.ISA_NAMES)
def isa(request):
    """Runs the test once per ISA, restoring the ISA after; skipped (and so
    reported and checked) for an ISA the library does not run here."""
    if not kvcache.isa_supported(request.param):
        pytest.skip(f"isa {request.param} not supported here")
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


# ---- skip check --------------------------------------------------------------

_SKIPS: dict[str, list[str]] = {}  # reason -> test or module ids
_VERDICT: list = []


def _note_skip(report):
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    lr = report.longrepr
    reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    reason = reason.removeprefix("Skipped: ")
    _SKIPS.setdefault(reason, []).append(report.nodeid)


def pytest_runtest_logreport(report):
    _note_skip(report)


def pytest_collectreport(report):
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus):
    entries = skip_check.load()
    found = [(r, len(ids), ids[0], "skipped") for r, ids in _SKIPS.items()]
    found += [(r, len(ids), sorted(ids)[0], "path not run")
              for r, ids in skip_check.PATHS_NOT_RUN.items()]
    for reason, n, first, kind in sorted(found):
        _VERDICT.append((reason, n, first, kind, skip_check.excuse(reason, entries)))
    if any(v[4] is None for v in _VERDICT) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if not _VERDICT:
        return
    tr = terminalreporter
    tr.section(f"skips (checked against {skip_check.LIST.relative_to(skip_check.REPO)})")
    for reason, n, first, kind, why in _VERDICT:
        verdict = f"expected: {why}" if why else "UNEXPECTED"
        tr.line(f"{kind} ({verdict}): {reason} [{n}x, e.g. {first}]", red=why is None)
    bad = sum(v[4] is None for v in _VERDICT)
    if bad:
        tr.line(f"{bad} unexpected skip reason(s): the run fails", red=True, bold=True)
