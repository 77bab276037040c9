"""Call slots shared fairly between tenants.

``TenantSlots(total, per_tenant)``: at most ``total`` calls run at once, at most
``per_tenant`` of them one tenant's. Calls beyond that wait; a freed slot goes to the waiting
tenant that runs the fewest calls (the earliest waiter among equals). So

* one tenant holding slots with long calls never makes another wait for them: it cannot
  hold more than ``per_tenant``, the rest stay free for the others;
* a tenant with thousands of calls queued does not delay one with a single call: the
  single call's tenant runs fewer, so it is served first;
* a tenant alone still uses ``per_tenant`` slots, and a batch larger than that queues
  (cancelled waiters leave the queue);
* a tenant's queue holds at most ``waiting`` calls (more are refused at once, QueueFull),
  and a call waits at most the ``timeout`` it is given (then DeadlineExceeded): calls whose
  callers have given up do not pile up behind slow ones.

Written here rather than taken from a library: it is ~60 lines on asyncio futures, and the
policy (max-min share with a per-tenant cap) is what the tests pin down.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dsec_kernel.contract import errors

__all__ = ["TenantSlots"]


class TenantSlots:
    """``total`` slots; a tenant holds at most ``per_tenant`` of them at once, and has at
    most ``waiting`` calls waiting (None: no bound)."""

    def __init__(self, total: int, per_tenant: int, waiting: int | None = None) -> None:
        if not 1 <= per_tenant <= total:
            raise ValueError(f"per_tenant must be between 1 and {total}")
        self.total = total
        self.per_tenant = per_tenant
        self.max_waiting = waiting
        self.used = 0
        self.running: Counter[str] = Counter()
        self.waiting: dict[str, deque[tuple[int, asyncio.Future[None]]]] = {}
        self._arrival = itertools.count()

    @asynccontextmanager
    async def hold(self, tenant: str, timeout: float | None = None) -> AsyncIterator[None]:
        """A slot for one of ``tenant``'s calls, for the duration of the block."""
        await self.acquire(tenant, timeout)
        try:
            yield
        finally:
            self.release(tenant)

    async def acquire(self, tenant: str, timeout: float | None = None) -> None:
        """Take a slot, waiting at most ``timeout`` seconds (None: as long as it takes)."""
        if self.used < self.total and self.running[tenant] < self.per_tenant:
            self._take(tenant)  # (a waiter that could run would have been granted already)
            return
        queue = self.waiting.setdefault(tenant, deque())
        if self.max_waiting is not None:
            queued = sum(not f.done() for _, f in queue)
            if queued >= self.max_waiting:
                raise errors.QueueFull(
                    f"{queued} of this tenant's calls are waiting here, the most that may; "
                    "wait for some to finish"
                )
        fut = asyncio.get_running_loop().create_future()
        queue.append((next(self._arrival), fut))
        try:
            await asyncio.wait_for(fut, timeout)  # (on a timeout, fut is cancelled)
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"waited {timeout:.1f}s for a turn here, as long as the caller waits"
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: give it back
                self.release(tenant)
            raise  # (a cancelled waiter is dropped when it reaches the head of its queue)

    def _take(self, tenant: str) -> None:
        self.used += 1
        self.running[tenant] += 1

    def release(self, tenant: str) -> None:
        self.used -= 1
        self.running[tenant] -= 1
        if not self.running[tenant]:
            del self.running[tenant]
        self._grant()

    def _grant(self) -> None:
        """Give free slots to waiters: the tenant running fewest first, then the earliest."""
        while self.used < self.total:
            best = None
            for tenant, queue in list(self.waiting.items()):
                while queue and queue[0][1].done():  # cancelled
                    queue.popleft()
                if not queue:
                    del self.waiting[tenant]
                elif self.running[tenant] < self.per_tenant:
                    key = (self.running[tenant], queue[0][0])
                    if best is None or key < best[0]:
                        best = (key, tenant)
            if best is None:
                return
            tenant = best[1]
            _, fut = self.waiting[tenant].popleft()
            self._take(tenant)
            fut.set_result(None)
