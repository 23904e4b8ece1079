"""Expected skips: reads tests/expected_skips.txt (the one list, shared with
the C harness tests/test_main.c) and says whether a skip reason is excused on
this machine. conftest.py reports every skip and fails the session on any
other; tests that loop over ISAs themselves report the ones they could not
run through isas_to_run()."""

from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

import kvcache

REPO = Path(__file__).resolve().parents[2]
LIST = REPO / "tests" / "expected_skips.txt"
ISA_ORDER = ("scalar", "avx2", "avx512", "amx")

# reason -> test ids, for ISA paths tests skipped inside a passing test
PATHS_NOT_RUN: dict[str, set[str]] = {}


def load(path=LIST):
    """[(condition words, reason substring)] from the list file."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cond, sep, reason = line.partition("|")
        if not sep or not cond.split() or not reason.strip():
            raise ValueError(f"{path}:{n}: expected 'CONDITION | REASON', got {line!r}")
        out.append((cond.split(), reason.strip()))
    return out


def cpu_flags():
    """The flags of /proc/cpuinfo's first "flags" line (None if unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def holds(cond):
    """Whether the condition words hold on this machine (unknown: no)."""
    kind, args = cond[0], cond[1:]
    if kind == "cpu-lacks" and args:
        flags = cpu_flags()
        return flags is not None and any(a not in flags for a in args)
    if kind == "cpu-has" and args:
        flags = cpu_flags()
        return flags is not None and all(a in flags for a in args)
    if kind == "env" and len(args) == 1:
        return bool(os.environ.get(args[0]))
    if kind == "missing" and len(args) == 1:
        return not (REPO / args[0]).exists()
    if kind == "system-lib" and len(args) == 1:
        return ctypes.util.find_library(args[0]) is not None
    return False


def excuse(reason, entries):
    """The condition (as text) that excuses this skip reason here, or None."""
    for cond, sub in entries:
        if sub in reason and holds(cond):
            return " ".join(cond)
    return None


def isas_to_run(test_id):
    """The ISAs this CPU supports; the others are noted as paths not run."""
    for name in ISA_ORDER:
        if not kvcache.isa_supported(name):
            PATHS_NOT_RUN.setdefault(f"isa {name} not supported here", set()).add(test_id)
    return kvcache.supported_isas()
