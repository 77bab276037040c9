"""Threads for long work a tenant asks for, shared fairly, and stopped when asked.

Walking a sandbox's files (snapshot, fs_diff, publish, prestage) and reclaiming its memory
(pause) take time in proportion to what the tenant put there: up to its inode and memory
limits, seconds. On the event loop's default executor (six threads on two cores) a few such
calls would hold up every other tenant's creates, commands and destroys, which need a thread
for a moment each. :class:`Lanes` runs them on threads of their own, at most one at a time
per tenant, so a tenant can hold one lane, never all of them, nor the default executor.

Lane work can be stopped: each call gets a :class:`Token`, which :meth:`Lanes.cancel` (one
sandbox's work, for its destroy) and :meth:`Lanes.close` (all of it, for the edge's
shutdown) cancel. A thread cannot be stopped from outside, so the work stops itself: the walks
(:mod:`.overlay`, :mod:`.fsdiff`, :mod:`.snapshots`) call :func:`checkpoint` for every entry
and every chunk of data, which raises :class:`Cancelled` once the token of the work this thread
runs is cancelled. The token is found through a context variable, as a cancel scope is in
trio, so a walk needs no token passed down through every call; outside lane work (a test, a
tool) :func:`checkpoint` does nothing, and :func:`cancellable` runs code under a token of
one's own. Work that stops this way unwinds like any failure: what it was making (a snapshot's
``.tmp-*`` directory, a publish's tree) is removed by its own ``finally``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from dsec_kernel.contract import errors
from dsec_kernel.fairshare import TenantSlots

__all__ = ["Cancelled", "Lanes", "Token", "cancellable", "checkpoint"]

T = TypeVar("T")

#: why work stops when the edge closes
CLOSING = "this edge is shutting down; send the request again"
#: why a sandbox's work stops by default when :meth:`Lanes.cancel` is given no reason
GONE = "the sandbox was destroyed while this ran"


class Cancelled(errors.Unavailable):
    """Lane work stopped before it finished (:meth:`Lanes.cancel`, :meth:`Lanes.close`);
    nothing it was making is left. Retryable when the edge closing stopped it, not when its
    sandbox went."""


class Token:
    """Whether one piece of work should stop. :meth:`cancel` may be called from any thread,
    any number of times (the first reason stays)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._why = ""
        self._retryable = True
        self._wake: Callable[[], None] | None = None

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()

    def cancel(self, why: str, retryable: bool = True) -> None:
        if not self._stop.is_set():
            self._why, self._retryable = why, retryable
            self._stop.set()
        if self._wake is not None:
            self._wake()

    def check(self) -> None:
        """Cancelled if :meth:`cancel` was called."""
        if self._stop.is_set():
            raise Cancelled(self._why, retryable=self._retryable)

    def on_cancel(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (from the cancelling thread) when cancelled; at once if already."""
        self._wake = wake
        if self._stop.is_set():
            wake()


_current: ContextVar[Token | None] = ContextVar("dsec_lane_token", default=None)


def checkpoint() -> None:
    """Cancelled if the work running in this thread was cancelled; nothing outside lane work.
    Cheap (a context variable and a flag): call it for every entry and chunk of a walk."""
    token = _current.get()
    if token is not None:
        token.check()


@contextmanager
def cancellable(token: Token) -> Iterator[Token]:
    """Run the block as work ``token`` cancels: :func:`checkpoint` in it checks ``token``."""
    reset = _current.set(token)
    try:
        yield token
    finally:
        _current.reset(reset)


class Lanes:
    """``threads`` threads; one call per tenant at a time, the others wait their turn (the
    tenant running fewest first: :class:`~dsec_kernel.fairshare.TenantSlots`), at most
    ``waiting`` of one tenant's: work goes on when its caller has stopped waiting (the
    apiserver's wait for an edge is bounded), so without a bound a tenant could pile up work
    for hours. Calls may name a ``key`` (the sandbox they are for) by which :meth:`cancel`
    stops them."""

    def __init__(self, threads: int, waiting: int = 16) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dsec-lane")
        self._turns = TenantSlots(threads, 1)
        self.waiting = waiting
        self._lock = threading.Lock()  # (close runs on another thread than the loop)
        self._closed = False
        self._work: dict[Token, str | None] = {}  # calls not ended: their keys
        self._running: dict[Token, Future[Any]] = {}  # those of them given a thread

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any, key: str | None = None) -> T:
        """``fn(*args)`` on a lane once ``tenant`` has none busy. The tenant's turn ends when
        ``fn`` returns, even if the caller stopped waiting for it. QueueFull if ``waiting``
        of its calls wait already; Cancelled if :meth:`cancel` (of ``key``) or :meth:`close`
        stops it, waiting or running."""
        loop = asyncio.get_running_loop()
        queued = sum(not f.done() for _, f in self._turns.waiting.get(tenant, ()))
        if queued >= self.waiting:
            raise errors.QueueFull(
                f"{queued} long operations (snapshots, diffs, publishes) of this tenant wait on "
                "this node already; retry when some are done"
            )
        token = Token()
        with self._lock:
            if self._closed:
                raise Cancelled(CLOSING)
            self._work[token] = key
        try:
            await self._turn(tenant, token)
            try:
                with self._lock:  # (so that close cannot shut the pool between check and submit)
                    token.check()
                    job = self._pool.submit(_call, token, fn, args)
                    self._running[token] = job
            except BaseException:
                self._turns.release(tenant)
                raise
        except BaseException:
            self._forget(token)
            raise

        def ended(_: Future[Any]) -> None:
            self._forget(token)
            loop.call_soon_threadsafe(self._turns.release, tenant)

        job.add_done_callback(ended)
        return await asyncio.wrap_future(job)

    async def _turn(self, tenant: str, token: Token) -> None:
        """Wait for ``tenant``'s turn; Cancelled (the turn not taken) if ``token`` is
        cancelled first."""
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(lambda: woken.done() or woken.set_result(None))
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        token.on_cancel(wake)
        turn = asyncio.ensure_future(self._turns.acquire(tenant))
        try:
            await asyncio.wait((turn, woken), return_when=asyncio.FIRST_COMPLETED)
            token.check()
            turn.result()
        except BaseException:
            # not granted yet: TenantSlots drops the waiter (and gives back a turn granted in
            # the meantime); granted: give it back here
            if not turn.cancel() and not turn.cancelled() and turn.exception() is None:
                self._turns.release(tenant)
            raise
        finally:
            woken.cancel()

    def _forget(self, token: Token) -> None:
        with self._lock:
            self._work.pop(token, None)
            self._running.pop(token, None)

    async def cancel(self, key: str, why: str = GONE) -> None:
        """Stop the calls for ``key``: those waiting never start, those running stop at their
        next :func:`checkpoint`; their callers get Cancelled (not retryable) with ``why``.
        Returns once the running ones have ended (so they hold none of the sandbox's
        descriptors any more). Calls made after this are not affected."""
        with self._lock:  # (a call given a thread after this sees its token cancelled)
            tokens = [t for t, k in self._work.items() if k == key]
            for token in tokens:
                token.cancel(why, retryable=False)
            running = [self._running[t] for t in tokens if t in self._running]
        if running:
            await asyncio.wait([asyncio.wrap_future(f) for f in running])

    def close(self) -> None:
        """Cancel every call, waiting or running (Cancelled, retryable, to their callers),
        wait for the running ones to reach a :func:`checkpoint` and end, stop the threads.
        Calls made after this are Cancelled at once."""
        with self._lock:  # (so no call is given a thread once the pool is shut)
            self._closed = True
            for token in self._work:
                token.cancel(CLOSING)
        self._pool.shutdown(wait=True)


def _call(token: Token, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    with cancellable(token):
        token.check()  # cancelled while it waited for a thread
        return fn(*args)
