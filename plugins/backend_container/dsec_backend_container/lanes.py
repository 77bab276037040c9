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

from dsec_kernel.fairshare import TenantSlots

__all__ = ["Lanes"]

T = TypeVar("T")


class Lanes:
    """``threads`` threads; one call per tenant at a time, the others wait their turn (the
    tenant running fewest first: :class:`~dsec_kernel.fairshare.TenantSlots`)."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dsec-lane")
        self._turns = TenantSlots(threads, 1)

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a lane once ``tenant`` has none busy. The tenant's turn ends when
        ``fn`` returns, even if the caller stopped waiting for it."""
        loop = asyncio.get_running_loop()
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
