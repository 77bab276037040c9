"""Requests that survive losing the NATS server their answer was to come through.

A request reaches a service through whichever server holds the service's connection; a
server killed at that moment takes the request with it, and the caller would wait for its
whole timeout (a minute for a create) for an answer that cannot come. So services say they
are still working on a request (:class:`KeepAlive`: an empty message with
``Dsec-Status: working`` to its reply subject every :data:`WORKING_EVERY_S`), and a caller
that hears nothing at all for :data:`SILENCE_S` sends the request again. Every DSec request
is safe to repeat (creates and commands by request id, the rest reads or idempotent), and
whichever copy answers first is the answer.

nats-py's own ``request`` takes only the first message on a reply subject, so replies come
through one wildcard subscription per connection on a private inbox (:class:`Replies`),
sorted to their waiters by token.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

__all__ = [
    "SILENCE_S",
    "STATUS_HEADER",
    "TIMEOUT_HEADER",
    "WORKING_EVERY_S",
    "KeepAlive",
    "Replies",
    "replies_of",
    "request",
]

STATUS_HEADER = "Dsec-Status"
TIMEOUT_HEADER = "Dsec-Timeout"  # how long the caller waits, in seconds (dsec_kernel.deadline)
WORKING_EVERY_S = 1.0
SILENCE_S = 5.0  # five beats missed: the request (or its service's connection) is gone
_NO_RESPONDERS = "503"  # the status nats-server answers with when nothing subscribes


class Replies:
    """Replies to one connection's requests: ``<inbox>.<n>`` for request ``n``."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.waiting: dict[str, asyncio.Queue[Msg]] = {}
        self._tokens = itertools.count()

    async def start(self) -> Replies:
        await self.nc.subscribe(f"{self.prefix}.*", cb=self._sort)
        return self

    async def _sort(self, msg: Msg) -> None:
        queue = self.waiting.get(msg.subject[len(self.prefix) + 1 :])
        if queue is not None:  # (else an answer to a copy, after the first one's)
            queue.put_nowait(msg)

    async def ask(self, subject: str, data: bytes, timeout: float, headers: dict[str, str]) -> Msg:
        """The answer to ``data`` on ``subject``, sent again after :data:`SILENCE_S` without
        a word (``headers[Dsec-Timeout]`` says the time left). nats-py's TimeoutError if no
        answer within ``timeout``, NoRespondersError if nothing serves ``subject``."""
        token = str(next(self._tokens))
        reply = f"{self.prefix}.{token}"
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self.waiting[token] = queue
        deadline = time.monotonic() + timeout
        try:
            await self.nc.publish(subject, data, reply=reply, headers=headers)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise nats.errors.TimeoutError
                try:
                    msg = await asyncio.wait_for(queue.get(), min(left, SILENCE_S))
                except TimeoutError:
                    if deadline - time.monotonic() > 0.1:
                        again = {**headers, TIMEOUT_HEADER: f"{deadline - time.monotonic():.3f}"}
                        await self.nc.publish(subject, data, reply=reply, headers=again)
                    continue
                status = (msg.headers or {}).get
                if status(STATUS_HEADER) == "working":
                    continue
                if status("Status") == _NO_RESPONDERS and not msg.data:
                    raise nats.errors.NoRespondersError
                return msg
        finally:
            del self.waiting[token]


_REPLIES: weakref.WeakKeyDictionary[NATS, asyncio.Future[Replies]] = weakref.WeakKeyDictionary()


async def replies_of(nc: NATS) -> Replies:
    """``nc``'s :class:`Replies` (subscribed at the first call)."""
    made = _REPLIES.get(nc)
    if made is None:
        made = _REPLIES[nc] = asyncio.ensure_future(Replies(nc).start())
    try:
        return await asyncio.shield(made)
    except BaseException:
        if made.done():  # its subscription failed (connection closing?): the next one tries
            _REPLIES.pop(nc, None)
        raise


async def request(
    nc: NATS, subject: str, data: bytes, *, timeout: float, headers: dict[str, str]
) -> Msg:
    """:meth:`Replies.ask` on ``nc``'s replies."""
    return await (await replies_of(nc)).ask(subject, data, timeout, headers)


class KeepAlive:
    """Tells ``reply`` every :data:`WORKING_EVERY_S` that its request is being worked on,
    until :meth:`cancel` (call it before the answer is sent)."""

    def __init__(self, nc: NATS, reply: str) -> None:
        self.nc = nc
        self.reply = reply
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        if reply:  # (a request sent with no reply subject is told nothing)
            self._handle = self._loop.call_later(WORKING_EVERY_S, self._beat)
        self._sending: set[asyncio.Task[None]] = set()

    def _beat(self) -> None:
        self._handle = self._loop.call_later(WORKING_EVERY_S, self._beat)
        task = self._loop.create_task(self._send())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self) -> None:
        try:
            await self.nc.publish(self.reply, b"", headers={STATUS_HEADER: "working"})
        except nats.errors.Error:
            pass  # the connection is going: the caller will ask again

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
