"""The one deadline along a request's path (standard library only).

A caller says how long it waits (the ``Dsec-Timeout`` header); the service handling the
request sets :func:`start` from it, and every call it makes on that request's behalf — to
another service over NATS, to a sandbox's agent — waits at most :func:`inner` seconds: a
little less than its own caller does, so the innermost gives up first and its error reaches
the outermost while that one still listens.
"""

from __future__ import annotations

import contextvars
import time
from typing import overload

__all__ = ["MARGIN_S", "inner", "start", "time_left"]

MARGIN_S = 1.0  # what each layer keeps back to answer its caller after an inner call failed

_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("deadline", default=None)


def start(waits: float) -> None:
    """The request being handled (this task and those it starts) is waited for ``waits``
    seconds from now."""
    _deadline.set(time.monotonic() + waits)


def time_left() -> float | None:
    """Seconds until the caller of the request being handled stops waiting for its reply (at
    least 0), or None when no caller said (or no request is being handled)."""
    deadline = _deadline.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())


@overload
def inner(wanted: float) -> float: ...
@overload
def inner(wanted: None) -> float | None: ...


def inner(wanted: float | None) -> float | None:
    """How long a call or wait made while handling a request may take: ``wanted`` (None: as
    long as it takes), cut to :data:`MARGIN_S` less than the request's caller waits (never
    below a tenth of a second: a call that cannot be waited for fails fast instead of not
    being made)."""
    left = time_left()
    if left is None:
        return wanted
    cut = max(0.1, left - MARGIN_S)
    return cut if wanted is None else max(0.1, min(wanted, cut))
