"""Library version and CPU ISA selection.

The C library picks the best kernels the CPU supports (capped by the
environment variable ``KVC_ISA``, any case: ``AVX2`` is avx2; any other value
makes ``import kvcache`` raise InvalidArgumentError naming the valid ones);
:func:`set_isa` overrides that for tests and benchmarks. Storage kernels (copies, conversion, quantization) give
bit-identical results on every ISA; attention agrees across ISAs to float32
rounding (``docs/DESIGN.md``).
"""

from __future__ import annotations

from . import _lib
from .errors import InvalidArgumentError

__all__ = ["version", "version_number", "get_isa", "set_isa", "best_isa", "isa_supported",
           "supported_isas", "ISA_NAMES"]

ISA_NAMES = _lib.ISA_NAMES

_isa_env_check = _lib.optional_proto("kvc_isa_env_check", _lib.ctypes.c_int)
if hasattr(_lib.lib, "kvc_isa_env_check"):  # a mistyped KVC_ISA: refused here, not ignored
    _lib.check(_isa_env_check())


def version() -> str:
    """The C library's version string, e.g. "0.1.0"."""
    return _lib.kvc_version_string().decode()


def version_number() -> int:
    """The C library's KVC_VERSION_NUMBER."""
    return int(_lib.kvc_version_number())


def _isa_code(name) -> int:
    if isinstance(name, str):
        key = name.strip().lower()
        if key in ISA_NAMES:
            return ISA_NAMES.index(key)
    raise InvalidArgumentError(f"unknown ISA {name!r}; expected one of {', '.join(ISA_NAMES)}")


def _isa_name(code: int) -> str:
    return _lib.kvc_isa_name(code).decode()


def get_isa() -> str:
    """The ISA the kernels run with now: "scalar", "avx2", "avx512" or "amx"."""
    return _isa_name(_lib.kvc_get_isa())


def best_isa() -> str:
    """The best ISA this CPU and OS support (ignores KVC_ISA)."""
    return _isa_name(_lib.kvc_best_isa())


def isa_supported(name: str) -> bool:
    """True if this CPU/OS can run the named ISA."""
    return bool(_lib.kvc_isa_supported(_isa_code(name)))


def supported_isas() -> list[str]:
    """Every ISA this CPU/OS can run, from the most portable ("scalar") up."""
    return [n for i, n in enumerate(ISA_NAMES) if _lib.kvc_isa_supported(i)]


def set_isa(name: str) -> None:
    """Selects the kernels used from now on.

    Raises InvalidArgumentError for an unknown name and UnsupportedError if
    the CPU cannot run that ISA. Not safe while other threads run kvcache
    operators."""
    _lib.check(_lib.kvc_set_isa(_isa_code(name)))
