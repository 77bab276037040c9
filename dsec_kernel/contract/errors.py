"""Typed errors: one class per wire error code.

Every failure that crosses a process boundary travels as the one wire error shape
(:class:`dsec_kernel.contract.wire.Error`: ``code``, ``message``, ``retryable``; made with
``Error.of(exc)``) and is raised on the other side as the matching subclass of
:class:`DsecError` (``error.exception()``). This module imports nothing of DSec's.
Adding a code is one edit: a subclass that sets ``code`` (its own), says what it means in
its docstring and, if it differs from its base's, the ``dsec`` command's ``exit_status``;
it is registered for :func:`error_class` and exported by defining it. ``retryable`` says
whether the same request may succeed if sent again unchanged.
"""

from __future__ import annotations

from typing import ClassVar

_BY_CODE: dict[str, type[DsecError]] = {}


class DsecError(Exception):
    """Base of every DSec error. ``code`` is stable and machine readable; ``exit_status``
    is the ``dsec`` command's when the error ends it (docs/configuration.md)."""

    code: ClassVar[str] = "internal"
    default_retryable: ClassVar[bool] = False
    exit_status: ClassVar[int] = 1

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        if "code" in cls.__dict__:  # a code of its own (StateUnavailable shares its base's)
            if cls.code in _BY_CODE:
                raise TypeError(f"error code {cls.code!r} is {_BY_CODE[cls.code].__name__}'s")
            _BY_CODE[cls.code] = cls

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = self.default_retryable if retryable is None else retryable

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class InvalidArgument(DsecError):
    """Bad input; nothing was changed."""

    code = "invalid_argument"
    exit_status = 3


class UnknownBackend(InvalidArgument):
    """No node in the cluster runs that backend."""

    code = "unknown_backend"


class Unauthenticated(DsecError):
    """Missing or wrong credential."""

    code = "unauthenticated"
    exit_status = 4


class NotFound(DsecError):
    """No such sandbox (or not yours), layer or file."""

    code = "not_found"
    exit_status = 5


class Unsupported(DsecError):
    """The backend does not declare that capability."""

    code = "unsupported"
    exit_status = 6


class Forbidden(DsecError):
    """A guard refused the operation."""

    code = "forbidden"
    exit_status = 6


class CapacityExceeded(DsecError):
    """No node has room now (retryable)."""

    code = "capacity_exceeded"
    default_retryable = True
    exit_status = 7


class Unavailable(DsecError):
    """A service or edge did not answer (retryable)."""

    code = "unavailable"
    default_retryable = True
    exit_status = 9


class StateUnavailable(Unavailable):
    """The cluster's state (JetStream) did not answer: a NATS server was lost and its
    streams are electing new leaders (4-9 s by nats-server's raft timeouts), or no quorum.
    Services wait this out within their caller's deadline (see :mod:`dsec_kernel.bus`)."""


class DeadlineExceeded(DsecError):
    """The request itself timed out (retryable)."""

    code = "deadline_exceeded"
    default_retryable = True
    exit_status = 10


class SandboxLost(DsecError):
    """Its node went down or its init died; its state is gone."""

    code = "sandbox_lost"
    exit_status = 11


class SandboxPaused(DsecError):
    """Paused (lease lapsed, priority, request): resume it first."""

    code = "sandbox_paused"
    exit_status = 11


class QueueFull(DsecError):
    """The tenant's queue or requests in flight are full (retryable)."""

    code = "queue_full"
    default_retryable = True
    exit_status = 7


class QuotaExceeded(DsecError):
    """A quota (the tenant's, a sandbox's disk) does not allow it."""

    code = "quota_exceeded"
    exit_status = 8


class Conflict(DsecError):
    """The state changed under the request (retryable)."""

    code = "conflict"
    default_retryable = True
    exit_status = 12


class Internal(DsecError):
    """A bug or an unexpected failure."""

    code = "internal"


def error_class(code: str) -> type[DsecError]:
    """The exception class for a wire error code (``Internal`` for codes unknown here)."""
    return _BY_CODE.get(code, Internal)


__all__ = ["DsecError", "StateUnavailable", "error_class", *(
    c.__name__ for c in _BY_CODE.values()
)]  # fmt: skip
