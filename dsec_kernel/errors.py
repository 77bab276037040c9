"""Typed errors: one class per wire error code.

Every failure that crosses a process boundary travels as the one wire error shape
(:class:`dsec_kernel.wire.Error`: ``code``, ``message``, ``retryable``) and is raised
on the other side as the matching subclass::

    DsecError
     ├── InvalidArgument      bad input; nothing was changed
     │    └── UnknownBackend  no node in the cluster runs that backend
     ├── Unauthenticated      missing or wrong credential
     ├── NotFound             no such sandbox (or not yours) / no such file
     ├── Unsupported          the backend does not declare that capability
     ├── Forbidden            a guard refused the operation
     ├── CapacityExceeded     no node has room now            (retryable)
     ├── Unavailable          a service or edge did not answer (retryable)
     ├── DeadlineExceeded     the request itself timed out     (retryable)
     ├── SandboxLost          its node went down; state is gone
     ├── SandboxPaused        paused (lease lapsed, priority, request): resume it first
     ├── QueueFull            the tenant's admission queue is full  (retryable)
     ├── QuotaExceeded        a quota (the tenant's, a sandbox's disk) does not allow it
     ├── Conflict             the state changed under the request (retryable)
     └── Internal             a bug or an unexpected failure

``retryable`` says whether the same request may succeed if sent again unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from dsec_kernel.wire import Error

__all__ = [
    "CapacityExceeded",
    "Conflict",
    "DeadlineExceeded",
    "DsecError",
    "Forbidden",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "QueueFull",
    "QuotaExceeded",
    "SandboxLost",
    "SandboxPaused",
    "Unauthenticated",
    "Unavailable",
    "UnknownBackend",
    "Unsupported",
    "error_class",
    "from_wire",
]


class DsecError(Exception):
    """Base of every DSec error. ``code`` is stable and machine readable."""

    code: ClassVar[str] = "internal"
    default_retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = self.default_retryable if retryable is None else retryable

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def to_wire(self):  # -> wire.Error; imported lazily to keep this module dependency-free
        from dsec_kernel.wire import Error

        return Error(code=self.code, message=self.message, retryable=self.retryable)


class InvalidArgument(DsecError):
    code = "invalid_argument"


class UnknownBackend(InvalidArgument):
    code = "unknown_backend"


class Unauthenticated(DsecError):
    code = "unauthenticated"


class NotFound(DsecError):
    code = "not_found"


class Unsupported(DsecError):
    code = "unsupported"


class Forbidden(DsecError):
    code = "forbidden"


class CapacityExceeded(DsecError):
    code = "capacity_exceeded"
    default_retryable = True


class Unavailable(DsecError):
    code = "unavailable"
    default_retryable = True


class StateUnavailable(Unavailable):
    """The cluster's state (JetStream) did not answer: a NATS server was lost and its
    streams are electing new leaders (4-9 s by nats-server's raft timeouts), or no quorum.
    Services wait this out within their caller's deadline (see :mod:`dsec_kernel.bus`)."""


class DeadlineExceeded(DsecError):
    code = "deadline_exceeded"
    default_retryable = True


class SandboxLost(DsecError):
    code = "sandbox_lost"


class SandboxPaused(DsecError):
    code = "sandbox_paused"


class QueueFull(DsecError):
    code = "queue_full"
    default_retryable = True


class QuotaExceeded(DsecError):
    code = "quota_exceeded"


class Conflict(DsecError):
    code = "conflict"
    default_retryable = True


class Internal(DsecError):
    code = "internal"


_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        UnknownBackend,
        Unauthenticated,
        NotFound,
        Unsupported,
        Forbidden,
        CapacityExceeded,
        Unavailable,
        DeadlineExceeded,
        SandboxLost,
        SandboxPaused,
        QueueFull,
        QuotaExceeded,
        Conflict,
        Internal,
    )
}


def error_class(code: str) -> type[DsecError]:
    """The exception class for a wire error code (``Internal`` for codes unknown here)."""
    return _BY_CODE.get(code, Internal)


def from_wire(error: Error) -> DsecError:
    """The exception a wire :class:`~dsec_kernel.wire.Error` stands for."""
    return error_class(error.code)(error.message, retryable=error.retryable)
