"""Admission control: quotas, a bounded queue per tenant, and priorities.

Every create passes here before placement. It is checked against the tenant's quota
(sandboxes, CPU, memory: KV ``dsec-quotas``), then admitted if the cluster has room for all
of it now — room is what placement sees free on nodes that are up (paused sandboxes do not
count), less what was admitted and is still being created. Otherwise it waits in its
backend's queue, ordered by its job's priority and then by arrival, for up to its
``wait_s``; a tenant's queued sandboxes are bounded (``queue_per_tenant``), past which it is
refused with QueueFull at once. Every request is answered: created, or a typed error.

When the request at the head of a queue has a higher priority than running sandboxes of
other jobs, those are paused (reason ``priority``; state kept, memory reclaimed) to make
room, sparing any within ``protect_s`` of its end. Priority-paused sandboxes are resumed,
highest priority first, when the queue is empty and room is back.

A tenant chooses its jobs' priorities, so between tenants what counts is a job's *standing*:
its priority, but no higher than the tenant's ceiling (its quota's ``max_priority``, else
``priority_ceiling``: 0 unless the operator grants more). Queues are ordered by standing,
then arrival; a tenant's sandbox is paused for another tenant's request only if that
request stands higher. Within a tenant, priorities order its own work as asked.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from dsec_kernel.apiserver.edges import Power
from dsec_kernel.apiserver.leases import JobLookup
from dsec_kernel.apiserver.registry import Registry
from dsec_kernel.config import ApiSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.placement import NodeView
from dsec_kernel.contract.wire import Quota, SandboxInfo, SandboxSpec
from dsec_kernel.state.buckets import QUOTAS
from dsec_kernel.state.facade import ClusterState

__all__ = ["Admission", "Admitted"]

log = logging.getLogger(__name__)


class Admitted:
    """Room held for an admitted create: ``waited`` seconds in the queue, at ``position`` on
    arrival. ``placed()`` (idempotent) gives the room back to the admission count."""

    def __init__(self, waited: float, position: int, release: Callable[[], None]) -> None:
        self.waited = waited
        self.position = position
        self._release: Callable[[], None] | None = release

    def placed(self) -> None:
        if self._release is not None:
            self._release, release = None, self._release
            release()


@dataclass(order=True)
class _Waiter:
    order: tuple[int, int]  # (-standing, arrival)
    tenant: str = field(compare=False)
    count: int = field(compare=False)
    priority: int = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    preempted_at: float = field(default=0.0, compare=False)


class Admission:
    """The apiserver's admission control; see the module docstring."""

    def __init__(
        self,
        settings: ApiSettings,
        state: ClusterState,
        views: dict[str, NodeView],
        registry: Registry,
        job: JobLookup,
        power: Power,
    ) -> None:
        """``views`` are the node views (read only), ``job`` looks a job up (its priority),
        ``power`` pauses and resumes sandboxes (preemption)."""
        self.settings = settings
        self.views = views
        self.registry = registry
        self.job = job
        self.power = power
        self.queues: dict[str, list[_Waiter]] = defaultdict(list)  # backend -> heap
        self.queued: Counter[str] = Counter()  # tenant -> sandboxes waiting
        self.reserved: Counter[str] = Counter()  # backend -> admitted, being created
        self.quotas = state.mirror(QUOTAS, Quota.model_validate_json)
        self._arrivals = itertools.count()
        self._usage: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        self._charged: dict[str, tuple[str, float, float]] = {}  # id -> (tenant, cpus, mb)
        self._pending: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        self._tasks: set[asyncio.Task[object]] = set()
        self._priority_paused: set[str] = set()  # ids paused to make room (see rebalance)

    # -- quotas ------------------------------------------------------------------------------

    def standing(self, tenant: str, priority: int) -> int:
        """What ``priority`` counts for against other tenants' work (module docstring)."""
        quota = self.quotas.get(tenant)
        ceiling = quota.max_priority if quota and quota.max_priority is not None else None
        return min(priority, self.settings.priority_ceiling if ceiling is None else ceiling)

    def charge(self, spec: SandboxSpec | None) -> tuple[float, float]:
        """(CPUs, MiB) a sandbox of ``spec`` counts against its tenant's quota."""
        limits = spec.limits if spec else None
        cpus = (limits.cpus if limits else None) or self.settings.quota_default_cpus
        mb = (limits.memory_mb if limits else None) or self.settings.quota_default_memory_mb
        return cpus, float(mb)

    def indexed(self, sandbox_id: str, info: SandboxInfo | None) -> None:
        """Keep each tenant's usage, and the set of priority-paused sandboxes, in step with
        the sandboxes mirror."""
        if info is not None and info.state == "paused" and info.paused_reason == "priority":
            self._priority_paused.add(sandbox_id)
        else:
            self._priority_paused.discard(sandbox_id)
        if info is not None and info.state != "lost":
            if sandbox_id not in self._charged:
                cpus, mb = self.charge(info.spec)
                self._charged[sandbox_id] = (info.tenant, cpus, mb)
                _add(self._usage[info.tenant], 1, cpus, mb)
            return
        old = self._charged.pop(sandbox_id, None)
        if old is not None:
            _add(self._usage[old[0]], -1, -old[1], -old[2])

    def quota_room(self, tenant: str, spec: SandboxSpec) -> int | None:
        """How many more sandboxes of ``spec`` the tenant's quota allows (None: no limit)."""
        quota = self.quotas.get(tenant)
        if quota is None:
            return None
        cpus, mb = self.charge(spec)
        used = [a + b for a, b in zip(self._usage[tenant], self._pending[tenant], strict=True)]
        room = [
            (limit - have) // each
            for have, each, limit in ((used[0], 1, quota.sandboxes), (used[1], cpus, quota.cpus),
                                      (used[2], mb, quota.memory_mb))
            if limit is not None
        ]  # fmt: skip
        return max(0, int(min(room))) if room else None

    def quota_fit(
        self, tenant: str, spec: SandboxSpec, count: int
    ) -> tuple[int, errors.QuotaExceeded | None]:
        """How many of ``count`` sandboxes of ``spec`` the tenant's quota admits now, and
        the error the others meet (None: all fit)."""
        try:
            self._check_quota(tenant, spec, count)
        except errors.QuotaExceeded as exc:
            return min(self.quota_room(tenant, spec) or 0, count - 1), exc
        return count, None

    def _check_quota(self, tenant: str, spec: SandboxSpec, count: int) -> tuple[float, float]:
        cpus, mb = self.charge(spec)
        quota = self.quotas.get(tenant)
        if quota is None:
            return cpus, mb
        used = [a + b for a, b in zip(self._usage[tenant], self._pending[tenant], strict=True)]
        for what, have, add, limit in (
            ("sandboxes", used[0], count, quota.sandboxes),
            ("CPUs", used[1], cpus * count, quota.cpus),
            ("MiB of memory", used[2], mb * count, quota.memory_mb),
        ):
            if limit is not None and have + add > limit:
                raise errors.QuotaExceeded(
                    f"tenant {tenant}: {have:g} {what} in use plus {add:g} asked for is over "
                    f"its quota of {limit:g}; destroy sandboxes or ask for a larger quota"
                )
        return cpus, mb

    # -- the queue ---------------------------------------------------------------------------

    def free(self, backend: str) -> int:
        up = (v for v in self.views.values() if v.info.serving)
        return sum(v.free(backend) for v in up) - self.reserved[backend]

    @asynccontextmanager
    async def admitted(
        self, tenant: str, spec: SandboxSpec, count: int, wait_s: float, priority: int
    ) -> AsyncIterator[Admitted]:
        """Hold room for ``count`` sandboxes of ``spec`` while the block creates them, until
        it calls ``placed()`` (placement then counts them on their nodes)."""
        backend = spec.backend
        cpus, mb = self._check_quota(tenant, spec, count)
        pending = (count, cpus * count, mb * count)
        _add(self._pending[tenant], *pending)
        try:
            waited, position = await self._wait(tenant, backend, count, wait_s, priority)
            held = Admitted(waited, position, lambda: self._unreserve(backend, count))
            try:
                yield held
            finally:
                held.placed()
        finally:
            _add(self._pending[tenant], *(-x for x in pending))

    def _unreserve(self, backend: str, count: int) -> None:
        self.reserved[backend] -= count
        self.pump(backend)

    async def _wait(
        self, tenant: str, backend: str, count: int, wait_s: float, priority: int
    ) -> tuple[float, int]:
        queue = self.queues[backend]
        up = [v for v in self.views.values() if v.info.serving]
        if count > sum(v.capacity(backend) for v in up):
            raise errors.CapacityExceeded(
                f"{count} {backend} sandboxes at once is more than the nodes up can ever hold "
                f"({sum(v.capacity(backend) for v in up)}); ask for fewer or add nodes"
            )
        if not any(not w.future.done() for w in queue) and self.free(backend) >= count:
            self.reserved[backend] += count
            return 0.0, 0
        limit = self.settings.queue_per_tenant
        if self.queued[tenant] + count > limit:
            raise errors.QueueFull(
                f"tenant {tenant} has {self.queued[tenant]} sandboxes waiting for room (at most "
                f"{limit}); retry when some are created, or ask for fewer at once"
            )
        waiter = _Waiter(
            (-self.standing(tenant, priority), next(self._arrivals)), tenant, count, priority,
            asyncio.get_running_loop().create_future(),
        )  # fmt: skip
        heapq.heappush(queue, waiter)
        position = sum(1 for w in queue if not w.future.done())
        self.queued[tenant] += count
        started = time.monotonic()
        try:
            self.pump(backend)
            await asyncio.wait_for(asyncio.shield(waiter.future), wait_s)
        except TimeoutError:
            if waiter.future.done():  # admitted as the wait ran out: take it
                return time.monotonic() - started, position
            waiter.future.cancel()
            free = max(0, self.free(backend))
            raise errors.CapacityExceeded(
                f"no room for {count} {backend} sandboxes after {wait_s:g} s in the queue "
                f"(position {position} on arrival; {free} free now); retry later or add nodes"
            ) from None
        finally:
            self.queued[tenant] -= count
        return time.monotonic() - started, position

    def pump(self, backend: str | None = None) -> None:
        """Admit from the heads of the queues while they fit; preempt for a head that does
        not. Called whenever room may have changed (heartbeats, creates, destroys)."""
        for name in [backend] if backend else list(self.queues):
            queue = self.queues.get(name, [])
            while queue:
                head = queue[0]
                if head.future.done():
                    heapq.heappop(queue)
                    continue
                if self.free(name) < head.count:
                    self._preempt(name, head)
                    break
                heapq.heappop(queue)
                self.reserved[name] += head.count
                head.future.set_result(None)

    # -- priorities --------------------------------------------------------------------------

    def _preempt(self, backend: str, head: _Waiter) -> None:
        """Pause lower-priority running sandboxes so that ``head`` fits (at most every 2 s
        per request: the pauses show in the next heartbeats)."""
        now = time.monotonic()
        if head.priority <= 0 or now - head.preempted_at < 2.0:
            return
        head.preempted_at = now
        need = head.count - max(0, self.free(backend))
        victims = self._victims(backend, head.tenant, head.priority)[:need]
        if not victims:
            return
        log.info(
            "pausing %d sandbox(es) of lower priority for a priority-%d request",
            len(victims), head.priority,
        )  # fmt: skip
        task = asyncio.ensure_future(self.power("pause", victims, "priority"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _victims(self, backend: str, tenant: str, priority: int) -> list[SandboxInfo]:
        """Running sandboxes a request of ``tenant`` at ``priority`` may pause: its own jobs'
        below ``priority``, other tenants' standing below its standing; lowest first, sparing
        those near their end."""
        end = time.time() + self.settings.protect_s
        standing = self.standing(tenant, priority)
        found: list[tuple[int, float, SandboxInfo]] = []
        for info, _ in self.registry.items.values():
            if info.state != "ready" or info.backend != backend or not info.job or info.in_pool:
                continue
            if info.expires_at is not None and info.expires_at < end:
                continue
            job = self.job(info.tenant, info.job)
            p = job.priority if job else 0
            if info.tenant == tenant and p < priority:
                found.append((p, -info.created_at, info))
            elif info.tenant != tenant and (s := self.standing(info.tenant, p)) < standing:
                found.append((s, -info.created_at, info))
        found.sort(key=lambda x: (x[0], x[1]))
        return [info for _, _, info in found]

    async def rebalance(self) -> None:
        """Resume priority-paused sandboxes, highest priority first, where room is back and
        nothing waits."""
        if not self._priority_paused:
            return
        waiting = {b for b, q in self.queues.items() if any(not w.future.done() for w in q)}
        paused: dict[str, list[tuple[int, SandboxInfo]]] = defaultdict(list)
        for sid in list(self._priority_paused):
            hit = self.registry.items.get(sid)
            if hit is not None:
                info = hit[0]
                job = self.job(info.tenant, info.job) if info.job else None
                p = self.standing(info.tenant, job.priority if job else 0)
                paused[info.backend].append((p, info))
        for backend, items in paused.items():
            room = self.free(backend)
            if backend in waiting or room <= 0:
                continue
            items.sort(key=lambda x: -x[0])
            await self.power("resume", [info for _, info in items[:room]], "priority")


def _add(acc: list[float], n: float, cpus: float, mb: float) -> None:
    acc[0] += n
    acc[1] += cpus
    acc[2] += mb
