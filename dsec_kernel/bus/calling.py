"""Calling a service: a request whose reply is parsed, or raised as the typed error it
carries.

Every request says how long its caller waits (the ``Dsec-Timeout`` header), and is sent
again if the service goes silent (:mod:`dsec_kernel.bus.replies`). A request made while
handling another waits less than that one's caller does (:func:`dsec_kernel.deadline.inner`):
the innermost call along a path gives up first.
"""

from __future__ import annotations

from typing import TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.micro.request import ERROR_CODE_HEADER
from pydantic import BaseModel, ValidationError

from dsec_kernel import deadline
from dsec_kernel.bus import replies
from dsec_kernel.bus.error_replies import raise_error_reply, validation_message
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import Message

__all__ = ["NoResponders", "request", "request_raw"]

M = TypeVar("M", bound=BaseModel)


class NoResponders(errors.Unavailable):
    """Nothing subscribes to the subject (a service is down, or starting: for a few
    milliseconds after a service has subscribed, a request may still find none)."""


async def request(
    nc: NATS,
    subject: str,
    payload: Message | bytes,
    reply: type[M],
    *,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> M:
    """Send a request and parse the reply as ``reply``, raising typed errors.

    NATS "no responders" becomes Unavailable, no reply in time DeadlineExceeded.
    """
    data = payload if isinstance(payload, bytes) else payload.model_dump_json().encode()
    msg = await request_raw(nc, subject, data, timeout=timeout, headers=headers)
    try:
        return reply.model_validate_json(msg)
    except ValidationError as exc:
        raise errors.Internal(f"malformed reply on {subject}: {validation_message(exc)}") from None


async def request_raw(
    nc: NATS,
    subject: str,
    data: bytes,
    *,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> bytes:
    """Like :func:`request`, returning the reply body unparsed (errors still raised)."""
    timeout = deadline.inner(timeout)
    headers = {**(headers or {}), replies.TIMEOUT_HEADER: f"{timeout:.3f}"}
    try:
        msg = await replies.request(nc, subject, data, timeout=timeout, headers=headers)
    except nats.errors.NoRespondersError:
        hint = (
            "; is `dsec up` (or `dsec apiserver`) running against this NATS?"
            if subject.startswith("dsec.api.")
            else ""
        )
        raise NoResponders(f"nothing is serving {subject}{hint}") from None
    except nats.errors.TimeoutError:
        raise errors.DeadlineExceeded(f"no reply on {subject} within {timeout:.1f}s") from None
    except nats.errors.ConnectionClosedError:
        raise errors.Unavailable("the NATS connection is closed") from None
    if msg.headers and ERROR_CODE_HEADER in msg.headers:
        raise_error_reply(msg.data)
    return msg.data
