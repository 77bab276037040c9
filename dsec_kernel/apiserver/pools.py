"""Warm pools, served by the apiserver: ``dsec.api.v1.pool.{open,acquire,release,close}``.

A pool (KV ``dsec-pools``) names a spec and a size. Its sandboxes are ordinary sandboxes of
the tenant with ``pool`` set; those waiting to be acquired also have ``in_pool``. Acquiring
flips ``in_pool`` off by compare-and-set (two callers never get the same sandbox); an acquire
that finds too few makes the rest at once and counts as demand: the pool's target rises by
the misses of the last minute, up to ``max_size``. Releasing resets a sandbox to its clean
state and puts it back. Every apiserver refills; a compare-and-set on the pool's record
lets one of them do it at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from contextlib import suppress

from dsec_kernel import bus
from dsec_kernel.apiserver.edges import Edges
from dsec_kernel.apiserver.registry import Registry
from dsec_kernel.apiserver.specs import Specs
from dsec_kernel.config import ApiSettings
from dsec_kernel.contract import errors
from dsec_kernel.contract.placement import NodeView
from dsec_kernel.contract.wire import (
    AcquireRequest,
    AcquireResponse,
    CreateRequest,
    CreateResponse,
    DestroyResponse,
    PoolCloseRequest,
    PoolInfo,
    PoolOpenRequest,
    ReleaseRequest,
    RestoreRequest,
    SandboxInfo,
    SandboxSpec,
)
from dsec_kernel.state.buckets import LIVE, POOLS
from dsec_kernel.state.facade import ClusterState

__all__ = ["Create", "Pools"]

log = logging.getLogger(__name__)

#: seconds an acquire that found the pool empty counts as demand
DEMAND_WINDOW_S = 60.0
#: most sandboxes one refill round makes for one pool
FILL_STEP = 100

#: ``create(tenant, request, pool=, in_pool=)``: every create's way in, through admission
Create = Callable[..., Awaitable[CreateResponse]]


class Pools:
    """The apiserver's part in warm pools: its handlers and its periodic :meth:`refill`."""

    def __init__(
        self,
        settings: ApiSettings,
        state: ClusterState,
        registry: Registry,
        views: dict[str, NodeView],
        specs: Specs,
        create: Create,
        destroy_all: Callable[[list[SandboxInfo]], Awaitable[list[str]]],
        quota_room: Callable[[str, SandboxSpec], int | None],
        edges: Edges,
    ) -> None:
        """``views`` are the node views (read only); ``quota_room(tenant, spec)`` how many
        more sandboxes a tenant's quota allows (None: no limit)."""
        self.settings = settings
        self.state = state
        self.registry = registry
        self.views = views
        self.specs = specs
        self.create = create
        self.destroy_all = destroy_all
        self.quota_room = quota_room
        self.edges = edges
        self.pools = state.mirror(POOLS, PoolInfo.model_validate_json)
        self._misses: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._fills: dict[str, asyncio.Task[None]] = {}  # pool key -> its refill now
        self._members: dict[str, set[str]] = defaultdict(set)  # pool key -> idle sandbox ids
        self._member_of: dict[str, str] = {}  # sandbox id -> pool key

    def indexed(self, sandbox_id: str, info: SandboxInfo | None) -> None:
        """Keep the index of idle pool members in step with the sandboxes mirror."""
        old = self._member_of.pop(sandbox_id, None)
        if old is not None:
            self._members[old].discard(sandbox_id)
        if info is not None and info.in_pool and info.pool:
            key = _key(info.tenant, info.pool)
            self._members[key].add(sandbox_id)
            self._member_of[sandbox_id] = key

    # -- handlers ----------------------------------------------------------------------------

    async def open(self, r: PoolOpenRequest, call: bus.Call) -> PoolInfo:
        tenant = call.tenant
        r.spec = self.specs.with_backend(r.spec)
        self.specs.check(tenant, r.spec)
        await self.specs.check_layers(tenant, r.spec)
        old = self._pool(tenant, r.name)
        info = PoolInfo(
            name=r.name, tenant=tenant, spec=r.spec, size=r.size,
            max_size=r.max_size if r.max_size is not None else 4 * r.size,
            created_at=old.created_at if old else time.time(),
        )  # fmt: skip
        if info.max_size < info.size:
            raise errors.InvalidArgument(f"max_size {info.max_size} is below size {info.size}")
        if old is not None and old.spec != r.spec:
            raise errors.Conflict(f"pool {r.name} exists with another spec; close it first")
        limit = self.settings.pools_per_tenant
        if old is None and sum(p.tenant == tenant for p, _ in self.pools.items.values()) >= limit:
            raise errors.QuotaExceeded(
                f"tenant {tenant} has {limit} pools, the most it may; close one first"
            )
        await self.state.put_pool(_key(tenant, r.name), info)
        return self._view(info)

    async def acquire(self, r: AcquireRequest, call: bus.Call) -> AcquireResponse:
        tenant = call.tenant
        pool = self._require(tenant, r.name)
        taken: list[SandboxInfo] = []
        for info, rev in self._idle(tenant, r.name):
            if len(taken) == r.count:
                break
            with suppress(errors.Conflict):  # another caller took it
                out = info.model_copy(update={"in_pool": False})
                await self._record(out, rev)
                taken.append(out)
        missing = r.count - len(taken)
        if missing:
            self._misses[_key(tenant, r.name)].append((time.monotonic(), missing))
            made = await self.create(  # the tenant's quota holds here too
                tenant, CreateRequest(spec=pool.spec, count=missing), pool=r.name
            )
            taken += made.sandboxes
        return AcquireResponse(sandboxes=taken, from_pool=r.count - missing)

    async def release(self, r: ReleaseRequest, call: bus.Call) -> DestroyResponse:
        """Reset each sandbox and return it to the pool; ``destroyed`` lists those that
        could not be reset (or found the pool full) and were destroyed instead."""
        tenant = call.tenant
        pool = self._require(tenant, r.name)
        infos = [await self.registry.lookup(tenant, sid) for sid in dict.fromkeys(r.ids)]
        for info in infos:
            if info.pool != r.name:
                raise errors.InvalidArgument(f"sandbox {info.id} is not from pool {r.name}")
        room = pool.max_size - len(self._idle(tenant, r.name))
        results = await asyncio.gather(*(self._reset(i) for i in infos[:room]))
        drop = [i for i, ok in zip(infos, results, strict=False) if not ok] + infos[room:]
        if drop:
            await self.destroy_all(drop)
        return DestroyResponse(destroyed=[i.id for i in drop])

    async def close(self, r: PoolCloseRequest, call: bus.Call) -> DestroyResponse:
        tenant = call.tenant
        await self.state.delete_pool(_key(tenant, r.name))
        self.pools.items.pop(_key(tenant, r.name), None)  # a refill in flight sees it gone
        idle = [info for info, _ in self._idle(tenant, r.name)]
        return DestroyResponse(destroyed=await self.destroy_all(idle))

    # -- filling -----------------------------------------------------------------------------

    async def refill(self) -> None:
        """Bring every pool to its target (in steps), one apiserver per pool at a time."""
        for key, (pool, rev) in list(self.pools.items.items()):
            if key in self._fills:
                continue
            want = self.target(pool) - len(self._idle(pool.tenant, pool.name))
            if want <= 0:
                continue
            try:  # the claim: rewriting the record at its revision; a second apiserver loses
                await self.state.cas_pool(
                    key, pool.model_copy(update={"target": self.target(pool)}), rev
                )
            except Exception:
                continue
            room = self.quota_room(pool.tenant, pool.spec)
            count = min(want, FILL_STEP, want if room is None else room)
            if count > 0:
                self._fills[key] = asyncio.create_task(self._fill(key, pool, count))

    async def _fill(self, key: str, pool: PoolInfo, count: int) -> None:
        try:
            made = await self.create(  # only into room free now, in quota
                pool.tenant, CreateRequest(spec=pool.spec, count=count, wait_s=0),
                pool=pool.name, in_pool=True,
            )  # fmt: skip
            if self._pool(pool.tenant, pool.name) is None:  # closed meanwhile
                await self.destroy_all(made.sandboxes)
        except (errors.CapacityExceeded, errors.QuotaExceeded) as exc:
            log.debug("pool %s of %s not filled now: %s", pool.name, pool.tenant, exc)
        except errors.DsecError as exc:
            log.warning("filling pool %s of %s failed: %s", pool.name, pool.tenant, exc)
        finally:
            self._fills.pop(key, None)

    async def stop(self) -> None:
        for task in list(self._fills.values()):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    def target(self, pool: PoolInfo) -> int:
        misses = self._misses[_key(pool.tenant, pool.name)]
        while misses and misses[0][0] < time.monotonic() - DEMAND_WINDOW_S:
            misses.popleft()
        return min(pool.max_size, pool.size + sum(n for _, n in misses))

    # -- helpers -----------------------------------------------------------------------------

    async def _reset(self, info: SandboxInfo) -> bool:
        backend = next(
            (b for v in self.views.values() if (b := v.info.backend(info.backend))), None
        )
        if backend is None or not backend.capabilities.restore:
            return False
        data = RestoreRequest(sandbox_id=info.id).model_dump_json().encode()
        try:
            await self.edges.call(info.node, "restore", data, self.settings.edge_timeout_s)
            hit = self.registry.items.get(info.id)
            if hit is None:
                return False
            await self._record(hit[0].model_copy(update={"in_pool": True}), hit[1])
            return True
        except errors.DsecError as exc:
            log.info("could not reset %s for its pool (%s): destroying it", info.id, exc)
            return False

    async def _record(self, info: SandboxInfo, rev: int) -> None:
        """Write the record if still at ``rev`` (else Conflict); mirror it at once."""
        new_rev = await self.state.cas_sandbox(info, rev)
        self.registry.record([info], {info.id: new_rev})

    def _idle(self, tenant: str, name: str) -> list[tuple[SandboxInfo, int]]:
        items = self.registry.items
        hits = (items.get(sid) for sid in list(self._members.get(_key(tenant, name), ())))
        return [hit for hit in hits if hit is not None and hit[0].state in LIVE]

    def _pool(self, tenant: str, name: str) -> PoolInfo | None:
        return self.pools.get(_key(tenant, name))

    def _require(self, tenant: str, name: str) -> PoolInfo:
        pool = self._pool(tenant, name)
        if pool is None:
            raise errors.NotFound(f"no pool {name!r}: open it first (`await client.pool(...)`)")
        return pool

    def _view(self, pool: PoolInfo) -> PoolInfo:
        idle = len(self._idle(pool.tenant, pool.name))
        return pool.model_copy(update={"target": self.target(pool), "idle": idle})


def _key(tenant: str, name: str) -> str:
    return f"{tenant}.{name}"
