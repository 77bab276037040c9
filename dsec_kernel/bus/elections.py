"""Waiting out the cluster's elections: a request whose work finds the cluster's state without
a leader is worked again until its caller stops waiting.

A NATS server lost takes its streams' leaders with it for the 4-9 s nats-server's raft needs
to elect others. Every request is safe to repeat (the SDK resends them too: creates and
commands by request id, the rest reads or idempotent).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.micro import Request

from dsec_kernel import deadline
from dsec_kernel.contract import errors

__all__ = ["ELECTION_WAIT_S", "STATE_DOWN", "through_elections"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a JetStream call raises while the stream it needs has no leader (lost with a server,
# being elected) or the cluster no quorum.
STATE_DOWN = (
    errors.StateUnavailable,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
)
ELECTION_WAIT_S = 30.0  # how long a request that said no deadline waits for the state


async def through_elections(
    work: Callable[[Request, str], Awaitable[T]], req: Request, caller: str
) -> T:
    """``work(req, caller)``, run again while the cluster's state does not answer, until the
    request's caller stops waiting (less :data:`~dsec_kernel.deadline.MARGIN_S` to answer;
    :data:`ELECTION_WAIT_S` if it did not say). Then Unavailable."""
    left = deadline.time_left()
    until = time.monotonic() + (ELECTION_WAIT_S if left is None else left) - deadline.MARGIN_S
    pause = 0.1
    while True:
        try:
            return await work(req, caller)
        except STATE_DOWN as exc:
            if time.monotonic() + pause > until:
                log.warning("%s: the cluster's state did not answer in time: %r", req.subject, exc)
                raise errors.Unavailable(
                    "the cluster's state store (JetStream) did not answer in time: a NATS "
                    "server lost? It elects new leaders within ~10 s; retry"
                ) from None
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 2)
