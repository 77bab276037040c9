"""An edge's heartbeat, sent from a thread of its own.

A node whose heartbeats stop is marked down and its sandboxes lost, then destroyed, so the
heartbeat must say whether the *process* lives, not whether its event loop is quick: tenants'
work runs on that loop, and a flood of it once held the loop past the node timeout, which
cost every tenant on the node its sandboxes. :class:`Heartbeat` therefore runs its own event
loop and NATS connection in a thread, and writes the node's record every interval: the last
one the edge gave it (:meth:`Heartbeat.update`, each edge heartbeat), with ``alive_at`` set
to now. The record's counts are as of its ``heartbeat_at`` (the edge's clock when it made
it), which is what placement compares with; liveness is ``alive_at``.

A loop that gives it nothing for :data:`STALLED_S` is taken for hung (a deadlock, not a
flood), and the thread stops saying the node lives, so it is marked down as if it had died.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

import nats.errors
from nats.aio.client import Client as NATS

from dsec_kernel import bus
from dsec_kernel.contract import errors
from dsec_kernel.contract.wire import NodeInfo
from dsec_kernel.state.facade import ClusterState

__all__ = ["Heartbeat"]

log = logging.getLogger(__name__)

STALLED_S = 120.0


class Heartbeat:
    """Writes ``latest`` every ``interval`` seconds from its own thread, on a connection
    ``connect()`` makes there."""

    def __init__(
        self, connect: Callable[[], Awaitable[NATS]], interval: float, first: NodeInfo
    ) -> None:
        self.connect = connect
        self.interval = interval
        self.latest = first  # replaced whole by the edge's loop (an atomic assignment)
        self._updated = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="dsec-heartbeat", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start the thread; return once it has written the first record (Unavailable if it
        could not within ``timeout``)."""
        self._thread.start()
        if not self._ready.wait(timeout) or self._failed is not None:
            self.stop()
            raise errors.Unavailable(f"the heartbeat could not start: {self._failed!r}")

    def update(self, info: NodeInfo) -> None:
        self.latest = info
        self._updated = time.monotonic()

    def stop(self, last: NodeInfo | None = None) -> None:
        """Write ``last`` (if given) as the final record, then end the thread (no-op once
        ended)."""
        if not self._thread.is_alive():
            return
        if last is not None:
            self.latest = last
        if self._loop is not None and self._stop is not None:
            with suppress(RuntimeError):  # its loop closed meanwhile
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._beat())
        except BaseException as exc:  # (the edge's start reports it)
            self._failed = exc
            self._ready.set()
        finally:
            loop.close()

    async def _beat(self) -> None:
        self._stop = asyncio.Event()
        nc = await self.connect()
        try:
            state = await ClusterState.open(nc, create=False)
            while True:
                last = self._stop.is_set()  # set before this write: it writes the last record
                if last or time.monotonic() - self._updated < STALLED_S:
                    await self._write(state)
                else:
                    log.error("the edge's loop gave nothing for %.0fs: not heartbeating", STALLED_S)
                self._ready.set()
                if last:
                    return
                try:
                    await asyncio.wait_for(self._stop.wait(), self.interval)
                except TimeoutError:
                    pass
        finally:
            await bus.disconnect(nc)

    async def _write(self, state: ClusterState) -> None:
        info = self.latest.model_copy(update={"alive_at": time.time()})
        try:
            await asyncio.wait_for(state.put_node(info), max(self.interval, 1.0))
        except (TimeoutError, errors.DsecError, nats.errors.Error) as exc:
            log.warning("heartbeat not written: %r", exc)
