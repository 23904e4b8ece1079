"""Exceptions raised by the kvcache binding.

Every failing C call (a negative ``kvc_status``) becomes an instance of
:class:`KvcacheError` (or of one of its subclasses) whose message is the C
library's ``kvc_last_error()`` text and whose ``status`` attribute is the
numeric status code. Checks the binding itself performs before calling C
(array layout, writeability, sizes the C API cannot see) raise the same
classes with ``status = STATUS_INVALID_ARG``.
"""

from __future__ import annotations

__all__ = [
    "STATUS_OK",
    "STATUS_NOMEM",
    "STATUS_INVALID_ARG",
    "STATUS_NO_SPACE",
    "STATUS_NOT_FOUND",
    "STATUS_UNSUPPORTED",
    "STATUS_IO",
    "STATUS_CORRUPT",
    "STATUS_INTERNAL",
    "KvcacheError",
    "OutOfMemoryError",
    "InvalidArgumentError",
    "NoSpaceError",
    "NotFoundError",
    "UnsupportedError",
    "KvcacheIOError",
    "CorruptError",
    "InternalError",
    "error_for_status",
]

# Values of the C enum kvc_status (include/kvcache/core.h).
STATUS_OK = 0
STATUS_NOMEM = -1
STATUS_INVALID_ARG = -2
STATUS_NO_SPACE = -3
STATUS_NOT_FOUND = -4
STATUS_UNSUPPORTED = -5
STATUS_IO = -6
STATUS_CORRUPT = -7
STATUS_INTERNAL = -8


class KvcacheError(RuntimeError):
    """A kvcache C call failed.

    Attributes:
        status: the ``kvc_status`` code (a negative int).
        message: the detail message (``kvc_last_error()``).
    """

    default_status = STATUS_INTERNAL

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = self.default_status if status is None else int(status)


class OutOfMemoryError(KvcacheError, MemoryError):
    """KVC_ERR_NOMEM: an allocation inside the library failed."""

    default_status = STATUS_NOMEM


class InvalidArgumentError(KvcacheError, ValueError):
    """KVC_ERR_INVALID_ARG: bad shape, dtype, attribute, index or value."""

    default_status = STATUS_INVALID_ARG


class NoSpaceError(KvcacheError):
    """KVC_ERR_NO_SPACE: a cache has no free pages left."""

    default_status = STATUS_NO_SPACE


class NotFoundError(KvcacheError):
    """KVC_ERR_NOT_FOUND: unknown or freed handle/id."""

    default_status = STATUS_NOT_FOUND


class UnsupportedError(KvcacheError):
    """KVC_ERR_UNSUPPORTED: a valid request this build or CPU cannot serve."""

    default_status = STATUS_UNSUPPORTED


class KvcacheIOError(KvcacheError, OSError):
    """KVC_ERR_IO: a file read or write failed."""

    default_status = STATUS_IO


class CorruptError(KvcacheError):
    """KVC_ERR_CORRUPT: malformed file or broken invariant."""

    default_status = STATUS_CORRUPT


class InternalError(KvcacheError):
    """KVC_ERR_INTERNAL: a bug in kvcache."""

    default_status = STATUS_INTERNAL


_BY_STATUS = {
    STATUS_NOMEM: OutOfMemoryError,
    STATUS_INVALID_ARG: InvalidArgumentError,
    STATUS_NO_SPACE: NoSpaceError,
    STATUS_NOT_FOUND: NotFoundError,
    STATUS_UNSUPPORTED: UnsupportedError,
    STATUS_IO: KvcacheIOError,
    STATUS_CORRUPT: CorruptError,
    STATUS_INTERNAL: InternalError,
}


def error_for_status(status: int, message: str) -> KvcacheError:
    """Returns the exception instance for a negative C status and its message."""
    cls = _BY_STATUS.get(int(status), KvcacheError)
    return cls(message, int(status))
