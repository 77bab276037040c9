"""Threads for long work a tenant asks for, shared fairly.

Walking a sandbox's files (snapshot, fs_diff, publish, prestage) and reclaiming its memory
(pause) take time in proportion to what the tenant put there: up to its inode and memory
limits, seconds. On the event loop's default executor (six threads on two cores) a few such
calls would hold up every other tenant's creates, commands and destroys, which need a thread
for a moment each. :class:`Lanes` runs them on threads of their own, at most one at a time
per tenant, so a tenant can hold one lane, never all of them, nor the default executor.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from dsec_kernel import errors
from dsec_kernel.fairshare import TenantSlots

__all__ = ["Lanes"]

T = TypeVar("T")


class Lanes:
    """``threads`` threads; one call per tenant at a time, the others wait their turn (the
    tenant running fewest first: :class:`~dsec_kernel.fairshare.TenantSlots`), at most
    ``waiting`` of one tenant's: work goes on when its caller has stopped waiting (the
    apiserver's wait for an edge is bounded), so without a bound a tenant could pile up work
    for hours."""

    def __init__(self, threads: int, waiting: int = 16) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dsec-lane")
        self._turns = TenantSlots(threads, 1)
        self.waiting = waiting

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a lane once ``tenant`` has none busy. The tenant's turn ends when
        ``fn`` returns, even if the caller stopped waiting for it. QueueFull if ``waiting``
        of its calls wait already."""
        loop = asyncio.get_running_loop()
        queued = sum(not f.done() for _, f in self._turns.waiting.get(tenant, ()))
        if queued >= self.waiting:
            raise errors.QueueFull(
                f"{queued} long operations (snapshots, diffs, publishes) of this tenant wait on "
                "this node already; retry when some are done"
            )
        await self._turns.acquire(tenant)
        try:
            job: Future[T] = self._pool.submit(functools.partial(fn, *args))
        except BaseException:
            self._turns.release(tenant)
            raise
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._turns.release, tenant))
        return await asyncio.wrap_future(job)

    def close(self) -> None:
        """Wait for the calls running, then stop the threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)
